//! [`Client`]: one node's address and root token, and the node-level calls (claim, list, info,
//! pools). The shapes the node answers with are `silk_api`'s, the node's own types. An answer
//! field the SDK does not know yet is ignored (except in pool configurations, which the node
//! also reads and which refuse unknown fields) and an unknown tier reads as `Tier::Other`; a
//! size, lane or state value it does not know fails the call as a protocol error.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use hyper::Method;
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};

use crate::error::{Error, Result};
use crate::http::{Http, Opened, Opening, SANDBOX_HEADER};
use crate::sandbox::Sandbox;

/// The fleet's sandboxes, and the nodes that did not answer (their sandboxes are missing).
#[derive(Debug, Clone, Default)]
pub struct Listing {
    pub sandboxes: Vec<SandboxInfo>,
    pub unreachable: Vec<String>,
}

/// A node's HTTP API. Cheap to clone; clones share one connection pool.
#[derive(Debug, Clone)]
pub struct Client {
    inner: Arc<ClientInner>,
}

#[derive(Debug)]
pub(crate) struct ClientInner {
    pub(crate) http: Http,
    token: Option<String>,
    pub(crate) max_idle: usize,
    /// Closes its sandboxes' idle relay connections as they expire.
    reaper: crate::conn::Reaper,
}

/// Options for a [`Client`].
#[derive(Debug, Clone)]
pub struct ClientBuilder {
    url: String,
    token: Option<String>,
    connect_timeout: Duration,
    request_timeout: Duration,
    max_idle: usize,
    tls: crate::tls::TlsOptions,
}

impl ClientBuilder {
    /// The node's root API token (needed for claim, list, info and pools).
    pub fn token(mut self, token: impl Into<String>) -> Self {
        self.token = Some(token.into());
        self
    }

    /// Limit on dialling the node and on the relay's upgrade handshake (default 10 s).
    pub fn connect_timeout(mut self, d: Duration) -> Self {
        self.connect_timeout = d;
        self
    }

    /// Limit on one JSON request, answer included (default 120 s: a claim may build a golden).
    /// Relay calls (exec, files, ...) have no overall limit; give `exec` its own timeout.
    pub fn request_timeout(mut self, d: Duration) -> Self {
        self.request_timeout = d;
        self
    }

    /// For an `https://` node: trust the CA certificates in this PEM file instead of the
    /// system's (a private CA, or `sandboxd tls self-signed`'s `ca.pem`).
    pub fn ca_file(mut self, pem: impl Into<std::path::PathBuf>) -> Self {
        self.tls.ca = Some(pem.into());
        self
    }

    /// For an `https://` node that requires client certificates (`[tls] client_ca`): this
    /// certificate chain and key (PEM files).
    pub fn client_cert(
        mut self,
        chain: impl Into<std::path::PathBuf>,
        key: impl Into<std::path::PathBuf>,
    ) -> Self {
        self.tls.identity = Some((chain.into(), key.into()));
        self
    }

    /// Idle relay connections each sandbox handle keeps for reuse (default and maximum 8; 0
    /// dials a new connection for every call).
    pub fn max_idle_connections(mut self, n: usize) -> Self {
        self.max_idle = n;
        self
    }

    pub fn build(self) -> Result<Client> {
        let http = Http::new(&self.url, self.connect_timeout, self.request_timeout, &self.tls)?;
        let inner = ClientInner {
            http,
            token: self.token,
            max_idle: self.max_idle,
            reaper: Default::default(),
        };
        Ok(Client { inner: Arc::new(inner) })
    }
}

impl Client {
    /// A client for the node at `url` (`http://host:port`, or `https://` with the system's
    /// CAs), without a token.
    pub fn new(url: &str) -> Result<Client> {
        Client::builder(url).build()
    }

    pub fn builder(url: impl Into<String>) -> ClientBuilder {
        ClientBuilder {
            url: url.into(),
            token: None,
            connect_timeout: Duration::from_secs(10),
            request_timeout: Duration::from_secs(120),
            max_idle: crate::conn::MAX_IDLE,
            tls: crate::tls::TlsOptions::default(),
        }
    }

