//! `write`'s data path: the file's bytes go from the socket into the file with splice(2),
//! through a pipe, never through silkd's memory. Reading them would be a third copy beside the
//! sender's and the page cache's; `silkbench agent` has the before and after.
//!
//! One blocking thread owns the upload: it reads each frame's header exactly (so no payload
//! lands in a buffer), splices each `Data` payload, and stops at `Eof` (the temp file becomes the
//! file) or `Cancel`. Its state machine is [`silk_proto::front`]; this module is the I/O. The
//! async side waits for it, and hangs up on it if the connection ends first ([`Abandon`]).
//! Where the kernel cannot splice from the socket or into the file it reads and writes instead.

use std::fs::File;
use std::io::Write;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};

use bytes::{Buf, BytesMut};
use silk_proto::{ErrorKind, Frame, Front, ProtoError, WireError};
use tokio::io::{AsyncRead, ReadBuf};

use super::io_error;
use crate::call::Fail;

/// A connection's read half with its socket's descriptor, which stays valid while the half
/// lives. Calls that move bulk bytes off the socket with splice(2) use the descriptor.
pub struct SocketReader<R> {
    half: R,
    fd: RawFd,
}

impl<R> SocketReader<R> {
    pub fn new(half: R, fd: RawFd) -> Self {
        SocketReader { half, fd }
    }

    pub fn fd(&self) -> RawFd {
        self.fd
    }
}

impl<R: AsyncRead + Unpin> AsyncRead for SocketReader<R> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.half).poll_read(cx, buf)
    }
}

/// Bytes moved per splice: the pipe's size (the default 64 KiB would take four round trips
/// through the pipe per 256 KiB frame).
const PIPE_BYTES: usize = 1 << 20;

/// The async side's end of an upload: dropped (the call ended, or the connection was closed
/// under it), it tells the thread to stop, waking it if it waits for the socket.
pub struct Abandon {
    stopped: Arc<AtomicBool>,
    _wake: OwnedFd,
}

impl Drop for Abandon {
    fn drop(&mut self) {
        self.stopped.store(true, Ordering::Relaxed);
    }
}

/// An upload, as the blocking thread holds it.
pub struct Upload {
    /// The thread's own reference to the socket (a duplicate: closing the connection does not
    /// pull the descriptor from under it).
    sock: OwnedFd,
    /// Hung up when [`Abandon`] is dropped.
    wake: OwnedFd,
    stopped: Arc<AtomicBool>,
    /// Read but not yet used: what the connection had buffered, then each header.
    buf: BytesMut,
    pipe: Option<(OwnedFd, OwnedFd)>,
    can_splice: bool,
}

/// How an upload's stream ended.
#[derive(Debug, PartialEq, Eq)]
enum Ended {
    Eof,
    Cancel,
}

impl Upload {
    /// An upload reading socket `fd`.
    pub fn new(fd: RawFd) -> std::io::Result<(Upload, Abandon)> {
        // SAFETY: F_DUPFD_CLOEXEC of a descriptor the caller's connection holds open.
        let dup = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
        if dup < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `dup` was just made and is ours.
        let sock = unsafe { OwnedFd::from_raw_fd(dup) };
        let (wake, wake_end) = pipe()?;
        let stopped = Arc::new(AtomicBool::new(false));
        let upload = Upload {
            sock,
            wake,
            stopped: stopped.clone(),
            buf: BytesMut::new(),
            pipe: None,
            can_splice: true,
        };
        Ok((upload, Abandon { stopped, _wake: wake_end }))
    }

    /// Receives the stream, starting with the `buffered` bytes the connection had already read
    /// from the socket, into `tmp` (opened as `file`) and, at `Eof`, renames it to `path`. The
    /// temp file is removed on any other ending. Returns with the bytes read past the stream's
    /// end: they belong to the connection's next call.
    pub fn run(
        mut self,
        buffered: BytesMut,
        file: File,
        tmp: PathBuf,
        path: PathBuf,
    ) -> (Result<(), Fail>, BytesMut) {
        self.buf = buffered;
        let result = match self.receive(&file, &path) {
            Ok(Ended::Eof) => {
                std::fs::rename(&tmp, &path).map_err(|e| Fail::Call(io_error(&path, e)))
            }
            Ok(Ended::Cancel) => {
                Err(Fail::Call(WireError::new(ErrorKind::Conflict, "write cancelled")))
            }
            Err(e) => Err(e),
        };
        if result.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        (result, self.buf)
    }

