//! Engines run sandboxes behind one trait.
//!
//! An [`Engine`] turns a [`TemplateDef`] into an immutable [`Template`] (named by a blake3
//! digest), a template plus its warmup into a [`Golden`], and goldens into running sandboxes
//! (the clone tier) — or templates straight into sandboxes (the cold tier). It snapshots
//! sandboxes into a portable layer and restores them, lists what it runs (also after the node
//! process died) and destroys it without leftovers. A capability an engine lacks is an
//! [`EngineError::Unsupported`], never a silent degrade.
//!
//! The trait is synchronous: every operation is a handful of syscalls or a child process, and the
//! node runs them on blocking threads. The `jail` backend (namespaces, overlayfs, cgroups,
//! seccomp) is in [`jail`]; VM backends will implement the same trait.

pub mod agent;
mod error;
#[cfg(feature = "fake")]
pub mod fake;
pub mod jail;
pub mod layer;
mod oci;
pub mod probe;
mod template;
mod types;

pub use error::EngineError;
pub use template::{PulledImage, TemplateDef, TemplateSource};
pub use types::*;

use std::path::Path;

pub type Result<T, E = EngineError> = std::result::Result<T, E>;

/// What every backend implements. See the crate docs.
pub trait Engine: Send + Sync + std::fmt::Debug {
    /// A short name, e.g. `jail`.
    fn name(&self) -> &'static str;

    fn capabilities(&self) -> Caps;

    /// Resolves (and on first use imports) a template. Same definition, same digest.
    fn template(&self, def: &TemplateDef) -> Result<Template>;

    /// Builds the golden of `template`: boot once, run the warmup, freeze the result. Returns the
    /// existing golden when one with the same digest (template + warmup) is already built.
    fn prepare(&self, template: &Template, warmup: &Warmup) -> Result<Golden>;

    /// The digest [`prepare`](Self::prepare) gives the golden of `template` + `warmup`, without
    /// building anything: nodes use it to find that golden in a shared store.
    fn golden_digest(&self, template: &Template, warmup: &Warmup) -> Digest;

    /// A golden this engine already holds.
    fn find_golden(&self, digest: &Digest) -> Option<Golden>;

    /// Writes a golden's layer as a layer tar, to share it with other nodes.
    fn export_golden(&self, golden: &Golden, into: &Path) -> Result<()>;

    /// Installs a golden exported by any engine whose template has the same digest. Returns the
    /// one already held when there is one.
    fn import_golden(
        &self,
        template: &Template,
        digest: &Digest,
        layer_tar: &Path,
    ) -> Result<Golden>;

    /// The clone tier: a new sandbox on top of a golden. Returns once silkd answered `info`.
    fn clone_golden(&self, golden: &Golden, id: &SandboxId, spec: &BoxSpec) -> Result<BoxInfo>;

    /// The cold tier: a new sandbox straight from the template (no warmup result).
    fn boot(&self, template: &Template, id: &SandboxId, spec: &BoxSpec) -> Result<BoxInfo>;

    /// Captures a sandbox's filesystem changes (and its memory where the engine can) into the
    /// file `into`, which appears only once the capture is complete (a crash mid-capture leaves
    /// no file there, and the source as it was). The file belongs to the caller. A `Stop`
    /// snapshot is on disk before the sandbox goes; a `KeepRunning` one need not survive a host
    /// crash (the sandbox still has its files). A sandbox that
    /// stopped on its own (its agent died, the host rebooted) can still be captured: its files
    /// are all there is, and restoring them is how it comes back.
    fn snapshot(
        &self,
        id: &SandboxId,
        mode: SnapshotMode,
        memory: Memory,
        into: &Path,
    ) -> Result<Snapshot>;

    /// Stops a sandbox and keeps its files where they are (the cheap hibernate), and its
    /// processes' memory beside them where the engine can and `memory` allows (`Required`: or
    /// fail, the sandbox running on as it was). `resume` starts it again; `snapshot` can still
    /// capture it. Stopping a stopped sandbox does nothing.
    fn stop(&self, id: &SandboxId, memory: Memory) -> Result<MemoryKept>;

    /// Starts a stopped sandbox again: its processes from their memory if `stop` kept it (else,
    /// or if that fails, restarted on its files; `BoxInfo::memory` says which); a running one is
    /// answered as it is. A failure leaves it stopped, its files kept.
    fn resume(&self, id: &SandboxId) -> Result<BoxInfo>;

    /// Freezes a snapshot as a golden: the base's golden (if any) and the snapshot's changes
    /// merged into one read-only layer, so new sandboxes clone from it (promote).
    fn golden_from_snapshot(&self, snapshot: &Snapshot) -> Result<Golden>;

    /// A new sandbox from a snapshot: wake, branch and fork all land here. Its processes come
    /// back from the snapshot's memory where it has some and `memory` allows (`Required`: or
    /// fail); `BoxInfo::memory` says whether they did.
    fn restore(
        &self,
        snapshot: &Snapshot,
        id: &SandboxId,
        spec: &BoxSpec,
        memory: Memory,
    ) -> Result<BoxInfo>;

