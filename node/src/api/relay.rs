//! The data plane: `GET /v1/sandboxes/{id}/agent` with `Upgrade: silkd`. After the `101` the
//! node splices bytes between the client and the sandbox's silkd, both ways, unchanged; a
//! half-close on either side is passed on to the other. The client's side is watched as it
//! passes (`silk_proto::Sniffer`) so each program it runs is an audit entry.

use std::sync::Arc;

use axum::extract::{Path, Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use hyper_util::rt::TokioIo;

use super::bearer;
use crate::error::{Code, NodeError};
use crate::node::Node;

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
    let (live, mut agent) = node.open_agent(&id).await?;
    let upgrade = hyper::upgrade::on(&mut req);
    // In use from the 101 on: the reaper must not find it idle while the upgrade completes.
    let active = crate::node::Active::new(&live);
    // Each program run through the relay is one audit entry (the opening is another).
    let (who, tenant) = super::audited::principal(&node, bearer(req.headers()), Some(&id));
    let whole = node.cfg.audit_exec_args;
    let (audit, name, target) = (node.audit.clone(), node.name.clone(), id.clone());
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
    Ok(switching_protocols())
}

/// The `101` the relay answers with (a forwarded relay passes its owner's on).
pub fn switching_protocols() -> Response {
    let mut res = StatusCode::SWITCHING_PROTOCOLS.into_response();
    res.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    res.headers_mut().insert(header::UPGRADE, HeaderValue::from_static(PROTOCOL));
    res
}
