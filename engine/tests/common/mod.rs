//! Harness for engine tests: a jail engine on a temp data directory, and helpers to run commands
//! in sandboxes through silkd.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use silk_engine::jail::{JailConfig, JailEngine};
use silk_engine::*;

pub mod contract;
pub mod memory;

/// The statically linked silkd that runs inside jails. `scripts/test` builds it and sets this.
pub fn static_silkd() -> PathBuf {
    let path = std::env::var_os("SILKD_STATIC").map(PathBuf::from).expect(
        "SILKD_STATIC is not set: run the suite through scripts/test (it builds a static silkd)",
    );
    assert!(path.is_file(), "SILKD_STATIC={} does not exist", path.display());
    path
}

pub struct Harness {
    pub engine: JailEngine,
    pub data: tempfile::TempDir,
}

impl Harness {
    pub fn new() -> Harness {
        let data = tempfile::tempdir().unwrap();
        let engine = Self::open(data.path().to_path_buf());
        Harness { engine, data }
    }

    /// An engine whose memory images are keyed with `key`, as every node of one fleet is.
    pub fn with_memory_key(key: [u8; 32]) -> Harness {
        let data = tempfile::tempdir().unwrap();
        let mut cfg = JailConfig::new(data.path(), static_silkd(), env!("CARGO_BIN_EXE_silk-jail"));
        cfg.memory_key = Some(key);
        Harness { engine: JailEngine::new(cfg).expect("jail engine"), data }
    }

    /// A second engine on the same data directory: what a restarted node gets.
    pub fn reopen(&self) -> JailEngine {
        Self::open(self.data.path().to_path_buf())
    }

    fn open(data: PathBuf) -> JailEngine {
        let cfg = JailConfig::new(data, static_silkd(), env!("CARGO_BIN_EXE_silk-jail"));
        JailEngine::new(cfg).expect("jail engine")
    }

    pub fn host(&self) -> Template {
        self.engine.template(&TemplateDef::host()).unwrap()
    }

    pub fn golden(&self, warmup: &[&str]) -> Golden {
        self.golden_with(warmup, false)
    }

    /// A golden of the host template after `warmup`, holding its processes' memory if `memory`.
    pub fn golden_with(&self, warmup: &[&str], memory: bool) -> Golden {
        let warmup = Warmup {
            argv: warmup.iter().map(|s| s.to_string()).collect(),
            timeout: Duration::from_secs(20),
            memory,
        };
        self.engine.prepare(&self.host(), &warmup).unwrap()
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        // Leave nothing running even when a test failed half way.
        if let Ok(boxes) = self.engine.list() {
            for b in boxes {
                let _ = self.engine.destroy(&b.id);
            }
        }
    }
}

/// A box's upper directory: in its disk, where the disk is bounded.
pub fn upper_dir(h: &Harness, id: &SandboxId) -> PathBuf {
    let dir = h.data.path().join("boxes").join(id.as_str());
    if dir.join("disk").is_dir() { dir.join("disk/upper") } else { dir.join("upper") }
}

pub fn id(s: &str) -> SandboxId {
    s.parse().unwrap()
}

pub fn small() -> BoxSpec {
    BoxSpec::new(Size::Small, Lane::None)
}

/// Runs `sh -c script` in the sandbox; returns (exit code, the last 4 KiB of output).
pub fn sh(info: &BoxInfo, script: &str) -> (i32, String) {
    let argv = vec!["/bin/sh".to_string(), "-c".to_string(), script.to_string()];
    let (status, out) = probe::exec(&info.agent, &argv, &[], Duration::from_secs(30)).unwrap();
    (status.code, out)
}

/// `sh` expecting success; returns trimmed output.
pub fn ok(info: &BoxInfo, script: &str) -> String {
    let (code, out) = sh(info, script);
    assert_eq!(code, 0, "`{script}` failed: {out}");
    out.trim().to_string()
}

pub fn pid_alive(pid: u32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
}

/// Everything a sandbox leaves on the host while it exists.
pub fn traces(h: &Harness, id: &SandboxId, pid: Option<u32>) -> Vec<String> {
    let mut found = vec![];
    if h.data.path().join("boxes").join(id.as_str()).exists() {
        found.push("box directory".to_string());
    }
    for ctl in ["memory", "cpu", "pids", "freezer", ""] {
        let Ok(groups) = std::fs::read_dir(PathBuf::from("/sys/fs/cgroup").join(ctl)) else {
            continue;
        };
        for group in
            groups.flatten().filter(|g| g.file_name().to_string_lossy().starts_with("silkmesh"))
        {
            if group.path().join(id.as_str()).exists() {
                found.push(format!("cgroup {}", group.path().join(id.as_str()).display()));
            }
        }
    }
    if let Some(pid) = pid
        && pid_alive(pid)
        && !std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default().contains(") Z")
    {
        found.push(format!("process {pid}"));
    }
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let dir = h.data.path().join("boxes").join(id.as_str());
    if mounts.lines().filter_map(|l| l.split(' ').nth(4)).any(|m| Path::new(m).starts_with(&dir)) {
        found.push("a mount under its box directory".to_string());
    }
    found
}

/// The host processes of a sandbox (silkd, the host pid in `info`, and everything under it)
/// that are not in each of the sandbox's own cgroups (memory, cpu, pids and freezer on v1; its
/// one group on v2), as "pid: line of /proc/<pid>/cgroup".
pub fn outside_own_cgroups(info: &BoxInfo) -> Vec<String> {
    let root = info.pid.expect("a running sandbox has a pid");
    let (mut pids, mut i) = (vec![root], 0);
    while i < pids.len() {
        let p = pids[i];
        for task in std::fs::read_dir(format!("/proc/{p}/task")).into_iter().flatten().flatten() {
            let children =
                std::fs::read_to_string(task.path().join("children")).unwrap_or_default();
            pids.extend(children.split_whitespace().filter_map(|c| c.parse::<u32>().ok()));
        }
        i += 1;
    }
    let own = format!("/{}", info.id);
    let pid_ns = |pid: u32| std::fs::read_link(format!("/proc/{pid}/ns/pid")).ok();
    let jail = pid_ns(root);
    let mut outside = vec![];
    for pid in pids {
        let Ok(groups) = std::fs::read_to_string(format!("/proc/{pid}/cgroup")) else { continue };
        // A short-lived child (the counter's `sleep`) may be gone and its pid taken by a host
        // process by now (pids wrap at 32768 here): only the jail's own processes count.
        if pid_ns(pid) != jail {
            continue;
        }
        let v1 = |line: &&str| {
            let controllers = line.split(':').nth(1).unwrap_or_default();
            controllers.split(',').any(|c| ["memory", "cpu", "pids", "freezer"].contains(&c))
        };
        let mut ours: Vec<&str> = groups.lines().filter(v1).collect();
        if ours.is_empty() {
            ours = groups.lines().filter(|l| l.starts_with("0::")).collect();
        }
        outside.extend(ours.iter().filter(|l| !l.ends_with(&own)).map(|l| format!("{pid}: {l}")));
    }
    outside
}
