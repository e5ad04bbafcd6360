//! The accept loop, the per-connection call loop, and shutdown.
//!
//! Each connection reads one request frame, hands it to its verb family's handler, and loops.
//! A handler sends its replies and its success terminal frame itself; a failure comes back as
//! [`Fail`]: `Call` is answered with an `Error` frame and the connection goes on, `Conn` means the
//! client is gone or the framing broke, and the connection is dropped (which kills any foreground
//! process of the call, see `process`).

use std::future::Future;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use silk_proto::{
    AgentInfo, ErrorKind, Frame, FrameReader, FrameWriter, PROTOCOL_VERSION, ProtoError, Welcome,
    WireError,
};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::signal::unix::{SignalKind, signal};

use crate::call::{Agent, CallResult, Fail, Options};
use crate::files::SocketReader;
use crate::listen::Listener;
use crate::{files, forward, git, process, pty, search, session, tree, watch};

/// Verb families served, as announced in `Welcome`.
const CAPABILITIES: &[&str] =
    &["exec", "spawn", "files", "tar", "sessions", "pty", "search", "watch", "git", "port_forward"];

/// Serves `listener` until `shutdown` resolves or SIGTERM/SIGINT arrives, then stops children
/// (SIGTERM, then SIGKILL after the grace period) and returns.
pub async fn run(
    listener: Listener,
    options: Options,
    shutdown: impl Future<Output = ()>,
) -> std::io::Result<()> {
    let agent = Arc::new(Agent::new(options));
    // Registered before any child exists, so no SIGCHLD is missed.
    let mut sigchld = signal(SignalKind::child())?;
    let reaper = {
        let agent = agent.clone();
        tokio::spawn(async move {
            loop {
                agent.procs.reap();
                if sigchld.recv().await.is_none() {
                    return;
                }
            }
        })
    };
    let sweeper = tokio::spawn(session::sweep(agent.clone()));
    let mut sigterm = signal(SignalKind::terminate())?;
    let mut sigint = signal(SignalKind::interrupt())?;
    tokio::pin!(shutdown);

    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            _ = sigterm.recv() => break,
            _ = sigint.recv() => break,
            accepted = accept(&listener, &agent) => {
                if let Err(e) = accepted {
                    // EMFILE and friends: back off briefly instead of spinning.
                    tracing::warn!("accept: {e}");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
        }
    }

    tracing::info!("shutting down");
    if let Listener::Unix(_, path) = &listener {
        let _ = std::fs::remove_file(path);
    }
    drop(listener);
    agent.procs.signal_all(libc::SIGTERM);
    let deadline = Instant::now() + agent.options.shutdown_grace;
    while agent.procs.live_count() > 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    agent.procs.signal_all(libc::SIGKILL);
    reaper.abort();
    sweeper.abort();
    Ok(())
}

async fn accept(listener: &Listener, agent: &Arc<Agent>) -> std::io::Result<()> {
    match listener {
        Listener::Unix(l, _) => {
            let (stream, _) = l.accept().await?;
            if agent.dumpable.swap(false, Ordering::Relaxed) {
                // Non-dumpable again after a dump (see `quiesce`), before serving anyone.
                // SAFETY: plain prctl.
                unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) };
            }
            let fd = stream.as_raw_fd();
            let (r, w) = stream.into_split();
            spawn_connection(agent.clone(), SocketReader::new(r, fd), w);
        }
        Listener::Tcp(l) => {
            let (stream, _) = l.accept().await?;
            stream.set_nodelay(true)?;
            let fd = stream.as_raw_fd();
            let (r, w) = stream.into_split();
            spawn_connection(agent.clone(), SocketReader::new(r, fd), w);
        }
        Listener::Vsock(l) => {
            let (stream, _) = l.accept().await?;
            let fd = stream.as_raw_fd();
            let (r, w) = stream.into_split();
            spawn_connection(agent.clone(), SocketReader::new(r, fd), w);
        }
    }
    Ok(())
}

