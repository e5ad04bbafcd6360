//! Filesystem layers as OCI-style tar streams, in both directions.
//!
//! - [`apply`] unpacks a layer into a directory. Whiteouts (`.wh.<name>`, and `.wh..wh..opq` for
//!   an opaque directory) either delete what they hide ([`Whiteouts::Delete`], flattening image
//!   layers) or become overlayfs whiteouts ([`Whiteouts::Overlay`]: a 0/0 character device, and
//!   the `trusted.overlay.opaque` xattr), rebuilding an overlay upper directory.
//! - [`capture`] does the reverse for an overlay upper directory.
//!
//! Every path in a layer is resolved inside the target root: `..` components are rejected and
//! symlinks met on the way are followed as if the root were `/`, so no entry can write outside
//! the root. Device nodes from layers are skipped: an image must not smuggle a host device into
//! a sandbox.

use std::collections::HashMap;
use std::ffi::{CStr, CString};
use std::io::Read;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::fs::MetadataExt;
use std::path::{Component, Path, PathBuf};

use tar::EntryType;

use crate::{EngineError, Result};

const WHITEOUT: &str = ".wh.";
const OPAQUE: &str = ".wh..wh..opq";
const OPAQUE_XATTR: &str = "trusted.overlay.opaque";

/// How many ids a sandbox has: 0..65536 inside, `base..base + 65536` on the host.
pub const ID_COUNT: u32 = 65536;
/// Where ids outside the range land (`nobody`).
const OVERFLOW_ID: u32 = 65534;

/// The host id range a sandbox's ids live in. Layer tars carry the ids the sandbox sees (0 is
/// its root), so they move between nodes with other ranges; on disk a sandbox's files carry
/// host ids `base + id`. `Ids::HOST` (base 0) keeps ids as they are: templates, which are
/// stored with host ids and id-mapped when mounted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ids {
    pub base: u32,
}

impl Ids {
    pub const HOST: Ids = Ids { base: 0 };

    /// The host id for an id from a layer.
    pub fn to_host(self, id: u64) -> u32 {
        if self.base == 0 {
            return u32::try_from(id).unwrap_or(OVERFLOW_ID);
        }
        self.base + u32::try_from(id).ok().filter(|&id| id < ID_COUNT).unwrap_or(OVERFLOW_ID)
    }

