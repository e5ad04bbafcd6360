//! `POST /v1/sandboxes`: a claim, answered `201` with the new sandbox's row, or, asked with
//! the relay's upgrade, `101` with the row in a header and the connection spliced to its silkd
//! (after silkd's `info` answer, when `silk-ask: info` asked for it).

use tokio::net::UnixStream;

use super::*;
use crate::node::Live;

pub(super) async fn claim(
    State(api): State<Api>,
    headers: HeaderMap,
    RawQuery(query): RawQuery,
    relay::ClientUpgrade(upgrade): relay::ClientUpgrade,
    OptionalJsonBody(req): OptionalJsonBody<ClaimRequest>,
) -> Result<Response, NodeError> {
    let node = api.node.clone();
    let tenant = node.principal(bearer(&headers)).scope()?;
    let ask_info = relay::asks_info(&headers)?;
    let forwardable = api.peers.is_some().then(|| req.clone());
    let mut spec =
        ClaimSpec::validate(req, node.cfg.default_ttl_seconds, node.cfg.max_ttl_seconds)?;
    if !templates::visible(&spec.template, tenant.as_deref()) {
        let unknown = format!("no template {:?}", spec.template);
        return Err(NodeError::new(Code::TemplateNotFound, unknown));
    }
    spec.tenant = tenant;
    let key =
        crate::pool::PoolKey { template: spec.template.clone(), size: spec.size, lane: spec.lane };
    let peer = forwardable.as_ref().and_then(|_| edge::warm_peer(&api, &key, query.as_deref()));
    let n = node.clone();
    let offered = peer.is_some();
    let claimed = match detached(async move { n.claim_or_place(spec, offered).await }).await? {
        Some(claimed) => claimed,
        None => {
            let (peer, request) = (peer.expect("offered"), forwardable.expect("offered"));
            let upgrade = upgrade.map(|u| u.on);
            return edge::place_claim(&api, peer, &headers, &request, upgrade).await;
        }
    };
    let noted = audited::Noted { target: Some(claimed.record.id.clone()), detail: None };
    let row = claimed_row(&node, &claimed);
    // The claim stands whatever happens here: a row too large for a header, or a relay that
    // does not open, is the plain `201`, and the client dials one as it would have.
    if let (Some(upgrade), Some(in_header)) = (upgrade, header_json(&row)) {
        match open_relay(&node, &row.id, ask_info).await {
            Ok((live, agent, answer)) => {
                let who = audited::principal(&node, bearer(&headers), None);
                let mut res = relay::serve(node.clone(), live, agent, upgrade, who);
                res.headers_mut().insert(relay::SANDBOX_HEADER, in_header);
                if let Some(answer) = answer {
                    res.headers_mut().insert(relay::AGENT_INFO_HEADER, answer);
                }
                res.extensions_mut().insert(noted);
                return Ok(res);
            }
            Err(e) => tracing::debug!(sandbox = row.id, "claimed; its relay did not open: {e}"),
        }
    }
    Ok((StatusCode::CREATED, axum::Extension(noted), axum::Json(row)).into_response())
}

/// The connection to a new sandbox's silkd for the relay its claim opens, and, if the claim
/// asked, silkd's `info` answer on it as a header.
async fn open_relay(
    node: &Arc<Node>,
    id: &str,
    ask_info: bool,
) -> Result<(Live, UnixStream, Option<header::HeaderValue>), String> {
    let (live, mut agent) = node.open_agent(id).await.map_err(|e| e.to_string())?;
    if !ask_info {
        return Ok((live, agent, None));
    }
    let info = relay::ask_info(&mut agent).await?;
    let answer = header_json(&info).ok_or("silkd's answer does not fit a header")?;
    Ok((live, agent, Some(answer)))
}

/// The most a row may take in a header: proxies in front of a node commonly hold 4–8 KiB of
/// response headers in all, and one that refused the answer would lose the claim's token.
const HEADER_ROW_MAX: usize = 4096;

/// `value` as JSON in a header, if it fits [`HEADER_ROW_MAX`]: serde_json escapes every control
/// character but DEL, which a header may not hold either (UTF-8 beyond ASCII it may).
fn header_json(value: &impl serde::Serialize) -> Option<header::HeaderValue> {
    let json = serde_json::to_string(value).ok()?.replace('\u{7f}', "\\u007f");
    (json.len() <= HEADER_ROW_MAX).then(|| header::HeaderValue::from_bytes(json.as_bytes()).ok())?
}
