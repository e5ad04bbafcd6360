//! The fleet layer: this node in the mesh. It publishes the node's state (warm counts per pool,
//! goldens, load, draining), places claims the node cannot serve on a peer with warm capacity,
//! finds the owner of a sandbox id the node does not hold, carries moves (the controller's
//! [`Fleet`]), and answers its peers' calls. It sits above the controller and below the HTTP
//! layer, and imports neither's HTTP types: a forwarded HTTP call is handed up as a stream.
//!
//! Placement is power of two choices among live, non-draining peers with a warm sandbox for the
//! pool key. Ownership: an id names its home node (`sb-<tag>-…`, the tag a hash of the node's
//! name); a node asks the home first, then every peer at once. A lookup carries the caller's
//! token and the owner checks it, so a wrong token answers the same 404 on every node. Answers
//! that authorized a token are cached for a few seconds per (id, token), and dropped when the
//! cached owner answers 404 or leaves the mesh.
//!
//! Peer calls are QUIC streams (see `silk_mesh::wire`): a `Lookup`; a `Receive`, after which the
//! stream carries a moved sandbox's files (source to target, with no store between them); or
//! `Http`, after which it carries one HTTP/1.1 connection to the owner's own API (forward
//! mode: the request, its answer and an upgraded relay pass through unchanged and stream).
//! A `Receive` goes on the mesh's bulk lane (TLS on TCP, a third of QUIC's CPU per byte:
//! `silk_mesh::bulk`), or on QUIC where the peer's lane cannot be reached.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use silk_mesh::{Incoming, Mesh, Peer, wire};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::task::JoinSet;

use crate::claims::{ClaimRecord, home_tag};
use crate::error::{Code, NodeError};
use crate::node::Node;
use crate::node::fleet::{BoxFuture, Fleet, PeerNode, SnapshotBytes};

const CACHE_TTL: Duration = Duration::from_secs(5);
/// How long a sandbox moved away is answered "try again" here while its node is not a live
/// member: longer than a restart or a pause usually lasts, short enough that a node gone for
/// good stops being waited for.
const MOVED_TTL: Duration = Duration::from_secs(600);

mod hand_over;
mod moved;
const PUBLISH_EVERY: Duration = Duration::from_millis(200);

/// A call from one node to another.
#[derive(Debug, Serialize, Deserialize)]
pub enum PeerRequest {
    /// Do you hold sandbox `id`, and may `token` act on it?
    Lookup { id: String, token: Option<String> },
    /// The rest of this stream is an HTTP/1.1 connection to your API (forward mode).
    Http,
    /// Take over sandbox `record` (JSON), moved as `name`: its files follow on this stream up
    /// to its end (`snapshot` says what they are over). Start it here under the same id and
    /// token as they arrive, and journal it. Answered once journalled; a stream the sender
    /// reset instead of finishing is refused (its capture failed half way).
    Receive { record: Vec<u8>, name: String, snapshot: String },
}

#[derive(Debug, Serialize, Deserialize)]
pub enum PeerReply {
    /// `adopting`: the sandbox is being started here (a move or a wake) and not yet journalled.
    Lookup { owned: bool, authorized: bool, adopting: bool },
    /// The answer to `Receive`: `None` once journalled, else the refusal's code and message.
    Adopted { refused: Option<(String, String)> },
}

/// A peer's call stream, both ways.
pub type PeerStream = tokio::io::Join<
    std::pin::Pin<Box<dyn AsyncRead + Send>>,
    std::pin::Pin<Box<dyn AsyncWrite + Send>>,
>;

/// Where a sandbox is, as far as the mesh can tell.
#[derive(Debug, Clone)]
pub enum Located {
    /// A live peer holds it and the token may use it.
    Owner(Box<Peer>),
    /// A live peer holds it; the token may not use it (the same 404 as an unknown id).
    Denied,
    /// Every live peer answered, and none holds it. `moved_unasked`: this node moved it to a
    /// peer that was not live to be asked (it may well hold it still).
    Nobody { moved_unasked: bool },
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
    /// Sandboxes this node moved away (see [`Fleet::moved`]).
    moved: moved::MovedAway,
}

