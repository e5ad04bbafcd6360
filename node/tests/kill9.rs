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
    let snapshots: Vec<_> =
        std::fs::read_dir(node.data().join("snapshots")).unwrap().flatten().collect();
    assert_eq!(snapshots.len(), usize::from(expect == "hibernated"), "{point}: {snapshots:?}");
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
    // Its first step captures the files into a tar and removes the box.
    crash_at("capture:intent", "archive", "claimed");
    crash_at("capture:captured", "archive", "hibernated");
    crash_at("archive:intent", "archive", "hibernated");
    crash_at("archive:uploaded", "archive", "archived");
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
