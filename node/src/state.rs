//! A sandbox's lifecycle state and the one table of allowed transitions.

pub use silk_api::SandboxState;

use SandboxState::*;

pub const ALL: [SandboxState; 5] = [Warm, Claimed, Hibernated, Archived, Released];

/// The transition table, on the API's states.
pub trait Transitions: Sized {
    /// Whether the table allows it. Everything not listed is refused.
    fn can_become(self, to: Self) -> bool;
    fn transition(self, to: Self) -> Result<Self, String>;
}

impl Transitions for SandboxState {
    fn can_become(self, to: SandboxState) -> bool {
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

    fn transition(self, to: SandboxState) -> Result<SandboxState, String> {
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
