//! The node's local chunk cache: verified chunks in a directory, bounded in bytes, evicted least
//! recently used first.
//!
//! Concurrent fetches of one chunk are merged: the first caller (the leader) downloads it, the
//! others wait for the leader and then read the cached copy. So two wakes of the same snapshot at
//! once download each chunk once. If the leader fails or is dropped, a waiter takes over.
//!
//! Files are named by chunk id and re-verified when read; a damaged file is dropped and fetched
//! again. The index lives in memory and is rebuilt from the directory at open (oldest first by
//! modification time), so a restarted node keeps its cache.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::SystemTime;

use bytes::Bytes;
use serde::Deserialize;
use tokio::sync::watch;

use crate::chunk::ChunkId;
use crate::manifest::ChunkRef;
use crate::{Result, StoreError};

/// The cache's settings (the `[store.cache]` table of the node config).
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CacheConfig {
    pub dir: PathBuf,
    /// Bytes of chunks kept at most.
    pub max_bytes: u64,
}

/// What the cache did, for tests and metrics.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    pub hits: u64,
    /// Downloads started by a leader.
    pub fetches: u64,
    /// Callers that waited for another caller's download instead of starting their own.
    pub merged: u64,
    pub evictions: u64,
    /// Cached files that failed verification and were dropped.
    pub damaged: u64,
}

#[derive(Debug, Default)]
struct State {
    /// Chunk → (size, last use tick).
    entries: HashMap<ChunkId, (u64, u64)>,
    /// Last use tick → chunk: the LRU order.
    order: BTreeMap<u64, ChunkId>,
    tick: u64,
    used: u64,
    inflight: HashMap<ChunkId, watch::Receiver<()>>,
    stats: CacheStats,
}

/// See the module docs.
#[derive(Debug)]
pub struct ChunkCache {
    dir: PathBuf,
    max_bytes: u64,
    state: Mutex<State>,
}

impl ChunkCache {
    /// Opens (or creates) the cache directory and indexes what it holds.
    pub async fn open(cfg: CacheConfig) -> Result<ChunkCache> {
        let dir = cfg.dir.clone();
        let found = tokio::task::spawn_blocking(move || scan(&dir))
            .await
            .map_err(|e| StoreError::io("scanning the chunk cache")(std::io::Error::other(e)))??;
        let cache = ChunkCache { dir: cfg.dir, max_bytes: cfg.max_bytes, state: Mutex::default() };
        let victims = {
            let mut s = cache.state();
            for (id, size) in found {
                s.tick += 1;
                let tick = s.tick;
                s.entries.insert(id, (size, tick));
                s.order.insert(tick, id);
                s.used += size;
            }
            cache.evict(&mut s, None)
        };
        cache.remove_files(&victims);
        Ok(cache)
    }

    pub fn stats(&self) -> CacheStats {
        self.state().stats.clone()
    }

    /// Bytes held now.
    pub fn used(&self) -> u64 {
        self.state().used
    }

