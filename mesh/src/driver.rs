//! The mesh at run time: one quinn endpoint (one UDP socket, both dialing and accepting) and one
//! task that owns the membership core. Membership packets travel as QUIC datagrams; node state
//! goes to a peer on a unidirectional stream when the core says so (on change, and to a peer
//! that heard nothing for `state_refresh`: see `core`); node-to-node calls are bidirectional
//! streams handed to the caller as [`Incoming`]. Beside the endpoint, a TCP listener at the same
//! address and port number serves the bulk lane ([`crate::bulk`]): calls that carry bulk bytes.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use foca::Timer;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::{mpsc, oneshot};

use crate::MeshError;
use crate::core::{
    Membership, NodeId, NodeState, Output, Peer, StateChange, StateMessage, TICK, swim_config,
};
use crate::tls::{SERVER_NAME, TlsFiles, names_node, peer_chain};
use crate::wire::{read_frame, write_frame};

/// A node's mesh settings.
#[derive(Debug, Clone)]
pub struct MeshConfig {
    pub name: String,
    /// The QUIC (UDP) address; the bulk lane takes the same TCP port (port 0: any port free
    /// for both).
    pub listen: SocketAddr,
    /// Seeds to join through (any live member will do).
    pub join: Vec<SocketAddr>,
    pub tls: TlsFiles,
    /// This start's number (the node persists and increments it).
    pub epoch: u64,
    pub probe_period: Duration,
    pub probe_rtt: Duration,
    pub suspect_to_down: Duration,
    /// Our state is sent again to a peer that heard nothing from us for this long (a change
    /// goes to every peer at once).
    pub state_refresh: Duration,
    /// The revocation list (`trust`), re-read when it changes; none: nothing is revoked.
    pub revoked: Option<std::path::PathBuf>,
    /// Serve and dial the bulk lane ([`crate::bulk`]); off where only UDP passes between
    /// nodes (bulk calls then go on QUIC).
    pub bulk_lane: bool,
}

impl MeshConfig {
    /// Loopback-friendly defaults: a killed node is declared down in about 2-3 s.
    pub fn new(name: impl Into<String>, listen: SocketAddr, tls: TlsFiles) -> MeshConfig {
        MeshConfig {
            name: name.into(),
            listen,
            join: vec![],
            tls,
            epoch: 1,
            probe_period: Duration::from_millis(500),
            probe_rtt: Duration::from_millis(150),
            suspect_to_down: Duration::from_millis(1500),
            state_refresh: STATE_REFRESH,
            revoked: None,
            bulk_lane: true,
        }
    }
}

/// See [`MeshConfig::state_refresh`].
pub const STATE_REFRESH: Duration = Duration::from_secs(30);

/// A node-to-node call opened by a peer: read its request from `recv`, answer on `send`, end
/// it with `send`'s shutdown.
pub struct Incoming {
    pub remote: SocketAddr,
    pub lane: Lane,
    pub send: Pin<Box<dyn AsyncWrite + Send>>,
    pub recv: Pin<Box<dyn AsyncRead + Send>>,
}

impl std::fmt::Debug for Incoming {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Incoming").field("remote", &self.remote).field("lane", &self.lane).finish()
    }
}

/// The transport a call came on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lane {
    /// A stream of the QUIC connection between the two nodes.
    Quic,
    /// A TLS connection of its own ([`crate::bulk`]).
    Bulk,
}

enum Cmd {
    Packet(Bytes),
    Timer(Timer<NodeId>),
    State(StateMessage),
    /// This node's own probe of a peer declared down: alive or not.
    Verified(NodeId, bool),
    Local(Box<dyn FnOnce(&mut NodeState) + Send>),
    Leave(oneshot::Sender<()>),
}

/// A connection to a peer's address, and the node name its certificate was checked to carry
/// (none yet for one accepted, or dialled as a seed).
#[derive(Debug)]
struct Conn {
    conn: quinn::Connection,
    named: Option<String>,
    /// This node dialled it (else accepted it).
    dialled: bool,
}

