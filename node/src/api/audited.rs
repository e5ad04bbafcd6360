//! Writing the audit journal from the HTTP layer: a middleware on every route records each call
//! that can change something (any method but `GET` and `HEAD`, and every relay opening) with its
//! caller, resolved before the call runs (a released sandbox's token cannot be checked after),
//! the route's action, its target and the answer's status. A handler adds what only it knows
//! (a claim's new id, an exec's program) as a response extension, [`Noted`]. A call this node
//! passed to a peer is recorded there, by the node that served it.

use axum::extract::{MatchedPath, Request, State};
use axum::http::Method;
use axum::middleware::Next;
use axum::response::Response;
use silk_api::AuditEntry;

use super::{Api, bearer};
use crate::node::{Node, Principal, now_ms};

/// What a handler adds to its call's audit entry.
#[derive(Debug, Clone, Default)]
pub struct Noted {
    /// The thing made (a claim's, fork's or branch's new sandboxes).
    pub target: Option<String>,
    /// An exec's program.
    pub detail: Option<String>,
}

/// Marks an answer that came from a peer (forwarded): the peer recorded the call.
#[derive(Debug, Clone, Copy)]
pub struct Passed;

/// The action a route is, by method and matched path.
fn action(method: &Method, route: &str) -> String {
    let named = match (method.as_str(), route) {
        ("POST", "/v1/sandboxes") => "claim",
        ("DELETE", "/v1/sandboxes/{id}") => "release",
        ("GET", "/v1/sandboxes/{id}/agent") => "relay",
        ("DELETE", "/v1/checkpoints/{id}") => "delete_checkpoint",
        ("POST", "/v1/checkpoints/{id}/claim") => "branch",
        ("PUT", "/v1/pools") => "pools",
        ("POST", "/v1/drain") => "drain",
        ("DELETE", "/v1/drain") => "undrain",
        ("DELETE", "/v1/templates/{name}") => "delete_template",
        ("POST", "/v1/tenants") => "create_tenant",
        ("PATCH", "/v1/tenants/{name}") => "update_tenant",
        ("DELETE", "/v1/tenants/{name}") => "delete_tenant",
        ("POST", "/v1/tenants/{name}/rotate") => "rotate_tenant",
        _ => "",
    };
    if !named.is_empty() {
        return named.to_string();
    }
    // `/v1/sandboxes/{id}/exec` → `exec`, and so on for every lifecycle verb.
    route.rsplit('/').next().unwrap_or(route).to_string()
}

/// What an audit entry says of a frame sent through the relay that runs a program: argv[0]
/// (a session's script: its first word; a terminal without a command: `/bin/sh`), or all of it
/// when `whole`. `None` for every other frame.
pub fn program(frame: &silk_proto::Frame, whole: bool) -> Option<String> {
    use silk_proto::Frame;
    let words: Vec<String> = match frame {
        Frame::Exec(r) => r.command.argv.clone(),
        Frame::Spawn(c) => c.argv.clone(),
        Frame::PtyOpen(r) if r.command.argv.is_empty() => vec!["/bin/sh".into()],
        Frame::PtyOpen(r) => r.command.argv.clone(),
        Frame::SessionExec(r) if whole => vec![r.script.clone()],
        Frame::SessionExec(r) => r.script.split_whitespace().take(1).map(String::from).collect(),
        _ => return None,
    };
    Some(if whole { words.join(" ") } else { words.into_iter().next().unwrap_or_default() })
}

/// Who `bearer` is for this call (`id`: the sandbox the route names, if any).
pub fn principal(node: &Node, bearer: Option<&str>, id: Option<&str>) -> (String, Option<String>) {
    match node.principal(bearer) {
        Principal::Root => ("root".into(), None),
        Principal::Tenant(t) => (format!("tenant:{t}"), Some(t)),
        Principal::Nobody => {
            let own = id.and_then(|id| node.get(id)).filter(|l| {
                bearer.is_some_and(|t| crate::claims::token_matches(t, &l.record.token_hash))
            });
            match own {
                Some(l) => (format!("sandbox:{}", l.record.id), l.record.tenant.clone()),
                None => ("anonymous".into(), None),
            }
        }
    }
}

pub async fn record(State(api): State<Api>, req: Request, next: Next) -> Response {
    let method = req.method().clone();
    let route = req.extensions().get::<MatchedPath>().map(|m| m.as_str().to_string());
    let relay = route.as_deref().is_some_and(|r| r.ends_with("/agent"));
    let Some(route) = route.filter(|_| relay || !matches!(method, Method::GET | Method::HEAD))
    else {
        return next.run(req).await;
    };
    // The `{id}` or `{name}` of the route, from the same position in the path.
    let target = route
        .split('/')
        .zip(req.uri().path().split('/'))
        .find(|(pattern, _)| pattern.starts_with('{'))
        .map(|(_, value)| value.to_string());
    let id = route.starts_with("/v1/sandboxes/{id}").then_some(target.as_deref()).flatten();
    let (who, tenant) = principal(&api.node, bearer(req.headers()), id);
    let res = next.run(req).await;
    if res.extensions().get::<Passed>().is_some() {
        return res;
    }
    let noted = res.extensions().get::<Noted>().cloned().unwrap_or_default();
    api.node.audit.record(AuditEntry {
        time_ms: now_ms(),
        node: api.node.name.clone(),
        principal: who,
        tenant,
        action: action(&method, &route),
        target: noted.target.or(target),
        status: res.status().as_u16(),
        detail: noted.detail,
    });
    res
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relay_frames_that_run_programs_are_named_by_their_program() {
        use silk_proto::{Command, ExecRequest, Frame};
        let command =
            Command { argv: vec!["ls".into(), "-l".into()], cwd: None, env: vec![], user: None };
        let exec =
            Frame::Exec(ExecRequest { command: command.clone(), stdin: false, timeout_ms: None });
        assert_eq!(program(&exec, false).as_deref(), Some("ls"));
        assert_eq!(program(&exec, true).as_deref(), Some("ls -l"));
        assert_eq!(program(&Frame::Spawn(command), false).as_deref(), Some("ls"));
        assert_eq!(program(&Frame::Eof, false), None);
    }

    #[test]
    fn routes_name_their_actions() {
        for (method, route, want) in [
            (Method::POST, "/v1/sandboxes", "claim"),
            (Method::DELETE, "/v1/sandboxes/{id}", "release"),
            (Method::POST, "/v1/sandboxes/{id}/exec", "exec"),
            (Method::POST, "/v1/sandboxes/{id}/hibernate", "hibernate"),
            (Method::POST, "/v1/checkpoints/{id}/claim", "branch"),
            (Method::PATCH, "/v1/tenants/{name}", "update_tenant"),
            (Method::GET, "/v1/sandboxes/{id}/agent", "relay"),
        ] {
            assert_eq!(action(&method, route), want, "{method} {route}");
        }
    }
}
