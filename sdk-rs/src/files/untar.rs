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
mod tests;
