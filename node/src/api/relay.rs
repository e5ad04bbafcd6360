//! The data plane: `GET /v1/sandboxes/{id}/agent` with `Upgrade: silkd`. After the `101` the
//! node splices bytes between the client and the sandbox's silkd, both ways, unchanged; a
//! half-close on either side is passed on to the other. The client's side is watched as it
//! passes (`silk_proto::Sniffer`) so each program it runs is an audit entry.
//!
//! A claim (`POST /v1/sandboxes`) may ask for the same upgrade: its `101` carries the new
//! sandbox's row in [`SANDBOX_HEADER`] and the connection is then this relay, so a client's
//! first call needs no second connection, request and relay set-up.

use std::convert::Infallible;
use std::sync::Arc;

use axum::extract::{FromRequestParts, Path, Request, State};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use hyper::upgrade::OnUpgrade;
use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;

use super::bearer;
use crate::error::{Code, NodeError};
use crate::node::{Live, Node};

pub const PROTOCOL: &str = "silkd";

/// The header of a claim's `101` that carries the new sandbox's row (JSON, with its token).
pub const SANDBOX_HEADER: &str = "silk-sandbox";

/// Whether a request asks for the relay (`Upgrade: silkd`).
pub fn wanted(headers: &HeaderMap) -> bool {
    headers
        .get(header::UPGRADE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.eq_ignore_ascii_case(PROTOCOL))
}

/// The client's side of an upgrade, taken from a request that asks for the relay (`None`
/// otherwise, and on a connection that cannot upgrade, such as HTTP/2).
#[derive(Debug)]
pub struct ClientUpgrade(pub Option<OnUpgrade>);

impl<S: Send + Sync> FromRequestParts<S> for ClientUpgrade {
    type Rejection = Infallible;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Infallible> {
        let on = wanted(&parts.headers).then(|| parts.extensions.remove::<OnUpgrade>()).flatten();
        Ok(ClientUpgrade(on))
    }
}

pub async fn agent(
    State(node): State<Arc<Node>>,
    Path(id): Path<String>,
    mut req: Request,
) -> Result<Response, NodeError> {
    node.authorized(&id, bearer(req.headers()))?;
    if !wanted(req.headers()) {
        return Err(NodeError::new(
            Code::UpgradeRequired,
            "send `Connection: upgrade` and `Upgrade: silkd`",
        ));
    }
    // A hibernated or archived sandbox wakes first (one whose silkd died restarts): the client
    // sees a slower call. Dialled before answering 101, so a failure is a clear error rather than
    // a dropped stream.
    let (live, agent) = node.open_agent(&id).await?;
    let upgrade = hyper::upgrade::on(&mut req);
    let principal = super::audited::principal(&node, bearer(req.headers()), Some(&id));
    Ok(serve(node, live, agent, upgrade, principal))
}

/// Answers `101` and, once the client's side of the upgrade is ready, splices it to `agent`
/// until either ends. `principal` (who, tenant) is who each program run through it is
/// recorded for.
pub fn serve(
    node: Arc<Node>,
    live: Live,
    mut agent: UnixStream,
    upgrade: OnUpgrade,
    (who, tenant): (String, Option<String>),
) -> Response {
    // In use from the 101 on: the reaper must not find it idle while the upgrade completes.
    let active = crate::node::Active::new(&live);
    // Each program run through the relay is one audit entry (the opening is another).
    let whole = node.cfg.audit_exec_args;
    let (audit, name, id) = (node.audit.clone(), node.name.clone(), live.record.id.clone());
    let target = id.clone();
    let seen = move |frame: silk_proto::Frame| {
        let Some(detail) = super::audited::program(&frame, whole) else { return };
        audit.record(silk_api::AuditEntry {
            time_ms: crate::node::now_ms(),
            node: name.clone(),
            principal: who.clone(),
            tenant: tenant.clone(),
            action: "exec".into(),
            target: Some(target.clone()),
            status: 101,
            detail: Some(detail),
        });
    };
    tokio::spawn(async move {
        let _active = active;
        let upgraded = match upgrade.await {
            Ok(u) => u,
            Err(e) => {
                tracing::debug!(sandbox = id, "upgrade failed: {e}");
                return;
            }
        };
        node.splice(&live, &mut TokioIo::new(upgraded), &mut agent, seen).await;
    });
    switching_protocols()
}

/// The `101` the relay answers with (a forwarded relay passes its owner's on).
pub fn switching_protocols() -> Response {
    let mut res = StatusCode::SWITCHING_PROTOCOLS.into_response();
    res.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    res.headers_mut().insert(header::UPGRADE, HeaderValue::from_static(PROTOCOL));
    res
}
