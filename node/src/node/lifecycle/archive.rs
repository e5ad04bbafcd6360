//! Archive: a sandbox's files to the object store and its host freed; and the store transfers
//! every lifecycle operation uses (upload; downloads are `stream.rs`'s `download_into`).

use super::*;

impl Node {
    // ---- archive ----

    /// Moves the sandbox's files into the store and frees the host. They are captured into a
    /// tar first; when the upload fails a sandbox that ran is woken again and the error returned.
    pub async fn archive(&self, id: &str, memory: Memory) -> Result<ClaimRecord, NodeError> {
        let _busy = self.busy(id).await;
        self.archive_locked(self.current(id)?, memory).await
    }

    /// [`archive`](Self::archive) with the sandbox's lifecycle lock held.
    pub(in crate::node) async fn archive_locked(
        &self,
        live: Live,
        memory: Memory,
    ) -> Result<ClaimRecord, NodeError> {
        let id = live.record.id.clone();
        let id = id.as_str();
        let was_running = match live.record.phase {
            Phase::Archived(_) => return Ok(live.record),
            Phase::Running => true,
            Phase::Stopped | Phase::Captured(_) => false,
        };
        let (mut rec, files) = self.stop_here(live, memory).await?;
        let archive = new_archive_name(id);
        let name = SnapshotName::archive(&archive).map_err(NodeError::from)?;
        rec.intent = Some(Intent::Archive(archive.clone()));
        self.put_record(&rec).await?;
        self.crash_point("archive:intent").await;
        let uploaded = self.upload_files(&name, &files, &rec, memory).await;
        if let (Ok(kept), Some(live)) = (&uploaded, self.get(id)) {
            live.activity.set_memory(kept.clone());
        }
        rec.intent = None;
        if let Err(e) = uploaded {
            self.crash_point("archive:upload-failed").await;
            self.undo_stop(rec, None, was_running, "archive").await?;
            return Err(e);
        }
        self.crash_point("archive:uploaded").await;
        let mut archived = rec.clone();
        archived.enter(Phase::Archived(archive.clone()), now_ms()).map_err(conflict)?;
        // Published before it is journalled: any node may wake it from here on, also when this
        // one is gone, and an archived record here always has its published twin.
        if let Err(e) = self.publish_archived(&archived).await {
            self.undo_stop(rec, Some(&archive), was_running, "archive").await?;
            return Err(e);
        }
        let rec = archived;
        self.put_record(&rec).await?;
        self.drop_files(id, &files).await;
        self.metrics.archived.fetch_add(1, Ordering::Relaxed);
        Ok(rec)
    }

    /// Stops `live` in place, unless it is stopped already; returns its record and where its
    /// files are for an upload.
    pub(in crate::node) async fn stop_here(
        &self,
        live: Live,
        memory: Memory,
    ) -> Result<(ClaimRecord, Files), NodeError> {
        let id = live.record.id.clone();
        if live.record.phase == Phase::Running {
            self.hibernate_locked(live, memory).await?;
        }
        let live = self.current(&id)?;
        let files = Files::of(&live).ok_or_else(|| NodeError::internal("unknown sandbox base"))?;
        Ok((live.record, files))
    }

    /// Once the store holds a stopped sandbox's files: its local copy goes, before the call
    /// answers (a wake of the archive here restores a box under the same id).
    pub(in crate::node) async fn drop_files(&self, id: &str, files: &Files) {
        match files {
            Files::Tar(snap) => {
                let _ = std::fs::remove_file(&snap.layer_tar);
            }
            Files::Box(_) => {
                let (engine, id) = (self.engine.clone(), id.to_string());
                let Ok(sid) = id.parse::<SandboxId>() else { return };
                // A box left behind goes at the next start (no claim runs on it).
                if let Err(e) = blocking(move || engine.destroy(&sid)).await {
                    tracing::warn!(sandbox = id, "removing the box of a stored sandbox: {e}");
                }
            }
        }
    }

    /// Puts a sandbox back as it was after an archive or move failed before its switch: the
    /// intent cleared, the upload (if any) dropped, running again if it was.
    pub(in crate::node) async fn undo_stop(
        &self,
        mut rec: ClaimRecord,
        archive: Option<&str>,
        was_running: bool,
        what: &str,
    ) -> Result<(), NodeError> {
        rec.intent = None;
        self.put_record(&rec).await?;
        if let Some(archive) = archive {
            self.drop_archive(archive).await;
        }
        if was_running && let Err(w) = self.wake_locked(self.current(&rec.id)?).await {
            tracing::warn!(sandbox = rec.id, "waking after a failed {what}: {w}");
        }
        Ok(())
    }