fn spawn_connection<R, W>(agent: Arc<Agent>, r: SocketReader<R>, w: W)
where
    R: AsyncRead + Unpin + Send + 'static,
    W: AsyncWrite + Unpin + Send + 'static,
{
    tokio::spawn(async move {
        let me = agent.next_connection.fetch_add(1, Ordering::Relaxed);
        let mut quiesce = agent.quiesce.subscribe();
        agent.connections.fetch_add(1, Ordering::Relaxed);
        tokio::select! {
            () = serve(&agent, me, FrameReader::new(r), FrameWriter::new(w)) => {}
            // Another connection asked for quiet: this one ends wherever it is (its socket and
            // any foreground process go as on a hang-up).
            _ = quiesce.wait_for(|asker| *asker != 0 && *asker != me) => {}
        }
        agent.connections.fetch_sub(1, Ordering::Relaxed);
    });
}

/// `Quiesce`: closes every other connection, waits (a moment at most) until they are gone,
/// answers `Done`; the caller then closes this one.
async fn quiesce<W: AsyncWrite + Unpin>(agent: &Agent, me: u64, wr: &mut FrameWriter<W>) {
    agent.quiesce.send_replace(me);
    if std::process::id() == 1 {
        // CRIU's check that the jail's namespaces belong to its user namespace reads this
        // process's /proc entries from inside that namespace, which a non-dumpable process
        // whose memory was made outside it (one CRIU restored) refuses. Dumpable until the next
        // connection (see `accept`); the sandbox is frozen for the dump meanwhile.
        // SAFETY: plain prctl.
        unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 1, 0, 0, 0) };
        agent.dumpable.store(true, Ordering::Relaxed);
    }
    let deadline = Instant::now() + Duration::from_secs(2);
    while agent.connections.load(Ordering::Relaxed) > 1 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    // Connections made from now on (after a checkpoint that kept the sandbox running, or in
    // its restored copies) are served again.
    agent.quiesce.send_replace(0);
    let _ = wr.send(&Frame::Done).await;
}

async fn serve<R, W>(
    agent: &Agent,
    me: u64,
    mut rd: FrameReader<SocketReader<R>>,
    mut wr: FrameWriter<W>,
) where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    loop {
        let frame = match rd.recv().await {
            Ok(Some(frame)) => frame,
            Ok(None) => return,
            Err(e) => {
                let recoverable = e.is_recoverable();
                let reply = Frame::Error(WireError::new(ErrorKind::BadRequest, e.to_string()));
                if matches!(e, ProtoError::Io(_) | ProtoError::Truncated)
                    || wr.send(&reply).await.is_err()
                    || !recoverable
                {
                    return;
                }
                continue;
            }
        };
        if frame == Frame::Quiesce {
            return quiesce(agent, me, &mut wr).await;
        }
        let name = frame.name();
        match call(agent, frame, &mut rd, &mut wr).await {
            Ok(()) => {}
            Err(Fail::Call(e)) => {
                tracing::debug!(call = name, "failed: {e}");
                if wr.send(&Frame::Error(e)).await.is_err() {
                    return;
                }
            }
            Err(Fail::Conn(e)) => {
                tracing::debug!(call = name, "connection ended: {e}");
                return;
            }
        }
    }
}

