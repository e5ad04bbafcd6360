//! Layer round trips, escapes and ids.

use super::*;

fn header() -> tar::Header {
    let mut h = tar::Header::new_gnu();
    h.set_mode(0o644);
    h.set_uid(0);
    h.set_gid(0);
    h.set_mtime(0);
    h
}

fn layer(entries: &[(&str, &[u8])]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for (path, data) in entries {
        let mut h = header();
        h.set_size(data.len() as u64);
        // `set_path` refuses `..`; write the name bytes directly as a hostile tool would.
        h.as_old_mut().name[..path.len()].copy_from_slice(path.as_bytes());
        h.set_cksum();
        b.append(&h, *data).unwrap();
    }
    b.into_inner().unwrap()
}

#[test]
fn whiteouts_delete_and_opaque_dirs_clear() {
    let root = tempfile::tempdir().unwrap();
    apply(
        &layer(&[("a/keep", b"1"), ("a/gone", b"2"), ("d/x", b"3")])[..],
        root.path(),
        Whiteouts::Delete,
        Ids::HOST,
    )
    .unwrap();
    apply(
        &layer(&[("a/.wh.gone", b""), ("d/.wh..wh..opq", b""), ("d/y", b"4")])[..],
        root.path(),
        Whiteouts::Delete,
        Ids::HOST,
    )
    .unwrap();
    assert!(root.path().join("a/keep").exists());
    assert!(!root.path().join("a/gone").exists());
    assert!(!root.path().join("d/x").exists());
    assert_eq!(std::fs::read(root.path().join("d/y")).unwrap(), b"4");
}

#[test]
fn escaping_paths_are_rejected_and_symlinks_stay_inside() {
    let root = tempfile::tempdir().unwrap();
    let err = apply(&layer(&[("../evil", b"x")])[..], root.path(), Whiteouts::Delete, Ids::HOST)
        .unwrap_err();
    assert!(matches!(err, EngineError::Unsafe(_)), "{err}");

    // A symlink to an absolute host path, then a file "through" it: lands inside the root.
    let outside = tempfile::tempdir().unwrap();
    let mut b = tar::Builder::new(Vec::new());
    let mut h = header();
    h.set_entry_type(EntryType::Symlink);
    h.set_size(0);
    b.append_link(&mut h, "link", outside.path()).unwrap();
    let mut h = header();
    h.set_size(1);
    b.append_data(&mut h, "link/pwned", &b"x"[..]).unwrap();
    apply(&b.into_inner().unwrap()[..], root.path(), Whiteouts::Delete, Ids::HOST).unwrap();
    assert!(!outside.path().join("pwned").exists(), "wrote outside the root");
    let inside = resolve(root.path(), Path::new("link/pwned")).unwrap();
    assert!(inside.starts_with(root.path()) && inside.exists());

    // A symlink to a host file, then a regular file under the link's own name: the file
    // replaces the link, the host file is untouched.
    let host_file = outside.path().join("host-file");
    std::fs::write(&host_file, b"host").unwrap();
    let mut b = tar::Builder::new(Vec::new());
    let mut h = header();
    h.set_entry_type(EntryType::Symlink);
    h.set_size(0);
    b.append_link(&mut h, "planted", &host_file).unwrap();
    let mut h = header();
    h.set_size(5);
    b.append_data(&mut h, "planted", &b"owned"[..]).unwrap();
    apply(&b.into_inner().unwrap()[..], root.path(), Whiteouts::Delete, Ids::HOST).unwrap();
    assert_eq!(std::fs::read(&host_file).unwrap(), b"host", "wrote through the link");
    let planted = std::fs::symlink_metadata(root.path().join("planted")).unwrap();
    assert!(planted.is_file(), "the link is still there");
    assert_eq!(std::fs::read(root.path().join("planted")).unwrap(), b"owned");
}

