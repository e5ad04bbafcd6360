//! The API over TLS against a real sandboxd with a private CA (`sandboxd tls self-signed`): the
//! SDK's JSON calls and its relay (exec, files, a reused connection), `sbx` with `--ca`, HTTP/2
//! by ALPN, a client that does not trust the CA or speaks plain HTTP refused, mutual TLS, and a
//! redirect from https to http never followed (the token would go out in clear text).

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use common::*;
use silkmesh::{Client, Error};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

struct DevCert {
    ca: PathBuf,
    cert: PathBuf,
    key: PathBuf,
}

/// `sandboxd tls self-signed --dir dir --name <names>...`
fn dev_cert(dir: &Path, names: &[&str]) -> DevCert {
    let mut cmd = Command::new(sibling("sandboxd"));
    cmd.args(["tls", "self-signed", "--dir"]).arg(dir);
    for n in names {
        cmd.args(["--name", n]);
    }
    let out = cmd.output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    DevCert {
        ca: dir.join("ca.pem"),
        cert: dir.join(format!("{}.pem", names[0])),
        key: dir.join(format!("{}.key", names[0])),
    }
}

fn tls_toml(cert: &DevCert, client_ca: Option<&Path>) -> String {
    let mut t = format!("[tls]\ncert = {:?}\nkey = {:?}\n", cert.cert, cert.key);
    if let Some(ca) = client_ca {
        t += &format!("client_ca = {ca:?}\n");
    }
    t
}

#[tokio::test(flavor = "multi_thread")]
async fn the_sdk_and_sbx_speak_https_to_a_node_with_a_private_ca() {
    let dir = tempfile::tempdir().unwrap();
    let cert = dev_cert(dir.path(), &["127.0.0.1", "localhost"]);
    let node = Sandboxd::start(&format!("{ONE_WARM}{}", tls_toml(&cert, None)));
    let url = format!("https://{}", node.addr);

    let client = Client::builder(&url).token(ROOT).ca_file(&cert.ca).build().unwrap();
    let sb = client.claim("host").send().await.unwrap();
    let out = sb.exec(["sh", "-c", "echo over-tls"]).run().await.unwrap();
    assert_eq!(out.stdout_str(), "over-tls\n");
    sb.write("/tmp/f", &b"tls bytes"[..]).await.unwrap();
    assert_eq!(&sb.read("/tmp/f").await.unwrap()[..], b"tls bytes");
    let stats = sb.connection_stats();
    assert!(stats.reused >= 1, "relay connections over TLS are kept and reused: {stats:?}");
    assert_eq!(client.list().await.unwrap().len(), 1);

    // The name in the URL must be on the certificate: `localhost` is, as given.
    let by_name = format!("https://localhost:{}", node.addr.port());
    let named = Client::builder(by_name).token(ROOT).ca_file(&cert.ca).build().unwrap();
    assert_eq!(named.list().await.unwrap().len(), 1);

    // A client that does not trust the CA, or speaks plain HTTP to the TLS port, gets nothing.
    if let Ok(system) = Client::builder(&url).token(ROOT).build() {
        let e = system.list().await.unwrap_err();
        assert!(matches!(e, Error::Transport { .. }), "{e:?}");
    }
    let plain = Client::builder(node.url()).token(ROOT).build().unwrap();
    assert!(plain.list().await.is_err(), "plain HTTP on the TLS port");

    // HTTP/2 by ALPN, on a JSON route.
    let (alpn, status) = h2_request(node.addr, &cert.ca, "/v1/info").await;
    assert_eq!((alpn.as_deref(), status), (Some(&b"h2"[..]), 200));

    // sbx with --ca (and SBX_CA).
    let sbx = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_sbx"))
            .env("SBX_ADDR", &url)
            .env("SBX_TOKEN", ROOT)
            .env_remove("SBX_CA")
            .args(args)
            .output()
            .unwrap();
        (out.status.code(), String::from_utf8_lossy(&out.stdout).into_owned(), out.stderr)
    };
    let ca = cert.ca.to_str().unwrap();
    let (code, stdout, stderr) = sbx(&["--ca", ca, "exec", sb.id(), "--", "echo", "sbx-tls"]);
    assert_eq!(code, Some(0), "{}", String::from_utf8_lossy(&stderr));
    assert_eq!(stdout, "sbx-tls\n");
    let (code, _, _) = sbx(&["ls"]);
    assert_ne!(code, Some(0), "sbx without the CA trusts only the system's");
    sb.release().await.unwrap();
}

