//! The audit journal's entries (`GET /v1/audit`) and the usage journal's sums (`GET /v1/usage`).

use serde::{Deserialize, Serialize};

use crate::{Lane, Size};

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
    /// Nodes of the mesh that did not answer in time: their entries are missing here.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unreachable: Vec<String>,
}

/// Sandbox-seconds of one tenant (none: root's), size and lane in a usage report.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(ToSchema))]
pub struct UsageRow {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    pub size: Size,
    pub lane: Lane,
    pub sandbox_seconds: u64,
}

/// `GET /v1/usage`: sandbox-seconds metered in `[from_ms, to_ms)`, summed over the fleet (or
/// this node, with `scope=node`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(ToSchema))]
pub struct UsageReport {
    pub from_ms: u64,
    pub to_ms: u64,
    pub rows: Vec<UsageRow>,
    /// Logical bytes of the tenant's checkpoints and archives now: when one tenant was asked for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub store_bytes: Option<u64>,
    /// Nodes of the mesh that did not answer in time: their usage is missing here.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unreachable: Vec<String>,
}
