//! Goldens of the jail engine: built from a warmup, exported to and installed from layer tars
//! (other nodes' goldens), and merged from a snapshot (promote). Every golden layer is stored in
//! the sandboxes' id range, with an `ids` marker beside it.

use std::path::Path;

use super::ids::mark_ids;
use super::{JailEngine, partial_path};
use crate::layer::Ids;
use crate::layer::{self, Whiteouts};
use crate::{
    Base, BoxSpec, Digest, Engine, EngineError, Golden, Lane, Result, SandboxId, Snapshot,
    Template, Warmup, probe, template,
};

impl JailEngine {
    pub(super) fn write_golden_tar(&self, golden: &Golden, into: &Path) -> Result<()> {
        let partial = partial_path(into);
        let file = std::fs::File::create(&partial).map_err(EngineError::io("create golden tar"))?;
        let mut out = std::io::BufWriter::new(file);
        let memory = match super::golden_images(golden) {
            Some(images) => self.write_memory_entry(&images, &mut out).map(drop),
            None => Ok(()),
        };
        let written = memory
            .and_then(|()| layer::capture(&[&golden.layer], &mut out, self.ids))
            .and_then(|()| {
                std::io::Write::flush(&mut out).map_err(EngineError::io("write golden tar"))
            })
            .and_then(|()| {
                std::fs::rename(&partial, into).map_err(EngineError::io("commit golden tar"))
            });
        if written.is_err() {
            let _ = std::fs::remove_file(&partial);
        }
        written
    }

    pub(super) fn install_golden(
        &self,
        template: &Template,
        digest: &Digest,
        layer_tar: &Path,
    ) -> Result<Golden> {
        if let Some(g) = self.find_golden(digest) {
            return Ok(g);
        }
        let dir = self.golden_dir(digest);
        let golden =
            Golden { digest: digest.clone(), template: template.clone(), layer: dir.join("layer") };
        template::build_atomically(&dir, |staging| {
            // A memory golden's tar starts with its images, kept only when this fleet made them.
            let (files, memory) = self.open_snapshot(layer_tar, &staging.join("memory"))?;
            if let Err(why) = memory {
                tracing::warn!(golden = %digest, "installed without its memory: {why}");
            }
            layer::apply(files, &staging.join("layer"), Whiteouts::Overlay, self.ids)?;
            seal(staging, &golden, self.ids)
        })?;
        self.installed(&golden)
    }

    pub(super) fn build_golden(&self, template: &Template, warmup: &Warmup) -> Result<Golden> {
        let digest = self.golden_digest(template, warmup);
        let dir = self.golden_dir(&digest);
        if let Some(golden) = self.find_golden(&digest) {
            return Ok(golden);
        }
        let builder: SandboxId = format!("golden-{}", digest.short()).parse()?;
        // A builder left by a crashed attempt is stale.
        if self.record(&builder).is_ok() {
            self.destroy(&builder)?;
        }
        let base = Base { template: template.clone(), golden: None };
        let info =
            // Unbounded: its upper directory is renamed into the golden (a rename out of a
            // btrfs subvolume would be EXDEV).
            self.create(base, &builder, &BoxSpec::new(crate::Size::Medium, Lane::None), super::Seed::Fresh, false)?;
        let built = (|| {
            if !warmup.argv.is_empty() {
                let (status, tail) =
                    probe::exec(&info.agent, &warmup.argv, &template.env, warmup.timeout)?;
                if status.timed_out {
                    return Err(EngineError::WarmupFailed(format!(
                        "timed out after {:?}: {tail}",
                        warmup.timeout
                    )));
                }
                if status.code != 0 {
                    return Err(EngineError::WarmupFailed(format!(
                        "exit {}: {}",
                        status.code,
                        tail.trim()
                    )));
                }
            }
            // A memory golden: the processes the warmup left are dumped (CRIU ends them).
            let images = self.box_dir(&builder).join("golden-memory");
            let memory = match info.pid {
                Some(pid) if warmup.memory => {
                    match self.dump_memory(&builder, pid, &images, false, None) {
                        Ok(_) => true,
                        Err(why) => {
                            tracing::warn!(golden = %digest, "files only, no memory: {why}");
                            false
                        }
                    }
                }
                _ => false,
            };
            // Stop everything before taking the upper directory as the golden layer.
            self.kill(&builder, info.pid)?;
            let golden = Golden {
                digest: digest.clone(),
                template: template.clone(),
                layer: dir.join("layer"),
            };
            template::build_atomically(&dir, |staging| {
                std::fs::rename(self.box_dir(&builder).join("upper"), staging.join("layer"))
                    .map_err(EngineError::io("move golden layer"))?;
                if memory {
                    std::fs::rename(&images, staging.join("memory"))
                        .map_err(EngineError::io("move golden memory"))?;
                }
                seal(staging, &golden, self.ids)
            })?;
            self.installed(&golden)
        })();
        self.destroy(&builder)?;
        built
    }

