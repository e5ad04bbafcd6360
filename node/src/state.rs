//! A sandbox's lifecycle state and the one table of allowed transitions.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SandboxState {
    /// Ready in a pool, owned by nobody.
    Warm,
    /// Owned by a client under a lease.
    Claimed,
    /// Stopped with its files kept on this node.
    Hibernated,
    /// Stopped with its files in the object store.
    Archived,
    /// Gone. Terminal.
    Released,
}

use SandboxState::*;

pub const ALL: [SandboxState; 5] = [Warm, Claimed, Hibernated, Archived, Released];

impl SandboxState {
    /// The transition table. Everything not listed is refused.
    pub fn can_become(self, to: SandboxState) -> bool {
        matches!(
            (self, to),
            (Warm, Claimed)
                | (Warm, Released)
                | (Claimed, Hibernated)
                | (Claimed, Archived)
                | (Claimed, Released)
                | (Hibernated, Claimed)
                | (Hibernated, Archived)
                | (Hibernated, Released)
                | (Archived, Claimed)
                | (Archived, Released)
        )
    }

    pub fn transition(self, to: SandboxState) -> Result<SandboxState, String> {
        if self.can_become(to) {
            Ok(to)
        } else {
            Err(format!("a {self:?} sandbox cannot become {to:?}"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_transition_table_is_exactly_this() {
        let allowed = [
            (Warm, Claimed),
            (Warm, Released),
            (Claimed, Hibernated),
            (Claimed, Archived),
            (Claimed, Released),
            (Hibernated, Claimed),
            (Hibernated, Archived),
            (Hibernated, Released),
            (Archived, Claimed),
            (Archived, Released),
        ];
        for from in ALL {
            for to in ALL {
                assert_eq!(
                    from.can_become(to),
                    allowed.contains(&(from, to)),
                    "{from:?} -> {to:?}"
                );
                assert_eq!(from.transition(to).is_ok(), allowed.contains(&(from, to)));
            }
        }
        assert!(ALL.iter().all(|s| !Released.can_become(*s)), "released is terminal");
    }
}
