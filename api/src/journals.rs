//! The audit journal's entries (`GET /v1/audit`).

use serde::{Deserialize, Serialize};

#[cfg(feature = "schema")]
use utoipa::ToSchema;

/// One call that changed something.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(ToSchema))]
pub struct AuditEntry {
    /// When it was answered, unix milliseconds.
    pub time_ms: u64,
    /// The node that served it.
    pub node: String,
    /// `root`, `tenant:<name>`, `sandbox:<id>` (that sandbox's own token), or `anonymous`.
    pub principal: String,
    /// The tenant whose call it was (a tenant's key, or a token of one of its sandboxes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    /// `claim`, `release`, `renew`, `exec`, `hibernate`, … (see docs/api.md).
    pub action: String,
    /// The sandbox, checkpoint, template or tenant acted on (a claim's: the new sandbox).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target: Option<String>,
    /// The HTTP status of the answer (`101` for a relay that opened).
    pub status: u16,
    /// An exec's program (`argv[0]`; the whole argv when the node sets `audit_exec_args`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
}

/// `GET /v1/audit`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(ToSchema))]
pub struct AuditList {
    pub entries: Vec<AuditEntry>,
}
