//! The lifecycle section: hibernate, wake, checkpoint, branch, fork ×8, archive and wake from
//! the archive on a throwaway sandboxd (jail engine, local-directory store), each on a sandbox
//! holding a freshly written tree of incompressible files (100 MiB by default); and the bytes a
//! second checkpoint uploads after a 1 MiB change. Every timed step, the floor included, starts
//! from a flushed disk (`sync`) but for the sandbox's own tree, which the hibernate that follows
//! its writing leaves to flush behind its answer (the jail's overlay is unmounted, and synced,
//! after the stop returns): the `sync` before the explicit wake waits for that flush.
//!
//! | measurement | floor beside it |
//! |---|---|
//! | every operation, request → answer over a kept HTTP connection | `tar` of an equal tree on the host to a file on the same disk, `sync`ed (what any snapshot of those bytes costs) |

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, ensure};

use crate::node::json;
use crate::node::{Http, NodeProc};
use crate::report::{Samples, host_stamp, ms, table};

#[derive(Debug, clap::Args)]
pub struct LifecycleArgs {
    /// A statically linked silkd (default: $SILKD_STATIC).
    #[arg(long, env = "SILKD_STATIC")]
    silkd: PathBuf,
    /// Rounds (each writes a new tree and runs every operation once).
    #[arg(long, default_value_t = 5)]
    iters: usize,
    /// The tree's size, in 1 MiB files.
    #[arg(long, default_value_t = 100)]
    tree_mib: usize,
    #[arg(long, default_value = "/var/tmp")]
    dir: PathBuf,
}

pub fn run(args: LifecycleArgs) -> anyhow::Result<()> {
    let work = args.dir.join(format!("silkbench-lifecycle-{}", std::process::id()));
    std::fs::create_dir_all(&work)?;
    let config = "[[pools]]\ntemplate = \"host\"\nwarm = 2\nwarm_max = 2\n";
    let result =
        NodeProc::start(&args.silkd, &work, config).and_then(|node| measure(&args, &node, &work));
    // Disk images of sandboxes a killed node left are still mounted.
    silk_engine::jail::unmount_under(&work);
    let _ = std::fs::remove_dir_all(&work);
    result
}

/// One API call that must answer `want`; returns its time and body.
pub(crate) fn timed(
    http: &mut Http,
    method: &str,
    path: &str,
    body: &str,
    want: u16,
) -> anyhow::Result<(std::time::Duration, serde_json::Value)> {
    let t = Instant::now();
    let (status, out) = http.call(method, path, body)?;
    let d = t.elapsed();
    ensure!(status == want, "{method} {path} answered {status}: {out}");
    Ok((d, json(&out)))
}

/// A buffered exec that must exit 0, served by the node asked; returns its stdout.
pub(crate) fn exec(http: &mut Http, id: &str, script: &str) -> anyhow::Result<String> {
    let body = serde_json::json!({ "argv": ["sh", "-c", script] }).to_string();
    let path = format!("/v1/sandboxes/{id}/exec?no_redirect=1");
    let (_, v) = timed(http, "POST", &path, &body, 200)?;
    ensure!(v["exit_code"] == 0, "{script}: {v}");
    Ok(v["stdout"].as_str().unwrap_or_default().trim().to_string())
}

/// The files-only variants: their floor is the tar (the memory-carrying ones are `silkbench
/// memory`'s, beside direct CRIU), and a node with CRIU would otherwise keep memory (`auto`).
const FILES_ONLY: &str = r#"{"memory": "off"}"#;

