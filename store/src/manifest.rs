//! Snapshot names and manifests.
//!
//! A manifest is the commit point of a snapshot: a JSON object listing the chunks of the stream in
//! order, with their sizes, the stream's total size, the caller's metadata and a format version.
//! It is written after every chunk it names is in the store, so a manifest that exists always
//! describes a whole snapshot.
//!
//! Names map to keys: `goldens/<pool-key>/<digest>`, `checkpoints/ck_<id>`, `archives/ar_<id>`,
//! `templates/<name>`.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::chunk::{ChunkId, ChunkParams};
use crate::{Key, Result, StoreError};

/// The manifest format this build writes, and the newest it reads.
pub const FORMAT: u32 = 1;

/// Where manifests live; garbage collection reads every one of them.
pub const MANIFEST_PREFIXES: [&str; 4] = ["goldens/", "checkpoints/", "archives/", "templates/"];

/// What a snapshot is, and so where its manifest lives. Every part is 1–128 characters of
/// `[A-Za-z0-9._=+-]`, not starting with `.`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum SnapshotName {
    /// `goldens/<pool-key>/<digest>`
    Golden { pool: String, digest: String },
    /// `checkpoints/ck_<id>`
    Checkpoint(String),
    /// `archives/ar_<id>`
    Archive(String),
    /// `templates/<name>`
    Template(String),
}

impl SnapshotName {
    pub fn golden(pool: &str, digest: &str) -> Result<SnapshotName> {
        Ok(SnapshotName::Golden { pool: part(pool)?, digest: part(digest)? })
    }

    /// `id` without the `ck_` prefix.
    pub fn checkpoint(id: &str) -> Result<SnapshotName> {
        Ok(SnapshotName::Checkpoint(part(id)?))
    }

    /// `id` without the `ar_` prefix.
    pub fn archive(id: &str) -> Result<SnapshotName> {
        Ok(SnapshotName::Archive(part(id)?))
    }

    pub fn template(name: &str) -> Result<SnapshotName> {
        Ok(SnapshotName::Template(part(name)?))
    }

    pub fn key(&self) -> Key {
        // Every part was checked at construction, so the key is valid.
        Key::new(self.to_string()).expect("snapshot names make valid keys")
    }

    /// The name a manifest key stands for.
    pub fn from_key(key: &Key) -> Result<SnapshotName> {
        let s = key.as_str();
        let bad = || StoreError::InvalidKey { key: s.to_string(), reason: "not a snapshot name" };
        let parts: Vec<&str> = s.split('/').collect();
        match parts.as_slice() {
            ["goldens", pool, digest] => SnapshotName::golden(pool, digest),
            ["checkpoints", id] => {
                SnapshotName::checkpoint(id.strip_prefix("ck_").ok_or_else(bad)?)
            }
            ["archives", id] => SnapshotName::archive(id.strip_prefix("ar_").ok_or_else(bad)?),
            ["templates", name] => SnapshotName::template(name),
            _ => Err(bad()),
        }
    }
}

impl fmt::Display for SnapshotName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SnapshotName::Golden { pool, digest } => write!(f, "goldens/{pool}/{digest}"),
            SnapshotName::Checkpoint(id) => write!(f, "checkpoints/ck_{id}"),
            SnapshotName::Archive(id) => write!(f, "archives/ar_{id}"),
            SnapshotName::Template(name) => write!(f, "templates/{name}"),
        }
    }
}

fn part(s: &str) -> Result<String> {
    let ok = (1..=128).contains(&s.len())
        && !s.starts_with('.')
        && s.bytes().all(|b| b.is_ascii_alphanumeric() || b"._=+-".contains(&b));
    if ok {
        Ok(s.to_string())
    } else {
        Err(StoreError::InvalidKey {
            key: s.to_string(),
            reason: "a snapshot name part is 1-128 of A-Z a-z 0-9 . _ = + - (not starting with .)",
        })
    }
}

/// One chunk of a snapshot, in stream order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChunkRef {
    pub id: ChunkId,
    pub size: u32,
}

