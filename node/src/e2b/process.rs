//! envd's `process.Process` service: `Start` (a silkd `Exec`, or `PtyOpen` for a terminal,
//! driven by the process table, so it outlives its stream), `Connect` (attach to a running
//! command), `List`, `SendSignal`, `SendInput`, `StreamInput` (a client stream of input),
//! `CloseStdin`, `Update` (a pty's size). Streams are `start`, `data`, `keepalive` and `end`
//! events, then the end-of-stream envelope; the body ends there (the SDK reads to its end).

use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Path, Request, State};
use axum::http::{HeaderMap, StatusCode, header as h};
use axum::response::Response;
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as B64;
use serde::Deserialize;
use serde_json::{Value, json};
use silk_proto::{Command, ExecRequest, Frame, PtyRequest};
use tokio::sync::mpsc;

use super::connect::{self, Code, Envelopes};
use super::envd::{Agent, agent, call, fail, lost, message, ok, user};
use super::procs::{Event, Input};
use super::{E2b, header};

#[derive(Debug, Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct ProcessConfig {
    cmd: String,
    #[serde(default)]
    args: Vec<String>,
    #[serde(default)]
    envs: std::collections::BTreeMap<String, String>,
    cwd: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct StartRequest {
    process: ProcessConfig,
    pty: Option<PtyConfig>,
    tag: Option<String>,
    #[serde(default)]
    stdin: bool,
}

#[derive(Debug, Deserialize)]
struct PtyConfig {
    size: PtySize,
}

#[derive(Debug, Deserialize)]
struct PtySize {
    cols: u16,
    rows: u16,
}

#[derive(Debug, Deserialize)]
struct UpdateRequest {
    process: Selector,
    pty: Option<PtyConfig>,
}

/// Which command a call means.
#[derive(Debug, Deserialize)]
struct Selector {
    pid: Option<u32>,
    tag: Option<String>,
}

#[derive(Debug, Deserialize)]
struct Selected {
    process: Selector,
}

#[derive(Debug, Deserialize)]
struct SignalRequest {
    process: Selector,
    signal: Value,
}

#[derive(Debug, Deserialize)]
struct InputRequest {
    process: Selector,
    input: ProcessInput,
}

#[derive(Debug, Deserialize)]
struct ProcessInput {
    stdin: Option<String>,
    pty: Option<String>,
}

pub(super) async fn process(
    State(e2b): State<E2b>,
    Path(method): Path<String>,
    request: Request,
) -> Response {
    let (parts, body) = request.into_parts();
    let headers = parts.headers;
    let mut agent = match agent(&e2b, &headers).await {
        Ok(agent) => agent,
        Err(res) => return axum::response::IntoResponse::into_response(res),
    };
    if method == "StreamInput" {
        let answer = stream_input(&e2b, &agent, body).await;
        return once(connect::envelope(&json!({})), answer.err());
    }
    let body = match axum::body::to_bytes(body, connect::Envelopes::MAX_MESSAGE + 5).await {
        Ok(body) => body,
        Err(e) => return fail(connect::Error::new(Code::ResourceExhausted, e.to_string())),
    };
    let answer = match method.as_str() {
        "Start" => return start(&e2b, agent, &headers, &body).await,
        "Connect" => return connect(&e2b, &agent, &headers, &body),
        "List" => Ok(json!({ "processes": e2b.procs.list(&agent.id) })),
        "SendSignal" => send_signal(&e2b, &mut agent, &body).await,
        "SendInput" => send_input(&e2b, &agent, &body).await,
        "CloseStdin" => close_stdin(&e2b, &agent, &body).await,
        "Update" => update(&e2b, &agent, &body).await,
        other => Err(connect::Error::new(
            Code::Unimplemented,
            format!("process.Process/{other} is not served by silkmesh yet"),
        )),
    };
    answer.map_or_else(fail, ok)
}

/// The pid a selector names among sandbox `id`'s commands (by tag: the process table's).
fn pid_of(e2b: &E2b, id: &str, s: &Selector) -> Result<u32, connect::Error> {
    if let Some(pid) = s.pid {
        return Ok(pid);
    }
    let tag = s.tag.as_deref().ok_or_else(|| {
        connect::Error::new(Code::InvalidArgument, "select the process by pid or tag")
    })?;
    e2b.procs
        .list(id)
        .iter()
        .find(|p| p["tag"] == tag)
        .and_then(|p| p["pid"].as_u64())
        .map(|pid| pid as u32)
        .ok_or_else(|| connect::Error::new(Code::NotFound, format!("no process tagged {tag:?}")))
}

