//! Per-sandbox cgroups: limits, freezing, membership and removal, on cgroup v2 where the
//! controllers live there and on v1 hierarchies otherwise (this project's CI hosts are v1
//! hybrids: memory/cpu/pids/freezer under `/sys/fs/cgroup/<controller>`).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::{EngineError, Limits, Result, SandboxId};

const V1_CONTROLLERS: &[&str] = &["memory", "cpu", "pids", "freezer"];
const CPU_PERIOD_US: u64 = 100_000;

/// The cgroup tree of one engine: the mount, its version, and the parent group its sandboxes
/// live under (named per data directory, so two nodes on one host never share a group).
#[derive(Debug, Clone)]
pub struct Cgroups {
    version: Version,
    mount: PathBuf,
    parent: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Version {
    V1,
    V2,
}

fn write(path: &Path, value: &str) -> Result<()> {
    std::fs::write(path, value).map_err(EngineError::io(format!(
        "write {} to {}",
        value,
        path.display()
    )))
}

impl Cgroups {
    /// Picks v2 when its root offers the memory, cpu and pids controllers, else v1.
    pub fn detect(mount: &Path, parent: String) -> Result<Cgroups> {
        let v2 = std::fs::read_to_string(mount.join("cgroup.controllers")).unwrap_or_default();
        let has = |c: &str| v2.split_whitespace().any(|x| x == c);
        if has("memory") && has("cpu") && has("pids") {
            return Ok(Cgroups { version: Version::V2, mount: mount.to_path_buf(), parent });
        }
        for c in V1_CONTROLLERS {
            if !mount.join(c).is_dir() {
                return Err(EngineError::Host(format!(
                    "no cgroup v2 controllers and no v1 {c} hierarchy under {}",
                    mount.display()
                )));
            }
        }
        Ok(Cgroups { version: Version::V1, mount: mount.to_path_buf(), parent })
    }

    /// The parent group's directories.
    fn parents(&self) -> Vec<PathBuf> {
        match self.version {
            Version::V2 => vec![self.mount.join(&self.parent)],
            Version::V1 => {
                V1_CONTROLLERS.iter().map(|c| self.mount.join(c).join(&self.parent)).collect()
            }
        }
    }

    /// The sandboxes that have a group under this engine's parent (whatever the engine's
    /// records say).
    pub fn groups(&self) -> Vec<SandboxId> {
        let mut ids: Vec<SandboxId> = self
            .parents()
            .iter()
            .filter_map(|p| std::fs::read_dir(p).ok())
            .flat_map(|d| d.flatten())
            .filter(|e| e.path().is_dir())
            .filter_map(|e| e.file_name().to_string_lossy().parse().ok())
            .collect();
        ids.sort();
        ids.dedup();
        ids
    }

    /// Every directory of the sandbox's group (one on v2, one per controller on v1).
    pub fn dirs(&self, id: &SandboxId) -> Vec<PathBuf> {
        self.parents().into_iter().map(|p| p.join(id.as_str())).collect()
    }

    /// Creates the sandbox's group with its limits.
    pub fn create(&self, id: &SandboxId, limits: Limits) -> Result<Vec<PathBuf>> {
        // An engine closing on the same data directory (a test's reopen) removes the (then
        // empty) parent: one that lands between this creating the parent and the group in it
        // is answered by starting again.
        for _ in 0..4 {
            match self.create_once(id, limits) {
                Err(EngineError::Io { source, .. })
                    if source.kind() == std::io::ErrorKind::NotFound => {}
                done => return done,
            }
        }
        self.create_once(id, limits)
    }

    fn create_once(&self, id: &SandboxId, limits: Limits) -> Result<Vec<PathBuf>> {
        let dirs = self.dirs(id);
        match self.version {
            Version::V2 => {
                let parent = self.mount.join(&self.parent);
                std::fs::create_dir_all(&parent).map_err(EngineError::io("mkdir cgroup"))?;
                let _ = write(&self.mount.join("cgroup.subtree_control"), "+cpu +memory +pids");
                write(&parent.join("cgroup.subtree_control"), "+cpu +memory +pids")?;
                let dir = &dirs[0];
                mkdir(dir)?;
                write(&dir.join("memory.max"), &limits.memory_bytes.to_string())?;
                let _ = write(&dir.join("memory.swap.max"), "0");
                let quota = u64::from(limits.cpu_millis) * CPU_PERIOD_US / 1000;
                write(&dir.join("cpu.max"), &format!("{quota} {CPU_PERIOD_US}"))?;
                write(&dir.join("pids.max"), &limits.pids.to_string())?;
            }
            Version::V1 => {
                for dir in &dirs {
                    mkdir(dir)?;
                }
                let [memory, cpu, pids, _freezer] = &dirs[..] else {
                    unreachable!("four v1 controllers")
                };
                write(&memory.join("memory.limit_in_bytes"), &limits.memory_bytes.to_string())?;
                // Without this the limit could be dodged through swap where swap accounting is on.
                let _ = write(
                    &memory.join("memory.memsw.limit_in_bytes"),
                    &limits.memory_bytes.to_string(),
                );
                write(&cpu.join("cpu.cfs_period_us"), &CPU_PERIOD_US.to_string())?;
                let quota = u64::from(limits.cpu_millis) * CPU_PERIOD_US / 1000;
                write(&cpu.join("cpu.cfs_quota_us"), &quota.to_string())?;
                write(&pids.join("pids.max"), &limits.pids.to_string())?;
            }
        }
        Ok(dirs)
    }

