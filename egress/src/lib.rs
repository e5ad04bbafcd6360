//! The egress lane's node side. A sandbox in lane `egress` has a veth to the node (the engine
//! makes it); the node's nftables table ([`nft`]) sends every TCP connection it opens to the
//! node's transparent [`proxy`] and its DNS to the node's [`resolver`], and drops the rest.
//! The resolver answers only names the sandbox's [`policy`] allows, and remembers the
//! addresses they resolved to; the proxy connects (from the node's own namespace) only to an
//! address this sandbox resolved for an allowed name, or one its policy names, and never to
//! one the [`guard`] refuses.
//!
//! Why a proxy and not forwarding with NAT and per-sandbox address sets: one place decides
//! every connection (policy, guard, limits, counters) in code that tests without sockets, and
//! neither a lookup nor a claim has to change a firewall set; the cost is a user-space copy,
//! measured in `bench` against a direct connection.

pub mod dns;
pub mod guard;
pub mod lanes;
pub mod nft;
pub mod orphans;
pub mod policy;
mod proxy;
mod resolver;

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub use guard::{Denied, Guard, Net};
pub use lanes::{Lease, Leases};
pub use policy::Policy;

#[derive(Debug, thiserror::Error)]
pub enum EgressError {
    #[error("nftables: {0}")]
    Nft(String),
    #[error("{0}: {1}")]
    Io(String, std::io::Error),
}

/// How the node runs its lane.
#[derive(Debug, Clone)]
pub struct EgressConfig {
    /// The nftables table (one per node: its data directory names it).
    pub table: String,
    /// Every sandbox-facing interface's name starts with it.
    pub prefix: String,
    /// The lane's network: the gateway and every sandbox address.
    pub lane: Net,
    /// Where the resolver asks (the node's own resolvers when empty).
    pub upstream_dns: Vec<SocketAddr>,
    /// Private networks opened to sandboxes (their policies must still allow them).
    pub opened: Vec<Net>,
    /// More addresses no sandbox may reach (the store's, the mesh's).
    pub node_addresses: Vec<Ipv4Addr>,
    /// Connections one sandbox may have open at once.
    pub max_connections: usize,
    /// How long a connection out may take to open.
    pub connect_timeout: Duration,
    /// The node's data directory, which names the table (see [`orphans`]).
    pub data_dir: std::path::PathBuf,
}

/// What `/metrics` shows of the lane.
#[derive(Debug, Default)]
pub struct Counters {
    /// From sandboxes, and to them.
    pub bytes_out: AtomicU64,
    pub bytes_in: AtomicU64,
    pub connections: AtomicU64,
    pub open: AtomicU64,
    pub lookups: AtomicU64,
    denied: [AtomicU64; Denied::ALL.len()],
}

impl Counters {
    fn deny(&self, why: Denied) {
        self.denied[why as usize].fetch_add(1, Ordering::Relaxed);
    }

    pub fn denied(&self, why: Denied) -> u64 {
        self.denied[why as usize].load(Ordering::Relaxed)
    }
}

/// What the proxy and the resolver share.
struct Shared {
    cfg: EgressConfig,
    /// Set once the node is up; until then no sandbox holds an address.
    leases: std::sync::OnceLock<Arc<dyn Leases>>,
    lanes: Mutex<Lanes>,
    guard: Mutex<Guard>,
    counters: Arc<Counters>,
    /// Where the table sends sandboxes' TCP and DNS (to write it again if it goes).
    proxy_port: u16,
    dns_port: u16,
}

use lanes::Lanes;

impl Shared {
    fn lanes(&self) -> std::sync::MutexGuard<'_, Lanes> {
        self.lanes.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The lease of the sandbox at `peer`, if it is one of the lane's.
    fn lease(&self, peer: SocketAddr) -> Option<(Ipv4Addr, Lease)> {
        let SocketAddr::V4(v4) = peer else { return None };
        let addr = *v4.ip();
        if !self.cfg.lane.contains(addr) {
            return None;
        }
        self.leases.get()?.lease(addr).map(|l| (addr, l))
    }
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared").field("cfg", &self.cfg).finish_non_exhaustive()
    }
}

/// The running lane: its proxy and resolver tasks live as long as the tokio runtime.
#[derive(Debug, Clone)]
pub struct Egress {
    shared: Arc<Shared>,
}

impl Egress {
    /// Binds the proxy and the resolver, writes the nftables table, starts both.
    pub async fn start(cfg: EgressConfig) -> Result<Egress, EgressError> {
        // On the gateway only (nftables steers sandboxes to it), not on every address of the
        // host: nothing else reaches either, and the rules that close their ports name only
        // that address.
        let gateway = cfg.lane.gateway();
        let listener = bind_gateway(gateway, socket2::Type::STREAM)
            .and_then(|s| tokio::net::TcpListener::from_std(s.into()))
            .map_err(|e| EgressError::Io("bind the egress proxy".into(), e))?;
        let udp = bind_gateway(gateway, socket2::Type::DGRAM)
            .and_then(|s| tokio::net::UdpSocket::from_std(s.into()))
            .map_err(|e| EgressError::Io("bind the lane's resolver".into(), e))?;
        let port = |a: std::io::Result<SocketAddr>| a.map(|a| a.port());
        let proxy_port =
            port(listener.local_addr()).map_err(|e| EgressError::Io("proxy".into(), e))?;
        let dns_port = port(udp.local_addr()).map_err(|e| EgressError::Io("resolver".into(), e))?;
        let mut cfg = cfg;
        if cfg.upstream_dns.is_empty() {
            cfg.upstream_dns = resolver::system_servers();
        }
        let table = cfg.table.clone();
        let prefix = cfg.prefix.clone();
        let data_dir = cfg.data_dir.clone();
        let install = move || {
            let registry = std::path::Path::new(orphans::REGISTRY);
            for gone in orphans::sweep(registry) {
                tracing::info!(table = gone, "removed the egress table of a node gone for good");
            }
            nft::install(&table, &prefix, gateway, proxy_port, dns_port)?;
            if let Err(e) = orphans::register(registry, &table, &prefix, &data_dir) {
                tracing::warn!("registering the egress table in {}: {e}", registry.display());
            }
            Ok::<(), EgressError>(())
        };
        tokio::task::spawn_blocking(install)
            .await
            .map_err(|e| EgressError::Nft(e.to_string()))??;
        let guard = Mutex::new(guard_of(&cfg));
        let shared = Arc::new(Shared {
            cfg,
            leases: std::sync::OnceLock::new(),
            lanes: Mutex::default(),
            guard,
            counters: Arc::default(),
            proxy_port,
            dns_port,
        });
        tokio::spawn(proxy::serve(shared.clone(), listener));
        tokio::spawn(resolver::serve(shared.clone(), Arc::new(udp)));
        tokio::spawn(sweep(Arc::downgrade(&shared)));
        tracing::info!(lane = %shared.cfg.lane, proxy_port, dns_port, "egress lane ready");
        Ok(Egress { shared })
    }

