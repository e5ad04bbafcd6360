//! Processes: streaming `exec` (an [`Exec`] handle: output chunks, stdin, cancel, exit status),
//! the collecting `run`/`run_checked`, detached `spawn`, `ps`, `logs`, `attach` and `kill`, and
//! persistent shell sessions (whose `session_exec` streams through the same [`Exec`] handle).
//!
//! An exec runs on a pooled connection; the connection goes back to the pool when `Exit`
//! arrives, unless an [`ExecStdin`] handle is still alive (someone could still write into the
//! connection). Dropping an [`Exec`] before it ended closes its connection, which makes silkd kill
//! the process group.

use std::sync::Arc;
use std::time::Duration;

use crate::conn::{RelayRead, RelayWrite};
use bytes::{Bytes, BytesMut};
use silk_proto::{
    Command, ExecRequest, ExitStatus, Frame, FrameReader, FrameWriter, ProcInfo,
    SessionExecRequest, SessionInfo, SessionRequest,
};
use tokio::sync::Mutex;

use crate::conn::{RelayConn, recv};
use crate::error::{Error, Result};
use crate::sandbox::Sandbox;

/// A piece of a process's output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Chunk {
    Stdout(Bytes),
    Stderr(Bytes),
}

/// What a collected run produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Output {
    pub status: ExitStatus,
    pub stdout: Bytes,
    pub stderr: Bytes,
}

impl Output {
    /// The exit code (128 + signal when killed).
    pub fn code(&self) -> i32 {
        self.status.code
    }

    pub fn success(&self) -> bool {
        self.status.code == 0 && self.status.signal.is_none()
    }

    /// stdout as text (lossy UTF-8).
    pub fn stdout_str(&self) -> String {
        String::from_utf8_lossy(&self.stdout).into_owned()
    }

    pub fn stderr_str(&self) -> String {
        String::from_utf8_lossy(&self.stderr).into_owned()
    }

    fn checked(self) -> Result<Output> {
        if self.success() {
            Ok(self)
        } else {
            Err(Error::NonZeroExit {
                code: self.status.code,
                signal: self.status.signal,
                stdout: self.stdout,
                stderr: self.stderr,
            })
        }
    }
}

/// Stdin up to this size is sent with the request itself.
const INLINE_STDIN: usize = 64 * 1024;

#[derive(Debug)]
enum Stdin {
    Null,
    Bytes(Bytes),
    Stream,
}

/// A command being prepared: [`start`](Self::start) streams, [`run`](Self::run) collects,
/// [`spawn`](Self::spawn) detaches.
#[derive(Debug)]
#[must_use = "an ExecBuilder does nothing until started"]
pub struct ExecBuilder {
    sandbox: Sandbox,
    command: Command,
    timeout: Option<Duration>,
    stdin: Stdin,
}

impl ExecBuilder {
    /// Working directory (default: the user's home).
    pub fn cwd(mut self, dir: impl Into<String>) -> Self {
        self.command.cwd = Some(dir.into());
        self
    }

    /// An environment variable on top of the clean base environment.
    pub fn env(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.command.env.push((key.into(), value.into()));
        self
    }

    /// Run as this user name or uid of the sandbox.
    pub fn user(mut self, user: impl Into<String>) -> Self {
        self.command.user = Some(user.into());
        self
    }

    /// silkd kills the process group after this long (`Exit` then has `timed_out`).
    pub fn timeout(mut self, d: Duration) -> Self {
        self.timeout = Some(d);
        self
    }

    /// Feed these bytes on stdin, then end it.
    pub fn stdin(mut self, data: impl Into<Bytes>) -> Self {
        self.stdin = Stdin::Bytes(data.into());
        self
    }

    /// Keep stdin open for [`Exec::write_stdin`] / [`Exec::stdin`] (only with `start`).
    pub fn stdin_stream(mut self) -> Self {
        self.stdin = Stdin::Stream;
        self
    }

