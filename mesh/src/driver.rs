//! The mesh at run time: one quinn endpoint (one UDP socket, both dialing and accepting) and one
//! task that owns the membership core. Membership packets travel as QUIC datagrams; node state
//! goes to a peer on a unidirectional stream when the core says so (on change, and to a peer
//! that heard nothing for `state_refresh`: see `core`); node-to-node calls are bidirectional
//! streams handed to the caller as [`Incoming`]. Beside the endpoint, a TCP listener at the same
//! address and port number serves the bulk lane ([`crate::bulk`]): calls that carry bulk bytes.
//!
//! This file holds the public types and the [`Mesh`] handle; the connections (dial, accept,
//! serve, the trust reload) are in `conns`, the membership task that carries out the core's
//! output in `membership`.

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
use crate::core::{Membership, NodeId, NodeState, Peer, StateMessage, swim_config};
use crate::tls::TlsFiles;

mod conns;
mod membership;

pub(crate) use conns::Throttled;
use conns::{accept_loop, bind, connection, watch_trust};
use membership::membership_task;

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
