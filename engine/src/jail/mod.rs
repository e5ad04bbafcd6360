//! The `jail` engine: each sandbox is a set of Linux namespaces around an overlayfs root, with
//! silkd as PID 1, limits through cgroups, and a seccomp filter. Runs on any Linux host as root.
//!
//! On disk, under the data directory (every directory 0700, root's only):
//! ```text
//! templates/<kind>-<digest>/root     materialised templates (host skeletons, flattened images)
//! goldens/<digest>/{layer,golden.json,ids}   warmup results, read-only lower layers
//! forks/<name>/{layer,ref,ids}       a fork's files, shared by its copies (see `forks`)
//! boxes/<id>/{box.json,root,lower,agent.log,fork}
//! boxes/<id>/[disk/]{upper,work}      the sandbox's files (in `disk/` where its disk is bounded)
//! boxes/<id>/disk.img                the sandbox's disk, where it is an ext4 image
//! disks/<engine>/<n>/{disk.img,disk,root,lower}   boxes with a mounted image, made ahead (see `disk`)
//! ```
//! `box.json` is the record [`Engine::list`] reads back after the node restarts; a sandbox is
//! running when the pid it names is alive *and* has the start time recorded with it, so a reused
//! pid is never mistaken for a jail.
//!
//! **Ids.** Every sandbox runs in the engine's one user namespace, whose root is host uid/gid
//! `id_base` (65536 ids from there). Files a sandbox makes (its upper directory, goldens built by
//! warmups) are stored with those host ids; layer tars carry the ids the sandbox sees
//! ([`layer::Ids`]), so snapshots move between nodes with other ranges. Templates keep host ids
//! and are mounted through id-mapped views, so their root-owned files look root-owned inside.
//! One range for all sandboxes rather than one each: goldens and templates are shared read-only
//! by every sandbox and would otherwise need an id-mapped view per range and layer; what keeps
//! neighbours apart is that no sandbox can reach another's files or processes (mount and pid
//! namespaces, 0700 box directories), not their uids.
//!
//! **Host code never follows a sandbox's paths.** Where the engine touches a sandbox's files:
//! the launcher (see [`launch`]: mount targets through `openat2(RESOLVE_IN_ROOT)`, its two file
//! writes as the sandbox's root after `pivot_root`); [`layer::capture`] of an upper directory,
//! fork layer or golden layer (`O_NOFOLLOW` per component, relative to directory descriptors,
//! with the sandbox frozen or stopped); [`layer::apply`] into a fresh upper directory, fork
//! layer or staging directory no sandbox runs on yet (paths resolved inside the root; device
//! nodes skipped); `chown` of a new upper directory; [`layer::shift_ids`] of a stopped box or
//! an unused fork layer (`lchown`, no link followed); removal of a stopped box or a fork layer
//! no box uses (`remove_dir_all`, which does not follow symlinks, on a thread with a stack for
//! any depth a sandbox can nest directories to).

mod cgroup;
mod config;
mod criu;
mod dev_check;
mod disk;
mod forks;
mod goldens;
mod host;
mod ids;
mod kept;
pub mod launch;
mod launcher;
mod mapped;
mod memory;
mod net;
mod outside;
pub mod seccomp;
mod snapshot;
mod start;
mod trash;
mod unmounting;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::layer::{ID_COUNT, Ids};
use crate::template::{self, TemplateDef};
use crate::{
    AgentAddr, Base, BoxInfo, BoxSpec, Caps, Digest, DiskMechanism, Engine, EngineError, Golden,
    Memory, MemoryKept, Result, SandboxId, Snapshot, SnapshotMode, Streamed, Template, Warmup,
};
use cgroup::Cgroups;
pub use config::JailConfig;
pub use disk::{DiskSizes, unmount_under};
use host::partial_path;
pub(crate) use host::start_time;
pub use ids::user_namespace;
use launch::AGENT_NAME;
pub use net::LaneNet;
pub use outside::{recorded_boxes, remove_all};
use snapshot::SnapshotInput;
use start::Seed;

