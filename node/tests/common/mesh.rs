//! Nodes in a mesh on 127.0.0.x: certificates made by `sandboxd mesh`, a node per address,
//! and what each says about its peers.

use std::path::Path;

use serde_json::Value;

use super::{ROOT, Sandboxd};

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

/// A free UDP port on 127.0.0.`host`, for a mesh endpoint that keeps its address across
/// restarts (as in production).
pub fn free_udp_port(host: u8) -> u16 {
    std::net::UdpSocket::bind(("127.0.0.".to_string() + &host.to_string(), 0))
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
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
