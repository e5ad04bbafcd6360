//! The [`ObjectStore`] trait every backend implements, and the types it speaks: validated keys,
//! byte ranges, object metadata, list pages and byte streams.
//!
//! The trait is S3's model cut down to what the snapshot store needs. Every method is an `async
//! fn` whose future can be dropped at any await point: a dropped put leaves no object (the `fs`
//! backend removes its temp file, the `s3` backend aborts its multipart upload), a dropped get
//! simply stops reading.

use std::fmt;
use std::pin::Pin;
use std::time::SystemTime;

use async_trait::async_trait;
use bytes::Bytes;
use futures_util::{Stream, TryStreamExt};

use crate::{Result, StoreError};

/// A stream of bytes: an upload's body or a download's content.
pub type ByteStream = Pin<Box<dyn Stream<Item = Result<Bytes>> + Send>>;

/// A stream over one buffer.
pub fn stream_of(bytes: Bytes) -> ByteStream {
    Box::pin(futures_util::stream::once(async move { Ok(bytes) }))
}

/// Longest key we accept (S3 allows 1024 bytes; a backend prefix must fit beside it).
pub const MAX_KEY_LEN: usize = 900;

/// An object's name: `/`-separated components of `[A-Za-z0-9._~=+,@:-]`, none empty, none
/// starting with `.` (so no `.` and `..`, and hidden names stay free for a backend's own use), no
/// leading or trailing `/`. Such a key means the same on every backend and cannot escape the `fs`
/// backend's root.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Key(String);

impl Key {
    pub fn new(key: impl Into<String>) -> Result<Key> {
        let key = key.into();
        match check_key(&key) {
            Ok(()) => Ok(Key(key)),
            Err(reason) => Err(StoreError::InvalidKey { key, reason }),
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.0)
    }
}

impl std::str::FromStr for Key {
    type Err = StoreError;
    fn from_str(s: &str) -> Result<Key> {
        Key::new(s)
    }
}

/// Checks a list prefix: like a key, but it may be empty and may end with `/` (a prefix is a
/// string prefix, as in S3, not a directory).
pub(crate) fn check_prefix(prefix: &str) -> Result<()> {
    if prefix.is_empty() {
        return Ok(());
    }
    check_key(prefix.strip_suffix('/').unwrap_or(prefix))
        .map_err(|reason| StoreError::InvalidKey { key: prefix.to_string(), reason })
}

fn check_key(key: &str) -> std::result::Result<(), &'static str> {
    if key.is_empty() {
        return Err("empty");
    }
    if key.len() > MAX_KEY_LEN {
        return Err("longer than 900 bytes");
    }
    let allowed = |c: char| c.is_ascii_alphanumeric() || "._~=+,@:-".contains(c);
    if !key.chars().all(|c| allowed(c) || c == '/') {
        return Err("only A-Z a-z 0-9 . _ ~ = + , @ : - and / are allowed");
    }
    for part in key.split('/') {
        if part.is_empty() {
            return Err("empty path component (leading, trailing or double /)");
        }
        if part.starts_with('.') {
            return Err("a path component starts with `.`");
        }
    }
    Ok(())
}

/// Bytes `start..end` of an object (`end` exclusive; `None` means to the end). An `end` past the
/// object's size is cut to it; a `start` at or past the size is [`StoreError::InvalidRange`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ByteRange {
    pub start: u64,
    pub end: Option<u64>,
}

impl ByteRange {
    /// `start..end`; `end` must be greater than `start`.
    pub fn new(start: u64, end: u64) -> ByteRange {
        ByteRange { start, end: Some(end) }
    }

    /// From `start` to the end of the object.
    pub fn from(start: u64) -> ByteRange {
        ByteRange { start, end: None }
    }

    /// The range within an object of `size` bytes, as `(start, len)`.
    pub(crate) fn resolve(&self, key: &Key, size: u64) -> Result<(u64, u64)> {
        let end = self.end.map_or(size, |e| e.min(size));
        if self.start >= size || self.end.is_some_and(|e| e <= self.start) {
            return Err(StoreError::InvalidRange { key: key.to_string(), range: *self, size });
        }
        Ok((self.start, end - self.start))
    }
}

impl fmt::Display for ByteRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.end {
            Some(end) => write!(f, "{}..{end}", self.start),
            None => write!(f, "{}..", self.start),
        }
    }
}

/// What `head` and `list` say about an object.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ObjectMeta {
    pub key: Key,
    pub size: u64,
    /// When the object was last written (or touched), by the store's clock.
    pub modified: SystemTime,
}

/// The answer to `get`: the whole object's metadata and the requested bytes as a stream.
pub struct GetObject {
    pub meta: ObjectMeta,
    /// Where the body starts within the object, and how many bytes it carries.
    pub start: u64,
    pub len: u64,
    pub body: ByteStream,
}

