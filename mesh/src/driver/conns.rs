//! The mesh's QUIC connections: the one to each peer, dialled on first use or accepted, kept
//! one per peer when two nodes dial each other at once; what a peer sends on one (read by
//! `serve`); the endpoint's and the bulk lane's bind; and the trust reload that swaps the TLS
//! configs and closes revoked nodes' connections. Apart from the handle (`driver.rs`), which
//! starts it, and the membership task (`membership`), which sends on the connections it hands out.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::{Cmd, Conn, Incoming, Inner, Lane, lock};
use crate::MeshError;
use crate::core::{Membership, NodeId, StateMessage};
use crate::tls::{SERVER_NAME, names_node, peer_chain};
use crate::wire::read_frame;

/// How long a duplicate connection stays open after it lost the tie-break: calls already under
/// way on it finish; new ones go to the connection kept.
const RETIRE_AFTER: Duration = Duration::from_secs(10);

/// The connection to node `to`, dialled on first use. Its certificate must name `to` (a seed
/// known only by its address, with no name yet, may be any node of the cluster).
pub(super) async fn connection(
    inner: &Arc<Inner>,
    to: &NodeId,
) -> Result<quinn::Connection, MeshError> {
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

pub(super) async fn accept_loop(inner: Arc<Inner>) {
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
pub(super) fn bind(
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
pub(super) async fn watch_trust(
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
