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

use silk_engine::{
    AgentAddr, Base, BoxInfo, BoxSpec, Engine, EngineError, Golden, MemoryKept, SandboxId,
    Template, TemplateDef, TemplateSource, Warmup,
};
use silk_store::SnapshotStore;
use tokio::net::UnixStream;
use tokio::sync::{Notify, Semaphore};

use crate::claims::{
    ClaimRecord, ClaimSpec, OnExpire, Phase, Tier, hash_token, new_token, token_matches,
};
use crate::config::{Config, PoolConfig};
use crate::error::{Code, NodeError};
use crate::journal::{Change, Journal};
use crate::metrics::Metrics;
use crate::pool::{Pool, PoolKey};
use crate::stored::StoredClaim;

// The journal's framing and the stored records are one format version.
use crate::state::{SandboxState, Transitions};

mod activity;
mod catalog;
mod claiming;
pub mod fleet;
mod foreground;
mod lane;
mod lifecycle;
mod pools;
pub(crate) mod previews;
mod reaper;
mod registered;
mod report;
mod restart;
mod slots;

use claiming::new_record;
use fleet::Fleet;
use slots::Slots;

pub use activity::{Active, Activity};
pub use lifecycle::{CheckpointInfo, Promoted};
use pools::{Ready, load_pools, refill_loop};
use reaper::{gc_loop, reap_loop, tenants_loop, usage_loop};
pub use report::Advert;

const REFILL_TICK: Duration = Duration::from_millis(250);
/// A woken refill waits this long first: the claim that woke it answers, and its client's first
/// calls into the new sandbox run, before a clone takes the other core (measured: warm claim
/// p50 -14 %, p90 -18 % on 2 cores), and a burst of claims is refilled in one pass.
const REFILL_SETTLE: Duration = Duration::from_millis(3);
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
    /// Claims' starts in progress, which the pools' refills give way to.
    foreground: foreground::Foreground,
    refill: Notify,
    draining: AtomicBool,
    pub metrics: Metrics,
    started: Instant,
    /// This node's name (the mesh name, or `local`): sandbox ids carry a tag of it.
    pub name: String,
    /// The other nodes, when this one is in a mesh.
    fleet: std::sync::OnceLock<Arc<dyn Fleet>>,
    /// Lane `egress`, when this node offers it.
    pub(crate) egress: std::sync::OnceLock<silk_egress::Egress>,
    /// The fleet's preview key, once read from the store.
    preview_key: tokio::sync::OnceCell<[u8; 32]>,
    /// Every tenant of the fleet, as the shared store says.
    pub tenants: crate::tenants::Tenants,
    /// Registry images: registered templates, pins, pulls and the layer cache.
    pub images: crate::images::Images,
    /// Calls that changed something (written by the HTTP layer).
    pub audit: crate::audit::Audit,
    /// Sandbox-seconds per tenant, size and lane.
    pub usage: crate::usage::Usage,
    /// Checkpoints as their manifests said when this node last listed them. A checkpoint's
    /// manifest is written once and never changed, so what it said stays true until the
    /// checkpoint goes, and the store's list says which ones are still there.
    checkpoint_infos: Mutex<HashMap<String, lifecycle::CheckpointInfo>>,
    /// Checkpoints the engine keeps a copy of on this node, for their branches here.
    kept: Mutex<lifecycle::KeptCopies>,
    /// The crash point the in-process crash tests stop calls at.
    #[cfg(feature = "crash-points")]
    crash_at: Mutex<Option<(String, bool)>>,
}

#[derive(Debug, Default)]
struct State {
    /// Claims, lifecycle locks, retry times and adoptions, one slot per sandbox id.
    slots: Slots,
    /// Claims between admission and acknowledgement (they count against `max_claims`).
    pending: usize,
    /// Of those, the ones for each tenant (they count against its `max_sandboxes`).
    pending_by_tenant: HashMap<String, usize>,
    pools: BTreeMap<PoolKey, Pool<Ready>>,
    templates: HashMap<String, Template>,
    goldens: HashMap<String, Golden>,
    /// Goldens holding the memory of what their warmup left running (pools with
    /// `memory_golden`), by template name.
    memory_goldens: HashMap<String, Golden>,
    /// Templates made by promote: name → golden.
    promoted: BTreeMap<String, Promoted>,
}

impl State {
    /// `tenant`'s sandboxes on this node: claimed, and in flight.
    fn tenant_live(&self, tenant: &str) -> usize {
        self.slots.claims().filter(|l| l.record.tenant.as_deref() == Some(tenant)).count()
            + self.pending_by_tenant.get(tenant).copied().unwrap_or(0)
    }
}