impl Peers {
    pub fn new(mesh: Mesh, forward: bool) -> Peers {
        Peers {
            mesh,
            forward,
            owners: Mutex::new(HashMap::new()),
            moved: moved::MovedAway::new(MOVED_TTL),
        }
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

    /// Whether a recent answer says who holds `id` for `token` (finding it costs no call).
    pub fn cached(&self, id: &str, token: Option<&str>) -> bool {
        let owners = self.owners();
        owners.get(&cache_key(id, token)).is_some_and(|(_, t)| t.elapsed() < CACHE_TTL)
    }

    /// The live peer that holds sandbox `id`, if `token` may act on it there. A recent answer
    /// for the same id and token is reused (see [`Peers::forget`]): as it is when `trust_cache`
    /// (the caller retries elsewhere if it was wrong), otherwise once the owner confirms it.
    pub async fn locate(&self, id: &str, token: Option<&str>, trust_cache: bool) -> Located {
        let live = self.mesh.peers();
        let by_name = |n: &str| live.iter().find(|p| p.id.name == n).cloned();
        let key = cache_key(id, token);
        let cached = self
            .owners()
            .get(&key)
            .filter(|(_, t)| t.elapsed() < CACHE_TTL)
            .map(|(n, _)| n.clone());
        if let Some(peer) = cached.as_deref().and_then(by_name) {
            if trust_cache || self.lookup(&peer, id, token).await.is_some_and(|l| l.0 && l.1) {
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
        if unsure {
            return Located::Unknown;
        }
        // Judged on the peers this lookup asked: a peer that comes back a moment later was not
        // asked, and its "not here" is not known.
        let moved_unasked = self.moved.peer_of(id).is_some_and(|to| by_name(&to).is_none());
        Located::Nobody { moved_unasked }
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

    /// Opens an HTTP/1.1 connection to `peer`'s API over a QUIC stream (forward mode).
    pub async fn open_http(&self, peer: &Peer) -> Result<PeerStream, NodeError> {
        let (mut send, recv) = self.mesh.open(&peer.id.name).await.map_err(unreachable_peer)?;
        wire::write_frame(&mut send, &PeerRequest::Http).await.map_err(unreachable_peer)?;
        Ok(tokio::io::join(Box::pin(recv), Box::pin(send)))
    }
}

impl Fleet for Peers {
    fn moved(&self, id: &str, peer: &str) {
        self.moved.record(id, peer);
    }

    fn tenant_seconds(&self, tenant: &str) -> u64 {
        let peers = self.mesh.peers();
        let seconds =
            |p: &Peer| p.state.as_ref().and_then(|s| s.tenant_seconds.get(tenant)).copied();
        peers.iter().filter_map(seconds).sum()
    }

    fn tenant_sandboxes(&self, tenant: &str) -> u64 {
        let peers = self.mesh.peers();
        let count = |p: &Peer| p.state.as_ref().and_then(|s| s.tenants.get(tenant)).copied();
        peers.iter().filter_map(count).map(u64::from).sum()
    }

    fn move_target(&self, to: Option<&str>) -> Result<PeerNode, NodeError> {
        let peer = match to {
            Some(name) if name == self.mesh.id().name => {
                return Err(NodeError::new(
                    Code::Conflict,
                    format!("the sandbox is on {name:?} already"),
                ));
            }
            Some(name) => self.mesh.peer(name).ok_or_else(|| {
                NodeError::new(Code::PeerNotFound, format!("no live peer {name:?}"))
            })?,
            None => self
                .mesh
                .peers()
                .iter()
                .filter(|p| p.state.as_ref().is_some_and(|s| !s.draining && s.claims < s.capacity))
                .min_by_key(|p| p.state.as_ref().map(|s| (s.claims, s.capacity)))
                .cloned()
                .ok_or_else(|| {
                    NodeError::new(Code::Conflict, "no live peer can take the sandbox")
                })?,
        };
        let api = peer.state.map(|s| s.api).unwrap_or_default();
        Ok(PeerNode { name: peer.id.name, api })
    }

    fn hand_over<'a>(
        &'a self,
        peer: &'a str,
        record: &'a ClaimRecord,
        name: &'a str,
        snapshot: &'a str,
        files: SnapshotBytes,
    ) -> BoxFuture<'a, Result<(), NodeError>> {
        Box::pin(async move {
            let record =
                serde_json::to_vec(record).map_err(|e| NodeError::internal(e.to_string()))?;
            let req = PeerRequest::Receive { record, name: name.into(), snapshot: snapshot.into() };
            let bulk = match self.mesh.bulk_lane() {
                true => self.mesh.open_bulk(peer).await.map_err(|e| {
                    tracing::warn!(peer, "the bulk lane: {e}; the files go on a QUIC stream");
                }),
                false => Err(()),
            };
            let (reply, captured) = match bulk {
                Ok(stream) => hand_over::bulk(stream, &req, files).await?,
                Err(()) => hand_over::quic(&self.mesh, peer, &req, files).await?,
            };
            match (reply, captured) {
                (PeerReply::Adopted { refused: None }, _) => Ok(()),
                (PeerReply::Adopted { .. }, Err(e)) => {
                    Err(NodeError::internal(format!("capturing the sandbox's files: {e}")))
                }
                (PeerReply::Adopted { refused: Some((code, message)) }, Ok(())) => {
                    Err(refusal(peer, &code, &message))
                }
                (PeerReply::Lookup { .. }, _) => {
                    Err(unreachable_peer("a lookup answer to a hand-over"))
                }
            }
        })
    }

    fn holds<'a>(&'a self, peer: &'a str, id: &'a str) -> BoxFuture<'a, Option<bool>> {
        Box::pin(async move {
            let peer = self.mesh.peer(peer)?;
            match self.lookup(&peer, id, None).await? {
                (_, _, true) => None,
                (owned, _, false) => Some(owned),
            }
        })
    }
}

