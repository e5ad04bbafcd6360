//! The jail engine's snapshot, stop, resume and restore: files always, memory where CRIU can
//! (see `memory`).

use std::path::Path;

use std::io::{Read, Write};

use super::forks::link_files;
use super::host::partial_path;
use super::{JailEngine, disk, unmounting};
use crate::layer::{self, Ids, Whiteouts};
use crate::{
    Base, BoxInfo, BoxSpec, Engine, EngineError, Memory, MemoryKept, Result, SandboxId, Snapshot,
    SnapshotMode, Streamed,
};

/// What [`JailEngine::capture_box`] took: the box's base and spec, the bytes `write` reported,
/// whether memory came along, and how long a running box was frozen.
pub(super) struct Captured {
    pub(super) base: Base,
    pub(super) spec: BoxSpec,
    pub(super) bytes: u64,
    pub(super) memory: MemoryKept,
    pub(super) freeze_ms: Option<u64>,
}

impl JailEngine {
    pub(super) fn take_snapshot(
        &self,
        id: &SandboxId,
        mode: SnapshotMode,
        memory: Memory,
        into: &Path,
    ) -> Result<Snapshot> {
        let partial = partial_path(into);
        let captured = self.capture_box(id, mode, memory, |images, layers, ids| {
            let written = (|| {
                let file =
                    std::fs::File::create(&partial).map_err(EngineError::io("create snapshot"))?;
                let mut out = std::io::BufWriter::new(file);
                if let Some(images) = images {
                    self.write_memory_entry(images, &mut out)?;
                }
                layer::capture(layers, &mut out, ids)?;
                let file = out
                    .into_inner()
                    .map_err(|e| EngineError::io("write snapshot")(e.into_error()))?;
                if mode == SnapshotMode::Stop {
                    // All that is left of the box once it goes: on disk before it does. A copy
                    // of a box that runs on is scratch for an upload or a restore, and the
                    // store syncs what it keeps.
                    file.sync_all().map_err(EngineError::io("sync snapshot"))?;
                }
                let bytes =
                    file.metadata().map(|m| m.len()).map_err(EngineError::io("stat snapshot"))?;
                std::fs::rename(&partial, into).map_err(EngineError::io("commit snapshot"))?;
                Ok(bytes)
            })();
            if written.is_err() {
                let _ = std::fs::remove_file(&partial);
            }
            written
        })?;
        Ok(Snapshot {
            base: captured.base,
            spec: captured.spec,
            layer_tar: into.to_path_buf(),
            bytes: captured.bytes,
            memory: captured.memory.kept,
            memory_why_not: captured.memory.why_not,
            freeze_ms: captured.freeze_ms,
            vouched: false,
        })
    }

    /// A box's snapshot written to `out` (see `Engine::write_snapshot`).
    ///
    /// A running box's memory entry is written after it thaws: while it is frozen its files go
    /// to `scratch` and its dumped images are linked aside, and then the entry (read from those
    /// links, its MAC computed) and the files (from `scratch`) go to `out` in the stream's
    /// order. The freeze window is then the dump and the file capture, not the images' pass
    /// too; the images hold the frozen moment either way.
    pub(super) fn stream_snapshot(
        &self,
        id: &SandboxId,
        memory: Memory,
        out: &mut dyn crate::SnapshotSink,
        scratch: &Path,
        keep: Option<&str>,
    ) -> Result<Streamed> {
        let running = self.record(id).is_ok_and(|r| self.live_pid(&r).is_some());
        let aside = self.box_dir(id).join("memory-aside");
        let (mut copy, mut later) = (None, false);
        let captured =
            self.capture_box(id, SnapshotMode::KeepRunning, memory, |images, layers, ids| {
                let files = |out: &mut dyn std::io::Write| match keep {
                    Some(name) => self.capture_beside(name, images, layers, ids, out),
                    None => layer::capture(layers, out, ids).map(|()| None),
                };
                match images {
                    Some(images) if running => {
                        let _ = std::fs::remove_dir_all(&aside);
                        link_files(images, &aside)
                            .map_err(EngineError::io("link memory images"))?;
                        let file = std::fs::File::create(scratch)
                            .map_err(EngineError::io("create the files' spool"))?;
                        let mut spool = std::io::BufWriter::with_capacity(256 << 10, file);
                        copy = files(&mut spool)?;
                        spool.flush().map_err(EngineError::io("write the files' spool"))?;
                        later = true;
                    }
                    images => {
                        let mut out = std::io::BufWriter::with_capacity(256 << 10, &mut *out);
                        if let Some(images) = images {
                            self.write_memory_entry(images, &mut out)?;
                        }
                        copy = files(&mut out)?;
                        out.flush().map_err(EngineError::io("write snapshot"))?;
                    }
                }
                Ok(0)
            });
        let captured = captured.and_then(|captured| {
            if later {
                self.write_after_thaw(&aside, scratch, out)?;
            }
            Ok(captured)
        });
        let _ = self.trash.discard(&aside);
        let _ = std::fs::remove_file(scratch);
        let kept = match (captured.as_ref(), keep, copy) {
            (Ok(captured), Some(name), Some(copy)) => self.keep_copy(name, copy, &captured.base),
            (_, _, Some(copy)) => {
                self.release_fork(&copy.fork);
                None
            }
            _ => None,
        };
        let captured = captured?;
        Ok(Streamed { memory: captured.memory, freeze_ms: captured.freeze_ms, kept })
    }

