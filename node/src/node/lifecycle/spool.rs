//! A running sandbox's capture on its way into the store ([`super::Pace::Spool`]): the engine
//! writes it on a blocking thread ([`SpoolWriter`]) into memory, or past the node's bound for
//! that into a scratch file, and the store reads it from behind ([`SpoolReader`]), so the freeze
//! lasts the capture, not the upload.

use std::future::Future;
use std::io::Write;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

/// Bytes of all spools on this node held in memory at once; past it a capture goes to its
/// scratch file. A checkpoint's capture outruns the store's put (chunking and hashing), so
/// without room in memory most of it would be written to disk and read back.
const SPOOL_MEMORY: usize = 256 << 20;

/// What the spools on this node hold in memory now, against [`SPOOL_MEMORY`].
static SPOOLED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Emptied buffers a spool keeps for its next writes (fresh ones cost a page fault per 4 KiB).
const SPARE_BUFFERS: usize = 4;

/// A capture one thread writes and the store reads behind it ([`SpoolReader`]), in order: in
/// memory while there is room ([`SPOOL_MEMORY`]), in a scratch file past it.
#[derive(Default)]
struct Spool {
    progress: Mutex<Progress>,
}

#[derive(Default)]
struct Progress {
    parts: std::collections::VecDeque<Part>,
    /// Whether the writer wrote everything, once it is done.
    done: Option<bool>,
    /// The reader, waiting for the next part.
    waker: Option<std::task::Waker>,
    /// The reader is gone: the writer stops.
    closed: bool,
    spare: Vec<Vec<u8>>,
}

/// A stretch of the capture, in the order written.
enum Part {
    Memory(Held),
    /// This many bytes next in the scratch file.
    File(u64),
}

/// Spooled bytes in memory, counted in [`SPOOLED`] until dropped or given back.
struct Held(Vec<u8>);

impl Held {
    /// `bytes` copied into `buf`, when the node's spools have room for them.
    fn copy(bytes: &[u8], mut buf: Vec<u8>) -> Option<Held> {
        SPOOLED
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |now| {
                (now + bytes.len() <= SPOOL_MEMORY).then_some(now + bytes.len())
            })
            .ok()?;
        buf.clear();
        buf.extend_from_slice(bytes);
        Some(Held(buf))
    }

    /// The buffer, no longer counted.
    fn into_buffer(mut self) -> Vec<u8> {
        let buf = std::mem::take(&mut self.0);
        SPOOLED.fetch_sub(buf.len(), Ordering::AcqRel);
        buf
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        SPOOLED.fetch_sub(self.0.len(), Ordering::AcqRel);
    }
}

