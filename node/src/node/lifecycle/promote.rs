//! Promote: a sandbox's files published as a template of this node (its clones start from
//! them), and the promoted templates' record. Apart from the checkpoints' copies (`copies.rs`)
//! they sat beside.

use super::*;

impl Node {
    /// Publishes the sandbox's files as template `name`; later claims of it clone from them.
    /// A tenant's sandbox promotes into its tenant's names (`<tenant>/<name>`) unless root asks;
    /// returns the template's full name.
    pub async fn promote(
        &self,
        id: &str,
        name: &str,
        by_root: bool,
    ) -> Result<(String, Promoted), NodeError> {
        let valid = (1..=64).contains(&name.len())
            && name
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_');
        if !valid {
            return Err(NodeError::bad_request("a template name is 1-64 of a-z 0-9 - _"));
        }
        if name == "host" || self.cfg.templates.contains_key(name) {
            return Err(conflict(format!(
                "{name:?} is a configured template; promote under another name"
            )));
        }
        let _busy = self.busy(id).await;
        let live = self.current(id)?;
        let full = match (&live.record.tenant, by_root) {
            (Some(t), false) => format!("{t}/{name}"),
            _ => name.to_string(),
        };
        let name = full.as_str();
        if self.images.registered(name).is_some() {
            return Err(conflict(format!(
                "{name:?} is a registered template; promote under another name"
            )));
        }
        let owner = (!by_root).then(|| live.record.token_hash.clone());
        // A tenant's template is its tenant's to replace: any of its sandboxes or its key.
        let tenant_owned = full.contains('/');
        let may_replace = |st: &State| match st.promoted.get(name) {
            Some(p) => by_root || tenant_owned || p.owner.is_some() && p.owner == owner,
            None => true,
        };
        if !may_replace(&self.lock()) {
            return Err(conflict(format!("template {name:?} was promoted by another owner")));
        }
        // A template is files: its clones start fresh.
        let (snap, scratch) = self.current_files(&live, "promote", Memory::Off).await?;
        let engine = self.engine.clone();
        let s = snap.clone();
        let made = blocking(move || engine.golden_from_snapshot(&s)).await;
        if scratch {
            let _ = std::fs::remove_file(&snap.layer_tar);
        }
        let promoted = Promoted {
            golden: made?,
            source: id.to_string(),
            created_ms: now_ms(),
            owner: owner.clone(),
        };
        // Other nodes can then start this template's checkpoints, archives and moves.
        self.share_golden(promoted.golden.clone());
        // Read, change and save the map under the state lock: concurrent promotes and deletes
        // of other templates must not lose each other's entries (the file is small).
        let mut st = self.lock();
        if !may_replace(&st) {
            return Err(conflict(format!("template {name:?} was promoted by another owner")));
        }
        let mut all = st.promoted.clone();
        all.insert(name.to_string(), promoted.clone());
        self.save_promoted(&all)?;
        st.promoted = all;
        st.goldens.insert(name.to_string(), promoted.golden.clone());
        st.memory_goldens.remove(name);
        st.templates.remove(name);
        self.flush_pools(&mut st, name);
        drop(st);
        self.refill.notify_one();
        self.metrics.promoted.fetch_add(1, Ordering::Relaxed);
        Ok((full, promoted))
    }

    pub fn promoted(&self) -> BTreeMap<String, Promoted> {
        self.lock().promoted.clone()
    }

    /// Deletes a promoted template. Sandboxes made from it keep running.
    pub fn delete_template(&self, name: &str) -> Result<(), NodeError> {
        let mut st = self.lock();
        let mut all = st.promoted.clone();
        if all.remove(name).is_none() {
            if name == "host" || self.cfg.templates.contains_key(name) {
                return Err(conflict(format!(
                    "{name:?} is configured; remove it from the config file"
                )));
            }
            return Err(NodeError::new(
                Code::TemplateNotFound,
                format!("no promoted template {name:?}"),
            ));
        }
        self.save_promoted(&all)?;
        st.promoted = all;
        st.goldens.remove(name);
        st.memory_goldens.remove(name);
        self.flush_pools(&mut st, name);
        Ok(())
    }

    fn save_promoted(&self, all: &BTreeMap<String, Promoted>) -> Result<(), NodeError> {
        let json =
            serde_json::to_vec_pretty(all).map_err(|e| NodeError::internal(e.to_string()))?;
        crate::durable::replace(&promoted_path(&self.cfg), &json)
            .map_err(|e| NodeError::internal(format!("persist promoted templates: {e}")))
    }

    /// Warm sandboxes of `template` were made from its old golden: they go, and so do those
    /// being started now.
    pub(in crate::node) fn flush_pools(&self, st: &mut State, template: &str) {
        for pool in st.pools.values_mut().filter(|p| p.key.template == template) {
            for ready in pool.flush() {
                self.teardown(ready.info.id);
            }
        }
    }
}
