//! The usage journal: sandbox-seconds of running sandboxes per tenant, size and lane, metered
//! every `usage_interval_seconds` and at release, appended to `<data_dir>/usage/usage.log` (one
//! JSON line per bucket and interval). Each line carries the time it metered up to; a node that
//! restarts meters its sandboxes on from the last such time, so the time it was down (its
//! sandboxes kept running) is counted, and a kill -9 loses at most the interval in progress.
//!
//! The sandbox-seconds of each tenant this calendar month (UTC) are kept in memory too (read
//! back from the journal at start): quotas and gossip read them without touching the disk.

use std::collections::{BTreeMap, HashMap};
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};
use silk_api::{Lane, Size};

const FILE: &str = "usage.log";

/// One metered bucket: `sandbox_seconds` of running sandboxes of `tenant` (none: root's) of
/// one size and lane, between `from_ms` and `to_ms`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UsageLine {
    pub from_ms: u64,
    pub to_ms: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    pub size: Size,
    pub lane: Lane,
    pub sandbox_seconds: u64,
}

/// A claimed sandbox as the meter sees it.
#[derive(Debug, Clone)]
pub struct Running {
    pub id: String,
    pub tenant: Option<String>,
    pub size: Size,
    pub lane: Lane,
    /// Since when it has run (its claim, or its last wake).
    pub since_ms: u64,
    /// When it stopped running (hibernated, archived), if it has.
    pub until_ms: Option<u64>,
}

#[derive(Debug)]
pub struct Usage {
    path: PathBuf,
    state: Mutex<Meter>,
}

#[derive(Debug, Default)]
struct Meter {
    /// What the last meter covered up to, per sandbox (fresh sandboxes start at their claim).
    metered: HashMap<String, u64>,
    /// Up to when the journal has metered everything (the last line's `to_ms`).
    journal_to_ms: u64,
    /// Sandbox-seconds per tenant in the month that `month` names.
    month: (i64, u32),
    this_month: BTreeMap<String, u64>,
}

/// The calendar month (UTC) of a unix-milliseconds time, as (year, month).
pub fn month_of(ms: u64) -> (i64, u32) {
    // Days since 1970-01-01 to a civil date (Howard Hinnant's algorithm).
    let days = (ms / 86_400_000) as i64;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month)
}

/// The first millisecond of the calendar month (UTC) `ms` falls in.
pub fn month_start(ms: u64) -> u64 {
    let month = month_of(ms);
    // At most 31 days back, a day at a time: cheap, and no calendar arithmetic to get wrong.
    let mut day = ms - ms % 86_400_000;
    while day >= 86_400_000 && month_of(day - 86_400_000) == month {
        day -= 86_400_000;
    }
    day
}

