//! The claims journal: a crash-safe, append-only log of keyed records, replayed when the node
//! starts. We keep it ourselves rather than embed a database such as redb because the job is
//! small: a few thousand records, single-key writes, and the whole set read back only at start.
//! A log with compaction does that in one file, on crates the workspace already has and with a
//! format short enough to describe here, where a database would bring its own dependency tree,
//! page cache and file format for features we would not use.
//!
//! On disk, in the journal's directory:
//! ```text
//! journal.log       the log: header, then one frame per committed batch
//! journal.log.tmp   a compacted image being written; left over only by a crash, removed at open
//! journal.lock      flock'd while a journal is open, so two processes never append to one log
//! ```
//! `journal.log` starts with a 12-byte header, the magic `SLKJRNL\0` and a `u32` LE format
//! version: the record type's ([`Record::VERSION`]). A log one version older is read as the
//! previous record type, upgraded record by record, and rewritten whole in the current version
//! (by the same atomic rename as a compaction) before the journal opens; other versions are
//! refused with both numbers named. Each frame is a `u32` LE payload length, four checksum bytes (the first four bytes
//! of the payload's blake3 hash) and the payload: the postcard encoding of a
//! `Vec<(String, Option<T>)>`, where `None` deletes the key. Replay applies frames in order. A
//! bad frame with nothing valid after it is a torn tail (a write that never completed, so a batch
//! never acknowledged) and is truncated away; a bad frame followed by a valid one is corruption,
//! and [`Journal::open`] refuses it rather than drop acknowledged batches.
//!
//! Callers encode their own batch, so a commit costs the size of its records. Without fsync (the
//! default: a commit then survives a killed process, not a power cut) the caller appends its
//! frame itself under the writer's mutex: one `write` to the page cache, a few microseconds.
//! With fsync, commits go through one writer thread fed by a channel, which does group commit:
//! it takes every batch waiting in the channel, appends them with one `write` and one
//! `fdatasync`, then acknowledges each, and no caller blocks its async runtime on the disk. (A
//! hand-off to that thread and back costs two thread wake-ups, 60–100 µs on a VM: most of a warm
//! claim, which is why the default path does not take it.) The writer keeps the encoded live
//! records; when the log outgrows max(1 MiB, 4 × the compacted image) it writes the image to
//! `journal.log.tmp`, fsyncs it, renames it over the log and fsyncs the directory. The old log
//! stays whole until the rename, so a kill at any point loses no acknowledged batch.

use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::marker::PhantomData;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, oneshot};
use tracing::{debug, error, warn};

const LOG: &str = "journal.log";
const TMP: &str = "journal.log.tmp";
const LOCK: &str = "journal.lock";
/// The header's first bytes; the format version follows as a `u32` LE.
const MAGIC: [u8; MAGIC_LEN] = *b"SLKJRNL\0";
const MAGIC_LEN: usize = 8;
const HEADER_LEN: usize = 12;

/// The header of a log in format `version`.
fn header(version: u32) -> [u8; HEADER_LEN] {
    let mut h = [0; HEADER_LEN];
    h[..MAGIC_LEN].copy_from_slice(&MAGIC);
    h[MAGIC_LEN..].copy_from_slice(&version.to_le_bytes());
    h
}

/// A journal's record type. postcard writes no field names, only order and variant indexes, so
/// a changed record is a new version; the previous one stays readable through `Previous`.
pub trait Record: Serialize + DeserializeOwned + Clone + Send + 'static {
    /// The format version of logs of this record.
    const VERSION: u32;
    /// The record as format `VERSION - 1` wrote it (and, through its own `Before`, older ones).
    type Previous: Past;
    fn upgrade(previous: Self::Previous) -> Self;
}

/// A record as an older format wrote it: logs in it are read and upgraded step by step.
pub trait Past: DeserializeOwned {
    /// The format version it was.
    const VERSION: u32;
    /// The format before it ([`NoOlder`] where none is read any more).
    type Before: Past;
    fn upgrade(before: Self::Before) -> Self;
}

/// The end of a record's history: no older log is read.
#[derive(Debug, Deserialize)]
pub enum NoOlder {}

