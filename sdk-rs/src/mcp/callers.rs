//! Who a tool call acts as (one fixed key, or each caller's bearer token) and the sandbox
//! handles kept per caller so that later calls reuse their relay connections.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use rmcp::RoleServer;
use rmcp::model::CallToolResult;
use rmcp::service::RequestContext;

use super::Session;
use super::output::failed;
use crate::{Client, Error, Sandbox};

/// Makes the SDK client of a caller's bearer token.
type MakeClient = dyn Fn(Option<&str>) -> Result<Client, Error> + Send + Sync;

/// Where a tool call's SDK client comes from.
#[derive(Clone)]
pub(super) enum Clients {
    /// One client for the whole server (stdio: the key `sbx` was given).
    Fixed(Client),
    /// The caller's own key, from its request (the node's `/mcp`): a client per key, made by
    /// this function from the bearer token (none: the node takes calls without one).
    PerCaller(Arc<MakeClient>),
}

/// Handles on sandboxes the server has used, by caller (its token; empty for a fixed client)
/// and id: a later call reuses the handle's relay connections instead of looking the sandbox
/// up and dialling again (a handle is only a name and a connection pool: a sandbox released or
/// moved meanwhile answers through it as through a new one).
type Handles = Mutex<HashMap<(String, String), Sandbox>>;
/// Handles kept at most (all dropped beyond it).
const HANDLES: usize = 1024;

/// The MCP server: the tools, and where their SDK client comes from.
#[derive(Clone)]
pub struct Tools {
    pub(super) clients: Clients,
    pub(super) session: Option<Arc<Session>>,
    handles: Arc<Handles>,
}

impl std::fmt::Debug for Tools {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let clients = match &self.clients {
            Clients::Fixed(c) => c.url().to_string(),
            Clients::PerCaller(_) => "per caller".into(),
        };
        f.debug_struct("Tools").field("clients", &clients).finish_non_exhaustive()
    }
}

impl Tools {
    /// A server acting with `client`'s key; `session` (stdio) keeps what it creates alive.
    pub fn new(client: Client, session: Option<Arc<Session>>) -> Tools {
        Tools { clients: Clients::Fixed(client), session, handles: Arc::default() }
    }

    /// A server acting with each caller's bearer token, the client made by `make`.
    pub fn per_caller(
        make: impl Fn(Option<&str>) -> Result<Client, Error> + Send + Sync + 'static,
    ) -> Tools {
        Tools {
            clients: Clients::PerCaller(Arc::new(make)),
            session: None,
            handles: Arc::default(),
        }
    }

    pub(super) fn client(
        &self,
        ctx: &RequestContext<RoleServer>,
    ) -> Result<Client, CallToolResult> {
        self.caller(ctx).map(|(client, _)| client)
    }

    /// The caller's SDK client and who it is (its token; empty for a fixed client).
    pub(super) fn caller(
        &self,
        ctx: &RequestContext<RoleServer>,
    ) -> Result<(Client, String), CallToolResult> {
        match &self.clients {
            Clients::Fixed(c) => Ok((c.clone(), String::new())),
            Clients::PerCaller(make) => {
                let token = ctx
                    .extensions
                    .get::<::http::request::Parts>()
                    .and_then(|p| p.headers.get("authorization"))
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.strip_prefix("Bearer "))
                    .map(str::trim);
                let client = make(token).map_err(failed)?;
                Ok((client, token.unwrap_or_default().to_string()))
            }
        }
    }

    fn handles(&self) -> std::sync::MutexGuard<'_, HashMap<(String, String), Sandbox>> {
        self.handles.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) async fn sandbox(
        &self,
        ctx: &RequestContext<RoleServer>,
        id: &str,
    ) -> Result<Sandbox, CallToolResult> {
        let (client, who) = self.caller(ctx)?;
        let key = (who, id.to_string());
        if let Some(sb) = self.handles().get(&key) {
            return Ok(sb.clone());
        }
        let sb = client.sandbox(id, None).await.map_err(failed)?;
        let mut handles = self.handles();
        if handles.len() >= HANDLES {
            handles.clear();
        }
        handles.insert(key, sb.clone());
        Ok(sb)
    }

    pub(super) fn forget(&self, id: &str) {
        self.handles().retain(|(_, held), _| held != id);
    }

    pub(super) fn remember(&self, sandboxes: &[&Sandbox], keep: bool) {
        if let Some(s) = &self.session {
            for sb in sandboxes {
                s.created(sb.id(), sb.info().lease_seconds, keep);
            }
        }
    }
}
