//! File verbs: `read` (streamed), `write` (streamed, atomic), `stat`, `list`, `mkdir`, `rm`,
//! `rename`.
//!
//! Bulk transfers run the disk side on a blocking thread, so a slow disk or client never stalls
//! silkd's other connections. A read is joined to the connection by a short bounded channel (disk
//! and socket work overlap, and a slow client slows the disk side down instead of filling
//! memory); a write's thread moves the bytes from the socket into the file itself (`splice`).
//! Relative paths resolve against silkd's working directory.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use bytes::{Bytes, BytesMut};
use silk_proto::{
    DATA_CHUNK, DirEntry, ErrorKind, FileKind, FileStat, Frame, FrameReader, FrameWriter,
    ReadRequest, WireError, WriteRequest,
};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::mpsc;

use crate::call::{CallResult, Fail};

mod splice;
pub use splice::SocketReader;
use splice::Upload;

/// Entries per `Entries` frame.
const LIST_BATCH: usize = 256;
/// Chunks in flight between a read's disk thread and the socket.
const PIPELINE: usize = 4;

/// Maps an I/O error to the wire's error kinds, naming the path.
pub fn io_error(path: &Path, err: std::io::Error) -> WireError {
    use std::io::ErrorKind as Io;
    let kind = match err.kind() {
        Io::NotFound => ErrorKind::NotFound,
        Io::PermissionDenied | Io::ReadOnlyFilesystem => ErrorKind::PermissionDenied,
        Io::AlreadyExists | Io::DirectoryNotEmpty | Io::CrossesDevices => ErrorKind::Conflict,
        Io::IsADirectory | Io::NotADirectory | Io::InvalidInput | Io::InvalidFilename => {
            ErrorKind::BadRequest
        }
        Io::StorageFull | Io::QuotaExceeded | Io::FileTooLarge => ErrorKind::ResourceExhausted,
        _ => ErrorKind::Internal,
    };
    WireError::new(kind, format!("{}: {err}", path.display()))
}

pub fn checked_path(path: &str) -> Result<PathBuf, WireError> {
    if path.is_empty() || path.contains('\0') {
        return Err(WireError::new(ErrorKind::BadRequest, format!("bad path {path:?}")));
    }
    Ok(PathBuf::from(path))
}

/// Runs blocking filesystem work off the async threads.
pub async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, WireError> + Send + 'static,
) -> Result<T, WireError> {
    tokio::task::spawn_blocking(f)
        .await
        .unwrap_or_else(|e| Err(WireError::new(ErrorKind::Internal, format!("worker failed: {e}"))))
}

pub fn to_stat(meta: &std::fs::Metadata) -> FileStat {
    let ft = meta.file_type();
    let kind = if ft.is_file() {
        FileKind::File
    } else if ft.is_dir() {
        FileKind::Dir
    } else if ft.is_symlink() {
        FileKind::Symlink
    } else {
        FileKind::Other
    };
    FileStat {
        kind,
        size: meta.len(),
        mode: meta.mode() & 0o7777,
        uid: meta.uid(),
        gid: meta.gid(),
        mtime_ms: meta.mtime() * 1000 + meta.mtime_nsec() / 1_000_000,
    }
}

pub async fn read<W: AsyncWrite + Unpin>(req: ReadRequest, wr: &mut FrameWriter<W>) -> CallResult {
    let path = checked_path(&req.path)?;
    let file = File::open(&path).map_err(|e| io_error(&path, e))?;
    let meta = file.metadata().map_err(|e| io_error(&path, e))?;
    if meta.is_dir() {
        return Err(Fail::Call(WireError::new(
            ErrorKind::BadRequest,
            format!("{} is a directory", path.display()),
        )));
    }
    let (tx, mut rx) = mpsc::channel::<Result<Bytes, WireError>>(PIPELINE);
    tokio::task::spawn_blocking(move || {
        let mut offset = req.offset;
        let mut remaining = req.len.unwrap_or(u64::MAX);
        while remaining > 0 {
            let want = remaining.min(DATA_CHUNK as u64) as usize;
            let chunk = pread_chunk(&file, offset, want).map_err(|e| io_error(&path, e));
            let done = matches!(&chunk, Ok(b) if b.is_empty()) || chunk.is_err();
            if let Ok(b) = &chunk {
                offset += b.len() as u64;
                remaining -= b.len() as u64;
            }
            if done {
                if chunk.is_err() {
                    let _ = tx.blocking_send(chunk);
                }
                return;
            }
            if tx.blocking_send(chunk).is_err() {
                return; // the client is gone
            }
        }
    });
    while let Some(chunk) = rx.recv().await {
        wr.send(&Frame::Data(chunk?)).await?;
    }
    Ok(wr.send(&Frame::Done).await?)
}

