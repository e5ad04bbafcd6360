//! Files and trees: read (whole, a range, or streamed into a writer), write (bytes or streamed
//! from a reader; atomic on silkd's side), stat, list, mkdir, rm, rename, and push/pull of a
//! local directory or file as a tar stream.
//!
//! Tar work is blocking (the `tar` crate), so it runs on a blocking thread that exchanges
//! `DATA_CHUNK` buffers with the connection through a small channel: the socket and the disk
//! overlap, and memory stays bounded by the channel depth. That plumbing is silkd's too:
//! `silk_proto::tarstream`.
//!
//! Uploads read the connection while they send, so a call silkd fails at its first frame (a
//! missing parent, a path that is not a directory) stops the upload at once instead of sending
//! the rest into the void.
//!
//! A pull's tar stream comes from inside the sandbox, so it is hostile input: it is unpacked by
//! [`untar`], never by tar-rs's own `unpack`.

use std::future::{Future, IntoFuture};
use std::marker::PhantomData;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::pin::Pin;

use bytes::{Bytes, BytesMut};
use silk_proto::tarstream::{self, ChunkReader};
use silk_proto::{DATA_CHUNK, DirEntry, FileStat, Frame, ReadRequest, WriteRequest};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc;

use crate::conn::{RelayConn, recv};
use crate::error::{Error, Result};
use crate::sandbox::Sandbox;

mod untar;

/// Chunks in flight between the tar thread and the socket.
const PIPELINE: usize = 4;

/// How a written file is created.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WriteOptions {
    /// Permission bits of a new file (default 0o644); an existing file keeps its own.
    pub mode: Option<u32>,
    /// Create missing parent directories.
    pub parents: bool,
}

/// Where upload bytes come from.
enum Source<'a> {
    Bytes(Bytes),
    Reader(Pin<Box<dyn AsyncRead + Send + 'a>>),
    Tar(mpsc::Receiver<std::io::Result<Bytes>>),
}

impl Source<'_> {
    /// The next chunk, `None` at the end. Cancel-safe.
    async fn next(&mut self) -> Option<std::io::Result<Bytes>> {
        match self {
            Source::Bytes(b) => (!b.is_empty()).then(|| Ok(b.split_to(b.len().min(DATA_CHUNK)))),
            Source::Reader(r) => {
                let mut buf = BytesMut::with_capacity(DATA_CHUNK);
                match r.read_buf(&mut buf).await {
                    Ok(0) => None,
                    Ok(_) => Some(Ok(buf.freeze())),
                    Err(e) => Some(Err(e)),
                }
            }
            Source::Tar(rx) => rx.recv().await,
        }
    }
}

type Progress<'a> = Option<Box<dyn FnMut(u64) + Send + 'a>>;

impl Sandbox {
    /// A whole file.
    pub async fn read(&self, path: &str) -> Result<Bytes> {
        self.read_range(path, 0, None).await
    }

    /// `len` bytes (to the end when `None`) from `offset`.
    pub async fn read_range(&self, path: &str, offset: u64, len: Option<u64>) -> Result<Bytes> {
        let mut out = BytesMut::new();
        let req = Frame::Read(ReadRequest { path: path.into(), offset, len });
        self.unary(req, |f| match f {
            Frame::Data(b) => {
                out.extend_from_slice(&b);
                Ok(())
            }
            other => Err(Error::unexpected(&other, "read")),
        })
        .await?;
        Ok(out.freeze())
    }

    /// Streams a file into `out`; returns the bytes written.
    pub async fn read_into<W: AsyncWrite + Unpin>(&self, path: &str, out: &mut W) -> Result<u64> {
        let mut conn = self.conn().await?;
        conn.send(&Frame::Read(ReadRequest { path: path.into(), offset: 0, len: None })).await?;
        let mut n = 0;
        loop {
            match conn.recv().await? {
                // A local write error leaves the call half read: the connection is dropped.
                Frame::Data(b) => {
                    out.write_all(&b).await.map_err(Error::Local)?;
                    n += b.len() as u64;
                }
                Frame::Done => {
                    self.put_back(conn);
                    out.flush().await.map_err(Error::Local)?;
                    return Ok(n);
                }
                Frame::Error(e) => {
                    self.put_back(conn);
                    return Err(e.into());
                }
                other => return Err(Error::unexpected(&other, "read")),
            }
        }
    }

    /// Replaces `path` with `data` atomically (readers see the old or the new content).
    pub async fn write(&self, path: &str, data: impl Into<Bytes>) -> Result<()> {
        self.write_with(path, data, WriteOptions::default()).await
    }

    pub async fn write_with(
        &self,
        path: &str,
        data: impl Into<Bytes>,
        opts: WriteOptions,
    ) -> Result<()> {
        let req = write_request(path, opts);
        self.upload(req, Source::Bytes(data.into()), &mut None).await.map(drop)
    }

