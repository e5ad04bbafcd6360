//! Object stores and the content-addressed snapshot store on top of them.
//!
//! Goldens, checkpoints and archives leave a node as snapshot streams (a tar of a sandbox's files
//! plus metadata) and are shared between nodes through an object store. This crate has three
//! layers:
//!
//! - [`ObjectStore`]: put (streamed, multipart above a size), get (whole or a byte range,
//!   streamed), head, list by prefix (paginated), batch delete and touch. Backends: [`fs`] (a
//!   local directory, the single-node default) and [`s3`] (aws-sdk-s3: AWS, MinIO, Garage), plus
//!   [`fault`], a wrapper that injects failures and latency for tests. Every call can be
//!   cancelled by dropping its future.
//! - [`SnapshotStore`]: cuts a stream into content-defined chunks stored once each under
//!   `chunks/<blake3>`, uploads only what the store lacks, writes the manifest last (the commit
//!   point), downloads concurrently with every chunk verified, and collects unreferenced chunks
//!   after a grace period.
//! - [`ChunkCache`]: a node's bounded LRU cache of verified chunks that merges concurrent fetches.
//!
//! Errors are one enum, [`StoreError`]; [`StoreError::is_retryable`] says whether trying again
//! later can help. Time is an input where it matters ([`SnapshotStore::put_at`],
//! [`SnapshotStore::gc`]), so tests never sleep. `docs/store.md` is the operator's guide.

mod cache;
mod chunk;
mod error;
pub mod fault;
pub mod fs;
mod known;
mod lease;
mod manifest;
mod object;
mod pieces;
pub mod s3;
mod snapshot;

pub use cache::{CacheConfig, CacheStats, ChunkCache};
pub use chunk::{CHUNK_PREFIX, ChunkId, ChunkParams, Chunker};
pub use error::StoreError;
pub use lease::Lease;
pub use manifest::{ChunkRef, FORMAT, MANIFEST_PREFIXES, Manifest, SnapshotName};
pub use object::{
    ByteRange, ByteStream, GetObject, Key, ListPage, MAX_KEY_LEN, ObjectMeta, ObjectStore,
    stream_of,
};
pub use pieces::Pieces;
pub use snapshot::{GcReport, ManifestKey, PutReport, SnapshotConfig, SnapshotStore};

pub type Result<T, E = StoreError> = std::result::Result<T, E>;
