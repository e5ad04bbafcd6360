//! The `fs` backend: objects are files under a root directory, named by their key.
//!
//! A put streams into a temp file under `<root>/.tmp/`, syncs it (with `fsync`, the default),
//! and renames it over the key's path: readers see the old file or the whole new one, and two
//! writers of one key each rename a complete file (the last rename wins). A dropped or failed put
//! removes its temp file; temp files left by a crash are removed by the next `open` once they are
//! an hour old (younger ones may belong to another process writing into the same root).
//!
//! Keys are validated ([`Key`]): no `..`, no absolute paths, no hidden components, so a key always
//! names a path inside the root. The root is assumed to be the store's own directory, but what is
//! inside it may be written by every node sharing it: the backend never creates symlinks and
//! never follows one below the root. A key's path is looked at one component at a time with
//! `lstat` ([`inspect`]); a symlink on the way or at the key, or anything but a regular file at
//! it (a FIFO would block the reading thread), is [`StoreError::Refused`]. A file is opened only
//! after that and must then be the very file looked at (same device and inode), so one swapped in
//! between is refused too. `.tmp` must be a real directory, and only regular files in it are
//! cleared. What remains (std has no `O_NOFOLLOW`): a directory swapped for a symlink in the
//! microseconds between the check and the call is followed, and a FIFO swapped in for a checked
//! file blocks that one open.

use std::io::{ErrorKind, Read, SeekFrom, Write};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use bytes::{Bytes, BytesMut};
use futures_util::StreamExt;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncReadExt, AsyncSeekExt, AsyncWriteExt};

use crate::object::check_prefix;
use crate::{ByteRange, ByteStream, GetObject, Key, ListPage, ObjectMeta, ObjectStore};
use crate::{Result, StoreError};

/// Where staged writes live, inside the root so the final rename never crosses filesystems.
const TMP_DIR: &str = ".tmp";
/// Temp files older than this at `open` are leftovers of a crash.
const STALE_TMP: Duration = Duration::from_secs(3600);
/// Bytes per item of a get's stream.
const READ_CHUNK: usize = 256 * 1024;

/// The `fs` backend's settings (the `[store.fs]` table of the node config).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FsConfig {
    /// The directory holding the objects; created if missing.
    pub root: PathBuf,
    /// Sync every object (and its directory) before it becomes visible. Off only for throwaway
    /// stores: without it a power cut can leave a committed manifest pointing at lost chunks.
    #[serde(default = "default_fsync")]
    pub fsync: bool,
    /// Objects per `list` page.
    #[serde(default = "default_list_page")]
    pub list_page: usize,
}

fn default_fsync() -> bool {
    true
}

fn default_list_page() -> usize {
    5000
}

impl FsConfig {
    pub fn new(root: impl Into<PathBuf>) -> FsConfig {
        FsConfig { root: root.into(), fsync: default_fsync(), list_page: default_list_page() }
    }
}

/// See the module docs.
#[derive(Debug)]
pub struct FsStore {
    root: PathBuf,
    tmp: PathBuf,
    fsync: bool,
    list_page: usize,
}

