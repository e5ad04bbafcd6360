//! Lane `egress`, attacked from inside sandboxes. The test makes two network namespaces
//! (`silk_testkit::netns`): "upstream", the only way out of "node"'s, with a DNS server
//! (dnsmasq) and servers on documentation, private and metadata addresses that exist only
//! there; the node runs in "node"'s (the test's thread enters it, so the node process it starts
//! does too). No packet leaves the namespaces the test made. Inside sandboxes the testkit's
//! probe resolves, fetches and connects, and says what happened.

mod common;

use std::path::Path;

use common::*;
use serde_json::{Value, json};
use silk_testkit::netns::{Network, PROBE};

const POLICY: &str = r#"{ allow = ["allowed.test", "hold.test", "private.test", "opened.test", "meta.test", "rebind.test", "node.test"] }"#;

fn node_config() -> String {
    format!(
        "[egress]\ndns = [\"192.0.2.1:53\"]\nopen_private = [\"10.201.0.0/16\"]\nmax_connections = 4\n\
         small_mbit = 8\ndefault = {POLICY}\n\n[[pools]]\ntemplate = \"host\"\nlane = \"egress\"\nwarm = 1\n"
    )
}

/// Writes the probe into sandbox `id` once.
fn install_probe(node: &Sandboxd, id: &str, token: &str) {
    let body = json!({ "argv": ["sh", "-c", "cat > /root/probe.py"], "stdin": PROBE }).to_string();
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

/// The lane address the engine gave sandbox `id`.
fn address(node: &Sandboxd, id: &str) -> std::net::Ipv4Addr {
    node.boxes().into_iter().find(|x| x.id.as_str() == id).and_then(|x| x.address).unwrap()
}

fn metric(text: &str, line_start: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix(line_start)?.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {line_start} in the metrics"))
}

#[test]
fn sandboxes_reach_allowed_names_and_nothing_else() {
    let received = tempfile::tempdir().unwrap();
    let udp_log = received.path().join("udp.log");
    let net = Network::new(&udp_log);
    // Everything from here on runs in the node's namespace, the node included.
    std::thread::scope(|s| {
        s.spawn(|| {
            net.enter_node();
            attack_from_inside(&udp_log);
        })
        .join()
        .unwrap()
    });
}

fn attack_from_inside(udp_log: &Path) {
    // The API on the node's own address: reachable from the lane's gateway but for the guard.
    let mut node =
        Sandboxd::start_at(&format!("{}:0", silk_testkit::netns::NODE_ADDR), &node_config());
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

    let b_addr = address(&node, b_id);
    assert_ne!(b_addr, address(&node, id), "each sandbox has its own address");
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
    assert_eq!(status, 422, "a policy for lane none: {v}");
    let (status, v) = node.req(
        "POST",
        "/v1/sandboxes",
        Some(ROOT),
        Some(r#"{"lane": "egress", "egress": {"allow": ["not a name"]}}"#),
    );
    assert_eq!((status, v["error"]["code"].as_str()), (422, Some("invalid")), "{v}");

    // The lane keeps files only: memory asked for is refused, and nothing changes.
    let path = format!("/v1/sandboxes/{id}/hibernate");
    let (status, v) = node.req("POST", &path, Some(token), Some(r#"{"memory": "required"}"#));
    assert_eq!((status, v["error"]["code"].as_str()), (409, Some("memory_snapshot_failed")), "{v}");

    // A restarted node (new proxy and resolver ports, the same table) serves running sandboxes.
    node.restart();
    let got = probe(&node, id, token, json!([["get", "http://allowed.test/"]]));
    assert!(ok_from("198.51.100.10")(&got[0]), "after a restart: {got:?}");

    // Someone flushes the host's firewall: the node puts its table back within seconds.
    let tables = || {
        let out = std::process::Command::new("nft").args(["list", "tables"]).output().unwrap();
        String::from_utf8(out.stdout).unwrap()
    };
    let table = tables()
        .lines()
        .find_map(|l| l.strip_prefix("table inet silkmesh_").map(|t| format!("silkmesh_{t}")))
        .expect("the node's table");
    let flushed =
        std::process::Command::new("nft").args(["delete", "table", "inet", &table]).status();
    assert!(flushed.unwrap().success());
    let back = (0..100).any(|_| {
        std::thread::sleep(std::time::Duration::from_millis(200));
        tables().contains(&table)
    });
    assert!(back, "the table was not restored");
    let got = probe(&node, id, token, json!([["get", format!("http://node.test:{api}/v1/info")]]));
    assert_eq!(got[0], refused(), "{got:?}");

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
    assert_ne!(address(&node, c_id), address(&node, id));
    let got = probe(
        &node,
        c_id,
        c_token,
        json!([["get", "http://allowed.test/"], ["resolve", "denied.test"]]),
    );
    assert!(ok_from("198.51.100.10")(&got[0]), "a fork: {got:?}");
    assert_eq!(got[1], no_name());

    // A branch of the narrowed sandbox runs under its narrower policy, at an address of its own.
    let (status, ck) =
        node.req("POST", &format!("/v1/sandboxes/{n_id}/checkpoint"), Some(n_token), Some(""));
    assert_eq!(status, 201, "{ck}");
    let branch = format!("/v1/checkpoints/{}/claim", ck["id"].as_str().unwrap());
    let (status, b) = node.req("POST", &branch, Some(ROOT), Some(""));
    assert_eq!(status, 201, "{b}");
    let (b_id, b_token) = (b["id"].as_str().unwrap(), b["token"].as_str().unwrap());
    assert_eq!(b["egress"], narrow["egress"]);
    assert_ne!(address(&node, b_id), address(&node, n_id));
    let steps = json!([["resolve", "hold.test"], ["get", "http://allowed.test/"]]);
    let got = probe(&node, b_id, b_token, steps.clone());
    assert_eq!(got[0], no_name());
    assert!(ok_from("198.51.100.10")(&got[1]), "a branch: {got:?}");

    // Archived into the store and woken from it (what a move does on its target node): wired
    // again, under the same policy.
    let (status, v) =
        node.req("POST", &format!("/v1/sandboxes/{n_id}/archive"), Some(n_token), Some(""));
    assert_eq!((status, v["state"].as_str()), (200, Some("archived")), "{v}");
    let got = probe(&node, n_id, n_token, steps);
    assert_eq!(got[0], no_name());
    assert!(ok_from("198.51.100.10")(&got[1]), "woken from its archive: {got:?}");
}
