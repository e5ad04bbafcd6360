//! The process table: every child silkd starts, and the single reaper that collects them.
//!
//! silkd is PID 1 inside a sandbox, so it must reap every orphan. One task calls
//! `waitpid(-1, WNOHANG)` on each SIGCHLD and hands the status of a child it knows to that
//! child's waiter. Spawning and reaping take the same lock, so a child cannot be reaped between
//! `fork` and its registration, and [`Procs::kill`] can never signal a pid that was already reaped
//! (the kernel reuses a pid only after it is reaped, which happens under this lock).

use std::collections::{BTreeMap, HashMap};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::process::Stdio;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{SystemTime, UNIX_EPOCH};

use silk_proto::{Command, ErrorKind, ExitStatus, ProcInfo, WireError};
use tokio::net::unix::pipe;
use tokio::sync::oneshot;

use crate::ring::Ring;
use crate::users::{self, User};

/// `PATH` of every child unless the request sets its own.
pub const BASE_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// Exited detached processes kept for `ps`/`logs`/`attach`.
const KEEP_EXITED: usize = 64;

/// The agent's children.
#[derive(Debug, Default)]
pub struct Procs {
    table: Mutex<Table>,
    defaults: Defaults,
}

/// What a command gets when its request does not say: an image template's config (`Env`,
/// `WorkingDir`, `User`), passed to silkd by the engine.
#[derive(Debug, Clone, Default)]
pub struct Defaults {
    /// Merged onto the clean base environment, under the request's own variables.
    pub env: Vec<(String, String)>,
    pub cwd: Option<String>,
    pub user: Option<String>,
}

#[derive(Debug, Default)]
struct Table {
    /// Children not yet reaped.
    live: HashMap<u32, Live>,
    /// Detached processes, live or exited, by pid.
    detached: BTreeMap<u32, Arc<Detached>>,
}

#[derive(Debug)]
struct Live {
    argv: Vec<String>,
    started_ms: u64,
    on_exit: oneshot::Sender<ExitStatus>,
}

/// A process started by `Spawn`: its output ring outlives it.
#[derive(Debug)]
pub struct Detached {
    pub pid: u32,
    pub argv: Vec<String>,
    pub started_ms: u64,
    pub ring: Ring,
}

/// Stdio and session set-up for [`Procs::start_with`].
#[derive(Debug)]
pub struct ChildIo {
    pub stdin: Stdio,
    pub stdout: Stdio,
    pub stderr: Stdio,
    /// A descriptor the child gets as fd 3 (e.g. the write end of a status pipe).
    pub fd3: Option<OwnedFd>,
    /// Start a new session with stdin (a pty slave) as the controlling terminal, instead of
    /// only a new process group.
    pub terminal: bool,
}

/// A child just started, with the host ends of its pipes.
#[derive(Debug)]
pub struct Child {
    pub pid: u32,
    pub stdin: Option<pipe::Sender>,
    pub stdout: pipe::Receiver,
    pub stderr: pipe::Receiver,
    pub exited: oneshot::Receiver<ExitStatus>,
}

impl Procs {
    pub fn new(defaults: Defaults) -> Procs {
        Procs { table: Mutex::default(), defaults }
    }

    fn lock(&self) -> MutexGuard<'_, Table> {
        // A panic while holding this lock would be a bug in this module; keep serving anyway.
        self.table.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Starts `cmd` in its own process group with piped stdout/stderr, and stdin piped or
    /// `/dev/null`.
    pub fn start(&self, cmd: &Command, stdin: bool) -> Result<Child, WireError> {
        let io = ChildIo {
            stdin: if stdin { Stdio::piped() } else { Stdio::null() },
            stdout: Stdio::piped(),
            stderr: Stdio::piped(),
            fd3: None,
            terminal: false,
        };
        let (mut child, exited) = self.start_with(cmd, io)?;
        let pid = child.id();
        // `child` is dropped without `wait`: the reaper owns its exit status.
        let stdout =
            pipe::Receiver::from_owned_fd(OwnedFd::from(child.stdout.take().expect("piped")));
        let stderr =
            pipe::Receiver::from_owned_fd(OwnedFd::from(child.stderr.take().expect("piped")));
        let stdin = child.stdin.take().map(|s| pipe::Sender::from_owned_fd(OwnedFd::from(s)));
        Ok(Child {
            pid,
            stdin: stdin.transpose().map_err(pipe_error)?,
            stdout: stdout.map_err(pipe_error)?,
            stderr: stderr.map_err(pipe_error)?,
            exited,
        })
    }

