//! Warm pools: their configuration (from the config file, replaced at run time and kept in
//! `pools.json`) and the refill that keeps each at its target.

use super::*;

impl Node {
    pub(super) fn set_pool_configs(&self, pools: &[PoolConfig]) {
        let mut st = self.lock();
        let mut next = BTreeMap::new();
        for p in pools {
            let key = PoolKey { template: p.template.clone(), size: p.size, lane: p.lane };
            let mut pool = st.pools.remove(&key).unwrap_or_else(|| {
                Pool::new(key.clone(), p.warm, p.warm_max.unwrap_or(p.warm * 2))
            });
            if pool.memory_golden != p.memory_golden {
                // Its warm sandboxes came from the other golden.
                for ready in pool.flush() {
                    self.teardown(ready.info.id);
                }
            }
            pool.warm = p.warm;
            pool.idle_hibernate = p.idle_hibernate_seconds;
            pool.memory = p.memory;
            pool.memory_golden = p.memory_golden;
            pool.egress = p.egress.clone();
            pool.warm_max = p.warm_max.unwrap_or(p.warm * 2).max(p.warm);
            pool.target = pool.target.clamp(pool.warm, pool.warm_max);
            next.insert(key, pool);
        }
        // Pools no longer configured: their warm sandboxes go away.
        for (_, pool) in std::mem::take(&mut st.pools) {
            for ready in pool.ready {
                self.teardown(ready.info.id);
            }
        }
        st.pools = next;
        drop(st);
        self.refill.notify_one();
    }

    pub fn pool_configs(&self) -> Vec<PoolConfig> {
        self.lock()
            .pools
            .values()
            .map(|p| PoolConfig {
                template: p.key.template.clone(),
                size: p.key.size,
                lane: p.key.lane,
                warm: p.warm,
                warm_max: Some(p.warm_max),
                idle_hibernate_seconds: p.idle_hibernate,
                memory: p.memory,
                memory_golden: p.memory_golden,
                egress: p.egress.clone(),
            })
            .collect()
    }

    /// Replaces the pools at runtime and persists them for the next start.
    pub fn replace_pools(&self, pools: Vec<PoolConfig>) -> Result<(), NodeError> {
        let mut probe = self.cfg.clone();
        // Promoted templates are not in the config file; validate the others.
        let promoted = self.lock().promoted.clone();
        probe.pools =
            pools.iter().filter(|p| !promoted.contains_key(&p.template)).cloned().collect();
        probe.validate().map_err(|e| NodeError::new(Code::Invalid, e.to_string()))?;
        let json =
            serde_json::to_vec_pretty(&pools).map_err(|e| NodeError::internal(e.to_string()))?;
        crate::durable::replace(&self.cfg.data_dir.join("pools.json"), &json)
            .map_err(|e| NodeError::internal(format!("persist pools: {e}")))?;
        self.set_pool_configs(&pools);
        Ok(())
    }

    /// Starts whatever the pools are missing.
    pub(super) fn refill_once(self: &Arc<Self>) {
        if self.draining.load(Ordering::Relaxed) {
            return;
        }
        let now = Instant::now();
        let mut starts = vec![];
        for pool in self.lock().pools.values_mut() {
            let n = pool.wanted(now);
            pool.starting += n;
            starts.extend(std::iter::repeat_n((pool.key.clone(), pool.generation()), n));
        }
        for (key, generation) in starts {
            let node = self.clone();
            tokio::spawn(async move {
                let started = node.start_warm(&key).await;
                // Off the claim's path: the relay a claim opens takes this connection.
                let agent = match &started {
                    Ok(info) => match node.answered(info) {
                        Some(answered) => Some(answered),
                        None => super::connect_agent(&info.agent).await.ok(),
                    },
                    Err(_) => None,
                };
                let mut st = node.lock();
                let Some(pool) = st.pools.get_mut(&key) else {
                    // The pool was removed meanwhile.
                    if let Ok(info) = started {
                        node.teardown(info.id);
                    }
                    return;
                };
                match started {
                    Ok(info) => {
                        if let Some(stale) = pool.started(Ready { info, agent }, generation) {
                            node.teardown(stale.info.id);
                            drop(st);
                            node.refill.notify_one();
                        }
                    }
                    Err(e) => {
                        tracing::warn!(pool = %key, "refill failed: {e}");
                        node.metrics.refill_failures.fetch_add(1, Ordering::Relaxed);
                        pool.start_failed(Instant::now());
                    }
                }
            });
        }
    }

    pub(super) async fn start_warm(&self, key: &PoolKey) -> Result<BoxInfo, NodeError> {
        self.room_on_disk().await?;
        let memory_golden = self.lock().pools.get(key).is_some_and(|p| p.memory_golden);
        let golden = self.golden_of(&key.template, memory_golden).await?;
        // Before the permit: a refill giving way holds up no teardown.
        self.foreground.give_way().await;
        let _permit =
            self.background.acquire().await.map_err(|e| NodeError::internal(e.to_string()))?;
        let id: SandboxId = self.new_id()?;
        let (engine, spec) = (self.engine.clone(), BoxSpec::new(key.size, key.lane));
        blocking(move || engine.clone_golden(&golden, &id, &spec)).await
    }
}

/// A warm sandbox as its pool keeps it.
#[derive(Debug)]
pub(super) struct Ready {
    pub(super) info: BoxInfo,
    /// A connection to its silkd, opened while it waits: its claim keeps it for the first
    /// relay (`Activity::take_ahead`).
    pub(super) agent: Option<UnixStream>,
}

pub(super) fn load_pools(cfg: &Config) -> anyhow::Result<Vec<PoolConfig>> {
    let path = cfg.data_dir.join("pools.json");
    match std::fs::read(&path) {
        Ok(bytes) => Ok(serde_json::from_slice(&bytes)?),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(cfg.pools.clone()),
        Err(e) => Err(e.into()),
    }
}

pub(super) async fn refill_loop(node: Arc<Node>) {
    loop {
        node.refill_once();
        tokio::select! {
            () = node.refill.notified() => tokio::time::sleep(REFILL_SETTLE).await,
            () = tokio::time::sleep(REFILL_TICK) => {}
        }
    }
}
