//! Hostile tars against the extractor.

use std::os::unix::fs::{MetadataExt, symlink};
use std::path::PathBuf;

use super::*;

/// An archive built entry by entry, names and link names written raw and unchecked, as a
/// hostile tool would.
struct Tar(tar::Builder<Vec<u8>>);

impl Tar {
    fn new() -> Tar {
        Tar(tar::Builder::new(Vec::new()))
    }

    fn entry(mut self, kind: EntryType, name: &str, link: &str, mode: u32, data: &[u8]) -> Tar {
        let mut h = Header::new_gnu();
        h.set_entry_type(kind);
        h.set_mode(mode);
        h.set_size(data.len() as u64);
        h.set_mtime(1_600_000_000);
        let raw = h.as_old_mut();
        raw.name[..name.len()].copy_from_slice(name.as_bytes());
        raw.linkname[..link.len()].copy_from_slice(link.as_bytes());
        h.set_cksum();
        self.0.append(&h, data).unwrap();
        self
    }

    fn file(self, name: &str, mode: u32, data: &[u8]) -> Tar {
        self.entry(EntryType::Regular, name, "", mode, data)
    }

    fn dir(self, name: &str, mode: u32) -> Tar {
        self.entry(EntryType::Directory, name, "", mode, b"")
    }

    fn symlink(self, name: &str, target: &str) -> Tar {
        self.entry(EntryType::Symlink, name, target, 0o777, b"")
    }

    fn hard_link(self, name: &str, target: &str) -> Tar {
        self.entry(EntryType::Link, name, target, 0o644, b"")
    }

    fn bytes(self) -> Vec<u8> {
        self.0.into_inner().unwrap()
    }

    fn unpack(self, dest: &Path) -> PullReport {
        unpack_tree(&self.bytes()[..], dest).unwrap()
    }
}

/// `parent/dest`, the destination (not created), beside `parent/outside/secret`, which no
/// archive may touch.
struct Fixture {
    _parent: tempfile::TempDir,
    dest: PathBuf,
    outside: PathBuf,
}

fn fixture() -> Fixture {
    let parent = tempfile::tempdir().unwrap();
    let dest = parent.path().join("dest");
    let outside = parent.path().join("outside");
    std::fs::create_dir(&outside).unwrap();
    std::fs::write(outside.join("secret"), "secret").unwrap();
    Fixture { _parent: parent, dest, outside }
}

impl Fixture {
    /// Nothing appeared beside `dest`, and `outside` holds its one file, unchanged and not
    /// hard-linked.
    fn assert_contained(&self) {
        let names = |dir: &Path| {
            let mut names: Vec<String> = std::fs::read_dir(dir)
                .unwrap()
                .map(|e| e.unwrap().file_name().into_string().unwrap())
                .collect();
            names.sort();
            names
        };
        assert_eq!(names(self.dest.parent().unwrap()), ["dest", "outside"]);
        assert_eq!(names(&self.outside), ["secret"]);
        let secret = self.outside.join("secret");
        assert_eq!(std::fs::read(&secret).unwrap(), b"secret");
        assert_eq!(std::fs::metadata(&secret).unwrap().nlink(), 1);
    }

    fn outside_str(&self) -> &str {
        self.outside.to_str().unwrap()
    }
}

fn mode(path: &Path) -> u32 {
    std::fs::symlink_metadata(path).unwrap().permissions().mode() & 0o7777
}

fn is_symlink(path: &Path) -> bool {
    std::fs::symlink_metadata(path).unwrap().file_type().is_symlink()
}

#[test]
fn absolute_paths_and_dot_dot_are_skipped() {
    let f = fixture();
    let absolute = format!("{}/abs", f.outside_str());
    let report = Tar::new()
        .file("../escaped", 0o644, b"x")
        .file("a/../../escaped", 0o644, b"x")
        .dir("../outside/d", 0o755)
        .file(&absolute, 0o644, b"x")
        .file("./ok", 0o644, b"fine")
        .unpack(&f.dest);
    assert_eq!(report.skipped_unsafe_paths, 4);
    assert_eq!(report.skipped(), 4);
    assert_eq!(std::fs::read(f.dest.join("ok")).unwrap(), b"fine");
    assert!(!f.dest.join("a").exists());
    f.assert_contained();
}

