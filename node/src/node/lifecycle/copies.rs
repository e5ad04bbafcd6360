//! Copies of a sandbox: checkpoints (in the store) and the sandboxes branched from them, and
//! forks (promoted templates: `promote.rs`).

use super::*;
use kept::Kept;
use silk_engine::{Lane, Size};
use silk_store::Manifest;

/// Checkpoint manifests read at once when listing them.
const CHECKPOINT_READS: usize = 32;

impl Node {
    // ---- checkpoint and branch ----

    pub async fn checkpoint(
        &self,
        id: &str,
        name: Option<String>,
        memory: Memory,
    ) -> Result<CheckpointInfo, NodeError> {
        if name.as_ref().is_some_and(|n| n.is_empty() || n.chars().count() > 128) {
            return Err(NodeError::bad_request("a checkpoint name is 1-128 characters"));
        }
        self.room_on_disk().await?;
        let _busy = self.busy(id).await;
        let live = self.current(id)?;
        if let Some(t) = &live.record.tenant {
            self.checkpoint_room(t).await?;
        }
        let hex = random_hex(16);
        let ck = format!("ck_{hex}");
        let store_name = SnapshotName::checkpoint(&hex).map_err(NodeError::from)?;
        let mut meta = BTreeMap::new();
        if let Some(n) = &name {
            meta.insert("name".into(), n.clone());
        }
        let mut copy_on = None;
        let (report, streamed) = match &live.record.phase {
            // Spooled: the sandbox is frozen while its capture goes to memory (or disk), and
            // the upload reads behind it, beside it rather than after it.
            Phase::Running | Phase::Stopped => {
                before_dump(&live, memory);
                let base = live.base.as_ref().ok_or_else(|| NodeError::internal("unknown base"))?;
                let stored = StoredSnapshot::over(base, &box_spec(&live.record));
                let mut meta = self.snapshot_meta(&stored, &live.record, meta)?;
                let (engine, sid) = (self.engine.clone(), live.record.id.parse::<SandboxId>()?);
                let scratch = self.scratch_tar("checkpoint");
                // A copy kept here for the branches on this node, of a checkpoint that keeps
                // memory: a branch of one is otherwise mostly its images' download. The
                // manifest names this node, so the fleet sends its branches here.
                let keep = (memory != Memory::Off && self.lock_kept().on()).then(|| ck.clone());
                if keep.is_some() {
                    meta.insert("copy_on".into(), self.name.clone());
                    copy_on = Some(self.name.clone());
                }
                let write = move |out: &mut dyn silk_engine::SnapshotSink| {
                    engine.write_snapshot(&sid, memory, out, &scratch, keep.as_deref())
                };
                let pace = Pace::Spool { captured: "checkpoint:captured" };
                let uploaded = self.upload_stream(&store_name, meta, pace, write).await;
                match uploaded {
                    Ok((report, streamed)) => {
                        if let Some(bytes) = streamed.kept {
                            let (size, lane) = (live.record.size, live.record.lane);
                            let kept = Kept { bytes, size, lane, snapshot_bytes: report.size };
                            let dropped = self.lock_kept().insert(ck.clone(), kept);
                            self.drop_copies(dropped);
                        }
                        (report, streamed)
                    }
                    Err(e) => {
                        // Whatever the engine kept belongs to no checkpoint.
                        self.drop_copies(vec![ck.clone()]);
                        return Err(e);
                    }
                }
            }
            Phase::Captured(snap) => {
                let report = self.upload(&store_name, snap, &live.record, meta).await?;
                (report, Streamed { memory: snap.memory_kept(), freeze_ms: None, kept: None })
            }
            Phase::Archived(_) => {
                return Err(conflict("a sandbox that is Archived must be woken first".into()));
            }
        };
        self.crash_point("checkpoint:uploaded").await;
        self.metrics.checkpoints.fetch_add(1, Ordering::Relaxed);
        let checkpoint = silk_api::Checkpoint {
            id: ck,
            name,
            sandbox: id.to_string(),
            template: live.record.template.clone(),
            created_ms: now_ms(),
            bytes: report.size,
            uploaded_bytes: Some(report.uploaded_bytes),
            memory_snapshot: Some(streamed.memory.kept),
            memory_note: streamed.memory.why_not,
            freeze_ms: streamed.freeze_ms,
        };
        let token_hash = live.record.token_hash.clone();
        let (tenant, egress) = (live.record.tenant.clone(), live.record.egress.clone());
        Ok(CheckpointInfo { checkpoint, token_hash, tenant, egress, copy_on })
    }

