//! The bounded output ring of a detached process.
//!
//! Output is kept as chunks stamped with their absolute byte offset (stdout and stderr share one
//! sequence). A reader holds a cursor; it gets every chunk at or after the cursor, and when the
//! ring has already dropped older chunks it learns exactly how many bytes it missed. Followers
//! wait on a `watch` channel bumped after each change, so a chunk pushed between a reader's scan
//! and its wait is never missed, and none is sent twice.

use std::collections::VecDeque;
use std::sync::{Mutex, MutexGuard};

use bytes::Bytes;
use silk_proto::{ExitStatus, Frame};
use tokio::sync::watch;

#[derive(Debug)]
pub struct Ring {
    capacity: usize,
    state: Mutex<State>,
    changed: watch::Sender<()>,
}

#[derive(Debug, Default)]
struct State {
    chunks: VecDeque<(u64, bool, Bytes)>, // (offset, is_stderr, bytes)
    held: usize,
    start: u64,
    end: u64,
    exit: Option<ExitStatus>,
    output_closed: bool,
}

/// What a reader gets from one scan.
#[derive(Debug, Default)]
pub struct Scan {
    pub frames: Vec<Frame>,
    /// Bytes that left the ring before this reader saw them.
    pub dropped: u64,
    /// Set once the process exited and all its output is in the ring.
    pub finished: Option<ExitStatus>,
}

impl Ring {
    pub fn new(capacity: usize) -> Self {
        Ring { capacity, state: Mutex::default(), changed: watch::channel(()).0 }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn push(&self, stderr: bool, data: Bytes) {
        let mut s = self.lock();
        let offset = s.end;
        s.end += data.len() as u64;
        s.held += data.len();
        s.chunks.push_back((offset, stderr, data));
        while s.held > self.capacity {
            let Some((_, _, old)) = s.chunks.pop_front() else { break };
            s.held -= old.len();
            s.start += old.len() as u64;
        }
        drop(s);
        self.changed.send_replace(());
    }

    pub fn set_exit(&self, exit: ExitStatus) {
        self.lock().exit = Some(exit);
        self.changed.send_replace(());
    }

    pub fn close_output(&self) {
        self.lock().output_closed = true;
        self.changed.send_replace(());
    }

    pub fn exit(&self) -> Option<ExitStatus> {
        self.lock().exit
    }

    /// Subscribe before the first [`scan`](Self::scan) so no change is missed.
    pub fn subscribe(&self) -> watch::Receiver<()> {
        self.changed.subscribe()
    }

    /// Everything from `cursor` on; advances the cursor past it.
    pub fn scan(&self, cursor: &mut u64) -> Scan {
        let s = self.lock();
        let mut scan = Scan::default();
        if *cursor < s.start {
            scan.dropped = s.start - *cursor;
            *cursor = s.start;
        }
        for (offset, stderr, data) in &s.chunks {
            if *offset >= *cursor {
                scan.frames.push(if *stderr {
                    Frame::Stderr(data.clone())
                } else {
                    Frame::Stdout(data.clone())
                });
            }
        }
        *cursor = s.end;
        if s.output_closed {
            scan.finished = s.exit;
        }
        scan
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readers_get_each_byte_once_and_learn_what_was_dropped() {
        let ring = Ring::new(10);
        ring.push(false, Bytes::from_static(b"abcd"));
        let mut cursor = 0;
        let scan = ring.scan(&mut cursor);
        assert_eq!(scan.frames, vec![Frame::Stdout(Bytes::from_static(b"abcd"))]);
        assert!(ring.scan(&mut cursor).frames.is_empty(), "no duplicates");

        ring.push(true, Bytes::from_static(b"efgh"));
        ring.push(false, Bytes::from_static(b"ijkl")); // evicts "abcd"
        let mut late = 0;
        let scan = ring.scan(&mut late);
        assert_eq!(scan.dropped, 4);
        assert_eq!(scan.frames.len(), 2);
        let scan = ring.scan(&mut cursor);
        assert_eq!((scan.dropped, scan.frames.len()), (0, 2));

        let exit = ExitStatus { code: 0, signal: None, timed_out: false };
        ring.set_exit(exit);
        assert_eq!(ring.scan(&mut cursor).finished, None, "output still open");
        ring.close_output();
        assert_eq!(ring.scan(&mut cursor).finished, Some(exit));
    }
}
