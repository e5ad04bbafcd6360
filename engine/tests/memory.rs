//! Process memory on the jail engine (CRIU, installed by scripts/test): hibernated sandboxes
//! wake with their processes where they were, snapshots carry them into copies, and what
//! cannot be kept leaves the files as they are and says why.

mod common;

use std::time::Duration;

use common::memory::*;
use common::*;
use silk_engine::*;

#[test]
fn hibernated_processes_wake_where_they_were() {
    let h = memory_engine();
    let g = h.golden(&[]);
    let a = h.engine.clone_golden(&g, &id("m-a"), &small()).unwrap();
    ok(&a, COUNTER);
    ok(&a, "python3 -m http.server 8000 --bind 127.0.0.1 >/dev/null 2>&1 &");
    let served = "python3 -c \"import urllib.request as u; \
                  print(u.urlopen('http://127.0.0.1:8000/', timeout=5).status)\"";
    // Listening before the hibernate (python takes a while to start on a busy host).
    ok(
        &a,
        &format!("for i in $(seq 100); do {served} 2>/dev/null && exit 0; sleep 0.1; done; exit 1"),
    );
    let (pid, before) = (ok(&a, "cat /tmp/pid"), count(&a));

    let kept = h.engine.stop(&a.id, Memory::Auto).unwrap();
    assert!(kept.kept, "{kept:?}");
    let woken = h.engine.resume(&a.id).unwrap();
    assert!(woken.memory.kept, "{:?}", woken.memory);
    continues(&woken, before, &pid);
    assert_eq!(ok(&woken, served), "200", "the http server inside answers after the wake");
    // Every restored process is back in the sandbox's own groups (its limits hold).
    assert_eq!(outside_own_cgroups(&woken), Vec::<String>::new());
    assert_eq!(ok(&woken, "hostname; cat /etc/hostname"), "m-a\nm-a");

    // A restarted node (a new engine on the same data) wakes it the same way.
    let before = count(&woken);
    assert!(h.engine.stop(&a.id, Memory::Required).unwrap().kept);
    let reopened = h.reopen();
    let woken = reopened.resume(&a.id).unwrap();
    assert!(woken.memory.kept, "{:?}", woken.memory);
    continues(&woken, before, &pid);

    // Off: files only, as without CRIU.
    assert!(!h.engine.stop(&a.id, Memory::Off).unwrap().kept);
    let restarted = h.engine.resume(&a.id).unwrap();
    assert!(!restarted.memory.kept);
    stands(&restarted);
}

/// An echo server and a client on one TCP connection inside the sandbox: the client counts
/// the round trips it completed into /tmp/echoed, and dies if its connection breaks.
const ECHO: &str = r#"cat > /tmp/echo.py <<'PY'
import socket, sys, time
if sys.argv[1] == "server":
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 7070)); s.listen(1); open("/tmp/listening", "w")
    c, _ = s.accept()
    while True:
        d = c.recv(64)
        if not d: break
        c.sendall(d)
else:
    c = socket.create_connection(("127.0.0.1", 7070)); n = 0
    while True:
        c.sendall(b"%d;" % n)
        if c.recv(64) != b"%d;" % n: break
        n += 1; open("/tmp/echoed.new", "w").write(str(n)); __import__("os").rename("/tmp/echoed.new", "/tmp/echoed")
        time.sleep(0.02)
PY
python3 /tmp/echo.py server >/dev/null 2>&1 &
until test -e /tmp/listening; do sleep 0.01; done
python3 /tmp/echo.py client >/dev/null 2>&1 &
until test -e /tmp/echoed; do sleep 0.01; done"#;

/// The client's round trips go on from `before` (its connection is the one it had).
fn echoes_on(b: &BoxInfo, before: u64) {
    let after: u64 = ok(b, "cat /tmp/echoed").parse().unwrap();
    assert!(after >= before, "the round trips went back from {before} to {after}");
    std::thread::sleep(Duration::from_millis(300));
    let later: u64 = ok(b, "cat /tmp/echoed").parse().unwrap();
    assert!(later > after, "the connection inside no longer carries anything ({after})");
}

