//! Tenants: teams sharing a fleet, each with an API key and limits. The records live in the
//! shared store (`tenants/<name>`, JSON, the key kept only as its blake3 hash), so every node
//! knows every tenant; each node keeps them in memory (and in `<data_dir>/tenants.json`, so a
//! node that starts while the store is down still authenticates) and re-reads the store every
//! `tenant_refresh_ms`. A change made on one node is in force there at once and on every other
//! node within one refresh period plus one store round trip.
//!
//! Writes go to the store first and answer `503 store_unavailable` when it cannot be reached;
//! authentication goes on from the records in memory. Two nodes creating the same name at the
//! same moment both write; the later write is the tenant (the store has no conditional put).

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, RwLock};

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use silk_api::TenantLimits;
use silk_store::{Key, ObjectStore, StoreError};

use crate::claims::{hash_token, random_hex};
use crate::error::{Code, NodeError};
use crate::node::now_ms;

const PREFIX: &str = "tenants/";
/// Tenant keys start with this, so a node tells them from sandbox tokens without a lookup.
pub const KEY_PREFIX: &str = "sk_";

/// A tenant as the store keeps it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TenantRecord {
    pub name: String,
    /// blake3 of the API key, hex.
    pub key_hash: String,
    pub limits: TenantLimits,
    pub created_ms: u64,
    pub key_since_ms: u64,
}

#[derive(Debug, Default)]
struct Known {
    by_name: BTreeMap<String, TenantRecord>,
    /// Key hash → tenant name.
    by_key: HashMap<String, String>,
}

impl Known {
    fn of(records: impl IntoIterator<Item = TenantRecord>) -> Known {
        let by_name: BTreeMap<_, _> = records.into_iter().map(|r| (r.name.clone(), r)).collect();
        let by_key = by_name.values().map(|r| (r.key_hash.clone(), r.name.clone())).collect();
        Known { by_name, by_key }
    }
}

#[derive(Debug)]
pub struct Tenants {
    store: Arc<dyn ObjectStore>,
    /// The last records read, for a start while the store is down.
    cache_file: PathBuf,
    known: RwLock<Known>,
}

fn key_of(name: &str) -> Result<Key, NodeError> {
    Key::new(format!("{PREFIX}{name}")).map_err(NodeError::from)
}

fn not_found(name: &str) -> NodeError {
    NodeError::new(Code::NotFound, format!("no tenant {name:?}"))
}

fn new_key() -> String {
    // The same source as sandbox tokens: the kernel's CSPRNG.
    format!("{KEY_PREFIX}{}", random_hex(32))
}

impl Tenants {
    /// The tenants of `store`: read now, or (when it cannot be reached) those this node last
    /// read.
    pub async fn open(store: Arc<dyn ObjectStore>, data_dir: &std::path::Path) -> Tenants {
        let cache_file = data_dir.join("tenants.json");
        let cached: Vec<TenantRecord> = std::fs::read(&cache_file)
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or_default();
        let tenants = Tenants { store, cache_file, known: RwLock::new(Known::of(cached)) };
        if let Err(e) = tenants.refresh().await {
            tracing::warn!("tenants: {e}; using the {} records read last", tenants.all().len());
        }
        tenants
    }

