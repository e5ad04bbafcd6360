//! The engine contract: what every backend must do, written against `&dyn Engine` only. Each
//! backend's test file calls every function here with its own engine and a template.

use std::path::Path;
use std::time::Duration;

use silk_engine::*;

use super::{id, ok, sh, small};

fn warmup(argv: &[&str]) -> Warmup {
    Warmup {
        argv: argv.iter().map(|s| s.to_string()).collect(),
        timeout: Duration::from_secs(20),
        memory: false,
    }
}

/// Goldens are content-named: same template and warmup, same golden; the warmup's result is in
/// every clone, and not in a cold boot.
pub fn goldens_are_reused_and_carry_the_warmup(e: &dyn Engine, t: &Template) {
    let g1 = e.prepare(t, &warmup(&["/bin/sh", "-c", "echo warm > /etc/warm"])).unwrap();
    let g2 = e.prepare(t, &warmup(&["/bin/sh", "-c", "echo warm > /etc/warm"])).unwrap();
    assert_eq!(g1, g2);
    let other = e.prepare(t, &warmup(&["/bin/sh", "-c", "echo other > /etc/warm"])).unwrap();
    assert_ne!(other.digest, g1.digest, "a changed warmup is a new golden");

    let clone = e.clone_golden(&g1, &id("c-warm"), &small()).unwrap();
    assert_eq!(ok(&clone, "cat /etc/warm"), "warm");
    let cold = e.boot(t, &id("c-cold"), &small()).unwrap();
    assert_ne!(sh(&cold, "cat /etc/warm").0, 0, "cold boot has no warmup result");
    e.destroy(&clone.id).unwrap();
    e.destroy(&cold.id).unwrap();
    assert!(e.list().unwrap().is_empty(), "golden builders leave no sandbox behind");
}

/// Clones answer, are named by their id, and do not share files.
pub fn clones_are_separate_machines(e: &dyn Engine, t: &Template) {
    let g = e.prepare(t, &Warmup::default()).unwrap();
    let a = e.clone_golden(&g, &id("c-a"), &small()).unwrap();
    let b = e.clone_golden(&g, &id("c-b"), &small()).unwrap();
    assert_eq!(ok(&a, "hostname; cat /etc/hostname"), "c-a\nc-a");
    ok(&a, "echo only-a > /root/mine");
    assert_ne!(sh(&b, "cat /root/mine").0, 0);
    assert_ne!(ok(&a, "cat /etc/machine-id"), ok(&b, "cat /etc/machine-id"));
    assert_eq!(e.agent(&a.id).unwrap(), a.agent);
    let ids: Vec<_> = e.list().unwrap().into_iter().filter(|i| i.running).map(|i| i.id).collect();
    assert_eq!(ids, vec![a.id.clone(), b.id.clone()]);
    e.destroy(&a.id).unwrap();
    e.destroy(&b.id).unwrap();
}

/// A snapshot carries files written and files deleted; the source keeps running (or stops).
pub fn snapshot_and_restore_keep_the_filesystem(e: &dyn Engine, t: &Template, scratch: &Path) {
    let g = e.prepare(t, &Warmup::default()).unwrap();
    let src = e.clone_golden(&g, &id("c-src"), &small()).unwrap();
    ok(
        &src,
        "mkdir -p /srv/data && echo v1 > /srv/data/f && rm /etc/hosts && chmod 600 /srv/data/f",
    );
    let into = scratch.join("keep.tar");
    let snap = e.snapshot(&src.id, SnapshotMode::KeepRunning, Memory::Off, &into).unwrap();
    assert!(!snap.memory || e.capabilities().memory_snapshot);
    assert_eq!(snap.layer_tar, into);
    assert_eq!(std::fs::metadata(&into).unwrap().len(), snap.bytes);
    ok(&src, "echo v2 > /srv/data/f"); // still running and writable after the snapshot

    let copy = e.restore(&snap, &id("c-copy"), &small(), Memory::Off).unwrap();
    assert_eq!(ok(&copy, "cat /srv/data/f"), "v1");
    assert_eq!(ok(&copy, "stat -c %a /srv/data/f"), "600");
    assert_ne!(sh(&copy, "test -e /etc/hosts").0, 0, "a deletion survives the snapshot");
    assert_eq!(ok(&copy, "hostname"), "c-copy");

    let stopped =
        e.snapshot(&src.id, SnapshotMode::Stop, Memory::Off, &scratch.join("stop.tar")).unwrap();
    assert!(e.list().unwrap().iter().all(|b| b.id != src.id), "Stop destroys the source");
    let again = e.restore(&stopped, &id("c-again"), &small(), Memory::Off).unwrap();
    assert_eq!(ok(&again, "cat /srv/data/f"), "v2");
    for b in [copy.id, again.id] {
        e.destroy(&b).unwrap();
    }
}

