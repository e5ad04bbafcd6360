//! The data plane: `GET /v1/sandboxes/{id}/agent` with `Upgrade: silkd`. After the `101` the
//! node splices bytes between the client and the sandbox's silkd, both ways, unchanged; a
//! half-close on either side is passed on to the other. The client's side is watched as it
//! passes (`silk_proto::Sniffer`) so each program it runs is an audit entry.
//!
//! A claim (`POST /v1/sandboxes`) may ask for the same upgrade: its `101` carries the new
//! sandbox's row in [`SANDBOX_HEADER`] and the connection is then this relay, so a client's
//! first call needs no second connection, request and relay set-up.

use std::convert::Infallible;
use std::sync::Arc;

use axum::extract::{FromRequestParts, Path, Request, State};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use hyper::upgrade::OnUpgrade;
use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;

use super::bearer;
use crate::error::{Code, NodeError};
use crate::listen::AfterUpgrade;
use crate::node::{Live, Node};

pub const PROTOCOL: &str = "silkd";

/// The header of a claim's `101` that carries the new sandbox's row (JSON, with its token).
pub const SANDBOX_HEADER: &str = "silk-sandbox";

/// A claim that opens the relay and carries this header (value `info`) is answered once the
/// sandbox's silkd answered `info` on the relay's connection: the `101` then carries that
/// answer (JSON) in [`AGENT_INFO_HEADER`]. The proof is fresh, made after the claim, on the
/// connection the client goes on to use.
pub const ASK_HEADER: &str = "silk-ask";

/// The header of a claim's `101` with silkd's `info` answer, when [`ASK_HEADER`] asked for it.
pub const AGENT_INFO_HEADER: &str = "silk-agent-info";

/// How long a claim waits for silkd's `info` answer before it answers without the relay.
const ANSWER_WITHIN: std::time::Duration = std::time::Duration::from_secs(2);

/// Whether a claim asks for silkd's answer before its `101` ([`ASK_HEADER`]: `info`); any
/// other value is refused before anything is claimed.
pub fn asks_info(headers: &HeaderMap) -> Result<bool, NodeError> {
    match headers.get(ASK_HEADER) {
        None => Ok(false),
        Some(v) if v.as_bytes().eq_ignore_ascii_case(b"info") => Ok(true),
        Some(v) => Err(NodeError::bad_request(format!("{ASK_HEADER}: {v:?}: only `info`"))),
    }
}

/// silkd's answer to `info` on `agent`, within [`ANSWER_WITHIN`]. Whatever the sandbox sends
/// is untrusted: anything but one `InfoReply` then `Done`, or bytes after them, is a refusal
/// (the relay must start between frames).
pub async fn ask_info(agent: &mut UnixStream) -> Result<silk_proto::AgentInfo, String> {
    use silk_proto::{Frame, FrameReader, FrameWriter};
    let (rd, wr) = agent.split();
    let (mut rd, mut wr) = (FrameReader::new(rd), FrameWriter::new(wr));
    let exchange = async {
        wr.send(&Frame::Info).await.map_err(|e| e.to_string())?;
        let mut info = None;
        loop {
            match rd.recv().await.map_err(|e| e.to_string())? {
                Some(Frame::InfoReply(i)) if info.is_none() => info = Some(i),
                Some(Frame::Done) => break,
                other => return Err(format!("silkd answered {other:?}")),
            }
        }
        if !rd.buffered().is_empty() {
            return Err("silkd sent more than its answer".into());
        }
        info.ok_or_else(|| "silkd ended `info` without its reply".to_string())
    };
    tokio::time::timeout(ANSWER_WITHIN, exchange)
        .await
        .unwrap_or_else(|_| Err("silkd did not answer `info` in time".into()))
}

/// Whether a request asks for the relay (`Upgrade: silkd`).
pub fn wanted(headers: &HeaderMap) -> bool {
    headers
        .get(header::UPGRADE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.eq_ignore_ascii_case(PROTOCOL))
}

/// The client's side of an upgrade, taken from a request that asks for the relay (`None`
/// otherwise, and on a connection that cannot upgrade, such as HTTP/2).
#[derive(Debug)]
pub struct ClientUpgrade(pub Option<Upgrade>);

/// A request's upgrade, and where its connection runs the work after it (absent where the
/// request did not come through the listener: then the work is a task of its own).
#[derive(Debug)]
pub struct Upgrade {
    pub on: OnUpgrade,
    after: Option<AfterUpgrade>,
}

impl Upgrade {
    fn of(on: OnUpgrade, extensions: &axum::http::Extensions) -> Upgrade {
        Upgrade { on, after: extensions.get::<AfterUpgrade>().cloned() }
    }
}

impl<S: Send + Sync> FromRequestParts<S> for ClientUpgrade {
    type Rejection = Infallible;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Infallible> {
        let on = wanted(&parts.headers).then(|| parts.extensions.remove::<OnUpgrade>()).flatten();
        Ok(ClientUpgrade(on.map(|on| Upgrade::of(on, &parts.extensions))))
    }
}

