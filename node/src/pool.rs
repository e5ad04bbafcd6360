//! Warm pools: bookkeeping only, no I/O, time passed in — so the adaptive target and the backoff
//! are tested without sandboxes or clocks.
//!
//! A pool keeps `target` sandboxes ready. The target starts at the configured `warm`; every
//! claim that finds the pool empty raises it by one, up to `warm_max`; after a quiet minute (no
//! miss) it steps back down towards `warm`. Failed starts back off exponentially (0.2 s doubling
//! to 30 s) so a broken template does not spin.

use std::collections::VecDeque;
use std::fmt;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use silk_engine::{BoxInfo, Lane, Size};

const QUIET: Duration = Duration::from_secs(60);
const BACKOFF_FIRST: Duration = Duration::from_millis(200);
const BACKOFF_MAX: Duration = Duration::from_secs(30);

#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct PoolKey {
    pub template: String,
    pub size: Size,
    pub lane: Lane,
}

impl fmt::Display for PoolKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let size = serde_json::to_value(self.size).ok();
        let lane = serde_json::to_value(self.lane).ok();
        let text = |v: Option<serde_json::Value>| {
            v.and_then(|v| v.as_str().map(str::to_string)).unwrap_or_default()
        };
        write!(f, "{}/{}/{}", self.template, text(size), text(lane))
    }
}

/// `T` is what a ready sandbox is kept as: the node keeps its [`BoxInfo`] with a connection
/// to its silkd; the tests here, the bare `BoxInfo`.
#[derive(Debug)]
pub struct Pool<T = BoxInfo> {
    pub key: PoolKey,
    pub warm: usize,
    pub warm_max: usize,
    /// Claims of this pool hibernate after this long idle.
    pub idle_hibernate: Option<u64>,
    /// What idle hibernation and `on_expire: archive` do with its claims' memory.
    pub memory: silk_api::Memory,
    /// Its sandboxes clone the template's memory golden.
    pub memory_golden: bool,
    /// Lane `egress`: its claims' policy (`None`: the node's default).
    pub egress: Option<silk_api::EgressPolicy>,
    pub target: usize,
    pub ready: VecDeque<T>,
    /// Starts in flight.
    pub starting: usize,
    /// Bumped by `flush`: a start begun before it may carry the old base.
    generation: u64,
    failures: u32,
    retry_at: Option<Instant>,
    last_miss: Option<Instant>,
    last_decay: Option<Instant>,
}

impl<T> Pool<T> {
    pub fn new(key: PoolKey, warm: usize, warm_max: usize) -> Pool<T> {
        Pool {
            key,
            warm,
            warm_max: warm_max.max(warm),
            idle_hibernate: None,
            memory: silk_api::Memory::Auto,
            memory_golden: false,
            egress: None,
            target: warm,
            ready: VecDeque::new(),
            starting: 0,
            generation: 0,
            failures: 0,
            retry_at: None,
            last_miss: None,
            last_decay: None,
        }
    }

    /// Takes a ready sandbox, or records a miss (raising the target).
    pub fn take(&mut self, now: Instant) -> Option<T> {
        let got = self.ready.pop_front();
        if got.is_none() {
            self.target = (self.target + 1).min(self.warm_max);
            self.last_miss = Some(now);
        }
        got
    }

    /// How many starts to begin now.
    pub fn wanted(&mut self, now: Instant) -> usize {
        self.decay(now);
        if self.retry_at.is_some_and(|t| now < t) {
            return 0;
        }
        self.target.saturating_sub(self.ready.len() + self.starting)
    }

    fn decay(&mut self, now: Instant) {
        let quiet_since = self.last_miss.max(self.last_decay);
        if self.target > self.warm && quiet_since.is_none_or(|t| now.duration_since(t) >= QUIET) {
            self.target -= 1;
            self.last_decay = Some(now);
        }
    }

    /// What a start begun now passes back to `started`.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// A start of `generation` finished. A sandbox begun before the last `flush` is handed back,
    /// to be torn down: it may run on the old base.
    pub fn started(&mut self, info: T, generation: u64) -> Option<T> {
        self.starting = self.starting.saturating_sub(1);
        if generation != self.generation {
            return Some(info);
        }
        self.failures = 0;
        self.retry_at = None;
        self.ready.push_back(info);
        None
    }

