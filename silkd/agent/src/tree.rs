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
        let dst_meta = std::fs::symlink_metadata(&dst).ok();
        let dst_is_dir = dst_meta.as_ref().is_some_and(|m| m.is_dir());
        if src_is_dir && dst_is_dir {
            merge_into(&src, &dst)?;
        } else {
            if dst_is_dir {
                std::fs::remove_dir_all(&dst).map_err(|e| io_error(&dst, e))?;
            } else if src_is_dir && dst_meta.is_some() {
                // `rename` puts a directory only where there is nothing or an empty directory:
                // a file or symlink in its place goes first (never followed).
                std::fs::remove_file(&dst).map_err(|e| io_error(&dst, e))?;
            }
            std::fs::rename(&src, &dst).map_err(|e| io_error(&dst, e))?;
        }
    }
    Ok(())
}

/// Tar streams into `push` under mutation: the property of the fuzz target `push`
/// (`silkd/agent/fuzz`, which compiles this module on its own) and its seeded quick pass.
///
/// A root holds a canary directory and a box with the target in it; the target holds a file, a
/// directory and symlinks out to the canary (relative and absolute). A push of any bytes must
/// not panic, must leave the canary and the rest of the box as they were (nothing created,
/// written or linked through outside the target), must leave no staging behind, must change
/// nothing when it fails, and must take no more disk than the stream could describe.
#[cfg(any(test, fuzzing))]
pub mod mutations {
    use std::collections::BTreeMap;
    use std::os::unix::fs::MetadataExt;

    use bytes::BytesMut;

    use super::*;

    /// Everything under a directory, not following symlinks: mode (with the kind), mtime (not of
    /// directories, whose entries a push may stage in), contents or link target.
    pub type Tree = BTreeMap<PathBuf, (u32, u64, Vec<u8>)>;

    pub fn snapshot(dir: &Path) -> Tree {
        let mut tree = Tree::new();
        let Ok(entries) = std::fs::read_dir(dir) else { return tree };
        for entry in entries {
            let path = entry.expect("a listed entry").path();
            let meta = std::fs::symlink_metadata(&path).expect("a listed entry's metadata");
            let data = if meta.is_symlink() {
                std::fs::read_link(&path).expect("a link").into_os_string().into_encoded_bytes()
            } else if meta.is_file() {
                std::fs::read(&path).expect("a file")
            } else {
                tree.extend(snapshot(&path));
                vec![]
            };
            let mtime = if meta.is_dir() { 0 } else { meta.mtime() as u64 };
            tree.insert(path, (meta.mode(), mtime, data));
        }
        tree
    }

    /// Disk taken under `dir` (blocks, not apparent sizes: a sparse file may say anything), and
    /// the number of entries.
    fn disk(dir: &Path) -> (u64, u64) {
        let mut total = (0, 0);
        for entry in std::fs::read_dir(dir).into_iter().flatten() {
            let path = entry.expect("a listed entry").path();
            let meta = std::fs::symlink_metadata(&path).expect("metadata");
            let below = if meta.is_dir() { disk(&path) } else { (0, 0) };
            total = (total.0 + meta.blocks() * 512 + below.0, total.1 + 1 + below.1);
        }
        total
    }

    /// Lays out `root` afresh: `canary/`, and `box/dest/` with symlinks out to the canary.
    pub fn lay_out(root: &Path) {
        let _ = std::fs::remove_dir_all(root);
        let canary = root.join("canary");
        let dest = root.join("box/dest");
        std::fs::create_dir_all(canary.join("sub")).unwrap();
        std::fs::create_dir_all(dest.join("d")).unwrap();
        std::fs::write(canary.join("file"), b"canary").unwrap();
        std::fs::write(canary.join("sub/inner"), b"inner").unwrap();
        std::fs::write(dest.join("keep"), b"kept").unwrap();
        std::fs::write(dest.join("d/f"), b"deep").unwrap();
        std::os::unix::fs::symlink("../../canary", dest.join("link-out")).unwrap();
        std::os::unix::fs::symlink(&canary, dest.join("abs-out")).unwrap();
    }

