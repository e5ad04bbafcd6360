//! HTTP to the node: JSON requests on hyper-util's pooled client, and the `Upgrade: silkd`
//! handshake that turns a fresh TCP connection into a raw silk-proto byte stream. `https://`
//! addresses speak TLS ([`crate::tls`]) on both.
//!
//! Redirects: a `307` with a `Location` is followed **once**, to the same method and body, with
//! `no_redirect=1` added to the retried request's query so the node it lands on serves it rather
//! than redirecting again (DESIGN §7: at most one hop). A second `307` is an error. The bearer
//! token travels to the redirect target: in a mesh every node is a peer that must see it. When
//! the target cannot be reached (it died after the origin chose it), the call goes back to the
//! origin once, with `no_redirect=1`, and the origin serves it itself. An upgrade (the relay, a
//! claim) goes back only if the target could not be reached: one that took the request may have
//! acted on it. A redirect never changes the scheme: from `https://` to `http://` would send the
//! token in clear text.
//!
//! The upgrade uses hyper's connection-level client on a socket this module dials itself, then
//! downcasts the upgraded stream back to that `TcpStream` (or TLS stream): calls after the `101`
//! run on the bare connection, with no HTTP layer or extra buffer in the way. Over plain
//! `http://`, that socket is dialled ahead of need ([`crate::spare`]): a claim or a relay then pays no
//! TCP connect and no accept by the node on its path.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::header::{AUTHORIZATION, CONNECTION, CONTENT_TYPE, HOST, LOCATION, UPGRADE};
use hyper::{Method, Request, StatusCode, Uri};
use hyper_util::client::legacy::Client as Pooled;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use serde_json::Value;
use tokio::net::TcpStream;

use crate::conn::NodeStream;
use crate::error::{Error, Result};
use crate::spare::Spare;
use crate::tls::TlsOptions;

/// The query parameter a redirect's retry carries.
pub(crate) const NO_REDIRECT: &str = "no_redirect=1";

#[derive(Debug)]
pub(crate) struct Http {
    pooled: Pooled<hyper_rustls::HttpsConnector<HttpConnector>, Full<Bytes>>,
    /// `http(s)://host:port` plus an optional path prefix, without a trailing slash.
    base: String,
    /// Set for an `https://` base: the relay's TLS connections use it too.
    tls: Option<Arc<rustls::ClientConfig>>,
    pub(crate) connect_timeout: Duration,
    pub(crate) request_timeout: Duration,
    spare: Arc<Spare>,
}

