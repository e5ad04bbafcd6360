//! The node's HTTP API shapes, one definition for the node that answers and the SDK that calls:
//! request bodies, answer bodies, the enums they carry, and the machine-readable error [`Code`].
//! With the `schema` feature every type also derives its OpenAPI schema (utoipa), from which the
//! node's `/v1/openapi.json` is made: the document cannot drift from what is served.
//!
//! Bounds the node enforces are stated on the fields ([`MAX_FORK`], the metadata limits); the
//! lease cap is the node's own setting and is filled into its document at run time.

mod bodies;
mod code;
mod journals;
mod tenants;

pub use bodies::*;
pub use code::Code;
pub use journals::*;
pub use tenants::*;

use serde::{Deserialize, Serialize};

/// The OpenAPI schemas of every body, by type name (`components.schemas` of the node's
/// document).
#[cfg(feature = "schema")]
pub fn schemas() -> serde_json::Value {
    use utoipa::OpenApi;
    #[derive(OpenApi)]
    #[openapi(components(schemas(
        ClaimRequest,
        RenewRequest,
        ExecRequest,
        CheckpointRequest,
        StopRequest,
        BranchRequest,
        ForkRequest,
        EgressPolicy,
        PreviewRequest,
        Preview,
        PromoteRequest,
        RegisterTemplate,
        MoveRequest,
        PoolConfig,
        Pools,
        Sandbox,
        SandboxList,
        FleetView,
        Renewed,
        ExecResult,
        Checkpoint,
        CheckpointList,
        Template,
        TemplateKind,
        PullStatus,
        TemplateList,
        NodeInfo,
        PoolStatus,
        MeshInfo,
        MeshView,
        PeerRow,
        ErrorBody,
        ErrorDetail,
        Code,
        Size,
        Lane,
        Tier,
        OnExpire,
        SandboxState,
        TenantLimits,
        TenantRequest,
        TenantPatch,
        TenantKey,
        TenantUsage,
        Tenant,
        TenantList,
        AuditEntry,
        AuditList,
        UsageRow,
        UsageReport
    )))]
    struct Document;
    let doc = serde_json::to_value(Document::openapi()).expect("a document serializes");
    doc["components"]["schemas"].clone()
}

/// At most this many children per fork.
pub const MAX_FORK: usize = 16;
pub const MAX_METADATA_PAIRS: usize = 16;
pub const MAX_METADATA_KEY: usize = 128;
pub const MAX_METADATA_VALUE: usize = 512;

/// Size tiers: cpu, memory and process limits per the node's engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum Size {
    Small,
    Medium,
    Large,
}

impl std::str::FromStr for Size {
    type Err = String;

    fn from_str(s: &str) -> Result<Size, String> {
        match s {
            "small" => Ok(Size::Small),
            "medium" => Ok(Size::Medium),
            "large" => Ok(Size::Large),
            other => Err(format!("size {other:?}: small, medium or large")),
        }
    }
}

/// Network lanes. `none`: a network namespace with only loopback.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum Lane {
    None,
    Egress,
}

impl std::str::FromStr for Lane {
    type Err = String;

    fn from_str(s: &str) -> Result<Lane, String> {
        match s {
            "none" => Ok(Lane::None),
            "egress" => Ok(Lane::Egress),
            other => Err(format!("lane {other:?}: none or egress")),
        }
    }
}

/// Whether an operation that stops or copies a sandbox keeps its processes' memory: `auto`
/// (where the engine can, else files only, saying why), `required` (fail with
/// `409 memory_snapshot_failed` instead, changing nothing) or `off` (files only: processes
/// restart).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum Memory {
    #[default]
    Auto,
    Required,
    Off,
}

/// How a claim was served: an already running sandbox, a clone of the template's golden, or a
/// cold boot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum Tier {
    Warm,
    Clone,
    Cold,
    /// A tier this build does not know (a newer node's): clients keep working.
    #[serde(other)]
    Other,
}

impl Tier {
    /// The tiers a node serves claims in.
    pub const ALL: [Tier; 3] = [Tier::Warm, Tier::Clone, Tier::Cold];
}

/// What happens when a lease ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum OnExpire {
    #[default]
    Destroy,
    Archive,
    /// Hibernated (memory kept as the pool's `memory` says); woken by any call, with a new lease.
    Hibernate,
}

/// Where a sandbox is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum SandboxState {
    /// Ready in a pool, owned by nobody.
    Warm,
    /// Owned by a client under a lease, running.
    Claimed,
    /// Stopped with its files kept on its node.
    Hibernated,
    /// Stopped with its files in the object store.
    Archived,
    /// Gone. Terminal.
    Released,
}

#[cfg(all(test, feature = "schema"))]
mod tests {
    #[test]
    fn every_schema_is_made_and_optional_answer_fields_are_not_required() {
        let s = super::schemas();
        let sandbox = &s["Sandbox"];
        let required: Vec<&str> =
            sandbox["required"].as_array().unwrap().iter().filter_map(|v| v.as_str()).collect();
        assert!(required.contains(&"id") && required.contains(&"memory_snapshot"), "{sandbox}");
        assert!(!required.contains(&"token") && !required.contains(&"claim_micros"), "{sandbox}");
        assert!(s["ForkRequest"]["properties"]["count"]["maximum"].as_f64() == Some(16.0), "{s}");
    }
}

/// The wire name (`small`, `warm`, `hibernated`, …), for tables and messages.
macro_rules! display_as_wire_name {
    ($($t:ty),*) => {$(
        impl std::fmt::Display for $t {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                match serde_json::to_value(self) {
                    Ok(serde_json::Value::String(name)) => f.write_str(&name),
                    _ => write!(f, "{self:?}"),
                }
            }
        }
    )*};
}

display_as_wire_name!(Size, Lane, Tier, OnExpire, SandboxState, TemplateKind, PullStatus);
