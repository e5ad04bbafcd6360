//! The local cluster (`deploy/local-cluster`): S3 (Garage), three nodes in one mesh in forward
//! mode, HAProxy in front. Everything here goes through the load balancer, as a client would:
//! claim, write, move, read with the same token; archive on one node, kill it, wake through the
//! balancer elsewhere; branch a checkpoint made on one node on another; goldens built once; a
//! node cut off by a real partition (its link down) is dropped and rejoins; the stock e2b SDK
//! drives sandboxes through the balancer's E2B address, any node forwarding to the owner. The
//! API is TLS end to end (the script's development CA): the balancer and every node answer only
//! over TLS.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::*;
use serde_json::{Value, json};

const TOKEN: &str = "local-cluster-token";
const LB: &str = "127.0.0.1:18080";
const E2B_LB: &str = "127.0.0.1:18030";

struct Cluster {
    dir: tempfile::TempDir,
    /// Trusts the script's development CA.
    tls: std::sync::Arc<rustls::ClientConfig>,
}

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

fn script(dir: &Path, verb: &str) -> std::process::Output {
    Command::new(repo().join("deploy/local-cluster"))
        .arg(verb)
        .env("SILKMESH_CLUSTER_DIR", dir)
        .env("SILKMESH_BIN", launcher().parent().unwrap())
        .env("SILKD_STATIC", static_silkd())
        .env("SILKMESH_LB", LB)
        .env("SILKMESH_E2B_LB", E2B_LB)
        .output()
        .unwrap()
}

impl Cluster {
    fn start() -> Cluster {
        let dir = tempfile::tempdir().unwrap();
        let out = script(dir.path(), "start");
        assert!(
            out.status.success(),
            "local-cluster start: {}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let tls = silk_testkit::tls_client(&dir.path().join("certs/api/ca.pem"));
        Cluster { dir, tls }
    }

    fn pid(&self, node: &str) -> i32 {
        std::fs::read_to_string(self.dir.path().join(format!("{node}.pid")))
            .unwrap()
            .trim()
            .parse()
            .unwrap()
    }

    /// A node's API address, as the script configured it.
    fn api(&self, node: &str) -> std::net::SocketAddr {
        let config = std::fs::read_to_string(self.dir.path().join(format!("{node}.toml"))).unwrap();
        let listen = config.lines().find_map(|l| l.strip_prefix("listen = ")).unwrap();
        listen.trim_matches('"').parse().unwrap()
    }

    /// Whether the nodes run in network namespaces of their own (where the host can make them).
    fn in_namespaces(&self) -> bool {
        std::fs::read_to_string(self.dir.path().join("network")).unwrap().trim() == "netns"
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        script(self.dir.path(), "stop");
    }
}

impl Cluster {
    /// A request through the load balancer, over TLS.
    fn lb(&self, method: &str, path: &str, token: &str, body: Option<&str>) -> (u16, Value) {
        let host = LB.split(':').next().unwrap();
        silk_testkit::https(&self.tls, host, LB.parse().unwrap(), method, path, Some(token), body)
    }

