//! Lifecycle beyond one claim: hibernate and wake, checkpoint and branch, fork, promote,
//! archive. Everything goes through the engine trait and the snapshot store. Checkpoints, forks
//! and promotes are in `copies`; what crosses nodes is in `shared`.
//!
//! Calls on one sandbox run one at a time (a per-sandbox async lock); a call the sandbox's state
//! does not allow answers 409. Crash safety, step by step (a kill -9 anywhere):
//!
//! | operation | how a crash is survived |
//! |---|---|
//! | hibernate | the engine stops the box, keeping its files in place; then the state is journalled. A crash between leaves a claimed sandbox whose box stopped: the next access starts it again. |
//! | archive | a running sandbox is hibernated first (above); the intent is journalled, then the engine's capture of the stopped box streams into the store, and the box is removed only once the archived state is journalled. At start: the archive's manifest in the store → archived (the box goes in reconcile); otherwise still hibernated, in its box. A sandbox hibernated into a tar by an older node is uploaded from that tar, which is kept the same way. |
//! | wake | the tar (or the archive) is deleted only after the running state is journalled; a sandbox restored but not journalled is removed at start, one resumed in its box is claimed. Woken from an archive, the record carries `Unpublish(archive)` until the store's published claim and the archive are gone: a restart finishes that, so no other node can later wake the old archive — unless this node stayed down past its wake lease and another woke it meanwhile (the lease's keys tell: `recover::interrupted_wake`); then that copy is the sandbox and this one is removed. |
//! | silkd dies (OOM kill, host reboot) | the claim and its box stay; the next data-plane access stops and starts the box: its files are as they were, its processes restart. |
//! | checkpoint, fork, branch, promote | nothing is journalled until the result is whole: a crash leaves the source as it was, and scratch files and half-made sandboxes are removed at start. A checkpoint's manifest is its commit point. |

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use serde::{Deserialize, Serialize};
use silk_engine::{
    Base, BoxInfo, BoxSpec, Golden, Memory, MemoryKept, SandboxId, Snapshot, SnapshotMode, Streamed,
};
use silk_store::{ObjectStore, SnapshotName, SnapshotStore, StoreError};
use tokio::net::UnixStream;

use super::{Claimed, Live, Node, State, blocking, new_record, now_ms};
use crate::claims::{
    ClaimRecord, ClaimSpec, Intent, Phase, Tier, lease_end, new_archive_name, new_token, random_hex,
};
use crate::config::Config;
use crate::error::{Code, NodeError};
use crate::journal::Change;
use crate::state::SandboxState;

mod archive;
mod copies;
mod kept;
mod promote;
mod recover;
mod shared;
mod spool;
mod stored;
mod stream;

use archive::Files;
pub(super) use kept::KeptCopies;
use stored::StoredSnapshot;
use stream::{Arriving, Pace};

pub const MAX_FORK: usize = 16;
/// How long a wake may hold an archive's lease before others treat its holder as dead: far
/// longer than any download and restore.
const WAKE_LEASE: std::time::Duration = std::time::Duration::from_secs(3600);

/// A template made by promote.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Promoted {
    pub golden: Golden,
    /// The sandbox it was promoted from.
    pub source: String,
    pub created_ms: u64,
    /// The token hash of that sandbox (`None`: promoted with the root token). Only the same
    /// owner or the root token may replace it.
    pub owner: Option<String>,
}

/// A checkpoint as the API shows it, and the hash of its sandbox's token (who may use it).
#[derive(Debug, Clone)]
pub struct CheckpointInfo {
    pub checkpoint: silk_api::Checkpoint,
    token_hash: String,
    /// The tenant of the sandbox it was taken from (none: root's).
    pub tenant: Option<String>,
    /// The egress policy of the sandbox it was taken from: its branches run under it.
    pub egress: Option<silk_api::EgressPolicy>,
    /// The node that kept a copy of it when it was taken (its branches start fastest there).
    pub copy_on: Option<String>,
}

