//! sandboxd: the node daemon. It keeps warm pools, serves claims in three tiers (warm hit →
//! clone from golden → cold boot), keeps claims in a crash-safe journal under leases, relays the
//! data plane to each sandbox's silkd, and serves the HTTP API.
//!
//! `node` is the controller (typed actions, no HTTP); `api` and `relay` are the HTTP edge.

pub mod api;
pub mod claims;
pub mod config;
pub mod error;
pub mod journal;
pub mod metrics;
pub mod node;
pub mod openapi;
pub mod pool;
pub mod relay;
pub mod state;

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
    axum::serve(listener, api::router(node)).with_graceful_shutdown(shutdown).await
}