#[test]
fn capture_then_apply_keeps_overlay_whiteouts_and_opaque_dirs() {
    let upper = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(upper.path().join("etc/opaque")).unwrap();
    std::fs::write(upper.path().join("etc/file"), b"data").unwrap();
    let file = std::fs::File::options().write(true).open(upper.path().join("etc/file")).unwrap();
    let when = std::time::UNIX_EPOCH + std::time::Duration::from_secs(1_500_000_000);
    file.set_modified(when).unwrap();
    use std::os::unix::fs::PermissionsExt;
    file.set_permissions(std::fs::Permissions::from_mode(0o640)).unwrap();
    mknod_whiteout(&upper.path().join("etc/removed")).unwrap();
    set_xattr(&upper.path().join("etc/opaque"), OPAQUE_XATTR, b"y").unwrap();
    let mut tar = vec![];
    capture(&[upper.path()], &mut tar, Ids::HOST).unwrap();

    let restored = tempfile::tempdir().unwrap();
    apply(&tar[..], restored.path(), Whiteouts::Overlay, Ids::HOST).unwrap();
    assert_eq!(std::fs::read(restored.path().join("etc/file")).unwrap(), b"data");
    let meta = std::fs::metadata(restored.path().join("etc/file")).unwrap();
    assert_eq!(meta.modified().unwrap(), when, "a file keeps its mtime");
    assert_eq!(meta.mode() & 0o7777, 0o640, "a file keeps its mode");
    let wh = std::fs::symlink_metadata(restored.path().join("etc/removed")).unwrap();
    assert!(is_overlay_whiteout(&wh));
    assert_eq!(
        get_xattr(&restored.path().join("etc/opaque"), OPAQUE_XATTR).as_deref(),
        Some(&b"y"[..])
    );
}

#[test]
fn captures_keep_holes_and_links_and_the_size_of_the_data() {
    use std::os::unix::fs::PermissionsExt;
    let upper = tempfile::tempdir().unwrap();
    let u = upper.path();
    // 1 GiB apparent, 3 small data islands (one past the 4 slots of a GNU header's map
    // when combined with the many-holes file below), ending in a hole.
    let sparse = std::fs::File::create(u.join("sparse")).unwrap();
    use std::os::unix::fs::FileExt;
    sparse.write_at(b"head", 0).unwrap();
    sparse.write_at(b"middle", 300 << 20).unwrap();
    sparse.write_at(b"late", 700 << 20).unwrap();
    sparse.set_len(1 << 30).unwrap();
    // 30 islands: the map needs extension blocks.
    let many = std::fs::File::create(u.join("many")).unwrap();
    for i in 0..30u64 {
        many.write_at(&[i as u8 + 1; 100], i << 20).unwrap();
    }
    std::fs::write(u.join("big"), vec![7u8; 1 << 20]).unwrap();
    for i in 0..50 {
        std::fs::hard_link(u.join("big"), u.join(format!("link{i}"))).unwrap();
    }
    std::fs::set_permissions(u.join("big"), std::fs::Permissions::from_mode(0o4755)).unwrap();

    let mut tar = vec![];
    capture(&[u], &mut tar, Ids::HOST).unwrap();
    assert!(tar.len() < 3 << 20, "the capture is {} bytes", tar.len());

    let restored = tempfile::tempdir().unwrap();
    let r = restored.path();
    apply(&tar[..], r, Whiteouts::Overlay, Ids::HOST).unwrap();
    for name in ["sparse", "many", "big"] {
        let (a, b) = (std::fs::read(u.join(name)).unwrap(), std::fs::read(r.join(name)).unwrap());
        assert!(a == b, "{name} differs after a round trip");
    }
    let meta = std::fs::metadata(r.join("sparse")).unwrap();
    assert_eq!(meta.len(), 1 << 30);
    assert!(meta.blocks() * 512 < 1 << 20, "holes came back as data");
    let big = std::fs::metadata(r.join("big")).unwrap();
    assert_eq!(big.nlink(), 51, "hard links came back as copies");
    assert_eq!(big.mode() & 0o7777, 0o4755);
    assert_eq!(std::fs::metadata(r.join("link7")).unwrap().ino(), big.ino());
}

