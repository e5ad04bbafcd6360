//! What the lane knows of each sandbox: the addresses its allowed names resolved to (until
//! their TTL ends) and its open connections, and the decision every connection gets. Pure: time
//! is passed in.

use std::collections::HashMap;
use std::net::Ipv4Addr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::guard::{Denied, Guard};
use crate::policy::Policy;

/// What the node says about the sandbox at a lane address.
#[derive(Debug, Clone)]
pub struct Lease {
    /// The sandbox's id: what a lane address resolved for stays with it, not with the address.
    pub sandbox: String,
    pub policy: Arc<Policy>,
}

/// How the lane asks the node who holds an address.
pub trait Leases: Send + Sync + 'static {
    /// The claimed, running sandbox at `addr`; `None` for an unclaimed (warm) one or none.
    fn lease(&self, addr: Ipv4Addr) -> Option<Lease>;
}

/// Answers shorter than this are kept this long: the connection that follows a lookup must
/// find it, whatever TTL the upstream gave.
const MIN_TTL: Duration = Duration::from_secs(60);
/// And none longer than a day.
const MAX_TTL: Duration = Duration::from_secs(86_400);
/// Addresses remembered per sandbox: a sandbox resolving endlessly many names cannot grow the
/// node's memory past this (the oldest-expiring go first).
const MAX_RESOLVED: usize = 4096;

#[derive(Debug, Default)]
struct Entry {
    sandbox: String,
    resolved: HashMap<Ipv4Addr, Instant>,
    open: usize,
}

/// Every lane address's entry.
#[derive(Debug, Default)]
pub struct Lanes {
    entries: HashMap<Ipv4Addr, Entry>,
}

impl Lanes {
    /// The entry of `addr` for `lease`'s sandbox: a new one when the address changed hands.
    fn entry(&mut self, addr: Ipv4Addr, lease: &Lease) -> &mut Entry {
        let e = self.entries.entry(addr).or_default();
        if e.sandbox != lease.sandbox {
            *e = Entry { sandbox: lease.sandbox.clone(), resolved: HashMap::new(), open: e.open };
        }
        e
    }

    /// Remembers that an allowed name resolved to `ips` for the sandbox at `addr`.
    pub fn resolved(
        &mut self,
        addr: Ipv4Addr,
        lease: &Lease,
        ips: &[(Ipv4Addr, u32)],
        now: Instant,
    ) {
        let e = self.entry(addr, lease);
        for (ip, ttl) in ips {
            let until = now + Duration::from_secs(u64::from(*ttl)).clamp(MIN_TTL, MAX_TTL);
            let old = e.resolved.entry(*ip).or_insert(until);
            *old = (*old).max(until);
        }
        if e.resolved.len() > MAX_RESOLVED {
            let mut by_end: Vec<_> = e.resolved.iter().map(|(ip, t)| (*t, *ip)).collect();
            by_end.sort();
            for (_, ip) in &by_end[..e.resolved.len() - MAX_RESOLVED] {
                e.resolved.remove(ip);
            }
        }
    }

    /// Whether the sandbox at `addr` may open a connection to `dst`; on `Ok` it counts as open
    /// until [`Lanes::closed`].
    pub fn open(
        &mut self,
        addr: Ipv4Addr,
        lease: &Lease,
        dst: Ipv4Addr,
        guard: &Guard,
        max_open: usize,
        now: Instant,
    ) -> Result<(), Denied> {
        guard.check(dst)?;
        let e = self.entry(addr, lease);
        let named = e.resolved.get(&dst).is_some_and(|until| *until > now);
        if !named && !lease.policy.allows_net(dst) {
            return Err(Denied::NotResolved);
        }
        if e.open >= max_open {
            return Err(Denied::Limit);
        }
        e.open += 1;
        Ok(())
    }

    pub fn closed(&mut self, addr: Ipv4Addr) {
        if let Some(e) = self.entries.get_mut(&addr) {
            e.open = e.open.saturating_sub(1);
        }
    }

