//! Copies of a snapshot kept on this host (`Engine::write_snapshot`'s `keep`): a checkpoint's
//! branches on the node that took it start from them as a fork's copies start (see `forks`),
//! with no download, no unpack and no check of images this host's CRIU just wrote.
//!
//! A kept copy is a fork directory: `layer` (the box's files, unpacked from the capture's tar
//! stream as it is written, on a thread beside it), `memory` (the dumped images, hard links),
//! `base.json`. `kept/<name>` is a hard link to its `ref`, the hold that keeps it while no copy
//! runs on it; dropping the copy removes that link, and the fork goes with its last user. A
//! restore first links `kept/<name>` itself (`kept/.use-<id>`): a drop that unlinked the name
//! before that fails the restore (`None`), and one after it leaves the layer to the restore.
//! The node keeps no record of copies across a restart, so the engine's start drops them all.

use std::io::Write;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};

use super::forks::{Fork, link_files, wide_pipe};
use super::host::now_ms;
use super::ids::mark_ids;
use super::{JailEngine, Seed};
use crate::layer::{self, Ids, Whiteouts};
use crate::{Base, BoxInfo, BoxSpec, EngineError, Memory, Result, SandboxId};

/// A copy made beside a capture, not yet held under its name.
pub(super) struct Copy {
    pub(super) fork: String,
    bytes: u64,
}

impl JailEngine {
    fn kept_dir(&self) -> PathBuf {
        self.cfg.data_dir.join("kept")
    }

    /// Inside a capture: the box's files (`layers`, ids in range `ids`) written to `out` as
    /// `layer::capture` writes them and, from the same bytes, unpacked into a new fork with
    /// `images` linked in. The copy is optional: whatever fails in it is logged, `out` gets
    /// what it would without it, and `None` says no copy was made. `Err` is the capture's.
    pub(super) fn capture_beside(
        &self,
        name: &str,
        images: Option<&Path>,
        layers: &[&Path],
        ids: Ids,
        out: &mut dyn Write,
    ) -> Result<Option<Copy>> {
        if !plain(name) {
            tracing::warn!(copy = name, "no copy kept: not a plain name");
            layer::capture(layers, out, ids)?;
            return Ok(None);
        }
        let fork = format!("{name}-{}", now_ms());
        let dir = self.forks_dir().join(&fork);
        let made = self.new_copy_dir(&dir, images).map_err(|e| e.to_string());
        let pipe = made.and_then(|()| wide_pipe().map_err(|e| e.to_string()));
        let (reader, writer) = match pipe {
            Ok(pipe) => pipe,
            Err(why) => {
                tracing::warn!(copy = name, "no copy kept: {why}");
                let _ = std::fs::remove_dir_all(&dir);
                layer::capture(layers, out, ids)?;
                return Ok(None);
            }
        };
        let (captured, copied, applied) = std::thread::scope(|s| {
            let into = dir.join("layer");
            let apply = s.spawn(move || layer::apply(reader, &into, Whiteouts::Overlay, self.ids));
            let mut tee = std::io::BufWriter::with_capacity(
                256 << 10,
                Tee { out, copy: Some(writer), copied: 0 },
            );
            let captured = layer::capture(layers, &mut tee, ids)
                .and_then(|()| tee.flush().map_err(EngineError::io("write snapshot")));
            // Dropping the tee closes the pipe: the unpack ends at its end.
            let copied = tee.get_ref().copied;
            drop(tee);
            let applied = apply
                .join()
                .unwrap_or_else(|_| Err(EngineError::Host("the copy's unpack panicked".into())));
            (captured, copied, applied)
        });
        if let Err(e) = captured {
            let _ = std::fs::remove_dir_all(&dir);
            return Err(e);
        }
        if let Err(e) = applied {
            tracing::warn!(copy = name, "no copy kept: {e}");
            let _ = std::fs::remove_dir_all(&dir);
            return Ok(None);
        }
        let images = dir_bytes(&dir.join("memory"));
        Ok(Some(Copy { fork, bytes: copied + images }))
    }

