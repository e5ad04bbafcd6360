//! `silk-jail --serve`: the launcher kept running beside the engine, so a start costs a `fork`
//! of this small single-threaded process instead of a fork of the node and an `exec` of the
//! launcher (its dynamic loading and libc's start-up, which on a virtual machine where `cpuid`
//! traps costs most of a millisecond).
//!
//! The engine holds the other end of [`CONTROL_FD`], a `SOCK_SEQPACKET` socket. Each message is
//! one [`Request`] as JSON with the socket to answer on attached (and, for a restore, silkd's
//! log). For each, the server forks a launcher that starts the jail as `silk-jail SPEC.json`
//! does ([`run`]) or brings it back from CRIU's images ([`super::restore::run`]), and answers
//! `+PID` or `-why` on that socket; the server goes back to reading at once, so starts run side
//! by side. When the engine's end closes, the server exits.
//!
//! Each launcher dies with the server (`PR_SET_PDEATHSIG`), which dies with the node: a start
//! interrupted by a crash never finishes behind the next node's back (see the engine's
//! `dies_with_its_parent`).
//!
//! Between starts the server makes network namespaces ahead ([`NETWORK_STOCK`] of them, once
//! no request came for [`QUIET`]): a new one is ~0.5 ms of a start's CPU, the largest step of
//! the namespaces'. Each is handed to one launcher only (popped before its fork, closed in
//! the server after it), and a launcher closes the others first thing.

use std::ffi::OsString;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::restore::{LOG_FD, RestoreSpec};
use super::{LaunchSpec, make_network_namespace, run};

/// What the engine asks the server for.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Request {
    /// A new jail.
    Launch(LaunchSpec),
    /// A jail back from CRIU's images; silkd's log comes attached, after the answer's socket.
    Restore(RestoreSpec),
    /// CRIU (a dump), run and waited for; it dies with its launcher.
    Criu { bin: PathBuf, args: Vec<OsString> },
}

/// Network namespaces kept made ahead.
const NETWORK_STOCK: usize = 4;

/// How long the server must have had no request before it makes one: not beside a start it
/// just forked (on a two-core host it would slow that start by as much).
const QUIET: Duration = Duration::from_millis(20);

/// The descriptor the server reads its requests on (its stdin).
pub const CONTROL_FD: i32 = 0;

/// The longest request read; a longer one is answered with an error.
const MAX_REQUEST: usize = 1 << 20;

/// The answer to a start: the jail's host pid, or why it did not start.
pub fn encode_answer(answer: &Result<u32, String>) -> Vec<u8> {
    match answer {
        Ok(pid) => format!("+{pid}").into_bytes(),
        Err(why) => format!("-{why}").into_bytes(),
    }
}

/// Reads what [`encode_answer`] wrote.
pub fn decode_answer(bytes: &[u8]) -> Result<u32, String> {
    let text = String::from_utf8_lossy(bytes);
    match text.split_at_checked(1) {
        Some(("+", pid)) => pid.parse().map_err(|_| format!("the launcher answered {text:?}")),
        Some(("-", why)) => Err(why.to_string()),
        _ => Err(format!("the launcher answered {text:?}")),
    }
}

/// Serves starts until the engine closes its end. Returns why it could not go on.
pub fn serve() -> Result<(), String> {
    let os = |what: &str| format!("{what}: {}", std::io::Error::last_os_error());
    let me = std::process::id() as libc::pid_t;
    let mut buf = vec![0u8; MAX_REQUEST];
    let mut stock: Vec<i32> = Vec::with_capacity(NETWORK_STOCK);
    // SAFETY: plain syscalls in a single-threaded process; the child below runs Rust code,
    // which is sound after `fork` because no other thread held a lock it could need.
    unsafe {
        // Launchers are reaped by the kernel; each one puts the default back for its own
        // children (it waits for them).
        libc::signal(libc::SIGCHLD, libc::SIG_IGN);
        loop {
            if stock.len() < NETWORK_STOCK && !request_within(QUIET) {
                // A host that cannot make one ahead makes it in each launcher, as before.
                if let Ok(net) = make_network_namespace() {
                    stock.push(net);
                }
                continue;
            }
            let (n, reply, log) = match receive(&mut buf) {
                Ok(Some(got)) => got,
                Ok(None) => return Ok(()),
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                Err(e) => return Err(format!("read a request: {e}")),
            };
            let request = serde_json::from_slice::<Request>(&buf[..n])
                .map_err(|e| format!("read the request: {e}"));
            // A restore's network namespace is CRIU's to make.
            let net = match request {
                Ok(Request::Launch(_)) => stock.pop(),
                _ => None,
            };
            let pid = libc::fork();
            if pid < 0 {
                let answer = encode_answer(&Err(os("fork a launcher")));
                libc::send(reply, answer.as_ptr().cast(), answer.len(), libc::MSG_NOSIGNAL);
            } else if pid == 0 {
                // The other namespaces made ahead are other jails'.
                stock.iter().for_each(|other| _ = libc::close(*other));
                libc::signal(libc::SIGCHLD, libc::SIG_DFL);
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 || libc::getppid() != me
                {
                    libc::_exit(1);
                }
                let (answer, reply) = match place_descriptors(reply, log) {
                    Ok(reply) => (request.and_then(|r| serve_one(r, net)), reply),
                    Err(why) => (Err(why), reply),
                };
                let answer = encode_answer(&answer);
                libc::send(reply, answer.as_ptr().cast(), answer.len(), libc::MSG_NOSIGNAL);
                libc::_exit(0);
            }
            if let Some(net) = net {
                libc::close(net);
            }
            libc::close(reply);
            if let Some(log) = log {
                libc::close(log);
            }
        }
    }
}

