//! The cluster's certificates and the mutual-TLS configs built from them.
//!
//! One CA per cluster (`ca.pem`, `ca.key`); every node holds a certificate signed by it
//! (`<name>.pem`, `<name>.key`) with the SAN `silkmesh` (the name every node dials) and its own
//! name. Both sides of every connection (QUIC, and the bulk lane's TLS over TCP) present a
//! certificate and verify the other's against the CA: a peer without one cannot complete a
//! handshake, so it cannot send a single packet that reaches the membership layer. A
//! certificate also binds its holder to its node name: a node dials a peer by that peer's name,
//! and a packet or state that says it comes from node N is accepted only on a connection whose
//! certificate names N ([`names_node`]), so a cluster member cannot speak for another.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, IsCa, KeyPair, KeyUsagePurpose,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};

use crate::MeshError;

/// The TLS server name every node presents and dials.
pub const SERVER_NAME: &str = "silkmesh";
/// ALPN of the mesh protocol.
pub const ALPN: &[u8] = b"silkmesh/1";
const CA_NAME: &str = "silkmesh cluster CA";

fn bad(what: impl std::fmt::Display) -> MeshError {
    MeshError::Tls(what.to_string())
}

fn write_new(path: &Path, data: &str, mode: u32) -> Result<(), MeshError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(path)
        .map_err(|e| bad(format!("create {}: {e}", path.display())))?;
    f.write_all(data.as_bytes()).map_err(|e| bad(format!("write {}: {e}", path.display())))
}

fn ca_params() -> Result<CertificateParams, MeshError> {
    let mut params = CertificateParams::new(Vec::<String>::new()).map_err(bad)?;
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, CA_NAME);
    params.distinguished_name = dn;
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    Ok(params)
}

/// Creates `dir/ca.pem` and `dir/ca.key` (mode 0600). Refuses to overwrite.
pub fn init_ca(dir: &Path) -> Result<PathBuf, MeshError> {
    std::fs::create_dir_all(dir).map_err(|e| bad(format!("mkdir {}: {e}", dir.display())))?;
    let key = KeyPair::generate().map_err(bad)?;
    let cert = ca_params()?.self_signed(&key).map_err(bad)?;
    write_new(&dir.join("ca.key"), &key.serialize_pem(), 0o600)?;
    write_new(&dir.join("ca.pem"), &cert.pem(), 0o644)?;
    Ok(dir.join("ca.pem"))
}

/// Whether `name` can be a node's name: 1-64 of `a-z A-Z 0-9 - .`, a DNS name (it is one in the
/// certificate), and not `silkmesh` (which every certificate carries).
pub fn valid_node_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.')
        && !name.eq_ignore_ascii_case(SERVER_NAME)
        && matches!(ServerName::try_from(name), Ok(ServerName::DnsName(_)))
}

