//! What the node says about itself: `/v1/info`, `/metrics`, the state it gossips to peers, and
//! the sizes of its tables.

use super::*;

/// What a node tells its peers: warm sandboxes per pool key, the digests of its goldens and
/// templates, claims against capacity, and whether it drains.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Advert {
    pub warm: BTreeMap<String, u32>,
    pub goldens: Vec<String>,
    pub templates: Vec<String>,
    pub claims: u32,
    pub capacity: u32,
    pub draining: bool,
    /// Live sandboxes here per tenant (claims and those in flight).
    pub tenants: BTreeMap<String, u32>,
    /// Sandbox-seconds here per tenant this calendar month.
    pub tenant_seconds: BTreeMap<String, u64>,
}

impl Node {
    /// The engine's capabilities as `/v1/info` shows them, with why memory is not kept when
    /// it is not (`memory_note`).
    fn capabilities_json(&self) -> serde_json::Value {
        let mut caps = serde_json::to_value(self.engine.capabilities()).unwrap_or_default();
        if let Some(why) = self.engine.memory_why_not() {
            caps["memory_note"] = why.into();
        }
        caps
    }

    /// The node's report (`/v1/info`); the HTTP layer adds its place in the mesh.
    pub fn info(&self) -> silk_api::NodeInfo {
        let st = self.lock();
        let now = Instant::now();
        let pools = st
            .pools
            .values()
            .map(|p| silk_api::PoolStatus {
                template: p.key.template.clone(),
                size: p.key.size,
                lane: p.key.lane,
                warm: p.ready.len() as u64,
                starting: p.starting as u64,
                target: p.target as u64,
                warm_min: p.warm as u64,
                warm_max: p.warm_max as u64,
                golden: if p.memory_golden { &st.memory_goldens } else { &st.goldens }
                    .get(&p.key.template)
                    .map(|g| g.digest.to_string()),
                backing_off: p.backing_off(now),
            })
            .collect();
        silk_api::NodeInfo {
            version: env!("CARGO_PKG_VERSION").to_string(),
            engine: self.engine.name().to_string(),
            capabilities: self.capabilities_json(),
            claims: st.slots.len() as u64,
            max_claims: self.cfg.max_claims as u64,
            draining: self.draining.load(Ordering::Relaxed),
            uptime_ms: self.started.elapsed().as_millis() as u64,
            pools,
            goldens: st.goldens.keys().cloned().collect(),
            name: self.name.clone(),
            mesh: None,
        }
    }

    pub fn render_metrics(&self) -> String {
        let st = self.lock();
        let warm = st
            .pools
            .values()
            .map(|p| (format!("pool=\"{}\"", p.key), p.ready.len() as u64))
            .collect();
        let target =
            st.pools.values().map(|p| (format!("pool=\"{}\"", p.key), p.target as u64)).collect();
        let claims = vec![(String::new(), st.slots.len() as u64)];
        drop(st);
        let mut out = self.metrics.render(&[
            ("silkmesh_pool_warm", "Warm sandboxes ready, by pool.", warm),
            ("silkmesh_pool_target", "Current warm target, by pool.", target),
            ("silkmesh_claims_live", "Claims held on this node.", claims),
            (
                "silkmesh_journal_records",
                "Records in the claims journal.",
                vec![(String::new(), self.journal.len() as u64)],
            ),
            (
                "silkmesh_checkpoint_copies_bytes",
                "Bytes of the checkpoints' copies kept on this node for their branches here.",
                vec![(String::new(), self.kept_bytes())],
            ),
        ]);
        if let Some(egress) = self.egress() {
            crate::egress::render_metrics(egress, &mut out);
        }
        out
    }

    /// Entries in each of the controller's tables (tests check none grows without bound).
    #[doc(hidden)]
    pub fn table_sizes(&self) -> BTreeMap<&'static str, usize> {
        let st = self.lock();
        BTreeMap::from([
            ("claims", st.slots.len()),
            ("pending", st.pending),
            ("slots", st.slots.slots()),
        ])
    }

    /// Warm sandboxes ready for `key` here (0 while draining or full).
    pub fn warm_for(&self, key: &PoolKey) -> usize {
        let st = self.lock();
        if self.draining.load(Ordering::Relaxed)
            || st.slots.len() + st.pending >= self.cfg.max_claims
        {
            return 0;
        }
        st.pools.get(key).map_or(0, |p| p.ready.len())
    }

    /// What this node tells its peers about itself. A draining node advertises no warm capacity.
    pub fn advert(&self) -> Advert {
        let st = self.lock();
        let draining = self.draining.load(Ordering::Relaxed);
        let warm = if draining {
            BTreeMap::new()
        } else {
            st.pools.values().map(|p| (p.key.to_string(), p.ready.len() as u32)).collect()
        };
        let mut goldens: Vec<String> = st
            .goldens
            .values()
            .chain(st.memory_goldens.values())
            .map(|g| g.digest.to_string())
            .collect();
        goldens.sort();
        let mut templates: Vec<String> =
            st.templates.values().map(|t| t.digest.to_string()).collect();
        templates.sort();
        let mut tenants: BTreeMap<String, u32> = BTreeMap::new();
        for t in st.slots.claims().filter_map(|l| l.record.tenant.as_ref()) {
            *tenants.entry(t.clone()).or_default() += 1;
        }
        for (t, n) in &st.pending_by_tenant {
            *tenants.entry(t.clone()).or_default() += *n as u32;
        }
        Advert {
            warm,
            goldens,
            templates,
            claims: (st.slots.len() + st.pending) as u32,
            capacity: self.cfg.max_claims as u32,
            draining,
            tenants,
            tenant_seconds: self.usage.month_totals(),
        }
    }
}