impl Http {
    pub(crate) fn new(
        base_url: &str,
        connect_timeout: Duration,
        request_timeout: Duration,
        tls: &TlsOptions,
    ) -> Result<Http> {
        let uri: Uri =
            base_url.parse().map_err(|e| Error::Invalid(format!("address {base_url:?}: {e}")))?;
        let scheme = match uri.scheme_str() {
            Some(s @ ("http" | "https")) => s,
            Some(other) => {
                return Err(Error::Invalid(format!(
                    "address {base_url:?}: scheme {other:?} is not supported (use http:// or https://)"
                )));
            }
            None => {
                return Err(Error::Invalid(format!(
                    "address {base_url:?} needs http:// or https://"
                )));
            }
        };
        let authority = uri
            .authority()
            .ok_or_else(|| Error::Invalid(format!("address {base_url:?} has no host")))?;
        let base = format!("{scheme}://{authority}{}", uri.path().trim_end_matches('/'));
        let tls = (scheme == "https").then(|| crate::tls::client_config(tls)).transpose()?;
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(connect_timeout));
        // Only `https://` requests use it, and only an `https://` base makes them.
        connector.enforce_http(false);
        let mut config = match &tls {
            Some(config) => (**config).clone(),
            None => crate::tls::unused_config(),
        };
        // The connector offers the protocols it enables (HTTP/1.1) itself.
        config.alpn_protocols.clear();
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(config)
            .https_or_http()
            .enable_http1()
            .wrap_connector(connector);
        let pooled = Pooled::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(30))
            .pool_timer(TokioTimer::new())
            .build(connector);
        let spare = Arc::default();
        Ok(Http { pooled, base, tls, connect_timeout, request_timeout, spare })
    }

    pub(crate) fn base(&self) -> &str {
        &self.base
    }

    fn url(&self, path: &str) -> Result<Uri> {
        format!("{}{path}", self.base).parse().map_err(|e| Error::Invalid(format!("{path:?}: {e}")))
    }

    /// One JSON request; `Value::Null` for an empty success body (`204`).
    pub(crate) async fn json(
        &self,
        method: Method,
        path: &str,
        token: Option<&str>,
        body: Option<&Value>,
    ) -> Result<Value> {
        let body = match body {
            Some(v) => {
                Bytes::from(serde_json::to_vec(v).map_err(|e| Error::Invalid(e.to_string()))?)
            }
            None => Bytes::new(),
        };
        let origin = self.url(path)?;
        let mut uri = origin.clone();
        let mut hopped = false;
        let mut fell_back = false;
        loop {
            let mut req = Request::builder().method(method.clone()).uri(uri.clone());
            if let Some(t) = token.filter(|t| !t.is_empty()) {
                req = req.header(AUTHORIZATION, format!("Bearer {t}"));
            }
            if !body.is_empty() || method == Method::POST || method == Method::PUT {
                req = req.header(CONTENT_TYPE, "application/json");
            }
            let req =
                req.body(Full::new(body.clone())).map_err(|e| Error::Invalid(e.to_string()))?;
            let exchange = async {
                let res = self
                    .pooled
                    .request(req)
                    .await
                    .map_err(|e| Error::transport(format!("{method} {uri}"), e))?;
                let status = res.status();
                let location = res.headers().get(LOCATION).cloned();
                let bytes = res
                    .into_body()
                    .collect()
                    .await
                    .map_err(|e| Error::transport(format!("{method} {uri}: body"), e))?
                    .to_bytes();
                Ok::<_, Error>((status, location, bytes))
            };
            let answer = tokio::time::timeout(self.request_timeout, exchange)
                .await
                .map_err(|_| Error::timeout(&format!("{method} {path}")))
                .and_then(|r| r);
            let (status, location, bytes) = match answer {
                Ok(a) => a,
                // The node a redirect pointed at cannot be reached (it died since the origin
                // chose it): ask the origin once more, to serve the call itself.
                Err(Error::Transport { .. }) if hopped && !fell_back => {
                    fell_back = true;
                    uri = no_redirect(&origin)?;
                    continue;
                }
                Err(e) => return Err(e),
            };
            if status == StatusCode::TEMPORARY_REDIRECT {
                uri = redirect(&uri, location.as_ref(), &mut hopped)?;
                continue;
            }
            if !status.is_success() {
                return Err(api_error(status, &bytes));
            }
            if bytes.is_empty() {
                return Ok(Value::Null);
            }
            return serde_json::from_slice(&bytes)
                .map_err(|e| Error::Protocol(format!("{method} {path}: answer is not JSON: {e}")));
        }
    }

    /// `GET path` with `Upgrade: silkd` on a new connection; after the `101`, the bare socket.
    pub(crate) async fn upgrade(&self, path: &str, token: &str) -> Result<NodeStream> {
        let get = Opening { method: Method::GET, path, token, body: Bytes::new(), ask_info: false };
        match self.open(get, self.connect_timeout).await? {
            Opened::Relay(Some(stream), _) => Ok(stream),
            Opened::Relay(None, _) => {
                Err(Error::Protocol(format!("GET {path}: the relay did not open")))
            }
            Opened::Answer(status, _) => {
                Err(Error::Protocol(format!("GET {path}: {status} where the relay answers 101")))
            }
        }
    }

    /// A request with `Upgrade: silkd` on a new connection, within `limit` (the connect and TLS
    /// handshake within `connect_timeout`): the bare socket and the `101`'s [`SANDBOX_HEADER`] if
    /// the node switched, or a success answer's body if it did not (a node that does not offer
    /// the relay on this route). After a redirect, only a target that could not be reached sends
    /// the request back to the origin: one that took it may have acted on it (a claim).
    pub(crate) async fn open(&self, opening: Opening<'_>, limit: Duration) -> Result<Opened> {
        let origin = self.url(opening.path)?;
        let mut uri = origin.clone();
        let mut hopped = false;
        let mut fell_back = false;
        loop {
            // Only the origin has a spare connection: a redirect's target is dialled.
            let spare = (!hopped).then_some(&self.spare);
            let handshake =
                upgrade_once(&uri, &opening, self.tls.as_ref(), self.connect_timeout, spare);
            let outcome = tokio::time::timeout(limit, handshake)
                .await
                .map_err(|_| Error::timeout(&format!("{} {}", opening.method, opening.path)))
                .and_then(|r| r)?;
            match outcome {
                Upgraded::Unreachable(_) if hopped && !fell_back => {
                    fell_back = true;
                    uri = no_redirect(&origin)?;
                }
                Upgraded::Unreachable(e) => return Err(e),
                Upgraded::Stream(s, said) => return Ok(Opened::Relay(s, said)),
                Upgraded::Redirect(location) => {
                    uri = redirect(&uri, location.as_ref(), &mut hopped)?;
                }
                Upgraded::Refused(status, body) if status.is_success() => {
                    return Ok(Opened::Answer(status, body));
                }
                Upgraded::Refused(status, body) => return Err(api_error(status, &body)),
            }
        }
    }
}

