//! The node in the mesh: it publishes its state (warm counts per pool, goldens, load,
//! draining), places claims it cannot serve on a peer with warm capacity, finds the owner of a
//! sandbox id it does not hold, and answers its peers' calls.
//!
//! Placement is power of two choices among live, non-draining peers with a warm sandbox for the
//! pool key. Ownership: an id names its home node (`sb-<tag>-…`, the tag a hash of the node's
//! name); a node asks the home first, then every peer at once. A lookup carries the caller's
//! token and the owner checks it, so a wrong token answers the same 404 on every node. Answers
//! that authorized a token are cached for a few seconds per (id, token), and dropped when the
//! cached owner answers 404 or leaves the mesh.
//!
//! Peer calls are QUIC streams (see `silk_mesh::wire`): `Lookup`, and for forward mode `Http`
//! (an API request run by the owner's own router) and `Relay` (the data plane spliced through).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::Request;
use serde::{Deserialize, Serialize};
use silk_mesh::{Incoming, Mesh, Peer, quinn, wire};
use tokio::task::JoinSet;

use crate::claims::{random_hex, token_matches};
use crate::error::{Code, NodeError};
use crate::node::Node;

const CACHE_TTL: Duration = Duration::from_secs(5);
const PUBLISH_EVERY: Duration = Duration::from_millis(200);

/// A call from one node to another.
#[derive(Debug, Serialize, Deserialize)]
pub enum PeerRequest {
    /// Do you hold sandbox `id`, and may `token` act on it?
    Lookup { id: String, token: Option<String> },
    /// Run this API request as if a client had sent it to you.
    Http {
        method: String,
        uri: String,
        token: Option<String>,
        content_type: Option<String>,
        body: Vec<u8>,
    },
    /// Splice this stream to sandbox `id`'s silkd.
    Relay { id: String, token: Option<String> },
    /// Take over sandbox `record` (JSON), whose files are the store archive `archive`: start it
    /// here under the same id and token, and journal it. Answered `Http` 200 once journalled.
    Adopt { record: Vec<u8>, archive: String },
}

#[derive(Debug, Serialize, Deserialize)]
pub enum PeerReply {
    /// `adopting`: the sandbox is being started here (a move or a wake) and not yet journalled.
    Lookup { owned: bool, authorized: bool, adopting: bool },
    /// An HTTP answer; for `Relay`, status 101 means the stream now carries silk-proto.
    Http { status: u16, location: Option<String>, content_type: Option<String>, body: Vec<u8> },
}

/// The 8-hex tag of a node name that sandbox ids carry.
pub fn home_tag(name: &str) -> String {
    blake3::hash(name.as_bytes()).to_hex()[..8].to_string()
}

/// A fresh sandbox id homed on the node named `name`.
pub fn new_sandbox_id(name: &str) -> String {
    format!("sb-{}-{}", home_tag(name), random_hex(6))
}

/// Where a sandbox is, as far as the mesh can tell.
#[derive(Debug, Clone)]
pub enum Located {
    /// A live peer holds it and the token may use it.
    Owner(Box<Peer>),
    /// A live peer holds it; the token may not use it (the same 404 as an unknown id).
    Denied,
    /// Every live peer answered, and none holds it.
    Nobody,
    /// Some peer did not answer, or one is taking it over right now: try again shortly.
    Unknown,
}

/// The mesh side of a node.
#[derive(Debug)]
pub struct Peers {
    pub mesh: Mesh,
    /// Forward claims and the data plane instead of redirecting (nodes behind a load balancer).
    pub forward: bool,
    owners: Mutex<HashMap<String, (String, Instant)>>,
}

impl Peers {
    pub fn new(mesh: Mesh, forward: bool) -> Peers {
        Peers { mesh, forward, owners: Mutex::new(HashMap::new()) }
    }

