//! Lifecycle end to end on a real node (jail engine, local store; S3 where named): hibernate and
//! wake, checkpoint and branch, fork, promote, archive, leases that run out, idle hibernation
//! (kill -9 mid-step: kill9.rs).

mod common;

use common::*;
use serde_json::json;

#[path = "lifecycle/boxes.rs"]
mod boxes;

use boxes::*;

#[test]
fn hibernate_frees_the_host_and_any_access_wakes_it_with_the_same_files() {
    let node = Sandboxd::start(ONE_WARM);
    let b = claim(&node, "{}");
    sh(&node, &b, WRITE_TREE);
    let before = sh(&node, &b, HASH_TREE);

    let (status, v) = post(&node, &b, "hibernate", "");
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["state"], "hibernated");
    // CRIU kept its processes (scripts/test installs it; tests/memory.rs in the SDK and the
    // engine check they go on).
    assert_eq!((v["memory_snapshot"].as_bool(), v.get("memory_note")), (Some(true), None), "{v}");
    assert!(!running(&node, &b), "the host's processes are gone");
    let (status, v) = post(&node, &b, "hibernate", "");
    assert_eq!((status, v["state"].as_str()), (200, Some("hibernated")), "idempotent");
    let (status, v) = post(&node, &b, "fork", r#"{"count": 0}"#);
    assert_eq!((status, v["error"]["code"].as_str()), (400, Some("bad_request")));

    // Transparent wake on the next data-plane call.
    assert_eq!(sh(&node, &b, HASH_TREE), before);
    assert_eq!(state(&node, &b), "claimed");
    assert!(running(&node, &b));

    // Explicit wake, and the lease keeps running while hibernated.
    let deadline =
        node.req("GET", &format!("/v1/sandboxes/{}", b.id), Some(&b.token), None).1["deadline_ms"]
            .clone();
    assert_eq!(post(&node, &b, "hibernate", "").0, 200);
    let (status, v) = post(&node, &b, "wake", "");
    assert_eq!((status, v["state"].as_str()), (200, Some("claimed")), "{v}");
    assert_eq!(v["deadline_ms"], deadline);
    assert_eq!(sh(&node, &b, HASH_TREE), before);
    let (status, v) = post(&node, &b, "wake", "");
    assert_eq!((status, v["state"].as_str()), (200, Some("claimed")), "waking a running sandbox");

    // A hibernated sandbox survives a restart of the node, and a release frees its snapshot.
    assert_eq!(post(&node, &b, "hibernate", "").0, 200);
    let mut node = node;
    node.restart();
    assert_eq!(state(&node, &b), "hibernated");
    assert_eq!(sh(&node, &b, HASH_TREE), before);
    assert_eq!(post(&node, &b, "hibernate", "").0, 200);
    let (status, _) = node.req("DELETE", &format!("/v1/sandboxes/{}", b.id), Some(&b.token), None);
    assert_eq!(status, 204);
    assert_eq!(std::fs::read_dir(node.data().join("snapshots")).unwrap().count(), 0);
    let kept_in = node.data().join("engine/boxes").join(&b.id);
    eventually("the hibernated sandbox's files are deleted", || !kept_in.exists());

    // Wrong tokens see nothing.
    let other = claim(&node, "{}");
    let (status, v) = node.req(
        "POST",
        &format!("/v1/sandboxes/{}/hibernate", other.id),
        Some(&b.token),
        Some(""),
    );
    assert_eq!((status, v["error"]["code"].as_str()), (404, Some("not_found")));
}

#[test]
fn a_sandbox_whose_silkd_died_restarts_from_its_files_on_the_next_access() {
    let mut node = Sandboxd::start(ONE_WARM);
    let b = claim(&node, "{}");
    sh(&node, &b, WRITE_TREE);
    let before = sh(&node, &b, HASH_TREE);

    // Its processes die (an OOM kill): the next exec restarts it, with the same files.
    node.kill_sandbox_processes(&b.id);
    assert_eq!(sh(&node, &b, HASH_TREE), before);
    assert_eq!(state(&node, &b), "claimed");
    let (status, metrics) = node.req("GET", "/metrics", None, None);
    assert_eq!(status, 200);
    assert!(metrics.as_str().unwrap().contains("silkmesh_restarted_total 1"), "{metrics}");

    // The node and the sandbox's processes both die (a host reboot): after the node's restart
    // the claim is still there, and the relay restarts it too.
    node.kill9();
    node.kill_sandbox_processes(&b.id);
    node.restart();
    assert_eq!(state(&node, &b), "claimed");
    let stream = upgrade(node.addr, &b.id, &b.token);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let (out, code) = rt.block_on(async {
        relay_exec(&mut relay_connection(stream), &["sh", "-c", HASH_TREE]).await
    });
    assert_eq!((String::from_utf8_lossy(&out).trim(), code), (before.as_str(), 0));
}

