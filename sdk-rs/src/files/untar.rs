//! Unpacking a pull's tar stream. Every byte of it comes from inside a sandbox and lands on the
//! caller's machine with the caller's rights, so it is hostile input.
//!
//! tar-rs's own `unpack` is not enough for that: it checks that a path stays inside the
//! destination by canonicalising it, which follows any symlink already there (one an earlier
//! entry created, or one the destination held), and it keeps set-id bits and creates devices
//! and FIFOs. Here instead:
//!
//! - a path is walked one component at a time from the destination's directory fd, each
//!   directory opened with `O_NOFOLLOW`, and the final name is created relative to its parent's
//!   fd (`openat` with `O_CREAT | O_EXCL | O_NOFOLLOW`, `mkdirat`, `symlinkat`, `linkat`), an
//!   existing file or symlink unlinked first: nothing is ever written through a symlink;
//! - absolute paths, `..` components and paths through a symlink or a non-directory are skipped;
//! - a hard link must name a regular file this same pull extracted;
//! - symlinks are created as symlinks (their targets are never followed here);
//! - character and block devices and FIFOs are skipped;
//! - modes keep their permission bits only: set-uid and set-gid are cleared everywhere, sticky is
//!   kept on directories only; ownership is never applied;
//! - directory modes and mtimes are applied last, deepest first, so that a read-only directory
//!   does not block its own content.
//!
//! Every skip is counted in the [`PullReport`]. Extraction is single-threaded; other local
//! processes changing the destination meanwhile are out of scope (the fd walk narrows that too).

use std::collections::HashSet;
use std::ffi::{CStr, CString};
use std::fmt::Display;
use std::fs::{File, FileTimes, OpenOptions, Permissions};
use std::io::{self, Read};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::Path;
use std::time::{Duration, SystemTime};

use tar::{Archive, Entry, EntryType, Header};

use super::PullReport;
use crate::error::{Error, Result};

/// A safe archive path: its normal components (see [`components`]).
type Components = Vec<CString>;

/// Unpacks a tar stream into the directory `target` (created if missing; a symlink there is the
/// caller's own and is followed).
pub(super) fn unpack_tree(reader: impl Read, target: &Path) -> Result<PullReport> {
    std::fs::create_dir_all(target).map_err(|e| context(e, target.display()))?;
    let root = open_dir(target)?;
    let report = PullReport::default();
    let mut tree = Tree { root, report, files: HashSet::new(), dirs: vec![] };
    let mut archive = Archive::new(reader);
    for entry in archive.entries().map_err(Error::Local)? {
        let mut entry = entry.map_err(Error::Local)?;
        tree.entry(&mut entry)
            .map_err(|e| context(e, String::from_utf8_lossy(&entry.path_bytes())))?;
    }
    tree.finish().map_err(|e| context(e, target.display()))?;
    Ok(tree.report)
}

/// Writes the stream's one entry, which must be a regular file, to the path `target`. The
/// entry's name is ignored. `target`'s parent is the caller's own and is followed as given; its
/// final name is not: an existing file or symlink there is replaced.
pub(super) fn unpack_file(reader: impl Read, target: &Path) -> Result<PullReport> {
    let name = target
        .file_name()
        .and_then(|n| CString::new(n.as_bytes()).ok())
        .ok_or_else(|| Error::Invalid(format!("{} does not name a file", target.display())))?;
    let parent = match target.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let dir = open_dir(parent)?;
    let mut archive = Archive::new(reader);
    let mut entries = archive.entries().map_err(Error::Local)?;
    let mut entry = match entries.next() {
        Some(e) => e.map_err(Error::Local)?,
        None => return Err(Error::Protocol("pull sent an empty archive".into())),
    };
    if entry.header().entry_type() != EntryType::Regular {
        return Err(Error::Invalid("the remote path is not a regular file; pull the tree".into()));
    }
    let mut report = PullReport::default();
    let mode = permissions(entry.header(), &mut report).map_err(Error::Local)? & 0o777;
    let mtime = mtime_of(entry.header());
    write_file(dir.as_fd(), &name, &mut entry, mode, mtime)
        .map_err(|e| context(e, target.display()))?;
    if entries.next().is_some() {
        return Err(Error::Protocol("pull of a file sent more than one entry".into()));
    }
    Ok(report)
}

/// The state of one tree extraction.
struct Tree {
    /// The destination directory.
    root: File,
    report: PullReport,
    /// The regular files this pull extracted: the only targets a hard link may have.
    files: HashSet<Components>,
    /// Directories whose mode and mtime are applied at the end.
    dirs: Vec<(Components, u32, Option<SystemTime>)>,
}

