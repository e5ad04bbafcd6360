//! Session verbs: `session_create`, `session_list`, `session_rm` and `session_exec` — persistent
//! `sh` processes whose `cd`, `export` and shell variables carry over from call to call, and
//! across connections.
//!
//! **The end-of-call marker.** Each call writes one line to the shell's stdin:
//!
//! ```text
//! command eval '<script>' </dev/null 3>&- ; printf '<nonce> %d\n' "$?" >&3
//! ```
//!
//! The script is single-quoted (a `'` inside becomes `'\''`), so no script text can end the
//! line early, and `command eval` keeps a syntax error from exiting the shell. The exit code comes
//! back on **fd 3, a pipe of its own**, never on stdout or stderr: the script runs with fd 3
//! closed, so nothing it prints can look like a marker, and the random per-call nonce makes
//! stale or stray lines on fd 3 ignorable too. When the marker arrives, every byte the script's
//! foreground commands wrote is already in the stdout and stderr pipes (those writes finished
//! before the shell learnt the exit code), so silkd drains both pipes without blocking and ends
//! the call with `Exit`.
//!
//! A call that does not finish normally (`Cancel`, timeout, the client leaving, a stray frame)
//! kills the session: its shell may be anywhere in the script, so no later call could trust it.
//! Output of background jobs started by earlier calls is discarded at the start of a call.
//! Idle sessions (no call for `--session-idle-secs`) are killed by a periodic sweep.

use std::os::fd::{AsRawFd, OwnedFd};
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::BytesMut;
use silk_proto::{
    Command, ErrorKind, ExitStatus, Frame, FrameReader, FrameWriter, SessionExecRequest,
    SessionRequest, WireError,
};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::unix::pipe;
use tokio::sync::watch;

use crate::call::{Agent, CallResult, interrupted};
use crate::procs::{ChildIo, now_ms, pipe_pair};
use crate::sessions::{Session, Shell};

const READ_CHUNK: usize = 64 * 1024;

/// Kills every session that stayed idle too long. Runs until the agent stops.
pub async fn sweep(agent: Arc<Agent>) {
    let idle = agent.options.session_idle;
    // Check a few times per idle period so a session outlives its limit by a fraction of it.
    let tick = (idle / 4).clamp(Duration::from_millis(50), Duration::from_secs(30));
    loop {
        tokio::time::sleep(tick).await;
        for pid in agent.sessions.take_idle(now_ms(), idle) {
            tracing::debug!(pid, "session idle: killed");
            let _ = agent.procs.kill(pid, libc::SIGKILL);
        }
    }
}

pub async fn create<W: AsyncWrite + Unpin>(
    agent: &Agent,
    req: SessionRequest,
    wr: &mut FrameWriter<W>,
) -> CallResult {
    let id = match req.id {
        Some(id) => valid_id(id)?,
        None => format!("s-{}", random_hex(6)?),
    };
    agent.sessions.check_room(&id)?;
    let cmd = Command { argv: vec!["sh".into()], cwd: req.cwd, env: req.env, user: req.user };
    let (status_rx, status_tx) = pipe_pair()?;
    let io = ChildIo {
        stdin: Stdio::piped(),
        stdout: Stdio::piped(),
        stderr: Stdio::piped(),
        fd3: Some(status_tx),
        terminal: false,
    };
    let (mut child, exited) = agent.procs.start_with(&cmd, io)?;
    let pid = child.id();
    let shell = (|| -> std::io::Result<Shell> {
        let take = |fd: Option<OwnedFd>| fd.ok_or_else(|| std::io::Error::other("not piped"));
        Ok(Shell {
            stdin: pipe::Sender::from_owned_fd(take(child.stdin.take().map(OwnedFd::from))?)?,
            stdout: pipe::Receiver::from_owned_fd(take(child.stdout.take().map(OwnedFd::from))?)?,
            stderr: pipe::Receiver::from_owned_fd(take(child.stderr.take().map(OwnedFd::from))?)?,
            status: pipe::Receiver::from_owned_fd(status_rx)?,
        })
    })();
    let shell = match shell {
        Ok(shell) => shell,
        Err(e) => {
            let _ = agent.procs.kill(pid, libc::SIGKILL);
            return Err(WireError::new(ErrorKind::Internal, format!("session pipes: {e}")).into());
        }
    };
    let (exit_tx, exit_rx) = watch::channel(None);
    let now = now_ms();
    let session = Arc::new(Session {
        id: id.clone(),
        pid,
        created_ms: now,
        last_used_ms: AtomicU64::new(now),
        shell: tokio::sync::Mutex::new(shell),
        exit: exit_rx,
    });
    if !agent.sessions.insert_new(session.clone()) {
        // Another connection created the same id while the shell started.
        let _ = agent.procs.kill(pid, libc::SIGKILL);
        return Err(WireError::new(ErrorKind::Conflict, format!("session {id:?} exists")).into());
    }
    // When the shell exits (`exit` in a script, `kill`, the idle sweep) the session goes away.
    let sessions = agent.sessions.clone();
    let weak = Arc::downgrade(&session);
    tokio::spawn(async move {
        let status = exited.await.ok();
        let _ = exit_tx.send(status.or(Some(lost_status())));
        if let Some(session) = weak.upgrade() {
            sessions.remove(&session);
        }
    });
    wr.queue(&Frame::Sessions(vec![session.info()]))?;
    Ok(wr.send(&Frame::Done).await?)
}

