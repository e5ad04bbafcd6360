//! The object store contract: what every backend must do, written against `dyn ObjectStore`
//! only. `fs.rs`, `s3.rs` and `fault.rs` run every function here (see `contract_suite!`).

use std::collections::BTreeMap;
use std::task::Poll;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use futures_util::StreamExt;
use silk_store::*;

use super::{Backend, noise, snapshots};

fn key(s: &str) -> Key {
    Key::new(s).unwrap()
}

async fn get_all(store: &dyn ObjectStore, k: &Key) -> Vec<u8> {
    store.get_bytes(k).await.unwrap().to_vec()
}

/// A body delivered in pieces of `piece` bytes.
fn pieces(data: &[u8], piece: usize) -> ByteStream {
    let parts: Vec<silk_store::Result<Bytes>> =
        data.chunks(piece).map(|c| Ok(Bytes::copy_from_slice(c))).collect();
    Box::pin(futures_util::stream::iter(parts))
}

pub async fn put_get_and_head_agree(b: &Backend) {
    let s = b.store();
    let k = key("objects/one");
    assert_eq!(s.put_bytes(&k, Bytes::from_static(b"first")).await.unwrap(), 5);
    assert_eq!(s.put_bytes(&k, Bytes::from_static(b"second value")).await.unwrap(), 12);
    let meta = s.head(&k).await.unwrap();
    assert_eq!((meta.key.clone(), meta.size), (k.clone(), 12));
    let got = s.get(&k, None).await.unwrap();
    assert_eq!((got.start, got.len, got.meta.size), (0, 12, 12));
    assert_eq!(&got.bytes().await.unwrap()[..], b"second value");

    let empty = key("objects/empty");
    s.put_bytes(&empty, Bytes::new()).await.unwrap();
    assert_eq!(s.head(&empty).await.unwrap().size, 0);
    assert!(get_all(&*s, &empty).await.is_empty());
}

pub async fn missing_objects_are_not_found(b: &Backend) {
    let s = b.store();
    let k = key("nothing/here");
    assert!(matches!(s.get(&k, None).await, Err(StoreError::NotFound { .. })));
    assert!(matches!(s.head(&k).await, Err(StoreError::NotFound { .. })));
    assert!(matches!(s.touch(&k).await, Err(StoreError::NotFound { .. })));
    let err = s.get_bytes(&k).await.unwrap_err();
    assert!(err.is_not_found() && !err.is_retryable(), "{err}");
    // Deleting what is not there is fine, and so is listing an empty prefix.
    s.delete(&[k]).await.unwrap();
    assert!(s.list_all("nothing/").await.unwrap().is_empty());
    // A directory-like prefix of existing keys is not an object.
    s.put_bytes(&key("dir/file"), Bytes::from_static(b"x")).await.unwrap();
    assert!(matches!(s.head(&key("dir")).await, Err(StoreError::NotFound { .. })));
    assert!(matches!(s.list("../", None).await, Err(StoreError::InvalidKey { .. })));
}

pub async fn ranges_read_the_right_bytes(b: &Backend) {
    let s = b.store();
    let k = key("ranges/data");
    let data = noise(7, 1_000_003);
    s.put_bytes(&k, data.clone().into()).await.unwrap();
    for (range, want) in [
        (ByteRange::new(0, 1), &data[0..1]),
        (ByteRange::new(10, 20), &data[10..20]),
        (ByteRange::new(999_000, 1_000_003), &data[999_000..]),
        (ByteRange::new(999_999, 5_000_000), &data[999_999..]), // an end past the size is cut
        (ByteRange::from(500_000), &data[500_000..]),
        (ByteRange::from(1_000_002), &data[1_000_002..]),
    ] {
        let got = s.get(&k, Some(range)).await.unwrap();
        assert_eq!(got.start, range.start, "{range}");
        assert_eq!(got.len, want.len() as u64, "{range}");
        assert_eq!(got.meta.size, data.len() as u64, "{range}: size is the whole object's");
        assert!(got.bytes().await.unwrap() == want, "{range} returned other bytes");
    }
    for bad in
        [ByteRange::from(1_000_003), ByteRange::new(2_000_000, 2_000_010), ByteRange::new(5, 5)]
    {
        match s.get(&k, Some(bad)).await {
            Err(StoreError::InvalidRange { size, .. }) => assert_eq!(size, 1_000_003),
            other => panic!("{bad}: {other:?}"),
        }
    }
}