impl FsStore {
    /// Creates the root if needed and clears stale temp files.
    pub async fn open(cfg: FsConfig) -> Result<FsStore> {
        if cfg.list_page == 0 {
            return Err(StoreError::InvalidConfig("fs list_page must be at least 1".into()));
        }
        let tmp = cfg.root.join(TMP_DIR);
        tokio::fs::create_dir_all(&cfg.root)
            .await
            .map_err(StoreError::io(format!("creating {}", cfg.root.display())))?;
        match tokio::fs::create_dir(&tmp).await {
            Ok(()) => {}
            Err(e) if e.kind() == ErrorKind::AlreadyExists => {}
            Err(e) => return Err(StoreError::io(format!("creating {}", tmp.display()))(e)),
        }
        let store = FsStore { root: cfg.root, tmp, fsync: cfg.fsync, list_page: cfg.list_page };
        let tmp = store.tmp.clone();
        blocking(move || {
            check_tmp(&tmp, "open")?;
            remove_stale_tmp(&tmp)
        })
        .await?;
        Ok(store)
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    fn path(&self, key: &Key) -> PathBuf {
        self.root.join(key.as_str())
    }

    /// Moves a staged file over the key's path, then syncs the directory.
    async fn commit(&self, key: &Key, tmp: &Path, guard: TempFile) -> Result<()> {
        // Inline, not on a blocking thread: the object becomes visible only while the put's
        // future is being polled, so a put that was dropped can never complete behind the
        // caller's back. All calls are metadata operations of a few microseconds.
        let parent = make_parents(&self.root, key)?;
        let path = self.path(key);
        if std::fs::symlink_metadata(&path).is_ok_and(|m| m.file_type().is_symlink()) {
            // The rename would replace the link, but a link at a key was planted: say so.
            return Err(refused("put", key, format!("{key} is a symlink")));
        }
        std::fs::rename(tmp, &path).map_err(StoreError::io(format!("renaming {key}")))?;
        guard.disarm();
        if self.fsync {
            // The rename is durable only once its directory is synced.
            blocking(move || {
                std::fs::File::open(&parent)
                    .and_then(|d| d.sync_all())
                    .map_err(StoreError::io(format!("syncing {}", parent.display())))
            })
            .await?;
        }
        Ok(())
    }

    /// A fresh staging path in `.tmp`, which must still be a real directory: a symlink there
    /// would stage the object's bytes wherever it points.
    fn temp_path(&self) -> Result<PathBuf> {
        check_tmp(&self.tmp, "put")?;
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let nanos = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default();
        Ok(self.tmp.join(format!(
            "{}-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed),
            nanos.as_nanos()
        )))
    }
}

#[async_trait]
impl ObjectStore for FsStore {
    fn name(&self) -> String {
        "fs".into()
    }

    async fn put(&self, key: &Key, mut body: ByteStream) -> Result<u64> {
        let tmp = self.temp_path()?;
        let guard = TempFile(Some(tmp.clone()));
        // `create_new`: never through something already at the staging name (a planted link).
        let mut file = tokio::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)
            .await
            .map_err(StoreError::io(format!("creating {}", tmp.display())))?;
        let mut written = 0u64;
        while let Some(part) = body.next().await {
            let part = part?;
            file.write_all(&part).await.map_err(StoreError::io(format!("writing {key}")))?;
            written += part.len() as u64;
        }
        file.flush().await.map_err(StoreError::io(format!("writing {key}")))?;
        if self.fsync {
            file.sync_data().await.map_err(StoreError::io(format!("syncing {key}")))?;
        }
        drop(file);
        self.commit(key, &tmp, guard).await?;
        Ok(written)
    }

    async fn put_bytes(&self, key: &Key, bytes: Bytes) -> Result<u64> {
        // Chunks arrive whole: one trip to a blocking thread instead of one per write.
        let tmp = self.temp_path()?;
        let guard = TempFile(Some(tmp.clone()));
        let (staged, fsync, name, len) = (tmp.clone(), self.fsync, key.to_string(), bytes.len());
        blocking(move || {
            let mut file = std::fs::File::options()
                .write(true)
                .create_new(true)
                .open(&staged)
                .map_err(StoreError::io(format!("creating {}", staged.display())))?;
            file.write_all(&bytes).map_err(StoreError::io(format!("writing {name}")))?;
            if fsync {
                file.sync_data().map_err(StoreError::io(format!("syncing {name}")))?;
            }
            Ok(())
        })
        .await?;
        self.commit(key, &tmp, guard).await?;
        Ok(len as u64)
    }

    async fn get_bytes(&self, key: &Key) -> Result<Bytes> {
        let (root, k) = (self.root.clone(), key.clone());
        blocking(move || {
            let (mut file, md) = open_checked(&root, &k, "get", false)?;
            if md.len() > crate::object::MAX_IN_MEMORY {
                return Err(StoreError::Refused {
                    op: "get",
                    key: k.to_string(),
                    reason: format!("{} bytes is too large to read into memory", md.len()),
                });
            }
            let mut buf = Vec::with_capacity(md.len() as usize);
            file.read_to_end(&mut buf).map_err(StoreError::io(format!("reading {k}")))?;
            Ok(Bytes::from(buf))
        })
        .await
    }