    pub(super) fn merge_golden(&self, snapshot: &Snapshot) -> Result<Golden> {
        if snapshot.memory {
            return Err(EngineError::Unsupported {
                what: "promoting process memory",
                engine: "jail",
            });
        }
        let base = &snapshot.base;
        let mut hasher = blake3::Hasher::new();
        hasher.update(b"silk-golden-promoted-v1").update(base.template.digest.as_str().as_bytes());
        if let Some(g) = &base.golden {
            hasher.update(g.digest.as_str().as_bytes());
        }
        let mut tar = std::fs::File::open(&snapshot.layer_tar)
            .map_err(EngineError::io(format!("open {}", snapshot.layer_tar.display())))?;
        hasher.update_reader(&mut tar).map_err(EngineError::io("hash snapshot"))?;
        let digest = Digest::of(&hasher);
        let dir = self.golden_dir(&digest);
        let golden = Golden {
            digest: digest.clone(),
            template: base.template.clone(),
            layer: dir.join("layer"),
        };
        if let Some(golden) = self.find_golden(&digest) {
            return Ok(golden);
        }
        template::build_atomically(&dir, |staging| {
            let layer_dir = staging.join("layer");
            std::fs::create_dir(&layer_dir).map_err(EngineError::io("mkdir golden layer"))?;
            if let Some(g) = &base.golden {
                // The old golden's layer first (as a layer tar, so its whiteouts carry over),
                // then the snapshot's changes on top.
                let below = staging.join("below.tar");
                let file = std::fs::File::create(&below).map_err(EngineError::io("create"))?;
                let mut out = std::io::BufWriter::new(file);
                layer::capture(&[&g.layer], &mut out, self.ids)?;
                std::io::Write::flush(&mut out).map_err(EngineError::io("write layer"))?;
                let file = std::fs::File::open(&below).map_err(EngineError::io("open"))?;
                layer::apply(file, &layer_dir, Whiteouts::Overlay, self.ids)?;
                std::fs::remove_file(&below).map_err(EngineError::io("remove"))?;
            }
            let file = std::fs::File::open(&snapshot.layer_tar).map_err(EngineError::io("open"))?;
            layer::apply(file, &layer_dir, Whiteouts::Overlay, self.ids)?;
            seal(staging, &golden, self.ids)
        })?;
        self.installed(&golden)
    }

    /// The golden a build just put in place, checked: `build_atomically` keeps a directory
    /// that was already there, and directories are named by a digest's first 16 digits, so a
    /// golden whose digest merely shares them (one named by a hostile store) must not pass for
    /// this one.
    fn installed(&self, golden: &Golden) -> Result<Golden> {
        self.find_golden(&golden.digest).ok_or_else(|| {
            EngineError::Host(format!(
                "goldens/{} holds another golden (its digest shares the first 16 digits)",
                golden.digest.short()
            ))
        })
    }
}

/// Finishes a golden's staging directory: the marker of the id range its layer is stored in,
/// then `golden.json` (what `find_golden` reads), so a golden found is always whole.
fn seal(staging: &Path, golden: &Golden, ids: Ids) -> Result<()> {
    mark_ids(staging, ids)?;
    let json = serde_json::to_vec_pretty(golden).map_err(|e| EngineError::Host(e.to_string()))?;
    std::fs::write(staging.join("golden.json"), json).map_err(EngineError::io("write golden.json"))
}
