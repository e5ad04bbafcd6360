//! The verbs section: silkd's search, watch and session verbs over a kept unix-socket connection.
//!
//! | measurement | floor beside it |
//! |---|---|
//! | `find` over a 10 000-file tree | `grep -rnI` of the same pattern over the same tree |
//! | `watch`: file write → event at the client | raw inotify read in this process |
//! | `session_exec` round trip | `fork+exec` from Rust, and silkd's plain `exec` |

use std::io::Write;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use silk_proto::{
    Command, Connection, ExecRequest, FindRequest, Frame, SessionExecRequest, SessionRequest,
    WatchRequest,
};
use tokio::net::UnixStream;

use crate::agent::{row, start, until_terminal};
use crate::report::{Samples, host_stamp, table};

#[derive(Debug, clap::Args)]
pub struct VerbsArgs {
    /// The silkd binary (default: next to this one).
    #[arg(long)]
    silkd: Option<PathBuf>,
    /// Files in the find tree (100 per directory).
    #[arg(long, default_value_t = 10_000)]
    files: usize,
    /// Runs per find arm (the table shows the median).
    #[arg(long, default_value_t = 7)]
    find_runs: usize,
    /// Writes timed per watch arm.
    #[arg(long, default_value_t = 1_000)]
    watch_iters: usize,
    /// Round trips per exec/session arm.
    #[arg(long, default_value_t = 1_000)]
    exec_iters: usize,
    /// Directory for the socket and the trees.
    #[arg(long, default_value = "/tmp")]
    dir: PathBuf,
}

pub async fn run(args: VerbsArgs) -> anyhow::Result<()> {
    let me = std::env::current_exe()?;
    let silkd_bin = args.silkd.clone().unwrap_or_else(|| me.with_file_name("silkd"));
    let work = args.dir.join(format!("silkbench-verbs-{}", std::process::id()));
    std::fs::create_dir_all(&work)?;
    let result = sections(&args, &silkd_bin, &work).await;
    // Disk images of sandboxes a killed node left are still mounted.
    silk_engine::jail::unmount_under(&work);
    let _ = std::fs::remove_dir_all(&work);
    result
}

async fn sections(args: &VerbsArgs, silkd_bin: &Path, work: &Path) -> anyhow::Result<()> {
    let sock = work.join("silkd.sock");
    let _silkd = start(std::process::Command::new(silkd_bin).arg("--unix").arg(&sock))?;
    let mut silk = Connection::new(UnixStream::connect(&sock).await?);
    println!("## silkd verbs\n\n{}", host_stamp());
    find_table(args, work, &mut silk).await?;
    watch_table(args, work, &mut silk).await?;
    session_table(args, &mut silk).await
}

async fn find_table(
    args: &VerbsArgs,
    work: &Path,
    silk: &mut Connection<UnixStream>,
) -> anyhow::Result<()> {
    let tree = work.join("tree");
    let bytes = make_tree(&tree, args.files)?;
    let pattern = "needle_[0-9]+";
    let (mut grep, mut find) = (Samples::default(), Samples::default());
    let (mut grep_hits, mut find_hits) = (0, 0);
    // Interleaved, after one warm-up of each, so the page cache and drift treat both alike.
    for i in 0..=args.find_runs {
        let t = Instant::now();
        let out =
            std::process::Command::new("grep").args(["-rnIE", pattern]).arg(&tree).output()?;
        let d = t.elapsed();
        grep_hits = out.stdout.iter().filter(|&&b| b == b'\n').count();
        let t = Instant::now();
        find_hits = find_all(silk, &tree, pattern).await?;
        if i > 0 {
            grep.push(d);
            find.push(t.elapsed());
        }
    }
    anyhow::ensure!(grep_hits == find_hits, "grep found {grep_hits}, find {find_hits}");
    let ms = |d: Duration| format!("{:.1} ms", d.as_secs_f64() * 1e3);
    let ratio = find.pct(0.5).as_secs_f64() / grep.pct(0.5).as_secs_f64();
    table(
        &format!(
            "regex search over {} files ({:.1} MiB, page cache warm; median of {})",
            args.files,
            bytes as f64 / (1 << 20) as f64,
            find.len()
        ),
        &["arm", "p50", "max", "matches", "ratio"],
        &[
            vec![
                format!("`grep -rnIE '{pattern}'` (floor)"),
                ms(grep.pct(0.5)),
                ms(grep.pct(1.0)),
                grep_hits.to_string(),
                "1.00".into(),
            ],
            vec![
                "silkd `find` over the protocol".into(),
                ms(find.pct(0.5)),
                ms(find.pct(1.0)),
                find_hits.to_string(),
                format!("{ratio:.2}"),
            ],
        ],
    );
    Ok(())
}

/// 100 files per directory, each ~4 KiB of text with one matching line; returns the bytes.
fn make_tree(root: &Path, files: usize) -> anyhow::Result<u64> {
    let filler: String =
        (0..60).map(|i| format!("line {i:03} of ordinary text without the word\n")).collect();
    let mut bytes = 0;
    for i in 0..files {
        let dir = root.join(format!("d{:03}", i / 100));
        if i % 100 == 0 {
            std::fs::create_dir_all(&dir)?;
        }
        let body = format!("{filler}let needle_{i} = {i};\n{filler}");
        bytes += body.len() as u64;
        std::fs::write(dir.join(format!("f{i:05}.rs")), body)?;
    }
    Ok(bytes)
}