impl Past for NoOlder {
    const VERSION: u32 = 0;
    type Before = NoOlder;
    fn upgrade(before: NoOlder) -> NoOlder {
        before
    }
}
/// Length and checksum in front of every payload.
const FRAME_HEADER: usize = 8;
/// Below this the log is never compacted: rewriting a small file buys nothing.
const COMPACT_FLOOR: u64 = 1 << 20;
/// The log is compacted once it is this many times the size of its compacted image.
const COMPACT_RATIO: u64 = 4;
/// Batches that may wait for the writer before `commit` waits for room (backpressure).
const QUEUE: usize = 1024;
/// Bytes hashed while looking for valid frames after a bad one, before `open` gives up and calls
/// the log corrupt. A torn tail is one unfinished write, far smaller than this.
const SCAN_BUDGET: usize = 64 << 20;

/// What can go wrong. After an I/O error in the writer the journal answers [`JournalError::Closed`]:
/// reopening it (which replays and trims the log) is the way back.
#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    /// A filesystem call failed; retrying after the cause is fixed (a full disk, say) may help.
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: io::Error,
    },
    /// The log holds damage that cannot be skipped without losing acknowledged batches, or was
    /// written by an incompatible version. Retrying does not help; an operator has to look.
    #[error("journal {} is corrupt at byte {offset}: {reason}", .path.display())]
    Corrupt { path: PathBuf, offset: u64, reason: String },
    /// Another process has the journal open.
    #[error("journal in {} is already open in another process", .0.display())]
    InUse(PathBuf),
    /// A record could not be encoded (its `Serialize` impl does something postcard cannot hold).
    /// Nothing of the batch was written.
    #[error("cannot encode journal record {key:?}: {reason}")]
    Encode { key: String, reason: String },
    /// The writer has stopped: an earlier write failed, so whether later ones would land is
    /// unknown. Reopen the journal.
    #[error("journal writer has stopped after an earlier error; reopen the journal")]
    Closed,
}

/// One change in a batch.
#[derive(Debug, Clone)]
pub enum Change<T> {
    Put(String, T),
    Delete(String),
}

/// The journal handle. Dropping it lets the writer finish the batches already queued, then waits
/// for it, so the directory can be reopened as soon as the drop returns.
pub struct Journal<T> {
    writer: Arc<Mutex<Writer>>,
    /// With fsync: the group-commit thread and its queue (`None` only inside `drop`).
    thread: Option<(mpsc::Sender<Queued>, JoinHandle<()>)>,
    live: Arc<AtomicUsize>,
    _records: PhantomData<fn(T) -> T>,
}

impl<T> std::fmt::Debug for Journal<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Journal").field("len", &self.live.load(Ordering::Relaxed)).finish()
    }
}

/// Each key of a batch with the byte range of its `(key, Some(value))` encoding in the frame, or
/// `None` for a delete.
type Entries = Vec<(String, Option<Range<usize>>)>;

/// A batch on its way to the log: the finished frame, and where each record sits in it.
struct Batch {
    frame: Vec<u8>,
    entries: Entries,
}

/// A batch queued for the group-commit thread, and who waits for it.
type Queued = (Batch, oneshot::Sender<Result<(), JournalError>>);