    /// Refuses a checkpoint of `tenant` past its `max_checkpoints` or `max_store_bytes` (what
    /// its checkpoints and archives hold now, read from the store; two checkpoints taken at
    /// the same moment may both pass the last room).
    async fn checkpoint_room(&self, tenant: &str) -> Result<(), NodeError> {
        let Some(limits) = self.tenants.get(tenant).map(|r| r.limits) else {
            return Err(NodeError::sandbox_not_found());
        };
        let (count, bytes) = self.tenant_store_usage(tenant).await?;
        let refuse = |what: String| Err(NodeError::new(Code::QuotaExceeded, what));
        if count >= limits.max_checkpoints {
            return refuse(format!(
                "tenant {tenant} has {count} checkpoints of its max_checkpoints {}",
                limits.max_checkpoints
            ));
        }
        if bytes >= limits.max_store_bytes {
            return refuse(format!(
                "tenant {tenant} stores {bytes} bytes of its max_store_bytes {}",
                limits.max_store_bytes
            ));
        }
        Ok(())
    }

    /// `tenant`'s checkpoints, and the logical bytes of its checkpoints and archives.
    pub async fn tenant_store_usage(&self, tenant: &str) -> Result<(u64, u64), NodeError> {
        let (mut checkpoints, mut bytes) = (0, 0);
        for prefix in ["checkpoints/", "archives/"] {
            for name in self.store.list(prefix).await? {
                let m = match self.store.manifest(&name).await {
                    Ok(m) => m,
                    Err(StoreError::NotFound { .. }) => continue,
                    Err(e) => return Err(e.into()),
                };
                if m.meta.get("tenant").map(String::as_str) == Some(tenant) {
                    bytes += m.size;
                    checkpoints += u64::from(matches!(name, SnapshotName::Checkpoint(_)));
                }
            }
        }
        Ok((checkpoints, bytes))
    }

    /// Checkpoints in `scope`: every one (root), a tenant's, and of those, `sandbox`'s.
    pub async fn checkpoints(
        &self,
        sandbox: Option<&str>,
        scope: Option<&str>,
    ) -> Result<Vec<CheckpointInfo>, NodeError> {
        use futures_util::StreamExt;
        let names = self.store.list("checkpoints/").await?;
        // Each checkpoint's manifest is its own object: read many at once (one at a time was
        // a store round trip per checkpoint, 10 000 in a row for a large tenant).
        let names: Vec<(String, SnapshotName)> = names
            .into_iter()
            .filter_map(|name| match &name {
                SnapshotName::Checkpoint(hex) => Some((hex.clone(), name.clone())),
                _ => None,
            })
            .collect();
        // Manifests read before are not read again (see `Node::checkpoint_infos`); the ones
        // gone from the store are forgotten.
        let (mut infos, unread) = {
            let mut known = self.checkpoint_infos.lock().unwrap_or_else(|p| p.into_inner());
            let listed: std::collections::HashSet<&str> =
                names.iter().map(|(hex, _)| hex.as_str()).collect();
            known.retain(|hex, _| listed.contains(hex.as_str()));
            let (read, unread): (Vec<_>, Vec<_>) =
                names.into_iter().partition(|(hex, _)| known.contains_key(hex));
            (read.iter().map(|(hex, _)| known[hex].clone()).collect::<Vec<_>>(), unread)
        };
        let mut reads = futures_util::stream::iter(unread)
            .map(|(hex, name)| async move { (self.checkpoint_info(&hex, &name).await, hex) })
            .buffer_unordered(CHECKPOINT_READS);
        let mut fresh = vec![];
        while let Some((read, hex)) = reads.next().await {
            match read {
                Ok(info) => fresh.push((hex, info)),
                // Deleted between the list and the read.
                Err(e) if e.code == Code::NotFound => continue,
                Err(e) => return Err(e),
            }
        }
        {
            let mut known = self.checkpoint_infos.lock().unwrap_or_else(|p| p.into_inner());
            for (hex, info) in fresh {
                infos.push(info.clone());
                known.insert(hex, info);
            }
        }
        let mut out = vec![];
        for info in infos {
            let in_scope = scope.is_none_or(|t| info.tenant.as_deref() == Some(t));
            if in_scope && sandbox.is_none_or(|s| s == info.sandbox) {
                out.push(info);
            }
        }
        out.sort_by(|a, b| a.created_ms.cmp(&b.created_ms).then(a.id.cmp(&b.id)));
        Ok(out)
    }

