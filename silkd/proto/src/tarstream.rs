//! Tar streams over frames: the plumbing between the blocking `tar` crate and an async
//! connection, shared by silkd's `push`/`pull` verbs and the SDK's push and pull.
//!
//! Tar work is blocking, so it runs on a blocking thread that exchanges [`DATA_CHUNK`] buffers
//! with the async side through a small bounded channel: disk and socket work overlap, and memory
//! stays bounded by the channel's depth (each caller picks it).
//!
//! - Sending a tree: [`build`] archives a path on a blocking thread into a [`ChunkWriter`],
//!   which cuts the byte stream into `DATA_CHUNK` pieces for the caller to send as `Data` frames.
//! - Receiving a tree: the caller feeds `Data` payloads into a channel and unpacks, on a
//!   blocking thread of its own, from a [`ChunkReader`] over it. How to unpack (what to trust in
//!   the archive) is the caller's policy, not this module's.
//!
//! Errors stay the caller's own: [`build`] maps a failure with the caller's function, and a
//! [`ChunkReader`] passes on the `io::Error` the caller put in the channel unchanged.

use std::io::{Read, Write};
use std::path::PathBuf;

use bytes::{Buf, Bytes, BytesMut};
use tokio::sync::mpsc;

use crate::DATA_CHUNK;

/// Archives `path` on a blocking thread and returns the receiving end of the archive's bytes,
/// `Ok` chunks of exactly [`DATA_CHUNK`] bytes but the last, at most `depth` of them in flight
/// (`depth` must not be 0). A directory (`is_dir`) is archived as its content, `./…` entries;
/// anything else as one entry under its own file name. Symlinks are archived as symlinks, never
/// followed. A failure part way is the last item, `Err(on_error(e))`; the channel's close after
/// `Ok` chunks only is the clean end. Dropping the receiver stops the archiving.
///
/// Must be called within a tokio runtime (it spawns the blocking thread there).
pub fn build<E, F>(
    path: PathBuf,
    is_dir: bool,
    depth: usize,
    on_error: F,
) -> mpsc::Receiver<Result<Bytes, E>>
where
    E: Send + 'static,
    F: FnOnce(std::io::Error) -> E + Send + 'static,
{
    let (tx, rx) = mpsc::channel::<Result<Bytes, E>>(depth);
    tokio::task::spawn_blocking(move || {
        let out = ChunkWriter::new(tx.clone());
        let mut tar = tar::Builder::new(out);
        tar.follow_symlinks(false);
        let built = if is_dir {
            tar.append_dir_all(".", &path)
        } else {
            let name = path.file_name().map(PathBuf::from).unwrap_or_else(|| "file".into());
            tar.append_path_with_name(&path, name)
        };
        let result = built.and_then(|()| tar.into_inner()).and_then(|mut out| out.flush());
        if let Err(e) = result {
            // A closed channel means the receiver stopped: there is no one left to tell.
            let _ = tx.blocking_send(Err(on_error(e)));
        }
    });
    rx
}

/// `Write` end of a sending pipeline: fills [`DATA_CHUNK`] buffers and sends each, as `Ok`, to
/// the async side as soon as it is full; `flush` sends the partial buffer. Blocking: use it on
/// a blocking thread only. A write fails with `BrokenPipe` once the receiver is gone.
pub struct ChunkWriter<E> {
    tx: mpsc::Sender<Result<Bytes, E>>,
    buf: BytesMut,
}

impl<E> ChunkWriter<E> {
    pub fn new(tx: mpsc::Sender<Result<Bytes, E>>) -> Self {
        ChunkWriter { tx, buf: BytesMut::new() }
    }
}

impl<E> std::fmt::Debug for ChunkWriter<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChunkWriter").field("buffered", &self.buf.len()).finish_non_exhaustive()
    }
}

impl<E> Write for ChunkWriter<E> {
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
            .map_err(|_| std::io::Error::new(std::io::ErrorKind::BrokenPipe, "receiver gone"))
    }
}

/// An item a [`ChunkReader`] can receive: a plain chunk, or a chunk or the error that aborts the
/// stream (the reader returns that error as it is).
pub trait Chunk {
    fn into_bytes(self) -> std::io::Result<Bytes>;
}

impl Chunk for Bytes {
    fn into_bytes(self) -> std::io::Result<Bytes> {
        Ok(self)
    }
}

impl Chunk for std::io::Result<Bytes> {
    fn into_bytes(self) -> std::io::Result<Bytes> {
        self
    }
}