async fn find_all(
    c: &mut Connection<UnixStream>,
    tree: &Path,
    pattern: &str,
) -> anyhow::Result<usize> {
    c.send(&Frame::Find(FindRequest {
        path: tree.to_str().context("utf-8 path")?.into(),
        pattern: pattern.into(),
        glob: None,
        max_file_bytes: None,
        max_matches: None,
    }))
    .await?;
    let mut n = 0;
    loop {
        match c.recv().await?.context("closed")? {
            Frame::Matches(m) => n += m.len(),
            Frame::Done => return Ok(n),
            other => bail!("find ended with {}", other.name()),
        }
    }
}

async fn watch_table(
    args: &VerbsArgs,
    work: &Path,
    silk: &mut Connection<UnixStream>,
) -> anyhow::Result<()> {
    let dir = work.join("watched");
    std::fs::create_dir_all(&dir)?;
    // One `write` on a file kept open is exactly one IN_MODIFY (no truncate, no close events);
    // each is waited for before the next write, so the kernel never merges two.
    let mut file = std::fs::File::create(dir.join("f"))?;

    // Floor: this process's own inotify watch, read blocking right after the write.
    let floor = {
        // SAFETY: plain syscalls; results are checked.
        let fd = unsafe { libc::inotify_init1(libc::IN_CLOEXEC) };
        anyhow::ensure!(fd >= 0, "inotify_init1: {}", std::io::Error::last_os_error());
        // SAFETY: a fresh descriptor nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let path = std::ffi::CString::new(dir.to_str().context("utf-8 path")?)?;
        // SAFETY: a valid C string and our descriptor.
        let wd = unsafe { libc::inotify_add_watch(fd.as_raw_fd(), path.as_ptr(), libc::IN_MODIFY) };
        anyhow::ensure!(wd >= 0, "inotify_add_watch: {}", std::io::Error::last_os_error());
        let mut samples = Samples::default();
        let mut buf = [0u8; 4096];
        for i in 0..(args.watch_iters + 50) {
            let t = Instant::now();
            file.write_all(b"x")?;
            // SAFETY: reads into a valid buffer (blocking until the event is there).
            let n = unsafe { libc::read(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
            anyhow::ensure!(n > 0, "inotify read");
            if i >= 50 {
                samples.push(t.elapsed());
            }
        }
        samples
    };

    silk.send(&Frame::Watch(WatchRequest {
        path: dir.to_str().context("utf-8 path")?.into(),
        recursive: false,
    }))
    .await?;
    match silk.recv().await?.context("closed")? {
        Frame::Ready => {}
        other => bail!("watch answered {}", other.name()),
    }
    let mut samples = Samples::default();
    for i in 0..(args.watch_iters + 50) {
        let t = Instant::now();
        file.write_all(b"x")?;
        match silk.recv().await?.context("closed")? {
            Frame::Events(events) if events.len() == 1 => {}
            other => bail!("watch sent {}", other.name()),
        }
        if i >= 50 {
            samples.push(t.elapsed());
        }
    }
    silk.send(&Frame::Cancel).await?;
    until_terminal(silk).await?;
    table(
        &format!("write → event latency (n = {} per arm)", samples.len()),
        &["arm", "p50", "p90", "p50 ratio"],
        &[
            row("raw inotify read in-process (floor)", &floor, &floor),
            row("silkd `watch` event at the client", &samples, &floor),
        ],
    );
    Ok(())
}

async fn session_table(args: &VerbsArgs, silk: &mut Connection<UnixStream>) -> anyhow::Result<()> {
    silk.send(&Frame::SessionCreate(SessionRequest {
        id: Some("bench".into()),
        ..Default::default()
    }))
    .await?;
    until_terminal(silk).await?;
    let exec = Frame::Exec(ExecRequest {
        command: Command { argv: vec!["/bin/true".into()], ..Default::default() },
        ..Default::default()
    });
    let in_session = |script: &str| {
        Frame::SessionExec(SessionExecRequest {
            id: "bench".into(),
            script: script.into(),
            timeout_ms: None,
        })
    };
    let (builtin, forked) = (in_session(":"), in_session("/bin/true"));
    let (mut fork, mut plain, mut sess_builtin, mut sess_fork) =
        (Samples::default(), Samples::default(), Samples::default(), Samples::default());
    for i in 0..(args.exec_iters + 50) {
        let t = Instant::now();
        let status = std::process::Command::new("/bin/true").status()?;
        let d = t.elapsed();
        anyhow::ensure!(status.success());
        let keep = i >= 50;
        if keep {
            fork.push(d);
        }
        for (req, samples) in
            [(&exec, &mut plain), (&builtin, &mut sess_builtin), (&forked, &mut sess_fork)]
        {
            let t = Instant::now();
            silk.send(req).await?;
            match until_terminal(silk).await? {
                Frame::Exit(e) if e.code == 0 => {}
                other => bail!("{} ended with {}", req.name(), other.name()),
            }
            if keep {
                samples.push(t.elapsed());
            }
        }
    }
    table(
        &format!("exec round trips on a kept connection (n = {} per arm)", plain.len()),
        &["arm", "p50", "p90", "p50 ratio"],
        &[
            row("fork+exec+wait of /bin/true from Rust (floor)", &fork, &fork),
            row("silkd `exec /bin/true`", &plain, &fork),
            row("silkd `session_exec '/bin/true'`", &sess_fork, &fork),
            row("silkd `session_exec ':'` (shell builtin, no fork)", &sess_builtin, &fork),
        ],
    );
    Ok(())
}
