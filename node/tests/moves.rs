//! Moves between two nodes on the fake engine, in one process. The mover's fleet reaches the
//! target's controller directly: the record crosses as JSON and the files as a stream that ends
//! whole only when the mover finished it, as they do over QUIC, and the adoption runs on the
//! target's runtime, so dropping that runtime loses the answer as a dead peer does. A stop at every crash point of a move (on the mover) and of an adoption (on the
//! target), then a restart: the sandbox ends up on exactly one node, with its files and token.

mod fake;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use fake::*;
use sandboxd::claims::ClaimRecord;
use sandboxd::error::{Code, NodeError};
use sandboxd::node::Node;
use sandboxd::node::fleet::{BoxFuture, Fleet, PeerNode, SnapshotBytes};
use sandboxd::state::SandboxState;
use silk_engine::fake::Op;

/// The other node, reached in process; `None` while it is down.
#[derive(Debug, Default)]
struct Direct {
    target: Mutex<Option<(Arc<Node>, tokio::runtime::Handle)>>,
}

impl Direct {
    fn set(&self, target: Option<(Arc<Node>, tokio::runtime::Handle)>) {
        *self.target.lock().unwrap() = target;
    }

    fn get(&self) -> Option<(Arc<Node>, tokio::runtime::Handle)> {
        self.target.lock().unwrap().clone()
    }
}

/// The target's end of a hand-over: its end is an error unless the mover finished.
struct Finished {
    rx: tokio::io::DuplexStream,
    finished: Arc<AtomicBool>,
}

impl tokio::io::AsyncRead for Finished {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        std::task::ready!(std::pin::Pin::new(&mut self.rx).poll_read(cx, buf))?;
        if buf.filled().len() == before
            && buf.remaining() > 0
            && !self.finished.load(Ordering::Acquire)
        {
            return std::task::Poll::Ready(Err(std::io::Error::other(
                "the mover reset the stream",
            )));
        }
        std::task::Poll::Ready(Ok(()))
    }
}

fn lost(m: &str) -> NodeError {
    NodeError::new(Code::PeerUnavailable, m)
}

impl Fleet for Direct {
    fn moved(&self, _: &str, _: &str) {}

    fn tenant_sandboxes(&self, _: &str) -> u64 {
        0
    }

    fn tenant_seconds(&self, _: &str) -> u64 {
        0
    }

    fn move_target(&self, _to: Option<&str>) -> Result<PeerNode, NodeError> {
        Ok(PeerNode { name: "b".into(), api: "b:1".into() })
    }

    fn hand_over<'a>(
        &'a self,
        _peer: &'a str,
        record: &'a ClaimRecord,
        name: &'a str,
        snapshot: &'a str,
        mut files: SnapshotBytes,
    ) -> BoxFuture<'a, Result<(), NodeError>> {
        Box::pin(async move {
            let (node, runtime) = self.get().ok_or_else(|| lost("the target is down"))?;
            let record: ClaimRecord =
                serde_json::from_slice(&serde_json::to_vec(record).unwrap()).unwrap();
            // The bytes cross as over a QUIC stream: copied on the mover's runtime into a pipe
            // the target reads, which ends whole only once the copy finished. A mover stopped
            // or dropped mid-way leaves it cut short, as a reset stream does.
            let (mut tx, rx) = tokio::io::duplex(1 << 16);
            let finished = Arc::new(AtomicBool::new(false));
            let arriving = Finished { rx, finished: finished.clone() };
            let (name, snapshot) = (name.to_string(), snapshot.to_string());
            let receiving = runtime
                .spawn(async move { node.receive(record, &name, &snapshot, arriving).await });
            if tokio::io::copy(&mut files, &mut tx).await.is_ok() {
                finished.store(true, Ordering::Release);
            }
            drop(tx);
            match receiving.await {
                Ok(adopted) => adopted,
                Err(_) => Err(lost("the target died during the call")),
            }
        })
    }

    fn holds<'a>(&'a self, _peer: &'a str, id: &'a str) -> BoxFuture<'a, Option<bool>> {
        Box::pin(async move {
            let (node, _) = self.get()?;
            if node.is_adopting(id) { None } else { Some(node.get(id).is_some()) }
        })
    }
}

struct Pair {
    a: Harness,
    b: Harness,
    store: tempfile::TempDir,
    fleet: Arc<Direct>,
}

