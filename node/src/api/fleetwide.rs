//! Views of the whole fleet from any node: the sandboxes list, the audit journal and `/v1/fleet`
//! gather each live peer's own view (the same route with `scope=node`, over the mesh, with the
//! caller's token, so each peer answers for what that caller may see) and merge them with this
//! node's. A peer that does not answer within [`PEER_TIMEOUT`] is named in the answer's
//! `unreachable`, never silently left out.

use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderMap, HeaderValue, Method, Request, header};
use http_body_util::BodyExt;
use hyper_util::rt::TokioIo;
use serde::de::DeserializeOwned;
use tokio::task::JoinSet;

use super::{Api, NodeError, RawQuery, State, bearer, node_info, percent_decode, root, row};

/// How long a peer has to answer a gathered view.
pub const PEER_TIMEOUT: Duration = Duration::from_secs(3);
/// The largest answer taken from one peer.
const MAX_ANSWER: usize = 64 << 20;

/// Whether the caller asked for this node's view only.
pub fn node_only(query: Option<&str>) -> bool {
    query.is_some_and(|q| q.split('&').any(|p| p == "scope=node"))
}

/// `path_and_query` of this node's route asked of every live peer (with `scope=node` added and
/// the caller's `Authorization`): each peer's answer by name, and the names of those that did
/// not give one.
pub async fn gather<T: DeserializeOwned + Send + 'static>(
    api: &Api,
    path_and_query: &str,
    headers: &HeaderMap,
) -> (Vec<(String, T)>, Vec<String>) {
    let Some(peers) = api.peers.clone() else { return (vec![], vec![]) };
    let sep = if path_and_query.contains('?') { '&' } else { '?' };
    let uri = format!("{path_and_query}{sep}scope=node");
    let auth = headers.get(header::AUTHORIZATION).cloned();
    let mut set = JoinSet::new();
    for peer in peers.mesh.peers().iter().cloned() {
        let (peers, uri, auth) = (peers.clone(), uri.clone(), auth.clone());
        set.spawn(async move {
            let asked = async {
                let stream = peers.open_http(&peer).await.map_err(|e| e.message)?;
                let (mut sender, conn) =
                    hyper::client::conn::http1::handshake(TokioIo::new(stream))
                        .await
                        .map_err(|e| e.to_string())?;
                tokio::spawn(conn);
                let mut req = Request::builder().method(Method::GET).uri(&uri);
                if let Some(auth) = auth {
                    req = req.header(header::AUTHORIZATION, auth);
                }
                let req = req
                    .header(header::HOST, HeaderValue::from_static("peer"))
                    .body(Body::empty())
                    .map_err(|e| e.to_string())?;
                let res = sender.send_request(req).await.map_err(|e| e.to_string())?;
                if !res.status().is_success() {
                    return Err(format!("answered {}", res.status()));
                }
                let body = http_body_util::Limited::new(res.into_body(), MAX_ANSWER)
                    .collect()
                    .await
                    .map_err(|e| e.to_string())?
                    .to_bytes();
                serde_json::from_slice::<T>(&body).map_err(|e| e.to_string())
            };
            let answer = match tokio::time::timeout(PEER_TIMEOUT, asked).await {
                Ok(answer) => answer,
                Err(_) => Err("no answer in time".to_string()),
            };
            (peer.id.name.clone(), answer)
        });
    }
    let (mut answers, mut unreachable) = (vec![], vec![]);
    while let Some(joined) = set.join_next().await {
        match joined {
            Ok((name, Ok(answer))) => answers.push((name, answer)),
            Ok((name, Err(e))) => {
                tracing::debug!(peer = name, "fleet view: {e}");
                unreachable.push(name);
            }
            Err(e) => tracing::warn!("fleet view task: {e}"),
        }
    }
    answers.sort_by(|a, b| a.0.cmp(&b.0));
    unreachable.sort();
    (answers, unreachable)
}

/// The order lists are paged in, and the cursor that names a row's place in it.
pub fn cursor_of(s: &silk_api::Sandbox) -> String {
    format!("{:016x}-{}", s.created_ms, s.id)
}

/// `rows` in list order (oldest first, then by id, each id once), from after `cursor`, at most
/// `limit`; and the cursor of the next page when more rows follow.
pub fn page(
    mut rows: Vec<silk_api::Sandbox>,
    cursor: Option<&str>,
    limit: usize,
) -> (Vec<silk_api::Sandbox>, Option<String>) {
    rows.sort_by_cached_key(cursor_of);
    // A sandbox moving between nodes can be listed by both for a moment.
    rows.dedup_by(|a, b| a.id == b.id);
    if let Some(c) = cursor {
        rows.retain(|r| cursor_of(r).as_str() > c);
    }
    let next = (rows.len() > limit).then(|| cursor_of(&rows[limit - 1]));
    rows.truncate(limit);
    (rows, next)
}

// ---- the routes ----