pub async fn list<W: AsyncWrite + Unpin>(agent: &Agent, wr: &mut FrameWriter<W>) -> CallResult {
    let mut infos = agent.sessions.infos();
    infos.sort_by(|a, b| a.id.cmp(&b.id));
    wr.queue(&Frame::Sessions(infos))?;
    Ok(wr.send(&Frame::Done).await?)
}

pub async fn rm<W: AsyncWrite + Unpin>(
    agent: &Agent,
    id: String,
    wr: &mut FrameWriter<W>,
) -> CallResult {
    let session = agent.sessions.get(&id)?;
    agent.sessions.remove(&session);
    // A call running in it sees its shell die and ends with that `Exit`.
    let _ = agent.procs.kill(session.pid, libc::SIGKILL);
    Ok(wr.send(&Frame::Done).await?)
}

/// Kills the session when a call ends any way other than its marker or the shell's exit.
struct EndSessionOnDrop<'a> {
    agent: &'a Agent,
    session: Option<&'a Arc<Session>>,
}

impl Drop for EndSessionOnDrop<'_> {
    fn drop(&mut self) {
        if let Some(session) = self.session {
            end(self.agent, session);
        }
    }
}

fn end(agent: &Agent, session: &Arc<Session>) {
    agent.sessions.remove(session);
    let _ = agent.procs.kill(session.pid, libc::SIGKILL);
}

