//! E2B's API, so the stock e2b SDKs (Python, JavaScript) drive this node's sandboxes: the
//! control plane (`/sandboxes`, `/v2/sandboxes`, …; JSON, `X-API-Key`) and envd, the agent
//! API the SDKs reach inside a sandbox (Connect RPCs `process.Process/*` and
//! `filesystem.Filesystem/*` with the JSON codec, plus `/files` and `/health`), served from one
//! listener: envd calls are the ones that carry `E2b-Sandbox-Id`. Both planes call the
//! controller ([`Node`]) and silkd; there is no second agent in the sandbox. docs/e2b.md has
//! the mapping.
//!
//! Auth: `X-API-Key` is the root token or a tenant's key (`Node::principal`); a sandbox's envd
//! calls carry `X-Access-Token`, the `envdAccessToken` its create answered: a keyed blake3 of
//! its id under a key derived from the root token, so any node of the fleet checks it without
//! storing it.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};

use crate::fleet::Peers;
use crate::node::Node;

pub mod connect;
mod control;
mod copies;
mod envd;
mod files;
pub mod mesh;
mod process;
mod procs;
mod watch;

/// What the handlers reach. (Its `Debug` leaves out the key access tokens are made with.)
#[derive(Clone)]
pub struct E2b {
    pub node: Arc<Node>,
    /// The mesh, when the node is in one: calls on a peer's sandbox go there (`mesh.rs`).
    peers: Option<Arc<Peers>>,
    token_key: [u8; 32],
    /// Each sandbox's `envVars` from its create: the default environment of its commands.
    /// Kept in memory: a node restart forgets them (noted in docs/e2b.md).
    envs: Arc<Mutex<HashMap<String, BTreeMap<String, String>>>>,
    /// The commands envd started, while they run.
    procs: Arc<procs::Procs>,
    /// Directory watches, polled.
    watchers: Arc<watch::Watchers>,
}

/// The `envdVersion` reported: the highest whose gated SDK features are all served (see
/// e2b/envd/versions.py): commands' stdin flag (0.3.0), the default user (0.4.0),
/// `CloseStdin` (0.5.2) and octet-stream uploads, gzip ones included (0.5.7). Files' metadata
/// (0.6.2) is not served.
pub const ENVD_VERSION: &str = "0.5.7";

impl std::fmt::Debug for E2b {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("E2b").field("node", &self.node.name).finish_non_exhaustive()
    }
}

impl E2b {
    pub fn new(node: Arc<Node>, peers: Option<Arc<Peers>>) -> E2b {
        let secret = node.cfg.api_token.clone().unwrap_or_default();
        let token_key = blake3::derive_key("silkmesh e2b envd access token v1", secret.as_bytes());
        E2b {
            node,
            peers,
            token_key,
            envs: Arc::default(),
            procs: Arc::default(),
            watchers: Arc::default(),
        }
    }

    /// A copy's commands get its source's `envVars`.
    fn inherit_envs(&self, from: &str, to: &str) {
        let mut envs = self.envs.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(e) = envs.get(from).cloned() {
            envs.insert(to.to_string(), e);
        }
    }

    /// The `envdAccessToken` of sandbox `id`.
    pub fn access_token(&self, id: &str) -> String {
        format!("ea_{}", blake3::keyed_hash(&self.token_key, id.as_bytes()).to_hex())
    }

    /// Whether `token` is sandbox `id`'s access token (compared in constant time).
    fn access_ok(&self, id: &str, token: Option<&str>) -> bool {
        let Some(token) = token.and_then(|t| t.strip_prefix("ea_")) else { return false };
        let Ok(given) = blake3::Hash::from_hex(token) else { return false };
        given == blake3::keyed_hash(&self.token_key, id.as_bytes())
    }
}

