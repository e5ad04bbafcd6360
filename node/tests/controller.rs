//! The node's controller on the fake engine: no root, namespaces, silkd or sockets. Each test
//! runs its node on a runtime of its own; dropping that runtime stops every task at once, as
//! `kill -9` stops the process, and a second node opened on the same data directory and engine
//! is what the next start finds.

mod fake;

const AUTO: silk_engine::Memory = silk_engine::Memory::Auto;

use fake::*;
use sandboxd::claims::Tier;
use sandboxd::state::SandboxState;
use silk_engine::fake::Op;
use silk_engine::{Engine, Lane, Size};

#[test]
fn claims_are_served_warm_then_by_clone_then_cold() {
    let h = Harness::new();
    let (rt, node) = h.open(h.config(0));
    // No golden yet: the first claim boots from the template, and builds the golden after.
    let first = rt.block_on(node.claim(spec(60))).unwrap();
    assert_eq!(first.record.tier, Tier::Cold);
    eventually("the golden is built", || h.engine.calls(Op::Prepare) > 0);
    eventually("the second claim clones", || {
        let c = rt.block_on(node.claim(spec(60))).unwrap();
        c.record.tier == Tier::Clone
    });
    drop((node, rt));

    let h = Harness::new();
    let (rt, node) = h.open(h.config(1));
    eventually("the pool has a warm sandbox", || node.warm_for(&host_pool()) == 1);
    let warm = rt.block_on(node.claim(spec(60))).unwrap();
    assert_eq!(warm.record.tier, Tier::Warm);
    assert!(h.engine.running(&sid(&warm.record.id)));
    assert_eq!(node.get(&warm.record.id).unwrap().record.state(), SandboxState::Claimed);
}

#[test]
fn a_full_node_and_a_draining_node_refuse_claims_and_keep_what_they_hold() {
    let h = Harness::new();
    let mut cfg = h.config(0);
    cfg.max_claims = 2;
    let (rt, node) = h.open(cfg);
    let a = rt.block_on(node.claim(spec(60))).unwrap();
    rt.block_on(node.claim(spec(60))).unwrap();
    let full = rt.block_on(node.claim(spec(60))).unwrap_err();
    assert_eq!(full.code, "node_full");
    rt.block_on(node.release(&a.record.id)).unwrap();
    node.set_draining(true);
    let draining = rt.block_on(node.claim(spec(60))).unwrap_err();
    assert_eq!(draining.code, "draining");
    assert_eq!(node.list(&[]).len(), 1);
    node.set_draining(false);
    rt.block_on(node.claim(spec(60))).unwrap();
}

#[test]
fn an_expired_lease_ends_its_sandbox_and_a_renewed_one_does_not() {
    let h = Harness::new();
    let (rt, node) = h.open(h.config(0));
    let short = rt.block_on(node.claim(spec(1))).unwrap();
    let renewed = rt.block_on(node.claim(spec(1))).unwrap();
    rt.block_on(node.renew(&renewed.record.id, 600)).unwrap();
    eventually("the short lease ends", || node.get(&short.record.id).is_none());
    eventually("its sandbox is destroyed", || !h.engine.running(&sid(&short.record.id)));
    assert!(node.get(&renewed.record.id).is_some());
    assert!(h.engine.running(&sid(&renewed.record.id)));
    let gone = rt.block_on(node.renew(&short.record.id, 600)).unwrap_err();
    assert_eq!(gone.code, "not_found");
}

