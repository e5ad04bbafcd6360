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

mod capture;
pub use capture::capture;

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

/// Unpacks the plain layer tar read from `input` into `root`, owners translated into the host
/// range `ids`. Device nodes are skipped; setuid bits are kept (the files are only ever used
/// under `nosuid` mounts, in 0700 directories, by owners in the sandbox's range).
///
/// Never decompressed here: an image layer goes through [`decompress`] once, by its caller, so
/// what a size budget counts is what lands on disk (a gzip inside a gzip is a broken tar, not a
/// second, uncounted expansion), and a snapshot's tar is ours, whatever its first bytes spell.
pub fn apply(input: impl Read, root: &Path, whiteouts: Whiteouts, ids: Ids) -> Result<()> {
    // Buffered: tar reads each 512-byte header on its own.
    let mut archive = tar::Archive::new(std::io::BufReader::with_capacity(256 << 10, input));
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
                    make_parents(root, &parent, ids)?;
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
                make_parents(root, &parent, ids)?;
                mknod_whiteout(&target)?;
            }
            continue;
        }
        make_parents(root, &parent, ids)?;
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
        if kind == EntryType::Fifo {
            // tar-rs would make a regular file of it.
            let c = cpath(&dst)?;
            let mode = entry.header().mode().unwrap_or(0o644) & 0o777;
            // SAFETY: plain syscall with a valid C string.
            if unsafe { libc::mknod(c.as_ptr(), libc::S_IFIFO | mode, 0) } != 0 {
                return Err(EngineError::io("mkfifo")(std::io::Error::last_os_error()));
            }
        } else if kind == EntryType::Regular {
            unpack_file(&mut entry, &dst)
                .map_err(|e| bad(format!("unpack {}: {e}", rel.display())))?;
        } else {
            entry.unpack(&dst).map_err(|e| bad(format!("unpack {}: {e}", rel.display())))?;
        }
        if std::fs::symlink_metadata(&dst).is_err() {
            continue; // an entry type tar-rs does not create (a pax global header, ...)
        }
        let header = entry.header();
        let (uid, gid) = (header.uid().unwrap_or(0), header.gid().unwrap_or(0));
        set_owner(&dst, ids.to_host(uid), ids.to_host(gid), header.mode().unwrap_or(0), kind)?;
    }
    Ok(())
}

/// A regular file's entry written to `dst` (which must not exist) as tar-rs's `unpack` writes
/// it, mode and mtime included, but in 1 MiB writes: tar-rs copies through an 8 KiB buffer, a
/// write call per 8 KiB (12 800 per 100 MiB restored).
fn unpack_file(entry: &mut tar::Entry<'_, impl Read>, dst: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    // As tar-rs: a zero mtime is set as 1 (0 reads as "unset" to some tools).
    let (mode, mtime) = (entry.header().mode()? & 0o7777, entry.header().mtime()?.max(1));
    let size = entry.size();
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(dst)?;
    // std's copy reads straight into the BufWriter's buffer, zeroing it first: sized to the
    // file, so a small file does not pay for clearing 1 MiB (4x tar-rs's time over 10 000
    // files of 100 bytes).
    let capacity = usize::try_from(size).unwrap_or(usize::MAX).clamp(8 << 10, 1 << 20);
    let mut out = std::io::BufWriter::with_capacity(capacity, file);
    let copied = std::io::copy(entry, &mut out)?;
    if copied != size {
        return Err(std::io::Error::other("the entry ended before its size"));
    }
    let file = out.into_inner().map_err(std::io::IntoInnerError::into_error)?;
    file.set_permissions(std::fs::Permissions::from_mode(mode))?;
    let at = std::time::UNIX_EPOCH + std::time::Duration::from_secs(mtime);
    file.set_times(std::fs::FileTimes::new().set_accessed(at).set_modified(at))
}

const GZIP_MAGIC: &[u8] = &[0x1f, 0x8b];
const ZSTD_MAGIC: &[u8] = &[0x28, 0xb5, 0x2f, 0xfd];

