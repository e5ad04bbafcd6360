//! The `jail` engine: each sandbox is a set of Linux namespaces around an overlayfs root, with
//! silkd as PID 1, limits through cgroups, and a seccomp filter. Runs on any Linux host as root.
//!
//! On disk, under the data directory (every directory 0700, root's only):
//! ```text
//! templates/<kind>-<digest>/root     materialised templates (host skeletons, flattened images)
//! goldens/<digest>/{layer,golden.json,ids}   warmup results, read-only lower layers
//! forks/<name>/{layer,ref,ids}       a fork's files, shared by its copies (see `forks`)
//! boxes/<id>/{box.json,launch.json,root,lower,agent.log,fork}
//! boxes/<id>/[disk/]{upper,work}      the sandbox's files (in `disk/` where its disk is bounded)
//! boxes/<id>/disk.img                the sandbox's disk, where it is an ext4 image
//! disks/<engine>/<n>/{disk.img,mnt}    images made ahead (see `disk`)
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
mod disk;
mod forks;
mod goldens;
mod host;
mod ids;
pub mod launch;
mod memory;
mod net;
mod outside;
pub mod seccomp;
mod snapshot;

use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;

use serde::{Deserialize, Serialize};

use crate::layer::{ID_COUNT, Ids};
use crate::template::{self, TemplateDef};
use crate::{
    AgentAddr, Base, BoxInfo, BoxSpec, Caps, Digest, DiskMechanism, Engine, EngineError, Golden,
    Lane, Memory, MemoryKept, Result, SandboxId, Snapshot, SnapshotMode, Streamed, Template,
    Warmup, probe,
};
use cgroup::Cgroups;
pub use config::JailConfig;
pub use disk::{DiskSizes, unmount_under};
pub(crate) use host::start_time;
use host::{image_defaults, log_tail, now_ms, partial_path};
pub use ids::user_namespace;
use launch::{AGENT_NAME, LaunchSpec, Lower, USERNS_FD};
pub use net::LaneNet;
pub use outside::{recorded_boxes, remove_all};

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
    /// The user namespace every sandbox enters (its maps written once, here).
    userns: OwnedFd,
    disks: disk::Disks,
    /// CRIU, or why memory is not kept.
    criu: std::result::Result<criu::Criu, String>,
    memory_key: [u8; 32],
    /// Names this engine's cgroups and staging directories apart from other engines'.
    instance: String,
    /// The egress lane's addresses, when it is offered.
    addresses: Option<net::Addresses>,
}

