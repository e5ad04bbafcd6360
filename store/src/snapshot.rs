//! The content-addressed snapshot store on top of any [`ObjectStore`].
//!
//! **Put.** The stream is cut into content-defined chunks ([`Chunker`]) and each chunk is named by
//! its blake3 hash. A chunk is uploaded only if the store lacks it: first the local known-chunk
//! index, then a HEAD. At most `upload_concurrency` PUTs are in flight while the stream is still
//! being cut; the HEADs run ahead of them, on up to twice as many chunks. When every chunk is in, the manifest is written — the commit point. A failed
//! or dropped put leaves chunks but no manifest: nothing half-written is visible, and garbage
//! collection reclaims the orphans after the grace period.
//!
//! **Get.** The manifest, then the chunks, `download_concurrency` at a time but written to the
//! caller in order. Every chunk is checked against its name and size before a byte of it is
//! written: a mismatch is [`StoreError::Corrupt`] naming the chunk, never bad data.
//!
//! **GC and the reuse window.** Garbage collection deletes a chunk only if no manifest names it
//! and its `modified` time is older than `grace`. An upload may skip a chunk the store already
//! has only if that chunk was modified within `reuse_window` (at most half the grace); an older
//! one it touches first (renewing `modified`). So every chunk a new manifest relies on was young
//! when the upload checked it, and GC leaves it alone for at least `grace - reuse_window`: an
//! upload that finishes within that time is never left pointing at a collected chunk. GC lists the
//! chunks before the manifests and re-checks each candidate's age just before deleting it, so a
//! chunk written or touched during the run survives it.

use std::collections::{BTreeMap, HashSet};
use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use futures_util::{StreamExt, TryStreamExt};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::sync::Semaphore;
use tokio::task::{JoinHandle, JoinSet};

use crate::cache::ChunkCache;
use crate::chunk::{CHUNK_PREFIX, ChunkId, ChunkParams, Chunker};
use crate::known::KnownChunks;
use crate::manifest::{ChunkRef, FORMAT, MANIFEST_PREFIXES, Manifest, SnapshotName};
use crate::pieces::{Chunks, Pieces, ReadPieces};
use crate::{Key, ObjectStore, Result, StoreError};

/// The snapshot store's settings (the `[store.snapshots]` table of the node config).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SnapshotConfig {
    #[serde(default)]
    pub chunking: ChunkParams,
    /// Chunk PUTs in flight at once per snapshot (HEADs run ahead on up to twice as many).
    #[serde(default = "default_concurrency")]
    pub upload_concurrency: usize,
    /// Chunk downloads in flight at once per snapshot.
    #[serde(default = "default_concurrency")]
    pub download_concurrency: usize,
    /// Unreferenced chunks younger than this are never collected.
    #[serde(default = "default_grace_secs")]
    pub grace_secs: u64,
    /// An existing chunk modified longer ago than this is touched before a new manifest relies on
    /// it. At most half of `grace_secs`.
    #[serde(default = "default_reuse_window_secs")]
    pub reuse_window_secs: u64,
    /// Where the known-chunk index lives; in memory only when unset.
    #[serde(default)]
    pub known_index: Option<PathBuf>,
    /// The key manifests written here are signed with, and those read back are checked
    /// against ([`SnapshotStore::vouches_for`]); never in a config file.
    #[serde(skip)]
    pub manifest_key: Option<ManifestKey>,
}

/// A key that signs manifests: a fleet's, so every node of it vouches for the others'.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct ManifestKey(pub [u8; 32]);

impl std::fmt::Debug for ManifestKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ManifestKey(..)")
    }
}

fn default_concurrency() -> usize {
    8
}
fn default_grace_secs() -> u64 {
    24 * 3600
}
fn default_reuse_window_secs() -> u64 {
    6 * 3600
}

impl Default for SnapshotConfig {
    fn default() -> SnapshotConfig {
        SnapshotConfig {
            chunking: ChunkParams::default(),
            upload_concurrency: default_concurrency(),
            download_concurrency: default_concurrency(),
            grace_secs: default_grace_secs(),
            reuse_window_secs: default_reuse_window_secs(),
            known_index: None,
            manifest_key: None,
        }
    }
}

/// What a put did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PutReport {
    pub key: Key,
    /// Bytes in the snapshot stream.
    pub size: u64,
    pub chunks: usize,
    /// Distinct chunks (a stream may repeat one).
    pub unique_chunks: usize,
    pub uploaded_chunks: usize,
    /// Chunk bytes sent to the store (the manifest not included).
    pub uploaded_bytes: u64,
    /// Old chunks renewed instead of uploaded (see the module docs).
    pub touched_chunks: usize,
}