    /// Streams `reader` into `path` (atomic: nothing changes unless the stream ends cleanly);
    /// returns the bytes sent.
    pub async fn write_from<R: AsyncRead + Send>(
        &self,
        path: &str,
        reader: R,
        opts: WriteOptions,
    ) -> Result<u64> {
        let req = write_request(path, opts);
        self.upload(req, Source::Reader(Box::pin(reader)), &mut None).await
    }

    /// Metadata of `path` (a final symlink is not followed).
    pub async fn stat(&self, path: &str) -> Result<FileStat> {
        let mut stat = None;
        self.unary(Frame::Stat { path: path.into() }, |f| match f {
            Frame::StatReply(s) => {
                stat = Some(s);
                Ok(())
            }
            other => Err(Error::unexpected(&other, "stat")),
        })
        .await?;
        stat.ok_or_else(|| Error::Protocol("stat ended without a reply".into()))
    }

    /// The entries of a directory.
    pub async fn list(&self, path: &str) -> Result<Vec<DirEntry>> {
        let mut all = vec![];
        self.unary(Frame::List { path: path.into() }, |f| match f {
            Frame::Entries(mut batch) => {
                all.append(&mut batch);
                Ok(())
            }
            other => Err(Error::unexpected(&other, "list")),
        })
        .await?;
        Ok(all)
    }

    /// Creates a directory (and its missing parents with `parents`).
    pub async fn mkdir(&self, path: &str, parents: bool) -> Result<()> {
        let req = Frame::Mkdir { path: path.into(), parents };
        self.unary(req, |f| Err(Error::unexpected(&f, "mkdir"))).await
    }

    /// Removes a file or an empty directory; a whole tree with `recursive`.
    pub async fn rm(&self, path: &str, recursive: bool) -> Result<()> {
        let req = Frame::Rm { path: path.into(), recursive };
        self.unary(req, |f| Err(Error::unexpected(&f, "rm"))).await
    }

    pub async fn rename(&self, from: &str, to: &str) -> Result<()> {
        let req = Frame::Rename { from: from.into(), to: to.into() };
        self.unary(req, |f| Err(Error::unexpected(&f, "rename"))).await
    }

    /// Copies a local directory's content into `remote_dir` (created if missing; directories
    /// merge, files are replaced), or a local file into `remote_dir/<its name>`. Atomic on
    /// silkd's side: nothing changes unless the whole stream arrived. Resolves to the tar bytes
    /// sent.
    pub fn push(&self, local: impl AsRef<Path>, remote_dir: &str) -> Transfer<'_> {
        self.transfer(Kind::Push, local.as_ref(), remote_dir)
    }

    /// Copies one local file to exactly `remote_path`, streamed and atomic; a new file gets the
    /// local file's mode, an existing one keeps its own. Resolves to the bytes sent.
    pub fn push_file(&self, local: impl AsRef<Path>, remote_path: &str) -> Transfer<'_> {
        self.transfer(Kind::PushFile, local.as_ref(), remote_path)
    }

    /// Copies a remote directory's content into `local_dir` (created if missing), or a remote
    /// file into `local_dir/<its name>`. Symlinks stay symlinks; the stream is treated as hostile:
    /// nothing is written outside `local_dir` or through a symlink, devices and FIFOs are skipped,
    /// set-id bits are cleared, ownership is not applied. Resolves to a [`PullReport`] that counts
    /// what was left out.
    pub fn pull(&self, remote: &str, local_dir: impl AsRef<Path>) -> Transfer<'_, PullReport> {
        self.transfer(Kind::Pull, local_dir.as_ref(), remote)
    }

    /// Copies one remote file to exactly `local_path` (mode kept, set-id bits cleared); an
    /// existing file or symlink there is replaced, not written through.
    pub fn pull_file(
        &self,
        remote_path: &str,
        local_path: impl AsRef<Path>,
    ) -> Transfer<'_, PullReport> {
        self.transfer(Kind::PullFile, local_path.as_ref(), remote_path)
    }

    fn transfer<T>(&self, kind: Kind, local: &Path, remote: &str) -> Transfer<'_, T> {
        Transfer {
            sandbox: self,
            kind,
            local: local.into(),
            remote: remote.into(),
            progress: None,
            output: PhantomData,
        }
    }

    /// Sends `request`, then the source as `Data` frames and `Eof`; expects `Done`.
    async fn upload(
        &self,
        request: Frame,
        mut source: Source<'_>,
        progress: &mut Progress<'_>,
    ) -> Result<u64> {
        let mut conn = self.conn().await?;
        conn.send(&request).await?;
        let RelayConn { rd, wr } = &mut conn;
        let mut sent = 0u64;
        let early = loop {
            // Both branches are cancel-safe; sending is not, so it happens outside the select.
            let chunk = tokio::select! {
                biased;
                frame = recv(rd) => break Some(frame?),
                chunk = source.next() => chunk,
            };
            match chunk {
                Some(Ok(data)) => {
                    sent += data.len() as u64;
                    wr.send(&Frame::Data(data)).await?;
                    if let Some(p) = progress {
                        p(sent);
                    }
                }
                // Dropping the connection mid-upload makes silkd discard what it got.
                Some(Err(e)) => return Err(Error::Local(e)),
                None => {
                    wr.send(&Frame::Eof).await?;
                    break None;
                }
            }
        };
        let eof_sent = early.is_none();
        let terminal = match early {
            Some(f) => f,
            None => recv(rd).await?,
        };
        match terminal {
            Frame::Done if eof_sent => {
                self.put_back(conn);
                Ok(sent)
            }
            // The call is over; silkd discards input frames that arrive after it, and none is
            // half sent, so the connection is clean.
            Frame::Error(e) => {
                self.put_back(conn);
                Err(e.into())
            }
            other => Err(Error::unexpected(&other, "upload")),
        }
    }
}