#[test]
fn a_symlink_from_the_stream_is_never_written_through() {
    let f = fixture();
    let report = Tar::new()
        .symlink("link", f.outside_str())
        .file("link/pwned", 0o644, b"x")
        .dir("link/sub", 0o755)
        .file("link/sub/deeper", 0o644, b"x")
        // A dangling symlink, then a file of the same name: the file replaces the symlink.
        .symlink("rel", "../outside/victim")
        .file("rel", 0o644, b"replaced")
        .unpack(&f.dest);
    assert_eq!(report.skipped_unsafe_paths, 3);
    assert_eq!(std::fs::read_link(f.dest.join("link")).unwrap(), f.outside);
    assert!(!is_symlink(&f.dest.join("rel")));
    assert_eq!(std::fs::read(f.dest.join("rel")).unwrap(), b"replaced");
    f.assert_contained();
}

#[test]
fn a_symlink_already_in_the_destination_is_never_written_through() {
    let f = fixture();
    std::fs::create_dir(&f.dest).unwrap();
    symlink(&f.outside, f.dest.join("pre")).unwrap();
    symlink(f.outside.join("secret"), f.dest.join("to-secret")).unwrap();
    symlink(f.outside.join("victim"), f.dest.join("dangling")).unwrap();
    let report = Tar::new()
        .file("pre/pwned", 0o644, b"x")
        .dir("pre/d", 0o755)
        .file("to-secret", 0o644, b"overwritten?")
        .file("dangling", 0o644, b"replaced")
        .unpack(&f.dest);
    assert_eq!(report.skipped_unsafe_paths, 2);
    assert!(is_symlink(&f.dest.join("pre")));
    for name in ["to-secret", "dangling"] {
        assert!(!is_symlink(&f.dest.join(name)), "{name}");
    }
    assert_eq!(std::fs::read(f.dest.join("dangling")).unwrap(), b"replaced");
    f.assert_contained();
}

#[test]
fn hard_links_must_name_a_file_this_pull_extracted() {
    let f = fixture();
    std::fs::create_dir(&f.dest).unwrap();
    std::fs::write(f.dest.join("preexisting"), "p").unwrap();
    let absolute = format!("{}/secret", f.outside_str());
    let report = Tar::new()
        .hard_link("a", "../outside/secret")
        .hard_link("b", &absolute)
        .hard_link("c", "/etc/passwd")
        .hard_link("d", "preexisting")
        .hard_link("e", "missing")
        .symlink("s", "../outside/secret")
        .hard_link("g", "s")
        .unpack(&f.dest);
    assert_eq!(report.skipped_links, 6);
    for name in ["a", "b", "c", "d", "e", "g"] {
        assert!(f.dest.join(name).symlink_metadata().is_err(), "{name}");
    }
    assert!(is_symlink(&f.dest.join("s")));
    assert_eq!(std::fs::metadata(f.dest.join("preexisting")).unwrap().nlink(), 1);
    f.assert_contained();
}

#[test]
fn set_id_bits_are_cleared() {
    let f = fixture();
    let report = Tar::new()
        .file("suid", 0o4755, b"x")
        .file("sgid", 0o2755, b"x")
        .file("sticky", 0o1644, b"x")
        .dir("gdir", 0o2775)
        .dir("tmp", 0o1777)
        .unpack(&f.dest);
    assert_eq!(report.cleared_setid, 3);
    assert_eq!(report.skipped(), 0);
    assert_eq!(mode(&f.dest.join("suid")), 0o755);
    assert_eq!(mode(&f.dest.join("sgid")), 0o755);
    assert_eq!(mode(&f.dest.join("sticky")), 0o644);
    assert_eq!(mode(&f.dest.join("gdir")), 0o775);
    assert_eq!(mode(&f.dest.join("tmp")), 0o1777);
}

