//! Snapshots streamed between the store (or a peer) and the engine, with no tar file of the whole
//! between them. Into the store, the engine writes on a blocking thread into a spool
//! (`super::spool`) that the store's put reads from behind as pieces, what the engine shares (its
//! mapped memory images) uncopied; to a peer, into a pipe. Out of the store
//! ([`Node::download_into`]), or from a peer moving a sandbox here, the chunks go as they are to
//! the engine's restore, which reads them as they arrive ([`Node::restore_arriving`]).
//! Uploads are safe for two reasons:
//!
//! - **Whole or nothing.** A capture that fails half way ends the stream without the writer's
//!   word that it wrote everything, and the store's end (the spool's reader; a peer's, [`Whole`])
//!   turns that into an error, so no part of a snapshot is ever stored as the whole.
//! - **The writer's pace.** A stopped sandbox's capture ([`Pace::Store`]) waits for the store
//!   past a few MiB in flight. A running sandbox stays frozen while its capture writes: there
//!   ([`Pace::Spool`]: a checkpoint) the capture goes into memory, or past the node's bound for
//!   that into a scratch file, and the store reads it from behind, so the freeze lasts the
//!   capture, not the upload, and the upload still runs beside the capture rather than after it.

use std::io::Read;

use bytes::Bytes;
use futures_util::StreamExt;
use std::sync::atomic::AtomicBool;

use silk_engine::EngineError;

use crate::node::fleet::SnapshotBytes;

use super::*;

/// Who sets the pace of a streamed snapshot's writer.
pub(in crate::node) enum Pace {
    /// The store's: the writer waits while the store takes the bytes (a stopped sandbox).
    Store,
    /// The capture's own: spooled in memory or a scratch file (a running sandbox, frozen
    /// meanwhile). The stream ends only once the call passed its crash point `captured` (see
    /// `crash_point`).
    Spool { captured: &'static str },
}

impl Node {
    /// Stores as `name` what `write` writes, run on a blocking thread; see the module docs.
    pub(in crate::node) async fn upload_stream(
        &self,
        name: &SnapshotName,
        meta: BTreeMap<String, String>,
        pace: Pace,
        write: impl FnOnce(&mut dyn silk_engine::SnapshotSink) -> Result<Streamed, EngineError>
        + Send
        + 'static,
    ) -> Result<(silk_store::PutReport, Streamed), NodeError> {
        // The stream ends whole only on `go`, sent once the capture is written and, for a
        // running sandbox's, the call passed its crash point: a crash there commits nothing.
        let (go, gone) = tokio::sync::oneshot::channel();
        let (mut out, reader, point) = match pace {
            // A stopped sandbox: the writer may wait on the store, nothing to spill.
            Pace::Store => {
                let (out, reader) = super::spool::paced(gone, self.store.signs());
                (out, reader, None)
            }
            Pace::Spool { captured } => {
                let path = self.scratch_tar("spool");
                let (out, reader) = super::spool::spool(&path, gone, self.store.signs())
                    .map_err(|e| NodeError::internal(format!("spool {}: {e}", path.display())))?;
                (out, reader, Some(captured))
            }
        };
        let cut_short = reader.cut_short();
        let put = self.store.put_pieces(name, reader, meta);
        let capture = async move {
            let written = blocking(move || {
                let written = write(&mut out);
                out.finish(written.is_ok());
                written
            })
            .await;
            if let (Ok(_), Some(point)) = (&written, point) {
                self.crash_point(point).await;
            }
            let _ = go.send(());
            written
        };
        match tokio::join!(put, capture) {
            (Ok(report), Ok(streamed)) => Ok((report, streamed)),
            // The capture failed, and the store stopped at its end (a capture that failed after
            // the store did only met the closed stream: the store's error says more).
            (Err(_), Err(e)) if cut_short.load(Ordering::Acquire) => Err(e),
            (Err(e), _) => Err(e.into()),
            (Ok(_), Err(e)) => Err(e),
        }
    }
}

impl Node {
    /// What `write` writes on a blocking thread, as a stream for a peer (`Fleet::hand_over`)
    /// that ends in an error unless it wrote everything. The reader sets the pace: for a
    /// stopped sandbox only (a running one would stay frozen for as long).
    pub(in crate::node) fn capture_stream(
        &self,
        write: impl FnOnce(&mut dyn silk_engine::SnapshotSink) -> Result<Streamed, EngineError>
        + Send
        + 'static,
    ) -> Result<SnapshotBytes, NodeError> {
        let pipe = |e: std::io::Error| NodeError::internal(format!("pipe: {e}"));
        let (reader, writer) = wide_pipe().map_err(pipe)?;
        let reader =
            tokio::net::unix::pipe::Receiver::from_owned_fd(reader.into()).map_err(pipe)?;
        let whole = Whole::new(reader);
        let captured = whole.captured.clone();
        tokio::task::spawn_blocking(move || {
            let mut writer = writer;
            let written = write(&mut writer);
            if let Err(e) = &written {
                tracing::warn!("capturing a sandbox's files for a peer: {e}");
            }
            // Before the writer closes: the reader takes its end for the snapshot's end.
            captured.store(written.is_ok(), Ordering::Release);
        });
        Ok(Box::pin(whole))
    }

