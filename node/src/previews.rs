//! Preview URLs: a port of a sandbox opened to whoever holds a signed, expiring token, without
//! the sandbox token (a browser). A token is `pv_{port}_{expires_ms}_{nonce}_{mac}`: the mac is
//! a keyed blake3 of the sandbox id, port, expiry and nonce under the fleet's preview key (kept
//! in the store, so every node checks any node's tokens); the claim keeps a hash of each live
//! one, so a revoked token, an expired one and every token of a released sandbox are refused.
//! The first visit with `?token=` sets a cookie and is sent on to the same address without the
//! token; the page's own requests carry the cookie. With `preview_domain` set, a request to
//! `{port}-{id}.{preview_domain}` is one to `/v1/sandboxes/{id}/ports/{port}/` on any node.

use axum::http::{HeaderMap, Uri, header};
use serde::{Deserialize, Serialize};

use crate::claims::{constant_time_eq, hash_token, random_hex};

/// The cookie a visited preview leaves.
pub const COOKIE: &str = "silkmesh_preview";
/// The query parameter of a preview URL.
const QUERY: &str = "token";
/// At most this many live previews per sandbox.
pub const MAX_PER_SANDBOX: usize = 64;
/// Previews last an hour unless asked otherwise, and at most a day.
pub const DEFAULT_TTL: u64 = 3600;
pub const MAX_TTL: u64 = 86_400;

/// A live preview as its claim keeps it: the token's hash, never the token.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Grant {
    pub hash: String,
    pub port: u16,
    pub expires_ms: u64,
}

/// A token's parts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Token {
    pub port: u16,
    pub expires_ms: u64,
    nonce: String,
    mac: String,
}

fn mac(key: &[u8; 32], id: &str, port: u16, expires_ms: u64, nonce: &str) -> String {
    let signed = format!("{id}\n{port}\n{expires_ms}\n{nonce}");
    blake3::keyed_hash(key, signed.as_bytes()).to_hex()[..32].to_string()
}

/// A new token for port `port` of sandbox `id`, and the grant its claim keeps.
pub fn issue(key: &[u8; 32], id: &str, port: u16, expires_ms: u64) -> (String, Grant) {
    let nonce = random_hex(16);
    let mac = mac(key, id, port, expires_ms, &nonce);
    let token = format!("pv_{port}_{expires_ms}_{nonce}_{mac}");
    let grant = Grant { hash: hash_token(&token), port, expires_ms };
    (token, grant)
}

impl Token {
    pub fn parse(text: &str) -> Option<Token> {
        let mut parts = text.strip_prefix("pv_")?.split('_');
        let port = parts.next()?.parse().ok()?;
        let expires_ms = parts.next()?.parse().ok()?;
        let (nonce, mac) = (parts.next()?.to_string(), parts.next()?.to_string());
        let hex = |s: &str, n: usize| s.len() == n && s.bytes().all(|b| b.is_ascii_hexdigit());
        (parts.next().is_none() && hex(&nonce, 32) && hex(&mac, 32)).then_some(Token {
            port,
            expires_ms,
            nonce,
            mac,
        })
    }

    /// Whether it opens port `port` of sandbox `id` now, as signed under `key`.
    pub fn valid(&self, key: &[u8; 32], id: &str, port: u16, now_ms: u64) -> bool {
        let want = mac(key, id, self.port, self.expires_ms, &self.nonce);
        self.port == port
            && self.expires_ms > now_ms
            && constant_time_eq(want.as_bytes(), self.mac.as_bytes())
    }
}

/// Where a request carries a preview token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Carried {
    /// `?token=`: the first visit.
    Query(String),
    Cookie(String),
}

impl Carried {
    pub fn token(&self) -> &str {
        match self {
            Carried::Query(t) | Carried::Cookie(t) => t,
        }
    }
}

/// The preview tokens a request carries: its query's, then every cookie of the name (a page
/// may have set one of its own: each is tried, so it cannot shadow the real one).
pub fn carried(uri: &Uri, headers: &HeaderMap) -> Vec<Carried> {
    let in_query = uri.query().into_iter().flat_map(|q| q.split('&')).filter_map(|pair| {
        pair.strip_prefix(QUERY)?.strip_prefix('=').filter(|t| t.starts_with("pv_"))
    });
    let in_query = in_query.map(|t| Carried::Query(t.to_string()));
    let in_cookies = cookies(headers).filter(|(k, _)| *k == COOKIE);
    in_query.chain(in_cookies.map(|(_, v)| Carried::Cookie(v.to_string()))).take(8).collect()
}

fn cookies(headers: &HeaderMap) -> impl Iterator<Item = (&str, &str)> {
    headers
        .get_all(header::COOKIE)
        .into_iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|c| c.trim().split_once('='))
}

/// The query without the preview token (`None`: nothing else was in it).
pub fn query_without_token(uri: &Uri) -> Option<String> {
    let kept: Vec<&str> = uri
        .query()?
        .split('&')
        .filter(|p| {
            !p.strip_prefix(QUERY)
                .and_then(|r| r.strip_prefix('='))
                .is_some_and(|t| t.starts_with("pv_"))
        })
        .collect();
    (!kept.is_empty()).then(|| kept.join("&"))
}

