//! The store's one error enum.

use crate::chunk::ChunkId;

/// What went wrong, and (through the variant) whether retrying can help: only
/// [`StoreError::Unavailable`] is worth another try, and only later — the backend already retried
/// with backoff before giving up.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The object (or snapshot manifest) does not exist. Retrying does not help.
    #[error("{key} not found")]
    NotFound { key: String },
    /// The store could not be reached or kept failing (connection refused, timeouts, throttling,
    /// 5xx) for `attempts` tries. Retrying later may help.
    #[error("store unavailable: {op} {key} failed after {attempts} attempt(s): {reason}")]
    Unavailable { op: &'static str, key: String, attempts: u32, reason: String },
    /// A chunk's bytes do not hash to its name, or it is missing although a manifest lists it.
    /// The data is bad; retrying the same read does not help.
    #[error("chunk {chunk} is corrupt: {reason}")]
    Corrupt { chunk: ChunkId, reason: String },
    /// A manifest that cannot be parsed or does not add up.
    #[error("manifest {key} is corrupt: {reason}")]
    CorruptManifest { key: String, reason: String },
    /// A manifest written by a newer format than this build reads.
    #[error("manifest {key} has format version {found}; this build reads up to {supported}")]
    UnsupportedFormat { key: String, found: u32, supported: u32 },
    /// A key, name or id that is not allowed (empty, `..`, absolute, hidden, odd characters).
    #[error("invalid key {key:?}: {reason}")]
    InvalidKey { key: String, reason: &'static str },
    /// A byte range that is empty or starts at or past the end of the object.
    #[error("range {range} of {key} is empty or past its end ({size} bytes)")]
    InvalidRange { key: String, range: crate::ByteRange, size: u64 },
    #[error("invalid store config: {0}")]
    InvalidConfig(String),
    /// The backend refused the request (permissions, a bad request): retrying does not help.
    #[error("store refused {op} {key}: {reason}")]
    Refused { op: &'static str, key: String, reason: String },
    /// A local I/O error (the `fs` backend, the chunk cache, the known-chunk index, the caller's
    /// reader or writer).
    #[error("{context}: {source}")]
    Io { context: String, source: std::io::Error },
}

impl StoreError {
    /// Whether the same call may succeed later.
    pub fn is_retryable(&self) -> bool {
        matches!(self, StoreError::Unavailable { .. })
    }

    pub fn is_not_found(&self) -> bool {
        matches!(self, StoreError::NotFound { .. })
    }

    pub(crate) fn io(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> StoreError {
        let context = context.into();
        move |source| StoreError::Io { context, source }
    }
}
