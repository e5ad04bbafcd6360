//! A token server for [`super::Auth::Token`]: the Docker registry token protocol
//! (distribution's docs, spec/auth/token.md and spec/auth/oauth.md), enough for skopeo and a
//! registry client to authenticate against a real `docker-registry`.
//!
//! `GET /token?service=…&scope=repository:NAME:pull,push` (the user's credentials in
//! `Authorization: Basic`) and the OAuth2 form `POST /token` (`grant_type=password`) answer
//! `{"token", "access_token", "expires_in"}`: a JWT signed ES256 by a P-256 key whose
//! self-signed certificate is the registry's `rootcertbundle`, carried in the header's `x5c`.
//! Right credentials get every action they ask for; no credentials get a token granting nothing
//! (the spec's anonymous user, who may then see `insufficient_scope` from the registry); wrong
//! credentials get 401.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::Engine;
use base64::engine::general_purpose::{STANDARD, URL_SAFE_NO_PAD};
use ring::signature::{ECDSA_P256_SHA256_FIXED_SIGNING, EcdsaKeyPair};
use serde_json::{Value, json};

/// What the registry's `auth.token` says: its `service` and the tokens' `iss`.
pub const SERVICE: &str = "silk-test-registry";
pub const ISSUER: &str = "silk-test-issuer";
/// How long a token lives, in seconds (`expires_in`).
const TTL: u64 = 300;

/// What each connection's handler shares.
struct Shared {
    user: String,
    password: String,
    key: EcdsaKeyPair,
    /// The certificate (DER, standard base64) the registry trusts: the JWT header's `x5c`.
    cert_b64: String,
    requests: AtomicUsize,
    stop: AtomicBool,
}

#[derive(Debug)]
pub struct TokenServer {
    pub addr: SocketAddr,
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared").field("user", &self.user).finish_non_exhaustive()
    }
}

impl TokenServer {
    /// Listens on `ip` (a free port) and writes the signing certificate to `cert_pem`, the file
    /// the registry's `rootcertbundle` names.
    pub fn start(ip: &str, user: &str, password: &str, cert_pem: &Path) -> TokenServer {
        let key_pair = rcgen::KeyPair::generate().expect("a P-256 key");
        let cert = rcgen::CertificateParams::new(vec![ISSUER.to_string()])
            .expect("certificate parameters")
            .self_signed(&key_pair)
            .expect("a self-signed certificate");
        std::fs::write(cert_pem, cert.pem()).expect("writing the token certificate");
        let key = EcdsaKeyPair::from_pkcs8(
            &ECDSA_P256_SHA256_FIXED_SIGNING,
            &key_pair.serialize_der(),
            &ring::rand::SystemRandom::new(),
        )
        .expect("ring reads rcgen's PKCS#8 key");
        let listener = TcpListener::bind((ip, 0))
            .unwrap_or_else(|e| panic!("token server: binding {ip}: {e}"));
        let addr = listener.local_addr().expect("a local address");
        let shared = Arc::new(Shared {
            user: user.into(),
            password: password.into(),
            key,
            cert_b64: STANDARD.encode(cert.der()),
            requests: AtomicUsize::new(0),
            stop: AtomicBool::new(false),
        });
        let s = shared.clone();
        let thread = std::thread::spawn(move || {
            for conn in listener.incoming() {
                if s.stop.load(Ordering::SeqCst) {
                    break;
                }
                let Ok(conn) = conn else { continue };
                let s = s.clone();
                // A thread per connection: a client that opens one and says nothing must not
                // hold up the others.
                std::thread::spawn(move || handle(&s, conn));
            }
        });
        TokenServer { addr, shared, thread: Some(thread) }
    }

    /// The realm the registry sends clients to.
    pub fn realm(&self) -> String {
        format!("http://{}/token", self.addr)
    }

    /// Requests made to `/token` so far, whatever their outcome.
    pub fn requests(&self) -> usize {
        self.shared.requests.load(Ordering::SeqCst)
    }

