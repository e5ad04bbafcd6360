//! E2B's control plane over the controller: create (a claim), get, list, kill (release),
//! timeout and refreshes (renew), pause (hibernate, memory kept where the engine can), connect
//! and resume (wake). Shapes as the e2b SDK 2.63.0 reads them: camelCase keys, ids as
//! `sandboxID`/`templateID`/`clientID`, errors `{"code": <status>, "message"}` — the SDK parses
//! an error body before it looks at the status, so every error here is that JSON.

use std::collections::BTreeMap;

use axum::Router;
use axum::extract::{Path, RawQuery, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use axum::routing::{get, post};
use serde::Deserialize;
use serde_json::{Value, json};

use super::{E2b, ENVD_VERSION, HttpError, header};
use crate::claims::{ClaimRecord, ClaimSpec, OnExpire};
use crate::error::NodeError;
use crate::node::{Principal, detached};
use crate::state::SandboxState;

pub(super) fn routes() -> Router<E2b> {
    let not_yet = || async { unimplemented("this E2B call is not served by silkmesh yet") };
    Router::new()
        .route("/sandboxes", get(list).post(create))
        .route("/v2/sandboxes", get(list).post(create))
        .route("/sandboxes/{id}", get(detail).delete(kill))
        .route("/sandboxes/{id}/timeout", post(set_timeout))
        .route("/sandboxes/{id}/refreshes", post(refresh))
        .route("/sandboxes/{id}/pause", post(pause))
        .route("/sandboxes/{id}/resume", post(connect))
        .route("/sandboxes/{id}/connect", post(connect))
        .route("/v2/sandboxes/{id}/connect", post(connect))
        .route("/templates", get(templates))
        .route("/sandboxes/{id}/fork", post(super::copies::fork))
        .route("/sandboxes/{id}/snapshots", post(super::copies::snapshot))
        .route("/snapshots", get(super::copies::snapshots))
        .route("/templates/{id}", axum::routing::delete(super::copies::delete))
        .route("/sandboxes/{id}/metrics", get(not_yet))
        .route("/sandboxes/metrics", get(not_yet))
        .route("/sandboxes/{id}/logs", get(not_yet))
        .route("/v2/sandboxes/{id}/logs", get(not_yet))
        .route("/sandboxes/{id}/network", axum::routing::put(not_yet))
}

pub(super) fn error(status: StatusCode, message: impl Into<String>) -> HttpError {
    HttpError::new(status, message)
}

fn unimplemented(message: &str) -> HttpError {
    error(StatusCode::NOT_IMPLEMENTED, message)
}

pub(super) fn node_error(e: NodeError) -> HttpError {
    error(crate::api::status(&e), e.message)
}

fn not_found(id: &str) -> HttpError {
    error(StatusCode::NOT_FOUND, format!("sandbox {id} not found"))
}

pub(super) type Answer = Result<Response, HttpError>;

/// The caller's tenant (`None`: root), from `X-API-Key`.
pub(super) fn caller(e2b: &E2b, headers: &HeaderMap) -> Result<Option<String>, HttpError> {
    match e2b.node.principal(header(headers, "x-api-key")) {
        Principal::Root => Ok(None),
        Principal::Tenant(t) => Ok(Some(t)),
        Principal::Nobody => Err(error(StatusCode::UNAUTHORIZED, "invalid API key")),
    }
}

/// Sandbox `id`'s record, if the caller may act on it (else the same 404 as an unknown id).
pub(super) fn owned(e2b: &E2b, headers: &HeaderMap, id: &str) -> Result<ClaimRecord, HttpError> {
    caller(e2b, headers)?;
    e2b.node
        .authorized(id, header(headers, "x-api-key"))
        .map(|live| live.record)
        .map_err(|_| not_found(id))
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct NewSandbox {
    #[serde(rename = "templateID")]
    template_id: String,
    timeout: Option<u64>,
    #[serde(default)]
    metadata: BTreeMap<String, String>,
    #[serde(default)]
    env_vars: BTreeMap<String, String>,
    #[serde(default)]
    auto_pause: bool,
    #[serde(default)]
    volume_mounts: Vec<Value>,
}

pub(super) fn body<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Result<T, HttpError> {
    let bytes = if bytes.is_empty() { b"{}".as_slice() } else { bytes };
    serde_json::from_slice(bytes).map_err(|e| error(StatusCode::BAD_REQUEST, e.to_string()))
}

async fn create(State(e2b): State<E2b>, headers: HeaderMap, raw: axum::body::Bytes) -> Answer {
    let tenant = caller(&e2b, &headers)?;
    let req: NewSandbox = body(&raw)?;
    if !req.volume_mounts.is_empty() {
        return Err(unimplemented("volumes are not served by silkmesh"));
    }
    let aliases = &e2b.node.cfg.e2b.as_ref().expect("listening").templates;
    let snapshot = req.template_id.starts_with("ck_");
    let template = match aliases.get(&req.template_id) {
        Some(t) => Some(t),
        None if snapshot => Some(&req.template_id), // replaced by the checkpoint's below
        None => None,
    };
    let Some(template) = template else {
        let known: Vec<&String> = aliases.keys().collect();
        let message = format!("template {:?} not found (known: {known:?})", req.template_id);
        return Err(error(StatusCode::NOT_FOUND, message));
    };
    let ttl = timeout(&e2b, req.timeout.unwrap_or(e2b.node.cfg.default_ttl_seconds))?;
    crate::claims::check_metadata(&req.metadata).map_err(node_error)?;
    let spec = ClaimSpec {
        template: template.clone(),
        size: silk_api::Size::Small,
        lane: silk_api::Lane::None,
        ttl_seconds: ttl,
        metadata: req.metadata,
        // `autoPause` (and `lifecycle.onTimeout: pause`, which the SDK sends as it): paused
        // at the timeout; any call resumes it (E2B's auto-resume, always on here).
        on_expire: if req.auto_pause { OnExpire::Hibernate } else { OnExpire::Destroy },
        tenant,
        egress: None,
    };
    let claimed = if snapshot {
        super::copies::branch(&e2b, &headers, &req.template_id, spec).await?
    } else {
        let node = e2b.node.clone();
        detached(async move { node.claim(spec).await }).await.map_err(node_error)?
    };
    let id = claimed.record.id.clone();
    let mut envs = e2b.envs.lock().unwrap_or_else(|p| p.into_inner());
    // Sandboxes that ended without a kill here (a lease ran out) leave their entries.
    envs.retain(|id, _| e2b.node.get(id).is_some());
    envs.insert(id.clone(), req.env_vars);
    drop(envs);
    Ok(super::json(StatusCode::CREATED, sandbox(&e2b, &id, &req.template_id)))
}

/// What create and connect answer.
pub(super) fn sandbox(e2b: &E2b, id: &str, template: &str) -> Value {
    json!({
        "templateID": template,
        "sandboxID": id,
        "clientID": e2b.node.name,
        "envdVersion": ENVD_VERSION,
        "envdAccessToken": e2b.access_token(id),
        "alias": template,
    })
}

/// The E2B template id a record's template is known by (the first alias naming it).
pub(super) fn template_id<'a>(e2b: &'a E2b, record: &'a ClaimRecord) -> &'a str {
    let aliases = &e2b.node.cfg.e2b.as_ref().expect("listening").templates;
    aliases.iter().find(|(_, t)| **t == record.template).map_or(&record.template, |(a, _)| a)
}

fn state(record: &ClaimRecord) -> &'static str {
    match record.state() {
        SandboxState::Hibernated | SandboxState::Archived => "paused",
        _ => "running",
    }
}

/// A sandbox as get and list describe it.
fn listed(e2b: &E2b, r: &ClaimRecord) -> Value {
    let limits = silk_engine::Limits::of(r.size);
    let disk = &e2b.node.cfg.disk;
    let disk_mib = match r.size {
        silk_api::Size::Small => disk.small_mib,
        silk_api::Size::Medium => disk.medium_mib,
        silk_api::Size::Large => disk.large_mib,
    };
    json!({
        "templateID": template_id(e2b, r),
        "alias": template_id(e2b, r),
        "sandboxID": r.id,
        "clientID": e2b.node.name,
        "startedAt": rfc3339(r.created_ms),
        "endAt": rfc3339(r.deadline_ms),
        "cpuCount": limits.cpu_millis.div_ceil(1000).max(1),
        "memoryMB": limits.memory_bytes >> 20,
        "diskSizeMB": disk_mib,
        "state": state(r),
        "envdVersion": ENVD_VERSION,
        "metadata": r.metadata,
    })
}

async fn detail(State(e2b): State<E2b>, headers: HeaderMap, Path(id): Path<String>) -> Answer {
    let r = owned(&e2b, &headers, &id)?;
    let mut v = listed(&e2b, &r);
    v["envdAccessToken"] = json!(e2b.access_token(&id));
    v["domain"] = Value::Null;
    Ok(super::json(StatusCode::OK, v))
}

async fn list(State(e2b): State<E2b>, headers: HeaderMap, RawQuery(q): RawQuery) -> Answer {
    let tenant = caller(&e2b, &headers)?;
    let query = Query::parse(q.as_deref().unwrap_or_default());
    let filter: Vec<(String, String)> = query.metadata.into_iter().collect();
    let mut rows: Vec<ClaimRecord> = e2b
        .node
        .list(&filter)
        .into_iter()
        .filter(|r| tenant.is_none() || r.tenant == tenant)
        .filter(|r| query.states.is_empty() || query.states.iter().any(|s| s == state(r)))
        .collect();
    // Pages: the token is the last id a page ended with (ids sort as the list does).
    rows.sort_by(|a, b| a.id.cmp(&b.id));
    if let Some(after) = &query.next_token {
        rows.retain(|r| &r.id > after);
    }
    let limit = query.limit.unwrap_or(1000).clamp(1, 1000);
    let next = (rows.len() > limit).then(|| rows[limit - 1].id.clone());
    rows.truncate(limit);
    let body: Vec<Value> = rows.iter().map(|r| listed(&e2b, r)).collect();
    let mut res = super::json(StatusCode::OK, Value::Array(body));
    if let Some(next) = next {
        res.headers_mut().insert("x-next-token", next.parse().expect("ids are header-safe"));
    }
    Ok(res)
}

async fn kill(State(e2b): State<E2b>, headers: HeaderMap, Path(id): Path<String>) -> Answer {
    owned(&e2b, &headers, &id)?;
    let node = e2b.node.clone();
    let gone = id.clone();
    detached(async move { node.release(&gone).await }).await.map_err(node_error)?;
    e2b.envs.lock().unwrap_or_else(|p| p.into_inner()).remove(&id);
    Ok(super::json(StatusCode::NO_CONTENT, Value::Null))
}

#[derive(Debug, Deserialize)]
struct Timeout {
    timeout: u64,
}

async fn set_timeout(
    State(e2b): State<E2b>,
    headers: HeaderMap,
    Path(id): Path<String>,
    raw: axum::body::Bytes,
) -> Answer {
    owned(&e2b, &headers, &id)?;
    let req: Timeout = body(&raw)?;
    renew(&e2b, &id, req.timeout).await
}

#[derive(Debug, Deserialize)]
struct Refresh {
    duration: Option<u64>,
}

async fn refresh(
    State(e2b): State<E2b>,
    headers: HeaderMap,
    Path(id): Path<String>,
    raw: axum::body::Bytes,
) -> Answer {
    let r = owned(&e2b, &headers, &id)?;
    let req: Refresh = body(&raw)?;
    renew(&e2b, &id, req.duration.unwrap_or(r.lease_seconds)).await
}

/// A lease of `ttl` seconds, if the node's bounds allow it (E2B has no "0 means the default").
fn timeout(e2b: &E2b, ttl: u64) -> Result<u64, HttpError> {
    let max = e2b.node.cfg.max_ttl_seconds;
    if ttl == 0 || ttl > max {
        return Err(error(StatusCode::BAD_REQUEST, format!("timeout must be 1-{max} seconds")));
    }
    Ok(ttl)
}

async fn renew(e2b: &E2b, id: &str, ttl: u64) -> Answer {
    let ttl = timeout(e2b, ttl)?;
    let (node, id) = (e2b.node.clone(), id.to_string());
    detached(async move { node.renew(&id, ttl).await }).await.map_err(node_error)?;
    Ok(super::json(StatusCode::NO_CONTENT, Value::Null))
}

async fn pause(State(e2b): State<E2b>, headers: HeaderMap, Path(id): Path<String>) -> Answer {
    let r = owned(&e2b, &headers, &id)?;
    if state(&r) == "paused" {
        return Err(error(StatusCode::CONFLICT, format!("sandbox {id} is already paused")));
    }
    let node = e2b.node.clone();
    detached(async move { node.hibernate(&id, silk_api::Memory::Auto).await })
        .await
        .map_err(node_error)?;
    Ok(super::json(StatusCode::NO_CONTENT, Value::Null))
}

#[derive(Debug, Deserialize)]
struct Connect {
    timeout: Option<u64>,
}

/// Connect and resume: 200 when it was running, 201 when it was woken.
async fn connect(
    State(e2b): State<E2b>,
    headers: HeaderMap,
    Path(id): Path<String>,
    raw: axum::body::Bytes,
) -> Answer {
    let r = owned(&e2b, &headers, &id)?;
    let req: Connect = body(&raw)?;
    let paused = state(&r) == "paused";
    if paused {
        let (node, woken) = (e2b.node.clone(), id.clone());
        detached(async move { node.wake(&woken).await.map(drop) }).await.map_err(node_error)?;
    }
    if let Some(ttl) = req.timeout {
        renew(&e2b, &id, ttl).await?;
    }
    let status = if paused { StatusCode::CREATED } else { StatusCode::OK };
    Ok(super::json(status, sandbox(&e2b, &id, template_id(&e2b, &r))))
}

async fn templates(State(e2b): State<E2b>, headers: HeaderMap) -> Answer {
    caller(&e2b, &headers)?;
    let aliases = &e2b.node.cfg.e2b.as_ref().expect("listening").templates;
    let body: Vec<Value> = aliases
        .iter()
        .map(|(alias, template)| {
            json!({ "templateID": alias, "aliases": [alias], "buildID": template,
                    "public": false, "cpuCount": 1, "memoryMB": 512 })
        })
        .collect();
    Ok(super::json(StatusCode::OK, Value::Array(body)))
}

/// `GET /v2/sandboxes`'s query: `metadata` (itself an encoded query, its keys and values
/// encoded once more by the SDK), `state` (comma-joined), `limit`, `nextToken`.
#[derive(Debug, Default, PartialEq)]
struct Query {
    metadata: BTreeMap<String, String>,
    states: Vec<String>,
    limit: Option<usize>,
    next_token: Option<String>,
}

impl Query {
    fn parse(q: &str) -> Query {
        let mut out = Query::default();
        for (k, v) in pairs(q) {
            match k.as_str() {
                "metadata" => {
                    for (mk, mv) in pairs(&v) {
                        out.metadata.insert(decode(&mk), decode(&mv));
                    }
                }
                "state" => out.states.extend(v.split(',').map(str::to_string)),
                "limit" => out.limit = v.parse().ok(),
                "nextToken" => out.next_token = Some(v).filter(|t| !t.is_empty()),
                _ => {}
            }
        }
        out
    }
}

/// A query string's pairs, each side percent-decoded (`+` is a space).
pub(super) fn pairs(q: &str) -> Vec<(String, String)> {
    q.split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (decode(&k.replace('+', " ")), decode(&v.replace('+', " ")))
        })
        .collect()
}