    /// The id a layer records for a host id (one outside the range, which no sandbox can
    /// make, becomes `nobody`).
    pub fn from_host(self, id: u32) -> u32 {
        match id.checked_sub(self.base) {
            _ if self.base == 0 => id,
            Some(inside) if inside < ID_COUNT => inside,
            _ => OVERFLOW_ID,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Whiteouts {
    Delete,
    Overlay,
}

fn bad(msg: impl Into<String>) -> EngineError {
    EngineError::BadTemplate(msg.into())
}

/// Unpacks the layer tar read from `input` (plain or gzip) into `root`, owners translated into
/// the host range `ids`. Device nodes are skipped; setuid bits are kept (the files are only ever
/// used under `nosuid` mounts, in 0700 directories, by owners in the sandbox's range).
pub fn apply(input: impl Read, root: &Path, whiteouts: Whiteouts, ids: Ids) -> Result<()> {
    let mut input = std::io::BufReader::new(input);
    let head = std::io::BufRead::fill_buf(&mut input).map_err(EngineError::io("read layer"))?;
    let gzip = head.starts_with(&[0x1f, 0x8b]);
    let reader: Box<dyn Read> =
        if gzip { Box::new(flate2::read::GzDecoder::new(input)) } else { Box::new(input) };
    let mut archive = tar::Archive::new(reader);
    // Owners are set below, translated into `ids`.
    archive.set_preserve_ownerships(false);
    archive.set_preserve_permissions(true);
    archive.set_preserve_mtime(true);
    std::fs::create_dir_all(root).map_err(EngineError::io("mkdir layer root"))?;
    for entry in archive.entries().map_err(|e| bad(format!("layer: {e}")))? {
        let mut entry = entry.map_err(|e| bad(format!("layer entry: {e}")))?;
        let rel = clean(&entry.path().map_err(|e| bad(format!("entry path: {e}")))?)?;
        let Some(name) = rel.file_name().map(|n| n.to_string_lossy().into_owned()) else {
            continue; // the root itself
        };
        let parent = resolve(root, rel.parent().unwrap_or(Path::new("")))?;
        if name == OPAQUE {
            match whiteouts {
                Whiteouts::Delete => clear_dir(&parent)?,
                Whiteouts::Overlay => {
                    std::fs::create_dir_all(&parent).map_err(EngineError::io("mkdir"))?;
                    // The marker follows its directory's entry and precedes its children, so
                    // this clears only what an earlier layer put there (a merge, see
                    // `golden_from_snapshot`); in a fresh upper directory it is a no-op.
                    clear_dir(&parent)?;
                    set_xattr(&parent, OPAQUE_XATTR, b"y")?;
                }
            }
            continue;
        }
        if let Some(hidden) = name.strip_prefix(WHITEOUT) {
            if matches!(hidden, "" | "." | "..") {
                return Err(bad(format!("whiteout {} names no entry", rel.display())));
            }
            let target = parent.join(hidden);
            remove_any(&target)?;
            if whiteouts == Whiteouts::Overlay {
                std::fs::create_dir_all(&parent).map_err(EngineError::io("mkdir"))?;
                mknod_whiteout(&target)?;
            }
            continue;
        }
        std::fs::create_dir_all(&parent).map_err(EngineError::io("mkdir"))?;
        let dst = parent.join(&name);
        let kind = entry.header().entry_type();
        match kind {
            EntryType::Char | EntryType::Block => {
                tracing::warn!("skipping device node {} from a layer", rel.display());
                continue;
            }
            EntryType::Directory => {
                if std::fs::symlink_metadata(&dst).is_ok_and(|m| !m.is_dir()) {
                    remove_any(&dst)?;
                }
            }
            EntryType::Link => {
                let link = entry.link_name().map_err(|e| bad(format!("link: {e}")))?;
                let link = link.ok_or_else(|| bad("hard link without a target"))?;
                let src = resolve(root, &clean(&link)?)?;
                remove_any(&dst)?;
                std::fs::hard_link(&src, &dst).map_err(|e| {
                    bad(format!("hard link {} -> {}: {e}", rel.display(), link.display()))
                })?;
                continue;
            }
            _ => remove_any(&dst)?,
        }
        entry.unpack(&dst).map_err(|e| bad(format!("unpack {}: {e}", rel.display())))?;
        let header = entry.header();
        let (uid, gid) = (header.uid().unwrap_or(0), header.gid().unwrap_or(0));
        set_owner(&dst, ids.to_host(uid), ids.to_host(gid), header.mode().unwrap_or(0), kind)?;
    }
    Ok(())
}

/// `lchown`, then the setuid/setgid bits back (chown clears them on files).
fn set_owner(path: &Path, uid: u32, gid: u32, mode: u32, kind: EntryType) -> Result<()> {
    std::os::unix::fs::lchown(path, Some(uid), Some(gid))
        .map_err(EngineError::io(format!("chown {}", path.display())))?;
    if mode & 0o6000 != 0 && kind == EntryType::Regular {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode & 0o7777))
            .map_err(EngineError::io(format!("chmod {}", path.display())))?;
    }
    Ok(())
}

/// Moves a tree stored with host ids 0..65536 (made before sandboxes had a user namespace)
/// into the range `ids`; ids already in the range are left alone, so running it twice is
/// harmless. Symlinks are changed, never followed.
pub fn shift_into(root: &Path, ids: Ids) -> Result<()> {
    let meta = std::fs::symlink_metadata(root).map_err(EngineError::io("stat"))?;
    let shift = |id: u32| if id < ID_COUNT { ids.to_host(id.into()) } else { id };
    if meta.uid() < ID_COUNT || meta.gid() < ID_COUNT {
        let kind = if meta.is_file() { EntryType::Regular } else { EntryType::Directory };
        set_owner(root, shift(meta.uid()), shift(meta.gid()), meta.mode(), kind)?;
    }
    if meta.is_dir() {
        for entry in std::fs::read_dir(root).map_err(EngineError::io("read dir"))? {
            shift_into(&entry.map_err(EngineError::io("read dir"))?.path(), ids)?;
        }
    }
    Ok(())
}

/// Writes `upper` (an overlay upper directory, or a golden's layer) as an OCI-style layer tar,
/// with owners translated from the host range `ids` to the ids the sandbox sees.
///
/// The tree belongs to a sandbox, so it is read as hostile: every directory is opened with
/// `O_NOFOLLOW` relative to its parent's descriptor and every file the same way (and checked to
/// be the inode just listed), so no symlink or rename leads the capture out of the tree. Files
/// keep their size on the wire: holes are written as GNU sparse entries (`SEEK_DATA`/`SEEK_HOLE`)
/// and a file with several links is written once, then as hard links. A name starting with
/// `.wh.` is refused: it would turn into a deletion when the tar is applied.
pub fn capture(upper: &Path, out: impl std::io::Write, ids: Ids) -> Result<()> {
    let mut capture = Capture { tar: tar::Builder::new(out), ids, links: HashMap::new() };
    let root = open_dir(libc::AT_FDCWD, &cpath(upper)?)
        .map_err(EngineError::io(format!("open {}", upper.display())))?;
    capture.dir(&root, Path::new(""))?;
    capture.tar.into_inner().map_err(EngineError::io("finish layer"))?;
    Ok(())
}

struct Capture<W: std::io::Write> {
    tar: tar::Builder<W>,
    ids: Ids,
    /// (dev, inode) of files with several links, and the path they were first written under.
    links: HashMap<(u64, u64), PathBuf>,
}

impl<W: std::io::Write> Capture<W> {
    fn dir(&mut self, dir: &OwnedFd, rel: &Path) -> Result<()> {
        let listing = format!("/proc/self/fd/{}", dir.as_raw_fd());
        let mut names: Vec<_> = std::fs::read_dir(&listing)
            .map_err(EngineError::io(format!("read {}", rel.display())))?
            .filter_map(|e| e.ok().map(|e| e.file_name()))
            .collect();
        names.sort();
        for name in names {
            let path = rel.join(&name);
            let cname = cpath(Path::new(&name))?;
            let st = fstatat(dir.as_raw_fd(), &cname)
                .map_err(EngineError::io(format!("stat {}", path.display())))?;
            let kind = st.st_mode & libc::S_IFMT;
            if kind == libc::S_IFCHR && st.st_rdev == 0 {
                let wh = rel.join(format!("{WHITEOUT}{}", name.to_string_lossy()));
                append_empty(&mut self.tar, &wh)?;
                continue;
            }
            if name.as_bytes().starts_with(WHITEOUT.as_bytes()) {
                return Err(EngineError::BadRequest(format!(
                    "/{} cannot be captured: names starting with {WHITEOUT} are reserved for \
                     deletions in layers (rename it)",
                    path.display()
                )));
            }
            let mut header = tar::Header::new_gnu();
            header.set_mode(st.st_mode & 0o7777);
            header.set_uid(self.ids.from_host(st.st_uid).into());
            header.set_gid(self.ids.from_host(st.st_gid).into());
            header.set_mtime(st.st_mtime.max(0) as u64);
            header.set_size(0);
            let wrote = match kind {
                libc::S_IFDIR => {
                    header.set_entry_type(EntryType::Directory);
                    self.tar
                        .append_data(&mut header, &path, std::io::empty())
                        .map_err(EngineError::io(format!("archive {}", path.display())))?;
                    let sub = open_dir(dir.as_raw_fd(), &cname)
                        .map_err(EngineError::io(format!("open {}", path.display())))?;
                    if fget_xattr(sub.as_raw_fd(), OPAQUE_XATTR).as_deref() == Some(b"y") {
                        append_empty(&mut self.tar, &path.join(OPAQUE))?;
                    }
                    self.dir(&sub, &path)?;
                    continue;
                }
                libc::S_IFLNK => {
                    let target = readlinkat(dir.as_raw_fd(), &cname)
                        .map_err(EngineError::io(format!("readlink {}", path.display())))?;
                    header.set_entry_type(EntryType::Symlink);
                    self.tar.append_link(&mut header, &path, target)
                }
                libc::S_IFREG => self.file(dir, &cname, &st, header, &path),
                libc::S_IFIFO => {
                    header.set_entry_type(EntryType::Fifo);
                    self.tar.append_data(&mut header, &path, std::io::empty())
                }
                // Sockets, and device nodes no sandbox can make: nothing to keep.
                _ => Ok(()),
            };
            wrote.map_err(EngineError::io(format!("archive {}", path.display())))?;
        }
        Ok(())
    }

