//! The node controller: typed actions (claim, release, renew, list, pools, drain) over the
//! engine, the journal and the pools, tested without an HTTP server in front.
//!
//! Locking: one `std::sync::Mutex` guards the in-memory state and is never held across an
//! `.await` or an engine call. Engine calls (blocking) run on tokio's blocking threads. The
//! journal commit is the durability point of every claim change: a claim is acknowledged only
//! after its record is in the journal, so a `kill -9` cannot lose an acknowledged claim.
//!
//! Background work: one refill loop keeps pools at their targets (and builds goldens on first
//! need), one reaper ends expired leases; both share a semaphore with teardown so the engine
//! never runs more than `background_concurrency` operations for them at once.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use silk_engine::jail::{JailConfig, JailEngine};
use silk_engine::{
    AgentAddr, Base, BoxInfo, BoxSpec, Engine, EngineError, Golden, SandboxId, Template,
    TemplateDef, TemplateSource, Warmup,
};
use silk_store::SnapshotStore;
use tokio::sync::{Notify, Semaphore};

use crate::claims::{ClaimRecord, ClaimSpec, OnExpire, Tier, hash_token, new_token, token_matches};
use crate::config::{Config, PoolConfig};
use crate::error::{Code, NodeError};
use crate::journal::{Change, Journal};
use crate::metrics::Metrics;
use crate::pool::{Pool, PoolKey};
use crate::stored::StoredClaim;

// The journal's framing and the stored records are one format version.
const _: () = assert!(crate::stored::VERSION == crate::journal::VERSION);
use crate::state::SandboxState;

mod lifecycle;
pub use lifecycle::{CheckpointInfo, Promoted};

const REFILL_TICK: Duration = Duration::from_millis(250);
const REAP_TICK: Duration = Duration::from_millis(500);

#[derive(Debug)]
pub struct Node {
    pub cfg: Config,
    engine: Arc<dyn Engine>,
    store: SnapshotStore,
    journal: Journal<StoredClaim>,
    state: Mutex<State>,
    /// Golden builds run one at a time (two builds of one golden would collide).
    golden_lock: tokio::sync::Mutex<()>,
    background: Arc<Semaphore>,
    refill: Notify,
    draining: AtomicBool,
    pub metrics: Metrics,
    started: Instant,
    /// This node's name (the mesh name, or `local`): sandbox ids carry a tag of it.
    pub name: String,
    /// The mesh, when configured.
    pub peers: Option<Arc<crate::peers::Peers>>,
    /// Peers' calls, until `serve` takes them (it has the router they run through).
    pub(crate) incoming: Mutex<Option<tokio::sync::mpsc::Receiver<silk_mesh::Incoming>>>,
}

#[derive(Debug, Default)]
struct State {
    claims: HashMap<String, Live>,
    /// Claims between admission and acknowledgement (they count against `max_claims`).
    pending: usize,
    pools: BTreeMap<PoolKey, Pool>,
    templates: HashMap<String, Template>,
    goldens: HashMap<String, Golden>,
    /// Templates made by promote: name → golden.
    promoted: BTreeMap<String, Promoted>,
    /// One lock per sandbox: lifecycle calls on one sandbox run one at a time.
    busy: HashMap<String, Arc<tokio::sync::Mutex<()>>>,
    /// Background lifecycle work (idle hibernate, archive) that failed waits until then.
    retry_at: HashMap<String, Instant>,
    /// Sandboxes being adopted here (a move or a wake anywhere), not yet journalled.
    adopting: std::collections::HashSet<String>,
}

/// A claimed sandbox.
#[derive(Debug, Clone)]
pub struct Live {
    pub record: ClaimRecord,
    /// Where its silkd listens while it runs.
    pub agent: PathBuf,
    /// The layers it runs on (unknown for a sandbox adopted while archived).
    pub base: Option<Base>,
    pub activity: Arc<Activity>,
}

impl Live {
    /// Whether the engine holds a box for it: running, or hibernated in place.
    fn has_box(&self) -> bool {
        match self.record.state {
            SandboxState::Claimed => true,
            SandboxState::Hibernated => self.record.stopped.is_none(),
            _ => false,
        }
    }
}

