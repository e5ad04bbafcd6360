//! What a claim is on disk and on the wire: the journal's records, the claims a node publishes
//! in the store for an archive, and the record a move hands to a peer. These are the node's own
//! types, field for field and variant for variant what `ClaimRecord` and the engine types inside
//! it were when journal format 2 was fixed (fixtures: `tests/fixtures/journal-v2`, and
//! `tests/fixtures/claims-v2.json` for the JSON form), plus the owning tenant since format 3 (a
//! format-2 log is upgraded when the node opens it: its claims are root's). postcard writes no names, only order and
//! variant indexes: a change here is a new journal format; JSON names are kept as they were, so
//! nodes of either build read each other's claims. The conversions are explicit, so an engine
//! or API type can change without changing either form, and a record that does not convert
//! (a digest that is not one, a phase its fields cannot make) is refused rather than misread.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use silk_engine::{Base, BoxSpec, Golden, Lane, Limits, Size, Snapshot, Template};

use crate::claims::{ClaimRecord, Intent, OnExpire, Phase, Tier};
use crate::state::SandboxState;

/// The journal format these types are.
pub const VERSION: u32 = 4;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StoredClaim {
    id: String,
    token_hash: String,
    template: String,
    size: StoredSize,
    lane: StoredLane,
    tier: StoredTier,
    state: StoredState,
    created_ms: u64,
    deadline_ms: u64,
    on_expire: StoredOnExpire,
    metadata: BTreeMap<String, String>,
    lease_seconds: u64,
    idle_hibernate_seconds: Option<u64>,
    from_checkpoint: Option<String>,
    forked_from: Option<String>,
    state_since_ms: u64,
    stopped: Option<StoredSnapshot>,
    archive: Option<String>,
    intent: Option<StoredIntent>,
    /// The tenant that owns the claim; none: root's. (JSON written before format 3 has none.)
    #[serde(default)]
    tenant: Option<String>,
    /// Lane `egress`: its policy (format 4; JSON before it has none).
    #[serde(default)]
    egress: Option<StoredEgress>,
    /// Live preview URLs: their tokens' hashes (format 4).
    #[serde(default)]
    previews: Vec<StoredGrant>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct StoredGrant {
    hash: String,
    port: u16,
    expires_ms: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct StoredEgress {
    allow: Vec<String>,
    deny: Vec<String>,
}

/// A claim as journal format 3 wrote it: [`StoredClaim`] without its egress policy.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct StoredClaimV3 {
    id: String,
    token_hash: String,
    template: String,
    size: StoredSize,
    lane: StoredLane,
    tier: StoredTier,
    state: StoredState,
    created_ms: u64,
    deadline_ms: u64,
    on_expire: StoredOnExpire,
    metadata: BTreeMap<String, String>,
    lease_seconds: u64,
    idle_hibernate_seconds: Option<u64>,
    from_checkpoint: Option<String>,
    forked_from: Option<String>,
    state_since_ms: u64,
    stopped: Option<StoredSnapshot>,
    archive: Option<String>,
    intent: Option<StoredIntent>,
    /// The tenant that owns the claim; none: root's. (JSON written before format 3 has none.)
    #[serde(default)]
    tenant: Option<String>,
}

/// A claim as journal format 2 wrote it: [`StoredClaim`] without its tenant.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct StoredClaimV2 {
    id: String,
    token_hash: String,
    template: String,
    size: StoredSize,
    lane: StoredLane,
    tier: StoredTier,
    state: StoredState,
    created_ms: u64,
    deadline_ms: u64,
    on_expire: StoredOnExpire,
    metadata: BTreeMap<String, String>,
    lease_seconds: u64,
    idle_hibernate_seconds: Option<u64>,
    from_checkpoint: Option<String>,
    forked_from: Option<String>,
    state_since_ms: u64,
    stopped: Option<StoredSnapshot>,
    archive: Option<String>,
    intent: Option<StoredIntent>,
}