    /// Starts the process; returns once silkd answered `Started`.
    pub async fn start(self) -> Result<Exec> {
        let request = Frame::Exec(ExecRequest {
            command: self.command,
            stdin: !matches!(self.stdin, Stdin::Null),
            timeout_ms: self.timeout.map(|d| d.as_millis() as u64),
        });
        let mut conn = self.sandbox.conn().await?;
        conn.wr.queue(&request)?;
        let mut feed = None;
        let stdin_open = match self.stdin {
            Stdin::Null => false,
            // Small input goes out with the request, in one write.
            Stdin::Bytes(data) if data.len() <= INLINE_STDIN => {
                conn.wr.queue(&Frame::Stdin(data))?;
                conn.wr.queue(&Frame::Eof)?;
                false
            }
            // Large input is fed by a task while the caller reads the output: a process that
            // echoes its input would otherwise fill the pipes both ways and stall.
            Stdin::Bytes(data) => {
                feed = Some(data);
                true
            }
            Stdin::Stream => true,
        };
        conn.wr.flush().await?;
        let mut exec = Exec::started(self.sandbox, conn, stdin_open, "exec").await?;
        if let Some(data) = feed {
            let stdin = exec.stdin()?;
            exec.stdin_open = false;
            tokio::spawn(async move {
                // A process that exits before reading everything ends the call; what is left
                // is discarded by silkd, and the failed write needs no report.
                if stdin.write(data).await.is_ok() {
                    let _ = stdin.close().await;
                }
            });
        }
        Ok(exec)
    }

    /// Runs to the end and collects the output, whatever the exit code.
    pub async fn run(self) -> Result<Output> {
        if matches!(self.stdin, Stdin::Stream) {
            return Err(Error::Invalid("run feeds stdin with .stdin(bytes), not a stream".into()));
        }
        self.start().await?.collect().await
    }

    /// Like [`run`](Self::run), but a non-zero exit is [`Error::NonZeroExit`].
    pub async fn run_checked(self) -> Result<Output> {
        self.run().await?.checked()
    }

    /// Starts the process detached (its output kept in a ring for `logs`/`attach`); returns its
    /// pid. Stdin is `/dev/null`; a timeout cannot be set.
    pub async fn spawn(self) -> Result<u32> {
        if self.timeout.is_some() || !matches!(self.stdin, Stdin::Null) {
            return Err(Error::Invalid("a spawned process takes no timeout and no stdin".into()));
        }
        let mut pid = None;
        self.sandbox
            .unary(Frame::Spawn(self.command), |f| match f {
                Frame::Spawned { pid: p } => {
                    pid = Some(p);
                    Ok(())
                }
                other => Err(Error::unexpected(&other, "spawn")),
            })
            .await?;
        pid.ok_or_else(|| Error::Protocol("spawn ended without a pid".into()))
    }
}

fn chunks(mut data: Bytes) -> impl Iterator<Item = Bytes> {
    std::iter::from_fn(move || {
        (!data.is_empty()).then(|| data.split_to(data.len().min(silk_proto::DATA_CHUNK)))
    })
}

/// A running process (an `exec` or a `session_exec`).
#[derive(Debug)]
pub struct Exec {
    sandbox: Sandbox,
    pid: u32,
    /// Both `None` once the call ended.
    rd: Option<FrameReader<RelayRead>>,
    wr: Option<Arc<Mutex<FrameWriter<RelayWrite>>>>,
    stdin_open: bool,
    status: Option<ExitStatus>,
}

impl Exec {
    async fn started(
        sandbox: Sandbox,
        mut conn: RelayConn,
        stdin_open: bool,
        what: &str,
    ) -> Result<Exec> {
        match conn.recv().await? {
            Frame::Started { pid } => Ok(Exec {
                sandbox,
                pid,
                rd: Some(conn.rd),
                wr: Some(Arc::new(Mutex::new(conn.wr))),
                stdin_open,
                status: None,
            }),
            Frame::Error(e) => {
                sandbox.put_back(conn);
                Err(e.into())
            }
            other => Err(Error::unexpected(&other, what)),
        }
    }

