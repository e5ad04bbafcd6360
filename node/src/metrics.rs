//! Prometheus metrics, kept as atomics and rendered as text. Hand-written: a handful of counters
//! and one histogram family do not justify a metrics framework.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use crate::claims::Tier;

/// Claim latency buckets, seconds.
const BUCKETS: [f64; 12] =
    [0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 2.5];

#[derive(Debug, Default)]
struct Histogram {
    buckets: [AtomicU64; BUCKETS.len()],
    count: AtomicU64,
    sum_micros: AtomicU64,
}

impl Histogram {
    fn observe(&self, d: Duration) {
        let secs = d.as_secs_f64();
        for (i, le) in BUCKETS.iter().enumerate() {
            if secs <= *le {
                self.buckets[i].fetch_add(1, Relaxed);
            }
        }
        self.count.fetch_add(1, Relaxed);
        self.sum_micros.fetch_add(d.as_micros() as u64, Relaxed);
    }

    fn render(&self, out: &mut String, name: &str, labels: &str) {
        for (i, le) in BUCKETS.iter().enumerate() {
            let _ = writeln!(
                out,
                "{name}_bucket{{{labels},le=\"{le}\"}} {}",
                self.buckets[i].load(Relaxed)
            );
        }
        let count = self.count.load(Relaxed);
        let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {count}");
        let _ =
            writeln!(out, "{name}_sum{{{labels}}} {}", self.sum_micros.load(Relaxed) as f64 / 1e6);
        let _ = writeln!(out, "{name}_count{{{labels}}} {count}");
    }
}

/// A gauge family computed at render time: (name, help, [(labels, value)]).
pub type Gauge<'a> = (&'a str, &'a str, Vec<(String, u64)>);

#[derive(Debug, Default)]
pub struct Metrics {
    claims: [AtomicU64; 3],
    claim_latency: [Histogram; 3],
    pub released: AtomicU64,
    pub expired: AtomicU64,
    pub refill_failures: AtomicU64,
    pub relay_bytes: AtomicU64,
    pub execs: AtomicU64,
    pub hibernated: AtomicU64,
    pub gc_deleted_chunks: AtomicU64,
    pub orphan_archives: AtomicU64,
    pub gc_deleted_bytes: AtomicU64,
    pub restarted: AtomicU64,
    pub woken: AtomicU64,
    pub archived: AtomicU64,
    pub checkpoints: AtomicU64,
    pub branched: AtomicU64,
    pub branched_from_copies: AtomicU64,
    pub forked: AtomicU64,
    pub promoted: AtomicU64,
    pub placed_on_peers: AtomicU64,
    pub golden_builds: AtomicU64,
    pub moved: AtomicU64,
    pub golden_downloads: AtomicU64,
    pub owner_lookups: AtomicU64,
    pub lookups_limited: AtomicU64,
    pub e2b_forwarded: AtomicU64,
}

impl Metrics {
    pub fn claimed(&self, tier: Tier, took: Duration) {
        self.claims[tier as usize].fetch_add(1, Relaxed);
        self.claim_latency[tier as usize].observe(took);
    }

    /// The text exposition, with gauges supplied by the caller: (name, help, [(labels, value)]).
    pub fn render(&self, gauges: &[Gauge<'_>]) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "# HELP silkmesh_claims_total Claims served, by tier.\n# TYPE silkmesh_claims_total counter"
        );
        for tier in Tier::ALL {
            let _ = writeln!(
                out,
                "silkmesh_claims_total{{tier=\"{}\"}} {}",
                tier.name(),
                self.claims[tier as usize].load(Relaxed)
            );
        }
        let _ = writeln!(
            out,
            "# HELP silkmesh_claim_seconds Claim latency, request to usable sandbox, by tier.\n# TYPE silkmesh_claim_seconds histogram"
        );
        for tier in Tier::ALL {
            self.claim_latency[tier as usize].render(
                &mut out,
                "silkmesh_claim_seconds",
                &format!("tier=\"{}\"", tier.name()),
            );
        }
        for (name, help, value) in [
            (
                "silkmesh_released_total",
                "Sandboxes released (by a client or a lease).",
                &self.released,
            ),
            ("silkmesh_expired_total", "Leases that ran out.", &self.expired),
            (
                "silkmesh_refill_failures_total",
                "Warm-pool starts that failed.",
                &self.refill_failures,
            ),
            (
                "silkmesh_relay_bytes_total",
                "Bytes carried by the agent relay, both ways.",
                &self.relay_bytes,
            ),
            ("silkmesh_exec_total", "Buffered exec calls.", &self.execs),
            ("silkmesh_hibernated_total", "Sandboxes hibernated.", &self.hibernated),
            (
                "silkmesh_store_gc_deleted_chunks_total",
                "Chunks no snapshot named, deleted by this node's store GC.",
                &self.gc_deleted_chunks,
            ),
            (
                "silkmesh_store_gc_deleted_bytes_total",
                "Bytes of those chunks.",
                &self.gc_deleted_bytes,
            ),
            (
                "silkmesh_store_orphan_archives_deleted_total",
                "Archives older than the grace period that no claim named, deleted.",
                &self.orphan_archives,
            ),
            (
                "silkmesh_restarted_total",
                "Sandboxes restarted from their files after their silkd died.",
                &self.restarted,
            ),
            (
                "silkmesh_woken_total",
                "Sandboxes woken (from hibernation or an archive).",
                &self.woken,
            ),
            ("silkmesh_archived_total", "Sandboxes archived to the store.", &self.archived),
            ("silkmesh_checkpoints_total", "Checkpoints taken.", &self.checkpoints),
            ("silkmesh_branched_total", "Sandboxes branched from checkpoints.", &self.branched),
            (
                "silkmesh_branched_from_copies_total",
                "Of those, sandboxes started from a checkpoint's copy kept on this node.",
                &self.branched_from_copies,
            ),
            ("silkmesh_forked_total", "Sandboxes made by fork.", &self.forked),
            ("silkmesh_promoted_total", "Templates promoted.", &self.promoted),
            (
                "silkmesh_golden_builds_total",
                "Goldens built here (warmup run).",
                &self.golden_builds,
            ),
            (
                "silkmesh_golden_downloads_total",
                "Goldens fetched from the shared store instead of built.",
                &self.golden_downloads,
            ),
            (
                "silkmesh_claims_placed_on_peers_total",
                "Claims redirected or forwarded to a peer with warm capacity.",
                &self.placed_on_peers,
            ),
            (
                "silkmesh_owner_lookups_total",
                "Calls on sandboxes held elsewhere for which this node asked its peers who holds them.",
                &self.owner_lookups,
            ),
            (
                "silkmesh_owner_lookups_limited_total",
                "Such lookups refused (429) by the per-client rate limit.",
                &self.lookups_limited,
            ),
            (
                "silkmesh_e2b_forwarded_total",
                "E2B API calls on sandboxes held by a peer, forwarded to it through the mesh.",
                &self.e2b_forwarded,
            ),
        ] {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}",
                value.load(Relaxed)
            );
        }
        for (name, help, values) in gauges {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge");
            for (labels, v) in values {
                if labels.is_empty() {
                    let _ = writeln!(out, "{name} {v}");
                } else {
                    let _ = writeln!(out, "{name}{{{labels}}} {v}");
                }
            }
        }
        out
    }
}
