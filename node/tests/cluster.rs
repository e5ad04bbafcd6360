//! State that outlives a node: two sandboxd processes sharing one store directory (as a fleet
//! shares a bucket). A golden built on one is fetched by the other (its warmup never runs
//! there), and a checkpoint taken on one is branched on the other.

mod common;

use common::*;

fn metric(n: &Sandboxd, name: &str) -> u64 {
    let (_, v) = n.req("GET", "/metrics", None, None);
    let text = v.as_str().unwrap_or_default().to_string();
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|rest| rest.trim().parse().ok()))
        .unwrap_or_else(|| panic!("no {name} in {text}"))
}

fn sh(n: &Sandboxd, id: &str, token: &str, script: &str) -> String {
    let v = n.exec(id, token, script);
    assert_eq!(v["exit_code"], 0, "{script}: {v}");
    v["stdout"].as_str().unwrap().trim().to_string()
}

#[test]
fn goldens_and_checkpoints_travel_through_the_shared_store() {
    let shared = tempfile::tempdir().unwrap();
    let rootfs = busybox_rootfs(shared.path());
    let store = shared.path().join("store");
    // The warmup records when it ran: a node that fetched the golden shows the builder's time.
    let cfg = format!(
        "[[pools]]\ntemplate = \"tiny\"\nwarm = 1\nwarm_max = 1\n[templates.tiny]\ndir = \"{}\"\nwarmup = [\"sh\", \"-c\", \"cat /proc/uptime > /etc/built\"]\n[store.fs]\nroot = \"{}\"\n",
        rootfs.display(),
        store.display()
    );
    let a = Sandboxd::start(&cfg);
    a.wait_warm(1);
    eventually("a shares its golden", || {
        std::fs::read_dir(store.join("goldens/tiny")).map(|d| d.count()).unwrap_or(0) == 1
    });
    assert_eq!(metric(&a, "silkmesh_golden_builds_total"), 1);

    let b = Sandboxd::start(&cfg);
    b.wait_warm(1);
    assert_eq!(metric(&b, "silkmesh_golden_builds_total"), 0, "b ran no warmup");
    assert_eq!(metric(&b, "silkmesh_golden_downloads_total"), 1);
    let on_a = a.claim(r#"{"template": "tiny"}"#);
    let on_b = b.claim(r#"{"template": "tiny"}"#);
    let built = |n: &Sandboxd, c: &serde_json::Value| {
        sh(n, c["id"].as_str().unwrap(), c["token"].as_str().unwrap(), "cat /etc/built")
    };
    assert_eq!(built(&a, &on_a), built(&b, &on_b), "one golden, built once");

    // Branch anywhere: a checkpoint made on a becomes a sandbox on b.
    let (id, token) = (on_a["id"].as_str().unwrap(), on_a["token"].as_str().unwrap());
    sh(&a, id, token, "mkdir -p /srv && echo from-a > /srv/note");
    let (status, ck) =
        a.req("POST", &format!("/v1/sandboxes/{id}/checkpoint"), Some(token), Some(""));
    assert_eq!(status, 201, "{ck}");
    let (status, branch) = b.req(
        "POST",
        &format!("/v1/checkpoints/{}/claim", ck["id"].as_str().unwrap()),
        Some(token),
        Some(""),
    );
    assert_eq!(status, 201, "{branch}");
    let (bid, btoken) = (branch["id"].as_str().unwrap(), branch["token"].as_str().unwrap());
    assert_eq!(sh(&b, bid, btoken, "cat /srv/note"), "from-a");
    assert_eq!(sh(&b, bid, btoken, "cat /etc/built"), built(&a, &on_a));

    // A template that differs on the branching node is refused with a clear error, not a
    // sandbox on the wrong files.
    let other = tempfile::tempdir().unwrap();
    let other_rootfs = busybox_rootfs(other.path());
    std::fs::write(other_rootfs.join("etc/extra"), "different").unwrap();
    let c = Sandboxd::start(&format!(
        "pools = []\n[templates.tiny]\ndir = \"{}\"\n[store.fs]\nroot = \"{}\"\n",
        other_rootfs.display(),
        store.display()
    ));
    let (status, v) = c.req(
        "POST",
        &format!("/v1/checkpoints/{}/claim", ck["id"].as_str().unwrap()),
        Some(ROOT),
        Some(""),
    );
    assert_eq!((status, v["error"]["code"].as_str()), (409, Some("base_unavailable")), "{v}");
}
