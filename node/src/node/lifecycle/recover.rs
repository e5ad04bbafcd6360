//! Recovery at start: each journalled claim brought back, an interrupted operation finished or
//! rolled back (see the module docs of `lifecycle`).

use super::*;

impl Node {
    /// Brings one journalled claim back after a restart: finishes or rolls back an interrupted
    /// operation (see the module docs). `found`: its box, running or not. `None`: the sandbox is
    /// gone. The flag says whether the record changed.
    pub(in crate::node) async fn recover(
        &self,
        mut rec: ClaimRecord,
        found: Option<&BoxInfo>,
    ) -> Option<(Live, bool)> {
        let mut changed = false;
        match rec.intent.take() {
            Some(Intent::Hibernate(snap)) => {
                changed = true;
                if snap.layer_tar.is_file() {
                    // The capture completed: hibernated (the box, if any, goes in reconcile).
                    let bytes = std::fs::metadata(&snap.layer_tar).map(|m| m.len()).unwrap_or(0);
                    rec.phase = Phase::Captured(Box::new(Snapshot { bytes, ..*snap }));
                    rec.state_since_ms = now_ms();
                }
            }
            Some(Intent::Unpublish(archive)) => {
                // Woken from `archive`, the node died before the store forgot it. If it stayed
                // down past its wake lease, another node may have woken the same archive: then
                // that copy is the sandbox, and this one goes.
                changed = true;
                match self.interrupted_wake(&rec.id).await {
                    Some(true) => self.drop_archive(&archive).await,
                    Some(false) => {
                        tracing::warn!(
                            sandbox = rec.id,
                            "woken by another node while this one was down: its copy is kept, this one removed"
                        );
                        return None;
                    }
                    // The store cannot say: the next start asks again.
                    None => rec.intent = Some(Intent::Unpublish(archive)),
                }
            }
            Some(intent @ Intent::Move { .. }) => {
                // Settled once the mesh is up (`settle_moves`): until then it stays hibernated.
                rec.intent = Some(intent);
            }
            Some(Intent::Archive(archive)) => {
                changed = true;
                let archived = match SnapshotName::archive(&archive) {
                    Ok(name) => self.store.manifest(&name).await.is_ok(),
                    Err(_) => false,
                };
                if archived {
                    // Complete it: publish the claim (as archive does before journalling), then
                    // drop the local copy. If the store refuses, it stays hibernated.
                    let mut done = rec.clone();
                    done.phase = Phase::Archived(archive);
                    done.state_since_ms = now_ms();
                    if self.publish_archived(&done).await.is_ok() {
                        if let Some(s) = rec.phase.snapshot() {
                            let _ = std::fs::remove_file(&s.layer_tar);
                        }
                        rec = done;
                    }
                }
            }
            None => {}
        }
        if rec.phase == Phase::Stopped && found.is_some_and(|b| b.running) {
            // A wake resumed its box and the node died before journalling it: it is awake.
            rec.phase = Phase::Running;
            rec.state_since_ms = now_ms();
            changed = true;
        }
        let base = match &rec.phase {
            // Its box stays even if it stopped (a host reboot): the next access restarts it
            // from its files (`agent_stream`).
            Phase::Running => Some(found?.base.clone()),
            Phase::Captured(snap) if snap.layer_tar.is_file() => Some(snap.base.clone()),
            Phase::Captured(_) => {
                tracing::error!(sandbox = rec.id, "hibernated, but its snapshot is missing");
                return None;
            }
            Phase::Stopped => match found {
                Some(b) => Some(b.base.clone()),
                None => {
                    tracing::error!(sandbox = rec.id, "hibernated, but its box is missing");
                    return None;
                }
            },
            Phase::Archived(_) => None,
        };
        // Not running here: nowhere yet (a wake tells where).
        let agent =
            found.map_or(silk_engine::AgentAddr::Unix(Default::default()), |b| b.agent.clone());
        let address = found.and_then(|b| b.address);
        let activity = crate::node::Activity::new();
        Some((Live { record: rec, agent, base, address, activity }, changed))
    }

    /// Finishes a wake from an archive that a crash interrupted (the record journalled running,
    /// the store not yet told): `Some(true)` when the sandbox is this node's (the store's
    /// published claim is now gone), `Some(false)` when another node woke the archive while
    /// this one was down, `None` when the store cannot say.
    ///
    /// The wake lease tells: this node's key under `leases/<id>/` stays until someone takes the
    /// lease, and a node can wake the archive only by taking it, which removes a dead holder's
    /// key. So with our key still there nobody else woke it; without it, someone took the
    /// lease after ours ran out — and woke it, unless the claim is still published and the
    /// lease free again (that wake failed): then it is ours to finish.
    async fn interrupted_wake(&self, id: &str) -> Option<bool> {
        let objects = self.store.object_store().clone();
        let name = format!("leases/{id}");
        let mut ours = vec![];
        for o in objects.list_all(&format!("{name}/")).await.ok()? {
            if objects.get_bytes(&o.key).await.ok()?.as_ref() == self.name.as_bytes() {
                ours.push(o.key);
            }
        }
        match (ours.is_empty(), self.still_archived(id).await?) {
            // This node unpublished it before the crash.
            (false, false) => {
                let _ = objects.delete(&ours).await;
                return Some(true);
            }
            (true, false) => return Some(false),
            (_, true) => {}
        }
        // Still published: finish it under a lease of our own (our old key would count as a
        // live holder), unless another node is waking it right now.
        let _ = objects.delete(&ours).await;
        let lease =
            silk_store::Lease::acquire(&*objects, &name, &self.name, WAKE_LEASE).await.ok()?;
        let Some(lease) = lease else { return Some(false) };
        // Unpublished meanwhile: a wake elsewhere finished before we took the lease.
        let mine = match self.still_archived(id).await {
            Some(true) => self.unpublish_archived(id).await.then_some(true),
            other => other,
        };
        let _ = lease.release(&*objects).await;
        mine
    }
}
