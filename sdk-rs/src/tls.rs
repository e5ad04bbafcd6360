//! TLS to the node (`https://` addresses): the roots a client trusts (a private CA's PEM, or the
//! system's), an optional client certificate for nodes that require one, and the relay's own
//! TLS connections, which offer only HTTP/1.1 (the relay is an HTTP/1.1 upgrade).

use std::path::Path;
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio::net::TcpStream;

use crate::error::{Error, Result};

/// Where a client's TLS trust and identity come from.
#[derive(Debug, Clone, Default)]
pub(crate) struct TlsOptions {
    /// A PEM file of the CA certificates to trust instead of the system's.
    pub(crate) ca: Option<std::path::PathBuf>,
    /// A client certificate chain and its key (PEM), for nodes with `[tls] client_ca`.
    pub(crate) identity: Option<(std::path::PathBuf, std::path::PathBuf)>,
}

fn read(path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|e| Error::Invalid(format!("read {}: {e}", path.display())))
}

fn invalid(path: &Path, e: impl std::fmt::Display) -> Error {
    Error::Invalid(format!("{}: {e}", path.display()))
}

/// The client config for `options`, offering only HTTP/1.1.
pub(crate) fn client_config(options: &TlsOptions) -> Result<Arc<rustls::ClientConfig>> {
    let mut roots = rustls::RootCertStore::empty();
    match &options.ca {
        Some(ca) => {
            for cert in CertificateDer::pem_slice_iter(&read(ca)?) {
                roots.add(cert.map_err(|e| invalid(ca, e))?).map_err(|e| invalid(ca, e))?;
            }
            if roots.is_empty() {
                return Err(Error::Invalid(format!("{} holds no certificate", ca.display())));
            }
        }
        None => {
            let found = rustls_native_certs::load_native_certs();
            let (added, _) = roots.add_parsable_certificates(found.certs);
            if added == 0 {
                return Err(Error::Invalid(
                    "no system CA certificates found: name the node's CA (SBX_CA, --ca)".into(),
                ));
            }
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| Error::Invalid(format!("tls: {e}")))?
        .with_root_certificates(roots);
    let mut config = match &options.identity {
        Some((cert, key)) => {
            let chain = CertificateDer::pem_slice_iter(&read(cert)?)
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| invalid(cert, e))?;
            let key = PrivateKeyDer::from_pem_slice(&read(key)?).map_err(|e| invalid(key, e))?;
            builder.with_client_auth_cert(chain, key).map_err(|e| invalid(cert, e))?
        }
        None => builder.with_no_client_auth(),
    };
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// A config for a client whose base is `http://`: it refuses every redirect to `https://`,
/// so this is never used to connect.
pub(crate) fn unused_config() -> rustls::ClientConfig {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("ring supports the default versions")
        .with_root_certificates(rustls::RootCertStore::empty())
        .with_no_client_auth()
}

/// TLS over a dialled socket to `host` (a DNS name or an IP address).
pub(crate) async fn connect(
    config: &Arc<rustls::ClientConfig>,
    host: &str,
    tcp: TcpStream,
) -> Result<tokio_rustls::client::TlsStream<TcpStream>> {
    // An IPv6 host comes bracketed in a URL's authority.
    let name = host.trim_start_matches('[').trim_end_matches(']').to_string();
    let name = ServerName::try_from(name)
        .map_err(|e| Error::Invalid(format!("TLS server name {host:?}: {e}")))?;
    tokio_rustls::TlsConnector::from(config.clone())
        .connect(name, tcp)
        .await
        .map_err(|e| Error::transport(format!("TLS handshake with {host}"), e))
}
