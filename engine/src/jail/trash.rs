//! Removed boxes leave `boxes/` at once and are deleted behind the caller (so do the memory
//! images a wake has restored). A destroy answers
//! once the id is free (processes killed, cgroups gone, disk unmounted, the directory renamed
//! into `trash/`); one thread per engine deletes what lands there, in order. Deleting a box is
//! most of a destroy's time (its image's blocks are freed, and a host filesystem mounted with
//! `discard` discards them: 30 ms for 100 MiB here), which an archive or a move paid before
//! answering. What a crash leaves in `trash/` goes when the next engine opens.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::thread::JoinHandle;

#[derive(Debug)]
pub(super) struct Trash {
    dir: PathBuf,
    /// Paths for the remover; `None` once closed (the remover then ends).
    to_remover: Option<mpsc::Sender<PathBuf>>,
    remover: Option<JoinHandle<()>>,
    next: AtomicU64,
}

impl Trash {
    /// Opens `dir` (made if missing), queueing whatever is already in it.
    pub(super) fn open(dir: PathBuf) -> std::io::Result<Trash> {
        std::fs::create_dir_all(&dir)?;
        let (tx, rx) = mpsc::channel::<PathBuf>();
        for entry in std::fs::read_dir(&dir)?.flatten() {
            let _ = tx.send(entry.path());
        }
        let remover = std::thread::Builder::new()
            .name("silk-trash".into())
            // A sandbox can nest directories far deeper than a default stack recurses (see
            // `host::remove_tree`); reserved, not committed.
            .stack_size(1 << 30)
            .spawn(move || {
                // Behind the sandboxes and the claim path, as the disk stock is.
                // SAFETY: plain syscalls on this thread.
                unsafe { libc::setpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t, 10) };
                for path in rx {
                    match std::fs::remove_dir_all(&path) {
                        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                            tracing::warn!(path = %path.display(), "removing a destroyed box: {e}")
                        }
                        _ => {}
                    }
                }
            })?;
        Ok(Trash { dir, to_remover: Some(tx), remover: Some(remover), next: AtomicU64::new(0) })
    }

    /// Moves `box_dir` (or another directory of the engine's, nothing mounted under it) into
    /// the trash, for the remover. A directory already gone is no error.
    pub(super) fn discard(&self, box_dir: &Path) -> std::io::Result<()> {
        let name =
            box_dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        // Unique across engines on one data directory (a test's reopen) and across restarts.
        let to =
            self.dir.join(format!("{name}.{}.{}.{n}", std::process::id(), super::host::now_ms()));
        match std::fs::rename(box_dir, &to) {
            Ok(()) => {
                if let Some(tx) = &self.to_remover {
                    // A remover that died leaves the entry for the next engine's sweep.
                    let _ = tx.send(to);
                }
                Ok(())
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(e),
        }
    }
}

impl Drop for Trash {
    /// Waits for the remover to empty the queue: an engine closed leaves nothing being
    /// deleted behind it (a test's filesystem is unmounted next).
    fn drop(&mut self) {
        drop(self.to_remover.take());
        if let Some(remover) = self.remover.take() {
            let _ = remover.join();
        }
    }
}
