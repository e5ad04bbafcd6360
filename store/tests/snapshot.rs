//! The snapshot store on the `fs` backend (through the fault wrapper where counting or faults
//! matter): dedup at scale, corruption, missing manifests, garbage collection with time as an
//! input, a crash mid-upload, and the chunk cache.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use silk_store::fault::{FaultStore, Op};
use silk_store::*;

const MIB: u64 = 1024 * 1024;

/// A snapshot store with production chunk sizes over a counting fault wrapper.
fn production(store: Arc<dyn ObjectStore>) -> SnapshotStore {
    SnapshotStore::new(store, SnapshotConfig::default(), None).unwrap()
}

fn fault_over(b: &common::Backend) -> Arc<FaultStore> {
    Arc::new(FaultStore::new(b.store()))
}

fn none() -> BTreeMap<String, String> {
    BTreeMap::new()
}

/// Two snapshots of a 200 MiB tree (100 files of 2 MiB) that differ in one file: the second
/// uploads about that file's worth of chunks, counted both by the snapshot store and by the
/// object store underneath.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_snapshot_uploads_about_one_changed_file() {
    let backend = common::fs_unsynced().await;
    let fault = fault_over(&backend);
    let snaps = production(fault.clone());
    const FILE: usize = 2 * 1024 * 1024;
    let seeds: Vec<u64> = (0..100).collect();
    let before = common::tree(&seeds, FILE);
    assert!(before.len() as u64 >= 200 * MIB);

    let first = SnapshotName::checkpoint("tree-1").unwrap();
    let r1 = snaps.put(&first, &before[..], none()).await.unwrap();
    assert_eq!(r1.uploaded_bytes, before.len() as u64, "a first snapshot uploads everything");
    // Production chunking: about 1 MiB on average.
    let avg = r1.size / r1.chunks as u64;
    assert!((512 * 1024..=2 * MIB).contains(&avg), "average chunk {avg} bytes");

    let mut changed = seeds.clone();
    changed[50] = 1000; // file 50 gets new contents of the same size
    let after = common::tree(&changed, FILE);
    drop(before);
    let put_before = fault.counts().put_bytes;
    let second = SnapshotName::checkpoint("tree-2").unwrap();
    let r2 = snaps.put(&second, &after[..], none()).await.unwrap();

    // The changed file, plus at most the two chunks straddling its edges (4 MiB max each).
    let max_chunk = u64::from(ChunkParams::default().max);
    assert!(
        (FILE as u64..=FILE as u64 + 2 * max_chunk).contains(&r2.uploaded_bytes),
        "the second snapshot uploaded {} bytes for one changed 2 MiB file: {r2:?}",
        r2.uploaded_bytes
    );
    let manifest_bytes = snaps.object_store().head(&second.key()).await.unwrap().size;
    assert_eq!(fault.counts().put_bytes - put_before, r2.uploaded_bytes + manifest_bytes);

    let mut out = Vec::with_capacity(after.len());
    snaps.get(&second, &mut out).await.unwrap();
    assert!(out == after, "the second snapshot came back different");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_chunk_is_an_error_naming_it_and_no_bad_byte_is_returned() {
    let backend = common::fs().await;
    let snaps = common::snapshots(backend.store());
    let data = common::noise(5, 3 << 20);
    let name = SnapshotName::checkpoint("c").unwrap();
    snaps.put(&name, &data[..], none()).await.unwrap();
    let manifest = snaps.manifest(&name).await.unwrap();
    let victim = manifest.chunks[3];
    let offset: usize = manifest.chunks[..3].iter().map(|c| c.size as usize).sum();

    // Same size, other bytes: only the hash can tell.
    let store = backend.store();
    let mut bad = store.get_bytes(&victim.id.key()).await.unwrap().to_vec();
    bad[100] ^= 0x55;
    store.put_bytes(&victim.id.key(), bad.into()).await.unwrap();
    let mut out = Vec::new();
    match snaps.get(&name, &mut out).await {
        Err(StoreError::Corrupt { chunk, reason }) => {
            assert_eq!(chunk, victim.id);
            assert!(reason.contains("hash"), "{reason}");
        }
        other => panic!("expected Corrupt, got {other:?}"),
    }
    assert!(out == data[..offset], "only the verified chunks before the bad one were written");

    // A chunk that is gone is named too.
    store.delete(&[victim.id.key()]).await.unwrap();
    let err = snaps.get(&name, &mut Vec::new()).await.unwrap_err();
    assert!(matches!(err, StoreError::Corrupt { chunk, .. } if chunk == victim.id), "{err}");
    assert!(!err.is_retryable());
}

