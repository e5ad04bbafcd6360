//! The bulk lane: node-to-node calls that carry bulk bytes (a moved sandbox's files) over TLS
//! on kernel TCP, beside the QUIC endpoint at the same address and port number.
//!
//! Why a second transport: QUIC does its per-packet work in user space (each ~1.4 KB packet's
//! frames, acknowledgements, header protection and AEAD, one at a time). Here 100 MiB over one
//! QUIC stream cost ~430 ms of CPU for both ends together, where TLS on kernel TCP (64 KiB
//! segments, 16 KiB records) cost ~140 ms (docs/benchmarks.md, session of 2026-12-07 06:29).
//! A move is CPU-bound on its node's cores, so that difference is most of what a move costs
//! beyond its floor. Small calls stay on QUIC, where they share one warm connection.
//!
//! A bulk call is a mesh call like any other (the same [`Incoming`], the same requests), and
//! its handshake makes the same checks as QUIC's ([`crate::tls::configs`]: the CA, validity,
//! the revocation list; the dialler checks that the certificate names the node it dials), under
//! its own ALPN. A connection carries one call. How it ends says whether the sender finished:
//! TLS's `close_notify` is a clean end, and an end without one ([`Abort`]) reads as an error on
//! the other side, as a reset QUIC stream does. A connection on which no byte has moved
//! either way for [`IDLE`] fails ([`Idle`]): a peer that died, froze or was cut off mid-call is
//! noticed as QUIC's idle timeout notices it.

use std::net::SocketAddr;
use std::os::fd::AsFd;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use rustls::pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio::time::{Instant, Sleep};

use crate::MeshError;
use crate::driver::{Incoming, Lane, Throttled};

/// ALPN of the bulk lane.
pub const ALPN: &[u8] = b"silkmesh-bulk/1";

/// How long a dial may take to connect, and a handshake (either side) to finish.
const CONNECT_WITHIN: Duration = Duration::from_secs(2);
const HANDSHAKE_WITHIN: Duration = Duration::from_secs(10);

/// Handshakes under way at once; connections over it are closed unanswered.
const MAX_HANDSHAKES: usize = 64;

/// How long a bulk connection may move no byte either way before it fails. Longer than
/// QUIC's idle timeout (10 s), whose keep-alives flow while the application is silent: here
/// the bytes are the only sign of life, and a target busy writing what came may not read for
/// a few seconds.
pub const IDLE: Duration = Duration::from_secs(20);

/// The dialler's end of a bulk call.
pub type BulkStream = tokio_rustls::client::TlsStream<Idle<TcpStream>>;

/// A stream that fails a read or write once no byte has moved either way for `limit`. Each
/// direction waits on its own timer (the halves of a split stream are polled by different
/// tasks); a byte moving only stamps the time, and a timer is set again from the stamp at the
/// next poll that finds nothing to do.
#[derive(Debug)]
pub struct Idle<S> {
    inner: S,
    limit: Duration,
    moved: Instant,
    /// Reading's, writing's.
    timers: [Pin<Box<Sleep>>; 2],
}