/// The default host uid/gid of a sandbox's root: inside systemd's range for containers
/// (524288–1879048191), far from the ranges `useradd` hands out in /etc/subuid (100000 up).
pub const DEFAULT_ID_BASE: u32 = 0x6000_0000;

/// Where a jail's silkd listens: [`AGENT_NAME`] in the network namespace of its init.
fn agent_addr(pid: u32, start_time: Option<u64>) -> AgentAddr {
    AgentAddr::Netns { pid, start_time: start_time.unwrap_or(0), name: AGENT_NAME.to_string() }
}

#[derive(Debug)]
pub struct JailEngine {
    cfg: JailConfig,
    cgroups: Cgroups,
    ids: Ids,
    /// Starts jails; holds the user namespace every sandbox enters (its maps written once,
    /// here).
    launcher: launcher::Launcher,
    disks: disk::Disks,
    /// CRIU, or why memory is not kept.
    criu: std::result::Result<criu::Criu, String>,
    memory_key: [u8; 32],
    /// Names this engine's cgroups and staging directories apart from other engines'.
    instance: String,
    /// The egress lane's addresses, when it is offered.
    addresses: Option<net::Addresses>,
    /// Where destroyed boxes are deleted from, behind the destroy.
    trash: trash::Trash,
    /// Stopped jails' overlays, unmounted behind the stop.
    unmounting: unmounting::Unmounting,
    /// The connections starts were found ready on, for their sandboxes' first callers.
    answered: crate::probe::Answered,
}

impl Drop for JailEngine {
    fn drop(&mut self) {
        // Sandboxes that outlive the engine (claims across a node's restart) keep theirs.
        self.cgroups.remove_parents();
    }
}

/// The memory images of a golden built with `Warmup::memory`, beside its layer.
fn golden_images(golden: &Golden) -> Option<PathBuf> {
    let images = golden.layer.parent()?.join("memory");
    images.join("memory.json").is_file().then_some(images)
}

/// What `boxes/<id>/box.json` holds.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Record {
    info: BoxInfo,
    /// `/proc/<pid>/stat` start time of the jail's init, to tell it from a reused pid.
    start_time: Option<u64>,
    /// The host id range the upper directory's files are stored in (`None`: made before
    /// sandboxes had a user namespace, stored with host ids 0..65536).
    #[serde(default)]
    id_base: Option<u32>,
}