fn measure(args: &LifecycleArgs, node: &NodeProc, work: &std::path::Path) -> anyhow::Result<()> {
    println!("## lifecycle (sandboxd, jail engine, local store)\n\n{}", host_stamp());
    let mut http = Http::connect(node.addr)?;
    let write_tree = tree(args.tree_mib);
    let hash = "cd /srv/t && cat $(ls | sort) | sha256sum";
    let names = [
        "hibernate",
        "wake (explicit)",
        "checkpoint (source keeps running)",
        "branch the checkpoint",
        "fork ×8",
        "archive (running → store)",
        "wake from the archive",
        "exec after its silkd was killed (restart included)",
    ];
    let mut samples: Vec<Samples> = names.iter().map(|_| Samples::default()).collect();
    let mut floor = Samples::default();
    let mut second_upload = vec![];
    for _ in 0..args.iters {
        floor.push(tar_floor(work, args.tree_mib)?);

        let (_, s) = timed(&mut http, "POST", "/v1/sandboxes", "{}", 201)?;
        let id = s["id"].as_str().context("id")?.to_string();
        // Before the tree is written, not after: flushing it follows the hibernate.
        quiet()?;
        exec(&mut http, &id, &write_tree)?;
        let sum = exec(&mut http, &id, hash)?;
        let path = |verb: &str| format!("/v1/sandboxes/{id}/{verb}");

        let (d, _) = timed(&mut http, "POST", &path("hibernate"), FILES_ONLY, 200)?;
        samples[0].push(d);
        quiet()?;
        let (d, _) = timed(&mut http, "POST", &path("wake"), "", 200)?;
        samples[1].push(d);
        ensure!(exec(&mut http, &id, hash)? == sum, "files changed across hibernate");

        quiet()?;
        let (d, ck) = timed(&mut http, "POST", &path("checkpoint"), FILES_ONLY, 201)?;
        samples[2].push(d);
        let ck = ck["id"].as_str().context("checkpoint id")?.to_string();
        exec(&mut http, &id, "head -c 1048576 /dev/urandom > /srv/t/changed")?;
        let (_, ck2) = timed(&mut http, "POST", &path("checkpoint"), FILES_ONLY, 201)?;
        second_upload.push(ck2["uploaded_bytes"].as_u64().unwrap_or(0));

        quiet()?;
        let (d, b) = timed(&mut http, "POST", &format!("/v1/checkpoints/{ck}/claim"), "", 201)?;
        samples[3].push(d);
        let branch = b["id"].as_str().context("branch id")?.to_string();
        ensure!(exec(&mut http, &branch, hash)? == sum, "branch differs from the checkpoint");
        timed(&mut http, "DELETE", &format!("/v1/sandboxes/{branch}"), "", 204)?;

        quiet()?;
        let (d, kids) =
            timed(&mut http, "POST", &path("fork"), r#"{"count": 8, "memory": "off"}"#, 201)?;
        samples[4].push(d);
        for k in kids["sandboxes"].as_array().context("fork answer")? {
            let kid = k["id"].as_str().context("child id")?;
            timed(&mut http, "DELETE", &format!("/v1/sandboxes/{kid}"), "", 204)?;
        }

        quiet()?;
        let (d, _) = timed(&mut http, "POST", &path("archive"), FILES_ONLY, 200)?;
        samples[5].push(d);
        quiet()?;
        let (d, _) = timed(&mut http, "POST", &path("wake"), "", 200)?;
        samples[6].push(d);
        exec(&mut http, &id, "rm /srv/t/changed")?;
        ensure!(exec(&mut http, &id, hash)? == sum, "files changed across archive");

        // Its silkd dies (as in an OOM kill): the next exec restarts it on its files.
        kill_silkd(work, &id)?;
        let body = serde_json::json!({ "argv": ["true"] }).to_string();
        quiet()?;
        let (d, _) = timed(&mut http, "POST", &path("exec"), &body, 200)?;
        samples[7].push(d);
        ensure!(exec(&mut http, &id, hash)? == sum, "files changed across a restart");

        for c in [ck, ck2["id"].as_str().unwrap_or_default().to_string()] {
            timed(&mut http, "DELETE", &format!("/v1/checkpoints/{c}"), "", 204)?;
        }
        timed(&mut http, "DELETE", &format!("/v1/sandboxes/{id}"), "", 204)?;
    }
    let ratio =
        |s: &Samples| format!("{:.2}", s.pct(0.5).as_secs_f64() / floor.pct(0.5).as_secs_f64());
    let mut rows = vec![vec![
        format!("`tar` {} MiB tree to a file + sync (floor)", args.tree_mib),
        ms(floor.pct(0.5)),
        ms(floor.pct(1.0)),
        "1.00".into(),
    ]];
    for (name, s) in names.iter().zip(&samples) {
        rows.push(vec![name.to_string(), ms(s.pct(0.5)), ms(s.pct(1.0)), ratio(s)]);
    }
    table(
        &format!(
            "lifecycle operations on a sandbox with a {} MiB written tree (n = {})",
            args.tree_mib, args.iters
        ),
        &["operation", "p50", "max", "p50 / floor"],
        &rows,
    );
    second_upload.sort_unstable();
    let median = second_upload[second_upload.len() / 2];
    table(
        "a second checkpoint of the same sandbox after a 1 MiB change",
        &["tree", "uploaded (median)", "of the tree"],
        &[vec![
            format!("{} MiB", args.tree_mib),
            format!("{:.2} MiB", median as f64 / (1 << 20) as f64),
            format!("{:.1} %", 100.0 * median as f64 / (args.tree_mib << 20) as f64),
        ]],
    );
    Ok(())
}

/// SIGKILLs sandbox `id`'s silkd (its jail's PID 1, so the whole jail goes) and waits until the
/// engine would see it dead (the process gone or a zombie).
fn kill_silkd(work: &std::path::Path, id: &str) -> anyhow::Result<()> {
    let dir = work.join("data/engine/boxes").join(id);
    let record: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.join("box.json"))?)?;
    let pid = record["info"]["pid"].as_i64().context("the box's pid")? as i32;
    // SAFETY: plain syscall on the jail's init, which this bench's node started.
    unsafe { libc::kill(pid, libc::SIGKILL) };
    let deadline = Instant::now() + std::time::Duration::from_secs(5);
    // Gone or a zombie, as the engine tells a dead jail from a live one.
    let alive = || {
        std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
            s.rsplit_once(')').is_some_and(|(_, rest)| !rest.trim_start().starts_with('Z'))
        })
    };
    while alive() {
        ensure!(Instant::now() < deadline, "silkd {pid} still accepts after SIGKILL");
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    Ok(())
}

