//! Lane `egress`, attacked from inside sandboxes. The test makes two network namespaces:
//! "upstream", the only way out of "node"'s, with a DNS server (dnsmasq) and servers on
//! documentation and private addresses that exist only there (`tests/egress/upstream.py`); the
//! node runs in "node"'s (the test's thread enters it, so the node process it starts does too).
//! No packet leaves the namespaces the test made. Inside sandboxes `tests/egress/probe.py`
//! resolves, fetches and connects, and says what happened.

mod common;

use std::io::{BufRead, BufReader};
use std::os::fd::AsRawFd;
use std::path::Path;
use std::process::{Child, Command, Stdio};

use common::*;
use serde_json::{Value, json};

/// The two namespaces, their link and their servers; dropped: all gone.
struct Topology {
    names: [String; 2],
    servers: Vec<Child>,
}

fn ip(args: &str) {
    let out = Command::new("ip").args(args.split_whitespace()).output().expect("run ip");
    assert!(out.status.success(), "ip {args}: {}", String::from_utf8_lossy(&out.stderr));
}

impl Topology {
    fn new() -> Topology {
        let tag = std::process::id() % 100_000;
        let (up, node) = (format!("smt-up-{tag}"), format!("smt-node-{tag}"));
        let t = Topology { names: [up.clone(), node.clone()], servers: vec![] };
        ip(&format!("netns add {up}"));
        ip(&format!("netns add {node}"));
        ip(&format!("link add smt{tag}n netns {node} type veth peer name smt{tag}u netns {up}"));
        for (ns, dev, addr) in [(&node, "n", "192.0.2.2/24"), (&up, "u", "192.0.2.1/24")] {
            ip(&format!("-n {ns} addr add {addr} dev smt{tag}{dev}"));
            ip(&format!("-n {ns} link set smt{tag}{dev} up"));
            ip(&format!("-n {ns} link set lo up"));
        }
        ip(&format!("-n {node} route add default via 192.0.2.1"));
        for a in UPSTREAM_ADDRESSES {
            ip(&format!("-n {up} addr add {a}/32 dev lo"));
        }
        t
    }

    /// Starts `argv` in the upstream namespace.
    fn serve(&mut self, argv: &[&str]) -> &mut Child {
        let child = Command::new("ip")
            .args(["netns", "exec", &self.names[0]])
            .args(argv)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("start an upstream server");
        self.servers.push(child);
        self.servers.last_mut().unwrap()
    }

    /// Moves the calling thread into the node's namespace.
    fn enter_node(&self) {
        let ns = std::fs::File::open(format!("/run/netns/{}", self.names[1])).unwrap();
        // SAFETY: setns on this thread only, with a namespace file just opened.
        assert_eq!(unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) }, 0);
    }
}