pub async fn large_streamed_puts_round_trip(b: &Backend) {
    let s = b.store();
    // 13 MiB and a bit, in 64 KiB pieces: three parts where the backend uploads in parts.
    let data = noise(13, 13 * 1024 * 1024 + 12_345);
    let k = key("big/object");
    let n = s.put(&k, pieces(&data, 64 * 1024)).await.unwrap();
    assert_eq!(n, data.len() as u64);
    assert_eq!(s.head(&k).await.unwrap().size, data.len() as u64);
    let got = s.get(&k, None).await.unwrap();
    let mut body = got.body;
    let mut all = Vec::with_capacity(data.len());
    while let Some(part) = body.next().await {
        all.extend_from_slice(&part.unwrap());
    }
    assert!(all == data, "the streamed body differs");
    let tail = s.get(&k, Some(ByteRange::from(13 * 1024 * 1024))).await.unwrap();
    assert!(tail.bytes().await.unwrap() == data[13 * 1024 * 1024..]);
}

pub async fn lists_are_sorted_paginated_and_prefix_exact(b: &Backend) {
    let s = b.store();
    let mut want = Vec::new();
    for i in 0..25 {
        let k = key(&format!("l/a/{i:02}"));
        s.put_bytes(&k, Bytes::from(vec![1; i])).await.unwrap();
        want.push(k);
    }
    for other in ["l/ab", "l/b/1", "l2/x", "l/a-c"] {
        s.put_bytes(&key(other), Bytes::from_static(b"o")).await.unwrap();
    }
    // Page by page: every page is in order, and together they are exactly the prefix's keys.
    let mut pages = 0;
    let mut got = Vec::new();
    let mut next: Option<String> = None;
    loop {
        let page = s.list("l/a/", next.as_deref()).await.unwrap();
        pages += 1;
        got.extend(page.objects.iter().map(|o| (o.key.clone(), o.size)));
        match page.next {
            Some(n) => next = Some(n),
            None => break,
        }
        assert!(pages < 100, "pagination does not end");
    }
    assert!(pages > 1, "25 keys should not fit one test page");
    let sizes: Vec<(Key, u64)> = want.iter().cloned().zip(0..).collect();
    assert_eq!(got, sizes);
    // A prefix is a string prefix, not a directory.
    let all: Vec<String> =
        s.list_all("l/a").await.unwrap().into_iter().map(|o| o.key.to_string()).collect();
    assert_eq!(all.len(), 27);
    assert!(all.windows(2).all(|w| w[0] < w[1]), "not in key order: {all:?}");
    assert!(all.contains(&"l/ab".to_string()) && all.contains(&"l/a-c".to_string()));
    assert_eq!(s.list_all("l/b").await.unwrap().len(), 1);
    assert_eq!(s.list_all("").await.unwrap().len(), 29);
}

pub async fn batch_delete_removes_what_it_names(b: &Backend) {
    let s = b.store();
    let keys: Vec<Key> = (0..5).map(|i| key(&format!("del/{i}"))).collect();
    for k in &keys {
        s.put_bytes(k, Bytes::from_static(b"x")).await.unwrap();
    }
    s.delete(&[keys[0].clone(), keys[2].clone(), keys[4].clone(), key("del/missing")])
        .await
        .unwrap();
    let left: Vec<Key> = s.list_all("del/").await.unwrap().into_iter().map(|o| o.key).collect();
    assert_eq!(left, vec![keys[1].clone(), keys[3].clone()]);
    s.delete(&[]).await.unwrap();
}