/// How long a duplicate connection stays open after it lost the tie-break: calls already under
/// way on it finish; new ones go to the connection kept.
const RETIRE_AFTER: Duration = Duration::from_secs(10);

/// See the module docs. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Mesh {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    me: NodeId,
    endpoint: quinn::Endpoint,
    cmds: mpsc::UnboundedSender<Cmd>,
    incoming: mpsc::Sender<Incoming>,
    /// The live members as of the last change (read by the API without touching the core).
    view: Mutex<(NodeState, Arc<Vec<Peer>>)>,
    conns: Mutex<HashMap<SocketAddr, Conn>>,
    /// One dial at a time per address: callers that find no connection wait for the first
    /// one's instead of each dialling their own.
    dials: Mutex<HashMap<SocketAddr, Arc<tokio::sync::Mutex<()>>>>,
    /// Connections open now, duplicates waiting to close included.
    open_connections: AtomicU64,
    /// How this node dials (replaced when its certificate or the revocation list changes).
    client: Mutex<quinn::ClientConfig>,
    /// The bulk lane's TLS configs, replaced with `client`'s.
    bulk: Mutex<(Arc<rustls::ServerConfig>, Arc<rustls::ClientConfig>)>,
    /// The bulk lane's accept loop, stopped when the node leaves.
    bulk_accept: Mutex<Option<tokio::task::AbortHandle>>,
    bulk_lane: bool,
    /// How long a peer declared down has to answer this node's own probe.
    verify_within: Duration,
    /// Membership and state bytes sent (datagrams and state streams' payloads).
    gossip_bytes: AtomicU64,
}

impl Mesh {
    /// Binds the endpoint, starts the membership task and joins through the seeds. Peers'
    /// calls arrive on the returned channel.
    pub async fn start(
        cfg: MeshConfig,
        local: NodeState,
    ) -> Result<(Mesh, mpsc::Receiver<Incoming>), MeshError> {
        let revoked =
            crate::trust::RevocationList::open(cfg.revoked.as_deref()).map_err(MeshError::Tls)?;
        let configs = crate::tls::configs(&cfg.tls, &revoked)?;
        let (endpoint, listener) = bind(cfg.listen, &configs.quic_server, cfg.bulk_lane)?;
        let addr = endpoint.local_addr().map_err(|e| MeshError::Io(e.to_string()))?;
        let me = NodeId { name: cfg.name.clone(), addr, epoch: cfg.epoch, renewal: 0 };
        let local = NodeState { name: cfg.name.clone(), epoch: cfg.epoch, seq: 1, ..local };
        let swim = swim_config(cfg.probe_period, cfg.probe_rtt, cfg.suspect_to_down);
        let seed = u64::from_le_bytes(*b"silkmesh") ^ cfg.epoch ^ u64::from(addr.port());
        let core = Membership::new(me.clone(), swim, seed, local.clone(), cfg.state_refresh);
        let (cmds, rx) = mpsc::unbounded_channel();
        let (incoming, incoming_rx) = mpsc::channel(256);
        let inner = Arc::new(Inner {
            me,
            endpoint,
            cmds,
            incoming,
            view: Mutex::new((local, Arc::new(vec![]))),
            conns: Mutex::new(HashMap::new()),
            dials: Mutex::new(HashMap::new()),
            open_connections: AtomicU64::new(0),
            client: Mutex::new(configs.quic_client),
            bulk: Mutex::new((configs.bulk_server, configs.bulk_client)),
            bulk_accept: Mutex::new(None),
            bulk_lane: cfg.bulk_lane,
            verify_within: (cfg.probe_rtt * 4).max(Duration::from_secs(1)),
            gossip_bytes: AtomicU64::new(0),
        });
        tokio::spawn(accept_loop(inner.clone()));
        if let Some(listener) = listener {
            let weak = Arc::downgrade(&inner);
            // The node's current config and its calls' queue, until it is gone.
            let lane = move || {
                let inner = weak.upgrade()?;
                Some((lock(&inner.bulk).0.clone(), inner.incoming.clone()))
            };
            let bulk = tokio::spawn(crate::bulk::serve(listener, lane));
            *lock(&inner.bulk_accept) = Some(bulk.abort_handle());
        }
        tokio::spawn(watch_trust(Arc::downgrade(&inner), cfg.tls.clone(), revoked));
        tokio::spawn(membership_task(inner.clone(), core, rx, cfg.join));
        Ok((Mesh { inner }, incoming_rx))
    }