impl fmt::Debug for GetObject {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GetObject")
            .field("meta", &self.meta)
            .field("start", &self.start)
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

/// The largest object read whole into memory (records, manifests, leases): the store is shared
/// and may be hostile, and a huge object must not take the node's memory with it.
pub const MAX_IN_MEMORY: u64 = 64 << 20;

impl GetObject {
    /// Reads the whole body into memory, checking it carried exactly `len` bytes.
    pub async fn bytes(self) -> Result<Bytes> {
        let key = self.meta.key.to_string();
        if self.len > MAX_IN_MEMORY {
            return Err(StoreError::Refused {
                op: "get",
                key,
                reason: format!("{} bytes is too large to read into memory", self.len),
            });
        }
        let parts: Vec<Bytes> = self.body.try_collect().await?;
        let total: usize = parts.iter().map(Bytes::len).sum();
        if total as u64 != self.len {
            return Err(StoreError::Unavailable {
                op: "get",
                key,
                attempts: 1,
                reason: format!("body ended after {total} of {} bytes", self.len),
            });
        }
        Ok(match parts.len() {
            1 => parts.into_iter().next().unwrap_or_default(),
            _ => parts.concat().into(),
        })
    }
}

/// One page of a listing, in key order. `next` continues it.
#[derive(Clone, Debug, Default)]
pub struct ListPage {
    pub objects: Vec<ObjectMeta>,
    pub next: Option<String>,
}

/// An object store: a flat namespace of immutable-once-written objects. See the module docs.
#[async_trait]
pub trait ObjectStore: Send + Sync + fmt::Debug {
    /// A short name for messages and reports: `fs`, `s3`, `fault(fs)`.
    fn name(&self) -> String;

    /// Writes `body` under `key`, replacing any object there. Readers see the old object or the
    /// whole new one, never a part. Returns the bytes written.
    async fn put(&self, key: &Key, body: ByteStream) -> Result<u64>;

    /// The object's bytes, or the bytes of `range`. A missing object is `NotFound`.
    async fn get(&self, key: &Key, range: Option<ByteRange>) -> Result<GetObject>;

    /// The object's metadata, or `NotFound`.
    async fn head(&self, key: &Key) -> Result<ObjectMeta>;

    /// One page of the objects whose keys start with `prefix` (a string prefix, as in S3), in key
    /// order. Pass the previous page's `next` to continue.
    async fn list(&self, prefix: &str, page: Option<&str>) -> Result<ListPage>;

    /// Deletes every key given. Keys that do not exist are not an error.
    async fn delete(&self, keys: &[Key]) -> Result<()>;

    /// Renews the object's `modified` time without changing its bytes, or `NotFound`. The
    /// snapshot store touches an old chunk it reuses so garbage collection sees it as young.
    async fn touch(&self, key: &Key) -> Result<()>;

    /// `put` of one buffer.
    async fn put_bytes(&self, key: &Key, bytes: Bytes) -> Result<u64> {
        self.put(key, stream_of(bytes)).await
    }

    /// `get` of the whole object into memory.
    async fn get_bytes(&self, key: &Key) -> Result<Bytes> {
        self.get(key, None).await?.bytes().await
    }

    /// Every object under `prefix`, following pages.
    async fn list_all(&self, prefix: &str) -> Result<Vec<ObjectMeta>> {
        let mut all = Vec::new();
        let mut page: Option<String> = None;
        loop {
            let got = self.list(prefix, page.as_deref()).await?;
            all.extend(got.objects);
            match got.next {
                Some(next) => page = Some(next),
                None => return Ok(all),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_that_could_escape_or_confuse_are_refused() {
        for bad in [
            "", "/abs", "a//b", "a/", "..", "a/../b", "./a", ".hidden", "a/.tmp/x", "a b", "a\\b",
            "a\0b", "é",
        ] {
            assert!(Key::new(bad).is_err(), "{bad:?} was accepted");
        }
        for good in ["chunks/0af3", "goldens/pool-1/abc", "checkpoints/ck_x.y", "a/b~c=d+e,f@g:h"] {
            assert_eq!(Key::new(good).unwrap().as_str(), good);
        }
        assert!(Key::new("x".repeat(MAX_KEY_LEN + 1)).is_err());
    }

    #[test]
    fn prefixes_may_end_with_a_slash_or_be_cut() {
        for good in ["", "chunks/", "chunks/ab", "goldens/pool"] {
            check_prefix(good).unwrap();
        }
        for bad in ["/", "../", "a//", "a/../", "a/.."] {
            assert!(check_prefix(bad).is_err(), "{bad:?} was accepted");
        }
    }

    #[test]
    fn ranges_resolve_against_the_size() {
        let k = Key::new("k").unwrap();
        assert_eq!(ByteRange::new(2, 5).resolve(&k, 10).unwrap(), (2, 3));
        assert_eq!(ByteRange::from(7).resolve(&k, 10).unwrap(), (7, 3));
        assert_eq!(ByteRange::new(7, 100).resolve(&k, 10).unwrap(), (7, 3));
        assert!(ByteRange::from(10).resolve(&k, 10).is_err());
        assert!(ByteRange::new(5, 5).resolve(&k, 10).is_err());
    }
}