    /// The rest of [`Self::stream_snapshot`] once a running box thawed: the memory entry of the
    /// images in `images`, then the files' tar spooled in `files`.
    fn write_after_thaw(
        &self,
        images: &Path,
        files: &Path,
        out: &mut dyn crate::SnapshotSink,
    ) -> Result<()> {
        let mut out = std::io::BufWriter::with_capacity(256 << 10, out);
        self.write_memory_entry(images, &mut out)?;
        let mut spool =
            std::fs::File::open(files).map_err(EngineError::io("open the files' spool"))?;
        // 1 MiB at a time (`io::copy` moves 8 KiB).
        let mut buf = vec![0u8; 1 << 20];
        loop {
            match spool.read(&mut buf).map_err(EngineError::io("read the files' spool"))? {
                0 => break,
                n => out.write_all(&buf[..n]).map_err(EngineError::io("write snapshot"))?,
            }
        }
        out.flush().map_err(EngineError::io("write snapshot"))
    }

    /// Captures a box as it is: its memory dumped (as `memory` says) and its processes frozen
    /// while `write` takes the memory images (if any), the layers of its files (top first) and
    /// the id range they are stored in. Then, as `mode` says, it runs on or is destroyed; a
    /// failed capture leaves it as it was.
    pub(super) fn capture_box(
        &self,
        id: &SandboxId,
        mode: SnapshotMode,
        memory: Memory,
        write: impl FnOnce(Option<&Path>, &[&Path], Ids) -> Result<u64>,
    ) -> Result<Captured> {
        let record = self.record(id)?;
        // A jail whose silkd died (or that a host reboot ended) still has its files: capturing
        // them is how it comes back. Only a live one needs freezing for a consistent capture.
        let live = self.live_pid(&record);
        // The ids its files are stored with (a box from before the user namespace: host ids).
        let ids = Ids { base: record.id_base.unwrap_or(0) };
        let dir = self.box_dir(id);
        // The memory images that go into the snapshot: a stopped box's from its hibernation, a
        // running one's dumped now (into a directory of the snapshot's own).
        let hibernated = dir.join("memory");
        let fresh = dir.join("memory-snapshot");
        let mut kept = MemoryKept::no("not asked for");
        let mut images = None;
        // From the freeze to the thaw: what the sandbox's processes lose to a checkpoint.
        let mut frozen_at = None;
        if memory != Memory::Off {
            match live {
                Some(pid) => {
                    // Frozen from the dump to the end of the file capture, so both show one
                    // moment. A stop snapshot ends the jail in the dump.
                    let leave = mode == SnapshotMode::KeepRunning;
                    match self.dump_memory(id, pid, &fresh, leave, Some(&mut frozen_at)) {
                        Ok(took) => {
                            tracing::debug!(sandbox = %id, "memory dumped in {took:?}");
                            (kept, images) = (MemoryKept::yes(), Some(fresh.clone()));
                        }
                        Err(why) => kept = MemoryKept::no(why),
                    }
                }
                None if hibernated.join("memory.json").is_file() => {
                    (kept, images) = (MemoryKept::yes(), Some(hibernated.clone()));
                }
                None => kept = MemoryKept::no("its processes were not running"),
            }
            if memory == Memory::Required && !kept.kept {
                if frozen_at.is_some() {
                    self.cgroups.freeze(id, false)?;
                }
                let why = kept.why_not.unwrap_or_default();
                return Err(EngineError::MemoryFailed(why));
            }
        }
        if live.is_some() && frozen_at.is_none() {
            self.cgroups.freeze(id, true)?;
            frozen_at = Some(std::time::Instant::now());
        }
        // A fork's copy: its upper directory over the layer it shares with the others.
        let upper = disk::files_dir(&dir).join("upper");
        let fork = self.fork_layer(&dir);
        let layers: Vec<&Path> =
            [Some(upper.as_path()), fork.as_deref()].into_iter().flatten().collect();
        let captured = write(images.as_deref(), &layers, ids);
        let after = match mode {
            SnapshotMode::KeepRunning if live.is_none() => Ok(()),
            SnapshotMode::KeepRunning => self.cgroups.freeze(id, false),
            SnapshotMode::Stop if captured.is_ok() => {
                // The snapshot is committed: the caller has the sandbox's files. A sandbox that
                // fails to go away is left for `list` to report (and its owner to destroy).
                if let Err(e) = self.destroy(id) {
                    tracing::warn!(sandbox = %id, "destroy after a stop snapshot: {e}");
                }
                Ok(())
            }
            // A failed capture must leave the source as it was — but a stop snapshot whose
            // dump ended the jail has only its files left: it stays, stopped, and a resume
            // starts it from them.
            SnapshotMode::Stop if live.is_none() => Ok(()),
            SnapshotMode::Stop => self.cgroups.freeze(id, false),
        };
        let freeze_ms = match mode {
            SnapshotMode::KeepRunning => frozen_at.map(|t| t.elapsed().as_millis() as u64),
            SnapshotMode::Stop => None,
        };
        // Once thawed: the images dumped now are spent (written, or linked aside) and go
        // behind the call, not file by file in the freeze.
        let _ = self.trash.discard(&fresh);
        let bytes = captured?;
        after?;
        Ok(Captured {
            base: record.info.base,
            spec: record.info.spec,
            bytes,
            memory: kept,
            freeze_ms,
        })
    }

