//! Background ends: leases that ran out, idle sandboxes hibernated, long-hibernated ones
//! archived, archives past their retention deleted, and the store's garbage collected.

use super::*;

impl Node {
    /// What the reaper should do with a sandbox now, if anything.
    pub(super) fn due(&self, live: &Live, now: u64) -> Option<Due> {
        let r = &live.record;
        if matches!(r.intent, Some(crate::claims::Intent::Move { .. })) {
            return None; // settled with the target first
        }
        let since = now.saturating_sub(r.state_since_ms) / 1000;
        let retention = |s: &u64| since >= *s;
        if r.deadline_ms <= now {
            match (r.on_expire, r.state()) {
                (OnExpire::Archive, SandboxState::Archived) => {
                    return self
                        .cfg
                        .archive_retention_seconds
                        .filter(retention)
                        .map(|_| Due::Release);
                }
                (OnExpire::Archive, _) => return Some(Due::Archive),
                (OnExpire::Destroy, _) => return Some(Due::Release),
                (OnExpire::Hibernate, SandboxState::Claimed) => return Some(Due::Hibernate),
                // Asleep: from here on as any hibernated sandbox (archived after
                // `archive_after_seconds`, released after the retention).
                (OnExpire::Hibernate, _) => {}
            }
        }
        match r.state() {
            SandboxState::Claimed => {
                let idle_ms = now.saturating_sub(live.activity.last_ms.load(Ordering::Relaxed));
                let open = live.activity.open.load(Ordering::Relaxed);
                r.idle_hibernate_seconds
                    .filter(|s| open == 0 && idle_ms >= s.saturating_mul(1000))
                    .map(|_| Due::Hibernate)
            }
            SandboxState::Hibernated => {
                self.cfg.archive_after_seconds.filter(|s| since >= *s).map(|_| Due::Archive)
            }
            SandboxState::Archived => {
                self.cfg.archive_retention_seconds.filter(retention).map(|_| Due::Release)
            }
            SandboxState::Warm | SandboxState::Released => None,
        }
    }

    /// Ends every lease that ran out (`destroy`, or `archive`), hibernates idle sandboxes,
    /// archives long-hibernated ones and deletes archives past their retention. Each decision
    /// is made again under the sandbox's lifecycle lock: a call that got there first (a wake, a
    /// renew) wins.
    pub(super) async fn reap(&self) {
        let now = now_ms();
        let due: Vec<String> = {
            let st = self.lock();
            let later = Instant::now();
            st.slots
                .claims()
                .filter(|l| st.slots.retry_at(&l.record.id).is_none_or(|t| later >= t))
                .filter(|l| self.due(l, now).is_some())
                .map(|l| l.record.id.clone())
                .collect()
        };
        for id in due {
            let _busy = self.busy(&id).await;
            let Some(live) = self.get(&id) else { continue };
            let Some(work) = self.due(&live, now_ms()) else { continue };
            // Both keep the processes' memory as the sandbox's pool says (default: where they
            // can, as a user's hibernate does).
            let memory = {
                let r = &live.record;
                let key = PoolKey { template: r.template.clone(), size: r.size, lane: r.lane };
                self.lock().pools.get(&key).map_or(silk_engine::Memory::Auto, |p| p.memory)
            };
            let done = match work {
                Due::Release => self.release_locked(&id).await.map(|()| "released"),
                Due::Archive => self.archive_locked(live, memory).await.map(|_| "archived"),
                Due::Hibernate => {
                    let why = if live.record.deadline_ms <= now_ms() { "lease" } else { "idle" };
                    let done = self.hibernate_locked(live, memory).await;
                    done.map(|_| {
                        if why == "lease" { "hibernated (lease)" } else { "hibernated (idle)" }
                    })
                }
            };
            match done {
                Ok(what) => {
                    self.lock().slots.set_retry(&id, None);
                    if matches!(work, Due::Release) {
                        self.metrics.expired.fetch_add(1, Ordering::Relaxed);
                    }
                    tracing::info!(sandbox = id, "{what}");
                }
                Err(e) => {
                    tracing::warn!(sandbox = id, "background {work:?} failed: {e}");
                    let later = Instant::now() + Duration::from_secs(5);
                    self.lock().slots.set_retry(&id, Some(later));
                }
            }
        }
    }
}

#[derive(Debug, Clone, Copy)]
pub(super) enum Due {
    Release,
    Archive,
    Hibernate,
}

/// Every `gc_interval_seconds`: deletes archives no claim names, then collects the store's
/// unreferenced chunks (the snapshot store's GC is safe beside uploads and beside other nodes'
/// GCs; see silk-store).
pub(super) async fn gc_loop(node: Arc<Node>) {
    let every = node.cfg.store.gc_interval_seconds;
    if every == 0 {
        return;
    }
    loop {
        // Up to a tenth later, so nodes started together do not all list the store at once.
        let jitter =
            u64::from_str_radix(&crate::claims::random_hex(4), 16).unwrap_or(0) % (every * 100 + 1);
        tokio::time::sleep(Duration::from_millis(every * 1000 + jitter)).await;
        match node.sweep_orphan_archives().await {
            Ok(n) => {
                node.metrics.orphan_archives.fetch_add(n as u64, Ordering::Relaxed);
            }
            Err(e) => tracing::warn!("orphan archive sweep: {e}"),
        }
        match node.store.gc(std::time::SystemTime::now()).await {
            Ok(r) => {
                node.metrics.gc_deleted_chunks.fetch_add(r.deleted as u64, Ordering::Relaxed);
                node.metrics.gc_deleted_bytes.fetch_add(r.deleted_bytes, Ordering::Relaxed);
                tracing::info!(
                    manifests = r.manifests,
                    chunks = r.chunks,
                    deleted = r.deleted,
                    bytes = r.deleted_bytes,
                    "store gc"
                );
            }
            Err(e) => tracing::warn!("store gc: {e}"),
        }
    }
}

