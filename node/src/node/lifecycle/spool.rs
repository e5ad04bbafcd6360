//! A capture on its way into the store: the engine writes it on a blocking thread
//! ([`SpoolWriter`]) and the store reads it from behind ([`SpoolReader`]) as pieces. A running
//! sandbox's ([`super::Pace::Spool`], [`spool`]) goes into memory, or past the node's bound for
//! that into a scratch file, so the freeze lasts the capture, not the upload; a stopped
//! sandbox's ([`super::Pace::Store`], [`paced`]) waits for the store past a few MiB. What the
//! engine shares rather than writes (its mapped memory images:
//! [`silk_engine::SnapshotSink::share`]) is passed on as it is, uncopied, in both.

use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::Poll;

use bytes::{Bytes, BytesMut};

/// Bytes of all spools on this node held in memory at once; past it a capture goes to its
/// scratch file. A checkpoint's capture outruns the store's put (chunking and hashing), so
/// without room in memory most of it would be written to disk and read back.
const SPOOL_MEMORY: usize = 256 << 20;

/// What the spools on this node hold in memory now, against [`SPOOL_MEMORY`].
static SPOOLED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Emptied buffers a spool keeps for its next writes (fresh ones cost a page fault per 4 KiB).
const SPARE_BUFFERS: usize = 4;

/// The most read from the scratch file as one piece.
const FILE_PIECE: u64 = 4 << 20;

/// What a [`paced`] spool holds of written bytes before its writer waits for the store.
const PACED_ROOM: usize = 8 << 20;

/// A capture one thread writes and the store reads behind it ([`SpoolReader`]), in order: in
/// memory while there is room ([`SPOOL_MEMORY`]), in a scratch file past it; or, paced, in
/// memory up to [`PACED_ROOM`] while its writer waits for more.
#[derive(Default)]
struct Spool {
    progress: Mutex<Progress>,
    /// Buffers the store is done with, for the writer's next parts.
    spare: Mutex<Vec<Vec<u8>>>,
    /// A [`paced`] spool's written bytes not yet dropped by the store, and its writer's wait.
    paced: Option<(Mutex<usize>, std::sync::Condvar)>,
    /// The reader is gone: the writer stops (also out of a paced wait).
    closed: AtomicBool,
}

#[derive(Default)]
struct Progress {
    parts: std::collections::VecDeque<Part>,
    /// Whether the writer wrote everything, once it is done.
    done: Option<bool>,
    /// The reader, waiting for the next part.
    waker: Option<std::task::Waker>,
}

/// A stretch of the capture, in the order written.
enum Part {
    Memory(Held),
    /// This many bytes next in the scratch file.
    File(u64),
    /// Bytes the engine shared: already in memory (mapped files), so neither copied nor
    /// counted.
    Shared(Bytes),
}

/// Spooled bytes in memory, counted in [`SPOOLED`] (or a paced spool's own room) until dropped;
/// then the buffer goes back to its spool's spares.
struct Held {
    buf: Vec<u8>,
    home: std::sync::Weak<Spool>,
    /// Counted in its paced spool's room, not in [`SPOOLED`].
    paced: bool,
}

impl Held {
    /// `bytes` copied into a spare buffer of `spool`'s, when there is room: for a paced spool
    /// once the store dropped enough of what it held (`Err` if the store went), else if the
    /// node's spools have room (`Ok(None)` if not).
    fn copy(bytes: &[u8], spool: &Arc<Spool>) -> std::io::Result<Option<Held>> {
        if let Some((held, freed)) = &spool.paced {
            let mut held = held.lock().unwrap_or_else(|e| e.into_inner());
            while *held > 0 && *held + bytes.len() > PACED_ROOM {
                if spool.closed.load(Ordering::Acquire) {
                    return Err(stopped_reading());
                }
                held = freed.wait(held).unwrap_or_else(|e| e.into_inner());
            }
            *held += bytes.len();
        } else if SPOOLED
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |now| {
                (now + bytes.len() <= SPOOL_MEMORY).then_some(now + bytes.len())
            })
            .is_err()
        {
            return Ok(None);
        }
        let mut buf = spool.spares().pop().unwrap_or_default();
        buf.clear();
        buf.extend_from_slice(bytes);
        Ok(Some(Held { buf, home: Arc::downgrade(spool), paced: spool.paced.is_some() }))
    }
}