/// The header of a claim's `101` that carries the new sandbox's row.
pub(crate) const SANDBOX_HEADER: &str = "silk-sandbox";
/// The request header (value `info`) by which a claim asks the node for silkd's `info` answer
/// on the relay before the `101`, and the `101`'s header that carries it.
const ASK_HEADER: &str = "silk-ask";
const AGENT_INFO_HEADER: &str = "silk-agent-info";

/// A request that asks for the relay.
pub(crate) struct Opening<'a> {
    pub(crate) method: Method,
    pub(crate) path: &'a str,
    pub(crate) token: &'a str,
    /// JSON, or empty for none.
    pub(crate) body: Bytes,
    /// Ask for silkd's `info` answer on the relay before the `101` (a claim).
    pub(crate) ask_info: bool,
}

/// What a `101` said besides switching: the new sandbox's row ([`SANDBOX_HEADER`]) and silkd's
/// `info` answer, if the request asked for it and the node checked.
#[derive(Debug, Default)]
pub(crate) struct Switched {
    pub(crate) row: Option<hyper::header::HeaderValue>,
    pub(crate) agent_info: Option<hyper::header::HeaderValue>,
}

/// How the node answered an [`Opening`].
pub(crate) enum Opened {
    /// `101`: the relay, and what the answer said. A `101` that carried a row is returned even
    /// if the socket could not be taken over (`None`): the node acted on the request (a
    /// claim), and its answer must reach the caller.
    Relay(Option<NodeStream>, Switched),
    /// A success without the switch, and its body.
    Answer(StatusCode, Bytes),
}

enum Upgraded {
    /// The connect or TLS handshake failed: nothing was sent.
    Unreachable(Error),
    Stream(Option<NodeStream>, Switched),
    Redirect(Option<hyper::header::HeaderValue>),
    Refused(StatusCode, Bytes),
}

