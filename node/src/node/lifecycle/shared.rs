//! The fleet's part of the lifecycle: what crosses nodes through the shared store and the mesh.
//! Waking an archive on any node (claim records published in the store, one waker by lease),
//! moving a sandbox to a peer (the switch and its recovery when an answer is lost), and goldens
//! shared through the store instead of built on every node. And the sweep of archives nothing
//! names any more.

use super::*;
use crate::node::fleet::PeerNode;

/// Where a sandbox taken over comes from.
enum Taken {
    /// Its archive in the store (its node died).
    Archive(SnapshotName),
    /// Its node, moving it here: the files as they arrive, over what they are.
    Peer(StoredSnapshot, Box<dyn tokio::io::AsyncRead + Send + Unpin>),
}

impl Node {
    // ---- wake anywhere ----

    fn claim_key(id: &str) -> Result<silk_store::Key, NodeError> {
        silk_store::Key::new(format!("claims/{id}")).map_err(NodeError::from)
    }

    /// Puts an archived claim's record in the store (`claims/<id>`): while it is there, the
    /// sandbox is archived and any node may wake it.
    pub(super) async fn publish_archived(&self, rec: &ClaimRecord) -> Result<(), NodeError> {
        let json = serde_json::to_vec(rec).map_err(|e| NodeError::internal(e.to_string()))?;
        self.store.object_store().put_bytes(&Self::claim_key(&rec.id)?, json.into()).await?;
        Ok(())
    }

