//! Templates registered at run time from registry images (`POST /v1/templates`), and refreshing
//! any registry template's pin. The records are the store's (see `images`); what this node
//! made of a template (its unpacked root, its goldens, its warm sandboxes) is dropped when the
//! template leaves or is pinned to another image.

use std::sync::Arc;

use super::*;
use crate::images::Registered;

fn conflict(message: String) -> NodeError {
    NodeError::new(Code::Conflict, message)
}

impl Node {
    /// Registers `image` as template `name` (under `<tenant>/` for a tenant) on the whole fleet:
    /// the reference is resolved and pinned now (so a missing image, a wrong platform or refused
    /// credentials answer at once), and this node starts pulling it.
    pub async fn register_template(
        self: &Arc<Self>,
        req: silk_api::RegisterTemplate,
        tenant: Option<&str>,
    ) -> Result<Registered, NodeError> {
        let name = match tenant {
            Some(t) => format!("{t}/{}", req.name),
            None => req.name.clone(),
        };
        if req.name.contains('/') || !crate::images::valid_name(&name) {
            return Err(NodeError::bad_request("a template name is 1-64 of a-z 0-9 - _"));
        }
        if req.image.trim().is_empty() || req.image.len() > 512 {
            return Err(NodeError::bad_request("image: a reference of 1-512 characters"));
        }
        self.name_is_free(&name)?;
        let digest = self.images.resolve(&req.image).await?;
        // Resolving takes a round trip to the registry: look again, and in the store (another
        // node may have registered it since this one last read it).
        self.name_is_free(&name)?;
        if self.images.stored(&name).await? {
            return Err(conflict(format!("{name:?} is a registered template; pick another name")));
        }
        let record = Registered {
            name: name.clone(),
            image: req.image,
            digest,
            warmup: req.warmup,
            created_ms: now_ms(),
        };
        self.images.put_registered(record.clone()).await?;
        self.pull_in_background(&name);
        Ok(record)
    }

    fn name_is_free(&self, name: &str) -> Result<(), NodeError> {
        let taken = if name == "host" || self.cfg.templates.contains_key(name) {
            Some("configured")
        } else if self.lock().promoted.contains_key(name) {
            Some("promoted")
        } else if self.images.registered(name).is_some() {
            Some("registered")
        } else {
            None
        };
        match taken {
            Some(kind) => {
                Err(conflict(format!("{name:?} is a {kind} template; pick another name")))
            }
            None => Ok(()),
        }
    }

    /// Pulls and unpacks `name` now, so the first claim finds it ready.
    pub(crate) fn pull_in_background(self: &Arc<Self>, name: &str) {
        let (node, name) = (self.clone(), name.to_string());
        tokio::spawn(async move {
            if let Err(e) = node.template(&name).await {
                tracing::warn!(template = name, "pulling a registry template: {e}");
            }
        });
    }

    /// Waits until template `name` is pulled and unpacked here (the pull's error, if it fails).
    pub async fn template_ready(&self, name: &str) -> Result<(), NodeError> {
        self.template(name).await.map(drop)
    }

    /// Removes registered template `name` from the fleet.
    pub async fn unregister_template(&self, name: &str) -> Result<(), NodeError> {
        self.images.remove_registered(name).await?;
        self.drop_template(name);
        Ok(())
    }

    /// Resolves `name`'s reference again. On a new digest the template is pinned to it (for the
    /// fleet, when registered), its goldens and warm sandboxes here go, and the pull starts.
    pub async fn refresh_template(self: &Arc<Self>, name: &str) -> Result<String, NodeError> {
        let Some((image, registered)) = self.image_template(name) else {
            let kind = if self.template_known(&self.lock(), name) {
                "not from a registry image"
            } else {
                "unknown"
            };
            let code = if kind == "unknown" { Code::TemplateNotFound } else { Code::Conflict };
            return Err(NodeError::new(code, format!("template {name:?} is {kind}")));
        };
        let digest = self.images.resolve(&image).await?;
        let changed = match registered {
            Some(old) => {
                let mut record = self.images.registered(name).ok_or_else(|| {
                    NodeError::new(Code::TemplateNotFound, format!("template {name:?} is unknown"))
                })?;
                record.digest = digest.clone();
                self.images.put_registered(record).await?;
                old != digest
            }
            None => {
                let old = self.images.pinned(name, &image);
                self.images.pin(name, &image, &digest);
                old.as_deref() != Some(digest.as_str())
            }
        };
        if changed {
            tracing::info!(template = name, %image, digest, "template pinned to a new image");
            self.drop_template(name);
        }
        // Pulled here whether or not it changed, so the caller that follows its pull sees it
        // end (at once, when it was pulled already).
        self.pull_in_background(name);
        Ok(digest)
    }

    /// Forgets what this node made of template `name`: its unpacked template, its goldens and
    /// its warm sandboxes (as promote does when it replaces a template).
    pub(crate) fn drop_template(&self, name: &str) {
        let mut st = self.lock();
        st.templates.remove(name);
        st.goldens.remove(name);
        st.memory_goldens.remove(name);
        self.flush_pools(&mut st, name);
        drop(st);
        self.images.forget(name);
    }

    /// Re-reads the registered templates from the store and drops those that changed.
    pub(crate) async fn refresh_registered(&self) {
        match self.images.refresh().await {
            Ok(changed) => {
                for name in changed {
                    tracing::info!(template = name, "registered template removed or re-pinned");
                    self.drop_template(&name);
                }
            }
            Err(e) => tracing::debug!("registered templates: {e}; using those in memory"),
        }
    }
}
