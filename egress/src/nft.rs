//! The lane's nftables table: TCP from sandboxes to the proxy, their DNS to the resolver,
//! everything else of theirs dropped (and counted) before routing, whether or not the host
//! forwards packets. One static table per node, written once at start: a
//! sandbox's own setup adds no rule (its interface matches the node's prefix), so a refill does
//! no firewall work and a claim none at all.
//!
//! nftables rather than iptables: one atomic transaction replaces the whole table (no window
//! with half the rules), one `inet` table covers IPv4 and IPv6 (the lane drops the latter), and
//! `fib` does the anti-spoofing check in one rule. The `nft` command rather than netlink from
//! Rust: it runs once per node start, where a netlink crate would be a large dependency for one
//! call.

use std::io::Write;
use std::net::Ipv4Addr;
use std::process::{Command, Stdio};

use crate::EgressError;

/// The table for a lane whose sandbox-facing interfaces start with `prefix`, whose proxy and
/// resolver listen on `gateway`, ports `proxy` and `dns`.
///
/// Every rule names the lane's interfaces or its gateway address: a node killed with its
/// sandboxes still running leaves its table (it is what still fences them in), and that table
/// must not touch the host's other traffic once the two ports are free for anyone to take.
/// The proxy's and resolver's ports are closed to all but sandboxes (of any node: another
/// node's sandboxes are steered to its own ports before these rules see them).
pub fn ruleset(table: &str, prefix: &str, gateway: Ipv4Addr, proxy: u16, dns: u16) -> String {
    let sb = format!("iifname \"{prefix}*\"");
    let outside = format!("iifname != \"{}*\" ip daddr {gateway}", crate::IFNAME_PREFIX);
    format!(
        "table inet {table}
delete table inet {table}
table inet {table} {{
  counter dropped {{ }}
  chain spoofed {{
    type filter hook prerouting priority raw; policy accept;
    {sb} fib saddr . iif oif missing counter name dropped drop
  }}
  chain steer {{
    type nat hook prerouting priority dstnat; policy accept;
    {sb} meta nfproto ipv4 meta l4proto tcp redirect to :{proxy}
    {sb} meta nfproto ipv4 udp dport 53 redirect to :{dns}
  }}
  chain gate {{
    type filter hook prerouting priority filter; policy accept;
    {sb} ct status dnat accept
    {sb} counter name dropped drop
  }}
  chain input {{
    type filter hook input priority filter; policy accept;
    {sb} ct state established,related accept
    {sb} ct status dnat tcp dport {proxy} accept
    {sb} ct status dnat udp dport {dns} accept
    {sb} counter name dropped drop
    {outside} tcp dport {proxy} drop
    {outside} udp dport {dns} drop
  }}
  chain forward {{
    type filter hook forward priority filter; policy accept;
    {sb} counter name dropped drop
    oifname \"{prefix}*\" drop
  }}
}}
"
    )
}

fn nft(script: &str) -> Result<String, EgressError> {
    let mut child = Command::new("nft")
        .args(["-f", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| EgressError::Nft(format!("run nft (install nftables): {e}")))?;
    child.stdin.take().map(|mut i| i.write_all(script.as_bytes()));
    let out = child.wait_with_output().map_err(|e| EgressError::Nft(format!("nft: {e}")))?;
    if !out.status.success() {
        return Err(EgressError::Nft(String::from_utf8_lossy(&out.stderr).trim().to_string()));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Writes the table (replacing an older one of the same name, atomically).
pub fn install(
    table: &str,
    prefix: &str,
    gateway: Ipv4Addr,
    proxy: u16,
    dns: u16,
) -> Result<(), EgressError> {
    nft(&ruleset(table, prefix, gateway, proxy, dns)).map(drop)
}

/// Removes the table, if there is one.
pub fn remove(table: &str) -> Result<(), EgressError> {
    nft(&format!("table inet {table}\ndelete table inet {table}\n")).map(drop)
}

/// Whether the table is there.
pub fn exists(table: &str) -> bool {
    nft(&format!("list table inet {table}\n")).is_ok()
}

/// Packets the table dropped (traffic the lane never carries, spoofed sources).
pub fn dropped(table: &str) -> Option<u64> {
    let out = nft(&format!("list counter inet {table} dropped\n")).ok()?;
    let rest = &out[out.find("packets ")? + 8..];
    rest.split_whitespace().next()?.parse().ok()
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_ruleset_names_the_prefix_and_ports() {
        let gw = "10.88.0.1".parse().unwrap();
        let r = super::ruleset("silkmesh_abc", "smabc", gw, 4001, 4002);
        assert!(
            r.contains("iifname \"smabc*\" meta nfproto ipv4 meta l4proto tcp redirect to :4001")
        );
        assert!(r.contains("udp dport 53 redirect to :4002"));
        assert!(r.starts_with("table inet silkmesh_abc\ndelete table inet silkmesh_abc\n"));
        // Host traffic that merely uses the same port numbers is none of the table's business.
        for line in r.lines().filter(|l| l.contains("dport 400")) {
            assert!(line.contains("smabc*") || line.contains("ip daddr 10.88.0.1"), "{line}");
        }
    }
}
