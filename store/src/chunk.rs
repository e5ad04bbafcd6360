//! Chunks: content-defined cutting (a gear hash tested at 512-byte offsets) and blake3 names.
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

/// Chunk size bounds in bytes, each a multiple of [`GRID`]. The defaults (256 KiB / 1 MiB /
/// 4 MiB) keep a 1 GiB snapshot at about a thousand chunks: few enough requests per snapshot,
/// small enough that an edit costs about a megabyte.
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

/// Chunks end only at multiples of this many bytes from the stream's start (or at its end).
///
/// Every stream we store is a tar (a sandbox's files, goldens, the memory entry with CRIU's
/// images inside it, whose pages are 4 KiB each), and a tar moves its contents only by whole
/// 512-byte blocks: a file added, grown or removed shifts everything after it by a multiple of
/// 512, and so does a page added to a memory image. Testing for a cut at those offsets only
/// finds the same cuts after such a shift as a byte-by-byte scan would, for an eighth of the
/// hashing: the scan over every byte was the critical path of a large checkpoint (~108 ms of a
/// 256 MiB one, on one core). A shift by another amount inside one file re-aligns at the next
/// tar entry.
pub const GRID: usize = 512;

/// The bytes before a candidate offset that decide whether it is a cut: a gear hash of them.
const WINDOW: usize = 64;

/// Cuts a byte stream into content-defined chunks (normalized chunking as in FastCDC: a
/// stricter test before the average size, a looser one after it).
#[derive(Clone, Debug)]
pub struct Chunker {
    params: ChunkParams,
    /// Cut where the hash's top `bits_s` bits are zero (before `avg`), `bits_l` after it.
    bits_s: u32,
    bits_l: u32,
}

/// 256 random 64-bit words (blake3's output stream of a fixed label): the gear hash's table.
/// Changing them only moves cut points, which costs dedup against older snapshots.
fn gear() -> &'static [u64; 256] {
    static GEAR: std::sync::OnceLock<[u64; 256]> = std::sync::OnceLock::new();
    GEAR.get_or_init(|| {
        let mut bytes = [0u8; 256 * 8];
        blake3::Hasher::new_derive_key("silkmesh 2026-12 chunk gear")
            .finalize_xof()
            .fill(&mut bytes);
        std::array::from_fn(|i| u64::from_le_bytes(bytes[i * 8..i * 8 + 8].try_into().unwrap()))
    })
}

/// Candidates whose windows are hashed together.
const LANES: usize = 8;

/// The gear hashes of the windows before `at`, `at + GRID`, … (`lanes` of them; the lanes
/// past those repeat the last).
fn window_hashes(buf: &[u8], at: usize, lanes: usize) -> [u64; LANES] {
    let gear = gear();
    let window = |k: usize| -> &[u8; WINDOW] {
        let end = at + k.min(lanes - 1) * GRID;
        buf[end - WINDOW..end].try_into().expect("a window is WINDOW bytes")
    };
    let windows: [&[u8; WINDOW]; LANES] = std::array::from_fn(window);
    let mut h = [0u64; LANES];
    for i in 0..WINDOW {
        for k in 0..LANES {
            h[k] = (h[k] << 1).wrapping_add(gear[windows[k][i] as usize]);
        }
    }
    h
}

impl Chunker {
    pub fn new(params: ChunkParams) -> Result<Chunker> {
        let ChunkParams { min, avg, max } = params;
        let grid = GRID as u32;
        // Below 32 KiB on average a chunk spans too few candidates for the looser test.
        let ok = min >= grid
            && (32 * 1024..=4 << 20).contains(&avg)
            && max <= 16 << 20
            && min < avg
            && avg < max
            && [min, avg, max].iter().all(|v| v % grid == 0);
        if !ok {
            return Err(StoreError::InvalidConfig(format!(
                "chunk sizes {min}/{avg}/{max}: need multiples of {GRID} with min < avg < max, \
                 avg in 32KiB..=4MiB and max at most 16MiB"
            )));
        }
        // One candidate per GRID bytes: about 1 in avg/GRID of them is a cut.
        let bits = (avg / grid).ilog2();
        Ok(Chunker { params, bits_s: bits + 1, bits_l: bits - 1 })
    }

    pub fn params(&self) -> ChunkParams {
        self.params
    }