    /// The process id inside the sandbox (for a session, its shell).
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// The exit status, once [`next`](Self::next) returned `None`.
    pub fn status(&self) -> Option<ExitStatus> {
        self.status
    }

    /// The next output chunk, or `None` once the process exited and its output ended.
    /// Cancel-safe (usable in `select!`).
    pub async fn next(&mut self) -> Result<Option<Chunk>> {
        let Some(rd) = self.rd.as_mut() else { return Ok(None) };
        match recv(rd).await? {
            Frame::Stdout(b) => Ok(Some(Chunk::Stdout(b))),
            Frame::Stderr(b) => Ok(Some(Chunk::Stderr(b))),
            Frame::Exit(status) => {
                self.status = Some(status);
                self.finish();
                Ok(None)
            }
            Frame::Error(e) => {
                self.finish();
                Err(e.into())
            }
            other => {
                (self.rd, self.wr) = (None, None);
                Err(Error::unexpected(&other, "exec"))
            }
        }
    }

    /// The call ended cleanly: pool the connection unless a stdin handle still exists.
    fn finish(&mut self) {
        let (Some(rd), Some(wr)) = (self.rd.take(), self.wr.take()) else { return };
        if let Ok(wr) = Arc::try_unwrap(wr) {
            self.sandbox.put_back(RelayConn { rd, wr: wr.into_inner() });
        }
    }

    /// Waits for the end, discarding output.
    pub async fn wait(mut self) -> Result<ExitStatus> {
        while self.next().await?.is_some() {}
        self.status.ok_or_else(|| Error::Protocol("exec ended without a status".into()))
    }

    /// Waits for the end, collecting output.
    pub async fn collect(mut self) -> Result<Output> {
        let (mut out, mut err) = (BytesMut::new(), BytesMut::new());
        while let Some(chunk) = self.next().await? {
            match chunk {
                Chunk::Stdout(b) => out.extend_from_slice(&b),
                Chunk::Stderr(b) => err.extend_from_slice(&b),
            }
        }
        let status =
            self.status.ok_or_else(|| Error::Protocol("exec ended without a status".into()))?;
        Ok(Output { status, stdout: out.freeze(), stderr: err.freeze() })
    }

    /// A handle for writing stdin from another task. Only for an exec started with
    /// [`ExecBuilder::stdin_stream`].
    pub fn stdin(&self) -> Result<ExecStdin> {
        if !self.stdin_open {
            return Err(Error::Invalid("this exec was not started with stdin_stream()".into()));
        }
        let wr = self.wr.clone().ok_or_else(|| Error::Invalid("the process has ended".into()))?;
        Ok(ExecStdin { wr })
    }

    pub async fn write_stdin(&self, data: impl Into<Bytes>) -> Result<()> {
        self.stdin()?.write(data).await
    }

    /// Ends stdin (the process reads end of file).
    pub async fn close_stdin(&self) -> Result<()> {
        self.stdin()?.close().await
    }

    /// Asks silkd to kill the process group; the call still ends with `Exit` (signal 9), which
    /// [`next`](Self::next) reports.
    pub async fn cancel(&self) -> Result<()> {
        match &self.wr {
            Some(wr) => Ok(wr.lock().await.send(&Frame::Cancel).await?),
            None => Ok(()),
        }
    }
}

/// Writes into an exec's stdin; cloneable, usable from another task than the reader.
#[derive(Debug, Clone)]
pub struct ExecStdin {
    wr: Arc<Mutex<FrameWriter<RelayWrite>>>,
}

