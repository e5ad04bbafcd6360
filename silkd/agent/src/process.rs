//! Process verbs: `exec` (foreground, streamed), `spawn` (detached, output in a ring), `logs`,
//! `attach` and `kill`.
//!
//! `exec` runs three things at once: the output pump (pipes → `Stdout`/`Stderr` frames, so a
//! client that stops reading stops the child through the pipe's backpressure), the input pump
//! (client frames → stdin, watching for `Cancel` and for the client going away), and the
//! timeout. Whatever way the call ends early, a guard kills the child's process group.
//! The call ends when the child exited **and** both pipes reached end of file, so a background
//! grandchild that keeps stdout open keeps the call open (as with ssh); use `spawn` for daemons.

use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use silk_proto::{
    Command, ErrorKind, ExecRequest, ExitStatus, Frame, FrameReader, FrameWriter, ProtoError,
    WireError,
};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::unix::pipe;

use crate::call::{Agent, CallResult, Fail, interrupted};
use crate::procs::{Detached, Procs, now_ms};
use crate::ring::Ring;

const PIPE_READ: usize = 64 * 1024;

/// Kills a child's process group when a call ends before the child did.
pub struct KillOnDrop<'a> {
    pub procs: &'a Procs,
    pub pid: Option<u32>,
}

impl Drop for KillOnDrop<'_> {
    fn drop(&mut self) {
        if let Some(pid) = self.pid {
            let _ = self.procs.kill(pid, libc::SIGKILL);
        }
    }
}

/// How the client's side of an exec ended before the process did.
enum InputEnd {
    Cancel,
}

pub async fn exec<R, W>(
    agent: &Agent,
    req: ExecRequest,
    rd: &mut FrameReader<R>,
    wr: &mut FrameWriter<W>,
) -> CallResult
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let child = agent.procs.start(&req.command, req.stdin)?;
    let pid = child.pid;
    let mut guard = KillOnDrop { procs: &agent.procs, pid: Some(pid) };
    wr.send(&Frame::Started { pid }).await?;

    let mut timed_out = false;
    let status = {
        let finished = async {
            pump_output(child.stdout, child.stderr, wr).await?;
            child
                .exited
                .await
                .map_err(|_| Fail::Call(WireError::new(ErrorKind::Internal, "exit status lost")))
        };
        let input = pump_input(rd, child.stdin);
        let timeout = async {
            match req.timeout_ms {
                Some(ms) => tokio::time::sleep(Duration::from_millis(ms)).await,
                None => std::future::pending().await,
            }
        };
        tokio::pin!(finished, input, timeout);
        let mut input_open = true;
        loop {
            tokio::select! {
                status = &mut finished => break status?,
                end = &mut input, if input_open => {
                    input_open = false;
                    match end? {
                        InputEnd::Cancel => { let _ = agent.procs.kill(pid, libc::SIGKILL); }
                    }
                }
                () = &mut timeout, if !timed_out => {
                    timed_out = true;
                    let _ = agent.procs.kill(pid, libc::SIGKILL);
                }
            }
        }
    };
    guard.pid = None;
    Ok(wr.send(&Frame::Exit(ExitStatus { timed_out, ..status })).await?)
}

/// Streams both pipes to the client until both reach end of file.
async fn pump_output<W: AsyncWrite + Unpin>(
    mut stdout: pipe::Receiver,
    mut stderr: pipe::Receiver,
    wr: &mut FrameWriter<W>,
) -> Result<(), Fail> {
    let (mut out_buf, mut err_buf) = (BytesMut::new(), BytesMut::new());
    let (mut out_open, mut err_open) = (true, true);
    while out_open || err_open {
        tokio::select! {
            chunk = read_chunk(&mut stdout, &mut out_buf), if out_open => match chunk {
                Some(data) => wr.send(&Frame::Stdout(data)).await?,
                None => out_open = false,
            },
            chunk = read_chunk(&mut stderr, &mut err_buf), if err_open => match chunk {
                Some(data) => wr.send(&Frame::Stderr(data)).await?,
                None => err_open = false,
            },
        }
    }
    Ok(())
}

/// One read from a pipe, or `None` at end of file (or on a read error, which ends it too).
/// Cancel-safe: bytes read land in `buf` and are returned by the next call.
pub async fn read_chunk(pipe: &mut pipe::Receiver, buf: &mut BytesMut) -> Option<Bytes> {
    if buf.is_empty() {
        buf.reserve(PIPE_READ);
    }
    match pipe.read_buf(buf).await {
        Ok(0) | Err(_) => None,
        Ok(_) => Some(buf.split().freeze()),
    }
}

