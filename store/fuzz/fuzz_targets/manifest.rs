//! Feeds arbitrary bytes to the snapshot manifest parser (`store/src/manifest.rs`, compiled here
//! on its own with the chunk names it reads and stand-ins for the crate's key and error types).
//! The contract: no panic; a manifest it accepts adds up and names its key, serializes to bytes
//! that parse to the same manifest, and holds no more than its bytes spelled out (the format is
//! JSON, so no length field can make the parser allocate ahead of the data).
#![no_main]

use libfuzzer_sys::fuzz_target;

#[allow(dead_code)]
#[path = "../../src/chunk.rs"]
mod chunk;
#[allow(dead_code)]
#[path = "../../src/manifest.rs"]
mod manifest;

use manifest::{FORMAT, Manifest};

pub type Result<T, E = StoreError> = std::result::Result<T, E>;

/// The variants of the store's error that the two modules make.
#[derive(Debug)]
pub enum StoreError {
    InvalidKey { key: String, reason: &'static str },
    CorruptManifest { key: String, reason: String },
    UnsupportedFormat { key: String, found: u32, supported: u32 },
    InvalidConfig(String),
}

impl std::fmt::Display for StoreError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{self:?}")
    }
}

/// An object key; the fuzzer only ever uses valid ones, so no check.
#[derive(Debug)]
pub struct Key(String);

impl Key {
    pub fn new(key: impl Into<String>) -> Result<Key> {
        Ok(Key(key.into()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

const KEYS: [&str; 4] =
    ["goldens/host-small-none/a1b2", "checkpoints/ck_x9", "archives/ar_y8", "templates/debian-12"];

fuzz_target!(|data: &[u8]| {
    let Some((&which, bytes)) = data.split_first() else { return };
    let key = Key::new(KEYS[usize::from(which) % KEYS.len()]).unwrap();
    let m = match Manifest::parse(&key, bytes) {
        Ok(m) => m,
        Err(StoreError::CorruptManifest { .. }) => return,
        Err(StoreError::UnsupportedFormat { found, .. }) => {
            return assert!(found == 0 || found > FORMAT);
        }
        Err(e) => panic!("parse failed with {e:?}, not a manifest error"),
    };
    assert!((1..=FORMAT).contains(&m.format));
    assert_eq!(m.name, key.as_str());
    assert_eq!(m.chunks.iter().map(|c| u64::from(c.size)).sum::<u64>(), m.size);
    // Each chunk is spelled out with its 64-digit name; metadata strings only shrink when read.
    assert!(m.chunks.len() * 64 <= bytes.len());
    assert!(m.meta.iter().map(|(k, v)| k.len() + v.len()).sum::<usize>() <= bytes.len());
    let again = m.to_json();
    assert_eq!(Manifest::parse(&key, &again).expect("a written manifest parses"), m);
});
