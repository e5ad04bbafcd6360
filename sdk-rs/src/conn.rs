//! Relay connections and the per-sandbox pool of idle ones.
//!
//! A [`RelayConn`] is an upgraded connection to the sandbox's silkd, split into a frame reader
//! and a frame writer so a call can stream input while it reads output. silkd serves calls back
//! to back on one connection, so a connection whose call ended with its terminal frame, and on
//! which nothing else is in flight, goes back to the [`Pool`] and serves a later call without a
//! new TCP connection, HTTP request and upgrade.
//!
//! Pool rules: at most [`MAX_IDLE`] idle connections (fewer if the client asks; 0 dials per
//! call), each kept at most [`IDLE_TTL`]; the most
//! recently used is reused first (it is the least likely to have been closed). Before reuse a
//! connection is checked without blocking: if the node or silkd closed it, it is dropped and the
//! next one (or a new dial) is used, so a stale connection never fails a call. One reaper task
//! per client ([`Reaper`]), running only while connections sit idle, closes the expired ones. A connection whose
//! call did not end cleanly (dropped mid-stream, a framing error) is never returned.

use std::pin::Pin;
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Waker};
use std::time::Duration;

use silk_proto::{Frame, FrameReader, FrameWriter};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
// tokio's clock, so tests can pause and advance it.
use tokio::time::Instant;

use crate::error::{Error, Result};

pub(crate) const MAX_IDLE: usize = 8;
pub(crate) const IDLE_TTL: Duration = Duration::from_secs(30);

/// A connection to the node after the relay's `101`: a bare socket, or TLS over one.
#[derive(Debug)]
pub(crate) enum NodeStream {
    Tcp(TcpStream),
    Tls(Box<tokio_rustls::client::TlsStream<TcpStream>>),
}

/// The two directions of a relay connection. Boxed so that every verb is written once for
/// plain and TLS connections; the indirect call costs nothing next to the read it makes.
pub(crate) type RelayRead = Box<dyn ReadHalf>;
pub(crate) type RelayWrite = Box<dyn WriteHalf>;

pub(crate) trait ReadHalf: AsyncRead + Send + Unpin + std::fmt::Debug {}
impl<T: AsyncRead + Send + Unpin + std::fmt::Debug> ReadHalf for T {}
pub(crate) trait WriteHalf: AsyncWrite + Send + Unpin + std::fmt::Debug {}
impl<T: AsyncWrite + Send + Unpin + std::fmt::Debug> WriteHalf for T {}

impl NodeStream {
    fn split(self) -> (RelayRead, RelayWrite) {
        match self {
            NodeStream::Tcp(tcp) => {
                let (r, w) = tcp.into_split();
                (Box::new(r), Box::new(w))
            }
            NodeStream::Tls(tls) => {
                let (r, w) = tokio::io::split(*tls);
                (Box::new(r), Box::new(w))
            }
        }
    }
}

#[derive(Debug)]
pub(crate) struct RelayConn {
    pub(crate) rd: FrameReader<RelayRead>,
    pub(crate) wr: FrameWriter<RelayWrite>,
}

impl RelayConn {
    pub(crate) fn new(stream: NodeStream) -> RelayConn {
        let (r, w) = stream.split();
        RelayConn { rd: FrameReader::new(r), wr: FrameWriter::new(w) }
    }

    pub(crate) async fn send(&mut self, frame: &Frame) -> Result<()> {
        Ok(self.wr.send(frame).await?)
    }

    /// The next frame; the peer closing the connection mid-call is an error.
    pub(crate) async fn recv(&mut self) -> Result<Frame> {
        recv(&mut self.rd).await
    }

    /// True when the idle connection is still open and silent. Never blocks: one read is
    /// tried and must find nothing to read yet. (Under TLS that read also takes in records the
    /// node may send unasked, such as session tickets, and still finds no data.)
    fn usable(&mut self) -> bool {
        let mut probe = [0u8; 1];
        let mut buf = ReadBuf::new(&mut probe);
        let mut cx = Context::from_waker(Waker::noop());
        // Nothing to read: open and idle, as it should be. End of stream, an error, or bytes
        // nobody asked for: not safe to reuse.
        Pin::new(self.rd.get_mut()).poll_read(&mut cx, &mut buf).is_pending()
    }
}

pub(crate) async fn recv(rd: &mut FrameReader<RelayRead>) -> Result<Frame> {
    rd.recv().await?.ok_or_else(Error::closed)
}

