//! kill -9 soak: a node SIGKILLed at a random moment and started again, cycle after cycle,
//! while four clients claim, exec, write, hibernate, wake, checkpoint and release. The suite
//! runs 5 cycles; `scripts/soak` runs 100 (`SILK_SOAK_CYCLES`).
//!
//! After every start: each claim a client was answered for (and did not release) is there,
//! holding the last value the client's writes were answered for; every box the engine holds
//! belongs to a claim or to the warm pool; the journal stays under its compaction bound. Every
//! answer is one the OpenAPI document describes, and none is a 500. At the end, all claims
//! released and the node stopped with SIGTERM: no jail, sandbox process, mount, cgroup,
//! snapshot or scratch file of the node is left.

mod common;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;

const CLIENTS: u64 = 4;
const WARM: usize = 2;
/// The journal compacts once its log passes max(1 MiB, 4 × its image): with a few dozen claims
/// the image is small, so the log never gets far past 1 MiB.
const JOURNAL_BOUND: u64 = 2 << 20;

/// A sandbox one client claimed. `writing`/`releasing`: a call that was under way when the node
/// died, so either outcome is right.
struct Owned {
    id: String,
    token: String,
    written: u64,
    writing: Option<u64>,
    releasing: bool,
}

#[derive(Default)]
struct Tally {
    /// Answers by operation and status; `-` is a connection the node's death cut.
    answers: BTreeMap<(&'static str, String), u64>,
    checks: BTreeMap<&'static str, u64>,
}

impl Tally {
    fn answered(&mut self, op: &'static str, status: Option<u16>) {
        let status = status.map_or_else(|| "-".to_string(), |s| s.to_string());
        *self.answers.entry((op, status)).or_default() += 1;
    }
    fn checked(&mut self, what: &'static str) {
        *self.checks.entry(what).or_default() += 1;
    }
}

/// xorshift64: a fixed, seeded sequence, so a failing run can be replayed with its seed.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

#[test]
fn kill_9_under_load_loses_no_acknowledged_claim_and_leaks_nothing() {
    let cycles: u64 = std::env::var("SILK_SOAK_CYCLES").map_or(5, |c| c.parse().unwrap());
    let seed: u64 = std::env::var("SILK_SOAK_SEED").map_or(1, |s| s.parse().unwrap());
    // A fixed port: the clients find the node again after each start.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let pool = format!("[[pools]]\ntemplate = \"host\"\nwarm = {WARM}\nwarm_max = {WARM}\n");
    let mut node = Sandboxd::start_at(&format!("127.0.0.1:{port}"), &pool);
    // Every answer is checked against the document, read once here while the node is up.
    node.info();
    let owned: Vec<Arc<Mutex<Vec<Owned>>>> =
        (0..CLIENTS).map(|_| Arc::new(Mutex::new(vec![]))).collect();
    let tally = Arc::new(Mutex::new(Tally::default()));
    let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
    let mut journal_max = 0;
    let started = Instant::now();

    for cycle in 0..cycles {
        let stop = Arc::new(AtomicBool::new(false));
        let clients: Vec<_> = (0..CLIENTS)
            .map(|c| {
                let (owned, tally, stop) = (owned[c as usize].clone(), tally.clone(), stop.clone());
                let addr = node.addr;
                let seed = rng.below(u64::MAX) | 1;
                std::thread::spawn(move || client(addr, &owned, &tally, &stop, Rng(seed)))
            })
            .collect();
        std::thread::sleep(Duration::from_millis(500 + rng.below(2500)));
        node.kill9();
        stop.store(true, Ordering::Relaxed);
        for c in clients {
            c.join().expect("a client's check failed");
        }
        node.launch().expect("the node starts again");

        let mut tally = tally.lock().unwrap();
        for client in &owned {
            check_after_start(&node, &mut client.lock().unwrap(), &mut tally);
        }
        let claims = claim_ids(&node);
        eventually("only claims and the warm pool hold boxes", || {
            node.boxes().iter().filter(|b| !claims.contains(&b.id.to_string())).count() <= WARM
        });
        tally.checked("boxes: claims or warm");
        let journal = std::fs::metadata(node.data().join("journal/journal.log")).unwrap().len();
        assert!(journal <= JOURNAL_BOUND, "cycle {cycle}: the journal is {journal} bytes");
        journal_max = journal_max.max(journal);
        tally.checked("journal bounded");
        eprintln!("soak: cycle {} of {cycles}: {} claims", cycle + 1, claims.len());
    }

    // Everything released, then a clean stop: nothing of the node is left on the host.
    for id in claim_ids(&node) {
        assert_eq!(node.req("DELETE", &format!("/v1/sandboxes/{id}"), Some(ROOT), None).0, 204);
    }
    let mut child = node.child.take().unwrap();
    // SAFETY: kill(2) on the node's own process.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    assert!(child.wait().unwrap().success(), "a clean exit on SIGTERM");
    let tally = tally.lock().unwrap();
    assert_eq!(node.jails(), 0, "jails left");
    assert_eq!(processes_under(node.work()), 0, "sandbox processes left");
    // A helper the node ran on a sandbox's files (CRIU and what it forks), orphaned by a kill.
    assert_eq!(helpers_naming(node.work()), 0, "helper processes left");
    assert_eq!(mounts_under(node.work()), 0, "mounts left");
    assert_eq!(cgroups_of(&node.data().join("engine")), 0, "cgroups left");
    for dir in ["snapshots", "scratch"] {
        let left = std::fs::read_dir(node.data().join(dir)).map_or(0, |d| d.count());
        assert_eq!(left, 0, "{dir} left");
    }
    let server_errors: u64 = tally
        .answers
        .iter()
        .filter(|((_, s), _)| s.starts_with('5') && s != "503")
        .map(|(_, n)| n)
        .sum();
    eprintln!("soak: {cycles} kill -9 cycles in {:.0?}, seed {seed}", started.elapsed());
    eprintln!("soak: answers (operation, status: count; - = cut by the kill):");
    for ((op, status), n) in &tally.answers {
        eprintln!("  {op:<10} {status:>3}: {n}");
    }
    eprintln!("soak: invariants checked:");
    for (what, n) in &tally.checks {
        eprintln!("  {what}: {n}");
    }
    eprintln!("soak: largest journal {journal_max} bytes; at the end nothing left");
    assert_eq!(server_errors, 0, "5xx answers other than 503");
}

/// One client until `stop`: its own sandboxes (one to four), one call at a time.
fn client(
    addr: std::net::SocketAddr,
    owned: &Mutex<Vec<Owned>>,
    tally: &Mutex<Tally>,
    stop: &AtomicBool,
    mut rng: Rng,
) {
    let mut owned = owned.lock().unwrap();
    while !stop.load(Ordering::Relaxed) {
        let call = |method: &str, path: &str, token: &str, body: &str| {
            try_http(addr, method, path, Some(token), body)
        };
        let pick = rng.below(100);
        if owned.len() < 2 || (pick < 10 && owned.len() < 4) {
            let answer = call("POST", "/v1/sandboxes", ROOT, r#"{"ttl_seconds": 3600}"#);
            tally.lock().unwrap().answered("claim", answer.as_ref().map(|a| a.0));
            match answer {
                Some((201, v)) => owned.push(Owned {
                    id: v["id"].as_str().unwrap().into(),
                    token: v["token"].as_str().unwrap().into(),
                    written: 0,
                    writing: None,
                    releasing: false,
                }),
                // Cut: a claim nobody knows of, which the end releases like any other.
                _ => std::thread::sleep(Duration::from_millis(20)),
            }
            continue;
        }
        let i = rng.below(owned.len() as u64) as usize;
        let s = &mut owned[i];
        let base = format!("/v1/sandboxes/{}", s.id);
        let (op, answer) = match pick {
            10..=39 => {
                let n = s.written + 1;
                s.writing = Some(n);
                // Through a rename: silkd kills a call's processes when its connection drops,
                // so a plain `echo > counter` cut by the kill could leave the file truncated and
                // empty, a state no write was answered for.
                let body = format!(
                    r#"{{"argv": ["sh", "-c", "echo {n} > /root/counter.new && mv /root/counter.new /root/counter"]}}"#
                );
                let answer = call("POST", &format!("{base}/exec"), &s.token, &body);
                match &answer {
                    Some((200, v)) if v["exit_code"] == 0 => (s.written, s.writing) = (n, None),
                    Some(_) => s.writing = None,
                    None => {}
                }
                ("write", answer)
            }
            40..=54 => {
                let answer = call("POST", &format!("{base}/exec"), &s.token, READ);
                if let Some((200, v)) = &answer
                    && s.writing.is_none()
                {
                    assert_eq!(value(v), s.written, "{}: a read after an answered write", s.id);
                    tally.lock().unwrap().checked("a read sees the last write");
                }
                ("read", answer)
            }
            55..=66 => ("hibernate", call("POST", &format!("{base}/hibernate"), &s.token, "")),
            67..=78 => ("wake", call("POST", &format!("{base}/wake"), &s.token, "")),
            79..=89 => ("checkpoint", call("POST", &format!("{base}/checkpoint"), &s.token, "")),
            _ => {
                s.releasing = true;
                let answer = call("DELETE", &base, &s.token, "");
                match answer.as_ref().map(|a| a.0) {
                    Some(204) => drop(owned.remove(i)),
                    Some(_) => owned[i].releasing = false,
                    None => {}
                }
                ("release", answer)
            }
        };
        if let Some((status, v)) = &answer
            && *status >= 500
            && *status != 503
        {
            eprintln!("soak: {op} answered {status}: {v}");
        }
        tally.lock().unwrap().answered(op, answer.as_ref().map(|a| a.0));
        if answer.is_none() {
            std::thread::sleep(Duration::from_millis(20)); // the node is down
        }
    }
}

const READ: &str = r#"{"argv": ["sh", "-c", "cat /root/counter 2>/dev/null || echo 0"]}"#;

fn value(exec: &serde_json::Value) -> u64 {
    let out = exec["stdout"].as_str().unwrap().trim();
    out.parse().unwrap_or_else(|_| panic!("the counter holds {out:?}: {exec}"))
}

/// After a start: each of a client's sandboxes is there (unless its release was cut) and holds
/// what its last answered write wrote (or the write that was cut).
fn check_after_start(node: &Sandboxd, owned: &mut Vec<Owned>, tally: &mut Tally) {
    owned.retain_mut(|s| {
        let (status, v) = node.req("GET", &format!("/v1/sandboxes/{}", s.id), Some(&s.token), None);
        if status == 404 && s.releasing {
            tally.checked("a cut release: gone");
            return false;
        }
        assert_eq!(status, 200, "{}: an acknowledged claim after a restart: {v}", s.id);
        tally.checked("an acknowledged claim is there");
        let v = node.exec(&s.id, &s.token, "cat /root/counter 2>/dev/null || echo 0");
        let found = value(&v);
        assert!(
            found == s.written || Some(found) == s.writing,
            "{}: holds {found}, the last answered write was {} (cut: {:?})",
            s.id,
            s.written,
            s.writing
        );
        tally.checked("its files hold the last answered write");
        (s.written, s.writing, s.releasing) = (found, None, false);
        true
    });
}

fn claim_ids(node: &Sandboxd) -> Vec<String> {
    let (status, v) = node.req("GET", "/v1/sandboxes?scope=node&limit=1000", Some(ROOT), None);
    assert_eq!(status, 200, "{v}");
    v["sandboxes"].as_array().unwrap().iter().map(|s| s["id"].as_str().unwrap().into()).collect()
}

/// Processes whose root directory is under `dir`: a sandbox's.
fn processes_under(dir: &std::path::Path) -> usize {
    let Ok(procs) = std::fs::read_dir("/proc") else { return 0 };
    procs
        .flatten()
        .filter_map(|p| std::fs::read_link(p.path().join("root")).ok())
        .filter(|root| root.starts_with(dir))
        .count()
}

fn helpers_naming(dir: &std::path::Path) -> usize {
    let Ok(procs) = std::fs::read_dir("/proc") else { return 0 };
    let needle = dir.as_os_str().as_encoded_bytes();
    procs
        .flatten()
        .filter(|p| p.file_name() != std::process::id().to_string().as_str())
        .filter_map(|p| std::fs::read(p.path().join("cmdline")).ok())
        .filter(|cmdline| cmdline.split(|b| *b == 0).any(|arg| arg.starts_with(needle)))
        .count()
}

fn mounts_under(dir: &std::path::Path) -> usize {
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let dir = dir.to_str().unwrap();
    mounts.lines().filter(|l| l.split(' ').nth(4).is_some_and(|m| m.starts_with(dir))).count()
}

/// Sandbox cgroups left under the engine's parent group (named for its data directory).
fn cgroups_of(engine_dir: &std::path::Path) -> usize {
    let hash = blake3::hash(engine_dir.as_os_str().as_encoded_bytes()).to_hex();
    let parent = format!("silkmesh-{}", &hash[..12]);
    let roots = std::fs::read_dir("/sys/fs/cgroup").unwrap().flatten().map(|c| c.path());
    roots
        .chain(std::iter::once("/sys/fs/cgroup".into()))
        .map(|r| r.join(&parent))
        .filter_map(|p| std::fs::read_dir(p).ok())
        .map(|d| d.flatten().filter(|e| e.path().is_dir()).count())
        .sum()
}