/// The query's `name=value` pairs (values still encoded), but for those every such route takes
/// (`no_redirect`: a retried redirect; `scope`: see [`node_only`]); a name not in `known` is a
/// `400`.
fn params<'q>(
    query: Option<&'q str>,
    known: &[&str],
) -> Result<Vec<(&'q str, &'q str)>, NodeError> {
    let mut out = vec![];
    for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
        match name {
            "no_redirect" => {}
            "scope" if value == "node" => {}
            "scope" => return Err(NodeError::bad_request("scope: only scope=node")),
            _ if known.contains(&name) => out.push((name, value)),
            _ => return Err(NodeError::bad_request(format!("unknown query parameter {name:?}"))),
        }
    }
    Ok(out)
}

fn number(name: &str, value: &str) -> Result<u64, NodeError> {
    value.parse().map_err(|_| NodeError::bad_request(format!("{name}: a number")))
}

/// `GET /v1/sandboxes?metadata=key=value&…&limit=&cursor=&scope=node`: the caller's sandboxes
/// (root: all; a tenant: its own) on every node of the mesh, or this node's with `scope=node`;
/// oldest first, at most `limit` (1-1000, default 1000) after `cursor`.
pub(super) async fn list(
    State(api): State<Api>,
    headers: HeaderMap,
    RawQuery(query): RawQuery,
) -> Result<axum::Json<silk_api::SandboxList>, NodeError> {
    let node = &api.node;
    let scope = node.principal(bearer(&headers)).scope()?;
    let (mut filter, mut filters, mut limit, mut cursor) = (vec![], vec![], None, None);
    for (name, value) in params(query.as_deref(), &["limit", "cursor", "metadata"])? {
        match name {
            "limit" => match value.parse::<usize>() {
                Ok(n @ 1..=1000) => limit = Some(n),
                _ => return Err(NodeError::bad_request("limit is 1-1000")),
            },
            "cursor" => cursor = Some(percent_decode(value)),
            _ => {
                let decoded = percent_decode(value);
                // A key is never empty (the document's pattern, and claims refuse one).
                let (k, v) = decoded
                    .split_once('=')
                    .filter(|(k, _)| !k.is_empty())
                    .ok_or_else(|| NodeError::bad_request("metadata filters are key=value"))?;
                filter.push((k.to_string(), v.to_string()));
                filters.push(format!("metadata={value}"));
            }
        }
    }
    let mut rows: Vec<silk_api::Sandbox> = node
        .list(&filter)
        .iter()
        .filter(|r| scope.is_none() || r.tenant == scope)
        .map(|r| row(node, r))
        .collect();
    let mut unreachable = vec![];
    let here_only = node_only(query.as_deref());
    if !here_only {
        let path = format!("/v1/sandboxes?{}", filters.join("&"));
        let (answers, missing) = gather::<silk_api::SandboxList>(&api, &path, &headers).await;
        rows.extend(answers.into_iter().flat_map(|(_, list)| list.sandboxes));
        unreachable = missing;
    }
    // A peer's share comes whole; pages are cut where the fleet's list is gathered.
    let limit = limit.unwrap_or(if here_only { usize::MAX } else { 1000 });
    let (sandboxes, next_cursor) = page(rows, cursor.as_deref(), limit);
    Ok(axum::Json(silk_api::SandboxList { sandboxes, next_cursor, unreachable }))
}

/// `GET /v1/fleet` (root): every node's report (this one's with `scope=node`).
pub(super) async fn fleet_view(
    State(api): State<Api>,
    headers: HeaderMap,
    RawQuery(query): RawQuery,
) -> Result<axum::Json<silk_api::FleetView>, NodeError> {
    root(&api.node, &headers)?;
    params(query.as_deref(), &[])?;
    let mut nodes = vec![node_info(&api)];
    let mut unreachable = vec![];
    if !node_only(query.as_deref()) {
        let (answers, missing) = gather::<silk_api::FleetView>(&api, "/v1/fleet", &headers).await;
        nodes.extend(answers.into_iter().flat_map(|(_, v)| v.nodes));
        unreachable = missing;
    }
    Ok(axum::Json(silk_api::FleetView { nodes, unreachable }))
}

