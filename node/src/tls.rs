//! TLS on the API: the server config a node's `[tls]` section names, and the development
//! certificates `sandboxd tls self-signed` writes.
//!
//! The API offers HTTP/2 and HTTP/1.1 by ALPN (TLS 1.2 and 1.3). The relay is an HTTP/1.1
//! upgrade, so clients that want it offer only `http/1.1` on that connection. With `client_ca`
//! set, every client must present a certificate that CA signed (mutual TLS) before any request.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, IsCa, KeyPair, KeyUsagePurpose,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

use crate::config::TlsSection;

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn read(path: &Path) -> anyhow::Result<Vec<u8>> {
    std::fs::read(path).map_err(|e| anyhow::anyhow!("tls: read {}: {e}", path.display()))
}

/// The rustls server config for `[tls]`: its chain and key, and client verification when
/// `client_ca` is set.
pub fn server_config(tls: &TlsSection) -> anyhow::Result<Arc<rustls::ServerConfig>> {
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&read(&tls.cert)?)
        .collect::<Result<_, _>>()
        .map_err(|e| anyhow::anyhow!("tls: {}: {e}", tls.cert.display()))?;
    if chain.is_empty() {
        anyhow::bail!("tls: {} holds no certificate", tls.cert.display());
    }
    let key = PrivateKeyDer::from_pem_slice(&read(&tls.key)?)
        .map_err(|e| anyhow::anyhow!("tls: {}: {e}", tls.key.display()))?;
    let builder = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?;
    let builder = match &tls.client_ca {
        Some(ca) => {
            let mut roots = rustls::RootCertStore::empty();
            for cert in CertificateDer::pem_slice_iter(&read(ca)?) {
                roots.add(cert.map_err(|e| anyhow::anyhow!("tls: {}: {e}", ca.display()))?)?;
            }
            let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                Arc::new(roots),
                provider(),
            )
            .build()?;
            builder.with_client_cert_verifier(verifier)
        }
        None => builder.with_no_client_auth(),
    };
    let mut config = builder.with_single_cert(chain, key).map_err(|e| {
        anyhow::anyhow!("tls: {} and {}: {e}", tls.cert.display(), tls.key.display())
    })?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// What `sandboxd tls self-signed` wrote.
#[derive(Debug)]
pub struct DevCert {
    /// The CA clients trust (`SBX_CA`, `--ca`).
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// Writes a development CA (`ca.pem`, `ca.key`) unless `dir` has one, and a server certificate
/// it signed for `names` (DNS names or IP addresses): `<first name>.pem` and `.key` (keys mode
/// 0600). Refuses to overwrite a certificate.
pub fn self_signed(dir: &Path, names: &[String]) -> anyhow::Result<DevCert> {
    let Some(first) = names.first() else { anyhow::bail!("give at least one --name") };
    if names.iter().any(|n| n.is_empty() || n.contains(['/', '\0'])) {
        anyhow::bail!("names are DNS names or IP addresses");
    }
    std::fs::create_dir_all(dir)?;
    let (ca_pem, ca_key_path) = (dir.join("ca.pem"), dir.join("ca.key"));
    let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, "silkmesh development CA");
    ca_params.distinguished_name = dn;
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let ca_key = if ca_key_path.exists() {
        KeyPair::from_pem(&std::fs::read_to_string(&ca_key_path)?)?
    } else {
        let key = KeyPair::generate()?;
        write_new(&ca_key_path, &key.serialize_pem(), 0o600)?;
        write_new(&ca_pem, &ca_params.clone().self_signed(&key)?.pem(), 0o644)?;
        key
    };
    // The issuer needs only the CA's name and key: rebuild it rather than parse the PEM.
    let issuer = ca_params.self_signed(&ca_key)?;
    let mut params = CertificateParams::new(names.to_vec())?;
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, first.as_str());
    params.distinguished_name = dn;
    let key = KeyPair::generate()?;
    let cert = params.signed_by(&key, &issuer, &ca_key)?;
    let (cert_path, key_path) =
        (dir.join(format!("{first}.pem")), dir.join(format!("{first}.key")));
    write_new(&key_path, &key.serialize_pem(), 0o600)?;
    write_new(&cert_path, &cert.pem(), 0o644)?;
    Ok(DevCert { ca: ca_pem, cert: cert_path, key: key_path })
}

fn write_new(path: &Path, data: &str, mode: u32) -> anyhow::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(path)
        .map_err(|e| anyhow::anyhow!("create {}: {e}", path.display()))?;
    Ok(f.write_all(data.as_bytes())?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dev_cert_loads_as_a_server_config_and_is_never_overwritten() {
        let dir = tempfile::tempdir().unwrap();
        let names = ["127.0.0.1".to_string(), "localhost".to_string()];
        let dev = self_signed(dir.path(), &names).unwrap();
        let tls = TlsSection { cert: dev.cert.clone(), key: dev.key.clone(), client_ca: None };
        let config = server_config(&tls).unwrap();
        assert_eq!(config.alpn_protocols, [b"h2".to_vec(), b"http/1.1".to_vec()]);
        assert!(self_signed(dir.path(), &names).is_err(), "overwrote a certificate");
        // A second certificate from the same CA.
        let other = self_signed(dir.path(), &["node-b".to_string()]).unwrap();
        assert_eq!(other.ca, dev.ca);
        let with_ca = TlsSection { client_ca: Some(dev.ca), ..tls };
        server_config(&with_ca).unwrap();
    }
}