fn stopped_reading() -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::BrokenPipe, "the upload stopped reading")
}

impl AsRef<[u8]> for Held {
    fn as_ref(&self) -> &[u8] {
        &self.buf
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        // Even when the spool is gone (an aborted upload's chunk may outlive it): the node's
        // count is shared by every spool.
        if !self.paced {
            SPOOLED.fetch_sub(self.buf.len(), Ordering::AcqRel);
        }
        let Some(spool) = self.home.upgrade() else { return };
        if let Some((held, freed)) = &spool.paced {
            *held.lock().unwrap_or_else(|e| e.into_inner()) -= self.buf.len();
            freed.notify_all();
        }
        let mut spare = spool.spares();
        if spare.len() < SPARE_BUFFERS {
            spare.push(std::mem::take(&mut self.buf));
        }
    }
}

impl Spool {
    fn progress(&self) -> std::sync::MutexGuard<'_, Progress> {
        self.progress.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn spares(&self) -> std::sync::MutexGuard<'_, Vec<Vec<u8>>> {
        self.spare.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Adds `part`, unless the reader is gone.
    fn push(&self, part: Part) -> std::io::Result<()> {
        let mut p = self.progress();
        if self.closed.load(Ordering::Acquire) {
            drop(p);
            drop(part);
            return Err(stopped_reading());
        }
        match (p.parts.back_mut(), part) {
            (Some(Part::File(last)), Part::File(n)) => *last += n,
            (_, part) => p.parts.push_back(part),
        }
        let waker = p.waker.take();
        drop(p);
        if let Some(waker) = waker {
            waker.wake();
        }
        Ok(())
    }

    fn finish(&self, whole: bool) {
        let mut p = self.progress();
        p.done = Some(whole);
        let waker = p.waker.take();
        drop(p);
        if let Some(waker) = waker {
            waker.wake();
        }
    }
}

/// A spool whose parts past memory go into a scratch file made at `path`: the writer's end,
/// and the store's end, which ends whole only once the writer finished whole and `go` came.
/// `vouched`: the store signs what it stores, and vouches for it when read back
/// ([`silk_engine::SnapshotSink::vouched`]).
pub(super) fn spool(
    path: &std::path::Path,
    go: tokio::sync::oneshot::Receiver<()>,
    vouched: bool,
) -> std::io::Result<(SpoolWriter, SpoolReader)> {
    let file = std::fs::File::create(path)?;
    let behind = std::fs::File::open(path);
    let _ = std::fs::remove_file(path); // both ends are open: nothing to sweep
    let spool = Arc::new(Spool::default());
    let writer = SpoolWriter { file: Some(file), spool: spool.clone(), vouched };
    Ok((writer, SpoolReader::new(spool, Some(behind?), go)))
}

/// A spool for a stopped sandbox's capture: no scratch file, and its writer waits while the
/// store has not yet dropped [`PACED_ROOM`] of what it wrote (shared bytes hold no room: they
/// are the engine's mapped files). Its end comes on `go`, as [`spool`]'s.
pub(super) fn paced(
    go: tokio::sync::oneshot::Receiver<()>,
    vouched: bool,
) -> (SpoolWriter, SpoolReader) {
    let paced = Some((Mutex::new(0), std::sync::Condvar::new()));
    let spool = Arc::new(Spool { paced, ..Spool::default() });
    let writer = SpoolWriter { file: None, spool: spool.clone(), vouched };
    (writer, SpoolReader::new(spool, None, go))
}

pub(super) struct SpoolWriter {
    /// Where a spilling spool's writes go past the node's memory for spools.
    file: Option<std::fs::File>,
    spool: Arc<Spool>,
    vouched: bool,
}

