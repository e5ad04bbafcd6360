//! Revocation: certificates the cluster CA signed that must no longer be accepted. A list of
//! node names and certificate serials (`[mesh] revoked`, one per line: a node name, or
//! `serial:<hex>`; `#` starts a comment), re-read when it changes, is checked at every handshake
//! in both directions on top of the CA's signature and the validity period; connections of a
//! newly revoked node are closed (see the driver).

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::SystemTime;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::{DigitallySignedStruct, DistinguishedName, SignatureScheme};

/// What is revoked now.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Revoked {
    pub names: HashSet<String>,
    /// Serial numbers as their DER integer bytes, leading zeros trimmed.
    pub serials: HashSet<Vec<u8>>,
}

impl Revoked {
    /// Parses the list's text; a bad line is an error naming it.
    pub fn parse(text: &str) -> Result<Revoked, String> {
        let mut r = Revoked::default();
        for (n, line) in text.lines().enumerate() {
            let line = line.split('#').next().unwrap_or("").trim();
            if line.is_empty() {
                continue;
            }
            match line.strip_prefix("serial:") {
                Some(hex) => {
                    let hex: String = hex.chars().filter(|c| *c != ':').collect();
                    let bytes = (0..hex.len())
                        .step_by(2)
                        .map(|i| u8::from_str_radix(hex.get(i..i + 2).unwrap_or("x"), 16))
                        .collect::<Result<Vec<u8>, _>>()
                        .map_err(|_| format!("line {}: {line:?} is not serial:<hex>", n + 1))?;
                    r.serials.insert(trim(&bytes).to_vec());
                }
                None if crate::tls::valid_node_name(line) => {
                    r.names.insert(line.to_string());
                }
                None => return Err(format!("line {}: {line:?} is no node name", n + 1)),
            }
        }
        Ok(r)
    }

    /// Whether the leaf of `chain` is revoked, by its serial or a node name it carries.
    pub fn covers(&self, chain: &[CertificateDer<'_>]) -> bool {
        let Some(leaf) = chain.first() else { return false };
        if serial_of(leaf).is_some_and(|s| self.serials.contains(trim(s))) {
            return true;
        }
        self.names.iter().any(|n| crate::tls::names_node(chain, n))
    }
}

fn trim(serial: &[u8]) -> &[u8] {
    let zeros = serial.iter().take_while(|b| **b == 0).count();
    &serial[zeros.min(serial.len().saturating_sub(1))..]
}

/// One DER element at the front of `der`: (tag, contents, what follows).
fn element(der: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let (&tag, rest) = der.split_first()?;
    let (&first, rest) = rest.split_first()?;
    let (len, rest) = if first < 0x80 {
        (first as usize, rest)
    } else {
        let n = (first & 0x7f) as usize;
        if n == 0 || n > 4 || rest.len() < n {
            return None;
        }
        let len = rest[..n].iter().fold(0usize, |acc, b| (acc << 8) | *b as usize);
        (len, &rest[n..])
    };
    (rest.len() >= len).then(|| (tag, &rest[..len], &rest[len..]))
}

/// The serial number of a DER certificate: `Certificate.tbsCertificate.serialNumber`.
pub fn serial_of(der: &[u8]) -> Option<&[u8]> {
    const SEQUENCE: u8 = 0x30;
    let (SEQUENCE, cert, _) = element(der)? else { return None };
    let (SEQUENCE, tbs, _) = element(cert)? else { return None };
    let (tag, value, rest) = element(tbs)?;
    // `[0] EXPLICIT Version` comes first when present.
    let (tag, value) =
        if tag == 0xa0 { element(rest).map(|(t, v, _)| (t, v))? } else { (tag, value) };
    (tag == 0x02).then_some(value)
}

/// The revocation list a node watches: its file and what it said when last read.
#[derive(Debug, Clone)]
pub struct RevocationList {
    path: Option<PathBuf>,
    state: Arc<RwLock<(Option<SystemTime>, Revoked)>>,
}

impl RevocationList {
    /// The list in `path` (none: nothing is revoked). A list that does not parse stops the
    /// start; later, a bad edit keeps the last good list (and is logged).
    pub fn open(path: Option<&Path>) -> Result<RevocationList, String> {
        let list = RevocationList { path: path.map(Path::to_path_buf), state: Arc::default() };
        list.reload()?;
        Ok(list)
    }