    /// `bytes` stopping at the crash point `point` once part of them was read (see
    /// `crash_point`): a stream cut short mid-way.
    #[cfg(feature = "crash-points")]
    pub(in crate::node) fn crash_point_within(
        self: &std::sync::Arc<Self>,
        point: &'static str,
        bytes: SnapshotBytes,
    ) -> SnapshotBytes {
        let node = self.clone();
        let stop = Box::pin(async move { node.crash_point(point).await });
        Box::pin(StopWithin { bytes, stop: Some(stop), read: false })
    }
}

#[cfg(feature = "crash-points")]
struct StopWithin {
    bytes: SnapshotBytes,
    stop: Option<std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>>,
    read: bool,
}

#[cfg(feature = "crash-points")]
impl tokio::io::AsyncRead for StopWithin {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        if self.read
            && let Some(stop) = self.stop.as_mut()
        {
            std::task::ready!(std::future::Future::poll(stop.as_mut(), cx));
            self.stop = None;
        }
        let before = buf.filled().len();
        std::task::ready!(tokio::io::AsyncRead::poll_read(self.bytes.as_mut(), cx, buf))?;
        self.read |= buf.filled().len() > before;
        std::task::Poll::Ready(Ok(()))
    }
}

/// A pipe that holds 1 MiB rather than 64 KiB: a snapshot crosses it in 1 MiB steps, not in
/// 1600 hand-offs (each a wake-up of the other side) per 100 MiB.
fn wide_pipe() -> std::io::Result<(std::io::PipeReader, std::io::PipeWriter)> {
    use std::os::fd::AsRawFd;
    let (reader, writer) = std::io::pipe()?;
    // SAFETY: fcntl(2) on a descriptor we own. Refused above /proc/sys/fs/pipe-max-size (a
    // host that lowered it): the default size then, which only costs speed.
    unsafe { libc::fcntl(writer.as_raw_fd(), libc::F_SETPIPE_SZ, 1 << 20) };
    Ok((reader, writer))
}

/// Where the bytes of a snapshot being restored come from.
pub(super) enum Arriving {
    /// The store: the snapshot whose manifest the caller read.
    Store(silk_store::Manifest),
    /// A peer moving a sandbox here: its stream ends in an error unless the peer finished it.
    Peer(Box<dyn tokio::io::AsyncRead + Send + Unpin>),
}