/// A claimed sandbox.
#[derive(Debug, Clone)]
pub struct Live {
    pub record: ClaimRecord,
    /// Where its silkd listens while it runs.
    pub agent: AgentAddr,
    /// The layers it runs on (unknown for a sandbox adopted while archived).
    pub base: Option<Base>,
    /// Its address in lane `egress`.
    pub address: Option<std::net::Ipv4Addr>,
    pub activity: Arc<Activity>,
}

impl Live {
    /// Whether the engine holds a box for it: running, or hibernated in place.
    fn has_box(&self) -> bool {
        matches!(self.record.phase, Phase::Running | Phase::Stopped)
    }
}

/// Runs `work` to its end even if the client goes away. hyper drops a handler's future when
/// its connection closes; a claim or lifecycle call cut between its engine step and its journal
/// write would leave a sandbox between states (or a claim slot counted forever).
///
/// It is polled once here first: a call that ends without waiting (a refusal, a claim placed on
/// a peer) costs no task. One that waits moves, as it is, into a task of its own; nothing can
/// cancel it between the two (there is no `.await` there).
///
/// `work` is boxed at the call, not at the first poll: the caller's future then holds a
/// pointer, not the work. A handler's future is copied whole into its box on every request,
/// and the claim handler's was 25.9 KB, 23.8 KB of it the relay's `open_agent`, which most
/// claims never reach (`-Zprint-type-sizes`).
pub fn detached<T: Send + 'static>(
    work: impl Future<Output = Result<T, NodeError>> + Send + 'static,
) -> impl Future<Output = Result<T, NodeError>> + Send {
    let work = Box::pin(work);
    run_detached(work)
}

async fn run_detached<T: Send + 'static>(
    mut work: std::pin::Pin<Box<impl Future<Output = Result<T, NodeError>> + Send + 'static>>,
) -> Result<T, NodeError> {
    use std::task::Poll;
    let first = std::future::poll_fn(|cx| {
        // A panic is the call's own failure (a 500), as it is inside a task.
        let polled =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| work.as_mut().poll(cx)));
        Poll::Ready(polled)
    })
    .await;
    match first {
        Ok(Poll::Ready(done)) => return done,
        Ok(Poll::Pending) => {}
        Err(_) => return Err(NodeError::internal("the call panicked")),
    }
    tokio::spawn(work).await.map_err(|e| NodeError::internal(format!("task: {e}")))?
}

impl Live {
    fn new(record: ClaimRecord, info: &BoxInfo) -> Live {
        let activity = Activity::new();
        // A copy (branch, fork) says whether its processes came back; a fresh one has none.
        if info.memory.kept || info.memory.why_not.is_some() {
            activity.set_memory(info.memory.clone());
        }
        let (agent, base, address) = (info.agent.clone(), Some(info.base.clone()), info.address);
        Live { record, agent, base, address, activity }
    }
}

/// Claims admitted against `max_claims` and not yet acknowledged: uncounted when dropped,
/// however the call ends (an answer, an error, a panic, a cancelled request).
pub(crate) struct Admission<'a> {
    node: &'a Node,
    n: usize,
    tenant: Option<String>,
}

impl Admission<'_> {
    /// Stops counting them, under the caller's lock (their claims are visible now).
    fn settle(&mut self, st: &mut State) {
        let n = std::mem::take(&mut self.n);
        st.pending -= n;
        if let Some(t) = &self.tenant
            && let Some(pending) = st.pending_by_tenant.get_mut(t)
        {
            *pending -= n;
            if *pending == 0 {
                st.pending_by_tenant.remove(t);
            }
        }
    }
}

impl Drop for Admission<'_> {
    fn drop(&mut self) {
        if self.n > 0 {
            let node = self.node;
            self.settle(&mut node.lock());
        }
    }
}

/// Whom a bearer token speaks for (a sandbox's own token speaks only for that sandbox).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Principal {
    Root,
    Tenant(String),
    Nobody,
}

impl Principal {
    /// The tenant whose things the caller sees: `Ok(None)` for root, `Ok(Some)` for a tenant,
    /// and `401` for anyone else (node routes).
    pub fn scope(self) -> Result<Option<String>, NodeError> {
        match self {
            Principal::Root => Ok(None),
            Principal::Tenant(t) => Ok(Some(t)),
            Principal::Nobody => Err(NodeError::unauthorized()),
        }
    }
}

/// What a successful claim hands back (the token only this once).
#[derive(Debug)]
pub struct Claimed {
    pub record: ClaimRecord,
    pub token: String,
    pub took: Duration,
}

