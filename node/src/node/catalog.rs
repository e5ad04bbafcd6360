//! The catalog: templates (configured, built in, promoted, registered) resolved through the
//! engine, and their goldens, built on first need or fetched from the store when a peer built
//! them. A template from a registry image is pulled first (see `images`).

use super::*;

impl Node {
    pub(super) fn template_def(&self, name: &str) -> Result<TemplateDef, NodeError> {
        if name == "host" {
            return Ok(TemplateDef::host());
        }
        if let Some(p) = self.lock().promoted.get(name) {
            return Ok(TemplateDef {
                name: name.into(),
                source: TemplateSource::Dir(p.golden.template.root.clone()),
            });
        }
        let t = self.cfg.templates.get(name).ok_or_else(|| {
            NodeError::new(Code::TemplateNotFound, format!("no template {name:?}"))
        })?;
        let source = match (&t.dir, &t.image) {
            (Some(dir), _) => TemplateSource::Dir(dir.clone()),
            (None, Some(image)) => TemplateSource::Image(image.clone()),
            (None, None) => return Err(NodeError::internal("template without a source")),
        };
        Ok(TemplateDef { name: name.into(), source })
    }

    /// A template made from a registry image: its reference, and the digest it is pinned to
    /// fleet-wide (registered) or `None` (configured: pinned per node on first use).
    pub(super) fn image_template(&self, name: &str) -> Option<(String, Option<String>)> {
        if let Some(t) = self.cfg.templates.get(name) {
            return t.reference.clone().map(|image| (image, None));
        }
        self.images.registered(name).map(|r| (r.image, Some(r.digest)))
    }

    /// The digest `name`'s image is pinned to here, resolving the reference on first use.
    pub(super) async fn pinned_digest(
        &self,
        name: &str,
        image: &str,
        registered: Option<String>,
    ) -> Result<String, NodeError> {
        if let Some(digest) = registered.or_else(|| self.images.pinned(name, image)) {
            return Ok(digest);
        }
        let digest = self.images.resolve(image).await?;
        self.images.pin(name, image, &digest);
        Ok(digest)
    }

    pub(super) fn warmup(&self, name: &str, memory: bool) -> Warmup {
        let mut warmup = match (self.cfg.templates.get(name), self.images.registered(name)) {
            (Some(t), _) => Warmup {
                argv: t.warmup.clone(),
                timeout: Duration::from_secs(t.warmup_timeout_seconds),
                memory: false,
            },
            (None, Some(r)) => Warmup {
                argv: r.warmup,
                timeout: Duration::from_secs(crate::config::default_warmup_timeout()),
                memory: false,
            },
            (None, None) => Warmup::default(),
        };
        warmup.memory = memory;
        warmup
    }

    pub(super) async fn template(&self, name: &str) -> Result<Template, NodeError> {
        if let Some(t) = self.lock().templates.get(name) {
            return Ok(t.clone());
        }
        if let Some(p) = self.lock().promoted.get(name) {
            return Ok(p.golden.template.clone());
        }
        let Some((image, registered)) = self.image_template(name) else {
            let def = self.template_def(name)?;
            let engine = self.engine.clone();
            let t = blocking(move || engine.template(&def)).await?;
            self.lock().templates.insert(name.into(), t.clone());
            return Ok(t);
        };
        let digest = self.pinned_digest(name, &image, registered).await?;
        let engine = self.engine.clone();
        let unpack = |pulled, held| async move {
            let def = TemplateDef { name: name.into(), source: TemplateSource::Pulled(pulled) };
            // The blobs stay held while the import reads them, even if this call is dropped.
            let made = tokio::task::spawn_blocking(move || {
                let _held: Vec<silk_registry::Held> = held;
                engine.template(&def)
            })
            .await
            .map_err(|e| NodeError::internal(format!("engine task failed: {e}")))?;
            made.map_err(|e| match e {
                EngineError::Unsafe(m) => NodeError::new(Code::ImageUnsafe, m),
                other => NodeError::from(other),
            })
        };
        let t = self.images.pull(name, &image, &digest, unpack).await?;
        // Unless the template was refreshed or removed meanwhile.
        if self.image_template(name).is_some_and(|(i, r)| {
            i == image && r.or_else(|| self.images.pinned(name, &i)).as_ref() == Some(&digest)
        }) {
            self.lock().templates.insert(name.into(), t.clone());
        }
        Ok(t)
    }

    /// The template's golden, or (`memory`) its memory golden, built on first need. A
    /// promoted template's golden is the promoted sandbox's files: it has no memory golden.
    pub(super) async fn golden_of(&self, name: &str, memory: bool) -> Result<Golden, NodeError> {
        let memory = memory && !self.lock().promoted.contains_key(name);
        let held = |st: &State| {
            if memory { st.memory_goldens.get(name) } else { st.goldens.get(name) }.cloned()
        };
        if let Some(g) = held(&self.lock()) {
            return Ok(g);
        }
        let template = self.template(name).await?;
        let _one_at_a_time = self.golden_lock.lock().await;
        if let Some(g) = held(&self.lock()) {
            return Ok(g);
        }
        let warmup = self.warmup(name, memory);
        let digest = self.engine.golden_digest(&template, &warmup);
        // Held here already, or built by a peer and shared through the store: no warmup runs.
        let g = match self.engine.find_golden(&digest) {
            Some(g) => g,
            None => match self.fetch_golden(&template, &digest).await {
                Ok(Some(g)) => g,
                fetched => {
                    if let Err(e) = fetched {
                        tracing::warn!(template = name, "golden from the store: {e}; building it");
                    }
                    let engine = self.engine.clone();
                    let g = blocking(move || engine.prepare(&template, &warmup)).await?;
                    self.metrics.golden_builds.fetch_add(1, Ordering::Relaxed);
                    self.share_golden(g.clone());
                    g
                }
            },
        };
        let mut st = self.lock();
        if memory { &mut st.memory_goldens } else { &mut st.goldens }
            .insert(name.into(), g.clone());
        Ok(g)
    }
}