async fn upgrade_once(
    uri: &Uri,
    opening: &Opening<'_>,
    tls: Option<&Arc<rustls::ClientConfig>>,
    connect_timeout: Duration,
    spare: Option<&Arc<Spare>>,
) -> Result<Upgraded> {
    let authority = uri.authority().ok_or_else(|| Error::Invalid(format!("{uri}: no host")))?;
    let tls = match uri.scheme_str() {
        Some("https") => Some(tls.ok_or_else(|| Error::Invalid(format!("{uri}: no TLS")))?),
        _ => None,
    };
    let port = authority.port_u16().unwrap_or(if tls.is_some() { 443 } else { 80 });
    let addr = format!("{}:{port}", authority.host());
    let connect = async {
        let tcp = TcpStream::connect(&addr)
            .await
            .map_err(|e| Error::transport(format!("connect {addr}"), e))?;
        tcp.set_nodelay(true).map_err(|e| Error::transport("set TCP_NODELAY", e))?;
        Ok::<_, Error>(tcp)
    };
    // A spare connection over plain TCP only (a TLS one would need its handshake kept fresh).
    let spare = spare.filter(|_| tls.is_none());
    let tcp = match spare.and_then(|s| s.take(&addr)) {
        Some(tcp) => tcp,
        None => match tokio::time::timeout(connect_timeout, connect).await {
            Ok(Ok(tcp)) => tcp,
            Ok(Err(e)) => return Ok(Upgraded::Unreachable(e)),
            Err(_) => {
                return Ok(Upgraded::Unreachable(Error::timeout(&format!("connect {addr}"))));
            }
        },
    };

    // The next spare is dialled in the background once this request is on its way: spawning
    // that rouses another worker, which is better spent while the node works on the request.
    let refill = || {
        if let Some(spare) = spare {
            spare.refill(addr.clone(), connect_timeout);
        }
    };
    Ok(match tls {
        None => match open_on(TokioIo::new(tcp), uri, opening, refill).await? {
            Answer::Switched(io, said) => {
                Upgraded::Stream(io.map(|io| NodeStream::Tcp(io.into_inner())), said)
            }
            Answer::Other(other) => other,
        },
        Some(config) => {
            let handshake = crate::tls::connect(config, authority.host(), tcp);
            let tls = match tokio::time::timeout(connect_timeout, handshake).await {
                Ok(Ok(tls)) => tls,
                Ok(Err(e)) => return Ok(Upgraded::Unreachable(e)),
                Err(_) => return Ok(Upgraded::Unreachable(Error::timeout("TLS handshake"))),
            };
            match open_on(TokioIo::new(tls), uri, opening, refill).await? {
                Answer::Switched(io, said) => {
                    Upgraded::Stream(io.map(|io| NodeStream::Tls(Box::new(io.into_inner()))), said)
                }
                Answer::Other(other) => other,
            }
        }
    })
}

/// What [`open_on`] got: the switched connection (see [`Opened::Relay`]) and what the `101`
/// said, or any other answer.
enum Answer<I> {
    Switched(Option<I>, Switched),
    Other(Upgraded),
}

