//! Sandboxes that move between real sandboxd processes on 127.0.0.x, in a mesh sharing one
//! store: a move with its files, id and token, and one a crash or a store outage interrupts; an
//! archive woken by another node once its own is gone; running processes carried along; a
//! branch placed on the node that keeps the checkpoint's copy; a move asked for through MCP.
//! Apart from `mesh.rs` (membership, placement, forwarding) because these follow a sandbox,
//! not the mesh.

mod common;

use common::mesh::*;
use common::*;

const TREE: &str = "mkdir -p /srv/t/d && echo one > /srv/t/one && head -c 300000 /dev/urandom > /srv/t/d/noise && ln -s one /srv/t/link";
const HASH: &str = "cd /srv/t && { find . | sort; cat one d/noise; readlink link; } | sha256sum";

#[test]
fn a_sandbox_moves_with_its_files_id_and_token_and_any_node_reaches_it() {
    let (dir, store) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (a, b) = pair(dir.path(), store.path(), (11, 12));
    let c = a.claim("{}");
    let (id, token) = (c["id"].as_str().unwrap(), c["token"].as_str().unwrap());
    exec_via(&a, id, token, TREE);
    let before = exec_via(&a, id, token, HASH);
    // An attack on the target's launcher: files it writes, replaced by links to host paths.
    let host = tempfile::tempdir().unwrap();
    let plant = format!(
        "ln -sf {0}/hostname /etc/hostname && ln -sf {0}/machine-id /etc/machine-id",
        host.path().display()
    );
    exec_via(&a, id, token, &plant);

    // Files only, so the target's launcher starts it (and meets the links).
    let (status, v) = a.req(
        "POST",
        &format!("/v1/sandboxes/{id}/move"),
        Some(token),
        Some(r#"{"to": "b", "memory": "off"}"#),
    );
    assert_eq!(status, 200, "{v}");
    assert_eq!(exec_via(&b, id, token, "cat /etc/hostname"), id);
    assert_eq!(std::fs::read_dir(host.path()).unwrap().count(), 0, "a host file was written");
    assert_eq!((v["node"].as_str(), v["id"].as_str()), (Some("b"), Some(id)));
    assert!(!a.data().join("engine/boxes").join(id).exists(), "gone from the source");
    assert!(b.data().join("engine/boxes").join(id).exists(), "running on the target");
    // The same id and token, through either node.
    assert_eq!(exec_via(&b, id, token, HASH), before);
    assert_eq!(exec_via(&a, id, token, HASH), before, "a redirects to the new owner");
    let (first, _, _) = follow(&a, "GET", &format!("/v1/sandboxes/{id}"), WRONG_TOKEN, None);
    assert_eq!(first, 404);
    // Moving again, back, hibernated, without naming the target (the least loaded peer).
    let (status, v) = b.req("POST", &format!("/v1/sandboxes/{id}/hibernate"), Some(token), None);
    assert_eq!((status, v["state"].as_str()), (200, Some("hibernated")), "{v}");
    let (status, v) =
        a.req("POST", &format!("/v1/sandboxes/{id}/move?no_redirect=1"), Some(token), Some(""));
    assert_eq!(status, 404, "a no longer holds it: {v}");
    let (_, status, v) = follow(&a, "POST", &format!("/v1/sandboxes/{id}/move"), token, Some(""));
    assert_eq!((status, v["node"].as_str()), (200, Some("a")), "{v}");
    assert_eq!(exec_via(&a, id, token, HASH), before);
}

/// Moves `id` from `a` to `b` with `a` set to kill itself at `point`, then starts `a` again.
fn move_crashing_at(a: &mut Sandboxd, b: &Sandboxd, id: &str, token: &str, point: &str) {
    a.crash_at = Some(point.into());
    a.restart();
    eventually("a back in the mesh", || peer_names(b) == ["a"] && peer_names(a) == ["b"]);
    let move_to_b = format!("/v1/sandboxes/{id}/move");
    let answer = try_http(a.addr, "POST", &move_to_b, Some(token), r#"{"to": "b"}"#);
    assert!(answer.is_none(), "{point}: answered {answer:?} instead of crashing");
    a.wait_crash_and_restart();
}

#[test]
fn a_move_interrupted_by_a_crash_leaves_the_sandbox_exactly_once() {
    let (dir, store) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (mut a, mut b) = pair(dir.path(), store.path(), (13, 14));
    let c = a.claim("{}");
    let (id, token) =
        (c["id"].as_str().unwrap().to_string(), c["token"].as_str().unwrap().to_string());
    let (id, token) = (id.as_str(), token.as_str());
    exec_via(&a, id, token, TREE);
    let before = exec_via(&a, id, token, HASH);
    let on = |n: &Sandboxd| n.data().join("engine/boxes").join(id).exists();
    let held = |n: &Sandboxd| {
        n.req("GET", &format!("/v1/sandboxes/{id}?no_redirect=1"), Some(token), None).0 == 200
    };

    // The target dies after starting the sandbox, before journalling it. The source cannot
    // know whether the target took it: it answers 503 `moving` and keeps its copy, stopped,
    // until the target answers for certain. The target, back, has removed its half-made copy
    // and says it does not hold it: the source keeps the sandbox.
    b.crash_at = Some("adopt:restored".into());
    b.restart();
    eventually("b back in the mesh", || peer_names(&a) == ["b"]);
    let (status, v) =
        a.req("POST", &format!("/v1/sandboxes/{id}/move"), Some(token), Some(r#"{"to": "b"}"#));
    assert_eq!((status, v["error"]["code"].as_str()), (503, Some("moving")), "{v}");
    b.wait_crash_and_restart();
    let body = serde_json::json!({ "argv": ["sh", "-c", HASH] }).to_string();
    let exec_ok = |n: &Sandboxd| {
        let r = try_http(n.addr, "POST", &format!("/v1/sandboxes/{id}/exec"), Some(token), &body);
        matches!(r, Some((200, _)))
    };
    eventually("settled on a", || exec_ok(&a));
    assert!(held(&a) && !held(&b), "on a only");
    assert_eq!(exec_via(&a, id, token, HASH), before);
    assert!(!on(&b), "b removed its half-made copy");

    // The source dies half way through streaming the files: the target refuses what came and
    // removes its half-made copy. After its restart the sandbox is still on the source,
    // hibernated, and wakes on the next call.
    eventually("b back in the mesh", || peer_names(&a) == ["b"]);
    move_crashing_at(&mut a, &b, id, token, "move:streaming");
    // Until the move is settled (the target asked) calls answer 503 `moving`; then it wakes.
    eventually("settled on a", || exec_ok(&a));
    assert!(held(&a));
    assert!(!held(&b));
    assert_eq!(exec_via(&a, id, token, HASH), before);

    // The source dies right after the switch: after its restart it learns the target holds
    // the sandbox and forgets its own copy.
    eventually("a back in the mesh", || peer_names(&b) == ["a"] && peer_names(&a) == ["b"]);
    move_crashing_at(&mut a, &b, id, token, "move:switched");
    eventually("settled on b", || !held(&a) && held(&b));
    // Its box (hibernated in place for the move) goes right after it forgets the claim.
    eventually("a removed its copy", || !on(&a));
    eventually("a knows where b is", || {
        peer_warm(&a, "b").is_some() || peers(&a)["peers"][0]["api"].is_string()
    });
    assert_eq!(exec_via(&a, id, token, HASH), before, "reached through a");
}

#[test]
fn an_archive_outlives_its_node_and_any_node_wakes_it_once() {
    let (dir, store) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (mut a, b) = pair(dir.path(), store.path(), (17, 18));
    let c = a.claim(r#"{"ttl_seconds": 600}"#);
    let (id, token) =
        (c["id"].as_str().unwrap().to_string(), c["token"].as_str().unwrap().to_string());
    let (id, token) = (id.as_str(), token.as_str());
    exec_via(&a, id, token, TREE);
    let before = exec_via(&a, id, token, HASH);
    let (status, v) = a.req("POST", &format!("/v1/sandboxes/{id}/archive"), Some(token), Some(""));
    assert_eq!((status, v["state"].as_str()), (200, Some("archived")), "{v}");

    // a dies; its archive does not die with it.
    a.kill9();
    eventually("b drops a", || peer_names(&b).is_empty());
    let (status, _) = b.req("GET", &format!("/v1/sandboxes/{id}"), Some(WRONG_TOKEN), None);
    assert_eq!(status, 404, "a wrong token wakes nothing");
    assert_eq!(exec_via(&b, id, token, HASH), before, "woken on b from the store");
    let (status, row) =
        b.req("GET", &format!("/v1/sandboxes/{id}?no_redirect=1"), Some(token), None);
    assert_eq!((status, row["state"].as_str()), (200, Some("claimed")), "{row}");
    assert!(row["deadline_ms"].as_u64().unwrap() > row["state_since_ms"].as_u64().unwrap());

    // a comes back: it lets go of the archive b woke, and sends callers to b.
    a.restart();
    eventually("a back", || peer_names(&b) == ["a"] && peer_names(&a) == ["b"]);
    let (status, _) = a.req("GET", &format!("/v1/sandboxes/{id}?no_redirect=1"), Some(token), None);
    assert_eq!(status, 404, "a no longer claims it");
    assert_eq!(exec_via(&a, id, token, HASH), before, "reached through a");
}

#[test]
fn a_store_outage_fails_a_move_before_the_switch_and_the_sandbox_stays() {
    let dir = tempfile::tempdir().unwrap();
    certs(dir.path(), &["a", "b"]);
    // A store nobody listens on, one try per request.
    let dead = "[store.s3]\nbucket = \"b\"\nendpoint = \"http://127.0.0.1:9\"\npath_style = true\nmax_attempts = 1\nconnect_timeout_ms = 200\n";
    let pool = "[[pools]]\ntemplate = \"host\"\nwarm = 1\nwarm_max = 1\n";
    let a = node(dir.path(), "a", 19, None, &format!("{pool}{dead}"));
    let b = node(dir.path(), "b", 20, Some(&mesh_addr(&a)), &format!("pools = []\n{dead}"));
    eventually("meshed", || peer_names(&a) == ["b"] && peer_names(&b) == ["a"]);
    // From a's golden, which b can only get from the store (a sandbox cold-booted before the
    // golden was built is over the template alone, which b has).
    a.wait_warm(1);
    let c = a.claim("{}");
    assert_eq!(c["tier"], "warm", "{c}");
    let (id, token) = (c["id"].as_str().unwrap(), c["token"].as_str().unwrap());
    exec_via(&a, id, token, TREE);
    let before = exec_via(&a, id, token, HASH);
    let (status, v) =
        a.req("POST", &format!("/v1/sandboxes/{id}/move"), Some(token), Some(r#"{"to": "b"}"#));
    assert_eq!((status, v["error"]["code"].as_str()), (503, Some("store_unavailable")), "{v}");
    let (status, row) = a.req("GET", &format!("/v1/sandboxes/{id}"), Some(token), None);
    assert_eq!(
        (status, row["state"].as_str()),
        (200, Some("claimed")),
        "running again on a: {row}"
    );
    assert_eq!(exec_via(&a, id, token, HASH), before);
    assert!(!b.data().join("engine/boxes").join(id).exists());
}

/// A counter whose count lives in the shell's memory, written to /tmp with its pid.
const COUNTER: &str = "sh -c 'echo $$ > /tmp/pid; i=0; while :; do i=$((i+1)); echo $i > /tmp/count; sleep 0.05; done' >/dev/null 2>&1 & sleep 0.3";
/// The counter truncates the file before it writes: a read in between finds it empty.
const READ_COUNT: &str = "c=; while [ -z \"$c\" ]; do c=$(cat /tmp/count); done; echo $c";

/// The counter in `id` runs on from `before`, in process `pid`.
fn counts_on(n: &Sandboxd, id: &str, token: &str, before: u64, pid: &str) {
    let now: u64 = exec_via(n, id, token, READ_COUNT).parse().unwrap();
    assert!(now >= before, "the count went back from {before} to {now}: its processes restarted");
    assert_eq!(exec_via(n, id, token, "cat /tmp/pid"), pid);
    std::thread::sleep(std::time::Duration::from_millis(300));
    let later: u64 = exec_via(n, id, token, READ_COUNT).parse().unwrap();
    assert!(later > now, "the counter stopped");
}

#[test]
fn processes_continue_on_the_node_a_sandbox_moves_to_or_wakes_on() {
    let (dir, store) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (a, mut b) = pair(dir.path(), store.path(), (51, 52));
    let c = a.claim(r#"{"ttl_seconds": 600}"#);
    let (id, token) =
        (c["id"].as_str().unwrap().to_string(), c["token"].as_str().unwrap().to_string());
    let (id, token) = (id.as_str(), token.as_str());
    exec_via(&a, id, token, COUNTER);
    let pid = exec_via(&a, id, token, "cat /tmp/pid");
    let before: u64 = exec_via(&a, id, token, READ_COUNT).parse().unwrap();

    let (status, v) =
        a.req("POST", &format!("/v1/sandboxes/{id}/move"), Some(token), Some(r#"{"to": "b"}"#));
    assert_eq!((status, v["memory_snapshot"].as_bool()), (200, Some(true)), "{v}");
    counts_on(&b, id, token, before, &pid);

    // Archived on b, which then dies: a wakes it from the store, its processes too.
    let before: u64 = exec_via(&b, id, token, READ_COUNT).parse().unwrap();
    let (status, v) = b.req("POST", &format!("/v1/sandboxes/{id}/archive"), Some(token), Some(""));
    assert_eq!((status, v["memory_snapshot"].as_bool()), (200, Some(true)), "{v}");
    b.kill9();
    eventually("a drops b", || peer_names(&a).is_empty());
    counts_on(&a, id, token, before, &pid);
}

#[test]
fn a_branch_goes_to_the_node_that_keeps_the_checkpoints_copy_unless_that_node_is_gone() {
    let (dir, store) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (mut a, b) = pair(dir.path(), store.path(), (53, 54));
    let c = a.claim(r#"{"ttl_seconds": 600}"#);
    let (id, token) = (c["id"].as_str().unwrap(), c["token"].as_str().unwrap());
    exec_via(&a, id, token, COUNTER);
    let pid = exec_via(&a, id, token, "cat /tmp/pid");
    let before: u64 = exec_via(&a, id, token, READ_COUNT).parse().unwrap();
    let required = r#"{"memory": "required"}"#;
    let (status, ck) =
        a.req("POST", &format!("/v1/sandboxes/{id}/checkpoint"), Some(token), Some(required));
    assert_eq!(status, 201, "{ck}");
    let branch = format!("/v1/checkpoints/{}/claim", ck["id"].as_str().unwrap());
    let held_by = |n: &Sandboxd, v: &serde_json::Value| {
        let path = format!("/v1/sandboxes/{}", v["id"].as_str().unwrap());
        n.req("GET", &path, Some(ROOT), None).0 == 200
    };

    // Asked of b: sent to a, which keeps the copy, and starts the branch from it.
    let (first, status, v) = follow(&b, "POST", &branch, token, Some(required));
    assert_eq!((first, status), (307, 201), "{v}");
    assert!(held_by(&a, &v), "the branch is not on a: {v}");
    let (bid, btoken) = (v["id"].as_str().unwrap(), v["token"].as_str().unwrap());
    counts_on(&a, bid, btoken, before, &pid);
    let (_, metrics) = a.req("GET", "/metrics", Some(ROOT), None);
    assert!(metrics.as_str().unwrap().contains("silkmesh_branched_from_copies_total 1"));

    // Asked of b for b only: b branches it through the store.
    let (status, _, v) = raw(b.addr, "POST", &format!("{branch}?no_redirect=1"), token, required);
    assert_eq!(status, 201, "{v}");
    assert!(held_by(&b, &v), "the branch is not on b: {v}");
    counts_on(&b, v["id"].as_str().unwrap(), v["token"].as_str().unwrap(), before, &pid);

    // a is gone: b serves the branch itself, from the store.
    a.kill9();
    eventually("b drops a", || peer_names(&b).is_empty());
    let (first, status, v) = follow(&b, "POST", &branch, token, Some(required));
    assert_eq!((first, status), (201, 201), "{v}");
    counts_on(&b, v["id"].as_str().unwrap(), v["token"].as_str().unwrap(), before, &pid);
}

#[test]
fn an_mcp_client_moves_a_sandbox_between_nodes_and_keeps_using_it() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    let (a, _b) = pair(dir.path(), &store, (43, 44));
    let c = a.claim("{}");
    let (id, token) = (c["id"].as_str().unwrap(), c["token"].as_str().unwrap());
    exec_via(&a, id, token, "echo here > /root/moved");
    // The Python MCP client (sdk-rs/tests/mcp/drive.py) on a's /mcp: sandbox_move to b, then
    // sandbox_exec through a, which the SDK behind /mcp follows to b.
    let python = std::env::var("E2B_PYTHON").expect("E2B_PYTHON: run through scripts/test");
    let drive = concat!(env!("CARGO_MANIFEST_DIR"), "/../sdk-rs/tests/mcp/drive.py");
    let url = format!("http://{}/mcp", a.addr);
    let out = std::process::Command::new(python)
        .arg(drive)
        .args(["move", &url, ROOT, id, "b"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    let seen: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    assert!(seen["owner"].as_str().unwrap().starts_with("127.0.0.44:"), "{seen}");
    assert_eq!(seen["stdout"], "here\n");
}
