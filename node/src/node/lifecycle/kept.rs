//! Which checkpoints the engine keeps a copy of on this node (`Engine::write_snapshot`'s
//! `keep`), for their branches here to start without the store, within `checkpoint_copies_mib`:
//! past it the least recently used copy goes. The record lives in memory only: the engine
//! drops every copy when it starts.

use std::collections::HashMap;

use silk_engine::{Lane, Size};

/// One kept copy: its bytes on this disk, what the checkpoint ran as, and the size of its
/// snapshot in the store (a branch takes the copy only for the manifest it was kept beside).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::node) struct Kept {
    pub bytes: u64,
    pub size: Size,
    pub lane: Lane,
    pub snapshot_bytes: u64,
}

#[derive(Debug)]
pub(in crate::node) struct KeptCopies {
    bound: u64,
    used: u64,
    /// Bumped at every use: a copy's last use orders the evictions.
    clock: u64,
    copies: HashMap<String, (Kept, u64)>,
}

impl KeptCopies {
    pub fn new(bound: u64) -> KeptCopies {
        KeptCopies { bound, used: 0, clock: 0, copies: HashMap::new() }
    }

    /// Whether copies are kept at all.
    pub fn on(&self) -> bool {
        self.bound > 0
    }

    /// Records the copy `name`; returns the copies to drop to stay within the bound (the
    /// least recently used first; `name` itself when it alone is past the bound).
    pub fn insert(&mut self, name: String, kept: Kept) -> Vec<String> {
        if kept.bytes > self.bound {
            self.remove(&name);
            return vec![name];
        }
        self.clock += 1;
        self.used += kept.bytes;
        if let Some((old, _)) = self.copies.insert(name, (kept, self.clock)) {
            self.used -= old.bytes;
        }
        let mut dropped = vec![];
        while self.used > self.bound {
            let oldest = self.copies.iter().min_by_key(|(_, (_, last))| *last);
            let Some(oldest) = oldest.map(|(name, _)| name.clone()) else { break };
            self.remove(&oldest);
            dropped.push(oldest);
        }
        dropped
    }

    /// The copy kept as `name`, now the most recently used.
    pub fn touch(&mut self, name: &str) -> Option<Kept> {
        self.clock += 1;
        let (kept, last) = self.copies.get_mut(name)?;
        *last = self.clock;
        Some(*kept)
    }

    pub fn contains(&self, name: &str) -> bool {
        self.copies.contains_key(name)
    }

    pub fn remove(&mut self, name: &str) -> Option<Kept> {
        let (kept, _) = self.copies.remove(name)?;
        self.used -= kept.bytes;
        Some(kept)
    }

    /// Bytes the copies hold.
    pub fn used(&self) -> u64 {
        self.used
    }

    /// Forgets the least recently used copies until they add up to `bytes`, and names them;
    /// none when all of them together hold less (dropping them would not be enough).
    pub fn take_oldest(&mut self, bytes: u64) -> Vec<String> {
        if self.used < bytes {
            return vec![];
        }
        let mut order: Vec<(u64, String)> =
            self.copies.iter().map(|(name, (_, last))| (*last, name.clone())).collect();
        order.sort_unstable();
        let mut taken = vec![];
        let mut freed = 0;
        for (_, name) in order {
            if freed >= bytes {
                break;
            }
            freed += self.remove(&name).map_or(0, |k| k.bytes);
            taken.push(name);
        }
        taken
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn copy(bytes: u64) -> Kept {
        Kept { bytes, size: Size::Small, lane: Lane::None, snapshot_bytes: bytes }
    }

    #[test]
    fn past_the_bound_the_least_recently_used_copies_go_first() {
        let mut kept = KeptCopies::new(100);
        assert!(kept.insert("a".into(), copy(40)).is_empty());
        assert!(kept.insert("b".into(), copy(40)).is_empty());
        // `a` was used after `b` was kept: `b` is the older one now.
        assert_eq!(kept.touch("a"), Some(copy(40)));
        assert_eq!(kept.insert("c".into(), copy(40)), ["b"]);
        assert_eq!(kept.used(), 80);
        assert_eq!(kept.touch("b"), None);
        // A copy past the bound on its own goes at once, and takes no other with it.
        assert_eq!(kept.insert("d".into(), copy(500)), ["d"]);
        assert_eq!(kept.used(), 80);
        assert_eq!(kept.touch("d"), None);
        assert_eq!(kept.touch("a"), Some(copy(40)));
    }

    #[test]
    fn room_is_taken_from_the_least_recently_used_copies_only_when_they_can_make_it() {
        let mut kept = KeptCopies::new(1000);
        for (name, bytes) in [("a", 30), ("b", 50), ("c", 20)] {
            kept.insert(name.into(), copy(bytes));
        }
        kept.touch("a");
        // Needing more than all three hold: none goes.
        assert!(kept.take_oldest(101).is_empty());
        assert_eq!(kept.used(), 100);
        // b then c are the oldest; b alone is not enough for 60.
        assert_eq!(kept.take_oldest(60), ["b", "c"]);
        assert_eq!(kept.used(), 30);
        assert!(kept.contains("a"));
        assert!(kept.take_oldest(0).is_empty());
    }

    #[test]
    fn a_removed_copy_frees_its_bytes_and_a_bound_of_zero_keeps_none() {
        let mut kept = KeptCopies::new(100);
        kept.insert("a".into(), copy(60));
        assert_eq!(kept.remove("a"), Some(copy(60)));
        assert_eq!(kept.used(), 0);
        assert_eq!(kept.insert("b".into(), copy(60)), Vec::<String>::new());
        assert!(kept.on());
        let mut none = KeptCopies::new(0);
        assert!(!none.on());
        assert_eq!(none.insert("a".into(), copy(1)), ["a"]);
    }
}
