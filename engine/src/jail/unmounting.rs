//! A stopped jail's overlay is unmounted behind the caller. The overlay lives in the jail's
//! own mount namespace, so it goes when the jail's last process exits — and overlayfs syncs
//! its whole upper filesystem as it goes (`ovl_sync_fs`): the kill waited for every byte the
//! sandbox wrote to reach the disk. 100 MiB written: a hibernate took 72-101 ms, 12-15 ms with
//! the overlay held open past the kill (four each, one node). A move or an archive reads those
//! bytes next and then deletes them; a hibernate keeps them on a disk the kernel writes back
//! anyway.
//!
//! So a kill first opens the jail's root (`O_PATH`), which keeps the overlay mounted once the
//! namespace is gone, and hands it here: one thread per engine closes it, and the unmount and
//! its sync run there. Whatever mounts over the same upper directory again (a wake) or
//! unmounts the disk under it (a destroy) waits for that box's close first ([`Unmounting::wait`]).
//! A crash closes them all: the kernel unmounts each as it would have.

use std::collections::HashSet;
use std::os::fd::OwnedFd;
use std::sync::{Condvar, Mutex, mpsc};
use std::thread::JoinHandle;

use crate::SandboxId;

#[derive(Debug)]
pub(super) struct Unmounting {
    /// Boxes whose overlay is still held here.
    held: std::sync::Arc<(Mutex<HashSet<SandboxId>>, Condvar)>,
    to_closer: Option<mpsc::Sender<(SandboxId, OwnedFd)>>,
    closer: Option<JoinHandle<()>>,
}

impl Unmounting {
    pub(super) fn start() -> std::io::Result<Unmounting> {
        let held = std::sync::Arc::new((Mutex::new(HashSet::new()), Condvar::new()));
        let (tx, rx) = mpsc::channel::<(SandboxId, OwnedFd)>();
        let state = held.clone();
        let closer = std::thread::Builder::new().name("silk-unmount".into()).spawn(move || {
            for (id, root) in rx {
                // The last reference: the overlay's unmount and its sync run in this close.
                drop(root);
                let (lock, changed) = &*state;
                lock.lock().unwrap_or_else(|p| p.into_inner()).remove(&id);
                changed.notify_all();
            }
        })?;
        Ok(Unmounting { held, to_closer: Some(tx), closer: Some(closer) })
    }

    /// Opens the root of the jail whose init is `pid`, to hold its overlay past the kill.
    /// `None` when it cannot (the jail already gone): the kill then waits as it always did.
    pub(super) fn hold(pid: u32) -> Option<OwnedFd> {
        use std::os::fd::FromRawFd;
        let path = std::ffi::CString::new(format!("/proc/{pid}/root")).ok()?;
        // SAFETY: a plain open of a NUL-terminated path; the fd is owned below. O_PATH: the
        // directory is neither read nor searched, only kept.
        let fd = unsafe { libc::open(path.as_ptr(), libc::O_PATH | libc::O_CLOEXEC) };
        // SAFETY: `fd` is a descriptor this call just opened and nothing else owns.
        (fd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd) })
    }

    /// Closes `root` (from [`Unmounting::hold`], its jail now dead) behind the caller.
    pub(super) fn close(&self, id: &SandboxId, root: OwnedFd) {
        let (lock, _) = &*self.held;
        lock.lock().unwrap_or_else(|p| p.into_inner()).insert(id.clone());
        let sent = self.to_closer.as_ref().map(|tx| tx.send((id.clone(), root)));
        if let Some(Err(mpsc::SendError((id, root)))) = sent {
            // The closer is gone: close it here, waiting as a kill used to.
            drop(root);
            lock.lock().unwrap_or_else(|p| p.into_inner()).remove(&id);
        }
    }

    /// Returns once box `id`'s overlay is unmounted (at once if none is held).
    pub(super) fn wait(&self, id: &SandboxId) {
        let (lock, changed) = &*self.held;
        let mut held = lock.lock().unwrap_or_else(|p| p.into_inner());
        while held.contains(id) {
            held = changed.wait(held).unwrap_or_else(|p| p.into_inner());
        }
    }
}

impl Drop for Unmounting {
    /// Waits for every held overlay to go: an engine closed leaves nothing mounted behind it.
    fn drop(&mut self) {
        drop(self.to_closer.take());
        if let Some(closer) = self.closer.take() {
            let _ = closer.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    /// `wait` returns only once the closer has closed what it was handed: here the read end
    /// of a pipe, so a write to the other end then fails.
    #[test]
    fn a_wait_returns_once_the_held_descriptor_is_closed() {
        let unmounting = Unmounting::start().unwrap();
        let (read, write) = std::io::pipe().unwrap();
        let mut write = std::fs::File::from(OwnedFd::from(write));
        let id: SandboxId = "u-1".parse().unwrap();
        unmounting.wait(&id);
        unmounting.close(&id, OwnedFd::from(read));
        unmounting.wait(&id);
        let err = write.write_all(b"x").unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::BrokenPipe);
        // Another box's wait is not held up by it.
        unmounting.wait(&"u-2".parse().unwrap());
    }
}
