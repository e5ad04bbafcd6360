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
                // Woken from `archive`, the node died before the store forgot it.
                changed = true;
                if self.unpublish_archived(&rec.id).await {
                    self.drop_archive(&archive).await;
                } else {
                    rec.intent = Some(Intent::Unpublish(archive)); // the next start tries again
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
}