#[test]
fn hibernate_wake_archive_and_wake_keep_the_sandboxs_files() {
    let h = Harness::new();
    let (rt, node) = h.open(h.config(0));
    let c = rt.block_on(node.claim(spec(600))).unwrap();
    let (id, box_id) = (c.record.id.clone(), sid(&c.record.id));
    h.engine.write_file(&box_id, "work/notes", b"kept").unwrap();

    let rec = rt.block_on(node.hibernate(&id, AUTO)).unwrap();
    assert_eq!(rec.state(), SandboxState::Hibernated);
    assert!(!h.engine.running(&box_id), "a hibernated sandbox runs nothing");
    // Hibernating again is no change; waking brings it back on its files.
    assert_eq!(rt.block_on(node.hibernate(&id, AUTO)).unwrap().state(), SandboxState::Hibernated);
    let live = rt.block_on(node.wake(&id)).unwrap();
    assert_eq!(live.record.state(), SandboxState::Claimed);
    assert_eq!(h.engine.read_file(&box_id, "work/notes").as_deref(), Some(&b"kept"[..]));

    let rec = rt.block_on(node.archive(&id, AUTO)).unwrap();
    assert_eq!(rec.state(), SandboxState::Archived);
    assert!(h.engine.list().unwrap().is_empty(), "an archived sandbox holds no box");
    let refused = rt.block_on(node.hibernate(&id, AUTO)).unwrap_err();
    assert_eq!(refused.code, "conflict");
    let live = rt.block_on(node.wake(&id)).unwrap();
    assert_eq!(live.record.state(), SandboxState::Claimed);
    assert_eq!(h.engine.read_file(&box_id, "work/notes").as_deref(), Some(&b"kept"[..]));

    rt.block_on(node.release(&id)).unwrap();
    eventually("the box is destroyed", || h.engine.list().unwrap().is_empty());
    let gone = rt.block_on(node.wake(&id)).unwrap_err();
    assert_eq!(gone.code, "not_found");
}

#[test]
fn checkpoints_branch_and_forks_copy_files_and_promote_makes_a_template() {
    let h = Harness::new();
    let (rt, node) = h.open(h.config(0));
    let c = rt.block_on(node.claim(spec(600))).unwrap();
    let id = c.record.id.clone();
    h.engine.write_file(&sid(&id), "v", b"1").unwrap();
    let ck = rt.block_on(node.checkpoint(&id, Some("one".into()), AUTO)).unwrap();
    h.engine.write_file(&sid(&id), "v", b"2").unwrap();

    let branch = rt.block_on(node.branch(&ck.id, spec(600), AUTO)).unwrap();
    assert_eq!(h.engine.read_file(&sid(&branch.record.id), "v").as_deref(), Some(&b"1"[..]));
    assert_eq!(branch.record.from_checkpoint.as_deref(), Some(ck.id.as_str()));
    let forks = rt.block_on(node.fork(&id, 2, None, AUTO)).unwrap();
    assert_eq!(forks.len(), 2);
    for f in &forks {
        assert_eq!(h.engine.read_file(&sid(&f.record.id), "v").as_deref(), Some(&b"2"[..]));
        assert_eq!(f.record.forked_from.as_deref(), Some(id.as_str()));
    }
    let bad = rt.block_on(node.fork(&id, 0, None, AUTO)).unwrap_err();
    assert_eq!(bad.code, "bad_request");

    rt.block_on(node.promote(&id, "mine", true)).unwrap();
    let mut from_promoted = spec(600);
    from_promoted.template = "mine".into();
    let child = rt.block_on(node.claim(from_promoted)).unwrap();
    assert_eq!(h.engine.read_file(&sid(&child.record.id), "v").as_deref(), Some(&b"2"[..]));
    let mut unknown = spec(600);
    unknown.template = "nope".into();
    let err = rt.block_on(node.claim(unknown)).unwrap_err();
    assert_eq!(err.code, "template_not_found");
}