    /// Starts `cmd` with the caller's stdio, registered in the table like every child (so `ps`
    /// lists it, `kill` reaches it and the reaper collects it). The returned `std` child is only
    /// a holder for piped handles: it must not be waited on.
    pub fn start_with(
        &self,
        cmd: &Command,
        io: ChildIo,
    ) -> Result<(std::process::Child, oneshot::Receiver<ExitStatus>), WireError> {
        let (program, prepared) = prepare(cmd, &self.defaults)?;
        let mut os = std::process::Command::new(program);
        os.args(&cmd.argv[1..])
            .env_clear()
            .envs(prepared.env)
            .current_dir(&prepared.cwd)
            .stdin(io.stdin)
            .stdout(io.stdout)
            .stderr(io.stderr);
        if io.terminal {
            // A new session whose controlling terminal is stdin (a pty slave). The session
            // leader is also its group leader, so `kill` reaches the group as for any child.
            // SAFETY: setsid and ioctl are async-signal-safe.
            unsafe {
                os.pre_exec(|| {
                    if libc::setsid() < 0 || libc::ioctl(0, libc::TIOCSCTTY, 0) < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        } else {
            os.process_group(0);
        }
        // A descriptor below 3 (silkd started with closed stdio) would be overwritten when the
        // child's stdio is set up; `try_clone` duplicates to 3 or above.
        let fd3 = match io.fd3 {
            Some(fd) if fd.as_raw_fd() < 3 => Some(fd.try_clone().map_err(pipe_error)?),
            other => other,
        };
        if let Some(fd) = &fd3 {
            let raw = fd.as_raw_fd();
            // SAFETY: dup2/fcntl are async-signal-safe; `fd` outlives the spawn below.
            unsafe {
                os.pre_exec(move || {
                    let ok = if raw == 3 {
                        // dup2 onto itself keeps close-on-exec: clear it instead.
                        libc::fcntl(3, libc::F_SETFD, 0) == 0
                    } else {
                        libc::dup2(raw, 3) == 3
                    };
                    if !ok {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
        if let Some(user) = prepared.user {
            drop_privileges(&mut os, user);
        }

        let mut table = self.lock();
        let child = os.spawn().map_err(|e| spawn_error(&cmd.argv[0], e))?;
        let (tx, rx) = oneshot::channel();
        table
            .live
            .insert(child.id(), Live { argv: cmd.argv.clone(), started_ms: now_ms(), on_exit: tx });
        drop(table);
        drop(fd3); // the child has its copy
        Ok((child, rx))
    }

    /// Records a detached process so `ps`, `logs` and `attach` find it.
    pub fn add_detached(&self, detached: Arc<Detached>) {
        let mut table = self.lock();
        table.detached.insert(detached.pid, detached);
        let exited: Vec<u32> =
            table.detached.values().filter(|d| d.ring.exit().is_some()).map(|d| d.pid).collect();
        for pid in exited.iter().take(exited.len().saturating_sub(KEEP_EXITED)) {
            table.detached.remove(pid);
        }
    }

    pub fn detached(&self, pid: u32) -> Result<Arc<Detached>, WireError> {
        self.lock().detached.get(&pid).cloned().ok_or_else(|| {
            WireError::new(ErrorKind::NotFound, format!("no detached process {pid}"))
        })
    }

    /// Signals the process group of a live child. A pid that is not a live child of silkd is
    /// `NotFound`, so a reaped (and possibly reused) pid is never signalled.
    pub fn kill(&self, pid: u32, signal: i32) -> Result<(), WireError> {
        let table = self.lock();
        if !table.live.contains_key(&pid) {
            return Err(WireError::new(ErrorKind::NotFound, format!("no live process {pid}")));
        }
        // SAFETY: plain syscall; `pid` is an unreaped child and leader of its own group.
        if unsafe { libc::kill(-(pid as i32), signal) } != 0 {
            let err = std::io::Error::last_os_error();
            let kind = match err.raw_os_error() {
                Some(libc::EINVAL) => ErrorKind::BadRequest,
                _ => ErrorKind::Internal,
            };
            return Err(WireError::new(kind, format!("kill {pid}: {err}")));
        }
        Ok(())
    }

    /// Sends `signal` to every live child's group (shutdown).
    pub fn signal_all(&self, signal: i32) {
        for pid in self.lock().live.keys() {
            // SAFETY: plain syscall on unreaped children.
            unsafe { libc::kill(-(*pid as i32), signal) };
        }
    }

    pub fn live_count(&self) -> usize {
        self.lock().live.len()
    }

    pub fn list(&self) -> Vec<ProcInfo> {
        let table = self.lock();
        let mut out: Vec<ProcInfo> = table
            .live
            .iter()
            .map(|(pid, live)| ProcInfo {
                pid: *pid,
                argv: live.argv.clone(),
                started_ms: live.started_ms,
                detached: table.detached.contains_key(pid),
                exit: None,
            })
            .collect();
        for d in table.detached.values() {
            if let (Some(exit), false) = (d.ring.exit(), table.live.contains_key(&d.pid)) {
                out.push(ProcInfo {
                    pid: d.pid,
                    argv: d.argv.clone(),
                    started_ms: d.started_ms,
                    detached: true,
                    exit: Some(exit),
                });
            }
        }
        out.sort_by_key(|p| p.started_ms);
        out
    }

    /// Reaps every exited child (ours or an orphan re-parented to us). Called on SIGCHLD.
    pub fn reap(&self) {
        let mut table = self.lock();
        loop {
            let mut status = 0;
            // SAFETY: plain syscall with a valid out-pointer.
            let pid = unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) };
            if pid <= 0 {
                return; // 0: children remain but none exited; -1: ECHILD
            }
            if let Some(live) = table.live.remove(&(pid as u32)) {
                let _ = live.on_exit.send(decode_status(status));
            }
        }
    }
}

fn decode_status(status: i32) -> ExitStatus {
    if libc::WIFSIGNALED(status) {
        let signal = libc::WTERMSIG(status);
        ExitStatus { code: 128 + signal, signal: Some(signal), timed_out: false }
    } else {
        ExitStatus { code: libc::WEXITSTATUS(status), signal: None, timed_out: false }
    }
}

pub fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// A validated command, ready to spawn.
struct Prepared {
    cwd: String,
    env: Vec<(String, String)>,
    user: Option<User>,
}

/// Checks the request and builds the environment: a clean base, then the caller's variables.
fn prepare<'a>(cmd: &'a Command, defaults: &Defaults) -> Result<(&'a str, Prepared), WireError> {
    let Some(program) = cmd.argv.first() else {
        return Err(WireError::new(ErrorKind::BadRequest, "argv is empty"));
    };
    if cmd.argv.iter().any(|a| a.contains('\0')) {
        return Err(WireError::new(ErrorKind::BadRequest, "argv contains a NUL byte"));
    }
    let user = cmd.user.as_deref().or(defaults.user.as_deref()).map(users::lookup).transpose()?;
    let home = user
        .as_ref()
        .map_or_else(|| std::env::var("HOME").unwrap_or("/root".into()), |u| u.home.clone());
    let cwd = cmd.cwd.clone().or_else(|| defaults.cwd.clone()).unwrap_or_else(|| {
        if std::path::Path::new(&home).is_dir() { home.clone() } else { "/".into() }
    });
    match std::fs::metadata(&cwd) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => {
            return Err(WireError::new(
                ErrorKind::BadRequest,
                format!("cwd {cwd} is not a directory"),
            ));
        }
        Err(_) => {
            return Err(WireError::new(ErrorKind::NotFound, format!("cwd {cwd} does not exist")));
        }
    }
    let name = user.as_ref().map_or_else(|| "root".to_string(), |u| u.name.clone());
    let mut env: Vec<(String, String)> = vec![
        ("PATH".into(), BASE_PATH.into()),
        ("HOME".into(), home),
        ("USER".into(), name.clone()),
        ("LOGNAME".into(), name),
        ("LANG".into(), "C.UTF-8".into()),
    ];
    for (key, value) in defaults.env.iter().chain(&cmd.env) {
        if key.is_empty() || key.contains(['=', '\0']) || value.contains('\0') {
            return Err(WireError::new(
                ErrorKind::BadRequest,
                format!("bad environment variable {key:?}"),
            ));
        }
        match env.iter_mut().find(|(k, _)| k == key) {
            Some(slot) => slot.1 = value.clone(),
            None => env.push((key.clone(), value.clone())),
        }
    }
    Ok((program, Prepared { cwd, env, user }))
}

/// Drops to `user` in the child between fork and exec: groups, then gid, then uid.
fn drop_privileges(os: &mut std::process::Command, user: User) {
    let User { uid, gid, groups, .. } = user;
    // SAFETY: the closure only makes async-signal-safe syscalls on data prepared before fork.
    unsafe {
        os.pre_exec(move || {
            if libc::setgroups(groups.len(), groups.as_ptr()) != 0
                || libc::setgid(gid) != 0
                || libc::setuid(uid) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// A close-on-exec pipe: (read end, write end).
pub fn pipe_pair() -> Result<(OwnedFd, OwnedFd), WireError> {
    let mut fds = [0; 2];
    // SAFETY: `fds` has room for the two descriptors pipe2 returns.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        let e = std::io::Error::last_os_error();
        return Err(WireError::new(ErrorKind::ResourceExhausted, format!("pipe: {e}")));
    }
    // SAFETY: both descriptors were just created and are owned by nobody else.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

fn pipe_error(e: std::io::Error) -> WireError {
    WireError::new(ErrorKind::Internal, format!("pipe: {e}"))
}

fn spawn_error(program: &str, err: std::io::Error) -> WireError {
    let kind = match err.kind() {
        std::io::ErrorKind::NotFound => ErrorKind::NotFound,
        std::io::ErrorKind::PermissionDenied => ErrorKind::PermissionDenied,
        _ if err.raw_os_error() == Some(libc::EAGAIN) => ErrorKind::ResourceExhausted,
        _ => ErrorKind::Internal,
    };
    WireError::new(kind, format!("cannot start {program}: {err}"))
}