/// `read_snapshot` restores what it reads as `restore` restores the file; a stream that fails
/// half way makes no sandbox and leaves nothing of one.
pub fn snapshots_restore_from_a_stream(e: &dyn Engine, t: &Template, scratch: &Path) {
    let g = e.prepare(t, &Warmup::default()).unwrap();
    let src = e.clone_golden(&g, &id("s-src"), &small()).unwrap();
    ok(&src, "mkdir -p /srv/s && head -c 3000000 /dev/urandom > /srv/s/big && echo v1 > /srv/s/f");
    ok(&src, "rm /etc/hosts && sha256sum /srv/s/big > /srv/s/sum");
    let tar = scratch.join("stream.tar");
    let snap = e.snapshot(&src.id, SnapshotMode::KeepRunning, Memory::Off, &tar).unwrap();
    let stream_snap = Snapshot { layer_tar: scratch.join("stream-scratch.tar"), ..snap.clone() };

    let mut input = std::fs::File::open(&tar).unwrap();
    let copy = e.read_snapshot(&mut input, &stream_snap, &id("s-copy"), &small(), Memory::Off);
    let copy = copy.unwrap();
    assert_eq!(ok(&copy, "cat /srv/s/f"), "v1");
    assert_eq!(ok(&copy, "sha256sum -c /srv/s/sum"), "/srv/s/big: OK");
    assert_ne!(sh(&copy, "test -e /etc/hosts").0, 0, "a deletion survives the stream");
    assert_eq!(ok(&copy, "hostname"), "s-copy");
    assert!(!stream_snap.layer_tar.exists(), "no scratch file is left");

    /// The snapshot's first `left` bytes, then an error: a download that failed.
    struct Failing(std::fs::File, u64);
    impl std::io::Read for Failing {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            if self.1 == 0 {
                return Err(std::io::Error::other("the store went away"));
            }
            let want = buf.len().min(self.1 as usize);
            let n = self.0.read(&mut buf[..want])?;
            self.1 -= n as u64;
            Ok(n)
        }
    }
    let half = std::fs::metadata(&tar).unwrap().len() / 2;
    let mut input = Failing(std::fs::File::open(&tar).unwrap(), half);
    let failed = e.read_snapshot(&mut input, &stream_snap, &id("s-cut"), &small(), Memory::Off);
    assert!(failed.is_err(), "a stream cut short makes no sandbox");
    assert!(e.list().unwrap().iter().all(|b| b.id.as_str() != "s-cut"));
    // The id is free again: nothing of the failed start is left under it.
    let mut input = std::fs::File::open(&tar).unwrap();
    let again = e.read_snapshot(&mut input, &stream_snap, &id("s-cut"), &small(), Memory::Off);
    assert_eq!(ok(&again.unwrap(), "cat /srv/s/f"), "v1");
    for b in ["s-src", "s-copy", "s-cut"] {
        e.destroy(&id(b)).unwrap();
    }
}