#[test]
fn a_restart_finds_every_acknowledged_claim_and_removes_every_other_box() {
    let h = Harness::new();
    let (rt, node) = h.open(h.config(1));
    let running = rt.block_on(node.claim(spec(600))).unwrap();
    let sleeping = rt.block_on(node.claim(spec(600))).unwrap();
    let archived = rt.block_on(node.claim(spec(600))).unwrap();
    h.engine.write_file(&sid(&archived.record.id), "f", b"x").unwrap();
    rt.block_on(node.hibernate(&sleeping.record.id, AUTO)).unwrap();
    rt.block_on(node.archive(&archived.record.id, AUTO)).unwrap();
    eventually("the pool has a warm sandbox", || node.warm_for(&host_pool()) == 1);
    // A box nobody acknowledged (a claim the crash interrupted).
    let stray = sid("sb-stray");
    let t = h.engine.template(&silk_engine::TemplateDef::host()).unwrap();
    h.engine.boot(&t, &stray, &silk_engine::BoxSpec::new(Size::Small, Lane::None)).unwrap();
    drop((node, rt)); // every task stops where it is

    let (rt, node) = h.open(h.config(0));
    let state = |id: &str| node.get(id).map(|l| l.record.state());
    assert_eq!(state(&running.record.id), Some(SandboxState::Claimed));
    assert_eq!(state(&sleeping.record.id), Some(SandboxState::Hibernated));
    assert_eq!(state(&archived.record.id), Some(SandboxState::Archived));
    let boxes: Vec<String> =
        h.engine.list().unwrap().into_iter().map(|b| b.id.to_string()).collect();
    assert_eq!(boxes.len(), 2, "the claimed and the hibernated box stay: {boxes:?}");
    assert!(!boxes.contains(&stray.to_string()));
    // The old tokens still work, and the archive still wakes with its files.
    assert!(node.authorized(&running.record.id, Some(&running.token)).is_ok());
    rt.block_on(node.wake(&archived.record.id)).unwrap();
    assert_eq!(h.engine.read_file(&sid(&archived.record.id), "f").as_deref(), Some(&b"x"[..]));
}

#[test]
fn a_pool_whose_engine_fails_retries_and_fills_once_it_works() {
    let h = Harness::new();
    h.engine.fail(Op::Clone, 3);
    h.engine.fail(Op::Boot, 3);
    let (_rt, node) = h.open(h.config(2));
    eventually("the pool fills", || node.warm_for(&host_pool()) == 2);
    assert!(h.engine.calls(Op::Clone) + h.engine.calls(Op::Boot) >= 5);
}

#[test]
fn a_failed_start_leaves_no_claim_and_no_slot() {
    let h = Harness::new();
    let mut cfg = h.config(0);
    cfg.max_claims = 1;
    let (rt, node) = h.open(cfg);
    h.engine.fail(Op::Boot, 1);
    let err = rt.block_on(node.claim(spec(60))).unwrap_err();
    assert_eq!(err.code, "engine_failed");
    // The failed claim's admission is returned: the one slot is free.
    let c = rt.block_on(node.claim(spec(60))).unwrap();
    assert!(node.get(&c.record.id).is_some());
}

#[test]
fn every_table_returns_to_its_size_after_ten_thousand_claims_and_releases() {
    let h = Harness::new();
    let (rt, node) = h.open(h.config(0));
    let before = node.table_sizes();
    rt.block_on(async {
        for i in 0..10_000 {
            let c = node.claim(spec(600)).await.unwrap();
            if i % 100 == 0 {
                node.hibernate(&c.record.id, AUTO).await.unwrap();
                node.wake(&c.record.id).await.unwrap();
            }
            node.release(&c.record.id).await.unwrap();
            // Calls for ids that do not exist leave nothing behind either.
            assert_eq!(node.wake("sb-unknown").await.unwrap_err().code, "not_found");
            assert_eq!(node.hibernate(&c.record.id, AUTO).await.unwrap_err().code, "not_found");
        }
    });
    assert_eq!(node.table_sizes(), before);
    eventually("every box is destroyed", || h.engine.list().unwrap().is_empty());
}