    /// The node's base URL as used for requests.
    pub fn url(&self) -> &str {
        self.inner.http.base()
    }

    pub(crate) fn http(&self) -> &Http {
        &self.inner.http
    }

    pub(crate) fn reaper(&self) -> &crate::conn::Reaper {
        &self.inner.reaper
    }

    pub(crate) fn max_idle(&self) -> usize {
        self.inner.max_idle
    }

    pub(crate) fn root_token(&self) -> Option<&str> {
        self.inner.token.as_deref()
    }

    pub(crate) async fn call<T: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        token: Option<&str>,
        body: Option<&Value>,
    ) -> Result<T> {
        let v = self.inner.http.json(method.clone(), path, token, body).await?;
        serde_json::from_value(v)
            .map_err(|e| Error::Protocol(format!("{method} {path}: unexpected answer: {e}")))
    }

    /// Starts a claim of a sandbox from `template` (`"host"` is built in); finish with
    /// [`ClaimBuilder::send`].
    pub fn claim(&self, template: impl Into<String>) -> ClaimBuilder {
        ClaimBuilder {
            client: self.clone(),
            template: template.into(),
            size: None,
            lane: None,
            egress: None,
            ttl: None,
            metadata: BTreeMap::new(),
            auto_release: false,
            answered: false,
        }
    }

    /// Every live claim on the node.
    pub async fn list(&self) -> Result<Vec<SandboxInfo>> {
        self.list_by(&[]).await
    }

    /// Live claims whose metadata has every `key = value` given, on every node of the fleet.
    /// A node that does not answer makes this an error (`peer_unavailable`) rather than a
    /// shorter list; [`listing`](Self::listing) returns what the others said and names it.
    pub async fn list_by(&self, metadata: &[(&str, &str)]) -> Result<Vec<SandboxInfo>> {
        let listing = self.listing(metadata).await?;
        if !listing.unreachable.is_empty() {
            return Err(Error::Api {
                status: 503,
                code: "peer_unavailable".into(),
                message: format!(
                    "nodes {} did not answer; their sandboxes are missing from the list",
                    listing.unreachable.join(", ")
                ),
            });
        }
        Ok(listing.sandboxes)
    }

    /// Every page of the fleet's list of live claims with the given metadata, and the nodes
    /// that did not answer.
    pub async fn listing(&self, metadata: &[(&str, &str)]) -> Result<Listing> {
        let mut query: Vec<String> = metadata
            .iter()
            .map(|(k, v)| format!("metadata={}", percent_encode(&format!("{k}={v}"))))
            .collect();
        query.push("limit=1000".into());
        let mut listing = Listing::default();
        let mut cursor: Option<String> = None;
        loop {
            let mut q = query.clone();
            if let Some(c) = &cursor {
                q.push(format!("cursor={}", percent_encode(c)));
            }
            let path = format!("/v1/sandboxes?{}", q.join("&"));
            let page: silk_api::SandboxList =
                self.call(Method::GET, &path, self.root_token(), None).await?;
            listing.sandboxes.extend(page.sandboxes);
            for n in page.unreachable {
                if !listing.unreachable.contains(&n) {
                    listing.unreachable.push(n);
                }
            }
            match page.next_cursor {
                Some(next) => cursor = Some(next),
                None => return Ok(listing),
            }
        }
    }

    /// Every node's report (root).
    pub async fn fleet(&self) -> Result<silk_api::FleetView> {
        self.call(Method::GET, "/v1/fleet", self.root_token(), None).await
    }

    /// The node: version, engine, claims, pools and their warm counts.
    pub async fn info(&self) -> Result<NodeInfo> {
        self.call(Method::GET, "/v1/info", self.root_token(), None).await
    }

    /// The warm pool configuration.
    pub async fn pools(&self) -> Result<Vec<PoolConfig>> {
        #[derive(Deserialize)]
        struct Pools {
            pools: Vec<PoolConfig>,
        }
        let p: Pools = self.call(Method::GET, "/v1/pools", self.root_token(), None).await?;
        Ok(p.pools)
    }

    /// A handle on an existing sandbox, checked with the node. `token` is the sandbox's own
    /// token; `None` uses the client's root token.
    pub async fn sandbox(&self, id: &str, token: Option<&str>) -> Result<Sandbox> {
        // With neither token the calls go unauthenticated: a node without an api_token (the
        // loopback default) accepts them; any other node answers 404.
        let token = token.or(self.root_token()).unwrap_or_default().to_string();
        let path = format!("/v1/sandboxes/{}", path_segment(id)?);
        let info: SandboxInfo = self.call(Method::GET, &path, Some(&token), None).await?;
        Ok(Sandbox::new(self.clone(), info, token, None, false))
    }
}

