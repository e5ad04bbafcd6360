//! The mesh at the HTTP edge: a claim this node cannot serve from its warm pool goes to a peer
//! that can, and a call on a sandbox this node does not hold goes to its owner — by a `307`
//! (clients follow it, at most one hop: the retry carries `no_redirect`), or in forward mode
//! through this node: the request goes to the owner's own API as HTTP/1.1 over a QUIC stream
//! (headers, status and bodies pass unchanged and stream; the relay's upgrade passes through
//! like any other answer, then the bytes are spliced).

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, Uri, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use hyper_util::rt::TokioIo;

use super::{Api, bearer};
use crate::error::{Code, NodeError};
use crate::fleet::{Located, PeerStream};
use crate::node::Node;
use crate::pool::PoolKey;
use crate::previews::{self, Carried, Token};

/// Whether the request is a redirect's retry (or a forwarded call): serve it here.
pub fn no_redirect(query: Option<&str>) -> bool {
    query.is_some_and(|q| q.split('&').any(|p| p == "no_redirect" || p.starts_with("no_redirect=")))
}

fn redirect(location: String) -> Response {
    let mut res = StatusCode::TEMPORARY_REDIRECT.into_response();
    // The node it points at serves (and records) the call.
    res.extensions_mut().insert(super::audited::Passed);
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

/// A peer with a warm sandbox for `key`, unless the client asked this node only. Whether the
/// claim goes there is the node's to decide ([`crate::node::Node::claim_or_place`]).
pub fn warm_peer(api: &Api, key: &PoolKey, query: Option<&str>) -> Option<silk_mesh::Peer> {
    let peers = api.peers.as_ref()?;
    if no_redirect(query) {
        return None;
    }
    peers.pick(&key.to_string())
}

/// The live peer that keeps the copy of checkpoint `id` (`copy_on`, the node that took it),
/// when its branch should go there: it is not this node, this node keeps no copy of it, the
/// peer is not draining and has room, and the client did not ask this node only.
pub fn copy_peer(
    api: &Api,
    copy_on: Option<&str>,
    id: &str,
    query: Option<&str>,
) -> Option<silk_mesh::Peer> {
    let peers = api.peers.as_ref()?;
    let on = copy_on.filter(|on| *on != api.node.name)?;
    if no_redirect(query) || api.node.has_copy(id) {
        return None;
    }
    let room = |s: &silk_mesh::NodeState| !s.draining && s.claims < s.capacity;
    let live = peers.mesh.peers();
    live.iter().find(|p| p.id.name == on && p.state.as_ref().is_some_and(room)).cloned()
}

/// Sends a claim to `peer`: a redirect to it, or the request forwarded and its answer.
pub async fn place_claim(
    api: &Api,
    peer: silk_mesh::Peer,
    headers: &HeaderMap,
    request: &crate::claims::ClaimRequest,
    upgrade: Option<hyper::upgrade::OnUpgrade>,
) -> Result<Response, NodeError> {
    let body = serde_json::to_vec(request).map_err(|e| NodeError::internal(e.to_string()))?;
    let mut extra = HeaderMap::new();
    if upgrade.is_some() {
        // A claim that asks for the relay gets the peer's: its `101` is spliced through here.
        extra.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        extra.insert(header::UPGRADE, HeaderValue::from_static(super::relay::PROTOCOL));
        // The peer asks its silkd, if the client asked (its answer comes back in the `101`).
        if let Some(ask) = headers.get(super::relay::ASK_HEADER) {
            extra.insert(super::relay::ASK_HEADER, ask.clone());
        }
    }
    let path = "/v1/sandboxes?no_redirect=1".to_string();
    place(api, peer, headers, path, body.into(), extra, upgrade).await
}

/// Sends a branch of checkpoint `id` (its request `body`) to `peer`, as [`place_claim`] does.
pub async fn place_branch(
    api: &Api,
    peer: silk_mesh::Peer,
    headers: &HeaderMap,
    id: &str,
    body: axum::body::Bytes,
) -> Result<Response, NodeError> {
    // `id` passed `authorized_checkpoint`: `ck_` and hex digits.
    let path = format!("/v1/checkpoints/{id}/claim?no_redirect=1");
    place(api, peer, headers, path, body, HeaderMap::new(), None).await
}

/// A call made for `peer` to serve: a redirect to `path` on it, or in forward mode `POST path`
/// with `body`, the client's bearer token and `extra` headers, and the peer's answer.
async fn place(
    api: &Api,
    peer: silk_mesh::Peer,
    headers: &HeaderMap,
    path: String,
    body: axum::body::Bytes,
    extra: HeaderMap,
    mut upgrade: Option<hyper::upgrade::OnUpgrade>,
) -> Result<Response, NodeError> {
    let peers = api.peers.as_ref().expect("a peer was picked");
    let state = peer.state.as_ref().expect("picked peers have state");
    api.node.metrics.placed_on_peers.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    if !peers.forward {
        return Ok(redirect(format!("{}{path}", state.client_url())));
    }
    let mut req = Request::new(Body::from(body));
    *req.method_mut() = Method::POST;
    *req.uri_mut() = Uri::try_from(path).map_err(|e| NodeError::internal(e.to_string()))?;
    if let Some(auth) = headers.get(header::AUTHORIZATION) {
        req.headers_mut().insert(header::AUTHORIZATION, auth.clone());
    }
    req.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    req.headers_mut().extend(extra);
    forward(peers, &api.node, &peer, req, &mut upgrade).await
}

/// The port a ports-route request names, and the preview tokens it carries.
fn preview_of(req: &Request) -> Option<(u16, Vec<Carried>)> {
    let mut parts = req.uri().path().split('/').skip(4); // "", "v1", "sandboxes", id
    let port: u16 = match (parts.next(), parts.next()) {
        (Some("ports"), Some(port)) => port.parse().ok()?,
        _ => return None,
    };
    Some((port, previews::carried(req.uri(), req.headers())))
}

/// The first of `carried` signed by this fleet's key for `port` of sandbox `id` and not
/// expired: checked before any peer is asked (the owner checks it was not revoked).
async fn signed(
    node: &Node,
    id: &str,
    (port, carried): (u16, Vec<Carried>),
) -> Option<(u16, Carried)> {
    if carried.is_empty() {
        return None;
    }
    let key = node.preview_key().await.ok()?;
    let now = crate::node::now_ms();
    let signed =
        |c: &Carried| Token::parse(c.token()).is_some_and(|t| t.valid(&key, id, port, now));
    carried.into_iter().find(signed).map(|c| (port, c))
}

/// Middleware on every `/v1/sandboxes/{id}…` route: a sandbox held here is served here; one held
/// by a peer is redirected (or forwarded) there; anything else falls through to the usual 404.
pub async fn owner(State(api): State<Api>, req: Request, next: Next) -> Response {
    let Some(peers) = api.peers.clone() else { return next.run(req).await };
    let node = api.node.clone();
    let path = req.uri().path().to_string();
    let id = path.split('/').nth(3).unwrap_or_default().to_string();
    if id.is_empty() || node.get(&id).is_some() || no_redirect(req.uri().query()) {
        return next.run(req).await;
    }
    // No work elsewhere before a token was presented: without one the answer is the same 404
    // (or 401) this node gives for any id it does not hold. A preview held elsewhere is checked
    // against the fleet's key first: its first visit is answered here (a cookie and a redirect
    // reveal nothing of the sandbox); its cookie is the credential the owner is asked with.
    // Previews are always forwarded: a browser would not take the cookie along a redirect.
    let is_preview = bearer(req.headers()).is_none();
    let preview = match (is_preview, preview_of(&req)) {
        (true, Some(carried)) => signed(&node, &id, carried).await,
        _ => None,
    };
    let token = match (bearer(req.headers()), preview) {
        // A bearer no node could take is refused before the mesh is asked.
        (Some(token), _) => match node.credential_presented(Some(token)) {
            Ok(()) => token.to_string(),
            Err(e) => return e.into_response(),
        },
        (None, Some((port, Carried::Query(t)))) => {
            return super::ports::first_visit(&node, &req, &id, port, &t);
        }
        (None, Some((_, Carried::Cookie(t)))) => t,
        (None, None) => return next.run(req).await,
    };
    let token = Some(token);
    let client = req.extensions().get::<crate::listen::ClientAddr>().map(|c| c.0.ip());
    let cached = peers.cached(&id, token.as_deref());
    if let Some(ip) = client
        && !cached
        && !api.lookups.allow(ip)
    {
        node.metrics.lookups_limited.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let limited = NodeError::new(
            Code::RateLimited,
            "too many lookups of sandboxes this node does not hold; try again in a moment",
        );
        let mut res = limited.into_response();
        res.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        return res;
    }
    // A forwarded call whose body is small (most are) is kept so it can be sent again: it
    // trusts a cached owner, and asks the mesh again if that one no longer holds it. A large or
    // streamed body is sent once, so its owner is confirmed first.
    let resendable = small_body(req.headers());
    let trust_cache = peers.forward && resendable;
    if !cached {
        node.metrics.owner_lookups.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
    let peer = match peers.locate(&id, token.as_deref(), trust_cache).await {
        Located::Owner(peer) => *peer,
        Located::Denied => return next.run(req).await,
        Located::Unknown => {
            let message =
                format!("a node that may hold {id} did not answer; try again in a moment");
            return try_again(message).into_response();
        }
        Located::Nobody { moved_unasked } => {
            // No live node holds it: an archive whose node died is woken here.
            let (n, owned, t) = (node.clone(), id.clone(), token.clone());
            return match crate::node::detached(
                async move { n.wake_orphan(&owned, t.as_deref()).await },
            )
            .await
            {
                // Not archived, but moved from here to a node out of reach for now: it may well
                // live there, and a 404 would tell the client it is gone.
                Ok(false) if moved_unasked => {
                    let message = format!("the node {id} moved to did not answer; try again");
                    try_again(message).into_response()
                }
                Ok(_) => next.run(req).await,
                Err(e) => e.into_response(),
            };
        }
    };
    let target = with_no_redirect(req.uri().path_and_query().map_or(path.as_str(), |p| p.as_str()));
    if !peers.forward && !is_preview {
        // The owner's address arrives with its state, a moment after it joins.
        let Some(state) = peer.state.as_ref().filter(|s| !s.api.is_empty()) else {
            let message =
                format!("the node holding {id} is joining the mesh; try again in a moment");
            return try_again(message).into_response();
        };
        return redirect(format!("{}{target}", state.client_url()));
    }
    let (mut parts, body) = req.into_parts();
    parts.uri = match target.parse() {
        Ok(uri) => uri,
        Err(e) => return NodeError::bad_request(format!("path: {e}")).into_response(),
    };
    // The client's side of an upgrade (the relay), spliced to whichever owner accepts it.
    let mut upgrade = parts.extensions.remove::<hyper::upgrade::OnUpgrade>();
    strip_hop_by_hop(&mut parts.headers, path.ends_with("/agent"));
    if !resendable {
        let req = Request::from_parts(parts, body);
        let answer = forward(&peers, &node, &peer, req, &mut upgrade).await;
        return answer.unwrap_or_else(IntoResponse::into_response);
    }
    let body = match axum::body::to_bytes(body, RESEND_BODY_MAX as usize).await {
        Ok(bytes) => bytes,
        Err(e) => return NodeError::bad_request(format!("request body: {e}")).into_response(),
    };
    let copy = || {
        let mut req = Request::new(Body::from(body.clone()));
        (*req.method_mut(), *req.uri_mut(), *req.headers_mut()) =
            (parts.method.clone(), parts.uri.clone(), parts.headers.clone());
        req
    };
    let answer = forward(&peers, &node, &peer, copy(), &mut upgrade).await;
    // A cached owner that no longer holds it (moved, released, woken elsewhere): ask the mesh
    // again, once.
    let stale = match &answer {
        Ok(res) => res.status() == StatusCode::NOT_FOUND,
        Err(_) => true,
    };
    if stale {
        peers.forget(&id, token.as_deref());
        if let Located::Owner(again) = peers.locate(&id, token.as_deref(), false).await
            && again.id != peer.id
        {
            let retry = forward(&peers, &node, &again, copy(), &mut upgrade).await;
            return retry.unwrap_or_else(IntoResponse::into_response);
        }
    }
    answer.unwrap_or_else(IntoResponse::into_response)
}

/// Drops the headers that concern one connection only (RFC 9110 §7.6.1): those `Connection`
/// names and the standard ones. The relay's upgrade (`Connection: upgrade`, `Upgrade`) is kept
/// on `/agent`, the one route that upgrades.
pub(crate) fn strip_hop_by_hop(headers: &mut HeaderMap, upgrade: bool) {
    let named: Vec<String> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|n| n.trim().to_ascii_lowercase())
        .filter(|n| !(upgrade && n == "upgrade"))
        .collect();
    for name in named {
        headers.remove(name.as_str());
    }
    for name in ["keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding"] {
        headers.remove(name);
    }
    headers.remove(header::PROXY_AUTHORIZATION);
    if !upgrade {
        headers.remove(header::CONNECTION);
        headers.remove(header::UPGRADE);
    }
}

/// Bodies up to this size are kept in memory so that a forwarded call can be sent again.
const RESEND_BODY_MAX: u64 = 64 << 10;

/// Whether a request's body is declared at most [`RESEND_BODY_MAX`] bytes (or absent).
fn small_body(headers: &HeaderMap) -> bool {
    match headers.get(header::CONTENT_LENGTH) {
        Some(n) => n
            .to_str()
            .ok()
            .and_then(|n| n.parse::<u64>().ok())
            .is_some_and(|n| n <= RESEND_BODY_MAX),
        None => !headers.contains_key(header::TRANSFER_ENCODING),
    }
}

/// Sends `req` to `peer`'s API and returns its answer as it streams in. When the peer accepts
/// an upgrade (the relay), the client's side of it (`upgrade`, taken then) is spliced to it.
pub(crate) async fn forward(
    peers: &crate::fleet::Peers,
    node: &std::sync::Arc<crate::node::Node>,
    peer: &silk_mesh::Peer,
    req: Request,
    upgrade: &mut Option<hyper::upgrade::OnUpgrade>,
) -> Result<Response, NodeError> {
    let unreachable =
        |e: hyper::Error| NodeError::new(Code::PeerUnavailable, format!("{}: {e}", peer.id.name));
    let stream = peers.open_http(peer).await?;
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.map_err(unreachable)?;
    tokio::spawn(async move {
        if let Err(e) = conn.with_upgrades().await {
            tracing::debug!("forwarded connection: {e}");
        }
    });
    let mut res = sender.send_request(req).await.map_err(unreachable)?;
    let upgraded = res.status() == StatusCode::SWITCHING_PROTOCOLS;
    // The owner's `Connection: close` ends its stream, not the client's connection.
    strip_hop_by_hop(res.headers_mut(), upgraded);
    if upgraded && let Some(client_side) = upgrade.take() {
        let owner_side = hyper::upgrade::on(&mut res);
        let node = node.clone();
        tokio::spawn(async move {
            let (Ok(client), Ok(owner)) = (client_side.await, owner_side.await) else { return };
            let (mut client, mut owner) = (TokioIo::new(client), TokioIo::new(owner));
            match tokio::io::copy_bidirectional(&mut client, &mut owner).await {
                Ok((up, down)) => {
                    let bytes = &node.metrics.relay_bytes;
                    bytes.fetch_add(up + down, std::sync::atomic::Ordering::Relaxed);
                }
                Err(e) => tracing::debug!("forwarded relay ended: {e}"),
            }
        });
    }
    // The peer served (and recorded) the call.
    res.extensions_mut().insert(super::audited::Passed);
    Ok(res.map(Body::new))
}

/// Serves one peer's forwarded HTTP/1.1 connection with this node's router, upgrades included.
pub async fn serve_forwarded(router: axum::Router, stream: PeerStream) {
    let service = hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
        tower::ServiceExt::oneshot(router.clone(), req.map(Body::new))
    });
    // One request per stream (the caller opens one per call), its head within a bound; polled
    // in place when a request's body wakes it, as the listener's connections are.
    let served = crate::in_place::in_place(
        hyper::server::conn::http1::Builder::new()
            .keep_alive(false)
            .timer(hyper_util::rt::TokioTimer::new())
            .header_read_timeout(std::time::Duration::from_secs(30))
            .serve_connection(TokioIo::new(stream), service)
            .with_upgrades(),
    )
    .await;
    if let Err(e) = served {
        tracing::debug!("a peer's forwarded connection: {e}");
    }
}

/// A peer that may answer in a moment: 503, where an unreachable one is 502.
fn try_again(message: String) -> NodeError {
    NodeError { status: Some(503), ..NodeError::new(Code::PeerUnavailable, message) }
}