impl JailEngine {
    pub fn new(cfg: JailConfig) -> Result<JailEngine> {
        // SAFETY: plain syscall.
        if unsafe { libc::geteuid() } != 0 {
            return Err(EngineError::Host("the jail engine needs root".into()));
        }
        let filesystems = std::fs::read_to_string("/proc/filesystems").unwrap_or_default();
        if !filesystems.contains("overlay") {
            return Err(EngineError::Host("overlayfs is not available (modprobe overlay)".into()));
        }
        for tool in [&cfg.silkd, &cfg.launcher] {
            if !tool.is_file() {
                return Err(EngineError::Host(format!("{} not found", tool.display())));
            }
        }
        if cfg.id_base < ID_COUNT || cfg.id_base.checked_add(ID_COUNT).is_none() {
            return Err(EngineError::Host(format!(
                "id_base {} must be at least {ID_COUNT} and leave {ID_COUNT} ids below 2^32",
                cfg.id_base
            )));
        }
        // Sandboxes' files (setuid ones too) sit under these: nobody but root gets in.
        for dir in ["", "templates", "goldens", "forks", "boxes", "disks", "trash"] {
            let d = cfg.data_dir.join(dir);
            std::fs::create_dir_all(&d)
                .and_then(|()| std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o700)))
                .map_err(EngineError::io(format!("mkdir {}", d.display())))?;
        }
        // Before anything else here is cleared: such a process holds a destroyed box's images.
        host::kill_orphaned_criu(&cfg.data_dir);
        let hash = blake3::hash(cfg.data_dir.as_os_str().as_encoded_bytes()).to_hex();
        let instance = hash[..12].to_string();
        let cgroups = Cgroups::detect(&cfg.cgroup_root, format!("silkmesh-{instance}"))?;
        let ids = Ids { base: cfg.id_base };
        let launcher = launcher::Launcher::new(&cfg.launcher, user_namespace(&cfg.launcher, ids)?);
        let disks = disk::Disks::open(&cfg.data_dir, cfg.disk, cfg.bound_disks);
        let criu = match cfg.memory {
            true => criu::probe(cfg.criu.as_deref()),
            false => Err("turned off in the configuration".into()),
        };
        if let Err(why) = &criu {
            tracing::info!("sandboxes keep their files, not their memory: {why}");
        }
        let memory_key = memory::memory_key(&cfg.data_dir, cfg.memory_key)?;
        let trash = trash::Trash::open(cfg.data_dir.join("trash"))
            .map_err(EngineError::io("open the trash directory"))?;
        let unmounting = unmounting::Unmounting::start()
            .map_err(EngineError::io("start the unmounting thread"))?;
        let addresses = cfg.lane.clone().map(|lane| {
            let taken = recorded_boxes(&cfg.data_dir).into_iter().filter_map(|b| b.address);
            net::Addresses::new(lane, taken)
        });
        let engine = JailEngine {
            cfg,
            cgroups,
            ids,
            launcher,
            disks,
            criu,
            memory_key,
            instance,
            addresses,
            trash,
            unmounting,
            answered: Default::default(),
        };
        engine.remove_incomplete()?;
        engine.thaw_all();
        engine.stop_unconfined();
        engine.shift_old_goldens()?;
        engine.drop_copies();
        engine.sweep_forks()?;
        Ok(engine)
    }

    /// The pid of the launcher this engine keeps running (`silk-jail --serve`, see
    /// `launch::serve`), while one runs: it starts on the first sandbox start.
    pub fn launcher_pid(&self) -> Option<u32> {
        self.launcher.pid()
    }

    /// A box directory without a readable `box.json` is a start that a crash interrupted (the
    /// record is written right after the launch). Nothing can own it: kill what runs in its
    /// cgroups and remove it, so a crash mid-start leaks nothing.
    fn remove_incomplete(&self) -> Result<()> {
        let entries = std::fs::read_dir(self.cfg.data_dir.join("boxes"))
            .map_err(EngineError::io("read boxes"))?;
        for entry in entries.flatten() {
            let Ok(id) = entry.file_name().to_string_lossy().parse::<SandboxId>() else { continue };
            if self.record(&id).is_err() {
                tracing::warn!(sandbox = %id, "removing a sandbox whose start was interrupted");
                self.cgroups.remove(&id)?;
                disk::remove_box(&entry.path()).map_err(EngineError::io(format!("remove {id}")))?;
            }
        }
        Ok(())
    }

    /// A sandbox is frozen only inside `snapshot`; one still frozen now was caught there by a
    /// crash. Thaw it, so a crash mid-snapshot leaves the source running as it was.
    fn thaw_all(&self) {
        let Ok(entries) = std::fs::read_dir(self.cfg.data_dir.join("boxes")) else { return };
        for entry in entries.flatten() {
            let Ok(id) = entry.file_name().to_string_lossy().parse::<SandboxId>() else { continue };
            if let Err(e) = self.cgroups.freeze(&id, false) {
                tracing::debug!(sandbox = %id, "thaw at start: {e}");
            }
        }
    }

    fn box_dir(&self, id: &SandboxId) -> PathBuf {
        self.cfg.data_dir.join("boxes").join(id.as_str())
    }

    fn record(&self, id: &SandboxId) -> Result<Record> {
        let bytes = std::fs::read(self.box_dir(id).join("box.json"))
            .map_err(|_| EngineError::NotFound(id.to_string()))?;
        serde_json::from_slice(&bytes)
            .map_err(|e| EngineError::Host(format!("corrupt box.json of {id}: {e}")))
    }

    fn save(&self, record: &Record) -> Result<()> {
        let dir = self.box_dir(&record.info.id);
        let tmp = dir.join("box.json.tmp");
        let json =
            serde_json::to_vec_pretty(record).map_err(|e| EngineError::Host(e.to_string()))?;
        std::fs::write(&tmp, json).map_err(EngineError::io("write box.json"))?;
        std::fs::rename(&tmp, dir.join("box.json")).map_err(EngineError::io("commit box.json"))
    }

    /// Kills the jail (PID 1 first: the kernel then kills the whole pid namespace) and removes
    /// its cgroups.
    fn kill(&self, id: &SandboxId, pid: Option<u32>) -> Result<()> {
        self.answered.forget(id);
        let address = self.record(id).ok().and_then(|r| r.info.address);
        if let Some(pid) = pid {
            // SAFETY: plain syscall; callers pass a pid checked against its recorded start time.
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        }
        self.cgroups.remove(id)?;
        if let Some(pid) = pid {
            host::wait_exited(pid);
        }
        if let (Some(lane), Some(addr)) = (self.lane(), address) {
            net::detach(lane, addr);
        }
        Ok(())
    }

    /// The egress lane, when it is offered.
    fn lane(&self) -> Option<&LaneNet> {
        self.addresses.as_ref().map(|a| &a.lane)
    }

    fn live_pid(&self, record: &Record) -> Option<u32> {
        let pid = record.info.pid?;
        (start_time(pid).is_some() && start_time(pid) == record.start_time).then_some(pid)
    }

    fn golden_dir(&self, digest: &Digest) -> PathBuf {
        self.cfg.data_dir.join("goldens").join(digest.short())
    }
}