impl ExecStdin {
    pub async fn write(&self, data: impl Into<Bytes>) -> Result<()> {
        let mut wr = self.wr.lock().await;
        for chunk in chunks(data.into()) {
            wr.send(&Frame::Stdin(chunk)).await?;
        }
        Ok(())
    }

    pub async fn close(&self) -> Result<()> {
        Ok(self.wr.lock().await.send(&Frame::Eof).await?)
    }
}

/// What `logs` returned: the ring's content, and how much of it was lost before it was read.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Logs {
    pub dropped: u64,
    pub chunks: Vec<Chunk>,
}

impl Logs {
    /// All stdout chunks, joined.
    pub fn stdout(&self) -> Vec<u8> {
        self.chunks
            .iter()
            .filter_map(|c| if let Chunk::Stdout(b) = c { Some(&b[..]) } else { None })
            .flatten()
            .copied()
            .collect()
    }

    pub fn stderr(&self) -> Vec<u8> {
        self.chunks
            .iter()
            .filter_map(|c| if let Chunk::Stderr(b) = c { Some(&b[..]) } else { None })
            .flatten()
            .copied()
            .collect()
    }
}

/// Following a detached process: its ring replayed, then live output, then its exit. Runs on a
/// connection of its own.
#[derive(Debug)]
pub struct Attach {
    conn: Option<RelayConn>,
    dropped: u64,
    status: Option<ExitStatus>,
}

impl Attach {
    /// Bytes lost from the ring before they could be sent (reported before any chunk).
    pub fn dropped(&self) -> u64 {
        self.dropped
    }

    /// The exit status, when the process exited while attached.
    pub fn status(&self) -> Option<ExitStatus> {
        self.status
    }

    /// The next chunk; `None` when the process exited (see [`status`](Self::status)) or after
    /// [`cancel`](Self::cancel). Cancel-safe.
    pub async fn next(&mut self) -> Result<Option<Chunk>> {
        let Some(conn) = self.conn.as_mut() else { return Ok(None) };
        loop {
            match conn.recv().await {
                Ok(Frame::Dropped { bytes }) => self.dropped += bytes,
                Ok(Frame::Stdout(b)) => return Ok(Some(Chunk::Stdout(b))),
                Ok(Frame::Stderr(b)) => return Ok(Some(Chunk::Stderr(b))),
                Ok(Frame::Exit(s)) => {
                    self.status = Some(s);
                    self.conn = None;
                    return Ok(None);
                }
                Ok(Frame::Done) => {
                    self.conn = None;
                    return Ok(None);
                }
                Ok(Frame::Error(e)) => {
                    self.conn = None;
                    return Err(e.into());
                }
                Ok(other) => {
                    self.conn = None;
                    return Err(Error::unexpected(&other, "attach"));
                }
                Err(e) => {
                    self.conn = None;
                    return Err(e);
                }
            }
        }
    }

    /// Stops following (the process keeps running); [`next`](Self::next) then drains to the end.
    pub async fn cancel(&mut self) -> Result<()> {
        match self.conn.as_mut() {
            Some(c) => c.send(&Frame::Cancel).await,
            None => Ok(()),
        }
    }
}

