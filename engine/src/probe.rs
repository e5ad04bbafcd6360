//! A tiny blocking silkd client: the readiness probe (`info`) and the golden's warmup (`exec`).
//! Built on silk-proto's sans-IO codec, so it needs no async runtime.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use silk_proto::{AgentInfo, Command, ExecRequest, ExitStatus, Frame, decode, encode};

use crate::{AgentAddr, EngineError, Result};

struct Client {
    stream: UnixStream,
    buf: BytesMut,
    deadline: Instant,
}

impl Client {
    fn connect(agent: &AgentAddr, deadline: Instant) -> Result<Client> {
        let stream = crate::agent::connect(agent)
            .and_then(|s| s.set_nonblocking(false).map(|()| s))
            .map_err(|e| EngineError::NotReady(format!("connect to silkd: {e}")))?;
        Ok(Client { stream, buf: BytesMut::with_capacity(4096), deadline })
    }

    fn send(&mut self, frame: &Frame) -> Result<()> {
        let mut out = BytesMut::new();
        encode(frame, &mut out).map_err(|e| EngineError::NotReady(e.to_string()))?;
        self.stream.write_all(&out).map_err(|e| EngineError::NotReady(format!("send: {e}")))
    }

    fn info(&mut self) -> Result<AgentInfo> {
        self.send(&Frame::Info)?;
        let mut info = None;
        loop {
            match self.recv()? {
                Frame::InfoReply(i) => info = Some(i),
                Frame::Done => {
                    return info.ok_or_else(|| EngineError::NotReady("no InfoReply".into()));
                }
                Frame::Error(e) => return Err(EngineError::NotReady(e.to_string())),
                _ => {}
            }
        }
    }

    fn recv(&mut self) -> Result<Frame> {
        loop {
            if let Some(frame) =
                decode(&mut self.buf).map_err(|e| EngineError::NotReady(e.to_string()))?
            {
                return Ok(frame);
            }
            let left = self.deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(EngineError::NotReady("silkd did not answer in time".into()));
            }
            self.stream.set_read_timeout(Some(left)).map_err(EngineError::io("socket timeout"))?;
            let mut chunk = [0u8; 16 * 1024];
            match self.stream.read(&mut chunk) {
                Ok(0) => return Err(EngineError::NotReady("silkd closed the connection".into())),
                Ok(n) => self.buf.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(EngineError::NotReady(format!("read: {e}"))),
            }
        }
    }
}

/// Waits until silkd at `agent` answers `info`.
pub fn info(agent: &AgentAddr, timeout: Duration) -> Result<AgentInfo> {
    Client::connect(agent, Instant::now() + timeout)?.info()
}

/// Waits until silkd at `agent` answers `info`; returns the connection it answered on, idle
/// and non-blocking, when nothing else came on it (silkd never speaks first).
pub fn ready(agent: &AgentAddr, timeout: Duration) -> Result<Option<UnixStream>> {
    let mut c = Client::connect(agent, Instant::now() + timeout)?;
    c.info()?;
    let idle = c.buf.is_empty()
        && c.stream.set_read_timeout(None).is_ok()
        && c.stream.set_nonblocking(true).is_ok();
    Ok(idle.then_some(c.stream))
}

/// The connections on which starts were found ready ([`ready`]), each kept a few seconds for
/// its sandbox's first caller (`Engine::take_answered`): that call then opens no connection
/// into the sandbox, and its silkd accepts none on the call's path. One not taken closes when
/// it expires or when its sandbox stops.
#[derive(Debug, Default)]
pub(crate) struct Answered(Mutex<Vec<(crate::SandboxId, Instant, UnixStream)>>);

/// How long an answered connection waits for its taker: the node takes it as the start returns.
const ANSWERED_FOR: Duration = Duration::from_secs(10);

impl Answered {
    pub(crate) fn keep(&self, id: &crate::SandboxId, conn: UnixStream) {
        let mut kept = self.0.lock().unwrap_or_else(|e| e.into_inner());
        kept.retain(|(other, since, _)| other != id && since.elapsed() < ANSWERED_FOR);
        kept.push((id.clone(), Instant::now(), conn));
    }

    pub(crate) fn take(&self, id: &crate::SandboxId) -> Option<UnixStream> {
        let mut kept = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let at = kept.iter().position(|(other, _, _)| other == id)?;
        let (_, since, conn) = kept.swap_remove(at);
        (since.elapsed() < ANSWERED_FOR).then_some(conn)
    }

    /// Closes the one kept for `id`, if any (its sandbox stops).
    pub(crate) fn forget(&self, id: &crate::SandboxId) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).retain(|(other, _, _)| other != id);
    }
}

/// Runs `argv` to completion; returns its exit status and the last 4 KiB of its output.
pub fn exec(
    agent: &AgentAddr,
    argv: &[String],
    env: &[(String, String)],
    timeout: Duration,
) -> Result<(ExitStatus, String)> {
    let mut c = Client::connect(agent, Instant::now() + timeout + Duration::from_secs(5))?;
    c.send(&Frame::Exec(ExecRequest {
        command: Command { argv: argv.to_vec(), env: env.to_vec(), ..Default::default() },
        stdin: false,
        timeout_ms: Some(timeout.as_millis() as u64),
    }))?;
    let mut tail = Vec::new();
    loop {
        match c.recv()? {
            Frame::Stdout(b) | Frame::Stderr(b) => {
                tail.extend_from_slice(&b);
                let excess = tail.len().saturating_sub(4096);
                tail.drain(..excess);
            }
            Frame::Exit(status) => {
                return Ok((status, String::from_utf8_lossy(&tail).into_owned()));
            }
            Frame::Error(e) => return Err(EngineError::WarmupFailed(e.to_string())),
            _ => {}
        }
    }
}

/// Asks silkd to close every connection (this one last), so the jail holds no socket of the
/// host's when CRIU dumps it. Returns once silkd closed this connection too.
pub fn quiesce(agent: &AgentAddr, timeout: Duration) -> Result<()> {
    let mut c = Client::connect(agent, Instant::now() + timeout)?;
    c.send(&Frame::Quiesce)?;
    match c.recv()? {
        Frame::Done => {}
        Frame::Error(e) => return Err(EngineError::NotReady(e.to_string())),
        other => return Err(EngineError::NotReady(format!("quiesce answered {}", other.name()))),
    }
    // silkd closes its end right after `Done`: wait for that, so its socket is gone.
    match c.recv() {
        Err(EngineError::NotReady(m)) if m.contains("closed the connection") => Ok(()),
        Err(e) => Err(e),
        Ok(other) => Err(EngineError::NotReady(format!("quiesce went on with {}", other.name()))),
    }
}
