//! Resolving and pulling images. See the crate docs for the order of sources.

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::{StreamExt, TryStreamExt};
use oci_client::client::{Certificate, CertificateEncoding, ClientConfig, ClientProtocol};
use oci_client::manifest::OciDescriptor;
use oci_client::{Client, Reference};
use serde::Deserialize;
use silk_store::{Key, ObjectStore, StoreError};

use crate::remote::Remote;
use crate::{
    Compression, Digest, Layer, LayerCache, Progress, Pulled, RegistryError, Result, Settings,
    Sources, auth,
};

/// Manifests and image configs are small; a larger one is refused before it is read whole.
pub(crate) const MAX_DOCUMENT: u64 = 4 << 20;
/// Blobs fetched at once in one pull (a registry's usual per-client allowance).
const PARALLEL: usize = 3;
/// Where the fleet keeps the blobs its nodes pulled, by digest.
const STORE_PREFIX: &str = "images/sha256/";

pub struct Puller {
    settings: Settings,
    cache: LayerCache,
    store: Option<Arc<dyn ObjectStore>>,
    /// Clients per registry host: each keeps that registry's tokens and connections.
    clients: Mutex<HashMap<String, Clients>>,
}

impl std::fmt::Debug for Puller {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Puller").field("settings", &self.settings).finish_non_exhaustive()
    }
}

/// The parts of a manifest or an image index this node reads.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Document {
    #[serde(default)]
    media_type: Option<String>,
    manifests: Option<Vec<Entry>>,
    config: Option<Descriptor>,
    #[serde(default)]
    layers: Vec<Descriptor>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Entry {
    digest: String,
    #[serde(default)]
    platform: Option<Platform>,
}

#[derive(Debug, Default, Deserialize)]
struct Platform {
    #[serde(default)]
    os: String,
    #[serde(default)]
    architecture: String,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Descriptor {
    media_type: String,
    digest: String,
    size: u64,
}

/// One registry's clients: oci-client's (its tokens and connections), and a plain one.
#[derive(Clone)]
struct Clients {
    oci: Arc<Client>,
    http: reqwest::Client,
    scheme: &'static str,
}

/// What a blob is, for the registry's two endpoints.
#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Manifest,
    Blob,
}

fn parse(reference: &str) -> Result<Reference> {
    reference.parse::<Reference>().map_err(|e| RegistryError::BadReference {
        reference: reference.into(),
        reason: e.to_string(),
    })
}

fn document(bytes: &[u8]) -> Result<Document> {
    serde_json::from_slice(bytes).map_err(|e| RegistryError::Unsupported(format!("manifest: {e}")))
}

fn compression(media_type: &str) -> Result<Compression> {
    Ok(match media_type {
        "application/vnd.oci.image.layer.v1.tar"
        | "application/vnd.docker.image.rootfs.diff.tar" => Compression::None,
        "application/vnd.oci.image.layer.v1.tar+gzip"
        | "application/vnd.docker.image.rootfs.diff.tar.gzip" => Compression::Gzip,
        "application/vnd.oci.image.layer.v1.tar+zstd" => Compression::Zstd,
        other => return Err(RegistryError::Unsupported(format!("layer media type {other}"))),
    })
}

impl Puller {
    pub fn new(settings: Settings, cache: LayerCache, store: Option<Arc<dyn ObjectStore>>) -> Self {
        Puller { settings, cache, store, clients: Mutex::default() }
    }

