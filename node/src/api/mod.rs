//! The HTTP layer: routes, authentication, request parsing, and JSON shapes. Handlers turn HTTP
//! into typed calls on [`Node`] and its results into JSON; every failure is a [`NodeError`],
//! mapped to its status here ([`status`]). `edge` sends calls on sandboxes held elsewhere to
//! their owner, `relay` is the data plane, `openapi` the document.
//!
//! Auth: `Authorization: Bearer <token>`, resolved by the controller (`Node::principal`,
//! `Node::authorized`). Node routes need the root token (when one is configured). Sandbox
//! routes take that sandbox's own token, its tenant's key, or the root token; anything else
//! answers the same 404 as an unknown id. Every call that changes something is recorded
//! (`audited`); what a request may cost is bounded (`limit`).

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::{DefaultBodyLimit, FromRef, Path, RawQuery, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get, post};
use serde_json::Value;
use silk_proto::{Command, Connection, ExecRequest, Frame};

use crate::claims::{ClaimRecord, ClaimRequest, ClaimSpec, checked_ttl};
use crate::error::{Code, NodeError};
use crate::fleet::Peers;
use crate::node::{Claimed, Node, detached};
use body::optional as optional_json;
pub use body::{JsonBody, OptionalJsonBody};

pub(crate) mod audited;
mod body;
mod claim;
pub mod edge;
mod fleetwide;
mod lifecycle;
pub mod limit;
pub mod mcp;
pub mod openapi;
mod ports;
pub mod previews;
pub mod relay;
mod templates;
mod tenants;

/// What the handlers reach: the controller, and the mesh when this node is in one.
#[derive(Debug, Clone)]
pub struct Api {
    pub node: Arc<Node>,
    pub peers: Option<Arc<Peers>>,
    /// Lookups of sandboxes held elsewhere, per client.
    pub lookups: Arc<limit::PerClient>,
}

impl FromRef<Api> for Arc<Node> {
    fn from_ref(api: &Api) -> Arc<Node> {
        api.node.clone()
    }
}

type Shared = State<Arc<Node>>;

pub fn router(node: Arc<Node>, peers: Option<Arc<Peers>>) -> Router {
    let limit = node.cfg.max_body_bytes;
    let lookups = limit::PerClient::new(node.cfg.lookups_per_minute, node.cfg.lookup_burst);
    let api = Api { node, peers, lookups: Arc::new(lookups) };
    // Calls on one sandbox: served here, or sent to the node that holds it (see `edge`).
    let sandbox = Router::new()
        .route("/v1/sandboxes/{id}", get(get_one).delete(release))
        .route("/v1/sandboxes/{id}/renew", post(renew))
        .route("/v1/sandboxes/{id}/exec", post(exec))
        .route("/v1/sandboxes/{id}/hibernate", post(lifecycle::hibernate))
        .route("/v1/sandboxes/{id}/wake", post(lifecycle::wake))
        .route("/v1/sandboxes/{id}/archive", post(lifecycle::archive))
        .route("/v1/sandboxes/{id}/checkpoint", post(lifecycle::checkpoint))
        .route("/v1/sandboxes/{id}/checkpoints", get(lifecycle::sandbox_checkpoints))
        .route("/v1/sandboxes/{id}/fork", post(lifecycle::fork))
        .route("/v1/sandboxes/{id}/promote", post(lifecycle::promote))
        .route("/v1/sandboxes/{id}/move", post(lifecycle::move_sandbox))
        .route("/v1/sandboxes/{id}/agent", get(relay::agent))
        .route("/v1/sandboxes/{id}/ports/{port}", any(ports::proxy_root))
        .route("/v1/sandboxes/{id}/ports/{port}/", any(ports::proxy_root))
        .route("/v1/sandboxes/{id}/ports/{port}/{*path}", any(ports::proxy))
        .route("/v1/sandboxes/{id}/previews", post(previews::create))
        .route("/v1/sandboxes/{id}/previews/{token}", axum::routing::delete(previews::revoke))
        .route_layer(axum::middleware::from_fn_with_state(api.clone(), edge::owner));
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/metrics", get(metrics))
        .route("/v1/openapi.json", get(openapi_document))
        .route("/v1/info", get(info))
        .route("/v1/peers", get(mesh_peers))
        .route("/v1/pools", get(get_pools).put(put_pools))
        .route("/v1/drain", post(drain_on).delete(drain_off))
        .route("/v1/sandboxes", post(claim::claim).get(fleetwide::list))
        .merge(sandbox)
        .route("/v1/checkpoints", get(lifecycle::all_checkpoints))
        .route(
            "/v1/checkpoints/{id}",
            get(lifecycle::get_checkpoint).delete(lifecycle::delete_checkpoint),
        )
        .route("/v1/checkpoints/{id}/claim", post(lifecycle::branch))
        .route("/v1/tenants", post(tenants::create).get(tenants::list))
        .route(
            "/v1/tenants/{name}",
            get(tenants::get).patch(tenants::patch).delete(tenants::delete),
        )
        .route("/v1/tenants/{name}/rotate", post(tenants::rotate))
        .route("/v1/templates", get(templates::list).post(templates::register))
        .route("/v1/templates/{name}", get(templates::get).delete(templates::delete))
        .route("/v1/templates/{name}/refresh", post(templates::refresh))
        .route("/v1/audit", get(fleetwide::audit))
        .route("/v1/usage", get(fleetwide::usage))
        .route("/v1/fleet", get(fleetwide::fleet_view))
        .fallback(|| async { NodeError::new(Code::NoRoute, "no such route") })
        .method_not_allowed_fallback(|| async {
            NodeError::new(Code::MethodNotAllowed, "method not allowed on this route")
        })
        .layer(axum::middleware::from_fn_with_state(api.clone(), audited::record))
        .layer(DefaultBodyLimit::max(limit))
        .layer(axum::middleware::from_fn_with_state(limit, limit::refuse_oversized))
        .with_state(api)
}

