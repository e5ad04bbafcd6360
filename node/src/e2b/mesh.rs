//! Any node of a mesh serves any sandbox: a call on a sandbox this node does not hold goes,
//! through the mesh, to the E2B API of the node that does (HTTP/1.1 over a QUIC stream, as the
//! native API forwards; bodies and streams pass through), so the SDK can be pointed at a load
//! balancer in front of every node. E2B's clients do not follow redirects, so this is always
//! forwarding, whatever `[mesh] forward` says.
//!
//! The caller is checked here first (the key, or the sandbox's access token, which every node
//! of the fleet can check): nothing is asked of the mesh for a caller who could not use the
//! sandbox anyway. The owner checks the call again, as any other (a tenant's ownership there).

use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::{E2b, HttpError, header};
use crate::fleet::Located;

/// Forwarded calls arrive under this prefix on a peer's forwarded-call router (`lib.rs` nests
/// the E2B API there), which is reachable only through the mesh.
pub const PREFIX: &str = "/.e2b";

/// Set on a forwarded call: the owner serves it, whatever it holds (one hop at most).
const FORWARDED: &str = "x-silkmesh-e2b-forwarded";

/// The sandbox a call is about: an envd call's `E2b-Sandbox-Id`, or the `{id}` of
/// `/sandboxes/{id}…` and `/v2/sandboxes/{id}…`.
fn sandbox_of(req: &Request) -> Option<(String, bool)> {
    if let Some(id) = header(req.headers(), "e2b-sandbox-id") {
        return Some((id.to_string(), true));
    }
    let mut parts = req.uri().path().trim_start_matches('/').split('/');
    let id = match (parts.next(), parts.next(), parts.next()) {
        (Some("sandboxes"), Some(id), _) | (Some("v2"), Some("sandboxes"), Some(id)) => id,
        _ => return None,
    };
    (!id.is_empty()).then(|| (id.to_string(), false))
}

pub(super) async fn owner(State(e2b): State<E2b>, req: Request, next: Next) -> Response {
    let Some(peers) = e2b.peers.clone() else { return next.run(req).await };
    let Some((id, envd)) = sandbox_of(&req) else { return next.run(req).await };
    if e2b.node.get(&id).is_some() || req.headers().contains_key(FORWARDED) {
        return next.run(req).await;
    }
    let headers = req.headers();
    let allowed = if envd {
        e2b.access_ok(&id, header(headers, "x-access-token"))
    } else {
        super::control::caller(&e2b, headers).is_ok()
    };
    // The root token asks the mesh: the caller was checked above, and the owner checks again.
    let root = e2b.node.cfg.api_token.clone();
    let (true, Some(root)) = (allowed, root) else { return next.run(req).await };
    let peer = match peers.locate(&id, Some(&root), false).await {
        Located::Owner(peer) => *peer,
        Located::Denied => return next.run(req).await,
        Located::Unknown => {
            let message = format!("a node that may hold {id} did not answer; try again");
            return HttpError::new(StatusCode::SERVICE_UNAVAILABLE, message).into_response();
        }
        Located::Nobody { moved_unasked } => {
            // No live node holds it: an archive whose node died is woken here.
            let (node, orphan) = (e2b.node.clone(), id.clone());
            let woken =
                crate::node::detached(async move { node.wake_orphan(&orphan, Some(&root)).await })
                    .await;
            // Woken, or it is nowhere: the call is answered here, in the shape its plane uses
            // for a sandbox that is gone (envd's 502 "not found", the control plane's 404).
            return match woken {
                Ok(false) if moved_unasked => {
                    let message = format!("the node {id} moved to did not answer; try again");
                    HttpError::new(StatusCode::SERVICE_UNAVAILABLE, message).into_response()
                }
                Err(e) if crate::api::status(&e) != StatusCode::NOT_FOUND => {
                    HttpError::new(crate::api::status(&e), e.message).into_response()
                }
                _ => next.run(req).await,
            };
        }
    };
    let (mut parts, body) = req.into_parts();
    let target = format!("{PREFIX}{}", parts.uri.path_and_query().map_or("/", |p| p.as_str()));
    parts.uri = match target.parse() {
        Ok(uri) => uri,
        Err(e) => return HttpError::new(StatusCode::BAD_REQUEST, e.to_string()).into_response(),
    };
    crate::api::edge::strip_hop_by_hop(&mut parts.headers, false);
    parts.headers.insert(FORWARDED, HeaderValue::from_static("1"));
    let req = Request::from_parts(parts, body);
    e2b.node.metrics.e2b_forwarded.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    match crate::api::edge::forward(&peers, &e2b.node, &peer, req, &mut None).await {
        Ok(res) => res,
        Err(e) => HttpError::new(StatusCode::BAD_GATEWAY, e.message).into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sandbox_of_a_call() {
        let of = |path: &str, id: Option<&str>| {
            let mut req = Request::builder().uri(path);
            if let Some(id) = id {
                req = req.header("E2b-Sandbox-Id", id);
            }
            sandbox_of(&req.body(axum::body::Body::empty()).unwrap())
        };
        assert_eq!(of("/files?path=x", Some("sb-1")), Some(("sb-1".into(), true)));
        assert_eq!(of("/sandboxes/sb-2/timeout", None), Some(("sb-2".into(), false)));
        assert_eq!(of("/v2/sandboxes/sb-3/connect", None), Some(("sb-3".into(), false)));
        assert_eq!(of("/sandboxes", None), None);
        assert_eq!(of("/v2/sandboxes", None), None);
        assert_eq!(of("/templates", None), None);
    }
}
