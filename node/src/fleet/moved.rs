//! Where this node moved sandboxes, for a while after: while the peer that took one is out of
//! reach (paused, restarting, not yet admitted again), a call for it here is "try again", not
//! "no such sandbox" (which the SDK takes for released).

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

#[derive(Debug)]
pub(super) struct MovedAway {
    ttl: Duration,
    /// Sandbox id → the peer it went to, and when.
    to: Mutex<HashMap<String, (String, Instant)>>,
}

impl MovedAway {
    pub fn new(ttl: Duration) -> MovedAway {
        MovedAway { ttl, to: Mutex::default() }
    }

    /// Notes that sandbox `id` went to `peer` now (and forgets what is past the ttl).
    pub fn record(&self, id: &str, peer: &str) {
        let mut to = self.lock();
        to.retain(|_, (_, at)| at.elapsed() < self.ttl);
        to.insert(id.to_string(), (peer.to_string(), Instant::now()));
    }

    /// The peer `id` went to, within the ttl.
    pub fn peer_of(&self, id: &str) -> Option<String> {
        let to = self.lock();
        to.get(id).filter(|(_, at)| at.elapsed() < self.ttl).map(|(peer, _)| peer.clone())
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<String, (String, Instant)>> {
        self.to.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_move_is_remembered_for_its_ttl_only() {
        let moved = MovedAway::new(Duration::from_millis(50));
        moved.record("sb-1", "b");
        assert_eq!(moved.peer_of("sb-1").as_deref(), Some("b"));
        assert_eq!(moved.peer_of("sb-2"), None);
        moved.record("sb-1", "c");
        assert_eq!(moved.peer_of("sb-1").as_deref(), Some("c"));
        std::thread::sleep(Duration::from_millis(60));
        assert_eq!(moved.peer_of("sb-1"), None, "remembered past its ttl");
        moved.record("sb-2", "b");
        assert_eq!(moved.lock().len(), 1, "an expired entry was kept");
    }
}
