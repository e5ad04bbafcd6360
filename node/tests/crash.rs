//! A node stopped at every crash point of its lifecycle operations, on the fake engine: the
//! call stops there for good, the runtime is dropped (every task ends at once, as with
//! `kill -9`), and a second node opens on the same data directory and engine. What the restart
//! finds must be a sandbox in one consistent state whose files are all there, that wakes.
//! (Moves and adoptions cross nodes: their crash points are in tests/moves.rs, two nodes on the
//! fake engine, and between real nodes in tests/mesh_moves.rs.)

mod fake;

const AUTO: silk_engine::Memory = silk_engine::Memory::Auto;

use std::sync::Arc;

use fake::*;
use sandboxd::node::Node;
use sandboxd::state::SandboxState;

type Op = fn(Arc<Node>, String) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>;

fn hibernate(
    node: Arc<Node>,
    id: String,
) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>> {
    Box::pin(async move {
        let _ = node.hibernate(&id, AUTO).await;
    })
}

fn archive(
    node: Arc<Node>,
    id: String,
) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>> {
    Box::pin(async move {
        let _ = node.archive(&id, AUTO).await;
    })
}

fn checkpoint(
    node: Arc<Node>,
    id: String,
) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>> {
    Box::pin(async move {
        let _ = node.checkpoint(&id, Some("mid-crash".into()), AUTO).await;
    })
}

fn wake(
    node: Arc<Node>,
    id: String,
) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>> {
    Box::pin(async move {
        let _ = node.wake(&id).await;
    })
}

/// Claims a sandbox with a file, optionally archives it first, stops `op` at `point`, restarts,
/// and checks the sandbox is `expect`, wakes, and kept its file.
fn crash(
    point: &str,
    archived_first: bool,
    op: Op,
    expect: SandboxState,
) -> (Harness, Arc<Node>, tokio::runtime::Runtime) {
    let h = Harness::new();
    let (rt, node) = h.open(h.config(0));
    let c = rt.block_on(node.claim(spec(600))).unwrap();
    let id = c.record.id.clone();
    h.engine.write_file(&sid(&id), "notes", b"kept").unwrap();
    if archived_first {
        rt.block_on(node.archive(&id, AUTO)).unwrap();
    }
    node.crash_at(point);
    rt.spawn(op(node.clone(), id.clone()));
    eventually(&format!("the call reaches {point}"), || node.stopped_at_crash_point());
    drop((node, rt));

    let (rt, node) = h.open(h.config(0));
    let record = node.get(&id).unwrap_or_else(|| panic!("{point}: the claim is gone")).record;
    assert_eq!(record.state(), expect, "after a crash at {point}");
    assert_eq!(record.intent, None, "{point}: an intent left unfinished: {record:?}");
    let live = rt.block_on(node.wake(&id)).unwrap_or_else(|e| panic!("{point}: wake: {e}"));
    assert_eq!(live.record.state(), SandboxState::Claimed);
    assert_eq!(h.engine.read_file(&sid(&id), "notes").as_deref(), Some(&b"kept"[..]), "{point}");
    assert!(node.authorized(&id, Some(&c.token)).is_ok(), "{point}: the token no longer works");
    (h, node, rt)
}

#[test]
fn a_crash_mid_hibernate_leaves_a_claimed_sandbox() {
    crash("hibernate:stopped", false, hibernate, SandboxState::Claimed);
}

#[test]
fn a_crash_mid_archive_rolls_back_before_the_upload_and_forward_after_it() {
    // Its first step hibernates the sandbox in place; the upload streams from its box.
    crash("hibernate:stopped", false, archive, SandboxState::Claimed);
    crash("archive:intent", false, archive, SandboxState::Hibernated);
    crash("archive:uploaded", false, archive, SandboxState::Archived);
}

#[test]
fn a_crash_mid_wake_from_an_archive_leaves_it_woken_and_the_archive_gone() {
    let (h, node, rt) = crash("wake:journalled", true, wake, SandboxState::Claimed);
    // Nothing is left in the store to wake a second copy from.
    let store = h.dir.path().join("data/store");
    let archives = walk(&store).into_iter().filter(|p| p.contains("archive")).collect::<Vec<_>>();
    assert!(archives.is_empty(), "{archives:?}");
    drop((node, rt));
}

#[test]
fn a_crash_mid_checkpoint_leaves_the_source_running_and_a_whole_checkpoint_or_none() {
    for point in ["checkpoint:captured", "checkpoint:uploaded"] {
        let (_h, node, rt) = crash(point, false, checkpoint, SandboxState::Claimed);
        for ck in rt.block_on(node.checkpoints(None, None)).unwrap() {
            // Whatever is listed branches whole.
            let branch = rt.block_on(node.branch(&ck.id, spec(60), AUTO)).unwrap();
            assert_eq!(branch.record.from_checkpoint.as_deref(), Some(ck.id.as_str()));
        }
    }
}

fn walk(dir: &std::path::Path) -> Vec<String> {
    let mut out = vec![];
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        if e.path().is_dir() {
            out.extend(walk(&e.path()));
        } else {
            out.push(e.path().display().to_string());
        }
    }
    out
}