/// In a forked launcher, first: the jail's descriptors are placed by number (its listening
/// socket at 3, the user namespace at 4, a restore's log at [`LOG_FD`]), so the answer's socket
/// moves out of their way and the engine's end becomes `/dev/null`. Returns the answer's
/// descriptor.
///
/// # Safety
/// Plain syscalls.
unsafe fn place_descriptors(reply: i32, log: Option<i32>) -> Result<i32, String> {
    unsafe {
        let fail = || format!("launcher descriptors: {}", std::io::Error::last_os_error());
        let moved = libc::fcntl(reply, libc::F_DUPFD_CLOEXEC, 10);
        let null = libc::open(c"/dev/null".as_ptr(), libc::O_RDWR | libc::O_CLOEXEC);
        if moved < 0 || null < 0 || libc::dup2(null, CONTROL_FD) < 0 {
            return Err(fail());
        }
        libc::close(null);
        libc::close(reply);
        if let Some(log) = log {
            // Above the target first, so the source is never the target itself; `dup2` leaves
            // the target open across CRIU's exec.
            let above = libc::fcntl(log, libc::F_DUPFD_CLOEXEC, 10);
            if above < 0 || libc::dup2(above, LOG_FD) < 0 {
                return Err(fail());
            }
            libc::close(above);
            if log != LOG_FD {
                libc::close(log);
            }
        }
        Ok(moved)
    }
}

/// In a forked launcher: the request, started as `silk-jail SPEC.json` would (in `net`, if one
/// was made ahead) or restored.
fn serve_one(request: Request, net: Option<i32>) -> Result<u32, String> {
    match request {
        Request::Launch(spec) => run(&spec, net),
        Request::Restore(spec) => super::restore::run(&spec),
        Request::Criu { bin, args } => criu(&bin, &args).map(|()| 0),
    }
}

/// Runs CRIU and waits for it; `Err` is the end of its stderr. It dies with this launcher, which
/// dies with the server, which dies with the node: a dump left running would finish after the
/// next start thawed its jail and freeze it again.
fn criu(bin: &Path, args: &[OsString]) -> Result<(), String> {
    use std::process::Stdio;
    let mut cmd = std::process::Command::new(bin);
    cmd.args(args).stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::piped());
    super::super::host::dies_with_its_parent(&mut cmd);
    let mut child = cmd.spawn().map_err(|e| format!("run {}: {e}", bin.display()))?;
    let mut stderr = String::new();
    if let Some(mut err) = child.stderr.take() {
        let _ = err.read_to_string(&mut stderr);
    }
    let status = child.wait().map_err(|e| format!("wait for {}: {e}", bin.display()))?;
    if status.success() {
        return Ok(());
    }
    if stderr.trim().is_empty() {
        return Err(format!("{} {status}", bin.display()));
    }
    // The answer is one message: the end of a long stderr, where the reason is.
    let mut from = stderr.len().saturating_sub(4096);
    while !stderr.is_char_boundary(from) {
        from += 1;
    }
    Err(stderr[from..].to_string())
}

/// Whether a request (or the engine's end closing) arrives on [`CONTROL_FD`] within `wait`.
fn request_within(wait: Duration) -> bool {
    let mut poll = libc::pollfd { fd: CONTROL_FD, events: libc::POLLIN, revents: 0 };
    // SAFETY: poll(2) on one descriptor we own. An error (EINTR) counts as a request: the
    // loop reads, which tells.
    unsafe { libc::poll(&mut poll, 1, wait.as_millis() as i32) != 0 }
}

/// One request: its length in `buf`, the descriptor to answer on and the one more a restore
/// carries. `None`: the engine is gone.
///
/// # Safety
/// Plain syscalls on [`CONTROL_FD`].
unsafe fn receive(buf: &mut [u8]) -> std::io::Result<Option<(usize, i32, Option<i32>)>> {
    unsafe {
        let mut iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
        let mut space = [0u64; 8]; // room for a few descriptors' control message, aligned
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = space.as_mut_ptr().cast();
        msg.msg_controllen = std::mem::size_of_val(&space);
        let n = libc::recvmsg(CONTROL_FD, &mut msg, libc::MSG_CMSG_CLOEXEC);
        if n < 0 {
            return Err(std::io::Error::last_os_error());
        }
        if n == 0 && msg.msg_controllen == 0 {
            return Ok(None);
        }
        let mut fds = vec![];
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        if !cmsg.is_null()
            && (*cmsg).cmsg_level == libc::SOL_SOCKET
            && (*cmsg).cmsg_type == libc::SCM_RIGHTS
        {
            let data = libc::CMSG_DATA(cmsg).cast::<i32>();
            let count = ((*cmsg).cmsg_len - libc::CMSG_LEN(0) as usize) / size_of::<i32>();
            fds.extend((0..count).map(|i| std::ptr::read_unaligned(data.add(i))));
        }
        // The answer's socket first, then a restore's log; the engine sends no more.
        let (Some(&reply), log) = (fds.first(), fds.get(1).copied()) else {
            // Nowhere to answer: the engine never sends that. Skip it.
            return receive(buf);
        };
        fds.iter().skip(2).for_each(|fd| _ = libc::close(*fd));
        if msg.msg_flags & libc::MSG_TRUNC != 0 {
            let answer = encode_answer(&Err("the request is too long".into()));
            libc::send(reply, answer.as_ptr().cast(), answer.len(), libc::MSG_NOSIGNAL);
            fds.iter().take(2).for_each(|fd| _ = libc::close(*fd));
            return receive(buf);
        }
        Ok(Some((n as usize, reply, log)))
    }
}