    /// `restore` from a snapshot read from `input` as it arrives (a download), rather than from
    /// its file: `snapshot` says what it is, and its `layer_tar` is a scratch path the engine
    /// may use. `input` ends in an error where the bytes stopped short of the whole; the
    /// sandbox is then not made. The default writes `input` to the scratch file, restores from
    /// it and removes it; the jail engine unpacks the files as they come.
    fn read_snapshot(
        &self,
        input: &mut dyn std::io::Read,
        snapshot: &Snapshot,
        id: &SandboxId,
        spec: &BoxSpec,
        memory: Memory,
    ) -> Result<BoxInfo> {
        let scratch = &snapshot.layer_tar;
        let copied = std::fs::File::create(scratch).and_then(|mut f| std::io::copy(input, &mut f));
        let restored = copied
            .map_err(EngineError::io("read the snapshot"))
            .and_then(|_| self.restore(snapshot, id, spec, memory));
        let _ = std::fs::remove_file(scratch);
        restored
    }

    /// `ids.len()` new sandboxes from one snapshot (fork), all or none: what `restore` does for
    /// each, where an engine may share the snapshot's files among them (the jail engine unpacks
    /// them once, into a read-only layer under every copy's own).
    fn restore_many(
        &self,
        snapshot: &Snapshot,
        ids: &[SandboxId],
        spec: &BoxSpec,
        memory: Memory,
    ) -> Result<Vec<BoxInfo>> {
        let mut made = vec![];
        for id in ids {
            match self.restore(snapshot, id, spec, memory) {
                Ok(info) => made.push(info),
                Err(e) => {
                    for info in made {
                        let _ = self.destroy(&info.id);
                    }
                    return Err(e);
                }
            }
        }
        Ok(made)
    }

    /// Writes a sandbox's snapshot to `out` as a stream: the bytes `snapshot(KeepRunning)`
    /// would put in its file (its memory first, dumped now from a running sandbox or kept by
    /// `stop`, as `memory` says), with no file of the engine's between the box and `out`. The
    /// box stays as it is; a running one is frozen until `out` took the last byte, so hand it
    /// an `out` that keeps up (the node spools a running sandbox's stream through a scratch
    /// file, and pipes a stopped one's straight into the store). The default goes through a
    /// snapshot in the file `scratch` (removed after).
    ///
    /// With `keep`, an engine that can also keeps a copy of what it captured on this host,
    /// named `keep` (letters, digits, `-`, `_`), for [`Engine::restore_kept`] to start new
    /// sandboxes from without reading the stream back (a checkpoint's branches on the node
    /// that took it); `Streamed::kept` says whether it did. The copy is the caller's to drop;
    /// the engine drops every copy when it starts. The default keeps none.
    fn write_snapshot(
        &self,
        id: &SandboxId,
        memory: Memory,
        out: &mut dyn crate::SnapshotSink,
        scratch: &Path,
        keep: Option<&str>,
    ) -> Result<Streamed> {
        let _ = keep;
        let snapshot = self.snapshot(id, SnapshotMode::KeepRunning, memory, scratch)?;
        let copied = std::fs::File::open(scratch).and_then(|mut f| std::io::copy(&mut f, out));
        let _ = std::fs::remove_file(scratch);
        copied.map_err(EngineError::io("write the snapshot"))?;
        Ok(Streamed { memory: snapshot.memory_kept(), freeze_ms: snapshot.freeze_ms, kept: None })
    }

    /// `ids.len()` copies of the sandbox `source` as it is now (it runs on, or stays stopped),
    /// all or none: its snapshot restored `ids.len()` times, taken through the file `scratch`
    /// (removed after), where an engine may do without it (the jail engine copies the files
    /// straight into the layer its copies share).
    fn fork(
        &self,
        source: &SandboxId,
        ids: &[SandboxId],
        spec: &BoxSpec,
        memory: Memory,
        scratch: &Path,
    ) -> Result<Vec<BoxInfo>> {
        let snapshot = self.snapshot(source, SnapshotMode::KeepRunning, memory, scratch)?;
        let made = self.restore_many(&snapshot, ids, spec, memory);
        let _ = std::fs::remove_file(scratch);
        made
    }

    /// A new sandbox from the copy `write_snapshot` kept as `name`: what `restore` makes of
    /// that snapshot, its processes from the copy's memory where it holds some and `memory`
    /// allows. `Ok(None)` when no copy of that name is kept.
    fn restore_kept(
        &self,
        name: &str,
        id: &SandboxId,
        spec: &BoxSpec,
        memory: Memory,
    ) -> Result<Option<BoxInfo>> {
        let _ = (name, id, spec, memory);
        Ok(None)
    }

    /// Drops the copy kept as `name` (sandboxes started from it keep what they use of it).
    fn drop_kept(&self, name: &str) {
        let _ = name;
    }

    /// Why this engine keeps no process memory (`None` when it does).
    fn memory_why_not(&self) -> Option<String> {
        (!self.capabilities().memory_snapshot).then(|| "not supported by this engine".into())
    }

    /// Stops a sandbox and removes every trace of it. Unknown ids are `NotFound`.
    fn destroy(&self, id: &SandboxId) -> Result<()>;

    /// Every sandbox this engine started that still exists, running or not.
    fn list(&self) -> Result<Vec<BoxInfo>>;

    /// Where the sandbox's silkd listens.
    fn agent(&self, id: &SandboxId) -> Result<AgentAddr>;

    /// The connection on which the last start of `id` was found ready (its silkd answered
    /// `info` on it), if no one took it yet and it is a few seconds old at most: the caller's
    /// first call then opens no connection into the sandbox. Non-blocking. Engines that keep
    /// none answer `None`.
    fn take_answered(&self, _id: &SandboxId) -> Option<std::os::unix::net::UnixStream> {
        None
    }
}