async fn call<R, W>(
    agent: &Agent,
    frame: Frame,
    rd: &mut FrameReader<SocketReader<R>>,
    wr: &mut FrameWriter<W>,
) -> CallResult
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    match frame {
        // The tail of an input stream whose call already ended (e.g. the process exited while
        // the client was still sending stdin, or a write failed early): dropped by design.
        Frame::Stdin(_) | Frame::Data(_) | Frame::Eof | Frame::Cancel => Ok(()),
        Frame::Hello(hello) => {
            if hello.protocol != PROTOCOL_VERSION {
                return Err(Fail::Call(WireError::new(
                    ErrorKind::Unsupported,
                    format!(
                        "protocol {} is not served; this agent speaks {PROTOCOL_VERSION}",
                        hello.protocol
                    ),
                )));
            }
            wr.queue(&Frame::Welcome(Welcome {
                protocol: PROTOCOL_VERSION,
                agent_version: env!("CARGO_PKG_VERSION").into(),
                capabilities: CAPABILITIES.iter().map(|c| c.to_string()).collect(),
            }))?;
            Ok(wr.send(&Frame::Done).await?)
        }
        Frame::Info => {
            wr.queue(&Frame::InfoReply(AgentInfo {
                agent_version: env!("CARGO_PKG_VERSION").into(),
                protocol: PROTOCOL_VERSION,
                uptime_ms: agent.started.elapsed().as_millis() as u64,
                processes: agent.procs.live_count() as u32,
                sessions: agent.sessions.len() as u32,
                connections: agent.connections.load(Ordering::Relaxed),
            }))?;
            Ok(wr.send(&Frame::Done).await?)
        }
        Frame::Exec(req) => process::exec(agent, req, rd, wr).await,
        Frame::Spawn(cmd) => process::spawn(agent, cmd, wr).await,
        Frame::Ps => {
            wr.queue(&Frame::Procs(agent.procs.list()))?;
            Ok(wr.send(&Frame::Done).await?)
        }
        Frame::Logs { pid } => process::logs(agent, pid, wr).await,
        Frame::Attach { pid } => process::attach(agent, pid, rd, wr).await,
        Frame::Kill { pid, signal } => process::kill(agent, pid, signal, wr).await,
        Frame::Read(req) => files::read(req, wr).await,
        Frame::Write(req) => files::write(req, rd, wr).await,
        Frame::Stat { path } => files::stat(path, wr).await,
        Frame::List { path } => files::list(path, wr).await,
        Frame::Mkdir { path, parents } => files::mkdir(path, parents, wr).await,
        Frame::Rm { path, recursive } => files::rm(path, recursive, wr).await,
        Frame::Rename { from, to } => files::rename(from, to, wr).await,
        Frame::Push { path } => tree::push(path, rd, wr).await,
        Frame::Pull { path } => tree::pull(path, wr).await,
        Frame::SessionCreate(req) => session::create(agent, req, wr).await,
        Frame::SessionList => session::list(agent, wr).await,
        Frame::SessionRm { id } => session::rm(agent, id, wr).await,
        Frame::SessionExec(req) => session::exec(agent, req, rd, wr).await,
        Frame::PtyOpen(req) => pty::open(agent, req, rd, wr).await,
        Frame::PtyResize { pid, cols, rows } => pty::resize(agent, pid, cols, rows, wr).await,
        Frame::Find(req) => search::find(req, rd, wr).await,
        Frame::Replace(req) => search::replace(req, wr).await,
        Frame::Watch(req) => watch::watch(agent, req, rd, wr).await,
        Frame::Git(req) => git::git(agent, req, rd, wr).await,
        Frame::PortForward { port } => forward::forward(port, rd, wr).await,
        Frame::Quiesce => Ok(()), // answered by `serve`
        Frame::Chown { path, user } => files::chown(path, user, wr).await,
        reply @ (Frame::Stdout(_)
        | Frame::Stderr(_)
        | Frame::Exit(_)
        | Frame::Done
        | Frame::Error(_)
        | Frame::Welcome(_)
        | Frame::InfoReply(_)
        | Frame::Started { .. }
        | Frame::Spawned { .. }
        | Frame::Procs(_)
        | Frame::StatReply(_)
        | Frame::Entries(_)
        | Frame::Dropped { .. }
        | Frame::Ready
        | Frame::Sessions(_)
        | Frame::Matches(_)
        | Frame::Replaced { .. }
        | Frame::Events(_)
        | Frame::GitReply(_)) => Err(Fail::Call(WireError::new(
            ErrorKind::BadRequest,
            format!("{} is a reply, not a request", reply.name()),
        ))),
    }
}
