//! Harness for store tests: backends on temp directories and on the local S3 server, data that
//! is the same on every run, and the contract suite every backend runs.
#![allow(dead_code)]

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use silk_store::fault::FaultStore;
use silk_store::fs::{FsConfig, FsStore};
use silk_store::s3::{S3Config, S3Store};
use silk_store::{ChunkParams, ObjectStore, SnapshotConfig, SnapshotStore};

pub mod contract;

/// Generates one `#[tokio::test]` per contract function, each on a fresh backend from `$make`
/// (an async fn returning a [`Backend`]).
#[macro_export]
macro_rules! contract_suite {
    ($make:path) => {
        $crate::contract_suite!(@tests $make,
            put_get_and_head_agree,
            missing_objects_are_not_found,
            ranges_read_the_right_bytes,
            large_streamed_puts_round_trip,
            lists_are_sorted_paginated_and_prefix_exact,
            batch_delete_removes_what_it_names,
            concurrent_writers_of_one_key_never_mix,
            exactly_one_concurrent_lease_wins,
            touch_renews_modified_and_keeps_bytes,
            a_dropped_put_leaves_no_object,
            snapshots_round_trip_and_dedup,
            two_nodes_write_the_same_chunks_at_once,
            old_chunks_are_touched_not_trusted,
        );
    };
    (@tests $make:path, $($name:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                let backend = $make().await;
                common::contract::$name(&backend).await;
            }
        )*
    };
}

/// A store under test, and whatever must live as long as it.
pub struct Backend {
    pub store: Arc<dyn ObjectStore>,
    pub dir: Option<tempfile::TempDir>,
}

impl Backend {
    pub fn store(&self) -> Arc<dyn ObjectStore> {
        self.store.clone()
    }
}

/// An `fs` store on a fresh temp directory, syncing as in production, with small list pages so
/// pagination is exercised.
pub async fn fs() -> Backend {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = FsConfig::new(dir.path().join("store"));
    cfg.list_page = 7;
    let store = FsStore::open(cfg).await.unwrap();
    Backend { store: Arc::new(store), dir: Some(dir) }
}

/// An `fs` store without fsync, for the tests that push hundreds of MiB.
pub async fn fs_unsynced() -> Backend {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = FsConfig::new(dir.path().join("store"));
    cfg.fsync = false;
    let store = FsStore::open(cfg).await.unwrap();
    Backend { store: Arc::new(store), dir: Some(dir) }
}

/// The fault wrapper around `fs`, with a little latency and no faults: it must be transparent.
pub async fn fault_fs() -> Backend {
    let inner = fs().await;
    let fault = FaultStore::new(inner.store.clone());
    fault.set_latency(std::time::Duration::from_millis(1));
    Backend { store: Arc::new(fault), dir: inner.dir }
}

/// Where the local S3 server is, from the environment `scripts/start-s3` prints.
#[derive(Debug, Clone)]
pub struct S3Env {
    pub endpoint: String,
    pub region: String,
    pub bucket: String,
}

/// Reads the S3 test environment, or fails the test saying how to get one. Never skips.
pub fn s3_env() -> S3Env {
    let vars = ["SILK_S3_ENDPOINT", "SILK_S3_REGION", "SILK_S3_BUCKET"];
    let creds = ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"];
    let missing: Vec<&str> =
        vars.iter().chain(&creds).copied().filter(|v| std::env::var_os(v).is_none()).collect();
    assert!(
        missing.is_empty(),
        "the S3 tests need a running S3 server, and {} {} not set.\n\
         Start the local one and load its environment:\n    \
         eval \"$(scripts/start-s3)\"\n\
         (scripts/test does this itself). The S3 tests are never skipped.",
        missing.join(", "),
        if missing.len() == 1 { "is" } else { "are" },
    );
    let var = |v: &str| std::env::var(v).unwrap();
    S3Env { endpoint: var(vars[0]), region: var(vars[1]), bucket: var(vars[2]) }
}

/// An S3 config for the local server under a prefix no other test uses, with the smallest parts
/// S3 allows so multipart uploads happen at test sizes, and small list pages.
pub fn s3_config() -> S3Config {
    let env = s3_env();
    let mut cfg = S3Config::new(env.bucket);
    cfg.region = env.region;
    cfg.endpoint = Some(env.endpoint);
    cfg.path_style = true;
    cfg.prefix = format!("test-{}/", unique());
    cfg.part_size = 5 * 1024 * 1024;
    cfg.multipart_threshold = 5 * 1024 * 1024;
    cfg.part_concurrency = 3;
    cfg.list_page = 7;
    cfg
}

pub async fn s3() -> Backend {
    let store = S3Store::new(s3_config()).await.unwrap();
    Backend { store: Arc::new(store), dir: None }
}

/// A name no other test in any run uses.
pub fn unique() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let nanos =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
    format!("{}-{nanos}-{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed))
}

/// `len` pseudo-random bytes, the same for the same seed on every run.
pub fn noise(seed: u64, len: usize) -> Vec<u8> {
    let mut out = vec![0; len];
    blake3::Hasher::new().update(&seed.to_le_bytes()).finalize_xof().fill(&mut out);
    out
}

/// Small chunks (16/64/256 KiB) so a few MiB make dozens of chunks.
pub fn small_chunks() -> ChunkParams {
    ChunkParams { min: 16 * 1024, avg: 64 * 1024, max: 256 * 1024 }
}

/// A snapshot store with small chunks, a one-hour grace and a half-hour reuse window.
pub fn snapshots(store: Arc<dyn ObjectStore>) -> SnapshotStore {
    let cfg = SnapshotConfig {
        chunking: small_chunks(),
        grace_secs: 3600,
        reuse_window_secs: 1800,
        ..SnapshotConfig::default()
    };
    SnapshotStore::new(store, cfg, None).unwrap()
}

/// A tar stream of `files` files of `size` bytes each; file `i` holds `noise(seeds[i])`.
pub fn tree(seeds: &[u64], size: usize) -> Vec<u8> {
    let mut tar = tar::Builder::new(Vec::new());
    for (i, seed) in seeds.iter().enumerate() {
        let mut header = tar::Header::new_gnu();
        header.set_size(size as u64);
        header.set_mode(0o644);
        header.set_mtime(1_700_000_000);
        header.set_cksum();
        tar.append_data(&mut header, format!("srv/data/f{i:03}"), &noise(*seed, size)[..]).unwrap();
    }
    tar.into_inner().unwrap()
}
