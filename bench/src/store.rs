//! The store section: put and get of one snapshot (default 1 GiB) through the snapshot store on
//! the `fs` backend (with and without fsync) and on the local S3 server, beside `cp` of the same
//! file in the same run; the dedup ratio of a second snapshot that differs in a few places; and
//! chunking + hashing throughput on one core, the CPU floor of every put.
//!
//! The S3 arm reads the environment `scripts/start-s3` prints (`eval "$(scripts/start-s3)"`);
//! `--no-s3` leaves it out. The Garage the test suite installs is a test server, unoptimised:
//! measure against one built with `GARAGE_OPT_LEVEL=3` (docs/store.md).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use silk_store::fs::{FsConfig, FsStore};
use silk_store::s3::{S3Config, S3Store};
use silk_store::{ChunkParams, Chunker, ObjectStore, SnapshotConfig, SnapshotName, SnapshotStore};

use crate::report::{host_stamp, table};

#[derive(Debug, clap::Args)]
pub struct StoreArgs {
    /// Snapshot size in MiB (a multiple of 4).
    #[arg(long, default_value_t = 1024)]
    size_mib: usize,
    /// Directory for the source files, the fs stores and the copies (needs ~5x the size free).
    #[arg(long, default_value = "/var/tmp")]
    dir: PathBuf,
    /// Leave out the S3 arm (it needs the environment printed by scripts/start-s3).
    #[arg(long)]
    no_s3: bool,
}

const MIB: usize = 1024 * 1024;
/// The snapshot is made of 4 MiB segments of noise; the second snapshot rewrites a few of them.
const SEGMENT: usize = 4 * MIB;

pub fn run(args: StoreArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.size_mib >= 64 && args.size_mib.is_multiple_of(4),
        "--size-mib must be a multiple of 4, at least 64"
    );
    let work = args.dir.join(format!("silkbench-store-{}", std::process::id()));
    std::fs::create_dir_all(&work).with_context(|| format!("creating {}", work.display()))?;
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let result = runtime.block_on(sections(&args, &work));
    let _ = std::fs::remove_dir_all(&work);
    result
}

/// Segment `i` of snapshot `generation`: the second generation rewrites every 32nd segment.
fn segment(i: usize, generation: u64) -> Vec<u8> {
    let seed = if generation == 2 && i % 32 == 7 { 1_000_000 + i as u64 } else { i as u64 };
    let mut out = vec![0; SEGMENT];
    blake3::Hasher::new().update(&seed.to_le_bytes()).finalize_xof().fill(&mut out);
    out
}

fn write_source(path: &Path, segments: usize, generation: u64) -> anyhow::Result<()> {
    use std::io::Write;
    let mut f = std::io::BufWriter::new(std::fs::File::create(path)?);
    for i in 0..segments {
        f.write_all(&segment(i, generation))?;
    }
    f.into_inner()?.sync_all()?;
    Ok(())
}

fn mib_s(bytes: u64, took: Duration) -> String {
    format!("{:.0}", bytes as f64 / MIB as f64 / took.as_secs_f64())
}

