//! The agent section: silkd over a kept unix-socket connection.
//!
//! | measurement | floor beside it |
//! |---|---|
//! | `info` round trip | 8-byte echo round trip to a tokio echo server in its own process |
//! | `exec true` round trip | `fork+exec` of `/bin/true` from a Rust loop |
//! | 1 GiB `read` | `cat file > /dev/null` |

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use silk_engine::AgentAddr;
use silk_proto::{Command, Connection, ExecRequest, Frame, ReadRequest};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{UnixListener, UnixStream};

use crate::lifecycle::quiet;
use crate::report::{Samples, host_stamp, table, us};

#[derive(Debug, clap::Args)]
pub struct AgentArgs {
    /// The silkd binary (default: next to this one).
    #[arg(long)]
    silkd: Option<PathBuf>,
    /// Round trips per arm for `info`.
    #[arg(long, default_value_t = 20_000)]
    rtt_iters: usize,
    /// Round trips per arm for `exec true`.
    #[arg(long, default_value_t = 1_000)]
    exec_iters: usize,
    /// Size of the read-throughput file, MiB.
    #[arg(long, default_value_t = 1024)]
    read_mib: usize,
    /// Files in the pull/push tree.
    #[arg(long, default_value_t = 10_000)]
    tree_files: usize,
    /// Directory for the socket and the test file.
    #[arg(long, default_value = "/tmp")]
    dir: PathBuf,
}

/// A child process killed on drop.
pub struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

pub fn start(cmd: &mut std::process::Command) -> anyhow::Result<Proc> {
    let mut child = cmd.stdout(Stdio::piped()).spawn().context("start process")?;
    let mut line = String::new();
    BufReader::new(child.stdout.take().context("stdout")?).read_line(&mut line)?;
    if line.is_empty() {
        bail!("process exited before it was ready");
    }
    Ok(Proc(child))
}

pub async fn run(args: AgentArgs) -> anyhow::Result<()> {
    let me = std::env::current_exe()?;
    let silkd_bin = args.silkd.clone().unwrap_or_else(|| me.with_file_name("silkd"));
    let work = args.dir.join(format!("silkbench-{}", std::process::id()));
    std::fs::create_dir_all(&work)?;
    let result = sections(&args, &me, &silkd_bin, &work).await;
    let _ = std::fs::remove_dir_all(&work);
    result
}