/// `opening` with `Upgrade: silkd` on a fresh connection `io`; `sent` runs once the request is
/// written. hyper's connection future is driven here rather than spawned, so the answer and
/// the socket come back without a hop between tasks; it is spawned only to read the body of an
/// answer that did not switch.
async fn open_on<I>(
    io: I,
    uri: &Uri,
    opening: &Opening<'_>,
    sent: impl FnOnce(),
) -> Result<Answer<I>>
where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let authority = uri.authority().ok_or_else(|| Error::Invalid(format!("{uri}: no host")))?;
    let failed = |what: &str, e: hyper::Error| Error::transport(format!("{what} {uri}"), e);
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(io).await.map_err(|e| failed("handshake with", e))?;
    let mut conn = conn.with_upgrades();
    let path = uri.path_and_query().map_or("/", |p| p.as_str());
    let mut req = Request::builder()
        .method(opening.method.clone())
        .uri(path)
        .header(HOST, authority.as_str());
    if !opening.token.is_empty() {
        req = req.header(AUTHORIZATION, format!("Bearer {}", opening.token));
    }
    if !opening.body.is_empty() {
        req = req.header(CONTENT_TYPE, "application/json");
    }
    if opening.ask_info {
        req = req.header(ASK_HEADER, "info");
    }
    let req = req
        .header(CONNECTION, "upgrade")
        .header(UPGRADE, "silkd")
        .body(Full::new(opening.body.clone()))
        .map_err(|e| Error::Invalid(e.to_string()))?;
    let method = opening.method.as_str();
    let send = sender.send_request(req);
    tokio::pin!(send);
    let mut conn_ended = false;
    let mut sent = Some(sent);
    let res = loop {
        tokio::select! {
            biased;
            res = &mut send => break res.map_err(|e| failed(method, e))?,
            // Ended before the answer: `send` says how.
            ended = &mut conn, if !conn_ended => {
                conn_ended = true;
                ended.map_err(|e| failed(method, e))?;
            }
            // The connection's first poll above wrote the request.
            () = std::future::ready(()), if sent.is_some() => (sent.take().expect("guarded"))(),
        }
    };
    if res.status() == StatusCode::SWITCHING_PROTOCOLS {
        let said = Switched {
            row: res.headers().get(SANDBOX_HEADER).cloned(),
            agent_info: res.headers().get(AGENT_INFO_HEADER).cloned(),
        };
        let upgrade = hyper::upgrade::on(res);
        let switched = async {
            if !conn_ended {
                conn.await.map_err(|e| failed("upgrade", e))?;
            }
            let upgraded = upgrade.await.map_err(|e| failed("upgrade", e))?;
            let parts = upgraded
                .downcast::<I>()
                .map_err(|_| Error::Protocol("upgraded stream is not the dialled socket".into()))?;
            // silkd only ever answers, so nothing can follow the 101 before the first request.
            if !parts.read_buf.is_empty() {
                let n = parts.read_buf.len();
                return Err(Error::Protocol(format!("{n} unexpected bytes after the 101")));
            }
            Ok(parts.io)
        };
        return match switched.await {
            Ok(io) => Ok(Answer::Switched(Some(io), said)),
            // The node acted (claimed) and said so: that answer is kept, without the relay.
            Err(_) if said.row.is_some() => Ok(Answer::Switched(None, said)),
            Err(e) => Err(e),
        };
    }
    if !conn_ended {
        tokio::spawn(conn);
    }
    if res.status() == StatusCode::TEMPORARY_REDIRECT {
        return Ok(Answer::Other(Upgraded::Redirect(res.headers().get(LOCATION).cloned())));
    }
    let status = res.status();
    let body = res.into_body().collect().await.map(|b| b.to_bytes()).unwrap_or_default();
    Ok(Answer::Other(Upgraded::Refused(status, body)))
}

/// `uri` with `no_redirect=1` added to its query.
fn no_redirect(uri: &Uri) -> Result<Uri> {
    let s = uri.to_string();
    let s =
        if s.contains('?') { format!("{s}&{NO_REDIRECT}") } else { format!("{s}?{NO_REDIRECT}") };
    s.parse().map_err(|e| Error::Invalid(format!("{s}: {e}")))
}

/// The retry target of a `307`: `Location` resolved against `from`, with `no_redirect=1` added.
fn redirect(
    from: &Uri,
    location: Option<&hyper::header::HeaderValue>,
    hopped: &mut bool,
) -> Result<Uri> {
    let location = location
        .and_then(|l| l.to_str().ok())
        .ok_or_else(|| Error::Protocol(format!("307 from {from} without a usable Location")))?;
    if *hopped {
        return Err(Error::TooManyRedirects { location: location.to_string() });
    }
    *hopped = true;
    let scheme = from.scheme_str().unwrap_or("http");
    let target = if location.starts_with('/') {
        let authority = from.authority().map_or("", |a| a.as_str());
        format!("{scheme}://{authority}{location}")
    } else if location.starts_with(&format!("{scheme}://")) {
        location.to_string()
    } else {
        // Above all https → http: the retry carries the token, which must not go out in clear.
        return Err(Error::Protocol(format!(
            "307 to {location:?}: only {scheme}:// addresses and absolute paths are followed"
        )));
    };
    let target = if target.contains('?') {
        format!("{target}&{NO_REDIRECT}")
    } else {
        format!("{target}?{NO_REDIRECT}")
    };
    target.parse().map_err(|e| Error::Protocol(format!("307 to {location:?}: {e}")))
}