    /// Stops a sandbox, its files in place and (unless `memory` is off, or CRIU cannot) its
    /// processes dumped beside them for `resume`.
    pub(super) fn stop_box(&self, id: &SandboxId, memory: Memory) -> Result<MemoryKept> {
        // Not the jail's to hold while its memory is dumped.
        self.answered.forget(id);
        let record = self.record(id)?;
        let Some(pid) = self.live_pid(&record) else {
            // The rootfs mount lives in the jail's own mount namespace: it went with the jail.
            self.kill(id, None)?;
            return Ok(MemoryKept::no("its processes were not running"));
        };
        // Held past the kill, so the overlay's unmount (a sync of all it wrote) runs behind
        // this call: see `unmounting`.
        let root = unmounting::Unmounting::hold(pid);
        let dir = self.box_dir(id);
        // Images beside a running box are from before its last wake: a node killed between a
        // restore and their removal leaves them. They must not block this stop's images, nor
        // be restored by the next wake after a stop that keeps none.
        let _ = std::fs::remove_dir_all(dir.join("memory"));
        let kept = match memory {
            Memory::Off => MemoryKept::no("not asked for"),
            _ => match self.dump_memory(id, pid, &dir.join("memory.partial"), false, None) {
                Ok(_) => {
                    std::fs::rename(dir.join("memory.partial"), dir.join("memory"))
                        .map_err(EngineError::io("commit memory images"))?;
                    MemoryKept::yes()
                }
                // The jail runs on as it was.
                Err(why) if memory == Memory::Required => {
                    return Err(EngineError::MemoryFailed(why));
                }
                Err(why) => MemoryKept::no(why),
            },
        };
        // After a dump CRIU has killed the jail already: the signal finds it dying or dead.
        self.kill(id, Some(pid))?;
        if let Some(root) = root {
            self.unmounting.close(id, root);
        }
        Ok(kept)
    }