pub fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// A connection to the silkd at `agent`: a few syscalls, or a short wait while silkd's accept
/// queue is full (`silk_engine::agent::queue_full`).
pub(crate) async fn connect_agent(agent: &AgentAddr) -> std::io::Result<UnixStream> {
    use silk_engine::agent::{QUEUE_WAIT, queue_full, try_connect};
    let deadline = std::time::Instant::now() + QUEUE_WAIT;
    let mut pause = std::time::Duration::from_micros(500);
    loop {
        match try_connect(agent) {
            Err(e) if queue_full(&e) && std::time::Instant::now() < deadline => {
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(std::time::Duration::from_millis(20));
            }
            connected => return UnixStream::from_std(connected?),
        }
    }
}

impl Node {
    /// The connection on which the engine found the sandbox of `info` ready when it started it
    /// (`Engine::take_answered`), for the sandbox's first relay.
    fn answered(&self, info: &BoxInfo) -> Option<UnixStream> {
        UnixStream::from_std(self.engine.take_answered(&info.id)?).ok()
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
    /// Opens the journal and the store on `engine` (the jail engine in production, a fake one in
    /// the controller's tests), reconciles what survived the last run, and starts the
    /// background loops. A node in a mesh then [`join`](Self::join)s its fleet. Expects `cfg`
    /// validated and its data directory made.
    pub async fn open(cfg: Config, engine: Arc<dyn Engine>) -> anyhow::Result<Arc<Node>> {
        let (journal, stored) = Journal::open(&cfg.data_dir.join("journal"), cfg.journal_fsync)?;
        let records = crate::stored::live_records(stored).map_err(anyhow::Error::msg)?;
        let store = lifecycle::open_store(&cfg).await?;
        let tenants =
            crate::tenants::Tenants::open(store.object_store().clone(), &cfg.data_dir).await;
        let images = crate::images::Images::open(&cfg, store.object_store().clone()).await?;
        let pools = load_pools(&cfg)?;
        let audit = crate::audit::Audit::open(
            &cfg.data_dir.join("audit"),
            cfg.audit_max_bytes,
            cfg.audit_keep,
        )?;
        let usage = crate::usage::Usage::open(&cfg.data_dir.join("usage"), now_ms())?;
        let name = cfg.mesh.as_ref().map_or_else(|| "local".to_string(), |m| m.name.clone());
        let copies_bound = cfg.checkpoint_copies_mib.saturating_mul(1 << 20);
        let node = Arc::new(Node {
            background: Arc::new(Semaphore::new(cfg.background_concurrency.max(1))),
            cfg,
            engine,
            store,
            journal,
            state: Mutex::default(),
            golden_lock: tokio::sync::Mutex::new(()),
            foreground: foreground::Foreground::default(),
            refill: Notify::new(),
            draining: AtomicBool::new(false),
            metrics: Metrics::default(),
            started: Instant::now(),
            name,
            fleet: std::sync::OnceLock::new(),
            egress: std::sync::OnceLock::new(),
            preview_key: tokio::sync::OnceCell::new(),
            tenants,
            images,
            audit,
            usage,
            checkpoint_infos: Mutex::default(),
            kept: Mutex::new(lifecycle::KeptCopies::new(copies_bound)),
            #[cfg(feature = "crash-points")]
            crash_at: Mutex::new(None),
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
        tokio::spawn(tenants_loop(node.clone()));
        tokio::spawn(usage_loop(node.clone()));

        Ok(node)
    }

    /// Reaches other nodes through `fleet` from now on (once; a second call is ignored), and
    /// settles the moves a crash or a lost answer left open. Called after `open`, so a second
    /// process on a live data directory fails at the journal's lock before it joins any mesh.
    pub fn join(self: &Arc<Self>, fleet: Arc<dyn Fleet>) {
        if self.fleet.set(fleet).is_ok() {
            tokio::spawn(self.clone().settle_moves());
        }
    }

    fn fleet(&self) -> Option<Arc<dyn Fleet>> {
        self.fleet.get().cloned()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
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
        self.lock().slots.claim(id).cloned()
    }

    /// What a live sandbox says of its processes' memory (what `get` would, without copying
    /// its whole record: every row the API answers asks).
    pub fn memory_of(&self, id: &str) -> Option<MemoryKept> {
        self.lock().slots.claim(id).and_then(|l| l.activity.memory())
    }

    /// Claims whose metadata contains every `(key, value)` of `filter`.
    pub fn list(&self, filter: &[(String, String)]) -> Vec<ClaimRecord> {
        let mut out: Vec<ClaimRecord> = self
            .lock()
            .slots
            .claims()
            .filter(|l| filter.iter().all(|(k, v)| l.record.metadata.get(k) == Some(v)))
            .map(|l| l.record.clone())
            .collect();
        out.sort_by(|a, b| a.created_ms.cmp(&b.created_ms).then(a.id.cmp(&b.id)));
        out
    }

    /// A fresh sandbox id homed on this node.
    pub fn new_id(&self) -> Result<SandboxId, NodeError> {
        Ok(crate::claims::new_sandbox_id(&self.name).parse()?)
    }

    pub fn capabilities(&self) -> silk_engine::Caps {
        self.engine.capabilities()
    }

    /// Why the engine keeps no process memory (`None` when it does).
    pub fn engine_memory_why_not(&self) -> Option<String> {
        self.engine.memory_why_not()
    }

    /// Whether a call on a sandbox or checkpoint presents something that can be a credential:
    /// none at all (on a node that needs one), or a bearer that is neither the root token, a
    /// tenant's key nor shaped like a sandbox's token, is a 401 whatever the id (telling
    /// nothing of what exists). A credential that does not grant this id gets the same 404
    /// as an unknown id.
    pub fn credential_presented(&self, bearer: Option<&str>) -> Result<(), NodeError> {
        if self.is_root(bearer) {
            return Ok(());
        }
        match bearer {
            Some(t) if crate::claims::token_shaped(t) || self.tenants.by_key(t).is_some() => Ok(()),
            _ => Err(NodeError::unauthorized()),
        }
    }

    pub fn is_root(&self, bearer: Option<&str>) -> bool {
        match (&self.cfg.api_token, bearer) {
            (None, _) => true,
            // An empty token is never root, even against a config that slipped one through.
            (Some(root), Some(given)) => {
                !given.is_empty()
                    && crate::claims::constant_time_eq(root.as_bytes(), given.as_bytes())
            }
            (Some(_), None) => false,
        }
    }

    /// Whom `bearer` speaks for beyond one sandbox's own token: root, a tenant, or nobody.
    pub fn principal(&self, bearer: Option<&str>) -> Principal {
        if self.is_root(bearer) {
            return Principal::Root;
        }
        match bearer.and_then(|b| self.tenants.by_key(b)) {
            Some(tenant) => Principal::Tenant(tenant),
            None => Principal::Nobody,
        }
    }

    /// Whether `bearer` may act on something owned by `tenant` (none: root's) whose own token
    /// hashes to `token_hash`: that token, the root token, or the owning tenant's key.
    pub fn may_act(&self, bearer: Option<&str>, tenant: Option<&str>, token_hash: &str) -> bool {
        if bearer.is_some_and(|t| token_matches(t, token_hash)) {
            return true;
        }
        match self.principal(bearer) {
            Principal::Root => true,
            Principal::Tenant(t) => tenant == Some(t.as_str()),
            Principal::Nobody => false,
        }
    }

    /// The claim, if `bearer` may act on it ([`may_act`](Self::may_act)); otherwise the same
    /// 404 as an unknown id.
    pub fn authorized(&self, id: &str, bearer: Option<&str>) -> Result<Live, NodeError> {
        self.credential_presented(bearer)?;
        let live = self.get(id).ok_or_else(NodeError::sandbox_not_found)?;
        let r = &live.record;
        if self.may_act(bearer, r.tenant.as_deref(), &r.token_hash) {
            Ok(live)
        } else {
            Err(NodeError::sandbox_not_found())
        }
    }

    pub async fn release(&self, id: &str) -> Result<(), NodeError> {
        let _busy = self.busy(id).await;
        self.release_locked(id).await
    }

    /// [`release`](Self::release) with the sandbox's lifecycle lock held.
    async fn release_locked(&self, id: &str) -> Result<(), NodeError> {
        let live = self.lock().slots.remove_claim(id).ok_or_else(NodeError::sandbox_not_found)?;
        live.record.state().transition(SandboxState::Released).map_err(NodeError::internal)?;
        if let Err(e) = self.journal.commit(vec![Change::Delete(id.to_string())]).await {
            self.lock().slots.insert_claim(id.to_string(), live);
            return Err(NodeError::internal(format!("journal: {e}")));
        }
        self.metrics.released.fetch_add(1, Ordering::Relaxed);
        self.meter(std::slice::from_ref(&live.record), &[id.to_string()]);
        live.activity.hang_up();
        match &live.record.phase {
            Phase::Running | Phase::Stopped => self.teardown(live.record.id.parse()?),
            Phase::Captured(s) => {
                let _ = std::fs::remove_file(&s.layer_tar);
            }
            Phase::Archived(name) => {
                self.unpublish_archived(id).await;
                self.drop_archive(name).await;
            }
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
        match self.lock().slots.claim_mut(id) {
            Some(live) => {
                live.record.deadline_ms = record.deadline_ms;
                live.record.lease_seconds = ttl_seconds;
            }
            // Released while the renewal was being written: the release wins.
            None => return Err(NodeError::sandbox_not_found()),
        }
        Ok(record)
    }

    // ---- pools ----

    pub fn set_draining(&self, draining: bool) {
        self.draining.store(draining, Ordering::Relaxed);
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