    async fn checkpoint_info(
        &self,
        hex: &str,
        name: &SnapshotName,
    ) -> Result<CheckpointInfo, NodeError> {
        self.read_checkpoint(hex, name).await.map(|(info, _)| info)
    }

    /// The checkpoint's manifest from the store, and what the API shows of it.
    async fn read_checkpoint(
        &self,
        hex: &str,
        name: &SnapshotName,
    ) -> Result<(CheckpointInfo, Manifest), NodeError> {
        let m = self.store.manifest(name).await.map_err(|e| match e {
            StoreError::NotFound { .. } => {
                // Deleted elsewhere in the fleet: its copy here goes too.
                self.forget_copy(&format!("ck_{hex}"));
                checkpoint_not_found()
            }
            other => other.into(),
        })?;
        let get = |k: &str| m.meta.get(k).cloned().unwrap_or_default();
        let checkpoint = silk_api::Checkpoint {
            id: format!("ck_{hex}"),
            name: m.meta.get("name").cloned(),
            sandbox: get("sandbox"),
            template: get("template"),
            created_ms: m.created_ms,
            bytes: m.size,
            uploaded_bytes: None,
            memory_snapshot: None,
            memory_note: None,
            freeze_ms: None,
        };
        let tenant = m.meta.get("tenant").cloned();
        let egress = m.meta.get("egress").and_then(|j| serde_json::from_str(j).ok());
        let copy_on = m.meta.get("copy_on").cloned();
        let info =
            CheckpointInfo { checkpoint, token_hash: get("token_hash"), tenant, egress, copy_on };
        Ok((info, m))
    }

    /// The checkpoint, if `bearer` may use it: the root token, the token of the sandbox it was
    /// taken from, or its tenant's key. Anything else is the same 404 as an unknown id.
    pub async fn authorized_checkpoint(
        &self,
        id: &str,
        bearer: Option<&str>,
    ) -> Result<CheckpointInfo, NodeError> {
        self.authorized_checkpoint_read(id, bearer).await.map(|(info, _)| info)
    }

    /// [`Self::authorized_checkpoint`] and the manifest read for it, which a branch then
    /// starts from ([`Self::branch_from`]): one read of the store, not two.
    pub async fn authorized_checkpoint_read(
        &self,
        id: &str,
        bearer: Option<&str>,
    ) -> Result<(CheckpointInfo, Manifest), NodeError> {
        self.credential_presented(bearer)?;
        let name = checkpoint_name(id)?;
        let SnapshotName::Checkpoint(hex) = &name else { unreachable!("a checkpoint name") };
        let (info, manifest) = self.read_checkpoint(hex, &name).await?;
        if self.may_act(bearer, info.tenant.as_deref(), &info.token_hash) {
            Ok((info, manifest))
        } else {
            Err(checkpoint_not_found())
        }
    }

    pub async fn delete_checkpoint(&self, id: &str) -> Result<(), NodeError> {
        let name = checkpoint_name(id)?;
        self.forget_copy(id);
        Ok(self.store.delete(&name).await?)
    }

    /// A new sandbox from a checkpoint (any checkpoint in the store).
    pub async fn branch(
        &self,
        id: &str,
        spec: ClaimSpec,
        memory: Memory,
    ) -> Result<Claimed, NodeError> {
        let name = checkpoint_name(id)?;
        let SnapshotName::Checkpoint(hex) = &name else { unreachable!("a checkpoint name") };
        let (_, manifest) = self.read_checkpoint(hex, &name).await?;
        self.branch_from(id, manifest, spec, memory).await
    }

