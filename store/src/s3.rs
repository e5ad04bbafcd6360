//! The `s3` backend on aws-sdk-s3: AWS S3, MinIO, Garage, Ceph RGW.
//!
//! Credentials come from the standard AWS chain (environment, shared profile files, web
//! identity, ECS/EC2 metadata), never from the node's config file. Every request goes through the
//! SDK's standard retry strategy: throttling, 5xx, timeouts and connection failures are retried
//! with jittered exponential backoff up to `max_attempts`, then reported as
//! [`StoreError::Unavailable`].
//!
//! A put buffers up to `multipart_threshold` bytes; a body that ends before that is one
//! `PutObject`, a longer one a multipart upload whose parts (`part_size` each) are uploaded by at
//! most `part_concurrency` tasks. A failed or dropped multipart put aborts its upload (from a
//! spawned task, since `Drop` cannot await) so no parts linger; a bucket lifecycle rule for
//! incomplete uploads is the backstop if the process dies first.
//!
//! Checksums: chunks are verified end to end by their blake3 names, so the SDK's own CRC checksums
//! are only sent where an operation requires one. That also keeps older S3-compatible servers
//! working.

use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use aws_config::BehaviorVersion;
use aws_config::retry::RetryConfig;
use aws_config::timeout::TimeoutConfig;
use aws_sdk_s3::Client;
use aws_sdk_s3::config::{Region, RequestChecksumCalculation, ResponseChecksumValidation};
use aws_sdk_s3::error::{DisplayErrorContext, ProvideErrorMetadata, SdkError};
use aws_sdk_s3::types::{CompletedMultipartUpload, CompletedPart, Delete, ObjectIdentifier};
use aws_smithy_http_client::tls;
use bytes::{Bytes, BytesMut};
use futures_util::StreamExt;
use tokio::task::JoinSet;

use crate::object::check_prefix;
use crate::{ByteRange, ByteStream, GetObject, Key, ListPage, ObjectMeta, ObjectStore};
use crate::{Result, StoreError};

/// S3 refuses parts below 5 MiB (except the last).
const MIN_PART: u64 = 5 * 1024 * 1024;
/// ... and more than 10 000 parts.
const MAX_PARTS: i32 = 10_000;
/// DeleteObjects takes at most this many keys.
const DELETE_BATCH: usize = 1000;

mod config;
pub use config::S3Config;

/// See the module docs.
#[derive(Clone, Debug)]
pub struct S3Store {
    client: Client,
    bucket: String,
    prefix: String,
    attempts: u32,
    threshold: usize,
    part_size: usize,
    part_concurrency: usize,
    list_page: i32,
}

impl S3Store {
    /// Builds the client. Nothing is sent yet: a wrong endpoint or missing credentials show up
    /// on the first call.
    pub async fn new(cfg: S3Config) -> Result<S3Store> {
        cfg.check()?;
        // rustls on ring: the same TLS stack as the rest of the workspace, and no C toolchain
        // for aws-lc. Trust roots are the system's.
        let http = aws_smithy_http_client::Builder::new()
            .tls_provider(tls::Provider::Rustls(tls::rustls_provider::CryptoMode::Ring))
            .build_https();
        let retry = RetryConfig::standard()
            .with_max_attempts(cfg.max_attempts)
            .with_initial_backoff(Duration::from_millis(cfg.initial_backoff_ms))
            .with_max_backoff(Duration::from_millis(cfg.max_backoff_ms));
        let timeouts = TimeoutConfig::builder()
            .connect_timeout(Duration::from_millis(cfg.connect_timeout_ms))
            .build();
        let shared = aws_config::defaults(BehaviorVersion::latest())
            .region(Region::new(cfg.region.clone()))
            .http_client(http)
            .retry_config(retry)
            .timeout_config(timeouts)
            .load()
            .await;
        let mut conf = aws_sdk_s3::config::Builder::from(&shared)
            .force_path_style(cfg.path_style)
            .request_checksum_calculation(RequestChecksumCalculation::WhenRequired)
            .response_checksum_validation(ResponseChecksumValidation::WhenRequired);
        if let Some(endpoint) = &cfg.endpoint {
            conf = conf.endpoint_url(endpoint);
        }
        Ok(S3Store {
            client: Client::from_conf(conf.build()),
            bucket: cfg.bucket,
            prefix: cfg.prefix,
            attempts: cfg.max_attempts,
            threshold: cfg.multipart_threshold as usize,
            part_size: cfg.part_size as usize,
            part_concurrency: cfg.part_concurrency,
            list_page: cfg.list_page,
        })
    }

    /// The SDK client this store sends through, with its transport, retry and checksum
    /// settings: for measuring the store against the bare SDK on the same terms.
    pub fn client(&self) -> &Client {
        &self.client
    }

