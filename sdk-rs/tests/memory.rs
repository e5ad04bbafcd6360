//! Process memory through the SDK on a real node (jail engine with CRIU, which scripts/test
//! installs): processes, sessions and tmpfs survive hibernate, a node restart, checkpoint and
//! branch, fork, archive; what cannot be kept is reported, and `required` refuses cleanly.

mod common;

use std::time::Duration;

use common::*;
use silkmesh::{Error, Memory, Sandbox, SandboxState};

const COUNTER: &str = "echo $$ > /tmp/pid; i=0; while :; do i=$((i+1)); echo $i > /tmp/count; \
                       sleep 0.05; done";

async fn sh(s: &Sandbox, script: &str) -> String {
    let out = s.run(["sh", "-c", script]).await.unwrap();
    assert_eq!(out.status.code, 0, "{script}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

async fn count(s: &Sandbox) -> u64 {
    sh(s, "c=; while [ -z \"$c\" ]; do c=$(cat /tmp/count); done; echo $c").await.parse().unwrap()
}

/// The counter runs on from `before` in the process `pid`.
async fn continues(s: &Sandbox, before: u64, pid: &str) {
    let now = count(s).await;
    assert!(now >= before, "{}: the count went back from {before} to {now}", s.id());
    assert_eq!(sh(s, "cat /tmp/pid").await, pid, "{}: another process counts", s.id());
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(count(s).await > now, "{}: the counter stopped", s.id());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn processes_sessions_and_tmp_survive_every_lifecycle_step() {
    let mut node = Sandboxd::start(ONE_WARM);
    let c = node.client();
    let caps = c.info().await.unwrap().capabilities;
    assert_eq!(caps["memory_snapshot"], true, "CRIU is not usable: {caps}");
    let s = c.claim("host").ttl(Duration::from_secs(600)).send().await.unwrap();
    s.spawn(["sh", "-c", COUNTER]).await.unwrap();
    let echo = s.spawn(["sh", "-c", "echo ring-kept; sleep 1000"]).await.unwrap();
    s.spawn(["python3", "-m", "http.server", "8000", "--bind", "127.0.0.1"]).await.unwrap();
    let session = s.session_create(Default::default()).await.unwrap();
    s.session_exec(&session.id, "mkdir -p /srv/work && cd /srv/work && X=41").await.unwrap();
    sh(&s, "echo in-tmpfs > /dev/shm/t").await;
    let served = "python3 -c \"import urllib.request as u; \
                  print(u.urlopen('http://127.0.0.1:8000/', timeout=5).status)\"";
    // Listening before the hibernate (python takes a while to start on a busy host).
    let wait =
        format!("for i in $(seq 100); do {served} 2>/dev/null && exit 0; sleep 0.1; done; exit 1");
    sh(&s, &wait).await;
    let pid = sh(&s, "cat /tmp/pid").await;

    // Hibernate and wake: the same processes go on.
    let before = count(&s).await;
    let h = s.hibernate().await.unwrap();
    assert_eq!(
        (h.state, h.memory_snapshot, h.memory_note.as_deref()),
        (SandboxState::Hibernated, true, None)
    );
    let w = s.wake().await.unwrap();
    assert!(w.memory_snapshot, "{:?}", w.memory_note);
    continues(&s, before, &pid).await;
    let out = s.session_exec(&session.id, "pwd; echo $X").await.unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "/srv/work\n41\n",
        "the session kept its state"
    );
    assert_eq!(sh(&s, "cat /dev/shm/t").await, "in-tmpfs");
    assert_eq!(sh(&s, served).await, "200", "the server inside answers after the wake");
    let ring = s.logs(echo).await.unwrap();
    let said: Vec<u8> = ring
        .chunks
        .iter()
        .flat_map(|c| match c {
            silkmesh::Chunk::Stdout(b) | silkmesh::Chunk::Stderr(b) => b.to_vec(),
        })
        .collect();
    assert_eq!(String::from_utf8_lossy(&said), "ring-kept\n", "silkd kept the output ring");

    // A node restart while it is hibernated.
    let before = count(&s).await;
    assert!(s.hibernate_with(Memory::Required).await.unwrap().memory_snapshot);
    node.restart();
    let c = node.client();
    let s = c.sandbox(s.id(), Some(s.token())).await.unwrap();
    continues(&s, before, &pid).await;

    // Checkpoint and branch: the branch continues from the checkpoint's moment.
    let before = count(&s).await;
    let ck = s.checkpoint(None).await.unwrap();
    assert_eq!(ck.memory_snapshot, Some(true), "{:?}", ck.memory_note);
    assert!(ck.freeze_ms.is_some(), "a checkpoint of a running sandbox reports its freeze window");
    let b = c.branch(&ck.id, Some(s.token())).await.unwrap();
    assert!(b.info().memory_snapshot, "{:?}", b.info().memory_note);
    continues(&b, before, &pid).await;
    assert_eq!(sh(&b, "hostname").await, b.id(), "a branch has its own identity");

    // Fork three: each continues, then they diverge.
    let before = count(&s).await;
    let kids = s.fork(3).await.unwrap();
    for k in &kids {
        assert!(k.info().memory_snapshot, "{:?}", k.info().memory_note);
        continues(k, before, &pid).await;
        sh(k, &format!("echo {} > /tmp/mine", k.id())).await;
    }
    for k in &kids {
        assert_eq!(sh(k, "cat /tmp/mine").await, k.id());
    }
    continues(&s, before, &pid).await;

    // Archive and wake.
    let before = count(&s).await;
    let a = s.archive().await.unwrap();
    assert_eq!((a.state, a.memory_snapshot), (SandboxState::Archived, true), "{:?}", a.memory_note);
    s.wake().await.unwrap();
    continues(&s, before, &pid).await;
    c.delete_checkpoint(&ck.id, None).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_cannot_be_kept_is_reported_and_required_refuses_changing_nothing() {
    let node = Sandboxd::start(ONE_WARM);
    let c = node.client();
    let s = c.claim("host").send().await.unwrap();
    s.write("/root/marker", "kept").await.unwrap();
    s.spawn(["sh", "-c", COUNTER]).await.unwrap();
    // An open, deleted file bigger than CRIU carries.
    sh(&s, "dd if=/dev/zero of=/tmp/big bs=1M count=80 2>/dev/null").await;
    s.spawn(["sh", "-c", "exec 3</tmp/big; rm /tmp/big; sleep 1000"]).await.unwrap();
    sh(&s, "sleep 0.5").await;

    for refused in [
        s.hibernate_with(Memory::Required).await.map(drop),
        s.checkpoint_with(None, Memory::Required).await.map(drop),
        s.fork_with(1, Memory::Required).await.map(drop),
    ] {
        match refused {
            Err(Error::Api { status: 409, code, .. }) => assert_eq!(code, "memory_snapshot_failed"),
            other => panic!("required memory that cannot be kept: {other:?}"),
        }
    }
    assert_eq!(s.refresh().await.unwrap().state, SandboxState::Claimed, "nothing changed");
    let before = count(&s).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(count(&s).await > before, "its processes run on");
    assert!(c.checkpoints().await.unwrap().is_empty(), "no checkpoint was made");

    let h = s.hibernate().await.unwrap();
    assert_eq!(h.state, SandboxState::Hibernated);
    assert!(!h.memory_snapshot);
    assert!(h.memory_note.is_some_and(|w| !w.is_empty()), "it says why");
    assert_eq!(s.read("/root/marker").await.unwrap(), "kept", "the files are all there");
    // Its processes restarted: the count they left in /tmp (kept with the files) stands.
    let stood = sh(&s, "cat /tmp/count").await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(sh(&s, "cat /tmp/count").await, stood, "its processes were kept");
}