pub async fn exec<R, W>(
    agent: &Agent,
    req: SessionExecRequest,
    rd: &mut FrameReader<R>,
    wr: &mut FrameWriter<W>,
) -> CallResult
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    if req.script.contains('\0') {
        return Err(WireError::new(ErrorKind::BadRequest, "script contains a NUL byte").into());
    }
    let session = agent.sessions.get(&req.id)?;
    let Ok(mut shell) = session.shell.try_lock() else {
        return Err(WireError::new(
            ErrorKind::Conflict,
            format!("session {:?} is running another call", req.id),
        )
        .into());
    };
    let mut exit = session.exit.clone();
    if let Some(status) = *exit.borrow() {
        return Err(WireError::new(
            ErrorKind::NotFound,
            format!("session {:?} ended (exit code {})", req.id, status.code),
        )
        .into());
    }
    let mut guard = EndSessionOnDrop { agent, session: Some(&session) };
    let shell = &mut *shell;
    // Whatever background jobs of earlier calls printed since is not this call's output.
    let mut scratch = vec![0u8; READ_CHUNK];
    for fd in [shell.stdout.as_raw_fd(), shell.stderr.as_raw_fd(), shell.status.as_raw_fd()] {
        while matches!(read_now(fd, &mut scratch), Ok(n) if n > 0) {}
    }

    let nonce = random_hex(16)?;
    let line = format!(
        "command eval {} </dev/null 3>&- ; printf '{nonce} %d\\n' \"$?\" >&3\n",
        quote(&req.script)
    );
    wr.send(&Frame::Started { pid: session.pid }).await?;
    // The shell reads the whole line before it runs any of it, so this cannot wait on output.
    let written = shell.stdin.write_all(line.as_bytes()).await.is_ok();

    let mut status_line = Vec::new();
    let (mut out_buf, mut err_buf) = (BytesMut::new(), BytesMut::new());
    let (mut out_open, mut err_open, mut status_open) = (written, written, written);
    let timeout = async {
        match req.timeout_ms {
            Some(ms) => tokio::time::sleep(Duration::from_millis(ms)).await,
            None => std::future::pending().await,
        }
    };
    tokio::pin!(timeout);
    let outcome = loop {
        tokio::select! {
            chunk = read_chunk(&mut shell.stdout, &mut out_buf), if out_open => match chunk {
                Some(data) => wr.send(&Frame::Stdout(data.freeze())).await?,
                None => out_open = false,
            },
            chunk = read_chunk(&mut shell.stderr, &mut err_buf), if err_open => match chunk {
                Some(data) => wr.send(&Frame::Stderr(data.freeze())).await?,
                None => err_open = false,
            },
            n = read_status(&mut shell.status, &mut status_line), if status_open => {
                if n == 0 {
                    status_open = false;
                } else if let Some(code) = take_marker(&mut status_line, &nonce) {
                    break Outcome::Marker(code);
                }
            }
            status = async { exit.wait_for(Option::is_some).await.ok().and_then(|s| *s) } => {
                break Outcome::ShellExited(status.unwrap_or_else(lost_status));
            }
            frame = rd.recv() => match frame {
                // The script's stdin is /dev/null: input-stream frames have nowhere to go.
                Ok(Some(Frame::Stdin(_) | Frame::Eof)) => {}
                Ok(Some(Frame::Cancel)) => break Outcome::Killed { timed_out: false },
                other => return Err(interrupted(other, "during a session call; the session was ended")),
            },
            () = &mut timeout => break Outcome::Killed { timed_out: true },
        }
    };

    let status = match outcome {
        Outcome::Marker(code) => {
            guard.session = None;
            session.last_used_ms.store(now_ms(), Ordering::Relaxed);
            ExitStatus { code, signal: None, timed_out: false }
        }
        Outcome::ShellExited(status) => {
            guard.session = None;
            agent.sessions.remove(&session);
            status
        }
        Outcome::Killed { timed_out } => {
            guard.session = None;
            end(agent, &session);
            ExitStatus { code: 128 + libc::SIGKILL, signal: Some(libc::SIGKILL), timed_out }
        }
    };
    // Everything the script wrote is in the pipes by now; send it without waiting for more.
    for (fd, is_err) in [(shell.stdout.as_raw_fd(), false), (shell.stderr.as_raw_fd(), true)] {
        loop {
            match read_now(fd, &mut scratch) {
                Ok(n) if n > 0 => {
                    let data = bytes::Bytes::copy_from_slice(&scratch[..n]);
                    wr.send(&if is_err { Frame::Stderr(data) } else { Frame::Stdout(data) })
                        .await?;
                }
                _ => break,
            }
        }
    }
    Ok(wr.send(&Frame::Exit(status)).await?)
}

enum Outcome {
    Marker(i32),
    ShellExited(ExitStatus),
    Killed { timed_out: bool },
}

/// The status of a shell whose exit the reaper could not report (it never happens while silkd
/// owns its children; reported as a kill rather than a success).
fn lost_status() -> ExitStatus {
    ExitStatus { code: 128 + libc::SIGKILL, signal: Some(libc::SIGKILL), timed_out: false }
}

/// One read from a pipe, or `None` at end of file or on an error.
async fn read_chunk(pipe: &mut pipe::Receiver, buf: &mut BytesMut) -> Option<BytesMut> {
    if buf.capacity() < READ_CHUNK / 4 {
        buf.reserve(READ_CHUNK);
    }
    match pipe.read_buf(buf).await {
        Ok(0) | Err(_) => None,
        Ok(_) => Some(buf.split()),
    }
}

