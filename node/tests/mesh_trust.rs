//! Trust between nodes, attacked from the side of a member gone bad: a node named in the
//! revocation list is dropped by every node that reads it (its connections closed) and cannot
//! rejoin; a renewed certificate is taken into use without a restart; a node whose certificate
//! expired cannot join (silk-mesh's `tests/mesh.rs` checks that too, also after a reload of the
//! revocation list; a forged `Adopt` is refused in `moves.rs`).

mod common;

use common::mesh::*;
use common::*;

fn names(dir: &std::path::Path, n: &str) -> String {
    sandboxd(&["mesh", "cert", "issue", "--dir", dir.to_str().unwrap(), "--node", n])
}

#[test]
fn a_revoked_node_is_dropped_and_cannot_rejoin_and_a_renewed_certificate_is_used_at_once() {
    let dir = tempfile::tempdir().unwrap();
    sandboxd(&["mesh", "ca", "init", "--dir", dir.path().to_str().unwrap()]);
    let mut serials = std::collections::BTreeMap::new();
    for n in ["a", "b", "c"] {
        let out = names(dir.path(), n);
        serials.insert(n, out.lines().find(|l| l.starts_with("serial:")).unwrap().to_string());
    }
    let list = dir.path().join("revoked.txt");
    let revoked = format!("revoked = \"{}\"\n", list.display());
    let a = node_with(dir.path(), "a", "127.0.0.41:0", None, "", &revoked);
    let join = mesh_addr(&a);
    let b = node_with(dir.path(), "b", "127.0.0.42:0", Some(&join), "", &revoked);
    let c = node_with(dir.path(), "c", "127.0.0.43:0", Some(&join), "", "");
    for n in [&a, &b] {
        eventually("a mesh of three", || peer_names(n).len() == 2);
    }

    // c goes bad: the operator revokes it by serial (a renewal would give it a new one, so
    // b's copy of the list names it too).
    std::fs::write(&list, format!("# compromised\n{}\nc\n", serials["c"])).unwrap();
    for n in [&a, &b] {
        eventually("c is dropped", || peer_names(n) == [if n.addr == a.addr { "b" } else { "a" }]);
    }
    // It keeps trying (its own view still has them, it keeps probing) and stays out.
    std::thread::sleep(std::time::Duration::from_secs(3));
    assert!(!peer_names(&a).contains(&"c".to_string()));
    assert!(!peer_names(&b).contains(&"c".to_string()));
    drop(c);

    // b's certificate is renewed while it runs: new handshakes use it (a new serial), and the
    // old serial can be revoked without dropping b.
    let renewed =
        sandboxd(&["mesh", "cert", "renew", "--dir", dir.path().to_str().unwrap(), "--node", "b"]);
    let new_serial = renewed.lines().find(|l| l.starts_with("serial:")).unwrap();
    assert_ne!(new_serial, serials["b"]);
    std::thread::sleep(std::time::Duration::from_secs(2)); // b reloads it within a second
    std::fs::write(&list, format!("c\n{}\n", serials["b"])).unwrap();
    // Connections made with the old certificate are closed; b comes back on its new one.
    eventually("b is in the mesh on its renewed certificate", || {
        peer_names(&a) == ["b"] && peer_names(&b) == ["a"]
    });
}

#[test]
fn a_node_whose_certificate_expired_cannot_join() {
    let dir = tempfile::tempdir().unwrap();
    sandboxd(&["mesh", "ca", "init", "--dir", dir.path().to_str().unwrap()]);
    for n in ["a", "b"] {
        names(dir.path(), n);
    }
    let a = node_with(dir.path(), "a", "127.0.0.45:0", None, "", "");
    let join = mesh_addr(&a);
    let b = node_with(dir.path(), "b", "127.0.0.46:0", Some(&join), "", "");
    eventually("a mesh of two", || peer_names(&a) == ["b"]);
    let d = dir.path().to_str().unwrap();
    sandboxd(&["mesh", "cert", "issue", "--dir", d, "--node", "x", "--days", "0"]);
    // Valid until the second it was issued: past it by the time x dials.
    std::thread::sleep(std::time::Duration::from_secs(2));
    let x = node_with(dir.path(), "x", "127.0.0.47:0", Some(&join), "", "");
    std::thread::sleep(std::time::Duration::from_secs(3));
    assert_eq!(peer_names(&a), ["b"], "an expired certificate joined: {}", peers(&a));
    assert_eq!(peer_names(&b), ["a"]);
    assert!(peer_names(&x).is_empty());
}