async fn sections(
    args: &AgentArgs,
    me: &Path,
    silkd_bin: &Path,
    work: &Path,
) -> anyhow::Result<()> {
    let silkd_sock = work.join("silkd.sock");
    let echo_sock = work.join("echo.sock");
    let _silkd = start(std::process::Command::new(silkd_bin).arg("--unix").arg(&silkd_sock))?;
    let _echo = start(std::process::Command::new(me).arg("echo-server").arg(&echo_sock))?;

    println!("## silkd agent\n\n{}", host_stamp());

    // info vs echo, interleaved in blocks so drift hits both arms alike.
    // Dialled as the node dials a sandbox's silkd (its socket options included).
    let dialled = silk_engine::agent::try_connect(&AgentAddr::Unix(silkd_sock.clone()))?;
    let mut silk = Connection::new(UnixStream::from_std(dialled)?);
    let mut echo = UnixStream::connect(&echo_sock).await?;
    let (mut info, mut floor) = (Samples::default(), Samples::default());
    let block = 1000.min(args.rtt_iters);
    // Blocks in A B B A order, so drift over the run weighs on both arms alike.
    for round in 0..=(args.rtt_iters / block) {
        let warmup = round == 0;
        for arm in if round % 2 == 0 { [0, 1] } else { [1, 0] } {
            for _ in 0..block {
                let t = Instant::now();
                if arm == 0 {
                    echo_once(&mut echo).await?;
                } else {
                    info_once(&mut silk).await?;
                }
                if !warmup {
                    if arm == 0 { &mut floor } else { &mut info }.push(t.elapsed());
                }
            }
        }
    }
    table(
        &format!("`info` round trip on a kept unix-socket connection (n = {} per arm)", info.len()),
        &["arm", "p50", "p90", "p50 ratio"],
        &[row("raw unix-socket echo (floor)", &floor, &floor), row("silkd `info`", &info, &floor)],
    );

    // exec true vs fork+exec.
    let (mut exec, mut fork) = (Samples::default(), Samples::default());
    let req = Frame::Exec(ExecRequest {
        command: Command { argv: vec!["/bin/true".into()], ..Default::default() },
        ..Default::default()
    });
    for i in 0..(args.exec_iters + 50) {
        // A B B A: the arm that goes first alternates.
        let (mut d_fork, mut d_exec) = (Duration::ZERO, Duration::ZERO);
        for arm in if i % 2 == 0 { [0, 1] } else { [1, 0] } {
            let t = Instant::now();
            if arm == 0 {
                anyhow::ensure!(std::process::Command::new("/bin/true").status()?.success());
                d_fork = t.elapsed();
            } else {
                exec_once(&mut silk, &req).await?;
                d_exec = t.elapsed();
            }
        }
        if i >= 50 {
            fork.push(d_fork);
            exec.push(d_exec);
        }
    }
    table(
        &format!("`exec /bin/true` round trip (n = {} per arm)", exec.len()),
        &["arm", "p50", "p90", "p50 ratio"],
        &[row("fork+exec+wait from Rust (floor)", &fork, &fork), row("silkd `exec`", &exec, &fork)],
    );

    // 1 GiB read vs cat.
    let file = work.join("read.bin");
    write_file(&file, args.read_mib)?;
    let bytes = (args.read_mib as u64) << 20;
    let (mut cat_best, mut read_best) = (Duration::MAX, Duration::MAX);
    for _ in 0..3 {
        let t = Instant::now();
        let status = std::process::Command::new("sh")
            .arg("-c")
            .arg(format!("cat '{}' > /dev/null", file.display()))
            .status()?;
        anyhow::ensure!(status.success());
        cat_best = cat_best.min(t.elapsed());
        let t = Instant::now();
        let got = read_all(&mut silk, &file).await?;
        read_best = read_best.min(t.elapsed());
        anyhow::ensure!(got == bytes, "read {got} of {bytes} bytes");
    }
    let mibs = |d: Duration| bytes as f64 / (1 << 20) as f64 / d.as_secs_f64();
    table(
        &format!("reading a {} MiB file (page cache warm, best of 3)", args.read_mib),
        &["arm", "time", "MiB/s", "ratio"],
        &[
            vec![
                "`cat file > /dev/null` (floor)".into(),
                format!("{:.0} ms", cat_best.as_secs_f64() * 1e3),
                format!("{:.0}", mibs(cat_best)),
                "1.00".into(),
            ],
            vec![
                "silkd `read` over the protocol".into(),
                format!("{:.0} ms", read_best.as_secs_f64() * 1e3),
                format!("{:.0}", mibs(read_best)),
                format!("{:.2}", mibs(read_best) / mibs(cat_best)),
            ],
        ],
    );

    // Writing the same bytes, beside `cat file > dest` on the same filesystem.
    let content = bytes::Bytes::from(std::fs::read(&file)?);
    let dest = work.join("written.bin");
    let (mut cp_best, mut write_best) = (Duration::MAX, Duration::MAX);
    // Each arm from a flushed disk: otherwise an arm pays for the writeback of the gigabyte the
    // arm before it wrote, and which arm that is decides the ratio.
    for _ in 0..3 {
        quiet()?;
        let t = Instant::now();
        let status = std::process::Command::new("sh")
            .arg("-c")
            .arg(format!("cat '{}' > '{}'", file.display(), dest.display()))
            .status()?;
        anyhow::ensure!(status.success());
        cp_best = cp_best.min(t.elapsed());
        std::fs::remove_file(&dest)?;
        quiet()?;
        let t = Instant::now();
        write_all(&mut silk, &dest, &content).await?;
        write_best = write_best.min(t.elapsed());
        std::fs::remove_file(&dest)?;
    }
    drop(content);
    table(
        &format!("writing a {} MiB file (best of 3)", args.read_mib),
        &["arm", "time", "MiB/s", "ratio"],
        &[
            throughput_row("`cat file > dest` (floor)", cp_best, bytes, cp_best),
            throughput_row("silkd `write` over the protocol (atomic)", write_best, bytes, cp_best),
        ],
    );

    // A 10 000-file tree: pull beside `tar -c | cat`, push beside `tar -x`.
    let tree = work.join("tree");
    let tree_bytes = make_tree(&tree, args.tree_files)?;
    let tar_cmd = format!("tar -C '{}' -cf - . | cat > /dev/null", tree.display());
    let (mut tar_best, mut pull_best, mut pulled) = (Duration::MAX, Duration::MAX, Vec::new());
    for _ in 0..3 {
        let t = Instant::now();
        anyhow::ensure!(
            std::process::Command::new("sh").arg("-c").arg(&tar_cmd).status()?.success()
        );
        tar_best = tar_best.min(t.elapsed());
        let t = Instant::now();
        pulled = pull_all(&mut silk, &tree).await?;
        pull_best = pull_best.min(t.elapsed());
    }
    // The trees stay until every arm has run: on this disk (ext4 without a journal) a new
    // inode skips those deleted in the last minute or more, one inode-table read each, so an
    // arm right after a deleted tree of 10 000 files took 1.5–2.7 s where the same arm took
    // 0.19 s otherwise, whichever arm it was.
    let mut made = vec![];
    let (mut untar_best, mut push_best) = (Duration::MAX, Duration::MAX);
    for i in 0..3 {
        let into = work.join(format!("untar{i}"));
        std::fs::create_dir(&into)?;
        let mut child = std::process::Command::new("tar")
            .arg("-C")
            .arg(&into)
            .arg("-xf")
            .arg("-")
            .stdin(std::process::Stdio::piped())
            .spawn()?;
        quiet()?;
        let t = Instant::now();
        child.stdin.take().context("stdin")?.write_all(&pulled)?;
        anyhow::ensure!(child.wait()?.success());
        untar_best = untar_best.min(t.elapsed());
        made.push(into);
        let into = work.join(format!("pushed{i}"));
        quiet()?;
        let t = Instant::now();
        push_all(&mut silk, &into, &pulled).await?;
        push_best = push_best.min(t.elapsed());
        made.push(into);
    }
    for dir in made {
        std::fs::remove_dir_all(dir)?;
    }
    table(
        &format!(
            "a {}-file tree ({:.1} MiB of content; best of 3)",
            args.tree_files,
            tree_bytes as f64 / (1 << 20) as f64
        ),
        &["arm", "time", "MiB/s", "ratio"],
        &[
            throughput_row("`tar -c | cat` (floor for pull)", tar_best, tree_bytes, tar_best),
            throughput_row(
                "silkd `pull` (tar stream over the protocol)",
                pull_best,
                tree_bytes,
                tar_best,
            ),
            throughput_row("`tar -x` (floor for push)", untar_best, tree_bytes, untar_best),
            throughput_row(
                "silkd `push` (staged, merged after a clean end)",
                push_best,
                tree_bytes,
                untar_best,
            ),
        ],
    );
    Ok(())
}

