//! Disk limits, on data directories the tests make on loop-mounted btrfs and ext4 filesystems:
//! a sandbox that fills its disk stops at its tier's limit (EDQUOT on btrfs, ENOSPC in its
//! ext4 image), and its neighbour and the host filesystem go on.

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
    fn new(mkfs: &str, args: &[&str]) -> LoopFs {
        let dir = tempfile::tempdir().unwrap();
        let (img, mnt) = (dir.path().join("fs.img"), dir.path().join("mnt"));
        std::fs::File::create(&img).unwrap().set_len(1 << 30).unwrap();
        let made = Command::new(mkfs).args(args).arg(&img).status();
        assert!(made.is_ok_and(|s| s.success()), "{mkfs} failed: run scripts/install-test-deps");
        std::fs::create_dir(&mnt).unwrap();
        let mount = Command::new("mount").args(["-o", "loop"]).arg(&img).arg(&mnt).status();
        assert!(mount.is_ok_and(|s| s.success()), "mount -o loop failed");
        LoopFs { _dir: dir, mnt }
    }

    fn engine(&self) -> JailEngine {
        let mut cfg =
            JailConfig::new(self.mnt.join("data"), static_silkd(), env!("CARGO_BIN_EXE_silk-jail"));
        cfg.disk = DiskSizes { small: 64 << 20, medium: 128 << 20, large: 256 << 20 };
        JailEngine::new(cfg).unwrap()
    }

    /// Mount points under the data directory (the sandboxes' images, the stock).
    fn mounts(&self) -> Vec<String> {
        let table = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
        let data = self.mnt.join("data");
        table
            .lines()
            .filter_map(|l| l.split(' ').nth(4))
            .filter(|t| std::path::Path::new(t).starts_with(&data))
            .map(str::to_string)
            .collect()
    }
}

impl Drop for LoopFs {
    fn drop(&mut self) {
        // A test that failed half way leaves sandboxes: they go first (through the engine, as
        // a node would), or their disks keep this filesystem busy.
        if self.mnt.join("data/boxes").is_dir() {
            let engine = self.engine();
            for b in engine.list().unwrap_or_default() {
                let _ = engine.destroy(&b.id);
            }
        }
        silk_engine::jail::unmount_under(&self.mnt);
    }
}

#[test]
fn on_btrfs_a_sandbox_fills_its_disk_to_the_tier_limit_and_no_further() {
    let fs = LoopFs::new("mkfs.btrfs", &["-q"]);
    let engine = fs.engine();
    let caps = engine.capabilities();
    assert!(caps.disk_limit);
    assert_eq!(caps.disk_mechanism, DiskMechanism::BtrfsQgroup);
    fills_to_the_limit(&fs, &engine, "Disk quota exceeded");
}

#[test]
fn on_ext4_a_sandbox_fills_its_image_to_the_tier_limit_and_no_further() {
    let fs = LoopFs::new("mkfs.ext4", &["-q"]);
    let engine = fs.engine();
    let caps = engine.capabilities();
    assert!(caps.disk_limit);
    assert_eq!(caps.disk_mechanism, DiskMechanism::Ext4Image);
    fills_to_the_limit(&fs, &engine, "No space left on device");
    // What its sandboxes are told (btrfs's df does not show qgroup limits): a disk of the tier's
    // size.
    let template = engine.template(&TemplateDef::host()).unwrap();
    let a = engine.boot(&template, &id("disk-df"), &small()).unwrap();
    let total_kib: u64 = ok(&a, "df -k / | tail -1 | awk '{print $2}'").parse().unwrap();
    assert!((48 << 10..=64 << 10).contains(&total_kib), "df says {total_kib} KiB");
    engine.destroy(&a.id).unwrap();
    drop(engine);
    assert_eq!(fs.mounts(), Vec::<String>::new(), "the engine left mounts behind");
}

