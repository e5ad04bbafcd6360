//! Claims: what the journal stores, what a claim request may contain, and bearer tokens.
//!
//! Requests are parsed into [`ClaimSpec`], which cannot hold an invalid value: bounded metadata,
//! a lease within the cap, a known size and lane. Tokens are 32 random bytes shown to the client
//! once; only their blake3 hash is kept, and hashes compare in constant time.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use silk_engine::{Lane, Size, Snapshot};

use crate::error::NodeError;
use crate::state::{SandboxState, Transitions};

pub use silk_api::{
    ClaimRequest, MAX_METADATA_KEY, MAX_METADATA_PAIRS, MAX_METADATA_VALUE, OnExpire,
};

/// How a claim was served. The API's `Tier` also has `Other` (for clients reading a newer
/// node); a claim here is always one of these three.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Tier {
    Warm = 0,
    Clone = 1,
    Cold = 2,
}

impl Tier {
    pub const ALL: [Tier; 3] = [Tier::Warm, Tier::Clone, Tier::Cold];

    pub fn name(self) -> &'static str {
        match self {
            Tier::Warm => "warm",
            Tier::Clone => "clone",
            Tier::Cold => "cold",
        }
    }
}

impl From<Tier> for silk_api::Tier {
    fn from(t: Tier) -> silk_api::Tier {
        match t {
            Tier::Warm => silk_api::Tier::Warm,
            Tier::Clone => silk_api::Tier::Clone,
            Tier::Cold => silk_api::Tier::Cold,
        }
    }
}

/// One claim. On disk and on the wire (the journal, the store's published claims, a move to a
/// peer) it is a [`StoredClaim`](crate::stored::StoredClaim): the conversion refuses a record
/// whose fields do not make one [`Phase`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(into = "crate::stored::StoredClaim", try_from = "crate::stored::StoredClaim")]
pub struct ClaimRecord {
    pub id: String,
    pub token_hash: String,
    pub template: String,
    pub size: Size,
    pub lane: Lane,
    pub tier: Tier,
    /// Where the sandbox is.
    pub phase: Phase,
    pub created_ms: u64,
    pub deadline_ms: u64,
    pub on_expire: OnExpire,
    pub metadata: BTreeMap<String, String>,
    /// The lease's length, so a wake from an archive grants a fresh lease of the same length.
    pub lease_seconds: u64,
    /// Hibernate after this long without a data-plane call (from the pool).
    pub idle_hibernate_seconds: Option<u64>,
    /// Lineage: the checkpoint this sandbox was branched from, or the sandbox it was forked from.
    pub from_checkpoint: Option<String>,
    pub forked_from: Option<String>,
    /// When the current phase began.
    pub state_since_ms: u64,
    /// A lifecycle operation that was begun and not finished: written before acting, so the
    /// next start completes or rolls it back.
    pub intent: Option<Intent>,
    /// The tenant that owns it (its key may act on it, its quotas count it); none: root's.
    pub tenant: Option<String>,
    /// Lane `egress`: the policy it runs under (fixed at the claim; its copies keep it).
    pub egress: Option<silk_api::EgressPolicy>,
    /// Its live preview URLs (their tokens' hashes); copies start with none.
    pub previews: Vec<crate::previews::Grant>,
}

/// Where a claimed sandbox is: one value, so no record can be hibernated with an archive, or
/// archived without one.
#[derive(Debug, Clone, PartialEq)]
pub enum Phase {
    /// Running on this node.
    Running,
    /// Stopped here in place: the engine keeps its box, files and all.
    Stopped,
    /// Stopped here, its files captured in a tar on this node (its box gone).
    Captured(Box<Snapshot>),
    /// Its files are in the store under this archive (`<id>.<random>`: each archive has its own
    /// name, so a stale delete or a crashed upload can never touch a newer one).
    Archived(String),
}