/// A claim being prepared; [`send`](Self::send) makes it.
#[derive(Debug)]
pub struct ClaimBuilder {
    client: Client,
    template: String,
    size: Option<Size>,
    lane: Option<Lane>,
    egress: Option<EgressPolicy>,
    ttl: Option<Duration>,
    metadata: BTreeMap<String, String>,
    auto_release: bool,
    answered: bool,
}

impl ClaimBuilder {
    pub fn size(mut self, size: Size) -> Self {
        self.size = Some(size);
        self
    }

    /// The network lane (`none` when unset: loopback only).
    pub fn lane(mut self, lane: Lane) -> Self {
        self.lane = Some(lane);
        self
    }

    /// Lane `egress` with this policy (it may only narrow the pool's, unless the client is
    /// root): names it may resolve and reach, `*.suffix` wildcards, IPv4 networks.
    pub fn egress(mut self, policy: EgressPolicy) -> Self {
        self.lane = Some(Lane::Egress);
        self.egress = Some(policy);
        self
    }

    /// The lease (whole seconds; the node's default when unset, capped by the node).
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = Some(ttl);
        self
    }

    /// A label; `list_by` filters on them.
    pub fn metadata(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.metadata.insert(key.into(), value.into());
        self
    }

    /// Release the sandbox when the last handle to it is dropped (see [`Sandbox::set_auto_release`]).
    pub fn auto_release(mut self, yes: bool) -> Self {
        self.auto_release = yes;
        self
    }

    /// Return only once the new sandbox's silkd answered `info`, after the claim, on the
    /// connection the handle goes on to use ([`Sandbox::answered`] has that answer). The node
    /// asks on the relay the claim opens and puts silkd's answer in its `101`, so this costs
    /// one round trip between the node and silkd, not one from here; where the node did not
    /// check (an older node, a relay that did not open), the handle asks itself.
    pub fn answered(mut self, yes: bool) -> Self {
        self.answered = yes;
        self
    }

    pub async fn send(self) -> Result<Sandbox> {
        let mut body = json!({ "template": self.template, "metadata": self.metadata });
        if let Some(size) = self.size {
            body["size"] = json!(size);
        }
        if let Some(ttl) = self.ttl {
            body["ttl_seconds"] = json!(ttl.as_secs().max(1));
        }
        if let Some(lane) = self.lane {
            body["lane"] = json!(lane);
        }
        if let Some(egress) = &self.egress {
            body["egress"] = json!(egress);
        }
        let c = &self.client;
        if c.max_idle() == 0 {
            // Nowhere to keep a connection: the claim alone.
            let claimed: Claimed =
                c.call(Method::POST, "/v1/sandboxes", c.root_token(), Some(&body)).await?;
            let sandbox = claimed.into_sandbox(c, self.auto_release);
            if self.answered {
                sandbox.ask_answered(None).await?;
            }
            return Ok(sandbox);
        }
        // The claim asks for the relay too: its connection becomes the sandbox's first, so the
        // first call needs no new connection and upgrade of its own.
        let body = serde_json::to_vec(&body).map_err(|e| Error::Invalid(e.to_string()))?;
        let token = c.root_token().unwrap_or_default();
        let opening = Opening {
            method: Method::POST,
            path: "/v1/sandboxes",
            token,
            body: body.into(),
            ask_info: self.answered,
        };
        let (claimed, relay, agent_info) =
            match c.http().open(opening, c.http().request_timeout).await? {
                Opened::Relay(stream, said) => {
                    let row = said.row.ok_or_else(|| {
                        Error::Protocol(format!("claim: a 101 without its {SANDBOX_HEADER} header"))
                    })?;
                    (parse_claimed(row.as_bytes())?, stream, said.agent_info)
                }
                // A node that did not switch answers the claim as JSON.
                Opened::Answer(_, body) => (parse_claimed(&body)?, None, None),
            };
        let sandbox = claimed.into_sandbox(c, self.auto_release);
        // A 101 whose socket could not be taken over still claimed: the first call dials.
        if let Some(stream) = relay {
            sandbox.adopt(stream);
        }
        if self.answered {
            sandbox.ask_answered(agent_info).await?;
        }
        Ok(sandbox)
    }
}

