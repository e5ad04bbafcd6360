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

use std::ffi::CString;
use std::io::Read;
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};

use tar::EntryType;

use crate::{EngineError, Result};

const WHITEOUT: &str = ".wh.";
const OPAQUE: &str = ".wh..wh..opq";
const OPAQUE_XATTR: &str = "trusted.overlay.opaque";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Whiteouts {
    Delete,
    Overlay,
}

fn bad(msg: impl Into<String>) -> EngineError {
    EngineError::BadTemplate(msg.into())
}

/// Unpacks the layer tar read from `input` (plain or gzip) into `root`.
pub fn apply(input: impl Read, root: &Path, whiteouts: Whiteouts) -> Result<()> {
    let mut input = std::io::BufReader::new(input);
    let head = std::io::BufRead::fill_buf(&mut input).map_err(EngineError::io("read layer"))?;
    let gzip = head.starts_with(&[0x1f, 0x8b]);
    let reader: Box<dyn Read> =
        if gzip { Box::new(flate2::read::GzDecoder::new(input)) } else { Box::new(input) };
    let mut archive = tar::Archive::new(reader);
    archive.set_preserve_ownerships(true);
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
    }
    Ok(())
}

/// Writes `upper` (an overlay upper directory) as an OCI-style layer tar.
pub fn capture(upper: &Path, out: impl std::io::Write) -> Result<()> {
    let mut tar = tar::Builder::new(out);
    tar.follow_symlinks(false);
    capture_dir(&mut tar, upper, Path::new(""))?;
    tar.into_inner().map_err(EngineError::io("finish layer"))?;
    Ok(())
}

fn capture_dir<W: std::io::Write>(tar: &mut tar::Builder<W>, dir: &Path, rel: &Path) -> Result<()> {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .map_err(EngineError::io(format!("read {}", dir.display())))?
        .filter_map(|e| e.ok())
        .collect();
    entries.sort_by_key(|e| e.file_name());
    for entry in entries {
        let path = entry.path();
        let name = rel.join(entry.file_name());
        let meta = std::fs::symlink_metadata(&path).map_err(EngineError::io("stat"))?;
        if is_overlay_whiteout(&meta) {
            let wh = rel.join(format!("{WHITEOUT}{}", entry.file_name().to_string_lossy()));
            append_empty(tar, &wh)?;
            continue;
        }
        tar.append_path_with_name(&path, &name)
            .map_err(EngineError::io(format!("archive {}", name.display())))?;
        if meta.is_dir() {
            if get_xattr(&path, OPAQUE_XATTR).as_deref() == Some(b"y") {
                append_empty(tar, &name.join(OPAQUE))?;
            }
            capture_dir(tar, &path, &name)?;
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
        )
        .unwrap();
        apply(
            &layer(&[("a/.wh.gone", b""), ("d/.wh..wh..opq", b""), ("d/y", b"4")])[..],
            root.path(),
            Whiteouts::Delete,
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
            apply(&layer(&[("../evil", b"x")])[..], root.path(), Whiteouts::Delete).unwrap_err();
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
        apply(&b.into_inner().unwrap()[..], root.path(), Whiteouts::Delete).unwrap();
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
        capture(upper.path(), &mut tar).unwrap();

        let restored = tempfile::tempdir().unwrap();
        apply(&tar[..], restored.path(), Whiteouts::Overlay).unwrap();
        assert_eq!(std::fs::read(restored.path().join("etc/file")).unwrap(), b"data");
        let wh = std::fs::symlink_metadata(restored.path().join("etc/removed")).unwrap();
        assert!(is_overlay_whiteout(&wh));
        assert_eq!(
            get_xattr(&restored.path().join("etc/opaque"), OPAQUE_XATTR).as_deref(),
            Some(&b"y"[..])
        );
    }
}