/// A shell script writing `mib` 1 MiB files of noise under /srv/t (run in a sandbox).
pub(crate) fn tree(mib: usize) -> String {
    format!(
        "mkdir -p /srv/t && i=0; while [ $i -lt {mib} ]; do head -c 1048576 /dev/urandom > /srv/t/f$i; i=$((i+1)); done"
    )
}

/// Flushes every dirty page before a timed step, so no step pays for the writeback of the one
/// before it (fork ×8 leaves 800 MiB behind it, the archive after it met that flush).
pub(crate) fn quiet() -> anyhow::Result<()> {
    ensure!(std::process::Command::new("sync").status()?.success(), "sync failed");
    Ok(())
}

/// The floor beside every operation on a written tree: an equal tree written on the host,
/// then timed: `tar` of it to a file on the same disk, synced.
pub(crate) fn tar_floor(work: &std::path::Path, mib: usize) -> anyhow::Result<std::time::Duration> {
    let dir = work.join("floor");
    std::fs::create_dir_all(&dir)?;
    let script = format!(
        "cd {d} && i=0; while [ $i -lt {mib} ]; do head -c 1048576 /dev/urandom > f$i; i=$((i+1)); done",
        d = dir.display()
    );
    ensure!(std::process::Command::new("sh").arg("-c").arg(&script).status()?.success());
    quiet()?;
    let t = Instant::now();
    let tar = format!(
        "tar -C {} -cf {w}/floor.tar . && sync {w}/floor.tar",
        dir.display(),
        w = work.display()
    );
    ensure!(std::process::Command::new("sh").arg("-c").arg(&tar).status()?.success());
    let d = t.elapsed();
    std::fs::remove_dir_all(&dir)?;
    std::fs::remove_file(work.join("floor.tar"))?;
    Ok(d)
}
