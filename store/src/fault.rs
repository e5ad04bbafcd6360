//! A fault-injecting wrapper around any [`ObjectStore`], for tests: fail the next N calls, add
//! latency to every call, fail calls whose key matches a pattern. It also counts the calls that
//! got through (and the bytes put) and the most calls under way at once, and lets a test wait on
//! those counts — a signal, not a sleep.
//!
//! Injected failures are [`StoreError::Unavailable`], what a real outage looks like after the
//! backend's own retries.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use regex::Regex;
use tokio::sync::watch;

use crate::{ByteRange, ByteStream, GetObject, Key, ListPage, ObjectMeta, ObjectStore};
use crate::{Result, StoreError};

/// The operations of the trait, for targeting faults.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Put,
    Get,
    Head,
    List,
    Delete,
    Touch,
}

/// Calls that reached the inner store and succeeded, per operation, plus injected failures.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    pub puts: u64,
    pub gets: u64,
    pub heads: u64,
    pub lists: u64,
    pub deletes: u64,
    pub touches: u64,
    /// Bytes written by successful puts.
    pub put_bytes: u64,
    /// Calls failed on purpose.
    pub injected: u64,
    /// The most puts under way at once, and the most calls of any kind.
    pub peak_puts: u64,
    pub peak_calls: u64,
}

/// Calls under way now.
#[derive(Debug, Default)]
struct InFlight {
    puts: u64,
    calls: u64,
}

#[derive(Debug, Default)]
struct Faults {
    fail_next: u32,
    latency: Duration,
    fail_keys: Option<(Regex, Option<Op>)>,
}

/// See the module docs.
#[derive(Debug)]
pub struct FaultStore {
    inner: Arc<dyn ObjectStore>,
    faults: Mutex<Faults>,
    counts: watch::Sender<Counts>,
    in_flight: Mutex<InFlight>,
}

/// One call under way: counted in [`FaultStore::in_flight`] until dropped.
struct Underway<'a> {
    store: &'a FaultStore,
    put: bool,
}

impl Drop for Underway<'_> {
    fn drop(&mut self) {
        let mut now = self.store.in_flight.lock().unwrap_or_else(|e| e.into_inner());
        now.calls -= 1;
        now.puts -= u64::from(self.put);
    }
}

impl FaultStore {
    /// A transparent wrapper: no faults until some are set.
    pub fn new(inner: Arc<dyn ObjectStore>) -> FaultStore {
        FaultStore {
            inner,
            faults: Mutex::new(Faults::default()),
            counts: watch::Sender::new(Counts::default()),
            in_flight: Mutex::default(),
        }
    }

    /// The next `n` calls (of any operation) fail.
    pub fn fail_next(&self, n: u32) {
        self.faults().fail_next = n;
    }

    /// Every call waits this long before it reaches the inner store.
    pub fn set_latency(&self, latency: Duration) {
        self.faults().latency = latency;
    }

    /// Calls whose key matches `pattern` (a regex; a list's prefix, any key of a delete) fail,
    /// for one operation or all. Panics on an invalid pattern: this is a test helper.
    pub fn fail_keys(&self, pattern: &str, op: Option<Op>) {
        let re = Regex::new(pattern).unwrap_or_else(|e| panic!("bad fault pattern {pattern}: {e}"));
        self.faults().fail_keys = Some((re, op));
    }

    /// Removes every fault.
    pub fn clear(&self) {
        *self.faults() = Faults::default();
    }

    pub fn counts(&self) -> Counts {
        self.counts.borrow().clone()
    }

    /// Waits until `done` holds for the counts.
    pub async fn wait_for(&self, done: impl Fn(&Counts) -> bool) {
        let mut rx = self.counts.subscribe();
        // The sender lives in `self`, so the channel cannot close while we wait.
        let _ = rx.wait_for(|c| done(c)).await;
    }

