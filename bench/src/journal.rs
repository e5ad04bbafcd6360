//! The journal section: one single-record commit to the claims journal (a claim's deadline
//! changing), for several sizes of the live set, beside the floor measured in the same run: one
//! `write` of as many bytes to a file opened with `O_APPEND`, plus an `fdatasync` with `--fsync`.
//! That is the I/O a commit cannot avoid; the rest is encoding and the trip to the writer thread.
//! The p50 should not grow with the live set: a commit appends, it never rewrites the set.

use std::fs::OpenOptions;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::Context;
use sandboxd::journal::{Change, Journal};

use crate::report::{Samples, host_stamp, table, us};

#[derive(Debug, clap::Args)]
pub struct JournalArgs {
    /// Timed commits per live-set size.
    #[arg(long, default_value_t = 2000)]
    commits: usize,
    /// fsync every commit (the node's `journal_fsync`), and the floor's write with it.
    #[arg(long)]
    fsync: bool,
    /// Directory for the throwaway journals.
    #[arg(long, default_value = "/var/tmp")]
    dir: PathBuf,
}

/// A claim of realistic size: id, token hash (64 hex chars), deadline, state, four metadata
/// pairs.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct Claim(String, String, u64, String, [(String, String); 4]);

impl sandboxd::journal::Record for Claim {
    const VERSION: u32 = 1;
    type Previous = sandboxd::journal::NoOlder;
    fn upgrade(previous: sandboxd::journal::NoOlder) -> Claim {
        match previous {}
    }
}

const LIVE: [usize; 3] = [100, 1000, 5000];
/// Untimed rounds before each arm, so first-touch costs stay out of the samples.
const WARMUP: usize = 20;

pub fn run(args: JournalArgs) -> anyhow::Result<()> {
    let data = args.dir.join(format!("silkbench-journal-{}", std::process::id()));
    let result = sections(&args, &data);
    let _ = std::fs::remove_dir_all(&data);
    result
}

fn sections(args: &JournalArgs, data: &Path) -> anyhow::Result<()> {
    anyhow::ensure!(args.commits > 0, "--commits must be at least 1");
    // The journal's writer is its own thread; the caller side needs no more than this one.
    let runtime = tokio::runtime::Builder::new_current_thread().build()?;
    println!("## claims journal\n\n{}", host_stamp());

    let mut rows = Vec::new();
    let mut frame_bytes = 0;
    for live in LIVE {
        let dir = data.join(live.to_string());
        let (commits, floor, bytes) = runtime.block_on(arm(args, &dir, live))?;
        frame_bytes = bytes;
        rows.push(vec![
            live.to_string(),
            us(commits.pct(0.5)),
            us(commits.pct(0.9)),
            us(commits.pct(1.0)),
            us(floor.pct(0.5)),
            us(floor.pct(0.9)),
            us(floor.pct(1.0)),
            format!("{:.2}", commits.pct(0.5).as_secs_f64() / floor.pct(0.5).as_secs_f64()),
        ]);
    }
    let sync = if args.fsync { ", fsync on" } else { ", no fsync" };
    table(
        &format!(
            "claims journal, one single-record commit{sync} (n = {} per row, {frame_bytes} bytes \
             appended per commit); floor: O_APPEND write of as many bytes{}",
            args.commits,
            if args.fsync { " + fdatasync" } else { "" },
        ),
        &["live claims", "p50", "p90", "max", "floor p50", "floor p90", "floor max", "p50 ratio"],
        &rows,
    );
    Ok(())
}

/// Preloads `live` claims, then times `args.commits` commits interleaved with the floor, so both
/// see the same noise. Returns the commit samples, the floor samples and the bytes per commit.
async fn arm(
    args: &JournalArgs,
    dir: &Path,
    live: usize,
) -> anyhow::Result<(Samples, Samples, usize)> {
    let journal_dir = dir.join("journal");
    let (journal, _) = Journal::<Claim>::open(&journal_dir, args.fsync)
        .with_context(|| format!("opening a journal in {}", journal_dir.display()))?;
    let keys: Vec<String> = (0..live).map(|i| format!("claim-{i:05}")).collect();
    // Preloading is setup, not what is measured: batches of 100.
    for chunk in keys.chunks(100) {
        journal.commit(chunk.iter().map(|k| Change::Put(k.clone(), claim(k, 0))).collect()).await?;
    }

    let bytes = commit_bytes(&journal, &journal_dir, &keys[0]).await?;
    let floor_path = dir.join("floor");
    let mut floor_file = OpenOptions::new()
        .create(true)
        .append(true)
        .open(&floor_path)
        .with_context(|| format!("opening {}", floor_path.display()))?;
    let buf = vec![0x5a; bytes];

    let (mut commits, mut floor) = (Samples::default(), Samples::default());
    for i in 0..WARMUP + args.commits {
        let t = Instant::now();
        floor_file.write_all(&buf)?;
        if args.fsync {
            floor_file.sync_data()?;
        }
        let floor_took = t.elapsed();

        let key = &keys[i % live];
        let change = Change::Put(key.clone(), claim(key, i as u64 + 1));
        let t = Instant::now();
        journal.commit(vec![change]).await?;
        let commit_took = t.elapsed();

        if i >= WARMUP {
            floor.push(floor_took);
            commits.push(commit_took);
        }
    }
    Ok((commits, floor, bytes))
}

/// The bytes one single-record commit appends, read off the journal directory's growth. A
/// compaction right after the commit would shrink it instead, so that try does not count.
async fn commit_bytes(journal: &Journal<Claim>, dir: &Path, key: &str) -> anyhow::Result<usize> {
    for _ in 0..3 {
        let before = dir_bytes(dir)?;
        journal.commit(vec![Change::Put(key.to_string(), claim(key, 0))]).await?;
        let after = dir_bytes(dir)?;
        if after > before {
            return Ok(usize::try_from(after - before)?);
        }
    }
    anyhow::bail!("could not measure the size of one commit: the journal shrank on every try")
}

fn dir_bytes(dir: &Path) -> anyhow::Result<u64> {
    let mut total = 0;
    for entry in std::fs::read_dir(dir)? {
        total += entry?.metadata()?.len();
    }
    Ok(total)
}

/// Claim `key` at version `n`: only the deadline moves between versions, as on a lease renewal.
fn claim(key: &str, n: u64) -> Claim {
    let pair = |k: &str, v: String| (k.to_string(), v);
    Claim(
        key.to_string(),
        blake3::hash(key.as_bytes()).to_hex().to_string(),
        1_767_225_600_000 + n * 30_000,
        "running".to_string(),
        [
            pair("owner", "team-build".into()),
            pair("job", format!("ci-{key}")),
            pair("region", "eu-west-1".into()),
            pair("purpose", "integration-tests".into()),
        ],
    )
}