/// See the module docs.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    pub format: u32,
    /// The snapshot's name (its key), so a manifest read on its own says what it is.
    pub name: String,
    /// Bytes in the stream: the sum of the chunk sizes.
    pub size: u64,
    /// When the upload began, in milliseconds since the Unix epoch (the writer's clock).
    pub created_ms: u64,
    pub chunking: ChunkParams,
    /// The caller's metadata (template digest, sandbox id, engine, ...).
    pub meta: BTreeMap<String, String>,
    pub chunks: Vec<ChunkRef>,
    /// A keyed blake3 of the rest of the manifest under the writer's manifest key (hex), when
    /// it had one (`SnapshotStore::vouches_for`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mac: Option<String>,
}

impl Manifest {
    /// The MAC of this manifest under `key`: of its JSON without the `mac` field. A field a
    /// newer writer added and this build does not know is not in what it hashes, so such a
    /// manifest is never vouched for here (its images' own MAC is checked instead).
    pub fn mac_under(&self, key: &[u8; 32]) -> blake3::Hash {
        let unsigned = Manifest { mac: None, ..self.clone() };
        blake3::keyed_hash(key, &unsigned.to_json())
    }

    pub fn to_json(&self) -> Vec<u8> {
        // A struct of strings, numbers and maps always serializes.
        serde_json::to_vec(self).expect("manifests serialize")
    }