    fn file(
        &mut self,
        dir: &OwnedFd,
        name: &CStr,
        st: &libc::stat,
        mut header: tar::Header,
        path: &Path,
    ) -> std::io::Result<()> {
        if st.st_nlink > 1 {
            let key = (st.st_dev, st.st_ino);
            if let Some(first) = self.links.get(&key) {
                header.set_entry_type(EntryType::Link);
                return self.tar.append_link(&mut header, path, first);
            }
            self.links.insert(key, path.to_path_buf());
        }
        // SAFETY: plain syscalls on a valid C string and a descriptor we own.
        let file = unsafe {
            let fd = libc::openat(
                dir.as_raw_fd(),
                name.as_ptr(),
                libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NOCTTY,
            );
            if fd < 0 {
                return Err(std::io::Error::last_os_error());
            }
            std::fs::File::from_raw_fd(fd)
        };
        let meta = file.metadata()?;
        if meta.ino() != st.st_ino || meta.dev() != st.st_dev {
            return Err(std::io::Error::other("the file changed while it was captured"));
        }
        let size = meta.len();
        let segments =
            if meta.blocks() * 512 < size { data_segments(&file, size)? } else { vec![] };
        let stored: u64 = segments.iter().map(|s| s.1).sum();
        if segments.is_empty() || stored >= size {
            header.set_entry_type(EntryType::Regular);
            header.set_size(size);
            return self.tar.append_data(&mut header, path, (&file).take(size));
        }
        // A GNU sparse entry: the map (4 entries in the header, 21 per extension block that
        // follows it), then only the data segments.
        let mut map = segments.clone();
        if map.last().is_none_or(|&(off, len)| off + len < size) {
            map.push((size, 0)); // the file ends in a hole
        }
        header.set_entry_type(EntryType::GNUSparse);
        header.set_size(stored);
        let gnu = header.as_gnu_mut().expect("a GNU header");
        gnu.set_real_size(size);
        let (head, rest) = map.split_at(map.len().min(4));
        for (slot, &(off, len)) in gnu.sparse.iter_mut().zip(head) {
            slot.set_offset(off);
            slot.set_length(len);
        }
        gnu.set_is_extended(!rest.is_empty());
        let mut blocks = vec![];
        let chunks: Vec<_> = rest.chunks(21).collect();
        for (i, chunk) in chunks.iter().enumerate() {
            let mut ext = tar::GnuExtSparseHeader::new();
            for (slot, &(off, len)) in ext.sparse_mut().iter_mut().zip(chunk.iter()) {
                slot.set_offset(off);
                slot.set_length(len);
            }
            ext.set_is_extended(i + 1 < chunks.len());
            blocks.extend_from_slice(ext.as_bytes());
        }
        let data = SegmentReader { file: &file, segments, at: 0 };
        self.tar.append_data(&mut header, path, std::io::Cursor::new(blocks).chain(data))
    }
}

/// The data segments of a sparse file as (offset, length), widened to 512-byte boundaries (tar's
/// sparse format needs every segment but the last to end on one).
fn data_segments(file: &std::fs::File, size: u64) -> std::io::Result<Vec<(u64, u64)>> {
    let fd = file.as_raw_fd();
    let mut segments: Vec<(u64, u64)> = vec![];
    let mut pos = 0u64;
    while pos < size {
        // SAFETY: plain syscalls on an open descriptor.
        let data = unsafe { libc::lseek(fd, pos as i64, libc::SEEK_DATA) };
        if data < 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::ENXIO) {
                break; // only a hole is left
            }
            return Err(e);
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(fd, data, libc::SEEK_HOLE) };
        if hole < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let start = data as u64 & !511;
        let end = ((hole as u64 + 511) & !511).min(size);
        match segments.last_mut() {
            Some((off, len)) if *off + *len >= start => *len = end - *off,
            _ => segments.push((start, end - start)),
        }
        pos = hole as u64;
    }
    Ok(segments)
}