impl Tree {
    fn entry<R: Read>(&mut self, entry: &mut Entry<'_, R>) -> io::Result<()> {
        let kind = entry.header().entry_type();
        match kind {
            EntryType::Char | EntryType::Block => {
                self.report.skipped_devices += 1;
                return Ok(());
            }
            EntryType::Fifo => {
                self.report.skipped_fifos += 1;
                return Ok(());
            }
            // Metadata for the entries that follow, which `entries()` already applies.
            EntryType::XGlobalHeader
            | EntryType::XHeader
            | EntryType::GNULongName
            | EntryType::GNULongLink => return Ok(()),
            _ => {}
        }
        let Some(path) = components(&entry.path_bytes()) else {
            self.report.skipped_unsafe_paths += 1;
            return Ok(());
        };
        // Whatever this entry puts there replaces what was: no longer a file this pull made.
        self.files.remove(&path);
        let Some((name, parents)) = path.split_last() else {
            return Ok(()); // `.`: the destination itself, which keeps its own mode
        };
        let Some(parent) = walk(self.root.as_fd(), parents, true)? else {
            self.report.skipped_unsafe_paths += 1;
            return Ok(());
        };
        let dir = parent.as_fd();
        match kind {
            EntryType::Directory => {
                let mode = permissions(entry.header(), &mut self.report)?;
                let mtime = mtime_of(entry.header());
                make_dir(dir, name)?;
                self.dirs.push((path, mode, mtime));
            }
            EntryType::Symlink => {
                let target = entry
                    .link_name_bytes()
                    .filter(|t| !t.is_empty())
                    .and_then(|t| CString::new(t.into_owned()).ok());
                let Some(target) = target else {
                    self.report.skipped_links += 1;
                    return Ok(());
                };
                replace(dir, name, || {
                    check(unsafe {
                        libc::symlinkat(target.as_ptr(), dir.as_raw_fd(), name.as_ptr())
                    })
                })?;
                if let Some(t) = mtime_of(entry.header()) {
                    set_symlink_mtime(dir, name, t)?;
                }
            }
            EntryType::Link => {
                let source = entry.link_name_bytes().unwrap_or_default();
                if self.hard_link(dir, name, &source)? {
                    self.files.insert(path);
                } else {
                    self.report.skipped_links += 1;
                }
            }
            // Regular files, and (as POSIX asks) any type this reader does not know.
            _ => {
                let mode = permissions(entry.header(), &mut self.report)? & 0o777;
                let mtime = mtime_of(entry.header());
                write_file(dir, name, entry, mode, mtime)?;
                self.files.insert(path);
            }
        }
        Ok(())
    }

    /// Hard-links `name` in `dir` to the archive path `source` if that is a regular file this
    /// pull extracted; false (and nothing done) if not.
    fn hard_link(&self, dir: BorrowedFd<'_>, name: &CStr, source: &[u8]) -> io::Result<bool> {
        let Some(source) = components(source).filter(|s| self.files.contains(s)) else {
            return Ok(false);
        };
        let Some((source_name, source_parents)) = source.split_last() else {
            return Ok(false);
        };
        let Some(source_dir) = walk(self.root.as_fd(), source_parents, false)? else {
            return Ok(false);
        };
        if file_type_at(source_dir.as_fd(), source_name).ok() != Some(libc::S_IFREG) {
            return Ok(false);
        }
        replace(dir, name, || {
            // No AT_SYMLINK_FOLLOW: a symlink would be linked itself, never its target.
            check(unsafe {
                libc::linkat(
                    source_dir.as_raw_fd(),
                    source_name.as_ptr(),
                    dir.as_raw_fd(),
                    name.as_ptr(),
                    0,
                )
            })
        })?;
        Ok(true)
    }

    /// Applies the directories' modes and mtimes, deepest first (a path sorts after its
    /// ancestors), each reached by the same no-symlink walk.
    fn finish(&mut self) -> io::Result<()> {
        self.dirs.sort_by(|a, b| b.0.cmp(&a.0));
        for (path, mode, mtime) in &self.dirs {
            let Some(fd) = walk(self.root.as_fd(), path, false)? else { continue };
            let dir = File::from(fd);
            if let Some(t) = mtime {
                dir.set_times(FileTimes::new().set_accessed(*t).set_modified(*t))?;
            }
            dir.set_permissions(Permissions::from_mode(*mode))?;
        }
        Ok(())
    }
}

/// An archive path's components, empty and `.` ones dropped; `None` for an absolute path, a `..`
/// component, or a NUL byte.
fn components(path: &[u8]) -> Option<Components> {
    if path.first() == Some(&b'/') {
        return None;
    }
    let mut out = vec![];
    for part in path.split(|&b| b == b'/') {
        match part {
            b"" | b"." => {}
            b".." => return None,
            name => out.push(CString::new(name).ok()?),
        }
    }
    Some(out)
}

/// The entry's mode without set-uid and set-gid (counted when cleared).
fn permissions(header: &Header, report: &mut PullReport) -> io::Result<u32> {
    let mode = header.mode()?;
    if mode & 0o6000 != 0 {
        report.cleared_setid += 1;
    }
    Ok(mode & 0o1777)
}

fn mtime_of(header: &Header) -> Option<SystemTime> {
    SystemTime::UNIX_EPOCH.checked_add(Duration::from_secs(header.mtime().ok()?))
}

