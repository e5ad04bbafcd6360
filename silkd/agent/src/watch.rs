//! The `watch` verb: filesystem events under a path, from inotify, until the client cancels.
//!
//! A blocking thread owns the inotify descriptor. It first arms every watch (the whole tree when
//! `recursive`), and only then does the call send `Ready`, so any change made after the client
//! saw `Ready` is reported. The thread then reads events, turns them into `WatchEvent`s (paired
//! `IN_MOVED_FROM`/`IN_MOVED_TO` become one `Renamed`; a move out of the tree is `Deleted`, a
//! move in is `Created`), and hands them to the connection through a bounded queue
//! (`--watch-queue` events).
//!
//! **Nothing is lost silently.** Two things can overflow: the kernel's queue (`IN_Q_OVERFLOW`)
//! and ours, when the client reads slower than events arrive. Either way the thread stops, the
//! client receives every event queued before that point, and the call ends with
//! `Error{ResourceExhausted}`. The queue is the one to lower to see this happen (tests do):
//! the kernel's (`fs.inotify.max_queued_events`) is host-wide and not ours to change.
//!
//! In recursive mode a directory created (or moved in) later gets its watches at once, and its
//! contents found at that moment are reported as `Created`, so files made in it before its watch
//! was armed are not missed (one may be reported twice). When the watched path itself is deleted
//! or moved, the call sends `Deleted` for it and ends with `Done`; `Cancel` ends it with `Done`.

use std::collections::HashMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};

use silk_proto::{
    ErrorKind, EventKind, Frame, FrameReader, FrameWriter, WatchEvent, WatchRequest, WireError,
};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::{mpsc, oneshot};

use crate::call::{Agent, CallResult, Fail, interrupted};
use crate::files::{checked_path, io_error};
use crate::procs::pipe_pair;

/// Events per `Events` frame.
const BATCH: usize = 256;
/// How long a `IN_MOVED_FROM` waits for its `IN_MOVED_TO` (the kernel queues both within one
/// rename, so this only delays reporting a move out of the tree).
const MOVE_PAIR_MS: i32 = 20;

const DIR_MASK: u32 = libc::IN_CREATE
    | libc::IN_MODIFY
    | libc::IN_ATTRIB
    | libc::IN_DELETE
    | libc::IN_MOVED_FROM
    | libc::IN_MOVED_TO
    | libc::IN_DELETE_SELF
    | libc::IN_MOVE_SELF
    | libc::IN_ONLYDIR
    | libc::IN_DONT_FOLLOW
    | libc::IN_EXCL_UNLINK;
const FILE_MASK: u32 =
    libc::IN_MODIFY | libc::IN_ATTRIB | libc::IN_DELETE_SELF | libc::IN_MOVE_SELF;

pub async fn watch<R, W>(
    agent: &Agent,
    req: WatchRequest,
    rd: &mut FrameReader<R>,
    wr: &mut FrameWriter<W>,
) -> CallResult
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let root = checked_path(&req.path)?;
    let meta = std::fs::metadata(&root).map_err(|e| io_error(&root, e))?;
    // The thread's stop signal: dropping `stop_tx` (at the end of the call, however it ends)
    // wakes its poll.
    let (stop_rx, stop_tx) = pipe_pair()?;
    let (armed_tx, armed_rx) = oneshot::channel();
    let (tx, mut rx) = mpsc::channel(agent.options.watch_queue.max(1));
    let recursive = req.recursive && meta.is_dir();
    let thread = tokio::task::spawn_blocking(move || {
        let mut watcher = match Watcher::arm(root, meta.is_dir(), recursive) {
            Ok(w) => w,
            Err(e) => {
                let _ = armed_tx.send(Err(e));
                return Ok(());
            }
        };
        let _ = armed_tx.send(Ok(()));
        watcher.run(&tx, &stop_rx)
    });
    match armed_rx.await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => return Err(Fail::Call(e)),
        Err(_) => return Err(Fail::Call(WireError::new(ErrorKind::Internal, "watcher failed"))),
    }
    wr.send(&Frame::Ready).await?;

    loop {
        tokio::select! {
            event = rx.recv() => match event {
                Some(event) => {
                    let mut batch = vec![event];
                    while batch.len() < BATCH {
                        match rx.try_recv() {
                            Ok(event) => batch.push(event),
                            Err(_) => break,
                        }
                    }
                    wr.send(&Frame::Events(batch)).await?;
                }
                // The thread ended (root gone, overflow, failure) and every event it queued
                // was sent: its result is the call's.
                None => {
                    let ended = thread.await.unwrap_or_else(|e| {
                        Err(WireError::new(ErrorKind::Internal, format!("watcher failed: {e}")))
                    });
                    ended?;
                    break;
                }
            },
            frame = rd.recv() => match frame {
                Ok(Some(Frame::Cancel)) => break,
                Ok(Some(Frame::Stdin(_) | Frame::Data(_) | Frame::Eof)) => {}
                other => return Err(interrupted(other, "during a watch; the watch was stopped")),
            },
        }
    }
    // Dropping `stop_tx` (here or on any early return) wakes and ends the thread.
    drop(stop_tx);
    Ok(wr.send(&Frame::Done).await?)
}