/// An error status as [`Error::Api`], from the node's `{"error": {"code", "message"}}` body when
/// there is one.
fn api_error(status: StatusCode, body: &[u8]) -> Error {
    let parsed: Option<Value> = serde_json::from_slice(body).ok();
    let field =
        |name: &str| parsed.as_ref().and_then(|v| v["error"][name].as_str()).map(str::to_string);
    Error::Api {
        status: status.as_u16(),
        code: field("code").unwrap_or_else(|| format!("http_{}", status.as_u16())),
        message: field("message")
            .unwrap_or_else(|| String::from_utf8_lossy(&body[..body.len().min(512)]).into_owned()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redirects_add_no_redirect_and_take_one_hop() {
        let from: Uri = "http://10.0.0.1:7777/v1/sandboxes".parse().unwrap();
        let mut hopped = false;
        let to = redirect(&from, Some(&"/v1/x?a=b".parse().unwrap()), &mut hopped).unwrap();
        assert_eq!(to.to_string(), "http://10.0.0.1:7777/v1/x?a=b&no_redirect=1");
        let again = redirect(&to, Some(&"http://peer:1/v1/y".parse().unwrap()), &mut hopped);
        assert!(matches!(again, Err(Error::TooManyRedirects { .. })));
        let mut fresh = false;
        let abs = redirect(&from, Some(&"http://peer:1/v1/y".parse().unwrap()), &mut fresh);
        assert_eq!(abs.unwrap().to_string(), "http://peer:1/v1/y?no_redirect=1");
        let mut fresh = false;
        assert!(redirect(&from, Some(&"https://peer/".parse().unwrap()), &mut fresh).is_err());
        assert!(redirect(&from, None, &mut false).is_err());
        // Over TLS, relative redirects stay on TLS and a downgrade is refused.
        let from: Uri = "https://10.0.0.1:7777/v1/sandboxes".parse().unwrap();
        let to = redirect(&from, Some(&"/v1/x".parse().unwrap()), &mut false).unwrap();
        assert_eq!(to.to_string(), "https://10.0.0.1:7777/v1/x?no_redirect=1");
        let down = redirect(&from, Some(&"http://peer:1/v1/y".parse().unwrap()), &mut false);
        assert!(matches!(down, Err(Error::Protocol(m)) if m.contains("only https://")));
    }

    #[test]
    fn error_bodies_become_typed_api_errors() {
        let e = api_error(
            StatusCode::NOT_FOUND,
            br#"{"error": {"code": "not_found", "message": "no such sandbox"}}"#,
        );
        assert!(matches!(e, Error::Api { status: 404, ref code, .. } if code == "not_found"));
        let e = api_error(StatusCode::BAD_GATEWAY, b"upstream down");
        assert!(
            matches!(e, Error::Api { status: 502, ref code, ref message } if code == "http_502" && message == "upstream down")
        );
        assert!(e.is_retryable());
    }

    #[test]
    fn only_http_and_https_addresses_are_accepted() {
        let d = Duration::from_secs(1);
        let none = TlsOptions::default();
        assert!(Http::new("ftp://x", d, d, &none).is_err());
        assert!(Http::new("127.0.0.1:7777", d, d, &none).is_err());
        let h = Http::new("http://127.0.0.1:7777/", d, d, &none).unwrap();
        assert_eq!(h.base(), "http://127.0.0.1:7777");
        assert_eq!(h.url("/v1/info").unwrap().to_string(), "http://127.0.0.1:7777/v1/info");
        let missing = TlsOptions { ca: Some("/nonexistent/ca.pem".into()), identity: None };
        assert!(Http::new("https://127.0.0.1:7777", d, d, &missing).is_err());
    }
}