/// Feeds the child's stdin from the client until the call ends. Returns only when the client
/// cancels or is gone (as an error); `Eof` closes stdin and keeps watching.
async fn pump_input<R: AsyncRead + Unpin>(
    rd: &mut FrameReader<R>,
    mut stdin: Option<pipe::Sender>,
) -> Result<InputEnd, Fail> {
    loop {
        match rd.recv().await {
            Ok(Some(Frame::Stdin(data))) => {
                if let Some(pipe) = stdin.as_mut() {
                    // The child closing its stdin is its business: drop what follows.
                    if pipe.write_all(&data).await.is_err() {
                        stdin = None;
                    }
                }
            }
            Ok(Some(Frame::Eof)) => stdin = None,
            Ok(Some(Frame::Cancel)) => return Ok(InputEnd::Cancel),
            other => {
                return Err(interrupted(
                    other,
                    "while a process is running; the call was abandoned",
                ));
            }
        }
    }
}

pub async fn spawn<W: AsyncWrite + Unpin>(
    agent: &Agent,
    cmd: Command,
    wr: &mut FrameWriter<W>,
) -> CallResult {
    let child = agent.procs.start(&cmd, false)?;
    let detached = Arc::new(Detached {
        pid: child.pid,
        argv: cmd.argv,
        started_ms: now_ms(),
        ring: Ring::new(agent.options.ring_bytes),
    });
    agent.procs.add_detached(detached.clone());
    let pid = child.pid;
    tokio::spawn(async move {
        let ring = &detached.ring;
        let output = async {
            let (mut stdout, mut stderr) = (child.stdout, child.stderr);
            let (mut out_buf, mut err_buf) = (BytesMut::new(), BytesMut::new());
            let (mut out_open, mut err_open) = (true, true);
            while out_open || err_open {
                tokio::select! {
                    chunk = read_chunk(&mut stdout, &mut out_buf), if out_open => match chunk {
                        Some(data) => ring.push(false, data),
                        None => out_open = false,
                    },
                    chunk = read_chunk(&mut stderr, &mut err_buf), if err_open => match chunk {
                        Some(data) => ring.push(true, data),
                        None => err_open = false,
                    },
                }
            }
        };
        let exit = async {
            if let Ok(status) = child.exited.await {
                ring.set_exit(status);
            }
        };
        tokio::join!(output, exit);
        ring.close_output();
    });
    wr.queue(&Frame::Spawned { pid })?;
    Ok(wr.send(&Frame::Done).await?)
}

pub async fn logs<W: AsyncWrite + Unpin>(
    agent: &Agent,
    pid: u32,
    wr: &mut FrameWriter<W>,
) -> CallResult {
    let detached = agent.procs.detached(pid)?;
    let mut cursor = 0;
    let scan = detached.ring.scan(&mut cursor);
    if scan.dropped > 0 {
        wr.queue(&Frame::Dropped { bytes: scan.dropped })?;
    }
    for frame in &scan.frames {
        wr.queue(frame)?;
    }
    Ok(wr.send(&Frame::Done).await?)
}

/// Replays the ring, then follows it until the process exits (ending with its `Exit`) or the
/// client sends `Cancel` (ending with `Done`; the process keeps running).
pub async fn attach<R, W>(
    agent: &Agent,
    pid: u32,
    rd: &mut FrameReader<R>,
    wr: &mut FrameWriter<W>,
) -> CallResult
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let detached = agent.procs.detached(pid)?;
    let mut changed = detached.ring.subscribe();
    let mut cursor = 0;
    loop {
        let scan = detached.ring.scan(&mut cursor);
        if scan.dropped > 0 {
            wr.queue(&Frame::Dropped { bytes: scan.dropped })?;
        }
        for frame in &scan.frames {
            wr.send(frame).await?;
        }
        if let Some(status) = scan.finished {
            return Ok(wr.send(&Frame::Exit(status)).await?);
        }
        wr.flush().await?;
        tokio::select! {
            _ = changed.changed() => {}
            frame = rd.recv() => match frame {
                Ok(Some(Frame::Cancel)) => return Ok(wr.send(&Frame::Done).await?),
                Ok(Some(_)) => {} // stray input-stream frames: ignored
                Ok(None) => return Err(Fail::Conn(ProtoError::Truncated)),
                Err(e) => return Err(Fail::Conn(e)),
            },
        }
    }
}

pub async fn kill<W: AsyncWrite + Unpin>(
    agent: &Agent,
    pid: u32,
    signal: i32,
    wr: &mut FrameWriter<W>,
) -> CallResult {
    if !(1..=64).contains(&signal) {
        return Err(Fail::Call(WireError::new(
            ErrorKind::BadRequest,
            format!("bad signal {signal}"),
        )));
    }
    agent.procs.kill(pid, signal)?;
    Ok(wr.send(&Frame::Done).await?)
}