pub async fn concurrent_writers_of_one_key_never_mix(b: &Backend) {
    let s = b.store();
    let k = key("race/object");
    let (a, bb) = (noise(1, 3 << 20), noise(2, 3 << 20));
    let mut tasks = Vec::new();
    for i in 0..8 {
        let (s, k) = (s.clone(), k.clone());
        let data = if i % 2 == 0 { a.clone() } else { bb.clone() };
        tasks.push(tokio::spawn(async move { s.put(&k, pieces(&data, 100_000)).await }));
    }
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    let got = get_all(&*s, &k).await;
    assert!(got == a || got == bb, "concurrent puts left a mix of two writers' bytes");
}

/// A lease: of many racing acquirers at most one holds it, a held lease refuses newcomers, a
/// released one can be taken again, and a holder that vanished stops blocking after the TTL.
pub async fn exactly_one_concurrent_lease_wins(b: &Backend) {
    use silk_store::Lease;
    use std::time::Duration;
    let s = b.store();
    let ttl = Duration::from_secs(60);
    let mut tasks = Vec::new();
    for i in 0..8 {
        let s = s.clone();
        tasks.push(tokio::spawn(async move {
            Lease::acquire(&*s, "leases/sb-race", &format!("node-{i}"), ttl).await.unwrap()
        }));
    }
    let mut held = vec![];
    for t in tasks {
        held.extend(t.await.unwrap());
    }
    assert!(held.len() <= 1, "{} holders", held.len());
    // Racers may all back off; then one alone gets it.
    let lease = match held.pop() {
        Some(l) => l,
        None => Lease::acquire(&*s, "leases/sb-race", "alone", ttl).await.unwrap().expect("alone"),
    };
    assert!(Lease::acquire(&*s, "leases/sb-race", "late", ttl).await.unwrap().is_none());
    lease.release(&*s).await.unwrap();
    let again = Lease::acquire(&*s, "leases/sb-race", "again", ttl).await.unwrap();
    assert!(again.is_some(), "free after a release");
    // A holder that died: after the TTL its lease no longer blocks.
    let short = Duration::from_millis(1);
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let taken = Lease::acquire(&*s, "leases/sb-race", "after", short).await.unwrap();
    assert!(taken.is_some(), "an expired lease is taken over");
}

pub async fn touch_renews_modified_and_keeps_bytes(b: &Backend) {
    let s = b.store();
    let k = key("touch/me");
    s.put_bytes(&k, Bytes::from_static(b"keep")).await.unwrap();
    let before = s.head(&k).await.unwrap();
    let asked = SystemTime::now();
    s.touch(&k).await.unwrap();
    let after = s.head(&k).await.unwrap();
    assert!(after.modified >= before.modified);
    // Stores keep whole seconds at worst.
    assert!(after.modified + Duration::from_secs(1) >= asked, "touch did not renew the time");
    assert_eq!(after.size, 4);
    assert_eq!(get_all(&*s, &k).await, b"keep");
}

pub async fn a_dropped_put_leaves_no_object(b: &Backend) {
    let s = b.store();
    let k = key("dropped/object");
    // 6 MiB (past the test multipart threshold), then a body that never ends.
    let head = noise(6, 6 << 20);
    let (pulled_tx, pulled_rx) = tokio::sync::oneshot::channel::<()>();
    let mut pulled_tx = Some(pulled_tx);
    let first = futures_util::stream::iter(
        head.chunks(1 << 20).map(|c| Ok(Bytes::copy_from_slice(c))).collect::<Vec<_>>(),
    );
    let stall = futures_util::stream::poll_fn(move |_| {
        if let Some(tx) = pulled_tx.take() {
            let _ = tx.send(());
        }
        Poll::<Option<silk_store::Result<Bytes>>>::Pending
    });
    let body: ByteStream = Box::pin(first.chain(stall));
    tokio::select! {
        r = s.put(&k, body) => panic!("a put of an endless body finished: {r:?}"),
        _ = pulled_rx => {}
    }
    // The put future is dropped here, after its body was read past 6 MiB.
    assert!(matches!(s.head(&k).await, Err(StoreError::NotFound { .. })));
    assert!(s.list_all("dropped/").await.unwrap().is_empty());
}