    fn owners(&self) -> std::sync::MutexGuard<'_, HashMap<String, (String, Instant)>> {
        self.owners.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A peer to send a claim for `key` to: power of two choices among live peers that are not
    /// draining and have a warm sandbox for it.
    pub fn pick(&self, key: &str) -> Option<Peer> {
        let live = self.mesh.peers();
        let candidates: Vec<&Peer> = live
            .iter()
            .filter(|p| {
                p.state.as_ref().is_some_and(|s| {
                    !s.draining
                        && s.claims < s.capacity
                        && s.warm.get(key).copied().unwrap_or(0) > 0
                })
            })
            .collect();
        let score = |p: &Peer| {
            let s = p.state.as_ref().expect("filtered on state");
            (s.warm.get(key).copied().unwrap_or(0), u32::MAX - s.claims)
        };
        match candidates.len() {
            0 => None,
            1 => candidates.first().map(|p| (*p).clone()),
            n => {
                let r = cheap_random();
                let a = (r % n as u64) as usize;
                let b = (a + 1 + ((r >> 32) % (n as u64 - 1)) as usize) % n;
                let (pa, pb) = (&candidates[a], &candidates[b]);
                Some(if score(pb) > score(pa) { (*pb).clone() } else { (*pa).clone() })
            }
        }
    }

    /// The live peer that holds sandbox `id`, if `token` may act on it there. A recent answer
    /// for the same id and token is reused without asking (see [`Peers::forget`]).
    pub async fn locate(&self, id: &str, token: Option<&str>) -> Located {
        let live = self.mesh.peers();
        let by_name = |n: &str| live.iter().find(|p| p.id.name == n).cloned();
        let key = cache_key(id, token);
        let cached = self
            .owners()
            .get(&key)
            .filter(|(_, t)| t.elapsed() < CACHE_TTL)
            .map(|(n, _)| n.clone());
        if let Some(peer) = cached.as_deref().and_then(by_name) {
            // Forwarded calls trust the cache (a 404 from a stale owner is retried after
            // `forget`); a redirect cannot be taken back, so the owner confirms first.
            if self.forward || self.lookup(&peer, id, token).await.is_some_and(|l| l.0 && l.1) {
                return Located::Owner(Box::new(peer));
            }
            self.forget(id, token);
        }
        // The id's home node first, then everyone else at once.
        let home = id
            .split('-')
            .nth(1)
            .and_then(|tag| live.iter().find(|p| home_tag(&p.id.name) == tag))
            .map(|p| p.id.name.clone());
        let mut asked = vec![];
        for name in [home].into_iter().flatten() {
            if asked.contains(&name) {
                continue;
            }
            asked.push(name.clone());
            let Some(peer) = by_name(&name) else { continue };
            if let Some((true, authorized, _)) = self.lookup(&peer, id, token).await {
                return self.found(&key, peer, authorized);
            }
        }
        let mut unsure = false;
        let mut set = JoinSet::new();
        for peer in live.iter().filter(|p| !asked.contains(&p.id.name)).cloned() {
            let (mesh, id, token) = (self.mesh.clone(), id.to_string(), token.map(str::to_string));
            set.spawn(async move {
                let found = lookup(&mesh, &peer, &id, token.as_deref()).await;
                (peer, found)
            });
        }
        while let Some(joined) = set.join_next().await {
            match joined {
                Ok((peer, Some((true, authorized, _)))) => {
                    return self.found(&key, peer, authorized);
                }
                Ok((_, Some((false, _, adopting)))) => unsure |= adopting,
                Ok((_, None)) | Err(_) => unsure = true,
            }
        }
        if unsure { Located::Unknown } else { Located::Nobody }
    }

    /// Only authorized answers are cached: a wrong token is asked about every time, so it
    /// can never ride on another caller's answer.
    fn found(&self, key: &str, peer: Peer, authorized: bool) -> Located {
        if !authorized {
            return Located::Denied;
        }
        self.owners().insert(key.to_string(), (peer.id.name.clone(), Instant::now()));
        Located::Owner(Box::new(peer))
    }

    /// Drops a cached owner that turned out wrong (it answered 404: released or moved).
    pub fn forget(&self, id: &str, token: Option<&str>) {
        self.owners().remove(&cache_key(id, token));
    }

    async fn lookup(
        &self,
        peer: &Peer,
        id: &str,
        token: Option<&str>,
    ) -> Option<(bool, bool, bool)> {
        lookup(&self.mesh, peer, id, token).await
    }