    /// A token for `user`/`password` granting `scope` (`repository:NAME:pull`), through the
    /// protocol itself.
    pub fn token(&self, scope: &str) -> String {
        let creds = STANDARD.encode(format!("{}:{}", self.shared.user, self.shared.password));
        let path = format!("/token?service={SERVICE}&scope={}", encode(scope));
        let (status, body) =
            super::http_get(self.addr, &path, &[("Authorization", &format!("Basic {creds}"))]);
        assert_eq!(status, 200, "token server: {}", String::from_utf8_lossy(&body));
        let v: Value = serde_json::from_slice(&body).expect("a JSON token answer");
        v["token"].as_str().expect("a token").to_string()
    }
}

impl Drop for TokenServer {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        // Wake the accept loop so it sees the flag and lets go of the port.
        let _ = TcpStream::connect(self.addr);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// One request on `conn`, answered and closed.
fn handle(s: &Shared, mut conn: TcpStream) {
    let _ = conn.set_read_timeout(Some(Duration::from_secs(10)));
    let Some((head, body)) = read_request(&mut conn) else { return };
    let mut lines = head.split("\r\n");
    let mut first = lines.next().unwrap_or("").split(' ');
    let (method, target) = (first.next().unwrap_or(""), first.next().unwrap_or(""));
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    let header = |name: &str| {
        head.split("\r\n").skip(1).find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.trim().eq_ignore_ascii_case(name).then(|| v.trim().to_string())
        })
    };
    let (status, answer) = if path != "/token" {
        (404, json!({"errors": [{"code": "NOT_FOUND", "message": path}]}))
    } else {
        s.requests.fetch_add(1, Ordering::SeqCst);
        match method {
            "GET" => {
                let basic = header("authorization").and_then(|h| basic_credentials(&h));
                issue(s, basic, &params(query))
            }
            "POST" => {
                let form = params(&body);
                let creds = match (form_value(&form, "username"), form_value(&form, "password")) {
                    (Some(u), Some(p)) => Some((u.to_string(), p.to_string())),
                    _ => None,
                };
                if form_value(&form, "grant_type") != Some("password") {
                    // Refresh tokens are never issued here, so nothing else can be valid.
                    (400, json!({"error": "unsupported_grant_type"}))
                } else {
                    issue(s, creds, &form)
                }
            }
            _ => (405, json!({"error": "method not allowed"})),
        }
    };
    let body = answer.to_string();
    let reason = if status == 200 { "OK" } else { "Error" };
    let _ = write!(
        conn,
        "HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
}

/// The answer to a token request: `creds` is what the client sent (None: anonymous).
fn issue(s: &Shared, creds: Option<(String, String)>, params: &[(String, String)]) -> (u16, Value) {
    let service = form_value(params, "service").unwrap_or(SERVICE);
    let scopes: Vec<&str> =
        params.iter().filter(|(k, _)| k == "scope").flat_map(|(_, v)| v.split(' ')).collect();
    let (subject, access) = match creds {
        None => (String::new(), Vec::new()),
        Some((u, p)) if u == s.user && p == s.password => {
            (u, scopes.iter().filter_map(|sc| access(sc)).collect())
        }
        Some(_) => {
            let refusal =
                json!({"errors": [{"code": "UNAUTHORIZED", "message": "wrong credentials"}]});
            return (401, refusal);
        }
    };
    let token = jwt(s, &subject, service, access);
    (200, json!({"token": token, "access_token": token, "expires_in": TTL}))
}

/// `repository:NAME:pull,push` as a claim's access entry (the name may hold colons: a port).
fn access(scope: &str) -> Option<Value> {
    let (kind, rest) = scope.split_once(':')?;
    let (name, actions) = rest.rsplit_once(':')?;
    let actions: Vec<&str> = actions.split(',').filter(|a| !a.is_empty()).collect();
    Some(json!({"type": kind, "name": name, "actions": actions}))
}

/// A JWT as distribution 2.8 checks it: ES256, the signing certificate in `x5c`, `iss` its
/// issuer, `aud` its service (a string: 2.8 reads no list there).
fn jwt(s: &Shared, subject: &str, service: &str, access: Vec<Value>) -> String {
    let now = SystemTime::now().duration_since(UNIX_EPOCH).expect("a clock after 1970").as_secs();
    let header = json!({"typ": "JWT", "alg": "ES256", "x5c": [s.cert_b64]});
    let claims = json!({
        "iss": ISSUER,
        "sub": subject,
        "aud": service,
        "exp": now + TTL,
        // A little in the past: the registry refuses a token from its future.
        "nbf": now - 10,
        "iat": now,
        "jti": format!("{now}-{}", s.requests.load(Ordering::SeqCst)),
        "access": access,
    });
    let signed = format!(
        "{}.{}",
        URL_SAFE_NO_PAD.encode(header.to_string()),
        URL_SAFE_NO_PAD.encode(claims.to_string())
    );
    let sig =
        s.key.sign(&ring::rand::SystemRandom::new(), signed.as_bytes()).expect("signing a token");
    format!("{signed}.{}", URL_SAFE_NO_PAD.encode(sig.as_ref()))
}