/// Stop frees the processes and keeps the files; resume starts the same sandbox on them. A
/// stopped sandbox can still be captured and destroyed.
pub fn stopped_sandboxes_resume_on_their_files(e: &dyn Engine, t: &Template, scratch: &Path) {
    let g = e.prepare(t, &Warmup::default()).unwrap();
    let a = e.clone_golden(&g, &id("c-park"), &small()).unwrap();
    // `/tmp` is on the sandbox's disk, as in a container or a VM: kept with its files.
    ok(&a, "mkdir -p /srv/p && echo parked > /srv/p/f && echo kept > /tmp/t && rm /etc/hosts");
    e.stop(&a.id, Memory::Off).unwrap();
    e.stop(&a.id, Memory::Off).unwrap(); // idempotent
    let listed = e.list().unwrap();
    let row = listed.iter().find(|b| b.id == a.id).expect("a stopped sandbox is still listed");
    assert!(!row.running);

    let snap = e
        .snapshot(&a.id, SnapshotMode::KeepRunning, Memory::Off, &scratch.join("park.tar"))
        .unwrap();
    let back = e.resume(&a.id).unwrap();
    assert!(back.running);
    assert_eq!(ok(&back, "cat /srv/p/f; cat /tmp/t"), "parked\nkept");
    assert_ne!(sh(&back, "test -e /etc/hosts").0, 0, "a deletion survives a stop");
    assert_eq!(ok(&back, "hostname"), "c-park");
    let same = e.resume(&a.id).unwrap();
    assert_eq!(same.pid, back.pid, "resuming a running sandbox changes nothing");

    let copy = e.restore(&snap, &id("c-park2"), &small(), Memory::Off).unwrap();
    assert_eq!(
        ok(&copy, "cat /srv/p/f; cat /tmp/t"),
        "parked\nkept",
        "a stopped sandbox can be captured"
    );
    e.stop(&copy.id, Memory::Off).unwrap();
    e.destroy(&copy.id).unwrap();
    assert!(matches!(e.resume(&copy.id), Err(EngineError::NotFound(_))));
    e.destroy(&a.id).unwrap();
}

/// Bad requests are typed and leave nothing behind.
pub fn errors_are_typed(e: &dyn Engine, t: &Template, scratch: &Path) {
    let g = e.prepare(t, &Warmup::default()).unwrap();
    let a = e.clone_golden(&g, &id("c-dup"), &small()).unwrap();
    assert!(matches!(e.clone_golden(&g, &id("c-dup"), &small()), Err(EngineError::Exists(_))));
    assert_eq!(
        ok(&a, "echo still fine"),
        "still fine",
        "a failed duplicate does not hurt the original"
    );
    e.destroy(&a.id).unwrap();
    assert!(matches!(e.destroy(&a.id), Err(EngineError::NotFound(_))));
    let egress = BoxSpec::new(Size::Small, Lane::Egress);
    if !e.capabilities().egress {
        assert!(matches!(
            e.clone_golden(&g, &id("c-egress"), &egress),
            Err(EngineError::Unsupported { .. })
        ));
    }
    assert!(matches!(
        e.snapshot(
            &id("c-none"),
            SnapshotMode::KeepRunning,
            Memory::Off,
            &scratch.join("none.tar")
        ),
        Err(EngineError::NotFound(_))
    ));
    assert!(!scratch.join("none.tar").exists(), "a failed snapshot leaves no file");

    let failing = e.prepare(t, &warmup(&["/bin/sh", "-c", "echo broken >&2; exit 7"]));
    assert!(
        matches!(&failing, Err(EngineError::WarmupFailed(m)) if m.contains("exit 7") && m.contains("broken")),
        "{failing:?}"
    );
    let hanging = e.prepare(
        t,
        &Warmup {
            argv: vec!["sleep".into(), "100".into()],
            timeout: Duration::from_millis(300),
            memory: false,
        },
    );
    assert!(
        matches!(&hanging, Err(EngineError::WarmupFailed(m)) if m.contains("timed out")),
        "{hanging:?}"
    );
    assert!(e.list().unwrap().is_empty(), "failed warmups leave no sandbox");
}

