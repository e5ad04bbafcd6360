//! Disk limits, on a data directory the test makes on a loop-mounted btrfs filesystem: a
//! sandbox that fills its disk stops at its tier's limit with EDQUOT, and its neighbour and the
//! host filesystem go on.

mod common;

use std::path::PathBuf;
use std::process::Command;

use common::*;
use silk_engine::jail::{DiskSizes, JailConfig, JailEngine};
use silk_engine::*;

/// A filesystem in an image file, loop-mounted for the test's life.
struct LoopFs {
    _dir: tempfile::TempDir,
    mnt: PathBuf,
}

impl LoopFs {
    fn btrfs() -> LoopFs {
        let dir = tempfile::tempdir().unwrap();
        let (img, mnt) = (dir.path().join("fs.img"), dir.path().join("mnt"));
        std::fs::File::create(&img).unwrap().set_len(1 << 30).unwrap();
        let mkfs = Command::new("mkfs.btrfs").arg("-q").arg(&img).status();
        assert!(
            mkfs.is_ok_and(|s| s.success()),
            "mkfs.btrfs failed: run scripts/install-test-deps (btrfs-progs)"
        );
        std::fs::create_dir(&mnt).unwrap();
        let mount = Command::new("mount").args(["-o", "loop"]).arg(&img).arg(&mnt).status();
        assert!(mount.is_ok_and(|s| s.success()), "mount -o loop failed");
        LoopFs { _dir: dir, mnt }
    }
}

impl Drop for LoopFs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.mnt).status();
    }
}

#[test]
fn a_sandbox_fills_its_disk_to_the_tier_limit_and_no_further() {
    let fs = LoopFs::btrfs();
    let mut cfg =
        JailConfig::new(fs.mnt.join("data"), static_silkd(), env!("CARGO_BIN_EXE_silk-jail"));
    cfg.disk = DiskSizes { small: 64 << 20, medium: 128 << 20, large: 256 << 20 };
    let engine = JailEngine::new(cfg).unwrap();
    let caps = engine.capabilities();
    assert!(caps.disk_limit);
    assert_eq!(caps.disk_mechanism, DiskMechanism::BtrfsQgroup);

    let template = engine.template(&TemplateDef::host()).unwrap();
    let golden = engine.prepare(&template, &Warmup::default()).unwrap();
    let a = engine.clone_golden(&golden, &id("disk-a"), &small()).unwrap();
    let b = engine.clone_golden(&golden, &id("disk-b"), &small()).unwrap();

    let (code, out) = sh(&a, "dd if=/dev/zero of=/root/fill bs=1M count=200 2>&1; sync");
    assert!(out.contains("Disk quota exceeded"), "exit {code}: {out}");
    let filled: u64 = ok(&a, "stat -c %s /root/fill").parse().unwrap();
    assert!(filled <= 64 << 20, "the sandbox wrote {filled} bytes past a 64 MiB limit");
    assert!(filled > 32 << 20, "the limit cut in early: {filled} bytes");
    // The neighbour has its own disk; the node's filesystem has room.
    assert_eq!(
        ok(&b, "head -c 10485760 /dev/zero > /root/ten && stat -c %s /root/ten"),
        "10485760"
    );
    std::fs::write(fs.mnt.join("host-file"), vec![0u8; 1 << 20]).unwrap();
    // Freeing space inside lets it write again.
    ok(&a, "rm /root/fill && sync && head -c 1048576 /dev/zero > /root/again");

    // A snapshot restores into a bounded disk too, and removal takes the subvolume.
    let snap = engine.snapshot(&a.id, SnapshotMode::KeepRunning, &fs.mnt.join("a.tar")).unwrap();
    let c = engine.restore(&snap, &id("disk-c"), &small()).unwrap();
    let (_, out) = sh(&c, "dd if=/dev/zero of=/root/fill bs=1M count=200 2>&1");
    assert!(out.contains("Disk quota exceeded"), "{out}");
    for info in [&a, &b, &c] {
        engine.destroy(&info.id).unwrap();
        assert!(!fs.mnt.join("data/boxes").join(info.id.as_str()).exists());
    }
}
