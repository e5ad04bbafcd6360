//! One registry to fetch from, and what its answers mean: manifests fetched here with a bound
//! (oci-client reads a manifest whole, and a registry is whatever a template names), and
//! oci-client's and our own errors mapped to [`RegistryError`]s.

use std::sync::Arc;
use std::time::Duration;

use oci_client::errors::{OciDistributionError, OciErrorCode};
use oci_client::secrets::RegistryAuth;
use oci_client::{Client, Reference};

use crate::pull::MAX_DOCUMENT;
use crate::{Digest, RegistryError, Result};

/// How long a manifest may take to arrive whole.
const MANIFEST_WITHIN: Duration = Duration::from_secs(120);

const MANIFEST_TYPES: &[&str] = &[
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
];

/// A registry to fetch from: the reference, its clients and credentials.
pub(crate) struct Remote {
    pub(crate) reference: Reference,
    pub(crate) client: Arc<Client>,
    /// For manifests, read with a bound (see [`Remote::manifest`]).
    pub(crate) http: reqwest::Client,
    pub(crate) scheme: &'static str,
    pub(crate) auth: RegistryAuth,
}

impl Remote {
    /// The manifest the reference names, its digest checked when the reference pins one.
    ///
    /// Fetched here rather than by oci-client, which reads the whole body into memory: a
    /// registry is whatever a template names, so a manifest that never ends must stop at
    /// [`MAX_DOCUMENT`]. Authentication is still oci-client's (it answers the challenge).
    pub(crate) async fn manifest(&self) -> Result<bytes::Bytes> {
        // A whole answer within this, not only each read within the client's read timeout: a
        // registry that trickles a byte a minute holds no pull (and its name's lock) for ever.
        match tokio::time::timeout(MANIFEST_WITHIN, self.fetch_manifest()).await {
            Ok(got) => got,
            Err(_) => Err(RegistryError::Unreachable {
                registry: self.reference.registry().to_string(),
                reason: format!("no whole manifest within {} s", MANIFEST_WITHIN.as_secs()),
            }),
        }
    }

    async fn fetch_manifest(&self) -> Result<bytes::Bytes> {
        let r = &self.reference;
        let token = self
            .client
            .auth(r, &self.auth, oci_client::RegistryOperation::Pull)
            .await
            .map_err(|e| self.error(e))?;
        let at = r.digest().or(r.tag()).unwrap_or("latest");
        let url = format!(
            "{}://{}/v2/{}/manifests/{at}",
            self.scheme,
            r.resolve_registry(),
            r.repository()
        );
        let mut req = self.http.get(url).header("accept", MANIFEST_TYPES.join(", "));
        req = match (token, &self.auth) {
            (Some(token), _) => req.bearer_auth(token),
            (None, RegistryAuth::Basic(user, password)) => req.basic_auth(user, Some(password)),
            (None, _) => req,
        };
        let registry = r.registry().to_string();
        let unreachable = |e: reqwest::Error| RegistryError::Unreachable {
            registry: registry.clone(),
            reason: source_chain(&e),
        };
        let mut res = req.send().await.map_err(unreachable)?;
        let status = res.status().as_u16();
        if status != 200 {
            // What a refusal says, from its first KiB only.
            let mut text = Vec::new();
            while text.len() < 1024 {
                match res.chunk().await {
                    Ok(Some(chunk)) => text.extend_from_slice(&chunk),
                    _ => break,
                }
            }
            text.truncate(1024);
            let text = String::from_utf8_lossy(&text).into_owned();
            // The distribution spec's error codes, where the registry sends them; else the status.
            let says = |code: &str| text.contains(&format!("\"{code}\""));
            return Err(if says("MANIFEST_UNKNOWN") || says("NAME_UNKNOWN") || status == 404 {
                RegistryError::NotFound(r.whole())
            } else if says("UNAUTHORIZED") || says("DENIED") || matches!(status, 401 | 403) {
                RegistryError::Denied {
                    registry: registry.clone(),
                    reason: format!("HTTP {status}: credentials refused or missing"),
                }
            } else {
                let reason = format!("HTTP {status}: {text}");
                RegistryError::Unreachable { registry: registry.clone(), reason }
            });
        }
        let too_large = |size: u64| RegistryError::TooLarge {
            what: format!("manifest of {}", r.whole()),
            size,
            cap: MAX_DOCUMENT,
        };
        if let Some(len) = res.content_length().filter(|&len| len > MAX_DOCUMENT) {
            return Err(too_large(len));
        }
        let mut body = bytes::BytesMut::new();
        while let Some(chunk) = res.chunk().await.map_err(unreachable)? {
            body.extend_from_slice(&chunk);
            if body.len() as u64 > MAX_DOCUMENT {
                return Err(too_large(body.len() as u64));
            }
        }
        let body = body.freeze();
        if let Some(pinned) = r.digest() {
            let actual = Digest::of(&body);
            if actual.to_string() != pinned {
                let expected = pinned.to_string();
                return Err(RegistryError::DigestMismatch { expected, actual: actual.to_string() });
            }
        }
        Ok(body)
    }

    pub(crate) fn error(&self, e: OciDistributionError) -> RegistryError {
        use OciDistributionError as E;
        let registry = self.reference.registry().to_string();
        let image = self.reference.whole();
        let denied = |reason: String| RegistryError::Denied { registry: registry.clone(), reason };
        let unreachable =
            |reason: String| RegistryError::Unreachable { registry: registry.clone(), reason };
        match e {
            E::AuthenticationFailure(r) => denied(r),
            E::UnauthorizedError { .. } => denied("credentials refused or missing".into()),
            E::ImageManifestNotFoundError(_) => RegistryError::NotFound(image),
            E::RegistryError { envelope, .. } => {
                let codes: Vec<&OciErrorCode> = envelope.errors.iter().map(|e| &e.code).collect();
                let text = envelope.to_string();
                use OciErrorCode::*;
                if codes.iter().any(|c| matches!(c, Unauthorized | Denied)) {
                    denied(text)
                } else if codes
                    .iter()
                    .any(|c| matches!(c, ManifestUnknown | NameUnknown | BlobUnknown | NotFound))
                {
                    RegistryError::NotFound(image)
                } else if codes.iter().any(|c| matches!(c, Toomanyrequests)) {
                    unreachable(text)
                } else {
                    RegistryError::Unsupported(text)
                }
            }
            E::ServerError { code, message, .. } => match code {
                401 | 403 => denied(message),
                404 => RegistryError::NotFound(image),
                _ => unreachable(format!("HTTP {code}: {message}")),
            },
            E::RequestError(e) => unreachable(source_chain(&e)),
            E::DigestError(d) => RegistryError::Unsupported(d.to_string()),
            E::IoError(e) => self.stream_error(e),
            other => RegistryError::Unsupported(other.to_string()),
        }
    }

    /// An error while a blob streams: a digest the registry's bytes did not match, or the
    /// connection.
    pub(crate) fn stream_error(&self, e: std::io::Error) -> RegistryError {
        if let Some(oci_client::errors::DigestError::VerificationError { expected, actual }) =
            e.get_ref().and_then(|i| i.downcast_ref())
        {
            return RegistryError::DigestMismatch {
                expected: expected.clone(),
                actual: actual.clone(),
            };
        }
        let registry = self.reference.registry().to_string();
        RegistryError::Unreachable { registry, reason: source_chain(&e) }
    }
}

/// An error with its causes ("error sending request: connection refused"), which is what
/// tells a user why.
fn source_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut at = e.source();
    while let Some(cause) = at {
        text = format!("{text}: {cause}");
        at = cause.source();
    }
    text
}