/// Appends what the status pipe has to `line`; 0 at end of file. Cancel-safe.
async fn read_status(pipe: &mut pipe::Receiver, line: &mut Vec<u8>) -> usize {
    let mut buf = [0u8; 256];
    match pipe.read(&mut buf).await {
        Ok(n) => {
            line.extend_from_slice(&buf[..n]);
            n
        }
        Err(_) => 0,
    }
}

/// Takes complete lines off `buf`; returns the exit code of the first one carrying `nonce`.
fn take_marker(buf: &mut Vec<u8>, nonce: &str) -> Option<i32> {
    while let Some(end) = buf.iter().position(|&b| b == b'\n') {
        let line: Vec<u8> = buf.drain(..=end).collect();
        let text = String::from_utf8_lossy(&line[..end]);
        if let Some(code) = text.strip_prefix(nonce).and_then(|r| r.strip_prefix(' '))
            && let Ok(code) = code.trim().parse()
        {
            return Some(code);
        }
    }
    // A line that never ends is not ours: keep the buffer bounded.
    if buf.len() > 4096 {
        buf.clear();
    }
    None
}

/// A non-blocking read straight from the descriptor. Unlike tokio's `try_read`, it does not
/// consult the reactor's cached readiness, so "nothing left" really means the pipe is empty.
fn read_now(fd: std::os::fd::RawFd, buf: &mut [u8]) -> std::io::Result<usize> {
    // SAFETY: `buf` is valid for `buf.len()` bytes; the fd is an open non-blocking pipe end.
    let n = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) };
    if n < 0 { Err(std::io::Error::last_os_error()) } else { Ok(n as usize) }
}

/// Single-quotes `s` for sh: nothing inside single quotes is special except `'` itself.
fn quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', "'\\''"))
}

fn valid_id(id: String) -> Result<String, WireError> {
    let ok = (1..=64).contains(&id.len())
        && id.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    if ok {
        Ok(id)
    } else {
        Err(WireError::new(
            ErrorKind::BadRequest,
            format!("bad session id {id:?}: 1 to 64 of letters, digits, '-', '_', '.'"),
        ))
    }
}

/// `2 * bytes` hex digits from the kernel's random source.
pub fn random_hex(bytes: usize) -> Result<String, WireError> {
    let mut buf = vec![0u8; bytes];
    let mut filled = 0;
    while filled < buf.len() {
        // SAFETY: writes at most the remaining length into `buf`.
        let n =
            unsafe { libc::getrandom(buf[filled..].as_mut_ptr().cast(), buf.len() - filled, 0) };
        if n >= 0 {
            filled += n as usize;
            continue;
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(WireError::new(ErrorKind::Internal, format!("getrandom: {e}")));
        }
    }
    Ok(buf.iter().map(|b| format!("{b:02x}")).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn markers_need_the_nonce_and_a_whole_line() {
        let mut buf = b"deadbeef 0\nabc 1".to_vec();
        assert_eq!(take_marker(&mut buf, "abc"), None, "wrong nonce, then a partial line");
        buf.extend_from_slice(b"7\n");
        assert_eq!(take_marker(&mut buf, "abc"), Some(17));
        assert!(buf.is_empty());
    }

    #[test]
    fn quoting_survives_quotes_and_newlines() {
        assert_eq!(quote("it's\nok"), "'it'\\''s\nok'");
    }

    #[test]
    fn ids_are_validated_and_random_ones_differ() {
        assert!(valid_id("build-1.x_y".into()).is_ok());
        for bad in ["", "a b", "a/b", &"x".repeat(65)] {
            assert_eq!(valid_id(bad.into()).unwrap_err().kind, ErrorKind::BadRequest);
        }
        assert_ne!(random_hex(16).unwrap(), random_hex(16).unwrap());
        assert_eq!(random_hex(16).unwrap().len(), 32);
    }
}