async fn send_signal(e2b: &E2b, agent: &mut Agent, body: &[u8]) -> Result<Value, connect::Error> {
    let req: SignalRequest = message(body)?;
    let pid = pid_of(e2b, &agent.id, &req.process)?;
    let signal = match &req.signal {
        Value::String(s) if s == "SIGNAL_SIGTERM" => libc::SIGTERM,
        Value::Number(n) if n.as_i64() == Some(15) => libc::SIGTERM,
        _ => libc::SIGKILL,
    };
    call(&mut agent.conn, Frame::Kill { pid, signal }).await?;
    Ok(json!({}))
}

async fn send_input(e2b: &E2b, agent: &Agent, body: &[u8]) -> Result<Value, connect::Error> {
    let req: InputRequest = message(body)?;
    let pid = pid_of(e2b, &agent.id, &req.process)?;
    let data = req.input.stdin.or(req.input.pty).unwrap_or_default();
    let bytes = B64
        .decode(data.as_bytes())
        .map_err(|e| connect::Error::new(Code::InvalidArgument, format!("input: {e}")))?;
    deliver(e2b, &agent.id, pid, Input::Data(bytes.into())).await
}

#[derive(Debug, Deserialize)]
struct StreamInputRequest {
    start: Option<Selected>,
    data: Option<DataEvent>,
}

#[derive(Debug, Deserialize)]
struct DataEvent {
    input: ProcessInput,
}

/// `StreamInput`: `start{process}`, then `data` (and `keepalive`) messages as the client sends
/// them, each delivered as it arrives, in order.
async fn stream_input(e2b: &E2b, agent: &Agent, mut body: Body) -> Result<(), connect::Error> {
    use http_body_util::BodyExt as _;
    let mut envelopes = Envelopes::default();
    let mut target: Option<(u32, mpsc::Sender<Input>)> = None;
    let not_running =
        |pid: u32| connect::Error::new(Code::NotFound, format!("process {pid} is not running"));
    let invalid = |m: &str| connect::Error::new(Code::InvalidArgument, m.to_string());
    loop {
        while let Some(m) = envelopes.next_message()? {
            let req: StreamInputRequest = message(&m)?;
            match (req.start, req.data, &target) {
                (Some(start), None, None) => {
                    let pid = pid_of(e2b, &agent.id, &start.process)?;
                    let tx = e2b.procs.input(&agent.id, pid).ok_or_else(|| not_running(pid))?;
                    target = Some((pid, tx));
                }
                (None, Some(DataEvent { input }), Some((pid, tx))) => {
                    let data = input.stdin.or(input.pty).unwrap_or_default();
                    let bytes = B64.decode(data.as_bytes()).map_err(|_| invalid("bad base64"))?;
                    tx.send(Input::Data(bytes.into())).await.map_err(|_| not_running(*pid))?;
                }
                (None, None, _) => {} // a keepalive
                (Some(_), _, Some(_)) | (Some(_), Some(_), None) => {
                    return Err(invalid("start is the first message, and only once"));
                }
                (None, Some(_), None) => return Err(invalid("data before start")),
            }
        }
        match body.frame().await {
            Some(Ok(frame)) => {
                if let Some(bytes) = frame.data_ref() {
                    envelopes.push(bytes);
                }
            }
            Some(Err(e)) => return Err(invalid(&e.to_string())),
            None if envelopes.pending() > 0 => return Err(invalid("the stream ended mid-message")),
            None => return Ok(()),
        }
    }
}

/// A client-streaming call's answer: its one message, or its error, then the stream's end.
fn once(message: Bytes, error: Option<connect::Error>) -> Response {
    let body = match &error {
        None => [message, connect::end(None)].concat(),
        Some(e) => connect::end(Some(e)).to_vec(),
    };
    Response::builder()
        .status(StatusCode::OK)
        .header(h::CONTENT_TYPE, "application/connect+json")
        .body(Body::from(body))
        .expect("a valid response")
}

async fn close_stdin(e2b: &E2b, agent: &Agent, body: &[u8]) -> Result<Value, connect::Error> {
    let req: Selected = message(body)?;
    let pid = pid_of(e2b, &agent.id, &req.process)?;
    deliver(e2b, &agent.id, pid, Input::Close).await
}

/// `Update`: a pty's window size.
async fn update(e2b: &E2b, agent: &Agent, body: &[u8]) -> Result<Value, connect::Error> {
    let req: UpdateRequest = message(body)?;
    let pid = pid_of(e2b, &agent.id, &req.process)?;
    let Some(PtyConfig { size }) = req.pty else { return Ok(json!({})) };
    if size.cols == 0 || size.rows == 0 {
        return Err(connect::Error::new(Code::InvalidArgument, "a pty is at least 1×1"));
    }
    if !e2b.procs.is_pty(&agent.id, pid) {
        let e = format!("process {pid} is not a pty (or not running)");
        return Err(connect::Error::new(Code::InvalidArgument, e));
    }
    deliver(e2b, &agent.id, pid, Input::Resize { cols: size.cols, rows: size.rows }).await
}

