//! Starting a box: its directories, its disk, its seed (files, memory, or a fork's layer), its
//! jail through `silk-jail`, and the wait for its silkd.

use std::path::{Path, PathBuf};

use super::host::{image_defaults, log_tail, now_ms, start_time};
use super::launch::{LaunchSpec, Lower};
use super::{JailEngine, Record, agent_addr, disk, net};
use crate::{
    Base, BoxInfo, BoxSpec, EngineError, Lane, Memory, MemoryKept, Result, SandboxId, probe,
};

/// What a new box starts from besides its base's layers.
pub(super) enum Seed<'a> {
    /// Nothing: its processes start fresh.
    Fresh,
    /// A snapshot's files, and its memory where it has some and the caller wants it.
    Snapshot(super::snapshot::SnapshotInput<'a>, Memory),
    /// Its golden's memory images: the warmup's processes continue.
    GoldenMemory(PathBuf),
    /// A fork's files, shared with the other copies (see `forks`), and its memory.
    Fork(&'a super::forks::Fork),
}

impl JailEngine {
    /// Creates and starts a sandbox on `base`; `layer` (a snapshot, and whether to bring its
    /// memory back) seeds it (restore).
    pub(super) fn create(
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

    pub(super) fn create_at(
        &self,
        base: Base,
        id: &SandboxId,
        spec: &BoxSpec,
        seed: Seed<'_>,
        bounded: bool,
        address: Option<std::net::Ipv4Addr>,
    ) -> Result<BoxInfo> {
        let dir = self.box_dir(id);
        match self.disks.make_box(&dir, bounded.then_some(spec.size)) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                return Err(EngineError::Exists(id.to_string()));
            }
            Err(e) => return Err(EngineError::io("make the box")(e)),
        }
        let started = self.start(base, id, spec, seed, bounded, address);
        self.disks.restock();
        if started.is_err() {
            let _ = self.cgroups.remove(id);
            let _ = disk::remove_box(&dir);
        }
        started
    }

    pub(super) fn start(
        &self,
        base: Base,
        id: &SandboxId,
        spec: &BoxSpec,
        seed: Seed<'_>,
        bounded: bool,
        address: Option<std::net::Ipv4Addr>,
    ) -> Result<BoxInfo> {
        let dir = &self.box_dir(id);
        let files = disk::files_dir(dir);
        let (upper, work) = (files.join("upper"), files.join("work"));
        let box_dirs = disk::BOX_DIRS.map(|d| dir.join(d));
        for d in [&upper, &work].into_iter().chain(&box_dirs) {
            match std::fs::create_dir(d) {
                // A box from the disk stock comes with them; nothing else made this new box's.
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && bounded => {}
                made => made.map_err(EngineError::io(format!("mkdir {}", d.display())))?,
            }
        }
        // The overlay's root directory is the upper directory's: the sandbox's root owns it.
        let root_id = Some(self.ids.base);
        std::os::unix::fs::chown(&upper, root_id, root_id)
            .map_err(EngineError::io("chown upper"))?;
        let mut memory = MemoryKept::default();
        let restored = match seed {
            Seed::Fresh => Err(None),
            Seed::Snapshot(input, wanted) => {
                self.apply_snapshot(input, wanted, &upper, &base, id, spec)?.map_err(Some)
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
    pub(super) fn launch_box(
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
        let pid = self.launcher.launch(launch)?;
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
        match probe::ready(&info.agent, self.cfg.ready_timeout) {
            Ok(answered) => answered.into_iter().for_each(|conn| self.answered.keep(id, conn)),
            Err(e) => {
                let log = log_tail(&dir.join("agent.log"));
                let _ = self.kill(id, Some(pid));
                return Err(EngineError::NotReady(format!("{e}; agent log: {}", log.trim())));
            }
        }
        Ok(info)
    }

    /// The overlay's read-only layers of a box on `base`, top first.
    pub(super) fn lowers(&self, base: &Base, dir: &Path) -> Result<Vec<Lower>> {
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
}
