//! The data plane: `GET /v1/sandboxes/{id}/agent` with `Upgrade: silkd`. After the `101` the
//! node splices bytes between the client and the sandbox's silkd, both ways, without buffering
//! or parsing; a half-close on either side is passed on to the other.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use axum::extract::{Path, Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use hyper_util::rt::TokioIo;

use crate::api::bearer;
use crate::error::{Code, NodeError};
use crate::node::{Active, Node};

pub const PROTOCOL: &str = "silkd";

pub async fn agent(
    State(node): State<Arc<Node>>,
    Path(id): Path<String>,
    mut req: Request,
) -> Result<Response, NodeError> {
    node.authorized(&id, bearer(req.headers()))?;
    let wants = req
        .headers()
        .get(header::UPGRADE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.eq_ignore_ascii_case(PROTOCOL));
    if !wants {
        return Err(NodeError::new(
            Code::UpgradeRequired,
            "send `Connection: upgrade` and `Upgrade: silkd`",
        ));
    }
    // A hibernated or archived sandbox wakes first (one whose silkd died restarts): the client
    // sees a slower call. Dialled before answering 101, so a failure is a clear error rather than
    // a dropped stream.
    let (n, owned) = (node.clone(), id.clone());
    let (live, mut agent) =
        crate::node::detached(async move { n.agent_stream(&owned).await }).await?;
    let upgrade = hyper::upgrade::on(&mut req);
    let active = Active::new(&live);
    tokio::spawn(async move {
        let _active = active;
        let upgraded = match upgrade.await {
            Ok(u) => u,
            Err(e) => {
                tracing::debug!("upgrade failed: {e}");
                return;
            }
        };
        let mut client = TokioIo::new(upgraded);
        let hangup = live.activity.clone();
        tokio::select! {
            copied = tokio::io::copy_bidirectional(&mut client, &mut agent) => match copied {
                Ok((up, down)) => {
                    node.metrics.relay_bytes.fetch_add(up + down, Ordering::Relaxed);
                }
                Err(e) => tracing::debug!(sandbox = id, "relay ended: {e}"),
            },
            // Hibernate, archive or release: the sandbox is stopping.
            () = hangup.hangup.notified() => {}
        }
    });
    let mut res = StatusCode::SWITCHING_PROTOCOLS.into_response();
    res.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    res.headers_mut().insert(header::UPGRADE, HeaderValue::from_static(PROTOCOL));
    Ok(res)
}