pub async fn agent(
    State(node): State<Arc<Node>>,
    Path(id): Path<String>,
    mut req: Request,
) -> Result<Response, NodeError> {
    node.authorized(&id, bearer(req.headers()))?;
    if !wanted(req.headers()) {
        return Err(NodeError::new(
            Code::UpgradeRequired,
            "send `Connection: upgrade` and `Upgrade: silkd`",
        ));
    }
    // A hibernated or archived sandbox wakes first (one whose silkd died restarts): the client
    // sees a slower call. Dialled before answering 101, so a failure is a clear error rather than
    // a dropped stream.
    let (live, agent) = node.open_agent(&id).await?;
    let upgrade = Upgrade::of(hyper::upgrade::on(&mut req), req.extensions());
    let principal = super::audited::principal(&node, bearer(req.headers()), Some(&id));
    Ok(serve(node, live, agent, upgrade, principal))
}

/// Answers `101` and, once the client's side of the upgrade is ready, splices it to `agent`
/// until either ends. `principal` (who, tenant) is who each program run through it is
/// recorded for.
pub fn serve(
    node: Arc<Node>,
    live: Live,
    mut agent: UnixStream,
    upgrade: Upgrade,
    (who, tenant): (String, Option<String>),
) -> Response {
    // In use from the 101 on: the reaper must not find it idle while the upgrade completes.
    let active = crate::node::Active::new(&live);
    // Each program run through the relay is one audit entry (the opening is another).
    let whole = node.cfg.audit_exec_args;
    let (audit, name, id) = (node.audit.clone(), node.name.clone(), live.record.id.clone());
    let target = id.clone();
    let seen = move |frame: silk_proto::Frame| {
        let Some(detail) = super::audited::program(&frame, whole) else { return };
        audit.record(silk_api::AuditEntry {
            time_ms: crate::node::now_ms(),
            node: name.clone(),
            principal: who.clone(),
            tenant: tenant.clone(),
            action: "exec".into(),
            target: Some(target.clone()),
            status: 101,
            detail: Some(detail),
        });
    };
    let Upgrade { on, after } = upgrade;
    let splice = async move {
        let _active = active;
        let upgraded = match on.await {
            Ok(u) => u,
            Err(e) => {
                tracing::debug!(sandbox = id, "upgrade failed: {e}");
                return;
            }
        };
        node.splice(&live, &mut TokioIo::new(upgraded), &mut agent, seen).await;
    };
    match after {
        Some(after) => after.run(splice),
        None => drop(tokio::spawn(splice)),
    }
    switching_protocols()
}

/// The `101` the relay answers with (a forwarded relay passes its owner's on).
pub fn switching_protocols() -> Response {
    let mut res = StatusCode::SWITCHING_PROTOCOLS.into_response();
    res.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    res.headers_mut().insert(header::UPGRADE, HeaderValue::from_static(PROTOCOL));
    res
}

#[cfg(test)]
mod tests {
    use silk_proto::{AgentInfo, Frame, encode};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    fn info() -> AgentInfo {
        AgentInfo {
            agent_version: "1".into(),
            protocol: 1,
            uptime_ms: 2,
            processes: 0,
            sessions: 0,
            connections: 1,
        }
    }

    /// A peer in silkd's place that reads the node's `Info`, then answers `answer`'s bytes and
    /// holds the connection open, or closes it (no bytes), or stays silent (`None`).
    async fn ask_with(answer: Option<Vec<u8>>) -> Result<AgentInfo, String> {
        let (mut node_side, mut sandbox_side) = UnixStream::pair().unwrap();
        let peer = tokio::spawn(async move {
            let mut asked = [0u8; 5];
            sandbox_side.read_exact(&mut asked).await.unwrap();
            assert_eq!(asked, [1, 0, 0, 0, 10], "an `Info` frame");
            match answer {
                Some(bytes) if bytes.is_empty() => return drop(sandbox_side),
                Some(bytes) => sandbox_side.write_all(&bytes).await.unwrap(),
                None => {}
            }
            std::future::pending::<()>().await;
        });
        let asked = ask_info(&mut node_side).await;
        peer.abort();
        asked
    }

    fn frames(frames: &[Frame]) -> Vec<u8> {
        let mut out = bytes::BytesMut::new();
        frames.iter().for_each(|f| encode(f, &mut out).unwrap());
        out.to_vec()
    }

    #[tokio::test(start_paused = true)]
    async fn only_one_info_answer_and_nothing_after_it_is_silkds_answer() {
        let answered = frames(&[Frame::InfoReply(info()), Frame::Done]);
        assert_eq!(ask_with(Some(answered.clone())).await, Ok(info()));

        // What a process squatting on silkd's socket might send: each is a refusal, so the
        // claim answers without the relay rather than relay a stream that starts mid-frame.
        let mut trailing = answered.clone();
        trailing.extend_from_slice(&frames(&[Frame::Done]));
        let twice = frames(&[Frame::InfoReply(info()), Frame::InfoReply(info()), Frame::Done]);
        let too_large = (silk_proto::MAX_FRAME as u32 + 1).to_le_bytes().to_vec();
        for (what, bytes) in [
            ("bytes after the answer", trailing),
            ("two replies", twice),
            ("no reply", frames(&[Frame::Done])),
            ("another frame", frames(&[Frame::Ready, Frame::Done])),
            ("a frame too large", too_large),
            ("a closed connection", vec![]),
        ] {
            assert!(ask_with(Some(bytes)).await.is_err(), "{what}");
        }
        // Silence ends at the deadline (the clock is paused: no real wait).
        let silent = ask_with(None).await.unwrap_err();
        assert!(silent.contains("in time"), "{silent}");
    }
}