    /// [`Self::branch`] from the checkpoint's `manifest`, just read from the store (also for a
    /// branch from the copy kept here: a checkpoint deleted anywhere in the fleet branches
    /// nowhere, and its copy here goes when that read finds it gone).
    pub async fn branch_from(
        &self,
        id: &str,
        manifest: Manifest,
        spec: ClaimSpec,
        memory: Memory,
    ) -> Result<Claimed, NodeError> {
        let t0 = std::time::Instant::now();
        let name = checkpoint_name(id)?;
        self.room_on_disk().await?;
        let admitted = {
            let mut st = self.lock();
            self.admit(&mut st, 1, spec.tenant.as_deref())?
        };
        let (engine, sid) = (self.engine.clone(), self.new_id()?);
        let (info, size, lane) = match self.branch_from_copy(id, &manifest, &sid, memory).await {
            Some(made) => made,
            None => {
                self.download_into(&name, manifest, move |input, snap| {
                    // Size and lane only: limits are this node's for them, whatever the
                    // snapshot says (it comes from the shared store).
                    let spec = BoxSpec::new(snap.spec.size, snap.spec.lane);
                    let info = engine.read_snapshot(input, snap, &sid, &spec, memory)?;
                    Ok((info, spec.size, spec.lane))
                })
                .await?
            }
        };
        let spec = ClaimSpec { size, lane, ..spec };
        let token = new_token();
        let mut record = new_record(&info, &token, &spec, Tier::Clone);
        record.from_checkpoint = Some(id.to_string());
        self.acknowledge(vec![(record.clone(), info)], admitted).await?;
        self.metrics.branched.fetch_add(1, Ordering::Relaxed);
        Ok(Claimed { record, token, took: t0.elapsed() })
    }

    /// A branch of checkpoint `id` started from the copy the engine kept here when it was
    /// taken, if one is kept for this `manifest`. Any failure leaves the branch to the store
    /// (and the copy dropped).
    async fn branch_from_copy(
        &self,
        id: &str,
        manifest: &Manifest,
        sid: &SandboxId,
        memory: Memory,
    ) -> Option<(BoxInfo, Size, Lane)> {
        let kept = self.lock_kept().touch(id)?;
        if kept.snapshot_bytes == manifest.size {
            let (engine, name, sid) = (self.engine.clone(), id.to_string(), sid.clone());
            let spec = BoxSpec::new(kept.size, kept.lane);
            match blocking(move || engine.restore_kept(&name, &sid, &spec, memory)).await {
                Ok(Some(info)) => {
                    self.metrics.branched_from_copies.fetch_add(1, Ordering::Relaxed);
                    return Some((info, kept.size, kept.lane));
                }
                Ok(None) => {}
                Err(e) => tracing::warn!(checkpoint = id, "branch from the copy kept here: {e}"),
            }
        }
        self.forget_copy(id);
        None
    }

    /// Drops the copy of checkpoint `id` kept here, if there is one.
    fn forget_copy(&self, id: &str) {
        if self.lock_kept().remove(id).is_some() {
            self.drop_copies(vec![id.to_string()]);
        }
    }

    /// Whether a copy of checkpoint `id` is kept here.
    pub fn has_copy(&self, id: &str) -> bool {
        self.lock_kept().contains(id)
    }

    /// Bytes of the checkpoints' copies kept here.
    pub(in crate::node) fn kept_bytes(&self) -> u64 {
        self.lock_kept().used()
    }