    /// Starts a stopped sandbox again: from its memory images if it has them (its processes go
    /// on), else (or if they fail) from its files.
    pub(super) fn resume_box(&self, id: &SandboxId) -> Result<BoxInfo> {
        // Two overlays over one upper directory at once: the last stop's must be gone.
        self.unmounting.wait(id);
        let record = self.record(id)?;
        if let Some(pid) = self.live_pid(&record) {
            return Ok(BoxInfo { pid: Some(pid), running: true, ..record.info });
        }
        // A jail that died by itself can leave its cgroups behind.
        self.cgroups.remove(id)?;
        let dir = self.box_dir(id);
        let upper = disk::files_dir(&dir).join("upper");
        if record.id_base != Some(self.ids.base) {
            // Made with another range (none: before sandboxes had a user namespace, host ids
            // 0..65536): its files move into this one, and memory from then cannot come back.
            let _ = std::fs::remove_dir_all(dir.join("memory"));
            layer::shift_ids(&upper, record.id_base.unwrap_or(0), self.ids)?;
        }
        let info = record.info;
        let mut memory = MemoryKept::default();
        if dir.join("memory").is_dir() {
            match self.restore_memory(info.base.clone(), id, &info.spec) {
                Ok(restored) => return Ok(restored),
                Err(why) => {
                    tracing::warn!(sandbox = %id, "woken from its files: {why}");
                    let _ = std::fs::remove_dir_all(dir.join("memory"));
                    memory = MemoryKept::no(why);
                }
            }
        }
        let resumed = self.launch_box(info.base, id, &info.spec, &dir, info.address);
        if resumed.is_err() {
            // Its files stay: a failed resume leaves a stopped sandbox, never a lost one.
            let _ = self.cgroups.remove(id);
        }
        resumed.map(|info| BoxInfo { memory, ..info })
    }

    /// Applies a snapshot's files to a new box's `upper` directory and, when it carries memory
    /// that is `wanted`, starts the box from it: `Ok(Ok(info))`. `Ok(Err(why))`: the files are
    /// in place, start them.
    pub(super) fn apply_snapshot(
        &self,
        input: SnapshotInput<'_>,
        wanted: Memory,
        upper: &Path,
        base: &Base,
        id: &SandboxId,
        spec: &BoxSpec,
    ) -> Result<std::result::Result<BoxInfo, String>> {
        let images = self.box_dir(id).join("memory");
        let (mut files, carried) = match input {
            SnapshotInput::File(tar) => self.open_snapshot(tar, &images)?,
            SnapshotInput::Stream(stream, vouched) => {
                self.open_snapshot_stream(stream, &images, vouched)?
            }
        };
        layer::apply(&mut files, upper, Whiteouts::Overlay, self.ids)?;
        // To the stream's end: a download that failed after the layer's last entry still fails
        // the restore, and one that did not is not left writing into a closed pipe.
        std::io::copy(&mut files, &mut std::io::sink())
            .map_err(EngineError::io("read snapshot"))?;
        let why = match (wanted, carried) {
            (Memory::Off, _) => "not asked for".to_string(),
            (_, Ok(false)) => "the snapshot holds no memory".to_string(),
            (_, Err(why)) => why,
            (_, Ok(true)) => match self.restore_memory(base.clone(), id, spec) {
                Ok(info) => return Ok(Ok(info)),
                Err(why) => why,
            },
        };
        let _ = std::fs::remove_dir_all(&images);
        if wanted == Memory::Required {
            return Err(EngineError::MemoryFailed(why));
        }
        Ok(Err(why))
    }
}

/// Where a restore's snapshot comes from.
pub(super) enum SnapshotInput<'a> {
    /// A file.
    File(&'a Path),
    /// A stream, read once as it arrives (a download), and whether it is vouched for
    /// (`Snapshot::vouched`).
    Stream(&'a mut dyn std::io::Read, bool),
}
