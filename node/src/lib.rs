//! sandboxd: the node daemon. It keeps warm pools, serves claims in three tiers (warm hit →
//! clone from golden → cold boot), keeps claims in a crash-safe journal under leases, relays the
//! data plane to each sandbox's silkd, and serves the HTTP API.
//!
//! Layers, imports pointing down only (docs/architecture.md): `api` (HTTP: routes, auth,
//! errors to statuses, the relay, the mesh at the edge) → `fleet` (this node in the mesh) →
//! `node` (the controller: claims, pools, lifecycle; no HTTP, no mesh) → `journal`, the engine,
//! the store. This file wires them together.

// The OpenAPI document is one `json!` literal (api/openapi.rs), deeper than the default limit.
#![recursion_limit = "256"]

pub mod api;
pub mod audit;
pub mod claims;
pub mod config;
mod durable;
pub mod e2b;
pub mod egress;
pub mod error;
pub mod fleet;
pub mod images;
mod in_place;
pub mod journal;
pub mod listen;
pub mod metrics;
pub mod node;
pub mod pool;
pub mod previews;
pub mod state;
pub mod stored;
pub mod tenants;
pub mod tls;
pub mod usage;

use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;

use silk_engine::jail::{JailConfig, JailEngine};

use config::Config;
use fleet::Peers;
use node::Node;

/// A node with its parts wired: the controller, and the mesh when configured.
#[derive(Debug)]
pub struct Daemon {
    pub node: Arc<Node>,
    pub peers: Option<Arc<Peers>>,
    incoming: Option<tokio::sync::mpsc::Receiver<silk_mesh::Incoming>>,
    tls: Option<Arc<rustls::ServerConfig>>,
    /// E2B's listener, bound at start (so it answers once the node says it listens).
    e2b: Option<tokio::net::TcpListener>,
    /// `<data>/node.lock`, held while the node runs (see [`start`]).
    _data_lock: std::fs::File,
}

/// Takes `<data>/node.lock` for this process, or says that another node runs on `data`.
fn lock_data_dir(data: &std::path::Path) -> anyhow::Result<std::fs::File> {
    let path = data.join("node.lock");
    let lock = std::fs::OpenOptions::new().create(true).truncate(false).write(true).open(&path)?;
    match lock.try_lock() {
        Ok(()) => Ok(lock),
        Err(std::fs::TryLockError::WouldBlock) => anyhow::bail!(
            "{} is already open in another process: a node runs there",
            data.display()
        ),
        Err(std::fs::TryLockError::Error(e)) => Err(e.into()),
    }
}

/// Starts a node on the jail engine: the controller (which reconciles what survived the last
/// run), then the mesh endpoint when configured, and the loop that publishes its state.
pub async fn start(cfg: Config) -> anyhow::Result<Daemon> {
    cfg.validate()?;
    // A certificate that does not load stops the start before anything else happens.
    let tls = cfg.tls.as_ref().map(tls::server_config).transpose()?;
    // Sandboxes' files, checkpoints and the journal live here: root's only.
    std::fs::create_dir_all(&cfg.data_dir)?;
    std::fs::set_permissions(&cfg.data_dir, std::os::unix::fs::PermissionsExt::from_mode(0o700))?;
    // Whatever can refuse the start is checked before the node touches the host: a second
    // process on a live data directory would otherwise rewrite the live node's firewall table
    // (steering its sandboxes to ports nothing listens on), and a refused start would leave a
    // table behind.
    let data_lock = lock_data_dir(&cfg.data_dir)?;
    if let Some(m) = &cfg.mesh {
        silk_mesh::tls::check_own(&fleet::tls_files(m), &m.name)?;
    }
    let e2b = match &cfg.e2b {
        Some(e2b) => Some(tokio::net::TcpListener::bind(e2b.listen).await?),
        None => None,
    };
    // The lane's firewall before any sandbox can use it: without it the engine offers no lane.
    let egress = egress::start(&cfg).await;
    let mut jail = jail_config(&cfg)?;
    jail.lane = egress.as_ref().and_then(|_| egress::lane_net(&cfg));
    let engine = Arc::new(JailEngine::new(jail)?);
    let mesh = cfg.mesh.clone();
    // The controller first: it takes the journal's lock, so a second process on this data
    // directory stops there, before it could join the mesh in this node's name.
    let node = Node::open(cfg, engine).await?;
    if let Some(egress) = egress {
        egress.serve_leases(Arc::new(egress::NodeLeases(Arc::downgrade(&node))));
        let _ = node.egress.set(egress);
    }
    let (peers, incoming) = match &mesh {
        Some(m) => {
            let (peers, incoming) = fleet::start(&node.cfg, m).await?;
            node.join(peers.clone());
            tokio::spawn(fleet::publish_loop(node.clone(), peers.clone()));
            (Some(peers), Some(incoming))
        }
        None => (None, None),
    };
    Ok(Daemon { node, peers, incoming, tls, e2b, _data_lock: data_lock })
}

