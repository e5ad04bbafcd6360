//! `ANY /v1/sandboxes/{id}/ports/{port}/{path}`: HTTP, and WebSocket (any upgrade), to
//! `127.0.0.1:{port}` inside the sandbox. The connection is silkd's `PortForward`, so it works
//! in every lane (a sandbox with no network too) and, behind the owner middleware, from any
//! node of a mesh. One request per connection: the node speaks HTTP/1.1 to the sandbox's server
//! over the forwarded byte stream and streams the answer back; a `101` splices both sides.
//!
//! What reaches the sandbox: the method, `/{path}?{query}`, the body and the client's headers,
//! less the hop-by-hop ones and less `Authorization` (the sandbox token is never shown to the
//! code inside); `Host` is `localhost:{port}` (dev servers check it), the client's goes in
//! `X-Forwarded-Host`.
//!
//! Who may: the sandbox token, root, its tenant's key, or a preview token of this port (see
//! `crate::previews`; it is never passed in either). A preview's first visit (`?token=`) is
//! answered `303` to the same address without the token, with the cookie that carries it.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Path, Request, State};
use axum::http::{HeaderValue, Method, StatusCode, header};
use axum::response::Response;
use bytes::BytesMut;
use hyper_util::rt::TokioIo;
use silk_proto::{Frame, FrameReader, FrameWriter};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::bearer;
use super::previews::PreviewHost;
use crate::error::{Code, NodeError};
use crate::node::{Active, Node};
use crate::previews::{self, Carried};

/// The answer to a preview's first visit: the same address without the token, and the cookie
/// that carries it from now on (for this port's path, or the whole preview host), as long as
/// the token lasts.
pub(super) fn first_visit(
    node: &Node,
    req: &Request,
    id: &str,
    port: u16,
    token: &str,
) -> Response {
    let host = req.extensions().get::<PreviewHost>();
    let path = host.map_or_else(|| req.uri().path().to_string(), |h| h.path.clone());
    // One leading slash: `//elsewhere.example` would send the browser to another host.
    let path = format!("/{}", path.trim_start_matches(['/', '\\']));
    let cookie_path = match host {
        Some(_) => "/".to_string(),
        None => format!("/v1/sandboxes/{id}/ports/{port}/"),
    };
    let query =
        previews::query_without_token(req.uri()).map(|q| format!("?{q}")).unwrap_or_default();
    let max_age = previews::Token::parse(token)
        .map_or(0, |t| t.expires_ms.saturating_sub(crate::node::now_ms()) / 1000);
    let p = &node.cfg.previews;
    let https = p.scheme.as_deref().map_or(node.cfg.tls.is_some(), |s| s == "https");
    let secure = if https { "; Secure" } else { "" };
    let cookie = format!(
        "{}={token}; Path={cookie_path}; Max-Age={max_age}; HttpOnly; SameSite=Lax{secure}",
        previews::COOKIE
    );
    Response::builder()
        .status(StatusCode::SEE_OTHER)
        .header(header::LOCATION, format!("{path}{query}"))
        .header(header::SET_COOKIE, cookie)
        .header(header::CACHE_CONTROL, "no-store")
        .body(Body::empty())
        .expect("a valid answer")
}

pub async fn proxy_root(
    State(node): State<Arc<Node>>,
    Path((id, port)): Path<(String, String)>,
    req: Request,
) -> Result<Response, NodeError> {
    serve(node, id, port, req).await
}

pub async fn proxy(
    State(node): State<Arc<Node>>,
    Path((id, port, _)): Path<(String, String, String)>,
    req: Request,
) -> Result<Response, NodeError> {
    serve(node, id, port, req).await
}

/// A preview token among `carried` that opens `port` of `id` here.
async fn preview(node: &Node, id: &str, port: u16, carried: Vec<Carried>) -> Option<Carried> {
    for c in carried {
        if node.preview_allows(id, port, c.token()).await {
            return Some(c);
        }
    }
    None
}

