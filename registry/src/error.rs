//! The registry crate's one error enum. Each variant is one thing a user can act on, and the node
//! answers each with its own code (docs/templates.md lists them).

#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    #[error("bad image reference {reference:?}: {reason}")]
    BadReference { reference: String, reason: String },
    #[error("image {0} not found")]
    NotFound(String),
    /// The image exists, but not for the node's platform.
    #[error("image {reference} has no linux/amd64 image (it has: {available})")]
    Platform { reference: String, available: String },
    #[error("registry {registry} refused access: {reason}")]
    Denied { registry: String, reason: String },
    #[error("registry {registry} cannot be reached: {reason}")]
    Unreachable { registry: String, reason: String },
    /// A blob's bytes are not what its digest says (a registry or a store copy is corrupt).
    #[error("blob {expected} arrived with digest {actual}")]
    DigestMismatch { expected: String, actual: String },
    #[error("{what} is {size} bytes, over the cap of {cap}")]
    TooLarge { what: String, size: u64, cap: u64 },
    /// A manifest this node cannot use (a media type it does not unpack, a malformed document).
    #[error("unusable image: {0}")]
    Unsupported(String),
    #[error("disk reserve reached: {0}")]
    DiskFull(String),
    #[error("store: {0}")]
    Store(silk_store::StoreError),
    #[error("{context}: {source}")]
    Io { context: String, source: std::io::Error },
}

impl RegistryError {
    pub(crate) fn io(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> RegistryError {
        let context = context.into();
        move |source| RegistryError::Io { context, source }
    }
}

pub type Result<T, E = RegistryError> = std::result::Result<T, E>;
