//! The node's one error: a machine-readable [`Code`] and a message. The controller and the
//! mesh layer speak only this; the HTTP layer maps each code to its status in one place
//! (`api::status`), and the body is `{"error": {"code": "...", "message": "..."}}`.

use silk_engine::EngineError;

/// What went wrong, as clients branch on it. The wire form is [`Code::as_str`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Code {
    BadRequest,
    Unauthorized,
    /// No such sandbox, checkpoint or route; also a token that is not the sandbox's.
    NotFound,
    TemplateNotFound,
    PeerNotFound,
    NoRoute,
    MethodNotAllowed,
    Conflict,
    /// A move needs a base (golden) the target cannot get.
    BaseUnavailable,
    NodeFull,
    Draining,
    InsufficientStorage,
    PayloadTooLarge,
    UnsupportedMediaType,
    UpgradeRequired,
    /// The sandbox is moving, or lives on another node now: try again.
    Moving,
    AgentUnavailable,
    PeerUnavailable,
    /// The target of a move refused the sandbox (its answer's status is kept).
    MoveRefused,
    SandboxNotReady,
    BadTemplate,
    WarmupFailed,
    Unsupported,
    /// A command the sandbox's agent refused (the HTTP layer picks the status from its kind).
    ExecFailed,
    EngineFailed,
    StoreUnavailable,
    StoreCorrupt,
    StoreRefused,
    StoreFailed,
    Internal,
}

impl Code {
    pub fn as_str(self) -> &'static str {
        use Code::*;
        match self {
            BadRequest => "bad_request",
            Unauthorized => "unauthorized",
            NotFound => "not_found",
            TemplateNotFound => "template_not_found",
            PeerNotFound => "peer_not_found",
            NoRoute => "no_route",
            MethodNotAllowed => "method_not_allowed",
            Conflict => "conflict",
            BaseUnavailable => "base_unavailable",
            NodeFull => "node_full",
            Draining => "draining",
            InsufficientStorage => "insufficient_storage",
            PayloadTooLarge => "payload_too_large",
            UnsupportedMediaType => "unsupported_media_type",
            UpgradeRequired => "upgrade_required",
            Moving => "moving",
            AgentUnavailable => "agent_unavailable",
            PeerUnavailable => "peer_unavailable",
            MoveRefused => "move_refused",
            SandboxNotReady => "sandbox_not_ready",
            BadTemplate => "bad_template",
            WarmupFailed => "warmup_failed",
            Unsupported => "unsupported",
            ExecFailed => "exec_failed",
            EngineFailed => "engine_failed",
            StoreUnavailable => "store_unavailable",
            StoreCorrupt => "store_corrupt",
            StoreRefused => "store_refused",
            StoreFailed => "store_failed",
            Internal => "internal",
        }
    }
}

impl std::fmt::Display for Code {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl PartialEq<&str> for Code {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

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

    /// The JSON body every error answer carries.
    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({ "error": { "code": self.code.as_str(), "message": self.message } })
    }
}

impl From<EngineError> for NodeError {
    fn from(e: EngineError) -> NodeError {
        use EngineError::*;
        let code = match &e {
            TemplateNotFound(_) => Code::TemplateNotFound,
            BadTemplate(_) => Code::BadTemplate,
            WarmupFailed(_) => Code::WarmupFailed,
            NotFound(_) => Code::NotFound,
            Exists(_) => Code::Conflict,
            Unsupported { .. } => Code::Unsupported,
            BadRequest(_) => Code::BadRequest,
            NotReady(_) => Code::SandboxNotReady,
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
