//! Tree verbs: `push` (a tar stream extracted into a directory) and `pull` (a path as a tar
//! stream).
//!
//! `push` extracts into a staging directory beside the target and merges only after the client's
//! stream ended with `Eof` and the archive unpacked cleanly; a broken or cancelled stream removes
//! the staging directory and leaves the target as it was. The merge moves entries with `rename`
//! (directories are merged, anything else replaces what is there), as `tar -x` would.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use bytes::{Buf, Bytes, BytesMut};
use silk_proto::{DATA_CHUNK, ErrorKind, Frame, FrameReader, FrameWriter, ProtoError, WireError};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::mpsc;

use crate::files::{blocking, checked_path, io_error, unique_suffix};
use crate::server::{CallResult, Fail};

const PIPELINE: usize = 4;

pub async fn pull<W: AsyncWrite + Unpin>(path: String, wr: &mut FrameWriter<W>) -> CallResult {
    let path = checked_path(&path)?;
    let meta = std::fs::symlink_metadata(&path).map_err(|e| io_error(&path, e))?;
    let (tx, mut rx) = mpsc::channel::<Result<Bytes, WireError>>(PIPELINE);
    tokio::task::spawn_blocking(move || {
        let out = ChannelWriter { tx: tx.clone(), buf: BytesMut::new() };
        let mut tar = tar::Builder::new(out);
        tar.follow_symlinks(false);
        let built = if meta.is_dir() {
            tar.append_dir_all(".", &path)
        } else {
            let name = path.file_name().map(PathBuf::from).unwrap_or_else(|| "file".into());
            tar.append_path_with_name(&path, name)
        };
        let result = built.and_then(|()| tar.into_inner()).and_then(|mut out| out.flush());
        if let Err(e) = result {
            // A closed channel means the client left; anything else is worth reporting.
            let _ = tx.blocking_send(Err(io_error(&path, e)));
        }
    });
    while let Some(chunk) = rx.recv().await {
        wr.send(&Frame::Data(chunk?)).await?;
    }
    Ok(wr.send(&Frame::Done).await?)
}

/// `Write` side of the pull pipeline: fills `DATA_CHUNK` buffers and hands them to the socket.
struct ChannelWriter {
    tx: mpsc::Sender<Result<Bytes, WireError>>,
    buf: BytesMut,
}

impl Write for ChannelWriter {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        let n = data.len().min(DATA_CHUNK - self.buf.len());
        self.buf.extend_from_slice(&data[..n]);
        if self.buf.len() == DATA_CHUNK {
            self.flush()?;
        }
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let chunk = self.buf.split().freeze();
        self.buf.reserve(DATA_CHUNK);
        self.tx
            .blocking_send(Ok(chunk))
            .map_err(|_| std::io::Error::new(std::io::ErrorKind::BrokenPipe, "client gone"))
    }
}

/// `Read` side of the push pipeline: bytes from `Data` frames; `None` is a clean end, `Err` an
/// aborted stream.
struct ChannelReader {
    rx: mpsc::Receiver<Result<Bytes, ()>>,
    cur: Bytes,
}

impl Read for ChannelReader {
    fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
        while self.cur.is_empty() {
            match self.rx.blocking_recv() {
                Some(Ok(data)) => self.cur = data,
                Some(Err(())) => {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::BrokenPipe,
                        "stream aborted",
                    ));
                }
                None => return Ok(0),
            }
        }
        let n = out.len().min(self.cur.len());
        out[..n].copy_from_slice(&self.cur[..n]);
        self.cur.advance(n);
        Ok(n)
    }
}