#[test]
fn captures_refuse_names_that_would_become_deletions() {
    let upper = tempfile::tempdir().unwrap();
    std::fs::create_dir(upper.path().join("etc")).unwrap();
    std::fs::write(upper.path().join("etc/.wh.passwd"), b"").unwrap();
    let err = capture(&[upper.path()], &mut vec![], Ids::HOST).unwrap_err();
    assert!(matches!(err, EngineError::BadRequest(_)), "{err}");
    assert!(err.to_string().contains("/etc/.wh.passwd"), "{err}");
}

#[test]
fn captures_never_follow_symlinks_out_of_the_tree() {
    let outside = tempfile::tempdir().unwrap();
    std::fs::write(outside.path().join("secret"), b"host secret").unwrap();
    let upper = tempfile::tempdir().unwrap();
    std::os::unix::fs::symlink(outside.path(), upper.path().join("dir")).unwrap();
    std::os::unix::fs::symlink(outside.path().join("secret"), upper.path().join("file")).unwrap();
    let mut tar = vec![];
    capture(&[upper.path()], &mut tar, Ids::HOST).unwrap();
    assert!(!tar.windows(11).any(|w| w == b"host secret"), "a symlink was followed");
    let mut archive = tar::Archive::new(&tar[..]);
    for entry in archive.entries().unwrap() {
        assert_eq!(entry.unwrap().header().entry_type(), EntryType::Symlink);
    }
}

#[test]
fn layers_carry_the_ids_the_sandbox_sees_and_disks_the_host_range() {
    let ids = Ids { base: 1 << 20 };
    assert_eq!(ids.to_host(0), 1 << 20);
    assert_eq!(ids.to_host(1000), (1 << 20) + 1000);
    assert_eq!(ids.to_host(1 << 40), (1 << 20) + OVERFLOW_ID);
    assert_eq!(ids.from_host((1 << 20) + 5), 5);
    assert_eq!(ids.from_host(0), OVERFLOW_ID, "host root is nobody inside");
    assert_eq!(Ids::HOST.to_host(100_000), 100_000);

    let upper = tempfile::tempdir().unwrap();
    std::fs::write(upper.path().join("f"), b"x").unwrap();
    std::os::unix::fs::lchown(upper.path().join("f"), Some((1 << 20) + 1000), Some(1 << 20))
        .unwrap();
    let mut tar = vec![];
    capture(&[upper.path()], &mut tar, ids).unwrap();
    let mut archive = tar::Archive::new(&tar[..]);
    let entry = archive.entries().unwrap().next().unwrap().unwrap();
    assert_eq!((entry.header().uid().unwrap(), entry.header().gid().unwrap()), (1000, 0));

    let other = Ids { base: 2 << 20 };
    let restored = tempfile::tempdir().unwrap();
    apply(&tar[..], restored.path(), Whiteouts::Overlay, other).unwrap();
    let meta = std::fs::metadata(restored.path().join("f")).unwrap();
    assert_eq!((meta.uid(), meta.gid()), ((2 << 20) + 1000, 2 << 20));

    shift_ids(restored.path(), 0, other).unwrap();
    let meta = std::fs::metadata(restored.path().join("f")).unwrap();
    assert_eq!(meta.uid(), (2 << 20) + 1000, "ids already in the range stay");
}

