//! The double-copy window of a wake from an archive: node `a` wakes an archive and dies before
//! the store forgets it; it stays down past its wake lease, so node `b` wakes the same archive
//! for a caller. When `a` returns, the sandbox must run once — on `b`, which served it since.

mod common;

use std::process::Command;

use common::mesh::*;
use common::*;

fn exec(n: &Sandboxd, id: &str, token: &str, script: &str) -> (u16, serde_json::Value) {
    let body = serde_json::json!({ "argv": ["sh", "-c", script] }).to_string();
    n.req("POST", &format!("/v1/sandboxes/{id}/exec"), Some(token), Some(&body))
}

#[test]
fn a_node_back_after_another_woke_its_interrupted_wake_keeps_no_second_copy() {
    let (dir, store) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    certs(dir.path(), &["a", "b"]);
    let extra = |pools: &str| format!("{pools}[store.fs]\nroot = \"{}\"\n", store.path().display());
    let (pa, pb) = (free_mesh_port(41), free_mesh_port(42));
    let pool = "[[pools]]\ntemplate = \"host\"\nwarm = 1\n";
    let mut a = node_on(dir.path(), "a", 41, pa, Some(&format!("127.0.0.42:{pb}")), &extra(pool));
    let b =
        node_on(dir.path(), "b", 42, pb, Some(&format!("127.0.0.41:{pa}")), &extra("pools = []\n"));
    eventually("a and b meshed", || peer_names(&a) == ["b"] && peer_names(&b) == ["a"]);

    let c = a.claim("{}");
    let (id, token) = (c["id"].as_str().unwrap(), c["token"].as_str().unwrap());
    assert_eq!(exec(&a, id, token, "echo mine > /root/note").0, 200);
    let (status, v) = a.req("POST", &format!("/v1/sandboxes/{id}/archive"), Some(ROOT), Some(""));
    assert_eq!(status, 200, "{v}");

    // `a` wakes it, journals it running, and dies before the store is told.
    a.crash_at = Some("wake:journalled".into());
    a.restart();
    let woke = try_http(a.addr, "POST", &format!("/v1/sandboxes/{id}/wake"), Some(token), "");
    assert!(woke.is_none(), "the node answered {woke:?} instead of crashing");
    let mut child = a.child.take().unwrap();
    assert!(!child.wait().unwrap().success());
    assert!(a.boxes().iter().any(|x| x.id.to_string() == id), "a's copy runs on while a is down");

    // Its wake lease runs out (an hour, here made old), and a caller reaches `b`, which wakes
    // the archive: a second copy, the one the caller now uses.
    let leases = store.path().join(format!("leases/{id}"));
    for key in std::fs::read_dir(&leases).unwrap() {
        let path = key.unwrap().path();
        let aged = Command::new("touch").args(["-d", "2 hours ago"]).arg(path).status().unwrap();
        assert!(aged.success());
    }
    eventually("b saw a leave", || peer_names(&b).is_empty());
    eventually("b wakes the orphaned archive", || exec(&b, id, token, "true").0 == 200);
    let (_, v) = exec(&b, id, token, "echo theirs >> /root/note; cat /root/note");
    assert_eq!(v["stdout"], "mine\ntheirs\n");

    // `a` comes back: the copy `b` runs is the sandbox; `a` removes its own.
    a.crash_at = None;
    a.launch().unwrap();
    eventually("a and b meshed again", || peer_names(&a) == ["b"]);
    assert!(!a.boxes().iter().any(|x| x.id.to_string() == id), "a kept a second copy");
    let (status, _) = a.req("GET", &format!("/v1/sandboxes/{id}?no_redirect=1"), Some(ROOT), None);
    assert_eq!(status, 404, "a still holds the sandbox");
    let (_, v) = exec(&b, id, token, "cat /root/note");
    assert_eq!(v["stdout"], "mine\ntheirs\n");
}