/// Reads the given segments of a file back to back.
struct SegmentReader<'a> {
    file: &'a std::fs::File,
    segments: Vec<(u64, u64)>,
    at: usize,
}

impl Read for SegmentReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        use std::os::unix::fs::FileExt;
        while let Some(&(off, len)) = self.segments.get(self.at) {
            if len == 0 {
                self.at += 1;
                continue;
            }
            let want = buf.len().min(len as usize);
            let n = self.file.read_at(&mut buf[..want], off)?;
            if n == 0 {
                return Err(std::io::Error::other("the file shrank while it was captured"));
            }
            self.segments[self.at] = (off + n as u64, len - n as u64);
            return Ok(n);
        }
        Ok(0)
    }
}

/// Opens the directory `name` under `dirfd` without following a symlink.
fn open_dir(dirfd: i32, name: &CStr) -> std::io::Result<OwnedFd> {
    // SAFETY: plain syscall on a valid C string; the result is a fresh descriptor we own.
    unsafe {
        let fd = libc::openat(
            dirfd,
            name.as_ptr(),
            libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC,
        );
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(OwnedFd::from_raw_fd(fd))
    }
}

fn fstatat(dirfd: i32, name: &CStr) -> std::io::Result<libc::stat> {
    // SAFETY: `st` is written by the kernel on success.
    unsafe {
        let mut st: libc::stat = std::mem::zeroed();
        if libc::fstatat(dirfd, name.as_ptr(), &mut st, libc::AT_SYMLINK_NOFOLLOW) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(st)
    }
}

