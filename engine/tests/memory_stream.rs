//! Memory in a snapshot's stream (`Engine::write_snapshot`): a running sandbox thaws before its
//! images go into the stream, the images are handed to the sink rather than copied into it, and
//! images written for a store that vouches for its readers restore only where it does. Apart
//! from `memory.rs` (what memory keeps) because these are about the stream itself.

mod common;

use std::time::Duration;

use common::memory::*;
use common::*;
use silk_engine::*;

/// A snapshot's stream that, at its first byte, asks whether the sandbox answers an exec
/// within 2 s (a frozen one cannot), and counts what the engine shared rather than wrote.
struct Probe<'a> {
    sandbox: &'a BoxInfo,
    answered: Option<bool>,
    bytes: Vec<u8>,
    shared: usize,
}

impl silk_engine::SnapshotSink for Probe<'_> {
    fn share(&mut self, bytes: bytes::Bytes) -> std::io::Result<()> {
        self.shared += bytes.len();
        std::io::Write::write_all(self, &bytes)
    }
}

impl std::io::Write for Probe<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.answered.is_none() {
            let (tx, rx) = std::sync::mpsc::channel();
            let sandbox = self.sandbox.clone();
            std::thread::spawn(move || tx.send(sh(&sandbox, "echo up")));
            self.answered = Some(rx.recv_timeout(Duration::from_secs(2)).is_ok());
        }
        self.bytes.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn a_running_sandbox_runs_again_before_its_memory_goes_into_the_stream() {
    let h = memory_engine();
    let g = h.golden(&[]);
    let src = h.engine.clone_golden(&g, &id("m-thaw"), &small()).unwrap();
    ok(&src, "echo on-disk > /root/file");
    ok(&src, COUNTER);
    let (pid, before) = (ok(&src, "cat /tmp/pid"), count(&src));
    let mut probe = Probe { sandbox: &src, answered: None, bytes: vec![], shared: 0 };
    let scratch = h.data.path().join("thaw.tar");
    let streamed =
        h.engine.write_snapshot(&src.id, Memory::Required, &mut probe, &scratch, None).unwrap();
    assert!(streamed.memory.kept, "{:?}", streamed.memory);
    assert_eq!(probe.answered, Some(true), "the sandbox was frozen while its memory was written");
    // The images, most of the stream, were handed over rather than written (copied).
    let (shared, all) = (probe.shared, probe.bytes.len());
    assert!(shared > all / 2, "{shared} of {all} bytes shared");
    assert!(!scratch.exists(), "the files' spool is left behind");
    // The stream is whole: files and processes of the frozen moment.
    ok(&src, "echo later > /root/file");
    let snap =
        stream_snapshot(src.base.clone(), h.data.path().join("thaw-in.tar"), probe.bytes.len());
    let copy = h.engine.read_snapshot(
        &mut &probe.bytes[..],
        &snap,
        &id("m-thaw2"),
        &small(),
        Memory::Required,
    );
    let copy = copy.unwrap();
    continues(&copy, before, &pid);
    assert_eq!(ok(&copy, "cat /root/file"), "on-disk");
}

/// A sink whose readers the store vouches for (it signs its manifests): the engine writes the
/// images with no MAC of their own.
struct ForSigningStore(Vec<u8>);

impl std::io::Write for ForSigningStore {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.write(buf)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl SnapshotSink for ForSigningStore {
    fn vouched(&self) -> bool {
        true
    }
}

/// Images with no MAC are safe only because the store vouches for every byte it gives back: a
/// reader it does not vouch for (an unsigned manifest anyone with write access to the store
/// could have made, a peer) must refuse them like images under another key.
#[test]
fn images_written_for_a_signing_store_restore_only_where_it_vouches_for_them() {
    let h = memory_engine();
    let g = h.golden(&[]);
    let src = h.engine.clone_golden(&g, &id("m-v"), &small()).unwrap();
    ok(&src, "echo files > /root/f");
    ok(&src, COUNTER);
    let (pid, before) = (ok(&src, "cat /tmp/pid"), count(&src));
    let (mut out, scratch) = (ForSigningStore(vec![]), h.data.path().join("v.tar"));
    let streamed =
        h.engine.write_snapshot(&src.id, Memory::Required, &mut out, &scratch, None).unwrap();
    assert!(streamed.memory.kept, "{:?}", streamed.memory);
    let snap = stream_snapshot(src.base.clone(), h.data.path().join("v-in.tar"), out.0.len());

    let read = |name: &str, snap: &Snapshot, memory| {
        h.engine.read_snapshot(&mut &out.0[..], snap, &id(name), &small(), memory)
    };
    let copy = read("m-v1", &snap, Memory::Auto).unwrap();
    assert!(!copy.memory.kept, "{:?}", copy.memory);
    let why = copy.memory.why_not.clone().unwrap_or_default();
    assert!(why.contains("not signed"), "{why}");
    assert_eq!(ok(&copy, "cat /root/f"), "files");
    let refused = read("m-v2", &snap, Memory::Required);
    assert!(matches!(refused, Err(EngineError::MemoryFailed(_))), "{refused:?}");

    let vouched = Snapshot { vouched: true, ..snap };
    let copy = read("m-v3", &vouched, Memory::Required).unwrap();
    continues(&copy, before, &pid);
    assert_eq!(ok(&copy, "cat /root/f"), "files");
}
