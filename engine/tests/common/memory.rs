//! What the memory tests share: a jail engine that must have CRIU, and a counter whose
//! count lives in a shell's memory.

use std::time::Duration;

use silk_engine::*;

use super::*;

/// A counter in the background: its count lives in the shell's memory and goes to /tmp every
/// 50 ms, with its pid beside it.
pub const COUNTER: &str = "sh -c 'echo $$ > /tmp/pid; i=0; while :; do i=$((i+1)); echo $i > /tmp/count; \
                       sleep 0.05; done' >/dev/null 2>&1 & sleep 0.3";

/// The counter truncates the file before it writes: a read in between finds it empty.
pub const READ_COUNT: &str = "c=; while [ -z \"$c\" ]; do c=$(cat /tmp/count); done; echo $c";

pub fn count(b: &BoxInfo) -> u64 {
    ok(b, READ_COUNT).parse().expect("a count")
}

pub fn memory_engine() -> Harness {
    let h = Harness::new();
    assert!(
        h.engine.capabilities().memory_snapshot,
        "CRIU is not usable here ({:?}); scripts/install-criu installs it",
        h.engine.memory_why_not()
    );
    h
}

/// No counter runs: what it wrote to /tmp is kept with the files, and the count stands.
pub fn stands(b: &BoxInfo) {
    let before = ok(b, "cat /tmp/count");
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(ok(b, "cat /tmp/count"), before, "the counter runs: its process was kept");
}

/// The counter runs on from `before`, in the same process.
pub fn continues(b: &BoxInfo, before: u64, pid: &str) {
    let after = count(b);
    assert!(after >= before, "the count went back from {before} to {after}: the process restarted");
    assert_eq!(ok(b, "cat /tmp/pid"), pid, "another process counts");
    std::thread::sleep(Duration::from_millis(300));
    assert!(count(b) > after, "the counter stopped");
}

/// Sandbox `name` cloned from a fresh golden on an engine with CRIU; the harness must outlive it.
pub fn memory_box(name: &str) -> (Harness, BoxInfo) {
    let h = memory_engine();
    let g = h.golden(&[]);
    let b = h.engine.clone_golden(&g, &id(name), &small()).unwrap();
    (h, b)
}

/// Wakes hibernated sandbox `id`, which must come back with its processes.
pub fn wake(h: &Harness, id: &SandboxId) -> BoxInfo {
    let woken = h.engine.resume(id).unwrap();
    assert!(woken.memory.kept, "{:?}", woken.memory);
    woken
}

/// Where a hibernated sandbox's CRIU images are.
pub fn images_dir(h: &Harness, id: &SandboxId) -> std::path::PathBuf {
    h.data.path().join("boxes").join(id.as_str()).join("memory")
}

/// The images CRIU made of the sandbox's tmpfs mounts, sorted.
pub fn tmpfs_images(h: &Harness, id: &SandboxId) -> Vec<std::path::PathBuf> {
    let dir = images_dir(h, id);
    let mut images: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.file_name().unwrap().to_string_lossy().starts_with("tmpfs"))
        .collect();
    images.sort();
    images
}

/// A snapshot with memory over `base`, read from a stream of `bytes` bytes (its tar written to
/// `layer_tar` where the engine needs a file).
pub fn stream_snapshot(base: Base, layer_tar: std::path::PathBuf, bytes: usize) -> Snapshot {
    Snapshot {
        base,
        spec: small(),
        layer_tar,
        bytes: bytes as u64,
        memory: true,
        memory_why_not: None,
        freeze_ms: None,
        vouched: false,
    }
}