/// Whether a peer's certificate chain (as its QUIC connection reports it) was issued to node
/// `name`. The handshake already checked that the cluster CA signed it.
pub fn names_node(chain: &[CertificateDer<'_>], name: &str) -> bool {
    if !valid_node_name(name) {
        return false;
    }
    let (Some(leaf), Ok(subject)) = (chain.first(), ServerName::try_from(name)) else {
        return false;
    };
    webpki::EndEntityCert::try_from(leaf)
        .is_ok_and(|cert| cert.verify_is_valid_for_subject_name(&subject).is_ok())
}

/// Checks that this node's own certificate was issued to `name`: peers would drop everything
/// it sends otherwise.
pub fn check_own(files: &TlsFiles, name: &str) -> Result<(), MeshError> {
    let (_, chain, _) = load(files)?;
    if names_node(&chain, name) {
        return Ok(());
    }
    Err(bad(format!(
        "{} is not a certificate for node {name:?}: issue one with `sandboxd mesh cert issue --node {name}`",
        files.cert.display()
    )))
}

/// The certificate chain the peer of a QUIC connection presented.
pub fn peer_chain(conn: &quinn::Connection) -> Vec<CertificateDer<'static>> {
    conn.peer_identity()
        .and_then(|id| id.downcast::<Vec<CertificateDer<'static>>>().ok())
        .map(|chain| *chain)
        .unwrap_or_default()
}

/// How long a node certificate is valid when nothing else is said.
pub const DEFAULT_DAYS: u32 = 90;

/// Issues `dir/<name>.pem` and `dir/<name>.key` for node `name`, signed by `dir/ca.*`, valid
/// for `days` from now (and an hour before, for clocks a little behind). Refuses to overwrite
/// (see [`renew`]).
pub fn issue(dir: &Path, name: &str, days: u32) -> Result<(PathBuf, PathBuf), MeshError> {
    let (cert, key) = signed(dir, name, days)?;
    let (pem, key_path) = (dir.join(format!("{name}.pem")), dir.join(format!("{name}.key")));
    write_new(&key_path, &key, 0o600)?;
    write_new(&pem, &cert, 0o644)?;
    Ok((pem, key_path))
}

/// Replaces node `name`'s certificate and key with new ones (a new key, serial and validity):
/// each file is swapped whole by a rename. A running node picks them up by itself.
pub fn renew(dir: &Path, name: &str, days: u32) -> Result<(PathBuf, PathBuf), MeshError> {
    let (cert, key) = signed(dir, name, days)?;
    let (pem, key_path) = (dir.join(format!("{name}.pem")), dir.join(format!("{name}.key")));
    for (path, data, mode) in [(&key_path, &key, 0o600), (&pem, &cert, 0o644)] {
        let tmp = path.with_extension("new");
        let _ = std::fs::remove_file(&tmp);
        write_new(&tmp, data, mode)?;
        std::fs::rename(&tmp, path).map_err(|e| bad(format!("rename {}: {e}", tmp.display())))?;
    }
    Ok((pem, key_path))
}

/// The serial number of the certificate in `pem`, as hex (what a revocation list names).
pub fn serial_hex(pem: &Path) -> Result<String, MeshError> {
    let der = CertificateDer::from_pem_file(pem).map_err(bad)?;
    let serial = crate::trust::serial_of(&der).ok_or_else(|| bad("no serial number"))?;
    Ok(serial.iter().map(|b| format!("{b:02x}")).collect())
}

/// A certificate for node `name` and its new key, as PEM.
fn signed(dir: &Path, name: &str, days: u32) -> Result<(String, String), MeshError> {
    if !valid_node_name(name) {
        return Err(bad(format!(
            "node name {name:?}: 1-64 of a-z A-Z 0-9 - . forming a DNS name, not {SERVER_NAME:?}"
        )));
    }
    let ca_key = std::fs::read_to_string(dir.join("ca.key"))
        .map_err(|e| bad(format!("read {}: {e}", dir.join("ca.key").display())))?;
    let ca_key = KeyPair::from_pem(&ca_key).map_err(bad)?;
    // The issuer needs only the CA's name and key: rebuild it rather than parse the PEM.
    let issuer = ca_params()?.self_signed(&ca_key).map_err(bad)?;
    let mut params =
        CertificateParams::new(vec![SERVER_NAME.to_string(), name.to_string()]).map_err(bad)?;
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, name);
    params.distinguished_name = dn;
    let now = time::OffsetDateTime::now_utc();
    params.not_before = now - time::Duration::hours(1);
    params.not_after = now + time::Duration::days(i64::from(days));
    // A random serial (positive: the top bit clear), so a revocation names one certificate.
    let mut serial = [0u8; 16];
    let mut rng = <rand::rngs::StdRng as rand::SeedableRng>::from_os_rng();
    rand::RngCore::fill_bytes(&mut rng, &mut serial);
    serial[0] &= 0x7f;
    params.serial_number = Some(rcgen::SerialNumber::from_slice(&serial));
    let key = KeyPair::generate().map_err(bad)?;
    let cert = params.signed_by(&key, &issuer, &ca_key).map_err(bad)?;
    Ok((cert.pem(), key.serialize_pem()))
}