/// The thread's state: the inotify descriptor and what each watch descriptor stands for.
struct Watcher {
    fd: OwnedFd,
    root: PathBuf,
    root_wd: i32,
    root_is_dir: bool,
    recursive: bool,
    /// Watch descriptor → the directory (or the watched file) it reports on.
    paths: HashMap<i32, PathBuf>,
    /// An `IN_MOVED_FROM` waiting for its `IN_MOVED_TO`: (cookie, path, is_dir).
    pending_move: Option<(u32, PathBuf, bool)>,
}

/// Why the thread stopped sending.
enum Stop {
    /// The client is gone or cancelled.
    Closed,
    Failed(WireError),
}

type Sent = Result<(), Stop>;

fn overflow(whose: &str) -> WireError {
    WireError::new(
        ErrorKind::ResourceExhausted,
        format!("watch event queue overflowed ({whose}); events after the last one sent were lost"),
    )
}

impl Watcher {
    fn arm(root: PathBuf, is_dir: bool, recursive: bool) -> Result<Watcher, WireError> {
        // SAFETY: plain syscall; the result is checked.
        let fd = unsafe { libc::inotify_init1(libc::IN_NONBLOCK | libc::IN_CLOEXEC) };
        if fd < 0 {
            let e = std::io::Error::last_os_error();
            return Err(WireError::new(
                ErrorKind::ResourceExhausted,
                format!("inotify: {e} (fs.inotify.max_user_instances)"),
            ));
        }
        // SAFETY: a fresh descriptor nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let mut w = Watcher {
            fd,
            root: root.clone(),
            root_wd: -1,
            root_is_dir: is_dir,
            recursive,
            paths: HashMap::new(),
            pending_move: None,
        };
        w.root_wd = w.add(&root, if is_dir { DIR_MASK } else { FILE_MASK })?;
        if recursive {
            match w.add_tree(&root, None) {
                Ok(()) | Err(Stop::Closed) => {}
                Err(Stop::Failed(e)) => return Err(e),
            }
        }
        Ok(w)
    }

    fn add(&mut self, path: &Path, mask: u32) -> Result<i32, WireError> {
        use std::os::unix::ffi::OsStrExt;
        let c = std::ffi::CString::new(path.as_os_str().as_bytes())
            .map_err(|_| WireError::new(ErrorKind::BadRequest, "path contains a NUL byte"))?;
        // SAFETY: a valid C string and an inotify descriptor we own.
        let wd = unsafe { libc::inotify_add_watch(self.fd.as_raw_fd(), c.as_ptr(), mask) };
        if wd < 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::ENOSPC) {
                return Err(WireError::new(
                    ErrorKind::ResourceExhausted,
                    "inotify watch limit reached (fs.inotify.max_user_watches)",
                ));
            }
            return Err(io_error(path, e));
        }
        self.paths.insert(wd, path.to_path_buf());
        Ok(wd)
    }

    /// Watches every directory below `dir`. With `report`, also sends `Created` for every
    /// entry found (a directory that appeared after arming: its contents may predate its watch).
    fn add_tree(&mut self, dir: &Path, report: Option<&mpsc::Sender<WatchEvent>>) -> Sent {
        for entry in walkdir::WalkDir::new(dir).min_depth(1).follow_links(false) {
            // Entries vanishing mid-walk are normal on a busy tree.
            let Ok(entry) = entry else { continue };
            let is_dir = entry.file_type().is_dir();
            if is_dir {
                match self.add(entry.path(), DIR_MASK) {
                    Ok(_) => {}
                    Err(e) if e.kind == ErrorKind::ResourceExhausted => {
                        return Err(Stop::Failed(e));
                    }
                    Err(_) => continue, // gone already, or not a directory any more
                }
            }
            if let Some(tx) = report {
                send(tx, event(EventKind::Created, entry.path(), None, is_dir))?;
            }
        }
        Ok(())
    }

    fn run(&mut self, tx: &mpsc::Sender<WatchEvent>, stop: &OwnedFd) -> Result<(), WireError> {
        match self.pump(tx, stop) {
            Ok(()) | Err(Stop::Closed) => Ok(()),
            Err(Stop::Failed(e)) => Err(e),
        }
    }

    /// Reads and translates events until the root goes away (`Ok`) or something stops it.
    fn pump(&mut self, tx: &mpsc::Sender<WatchEvent>, stop: &OwnedFd) -> Sent {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let mut fds = [
                libc::pollfd { fd: self.fd.as_raw_fd(), events: libc::POLLIN, revents: 0 },
                libc::pollfd { fd: stop.as_raw_fd(), events: libc::POLLIN, revents: 0 },
            ];
            let timeout = if self.pending_move.is_some() { MOVE_PAIR_MS } else { -1 };
            // SAFETY: two valid pollfd entries.
            let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, timeout) };
            if n < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(Stop::Failed(WireError::new(
                    ErrorKind::Internal,
                    format!("poll: {e}"),
                )));
            }
            if fds[1].revents != 0 {
                return Err(Stop::Closed);
            }
            if n == 0 {
                self.flush_move(tx)?; // its partner never came: it left the tree
                continue;
            }
            loop {
                // SAFETY: reads into a valid buffer from our non-blocking descriptor.
                let len =
                    unsafe { libc::read(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
                if len <= 0 {
                    break; // EAGAIN: drained
                }
                let mut at = 0;
                while at + 16 <= len as usize {
                    let word = |i: usize| {
                        let b = &buf[at + i..at + i + 4];
                        u32::from_ne_bytes([b[0], b[1], b[2], b[3]])
                    };
                    let (wd, mask, cookie, name_len) = (word(0) as i32, word(4), word(8), word(12));
                    let name_end = (at + 16 + name_len as usize).min(len as usize);
                    let name = &buf[at + 16..name_end];
                    let name = &name[..name.iter().position(|&b| b == 0).unwrap_or(name.len())];
                    at = name_end;
                    if self.handle(tx, wd, mask, cookie, name)? {
                        return Ok(());
                    }
                }
            }
        }
    }

    /// Translates one inotify event. Returns true when the watched root is gone.
    fn handle(
        &mut self,
        tx: &mpsc::Sender<WatchEvent>,
        wd: i32,
        mask: u32,
        cookie: u32,
        name: &[u8],
    ) -> Result<bool, Stop> {
        if mask & libc::IN_Q_OVERFLOW != 0 {
            return Err(Stop::Failed(overflow("kernel queue")));
        }
        let Some(base) = self.paths.get(&wd).cloned() else { return Ok(false) };
        if mask & libc::IN_IGNORED != 0 {
            self.paths.remove(&wd);
            return Ok(false);
        }
        if mask & (libc::IN_DELETE_SELF | libc::IN_MOVE_SELF) != 0 {
            if wd == self.root_wd {
                self.flush_move(tx)?;
                send(tx, event(EventKind::Deleted, &self.root, None, self.root_is_dir))?;
                return Ok(true);
            }
            return Ok(false); // a subdirectory: its parent's watch reports it
        }
        let is_dir = mask & libc::IN_ISDIR != 0;
        let path = if name.is_empty() {
            base
        } else {
            use std::os::unix::ffi::OsStrExt;
            base.join(std::ffi::OsStr::from_bytes(name))
        };
        if mask & libc::IN_MOVED_TO != 0 {
            if let Some((from_cookie, from, from_dir)) = self.pending_move.take() {
                if from_cookie == cookie {
                    self.moved_within(&from, &path);
                    return send(tx, event(EventKind::Renamed, &from, Some(&path), from_dir))
                        .map(|()| false);
                }
                self.pending_move = Some((from_cookie, from, from_dir));
            }
            self.flush_move(tx)?;
            send(tx, event(EventKind::Created, &path, None, is_dir))?;
            if is_dir && self.recursive {
                self.add_new_dir(&path, tx)?;
            }
            return Ok(false);
        }
        self.flush_move(tx)?;
        if mask & libc::IN_MOVED_FROM != 0 {
            self.pending_move = Some((cookie, path, is_dir));
        } else if mask & libc::IN_CREATE != 0 {
            send(tx, event(EventKind::Created, &path, None, is_dir))?;
            if is_dir && self.recursive {
                self.add_new_dir(&path, tx)?;
            }
        } else if mask & libc::IN_DELETE != 0 {
            send(tx, event(EventKind::Deleted, &path, None, is_dir))?;
        } else if mask & (libc::IN_MODIFY | libc::IN_ATTRIB) != 0
            && (!name.is_empty() || wd == self.root_wd)
        {
            // A directory watch also reports changes to the directory itself (empty name);
            // those reach the client through the parent's watch, except for the root's own.
            send(tx, event(EventKind::Modified, &path, None, is_dir))?;
        }
        Ok(false)
    }

    fn add_new_dir(&mut self, path: &Path, tx: &mpsc::Sender<WatchEvent>) -> Sent {
        match self.add(path, DIR_MASK) {
            Ok(_) => self.add_tree(path, Some(tx)),
            Err(e) if e.kind == ErrorKind::ResourceExhausted => Err(Stop::Failed(e)),
            Err(_) => Ok(()), // already gone
        }
    }

    /// A move out of the tree: report it as deleted and drop the watches that went with it.
    fn flush_move(&mut self, tx: &mpsc::Sender<WatchEvent>) -> Sent {
        let Some((_, from, is_dir)) = self.pending_move.take() else { return Ok(()) };
        if is_dir {
            let gone: Vec<i32> = self
                .paths
                .iter()
                .filter(|(_, p)| p.starts_with(&from))
                .map(|(wd, _)| *wd)
                .collect();
            for wd in gone {
                // SAFETY: plain syscall on our descriptor; a stale wd only yields EINVAL.
                unsafe { libc::inotify_rm_watch(self.fd.as_raw_fd(), wd) };
                self.paths.remove(&wd);
            }
        }
        send(tx, event(EventKind::Deleted, &from, None, is_dir))
    }

    /// A directory moved inside the tree keeps its watches; only the paths they stand for change.
    fn moved_within(&mut self, from: &Path, to: &Path) {
        for path in self.paths.values_mut() {
            if let Ok(rest) = path.strip_prefix(from) {
                *path = to.join(rest);
            }
        }
    }
}

fn event(kind: EventKind, path: &Path, to: Option<&Path>, dir: bool) -> WatchEvent {
    WatchEvent {
        kind,
        path: path.to_string_lossy().into_owned(),
        to: to.map(|p| p.to_string_lossy().into_owned()),
        dir,
    }
}

/// Queues one event; a full queue is an overflow, never a wait or a silent drop.
fn send(tx: &mpsc::Sender<WatchEvent>, event: WatchEvent) -> Sent {
    tx.try_send(event).map_err(|e| match e {
        mpsc::error::TrySendError::Full(_) => Stop::Failed(overflow("silkd queue")),
        mpsc::error::TrySendError::Closed(_) => Stop::Closed,
    })
}