async fn serve(
    node: Arc<Node>,
    id: String,
    port: String,
    mut req: Request,
) -> Result<Response, NodeError> {
    // The path after `/ports/{port}` as the client sent it (not percent-decoded: `%2F` and
    // `%3F` stay what they were for the server inside).
    // What a browser or an HTTP client sends a web server; TRACE and CONNECT are not passed on.
    if !matches!(
        *req.method(),
        Method::GET
            | Method::HEAD
            | Method::POST
            | Method::PUT
            | Method::PATCH
            | Method::DELETE
            | Method::OPTIONS
    ) {
        let refused = NodeError::new(Code::MethodNotAllowed, "method not allowed on this route");
        let mut res = axum::response::IntoResponse::into_response(refused);
        res.headers_mut().insert(
            header::ALLOW,
            HeaderValue::from_static("GET, HEAD, POST, PUT, PATCH, DELETE, OPTIONS"),
        );
        return Ok(res);
    }
    let path = req.uri().path().splitn(7, '/').nth(6).unwrap_or_default().to_string();
    let port: u16 = port
        .parse()
        .ok()
        .filter(|p| *p != 0)
        .ok_or_else(|| NodeError::bad_request(format!("port {port:?}: 1-65535")))?;
    if let Err(denied) = node.authorized(&id, bearer(req.headers())) {
        let carried = previews::carried(req.uri(), req.headers());
        // A preview token that opens nothing here is a credential that was presented: the
        // 404 of an unknown sandbox, as for a wrong sandbox token (no credential is a 401).
        let presented = !carried.is_empty();
        match preview(&node, &id, port, carried).await {
            Some(Carried::Query(token)) => return Ok(first_visit(&node, &req, &id, port, &token)),
            Some(Carried::Cookie(_)) => {}
            None if presented => return Err(NodeError::sandbox_not_found()),
            None => return Err(denied),
        }
    }
    // Whatever the preview brought stays here.
    let query = previews::query_without_token(req.uri());
    match previews::cookies_without_preview(req.headers()) {
        Some(rest) => {
            let v = HeaderValue::from_str(&rest).map_err(|_| NodeError::bad_request("cookie"))?;
            req.headers_mut().insert(header::COOKIE, v);
        }
        None => drop(req.headers_mut().remove(header::COOKIE)),
    }
    let closed = |why: String| NodeError::new(Code::PortClosed, format!("port {port}: {why}"));
    // A hibernated sandbox wakes, as on the relay.
    let (live, agent) = node.open_agent(&id).await?;
    let active = Active::new(&live);
    let (rd, wr) = agent.into_split();
    let (mut rd, mut wr) = (FrameReader::new(rd), FrameWriter::new(wr));
    wr.send(&Frame::PortForward { port }).await.map_err(|e| closed(e.to_string()))?;
    match rd.recv().await {
        Ok(Some(Frame::Ready)) => {}
        Ok(Some(Frame::Error(e))) => return Err(closed(e.message)),
        other => return Err(closed(format!("silkd answered {other:?}"))),
    }
    // The forwarded bytes as a stream hyper can speak HTTP/1.1 over.
    let (ours, theirs) = tokio::io::duplex(64 << 10);
    tokio::spawn(async move {
        let _active = active; // in use while the connection is open
        let (mut from_http, mut to_http) = tokio::io::split(theirs);
        let up = async {
            let mut buf = BytesMut::new();
            loop {
                buf.reserve(32 << 10);
                if from_http.read_buf(&mut buf).await.unwrap_or(0) == 0 {
                    let _ = wr.send(&Frame::Eof).await;
                    return std::future::pending::<()>().await;
                }
                if wr.send(&Frame::Data(buf.split().freeze())).await.is_err() {
                    return;
                }
            }
        };
        let down = async {
            loop {
                match rd.recv().await {
                    Ok(Some(Frame::Data(b))) => {
                        if to_http.write_all(&b).await.is_err() {
                            return;
                        }
                    }
                    Ok(Some(Frame::Eof)) => drop(to_http.shutdown().await),
                    _ => return, // `Done`, an error, or silkd gone
                }
            }
        };
        tokio::select! {
            () = up => {}
            () = down => {}
        }
    });
    let failed = |e: hyper::Error| closed(e.to_string());
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(TokioIo::new(ours)).await.map_err(failed)?;
    tokio::spawn(async move {
        if let Err(e) = conn.with_upgrades().await {
            tracing::debug!("port connection: {e}");
        }
    });

    let client_upgrade = req.extensions_mut().remove::<hyper::upgrade::OnUpgrade>();
    let upgrading = req.headers().contains_key(header::UPGRADE);
    let query = query.map(|q| format!("?{q}")).unwrap_or_default();
    *req.uri_mut() = format!("/{path}{query}")
        .parse()
        .map_err(|e| NodeError::bad_request(format!("path: {e}")))?;
    let headers = req.headers_mut();
    super::edge::strip_hop_by_hop(headers, upgrading);
    headers.remove(header::AUTHORIZATION);
    if let Some(host) = headers.remove(header::HOST) {
        headers.insert("x-forwarded-host", host);
    }
    let host = HeaderValue::from_str(&format!("localhost:{port}")).expect("a valid host");
    headers.insert(header::HOST, host);

    let mut res = sender.send_request(req).await.map_err(failed)?;
    let switched = res.status() == StatusCode::SWITCHING_PROTOCOLS;
    super::edge::strip_hop_by_hop(res.headers_mut(), switched);
    if switched && let Some(client_side) = client_upgrade {
        let server_side = hyper::upgrade::on(&mut res);
        tokio::spawn(async move {
            let (Ok(client), Ok(server)) = (client_side.await, server_side.await) else { return };
            let (mut client, mut server) = (TokioIo::new(client), TokioIo::new(server));
            if let Err(e) = tokio::io::copy_bidirectional(&mut client, &mut server).await {
                tracing::debug!("port upgrade ended: {e}");
            }
        });
    }
    Ok(res.map(Body::new))
}
