//! A sandbox's data-plane use: relay connections open, when the last call ended (for idle
//! hibernation), what its last stop kept of its memory, and a connection to its silkd opened
//! ahead of need.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use silk_engine::MemoryKept;
use tokio::net::UnixStream;
use tokio::sync::Notify;

use super::{Live, now_ms};

/// Data-plane use of one sandbox, for idle hibernation.
#[derive(Debug, Default)]
pub struct Activity {
    /// Relay connections open now.
    pub open: std::sync::atomic::AtomicUsize,
    /// When the last data-plane call ended (ms since the epoch).
    pub last_ms: std::sync::atomic::AtomicU64,
    /// Wakes relay tasks so they end when the sandbox stops (hibernate, archive, release).
    pub hangup: Notify,
    /// What its last hibernate or start did with its processes' memory (`None`: neither yet).
    memory: std::sync::Mutex<Option<MemoryKept>>,
    /// A connection to its silkd opened ahead of need (while it waited in a warm pool): the
    /// next relay takes it rather than connecting on its caller's path.
    ahead: std::sync::Mutex<Option<UnixStream>>,
}

impl Activity {
    pub(super) fn new() -> Arc<Activity> {
        let a = Activity::default();
        a.last_ms.store(now_ms(), Ordering::Relaxed);
        Arc::new(a)
    }

    pub fn memory(&self) -> Option<MemoryKept> {
        self.memory.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    pub(crate) fn set_memory(&self, kept: MemoryKept) {
        *self.memory.lock().unwrap_or_else(|e| e.into_inner()) = Some(kept);
    }

    /// The sandbox stops (hibernate, a memory dump, archive, move, release): its relays end,
    /// and the connection kept ahead goes.
    pub(crate) fn hang_up(&self) {
        self.hangup.notify_waiters();
        self.ahead.lock().unwrap_or_else(|e| e.into_inner()).take();
    }

    pub(super) fn keep_ahead(&self, agent: UnixStream) {
        *self.ahead.lock().unwrap_or_else(|e| e.into_inner()) = Some(agent);
    }

    /// The connection kept ahead, if silkd still holds it open and idle (a silkd that died or
    /// was restarted meanwhile closed it).
    pub(super) fn take_ahead(&self) -> Option<UnixStream> {
        self.ahead.lock().unwrap_or_else(|e| e.into_inner()).take().filter(open_and_idle)
    }
}

/// Whether silkd holds `agent` open with nothing sent on it (silkd never speaks first): one
/// peek that must find nothing to read yet.
fn open_and_idle(agent: &UnixStream) -> bool {
    use std::os::fd::AsRawFd;
    let mut byte = [0u8; 1];
    // SAFETY: a non-blocking peek into a local buffer, on a descriptor `agent` owns.
    let n = unsafe {
        libc::recv(
            agent.as_raw_fd(),
            byte.as_mut_ptr().cast(),
            1,
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    n < 0 && std::io::Error::last_os_error().kind() == std::io::ErrorKind::WouldBlock
}

/// A data-plane call in progress: pauses the sandbox's idle clock until dropped.
#[derive(Debug)]
pub struct Active(Arc<Activity>);

impl Active {
    pub fn new(live: &Live) -> Active {
        live.activity.open.fetch_add(1, Ordering::Relaxed);
        Active(live.activity.clone())
    }
}

impl Drop for Active {
    fn drop(&mut self) {
        self.0.last_ms.store(now_ms(), Ordering::Relaxed);
        self.0.open.fetch_sub(1, Ordering::Relaxed);
    }
}