    /// The group that freezes the sandbox (CRIU's `--freeze-cgroup`).
    pub fn freezer_dir(&self, id: &SandboxId) -> PathBuf {
        match self.version {
            Version::V2 => self.dirs(id)[0].clone(),
            Version::V1 => self.mount.join("freezer").join(&self.parent).join(id.as_str()),
        }
    }

    pub fn freeze(&self, id: &SandboxId, frozen: bool) -> Result<()> {
        match self.version {
            Version::V2 => {
                write(&self.dirs(id)[0].join("cgroup.freeze"), if frozen { "1" } else { "0" })
            }
            Version::V1 => {
                let state = self
                    .mount
                    .join("freezer")
                    .join(&self.parent)
                    .join(id.as_str())
                    .join("freezer.state");
                write(&state, if frozen { "FROZEN" } else { "THAWED" })?;
                if frozen {
                    // FREEZING → FROZEN is asynchronous on v1, and a v1 freeze can stall in
                    // FREEZING for good (a task that missed it): as CRIU does, ask again now
                    // and then, and now and then thaw and start over.
                    let deadline = Instant::now() + Duration::from_secs(5);
                    let mut polls = 0u32;
                    while std::fs::read_to_string(&state).unwrap_or_default().trim() != "FROZEN" {
                        if Instant::now() > deadline {
                            return Err(EngineError::Host("cgroup did not freeze".into()));
                        }
                        polls += 1;
                        if polls.is_multiple_of(100) {
                            write(&state, "THAWED")?;
                            std::thread::sleep(Duration::from_millis(1));
                            write(&state, "FROZEN")?;
                        } else if polls.is_multiple_of(20) {
                            write(&state, "FROZEN")?;
                        }
                        std::thread::sleep(Duration::from_millis(1));
                    }
                }
                Ok(())
            }
        }
    }

    /// Whether a thread of the group is inside a fork-like call: a parent in `vfork()` (busybox
    /// sh and `posix_spawn` both use it) waits for its child to exec, and CRIU can stop neither
    /// while it does.
    pub fn mid_fork(&self, id: &SandboxId) -> bool {
        let forking = [libc::SYS_vfork, libc::SYS_clone, libc::SYS_clone3, libc::SYS_fork];
        self.procs(id).into_iter().any(|pid| {
            let Ok(threads) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return false };
            threads.flatten().any(|t| {
                // "<nr> <args…>" while blocked in a syscall, "running" or "-1 …" otherwise.
                let call = std::fs::read_to_string(t.path().join("syscall")).unwrap_or_default();
                let nr = call.split_whitespace().next().and_then(|n| n.parse::<i64>().ok());
                nr.is_some_and(|nr| forking.contains(&nr))
            })
        })
    }

    /// Pids still in the sandbox's group.
    pub fn procs(&self, id: &SandboxId) -> Vec<u32> {
        let dir = &self.dirs(id)[0];
        std::fs::read_to_string(dir.join("cgroup.procs"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect()
    }

    /// Kills whatever is left in the group and removes it.
    pub fn remove(&self, id: &SandboxId) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(5);
        // A frozen group cannot die; thaw it first.
        let _ = self.freeze(id, false);
        loop {
            let procs = self.procs(id);
            if procs.is_empty() {
                break;
            }
            for pid in procs {
                // SAFETY: plain syscall; these pids belong to the sandbox's group.
                unsafe { libc::kill(pid as i32, libc::SIGKILL) };
            }
            if Instant::now() > deadline {
                return Err(EngineError::Host(format!("processes of {id} survive SIGKILL")));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        for dir in self.dirs(id) {
            loop {
                match std::fs::remove_dir(&dir) {
                    Ok(()) => break,
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => break,
                    // The last task can linger a moment after it left cgroup.procs.
                    Err(_) if Instant::now() < deadline => {
                        std::thread::sleep(Duration::from_millis(1))
                    }
                    Err(e) => return Err(EngineError::io(format!("rmdir {}", dir.display()))(e)),
                }
            }
        }
        Ok(())
    }

    /// Removes the parent groups if no sandbox's group is left in them: when the engine
    /// closes. (Kept while the engine lives: making them again for a sandbox after the last
    /// one went cost 70–90 µs of its start on v1, four controllers' `mkdir`.)
    pub fn remove_parents(&self) {
        for parent in self.parents() {
            let _ = std::fs::remove_dir(parent);
        }
    }
}

fn mkdir(dir: &Path) -> Result<()> {
    match std::fs::create_dir_all(dir) {
        Ok(()) => Ok(()),
        Err(e) => Err(EngineError::io(format!("mkdir {}", dir.display()))(e)),
    }
}