impl Spool {
    fn progress(&self) -> std::sync::MutexGuard<'_, Progress> {
        self.progress.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Adds `part`, unless the reader is gone.
    fn push(&self, part: Part) -> std::io::Result<()> {
        let mut p = self.progress();
        if p.closed {
            return Err(std::io::Error::new(
                std::io::ErrorKind::BrokenPipe,
                "the upload stopped reading",
            ));
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
pub(super) fn spool(
    path: &std::path::Path,
    go: tokio::sync::oneshot::Receiver<()>,
) -> std::io::Result<(SpoolWriter, SpoolReader)> {
    let file = std::fs::File::create(path)?;
    let behind = std::fs::File::open(path);
    let _ = std::fs::remove_file(path); // both ends are open: nothing to sweep
    let spool = std::sync::Arc::new(Spool::default());
    Ok((SpoolWriter { file, spool: spool.clone() }, SpoolReader::new(spool, behind?, go)))
}

pub(super) struct SpoolWriter {
    file: std::fs::File,
    spool: std::sync::Arc<Spool>,
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
            // An empty part would read as the stream's end.
            return Ok(0);
        }
        let spare = self.spool.progress().spare.pop().unwrap_or_default();
        let (part, n) = match Held::copy(bytes, spare) {
            Some(held) => (Part::Memory(held), bytes.len()),
            None => {
                let n = self.file.write(bytes)?;
                (Part::File(n as u64), n)
            }
        };
        self.spool.push(part)?;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The store's end of a [`Spool`]: its parts in order, then its end, which is an error unless
/// the writer wrote everything and `go` came.
pub(super) struct SpoolReader {
    spool: std::sync::Arc<Spool>,
    /// The scratch file, read where the writer went past memory (limited to the part).
    file: tokio::io::Take<tokio::fs::File>,
    /// The part being read: a buffer and how far, or the file.
    reading: Option<Reading>,
    go: Option<tokio::sync::oneshot::Receiver<()>>,
    /// Set here when the stream ended without the writer's word that it was whole.
    cut_short: std::sync::Arc<AtomicBool>,
}

enum Reading {
    Memory(Held, usize),
    File,
}

impl SpoolReader {
    fn new(
        spool: std::sync::Arc<Spool>,
        file: std::fs::File,
        go: tokio::sync::oneshot::Receiver<()>,
    ) -> SpoolReader {
        use tokio::io::AsyncReadExt;
        let file = tokio::fs::File::from_std(file).take(0);
        SpoolReader { spool, file, reading: None, go: Some(go), cut_short: Default::default() }
    }

    /// Set once the stream ended without the writer's word that it was whole.
    pub(super) fn cut_short(&self) -> std::sync::Arc<AtomicBool> {
        self.cut_short.clone()
    }

    fn cut(&self, why: &str) -> std::io::Result<()> {
        self.cut_short.store(true, Ordering::Release);
        Err(std::io::Error::other(why.to_string()))
    }
}

impl tokio::io::AsyncRead for SpoolReader {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        use std::task::Poll;
        if buf.remaining() == 0 {
            return Poll::Ready(Ok(()));
        }
        let this = &mut *self;
        loop {
            match &mut this.reading {
                Some(Reading::Memory(held, at)) => {
                    let n = buf.remaining().min(held.0.len() - *at);
                    buf.put_slice(&held.0[*at..*at + n]);
                    *at += n;
                    if *at == held.0.len()
                        && let Some(Reading::Memory(held, _)) = this.reading.take()
                    {
                        let mut p = this.spool.progress();
                        if p.spare.len() < SPARE_BUFFERS {
                            p.spare.push(held.into_buffer());
                        }
                    }
                    return Poll::Ready(Ok(()));
                }
                Some(Reading::File) => {
                    let before = buf.filled().len();
                    std::task::ready!(std::pin::Pin::new(&mut this.file).poll_read(cx, buf))?;
                    if this.file.limit() == 0 {
                        this.reading = None;
                    } else if buf.filled().len() == before {
                        return Poll::Ready(this.cut("the spool is shorter than written"));
                    }
                    return Poll::Ready(Ok(()));
                }
                None => {}
            }
            let mut p = this.spool.progress();
            if let Some(part) = p.parts.pop_front() {
                this.reading = Some(match part {
                    Part::Memory(held) => Reading::Memory(held, 0),
                    Part::File(n) => {
                        this.file.set_limit(n);
                        Reading::File
                    }
                });
                continue;
            }
            let done = p.done;
            if done.is_none() {
                p.waker = Some(cx.waker().clone());
                return Poll::Pending;
            }
            drop(p);
            if done == Some(false) {
                return Poll::Ready(this.cut("the capture failed"));
            }
            let Some(go) = this.go.as_mut() else { return Poll::Ready(Ok(())) };
            let went = std::task::ready!(std::pin::Pin::new(go).poll(cx));
            this.go = None;
            return match went {
                Ok(()) => Poll::Ready(Ok(())),
                Err(_) => Poll::Ready(this.cut("the call stopped before the snapshot's end")),
            };
        }
    }
}

impl Drop for SpoolReader {
    fn drop(&mut self) {
        let mut p = self.spool.progress();
        p.closed = true;
        p.parts.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A spool over a fresh scratch file: its writer's end, the store's end, and `go`.
    fn fresh() -> (SpoolWriter, SpoolReader, tokio::sync::oneshot::Sender<()>) {
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let path = std::env::temp_dir().join(format!("silk-spool-test-{}-{n}", std::process::id()));
        let (go, gone) = tokio::sync::oneshot::channel();
        let (writer, reader) = spool(&path, gone).unwrap();
        (writer, reader, go)
    }

    #[tokio::test]
    async fn a_spool_reads_back_in_order_across_memory_and_its_file_and_ends_only_on_go() {
        use tokio::io::AsyncReadExt;
        let (mut writer, mut reader, go) = fresh();
        writer.write_all(b"one ").unwrap();
        // The node's spools are full: the next parts go to the file.
        SPOOLED.fetch_add(SPOOL_MEMORY, Ordering::AcqRel);
        writer.write_all(b"two ").unwrap();
        writer.write_all(b"three ").unwrap();
        SPOOLED.fetch_sub(SPOOL_MEMORY, Ordering::AcqRel);
        writer.write_all(b"four").unwrap();
        {
            let p = writer.spool.progress();
            let kinds: Vec<&str> = p
                .parts
                .iter()
                .map(|p| match p {
                    Part::Memory(_) => "memory",
                    Part::File(_) => "file",
                })
                .collect();
            assert_eq!(kinds, ["memory", "file", "memory"]);
        }
        writer.finish(true);
        let mut got = vec![0; 18];
        reader.read_exact(&mut got).await.unwrap();
        assert_eq!(got, b"one two three four");
        // Everything is read, but the call has not passed its crash point: no end yet.
        let mut rest = vec![];
        let early = tokio::time::timeout(
            std::time::Duration::from_millis(50),
            reader.read_to_end(&mut rest),
        )
        .await;
        assert!(early.is_err(), "the stream ended before go");
        go.send(()).unwrap();
        assert_eq!(reader.read_to_end(&mut rest).await.unwrap(), 0);
        assert!(!reader.cut_short.load(Ordering::Acquire));
    }

    #[tokio::test]
    async fn a_spool_whose_capture_failed_or_whose_call_stopped_ends_in_an_error() {
        use tokio::io::AsyncReadExt;
        let (mut writer, mut reader, _go) = fresh();
        writer.write_all(b"half").unwrap();
        writer.finish(false);
        let mut got = vec![];
        let err = reader.read_to_end(&mut got).await.unwrap_err();
        assert!(err.to_string().contains("capture failed"), "{err}");
        assert_eq!(got, b"half");
        assert!(reader.cut_short.load(Ordering::Acquire));

        let (mut writer, mut reader, go) = fresh();
        writer.write_all(b"all").unwrap();
        writer.finish(true);
        drop(go);
        let err = reader.read_to_end(&mut vec![]).await.unwrap_err();
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
        assert!(writer.spool.progress().parts.is_empty(), "what it held is freed");
    }
}