    fn known(&self) -> std::sync::RwLockReadGuard<'_, Known> {
        self.known.read().unwrap_or_else(|e| e.into_inner())
    }

    /// The tenant whose key `bearer` is.
    pub fn by_key(&self, bearer: &str) -> Option<String> {
        if !bearer.starts_with(KEY_PREFIX) {
            return None;
        }
        self.known().by_key.get(&hash_token(bearer)).cloned()
    }

    pub fn get(&self, name: &str) -> Option<TenantRecord> {
        self.known().by_name.get(name).cloned()
    }

    pub fn all(&self) -> Vec<TenantRecord> {
        self.known().by_name.values().cloned().collect()
    }

    /// Re-reads every record from the store. Returns the names of tenants that are gone.
    pub async fn refresh(&self) -> Result<Vec<String>, NodeError> {
        let metas = self.store.list_all(PREFIX).await?;
        let mut set = tokio::task::JoinSet::new();
        for meta in metas {
            let store = self.store.clone();
            set.spawn(async move { (meta.key.clone(), store.get_bytes(&meta.key).await) });
        }
        let mut records = vec![];
        while let Some(joined) = set.join_next().await {
            let (key, got) = joined.map_err(|e| NodeError::internal(format!("tenants: {e}")))?;
            match got {
                Ok(bytes) => match serde_json::from_slice::<TenantRecord>(&bytes) {
                    // A record is trusted only under its own name, and only with a name a
                    // tenant can have (it becomes a template prefix and a log field).
                    Ok(r)
                        if silk_api::valid_tenant_name(&r.name)
                            && key.as_str() == format!("{PREFIX}{}", r.name) =>
                    {
                        records.push(r)
                    }
                    _ => tracing::warn!(%key, "tenants: an unreadable record is ignored"),
                },
                // Deleted between the list and the read.
                Err(StoreError::NotFound { .. }) => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(self.replace(records))
    }

    /// Makes `records` the known set; the names that left it.
    fn replace(&self, records: Vec<TenantRecord>) -> Vec<String> {
        let next = Known::of(records);
        let mut known = self.known.write().unwrap_or_else(|e| e.into_inner());
        let gone =
            known.by_name.keys().filter(|n| !next.by_name.contains_key(*n)).cloned().collect();
        let changed = known.by_name != next.by_name;
        *known = next;
        if changed {
            let all: Vec<_> = known.by_name.values().collect();
            if let Ok(bytes) = serde_json::to_vec(&all)
                && let Err(e) = crate::durable::replace(&self.cache_file, &bytes)
            {
                tracing::warn!("tenants: writing {}: {e}", self.cache_file.display());
            }
        }
        gone
    }

    fn remember(&self, record: TenantRecord) {
        let mut all = self.all();
        all.retain(|r| r.name != record.name);
        all.push(record);
        self.replace(all);
    }

    async fn write(&self, record: &TenantRecord) -> Result<(), NodeError> {
        let bytes = serde_json::to_vec(record).map_err(|e| NodeError::internal(e.to_string()))?;
        self.store.put_bytes(&key_of(&record.name)?, Bytes::from(bytes)).await?;
        Ok(())
    }

    /// A new tenant and its key (shown once). `409 conflict` when the name is taken.
    pub async fn create(
        &self,
        name: &str,
        limits: TenantLimits,
    ) -> Result<(TenantRecord, String), NodeError> {
        if !silk_api::valid_tenant_name(name) {
            return Err(NodeError::bad_request(format!(
                "tenant name {name:?}: 1-63 of a-z, 0-9 and -"
            )));
        }
        match self.store.head(&key_of(name)?).await {
            Ok(_) => return Err(conflict(name)),
            Err(StoreError::NotFound { .. }) => {}
            Err(e) => return Err(e.into()),
        }
        let key = new_key();
        let now = now_ms();
        let record = TenantRecord {
            name: name.to_string(),
            key_hash: hash_token(&key),
            limits,
            created_ms: now,
            key_since_ms: now,
        };
        self.write(&record).await?;
        self.remember(record.clone());
        Ok((record, key))
    }

    /// The record as the store has it now (a change made elsewhere is not missed).
    async fn current(&self, name: &str) -> Result<TenantRecord, NodeError> {
        // A name no tenant can have is not one the store is asked about (nor can refuse).
        if !silk_api::valid_tenant_name(name) {
            return Err(not_found(name));
        }
        match self.store.get_bytes(&key_of(name)?).await {
            Ok(bytes) => serde_json::from_slice(&bytes)
                .map_err(|e| NodeError::internal(format!("tenant record {name}: {e}"))),
            Err(StoreError::NotFound { .. }) => Err(not_found(name)),
            Err(e) => Err(e.into()),
        }
    }

    pub async fn set_limits(
        &self,
        name: &str,
        patch: &silk_api::TenantPatch,
    ) -> Result<TenantRecord, NodeError> {
        let mut record = self.current(name).await?;
        record.limits = patch.apply(record.limits);
        self.write(&record).await?;
        self.remember(record.clone());
        Ok(record)
    }

    /// A new key; the old one stops working here at once and on every node within the bound.
    pub async fn rotate(&self, name: &str) -> Result<String, NodeError> {
        let mut record = self.current(name).await?;
        let key = new_key();
        record.key_hash = hash_token(&key);
        record.key_since_ms = now_ms();
        self.write(&record).await?;
        self.remember(record);
        Ok(key)
    }

    pub async fn remove(&self, name: &str) -> Result<(), NodeError> {
        self.current(name).await?;
        self.store.delete(&[key_of(name)?]).await?;
        let mut all = self.all();
        all.retain(|r| r.name != name);
        self.replace(all);
        Ok(())
    }
}

fn conflict(name: &str) -> NodeError {
    NodeError::new(Code::Conflict, format!("a tenant named {name:?} exists"))
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn tenants(dir: &std::path::Path) -> Tenants {
        let fs = silk_store::fs::FsConfig::new(dir.join("store"));
        let store: Arc<dyn ObjectStore> =
            Arc::new(silk_store::fs::FsStore::open(fs).await.unwrap());
        Tenants::open(store, dir).await
    }

    const LIMITS: TenantLimits = TenantLimits {
        max_sandboxes: 2,
        max_checkpoints: 1,
        max_store_bytes: 1 << 20,
        max_sandbox_seconds: None,
    };

    #[tokio::test]
    async fn keys_name_their_tenant_until_rotated_and_every_node_learns_by_refresh() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (tenants(dir.path()).await, tenants(dir.path()).await);
        let (record, key) = a.create("team-a", LIMITS).await.unwrap();
        assert!(key.starts_with(KEY_PREFIX) && record.key_hash != key);
        assert_eq!(a.by_key(&key).as_deref(), Some("team-a"));
        assert_eq!(b.by_key(&key), None, "b has not refreshed yet");
        b.refresh().await.unwrap();
        assert_eq!(b.by_key(&key).as_deref(), Some("team-a"));
        assert!(matches!(a.create("team-a", LIMITS).await, Err(e) if e.code == Code::Conflict));
        for bad in ["", "Team", "a_b", "a/b", &"x".repeat(64)] {
            assert!(a.create(bad, LIMITS).await.is_err(), "{bad:?}");
        }

        let new = b.rotate("team-a").await.unwrap();
        assert_eq!(b.by_key(&key), None);
        a.refresh().await.unwrap();
        assert_eq!((a.by_key(&key), a.by_key(&new).as_deref()), (None, Some("team-a")));

        let patch = silk_api::TenantPatch { max_sandboxes: Some(9), ..Default::default() };
        a.set_limits("team-a", &patch).await.unwrap();
        b.refresh().await.unwrap();
        assert_eq!(b.get("team-a").unwrap().limits.max_sandboxes, 9);

        a.remove("team-a").await.unwrap();
        assert_eq!(b.refresh().await.unwrap(), ["team-a"], "b learns it is gone");
        assert_eq!(b.by_key(&new), None);
        assert!(matches!(a.rotate("team-a").await, Err(e) if e.code == Code::NotFound));
    }

    #[tokio::test]
    async fn a_record_under_another_name_is_not_trusted() {
        let dir = tempfile::tempdir().unwrap();
        let t = tenants(dir.path()).await;
        let (mut record, key) = t.create("honest", LIMITS).await.unwrap();
        // Someone with store access writes `tenants/evil` claiming to be `honest`.
        record.limits.max_sandboxes = 1000;
        let bytes = Bytes::from(serde_json::to_vec(&record).unwrap());
        t.store.put_bytes(&Key::new("tenants/evil").unwrap(), bytes).await.unwrap();
        // And one whose name no tenant can have, under that very name.
        let mut odd = record.clone();
        odd.name = "a/b".into();
        let bytes = Bytes::from(serde_json::to_vec(&odd).unwrap());
        t.store.put_bytes(&Key::new("tenants/a/b").unwrap(), bytes).await.unwrap();
        t.refresh().await.unwrap();
        assert_eq!(t.get("honest").unwrap().limits.max_sandboxes, 2);
        assert_eq!(t.by_key(&key).as_deref(), Some("honest"));
        assert!(t.get("a/b").is_none());
    }
}
