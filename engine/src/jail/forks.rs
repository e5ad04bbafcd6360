//! Forks: several sandboxes from one snapshot share its files. They are unpacked once into
//! `forks/<name>/layer`, a read-only layer every copy mounts between its own upper directory
//! and its base, so N copies cost one unpack and N starts instead of N unpacks. A copy's
//! snapshot captures its upper directory and the fork layer together (`layer::capture` merges
//! them), so what leaves the box is one layer over the base, as from any other sandbox.
//!
//! Each copy's box directory holds `fork`, a hard link to `forks/<name>/ref` (whose bytes are
//! the name): the link count is how many copies still mount the layer, and whoever drops it to
//! one (the last copy's destroy, or the fork itself when no copy started) removes the layer. A
//! crash in between leaves a count of one, and the engine's start removes it.

use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::path::{Path, PathBuf};

use super::host::{now_ms, remove_tree};
use super::ids::mark_ids;
use super::{JailEngine, Seed};
use crate::layer::{self, Whiteouts};
use crate::{BoxInfo, BoxSpec, Engine, EngineError, Memory, Result, SandboxId, Snapshot};

/// A fork being started: its directory, and the memory images its copies start from (or why
/// they start from their files).
pub(super) struct Fork {
    pub(super) dir: PathBuf,
    pub(super) memory: Memory,
    pub(super) images: std::result::Result<PathBuf, String>,
}

impl JailEngine {
    fn forks_dir(&self) -> PathBuf {
        self.cfg.data_dir.join("forks")
    }

    /// `ids.len()` new sandboxes from `snapshot`, all or none, its files unpacked once.
    pub(super) fn restore_forks(
        &self,
        snapshot: &Snapshot,
        ids: &[SandboxId],
        spec: &BoxSpec,
        memory: Memory,
    ) -> Result<Vec<BoxInfo>> {
        let name = format!("{}-{}", ids[0], now_ms());
        let dir = self.forks_dir().join(&name);
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&dir)
            .map_err(EngineError::io(format!("mkdir {}", dir.display())))?;
        let made = (|| {
            mark_ids(&dir, self.ids)?;
            let images = dir.join("memory");
            let (files, carried) = self.open_snapshot(&snapshot.layer_tar, &images)?;
            layer::apply(files, &dir.join("layer"), Whiteouts::Overlay, self.ids)?;
            std::fs::write(dir.join("ref"), &name).map_err(EngineError::io("write fork ref"))?;
            let images = match (memory, carried) {
                (Memory::Off, _) => Err("not asked for".to_string()),
                (_, Ok(false)) => Err("the snapshot holds no memory".to_string()),
                (_, Err(why)) => Err(why),
                (_, Ok(true)) => Ok(images),
            };
            if let (Memory::Required, Err(why)) = (memory, &images) {
                return Err(EngineError::MemoryFailed(why.clone()));
            }
            let fork = Fork { dir: dir.clone(), memory, images };
            let started: Vec<Result<BoxInfo>> = std::thread::scope(|s| {
                let starts: Vec<_> = ids
                    .iter()
                    .map(|id| {
                        let (base, fork) = (snapshot.base.clone(), &fork);
                        s.spawn(move || self.create(base, id, spec, Seed::Fork(fork), true))
                    })
                    .collect();
                starts
                    .into_iter()
                    .map(|s| {
                        s.join().unwrap_or_else(|_| Err(EngineError::Host("fork panicked".into())))
                    })
                    .collect()
            });
            let (made, failed): (Vec<_>, Vec<_>) = started.into_iter().partition(Result::is_ok);
            let made: Vec<BoxInfo> = made.into_iter().map(Result::unwrap).collect();
            if let Some(Err(e)) = failed.into_iter().next() {
                for info in &made {
                    let _ = self.destroy(&info.id);
                }
                return Err(e);
            }
            Ok(made)
        })();
        // The copies hold their own links to the images they restored from.
        let _ = std::fs::remove_dir_all(dir.join("memory"));
        self.release_fork(&name);
        made
    }

    /// Links the fork layer into a new box's directory: from now on it is one of its layers.
    pub(super) fn join_fork(&self, fork: &Fork, box_dir: &Path) -> Result<()> {
        std::fs::hard_link(fork.dir.join("ref"), box_dir.join("fork"))
            .map_err(EngineError::io("link the fork layer"))
    }

    /// The fork a box's files sit on, by name, if it is a fork's copy.
    pub(super) fn fork_of(&self, box_dir: &Path) -> Option<String> {
        let name = std::fs::read_to_string(box_dir.join("fork")).ok()?;
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