/// One HTTP/2 request over TLS offering `h2` and `http/1.1`: the protocol the node chose, and
/// the answer's status.
async fn h2_request(addr: std::net::SocketAddr, ca: &Path, path: &str) -> (Option<Vec<u8>>, u16) {
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    for c in rustls::pki_types::CertificateDer::pem_file_iter(ca).unwrap() {
        roots.add(c.unwrap()).unwrap();
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let name = rustls::pki_types::ServerName::try_from("127.0.0.1").unwrap();
    let tls = tokio_rustls::TlsConnector::from(Arc::new(config)).connect(name, tcp).await.unwrap();
    let alpn = tls.get_ref().1.alpn_protocol().map(<[u8]>::to_vec);
    let io = hyper_util::rt::TokioIo::new(tls);
    let (mut send, conn) =
        hyper::client::conn::http2::handshake(hyper_util::rt::TokioExecutor::new(), io)
            .await
            .unwrap();
    tokio::spawn(conn);
    let req = hyper::Request::get(format!("https://{addr}{path}"))
        .header("authorization", format!("Bearer {ROOT}"))
        .body(http_body_util::Empty::<bytes::Bytes>::new())
        .unwrap();
    let res = send.send_request(req).await.unwrap();
    (alpn, res.status().as_u16())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_node_that_requires_client_certificates_refuses_clients_without_one() {
    let dir = tempfile::tempdir().unwrap();
    let cert = dev_cert(dir.path(), &["127.0.0.1"]);
    let client_cert = dev_cert(dir.path(), &["client-1"]);
    let node = Sandboxd::start(&format!("{ONE_WARM}{}", tls_toml(&cert, Some(&cert.ca))));
    let url = format!("https://{}", node.addr);

    let anonymous = Client::builder(&url).token(ROOT).ca_file(&cert.ca).build().unwrap();
    let e = anonymous.list().await.unwrap_err();
    assert!(matches!(e, Error::Transport { .. }), "{e:?}");
    // A certificate from another CA is refused too.
    let other = tempfile::tempdir().unwrap();
    let stranger = dev_cert(other.path(), &["client-2"]);
    let foreign = Client::builder(&url)
        .token(ROOT)
        .ca_file(&cert.ca)
        .client_cert(&stranger.cert, &stranger.key)
        .build()
        .unwrap();
    assert!(foreign.list().await.is_err(), "a certificate from another CA");

    let known = Client::builder(&url)
        .token(ROOT)
        .ca_file(&cert.ca)
        .client_cert(&client_cert.cert, &client_cert.key)
        .build()
        .unwrap();
    let sb = known.claim("host").send().await.unwrap();
    let out = sb.exec(["echo", "mutual"]).run().await.unwrap();
    assert_eq!(out.stdout_str(), "mutual\n");
    sb.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn a_redirect_from_https_to_http_is_never_followed() {
    let dir = tempfile::tempdir().unwrap();
    let cert = dev_cert(dir.path(), &["127.0.0.1"]);
    // Where the redirect points: it must never see a request (nor the token).
    let plain = FakeHttp::start(|_| "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}".into()).await;
    let location = format!("{}/v1/sandboxes?x=1", plain.url());
    let origin = tls_redirector(&cert, location).await;

    let client = Client::builder(format!("https://{origin}"))
        .token("root-secret")
        .ca_file(&cert.ca)
        .build()
        .unwrap();
    let e = client.list().await.unwrap_err();
    assert!(matches!(&e, Error::Protocol(m) if m.contains("only https://")), "{e:?}");
    let e = client.claim("host").send().await.unwrap_err();
    assert!(matches!(&e, Error::Protocol(m) if m.contains("only https://")), "{e:?}");
    assert!(plain.seen().is_empty(), "the plain-HTTP target was asked: {:?}", plain.seen());
}

/// A TLS server that answers every request with a `307` to `location`.
async fn tls_redirector(cert: &DevCert, location: String) -> std::net::SocketAddr {
    use rustls::pki_types::pem::PemObject;
    let chain = rustls::pki_types::CertificateDer::pem_file_iter(&cert.cert)
        .unwrap()
        .collect::<Result<Vec<_>, _>>()
        .unwrap();
    let key = rustls::pki_types::PrivateKeyDer::from_pem_file(&cert.key).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let (acceptor, location) = (acceptor.clone(), location.clone());
            tokio::spawn(async move {
                let Ok(mut tls) = acceptor.accept(tcp).await else { return };
                let mut head = Vec::new();
                let mut byte = [0u8; 1];
                while !head.ends_with(b"\r\n\r\n") {
                    if tls.read(&mut byte).await.unwrap_or(0) == 0 {
                        return;
                    }
                    head.push(byte[0]);
                }
                // Read the body too: closing on unread bytes would reset the connection
                // before the client reads the answer.
                let head = String::from_utf8_lossy(&head).to_ascii_lowercase();
                let length = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length:"))
                    .map_or(0, |n| n.trim().parse().unwrap_or(0));
                let mut body = vec![0u8; length];
                let _ = tls.read_exact(&mut body).await;
                let answer = format!(
                    "HTTP/1.1 307 Temporary Redirect\r\nLocation: {location}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                );
                let _ = tls.write_all(answer.as_bytes()).await;
                let _ = tls.shutdown().await;
            });
        }
    });
    addr
}