    /// The digest of `reference`'s linux/amd64 image manifest.
    pub async fn resolve(&self, reference: &str) -> Result<Digest> {
        let remote = self.remote(parse(reference)?)?;
        let body = remote.manifest().await?;
        let doc = document(&body)?;
        let Some(entries) = doc.manifests else {
            image_layers(&doc)?;
            return Ok(Digest::of(&body));
        };
        let amd64 = |p: &Platform| p.os == "linux" && p.architecture == "amd64";
        let Some(entry) = entries.iter().find(|e| e.platform.as_ref().is_some_and(amd64)) else {
            let available: Vec<String> = entries
                .iter()
                .filter_map(|e| e.platform.as_ref())
                .map(|p| format!("{}/{}", p.os, p.architecture))
                .collect();
            let available = if available.is_empty() { "none".into() } else { available.join(", ") };
            return Err(RegistryError::Platform { reference: reference.into(), available });
        };
        let digest = Digest::parse(&entry.digest)?;
        let child =
            Remote { reference: remote.reference.clone_with_digest(digest.to_string()), ..remote };
        image_layers(&document(&child.manifest().await?)?)?;
        Ok(digest)
    }

    /// Pulls the image manifest `digest` of `reference`'s repository, with its config and layers.
    pub async fn pull(
        &self,
        reference: &str,
        digest: &Digest,
        progress: &Progress,
    ) -> Result<Pulled> {
        let reference = parse(reference)?.clone_with_digest(digest.to_string());
        let remote = self.remote(reference)?;
        let mut sources = Sources::default();
        let mut held = vec![self.cache.hold([digest.clone()])];
        let (path, from) = self.fetch(&remote, Kind::Manifest, digest, MAX_DOCUMENT, None).await?;
        sources.count(from);
        let doc = document(&read(&path)?)?;
        let layers = image_layers(&doc)?;
        let config = doc.config.ok_or_else(|| RegistryError::Unsupported("no config".into()))?;
        // Sizes are the registry's word: a sum past u64 is over any cap, not a wrap below it.
        let total = layers.iter().try_fold(config.size, |sum, (d, _)| sum.checked_add(d.size));
        let cap = self.settings.max_image_bytes;
        let total = match total {
            Some(total) if total <= cap => total,
            _ => {
                let what = format!("image {}", remote.reference.whole());
                let size = total.unwrap_or(u64::MAX);
                return Err(RegistryError::TooLarge { what, size, cap });
            }
        };
        progress.total.store(total, Ordering::Relaxed);

        let config_digest = Digest::parse(&config.digest)?;
        let layer_digests = layers.iter().map(|(d, _)| Digest::parse(&d.digest));
        held.push(self.cache.hold(layer_digests.collect::<Result<Vec<_>>>()?));
        held.push(self.cache.hold([config_digest.clone()]));
        let (path, from) =
            self.fetch(&remote, Kind::Blob, &config_digest, MAX_DOCUMENT, Some(progress)).await?;
        sources.count(from);
        let config = read(&path)?;
        check_platform(&config, &remote.reference)?;

        let fetched: Vec<(Layer, Source)> = futures_util::stream::iter(layers)
            .map(|(desc, compression)| {
                let remote = &remote;
                async move {
                    let digest = Digest::parse(&desc.digest)?;
                    let (path, from) =
                        self.fetch(remote, Kind::Blob, &digest, desc.size, Some(progress)).await?;
                    Ok::<_, RegistryError>((Layer { digest: desc.digest, path, compression }, from))
                }
            })
            .buffered(PARALLEL)
            .try_collect()
            .await?;
        let mut keep: HashSet<Digest> = [digest.clone(), config_digest].into();
        for (layer, from) in &fetched {
            sources.count(*from);
            keep.insert(Digest::parse(&layer.digest)?);
        }
        let freed = self.cache.gc(&keep);
        if freed > 0 {
            tracing::info!(
                freed_mib = freed >> 20,
                "layer cache: least recently used blobs removed"
            );
        }
        let layers = fetched.into_iter().map(|(l, _)| l).collect();
        Ok(Pulled { digest: digest.clone(), config, layers, sources, held })
    }

