//! The escape suite: hostile code in real sandboxes of a real node (jail engine) tries to reach
//! the host, and the test inspects the host afterwards. Each test makes an attack that worked
//! before the jail hardening (see docs/engine.md, "Threat model").

mod common;

use std::os::unix::fs::MetadataExt;
use std::path::Path;

use common::*;
use serde_json::Value;

const OFF: &str = r#"{"memory": "off"}"#;

struct Box {
    id: String,
    token: String,
}

fn claim(node: &Sandboxd, body: &str) -> Box {
    let v = node.claim(body);
    Box { id: v["id"].as_str().unwrap().into(), token: v["token"].as_str().unwrap().into() }
}

fn boxed(v: &Value) -> Box {
    Box { id: v["id"].as_str().unwrap().into(), token: v["token"].as_str().unwrap().into() }
}

/// Runs a script; (exit code, stdout + stderr).
fn run(node: &Sandboxd, b: &Box, script: &str) -> (i64, String) {
    let v = node.exec(&b.id, &b.token, script);
    let out =
        format!("{}{}", v["stdout"].as_str().unwrap_or(""), v["stderr"].as_str().unwrap_or(""));
    (v["exit_code"].as_i64().unwrap(), out.trim().to_string())
}

fn sh(node: &Sandboxd, b: &Box, script: &str) -> String {
    let (code, out) = run(node, b, script);
    assert_eq!(code, 0, "{script}: {out}");
    out
}

fn post(node: &Sandboxd, b: &Box, verb: &str, body: &str) -> (u16, Value) {
    node.req("POST", &format!("/v1/sandboxes/{}/{verb}", b.id), Some(&b.token), Some(body))
}

/// Host files the sandbox aims its symlinks at: `hostname` must never appear, `machine-id`
/// must keep its content.
struct Targets {
    dir: tempfile::TempDir,
}

impl Targets {
    fn new() -> Targets {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("machine-id"), "host file\n").unwrap();
        std::fs::write(dir.path().join("hosts"), "host file\n").unwrap();
        Targets { dir }
    }

    /// Every file in the sandbox the host side ever wrote, replaced by a symlink to the host.
    fn plant(&self, node: &Sandboxd, b: &Box) {
        let d = self.dir.path().display();
        sh(
            node,
            b,
            &format!(
                "ln -sf {d}/hostname /etc/hostname && ln -sf {d}/machine-id /etc/machine-id \
                 && ln -sf {d}/hosts /etc/hosts && ln -sf {d}/resolv.conf /etc/resolv.conf"
            ),
        );
    }

    fn assert_untouched(&self, after: &str) {
        let d = self.dir.path();
        assert!(!d.join("hostname").exists(), "{after}: a host file was created through a symlink");
        assert!(!d.join("resolv.conf").exists(), "{after}: a host file was created");
        for f in ["machine-id", "hosts"] {
            assert_eq!(std::fs::read_to_string(d.join(f)).unwrap(), "host file\n", "{after}: {f}");
        }
    }
}

/// The sandbox sees its own hostname (the launcher wrote it inside, not through the link).
fn assert_own_hostname(node: &Sandboxd, b: &Box) {
    assert_eq!(sh(node, b, "cat /etc/hostname"), b.id);
}