fn readlinkat(dirfd: i32, name: &CStr) -> std::io::Result<PathBuf> {
    let mut buf = vec![0u8; libc::PATH_MAX as usize];
    // SAFETY: the buffer is as long as we say.
    let n = unsafe { libc::readlinkat(dirfd, name.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    buf.truncate(n as usize);
    Ok(PathBuf::from(std::ffi::OsString::from_vec(buf)))
}

fn append_empty<W: std::io::Write>(tar: &mut tar::Builder<W>, path: &Path) -> Result<()> {
    let mut header = tar::Header::new_gnu();
    header.set_size(0);
    header.set_mode(0o644);
    header.set_uid(0);
    header.set_gid(0);
    header.set_mtime(0);
    header.set_entry_type(EntryType::Regular);
    tar.append_data(&mut header, path, std::io::empty())
        .map_err(EngineError::io("archive whiteout"))
}

#[cfg(test)]
fn is_overlay_whiteout(meta: &std::fs::Metadata) -> bool {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    meta.file_type().is_char_device() && meta.rdev() == 0
}

/// A layer path made relative, with `.` dropped; `..` or a prefix is an escape attempt.
fn clean(path: &Path) -> Result<PathBuf> {
    let mut out = PathBuf::new();
    for c in path.components() {
        match c {
            Component::Normal(p) => out.push(p),
            Component::CurDir | Component::RootDir => {}
            Component::ParentDir | Component::Prefix(_) => {
                return Err(bad(format!("layer path {} escapes the root", path.display())));
            }
        }
    }
    Ok(out)
}

/// Resolves `rel` under `root`, following symlinks as if `root` were `/`.
pub(crate) fn resolve(root: &Path, rel: &Path) -> Result<PathBuf> {
    let mut resolved = root.to_path_buf();
    let mut pending: Vec<PathBuf> =
        rel.components().rev().map(|c| PathBuf::from(c.as_os_str())).collect();
    let mut hops = 0;
    while let Some(part) = pending.pop() {
        match part.to_str() {
            Some("/") | Some(".") | Some("") => continue,
            Some("..") => {
                if resolved != root {
                    resolved.pop();
                }
                continue;
            }
            _ => {}
        }
        let next = resolved.join(&part);
        match std::fs::symlink_metadata(&next) {
            Ok(m) if m.file_type().is_symlink() => {
                hops += 1;
                if hops > 40 {
                    return Err(bad(format!("too many symlinks under {}", rel.display())));
                }
                let target = std::fs::read_link(&next).map_err(EngineError::io("readlink"))?;
                if target.is_absolute() {
                    resolved = root.to_path_buf();
                }
                pending.extend(target.components().rev().map(|c| PathBuf::from(c.as_os_str())));
            }
            _ => resolved = next,
        }
    }
    Ok(resolved)
}

fn remove_any(path: &Path) -> Result<()> {
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => std::fs::remove_dir_all(path),
        Ok(_) => std::fs::remove_file(path),
        Err(_) => Ok(()),
    }
    .map_err(EngineError::io(format!("remove {}", path.display())))
}

fn clear_dir(dir: &Path) -> Result<()> {
    if let Ok(entries) = std::fs::read_dir(dir) {
        for entry in entries.flatten() {
            remove_any(&entry.path())?;
        }
    }
    Ok(())
}

fn cpath(path: &Path) -> Result<CString> {
    CString::new(path.as_os_str().as_bytes()).map_err(|_| bad("path with a NUL byte"))
}

fn mknod_whiteout(path: &Path) -> Result<()> {
    let c = cpath(path)?;
    // SAFETY: plain syscall with a valid C string.
    if unsafe { libc::mknod(c.as_ptr(), libc::S_IFCHR, 0) } != 0 {
        return Err(EngineError::io("mknod whiteout")(std::io::Error::last_os_error()));
    }
    Ok(())
}

fn set_xattr(path: &Path, name: &str, value: &[u8]) -> Result<()> {
    let (c, n) = (cpath(path)?, CString::new(name).map_err(|_| bad("xattr name"))?);
    // SAFETY: valid C strings and a buffer of the given length.
    let rc =
        unsafe { libc::lsetxattr(c.as_ptr(), n.as_ptr(), value.as_ptr().cast(), value.len(), 0) };
    if rc != 0 {
        return Err(EngineError::io("set opaque xattr")(std::io::Error::last_os_error()));
    }
    Ok(())
}

fn fget_xattr(fd: i32, name: &str) -> Option<Vec<u8>> {
    let n = CString::new(name).ok()?;
    let mut buf = [0u8; 16];
    // SAFETY: a valid C string and a buffer of the given length.
    let len = unsafe { libc::fgetxattr(fd, n.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    (len >= 0).then(|| buf[..len as usize].to_vec())
}

#[cfg(test)]
fn get_xattr(path: &Path, name: &str) -> Option<Vec<u8>> {
    let (c, n) = (cpath(path).ok()?, CString::new(name).ok()?);
    let mut buf = [0u8; 16];
    // SAFETY: valid C strings and a buffer of the given length.
    let len =
        unsafe { libc::lgetxattr(c.as_ptr(), n.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    (len >= 0).then(|| buf[..len as usize].to_vec())
}

#[cfg(test)]
mod tests {
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
        let err =
            apply(&layer(&[("../evil", b"x")])[..], root.path(), Whiteouts::Delete, Ids::HOST)
                .unwrap_err();
        assert!(matches!(err, EngineError::BadTemplate(_)), "{err}");

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
    }

    #[test]
    fn capture_then_apply_keeps_overlay_whiteouts_and_opaque_dirs() {
        let upper = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(upper.path().join("etc/opaque")).unwrap();
        std::fs::write(upper.path().join("etc/file"), b"data").unwrap();
        mknod_whiteout(&upper.path().join("etc/removed")).unwrap();
        set_xattr(&upper.path().join("etc/opaque"), OPAQUE_XATTR, b"y").unwrap();
        let mut tar = vec![];
        capture(upper.path(), &mut tar, Ids::HOST).unwrap();

        let restored = tempfile::tempdir().unwrap();
        apply(&tar[..], restored.path(), Whiteouts::Overlay, Ids::HOST).unwrap();
        assert_eq!(std::fs::read(restored.path().join("etc/file")).unwrap(), b"data");
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
        capture(u, &mut tar, Ids::HOST).unwrap();
        assert!(tar.len() < 3 << 20, "the capture is {} bytes", tar.len());

        let restored = tempfile::tempdir().unwrap();
        let r = restored.path();
        apply(&tar[..], r, Whiteouts::Overlay, Ids::HOST).unwrap();
        for name in ["sparse", "many", "big"] {
            let (a, b) =
                (std::fs::read(u.join(name)).unwrap(), std::fs::read(r.join(name)).unwrap());
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
        let err = capture(upper.path(), &mut vec![], Ids::HOST).unwrap_err();
        assert!(matches!(err, EngineError::BadRequest(_)), "{err}");
        assert!(err.to_string().contains("/etc/.wh.passwd"), "{err}");
    }

    #[test]
    fn captures_never_follow_symlinks_out_of_the_tree() {
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("secret"), b"host secret").unwrap();
        let upper = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink(outside.path(), upper.path().join("dir")).unwrap();
        std::os::unix::fs::symlink(outside.path().join("secret"), upper.path().join("file"))
            .unwrap();
        let mut tar = vec![];
        capture(upper.path(), &mut tar, Ids::HOST).unwrap();
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
        capture(upper.path(), &mut tar, ids).unwrap();
        let mut archive = tar::Archive::new(&tar[..]);
        let entry = archive.entries().unwrap().next().unwrap().unwrap();
        assert_eq!((entry.header().uid().unwrap(), entry.header().gid().unwrap()), (1000, 0));

        let other = Ids { base: 2 << 20 };
        let restored = tempfile::tempdir().unwrap();
        apply(&tar[..], restored.path(), Whiteouts::Overlay, other).unwrap();
        let meta = std::fs::metadata(restored.path().join("f")).unwrap();
        assert_eq!((meta.uid(), meta.gid()), ((2 << 20) + 1000, 2 << 20));

        shift_into(restored.path(), other).unwrap();
        let meta = std::fs::metadata(restored.path().join("f")).unwrap();
        assert_eq!(meta.uid(), (2 << 20) + 1000, "ids already in the range stay");
    }
}
