//! The catalog: templates (configured, built in, promoted) resolved through the engine, and
//! their goldens, built on first need or fetched from the store when a peer built them.

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

    pub(super) fn warmup(&self, name: &str, memory: bool) -> Warmup {
        let mut warmup = self
            .cfg
            .templates
            .get(name)
            .map(|t| Warmup {
                argv: t.warmup.clone(),
                timeout: Duration::from_secs(t.warmup_timeout_seconds),
                memory: false,
            })
            .unwrap_or_default();
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
        let def = self.template_def(name)?;
        let engine = self.engine.clone();
        let t = blocking(move || engine.template(&def)).await?;
        self.lock().templates.insert(name.into(), t.clone());
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
