//! The claim path: admission against `max_claims` and the disk reserve, a warm sandbox from
//! the pool or a new one (clone, else cold boot), the journal commit that acknowledges it.

use super::*;

impl Node {
    /// A claim served here: a warm sandbox, else a clone of the golden, else a cold boot.
    pub async fn claim(self: &Arc<Self>, spec: ClaimSpec) -> Result<Claimed, NodeError> {
        let claimed = self.claim_or_place(spec, false).await?;
        Ok(claimed.expect("no peer was offered"))
    }

    /// A claim, or `None` when a peer should serve it: `peer_has_warm` says one has a warm
    /// sandbox for it, and this node has none it may hand out (none ready, full, or draining).
    /// The choice and the pop are one critical section, so a sandbox is never both promised
    /// elsewhere and taken here; a warm claim holds the state lock only for such short steps,
    /// never across an await.
    pub async fn claim_or_place(
        self: &Arc<Self>,
        spec: ClaimSpec,
        peer_has_warm: bool,
    ) -> Result<Option<Claimed>, NodeError> {
        let t0 = Instant::now();
        let mut spec = spec;
        self.settle_egress(&mut spec)?;
        let key = PoolKey { template: spec.template.clone(), size: spec.size, lane: spec.lane };
        // Copies of checkpoints give way first when the disk is short (one lock when none
        // are kept, a statfs when some are): the reserve is checked under the lock below.
        self.make_room().await;
        let (admitted, warm, idle) = {
            let mut st = self.lock();
            let draining = self.draining.load(Ordering::Relaxed);
            let full = st.slots.len() + st.pending >= self.cfg.max_claims;
            let ready = st.pools.get(&key).is_some_and(|p| !p.ready.is_empty());
            if peer_has_warm && (draining || full || !ready) {
                return Ok(None);
            }
            if draining {
                return Err(NodeError::new(
                    Code::Draining,
                    "this node is draining and takes no new claims",
                ));
            }
            if !self.template_known(&st, &spec.template) {
                let name = &spec.template;
                return Err(NodeError::new(
                    Code::TemplateNotFound,
                    format!("no template {name:?}"),
                ));
            }
            // Served here: not below the disk reserve (one statfs, under the lock so that no
            // warm sandbox is popped first).
            self.disk_reserve()?;
            let admitted = self.admit(&mut st, 1, spec.tenant.as_deref())?;
            let pool = st.pools.get_mut(&key);
            let idle = pool.as_ref().and_then(|p| p.idle_hibernate);
            (admitted, pool.and_then(|p| p.take(Instant::now())), idle)
        };
        let memory_golden = self.lock().pools.get(&key).is_some_and(|p| p.memory_golden);
        let result = self.finish_claim(spec, key, warm, idle, admitted, t0).await;
        self.refill.notify_one();
        if let Ok(claimed) = &result
            && claimed.record.tier != Tier::Warm
        {
            // The golden is built on first need (the pool's kind: a memory pool's miss may
            // have cloned the files golden), so the next claim of this template clones it.
            let (node, template) = (self.clone(), claimed.record.template.clone());
            tokio::spawn(async move {
                if let Err(e) = node.golden_of(&template, memory_golden).await {
                    tracing::warn!(template, "golden build failed: {e}");
                }
            });
        }
        result.map(Some)
    }

    /// Answers 507 while the data directory's filesystem has less than `min_free_mib` free.
    pub(crate) fn disk_reserve(&self) -> Result<(), NodeError> {
        let min = self.cfg.min_free_mib.saturating_mul(1 << 20);
        match free_bytes(&self.cfg.data_dir) {
            Some(free) if free < min => Err(NodeError::new(
                Code::InsufficientStorage,
                format!(
                    "the node's disk has {} MiB free, less than its reserve of {} MiB",
                    free >> 20,
                    self.cfg.min_free_mib
                ),
            )),
            _ => Ok(()),
        }
    }

    /// [`Node::disk_reserve`], once the checkpoints' copies kept here have given way if that
    /// makes the room (see `make_room`).
    pub(crate) async fn room_on_disk(&self) -> Result<(), NodeError> {
        self.make_room().await;
        self.disk_reserve()
    }

