//! Claims: what the journal stores, what a claim request may contain, and bearer tokens.
//!
//! Requests are parsed into [`ClaimSpec`], which cannot hold an invalid value: bounded metadata,
//! a lease within the cap, a known size and lane. Tokens are 32 random bytes shown to the client
//! once; only their blake3 hash is kept, and hashes compare in constant time.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use silk_engine::{Lane, Size, Snapshot};

use crate::error::ApiError;
use crate::state::SandboxState;

pub const MAX_METADATA_PAIRS: usize = 16;
pub const MAX_METADATA_KEY: usize = 128;
pub const MAX_METADATA_VALUE: usize = 512;

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

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum OnExpire {
    #[default]
    Destroy,
    Archive,
}

/// One claim as the journal keeps it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClaimRecord {
    pub id: String,
    pub token_hash: String,
    pub template: String,
    pub size: Size,
    pub lane: Lane,
    pub tier: Tier,
    pub state: SandboxState,
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
    /// When the current state began.
    pub state_since_ms: u64,
    /// The sandbox's files on this node while it is hibernated.
    pub stopped: Option<Snapshot>,
    /// The store name of its archive while it is archived (`<id>.<random>`: each archive has
    /// its own name, so a stale delete or a crashed upload can never touch a newer one).
    pub archive: Option<String>,
    /// A lifecycle operation that was begun and not finished: written before acting, so the
    /// next start completes or rolls it back.
    pub intent: Option<Intent>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Intent {
    /// Hibernating into `stopped`'s tar: a complete tar there means the capture finished.
    Hibernate(Box<Snapshot>),
    /// Uploading the hibernated snapshot as the archive of this name.
    Archive(String),
    /// Moving to peer `target` through the archive `archive`: the sandbox stays here,
    /// hibernated, until the target has journalled it (the switch).
    Move { archive: String, target: String },
    /// Woken from the archive of this name and running: its published claim and the archive
    /// are still to be removed from the store. (Last: journals written before it decode.)
    Unpublish(String),
}

/// `POST /v1/sandboxes` body, as sent (serialized again when a claim is forwarded to a peer).
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct ClaimRequest {
    #[serde(default)]
    pub template: Option<String>,
    #[serde(default)]
    pub size: Option<Size>,
    #[serde(default)]
    pub lane: Option<Lane>,
    #[serde(default)]
    pub ttl_seconds: Option<u64>,
    #[serde(default)]
    pub metadata: BTreeMap<String, String>,
    #[serde(default)]
    pub on_expire: OnExpire,
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
}

impl ClaimRequest {
    pub fn validate(self, default_ttl: u64, max_ttl: u64) -> Result<ClaimSpec, ApiError> {
        let ttl_seconds = checked_ttl(self.ttl_seconds, default_ttl, max_ttl)?;
        check_metadata(&self.metadata)?;
        let template = self.template.unwrap_or_else(|| "host".into());
        if template.is_empty() || template.len() > 128 {
            return Err(ApiError::bad_request("template must be 1-128 bytes"));
        }
        Ok(ClaimSpec {
            template,
            size: self.size.unwrap_or(Size::Small),
            lane: self.lane.unwrap_or(Lane::None),
            ttl_seconds,
            metadata: self.metadata,
            on_expire: self.on_expire,
        })
    }
}

pub fn checked_ttl(ttl: Option<u64>, default_ttl: u64, max_ttl: u64) -> Result<u64, ApiError> {
    match ttl {
        None | Some(0) => Ok(default_ttl),
        Some(t) if t > max_ttl => {
            Err(ApiError::bad_request(format!("ttl_seconds {t} exceeds the cap of {max_ttl}")))
        }
        Some(t) => Ok(t),
    }
}

fn check_metadata(m: &BTreeMap<String, String>) -> Result<(), ApiError> {
    if m.len() > MAX_METADATA_PAIRS {
        return Err(ApiError::bad_request(format!("at most {MAX_METADATA_PAIRS} metadata pairs")));
    }
    for (k, v) in m {
        if k.is_empty() || k.len() > MAX_METADATA_KEY {
            return Err(ApiError::bad_request(format!(
                "metadata keys are 1-{MAX_METADATA_KEY} bytes"
            )));
        }
        if v.len() > MAX_METADATA_VALUE {
            return Err(ApiError::bad_request(format!(
                "metadata value of {k:?} exceeds {MAX_METADATA_VALUE} bytes"
            )));
        }
    }
    Ok(())
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
    buf.iter().map(|b| format!("{b:02x}")).collect()
}

pub fn new_token() -> String {
    format!("sbt_{}", random_hex(32))
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
        let ok = ClaimRequest::default().validate(300, 86_400).unwrap();
        assert_eq!((ok.template.as_str(), ok.ttl_seconds), ("host", 300));
        let too_long = ClaimRequest { ttl_seconds: Some(86_401), ..Default::default() };
        assert!(too_long.validate(300, 86_400).is_err());
        let many: BTreeMap<_, _> = (0..17).map(|i| (format!("k{i}"), "v".to_string())).collect();
        assert!(
            ClaimRequest { metadata: many, ..Default::default() }.validate(300, 86_400).is_err()
        );
        let big = BTreeMap::from([("k".to_string(), "v".repeat(513))]);
        assert!(
            ClaimRequest { metadata: big, ..Default::default() }.validate(300, 86_400).is_err()
        );
        assert!(
            serde_json::from_str::<ClaimRequest>(r#"{"sise":"small"}"#).is_err(),
            "unknown fields"
        );
        assert!(serde_json::from_str::<ClaimRequest>(r#"{"size":"huge"}"#).is_err());
    }

    #[test]
    fn tokens_are_random_and_checked_by_hash() {
        let (a, b) = (new_token(), new_token());
        assert_ne!(a, b);
        assert!(token_matches(&a, &hash_token(&a)));
        assert!(!token_matches(&b, &hash_token(&a)));
        assert!(!constant_time_eq(b"ab", b"abc"));
    }
}