impl Node {
    /// Restores the snapshot `stored` as its bytes arrive: `restore` runs on a blocking thread
    /// and reads them, and what it reads ends in an error unless all of them came, so a
    /// download or hand-over cut short never passes for a whole snapshot. It gets the snapshot
    /// with its `layer_tar` a scratch path, for an engine that restores from a file. Returns
    /// what `restore` made.
    pub(super) async fn restore_arriving<T: Send + 'static>(
        &self,
        stored: &StoredSnapshot,
        from: Arriving,
        restore: impl FnOnce(&mut dyn Read, &Snapshot) -> Result<T, EngineError> + Send + 'static,
    ) -> Result<T, NodeError> {
        // Every snapshot restored becomes files on this disk (a branch, a wake from an archive,
        // a move).
        self.room_on_disk().await?;
        let base = self.local_base(stored).await?;
        // A manifest signed with the fleet's key vouches for every byte its chunks give (each
        // is checked against its id): the engine skips the images' own MAC.
        let (bytes, vouched) = match &from {
            Arriving::Store(manifest) => (manifest.size, self.store.vouches_for(manifest)),
            Arriving::Peer(_) => (0, false),
        };
        let mut snap = stored.local(base, self.scratch_tar("download"), bytes);
        snap.vouched = vouched;
        // The bytes cross to the engine's thread as they came (a chunk, a read from the
        // peer), copied once, where they reach the engine's reads; a pipe copied them twice.
        let (tx, rx) = tokio::sync::mpsc::channel(ARRIVING);
        let input = Arrived {
            pieces: rx,
            piece: Bytes::new(),
            whole: Default::default(),
            cut_short: Default::default(),
        };
        let (whole, cut_short) = (input.whole.clone(), input.cut_short.clone());
        let s = snap.clone();
        let restored = blocking(move || {
            let mut input = input;
            restore(&mut input, &s)
        });
        let gone = || NodeError::internal("the restore stopped reading");
        let fetched = async move {
            let got = match from {
                Arriving::Store(manifest) => {
                    let mut chunks = std::pin::pin!(self.store.chunks(&manifest));
                    loop {
                        match chunks.next().await {
                            Some(Ok(chunk)) => tx.send(chunk).await.map_err(|_| gone())?,
                            Some(Err(e)) => break Err(NodeError::from(e)),
                            None => break Ok(()),
                        }
                    }
                }
                Arriving::Peer(mut files) => {
                    use tokio::io::AsyncReadExt;
                    let mut buf = bytes::BytesMut::new();
                    loop {
                        // 1 MiB at a time, the buffer reused once the engine is done with it.
                        buf.reserve(1 << 20);
                        match files.read_buf(&mut buf).await {
                            Ok(0) => break Ok(()),
                            Ok(_) => tx.send(buf.split().freeze()).await.map_err(|_| gone())?,
                            Err(e) => {
                                let e = format!("the files stopped short: {e}");
                                break Err(NodeError::internal(e));
                            }
                        }
                    }
                }
            };
            // Before the channel closes: the engine takes its end for the snapshot's end.
            whole.store(got.is_ok(), Ordering::Release);
            drop(tx);
            got
        };
        let (restored, fetched) = tokio::join!(restored, fetched);
        let _ = std::fs::remove_file(&snap.layer_tar);
        match (restored, fetched) {
            // The engine read to the stream's end, which ends whole only once everything came.
            (Ok(made), Ok(())) => Ok(made),
            // The bytes stopped short, and the engine at their end: the source says why.
            (Err(_), Err(e)) if cut_short.load(Ordering::Acquire) => Err(e),
            // The engine stopped first (the source then met the closed pipe).
            (Err(e), _) => Err(e),
            (Ok(_), Err(e)) => Err(e),
        }
    }

    /// [`Node::restore_arriving`] from the store's snapshot `name` (its `manifest`, which the
    /// caller read), as described by the manifest.
    pub(in crate::node) async fn download_into<T: Send + 'static>(
        &self,
        name: &SnapshotName,
        manifest: silk_store::Manifest,
        restore: impl FnOnce(&mut dyn Read, &Snapshot) -> Result<T, EngineError> + Send + 'static,
    ) -> Result<T, NodeError> {
        let json = manifest
            .meta
            .get("snapshot")
            .ok_or_else(|| NodeError::internal(format!("{name} has no snapshot metadata")))?;
        let stored = StoredSnapshot::parse(json)
            .map_err(|e| NodeError::internal(format!("{name}: snapshot metadata: {e}")))?;
        self.restore_arriving(&stored, Arriving::Store(manifest), restore).await
    }
}

