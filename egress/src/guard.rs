//! The guard every connection out of a sandbox passes, whatever its policy says: no link-local
//! or metadata address, no loopback, no private range the operator did not open, no other
//! sandbox, none of the node's own addresses. Pure: the proxy asks it.

use std::fmt;
use std::net::Ipv4Addr;

/// An IPv4 network.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Net {
    pub addr: Ipv4Addr,
    pub prefix: u8,
}

impl Net {
    pub const fn new(a: u8, b: u8, c: u8, d: u8, prefix: u8) -> Net {
        Net { addr: Ipv4Addr::new(a, b, c, d), prefix }
    }

    /// `a.b.c.d/n`, or one address.
    pub fn parse(text: &str) -> Result<Net, String> {
        let bad = || format!("{text:?} is not an IPv4 address or network");
        let (addr, prefix) = match text.split_once('/') {
            Some((a, p)) => (a, p.parse::<u8>().map_err(|_| bad())?),
            None => (text, 32),
        };
        let addr: Ipv4Addr = addr.parse().map_err(|_| bad())?;
        if prefix > 32 {
            return Err(bad());
        }
        Ok(Net { addr: Ipv4Addr::from(u32::from(addr) & mask(prefix)), prefix })
    }

    /// The network's first address: the lane's gateway, on the host's end of every veth.
    pub fn gateway(&self) -> Ipv4Addr {
        Ipv4Addr::from(u32::from(self.addr).wrapping_add(1))
    }

    pub fn contains(&self, ip: Ipv4Addr) -> bool {
        u32::from(ip) & mask(self.prefix) == u32::from(self.addr)
    }

    pub fn contains_net(&self, other: &Net) -> bool {
        other.prefix >= self.prefix && self.contains(other.addr)
    }

    /// How many addresses it holds.
    pub fn size(&self) -> u64 {
        1u64 << (32 - self.prefix)
    }

    /// Its `n`th address.
    pub fn nth(&self, n: u32) -> Ipv4Addr {
        Ipv4Addr::from(u32::from(self.addr).wrapping_add(n))
    }
}

impl fmt::Display for Net {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.prefix {
            32 => write!(f, "{}", self.addr),
            p => write!(f, "{}/{p}", self.addr),
        }
    }
}

fn mask(prefix: u8) -> u32 {
    match prefix {
        0 => 0,
        p => u32::MAX << (32 - u32::from(p)),
    }
}

/// Why a connection (or a name) was refused: the `reason` label of
/// `silkmesh_egress_denied_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Denied {
    /// The resolver was asked for a name the policy does not allow.
    Name,
    /// A connection to an address no allowed name resolved to for this sandbox.
    NotResolved,
    /// Link-local, cloud metadata.
    Metadata,
    /// The host's loopback.
    Loopback,
    /// A private range the operator did not open.
    Private,
    /// This node's lane: another sandbox, or the lane's gateway.
    Sandbox,
    /// One of this node's own addresses, or its store.
    Node,
    /// Unspecified, multicast, reserved.
    Reserved,
    /// The sandbox has as many connections open as it may, or asks the resolver too fast.
    Limit,
    /// Traffic the lane never carries (UDP but DNS, ICMP, IPv6): counted by nftables.
    Protocol,
}

impl Denied {
    pub const ALL: [Denied; 10] = [
        Denied::Name,
        Denied::NotResolved,
        Denied::Metadata,
        Denied::Loopback,
        Denied::Private,
        Denied::Sandbox,
        Denied::Node,
        Denied::Reserved,
        Denied::Limit,
        Denied::Protocol,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Denied::Name => "name",
            Denied::NotResolved => "not_resolved",
            Denied::Metadata => "metadata",
            Denied::Loopback => "loopback",
            Denied::Private => "private",
            Denied::Sandbox => "sandbox",
            Denied::Node => "node",
            Denied::Reserved => "reserved",
            Denied::Limit => "limit",
            Denied::Protocol => "protocol",
        }
    }
}

/// Metadata services: link-local (every cloud's 169.254.169.254), Azure's WireServer, Alibaba's
/// (inside 100.64/10, so refused even where an operator opens that range).
const METADATA: [Net; 3] = [
    Net::new(169, 254, 0, 0, 16),
    Net::new(168, 63, 129, 16, 32),
    Net::new(100, 100, 100, 200, 32),
];

