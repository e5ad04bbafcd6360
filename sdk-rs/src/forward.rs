//! Port forwarding: a local TCP listener on 127.0.0.1 whose connections each reach a TCP port
//! inside the sandbox through a relay connection of their own (`PortForward` call).
//!
//! Splicing honours half-close both ways: the local peer's end of stream becomes an `Eof` frame
//! (silkd shuts down its write side to the sandbox's server), and silkd's `Eof` shuts down the
//! write side of the local socket; the call ends with silkd's `Done` once both directions are
//! closed. A local connection whose forward cannot be set up (nothing listens inside) is closed
//! at once; [`PortForward::failures`] counts those.

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::BytesMut;
use silk_proto::Frame;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;

use crate::conn::{RelayConn, recv};
use crate::error::{Error, Result};
use crate::sandbox::Sandbox;

const READ_CHUNK: usize = 64 * 1024;

/// A running forward. Dropping it closes the listener and every forwarded connection.
#[derive(Debug)]
pub struct PortForward {
    local: SocketAddr,
    failures: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl PortForward {
    /// The local address to connect to.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// Local connections closed because the forward failed (setup or mid-stream).
    pub fn failures(&self) -> u64 {
        self.failures.load(Ordering::Relaxed)
    }
}

impl Drop for PortForward {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Sandbox {
    /// Listens on `127.0.0.1:local_port` (0 picks a free port) and forwards each connection to
    /// `127.0.0.1:remote_port` inside the sandbox.
    pub async fn forward(&self, remote_port: u16, local_port: u16) -> Result<PortForward> {
        if remote_port == 0 {
            return Err(Error::Invalid("remote port 0".into()));
        }
        let listener =
            TcpListener::bind((Ipv4Addr::LOCALHOST, local_port)).await.map_err(Error::Local)?;
        let local = listener.local_addr().map_err(Error::Local)?;
        let failures = Arc::new(AtomicU64::new(0));
        let sandbox = self.clone();
        let counted = failures.clone();
        let task = tokio::spawn(async move {
            // Owned here, so aborting this task ends every forwarded connection with it.
            let mut conns = JoinSet::new();
            loop {
                tokio::select! {
                    accepted = listener.accept() => {
                        let Ok((socket, _)) = accepted else { continue };
                        let (sandbox, counted) = (sandbox.clone(), counted.clone());
                        conns.spawn(async move {
                            if forward_one(&sandbox, socket, remote_port).await.is_err() {
                                counted.fetch_add(1, Ordering::Relaxed);
                            }
                        });
                    }
                    Some(_) = conns.join_next(), if !conns.is_empty() => {}
                }
            }
        });
        Ok(PortForward { local, failures, task })
    }
}

async fn forward_one(sandbox: &Sandbox, local: TcpStream, port: u16) -> Result<()> {
    local.set_nodelay(true).map_err(Error::Local)?;
    let mut conn = sandbox.dial().await?;
    conn.send(&Frame::PortForward { port }).await?;
    match conn.recv().await? {
        Frame::Ready => {}
        Frame::Error(e) => return Err(e.into()),
        other => return Err(Error::unexpected(&other, "port forward")),
    }
    splice(local, conn).await
}

/// Bytes both ways until silkd's `Done`; a failure on either side drops both connections.
async fn splice(local: TcpStream, conn: RelayConn) -> Result<()> {
    let (mut local_rd, mut local_wr) = local.into_split();
    let RelayConn { mut rd, mut wr } = conn;
    let up = async {
        let mut buf = BytesMut::new();
        loop {
            buf.reserve(READ_CHUNK);
            if local_rd.read_buf(&mut buf).await.map_err(Error::Local)? == 0 {
                wr.send(&Frame::Eof).await?;
                // This direction is closed; the call ends when silkd says `Done` below.
                return std::future::pending::<Result<()>>().await;
            }
            wr.send(&Frame::Data(buf.split().freeze())).await?;
        }
    };
    let down = async {
        loop {
            match recv(&mut rd).await? {
                Frame::Data(b) => local_wr.write_all(&b).await.map_err(Error::Local)?,
                Frame::Eof => local_wr.shutdown().await.map_err(Error::Local)?,
                Frame::Done => return Ok(()),
                Frame::Error(e) => return Err(Error::from(e)),
                other => return Err(Error::unexpected(&other, "port forward")),
            }
        }
    };
    tokio::select! {
        r = up => r,
        r = down => r,
    }
}