/// `Read` end of a receiving pipeline: the chunks from the channel, in order; the channel's
/// close is the end of the stream, an `Err` item a failed read. Blocking: use it on a blocking
/// thread only.
pub struct ChunkReader<T> {
    rx: mpsc::Receiver<T>,
    cur: Bytes,
}

impl<T> ChunkReader<T> {
    pub fn new(rx: mpsc::Receiver<T>) -> Self {
        ChunkReader { rx, cur: Bytes::new() }
    }
}

impl<T> std::fmt::Debug for ChunkReader<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChunkReader").field("buffered", &self.cur.len()).finish_non_exhaustive()
    }
}

impl<T: Chunk> Read for ChunkReader<T> {
    fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
        while self.cur.is_empty() {
            match self.rx.blocking_recv() {
                Some(chunk) => self.cur = chunk.into_bytes()?,
                None => return Ok(0),
            }
        }
        let n = out.len().min(self.cur.len());
        out[..n].copy_from_slice(&self.cur[..n]);
        self.cur.advance(n);
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_writer_sends_whole_chunks_and_flush_sends_the_rest() {
        let (tx, mut rx) = mpsc::channel::<std::io::Result<Bytes>>(8);
        let mut writer = ChunkWriter::new(tx);
        writer.write_all(&vec![7u8; 2 * DATA_CHUNK + 3]).unwrap();
        writer.flush().unwrap();
        writer.flush().unwrap(); // nothing buffered: sends nothing
        drop(writer);
        let mut sizes = vec![];
        while let Some(chunk) = rx.blocking_recv() {
            sizes.push(chunk.unwrap().len());
        }
        assert_eq!(sizes, [DATA_CHUNK, DATA_CHUNK, 3]);
    }

    #[test]
    fn the_writer_fails_once_the_receiver_is_gone() {
        let (tx, rx) = mpsc::channel::<Result<Bytes, ()>>(1);
        drop(rx);
        let mut writer = ChunkWriter::new(tx);
        writer.write_all(b"x").unwrap(); // buffered only
        assert_eq!(writer.flush().unwrap_err().kind(), std::io::ErrorKind::BrokenPipe);
    }

    #[test]
    fn the_reader_joins_chunks_and_passes_errors_on() {
        let (tx, rx) = mpsc::channel::<std::io::Result<Bytes>>(4);
        tx.blocking_send(Ok(Bytes::from_static(b"ab"))).unwrap();
        tx.blocking_send(Ok(Bytes::new())).unwrap();
        tx.blocking_send(Ok(Bytes::from_static(b"c"))).unwrap();
        tx.blocking_send(Err(std::io::Error::new(std::io::ErrorKind::BrokenPipe, "aborted")))
            .unwrap();
        drop(tx);
        let mut reader = ChunkReader::new(rx);
        let mut got = Vec::new();
        let e = reader.read_to_end(&mut got).unwrap_err();
        assert_eq!((got.as_slice(), e.kind()), (&b"abc"[..], std::io::ErrorKind::BrokenPipe));
        assert_eq!(reader.read(&mut [0u8; 4]).unwrap(), 0, "then the channel's end");

        let (tx, rx) = mpsc::channel::<Bytes>(1);
        tx.blocking_send(Bytes::from_static(b"plain")).unwrap();
        drop(tx);
        let mut text = String::new();
        ChunkReader::new(rx).read_to_string(&mut text).unwrap();
        assert_eq!(text, "plain");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn build_names_a_single_file_by_its_name_and_maps_failures() {
        let dir = std::env::temp_dir().join(format!("silk-tarstream-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("one.txt");
        std::fs::write(&file, b"hello").unwrap();
        let mut rx = build(file, false, 4, |e| e);
        let mut archive = Vec::new();
        while let Some(chunk) = rx.recv().await {
            archive.extend_from_slice(&chunk.unwrap());
        }
        let names: Vec<String> = tar::Archive::new(archive.as_slice())
            .entries()
            .unwrap()
            .map(|e| e.unwrap().path().unwrap().display().to_string())
            .collect();
        assert_eq!(names, ["one.txt"]);

        let mut rx = build(dir.join("missing"), false, 4, |e| format!("mapped: {e}"));
        let last = rx.recv().await.unwrap();
        assert!(last.unwrap_err().starts_with("mapped: "));
        assert!(rx.recv().await.is_none());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