    /// Who holds the lane's addresses, from now on.
    pub fn serve_leases(&self, leases: Arc<dyn Leases>) {
        let _ = self.shared.leases.set(leases);
    }

    pub fn counters(&self) -> &Counters {
        &self.shared.counters
    }

    /// Packets nftables dropped (UDP but DNS, ICMP, IPv6, spoofed sources).
    pub fn dropped(&self) -> u64 {
        nft::dropped(&self.shared.cfg.table).unwrap_or(0)
    }

    pub fn config(&self) -> &EgressConfig {
        &self.shared.cfg
    }
}

/// A socket on `gateway`, any port, before the engine gave an interface that address (it does
/// with the lane's first sandbox): `IP_FREEBIND`.
fn bind_gateway(gateway: Ipv4Addr, kind: socket2::Type) -> std::io::Result<socket2::Socket> {
    let socket = socket2::Socket::new(socket2::Domain::IPV4, kind, None)?;
    socket.set_freebind_v4(true)?;
    socket.set_nonblocking(true)?;
    socket.bind(&SocketAddr::from((gateway, 0)).into())?;
    if kind == socket2::Type::STREAM {
        socket.listen(1024)?;
    }
    Ok(socket)
}

/// Host-side interfaces of every node's lane start with this.
pub(crate) const IFNAME_PREFIX: &str = "sm";

/// The nftables table and the interface prefix of the node on `data_dir`: nodes sharing a host
/// keep theirs apart (an interface name is at most 15 bytes: the prefix, then 8 hex digits).
pub fn names(data_dir: &std::path::Path) -> (String, String) {
    let hash = blake3_hex(data_dir.as_os_str().as_encoded_bytes());
    (format!("silkmesh_{}", &hash[..12]), format!("{IFNAME_PREFIX}{}", &hash[..5]))
}

fn blake3_hex(bytes: &[u8]) -> String {
    blake3::hash(bytes).to_hex().to_string()
}

fn guard_of(cfg: &EgressConfig) -> Guard {
    let mut node = local_addresses();
    node.extend(&cfg.node_addresses);
    Guard { lane: Some(cfg.lane), node, opened: cfg.opened.clone() }
}

/// Every IPv4 address of this node's interfaces (in its network namespace).
pub fn local_addresses() -> Vec<Ipv4Addr> {
    let mut out = vec![];
    let mut list: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `list`, freed below; every pointer is checked before use.
    unsafe {
        if libc::getifaddrs(&mut list) != 0 {
            return out;
        }
        let mut at = list;
        while !at.is_null() {
            let a = (*at).ifa_addr;
            if !a.is_null() && i32::from((*a).sa_family) == libc::AF_INET {
                let sin = &*(a as *const libc::sockaddr_in);
                out.push(Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)));
            }
            at = (*at).ifa_next;
        }
        libc::freeifaddrs(list);
    }
    out
}

/// Every few seconds: puts the nftables table back if something removed it (an `nft flush
/// ruleset`, a firewall service reloading its own rules) and re-reads the node's addresses (an
/// interface may have come up); once a minute, forgets expired lookups and released sandboxes.
async fn sweep(shared: std::sync::Weak<Shared>) {
    const EVERY: Duration = Duration::from_secs(5);
    let mut tick = tokio::time::interval(EVERY);
    for round in 0u64.. {
        tick.tick().await;
        let Some(s) = shared.upgrade() else { return };
        let (table, prefix) = (s.cfg.table.clone(), s.cfg.prefix.clone());
        let (gateway, proxy, dns) = (s.cfg.lane.gateway(), s.proxy_port, s.dns_port);
        let restored = tokio::task::spawn_blocking(move || {
            if nft::exists(&table) {
                return Ok(false);
            }
            nft::install(&table, &prefix, gateway, proxy, dns).map(|()| true)
        })
        .await;
        match restored {
            Ok(Ok(true)) => {
                tracing::warn!(table = s.cfg.table, "the egress table was gone: restored")
            }
            Ok(Err(e)) => tracing::error!(table = s.cfg.table, "the egress table is gone: {e}"),
            _ => {}
        }
        let fresh = guard_of(&s.cfg);
        *s.guard.lock().unwrap_or_else(|e| e.into_inner()) = fresh;
        if round % 12 != 11 {
            continue;
        }
        let Some(leases) = s.leases.get().cloned() else { continue };
        s.lanes()
            .sweep(Instant::now(), |addr, id| leases.lease(addr).is_some_and(|l| l.sandbox == id));
    }
}
