//! The bulk lane: node-to-node calls that carry bulk bytes (a moved sandbox's files) over TLS
//! on kernel TCP, beside the QUIC endpoint at the same address and port number.
//!
//! Why a second transport: QUIC does its per-packet work in user space (each ~1.4 KB packet's
//! frames, acknowledgements, header protection and AEAD, one at a time). Here 100 MiB over one
//! QUIC stream cost ~430 ms of CPU for both ends together, where TLS on kernel TCP (64 KiB
//! segments, 16 KiB records) cost ~140 ms (docs/benchmarks.md, session of 2026-12-07 06:29).
//! A move is CPU-bound on its node's cores, so that difference is most of what a move costs
//! beyond its floor. Small calls stay on QUIC, where they share one warm connection.
//!
//! A bulk call is a mesh call like any other (the same [`Incoming`], the same requests), and
//! its handshake makes the same checks as QUIC's ([`crate::tls::configs`]: the CA, validity,
//! the revocation list; the dialler checks that the certificate names the node it dials), under
//! its own ALPN. A connection carries one call. How it ends says whether the sender finished:
//! TLS's `close_notify` is a clean end, and an end without one ([`Abort`]) reads as an error on
//! the other side, as a reset QUIC stream does.

use std::net::SocketAddr;
use std::os::fd::AsFd;
use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::ServerName;
use tokio::net::TcpStream;

use crate::MeshError;
use crate::driver::{Incoming, Lane};

/// ALPN of the bulk lane.
pub const ALPN: &[u8] = b"silkmesh-bulk/1";

/// How long a dial may take to connect, and a handshake (either side) to finish.
pub(crate) const CONNECT_WITHIN: Duration = Duration::from_secs(2);
pub(crate) const HANDSHAKE_WITHIN: Duration = Duration::from_secs(10);

/// Handshakes under way at once; connections over it are closed unanswered.
pub(crate) const MAX_HANDSHAKES: usize = 64;

/// The dialler's end of a bulk call.
pub type BulkStream = tokio_rustls::client::TlsStream<TcpStream>;

/// Ends what a bulk call sends without TLS's `close_notify`: the peer's next read after the
/// bytes already sent fails, so it knows the sender did not finish (the bulk lane's reset).
/// Taken before the stream is split, it works beside both halves.
#[derive(Debug)]
pub struct Abort(std::net::TcpStream);

impl Abort {
    pub fn of(stream: &BulkStream) -> std::io::Result<Abort> {
        let fd = stream.get_ref().0.as_fd().try_clone_to_owned()?;
        Ok(Abort(std::net::TcpStream::from(fd)))
    }

    pub fn abort(&self) {
        let _ = self.0.shutdown(std::net::Shutdown::Write);
    }
}

/// Dials node `name`'s bulk lane at `addr`: connected, handshaken, the peer checked to be
/// `name`.
pub(crate) async fn dial(
    addr: SocketAddr,
    name: &str,
    config: Arc<rustls::ClientConfig>,
) -> Result<BulkStream, MeshError> {
    let io = |e: std::io::Error| MeshError::Io(format!("bulk lane to {name} at {addr}: {e}"));
    let server_name = ServerName::try_from(name.to_string())
        .map_err(|e| MeshError::Tls(format!("node name {name:?}: {e}")))?;
    let tcp = tokio::time::timeout(CONNECT_WITHIN, TcpStream::connect(addr))
        .await
        .map_err(|_| io(std::io::ErrorKind::TimedOut.into()))?
        .map_err(io)?;
    // The call's request and answer are small writes each waiting on the other.
    tcp.set_nodelay(true).map_err(io)?;
    let connector = tokio_rustls::TlsConnector::from(config);
    let stream = tokio::time::timeout(HANDSHAKE_WITHIN, connector.connect(server_name, tcp))
        .await
        .map_err(|_| io(std::io::ErrorKind::TimedOut.into()))?
        .map_err(|e| MeshError::Tls(format!("bulk lane to {name} at {addr}: {e}")))?;
    if stream.get_ref().1.alpn_protocol() != Some(ALPN) {
        return Err(MeshError::Tls(format!("{addr} does not speak the bulk lane")));
    }
    Ok(stream)
}

/// The server's side of a bulk connection's handshake: the call it carries.
pub(crate) async fn accept(
    tcp: TcpStream,
    remote: SocketAddr,
    config: Arc<rustls::ServerConfig>,
) -> Result<Incoming, MeshError> {
    let tls = |e: std::io::Error| MeshError::Tls(format!("bulk lane from {remote}: {e}"));
    tcp.set_nodelay(true).map_err(tls)?;
    let acceptor = tokio_rustls::TlsAcceptor::from(config);
    let stream = tokio::time::timeout(HANDSHAKE_WITHIN, acceptor.accept(tcp))
        .await
        .map_err(|_| tls(std::io::ErrorKind::TimedOut.into()))?
        .map_err(tls)?;
    // A client that offered no ALPN gets through rustls without one.
    if stream.get_ref().1.alpn_protocol() != Some(ALPN) {
        return Err(MeshError::Tls(format!("bulk lane from {remote}: not the bulk ALPN")));
    }
    let (recv, send) = tokio::io::split(stream);
    Ok(Incoming { remote, lane: Lane::Bulk, send: Box::pin(send), recv: Box::pin(recv) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Mesh, MeshConfig, NodeState, TlsFiles, tls};

    /// A member of the cluster listening where a node dials `b`: its certificate says `evil`,
    /// so the dial fails before a byte of the call is sent.
    #[tokio::test]
    async fn a_dial_refuses_a_member_that_is_not_the_node_dialled() {
        let dir = tempfile::tempdir().unwrap();
        tls::init_ca(dir.path()).unwrap();
        let files: Vec<TlsFiles> = ["a", "b", "evil"]
            .iter()
            .map(|n| {
                let (cert, key) = tls::issue(dir.path(), n, tls::DEFAULT_DAYS).unwrap();
                TlsFiles { ca: dir.path().join("ca.pem"), cert, key }
            })
            .collect();
        let start = |f: &TlsFiles, name: &str| {
            let cfg = MeshConfig::new(name, "127.0.0.1:0".parse().unwrap(), f.clone());
            Mesh::start(cfg, NodeState::default())
        };
        let (b, _calls_b) = start(&files[1], "b").await.unwrap();
        let (evil, _calls_evil) = start(&files[2], "evil").await.unwrap();
        let list = crate::trust::RevocationList::open(None).unwrap();
        let client = tls::configs(&files[0], &list).unwrap().bulk_client;
        dial(b.id().addr, "b", client.clone()).await.expect("the real b");
        let Err(e) = dial(evil.id().addr, "b", client).await else {
            panic!("a dial for b accepted evil's certificate");
        };
        assert!(matches!(e, MeshError::Tls(_)), "{e}");
    }
}