#[tokio::test]
async fn a_missing_manifest_is_not_found() {
    let backend = common::fs().await;
    let snaps = common::snapshots(backend.store());
    let name = SnapshotName::golden("pool-a", "deadbeef").unwrap();
    assert!(matches!(snaps.manifest(&name).await, Err(StoreError::NotFound { .. })));
    let err = snaps.get(&name, &mut Vec::new()).await.unwrap_err();
    assert!(err.is_not_found(), "{err}");
    // A manifest that is not one is reported as such.
    backend.store.put_bytes(&name.key(), Bytes::from_static(b"not json")).await.unwrap();
    assert!(matches!(snaps.manifest(&name).await, Err(StoreError::CorruptManifest { .. })));
}

/// GC with time as an input: nothing younger than the grace period goes, nothing a manifest
/// names ever goes, everything else does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gc_keeps_referenced_and_young_chunks_and_reclaims_the_rest() {
    let backend = common::fs().await;
    let snaps = common::snapshots(backend.store()); // grace 1 h
    let store = backend.store();
    let shared = common::noise(61, 1 << 20);
    let a_data = [shared.clone(), common::noise(62, 1 << 20)].concat();
    let b_data = [shared, common::noise(63, 1 << 20)].concat();
    let (a, b) = (SnapshotName::checkpoint("a").unwrap(), SnapshotName::archive("b").unwrap());
    snaps.put(&a, &a_data[..], none()).await.unwrap();
    snaps.put(&b, &b_data[..], none()).await.unwrap();
    let ids =
        |m: &Manifest| m.chunks.iter().map(|c| c.id).collect::<std::collections::HashSet<_>>();
    let (a_ids, b_ids) =
        (ids(&snaps.manifest(&a).await.unwrap()), ids(&snaps.manifest(&b).await.unwrap()));
    let b_only: Vec<ChunkId> = b_ids.difference(&a_ids).copied().collect();
    assert!(!b_only.is_empty() && a_ids.intersection(&b_ids).count() > 0);

    snaps.delete(&b).await.unwrap();
    let now = SystemTime::now();
    // Now: b's chunks are unreferenced but young.
    let r = snaps.gc(now).await.unwrap();
    assert_eq!((r.deleted, r.young, r.manifests), (0, b_only.len(), 1), "{r:?}");
    // Just inside the grace period: still young.
    let r = snaps.gc(now + Duration::from_secs(3500)).await.unwrap();
    assert_eq!(r.deleted, 0, "{r:?}");
    // Past it: exactly b's own chunks go; a's (shared ones included) stay however old.
    let r = snaps.gc(now + Duration::from_secs(7200)).await.unwrap();
    assert_eq!(r.deleted, b_only.len(), "{r:?}");
    assert_eq!(r.referenced, a_ids.len());
    for id in &b_only {
        assert!(store.head(&id.key()).await.unwrap_err().is_not_found());
    }
    let mut out = Vec::new();
    snaps.get(&a, &mut out).await.unwrap();
    assert!(out == a_data);
    let r = snaps.gc(now + Duration::from_secs(30 * 24 * 3600)).await.unwrap();
    assert_eq!(r.deleted, 0, "a month on, referenced chunks still stay: {r:?}");
}

#[tokio::test]
async fn gc_stops_rather_than_guess_when_a_manifest_is_unreadable() {
    let backend = common::fs().await;
    let snaps = common::snapshots(backend.store());
    snaps
        .put(&SnapshotName::checkpoint("x").unwrap(), &common::noise(7, 200_000)[..], none())
        .await
        .unwrap();
    let orphan = Key::new(format!("{CHUNK_PREFIX}{}", ChunkId::of(b"orphan"))).unwrap();
    backend.store.put_bytes(&orphan, Bytes::from_static(b"orphan")).await.unwrap();
    let broken = SnapshotName::template("broken").unwrap().key();
    backend.store.put_bytes(&broken, Bytes::from_static(b"{")).await.unwrap();
    let later = SystemTime::now() + Duration::from_secs(7200);
    assert!(matches!(snaps.gc(later).await, Err(StoreError::CorruptManifest { .. })));
    backend.store.head(&orphan).await.unwrap(); // nothing was deleted
    backend.store.delete(&[broken]).await.unwrap();
    assert_eq!(snaps.gc(later).await.unwrap().deleted, 1);
}