/// Connection counters of one sandbox handle.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ConnStats {
    /// Relay connections dialled (TCP connect + `Upgrade: silkd`).
    pub dialled: u64,
    /// Calls served on a kept connection instead of a new one.
    pub reused: u64,
    /// Connections idle in the pool now.
    pub idle: usize,
}

#[derive(Debug)]
pub(crate) struct Pool {
    state: Mutex<PoolState>,
    /// Idle connections kept at most (0 turns reuse off).
    max_idle: usize,
}

impl Default for Pool {
    fn default() -> Pool {
        Pool::new(MAX_IDLE)
    }
}

#[derive(Debug, Default)]
struct PoolState {
    /// Oldest first.
    idle: Vec<(RelayConn, Instant)>,
    reaper: bool,
    dialled: u64,
    reused: u64,
}

impl PoolState {
    fn expire(&mut self, now: Instant) {
        self.idle.retain(|(_, since)| now.duration_since(*since) < IDLE_TTL);
    }
}

impl Pool {
    pub(crate) fn new(max_idle: usize) -> Pool {
        Pool { state: Mutex::default(), max_idle: max_idle.min(MAX_IDLE) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, PoolState> {
        // A panic while holding this lock cannot leave the pool inconsistent (every update is a
        // single push, pop or retain), so a poisoned lock is still usable.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A usable idle connection, most recent first.
    pub(crate) fn take(&self) -> Option<RelayConn> {
        let mut st = self.lock();
        st.expire(Instant::now());
        while let Some((mut conn, _)) = st.idle.pop() {
            if conn.usable() {
                st.reused += 1;
                return Some(conn);
            }
        }
        None
    }

    pub(crate) fn count_dial(&self) {
        self.lock().dialled += 1;
    }

    /// Keeps `conn` for a later call. Returns true when a reaper should be started.
    pub(crate) fn put(&self, conn: RelayConn) -> bool {
        let mut st = self.lock();
        st.expire(Instant::now());
        if st.idle.len() >= self.max_idle {
            return false;
        }
        st.idle.push((conn, Instant::now()));
        let start = !st.reaper;
        st.reaper = true;
        start
    }

    pub(crate) fn stats(&self) -> ConnStats {
        let st = self.lock();
        ConnStats { dialled: st.dialled, reused: st.reused, idle: st.idle.len() }
    }

    pub(crate) fn clear(&self) {
        self.lock().idle.clear();
    }

    /// One reaper pass: drops expired connections. Returns how long until the next one expires,
    /// or `None` (and marks the reaper stopped) when nothing is idle.
    fn reap(&self) -> Option<Duration> {
        let mut st = self.lock();
        let now = Instant::now();
        st.expire(now);
        match st.idle.first() {
            Some((_, since)) => Some(IDLE_TTL.saturating_sub(now.duration_since(*since))),
            None => {
                st.reaper = false;
                None
            }
        }
    }
}

/// What holds a [`Pool`] (a sandbox handle), as the [`Reaper`] sees it.
pub(crate) trait HasPool: Send + Sync {
    fn pool(&self) -> &Pool;
}

/// One task per client that closes expired idle connections of every pool it watches, running
/// only while some are idle. It holds the pools weakly, so it never keeps a dropped sandbox
/// handle alive. One per client rather than per handle: a spawn rouses another worker, and a
/// claim, whose relay connection goes idle in the new handle's pool, paid that on its path.
#[derive(Clone, Default)]
pub(crate) struct Reaper(Arc<Mutex<Watched>>);

#[derive(Default)]
struct Watched {
    pools: Vec<Weak<dyn HasPool>>,
    running: bool,
}

impl std::fmt::Debug for Reaper {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Reaper")
    }
}

impl Reaper {
    /// Watches `owner`'s pool until nothing in it is idle (`Pool::put` says when to start).
    pub(crate) fn watch(&self, owner: Weak<dyn HasPool>) {
        let mut watched = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if watched.running {
            watched.pools.push(owner);
            return;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        watched.pools.push(owner);
        watched.running = true;
        let shared = self.0.clone();
        rt.spawn(async move {
            loop {
                let wait = {
                    let mut watched = shared.lock().unwrap_or_else(|e| e.into_inner());
                    let mut next: Option<Duration> = None;
                    watched.pools.retain(|owner| {
                        let wait = owner.upgrade().and_then(|o| o.pool().reap());
                        if let Some(wait) = wait {
                            next = Some(next.map_or(wait, |n| n.min(wait)));
                        }
                        wait.is_some()
                    });
                    match next {
                        Some(wait) => wait,
                        None => {
                            watched.running = false;
                            return;
                        }
                    }
                };
                tokio::time::sleep(wait + Duration::from_millis(10)).await;
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn pair() -> (RelayConn, TcpStream) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap()).await.unwrap();
        let (server, _) = listener.accept().await.unwrap();
        (RelayConn::new(NodeStream::Tcp(client)), server)
    }

    #[tokio::test]
    async fn closed_or_chatty_connections_are_never_reused() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let pool = Pool::default();
        let (open, mut keep) = pair().await;
        let (closed, peer) = pair().await;
        let (chatty, mut talker) = pair().await;
        drop(peer);
        talker.write_all(b"x").await.unwrap();
        // Let the runtime's I/O driver see the close and the byte, as it would between calls.
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(pool.put(open));
        assert!(!pool.put(closed), "the reaper is started once");
        pool.put(chatty);
        assert_eq!(pool.stats().idle, 3);
        // Most recent first: the chatty and the closed ones are skipped, the open one is used.
        let got = pool.take().expect("the open connection");
        let mut got = got;
        let raw = got.wr.get_mut();
        raw.write_all(b"!").await.unwrap();
        let mut byte = [0u8; 1];
        keep.read_exact(&mut byte).await.unwrap();
        assert_eq!(&byte, b"!", "the connection taken is the open one");
        assert!(pool.take().is_none());
        assert_eq!(pool.stats(), ConnStats { dialled: 0, reused: 1, idle: 0 });
    }

    #[tokio::test]
    async fn the_pool_keeps_at_most_eight() {
        let pool = Pool::default();
        let mut peers = vec![];
        for _ in 0..MAX_IDLE + 2 {
            let (c, p) = pair().await;
            peers.push(p);
            pool.put(c);
        }
        assert_eq!(pool.stats().idle, MAX_IDLE);
        let off = Pool::new(0);
        let (c, _peer) = pair().await;
        assert!(!off.put(c));
        assert_eq!(off.stats().idle, 0);
    }

    struct Holder(Pool);

    impl HasPool for Holder {
        fn pool(&self) -> &Pool {
            &self.0
        }
    }

    #[tokio::test(start_paused = true)]
    async fn one_reaper_closes_every_pools_expired_connections_then_stops() {
        let reaper = Reaper::default();
        let (a, b) = (Arc::new(Holder(Pool::default())), Arc::new(Holder(Pool::default())));
        let mut peers = vec![];
        for owner in [&a, &b] {
            let (c, peer) = pair().await;
            peers.push(peer);
            assert!(owner.0.put(c), "the first idle connection asks to be watched");
            reaper.watch(Arc::downgrade(owner) as Weak<dyn HasPool>);
        }
        // A dropped handle's pool is simply forgotten.
        let (dropped, (c, _peer)) = (Arc::new(Holder(Pool::default())), pair().await);
        dropped.0.put(c);
        reaper.watch(Arc::downgrade(&dropped) as Weak<dyn HasPool>);
        drop(dropped);
        assert!(reaper.0.lock().unwrap().running);
        tokio::time::sleep(IDLE_TTL / 2).await;
        assert_eq!((a.0.stats().idle, b.0.stats().idle), (1, 1), "not expired yet");
        tokio::time::sleep(IDLE_TTL).await;
        assert_eq!((a.0.stats().idle, b.0.stats().idle), (0, 0), "both closed by the one task");
        {
            let watched = reaper.0.lock().unwrap();
            assert!(!watched.running && watched.pools.is_empty(), "stopped once nothing is idle");
        }
        // The next idle connection starts it again.
        let (c, _peer) = pair().await;
        assert!(a.0.put(c));
        reaper.watch(Arc::downgrade(&a) as Weak<dyn HasPool>);
        tokio::time::sleep(IDLE_TTL + Duration::from_secs(1)).await;
        assert_eq!(a.0.stats().idle, 0);
    }

    #[tokio::test(start_paused = true)]
    async fn idle_connections_expire() {
        let pool = Pool::default();
        let (c, _peer) = pair().await;
        pool.put(c);
        assert_eq!(pool.reap(), Some(IDLE_TTL));
        tokio::time::advance(IDLE_TTL).await;
        assert_eq!(pool.reap(), None, "expired and the reaper stops");
        assert!(pool.take().is_none());
    }
}