    /// Deletes an archive whose sandbox is gone or running again. A failure is logged: the
    /// archive's unique name means a leftover can never be mistaken for a newer one.
    pub(in crate::node) async fn drop_archive(&self, archive: &str) {
        let Ok(name) = SnapshotName::archive(archive) else { return };
        if let Err(e) = self.store.delete(&name).await {
            tracing::warn!(archive = %name, "delete failed (left in the store): {e}");
        }
    }

    // ---- the store ----

    /// Uploads a snapshot file as `name`, described for the nodes that restore it.
    pub(in crate::node) async fn upload(
        &self,
        name: &SnapshotName,
        snap: &Snapshot,
        source: &ClaimRecord,
        meta: BTreeMap<String, String>,
    ) -> Result<silk_store::PutReport, NodeError> {
        let meta = self.snapshot_meta(&StoredSnapshot::of(snap), source, meta)?;
        let file = tokio::fs::File::open(&snap.layer_tar)
            .await
            .map_err(|e| NodeError::internal(format!("open {}: {e}", snap.layer_tar.display())))?;
        Ok(self.store.put(name, tokio::io::BufReader::with_capacity(1 << 20, file), meta).await?)
    }

    /// Uploads a stopped sandbox's files (and its memory, as `memory` says) as `name`: from
    /// its tar, or straight from its box, the engine's capture streamed into the store's put
    /// through a pipe (no file, no second pass over the bytes). Says whether memory went along.
    pub(in crate::node) async fn upload_files(
        &self,
        name: &SnapshotName,
        files: &Files,
        source: &ClaimRecord,
        memory: Memory,
    ) -> Result<MemoryKept, NodeError> {
        let base = match files {
            Files::Tar(snap) => {
                self.upload(name, snap, source, BTreeMap::new()).await?;
                return Ok(snap.memory_kept());
            }
            Files::Box(base) => base,
        };
        let stored = StoredSnapshot::over(base, &box_spec(source));
        let meta = self.snapshot_meta(&stored, source, BTreeMap::new())?;
        let (engine, sid) = (self.engine.clone(), source.id.parse::<SandboxId>()?);
        let scratch = self.scratch_tar("upload");
        let write = move |out: &mut dyn silk_engine::SnapshotSink| {
            engine.write_snapshot(&sid, memory, out, &scratch, None)
        };
        let (_, streamed) = self.upload_stream(name, meta, Pace::Store, write).await?;
        Ok(streamed.memory)
    }

    /// The metadata a snapshot is stored with: what it is over, and whose it is.
    pub(super) fn snapshot_meta(
        &self,
        stored: &StoredSnapshot,
        source: &ClaimRecord,
        mut meta: BTreeMap<String, String>,
    ) -> Result<BTreeMap<String, String>, NodeError> {
        let json = serde_json::to_string(stored).map_err(|e| NodeError::internal(e.to_string()))?;
        meta.insert("snapshot".into(), json);
        meta.insert("sandbox".into(), source.id.clone());
        meta.insert("template".into(), source.template.clone());
        meta.insert("token_hash".into(), source.token_hash.clone());
        if let Some(e) = &source.egress
            && let Ok(json) = serde_json::to_string(e)
        {
            meta.insert("egress".into(), json);
        }
        if let Some(t) = &source.tenant {
            // Whose quota the bytes count against, and whose key may see a checkpoint.
            meta.insert("tenant".into(), t.clone());
        }
        meta.insert("engine".into(), self.engine.name().into());
        Ok(meta)
    }
}

/// Where a stopped sandbox's files are, for an upload.
pub(in crate::node) enum Files {
    /// In its box (hibernated in place), over this base.
    Box(Base),
    /// In a tar (hibernated into one).
    Tar(Snapshot),
}

impl Files {
    /// Where a stopped sandbox's files are (`None`: its base is not known here).
    pub(in crate::node) fn of(live: &Live) -> Option<Files> {
        match live.record.phase.snapshot() {
            Some(snap) => Some(Files::Tar(snap.clone())),
            None => live.base.clone().map(Files::Box),
        }
    }
}