/// An upload that dies before its manifest (a failed commit, or the process gone mid-stream)
/// leaves nothing visible; GC reclaims its chunks once they are past the grace period. On one
/// thread, so no upload task can still be finishing a poll after the put is dropped.
#[tokio::test]
async fn a_crash_mid_upload_leaves_no_manifest_and_gc_reclaims_the_orphans() {
    let backend = common::fs().await;
    let fault = fault_over(&backend);
    let snaps = common::snapshots(fault.clone());
    let now = SystemTime::now();

    // 1. Every chunk lands, the manifest write fails.
    fault.fail_keys("^checkpoints/", Some(Op::Put));
    let name = SnapshotName::checkpoint("failed").unwrap();
    let err = snaps.put(&name, &common::noise(8, 2 << 20)[..], none()).await.unwrap_err();
    assert!(err.is_retryable(), "{err}");
    fault.clear();
    assert!(snaps.manifest(&name).await.unwrap_err().is_not_found());
    assert!(snaps.list("checkpoints/").await.unwrap().is_empty());
    let orphans = backend.store.list_all(CHUNK_PREFIX).await.unwrap().len();
    assert!(orphans > 8);

    // 2. The upload is dropped mid-stream (the node died): the stream never ends, and the future
    //    is dropped once a few chunks are in.
    let head = common::noise(9, 3 << 20);
    let endless = tokio::io::AsyncReadExt::chain(&head[..], Endless);
    let puts = fault.counts().puts;
    let dying = SnapshotName::checkpoint("dying").unwrap();
    tokio::select! {
        r = snaps.put(&dying, endless, none()) => panic!("an endless stream finished: {r:?}"),
        _ = fault.wait_for(|c| c.puts >= puts + 3) => {}
    }
    assert!(snaps.manifest(&dying).await.unwrap_err().is_not_found());
    let orphans = backend.store.list_all(CHUNK_PREFIX).await.unwrap().len();

    // Young orphans stay (an upload may still be running); old ones go.
    assert_eq!(snaps.gc(now).await.unwrap().deleted, 0);
    let r = snaps.gc(now + Duration::from_secs(3601)).await.unwrap();
    assert_eq!(r.deleted, orphans, "{r:?}");
    assert!(backend.store.list_all(CHUNK_PREFIX).await.unwrap().is_empty());
}

/// A reader that never yields another byte, like a sandbox whose tar stream stalled.
struct Endless;

impl tokio::io::AsyncRead for Endless {
    fn poll_read(
        self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
        _: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::task::Poll::Pending
    }
}

/// Two concurrent gets of one snapshot through the cache download each chunk once; a third is
/// served from the cache entirely.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cache_merges_concurrent_fetches_of_one_snapshot() {
    let backend = common::fs().await;
    let fault = fault_over(&backend);
    let dir = tempfile::tempdir().unwrap();
    let cache =
        ChunkCache::open(CacheConfig { dir: dir.path().to_path_buf(), max_bytes: 64 * MIB })
            .await
            .unwrap();
    let cfg = SnapshotConfig { chunking: common::small_chunks(), ..SnapshotConfig::default() };
    let snaps = SnapshotStore::new(fault.clone(), cfg, Some(cache)).unwrap();
    let data = common::noise(10, 4 << 20);
    let name = SnapshotName::golden("pool", "d1").unwrap();
    let report = snaps.put(&name, &data[..], none()).await.unwrap();

    let gets = fault.counts().gets;
    let (mut one, mut two) = (Vec::new(), Vec::new());
    let (r1, r2) = tokio::join!(snaps.get(&name, &mut one), snaps.get(&name, &mut two));
    r1.unwrap();
    r2.unwrap();
    assert!(one == data && two == data);
    // Two manifest reads, one download per chunk.
    assert_eq!(fault.counts().gets - gets, 2 + report.unique_chunks as u64);
    let stats = snaps.cache().unwrap().stats();
    assert_eq!(stats.fetches, report.unique_chunks as u64, "{stats:?}");

    let gets = fault.counts().gets;
    let mut three = Vec::new();
    snaps.get(&name, &mut three).await.unwrap();
    assert!(three == data);
    assert_eq!(fault.counts().gets - gets, 1, "only the manifest is read again");
}

/// A store that fails for a while: the snapshot store reports the outage (retryable) and never
/// writes a manifest for a snapshot whose chunks did not all land.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage_during_upload_fails_the_put_cleanly() {
    let backend = common::fs().await;
    let fault = fault_over(&backend);
    let snaps = common::snapshots(fault.clone());
    fault.fail_keys("^chunks/", Some(Op::Put));
    let name = SnapshotName::checkpoint("outage").unwrap();
    let err = snaps.put(&name, &common::noise(11, 1 << 20)[..], none()).await.unwrap_err();
    assert!(matches!(err, StoreError::Unavailable { .. }), "{err}");
    fault.clear();
    assert!(snaps.manifest(&name).await.unwrap_err().is_not_found());
    // Once the store is back the same put succeeds.
    let data = common::noise(11, 1 << 20);
    snaps.put(&name, &data[..], none()).await.unwrap();
    let mut out = Vec::new();
    snaps.get(&name, &mut out).await.unwrap();
    assert!(out == data);
}

