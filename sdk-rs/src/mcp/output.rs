//! What the tools answer: results and tool errors, exec output kept within its cap as it
//! arrives, file bytes as text or base64, and progress while a call runs.

use std::time::Duration;

use rmcp::ErrorData;
use rmcp::RoleServer;
use rmcp::model::{CallToolResult, ProgressNotificationParam};
use rmcp::service::RequestContext;
use serde_json::{Value, json};

use super::OUTPUT_CAP;
use crate::Error;

/// A failure as a tool error: the text names what went wrong.
pub(super) fn failed(e: impl std::fmt::Display) -> CallToolResult {
    CallToolResult::structured_error(json!({ "error": e.to_string() }))
}

pub(super) fn done(v: Value) -> CallToolResult {
    CallToolResult::structured(v)
}

pub(super) fn to_json(v: impl serde::Serialize) -> Value {
    let mut v = serde_json::to_value(v).unwrap_or(Value::Null);
    // The caller's key acts on the sandbox: its own token stays out of agents' transcripts.
    if let Some(o) = v.as_object_mut() {
        o.remove("token");
    }
    v
}

/// Runs `run` to its end, keeping at most a little more than [`OUTPUT_CAP`] of each stream (the
/// rest is read and dropped: a command that prints without end costs no memory).
pub(super) async fn collect_capped(
    run: crate::ExecBuilder,
) -> Result<(crate::ExitStatus, Vec<u8>, Vec<u8>), Error> {
    let keep = OUTPUT_CAP + 4;
    let mut exec = run.start().await?;
    let (mut out, mut err) = (vec![], vec![]);
    while let Some(chunk) = exec.next().await? {
        let (to, bytes) = match &chunk {
            crate::Chunk::Stdout(b) => (&mut out, b),
            crate::Chunk::Stderr(b) => (&mut err, b),
        };
        let room = keep.saturating_sub(to.len());
        to.extend_from_slice(&bytes[..bytes.len().min(room)]);
    }
    let status =
        exec.status().ok_or_else(|| Error::Protocol("exec ended without a status".into()))?;
    Ok((status, out, err))
}

/// `text`, cut to `cap` bytes at a character boundary; whether it was cut.
pub(super) fn capped(bytes: &[u8], cap: usize) -> (String, bool) {
    let text = String::from_utf8_lossy(&bytes[..bytes.len().min(cap)]);
    let mut text = text.into_owned();
    if bytes.len() > cap && text.ends_with('\u{fffd}') {
        text.pop(); // a character the cut split
    }
    (text, bytes.len() > cap)
}

pub(super) fn result(
    r: Result<CallToolResult, CallToolResult>,
) -> Result<CallToolResult, ErrorData> {
    Ok(r.unwrap_or_else(|e| e))
}

/// Runs `work`, sending the caller progress every second while it runs (when it asked for
/// progress), and a last one when it is done.
pub(super) async fn with_progress<T>(
    ctx: &RequestContext<RoleServer>,
    what: &str,
    work: impl std::future::Future<Output = T>,
) -> T {
    let Some(token) = ctx.meta.get_progress_token() else { return work.await };
    let note = |n: f64, message: String| {
        ProgressNotificationParam::new(token.clone(), n).with_message(message)
    };
    let _ = ctx.peer.notify_progress(note(0.0, format!("{what}: started"))).await;
    tokio::pin!(work);
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.tick().await;
    let mut seconds = 0.0;
    let out = loop {
        tokio::select! {
            out = &mut work => break out,
            _ = tick.tick() => {
                seconds += 1.0;
                let n = note(seconds, format!("{what}: {seconds} s"));
                let _ = ctx.peer.notify_progress(n).await;
            }
        }
    };
    let _ = ctx.peer.notify_progress(note(seconds + 1.0, format!("{what}: done"))).await;
    out
}

pub(super) fn base64_encode(bytes: &[u8]) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

pub(super) fn base64_decode(text: &str) -> Option<Vec<u8>> {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.decode(text.trim()).ok()
}
