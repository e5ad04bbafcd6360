//! The resolver sandboxes ask (nftables redirects their port-53 UDP here). A name the
//! sandbox's policy does not allow is answered `NXDOMAIN` (a client fails at once; `REFUSED` makes glibc retry) without going upstream; an allowed
//! one is asked upstream, and the IPv4 addresses of the answer are remembered for the sandbox
//! until their TTL ends. AAAA is answered empty: the lane has no IPv6.

use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
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

/// Lookups one sandbox may make per second, and the burst it may save up: a package manager
/// resolving its mirrors stays far below; a sandbox flooding the resolver is cut off before its
/// queries cost the node a task, a lock or an upstream socket.
const RATE: f64 = 200.0;
const BURST: f64 = 400.0;
/// Lookups in flight (waiting on upstream) per sandbox, and on the node in all.
const IN_FLIGHT_EACH: u32 = 32;
const IN_FLIGHT_ALL: u32 = 1024;
/// Senders remembered by the admission control (forgotten, idle first, beyond it).
const SENDERS: usize = 4096;

/// Who may have a lookup answered now: a token bucket and an in-flight count per sandbox
/// address, and a node-wide in-flight count. Pure (time is given).
#[derive(Debug, Default)]
pub(crate) struct Admission {
    senders: HashMap<Ipv4Addr, Sender>,
    in_flight: u32,
}

#[derive(Debug)]
struct Sender {
    tokens: f64,
    at: Instant,
    in_flight: u32,
}

impl Admission {
    /// Takes a token and an in-flight slot for `from`, or says no (the query is dropped).
    pub(crate) fn admit(&mut self, from: Ipv4Addr, now: Instant) -> bool {
        if self.in_flight >= IN_FLIGHT_ALL {
            return false;
        }
        if self.senders.len() >= SENDERS && !self.senders.contains_key(&from) {
            self.senders.retain(|_, s| s.in_flight > 0);
        }
        let s = self.senders.entry(from).or_insert(Sender { tokens: BURST, at: now, in_flight: 0 });
        s.tokens = (s.tokens + now.duration_since(s.at).as_secs_f64() * RATE).min(BURST);
        s.at = now;
        if s.tokens < 1.0 || s.in_flight >= IN_FLIGHT_EACH {
            return false;
        }
        s.tokens -= 1.0;
        s.in_flight += 1;
        self.in_flight += 1;
        true
    }

    /// Gives back the in-flight slot `admit` took.
    pub(crate) fn done(&mut self, from: Ipv4Addr) {
        self.in_flight = self.in_flight.saturating_sub(1);
        if let Some(s) = self.senders.get_mut(&from) {
            s.in_flight = s.in_flight.saturating_sub(1);
        }
    }
}

pub(crate) async fn serve(shared: Arc<Shared>, socket: Arc<UdpSocket>) {
    let admission = Arc::new(Mutex::new(Admission::default()));
    let mut buf = vec![0u8; 1500];
    loop {
        let (n, from) = match socket.recv_from(&mut buf).await {
            Ok(got) => got,
            Err(e) => {
                tracing::debug!("lane resolver recv: {e}");
                continue;
            }
        };
        let SocketAddr::V4(sender) = from else { continue };
        let sender = *sender.ip();
        if !admission.lock().unwrap_or_else(|e| e.into_inner()).admit(sender, Instant::now()) {
            shared.counters.deny(Denied::Limit);
            continue;
        }
        let raw = buf[..n].to_vec();
        let (shared, socket, admission) = (shared.clone(), socket.clone(), admission.clone());
        tokio::spawn(async move {
            answer(shared, socket, raw, from).await;
            admission.lock().unwrap_or_else(|e| e.into_inner()).done(sender);
        });
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
        // The largest UDP answer (an upstream honours the size the sandbox's query offered).
        let mut buf = vec![0u8; 65535];
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flooding_sandbox_is_cut_off_and_the_others_are_not() {
        let (a, b) = (Ipv4Addr::new(10, 88, 0, 2), Ipv4Addr::new(10, 88, 0, 3));
        let t0 = Instant::now();
        let mut adm = Admission::default();
        // In flight: at most IN_FLIGHT_EACH for one sandbox, whatever its tokens.
        let taken = (0..100).filter(|_| adm.admit(a, t0)).count();
        assert_eq!(taken, IN_FLIGHT_EACH as usize);
        assert!(adm.admit(b, t0), "a neighbour is not held up");
        adm.done(b);
        for _ in 0..IN_FLIGHT_EACH {
            adm.done(a);
        }
        // Answered at once, it spends its burst, then gets RATE a second.
        let mut answered = 0;
        for _ in 0..1000 {
            if adm.admit(a, t0) {
                adm.done(a);
                answered += 1;
            }
        }
        assert_eq!(answered, BURST as usize - IN_FLIGHT_EACH as usize);
        let later = t0 + Duration::from_millis(100);
        let more = (0..1000)
            .filter(|_| {
                adm.admit(a, later) && {
                    adm.done(a);
                    true
                }
            })
            .count();
        assert_eq!(more, (RATE / 10.0) as usize);
        assert_eq!(adm.in_flight, 0);
    }

    #[test]
    fn the_node_wide_cap_holds_and_senders_are_forgotten() {
        let t0 = Instant::now();
        let mut adm = Admission::default();
        let mut admitted = 0;
        for i in 0..(IN_FLIGHT_ALL / IN_FLIGHT_EACH + 4) {
            let from = Ipv4Addr::from(0x0a58_0000 + i);
            admitted += (0..IN_FLIGHT_EACH).filter(|_| adm.admit(from, t0)).count();
        }
        assert_eq!(admitted, IN_FLIGHT_ALL as usize);
        let mut adm = Admission::default();
        for i in 0..(SENDERS as u32 * 2) {
            let from = Ipv4Addr::from(0x0a58_0000 + i);
            assert!(adm.admit(from, t0));
            adm.done(from);
        }
        assert!(adm.senders.len() <= SENDERS);
    }
}
