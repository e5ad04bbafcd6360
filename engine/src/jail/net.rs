//! The egress lane's plumbing: a veth pair from the host into a jail's network namespace, the
//! jail's end `eth0` with its lane address, the host's end with the gateway address (the same
//! on every host end: each is a point-to-point link with a route to its one sandbox), and a
//! token bucket on both ends for the size tier's bandwidth. The node's nftables table (see
//! silk-egress) decides what crosses it; the engine only wires it, at start, so a warm claim
//! does no network work.
//!
//! The sandbox cannot change any of it: its network namespace is owned by the sandboxes' user
//! namespace, but no process in it holds `CAP_NET_ADMIN` (see `launch`).

use std::collections::BTreeSet;
use std::io::Write;
use std::net::Ipv4Addr;
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::sync::Mutex;

use crate::{EngineError, Result, Size};

/// The lane as the node configures it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaneNet {
    /// The lane's network (its first address is the gateway; sandboxes get the others).
    pub network: Ipv4Addr,
    pub prefix_len: u8,
    /// Host-side interface names start with it (at most 7 bytes: 8 hex digits follow).
    pub ifname_prefix: String,
    /// Bandwidth each way per size tier (small, medium, large), Mbit/s; 0: not limited.
    pub mbit: [u32; 3],
}

impl LaneNet {
    fn gateway(&self) -> Ipv4Addr {
        Ipv4Addr::from(u32::from(self.network) + 1)
    }

    /// How many sandbox addresses the lane has (neither the network's first two nor its last).
    fn capacity(&self) -> u32 {
        (1u64 << (32 - u32::from(self.prefix_len))).saturating_sub(3).min(u64::from(u32::MAX))
            as u32
    }

    pub fn ifname(&self, addr: Ipv4Addr) -> String {
        format!("{}{:08x}", self.ifname_prefix, u32::from(addr))
    }

    fn mbit(&self, size: Size) -> u32 {
        self.mbit[match size {
            Size::Small => 0,
            Size::Medium => 1,
            Size::Large => 2,
        }]
    }
}

/// Which lane addresses are taken.
#[derive(Debug)]
pub(super) struct Addresses {
    pub lane: LaneNet,
    taken: Mutex<BTreeSet<Ipv4Addr>>,
}

impl Addresses {
    pub fn new(lane: LaneNet, taken: impl IntoIterator<Item = Ipv4Addr>) -> Addresses {
        Addresses { lane, taken: Mutex::new(taken.into_iter().collect()) }
    }

    fn taken(&self) -> std::sync::MutexGuard<'_, BTreeSet<Ipv4Addr>> {
        self.taken.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The lowest free address.
    pub fn take(&self) -> Result<Ipv4Addr> {
        let mut taken = self.taken();
        let first = u32::from(self.lane.gateway()) + 1;
        (first..first + self.lane.capacity())
            .map(Ipv4Addr::from)
            .find(|a| !taken.contains(a))
            .inspect(|a| {
                taken.insert(*a);
            })
            .ok_or_else(|| EngineError::Host("the egress lane has no free address".into()))
    }

    pub fn give_back(&self, addr: Ipv4Addr) {
        self.taken().remove(&addr);
    }
}