    /// Pushes `tar` into `root`'s target (`box/dest`, or `box/new`, which does not exist) as a
    /// client would, `Data` frames then `Eof`, and checks the outcome. `root` as [`lay_out`]
    /// left it. Says whether the push went through (and so changed the target).
    pub fn check(rt: &tokio::runtime::Runtime, root: &Path, tar: &[u8], new: bool) -> bool {
        let target = root.join(if new { "box/new" } else { "box/dest" });
        let (canary, before) = (snapshot(&root.join("canary")), snapshot(&root.join("box")));
        let (was, _) = disk(&target);
        let mut input = BytesMut::new();
        for chunk in tar.chunks(4096) {
            silk_proto::encode(&Frame::Data(Bytes::copy_from_slice(chunk)), &mut input).unwrap();
        }
        silk_proto::encode(&Frame::Eof, &mut input).unwrap();
        let mut rd = FrameReader::new(&input[..]);
        let mut wr = FrameWriter::new(Vec::new());
        let path = target.to_str().expect("a UTF-8 root").to_string();
        let outcome = rt.block_on(push(path, &mut rd, &mut wr));

        assert_eq!(snapshot(&root.join("canary")), canary, "the canary changed");
        let mut top: Vec<_> =
            std::fs::read_dir(root).unwrap().map(|e| e.unwrap().file_name()).collect();
        top.sort();
        assert_eq!(top, ["box", "canary"], "something was made beside the box");
        let after = snapshot(&root.join("box"));
        let outside = |tree: &Tree| -> Tree {
            tree.iter()
                .filter(|(p, _)| !p.starts_with(&target))
                .map(|(p, v)| (p.clone(), v.clone()))
                .collect()
        };
        assert_eq!(outside(&after), outside(&before), "the box changed beside the target");
        assert!(
            !after.keys().any(|p| p.to_string_lossy().contains(".silk-push-")),
            "staging left behind"
        );
        let pushed = match outcome {
            Ok(()) => {
                assert!(target.is_dir(), "a push that succeeds leaves a directory");
                true
            }
            Err(Fail::Call(e)) if e.message.starts_with("bad tar stream") => {
                assert_eq!(after, before, "a push that failed changed the target");
                false
            }
            Err(e) => panic!("push failed other than on its stream: {e:?}"),
        };
        // Each 512-byte block of the stream makes at most a few file-system blocks (a GNU
        // sparse map entry takes 24 bytes and can place one block), each entry at most one more.
        let (bytes, entries) = disk(&target);
        assert!(
            bytes <= was + 256 * tar.len() as u64 + 8192 * entries,
            "{bytes} bytes on disk from a {} byte stream",
            tar.len()
        );
        pushed
    }

    /// Sets the checksum of every header of a (damaged) stream, walking it as a reader would:
    /// a header, its data, the next header. Damage then reaches past the checksum to the fields.
    pub fn repair(tar: &mut [u8]) {
        let mut at = 0;
        while tar.len().saturating_sub(at) >= 512 {
            let block = &mut tar[at..at + 512];
            if block.iter().all(|&b| b == 0) {
                at += 512;
                continue;
            }
            block[148..156].fill(b' ');
            let sum: u32 = block.iter().map(|&b| u32::from(b)).sum();
            block[148..156].copy_from_slice(format!("{sum:06o}\0 ").as_bytes());
            let size = tar::Header::from_byte_slice(block).entry_size().unwrap_or(0);
            at = at
                .saturating_add(512)
                .saturating_add(size.div_ceil(512).saturating_mul(512) as usize);
        }
    }

