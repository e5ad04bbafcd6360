//! Faults a node meets in production, each under a minute: its S3 server stopped, reset and
//! slowed (a fault proxy between the two); a peer stopped (SIGSTOP) while a sandbox moves to
//! it; a peer whose bulk lane cannot be reached; its disk nearly full. Only the calls that need the faulty part fail, with the documented
//! code; nothing is lost; everything resumes once the fault is gone. (A cut network link is
//! `local_cluster.rs`'s partition.)

#[path = "lifecycle/boxes.rs"]
mod boxes;
mod common;

use std::time::Duration;

use boxes::*;
use common::mesh::*;
use common::*;
use silk_testkit::fault::{Fault, FaultProxy};

fn code(v: &serde_json::Value) -> Option<&str> {
    v["error"]["code"].as_str()
}

/// The suite's S3 server behind a fault proxy: two tries per request and a short connect
/// timeout (a stopped server refuses at once; the timeout only spares a loaded machine).
fn s3_behind(proxy: &FaultProxy) -> String {
    let endpoint = std::env::var("SILK_S3_ENDPOINT").expect("the suite's S3 server");
    s3_store_toml().replace(&endpoint, &format!("http://{}", proxy.addr))
        + "max_attempts = 2\nconnect_timeout_ms = 3000\n"
}

fn upstream() -> std::net::SocketAddr {
    let endpoint = std::env::var("SILK_S3_ENDPOINT").expect("the suite's S3 server");
    endpoint.trim_start_matches("http://").trim_end_matches('/').parse().expect("host:port")
}

#[test]
fn a_store_that_stops_resets_or_slows_fails_only_store_calls_and_loses_nothing() {
    let proxy = FaultProxy::start(upstream());
    let node = Sandboxd::start(&format!("{ONE_WARM}{}", s3_behind(&proxy)));
    let a = claim(&node, "{}");
    sh(&node, &a, WRITE_TREE);
    let before = sh(&node, &a, HASH_TREE);
    let (status, v) = post(&node, &a, "checkpoint", "");
    assert_eq!(status, 201, "{v}");

    for fault in [Fault::Down, Fault::Reset] {
        proxy.set(fault);
        // What needs the store: 503 store_unavailable, and the sandbox stays as it was.
        for verb in ["checkpoint", "archive"] {
            let (status, v) = post(&node, &a, verb, "");
            assert_eq!(
                (status, code(&v)),
                (503, Some("store_unavailable")),
                "{fault:?} {verb}: {v}"
            );
        }
        let list = format!("/v1/sandboxes/{}/checkpoints", a.id);
        let (status, v) = node.req("GET", &list, Some(&a.token), None);
        assert_eq!((status, code(&v)), (503, Some("store_unavailable")), "{fault:?}: {v}");
        assert_eq!(state(&node, &a), "claimed");
        // What does not: exec, hibernate and wake, a claim from the warm pool, a release.
        assert_eq!(sh(&node, &a, HASH_TREE), before, "{fault:?}");
        assert_eq!(post(&node, &a, "hibernate", "").0, 200, "{fault:?}");
        assert_eq!(post(&node, &a, "wake", "").0, 200, "{fault:?}");
        assert_eq!(sh(&node, &a, HASH_TREE), before, "{fault:?}");
        node.wait_warm(1);
        let b = claim(&node, "{}");
        assert_eq!(
            node.req("DELETE", &format!("/v1/sandboxes/{}", b.id), Some(&b.token), None).0,
            204
        );
    }

    // Slow (every request half a second late): store calls take longer and succeed.
    proxy.set(Fault::Slow);
    assert_eq!(post(&node, &a, "checkpoint", "").0, 201);
    let (status, v) = post(&node, &a, "archive", "");
    assert_eq!((status, v["state"].as_str()), (200, Some("archived")), "{v}");
    assert_eq!(post(&node, &a, "wake", "").0, 200);
    assert_eq!(sh(&node, &a, HASH_TREE), before, "woken from an archive made through a slow store");

    // Back to normal: both checkpoints are there, and the journal came through it all.
    proxy.set(Fault::Pass);
    let list = format!("/v1/sandboxes/{}/checkpoints", a.id);
    let (status, v) = node.req("GET", &list, Some(&a.token), None);
    assert_eq!((status, v["checkpoints"].as_array().map(Vec::len)), (200, Some(2)), "{v}");
    let mut node = node;
    node.restart();
    assert_eq!(state(&node, &a), "claimed");
    assert_eq!(sh(&node, &a, HASH_TREE), before);
}