/// Both planes. Paths both define (`/health`) go to envd when the call names a sandbox. In a
/// mesh, a call on a peer's sandbox is forwarded there (`mesh.rs`); the same router serves the
/// calls peers forward here (under [`mesh::PREFIX`]), so both share one process table.
pub fn router(node: Arc<Node>, peers: Option<Arc<Peers>>) -> Router {
    let limit = node.cfg.max_body_bytes;
    let e2b = E2b::new(node, peers);
    control::routes()
        .merge(envd::routes())
        .merge(files::routes())
        .fallback(|| async { control::error(StatusCode::NOT_FOUND, "no such route") })
        .layer(axum::middleware::from_fn_with_state(e2b.clone(), mesh::owner))
        .layer(axum::middleware::from_fn_with_state(e2b.clone(), audit))
        .layer(axum::extract::DefaultBodyLimit::max(limit))
        .with_state(e2b)
}

/// Every call that can change something is one audit line, as on the native API: who (the
/// principal of `X-API-Key`, or `sandbox:<id>` for an envd call carrying that sandbox's access
/// token), the action (`e2b.create`, `e2b.kill`, `e2b.pause`, `e2b.Start`, `e2b.write_files`,
/// …), the sandbox or snapshot, and the answer's status.
async fn audit(
    axum::extract::State(e2b): axum::extract::State<E2b>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    use axum::http::Method;
    let method = req.method().clone();
    if matches!(method, Method::GET | Method::HEAD) {
        return next.run(req).await;
    }
    let route =
        req.extensions().get::<axum::extract::MatchedPath>().map(|m| m.as_str().to_string());
    let path = req.uri().path().to_string();
    let headers = req.headers();
    let sandbox = header(headers, "e2b-sandbox-id").map(str::to_string);
    let (principal, tenant) = match &sandbox {
        Some(id) if e2b.access_ok(id, header(headers, "x-access-token")) => {
            let tenant = e2b.node.get(id).and_then(|l| l.record.tenant.clone());
            (format!("sandbox:{id}"), tenant)
        }
        Some(_) => ("anonymous".to_string(), None),
        None => crate::api::audited::principal(&e2b.node, header(headers, "x-api-key"), None),
    };
    // The `{id}` of the route, from the same position in the path.
    let named = route.as_deref().and_then(|r| {
        r.split('/').zip(path.split('/')).find(|(p, _)| *p == "{id}").map(|(_, v)| v.to_string())
    });
    let last = path.rsplit('/').next().unwrap_or_default();
    let action = match (method.as_str(), route.as_deref().unwrap_or_default()) {
        ("POST", "/sandboxes" | "/v2/sandboxes") => "create".to_string(),
        ("DELETE", "/sandboxes/{id}") => "kill".to_string(),
        ("DELETE", "/templates/{id}") => "delete_snapshot".to_string(),
        ("POST", "/files") => "write_files".to_string(),
        _ => last.to_string(),
    };
    let res = next.run(req).await;
    if res.extensions().get::<crate::api::audited::Passed>().is_some() {
        return res; // forwarded: the owner recorded it
    }
    e2b.node.audit.record(silk_api::AuditEntry {
        time_ms: crate::node::now_ms(),
        node: e2b.node.name.clone(),
        principal,
        tenant,
        action: format!("e2b.{action}"),
        target: sandbox.or(named),
        status: res.status().as_u16(),
        detail: None,
    });
    res
}

pub(crate) fn header<'h>(headers: &'h HeaderMap, name: &str) -> Option<&'h str> {
    headers.get(name).and_then(|v| v.to_str().ok())
}

/// An error as E2B's HTTP answers carry it: `{"code": <status>, "message"}` (the SDK parses
/// that body before it looks at the status).
#[derive(Debug)]
pub struct HttpError {
    pub status: StatusCode,
    pub message: String,
}

impl HttpError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> HttpError {
        HttpError { status, message: message.into() }
    }
}

impl IntoResponse for HttpError {
    fn into_response(self) -> Response {
        let body = serde_json::json!({ "code": self.status.as_u16(), "message": self.message });
        json(self.status, body)
    }
}

/// A JSON answer with `status`.
pub(crate) fn json(status: StatusCode, body: serde_json::Value) -> Response {
    (status, axum::Json(body)).into_response()
}