impl SpoolWriter {
    /// The capture is over: all of it (`whole`), or it failed.
    pub(super) fn finish(&self, whole: bool) {
        self.spool.finish(whole);
    }
}

impl Write for SpoolWriter {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        if bytes.is_empty() {
            return Ok(0);
        }
        let (part, n) = match (Held::copy(bytes, &self.spool)?, &mut self.file) {
            (Some(held), _) => (Part::Memory(held), bytes.len()),
            (None, Some(file)) => {
                let n = file.write(bytes)?;
                (Part::File(n as u64), n)
            }
            (None, None) => unreachable!("a paced spool always holds what it is given"),
        };
        self.spool.push(part)?;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl silk_engine::SnapshotSink for SpoolWriter {
    fn share(&mut self, bytes: Bytes) -> std::io::Result<()> {
        if bytes.is_empty() {
            return Ok(());
        }
        self.spool.push(Part::Shared(bytes))
    }

    fn vouched(&self) -> bool {
        self.vouched
    }
}

/// The store's end of a [`Spool`]: its parts in order as pieces ([`silk_store::Pieces`]),
/// then its end, which is an error unless the writer wrote everything and `go` came.
pub(super) struct SpoolReader {
    spool: Arc<Spool>,
    /// The scratch file, read where the writer went past memory (limited to the part); none
    /// for a paced spool.
    file: Option<tokio::io::Take<tokio::fs::File>>,
    go: Option<tokio::sync::oneshot::Receiver<()>>,
    /// Set here when the stream ended without the writer's word that it was whole.
    cut_short: Arc<AtomicBool>,
}

impl SpoolReader {
    fn new(
        spool: Arc<Spool>,
        file: Option<std::fs::File>,
        go: tokio::sync::oneshot::Receiver<()>,
    ) -> SpoolReader {
        use tokio::io::AsyncReadExt;
        let file = file.map(|file| tokio::fs::File::from_std(file).take(0));
        SpoolReader { spool, file, go: Some(go), cut_short: Default::default() }
    }

    /// Bytes of the scratch file's current stretch not yet read.
    fn in_file(&self) -> u64 {
        self.file.as_ref().map_or(0, tokio::io::Take::limit)
    }

    /// Set once the stream ended without the writer's word that it was whole.
    pub(super) fn cut_short(&self) -> Arc<AtomicBool> {
        self.cut_short.clone()
    }

    fn cut<T>(&self, why: &str) -> std::io::Result<T> {
        self.cut_short.store(true, Ordering::Release);
        Err(std::io::Error::other(why.to_string()))
    }

    /// The next piece of the stretch of the scratch file being read.
    async fn read_file(&mut self) -> std::io::Result<Bytes> {
        use tokio::io::AsyncReadExt;
        let n = self.in_file().min(FILE_PIECE) as usize;
        let mut buf = BytesMut::with_capacity(n);
        while buf.len() < n {
            let Some(file) = self.file.as_mut() else { break };
            if file.read_buf(&mut buf).await? == 0 {
                break;
            }
        }
        if buf.len() < n {
            return self.cut("the spool is shorter than written");
        }
        Ok(buf.freeze())
    }