    fn full(&self, key: &Key) -> String {
        format!("{}{}", self.prefix, key)
    }

    fn err<E>(&self, op: &'static str, key: &Key, e: SdkError<E, HttpResponse>) -> StoreError
    where
        E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
    {
        map_err(op, key.as_str(), self.attempts, e)
    }

    /// One `PutObject` of `bytes`.
    async fn put_object(&self, key: &Key, bytes: Bytes) -> Result<u64> {
        let len = bytes.len() as u64;
        self.client
            .put_object()
            .bucket(&self.bucket)
            .key(self.full(key))
            .body(bytes.into())
            .send()
            .await
            .map_err(|e| self.err("put", key, e))?;
        Ok(len)
    }

    async fn put_multipart(
        &self,
        key: &Key,
        mut buf: BytesMut,
        mut body: ByteStream,
    ) -> Result<u64> {
        let full = self.full(key);
        let created = self
            .client
            .create_multipart_upload()
            .bucket(&self.bucket)
            .key(&full)
            .send()
            .await
            .map_err(|e| self.err("put", key, e))?;
        let Some(upload_id) = created.upload_id().map(str::to_string) else {
            return Err(refused("put", key, "CreateMultipartUpload returned no upload id"));
        };
        let guard = AbortUpload {
            client: self.client.clone(),
            bucket: self.bucket.clone(),
            key: full.clone(),
            upload_id: Some(upload_id.clone()),
        };
        // Dropping the set (a failed or dropped put) aborts the part uploads still running.
        let mut tasks: JoinSet<Result<CompletedPart>> = JoinSet::new();
        let mut parts = Vec::new();
        let (mut number, mut total, mut eof) = (0i32, 0u64, false);
        loop {
            while buf.len() >= self.part_size || (eof && !buf.is_empty()) {
                let data = buf.split_to(self.part_size.min(buf.len())).freeze();
                number += 1;
                if number > MAX_PARTS {
                    return Err(refused("put", key, "more than 10000 parts: raise part_size"));
                }
                total += data.len() as u64;
                while tasks.len() >= self.part_concurrency {
                    parts.push(joined(key, tasks.join_next().await)?);
                }
                let part = self.upload_part(key, &full, &upload_id, number, data);
                tasks.spawn(part);
            }
            if eof {
                break;
            }
            match body.next().await {
                Some(item) => buf.extend_from_slice(&item?),
                None => eof = true,
            }
        }
        while let Some(done) = tasks.join_next().await {
            parts.push(joined(key, Some(done))?);
        }
        parts.sort_by_key(|p| p.part_number());
        self.client
            .complete_multipart_upload()
            .bucket(&self.bucket)
            .key(&full)
            .upload_id(&upload_id)
            .multipart_upload(CompletedMultipartUpload::builder().set_parts(Some(parts)).build())
            .send()
            .await
            .map_err(|e| self.err("put", key, e))?;
        guard.disarm();
        Ok(total)
    }

    fn upload_part(
        &self,
        key: &Key,
        full: &str,
        upload_id: &str,
        number: i32,
        data: Bytes,
    ) -> impl std::future::Future<Output = Result<CompletedPart>> + Send + 'static {
        // A `Bytes` body can be replayed, so the SDK's retries cover parts too.
        let request = self
            .client
            .upload_part()
            .bucket(&self.bucket)
            .key(full)
            .upload_id(upload_id)
            .part_number(number)
            .body(data.into());
        let (key, attempts) = (key.clone(), self.attempts);
        async move {
            let out =
                request.send().await.map_err(|e| map_err("put", key.as_str(), attempts, e))?;
            let etag = out.e_tag().unwrap_or_default().to_string();
            Ok(CompletedPart::builder().part_number(number).e_tag(etag).build())
        }
    }
}

type HttpResponse = aws_sdk_s3::config::http::HttpResponse;

#[async_trait]
impl ObjectStore for S3Store {
    fn name(&self) -> String {
        "s3".into()
    }

    async fn put(&self, key: &Key, mut body: ByteStream) -> Result<u64> {
        let mut buf = BytesMut::new();
        while buf.len() < self.threshold {
            match body.next().await {
                Some(item) => buf.extend_from_slice(&item?),
                None => return self.put_object(key, buf.freeze()).await,
            }
        }
        self.put_multipart(key, buf, body).await
    }

    /// A buffer below the multipart threshold (every chunk) is sent as it is, not copied into
    /// a new one first.
    async fn put_bytes(&self, key: &Key, bytes: Bytes) -> Result<u64> {
        if bytes.len() < self.threshold {
            return self.put_object(key, bytes).await;
        }
        self.put(key, crate::object::stream_of(bytes)).await
    }

