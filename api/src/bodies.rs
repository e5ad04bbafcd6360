//! Request and answer bodies, by route (see the node's `/v1/openapi.json` for which is which).
//! Requests refuse unknown fields; optional answer fields that only some answers carry are
//! left out rather than `null`.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::{Code, Lane, Memory, OnExpire, SandboxState, Size, Tier};

#[cfg(feature = "schema")]
use utoipa::ToSchema;

// ---- requests ----

/// `POST /v1/sandboxes`: every field may be left out.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(ToSchema))]
#[serde(deny_unknown_fields)]
pub struct ClaimRequest {
    /// `host` when left out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "schema", schema(min_length = 1, max_length = 128))]
    pub template: Option<String>,
    /// `small` when left out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size: Option<Size>,
    /// `none` when left out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lane: Option<Lane>,
    /// The lease; 0 or left out: the node's default. At most the node's cap.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_seconds: Option<u64>,
    /// At most 16 pairs; keys 1–128 characters, values up to 512.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub metadata: BTreeMap<String, String>,
    #[serde(default)]
    pub on_expire: OnExpire,
    /// Lane `egress`: what the sandbox may reach. It can only narrow its pool's policy (root
    /// may widen it); left out: the pool's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub egress: Option<EgressPolicy>,
}

/// What a sandbox in lane `egress` may reach: names it may resolve and connect to, and IPv4
/// networks it may connect to without a name. A name is allowed when an `allow` pattern
/// matches it and no `deny` pattern does. Patterns: `example.com` (that name), `*.example.com`
/// (any name under it, not itself), `*` (any name), `203.0.113.0/24` (those addresses).
/// Whatever a policy says, the node's guard refuses link-local, loopback, private ranges the
/// operator did not open, other sandboxes and the node's own addresses.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(ToSchema))]
#[serde(deny_unknown_fields)]
pub struct EgressPolicy {
    #[serde(default)]
    pub allow: Vec<String>,
    #[serde(default)]
    pub deny: Vec<String>,
}

/// `POST /v1/sandboxes/{id}/previews`: a URL a browser opens without the sandbox token.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(ToSchema))]
#[serde(deny_unknown_fields)]
pub struct PreviewRequest {
    #[cfg_attr(feature = "schema", schema(minimum = 1, maximum = 65535))]
    pub port: u16,
    /// How long the URL works; left out: an hour. At most a day.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "schema", schema(minimum = 1, maximum = 86400))]
    pub ttl_seconds: Option<u64>,
}

/// `POST /v1/sandboxes/{id}/renew`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(ToSchema))]
#[serde(deny_unknown_fields)]
pub struct RenewRequest {
    /// The new lease from now; 0 or left out: the node's default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_seconds: Option<u64>,
}

/// `POST /v1/sandboxes/{id}/exec`: a command run to its end, its output buffered.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(ToSchema))]
#[serde(deny_unknown_fields)]
pub struct ExecRequest {
    #[cfg_attr(feature = "schema", schema(min_items = 1))]
    pub argv: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    /// Text given to the process on stdin.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stdin: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_seconds: Option<u64>,
}

/// `POST /v1/sandboxes/{id}/checkpoint`; the body may be left out.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(ToSchema))]
#[serde(deny_unknown_fields)]
pub struct CheckpointRequest {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "schema", schema(min_length = 1, max_length = 128))]
    pub name: Option<String>,
    /// Keep the processes' memory in the checkpoint (the sandbox is frozen meanwhile, and its
    /// connections to silkd are closed).
    #[serde(default)]
    pub memory: Memory,
}

/// `POST /v1/sandboxes/{id}/hibernate` and `/archive`; the body may be left out.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(ToSchema))]
#[serde(deny_unknown_fields)]
pub struct StopRequest {
    /// Keep the processes' memory, so a wake continues them.
    #[serde(default)]
    pub memory: Memory,
}

/// `POST /v1/checkpoints/{id}/claim` (branch); the body may be left out.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(ToSchema))]
#[serde(deny_unknown_fields)]
pub struct BranchRequest {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_seconds: Option<u64>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub metadata: BTreeMap<String, String>,
    #[serde(default)]
    pub on_expire: OnExpire,
    /// Continue the checkpoint's processes (when it holds their memory).
    #[serde(default)]
    pub memory: Memory,
}

