//! The node's one error: a machine-readable [`Code`] and a message. The controller and the
//! mesh layer speak only this; the HTTP layer maps each code to its status in one place
//! (`api::status`), and the body is `{"error": {"code": "...", "message": "..."}}`.

use silk_engine::EngineError;

pub use silk_api::Code;

#[derive(Debug, Clone, thiserror::Error)]
#[error("{code}: {message}")]
pub struct NodeError {
    pub code: Code,
    pub message: String,
    /// The HTTP status, where one code answers with more than one (an agent's refusal of a
    /// command, by its kind); `None`: the code's own.
    pub status: Option<u16>,
}

impl NodeError {
    pub fn new(code: Code, message: impl Into<String>) -> NodeError {
        NodeError { code, message: message.into(), status: None }
    }

    pub fn bad_request(message: impl Into<String>) -> NodeError {
        NodeError::new(Code::BadRequest, message)
    }

    /// Unknown sandboxes and wrong sandbox tokens look the same: no hint that an id exists.
    pub fn sandbox_not_found() -> NodeError {
        NodeError::new(Code::NotFound, "no such sandbox")
    }

    pub fn unauthorized() -> NodeError {
        NodeError::new(Code::Unauthorized, "a valid bearer token is required")
    }

    pub fn internal(message: impl Into<String>) -> NodeError {
        NodeError::new(Code::Internal, message)
    }

    /// The body every error answer carries.
    pub fn body(&self) -> silk_api::ErrorBody {
        let error = silk_api::ErrorDetail { code: self.code, message: self.message.clone() };
        silk_api::ErrorBody { error }
    }
}

impl From<EngineError> for NodeError {
    fn from(e: EngineError) -> NodeError {
        use EngineError::*;
        let code = match &e {
            TemplateNotFound(_) => Code::TemplateNotFound,
            BadTemplate(_) | Unsafe(_) => Code::BadTemplate,
            TooLarge(_) => Code::ImageTooLarge,
            DiskFull(_) => Code::InsufficientStorage,
            WarmupFailed(_) => Code::WarmupFailed,
            NotFound(_) => Code::NotFound,
            Exists(_) => Code::Conflict,
            Unsupported { .. } => Code::Unsupported,
            BadRequest(_) => Code::BadRequest,
            NotReady(_) => Code::SandboxNotReady,
            MemoryFailed(_) => Code::MemorySnapshotFailed,
            Host(_) | Io { .. } => Code::EngineFailed,
        };
        NodeError::new(code, e.to_string())
    }
}

impl From<silk_store::StoreError> for NodeError {
    fn from(e: silk_store::StoreError) -> NodeError {
        use silk_store::StoreError::*;
        let code = match &e {
            NotFound { .. } => Code::NotFound,
            Unavailable { .. } => Code::StoreUnavailable,
            Corrupt { .. } | CorruptManifest { .. } | UnsupportedFormat { .. } => {
                Code::StoreCorrupt
            }
            Refused { .. } => Code::StoreRefused,
            _ => Code::StoreFailed,
        };
        NodeError::new(code, e.to_string())
    }
}
