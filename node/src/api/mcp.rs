//! `/mcp`: the SDK's MCP server (`silkmesh::mcp`) over streamable HTTP, stateless: each request
//! stands alone, and its tools act with the caller's own key (root or a tenant's) through an
//! SDK client aimed at this node's own listener, so they get what every SDK user gets
//! (redirects to the node that holds a sandbox, the same authorization, typed errors).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use silkmesh::Client;
use silkmesh::mcp::Tools;
use silkmesh::mcp::rmcp::transport::streamable_http_server::session::never::NeverSessionManager;
use silkmesh::mcp::rmcp::transport::streamable_http_server::{
    StreamableHttpServerConfig, StreamableHttpService,
};

use super::bearer;
use crate::error::NodeError;
use crate::node::{Node, Principal};

/// SDK clients kept per caller's key (each holds its pooled connections).
const CLIENTS: usize = 64;

/// `router` with `/mcp`, whose SDK clients reach this node at `local` (its listener's address).
pub fn with_mcp(router: Router, node: Arc<Node>, local: SocketAddr) -> Router {
    let host = match local.ip() {
        ip if ip.is_unspecified() => std::net::Ipv4Addr::LOCALHOST.into(),
        ip => ip,
    };
    let url = match &node.cfg.tls {
        Some(_) => format!("https://{}", SocketAddr::new(host, local.port())),
        None => format!("http://{}", SocketAddr::new(host, local.port())),
    };
    // The node's own certificate chain is what the client trusts on its way back in.
    let ca = node.cfg.tls.as_ref().map(|t| t.cert.clone());
    let clients: Arc<Mutex<HashMap<String, Client>>> = Arc::default();
    let make = move |token: Option<&str>| -> Result<Client, silkmesh::Error> {
        let key = token.unwrap_or_default().to_string();
        let mut cache = clients.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(c) = cache.get(&key) {
            return Ok(c.clone());
        }
        let mut b = Client::builder(url.clone());
        if let Some(t) = token {
            b = b.token(t);
        }
        if let Some(ca) = &ca {
            b = b.ca_file(ca.clone());
        }
        let client = b.build()?;
        if cache.len() >= CLIENTS {
            cache.clear();
        }
        cache.insert(key, client.clone());
        Ok(client)
    };
    let config = StreamableHttpServerConfig::default()
        .with_legacy_session_mode(false)
        .with_json_response(true)
        // Callers carry a key; a browser page cannot send one across sites without CORS.
        .disable_allowed_hosts();
    // One server for every request (stateless), so its sandbox handles outlive each.
    let tools = Tools::per_caller(make);
    let service = StreamableHttpService::new(
        move || Ok(tools.clone()),
        NeverSessionManager::default().into(),
        config,
    );
    let mcp = Router::new()
        .nest_service("/mcp", service)
        .layer(axum::middleware::from_fn_with_state(node, require_key));
    router.merge(mcp)
}

/// `/mcp` answers only root and tenants (a sandbox's own token has its own routes).
async fn require_key(State(node): State<Arc<Node>>, req: Request, next: Next) -> Response {
    match node.principal(bearer(req.headers())) {
        Principal::Nobody => NodeError::unauthorized().into_response(),
        Principal::Root | Principal::Tenant(_) => next.run(req).await,
    }
}