async fn deliver(e2b: &E2b, id: &str, pid: u32, input: Input) -> Result<Value, connect::Error> {
    let not_running =
        || connect::Error::new(Code::NotFound, format!("process {pid} is not running"));
    let tx = e2b.procs.input(id, pid).ok_or_else(not_running)?;
    tx.send(input).await.map_err(|_| not_running())?;
    Ok(json!({}))
}

/// The one request message of a server-streaming call.
pub(super) fn stream_request<T: serde::de::DeserializeOwned>(
    body: &[u8],
) -> Result<T, connect::Error> {
    let mut envelopes = Envelopes::default();
    envelopes.push(body);
    match envelopes.next_message()? {
        Some(m) => message(&m),
        None => Err(connect::Error::new(Code::InvalidArgument, "no request message")),
    }
}

/// How often a quiet stream says it is alive (`Keepalive-Ping-Interval`, seconds).
pub(super) fn keepalive(headers: &HeaderMap) -> Duration {
    let seconds = header(headers, "keepalive-ping-interval").and_then(|s| s.parse::<u64>().ok());
    Duration::from_secs(seconds.unwrap_or(50).clamp(1, 300))
}

async fn start(e2b: &E2b, mut agent: Agent, headers: &HeaderMap, body: &[u8]) -> Response {
    let req: StartRequest = match stream_request(body) {
        Ok(req) => req,
        Err(e) => return fail(e),
    };
    let config = json!({
        "cmd": req.process.cmd, "args": req.process.args,
        "envs": req.process.envs, "cwd": req.process.cwd,
    });
    let mut env: Vec<(String, String)> = {
        let envs = e2b.envs.lock().unwrap_or_else(|p| p.into_inner());
        envs.get(&agent.id).map(|e| e.clone().into_iter().collect()).unwrap_or_default()
    };
    env.extend(req.process.envs);
    let command = Command {
        argv: std::iter::once(req.process.cmd).chain(req.process.args).collect(),
        cwd: req.process.cwd,
        env,
        user: Some(user(headers)),
    };
    let pty = req.pty.is_some();
    let call = match req.pty {
        // A terminal: no timeout of silkd's (the SDK ends it with `exit` or a kill).
        Some(PtyConfig { size }) => {
            Frame::PtyOpen(PtyRequest { command, cols: size.cols, rows: size.rows })
        }
        None => Frame::Exec(ExecRequest {
            command,
            stdin: req.stdin,
            timeout_ms: connect::timeout_ms(header(headers, "connect-timeout-ms")),
        }),
    };
    if let Err(e) = agent.conn.send(&call).await {
        return fail(lost(e));
    }
    let events = e2b.procs.drive(agent, config, req.tag, pty);
    stream(events, keepalive(headers))
}

fn connect(e2b: &E2b, agent: &Agent, headers: &HeaderMap, body: &[u8]) -> Response {
    let attached = stream_request::<Selected>(body)
        .and_then(|req| pid_of(e2b, &agent.id, &req.process))
        .and_then(|pid| {
            e2b.procs.attach(&agent.id, pid).ok_or_else(|| {
                connect::Error::new(Code::NotFound, format!("process {pid} is not running"))
            })
        });
    match attached {
        Ok(events) => stream(events, keepalive(headers)),
        Err(e) => fail(e),
    }
}

/// A command's (or a watch's) events as a Connect stream, with keepalives while it is quiet.
pub(super) fn stream(mut events: mpsc::Receiver<Event>, every: Duration) -> Response {
    let (tx, rx) = mpsc::channel::<Result<Bytes, std::io::Error>>(16);
    tokio::spawn(async move {
        loop {
            // A client that left is noticed at once, not at the next event or keepalive.
            let next = tokio::select! {
                next = tokio::time::timeout(every, events.recv()) => next,
                () = tx.closed() => return,
            };
            let out = match next {
                Err(_) => connect::envelope(&json!({ "event": { "keepalive": {} } })),
                Ok(Some(Event::Message(m))) => m,
                Ok(Some(Event::End(error))) => {
                    let _ = tx.send(Ok(connect::end(error.as_ref()))).await;
                    return;
                }
                Ok(None) => {
                    let e = connect::Error::new(Code::Unavailable, "the command's stream ended");
                    let _ = tx.send(Ok(connect::end(Some(&e)))).await;
                    return;
                }
            };
            if tx.send(Ok(out)).await.is_err() {
                return; // the client left; the command goes on
            }
        }
    });
    Response::builder()
        .status(StatusCode::OK)
        .header(h::CONTENT_TYPE, "application/connect+json")
        .body(Body::from_stream(super::files::Chunks(rx)))
        .expect("a valid response")
}