impl Pair {
    fn new() -> Pair {
        let fleet = Arc::new(Direct::default());
        Pair { a: Harness::new(), b: Harness::new(), store: tempfile::tempdir().unwrap(), fleet }
    }

    /// Both nodes keep their snapshots in one store, as a mesh does.
    fn config(&self, h: &Harness) -> sandboxd::config::Config {
        let mut cfg = h.config(0);
        cfg.store.fs = Some(silk_store::fs::FsConfig::new(self.store.path()));
        cfg
    }

    fn open_a(&self) -> (tokio::runtime::Runtime, Arc<Node>) {
        let fleet: Arc<dyn Fleet> = self.fleet.clone();
        self.a.open_in_fleet(self.config(&self.a), Some(fleet))
    }

    /// A sandbox claimed on `a` with a file of its own (`notes`): its id and token.
    fn claim_with_notes(&self, a: &(tokio::runtime::Runtime, Arc<Node>)) -> (String, String) {
        let c = a.0.block_on(a.1.claim(spec(600))).unwrap();
        self.a.engine.write_file(&sid(&c.record.id), "notes", b"kept").unwrap();
        (c.record.id.clone(), c.token)
    }

    fn open_b(&self) -> (tokio::runtime::Runtime, Arc<Node>) {
        let (rt, b) = self.b.open(self.config(&self.b));
        self.fleet.set(Some((b.clone(), rt.handle().clone())));
        (rt, b)
    }
}

/// After the dust settles, exactly one node holds `id`, unmoving, and it runs with its file
/// and answers its token. Returns whether it is on `b`.
fn settled_once(
    p: &Pair,
    a: &(tokio::runtime::Runtime, Arc<Node>),
    b: &Arc<Node>,
    id: &str,
    token: &str,
    point: &str,
) -> bool {
    eventually(&format!("{point}: the move settles"), || {
        let on_a = a.1.get(id).is_some_and(|l| l.record.intent.is_none());
        let on_b = b.get(id).is_some() && !b.is_adopting(id);
        let still_on_a = a.1.get(id).is_some();
        (on_a && b.get(id).is_none()) || (on_b && !still_on_a)
    });
    let on_b = b.get(id).is_some();
    let (node, harness) = if on_b { (b, &p.b) } else { (&a.1, &p.a) };
    let live = a.0.block_on(node.wake(id)).unwrap_or_else(|e| panic!("{point}: wake: {e}"));
    assert_eq!(live.record.state(), SandboxState::Claimed, "{point}");
    assert_eq!(
        harness.engine.read_file(&sid(id), "notes").as_deref(),
        Some(&b"kept"[..]),
        "{point}"
    );
    assert!(node.authorized(id, Some(token)).is_ok(), "{point}: the token no longer works");
    on_b
}

#[test]
fn a_move_moves_the_files_id_and_token_and_the_mover_forgets_it() {
    let p = Pair::new();
    let (_rt_b, b) = p.open_b();
    let a = p.open_a();
    let (id, token) = p.claim_with_notes(&a);
    let (n, i) = (a.1.clone(), id.clone());
    let (moved, to) =
        a.0.block_on(async move { n.move_sandbox(&i, Some("b"), silk_engine::Memory::Auto).await })
            .unwrap();
    assert_eq!((moved.id.as_str(), to.name.as_str()), (id.as_str(), "b"));
    assert!(a.1.get(&id).is_none(), "the mover still holds it");
    assert!(settled_once(&p, &a, &b, &id, &token, "no crash"), "not on b");
}

#[test]
fn a_mover_stopped_at_any_crash_point_leaves_the_sandbox_on_exactly_one_node() {
    for (point, ends_on_b) in
        [("move:intent", false), ("move:streaming", false), ("move:switched", true)]
    {
        let p = Pair::new();
        let (_rt_b, b) = p.open_b();
        let a = p.open_a();
        let (id, token) = p.claim_with_notes(&a);
        a.1.crash_at(point);
        let (n, i) = (a.1.clone(), id.clone());
        a.0.spawn(async move {
            let _ = n.move_sandbox(&i, Some("b"), silk_engine::Memory::Auto).await;
        });
        eventually(&format!("the move reaches {point}"), || a.1.stopped_at_crash_point());
        drop(a);

        let a = p.open_a();
        assert_eq!(settled_once(&p, &a, &b, &id, &token, point), ends_on_b, "{point}");
    }
}

