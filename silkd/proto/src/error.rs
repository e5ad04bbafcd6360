//! The closed set of error kinds a call can end with, and the codec's own errors.

use serde::{Deserialize, Serialize};

/// Why a call failed. The set is closed: clients match on it, and the node maps each kind to one
/// HTTP status. Append only (the postcard tag is the variant index).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ErrorKind {
    /// The request is malformed or makes no sense (empty argv, a directory given to `Read`).
    BadRequest,
    /// A path, pid, or session does not exist.
    NotFound,
    PermissionDenied,
    /// The target is in a state that forbids the call (exists already, not empty).
    Conflict,
    /// The agent does not serve this verb or version.
    Unsupported,
    /// A limit was reached (disk full, too many processes, frame too large).
    ResourceExhausted,
    /// A dependency is temporarily missing; retrying may help.
    Unavailable,
    /// A bug or an unexpected system failure.
    Internal,
}

/// Errors of the codec and of [`crate::Connection`].
#[derive(Debug, thiserror::Error)]
pub enum ProtoError {
    /// The length prefix exceeds [`crate::MAX_FRAME`]. The stream cannot be resynchronised.
    #[error("frame of {0} bytes exceeds the {max} byte limit", max = crate::MAX_FRAME)]
    TooLarge(usize),
    /// A complete frame whose body does not decode. The frame was consumed, so the stream is
    /// still aligned on the next frame and the connection remains usable.
    #[error("malformed frame: {0}")]
    Malformed(String),
    /// The peer closed the stream in the middle of a frame.
    #[error("connection closed mid-frame")]
    Truncated,
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
}

impl ProtoError {
    /// Whether the connection can carry further frames after this error.
    pub fn is_recoverable(&self) -> bool {
        matches!(self, ProtoError::Malformed(_))
    }
}
