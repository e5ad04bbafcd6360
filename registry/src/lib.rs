//! Images pulled by reference (`python:3.12`, `ghcr.io/org/base:v4`, `…@sha256:…`) from any
//! OCI-distribution registry, for templates.
//!
//! - [`Puller::resolve`] turns a reference into the digest of its linux/amd64 image manifest
//!   (through an image index when the reference names one). A template pins that digest, so a
//!   tag that moves changes nothing until the template is refreshed.
//! - [`Puller::pull`] fetches the pinned manifest, the image config and every layer into the
//!   node's [`LayerCache`]. A layer comes from the cache, else from the object store
//!   (`images/sha256/<hex>`, where the first node of a fleet to pull it put it), else from the
//!   registry, and then goes to the store. Every blob's digest is checked on arrival, whichever
//!   the source: a registry and a store are both outside the node.
//!
//! The registry protocol's blobs and authentication (the bearer-token challenge, basic auth)
//! are `oci-client`'s. Manifests this crate fetches itself, with oci-client's credentials:
//! oci-client reads a manifest whole into memory, and a registry is whatever a template names,
//! so a manifest is read no further than 4 MiB and within 120 s. It parses them itself too, so
//! a platform that is missing and a media type it cannot unpack are errors of their own.

mod auth;
mod cache;
mod digest;
mod error;
mod pull;
mod remote;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::AtomicU64;

use serde::{Deserialize, Serialize};

pub use cache::{Held, LayerCache};
pub use digest::Digest;
pub use error::{RegistryError, Result};
pub use pull::Puller;

/// One registry's settings: `[registries."HOST:PORT"]` in the node's config.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RegistrySettings {
    /// Plain HTTP (a registry on a private network without TLS).
    pub insecure: bool,
    /// A PEM file of CA certificates the registry's TLS certificate is checked against, besides
    /// the system's.
    pub ca: Option<PathBuf>,
    /// Basic-auth (or token-server) user; the password is read from `password_env`.
    pub username: Option<String>,
    /// The environment variable holding `username`'s password (default
    /// `SANDBOXD_REGISTRY_PASSWORD`).
    pub password_env: Option<String>,
}

#[derive(Debug, Clone, Default)]
pub struct Settings {
    /// By registry host (`docker.io`, `ghcr.io`, `127.0.0.1:5000`).
    pub registries: BTreeMap<String, RegistrySettings>,
    /// A docker `config.json` with credentials (see `auth`).
    pub auth_file: Option<PathBuf>,
    /// Pull only from the registries in `registries`: an image named elsewhere is refused
    /// before any connection is made.
    pub only_listed: bool,
    /// The most compressed bytes one image's layers may add up to.
    pub max_image_bytes: u64,
}

/// The bytes a pull has fetched so far, of how many (both grow as the manifest is read).
#[derive(Debug, Default)]
pub struct Progress {
    pub done: AtomicU64,
    pub total: AtomicU64,
}

/// Where a pull's layers came from, for reports and tests.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Sources {
    pub cache: u32,
    pub store: u32,
    pub registry: u32,
}

/// How a layer blob is compressed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Compression {
    None,
    Gzip,
    Zstd,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Layer {
    pub digest: String,
    pub path: PathBuf,
    pub compression: Compression,
}

/// A pulled image: every part in the node's layer cache, digests checked.
#[derive(Debug, Clone)]
pub struct Pulled {
    /// The image manifest's digest.
    pub digest: Digest,
    /// The image config (JSON), as the registry holds it.
    pub config: Vec<u8>,
    /// Bottom layer first.
    pub layers: Vec<Layer>,
    pub sources: Sources,
    /// Keeps the image's blobs in the layer cache until it is unpacked (drop it then).
    pub held: Vec<Held>,
}