    pub fn id(&self) -> &NodeId {
        &self.inner.me
    }

    /// This node's state as last published.
    pub fn local(&self) -> NodeState {
        lock(&self.inner.view).0.clone()
    }

    /// Changes this node's state; peers hear of it at once.
    pub fn update(&self, f: impl FnOnce(&mut NodeState) + Send + 'static) {
        let _ = self.inner.cmds.send(Cmd::Local(Box::new(f)));
    }

    /// Live peers (never this node), with their last state: a shared snapshot, cheap to take
    /// on every request.
    pub fn peers(&self) -> Arc<Vec<Peer>> {
        lock(&self.inner.view).1.clone()
    }

    pub fn peer(&self, name: &str) -> Option<Peer> {
        self.peers().iter().find(|p| p.id.name == name).cloned()
    }

    /// Membership and state bytes this node has sent.
    pub fn gossip_bytes(&self) -> u64 {
        self.inner.gossip_bytes.load(Ordering::Relaxed)
    }

    /// QUIC connections open to peers: one per peer once dials have settled.
    pub fn open_connections(&self) -> u64 {
        self.inner.open_connections.load(Ordering::Relaxed)
    }

    /// Opens a call to a live peer.
    pub async fn open(
        &self,
        name: &str,
    ) -> Result<(quinn::SendStream, quinn::RecvStream), MeshError> {
        let peer = self.peer(name).ok_or_else(|| MeshError::NoPeer(name.to_string()))?;
        let conn = connection(&self.inner, &peer.id).await?;
        conn.open_bi().await.map_err(|e| MeshError::Io(format!("open a stream to {name}: {e}")))
    }

    /// Whether this node serves and dials the bulk lane ([`MeshConfig::bulk_lane`]).
    pub fn bulk_lane(&self) -> bool {
        self.inner.bulk_lane
    }

    /// Opens a call to a live peer on the bulk lane (a TLS connection of its own, for a call
    /// that carries bulk bytes): end what it sends with `shutdown`, or [`crate::bulk::Abort`].
    pub async fn open_bulk(&self, name: &str) -> Result<crate::bulk::BulkStream, MeshError> {
        if !self.inner.bulk_lane {
            return Err(MeshError::Io("this node's bulk lane is off".into()));
        }
        let peer = self.peer(name).ok_or_else(|| MeshError::NoPeer(name.to_string()))?;
        let config = lock(&self.inner.bulk).1.clone();
        crate::bulk::dial(peer.id.addr, &peer.id.name, config).await
    }