/// A golden made from a snapshot (promote) holds the golden it was cloned from plus the
/// sandbox's changes, deletions and replaced directories included.
pub fn goldens_from_snapshots_keep_every_change(e: &dyn Engine, t: &Template, scratch: &Path) {
    let g = e
        .prepare(
            t,
            &warmup(&[
                "/bin/sh",
                "-c",
                "mkdir -p /srv/old && echo w > /srv/old/a && echo w > /etc/warm",
            ]),
        )
        .unwrap();
    let src = e.clone_golden(&g, &id("p-src"), &small()).unwrap();
    ok(
        &src,
        "echo promoted > /etc/new && rm /etc/warm && rm -r /srv/old && mkdir /srv/old && echo b > /srv/old/b && rm /etc/hosts",
    );
    let snap = e
        .snapshot(&src.id, SnapshotMode::KeepRunning, Memory::Off, &scratch.join("p.tar"))
        .unwrap();
    let promoted = e.golden_from_snapshot(&snap).unwrap();
    assert_ne!(promoted.digest, g.digest);
    assert_eq!(e.golden_from_snapshot(&snap).unwrap(), promoted, "same snapshot, same golden");
    let child = e.clone_golden(&promoted, &id("p-child"), &small()).unwrap();
    assert_eq!(ok(&child, "cat /etc/new; ls /srv/old"), "promoted\nb");
    assert_ne!(sh(&child, "test -e /etc/warm").0, 0, "a file deleted before promote stays deleted");
    assert_ne!(sh(&child, "test -e /etc/hosts").0, 0, "a template file deleted stays deleted");
    assert_eq!(ok(&child, "hostname"), "p-child");
    for b in [src.id, child.id] {
        e.destroy(&b).unwrap();
    }
}

/// A golden exported by one engine and imported by another (another node) is the same golden:
/// same digest, same files, and its clones see the warmup's result without running it.
pub fn goldens_travel_between_engines(
    (a, ta): (&dyn Engine, &Template),
    (b, tb): (&dyn Engine, &Template),
    scratch: &Path,
) {
    assert_eq!(ta.digest, tb.digest, "one template, two engines");
    let t = ta;
    let warm = warmup(&["/bin/sh", "-c", "echo built > /etc/warm && rm /etc/hosts"]);
    let g = a.prepare(t, &warm).unwrap();
    assert_eq!(a.golden_digest(t, &warm), g.digest);
    assert_eq!(a.find_golden(&g.digest), Some(g.clone()));
    assert!(b.find_golden(&g.digest).is_none());
    let tar = scratch.join("golden.tar");
    a.export_golden(&g, &tar).unwrap();
    let imported = b.import_golden(tb, &g.digest, &tar).unwrap();
    assert_eq!(imported.digest, g.digest);
    assert_eq!(b.find_golden(&g.digest), Some(imported.clone()));
    assert_eq!(b.prepare(tb, &warm).unwrap(), imported, "prepare finds it: no warmup runs again");
    let clone = b.clone_golden(&imported, &id("t-clone"), &small()).unwrap();
    assert_eq!(ok(&clone, "cat /etc/warm"), "built");
    assert_ne!(sh(&clone, "test -e /etc/hosts").0, 0, "the warmup's deletion travelled too");
    b.destroy(&clone.id).unwrap();
}