#[test]
fn a_claim_goes_to_a_peer_only_when_this_node_cannot_hand_out_a_warm_sandbox() {
    let h = Harness::new();
    let mut cfg = h.config(1);
    cfg.max_claims = 2;
    let (rt, node) = h.open(cfg);
    eventually("the pool has a warm sandbox", || node.warm_for(&host_pool()) == 1);
    // Refills fail from here, so none is ready when the second claim comes.
    h.engine.fail(Op::Clone, usize::MAX);
    // A warm sandbox here is taken here, whatever a peer has.
    let here = rt.block_on(node.claim_or_place(spec(60), true)).unwrap();
    assert_eq!(here.map(|c| c.record.tier), Some(Tier::Warm));
    // None ready here: the peer's, and nothing is admitted or started for it here.
    let (boots, running) = (h.engine.calls(Op::Boot), h.engine.list().unwrap().len());
    let placed = rt.block_on(node.claim_or_place(spec(60), true)).unwrap();
    assert!(placed.is_none());
    assert_eq!(node.table_sizes()["pending"], 0);
    assert_eq!(h.engine.calls(Op::Boot), boots);
    assert_eq!(h.engine.list().unwrap().len(), running);
    h.engine.fail(Op::Clone, 0);
    // No peer has one: made here.
    let made = rt.block_on(node.claim_or_place(spec(60), false)).unwrap().unwrap();
    assert_ne!(made.record.tier, Tier::Warm);
    // Full or draining: the peer's when there is one, else the refusal.
    // (`warm_for` says what a peer may count on: nothing while full.)
    eventually("the pool refills", || node.info().pools[0].warm == 1);
    assert!(rt.block_on(node.claim_or_place(spec(60), true)).unwrap().is_none(), "full");
    assert_eq!(rt.block_on(node.claim_or_place(spec(60), false)).unwrap_err().code, "node_full");
    rt.block_on(node.release(&made.record.id)).unwrap();
    node.set_draining(true);
    assert!(rt.block_on(node.claim_or_place(spec(60), true)).unwrap().is_none(), "draining");
    assert_eq!(rt.block_on(node.claim_or_place(spec(60), false)).unwrap_err().code, "draining");
}

#[test]
fn every_lifecycle_call_refuses_what_it_cannot_do_and_changes_nothing() {
    let h = Harness::new();
    let (rt, node) = h.open(h.config(0));
    let a = rt.block_on(node.claim(spec(600))).unwrap();
    let b = rt.block_on(node.claim(spec(600))).unwrap();
    let (a, b) = (a.record.id, b.record.id);
    rt.block_on(node.archive(&b, AUTO)).unwrap();
    let code = |r: Result<(), sandboxd::error::NodeError>| r.err().map(|e| e.code.as_str());
    let cases: Vec<(&str, Option<&str>, Option<&str>)> = vec![
        // An archived sandbox: woken first for anything that needs its files here.
        (
            "fork an archive",
            code(rt.block_on(node.fork(&b, 1, None, AUTO)).map(drop)),
            Some("conflict"),
        ),
        (
            "hibernate an archive",
            code(rt.block_on(node.hibernate(&b, AUTO)).map(drop)),
            Some("conflict"),
        ),
        // Archiving an archive is no change, as hibernating a hibernated one is.
        ("archive an archive", code(rt.block_on(node.archive(&b, AUTO)).map(drop)), None),
        (
            "checkpoint an archive",
            code(rt.block_on(node.checkpoint(&b, None, AUTO)).map(drop)),
            Some("conflict"),
        ),
        // Bad arguments.
        ("fork 0", code(rt.block_on(node.fork(&a, 0, None, AUTO)).map(drop)), Some("bad_request")),
        (
            "fork 17",
            code(rt.block_on(node.fork(&a, 17, None, AUTO)).map(drop)),
            Some("bad_request"),
        ),
        (
            "an empty checkpoint name",
            code(rt.block_on(node.checkpoint(&a, Some(String::new()), AUTO)).map(drop)),
            Some("bad_request"),
        ),
        (
            "promote as Bad/Name",
            code(rt.block_on(node.promote(&a, "Bad/Name", true)).map(drop)),
            Some("bad_request"),
        ),
        (
            "promote over the host template",
            code(rt.block_on(node.promote(&a, "host", true)).map(drop)),
            Some("conflict"),
        ),
        (
            "branch an unknown checkpoint",
            code(
                rt.block_on(node.branch("ck_00000000000000000000000000000000", spec(60), AUTO))
                    .map(drop),
            ),
            Some("not_found"),
        ),
        (
            "branch a bad id",
            code(rt.block_on(node.branch("nope", spec(60), AUTO)).map(drop)),
            Some("not_found"),
        ),
        ("delete the host template", code(node.delete_template("host")), Some("conflict")),
        (
            "delete an unknown template",
            code(node.delete_template("nope")),
            Some("template_not_found"),
        ),
        (
            "move without a mesh",
            code(rt.block_on(node.move_sandbox(&a, None, AUTO)).map(drop)),
            Some("conflict"),
        ),
        // Unknown sandboxes, for every call.
        ("release unknown", code(rt.block_on(node.release("sb-x"))), Some("not_found")),
        ("renew unknown", code(rt.block_on(node.renew("sb-x", 60)).map(drop)), Some("not_found")),
        (
            "archive unknown",
            code(rt.block_on(node.archive("sb-x", AUTO)).map(drop)),
            Some("not_found"),
        ),
        (
            "fork unknown",
            code(rt.block_on(node.fork("sb-x", 1, None, AUTO)).map(drop)),
            Some("not_found"),
        ),
        (
            "promote unknown",
            code(rt.block_on(node.promote("sb-x", "t", true)).map(drop)),
            Some("not_found"),
        ),
    ];
    for (what, got, want) in cases {
        assert_eq!(got, want, "{what}");
    }
    // Nothing changed: the claimed one runs, the archived one is still archived, no other box.
    assert_eq!(node.get(&a).unwrap().record.state(), SandboxState::Claimed);
    assert_eq!(node.get(&b).unwrap().record.state(), SandboxState::Archived);
    assert_eq!(h.engine.list().unwrap().len(), 1);
    assert_eq!(node.list(&[]).len(), 2);
    assert_eq!(node.table_sizes()["pending"], 0);
}