impl Drop for Topology {
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

/// Upstream's addresses: public (documentation ranges), private, and the metadata address.
const UPSTREAM_ADDRESSES: [&str; 7] = [
    "198.51.100.10", // allowed.test
    "198.51.100.11", // denied.test
    "198.51.100.12", // hold.test: the holding TCP server and the UDP sink
    "203.0.113.5",   // no name: a raw address
    "10.200.0.5",    // private.test: a private range nobody opened
    "10.201.0.5",    // opened.test: a private range the operator opened
    "169.254.169.254",
];

fn dnsmasq_args() -> Vec<String> {
    let names = [
        ("allowed.test", "198.51.100.10"),
        ("denied.test", "198.51.100.11"),
        ("hold.test", "198.51.100.12"),
        ("private.test", "10.200.0.5"),
        ("opened.test", "10.201.0.5"),
        ("meta.test", "169.254.169.254"),
        ("rebind.test", "127.0.0.1"),
        ("node.test", "192.0.2.2"),
    ];
    let mut args: Vec<String> = [
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
    args.extend(names.iter().map(|(n, a)| format!("--address=/{n}/{a}")));
    args
}

const POLICY: &str = r#"{ allow = ["allowed.test", "hold.test", "private.test", "opened.test", "meta.test", "rebind.test", "node.test"] }"#;

fn node_config() -> String {
    format!(
        "[egress]\ndns = [\"192.0.2.1:53\"]\nopen_private = [\"10.201.0.0/16\"]\nmax_connections = 4\n\
         small_mbit = 8\ndefault = {POLICY}\n\n[[pools]]\ntemplate = \"host\"\nlane = \"egress\"\nwarm = 1\n"
    )
}

/// Writes the probe into sandbox `id` once.
fn install_probe(node: &Sandboxd, id: &str, token: &str) {
    let probe = include_str!("egress/probe.py");
    let body = json!({ "argv": ["sh", "-c", "cat > /root/probe.py"], "stdin": probe }).to_string();
    let (status, v) =
        node.req("POST", &format!("/v1/sandboxes/{id}/exec"), Some(token), Some(&body));
    assert_eq!(status, 200, "{v}");
}

/// Runs the probe's `steps` in sandbox `id`: one result each.
fn probe(node: &Sandboxd, id: &str, token: &str, steps: Value) -> Vec<Value> {
    let body = json!({ "argv": ["python3", "/root/probe.py", steps.to_string()] }).to_string();
    let (status, v) =
        node.req("POST", &format!("/v1/sandboxes/{id}/exec"), Some(token), Some(&body));
    assert_eq!(status, 200, "{v}");
    let out = v["stdout"].as_str().unwrap();
    serde_json::from_str::<Vec<Value>>(out.trim())
        .unwrap_or_else(|_| panic!("probe said {out:?}, {}", v["stderr"]))
}

fn refused() -> Value {
    json!({ "err": "refused" })
}

fn no_name() -> Value {
    json!({ "err": "no name" })
}

fn ok_from(addr: &str) -> impl Fn(&Value) -> bool + '_ {
    move |v| v["ok"].as_str().is_some_and(|b| b == format!("hello from {addr}\n"))
}

fn metric(text: &str, line_start: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix(line_start)?.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {line_start} in the metrics"))
}

#[test]
fn sandboxes_reach_allowed_names_and_nothing_else() {
    let mut topology = Topology::new();
    let mut dns = dnsmasq_args();
    let dns: Vec<&str> = dns.iter_mut().map(|s| s.as_str()).collect();
    topology.serve(&dns);
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/egress/upstream.py");
    let servers = [
        "198.51.100.10",
        "198.51.100.11",
        "203.0.113.5",
        "10.200.0.5",
        "10.201.0.5",
        "169.254.169.254",
    ];
    let received = tempfile::tempdir().unwrap();
    let udp_log = received.path().join("udp.log");
    let udp_log_arg = udp_log.to_str().unwrap().to_string();
    let mut argv = vec!["python3", script, "198.51.100.12", &udp_log_arg];
    argv.extend(servers);
    let upstream = topology.serve(&argv);
    let mut ready = String::new();
    BufReader::new(upstream.stdout.as_mut().unwrap()).read_line(&mut ready).unwrap();
    assert_eq!(ready, "ready\n");
    let topology = topology;
    // Everything from here on runs in the node's namespace, the node included.
    std::thread::scope(|s| {
        s.spawn(|| {
            topology.enter_node();
            attack_from_inside(&udp_log);
        })
        .join()
        .unwrap()
    });
}

fn attack_from_inside(udp_log: &Path) {
    let node = Sandboxd::start(&node_config());
    node.wait_warm(1);
    let api = node.addr.port();

    // A warm claim: no network work at the claim, and its DNS and HTTP work at once.
    let a = node.claim(r#"{"lane": "egress"}"#);
    assert_eq!(a["tier"], "warm", "{a}");
    let (id, token) = (a["id"].as_str().unwrap(), a["token"].as_str().unwrap());
    assert_eq!(a["egress"]["allow"].as_array().unwrap().len(), 7, "{a}");
    install_probe(&node, id, token);
    let got = probe(
        &node,
        id,
        token,
        json!([["resolve", "allowed.test"], ["get", "http://allowed.test/"]]),
    );
    assert_eq!(got[0], json!(["198.51.100.10"]));
    assert!(ok_from("198.51.100.10")(&got[1]), "{got:?}");

    // What the policy does not allow, and what the guard refuses whatever the policy says.
    let steps = json!([
        ["resolve", "denied.test"],
        ["get", "http://198.51.100.11/"], // a raw address no allowed name resolved to
        ["get", "http://203.0.113.5/"],   // another
        ["get", "http://198.51.100.10/"], // resolved for allowed.test above: fine
        ["get", "http://169.254.169.254/"], // metadata, raw
        ["get", "http://meta.test/"],     // metadata, through an allowed name
        ["get", format!("http://node.test:{api}/v1/info")], // the node's own address and API
        // The host's loopback, through a name that resolves there: 127.0.0.1 is the sandbox's
        // own loopback, which never leaves it (the guard would refuse it at the proxy).
        ["get", format!("http://rebind.test:{api}/v1/info")],
        ["get", format!("http://10.88.0.1:{api}/v1/info")], // the lane's gateway
        ["get", "http://private.test/"],                    // a private range nobody opened
        ["get", "http://opened.test/"],                     // one the operator opened
    ]);
    let got = probe(&node, id, token, steps);
    let want = [no_name(), refused(), refused()];
    assert_eq!(got[..3], want, "{got:?}");
    assert!(ok_from("198.51.100.10")(&got[3]), "{got:?}");
    assert_eq!(
        got[4..10],
        [refused(), refused(), refused(), refused(), refused(), refused()],
        "{got:?}"
    );
    assert!(ok_from("10.201.0.5")(&got[10]), "{got:?}");

    // Another sandbox of the lane, serving on its address: out of reach.
    let b = node.claim(r#"{"lane": "egress"}"#);
    let (b_id, b_token) = (b["id"].as_str().unwrap(), b["token"].as_str().unwrap());
    node.exec(b_id, b_token, "setsid python3 -m http.server 8080 >/dev/null 2>&1 < /dev/null &");
    let address = |sandbox: &str| {
        node.boxes().into_iter().find(|x| x.id.as_str() == sandbox).and_then(|x| x.address).unwrap()
    };
    let b_addr = address(b_id);
    assert_ne!(b_addr, address(id), "each sandbox has its own address");
    eventually("the neighbour serves", || {
        let check = "python3 -c 'import socket; socket.create_connection((\"127.0.0.1\", 8080), 1)' && echo up";
        node.exec(b_id, b_token, check)["stdout"] == "up\n"
    });
    let got = probe(&node, id, token, json!([["get", format!("http://{b_addr}:8080/")]]));
    assert_eq!(got, [refused()], "a neighbour's server");

    // UDP leaves only to the resolver; connections are bounded per sandbox.
    let got = probe(
        &node,
        id,
        token,
        json!([["udp", "198.51.100.12", 9999], ["hold", "hold.test", 7000, 6]]),
    );
    assert_eq!(got, [json!("sent"), json!({ "greeted": 4 })], "max_connections = 4");

    // Bandwidth: 2 MiB at 8 Mbit/s takes at least 2 s (bursts aside); from the node, far less.
    let got = probe(&node, id, token, json!([["get", "http://allowed.test/big"]]));
    assert_eq!(got[0]["bytes"], 2 << 20, "{got:?}");
    let seconds = got[0]["seconds"].as_f64().unwrap();
    assert!(seconds >= 1.5, "2 MiB in {seconds} s through an 8 Mbit/s lane");

    // Each refusal was counted, by reason; the datagram never reached upstream.
    let (_, m) = node.req("GET", "/metrics", Some(ROOT), None);
    let m = m.as_str().unwrap().to_string();
    for (reason, at_least) in [
        ("name", 1),
        ("not_resolved", 2),
        ("metadata", 2),
        ("node", 1),
        ("sandbox", 2),
        ("private", 1),
        ("limit", 2),
        ("protocol", 1),
    ] {
        let n = metric(&m, &format!("silkmesh_egress_denied_total{{reason=\"{reason}\"}}"));
        assert!(n >= at_least, "{reason}: {n}");
    }
    assert!(metric(&m, "silkmesh_egress_bytes_total{direction=\"in\"}") > 2 << 20);
    assert!(metric(&m, "silkmesh_egress_connections_total") >= 5);
    assert!(!udp_log.exists(), "a datagram got out: {:?}", std::fs::read_to_string(udp_log));

    // A claim narrows the pool's policy; a tenant may not widen it, root may.
    let narrow = node.claim(r#"{"lane": "egress", "egress": {"allow": ["allowed.test"]}}"#);
    let (n_id, n_token) = (narrow["id"].as_str().unwrap(), narrow["token"].as_str().unwrap());
    assert_eq!(narrow["egress"], json!({ "allow": ["allowed.test"], "deny": [] }));
    install_probe(&node, n_id, n_token);
    let got = probe(
        &node,
        n_id,
        n_token,
        json!([["resolve", "hold.test"], ["get", "http://allowed.test/"]]),
    );
    assert_eq!(got[0], no_name());
    assert!(ok_from("198.51.100.10")(&got[1]), "{got:?}");
    let wide = r#"{"lane": "egress", "egress": {"allow": ["*"]}}"#;
    let (status, v) =
        node.req("POST", "/v1/tenants", Some(ROOT), Some(r#"{"name": "t1", "max_sandboxes": 4, "max_checkpoints": 1, "max_store_bytes": 1000000}"#));
    assert_eq!(status, 201, "{v}");
    let key = v["api_key"].as_str().unwrap().to_string();
    let (status, v) = node.req("POST", "/v1/sandboxes", Some(&key), Some(wide));
    assert_eq!((status, v["error"]["code"].as_str()), (403, Some("egress_wider")), "{v}");
    let (status, v) = node.req("POST", "/v1/sandboxes", Some(ROOT), Some(wide));
    assert_eq!(status, 201, "root may widen: {v}");
    let (status, v) =
        node.req("POST", "/v1/sandboxes", Some(ROOT), Some(r#"{"egress": {"allow": ["a.test"]}}"#));
    assert_eq!(status, 400, "a policy for lane none: {v}");
    let (status, v) = node.req(
        "POST",
        "/v1/sandboxes",
        Some(ROOT),
        Some(r#"{"lane": "egress", "egress": {"allow": ["not a name"]}}"#),
    );
    assert_eq!(status, 400, "{v}");

    // Hibernated and woken, and forked: the policy goes with the claim, each copy has an address.
    let (status, v) = node.req("POST", &format!("/v1/sandboxes/{id}/hibernate"), Some(token), None);
    assert_eq!(status, 200, "{v}");
    let got = probe(
        &node,
        id,
        token,
        json!([["get", "http://allowed.test/"], ["resolve", "denied.test"]]),
    );
    assert!(ok_from("198.51.100.10")(&got[0]), "after a wake: {got:?}");
    assert_eq!(got[1], no_name());
    let (status, v) =
        node.req("POST", &format!("/v1/sandboxes/{id}/fork"), Some(token), Some(r#"{"count": 1}"#));
    assert_eq!(status, 201, "{v}");
    let child = &v["sandboxes"][0].clone();
    let (c_id, c_token) = (child["id"].as_str().unwrap(), child["token"].as_str().unwrap());
    assert_eq!(child["egress"], a["egress"]);
    assert_ne!(address(c_id), address(id));
    let got = probe(
        &node,
        c_id,
        c_token,
        json!([["get", "http://allowed.test/"], ["resolve", "denied.test"]]),
    );
    assert!(ok_from("198.51.100.10")(&got[0]), "a fork: {got:?}");
    assert_eq!(got[1], no_name());
}