/// A target's refusal of a move, in its own code (and so its status: `node_full`, `draining`,
/// `insufficient_storage`, …); a code this build does not know is `move_refused`.
fn refusal(peer: &str, code: &str, message: &str) -> NodeError {
    let known = serde_json::from_value(serde_json::Value::String(code.to_string()));
    let code: Code = known.unwrap_or(Code::MoveRefused);
    NodeError::new(code, format!("{peer} refused the sandbox: {message}"))
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
            PeerReply::Adopted { .. } => None,
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
        let advert = node.advert();
        peers.mesh.update(move |s| {
            s.warm = advert.warm;
            s.goldens = advert.goldens;
            s.templates = advert.templates;
            s.claims = advert.claims;
            s.capacity = advert.capacity;
            s.draining = advert.draining;
            s.tenants = advert.tenants;
            s.tenant_seconds = advert.tenant_seconds;
        });
        tokio::time::sleep(PUBLISH_EVERY).await;
    }
}

/// Answers peers' calls; `http` serves a forwarded HTTP connection (the HTTP layer's router).
pub async fn serve<F, Fut>(
    node: Arc<Node>,
    mut incoming: tokio::sync::mpsc::Receiver<Incoming>,
    http: F,
) where
    F: Fn(PeerStream) -> Fut + Clone + Send + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    while let Some(call) = incoming.recv().await {
        let (node, http) = (node.clone(), http.clone());
        tokio::spawn(async move {
            if let Err(e) = answer(node, call, http).await {
                tracing::debug!("peer call: {e}");
            }
        });
    }
}

