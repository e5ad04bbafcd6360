//! Small host-side helpers of the jail engine: box removal, log tails, partial-file names,
//! clocks and process start times, helpers that die with the node (and those that did not),
//! and an image's silkd flags.

use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::Template;

/// silkd flags carrying an image template's config, so commands run as the image intends.
pub(super) fn image_defaults(t: &Template) -> Vec<String> {
    let mut args: Vec<String> =
        t.env.iter().flat_map(|(k, v)| ["--env".to_string(), format!("{k}={v}")]).collect();
    if let Some(cwd) = &t.cwd {
        args.extend(["--default-cwd".to_string(), cwd.clone()]);
    }
    // `user:group` images: silkd takes the user (its groups come from the image's /etc/group).
    if let Some(user) =
        t.user.as_deref().and_then(|u| u.split(':').next()).filter(|u| !u.is_empty())
    {
        args.extend(["--default-user".to_string(), user.to_string()]);
    }
    args
}

/// Removes a box directory. `remove_dir_all` recurses once per level and a sandbox can nest
/// directories far deeper than a blocking thread's 2 MiB stack: it runs on a thread whose stack
/// (reserved, not committed) takes a million levels.
pub(super) fn remove_tree(dir: &Path) -> std::io::Result<()> {
    let path = dir.to_path_buf();
    std::thread::Builder::new()
        .stack_size(1 << 30)
        .spawn(move || std::fs::remove_dir_all(&path))?
        .join()
        .map_err(|_| std::io::Error::other("the remover panicked"))?
}

/// The last 4 KiB of a jail's log (the file is the sandbox's to grow).
pub(super) fn log_tail(path: &Path) -> String {
    use std::io::{Read, Seek, SeekFrom};
    let Ok(mut file) = std::fs::File::open(path) else { return String::new() };
    let _ = file.seek(SeekFrom::End(-4096)).or_else(|_| file.seek(SeekFrom::Start(0)));
    let mut tail = vec![];
    let _ = file.take(4096).read_to_end(&mut tail);
    String::from_utf8_lossy(&tail).into_owned()
}

/// Where a snapshot is written before it is complete.
pub(super) fn partial_path(into: &Path) -> PathBuf {
    let mut name = into.as_os_str().to_owned();
    name.push(".partial");
    PathBuf::from(name)
}

pub(super) fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// The fields of `/proc/<pid>/stat` after the command name (which may hold spaces and `)`):
/// the state first, then the parent's pid.
fn stat_fields(pid: impl std::fmt::Display) -> Option<String> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    Some(stat.rsplit_once(')')?.1.to_string())
}

/// Field 22 of `/proc/<pid>/stat`: the process's start time in clock ticks since boot.
pub(crate) fn start_time(pid: u32) -> Option<u64> {
    let after_comm = stat_fields(pid)?;
    let state = after_comm.split_whitespace().next()?;
    if state == "Z" || state == "X" {
        return None; // dead, waiting to be reaped
    }
    after_comm.split_whitespace().nth(19)?.parse().ok()
}

/// Waits (up to five seconds) until `pid` has exited. A process leaves its cgroup early in its
/// exit, so an empty group does not yet mean a dead jail: a resume that looked in between would
/// find the old init "running".
pub(super) fn wait_exited(pid: u32) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while start_time(pid).is_some() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

/// Kills what CRIU left running when its node was killed: processes named `criu`, orphaned
/// (their parent is init: the criu a launcher ran died with it, see `dies_with_its_parent`, and
/// the processes it had forked do not inherit that signal), whose arguments name a path under
/// `data_dir`. Seen after kill -9 soaks: such a process asleep for minutes with a destroyed
/// box's images open.
pub(super) fn kill_orphaned_criu(data_dir: &Path) {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    // Where this process is init (a container), its own children's parent is init too.
    if std::process::id() == 1 {
        return;
    }
    let Ok(procs) = std::fs::read_dir("/proc") else { return };
    for entry in procs.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        if !orphaned_criu(pid, data_dir) {
            continue;
        }
        // SAFETY: plain syscalls; the descriptor is owned from here on.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
        if fd < 0 {
            continue;
        }
        let pidfd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
        // Checked again through the pidfd's process: the pid cannot have been reused under it.
        let sent = orphaned_criu(pid, data_dir)
            && unsafe {
                libc::syscall(
                    libc::SYS_pidfd_send_signal,
                    pidfd.as_raw_fd(),
                    libc::SIGKILL,
                    std::ptr::null::<libc::siginfo_t>(),
                    0,
                )
            } == 0;
        if sent {
            tracing::warn!(pid, "killed a criu a killed node left running");
        }
    }
}

fn orphaned_criu(pid: i32, data_dir: &Path) -> bool {
    let Some(after_comm) = stat_fields(pid) else { return false };
    if after_comm.split_whitespace().nth(1) != Some("1") {
        return false;
    }
    let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else { return false };
    let mut args = cmdline.split(|b| *b == 0).map(|a| Path::new(std::ffi::OsStr::from_bytes(a)));
    args.next().and_then(Path::file_name).is_some_and(|name| name == "criu")
        && args.any(|a| a.starts_with(data_dir))
}

/// Makes `cmd` die with the process that spawns it (the signal comes when the spawning thread
/// ends, and that thread waits for it). So the launcher server dies with the node, and each
/// launcher and each CRIU dump with the process that forked it: none outlives a node that was
/// killed. A CRIU dump left running would finish after the next start thawed its jail and put
/// the cgroup back in the state it found it in — frozen — with the sandbox claimed and every
/// call into it hanging; a launcher could finish a start after the next start tidied up.
pub(super) fn dies_with_its_parent(cmd: &mut std::process::Command) {
    use std::os::unix::process::CommandExt;
    let parent = std::process::id() as libc::pid_t;
    // SAFETY: prctl and getppid are async-signal-safe.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // The parent died between the fork and the prctl: no signal will come.
            if libc::getppid() != parent {
                return Err(std::io::Error::other("its parent is gone"));
            }
            Ok(())
        });
    }
}