    fn new_copy_dir(&self, dir: &Path, images: Option<&Path>) -> Result<()> {
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(dir)
            .map_err(EngineError::io(format!("mkdir {}", dir.display())))?;
        mark_ids(dir, self.ids)?;
        if let Some(images) = images {
            link_files(images, &dir.join("memory"))
                .map_err(EngineError::io("link memory images"))?;
        }
        Ok(())
    }

    /// Holds `copy` (made over `base`) as `name`, or drops it; its bytes if held.
    pub(super) fn keep_copy(&self, name: &str, copy: Copy, base: &Base) -> Option<u64> {
        let dir = self.forks_dir().join(&copy.fork);
        let held = (|| {
            let json = serde_json::to_vec(base).map_err(std::io::Error::other)?;
            std::fs::write(dir.join("base.json"), json)?;
            std::fs::write(dir.join("ref"), &copy.fork)?;
            std::fs::create_dir_all(self.kept_dir())?;
            std::fs::hard_link(dir.join("ref"), self.kept_dir().join(name))
        })();
        match held {
            Ok(()) => Some(copy.bytes),
            Err(e) => {
                tracing::warn!(copy = name, "no copy kept: {e}");
                self.release_fork(&copy.fork);
                None
            }
        }
    }

    /// A new box from the copy kept as `name` (`None`: there is none).
    pub(super) fn restore_copy(
        &self,
        name: &str,
        id: &SandboxId,
        spec: &BoxSpec,
        memory: Memory,
    ) -> Result<Option<BoxInfo>> {
        if !plain(name) {
            return Ok(None);
        }
        let using = self.kept_dir().join(format!(".use-{id}"));
        if std::fs::hard_link(self.kept_dir().join(name), &using).is_err() {
            return Ok(None);
        }
        let Some(fork) = self.fork_named(&using) else {
            let _ = std::fs::remove_file(&using);
            return Ok(None);
        };
        let made = (|| {
            let dir = self.forks_dir().join(&fork);
            let base: Base = std::fs::read(dir.join("base.json"))
                .map_err(std::io::Error::other)
                .and_then(|json| serde_json::from_slice(&json).map_err(std::io::Error::other))
                .map_err(EngineError::io("read the copy's base"))?;
            let images = match memory {
                Memory::Off => Err("not asked for".to_string()),
                _ if dir.join("memory").is_dir() => Ok(dir.join("memory")),
                _ => Err("the snapshot holds no memory".to_string()),
            };
            if let (Memory::Required, Err(why)) = (memory, &images) {
                return Err(EngineError::MemoryFailed(why.clone()));
            }
            let copy = Fork { dir, memory, images };
            self.create(base, id, spec, Seed::Fork(&copy), true)
        })();
        let _ = std::fs::remove_file(&using);
        // Dropped while this restore held it, and no sandbox started on it: it goes now.
        self.release_fork(&fork);
        made.map(Some)
    }

    /// Drops the copy kept as `name`.
    pub(super) fn drop_copy(&self, name: &str) {
        if !plain(name) {
            return;
        }
        let hold = self.kept_dir().join(name);
        let fork = self.fork_named(&hold);
        if std::fs::remove_file(&hold).is_ok()
            && let Some(fork) = fork
        {
            self.release_fork(&fork);
        }
    }

    /// At start: no copy is anyone's any more (`sweep_forks` then removes their forks).
    pub(super) fn drop_copies(&self) {
        let _ = std::fs::remove_dir_all(self.kept_dir());
    }
}

/// A kept copy's name, which becomes a path component: plain characters only.
fn plain(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 128
        && !name.starts_with(['.', '-'])
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_".contains(&b))
}

/// The bytes of the files in `dir`.
fn dir_bytes(dir: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else { return 0 };
    entries.flatten().filter_map(|e| e.metadata().ok()).map(|m| m.len()).sum()
}

/// Writes to `out` and, while it takes them, the same bytes to `copy`. The copy is optional:
/// its failure (its reader gone) drops it, and `out` goes on.
struct Tee<'a> {
    out: &'a mut dyn Write,
    copy: Option<std::io::PipeWriter>,
    copied: u64,
}

impl Write for Tee<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.out.write(buf)?;
        if let Some(copy) = &mut self.copy {
            match copy.write_all(&buf[..n]) {
                Ok(()) => self.copied += n as u64,
                Err(_) => self.copy = None,
            }
        }
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.out.flush()
    }
}