#[test]
fn a_connection_inside_the_sandbox_survives_a_hibernate_and_goes_on_in_a_copy() {
    let h = memory_engine();
    let g = h.golden(&[]);
    let a = h.engine.clone_golden(&g, &id("m-e"), &small()).unwrap();
    ok(&a, ECHO);
    let before: u64 = ok(&a, "cat /tmp/echoed").parse().unwrap();

    assert!(h.engine.stop(&a.id, Memory::Required).unwrap().kept);
    let woken = h.engine.resume(&a.id).unwrap();
    assert!(woken.memory.kept, "{:?}", woken.memory);
    echoes_on(&woken, before);

    // A checkpoint leaves it running, and a copy from it carries the connection on too.
    let tar = h.data.path().join("e.tar");
    let snap = h.engine.snapshot(&a.id, SnapshotMode::KeepRunning, Memory::Required, &tar);
    let snap = snap.unwrap();
    let before: u64 = ok(&woken, "cat /tmp/echoed").parse().unwrap();
    echoes_on(&woken, before);
    let copy = h.engine.restore(&snap, &id("m-e2"), &small(), Memory::Required).unwrap();
    assert!(copy.memory.kept, "{:?}", copy.memory);
    echoes_on(&copy, 1);
}

#[test]
fn images_a_killed_node_left_beside_a_woken_box_are_neither_in_the_way_nor_restored() {
    let h = memory_engine();
    let g = h.golden(&[]);
    let a = h.engine.clone_golden(&g, &id("m-stale"), &small()).unwrap();
    ok(&a, COUNTER);
    let pid = ok(&a, "cat /tmp/pid");
    let dir = h.data.path().join("boxes").join(a.id.as_str());
    let (images, aside) = (dir.join("memory"), h.data.path().join("images-aside"));
    let copy = |from: &std::path::Path, to: &std::path::Path| {
        let copied = std::process::Command::new("cp").arg("-a").arg(from).arg(to).status();
        assert!(copied.unwrap().success(), "cp -a {from:?} {to:?}");
    };
    // What a node killed between a wake's restore and the removal of its images leaves: the
    // box running again, its old images still beside it.
    let stale_images_beside_a_woken_box = || {
        let woken = h.engine.resume(&a.id).unwrap();
        assert!(woken.memory.kept, "{:?}", woken.memory);
        assert!(!images.exists(), "a wake removes the images it restored");
        copy(&aside, &images);
        woken
    };
    assert!(h.engine.stop(&a.id, Memory::Required).unwrap().kept);
    copy(&images, &aside);
    let woken = stale_images_beside_a_woken_box();
    let before = count(&woken);

    // A stop that keeps memory writes its own images (it failed: `Directory not empty`).
    let kept = h.engine.stop(&a.id, Memory::Required).unwrap();
    assert!(kept.kept, "{kept:?}");
    let woken = h.engine.resume(&a.id).unwrap();
    continues(&woken, before, &pid);

    // A stop that keeps none wakes from the files, not from the old images (it woke the
    // processes of the first hibernation: memory from then, files from now).
    let _ = h.engine.stop(&a.id, Memory::Required).unwrap();
    stale_images_beside_a_woken_box();
    assert!(!h.engine.stop(&a.id, Memory::Off).unwrap().kept);
    let restarted = h.engine.resume(&a.id).unwrap();
    assert!(!restarted.memory.kept, "woken from images it was not stopped with");
    stands(&restarted);
}