/// `POST /v1/sandboxes/{id}/fork`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(ToSchema))]
#[serde(deny_unknown_fields)]
pub struct ForkRequest {
    #[cfg_attr(feature = "schema", schema(minimum = 1, maximum = 16))]
    pub count: usize,
    /// The children's lease; the parent's length when left out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_seconds: Option<u64>,
    /// Each child continues the parent's processes from one memory image.
    #[serde(default)]
    pub memory: Memory,
}

/// `POST /v1/sandboxes/{id}/promote`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(ToSchema))]
#[serde(deny_unknown_fields)]
pub struct PromoteRequest {
    #[cfg_attr(feature = "schema", schema(pattern = "^[a-z0-9_-]{1,64}$"))]
    pub template: String,
}

/// `POST /v1/templates`: a template from a registry image, on every node of the fleet.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(ToSchema))]
#[serde(deny_unknown_fields)]
pub struct RegisterTemplate {
    /// A tenant's name is kept as `<tenant>/<name>`.
    #[cfg_attr(feature = "schema", schema(pattern = "^[a-z0-9_-]{1,64}$"))]
    pub name: String,
    /// An image reference: `python:3.12`, `ghcr.io/org/base:v4`, `host:port/repo@sha256:…`.
    #[cfg_attr(feature = "schema", schema(min_length = 1, max_length = 512))]
    pub image: String,
    /// Run once in a fresh sandbox before its golden is frozen.
    #[serde(default)]
    pub warmup: Vec<String>,
}

/// `POST /v1/sandboxes/{id}/move`; the body may be left out.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(ToSchema))]
#[serde(deny_unknown_fields)]
pub struct MoveRequest {
    /// The peer to move to; the least loaded live peer when left out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub to: Option<String>,
    /// Carry the processes' memory: they continue on the target.
    #[serde(default)]
    pub memory: Memory,
}

/// The most warm sandboxes one pool keeps (`warm`, `warm_max`) unless a node's `max_warm` says
/// otherwise: a bound on what one line of configuration can make a node start.
pub const MAX_WARM: usize = 1024;

/// One pool's configuration (`GET`/`PUT /v1/pools`, and `[[pools]]` in the node's config).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(ToSchema))]
#[serde(deny_unknown_fields)]
pub struct PoolConfig {
    pub template: String,
    #[serde(default = "small")]
    pub size: Size,
    #[serde(default = "no_lane")]
    pub lane: Lane,
    /// Warm sandboxes to keep ready (at most the node's `max_warm`).
    pub warm: usize,
    /// Ceiling the warm target may rise to while claims outrun refills (default: 2 × warm, at
    /// most the node's `max_warm`).
    #[serde(default)]
    pub warm_max: Option<usize>,
    /// Hibernate a claimed sandbox of this pool after this long without a data-plane call (the
    /// clock pauses while a relay connection is open). Never when unset.
    #[serde(default)]
    pub idle_hibernate_seconds: Option<u64>,
    /// Whether idle hibernation and `on_expire: archive` keep the processes' memory.
    #[serde(default)]
    pub memory: Memory,
    /// Clone this pool's sandboxes from a golden that holds the processes its template's
    /// warmup left running, so each starts with them (e.g. an interpreter with its imports
    /// loaded). Files only where the node keeps no memory.
    #[serde(default)]
    pub memory_golden: bool,
    /// Lane `egress`: the policy of this pool's claims (they may narrow it); left out: the
    /// node's default, which allows nothing unless the operator set one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub egress: Option<EgressPolicy>,
}

fn small() -> Size {
    Size::Small
}

fn no_lane() -> Lane {
    Lane::None
}

/// `GET`/`PUT /v1/pools`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(ToSchema))]
#[serde(deny_unknown_fields)]
pub struct Pools {
    pub pools: Vec<PoolConfig>,
}

// ---- answers ----