async fn answer<F, Fut>(node: Arc<Node>, mut call: Incoming, http: F) -> Result<(), String>
where
    F: Fn(PeerStream) -> Fut,
    Fut: Future<Output = ()>,
{
    let Some(req) =
        wire::read_frame::<PeerRequest>(&mut call.recv).await.map_err(|e| e.to_string())?
    else {
        return Ok(());
    };
    let reply = match req {
        PeerRequest::Lookup { id, token } => {
            let live = node.get(&id);
            let authorized = live.as_ref().is_some_and(|l| {
                let r = &l.record;
                node.may_act(token.as_deref(), r.tenant.as_deref(), &r.token_hash)
                    || token.as_deref().is_some_and(|t| crate::node::previews::granted(r, t, None))
            });
            PeerReply::Lookup { owned: live.is_some(), authorized, adopting: node.is_adopting(&id) }
        }
        PeerRequest::Http => {
            http(tokio::io::join(call.recv, call.send)).await;
            return Ok(());
        }
        PeerRequest::Receive { record, name, snapshot } => {
            let adopted = match serde_json::from_slice(&record) {
                Ok(record) => {
                    let (n, files) = (node.clone(), call.recv);
                    crate::node::detached(async move {
                        n.receive(record, &name, &snapshot, files).await
                    })
                    .await
                }
                Err(e) => Err(NodeError::bad_request(format!("receive: {e}"))),
            };
            let refused = adopted.err().map(|e| (e.code.as_str().to_string(), e.message));
            PeerReply::Adopted { refused }
        }
    };
    wire::write_frame(&mut call.send, &reply).await.map_err(|e| e.to_string())?;
    call.send.shutdown().await.map_err(|e| e.to_string())
}

/// The node's mesh certificate files, as configured.
pub fn tls_files(m: &crate::config::MeshSection) -> silk_mesh::TlsFiles {
    silk_mesh::TlsFiles { ca: m.ca.clone(), cert: m.cert.clone(), key: m.key.clone() }
}

/// Starts this node's mesh endpoint. The epoch (persisted, +1 per start) versions its state, so
/// peers order its announcements without trusting any clock.
pub async fn start(
    cfg: &crate::config::Config,
    m: &crate::config::MeshSection,
) -> anyhow::Result<(Arc<Peers>, tokio::sync::mpsc::Receiver<Incoming>)> {
    std::fs::create_dir_all(&cfg.data_dir)?;
    let path = cfg.data_dir.join("mesh-epoch");
    let epoch =
        std::fs::read_to_string(&path).ok().and_then(|s| s.trim().parse::<u64>().ok()).unwrap_or(0)
            + 1;
    crate::durable::replace(&path, epoch.to_string().as_bytes())?;
    let tls = tls_files(m);
    silk_mesh::tls::check_own(&tls, &m.name)?;
    let mut mc = silk_mesh::MeshConfig::new(m.name.clone(), m.listen, tls);
    mc.join = m.join.clone();
    for known in known_peers(&cfg.data_dir) {
        if !mc.join.contains(&known) {
            mc.join.push(known);
        }
    }
    mc.epoch = epoch;
    mc.probe_period = Duration::from_millis(m.probe_period_ms);
    mc.probe_rtt = Duration::from_millis(m.probe_rtt_ms);
    mc.suspect_to_down = Duration::from_millis(m.suspect_to_down_ms);
    mc.revoked = m.revoked.clone();
    mc.bulk_lane = m.bulk_lane;
    let api = m.advertise.clone().unwrap_or_else(|| cfg.own_url());
    let state = silk_mesh::NodeState { api, public: m.public_url.clone(), ..Default::default() };
    let (mesh, incoming) = silk_mesh::Mesh::start(mc, state).await?;
    tracing::info!(name = m.name, addr = %mesh.id().addr, epoch, "mesh endpoint up");
    Ok((Arc::new(Peers::new(mesh, m.forward)), incoming))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refused_move_answers_in_the_targets_code() {
        let e = refusal("b", "insufficient_storage", "below min_free_mib");
        assert_eq!(
            (e.code, e.message.as_str()),
            (Code::InsufficientStorage, "b refused the sandbox: below min_free_mib")
        );
        assert_eq!(refusal("b", "from_the_future", "?").code, Code::MoveRefused);
    }
}
