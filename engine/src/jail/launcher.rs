//! The engine's side of `silk-jail --serve` (see `launch::serve`): one launcher process kept
//! running per engine, asked for each start and each restore over a `SOCK_SEQPACKET` socket.
//! Either then costs a fork of that small process rather than a fork of the node and an exec
//! of the launcher (2–10 ms of a small sandbox's wake here, more under load).

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};

use super::host;
use super::launch::restore::RestoreSpec;
use super::launch::serve::{Request, decode_answer};
use super::launch::{LaunchSpec, USERNS_FD};
use crate::{EngineError, Result};

#[derive(Debug)]
pub(super) struct Launcher {
    path: PathBuf,
    /// The sandboxes' user namespace, which every jail enters.
    userns: OwnedFd,
    /// The running server; `None` until the first start, or after it died.
    server: Mutex<Option<Server>>,
}

#[derive(Debug)]
struct Server {
    socket: Arc<OwnedFd>,
    pid: u32,
}

impl Launcher {
    pub(super) fn new(path: &Path, userns: OwnedFd) -> Launcher {
        Launcher { path: path.to_path_buf(), userns, server: Mutex::new(None) }
    }

    /// Starts the jail `spec` describes; returns its init's host pid.
    pub(super) fn launch(&self, spec: LaunchSpec) -> Result<u32> {
        let answer =
            self.ask(&Request::Launch(spec), None).map_err(EngineError::io("ask the launcher"))?;
        decode_answer(&answer)
            .map_err(|why| EngineError::NotReady(format!("jail setup failed: {why}")))
    }

    /// Brings back the jail `spec` describes, silkd's `log` handed to CRIU; returns its init's
    /// host pid. `Err` says why not.
    pub(super) fn restore(
        &self,
        spec: RestoreSpec,
        log: BorrowedFd<'_>,
    ) -> std::result::Result<u32, String> {
        let answer = self
            .ask(&Request::Restore(spec), Some(log))
            .map_err(|e| format!("ask the launcher: {e}"))?;
        decode_answer(&answer)
    }

    /// Runs CRIU as `cmd` says (its program and arguments) and waits for it; `Err` is its
    /// stderr's end, or why it did not run. It dies with the node, as the launcher does.
    pub(super) fn criu(&self, cmd: &std::process::Command) -> std::result::Result<(), String> {
        let request = Request::Criu {
            bin: cmd.get_program().into(),
            args: cmd.get_args().map(|a| a.to_os_string()).collect(),
        };
        let answer = self.ask(&request, None).map_err(|e| format!("ask the launcher: {e}"))?;
        decode_answer(&answer).map(drop)
    }

    /// Sends `request` with the socket to answer on (and `more`); reads the answer. A server
    /// that died (killed, say) is replaced, once: the send meets its closed end.
    fn ask(&self, request: &Request, more: Option<BorrowedFd<'_>>) -> std::io::Result<Vec<u8>> {
        let json = serde_json::to_vec(request).map_err(std::io::Error::other)?;
        match self.ask_server(&json, more, false) {
            Err(e) if e.raw_os_error() == Some(libc::EPIPE) => self.ask_server(&json, more, true),
            answer => answer,
        }
    }

    /// One request to the server (a new one if `fresh`); the answer (empty: the launcher died
    /// before answering).
    fn ask_server(
        &self,
        request: &[u8],
        more: Option<BorrowedFd<'_>>,
        fresh: bool,
    ) -> std::io::Result<Vec<u8>> {
        let server = self.server(fresh)?;
        let (mine, theirs) = seqpacket_pair()?;
        let fds: Vec<BorrowedFd<'_>> = std::iter::once(theirs.as_fd()).chain(more).collect();
        send_with_fds(server.as_fd(), request, &fds)?;
        drop(theirs);
        let mut answer = vec![0u8; 64 << 10];
        let n = recv(mine.as_fd(), &mut answer)?;
        if n == 0 {
            return Err(std::io::Error::other("the launcher died before it answered"));
        }
        answer.truncate(n);
        Ok(answer)
    }

    /// The server's pid while one runs.
    pub(super) fn pid(&self) -> Option<u32> {
        self.server.lock().unwrap_or_else(|e| e.into_inner()).as_ref().map(|s| s.pid)
    }

    fn server(&self, fresh: bool) -> std::io::Result<Arc<OwnedFd>> {
        let mut server = self.server.lock().unwrap_or_else(|e| e.into_inner());
        match &*server {
            Some(s) if !fresh => Ok(s.socket.clone()),
            _ => {
                let (socket, pid) = self.spawn()?;
                let socket = Arc::new(socket);
                *server = Some(Server { socket: socket.clone(), pid });
                Ok(socket)
            }
        }
    }

    /// Runs `silk-jail --serve` from a thread of its own that waits for it: the server dies
    /// with the thread that spawned it (`PR_SET_PDEATHSIG`), so that thread must live as long.
    fn spawn(&self) -> std::io::Result<(OwnedFd, u32)> {
        let (mine, theirs) = seqpacket_pair()?;
        let userns = self.userns.as_raw_fd();
        let mut cmd = std::process::Command::new(&self.path);
        cmd.arg("--serve")
            .stdin(Stdio::from(theirs))
            .stdout(Stdio::null())
            .stderr(Stdio::inherit());
        host::dies_with_its_parent(&mut cmd);
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
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::Builder::new().name("silk-jail".into()).spawn(move || match cmd.spawn() {
            Ok(mut child) => {
                let _ = tx.send(Ok(child.id()));
                let _ = child.wait();
            }
            Err(e) => {
                let _ = tx.send(Err(e));
            }
        })?;
        let pid = rx.recv().map_err(|_| std::io::Error::other("the launcher's thread died"))??;
        Ok((mine, pid))
    }
}

fn seqpacket_pair() -> std::io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: socketpair fills `fds` with two new descriptors, owned from here on.
    unsafe {
        let flags = libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC;
        if libc::socketpair(libc::AF_UNIX, flags, 0, fds.as_mut_ptr()) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok((OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])))
    }
}

/// Sends `bytes` as one message on `socket` with `fds` (one or two) attached.
fn send_with_fds(
    socket: BorrowedFd<'_>,
    bytes: &[u8],
    fds: &[BorrowedFd<'_>],
) -> std::io::Result<()> {
    let mut space = [0u64; 8]; // room for a few descriptors' control message, aligned
    let size = std::mem::size_of_val(fds) as u32;
    // SAFETY: the message points at live buffers for the duration of the call; `space` holds
    // the control message of the few descriptors the engine sends.
    unsafe {
        let mut iov = libc::iovec { iov_base: bytes.as_ptr() as *mut _, iov_len: bytes.len() };
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = space.as_mut_ptr().cast();
        msg.msg_controllen = libc::CMSG_SPACE(size) as usize;
        assert!(msg.msg_controllen <= std::mem::size_of_val(&space));
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(size) as usize;
        let data = libc::CMSG_DATA(cmsg).cast::<i32>();
        for (i, fd) in fds.iter().enumerate() {
            std::ptr::write_unaligned(data.add(i), fd.as_raw_fd());
        }
        loop {
            if libc::sendmsg(socket.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) >= 0 {
                return Ok(());
            }
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
    }
}

fn recv(socket: BorrowedFd<'_>, buf: &mut [u8]) -> std::io::Result<usize> {
    loop {
        // SAFETY: `buf` is writable for its length.
        let n = unsafe { libc::recv(socket.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
        if n >= 0 {
            return Ok(n as usize);
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}
