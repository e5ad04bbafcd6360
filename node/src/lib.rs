//! sandboxd: the node daemon. It keeps warm pools, serves claims in three tiers (warm hit →
//! clone from golden → cold boot), keeps claims in a crash-safe journal under leases, relays the
//! data plane to each sandbox's silkd, and serves the HTTP API.
//!
//! `node` is the controller (typed actions, no HTTP); `api` and `relay` are the HTTP edge.

pub mod api;
pub mod claims;
pub mod config;
mod durable;
pub mod edge;
pub mod error;
pub mod journal;
pub mod metrics;
pub mod node;
pub mod openapi;
pub mod peers;
pub mod pool;
pub mod relay;
pub mod state;
pub mod stored;

use std::future::Future;
use std::sync::Arc;

/// Serves the API on `listener` until `shutdown` resolves. Sandboxes keep running afterwards,
/// for the next start to re-adopt.
pub async fn serve(
    node: Arc<node::Node>,
    listener: tokio::net::TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    use axum::serve::ListenerExt;
    // The relay forwards silkd's small frames as they come: Nagle plus the client's delayed ACK
    // would hold the second of two back-to-back frames for ~40 ms.
    let listener = listener.tap_io(|tcp| {
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!("TCP_NODELAY: {e}");
        }
    });
    let router = api::router(node.clone());
    let incoming = node.incoming.lock().unwrap_or_else(|p| p.into_inner()).take();
    if let Some(incoming) = incoming {
        tokio::spawn(peers::serve(node.clone(), router.clone(), incoming));
    }
    let served = axum::serve(listener, router).with_graceful_shutdown(shutdown).await;
    // Peers learn at once that this node left, rather than by failure detection.
    if let Some(p) = &node.peers {
        p.mesh.leave().await;
    }
    served
}
