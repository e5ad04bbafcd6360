//! Nodes in a mesh on 127.0.0.x: certificates made by `sandboxd mesh`, a node per address,
//! and what each says about its peers.

use std::io::Write;
use std::path::Path;

use serde_json::Value;

use super::{ROOT, Sandboxd, eventually};

pub fn sandboxd(args: &[&str]) -> String {
    let out =
        std::process::Command::new(env!("CARGO_BIN_EXE_sandboxd")).args(args).output().unwrap();
    assert!(out.status.success(), "sandboxd {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

/// A CA in `dir` and a certificate for each name, made by the `sandboxd mesh` commands.
pub fn certs(dir: &Path, names: &[&str]) {
    sandboxd(&["mesh", "ca", "init", "--dir", dir.to_str().unwrap()]);
    for n in names {
        sandboxd(&["mesh", "cert", "issue", "--dir", dir.to_str().unwrap(), "--node", n]);
    }
}

/// A node named `name` on 127.0.0.`host` (API and mesh), joining through `join`.
pub fn node(certs: &Path, name: &str, host: u8, join: Option<&str>, extra: &str) -> Sandboxd {
    node_on(certs, name, host, 0, join, extra)
}

/// A port on 127.0.0.`host` free for both mesh lanes, for a mesh endpoint that keeps its
/// address across restarts (as in production).
pub fn free_mesh_port(host: u8) -> u16 {
    silk_mesh::free_port(std::net::Ipv4Addr::new(127, 0, 0, host).into()).unwrap()
}

pub fn node_on(
    certs: &Path,
    name: &str,
    host: u8,
    port: u16,
    join: Option<&str>,
    extra: &str,
) -> Sandboxd {
    node_with(certs, name, &format!("127.0.0.{host}:{port}"), join, extra, "")
}

/// A node in forward mode (clients need reach only it) on 127.0.0.`host`.
pub fn forwarding_node(
    certs: &Path,
    name: &str,
    host: u8,
    join: Option<&str>,
    extra: &str,
) -> Sandboxd {
    node_with(certs, name, &format!("127.0.0.{host}:0"), join, extra, "forward = true\n")
}

/// A node whose mesh endpoint is `mesh` (its API on the same address, any port); `extra` is
/// top-level TOML and tables, `mesh_extra` keys of its `[mesh]`.
pub fn node_with(
    certs: &Path,
    name: &str,
    mesh: &str,
    join: Option<&str>,
    extra: &str,
    mesh_extra: &str,
) -> Sandboxd {
    let join = join.map(|j| format!("join = [\"{j}\"]\n")).unwrap_or_default();
    let d = certs.display();
    let host = mesh.rsplit_once(':').map_or(mesh, |(h, _)| h);
    Sandboxd::start_at(
        &format!("{host}:0"),
        &format!(
            "{extra}\n[mesh]\nname = \"{name}\"\nlisten = \"{mesh}\"\n{join}{mesh_extra}ca = \"{d}/ca.pem\"\ncert = \"{d}/{name}.pem\"\nkey = \"{d}/{name}.key\"\n"
        ),
    )
}

pub fn mesh_addr(n: &Sandboxd) -> String {
    n.info()["mesh"]["addr"].as_str().unwrap().to_string()
}

pub fn peers(n: &Sandboxd) -> Value {
    let (status, v) = n.req("GET", "/v1/peers", Some(ROOT), None);
    assert_eq!(status, 200, "{v}");
    v
}

pub fn peer_names(n: &Sandboxd) -> Vec<String> {
    let mut names: Vec<String> = peers(n)["peers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["name"].as_str().unwrap().to_string())
        .collect();
    names.sort();
    names
}

/// The pool key (template `host`, size `small`, lane `none`) under which `/v1/peers` reports
/// the warm capacity of the pools these tests configure.
pub const KEY: &str = "host/small/none";

/// How many sandboxes of [`KEY`] `n` says peer `name` has warm.
pub fn peer_warm(n: &Sandboxd, name: &str) -> Option<u64> {
    peers(n)["peers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == name)
        .and_then(|p| p["warm"][KEY].as_u64())
}

/// One request; (status, Location, JSON body).
pub fn raw(
    addr: std::net::SocketAddr,
    method: &str,
    path: &str,
    token: &str,
    body: &str,
) -> (u16, Option<String>, Value) {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    write!(s, "{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAuthorization: Bearer {token}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}", body.len()).unwrap();
    let mut text = String::new();
    std::io::Read::read_to_string(&mut s, &mut text).unwrap();
    let (head, rest) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    let location = head.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.eq_ignore_ascii_case("location").then(|| v.trim().to_string())
    });
    (status, location, serde_json::from_str(rest).unwrap_or(Value::String(rest.to_string())))
}

/// Follows one `307` the way the SDK does; returns (first status, final status, body).
pub fn follow(
    n: &Sandboxd,
    method: &str,
    path: &str,
    token: &str,
    body: Option<&str>,
) -> (u16, u16, Value) {
    let body = body.unwrap_or("");
    let (status, location, v) = raw(n.addr, method, path, token, body);
    if status != 307 {
        return (status, status, v);
    }
    let location = location.expect("a 307 has a Location");
    let url = location
        .strip_prefix("http://")
        .unwrap_or_else(|| panic!("location {location:?} of {method} {path}"));
    let (host, rest) = url.split_once('/').unwrap();
    let (status, _, v) = raw(host.parse().unwrap(), method, &format!("/{rest}"), token, body);
    (307, status, v)
}

/// Two meshed nodes sharing one store directory.
pub fn pair(dir: &Path, store: &Path, hosts: (u8, u8)) -> (Sandboxd, Sandboxd) {
    pair_with(dir, store, hosts, "")
}

/// [`pair`], with `b_mesh` keys in b's `[mesh]`.
pub fn pair_with(dir: &Path, store: &Path, hosts: (u8, u8), b_mesh: &str) -> (Sandboxd, Sandboxd) {
    certs(dir, &["a", "b"]);
    let extra = |pools: &str| format!("{pools}[store.fs]\nroot = \"{}\"\n", store.display());
    // Fixed mesh ports: restarted nodes come back at the same address, as in production.
    let (pa, pb) = (free_mesh_port(hosts.0), free_mesh_port(hosts.1));
    let (sa, sb) = (format!("127.0.0.{}:{pa}", hosts.0), format!("127.0.0.{}:{pb}", hosts.1));
    let pool = "[[pools]]\ntemplate = \"host\"\nwarm = 1\nwarm_max = 1\n";
    let a = node_on(dir, "a", hosts.0, pa, Some(&sb), &extra(pool));
    let b = node_with(dir, "b", &sb, Some(&sa), &extra("pools = []\n"), b_mesh);
    eventually("a and b meshed", || peer_names(&a) == ["b"] && peer_names(&b) == ["a"]);
    (a, b)
}

pub fn exec_via(n: &Sandboxd, id: &str, token: &str, script: &str) -> String {
    let body = serde_json::json!({ "argv": ["sh", "-c", script] }).to_string();
    let (_, status, v) = follow(n, "POST", &format!("/v1/sandboxes/{id}/exec"), token, Some(&body));
    assert_eq!((status, v["exit_code"].as_i64()), (200, Some(0)), "{v}");
    v["stdout"].as_str().unwrap().trim().to_string()
}