/// SIGSTOP and SIGCONT of a node's process.
fn signal(n: &Sandboxd, sig: i32) {
    let pid = n.child.as_ref().expect("running").id() as i32;
    // SAFETY: kill(2) on the node process this test started.
    let sent = unsafe { libc::kill(pid, sig) };
    assert_eq!(sent, 0, "signal {sig} to {pid}: {}", std::io::Error::last_os_error());
}

/// The tree's hash through `n` once the move has settled there (until then: 503 `moving`, or
/// `peer_unavailable` while the node that took it is not yet a member again).
fn settled_hash(n: &Sandboxd, s: &Box) -> String {
    let body = serde_json::json!({ "argv": ["sh", "-c", HASH_TREE] }).to_string();
    let path = format!("/v1/sandboxes/{}/exec", s.id);
    let mut answer = (0, serde_json::Value::Null);
    eventually("the move settled", || {
        answer = n.req("POST", &path, Some(&s.token), Some(&body));
        answer.0 != 503 || !matches!(code(&answer.1), Some("moving" | "peer_unavailable"))
    });
    let (status, v) = answer;
    assert_eq!((status, &v["exit_code"]), (200, &serde_json::json!(0)), "through {}: {v}", n.addr);
    v["stdout"].as_str().unwrap().trim().to_string()
}

/// The nodes whose engine holds `id` running.
fn running_on(nodes: &[&Sandboxd], id: &str) -> usize {
    nodes.iter().filter(|n| n.boxes().iter().any(|b| b.id.as_str() == id && b.running)).count()
}

/// Two meshed nodes on `hosts` in forward mode (either serves any call, so a test reaches a
/// sandbox through both), sharing a store directory; the directories go with the first value.
fn forwarding_pair(hosts: (u8, u8)) -> ([tempfile::TempDir; 2], Sandboxd, Sandboxd) {
    let (dir, store) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    certs(dir.path(), &["a", "b"]);
    let extra = format!("{ONE_WARM}[store.fs]\nroot = \"{}\"\n", store.path().display());
    let a = forwarding_node(dir.path(), "a", hosts.0, None, &extra);
    let b = forwarding_node(dir.path(), "b", hosts.1, Some(&mesh_addr(&a)), &extra);
    eventually("meshed", || peer_names(&a) == ["b"] && peer_names(&b) == ["a"]);
    ([dir, store], a, b)
}