/// The silkd and the jail launcher a node runs: the configured ones, or those beside this
/// binary.
pub fn tool_paths(cfg: &Config) -> anyhow::Result<(PathBuf, PathBuf)> {
    let exe_dir = std::env::current_exe()?.parent().map(PathBuf::from).unwrap_or_default();
    let silkd = cfg.silkd.clone().unwrap_or_else(|| exe_dir.join("silkd"));
    let launcher = cfg.launcher.clone().unwrap_or_else(|| exe_dir.join("silk-jail"));
    Ok((silkd, launcher))
}

/// The jail engine's configuration for a node's config (the same for `start` and `clean`).
fn jail_config(cfg: &Config) -> anyhow::Result<JailConfig> {
    let (silkd, launcher) = tool_paths(cfg)?;
    let mut jail = JailConfig::new(cfg.data_dir.join("engine"), silkd, launcher);
    jail.id_base = cfg.sandbox_id_base;
    jail.disk = silk_engine::jail::DiskSizes {
        small: cfg.disk.small_mib.saturating_mul(1 << 20),
        medium: cfg.disk.medium_mib.saturating_mul(1 << 20),
        large: cfg.disk.large_mib.saturating_mul(1 << 20),
    };
    jail.bound_disks = cfg.disk.bounded;
    jail.memory = cfg.memory;
    jail.criu = cfg.criu.clone();
    // Memory images travel through the shared store, and a node restores only those made
    // under the key of its fleet: one derived from the root token, which every node of a
    // fleet shares (without one, the engine's own key: images stay on their node).
    jail.memory_key = cfg
        .api_token
        .as_ref()
        .map(|t| blake3::derive_key("silkmesh memory images v1", t.as_bytes()));
    Ok(jail)
}

/// `sandboxd clean`: removes every sandbox a stopped node left in its data directory
/// (sandboxes outlive their node by design, for the next start to re-adopt). Refused while a
/// node runs there: its journal's lock is held for the whole removal, so none can start
/// meanwhile either. How many sandboxes it removed.
pub fn clean(cfg: &Config) -> anyhow::Result<usize> {
    let dir = cfg.data_dir.join("journal");
    std::fs::create_dir_all(&dir)?;
    let lock = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(dir.join("journal.lock"))?;
    match lock.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => anyhow::bail!(
            "a node is running on {}: stop it first (its sandboxes are its own)",
            cfg.data_dir.display()
        ),
        Err(std::fs::TryLockError::Error(e)) => return Err(e.into()),
    }
    let removed = silk_engine::jail::remove_all(jail_config(cfg)?)?;
    egress::remove_table(cfg);
    Ok(removed)
}

/// Serves the API on `listener` (and peers' calls, in a mesh) until `shutdown` resolves, then
/// stops the node ([`Node::stop`]): claimed sandboxes keep running, for the next start to
/// re-adopt; the warm pools are destroyed.
pub async fn serve(
    daemon: Daemon,
    listener: tokio::net::TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let Daemon { node, peers, incoming, tls, e2b, _data_lock } = daemon;
    let router = api::router(node.clone(), peers.clone());
    let e2b_router = e2b.is_some().then(|| e2b::router(node.clone(), peers.clone()));
    if let Some(incoming) = incoming {
        // Peers forward native calls, and E2B calls under their prefix when E2B is served.
        let r = match &e2b_router {
            Some(e2b) => router.clone().nest(e2b::mesh::PREFIX, e2b.clone()),
            None => router.clone(),
        };
        let http = move |stream| api::edge::serve_forwarded(r.clone(), stream);
        tokio::spawn(fleet::serve(node.clone(), incoming, http));
    }
    // E2B's API on a listener of its own, stopped with the main one.
    let (stop, stopped) = tokio::sync::watch::channel(false);
    if let (Some(listener), Some(router)) = (e2b, e2b_router) {
        let mut stopped = stopped.clone();
        let shutdown = async move {
            let _ = stopped.wait_for(|s| *s).await;
        };
        tokio::spawn(listen::serve(listener, router, tls.clone(), shutdown));
    }
    // The MCP endpoint's SDK clients come back in through this listener.
    let router = api::mcp::with_mcp(router, node.clone(), listener.local_addr()?);
    // Preview hosts reach sandboxes' ports (a peer forwards such calls already routed).
    let router = match node.cfg.previews.domain.clone() {
        Some(domain) => api::previews::hosts(router, domain),
        None => router,
    };
    let served = listen::serve(listener, router, tls, async move {
        shutdown.await;
        let _ = stop.send(true);
    })
    .await;
    drop(stopped);
    // Peers learn at once that this node left, rather than by failure detection.
    if let Some(p) = &peers {
        p.mesh.leave().await;
    }
    let removed = node.stop().await;
    tracing::info!(
        removed,
        "warm pools removed; claimed sandboxes keep running for the next start"
    );
    served
}