/// What a garbage collection run did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GcReport {
    pub manifests: usize,
    pub chunks: usize,
    pub referenced: usize,
    /// Unreferenced but younger than the grace period.
    pub young: usize,
    pub deleted: usize,
    pub deleted_bytes: u64,
}

#[derive(Debug)]
struct Inner {
    store: Arc<dyn ObjectStore>,
    chunker: Chunker,
    known: KnownChunks,
    cache: Option<ChunkCache>,
    upload_concurrency: usize,
    download_concurrency: usize,
    grace: Duration,
    reuse_window: Duration,
    manifest_key: Option<ManifestKey>,
}

/// See the module docs. Cheap to clone.
#[derive(Clone, Debug)]
pub struct SnapshotStore {
    inner: Arc<Inner>,
}

enum Upload {
    /// The store had it, fresh; `modified` is its time there.
    Present(SystemTime),
    Touched,
    Uploaded(u64),
}

impl SnapshotStore {
    /// A snapshot store over `store`, reading chunks through `cache` when given.
    pub fn new(
        store: Arc<dyn ObjectStore>,
        cfg: SnapshotConfig,
        cache: Option<ChunkCache>,
    ) -> Result<SnapshotStore> {
        let bad = |m: &str| Err(StoreError::InvalidConfig(format!("snapshots: {m}")));
        if cfg.upload_concurrency == 0 || cfg.download_concurrency == 0 {
            return bad("concurrency must be at least 1");
        }
        if cfg.reuse_window_secs.saturating_mul(2) > cfg.grace_secs {
            return bad("reuse_window_secs must be at most half of grace_secs");
        }
        Ok(SnapshotStore {
            inner: Arc::new(Inner {
                store,
                chunker: Chunker::new(cfg.chunking)?,
                known: KnownChunks::open(cfg.known_index)?,
                cache,
                upload_concurrency: cfg.upload_concurrency,
                download_concurrency: cfg.download_concurrency,
                grace: Duration::from_secs(cfg.grace_secs),
                reuse_window: Duration::from_secs(cfg.reuse_window_secs),
                manifest_key: cfg.manifest_key,
            }),
        })
    }

    pub fn object_store(&self) -> &Arc<dyn ObjectStore> {
        &self.inner.store
    }

    pub fn cache(&self) -> Option<&ChunkCache> {
        self.inner.cache.as_ref()
    }

    /// [`SnapshotStore::put_at`] at the current time.
    pub async fn put(
        &self,
        name: &SnapshotName,
        stream: impl AsyncRead + Unpin + Send,
        meta: BTreeMap<String, String>,
    ) -> Result<PutReport> {
        self.put_at(name, stream, meta, SystemTime::now()).await
    }

    /// [`Self::put`] of a stream handed over in pieces, cut where they lie: a chunk inside one
    /// piece is stored without a copy (see [`Pieces`]).
    pub async fn put_pieces(
        &self,
        name: &SnapshotName,
        pieces: impl Pieces,
        meta: BTreeMap<String, String>,
    ) -> Result<PutReport> {
        self.put_pieces_at(name, pieces, meta, SystemTime::now()).await
    }

    /// Stores `stream` as snapshot `name` (replacing a manifest of that name), judging chunk ages
    /// against `now`. See the module docs.
    pub async fn put_at(
        &self,
        name: &SnapshotName,
        stream: impl AsyncRead + Unpin + Send,
        meta: BTreeMap<String, String>,
        now: SystemTime,
    ) -> Result<PutReport> {
        // Read a few chunks' worth at a time: a chunk that spans two reads is copied again.
        let fill = 4 * self.inner.chunker.params().max as usize;
        self.put_pieces_at(name, ReadPieces::new(stream, fill), meta, now).await
    }

