//! The node's side of lane `egress` (docs/network.md): the lane's settings for the engine and
//! for silk-egress, the policy each claim runs under, and which claim holds a lane address.

use std::net::{Ipv4Addr, ToSocketAddrs};
use std::sync::Weak;

use silk_api::{EgressPolicy, PoolConfig};
use silk_egress::{Egress, EgressConfig, Lease, Leases, Net, Policy};
use silk_engine::Lane;
use silk_engine::jail::LaneNet;

use crate::config::{Config, EgressSection};
use crate::error::NodeError;
use crate::node::Node;

/// Checks `[egress]` and the pools' policies.
pub fn validate(cfg: &EgressSection, pools: &[PoolConfig]) -> Result<(), String> {
    let lane = Net::parse(&cfg.cidr).map_err(|e| format!("egress.cidr: {e}"))?;
    if !(8..=29).contains(&lane.prefix) {
        return Err(format!("egress.cidr {}: the prefix must be /8 to /29", cfg.cidr));
    }
    for n in &cfg.open_private {
        Net::parse(n).map_err(|e| format!("egress.open_private: {e}"))?;
    }
    if let Some(p) = &cfg.default {
        Policy::parse(p).map_err(|e| format!("egress.default: {e}"))?;
    }
    for p in pools {
        match (&p.egress, p.lane) {
            (Some(_), Lane::None) => {
                return Err(format!("pool {}: egress is for lane \"egress\" only", p.template));
            }
            (Some(e), _) => {
                Policy::parse(e).map_err(|e| format!("pool {}: {e}", p.template))?;
            }
            (None, _) => {}
        }
    }
    Ok(())
}

fn names(cfg: &Config) -> (String, String) {
    silk_egress::names(&cfg.data_dir)
}

/// Removes the node's nftables table (`sandboxd clean`: no sandbox is left to use it).
pub fn remove_table(cfg: &Config) {
    let table = names(cfg).0;
    match silk_egress::nft::remove(&table) {
        Ok(()) => silk_egress::orphans::unregister(
            std::path::Path::new(silk_egress::orphans::REGISTRY),
            &table,
        ),
        Err(e) => tracing::debug!("removing the egress table: {e}"),
    }
}

/// The lane as the engine wires it.
pub fn lane_net(cfg: &Config) -> Option<LaneNet> {
    let lane = Net::parse(&cfg.egress.cidr).ok()?;
    let e = &cfg.egress;
    Some(LaneNet {
        network: lane.addr,
        prefix_len: lane.prefix,
        ifname_prefix: names(cfg).1,
        mbit: [e.small_mbit, e.medium_mbit, e.large_mbit],
    })
}

/// Starts the lane's proxy and resolver and writes its nftables table; `None` (and why, in the
/// log) when it is off or cannot run here: the engine then offers no lane `egress`.
pub async fn start(cfg: &Config) -> Option<Egress> {
    if !cfg.egress.enabled {
        return None;
    }
    let (table, prefix) = names(cfg);
    let mut node_addresses = vec![];
    // The store and the mesh endpoint are the node's, wherever they are.
    let endpoint = cfg.store.s3.as_ref().and_then(|s| s.endpoint.clone());
    if let Some(hostport) = endpoint.as_deref().and_then(host_port) {
        node_addresses.extend(resolve(&hostport));
    }
    if let Some(std::net::SocketAddr::V4(a)) = cfg.mesh.as_ref().map(|m| m.listen) {
        node_addresses.push(*a.ip());
    }
    if let std::net::SocketAddr::V4(a) = cfg.listen {
        node_addresses.push(*a.ip());
    }
    let e = &cfg.egress;
    let egress_cfg = EgressConfig {
        table,
        prefix,
        lane: Net::parse(&e.cidr).ok()?,
        upstream_dns: e.dns.clone(),
        opened: e.open_private.iter().filter_map(|n| Net::parse(n).ok()).collect(),
        node_addresses,
        max_connections: e.max_connections,
        connect_timeout: std::time::Duration::from_secs(10),
        data_dir: cfg.data_dir.clone(),
    };
    match Egress::start(egress_cfg).await {
        Ok(egress) => Some(egress),
        Err(e) => {
            tracing::warn!("lane egress is off: {e}");
            None
        }
    }
}

