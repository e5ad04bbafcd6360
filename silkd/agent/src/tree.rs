//! Tree verbs: `push` (a tar stream extracted into a directory) and `pull` (a path as a tar
//! stream).
//!
//! `push` extracts into a staging directory beside the target and merges only after the client's
//! stream ended with `Eof` and the archive unpacked cleanly; a broken or cancelled stream removes
//! the staging directory and leaves the target as it was. The merge moves entries with `rename`
//! (directories are merged, anything else replaces what is there), as `tar -x` would.

use std::path::{Path, PathBuf};

use bytes::Bytes;
use silk_proto::tarstream::{self, ChunkReader};
use silk_proto::{ErrorKind, Frame, FrameReader, FrameWriter, ProtoError, WireError};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::mpsc;

use crate::call::{CallResult, Fail};
use crate::files::{blocking, checked_path, io_error, unique_suffix};

const PIPELINE: usize = 4;

pub async fn pull<W: AsyncWrite + Unpin>(path: String, wr: &mut FrameWriter<W>) -> CallResult {
    let path = checked_path(&path)?;
    let meta = std::fs::symlink_metadata(&path).map_err(|e| io_error(&path, e))?;
    // A failure part way ends the call with an error naming the path.
    let mut rx =
        tarstream::build(path.clone(), meta.is_dir(), PIPELINE, move |e| io_error(&path, e));
    while let Some(chunk) = rx.recv().await {
        wr.send(&Frame::Data(chunk?)).await?;
    }
    Ok(wr.send(&Frame::Done).await?)
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

    // Bytes from `Data` frames for the unpacker; the channel's close is a clean end, an `Err`
    // (see `aborted`) an aborted stream.
    let (tx, rx) = mpsc::channel::<std::io::Result<Bytes>>(PIPELINE);
    let unpack = {
        let staging = staging.clone();
        tokio::task::spawn_blocking(move || -> Result<(), WireError> {
            let mut reader = ChunkReader::new(rx);
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
        let _ = tx.send(Err(aborted())).await;
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

/// What the unpacker reads when the client's stream broke off: the archive must not be merged.
fn aborted() -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::BrokenPipe, "stream aborted")
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