async fn sections(args: &StoreArgs, work: &Path) -> anyhow::Result<()> {
    println!("## store\n\n{}", host_stamp());
    let segments = args.size_mib * MIB / SEGMENT;
    let (src, src2) = (work.join("snapshot-1"), work.join("snapshot-2"));
    write_source(&src, segments, 1)?;
    write_source(&src2, segments, 2)?;
    let size = (segments * SEGMENT) as u64;

    // The floor: cp of the same file, in the same run — before and after the store arms, since
    // the disk's writeback state moves it a lot on a shared machine.
    let mut rows = vec![cp_row(&src, work, size, "before")?];
    let mut arms: Vec<(String, Arc<dyn ObjectStore>)> = Vec::new();
    for fsync in [true, false] {
        let mut cfg = FsConfig::new(work.join(format!("fs-{fsync}")));
        cfg.fsync = fsync;
        let label = format!("fs store, fsync {}", if fsync { "on" } else { "off" });
        arms.push((label, Arc::new(FsStore::open(cfg).await?)));
    }
    if !args.no_s3 {
        arms.push(("s3 store, Garage on loopback".into(), Arc::new(s3_store().await?)));
    }

    let mut dedup = Vec::new();
    for (label, store) in &arms {
        let snaps = SnapshotStore::new(store.clone(), SnapshotConfig::default(), None)?;
        let name = SnapshotName::checkpoint("bench-1")?;
        let t = Instant::now();
        let file = tokio::fs::File::open(&src).await?;
        let report = snaps.put(&name, file, Default::default()).await?;
        let put = t.elapsed();
        anyhow::ensure!(report.uploaded_bytes == size, "a first put uploads everything");

        let out_path = work.join("out");
        let t = Instant::now();
        let mut out = tokio::fs::File::create(&out_path).await?;
        let manifest = snaps.get(&name, &mut out).await?;
        drop(out);
        let get = t.elapsed();
        anyhow::ensure!(manifest.size == size, "get returned {} bytes", manifest.size);
        std::fs::remove_file(&out_path)?;
        rows.push(vec![
            label.clone(),
            mib_s(size, put),
            mib_s(size, get),
            format!("{:.2} s / {:.2} s", put.as_secs_f64(), get.as_secs_f64()),
        ]);

        let file = tokio::fs::File::open(&src2).await?;
        let name2 = SnapshotName::checkpoint("bench-2")?;
        let second = snaps.put(&name2, file, Default::default()).await?;
        dedup.push(vec![
            label.clone(),
            format!("{} MiB", second.size / MIB as u64),
            format!("{:.1} MiB", second.uploaded_bytes as f64 / MIB as f64),
            format!("{} / {}", second.uploaded_chunks, second.chunks),
            format!("{:.1}x", second.size as f64 / second.uploaded_bytes.max(1) as f64),
        ]);
        let all = store.list_all("").await?;
        let keys: Vec<_> = all.into_iter().map(|o| o.key).collect();
        store.delete(&keys).await?;
    }
    if !args.no_s3 {
        rows.push(bare_s3_row(&src, work).await?);
    }
    rows.push(cp_row(&src, work, size, "after")?);
    let p = ChunkParams::default();
    table(
        &format!(
            "snapshot put/get, {} MiB of incompressible data, chunks {}/{}/{} KiB min/avg/max; \
             floor: cp of the same file",
            args.size_mib,
            p.min / 1024,
            p.avg / 1024,
            p.max / 1024
        ),
        &["arm", "put MiB/s", "get MiB/s", "time put / get"],
        &rows,
    );
    table(
        &format!(
            "dedup: a second snapshot with {} of its {segments} 4 MiB segments rewritten",
            (0..segments).filter(|i| i % 32 == 7).count()
        ),
        &["arm", "snapshot", "uploaded", "chunks uploaded", "dedup ratio"],
        &dedup,
    );
    chunking(args)?;
    Ok(())
}

fn cp_row(src: &Path, work: &Path, size: u64, when: &str) -> anyhow::Result<Vec<String>> {
    let copy = work.join("cp-copy");
    let t = Instant::now();
    let status = std::process::Command::new("cp").arg(src).arg(&copy).status()?;
    anyhow::ensure!(status.success(), "cp failed");
    let took = t.elapsed();
    std::fs::remove_file(&copy)?;
    Ok(vec![
        format!("`cp` file → file (floor, {when})"),
        mib_s(size, took),
        "—".into(),
        format!("{:.2} s", took.as_secs_f64()),
    ])
}

