//! Pools and process memory on a real node (jail engine with CRIU, which scripts/test
//! installs): a pool with a memory golden hands out sandboxes already running what the
//! template's warmup started, and a pool's `memory` setting decides what idle hibernation keeps.

mod common;

use common::*;

/// A counter whose count lives only in the shell's memory, written to /tmp (a tmpfs).
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
    let (code, _) = sh(&node, id, token, "cat /tmp/pid");
    assert_ne!(code, 0, "woken from its files: a fresh /tmp (was {pid})");
}