/// Reads up to `want` bytes at `offset` into a fresh buffer without zero-filling it first.
fn pread_chunk(file: &File, offset: u64, want: usize) -> std::io::Result<Bytes> {
    let mut buf = BytesMut::with_capacity(want);
    loop {
        // SAFETY: the pointer and length describe the buffer's spare capacity, which `pread`
        // writes and `set_len` then exposes only up to the count it returned.
        let n = unsafe {
            libc::pread(file.as_raw_fd(), buf.as_mut_ptr().cast(), want, offset as libc::off_t)
        };
        if n >= 0 {
            unsafe { buf.set_len(n as usize) };
            return Ok(buf.freeze());
        }
        let err = std::io::Error::last_os_error();
        if err.kind() != std::io::ErrorKind::Interrupted {
            return Err(err);
        }
    }
}

/// `Write`: the stream's `Data` into a temp file beside `path`, renamed over it at `Eof`. The
/// bytes go from the socket into the file without passing through silkd (`splice`).
pub async fn write<R, W>(
    req: WriteRequest,
    rd: &mut FrameReader<SocketReader<R>>,
    wr: &mut FrameWriter<W>,
) -> CallResult
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let path = checked_path(&req.path)?;
    let (tmp, file) = open_temp_for(&path, req.mode, req.parents)?;
    let (upload, _abandon) = match Upload::new(rd.get_mut().fd()) {
        Ok(made) => made,
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            return Err(Fail::Call(io_error(&path, e)));
        }
    };
    let buffered = std::mem::take(rd.buffered());
    let (result, leftover) =
        tokio::task::spawn_blocking(move || upload.run(buffered, file, tmp, path))
            .await
            .map_err(|e| WireError::new(ErrorKind::Internal, format!("writer failed: {e}")))?;
    *rd.buffered() = leftover;
    result?;
    Ok(wr.send(&Frame::Done).await?)
}

/// Opens a new temp file beside `path` with the mode (and owner) the final file must have.
pub fn open_temp_for(
    path: &Path,
    mode: Option<u32>,
    parents: bool,
) -> Result<(PathBuf, File), WireError> {
    let name = path.file_name().and_then(|n| n.to_str()).ok_or_else(|| {
        WireError::new(ErrorKind::BadRequest, format!("{} names no file", path.display()))
    })?;
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    if parents {
        std::fs::create_dir_all(parent).map_err(|e| io_error(parent, e))?;
    }
    match std::fs::metadata(parent) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => {
            return Err(WireError::new(
                ErrorKind::BadRequest,
                format!("{} is not a directory", parent.display()),
            ));
        }
        Err(e) => return Err(io_error(parent, e)),
    }
    let existing = match std::fs::metadata(path) {
        Ok(m) if m.is_dir() => {
            return Err(WireError::new(
                ErrorKind::BadRequest,
                format!("{} is a directory", path.display()),
            ));
        }
        Ok(m) => Some(m),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(io_error(path, e)),
    };
    let mode = existing.as_ref().map(|m| m.mode() & 0o7777).or(mode).unwrap_or(0o644);
    let tmp = parent.join(format!(".{name}.silk-{}", unique_suffix()));
    let file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(&tmp)
        .map_err(|e| io_error(&tmp, e))?;
    // The umask may have narrowed the mode; an existing file's owner carries over.
    let fixed =
        file.set_permissions(std::fs::Permissions::from_mode(mode)).and_then(
            |()| match &existing {
                Some(m) => std::os::unix::fs::fchown(&file, Some(m.uid()), Some(m.gid())),
                None => Ok(()),
            },
        );
    if let Err(e) = fixed {
        let _ = std::fs::remove_file(&tmp);
        return Err(io_error(&tmp, e));
    }
    Ok((tmp, file))
}

