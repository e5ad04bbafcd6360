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
