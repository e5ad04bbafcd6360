//! Tenants (root only): teams sharing a fleet, each with an API key and limits.

use serde::{Deserialize, Serialize};

#[cfg(feature = "schema")]
use utoipa::ToSchema;

/// A tenant's limits. Claims, forks and branches past `max_sandboxes` (live sandboxes across
/// the fleet) or `max_sandbox_seconds` (this calendar month, UTC, across the fleet), and
/// checkpoints past `max_checkpoints` or `max_store_bytes` (logical bytes of its checkpoints and
/// archives), are refused with `429 quota_exceeded`; running sandboxes keep running.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(ToSchema))]
#[serde(deny_unknown_fields)]
pub struct TenantLimits {
    pub max_sandboxes: u64,
    pub max_checkpoints: u64,
    pub max_store_bytes: u64,
    /// No limit when left out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_sandbox_seconds: Option<u64>,
}

/// `POST /v1/tenants`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(ToSchema))]
#[serde(deny_unknown_fields)]
pub struct TenantRequest {
    /// `[a-z0-9-]{1,63}`.
    #[cfg_attr(feature = "schema", schema(pattern = "^[a-z0-9-]{1,63}$"))]
    pub name: String,
    pub max_sandboxes: u64,
    pub max_checkpoints: u64,
    pub max_store_bytes: u64,
    /// No limit when left out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_sandbox_seconds: Option<u64>,
}

impl TenantRequest {
    pub fn limits(&self) -> TenantLimits {
        TenantLimits {
            max_sandboxes: self.max_sandboxes,
            max_checkpoints: self.max_checkpoints,
            max_store_bytes: self.max_store_bytes,
            max_sandbox_seconds: self.max_sandbox_seconds,
        }
    }
}

impl TenantPatch {
    /// `limits` with this patch applied.
    pub fn apply(&self, limits: TenantLimits) -> TenantLimits {
        TenantLimits {
            max_sandboxes: self.max_sandboxes.unwrap_or(limits.max_sandboxes),
            max_checkpoints: self.max_checkpoints.unwrap_or(limits.max_checkpoints),
            max_store_bytes: self.max_store_bytes.unwrap_or(limits.max_store_bytes),
            max_sandbox_seconds: match self.max_sandbox_seconds {
                None => limits.max_sandbox_seconds,
                Some(0) => None,
                Some(n) => Some(n),
            },
        }
    }
}

/// `PATCH /v1/tenants/{name}`: the limits to change; the others stay.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(ToSchema))]
#[serde(deny_unknown_fields)]
pub struct TenantPatch {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_sandboxes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_checkpoints: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_store_bytes: Option<u64>,
    /// `0` removes the limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_sandbox_seconds: Option<u64>,
}

/// `201` of `POST /v1/tenants` and `POST /v1/tenants/{name}/rotate`: the key is shown this once
/// (the fleet keeps only its hash).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(ToSchema))]
pub struct TenantKey {
    pub name: String,
    /// `sk_…`: accepted wherever the root token is, for this tenant's own things.
    pub api_key: String,
}

/// What a tenant uses now.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(ToSchema))]
pub struct TenantUsage {
    /// Live sandboxes across the fleet (this node's, and its peers' as they last said).
    pub live_sandboxes: u64,
    pub checkpoints: u64,
    /// Logical bytes of its checkpoints and archives.
    pub store_bytes: u64,
    /// Sandbox-seconds this calendar month (UTC), across the fleet.
    pub sandbox_seconds: u64,
}

/// A tenant: `GET /v1/tenants/{name}`, `PATCH`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(ToSchema))]
pub struct Tenant {
    pub name: String,
    pub limits: TenantLimits,
    pub created_ms: u64,
    /// When its key was last made (creation or rotation).
    pub key_since_ms: u64,
    pub usage: TenantUsage,
}

/// `GET /v1/tenants`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(ToSchema))]
pub struct TenantList {
    pub tenants: Vec<Tenant>,
}

/// Whether `name` can be a tenant's name: `[a-z0-9-]{1,63}`.
pub fn valid_tenant_name(name: &str) -> bool {
    (1..=63).contains(&name.len())
        && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
}