#[test]
fn a_target_that_dies_mid_adoption_leaves_the_sandbox_with_the_mover() {
    let p = Pair::new();
    let (rt_b, b) = p.open_b();
    let a = p.open_a();
    let (id, token) = p.claim_with_notes(&a);
    b.crash_at("adopt:restored");
    let (n, i) = (a.1.clone(), id.clone());
    let moving =
        a.0.spawn(async move { n.move_sandbox(&i, Some("b"), silk_engine::Memory::Auto).await });
    eventually("the adoption reaches adopt:restored", || b.stopped_at_crash_point());
    // The target dies: the mover's call loses its answer.
    p.fleet.set(None);
    drop((b, rt_b));
    let answer = a.0.block_on(moving).unwrap();
    assert_eq!(answer.map(|_| ()).unwrap_err().code, Code::Moving, "a lost answer settles later");
    assert!(a.1.get(&id).is_some(), "the mover keeps its copy until the target answers");

    // The target restarts (without the half-adopted sandbox) and answers: the mover keeps it.
    let (_rt_b, b) = p.open_b();
    assert!(!settled_once(&p, &a, &b, &id, &token, "adopt:restored"), "ended on b");
}

#[test]
fn an_adopt_is_refused_unless_the_archive_was_made_for_that_sandbox_token_and_tenant() {
    let p = Pair::new();
    let a = p.open_a();
    let b = p.open_b();
    let (id, token) = p.claim_with_notes(&a);
    let record = a.0.block_on(a.1.archive(&id, silk_engine::Memory::Auto)).unwrap();
    let archive = record.phase.archive().unwrap().to_string();
    // A cluster member hands b the archive with a token of its own, or in another tenant's
    // (or root's) name: b would serve the sandbox's files to whoever holds that.
    let stolen =
        ClaimRecord { token_hash: sandboxd::claims::hash_token("sbt_attacker"), ..record.clone() };
    let renamed = ClaimRecord { tenant: Some("someone".into()), ..record.clone() };
    for forged in [stolen, renamed] {
        let e = b.0.block_on(b.1.adopt(forged, &archive)).unwrap_err();
        assert_eq!(e.code, Code::BadRequest, "{e:?}");
        assert!(e.message.contains("was not made for"), "{e:?}");
        assert!(b.1.get(&id).is_none());
    }
    // The record the archive was made for is adopted.
    b.0.block_on(b.1.adopt(record, &archive)).unwrap();
    let live = b.1.get(&id).unwrap();
    assert!(sandboxd::claims::token_matches(&token, &live.record.token_hash));
}

#[test]
fn a_move_whose_capture_fails_or_whose_target_refuses_leaves_the_sandbox_running_on_the_mover() {
    let p = Pair::new();
    let (_rt_b, b) = p.open_b();
    let a = p.open_a();
    let (id, token) = p.claim_with_notes(&a);
    // The mover cannot capture the files (the stream to the target is cut), then the target
    // cannot start them: either way nothing is left on the target, and the mover runs it again.
    for (who, engine) in [("capture", &p.a.engine), ("target", &p.b.engine)] {
        let op = if who == "capture" { Op::Snapshot } else { Op::Restore };
        engine.fail(op, 1);
        let (n, i) = (a.1.clone(), id.clone());
        let moved =
            a.0.block_on(
                async move { n.move_sandbox(&i, Some("b"), silk_engine::Memory::Auto).await },
            );
        let e = moved.map(|_| ()).unwrap_err();
        assert_ne!(e.code, Code::Moving, "{who}: a refusal is certain, not in doubt: {e:?}");
        assert!(b.get(&id).is_none() && !b.is_adopting(&id), "{who}: the target kept a copy");
        let live = a.1.get(&id).unwrap_or_else(|| panic!("{who}: the mover lost it"));
        assert!(live.record.intent.is_none(), "{who}: {:?}", live.record.intent);
        assert_eq!(live.record.state(), SandboxState::Claimed, "{who}: not running again");
        assert_eq!(p.a.engine.read_file(&sid(&id), "notes").as_deref(), Some(&b"kept"[..]));
        assert!(a.1.authorized(&id, Some(&token)).is_ok());
    }
    // And the next move goes through.
    let (n, i) = (a.1.clone(), id.clone());
    a.0.block_on(async move { n.move_sandbox(&i, Some("b"), silk_engine::Memory::Auto).await })
        .unwrap();
    assert!(settled_once(&p, &a, &b, &id, &token, "after the failures"), "not on b");
}
