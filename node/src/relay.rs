//! The data plane: `GET /v1/sandboxes/{id}/agent` with `Upgrade: silkd`. After the `101` the
//! node splices bytes between the client and the sandbox's silkd, both ways, without buffering
//! or parsing; a half-close on either side is passed on to the other.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use axum::extract::{Path, Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;

use crate::api::bearer;
use crate::error::ApiError;
use crate::node::Node;

pub const PROTOCOL: &str = "silkd";

pub async fn agent(
    State(node): State<Arc<Node>>,
    Path(id): Path<String>,
    mut req: Request,
) -> Result<Response, ApiError> {
    let live = node.authorized(&id, bearer(req.headers()))?;
    let wants = req
        .headers()
        .get(header::UPGRADE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.eq_ignore_ascii_case(PROTOCOL));
    if !wants {
        return Err(ApiError::new(
            StatusCode::UPGRADE_REQUIRED,
            "upgrade_required",
            "send `Connection: upgrade` and `Upgrade: silkd`",
        ));
    }
    // Dial before answering 101, so a dead agent is a clear 503 rather than a dropped stream.
    let mut agent = UnixStream::connect(&live.agent).await.map_err(|e| {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "agent_unavailable",
            format!("connect to silkd: {e}"),
        )
    })?;
    let upgrade = hyper::upgrade::on(&mut req);
    tokio::spawn(async move {
        let upgraded = match upgrade.await {
            Ok(u) => u,
            Err(e) => {
                tracing::debug!("upgrade failed: {e}");
                return;
            }
        };
        let mut client = TokioIo::new(upgraded);
        match tokio::io::copy_bidirectional(&mut client, &mut agent).await {
            Ok((up, down)) => {
                node.metrics.relay_bytes.fetch_add(up + down, Ordering::Relaxed);
            }
            Err(e) => tracing::debug!(sandbox = id, "relay ended: {e}"),
        }
    });
    let mut res = StatusCode::SWITCHING_PROTOCOLS.into_response();
    res.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    res.headers_mut().insert(header::UPGRADE, HeaderValue::from_static(PROTOCOL));
    Ok(res)
}