fn fills_to_the_limit(fs: &LoopFs, engine: &JailEngine, full: &str) {
    let template = engine.template(&TemplateDef::host()).unwrap();
    let golden = engine.prepare(&template, &Warmup::default()).unwrap();
    let a = engine.clone_golden(&golden, &id("disk-a"), &small()).unwrap();
    let b = engine.clone_golden(&golden, &id("disk-b"), &small()).unwrap();

    let (code, out) = sh(&a, "dd if=/dev/zero of=/root/fill bs=1M count=200 2>&1; sync");
    assert!(out.contains(full), "exit {code}: {out}");
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

    // A snapshot restores into a bounded disk too, and removal takes the disk with the box.
    let snap = engine
        .snapshot(&a.id, SnapshotMode::KeepRunning, Memory::Off, &fs.mnt.join("a.tar"))
        .unwrap();
    let c = engine.restore(&snap, &id("disk-c"), &small(), Memory::Off).unwrap();
    assert_eq!(ok(&c, "stat -c %s /root/again"), "1048576");
    let (_, out) = sh(&c, "dd if=/dev/zero of=/root/fill bs=1M count=200 2>&1");
    assert!(out.contains(full), "{out}");
    for info in [&a, &b, &c] {
        engine.destroy(&info.id).unwrap();
        let dir = fs.mnt.join("data/boxes").join(info.id.as_str());
        assert!(!dir.exists());
        assert!(!fs.mounts().iter().any(|m| m.starts_with(dir.to_str().unwrap())), "{dir:?}");
    }
}

#[test]
fn an_image_unmounted_by_a_reboot_is_mounted_again_and_keeps_its_files() {
    let fs = LoopFs::new("mkfs.ext4", &["-q"]);
    let engine = fs.engine();
    let template = engine.template(&TemplateDef::host()).unwrap();
    let a = engine.boot(&template, &id("disk-r"), &small()).unwrap();
    ok(&a, "echo kept > /root/note && sync");
    engine.stop(&a.id, Memory::Off).unwrap();
    drop(engine);
    // What a host reboot leaves: the box's files in its image, nothing mounted.
    let disk = fs.mnt.join("data/boxes/disk-r/disk");
    silk_engine::jail::unmount_under(&disk);
    assert!(!fs.mounts().iter().any(|m| m.ends_with("disk-r/disk")));

    let engine = fs.engine();
    let a = engine.resume(&id("disk-r")).unwrap();
    assert_eq!(ok(&a, "cat /root/note"), "kept");
    let (_, out) = sh(&a, "dd if=/dev/zero of=/root/fill bs=1M count=200 2>&1");
    assert!(out.contains("No space left on device"), "{out}");
    engine.destroy(&a.id).unwrap();
}