/// Data-plane use of one sandbox, for idle hibernation.
#[derive(Debug, Default)]
pub struct Activity {
    /// Relay connections open now.
    pub open: std::sync::atomic::AtomicUsize,
    /// When the last data-plane call ended (ms since the epoch).
    pub last_ms: std::sync::atomic::AtomicU64,
    /// Wakes relay tasks so they end when the sandbox stops (hibernate, archive, release).
    pub hangup: Notify,
}

impl Activity {
    fn new() -> Arc<Activity> {
        let a = Activity::default();
        a.last_ms.store(now_ms(), Ordering::Relaxed);
        Arc::new(a)
    }
}

impl Live {
    fn new(record: ClaimRecord, info: &BoxInfo) -> Live {
        Live {
            record,
            agent: agent_path(info),
            base: Some(info.base.clone()),
            activity: Activity::new(),
        }
    }
}

/// Claims admitted against `max_claims` and not yet acknowledged: uncounted when dropped,
/// however the call ends (an answer, an error, a panic, a cancelled request).
pub(crate) struct Admission<'a> {
    node: &'a Node,
    n: usize,
}

impl Drop for Admission<'_> {
    fn drop(&mut self) {
        self.node.lock().pending -= self.n;
    }
}

/// What a successful claim hands back (the token only this once).
#[derive(Debug, Clone)]
pub struct Claimed {
    pub record: ClaimRecord,
    pub token: String,
    pub took: Duration,
}

pub fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

fn agent_path(info: &BoxInfo) -> PathBuf {
    match &info.agent {
        AgentAddr::Unix(p) => p.clone(),
        // The jail engine only hands out unix sockets; vsock arrives with VM engines.
        AgentAddr::Vsock { .. } => PathBuf::new(),
    }
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, EngineError> + Send + 'static,
) -> Result<T, NodeError> {
    match tokio::task::spawn_blocking(f).await {
        Ok(r) => r.map_err(NodeError::from),
        Err(e) => Err(NodeError::internal(format!("engine task failed: {e}"))),
    }
}

impl Node {
    /// Opens the engine and the journal, reconciles what survived the last run, and starts the
    /// background loops.
    pub async fn start(cfg: Config) -> anyhow::Result<Arc<Node>> {
        cfg.validate()?;
        let exe_dir = std::env::current_exe()?.parent().map(PathBuf::from).unwrap_or_default();
        let silkd = cfg.silkd.clone().unwrap_or_else(|| exe_dir.join("silkd"));
        let launcher = cfg.launcher.clone().unwrap_or_else(|| exe_dir.join("silk-jail"));
        // Sandboxes' files, checkpoints and the journal live here: root's only.
        std::fs::create_dir_all(&cfg.data_dir)?;
        std::fs::set_permissions(
            &cfg.data_dir,
            std::os::unix::fs::PermissionsExt::from_mode(0o700),
        )?;
        let mut jail = JailConfig::new(cfg.data_dir.join("engine"), silkd, launcher);
        jail.id_base = cfg.sandbox_id_base;
        jail.disk = silk_engine::jail::DiskSizes {
            small: cfg.disk.small_mib.saturating_mul(1 << 20),
            medium: cfg.disk.medium_mib.saturating_mul(1 << 20),
            large: cfg.disk.large_mib.saturating_mul(1 << 20),
        };
        jail.bound_disks = cfg.disk.bounded;
        let engine = JailEngine::new(jail)?;
        Node::open(cfg, Arc::new(engine)).await
    }

