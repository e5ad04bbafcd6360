//! Leases on any [`ObjectStore`]: at most one holder at a time, across nodes, without
//! conditional writes (which not every S3 server honours: Garage ignores `If-None-Match`).
//!
//! To acquire `name`, a contender writes a key of its own, `<name>/<nanos>-<random>`, then lists
//! `<name>/`: it holds the lease only if its key is the only live one there. Otherwise it
//! deletes its key and reports "held elsewhere" (or, when nobody else had held it before,
//! backs off briefly and tries once more). With list-after-write consistency (a directory, AWS
//! S3, a single Garage node) two contenders cannot both win: each writes before it lists, so
//! whichever lists second sees the other's key. Keys older than the TTL (a holder that died)
//! are ignored and removed.

use std::time::{Duration, SystemTime};

use bytes::Bytes;

use crate::{Key, ObjectStore, Result};

/// A held lease; [`Lease::release`] gives it up.
#[derive(Debug)]
pub struct Lease {
    key: Key,
}

fn nonce() -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default().as_nanos(),
    );
    format!("{:016x}", h.finish())
}

impl Lease {
    /// Takes the lease `name` for `holder`, or `None` when someone else holds it.
    pub async fn acquire(
        store: &dyn ObjectStore,
        name: &str,
        holder: &str,
        ttl: Duration,
    ) -> Result<Option<Lease>> {
        for attempt in 0..3 {
            let nanos = SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .unwrap_or_default()
                .as_nanos();
            let key = Key::new(format!("{name}/{nanos:024}-{}", nonce()))?;
            store.put_bytes(&key, Bytes::from(holder.to_string())).await?;
            let now = SystemTime::now();
            let mut others = 0;
            for o in store.list_all(&format!("{name}/")).await? {
                if o.key == key {
                    continue;
                }
                if now.duration_since(o.modified).unwrap_or_default() > ttl {
                    let _ = store.delete(std::slice::from_ref(&o.key)).await; // a holder that died
                    continue;
                }
                others += 1;
            }
            if others == 0 {
                return Ok(Some(Lease { key }));
            }
            store.delete(&[key]).await?;
            // Two contenders that wrote at once both see each other and both step back; a
            // short random pause lets one of them win the next round.
            if attempt < 2 {
                let jitter = u64::from_str_radix(&nonce()[..4], 16).unwrap_or(0) % 50;
                tokio::time::sleep(Duration::from_millis(20 + jitter)).await;
            }
        }
        Ok(None)
    }

    pub async fn release(self, store: &dyn ObjectStore) -> Result<()> {
        store.delete(&[self.key]).await
    }
}