#[test]
fn new_sandboxes_take_images_made_ahead() {
    let fs = LoopFs::new("mkfs.ext4", &["-q"]);
    let engine = fs.engine();
    let template = engine.template(&TemplateDef::host()).unwrap();
    let first = engine.boot(&template, &id("disk-s1"), &small()).unwrap();
    // The first small sandbox made its image itself and asked for a stock of them.
    let stocked = || fs.mounts().iter().filter(|m| m.contains("/data/disks/")).count();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while stocked() < 2 {
        assert!(std::time::Instant::now() < deadline, "no stock after 20 s: {:?}", fs.mounts());
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let stock_images = || -> Vec<u64> {
        use std::os::unix::fs::MetadataExt;
        let mut inodes = vec![];
        for instance in std::fs::read_dir(fs.mnt.join("data/disks")).unwrap().flatten() {
            for entry in std::fs::read_dir(instance.path()).unwrap().flatten() {
                if let Ok(m) = std::fs::metadata(entry.path().join("disk.img")) {
                    inodes.push(m.ino());
                }
            }
        }
        inodes
    };
    let mut before = stock_images();
    before.sort();
    // An id in use: refused, and neither its box nor the stock loses anything.
    ok(&first, "echo mine > /root/first");
    let again = engine.boot(&template, &id("disk-s1"), &small());
    assert!(matches!(again, Err(EngineError::Exists(_))), "{again:?}");
    let mut after = stock_images();
    after.sort();
    assert_eq!(after, before, "the stock lost a box to a refused id");
    assert_eq!(ok(&first, "cat /root/first"), "mine");
    let second = engine.boot(&template, &id("disk-s2"), &small()).unwrap();
    let taken = std::os::unix::fs::MetadataExt::ino(
        &std::fs::metadata(fs.mnt.join("data/boxes/disk-s2/disk.img")).unwrap(),
    );
    assert!(before.contains(&taken), "disk-s2's image {taken} is not one of {before:?}");
    let (_, out) = sh(&second, "dd if=/dev/zero of=/root/fill bs=1M count=200 2>&1");
    assert!(out.contains("No space left on device"), "{out}");
    // Each has its own filesystem.
    ok(&first, "echo one > /root/mine");
    assert_eq!(sh(&second, "cat /root/mine").0, 1);
    for info in [&first, &second] {
        engine.destroy(&info.id).unwrap();
    }
}

#[test]
fn a_disk_in_use_is_never_mounted_twice_and_a_box_without_its_image_file_still_goes() {
    let fs = LoopFs::new("mkfs.ext4", &["-q"]);
    let engine = fs.engine();
    let template = engine.template(&TemplateDef::host()).unwrap();
    let a = engine.boot(&template, &id("disk-u"), &small()).unwrap();
    ok(&a, "echo live > /root/note");
    // The host's mount goes while the jail still writes through its own (an operator's
    // `umount -l`): the image is attached and in use, and a new engine must leave it alone.
    let disk = fs.mnt.join("data/boxes/disk-u/disk");
    silk_engine::jail::unmount_under(&disk);
    drop(engine);
    let engine = fs.engine();
    assert!(!fs.mounts().iter().any(|m| m.ends_with("disk-u/disk")), "mounted a second time");
    assert_eq!(ok(&a, "cat /root/note"), "live");
    engine.destroy(&a.id).unwrap();

    // A box whose image file went (an operator's `rm`) while its disk is mounted: removal
    // unmounts whatever is mounted there.
    let b = engine.boot(&template, &id("disk-v"), &small()).unwrap();
    std::fs::remove_file(fs.mnt.join("data/boxes/disk-v/disk.img")).unwrap();
    engine.destroy(&b.id).unwrap();
    assert!(!fs.mnt.join("data/boxes/disk-v").exists());
    assert!(!fs.mounts().iter().any(|m| m.contains("disk-v")));
}

#[test]
fn a_stock_a_killed_node_left_is_unmounted_and_removed_whatever_build_made_it() {
    let fs = LoopFs::new("mkfs.ext4", &["-q"]);
    // What a node killed with its stock full leaves, in this build's layout (`disk`) and in
    // the one before (`mnt`): mounted entries of an instance whose lock nobody holds.
    let disks = fs.mnt.join("data/disks/1-dead");
    for (entry, at) in [("0", "disk"), ("1", "mnt")] {
        let mount_at = disks.join(entry).join(at);
        std::fs::create_dir_all(&mount_at).unwrap();
        std::fs::File::create(disks.join(entry).join("disk.img")).unwrap();
        let mounted = Command::new("mount").args(["-t", "tmpfs", "left"]).arg(&mount_at).status();
        assert!(mounted.is_ok_and(|s| s.success()));
    }
    std::fs::File::create(disks.join("lock")).unwrap();
    assert_eq!(fs.mounts().iter().filter(|m| m.contains("1-dead")).count(), 2);
    let _engine = fs.engine();
    assert!(!fs.mounts().iter().any(|m| m.contains("1-dead")), "{:?}", fs.mounts());
    assert!(!disks.exists(), "the dead stock's directory is still there");
}
