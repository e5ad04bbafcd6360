//! Pty verbs: `pty_open` (a command on a new pseudo-terminal, its input and output streamed)
//! and `pty_resize`.
//!
//! The child is started through the process table like any other (it shows in `ps`, `kill`
//! reaches it, the reaper collects it), as the leader of a new session whose controlling
//! terminal is the pty's slave side. silkd keeps only the master side, non-blocking, on the
//! reactor. As with `exec`, output and input are pumped concurrently (a program that is not
//! reading its input must not stop its output from flowing), and the call ends when the child
//! exited and every holder of the slave side closed it (reads on the master then fail with
//! `EIO`), with `Exit`.
//!
//! **Resize** is addressed by pid: `PtyResize{pid, cols, rows}` is a request of its own from any
//! connection (answered `Done`, or `NotFound` once the pty's call ended), and the same frame may
//! also be sent inside the `PtyOpen` call as a control frame (no answer). `Eof` from the client is
//! ignored: a terminal has no end of input; send `^D` (0x04) as input instead.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::process::Stdio;
use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use silk_proto::{ErrorKind, ExitStatus, Frame, FrameReader, FrameWriter, PtyRequest, WireError};
use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, AsyncWrite};

use crate::call::{Agent, CallResult, Fail, interrupted};
use crate::procs::ChildIo;
use crate::ptys::{check_size, set_size};

const READ_CHUNK: usize = 64 * 1024;

/// Removes the pty from the registry and kills its child if the call ends first.
struct Guard<'a> {
    agent: &'a Agent,
    pid: u32,
    kill: bool,
}

impl Drop for Guard<'_> {
    fn drop(&mut self) {
        self.agent.ptys.remove(self.pid);
        if self.kill {
            let _ = self.agent.procs.kill(self.pid, libc::SIGKILL);
        }
    }
}

pub async fn resize<W: AsyncWrite + Unpin>(
    agent: &Agent,
    pid: u32,
    cols: u16,
    rows: u16,
    wr: &mut FrameWriter<W>,
) -> CallResult {
    agent.ptys.resize(pid, cols, rows)?;
    Ok(wr.send(&Frame::Done).await?)
}

pub async fn open<R, W>(
    agent: &Agent,
    req: PtyRequest,
    rd: &mut FrameReader<R>,
    wr: &mut FrameWriter<W>,
) -> CallResult
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut cmd = req.command;
    if cmd.argv.is_empty() {
        cmd.argv = vec!["/bin/sh".into()];
    }
    if !cmd.env.iter().any(|(k, _)| k == "TERM") {
        cmd.env.push(("TERM".into(), "xterm-256color".into()));
    }
    let (master, slave) = open_pty(req.cols, req.rows)?;
    let stdio = |fd: &OwnedFd| {
        fd.try_clone()
            .map(Stdio::from)
            .map_err(|e| WireError::new(ErrorKind::ResourceExhausted, format!("pty: {e}")))
    };
    let io = ChildIo {
        stdin: stdio(&slave)?,
        stdout: stdio(&slave)?,
        stderr: Stdio::from(slave),
        fd3: None,
        terminal: true,
    };
    // `io` (every copy of the slave side) is dropped inside, so only the child holds it.
    let (child, exited) = agent.procs.start_with(&cmd, io)?;
    let pid = child.id();
    drop(child); // it holds no pipes; the reaper owns the exit status
    let mut guard = Guard { agent, pid, kill: true };
    // SAFETY: an `OwnedFd` stays open, on the same descriptor, until the `AsyncFd` drops it.
    let master = unsafe { AsyncFd::register(master) }
        .map_err(|e| WireError::new(ErrorKind::Internal, format!("pty reactor: {e}")))?;
    let master = Arc::new(master);
    agent.ptys.insert(pid, master.clone());
    wr.send(&Frame::Started { pid }).await?;

    let status = {
        let finished = async {
            let mut buf = BytesMut::new();
            while let Some(data) = read_master(&master, &mut buf).await {
                wr.send(&Frame::Stdout(data)).await?;
            }
            exited
                .await
                .map_err(|_| Fail::Call(WireError::new(ErrorKind::Internal, "exit status lost")))
        };
        let input = pump_input(&master, pid, rd);
        tokio::pin!(finished, input);
        let mut input_open = true;
        loop {
            tokio::select! {
                status = &mut finished => break status?,
                end = &mut input, if input_open => {
                    // Only `Cancel` ends the input side without an error.
                    end?;
                    input_open = false;
                    let _ = agent.procs.kill(pid, libc::SIGKILL);
                }
            }
        }
    };
    // Unregistered before the client hears of the exit, so a resize it sends next is refused.
    guard.kill = false;
    drop(guard);
    Ok(wr.send(&Frame::Exit(ExitStatus { timed_out: false, ..status })).await?)
}