    /// Real streams: an ordinary tree (files, a directory, links inside), one that tries every
    /// way out (`..`, absolute names, symlinks and hard links out, writing through a symlink,
    /// through the target's own links out), one that replaces a file by a directory and the
    /// reverse, long names (GNU and PAX), and a sparse file.
    pub fn seeds(root: &Path) -> Vec<Vec<u8>> {
        use tar::EntryType::{self, Directory as Dir, GNUSparse, Link, Regular as File, Symlink};
        let canary = root.join("canary");
        let canary = canary.to_str().expect("a UTF-8 root");
        let entry = |out: &mut Vec<u8>, kind: EntryType, name: &str, link: &str, data: &[u8]| {
            let mut h = tar::Header::new_gnu();
            h.set_entry_type(kind);
            h.set_size(data.len() as u64);
            h.set_mode(if kind == Dir { 0o755 } else { 0o644 });
            h.set_mtime(1_700_000_000);
            // Raw names: `set_path` refuses the hostile ones.
            h.as_old_mut().name[..name.len()].copy_from_slice(name.as_bytes());
            h.as_old_mut().linkname[..link.len()].copy_from_slice(link.as_bytes());
            h.set_cksum();
            out.extend_from_slice(h.as_bytes());
            out.extend_from_slice(data);
            out.resize(out.len().next_multiple_of(512), 0);
        };
        let end = |mut out: Vec<u8>| {
            out.resize(out.len() + 1024, 0);
            out
        };
        let mut plain = vec![];
        entry(&mut plain, Dir, "a/", "", b"");
        entry(&mut plain, File, "a/b/f", "", b"deep");
        entry(&mut plain, File, "top", "", b"top");
        entry(&mut plain, Symlink, "link", "", b"");
        plain.truncate(plain.len() - 512);
        entry(&mut plain, Symlink, "link", "top", b"");
        entry(&mut plain, Link, "hard", "top", b"");
        let mut out = vec![];
        entry(&mut out, File, "../escape", "", b"x");
        entry(&mut out, File, "/abs-file", "", b"x");
        entry(&mut out, File, &format!("{canary}/file"), "", b"pwned");
        entry(&mut out, Symlink, "esc", "../../canary", b"");
        entry(&mut out, File, "esc/pwn", "", b"pwned");
        entry(&mut out, Symlink, "abs", canary, b"");
        entry(&mut out, File, "abs/file", "", b"pwned");
        entry(&mut out, Link, "hout", "../../canary/file", b"");
        entry(&mut out, Link, "habs", &format!("{canary}/file"), b"");
        entry(&mut out, Link, "hvia", "abs/file", b"");
        entry(&mut out, File, "link-out/file", "", b"pwned");
        entry(&mut out, File, "abs-out/sub/inner", "", b"pwned");
        let mut swap = vec![];
        entry(&mut swap, Dir, "keep/", "", b"");
        entry(&mut swap, File, "keep/x", "", b"x");
        entry(&mut swap, File, "d", "", b"was a directory");
        entry(&mut swap, Dir, "link-out/", "", b"");
        let mut long = tar::Builder::new(vec![]);
        let mut h = tar::Header::new_gnu();
        h.set_size(4);
        long.append_data(&mut h, format!("{}/f", "n".repeat(150)), &b"long"[..]).unwrap();
        let mut pax = long.into_inner().unwrap();
        let record = format!("path={}/p", "q".repeat(120));
        let record = format!("{} {record}\n", record.len() + 5);
        entry(&mut pax, EntryType::XHeader, "pax", "", record.as_bytes());
        entry(&mut pax, File, "short", "", b"pax");
        // 8 bytes of data placed at 0 and at 1 MiB: a file of 1 MiB + 4 on 8 bytes of disk.
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(GNUSparse);
        h.set_size(8);
        h.set_mode(0o644);
        h.as_old_mut().name[..6].copy_from_slice(b"sparse");
        let octal = |n: u64| <[u8; 12]>::try_from(format!("{n:011o}\0").as_bytes()).unwrap();
        let g = h.as_gnu_mut().unwrap();
        (g.sparse[0].offset, g.sparse[0].numbytes) = (octal(0), octal(4));
        (g.sparse[1].offset, g.sparse[1].numbytes) = (octal(1 << 20), octal(4));
        g.realsize = octal((1 << 20) + 4);
        h.set_cksum();
        let mut sparse = h.as_bytes().to_vec();
        sparse.extend_from_slice(b"headtail");
        sparse.resize(1024, 0);
        [plain, out, swap, pax, sparse].into_iter().map(end).collect()
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        /// Found by the seeded pass: a directory in the stream where the target has a file or a
        /// symlink failed the merge half way (`rename` puts a directory only over nothing or an
        /// empty directory), leaving part of the archive merged. It replaces them now, as
        /// `tar -x` does, without following the symlink.
        #[test]
        fn a_directory_replaces_a_file_or_a_symlink() {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            let dir = tempfile::tempdir().unwrap();
            let root = dir.path().join("root");
            lay_out(&root);
            assert!(check(&rt, &root, &seeds(&root)[2], false), "the push goes through");
            let dest = root.join("box/dest");
            assert_eq!(std::fs::read(dest.join("keep/x")).unwrap(), b"x");
            assert!(std::fs::symlink_metadata(dest.join("link-out")).unwrap().is_dir());
            assert_eq!(std::fs::read(dest.join("d")).unwrap(), b"was a directory");
        }

        /// The real streams as they are, then 8 000 damaged ones (bits flipped, bytes inserted
        /// or dropped, a size or other number field rewritten, cut short, a block of another
        /// stream spliced in), most with their header checksums set again.
        #[test]
        fn pushed_streams_stay_inside_their_target() {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            let dir = tempfile::tempdir().unwrap();
            let root = dir.path().join("root");
            let seeds = seeds(&root);
            for seed in &seeds {
                lay_out(&root);
                check(&rt, &root, seed, false);
            }
            lay_out(&root);
            let mut state = 0x2545_f491_4f6c_dd1du64;
            let mut next = move || {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                state
            };
            let mut pushed = 0;
            for case in 0..8_000 {
                let mut data = seeds[case % seeds.len()].clone();
                for _ in 0..1 + next() % 3 {
                    let at = (next() as usize) % (data.len() + 1);
                    match next() % 6 {
                        0 if at < data.len() => data[at] ^= 1 << (next() % 8),
                        1 => data.insert(at, next() as u8),
                        2 if at < data.len() => drop(data.remove(at)),
                        3 if at + 12 <= data.len() => {
                            let n = next() >> (next() % 64);
                            data[at..at + 12].copy_from_slice(
                                format!("{:011o}\0", n & 0o77777777777).as_bytes(),
                            );
                        }
                        4 => {
                            let other = &seeds[next() as usize % seeds.len()];
                            let from = 512 * (next() as usize % (other.len() / 512));
                            let into = 512 * (at / 512);
                            data.splice(into..into, other[from..from + 512].iter().copied());
                        }
                        _ => data.truncate(at),
                    }
                }
                if next() % 4 != 0 {
                    repair(&mut data);
                }
                // A push that failed changed nothing (checked): lay out again only after one
                // that went through.
                if check(&rt, &root, &data, case % 3 == 0) {
                    pushed += 1;
                    lay_out(&root);
                }
            }
            assert!(pushed > 2_000, "only {pushed} pushes went through");
        }
    }
}
