//! The pty table: the master side of every live pty by its child's pid, so `PtyResize` from any
//! connection finds it; and the window-size ioctl both resizes use. The pty verbs (`pty`) run on
//! top of it; this module knows nothing of calls or the agent, so the agent state can hold it
//! without a cycle.

use std::collections::HashMap;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::{Arc, Mutex, MutexGuard};

use silk_proto::{ErrorKind, WireError};
use tokio::io::unix::AsyncFd;

/// The masters of live ptys, by their child's pid, for `PtyResize` from any connection.
#[derive(Debug, Default)]
pub struct Ptys {
    map: Mutex<HashMap<u32, Arc<AsyncFd<OwnedFd>>>>,
}

impl Ptys {
    fn lock(&self) -> MutexGuard<'_, HashMap<u32, Arc<AsyncFd<OwnedFd>>>> {
        // Held only for map operations, never across an await or a panic point.
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn insert(&self, pid: u32, master: Arc<AsyncFd<OwnedFd>>) {
        self.lock().insert(pid, master);
    }

    pub fn remove(&self, pid: u32) {
        self.lock().remove(&pid);
    }

    pub fn resize(&self, pid: u32, cols: u16, rows: u16) -> Result<(), WireError> {
        let master = self.lock().get(&pid).cloned().ok_or_else(|| {
            WireError::new(ErrorKind::NotFound, format!("no live pty for pid {pid}"))
        })?;
        set_size(master.get_ref(), cols, rows)
    }
}

pub fn check_size(cols: u16, rows: u16) -> Result<(), WireError> {
    if cols == 0 || rows == 0 {
        return Err(WireError::new(
            ErrorKind::BadRequest,
            format!("bad terminal size {cols}x{rows}"),
        ));
    }
    Ok(())
}

/// Sets the window size; the kernel sends SIGWINCH to the terminal's foreground group.
pub fn set_size(master: &OwnedFd, cols: u16, rows: u16) -> Result<(), WireError> {
    check_size(cols, rows)?;
    let winsize = libc::winsize { ws_row: rows, ws_col: cols, ws_xpixel: 0, ws_ypixel: 0 };
    // SAFETY: TIOCSWINSZ reads one `winsize` from a valid pointer.
    if unsafe { libc::ioctl(master.as_raw_fd(), libc::TIOCSWINSZ, &winsize) } != 0 {
        let e = std::io::Error::last_os_error();
        return Err(WireError::new(ErrorKind::Internal, format!("resize: {e}")));
    }
    Ok(())
}
