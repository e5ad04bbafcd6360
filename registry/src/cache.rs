//! The node's layer cache: compressed layer blobs as registries serve them, one file per digest
//! (`<dir>/sha256/<hex>`), shared by every template that uses the layer. A blob is written to a
//! temporary file, its digest checked, then renamed into place, so a file under its digest's
//! name always holds those bytes. When the cache outgrows its bound, the least recently used
//! blobs go (a blob's mtime is its last use), except those a pull holds ([`Held`]): a blob one
//! template's pull fetched is not collected by another's before it is unpacked.

use std::collections::{HashMap, HashSet};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use crate::digest::{Digest, Hasher};
use crate::{RegistryError, Result};

/// How often a blob being written checks the disk reserve.
const RESERVE_CHECK_EVERY: u64 = 8 << 20;

#[derive(Debug)]
pub struct LayerCache {
    dir: PathBuf,
    max_bytes: u64,
    min_free_bytes: u64,
    next: AtomicU64,
    /// Blobs pulls hold, by digest: how many hold each.
    held: Arc<Mutex<HashMap<Digest, usize>>>,
}

/// Blobs kept from [`LayerCache::gc`] until this (and every clone of it) drops.
#[derive(Debug, Clone)]
pub struct Held {
    _blobs: Arc<HeldBlobs>,
}

#[derive(Debug)]
struct HeldBlobs {
    digests: Vec<Digest>,
    by: Arc<Mutex<HashMap<Digest, usize>>>,
}

impl Drop for HeldBlobs {
    fn drop(&mut self) {
        let mut held = self.by.lock().unwrap_or_else(|e| e.into_inner());
        for d in &self.digests {
            if let Some(n) = held.get_mut(d) {
                *n -= 1;
                if *n == 0 {
                    held.remove(d);
                }
            }
        }
    }
}

impl LayerCache {
    /// The cache in `dir`; partial files left by a killed node are removed.
    pub fn open(dir: &Path, max_bytes: u64, min_free_bytes: u64) -> Result<LayerCache> {
        let blobs = dir.join("sha256");
        std::fs::create_dir_all(&blobs).map_err(RegistryError::io("create the layer cache"))?;
        for entry in std::fs::read_dir(dir).map_err(RegistryError::io("read the layer cache"))? {
            let entry = entry.map_err(RegistryError::io("read the layer cache"))?;
            if entry.file_name().to_string_lossy().starts_with(".partial-") {
                let _ = std::fs::remove_file(entry.path());
            }
        }
        let next = AtomicU64::new(0);
        let held = Arc::default();
        Ok(LayerCache { dir: dir.to_path_buf(), max_bytes, min_free_bytes, next, held })
    }

    /// Keeps `digests` from collection until the answer drops (hold them before fetching).
    pub fn hold(&self, digests: impl IntoIterator<Item = Digest>) -> Held {
        let digests: Vec<Digest> = digests.into_iter().collect();
        let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        for d in &digests {
            *held.entry(d.clone()).or_default() += 1;
        }
        Held { _blobs: Arc::new(HeldBlobs { digests, by: self.held.clone() }) }
    }

    fn path(&self, digest: &Digest) -> PathBuf {
        self.dir.join("sha256").join(digest.hex())
    }

    /// The blob's file, when cached; marks it used.
    pub fn get(&self, digest: &Digest) -> Option<PathBuf> {
        let path = self.path(digest);
        let file = std::fs::File::options().append(true).open(&path).ok()?;
        let _ = file.set_modified(SystemTime::now());
        Some(path)
    }

    /// A writer for the blob `digest`, refusing more than `cap` bytes.
    pub fn stage(&self, digest: &Digest, cap: u64) -> Result<Staged<'_>> {
        self.check_reserve()?;
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        let tmp = self.dir.join(format!(".partial-{}-{}-{n}", digest.hex(), std::process::id()));
        let file = std::fs::File::create(&tmp).map_err(RegistryError::io("create a layer file"))?;
        Ok(Staged {
            file,
            tmp,
            dest: self.path(digest),
            expected: digest.clone(),
            hasher: Hasher::default(),
            written: 0,
            cap,
            checked_at: 0,
            cache: self,
        })
    }

    fn check_reserve(&self) -> Result<()> {
        let free = free_bytes(&self.dir).map_err(RegistryError::io("statvfs the layer cache"))?;
        if free < self.min_free_bytes {
            return Err(RegistryError::DiskFull(format!(
                "{} MiB free, the node keeps {} MiB",
                free >> 20,
                self.min_free_bytes >> 20
            )));
        }
        Ok(())
    }

    /// Removes least recently used blobs neither in `keep` nor held until the cache is within
    /// its bound. Returns the bytes freed.
    pub fn gc(&self, keep: &HashSet<Digest>) -> u64 {
        let Ok(entries) = std::fs::read_dir(self.dir.join("sha256")) else { return 0 };
        let mut blobs: Vec<(SystemTime, u64, PathBuf, String)> = entries
            .flatten()
            .filter_map(|e| {
                let m = e.metadata().ok()?;
                let name = e.file_name().to_string_lossy().into_owned();
                Some((m.modified().ok()?, m.len(), e.path(), name))
            })
            .collect();
        let mut total: u64 = blobs.iter().map(|b| b.1).sum();
        blobs.sort();
        let mut freed = 0;
        for (_, len, path, name) in blobs {
            if total <= self.max_bytes {
                break;
            }
            if keep.iter().any(|d| d.hex() == name) {
                continue;
            }
            // Checked blob by blob, under the lock, so a pull that holds one now keeps it.
            let held = self.held.lock().unwrap_or_else(|e| e.into_inner());
            if held.keys().any(|d| d.hex() == name) {
                continue;
            }
            if std::fs::remove_file(&path).is_ok() {
                total -= len;
                freed += len;
            }
        }
        freed
    }
}