impl Engine for JailEngine {
    fn name(&self) -> &'static str {
        "jail"
    }

    fn capabilities(&self) -> Caps {
        Caps {
            memory_snapshot: self.criu.is_ok(),
            egress: self.addresses.is_some(),
            disk_limit: self.disks.mechanism() != DiskMechanism::None,
            disk_mechanism: self.disks.mechanism(),
        }
    }

    fn template(&self, def: &TemplateDef) -> Result<Template> {
        template::resolve(def, &self.cfg.data_dir.join("templates"))
    }

    fn golden_digest(&self, template: &Template, warmup: &Warmup) -> Digest {
        let mut hasher = blake3::Hasher::new();
        hasher.update(b"silk-golden-v1").update(template.digest.as_str().as_bytes());
        for arg in &warmup.argv {
            hasher.update(&(arg.len() as u64).to_le_bytes()).update(arg.as_bytes());
        }
        if warmup.memory {
            hasher.update(b"\0memory");
        }
        Digest::of(&hasher)
    }

    fn find_golden(&self, digest: &Digest) -> Option<Golden> {
        let bytes = std::fs::read(self.golden_dir(digest).join("golden.json")).ok()?;
        serde_json::from_slice::<Golden>(&bytes).ok().filter(|g| g.digest == *digest)
    }

    fn export_golden(&self, golden: &Golden, into: &Path) -> Result<()> {
        self.write_golden_tar(golden, into)
    }

    fn import_golden(
        &self,
        template: &Template,
        digest: &Digest,
        layer_tar: &Path,
    ) -> Result<Golden> {
        self.install_golden(template, digest, layer_tar)
    }

    fn prepare(&self, template: &Template, warmup: &Warmup) -> Result<Golden> {
        self.build_golden(template, warmup)
    }

    fn clone_golden(&self, golden: &Golden, id: &SandboxId, spec: &BoxSpec) -> Result<BoxInfo> {
        let base = Base { template: golden.template.clone(), golden: Some(golden.clone()) };
        let seed = match golden_images(golden) {
            Some(images) if self.criu.is_ok() => Seed::GoldenMemory(images),
            _ => Seed::Fresh,
        };
        self.create(base, id, spec, seed, true)
    }

    fn boot(&self, template: &Template, id: &SandboxId, spec: &BoxSpec) -> Result<BoxInfo> {
        self.create(Base { template: template.clone(), golden: None }, id, spec, Seed::Fresh, true)
    }

    fn snapshot(
        &self,
        id: &SandboxId,
        mode: SnapshotMode,
        memory: Memory,
        into: &Path,
    ) -> Result<Snapshot> {
        self.take_snapshot(id, mode, memory, into)
    }

    fn golden_from_snapshot(&self, snapshot: &Snapshot) -> Result<Golden> {
        self.merge_golden(snapshot)
    }

    fn restore(
        &self,
        snapshot: &Snapshot,
        id: &SandboxId,
        spec: &BoxSpec,
        memory: Memory,
    ) -> Result<BoxInfo> {
        let seed = Seed::Snapshot(SnapshotInput::File(&snapshot.layer_tar), memory);
        self.create(snapshot.base.clone(), id, spec, seed, true)
    }

    fn read_snapshot(
        &self,
        input: &mut dyn std::io::Read,
        snapshot: &Snapshot,
        id: &SandboxId,
        spec: &BoxSpec,
        memory: Memory,
    ) -> Result<BoxInfo> {
        let seed = Seed::Snapshot(SnapshotInput::Stream(input, snapshot.vouched), memory);
        self.create(snapshot.base.clone(), id, spec, seed, true)
    }

    fn write_snapshot(
        &self,
        id: &SandboxId,
        memory: Memory,
        out: &mut dyn crate::SnapshotSink,
        scratch: &Path,
        keep: Option<&str>,
    ) -> Result<Streamed> {
        self.stream_snapshot(id, memory, out, scratch, keep)
    }

    fn restore_kept(
        &self,
        name: &str,
        id: &SandboxId,
        spec: &BoxSpec,
        memory: Memory,
    ) -> Result<Option<BoxInfo>> {
        self.restore_copy(name, id, spec, memory)
    }

    fn drop_kept(&self, name: &str) {
        self.drop_copy(name)
    }

    fn fork(
        &self,
        source: &SandboxId,
        ids: &[SandboxId],
        spec: &BoxSpec,
        memory: Memory,
        _scratch: &Path,
    ) -> Result<Vec<BoxInfo>> {
        self.fork_box(source, ids, spec, memory)
    }

    fn restore_many(
        &self,
        snapshot: &Snapshot,
        ids: &[SandboxId],
        spec: &BoxSpec,
        memory: Memory,
    ) -> Result<Vec<BoxInfo>> {
        match ids {
            [] => Ok(vec![]),
            [id] => Ok(vec![self.restore(snapshot, id, spec, memory)?]),
            ids => self.restore_forks(snapshot, ids, spec, memory),
        }
    }

    fn stop(&self, id: &SandboxId, memory: Memory) -> Result<MemoryKept> {
        self.stop_box(id, memory)
    }

    fn resume(&self, id: &SandboxId) -> Result<BoxInfo> {
        self.resume_box(id)
    }

    fn memory_why_not(&self) -> Option<String> {
        self.criu.as_ref().err().cloned()
    }

    fn destroy(&self, id: &SandboxId) -> Result<()> {
        let record = self.record(id)?;
        self.kill(id, self.live_pid(&record))?;
        // A stop's overlay still held: it must be gone before its disk is.
        self.unmounting.wait(id);
        if let (Some(addresses), Some(addr)) = (&self.addresses, record.info.address) {
            addresses.give_back(addr);
        }
        let dir = self.box_dir(id);
        let fork = self.fork_of(&dir);
        let removed = || -> std::io::Result<()> {
            disk::unmount_disk(&dir)?;
            if fork.is_some() {
                // Its link to the shared layer goes now: the release below counts the links.
                let _ = std::fs::remove_file(dir.join("fork"));
            }
            self.trash.discard(&dir)
        };
        removed().map_err(EngineError::io(format!("remove sandbox {id}")))?;
        if let Some(fork) = fork {
            self.release_fork(&fork);
        }
        Ok(())
    }

    fn list(&self) -> Result<Vec<BoxInfo>> {
        std::fs::read_dir(self.cfg.data_dir.join("boxes"))
            .map_err(EngineError::io("read boxes"))?;
        Ok(recorded_boxes(&self.cfg.data_dir))
    }

    fn agent(&self, id: &SandboxId) -> Result<AgentAddr> {
        Ok(self.record(id)?.info.agent)
    }

    fn take_answered(&self, id: &SandboxId) -> Option<std::os::unix::net::UnixStream> {
        self.answered.take(id)
    }
}