#[test]
fn copies_from_a_snapshot_continue_its_processes_and_then_diverge() {
    let h = memory_engine();
    let g = h.golden(&[]);
    let src = h.engine.clone_golden(&g, &id("m-src"), &small()).unwrap();
    ok(&src, "echo on-disk > /root/file");
    ok(&src, COUNTER);
    let (pid, before) = (ok(&src, "cat /tmp/pid"), count(&src));
    let tar = h.data.path().join("m.tar");
    let snap = h.engine.snapshot(&src.id, SnapshotMode::KeepRunning, Memory::Auto, &tar).unwrap();
    assert!(snap.memory, "{:?}", snap.memory_why_not);
    assert!(snap.freeze_ms.is_some(), "the freeze window is reported");
    let at_snapshot = count(&src);
    // The source runs on.
    std::thread::sleep(Duration::from_millis(200));
    assert!(count(&src) > at_snapshot);

    let source_machine = ok(&src, "cat /etc/machine-id");
    let mut machines = vec![source_machine];
    // One copy on its own, two at once from the snapshot (its files shared, its images
    // linked), two forked from the running source.
    let mut copies = vec![h.engine.restore(&snap, &id("m-f1"), &small(), Memory::Auto).unwrap()];
    // One from the snapshot read as a stream (a download): its memory entry is spooled and
    // MAC-checked before CRIU sees it.
    let mut input = std::fs::File::open(&tar).unwrap();
    let streamed = Snapshot { layer_tar: h.data.path().join("m-stream.tar"), ..snap.clone() };
    let copy =
        h.engine.read_snapshot(&mut input, &streamed, &id("m-f6"), &small(), Memory::Required);
    copies.push(copy.unwrap());
    let two = [id("m-f2"), id("m-f3")];
    copies.extend(h.engine.restore_many(&snap, &two, &small(), Memory::Required).unwrap());
    let (two, scratch) = ([id("m-f4"), id("m-f5")], h.data.path().join("m-fork.tar"));
    copies.extend(h.engine.fork(&src.id, &two, &small(), Memory::Required, &scratch).unwrap());
    for copy in &copies {
        let name = copy.id.as_str();
        assert!(copy.memory.kept, "{:?}", copy.memory);
        continues(copy, before, &pid);
        assert_eq!(ok(copy, "hostname; cat /etc/hostname"), format!("{name}\n{name}"));
        assert_eq!(ok(copy, "cat /root/file"), "on-disk");
        ok(copy, &format!("echo {name} > /tmp/mine"));
        machines.push(ok(copy, "cat /etc/machine-id"));
    }
    machines.sort();
    machines.dedup();
    assert_eq!(machines.len(), 7, "every copy has its own machine id");
    for name in ["m-f1", "m-f2", "m-f3", "m-f4", "m-f5", "m-f6"] {
        let copy = h.engine.list().unwrap().into_iter().find(|b| b.id.as_str() == name).unwrap();
        assert_eq!(ok(&copy, "cat /tmp/mine"), name, "copies diverge");
    }
}

/// The forks directory's entries: kept copies and fork layers live there.
fn forks(h: &Harness) -> Vec<String> {
    let entries = std::fs::read_dir(h.data.path().join("forks")).unwrap();
    entries.map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect()
}

