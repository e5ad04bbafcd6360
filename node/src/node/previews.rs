//! Preview URLs in the controller: the fleet's key, and the grants each claim keeps (see
//! `crate::previews`).

use bytes::Bytes;
use silk_store::{Key, StoreError};

use super::*;
use crate::previews::{self, Grant, Token};

/// Where the fleet's preview key lives in the store.
const KEY_OBJECT: &str = "keys/previews";

impl Node {
    /// The fleet's preview key: the store's, or (the first node to need one) a new one written
    /// there. Two nodes making the first at the same moment both write; each then uses what the
    /// store holds after its write, so they agree unless the writes interleave exactly.
    pub(crate) async fn preview_key(&self) -> Result<[u8; 32], NodeError> {
        let key = self
            .preview_key
            .get_or_try_init(|| async {
                let store = self.store.object_store();
                let object = Key::new(KEY_OBJECT.to_string()).map_err(NodeError::from)?;
                let read = |b: Bytes| <[u8; 32]>::try_from(b.as_ref()).ok();
                match store.get_bytes(&object).await {
                    Ok(b) => read(b).ok_or_else(|| {
                        NodeError::internal("the preview key in the store is not 32 bytes")
                    }),
                    Err(StoreError::NotFound { .. }) => {
                        let fresh = previews::new_key();
                        store.put_bytes(&object, Bytes::copy_from_slice(&fresh)).await?;
                        let stored = store.get_bytes(&object).await?;
                        read(stored).ok_or_else(|| {
                            NodeError::internal("the preview key in the store is not 32 bytes")
                        })
                    }
                    Err(e) => Err(e.into()),
                }
            })
            .await?;
        Ok(*key)
    }

    /// A new preview of port `port` of sandbox `id` for `ttl_seconds`: its token.
    pub async fn create_preview(
        &self,
        id: &str,
        port: u16,
        ttl_seconds: u64,
    ) -> Result<(String, u64), NodeError> {
        if port == 0 {
            return Err(NodeError::bad_request("port must be 1-65535"));
        }
        if !(1..=previews::MAX_TTL).contains(&ttl_seconds) {
            return Err(NodeError::bad_request(format!(
                "ttl_seconds must be 1-{}",
                previews::MAX_TTL
            )));
        }
        let key = self.preview_key().await?;
        let _busy = self.busy(id).await;
        let mut record = self.get(id).ok_or_else(NodeError::sandbox_not_found)?.record;
        let now = now_ms();
        record.previews.retain(|g| g.expires_ms > now);
        if record.previews.len() >= previews::MAX_PER_SANDBOX {
            return Err(NodeError::new(
                Code::Conflict,
                format!(
                    "a sandbox has at most {} live previews: revoke one",
                    previews::MAX_PER_SANDBOX
                ),
            ));
        }
        let expires_ms = now + ttl_seconds * 1000;
        let (token, grant) = previews::issue(&key, id, port, expires_ms);
        record.previews.push(grant);
        self.keep_previews(id, record).await?;
        Ok((token, expires_ms))
    }

    /// Revokes a preview of sandbox `id`; `false`: it had none such.
    pub async fn revoke_preview(&self, id: &str, token: &str) -> Result<bool, NodeError> {
        let _busy = self.busy(id).await;
        let mut record = self.get(id).ok_or_else(NodeError::sandbox_not_found)?.record;
        let hash = hash_token(token);
        let before = record.previews.len();
        record.previews.retain(|g| g.hash != hash);
        if record.previews.len() == before {
            return Ok(false);
        }
        self.keep_previews(id, record).await?;
        Ok(true)
    }

    /// Journals `record`'s previews and puts them in force.
    async fn keep_previews(&self, id: &str, record: ClaimRecord) -> Result<(), NodeError> {
        self.journal
            .commit(vec![Change::Put(id.to_string(), (&record).into())])
            .await
            .map_err(|e| NodeError::internal(format!("journal: {e}")))?;
        match self.lock().slots.claim_mut(id) {
            Some(live) => live.record.previews = record.previews,
            None => return Err(NodeError::sandbox_not_found()),
        }
        Ok(())
    }

    /// Whether `token` opens port `port` of sandbox `id` now: signed by the fleet, not
    /// expired, and not revoked.
    pub async fn preview_allows(&self, id: &str, port: u16, token: &str) -> bool {
        let Some(parsed) = Token::parse(token) else { return false };
        let Ok(key) = self.preview_key().await else { return false };
        if !parsed.valid(&key, id, port, now_ms()) {
            return false;
        }
        self.get(id).is_some_and(|l| granted(&l.record, token, Some(port)))
    }
}

/// Whether `record` holds a live grant of `token` (for `port`, when given): a token this node
/// issued and nobody revoked. Peers ask it through a lookup before they forward a preview.
pub(crate) fn granted(record: &ClaimRecord, token: &str, port: Option<u16>) -> bool {
    let (hash, now) = (hash_token(token), now_ms());
    record
        .previews
        .iter()
        .any(|g: &Grant| g.hash == hash && g.expires_ms > now && port.is_none_or(|p| p == g.port))
}