fn write_request(path: &str, opts: WriteOptions) -> Frame {
    Frame::Write(WriteRequest { path: path.into(), mode: opts.mode, parents: opts.parents })
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Push,
    PushFile,
    Pull,
    PullFile,
}

/// A push or pull; `.await` it, optionally after [`progress`](Self::progress). A push resolves to
/// the tar bytes sent (`T = u64`), a pull to a [`PullReport`].
#[must_use = "a Transfer does nothing until awaited"]
pub struct Transfer<'a, T = u64> {
    sandbox: &'a Sandbox,
    kind: Kind,
    local: PathBuf,
    remote: String,
    progress: Progress<'a>,
    output: PhantomData<fn() -> T>,
}

/// What a [`Sandbox::pull`] or [`Sandbox::pull_file`] received, and what of the tar stream it left
/// out or changed because a sandbox must not plant it on this machine (see `docs/sdk.md`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PullReport {
    /// Tar bytes received.
    pub bytes: u64,
    /// Character and block device entries skipped.
    pub skipped_devices: u64,
    /// FIFO entries skipped.
    pub skipped_fifos: u64,
    /// Entries skipped because their path is absolute, has a `..` component, or goes through a
    /// symlink or a non-directory.
    pub skipped_unsafe_paths: u64,
    /// Hard links skipped because their target is not a regular file this pull extracted inside
    /// the destination, and symlinks with an empty target.
    pub skipped_links: u64,
    /// Entries extracted with their set-uid or set-gid bit cleared.
    pub cleared_setid: u64,
}

impl PullReport {
    /// The entries left out, of every kind.
    pub fn skipped(&self) -> u64 {
        self.skipped_devices + self.skipped_fifos + self.skipped_unsafe_paths + self.skipped_links
    }
}

impl<T> std::fmt::Debug for Transfer<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Transfer")
            .field("kind", &self.kind)
            .field("local", &self.local)
            .field("remote", &self.remote)
            .finish()
    }
}

impl<'a, T> Transfer<'a, T> {
    /// Called with the tar bytes moved so far, after each chunk.
    pub fn progress(mut self, f: impl FnMut(u64) + Send + 'a) -> Self {
        self.progress = Some(Box::new(f));
        self
    }
}

impl Transfer<'_> {
    async fn run(mut self) -> Result<u64> {
        match self.kind {
            Kind::PushFile => {
                // A streamed `Write` rather than a one-entry push: silkd stages a push beside
                // its target directory, which fails when that directory is a mount point (a
                // sandbox's `/tmp`), while a write's temp file sits beside the file itself.
                let meta = std::fs::metadata(&self.local).map_err(Error::Local)?;
                if !meta.is_file() {
                    return Err(Error::Invalid(format!("{} is not a file", self.local.display())));
                }
                let file = tokio::fs::File::open(&self.local).await.map_err(Error::Local)?;
                let opts =
                    WriteOptions { mode: Some(meta.permissions().mode() & 0o7777), parents: false };
                let req = write_request(&self.remote, opts);
                self.sandbox.upload(req, Source::Reader(Box::pin(file)), &mut self.progress).await
            }
            Kind::Push => {
                let meta = std::fs::metadata(&self.local).map_err(Error::Local)?;
                let rx = build_tar(self.local.clone(), meta.is_dir());
                let req = Frame::Push { path: self.remote.clone() };
                self.sandbox.upload(req, Source::Tar(rx), &mut self.progress).await
            }
            Kind::Pull | Kind::PullFile => unreachable!("a pull is a Transfer<PullReport>"),
        }
    }
}

