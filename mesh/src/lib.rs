//! The node mesh: nodes find each other without a central service, know who has warm capacity,
//! and call each other.
//!
//! - [`tls`]: the cluster CA and node certificates (rcgen), and the mutual-TLS configs
//!   (QUIC's, the bulk lane's).
//! - [`trust`]: the revocation list checked at every handshake.
//! - [`core`]: membership without I/O — foca (SWIM) and the versioned view of every node's
//!   state, and when this node's state goes to whom (its records and messages: `state`).
//!   The simulation tests drive it with a virtual clock and a lossy virtual network.
//! - [`Mesh`]: the run-time driver — one quinn endpoint per node; SWIM packets as QUIC
//!   datagrams, node state on unidirectional streams, node-to-node calls on bidirectional
//!   streams framed by [`wire`].
//! - [`bulk`]: the bulk lane, calls that carry bulk bytes over TLS on kernel TCP.
//! - [`sim`]: a deterministic simulation of the core (virtual clock, seeded loss).

pub mod bulk;
pub mod core;
mod driver;
pub mod sim;
mod state;
pub mod tls;
pub mod trust;
pub mod wire;

pub use crate::core::{NodeId, NodeState, Peer};
pub use driver::{Incoming, Lane, Mesh, MeshConfig, STATE_REFRESH};
/// The QUIC stream types calls hand out.
pub use quinn;
pub use tls::TlsFiles;

/// A port on `ip` free for both of a node's lanes (QUIC on UDP, the bulk lane on TCP), for a
/// test or bench that must know a node's mesh port before the node starts: two nodes that
/// join each other, a node restarted at its address. A node given port 0 finds its own.
///
/// The port is drawn from 10000–32767, below the kernel's ephemeral range (32768 and up by
/// default). A port the kernel hands out for UDP (`bind(0)`) is in that range, where any
/// outgoing TCP connection may hold it by the time the node binds its bulk lane there.
pub fn free_port(ip: std::net::IpAddr) -> std::io::Result<u16> {
    use std::hash::{BuildHasher, Hasher};
    const LOW: u64 = 10_000;
    const SPAN: u64 = 32_768 - LOW;
    // A random start per call, so parallel tests rarely try the same port.
    let start = std::collections::hash_map::RandomState::new().build_hasher().finish();
    for i in 0..SPAN {
        let port = (LOW + (start.wrapping_add(i)) % SPAN) as u16;
        let tcp = std::net::TcpListener::bind((ip, port));
        if tcp.is_ok() && std::net::UdpSocket::bind((ip, port)).is_ok() {
            return Ok(port);
        }
    }
    Err(std::io::Error::new(std::io::ErrorKind::AddrInUse, format!("no free port on {ip}")))
}

#[derive(Debug, thiserror::Error)]
pub enum MeshError {
    #[error("tls: {0}")]
    Tls(String),
    #[error("mesh i/o: {0}")]
    Io(String),
    #[error("mesh message: {0}")]
    Codec(String),
    #[error("no live peer named {0:?}")]
    NoPeer(String),
}
