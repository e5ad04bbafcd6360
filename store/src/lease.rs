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

/// Digits of the nanosecond timestamp in a lease key (zero-padded).
const NANOS_DIGITS: usize = 24;

/// Whether `key` is a contender's key of lease `name`: `<name>/<24 digits>-<16 hex>`, as
/// [`Lease::acquire`] writes them. Anything else listed under `<name>/` (written by something
/// else, or nested deeper) is not a lease key: never deleted as a dead holder, never counted.
fn is_lease_key(name: &str, key: &Key) -> bool {
    let Some(last) = key.as_str().strip_prefix(name).and_then(|k| k.strip_prefix('/')) else {
        return false;
    };
    let Some((nanos, nonce)) = last.split_once('-') else { return false };
    nanos.len() == NANOS_DIGITS
        && nanos.bytes().all(|b| b.is_ascii_digit())
        && nonce.len() == 16
        && nonce.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
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
            // `{:024}`: NANOS_DIGITS digits (for the next 30,000 years).
            let key = Key::new(format!("{name}/{nanos:024}-{}", nonce()))?;
            store.put_bytes(&key, Bytes::from(holder.to_string())).await?;
            let now = SystemTime::now();
            let mut others = 0;
            for o in store.list_all(&format!("{name}/")).await? {
                if o.key == key || !is_lease_key(name, &o.key) {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fs::{FsConfig, FsStore};

    const NONCE: &str = "0123456789abcdef";

    #[test]
    fn lease_keys_have_one_shape() {
        let name = "leases/sb-1";
        assert!(is_lease_key(name, &Key::new(format!("{name}/{:024}-{NONCE}", 17)).unwrap()));
        for bad in [
            format!("{name}/readme"),
            format!("{name}/{:024}-0123456789ABCDEF", 1),
            format!("{name}/{:023}-{NONCE}", 1),
            format!("{name}/{:024}-{NONCE}0", 1),
            format!("{name}/{:024}-{NONCE}/x", 1),
            format!("{name}/x/{:024}-{NONCE}", 1),
            format!("{name}x/{:024}-{NONCE}", 1),
            format!("leases/sb-2/{:024}-{NONCE}", 1),
        ] {
            assert!(!is_lease_key(name, &Key::new(&bad).unwrap()), "{bad}");
        }
    }

    #[tokio::test]
    async fn only_lease_keys_of_dead_holders_are_deleted() {
        let dir = tempfile::tempdir().unwrap();
        let store = FsStore::open(FsConfig::new(dir.path())).await.unwrap();
        let name = "leases/sb-1";
        let dead = Key::new(format!("{name}/{:024}-{NONCE}", 1)).unwrap();
        store.put_bytes(&dead, Bytes::from_static(b"died")).await.unwrap();
        // Listed under the lease's prefix, but not written by a contender.
        let foreign: Vec<Key> = [format!("{name}/notes"), format!("{name}/sub/{:024}-{NONCE}", 1)]
            .into_iter()
            .map(|k| Key::new(k).unwrap())
            .collect();
        for k in &foreign {
            store.put_bytes(k, Bytes::from_static(b"keep")).await.unwrap();
        }
        tokio::time::sleep(Duration::from_millis(30)).await;
        // Every key is older than the TTL: only the dead contender's goes.
        let ttl = Duration::from_millis(10);
        let lease = Lease::acquire(&store, name, "me", ttl).await.unwrap().expect("free");
        assert!(store.head(&dead).await.unwrap_err().is_not_found());
        for k in &foreign {
            store.head(k).await.unwrap_or_else(|e| panic!("{k} was deleted: {e}"));
        }
        lease.release(&store).await.unwrap();
    }
}