impl crate::journal::Record for StoredClaim {
    const VERSION: u32 = VERSION;
    type Previous = StoredClaimV3;
    fn upgrade(c: StoredClaimV3) -> StoredClaim {
        StoredClaim {
            id: c.id,
            token_hash: c.token_hash,
            template: c.template,
            size: c.size,
            lane: c.lane,
            tier: c.tier,
            state: c.state,
            created_ms: c.created_ms,
            deadline_ms: c.deadline_ms,
            on_expire: c.on_expire,
            metadata: c.metadata,
            lease_seconds: c.lease_seconds,
            idle_hibernate_seconds: c.idle_hibernate_seconds,
            from_checkpoint: c.from_checkpoint,
            forked_from: c.forked_from,
            state_since_ms: c.state_since_ms,
            stopped: c.stopped,
            archive: c.archive,
            intent: c.intent,
            tenant: c.tenant,
            egress: None,
            previews: vec![],
        }
    }
}

impl crate::journal::Past for StoredClaimV3 {
    const VERSION: u32 = 3;
    type Before = StoredClaimV2;
    fn upgrade(c: StoredClaimV2) -> StoredClaimV3 {
        StoredClaimV3 {
            id: c.id,
            token_hash: c.token_hash,
            template: c.template,
            size: c.size,
            lane: c.lane,
            tier: c.tier,
            state: c.state,
            created_ms: c.created_ms,
            deadline_ms: c.deadline_ms,
            on_expire: c.on_expire,
            metadata: c.metadata,
            lease_seconds: c.lease_seconds,
            idle_hibernate_seconds: c.idle_hibernate_seconds,
            from_checkpoint: c.from_checkpoint,
            forked_from: c.forked_from,
            state_since_ms: c.state_since_ms,
            stopped: c.stopped,
            archive: c.archive,
            intent: c.intent,
            tenant: None,
        }
    }
}