#[test]
fn checkpoints_branch_and_forks_are_independent_copies() {
    let node = Sandboxd::start(ONE_WARM);
    let b = claim(&node, r#"{"metadata": {"team": "x"}}"#);
    sh(&node, &b, WRITE_TREE);
    let before = sh(&node, &b, HASH_TREE);
    // Bulk no change below touches: chunks are ~1 MiB (at most 4), so a tree of a few MiB
    // would be a few chunks, and the two a change touches could be all of it.
    sh(&node, &b, "mkdir -p /opt && head -c 12582912 /dev/urandom > /opt/bulk");

    // Files only, both: this is about the files' chunks (a memory image in front of them
    // shifts their chunk boundaries: docs/benchmarks.md has what memory images dedup).
    let (status, ck) = post(&node, &b, "checkpoint", r#"{"name": "first", "memory": "off"}"#);
    assert_eq!(status, 201, "{ck}");
    let ck_id = ck["id"].as_str().unwrap().to_string();
    assert!(ck_id.starts_with("ck_") && ck_id.len() == 35, "{ck_id}");
    assert_eq!(ck["name"], "first");
    assert!(ck["uploaded_bytes"].as_u64().unwrap() >= 16 << 20);
    // The source keeps running; a change after the checkpoint is not in it.
    sh(&node, &b, "echo later > /srv/t/later");
    assert_eq!(state(&node, &b), "claimed");

    // A second checkpoint after a 1 MiB change re-sends only the chunks the change touched:
    // the one holding /srv/t's header (its mtime changed) and the tail from the last cut in
    // front of the new files, at most 4 + 4 + 1 MiB (a chunk is at most 4 MiB) of the 17 MiB.
    sh(&node, &b, "head -c 1048576 /dev/urandom > /srv/t/mib");
    let (status, ck2) = post(&node, &b, "checkpoint", r#"{"memory": "off"}"#);
    assert_eq!(status, 201, "{ck2}");
    let second = ck2["uploaded_bytes"].as_u64().unwrap();
    assert!(second < 10 << 20, "a second checkpoint re-sent {second} bytes");

    let (status, list) =
        node.req("GET", &format!("/v1/sandboxes/{}/checkpoints", b.id), Some(&b.token), None);
    assert_eq!(status, 200);
    assert_eq!(list["checkpoints"].as_array().unwrap().len(), 2, "{list}");
    let (_, all) = node.req("GET", "/v1/checkpoints", Some(ROOT), None);
    assert_eq!(all["checkpoints"][0]["id"], ck_id);
    assert_eq!(node.req("GET", "/v1/checkpoints", Some(&b.token), None).0, 401);

    // Branch: the checkpoint's files exactly, its own id and token, lineage recorded.
    let (status, v) = node.req(
        "POST",
        &format!("/v1/checkpoints/{ck_id}/claim"),
        Some(&b.token),
        Some(r#"{"metadata": {"branch": "yes"}}"#),
    );
    assert_eq!(status, 201, "{v}");
    assert_eq!(v["from_checkpoint"], ck_id);
    assert_eq!(v["metadata"]["branch"], "yes");
    let branch = child(&v);
    assert_ne!(branch.id, b.id);
    assert_eq!(sh(&node, &branch, HASH_TREE), before);
    assert_eq!(node.exec(&branch.id, &branch.token, "test -e /srv/t/later")["exit_code"], 1);
    let (status, _) =
        node.req("GET", &format!("/v1/sandboxes/{}", branch.id), Some(&b.token), None);
    assert_eq!(status, 404, "the source's token is not the branch's");

    // Fork: N children from the current state, each separate from the others and the source.
    let (status, v) = post(&node, &b, "fork", r#"{"count": 3}"#);
    assert_eq!(status, 201, "{v}");
    let kids: Vec<Box> = v["sandboxes"].as_array().unwrap().iter().map(child).collect();
    assert_eq!(kids.len(), 3);
    let now = sh(&node, &b, HASH_TREE);
    for k in &kids {
        assert_eq!(sh(&node, k, HASH_TREE), now);
        assert_eq!(sh(&node, k, "cat /srv/t/later"), "later");
        assert_eq!(sh(&node, k, "hostname"), k.id);
    }
    sh(&node, &kids[0], "echo mine > /srv/t/a/one");
    assert_eq!(sh(&node, &kids[1], "cat /srv/t/a/one"), "one");
    assert_eq!(sh(&node, &b, "cat /srv/t/a/one"), "one");
    let ids: Vec<String> = kids.iter().map(|k| sh(&node, k, "cat /etc/machine-id")).collect();
    assert!(ids[0] != ids[1] && ids[1] != ids[2], "fresh machine identities");
    let (_, row) =
        node.req("GET", &format!("/v1/sandboxes/{}", kids[2].id), Some(&kids[2].token), None);
    assert_eq!(row["forked_from"], b.id);
    for (body, code) in
        [(r#"{"count": 17}"#, 400), (r#"{"count": 0}"#, 400), (r#"{"cnt": 1}"#, 400)]
    {
        assert_eq!(post(&node, &b, "fork", body).0, code, "{body}");
    }

    // A hibernated sandbox is checkpointed and forked from its stopped files, without waking.
    assert_eq!(post(&node, &b, "hibernate", "").0, 200);
    let (status, ck3) = post(&node, &b, "checkpoint", "");
    assert_eq!(status, 201, "{ck3}");
    let (status, forked) = post(&node, &b, "fork", r#"{"count": 1}"#);
    assert_eq!(status, 201, "{forked}");
    assert_eq!(state(&node, &b), "hibernated");
    assert!(!running(&node, &b));
    let (status, v) = node.req(
        "POST",
        &format!("/v1/checkpoints/{}/claim", ck3["id"].as_str().unwrap()),
        Some(&b.token),
        Some(""),
    );
    assert_eq!(status, 201, "{v}");
    assert_eq!(sh(&node, &child(&v), HASH_TREE), now);
    assert_eq!(sh(&node, &child(&forked["sandboxes"][0]), HASH_TREE), now);

    // Delete: gone for branch and list; the token of another sandbox cannot delete it.
    let (status, _) =
        node.req("DELETE", &format!("/v1/checkpoints/{ck_id}"), Some(&kids[0].token), None);
    assert_eq!(status, 404, "a child's token is not the source's");
    let (status, _) = node.req("DELETE", &format!("/v1/checkpoints/{ck_id}"), Some(&b.token), None);
    assert_eq!(status, 204);
    let (status, v) =
        node.req("POST", &format!("/v1/checkpoints/{ck_id}/claim"), Some(ROOT), Some(""));
    assert_eq!((status, v["error"]["code"].as_str()), (404, Some("not_found")));
    for bad in ["ck_zz", "nope", "ck_00000000000000000000000000000000"] {
        assert_eq!(node.req("GET", &format!("/v1/checkpoints/{bad}"), Some(ROOT), None).0, 404);
    }
}

/// Files under `dir`, recursively.
#[test]
fn store_gc_collects_the_chunks_of_deleted_checkpoints_and_keeps_the_rest() {
    let node = Sandboxd::start(&format!(
        "{ONE_WARM}[store]\ngc_interval_seconds = 1\n[store.snapshots]\ngrace_secs = 1\nreuse_window_secs = 0\n"
    ));
    let chunks = node.data().join("store/chunks");
    // The node shares its golden through the store in the background: let that land first.
    eventually("the golden is shared", || files_under(&node.data().join("store/goldens")) > 0);
    let b = claim(&node, "{}");
    sh(&node, &b, "mkdir -p /srv/t && head -c 4194304 /dev/urandom > /srv/t/kept");
    let (status, kept) = post(&node, &b, "checkpoint", "");
    assert_eq!(status, 201, "{kept}");
    let with_kept = files_under(&chunks);
    sh(&node, &b, "rm /srv/t/kept && head -c 8388608 /dev/urandom > /srv/t/dropped");
    let (status, dropped) = post(&node, &b, "checkpoint", "");
    assert_eq!(status, 201, "{dropped}");
    assert!(files_under(&chunks) > with_kept);

    let path = format!("/v1/checkpoints/{}", dropped["id"].as_str().unwrap());
    assert_eq!(node.req("DELETE", &path, Some(ROOT), None).0, 204);
    eventually("the deleted checkpoint's chunks are collected", || {
        files_under(&chunks) <= with_kept
    });
    // The counter moves when the collection that deletes them ends.
    eventually("the metric counts them", || {
        let (_, metrics) = node.req("GET", "/metrics", None, None);
        !metrics.as_str().unwrap().contains("silkmesh_store_gc_deleted_chunks_total 0")
    });
    // What a live checkpoint names stays: it still branches, whole.
    let (status, v) = node.req(
        "POST",
        &format!("/v1/checkpoints/{}/claim", kept["id"].as_str().unwrap()),
        Some(ROOT),
        Some(""),
    );
    assert_eq!(status, 201, "{v}");
    assert_eq!(sh(&node, &child(&v), "wc -c < /srv/t/kept"), "4194304");
}

#[test]
fn archives_no_claim_names_are_swept_and_named_ones_kept() {
    let node = Sandboxd::start(&format!(
        "{ONE_WARM}[store]\ngc_interval_seconds = 1\n[store.snapshots]\ngrace_secs = 1\nreuse_window_secs = 0\n"
    ));
    let archives = node.data().join("store/archives");
    let b = claim(&node, "{}");
    sh(&node, &b, "echo kept > /root/kept");
    assert_eq!(post(&node, &b, "archive", "").0, 200);
    let names = || -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(&archives)
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    };
    let real = names();
    assert_eq!(real.len(), 1, "{real:?}");
    // An archive of the same sandbox under another name, as a wake whose delete failed leaves:
    // no claim names it. (A manifest names itself: the copy is renamed inside too.)
    let orphan = format!("ar_{}.00000000deadbeef", b.id);
    let manifest = std::fs::read_to_string(archives.join(&real[0])).unwrap();
    let renamed = manifest.replace(&format!("archives/{}", real[0]), &format!("archives/{orphan}"));
    assert_ne!(renamed, manifest);
    std::fs::write(archives.join(&orphan), renamed).unwrap();
    eventually("the orphan is swept", || names() == real);
    std::thread::sleep(std::time::Duration::from_millis(2500)); // two more sweeps
    assert_eq!(names(), real, "the archive its claim names stays");
    let (_, metrics) = node.req("GET", "/metrics", None, None);
    assert!(metrics.as_str().unwrap().contains("silkmesh_store_orphan_archives_deleted_total 1"));
    assert_eq!(sh(&node, &b, "cat /root/kept"), "kept", "and wakes");
}

#[test]
fn promote_publishes_a_template_that_claims_clone_from() {
    let node = Sandboxd::start(ONE_WARM);
    let b = claim(&node, "{}");
    sh(&node, &b, WRITE_TREE);
    let before = sh(&node, &b, HASH_TREE);
    let (status, v) = post(&node, &b, "promote", r#"{"template": "mytool"}"#);
    assert_eq!(status, 201, "{v}");
    let digest = v["digest"].as_str().unwrap().to_string();
    assert_eq!(digest.len(), 64);

    let c = claim(&node, r#"{"template": "mytool"}"#);
    assert_eq!(sh(&node, &c, HASH_TREE), before, "the promoted files, deletion included");
    let (_, row) = node.req("GET", &format!("/v1/sandboxes/{}", c.id), Some(&c.token), None);
    assert_eq!(row["tier"], "clone");

    // Re-promote replaces; a pool of the template serves the new version.
    sh(&node, &b, "echo v2 > /srv/t/version");
    let (status, v) = post(&node, &b, "promote", r#"{"template": "mytool"}"#);
    assert_eq!(status, 201);
    assert_ne!(v["digest"], digest);
    let pools = json!({ "pools": [{ "template": "mytool", "warm": 1 }] }).to_string();
    assert_eq!(node.req("PUT", "/v1/pools", Some(ROOT), Some(&pools)).0, 200);
    node.wait_warm(1);
    let d = claim(&node, r#"{"template": "mytool"}"#);
    assert_eq!(sh(&node, &d, "cat /srv/t/version"), "v2");
    let (_, t) = node.req("GET", "/v1/templates", Some(ROOT), None);
    assert!(t["templates"].as_array().unwrap().iter().any(|t| t["name"] == "mytool"), "{t}");

    // Only its owner (or root) may replace a promoted template.
    let other = claim(&node, "{}");
    let (status, v) = post(&node, &other, "promote", r#"{"template": "mytool"}"#);
    assert_eq!((status, v["error"]["code"].as_str()), (409, Some("conflict")), "{v}");
    for (body, status) in [
        (r#"{"template": "host"}"#, 409),
        (r#"{"template": "Bad Name"}"#, 400),
        (r#"{"tmpl": "x"}"#, 400),
    ] {
        assert_eq!(post(&node, &b, "promote", body).0, status, "{body}");
    }
    // Promoted templates survive a restart; deleting one ends new claims of it.
    let mut node = node;
    node.restart();
    let e = claim(&node, r#"{"template": "mytool"}"#);
    assert_eq!(sh(&node, &e, "cat /srv/t/version"), "v2");
    assert_eq!(node.req("DELETE", "/v1/templates/mytool", Some(ROOT), None).0, 204);
    let (status, v) =
        node.req("POST", "/v1/sandboxes", Some(ROOT), Some(r#"{"template": "mytool"}"#));
    assert_eq!((status, v["error"]["code"].as_str()), (404, Some("template_not_found")));
    assert_eq!(sh(&node, &e, "cat /srv/t/version"), "v2", "made from it, still running");
    assert_eq!(node.req("DELETE", "/v1/templates/host", Some(ROOT), None).0, 409);
    assert_eq!(node.req("DELETE", "/v1/templates/mytool", Some(ROOT), None).0, 404);
}

fn archive_round_trip(node: &mut Sandboxd) {
    let b = claim(node, r#"{"ttl_seconds": 600}"#);
    sh(node, &b, WRITE_TREE);
    let before = sh(node, &b, HASH_TREE);
    let (status, v) = post(node, &b, "archive", "");
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["state"], "archived");
    assert!(!running(node, &b));
    assert_eq!(std::fs::read_dir(node.data().join("snapshots")).unwrap().count(), 0, "host freed");
    let (status, v) = post(node, &b, "fork", r#"{"count": 1}"#);
    assert_eq!((status, v["error"]["code"].as_str()), (409, Some("conflict")), "{v}");

    // Archives outlive the node's local state: restart, then access wakes it from the store.
    node.restart();
    assert_eq!(state(node, &b), "archived");
    assert_eq!(sh(node, &b, HASH_TREE), before);
    assert_eq!(state(node, &b), "claimed");

    // A checkpoint on this store, branched.
    let (status, ck) = post(node, &b, "checkpoint", "");
    assert_eq!(status, 201, "{ck}");
    let (status, v) = node.req(
        "POST",
        &format!("/v1/checkpoints/{}/claim", ck["id"].as_str().unwrap()),
        Some(ROOT),
        Some(""),
    );
    assert_eq!(status, 201, "{v}");
    assert_eq!(sh(node, &child(&v), HASH_TREE), before);
}

#[test]
fn archive_to_the_local_store_and_wake_from_it() {
    let mut node = Sandboxd::start(ONE_WARM);
    archive_round_trip(&mut node);
}

#[test]
fn archive_and_branch_through_s3() {
    let mut node = Sandboxd::start(&format!("{ONE_WARM}{}", s3_store_toml()));
    archive_round_trip(&mut node);
}

#[test]
fn an_expiring_lease_archives_and_access_restores_a_fresh_lease() {
    let node = Sandboxd::start(&format!("archive_retention_seconds = 3600\n{ONE_WARM}"));
    let b = claim(&node, r#"{"ttl_seconds": 1, "on_expire": "archive"}"#);
    sh(&node, &b, "echo kept > /root/kept");
    eventually("archived at expiry", || state(&node, &b) == "archived");
    assert_eq!(sh(&node, &b, "cat /root/kept"), "kept");
    let (_, row) = node.req("GET", &format!("/v1/sandboxes/{}", b.id), Some(&b.token), None);
    assert_eq!(row["state"], "claimed");
    assert!(row["deadline_ms"].as_u64().unwrap() > row["state_since_ms"].as_u64().unwrap());
}

#[test]
fn an_expiring_lease_hibernates_and_a_call_wakes_it_with_a_fresh_lease() {
    let node = Sandboxd::start(ONE_WARM);
    let b = claim(&node, r#"{"ttl_seconds": 1, "on_expire": "hibernate"}"#);
    sh(&node, &b, "echo kept > /root/kept");
    eventually("hibernated at expiry", || state(&node, &b) == "hibernated");
    std::thread::sleep(std::time::Duration::from_millis(1500));
    assert_eq!(state(&node, &b), "hibernated", "asleep, not destroyed");
    assert_eq!(sh(&node, &b, "cat /root/kept"), "kept");
    let (_, row) = node.req("GET", &format!("/v1/sandboxes/{}", b.id), Some(&b.token), None);
    assert_eq!(
        (row["state"].as_str(), row["on_expire"].as_str()),
        (Some("claimed"), Some("hibernate"))
    );
    assert!(row["deadline_ms"].as_u64().unwrap() > row["state_since_ms"].as_u64().unwrap());
}

#[test]
fn archive_after_hibernation_and_retention_delete_the_archive() {
    let node = Sandboxd::start(&format!(
        "archive_after_seconds = 1\narchive_retention_seconds = 2\n{ONE_WARM}"
    ));
    let b = claim(&node, "{}");
    assert_eq!(post(&node, &b, "hibernate", "").0, 200);
    eventually("archived after a second hibernated", || state(&node, &b) == "archived");
    eventually("released after retention", || {
        node.req("GET", &format!("/v1/sandboxes/{}", b.id), Some(&b.token), None).0 == 404
    });
    eventually("its archive deleted", || {
        std::fs::read_dir(node.data().join("store/archives")).map(|d| d.count()).unwrap_or(0) == 0
    });
}

#[test]
fn idle_sandboxes_hibernate_but_not_while_a_relay_connection_is_open() {
    let node = Sandboxd::start(
        "[[pools]]\ntemplate = \"host\"\nwarm = 1\nwarm_max = 1\nidle_hibernate_seconds = 1\n",
    );
    let b = claim(&node, "{}");
    sh(&node, &b, "echo idle > /root/f");
    let stream = upgrade(node.addr, &b.id, &b.token);
    std::thread::sleep(std::time::Duration::from_millis(2500));
    assert_eq!(state(&node, &b), "claimed", "an open relay connection keeps it awake");
    drop(stream);
    eventually("idle hibernation", || state(&node, &b) == "hibernated");
    assert_eq!(sh(&node, &b, "cat /root/f"), "idle");
}

#[test]
fn a_store_outage_fails_archive_and_checkpoint_and_keeps_the_sandbox() {
    // A store nobody listens on, with one try per request.
    let node = Sandboxd::start(&format!(
        "{ONE_WARM}[store.s3]\nbucket = \"b\"\nendpoint = \"http://127.0.0.1:9\"\npath_style = true\nmax_attempts = 1\nconnect_timeout_ms = 200\n"
    ));
    let b = claim(&node, "{}");
    sh(&node, &b, "echo safe > /root/f");
    let (status, v) = post(&node, &b, "checkpoint", "");
    assert_eq!((status, v["error"]["code"].as_str()), (503, Some("store_unavailable")), "{v}");
    assert_eq!(state(&node, &b), "claimed");
    let (status, v) = post(&node, &b, "archive", "");
    assert_eq!((status, v["error"]["code"].as_str()), (503, Some("store_unavailable")), "{v}");
    assert_eq!(state(&node, &b), "claimed", "running again after the failed archive");
    assert!(running(&node, &b));
    assert_eq!(sh(&node, &b, "cat /root/f"), "safe");
    assert_eq!(std::fs::read_dir(node.data().join("snapshots")).unwrap().count(), 0);
}

#[test]
fn a_checkpoint_or_archive_whose_capture_fails_half_way_stores_nothing_and_keeps_the_sandbox() {
    let node = Sandboxd::start(ONE_WARM);
    let b = claim(&node, "{}");
    // 8 MiB the store takes first, then a name the capture refuses (applied, a `.wh.` name
    // would be a deletion): uploads stream from the box, and must not keep the first part.
    let setup = "head -c 8388608 /dev/urandom > /root/a && mkdir /root/z && touch /root/z/.wh.x";
    sh(&node, &b, setup);
    let sum = sh(&node, &b, "sha256sum /root/a");
    let (status, v) = post(&node, &b, "checkpoint", "");
    assert_eq!((status, v["error"]["code"].as_str()), (400, Some("bad_request")), "{v}");
    let (_, list) = node.req("GET", "/v1/checkpoints", Some(ROOT), None);
    assert_eq!(list["checkpoints"].as_array().unwrap().len(), 0, "{list}");
    assert_eq!(sh(&node, &b, "sha256sum /root/a"), sum, "the source runs on");
    let (status, v) = post(&node, &b, "archive", "");
    assert_eq!((status, v["error"]["code"].as_str()), (400, Some("bad_request")), "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains(".wh.x"), "{v}");
    assert_eq!(state(&node, &b), "claimed", "running again after the failed archive");
    assert_eq!(sh(&node, &b, "sha256sum /root/a"), sum);
    let archives = node.data().join("store/archives");
    let stored = std::fs::read_dir(&archives).map(|d| d.count()).unwrap_or(0);
    assert_eq!(stored, 0, "a part of a snapshot was stored as an archive");
    // Renamed, it archives.
    sh(&node, &b, "mv /root/z/.wh.x /root/z/x");
    assert_eq!(post(&node, &b, "archive", "").0, 200);
    assert_eq!(sh(&node, &b, "sha256sum /root/a"), sum);
}

#[test]
fn lifecycle_calls_on_one_sandbox_are_serialised() {
    let node = Sandboxd::start(ONE_WARM);
    let b = claim(&node, "{}");
    sh(&node, &b, "head -c 8388608 /dev/urandom > /root/big");
    let sum = sh(&node, &b, "sha256sum /root/big");
    let (addr, id, token) = (node.addr, b.id.clone(), b.token.clone());
    let calls: Vec<_> = ["hibernate", "checkpoint", "wake", "fork", "hibernate", "checkpoint"]
        .into_iter()
        .map(|verb| {
            let (id, token) = (id.clone(), token.clone());
            let body = if verb == "fork" { r#"{"count": 1}"# } else { "" };
            std::thread::spawn(move || {
                try_http(addr, "POST", &format!("/v1/sandboxes/{id}/{verb}"), Some(&token), body)
                    .unwrap()
            })
        })
        .collect();
    for c in calls {
        let (status, v) = c.join().unwrap();
        assert!(status == 200 || status == 201, "{status} {v}");
    }
    assert_eq!(sh(&node, &b, "sha256sum /root/big"), sum);
}

/// A wake streams the archive from the store into the sandbox's files. One whose download stops
/// half way (a chunk gone from the store) makes no sandbox and leaves the claim archived; with
/// the chunk back, the same wake succeeds.
#[test]
fn a_wake_whose_download_stops_half_way_leaves_the_sandbox_archived() {
    let node = Sandboxd::start(ONE_WARM);
    let b = claim(&node, r#"{"ttl_seconds": 600}"#);
    sh(&node, &b, "head -c 12582912 /dev/urandom > /root/big");
    let sum = sh(&node, &b, "sha256sum /root/big");
    assert_eq!(post(&node, &b, "archive", "").0, 200);
    let jails = node.jails();

    // The archive's manifest names its chunks: take one from the middle away.
    let archives = node.data().join("store/archives");
    let manifest = std::fs::read_dir(&archives).unwrap().flatten().next().unwrap().path();
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(manifest).unwrap()).unwrap();
    let chunks = manifest["chunks"].as_array().unwrap();
    assert!(chunks.len() > 4, "{} chunks", chunks.len());
    let middle = chunks[chunks.len() / 2]["id"].as_str().unwrap();
    let chunk = node.data().join("store/chunks").join(middle);
    let aside = node.data().join("aside");
    std::fs::rename(&chunk, &aside).unwrap();

    let body = r#"{"argv": ["true"]}"#;
    let path = format!("/v1/sandboxes/{}/exec", b.id);
    let (status, v) = node.req("POST", &path, Some(&b.token), Some(body));
    assert!(status >= 500 && v["error"]["code"].is_string(), "the wake failed: {status} {v}");
    assert_eq!(state(&node, &b), "archived");
    assert_eq!(node.jails(), jails, "no box is left of the failed wake");
    assert_eq!(std::fs::read_dir(node.data().join("scratch")).unwrap().count(), 0);

    std::fs::rename(&aside, &chunk).unwrap();
    assert_eq!(sh(&node, &b, "sha256sum /root/big"), sum);
    assert_eq!(state(&node, &b), "claimed");
}
