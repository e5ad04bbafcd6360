//! The memory section: lifecycle operations that keep processes (CRIU) on a throwaway sandboxd,
//! for a small sandbox (a shell counting in a loop and `python3 -m http.server`) and one whose
//! process holds 256 MiB of touched anonymous memory, beside the same operations keeping files
//! only, and beside CRIU run directly on an equal process tree on the host (the floor: what a
//! dump and a restore of those processes cost with no jail, no node and no snapshot around them).
//!
//! | measurement | floor beside it |
//! |---|---|
//! | hibernate (memory), checkpoint and its freeze window, archive | `criu dump` of an equal tree |
//! | wake (memory), branch (on the node that took the checkpoint, and on a second node through the store), fork ×4 (per child), wake from the archive | `criu restore` of that dump |
//!
//! A move carries memory the same way between two nodes: `silkbench cluster`.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};

use crate::lifecycle::{exec, timed};
use crate::node::{Http, NodeProc};
use crate::report::{Samples, host_stamp, ms, table};

#[derive(Debug, clap::Args)]
pub struct MemoryArgs {
    /// A statically linked silkd (default: $SILKD_STATIC).
    #[arg(long, env = "SILKD_STATIC")]
    silkd: PathBuf,
    /// Rounds per kind of sandbox.
    #[arg(long, default_value_t = 5)]
    iters: usize,
    /// The big sandbox's touched memory, in MiB.
    #[arg(long, default_value_t = 256)]
    mib: usize,
    #[arg(long, default_value = "/var/tmp")]
    dir: PathBuf,
    /// The CRIU binary for the floor.
    #[arg(long, default_value = "/usr/local/sbin/criu")]
    criu: PathBuf,
}