impl Usage {
    /// Opens the journal in `dir`, reading back this month's totals and how far it metered.
    pub fn open(dir: &Path, now_ms: u64) -> std::io::Result<Usage> {
        std::fs::create_dir_all(dir)?;
        let path = dir.join(FILE);
        let mut meter = Meter { month: month_of(now_ms), ..Meter::default() };
        if let Ok(file) = File::open(&path) {
            for line in BufReader::new(file).lines() {
                // A line cut by a crash is the one thing the journal can lose.
                let Ok(l) = serde_json::from_str::<UsageLine>(&line?) else { continue };
                meter.journal_to_ms = meter.journal_to_ms.max(l.to_ms);
                if let Some(t) = l.tenant.as_ref().filter(|_| month_of(l.to_ms) == meter.month) {
                    *meter.this_month.entry(t.clone()).or_default() += l.sandbox_seconds;
                }
            }
        }
        Ok(Usage { path, state: Mutex::new(meter) })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Meter> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Meters `running` up to `now_ms`, or up to when each stopped (each from where its last
    /// meter ended, or from when it started running, or from where the journal ended before
    /// this start), and appends the buckets. `released`: sandboxes metered for the last time.
    pub fn meter(
        &self,
        running: &[Running],
        released: &[String],
        now_ms: u64,
    ) -> std::io::Result<()> {
        let mut m = self.lock();
        if month_of(now_ms) != m.month {
            m.month = month_of(now_ms);
            m.this_month.clear();
        }
        let mut buckets: BTreeMap<(Option<String>, Size, Lane), (u64, u64)> = BTreeMap::new();
        let floor = m.journal_to_ms;
        for r in running {
            let last = match (m.metered.get(&r.id), r.until_ms) {
                (Some(&last), _) => last,
                // Stopped before any meter saw it run here: metered when it stopped, or never.
                (None, Some(_)) => continue,
                (None, None) => r.since_ms.max(floor),
            };
            let from = last.max(r.since_ms);
            let to = r.until_ms.map_or(now_ms, |u| u.min(now_ms));
            match r.until_ms {
                Some(_) => m.metered.remove(&r.id),
                None => m.metered.insert(r.id.clone(), now_ms),
            };
            if to <= from {
                continue;
            }
            let b = buckets.entry((r.tenant.clone(), r.size, r.lane)).or_insert((from, 0));
            b.0 = b.0.min(from);
            b.1 += to - from;
        }
        for id in released {
            m.metered.remove(id);
        }
        let mut text = String::new();
        for ((tenant, size, lane), (from_ms, ms)) in buckets {
            let seconds = ms.div_ceil(1000);
            if let Some(t) = &tenant {
                *m.this_month.entry(t.clone()).or_default() += seconds;
            }
            let line =
                UsageLine { from_ms, to_ms: now_ms, tenant, size, lane, sandbox_seconds: seconds };
            text.push_str(&serde_json::to_string(&line).map_err(std::io::Error::other)?);
            text.push('\n');
        }
        m.journal_to_ms = now_ms;
        if !text.is_empty() {
            // One write per meter: a kill -9 leaves whole lines (and at worst a cut last one).
            OpenOptions::new()
                .create(true)
                .append(true)
                .open(&self.path)?
                .write_all(text.as_bytes())?;
        }
        Ok(())
    }

    /// Sandbox-seconds of `tenant` this calendar month, on this node.
    pub fn month_seconds(&self, tenant: &str) -> u64 {
        self.lock().this_month.get(tenant).copied().unwrap_or(0)
    }

    /// Every tenant's sandbox-seconds this month, on this node (what it gossips).
    pub fn month_totals(&self) -> BTreeMap<String, u64> {
        self.lock().this_month.clone()
    }

    /// The lines whose interval ends in `[from_ms, to_ms)` and whose tenant `keep` accepts.
    pub fn read(
        &self,
        from_ms: u64,
        to_ms: u64,
        keep: impl Fn(Option<&str>) -> bool,
    ) -> std::io::Result<Vec<UsageLine>> {
        let Ok(file) = File::open(&self.path) else { return Ok(vec![]) };
        let mut out = vec![];
        for line in BufReader::new(file).lines() {
            let Ok(l) = serde_json::from_str::<UsageLine>(&line?) else { continue };
            if (from_ms..to_ms).contains(&l.to_ms) && keep(l.tenant.as_deref()) {
                out.push(l);
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn running(id: &str, tenant: Option<&str>, since_ms: u64) -> Running {
        Running {
            id: id.into(),
            tenant: tenant.map(Into::into),
            size: Size::Small,
            lane: Lane::None,
            since_ms,
            until_ms: None,
        }
    }

    #[test]
    fn months_are_calendar_months_in_utc() {
        assert_eq!(month_start(1_796_172_298_376), 1_796_083_200_000);
        assert_eq!(month_start(1_709_251_199_000), 1_706_745_600_000); // 2024-02-01
        assert_eq!(month_of(0), (1970, 1));
        assert_eq!(month_of(1_709_251_199_000), (2024, 2)); // 2024-02-29T23:59:59Z
        assert_eq!(month_of(1_709_251_200_000), (2024, 3));
        assert_eq!(month_of(1_796_083_200_000), (2026, 12)); // 2026-12-01T00:00:00Z
    }

    #[test]
    fn seconds_add_up_per_bucket_and_a_restart_meters_on_from_the_journal() {
        let dir = tempfile::tempdir().unwrap();
        let t0 = 1_796_083_200_000;
        let u = Usage::open(dir.path(), t0).unwrap();
        let sandboxes = [
            running("a", Some("team"), t0),
            running("b", Some("team"), t0),
            running("c", None, t0),
        ];
        u.meter(&sandboxes, &[], t0 + 60_000).unwrap();
        assert_eq!(u.month_seconds("team"), 120);
        u.meter(&sandboxes[..1], &["b".into()], t0 + 90_000).unwrap();
        assert_eq!(u.month_seconds("team"), 150);
        drop(u);
        // Down for a minute; the sandbox ran on: the next meter counts that minute too.
        let u = Usage::open(dir.path(), t0 + 150_000).unwrap();
        assert_eq!(u.month_seconds("team"), 150);
        u.meter(&sandboxes[..1], &[], t0 + 150_000).unwrap();
        assert_eq!(u.month_seconds("team"), 210);
        // Hibernated 30 s after that meter: counted up to then, and not after.
        let stopped = Running { until_ms: Some(t0 + 180_000), ..running("a", Some("team"), t0) };
        u.meter(std::slice::from_ref(&stopped), &[], t0 + 240_000).unwrap();
        u.meter(&[stopped], &[], t0 + 300_000).unwrap();
        assert_eq!(u.month_seconds("team"), 240);
        let lines = u.read(0, u64::MAX, |t| t == Some("team")).unwrap();
        assert_eq!(lines.iter().map(|l| l.sandbox_seconds).sum::<u64>(), 240);
        assert_eq!(u.read(0, u64::MAX, |t| t.is_none()).unwrap()[0].sandbox_seconds, 60);
        assert!(
            u.read(t0 + 100_000, u64::MAX, |_| true)
                .unwrap()
                .iter()
                .all(|l| l.to_ms >= t0 + 100_000)
        );
    }
}
