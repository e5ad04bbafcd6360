//! Forks: several sandboxes from one sandbox (or one snapshot) share its files. They are copied
//! once into `forks/<name>/layer`, a read-only layer every copy mounts between its own upper
//! directory and its base, so N copies cost one copy and N starts instead of N unpacks; a
//! running source's files go there straight from its capture, with no tar file between. A copy's
//! snapshot captures its upper directory and the fork layer together (`layer::capture` merges
//! them), so what leaves the box is one layer over the base, as from any other sandbox.
//!
//! Each copy's box directory holds `fork`, a hard link to `forks/<name>/ref` (whose bytes are
//! the name): the link count is how many copies still mount the layer, and whoever drops it to
//! one (the last copy's destroy, or the fork itself when no copy started) removes the layer. A
//! crash in between leaves a count of one, and the engine's start removes it.

use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::path::{Path, PathBuf};

use super::host::{now_ms, remove_tree};
use super::ids::mark_ids;
use super::{JailEngine, Seed};
use crate::layer::{self, Ids, Whiteouts};
use crate::{
    Base, BoxInfo, BoxSpec, Engine, EngineError, Memory, Result, SandboxId, Snapshot, SnapshotMode,
};

/// A fork being started: its directory, and the memory images its copies start from (or why
/// they start from their files).
pub(super) struct Fork {
    pub(super) dir: PathBuf,
    pub(super) memory: Memory,
    pub(super) images: std::result::Result<PathBuf, String>,
}

impl JailEngine {
    pub(super) fn forks_dir(&self) -> PathBuf {
        self.cfg.data_dir.join("forks")
    }

    /// `ids.len()` copies of the box `source` as it is now, all or none: its files copied
    /// straight into the fork layer (a tar stream from the capture to the unpack, no file
    /// between them), its processes frozen meanwhile, its memory dumped as `memory` says.
    pub(super) fn fork_box(
        &self,
        source: &SandboxId,
        ids: &[SandboxId],
        spec: &BoxSpec,
        memory: Memory,
    ) -> Result<Vec<BoxInfo>> {
        self.new_fork(ids, spec, memory, |dir| {
            let captured = self.capture_box(
                source,
                SnapshotMode::KeepRunning,
                memory,
                |images, layers, ids| {
                    if let Some(images) = images {
                        link_files(images, &dir.join("memory"))
                            .map_err(EngineError::io("link memory images"))?;
                    }
                    copy_layers(layers, ids, &dir.join("layer"), self.ids)?;
                    Ok(0)
                },
            )?;
            let images = match captured.memory.kept {
                true => Ok(dir.join("memory")),
                false => Err(captured.memory.why_not.unwrap_or_default()),
            };
            Ok((captured.base, images))
        })
    }

    /// `ids.len()` new sandboxes from `snapshot`, all or none, its files unpacked once.
    pub(super) fn restore_forks(
        &self,
        snapshot: &Snapshot,
        ids: &[SandboxId],
        spec: &BoxSpec,
        memory: Memory,
    ) -> Result<Vec<BoxInfo>> {
        self.new_fork(ids, spec, memory, |dir| {
            let (files, carried) = self.open_snapshot(&snapshot.layer_tar, &dir.join("memory"))?;
            layer::apply(files, &dir.join("layer"), Whiteouts::Overlay, self.ids)?;
            let images = match carried {
                Ok(true) => Ok(dir.join("memory")),
                Ok(false) => Err("the snapshot holds no memory".to_string()),
                Err(why) => Err(why),
            };
            Ok((snapshot.base.clone(), images))
        })
    }

