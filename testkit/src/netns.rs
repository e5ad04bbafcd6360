//! A network for egress tests and benchmarks that sends nothing off this machine: an
//! "upstream" namespace, the only way out of a "node" namespace, with a DNS server (dnsmasq)
//! and servers (`scripts/upstream.py`) on documentation, private and metadata addresses that
//! exist only there. A thread that calls [`Network::enter_node`] is in the node's namespace,
//! and so is every process it starts (a node included).

use std::io::{BufRead, BufReader};
use std::os::fd::AsRawFd;
use std::path::Path;
use std::process::{Child, Command, Stdio};

/// The upstream servers' script (stdlib Python): `python3 -c UPSTREAM ADDR LOG HTTP_ADDR...`.
pub const UPSTREAM: &str = include_str!("../scripts/upstream.py");
/// What sandboxes run to resolve, fetch and connect (`python3 probe.py STEPS_JSON`).
pub const PROBE: &str = include_str!("../scripts/probe.py");

/// The node's address on the link to upstream, and upstream's (its resolver).
pub const NODE_ADDR: &str = "192.0.2.2";
pub const UPSTREAM_DNS: &str = "192.0.2.1:53";
/// Upstream's servers: HTTP on each (`/` names the address, `/big` is 2 MiB, `/1m` 1 MiB).
pub const HTTP_SERVERS: [&str; 6] = [
    "198.51.100.10",
    "198.51.100.11",
    "203.0.113.5",
    "10.200.0.5",
    "10.201.0.5",
    "169.254.169.254",
];
/// The greeting TCP server (port 7000) and the UDP sink (9999).
pub const HOLD_SERVER: &str = "198.51.100.12";
/// The names upstream's resolver answers.
pub const NAMES: [(&str, &str); 8] = [
    ("allowed.test", "198.51.100.10"),
    ("denied.test", "198.51.100.11"),
    ("hold.test", HOLD_SERVER),
    ("private.test", "10.200.0.5"),
    ("opened.test", "10.201.0.5"),
    ("meta.test", "169.254.169.254"),
    ("rebind.test", "127.0.0.1"),
    ("node.test", NODE_ADDR),
];

/// The two namespaces, their link and upstream's servers; dropped: all gone.
#[derive(Debug)]
pub struct Network {
    names: [String; 2],
    servers: Vec<Child>,
}

fn ip(args: &str) {
    let out = Command::new("ip").args(args.split_whitespace()).output().expect("run ip");
    assert!(out.status.success(), "ip {args}: {}", String::from_utf8_lossy(&out.stderr));
}

impl Network {
    /// Makes the namespaces and starts upstream's resolver and servers (the UDP sink appends
    /// what reaches it to `udp_log`).
    pub fn new(udp_log: &Path) -> Network {
        let tag = std::process::id() % 100_000;
        let (up, node) = (format!("smt-up-{tag}"), format!("smt-node-{tag}"));
        let mut net = Network { names: [up.clone(), node.clone()], servers: vec![] };
        ip(&format!("netns add {up}"));
        ip(&format!("netns add {node}"));
        ip(&format!("link add smt{tag}n netns {node} type veth peer name smt{tag}u netns {up}"));
        for (ns, dev, addr) in [(&node, "n", NODE_ADDR), (&up, "u", "192.0.2.1")] {
            ip(&format!("-n {ns} addr add {addr}/24 dev smt{tag}{dev}"));
            ip(&format!("-n {ns} link set smt{tag}{dev} up"));
            ip(&format!("-n {ns} link set lo up"));
        }
        ip(&format!("-n {node} route add default via 192.0.2.1"));
        for a in HTTP_SERVERS.iter().chain([&HOLD_SERVER]) {
            ip(&format!("-n {up} addr add {a}/32 dev lo"));
        }
        let mut dns: Vec<String> = [
            "dnsmasq",
            "--keep-in-foreground",
            "--conf-file=/dev/null",
            "--no-resolv",
            "--no-hosts",
            "--bind-interfaces",
            "--listen-address=192.0.2.1",
            "--user=root",
            "--pid-file=",
        ]
        .map(String::from)
        .to_vec();
        dns.extend(NAMES.iter().map(|(n, a)| format!("--address=/{n}/{a}")));
        net.serve(&dns);
        let mut argv: Vec<String> =
            ["python3", "-c", UPSTREAM, HOLD_SERVER].map(String::from).to_vec();
        argv.push(udp_log.display().to_string());
        argv.extend(HTTP_SERVERS.map(String::from));
        let upstream = net.serve(&argv);
        let mut ready = String::new();
        BufReader::new(upstream.stdout.as_mut().expect("piped"))
            .read_line(&mut ready)
            .expect("upstream starts");
        assert_eq!(ready, "ready\n", "upstream's servers");
        net
    }

    /// Starts `argv` in the upstream namespace.
    fn serve(&mut self, argv: &[String]) -> &mut Child {
        let child = Command::new("ip")
            .args(["netns", "exec", &self.names[0]])
            .args(argv)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("start an upstream server");
        self.servers.push(child);
        self.servers.last_mut().expect("just pushed")
    }

    /// Moves the calling thread into the node's namespace.
    pub fn enter_node(&self) {
        let ns = std::fs::File::open(format!("/run/netns/{}", self.names[1]))
            .expect("the node's namespace");
        // SAFETY: setns on this thread only, with a namespace file just opened.
        assert_eq!(unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) }, 0, "setns");
    }
}

impl Drop for Network {
    fn drop(&mut self) {
        for s in &mut self.servers {
            let _ = s.kill();
            let _ = s.wait();
        }
        for n in &self.names {
            let _ = Command::new("ip").args(["netns", "del", n]).status();
        }
    }
}
