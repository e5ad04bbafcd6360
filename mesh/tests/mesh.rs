//! Real QUIC endpoints on loopback, in one process: joining, state gossip, leave, failure of a
//! dropped node, a certificate from another CA, a member that claims another's name, a call
//! on a stream, two nodes that dial each other at once, and calls on the bulk lane (TLS over
//! TCP) from members and from those it must refuse.

use std::time::{Duration, Instant};

use silk_mesh::{Incoming, Lane, Mesh, MeshConfig, NodeState, TlsFiles, bulk, tls, wire};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn certs(dir: &std::path::Path, names: &[&str]) -> Vec<TlsFiles> {
    tls::init_ca(dir).unwrap();
    names
        .iter()
        .map(|n| {
            let (cert, key) = tls::issue(dir, n, tls::DEFAULT_DAYS).unwrap();
            TlsFiles { ca: dir.join("ca.pem"), cert, key }
        })
        .collect()
}

async fn start(name: &str, tls: TlsFiles, join: Vec<std::net::SocketAddr>) -> Mesh {
    start_at("127.0.0.1:0".parse().unwrap(), name, tls, join).await
}

async fn start_at(
    listen: std::net::SocketAddr,
    name: &str,
    tls: TlsFiles,
    join: Vec<std::net::SocketAddr>,
) -> Mesh {
    let mut cfg = MeshConfig::new(name, listen, tls);
    cfg.join = join;
    let state = NodeState { api: format!("http://{name}"), ..Default::default() };
    let (mesh, mut incoming) = Mesh::start(cfg, state).await.unwrap();
    // Echo calls: read one u64, answer it plus one.
    tokio::spawn(async move {
        while let Some(mut call) = incoming.recv().await {
            tokio::spawn(async move {
                let n: u64 = wire::read_frame(&mut call.recv).await.unwrap().unwrap();
                wire::write_frame(&mut call.send, &(n + 1)).await.unwrap();
                call.send.shutdown().await.unwrap();
            });
        }
    });
    mesh
}