#[test]
fn a_copy_kept_beside_a_snapshot_starts_sandboxes_as_they_were_then_and_goes_when_dropped() {
    let h = memory_engine();
    let g = h.golden(&[]);
    let src = h.engine.clone_golden(&g, &id("m-ksrc"), &small()).unwrap();
    ok(&src, "echo on-disk > /root/file");
    ok(&src, COUNTER);
    let (pid, before) = (ok(&src, "cat /tmp/pid"), count(&src));
    let (mut stream, scratch) = (vec![], h.data.path().join("k.tar"));
    let streamed = h
        .engine
        .write_snapshot(&src.id, Memory::Auto, &mut stream, &scratch, Some("ck_1"))
        .unwrap();
    assert!(streamed.memory.kept, "{:?}", streamed.memory);
    assert!(streamed.kept.is_some_and(|bytes| bytes > 0), "{streamed:?}");
    // What the source does after the snapshot is not in the copy.
    ok(&src, "echo later > /root/file");

    let kept = h.engine.restore_kept("ck_1", &id("m-k1"), &small(), Memory::Required).unwrap();
    let kept = kept.expect("the copy kept as ck_1");
    assert!(kept.memory.kept, "{:?}", kept.memory);
    continues(&kept, before, &pid);
    assert_eq!(ok(&kept, "cat /root/file"), "on-disk");
    assert_eq!(ok(&kept, "hostname"), "m-k1");
    // The stream written beside the copy is whole: it restores too.
    let snap = stream_snapshot(src.base.clone(), h.data.path().join("k-in.tar"), stream.len());
    let read =
        h.engine.read_snapshot(&mut &stream[..], &snap, &id("m-k2"), &small(), Memory::Required);
    let read = read.unwrap();
    continues(&read, before, &pid);
    assert_eq!(ok(&read, "cat /root/file"), "on-disk");

    for unknown in ["ck_2", "../ck_1", "", "kept/ck_1"] {
        let none = h.engine.restore_kept(unknown, &id("m-kx"), &small(), Memory::Auto).unwrap();
        assert!(none.is_none(), "{unknown:?} is no kept copy");
    }
    // Dropped: no new sandbox from it, and the one running on it keeps its files until it goes.
    h.engine.drop_kept("ck_1");
    let gone = h.engine.restore_kept("ck_1", &id("m-k3"), &small(), Memory::Auto).unwrap();
    assert!(gone.is_none(), "a dropped copy started a sandbox");
    assert_eq!(ok(&kept, "cat /root/file; ls /bin/sh"), "on-disk\n/bin/sh");
    assert_eq!(forks(&h).len(), 1, "the copy's layer stays while a sandbox uses it");
    h.engine.destroy(&kept.id).unwrap();
    assert_eq!(forks(&h), Vec::<String>::new(), "the last user of a dropped copy removes it");

    // A copy no one dropped goes when the engine starts again (the node keeps no record of it).
    h.engine.write_snapshot(&src.id, Memory::Auto, &mut vec![], &scratch, Some("ck_3")).unwrap();
    assert_eq!(forks(&h).len(), 1);
    let reopened = h.reopen();
    assert_eq!(forks(&h), Vec::<String>::new());
    let none = reopened.restore_kept("ck_3", &id("m-k4"), &small(), Memory::Auto).unwrap();
    assert!(none.is_none(), "a copy outlived the engine's start");
}

#[test]
fn a_stop_snapshot_carries_memory_from_a_running_or_a_hibernated_sandbox() {
    let h = memory_engine();
    let g = h.golden(&[]);
    let a = h.engine.clone_golden(&g, &id("m-arch"), &small()).unwrap();
    ok(&a, COUNTER);
    let (pid, before) = (ok(&a, "cat /tmp/pid"), count(&a));
    let tar = h.data.path().join("arch.tar");
    let snap = h.engine.snapshot(&a.id, SnapshotMode::Stop, Memory::Auto, &tar).unwrap();
    assert!(snap.memory, "{:?}", snap.memory_why_not);
    let back = h.engine.restore(&snap, &a.id, &small(), Memory::Required).unwrap();
    continues(&back, before, &pid);

    // Hibernated in place first, then captured (archive or move of a hibernated sandbox).
    let before = count(&back);
    let kept = h.engine.stop(&a.id, Memory::Auto).unwrap();
    assert!(kept.kept, "{kept:?}");
    let snap = h.engine.snapshot(&a.id, SnapshotMode::Stop, Memory::Auto, &tar).unwrap();
    assert!(snap.memory, "{:?}", snap.memory_why_not);
    let back = h.engine.restore(&snap, &a.id, &small(), Memory::Auto).unwrap();
    continues(&back, before, &pid);
}

