//! The claims journal as main wrote it when the journal got its own record types (format 2,
//! written by `Journal<ClaimRecord>` with engine types inside: `fixtures/journal-v2`, one batch
//! of eight claims in every state and intent, then a delete). This build (format 4: a claim
//! carries its tenant since format 3, its egress policy and previews since 4) reads it whole,
//! upgrades it step by step (its claims are root's, with no policy and no previews), encodes
//! each record as format 2 did plus those, rewrites the log in format 4, and a node starts on
//! it.

use std::path::Path;
use std::sync::Arc;

use sandboxd::claims::{Intent, OnExpire, Phase, Tier};
use sandboxd::journal::Journal;
use sandboxd::state::SandboxState;
use sandboxd::stored::{StoredClaim, live_records};
use silk_engine::{Lane, Size};

fn fixture() -> Vec<u8> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/journal-v2/journal.log");
    std::fs::read(path).unwrap()
}

#[test]
fn a_journal_in_the_format_on_main_is_read_whole_and_written_the_same() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("journal.log"), fixture()).unwrap();
    let (journal, stored) = Journal::<StoredClaim>::open(dir.path(), false).unwrap();
    drop(journal);
    // Each record's encoding by this build is the fixture's, byte for byte, and then the
    // tenant, the egress policy (none: postcard's 0s) and the previews (an empty list: 0).
    let bytes = fixture();
    for (id, record) in &stored {
        let encoded = postcard::to_allocvec(&(id, Some(record))).unwrap();
        let (v2, added) = encoded.split_at(encoded.len() - 3);
        assert!(bytes.windows(v2.len()).any(|w| w == v2), "{id} encodes differently");
        assert_eq!(added, [0, 0, 0]);
    }
    // The log is format 4 now, and reads back the same.
    let upgraded = std::fs::read(dir.path().join("journal.log")).unwrap();
    assert_eq!(upgraded[..12], *b"SLKJRNL\0\x04\0\0\0");
    let (journal, again) = Journal::<StoredClaim>::open(dir.path(), false).unwrap();
    drop(journal);
    assert_eq!(again, stored);
    let records = live_records(stored).unwrap();
    let ids: Vec<&str> = records.keys().map(String::as_str).collect();
    assert_eq!(ids.len(), 7, "the deleted claim stays deleted: {ids:?}");
    assert!(!ids.contains(&"sb-local-000000000008"));

    let running = &records["sb-local-000000000001"];
    assert_eq!(
        (running.state(), running.tier, running.size),
        (SandboxState::Claimed, Tier::Clone, Size::Medium)
    );
    assert_eq!((running.lane, running.on_expire), (Lane::None, OnExpire::Archive));
    assert_eq!(running.metadata["owner"], "fixture");
    assert_eq!((running.lease_seconds, running.idle_hibernate_seconds), (600, Some(30)));
    let forked = &records["sb-local-000000000005"];
    assert_eq!(forked.forked_from.as_deref(), Some("sb-local-000000000001"));
    assert_eq!(forked.from_checkpoint.as_deref(), Some("ck_0123456789abcdef0123456789abcdef"));
    assert_eq!(records["sb-local-000000000003"].phase.snapshot(), None);

    let moving = &records["sb-local-000000000002"];
    let snap = moving.phase.snapshot().unwrap();
    let golden = snap.base.golden.as_ref().unwrap();
    assert_eq!(golden.digest.as_str(), "cd".repeat(32));
    assert_eq!(snap.base.template.digest.as_str(), "ab".repeat(32));
    assert_eq!(snap.base.template.env, vec![("PATH".to_string(), "/usr/bin:/bin".to_string())]);
    assert_eq!(snap.base.template.cwd.as_deref(), Some("/root"));
    assert_eq!((snap.spec.size, snap.bytes), (Size::Medium, 4096));
    assert_eq!(
        moving.intent,
        Some(Intent::Move {
            name: "sb-local-000000000002.00112233445566ff".into(),
            target: "n2".into()
        })
    );
    let archived = &records["sb-local-000000000004"];
    assert_eq!(archived.state(), SandboxState::Archived);
    assert_eq!(archived.phase.archive(), Some("sb-local-000000000004.0123456789abcdef"));
    assert!(
        matches!(&archived.intent, Some(Intent::Unpublish(a)) if a == "sb-local-000000000004.0123456789abcdef")
    );
    assert!(
        matches!(&records["sb-local-000000000006"].intent, Some(Intent::Hibernate(s)) if s.layer_tar == snap.layer_tar)
    );
    assert!(
        matches!(&records["sb-local-000000000007"].intent, Some(Intent::Archive(a)) if a.ends_with("fedcba9876543210"))
    );
}