#[test]
fn a_peer_stopped_while_a_sandbox_moves_to_it_leaves_one_copy() {
    let (_dirs, a, mut b) = forwarding_pair((51, 52));
    let s = claim(&a, "{}");
    sh(&a, &s, WRITE_TREE);
    let before = sh(&a, &s, HASH_TREE);
    let move_to_b = format!("/v1/sandboxes/{}/move", s.id);

    // Stopped before the move: b cannot answer, so the move is in doubt. Until it settles no
    // copy runs (better unavailable than running twice), and claims on a go on.
    signal(&b, libc::SIGSTOP);
    let (status, v) = a.req("POST", &move_to_b, Some(&s.token), Some(r#"{"to": "b"}"#));
    assert_eq!((status, code(&v)), (503, Some("moving")), "{v}");
    assert_eq!(running_on(&[&a, &b], &s.id), 0);
    eventually("b declared down", || peer_names(&a).is_empty());
    let claimed = a.claim("{}");
    assert!(claimed["owner"].as_str().unwrap().starts_with("127.0.0.51:"), "{claimed}");
    // b dies without having read the move and starts again: it never took the sandbox, so the
    // move settles as not made, and the sandbox runs on a again, as it did before it.
    b.restart();
    eventually("b back", || peer_names(&a) == ["b"]);
    eventually("running on a again", || running_on(&[&a], &s.id) == 1);
    assert_eq!(running_on(&[&b], &s.id), 0);
    assert_eq!(settled_hash(&a, &s), before);

    // Stopped before the move, then let go: whether b read the move before it noticed a had
    // given up on it is a race. Either way, once the move settles one copy runs, reached
    // through either node.
    signal(&b, libc::SIGSTOP);
    let (status, v) = a.req("POST", &move_to_b, Some(&s.token), Some(r#"{"to": "b"}"#));
    assert_eq!((status, code(&v)), (503, Some("moving")), "{v}");
    signal(&b, libc::SIGCONT);
    eventually("one running copy", || running_on(&[&a, &b], &s.id) == 1);
    for n in [&a, &b] {
        assert_eq!(settled_hash(n, &s), before);
    }

    // Stopped in the middle of the move, at whatever step it has reached: afterwards one copy
    // runs, on one node or the other, with its files, reached through either.
    // b must be a's peer again first: the pause above can leave it declared down for seconds
    // after the copy settled, and a move to a node that is no peer is refused at once (404
    // `peer_not_found`: the suite saw it once) instead of being cut in the middle.
    eventually("meshed again", || peer_names(&a) == ["b"] && peer_names(&b) == ["a"]);
    // (Back to a first, wherever it is.)
    let back = r#"{"to": "a"}"#;
    let (status, v) = a.req("POST", &move_to_b, Some(&s.token), Some(back));
    assert!(matches!(status, 200 | 409), "{status} {v}");
    let (addr, path, token) = (a.addr, move_to_b.clone(), s.token.clone());
    let mover = std::thread::spawn(move || {
        try_http(addr, "POST", &path, Some(&token), r#"{"to": "b"}"#).map(|a| a.0)
    });
    std::thread::sleep(Duration::from_millis(150));
    signal(&b, libc::SIGSTOP);
    std::thread::sleep(Duration::from_secs(4));
    signal(&b, libc::SIGCONT);
    let answer = mover.join().unwrap();
    assert!(matches!(answer, Some(200 | 409 | 502 | 503)), "{answer:?}");
    eventually("exactly one running copy", || running_on(&[&a, &b], &s.id) == 1);
    for n in [&a, &b] {
        assert_eq!(settled_hash(n, &s), before);
    }
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(running_on(&[&a, &b], &s.id), 1, "a second copy started later");
}

#[test]
fn a_sandbox_moved_to_a_paused_peer_is_try_again_through_its_old_node_not_gone() {
    let (_dirs, a, b) = forwarding_pair((63, 64));
    let s = claim(&a, "{}");
    sh(&a, &s, WRITE_TREE);
    let before = sh(&a, &s, HASH_TREE);
    let (status, v) = a.req(
        "POST",
        &format!("/v1/sandboxes/{}/move", s.id),
        Some(&s.token),
        Some(r#"{"to": "b"}"#),
    );
    assert_eq!(status, 200, "{v}");
    assert_eq!(settled_hash(&a, &s), before);

    // b pauses until a declares it down: the sandbox is b's, alive, only out of reach. A client
    // asking a is told to try again (a 404 would tell it the sandbox is gone: the SDK takes a
    // release's 404 for done).
    signal(&b, libc::SIGSTOP);
    eventually("a drops b", || peer_names(&a).is_empty());
    let body = serde_json::json!({ "argv": ["sh", "-c", HASH_TREE] }).to_string();
    let path = format!("/v1/sandboxes/{}/exec", s.id);
    let (status, v) = a.req("POST", &path, Some(&s.token), Some(&body));
    assert_eq!((status, code(&v)), (503, Some("peer_unavailable")), "{v}");
    signal(&b, libc::SIGCONT);
    assert_eq!(settled_hash(&a, &s), before);
}

#[test]
fn a_move_to_a_node_without_the_bulk_lane_goes_on_quic() {
    // b serves no bulk lane (as where only UDP passes between nodes): a's dial is refused and
    // the files go on a QUIC stream; b itself sends on QUIC.
    let (dir, store) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (a, b) = pair_with(dir.path(), store.path(), (61, 62), "bulk_lane = false\n");
    let c = a.claim("{}");
    let (id, token) = (c["id"].as_str().unwrap(), c["token"].as_str().unwrap());
    exec_via(&a, id, token, WRITE_TREE);
    let before = exec_via(&a, id, token, HASH_TREE);
    for (from, to) in [(&a, "b"), (&b, "a")] {
        let body = format!(r#"{{"to": "{to}", "memory": "off"}}"#);
        let (status, v) =
            from.req("POST", &format!("/v1/sandboxes/{id}/move"), Some(token), Some(&body));
        assert_eq!((status, v["node"].as_str()), (200, Some(to)), "{v}");
        assert_eq!(exec_via(&a, id, token, HASH_TREE), before);
    }
}

/// An ext4 filesystem of `mib` MiB in a file, loop-mounted while the test runs.
struct LoopFs {
    mnt: tempfile::TempDir,
    _image: tempfile::TempDir,
}

impl LoopFs {
    fn new(mib: u64) -> LoopFs {
        let (image, mnt) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let file = image.path().join("fs.img");
        std::fs::File::create(&file).unwrap().set_len(mib << 20).unwrap();
        let run = |cmd: &str, args: &[&std::ffi::OsStr]| {
            let out = std::process::Command::new(cmd).args(args).output().unwrap();
            assert!(out.status.success(), "{cmd}: {}", String::from_utf8_lossy(&out.stderr));
        };
        run("mkfs.ext4", &["-q".as_ref(), "-F".as_ref(), file.as_os_str()]);
        run("mount", &["-o".as_ref(), "loop".as_ref(), file.as_os_str(), mnt.path().as_os_str()]);
        LoopFs { mnt, _image: image }
    }

    fn path(&self) -> &std::path::Path {
        self.mnt.path()
    }
}

impl Drop for LoopFs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg(self.mnt.path()).status();
    }
}

fn free_bytes(dir: &std::path::Path) -> u64 {
    let c = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()).unwrap();
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: statvfs on a NUL-terminated path into a zeroed struct of the right type.
    assert_eq!(unsafe { libc::statvfs(c.as_ptr(), &mut st) }, 0);
    st.f_bavail * st.f_frsize
}

/// A file in `dir` taking all of its filesystem's free space but `left` bytes (something else
/// on the host filling the disk).
fn fill_all_but(dir: &std::path::Path, left: u64) -> std::fs::File {
    let ballast = std::fs::File::create(dir.join("ballast")).unwrap();
    let take = free_bytes(dir) - left;
    // SAFETY: fallocate on a file this test just created.
    let taken =
        unsafe { libc::fallocate(std::os::fd::AsRawFd::as_raw_fd(&ballast), 0, 0, take as i64) };
    assert_eq!(taken, 0, "{}", std::io::Error::last_os_error());
    ballast
}

#[test]
fn checkpoint_copies_give_way_to_a_claim_when_the_disk_is_short() {
    let fs = LoopFs::new(512);
    let node = Sandboxd::start_in(fs.path(), &format!("min_free_mib = 64\n{ONE_WARM}"));
    let a = claim(&node, "{}");
    // 48 MiB in its files: the copy its checkpoint leaves on this node holds them unpacked.
    sh(&node, &a, "head -c 50331648 /dev/urandom > /root/blob && echo kept > /root/file");
    let (status, ck) = post(&node, &a, "checkpoint", r#"{"memory": "required"}"#);
    assert_eq!(status, 201, "{ck}");
    assert!(metric(&node, "silkmesh_checkpoint_copies_bytes") >= 48 << 20);
    node.wait_warm(1);

    // Something else on the host takes all but 32 MiB, half the node's reserve: the copy's
    // room makes up the rest, so the copy goes and the claim is served.
    let _ballast = fill_all_but(fs.path(), 32 << 20);
    let (status, v) = node.req("POST", "/v1/sandboxes", Some(ROOT), Some("{}"));
    assert_eq!(status, 201, "claim: {v}");
    assert_eq!(metric(&node, "silkmesh_checkpoint_copies_bytes"), 0);
    assert!(free_bytes(fs.path()) >= 64 << 20, "the copy's room did not come back");
    // The checkpoint itself is in the store, whole.
    let path = format!("/v1/checkpoints/{}", ck["id"].as_str().unwrap());
    assert_eq!(node.req("GET", &path, Some(&a.token), None).0, 200);
}

#[test]
fn a_nearly_full_disk_answers_507_and_keeps_the_journal_whole() {
    let fs = LoopFs::new(512);
    let mut node = Sandboxd::start_in(fs.path(), &format!("min_free_mib = 64\n{ONE_WARM}"));
    let a = claim(&node, "{}");
    sh(&node, &a, "echo kept > /root/file");
    node.wait_warm(1);
    let b = claim(&node, "{}");

    // Something else on the host takes all but 32 MiB, half the node's reserve.
    let ballast = fill_all_but(fs.path(), 32 << 20);

    let (status, v) = node.req("POST", "/v1/sandboxes", Some(ROOT), Some("{}"));
    assert_eq!((status, code(&v)), (507, Some("insufficient_storage")), "claim: {v}");
    for (verb, body) in [("checkpoint", ""), ("fork", r#"{"count": 1}"#)] {
        let (status, v) = post(&node, &a, verb, body);
        assert_eq!((status, code(&v)), (507, Some("insufficient_storage")), "{verb}: {v}");
    }
    // What is running goes on, and a release is journalled.
    assert_eq!(sh(&node, &a, "cat /root/file"), "kept");
    let release = format!("/v1/sandboxes/{}", b.id);
    assert_eq!(node.req("DELETE", &release, Some(&b.token), None).0, 204);

    // The journal is whole: a start reads every claim back, the release included.
    node.restart();
    assert_eq!(state(&node, &a), "claimed");
    assert_eq!(sh(&node, &a, "cat /root/file"), "kept");
    assert_eq!(node.req("GET", &release, Some(&b.token), None).0, 404);

    // Room again: claims go on.
    drop(ballast);
    std::fs::remove_file(fs.path().join("ballast")).unwrap();
    node.wait_warm(1);
    claim(&node, "{}");
}