#[test]
fn clones_of_a_memory_golden_continue_what_its_warmup_left_running() {
    let key = [7u8; 32];
    let h = Harness::with_memory_key(key);
    // The warmup leaves a counter running: its count lives only in the shell's memory.
    let warmup = ["sh", "-c", COUNTER];
    let g = h.golden_with(&warmup, true);
    let (a, b) = (id("mg-a"), id("mg-b"));
    let a = h.engine.clone_golden(&g, &a, &small()).unwrap();
    let b = h.engine.clone_golden(&g, &b, &small()).unwrap();
    let pid = ok(&a, "cat /tmp/pid");
    for (clone, name) in [(&a, "mg-a"), (&b, "mg-b")] {
        assert!(clone.memory.kept, "{:?}", clone.memory);
        continues(clone, 1, &pid);
        assert_eq!(ok(clone, "hostname; cat /etc/hostname"), format!("{name}\n{name}"));
    }
    assert_ne!(ok(&a, "cat /etc/machine-id"), ok(&b, "cat /etc/machine-id"));
    // They diverge.
    ok(&a, "echo a > /tmp/mine");
    assert_ne!(sh(&b, "cat /tmp/mine").0, 0);

    // A files-only golden of the same warmup is another golden; its clones start fresh.
    let files = h.golden_with(&warmup, false);
    assert_ne!(files.digest, g.digest);
    let c = h.engine.clone_golden(&files, &id("mg-c"), &small()).unwrap();
    assert!(!c.memory.kept);
    stands(&c);

    // Exported and installed on another node of the fleet, it keeps its memory there; on a
    // node of another fleet (another key) it is files only.
    let tar = h.data.path().join("golden.tar");
    h.engine.export_golden(&g, &tar).unwrap();
    for (peer, kept) in [(Harness::with_memory_key(key), true), (Harness::new(), false)] {
        let there = peer.engine.import_golden(&g.template, &g.digest, &tar).unwrap();
        let d = peer.engine.clone_golden(&there, &id("mg-d"), &small()).unwrap();
        assert_eq!(d.memory.kept, kept, "{:?}", d.memory);
        if kept {
            continues(&d, 1, &pid);
        }
    }
}

#[test]
fn what_cannot_be_dumped_keeps_the_files_and_says_why() {
    let h = memory_engine();
    let g = h.golden(&[]);
    let a = h.engine.clone_golden(&g, &id("m-fail"), &small()).unwrap();
    ok(&a, "echo kept > /root/marker");
    ok(&a, COUNTER);
    // An open file that was deleted, bigger than CRIU will carry (its ghost limit).
    ok(
        &a,
        "dd if=/dev/zero of=/tmp/big bs=1M count=80 2>/dev/null; \
         sh -c 'exec 3</tmp/big; rm /tmp/big; sleep 1000' >/dev/null 2>&1 & sleep 0.3",
    );
    let before = count(&a);

    let refused = h.engine.stop(&a.id, Memory::Required).unwrap_err();
    assert!(matches!(refused, EngineError::MemoryFailed(_)), "{refused}");
    // Nothing changed: it runs on, its processes too.
    let running = h.engine.list().unwrap().into_iter().find(|b| b.id == a.id).unwrap();
    assert!(running.running);
    assert!(count(&running) >= before);
    let tar = h.data.path().join("f.tar");
    let refused = h.engine.snapshot(&a.id, SnapshotMode::KeepRunning, Memory::Required, &tar);
    assert!(matches!(refused, Err(EngineError::MemoryFailed(_))));
    assert!(!tar.exists());

    let kept = h.engine.stop(&a.id, Memory::Auto).unwrap();
    assert!(!kept.kept);
    assert!(kept.why_not.as_deref().is_some_and(|w| !w.is_empty()), "{kept:?}");
    let woken = h.engine.resume(&a.id).unwrap();
    assert_eq!(ok(&woken, "cat /root/marker"), "kept", "the files are all there");
    stands(&woken);
}

