//! `POST /v1/sandboxes/{id}/previews`, `DELETE /v1/sandboxes/{id}/previews/{token}`, and the
//! host-based routing of `{port}-{id}.{preview_domain}` (see `crate::previews`).

use std::sync::Arc;

use axum::Router;
use axum::extract::{Path, Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use tower::ServiceExt;

use super::{JsonBody, bearer};
use crate::error::NodeError;
use crate::node::Node;
use crate::previews::{self, host_route};

/// A request that came to a preview host: the path it had there.
#[derive(Debug, Clone)]
pub struct PreviewHost {
    pub path: String,
}

pub(super) async fn create(
    State(node): State<Arc<Node>>,
    headers: HeaderMap,
    Path(id): Path<String>,
    JsonBody(req): JsonBody<silk_api::PreviewRequest>,
) -> Result<Response, NodeError> {
    node.authorized(&id, bearer(&headers))?;
    let ttl = req.ttl_seconds.unwrap_or(previews::DEFAULT_TTL);
    let (token, expires_ms) = node.create_preview(&id, req.port, ttl).await?;
    let url = url(&node, &headers, &id, req.port, &token);
    let preview = silk_api::Preview { token, url, port: req.port, expires_ms };
    Ok((StatusCode::CREATED, axum::Json(preview)).into_response())
}

pub(super) async fn revoke(
    State(node): State<Arc<Node>>,
    headers: HeaderMap,
    Path((id, token)): Path<(String, String)>,
) -> Result<Response, NodeError> {
    node.authorized(&id, bearer(&headers))?;
    match node.revoke_preview(&id, &token).await? {
        true => Ok(StatusCode::NO_CONTENT.into_response()),
        false => Err(NodeError::new(silk_api::Code::NotFound, "no such preview")),
    }
}

/// The URL of a preview: on its own host with a preview domain, else a path under the address
/// the client used.
fn url(node: &Node, headers: &HeaderMap, id: &str, port: u16, token: &str) -> String {
    let p = &node.cfg.previews;
    let tls = if node.cfg.tls.is_some() { "https" } else { "http" };
    let scheme = p.scheme.as_deref().unwrap_or(tls);
    match &p.domain {
        Some(domain) => {
            let at = p.port.map(|n| format!(":{n}")).unwrap_or_default();
            format!("{scheme}://{port}-{id}.{domain}{at}/?token={token}")
        }
        None => {
            let host = headers.get(header::HOST).and_then(|h| h.to_str().ok());
            let host = host.map_or_else(|| node.cfg.listen.to_string(), str::to_string);
            format!("{scheme}://{host}/v1/sandboxes/{id}/ports/{port}/?token={token}")
        }
    }
}

/// `api` behind host-based preview routing: a request to `{port}-{id}.{domain}` is one to
/// that port of that sandbox, whatever its path (a preview host never serves the API).
pub fn hosts(api: Router, domain: String) -> Router {
    Router::new().fallback(move |mut req: Request| {
        let (api, domain) = (api.clone(), domain.clone());
        async move {
            let host = req.headers().get(header::HOST).and_then(|h| h.to_str().ok());
            let host =
                host.map(str::to_string).or_else(|| req.uri().authority().map(|a| a.to_string()));
            if let Some((id, port)) = host.as_deref().and_then(|h| host_route(h, &domain)) {
                let path_and_query = req.uri().path_and_query().map_or("/", |p| p.as_str());
                let routed = format!("/v1/sandboxes/{id}/ports/{port}");
                // A call a peer forwarded here was routed by that peer already.
                let forwarded = super::edge::no_redirect(req.uri().query())
                    && req.uri().path().strip_prefix(&routed).is_some_and(|r| r.starts_with('/'));
                if forwarded {
                    return api.oneshot(req).await.into_response();
                }
                let routed = format!("{routed}{path_and_query}");
                let path = req.uri().path().to_string();
                match routed.parse() {
                    Ok(uri) => *req.uri_mut() = uri,
                    Err(_) => return NodeError::bad_request("not a path").into_response(),
                }
                req.extensions_mut().insert(PreviewHost { path });
            }
            api.oneshot(req).await.into_response()
        }
    })
}