#[test]
fn devices_and_fifos_are_skipped() {
    let f = fixture();
    let report = Tar::new()
        .entry(EntryType::Char, "null", "", 0o666, b"")
        .entry(EntryType::Block, "sda", "", 0o660, b"")
        .entry(EntryType::Fifo, "fifo", "", 0o644, b"")
        .file("after", 0o644, b"ok")
        .unpack(&f.dest);
    assert_eq!((report.skipped_devices, report.skipped_fifos, report.skipped()), (2, 1, 3));
    for name in ["null", "sda", "fifo"] {
        assert!(f.dest.join(name).symlink_metadata().is_err(), "{name}");
    }
    assert_eq!(std::fs::read(f.dest.join("after")).unwrap(), b"ok");
}

#[test]
fn a_normal_tree_extracts_exactly() {
    let f = fixture();
    std::fs::create_dir(&f.dest).unwrap();
    std::fs::set_permissions(&f.dest, Permissions::from_mode(0o751)).unwrap();
    let report = Tar::new()
        .dir("./", 0o700)
        .dir("./d", 0o750)
        .dir("./d/ro", 0o555)
        .file("./d/ro/f", 0o600, b"inside a read-only directory")
        .file("./run.sh", 0o755, b"#!/bin/sh\n")
        .file("./implicit/parent/file", 0o644, b"deep")
        .symlink("./d/link", "../run.sh")
        .symlink("./abs", "/etc/hostname")
        .hard_link("./d/hard", "./run.sh")
        .unpack(&f.dest);
    assert_eq!(report, PullReport::default());
    let d = &f.dest;
    assert_eq!(mode(&d.join("d")), 0o750);
    assert_eq!(mode(&d.join("d/ro")), 0o555);
    assert_eq!(mode(&d.join("d/ro/f")), 0o600);
    assert_eq!(std::fs::read(d.join("d/ro/f")).unwrap(), b"inside a read-only directory");
    assert_eq!(mode(&d.join("run.sh")), 0o755);
    assert_eq!(std::fs::read(d.join("implicit/parent/file")).unwrap(), b"deep");
    assert_eq!(std::fs::read_link(d.join("d/link")).unwrap(), Path::new("../run.sh"));
    assert_eq!(std::fs::read_link(d.join("abs")).unwrap(), Path::new("/etc/hostname"));
    let run = d.join("run.sh").metadata().unwrap();
    let hard = d.join("d/hard").metadata().unwrap();
    assert_eq!((run.ino(), run.nlink()), (hard.ino(), 2));
    assert_eq!(run.mtime(), 1_600_000_000);
    assert_eq!(d.join("d").metadata().unwrap().mtime(), 1_600_000_000);
    assert_eq!(d.join("d/link").symlink_metadata().unwrap().mtime(), 1_600_000_000);
    // The destination keeps its own mode (a `./` entry does not change it).
    assert_eq!(mode(d), 0o751);
    std::fs::set_permissions(d.join("d/ro"), Permissions::from_mode(0o755)).unwrap();
    f.assert_contained();
}

#[test]
fn a_single_file_replaces_a_symlink_and_loses_set_id() {
    let f = fixture();
    std::fs::create_dir(&f.dest).unwrap();
    let target = f.dest.join("out");
    symlink(f.outside.join("secret"), &target).unwrap();
    let tar = Tar::new().file("../../ignored/name", 0o4755, b"data").bytes();
    let report = unpack_file(&tar[..], &target).unwrap();
    assert_eq!(report.cleared_setid, 1);
    assert!(!is_symlink(&target));
    assert_eq!(std::fs::read(&target).unwrap(), b"data");
    assert_eq!(mode(&target), 0o755);
    f.assert_contained();

    let fifo = Tar::new().entry(EntryType::Fifo, "p", "", 0o644, b"").bytes();
    assert!(matches!(unpack_file(&fifo[..], &f.dest.join("p")), Err(Error::Invalid(_))));
}