    /// The chunk's bytes: from the cache, from a concurrent caller's download, or from `fetch`,
    /// which must return verified bytes (the snapshot store's fetch checks the hash).
    pub async fn get_or_fetch<F, Fut>(&self, chunk: ChunkRef, fetch: F) -> Result<Bytes>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<Bytes>>,
    {
        let mut fetch = Some(fetch);
        loop {
            if self.touch(&chunk.id)
                && let Some(bytes) = self.read(chunk).await
            {
                self.state().stats.hits += 1;
                return Ok(bytes);
            }
            let leader = {
                let mut s = self.state();
                match s.inflight.get(&chunk.id) {
                    Some(rx) => {
                        let rx = rx.clone();
                        s.stats.merged += 1;
                        Err(rx)
                    }
                    None => {
                        let (tx, rx) = watch::channel(());
                        s.inflight.insert(chunk.id, rx);
                        s.stats.fetches += 1;
                        Ok(Inflight { cache: self, id: chunk.id, _done: tx })
                    }
                }
            };
            match leader {
                // Woken when the leader finishes, fails or is dropped: look again.
                Err(mut rx) => {
                    let _ = rx.changed().await;
                }
                Ok(inflight) => {
                    // A caller leads at most once: leading always returns.
                    let fetch = fetch.take().expect("a caller leads at most once");
                    let bytes = fetch().await?;
                    self.insert(chunk, &bytes).await;
                    drop(inflight);
                    return Ok(bytes);
                }
            }
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn path(&self, id: &ChunkId) -> PathBuf {
        self.dir.join(id.to_string())
    }

    /// Marks a use; whether the chunk is (believed) cached.
    fn touch(&self, id: &ChunkId) -> bool {
        let mut s = self.state();
        let Some(&(size, old)) = s.entries.get(id) else { return false };
        s.tick += 1;
        let tick = s.tick;
        s.order.remove(&old);
        s.order.insert(tick, *id);
        s.entries.insert(*id, (size, tick));
        true
    }

    /// Reads and verifies a cached chunk; drops it when it is gone or damaged.
    async fn read(&self, chunk: ChunkRef) -> Option<Bytes> {
        let path = self.path(&chunk.id);
        let read = tokio::fs::read(&path).await;
        if let Ok(bytes) = &read
            && bytes.len() == chunk.size as usize
            && ChunkId::of(bytes) == chunk.id
        {
            return read.ok().map(Bytes::from);
        }
        let mut s = self.state();
        if let Some((size, tick)) = s.entries.remove(&chunk.id) {
            s.order.remove(&tick);
            s.used -= size;
        }
        if read.is_ok() {
            s.stats.damaged += 1;
            drop(s);
            let _ = std::fs::remove_file(&path);
        }
        None
    }

    /// Adds a verified chunk. Best effort: a full disk costs a later download, not this read.
    async fn insert(&self, chunk: ChunkRef, bytes: &Bytes) {
        let size = bytes.len() as u64;
        if size > self.max_bytes {
            return;
        }
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let tmp =
            self.dir.join(format!(".tmp-{}-{}", chunk.id, NEXT.fetch_add(1, Ordering::Relaxed)));
        let written = match tokio::fs::write(&tmp, bytes).await {
            Ok(()) => tokio::fs::rename(&tmp, self.path(&chunk.id)).await,
            Err(e) => Err(e),
        };
        if let Err(e) = written {
            tracing::warn!("chunk cache: writing {}: {e}", chunk.id);
            let _ = tokio::fs::remove_file(&tmp).await;
            return;
        }
        let victims = {
            let mut s = self.state();
            if !s.entries.contains_key(&chunk.id) {
                s.tick += 1;
                let tick = s.tick;
                s.entries.insert(chunk.id, (size, tick));
                s.order.insert(tick, chunk.id);
                s.used += size;
            }
            self.evict(&mut s, Some(chunk.id))
        };
        self.remove_files(&victims);
    }

    /// Drops least recently used entries until the cache fits, never `keep`.
    fn evict(&self, s: &mut State, keep: Option<ChunkId>) -> Vec<ChunkId> {
        let mut victims = Vec::new();
        let mut ticks = s.order.keys().copied().collect::<Vec<_>>().into_iter();
        while s.used > self.max_bytes {
            let Some(tick) = ticks.next() else { break };
            let Some(&id) = s.order.get(&tick) else { continue };
            if Some(id) == keep {
                continue;
            }
            s.order.remove(&tick);
            if let Some((size, _)) = s.entries.remove(&id) {
                s.used -= size;
            }
            s.stats.evictions += 1;
            victims.push(id);
        }
        victims
    }

    fn remove_files(&self, ids: &[ChunkId]) {
        for id in ids {
            let _ = std::fs::remove_file(self.path(id));
        }
    }
}

/// A leader's claim on a chunk download; dropping it (done, failed or cancelled) wakes waiters.
struct Inflight<'a> {
    cache: &'a ChunkCache,
    id: ChunkId,
    _done: watch::Sender<()>,
}

impl Drop for Inflight<'_> {
    fn drop(&mut self) {
        self.cache.state().inflight.remove(&self.id);
        // `_done` drops after this body: its receivers see the channel close.
    }
}