#[test]
fn memory_images_from_elsewhere_are_never_given_to_criu() {
    let h = memory_engine();
    let g = h.golden(&[]);
    let a = h.engine.clone_golden(&g, &id("m-x"), &small()).unwrap();
    ok(&a, "echo files > /root/f");
    ok(&a, COUNTER);
    let tar = h.data.path().join("x.tar");
    let snap = h.engine.snapshot(&a.id, SnapshotMode::KeepRunning, Memory::Auto, &tar).unwrap();
    assert!(snap.memory);

    // Another engine (another fleet's key) restores the files only, and says why.
    let other = memory_engine();
    let og = other.golden(&[]);
    let theirs =
        Snapshot { base: Base { template: og.template.clone(), golden: Some(og) }, ..snap.clone() };
    let copy = other.engine.restore(&theirs, &id("m-y"), &small(), Memory::Auto).unwrap();
    assert!(!copy.memory.kept);
    assert!(
        copy.memory.why_not.as_deref().unwrap_or_default().contains("MAC"),
        "{:?}",
        copy.memory
    );
    assert_eq!(ok(&copy, "cat /root/f"), "files");
    let refused = other.engine.restore(&theirs, &id("m-z"), &small(), Memory::Required);
    assert!(matches!(refused, Err(EngineError::MemoryFailed(_))));
    assert!(other.engine.list().unwrap().iter().all(|b| b.id.as_str() != "m-z"));

    // A tampered image (one byte of its pages) fails the same way here.
    let mut bytes = std::fs::read(&tar).unwrap();
    bytes[4096] ^= 0xff;
    let tampered = h.data.path().join("t.tar");
    std::fs::write(&tampered, bytes).unwrap();
    let forged = Snapshot { layer_tar: tampered.clone(), ..snap.clone() };
    let copy = h.engine.restore(&forged, &id("m-t"), &small(), Memory::Auto).unwrap();
    assert!(!copy.memory.kept, "{:?}", copy.memory);
    // And read as a stream, where the images are unpacked before their MAC is known.
    let mut input = std::fs::File::open(&tampered).unwrap();
    let streamed = Snapshot { layer_tar: h.data.path().join("t-stream.tar"), ..snap };
    let copy = h.engine.read_snapshot(&mut input, &streamed, &id("m-ts"), &small(), Memory::Auto);
    let copy = copy.unwrap();
    assert!(
        copy.memory.why_not.as_deref().unwrap_or_default().contains("MAC"),
        "{:?}",
        copy.memory
    );
    assert_eq!(ok(&copy, "cat /root/f"), "files");
    let mut input = std::fs::File::open(&tampered).unwrap();
    let refused =
        h.engine.read_snapshot(&mut input, &streamed, &id("m-tr"), &small(), Memory::Required);
    assert!(matches!(refused, Err(EngineError::MemoryFailed(_))));
    assert!(h.engine.list().unwrap().iter().all(|b| b.id.as_str() != "m-tr"));
}

