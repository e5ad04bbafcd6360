//! Templates made from registry images: those configured with `ref = "<image>"`, and those
//! registered at run time (`POST /v1/templates`).
//!
//! - **Registered** templates live in the shared store (`templates/<name>`, JSON), so every
//!   node knows them; each node keeps them in memory (and in `<data_dir>/registered.json`, for
//!   a start while the store is down) and re-reads the store with the tenants, every
//!   `tenant_refresh_ms`. A record carries the image reference and the digest it was pinned to
//!   when registered (or refreshed): every node pulls that same image.
//! - **Configured** templates pin their reference on first use, per node
//!   (`<data_dir>/pins.json`), until a refresh.
//! - **Pulls** run one at a time per template name; what each node has pulled, or is pulling,
//!   or failed to pull (and why) is this node's own, in memory.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, RwLock};

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use silk_api::{ErrorDetail, PullStatus};
use silk_engine::{PulledImage, Template};
use silk_registry::{Digest, Held, LayerCache, Progress, Puller, RegistryError};
use silk_store::{Key, ObjectStore, StoreError};

use crate::config::Config;
use crate::error::{Code, NodeError};

const PREFIX: &str = "templates/";

/// A template registered at run time, as the store keeps it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Registered {
    /// `<name>`, or `<tenant>/<name>` for a tenant's.
    pub name: String,
    /// The reference as the user gave it.
    pub image: String,
    /// The image manifest digest it is pinned to.
    pub digest: String,
    #[serde(default)]
    pub warmup: Vec<String>,
    pub created_ms: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Pin {
    image: String,
    digest: String,
}

#[derive(Debug, Clone)]
enum Pull {
    Running {
        digest: String,
        progress: Arc<Progress>,
    },
    /// Pulled and unpacked.
    Ready {
        digest: String,
        total: u64,
        template: Template,
    },
    /// `attempt` tells a caller that waited for this pull from a later one.
    Failed {
        digest: String,
        error: NodeError,
        attempt: u64,
    },
}

/// Where a template's pull stands on this node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PullView {
    pub status: PullStatus,
    pub done: Option<u64>,
    pub total: Option<u64>,
    pub error: Option<ErrorDetail>,
}

#[derive(Debug)]
pub struct Images {
    puller: Puller,
    store: Arc<dyn ObjectStore>,
    registered_file: PathBuf,
    pins_file: PathBuf,
    registered: RwLock<BTreeMap<String, Registered>>,
    pins: Mutex<BTreeMap<String, Pin>>,
    pulls: Mutex<HashMap<String, Pull>>,
    /// One pull at a time per template name.
    locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    max_unpacked: u64,
    min_free: u64,
    attempts: std::sync::atomic::AtomicU64,
}

/// A template name: 1-64 of `a-z 0-9 - _`, after a `<tenant>/` prefix for a tenant's.
pub fn valid_name(name: &str) -> bool {
    let bare = match name.split_once('/') {
        Some((tenant, bare)) if silk_api::valid_tenant_name(tenant) => bare,
        Some(_) => return false,
        None => name,
    };
    (1..=64).contains(&bare.len())
        && bare
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
}

pub fn registry_error(e: RegistryError) -> NodeError {
    use RegistryError as R;
    let code = match &e {
        R::BadReference { .. } => Code::Invalid,
        R::NotFound(_) => Code::ImageNotFound,
        R::Platform { .. } => Code::ImagePlatform,
        R::Denied { .. } => Code::RegistryDenied,
        R::Unreachable { .. } => Code::RegistryUnavailable,
        R::DigestMismatch { .. } => Code::ImageDigestMismatch,
        R::TooLarge { .. } => Code::ImageTooLarge,
        R::Unsupported(_) => Code::ImageUnsupported,
        R::DiskFull(_) => Code::InsufficientStorage,
        R::Store(_) => Code::StoreUnavailable,
        R::Io { .. } => Code::Internal,
    };
    NodeError::new(code, e.to_string())
}

fn read_json<T: for<'de> Deserialize<'de> + Default>(path: &PathBuf) -> T {
    std::fs::read(path).ok().and_then(|b| serde_json::from_slice(&b).ok()).unwrap_or_default()
}

fn save_json(path: &std::path::Path, value: &impl Serialize) {
    let json = serde_json::to_vec_pretty(value).unwrap_or_default();
    if let Err(e) = crate::durable::replace(path, &json) {
        tracing::warn!("saving {}: {e}", path.display());
    }
}

