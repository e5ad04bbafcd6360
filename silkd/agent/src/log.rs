//! silkd's own log, bounded. In a jail silkd's stderr is a file on the host (the engine reads it
//! when a sandbox fails to start). A sandbox can make silkd log (bad requests, failing calls)
//! as often as it likes, so the file is capped: a write that would take it past the cap starts
//! it over from empty with a note saying so. Only silkd writes to it: commands get their own
//! pipes, and silkd is not dumpable, so no sandbox process can reopen it through /proc.

use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};

/// Bytes in the log file, as far as this process knows (it started with the file's size).
static WRITTEN: AtomicU64 = AtomicU64::new(0);

/// A `Write` to stderr that keeps a regular file there under `max` bytes.
#[derive(Debug, Clone, Copy)]
pub struct CappedStderr {
    max: u64,
}

impl CappedStderr {
    /// Starts counting at the file's current size, starting it over if it is already past `max`
    /// (it survives jail restarts and collects every run's lines).
    pub fn new(max: u64) -> CappedStderr {
        let log = CappedStderr { max };
        WRITTEN.store(stderr_size(), Ordering::Relaxed);
        if WRITTEN.load(Ordering::Relaxed) > max {
            log.start_over();
        }
        log
    }

    fn start_over(&self) {
        // SAFETY: plain syscall on fd 2; on a pipe or terminal it fails and nothing changes.
        if unsafe { libc::ftruncate(2, 0) } == 0 {
            let note = format!("silkd: log started over at {} bytes\n", self.max);
            WRITTEN.store(note.len() as u64, Ordering::Relaxed);
            let _ = std::io::stderr().write_all(note.as_bytes());
        }
    }
}

fn stderr_size() -> u64 {
    // SAFETY: fstat writes `st` on success.
    unsafe {
        let mut st: libc::stat = std::mem::zeroed();
        if libc::fstat(2, &mut st) == 0 && st.st_mode & libc::S_IFMT == libc::S_IFREG {
            st.st_size as u64
        } else {
            0
        }
    }
}

impl Write for CappedStderr {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if WRITTEN.fetch_add(buf.len() as u64, Ordering::Relaxed) + buf.len() as u64 > self.max {
            self.start_over();
            WRITTEN.fetch_add(buf.len() as u64, Ordering::Relaxed);
        }
        std::io::stderr().write(buf)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        std::io::stderr().flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_log_stays_under_its_cap() {
        // Point fd 2 at a temporary file for this test only (tests share the process: the
        // other tests' stderr goes there meanwhile, which only adds lines).
        // O_APPEND, as the launcher opens it: after a truncation writes go to the new end.
        let path = tempfile::NamedTempFile::new().unwrap().into_temp_path();
        let file = std::fs::OpenOptions::new().append(true).open(&path).unwrap();
        use std::os::fd::AsRawFd;
        // SAFETY: dup/dup2 on valid descriptors; restored below.
        let saved = unsafe { libc::dup(2) };
        unsafe { libc::dup2(file.as_raw_fd(), 2) };
        let mut log = CappedStderr::new(64 << 10);
        for _ in 0..10_000 {
            log.write_all(&[b'x'; 100]).unwrap();
        }
        let size = file.metadata().unwrap().len();
        unsafe { libc::dup2(saved, 2) };
        assert!(size <= 64 << 10, "the log grew to {size} bytes");
        assert!(size > 0);
    }
}