    async fn put_pieces_at(
        &self,
        name: &SnapshotName,
        pieces: impl Pieces,
        meta: BTreeMap<String, String>,
        now: SystemTime,
    ) -> Result<PutReport> {
        let inner = &self.inner;
        let fresh_since = now.checked_sub(inner.reuse_window).unwrap_or(SystemTime::UNIX_EPOCH);

        let mut stream = Chunks::new(pieces);
        // Each chunk's size in order; its id comes back from the task that hashed it.
        let mut sizes = Vec::new();
        let mut ids: Vec<Option<ChunkId>> = Vec::new();
        let seen = Arc::new(std::sync::Mutex::new(HashSet::new()));
        let mut known = Vec::new();
        let mut report = PutReport {
            key: name.key(),
            size: 0,
            chunks: 0,
            unique_chunks: 0,
            uploaded_chunks: 0,
            uploaded_bytes: 0,
            touched_chunks: 0,
        };
        // Dropping the set (an error here, or the caller dropping this future) aborts uploads.
        let mut uploads: JoinSet<Result<(usize, ChunkId, Option<Upload>)>> = JoinSet::new();
        // A chunk's HEAD runs ahead of the PUTs: twice as many chunks are in hand as PUTs may be
        // in flight, so a PUT slot is never idle while its next chunk waits on a HEAD.
        let puts = Arc::new(Semaphore::new(inner.upload_concurrency));
        while let Some(data) = stream
            .next(&inner.chunker)
            .await
            .map_err(StoreError::io("reading the snapshot stream"))?
        {
            let len = data.len();
            let at = sizes.len();
            sizes.push(len as u32);
            ids.push(None);
            report.size += len as u64;
            while uploads.len() >= 2 * inner.upload_concurrency {
                let finished = joined(uploads.join_next().await)?;
                record(&mut report, &mut ids, &mut known, finished, now);
            }
            // Hashed in the task, not here: cutting the next chunk (this loop) and hashing this
            // one then run on two cores (each is a large part of a put's CPU: `silkbench store`).
            let (task, puts, seen) = (self.clone(), puts.clone(), seen.clone());
            uploads.spawn(async move {
                let id = ChunkId::of(&data);
                let first = seen.lock().unwrap_or_else(|e| e.into_inner()).insert(id);
                if !first || task.inner.known.fresh_since(&id, fresh_since) {
                    return Ok((at, id, None));
                }
                task.upload(id, data, fresh_since, &puts).await.map(|u| (at, id, Some(u)))
            });
        }
        while let Some(finished) = uploads.join_next().await {
            record(&mut report, &mut ids, &mut known, joined(Some(finished))?, now);
        }
        let chunks: Vec<ChunkRef> = sizes
            .into_iter()
            .zip(ids)
            .map(|(size, id)| ChunkRef { id: id.expect("every chunk's task came back"), size })
            .collect();
        report.chunks = chunks.len();
        report.unique_chunks = seen.lock().unwrap_or_else(|e| e.into_inner()).len();
        inner.known.record(&known)?;

        let mut manifest = Manifest {
            mac: None,
            format: FORMAT,
            name: name.to_string(),
            size: report.size,
            created_ms: now.duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default().as_millis()
                as u64,
            chunking: inner.chunker.params(),
            meta,
            chunks,
        };
        if let Some(key) = &inner.manifest_key {
            manifest.mac = Some(manifest.mac_under(&key.0).to_hex().to_string());
        }
        inner.store.put_bytes(&name.key(), manifest.to_json().into()).await?;
        Ok(report)
    }

    /// Makes sure one chunk is in the store and fresh enough to rely on; a PUT takes one of
    /// `puts`.
    async fn upload(
        &self,
        id: ChunkId,
        data: Bytes,
        fresh_since: SystemTime,
        puts: &Semaphore,
    ) -> Result<Upload> {
        let store = &self.inner.store;
        let key = id.key();
        match store.head(&key).await {
            Ok(meta) if meta.modified >= fresh_since => return Ok(Upload::Present(meta.modified)),
            Ok(_) => match store.touch(&key).await {
                Ok(()) => return Ok(Upload::Touched),
                // Collected between the HEAD and the touch: upload it after all.
                Err(StoreError::NotFound { .. }) => {}
                Err(e) => return Err(e),
            },
            Err(StoreError::NotFound { .. }) => {}
            Err(e) => return Err(e),
        }
        let _slot = puts.acquire().await.expect("the semaphore is never closed");
        let n = store.put_bytes(&key, data).await?;
        Ok(Upload::Uploaded(n))
    }

    /// Whether this store signs the manifests it writes (it has a manifest key): then it
    /// vouches for what it reads back ([`Self::vouches_for`]).
    pub fn signs(&self) -> bool {
        self.inner.manifest_key.is_some()
    }

    /// Whether `manifest` was signed with this store's manifest key: then every byte its
    /// chunks give (each checked against its id as it is read) is what a node holding the key
    /// stored, whatever else wrote to the store. A manifest without a signature, with another
    /// key's, or changed since it was signed is not vouched for.
    pub fn vouches_for(&self, manifest: &Manifest) -> bool {
        let (Some(key), Some(mac)) = (&self.inner.manifest_key, &manifest.mac) else {
            return false;
        };
        // `Hash` compares in constant time.
        blake3::Hash::from_hex(mac).is_ok_and(|mac| mac == manifest.mac_under(&key.0))
    }