/// A listing remembers the manifests it read (a checkpoint's never changes), yet shows what the
/// store holds now: one deleted by another node (straight from the shared store) or through
/// this one is gone from the next listing, and a new one is in it.
#[test]
fn a_checkpoint_listing_shows_what_the_store_holds_now() {
    let h = Harness::new();
    let (rt, node) = h.open(h.config(0));
    let c = rt.block_on(node.claim(spec(600))).unwrap();
    let ids = || -> Vec<String> {
        let list = rt.block_on(node.checkpoints(None, None)).unwrap();
        list.into_iter().map(|i| i.checkpoint.id).collect()
    };
    let a = rt.block_on(node.checkpoint(&c.record.id, Some("a".into()), AUTO)).unwrap();
    assert_eq!(ids(), std::slice::from_ref(&a.id));
    std::thread::sleep(std::time::Duration::from_millis(5)); // a later created_ms
    let b = rt.block_on(node.checkpoint(&c.record.id, Some("b".into()), AUTO)).unwrap();
    assert_eq!(ids(), [a.id.clone(), b.id.clone()]);

    // Another node deletes `a` from the shared store.
    fn manifests(dir: &std::path::Path, hex: &str, found: &mut Vec<std::path::PathBuf>) {
        for e in std::fs::read_dir(dir).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                manifests(&p, hex, found);
            } else if p.to_string_lossy().contains(hex) && !p.to_string_lossy().contains("chunks") {
                found.push(p);
            }
        }
    }
    let mut found = vec![];
    manifests(&h.dir.path().join("data/store"), &a.id["ck_".len()..], &mut found);
    assert_eq!(found.len(), 1, "{found:?}");
    std::fs::remove_file(&found[0]).unwrap();
    assert_eq!(ids(), std::slice::from_ref(&b.id));

    rt.block_on(node.delete_checkpoint(&b.id)).unwrap();
    assert!(ids().is_empty());
}