fn parse_claimed(json: &[u8]) -> Result<Claimed> {
    serde_json::from_slice(json)
        .map_err(|e| Error::Protocol(format!("POST /v1/sandboxes: unexpected answer: {e}")))
}

/// A new sandbox as the node answers it: its row, which carries its token (claim, branch, fork).
#[derive(Debug, Deserialize)]
#[serde(try_from = "SandboxInfo")]
pub(crate) struct Claimed {
    info: SandboxInfo,
    token: String,
    claim_micros: Option<u64>,
}

impl TryFrom<SandboxInfo> for Claimed {
    type Error = String;

    fn try_from(info: SandboxInfo) -> std::result::Result<Claimed, String> {
        let token = info.token.clone().ok_or("a new sandbox's answer without its token")?;
        Ok(Claimed { claim_micros: info.claim_micros, token, info })
    }
}

impl Claimed {
    pub(crate) fn into_sandbox(self, client: &Client, auto_release: bool) -> Sandbox {
        let took = self.claim_micros.map(Duration::from_micros);
        Sandbox::new(client.clone(), self.info, self.token, took, auto_release)
    }
}

pub use silk_api::{
    EgressPolicy, Lane, NodeInfo, PoolConfig, PoolStatus, Preview, SandboxState, Size, Tier,
};

/// One claim as the node reports it.
pub type SandboxInfo = silk_api::Sandbox;

/// A sandbox id as one path segment: ids are letters, digits and `-`/`_`; anything else would
/// change the route.
pub(crate) fn path_segment(id: &str) -> Result<&str> {
    let ok = !id.is_empty()
        && id.len() <= 128
        && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.');
    if ok && id != "." && id != ".." {
        Ok(id)
    } else {
        Err(Error::Invalid(format!("sandbox id {id:?}")))
    }
}

fn percent_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn claim_answers_parse_and_unknown_fields_are_ignored() {
        let v = json!({
            "id": "sb-1", "template": "host", "size": "small", "lane": "none", "tier": "warm",
            "state": "claimed", "owner": "127.0.0.1:1", "created_ms": 1, "deadline_ms": 2,
            "on_expire": "destroy", "metadata": {"a": "b"}, "agent_path": "/x", "lease_seconds": 3,
            "state_since_ms": 1, "from_checkpoint": null, "forked_from": null,
            "memory_snapshot": false, "new_field": 3
        });
        let info: SandboxInfo = serde_json::from_value(v).unwrap();
        assert_eq!((info.tier, info.metadata["a"].as_str()), (Tier::Warm, "b"));
        let t: Tier = serde_json::from_value(json!("teleported")).unwrap();
        assert_eq!(t, Tier::Other);
    }

    #[test]
    fn ids_cannot_change_the_route_and_filters_are_encoded() {
        assert!(path_segment("sb-abc_1").is_ok());
        for bad in ["", "..", "a/b", "a?b", "a b"] {
            assert!(path_segment(bad).is_err(), "{bad}");
        }
        assert_eq!(percent_encode("team=a b&c"), "team%3Da%20b%26c");
    }
}