impl<S> Idle<S> {
    pub fn new(inner: S, limit: Duration) -> Idle<S> {
        let moved = Instant::now();
        let timer = || Box::pin(tokio::time::sleep_until(moved + limit));
        Idle { inner, limit, moved, timers: [timer(), timer()] }
    }

    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// For a poll in `direction` that found nothing to do: an error once `limit` has passed
    /// since a byte last moved, else pending until then.
    fn idle(&mut self, direction: usize, cx: &mut Context<'_>) -> Poll<std::io::Error> {
        let deadline = self.moved + self.limit;
        let timer = &mut self.timers[direction];
        if timer.deadline() != deadline {
            timer.as_mut().reset(deadline);
        }
        ready!(timer.as_mut().poll(cx));
        let idle = format!("no byte moved either way for {:?}", self.limit);
        Poll::Ready(std::io::Error::new(std::io::ErrorKind::TimedOut, idle))
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Idle<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        match Pin::new(&mut self.inner).poll_read(cx, buf) {
            Poll::Ready(done) => {
                self.moved = Instant::now();
                Poll::Ready(done)
            }
            Poll::Pending => self.idle(0, cx).map(Err),
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Idle<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        match Pin::new(&mut self.inner).poll_write(cx, buf) {
            Poll::Ready(done) => {
                self.moved = Instant::now();
                Poll::Ready(done)
            }
            Poll::Pending => self.idle(1, cx).map(Err),
        }
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Ends what a bulk call sends without TLS's `close_notify`: the peer's next read after the
/// bytes already sent fails, so it knows the sender did not finish (the bulk lane's reset).
/// Taken before the stream is split, it works beside both halves.
#[derive(Debug)]
pub struct Abort(std::net::TcpStream);

impl Abort {
    pub fn of(stream: &BulkStream) -> std::io::Result<Abort> {
        let fd = stream.get_ref().0.get_ref().as_fd().try_clone_to_owned()?;
        Ok(Abort(std::net::TcpStream::from(fd)))
    }

    pub fn abort(&self) {
        let _ = self.0.shutdown(std::net::Shutdown::Write);
    }
}

/// Dials node `name`'s bulk lane at `addr`: connected, handshaken, the peer checked to be
/// `name`.
pub(crate) async fn dial(
    addr: SocketAddr,
    name: &str,
    config: Arc<rustls::ClientConfig>,
) -> Result<BulkStream, MeshError> {
    let io = |e: std::io::Error| MeshError::Io(format!("bulk lane to {name} at {addr}: {e}"));
    let server_name = ServerName::try_from(name.to_string())
        .map_err(|e| MeshError::Tls(format!("node name {name:?}: {e}")))?;
    let tcp = tokio::time::timeout(CONNECT_WITHIN, TcpStream::connect(addr))
        .await
        .map_err(|_| io(std::io::ErrorKind::TimedOut.into()))?
        .map_err(io)?;
    // The call's request and answer are small writes each waiting on the other.
    tcp.set_nodelay(true).map_err(io)?;
    let connector = tokio_rustls::TlsConnector::from(config);
    let tcp = Idle::new(tcp, IDLE);
    let stream = tokio::time::timeout(HANDSHAKE_WITHIN, connector.connect(server_name, tcp))
        .await
        .map_err(|_| io(std::io::ErrorKind::TimedOut.into()))?
        .map_err(|e| MeshError::Tls(format!("bulk lane to {name} at {addr}: {e}")))?;
    if stream.get_ref().1.alpn_protocol() != Some(ALPN) {
        return Err(MeshError::Tls(format!("{addr} does not speak the bulk lane")));
    }
    Ok(stream)
}

/// Accepts bulk-lane connections until `lane` has no node left to serve (it is dropped) or
/// the task is aborted (the node left): each handshake on a task of its own, at most
/// [`MAX_HANDSHAKES`] at once, its call sent to the node's queue.
pub(crate) async fn serve(
    listener: std::net::TcpListener,
    lane: impl Fn() -> Option<(Arc<rustls::ServerConfig>, mpsc::Sender<Incoming>)>,
) {
    let listener = match tokio::net::TcpListener::from_std(listener) {
        Ok(l) => l,
        Err(e) => return tracing::warn!("bulk lane: {e}"),
    };
    let handshakes = Arc::new(tokio::sync::Semaphore::new(MAX_HANDSHAKES));
    let rejected = Throttled::default();
    loop {
        let (tcp, remote) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                // Out of descriptors, most likely: give what holds them a moment.
                rejected.log(format_args!("bulk lane: accept: {e}"));
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Some((config, incoming)) = lane() else { return };
        let Ok(slot) = handshakes.clone().try_acquire_owned() else {
            rejected.log(format_args!("bulk lane: {remote} refused: too many handshakes"));
            continue;
        };
        let log = rejected.clone();
        tokio::spawn(async move {
            let call = accept(tcp, remote, config).await;
            drop(slot);
            match call {
                Ok(call) => drop(incoming.send(call).await),
                Err(e) => log.log(format_args!("mesh connection rejected: {e}")),
            }
        });
    }
}

/// The server's side of a bulk connection's handshake: the call it carries.
async fn accept(
    tcp: TcpStream,
    remote: SocketAddr,
    config: Arc<rustls::ServerConfig>,
) -> Result<Incoming, MeshError> {
    let tls = |e: std::io::Error| MeshError::Tls(format!("bulk lane from {remote}: {e}"));
    tcp.set_nodelay(true).map_err(tls)?;
    let acceptor = tokio_rustls::TlsAcceptor::from(config);
    let stream = tokio::time::timeout(HANDSHAKE_WITHIN, acceptor.accept(Idle::new(tcp, IDLE)))
        .await
        .map_err(|_| tls(std::io::ErrorKind::TimedOut.into()))?
        .map_err(tls)?;
    // A client that offered no ALPN gets through rustls without one.
    if stream.get_ref().1.alpn_protocol() != Some(ALPN) {
        return Err(MeshError::Tls(format!("bulk lane from {remote}: not the bulk ALPN")));
    }
    let (recv, send) = tokio::io::split(stream);
    Ok(Incoming { remote, lane: Lane::Bulk, send: Box::pin(send), recv: Box::pin(recv) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Mesh, MeshConfig, NodeState, TlsFiles, tls};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    const LIMIT: Duration = Duration::from_secs(20);

    /// Whether `task` has ended after the clock moves on by `by`.
    async fn ended_after<T>(task: &tokio::task::JoinHandle<T>, by: Duration) -> bool {
        tokio::time::sleep(by).await;
        tokio::task::yield_now().await;
        task.is_finished()
    }

    /// A peer that sends nothing and reads nothing (dead, frozen, cut off): a read waiting on
    /// it fails after the limit, and so does a write it does not take.
    #[tokio::test(start_paused = true)]
    async fn a_call_on_which_nothing_moves_fails_after_the_limit() {
        let (near, _far) = tokio::io::duplex(1024);
        let mut near = Idle::new(near, LIMIT);
        let read = tokio::spawn(async move { near.read(&mut [0; 16]).await });
        assert!(!ended_after(&read, LIMIT - Duration::from_secs(1)).await);
        assert!(ended_after(&read, Duration::from_secs(2)).await);
        let e = read.await.unwrap().unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::TimedOut, "{e}");

        let (near, _far) = tokio::io::duplex(1024);
        let mut near = Idle::new(near, LIMIT);
        let write = tokio::spawn(async move { near.write_all(&[7; 4096]).await });
        assert!(!ended_after(&write, LIMIT - Duration::from_secs(1)).await);
        assert!(ended_after(&write, Duration::from_secs(2)).await);
        assert_eq!(write.await.unwrap().unwrap_err().kind(), std::io::ErrorKind::TimedOut);
    }

    /// A sender's read of the answer waits as long as its writes move, however long that is;
    /// once they stop it fails after the limit.
    #[tokio::test(start_paused = true)]
    async fn bytes_moving_either_way_keep_a_waiting_read_alive() {
        let (near, mut far) = tokio::io::duplex(1024);
        let (mut recv, mut send) = tokio::io::split(Idle::new(near, LIMIT));
        let read = tokio::spawn(async move { recv.read(&mut [0; 16]).await });
        for _ in 0..10 {
            send.write_all(&[7; 100]).await.unwrap();
            far.read_exact(&mut [0; 100]).await.unwrap();
            assert!(!ended_after(&read, LIMIT / 2).await, "a read failed while writes moved");
        }
        assert!(ended_after(&read, LIMIT).await);
        assert_eq!(read.await.unwrap().unwrap_err().kind(), std::io::ErrorKind::TimedOut);
    }

    /// A member of the cluster listening where a node dials `b`: its certificate says `evil`,
    /// so the dial fails before a byte of the call is sent.
    #[tokio::test]
    async fn a_dial_refuses_a_member_that_is_not_the_node_dialled() {
        let dir = tempfile::tempdir().unwrap();
        tls::init_ca(dir.path()).unwrap();
        let files: Vec<TlsFiles> = ["a", "b", "evil"]
            .iter()
            .map(|n| {
                let (cert, key) = tls::issue(dir.path(), n, tls::DEFAULT_DAYS).unwrap();
                TlsFiles { ca: dir.path().join("ca.pem"), cert, key }
            })
            .collect();
        let start = |f: &TlsFiles, name: &str| {
            let cfg = MeshConfig::new(name, "127.0.0.1:0".parse().unwrap(), f.clone());
            Mesh::start(cfg, NodeState::default())
        };
        let (b, _calls_b) = start(&files[1], "b").await.unwrap();
        let (evil, _calls_evil) = start(&files[2], "evil").await.unwrap();
        let list = crate::trust::RevocationList::open(None).unwrap();
        let client = tls::configs(&files[0], &list).unwrap().bulk_client;
        dial(b.id().addr, "b", client.clone()).await.expect("the real b");
        let Err(e) = dial(evil.id().addr, "b", client).await else {
            panic!("a dial for b accepted evil's certificate");
        };
        assert!(matches!(e, MeshError::Tls(_)), "{e}");
    }
}