    fn faults(&self) -> MutexGuard<'_, Faults> {
        // A panic while holding this lock leaves plain data behind; keep going.
        self.faults.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Counts a call as under way until the guard is dropped, and its peaks.
    fn underway(&self, op: Op) -> Underway<'_> {
        let put = op == Op::Put;
        let (puts, calls) = {
            let mut now = self.in_flight.lock().unwrap_or_else(|e| e.into_inner());
            now.calls += 1;
            now.puts += u64::from(put);
            (now.puts, now.calls)
        };
        self.count(|c| {
            c.peak_puts = c.peak_puts.max(puts);
            c.peak_calls = c.peak_calls.max(calls);
        });
        Underway { store: self, put }
    }

    /// Applies latency, then decides whether this call fails.
    async fn enter(&self, op: Op, keys: &[&str]) -> Result<()> {
        let latency = self.faults().latency;
        if !latency.is_zero() {
            tokio::time::sleep(latency).await;
        }
        let fail = {
            let mut f = self.faults();
            let by_key = f.fail_keys.as_ref().is_some_and(|(re, only)| {
                only.is_none_or(|o| o == op) && keys.iter().any(|k| re.is_match(k))
            });
            if f.fail_next > 0 {
                f.fail_next -= 1;
                true
            } else {
                by_key
            }
        };
        if fail {
            self.counts.send_modify(|c| c.injected += 1);
            return Err(StoreError::Unavailable {
                op: op_name(op),
                key: keys.first().map_or(String::new(), |k| k.to_string()),
                attempts: 1,
                reason: "injected fault".into(),
            });
        }
        Ok(())
    }

    fn count(&self, f: impl FnOnce(&mut Counts)) {
        self.counts.send_modify(f);
    }
}

fn op_name(op: Op) -> &'static str {
    match op {
        Op::Put => "put",
        Op::Get => "get",
        Op::Head => "head",
        Op::List => "list",
        Op::Delete => "delete",
        Op::Touch => "touch",
    }
}

#[async_trait]
impl ObjectStore for FaultStore {
    fn name(&self) -> String {
        format!("fault({})", self.inner.name())
    }

    async fn put(&self, key: &Key, body: ByteStream) -> Result<u64> {
        let _underway = self.underway(Op::Put);
        self.enter(Op::Put, &[key.as_str()]).await?;
        let n = self.inner.put(key, body).await?;
        self.count(|c| {
            c.puts += 1;
            c.put_bytes += n;
        });
        Ok(n)
    }

    async fn get(&self, key: &Key, range: Option<ByteRange>) -> Result<GetObject> {
        let _underway = self.underway(Op::Get);
        self.enter(Op::Get, &[key.as_str()]).await?;
        let got = self.inner.get(key, range).await?;
        self.count(|c| c.gets += 1);
        Ok(got)
    }

    async fn head(&self, key: &Key) -> Result<ObjectMeta> {
        let _underway = self.underway(Op::Head);
        self.enter(Op::Head, &[key.as_str()]).await?;
        let meta = self.inner.head(key).await?;
        self.count(|c| c.heads += 1);
        Ok(meta)
    }

    async fn list(&self, prefix: &str, page: Option<&str>) -> Result<ListPage> {
        let _underway = self.underway(Op::List);
        self.enter(Op::List, &[prefix]).await?;
        let got = self.inner.list(prefix, page).await?;
        self.count(|c| c.lists += 1);
        Ok(got)
    }

    async fn delete(&self, keys: &[Key]) -> Result<()> {
        let names: Vec<&str> = keys.iter().map(Key::as_str).collect();
        let _underway = self.underway(Op::Delete);
        self.enter(Op::Delete, &names).await?;
        self.inner.delete(keys).await?;
        self.count(|c| c.deletes += 1);
        Ok(())
    }

    async fn touch(&self, key: &Key) -> Result<()> {
        let _underway = self.underway(Op::Touch);
        self.enter(Op::Touch, &[key.as_str()]).await?;
        self.inner.touch(key).await?;
        self.count(|c| c.touches += 1);
        Ok(())
    }
}
