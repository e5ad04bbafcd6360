//! The contract suite on the `s3` backend against the local S3 server (`scripts/start-s3`; the
//! tests fail, never skip, when it is not configured), and an unreachable endpoint.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use silk_store::s3::{S3Config, S3Store};
use silk_store::{Key, ObjectStore, SnapshotName, StoreError};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

contract_suite!(common::s3);

/// An endpoint on a local port nobody listens on.
fn closed_endpoint() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    drop(listener);
    format!("http://127.0.0.1:{port}")
}

fn unreachable_config() -> S3Config {
    // Credentials still come from the environment's chain; require the same setup as every S3
    // test so the chain never falls through to instance metadata.
    let mut cfg = common::s3_config();
    cfg.endpoint = Some(closed_endpoint());
    cfg.max_attempts = 3;
    cfg.initial_backoff_ms = 10;
    cfg.max_backoff_ms = 50;
    cfg
}

#[tokio::test]
async fn an_unreachable_store_is_unavailable_after_bounded_retries() {
    let store = S3Store::new(unreachable_config()).await.unwrap();
    let k = Key::new("chunks/x").unwrap();
    match store.head(&k).await {
        Err(e @ StoreError::Unavailable { attempts: 3, .. }) => {
            assert!(e.is_retryable());
            assert!(e.to_string().contains("chunks/x"), "{e}");
        }
        other => panic!("expected Unavailable after 3 attempts, got {other:?}"),
    }
    assert!(matches!(store.list("chunks/", None).await, Err(StoreError::Unavailable { .. })));

    // A snapshot upload fails the same way, and says so.
    let snaps = common::snapshots(Arc::new(store));
    let name = SnapshotName::checkpoint("offline").unwrap();
    let err = snaps.put(&name, &common::noise(1, 300_000)[..], BTreeMap::new()).await.unwrap_err();
    assert!(err.is_retryable(), "{err}");
}

#[tokio::test]
async fn a_missing_bucket_is_refused_not_not_found() {
    let mut cfg = common::s3_config();
    cfg.bucket = format!("no-such-bucket-{}", common::unique().replace('-', ""));
    let store = S3Store::new(cfg).await.unwrap();
    let err = store.get_bytes(&Key::new("x").unwrap()).await.unwrap_err();
    assert!(!err.is_not_found(), "a missing bucket must not look like a missing object: {err}");
}

#[tokio::test]
async fn keys_live_under_the_configured_prefix() {
    let cfg = common::s3_config();
    let prefix = cfg.prefix.clone();
    let mut root = cfg.clone();
    root.prefix = String::new();
    let (scoped, root) = (S3Store::new(cfg).await.unwrap(), S3Store::new(root).await.unwrap());
    let k = Key::new("objects/a").unwrap();
    scoped.put_bytes(&k, bytes::Bytes::from_static(b"a")).await.unwrap();
    let full = Key::new(format!("{prefix}objects/a")).unwrap();
    assert_eq!(&root.get_bytes(&full).await.unwrap()[..], b"a");
    let listed = scoped.list_all("").await.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].key, k);
}

/// A local server that answers every request the same way, counting connections.
async fn stub_server(answer: Option<&'static str>) -> (String, Arc<AtomicUsize>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let count = Arc::new(AtomicUsize::new(0));
    let seen = count.clone();
    tokio::spawn(async move {
        loop {
            let Ok((mut sock, _)) = listener.accept().await else { return };
            seen.fetch_add(1, Ordering::SeqCst);
            let Some(answer) = answer else { continue }; // drop the connection unanswered
            tokio::spawn(async move {
                // Read the request head, then answer and close.
                let mut head = Vec::new();
                let mut buf = [0u8; 4096];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match sock.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                let _ = sock.write_all(answer.as_bytes()).await;
            });
        }
    });
    (format!("http://{addr}"), count)
}

#[tokio::test]
async fn dropped_connections_and_5xx_are_retried_a_bounded_number_of_times() {
    let k = Key::new("chunks/x").unwrap();
    for answer in [
        None,
        Some("HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"),
    ] {
        let (endpoint, connections) = stub_server(answer).await;
        let mut cfg = unreachable_config();
        cfg.endpoint = Some(endpoint);
        let store = S3Store::new(cfg).await.unwrap();
        match store.head(&k).await {
            Err(StoreError::Unavailable { attempts: 3, .. }) => {}
            other => panic!("{answer:?}: expected Unavailable, got {other:?}"),
        }
        assert_eq!(connections.load(Ordering::SeqCst), 3, "{answer:?}: one connection per try");
    }
}

#[tokio::test]
async fn a_403_is_refused_at_once() {
    let answer = "HTTP/1.1 403 Forbidden\r\nContent-Type: application/xml\r\nContent-Length: 82\r\n\
                  Connection: close\r\n\r\n<?xml version=\"1.0\"?><Error><Code>AccessDenied</Code>\
                  <Message>no</Message></Error>";
    let (endpoint, connections) = stub_server(Some(answer)).await;
    let mut cfg = unreachable_config();
    cfg.endpoint = Some(endpoint);
    let store = S3Store::new(cfg).await.unwrap();
    let err = store.get_bytes(&Key::new("x").unwrap()).await.unwrap_err();
    assert!(matches!(err, StoreError::Refused { .. }), "{err:?}");
    assert!(!err.is_retryable());
    assert_eq!(connections.load(Ordering::SeqCst), 1, "a refusal is not retried");
}