/// A name suffix unique within this host for temp and staging files.
pub fn unique_suffix() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    format!("{}-{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed))
}

pub async fn stat<W: AsyncWrite + Unpin>(path: String, wr: &mut FrameWriter<W>) -> CallResult {
    let path = checked_path(&path)?;
    let meta = std::fs::symlink_metadata(&path).map_err(|e| io_error(&path, e))?;
    wr.queue(&Frame::StatReply(to_stat(&meta)))?;
    Ok(wr.send(&Frame::Done).await?)
}

pub async fn list<W: AsyncWrite + Unpin>(path: String, wr: &mut FrameWriter<W>) -> CallResult {
    let path = checked_path(&path)?;
    let (tx, mut rx) = mpsc::channel::<Result<Vec<DirEntry>, WireError>>(PIPELINE);
    tokio::task::spawn_blocking(move || {
        let entries = match std::fs::read_dir(&path) {
            Ok(entries) => entries,
            Err(e) => {
                let _ = tx.blocking_send(Err(io_error(&path, e)));
                return;
            }
        };
        let mut batch = Vec::with_capacity(LIST_BATCH);
        for entry in entries {
            // An entry removed while listing is simply not listed.
            let Ok(entry) = entry else { continue };
            let Ok(meta) = entry.metadata() else { continue };
            batch.push(DirEntry {
                name: entry.file_name().to_string_lossy().into_owned(),
                stat: to_stat(&meta),
            });
            if batch.len() == LIST_BATCH
                && tx.blocking_send(Ok(std::mem::take(&mut batch))).is_err()
            {
                return;
            }
        }
        if !batch.is_empty() {
            let _ = tx.blocking_send(Ok(batch));
        }
    });
    while let Some(batch) = rx.recv().await {
        wr.send(&Frame::Entries(batch?)).await?;
    }
    Ok(wr.send(&Frame::Done).await?)
}

pub async fn mkdir<W: AsyncWrite + Unpin>(
    path: String,
    parents: bool,
    wr: &mut FrameWriter<W>,
) -> CallResult {
    let path = checked_path(&path)?;
    let made = if parents { std::fs::create_dir_all(&path) } else { std::fs::create_dir(&path) };
    made.map_err(|e| io_error(&path, e))?;
    Ok(wr.send(&Frame::Done).await?)
}

pub async fn rm<W: AsyncWrite + Unpin>(
    path: String,
    recursive: bool,
    wr: &mut FrameWriter<W>,
) -> CallResult {
    let path = checked_path(&path)?;
    blocking(move || {
        let meta = std::fs::symlink_metadata(&path).map_err(|e| io_error(&path, e))?;
        let removed = match (meta.is_dir(), recursive) {
            (false, _) => std::fs::remove_file(&path),
            (true, true) => std::fs::remove_dir_all(&path),
            (true, false) => std::fs::remove_dir(&path),
        };
        removed.map_err(|e| io_error(&path, e))
    })
    .await?;
    Ok(wr.send(&Frame::Done).await?)
}

pub async fn rename<W: AsyncWrite + Unpin>(
    from: String,
    to: String,
    wr: &mut FrameWriter<W>,
) -> CallResult {
    let (from, to) = (checked_path(&from)?, checked_path(&to)?);
    std::fs::rename(&from, &to).map_err(|e| io_error(&from, e))?;
    Ok(wr.send(&Frame::Done).await?)
}

pub async fn chown<W: AsyncWrite + Unpin>(
    path: String,
    user: String,
    wr: &mut FrameWriter<W>,
) -> CallResult {
    let path = checked_path(&path)?;
    let user = crate::users::lookup(&user)?;
    std::os::unix::fs::lchown(&path, Some(user.uid), Some(user.gid))
        .map_err(|e| io_error(&path, e))?;
    Ok(wr.send(&Frame::Done).await?)
}