/// "This network", IETF protocol assignments, benchmarking, the old class E.
const RESERVED: [Net; 4] = [
    Net::new(0, 0, 0, 0, 8),
    Net::new(192, 0, 0, 0, 24),
    Net::new(198, 18, 0, 0, 15),
    Net::new(240, 0, 0, 0, 4),
];

/// The private ranges (RFC 1918, shared address space) an operator may open.
const PRIVATE: [Net; 4] = [
    Net::new(10, 0, 0, 0, 8),
    Net::new(172, 16, 0, 0, 12),
    Net::new(192, 168, 0, 0, 16),
    Net::new(100, 64, 0, 0, 10),
];

/// What the guard refuses besides the fixed ranges.
#[derive(Debug, Clone, Default)]
pub struct Guard {
    /// The lane's network (every sandbox's address and the gateway).
    pub lane: Option<Net>,
    /// This node's own addresses (every interface's) and its store endpoint's.
    pub node: Vec<Ipv4Addr>,
    /// Private networks the operator opened to sandboxes.
    pub opened: Vec<Net>,
}

impl Guard {
    /// `Err` when no policy may let a connection to `ip` through.
    pub fn check(&self, ip: Ipv4Addr) -> Result<(), Denied> {
        if METADATA.iter().any(|n| n.contains(ip)) {
            return Err(Denied::Metadata);
        }
        if ip.is_loopback() {
            return Err(Denied::Loopback);
        }
        if self.lane.is_some_and(|l| l.contains(ip)) {
            return Err(Denied::Sandbox);
        }
        if self.node.contains(&ip) {
            return Err(Denied::Node);
        }
        if ip.is_unspecified()
            || ip.is_broadcast()
            || ip.is_multicast()
            || RESERVED.iter().any(|n| n.contains(ip))
        {
            return Err(Denied::Reserved);
        }
        if PRIVATE.iter().any(|n| n.contains(ip)) && !self.opened.iter().any(|n| n.contains(ip)) {
            return Err(Denied::Private);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> Ipv4Addr {
        s.parse().unwrap()
    }

    #[test]
    fn networks_parse_and_contain() {
        let n = Net::parse("10.88.7.9/16").unwrap();
        assert_eq!(n.to_string(), "10.88.0.0/16");
        assert!(n.contains(ip("10.88.255.1")) && !n.contains(ip("10.89.0.1")));
        assert!(n.contains_net(&Net::parse("10.88.4.0/24").unwrap()));
        assert!(!n.contains_net(&Net::parse("10.0.0.0/8").unwrap()));
        assert_eq!(Net::parse("0.0.0.0/0").unwrap().size(), 1 << 32);
        for bad in ["10.0.0.0/33", "10.0.0/8", "x", "10.0.0.0/"] {
            assert!(Net::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_guard_refuses_what_no_policy_may_open() {
        let g = Guard {
            lane: Some(Net::parse("10.88.0.0/16").unwrap()),
            node: vec![ip("198.51.100.2")],
            opened: ["10.1.0.0/16", "10.88.0.0/16", "100.64.0.0/10"]
                .map(|n| Net::parse(n).unwrap())
                .to_vec(),
        };
        let cases = [
            ("169.254.169.254", Err(Denied::Metadata)),
            ("168.63.129.16", Err(Denied::Metadata)),
            ("198.19.0.1", Err(Denied::Reserved)),
            ("127.0.0.1", Err(Denied::Loopback)),
            ("127.8.8.8", Err(Denied::Loopback)),
            ("10.88.0.7", Err(Denied::Sandbox)),
            ("198.51.100.2", Err(Denied::Node)),
            ("0.0.0.0", Err(Denied::Reserved)),
            ("224.0.0.1", Err(Denied::Reserved)),
            ("255.255.255.255", Err(Denied::Reserved)),
            ("10.2.0.1", Err(Denied::Private)),
            ("172.20.0.1", Err(Denied::Private)),
            ("192.168.1.1", Err(Denied::Private)),
            ("100.100.100.200", Err(Denied::Metadata)),
            ("100.64.0.1", Ok(())),
            ("10.1.2.3", Ok(())),
            ("198.51.100.3", Ok(())),
            ("8.8.8.8", Ok(())),
        ];
        for (addr, want) in cases {
            assert_eq!(g.check(ip(addr)), want, "{addr}");
        }
    }
}
