//! envd's plumbing and its `filesystem.Filesystem` service over silkd: reaching a sandbox's
//! silkd for a call (its access token checked first), `Stat`, `MakeDir`, `Remove`, `Move`,
//! `ListDir`, the watcher calls (`watch.rs`), and `GET /health`; `process.rs` has
//! `process.Process`. JSON codec: camelCase keys, bytes in base64, int64 as strings, enums by
//! name, times as RFC 3339 with a zone.

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as B64;
use serde::Deserialize;
use serde_json::{Value, json};
use silk_proto::{Connection, ErrorKind, FileKind, Frame, WireError};
use tokio::net::UnixStream;

use super::connect::{self, Code};
use super::{E2b, HttpError, header};
use crate::node::{Active, Live};
use crate::state::SandboxState;

pub(super) fn routes() -> Router<E2b> {
    Router::new()
        .route("/health", get(health))
        .route("/process.Process/{method}", post(super::process::process))
        .route("/filesystem.Filesystem/{method}", post(filesystem))
}

/// A sandbox's silkd, reached for an envd call.
pub(super) struct Agent {
    pub id: String,
    pub conn: Connection<UnixStream>,
    /// Held while the call (or a command it started) runs: the sandbox is in use.
    pub active: Active,
    pub live: Live,
}

/// Why an envd call cannot reach its sandbox, as the SDK reads it (a plain JSON error; 502 with
/// "was not found" is its "sandbox not running").
pub(super) fn unreachable(status: StatusCode, message: String) -> HttpError {
    HttpError::new(status, message)
}

/// The sandbox the call names (`E2b-Sandbox-Id`), its access token checked, its silkd opened
/// (a hibernated sandbox wakes).
pub(super) async fn agent(e2b: &E2b, headers: &HeaderMap) -> Result<Agent, HttpError> {
    let Some(id) = header(headers, "e2b-sandbox-id") else {
        return Err(unreachable(StatusCode::BAD_REQUEST, "no E2b-Sandbox-Id header".into()));
    };
    // The token first: without it, whether a sandbox exists is not told either.
    if !e2b.access_ok(id, header(headers, "x-access-token")) {
        return Err(unreachable(StatusCode::UNAUTHORIZED, "invalid X-Access-Token".into()));
    }
    let gone = || unreachable(StatusCode::BAD_GATEWAY, format!("The sandbox {id} was not found"));
    if e2b.node.get(id).is_none() {
        return Err(gone());
    }
    let (live, stream) = e2b.node.open_agent(id).await.map_err(|e| {
        let status = crate::api::status(&e);
        if status == StatusCode::NOT_FOUND { gone() } else { unreachable(status, e.message) }
    })?;
    let active = Active::new(&live);
    Ok(Agent { id: id.to_string(), conn: Connection::new(stream), active, live })
}

async fn health(State(e2b): State<E2b>, headers: HeaderMap) -> Response {
    if header(&headers, "e2b-sandbox-id").is_none() {
        return StatusCode::NO_CONTENT.into_response(); // the control plane's own health
    }
    let id = header(&headers, "e2b-sandbox-id").unwrap_or_default();
    if !e2b.access_ok(id, header(&headers, "x-access-token")) {
        return unreachable(StatusCode::UNAUTHORIZED, "invalid X-Access-Token".into())
            .into_response();
    }
    // A paused sandbox is not running, and asking does not wake it (as E2B's `is_running`).
    let running = e2b.node.get(id).is_some_and(|l| {
        !matches!(l.record.state(), SandboxState::Hibernated | SandboxState::Archived)
    });
    if !running {
        let gone = format!("The sandbox {id} was not found");
        return unreachable(StatusCode::BAD_GATEWAY, gone).into_response();
    }
    match agent(&e2b, &headers).await {
        Ok(_) => StatusCode::NO_CONTENT.into_response(),
        Err(res) => res.into_response(),
    }
}

/// A Connect error answer to a unary call.
pub(super) fn fail(e: connect::Error) -> Response {
    let status = StatusCode::from_u16(e.code.http_status()).expect("valid status");
    super::json(status, e.json())
}

pub(super) fn ok(body: Value) -> Response {
    super::json(StatusCode::OK, body)
}

pub(super) fn code_of(kind: ErrorKind) -> Code {
    match kind {
        ErrorKind::BadRequest => Code::InvalidArgument,
        ErrorKind::NotFound => Code::NotFound,
        ErrorKind::PermissionDenied => Code::PermissionDenied,
        ErrorKind::Conflict => Code::AlreadyExists,
        ErrorKind::Unsupported => Code::Unimplemented,
        ErrorKind::ResourceExhausted => Code::ResourceExhausted,
        ErrorKind::Unavailable => Code::Unavailable,
        ErrorKind::Internal => Code::Internal,
    }
}