/// `input` decompressed, by its first bytes: gzip, zstd, or (neither) a plain tar, whose first
/// bytes are an entry's name.
pub fn decompress<'a>(input: impl Read + 'a) -> Result<Box<dyn Read + 'a>> {
    let mut input = std::io::BufReader::with_capacity(256 << 10, input);
    let head = std::io::BufRead::fill_buf(&mut input).map_err(EngineError::io("read layer"))?;
    Ok(if head.starts_with(GZIP_MAGIC) {
        Box::new(flate2::read::GzDecoder::new(input))
    } else if head.starts_with(ZSTD_MAGIC) {
        Box::new(Zstd::new(input)?)
    } else {
        Box::new(input)
    })
}

/// A zstd stream of one or more frames (writers may cut a layer into several).
struct Zstd<R: std::io::BufRead> {
    frame: Option<ruzstd::decoding::StreamingDecoder<R, ruzstd::decoding::FrameDecoder>>,
}

impl<R: std::io::BufRead> Zstd<R> {
    fn new(input: R) -> Result<Self> {
        let frame = ruzstd::decoding::StreamingDecoder::new(input)
            .map_err(|e| bad(format!("zstd layer: {e}")))?;
        Ok(Zstd { frame: Some(frame) })
    }
}

impl<R: std::io::BufRead> Read for Zstd<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        loop {
            let Some(frame) = self.frame.as_mut() else { return Ok(0) };
            let n = frame.read(buf)?;
            if n > 0 || buf.is_empty() {
                return Ok(n);
            }
            let (mut input, decoder) = self.frame.take().expect("a frame").into_parts();
            if input.fill_buf()?.is_empty() {
                return Ok(0);
            }
            let next = ruzstd::decoding::StreamingDecoder::new_with_decoder(input, decoder)
                .map_err(std::io::Error::other)?;
            self.frame = Some(next);
        }
    }
}

/// Creates `dir` (inside `root`) and any missing parents, owned by the sandbox's root: a tar
/// need not list every directory before what is in it.
fn make_parents(root: &Path, dir: &Path, ids: Ids) -> Result<()> {
    let mut missing = vec![];
    let mut at = dir;
    while at != root && std::fs::symlink_metadata(at).is_err() {
        missing.push(at.to_path_buf());
        at = at.parent().unwrap_or(root);
    }
    let owner = Some(ids.to_host(0));
    for d in missing.iter().rev() {
        std::fs::create_dir(d)
            .and_then(|()| std::os::unix::fs::lchown(d, owner, owner))
            .map_err(EngineError::io(format!("mkdir {}", d.display())))?;
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

/// Moves a tree stored in the host range starting at `from` (0: made before sandboxes had a
/// user namespace) into the range `to`; ids outside `from`'s range are left alone, so running
/// it twice is harmless. Symlinks are changed, never followed; the walk keeps its own stack.
pub fn shift_ids(root: &Path, from: u32, to: Ids) -> Result<()> {
    let mut pending = vec![root.to_path_buf()];
    while let Some(path) = pending.pop() {
        let meta = std::fs::symlink_metadata(&path).map_err(EngineError::io("stat"))?;
        let shift = |id: u32| match id.checked_sub(from) {
            Some(inside) if inside < ID_COUNT => to.to_host(inside.into()),
            _ => id,
        };
        let (uid, gid) = (shift(meta.uid()), shift(meta.gid()));
        if (uid, gid) != (meta.uid(), meta.gid()) {
            let kind = if meta.is_file() { EntryType::Regular } else { EntryType::Directory };
            set_owner(&path, uid, gid, meta.mode(), kind)?;
        }
        if meta.is_dir() {
            for entry in std::fs::read_dir(&path).map_err(EngineError::io("read dir"))? {
                pending.push(entry.map_err(EngineError::io("read dir"))?.path());
            }
        }
    }
    Ok(())
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
                let escape = format!("layer path {} escapes the root", path.display());
                return Err(EngineError::Unsafe(escape));
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
mod tests;