    async fn get(&self, key: &Key, range: Option<ByteRange>) -> Result<GetObject> {
        let mut req = self.client.get_object().bucket(&self.bucket).key(self.full(key));
        if let Some(r) = range {
            if r.end.is_some_and(|e| e <= r.start) {
                let size = self.head(key).await?.size;
                return Err(StoreError::InvalidRange { key: key.to_string(), range: r, size });
            }
            req = req.range(match r.end {
                Some(end) => format!("bytes={}-{}", r.start, end - 1),
                None => format!("bytes={}-", r.start),
            });
        }
        let out = match req.send().await {
            Ok(out) => out,
            Err(e) if range.is_some() && status_of(&e) == Some(416) => {
                let size = self.head(key).await?.size;
                let range = range.unwrap_or(ByteRange::from(0));
                return Err(StoreError::InvalidRange { key: key.to_string(), range, size });
            }
            Err(e) => return Err(self.err("get", key, e)),
        };
        let len = out.content_length().unwrap_or(0).max(0) as u64;
        let (start, size) = match out.content_range().and_then(parse_content_range) {
            Some((start, size)) => (start, size),
            None => (0, len),
        };
        let meta = ObjectMeta { key: key.clone(), size, modified: modified(out.last_modified()) };
        let (name, attempts) = (key.to_string(), self.attempts);
        let body = futures_util::stream::try_unfold(out.body, move |mut body| {
            let name = name.clone();
            async move {
                match body.try_next().await {
                    Ok(Some(bytes)) => Ok(Some((bytes, body))),
                    Ok(None) => Ok(None),
                    Err(e) => Err(StoreError::Unavailable {
                        op: "get",
                        key: name,
                        attempts,
                        reason: format!("reading the body: {}", DisplayErrorContext(&e)),
                    }),
                }
            }
        });
        Ok(GetObject { meta, start, len, body: Box::pin(body) })
    }

    async fn head(&self, key: &Key) -> Result<ObjectMeta> {
        let out = self
            .client
            .head_object()
            .bucket(&self.bucket)
            .key(self.full(key))
            .send()
            .await
            .map_err(|e| self.err("head", key, e))?;
        Ok(ObjectMeta {
            key: key.clone(),
            size: out.content_length().unwrap_or(0).max(0) as u64,
            modified: modified(out.last_modified()),
        })
    }

    async fn list(&self, prefix: &str, page: Option<&str>) -> Result<ListPage> {
        check_prefix(prefix)?;
        let out = self
            .client
            .list_objects_v2()
            .bucket(&self.bucket)
            .prefix(format!("{}{prefix}", self.prefix))
            .set_continuation_token(page.map(str::to_string))
            .max_keys(self.list_page)
            .send()
            .await
            .map_err(|e| map_err("list", prefix, self.attempts, e))?;
        let objects = out
            .contents()
            .iter()
            .filter_map(|o| {
                // Keys not written through this crate (or outside our prefix) are not ours.
                let key = Key::new(o.key()?.strip_prefix(&self.prefix)?).ok()?;
                let size = o.size().unwrap_or(0).max(0) as u64;
                Some(ObjectMeta { key, size, modified: modified(o.last_modified()) })
            })
            .collect();
        let next = match out.is_truncated() {
            Some(true) => out.next_continuation_token().map(str::to_string),
            _ => None,
        };
        Ok(ListPage { objects, next })
    }

    async fn delete(&self, keys: &[Key]) -> Result<()> {
        for batch in keys.chunks(DELETE_BATCH) {
            let mut ids = Vec::with_capacity(batch.len());
            for key in batch {
                let id = ObjectIdentifier::builder().key(self.full(key)).build();
                ids.push(id.map_err(|e| refused("delete", key, &e.to_string()))?);
            }
            let delete = Delete::builder()
                .set_objects(Some(ids))
                .quiet(true)
                .build()
                .map_err(|e| refused("delete", &batch[0], &e.to_string()))?;
            let out = self
                .client
                .delete_objects()
                .bucket(&self.bucket)
                .delete(delete)
                .send()
                .await
                .map_err(|e| self.err("delete", &batch[0], e))?;
            // Per-key failures come back in the body; a key that is already gone is fine.
            if let Some(e) = out.errors().iter().find(|e| e.code() != Some("NoSuchKey")) {
                return Err(StoreError::Refused {
                    op: "delete",
                    key: e.key().unwrap_or_default().to_string(),
                    reason: format!(
                        "{}: {}",
                        e.code().unwrap_or("?"),
                        e.message().unwrap_or_default()
                    ),
                });
            }
        }
        Ok(())
    }