#[tokio::test]
async fn bad_configs_are_refused() {
    let backend = common::fs().await;
    let cfg =
        SnapshotConfig { grace_secs: 100, reuse_window_secs: 60, ..SnapshotConfig::default() };
    assert!(matches!(
        SnapshotStore::new(backend.store(), cfg, None),
        Err(StoreError::InvalidConfig(_))
    ));
    let cfg = SnapshotConfig { upload_concurrency: 0, ..SnapshotConfig::default() };
    assert!(SnapshotStore::new(backend.store(), cfg, None).is_err());
}

/// At most `upload_concurrency` PUTs are under way at once, while the HEADs of the next chunks
/// run beside them (a PUT slot does not wait on a HEAD), on no more than twice as many chunks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn puts_are_bounded_and_heads_run_ahead_of_them() {
    let backend = common::fs_unsynced().await;
    let fault = fault_over(&backend);
    fault.set_latency(Duration::from_millis(5));
    let cfg = SnapshotConfig {
        chunking: common::small_chunks(),
        upload_concurrency: 3,
        ..SnapshotConfig::default()
    };
    let snaps = SnapshotStore::new(fault.clone(), cfg, None).unwrap();
    let data = common::noise(7, 4 * MIB as usize);
    let name = SnapshotName::checkpoint("bounded").unwrap();
    let report = snaps.put(&name, &data[..], none()).await.unwrap();
    assert!(report.uploaded_chunks > 20, "{report:?}");
    let counts = fault.counts();
    assert_eq!(counts.peak_puts, 3, "PUTs under way at once: {counts:?}");
    assert!(counts.peak_calls > 3, "no HEAD ran beside the PUTs: {counts:?}");
    assert!(counts.peak_calls <= 6, "more chunks in hand than twice the PUTs: {counts:?}");
}

/// A snapshot store over `store` signing its manifests with `key`.
fn signing(store: Arc<dyn ObjectStore>, key: Option<[u8; 32]>) -> SnapshotStore {
    let cfg = SnapshotConfig { manifest_key: key.map(ManifestKey), ..SnapshotConfig::default() };
    SnapshotStore::new(store, cfg, None).unwrap()
}

#[tokio::test]
async fn a_store_vouches_only_for_manifests_signed_with_its_key_as_they_were_written() {
    let backend = common::fs_unsynced().await;
    let store = backend.store();
    let (fleet, other) = ([7u8; 32], [8u8; 32]);
    let ours = signing(store.clone(), Some(fleet));
    let name = SnapshotName::checkpoint("signed").unwrap();
    ours.put(&name, &b"the fleet's bytes"[..], none()).await.unwrap();
    let signed = ours.manifest(&name).await.unwrap();
    assert!(ours.vouches_for(&signed), "a node of the fleet vouches for its own manifest");
    assert!(signing(store.clone(), Some(fleet)).vouches_for(&signed), "and another node of it");
    assert!(!signing(store.clone(), Some(other)).vouches_for(&signed), "another fleet's key");
    assert!(!signing(store.clone(), None).vouches_for(&signed), "a store with no key");

    // Whoever can write to the store but lacks the key: an unsigned manifest, a signed one
    // changed (its chunks, its metadata), or another's signature copied onto new contents.
    let unsigned = SnapshotName::checkpoint("unsigned").unwrap();
    signing(store.clone(), None).put(&unsigned, &b"forged bytes"[..], none()).await.unwrap();
    let forged = ours.manifest(&unsigned).await.unwrap();
    assert!(!ours.vouches_for(&forged), "an unsigned manifest");
    let with_stolen_mac = Manifest { mac: signed.mac.clone(), ..forged.clone() };
    assert!(!ours.vouches_for(&with_stolen_mac), "a signature copied from another manifest");
    let mut changed = signed.clone();
    changed.chunks = forged.chunks.clone();
    changed.size = forged.size;
    assert!(!ours.vouches_for(&changed), "a signed manifest pointed at other chunks");
    let mut renamed = signed.clone();
    renamed.meta.insert("tenant".into(), "someone-else".into());
    assert!(!ours.vouches_for(&renamed), "a signed manifest with other metadata");
    // Written back to the store and read again: the same verdicts.
    store.put_bytes(&name.key(), Bytes::from(changed.to_json())).await.unwrap();
    assert!(!ours.vouches_for(&ours.manifest(&name).await.unwrap()));
}