impl Images {
    pub async fn open(cfg: &Config, store: Arc<dyn ObjectStore>) -> anyhow::Result<Images> {
        let settings = silk_registry::Settings {
            registries: cfg.registries.clone(),
            auth_file: cfg.registry_auth_file.clone(),
            only_listed: cfg.only_listed_registries,
            max_image_bytes: cfg.max_image_mib << 20,
        };
        let min_free = cfg.min_free_mib << 20;
        let cache =
            LayerCache::open(&cfg.data_dir.join("layers"), cfg.layer_cache_mib << 20, min_free)?;
        let registered_file = cfg.data_dir.join("registered.json");
        let cached: Vec<Registered> = read_json(&registered_file);
        let images = Images {
            puller: Puller::new(settings, cache, Some(store.clone())),
            store,
            pins_file: cfg.data_dir.join("pins.json"),
            pins: Mutex::new(read_json(&cfg.data_dir.join("pins.json"))),
            registered: RwLock::new(cached.into_iter().map(|r| (r.name.clone(), r)).collect()),
            registered_file,
            pulls: Mutex::default(),
            locks: Mutex::default(),
            max_unpacked: cfg.max_image_unpacked_mib << 20,
            min_free,
            attempts: Default::default(),
        };
        if let Err(e) = images.refresh().await {
            tracing::warn!("registered templates: {e}; using those read last");
        }
        Ok(images)
    }

    pub fn registered(&self, name: &str) -> Option<Registered> {
        self.registered.read().unwrap_or_else(|e| e.into_inner()).get(name).cloned()
    }

    pub fn all_registered(&self) -> Vec<Registered> {
        self.registered.read().unwrap_or_else(|e| e.into_inner()).values().cloned().collect()
    }