/// `host:port` of an endpoint URL.
fn host_port(url: &str) -> Option<String> {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let host = rest.split('/').next()?;
    let default = if url.starts_with("https") { 443 } else { 80 };
    Some(if host.contains(':') { host.to_string() } else { format!("{host}:{default}") })
}

fn resolve(hostport: &str) -> Vec<Ipv4Addr> {
    let addrs = hostport.to_socket_addrs().map(Iterator::collect).unwrap_or_else(|_| vec![]);
    addrs
        .into_iter()
        .filter_map(|a: std::net::SocketAddr| match a {
            std::net::SocketAddr::V4(v4) => Some(*v4.ip()),
            std::net::SocketAddr::V6(_) => None,
        })
        .collect()
}

/// Who holds a lane address: the node, asked without keeping it alive.
#[derive(Debug)]
pub struct NodeLeases(pub Weak<Node>);

impl Leases for NodeLeases {
    fn lease(&self, addr: Ipv4Addr) -> Option<Lease> {
        self.0.upgrade()?.egress_lease(addr)
    }
}

/// A claim's asked policy, checked for syntax (the pool's test comes at the claim).
pub fn check_asked(p: &Option<EgressPolicy>) -> Result<(), NodeError> {
    match p {
        Some(p) => {
            Policy::parse(p).map(drop).map_err(|e| NodeError::new(crate::error::Code::Invalid, e))
        }
        None => Ok(()),
    }
}

/// The lane's counters in the text exposition.
pub fn render_metrics(egress: &Egress, out: &mut String) {
    use std::fmt::Write;
    use std::sync::atomic::Ordering::Relaxed;
    let c = egress.counters();
    let mut counter = |name: &str, help: &str, rows: &[(&str, u64)]| {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
        for (labels, v) in rows {
            let _ = match labels.is_empty() {
                true => writeln!(out, "{name} {v}"),
                false => writeln!(out, "{name}{{{labels}}} {v}"),
            };
        }
    };
    counter(
        "silkmesh_egress_bytes_total",
        "Bytes sandboxes sent (out) and received (in) through the egress proxy.",
        &[
            ("direction=\"out\"", c.bytes_out.load(Relaxed)),
            ("direction=\"in\"", c.bytes_in.load(Relaxed)),
        ],
    );
    counter(
        "silkmesh_egress_connections_total",
        "Connections out of sandboxes the egress guard let through.",
        &[("", c.connections.load(Relaxed))],
    );
    counter(
        "silkmesh_egress_lookups_total",
        "DNS queries sandboxes asked the lane's resolver.",
        &[("", c.lookups.load(Relaxed))],
    );
    let dropped = egress.dropped();
    let labels: Vec<(String, u64)> = silk_egress::Denied::ALL
        .iter()
        .map(|d| {
            let n = c.denied(*d) + if *d == silk_egress::Denied::Protocol { dropped } else { 0 };
            (format!("reason=\"{}\"", d.as_str()), n)
        })
        .collect();
    let rows: Vec<(&str, u64)> = labels.iter().map(|(l, n)| (l.as_str(), *n)).collect();
    counter(
        "silkmesh_egress_denied_total",
        "Lookups, connections and packets of sandboxes the lane refused, by reason.",
        &rows,
    );
    let _ = writeln!(
        out,
        "# HELP silkmesh_egress_connections_open Connections open through the egress proxy.\n# TYPE silkmesh_egress_connections_open gauge\nsilkmesh_egress_connections_open {}",
        c.open.load(Relaxed)
    );
}
