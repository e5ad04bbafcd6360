//! Process memory through CRIU: probing it, dumping a jail, and the parts of a restore the host
//! side prepares (the rest is the launcher's, see [`super::launch::restore`]).
//!
//! A dump names what the jail holds of the host's as external, so CRIU records a key instead of
//! the object and the restore supplies one of its own: the template's host binds (`bind<i>`),
//! silkd's binary (`silkd`), `/dev` (`dev`: its device nodes cannot be recreated from inside
//! the restored user namespace) and silkd's log file. Everything else — processes, memory, open
//! files, pipes, unix and loopback TCP sockets, ptys, the tmpfs contents of `/dev/shm`, the
//! network namespace with its loopback — is CRIU's own.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// The CRIU this engine uses, once it passed the probe.
#[derive(Debug, Clone)]
pub(super) struct Criu {
    pub(super) bin: PathBuf,
    /// Whether it brings the loopback up in a namespace restored empty
    /// (`scripts/criu-empty-ns-loopback.patch`): then a dump leaves the jail's network
    /// namespace out (`--empty-ns net`).
    pub(super) empty_net: bool,
}

/// What `criu --version` prints when CRIU has `scripts/criu-empty-ns-loopback.patch`.
const EMPTY_NET_MARK: &str = "silkmesh: empty-ns-loopback";

/// Where CRIU is looked for when the configuration names none.
const SEARCH: &[&str] = &["/usr/local/sbin/criu", "/usr/sbin/criu", "/usr/local/bin/criu"];

/// Finds a CRIU that can keep sandboxes' memory here: version 4.1 or newer (older ones fail on
/// this kernel's vDSO layout) whose `criu check` passes. `Err` says why not, for `/v1/info`.
pub(super) fn probe(configured: Option<&Path>) -> Result<Criu, String> {
    let bin = match configured {
        Some(path) => path.to_path_buf(),
        None => SEARCH.iter().map(PathBuf::from).find(|p| p.is_file()).ok_or_else(|| {
            "CRIU is not installed (scripts/install-criu installs it)".to_string()
        })?,
    };
    let out = Command::new(&bin)
        .arg("--version")
        .output()
        .map_err(|e| format!("run {}: {e}", bin.display()))?;
    let text = String::from_utf8_lossy(&out.stdout);
    let version = text
        .lines()
        .find_map(|l| l.strip_prefix("Version:"))
        .map(str::trim)
        .ok_or_else(|| format!("{} printed no version", bin.display()))?;
    let mut parts = version.split('.').map(|p| p.parse::<u32>().unwrap_or(0));
    let (major, minor) = (parts.next().unwrap_or(0), parts.next().unwrap_or(0));
    if (major, minor) < (4, 1) {
        return Err(format!("CRIU {version} is too old for this kernel (4.1 or newer needed)"));
    }
    let check = Command::new(&bin)
        .arg("check")
        .output()
        .map_err(|e| format!("run {} check: {e}", bin.display()))?;
    if !check.status.success() {
        let why = String::from_utf8_lossy(&check.stderr);
        return Err(format!("`criu check` fails: {}", last_lines(&why, 3)));
    }
    let empty_net = text.lines().any(|l| l.trim() == EMPTY_NET_MARK);
    Ok(Criu { bin, empty_net })
}

/// What a dump records beside CRIU's images, for the restore (`memory.json`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct DumpMeta {
    /// CRIU's key for silkd's log file: `file[<mnt id>:<inode>]`, both hex.
    pub(super) log_key: String,
    /// How many host binds the dump declared (`bind0`..).
    pub(super) binds: usize,
    /// The sandbox dumped: a restore under another id is a copy, with an identity of its own.
    pub(super) id: crate::SandboxId,
    /// The jail's network namespace was left out (`--empty-ns net`): the restore makes a new
    /// one with its loopback up, which only a CRIU with [`Criu::empty_net`] does.
    #[serde(default)]
    pub(super) empty_net: bool,
}

impl DumpMeta {
    /// Read back (from a store, perhaps): the key goes onto CRIU's command line, so only its
    /// exact shape passes.
    pub(super) fn parse(bytes: &[u8]) -> Result<DumpMeta, String> {
        let meta: DumpMeta =
            serde_json::from_slice(bytes).map_err(|e| format!("memory.json: {e}"))?;
        let inner = meta
            .log_key
            .strip_prefix("file[")
            .and_then(|k| k.strip_suffix(']'))
            .and_then(|k| k.split_once(':'))
            .filter(|(m, i)| {
                [m, i].iter().all(|h| !h.is_empty() && h.bytes().all(|b| b.is_ascii_hexdigit()))
            });
        if inner.is_none() || meta.binds > 64 {
            return Err("memory.json: malformed".into());
        }
        Ok(meta)
    }
}