impl crate::journal::Past for StoredClaimV2 {
    const VERSION: u32 = 2;
    type Before = crate::journal::NoOlder;
    fn upgrade(before: crate::journal::NoOlder) -> StoredClaimV2 {
        match before {}
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
enum StoredSize {
    Small,
    Medium,
    Large,
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
enum StoredLane {
    None,
    Egress,
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
enum StoredTier {
    Warm,
    Clone,
    Cold,
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
enum StoredState {
    Warm,
    Claimed,
    Hibernated,
    Archived,
    Released,
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
enum StoredOnExpire {
    Destroy,
    Archive,
    // Appended: journals written before it still read.
    Hibernate,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
enum StoredIntent {
    Hibernate(Box<StoredSnapshot>),
    Archive(String),
    /// `archive`: the move's name (the field's name from when moves went through an archive).
    Move {
        archive: String,
        target: String,
    },
    Unpublish(String),
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct StoredSnapshot {
    base: StoredBase,
    spec: StoredSpec,
    layer_tar: PathBuf,
    bytes: u64,
    memory: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct StoredBase {
    template: StoredTemplate,
    golden: Option<StoredGolden>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct StoredTemplate {
    name: String,
    digest: String,
    root: PathBuf,
    binds: Vec<(PathBuf, PathBuf)>,
    env: Vec<(String, String)>,
    cwd: Option<String>,
    user: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct StoredGolden {
    digest: String,
    template: StoredTemplate,
    layer: PathBuf,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct StoredSpec {
    size: StoredSize,
    lane: StoredLane,
    limits: Option<StoredLimits>,
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
struct StoredLimits {
    cpu_millis: u32,
    memory_bytes: u64,
    pids: u32,
}

/// Pairs of (live value, stored value) for the plain enums: one table each way.
macro_rules! same_variants {
    ($live:ty, $stored:ident, $($variant:ident),+) => {
        impl From<$live> for $stored {
            fn from(v: $live) -> $stored {
                match v { $(<$live>::$variant => $stored::$variant),+ }
            }
        }
        impl From<$stored> for $live {
            fn from(v: $stored) -> $live {
                match v { $($stored::$variant => <$live>::$variant),+ }
            }
        }
    };
}

same_variants!(Size, StoredSize, Small, Medium, Large);
same_variants!(Lane, StoredLane, None, Egress);
same_variants!(Tier, StoredTier, Warm, Clone, Cold);
same_variants!(SandboxState, StoredState, Warm, Claimed, Hibernated, Archived, Released);
same_variants!(OnExpire, StoredOnExpire, Destroy, Archive, Hibernate);

impl From<&Template> for StoredTemplate {
    fn from(t: &Template) -> StoredTemplate {
        StoredTemplate {
            name: t.name.clone(),
            digest: t.digest.to_string(),
            root: t.root.clone(),
            binds: t.binds.clone(),
            env: t.env.clone(),
            cwd: t.cwd.clone(),
            user: t.user.clone(),
        }
    }
}

impl TryFrom<StoredTemplate> for Template {
    type Error = String;
    fn try_from(t: StoredTemplate) -> Result<Template, String> {
        Ok(Template {
            name: t.name,
            digest: t.digest.parse().map_err(|e| format!("template digest: {e}"))?,
            root: t.root,
            binds: t.binds,
            env: t.env,
            cwd: t.cwd,
            user: t.user,
        })
    }
}

impl From<&Snapshot> for StoredSnapshot {
    fn from(s: &Snapshot) -> StoredSnapshot {
        StoredSnapshot {
            base: StoredBase {
                template: (&s.base.template).into(),
                golden: s.base.golden.as_ref().map(|g| StoredGolden {
                    digest: g.digest.to_string(),
                    template: (&g.template).into(),
                    layer: g.layer.clone(),
                }),
            },
            spec: StoredSpec {
                size: s.spec.size.into(),
                lane: s.spec.lane.into(),
                limits: s.spec.limits.map(|l| StoredLimits {
                    cpu_millis: l.cpu_millis,
                    memory_bytes: l.memory_bytes,
                    pids: l.pids,
                }),
            },
            layer_tar: s.layer_tar.clone(),
            bytes: s.bytes,
            memory: s.memory,
        }
    }
}

impl TryFrom<StoredSnapshot> for Snapshot {
    type Error = String;
    fn try_from(s: StoredSnapshot) -> Result<Snapshot, String> {
        let golden = match s.base.golden {
            Some(g) => Some(Golden {
                digest: g.digest.parse().map_err(|e| format!("golden digest: {e}"))?,
                template: g.template.try_into()?,
                layer: g.layer,
            }),
            None => None,
        };
        let limits = s.spec.limits.map(|l| Limits {
            cpu_millis: l.cpu_millis,
            memory_bytes: l.memory_bytes,
            pids: l.pids,
        });
        Ok(Snapshot {
            base: Base { template: s.base.template.try_into()?, golden },
            spec: BoxSpec { size: s.spec.size.into(), lane: s.spec.lane.into(), limits },
            layer_tar: s.layer_tar,
            bytes: s.bytes,
            memory: s.memory,
            memory_why_not: None,
            freeze_ms: None,
            vouched: false,
        })
    }
}

impl From<&ClaimRecord> for StoredClaim {
    fn from(r: &ClaimRecord) -> StoredClaim {
        StoredClaim {
            id: r.id.clone(),
            token_hash: r.token_hash.clone(),
            template: r.template.clone(),
            size: r.size.into(),
            lane: r.lane.into(),
            tier: r.tier.into(),
            state: r.state().into(),
            created_ms: r.created_ms,
            deadline_ms: r.deadline_ms,
            on_expire: r.on_expire.into(),
            metadata: r.metadata.clone(),
            lease_seconds: r.lease_seconds,
            idle_hibernate_seconds: r.idle_hibernate_seconds,
            from_checkpoint: r.from_checkpoint.clone(),
            forked_from: r.forked_from.clone(),
            state_since_ms: r.state_since_ms,
            stopped: r.phase.snapshot().map(StoredSnapshot::from),
            archive: r.phase.archive().map(str::to_string),
            intent: r.intent.as_ref().map(|i| match i {
                Intent::Hibernate(s) => StoredIntent::Hibernate(Box::new(s.as_ref().into())),
                Intent::Archive(a) => StoredIntent::Archive(a.clone()),
                Intent::Move { name, target } => {
                    StoredIntent::Move { archive: name.clone(), target: target.clone() }
                }
                Intent::Unpublish(a) => StoredIntent::Unpublish(a.clone()),
            }),
            tenant: r.tenant.clone(),
            egress: r
                .egress
                .as_ref()
                .map(|e| StoredEgress { allow: e.allow.clone(), deny: e.deny.clone() }),
            previews: r
                .previews
                .iter()
                .map(|g| StoredGrant {
                    hash: g.hash.clone(),
                    port: g.port,
                    expires_ms: g.expires_ms,
                })
                .collect(),
        }
    }
}

impl From<ClaimRecord> for StoredClaim {
    fn from(r: ClaimRecord) -> StoredClaim {
        StoredClaim::from(&r)
    }
}

impl TryFrom<StoredClaim> for ClaimRecord {
    type Error = String;
    fn try_from(r: StoredClaim) -> Result<ClaimRecord, String> {
        let intent = match r.intent {
            None => None,
            Some(StoredIntent::Hibernate(s)) => Some(Intent::Hibernate(Box::new((*s).try_into()?))),
            Some(StoredIntent::Archive(a)) => Some(Intent::Archive(a)),
            // Older nodes moved through an archive of this name (the store's sweep removes one
            // left behind); the name alone is what a move needs now.
            Some(StoredIntent::Move { archive, target }) => {
                Some(Intent::Move { name: archive, target })
            }
            Some(StoredIntent::Unpublish(a)) => Some(Intent::Unpublish(a)),
        };
        let phase = match (r.state, r.stopped, r.archive) {
            (StoredState::Claimed, None, None) => Phase::Running,
            (StoredState::Hibernated, None, None) => Phase::Stopped,
            (StoredState::Hibernated, Some(s), None) => Phase::Captured(Box::new(s.try_into()?)),
            (StoredState::Archived, None, Some(a)) => Phase::Archived(a),
            (state, stopped, archive) => {
                return Err(format!(
                    "a {state:?} claim with{} a snapshot and archive {archive:?} is no phase",
                    if stopped.is_some() { "" } else { "out" }
                ));
            }
        };
        Ok(ClaimRecord {
            phase,
            id: r.id,
            token_hash: r.token_hash,
            template: r.template,
            size: r.size.into(),
            lane: r.lane.into(),
            tier: r.tier.into(),
            created_ms: r.created_ms,
            deadline_ms: r.deadline_ms,
            on_expire: r.on_expire.into(),
            metadata: r.metadata,
            lease_seconds: r.lease_seconds,
            idle_hibernate_seconds: r.idle_hibernate_seconds,
            from_checkpoint: r.from_checkpoint,
            forked_from: r.forked_from,
            state_since_ms: r.state_since_ms,
            intent,
            tenant: r.tenant,
            egress: r.egress.map(|e| silk_api::EgressPolicy { allow: e.allow, deny: e.deny }),
            previews: r
                .previews
                .into_iter()
                .map(|g| crate::previews::Grant {
                    hash: g.hash,
                    port: g.port,
                    expires_ms: g.expires_ms,
                })
                .collect(),
        })
    }
}

/// The live records of a replayed journal; a record that does not convert is refused by id.
pub fn live_records(
    stored: BTreeMap<String, StoredClaim>,
) -> Result<BTreeMap<String, ClaimRecord>, String> {
    stored
        .into_iter()
        .map(|(id, r)| match ClaimRecord::try_from(r) {
            Ok(r) => Ok((id, r)),
            Err(e) => Err(format!("journal record {id}: {e}")),
        })
        .collect()
}