    /// Counts `n` claims in flight until the returned guard drops, or answers 429 when the
    /// node is full or `tenant` would pass its `max_sandboxes` (its live sandboxes here, in
    /// flight here, and on its peers as they last said). `st` is this node's state, locked (the
    /// guard locks it again to drop).
    pub(super) fn admit(
        &self,
        st: &mut State,
        n: usize,
        tenant: Option<&str>,
    ) -> Result<Admission<'_>, NodeError> {
        if st.slots.len() + st.pending + n > self.cfg.max_claims {
            return Err(NodeError::new(
                Code::NodeFull,
                format!("this node holds its maximum of {} claims", self.cfg.max_claims),
            ));
        }
        if let Some(t) = tenant {
            // A tenant deleted meanwhile has no room at all.
            let limits = self.tenants.get(t).map(|r| r.limits);
            let max = limits.map_or(0, |l| l.max_sandboxes);
            let elsewhere = self.fleet().map_or(0, |f| f.tenant_sandboxes(t));
            let live = st.tenant_live(t) as u64 + elsewhere;
            if live + n as u64 > max {
                return Err(NodeError::new(
                    Code::QuotaExceeded,
                    format!("tenant {t} has {live} live sandboxes of its max_sandboxes {max}"),
                ));
            }
            if let Some(max) = limits.and_then(|l| l.max_sandbox_seconds) {
                let used = self.tenant_month_seconds(t);
                if used >= max {
                    return Err(NodeError::new(
                        Code::QuotaExceeded,
                        format!(
                            "tenant {t} used {used} of its max_sandbox_seconds {max} this month"
                        ),
                    ));
                }
            }
            *st.pending_by_tenant.entry(t.to_string()).or_default() += n;
        }
        st.pending += n;
        Ok(Admission { node: self, n, tenant: tenant.map(str::to_string) })
    }

    /// `host`, a configured template, a promoted or a registered one.
    pub(super) fn template_known(&self, st: &State, name: &str) -> bool {
        name == "host"
            || self.cfg.templates.contains_key(name)
            || st.promoted.contains_key(name)
            || self.images.registered(name).is_some()
    }

    pub(super) async fn finish_claim(
        &self,
        spec: ClaimSpec,
        key: PoolKey,
        warm: Option<Ready>,
        idle_hibernate_seconds: Option<u64>,
        admitted: Admission<'_>,
        t0: Instant,
    ) -> Result<Claimed, NodeError> {
        let (info, tier, agent) = match warm {
            Some(Ready { info, agent }) => (info, Tier::Warm, agent),
            None => {
                // Refills wait while this start runs (see `foreground`).
                let _start = self.foreground.start();
                let id: SandboxId = self.new_id()?;
                let box_spec = BoxSpec::new(key.size, key.lane);
                let engine = self.engine.clone();
                let golden = {
                    let st = self.lock();
                    // A pool miss clones the pool's own kind of golden where it is there.
                    let memory = st.pools.get(&key).is_some_and(|p| p.memory_golden);
                    let memory_golden = st.memory_goldens.get(&spec.template).filter(|_| memory);
                    memory_golden.or(st.goldens.get(&spec.template)).cloned()
                };
                match golden {
                    Some(g) => (
                        blocking(move || engine.clone_golden(&g, &id, &box_spec)).await?,
                        Tier::Clone,
                        None,
                    ),
                    None => {
                        let t = self.template(&spec.template).await?;
                        let info = blocking(move || engine.boot(&t, &id, &box_spec)).await?;
                        (info, Tier::Cold, None)
                    }
                }
            }
        };
        let token = new_token();
        let mut record = new_record(&info, &token, &spec, tier);
        record.idle_hibernate_seconds = idle_hibernate_seconds;
        self.acknowledge(vec![(record.clone(), info)], admitted).await?;
        if let Some(agent) = agent
            && let Some(live) = self.lock().slots.claim(&record.id)
        {
            live.activity.keep_ahead(agent);
        }
        let took = t0.elapsed();
        self.metrics.claimed(tier, took);
        Ok(Claimed { record, token, took })
    }

    /// Journals new claims on running sandboxes, all or none, and makes them visible. On a
    /// journal failure the sandboxes are destroyed: nothing unacknowledged outlives the call.
    /// They stop counting as admitted in the same critical section.
    pub(super) async fn acknowledge(
        &self,
        claims: Vec<(ClaimRecord, BoxInfo)>,
        mut admitted: Admission<'_>,
    ) -> Result<(), NodeError> {
        let changes = claims.iter().map(|(r, _)| Change::Put(r.id.clone(), r.into())).collect();
        if let Err(e) = self.journal.commit(changes).await {
            for (_, info) in claims {
                self.teardown(info.id);
            }
            return Err(NodeError::internal(format!("journal: {e}")));
        }
        let lives: Vec<Live> = claims
            .into_iter()
            .map(|(record, info)| {
                let live = Live::new(record, &info);
                // The connection its start found silkd ready on: its first relay takes it.
                if let Some(answered) = self.answered(&info) {
                    live.activity.keep_ahead(answered);
                }
                live
            })
            .collect();
        let mut st = self.lock();
        for live in lives {
            st.slots.insert_claim(live.record.id.clone(), live);
        }
        admitted.settle(&mut st);
        Ok(())
    }
}

/// The record of a fresh claim on `info`.
pub(super) fn new_record(info: &BoxInfo, token: &str, spec: &ClaimSpec, tier: Tier) -> ClaimRecord {
    let now = now_ms();
    ClaimRecord {
        id: info.id.to_string(),
        token_hash: hash_token(token),
        template: spec.template.clone(),
        size: spec.size,
        lane: spec.lane,
        tier,
        phase: Phase::Running,
        created_ms: now,
        deadline_ms: now + spec.ttl_seconds * 1000,
        on_expire: spec.on_expire,
        metadata: spec.metadata.clone(),
        lease_seconds: spec.ttl_seconds,
        idle_hibernate_seconds: None,
        from_checkpoint: None,
        forked_from: None,
        state_since_ms: now,
        intent: None,
        tenant: spec.tenant.clone(),
        egress: spec.egress.clone().filter(|_| spec.lane == silk_engine::Lane::Egress),
        previews: vec![],
    }
}