/// The `Cookie` header without the preview's (`None`: nothing else was in it).
pub fn cookies_without_preview(headers: &HeaderMap) -> Option<String> {
    let kept: Vec<String> =
        cookies(headers).filter(|(k, _)| *k != COOKIE).map(|(k, v)| format!("{k}={v}")).collect();
    (!kept.is_empty()).then(|| kept.join("; "))
}

/// `{port}-{id}.{domain}` (the domain in any case, a `:port` after it): the sandbox and port
/// it names. Ids are lower-case letters, digits and dashes; anything else names none.
pub fn host_route(host: &str, domain: &str) -> Option<(String, u16)> {
    let host = host
        .rsplit_once(':')
        .filter(|(_, p)| p.bytes().all(|b| b.is_ascii_digit()))
        .map_or(host, |(h, _)| h);
    let cut = host.len().checked_sub(domain.len() + 1)?;
    let (label, rest) = (host.get(..cut)?, host.get(cut..)?);
    if !rest.strip_prefix('.')?.eq_ignore_ascii_case(domain) {
        return None;
    }
    let (port, id) = label.split_once('-')?;
    let port = port.parse().ok().filter(|p| *p != 0)?;
    let id = id.to_ascii_lowercase();
    let fits = |b: u8| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-';
    (!id.is_empty() && id.bytes().all(fits)).then_some((id, port))
}

/// A new key for the fleet's previews.
pub fn new_key() -> [u8; 32] {
    let hex = random_hex(32);
    let mut key = [0u8; 32];
    for (i, b) in key.iter_mut().enumerate() {
        *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).expect("hex");
    }
    key
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_open_their_sandbox_and_port_until_they_expire() {
        let key = new_key();
        let (token, grant) = issue(&key, "sb-a", 8080, 2_000);
        assert_eq!(grant.hash, hash_token(&token));
        let t = Token::parse(&token).unwrap();
        assert!(t.valid(&key, "sb-a", 8080, 1_999));
        assert!(!t.valid(&key, "sb-a", 8080, 2_000), "expired");
        assert!(!t.valid(&key, "sb-b", 8080, 0), "another sandbox");
        assert!(!t.valid(&key, "sb-a", 8081, 0), "another port");
        assert!(!t.valid(&new_key(), "sb-a", 8080, 0), "another fleet's key");
        // A longer expiry written into the token breaks its mac.
        let forged = token.replacen("_2000_", "_9999999_", 1);
        assert!(!Token::parse(&forged).unwrap().valid(&key, "sb-a", 8080, 0));
        for bad in ["", "pv_", "pv_80_1_aa_bb", &format!("{token}_x"), &token.replace("pv_", "pw_")]
        {
            assert_eq!(Token::parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn the_token_is_found_in_the_query_or_a_cookie_and_taken_out() {
        let uri: Uri = "/a?x=1&token=pv_1_2_3&y=2".parse().unwrap();
        let mut headers = HeaderMap::new();
        assert_eq!(carried(&uri, &headers), [Carried::Query("pv_1_2_3".into())]);
        assert_eq!(query_without_token(&uri).as_deref(), Some("x=1&y=2"));
        let only: Uri = "/a?token=pv_1".parse().unwrap();
        assert_eq!(query_without_token(&only), None);
        // An app's own `token` parameter is not a preview's: it stays.
        let app: Uri = "/a?token=abc".parse().unwrap();
        assert_eq!(carried(&app, &headers), []);
        assert_eq!(query_without_token(&app).as_deref(), Some("token=abc"));
        // A page's own cookie of the name (set for a parent domain) does not shadow the node's.
        headers.insert(
            header::COOKIE,
            "a=1; silkmesh_preview=pv_page; silkmesh_preview=pv_x; b=2".parse().unwrap(),
        );
        let both = [Carried::Cookie("pv_page".into()), Carried::Cookie("pv_x".into())];
        assert_eq!(carried(&"/".parse().unwrap(), &headers), both);
        assert_eq!(cookies_without_preview(&headers).as_deref(), Some("a=1; b=2"));
    }

    #[test]
    fn preview_hosts_name_a_port_and_a_sandbox() {
        let d = "preview.example.com";
        let route = |id: &str, port| Some((id.to_string(), port));
        assert_eq!(host_route("8080-sb-a1-b2.preview.example.com", d), route("sb-a1-b2", 8080));
        assert_eq!(host_route("3000-sb-x.preview.example.com:443", d), route("sb-x", 3000));
        assert_eq!(host_route("3000-SB-X.Preview.Example.COM", d), route("sb-x", 3000));
        for bad in [
            "preview.example.com",
            "sb-x.preview.example.com",
            "0-sb.preview.example.com",
            "8080-.preview.example.com",
            "8080-a.b.preview.example.com",
            "8080-sbevilpreview.example.com",
            "8080-sb.other.com",
            "8080-a/v1/x.preview.example.com",
            "8080-a%2e.preview.example.com",
            "8080-é.preview.example.com",
        ] {
            assert_eq!(host_route(bad, d), None, "{bad}");
        }
    }
}
