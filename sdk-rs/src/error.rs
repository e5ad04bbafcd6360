//! The SDK's one error type. Each variant says which side failed: the node's HTTP API
//! ([`Error::Api`]), silkd inside the sandbox ([`Error::Agent`]), the program the caller asked to
//! succeed ([`Error::NonZeroExit`]), or the path between them ([`Error::Transport`]).
//! [`Error::is_retryable`] tells whether trying again can help.

use bytes::Bytes;
use silk_proto::{ErrorKind, ProtoError, WireError};

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The node answered with an error body `{"error": {"code", "message"}}` (or a status
    /// without one, in which case `code` is `http_<status>`).
    #[error("node answered {status} {code}: {message}")]
    Api { status: u16, code: String, message: String },
    /// silkd ended the call with an `Error` frame.
    #[error("silkd: {kind:?}: {message}")]
    Agent { kind: ErrorKind, message: String },
    /// A call that asked for success (`run_checked`) ran a program that did not exit 0.
    #[error("exit code {code}{}", signal.map(|s| format!(" (signal {s})")).unwrap_or_default())]
    NonZeroExit { code: i32, signal: Option<i32>, stdout: Bytes, stderr: Bytes },
    /// The node redirected a request that was already a redirect's retry (at most one hop).
    #[error("redirected twice (second hop to {location}); at most one hop is followed")]
    TooManyRedirects { location: String },
    /// A connection, request or frame failed underway, or a timeout passed.
    #[error("transport: {message}")]
    Transport {
        message: String,
        #[source]
        source: Option<Box<dyn std::error::Error + Send + Sync>>,
    },
    /// The peer said something the protocol does not allow here (a bug on one side or a version
    /// mismatch).
    #[error("protocol: {0}")]
    Protocol(String),
    /// The caller passed something unusable (a bad URL, an empty argv).
    #[error("invalid argument: {0}")]
    Invalid(String),
    /// Reading or writing the local side of a push, pull or port forward failed.
    #[error("local i/o: {0}")]
    Local(#[source] std::io::Error),
}

impl Error {
    /// Whether the same call may succeed if tried again later: network trouble, a full or
    /// draining node, a dependency silkd could not reach.
    pub fn is_retryable(&self) -> bool {
        match self {
            Error::Transport { .. } => true,
            Error::Api { status, .. } => matches!(status, 429 | 502 | 503 | 504),
            Error::Agent { kind, .. } => *kind == ErrorKind::Unavailable,
            _ => false,
        }
    }

    /// The agent's error kind, when silkd failed the call.
    pub fn agent_kind(&self) -> Option<ErrorKind> {
        match self {
            Error::Agent { kind, .. } => Some(*kind),
            _ => None,
        }
    }

    pub(crate) fn transport(
        message: impl Into<String>,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> Error {
        Error::Transport { message: message.into(), source: Some(Box::new(source)) }
    }

    pub(crate) fn timeout(what: &str) -> Error {
        Error::Transport { message: format!("{what} timed out"), source: None }
    }

    pub(crate) fn closed() -> Error {
        Error::Transport { message: "silkd connection closed mid-call".into(), source: None }
    }

    pub(crate) fn unexpected(frame: &silk_proto::Frame, during: &str) -> Error {
        Error::Protocol(format!("unexpected {} frame during {during}", frame.name()))
    }
}

impl From<WireError> for Error {
    fn from(e: WireError) -> Error {
        Error::Agent { kind: e.kind, message: e.message }
    }
}

impl From<ProtoError> for Error {
    fn from(e: ProtoError) -> Error {
        Error::transport("silkd connection", e)
    }
}