impl<T: Record> Journal<T> {
    /// Opens (creating if needed) the journal in `dir`, replays it, and returns the live records.
    /// `fsync`: when true, every commit is fsynced before it is acknowledged.
    pub fn open(
        dir: &Path,
        fsync: bool,
    ) -> Result<(Journal<T>, BTreeMap<String, T>), JournalError> {
        fs::create_dir_all(dir).map_err(io_err(format!("creating {}", dir.display())))?;
        let lock_path = dir.join(LOCK);
        let lock = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(io_err(format!("opening {}", lock_path.display())))?;
        match lock.try_lock() {
            Ok(()) => {}
            Err(fs::TryLockError::WouldBlock) => return Err(JournalError::InUse(dir.to_owned())),
            Err(fs::TryLockError::Error(e)) => {
                return Err(io_err(format!("locking {}", lock_path.display()))(e));
            }
        }

        let (path, tmp) = (dir.join(LOG), dir.join(TMP));
        // A compaction that died before its rename: the log it would have replaced is whole.
        remove_if_present(&tmp)?;
        let header = header(T::VERSION);
        if !path.exists() {
            install(dir, &tmp, &path, &header).map_err(|(e, _)| e)?;
        }
        let mut file = OpenOptions::new()
            .read(true)
            .append(true)
            .open(&path)
            .map_err(io_err(format!("opening {}", path.display())))?;
        let mut buf = Vec::new();
        file.read_to_end(&mut buf).map_err(io_err(format!("reading {}", path.display())))?;

        if buf.len() < HEADER_LEN && header.starts_with(&buf) {
            // Never installed whole (we create logs by rename, so only a foreign tool leaves
            // this): it cannot hold an acknowledged batch.
            warn!(path = %path.display(), "journal header incomplete; starting an empty log");
            file.set_len(0)
                .and_then(|()| file.write_all(&header))
                .and_then(|()| file.sync_all())
                .map_err(io_err(format!("rewriting header of {}", path.display())))?;
            buf = header.to_vec();
        }
        let replay = replay::<T>(&buf).map_err(|(offset, reason)| JournalError::Corrupt {
            path: path.clone(),
            offset: offset as u64,
            reason,
        })?;
        if replay.valid_len < buf.len() {
            warn!(
                path = %path.display(),
                offset = replay.valid_len,
                dropped = buf.len() - replay.valid_len,
                "truncating torn tail of the journal (a batch whose write never completed)"
            );
            file.set_len(replay.valid_len as u64)
                .and_then(|()| file.sync_all())
                .map_err(io_err(format!("truncating {}", path.display())))?;
        }

        let live = Arc::new(AtomicUsize::new(replay.values.len()));
        let live_bytes = replay.encoded.values().map(|b| b.len() as u64).sum();
        let mut writer = Writer {
            header,
            dir: dir.to_owned(),
            path,
            tmp,
            file,
            file_len: replay.valid_len as u64,
            fsync,
            records: replay.encoded,
            live_bytes,
            live: live.clone(),
            retry_compaction_at: 0,
            stopped: false,
            _lock: lock,
        };
        if replay.upgraded {
            // Nothing may be appended in the new format to a log in the old one.
            writer.compact().map_err(|(e, _)| e)?;
            tracing::info!(path = %writer.path.display(), version = T::VERSION, "journal upgraded");
        }
        // A log left large by the last run (say, a crash before its compaction) shrinks now.
        writer.maybe_compact();
        let writer = Arc::new(Mutex::new(writer));
        let thread = match fsync {
            false => None,
            true => {
                let (tx, rx) = mpsc::channel(QUEUE);
                let shared = writer.clone();
                let handle = std::thread::Builder::new()
                    .name("journal-writer".into())
                    .spawn(move || group_commits(&shared, rx))
                    .map_err(io_err("spawning the journal writer thread".to_string()))?;
                Some((tx, handle))
            }
        };
        Ok((Journal { writer, thread, live, _records: PhantomData }, replay.values))
    }

    /// Appends the changes as one atomic batch. Returns once the batch is written (and fsynced
    /// when configured): after that, a kill -9 of the process cannot lose it.
    ///
    /// On an error the batch may or may not have reached the disk. If this future is dropped
    /// after the batch was queued, the batch is still written.
    pub async fn commit(&self, changes: Vec<Change<T>>) -> Result<(), JournalError> {
        if changes.is_empty() {
            return Ok(());
        }
        let (frame, entries) = encode_batch(changes)?;
        let batch = Batch { frame, entries };
        let Some((tx, _)) = &self.thread else {
            return lock(&self.writer).write(&[&batch]);
        };
        let (done, acked) = oneshot::channel();
        tx.send((batch, done)).await.map_err(|_| JournalError::Closed)?;
        // A dropped sender means the writer stopped before reaching this batch.
        acked.await.map_err(|_| JournalError::Closed)?
    }

    /// Live record count (for metrics).
    pub fn len(&self) -> usize {
        self.live.load(Ordering::Acquire)
    }

    /// Whether the journal holds no live record.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl<T> Drop for Journal<T> {
    fn drop(&mut self) {
        // Closing the channel ends the writer once it has drained what is queued; waiting for it
        // releases the lock before a reopen can race it.
        if let Some((tx, thread)) = self.thread.take() {
            drop(tx);
            if thread.join().is_err() {
                error!("journal writer thread panicked");
            }
        }
    }
}

/// Encodes `changes` into one frame. Each entry is encoded on its own (postcard puts a sequence's
/// elements back to back after its length), so the writer can keep each record's bytes.
fn encode_batch<T: Serialize>(changes: Vec<Change<T>>) -> Result<(Vec<u8>, Entries), JournalError> {
    let mut frame = vec![0; FRAME_HEADER];
    let mut entries = Vec::with_capacity(changes.len());
    let encode_err = |key: &str, e: postcard::Error| JournalError::Encode {
        key: key.to_owned(),
        reason: e.to_string(),
    };
    frame = postcard::to_io(&changes.len(), frame).map_err(|e| encode_err("", e))?;
    for change in changes {
        match change {
            Change::Put(key, value) => {
                let start = frame.len();
                frame = postcard::to_io(&(key.as_str(), Some(&value)), frame)
                    .map_err(|e| encode_err(&key, e))?;
                entries.push((key, Some(start..frame.len())));
            }
            Change::Delete(key) => {
                frame = postcard::to_io(&(key.as_str(), None::<&T>), frame)
                    .map_err(|e| encode_err(&key, e))?;
                entries.push((key, None));
            }
        }
    }
    seal_frame(&mut frame).map_err(|reason| JournalError::Encode { key: String::new(), reason })?;
    Ok((frame, entries))
}