    async fn get(&self, key: &Key, range: Option<ByteRange>) -> Result<GetObject> {
        let (root, k) = (self.root.clone(), key.clone());
        let (file, md) = blocking(move || open_checked(&root, &k, "get", false)).await?;
        let mut file = tokio::fs::File::from_std(file);
        let meta = meta_of(key.clone(), &md);
        let (start, len) = match range {
            Some(r) => r.resolve(key, meta.size)?,
            None => (0, meta.size),
        };
        if start > 0 {
            file.seek(SeekFrom::Start(start))
                .await
                .map_err(StoreError::io(format!("seek {key}")))?;
        }
        let name = key.to_string();
        let body = futures_util::stream::try_unfold((file, len), move |(mut file, left)| {
            let name = name.clone();
            async move {
                if left == 0 {
                    return Ok(None);
                }
                let want = left.min(READ_CHUNK as u64) as usize;
                let mut buf = BytesMut::with_capacity(want);
                while buf.len() < want {
                    let n = (&mut file)
                        .take((want - buf.len()) as u64)
                        .read_buf(&mut buf)
                        .await
                        .map_err(StoreError::io(format!("reading {name}")))?;
                    if n == 0 {
                        // Files are replaced by rename, never truncated: this is outside damage.
                        return Err(StoreError::Io {
                            context: format!("reading {name}"),
                            source: ErrorKind::UnexpectedEof.into(),
                        });
                    }
                }
                Ok(Some((buf.freeze(), (file, left - want as u64))))
            }
        });
        Ok(GetObject { meta, start, len, body: Box::pin(body) })
    }

    async fn head(&self, key: &Key) -> Result<ObjectMeta> {
        let (root, k) = (self.root.clone(), key.clone());
        let md = blocking(move || match inspect(&root, k.as_str(), "head", &k)? {
            (_, Found::File(md)) => Ok(md),
            _ => Err(StoreError::NotFound { key: k.to_string() }),
        })
        .await?;
        Ok(meta_of(key.clone(), &md))
    }

    async fn list(&self, prefix: &str, page: Option<&str>) -> Result<ListPage> {
        check_prefix(prefix)?;
        let (root, prefix) = (self.root.clone(), prefix.to_string());
        let after = page.map(str::to_string);
        let limit = self.list_page;
        blocking(move || {
            // The deepest directory that holds every match: the prefix up to its last `/`,
            // reached without following a symlink.
            let dir = match prefix.rfind('/') {
                Some(i) => match inspect(&root, &prefix[..i], "list", &prefix)? {
                    (dir, Found::Dir) => Some(dir),
                    _ => None, // nothing there, so nothing under it
                },
                None => Some(root.clone()),
            };
            let mut found = Vec::new();
            if let Some(dir) = dir {
                walk(&root, &dir, &prefix, after.as_deref(), &mut found)?;
            }
            found.sort_by(|a, b| a.key.cmp(&b.key));
            let next = (found.len() > limit).then(|| found[limit - 1].key.to_string());
            found.truncate(limit);
            Ok(ListPage { objects: found, next })
        })
        .await
    }

    async fn delete(&self, keys: &[Key]) -> Result<()> {
        let (root, keys) = (self.root.clone(), keys.to_vec());
        blocking(move || {
            for key in keys {
                // Only a regular file at a path without symlinks: a link on the way would make
                // this delete a file outside the root.
                let path = match inspect(&root, key.as_str(), "delete", &key)? {
                    (path, Found::File(_)) => path,
                    _ => continue, // nothing there (or a directory): no object to delete
                };
                match std::fs::remove_file(&path) {
                    Ok(()) => {}
                    Err(e) if e.kind() == ErrorKind::NotFound => {}
                    Err(e) => return Err(StoreError::io(format!("deleting {key}"))(e)),
                }
            }
            Ok(())
        })
        .await
    }

    async fn touch(&self, key: &Key) -> Result<()> {
        let (root, k) = (self.root.clone(), key.clone());
        blocking(move || {
            let (file, _) = open_checked(&root, &k, "touch", true)?;
            file.set_modified(SystemTime::now()).map_err(StoreError::io(format!("touching {k}")))
        })
        .await
    }
}