impl Sandbox {
    /// Prepares a command; see [`ExecBuilder`].
    pub fn exec<I, S>(&self, argv: I) -> ExecBuilder
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        ExecBuilder {
            sandbox: self.clone(),
            command: Command {
                argv: argv.into_iter().map(Into::into).collect(),
                ..Default::default()
            },
            timeout: None,
            stdin: Stdin::Null,
        }
    }

    /// Runs `argv` and collects its output, whatever the exit code.
    pub async fn run<I, S>(&self, argv: I) -> Result<Output>
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.exec(argv).run().await
    }

    /// Runs `argv`; a non-zero exit is [`Error::NonZeroExit`].
    pub async fn run_checked<I, S>(&self, argv: I) -> Result<Output>
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.exec(argv).run_checked().await
    }

    /// Starts `argv` detached; returns its pid.
    pub async fn spawn<I, S>(&self, argv: I) -> Result<u32>
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.exec(argv).spawn().await
    }

    /// Processes silkd started (running, and the last exited detached ones).
    pub async fn ps(&self) -> Result<Vec<ProcInfo>> {
        let mut procs = vec![];
        self.unary(Frame::Ps, |f| match f {
            Frame::Procs(mut batch) => {
                procs.append(&mut batch);
                Ok(())
            }
            other => Err(Error::unexpected(&other, "ps")),
        })
        .await?;
        Ok(procs)
    }

    /// A detached process's output ring.
    pub async fn logs(&self, pid: u32) -> Result<Logs> {
        let mut logs = Logs::default();
        self.unary(Frame::Logs { pid }, |f| {
            match f {
                Frame::Dropped { bytes } => logs.dropped += bytes,
                Frame::Stdout(b) => logs.chunks.push(Chunk::Stdout(b)),
                Frame::Stderr(b) => logs.chunks.push(Chunk::Stderr(b)),
                other => return Err(Error::unexpected(&other, "logs")),
            }
            Ok(())
        })
        .await?;
        Ok(logs)
    }

    /// Follows a detached process: replay, then live output until it exits. No byte is lost or
    /// repeated between the replay and the live part.
    pub async fn attach(&self, pid: u32) -> Result<Attach> {
        let mut conn = self.dial().await?;
        conn.send(&Frame::Attach { pid }).await?;
        Ok(Attach { conn: Some(conn), dropped: 0, status: None })
    }

    /// Sends `signal` to the process group of a live process silkd started.
    pub async fn kill(&self, pid: u32, signal: i32) -> Result<()> {
        self.unary(Frame::Kill { pid, signal }, |f| Err(Error::unexpected(&f, "kill"))).await
    }

    // ---- sessions ----

    /// Starts a persistent shell session (`cd`, `export` and variables carry over between
    /// `session_exec` calls). `SessionRequest::default()` lets silkd pick the id.
    pub async fn session_create(&self, request: SessionRequest) -> Result<SessionInfo> {
        let mut created = None;
        self.unary(Frame::SessionCreate(request), |f| match f {
            Frame::Sessions(mut s) if s.len() == 1 => {
                created = s.pop();
                Ok(())
            }
            other => Err(Error::unexpected(&other, "session_create")),
        })
        .await?;
        created.ok_or_else(|| Error::Protocol("session_create ended without the session".into()))
    }

    pub async fn session_list(&self) -> Result<Vec<SessionInfo>> {
        let mut all = vec![];
        self.unary(Frame::SessionList, |f| match f {
            Frame::Sessions(mut s) => {
                all.append(&mut s);
                Ok(())
            }
            other => Err(Error::unexpected(&other, "session_list")),
        })
        .await?;
        Ok(all)
    }

    /// Ends a session (its shell's process group is killed).
    pub async fn session_rm(&self, id: &str) -> Result<()> {
        self.unary(Frame::SessionRm { id: id.into() }, |f| Err(Error::unexpected(&f, "session_rm")))
            .await
    }

    /// Runs `script` in the session and collects its output.
    pub async fn session_exec(&self, id: &str, script: &str) -> Result<Output> {
        self.session_exec_stream(id, script, None).await?.collect().await
    }

    /// Runs `script` in the session, streaming. A timeout (or cancel) kills the session.
    pub async fn session_exec_stream(
        &self,
        id: &str,
        script: &str,
        timeout: Option<Duration>,
    ) -> Result<Exec> {
        let request = Frame::SessionExec(SessionExecRequest {
            id: id.into(),
            script: script.into(),
            timeout_ms: timeout.map(|d| d.as_millis() as u64),
        });
        let mut conn = self.conn().await?;
        conn.send(&request).await?;
        Exec::started(self.clone(), conn, false, "session_exec").await
    }
}