    /// Sends an API request to `peer` to run as its own (forward mode).
    pub async fn forward(&self, peer: &Peer, req: PeerRequest) -> Result<PeerReply, NodeError> {
        let (mut send, mut recv) = self.mesh.open(&peer.id.name).await.map_err(unreachable_peer)?;
        wire::write_frame(&mut send, &req).await.map_err(unreachable_peer)?;
        let _ = send.finish();
        wire::read_frame(&mut recv)
            .await
            .map_err(unreachable_peer)?
            .ok_or_else(|| unreachable_peer("the peer closed the call"))
    }

    /// Asks `peer` to adopt a sandbox; `Ok` once the peer has journalled it.
    pub async fn adopt(
        &self,
        peer: &Peer,
        record: &crate::claims::ClaimRecord,
        archive: &str,
    ) -> Result<(), NodeError> {
        let record = serde_json::to_vec(record).map_err(|e| NodeError::internal(e.to_string()))?;
        let req = PeerRequest::Adopt { record, archive: archive.to_string() };
        match self.forward(peer, req).await? {
            PeerReply::Http { status: 200, .. } => Ok(()),
            PeerReply::Http { status, body, .. } => {
                let v: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
                let message = v["error"]["message"].as_str().unwrap_or("refused").to_string();
                let message = format!("{}: {message}", peer.id.name);
                // The target's own answer, status included.
                Err(NodeError {
                    status: Some(status),
                    ..NodeError::new(Code::MoveRefused, message)
                })
            }
            PeerReply::Lookup { .. } => Err(unreachable_peer("a lookup answer to an adopt")),
        }
    }

    /// Whether `peer` holds sandbox `id` (for settling a move): `None` while it cannot say
    /// (no answer, or still starting it).
    pub async fn holds(&self, peer: &Peer, id: &str) -> Option<bool> {
        match self.lookup(peer, id, None).await? {
            (_, _, true) => None,
            (owned, _, false) => Some(owned),
        }
    }

    /// Opens a relay to sandbox `id` on `peer`: after its 101 the streams carry silk-proto.
    pub async fn relay(
        &self,
        peer: &Peer,
        id: &str,
        token: Option<&str>,
    ) -> Result<(quinn::SendStream, quinn::RecvStream), PeerReply> {
        let failed = |m: String| error_reply(&NodeError::new(Code::PeerUnavailable, m));
        let (mut send, mut recv) =
            self.mesh.open(&peer.id.name).await.map_err(|e| failed(e.to_string()))?;
        let req = PeerRequest::Relay { id: id.to_string(), token: token.map(str::to_string) };
        wire::write_frame(&mut send, &req).await.map_err(|e| failed(e.to_string()))?;
        match wire::read_frame::<PeerReply>(&mut recv).await {
            Ok(Some(PeerReply::Http { status: 101, .. })) => Ok((send, recv)),
            Ok(Some(other)) => Err(other),
            Ok(None) => Err(failed("the peer closed the call".into())),
            Err(e) => Err(failed(e.to_string())),
        }
    }
}

/// A random number for placement, without a syscall: std's per-process random hash keys over a
/// counter.
fn cheap_random() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    use std::sync::atomic::{AtomicU64, Ordering};
    static KEYS: std::sync::OnceLock<std::collections::hash_map::RandomState> =
        std::sync::OnceLock::new();
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut h = KEYS.get_or_init(Default::default).build_hasher();
    h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    h.finish()
}

/// The cache is per (id, token): an answer for one token says nothing about another.
fn cache_key(id: &str, token: Option<&str>) -> String {
    let hash = blake3::hash(token.unwrap_or_default().as_bytes()).to_hex();
    format!("{id}:{}", &hash[..16])
}

fn unreachable_peer(e: impl std::fmt::Display) -> NodeError {
    NodeError::new(Code::PeerUnavailable, format!("peer: {e}"))
}