pub async fn push<R, W>(
    path: String,
    rd: &mut FrameReader<R>,
    wr: &mut FrameWriter<W>,
) -> CallResult
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let dest = checked_path(&path)?;
    match std::fs::metadata(&dest) {
        Ok(m) if !m.is_dir() => {
            return Err(Fail::Call(WireError::new(
                ErrorKind::BadRequest,
                format!("{} is not a directory", dest.display()),
            )));
        }
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(Fail::Call(io_error(&dest, e))),
    }
    // Stage on the target's own filesystem so the merge is a rename: inside an existing target
    // (it may be a mount point, like /tmp), beside a new one.
    let parent = match dest.parent() {
        _ if dest.is_dir() => dest.clone(),
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let staging = parent.join(format!(".silk-push-{}", unique_suffix()));
    std::fs::create_dir(&staging).map_err(|e| io_error(&staging, e))?;

    let (tx, rx) = mpsc::channel::<Result<Bytes, ()>>(PIPELINE);
    let unpack = {
        let staging = staging.clone();
        tokio::task::spawn_blocking(move || -> Result<(), WireError> {
            let mut reader = ChannelReader { rx, cur: Bytes::new() };
            let mut archive = tar::Archive::new(&mut reader);
            archive.set_preserve_permissions(true);
            archive.set_preserve_mtime(true);
            archive.set_overwrite(true);
            archive.unpack(&staging).map_err(|e| {
                WireError::new(ErrorKind::BadRequest, format!("bad tar stream: {e}"))
            })?;
            // Drain what follows the end-of-archive marker so the stream's end is observed.
            std::io::copy(&mut reader, &mut std::io::sink()).map_err(|e| {
                WireError::new(ErrorKind::BadRequest, format!("stream aborted: {e}"))
            })?;
            Ok(())
        })
    };

    let outcome: Result<(), Fail> = async {
        loop {
            let frame = match rd.recv().await {
                Ok(Some(frame)) => frame,
                Ok(None) => return Err(Fail::Conn(ProtoError::Truncated)),
                Err(e) => return Err(Fail::Conn(e)),
            };
            match frame {
                Frame::Data(data) => {
                    // A send error means the unpacker stopped; its result says why.
                    if tx.send(Ok(data)).await.is_err() {
                        break;
                    }
                }
                Frame::Eof => break,
                Frame::Cancel => {
                    return Err(Fail::Call(WireError::new(ErrorKind::Conflict, "push cancelled")));
                }
                other => {
                    return Err(Fail::Call(WireError::new(
                        ErrorKind::BadRequest,
                        format!("{} sent during a push; nothing was changed", other.name()),
                    )));
                }
            }
        }
        Ok(())
    }
    .await;
    if outcome.is_err() {
        let _ = tx.send(Err(())).await;
    }
    drop(tx);
    let unpacked = unpack.await.unwrap_or_else(|e| {
        Err(WireError::new(ErrorKind::Internal, format!("unpacker failed: {e}")))
    });
    let merged = match (outcome, unpacked) {
        (Err(fail), _) => Err(fail),
        (Ok(()), Err(e)) => Err(Fail::Call(e)),
        (Ok(()), Ok(())) => {
            let (staging, dest) = (staging.clone(), dest.clone());
            blocking(move || merge(&staging, &dest)).await.map_err(Fail::Call)
        }
    };
    let _ = std::fs::remove_dir_all(&staging);
    merged?;
    Ok(wr.send(&Frame::Done).await?)
}

/// Moves the staged tree into `dest`.
fn merge(staging: &Path, dest: &Path) -> Result<(), WireError> {
    if std::fs::symlink_metadata(dest).is_err() {
        return std::fs::rename(staging, dest).map_err(|e| io_error(dest, e));
    }
    merge_into(staging, dest)
}

fn merge_into(from: &Path, into: &Path) -> Result<(), WireError> {
    for entry in std::fs::read_dir(from).map_err(|e| io_error(from, e))? {
        let entry = entry.map_err(|e| io_error(from, e))?;
        let src = entry.path();
        let dst = into.join(entry.file_name());
        let src_is_dir = entry.file_type().map_err(|e| io_error(&src, e))?.is_dir();
        let dst_is_dir = std::fs::symlink_metadata(&dst).map(|m| m.is_dir()).unwrap_or(false);
        if src_is_dir && dst_is_dir {
            merge_into(&src, &dst)?;
        } else {
            if dst_is_dir {
                std::fs::remove_dir_all(&dst).map_err(|e| io_error(&dst, e))?;
            }
            std::fs::rename(&src, &dst).map_err(|e| io_error(&dst, e))?;
        }
    }
    Ok(())
}