    pub fn revoked(&self) -> Revoked {
        self.state.read().unwrap_or_else(|e| e.into_inner()).1.clone()
    }

    pub fn covers(&self, chain: &[CertificateDer<'_>]) -> bool {
        self.state.read().unwrap_or_else(|e| e.into_inner()).1.covers(chain)
    }

    /// Re-reads the file if it changed; whether the list changed.
    pub fn reload(&self) -> Result<bool, String> {
        let Some(path) = &self.path else { return Ok(false) };
        let modified = std::fs::metadata(path).and_then(|m| m.modified()).ok();
        if modified.is_some() && modified == self.state.read().unwrap_or_else(|e| e.into_inner()).0
        {
            return Ok(false);
        }
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            // No file: nothing revoked (yet).
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
            Err(e) => return Err(format!("{}: {e}", path.display())),
        };
        let revoked = Revoked::parse(&text).map_err(|e| format!("{}: {e}", path.display()))?;
        let mut state = self.state.write().unwrap_or_else(|e| e.into_inner());
        let changed = state.1 != revoked;
        *state = (modified, revoked);
        Ok(changed)
    }
}

fn revoked_error() -> rustls::Error {
    rustls::Error::InvalidCertificate(rustls::CertificateError::Revoked)
}

/// The CA's verification of a peer acting as server, then the revocation list.
#[derive(Debug)]
pub struct ServerCheck {
    pub inner: Arc<rustls::client::WebPkiServerVerifier>,
    pub list: RevocationList,
}

impl ServerCertVerifier for ServerCheck {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let ok = self.inner.verify_server_cert(
            end_entity,
            intermediates,
            server_name,
            ocsp_response,
            now,
        )?;
        if self.list.covers(std::slice::from_ref(end_entity)) {
            return Err(revoked_error());
        }
        Ok(ok)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

/// The CA's verification of a peer acting as client, then the revocation list.
#[derive(Debug)]
pub struct ClientCheck {
    pub inner: Arc<dyn ClientCertVerifier>,
    pub list: RevocationList,
}

impl ClientCertVerifier for ClientCheck {
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        self.inner.root_hint_subjects()
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        let ok = self.inner.verify_client_cert(end_entity, intermediates, now)?;
        if self.list.covers(std::slice::from_ref(end_entity)) {
            return Err(revoked_error());
        }
        Ok(ok)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_name_nodes_and_serials_and_refuse_garbage() {
        let r = Revoked::parse("# revoked\nn3\nserial:00:0a:ff  # old n1\n\n").unwrap();
        assert!(r.names.contains("n3"));
        assert!(r.serials.contains(&vec![0x0a, 0xff]));
        assert!(Revoked::parse("serial:xyz").is_err());
        assert!(Revoked::parse("not a name").is_err());
    }

    #[test]
    fn the_serial_is_read_from_an_issued_certificate() {
        let dir = tempfile::tempdir().unwrap();
        crate::tls::init_ca(dir.path()).unwrap();
        let (pem, _) = crate::tls::issue(dir.path(), "n1", 90).unwrap();
        use rustls::pki_types::pem::PemObject;
        let der = CertificateDer::from_pem_file(&pem).unwrap();
        let serial = serial_of(&der).unwrap().to_vec();
        assert!(!serial.is_empty());
        let chain = [der];
        let by_serial = Revoked::parse(&format!(
            "serial:{}",
            serial.iter().map(|b| format!("{b:02x}")).collect::<String>()
        ))
        .unwrap();
        assert!(by_serial.covers(&chain));
        assert!(Revoked::parse("n1").unwrap().covers(&chain));
        assert!(!Revoked::parse("n2\nserial:01").unwrap().covers(&chain));
    }
}