    /// Parses and checks a manifest read from `key`.
    pub fn parse(key: &Key, bytes: &[u8]) -> Result<Manifest> {
        let corrupt = |reason: String| StoreError::CorruptManifest { key: key.to_string(), reason };
        // The version first, so a newer format is reported as such rather than as garbage.
        #[derive(Deserialize)]
        struct Version {
            format: u32,
        }
        let v: Version = serde_json::from_slice(bytes).map_err(|e| corrupt(e.to_string()))?;
        if v.format > FORMAT || v.format == 0 {
            return Err(StoreError::UnsupportedFormat {
                key: key.to_string(),
                found: v.format,
                supported: FORMAT,
            });
        }
        let m: Manifest = serde_json::from_slice(bytes).map_err(|e| corrupt(e.to_string()))?;
        let sum: u64 = m.chunks.iter().map(|c| u64::from(c.size)).sum();
        if sum != m.size {
            return Err(corrupt(format!("chunks add up to {sum} bytes, size says {}", m.size)));
        }
        if m.name != key.as_str() {
            return Err(corrupt(format!("it names itself {:?}", m.name)));
        }
        Ok(m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_map_to_keys_and_back() {
        let names = [
            SnapshotName::golden("host-small-none", "a1b2").unwrap(),
            SnapshotName::checkpoint("x9").unwrap(),
            SnapshotName::archive("y8").unwrap(),
            SnapshotName::template("debian-12").unwrap(),
        ];
        let keys = [
            "goldens/host-small-none/a1b2",
            "checkpoints/ck_x9",
            "archives/ar_y8",
            "templates/debian-12",
        ];
        for (name, key) in names.iter().zip(keys) {
            assert_eq!(name.key().as_str(), key);
            assert_eq!(&SnapshotName::from_key(&name.key()).unwrap(), name);
        }
        assert!(SnapshotName::checkpoint("../x").is_err());
        assert!(SnapshotName::template("a/b").is_err());
        assert!(SnapshotName::golden(".p", "d").is_err());
        assert!(SnapshotName::from_key(&Key::new("checkpoints/x9").unwrap()).is_err());
    }

    #[test]
    fn manifests_round_trip_and_are_checked() {
        let name = SnapshotName::checkpoint("a").unwrap();
        let m = Manifest {
            format: FORMAT,
            name: name.to_string(),
            size: 5,
            created_ms: 1,
            chunking: ChunkParams::default(),
            meta: BTreeMap::from([("k".to_string(), "v".to_string())]),
            chunks: vec![ChunkRef { id: ChunkId::of(b"hello"), size: 5 }],
            mac: None,
        };
        let key = name.key();
        assert_eq!(Manifest::parse(&key, &m.to_json()).unwrap(), m);

        let mut short = m.clone();
        short.size = 6;
        assert!(matches!(
            Manifest::parse(&key, &short.to_json()),
            Err(StoreError::CorruptManifest { .. })
        ));
        let mut newer = m.clone();
        newer.format = FORMAT + 1;
        assert!(matches!(
            Manifest::parse(&key, &newer.to_json()),
            Err(StoreError::UnsupportedFormat { found: 2, .. })
        ));
        assert!(matches!(
            Manifest::parse(&key, b"{\"format\": 1, \"garbage"),
            Err(StoreError::CorruptManifest { .. })
        ));
        let other = SnapshotName::checkpoint("b").unwrap().key();
        assert!(Manifest::parse(&other, &m.to_json()).is_err(), "a manifest copied elsewhere");
    }
}

/// The seeded quick pass of the `manifest` fuzz target (`store/fuzz`): real manifests mutated.
#[cfg(test)]
mod mutations {
    use super::*;

    /// 20 000 manifests damaged (bits flipped, JSON bytes inserted, bytes dropped, pieces of
    /// another manifest spliced in, the end cut off), each read under every kind of name: no
    /// panic; a manifest that is accepted adds up, names its key, holds no more than its bytes
    /// spelled out, and serializes to bytes that parse to the same manifest.
    #[test]
    fn mutated_manifests_are_refused_or_read_back_whole() {
        let keys = [
            SnapshotName::golden("host-small-none", "a1b2").unwrap().key(),
            SnapshotName::checkpoint("x9").unwrap().key(),
            SnapshotName::archive("y8").unwrap().key(),
            SnapshotName::template("debian-12").unwrap().key(),
        ];
        let seeds: Vec<Vec<u8>> = keys
            .iter()
            .enumerate()
            .map(|(i, key)| {
                let chunks: Vec<ChunkRef> = (0..=i)
                    .map(|j| ChunkRef { id: ChunkId::of(&[j as u8]), size: 1 << (10 + j) })
                    .collect();
                Manifest {
                    mac: None,
                    format: FORMAT,
                    name: key.to_string(),
                    size: chunks.iter().map(|c| u64::from(c.size)).sum(),
                    created_ms: 1_700_000_000_000,
                    chunking: ChunkParams::default(),
                    meta: BTreeMap::from([
                        ("template".into(), "debian-12".into()),
                        ("sandbox".into(), "sb_\u{e9}\"q\"".into()),
                    ]),
                    chunks,
                }
                .to_json()
            })
            .collect();
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let mut accepted = 0;
        for case in 0..20_000 {
            let mut data = seeds[case % seeds.len()].clone();
            for _ in 0..1 + next() % 3 {
                let at = (next() as usize) % (data.len() + 1);
                match next() % 5 {
                    0 if at < data.len() => data[at] ^= 1 << (next() % 8),
                    1 => data.insert(at, b"{}[]\",:0123456789.e-\\"[next() as usize % 21]),
                    2 if at < data.len() => drop(data.remove(at)),
                    3 => {
                        let other = &seeds[next() as usize % seeds.len()];
                        let from = next() as usize % other.len();
                        let to = (from + 1 + next() as usize % 80).min(other.len());
                        data.splice(at..at, other[from..to].iter().copied());
                    }
                    _ => data.truncate(at),
                }
            }
            for key in &keys {
                let m = match Manifest::parse(key, &data) {
                    Ok(m) => m,
                    Err(StoreError::CorruptManifest { .. }) => continue,
                    Err(StoreError::UnsupportedFormat { found, .. }) => {
                        assert!(found == 0 || found > FORMAT);
                        continue;
                    }
                    Err(e) => panic!("not a manifest error: {e}"),
                };
                accepted += 1;
                assert_eq!(m.name, key.as_str());
                assert_eq!(m.chunks.iter().map(|c| u64::from(c.size)).sum::<u64>(), m.size);
                assert!(m.chunks.len() * 64 <= data.len());
                assert!(m.meta.iter().map(|(k, v)| k.len() + v.len()).sum::<usize>() <= data.len());
                assert_eq!(Manifest::parse(key, &m.to_json()).unwrap(), m);
            }
        }
        assert!(accepted > 500, "only {accepted} accepted: the round trip is barely exercised");
    }
}
