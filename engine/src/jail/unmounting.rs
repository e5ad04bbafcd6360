//! A stopped jail's overlay is unmounted behind the caller. The overlay lives in the jail's
//! own mount namespace, so it goes when the jail's last process exits — and overlayfs syncs
//! its whole upper filesystem as it goes (`ovl_sync_fs`): the kill waited for every byte the
//! sandbox wrote to reach the disk. 100 MiB written: a hibernate took 72-101 ms, 12-15 ms with
//! the overlay held open past the kill (four each, one node). A move or an archive reads those
//! bytes next and then deletes them; a hibernate keeps them on a disk the kernel writes back
//! anyway.
//!
//! So a stop first opens the jail's root (`O_PATH`), which keeps the overlay mounted once the
//! namespace is gone, and hands it here: one thread per engine closes the roots in turn, and
//! the unmount and its sync run there. Whatever mounts over the same upper directory again (a
//! wake) or unmounts the disk under it (a destroy) waits for that box's close first, and closes
//! it itself if it is still queued ([`Unmounting::wait`]). A crash closes them all: the kernel
//! unmounts each as it would have.

use std::collections::{HashSet, VecDeque};
use std::os::fd::OwnedFd;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

use crate::SandboxId;

#[derive(Debug, Default)]
struct Held {
    /// Roots waiting for the closer, oldest first.
    queued: VecDeque<(SandboxId, OwnedFd)>,
    /// Boxes whose root the closer is closing now.
    closing: HashSet<SandboxId>,
    /// The engine is closing: the closer empties the queue and ends.
    done: bool,
}

#[derive(Debug, Default)]
struct Shared {
    held: Mutex<Held>,
    changed: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Held> {
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[derive(Debug)]
pub(super) struct Unmounting {
    shared: Arc<Shared>,
    closer: Option<JoinHandle<()>>,
}

impl Unmounting {
    pub(super) fn start() -> std::io::Result<Unmounting> {
        let shared = Arc::new(Shared::default());
        let state = shared.clone();
        let closer = std::thread::Builder::new().name("silk-unmount".into()).spawn(move || {
            let mut held = state.lock();
            loop {
                let Some((id, root)) = held.queued.pop_front() else {
                    if held.done {
                        return;
                    }
                    held = state.changed.wait(held).unwrap_or_else(|p| p.into_inner());
                    continue;
                };
                held.closing.insert(id.clone());
                drop(held);
                // The last reference: the overlay's unmount and its sync run in this close.
                drop(root);
                held = state.lock();
                held.closing.remove(&id);
                state.changed.notify_all();
            }
        })?;
        Ok(Unmounting { shared, closer: Some(closer) })
    }

    /// Opens the root of the jail whose init is `pid`, to hold its overlay past the kill.
    /// `None` when it cannot (the jail already gone): the kill then waits as it always did.
    pub(super) fn hold(pid: u32) -> Option<OwnedFd> {
        use std::os::unix::fs::OpenOptionsExt;
        // O_PATH: the directory is neither read nor searched, only kept. std opens with
        // O_CLOEXEC: a sandbox's root must never reach a process the node starts (through it,
        // that process would reach the sandbox's files).
        let root = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_PATH)
            .open(format!("/proc/{pid}/root"))
            .ok()?;
        Some(root.into())
    }

    /// Closes `root` (from [`Unmounting::hold`], its jail now dead) behind the caller.
    pub(super) fn close(&self, id: &SandboxId, root: OwnedFd) {
        self.shared.lock().queued.push_back((id.clone(), root));
        self.shared.changed.notify_all();
    }

    /// Returns once box `id`'s overlay is unmounted (at once if none is held). A root still
    /// queued is closed here: the caller waits for its own box's sync, never behind others'.
    pub(super) fn wait(&self, id: &SandboxId) {
        let mut held = self.shared.lock();
        if let Some(at) = held.queued.iter().position(|(queued, _)| queued == id) {
            let root = held.queued.remove(at);
            drop(held);
            drop(root);
            return;
        }
        while held.closing.contains(id) {
            held = self.shared.changed.wait(held).unwrap_or_else(|p| p.into_inner());
        }
    }
}

impl Drop for Unmounting {
    /// Waits for every held overlay to go: an engine closed leaves nothing mounted behind it.
    fn drop(&mut self) {
        self.shared.lock().done = true;
        self.shared.changed.notify_all();
        if let Some(closer) = self.closer.take() {
            let _ = closer.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    /// `wait` returns only once what was handed over for that box is closed: here the read
    /// ends of pipes, so a write to the other end then fails. A root still queued behind
    /// another is closed by the wait itself.
    #[test]
    fn a_wait_returns_once_the_held_descriptor_is_closed() {
        let unmounting = Unmounting::start().unwrap();
        let pipe = || {
            let (read, write) = std::io::pipe().unwrap();
            (OwnedFd::from(read), std::fs::File::from(OwnedFd::from(write)))
        };
        let closed = |w: &mut std::fs::File| {
            w.write_all(b"x").is_err_and(|e| e.kind() == std::io::ErrorKind::BrokenPipe)
        };
        let (a, b): (SandboxId, SandboxId) = ("u-1".parse().unwrap(), "u-2".parse().unwrap());
        unmounting.wait(&a);
        let ((ra, mut wa), (rb, mut wb)) = (pipe(), pipe());
        unmounting.close(&a, ra);
        unmounting.close(&b, rb);
        unmounting.wait(&b);
        assert!(closed(&mut wb));
        unmounting.wait(&a);
        assert!(closed(&mut wa));
        // Closing the engine closes whatever is still held.
        let (rc, mut wc) = pipe();
        unmounting.close(&"u-3".parse().unwrap(), rc);
        drop(unmounting);
        assert!(closed(&mut wc));
    }

    /// A held root never reaches a process the node starts: it is closed on exec.
    #[test]
    fn a_held_root_is_closed_on_exec() {
        use std::os::fd::AsRawFd;
        let root = Unmounting::hold(std::process::id()).unwrap();
        // SAFETY: plain fcntl on a descriptor this test owns.
        let flags = unsafe { libc::fcntl(root.as_raw_fd(), libc::F_GETFD) };
        assert!(flags >= 0 && flags & libc::FD_CLOEXEC != 0, "flags {flags}");
    }
}