/// Pieces in flight to the engine's thread at once (chunks of up to 4 MiB, reads of 1 MiB).
const ARRIVING: usize = 8;

/// The engine's end of a download (or a peer's stream): the pieces as they come, ending in an
/// error unless the download said it sent everything.
struct Arrived {
    pieces: tokio::sync::mpsc::Receiver<Bytes>,
    /// What is left of the piece being read.
    piece: Bytes,
    /// Set by the download, before it closes the channel, when it sent everything.
    whole: std::sync::Arc<AtomicBool>,
    /// Set here when the channel closed without that.
    cut_short: std::sync::Arc<AtomicBool>,
}

impl Read for Arrived {
    /// Called on a blocking thread (it waits for the next piece).
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        while self.piece.is_empty() {
            match self.pieces.blocking_recv() {
                Some(piece) => self.piece = piece,
                None if self.whole.load(Ordering::Acquire) => return Ok(0),
                None => {
                    self.cut_short.store(true, Ordering::Release);
                    let why = "the download stopped short of the snapshot's end";
                    return Err(std::io::Error::other(why));
                }
            }
        }
        let n = buf.len().min(self.piece.len());
        buf[..n].copy_from_slice(&self.piece.split_to(n));
        Ok(n)
    }
}

/// The store's end of a capture's pipe, which ends in an error unless the writer said it wrote
/// everything.
struct Whole {
    pipe: tokio::net::unix::pipe::Receiver,
    /// Set by the writer, before it closes the pipe, when it wrote everything.
    captured: std::sync::Arc<AtomicBool>,
    /// Set here when the pipe ended without that.
    cut_short: std::sync::Arc<AtomicBool>,
}

impl Whole {
    fn new(pipe: tokio::net::unix::pipe::Receiver) -> Whole {
        Whole { pipe, captured: Default::default(), cut_short: Default::default() }
    }
}

impl tokio::io::AsyncRead for Whole {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        std::task::ready!(std::pin::Pin::new(&mut self.pipe).poll_read(cx, buf))?;
        let ended = buf.filled().len() == before && buf.remaining() > 0;
        if ended && !self.captured.load(Ordering::Acquire) {
            self.cut_short.store(true, Ordering::Release);
            return std::task::Poll::Ready(Err(std::io::Error::other("the capture failed")));
        }
        std::task::Poll::Ready(Ok(()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn arrived() -> (Arrived, tokio::sync::mpsc::Sender<Bytes>) {
        let (tx, pieces) = tokio::sync::mpsc::channel(4);
        let input = Arrived {
            pieces,
            piece: Bytes::new(),
            whole: Default::default(),
            cut_short: Default::default(),
        };
        (input, tx)
    }

    #[test]
    fn a_download_that_stops_short_ends_its_stream_in_an_error() {
        // A tar can end at any entry's boundary: without this, the engine would take the
        // bytes that arrived for the whole snapshot.
        let (mut input, tx) = arrived();
        tx.blocking_send(Bytes::from_static(b"part ")).unwrap();
        tx.blocking_send(Bytes::from_static(b"of it")).unwrap();
        drop(tx);
        let mut got = vec![];
        let err = input.read_to_end(&mut got).unwrap_err();
        assert!(err.to_string().contains("stopped short"), "{err}");
        assert_eq!(got, b"part of it");
        assert!(input.cut_short.load(Ordering::Acquire));

        let (mut input, tx) = arrived();
        tx.blocking_send(Bytes::from_static(b"all of it")).unwrap();
        input.whole.store(true, Ordering::Release);
        drop(tx);
        let mut got = [0u8; 4];
        input.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"all ");
        let mut rest = vec![];
        input.read_to_end(&mut rest).unwrap();
        assert_eq!(rest, b"of it");
        assert!(!input.cut_short.load(Ordering::Acquire));
    }
}