pub fn bearer(headers: &HeaderMap) -> Option<&str> {
    headers.get(header::AUTHORIZATION)?.to_str().ok()?.strip_prefix("Bearer ").map(str::trim)
}

fn root(node: &Node, headers: &HeaderMap) -> Result<(), NodeError> {
    if node.is_root(bearer(headers)) { Ok(()) } else { Err(NodeError::unauthorized()) }
}

/// The HTTP status of each error code: the one place they are mapped.
pub fn status(e: &NodeError) -> StatusCode {
    use Code::*;
    if let Some(status) = e.status.and_then(|s| StatusCode::from_u16(s).ok()) {
        return status;
    }
    match e.code {
        BadRequest => StatusCode::BAD_REQUEST,
        Unauthorized => StatusCode::UNAUTHORIZED,
        EgressWider => StatusCode::FORBIDDEN,
        NotFound | TemplateNotFound | PeerNotFound | NoRoute | ImageNotFound => {
            StatusCode::NOT_FOUND
        }
        RegistryDenied => StatusCode::FORBIDDEN,
        MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
        Conflict | BaseUnavailable | MemorySnapshotFailed => StatusCode::CONFLICT,
        NodeFull | QuotaExceeded | RateLimited => StatusCode::TOO_MANY_REQUESTS,
        Draining | Moving | AgentUnavailable | SandboxNotReady | StoreUnavailable => {
            StatusCode::SERVICE_UNAVAILABLE
        }
        InsufficientStorage => StatusCode::INSUFFICIENT_STORAGE,
        PayloadTooLarge | ImageTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
        UnsupportedMediaType => StatusCode::UNSUPPORTED_MEDIA_TYPE,
        UpgradeRequired => StatusCode::UPGRADE_REQUIRED,
        PeerUnavailable | PortClosed | MoveRefused | StoreRefused | RegistryUnavailable
        | ImageDigestMismatch => StatusCode::BAD_GATEWAY,
        BadTemplate | Invalid | WarmupFailed | ExecFailed | ImagePlatform | ImageUnsafe
        | ImageUnsupported => StatusCode::UNPROCESSABLE_ENTITY,
        Unsupported => StatusCode::NOT_IMPLEMENTED,
        EngineFailed | StoreCorrupt | StoreFailed | Internal => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

impl axum::response::IntoResponse for NodeError {
    fn into_response(self) -> axum::response::Response {
        (status(&self), axum::Json(self.body())).into_response()
    }
}

fn row(node: &Node, r: &ClaimRecord) -> silk_api::Sandbox {
    let memory = node.memory_of(&r.id);
    silk_api::Sandbox {
        id: r.id.clone(),
        template: r.template.clone(),
        size: r.size,
        lane: r.lane,
        tier: r.tier.into(),
        state: r.state(),
        owner: node.cfg.listen.to_string(),
        created_ms: r.created_ms,
        deadline_ms: r.deadline_ms,
        on_expire: r.on_expire,
        metadata: r.metadata.clone(),
        agent_path: format!("/v1/sandboxes/{}/agent", r.id),
        lease_seconds: r.lease_seconds,
        state_since_ms: r.state_since_ms,
        from_checkpoint: r.from_checkpoint.clone(),
        forked_from: r.forked_from.clone(),
        memory_snapshot: memory.as_ref().map_or(node.capabilities().memory_snapshot, |m| m.kept),
        memory_note: match memory {
            Some(m) => m.why_not,
            None => node.engine_memory_why_not(),
        },
        token: None,
        claim_micros: None,
        node: None,
        egress: r.egress.clone(),
        tenant: r.tenant.clone(),
    }
}

/// A new claim's row with its token (shown this once).
fn claimed_row(node: &Node, c: &Claimed) -> silk_api::Sandbox {
    silk_api::Sandbox {
        token: Some(c.token.clone()),
        claim_micros: Some(c.took.as_micros() as u64),
        ..row(node, &c.record)
    }
}

/// A route's one boolean query parameter `name` (absent: false). Read by hand, not by axum's
/// query extractor, so a bad value is our JSON 400, not its plain-text one.
fn flag(query: Option<&str>, name: &str) -> Result<bool, NodeError> {
    let query = query.unwrap_or("");
    match query.split_once('=') {
        None if query.is_empty() => Ok(false),
        Some((n, "true")) if n == name => Ok(true),
        Some((n, "false")) if n == name => Ok(false),
        _ => Err(NodeError::bad_request(format!("query {query:?}: only {name}=true"))),
    }
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let hex = |c: u8| (c as char).to_digit(16);
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%'
            && i + 3 <= b.len()
            && let (Some(hi), Some(lo)) = (hex(b[i + 1]), hex(b[i + 2]))
        {
            out.push((hi * 16 + lo) as u8);
            i += 3;
            continue;
        }
        out.push(if b[i] == b'+' { b' ' } else { b[i] });
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

async fn get_one(
    State(node): Shared,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<axum::Json<silk_api::Sandbox>, NodeError> {
    let live = node.authorized(&id, bearer(&headers))?;
    Ok(axum::Json(row(&node, &live.record)))
}

async fn release(
    State(node): Shared,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<StatusCode, NodeError> {
    node.authorized(&id, bearer(&headers))?;
    let n = node.clone();
    detached(async move { n.release(&id).await }).await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn renew(
    State(node): Shared,
    headers: HeaderMap,
    Path(id): Path<String>,
    JsonBody(req): JsonBody<silk_api::RenewRequest>,
) -> Result<axum::Json<silk_api::Renewed>, NodeError> {
    node.authorized(&id, bearer(&headers))?;
    let ttl = checked_ttl(req.ttl_seconds, node.cfg.default_ttl_seconds, node.cfg.max_ttl_seconds)?;
    let n = node.clone();
    let record = detached(async move { n.renew(&id, ttl).await }).await?;
    Ok(axum::Json(silk_api::Renewed { id: record.id, deadline_ms: record.deadline_ms }))
}

/// Buffered exec for clients that cannot hold an upgraded connection. The audit journal gets
/// its program (its whole argv with `audit_exec_args`).
async fn exec(
    State(node): Shared,
    headers: HeaderMap,
    Path(id): Path<String>,
    JsonBody(req): JsonBody<silk_api::ExecRequest>,
) -> Response {
    let detail =
        if node.cfg.audit_exec_args { Some(req.argv.join(" ")) } else { req.argv.first().cloned() };
    let mut res = buffered_exec(node, headers, id, req).await.into_response();
    res.extensions_mut().insert(audited::Noted { target: None, detail });
    res
}

async fn buffered_exec(
    node: Arc<Node>,
    headers: HeaderMap,
    id: String,
    req: silk_api::ExecRequest,
) -> Result<axum::Json<silk_api::ExecResult>, NodeError> {
    node.authorized(&id, bearer(&headers))?;
    if req.argv.is_empty() {
        return Err(NodeError::bad_request("argv is empty"));
    }
    // A hibernated or archived sandbox wakes (one whose silkd died restarts): the call is
    // slower, not an error.
    let (live, stream) = node.open_agent(&id).await?;
    let _active = crate::node::Active::new(&live);
    node.metrics.execs.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let unavailable = |e: String| NodeError::new(Code::AgentUnavailable, e);
    let mut conn = Connection::new(stream);
    let timeout = req.timeout_seconds.map(|s| Duration::from_secs(s).as_millis() as u64);
    let request = Frame::Exec(ExecRequest {
        command: Command {
            argv: req.argv,
            cwd: req.cwd,
            env: req.env.into_iter().collect(),
            user: req.user,
        },
        stdin: req.stdin.is_some(),
        timeout_ms: timeout,
    });
    let io = |e: silk_proto::ProtoError| unavailable(format!("silkd: {e}"));
    conn.queue(&request).map_err(io)?;
    if let Some(input) = req.stdin {
        conn.queue(&Frame::Stdin(input.into())).map_err(io)?;
        conn.queue(&Frame::Eof).map_err(io)?;
    }
    conn.flush().await.map_err(io)?;
    let cap = node.cfg.exec_output_cap;
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let (mut out_cut, mut err_cut) = (false, false);
    loop {
        match conn.recv().await.map_err(io)? {
            Some(Frame::Stdout(b)) => keep(&mut out, &b, cap, &mut out_cut),
            Some(Frame::Stderr(b)) => keep(&mut err, &b, cap, &mut err_cut),
            Some(Frame::Exit(status)) => {
                return Ok(axum::Json(silk_api::ExecResult {
                    exit_code: status.code,
                    signal: status.signal,
                    timed_out: status.timed_out,
                    stdout: String::from_utf8_lossy(&out).into_owned(),
                    stderr: String::from_utf8_lossy(&err).into_owned(),
                    stdout_truncated: out_cut,
                    stderr_truncated: err_cut,
                }));
            }
            Some(Frame::Error(e)) => {
                let status = match e.kind {
                    // The command was well formed; the sandbox refused it (no such user, a bad `cwd`).
                    silk_proto::ErrorKind::BadRequest => StatusCode::UNPROCESSABLE_ENTITY,
                    silk_proto::ErrorKind::NotFound => StatusCode::NOT_FOUND,
                    silk_proto::ErrorKind::PermissionDenied => StatusCode::FORBIDDEN,
                    _ => StatusCode::UNPROCESSABLE_ENTITY,
                };
                let refused = NodeError::new(Code::ExecFailed, e.to_string());
                return Err(NodeError { status: Some(status.as_u16()), ..refused });
            }
            Some(_) => {}
            None => return Err(unavailable("silkd closed the connection".into())),
        }
    }
}

fn keep(buf: &mut Vec<u8>, data: &[u8], cap: usize, cut: &mut bool) {
    let room = cap.saturating_sub(buf.len());
    buf.extend_from_slice(&data[..room.min(data.len())]);
    *cut |= data.len() > room;
}

/// The mesh as this node sees it: itself and every live peer with its last state.
async fn mesh_peers(
    State(api): State<Api>,
    headers: HeaderMap,
) -> Result<axum::Json<silk_api::MeshView>, NodeError> {
    let node = &api.node;
    root(node, &headers)?;
    let Some(p) = &api.peers else {
        let view = silk_api::MeshView {
            name: node.name.clone(),
            mesh: false,
            this: None,
            peers: vec![],
            gossip_bytes_sent: None,
        };
        return Ok(axum::Json(view));
    };
    let peer_row = |name: &str, addr: String, epoch: u64, s: Option<&silk_mesh::NodeState>| {
        silk_api::PeerRow {
            name: name.to_string(),
            mesh_addr: addr,
            epoch,
            api: s.map(|s| s.api.clone()),
            public_url: s.and_then(|s| s.public.clone()),
            warm: s.map(|s| s.warm.clone()),
            goldens: s.map(|s| s.goldens.clone()),
            claims: s.map(|s| s.claims),
            capacity: s.map(|s| s.capacity),
            draining: s.map(|s| s.draining),
            version: s.map(|s| [s.epoch, s.seq]),
        }
    };
    let me = p.mesh.local();
    let peers = p
        .mesh
        .peers()
        .iter()
        .map(|peer| {
            peer_row(&peer.id.name, peer.id.addr.to_string(), peer.id.epoch, peer.state.as_ref())
        })
        .collect();
    let this = peer_row(&me.name, p.mesh.id().addr.to_string(), p.mesh.id().epoch, Some(&me));
    Ok(axum::Json(silk_api::MeshView {
        name: node.name.clone(),
        mesh: true,
        this: Some(this),
        peers,
        gossip_bytes_sent: Some(p.mesh.gossip_bytes()),
    }))
}

/// The node's report, with its place in the mesh.
fn node_info(api: &Api) -> silk_api::NodeInfo {
    let mut info = api.node.info();
    info.mesh = api.peers.as_ref().map(|p| silk_api::MeshInfo {
        addr: p.mesh.id().addr.to_string(),
        epoch: p.mesh.id().epoch,
        peers: p.mesh.peers().len() as u64,
        forward: p.forward,
    });
    info
}

async fn info(
    State(api): State<Api>,
    headers: HeaderMap,
) -> Result<axum::Json<silk_api::NodeInfo>, NodeError> {
    root(&api.node, &headers)?;
    Ok(axum::Json(node_info(&api)))
}

async fn openapi_document(State(node): Shared) -> axum::Json<Value> {
    let limits = openapi::Limits {
        max_ttl_seconds: node.cfg.max_ttl_seconds,
        max_body_bytes: node.cfg.max_body_bytes,
        api_token: node.cfg.api_token.is_some(),
        metrics_token: node.cfg.metrics_token.is_some(),
        max_warm: node.cfg.max_warm,
    };
    axum::Json(openapi::document(limits))
}

async fn metrics(State(node): Shared, headers: HeaderMap) -> Result<Response, NodeError> {
    if let Some(wanted) = &node.cfg.metrics_token {
        let given = bearer(&headers);
        let metrics =
            given.is_some_and(|t| crate::claims::constant_time_eq(t.as_bytes(), wanted.as_bytes()));
        if !metrics && !node.is_root(given) {
            return Err(NodeError::unauthorized());
        }
    }
    let text = node.render_metrics();
    Ok(([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response())
}

async fn get_pools(
    State(node): Shared,
    headers: HeaderMap,
) -> Result<axum::Json<silk_api::Pools>, NodeError> {
    root(&node, &headers)?;
    Ok(axum::Json(silk_api::Pools { pools: node.pool_configs() }))
}

async fn put_pools(
    State(node): Shared,
    headers: HeaderMap,
    JsonBody(body): JsonBody<silk_api::Pools>,
) -> Result<axum::Json<silk_api::Pools>, NodeError> {
    root(&node, &headers)?;
    node.replace_pools(body.pools)?;
    Ok(axum::Json(silk_api::Pools { pools: node.pool_configs() }))
}

async fn drain_on(
    State(api): State<Api>,
    headers: HeaderMap,
) -> Result<axum::Json<silk_api::NodeInfo>, NodeError> {
    root(&api.node, &headers)?;
    api.node.set_draining(true);
    Ok(axum::Json(node_info(&api)))
}

async fn drain_off(
    State(api): State<Api>,
    headers: HeaderMap,
) -> Result<axum::Json<silk_api::NodeInfo>, NodeError> {
    root(&api.node, &headers)?;
    api.node.set_draining(false);
    Ok(axum::Json(node_info(&api)))
}

#[cfg(test)]
mod tests {
    /// Every route in this module's source (a `.route(path, method(handler)...)` call) is in
    /// the OpenAPI document, with each of its methods.
    #[test]
    fn every_route_is_documented() {
        let doc = super::openapi::document(super::openapi::Limits {
            max_ttl_seconds: 1,
            max_body_bytes: 1,
            api_token: true,
            metrics_token: false,
            max_warm: 1,
        });
        let source = include_str!("mod.rs");
        let mut routes = 0;
        for call in source.split(".route(\"").skip(1) {
            let (path, rest) = call.split_once('"').expect("a quoted path");
            let methods = rest.split_once(')').map_or("", |(m, _)| m);
            let chained = rest.split("\n").next().unwrap_or_default();
            for method in ["get", "post", "put", "patch", "delete"] {
                let routed = methods.contains(&format!(" {method}("))
                    || chained.contains(&format!(".{method}("))
                    || chained.contains(&format!("::{method}("));
                if routed {
                    routes += 1;
                    assert!(
                        doc["paths"][path][method].is_object(),
                        "{method} {path} is routed but not documented"
                    );
                }
            }
        }
        assert!(routes >= 25, "found only {routes} routes: the scan is broken");
    }
}