/// `GET /v1/audit?since=<ms>&tenant=<name>&limit=<n>&scope=node`: root sees every entry (or a
/// tenant's), a tenant its own; from every node of the mesh (this one's with `scope=node`),
/// oldest first.
pub(super) async fn audit(
    State(api): State<Api>,
    headers: HeaderMap,
    RawQuery(query): RawQuery,
) -> Result<axum::Json<silk_api::AuditList>, NodeError> {
    let node = &api.node;
    let scope = node.principal(bearer(&headers)).scope()?;
    let (mut since, mut tenant, mut limit) = (0, None, 1000usize);
    for (name, value) in params(query.as_deref(), &["since", "limit", "tenant"])? {
        match name {
            "since" => since = number(name, value)?,
            "limit" => match number(name, value)? {
                n @ 1..=10_000 => limit = n as usize,
                _ => return Err(NodeError::bad_request("limit is 1-10000")),
            },
            _ => tenant = Some(percent_decode(value)),
        }
    }
    // A tenant's key reads its own entries whatever it asks for.
    let tenant = scope.or(tenant);
    let mut entries = node
        .audit
        .read(since, limit, |e| tenant.is_none() || e.tenant == tenant)
        .await
        .map_err(|e| NodeError::internal(format!("audit journal: {e}")))?;
    let mut unreachable = vec![];
    if !node_only(query.as_deref()) {
        // Each peer gets the same question (and scopes a tenant's key itself).
        let path = format!("/v1/audit?{}", query.as_deref().unwrap_or(""));
        let (answers, missing) = gather::<silk_api::AuditList>(&api, &path, &headers).await;
        entries.extend(answers.into_iter().flat_map(|(_, l)| l.entries));
        entries.sort_by(|a, b| a.time_ms.cmp(&b.time_ms).then_with(|| a.node.cmp(&b.node)));
        entries.truncate(limit);
        unreachable = missing;
    }
    Ok(axum::Json(silk_api::AuditList { entries, unreachable }))
}

/// `GET /v1/usage?tenant=&from=&to=&scope=node`: sandbox-seconds metered in `[from, to)` (unix
/// ms; default: this calendar month so far) per tenant, size and lane, summed over the fleet
/// (this node's with `scope=node`). Root sees every tenant's (and root's own) or one tenant's; a
/// tenant its own.
pub(super) async fn usage(
    State(api): State<Api>,
    headers: HeaderMap,
    RawQuery(query): RawQuery,
) -> Result<axum::Json<silk_api::UsageReport>, NodeError> {
    let node = &api.node;
    let scope = node.principal(bearer(&headers)).scope()?;
    let now = crate::node::now_ms();
    let (mut from, mut to, mut tenant) = (crate::usage::month_start(now), u64::MAX, None);
    for (name, value) in params(query.as_deref(), &["from", "to", "tenant"])? {
        match name {
            "from" => from = number(name, value)?,
            "to" => to = number(name, value)?,
            _ => tenant = Some(percent_decode(value)),
        }
    }
    let tenant = scope.or(tenant);
    let lines = node
        .usage
        .read(from, to, |t| tenant.is_none() || t == tenant.as_deref())
        .map_err(|e| NodeError::internal(format!("usage journal: {e}")))?;
    let mut sums: std::collections::BTreeMap<
        (Option<String>, silk_engine::Size, silk_engine::Lane),
        u64,
    > = Default::default();
    for l in lines {
        *sums.entry((l.tenant, l.size, l.lane)).or_default() += l.sandbox_seconds;
    }
    let mut unreachable = vec![];
    if !node_only(query.as_deref()) {
        // Each peer gets the same question (and scopes a tenant's key itself).
        let path = format!("/v1/usage?{}", query.as_deref().unwrap_or(""));
        let (answers, missing) = gather::<silk_api::UsageReport>(&api, &path, &headers).await;
        for r in answers.into_iter().flat_map(|(_, u)| u.rows) {
            *sums.entry((r.tenant, r.size, r.lane)).or_default() += r.sandbox_seconds;
        }
        unreachable = missing;
    }
    let rows = sums
        .into_iter()
        .map(|((tenant, size, lane), sandbox_seconds)| silk_api::UsageRow {
            tenant,
            size,
            lane,
            sandbox_seconds,
        })
        .collect();
    let store_bytes = match &tenant {
        Some(t) if !node_only(query.as_deref()) => Some(node.tenant_store_usage(t).await?.1),
        _ => None,
    };
    Ok(axum::Json(silk_api::UsageReport {
        from_ms: from,
        to_ms: to,
        rows,
        store_bytes,
        unreachable,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(id: &str, created_ms: u64) -> silk_api::Sandbox {
        let json = serde_json::json!({"id": id, "template": "host", "size": "small",
            "lane": "none", "tier": "warm", "state": "claimed", "owner": "n", "created_ms": created_ms,
            "deadline_ms": 1, "on_expire": "destroy", "metadata": {}, "agent_path": "/",
            "lease_seconds": 1, "state_since_ms": 1, "from_checkpoint": null,
            "forked_from": null, "memory_snapshot": false});
        serde_json::from_value(json).unwrap()
    }

    #[test]
    fn pages_walk_every_row_once_in_a_stable_order() {
        let rows = vec![row("c", 2), row("a", 1), row("b", 2), row("a", 1), row("d", 3)];
        let (first, next) = page(rows.clone(), None, 2);
        let ids = |v: &[silk_api::Sandbox]| v.iter().map(|r| r.id.clone()).collect::<Vec<_>>();
        assert_eq!(ids(&first), ["a", "b"]);
        let (second, next) = page(rows.clone(), next.as_deref(), 2);
        assert_eq!(ids(&second), ["c", "d"]);
        assert_eq!(next, None);
        // A row that appears between pages (a new claim) is not seen twice.
        let (all, _) = page(rows, None, 100);
        assert_eq!(ids(&all), ["a", "b", "c", "d"]);
    }
}