/// A preview: `url` opens port `port` of the sandbox until `expires_ms`; its first visit sets
/// a cookie (so the page's own requests carry it) and drops the token from the address.
/// `DELETE /v1/sandboxes/{id}/previews/{token}` revokes it; a released sandbox's are all gone.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(ToSchema))]
pub struct Preview {
    pub token: String,
    pub url: String,
    pub port: u16,
    pub expires_ms: u64,
}

/// One claim as the node reports it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(ToSchema))]
pub struct Sandbox {
    pub id: String,
    pub template: String,
    pub size: Size,
    pub lane: Lane,
    pub tier: Tier,
    pub state: SandboxState,
    /// The node that runs it (its API address).
    pub owner: String,
    pub created_ms: u64,
    /// When the lease ends, unix milliseconds.
    pub deadline_ms: u64,
    pub on_expire: OnExpire,
    pub metadata: BTreeMap<String, String>,
    /// The data plane: `GET` it with `Upgrade: silkd`.
    pub agent_path: String,
    pub lease_seconds: u64,
    /// When the current state began.
    pub state_since_ms: u64,
    /// Lineage: the checkpoint this sandbox was branched from, or the sandbox it was forked from.
    pub from_checkpoint: Option<String>,
    pub forked_from: Option<String>,
    /// Whether its processes' memory was kept by the last operation that stopped or started it
    /// (hibernate, wake, branch, fork, move, archive); before any, whether the node can.
    pub memory_snapshot: bool,
    /// Why not, when it was not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_note: Option<String>,
    /// The sandbox's token: only in the answer that made it (claim, branch, fork).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<String>,
    /// How long the node took to serve the claim: only in the answer that made it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub claim_micros: Option<u64>,
    /// The node's mesh name: only in a move's answer (the node it moved to).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    /// Lane `egress`: the policy it runs under.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub egress: Option<EgressPolicy>,
    /// The tenant that owns it; left out for root's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
}

/// `GET /v1/sandboxes`, and the children of a fork.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(ToSchema))]
pub struct SandboxList {
    pub sandboxes: Vec<Sandbox>,
    /// More rows follow: pass this as `cursor` to get them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_cursor: Option<String>,
    /// Nodes of the mesh that did not answer in time: their sandboxes are missing here.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unreachable: Vec<String>,
}

/// `GET /v1/fleet`: every node's report.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(ToSchema))]
pub struct FleetView {
    pub nodes: Vec<NodeInfo>,
    /// Nodes of the mesh that did not answer in time.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unreachable: Vec<String>,
}

/// `POST /v1/sandboxes/{id}/renew`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(ToSchema))]
pub struct Renewed {
    pub id: String,
    pub deadline_ms: u64,
}

/// `POST /v1/sandboxes/{id}/exec`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(ToSchema))]
pub struct ExecResult {
    pub exit_code: i32,
    pub signal: Option<i32>,
    pub timed_out: bool,
    pub stdout: String,
    pub stderr: String,
    /// The output went past the node's cap and was cut there.
    pub stdout_truncated: bool,
    pub stderr_truncated: bool,
}

/// A checkpoint in the store: `ck_` followed by 32 hex digits.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(ToSchema))]
pub struct Checkpoint {
    pub id: String,
    pub name: Option<String>,
    /// The sandbox it was taken from.
    pub sandbox: String,
    pub template: String,
    pub created_ms: u64,
    /// Bytes in the snapshot.
    pub bytes: u64,
    /// Bytes this checkpoint sent to the store (the rest was there): only when it was made.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uploaded_bytes: Option<u64>,
    /// Whether it holds the processes' memory (a branch continues them): only when it was made.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_snapshot: Option<bool>,
    /// Why not, when it does not: only when it was made.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_note: Option<String>,
    /// How long the sandbox was frozen for it (the dump and the file capture): only when it was
    /// made, of a running sandbox.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub freeze_ms: Option<u64>,
}