    /// The snapshot's manifest, or `NotFound`.
    pub async fn manifest(&self, name: &SnapshotName) -> Result<Manifest> {
        let key = name.key();
        let bytes = self.inner.store.get_bytes(&key).await?;
        Manifest::parse(&key, &bytes)
    }

    /// Writes snapshot `name` to `out`, verified chunk by chunk; returns its manifest.
    pub async fn get(
        &self,
        name: &SnapshotName,
        out: &mut (dyn AsyncWrite + Unpin + Send),
    ) -> Result<Manifest> {
        let manifest = self.manifest(name).await?;
        self.get_chunks(&manifest, out).await?;
        Ok(manifest)
    }

    /// Writes the bytes of the snapshot `manifest` describes to `out` (what [`Self::get`] does
    /// once it has the manifest).
    pub async fn get_chunks(
        &self,
        manifest: &Manifest,
        out: &mut (dyn AsyncWrite + Unpin + Send),
    ) -> Result<()> {
        let mut chunks = self.chunks(manifest);
        while let Some(data) = chunks.next().await {
            out.write_all(&data?).await.map_err(StoreError::io("writing the snapshot"))?;
        }
        out.flush().await.map_err(StoreError::io("writing the snapshot"))?;
        Ok(())
    }

    /// The chunks of the snapshot `manifest` describes, in order, each checked against its id
    /// and size before it is given; `download_concurrency` of them fetched at once. For a
    /// caller that takes the bytes as they are rather than have them written
    /// ([`Self::get_chunks`]).
    pub fn chunks(
        &self,
        manifest: &Manifest,
    ) -> impl futures_util::Stream<Item = Result<Bytes>> + Send + 'static {
        let inner = self.inner.clone();
        futures_util::stream::iter(manifest.chunks.clone())
            .map(move |chunk| {
                let inner = inner.clone();
                // Spawned so hashing runs beside the downloads; aborted if the stream is dropped.
                AbortOnDrop(tokio::spawn(async move { inner.fetch(chunk).await }))
            })
            .buffered(self.inner.download_concurrency)
    }

    /// Removes the snapshot's manifest. Its chunks go at the next GC past the grace period.
    pub async fn delete(&self, name: &SnapshotName) -> Result<()> {
        self.inner.store.delete(&[name.key()]).await
    }

    /// Every snapshot whose key starts with `prefix` (e.g. `checkpoints/`, `goldens/pool-1/`).
    pub async fn list(&self, prefix: &str) -> Result<Vec<SnapshotName>> {
        let objects = self.inner.store.list_all(prefix).await?;
        Ok(objects.iter().filter_map(|o| SnapshotName::from_key(&o.key).ok()).collect())
    }

    /// Deletes chunks no manifest names that are older than the grace period at `now`. See the
    /// module docs for why this is safe beside running uploads.
    pub async fn gc(&self, now: SystemTime) -> Result<GcReport> {
        let inner = &self.inner;
        let store = &inner.store;
        let cutoff = now.checked_sub(inner.grace).unwrap_or(SystemTime::UNIX_EPOCH);
        // Chunks first: whatever is written after this listing is not a candidate at all.
        let chunks = store.list_all(CHUNK_PREFIX).await?;
        let mut report = GcReport { chunks: chunks.len(), ..GcReport::default() };

        let mut manifest_keys = Vec::new();
        for prefix in MANIFEST_PREFIXES {
            manifest_keys.extend(store.list_all(prefix).await?.into_iter().map(|o| o.key));
        }
        let mut referenced = HashSet::new();
        let mut reads = futures_util::stream::iter(manifest_keys)
            .map(|key| async move {
                match store.get_bytes(&key).await {
                    Ok(bytes) => Manifest::parse(&key, &bytes).map(Some),
                    // Deleted since the listing: it protects nothing any more.
                    Err(StoreError::NotFound { .. }) => Ok(None),
                    Err(e) => Err(e),
                }
            })
            .buffer_unordered(inner.download_concurrency);
        // Any manifest we cannot read stops the run: deleting on partial knowledge loses data.
        while let Some(manifest) = reads.try_next().await? {
            if let Some(m) = manifest {
                report.manifests += 1;
                referenced.extend(m.chunks.iter().map(|c| c.id));
            }
        }

        let mut candidates = Vec::new();
        for object in chunks {
            // Keys under chunks/ that are not chunk names are not ours to delete.
            let Some(id) = ChunkId::from_key(&object.key) else { continue };
            if referenced.contains(&id) {
                report.referenced += 1;
            } else if object.modified > cutoff {
                report.young += 1;
            } else {
                candidates.push(object.key);
            }
        }
        // Re-check each candidate's age right before deleting it: an upload may have touched it
        // since the listing.
        let mut doomed = Vec::new();
        let mut checks = futures_util::stream::iter(candidates)
            .map(|key| async move {
                match store.head(&key).await {
                    Ok(meta) => Ok(Some(meta)),
                    Err(StoreError::NotFound { .. }) => Ok(None),
                    Err(e) => Err(e),
                }
            })
            .buffer_unordered(inner.download_concurrency);
        while let Some(meta) = checks.try_next().await? {
            match meta {
                Some(meta) if meta.modified <= cutoff => doomed.push(meta),
                Some(_) => report.young += 1,
                None => {}
            }
        }
        for batch in doomed.chunks(1000) {
            let keys: Vec<Key> = batch.iter().map(|m| m.key.clone()).collect();
            store.delete(&keys).await?;
            let ids: Vec<ChunkId> = keys.iter().filter_map(ChunkId::from_key).collect();
            inner.known.forget(&ids)?;
            report.deleted += batch.len();
            report.deleted_bytes += batch.iter().map(|m| m.size).sum::<u64>();
        }
        Ok(report)
    }
}

