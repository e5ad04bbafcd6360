//! kill -9 of a real node in the middle of hibernate, archive, wake and checkpoint (at their
//! journalled steps): after a restart the sandbox is in a state the journal explains, with its
//! files intact, and nothing half-made is left.

mod common;

#[path = "lifecycle/boxes.rs"]
mod boxes;

use boxes::*;
use common::*;

/// Runs `verb` with the node set to kill itself at `point`, restarts it, and checks the
/// sandbox is in `expect` with its files intact.
fn crash_at(point: &str, verb: &str, expect: &str) -> (Sandboxd, Box, String) {
    let mut node = Sandboxd::start(ONE_WARM);
    node.crash_at = Some(point.to_string());
    node.restart();
    let b = claim(&node, "{}");
    sh(&node, &b, WRITE_TREE);
    let before = sh(&node, &b, HASH_TREE);
    let answer =
        try_http(node.addr, "POST", &format!("/v1/sandboxes/{}/{verb}", b.id), Some(&b.token), "");
    assert!(answer.is_none(), "{point}: the node answered {answer:?} instead of crashing");
    node.wait_crash_and_restart();
    assert_eq!(state(&node, &b), expect, "after a crash at {point}");
    // Hibernated in place, archived straight from the box: no tar of it anywhere.
    let snapshots: Vec<_> =
        std::fs::read_dir(node.data().join("snapshots")).unwrap().flatten().collect();
    assert!(snapshots.is_empty(), "{point}: {snapshots:?}");
    assert_eq!(std::fs::read_dir(node.data().join("scratch")).unwrap().count(), 0);
    assert_eq!(sh(&node, &b, HASH_TREE), before, "{point}: files intact");
    assert_eq!(state(&node, &b), "claimed");
    (node, b, before)
}

#[test]
fn kill_9_mid_hibernate_leaves_a_sandbox_that_starts_again() {
    crash_at("hibernate:stopped", "hibernate", "claimed");
}

#[test]
fn kill_9_mid_archive_rolls_back_or_completes() {
    // Its first step hibernates the sandbox in place; the upload streams from its box.
    crash_at("hibernate:stopped", "archive", "claimed");
    crash_at("archive:intent", "archive", "hibernated");
    crash_at("archive:uploaded", "archive", "archived");
}

#[test]
fn kill_9_after_an_upload_whose_capture_failed_half_way_leaves_no_archive() {
    let mut node = Sandboxd::start(ONE_WARM);
    node.crash_at = Some("archive:upload-failed".into());
    node.restart();
    let b = claim(&node, "{}");
    // 8 MiB the store takes first, then a name the capture refuses: the store must not keep
    // the first part as the archive, or the restart would find it and call the sandbox archived.
    sh(&node, &b, "head -c 8388608 /dev/urandom > /root/a && mkdir /root/z && touch /root/z/.wh.x");
    let sum = sh(&node, &b, "sha256sum /root/a");
    let path = format!("/v1/sandboxes/{}/archive", b.id);
    let answer = try_http(node.addr, "POST", &path, Some(&b.token), "");
    assert!(answer.is_none(), "the node answered {answer:?} instead of crashing");
    node.wait_crash_and_restart();
    assert_eq!(state(&node, &b), "hibernated");
    assert_eq!(files_under(&node.data().join("store/archives")), 0);
    assert_eq!(sh(&node, &b, "sha256sum /root/a"), sum);
}

#[test]
fn kill_9_mid_wake_from_an_archive_leaves_no_stale_archive_to_wake_again() {
    let mut node = Sandboxd::start(ONE_WARM);
    let b = claim(&node, "{}");
    sh(&node, &b, WRITE_TREE);
    let before = sh(&node, &b, HASH_TREE);
    assert_eq!(post(&node, &b, "archive", "").0, 200);
    node.crash_at = Some("wake:journalled".into());
    node.restart();
    let path = format!("/v1/sandboxes/{}/wake", b.id);
    let answer = try_http(node.addr, "POST", &path, Some(&b.token), "");
    assert!(answer.is_none(), "the node answered {answer:?} instead of crashing");
    node.wait_crash_and_restart();
    assert_eq!(state(&node, &b), "claimed");
    assert_eq!(sh(&node, &b, HASH_TREE), before);
    // Running here again, it is no longer archived in the store: no other node could wake
    // an old copy of it.
    let store = node.data().join("store");
    assert_eq!(files_under(&store.join("archives")), 0);
    assert_eq!(files_under(&store.join("claims")), 0);
}