    /// Re-reads the registered templates from the store. Returns the names that changed (left,
    /// or pinned to another digest): their goldens and warm sandboxes are stale.
    pub async fn refresh(&self) -> Result<Vec<String>, NodeError> {
        let metas = self.store.list_all(PREFIX).await?;
        let mut set = tokio::task::JoinSet::new();
        for meta in metas {
            let store = self.store.clone();
            set.spawn(async move { (meta.key.clone(), store.get_bytes(&meta.key).await) });
        }
        let mut records = BTreeMap::new();
        while let Some(joined) = set.join_next().await {
            let (key, got) = joined.map_err(|e| NodeError::internal(format!("templates: {e}")))?;
            match got {
                // A record is trusted only under its own name, and only with a valid one.
                Ok(bytes) => match serde_json::from_slice::<Registered>(&bytes) {
                    Ok(r)
                        if valid_name(&r.name) && key.as_str() == format!("{PREFIX}{}", r.name) =>
                    {
                        records.insert(r.name.clone(), r);
                    }
                    _ => tracing::warn!(%key, "templates: an unreadable record is ignored"),
                },
                Err(StoreError::NotFound { .. }) => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(self.replace(records))
    }

    fn replace(&self, next: BTreeMap<String, Registered>) -> Vec<String> {
        let mut known = self.registered.write().unwrap_or_else(|e| e.into_inner());
        let changed: Vec<String> = known
            .iter()
            .filter(|(n, r)| next.get(*n).is_none_or(|new| new.digest != r.digest))
            .map(|(n, _)| n.clone())
            .collect();
        if *known != next {
            *known = next;
            save_json(&self.registered_file, &known.values().collect::<Vec<_>>());
        }
        changed
    }

    /// Writes `record` to the store (the fleet's copy), then here.
    pub async fn put_registered(&self, record: Registered) -> Result<(), NodeError> {
        let key = Key::new(format!("{PREFIX}{}", record.name))?;
        let json = serde_json::to_vec(&record).map_err(|e| NodeError::internal(e.to_string()))?;
        self.store.put_bytes(&key, Bytes::from(json)).await?;
        let mut all = self.registered.read().unwrap_or_else(|e| e.into_inner()).clone();
        all.insert(record.name.clone(), record);
        self.replace(all);
        Ok(())
    }

    /// Whether the store holds a record named `name` (registered by any node, read or not).
    pub async fn stored(&self, name: &str) -> Result<bool, NodeError> {
        match self.store.head(&Key::new(format!("{PREFIX}{name}"))?).await {
            Ok(_) => Ok(true),
            Err(StoreError::NotFound { .. }) => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    /// The names of the records the store holds under `prefix` (`<tenant>/`, say).
    pub async fn stored_under(&self, prefix: &str) -> Result<Vec<String>, NodeError> {
        let metas = self.store.list_all(&format!("{PREFIX}{prefix}")).await?;
        Ok(metas
            .iter()
            .filter_map(|m| m.key.as_str().strip_prefix(PREFIX))
            .map(String::from)
            .collect())
    }

    pub async fn remove_registered(&self, name: &str) -> Result<(), NodeError> {
        self.store.delete(&[Key::new(format!("{PREFIX}{name}"))?]).await?;
        let mut all = self.registered.read().unwrap_or_else(|e| e.into_inner()).clone();
        all.remove(name);
        self.replace(all);
        self.forget(name);
        Ok(())
    }

    /// The digest a configured template's `image` is pinned to here.
    pub fn pinned(&self, name: &str, image: &str) -> Option<String> {
        let pins = self.pins.lock().unwrap_or_else(|e| e.into_inner());
        pins.get(name).filter(|p| p.image == image).map(|p| p.digest.clone())
    }

    pub fn pin(&self, name: &str, image: &str, digest: &str) {
        let mut pins = self.pins.lock().unwrap_or_else(|e| e.into_inner());
        pins.insert(name.into(), Pin { image: image.into(), digest: digest.into() });
        save_json(&self.pins_file, &*pins);
    }

    /// The digest of `image`'s linux/amd64 image manifest, asked of its registry now.
    pub async fn resolve(&self, image: &str) -> Result<String, NodeError> {
        Ok(self.puller.resolve(image).await.map_err(registry_error)?.to_string())
    }

    fn lock_for(&self, name: &str) -> Arc<tokio::sync::Mutex<()>> {
        let mut locks = self.locks.lock().unwrap_or_else(|e| e.into_inner());
        locks.entry(name.to_string()).or_default().clone()
    }

    fn set(&self, name: &str, pull: Pull) {
        self.pulls.lock().unwrap_or_else(|e| e.into_inner()).insert(name.into(), pull);
    }

    /// The image `digest` of `image`'s repository, pulled for template `name` and made a
    /// template by `unpack` (once: a caller that waited for another's pull gets its result,
    /// failed or not; a later one tries again). It is `ready` only once unpacked; `unpack` keeps
    /// the holds on its blobs until it has read them (they are otherwise the layer cache's to
    /// collect).
    pub async fn pull<Unpack, Unpacked>(
        &self,
        name: &str,
        image: &str,
        digest: &str,
        unpack: Unpack,
    ) -> Result<Template, NodeError>
    where
        Unpack: FnOnce(PulledImage, Vec<Held>) -> Unpacked,
        Unpacked: Future<Output = Result<Template, NodeError>>,
    {
        use std::sync::atomic::Ordering::Relaxed;
        let waited_from = self.attempts.load(Relaxed);
        let lock = self.lock_for(name);
        let _one_at_a_time = lock.lock().await;
        match self.pulls.lock().unwrap_or_else(|e| e.into_inner()).get(name) {
            Some(Pull::Ready { digest: d, template, .. }) if d == digest => {
                return Ok(template.clone());
            }
            Some(Pull::Failed { digest: d, error, attempt })
                if d == digest && *attempt > waited_from =>
            {
                return Err(error.clone());
            }
            _ => {}
        }
        let progress = Arc::new(Progress::default());
        self.set(name, Pull::Running { digest: digest.into(), progress: progress.clone() });
        let pulled = match Digest::parse(digest) {
            Ok(d) => self.puller.pull(image, &d, &progress).await,
            Err(e) => Err(e),
        };
        let made = match pulled {
            Ok(p) => {
                let s = p.sources;
                tracing::info!(
                    template = name,
                    %image,
                    digest,
                    from_cache = s.cache,
                    from_store = s.store,
                    from_registry = s.registry,
                    "image pulled"
                );
                let pulled = PulledImage {
                    digest: digest.into(),
                    config: p.config,
                    layers: p.layers.into_iter().map(|l| l.path).collect(),
                    max_bytes: self.max_unpacked,
                    min_free_bytes: self.min_free,
                };
                unpack(pulled, p.held).await
            }
            Err(e) => Err(registry_error(e)),
        };
        match made {
            Ok(template) => {
                let total = progress.total.load(Relaxed);
                let ready =
                    Pull::Ready { digest: digest.into(), total, template: template.clone() };
                self.set(name, ready);
                Ok(template)
            }
            Err(error) => {
                self.failed(name, digest, &error);
                Err(error)
            }
        }
    }

    /// Records that template `name` at `digest` cannot be used here (the pull, or unpacking it).
    fn failed(&self, name: &str, digest: &str, error: &NodeError) {
        let attempt = self.attempts.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
        self.set(name, Pull::Failed { digest: digest.into(), error: error.clone(), attempt });
    }

    /// Forgets the template's pull here (it left, or was pinned to another digest).
    pub fn forget(&self, name: &str) {
        self.pulls.lock().unwrap_or_else(|e| e.into_inner()).remove(name);
    }

    /// Where the pull of template `name` at `digest` stands here.
    pub fn view(&self, name: &str, digest: &str) -> PullView {
        use std::sync::atomic::Ordering::Relaxed;
        let pulls = self.pulls.lock().unwrap_or_else(|e| e.into_inner());
        let pending =
            PullView { status: PullStatus::Pending, done: None, total: None, error: None };
        match pulls.get(name) {
            Some(Pull::Running { digest: d, progress }) if d == digest => PullView {
                status: PullStatus::Pulling,
                done: Some(progress.done.load(Relaxed)),
                total: Some(progress.total.load(Relaxed)),
                error: None,
            },
            Some(Pull::Ready { digest: d, total, .. }) if d == digest => PullView {
                status: PullStatus::Ready,
                done: Some(*total),
                total: Some(*total),
                error: None,
            },
            Some(Pull::Failed { digest: d, error, .. }) if d == digest => {
                PullView { error: Some(error.body().error), status: PullStatus::Failed, ..pending }
            }
            _ => pending,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn template_names_are_plain_or_under_a_valid_tenant() {
        for ok in ["py", "agent-base_2", "acme/py"] {
            assert!(valid_name(ok), "{ok}");
        }
        for bad in ["", "Py", "a/b/c", "../x", "acme/", "/x", &"x".repeat(65), "a b"] {
            assert!(!valid_name(bad), "{bad}");
        }
    }
}