/// One dump of the jail whose init is `pid`.
pub(super) struct Dump<'a> {
    pub(super) id: &'a crate::SandboxId,
    pub(super) pid: u32,
    /// Where the images go (an empty directory).
    pub(super) images: &'a Path,
    /// CRIU's log.
    pub(super) log: &'a Path,
    /// Where the template's host binds are mounted inside (e.g. `usr`).
    pub(super) binds: Vec<&'a Path>,
    /// The jail's freezer cgroup: CRIU freezes through it (and leaves it as it found it).
    pub(super) freezer: &'a Path,
    /// Keep the jail running (a checkpoint) rather than ending it (hibernate).
    pub(super) leave_running: bool,
    /// Runs CRIU: a fork of its small server, not of the node.
    pub(super) launcher: &'a super::launcher::Launcher,
}

impl Criu {
    /// Dumps the jail; returns how long CRIU took. `Err` carries CRIU's own reason.
    pub(super) fn dump(&self, d: &Dump) -> Result<Duration, String> {
        let log_key = log_key(d.pid)?;
        let mut cmd = Command::new(&self.bin);
        cmd.arg("dump")
            .arg("--tree")
            .arg(d.pid.to_string())
            .arg("--images-dir")
            .arg(d.images)
            .arg("--log-file")
            .arg(d.log)
            .arg("--freeze-cgroup")
            .arg(d.freezer)
            .args(["--tcp-established", "--file-locks", "--manage-cgroups=ignore", "-v2"])
            .args(["--ghost-limit", "64M"])
            .args(["--external", "mnt[/run/silkd]:silkd", "--external", "mnt[/dev]:dev"])
            .arg("--external")
            .arg(&log_key);
        for (i, inside) in d.binds.iter().enumerate() {
            let at = Path::new("/").join(inside);
            cmd.arg("--external").arg(format!("mnt[{}]:bind{i}", at.display()));
        }
        if d.leave_running {
            cmd.arg("--leave-running");
        }
        if self.empty_net {
            // The jail's network namespace holds its loopback and nothing a sandbox could
            // change (no CAP_NET_ADMIN, /proc/sys read-only): left out, ~15 ms of a small
            // jail's dump and ~20 ms of its restore (routes, rules, iptables, sysctls). With
            // it goes the lock on its network, which guards connections that leave the
            // namespace: a jail that keeps memory has none (no lane), and what runs on its
            // loopback is frozen at both ends.
            cmd.args(["--empty-ns", "net", "--network-lock", "skip"]);
        } else {
            // Its lock on the jail's network is an nftables table made and dropped in CRIU
            // itself (libnftables), and the restore unlocks the way the dump locked. The
            // default, iptables, runs `iptables-restore` four to six times to unlock: 60 of a
            // small jail's 147 ms of restore here.
            cmd.args(["--network-lock", "nftables"]);
        }
        let started = Instant::now();
        d.launcher.criu(&cmd).map_err(|stderr| failure(d.log, &stderr))?;
        let meta =
            DumpMeta { log_key, binds: d.binds.len(), id: d.id.clone(), empty_net: self.empty_net };
        let json = serde_json::to_vec(&meta).expect("serializable");
        std::fs::write(d.images.join("memory.json"), json)
            .map_err(|e| format!("write memory.json: {e}"))?;
        Ok(started.elapsed())
    }
}

/// CRIU's key for what the jail's init has on fd 1 (silkd's log, a host file).
fn log_key(pid: u32) -> Result<String, String> {
    use std::os::unix::fs::MetadataExt;
    let fdinfo = std::fs::read_to_string(format!("/proc/{pid}/fdinfo/1"))
        .map_err(|e| format!("read silkd's fdinfo: {e}"))?;
    let mnt: u64 = fdinfo
        .lines()
        .find_map(|l| l.strip_prefix("mnt_id:"))
        .and_then(|v| v.trim().parse().ok())
        .ok_or("no mnt_id in silkd's fdinfo")?;
    let ino = std::fs::metadata(format!("/proc/{pid}/fd/1"))
        .map_err(|e| format!("stat silkd's log: {e}"))?
        .ino();
    Ok(format!("file[{mnt:x}:{ino:x}]"))
}

/// Why CRIU failed: the error lines of its log (the first is usually the cause), else stderr.
pub(super) fn failure(log: &Path, stderr: &str) -> String {
    let log = std::fs::read_to_string(log).unwrap_or_default();
    let errors: Vec<&str> = log
        .lines()
        // CRIU's own errors ("Error (file:line): ..."), less two that follow any run here.
        .filter(|l| l.contains("Error (") && !l.contains("RLIMIT_NOFILE") && !l.contains("cgroupd"))
        .map(|l| l.split_once("): ").map_or(l, |(_, msg)| msg))
        .take(2)
        .collect();
    if errors.is_empty() { last_lines(stderr, 3) } else { errors.join("; ") }
}

fn last_lines(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    lines[lines.len().saturating_sub(n)..].join("; ")
}