/// Collects the files under `dir` whose keys start with `prefix` and sort after `after`.
fn walk(
    root: &Path,
    dir: &Path,
    prefix: &str,
    after: Option<&str>,
    out: &mut Vec<ObjectMeta>,
) -> Result<()> {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(StoreError::io(format!("listing {}", dir.display()))(e)),
    };
    for entry in entries {
        let entry = entry.map_err(StoreError::io(format!("listing {}", dir.display())))?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if name.starts_with('.') {
            continue; // `.tmp` and anything else that is not an object
        }
        let path = entry.path();
        let Ok(rel) = path.strip_prefix(root) else { continue };
        let Some(key) = rel.to_str() else { continue };
        let md = match std::fs::symlink_metadata(&path) {
            Ok(md) => md,
            Err(e) if e.kind() == ErrorKind::NotFound => continue, // deleted meanwhile
            Err(e) => return Err(StoreError::io(format!("stat {}", path.display()))(e)),
        };
        if md.file_type().is_symlink() {
            // Neither an object nor a directory to list: never followed (see the module docs).
            tracing::warn!(path = %path.display(), "a symlink in the store's directory; ignored");
        } else if md.is_dir() {
            // Descend only where keys can still match the prefix.
            let as_prefix = format!("{key}/");
            if as_prefix.starts_with(prefix) || prefix.starts_with(&as_prefix) {
                walk(root, &path, prefix, after, out)?;
            }
        } else if md.is_file()
            && key.starts_with(prefix)
            && after.is_none_or(|a| key > a)
            && let Ok(key) = Key::new(key)
        {
            out.push(meta_of(key, &md));
        }
    }
    Ok(())
}

fn meta_of(key: Key, md: &std::fs::Metadata) -> ObjectMeta {
    ObjectMeta { key, size: md.len(), modified: md.modified().unwrap_or(SystemTime::UNIX_EPOCH) }
}

fn not_found_or(key: &Key, what: &'static str) -> impl FnOnce(std::io::Error) -> StoreError {
    let key = key.to_string();
    move |e| match e.kind() {
        // A key whose path is a directory names no object either.
        ErrorKind::NotFound | ErrorKind::IsADirectory => StoreError::NotFound { key },
        _ => StoreError::Io { context: format!("{what} {key}"), source: e },
    }
}

fn refused(op: &'static str, key: &impl std::fmt::Display, reason: String) -> StoreError {
    StoreError::Refused { op, key: key.to_string(), reason }
}

/// What [`inspect`] found at a path below the root.
enum Found {
    /// A regular file, with its `lstat` metadata.
    File(std::fs::Metadata),
    Dir,
    /// Nothing: the path, or a directory on the way to it, is missing (or a file stands where
    /// a directory would be).
    Missing,
}

/// Looks at `rel` (a key, or a list prefix's directory part) below `root` one component at a
/// time with `lstat`, so nothing on the way is followed: a symlink anywhere, or anything but a
/// regular file or directory at the end (a FIFO, a socket, a device), is refused as `op` of
/// `key`. Returns the path and what is there.
fn inspect(
    root: &Path,
    rel: &str,
    op: &'static str,
    key: &impl std::fmt::Display,
) -> Result<(PathBuf, Found)> {
    let mut path = root.to_path_buf();
    let parts: Vec<&str> = rel.split('/').collect();
    for (i, part) in parts.iter().enumerate() {
        path.push(part);
        let md = match std::fs::symlink_metadata(&path) {
            Ok(md) => md,
            Err(e) if matches!(e.kind(), ErrorKind::NotFound | ErrorKind::NotADirectory) => {
                return Ok((path, Found::Missing));
            }
            Err(e) => return Err(StoreError::io(format!("stat {}", path.display()))(e)),
        };
        let (at, last, kind) = (parts[..=i].join("/"), i + 1 == parts.len(), md.file_type());
        if kind.is_symlink() {
            return Err(refused(op, key, format!("{at} is a symlink")));
        }
        if kind.is_dir() {
            if last {
                return Ok((path, Found::Dir));
            }
        } else if !last {
            return Ok((path, Found::Missing)); // a file where a directory would be
        } else if kind.is_file() {
            return Ok((path, Found::File(md)));
        } else {
            return Err(refused(op, key, format!("{at} is not a regular file")));
        }
    }
    Ok((path, Found::Missing)) // `rel` was empty: not a key
}