/// Fills in the length and checksum of a frame whose payload follows `FRAME_HEADER` zero bytes.
fn seal_frame(frame: &mut [u8]) -> Result<(), String> {
    let payload_len = frame.len() - FRAME_HEADER;
    let len = u32::try_from(payload_len)
        .map_err(|_| format!("batch of {payload_len} bytes exceeds the 4 GiB frame limit"))?;
    let sum = checksum(&frame[FRAME_HEADER..]);
    frame[..4].copy_from_slice(&len.to_le_bytes());
    frame[4..FRAME_HEADER].copy_from_slice(&sum);
    Ok(())
}

fn checksum(payload: &[u8]) -> [u8; 4] {
    let hash = blake3::hash(payload);
    let mut sum = [0; 4];
    sum.copy_from_slice(&hash.as_bytes()[..4]);
    sum
}

fn lock(writer: &Mutex<Writer>) -> std::sync::MutexGuard<'_, Writer> {
    // A panic mid-write leaves at worst a torn tail, which the next open trims.
    writer.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The group-commit thread (fsync on): whatever queued up during the last write and fsync goes
/// out in the next one. The channel's capacity bounds the group.
fn group_commits(writer: &Mutex<Writer>, mut rx: mpsc::Receiver<Queued>) {
    let mut group = Vec::new();
    while let Some(first) = rx.blocking_recv() {
        group.push(first);
        while let Ok(queued) = rx.try_recv() {
            group.push(queued);
        }
        let batches: Vec<&Batch> = group.iter().map(|(b, _)| b).collect();
        let written = lock(writer).write(&batches);
        for (_, done) in group.drain(..) {
            // The caller may have stopped waiting; its batch is written all the same.
            let _ = done.send(match &written {
                Ok(()) => Ok(()),
                Err(JournalError::Io { context, source }) => Err(JournalError::Io {
                    context: context.clone(),
                    source: io::Error::new(source.kind(), source.to_string()),
                }),
                Err(_) => Err(JournalError::Closed),
            });
        }
    }
}

/// The log's writing side. It never sees `T`: it keeps each live record as the bytes the caller
/// encoded, which is all a compacted image needs.
struct Writer {
    /// The header of logs this writer writes (its records' version).
    header: [u8; HEADER_LEN],
    dir: PathBuf,
    path: PathBuf,
    tmp: PathBuf,
    /// The log, opened for append.
    file: File,
    file_len: u64,
    fsync: bool,
    records: BTreeMap<String, Vec<u8>>,
    /// Sum of the encodings in `records`, to size the compacted image without building it.
    live_bytes: u64,
    live: Arc<AtomicUsize>,
    /// After a compaction that failed harmlessly, the log length at which to try again.
    retry_compaction_at: u64,
    /// An append or a compaction failed: nothing more is written (see [`Writer::write`]).
    stopped: bool,
    /// Held for as long as the writer may touch the log.
    _lock: File,
}

impl Writer {
    /// Appends `batches` with one `write` (and one `fdatasync` when configured), applies them
    /// to the live records and compacts when due.
    fn write(&mut self, batches: &[&Batch]) -> Result<(), JournalError> {
        if self.stopped {
            return Err(JournalError::Closed);
        }
        let appended = match batches {
            [one] => self.append(&one.frame),
            _ => self.append(&batches.iter().map(|b| &b.frame[..]).collect::<Vec<_>>().concat()),
        };
        if let Err(e) = appended {
            // The log may now end in part of these batches, which the next open trims; writing
            // after it could bury that torn frame mid-file, and after a failed fsync the page
            // cache is no longer to be trusted. So fail them and stop: later commits get
            // `Closed`, and a reopen recovers.
            error!(path = %self.path.display(), error = %e, "journal write failed; writer stops");
            self.stopped = true;
            let context = format!("appending to {}", self.path.display());
            return Err(JournalError::Io { context, source: e });
        }
        for batch in batches {
            self.apply(batch);
        }
        self.live.store(self.records.len(), Ordering::Release);
        self.maybe_compact();
        Ok(())
    }