impl std::ops::Deref for CheckpointInfo {
    type Target = silk_api::Checkpoint;
    fn deref(&self) -> &silk_api::Checkpoint {
        &self.checkpoint
    }
}

/// Opens the configured object store: `[store.s3]`, `[store.fs]`, or `<data_dir>/store`.
pub(super) async fn open_store(cfg: &Config) -> anyhow::Result<SnapshotStore> {
    let objects: Arc<dyn ObjectStore> = match (&cfg.store.s3, &cfg.store.fs) {
        (Some(s3), _) => Arc::new(silk_store::s3::S3Store::new(s3.clone()).await?),
        (None, Some(fs)) => Arc::new(silk_store::fs::FsStore::open(fs.clone()).await?),
        (None, None) => {
            let fs = silk_store::fs::FsConfig::new(cfg.data_dir.join("store"));
            Arc::new(silk_store::fs::FsStore::open(fs).await?)
        }
    };
    let mut snapshots = cfg.store.snapshots.clone();
    if snapshots.known_index.is_none() {
        snapshots.known_index = Some(cfg.data_dir.join("known-chunks"));
    }
    // Manifests are signed with a key of the fleet's (derived from the root token, as the
    // memory images' key is): every node of it vouches for what the others stored.
    snapshots.manifest_key = cfg.api_token.as_ref().map(|t| {
        silk_store::ManifestKey(blake3::derive_key("silkmesh manifests v1", t.as_bytes()))
    });
    Ok(SnapshotStore::new(objects, snapshots, None)?)
}

fn promoted_path(cfg: &Config) -> PathBuf {
    cfg.data_dir.join("promoted.json")
}

/// Local tars of hibernated sandboxes.
/// Before a running sandbox's memory may be dumped: its silkd closes every connection.
fn before_dump(live: &Live, memory: Memory) {
    if live.record.phase == Phase::Running && memory != Memory::Off {
        live.activity.hang_up();
    }
}

fn snapshots_dir(cfg: &Config) -> PathBuf {
    cfg.data_dir.join("snapshots")
}

/// Tars that live for one call (checkpoint, fork, promote, downloads); emptied at start.
fn scratch_dir(cfg: &Config) -> PathBuf {
    cfg.data_dir.join("scratch")
}

pub(super) fn load_promoted(cfg: &Config) -> anyhow::Result<BTreeMap<String, Promoted>> {
    match std::fs::read(promoted_path(cfg)) {
        Ok(bytes) => Ok(serde_json::from_slice(&bytes)?),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(BTreeMap::new()),
        Err(e) => Err(e.into()),
    }
}

/// Removes what a crash left: scratch files, and hibernation tars no record names.
pub(super) fn sweep_files(cfg: &Config, referenced: &[PathBuf]) {
    let _ = std::fs::remove_dir_all(scratch_dir(cfg));
    for dir in [snapshots_dir(cfg), scratch_dir(cfg)] {
        if let Err(e) = std::fs::create_dir_all(&dir) {
            tracing::warn!("mkdir {}: {e}", dir.display());
        }
    }
    let Ok(entries) = std::fs::read_dir(snapshots_dir(cfg)) else { return };
    for entry in entries.flatten() {
        if !referenced.contains(&entry.path()) {
            tracing::info!(file = %entry.path().display(), "removing an unreferenced snapshot");
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

impl Node {
    /// Where the crash tests stop the node, as `kill -9` would: `SANDBOXD_CRASH_AT=<point>`
    /// makes the process SIGKILL itself there; [`Node::crash_at`] makes the call stop there for
    /// good (the in-process tests then drop its runtime, which ends every task at once). Only
    /// builds with the `crash-points` feature (test builds) have them.
    #[cfg(feature = "crash-points")]
    async fn crash_point(&self, point: &str) {
        let stop = {
            let mut at = self.crash_at.lock().unwrap_or_else(|p| p.into_inner());
            let stop = at.as_ref().is_some_and(|(p, _)| p == point);
            if stop {
                at.as_mut().expect("set").1 = true;
            }
            stop
        };
        if stop {
            tracing::error!("crash point {point}: this call stops here");
            std::future::pending::<()>().await;
        }
        if std::env::var_os("SANDBOXD_CRASH_AT").is_some_and(|v| v == point) {
            tracing::error!("crash point {point}: killing this process");
            // SAFETY: plain syscalls.
            unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
        }
    }

    #[cfg(not(feature = "crash-points"))]
    async fn crash_point(&self, _point: &str) {}

    /// The crash point at which calls stop (see `crash_point`).
    #[cfg(feature = "crash-points")]
    pub fn crash_at(&self, point: &str) {
        *self.crash_at.lock().unwrap_or_else(|p| p.into_inner()) = Some((point.to_string(), false));
    }

    /// Whether a call has stopped at the crash point set.
    #[cfg(feature = "crash-points")]
    pub fn stopped_at_crash_point(&self) -> bool {
        self.crash_at
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .is_some_and(|(_, hit)| *hit)
    }
}

/// A sandbox's lifecycle lock, held. Its entry leaves the node's table with the last holder
/// or waiter, so the table holds only ids in use.
pub(super) struct Busy<'a> {
    node: &'a Node,
    id: String,
    guard: Option<tokio::sync::OwnedMutexGuard<()>>,
}

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        let mut st = self.node.lock();
        drop(self.guard.take());
        // Clones are made under the state lock only: one reference left is the table's own.
        st.slots.tidy(&self.id);
    }
}

