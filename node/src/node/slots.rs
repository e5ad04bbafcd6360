//! One slot per sandbox id: its claim, its lifecycle lock, its retry time and whether it is
//! being adopted here, in one entry that exists while any of them is in use and goes with the
//! last (so no per-id table outgrows the ids in use).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use super::Live;

/// Everything the node keeps for one sandbox id.
#[derive(Debug, Default)]
struct Slot {
    /// The claim, once acknowledged.
    live: Option<Live>,
    /// Lifecycle calls on the sandbox run one at a time. Cloned only under the state lock.
    lock: Arc<tokio::sync::Mutex<()>>,
    /// Background lifecycle work (idle hibernate, archive) that failed waits until then.
    retry_at: Option<Instant>,
    /// Being started here (a move or a wake anywhere), not yet journalled.
    adopting: bool,
}

impl Slot {
    fn unused(&self) -> bool {
        self.live.is_none() && !self.adopting && Arc::strong_count(&self.lock) == 1
    }
}

#[derive(Debug, Default)]
pub(super) struct Slots {
    by_id: HashMap<String, Slot>,
    /// Slots holding a claim.
    claimed: usize,
}

impl Slots {
    /// Claims held.
    pub(super) fn len(&self) -> usize {
        self.claimed
    }

    /// Slots in use (claims, locks held or awaited, adoptions).
    pub(super) fn slots(&self) -> usize {
        self.by_id.len()
    }

    pub(super) fn claim(&self, id: &str) -> Option<&Live> {
        self.by_id.get(id)?.live.as_ref()
    }

    pub(super) fn claim_mut(&mut self, id: &str) -> Option<&mut Live> {
        self.by_id.get_mut(id)?.live.as_mut()
    }

    pub(super) fn claims(&self) -> impl Iterator<Item = &Live> {
        self.by_id.values().filter_map(|s| s.live.as_ref())
    }

    pub(super) fn insert_claim(&mut self, id: String, live: Live) {
        let slot = self.by_id.entry(id).or_default();
        if slot.live.replace(live).is_none() {
            self.claimed += 1;
        }
    }

    /// Takes the claim out (its retry time with it); the slot goes if nothing else uses it.
    pub(super) fn remove_claim(&mut self, id: &str) -> Option<Live> {
        let slot = self.by_id.get_mut(id)?;
        let live = slot.live.take()?;
        slot.retry_at = None;
        self.claimed -= 1;
        self.tidy(id);
        Some(live)
    }

    /// Replaces every claim (the reconcile at start, before any call runs).
    pub(super) fn set_claims(&mut self, claims: HashMap<String, Live>) {
        self.by_id.clear();
        self.claimed = claims.len();
        for (id, live) in claims {
            self.by_id.insert(id, Slot { live: Some(live), ..Slot::default() });
        }
    }

    /// The sandbox's lifecycle lock (made on first use).
    pub(super) fn lock(&mut self, id: &str) -> Arc<tokio::sync::Mutex<()>> {
        self.by_id.entry(id.to_string()).or_default().lock.clone()
    }

    /// Whether no lifecycle call holds or awaits the sandbox's lock.
    pub(super) fn free(&self, id: &str) -> bool {
        self.by_id.get(id).is_none_or(|s| s.lock.try_lock().is_ok())
    }

    pub(super) fn retry_at(&self, id: &str) -> Option<Instant> {
        self.by_id.get(id)?.retry_at
    }

    /// Background work on a claimed sandbox waits until `at` (nothing for an unclaimed id).
    pub(super) fn set_retry(&mut self, id: &str, at: Option<Instant>) {
        if let Some(slot) = self.by_id.get_mut(id).filter(|s| s.live.is_some()) {
            slot.retry_at = at;
        }
    }

    pub(super) fn adopting(&self, id: &str) -> bool {
        self.by_id.get(id).is_some_and(|s| s.adopting)
    }

    pub(super) fn set_adopting(&mut self, id: &str, adopting: bool) {
        self.by_id.entry(id.to_string()).or_default().adopting = adopting;
        self.tidy(id);
    }

    /// Removes the slot if nothing uses it any more.
    pub(super) fn tidy(&mut self, id: &str) {
        if self.by_id.get(id).is_some_and(Slot::unused) {
            self.by_id.remove(id);
        }
    }
}