    /// The stream's end: whole only once the writer said so and `go` came.
    async fn end(&mut self, whole: bool) -> std::io::Result<Option<Bytes>> {
        if !whole {
            return self.cut("the capture failed");
        }
        // Awaited in place, not taken: a caller that gives up waiting keeps it.
        let Some(go) = self.go.as_mut() else { return Ok(None) };
        let went = go.await;
        self.go = None;
        match went {
            Ok(()) => Ok(None),
            Err(_) => self.cut("the call stopped before the snapshot's end"),
        }
    }
}

impl silk_store::Pieces for SpoolReader {
    async fn next_piece(&mut self) -> std::io::Result<Option<Bytes>> {
        if self.in_file() > 0 {
            return self.read_file().await.map(Some);
        }
        let spool = self.spool.clone();
        let next = std::future::poll_fn(|cx| {
            let mut p = spool.progress();
            match p.parts.pop_front() {
                Some(part) => Poll::Ready(Ok(part)),
                None => match p.done {
                    Some(whole) => Poll::Ready(Err(whole)),
                    None => {
                        p.waker = Some(cx.waker().clone());
                        Poll::Pending
                    }
                },
            }
        })
        .await;
        match next {
            Ok(Part::Memory(held)) => Ok(Some(Bytes::from_owner(held))),
            Ok(Part::Shared(bytes)) => Ok(Some(bytes)),
            Ok(Part::File(n)) => {
                match self.file.as_mut() {
                    Some(file) => file.set_limit(n),
                    None => return self.cut("a paced spool has no file"),
                }
                self.read_file().await.map(Some)
            }
            Err(whole) => self.end(whole).await,
        }
    }
}

impl Drop for SpoolReader {
    fn drop(&mut self) {
        let parts = {
            let mut p = self.spool.progress();
            self.spool.closed.store(true, Ordering::Release);
            std::mem::take(&mut p.parts)
        };
        // Dropped unlocked: a part's buffer goes back to the spares under their own lock.
        drop(parts);
        if let Some((held, freed)) = &self.spool.paced {
            // Out of a paced writer's wait (under its lock: the writer checks, then waits).
            let _held = held.lock().unwrap_or_else(|e| e.into_inner());
            freed.notify_all();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use silk_engine::SnapshotSink;
    use silk_store::Pieces;

    /// A spool over a fresh scratch file: its writer's end, the store's end, and `go`.
    fn fresh() -> (SpoolWriter, SpoolReader, tokio::sync::oneshot::Sender<()>) {
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let path = std::env::temp_dir().join(format!("silk-spool-test-{}-{n}", std::process::id()));
        let (go, gone) = tokio::sync::oneshot::channel();
        let (writer, reader) = spool(&path, gone, false).unwrap();
        (writer, reader, go)
    }

    /// The pieces up to the stream's end, and how it ended.
    async fn drain(reader: &mut SpoolReader) -> (Vec<u8>, std::io::Result<()>) {
        let mut got = vec![];
        loop {
            match reader.next_piece().await {
                Ok(Some(piece)) => got.extend_from_slice(&piece),
                Ok(None) => return (got, Ok(())),
                Err(e) => return (got, Err(e)),
            }
        }
    }

    #[tokio::test]
    async fn a_spool_reads_back_in_order_across_memory_its_file_and_shared_bytes_and_ends_only_on_go()
     {
        let (mut writer, mut reader, go) = fresh();
        writer.write_all(b"one ").unwrap();
        // The node's spools are full: the next parts go to the file.
        SPOOLED.fetch_add(SPOOL_MEMORY, Ordering::AcqRel);
        writer.write_all(b"two ").unwrap();
        writer.write_all(b"three ").unwrap();
        SPOOLED.fetch_sub(SPOOL_MEMORY, Ordering::AcqRel);
        let shared = Bytes::from_static(b"four ");
        writer.share(shared.clone()).unwrap();
        writer.write_all(b"five").unwrap();
        {
            let p = writer.spool.progress();
            let kinds: Vec<&str> = p
                .parts
                .iter()
                .map(|p| match p {
                    Part::Memory(_) => "memory",
                    Part::File(_) => "file",
                    Part::Shared(_) => "shared",
                })
                .collect();
            assert_eq!(kinds, ["memory", "file", "shared", "memory"]);
        }
        writer.finish(true);
        let mut pieces = vec![];
        for _ in 0..4 {
            pieces.push(reader.next_piece().await.unwrap().unwrap());
        }
        assert_eq!(pieces.concat(), b"one two three four five");
        // What was shared is handed on as it is, not copied.
        assert_eq!(pieces[2].as_ptr(), shared.as_ptr());
        // Everything is read, but the call has not passed its crash point: no end yet.
        let early =
            tokio::time::timeout(std::time::Duration::from_millis(50), reader.next_piece()).await;
        assert!(early.is_err(), "the stream ended before go");
        go.send(()).unwrap();
        assert!(reader.next_piece().await.unwrap().is_none());
        assert!(!reader.cut_short.load(Ordering::Acquire));

        // A piece that outlives its spool (an aborted upload's chunk) still gives back the
        // node's spool memory it held. (Other tests hold a few bytes of it at a time.)
        let (mut writer, mut reader, _go) = fresh();
        writer.write_all(&vec![7u8; 1 << 20]).unwrap();
        let piece = reader.next_piece().await.unwrap().unwrap();
        drop((writer, reader));
        let held = SPOOLED.load(Ordering::Acquire);
        assert!(held >= 1 << 20, "{held}");
        drop(piece);
        let after = SPOOLED.load(Ordering::Acquire);
        assert!(
            after + (1 << 20) - 64 <= held,
            "{held} -> {after}: the piece's bytes stay counted"
        );
    }

    #[tokio::test]
    async fn a_spool_whose_capture_failed_or_whose_call_stopped_ends_in_an_error() {
        let (mut writer, mut reader, _go) = fresh();
        writer.write_all(b"half").unwrap();
        writer.finish(false);
        let (got, end) = drain(&mut reader).await;
        let err = end.unwrap_err();
        assert!(err.to_string().contains("capture failed"), "{err}");
        assert_eq!(got, b"half");
        assert!(reader.cut_short.load(Ordering::Acquire));

        let (mut writer, mut reader, go) = fresh();
        writer.write_all(b"all").unwrap();
        writer.finish(true);
        drop(go);
        let err = drain(&mut reader).await.1.unwrap_err();
        assert!(err.to_string().contains("stopped before"), "{err}");
        assert!(reader.cut_short.load(Ordering::Acquire));
    }

    #[tokio::test]
    async fn a_spool_whose_reader_went_stops_its_writer() {
        // A store that failed stops reading: the frozen sandbox's capture must end now, not
        // after writing everything to memory or disk.
        let (mut writer, reader, _go) = fresh();
        writer.write_all(b"some").unwrap();
        drop(reader);
        let err = writer.write_all(b"more").unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::BrokenPipe);
        let err = writer.share(Bytes::from_static(b"shared")).unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::BrokenPipe);
        assert!(writer.spool.progress().parts.is_empty(), "what it held is freed");
    }