fn conflict(message: String) -> NodeError {
    NodeError::new(Code::Conflict, message)
}

fn checkpoint_not_found() -> NodeError {
    NodeError::new(Code::NotFound, "no such checkpoint")
}

fn journal_error(e: impl std::fmt::Display) -> NodeError {
    NodeError::internal(format!("journal: {e}"))
}

/// `ck_<32 hex>` → the store name, or the 404 of an unknown checkpoint.
fn checkpoint_name(id: &str) -> Result<SnapshotName, NodeError> {
    id.strip_prefix("ck_")
        .filter(|hex| hex.len() == 32 && hex.bytes().all(|b| b.is_ascii_hexdigit()))
        .and_then(|hex| SnapshotName::checkpoint(hex).ok())
        .ok_or_else(checkpoint_not_found)
}

fn box_spec(r: &ClaimRecord) -> BoxSpec {
    BoxSpec::new(r.size, r.lane)
}

fn waking_elsewhere(id: &str) -> NodeError {
    NodeError::new(
        Code::Moving,
        format!("sandbox {id} is being woken by another node; try again in a moment"),
    )
}

impl Node {
    /// Waits for this sandbox's lifecycle lock.
    pub(super) async fn busy(&self, id: &str) -> Busy<'_> {
        let lock = self.lock().slots.lock(id);
        Busy { node: self, id: id.to_string(), guard: Some(lock.lock_owned().await) }
    }

    /// Journals a claim's new record, then shows it.
    async fn put_record(&self, record: &ClaimRecord) -> Result<(), NodeError> {
        self.journal
            .commit(vec![Change::Put(record.id.clone(), record.into())])
            .await
            .map_err(journal_error)?;
        if let Some(live) = self.lock().slots.claim_mut(&record.id) {
            live.record = record.clone();
        }
        Ok(())
    }

    fn current(&self, id: &str) -> Result<Live, NodeError> {
        self.get(id).ok_or_else(NodeError::sandbox_not_found)
    }

    fn scratch_tar(&self, what: &str) -> PathBuf {
        scratch_dir(&self.cfg).join(format!("{what}-{}.tar", random_hex(8)))
    }

    /// The sandbox's files as a snapshot the caller may read, and whether it is a scratch file
    /// to delete afterwards: a running or stopped box is captured (as it is), a hibernated
    /// sandbox kept as a tar has it already.
    async fn current_files(
        &self,
        live: &Live,
        what: &str,
        memory: Memory,
    ) -> Result<(Snapshot, bool), NodeError> {
        match &live.record.phase {
            Phase::Running | Phase::Stopped => {
                let (engine, id) = (self.engine.clone(), live.record.id.parse::<SandboxId>()?);
                let tar = self.scratch_tar(what);
                before_dump(live, memory);
                let mode = SnapshotMode::KeepRunning;
                let snap = blocking(move || engine.snapshot(&id, mode, memory, &tar)).await?;
                Ok((snap, true))
            }
            Phase::Captured(snap) => Ok(((**snap).clone(), false)),
            Phase::Archived(_) => {
                Err(conflict("a sandbox that is Archived must be woken first".into()))
            }
        }
    }

    // ---- hibernate and wake ----

    /// Stops the sandbox and keeps its files in place (and its memory, as `memory` says).
    /// Idempotent.
    pub async fn hibernate(&self, id: &str, memory: Memory) -> Result<ClaimRecord, NodeError> {
        let _busy = self.busy(id).await;
        let live = self.current(id)?;
        match live.record.state() {
            SandboxState::Hibernated => Ok(live.record),
            SandboxState::Claimed => self.hibernate_locked(live, memory).await,
            other => Err(conflict(format!("a sandbox that is {other:?} cannot be hibernated"))),
        }
    }

    /// The engine stops the box and its files stay where they are: no copy, so hibernating and
    /// waking cost a jail's stop and start whatever the sandbox holds. Nothing is journalled
    /// before: a crash between the stop and the journal leaves a claimed sandbox whose box
    /// stopped, which the next access starts again (`agent_stream`).
    pub(super) async fn hibernate_locked(
        &self,
        live: Live,
        memory: Memory,
    ) -> Result<ClaimRecord, NodeError> {
        let mut rec = live.record.clone();
        live.activity.hang_up();
        let (engine, sid) = (self.engine.clone(), rec.id.parse::<SandboxId>()?);
        let kept = blocking(move || engine.stop(&sid, memory)).await?;
        live.activity.set_memory(kept);
        self.crash_point("hibernate:stopped").await;
        rec.enter(Phase::Stopped, now_ms()).map_err(conflict)?;
        self.put_record(&rec).await?;
        self.metrics.hibernated.fetch_add(1, Ordering::Relaxed);
        Ok(rec)
    }

    /// The sandbox running: as it is, or woken from hibernation or from its archive (with a
    /// fresh lease of its original length). The data plane calls this on every access.
    pub async fn wake(&self, id: &str) -> Result<Live, NodeError> {
        // The fast path: running, and no lifecycle call under way (one may be stopping it).
        {
            let st = self.lock();
            if let Some(live) = st.slots.claim(id)
                && st.slots.free(id)
                && live.record.phase == Phase::Running
            {
                return Ok(live.clone());
            }
        }
        let _busy = self.busy(id).await;
        let live = self.current(id)?;
        self.wake_locked(live).await
    }

    /// [`agent_stream`](Self::agent_stream) run to its end even if the caller goes away: what
    /// every data-plane path opens (a client here, a peer forwarding one).
    pub async fn open_agent(self: &Arc<Self>, id: &str) -> Result<(Live, UnixStream), NodeError> {
        let (node, id) = (self.clone(), id.to_string());
        super::detached(async move { node.agent_stream(&id).await }).await
    }

    /// Splices a data-plane connection to the sandbox's silkd, both ways, until either side
    /// ends or the sandbox stops (hibernate, archive, release); keeps its idle clock paused
    /// meanwhile and counts the bytes. The client's control frames (a request to run a
    /// program, say) are shown to `seen` as they pass, unchanged; a half-close on either side
    /// is passed on to the other.
    pub async fn splice<C>(
        &self,
        live: &Live,
        client: &mut C,
        agent: &mut UnixStream,
        mut seen: impl FnMut(silk_proto::Frame),
    ) where
        C: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let _active = super::Active::new(live);
        let (mut client_rd, mut client_wr) = tokio::io::split(client);
        let (mut agent_rd, mut agent_wr) = agent.split();
        let up = async {
            let (mut sniffer, mut frames) = (silk_proto::Sniffer::default(), vec![]);
            let mut buf = vec![0u8; 64 << 10];
            let mut total = 0u64;
            loop {
                let n = client_rd.read(&mut buf).await?;
                if n == 0 {
                    agent_wr.shutdown().await?;
                    return Ok::<u64, std::io::Error>(total);
                }
                sniffer.feed(&buf[..n], &mut frames);
                frames.drain(..).for_each(&mut seen);
                agent_wr.write_all(&buf[..n]).await?;
                total += n as u64;
            }
        };
        let down = async {
            let n = tokio::io::copy(&mut agent_rd, &mut client_wr).await?;
            client_wr.shutdown().await?;
            Ok::<u64, std::io::Error>(n)
        };
        tokio::select! {
            copied = async { tokio::try_join!(up, down) } => match copied {
                Ok((up, down)) => {
                    self.metrics.relay_bytes.fetch_add(up + down, Ordering::Relaxed);
                }
                Err(e) => tracing::debug!(sandbox = live.record.id, "relay ended: {e}"),
            },
            () = live.activity.hangup.notified() => {}
        }
    }

    /// A connection to the sandbox's silkd, for the data plane: woken first if it sleeps, and
    /// restarted from its files if its silkd died (an OOM kill, a host reboot). Either way the
    /// client sees a slower call, and processes restart as on any wake.
    pub async fn agent_stream(&self, id: &str) -> Result<(Live, UnixStream), NodeError> {
        let live = self.wake(id).await?;
        if let Some(stream) = live.activity.take_ahead() {
            return Ok((live, stream));
        }
        if let Ok(stream) = super::connect_agent(&live.agent).await {
            return Ok((live, stream));
        }
        let _busy = self.busy(id).await;
        let live = self.wake_locked(self.current(id)?).await?;
        let refused = match super::connect_agent(&live.agent).await {
            Ok(stream) => return Ok((live, stream)), // another call brought it back
            Err(e) => e,
        };
        let engine = self.engine.clone();
        let boxes = blocking(move || engine.list()).await?;
        if boxes.iter().any(|b| b.id.as_str() == id && b.running) {
            return Err(NodeError::new(
                Code::AgentUnavailable,
                format!("connect to silkd: {refused}"),
            ));
        }
        tracing::warn!(sandbox = id, "its silkd is gone; restarting the sandbox from its files");
        self.hibernate_locked(live, Memory::Off).await?;
        let live = self.wake_locked(self.current(id)?).await?;
        self.metrics.restarted.fetch_add(1, Ordering::Relaxed);
        let stream = super::connect_agent(&live.agent).await.map_err(|e| {
            NodeError::new(Code::AgentUnavailable, format!("connect to silkd after a restart: {e}"))
        })?;
        Ok((live, stream))
    }

    async fn wake_locked(&self, live: Live) -> Result<Live, NodeError> {
        if matches!(live.record.intent, Some(Intent::Move { .. })) {
            // Starting it here could make a second copy of one the target already runs.
            return Err(NodeError::new(
                Code::Moving,
                "the sandbox is moving to another node; try again in a moment",
            ));
        }
        let engine = self.engine.clone();
        match live.record.phase.clone() {
            Phase::Running => Ok(live),
            Phase::Stopped => {
                let sid = live.record.id.parse::<SandboxId>()?;
                let info = blocking(move || engine.resume(&sid)).await?;
                self.start_from(live, info, false, None).await
            }
            Phase::Captured(snap) => {
                let (s, spec) = (snap.clone(), box_spec(&live.record));
                let sid = live.record.id.parse::<SandboxId>()?;
                let info = blocking(move || engine.restore(&s, &sid, &spec, Memory::Auto)).await?;
                let woken = self.start_from(live, info, true, None).await?;
                let _ = std::fs::remove_file(&snap.layer_tar);
                Ok(woken)
            }
            Phase::Archived(archive) => {
                // Any node may wake an archive: under its lease, and only if nobody did.
                let id = live.record.id.clone();
                self.under_wake_lease(&id, self.wake_archived(live, archive)).await
            }
        }
    }

    /// Wakes an archived sandbox here, its lease held.
    async fn wake_archived(&self, live: Live, archive: String) -> Result<Live, NodeError> {
        if self.still_archived(&live.record.id).await == Some(false) {
            // Woken on another node while this one was away from the mesh.
            let id = live.record.id.clone();
            self.journal.commit(vec![Change::Delete(id.clone())]).await.map_err(journal_error)?;
            self.lock().slots.remove_claim(&id);
            return Err(NodeError::new(
                Code::Moving,
                "this sandbox now lives on another node; try again",
            ));
        }
        let name = SnapshotName::archive(&archive).map_err(NodeError::from)?;
        let (engine, sid, spec) =
            (self.engine.clone(), live.record.id.parse::<SandboxId>()?, box_spec(&live.record));
        let restored = async {
            let manifest = self.store.manifest(&name).await?;
            self.download_into(&name, manifest, move |input, snap| {
                engine.read_snapshot(input, snap, &sid, &spec, Memory::Auto)
            })
            .await
        };
        let info = restored.await.map_err(|e: NodeError| match e.code {
            Code::NotFound => {
                NodeError::internal(format!("the archive {name} is missing from the store"))
            }
            _ => e,
        })?;
        let woken = self.start_from(live, info, true, Some(&archive)).await?;
        self.crash_point("wake:journalled").await;
        self.finish_unpublish(&woken.record.id, &archive).await?;
        self.current(&woken.record.id)
    }

    /// The end of a wake from an archive (the sandbox's lock held): the published claim and the
    /// archive leave the store, then the record's `Unpublish` intent is cleared. Until then a restart does the same
    /// (`recover`), so no stale archive is left for another node to wake.
    pub(super) async fn finish_unpublish(&self, id: &str, archive: &str) -> Result<(), NodeError> {
        if !self.unpublish_archived(id).await {
            return Ok(()); // the store is down: the next start tries again
        }
        self.drop_archive(archive).await;
        let mut rec = self.current(id)?.record;
        if rec.intent == Some(Intent::Unpublish(archive.to_string())) {
            rec.intent = None;
            self.put_record(&rec).await?;
        }
        Ok(())
    }

    /// Journals running a stopped sandbox the engine started again as `info`: `restored` from a
    /// snapshot, or resumed on its stopped box's files. Woken `from_archive`, it gets a fresh
    /// lease and the archive's removal as its intent.
    async fn start_from(
        &self,
        live: Live,
        info: BoxInfo,
        restored: bool,
        from_archive: Option<&str>,
    ) -> Result<Live, NodeError> {
        let mut rec = live.record.clone();
        let now = now_ms();
        rec.enter(Phase::Running, now).map_err(conflict)?;
        rec.intent = from_archive.map(|a| Intent::Unpublish(a.to_string()));
        // From an archive, or after its lease ran out asleep (`on_expire: hibernate`): a new
        // lease, or the reaper would put it back to sleep at once.
        if from_archive.is_some() || rec.deadline_ms <= now {
            rec.deadline_ms = lease_end(now, rec.lease_seconds);
        }
        if let Err(e) = self.put_record(&rec).await {
            if restored {
                self.teardown(info.id);
            } else if let Err(s) = blocking({
                let (engine, id) = (self.engine.clone(), info.id.clone());
                move || engine.stop(&id, Memory::Off).map(drop)
            })
            .await
            {
                tracing::warn!(sandbox = rec.id, "stopping again after a failed wake: {s}");
            }
            return Err(e);
        }
        let answered = self.answered(&info);
        let woken = Live {
            record: rec,
            agent: info.agent.clone(),
            address: info.address,
            base: Some(info.base),
            activity: live.activity.clone(),
        };
        woken.activity.last_ms.store(now, Ordering::Relaxed);
        woken.activity.set_memory(info.memory.clone());
        // The wake's caller (a relay, mostly: a wake on access) takes it.
        if let Some(answered) = answered {
            woken.activity.keep_ahead(answered);
        }
        self.lock().slots.insert_claim(woken.record.id.clone(), woken.clone());
        self.metrics.woken.fetch_add(1, Ordering::Relaxed);
        Ok(woken)
    }
}