#[test]
fn a_node_starts_on_a_journal_in_the_format_on_main() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    std::fs::create_dir_all(data.join("journal")).unwrap();
    std::fs::write(data.join("journal/journal.log"), fixture()).unwrap();
    // Record 4 carries an `Unpublish` intent: this node ("local") died while waking it, so it
    // still holds that wake's lease in the store (and the store no longer publishes the claim).
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let store =
            silk_store::fs::FsStore::open(silk_store::fs::FsConfig::new(data.join("store")));
        let lease = "leases/sb-local-000000000004";
        let ttl = std::time::Duration::from_secs(3600);
        let held = silk_store::Lease::acquire(&store.await.unwrap(), lease, "local", ttl).await;
        assert!(held.unwrap().is_some());
    });
    let cfg = sandboxd::config::Config { data_dir: data, min_free_mib: 0, ..Default::default() };
    let engine = Arc::new(silk_engine::fake::FakeEngine::new(dir.path().join("fake")));
    let node = rt.block_on(sandboxd::node::Node::open(cfg, engine)).unwrap();
    // Claims whose files this (empty) engine does not hold end; the archived one, whose files
    // are in the store, stays as it was.
    let kept: Vec<_> = node.list(&[]).into_iter().map(|r| (r.id, r.phase)).collect();
    assert_eq!(
        kept,
        vec![(
            "sb-local-000000000004".to_string(),
            Phase::Archived("sb-local-000000000004.0123456789abcdef".to_string())
        )]
    );
}

#[test]
fn claims_published_by_the_build_on_main_are_read_and_written_the_same() {
    // `claims-v2.json`: the records above as that build wrote them in JSON (a published claim
    // in the store, a record a move hands to a peer).
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/claims-v2.json");
    let old: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    assert_eq!(old.len(), 7);
    for (id, json) in old {
        let record: sandboxd::claims::ClaimRecord =
            serde_json::from_value(json.clone()).unwrap_or_else(|e| panic!("{id}: {e}"));
        assert_eq!(record.tenant, None, "{id}: a claim from before tenants is root's");
        // Written as before, plus `"tenant": null`, `"egress": null` and `"previews": []`
        // (which a build from before ignores).
        let mut written = serde_json::to_value(&record).unwrap();
        let added = written.as_object_mut().unwrap();
        assert_eq!(added.remove("tenant"), Some(serde_json::Value::Null));
        assert_eq!(added.remove("egress"), Some(serde_json::Value::Null));
        assert_eq!(added.remove("previews"), Some(serde_json::json!([])));
        assert_eq!(written, json, "{id} is written differently");
    }
    // A record whose fields make no phase is refused, not misread.
    let mut bad: serde_json::Value = serde_json::from_slice(
        &std::fs::read(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/claims-v2.json"))
            .unwrap(),
    )
    .unwrap();
    let mut archived = bad["sb-local-000000000004"].take();
    archived["archive"] = serde_json::Value::Null;
    let refused = serde_json::from_value::<sandboxd::claims::ClaimRecord>(archived);
    assert!(refused.unwrap_err().to_string().contains("no phase"));
}