/// A memory entry the store forged: its images are unpacked as they arrive, before their MAC is
/// known, so a name in them must not reach outside the box's image directory, and nothing of
/// them may stay once the MAC fails.
#[test]
fn a_forged_memory_entry_writes_nothing_outside_its_directory_and_leaves_nothing() {
    let h = memory_engine();
    let g = h.golden(&[]);
    let mut images = tar::Builder::new(Vec::new());
    for (name, body) in [("pages-1.img", &b"forged pages"[..]), ("../../../victim", b"escaped")] {
        let mut header = tar::Header::new_old();
        header.as_old_mut().name[..name.len()].copy_from_slice(name.as_bytes());
        header.set_size(body.len() as u64);
        header.set_mode(0o600);
        header.set_entry_type(tar::EntryType::Regular);
        header.set_cksum();
        images.append(&header, body).unwrap();
    }
    let mut inner = images.into_inner().unwrap();
    inner.extend_from_slice(&[7u8; 32]); // a MAC no fleet made
    let mut entry = tar::Header::new_old();
    entry.as_old_mut().name[..18].copy_from_slice(b"../silkmesh-memory");
    entry.set_size(inner.len() as u64);
    entry.set_mode(0o600);
    entry.set_entry_type(tar::EntryType::Regular);
    entry.set_cksum();
    let mut forged = entry.as_bytes().to_vec();
    forged.extend_from_slice(&inner);
    forged.resize(forged.len().div_ceil(512) * 512, 0);
    forged.extend_from_slice(&[0u8; 1024]); // the layer: an empty tar

    let snap = stream_snapshot(
        Base { template: g.template.clone(), golden: Some(g) },
        h.data.path().join("forged-stream.tar"),
        forged.len(),
    );
    let b = h.engine.read_snapshot(&mut &forged[..], &snap, &id("m-f"), &small(), Memory::Auto);
    let b = b.unwrap();
    assert!(b.memory.why_not.as_deref().unwrap_or_default().contains("MAC"), "{:?}", b.memory);
    let boxes = h.data.path().join("boxes");
    for escaped in ["victim", "m-f/victim", "../victim"] {
        assert!(!boxes.join(escaped).exists(), "{escaped} was written");
    }
    assert!(!boxes.join("m-f/memory").exists(), "the forged images stayed");
    ok(&b, "true");
}

#[test]
fn an_engine_without_criu_says_why() {
    let data = tempfile::tempdir().unwrap();
    let mut cfg = silk_engine::jail::JailConfig::new(
        data.path(),
        static_silkd(),
        env!("CARGO_BIN_EXE_silk-jail"),
    );
    cfg.criu = Some("/nonexistent/criu".into());
    let engine = silk_engine::jail::JailEngine::new(cfg).unwrap();
    assert!(!engine.capabilities().memory_snapshot);
    assert!(engine.memory_why_not().unwrap().contains("/nonexistent/criu"));
}

/// The jail's one tmpfs, `/dev/shm`, empty (as it is most of the time): its image is the
/// archive GNU tar writes of its root alone, byte for byte (so any CRIU restores it), made
/// without running tar (scripts/criu-tmpfs-without-tar.patch), and a wake gives the root back
/// its owner, mode and mtime.
#[test]
fn an_empty_dev_shm_comes_back_with_its_roots_owner_mode_and_time() {
    let (h, b) = memory_box("m-shm");
    ok(&b, COUNTER);
    ok(&b, "chown 1000:1001 /dev/shm && chmod 1750 /dev/shm && touch -d @1500000000 /dev/shm");
    let stat = "stat -c '%u %g %a %Y' /dev/shm";
    assert_eq!(ok(&b, stat), "1000 1001 1750 1500000000");
    let (pid, before) = (ok(&b, "cat /tmp/pid"), count(&b));
    assert!(h.engine.stop(&b.id, Memory::Required).unwrap().kept);

    let images = tmpfs_images(&h, &b.id);
    assert_eq!(images.len(), 1, "{images:?}");
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("shm");
    std::fs::create_dir(&dir).unwrap();
    std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o1750)).unwrap();
    let touched =
        std::process::Command::new("touch").args(["-d", "@1500000000"]).arg(&dir).status();
    assert!(touched.unwrap().success());
    // What CRIU runs, as the sandbox's root would see the directory.
    let tar = std::process::Command::new("tar")
        .args(["--create", "--no-unquote", "--no-wildcards", "--one-file-system"])
        .args(["--check-links", "--preserve-permissions", "--sparse", "--numeric-owner"])
        .args(["--owner=1000", "--group=1001", "--directory"])
        .arg(&dir)
        .arg(".")
        .output()
        .unwrap();
    assert!(tar.status.success(), "{tar:?}");
    assert!(std::fs::read(&images[0]).unwrap() == tar.stdout, "not the archive tar writes");

    let woken = wake(&h, &b.id);
    continues(&woken, before, &pid);
    assert_eq!(ok(&woken, stat), "1000 1001 1750 1500000000");
}