/// The processes of each kind: (name, script started in the background, how to tell it ready).
pub(crate) fn kinds(mib: usize) -> [(String, String, &'static str); 2] {
    let counter = "sh -c 'i=0; while :; do i=$((i+1)); echo $i > /tmp/count; sleep 0.05; done'";
    let server = "python3 -m http.server 8000 --bind 127.0.0.1";
    let big = format!(
        "python3 -c \"import time; b = bytearray({mib} << 20); \
         [b.__setitem__(i, 1) for i in range(0, len(b), 4096)]; open('/tmp/ready', 'w'); \
         time.sleep(86400)\""
    );
    [
        (
            "shell + python http.server".to_string(),
            format!("{counter} >/dev/null 2>&1 & {server} >/dev/null 2>&1 & echo"),
            "python3 -c \"import urllib.request as u; u.urlopen('http://127.0.0.1:8000/')\"",
        ),
        (
            format!("python holding {mib} MiB"),
            format!("{big} >/dev/null 2>&1 & echo"),
            "test -e /tmp/ready",
        ),
    ]
}

pub fn run(args: MemoryArgs) -> anyhow::Result<()> {
    let work = args.dir.join(format!("silkbench-memory-{}", std::process::id()));
    std::fs::create_dir_all(&work)?;
    // The host template's warmup starts an interpreter with its imports loaded; the large
    // size's pool (no warm sandboxes: every claim clones) keeps it in a memory golden.
    // A second node on the same store branches the checkpoints the first takes: a branch
    // through the store, beside one from the copy the first node keeps.
    let config = format!(
        "[[pools]]\ntemplate = \"host\"\nwarm = 2\nwarm_max = 2\n\
         [[pools]]\ntemplate = \"host\"\nsize = \"large\"\nwarm = 0\nmemory_golden = true\n\
         [templates.host]\nwarmup = [\"sh\", \"-c\", '''{PYTHON}''']\n\
         [store.fs]\nroot = \"{}\"\n",
        work.join("store").display()
    );
    let config = config.as_str();
    let result = (|| {
        let node = NodeProc::start(&args.silkd, &work, config)?;
        std::fs::create_dir_all(work.join("other"))?;
        let other = NodeProc::start(&args.silkd, &work.join("other"), config)?;
        measure(&args, &node, &other, &work)
    })();
    silk_engine::jail::unmount_under(&work);
    let _ = std::fs::remove_dir_all(&work);
    result
}

/// A Python interpreter that imports a set of stdlib modules, says so in /dev/shm (a tmpfs: kept
/// with its memory, not among the files a files golden keeps) and waits; started in the
/// background, and ready once the file is there.
const PYTHON: &str = "python3 -c \"import asyncio, json, email.parser, http.server, \
                      urllib.request, decimal, sqlite3, xml.etree.ElementTree, unittest, \
                      argparse, logging, ssl, statistics, time; open('/dev/shm/imported', 'w'); \
                      time.sleep(86400)\" >/dev/null 2>&1 & \
                      until test -e /dev/shm/imported; do sleep 0.01; done";

/// Each operation of a round, in order, and whether its floor is the dump (else the restore).
const OPERATIONS: [(&str, bool); 12] = [
    ("hibernate, memory", true),
    ("wake, memory", false),
    ("checkpoint, memory", true),
    ("the checkpoint's freeze window (its `freeze_ms`)", true),
    ("branch the checkpoint on its node (from the copy kept there), memory", false),
    ("branch the checkpoint on another node (through the store), memory", false),
    ("fork ×4, memory (per child)", false),
    ("archive, memory", true),
    ("wake from the archive, memory", false),
    ("hibernate, files only", true),
    ("wake, files only (processes restart)", false),
    ("checkpoint, files only", true),
];

fn measure(
    args: &MemoryArgs,
    node: &NodeProc,
    other: &NodeProc,
    work: &Path,
) -> anyhow::Result<()> {
    println!("## memory (CRIU on the jail engine)\n\n{}", host_stamp());
    let mut http = Http::connect(node.addr)?;
    let mut elsewhere = Http::connect(other.addr)?;
    // Its golden built before its first branch is timed.
    crate::node::wait_warm_for(&mut elsewhere, 2, Duration::from_secs(120))?;
    for (kind, script, ready) in kinds(args.mib) {
        let mut samples: Vec<Samples> = OPERATIONS.iter().map(|_| Samples::default()).collect();
        let (mut dump_floor, mut restore_floor) = (Samples::default(), Samples::default());
        let mut shared = vec![];
        for _ in 0..args.iters {
            let (d, r) = criu_floor(&args.criu, work, &script, ready)?;
            dump_floor.push(d);
            restore_floor.push(r);
            one_round(&mut http, &mut elsewhere, &script, ready, &mut samples, &mut shared)?;
        }
        shared.sort_by(f64::total_cmp);
        let dedup = shared[shared.len() / 2];
        let mut rows = vec![
            vec![
                "`criu dump` of an equal tree (floor)".into(),
                ms(dump_floor.pct(0.5)),
                "1.00".into(),
            ],
            vec!["`criu restore` of it (floor)".into(), ms(restore_floor.pct(0.5)), "1.00".into()],
        ];
        for ((name, dump), s) in OPERATIONS.iter().zip(&samples) {
            let floor = if *dump { &dump_floor } else { &restore_floor };
            let ratio = s.pct(0.5).as_secs_f64() / floor.pct(0.5).as_secs_f64();
            rows.push(vec![name.to_string(), ms(s.pct(0.5)), format!("{ratio:.2}")]);
        }
        table(
            &format!("{kind} (n = {}, p50; ratios to the dump or restore floor)", args.iters),
            &["operation", "p50", "ratio"],
            &rows,
        );
        println!(
            "A second checkpoint of it right after the first: {:.1} % of its bytes (memory image \
             and files) were already in the store (median).\n",
            100.0 * dedup
        );
    }
    memory_golden(&mut http, args.iters)
}

/// A claim that clones the memory golden (its interpreter running, imports loaded) until a
/// command sees it, beside a claim that clones the files golden and then starts the
/// interpreter (boot + warmup).
fn memory_golden(http: &mut Http, iters: usize) -> anyhow::Result<()> {
    let delete = |http: &mut Http, v: &serde_json::Value| {
        let id = v["id"].as_str().unwrap_or_default();
        timed(http, "DELETE", &format!("/v1/sandboxes/{id}"), "", 204).map(drop)
    };
    // The large size's first claim boots and has its memory golden built behind it.
    let (_, first) = timed(http, "POST", "/v1/sandboxes", r#"{"size": "large"}"#, 201)?;
    delete(http, &first)?;
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let (_, info) = timed(http, "GET", "/v1/info", "", 200)?;
        let pools = info["pools"].as_array().cloned().unwrap_or_default();
        if pools.iter().any(|p| p["size"] == "large" && p["golden"].is_string()) {
            break;
        }
        ensure!(Instant::now() < deadline, "no memory golden after 300 s: {info}");
        std::thread::sleep(Duration::from_millis(100));
    }
    let (mut from_memory, mut from_files) = (Samples::default(), Samples::default());
    for _ in 0..iters {
        let t = Instant::now();
        let (_, s) = timed(http, "POST", "/v1/sandboxes", r#"{"size": "large"}"#, 201)?;
        ensure!(s["tier"] == "clone" && s["memory_snapshot"] == true, "{s}");
        exec(http, s["id"].as_str().unwrap_or_default(), "test -e /dev/shm/imported")?;
        from_memory.push(t.elapsed());
        delete(http, &s)?;
        let t = Instant::now();
        let (_, s) = timed(http, "POST", "/v1/sandboxes", r#"{"size": "medium"}"#, 201)?;
        exec(http, s["id"].as_str().unwrap_or_default(), PYTHON)?;
        from_files.push(t.elapsed());
        delete(http, &s)?;
    }
    let ratio = from_memory.pct(0.5).as_secs_f64() / from_files.pct(0.5).as_secs_f64();
    table(
        &format!(
            "clone → python with its imports loaded (n = {iters}, p50; ratio to boot + warmup)"
        ),
        &["path", "p50", "ratio"],
        &[
            vec![
                "clone of the files golden, then start python (boot + warmup)".into(),
                ms(from_files.pct(0.5)),
                "1.00".into(),
            ],
            vec![
                "clone of the memory golden (python already running)".into(),
                ms(from_memory.pct(0.5)),
                format!("{ratio:.2}"),
            ],
        ],
    );
    Ok(())
}

/// A script that waits up to 30 s for `ready` to pass inside the sandbox.
pub(crate) fn until_ready(ready: &str) -> String {
    format!("for i in $(seq 300); do {ready} 2>/dev/null && exit 0; sleep 0.1; done; exit 1")
}

/// One sandbox through every operation; appends to `samples` in `OPERATIONS` order.
fn one_round(
    http: &mut Http,
    elsewhere: &mut Http,
    script: &str,
    ready: &str,
    samples: &mut [Samples],
    shared: &mut Vec<f64>,
) -> anyhow::Result<()> {
    let (_, s) = timed(http, "POST", "/v1/sandboxes", r#"{"size": "medium"}"#, 201)?;
    let id = s["id"].as_str().context("id")?.to_string();
    let path = |verb: &str| format!("/v1/sandboxes/{id}/{verb}");
    exec(http, &id, script)?;
    exec(http, &id, &until_ready(ready))?;
    let kept = |v: &serde_json::Value| v["memory_snapshot"].as_bool() == Some(true);
    let auto = r#"{"memory": "required"}"#;

    let (d, v) = timed(http, "POST", &path("hibernate"), auto, 200)?;
    ensure!(kept(&v), "hibernate kept no memory: {v}");
    samples[0].push(d);
    let (d, v) = timed(http, "POST", &path("wake"), "", 200)?;
    ensure!(kept(&v), "wake restored no memory: {v}");
    samples[1].push(d);
    let (d, ck) = timed(http, "POST", &path("checkpoint"), auto, 201)?;
    samples[2].push(d);
    samples[3].push(Duration::from_millis(ck["freeze_ms"].as_u64().context("freeze_ms")?));
    let ck = ck["id"].as_str().context("checkpoint id")?.to_string();
    // A second image of the same processes a moment later: what the store already had of it.
    let (_, again) = timed(http, "POST", &path("checkpoint"), auto, 201)?;
    let (bytes, sent) = (again["bytes"].as_u64().unwrap_or(0), again["uploaded_bytes"].as_u64());
    shared.push(1.0 - sent.unwrap_or(bytes) as f64 / bytes.max(1) as f64);
    timed(
        http,
        "DELETE",
        &format!("/v1/checkpoints/{}", again["id"].as_str().unwrap_or("")),
        "",
        204,
    )?;
    let (d, b) = timed(http, "POST", &format!("/v1/checkpoints/{ck}/claim"), auto, 201)?;
    samples[4].push(d);
    let branch = b["id"].as_str().context("branch id")?.to_string();
    exec(http, &branch, ready).context("the branch's processes")?;
    timed(http, "DELETE", &format!("/v1/sandboxes/{branch}"), "", 204)?;
    let (d, b) = timed(elsewhere, "POST", &format!("/v1/checkpoints/{ck}/claim"), auto, 201)?;
    samples[5].push(d);
    let branch = b["id"].as_str().context("branch id")?.to_string();
    exec(elsewhere, &branch, ready).context("the other node's branch's processes")?;
    timed(elsewhere, "DELETE", &format!("/v1/sandboxes/{branch}"), "", 204)?;
    let body = r#"{"count": 4, "memory": "required"}"#;
    let (d, kids) = timed(http, "POST", &path("fork"), body, 201)?;
    samples[6].push(d / 4);
    for k in kids["sandboxes"].as_array().context("fork answer")? {
        let kid = k["id"].as_str().context("child id")?;
        timed(http, "DELETE", &format!("/v1/sandboxes/{kid}"), "", 204)?;
    }
    let (d, v) = timed(http, "POST", &path("archive"), auto, 200)?;
    ensure!(kept(&v), "archive kept no memory: {v}");
    samples[7].push(d);
    let (d, v) = timed(http, "POST", &path("wake"), "", 200)?;
    ensure!(kept(&v), "the wake from the archive restored no memory: {v}");
    samples[8].push(d);
    exec(http, &id, ready).context("the processes woken from the archive")?;
    let off = r#"{"memory": "off"}"#;
    let (d, _) = timed(http, "POST", &path("hibernate"), off, 200)?;
    samples[9].push(d);
    let (d, _) = timed(http, "POST", &path("wake"), "", 200)?;
    samples[10].push(d);
    let (d, ck2) = timed(http, "POST", &path("checkpoint"), off, 201)?;
    samples[11].push(d);
    for c in [ck, ck2["id"].as_str().unwrap_or_default().to_string()] {
        timed(http, "DELETE", &format!("/v1/checkpoints/{c}"), "", 204)?;
    }
    timed(http, "DELETE", &format!("/v1/sandboxes/{id}"), "", 204)?;
    Ok(())
}

/// `criu dump` and `criu restore` of the same processes started on the host (a session of
/// their own, stdio on /dev/null, in a scratch directory), timed; the restored tree is killed.
pub(crate) fn criu_floor(
    criu: &Path,
    work: &Path,
    script: &str,
    ready: &str,
) -> anyhow::Result<(Duration, Duration)> {
    let dir = work.join("floor");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("images"))?;
    // The scripts write under /tmp: give them a /tmp of their own inside the scratch directory.
    let run =
        format!("cd {0} && mkdir -p tmp && {1}", dir.display(), script.replace("/tmp/", "tmp/"));
    let ready = ready.replace("/tmp/", &format!("{}/tmp/", dir.display()));
    let child = Command::new("setsid")
        .args(["sh", "-c", &format!("{run}; wait")])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()?;
    let pid = child.id();
    let _session = Session(pid);
    let deadline = Instant::now() + Duration::from_secs(30);
    while !Command::new("sh").args(["-c", &ready]).stderr(Stdio::null()).status()?.success() {
        ensure!(Instant::now() < deadline, "the floor's processes did not get ready");
        std::thread::sleep(Duration::from_millis(100));
    }
    // Every process of the tree (its session): the restore needs their pids free again.
    let session =
        String::from_utf8(Command::new("pgrep").args(["-s", &pid.to_string()]).output()?.stdout)?;
    let pids: Vec<String> = session.split_whitespace().map(str::to_string).collect();
    let images = dir.join("images");
    let t = Instant::now();
    let dumped = Command::new(criu)
        .args(["dump", "--tcp-established", "-t", &pid.to_string(), "-D"])
        .arg(&images)
        .args(["-o", "dump.log"])
        .status()?;
    let dump = t.elapsed();
    ensure!(dumped.success(), "criu dump failed (see {}/dump.log)", images.display());
    let mut child = child;
    let _ = child.wait();
    // The others were reparented when their session leader died: wait until they are reaped.
    let deadline = Instant::now() + Duration::from_secs(10);
    while pids.iter().any(|p| Path::new("/proc").join(p).exists()) {
        ensure!(Instant::now() < deadline, "the dumped processes linger");
        std::thread::sleep(Duration::from_millis(5));
    }
    let t = Instant::now();
    let restored = Command::new(criu)
        .args(["restore", "--tcp-established", "-d", "-D"])
        .arg(&images)
        .args(["-o", "restore.log"])
        .status()?;
    let restore = t.elapsed();
    ensure!(restored.success(), "criu restore failed (see {}/restore.log)", images.display());
    Ok((dump, restore)) // `_session` kills the restored tree
}

/// The floor's process group (its session leader's pid), killed however `criu_floor` ends: a
/// failed dump or restore would otherwise leave its processes running.
struct Session(u32);

impl Drop for Session {
    fn drop(&mut self) {
        // SAFETY: kill(2) on the process group of the floor's own tree.
        unsafe { libc::kill(-(self.0 as i32), libc::SIGKILL) };
    }
}
