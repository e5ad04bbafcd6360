//! A future polled again at once when it wakes itself during its own poll, instead of being
//! handed back to tokio's scheduler.
//!
//! Why: hyper serves a request body through a channel whose two ends live in the same task (the
//! connection's dispatcher sends, the handler inside it receives), so every request with a body
//! wakes its own connection task twice: the handler asking for the body, the dispatcher sending
//! it. Tokio treats a task woken during its poll as a yield: it goes to the back of the run
//! queue and a parked worker is woken to steal it. On these 2 cores that was a futex wake and an
//! idle vCPU roused for every `POST`, and the connection moving between the two cores from one
//! request to the next (perf stat over 2000 `POST`s on a kept connection: 2.3–2.4 context
//! switches and up to 0.3 migrations per request, against 1.0 and none for a bodiless `DELETE`;
//! docs/benchmarks.md, the session of 2026-12-06 09:05).
//!
//! A wake that comes while the future is not being polled (the socket became readable, a
//! spawned task finished) goes to the task's waker as before.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::task::{Context, Poll, Wake, Waker};

use futures_util::task::AtomicWaker;

/// Polls in place at most this many times in a row; past that the wake goes to the scheduler,
/// so a future that yields on purpose (hyper does after 16 pipelined requests, tokio's budget
/// does when spent) still lets other tasks run.
const MAX_IN_PLACE: usize = 4;

const IDLE: u8 = 0;
const POLLING: u8 = 1;
const WOKEN: u8 = 2;

/// `inner`, polled again in place when it wakes itself (see the module's comment).
pub fn in_place<F: Future>(inner: F) -> InPlace<F> {
    let wakes = Arc::new(Wakes { state: AtomicU8::new(IDLE), task: AtomicWaker::new() });
    InPlace { inner: Box::pin(inner), waker: Waker::from(wakes.clone()), wakes }
}

pub struct InPlace<F> {
    inner: Pin<Box<F>>,
    wakes: Arc<Wakes>,
    /// `wakes` as the waker `inner` is polled with.
    waker: Waker,
}

struct Wakes {
    /// `POLLING` while `inner` is polled, `WOKEN` once it woke itself meanwhile.
    state: AtomicU8,
    /// The waker of the task that polls this future.
    task: AtomicWaker,
}

impl Wake for Wakes {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        match self.state.compare_exchange(POLLING, WOKEN, Ordering::AcqRel, Ordering::Acquire) {
            // Seen by the poll loop when `inner` returns.
            Ok(_) | Err(WOKEN) => {}
            Err(_) => self.task.wake(),
        }
    }
}

impl<F: Future> Future for InPlace<F> {
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = &mut *self;
        // Before the state can read `IDLE` again: a wake after this poll must reach the task.
        this.wakes.task.register(cx.waker());
        let mut inner_cx = Context::from_waker(&this.waker);
        for _ in 0..MAX_IN_PLACE {
            this.wakes.state.store(POLLING, Ordering::Release);
            let polled = this.inner.as_mut().poll(&mut inner_cx);
            // A wake before this swap is seen here; one after it finds `IDLE` and wakes the task.
            let woken = this.wakes.state.swap(IDLE, Ordering::AcqRel) == WOKEN;
            if polled.is_ready() || !woken {
                return polled;
            }
        }
        cx.waker().wake_by_ref();
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    /// Counts the wakes of the task that polls it.
    struct Counted(AtomicUsize);

    impl Wake for Counted {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// Wakes itself during each of its first `self_wakes` polls, then is ready.
    struct WakesItself {
        self_wakes: usize,
        polls: usize,
    }

    impl Future for WakesItself {
        type Output = usize;

        fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<usize> {
            self.polls += 1;
            if self.polls > self.self_wakes {
                return Poll::Ready(self.polls);
            }
            cx.waker().wake_by_ref();
            Poll::Pending
        }
    }

    fn task() -> (Arc<Counted>, Waker) {
        let counted = Arc::new(Counted(AtomicUsize::new(0)));
        (counted.clone(), Waker::from(counted))
    }

    #[test]
    fn a_future_that_wakes_itself_is_polled_again_without_waking_its_task() {
        let (counted, waker) = task();
        let mut fut = in_place(WakesItself { self_wakes: 2, polls: 0 });
        let polled = Pin::new(&mut fut).poll(&mut Context::from_waker(&waker));
        assert_eq!(polled, Poll::Ready(3), "two self-wakes, three polls, one call");
        assert_eq!(counted.0.load(Ordering::SeqCst), 0, "the task was never woken");
    }

    #[test]
    fn a_future_that_keeps_waking_itself_goes_back_to_the_scheduler() {
        let (counted, waker) = task();
        let mut fut = in_place(WakesItself { self_wakes: 100, polls: 0 });
        let polled = Pin::new(&mut fut).poll(&mut Context::from_waker(&waker));
        assert!(polled.is_pending());
        assert_eq!(fut.inner.polls, MAX_IN_PLACE);
        assert_eq!(counted.0.load(Ordering::SeqCst), 1, "the task was woken to run again");
    }

    #[test]
    fn a_wake_between_polls_reaches_the_task() {
        let (counted, waker) = task();
        // Pending without waking itself: waits on something else, like a socket.
        let mut fut = in_place(std::future::pending::<()>());
        assert!(Pin::new(&mut fut).poll(&mut Context::from_waker(&waker)).is_pending());
        assert_eq!(counted.0.load(Ordering::SeqCst), 0);
        let from_elsewhere = fut.waker.clone();
        std::thread::spawn(move || from_elsewhere.wake()).join().expect("waker thread");
        assert_eq!(counted.0.load(Ordering::SeqCst), 1, "the socket's wake reached the task");
    }
}