/// Chunking and hashing on one thread over an in-memory buffer: the CPU cost of every put.
fn chunking(args: &StoreArgs) -> anyhow::Result<()> {
    let len = args.size_mib.min(256) * MIB;
    let data: Vec<u8> = (0..len / SEGMENT).flat_map(|i| segment(i, 1)).collect();
    let chunker = Chunker::new(ChunkParams::default())?;
    let t = Instant::now();
    let lengths = chunker.lengths(&data);
    let cut = t.elapsed();
    let t = Instant::now();
    let mut at = 0;
    for n in &lengths {
        std::hint::black_box(blake3::hash(&data[at..at + n]));
        at += n;
    }
    let hash = t.elapsed();
    let t = Instant::now();
    let mut rest = &data[..];
    while !rest.is_empty() {
        let n = chunker.cut(rest);
        std::hint::black_box(blake3::hash(&rest[..n]));
        rest = &rest[n..];
    }
    let both = t.elapsed();
    let rows = vec![
        vec!["cut points".to_string(), mib_s(len as u64, cut)],
        vec!["blake3 of each chunk".to_string(), mib_s(len as u64, hash)],
        vec!["both (what a put does per byte)".to_string(), mib_s(len as u64, both)],
    ];
    table(
        &format!(
            "chunking + hashing on one core, {} MiB in memory, {} chunks",
            len / MIB,
            lengths.len()
        ),
        &["stage", "MiB/s"],
        &rows,
    );
    Ok(())
}

/// The floor for the S3 arm: the same bytes cut at the same chunk boundaries, put as one object
/// each and got back into a file in order, through the store's own aws-sdk-s3 client called
/// directly, with the store's concurrency, against the same server.
async fn bare_s3_row(src: &Path, work: &Path) -> anyhow::Result<Vec<String>> {
    use futures_util::{StreamExt, TryStreamExt};
    use tokio::io::AsyncWriteExt;

    let store = s3_store().await?;
    let client = store.client();
    let bucket = std::env::var("SILK_S3_BUCKET")?;
    let concurrency = SnapshotConfig::default().upload_concurrency;

    let data = bytes::Bytes::from(std::fs::read(src)?);
    let chunker = Chunker::new(ChunkParams::default())?;
    let mut chunks = vec![];
    let mut at = 0;
    for n in chunker.lengths(&data) {
        chunks.push(data.slice(at..at + n));
        at += n;
    }
    let prefix = format!("bench-bare-{}/", std::process::id());
    let key = |i: usize| format!("{prefix}{i:08}");

    let t = Instant::now();
    futures_util::stream::iter(chunks.iter().enumerate())
        .map(|(i, chunk)| {
            let put = client.put_object().bucket(&bucket).key(key(i));
            put.body(chunk.clone().into()).send()
        })
        .buffer_unordered(concurrency)
        .try_collect::<Vec<_>>()
        .await?;
    let put = t.elapsed();

    let out_path = work.join("out-bare");
    let t = Instant::now();
    let mut out = tokio::fs::File::create(&out_path).await?;
    let mut gets = futures_util::stream::iter(0..chunks.len())
        .map(|i| {
            let get = client.get_object().bucket(&bucket).key(key(i)).send();
            async move { anyhow::Ok(get.await?.body.collect().await?.into_bytes()) }
        })
        .buffered(concurrency);
    while let Some(bytes) = gets.next().await {
        out.write_all(&bytes?).await?;
    }
    out.flush().await?;
    drop(out);
    let get = t.elapsed();
    std::fs::remove_file(&out_path)?;
    for i in 0..chunks.len() {
        client.delete_object().bucket(&bucket).key(key(i)).send().await?;
    }
    let size = data.len() as u64;
    Ok(vec![
        format!(
            "bare aws-sdk-s3, the same {} chunks, {concurrency} at a time (floor for s3)",
            chunks.len()
        ),
        mib_s(size, put),
        mib_s(size, get),
        format!("{:.2} s / {:.2} s", put.as_secs_f64(), get.as_secs_f64()),
    ])
}

async fn s3_store() -> anyhow::Result<S3Store> {
    let var = |v: &str| {
        std::env::var(v).with_context(|| {
            format!("{v} is not set: run `eval \"$(scripts/start-s3)\"` first, or pass --no-s3")
        })
    };
    let mut cfg = S3Config::new(var("SILK_S3_BUCKET")?);
    cfg.endpoint = Some(var("SILK_S3_ENDPOINT")?);
    cfg.region = var("SILK_S3_REGION")?;
    cfg.path_style = true;
    cfg.prefix = format!("bench-{}/", std::process::id());
    Ok(S3Store::new(cfg).await?)
}