    fn receive(&mut self, mut file: &File, path: &Path) -> Result<Ended, Fail> {
        loop {
            match silk_proto::front(&self.buf).map_err(Fail::Conn)? {
                Front::Need(n) => self.read_exact(n)?,
                Front::Data { header, payload } => {
                    self.buf.advance(header);
                    let here = payload.min(self.buf.len());
                    let mut failed = file.write_all(&self.buf[..here]).err();
                    self.buf.advance(here);
                    let mut rest = payload - here;
                    if failed.is_none() && rest > 0 {
                        failed = self.splice_into(file, &mut rest)?.err();
                    }
                    // The frame's unwritten rest is read and dropped, so the connection stays
                    // on a frame boundary; the call loop drops the frames after it.
                    self.discard(rest)?;
                    if let Some(e) = failed {
                        return Err(Fail::Call(io_error(path, e)));
                    }
                }
                Front::Other { len } => {
                    if self.buf.len() < len {
                        self.read_exact(len - self.buf.len())?;
                    }
                    let frame = silk_proto::decode(&mut self.buf).map_err(Fail::Conn)?;
                    return match frame.expect("a whole frame is buffered") {
                        Frame::Eof => Ok(Ended::Eof),
                        Frame::Cancel => Ok(Ended::Cancel),
                        other => Err(Fail::Call(WireError::new(
                            ErrorKind::BadRequest,
                            format!("{} sent during a write; nothing was written", other.name()),
                        ))),
                    };
                }
            }
        }
    }

    /// Moves `rest` bytes from the socket into `file`. The outer error is the connection's;
    /// the inner one the file's, with `rest` left at what was not taken off the socket.
    fn splice_into(&mut self, file: &File, rest: &mut usize) -> Result<std::io::Result<()>, Fail> {
        while *rest > 0 && self.can_splice {
            let (pipe_rd, pipe_wr) = self.pipe().map_err(|e| Fail::Conn(e.into()))?;
            self.check_stopped()?;
            // The pipe is empty here (each fill is drained below), so `EAGAIN` means the
            // socket has nothing yet.
            let in_pipe =
                match splice(self.sock.as_raw_fd(), pipe_wr, (*rest).min(PIPE_BYTES), true) {
                    Ok(0) => return Err(Fail::Conn(ProtoError::Truncated)),
                    Ok(n) => n,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        self.wait_readable()?;
                        continue;
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    // This socket cannot be spliced from (or splice is refused): read and
                    // write instead. A broken connection fails that read in turn.
                    Err(_) => {
                        self.can_splice = false;
                        break;
                    }
                };
            *rest -= in_pipe;
            if let Err(e) = self.drain(pipe_rd, file, in_pipe) {
                self.pipe = None; // it goes with its bytes: the write has failed anyway
                return Ok(Err(e));
            }
        }
        self.copy_into(file, rest)
    }

    /// The pipe's (read end, write end), made on first use.
    fn pipe(&mut self) -> std::io::Result<(RawFd, RawFd)> {
        if self.pipe.is_none() {
            let (r, w) = pipe()?;
            // SAFETY: fcntl on the pipe just made. A smaller pipe only splices less at a time.
            unsafe { libc::fcntl(w.as_raw_fd(), libc::F_SETPIPE_SZ, PIPE_BYTES as libc::c_int) };
            self.pipe = Some((r, w));
        }
        let (r, w) = self.pipe.as_ref().expect("made above");
        Ok((r.as_raw_fd(), w.as_raw_fd()))
    }