    fn append(&mut self, buf: &[u8]) -> io::Result<()> {
        self.file.write_all(buf)?;
        if self.fsync {
            self.file.sync_data()?;
        }
        self.file_len += buf.len() as u64;
        Ok(())
    }

    fn apply(&mut self, batch: &Batch) {
        for (key, range) in &batch.entries {
            let old = match range {
                Some(range) => {
                    self.live_bytes += range.len() as u64;
                    self.records.insert(key.clone(), batch.frame[range.clone()].to_vec())
                }
                None => self.records.remove(key),
            };
            if let Some(old) = old {
                self.live_bytes -= old.len() as u64;
            }
        }
    }

    /// Compacts when the log has outgrown its live records. Stops the writer when the log was
    /// replaced but the replacement may not be durable.
    fn maybe_compact(&mut self) {
        // Header, frame header, a count of at most 10 bytes, the records.
        let image_len = (HEADER_LEN + FRAME_HEADER + 10) as u64 + self.live_bytes;
        if self.file_len <= COMPACT_FLOOR.max(COMPACT_RATIO * image_len)
            || self.file_len < self.retry_compaction_at
        {
            return;
        }
        let before = self.file_len;
        match self.compact() {
            Ok(()) => {
                debug!(
                    before,
                    after = self.file_len,
                    records = self.records.len(),
                    "journal compacted"
                );
            }
            Err((e, false)) => {
                // The old log is untouched and still the log: keep appending to it, and try again
                // once it has grown some more rather than after every batch.
                warn!(error = %e, "journal compaction failed; continuing on the old log");
                let _ = fs::remove_file(&self.tmp);
                self.retry_compaction_at = self.file_len + COMPACT_FLOOR;
            }
            Err((e, true)) => {
                error!(error = %e, "journal compaction could not be made durable; writer stops");
                self.stopped = true;
            }
        }
    }

    fn compact(&mut self) -> Result<(), (JournalError, bool)> {
        let mut image = self.header.to_vec();
        image.resize(HEADER_LEN + FRAME_HEADER, 0);
        image = postcard::to_io(&self.records.len(), image).map_err(|e| {
            let reason = e.to_string();
            (JournalError::Encode { key: String::new(), reason }, false)
        })?;
        image.reserve(self.live_bytes as usize);
        for bytes in self.records.values() {
            image.extend_from_slice(bytes);
        }
        seal_frame(&mut image[HEADER_LEN..])
            .map_err(|reason| (JournalError::Encode { key: String::new(), reason }, false))?;
        self.file = install(&self.dir, &self.tmp, &self.path, &image)?;
        self.file_len = image.len() as u64;
        Ok(())
    }
}

/// Makes `bytes` the content of `path`, atomically: writes `tmp`, fsyncs it, renames it over
/// `path`, fsyncs `dir`. Returns the new file, open for append. The error's flag says whether
/// `path` was already replaced (the rename done, its durability unknown).
fn install(
    dir: &Path,
    tmp: &Path,
    path: &Path,
    bytes: &[u8],
) -> Result<File, (JournalError, bool)> {
    let before = |context: String| move |e| (io_err(context)(e), false);
    remove_if_present(tmp).map_err(|e| (e, false))?;
    let mut file = OpenOptions::new()
        .append(true)
        .create_new(true)
        .open(tmp)
        .map_err(before(format!("creating {}", tmp.display())))?;
    file.write_all(bytes)
        .and_then(|()| file.sync_all())
        .map_err(before(format!("writing {}", tmp.display())))?;
    fs::rename(tmp, path).map_err(before(format!(
        "renaming {} to {}",
        tmp.display(),
        path.display()
    )))?;
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| (io_err(format!("fsyncing directory {}", dir.display()))(e), true))?;
    Ok(file)
}

fn remove_if_present(path: &Path) -> Result<(), JournalError> {
    match fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => {
            Err(io_err(format!("removing {}", path.display()))(e))
        }
        _ => Ok(()),
    }
}

fn io_err(context: String) -> impl FnOnce(io::Error) -> JournalError {
    move |source| JournalError::Io { context, source }
}

mod replay;
use replay::replay;

#[cfg(test)]
mod tests;
// Replay under damage; `pub` for the fuzz target (`node/fuzz`), which compiles this module alone.
#[cfg(any(test, fuzzing))]
pub mod mutations;