fn wire(e: WireError) -> connect::Error {
    connect::Error::new(code_of(e.kind), e.message)
}

pub(super) fn lost(e: impl std::fmt::Display) -> connect::Error {
    connect::Error::new(Code::Unavailable, format!("silkd: {e}"))
}

/// Sends `request` and collects silkd's replies up to its terminal frame.
pub(super) async fn call(
    conn: &mut Connection<UnixStream>,
    request: Frame,
) -> Result<Vec<Frame>, connect::Error> {
    conn.send(&request).await.map_err(lost)?;
    let mut replies = vec![];
    loop {
        match conn.recv().await.map_err(lost)? {
            Some(Frame::Done) => return Ok(replies),
            Some(Frame::Error(e)) => return Err(wire(e)),
            Some(frame) => replies.push(frame),
            None => return Err(lost("closed the connection")),
        }
    }
}

/// The account a call names none runs as: E2B's default, which every template the node
/// materialises has (uid 1000, home `/home/user`).
pub(super) const DEFAULT_USER: &str = "user";

/// The user a call runs as: `Authorization: Basic base64("<user>:")`, else [`DEFAULT_USER`].
pub(super) fn user(headers: &HeaderMap) -> String {
    let named = || {
        let basic = header(headers, "authorization")?.strip_prefix("Basic ")?;
        let decoded = String::from_utf8(B64.decode(basic.trim()).ok()?).ok()?;
        let name = decoded.split(':').next()?.to_string();
        (!name.is_empty()).then_some(name)
    };
    named().unwrap_or_else(|| DEFAULT_USER.to_string())
}

/// Gives what a call made on `user`'s behalf to `user`, as envd does (silkd writes as root).
pub(super) async fn give(
    conn: &mut Connection<UnixStream>,
    path: &str,
    user: &str,
) -> Result<(), connect::Error> {
    if user == "root" || user == "0" {
        return Ok(());
    }
    call(conn, Frame::Chown { path: path.to_string(), user: user.to_string() }).await.map(drop)
}

/// A unary request's message.
pub(super) fn message<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, connect::Error> {
    let body = if body.is_empty() { b"{}".as_slice() } else { body };
    serde_json::from_slice(body)
        .map_err(|e| connect::Error::new(Code::InvalidArgument, e.to_string()))
}

// ---- filesystem ----

#[derive(Debug, Deserialize)]
struct PathRequest {
    path: String,
    #[serde(default)]
    depth: Option<u32>,
}

#[derive(Debug, Deserialize)]
struct MoveRequest {
    source: String,
    destination: String,
}

async fn filesystem(
    State(e2b): State<E2b>,
    Path(method): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let mut agent = match agent(&e2b, &headers).await {
        Ok(agent) => agent,
        Err(res) => return res.into_response(),
    };
    // Relative paths are the user's home's, as on `/files`.
    let user = user(&headers);
    let me = user.as_str();
    let answer = match method.as_str() {
        "CreateWatcher" => {
            return e2b.watchers.create(agent, me, &body).await.map_or_else(fail, ok);
        }
        "WatchDir" => {
            return match super::watch::Watchers::stream(agent, me, &body).await {
                Ok(events) => super::process::stream(events, super::process::keepalive(&headers)),
                Err(e) => fail(e),
            };
        }
        "GetWatcherEvents" => Some(e2b.watchers.events(&agent.id, &body)),
        "RemoveWatcher" => Some(e2b.watchers.remove(&agent.id, &body)),
        _ => None,
    };
    if let Some(answer) = answer {
        return answer.map_or_else(fail, ok);
    }
    // The request of the calls that name one path, that path made absolute.
    let path_request = || {
        let req: PathRequest = message(&body)?;
        Ok::<_, connect::Error>(PathRequest { path: super::files::absolute(&req.path, me), ..req })
    };
    let conn = &mut agent.conn;
    let answer = match method.as_str() {
        "Stat" => {
            async {
                let req = path_request()?;
                Ok(json!({ "entry": stat(conn, &req.path).await? }))
            }
            .await
        }
        "MakeDir" => {
            async {
                let req = path_request()?;
                if stat(conn, &req.path).await.is_ok() {
                    let e = format!("{} already exists", req.path);
                    return Err(connect::Error::new(Code::AlreadyExists, e));
                }
                call(conn, Frame::Mkdir { path: req.path.clone(), parents: true }).await?;
                give(conn, &req.path, me).await?;
                Ok(json!({ "entry": stat(conn, &req.path).await? }))
            }
            .await
        }
        "Remove" => {
            async {
                let req = path_request()?;
                call(conn, Frame::Rm { path: req.path, recursive: true }).await?;
                Ok(json!({}))
            }
            .await
        }
        "Move" => {
            async {
                let req: MoveRequest = message(&body)?;
                let req = MoveRequest {
                    source: super::files::absolute(&req.source, me),
                    destination: super::files::absolute(&req.destination, me),
                };
                let to = req.destination.clone();
                call(conn, Frame::Rename { from: req.source, to: req.destination }).await?;
                Ok(json!({ "entry": stat(conn, &to).await? }))
            }
            .await
        }
        "ListDir" => {
            async {
                let req = path_request()?;
                let mut entries = vec![];
                let depth = req.depth.unwrap_or(1).clamp(1, MAX_DEPTH);
                list_dir(conn, &req.path, depth, &mut entries).await?;
                Ok(json!({ "entries": entries }))
            }
            .await
        }
        other => Err(connect::Error::new(
            Code::Unimplemented,
            format!("filesystem.Filesystem/{other} is not served by silkmesh yet"),
        )),
    };
    answer.map_or_else(fail, ok)
}