/// A directory of the caller's (symlinks in its path are the caller's choice and followed).
fn open_dir(path: &Path) -> Result<File> {
    OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY)
        .open(path)
        .map_err(|e| context(e, path.display()))
}

/// Opens the directory `names` below `root` without following any symlink, creating missing
/// ones with `create`. `None` when a component is a symlink or not a directory, or is missing
/// without `create`.
fn walk(root: BorrowedFd<'_>, names: &[CString], create: bool) -> io::Result<Option<OwnedFd>> {
    const DIR: libc::c_int = libc::O_RDONLY | libc::O_DIRECTORY;
    let mut dir = root.try_clone_to_owned()?;
    for name in names {
        dir = match open_at(dir.as_fd(), name, DIR) {
            Ok(fd) => fd,
            Err(e) if create && e.raw_os_error() == Some(libc::ENOENT) => {
                if let Err(e) = mkdir_at(dir.as_fd(), name, 0o777)
                    && e.raw_os_error() != Some(libc::EEXIST)
                {
                    return Err(e);
                }
                open_at(dir.as_fd(), name, DIR)?
            }
            Err(e)
                if matches!(e.raw_os_error(), Some(libc::ELOOP | libc::ENOTDIR | libc::ENOENT)) =>
            {
                return Ok(None);
            }
            Err(e) => return Err(e),
        };
    }
    Ok(Some(dir))
}

/// Creates the directory `name` in `dir`: an existing directory is kept (trees merge), a file or
/// symlink there is replaced.
fn make_dir(dir: BorrowedFd<'_>, name: &CStr) -> io::Result<()> {
    if file_type_at(dir, name).ok() == Some(libc::S_IFDIR) {
        return Ok(());
    }
    replace(dir, name, || mkdir_at(dir, name, 0o700))
}

/// Writes `data` to a new file `name` in `dir` (replacing a file or symlink there, never writing
/// through it), then applies `mode` and `mtime`.
fn write_file(
    dir: BorrowedFd<'_>,
    name: &CStr,
    data: &mut impl Read,
    mode: u32,
    mtime: Option<SystemTime>,
) -> io::Result<()> {
    let flags = libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL;
    let mut file = File::from(replace(dir, name, || open_at(dir, name, flags))?);
    io::copy(data, &mut file)?;
    if let Some(t) = mtime {
        file.set_times(FileTimes::new().set_accessed(t).set_modified(t))?;
    }
    file.set_permissions(Permissions::from_mode(mode))
}

/// Runs `create`; if `name` already exists in `dir`, unlinks it (a file or a symlink, which is
/// not followed; a directory is an error) and runs `create` once more.
fn replace<T>(
    dir: BorrowedFd<'_>,
    name: &CStr,
    mut create: impl FnMut() -> io::Result<T>,
) -> io::Result<T> {
    match create() {
        Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {
            check(unsafe { libc::unlinkat(dir.as_raw_fd(), name.as_ptr(), 0) })?;
            create()
        }
        done => done,
    }
}

/// `openat` relative to `dir` that never follows a symlink at `name` (new files get 0600).
fn open_at(dir: BorrowedFd<'_>, name: &CStr, flags: libc::c_int) -> io::Result<OwnedFd> {
    let flags = flags | libc::O_NOFOLLOW | libc::O_CLOEXEC;
    let mode: libc::c_uint = 0o600;
    let fd = unsafe { libc::openat(dir.as_raw_fd(), name.as_ptr(), flags, mode) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a new descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn mkdir_at(dir: BorrowedFd<'_>, name: &CStr, mode: libc::mode_t) -> io::Result<()> {
    check(unsafe { libc::mkdirat(dir.as_raw_fd(), name.as_ptr(), mode) })
}

/// The `S_IFMT` bits of `name` in `dir`, a symlink not followed.
fn file_type_at(dir: BorrowedFd<'_>, name: &CStr) -> io::Result<libc::mode_t> {
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    let flags = libc::AT_SYMLINK_NOFOLLOW;
    check(unsafe { libc::fstatat(dir.as_raw_fd(), name.as_ptr(), &mut st, flags) })?;
    Ok(st.st_mode & libc::S_IFMT)
}

/// Sets a symlink's own access and modification times.
fn set_symlink_mtime(dir: BorrowedFd<'_>, name: &CStr, t: SystemTime) -> io::Result<()> {
    let secs = t.duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let mut ts: libc::timespec = unsafe { std::mem::zeroed() };
    ts.tv_sec = libc::time_t::try_from(secs).unwrap_or(libc::time_t::MAX);
    let times = [ts, ts];
    let flags = libc::AT_SYMLINK_NOFOLLOW;
    check(unsafe { libc::utimensat(dir.as_raw_fd(), name.as_ptr(), times.as_ptr(), flags) })
}

fn check(ret: libc::c_int) -> io::Result<()> {
    if ret < 0 { Err(io::Error::last_os_error()) } else { Ok(()) }
}

fn context(e: io::Error, what: impl Display) -> Error {
    Error::Local(io::Error::new(e.kind(), format!("{what}: {e}")))
}

#[cfg(test)]
mod tests {
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
}