    /// Says goodbye (peers drop this node at once) and closes the endpoint.
    pub async fn leave(&self) {
        let (tx, rx) = oneshot::channel();
        if self.inner.cmds.send(Cmd::Leave(tx)).is_ok() {
            let _ = tokio::time::timeout(Duration::from_secs(1), rx).await;
        }
        self.inner.endpoint.close(0u32.into(), b"leaving");
        if let Some(bulk) = lock(&self.inner.bulk_accept).take() {
            bulk.abort();
        }
        let _ = tokio::time::timeout(Duration::from_secs(1), self.inner.endpoint.wait_idle()).await;
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The connection to node `to`, dialled on first use. Its certificate must name `to` (a seed
/// known only by its address, with no name yet, may be any node of the cluster).
async fn connection(inner: &Arc<Inner>, to: &NodeId) -> Result<quinn::Connection, MeshError> {
    let addr = to.addr;
    let named = (!to.name.is_empty()).then_some(to.name.as_str());
    if let Some(c) = live(inner, addr, named)? {
        return Ok(c);
    }
    let gate = lock(&inner.dials).entry(addr).or_default().clone();
    let _dialling = gate.lock().await;
    if let Some(c) = live(inner, addr, named)? {
        return Ok(c); // dialled (or accepted) while this call waited
    }
    let connecting = inner
        .endpoint
        .connect_with(lock(&inner.client).clone(), addr, named.unwrap_or(SERVER_NAME))
        .map_err(|e| MeshError::Io(format!("connect {addr}: {e}")))?;
    let conn = connecting.await.map_err(|e| MeshError::Io(format!("connect {addr}: {e}")))?;
    let named = named.map(str::to_string); // the handshake checked it
    tokio::spawn(serve(inner.clone(), conn.clone()));
    Ok(keep(inner, addr, Conn { conn, named, dialled: true }))
}

/// The open connection to `addr`, if there is one; `named`: the node it must be.
fn live(
    inner: &Inner,
    addr: SocketAddr,
    named: Option<&str>,
) -> Result<Option<quinn::Connection>, MeshError> {
    let mut conns = lock(&inner.conns);
    let Some(c) = conns.get_mut(&addr).filter(|c| c.conn.close_reason().is_none()) else {
        return Ok(None);
    };
    if let Some(n) = named
        && c.named.as_deref() != Some(n)
    {
        // Accepted from whoever is at that address, or dialled as a seed: check who.
        if !names_node(&peer_chain(&c.conn), n) {
            return Err(MeshError::Tls(format!("the node at {addr} is not {n}")));
        }
        c.named = Some(n.to_string());
    }
    Ok(Some(c.conn.clone()))
}

/// Files a new connection to `remote` and returns the one to use. Two nodes that dial each
/// other at once each hold both connections: both keep the one the node with the lower address
/// dialled, and the other closes after [`RETIRE_AFTER`]. Any other open connection it replaces
/// (a peer that started again at the same address) closes the same way.
fn keep(inner: &Inner, remote: SocketAddr, new: Conn) -> quinn::Connection {
    let preferred = |c: &Conn| c.dialled == (inner.me.addr < remote);
    let mut conns = lock(&inner.conns);
    let (kept, retired) = match conns.remove(&remote) {
        Some(old) if old.conn.close_reason().is_none() && preferred(&old) && !preferred(&new) => {
            (old, Some(new.conn))
        }
        Some(old) if old.conn.close_reason().is_none() => (new, Some(old.conn)),
        _ => (new, None),
    };
    let conn = kept.conn.clone();
    conns.insert(remote, kept);
    if let Some(duplicate) = retired.filter(|d| d.stable_id() != conn.stable_id()) {
        tokio::spawn(async move {
            tokio::time::sleep(RETIRE_AFTER).await;
            duplicate.close(0u32.into(), b"duplicate");
        });
    }
    conn
}

/// This node's own look at a peer the failure detector declared down: our state sent on a
/// stream of its own and acknowledged by the peer within [`Inner::verify_within`].
async fn probe(inner: &Arc<Inner>, id: &NodeId) -> bool {
    // It closed our connection itself (it left, or stopped): no need to wait for a dial.
    let closed = lock(&inner.conns).get(&id.addr).is_some_and(|c| {
        matches!(c.conn.close_reason(), Some(quinn::ConnectionError::ApplicationClosed(_)))
    });
    if closed {
        return false;
    }
    let attempt = async {
        let conn = connection(inner, id).await.ok()?;
        let mut send = conn.open_uni().await.ok()?;
        // Our version: a state message it reads whole, as it reads every state stream.
        let state = lock(&inner.view).0.clone();
        let version = StateMessage::Change(StateChange::between(&state, &state));
        write_frame(&mut send, &version).await.ok()?;
        send.finish().ok()?;
        send.stopped().await.ok()?;
        Some(())
    };
    matches!(tokio::time::timeout(inner.verify_within, attempt).await, Ok(Some(())))
}

async fn accept_loop(inner: Arc<Inner>) {
    let rejected = Throttled::default();
    while let Some(incoming) = inner.endpoint.accept().await {
        // A handshake costs a signature check: an address must prove it receives our packets
        // first (a stateless retry), so a spoofed flood costs us one small packet each.
        if !incoming.remote_address_validated() {
            if let Err(e) = incoming.retry() {
                rejected.log(format_args!("retry: {e:?}"));
            }
            continue;
        }
        let inner = inner.clone();
        let log = rejected.clone();
        tokio::spawn(async move {
            let remote = incoming.remote_address();
            match incoming.await {
                Ok(conn) => {
                    // One socket per node: the remote address is the peer's endpoint, so this
                    // connection also serves our calls to it.
                    keep(&inner, remote, Conn { conn: conn.clone(), named: None, dialled: false });
                    serve(inner, conn).await;
                }
                Err(e) => log.log(format_args!("mesh connection from {remote} rejected: {e}")),
            }
        });
    }
}

/// Binds the QUIC endpoint at `listen` and (with `bulk`) the bulk lane's TCP listener at the
/// same address and port number. For port 0 that is a port free for both: TCP's is taken
/// first, and a UDP port already in use is tried again with another.
fn bind(
    listen: SocketAddr,
    server: &quinn::ServerConfig,
    bulk: bool,
) -> Result<(quinn::Endpoint, Option<std::net::TcpListener>), MeshError> {
    if !bulk {
        let endpoint = quinn::Endpoint::server(server.clone(), listen)
            .map_err(|e| MeshError::Io(format!("bind {listen}: {e}")))?;
        return Ok((endpoint, None));
    }
    let mut tries = if listen.port() == 0 { 16 } else { 1 };
    loop {
        let tcp = std::net::TcpListener::bind(listen)
            .map_err(|e| MeshError::Io(format!("bind {listen} (TCP, the bulk lane): {e}")))?;
        let at = tcp.local_addr().map_err(|e| MeshError::Io(e.to_string()))?;
        match quinn::Endpoint::server(server.clone(), at) {
            Ok(endpoint) => {
                tcp.set_nonblocking(true).map_err(|e| MeshError::Io(e.to_string()))?;
                return Ok((endpoint, Some(tcp)));
            }
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse && tries > 1 => tries -= 1,
            Err(e) => return Err(MeshError::Io(format!("bind {at} (UDP): {e}"))),
        }
    }
}

/// Rejection logs at most once per 10 s, with how many were left out: a node refused over and
/// over (a revoked one, a stranger) must not flood the log.
#[derive(Debug, Clone, Default)]
pub(crate) struct Throttled(Arc<Mutex<(Option<std::time::Instant>, u64)>>);

impl Throttled {
    pub(crate) fn log(&self, what: std::fmt::Arguments<'_>) {
        let mut s = lock(&self.0);
        let now = std::time::Instant::now();
        if s.0.is_some_and(|at| now.duration_since(at) < Duration::from_secs(10)) {
            s.1 += 1;
            return;
        }
        let skipped = std::mem::take(&mut s.1);
        s.0 = Some(now);
        tracing::warn!(skipped, "{what}");
    }
}

/// Every second: re-reads the revocation list, closing the connections of nodes it now names,
/// and this node's certificate, taking a renewed one into use for new handshakes.
async fn watch_trust(
    inner: std::sync::Weak<Inner>,
    files: crate::TlsFiles,
    revoked: crate::trust::RevocationList,
) {
    let stamp = |f: &crate::TlsFiles| {
        [&f.cert, &f.key, &f.ca].map(|p| std::fs::metadata(p).and_then(|m| m.modified()).ok())
    };
    let mut certs = stamp(&files);
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let Some(inner) = inner.upgrade() else { return };
        let list_changed = match revoked.reload() {
            Ok(changed) => changed,
            Err(e) => {
                tracing::warn!("revocation list: {e}; keeping the last one read");
                false
            }
        };
        let now = stamp(&files);
        if list_changed || now != certs {
            match crate::tls::configs(&files, &revoked) {
                Ok(c) => {
                    inner.endpoint.set_server_config(Some(c.quic_server));
                    *lock(&inner.client) = c.quic_client;
                    *lock(&inner.bulk) = (c.bulk_server, c.bulk_client);
                    if now != certs {
                        tracing::info!("mesh certificate reloaded");
                    }
                    certs = now;
                }
                Err(e) => tracing::warn!("mesh certificate: {e}; keeping the one in use"),
            }
        }
        if list_changed {
            for c in lock(&inner.conns).values() {
                if revoked.covers(&crate::tls::peer_chain(&c.conn)) {
                    c.conn.close(1u32.into(), b"revoked");
                }
            }
        }
    }
}

/// Reads what a peer sends on one connection: membership datagrams, state streams, calls. A
/// packet or a state is taken only from the node the connection's certificate names.
async fn serve(inner: Arc<Inner>, conn: quinn::Connection) {
    inner.open_connections.fetch_add(1, Ordering::Relaxed);
    let chain = Arc::new(peer_chain(&conn));
    let remote = conn.remote_address();
    let impostor = move |claimed: &str| {
        tracing::warn!(%remote, claimed, "dropped: the peer's certificate is for another node");
    };
    let datagrams = {
        let (inner, conn, chain) = (inner.clone(), conn.clone(), chain.clone());
        async move {
            // The name this connection proved, and the last one it failed to (logged once).
            let (mut verified, mut refused) = (String::new(), String::new());
            while let Ok(d) = conn.read_datagram().await {
                let Some(src) = Membership::sender(&d) else { continue };
                if src.name != verified {
                    if !names_node(&chain, &src.name) {
                        if src.name != refused {
                            impostor(&src.name);
                            refused = src.name;
                        }
                        continue;
                    }
                    verified = src.name;
                }
                let _ = inner.cmds.send(Cmd::Packet(d));
            }
        }
    };
    let states = {
        let (inner, conn) = (inner.clone(), conn.clone());
        async move {
            while let Ok(mut recv) = conn.accept_uni().await {
                let (inner, chain) = (inner.clone(), chain.clone());
                tokio::spawn(async move {
                    match read_frame::<StateMessage>(&mut recv).await {
                        Ok(Some(msg)) if names_node(&chain, msg.name()) => {
                            let _ = inner.cmds.send(Cmd::State(msg));
                        }
                        Ok(Some(msg)) => impostor(msg.name()),
                        Ok(None) => {}
                        Err(e) => tracing::debug!("state stream: {e}"),
                    }
                });
            }
        }
    };
    let calls = {
        let inner = inner.clone();
        async move {
            while let Ok((send, recv)) = conn.accept_bi().await {
                let (send, recv) = (Box::pin(send), Box::pin(recv));
                let call = Incoming { remote, lane: Lane::Quic, send, recv };
                if inner.incoming.send(call).await.is_err() {
                    break;
                }
            }
        }
    };
    tokio::join!(datagrams, states, calls);
    inner.open_connections.fetch_sub(1, Ordering::Relaxed);
}

async fn membership_task(
    inner: Arc<Inner>,
    mut core: Membership,
    mut rx: mpsc::UnboundedReceiver<Cmd>,
    join: Vec<SocketAddr>,
) {
    for seed in &join {
        core.join(*seed);
    }
    apply(&inner, &mut core);
    let started = tokio::time::Instant::now();
    let mut tick = tokio::time::interval(TICK);
    let mut rejoin = tokio::time::interval(Duration::from_secs(1));
    loop {
        tokio::select! {
            cmd = rx.recv() => match cmd {
                Some(Cmd::Packet(p)) => core.handle_packet(&p),
                Some(Cmd::Timer(t)) => core.handle_timer(t),
                Some(Cmd::State(msg)) => {
                    core.apply_message(msg);
                }
                Some(Cmd::Verified(id, alive)) => core.verified(id, alive),
                Some(Cmd::Local(f)) => {
                    core.tick(started.elapsed());
                    core.update_local(f);
                }
                Some(Cmd::Leave(done)) => {
                    core.leave();
                    let sends = apply(&inner, &mut core);
                    for s in sends {
                        let _ = s.await;
                    }
                    let _ = done.send(());
                    return;
                }
                None => return,
            },
            _ = tick.tick() => core.tick(started.elapsed()),
            _ = rejoin.tick() => core.knock(&join),
        }
        apply(&inner, &mut core);
    }
}

/// Carries out the core's output; returns the packet sends (awaited only when leaving).
fn apply(inner: &Arc<Inner>, core: &mut Membership) -> Vec<tokio::task::JoinHandle<()>> {
    let mut sends = vec![];
    let mut changed = false;
    for out in core.drain() {
        match out {
            Output::Packet(to, data) => {
                let inner2 = inner.clone();
                inner.gossip_bytes.fetch_add(data.len() as u64, Ordering::Relaxed);
                sends.push(tokio::spawn(async move {
                    match connection(&inner2, &to).await {
                        Ok(conn) => {
                            if let Err(e) = conn.send_datagram(data) {
                                tracing::debug!(peer = to.name, "datagram: {e}");
                            }
                        }
                        Err(e) => tracing::debug!(peer = to.name, "{e}"),
                    }
                }));
            }
            Output::Timer(after, timer) => {
                let cmds = inner.cmds.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(after).await;
                    let _ = cmds.send(Cmd::Timer(timer));
                });
            }
            Output::Up(id) => {
                tracing::info!(peer = id.name, addr = %id.addr, "peer up");
                changed = true;
            }
            Output::State(id, msg) => push_state(inner, id, *msg),
            Output::Verify { id, again } => {
                let inner2 = inner.clone();
                tokio::spawn(async move {
                    if again {
                        tokio::time::sleep(Duration::from_secs(2)).await;
                    }
                    let alive = probe(&inner2, &id).await;
                    let _ = inner2.cmds.send(Cmd::Verified(id, alive));
                });
            }
            Output::Down(id) => {
                tracing::info!(peer = id.name, addr = %id.addr, "peer down");
                if let Some(c) = lock(&inner.conns).remove(&id.addr) {
                    c.conn.close(0u32.into(), b"declared down");
                }
                lock(&inner.dials).remove(&id.addr);
                changed = true;
            }
        }
    }
    let peers: Vec<Peer> = core.peers().cloned().collect();
    let mut view = lock(&inner.view);
    if changed || *view.1 != peers || view.0 != *core.me() {
        *view = (core.me().clone(), Arc::new(peers));
    }
    sends
}

fn push_state(inner: &Arc<Inner>, to: NodeId, msg: StateMessage) {
    let inner = inner.clone();
    tokio::spawn(async move {
        let sent = async {
            let conn = connection(&inner, &to).await?;
            let mut send = conn.open_uni().await.map_err(|e| MeshError::Io(e.to_string()))?;
            let n = write_frame(&mut send, &msg).await?;
            send.finish().map_err(|e| MeshError::Io(e.to_string()))?;
            Ok::<_, MeshError>(n)
        };
        match sent.await {
            Ok(n) => {
                inner.gossip_bytes.fetch_add(n as u64, Ordering::Relaxed);
            }
            Err(e) => tracing::debug!(peer = to.name, "state push: {e}"),
        }
    });
}