    /// The blob `digest` in the layer cache: from there, else the store, else the registry.
    async fn fetch(
        &self,
        remote: &Remote,
        kind: Kind,
        digest: &Digest,
        cap: u64,
        progress: Option<&Progress>,
    ) -> Result<(PathBuf, Source)> {
        let add = |n: u64| {
            if let Some(p) = progress {
                p.done.fetch_add(n, Ordering::Relaxed);
            }
        };
        if let Some(path) = self.cache.get(digest) {
            add(std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0));
            return Ok((path, Source::Cache));
        }
        let key = Key::new(format!("{STORE_PREFIX}{}", digest.hex()))
            .map_err(|e| RegistryError::Unsupported(e.to_string()))?;
        if let Some(store) = &self.store {
            // What this fetch counted from the store, taken back if the registry must serve
            // it (other fetches of the pull count beside it).
            let counted = std::sync::atomic::AtomicU64::new(0);
            let add_counted = |n: u64| {
                counted.fetch_add(n, Ordering::Relaxed);
                add(n);
            };
            match self.fetch_from_store(store.as_ref(), &key, digest, cap, &add_counted).await {
                Ok(path) => return Ok((path, Source::Store)),
                Err(e @ (RegistryError::DiskFull(_) | RegistryError::Io { .. })) => return Err(e),
                Err(RegistryError::Store(StoreError::NotFound { .. })) => {}
                Err(e) => tracing::warn!(%key, "store copy unusable: {e}; using the registry"),
            }
            if let Some(p) = progress {
                p.done.fetch_sub(counted.into_inner(), Ordering::Relaxed);
            }
        }
        let mut staged = self.cache.stage(digest, cap)?;
        if kind == Kind::Manifest {
            staged.write(&remote.manifest().await?)?;
        } else {
            let desc = OciDescriptor { digest: digest.to_string(), ..Default::default() };
            let mut body = remote
                .client
                .pull_blob_stream(&remote.reference, &desc)
                .await
                .map_err(|e| remote.error(e))?;
            while let Some(bytes) = body.next().await {
                let bytes = bytes.map_err(|e| remote.stream_error(e))?;
                staged.write(&bytes)?;
                add(bytes.len() as u64);
            }
        }
        let path = staged.finish()?;
        if let Some(store) = &self.store {
            // Shared for the fleet's other nodes; a failure here costs them a registry pull.
            if let Err(e) = store.put(&key, file_stream(&path).await?).await {
                tracing::warn!(%key, "sharing a pulled blob through the store: {e}");
            }
        }
        Ok((path, Source::Registry))
    }

    async fn fetch_from_store(
        &self,
        store: &dyn ObjectStore,
        key: &Key,
        digest: &Digest,
        cap: u64,
        add: &impl Fn(u64),
    ) -> Result<PathBuf> {
        let got = store.get(key, None).await?;
        if got.len > cap {
            let what = format!("blob {digest}");
            return Err(RegistryError::TooLarge { what, size: got.len, cap });
        }
        let mut staged = self.cache.stage(digest, cap)?;
        let mut body = got.body;
        while let Some(bytes) = body.next().await {
            let bytes = bytes?;
            staged.write(&bytes)?;
            add(bytes.len() as u64);
        }
        staged.finish()
    }

    fn remote(&self, reference: Reference) -> Result<Remote> {
        let registry = reference.registry().to_string();
        let settings = self.settings.registries.get(&registry);
        if settings.is_none() && self.settings.only_listed {
            let reason = "not one of this node's [registries] (only_listed_registries)".into();
            return Err(RegistryError::Denied { registry, reason });
        }
        let auth = auth::credentials(&registry, settings, self.settings.auth_file.as_ref())?;
        let mut clients = self.clients.lock().unwrap_or_else(|e| e.into_inner());
        let c = match clients.get(&registry) {
            Some(c) => c.clone(),
            None => {
                let connect = Duration::from_secs(5);
                let read = Duration::from_secs(60);
                let mut config = ClientConfig {
                    connect_timeout: Some(connect),
                    read_timeout: Some(read),
                    ..Default::default()
                };
                let mut http = reqwest::Client::builder()
                    .connect_timeout(connect)
                    .read_timeout(read)
                    .user_agent(concat!("silkmesh-sandboxd/", env!("CARGO_PKG_VERSION")));
                let mut scheme = "https";
                if let Some(s) = settings {
                    if s.insecure {
                        config.protocol = ClientProtocol::Http;
                        scheme = "http";
                    }
                    if let Some(ca) = &s.ca {
                        let data = std::fs::read(ca)
                            .map_err(RegistryError::io(format!("read {}", ca.display())))?;
                        let bad_ca = |e: reqwest::Error| {
                            RegistryError::Unsupported(format!("ca {}: {e}", ca.display()))
                        };
                        http = http.tls_certs_merge(
                            reqwest::Certificate::from_pem_bundle(&data).map_err(bad_ca)?,
                        );
                        let cert = Certificate { encoding: CertificateEncoding::Pem, data };
                        config.extra_root_certificates.push(cert);
                    }
                }
                let http = http.build().map_err(|e| RegistryError::Unsupported(e.to_string()))?;
                let c = Clients { oci: Arc::new(Client::new(config)), http, scheme };
                clients.insert(registry, c.clone());
                c
            }
        };
        Ok(Remote { reference, client: c.oci, http: c.http, scheme: c.scheme, auth })
    }
}