fn run(mut cmd: Command, script: &str) -> Result<()> {
    let what = format!("{cmd:?}");
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(EngineError::io(format!("run {what}")))?;
    child.stdin.take().map(|mut i| i.write_all(script.as_bytes()));
    let out = child.wait_with_output().map_err(EngineError::io(format!("run {what}")))?;
    if !out.status.success() {
        return Err(EngineError::Host(format!(
            "{what}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(())
}

/// `cmd`, run in the network namespace of `pid`.
fn inside(program: &str, pid: u32) -> Result<Command> {
    let ns = std::fs::File::open(format!("/proc/{pid}/ns/net"))
        .map_err(EngineError::io("open the jail's network namespace"))?;
    let mut cmd = Command::new(program);
    // SAFETY: setns is async-signal-safe; `ns` lives in the closure until exec.
    unsafe {
        cmd.pre_exec(move || match libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) {
            0 => Ok(()),
            _ => Err(std::io::Error::last_os_error()),
        });
    }
    Ok(cmd)
}

/// A token bucket of `mbit` on `dev` (bursts of 50 ms' worth, at least 64 KiB).
fn shaping(dev: &str, mbit: u32) -> String {
    let burst = (u64::from(mbit) * 1_000_000 / 8 / 20).max(64 * 1024);
    format!("qdisc add dev {dev} root tbf rate {mbit}mbit burst {burst} latency 50ms\n")
}

/// Wires the lane into the running jail `pid` at `addr`.
pub(super) fn attach(lane: &LaneNet, pid: u32, addr: Ipv4Addr, size: Size) -> Result<()> {
    let (dev, gw) = (lane.ifname(addr), lane.gateway());
    let mut host = Command::new("ip");
    host.args(["-batch", "-"]);
    run(
        host,
        &format!(
            "link add {dev} type veth peer name eth0 netns {pid}\n\
             addr add {gw}/32 peer {addr}/32 dev {dev}\n\
             link set {dev} up\n"
        ),
    )?;
    // No IPv6 on either end: the lane carries none (nftables drops it), and a silent link
    // sends no router solicitations to count as refused.
    let no_v6 = |dev: &str| format!("/proc/sys/net/ipv6/conf/{dev}/disable_ipv6");
    let _ = std::fs::write(no_v6(&dev), "1");
    // Behind the node's nftables table (and for the seconds it takes the node to restore it
    // when someone flushes it): the host does not route what comes in on the lane, unless an
    // operator turns forwarding on for every interface later, and drops sources the lane's
    // routes do not lead back to.
    for (key, value) in [("forwarding", "0"), ("rp_filter", "1")] {
        let path = format!("/proc/sys/net/ipv4/conf/{dev}/{key}");
        std::fs::write(&path, value).map_err(EngineError::io(format!("write {path}")))?;
    }
    let mut jail = inside("sh", pid)?;
    jail.args(["-c", &format!("cat > {}", no_v6("eth0"))]);
    run(jail, "1")?;
    let mut jail = inside("ip", pid)?;
    jail.args(["-batch", "-"]);
    run(
        jail,
        &format!(
            "addr add {addr}/32 peer {gw}/32 dev eth0\n\
             link set eth0 up\n\
             route add default via {gw} dev eth0\n"
        ),
    )?;
    let mbit = lane.mbit(size);
    if mbit > 0 {
        let mut host = Command::new("tc");
        host.args(["-batch", "-"]);
        run(host, &shaping(&dev, mbit))?;
        let mut jail = inside("tc", pid)?;
        jail.args(["-batch", "-"]);
        run(jail, &shaping("eth0", mbit))?;
    }
    Ok(())
}

/// Removes the host end of `addr`'s veth (and with it the jail's), if it is still there: a
/// dying network namespace takes its veths with it, but not at once.
pub(super) fn detach(lane: &LaneNet, addr: Ipv4Addr) {
    let _ = Command::new("ip")
        .args(["link", "del", &lane.ifname(addr)])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
}

/// What the lane writes to a sandbox's `/etc/resolv.conf`.
pub(super) fn resolv_conf(lane: &LaneNet) -> String {
    format!(
        "# silkmesh egress lane: the node's resolver\nnameserver {}\noptions edns0\n",
        lane.gateway()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lane(prefix_len: u8) -> LaneNet {
        LaneNet {
            network: "10.88.0.0".parse().unwrap(),
            prefix_len,
            ifname_prefix: "smabcde".into(),
            mbit: [0; 3],
        }
    }

    #[test]
    fn addresses_are_handed_out_lowest_first_and_given_back() {
        let a = Addresses::new(lane(29), ["10.88.0.3".parse().unwrap()]);
        let got: Vec<_> = (0..4).map(|_| a.take().unwrap().to_string()).collect();
        assert_eq!(got, ["10.88.0.2", "10.88.0.4", "10.88.0.5", "10.88.0.6"]);
        assert!(a.take().is_err(), "a /29 has five sandbox addresses");
        a.give_back("10.88.0.4".parse().unwrap());
        assert_eq!(a.take().unwrap().to_string(), "10.88.0.4");
        assert_eq!(lane(16).ifname("10.88.1.2".parse().unwrap()), "smabcde0a580102");
    }
}
