//! The mesh at the HTTP edge: a claim this node cannot serve from its warm pool goes to a peer
//! that can, and a call on a sandbox this node does not hold goes to its owner — by a `307`
//! (clients follow it, at most one hop: the retry carries `no_redirect`), or in forward mode
//! through this node over a QUIC stream (the API call run by the owner's router; the data plane
//! spliced through).

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use hyper_util::rt::TokioIo;

use crate::api::bearer;
use crate::error::{Code, NodeError};
use crate::node::Node;
use crate::peers::{Located, PeerReply, PeerRequest};
use crate::pool::PoolKey;

/// Whether the request is a redirect's retry (or a forwarded call): serve it here.
pub fn no_redirect(query: Option<&str>) -> bool {
    query.is_some_and(|q| q.split('&').any(|p| p == "no_redirect" || p.starts_with("no_redirect=")))
}

fn redirect(location: String) -> Response {
    let mut res = StatusCode::TEMPORARY_REDIRECT.into_response();
    if let Ok(v) = HeaderValue::from_str(&location) {
        res.headers_mut().insert(header::LOCATION, v);
    }
    res
}

fn with_no_redirect(path_and_query: &str) -> String {
    if path_and_query.contains('?') {
        format!("{path_and_query}&no_redirect=1")
    } else {
        format!("{path_and_query}?no_redirect=1")
    }
}

fn http_reply(reply: PeerReply) -> Response {
    match reply {
        PeerReply::Http { status, location, content_type, body } => {
            let mut res = Response::new(Body::from(body));
            *res.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY);
            for (name, value) in
                [(header::LOCATION, location), (header::CONTENT_TYPE, content_type)]
            {
                if let Some(v) = value.and_then(|v| HeaderValue::from_str(&v).ok()) {
                    res.headers_mut().insert(name, v);
                }
            }
            res
        }
        PeerReply::Lookup { .. } => {
            NodeError::internal("a peer answered a call with a lookup").into_response()
        }
    }
}

/// A peer with a warm sandbox for `key`, unless the client asked this node only. Whether the
/// claim goes there is the node's to decide ([`Node::claim_or_place`]).
pub fn warm_peer(node: &Node, key: &PoolKey, query: Option<&str>) -> Option<silk_mesh::Peer> {
    let peers = node.peers.as_ref()?;
    if no_redirect(query) {
        return None;
    }
    peers.pick(&key.to_string())
}

/// Sends a claim to `peer`: a redirect to it, or the request forwarded and its answer.
pub async fn place_claim(
    node: &Node,
    peer: silk_mesh::Peer,
    token: Option<&str>,
    request: &crate::claims::ClaimRequest,
) -> Result<Response, NodeError> {
    let peers = node.peers.as_ref().expect("a peer was picked");
    let state = peer.state.as_ref().expect("picked peers have state");
    node.metrics.placed_on_peers.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    if !peers.forward {
        return Ok(redirect(format!("{}/v1/sandboxes?no_redirect=1", state.client_url())));
    }
    let body = serde_json::to_vec(request).map_err(|e| NodeError::internal(e.to_string()))?;
    let req = PeerRequest::Http {
        method: "POST".into(),
        uri: "/v1/sandboxes?no_redirect=1".into(),
        token: token.map(str::to_string),
        content_type: Some("application/json".into()),
        body,
    };
    Ok(http_reply(peers.forward(&peer, req).await?))
}