#[derive(Debug, Clone, Copy)]
enum Source {
    Cache,
    Store,
    Registry,
}

impl Sources {
    fn count(&mut self, from: Source) {
        match from {
            Source::Cache => self.cache += 1,
            Source::Store => self.store += 1,
            Source::Registry => self.registry += 1,
        }
    }
}

/// A file as a store upload body, read a MiB at a time.
async fn file_stream(path: &std::path::Path) -> Result<silk_store::ByteStream> {
    use tokio::io::AsyncReadExt;
    let file =
        tokio::fs::File::open(path).await.map_err(RegistryError::io("open a cached blob"))?;
    Ok(Box::pin(futures_util::stream::unfold(Some(file), |file| async move {
        let mut file = file?;
        let mut buf = bytes::BytesMut::with_capacity(1 << 20);
        match file.read_buf(&mut buf).await {
            Ok(0) => None,
            Ok(_) => Some((Ok(buf.freeze()), Some(file))),
            Err(e) => Some((
                Err(StoreError::Io { context: "read a cached blob".into(), source: e }),
                None,
            )),
        }
    })))
}

fn read(path: &std::path::Path) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(RegistryError::io("read a cached blob"))
}

/// An image manifest's layers with their compression; anything else is unusable here.
fn image_layers(doc: &Document) -> Result<Vec<(Descriptor, Compression)>> {
    if doc.manifests.is_some() || doc.config.is_none() {
        let kind = doc.media_type.as_deref().unwrap_or("no media type");
        return Err(RegistryError::Unsupported(format!("not an image manifest ({kind})")));
    }
    doc.layers.iter().map(|l| Ok((l.clone(), compression(&l.media_type)?))).collect()
}

/// An image built for another platform is refused even when it is not behind an index.
fn check_platform(config: &[u8], reference: &Reference) -> Result<()> {
    let c: Platform = serde_json::from_slice(config)
        .map_err(|e| RegistryError::Unsupported(format!("image config: {e}")))?;
    let os_ok = c.os.is_empty() || c.os == "linux";
    let arch_ok = c.architecture.is_empty() || c.architecture == "amd64";
    if os_ok && arch_ok {
        return Ok(());
    }
    let available = format!("{}/{}", c.os, c.architecture);
    Err(RegistryError::Platform { reference: reference.whole(), available })
}

impl From<StoreError> for RegistryError {
    fn from(e: StoreError) -> RegistryError {
        RegistryError::Store(e)
    }
}