pub async fn snapshots_round_trip_and_dedup(b: &Backend) {
    let snaps = snapshots(b.store());
    let data = noise(21, 4 << 20);
    let name = SnapshotName::checkpoint("rt").unwrap();
    let meta = BTreeMap::from([("sandbox".to_string(), "sb-1".to_string())]);
    let first = snaps.put(&name, &data[..], meta.clone()).await.unwrap();
    assert_eq!(first.size, data.len() as u64);
    assert!(first.chunks > 8, "{first:?}");
    assert_eq!(first.uploaded_bytes, data.len() as u64, "noise has no repeated chunks");

    let mut out = Vec::new();
    let manifest = snaps.get(&name, &mut out).await.unwrap();
    assert!(out == data, "the snapshot came back different");
    assert_eq!(manifest.meta, meta);
    assert_eq!(manifest.chunks.len(), first.chunks);

    // The same stream again uploads nothing; a 1-byte edit uploads about one chunk.
    let name2 = SnapshotName::checkpoint("rt2").unwrap();
    let again = snaps.put(&name2, &data[..], meta.clone()).await.unwrap();
    assert_eq!(again.uploaded_bytes, 0);
    let mut edited = data.clone();
    edited[2 << 20] ^= 1;
    let name3 = SnapshotName::archive("rt3").unwrap();
    let third = snaps.put(&name3, &edited[..], BTreeMap::new()).await.unwrap();
    assert!(
        third.uploaded_chunks <= 2 && third.uploaded_bytes <= 2 * 256 * 1024,
        "a 1-byte edit uploaded {third:?}"
    );
    let mut out = Vec::new();
    snaps.get(&name3, &mut out).await.unwrap();
    assert!(out == edited);
    let listed = snaps.list("checkpoints/").await.unwrap();
    assert_eq!(listed, vec![name.clone(), SnapshotName::checkpoint("rt2").unwrap()]);
}

pub async fn two_nodes_write_the_same_chunks_at_once(b: &Backend) {
    // Two snapshot stores (two nodes' known-chunk indexes) over one object store.
    let (n1, n2) = (snapshots(b.store()), snapshots(b.store()));
    let data = noise(31, 6 << 20);
    let (a, bb) =
        (SnapshotName::checkpoint("n1").unwrap(), SnapshotName::checkpoint("n2").unwrap());
    let (r1, r2) = tokio::join!(
        n1.put(&a, &data[..], BTreeMap::new()),
        n2.put(&bb, &data[..], BTreeMap::new())
    );
    let (r1, r2) = (r1.unwrap(), r2.unwrap());
    assert_eq!(r1.chunks, r2.chunks);
    for (node, name) in [(&n1, &bb), (&n2, &a)] {
        let mut out = Vec::new();
        node.get(name, &mut out).await.unwrap();
        assert!(out == data, "{name} came back different");
    }
    let chunks = b.store.list_all(CHUNK_PREFIX).await.unwrap();
    assert_eq!(chunks.len(), r1.unique_chunks, "each chunk is stored once");
}

pub async fn old_chunks_are_touched_not_trusted(b: &Backend) {
    let snaps = snapshots(b.store());
    let data = noise(41, 2 << 20);
    let now = SystemTime::now();
    let first = SnapshotName::template("t1").unwrap();
    let r = snaps.put_at(&first, &data[..], BTreeMap::new(), now).await.unwrap();
    // Within the reuse window the known-chunk index is trusted: no requests per chunk.
    let second = SnapshotName::template("t2").unwrap();
    let r2 = snaps.put_at(&second, &data[..], BTreeMap::new(), now).await.unwrap();
    assert_eq!((r2.uploaded_chunks, r2.touched_chunks), (0, 0));
    // Four hours on (reuse window 30 min, grace 1 h) the same chunks are too old to rely on as
    // they are: each is touched (renewed in place), none uploaded again.
    let later = now + Duration::from_secs(4 * 3600);
    let third = SnapshotName::template("t3").unwrap();
    let r3 = snaps.put_at(&third, &data[..], BTreeMap::new(), later).await.unwrap();
    assert_eq!(r3.uploaded_chunks, 0);
    assert_eq!(r3.touched_chunks, r.unique_chunks);
    let mut out = Vec::new();
    snaps.get(&third, &mut out).await.unwrap();
    assert!(out == data);
}