fn throughput_row(name: &str, d: Duration, bytes: u64, floor: Duration) -> Vec<String> {
    let mibs = |d: Duration| bytes as f64 / (1 << 20) as f64 / d.as_secs_f64();
    vec![
        name.into(),
        format!("{:.0} ms", d.as_secs_f64() * 1e3),
        format!("{:.0}", mibs(d)),
        format!("{:.2}", mibs(d) / mibs(floor)),
    ]
}

/// `n` files of 1–8 KiB in 100 directories; returns the content bytes.
fn make_tree(root: &Path, n: usize) -> anyhow::Result<u64> {
    let mut total = 0;
    for i in 0..n {
        let dir = root.join(format!("d{:02}", i % 100));
        std::fs::create_dir_all(&dir)?;
        let len = 1024 + (i * 7919) % 7168;
        std::fs::write(dir.join(format!("f{i}.txt")), vec![b'a' + (i % 26) as u8; len])?;
        total += len as u64;
    }
    Ok(total)
}

async fn write_all(
    c: &mut Connection<UnixStream>,
    path: &Path,
    content: &bytes::Bytes,
) -> anyhow::Result<()> {
    let path = path.to_str().context("utf-8 path")?.to_string();
    c.queue(&Frame::Write(silk_proto::WriteRequest { path, mode: None, parents: false }))?;
    // Slices of the caller's buffer, as the SDK sends them: no copy before the socket's.
    let mut at = 0;
    while at < content.len() {
        let end = (at + silk_proto::DATA_CHUNK).min(content.len());
        c.send(&Frame::Data(content.slice(at..end))).await?;
        at = end;
    }
    c.send(&Frame::Eof).await?;
    anyhow::ensure!(until_terminal(c).await? == Frame::Done, "write failed");
    Ok(())
}