fn decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |c: u8| (c as char).to_digit(16);
        if b[i] == b'%'
            && i + 2 < b.len()
            && let (Some(h), Some(l)) = (hex(b[i + 1]), hex(b[i + 2]))
        {
            out.push((h * 16 + l) as u8);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Unix milliseconds as RFC 3339 in UTC (`2026-12-02T06:39:00.123Z`).
pub(crate) fn rfc3339(ms: u64) -> String {
    let (secs, millis) = (ms / 1000, ms % 1000);
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let (h, m, s) = (rem / 3600, rem % 3600 / 60, rem % 60);
    format!("{year:04}-{month:02}-{day:02}T{h:02}:{m:02}:{s:02}.{millis:03}Z")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_are_rfc3339_utc() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339(951_782_400_123), "2000-02-29T00:00:00.123Z");
        assert_eq!(rfc3339(1_796_193_540_000), "2026-12-02T06:39:00.000Z");
    }

    #[test]
    fn the_sdks_doubly_encoded_metadata_filter_decodes() {
        // What e2b 2.63.0 sends for {"k": "v w", "a&b": "c=d"}, state and a page.
        let q = "metadata=k%3Dv%252520w%26a%252526b%3Dc%25253Dd&state=running,paused&limit=5\
                 &nextToken=sb-1";
        let parsed = Query::parse(q);
        let want = BTreeMap::from([("k".into(), "v w".into()), ("a&b".into(), "c=d".into())]);
        assert_eq!(parsed.metadata, want);
        assert_eq!(parsed.states, ["running", "paused"]);
        assert_eq!((parsed.limit, parsed.next_token.as_deref()), (Some(5), Some("sb-1")));
        assert_eq!(Query::parse("metadata=k%3Dv").metadata["k"], "v");
        assert_eq!(decode("%zz%4"), "%zz%4");
    }
}