    /// Empties the pool after its template's base changed (a promote replaced it): returns the
    /// ready sandboxes to tear down, and makes `started` refuse the starts in flight.
    pub fn flush(&mut self) -> Vec<T> {
        self.generation += 1;
        self.ready.drain(..).collect()
    }

    pub fn start_failed(&mut self, now: Instant) {
        self.starting = self.starting.saturating_sub(1);
        let backoff = BACKOFF_FIRST.saturating_mul(1 << self.failures.min(10)).min(BACKOFF_MAX);
        self.failures += 1;
        self.retry_at = Some(now + backoff);
    }

    /// Backoff remaining, for `/v1/info`.
    pub fn backing_off(&self, now: Instant) -> bool {
        self.retry_at.is_some_and(|t| now < t)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use silk_engine::{AgentAddr, Base, BoxSpec, Digest, Template};

    fn info() -> BoxInfo {
        let template = Template {
            name: "t".into(),
            digest: "d".repeat(64).parse::<Digest>().unwrap(),
            root: "/".into(),
            binds: vec![],
            env: vec![],
            cwd: None,
            user: None,
        };
        BoxInfo {
            id: "x".parse().unwrap(),
            base: Base { template, golden: None },
            spec: BoxSpec::new(Size::Small, Lane::None),
            agent: AgentAddr::Unix("/x".into()),
            pid: None,
            running: true,
            created_ms: 0,
            memory: Default::default(),
            address: None,
        }
    }

    fn pool(warm: usize, max: usize) -> Pool {
        Pool::new(PoolKey { template: "t".into(), size: Size::Small, lane: Lane::None }, warm, max)
    }

    #[test]
    fn misses_raise_the_target_to_the_ceiling_and_quiet_lowers_it() {
        let t0 = Instant::now();
        let mut p = pool(2, 4);
        assert_eq!(p.wanted(t0), 2);
        p.starting = 2;
        for _ in 0..5 {
            assert!(p.take(t0).is_none());
        }
        assert_eq!(p.target, 4, "capped at warm_max");
        assert_eq!(p.wanted(t0), 2);
        assert_eq!(p.wanted(t0 + Duration::from_secs(30)), 2, "not quiet yet");
        p.wanted(t0 + QUIET);
        assert_eq!(p.target, 3);
        p.wanted(t0 + QUIET + Duration::from_secs(1));
        assert_eq!(p.target, 3, "one step per quiet minute");
        p.wanted(t0 + 2 * QUIET);
        p.wanted(t0 + 3 * QUIET);
        assert_eq!(p.target, 2, "never below warm");
    }

    #[test]
    fn failures_back_off_exponentially_and_success_resets() {
        let t0 = Instant::now();
        let mut p = pool(1, 1);
        p.starting = 1;
        p.start_failed(t0);
        assert_eq!(p.wanted(t0), 0);
        assert_eq!(p.wanted(t0 + BACKOFF_FIRST), 1);
        p.starting = 1;
        p.start_failed(t0);
        assert_eq!(p.wanted(t0 + BACKOFF_FIRST), 0, "second failure waits twice as long");
        assert_eq!(p.wanted(t0 + 2 * BACKOFF_FIRST), 1);
        p.starting = 1;
        assert!(p.started(info(), p.generation()).is_none());
        assert_eq!(p.wanted(t0), 0, "full");
        assert!(p.take(t0).is_some());
        assert_eq!(p.wanted(t0), 1, "refill after a hit, no backoff left");
    }

    #[test]
    fn a_flush_drops_the_ready_and_refuses_the_starts_in_flight() {
        let t0 = Instant::now();
        let mut p = pool(2, 2);
        assert_eq!(p.wanted(t0), 2);
        p.starting = 2;
        let before = p.generation();
        assert!(p.started(info(), before).is_none());
        assert_eq!(p.flush().len(), 1, "the ready one goes");
        assert!(p.started(info(), before).is_some(), "begun on the old base: handed back");
        assert_eq!((p.ready.len(), p.starting), (0, 0));
        assert_eq!(p.wanted(t0), 2, "both are started again, without backoff");
        p.starting = 2;
        assert!(p.started(info(), p.generation()).is_none());
        assert_eq!(p.ready.len(), 1);
    }
}