    #[test]
    fn a_paced_spools_writer_waits_for_the_store_and_stops_when_it_goes() {
        let (go, gone) = tokio::sync::oneshot::channel();
        let (mut writer, mut reader) = paced(gone, true);
        assert!(writer.vouched());
        // Shared bytes hold no room; written ones do, up to PACED_ROOM.
        writer.share(Bytes::from(vec![1u8; 2 * PACED_ROOM])).unwrap();
        writer.write_all(&vec![2u8; PACED_ROOM]).unwrap();
        let wrote = std::thread::spawn(move || {
            let more = writer.write_all(b"more");
            (writer, more)
        });
        std::thread::sleep(std::time::Duration::from_millis(100));
        assert!(!wrote.is_finished(), "the writer went past its room");
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        let shared = rt.block_on(reader.next_piece()).unwrap().unwrap();
        assert_eq!(shared.len(), 2 * PACED_ROOM);
        let held = rt.block_on(reader.next_piece()).unwrap().unwrap();
        assert_eq!(held.len(), PACED_ROOM);
        drop(held);
        let (writer, more) = wrote.join().unwrap();
        more.unwrap();
        writer.finish(true);
        go.send(()).unwrap();
        assert_eq!(&rt.block_on(reader.next_piece()).unwrap().unwrap()[..], b"more");
        assert!(rt.block_on(reader.next_piece()).unwrap().is_none());

        // A store that stopped reading ends a waiting writer's capture.
        let (_go, gone) = tokio::sync::oneshot::channel();
        let (mut writer, reader) = paced(gone, false);
        writer.write_all(&vec![3u8; PACED_ROOM]).unwrap();
        let wrote = std::thread::spawn(move || writer.write_all(b"more"));
        std::thread::sleep(std::time::Duration::from_millis(100));
        drop(reader);
        let err = wrote.join().unwrap().unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::BrokenPipe);
    }
}