/// Middleware on every `/v1/sandboxes/{id}…` route: a sandbox held here is served here; one held
/// by a peer is redirected (or forwarded) there; anything else falls through to the usual 404.
pub async fn owner(State(node): State<Arc<Node>>, req: Request, next: Next) -> Response {
    let Some(peers) = node.peers.clone() else { return next.run(req).await };
    let path = req.uri().path().to_string();
    let id = path.split('/').nth(3).unwrap_or_default().to_string();
    if id.is_empty() || node.get(&id).is_some() || no_redirect(req.uri().query()) {
        return next.run(req).await;
    }
    let token = bearer(req.headers()).map(str::to_string);
    let peer = match peers.locate(&id, token.as_deref()).await {
        Located::Owner(peer) => *peer,
        Located::Denied => return next.run(req).await,
        Located::Unknown => {
            let message =
                format!("a node that may hold {id} did not answer; try again in a moment");
            return try_again(message).into_response();
        }
        Located::Nobody => {
            // No live node holds it: an archive whose node died is woken here.
            let (n, owned, t) = (node.clone(), id.clone(), token.clone());
            return match crate::node::detached(
                async move { n.wake_orphan(&owned, t.as_deref()).await },
            )
            .await
            {
                Ok(_) => next.run(req).await,
                Err(e) => e.into_response(),
            };
        }
    };
    let target = with_no_redirect(req.uri().path_and_query().map_or(path.as_str(), |p| p.as_str()));
    if !peers.forward {
        // The owner's address arrives with its state, a moment after it joins.
        let Some(state) = peer.state.as_ref().filter(|s| !s.api.is_empty()) else {
            let message =
                format!("the node holding {id} is joining the mesh; try again in a moment");
            return try_again(message).into_response();
        };
        return redirect(format!("{}{target}", state.client_url()));
    }
    if path.ends_with("/agent") {
        return forward_relay(node, peers, peer, req, &id, token).await;
    }
    let method = req.method().to_string();
    let content_type =
        req.headers().get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).map(str::to_string);
    let body = match axum::body::to_bytes(req.into_body(), node.cfg.max_body_bytes).await {
        Ok(b) => b.to_vec(),
        Err(e) => {
            return NodeError::new(Code::PayloadTooLarge, e.to_string()).into_response();
        }
    };
    let call = |peer: silk_mesh::Peer| {
        let req = PeerRequest::Http {
            method: method.clone(),
            uri: target.clone(),
            token: token.clone(),
            content_type: content_type.clone(),
            body: body.clone(),
        };
        let peers = peers.clone();
        async move { peers.forward(&peer, req).await }
    };
    let mut answer = call(peer.clone()).await;
    // A cached owner that no longer holds it (moved, released, woken elsewhere): ask the mesh
    // again, once.
    if matches!(answer, Ok(PeerReply::Http { status: 404, .. }) | Err(_)) {
        peers.forget(&id, token.as_deref());
        if let Located::Owner(again) = peers.locate(&id, token.as_deref()).await
            && again.id != peer.id
        {
            answer = call(*again).await;
        }
    }
    match answer {
        Ok(reply) => http_reply(reply),
        Err(e) => e.into_response(),
    }
}

/// Forward mode's data plane: `101` to the client, then its bytes spliced to a QUIC stream that
/// the owner splices to silkd.
async fn forward_relay(
    node: Arc<Node>,
    peers: Arc<crate::peers::Peers>,
    peer: silk_mesh::Peer,
    mut req: Request,
    id: &str,
    token: Option<String>,
) -> Response {
    let (send, recv) = match peers.relay(&peer, id, token.as_deref()).await {
        Ok(streams) => streams,
        Err(reply) => return http_reply(reply),
    };
    let upgrade = hyper::upgrade::on(&mut req);
    let id = id.to_string();
    tokio::spawn(async move {
        let Ok(upgraded) = upgrade.await else { return };
        let mut client = TokioIo::new(upgraded);
        let mut owner = tokio::io::join(recv, send);
        match tokio::io::copy_bidirectional(&mut client, &mut owner).await {
            Ok((up, down)) => {
                node.metrics.relay_bytes.fetch_add(up + down, std::sync::atomic::Ordering::Relaxed);
            }
            Err(e) => tracing::debug!(sandbox = id, "forwarded relay ended: {e}"),
        }
    });
    crate::relay::switching_protocols()
}

/// A peer that may answer in a moment: 503, where an unreachable one is 502.
fn try_again(message: String) -> NodeError {
    NodeError { status: Some(503), ..NodeError::new(Code::PeerUnavailable, message) }
}
