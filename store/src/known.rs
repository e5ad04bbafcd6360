//! The local known-chunk index: chunks this node has seen in the store, and how fresh each was
//! (its `modified` time in the store, or when this node wrote or touched it).
//!
//! It saves a HEAD per chunk on the next upload. An entry is trusted only while it is younger
//! than the snapshot store's reuse window, because garbage collection on another node may delete
//! a chunk that nobody references once it is older than the grace period — the window is what
//! keeps "known" from outliving the chunk.
//!
//! On disk it is an append-only file of 40-byte records (32-byte id, 8-byte little-endian Unix
//! seconds); a later record wins, a zero time forgets. A torn last record (a crash mid-append) is
//! ignored. The file is rewritten at open when most of it is superseded.

use std::collections::HashMap;
use std::io::Write;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, SystemTime};

use crate::chunk::ChunkId;
use crate::{Result, StoreError};

const RECORD: usize = 40;

#[derive(Debug)]
pub(crate) struct KnownChunks {
    path: Option<PathBuf>,
    map: Mutex<HashMap<ChunkId, u64>>,
}

impl KnownChunks {
    /// An index kept in `path` (created if missing), or in memory only.
    pub fn open(path: Option<PathBuf>) -> Result<KnownChunks> {
        let mut map = HashMap::new();
        let Some(p) = &path else {
            return Ok(KnownChunks { path, map: Mutex::new(map) });
        };
        let bytes = match std::fs::read(p) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(e) => return Err(StoreError::io(format!("reading {}", p.display()))(e)),
        };
        let records = bytes.len() / RECORD;
        for rec in bytes.chunks_exact(RECORD) {
            let mut id = [0u8; 32];
            id.copy_from_slice(&rec[..32]);
            let mut secs = [0u8; 8];
            secs.copy_from_slice(&rec[32..]);
            let (id, secs) = (ChunkId::from_bytes(id), u64::from_le_bytes(secs));
            if secs == 0 {
                map.remove(&id);
            } else {
                map.insert(id, secs);
            }
        }
        let known = KnownChunks { path: path.clone(), map: Mutex::new(map) };
        if records > 2 * known.len() + 1024 || bytes.len() % RECORD != 0 {
            known.rewrite()?;
        }
        Ok(known)
    }

    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<ChunkId, u64>> {
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn len(&self) -> usize {
        self.map().len()
    }

    /// Whether `id` was fresh at or after `since`.
    pub fn fresh_since(&self, id: &ChunkId, since: SystemTime) -> bool {
        self.map().get(id).is_some_and(|&secs| secs >= unix_secs(since))
    }

    /// Records chunks and their freshness.
    pub fn record(&self, entries: &[(ChunkId, SystemTime)]) -> Result<()> {
        let mut buf = Vec::with_capacity(entries.len() * RECORD);
        {
            let mut map = self.map();
            for (id, at) in entries {
                // Never zero: zero is the tombstone.
                let secs = unix_secs(*at).max(1);
                map.insert(*id, secs);
                buf.extend_from_slice(id.as_bytes());
                buf.extend_from_slice(&secs.to_le_bytes());
            }
        }
        self.append(&buf)
    }

    /// Forgets chunks (garbage collection deleted them).
    pub fn forget(&self, ids: &[ChunkId]) -> Result<()> {
        let mut buf = Vec::with_capacity(ids.len() * RECORD);
        {
            let mut map = self.map();
            for id in ids {
                map.remove(id);
                buf.extend_from_slice(id.as_bytes());
                buf.extend_from_slice(&0u64.to_le_bytes());
            }
        }
        self.append(&buf)
    }

    fn append(&self, buf: &[u8]) -> Result<()> {
        let Some(path) = &self.path else { return Ok(()) };
        if buf.is_empty() {
            return Ok(());
        }
        // A lost tail costs only HEAD requests later, so no fsync.
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .and_then(|mut f| f.write_all(buf))
            .map_err(StoreError::io(format!("appending to {}", path.display())))
    }

    fn rewrite(&self) -> Result<()> {
        let Some(path) = &self.path else { return Ok(()) };
        let mut buf = Vec::new();
        for (id, secs) in self.map().iter() {
            buf.extend_from_slice(id.as_bytes());
            buf.extend_from_slice(&secs.to_le_bytes());
        }
        let tmp = path.with_extension("rewrite");
        std::fs::write(&tmp, &buf)
            .and_then(|()| std::fs::rename(&tmp, path))
            .map_err(StoreError::io(format!("rewriting {}", path.display())))
    }
}

fn unix_secs(t: SystemTime) -> u64 {
    t.duration_since(SystemTime::UNIX_EPOCH).unwrap_or(Duration::ZERO).as_secs()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_survive_a_reopen_and_expire_by_time() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("known");
        let t = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        let (a, b) = (ChunkId::of(b"a"), ChunkId::of(b"b"));
        {
            let k = KnownChunks::open(Some(path.clone())).unwrap();
            k.record(&[(a, t), (b, t)]).unwrap();
            k.forget(&[b]).unwrap();
        }
        // A torn record at the end (a crash mid-append) is ignored.
        std::fs::OpenOptions::new().append(true).open(&path).unwrap().write_all(&[7; 13]).unwrap();
        let k = KnownChunks::open(Some(path)).unwrap();
        assert!(k.fresh_since(&a, t));
        assert!(!k.fresh_since(&a, t + Duration::from_secs(1)));
        assert!(!k.fresh_since(&b, SystemTime::UNIX_EPOCH));
        assert_eq!(k.len(), 1);
    }
}