#[test]
fn kill_9_mid_checkpoint_leaves_the_source_and_a_whole_checkpoint_or_none() {
    let (node, b, _) = crash_at("checkpoint:captured", "checkpoint", "claimed");
    let (_, list) = node.req("GET", "/v1/checkpoints", Some(ROOT), None);
    assert_eq!(list["checkpoints"].as_array().unwrap().len(), 0, "{list}");
    drop((node, b));
    let (node, b, before) = crash_at("checkpoint:uploaded", "checkpoint", "claimed");
    let (_, list) =
        node.req("GET", &format!("/v1/sandboxes/{}/checkpoints", b.id), Some(&b.token), None);
    let ck = list["checkpoints"][0]["id"].as_str().expect("the uploaded checkpoint is listed");
    let (status, v) =
        node.req("POST", &format!("/v1/checkpoints/{ck}/claim"), Some(ROOT), Some(""));
    assert_eq!(status, 201, "{v}");
    assert_eq!(sh(&node, &child(&v), HASH_TREE), before);
}

/// A node killed with -9 leaves its egress table: it still fences in the sandboxes the node
/// left running. Its proxy's and resolver's ports are free from then on, and the host's own
/// programs that get them (any bind to port 0 may; CRIU's self-test does on every run) are
/// none of that table's business.
#[test]
fn a_killed_nodes_firewall_leaves_the_hosts_own_traffic_on_its_ports_alone() {
    use std::io::{Read, Write};
    use std::net::{TcpListener, TcpStream, UdpSocket};
    use std::time::Duration;

    let mut node = Sandboxd::start(ONE_WARM);
    node.kill9();
    let (table, _) = silk_egress::names(&node.data());
    let out = std::process::Command::new("nft").args(["list", "table", "inet", &table]).output();
    let rules = String::from_utf8(out.expect("nft runs").stdout).unwrap();
    let port = |what: &str| -> u16 {
        let at = rules.find(what).unwrap_or_else(|| panic!("no {what:?} in {rules}"));
        let rest = &rules[at..];
        let digits = rest[rest.find(':').unwrap() + 1..].split(|c: char| !c.is_ascii_digit());
        digits.into_iter().next().unwrap().parse().unwrap()
    };
    let (proxy, dns) = (port("tcp redirect to :"), port("53 redirect to :"));

    let listener = TcpListener::bind(("127.0.0.1", proxy)).expect("the proxy's port is free");
    let mut client =
        TcpStream::connect_timeout(&listener.local_addr().unwrap(), Duration::from_secs(3))
            .expect("a loopback connection to the dead proxy's port is the host's own");
    client.write_all(b"ping").unwrap();
    let (mut served, _) = listener.accept().unwrap();
    let mut got = [0; 4];
    served.read_exact(&mut got).unwrap();
    assert_eq!(&got, b"ping");

    let server = UdpSocket::bind(("127.0.0.1", dns)).expect("the resolver's port is free");
    server.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
    let sender = UdpSocket::bind("127.0.0.1:0").unwrap();
    sender.send_to(b"ping", server.local_addr().unwrap()).unwrap();
    let (n, _) = server.recv_from(&mut got).expect("a datagram to the dead resolver's port");
    assert_eq!(&got[..n], b"ping");
    let _ = silk_egress::nft::remove(&table);
}

/// The node's launcher (`silk-jail --serve`, a root process holding the sandboxes' user
/// namespace) must not outlive a node killed with -9: a start it finished afterwards would
/// run behind the next node's back.
#[test]
fn kill_9_of_the_node_takes_its_launcher_with_it() {
    let mut node = Sandboxd::start(ONE_WARM);
    node.wait_warm(1);
    let pid = node.pid().unwrap();
    let serving = |pid: &u32| {
        std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| c.ends_with(b"--serve\0"))
    };
    let launchers: Vec<u32> =
        children_named(pid, "silk-jail").into_iter().filter(serving).collect();
    assert_eq!(launchers.len(), 1, "one launcher server: {launchers:?}");
    node.kill9();
    silk_testkit::eventually("the launcher exits with its node", || {
        !std::path::Path::new(&format!("/proc/{}", launchers[0])).exists()
    });
    // The next node starts its own and starts sandboxes with it.
    node.launch().unwrap();
    let b = claim(&node, "{}");
    assert_eq!(sh(&node, &b, "echo up"), "up");
}