/// Where a node finds its certificates.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TlsFiles {
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn load(
    files: &TlsFiles,
) -> Result<(rustls::RootCertStore, Vec<CertificateDer<'static>>, PrivateKeyDer<'static>), MeshError>
{
    let read = |p: &Path| std::fs::read(p).map_err(|e| bad(format!("read {}: {e}", p.display())));
    let mut roots = rustls::RootCertStore::empty();
    for ca in CertificateDer::pem_slice_iter(&read(&files.ca)?) {
        roots.add(ca.map_err(bad)?).map_err(bad)?;
    }
    let chain: Vec<_> = CertificateDer::pem_slice_iter(&read(&files.cert)?)
        .collect::<Result<_, _>>()
        .map_err(bad)?;
    let key = PrivateKeyDer::from_pem_slice(&read(&files.key)?).map_err(bad)?;
    Ok((roots, chain, key))
}

/// A node's mutual-TLS configs: QUIC's, and the bulk lane's (TLS over TCP, [`crate::bulk`]).
/// Both are the same checks: TLS 1.3, both sides authenticated by the CA (its signature and
/// the validity period) and checked against the revocation list; only the ALPN differs, so a
/// connection made for one lane is refused by the other.
#[derive(Debug, Clone)]
pub struct Configs {
    pub quic_server: quinn::ServerConfig,
    pub quic_client: quinn::ClientConfig,
    pub bulk_server: Arc<rustls::ServerConfig>,
    pub bulk_client: Arc<rustls::ClientConfig>,
}

/// See [`Configs`].
pub fn configs(
    files: &TlsFiles,
    revoked: &crate::trust::RevocationList,
) -> Result<Configs, MeshError> {
    let (roots, chain, key) = load(files)?;
    let roots = Arc::new(roots);
    let verifier =
        rustls::server::WebPkiClientVerifier::builder_with_provider(roots.clone(), provider())
            .build()
            .map_err(bad)?;
    let verifier = Arc::new(crate::trust::ClientCheck { inner: verifier, list: revoked.clone() });
    let server_check =
        rustls::client::WebPkiServerVerifier::builder_with_provider(roots, provider())
            .build()
            .map_err(bad)?;
    let server_check =
        Arc::new(crate::trust::ServerCheck { inner: server_check, list: revoked.clone() });
    let mut server = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(bad)?
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain.clone(), key.clone_key())
        .map_err(bad)?;
    let mut client = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(bad)?
        .dangerous()
        .with_custom_certificate_verifier(server_check)
        .with_client_auth_cert(chain, key)
        .map_err(bad)?;
    let alpn = |protocol: &[u8]| vec![protocol.to_vec()];
    let (mut bulk_server, mut bulk_client) = (server.clone(), client.clone());
    bulk_server.alpn_protocols = alpn(crate::bulk::ALPN);
    bulk_client.alpn_protocols = alpn(crate::bulk::ALPN);
    server.alpn_protocols = alpn(ALPN);
    client.alpn_protocols = alpn(ALPN);

    let server = quinn::crypto::rustls::QuicServerConfig::try_from(server).map_err(bad)?;
    let client = quinn::crypto::rustls::QuicClientConfig::try_from(client).map_err(bad)?;
    let mut transport = quinn::TransportConfig::default();
    transport
        .keep_alive_interval(Some(std::time::Duration::from_secs(1)))
        .max_idle_timeout(Some(std::time::Duration::from_secs(10).try_into().map_err(bad)?))
        .datagram_receive_buffer_size(Some(1 << 20));
    let transport = Arc::new(transport);
    let mut quic_server = quinn::ServerConfig::with_crypto(Arc::new(server));
    quic_server.transport_config(transport.clone());
    let mut quic_client = quinn::ClientConfig::new(Arc::new(client));
    quic_client.transport_config(transport);
    Ok(Configs {
        quic_server,
        quic_client,
        bulk_server: Arc::new(bulk_server),
        bulk_client: Arc::new(bulk_client),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_names_are_dns_names_other_than_the_shared_one() {
        for ok in ["a", "n1", "node-7.eu", "A1"] {
            assert!(valid_node_name(ok), "{ok}");
        }
        for bad in ["", "silkmesh", "SilkMesh", "a_b", "a b", "-a", "a..b", &"x".repeat(65)] {
            assert!(!valid_node_name(bad), "{bad:?}");
        }
    }
}
