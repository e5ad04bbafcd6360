//! The local terminal for `sbx shell`: raw mode through termios (restored on drop, also when
//! unwinding from a panic) and the window size.

use std::io;
use std::os::fd::RawFd;

/// Raw mode on a terminal; the saved settings come back when this is dropped.
#[derive(Debug)]
pub struct RawMode {
    fd: RawFd,
    saved: libc::termios,
}

impl RawMode {
    /// Puts `fd` in raw mode (no echo, no line editing, no signal keys: ^C goes to the sandbox).
    /// `None` when `fd` is not a terminal.
    pub fn enable(fd: RawFd) -> io::Result<Option<RawMode>> {
        // SAFETY: isatty only inspects the descriptor.
        if unsafe { libc::isatty(fd) } != 1 {
            return Ok(None);
        }
        // SAFETY: termios is plain old data, fully written by tcgetattr before it is read.
        let mut saved: libc::termios = unsafe { std::mem::zeroed() };
        // SAFETY: `saved` is a valid, writable termios.
        if unsafe { libc::tcgetattr(fd, &mut saved) } != 0 {
            return Err(io::Error::last_os_error());
        }
        let mut raw = saved;
        // SAFETY: `raw` is a valid termios obtained from tcgetattr.
        unsafe { libc::cfmakeraw(&mut raw) };
        // SAFETY: `raw` is a valid termios.
        if unsafe { libc::tcsetattr(fd, libc::TCSANOW, &raw) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Some(RawMode { fd, saved }))
    }
}

impl Drop for RawMode {
    fn drop(&mut self) {
        // SAFETY: `saved` came from tcgetattr on the same descriptor. TCSADRAIN lets the last
        // output reach the terminal before the settings change.
        unsafe { libc::tcsetattr(self.fd, libc::TCSADRAIN, &self.saved) };
    }
}

/// The window size of the terminal on `fd` as (cols, rows), if it is one.
pub fn size(fd: RawFd) -> Option<(u16, u16)> {
    // SAFETY: winsize is plain old data; TIOCGWINSZ writes it and touches nothing else.
    let mut ws: libc::winsize = unsafe { std::mem::zeroed() };
    // SAFETY: TIOCGWINSZ takes a pointer to a winsize, which `ws` is.
    let ok = unsafe { libc::ioctl(fd, libc::TIOCGWINSZ, &mut ws) } == 0;
    (ok && ws.ws_col > 0 && ws.ws_row > 0).then_some((ws.ws_col, ws.ws_row))
}
