//! The resolver sandboxes ask (nftables redirects their port-53 UDP here). A name the
//! sandbox's policy does not allow is answered `NXDOMAIN` (a client fails at once; `REFUSED` makes glibc retry) without going upstream; an allowed
//! one is asked upstream, and the IPv4 addresses of the answer are remembered for the sandbox
//! until their TTL ends. AAAA is answered empty: the lane has no IPv6.

use std::net::{SocketAddr, SocketAddrV4};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use tokio::net::UdpSocket;

use crate::Shared;
use crate::dns::{self, RCODE_NXDOMAIN, RCODE_SERVFAIL, TYPE_AAAA};
use crate::guard::Denied;

/// How long one upstream server gets to answer.
const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(2);

/// The node's own resolvers (`/etc/resolv.conf`), port 53.
pub(crate) fn system_servers() -> Vec<SocketAddr> {
    let conf = std::fs::read_to_string("/etc/resolv.conf").unwrap_or_default();
    conf.lines()
        .filter_map(|l| l.trim().strip_prefix("nameserver"))
        .filter_map(|a| a.trim().parse::<std::net::IpAddr>().ok())
        .map(|ip| SocketAddr::new(ip, 53))
        .collect()
}

pub(crate) async fn serve(shared: Arc<Shared>, socket: Arc<UdpSocket>) {
    let mut buf = vec![0u8; 1500];
    loop {
        let (n, from) = match socket.recv_from(&mut buf).await {
            Ok(got) => got,
            Err(e) => {
                tracing::debug!("lane resolver recv: {e}");
                continue;
            }
        };
        let raw = buf[..n].to_vec();
        tokio::spawn(answer(shared.clone(), socket.clone(), raw, from));
    }
}

async fn answer(shared: Arc<Shared>, socket: Arc<UdpSocket>, raw: Vec<u8>, from: SocketAddr) {
    let Some((addr, lease)) = shared.lease(from) else { return };
    let Some(query) = dns::parse_query(&raw) else { return };
    shared.counters.lookups.fetch_add(1, Ordering::Relaxed);
    let reply = if !lease.policy.allows_name(&query.name) {
        shared.counters.deny(Denied::Name);
        tracing::debug!(sandbox = lease.sandbox, name = query.name, "lookup refused");
        dns::reply(&raw, &query, RCODE_NXDOMAIN)
    } else if query.qtype == TYPE_AAAA {
        dns::reply(&raw, &query, 0)
    } else {
        match ask_upstream(&shared.cfg.upstream_dns, &raw, query.id).await {
            Some(answer) => {
                if let Some(ips) = dns::addresses(&answer, query.id) {
                    shared.lanes().resolved(addr, &lease, &ips, Instant::now());
                }
                answer
            }
            None if shared.cfg.upstream_dns.is_empty() => dns::reply(&raw, &query, RCODE_NXDOMAIN),
            None => dns::reply(&raw, &query, RCODE_SERVFAIL),
        }
    };
    let _ = socket.send_to(&reply, from).await;
}

/// The first answer to `raw` from the upstream servers, tried in turn.
async fn ask_upstream(servers: &[SocketAddr], raw: &[u8], id: u16) -> Option<Vec<u8>> {
    for server in servers {
        let bind: SocketAddr = match server {
            SocketAddr::V4(_) => SocketAddrV4::new(std::net::Ipv4Addr::UNSPECIFIED, 0).into(),
            SocketAddr::V6(_) => (std::net::Ipv6Addr::UNSPECIFIED, 0).into(),
        };
        let Ok(sock) = UdpSocket::bind(bind).await else { continue };
        if sock.connect(server).await.is_err() || sock.send(raw).await.is_err() {
            continue;
        }
        let mut buf = vec![0u8; 4096];
        let deadline = tokio::time::Instant::now() + UPSTREAM_TIMEOUT;
        while let Ok(Ok(n)) = tokio::time::timeout_at(deadline, sock.recv(&mut buf)).await {
            // Only the answer to this query (a connected socket hears only `server`).
            if n >= 2 && buf[..2] == id.to_be_bytes() {
                buf.truncate(n);
                return Some(buf);
            }
        }
    }
    None
}