/// The cached chunks in `dir`, oldest first; removes temp files and strangers.
fn scan(dir: &std::path::Path) -> Result<Vec<(ChunkId, u64)>> {
    std::fs::create_dir_all(dir).map_err(StoreError::io(format!("creating {}", dir.display())))?;
    let mut found = Vec::new();
    let entries =
        std::fs::read_dir(dir).map_err(StoreError::io(format!("listing {}", dir.display())))?;
    for entry in entries.flatten() {
        let Ok(md) = entry.metadata() else { continue };
        let id = entry.file_name().to_str().and_then(|n| n.parse::<ChunkId>().ok());
        match id {
            Some(id) if md.is_file() => {
                found.push((md.modified().unwrap_or(SystemTime::UNIX_EPOCH), id, md.len()));
            }
            _ if md.is_file() => {
                let _ = std::fs::remove_file(entry.path());
            }
            _ => {}
        }
    }
    found.sort();
    Ok(found.into_iter().map(|(_, id, size)| (id, size)).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(n: u8) -> (ChunkRef, Bytes) {
        let data = Bytes::from(vec![n; 1000]);
        (ChunkRef { id: ChunkId::of(&data), size: 1000 }, data)
    }

    async fn cache(dir: &std::path::Path, max: u64) -> ChunkCache {
        ChunkCache::open(CacheConfig { dir: dir.to_path_buf(), max_bytes: max }).await.unwrap()
    }

    #[tokio::test]
    async fn least_recently_used_is_evicted_first() {
        let dir = tempfile::tempdir().unwrap();
        let c = cache(dir.path(), 3000).await;
        let (a, b, d, e) = (chunk(1), chunk(2), chunk(3), chunk(4));
        for (r, data) in [&a, &b, &d] {
            let data = data.clone();
            c.get_or_fetch(*r, || async { Ok(data) }).await.unwrap();
        }
        // Use `a` again, so `b` is now the least recently used.
        c.get_or_fetch(a.0, || async { panic!("a is cached") }).await.unwrap();
        let data = e.1.clone();
        c.get_or_fetch(e.0, || async { Ok(data) }).await.unwrap();
        assert_eq!(c.used(), 3000);
        assert_eq!(c.stats().evictions, 1);
        assert!(!dir.path().join(b.0.id.to_string()).exists(), "b's file is gone");
        let got = c.get_or_fetch(a.0, || async { panic!("a is still cached") }).await.unwrap();
        assert_eq!(got, a.1);
        let mut refetched = false;
        c.get_or_fetch(b.0, || async {
            refetched = true;
            Ok(b.1.clone())
        })
        .await
        .unwrap();
        assert!(refetched, "b was evicted");

        // A reopened cache keeps what fits, and drops damaged files when read.
        drop(c);
        std::fs::write(dir.path().join(a.0.id.to_string()), vec![9; 1000]).unwrap();
        let c = cache(dir.path(), 3000).await;
        assert_eq!(c.used(), 3000);
        let got = c.get_or_fetch(a.0, || async { Ok(a.1.clone()) }).await.unwrap();
        assert_eq!(got, a.1);
        assert_eq!(c.stats().damaged, 1);
    }

    #[tokio::test]
    async fn concurrent_fetches_of_one_chunk_are_merged() {
        let dir = tempfile::tempdir().unwrap();
        let c = cache(dir.path(), 1 << 20).await;
        let (r, data) = chunk(5);
        let (release, released) = tokio::sync::oneshot::channel::<()>();
        let leader_data = data.clone();
        let mut leader = std::pin::pin!(c.get_or_fetch(r, || async move {
            released.await.unwrap();
            Ok(leader_data)
        }));
        // One poll takes the leader as far as its (blocked) download.
        assert!(futures_util::poll!(leader.as_mut()).is_pending());
        let mut follower =
            std::pin::pin!(c.get_or_fetch(r, || async { panic!("a second download") }));
        assert!(futures_util::poll!(follower.as_mut()).is_pending());
        assert_eq!(c.stats().merged, 1);
        release.send(()).unwrap();
        assert_eq!(leader.await.unwrap(), data);
        assert_eq!(follower.await.unwrap(), data);
        assert_eq!(c.stats().fetches, 1);
    }

    #[tokio::test]
    async fn a_dropped_leader_hands_over_to_a_waiter() {
        let dir = tempfile::tempdir().unwrap();
        let c = cache(dir.path(), 1 << 20).await;
        let (r, data) = chunk(6);
        let mut leader = Box::pin(c.get_or_fetch(r, std::future::pending::<Result<Bytes>>));
        assert!(futures_util::poll!(leader.as_mut()).is_pending());
        let follower_data = data.clone();
        let mut follower = std::pin::pin!(c.get_or_fetch(r, || async { Ok(follower_data) }));
        assert!(futures_util::poll!(follower.as_mut()).is_pending());
        drop(leader);
        assert_eq!(follower.await.unwrap(), data);
        assert_eq!(c.stats().fetches, 2);
    }
}