/// The head (up to the blank line) and the body (by Content-Length) of one request.
fn read_request(conn: &mut TcpStream) -> Option<(String, String)> {
    let mut raw = Vec::new();
    let mut buf = [0u8; 4096];
    let end = loop {
        if let Some(i) = raw.windows(4).position(|w| w == b"\r\n\r\n") {
            break i;
        }
        if raw.len() > 64 * 1024 {
            return None;
        }
        let n = conn.read(&mut buf).ok().filter(|&n| n > 0)?;
        raw.extend_from_slice(&buf[..n]);
    };
    let head = String::from_utf8_lossy(&raw[..end]).to_string();
    let length: usize = head
        .split("\r\n")
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.trim().eq_ignore_ascii_case("content-length").then(|| v.trim().parse().ok())?
        })
        .unwrap_or(0);
    let mut body = raw[end + 4..].to_vec();
    while body.len() < length {
        let n = conn.read(&mut buf).ok().filter(|&n| n > 0)?;
        body.extend_from_slice(&buf[..n]);
    }
    Some((head, String::from_utf8_lossy(&body).to_string()))
}

/// `Basic <base64 user:password>` as (user, password).
fn basic_credentials(header: &str) -> Option<(String, String)> {
    let (scheme, value) = header.split_once(' ')?;
    if !scheme.eq_ignore_ascii_case("basic") {
        return None;
    }
    let decoded = String::from_utf8(STANDARD.decode(value.trim()).ok()?).ok()?;
    let (u, p) = decoded.split_once(':')?;
    Some((u.into(), p.into()))
}

/// `a=1&b=2` (a query or a form body), percent-decoded, repeated keys kept.
fn params(query: &str) -> Vec<(String, String)> {
    query
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (decode(k), decode(v))
        })
        .collect()
}

fn form_value<'a>(params: &'a [(String, String)], key: &str) -> Option<&'a str> {
    params.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
}

fn decode(s: &str) -> String {
    let b = s.as_bytes();
    let hex = |c: u8| (c as char).to_digit(16);
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match (b[i], b.get(i + 1).and_then(|&c| hex(c)), b.get(i + 2).and_then(|&c| hex(c))) {
            (b'%', Some(hi), Some(lo)) => {
                out.push((hi * 16 + lo) as u8);
                i += 2;
            }
            (b'+', ..) => out.push(b' '),
            (c, ..) => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).to_string()
}

/// Percent-encodes everything but unreserved characters (a query value).
pub fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queries_and_forms_are_percent_decoded() {
        let p = params("scope=repository%3Asilk%2Fbusybox%3Apull%2Cpush&scope=a+b&bad=%zz%4");
        assert_eq!(form_value(&p, "scope"), Some("repository:silk/busybox:pull,push"));
        assert_eq!(p[1].1, "a b");
        assert_eq!(form_value(&p, "bad"), Some("%zz%4"));
        assert_eq!(decode(&encode("repository:a/b:pull")), "repository:a/b:pull");
    }

    #[test]
    fn a_scope_becomes_an_access_entry() {
        let a = access("repository:127.0.0.1:5000/x:pull,push").unwrap();
        assert_eq!(
            a,
            json!({"type": "repository", "name": "127.0.0.1:5000/x", "actions": ["pull", "push"]})
        );
        assert_eq!(access("nonsense"), None);
    }

    #[test]
    fn basic_credentials_are_read() {
        let h = format!("Basic {}", STANDARD.encode("bob:pa:ss"));
        assert_eq!(basic_credentials(&h), Some(("bob".into(), "pa:ss".into())));
        assert_eq!(basic_credentials("Bearer x"), None);
    }
}