#[test]
fn trees_deeper_than_a_stack_are_captured_or_refused_without_a_crash() {
    let upper = tempfile::tempdir().unwrap();
    // 2000 levels of "d/": within PATH_MAX, deeper than recursion on a small stack would go.
    let deep: PathBuf = std::iter::repeat_n("d", 2000).collect();
    std::fs::create_dir_all(upper.path().join(&deep)).unwrap();
    let small_stack = std::thread::Builder::new().stack_size(256 << 10);
    let path = upper.path().to_path_buf();
    let captured = small_stack
        .spawn(move || {
            let mut tar = vec![];
            capture(&[&path], &mut tar, Ids::HOST).map(|()| tar.len())
        })
        .unwrap()
        .join()
        .expect("no stack overflow");
    assert!(captured.unwrap() > 2000 * 512);
    // Past PATH_MAX: refused with a clear error.
    let deeper: PathBuf = std::iter::repeat_n("dd", 1500).collect();
    let dir = tempfile::tempdir().unwrap();
    let mut at = std::fs::File::open(dir.path()).unwrap();
    for part in deeper.iter() {
        use std::os::fd::AsRawFd;
        let name = CString::new(part.as_bytes()).unwrap();
        // SAFETY: plain syscalls on valid descriptors and strings.
        let fd = unsafe {
            libc::mkdirat(at.as_raw_fd(), name.as_ptr(), 0o755);
            libc::openat(at.as_raw_fd(), name.as_ptr(), libc::O_RDONLY | libc::O_DIRECTORY)
        };
        assert!(fd >= 0);
        at = unsafe { std::fs::File::from_raw_fd(fd) };
    }
    let err = capture(&[dir.path()], &mut vec![], Ids::HOST).unwrap_err();
    assert!(matches!(err, EngineError::BadRequest(_)), "{err}");
}

#[test]
fn fifos_come_back_as_fifos() {
    use std::os::unix::fs::FileTypeExt;
    let upper = tempfile::tempdir().unwrap();
    let fifo = CString::new(upper.path().join("pipe").as_os_str().as_bytes()).unwrap();
    // SAFETY: plain syscall with a valid C string.
    assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o640) }, 0);
    let mut tar = vec![];
    capture(&[upper.path()], &mut tar, Ids::HOST).unwrap();
    let restored = tempfile::tempdir().unwrap();
    apply(&tar[..], restored.path(), Whiteouts::Overlay, Ids::HOST).unwrap();
    let meta = std::fs::symlink_metadata(restored.path().join("pipe")).unwrap();
    assert!(meta.file_type().is_fifo(), "{:?}", meta.file_type());
    assert_eq!(meta.mode() & 0o777, 0o640);
}

#[test]
fn directories_a_layer_does_not_list_belong_to_the_sandboxs_root() {
    use std::os::unix::fs::MetadataExt;
    let ids = Ids { base: 1 << 20 };
    let root = tempfile::tempdir().unwrap();
    apply(&layer(&[("a/b/c/file", b"x")])[..], root.path(), Whiteouts::Overlay, ids).unwrap();
    for dir in ["a", "a/b", "a/b/c"] {
        assert_eq!(std::fs::metadata(root.path().join(dir)).unwrap().uid(), 1 << 20, "{dir}");
    }
}