async fn lookup(
    mesh: &Mesh,
    peer: &Peer,
    id: &str,
    token: Option<&str>,
) -> Option<(bool, bool, bool)> {
    let call = async {
        let (mut send, mut recv) = mesh.open(&peer.id.name).await.ok()?;
        let req = PeerRequest::Lookup { id: id.to_string(), token: token.map(str::to_string) };
        wire::write_frame(&mut send, &req).await.ok()?;
        let _ = send.finish();
        match wire::read_frame::<PeerReply>(&mut recv).await.ok()?? {
            PeerReply::Lookup { owned, authorized, adopting } => {
                Some((owned, authorized, adopting))
            }
            PeerReply::Http { .. } => None,
        }
    };
    tokio::time::timeout(Duration::from_secs(2), call).await.ok().flatten()
}

/// Where a node remembers its peers' mesh addresses, to find them again after a restart even
/// when its configured seeds are gone or it is the seed itself.
pub fn known_peers_path(data_dir: &std::path::Path) -> std::path::PathBuf {
    data_dir.join("mesh-peers")
}

pub fn known_peers(data_dir: &std::path::Path) -> Vec<std::net::SocketAddr> {
    std::fs::read_to_string(known_peers_path(data_dir))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect()
}

/// Keeps this node's published state current (a change reaches peers at once), and the list
/// of known peers on disk.
pub async fn publish_loop(node: Arc<Node>, peers: Arc<Peers>) {
    let mut saved = String::new();
    loop {
        let mut addrs: Vec<String> =
            peers.mesh.peers().iter().map(|p| p.id.addr.to_string()).collect();
        addrs.sort();
        let text = addrs.join("\n");
        if !addrs.is_empty() && text != saved {
            let path = known_peers_path(&node.cfg.data_dir);
            if crate::durable::replace(&path, text.as_bytes()).is_ok() {
                saved = text;
            }
        }
        let state = node.mesh_state();
        peers.mesh.update(move |s| {
            s.warm = state.warm;
            s.goldens = state.goldens;
            s.templates = state.templates;
            s.claims = state.claims;
            s.capacity = state.capacity;
            s.draining = state.draining;
        });
        tokio::time::sleep(PUBLISH_EVERY).await;
    }
}

/// Answers peers' calls.
pub async fn serve(
    node: Arc<Node>,
    router: axum::Router,
    mut incoming: tokio::sync::mpsc::Receiver<Incoming>,
) {
    while let Some(call) = incoming.recv().await {
        let (node, router) = (node.clone(), router.clone());
        tokio::spawn(async move {
            if let Err(e) = answer(node, router, call).await {
                tracing::debug!("peer call: {e}");
            }
        });
    }
}

async fn answer(node: Arc<Node>, router: axum::Router, mut call: Incoming) -> Result<(), String> {
    let Some(req) =
        wire::read_frame::<PeerRequest>(&mut call.recv).await.map_err(|e| e.to_string())?
    else {
        return Ok(());
    };
    let reply = match req {
        PeerRequest::Lookup { id, token } => {
            let live = node.get(&id);
            let authorized = live.as_ref().is_some_and(|l| {
                token.as_deref().is_some_and(|t| token_matches(t, &l.record.token_hash))
                    || node.is_root(token.as_deref())
            });
            PeerReply::Lookup { owned: live.is_some(), authorized, adopting: node.is_adopting(&id) }
        }
        PeerRequest::Http { method, uri, token, content_type, body } => {
            let mut req = Request::builder().method(method.as_str()).uri(uri);
            if let Some(t) = token {
                req = req.header("authorization", format!("Bearer {t}"));
            }
            if let Some(ct) = content_type {
                req = req.header("content-type", ct);
            }
            let req = req.body(Body::from(body)).map_err(|e| e.to_string())?;
            let res = tower::ServiceExt::oneshot(router, req).await.map_err(|e| e.to_string())?;
            let status = res.status().as_u16();
            let (parts, body) = res.into_parts();
            let header =
                |n: &str| parts.headers.get(n).and_then(|v| v.to_str().ok()).map(str::to_string);
            let (location, content_type) = (header("location"), header("content-type"));
            let body = axum::body::to_bytes(body, 64 << 20).await.map_err(|e| e.to_string())?;
            PeerReply::Http { status, location, content_type, body: body.to_vec() }
        }
        PeerRequest::Relay { id, token } => return relay(node, call, &id, token.as_deref()).await,
        PeerRequest::Adopt { record, archive } => {
            let adopted = match serde_json::from_slice(&record) {
                Ok(record) => {
                    let n = node.clone();
                    crate::node::detached(async move { n.adopt(record, &archive).await }).await
                }
                Err(e) => Err(NodeError::bad_request(format!("adopt: {e}"))),
            };
            match adopted {
                Ok(()) => PeerReply::Http {
                    status: 200,
                    location: None,
                    content_type: None,
                    body: vec![],
                },
                Err(e) => error_reply(&e),
            }
        }
    };
    wire::write_frame(&mut call.send, &reply).await.map_err(|e| e.to_string())?;
    call.send.finish().map_err(|e| e.to_string())
}