async fn pull_all(c: &mut Connection<UnixStream>, path: &Path) -> anyhow::Result<Vec<u8>> {
    let path = path.to_str().context("utf-8 path")?.to_string();
    c.send(&Frame::Pull { path }).await?;
    let mut out = Vec::new();
    loop {
        match c.recv().await?.context("closed")? {
            Frame::Data(b) => out.extend_from_slice(&b),
            Frame::Done => return Ok(out),
            other => bail!("pull ended with {}", other.name()),
        }
    }
}

async fn push_all(c: &mut Connection<UnixStream>, path: &Path, tar: &[u8]) -> anyhow::Result<()> {
    let path = path.to_str().context("utf-8 path")?.to_string();
    c.queue(&Frame::Push { path })?;
    for chunk in tar.chunks(silk_proto::DATA_CHUNK) {
        c.send(&Frame::Data(bytes::Bytes::copy_from_slice(chunk))).await?;
    }
    c.send(&Frame::Eof).await?;
    anyhow::ensure!(until_terminal(c).await? == Frame::Done, "push failed");
    Ok(())
}

pub fn row(name: &str, s: &Samples, floor: &Samples) -> Vec<String> {
    let ratio = s.pct(0.5).as_secs_f64() / floor.pct(0.5).as_secs_f64();
    vec![name.into(), us(s.pct(0.5)), us(s.pct(0.9)), format!("{ratio:.2}")]
}

async fn echo_once(s: &mut UnixStream) -> anyhow::Result<()> {
    let mut buf = [0u8; 8];
    s.write_all(&[1; 8]).await?;
    s.read_exact(&mut buf).await?;
    Ok(())
}

async fn info_once(c: &mut Connection<UnixStream>) -> anyhow::Result<()> {
    c.send(&Frame::Info).await?;
    until_terminal(c).await.map(|_| ())
}

async fn exec_once(c: &mut Connection<UnixStream>, req: &Frame) -> anyhow::Result<()> {
    c.send(req).await?;
    match until_terminal(c).await? {
        Frame::Exit(e) if e.code == 0 => Ok(()),
        other => bail!("exec ended with {other:?}"),
    }
}

async fn read_all(c: &mut Connection<UnixStream>, path: &Path) -> anyhow::Result<u64> {
    let path = path.to_str().context("utf-8 path")?.to_string();
    c.send(&Frame::Read(ReadRequest { path, offset: 0, len: None })).await?;
    let mut n = 0u64;
    loop {
        match c.recv().await?.context("closed")? {
            Frame::Data(b) => n += b.len() as u64,
            Frame::Done => return Ok(n),
            other => bail!("read ended with {}", other.name()),
        }
    }
}

pub async fn until_terminal(c: &mut Connection<UnixStream>) -> anyhow::Result<Frame> {
    loop {
        let f = c.recv().await?.context("silkd closed the connection")?;
        if f.is_terminal() {
            return Ok(f);
        }
    }
}

fn write_file(path: &Path, mib: usize) -> anyhow::Result<()> {
    let block: Vec<u8> = (0..1u32 << 20).map(|i| (i.wrapping_mul(2654435761) >> 7) as u8).collect();
    let mut f = std::io::BufWriter::new(std::fs::File::create(path)?);
    for _ in 0..mib {
        f.write_all(&block)?;
    }
    f.flush()?;
    Ok(())
}

/// The floor's server: echoes whatever arrives, on a tokio runtime like silkd's.
pub async fn echo_server(socket: PathBuf) -> anyhow::Result<()> {
    let _ = std::fs::remove_file(&socket);
    let listener = UnixListener::bind(&socket)?;
    println!("ready");
    std::io::stdout().flush()?;
    loop {
        let (mut s, _) = listener.accept().await?;
        tokio::spawn(async move {
            let mut buf = [0u8; 4096];
            while let Ok(n) = s.read(&mut buf).await {
                if n == 0 || s.write_all(&buf[..n]).await.is_err() {
                    return;
                }
            }
        });
    }
}