    /// A request to one node directly, over TLS.
    fn direct(&self, node: &str, method: &str, path: &str, token: Option<&str>) -> (u16, Value) {
        silk_testkit::https(&self.tls, node, self.api(node), method, path, token, None)
    }
}

fn exec(cluster: &Cluster, id: &str, token: &str, script: &str) -> String {
    let body = json!({ "argv": ["sh", "-c", script] }).to_string();
    let (status, v) = cluster.lb("POST", &format!("/v1/sandboxes/{id}/exec"), token, Some(&body));
    assert_eq!((status, v["exit_code"].as_i64()), (200, Some(0)), "{script}: {v}");
    v["stdout"].as_str().unwrap().trim().to_string()
}

/// The node that holds `id` (its name), asked of each node directly.
fn owner(cluster: &Cluster, id: &str, token: &str) -> String {
    for n in ["n1", "n2", "n3"] {
        let addr = cluster.api(n);
        if std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_err() {
            continue;
        }
        let path = format!("/v1/sandboxes/{id}?no_redirect=1");
        let (status, _) = cluster.direct(n, "GET", &path, Some(token));
        if status == 200 {
            return n.to_string();
        }
    }
    panic!("no node holds {id}");
}

fn metric(cluster: &Cluster, node: &str, name: &str) -> u64 {
    let (_, v) = cluster.direct(node, "GET", "/metrics", None);
    v.as_str()
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
        .unwrap_or(0)
}

const TREE: &str =
    "mkdir -p /srv/t && echo kept > /srv/t/a && head -c 200000 /dev/urandom > /srv/t/b";
const HASH: &str = "cat /srv/t/a /srv/t/b | sha256sum";

#[test]
fn a_fleet_behind_a_load_balancer_moves_wakes_and_branches_sandboxes() {
    let cluster = Cluster::start();
    // Each node in a network namespace of its own: what one node reaches of another crosses
    // a (virtual) network.
    let own_netns = |pid: i32| std::fs::read_link(format!("/proc/{pid}/ns/net")).unwrap();
    let host_netns = std::fs::read_link("/proc/self/ns/net").unwrap();
    if cluster.in_namespaces() {
        let spaces: std::collections::BTreeSet<_> =
            ["n1", "n2", "n3"].iter().map(|n| own_netns(cluster.pid(n))).collect();
        assert_eq!(spaces.len(), 3, "{spaces:?}");
        assert!(!spaces.contains(&host_netns));
    }
    // TLS only, at the balancer and at every node: plain HTTP gets no answer.
    for addr in [LB.parse().unwrap(), cluster.api("n1"), cluster.api("n2")] {
        let plain = silk_testkit::try_http(addr, "GET", "/healthz", None, None, "text/plain");
        assert!(plain.is_none(), "{addr} answered plain HTTP: {plain:?}");
    }
    eventually("three warm pools", || {
        ["n1", "n2", "n3"].iter().all(|n| {
            let (_, info) = cluster.direct(n, "GET", "/v1/info", Some(TOKEN));
            info["pools"][0]["warm"].as_u64() >= Some(1) && info["mesh"]["peers"] == 2
        })
    });
    // One golden for the host pool, built once in the fleet and fetched by the others (a node
    // may build before another's upload lands: never more than one build per node).
    let builds: u64 = ["n1", "n2", "n3"]
        .iter()
        .map(|n| metric(&cluster, n, "silkmesh_golden_builds_total"))
        .sum();
    let fetched: u64 = ["n1", "n2", "n3"]
        .iter()
        .map(|n| metric(&cluster, n, "silkmesh_golden_downloads_total"))
        .sum();
    assert!(builds >= 1 && builds + fetched == 3, "builds {builds}, fetched {fetched}");

    // The stock e2b SDK through the balancer's E2B address: its calls land on any node, and a
    // node that does not hold the sandbox forwards them to the one that does.
    let url = format!("https://{E2B_LB}");
    let python = std::env::var("E2B_PYTHON").expect("E2B_PYTHON: run through scripts/test");
    let out = Command::new(python)
        .arg(repo().join("node/tests/e2b/sdk_cluster.py"))
        .env("E2B_API_URL", &url)
        .env("E2B_SANDBOX_URL", &url)
        .env("E2B_API_KEY", TOKEN)
        .env("SSL_CERT_FILE", cluster.dir.path().join("certs/api/ca.pem"))
        .env("NO_PROXY", "127.0.0.1")
        .env_remove("HTTPS_PROXY")
        .env_remove("https_proxy")
        .output()
        .unwrap();
    let (stdout, stderr) =
        (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && stdout.contains("done"), "{stdout}\n{stderr}");
    let forwarded: u64 = ["n1", "n2", "n3"]
        .iter()
        .map(|n| metric(&cluster, n, "silkmesh_e2b_forwarded_total"))
        .sum();
    assert!(forwarded > 0, "calls were forwarded to the sandboxes' nodes");

    // Claim through the balancer, write, move, read the same files with the same token.
    let (status, c) = cluster.lb("POST", "/v1/sandboxes", TOKEN, Some(r#"{"ttl_seconds": 600}"#));
    assert_eq!(status, 201, "{c}");
    let (id, token) =
        (c["id"].as_str().unwrap().to_string(), c["token"].as_str().unwrap().to_string());
    exec(&cluster, &id, &token, TREE);
    let before = exec(&cluster, &id, &token, HASH);
    let from = owner(&cluster, &id, &token);
    let (status, v) = cluster.lb("POST", &format!("/v1/sandboxes/{id}/move"), &token, Some(""));
    assert_eq!(status, 200, "{v}");
    let to = owner(&cluster, &id, &token);
    assert_ne!(from, to, "moved to another node");
    assert_eq!(exec(&cluster, &id, &token, HASH), before);

    // A checkpoint made on one node, branched on another (whichever the balancer picks).
    let (status, ck) =
        cluster.lb("POST", &format!("/v1/sandboxes/{id}/checkpoint"), &token, Some(""));
    assert_eq!(status, 201, "{ck}");
    for _ in 0..3 {
        let (status, b) = cluster.lb(
            "POST",
            &format!("/v1/checkpoints/{}/claim", ck["id"].as_str().unwrap()),
            &token,
            Some(""),
        );
        assert_eq!(status, 201, "{b}");
        assert_eq!(
            exec(&cluster, b["id"].as_str().unwrap(), b["token"].as_str().unwrap(), HASH),
            before
        );
    }

    // Archive it, kill its node, wake it through the balancer on another.
    let (status, v) = cluster.lb("POST", &format!("/v1/sandboxes/{id}/archive"), &token, Some(""));
    assert_eq!((status, v["state"].as_str()), (200, Some("archived")), "{v}");
    unsafe { libc::kill(cluster.pid(&to), libc::SIGKILL) };
    eventually("the others drop the dead node", || {
        ["n1", "n2", "n3"].iter().filter(|n| **n != to).all(|n| {
            let (_, info) = cluster.direct(n, "GET", "/v1/info", Some(TOKEN));
            info["mesh"]["peers"] == 1
        })
    });
    assert_eq!(exec(&cluster, &id, &token, HASH), before, "woken on a live node from the store");
    let now = owner(&cluster, &id, &token);
    assert_ne!(now, to);
    let (status, _) = cluster.lb("GET", &format!("/v1/sandboxes/{id}"), WRONG_TOKEN, None);
    assert_eq!(status, 404);

    // A real partition: the third node's link goes down (every packet to and from it dropped).
    // The survivor declares it down and claims through the balancer keep working; when the
    // link comes back it rejoins.
    if !cluster.in_namespaces() {
        return;
    }
    let other = ["n1", "n2", "n3"].into_iter().find(|n| *n != to && *n != now).unwrap();
    let link = |state: &str| {
        let veth = format!("silkmesh-{other}h");
        let out = Command::new("ip").args(["link", "set", &veth, state]).output().unwrap();
        assert!(out.status.success(), "ip link set {veth} {state}: {out:?}");
    };
    let peers_of = |n: &str| {
        let (_, info) = cluster.direct(n, "GET", "/v1/info", Some(TOKEN));
        info["mesh"]["peers"].as_u64()
    };
    link("down");
    eventually("the partitioned node is dropped", || peers_of(&now) == Some(0));
    let (status, c) = cluster.lb("POST", "/v1/sandboxes", TOKEN, Some("{}"));
    assert_eq!(status, 201, "a claim during the partition: {c}");
    assert_eq!(owner(&cluster, c["id"].as_str().unwrap(), c["token"].as_str().unwrap()), now);
    link("up");
    eventually("the partition healed", || peers_of(&now) == Some(1) && peers_of(other) == Some(1));
}