    /// Drops what expired, and the entries of addresses nobody holds with nothing open.
    pub fn sweep(&mut self, now: Instant, held: impl Fn(Ipv4Addr, &str) -> bool) {
        self.entries.retain(|addr, e| {
            e.resolved.retain(|_, until| *until > now);
            e.open > 0 || held(*addr, &e.sandbox)
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::guard::Net;

    fn lease(id: &str, allow: &[&str]) -> Lease {
        let p = silk_api::EgressPolicy {
            allow: allow.iter().map(|s| s.to_string()).collect(),
            deny: vec![],
        };
        Lease { sandbox: id.into(), policy: Arc::new(Policy::parse(&p).unwrap()) }
    }

    fn ip(s: &str) -> Ipv4Addr {
        s.parse().unwrap()
    }

    #[test]
    fn a_connection_needs_a_name_resolved_by_this_sandbox_within_its_ttl() {
        let (mut lanes, guard, now) = (Lanes::default(), Guard::default(), Instant::now());
        let (a, b) = (ip("10.88.0.2"), ip("10.88.0.3"));
        let (la, lb) = (lease("sb-a", &["pypi.org"]), lease("sb-b", &["pypi.org"]));
        let server = ip("198.51.100.10");
        assert_eq!(lanes.open(a, &la, server, &guard, 8, now), Err(Denied::NotResolved));
        lanes.resolved(a, &la, &[(server, 1)], now);
        assert_eq!(lanes.open(a, &la, server, &guard, 8, now), Ok(()));
        assert_eq!(
            lanes.open(b, &lb, server, &guard, 8, now),
            Err(Denied::NotResolved),
            "another sandbox's lookup"
        );
        // A TTL of 1 s is kept for MIN_TTL, not longer.
        assert_eq!(
            lanes.open(a, &la, server, &guard, 8, now + MIN_TTL - Duration::from_secs(1)),
            Ok(())
        );
        assert_eq!(lanes.open(a, &la, server, &guard, 8, now + MIN_TTL), Err(Denied::NotResolved));
        // The address changes hands: nothing the old sandbox resolved carries over.
        let next = lease("sb-c", &["pypi.org"]);
        assert_eq!(lanes.open(a, &next, server, &guard, 8, now), Err(Denied::NotResolved));
    }

    #[test]
    fn the_guard_comes_first_and_networks_need_no_name() {
        let (mut lanes, now) = (Lanes::default(), Instant::now());
        let guard = Guard { lane: Some(Net::parse("10.88.0.0/16").unwrap()), ..Guard::default() };
        let a = ip("10.88.0.2");
        let l = lease("sb-a", &["*", "203.0.113.0/24"]);
        lanes.resolved(a, &l, &[(ip("169.254.169.254"), 60), (ip("10.88.0.3"), 60)], now);
        assert_eq!(lanes.open(a, &l, ip("169.254.169.254"), &guard, 8, now), Err(Denied::Metadata));
        assert_eq!(lanes.open(a, &l, ip("10.88.0.3"), &guard, 8, now), Err(Denied::Sandbox));
        assert_eq!(lanes.open(a, &l, ip("203.0.113.5"), &guard, 8, now), Ok(()));
    }

    #[test]
    fn open_connections_are_bounded_and_released() {
        let (mut lanes, guard, now) = (Lanes::default(), Guard::default(), Instant::now());
        let (a, l) = (ip("10.88.0.2"), lease("sb-a", &["203.0.113.0/24"]));
        let dst = ip("203.0.113.5");
        for _ in 0..3 {
            assert_eq!(lanes.open(a, &l, dst, &guard, 3, now), Ok(()));
        }
        assert_eq!(lanes.open(a, &l, dst, &guard, 3, now), Err(Denied::Limit));
        lanes.closed(a);
        assert_eq!(lanes.open(a, &l, dst, &guard, 3, now), Ok(()));
    }

    #[test]
    fn resolved_addresses_are_bounded_and_swept() {
        let (mut lanes, now) = (Lanes::default(), Instant::now());
        let (a, l) = (ip("10.88.0.2"), lease("sb-a", &["*"]));
        let many: Vec<_> = (0..MAX_RESOLVED as u32 + 10)
            .map(|n| (Ipv4Addr::from(0x0b00_0000 + n), 60 + n))
            .collect();
        lanes.resolved(a, &l, &many, now);
        assert_eq!(lanes.entries[&a].resolved.len(), MAX_RESOLVED);
        assert!(!lanes.entries[&a].resolved.contains_key(&many[0].0), "the soonest to expire went");
        lanes.sweep(now, |_, _| true);
        assert_eq!(lanes.entries[&a].resolved.len(), MAX_RESOLVED);
        lanes.sweep(now + MAX_TTL, |_, _| true);
        assert!(lanes.entries[&a].resolved.is_empty());
        lanes.sweep(now, |_, _| false);
        assert!(lanes.entries.is_empty());
    }
}