fn free_bytes(path: &Path) -> std::io::Result<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes())?;
    // SAFETY: a valid C string and a zeroed out-parameter of the right type.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(st.f_bavail as u64 * st.f_frsize as u64)
}

/// A blob being written into the cache. Dropped without `finish`, it leaves nothing.
#[derive(Debug)]
pub struct Staged<'a> {
    file: std::fs::File,
    tmp: PathBuf,
    dest: PathBuf,
    expected: Digest,
    hasher: Hasher,
    written: u64,
    cap: u64,
    checked_at: u64,
    cache: &'a LayerCache,
}

impl Staged<'_> {
    /// Appends `bytes` (a page-cache write: cheap enough to do on the async thread).
    pub fn write(&mut self, bytes: &[u8]) -> Result<()> {
        self.written += bytes.len() as u64;
        if self.written > self.cap {
            let what = format!("layer {}", self.expected);
            return Err(RegistryError::TooLarge { what, size: self.written, cap: self.cap });
        }
        if self.written - self.checked_at >= RESERVE_CHECK_EVERY {
            self.checked_at = self.written;
            self.cache.check_reserve()?;
        }
        self.hasher.update(bytes);
        self.file.write_all(bytes).map_err(RegistryError::io("write a layer file"))
    }

    /// Checks the digest and puts the blob in place; its path.
    pub fn finish(mut self) -> Result<PathBuf> {
        let actual = std::mem::take(&mut self.hasher).finish();
        if actual != self.expected {
            let _ = std::fs::remove_file(&self.tmp);
            let expected = self.expected.to_string();
            return Err(RegistryError::DigestMismatch { expected, actual: actual.to_string() });
        }
        std::fs::rename(&self.tmp, &self.dest).map_err(RegistryError::io("install a layer"))?;
        Ok(self.dest.clone())
    }
}

impl Drop for Staged<'_> {
    fn drop(&mut self) {
        // After `finish` renamed it, this finds nothing.
        let _ = std::fs::remove_file(&self.tmp);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_blob_is_kept_only_under_its_own_digest() {
        let dir = tempfile::tempdir().unwrap();
        let cache = LayerCache::open(dir.path(), u64::MAX, 0).unwrap();
        let good = Digest::of(b"layer");
        let mut s = cache.stage(&good, 100).unwrap();
        s.write(b"layer").unwrap();
        let path = s.finish().unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"layer");
        assert_eq!(cache.get(&good), Some(path));

        let claimed = Digest::of(b"what the registry promised");
        let mut s = cache.stage(&claimed, 100).unwrap();
        s.write(b"what it sent").unwrap();
        assert!(matches!(s.finish(), Err(RegistryError::DigestMismatch { .. })));
        assert_eq!(cache.get(&claimed), None);
        let mut s = cache.stage(&claimed, 4).unwrap();
        assert!(matches!(s.write(b"12345"), Err(RegistryError::TooLarge { .. })));
        drop(s);
        let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().flatten().collect();
        assert_eq!(left.len(), 1, "nothing but sha256/ stays: {left:?}");
    }

    #[test]
    fn gc_removes_the_least_recently_used_blobs_first_and_never_the_kept_ones() {
        let dir = tempfile::tempdir().unwrap();
        let cache = LayerCache::open(dir.path(), 25, 0).unwrap();
        let mut digests = vec![];
        for (i, body) in [b"aaaaaaaaaa", b"bbbbbbbbbb", b"cccccccccc"].iter().enumerate() {
            let d = Digest::of(*body);
            let mut s = cache.stage(&d, 100).unwrap();
            s.write(*body).unwrap();
            let path = s.finish().unwrap();
            let age = SystemTime::now() - std::time::Duration::from_secs(100 - i as u64);
            std::fs::File::options().append(true).open(path).unwrap().set_modified(age).unwrap();
            digests.push(d);
        }
        // The oldest is used again: the second oldest goes instead.
        cache.get(&digests[0]).unwrap();
        assert_eq!(cache.gc(&HashSet::new()), 10);
        assert!(cache.get(&digests[1]).is_none());
        let cache = LayerCache::open(dir.path(), 0, 0).unwrap();
        // Another pull holds the newest: it stays while held, in any clone of the hold.
        let held = cache.hold([digests[2].clone()]);
        let also = held.clone();
        drop(held);
        assert_eq!(cache.gc(&HashSet::new()), 10);
        assert!(cache.get(&digests[0]).is_none());
        assert!(cache.get(&digests[2]).is_some());
        drop(also);
        assert_eq!(cache.gc(&[digests[2].clone()].into()), 0);
        assert!(cache.get(&digests[2]).is_some());
        assert_eq!(cache.gc(&HashSet::new()), 10);
        assert!(cache.get(&digests[2]).is_none());
    }

    #[test]
    fn a_full_disk_refuses_a_new_blob() {
        let dir = tempfile::tempdir().unwrap();
        let cache = LayerCache::open(dir.path(), u64::MAX, u64::MAX).unwrap();
        assert!(matches!(cache.stage(&Digest::of(b"x"), 1), Err(RegistryError::DiskFull(_))));
    }
}
