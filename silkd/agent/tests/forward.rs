//! port_forward against a real silkd and TCP servers inside the test: echo, half-close in both
//! directions, cancel, and no listener.

mod common;

use bytes::Bytes;
use common::*;
use silk_proto::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

async fn ready(c: &mut Client) {
    let f = c.recv().await;
    assert_eq!(f, Frame::Ready, "got {}", f.name());
}

/// Reads `Data` frames until silkd's `Eof`, then the call's end.
async fn data_until_eof(c: &mut Client) -> Vec<u8> {
    let mut got = vec![];
    loop {
        match c.recv().await {
            Frame::Data(b) => got.extend_from_slice(&b),
            Frame::Eof => return got,
            other => panic!("expected Data or Eof, got {}", other.name()),
        }
    }
}

#[tokio::test]
async fn echo_through_a_forward_with_client_half_close() {
    let silkd = Silkd::start();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    // Echoes until our end of stream, then says how much it got: only possible if the client's
    // `Eof` became a TCP half-close that left the other direction open.
    tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.unwrap();
        let mut buf = vec![0; 65536];
        let mut total = 0;
        loop {
            let n = s.read(&mut buf).await.unwrap();
            if n == 0 {
                break;
            }
            total += n;
            s.write_all(&buf[..n]).await.unwrap();
        }
        s.write_all(format!("|got {total}").as_bytes()).await.unwrap();
    });

    let mut c = silkd.connect().await;
    c.send(Frame::PortForward { port }).await;
    ready(&mut c).await;
    c.send(Frame::Data(Bytes::from_static(b"hello"))).await;
    let mut echoed = vec![];
    while echoed.len() < 5 {
        match c.recv().await {
            Frame::Data(b) => echoed.extend_from_slice(&b),
            other => panic!("expected Data, got {}", other.name()),
        }
    }
    assert_eq!(echoed, b"hello");
    // Small enough to sit in socket buffers: this test client does not read while it sends.
    let big = Bytes::from(vec![7u8; 64 << 10]);
    c.send(Frame::Data(big.clone())).await;
    c.send(Frame::Eof).await;
    let rest = data_until_eof(&mut c).await;
    assert_eq!(rest.len(), big.len() + format!("|got {}", 5 + big.len()).len());
    assert!(rest.ends_with(format!("|got {}", 5 + big.len()).as_bytes()));
    assert_eq!(c.reply().await.end, Frame::Done);
    c.call(Frame::Info).await.done();
}

#[tokio::test]
async fn the_server_closing_first_leaves_the_client_side_open() {
    let silkd = Silkd::start();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let (got_tx, got_rx) = tokio::sync::oneshot::channel();
    tokio::spawn(async move {
        let (s, _) = listener.accept().await.unwrap();
        let (mut r, mut w) = s.into_split();
        w.write_all(b"banner").await.unwrap();
        w.shutdown().await.unwrap();
        let mut got = vec![];
        r.read_to_end(&mut got).await.unwrap();
        let _ = got_tx.send(got);
    });

    let mut c = silkd.connect().await;
    c.send(Frame::PortForward { port }).await;
    ready(&mut c).await;
    assert_eq!(data_until_eof(&mut c).await, b"banner");
    c.send(Frame::Data(Bytes::from_static(b"late words"))).await;
    c.send(Frame::Eof).await;
    assert_eq!(c.reply().await.end, Frame::Done);
    assert_eq!(got_rx.await.unwrap(), b"late words");
}

#[tokio::test]
async fn cancel_and_missing_listeners() {
    let silkd = Silkd::start();
    let mut c = silkd.connect().await;
    // A port that was just free: nothing listens there.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let r = c.call(Frame::PortForward { port }).await;
    assert_eq!(r.error_kind(), Some(ErrorKind::NotFound));
    assert_eq!(
        c.call(Frame::PortForward { port: 0 }).await.error_kind(),
        Some(ErrorKind::BadRequest)
    );

    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let (closed_tx, closed_rx) = tokio::sync::oneshot::channel();
    tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.unwrap();
        let mut buf = vec![];
        let _ = s.read_to_end(&mut buf).await;
        let _ = closed_tx.send(());
    });
    c.send(Frame::PortForward { port }).await;
    ready(&mut c).await;
    c.send(Frame::Cancel).await;
    assert_eq!(c.reply().await.end, Frame::Done);
    closed_rx.await.unwrap();
    c.call(Frame::Info).await.done();
}
