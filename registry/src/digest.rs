//! Content digests as registries name blobs (`sha256:<64 hex>`). A digest comes from a registry
//! or the store, so it is hostile until parsed here: only then does it name a file or a key.

use std::fmt;

use sha2::{Digest as _, Sha256};

use crate::{RegistryError, Result};

#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Digest {
    /// 64 lowercase hex digits.
    hex: String,
}

impl Digest {
    pub fn parse(s: &str) -> Result<Digest> {
        let hex = s.strip_prefix("sha256:").filter(|h| {
            h.len() == 64 && h.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        });
        match hex {
            Some(hex) => Ok(Digest { hex: hex.to_string() }),
            None => Err(RegistryError::Unsupported(format!("digest {s:?} is not sha256:<64 hex>"))),
        }
    }

    pub fn of(bytes: &[u8]) -> Digest {
        Digest { hex: hex(&Sha256::digest(bytes)) }
    }

    pub fn hex(&self) -> &str {
        &self.hex
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

impl fmt::Display for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "sha256:{}", self.hex)
    }
}

impl fmt::Debug for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// A running sha256 over bytes as they stream past.
#[derive(Default)]
pub(crate) struct Hasher(Sha256);

impl fmt::Debug for Hasher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Hasher")
    }
}

impl Hasher {
    pub(crate) fn update(&mut self, bytes: &[u8]) {
        self.0.update(bytes);
    }

    pub(crate) fn finish(self) -> Digest {
        Digest { hex: hex(&self.0.finalize()) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_sha256_of_64_lowercase_hex_digits_is_a_digest() {
        let ok = format!("sha256:{}", "a1".repeat(32));
        assert_eq!(Digest::parse(&ok).unwrap().to_string(), ok);
        for bad in [
            "sha256:../../etc/passwd".to_string(),
            format!("sha512:{}", "a1".repeat(32)),
            format!("sha256:{}", "A1".repeat(32)),
            format!("sha256:{}", "a1".repeat(31)),
            format!("sha256:{}/", "a1".repeat(32)),
            "a1".repeat(32),
        ] {
            assert!(Digest::parse(&bad).is_err(), "{bad}");
        }
        assert_eq!(
            Digest::of(b"").to_string(),
            "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
    }
}
