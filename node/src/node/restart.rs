//! A node's start and stop. A start re-adopts what the journal says it holds and removes every
//! other sandbox; a stop (SIGTERM) leaves the claims running for the next start and destroys
//! the warm pools, which no start would re-adopt (only claims are journalled): a stopped node
//! leaves nothing of its own behind but its users' sandboxes.

use std::collections::HashSet;

use super::*;

/// How long a stop waits for warm sandboxes still starting before it removes what is there.
const STARTS_GRACE: Duration = Duration::from_secs(10);

impl Node {
    /// Re-adopts claimed sandboxes that are still running, keeps hibernated and archived ones,
    /// finishes or rolls back lifecycle operations a crash interrupted (see `lifecycle`),
    /// removes every other sandbox and forgets claims whose sandbox is gone.
    pub(super) async fn reconcile(
        &self,
        records: BTreeMap<String, ClaimRecord>,
    ) -> anyhow::Result<()> {
        let engine = self.engine.clone();
        let boxes: HashMap<String, BoxInfo> = blocking(move || engine.list())
            .await?
            .into_iter()
            .map(|b| (b.id.to_string(), b))
            .collect();
        let mut kept = HashMap::new();
        let mut changes = vec![];
        for (id, rec) in records {
            // An archive another node woke while this one was away is no longer ours.
            if matches!(rec.phase, Phase::Archived(_))
                && rec.intent.is_none()
                && self.still_archived(&id).await == Some(false)
            {
                tracing::info!(sandbox = id, "woken elsewhere while this node was away");
                changes.push(Change::Delete(id));
                continue;
            }
            match self.recover(rec, boxes.get(&id)).await {
                Some((live, changed)) => {
                    if changed {
                        changes.push(Change::Put(id.clone(), (&live.record).into()));
                    }
                    kept.insert(id, live);
                }
                None => changes.push(Change::Delete(id)),
            }
        }
        // A box is kept only for a claim that runs on it, or is hibernated in it.
        let doomed: Vec<_> = boxes
            .into_values()
            .filter(|b| kept.get(b.id.as_str()).is_none_or(|l: &Live| !l.has_box()))
            .map(|b| b.id)
            .collect();
        // What a start after a stop or a crash did, by id: operators read this after a crash.
        let mut adopted: Vec<String> = kept
            .values()
            .map(|l| {
                let phase = match l.record.phase {
                    Phase::Running => "running",
                    Phase::Stopped | Phase::Captured(_) => "hibernated",
                    Phase::Archived(_) => "archived",
                };
                format!("{} ({phase})", l.record.id)
            })
            .collect();
        adopted.sort();
        let removed: Vec<String> = doomed.iter().map(ToString::to_string).collect();
        tracing::info!(
            kept = kept.len(),
            removed = doomed.len(),
            changed = changes.len(),
            "reconciled"
        );
        if !adopted.is_empty() {
            tracing::info!("re-adopted {} claims: {}", adopted.len(), adopted.join(", "));
        }
        if !removed.is_empty() {
            tracing::info!(
                "removed {} sandboxes no claim holds (warm pools, claims not acknowledged): {}",
                removed.len(),
                removed.join(", ")
            );
        }
        if !changes.is_empty() {
            self.journal.commit(changes).await?;
        }
        let referenced: Vec<PathBuf> = kept
            .values()
            .filter_map(|l| l.record.phase.snapshot().map(|s| s.layer_tar.clone()))
            .collect();
        self.lock().slots.set_claims(kept);
        for id in doomed {
            let engine = self.engine.clone();
            let name = id.to_string();
            // One box that will not go (a cgroup still busy with a dying task) must not keep the
            // node down: it is left for the next start to remove.
            if let Err(e) = blocking(move || engine.destroy(&id)).await {
                tracing::warn!(sandbox = name, "removing a leftover sandbox: {e}");
            }
        }
        lifecycle::sweep_files(&self.cfg, &referenced);
        Ok(())
    }

    /// SIGTERM: no more refills, every warm sandbox (ready or starting) destroyed; claims keep
    /// running. How many sandboxes it destroyed.
    pub async fn stop(&self) -> usize {
        self.set_draining(true);
        {
            let mut st = self.lock();
            // Starts in flight see a new generation and are refused when they finish.
            for pool in st.pools.values_mut() {
                pool.flush();
            }
        }
        let deadline = Instant::now() + STARTS_GRACE;
        while self.lock().pools.values().any(|p| p.starting > 0) && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // Whatever box no claim holds goes: the ready ones, those a start just finished, and
        // any a refused start is tearing down already.
        let held: HashSet<String> = self
            .lock()
            .slots
            .claims()
            .filter(|l| l.has_box())
            .map(|l| l.record.id.clone())
            .collect();
        let engine = self.engine.clone();
        let boxes = blocking(move || engine.list()).await.unwrap_or_default();
        let mut destroyed = 0;
        for b in boxes.into_iter().filter(|b| !held.contains(b.id.as_str())) {
            let engine = self.engine.clone();
            let id = b.id;
            match blocking(move || engine.destroy(&id)).await {
                Ok(()) => destroyed += 1,
                Err(e) => tracing::debug!("stop: removing a warm sandbox: {e}"),
            }
        }
        destroyed
    }
}