/// An EntryInfo as envd's JSON has it.
fn entry(path: &str, s: &silk_proto::FileStat) -> Value {
    let name = path.rsplit('/').next().unwrap_or(path);
    let kind = match s.kind {
        FileKind::File => "FILE_TYPE_FILE",
        FileKind::Dir => "FILE_TYPE_DIRECTORY",
        FileKind::Symlink => "FILE_TYPE_SYMLINK",
        FileKind::Other => "FILE_TYPE_UNSPECIFIED",
    };
    let mut v = json!({
        "name": name,
        "type": kind,
        "path": path,
        "size": s.size.to_string(),
        "mode": s.mode,
        "permissions": permissions(s),
        "owner": s.uid.to_string(),
        "group": s.gid.to_string(),
        "modifiedTime": super::control::rfc3339(s.mtime_ms.max(0) as u64),
    });
    if s.kind == FileKind::Symlink {
        v["isSymlink"] = json!(true);
    }
    v
}

fn permissions(s: &silk_proto::FileStat) -> String {
    let kind = match s.kind {
        FileKind::Dir => 'd',
        FileKind::Symlink => 'l',
        _ => '-',
    };
    let bits = "rwxrwxrwx";
    let rest: String = bits
        .chars()
        .enumerate()
        .map(|(i, c)| if s.mode & (0o400 >> i) != 0 { c } else { '-' })
        .collect();
    format!("{kind}{rest}")
}

async fn stat(conn: &mut Connection<UnixStream>, path: &str) -> Result<Value, connect::Error> {
    for frame in call(conn, Frame::Stat { path: path.to_string() }).await? {
        if let Frame::StatReply(s) = frame {
            return Ok(entry(path, &s));
        }
    }
    Err(connect::Error::new(Code::Internal, "silkd sent no stat"))
}

/// How deep a `ListDir` goes, and how many entries it answers with at most: what one call may
/// cost the node is bounded whatever the sandbox holds.
const MAX_DEPTH: u32 = 32;
const MAX_ENTRIES: usize = 100_000;

/// The entries under `dir`, `depth` levels down (1: its own).
async fn list_dir(
    conn: &mut Connection<UnixStream>,
    dir: &str,
    depth: u32,
    out: &mut Vec<Value>,
) -> Result<(), connect::Error> {
    let mut level = vec![dir.trim_end_matches('/').to_string()];
    for _ in 0..depth {
        if level.is_empty() {
            break;
        }
        let mut next = vec![];
        for d in level {
            for frame in
                call(conn, Frame::List { path: if d.is_empty() { "/".into() } else { d.clone() } })
                    .await?
            {
                if let Frame::Entries(entries) = frame {
                    for e in entries {
                        let path = format!("{d}/{}", e.name);
                        if e.stat.kind == FileKind::Dir {
                            next.push(path.clone());
                        }
                        out.push(entry(&path, &e.stat));
                        if out.len() > MAX_ENTRIES {
                            let e = format!("more than {MAX_ENTRIES} entries: list less deep");
                            return Err(connect::Error::new(Code::ResourceExhausted, e));
                        }
                    }
                }
            }
        }
        level = next;
    }
    Ok(())
}
