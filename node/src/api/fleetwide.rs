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

use super::Api;

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
