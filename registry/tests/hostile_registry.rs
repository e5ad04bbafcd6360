//! A registry is whatever a template names (a tenant's included): one that answers a manifest
//! with a body that never ends must cost the node a bounded read, not its memory.

use std::time::Duration;

use silk_registry::{LayerCache, Puller, RegistryError, RegistrySettings, Settings};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Answers `/v2/` with 200 (no auth) and anything else with an endless chunked body.
async fn endless_registry() -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((mut conn, _)) = listener.accept().await else { return };
            tokio::spawn(async move {
                let mut head = vec![0; 4096];
                let n = conn.read(&mut head).await.unwrap_or(0);
                let head = String::from_utf8_lossy(&head[..n]);
                if head.starts_with("GET /v2/ ") {
                    let ok = "HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{}";
                    let _ = conn.write_all(ok.as_bytes()).await;
                    return;
                }
                let start = "HTTP/1.1 200 OK\r\ncontent-type: \
                    application/vnd.oci.image.manifest.v1+json\r\ntransfer-encoding: chunked\r\n\r\n";
                if conn.write_all(start.as_bytes()).await.is_err() {
                    return;
                }
                let chunk = format!("10000\r\n{}\r\n", " ".repeat(0x10000));
                while conn.write_all(chunk.as_bytes()).await.is_ok() {}
            });
        }
    });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_manifest_that_never_ends_is_refused_after_a_bounded_read() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let addr = endless_registry().await;
    let host = addr.to_string();
    let settings = Settings {
        registries: [(host.clone(), RegistrySettings { insecure: true, ..Default::default() })]
            .into(),
        max_image_bytes: u64::MAX,
        ..Default::default()
    };
    let dir = tempfile::tempdir().unwrap();
    let cache = LayerCache::open(dir.path(), u64::MAX, 0).unwrap();
    let puller = Puller::new(settings, cache, None);
    let resolved = tokio::time::timeout(
        Duration::from_secs(30),
        puller.resolve(&format!("{host}/endless:v1")),
    )
    .await
    .expect("the read stops at the bound (not reading on until the registry stops)");
    match resolved {
        Err(RegistryError::TooLarge { size, cap, .. }) => assert!(size > cap && size < 2 * cap),
        other => panic!("{other:?}"),
    }
}