impl Inner {
    /// One chunk's verified bytes, through the cache when there is one.
    async fn fetch(&self, chunk: ChunkRef) -> Result<Bytes> {
        match &self.cache {
            Some(cache) => cache.get_or_fetch(chunk, || self.download(chunk)).await,
            None => self.download(chunk).await,
        }
    }

    async fn download(&self, chunk: ChunkRef) -> Result<Bytes> {
        let data = match self.store.get_bytes(&chunk.id.key()).await {
            Ok(data) => data,
            Err(StoreError::NotFound { .. }) => {
                return Err(StoreError::Corrupt {
                    chunk: chunk.id,
                    reason: "missing from the store".into(),
                });
            }
            Err(e) => return Err(e),
        };
        if data.len() != chunk.size as usize {
            return Err(StoreError::Corrupt {
                chunk: chunk.id,
                reason: format!("{} bytes, the manifest says {}", data.len(), chunk.size),
            });
        }
        let actual = ChunkId::of(&data);
        if actual != chunk.id {
            return Err(StoreError::Corrupt {
                chunk: chunk.id,
                reason: format!("its bytes hash to {actual}"),
            });
        }
        Ok(data)
    }
}

/// What the task of the chunk at `at` found: its id, and what it did (nothing for a chunk met
/// before in this snapshot or known fresh).
fn record(
    report: &mut PutReport,
    ids: &mut [Option<ChunkId>],
    known: &mut Vec<(ChunkId, SystemTime)>,
    (at, id, upload): (usize, ChunkId, Option<Upload>),
    now: SystemTime,
) {
    ids[at] = Some(id);
    let Some(upload) = upload else { return };
    match upload {
        Upload::Present(modified) => known.push((id, modified)),
        Upload::Touched => {
            report.touched_chunks += 1;
            known.push((id, now));
        }
        Upload::Uploaded(n) => {
            report.uploaded_chunks += 1;
            report.uploaded_bytes += n;
            known.push((id, now));
        }
    }
}

fn joined<T>(done: Option<std::result::Result<Result<T>, tokio::task::JoinError>>) -> Result<T> {
    match done {
        Some(Ok(result)) => result,
        Some(Err(e)) => Err(task_failed(e)),
        // Only called while the set is non-empty.
        None => Err(StoreError::Io {
            context: "waiting for chunk uploads".into(),
            source: std::io::Error::other("no upload task to wait for"),
        }),
    }
}

fn task_failed(e: tokio::task::JoinError) -> StoreError {
    StoreError::Io { context: "a chunk task".into(), source: std::io::Error::other(e.to_string()) }
}

/// A spawned task that is aborted when its handle is dropped (a dropped `get`).
struct AbortOnDrop<T>(JoinHandle<Result<T>>);

impl<T> Future for AbortOnDrop<T> {
    type Output = Result<T>;
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<T>> {
        Pin::new(&mut self.0).poll(cx).map(|done| done.unwrap_or_else(|e| Err(task_failed(e))))
    }
}

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}
