//! Pools and process memory on a real node (jail engine with CRIU, which scripts/test
//! installs): a pool with a memory golden hands out sandboxes already running what the
//! template's warmup started, and a pool's `memory` setting decides what idle hibernation keeps.

mod common;

use common::*;

/// A counter whose count lives only in the shell's memory, written to /tmp.
const COUNTER: &str = "echo $$ > /tmp/pid; i=0; while :; do i=$((i+1)); echo $i > /tmp/count; \
                       busybox sleep 0.05; done";
/// The counter truncates the file before it writes: a read in between finds it empty.
const READ_COUNT: &str = "c=; while [ -z \"$c\" ]; do c=$(cat /tmp/count); done; echo $c";

fn sh(n: &Sandboxd, id: &str, token: &str, script: &str) -> (i64, String) {
    let v = n.exec(id, token, script);
    (v["exit_code"].as_i64().unwrap(), v["stdout"].as_str().unwrap().trim().to_string())
}

fn count(n: &Sandboxd, id: &str, token: &str) -> u64 {
    let (code, out) = sh(n, id, token, READ_COUNT);
    assert_eq!(code, 0, "no count: {out}");
    out.parse().unwrap()
}

#[test]
fn a_memory_golden_pool_hands_out_sandboxes_running_what_the_warmup_started() {
    let dir = tempfile::tempdir().unwrap();
    let rootfs = busybox_rootfs(dir.path());
    let cfg = format!(
        r#"
[[pools]]
template = "counting"
warm = 1
warm_max = 1
memory_golden = true
idle_hibernate_seconds = 1
memory = "off"

[templates.counting]
dir = "{}"
warmup = ["sh", "-c", "sh -c '{COUNTER}' >/dev/null 2>&1 & busybox sleep 0.3"]
"#,
        rootfs.display()
    );
    let node = Sandboxd::start(&cfg);
    node.wait_warm(1);
    let info = node.info();
    assert!(info["pools"][0]["golden"].is_string(), "{info}");

    let c = node.claim(r#"{"template": "counting"}"#);
    let (id, token) = (c["id"].as_str().unwrap(), c["token"].as_str().unwrap());
    assert_eq!((c["tier"].as_str(), c["memory_snapshot"].as_bool()), (Some("warm"), Some(true)));
    // The warmup's counter runs in it, counting on from where the golden was dumped.
    let (code, pid) = sh(&node, id, token, "cat /tmp/pid");
    assert_eq!(code, 0, "the warmup's process is not there");
    let before = count(&node, id, token);
    std::thread::sleep(std::time::Duration::from_millis(300));
    assert!(count(&node, id, token) > before, "the counter runs");
    assert_eq!(sh(&node, id, token, "hostname").1, id);

    // The pool says `memory = "off"`: idle hibernation keeps the files only.
    let row = || node.req("GET", &format!("/v1/sandboxes/{id}"), Some(token), None).1;
    eventually("idle hibernation", || row()["state"] == "hibernated");
    let v = row();
    assert_eq!(v["memory_snapshot"], false, "{v}");
    assert!(v["memory_note"].as_str().is_some_and(|n| n.contains("not asked")), "{v}");
    // Its files are kept (`/tmp` is on its disk); its processes are not: the count stands.
    let (code, out) =
        sh(&node, id, token, "cat /tmp/pid /tmp/count; busybox sleep 0.3; cat /tmp/count");
    assert_eq!(code, 0, "{out}");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[0], pid, "/tmp was not kept");
    assert_eq!(lines[1], lines[2], "woken from its files, the counter {pid} still counts");
}