/// Client frames → the terminal's input. Returns `Ok` on `Cancel`; an error when the client
/// left or sent something that does not belong in the call.
async fn pump_input<R: AsyncRead + Unpin>(
    master: &AsyncFd<OwnedFd>,
    pid: u32,
    rd: &mut FrameReader<R>,
) -> Result<(), Fail> {
    let mut writable = true;
    loop {
        match rd.recv().await {
            Ok(Some(Frame::Stdin(data))) => {
                // A terminal that stopped taking input (the child is gone): drop what follows.
                if writable && write_master(master, &data).await.is_err() {
                    writable = false;
                }
            }
            Ok(Some(Frame::Eof)) => {}
            Ok(Some(Frame::Cancel)) => return Ok(()),
            Ok(Some(Frame::PtyResize { pid: target, cols, rows })) if target == pid => {
                set_size(master.get_ref(), cols, rows)?;
            }
            other => return Err(interrupted(other, "during a pty call; the call was abandoned")),
        }
    }
}

/// One read of terminal output, or `None` once no process holds the slave side (`EIO`).
async fn read_master(master: &AsyncFd<OwnedFd>, buf: &mut BytesMut) -> Option<Bytes> {
    loop {
        let mut ready = master.readable().await.ok()?;
        if buf.capacity() < READ_CHUNK / 4 {
            buf.reserve(READ_CHUNK);
        }
        let spare = buf.spare_capacity_mut();
        let read = ready.try_io(|fd| {
            // SAFETY: reads into the buffer's spare capacity, at most its length.
            let n = unsafe { libc::read(fd.as_raw_fd(), spare.as_mut_ptr().cast(), spare.len()) };
            if n < 0 { Err(std::io::Error::last_os_error()) } else { Ok(n as usize) }
        });
        match read {
            Ok(Ok(0)) | Ok(Err(_)) => return None,
            Ok(Ok(n)) => {
                // SAFETY: the kernel initialised `n` bytes of the spare capacity.
                unsafe { buf.set_len(buf.len() + n) };
                return Some(buf.split().freeze());
            }
            Err(_would_block) => continue,
        }
    }
}

async fn write_master(master: &AsyncFd<OwnedFd>, mut data: &[u8]) -> std::io::Result<()> {
    while !data.is_empty() {
        let mut ready = master.writable().await?;
        let wrote = ready.try_io(|fd| {
            // SAFETY: writes from a valid slice.
            let n = unsafe { libc::write(fd.as_raw_fd(), data.as_ptr().cast(), data.len()) };
            if n < 0 { Err(std::io::Error::last_os_error()) } else { Ok(n as usize) }
        });
        match wrote {
            Ok(Ok(n)) => data = &data[n..],
            Ok(Err(e)) => return Err(e),
            Err(_would_block) => continue,
        }
    }
    Ok(())
}

/// A new pty of the given size: (master, non-blocking; slave). Both are opened close-on-exec
/// atomically, so a child started concurrently on another connection cannot inherit either
/// (an inherited slave would keep the call from ever seeing its end).
fn open_pty(cols: u16, rows: u16) -> Result<(OwnedFd, OwnedFd), WireError> {
    check_size(cols, rows)?;
    let fail = |what: &str| {
        let e = std::io::Error::last_os_error();
        WireError::new(ErrorKind::ResourceExhausted, format!("{what}: {e}"))
    };
    let flags = libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC;
    // SAFETY: plain open of a constant path.
    let fd = unsafe { libc::open(c"/dev/ptmx".as_ptr(), flags | libc::O_NONBLOCK) };
    if fd < 0 {
        return Err(fail("open /dev/ptmx"));
    }
    // SAFETY: `fd` was just opened and is owned by nothing else.
    let master = unsafe { OwnedFd::from_raw_fd(fd) };
    let unlock: libc::c_int = 0;
    // SAFETY: TIOCSPTLCK reads one int; TIOCGPTPEER opens the slave side with `flags`.
    let slave = unsafe {
        if libc::ioctl(master.as_raw_fd(), libc::TIOCSPTLCK, &unlock) != 0 {
            return Err(fail("unlock pty"));
        }
        libc::ioctl(master.as_raw_fd(), libc::TIOCGPTPEER, flags)
    };
    if slave < 0 {
        return Err(fail("open pty slave"));
    }
    // SAFETY: the ioctl returned a fresh descriptor that nothing else owns.
    let slave = unsafe { OwnedFd::from_raw_fd(slave) };
    set_size(&master, cols, rows)?;
    Ok((master, slave))
}
