//! The engine's one error enum.

/// What went wrong, and (through the variant) whether retrying can help.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("template {0} not found")]
    TemplateNotFound(String),
    /// The template's content is unusable (corrupt archive, a path escaping the root, ...).
    #[error("bad template: {0}")]
    BadTemplate(String),
    /// A layer entry that would land outside the root (`..`): hostile content, refused.
    #[error("unsafe layer: {0}")]
    Unsafe(String),
    /// An image that unpacks to more than the node allows (a decompression bomb, or just big).
    #[error("too large: {0}")]
    TooLarge(String),
    /// The data directory's filesystem reached the free space the node keeps.
    #[error("disk reserve reached: {0}")]
    DiskFull(String),
    #[error("warmup failed: {0}")]
    WarmupFailed(String),
    #[error("sandbox {0} not found")]
    NotFound(String),
    #[error("sandbox {0} already exists")]
    Exists(String),
    /// The backend lacks this capability.
    #[error("{what} is not supported by the {engine} engine")]
    Unsupported { what: &'static str, engine: &'static str },
    #[error("bad request: {0}")]
    BadRequest(String),
    /// silkd did not answer in time, or died; the sandbox was removed.
    #[error("sandbox did not become ready: {0}")]
    NotReady(String),
    /// Process memory was required and could not be checkpointed (CRIU's reason); the sandbox
    /// is as it was.
    #[error("memory snapshot failed: {0}")]
    MemoryFailed(String),
    /// The host lacks something the engine needs (a cgroup controller, overlayfs, root).
    #[error("host: {0}")]
    Host(String),
    #[error("{context}: {source}")]
    Io { context: String, source: std::io::Error },
}

impl EngineError {
    pub fn io(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> EngineError {
        let context = context.into();
        move |source| EngineError::Io { context, source }
    }
}