/// Opens `key`'s regular file (for writing its times when `write`) after [`inspect`] found it,
/// and makes sure the file opened is that one: `open` follows links, so a symlink (or another
/// file) swapped in between would be a different inode. A put renaming a new file over the key
/// meanwhile does that too, so a mismatch is looked at again a few times before it is refused.
fn open_checked(
    root: &Path,
    key: &Key,
    op: &'static str,
    write: bool,
) -> Result<(std::fs::File, std::fs::Metadata)> {
    for _ in 0..3 {
        let (path, seen) = match inspect(root, key.as_str(), op, key)? {
            (path, Found::File(md)) => (path, md),
            _ => return Err(StoreError::NotFound { key: key.to_string() }),
        };
        let file = std::fs::File::options()
            .read(!write)
            .write(write)
            .open(&path)
            .map_err(not_found_or(key, "opening"))?;
        let md = file.metadata().map_err(StoreError::io(format!("stat {key}")))?;
        if md.is_file() && md.dev() == seen.dev() && md.ino() == seen.ino() {
            return Ok((file, md));
        }
    }
    Err(refused(op, key, format!("{key} kept changing while it was opened")))
}

/// Creates the directories on `key`'s path below `root` one at a time (`mkdir` never follows
/// a link), refusing a symlink or a file on the way; returns the key's parent directory.
fn make_parents(root: &Path, key: &Key) -> Result<PathBuf> {
    let mut dir = root.to_path_buf();
    let parts: Vec<&str> = key.as_str().split('/').collect();
    for (i, part) in parts[..parts.len() - 1].iter().enumerate() {
        dir.push(part);
        match std::fs::create_dir(&dir) {
            Ok(()) => continue,
            Err(e) if e.kind() == ErrorKind::AlreadyExists => {}
            Err(e) => return Err(StoreError::io(format!("creating {}", dir.display()))(e)),
        }
        let md = std::fs::symlink_metadata(&dir)
            .map_err(StoreError::io(format!("stat {}", dir.display())))?;
        if !md.is_dir() {
            // `lstat`: a symlink to a directory is not a directory here.
            let what = if md.file_type().is_symlink() { "a symlink" } else { "not a directory" };
            return Err(refused("put", key, format!("{} is {what}", parts[..=i].join("/"))));
        }
    }
    Ok(dir)
}

/// `.tmp` must be a directory of its own: through a symlink, staged files would be written (and
/// stale ones deleted) wherever it points.
fn check_tmp(tmp: &Path, op: &'static str) -> Result<()> {
    let md = std::fs::symlink_metadata(tmp)
        .map_err(StoreError::io(format!("stat {}", tmp.display())))?;
    if md.is_dir() {
        Ok(())
    } else {
        let what = if md.file_type().is_symlink() { "a symlink" } else { "not a directory" };
        Err(refused(op, &TMP_DIR, format!("the staging directory {} is {what}", tmp.display())))
    }
}

/// Deletes staged files a crash left (regular files only: anything else was not staged here).
fn remove_stale_tmp(tmp: &Path) -> Result<()> {
    let now = SystemTime::now();
    let entries =
        std::fs::read_dir(tmp).map_err(StoreError::io(format!("listing {}", tmp.display())))?;
    for entry in entries.flatten() {
        // `DirEntry::metadata` does not follow a symlink.
        let old = entry.metadata().is_ok_and(|m| {
            m.is_file()
                && m.modified()
                    .is_ok_and(|m| now.duration_since(m).is_ok_and(|age| age > STALE_TMP))
        });
        if old {
            let _ = std::fs::remove_file(entry.path());
        }
    }
    Ok(())
}

/// Runs blocking file-system work off the async threads.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> Result<T> + Send + 'static) -> Result<T> {
    tokio::task::spawn_blocking(f).await.map_err(|e| StoreError::Io {
        context: "a blocking file-system task".into(),
        source: std::io::Error::other(e.to_string()),
    })?
}

/// A staged file that is removed unless the put got as far as renaming it into place — also
/// when the put's future is dropped half way.
struct TempFile(Option<PathBuf>);

impl TempFile {
    fn disarm(mut self) {
        self.0 = None;
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        if let Some(path) = self.0.take() {
            let _ = std::fs::remove_file(path);
        }
    }
}
