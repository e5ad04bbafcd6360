//! Starts a claim waits for, and the pools' refills that give way to them. On a node with few
//! cores a refill's clone beside a claim's clone slows both (on 2 cores, a pool miss right
//! after a warm claim took ~10 ms where one on a quiet node took ~6.5: the warm claim's refill
//! ran beside it), and only the claim has a client waiting.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::sync::Notify;

/// How long a refill gives way at most: a steady stream of pool misses must not keep a pool
/// from refilling (a clone takes ~5–10 ms here, a burst of 16 ~100 ms).
const GIVE_WAY_AT_MOST: Duration = Duration::from_millis(50);

#[derive(Debug, Default)]
pub(super) struct Foreground {
    starts: AtomicUsize,
    none: Notify,
}

/// A claim's start in progress, until dropped.
pub(super) struct Start<'a>(&'a Foreground);

impl Foreground {
    pub(super) fn start(&self) -> Start<'_> {
        self.starts.fetch_add(1, Ordering::SeqCst);
        Start(self)
    }

    /// Returns once no claim's start is in progress, or after [`GIVE_WAY_AT_MOST`].
    pub(super) async fn give_way(&self) {
        let none = async {
            loop {
                // Made before the check: `notify_waiters` reaches it from here on.
                let notified = self.none.notified();
                if self.starts.load(Ordering::SeqCst) == 0 {
                    return;
                }
                notified.await;
            }
        };
        let _ = tokio::time::timeout(GIVE_WAY_AT_MOST, none).await;
    }
}

impl Drop for Start<'_> {
    fn drop(&mut self) {
        if self.0.starts.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.0.none.notify_waiters();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_refill_waits_for_the_claims_starts_and_no_longer_than_its_bound() {
        let fg = Foreground::default();
        // Nothing in progress: no wait.
        let t = tokio::time::Instant::now();
        fg.give_way().await;
        assert_eq!(t.elapsed(), Duration::ZERO);

        // Two starts: the refill goes when the last one ends.
        let (a, b) = (fg.start(), fg.start());
        let t = tokio::time::Instant::now();
        let waited = async {
            fg.give_way().await;
            t.elapsed()
        };
        let ends = async {
            tokio::time::sleep(Duration::from_millis(5)).await;
            drop(a);
            tokio::time::sleep(Duration::from_millis(5)).await;
            drop(b);
        };
        let (waited, ()) = tokio::join!(waited, ends);
        assert_eq!(waited, Duration::from_millis(10));

        // A start that does not end: the refill goes after the bound.
        let _stuck = fg.start();
        let t = tokio::time::Instant::now();
        fg.give_way().await;
        assert_eq!(t.elapsed(), GIVE_WAY_AT_MOST);
    }
}