impl Phase {
    /// The state clients see and the transition table speaks of.
    pub fn state(&self) -> SandboxState {
        match self {
            Phase::Running => SandboxState::Claimed,
            Phase::Stopped | Phase::Captured(_) => SandboxState::Hibernated,
            Phase::Archived(_) => SandboxState::Archived,
        }
    }

    /// The tar holding its files on this node, when captured.
    pub fn snapshot(&self) -> Option<&Snapshot> {
        match self {
            Phase::Captured(s) => Some(s),
            _ => None,
        }
    }

    /// Its archive's name, when archived.
    pub fn archive(&self) -> Option<&str> {
        match self {
            Phase::Archived(a) => Some(a),
            _ => None,
        }
    }
}

impl ClaimRecord {
    pub fn state(&self) -> SandboxState {
        self.phase.state()
    }

    /// Moves to `phase`, if the transition table allows its state (the time it began is now).
    pub fn enter(&mut self, phase: Phase, now_ms: u64) -> Result<(), String> {
        self.state().transition(phase.state())?;
        self.phase = phase;
        self.state_since_ms = now_ms;
        Ok(())
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Intent {
    /// Hibernating into `stopped`'s tar: a complete tar there means the capture finished.
    Hibernate(Box<Snapshot>),
    /// Uploading the hibernated snapshot as the archive of this name.
    Archive(String),
    /// Moving to peer `target` under `name` (unique per move, made as an archive's name is):
    /// the sandbox stays here, hibernated, until the target has journalled it (the switch).
    Move { name: String, target: String },
    /// Woken from the archive of this name and running: its published claim and the archive
    /// are still to be removed from the store. (Last: journals written before it decode.)
    Unpublish(String),
}

impl ClaimRecord {
    /// Checks a record that comes from outside this node before it is adopted — the store's
    /// `claims/<id>` (any node can write there) or a peer's move — and bounds its lease. It must
    /// be sandbox `id` (else a record planted under one id wakes another sandbox's archive with
    /// the planter's token), moved through `archive`, an archive of that id, be hibernated (a
    /// move) or archived through that very archive (a wake), and have the template and metadata
    /// a claim request could have had. Its lease is cut to this node's cap (none: the default)
    /// and `deadline_ms` to one lease from `now_ms`, in saturating arithmetic: no value in the
    /// record can overflow either or outlast the cap.
    pub(crate) fn check_foreign(
        &mut self,
        id: &str,
        archive: &str,
        default_ttl: u64,
        max_ttl: u64,
        now_ms: u64,
    ) -> Result<(), NodeError> {
        if self.id != id || id.parse::<silk_engine::SandboxId>().is_err() {
            return Err(NodeError::bad_request(format!(
                "the record names {:?}, not {id:?}",
                self.id
            )));
        }
        if !is_archive_of(archive, id) {
            return Err(NodeError::bad_request(format!("{archive:?} is not an archive of {id}")));
        }
        match &self.phase {
            Phase::Stopped => {}
            Phase::Archived(a) if a == archive => {}
            other => {
                return Err(NodeError::bad_request(format!(
                    "a record {:?} through {:?} cannot be adopted from {archive:?}",
                    other.state(),
                    other.archive()
                )));
            }
        }
        if self.template.is_empty() || self.template.chars().count() > 128 {
            return Err(NodeError::bad_request("template must be 1-128 characters"));
        }
        check_metadata(&self.metadata)?;
        // Cut to the cap rather than refused: a node with a larger cap may have granted it, and
        // its archive must still wake here.
        self.lease_seconds =
            checked_ttl(Some(self.lease_seconds.min(max_ttl)), default_ttl, max_ttl)?;
        self.deadline_ms = self.deadline_ms.min(lease_end(now_ms, self.lease_seconds));
        Ok(())
    }
}

/// When a lease of `seconds` from `now_ms` ends (saturating: never wraps into the past).
pub fn lease_end(now_ms: u64, seconds: u64) -> u64 {
    now_ms.saturating_add(seconds.saturating_mul(1000))
}

/// The store name of a new archive of sandbox `id`: `<id>.<16 hex>`, unique per archive.
pub fn new_archive_name(id: &str) -> String {
    format!("{id}.{}", random_hex(8))
}

/// Whether `archive` is a name [`new_archive_name`] could have made for sandbox `id`.
pub fn is_archive_of(archive: &str, id: &str) -> bool {
    archive.strip_prefix(id).and_then(|rest| rest.strip_prefix('.')).is_some_and(|hex| {
        hex.len() == 16 && hex.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    })
}

/// A validated claim request.
#[derive(Debug, Clone)]
pub struct ClaimSpec {
    pub template: String,
    pub size: Size,
    pub lane: Lane,
    pub ttl_seconds: u64,
    pub metadata: BTreeMap<String, String>,
    pub on_expire: OnExpire,
    /// The tenant the claim is for (its quota counts it); none: root's.
    pub tenant: Option<String>,
    /// Lane `egress`: the policy asked for, then (from [`Node::claim`](crate::node::Node)) the
    /// one it runs under.
    pub egress: Option<silk_api::EgressPolicy>,
}

impl ClaimSpec {
    /// A claim request checked against this node's lease bounds, its defaults filled in.
    pub fn validate(
        req: ClaimRequest,
        default_ttl: u64,
        max_ttl: u64,
    ) -> Result<ClaimSpec, NodeError> {
        let ttl_seconds = checked_ttl(req.ttl_seconds, default_ttl, max_ttl)?;
        check_metadata(&req.metadata)?;
        crate::egress::check_asked(&req.egress)?;
        let template = req.template.unwrap_or_else(|| "host".into());
        if template.is_empty() || template.chars().count() > 128 {
            return Err(NodeError::bad_request("template must be 1-128 characters"));
        }
        Ok(ClaimSpec {
            template,
            size: req.size.unwrap_or(Size::Small),
            lane: req.lane.unwrap_or(Lane::None),
            ttl_seconds,
            metadata: req.metadata,
            on_expire: req.on_expire,
            tenant: None,
            egress: req.egress,
        })
    }
}

pub fn checked_ttl(ttl: Option<u64>, default_ttl: u64, max_ttl: u64) -> Result<u64, NodeError> {
    match ttl {
        None | Some(0) => Ok(default_ttl),
        Some(t) if t > max_ttl => {
            Err(NodeError::bad_request(format!("ttl_seconds {t} exceeds the cap of {max_ttl}")))
        }
        Some(t) => Ok(t),
    }
}

pub(crate) fn check_metadata(m: &BTreeMap<String, String>) -> Result<(), NodeError> {
    if m.len() > MAX_METADATA_PAIRS {
        return Err(NodeError::bad_request(format!("at most {MAX_METADATA_PAIRS} metadata pairs")));
    }
    // Counted in characters, as the document's maxLength is.
    for (k, v) in m {
        if k.is_empty() || k.chars().count() > MAX_METADATA_KEY {
            return Err(NodeError::bad_request(format!(
                "metadata keys are 1-{MAX_METADATA_KEY} characters"
            )));
        }
        if v.chars().count() > MAX_METADATA_VALUE {
            return Err(NodeError::bad_request(format!(
                "metadata value of {k:?} exceeds {MAX_METADATA_VALUE} characters"
            )));
        }
    }
    Ok(())
}

/// The 8-hex tag of a node name that sandbox ids carry.
pub fn home_tag(name: &str) -> String {
    blake3::hash(name.as_bytes()).to_hex()[..8].to_string()
}

/// A fresh sandbox id homed on the node named `name`.
pub fn new_sandbox_id(name: &str) -> String {
    format!("sb-{}-{}", home_tag(name), random_hex(6))
}

/// A fresh random hex string of `bytes` random bytes.
pub fn random_hex(bytes: usize) -> String {
    let mut buf = vec![0u8; bytes];
    let mut filled = 0;
    while filled < bytes {
        // SAFETY: getrandom writes at most the given length into the buffer.
        let n = unsafe { libc::getrandom(buf[filled..].as_mut_ptr().cast(), bytes - filled, 0) };
        if n > 0 {
            filled += n as usize;
        }
    }
    let mut hex = String::with_capacity(2 * bytes);
    for b in buf {
        for nibble in [b >> 4, b & 15] {
            hex.push(char::from_digit(nibble.into(), 16).expect("a nibble is a hex digit"));
        }
    }
    hex
}

pub fn new_token() -> String {
    format!("sbt_{}", random_hex(32))
}

/// Whether `t` has the shape of a sandbox's token (whether it is one is the sandbox's to say).
pub fn token_shaped(t: &str) -> bool {
    t.strip_prefix("sbt_")
        .is_some_and(|hex| hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_hexdigit()))
}

pub fn hash_token(token: &str) -> String {
    blake3::hash(token.as_bytes()).to_hex().to_string()
}

/// Equality that takes the same time wherever the inputs differ.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Whether `token` is the one whose hash is `hash`.
pub fn token_matches(token: &str, hash: &str) -> bool {
    constant_time_eq(hash_token(token).as_bytes(), hash.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_are_bounded() {
        let ok = ClaimSpec::validate(ClaimRequest::default(), 300, 86_400).unwrap();
        assert_eq!((ok.template.as_str(), ok.ttl_seconds), ("host", 300));
        let too_long = ClaimRequest { ttl_seconds: Some(86_401), ..Default::default() };
        assert!(ClaimSpec::validate(too_long, 300, 86_400).is_err());
        let many: BTreeMap<_, _> = (0..17).map(|i| (format!("k{i}"), "v".to_string())).collect();
        assert!(
            ClaimSpec::validate(ClaimRequest { metadata: many, ..Default::default() }, 300, 86_400)
                .is_err()
        );
        let big = BTreeMap::from([("k".to_string(), "v".repeat(513))]);
        assert!(
            ClaimSpec::validate(ClaimRequest { metadata: big, ..Default::default() }, 300, 86_400)
                .is_err()
        );
        assert!(
            serde_json::from_str::<ClaimRequest>(r#"{"sise":"small"}"#).is_err(),
            "unknown fields"
        );
        assert!(serde_json::from_str::<ClaimRequest>(r#"{"size":"huge"}"#).is_err());
    }

    fn archived(id: &str, archive: &str) -> ClaimRecord {
        ClaimRecord {
            id: id.into(),
            token_hash: hash_token("t"),
            template: "host".into(),
            size: Size::Small,
            lane: Lane::None,
            tier: Tier::Warm,
            phase: Phase::Archived(archive.into()),
            created_ms: 0,
            deadline_ms: 0,
            on_expire: OnExpire::Destroy,
            metadata: BTreeMap::new(),
            lease_seconds: 300,
            idle_hibernate_seconds: None,
            from_checkpoint: None,
            forked_from: None,
            state_since_ms: 0,
            intent: None,
            tenant: None,
            egress: None,
            previews: vec![],
        }
    }

    #[test]
    fn archive_names_belong_to_their_sandbox() {
        let name = new_archive_name("sb-1");
        assert!(is_archive_of(&name, "sb-1"), "{name}");
        assert!(!is_archive_of(&name, "sb-2"));
        assert!(!is_archive_of(&name, "sb"), "a prefix of the id is another sandbox");
        for bad in ["sb-1", "sb-1.", "sb-1.0123", "sb-1.0123456789ABCDEF", "sb-1.0123456789abcdef0"]
        {
            assert!(!is_archive_of(bad, "sb-1"), "{bad}");
        }
    }

    #[test]
    fn foreign_records_must_be_the_sandbox_asked_for_and_bounded() {
        let (now, max) = (1_000_000, 86_400);
        let ar = "sb-a.0123456789abcdef";
        let mut ok = archived("sb-a", ar);
        ok.check_foreign("sb-a", ar, 300, max, now).unwrap();
        // A record planted under claims/sb-a that names sb-b (and sb-b's archive).
        let mut other = archived("sb-b", "sb-b.0123456789abcdef");
        assert!(other.check_foreign("sb-a", "sb-b.0123456789abcdef", 300, max, now).is_err());
        assert!(other.check_foreign("sb-a", ar, 300, max, now).is_err());
        // The right id, another sandbox's archive.
        let mut stolen = archived("sb-a", "sb-b.0123456789abcdef");
        assert!(stolen.check_foreign("sb-a", "sb-b.0123456789abcdef", 300, max, now).is_err());
        // Archived through one archive, adopted from another.
        let mut elsewhere = archived("sb-a", ar);
        assert!(elsewhere.check_foreign("sb-a", "sb-a.fedcba9876543210", 300, max, now).is_err());
        // Only hibernated (a move) or archived (a wake) records are adopted.
        let mut claimed = ClaimRecord { phase: Phase::Running, ..archived("sb-a", ar) };
        assert!(claimed.check_foreign("sb-a", ar, 300, max, now).is_err());
        let mut moved = ClaimRecord { phase: Phase::Stopped, ..ok.clone() };
        moved.check_foreign("sb-a", ar, 300, max, now).unwrap();
        // Not a sandbox id at all.
        let mut path = archived("../x", "../x.0123456789abcdef");
        assert!(path.check_foreign("../x", "../x.0123456789abcdef", 300, max, now).is_err());
        // A lease past the cap is cut to it, also one whose end would overflow.
        let mut long = ClaimRecord { lease_seconds: max + 1, ..archived("sb-a", ar) };
        long.check_foreign("sb-a", ar, 300, max, now).unwrap();
        assert_eq!(long.lease_seconds, max);
        let mut huge =
            ClaimRecord { lease_seconds: u64::MAX, deadline_ms: u64::MAX, ..archived("sb-a", ar) };
        huge.check_foreign("sb-a", ar, 300, max, now).unwrap();
        assert_eq!((huge.lease_seconds, huge.deadline_ms), (max, now + max * 1000));
        // A deadline far in the future is cut to one lease from now.
        let mut late = ClaimRecord { deadline_ms: u64::MAX, ..archived("sb-a", ar) };
        late.check_foreign("sb-a", ar, 300, max, now).unwrap();
        assert_eq!(late.deadline_ms, now + 300 * 1000);
        let mut zero =
            ClaimRecord { lease_seconds: 0, deadline_ms: u64::MAX, ..archived("sb-a", ar) };
        zero.check_foreign("sb-a", ar, 300, max, now).unwrap();
        assert_eq!((zero.lease_seconds, zero.deadline_ms), (300, now + 300 * 1000));
        // Metadata past the claim limits.
        let many: BTreeMap<_, _> = (0..17).map(|i| (format!("k{i}"), String::new())).collect();
        let mut meta = ClaimRecord { metadata: many, ..archived("sb-a", ar) };
        assert!(meta.check_foreign("sb-a", ar, 300, max, now).is_err());
        assert_eq!(lease_end(u64::MAX - 1, u64::MAX), u64::MAX);
    }

    #[test]
    fn tokens_are_random_and_checked_by_hash() {
        let (a, b) = (new_token(), new_token());
        assert_ne!(a, b);
        assert!(token_shaped(&a) && token_shaped(&b), "{a} {b}");
        assert!(random_hex(3).bytes().all(|c| matches!(c, b'0'..=b'9' | b'a'..=b'f')));
        assert!(token_matches(&a, &hash_token(&a)));
        assert!(!token_matches(&b, &hash_token(&a)));
        assert!(!constant_time_eq(b"ab", b"abc"));
    }
}