    async fn touch(&self, key: &Key) -> Result<()> {
        // A copy onto itself with replaced metadata is how S3 renews an object's Last-Modified
        // without moving its bytes through this node.
        let full = self.full(key);
        self.client
            .copy_object()
            .bucket(&self.bucket)
            .key(&full)
            .copy_source(format!("{}/{}", self.bucket, url_encode(&full)))
            .metadata_directive(aws_sdk_s3::types::MetadataDirective::Replace)
            .send()
            .await
            .map_err(|e| self.err("touch", key, e))?;
        Ok(())
    }
}

/// Maps an SDK error to what the caller can act on: missing, worth retrying later, or refused.
fn map_err<E>(
    op: &'static str,
    key: &str,
    attempts: u32,
    e: SdkError<E, HttpResponse>,
) -> StoreError
where
    E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
{
    let key = key.to_string();
    match &e {
        SdkError::ServiceError(service) => {
            let status = service.raw().status().as_u16();
            let code = service.err().code().unwrap_or("");
            let reason =
                format!("HTTP {status} {code}: {}", service.err().message().unwrap_or_default());
            let throttled = matches!(code, "SlowDown" | "Throttling" | "RequestTimeout");
            match status {
                _ if code == "NoSuchBucket" => StoreError::Refused { op, key, reason },
                404 => StoreError::NotFound { key },
                429 | 500.. => StoreError::Unavailable { op, key, attempts, reason },
                _ if throttled => StoreError::Unavailable { op, key, attempts, reason },
                _ => StoreError::Refused { op, key, reason },
            }
        }
        // The request could not be built: a config problem, retrying does not help.
        SdkError::ConstructionFailure(_) => {
            StoreError::Refused { op, key, reason: DisplayErrorContext(&e).to_string() }
        }
        // Connection refused or reset, DNS, timeouts, a garbled response.
        _ => StoreError::Unavailable {
            op,
            key,
            attempts,
            reason: DisplayErrorContext(&e).to_string(),
        },
    }
}

fn status_of<E>(e: &SdkError<E, HttpResponse>) -> Option<u16> {
    match e {
        SdkError::ServiceError(service) => Some(service.raw().status().as_u16()),
        _ => None,
    }
}

fn refused(op: &'static str, key: &Key, reason: &str) -> StoreError {
    StoreError::Refused { op, key: key.to_string(), reason: reason.to_string() }
}

fn joined(
    key: &Key,
    done: Option<std::result::Result<Result<CompletedPart>, tokio::task::JoinError>>,
) -> Result<CompletedPart> {
    let failed = |reason: String| StoreError::Unavailable {
        op: "put",
        key: key.to_string(),
        attempts: 1,
        reason,
    };
    match done {
        Some(Ok(part)) => part,
        Some(Err(e)) => Err(failed(format!("a part upload task failed: {e}"))),
        // Only called while the set is non-empty.
        None => Err(failed("no part upload task to wait for".into())),
    }
}

/// `bytes 10-19/100` → (10, 100).
fn parse_content_range(s: &str) -> Option<(u64, u64)> {
    let rest = s.strip_prefix("bytes ")?;
    let (span, size) = rest.split_once('/')?;
    let (start, _) = span.split_once('-')?;
    Some((start.parse().ok()?, size.parse().ok()?))
}

fn modified(t: Option<&aws_sdk_s3::primitives::DateTime>) -> SystemTime {
    t.and_then(|t| SystemTime::try_from(*t).ok()).unwrap_or(SystemTime::UNIX_EPOCH)
}

/// Percent-encodes everything but unreserved characters and `/` (for `x-amz-copy-source`).
fn url_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' | b'/' => {
                out.push(b as char)
            }
            _ => out.push_str(&format!("%{b:02X}")),
        }
    }
    out
}

/// Aborts a multipart upload unless it was completed: runs on a failed put and on a dropped one.
struct AbortUpload {
    client: Client,
    bucket: String,
    key: String,
    upload_id: Option<String>,
}

impl AbortUpload {
    fn disarm(mut self) {
        self.upload_id = None;
    }
}

impl Drop for AbortUpload {
    fn drop(&mut self) {
        let Some(upload_id) = self.upload_id.take() else { return };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else { return };
        let request = self
            .client
            .abort_multipart_upload()
            .bucket(&self.bucket)
            .key(&self.key)
            .upload_id(upload_id);
        runtime.spawn(async move {
            if let Err(e) = request.send().await {
                tracing::warn!("aborting a multipart upload: {}", DisplayErrorContext(&e));
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_ranges_parse() {
        assert_eq!(parse_content_range("bytes 10-19/100"), Some((10, 100)));
        assert_eq!(parse_content_range("bytes */100"), None);
    }

    #[test]
    fn copy_sources_are_encoded() {
        assert_eq!(url_encode("p/chunks/ab-c.d_~"), "p/chunks/ab-c.d_~");
        assert_eq!(url_encode("a+b=c,d@e:f"), "a%2Bb%3Dc%2Cd%40e%3Af");
    }
}