impl Transfer<'_, PullReport> {
    async fn download(mut self) -> Result<PullReport> {
        let (tx, rx) = mpsc::channel::<Bytes>(PIPELINE);
        let target = self.local.clone();
        let single = self.kind == Kind::PullFile;
        let extract = tokio::task::spawn_blocking(move || extract_tar(rx, &target, single));
        let mut conn = self.sandbox.conn().await?;
        conn.send(&Frame::Pull { path: self.remote.clone() }).await?;
        let mut got = 0u64;
        let outcome = loop {
            match conn.recv().await? {
                Frame::Data(b) => {
                    got += b.len() as u64;
                    if tx.send(b).await.is_err() {
                        // The extractor stopped; its error says why. The call is half read, so
                        // the connection goes with it.
                        drop(conn);
                        break Err(None);
                    }
                    if let Some(p) = &mut self.progress {
                        p(got);
                    }
                }
                Frame::Done => {
                    self.sandbox.put_back(conn);
                    break Ok(());
                }
                Frame::Error(e) => {
                    self.sandbox.put_back(conn);
                    break Err(Some(Error::from(e)));
                }
                other => break Err(Some(Error::unexpected(&other, "pull"))),
            }
        };
        drop(tx);
        let extracted = extract
            .await
            .map_err(|e| Error::Local(std::io::Error::other(format!("tar thread: {e}"))))?;
        match outcome {
            Ok(()) => extracted.map(|report| PullReport { bytes: got, ..report }),
            Err(Some(e)) => Err(e),
            Err(None) => extracted.and(Err(Error::closed())),
        }
    }
}

impl<'a> IntoFuture for Transfer<'a> {
    type Output = Result<u64>;
    type IntoFuture = Pin<Box<dyn Future<Output = Result<u64>> + Send + 'a>>;

    fn into_future(self) -> Self::IntoFuture {
        Box::pin(self.run())
    }
}

impl<'a> IntoFuture for Transfer<'a, PullReport> {
    type Output = Result<PullReport>;
    type IntoFuture = Pin<Box<dyn Future<Output = Result<PullReport>> + Send + 'a>>;

    fn into_future(self) -> Self::IntoFuture {
        Box::pin(self.download())
    }
}

/// Builds the tar stream of `local` on a blocking thread. A directory is sent as its content
/// (`./…` entries, as silkd's own pull does); a file as one entry under its own name.
fn build_tar(local: PathBuf, is_dir: bool) -> mpsc::Receiver<std::io::Result<Bytes>> {
    let shown = local.clone();
    tarstream::build(local, is_dir, PIPELINE, move |e| {
        // Same kind, so callers can still tell a missing file from a permission problem.
        std::io::Error::new(e.kind(), format!("{}: {e}", shown.display()))
    })
}

/// Unpacks the tar stream from `rx` into the directory `target`, or with `single`, writes its one
/// regular-file entry to the path `target`. The stream is hostile input: see [`untar`]. The
/// report's `bytes` is left to the caller.
fn extract_tar(rx: mpsc::Receiver<Bytes>, target: &Path, single: bool) -> Result<PullReport> {
    let mut reader = ChunkReader::new(rx);
    let report = if single {
        untar::unpack_file(&mut reader, target)?
    } else {
        untar::unpack_tree(&mut reader, target)?
    };
    // Read to the channel's end so the sender never blocks on a full channel.
    std::io::copy(&mut reader, &mut std::io::sink()).map_err(Error::Local)?;
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_tree_survives_the_tar_pipeline() {
        let src = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(src.path().join("d/e")).unwrap();
        std::fs::write(src.path().join("d/e/f.txt"), vec![9u8; 3 * DATA_CHUNK + 5]).unwrap();
        std::os::unix::fs::symlink("e/f.txt", src.path().join("d/link")).unwrap();
        let mut rx = build_tar(src.path().into(), true);
        let (tx, crx) = mpsc::channel(PIPELINE);
        let dst = tempfile::tempdir().unwrap();
        let target = dst.path().join("out");
        let t2 = target.clone();
        let extract = tokio::task::spawn_blocking(move || extract_tar(crx, &t2, false));
        while let Some(chunk) = rx.recv().await {
            tx.send(chunk.unwrap()).await.unwrap();
        }
        drop(tx);
        let report = extract.await.unwrap().unwrap();
        assert_eq!(report.skipped() + report.cleared_setid, 0);
        assert_eq!(std::fs::read(target.join("d/e/f.txt")).unwrap().len(), 3 * DATA_CHUNK + 5);
        assert_eq!(std::fs::read_link(target.join("d/link")).unwrap(), Path::new("e/f.txt"));
    }
}