    /// Makes a fork: `fill` puts its files (`layer`) and memory images (`memory`) into its new
    /// directory and says the base they are over and where its images are (or why there are
    /// none); then its copies start on it, together.
    fn new_fork(
        &self,
        ids: &[SandboxId],
        spec: &BoxSpec,
        memory: Memory,
        fill: impl FnOnce(&Path) -> Result<(Base, std::result::Result<PathBuf, String>)>,
    ) -> Result<Vec<BoxInfo>> {
        let first = ids.first().ok_or_else(|| EngineError::BadRequest("a fork of none".into()))?;
        let name = format!("{first}-{}", now_ms());
        let dir = self.forks_dir().join(&name);
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&dir)
            .map_err(EngineError::io(format!("mkdir {}", dir.display())))?;
        let made = (|| {
            mark_ids(&dir, self.ids)?;
            let (base, images) = fill(&dir)?;
            std::fs::write(dir.join("ref"), &name).map_err(EngineError::io("write fork ref"))?;
            let images = match memory {
                Memory::Off => Err("not asked for".to_string()),
                _ => images,
            };
            if let (Memory::Required, Err(why)) = (memory, &images) {
                return Err(EngineError::MemoryFailed(why.clone()));
            }
            let fork = Fork { dir: dir.clone(), memory, images };
            self.start_copies(&base, &fork, ids, spec)
        })();
        // The copies hold their own links to the images they restored from.
        let _ = std::fs::remove_dir_all(dir.join("memory"));
        self.release_fork(&name);
        made
    }

    /// Starts the fork's copies side by side; all or none.
    fn start_copies(
        &self,
        base: &Base,
        fork: &Fork,
        ids: &[SandboxId],
        spec: &BoxSpec,
    ) -> Result<Vec<BoxInfo>> {
        let started: Vec<Result<BoxInfo>> = std::thread::scope(|s| {
            let starts: Vec<_> = ids
                .iter()
                .map(|id| {
                    s.spawn(move || self.create(base.clone(), id, spec, Seed::Fork(fork), true))
                })
                .collect();
            starts
                .into_iter()
                .map(|s| {
                    s.join().unwrap_or_else(|_| {
                        Err(EngineError::Host("a copy's start panicked".into()))
                    })
                })
                .collect()
        });
        let mut made = vec![];
        let mut failure = None;
        for start in started {
            match start {
                Ok(info) => made.push(info),
                Err(e) => failure = failure.or(Some(e)),
            }
        }
        if let Some(e) = failure {
            for info in &made {
                let _ = self.destroy(&info.id);
            }
            return Err(e);
        }
        Ok(made)
    }

    /// Links the fork layer into a new box's directory: from now on it is one of its layers.
    pub(super) fn join_fork(&self, fork: &Fork, box_dir: &Path) -> Result<()> {
        std::fs::hard_link(fork.dir.join("ref"), box_dir.join("fork"))
            .map_err(EngineError::io("link the fork layer"))
    }

    /// The fork a box's files sit on, by name, if it is a fork's copy.
    pub(super) fn fork_of(&self, box_dir: &Path) -> Option<String> {
        self.fork_named(&box_dir.join("fork"))
    }

    /// The fork whose `ref` the file `link` is a link to, by name.
    pub(super) fn fork_named(&self, link: &Path) -> Option<String> {
        let name = std::fs::read_to_string(link).ok()?;
        // Written by this engine; checked anyway, as it becomes a path.
        let plain = !name.is_empty()
            && !name.starts_with('.')
            && name.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b));
        plain.then_some(name)
    }

    /// The fork layer a box mounts under its upper directory, if it is a fork's copy.
    pub(super) fn fork_layer(&self, box_dir: &Path) -> Option<PathBuf> {
        self.fork_of(box_dir).map(|name| self.forks_dir().join(name).join("layer"))
    }

    /// Removes the fork `name` once no box links it.
    pub(super) fn release_fork(&self, name: &str) {
        let dir = self.forks_dir().join(name);
        if std::fs::metadata(dir.join("ref")).is_ok_and(|m| m.nlink() > 1) {
            return;
        }
        // Renamed first: of two last copies destroyed at once, one removes it.
        let gone = self.forks_dir().join(format!(".gone-{name}"));
        if std::fs::rename(&dir, &gone).is_ok()
            && let Err(e) = remove_tree(&gone)
        {
            tracing::warn!(fork = name, "removing the fork layer: {e}");
        }
    }

    /// At start: forks no box links any more (a crash before their release) go, and layers
    /// stored in another id range move into this one.
    pub(super) fn sweep_forks(&self) -> Result<()> {
        let Ok(entries) = std::fs::read_dir(self.forks_dir()) else { return Ok(()) };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with(".gone-") {
                let _ = remove_tree(&entry.path());
                continue;
            }
            self.release_fork(&name);
            let dir = entry.path();
            let stored = std::fs::read_to_string(dir.join("ids"))
                .ok()
                .and_then(|s| s.trim().parse::<u32>().ok());
            if let Some(stored) = stored.filter(|&s| s != self.ids.base) {
                layer::shift_ids(&dir.join("layer"), stored, self.ids)?;
                mark_ids(&dir, self.ids)?;
            }
        }
        Ok(())
    }
}

/// Hard links every file of the directory `from` into `to`, a new directory.
pub(super) fn link_files(from: &Path, to: &Path) -> std::io::Result<()> {
    std::fs::DirBuilder::new().mode(0o700).create(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let into = to.join(entry.file_name());
        std::fs::hard_link(entry.path(), &into)
            .or_else(|_| std::fs::copy(entry.path(), &into).map(drop))?;
    }
    Ok(())
}

/// Copies `layers` (top first, merged as `layer::capture` merges them, ids in range `from`)
/// into the directory `into` (ids in range `to`) through a tar stream between two threads.
fn copy_layers(layers: &[&Path], from: Ids, into: &Path, to: Ids) -> Result<()> {
    let (reader, writer) = wide_pipe().map_err(EngineError::io("pipe"))?;
    std::thread::scope(|s| {
        let capture = s.spawn(move || {
            let out = std::io::BufWriter::with_capacity(256 << 10, writer);
            layer::capture(layers, out, from)
        });
        // The reader goes when `apply` returns: a capture still writing then fails (EPIPE)
        // rather than blocking.
        let applied = layer::apply(reader, into, Whiteouts::Overlay, to);
        let captured = capture
            .join()
            .unwrap_or_else(|_| Err(EngineError::Host("the capture panicked".into())));
        // The capture's error first: an unpack cut short by it says less.
        captured.and(applied)
    })
}

/// A pipe between two threads of a copy, wider than the 64 KiB default: fewer switches.
pub(super) fn wide_pipe() -> std::io::Result<(std::io::PipeReader, std::io::PipeWriter)> {
    let (reader, writer) = std::io::pipe()?;
    // SAFETY: plain fcntl on a descriptor we own; failure leaves the default.
    unsafe { libc::fcntl(writer.as_raw_fd(), libc::F_SETPIPE_SZ, 1 << 20) };
    Ok((reader, writer))
}
