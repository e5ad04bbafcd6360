//! Chunks: content-defined cutting (FastCDC 2020) and blake3 names.
//!
//! A cut point depends only on the bytes around it, so an edit in the middle of a snapshot
//! stream changes the chunks that overlap the edit and leaves every other chunk — and its name —
//! as it was. That is what makes the second snapshot of a sandbox cost only what changed.

use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::{Key, Result, StoreError};

/// Where chunks live in the store: `chunks/<blake3 hex>`.
pub const CHUNK_PREFIX: &str = "chunks/";

/// A chunk's name: the blake3 hash of its bytes.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ChunkId([u8; 32]);

impl ChunkId {
    pub fn of(data: &[u8]) -> ChunkId {
        ChunkId(*blake3::hash(data).as_bytes())
    }

    /// The chunk's object key, `chunks/<hex>`.
    pub fn key(&self) -> Key {
        // Hex digits after a fixed prefix always make a valid key.
        Key::new(format!("{CHUNK_PREFIX}{self}")).expect("a chunk key is always valid")
    }

    /// The id named by a chunk key, if it is one.
    pub fn from_key(key: &Key) -> Option<ChunkId> {
        key.as_str().strip_prefix(CHUNK_PREFIX)?.parse().ok()
    }

    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    pub fn from_bytes(bytes: [u8; 32]) -> ChunkId {
        ChunkId(bytes)
    }
}

impl fmt::Display for ChunkId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for b in self.0 {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for ChunkId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ChunkId({self})")
    }
}

impl std::str::FromStr for ChunkId {
    type Err = StoreError;
    fn from_str(s: &str) -> Result<ChunkId> {
        let bad =
            || StoreError::InvalidKey { key: s.to_string(), reason: "not a blake3 hex digest" };
        if s.len() != 64 || !s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
            return Err(bad());
        }
        let mut out = [0u8; 32];
        for (i, byte) in out.iter_mut().enumerate() {
            *byte = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).map_err(|_| bad())?;
        }
        Ok(ChunkId(out))
    }
}

impl Serialize for ChunkId {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for ChunkId {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<ChunkId, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// Chunk size bounds in bytes. The defaults (256 KiB / 1 MiB / 4 MiB) keep a 1 GiB snapshot at
/// about a thousand chunks: few enough requests per snapshot, small enough that an edit costs
/// about a megabyte.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChunkParams {
    pub min: u32,
    pub avg: u32,
    pub max: u32,
}

impl Default for ChunkParams {
    fn default() -> ChunkParams {
        ChunkParams { min: 256 * 1024, avg: 1024 * 1024, max: 4 * 1024 * 1024 }
    }
}

/// Cuts a byte stream into content-defined chunks.
#[derive(Clone, Debug)]
pub struct Chunker {
    params: ChunkParams,
    mask_s: u64,
    mask_l: u64,
}

impl Chunker {
    pub fn new(params: ChunkParams) -> Result<Chunker> {
        use fastcdc::v2020 as cdc;
        let ChunkParams { min, avg, max } = params;
        let (min_, avg_, max_) = (min as usize, avg as usize, max as usize);
        let ok = (cdc::MINIMUM_MIN..=cdc::MINIMUM_MAX).contains(&min_)
            && (cdc::AVERAGE_MIN..=cdc::AVERAGE_MAX).contains(&avg_)
            && (cdc::MAXIMUM_MIN..=cdc::MAXIMUM_MAX).contains(&max_)
            && min < avg
            && avg < max
            // FastCDC tests candidates in pairs: odd bounds would shift them by a byte.
            && [min, avg, max].iter().all(|v| v % 2 == 0);
        if !ok {
            return Err(StoreError::InvalidConfig(format!(
                "chunk sizes {min}/{avg}/{max}: need even min < avg < max with min in 64..=1MiB, \
                 avg in 256..=4MiB, max in 1KiB..=16MiB"
            )));
        }
        let (mask_s, mask_l) = cdc::select_masks(avg_, cdc::Normalization::Level1);
        Ok(Chunker { params, mask_s, mask_l })
    }

    pub fn params(&self) -> ChunkParams {
        self.params
    }

    /// The length of the first chunk of `buf`. Unless `buf` is the end of the stream it must hold
    /// at least `max` bytes, so the cut cannot depend on bytes not yet read.
    pub fn cut(&self, buf: &[u8]) -> usize {
        let p = self.params;
        let (_, len) = fastcdc::v2020::cut(
            buf,
            p.min as usize,
            p.avg as usize,
            p.max as usize,
            self.mask_s,
            self.mask_l,
            self.mask_s << 1,
            self.mask_l << 1,
        );
        len
    }

    /// Every chunk of an in-memory buffer, as lengths.
    pub fn lengths(&self, mut data: &[u8]) -> Vec<usize> {
        let mut out = Vec::new();
        while !data.is_empty() {
            let n = self.cut(data);
            out.push(n);
            data = &data[n..];
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn noise(seed: u8, len: usize) -> Vec<u8> {
        let mut out = vec![0; len];
        blake3::Hasher::new().update(&[seed]).finalize_xof().fill(&mut out);
        out
    }

    #[test]
    fn ids_round_trip_through_hex_and_keys() {
        let id = ChunkId::of(b"hello");
        assert_eq!(id.to_string(), blake3::hash(b"hello").to_hex().as_str());
        assert_eq!(id.to_string().parse::<ChunkId>().unwrap(), id);
        assert_eq!(ChunkId::from_key(&id.key()), Some(id));
        assert!("zz".parse::<ChunkId>().is_err());
        assert!(id.to_string().to_uppercase().parse::<ChunkId>().is_err());
    }

    #[test]
    fn chunks_respect_the_bounds_and_cover_the_input() {
        let c = Chunker::new(ChunkParams { min: 4096, avg: 16384, max: 65536 }).unwrap();
        let data = noise(1, 3 << 20);
        let lens = c.lengths(&data);
        assert_eq!(lens.iter().sum::<usize>(), data.len());
        for l in &lens[..lens.len() - 1] {
            assert!((4096..=65536).contains(l), "chunk of {l} bytes");
        }
        let avg = data.len() / lens.len();
        assert!((8192..=32768).contains(&avg), "average {avg}");
    }

    #[test]
    fn an_edit_changes_only_nearby_chunks() {
        let c = Chunker::new(ChunkParams { min: 4096, avg: 16384, max: 65536 }).unwrap();
        let a = noise(2, 2 << 20);
        let mut b = a.clone();
        b[1 << 20] ^= 0xff;
        let ids = |d: &[u8]| {
            let mut at = 0;
            c.lengths(d)
                .into_iter()
                .map(|n| {
                    at += n;
                    ChunkId::of(&d[at - n..at])
                })
                .collect::<std::collections::HashSet<_>>()
        };
        let (ia, ib) = (ids(&a), ids(&b));
        assert!(ib.difference(&ia).count() <= 2, "one flipped byte changed more than two chunks");
    }

    #[test]
    fn bad_bounds_are_refused() {
        assert!(Chunker::new(ChunkParams { min: 1, avg: 2, max: 3 }).is_err());
        assert!(Chunker::new(ChunkParams { min: 8192, avg: 4096, max: 65536 }).is_err());
        assert!(Chunker::new(ChunkParams::default()).is_ok());
    }
}