/// `GET /v1/checkpoints`, `GET /v1/sandboxes/{id}/checkpoints`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(ToSchema))]
pub struct CheckpointList {
    pub checkpoints: Vec<Checkpoint>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum TemplateKind {
    Builtin,
    Configured,
    Promoted,
    /// Registered at run time (`POST /v1/templates`), kept in the store for the whole fleet.
    Registered,
}

/// Where a registry image stands on the node that answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum PullStatus {
    /// Not pulled here yet (a claim or a pool pulls it).
    Pending,
    Pulling,
    Ready,
    Failed,
}

/// A template as `GET /v1/templates` lists it (and promote answers).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(ToSchema))]
pub struct Template {
    pub name: String,
    pub kind: TemplateKind,
    /// The golden's content digest (promoted templates).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub digest: Option<String>,
    /// The sandbox it was promoted from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub created_ms: Option<u64>,
    /// Templates from a registry image: the reference as given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    /// ... the image manifest digest the reference is pinned to (until a refresh).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_digest: Option<String>,
    /// ... and the pull on the node that answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<PullStatus>,
    /// Compressed bytes fetched, of `bytes_total` (`pulling`, `ready`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes_done: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes_total: Option<u64>,
    /// Why the pull failed (`failed`): the code a claim of it answers with.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<ErrorDetail>,
}

/// `GET /v1/templates`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(ToSchema))]
pub struct TemplateList {
    pub templates: Vec<Template>,
}

/// `GET /v1/info` (and the drain calls' answers).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(ToSchema))]
pub struct NodeInfo {
    pub version: String,
    pub engine: String,
    /// What the engine can do (limits, disk mechanism, memory snapshots), as it reports it;
    /// `memory_note` says why process memory is not kept, when it is not.
    #[cfg_attr(feature = "schema", schema(value_type = Object))]
    pub capabilities: serde_json::Value,
    pub claims: u64,
    pub max_claims: u64,
    pub draining: bool,
    pub uptime_ms: u64,
    pub pools: Vec<PoolStatus>,
    /// The templates this node has a golden of.
    pub goldens: Vec<String>,
    /// The node's name (its mesh name, or `local`).
    pub name: String,
    /// The node in its mesh; `null` on a node alone.
    pub mesh: Option<MeshInfo>,
}

/// One pool's live state in [`NodeInfo`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(ToSchema))]
pub struct PoolStatus {
    pub template: String,
    pub size: Size,
    pub lane: Lane,
    pub warm: u64,
    pub starting: u64,
    pub target: u64,
    pub warm_min: u64,
    pub warm_max: u64,
    /// The digest of the golden its clones come from.
    pub golden: Option<String>,
    /// Refills failed lately and wait before the next try.
    pub backing_off: bool,
}

/// This node in its mesh.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(ToSchema))]
pub struct MeshInfo {
    /// Its QUIC address.
    pub addr: String,
    /// +1 at every start.
    pub epoch: u64,
    /// Live peers.
    pub peers: u64,
    /// Whether it forwards claims and calls (behind a load balancer) instead of redirecting.
    pub forward: bool,
}

/// `GET /v1/peers`: the mesh as this node sees it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(ToSchema))]
pub struct MeshView {
    pub name: String,
    /// Whether this node is in a mesh at all.
    pub mesh: bool,
    /// This node as its peers see it (in a mesh).
    #[serde(rename = "self", default, skip_serializing_if = "Option::is_none")]
    pub this: Option<PeerRow>,
    pub peers: Vec<PeerRow>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gossip_bytes_sent: Option<u64>,
}

/// A live member of the mesh and what it last said about itself (`null` until it has).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(ToSchema))]
pub struct PeerRow {
    pub name: String,
    pub mesh_addr: String,
    pub epoch: u64,
    pub api: Option<String>,
    pub public_url: Option<String>,
    pub warm: Option<BTreeMap<String, u32>>,
    pub goldens: Option<Vec<String>>,
    pub claims: Option<u32>,
    pub capacity: Option<u32>,
    pub draining: Option<bool>,
    /// Its state's version: `[epoch, seq]`.
    pub version: Option<[u64; 2]>,
}

/// Every error answer: `{"error": {"code": "...", "message": "..."}}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(ToSchema))]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(ToSchema))]
pub struct ErrorDetail {
    pub code: Code,
    pub message: String,
}