    /// [`start`](Self::start) on a given engine (the node's tests use a fake one). Expects
    /// `cfg` validated and its data directory made.
    pub async fn open(cfg: Config, engine: Arc<dyn Engine>) -> anyhow::Result<Arc<Node>> {
        let (journal, stored) = Journal::open(&cfg.data_dir.join("journal"), cfg.journal_fsync)?;
        let records = crate::stored::live_records(stored).map_err(anyhow::Error::msg)?;
        let store = lifecycle::open_store(&cfg).await?;
        let pools = load_pools(&cfg)?;
        let (peers, incoming) = match &cfg.mesh {
            Some(m) => {
                let (peers, incoming) = start_mesh(&cfg, m).await?;
                (Some(peers), Some(incoming))
            }
            None => (None, None),
        };
        let name = cfg.mesh.as_ref().map_or_else(|| "local".to_string(), |m| m.name.clone());
        let node = Arc::new(Node {
            background: Arc::new(Semaphore::new(cfg.background_concurrency.max(1))),
            cfg,
            engine,
            store,
            journal,
            state: Mutex::default(),
            golden_lock: tokio::sync::Mutex::new(()),
            refill: Notify::new(),
            draining: AtomicBool::new(false),
            metrics: Metrics::default(),
            started: Instant::now(),
            name,
            peers,
            incoming: Mutex::new(incoming),
        });
        {
            let mut st = node.lock();
            st.promoted = lifecycle::load_promoted(&node.cfg)?;
            st.goldens = st.promoted.iter().map(|(n, p)| (n.clone(), p.golden.clone())).collect();
        }
        node.set_pool_configs(&pools);
        node.reconcile(records).await?;
        tokio::spawn(refill_loop(node.clone()));
        tokio::spawn(reap_loop(node.clone()));
        tokio::spawn(gc_loop(node.clone()));
        if let Some(peers) = &node.peers {
            tokio::spawn(crate::peers::publish_loop(node.clone(), peers.clone()));
            tokio::spawn(node.clone().settle_moves());
        }
        Ok(node)
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Re-adopts claimed sandboxes that are still running, keeps hibernated and archived ones,
    /// finishes or rolls back lifecycle operations a crash interrupted (see `lifecycle`),
    /// removes every other sandbox and forgets claims whose sandbox is gone.
    async fn reconcile(&self, records: BTreeMap<String, ClaimRecord>) -> anyhow::Result<()> {
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
            if rec.state == SandboxState::Archived
                && rec.intent.is_none()
                && rec.archive.is_some()
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
        tracing::info!(
            kept = kept.len(),
            removed = doomed.len(),
            changed = changes.len(),
            "reconciled"
        );
        if !changes.is_empty() {
            self.journal.commit(changes).await?;
        }
        let referenced: Vec<PathBuf> = kept
            .values()
            .filter_map(|l| l.record.stopped.as_ref().map(|s| s.layer_tar.clone()))
            .collect();
        self.lock().claims = kept;
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

    // ---- templates and goldens ----

    fn template_def(&self, name: &str) -> Result<TemplateDef, NodeError> {
        if name == "host" {
            return Ok(TemplateDef::host());
        }
        if let Some(p) = self.lock().promoted.get(name) {
            return Ok(TemplateDef {
                name: name.into(),
                source: TemplateSource::Dir(p.golden.template.root.clone()),
            });
        }
        let t = self.cfg.templates.get(name).ok_or_else(|| {
            NodeError::new(Code::TemplateNotFound, format!("no template {name:?}"))
        })?;
        let source = match (&t.dir, &t.image) {
            (Some(dir), _) => TemplateSource::Dir(dir.clone()),
            (None, Some(image)) => TemplateSource::Image(image.clone()),
            (None, None) => return Err(NodeError::internal("template without a source")),
        };
        Ok(TemplateDef { name: name.into(), source })
    }

    fn warmup(&self, name: &str) -> Warmup {
        self.cfg
            .templates
            .get(name)
            .map(|t| Warmup {
                argv: t.warmup.clone(),
                timeout: Duration::from_secs(t.warmup_timeout_seconds),
            })
            .unwrap_or_default()
    }

    async fn template(&self, name: &str) -> Result<Template, NodeError> {
        if let Some(t) = self.lock().templates.get(name) {
            return Ok(t.clone());
        }
        if let Some(p) = self.lock().promoted.get(name) {
            return Ok(p.golden.template.clone());
        }
        let def = self.template_def(name)?;
        let engine = self.engine.clone();
        let t = blocking(move || engine.template(&def)).await?;
        self.lock().templates.insert(name.into(), t.clone());
        Ok(t)
    }

    /// The template's golden, built on first need.
    async fn golden(&self, name: &str) -> Result<Golden, NodeError> {
        if let Some(g) = self.lock().goldens.get(name) {
            return Ok(g.clone());
        }
        let template = self.template(name).await?;
        let _one_at_a_time = self.golden_lock.lock().await;
        if let Some(g) = self.lock().goldens.get(name) {
            return Ok(g.clone());
        }
        let warmup = self.warmup(name);
        let digest = self.engine.golden_digest(&template, &warmup);
        // Held here already, or built by a peer and shared through the store: no warmup runs.
        let g = match self.engine.find_golden(&digest) {
            Some(g) => g,
            None => match self.fetch_golden(&template, &digest).await {
                Ok(Some(g)) => g,
                fetched => {
                    if let Err(e) = fetched {
                        tracing::warn!(template = name, "golden from the store: {e}; building it");
                    }
                    let engine = self.engine.clone();
                    let g = blocking(move || engine.prepare(&template, &warmup)).await?;
                    self.metrics.golden_builds.fetch_add(1, Ordering::Relaxed);
                    self.share_golden(g.clone());
                    g
                }
            },
        };
        self.lock().goldens.insert(name.into(), g.clone());
        Ok(g)
    }

    // ---- claims ----

    pub async fn claim(self: &Arc<Self>, spec: ClaimSpec) -> Result<Claimed, NodeError> {
        let t0 = Instant::now();
        if self.draining.load(Ordering::Relaxed) {
            return Err(NodeError::new(
                Code::Draining,
                "this node is draining and takes no new claims",
            ));
        }
        self.template_def(&spec.template)?;
        self.disk_reserve()?;
        let key = PoolKey { template: spec.template.clone(), size: spec.size, lane: spec.lane };
        let (admitted, warm, idle) = {
            let mut st = self.lock();
            let admitted = self.admit(&mut st, 1)?;
            let pool = st.pools.get_mut(&key);
            let idle = pool.as_ref().and_then(|p| p.idle_hibernate);
            (admitted, pool.and_then(|p| p.take(Instant::now())), idle)
        };
        let result = self.finish_claim(spec, key, warm, idle, t0).await;
        drop(admitted);
        self.refill.notify_one();
        if let Ok(claimed) = &result
            && claimed.record.tier == Tier::Cold
        {
            // The golden is built on first need, so the next claim of this template clones.
            let (node, template) = (self.clone(), claimed.record.template.clone());
            tokio::spawn(async move {
                if let Err(e) = node.golden(&template).await {
                    tracing::warn!(template, "golden build failed: {e}");
                }
            });
        }
        result
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

    /// Counts `n` claims in flight until the returned guard drops, or answers 429 when the
    /// node is full. `st` is this node's state, locked (the guard locks it again to drop).
    fn admit(&self, st: &mut State, n: usize) -> Result<Admission<'_>, NodeError> {
        if st.claims.len() + st.pending + n > self.cfg.max_claims {
            return Err(NodeError::new(
                Code::NodeFull,
                format!("this node holds its maximum of {} claims", self.cfg.max_claims),
            ));
        }
        st.pending += n;
        Ok(Admission { node: self, n })
    }

    async fn finish_claim(
        &self,
        spec: ClaimSpec,
        key: PoolKey,
        warm: Option<BoxInfo>,
        idle_hibernate_seconds: Option<u64>,
        t0: Instant,
    ) -> Result<Claimed, NodeError> {
        let (info, tier) = match warm {
            Some(info) => (info, Tier::Warm),
            None => {
                let id: SandboxId = self.new_id()?;
                let box_spec = BoxSpec::new(key.size, key.lane);
                let engine = self.engine.clone();
                let golden = self.lock().goldens.get(&spec.template).cloned();
                match golden {
                    Some(g) => (
                        blocking(move || engine.clone_golden(&g, &id, &box_spec)).await?,
                        Tier::Clone,
                    ),
                    None => {
                        let t = self.template(&spec.template).await?;
                        (blocking(move || engine.boot(&t, &id, &box_spec)).await?, Tier::Cold)
                    }
                }
            }
        };
        let token = new_token();
        let mut record = new_record(&info, &token, &spec, tier);
        record.idle_hibernate_seconds = idle_hibernate_seconds;
        self.acknowledge(vec![(record.clone(), info)]).await?;
        let took = t0.elapsed();
        self.metrics.claimed(tier, took);
        Ok(Claimed { record, token, took })
    }

    /// Journals new claims on running sandboxes, all or none, and makes them visible. On a
    /// journal failure the sandboxes are destroyed: nothing unacknowledged outlives the call.
    async fn acknowledge(&self, claims: Vec<(ClaimRecord, BoxInfo)>) -> Result<(), NodeError> {
        let changes = claims.iter().map(|(r, _)| Change::Put(r.id.clone(), r.into())).collect();
        if let Err(e) = self.journal.commit(changes).await {
            for (_, info) in claims {
                self.teardown(info.id);
            }
            return Err(NodeError::internal(format!("journal: {e}")));
        }
        let mut st = self.lock();
        for (record, info) in claims {
            st.claims.insert(record.id.clone(), Live::new(record, &info));
        }
        Ok(())
    }

    /// Destroys a sandbox in the background, within the shared concurrency limit.
    fn teardown(&self, id: SandboxId) {
        let (engine, permits) = (self.engine.clone(), self.background.clone());
        tokio::spawn(async move {
            let _permit = permits.acquire_owned().await;
            if let Err(e) = tokio::task::spawn_blocking(move || engine.destroy(&id)).await {
                tracing::warn!("teardown failed: {e}");
            }
        });
    }

    pub fn get(&self, id: &str) -> Option<Live> {
        self.lock().claims.get(id).cloned()
    }

    /// Claims whose metadata contains every `(key, value)` of `filter`.
    pub fn list(&self, filter: &[(String, String)]) -> Vec<ClaimRecord> {
        let mut out: Vec<ClaimRecord> = self
            .lock()
            .claims
            .values()
            .filter(|l| filter.iter().all(|(k, v)| l.record.metadata.get(k) == Some(v)))
            .map(|l| l.record.clone())
            .collect();
        out.sort_by(|a, b| a.created_ms.cmp(&b.created_ms).then(a.id.cmp(&b.id)));
        out
    }

    /// A fresh sandbox id homed on this node.
    pub fn new_id(&self) -> Result<SandboxId, NodeError> {
        Ok(crate::peers::new_sandbox_id(&self.name).parse()?)
    }

    /// Warm sandboxes ready for `key` here (0 while draining or full).
    pub fn warm_for(&self, key: &PoolKey) -> usize {
        let st = self.lock();
        if self.draining.load(Ordering::Relaxed)
            || st.claims.len() + st.pending >= self.cfg.max_claims
        {
            return 0;
        }
        st.pools.get(key).map_or(0, |p| p.ready.len())
    }

    /// What this node tells its peers about itself. A draining node advertises no warm capacity.
    pub fn mesh_state(&self) -> silk_mesh::NodeState {
        let st = self.lock();
        let draining = self.draining.load(Ordering::Relaxed);
        let warm = if draining {
            BTreeMap::new()
        } else {
            st.pools.values().map(|p| (p.key.to_string(), p.ready.len() as u32)).collect()
        };
        let mut goldens: Vec<String> = st.goldens.values().map(|g| g.digest.to_string()).collect();
        goldens.sort();
        let mut templates: Vec<String> =
            st.templates.values().map(|t| t.digest.to_string()).collect();
        templates.sort();
        silk_mesh::NodeState {
            warm,
            goldens,
            templates,
            claims: (st.claims.len() + st.pending) as u32,
            capacity: self.cfg.max_claims as u32,
            draining,
            ..Default::default()
        }
    }

    pub fn capabilities(&self) -> silk_engine::Caps {
        self.engine.capabilities()
    }

    pub fn is_root(&self, bearer: Option<&str>) -> bool {
        match (&self.cfg.api_token, bearer) {
            (None, _) => true,
            (Some(root), Some(given)) => {
                crate::claims::constant_time_eq(root.as_bytes(), given.as_bytes())
            }
            (Some(_), None) => false,
        }
    }

    /// The claim, if `bearer` may act on it (its own token or the root token); otherwise the
    /// same 404 as an unknown id.
    pub fn authorized(&self, id: &str, bearer: Option<&str>) -> Result<Live, NodeError> {
        let live = self.get(id).ok_or_else(NodeError::sandbox_not_found)?;
        let own = bearer.is_some_and(|t| token_matches(t, &live.record.token_hash));
        if own || self.is_root(bearer) { Ok(live) } else { Err(NodeError::sandbox_not_found()) }
    }

    pub async fn release(&self, id: &str) -> Result<(), NodeError> {
        let _busy = self.busy(id).await;
        self.release_locked(id).await
    }

    /// [`release`](Self::release) with the sandbox's lifecycle lock held.
    async fn release_locked(&self, id: &str) -> Result<(), NodeError> {
        let live = self.lock().claims.remove(id).ok_or_else(NodeError::sandbox_not_found)?;
        live.record.state.transition(SandboxState::Released).map_err(NodeError::internal)?;
        if let Err(e) = self.journal.commit(vec![Change::Delete(id.to_string())]).await {
            self.lock().claims.insert(id.to_string(), live);
            return Err(NodeError::internal(format!("journal: {e}")));
        }
        self.metrics.released.fetch_add(1, Ordering::Relaxed);
        live.activity.hangup.notify_waiters();
        self.lock().retry_at.remove(id);
        match live.record.state {
            SandboxState::Claimed => self.teardown(live.record.id.parse()?),
            SandboxState::Hibernated => match &live.record.stopped {
                Some(s) => {
                    let _ = std::fs::remove_file(&s.layer_tar);
                }
                None => self.teardown(live.record.id.parse()?),
            },
            SandboxState::Archived => {
                self.unpublish_archived(id).await;
                if let Some(name) = &live.record.archive {
                    self.drop_archive(name).await;
                }
            }
            SandboxState::Warm | SandboxState::Released => {}
        }
        Ok(())
    }

    pub async fn renew(&self, id: &str, ttl_seconds: u64) -> Result<ClaimRecord, NodeError> {
        // Under the lifecycle lock: a record journalled here must not undo a concurrent
        // hibernate, wake or archive.
        let _busy = self.busy(id).await;
        let mut record = self.get(id).ok_or_else(NodeError::sandbox_not_found)?.record;
        record.deadline_ms = now_ms() + ttl_seconds * 1000;
        record.lease_seconds = ttl_seconds;
        self.journal
            .commit(vec![Change::Put(id.to_string(), (&record).into())])
            .await
            .map_err(|e| NodeError::internal(format!("journal: {e}")))?;
        match self.lock().claims.get_mut(id) {
            Some(live) => {
                live.record.deadline_ms = record.deadline_ms;
                live.record.lease_seconds = ttl_seconds;
            }
            // Released while the renewal was being written: the release wins.
            None => return Err(NodeError::sandbox_not_found()),
        }
        Ok(record)
    }

    /// What the reaper should do with a sandbox now, if anything.
    fn due(&self, live: &Live, now: u64) -> Option<Due> {
        let r = &live.record;
        if matches!(r.intent, Some(crate::claims::Intent::Move { .. })) {
            return None; // settled with the target first
        }
        let since = now.saturating_sub(r.state_since_ms) / 1000;
        let retention = |s: &u64| since >= *s;
        if r.deadline_ms <= now {
            return match (r.on_expire, r.state) {
                (OnExpire::Archive, SandboxState::Archived) => {
                    self.cfg.archive_retention_seconds.filter(retention).map(|_| Due::Release)
                }
                (OnExpire::Archive, _) => Some(Due::Archive),
                (OnExpire::Destroy, _) => Some(Due::Release),
            };
        }
        match r.state {
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
    async fn reap(&self) {
        let now = now_ms();
        let due: Vec<String> = {
            let st = self.lock();
            let later = Instant::now();
            st.claims
                .values()
                .filter(|l| st.retry_at.get(&l.record.id).is_none_or(|t| later >= *t))
                .filter(|l| self.due(l, now).is_some())
                .map(|l| l.record.id.clone())
                .collect()
        };
        for id in due {
            let _busy = self.busy(&id).await;
            let Some(live) = self.get(&id) else { continue };
            let Some(work) = self.due(&live, now_ms()) else { continue };
            let done = match work {
                Due::Release => self.release_locked(&id).await.map(|()| "released"),
                Due::Archive => self.archive_locked(live).await.map(|_| "archived"),
                Due::Hibernate => self.hibernate_locked(live).await.map(|_| "hibernated (idle)"),
            };
            match done {
                Ok(what) => {
                    self.lock().retry_at.remove(&id);
                    if matches!(work, Due::Release) {
                        self.metrics.expired.fetch_add(1, Ordering::Relaxed);
                    }
                    tracing::info!(sandbox = id, "{what}");
                }
                Err(e) => {
                    tracing::warn!(sandbox = id, "background {work:?} failed: {e}");
                    self.lock().retry_at.insert(id, Instant::now() + Duration::from_secs(5));
                }
            }
        }
    }

    // ---- pools ----

    fn set_pool_configs(&self, pools: &[PoolConfig]) {
        let mut st = self.lock();
        let mut next = BTreeMap::new();
        for p in pools {
            let key = PoolKey { template: p.template.clone(), size: p.size, lane: p.lane };
            let mut pool = st.pools.remove(&key).unwrap_or_else(|| {
                Pool::new(key.clone(), p.warm, p.warm_max.unwrap_or(p.warm * 2))
            });
            pool.warm = p.warm;
            pool.idle_hibernate = p.idle_hibernate_seconds;
            pool.warm_max = p.warm_max.unwrap_or(p.warm * 2).max(p.warm);
            pool.target = pool.target.clamp(pool.warm, pool.warm_max);
            next.insert(key, pool);
        }
        // Pools no longer configured: their warm sandboxes go away.
        for (_, pool) in std::mem::take(&mut st.pools) {
            for info in pool.ready {
                self.teardown(info.id);
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
        probe.validate().map_err(|e| NodeError::bad_request(e.to_string()))?;
        let json =
            serde_json::to_vec_pretty(&pools).map_err(|e| NodeError::internal(e.to_string()))?;
        crate::durable::replace(&self.cfg.data_dir.join("pools.json"), &json)
            .map_err(|e| NodeError::internal(format!("persist pools: {e}")))?;
        self.set_pool_configs(&pools);
        Ok(())
    }

    /// Entries in each of the controller's tables (tests check none grows without bound).
    #[doc(hidden)]
    pub fn table_sizes(&self) -> BTreeMap<&'static str, usize> {
        let st = self.lock();
        BTreeMap::from([
            ("claims", st.claims.len()),
            ("pending", st.pending),
            ("busy", st.busy.len()),
            ("retry_at", st.retry_at.len()),
            ("adopting", st.adopting.len()),
        ])
    }

    pub fn set_draining(&self, draining: bool) {
        self.draining.store(draining, Ordering::Relaxed);
    }

    pub fn info(&self) -> serde_json::Value {
        let st = self.lock();
        let now = Instant::now();
        let pools: Vec<_> = st
            .pools
            .values()
            .map(|p| {
                serde_json::json!({
                    "template": p.key.template, "size": p.key.size, "lane": p.key.lane,
                    "warm": p.ready.len(), "starting": p.starting, "target": p.target,
                    "warm_min": p.warm, "warm_max": p.warm_max,
                    "golden": st.goldens.get(&p.key.template).map(|g| g.digest.to_string()),
                    "backing_off": p.backing_off(now),
                })
            })
            .collect();
        serde_json::json!({
            "version": env!("CARGO_PKG_VERSION"),
            "engine": self.engine.name(),
            "capabilities": self.engine.capabilities(),
            "claims": st.claims.len(),
            "max_claims": self.cfg.max_claims,
            "draining": self.draining.load(Ordering::Relaxed),
            "uptime_ms": self.started.elapsed().as_millis() as u64,
            "pools": pools,
            "goldens": st.goldens.keys().collect::<Vec<_>>(),
            "name": self.name,
            "mesh": self.peers.as_ref().map(|p| serde_json::json!({
                "addr": p.mesh.id().addr.to_string(),
                "epoch": p.mesh.id().epoch,
                "peers": p.mesh.peers().len(),
                "forward": p.forward,
            })),
        })
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
        let claims = vec![(String::new(), st.claims.len() as u64)];
        drop(st);
        self.metrics.render(&[
            ("silkmesh_pool_warm", "Warm sandboxes ready, by pool.", warm),
            ("silkmesh_pool_target", "Current warm target, by pool.", target),
            ("silkmesh_claims_live", "Claims held on this node.", claims),
            (
                "silkmesh_journal_records",
                "Records in the claims journal.",
                vec![(String::new(), self.journal.len() as u64)],
            ),
        ])
    }

    /// Starts whatever the pools are missing.
    fn refill_once(self: &Arc<Self>) {
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
                        if let Some(stale) = pool.started(info, generation) {
                            node.teardown(stale.id);
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

    async fn start_warm(&self, key: &PoolKey) -> Result<BoxInfo, NodeError> {
        self.disk_reserve()?;
        let golden = self.golden(&key.template).await?;
        let _permit =
            self.background.acquire().await.map_err(|e| NodeError::internal(e.to_string()))?;
        let id: SandboxId = self.new_id()?;
        let (engine, spec) = (self.engine.clone(), BoxSpec::new(key.size, key.lane));
        blocking(move || engine.clone_golden(&golden, &id, &spec)).await
    }
}

fn load_pools(cfg: &Config) -> anyhow::Result<Vec<PoolConfig>> {
    let path = cfg.data_dir.join("pools.json");
    match std::fs::read(&path) {
        Ok(bytes) => Ok(serde_json::from_slice(&bytes)?),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(cfg.pools.clone()),
        Err(e) => Err(e.into()),
    }
}

async fn refill_loop(node: Arc<Node>) {
    loop {
        node.refill_once();
        tokio::select! {
            () = node.refill.notified() => {}
            () = tokio::time::sleep(REFILL_TICK) => {}
        }
    }
}

#[derive(Debug, Clone, Copy)]
enum Due {
    Release,
    Archive,
    Hibernate,
}

/// The record of a fresh claim on `info`.
fn new_record(info: &BoxInfo, token: &str, spec: &ClaimSpec, tier: Tier) -> ClaimRecord {
    let now = now_ms();
    ClaimRecord {
        id: info.id.to_string(),
        token_hash: hash_token(token),
        template: spec.template.clone(),
        size: spec.size,
        lane: spec.lane,
        tier,
        state: SandboxState::Claimed,
        created_ms: now,
        deadline_ms: now + spec.ttl_seconds * 1000,
        on_expire: spec.on_expire,
        metadata: spec.metadata.clone(),
        lease_seconds: spec.ttl_seconds,
        idle_hibernate_seconds: None,
        from_checkpoint: None,
        forked_from: None,
        state_since_ms: now,
        stopped: None,
        archive: None,
        intent: None,
    }
}

/// Starts this node's mesh endpoint. The epoch (persisted, +1 per start) versions its state, so
/// peers order its announcements without trusting any clock.
async fn start_mesh(
    cfg: &Config,
    m: &crate::config::MeshSection,
) -> anyhow::Result<(Arc<crate::peers::Peers>, tokio::sync::mpsc::Receiver<silk_mesh::Incoming>)> {
    std::fs::create_dir_all(&cfg.data_dir)?;
    let path = cfg.data_dir.join("mesh-epoch");
    let epoch =
        std::fs::read_to_string(&path).ok().and_then(|s| s.trim().parse::<u64>().ok()).unwrap_or(0)
            + 1;
    crate::durable::replace(&path, epoch.to_string().as_bytes())?;
    let tls = silk_mesh::TlsFiles { ca: m.ca.clone(), cert: m.cert.clone(), key: m.key.clone() };
    silk_mesh::tls::check_own(&tls, &m.name)?;
    let mut mc = silk_mesh::MeshConfig::new(m.name.clone(), m.listen, tls);
    mc.join = m.join.clone();
    for known in crate::peers::known_peers(&cfg.data_dir) {
        if !mc.join.contains(&known) {
            mc.join.push(known);
        }
    }
    mc.epoch = epoch;
    mc.probe_period = Duration::from_millis(m.probe_period_ms);
    mc.probe_rtt = Duration::from_millis(m.probe_rtt_ms);
    mc.suspect_to_down = Duration::from_millis(m.suspect_to_down_ms);
    let api = m.advertise.clone().unwrap_or_else(|| format!("http://{}", cfg.listen));
    let state = silk_mesh::NodeState { api, public: m.public_url.clone(), ..Default::default() };
    let (mesh, incoming) = silk_mesh::Mesh::start(mc, state).await?;
    tracing::info!(name = m.name, addr = %mesh.id().addr, epoch, "mesh endpoint up");
    Ok((Arc::new(crate::peers::Peers::new(mesh, m.forward)), incoming))
}

/// Every `gc_interval_seconds`: deletes archives no claim names, then collects the store's
/// unreferenced chunks (the snapshot store's GC is safe beside uploads and beside other nodes'
/// GCs; see silk-store).
async fn gc_loop(node: Arc<Node>) {
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

async fn reap_loop(node: Arc<Node>) {
    loop {
        tokio::time::sleep(REAP_TICK).await;
        node.reap().await;
    }
}

/// Bytes an unprivileged writer may still use on the filesystem holding `dir`.
fn free_bytes(dir: &std::path::Path) -> Option<u64> {
    let path = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()).ok()?;
    // SAFETY: statvfs fills `st` on success.
    unsafe {
        let mut st: libc::statvfs = std::mem::zeroed();
        (libc::statvfs(path.as_ptr(), &mut st) == 0).then(|| st.f_bavail * st.f_frsize)
    }
}