/// Fork: copies start with the source's files as they were, each its own from then on, and a
/// copy's own snapshot carries what it inherited and what it changed. All or none, from a
/// running sandbox or from a snapshot.
pub fn forks_start_from_the_source_and_go_their_own_ways(
    e: &dyn Engine,
    t: &Template,
    scratch: &Path,
) -> Vec<BoxInfo> {
    let g = e.prepare(t, &Warmup::default()).unwrap();
    let src = e.clone_golden(&g, &id("k-src"), &small()).unwrap();
    ok(
        &src,
        "mkdir -p /srv/f/sub && for f in keep del mod same; do echo $f > /srv/f/$f; done && rm /etc/hosts",
    );
    let ids = [id("k-1"), id("k-2"), id("k-3")];
    let kids = e.fork(&src.id, &ids, &small(), Memory::Off, &scratch.join("k.tar")).unwrap();
    assert!(!scratch.join("k.tar").exists(), "the scratch file goes");
    assert_eq!(kids.iter().map(|k| &k.id).collect::<Vec<_>>(), ids.iter().collect::<Vec<_>>());
    for kid in &kids {
        assert_eq!(ok(kid, "cat /srv/f/keep /srv/f/del /srv/f/mod"), "keep\ndel\nmod");
        assert_ne!(sh(kid, "test -e /etc/hosts").0, 0, "the source's deletion carries over");
        assert_eq!(ok(kid, "hostname"), kid.id.as_str());
    }
    // A copy changes what it inherited, in place too: its siblings and the source keep theirs.
    ok(
        &kids[0],
        "echo changed >> /srv/f/mod && rm /srv/f/del && rm -r /srv/f/sub && echo new > /srv/f/new \
         && : > /srv/f/keep",
    );
    for other in [&kids[1], &src] {
        assert_eq!(ok(other, "cat /srv/f/keep /srv/f/del /srv/f/mod"), "keep\ndel\nmod");
        assert_ne!(sh(other, "test -e /srv/f/new").0, 0);
        assert_eq!(sh(other, "test -d /srv/f/sub").0, 0);
    }
    // The copy's snapshot stands alone: restored, it is the copy as it was, what it inherited
    // untouched included.
    let theirs = e
        .snapshot(&kids[0].id, SnapshotMode::KeepRunning, Memory::Off, &scratch.join("k1.tar"))
        .unwrap();
    let again = e.restore(&theirs, &id("k-again"), &small(), Memory::Off).unwrap();
    assert_eq!(ok(&again, "cat /srv/f/mod /srv/f/new /srv/f/same"), "mod\nchanged\nnew\nsame");
    assert_ne!(sh(&again, "test -e /etc/hosts").0, 0, "the inherited deletion carries over");
    assert_eq!(ok(&again, "wc -c < /srv/f/keep"), "0");
    assert_ne!(sh(&again, "test -e /srv/f/del || test -e /srv/f/sub").0, 0);
    e.destroy(&again.id).unwrap();

    // From a snapshot too (a sandbox kept as a tar), several at once.
    let snap = e
        .snapshot(&src.id, SnapshotMode::KeepRunning, Memory::Off, &scratch.join("k.tar"))
        .unwrap();
    let more = e.restore_many(&snap, &[id("k-6"), id("k-7")], &small(), Memory::Off).unwrap();
    for copy in more {
        assert_eq!(ok(&copy, "cat /srv/f/keep /srv/f/same"), "keep\nsame");
        e.destroy(&copy.id).unwrap();
    }

    // All or none, either way: one id already taken, no copy is left.
    let clash = [id("k-4"), id("k-1"), id("k-5")];
    let forked = e.fork(&src.id, &clash, &small(), Memory::Off, &scratch.join("k2.tar"));
    assert!(matches!(forked, Err(EngineError::Exists(_))), "{forked:?}");
    let restored = e.restore_many(&snap, &clash, &small(), Memory::Off);
    assert!(matches!(restored, Err(EngineError::Exists(_))), "{restored:?}");
    let listed: Vec<_> = e.list().unwrap().into_iter().map(|b| b.id).collect();
    assert!(!listed.contains(&id("k-4")) && !listed.contains(&id("k-5")), "{listed:?}");
    assert_eq!(ok(&src, "cat /srv/f/keep"), "keep", "the source runs on");
    e.destroy(&src.id).unwrap();
    kids
}