    /// Removes the published claim of `id`; whether it is gone.
    pub(in crate::node) async fn unpublish_archived(&self, id: &str) -> bool {
        let Ok(key) = Self::claim_key(id) else { return false };
        match self.store.object_store().delete(&[key]).await {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(sandbox = id, "removing the archived claim from the store: {e}");
                false
            }
        }
    }

    /// Deletes archives older than the store's grace period that no claim names, published or
    /// on this node: left by a wake, release or move whose delete failed (the store was down), or
    /// by an archive or move a crash cut short (its node kept its local copy, so nothing is lost).
    /// An archived sandbox is published before it is journalled, so no archive that can still
    /// be woken is touched. Their chunks then go at a later GC.
    pub(in crate::node) async fn sweep_orphan_archives(&self) -> Result<usize, NodeError> {
        let grace_ms = self.cfg.store.snapshots.grace_secs * 1000;
        let mut swept = 0;
        for name in self.store.list("archives/").await? {
            let SnapshotName::Archive(archive) = &name else { continue };
            let Some((id, _)) = archive.rsplit_once('.') else { continue };
            let created = match self.store.manifest(&name).await {
                Ok(m) => m.created_ms,
                Err(StoreError::NotFound { .. }) => continue,
                Err(e @ StoreError::CorruptManifest { .. }) => {
                    tracing::warn!(archive = %name, "left alone: {e}");
                    continue;
                }
                Err(e) => return Err(e.into()),
            };
            if now_ms().saturating_sub(created) < grace_ms
                || self.names_archive_here(archive)
                || self.published_archive(id).await?.as_deref() == Some(archive.as_str())
            {
                continue;
            }
            tracing::info!(archive = %name, "deleting an archive no claim names");
            self.store.delete(&name).await?;
            swept += 1;
        }
        Ok(swept)
    }

    /// Whether a claim on this node names `archive` (archived in it, archiving through it, or
    /// woken from it and not yet unpublished).
    fn names_archive_here(&self, archive: &str) -> bool {
        self.lock().slots.claims().any(|l| {
            l.record.phase.archive() == Some(archive)
                || match &l.record.intent {
                    Some(Intent::Archive(a) | Intent::Unpublish(a)) => a == archive,
                    _ => false,
                }
        })
    }

    /// The archive the claim published for `id` names (`None`: none is published). A record
    /// that cannot be read is an error, not a "no": deleting on partial knowledge loses data.
    async fn published_archive(&self, id: &str) -> Result<Option<String>, NodeError> {
        match self.store.object_store().get_bytes(&Self::claim_key(id)?).await {
            Ok(bytes) => serde_json::from_slice::<ClaimRecord>(&bytes)
                .map(|r| r.phase.archive().map(str::to_string))
                .map_err(|e| NodeError::internal(format!("the published claim of {id}: {e}"))),
            Err(StoreError::NotFound { .. }) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// Whether the store still says sandbox `id` is archived (`None`: the store cannot say).
    pub(in crate::node) async fn still_archived(&self, id: &str) -> Option<bool> {
        match self.store.object_store().head(&Self::claim_key(id).ok()?).await {
            Ok(_) => Some(true),
            Err(StoreError::NotFound { .. }) => Some(false),
            Err(_) => None,
        }
    }

    /// Wakes, on this node, an archived sandbox that no live node holds (its node died): takes
    /// its lease in the store, adopts it from its archive, and removes its claim record there.
    /// `Ok(false)`: no such archived sandbox (or not for this token).
    pub async fn wake_orphan(&self, id: &str, token: Option<&str>) -> Result<bool, NodeError> {
        let key = Self::claim_key(id)?;
        let bytes = match self.store.object_store().get_bytes(&key).await {
            Ok(b) => b,
            Err(StoreError::NotFound { .. }) => return Ok(false),
            Err(e) => return Err(e.into()),
        };
        let mut rec: ClaimRecord = serde_json::from_slice(&bytes)
            .map_err(|e| NodeError::internal(format!("{key}: {e}")))?;
        // Any node can write to the store: the record must be this sandbox's, archived through
        // an archive of its own, before its token hash means anything (see `check_foreign`).
        let Phase::Archived(archive) = rec.phase.clone() else {
            return Err(NodeError::internal(format!(
                "{key}: a published claim that is not archived"
            )));
        };
        let (default_ttl, max_ttl) = (self.cfg.default_ttl_seconds, self.cfg.max_ttl_seconds);
        rec.check_foreign(id, &archive, default_ttl, max_ttl, now_ms())
            .map_err(|e| NodeError::internal(format!("{key}: {}", e.message)))?;
        if !self.may_act(token, rec.tenant.as_deref(), &rec.token_hash) {
            return Ok(false);
        }
        let woken = async {
            // Another node may have finished just before we took the lease.
            if self.still_archived(id).await != Some(true) {
                return Err(waking_elsewhere(id));
            }
            self.adopt(rec, &archive).await?;
            let _busy = self.busy(id).await;
            self.finish_unpublish(id, &archive).await?;
            Ok(true)
        };
        self.under_wake_lease(id, woken).await
    }

    /// Runs `wake` holding sandbox `id`'s wake lease in the store, so that of all the nodes
    /// trying to wake one archive at once exactly one does.
    pub(super) async fn under_wake_lease<T>(
        &self,
        id: &str,
        wake: impl std::future::Future<Output = Result<T, NodeError>>,
    ) -> Result<T, NodeError> {
        let objects = self.store.object_store().clone();
        let lease =
            silk_store::Lease::acquire(&*objects, &format!("leases/{id}"), &self.name, WAKE_LEASE)
                .await?
                .ok_or_else(|| waking_elsewhere(id))?;
        let woken = wake.await;
        // Woken, but the store has not forgotten the archive yet (it failed, or the journal
        // did): the lease stays until a restart finishes the wake, so "none of our keys left"
        // can only mean that another node took the lease (`interrupted_wake`).
        let unpublishing =
            self.get(id).is_some_and(|l| matches!(l.record.intent, Some(Intent::Unpublish(_))));
        if unpublishing {
            tracing::warn!(sandbox = id, "the wake is not finished: its lease is kept");
        } else if let Err(e) = lease.release(&*objects).await {
            tracing::warn!(sandbox = id, "releasing the wake lease: {e} (it expires by itself)");
        }
        woken
    }

    // ---- move ----

    /// Moves a sandbox to another node (`to`, or the least loaded live peer): hibernate here,
    /// stream its files to the target, which starts it as they arrive and journals it (the
    /// switch), then this node forgets it. No store between them: one pass over the bytes. The
    /// id and token stay; any node finds the new owner. A failure before the switch leaves the
    /// sandbox here (running again if it was).
    pub async fn move_sandbox(
        self: &std::sync::Arc<Self>,
        id: &str,
        to: Option<&str>,
        memory: Memory,
    ) -> Result<(ClaimRecord, PeerNode), NodeError> {
        let fleet = self.fleet().ok_or_else(|| {
            conflict("this node is not in a mesh: there is nowhere to move to".into())
        })?;
        let _busy = self.busy(id).await;
        let live = self.current(id)?;
        let target = fleet.move_target(to)?;
        let was_running = match live.record.phase {
            Phase::Running => true,
            Phase::Stopped | Phase::Captured(_) => false,
            Phase::Archived(_) => {
                return Err(conflict("a sandbox that is Archived must be woken first".into()));
            }
        };
        let (mut rec, files) = self.stop_here(live, memory).await?;
        let name = new_archive_name(id);
        rec.intent = Some(Intent::Move { name: name.clone(), target: target.name.clone() });
        self.put_record(&rec).await?;
        self.crash_point("move:intent").await;
        let mut theirs = rec.clone();
        // The target starts it from the bytes: this node's paths are no business of its.
        (theirs.intent, theirs.phase) = (None, Phase::Stopped);
        let handed = async {
            let (stored, bytes) = self.files_stream(&files, &rec, memory).await?;
            let stored =
                serde_json::to_string(&stored).map_err(|e| NodeError::internal(e.to_string()))?;
            fleet.hand_over(&target.name, &theirs, &name, &stored, bytes).await
        }
        .await;
        if let Err(e) = handed.as_ref().map_err(|e| e.code)
            && e == "peer_unavailable"
        {
            // The target may or may not have taken it (the answer was lost): settle by asking
            // it, and keep the sandbox here, stopped, until it answers.
            tokio::spawn(self.clone().settle_move(id.to_string(), was_running));
            return Err(NodeError::new(
                Code::Moving,
                format!(
                    "{}: the target did not answer; the move settles once it does",
                    target.name
                ),
            ));
        }
        if let Err(e) = handed {
            // Refused, or failed before the target was asked: it stays here, as it was.
            self.undo_stop(rec, None, was_running, "move").await?;
            return Err(e);
        }
        self.crash_point("move:switched").await;
        self.forget_moved(id, &files).await?;
        fleet.moved(id, &target.name);
        self.metrics.moved.fetch_add(1, Ordering::Relaxed);
        let mut moved = rec;
        moved.intent = None;
        moved.phase = Phase::Running;
        Ok((moved, target))
    }

    /// A stopped sandbox's files as a stream for a peer (see `Fleet::hand_over`), and what they
    /// are over: its tar as it is, or the engine's capture of its box, written on a blocking
    /// thread into a pipe (the box is stopped: the capture may wait on the peer).
    async fn files_stream(
        self: &std::sync::Arc<Self>,
        files: &Files,
        source: &ClaimRecord,
        memory: Memory,
    ) -> Result<(StoredSnapshot, crate::node::fleet::SnapshotBytes), NodeError> {
        let base = match files {
            Files::Tar(snap) => {
                let tar = tokio::fs::File::open(&snap.layer_tar).await.map_err(|e| {
                    NodeError::internal(format!("open {}: {e}", snap.layer_tar.display()))
                })?;
                return Ok((StoredSnapshot::of(snap), Box::pin(tar)));
            }
            Files::Box(base) => base,
        };
        let (engine, sid) = (self.engine.clone(), source.id.parse::<SandboxId>()?);
        let scratch = self.scratch_tar("move");
        let write = move |out: &mut dyn silk_engine::SnapshotSink| {
            engine.write_snapshot(&sid, memory, out, &scratch, None)
        };
        let bytes = self.capture_stream(write)?;
        #[cfg(feature = "crash-points")]
        let bytes = self.crash_point_within("move:streaming", bytes);
        Ok((StoredSnapshot::over(base, &box_spec(source)), bytes))
    }

    /// After the switch: the sandbox lives on the target; this node drops its copy.
    async fn forget_moved(&self, id: &str, files: &Files) -> Result<(), NodeError> {
        self.journal.commit(vec![Change::Delete(id.to_string())]).await.map_err(journal_error)?;
        if let Some(live) = self.lock().slots.remove_claim(id) {
            live.activity.hang_up();
        }
        self.drop_files(id, files).await;
        Ok(())
    }

    /// Starts, under the same id and token, a sandbox whose node died, from its archive (a wake
    /// elsewhere), and journals it. Idempotent. The record comes from the store: it is checked
    /// (and its lease bounded) as any foreign record, and the archive must have been made for it.
    pub async fn adopt(&self, record: ClaimRecord, archive: &str) -> Result<(), NodeError> {
        let name = SnapshotName::archive(archive).map_err(NodeError::from)?;
        self.take_over(record, archive, Taken::Archive(name)).await
    }

    /// The target's side of a move: starts the sandbox under the same id and token from
    /// `files`, the bytes its node streams as they arrive (`snapshot`: what they are over, a
    /// `StoredSnapshot` as JSON), and journals it (the switch). Idempotent. The record and the
    /// bytes come from a peer: the record is checked (and its lease bounded) as any foreign
    /// record, and the bytes are unpacked as a download's are.
    pub async fn receive(
        &self,
        record: ClaimRecord,
        name: &str,
        snapshot: &str,
        files: impl tokio::io::AsyncRead + Send + Unpin + 'static,
    ) -> Result<(), NodeError> {
        let stored = StoredSnapshot::parse(snapshot)
            .map_err(|e| NodeError::bad_request(format!("receive: snapshot: {e}")))?;
        self.take_over(record, name, Taken::Peer(stored, Box::new(files))).await
    }

    async fn take_over(
        &self,
        mut record: ClaimRecord,
        archive: &str,
        from: Taken,
    ) -> Result<(), NodeError> {
        let id = record.id.clone();
        let (default_ttl, max_ttl) = (self.cfg.default_ttl_seconds, self.cfg.max_ttl_seconds);
        record
            .check_foreign(&id, archive, default_ttl, max_ttl, now_ms())
            .map_err(|e| NodeError::bad_request(format!("adopt: {}", e.message)))?;
        let _busy = self.busy(&record.id).await;
        if self.get(&record.id).is_some() {
            return Ok(());
        }
        let admitted = {
            let mut st = self.lock();
            // A move: the tenant's sandbox counts here instead of at the source, not twice.
            let admitted = self.admit(&mut st, 1, None)?;
            st.slots.set_adopting(&record.id, true);
            admitted
        };
        let result = async move {
            let (engine, sid, spec) =
                (self.engine.clone(), record.id.parse::<SandboxId>()?, box_spec(&record));
            let restore = move |input: &mut dyn std::io::Read, snap: &Snapshot| {
                engine.read_snapshot(input, snap, &sid, &spec, Memory::Auto)
            };
            let info = match from {
                Taken::Archive(name) => {
                    // The archive must have been made, by the node that held the sandbox, for
                    // this very record: a member handing over someone's archive with its own
                    // token (or in another tenant's name) gets nothing.
                    let manifest = self.store.manifest(&name).await?;
                    let made_for = &manifest.meta;
                    let said = |k: &str| made_for.get(k).map(String::as_str);
                    if said("sandbox") != Some(record.id.as_str())
                        || said("token_hash") != Some(record.token_hash.as_str())
                        || said("tenant") != record.tenant.as_deref()
                    {
                        return Err(NodeError::bad_request(format!(
                            "adopt: archive {archive} was not made for this claim of {}",
                            record.id
                        )));
                    }
                    self.download_into(&name, manifest, restore).await?
                }
                // A peer can hand over only bytes it has: the sandbox it held.
                Taken::Peer(stored, files) => {
                    self.restore_arriving(&stored, Arriving::Peer(files), restore).await?
                }
            };
            self.crash_point("adopt:restored").await;
            let from_archive = matches!(record.phase, Phase::Archived(_));
            if from_archive {
                // Woken from its archive: a fresh lease of its original length.
                record.deadline_ms = lease_end(now_ms(), record.lease_seconds);
            }
            // Woken from its archive: the store forgets it next (`finish_unpublish`), or at the
            // next start if this node dies first.
            let unpublish = from_archive.then(|| Intent::Unpublish(archive.to_string()));
            (record.phase, record.intent) = (Phase::Running, unpublish);
            record.state_since_ms = now_ms();
            self.acknowledge(vec![(record, info)], admitted).await
        }
        .await;
        self.lock().slots.set_adopting(&id, false);
        result
    }

    /// Whether a sandbox is being adopted here right now (started, not yet journalled).
    pub fn is_adopting(&self, id: &str) -> bool {
        self.lock().slots.adopting(id)
    }

    /// Settles moves a crash (or a lost answer) interrupted on this node: the target is
    /// asked until it answers for certain — it holds the sandbox (this node forgets its copy) or
    /// it does not (the copy here stays, hibernated: its next call wakes it). Until then calls
    /// answer 503 `moving`: better unavailable for a while than running twice.
    pub async fn settle_moves(self: std::sync::Arc<Self>) {
        let pending: Vec<String> = self
            .lock()
            .slots
            .claims()
            .filter(|l| matches!(l.record.intent, Some(Intent::Move { .. })))
            .map(|l| l.record.id.clone())
            .collect();
        for id in pending {
            tokio::spawn(self.clone().settle_move(id, false));
        }
    }

    /// Settles one move whose answer was lost. If the target does not hold the sandbox, it is
    /// as it was before the move: running again here when `was_running` (known only to the
    /// process that began the move).
    pub(in crate::node) async fn settle_move(
        self: std::sync::Arc<Self>,
        id: String,
        was_running: bool,
    ) {
        let Some(fleet) = self.fleet() else { return };
        let mut pause = std::time::Duration::from_millis(100);
        loop {
            let Some(Intent::Move { name, target }) = self.get(&id).and_then(|l| l.record.intent)
            else {
                return;
            };
            let held = fleet.holds(&target, &id).await;
            if let Some(held) = held {
                let _busy = self.busy(&id).await;
                // Re-read under the lock: the record is what we act on.
                let Some(live) = self.get(&id) else { return };
                if !matches!(&live.record.intent, Some(Intent::Move { name: n, .. }) if *n == name)
                {
                    return;
                }
                let settled = if held {
                    fleet.moved(&id, &target);
                    match Files::of(&live) {
                        Some(files) => self.forget_moved(&id, &files).await,
                        None => Ok(()),
                    }
                } else {
                    self.undo_stop(live.record.clone(), None, was_running, "move").await
                };
                match settled {
                    Ok(()) => {
                        tracing::info!(sandbox = id, moved = held, "interrupted move settled")
                    }
                    Err(e) => tracing::warn!(sandbox = id, "settling an interrupted move: {e}"),
                }
                return;
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(std::time::Duration::from_secs(5));
        }
    }

    // ---- shared goldens and bases ----

    /// A golden a peer built, from the store (`goldens/<template>/<digest>`), or `None` when no
    /// node has shared it.
    pub(in crate::node) async fn fetch_golden(
        &self,
        template: &silk_engine::Template,
        digest: &silk_engine::Digest,
    ) -> Result<Option<Golden>, NodeError> {
        let name =
            SnapshotName::golden(&template.name, digest.as_str()).map_err(NodeError::from)?;
        let path = self.scratch_tar("golden");
        let got = async {
            let mut file = tokio::fs::File::create(&path)
                .await
                .map_err(|e| NodeError::internal(format!("create {}: {e}", path.display())))?;
            match self.store.get(&name, &mut file).await {
                Ok(_) => {}
                Err(StoreError::NotFound { .. }) => return Ok(None),
                Err(e) => return Err(e.into()),
            }
            let (engine, t, d, p) =
                (self.engine.clone(), template.clone(), digest.clone(), path.clone());
            let g = blocking(move || engine.import_golden(&t, &d, &p)).await?;
            self.metrics.golden_downloads.fetch_add(1, Ordering::Relaxed);
            tracing::info!(golden = %name, "golden fetched from the store");
            Ok(Some(g))
        }
        .await;
        let _ = std::fs::remove_file(&path);
        got
    }

    /// Uploads a golden built here for other nodes, in the background.
    pub(in crate::node) fn share_golden(&self, golden: Golden) {
        let Ok(name) = SnapshotName::golden(&golden.template.name, golden.digest.as_str()) else {
            return;
        };
        let (engine, store, path) =
            (self.engine.clone(), self.store.clone(), self.scratch_tar("golden-up"));
        tokio::spawn(async move {
            let p = path.clone();
            let g = golden.clone();
            let exported = tokio::task::spawn_blocking(move || engine.export_golden(&g, &p)).await;
            let shared = match exported {
                Ok(Ok(())) => match tokio::fs::File::open(&path).await {
                    Ok(file) => {
                        let meta = BTreeMap::from([
                            ("template".to_string(), golden.template.name.clone()),
                            ("template_digest".to_string(), golden.template.digest.to_string()),
                        ]);
                        store
                            .put(&name, tokio::io::BufReader::with_capacity(1 << 20, file), meta)
                            .await
                            .map(|_| ())
                            .map_err(|e| e.to_string())
                    }
                    Err(e) => Err(e.to_string()),
                },
                Ok(Err(e)) => Err(e.to_string()),
                Err(e) => Err(e.to_string()),
            };
            let _ = std::fs::remove_file(&path);
            match shared {
                Ok(()) => tracing::info!(golden = %name, "golden shared through the store"),
                Err(e) => tracing::warn!(golden = %name, "sharing the golden failed: {e}"),
            }
        });
    }

    /// A snapshot's base (made on any node) in this node's terms: its template resolved here by
    /// name (same digest, or the snapshot cannot start here) and its golden found here or
    /// fetched from the store, by digest.
    pub(super) async fn local_base(&self, stored: &StoredSnapshot) -> Result<Base, NodeError> {
        let mismatch = |m: String| NodeError::new(Code::BaseUnavailable, m);
        let name = &stored.template;
        let template = self
            .template(name)
            .await
            .map_err(|e| mismatch(format!("template {name:?} of the snapshot: {}", e.message)))?;
        if template.digest != stored.template_digest {
            return Err(mismatch(format!(
                "template {name:?} differs on this node from the snapshot's"
            )));
        }
        let golden = match &stored.golden {
            None => None,
            Some(digest) => match self.engine.find_golden(digest) {
                Some(local) => Some(local),
                None => Some(self.fetch_golden(&template, digest).await?.ok_or_else(|| {
                    mismatch(format!("golden {} is neither here nor in the store", digest.short()))
                })?),
            },
        };
        Ok(Base { template, golden })
    }
}
