//! The `s3` backend's settings and their checks.

use serde::{Deserialize, Serialize};

use super::MIN_PART;
use crate::object::check_prefix;
use crate::{Result, StoreError};

/// The `s3` backend's settings (the `[store.s3]` table of the node config). Every key but
/// `bucket` has a default. There are deliberately no credential keys: see the module docs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct S3Config {
    pub bucket: String,
    /// `us-east-1` unless given; Garage's default is `garage`.
    #[serde(default = "default_region")]
    pub region: String,
    /// A custom endpoint (`http://127.0.0.1:3900`, `https://minio.example:9000`); AWS when unset.
    #[serde(default)]
    pub endpoint: Option<String>,
    /// Prepended to every key, e.g. `silkmesh/`; lets several deployments share a bucket.
    #[serde(default)]
    pub prefix: String,
    /// Path-style addressing (`endpoint/bucket/key`): MinIO and Garage want it.
    #[serde(default)]
    pub path_style: bool,
    /// Tries per request, the first included.
    #[serde(default = "default_max_attempts")]
    pub max_attempts: u32,
    #[serde(default = "default_initial_backoff_ms")]
    pub initial_backoff_ms: u64,
    #[serde(default = "default_max_backoff_ms")]
    pub max_backoff_ms: u64,
    #[serde(default = "default_connect_timeout_ms")]
    pub connect_timeout_ms: u64,
    /// Bodies longer than this are uploaded in parts.
    #[serde(default = "default_multipart_threshold")]
    pub multipart_threshold: u64,
    #[serde(default = "default_part_size")]
    pub part_size: u64,
    /// Parts of one object in flight at once.
    #[serde(default = "default_part_concurrency")]
    pub part_concurrency: usize,
    /// Keys per `list` page (S3 caps it at 1000).
    #[serde(default = "default_list_page")]
    pub list_page: i32,
}

fn default_region() -> String {
    "us-east-1".into()
}
fn default_max_attempts() -> u32 {
    4
}
fn default_initial_backoff_ms() -> u64 {
    200
}
fn default_max_backoff_ms() -> u64 {
    5_000
}
fn default_connect_timeout_ms() -> u64 {
    3_000
}
fn default_multipart_threshold() -> u64 {
    32 * 1024 * 1024
}
fn default_part_size() -> u64 {
    8 * 1024 * 1024
}
fn default_part_concurrency() -> usize {
    4
}
fn default_list_page() -> i32 {
    1000
}

impl S3Config {
    /// A config with every default, for `bucket`.
    pub fn new(bucket: impl Into<String>) -> S3Config {
        S3Config {
            bucket: bucket.into(),
            region: default_region(),
            endpoint: None,
            prefix: String::new(),
            path_style: false,
            max_attempts: default_max_attempts(),
            initial_backoff_ms: default_initial_backoff_ms(),
            max_backoff_ms: default_max_backoff_ms(),
            connect_timeout_ms: default_connect_timeout_ms(),
            multipart_threshold: default_multipart_threshold(),
            part_size: default_part_size(),
            part_concurrency: default_part_concurrency(),
            list_page: default_list_page(),
        }
    }

    pub(super) fn check(&self) -> Result<()> {
        let bad = |m: &str| Err(StoreError::InvalidConfig(format!("s3: {m}")));
        if self.bucket.is_empty() {
            return bad("bucket is empty");
        }
        if !self.prefix.is_empty() && !self.prefix.ends_with('/') {
            return bad("prefix must end with `/`");
        }
        check_prefix(&self.prefix)?;
        if self.max_attempts == 0 {
            return bad("max_attempts must be at least 1");
        }
        if self.part_size < MIN_PART {
            return bad("part_size must be at least 5 MiB");
        }
        if self.multipart_threshold < self.part_size {
            return bad("multipart_threshold must be at least part_size");
        }
        if self.part_concurrency == 0 {
            return bad("part_concurrency must be at least 1");
        }
        if !(1..=1000).contains(&self.list_page) {
            return bad("list_page must be in 1..=1000");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn configs_are_checked() {
        assert!(S3Config::new("b").check().is_ok());
        assert!(S3Config::new("").check().is_err());
        let mut c = S3Config::new("b");
        c.prefix = "no-slash".into();
        assert!(c.check().is_err());
        c.prefix = "silk/".into();
        assert!(c.check().is_ok());
        c.part_size = 1024;
        assert!(c.check().is_err());
    }
}