pub(super) async fn reap_loop(node: Arc<Node>) {
    loop {
        tokio::time::sleep(REAP_TICK).await;
        node.reap().await;
    }
}

/// Re-reads the fleet's tenants (and its registered templates) every `tenant_refresh_ms`. A tenant that is gone (deleted on
/// any node) leaves nothing behind here: its sandboxes are released and its promoted templates
/// deleted. A tenant never seen is not "gone": a node that starts with the store down releases
/// nothing.
pub(super) async fn tenants_loop(node: Arc<Node>) {
    let every = Duration::from_millis(node.cfg.tenant_refresh_ms.max(100));
    loop {
        tokio::time::sleep(every).await;
        match node.tenants.refresh().await {
            Ok(gone) => {
                for tenant in gone {
                    node.clear_tenant(&tenant).await;
                }
            }
            Err(e) => tracing::debug!("tenants: {e}; authenticating from the records in memory"),
        }
        node.refresh_registered().await;
    }
}

impl Node {
    /// Live sandboxes of `tenant` in the fleet: here (and in flight here), and on the other
    /// nodes as they last said.
    pub fn tenant_sandboxes(&self, tenant: &str) -> u64 {
        let here = self.lock().tenant_live(tenant) as u64;
        here + self.fleet().map_or(0, |f| f.tenant_sandboxes(tenant))
    }

    /// After `tenant` was deleted here: its checkpoints and registered templates go from the
    /// store, and this node's share of its sandboxes and templates goes at once (the others' as
    /// they learn of it).
    pub async fn forget_tenant(&self, tenant: &str) -> Result<(), NodeError> {
        for ck in self.checkpoints(None, Some(tenant)).await? {
            self.delete_checkpoint(&ck.id).await?;
        }
        // Its registered templates are the fleet's records: they go from the store here, those
        // this node has not read yet too.
        for name in self.images.stored_under(&format!("{tenant}/")).await? {
            self.unregister_template(&name).await?;
        }
        self.clear_tenant(tenant).await;
        Ok(())
    }

    /// Releases every sandbox of `tenant` this node holds and deletes its promoted templates.
    /// How many sandboxes it released.
    pub async fn clear_tenant(&self, tenant: &str) -> usize {
        let ids: Vec<String> = self
            .lock()
            .slots
            .claims()
            .filter(|l| l.record.tenant.as_deref() == Some(tenant))
            .map(|l| l.record.id.clone())
            .collect();
        let mut released = 0;
        for id in ids {
            match self.release(&id).await {
                Ok(()) => released += 1,
                Err(e) => tracing::warn!(
                    sandbox = id,
                    tenant,
                    "releasing a deleted tenant's sandbox: {e}"
                ),
            }
        }
        let prefix = format!("{tenant}/");
        let promoted: Vec<String> =
            self.lock().promoted.keys().filter(|n| n.starts_with(&prefix)).cloned().collect();
        for name in promoted {
            if let Err(e) = self.delete_template(&name) {
                tracing::warn!(template = name, "deleting a deleted tenant's template: {e}");
            }
        }
        released
    }
}

/// Meters the running sandboxes into the usage journal every `usage_interval_seconds`.
pub(super) async fn usage_loop(node: Arc<Node>) {
    let every = Duration::from_secs(node.cfg.usage_interval_seconds.max(1));
    loop {
        tokio::time::sleep(every).await;
        let records: Vec<ClaimRecord> =
            node.lock().slots.claims().map(|l| l.record.clone()).collect();
        node.meter(&records, &[]);
    }
}

impl Node {
    /// Meters `records` up to now (those that stopped running, up to when they stopped);
    /// `released` are metered for the last time.
    pub(super) fn meter(&self, records: &[ClaimRecord], released: &[String]) {
        let running: Vec<crate::usage::Running> = records
            .iter()
            .map(|r| crate::usage::Running {
                id: r.id.clone(),
                tenant: r.tenant.clone(),
                size: r.size,
                lane: r.lane,
                since_ms: r.state_since_ms,
                until_ms: (r.state() != SandboxState::Claimed).then_some(r.state_since_ms),
            })
            .collect();
        if let Err(e) = self.usage.meter(&running, released, now_ms()) {
            tracing::warn!("usage journal: {e}");
        }
    }

    /// Sandbox-seconds of `tenant` this calendar month: here, and on the other nodes as they
    /// last said.
    pub fn tenant_month_seconds(&self, tenant: &str) -> u64 {
        self.usage.month_seconds(tenant) + self.fleet().map_or(0, |f| f.tenant_seconds(tenant))
    }
}