/// What a new box starts from besides its base's layers.
enum Seed<'a> {
    /// Nothing: its processes start fresh.
    Fresh,
    /// A snapshot's files, and its memory where it has some and the caller wants it.
    Snapshot(&'a Path, Memory),
    /// Its golden's memory images: the warmup's processes continue.
    GoldenMemory(PathBuf),
    /// A fork's files, shared with the other copies (see `forks`), and its memory.
    Fork(&'a forks::Fork),
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
        for dir in ["", "templates", "goldens", "forks", "boxes", "disks"] {
            let d = cfg.data_dir.join(dir);
            std::fs::create_dir_all(&d)
                .and_then(|()| std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o700)))
                .map_err(EngineError::io(format!("mkdir {}", d.display())))?;
        }
        let hash = blake3::hash(cfg.data_dir.as_os_str().as_encoded_bytes()).to_hex();
        let instance = hash[..12].to_string();
        let cgroups = Cgroups::detect(&cfg.cgroup_root, format!("silkmesh-{instance}"))?;
        let ids = Ids { base: cfg.id_base };
        let userns = user_namespace(&cfg.launcher, ids)?;
        let disks = disk::Disks::open(&cfg.data_dir, cfg.disk, cfg.bound_disks);
        let criu = match cfg.memory {
            true => criu::probe(cfg.criu.as_deref()),
            false => Err("turned off in the configuration".into()),
        };
        if let Err(why) = &criu {
            tracing::info!("sandboxes keep their files, not their memory: {why}");
        }
        let memory_key = memory::memory_key(&cfg.data_dir, cfg.memory_key)?;
        let addresses = cfg.lane.clone().map(|lane| {
            let taken = recorded_boxes(&cfg.data_dir).into_iter().filter_map(|b| b.address);
            net::Addresses::new(lane, taken)
        });
        let engine =
            JailEngine { cfg, cgroups, ids, userns, disks, criu, memory_key, instance, addresses };
        engine.remove_incomplete()?;
        engine.thaw_all();
        engine.stop_unconfined();
        engine.shift_old_goldens()?;
        engine.sweep_forks()?;
        Ok(engine)
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

    /// Creates and starts a sandbox on `base`; `layer` (a snapshot, and whether to bring its
    /// memory back) seeds it (restore).
    fn create(
        &self,
        base: Base,
        id: &SandboxId,
        spec: &BoxSpec,
        seed: Seed<'_>,
        bounded: bool,
    ) -> Result<BoxInfo> {
        let address = match (spec.lane, &self.addresses) {
            (Lane::None, _) => None,
            (Lane::Egress, Some(addresses)) => Some(addresses.take()?),
            (Lane::Egress, None) => {
                return Err(EngineError::Unsupported { what: "the egress lane", engine: "jail" });
            }
        };
        let made = self.create_at(base, id, spec, seed, bounded, address);
        if let (Err(_), Some(addr), Some(addresses)) = (&made, address, &self.addresses) {
            addresses.give_back(addr);
        }
        made
    }

    fn create_at(
        &self,
        base: Base,
        id: &SandboxId,
        spec: &BoxSpec,
        seed: Seed<'_>,
        bounded: bool,
        address: Option<std::net::Ipv4Addr>,
    ) -> Result<BoxInfo> {
        let dir = self.box_dir(id);
        match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                return Err(EngineError::Exists(id.to_string()));
            }
            Err(e) => return Err(EngineError::io("mkdir box")(e)),
        }
        let started = self.start(base, id, spec, seed, bounded, address);
        if started.is_err() {
            let _ = self.cgroups.remove(id);
            let _ = disk::remove_box(&dir);
        }
        started
    }

    fn start(
        &self,
        base: Base,
        id: &SandboxId,
        spec: &BoxSpec,
        seed: Seed<'_>,
        bounded: bool,
        address: Option<std::net::Ipv4Addr>,
    ) -> Result<BoxInfo> {
        let dir = &self.box_dir(id);
        if bounded {
            self.disks.make(dir, spec.size).map_err(EngineError::io("make the sandbox's disk"))?;
        }
        let files = disk::files_dir(dir);
        let (upper, work, root) = (files.join("upper"), files.join("work"), dir.join("root"));
        for d in [&upper, &work, &root, &dir.join("lower")] {
            std::fs::create_dir(d).map_err(EngineError::io(format!("mkdir {}", d.display())))?;
        }
        // The overlay's root directory is the upper directory's: the sandbox's root owns it.
        let root_id = Some(self.ids.base);
        std::os::unix::fs::chown(&upper, root_id, root_id)
            .map_err(EngineError::io("chown upper"))?;
        let mut memory = MemoryKept::default();
        let restored = match seed {
            Seed::Fresh => Err(None),
            Seed::Snapshot(tar, wanted) => {
                self.apply_snapshot(tar, wanted, &upper, &base, id, spec)?.map_err(Some)
            }
            Seed::GoldenMemory(images) => {
                self.restore_golden_memory(&images, &base, id, spec).map_err(Some)
            }
            Seed::Fork(fork) => {
                self.join_fork(fork, dir)?;
                let restored = match &fork.images {
                    Ok(images) => self.restore_golden_memory(images, &base, id, spec),
                    Err(why) => Err(why.clone()),
                };
                match restored {
                    Err(why) if fork.memory == Memory::Required => {
                        return Err(EngineError::MemoryFailed(why));
                    }
                    restored => restored.map_err(Some),
                }
            }
        };
        match restored {
            Ok(info) => return Ok(info),
            Err(why) => memory.why_not = why,
        }
        let mut info = self.launch_box(base, id, spec, dir, address)?;
        info.memory = memory;
        Ok(info)
    }

    /// Starts the jail of a box whose directories (upper, work, root) exist: a new one, or a
    /// stopped one resuming on its files.
    fn launch_box(
        &self,
        base: Base,
        id: &SandboxId,
        spec: &BoxSpec,
        dir: &Path,
        address: Option<std::net::Ipv4Addr>,
    ) -> Result<BoxInfo> {
        let files = disk::files_dir(dir);
        let (upper, work, root) = (files.join("upper"), files.join("work"), dir.join("root"));
        let lowers = self.lowers(&base, dir)?;
        let cgroups = self.cgroups.create(id, spec.limits())?;

        let launch = LaunchSpec {
            hostname: id.to_string(),
            root,
            lowers,
            upper,
            work,
            binds: base.template.binds.clone(),
            silkd: self.cfg.silkd.clone(),
            cgroups,
            log: dir.join("agent.log"),
            root_id: self.ids.base,
            silkd_args: image_defaults(&base.template),
            resolv_conf: self.lane().filter(|_| address.is_some()).map(net::resolv_conf),
        };
        let launch_path = dir.join("launch.json");
        let json =
            serde_json::to_vec_pretty(&launch).map_err(|e| EngineError::Host(e.to_string()))?;
        std::fs::write(&launch_path, json).map_err(EngineError::io("write launch.json"))?;

        let pid = self.launch(&launch_path)?;
        let started = start_time(pid);
        let info = BoxInfo {
            id: id.clone(),
            base,
            spec: spec.clone(),
            agent: agent_addr(pid, started),
            pid: Some(pid),
            running: true,
            created_ms: now_ms(),
            memory: MemoryKept::default(),
            address,
        };
        self.save(&Record {
            info: info.clone(),
            start_time: started,
            id_base: Some(self.ids.base),
        })?;
        if let (Some(lane), Some(addr)) = (self.lane(), address)
            && let Err(e) = net::attach(lane, pid, addr, spec.size)
        {
            let _ = self.kill(id, Some(pid));
            return Err(EngineError::NotReady(format!("wiring the egress lane: {e}")));
        }
        if let Err(e) = probe::info(&info.agent, self.cfg.ready_timeout) {
            let log = log_tail(&dir.join("agent.log"));
            let _ = self.kill(id, Some(pid));
            return Err(EngineError::NotReady(format!("{e}; agent log: {}", log.trim())));
        }
        Ok(info)
    }

    /// The overlay's read-only layers of a box on `base`, top first.
    fn lowers(&self, base: &Base, dir: &Path) -> Result<Vec<Lower>> {
        let mut lowers = vec![];
        if let Some(fork) = self.fork_layer(dir) {
            lowers.push(Lower { path: fork, idmapped_at: None });
        }
        if let Some(golden) = &base.golden {
            lowers.push(Lower { path: golden.layer.clone(), idmapped_at: None });
        }
        let template_at = dir.join("lower");
        if !template_at.is_dir() {
            // A box made before template layers were id-mapped.
            std::fs::create_dir(&template_at).map_err(EngineError::io("mkdir lower"))?;
        }
        lowers.push(Lower { path: base.template.root.clone(), idmapped_at: Some(template_at) });
        Ok(lowers)
    }

    /// Runs `silk-jail` with the user namespace as fd 4; returns the jail's host pid.
    fn launch(&self, spec: &Path) -> Result<u32> {
        let userns = self.userns.as_raw_fd();
        let mut cmd = std::process::Command::new(&self.cfg.launcher);
        cmd.arg(spec).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
        host::dies_with_the_node(&mut cmd);
        // SAFETY: fcntl/dup2 are async-signal-safe.
        unsafe {
            cmd.pre_exec(move || {
                // A copy above the target first (close-on-exec, so it goes at exec), so the
                // source is never the target itself.
                let userns = libc::fcntl(userns, libc::F_DUPFD_CLOEXEC, 10);
                if userns < 0 || libc::dup2(userns, USERNS_FD) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let out = cmd
            .output()
            .map_err(EngineError::io(format!("run {}", self.cfg.launcher.display())))?;
        if !out.status.success() {
            return Err(EngineError::NotReady(format!(
                "jail setup failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
        String::from_utf8_lossy(&out.stdout).trim().parse().map_err(|_| {
            EngineError::Host(format!(
                "launcher printed {:?}",
                String::from_utf8_lossy(&out.stdout)
            ))
        })
    }

    /// Kills the jail (PID 1 first: the kernel then kills the whole pid namespace) and removes
    /// its cgroups.
    fn kill(&self, id: &SandboxId, pid: Option<u32>) -> Result<()> {
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
        let seed = Seed::Snapshot(snapshot.layer_tar.as_path(), memory);
        self.create(snapshot.base.clone(), id, spec, seed, true)
    }

    fn write_snapshot(
        &self,
        id: &SandboxId,
        memory: Memory,
        out: &mut dyn std::io::Write,
        _scratch: &Path,
    ) -> Result<Streamed> {
        self.stream_snapshot(id, memory, out)
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
        if let (Some(addresses), Some(addr)) = (&self.addresses, record.info.address) {
            addresses.give_back(addr);
        }
        let dir = self.box_dir(id);
        let fork = self.fork_of(&dir);
        disk::remove_box(&dir).map_err(EngineError::io(format!("remove sandbox {id}")))?;
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
}