/// Starts the counter in sandbox `id` and checkpoints it with its memory: the counter's pid,
/// its count just before, and the checkpoint's id.
fn checkpoint_counting(node: &Sandboxd, id: &str, token: &str) -> (String, u64, String) {
    sh(node, id, token, &format!("sh -c '{COUNTER}' >/dev/null 2>&1 & busybox sleep 0.3"));
    let (_, pid) = sh(node, id, token, "cat /tmp/pid");
    let before = count(node, id, token);
    let path = format!("/v1/sandboxes/{id}/checkpoint");
    let (status, ck) = node.req("POST", &path, Some(token), Some(r#"{"memory": "required"}"#));
    assert_eq!(status, 201, "{ck}");
    (pid, before, ck["id"].as_str().unwrap().to_string())
}

/// Branches a checkpoint; its status, and the new sandbox's id and token.
fn branch(n: &Sandboxd, ck: &str, token: &str) -> (u16, serde_json::Value) {
    let path = format!("/v1/checkpoints/{ck}/claim");
    n.req("POST", &path, Some(token), Some(r#"{"memory": "required"}"#))
}

#[test]
fn a_branch_on_the_node_that_took_the_checkpoint_starts_from_its_copy_while_the_checkpoint_lasts() {
    for copies in [true, false] {
        let node = Sandboxd::start(&format!(
            "checkpoint_copies_mib = {}\n{ONE_WARM}",
            if copies { 4096 } else { 0 }
        ));
        let c = node.claim("{}");
        let (id, token) = (c["id"].as_str().unwrap(), c["token"].as_str().unwrap());
        sh(&node, id, token, "echo on-disk > /root/file");
        let (pid, before, ck) = checkpoint_counting(&node, id, token);
        assert_eq!(metric(&node, "silkmesh_checkpoint_copies_bytes") > 0, copies);
        // Not in the checkpoint: a branch has the files and processes of its moment.
        sh(&node, id, token, "echo later > /root/file");

        let (status, b) = branch(&node, &ck, token);
        assert_eq!(status, 201, "{b}");
        let (bid, btoken) = (b["id"].as_str().unwrap(), b["token"].as_str().unwrap());
        assert_eq!(sh(&node, bid, btoken, "cat /root/file").1, "on-disk");
        assert_eq!(sh(&node, bid, btoken, "cat /tmp/pid").1, pid, "the counter restarted");
        assert!(count(&node, bid, btoken) >= before);
        assert_eq!(sh(&node, bid, btoken, "hostname").1, bid);
        let from_copies = metric(&node, "silkmesh_branched_from_copies_total");
        assert_eq!(from_copies, u64::from(copies));

        // Deleted by another node of the fleet (its manifest gone from the shared store behind
        // this node's back): no branch, though a copy is here, and the copy goes.
        let manifest = node.data().join(format!("store/checkpoints/{ck}"));
        std::fs::remove_file(&manifest).expect("the checkpoint's manifest in the local store");
        let (status, v) = branch(&node, &ck, token);
        assert_eq!((status, v["error"]["code"].as_str()), (404, Some("not_found")), "{v}");
        assert_eq!(metric(&node, "silkmesh_branched_from_copies_total"), from_copies);
        assert_eq!(metric(&node, "silkmesh_checkpoint_copies_bytes"), 0);

        // Deleted here: its copy goes with it, and once the branch that used it goes too,
        // nothing of either is left on the disk.
        let path = format!("/v1/sandboxes/{id}/checkpoint");
        let (status, ck2) = node.req("POST", &path, Some(token), Some(r#"{"memory": "required"}"#));
        assert_eq!(status, 201, "{ck2}");
        let ck2 = ck2["id"].as_str().unwrap();
        assert_eq!(metric(&node, "silkmesh_checkpoint_copies_bytes") > 0, copies);
        let (status, _) = node.req("DELETE", &format!("/v1/checkpoints/{ck2}"), Some(token), None);
        assert_eq!(status, 204);
        assert_eq!(metric(&node, "silkmesh_checkpoint_copies_bytes"), 0);
        let (status, _) = node.req("DELETE", &format!("/v1/sandboxes/{bid}"), Some(btoken), None);
        assert_eq!(status, 204);
        let forks = node.data().join("engine/forks");
        eventually("the copies' files are removed", || {
            std::fs::read_dir(&forks).unwrap().next().is_none()
        });
    }
}

/// `stream` with one byte of its first memory page image flipped: the image tar's entries
/// start on 512-byte boundaries after the memory entry's own header.
fn tamper_pages(stream: &mut [u8]) {
    let at = (512..stream.len())
        .step_by(512)
        .find(|&at| stream[at..].starts_with(b"pages-"))
        .expect("a pages image in the memory entry");
    stream[at + 512 + 100] ^= 0x55;
}

#[test]
fn memory_images_a_store_writer_forged_without_the_fleets_key_never_reach_criu() {
    let node = Sandboxd::start(&format!("checkpoint_copies_mib = 0\n{ONE_WARM}"));
    let c = node.claim("{}");
    let (id, token) = (c["id"].as_str().unwrap(), c["token"].as_str().unwrap());
    let (pid, before, ck) = checkpoint_counting(&node, id, token);

    // What the node signed restores, through the store (no copy is kept here).
    let (status, b) = branch(&node, &ck, token);
    assert_eq!(status, 201, "{b}");
    let (bid, btoken) = (b["id"].as_str().unwrap(), b["token"].as_str().unwrap());
    assert_eq!(sh(&node, bid, btoken, "cat /tmp/pid").1, pid);
    assert!(count(&node, bid, btoken) >= before);

    // Someone who can write to the store, but has not the fleet's key, stores the same
    // checkpoint with one byte of its memory changed: the chunks are sound (named by their
    // hashes), the manifest's metadata is the original's, only the signature is missing.
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        use silk_store::*;
        let fs = fs::FsStore::open(fs::FsConfig::new(node.data().join("store"))).await.unwrap();
        let forger =
            SnapshotStore::new(std::sync::Arc::new(fs), SnapshotConfig::default(), None).unwrap();
        let name = SnapshotName::checkpoint(ck.strip_prefix("ck_").unwrap()).unwrap();
        let mut stream = vec![];
        let manifest = forger.get(&name, &mut stream).await.unwrap();
        tamper_pages(&mut stream);
        forger.put(&name, &stream[..], manifest.meta).await.unwrap();
    });
    let (status, v) = branch(&node, &ck, token);
    assert_eq!(
        (status, v["error"]["code"].as_str()),
        (409, Some("memory_snapshot_failed")),
        "forged memory images were restored: {v}"
    );
    let path = format!("/v1/checkpoints/{ck}/claim");
    let (status, v) = node.req("POST", &path, Some(token), Some(r#"{"memory": "auto"}"#));
    assert_eq!((status, v["memory_snapshot"].as_bool()), (201, Some(false)), "{v}");
    // The node signs its manifests, so its images carry no MAC: only a signature vouches.
    assert!(v["memory_note"].as_str().unwrap().contains("not signed"), "{v}");
}