async fn until(what: &str, limit: Duration, mut cond: impl FnMut() -> bool) -> Duration {
    let t = Instant::now();
    while !cond() {
        assert!(t.elapsed() < limit, "timed out after {limit:?} waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    t.elapsed()
}

fn names(m: &Mesh) -> Vec<String> {
    let mut v: Vec<String> = m.peers().iter().map(|p| p.id.name.clone()).collect();
    v.sort();
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_nodes_join_gossip_call_and_leave() {
    let dir = tempfile::tempdir().unwrap();
    let files = certs(dir.path(), &["a", "b", "c"]);
    let a = start("a", files[0].clone(), vec![]).await;
    let b = start("b", files[1].clone(), vec![a.id().addr]).await;
    let c = start("c", files[2].clone(), vec![a.id().addr]).await;
    let all = Duration::from_secs(10);
    until("everyone sees everyone", all, || {
        names(&a) == ["b", "c"] && names(&b) == ["a", "c"] && names(&c) == ["a", "b"]
    })
    .await;

    // State: a change on c reaches a and b within a second.
    c.update(|s| {
        s.warm.insert("host/small/none".into(), 3);
    });
    let warm_on = |m: &Mesh| {
        m.peer("c").and_then(|p| p.state).and_then(|s| s.warm.get("host/small/none").copied())
    };
    let took = until("c's warm count on a and b", Duration::from_secs(1), || {
        warm_on(&a) == Some(3) && warm_on(&b) == Some(3)
    })
    .await;
    println!("state spread in {took:?}");
    assert_eq!(a.peer("c").unwrap().state.unwrap().api, "http://c");
    assert_eq!(c.local().warm.get("host/small/none"), Some(&3));

    // A call on a stream.
    let (mut send, mut recv) = a.open("b").await.unwrap();
    wire::write_frame(&mut send, &41u64).await.unwrap();
    assert_eq!(wire::read_frame::<u64>(&mut recv).await.unwrap(), Some(42));

    // Leave: the others drop c at once (well before failure detection could).
    c.leave().await;
    let took = until("c gone after leaving", Duration::from_secs(1), || {
        names(&a) == ["b"] && names(&b) == ["a"]
    })
    .await;
    println!("leave seen in {took:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_whose_certificate_expired_cannot_join() {
    let dir = tempfile::tempdir().unwrap();
    let files = certs(dir.path(), &["a", "b"]);
    // Valid until the second it was issued: past it two seconds later.
    let (cert, key) = tls::issue(dir.path(), "x", 0).unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let expired = TlsFiles { ca: dir.path().join("ca.pem"), cert, key };
    let a = start("a", files[0].clone(), vec![]).await;
    let b = start("b", files[1].clone(), vec![a.id().addr]).await;
    until("a mesh of two", Duration::from_secs(10), || a.peers().len() == 1).await;
    let x = start("x", expired, vec![a.id().addr, b.id().addr]).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(names(&a), ["b"], "an expired certificate joined");
    assert_eq!(names(&b), ["a"]);
    assert!(x.peers().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_certificate_is_refused_after_the_revocation_list_changed_too() {
    let dir = tempfile::tempdir().unwrap();
    let files = certs(dir.path(), &["a", "b"]);
    let list = dir.path().join("revoked");
    let mut cfg = MeshConfig::new("a", "127.0.0.1:0".parse().unwrap(), files[0].clone());
    cfg.revoked = Some(list.clone());
    let (a, _calls) = Mesh::start(cfg, NodeState::default()).await.unwrap();
    let b = start("b", files[1].clone(), vec![a.id().addr]).await;
    until("a mesh of two", Duration::from_secs(10), || a.peers().len() == 1).await;
    // The list changes (a name that is no member): a reloads its configs.
    std::fs::write(&list, "someone-else\n").unwrap();
    let (cert, key) = tls::issue(dir.path(), "x", 0).unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let expired = TlsFiles { ca: dir.path().join("ca.pem"), cert, key };
    let x = start("x", expired, vec![a.id().addr]).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(names(&a), ["b"], "an expired certificate joined after a reload");
    assert!(x.peers().is_empty());
    drop(b);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_with_another_cas_certificate_cannot_join() {
    let (good, evil) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let files = certs(good.path(), &["a"]);
    let outsider = certs(evil.path(), &["x"]);
    let a = start("a", files[0].clone(), vec![]).await;
    let x = start("x", outsider[0].clone(), vec![a.id().addr]).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(a.peers().is_empty(), "a let in {:?}", names(&a));
    assert!(x.peers().is_empty());
    assert!(a.open("x").await.is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_cannot_speak_for_another_name() {
    let dir = tempfile::tempdir().unwrap();
    let files = certs(dir.path(), &["a", "b", "evil"]);
    assert!(tls::issue(dir.path(), "silkmesh", 1).is_err(), "the name every certificate carries");
    assert!(tls::check_own(&files[2], "b").is_err(), "a node checks its own certificate");
    tls::check_own(&files[1], "b").unwrap();

    let a = start("a", files[0].clone(), vec![]).await;
    // A member of the cluster (its certificate says "evil") calls itself "b": a drops its
    // packets and states, so it never appears.
    let fake = start("b", files[2].clone(), vec![a.id().addr]).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(a.peers().is_empty(), "a let in {:?}", names(&a));
    assert!(fake.peers().is_empty());

    // The real b joins, and stays the only b while the impostor keeps knocking.
    let b = start("b", files[1].clone(), vec![a.id().addr]).await;
    until("a sees the real b", Duration::from_secs(5), || names(&a) == ["b"]).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let seen = a.peer("b").unwrap();
    assert_eq!(seen.id.addr, b.id().addr);
    assert_eq!(seen.state.unwrap().api, "http://b");
    let (mut send, mut recv) = a.open("b").await.unwrap();
    wire::write_frame(&mut send, &41u64).await.unwrap();
    send.finish().unwrap();
    assert_eq!(wire::read_frame::<u64>(&mut recv).await.unwrap(), Some(42));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_nodes_that_dial_each_other_at_once_keep_one_connection() {
    let dir = tempfile::tempdir().unwrap();
    let files = certs(dir.path(), &["a", "b"]);
    let ip = std::net::Ipv4Addr::LOCALHOST.into();
    let free = || std::net::SocketAddr::new(ip, silk_mesh::free_port(ip).unwrap());
    let (at_a, at_b) = (free(), free());
    // Each joins through the other at the same moment: both dial, many packets at once.
    let (a, b) = tokio::join!(
        start_at(at_a, "a", files[0].clone(), vec![at_b]),
        start_at(at_b, "b", files[1].clone(), vec![at_a]),
    );
    until("a mesh of two", Duration::from_secs(10), || names(&a) == ["b"] && names(&b) == ["a"])
        .await;
    // A duplicate closes once calls under way on it could have finished (10 s). A dial whose
    // first packet met the other's port before it was bound arrives a retransmission (~1 s)
    // after the first connection, so one connection each must hold for a while, not once.
    let mut since = None;
    let settled = until("one connection each, for 3 s", Duration::from_secs(30), || {
        if a.open_connections() != 1 || b.open_connections() != 1 {
            since = None;
            return false;
        }
        since.get_or_insert_with(Instant::now).elapsed() >= Duration::from_secs(3)
    })
    .await;
    println!("settled on one connection in {settled:?}");
    // Calls both ways go over it, and no new one is opened.
    for (from, to) in [(&a, "b"), (&b, "a")] {
        let (mut send, mut recv) = from.open(to).await.unwrap();
        wire::write_frame(&mut send, &1u64).await.unwrap();
        send.finish().unwrap();
        assert_eq!(wire::read_frame::<u64>(&mut recv).await.unwrap(), Some(2));
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!((a.open_connections(), b.open_connections()), (1, 1));
    assert_eq!((names(&a), names(&b)), (vec!["b".to_string()], vec!["a".to_string()]));
}

/// What a bulk call's receiver saw: the lane, the number in its frame, then the bytes after it
/// up to a clean end (`Ok`) or an error.
type Seen = (Lane, u64, Result<u64, String>);

/// Answers each call with the number it sent plus one, after reading it to its end.
async fn counting(mut incoming: tokio::sync::mpsc::Receiver<Incoming>) -> Vec<Seen> {
    let mut seen = vec![];
    while let Ok(Some(mut call)) =
        tokio::time::timeout(Duration::from_secs(2), incoming.recv()).await
    {
        let n: u64 = wire::read_frame(&mut call.recv).await.unwrap().unwrap();
        let mut rest = vec![];
        let read = call.recv.read_to_end(&mut rest).await;
        wire::write_frame(&mut call.send, &(n + 1)).await.unwrap();
        call.send.shutdown().await.unwrap();
        seen.push((call.lane, n, read.map(|n| n as u64).map_err(|e| e.to_string())));
    }
    seen
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bulk_call_carries_its_bytes_and_says_whether_the_sender_finished() {
    let dir = tempfile::tempdir().unwrap();
    let files = certs(dir.path(), &["a", "b"]);
    let (a, incoming) =
        Mesh::start(MeshConfig::new("a", "127.0.0.1:0".parse().unwrap(), files[0].clone()), {
            NodeState::default()
        })
        .await
        .unwrap();
    let b = start("b", files[1].clone(), vec![a.id().addr]).await;
    until("a mesh of two", Duration::from_secs(10), || names(&b) == ["a"]).await;
    let answers = tokio::spawn(counting(incoming));

    // Finished: every byte, then a clean end; the answer comes back on the same connection.
    let mut call = b.open_bulk("a").await.unwrap();
    wire::write_frame(&mut call, &41u64).await.unwrap();
    call.write_all(&vec![7u8; 3 << 20]).await.unwrap();
    call.shutdown().await.unwrap();
    assert_eq!(wire::read_frame::<u64>(&mut call).await.unwrap(), Some(42));

    // Aborted: the receiver's read fails after the bytes that came, as a reset QUIC stream's.
    let mut call = b.open_bulk("a").await.unwrap();
    let abort = bulk::Abort::of(&call).unwrap();
    wire::write_frame(&mut call, &1u64).await.unwrap();
    call.write_all(&[7u8; 1000]).await.unwrap();
    call.flush().await.unwrap();
    abort.abort();
    assert_eq!(wire::read_frame::<u64>(&mut call).await.unwrap(), Some(2));

    let seen = answers.await.unwrap();
    assert_eq!(seen.len(), 2, "{seen:?}");
    assert_eq!(seen[0], (Lane::Bulk, 41, Ok(3 << 20)));
    assert_eq!((seen[1].0, seen[1].1), (Lane::Bulk, 1));
    assert!(seen[1].2.is_err(), "an aborted call read as finished: {seen:?}");
}

/// A TLS client for `a`'s bulk lane as `config` makes it: what `a` answers to a call on it.
async fn call_bulk_as(
    a: std::net::SocketAddr,
    config: std::sync::Arc<rustls::ClientConfig>,
) -> Option<u64> {
    let tcp = tokio::net::TcpStream::connect(a).await.unwrap();
    let connector = tokio_rustls::TlsConnector::from(config);
    let server = rustls::pki_types::ServerName::try_from("a").unwrap();
    // TLS 1.3: a client finishes its side of the handshake before the server has judged its
    // certificate, so a refusal may show only when it reads.
    let mut s = connector.connect(server, tcp).await.ok()?;
    wire::write_frame(&mut s, &5u64).await.ok()?;
    s.shutdown().await.ok()?;
    wire::read_frame::<u64>(&mut s).await.ok()?
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bulk_lane_answers_members_only() {
    let (good, evil) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let files = certs(good.path(), &["a", "b", "r"]);
    let outsider = certs(evil.path(), &["b"]);
    let list = good.path().join("revoked");
    std::fs::write(&list, "r\n").unwrap();
    let mut cfg = MeshConfig::new("a", "127.0.0.1:0".parse().unwrap(), files[0].clone());
    cfg.revoked = Some(list);
    let (a, incoming) = Mesh::start(cfg, NodeState::default()).await.unwrap();
    let answers = tokio::spawn(counting(incoming));
    let at = a.id().addr;
    let nothing_revoked = silk_mesh::trust::RevocationList::open(None).unwrap();
    let client = |f: &TlsFiles| tls::configs(f, &nothing_revoked).unwrap().bulk_client;

    // A member of the cluster gets its answer: the lane is open, and this is how to use it.
    assert_eq!(call_bulk_as(at, client(&files[1])).await, Some(6));
    // Another CA's certificate (for a name the cluster has), a revoked member's, none at all,
    // and a member speaking QUIC's ALPN over TCP: no answer, and nothing reaches a's calls.
    assert_eq!(call_bulk_as(at, client(&outsider[0])).await, None, "another CA");
    assert_eq!(call_bulk_as(at, client(&files[2])).await, None, "revoked");
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    let ca = std::fs::read(good.path().join("ca.pem")).unwrap();
    for c in rustls::pki_types::CertificateDer::pem_slice_iter(&ca) {
        roots.add(c.unwrap()).unwrap();
    }
    let mut anonymous = rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_protocol_versions(&[&rustls::version::TLS13])
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    anonymous.alpn_protocols = vec![bulk::ALPN.to_vec()];
    assert_eq!(call_bulk_as(at, std::sync::Arc::new(anonymous)).await, None, "no certificate");
    let mut quic_alpn = (*client(&files[1])).clone();
    quic_alpn.alpn_protocols = vec![tls::ALPN.to_vec()];
    assert_eq!(call_bulk_as(at, std::sync::Arc::new(quic_alpn)).await, None, "QUIC's ALPN");
    // Bytes that are no TLS at all.
    let mut raw = tokio::net::TcpStream::connect(at).await.unwrap();
    raw.write_all(&[0, 0, 0, 1, 5]).await.unwrap();
    let mut got = vec![];
    let _ = tokio::time::timeout(Duration::from_secs(5), raw.read_to_end(&mut got)).await;
    assert!(got.len() < 64, "plain bytes got an answer: {got:?}");

    let seen = answers.await.unwrap();
    assert_eq!(seen, vec![(Lane::Bulk, 5, Ok(0))], "only the member's call came through");
}