#[test]
fn symlinks_planted_at_every_path_the_host_writes_never_reach_the_host() {
    let node = Sandboxd::start(ONE_WARM);
    let targets = Targets::new();
    let b = claim(&node, "{}");
    targets.plant(&node, &b);

    // Restart after silkd died (the next exec starts the jail again).
    node.kill_sandbox_processes(&b.id);
    assert_own_hostname(&node, &b);
    targets.assert_untouched("restart after silkd died");

    // Files only at every step, so the launcher starts each sandbox (and meets the links);
    // the same steps keeping memory follow below.
    targets.plant(&node, &b);
    assert_eq!(post(&node, &b, "hibernate", OFF).0, 200);
    assert_eq!(post(&node, &b, "wake", "").0, 200);
    assert_own_hostname(&node, &b);
    targets.assert_untouched("hibernate + wake");

    targets.plant(&node, &b);
    let (status, v) = post(&node, &b, "fork", r#"{"count": 2, "memory": "off"}"#);
    assert_eq!(status, 201, "{v}");
    for child in v["sandboxes"].as_array().unwrap() {
        assert_own_hostname(&node, &boxed(child));
    }
    targets.assert_untouched("fork");

    let (status, ck) = post(&node, &b, "checkpoint", OFF);
    assert_eq!(status, 201, "{ck}");
    let path = format!("/v1/checkpoints/{}/claim", ck["id"].as_str().unwrap());
    let (status, v) = node.req("POST", &path, Some(ROOT), Some(""));
    assert_eq!(status, 201, "{v}");
    assert_own_hostname(&node, &boxed(&v));
    targets.assert_untouched("branch");

    let (status, v) = post(&node, &b, "archive", OFF);
    assert_eq!(status, 200, "{v}");
    assert_own_hostname(&node, &b);
    targets.assert_untouched("archive + wake");

    targets.plant(&node, &b);
    let (status, v) = post(&node, &b, "promote", r#"{"template": "planted"}"#);
    assert_eq!(status, 201, "{v}");
    let c = claim(&node, r#"{"template": "planted"}"#);
    assert_own_hostname(&node, &c);
    targets.assert_untouched("promote + claim");

    // Keeping memory: a copy's identity is set from the host through the sandbox's root (its
    // hostname in its uts namespace, its /etc/hostname and /etc/machine-id files, resolved
    // inside it, no link followed): the links stay links, the host files untouched.
    targets.plant(&node, &b);
    let (status, v) = post(&node, &b, "fork", r#"{"count": 1, "memory": "required"}"#);
    assert_eq!(status, 201, "{v}");
    let child = boxed(&v["sandboxes"][0]);
    assert_eq!(sh(&node, &child, "hostname"), child.id);
    targets.assert_untouched("fork keeping memory");
    let (status, ck) = post(&node, &b, "checkpoint", r#"{"memory": "required"}"#);
    assert_eq!(status, 201, "{ck}");
    let path = format!("/v1/checkpoints/{}/claim", ck["id"].as_str().unwrap());
    let (status, v) = node.req("POST", &path, Some(ROOT), Some(r#"{"memory": "required"}"#));
    assert_eq!(status, 201, "{v}");
    assert_eq!(sh(&node, &boxed(&v), "hostname"), v["id"].as_str().unwrap());
    targets.assert_untouched("branch keeping memory");
}

#[test]
fn root_in_a_sandbox_holds_nothing_over_the_host() {
    let node = Sandboxd::start(ONE_WARM);
    let b = claim(&node, "{}");
    let core_pattern = std::fs::read_to_string("/proc/sys/kernel/core_pattern").unwrap();
    let (code, out) = run(&node, &b, "echo '|/tmp/pwn' > /proc/sys/kernel/core_pattern");
    assert_ne!(code, 0, "{out}");
    let (code, _) =
        run(&node, &b, "cat /proc/sys/kernel/core_pattern > /proc/sys/kernel/core_pattern");
    assert_ne!(code, 0, "writing the same value");
    assert_eq!(std::fs::read_to_string("/proc/sys/kernel/core_pattern").unwrap(), core_pattern);
    let (code, _) = run(&node, &b, "echo 3 > /proc/sys/vm/drop_caches");
    assert_ne!(code, 0);
    if Path::new("/proc/sysrq-trigger").exists() {
        assert_ne!(run(&node, &b, "echo h > /proc/sysrq-trigger").0, 0);
    }
    for masked in ["kcore", "keys", "timer_list"] {
        if Path::new("/proc").join(masked).exists() {
            assert_eq!(sh(&node, &b, &format!("wc -c < /proc/{masked}")), "0", "/proc/{masked}");
        }
    }
    let map = sh(&node, &b, "cat /proc/self/uid_map");
    assert_ne!(map.split_whitespace().nth(1), Some("0"), "the identity map: {map}");
    for attack in
        ["mknod /tmp/sda b 8 0", "mount -t tmpfs x /mnt", "unshare -U -r true", "unshare -m true"]
    {
        assert_ne!(run(&node, &b, attack).0, 0, "{attack}");
    }

    // A setuid shell made inside is no root shell for an unprivileged host user.
    sh(&node, &b, "cp /bin/sh /opt/rootsh && chmod 4755 /opt/rootsh");
    let dir = node.data().join("engine/boxes").join(&b.id);
    let files = if dir.join("disk").is_dir() { dir.join("disk") } else { dir };
    let file = files.join("upper/opt/rootsh");
    let meta = std::fs::metadata(&file).unwrap();
    assert_ne!(meta.uid(), 0, "owned by host root");
    assert_eq!(meta.mode() & 0o4000, 0o4000, "the bit is kept for the sandbox's own use");
    let out = std::process::Command::new("runuser")
        .args(["-u", "nobody", "--"])
        .arg(&file)
        .args(["-c", "id -u"])
        .output()
        .unwrap();
    assert!(!out.status.success(), "nobody ran a sandbox's setuid file: {out:?}");
    for dir in [node.data(), node.data().join("engine"), node.data().join("engine/boxes")] {
        assert_eq!(std::fs::metadata(&dir).unwrap().mode() & 0o077, 0, "{} is open", dir.display());
    }
}

#[test]
fn a_stderr_flood_leaves_the_host_log_bounded() {
    let node = Sandboxd::start(ONE_WARM);
    let b = claim(&node, "{}");
    let log = node.data().join("engine/boxes").join(&b.id).join("agent.log");
    // Through silkd's own descriptors: refused.
    for fd in [1, 2] {
        let (code, _) = run(&node, &b, &format!("yes flood | head -c 10000000 > /proc/1/fd/{fd}"));
        assert_ne!(code, 0, "wrote to silkd's fd {fd}");
    }
    // Through a command's own stderr: it goes to the client, not to the host.
    let (code, _) = run(&node, &b, "yes flood | head -c 3000000 >&2");
    assert_eq!(code, 0);
    let size = std::fs::metadata(&log).unwrap().len();
    assert!(size < 1 << 20, "the agent log grew to {size} bytes");
}

#[test]
fn holes_and_hard_links_checkpoint_as_the_size_of_their_data() {
    let node = Sandboxd::start(ONE_WARM);
    let b = claim(&node, "{}");
    sh(
        &node,
        &b,
        "truncate -s 64G /root/sparse && echo end >> /root/sparse \
         && head -c 67108864 /dev/urandom > /root/data \
         && for i in $(seq 200); do ln /root/data /root/l$i; done",
    );
    let store = node.data().join("store");
    let before = du(&store);
    let (status, ck) = post(&node, &b, "checkpoint", "");
    assert_eq!(status, 201, "{ck}");
    let grew = du(&store) - before;
    assert!(grew < 70 << 20, "the checkpoint took {grew} bytes for 64 MiB of data");
    let path = format!("/v1/checkpoints/{}/claim", ck["id"].as_str().unwrap());
    let (status, v) = node.req("POST", &path, Some(ROOT), Some(""));
    assert_eq!(status, 201, "{v}");
    let c = boxed(&v);
    assert_eq!(sh(&node, &c, "stat -c %s /root/sparse; stat -c %h /root/data"), "68719476740\n201");
    let used_kib: u64 = sh(&node, &c, "du -k /root/sparse | cut -f1").parse().unwrap();
    assert!(used_kib < 1024, "the branch's sparse file takes {used_kib} KiB");
    assert_eq!(sh(&node, &b, "md5sum < /root/data"), sh(&node, &c, "md5sum < /root/l200"));
}

/// Bytes of the files under `dir` (their allocated blocks).
fn du(dir: &Path) -> u64 {
    let mut total = 0;
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let meta = entry.metadata().unwrap();
        total += if meta.is_dir() { du(&entry.path()) } else { meta.blocks() * 512 };
    }
    total
}

#[test]
fn below_the_disk_reserve_new_sandboxes_and_checkpoints_are_refused_and_running_ones_go_on() {
    let mut node = Sandboxd::start(ONE_WARM);
    let b = claim(&node, "{}");
    sh(&node, &b, "echo kept > /root/kept");
    // A reserve larger than any disk: the node is "full" from the start.
    let config = std::fs::read_to_string(&node.config).unwrap();
    std::fs::write(&node.config, format!("min_free_mib = 1000000000000\n{config}")).unwrap();
    node.restart();
    for (method, path, token, body) in [
        ("POST", "/v1/sandboxes".to_string(), ROOT, "{}"),
        ("POST", format!("/v1/sandboxes/{}/fork", b.id), b.token.as_str(), r#"{"count": 1}"#),
        ("POST", format!("/v1/sandboxes/{}/checkpoint", b.id), b.token.as_str(), ""),
    ] {
        let (status, v) = node.req(method, &path, Some(token), Some(body));
        assert_eq!(
            (status, v["error"]["code"].as_str()),
            (507, Some("insufficient_storage")),
            "{path}: {v}"
        );
    }
    assert_eq!(sh(&node, &b, "cat /root/kept"), "kept", "what runs keeps running");
    assert_eq!(node.req("DELETE", &format!("/v1/sandboxes/{}", b.id), Some(&b.token), None).0, 204);
}

#[test]
fn on_btrfs_a_sandbox_that_fills_its_disk_stops_at_its_tier_and_its_neighbours_go_on() {
    fills_its_disk("btrfs", "btrfs_qgroup", "Disk quota exceeded");
}

#[test]
fn on_ext4_a_sandbox_that_fills_its_disk_stops_at_its_tier_and_its_neighbours_go_on() {
    fills_its_disk("ext4", "ext4_image", "No space left on device");
}

fn fills_its_disk(fs_kind: &str, mechanism: &str, full: &str) {
    // A 1 GiB filesystem: a small reserve.
    let mut node = Sandboxd::start(
        "min_free_mib = 16\n[disk]\nsmall_mib = 64\n\n[[pools]]\ntemplate = \"host\"\nwarm = 0\n",
    );
    // The same node again, its data directory now on a filesystem of that kind.
    node.kill9();
    let fs = LoopFs::mount_at(&node.data(), fs_kind);
    node.restart();
    let caps = &node.info()["capabilities"];
    assert_eq!(
        (caps["disk_limit"].as_bool(), caps["disk_mechanism"].as_str()),
        (Some(true), Some(mechanism)),
        "{caps}"
    );
    let a = claim(&node, "{}");
    let b = claim(&node, "{}");
    let (_, out) = run(&node, &a, "dd if=/dev/zero of=/root/fill bs=1M count=200 2>&1; sync");
    assert!(out.contains(full), "{out}");
    let filled: u64 = sh(&node, &a, "stat -c %s /root/fill").parse().unwrap();
    assert!(filled <= 64 << 20, "{filled} bytes past a 64 MiB tier");
    // The neighbour writes, a new claim and its exec work, and the node's journal has room.
    assert_eq!(
        sh(&node, &b, "head -c 10485760 /dev/zero > /root/ten && stat -c %s /root/ten"),
        "10485760"
    );
    let c = claim(&node, "{}");
    assert_eq!(sh(&node, &c, "echo fine"), "fine");
    for s in [&a, &b, &c] {
        assert_eq!(
            node.req("DELETE", &format!("/v1/sandboxes/{}", s.id), Some(&s.token), None).0,
            204
        );
    }
    drop(node);
    drop(fs);
}