    fn lock_kept(&self) -> std::sync::MutexGuard<'_, KeptCopies> {
        self.kept.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Below the disk's reserve, drops the least recently used copies kept here until the
    /// room they free makes it up (none when all of them would not): a copy only saves a
    /// branch a trip to the store, and must not cost a claim its `507`. Waits for their files
    /// to go, since the caller checks the reserve next.
    pub(in crate::node) async fn make_room(&self) {
        if self.kept_bytes() == 0 {
            return;
        }
        let reserve = self.cfg.min_free_mib.saturating_mul(1 << 20);
        let Some(short) = crate::node::free_bytes(&self.cfg.data_dir)
            .and_then(|free| reserve.checked_sub(free))
            .filter(|short| *short > 0)
        else {
            return;
        };
        let names = self.lock_kept().take_oldest(short);
        if names.is_empty() {
            return;
        }
        tracing::info!(copies = names.len(), "checkpoint copies dropped for the disk's reserve");
        let engine = self.engine.clone();
        let _ = tokio::task::spawn_blocking(move || {
            names.iter().for_each(|name| engine.drop_kept(name));
        })
        .await;
    }

    /// Drops the engine's copies `names`, behind the call (a copy's files can take a while).
    fn drop_copies(&self, names: Vec<String>) {
        if names.is_empty() {
            return;
        }
        let engine = self.engine.clone();
        tokio::task::spawn_blocking(move || names.iter().for_each(|name| engine.drop_kept(name)));
    }

    // ---- fork ----

    /// `count` new sandboxes from the current state, all or none.
    pub async fn fork(
        &self,
        id: &str,
        count: usize,
        ttl_seconds: Option<u64>,
        memory: Memory,
    ) -> Result<Vec<Claimed>, NodeError> {
        if !(1..=MAX_FORK).contains(&count) {
            return Err(NodeError::bad_request(format!("count must be 1-{MAX_FORK}")));
        }
        let t0 = std::time::Instant::now();
        self.room_on_disk().await?;
        let _busy = self.busy(id).await;
        let live = self.current(id)?;
        let admitted = {
            let mut st = self.lock();
            self.admit(&mut st, count, live.record.tenant.as_deref())?
        };
        let made = match &live.record.phase {
            // Straight from the box: the engine copies its files where the copies want them.
            Phase::Running | Phase::Stopped => {
                before_dump(&live, memory);
                let ids = self.new_ids(count)?;
                let (engine, source) = (self.engine.clone(), live.record.id.parse::<SandboxId>()?);
                let spec = BoxSpec::new(live.record.size, live.record.lane);
                let scratch = self.scratch_tar("fork");
                blocking(move || engine.fork(&source, &ids, &spec, memory, &scratch)).await
            }
            _ => {
                let (snap, _) = self.current_files(&live, "fork", memory).await?;
                self.restore_new(&snap, count, memory).await
            }
        };
        let src = &live.record;
        let spec = ClaimSpec {
            template: src.template.clone(),
            size: src.size,
            lane: src.lane,
            ttl_seconds: ttl_seconds.unwrap_or(src.lease_seconds),
            metadata: src.metadata.clone(),
            on_expire: src.on_expire,
            tenant: src.tenant.clone(),
            egress: src.egress.clone(),
        };
        let mut claims = vec![];
        let mut out = vec![];
        for info in made? {
            let token = new_token();
            let mut record = new_record(&info, &token, &spec, Tier::Clone);
            record.forked_from = Some(id.to_string());
            record.idle_hibernate_seconds = src.idle_hibernate_seconds;
            out.push(Claimed { record: record.clone(), token, took: t0.elapsed() });
            claims.push((record, info));
        }
        self.acknowledge(claims, admitted).await?;
        self.metrics.forked.fetch_add(count as u64, Ordering::Relaxed);
        Ok(out)
    }

    /// `count` new sandboxes (fresh ids) from one snapshot, all or none.
    async fn restore_new(
        &self,
        snap: &Snapshot,
        count: usize,
        memory: Memory,
    ) -> Result<Vec<BoxInfo>, NodeError> {
        let ids = self.new_ids(count)?;
        let (engine, snap) = (self.engine.clone(), snap.clone());
        // Size and lane only: limits are this node's for them, whatever the snapshot says (a
        // downloaded one comes from the shared store).
        let spec = BoxSpec::new(snap.spec.size, snap.spec.lane);
        blocking(move || engine.restore_many(&snap, &ids, &spec, memory)).await
    }

    fn new_ids(&self, count: usize) -> Result<Vec<SandboxId>, NodeError> {
        (0..count).map(|_| self.new_id()).collect()
    }
}