/// A fork's copy runs on two layers of its own over its base (its upper directory over the
/// layer shared by all copies): captured together they must be one layer that shows, over the
/// same base, exactly what overlayfs showed through both. overlayfs itself is the judge.
#[test]
fn layers_captured_together_show_what_overlayfs_shows_through_them() {
    let t = tempfile::tempdir().unwrap();
    let [base, below, top, restored] =
        ["base", "below", "top", "restored"].map(|d| t.path().join(d));
    let file = |root: &Path, rel: &str, data: &str| {
        let path = root.join(rel);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, data).unwrap();
    };
    let dir = |root: &Path, rel: &str, opaque: bool| {
        std::fs::create_dir_all(root.join(rel)).unwrap();
        if opaque {
            set_xattr(&root.join(rel), OPAQUE_XATTR, b"y").unwrap();
        }
    };
    let whiteout = |root: &Path, rel: &str| {
        std::fs::create_dir_all(root.join(rel).parent().unwrap()).unwrap();
        mknod_whiteout(&root.join(rel)).unwrap();
    };
    for d in [&base, &below, &top] {
        std::fs::create_dir_all(d).unwrap();
    }
    file(&base, "kept", "base");
    file(&below, "added", "below");
    file(&below, "added-then-deleted", "below");
    whiteout(&top, "added-then-deleted");
    file(&base, "deleted-below", "base");
    whiteout(&below, "deleted-below");
    file(&base, "deleted-then-made", "base");
    whiteout(&below, "deleted-then-made");
    file(&top, "deleted-then-made", "top");
    file(&below, "rewritten", "below");
    file(&top, "rewritten", "top");
    // Directories merged through all three; cut off by an opaque one below or on top; cut off
    // by a whiteout or a file below a plain directory on top.
    for (name, below_opaque, top_opaque) in
        [("m", false, false), ("n", true, false), ("o", false, true)]
    {
        file(&base, &format!("{name}/b"), "base");
        dir(&below, name, below_opaque);
        file(&below, &format!("{name}/l"), "below");
        dir(&top, name, top_opaque);
        file(&top, &format!("{name}/t"), "top");
    }
    file(&base, "p/b", "base");
    whiteout(&below, "p");
    file(&top, "p/t", "top");
    file(&base, "q/b", "base");
    file(&below, "q", "below");
    file(&top, "q/t", "top");
    file(&below, "r/l", "below");
    whiteout(&top, "r");
    std::os::unix::fs::symlink("kept", below.join("link")).unwrap();
    // A hard-linked pair below, one name of it deleted on top: the other keeps the bytes.
    file(&below, "pair-1", "pair");
    std::fs::hard_link(below.join("pair-1"), below.join("pair-2")).unwrap();
    whiteout(&top, "pair-1");

    let mut tar = vec![];
    capture(&[&top, &below], &mut tar, Ids::HOST).unwrap();
    apply(&tar[..], &restored, Whiteouts::Overlay, Ids::HOST).unwrap();

    let seen = |layers: &[&Path]| {
        let mnt = tempfile::tempdir().unwrap();
        let lowers: Vec<_> = layers.iter().map(|l| l.display().to_string()).collect();
        let ok = std::process::Command::new("mount")
            .args(["-t", "overlay", "overlay", "-o"])
            .arg(format!("lowerdir={}", lowers.join(":")))
            .arg(mnt.path())
            .status()
            .unwrap();
        assert!(ok.success(), "mount overlay");
        let tree = tree(mnt.path());
        let ok = std::process::Command::new("umount").arg(mnt.path()).status().unwrap();
        assert!(ok.success(), "umount overlay");
        tree
    };
    let through_both = seen(&[&top, &below, &base]);
    assert_eq!(seen(&[&restored, &base]), through_both);
    // What the test set up is what it checks.
    for gone in ["added-then-deleted", "deleted-below", "n/b", "o/b", "o/l", "p/b", "q/b", "r"] {
        assert!(!through_both.contains_key(gone), "{gone} shows");
    }
    for (path, what) in
        [("m/b", "base"), ("m/l", "below"), ("deleted-then-made", "top"), ("pair-2", "pair")]
    {
        assert_eq!(through_both[path], what);
    }
}

/// Every path under `root` and what it is: a file's bytes, a symlink's target, or a directory.
fn tree(root: &Path) -> std::collections::BTreeMap<String, String> {
    let mut out = std::collections::BTreeMap::new();
    let mut todo = vec![root.to_path_buf()];
    while let Some(dir) = todo.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let rel = path.strip_prefix(root).unwrap().display().to_string();
            let meta = std::fs::symlink_metadata(&path).unwrap();
            let what = if meta.is_symlink() {
                format!("-> {}", std::fs::read_link(&path).unwrap().display())
            } else if meta.is_dir() {
                todo.push(path);
                "dir".to_string()
            } else {
                String::from_utf8(std::fs::read(&path).unwrap()).unwrap()
            };
            out.insert(rel, what);
        }
    }
    out
}