    /// Moves the `n` bytes in the pipe into `file`: spliced, or through memory where the file
    /// cannot take a splice (and then later payloads skip the pipe too).
    fn drain(&mut self, pipe_rd: RawFd, mut file: &File, mut n: usize) -> std::io::Result<()> {
        let mut chunk = vec![];
        while n > 0 {
            if !self.can_splice {
                chunk.resize(n.min(64 << 10), 0);
                // SAFETY: read into a buffer of `chunk.len()` bytes.
                let got = unsafe { libc::read(pipe_rd, chunk.as_mut_ptr().cast(), chunk.len()) };
                match got {
                    0 => return Err(std::io::ErrorKind::UnexpectedEof.into()),
                    1.. => {
                        file.write_all(&chunk[..got as usize])?;
                        n -= got as usize;
                    }
                    _ => match std::io::Error::last_os_error() {
                        e if e.kind() == std::io::ErrorKind::Interrupted => {}
                        e => return Err(e),
                    },
                }
                continue;
            }
            match splice(pipe_rd, file.as_raw_fd(), n, false) {
                Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
                Ok(m) => n -= m,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => self.can_splice = false,
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Moves `rest` bytes from the socket into `file` through memory.
    fn copy_into(
        &mut self,
        mut file: &File,
        rest: &mut usize,
    ) -> Result<std::io::Result<()>, Fail> {
        let mut chunk = vec![0u8; (*rest).min(PIPE_BYTES)];
        while *rest > 0 {
            let want = (*rest).min(chunk.len());
            let got = self.read_some(&mut chunk[..want])?;
            *rest -= got;
            if let Err(e) = file.write_all(&chunk[..got]) {
                return Ok(Err(e));
            }
        }
        Ok(Ok(()))
    }

    /// Reads and drops `rest` bytes.
    fn discard(&mut self, mut rest: usize) -> Result<(), Fail> {
        let mut chunk = vec![0u8; rest.min(64 << 10)];
        while rest > 0 {
            let want = rest.min(chunk.len());
            rest -= self.read_some(&mut chunk[..want])?;
        }
        Ok(())
    }

    /// Reads exactly `n` more bytes onto the end of the buffer (headers and small frames).
    fn read_exact(&mut self, mut n: usize) -> Result<(), Fail> {
        let mut chunk = [0u8; 4096];
        while n > 0 {
            let got = self.read_some(&mut chunk[..n.min(4096)])?;
            self.buf.extend_from_slice(&chunk[..got]);
            n -= got;
        }
        Ok(())
    }

    /// One read of at most `into.len()` bytes (at least one), waiting for the socket.
    fn read_some(&mut self, into: &mut [u8]) -> Result<usize, Fail> {
        loop {
            self.check_stopped()?;
            // SAFETY: read into the caller's slice, within its length.
            let got =
                unsafe { libc::read(self.sock.as_raw_fd(), into.as_mut_ptr().cast(), into.len()) };
            if got > 0 {
                return Ok(got as usize);
            }
            if got == 0 {
                return Err(Fail::Conn(ProtoError::Truncated));
            }
            let e = std::io::Error::last_os_error();
            match e.kind() {
                std::io::ErrorKind::WouldBlock => self.wait_readable()?,
                std::io::ErrorKind::Interrupted => {}
                _ => return Err(Fail::Conn(e.into())),
            }
        }
    }

    /// Waits until the socket has bytes (or its peer hung up), or the upload is abandoned.
    fn wait_readable(&self) -> Result<(), Fail> {
        let mut fds = [
            libc::pollfd { fd: self.sock.as_raw_fd(), events: libc::POLLIN, revents: 0 },
            libc::pollfd { fd: self.wake.as_raw_fd(), events: libc::POLLIN, revents: 0 },
        ];
        loop {
            // SAFETY: poll over two pollfds this function owns.
            let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
            if n >= 0 {
                break;
            }
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::Interrupted {
                return Err(Fail::Conn(e.into()));
            }
        }
        self.check_stopped()
    }

    fn check_stopped(&self) -> Result<(), Fail> {
        if self.stopped.load(Ordering::Relaxed) {
            return Err(Fail::Conn(ProtoError::Io(std::io::Error::new(
                std::io::ErrorKind::ConnectionAborted,
                "the connection ended during the write",
            ))));
        }
        Ok(())
    }
}

/// A pipe, both ends close-on-exec: (read end, write end).
fn pipe() -> std::io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: pipe2 into a local array of two.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: both descriptors were just made and are ours.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// splice(2) of up to `len` bytes from `from` to `to` at their current offsets.
fn splice(from: RawFd, to: RawFd, len: usize, nonblock: bool) -> std::io::Result<usize> {
    let flags = libc::SPLICE_F_MOVE | if nonblock { libc::SPLICE_F_NONBLOCK } else { 0 };
    // SAFETY: splice between descriptors the caller holds, no offsets.
    let n =
        unsafe { libc::splice(from, std::ptr::null_mut(), to, std::ptr::null_mut(), len, flags) };
    if n < 0 { Err(std::io::Error::last_os_error()) } else { Ok(n as usize) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixStream;

    /// The spliced path and the read-and-write one it falls back to move the same bytes, from
    /// frames of every size, starting from bytes the connection had buffered, and stop at `Eof`.
    #[test]
    fn spliced_and_copied_uploads_move_every_byte() {
        for can_splice in [true, false] {
            let (client, server) = UnixStream::pair().unwrap();
            server.set_nonblocking(true).unwrap();
            let mut wire = BytesMut::new();
            let mut expected = vec![];
            for (i, n) in [5usize, 0, 262_144, 1, 1_500_000, 70_000].into_iter().enumerate() {
                let chunk: Vec<u8> = (0..n).map(|j| (j * 13 + i) as u8).collect();
                expected.extend_from_slice(&chunk);
                silk_proto::encode(&Frame::Data(chunk.into()), &mut wire).unwrap();
            }
            silk_proto::encode(&Frame::Eof, &mut wire).unwrap();
            silk_proto::encode(&Frame::Info, &mut wire).unwrap();
            // The connection had read the first 100 bytes already.
            let buffered = wire.split_to(100);
            let sender = std::thread::spawn(move || {
                let mut client = client;
                client.write_all(&wire).unwrap();
                client // kept open: the upload must stop at `Eof`, not at the close
            });
            let dir = tempfile::tempdir().unwrap();
            let (tmp, path) = (dir.path().join("tmp"), dir.path().join("f"));
            let file = File::create(&tmp).unwrap();
            let (mut upload, _abandon) = Upload::new(server.as_raw_fd()).unwrap();
            upload.can_splice = can_splice;
            let (result, leftover) = upload.run(buffered, file, tmp.clone(), path.clone());
            let _client = sender.join().unwrap();
            assert!(result.is_ok(), "splice {can_splice}: {:?}", result.err().map(|_| ()));
            assert_eq!(std::fs::read(&path).unwrap(), expected, "splice {can_splice}");
            assert!(!tmp.exists());
            // Headers are read exactly: the next call's frame is still on the socket.
            assert!(leftover.is_empty(), "{leftover:?}");
            server.set_nonblocking(false).unwrap();
            let mut next = BytesMut::zeroed(5);
            std::io::Read::read_exact(&mut &server, &mut next).unwrap();
            assert_eq!(silk_proto::decode(&mut next).unwrap(), Some(Frame::Info));
        }
    }
}