/// An API error as a peer's HTTP answer, in the shape every error answer has.
fn error_reply(e: &NodeError) -> PeerReply {
    PeerReply::Http {
        status: crate::api::status(e).as_u16(),
        location: None,
        content_type: Some("application/json".into()),
        body: e.body().to_string().into_bytes(),
    }
}

/// The owner's end of a forwarded data-plane connection.
async fn relay(
    node: Arc<Node>,
    mut call: Incoming,
    id: &str,
    token: Option<&str>,
) -> Result<(), String> {
    // The same opening as a relay here: woken, or restarted if its silkd died.
    let opened = async {
        node.authorized(id, token)?;
        node.open_agent(id).await
    };
    let (live, mut agent) = match opened.await {
        Ok(v) => v,
        Err(e) => {
            wire::write_frame(&mut call.send, &error_reply(&e)).await.map_err(|e| e.to_string())?;
            return call.send.finish().map_err(|e| e.to_string());
        }
    };
    let ok = PeerReply::Http { status: 101, location: None, content_type: None, body: vec![] };
    wire::write_frame(&mut call.send, &ok).await.map_err(|e| e.to_string())?;
    let mut stream = tokio::io::join(call.recv, call.send);
    node.splice(&live, &mut stream, &mut agent).await;
    Ok(())
}

/// Starts this node's mesh endpoint. The epoch (persisted, +1 per start) versions its state, so
/// peers order its announcements without trusting any clock.
pub(crate) async fn start_mesh(
    cfg: &crate::config::Config,
    m: &crate::config::MeshSection,
) -> anyhow::Result<(Arc<crate::peers::Peers>, tokio::sync::mpsc::Receiver<silk_mesh::Incoming>)> {
    std::fs::create_dir_all(&cfg.data_dir)?;
    let path = cfg.data_dir.join("mesh-epoch");
    let epoch =
        std::fs::read_to_string(&path).ok().and_then(|s| s.trim().parse::<u64>().ok()).unwrap_or(0)
            + 1;
    crate::durable::replace(&path, epoch.to_string().as_bytes())?;
    let tls = silk_mesh::TlsFiles { ca: m.ca.clone(), cert: m.cert.clone(), key: m.key.clone() };
    silk_mesh::tls::check_own(&tls, &m.name)?;
    let mut mc = silk_mesh::MeshConfig::new(m.name.clone(), m.listen, tls);
    mc.join = m.join.clone();
    for known in crate::peers::known_peers(&cfg.data_dir) {
        if !mc.join.contains(&known) {
            mc.join.push(known);
        }
    }
    mc.epoch = epoch;
    mc.probe_period = Duration::from_millis(m.probe_period_ms);
    mc.probe_rtt = Duration::from_millis(m.probe_rtt_ms);
    mc.suspect_to_down = Duration::from_millis(m.suspect_to_down_ms);
    let api = m.advertise.clone().unwrap_or_else(|| format!("http://{}", cfg.listen));
    let state = silk_mesh::NodeState { api, public: m.public_url.clone(), ..Default::default() };
    let (mesh, incoming) = silk_mesh::Mesh::start(mc, state).await?;
    tracing::info!(name = m.name, addr = %mesh.id().addr, epoch, "mesh endpoint up");
    Ok((Arc::new(crate::peers::Peers::new(mesh, m.forward)), incoming))
}
