//! The machine-readable error codes every error answer carries.

use serde::{Deserialize, Serialize};

/// What went wrong, as clients branch on it: `{"error": {"code": "...", "message": "..."}}`.
/// The wire form is [`Code::as_str`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
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
    /// A tenant's limit is reached (the message names it).
    QuotaExceeded,
    /// This client asked too often; try again in a moment.
    RateLimited,
    Draining,
    InsufficientStorage,
    PayloadTooLarge,
    UnsupportedMediaType,
    UpgradeRequired,
    /// The sandbox is moving, or lives on another node now: try again.
    Moving,
    AgentUnavailable,
    PeerUnavailable,
    /// The ports route: nothing inside the sandbox accepted the connection on that port.
    PortClosed,
    /// A claim's egress policy allows more than its pool's (only root may widen it).
    EgressWider,
    /// The target of a move refused the sandbox with a code this node does not know (a known
    /// one is passed on as it is).
    MoveRefused,
    SandboxNotReady,
    BadTemplate,
    /// A request that matches the API's document but breaks a rule the document states only in
    /// words (an egress rule that is no name or network, `warm_max` below `warm`, a pool of an
    /// unknown template): the message names the rule. `bad_request` is a request the document
    /// itself refuses.
    Invalid,
    WarmupFailed,
    Unsupported,
    /// A command the sandbox's agent refused (the status follows its kind).
    ExecFailed,
    EngineFailed,
    /// `"memory": "required"` and the sandbox's processes could not be checkpointed (the
    /// message says why); nothing changed.
    MemorySnapshotFailed,
    StoreUnavailable,
    StoreCorrupt,
    StoreRefused,
    StoreFailed,
    /// Templates pulled from registries: the image, or a tag's platform image, does not exist.
    ImageNotFound,
    /// The image exists, but not for linux/amd64.
    ImagePlatform,
    /// The registry refused the node's credentials (or asked for some it has none of).
    RegistryDenied,
    /// The registry cannot be reached, or failed (5xx).
    RegistryUnavailable,
    /// A blob's bytes did not match its digest (a corrupt registry or store copy); nothing was
    /// used.
    ImageDigestMismatch,
    /// The image's layers are over the node's cap, compressed or unpacked.
    ImageTooLarge,
    /// A layer writes outside the image's root (`..`): refused, nothing used.
    ImageUnsafe,
    /// A manifest or layer this node cannot use (a media type, a malformed document).
    ImageUnsupported,
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
            QuotaExceeded => "quota_exceeded",
            RateLimited => "rate_limited",
            Draining => "draining",
            InsufficientStorage => "insufficient_storage",
            PayloadTooLarge => "payload_too_large",
            UnsupportedMediaType => "unsupported_media_type",
            UpgradeRequired => "upgrade_required",
            Moving => "moving",
            AgentUnavailable => "agent_unavailable",
            PeerUnavailable => "peer_unavailable",
            PortClosed => "port_closed",
            EgressWider => "egress_wider",
            MoveRefused => "move_refused",
            SandboxNotReady => "sandbox_not_ready",
            BadTemplate => "bad_template",
            Invalid => "invalid",
            WarmupFailed => "warmup_failed",
            Unsupported => "unsupported",
            ExecFailed => "exec_failed",
            EngineFailed => "engine_failed",
            MemorySnapshotFailed => "memory_snapshot_failed",
            StoreUnavailable => "store_unavailable",
            StoreCorrupt => "store_corrupt",
            StoreRefused => "store_refused",
            StoreFailed => "store_failed",
            ImageNotFound => "image_not_found",
            ImagePlatform => "image_platform",
            RegistryDenied => "registry_denied",
            RegistryUnavailable => "registry_unavailable",
            ImageDigestMismatch => "image_digest_mismatch",
            ImageTooLarge => "image_too_large",
            ImageUnsafe => "image_unsafe",
            ImageUnsupported => "image_unsupported",
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_wire_form_is_the_serde_form() {
        use Code::*;
        for code in [
            BadRequest,
            Unauthorized,
            NotFound,
            TemplateNotFound,
            PeerNotFound,
            NoRoute,
            MethodNotAllowed,
            Conflict,
            BaseUnavailable,
            NodeFull,
            QuotaExceeded,
            RateLimited,
            Draining,
            InsufficientStorage,
            PayloadTooLarge,
            UnsupportedMediaType,
            UpgradeRequired,
            Moving,
            AgentUnavailable,
            PeerUnavailable,
            PortClosed,
            EgressWider,
            MoveRefused,
            SandboxNotReady,
            BadTemplate,
            Invalid,
            WarmupFailed,
            Unsupported,
            ExecFailed,
            EngineFailed,
            MemorySnapshotFailed,
            StoreUnavailable,
            StoreCorrupt,
            StoreRefused,
            StoreFailed,
            ImageNotFound,
            ImagePlatform,
            RegistryDenied,
            RegistryUnavailable,
            ImageDigestMismatch,
            ImageTooLarge,
            ImageUnsafe,
            ImageUnsupported,
            Internal,
        ] {
            assert_eq!(serde_json::to_value(code).unwrap(), code.as_str());
        }
    }
}
