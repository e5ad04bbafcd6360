//! Limits on what one request can cost. Per client: the work a request makes this node do
//! elsewhere — finding which node holds a sandbox asks peers (and, when none does, the store) —
//! through a token bucket per client address, in memory; an unknown id is cheap for the client
//! to send and must not be expensive for the fleet to answer. Per request: a body past the
//! limit is refused before any handler runs, in a way its client can read.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use axum::extract::{Request, State};
use axum::http::header;
use axum::response::{IntoResponse, Response};

use crate::error::{Code, NodeError};

/// Clients tracked at once; past this the idle ones are forgotten (and, under a flood from
/// more addresses than this, every one: limits restart rather than memory growing).
const MAX_CLIENTS: usize = 16_384;

#[derive(Debug)]
pub struct PerClient {
    /// Tokens added per second.
    per_second: f64,
    burst: f64,
    buckets: Mutex<HashMap<IpAddr, Bucket>>,
}

#[derive(Debug, Clone, Copy)]
struct Bucket {
    tokens: f64,
    at: Instant,
}

impl PerClient {
    /// `per_minute` sustained, `burst` at once; 0 per minute turns the limit off.
    pub fn new(per_minute: u32, burst: u32) -> PerClient {
        PerClient {
            per_second: f64::from(per_minute) / 60.0,
            burst: f64::from(burst.max(1)),
            buckets: Mutex::new(HashMap::new()),
        }
    }

    /// Takes one token from `client`'s bucket, if it has one.
    pub fn allow(&self, client: IpAddr) -> bool {
        self.allow_at(client, Instant::now())
    }

    fn allow_at(&self, client: IpAddr, now: Instant) -> bool {
        if self.per_second == 0.0 {
            return true;
        }
        let mut buckets = self.buckets.lock().unwrap_or_else(|e| e.into_inner());
        if buckets.len() >= MAX_CLIENTS && !buckets.contains_key(&client) {
            // A bucket refilled to full says nothing a new one would not.
            let full = Duration::from_secs_f64(self.burst / self.per_second);
            buckets.retain(|_, b| now.saturating_duration_since(b.at) < full);
            if buckets.len() >= MAX_CLIENTS {
                buckets.clear();
            }
        }
        let bucket = buckets.entry(client).or_insert(Bucket { tokens: self.burst, at: now });
        let refill = now.saturating_duration_since(bucket.at).as_secs_f64() * self.per_second;
        bucket.tokens = (bucket.tokens + refill).min(self.burst);
        bucket.at = now;
        if bucket.tokens < 1.0 {
            return false;
        }
        bucket.tokens -= 1.0;
        true
    }
}

/// How much of a refused body is read (and dropped) so that its client, still writing, gets
/// to read the `413`: a client that is cut off mid-write sees a broken pipe, not the answer.
const DRAIN_MAX_BYTES: u64 = 64 << 20;
const DRAIN_MAX_TIME: Duration = Duration::from_secs(10);

/// A body whose declared length is past the limit is refused before any handler runs: read
/// to its end (within [`DRAIN_MAX_BYTES`] and [`DRAIN_MAX_TIME`]) and answered `413` on a
/// connection that then closes. A chunked body past the limit is refused by the extractor
/// that reads it, without this courtesy.
pub(super) async fn refuse_oversized(
    State(limit): State<usize>,
    req: Request,
    next: axum::middleware::Next,
) -> Response {
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    let Some(length) = declared.filter(|&n| n > limit as u64) else {
        return next.run(req).await;
    };
    if length <= DRAIN_MAX_BYTES {
        let mut body = req.into_body();
        let drain = async {
            use http_body_util::BodyExt;
            while let Some(Ok(_)) = body.frame().await {}
        };
        let _ = tokio::time::timeout(DRAIN_MAX_TIME, drain).await;
    }
    let refused = NodeError::new(
        Code::PayloadTooLarge,
        format!("the body is {length} bytes; this node takes at most {limit}"),
    );
    let mut res = refused.into_response();
    res.headers_mut().insert(header::CONNECTION, axum::http::HeaderValue::from_static("close"));
    res
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_client_gets_its_burst_then_the_rate_and_others_are_unaffected() {
        let limit = PerClient::new(600, 5);
        let (a, b) = ("10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap());
        let t = Instant::now();
        assert_eq!((0..8).filter(|_| limit.allow_at(a, t)).count(), 5);
        assert!(limit.allow_at(b, t), "another client has its own bucket");
        assert!(!limit.allow_at(a, t + Duration::from_millis(50)));
        assert!(limit.allow_at(a, t + Duration::from_millis(100)), "refilled at 10/s");
        assert!(PerClient::new(0, 0).allow_at(a, t), "0 per minute is off");
    }

    #[test]
    fn memory_is_bounded_by_the_number_of_clients() {
        let limit = PerClient::new(60, 1);
        let t = Instant::now();
        for i in 0..(MAX_CLIENTS as u32 + 10) {
            limit.allow_at(IpAddr::from(i.to_be_bytes()), t);
        }
        assert!(limit.buckets.lock().unwrap().len() <= MAX_CLIENTS);
    }
}