/// CRIU runs under the node's launcher server (a fork of that small process, not of the node),
/// two processes away from the node, and must still go with a node killed with -9: a dump
/// finished behind the next node's back would end, or freeze again, a sandbox that node hands
/// out. Killed mid-dump, CRIU writes no more (its statistics, the last thing a dump writes, are
/// never there), and the next node hands the sandbox out running again.
#[test]
fn kill_9_mid_dump_takes_criu_with_it() {
    let mut node = Sandboxd::start(ONE_WARM);
    let b = claim(&node, "{}");
    // Enough memory that the dump is caught while it runs (~0.3 s for 384 MiB here).
    sh(
        &node,
        &b,
        "python3 -c \"b = bytearray(384 << 20)\nfor i in range(0, len(b), 4096): b[i] = 1\n\
         open('/tmp/ready', 'w')\nimport time; time.sleep(1e6)\" >/dev/null 2>&1 & \
         until test -e /tmp/ready; do sleep 0.05; done",
    );
    let (addr, token) = (node.addr, b.token.clone());
    let path = format!("/v1/sandboxes/{}/hibernate", b.id);
    let hibernate = std::thread::spawn(move || {
        try_http(addr, "POST", &path, Some(&token), r#"{"memory": "required"}"#)
    });
    let mut dumping = None;
    silk_testkit::eventually("criu dumps the jail", || {
        dumping = criu_dumping(&b.id);
        dumping.is_some()
    });
    let (criu, images) = dumping.unwrap();
    node.kill9();
    assert!(hibernate.join().unwrap().is_none(), "the node answered the hibernate");
    // The CRIU its launcher ran (processes CRIU forked do not inherit the signal, and go
    // when the next node opens: `host::kill_orphaned_criu`).
    silk_testkit::eventually("criu exits with its node", || {
        criu_dumping(&b.id).is_none_or(|(pid, _)| pid != criu)
    });
    let stats = images.join("stats-dump");
    assert!(!stats.exists(), "criu finished its dump after its node was killed");
    node.launch().unwrap();
    assert_eq!(state(&node, &b), "claimed");
    assert_eq!(sh(&node, &b, "echo up"), "up");
}

/// The CRIU a launcher runs to dump sandbox `id`, if one runs: its pid and images directory.
fn criu_dumping(id: &str) -> Option<(u32, std::path::PathBuf)> {
    use std::os::unix::ffi::OsStrExt;
    std::fs::read_dir("/proc").unwrap().flatten().find_map(|e| {
        let pid: u32 = e.file_name().to_str()?.parse().ok()?;
        let cmdline = std::fs::read(e.path().join("cmdline")).ok()?;
        let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
        let dumping = args.first()?.ends_with(b"criu") && args.get(1) == Some(&&b"dump"[..]);
        let at = args.iter().position(|a| *a == b"--images-dir")?;
        let images = std::path::Path::new(std::ffi::OsStr::from_bytes(args.get(at + 1)?));
        let stat = std::fs::read_to_string(e.path().join("stat")).ok()?;
        let ppid = stat.rsplit_once(") ")?.1.split_whitespace().nth(1)?;
        let parent = std::fs::read_to_string(format!("/proc/{ppid}/comm")).unwrap_or_default();
        (dumping && parent.trim() == "silk-jail" && images.to_string_lossy().contains(id))
            .then(|| (pid, images.to_path_buf()))
    })
}

/// Processes whose parent is `parent` and whose name is `comm`.
fn children_named(parent: u32, comm: &str) -> Vec<u32> {
    let stat = |pid: &str| std::fs::read_to_string(format!("/proc/{pid}/stat")).ok();
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| {
            let pid = e.file_name().to_string_lossy().parse::<u32>().ok()?;
            let stat = stat(&pid.to_string())?;
            let (name, rest) = stat.split_once(" (")?.1.rsplit_once(") ")?;
            let ppid: u32 = rest.split_whitespace().nth(1)?.parse().ok()?;
            (name == comm && ppid == parent).then_some(pid)
        })
        .collect()
}