    /// The length of the first chunk of `buf`. Unless `buf` is the end of the stream it must hold
    /// at least `max` bytes, so the cut cannot depend on bytes not yet read. `buf` must start at
    /// a multiple of [`GRID`] from the stream's start (every earlier cut is one).
    pub fn cut(&self, buf: &[u8]) -> usize {
        let p = self.params;
        let (min, avg, max) = (p.min as usize, p.avg as usize, p.max as usize);
        let end = buf.len().min(max);
        let mut at = min;
        while at < end {
            // Eight candidates at a time: their windows are hashed side by side, so eight
            // independent chains (and eight cache misses on a cold buffer) are in flight where
            // one candidate after another would wait on each.
            let lanes = ((end - at).div_ceil(GRID)).min(LANES);
            let hashes = window_hashes(buf, at, lanes);
            for (k, h) in hashes[..lanes].iter().enumerate() {
                let cut = at + k * GRID;
                let bits = if cut < avg { self.bits_s } else { self.bits_l };
                // The top bits of a gear hash mix every byte of the window.
                if h >> (64 - bits) == 0 {
                    return cut;
                }
            }
            at += lanes * GRID;
        }
        end
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
        let c = Chunker::new(SMALL).unwrap();
        let data = noise(1, 12 << 20);
        let lens = c.lengths(&data);
        assert_eq!(lens.iter().sum::<usize>(), data.len());
        for l in &lens[..lens.len() - 1] {
            assert!((16384..=262144).contains(l), "chunk of {l} bytes");
            assert_eq!(l % GRID, 0, "a chunk that ends off the grid");
        }
        let avg = data.len() / lens.len();
        assert!((32768..=131072).contains(&avg), "average {avg}");
    }

    const SMALL: ChunkParams = ChunkParams { min: 16384, avg: 65536, max: 262144 };

    fn ids(c: &Chunker, d: &[u8]) -> std::collections::HashSet<ChunkId> {
        let mut at = 0;
        c.lengths(d)
            .into_iter()
            .map(|n| {
                at += n;
                ChunkId::of(&d[at - n..at])
            })
            .collect()
    }

    #[test]
    fn an_edit_changes_only_nearby_chunks() {
        let c = Chunker::new(SMALL).unwrap();
        let a = noise(2, 8 << 20);
        let mut b = a.clone();
        b[4 << 20] ^= 0xff;
        let (ia, ib) = (ids(&c, &a), ids(&c, &b));
        assert!(ia.len() > 50, "{} chunks", ia.len());
        assert!(ib.difference(&ia).count() <= 2, "one flipped byte changed more than two chunks");
    }

    /// What a tar does when a file before others grows, and a memory image when a page is
    /// added: everything after moves by whole blocks.
    #[test]
    fn blocks_inserted_or_removed_change_only_nearby_chunks() {
        let c = Chunker::new(SMALL).unwrap();
        let a = noise(3, 8 << 20);
        for (at, shift) in [(3 << 20, 4096), (5 << 20, 512), (1 << 20, 3 * 512)] {
            let mut b = a[..at].to_vec();
            b.extend(noise(4, shift));
            b.extend(&a[at..]);
            let (ia, ib) = (ids(&c, &a), ids(&c, &b));
            assert!(ib.difference(&ia).count() <= 2, "{shift} bytes inserted at {at}");
            let mut b = a[..at].to_vec();
            b.extend(&a[at + shift..]);
            assert!(ids(&c, &b).difference(&ia).count() <= 2, "{shift} bytes removed at {at}");
        }
    }

    /// Zeros (a sparse file's holes, untouched pages) cut at the upper bound, not at every
    /// candidate.
    #[test]
    fn a_run_of_zeros_is_cut_at_the_upper_bound() {
        let c = Chunker::new(SMALL).unwrap();
        let lens = c.lengths(&vec![0; 2 << 20]);
        assert!(lens.iter().all(|&n| n == 262144), "{lens:?}");
    }

    #[test]
    fn bad_bounds_are_refused() {
        assert!(Chunker::new(ChunkParams { min: 1, avg: 2, max: 3 }).is_err());
        assert!(Chunker::new(ChunkParams { min: 8192, avg: 4096, max: 65536 }).is_err());
        assert!(Chunker::new(ChunkParams { min: 16384, avg: 65536 + 2, max: 262144 }).is_err());
        assert!(Chunker::new(ChunkParams { min: 16384, avg: 16384 * 3, max: 1 << 30 }).is_err());
        assert!(Chunker::new(ChunkParams::default()).is_ok());
    }
}
