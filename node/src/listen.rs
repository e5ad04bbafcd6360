//! The API's listener: TCP, or TLS over it when the node has `[tls]`; HTTP/1.1 (with the
//! relay's upgrade) and HTTP/2 on every connection (by ALPN under TLS, by the client's preface
//! on plain TCP); a graceful stop that lets requests underway finish.
//!
//! Each request carries the client's address ([`ClientAddr`]) for the limits that are kept per
//! client.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;

/// The address a request's connection came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientAddr(pub SocketAddr);

/// Work a request leaves for its connection's own task, to run once hyper has handed the
/// connection over to an upgrade (the relay's splice). Run there rather than spawned: a task
/// spawned in the handler woke the other worker to steal it (an idle vCPU roused, and the
/// splice then ran across the two), on the path of a claim's `101` and its first call.
#[derive(Clone, Default)]
pub struct AfterUpgrade(Arc<Mutex<Option<Work>>>);

type Work = Pin<Box<dyn Future<Output = ()> + Send>>;

impl AfterUpgrade {
    /// Runs `work` on the connection's task when the connection has upgraded (or ended).
    pub fn run(&self, work: impl Future<Output = ()> + Send + 'static) {
        let mut slot = self.0.lock().unwrap_or_else(|e| e.into_inner());
        match slot.as_ref() {
            // One upgrade per connection: a second is never expected, but runs all the same.
            Some(_) => drop(tokio::spawn(work)),
            None => *slot = Some(Box::pin(work)),
        }
    }

    fn take(&self) -> Option<Work> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).take()
    }
}

impl std::fmt::Debug for AfterUpgrade {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AfterUpgrade")
    }
}

/// A TLS handshake must finish within this, or the connection is dropped.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a stop waits for requests in flight (a claim, a checkpoint) before it closes the
/// connections still open.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// Serves `router` on `listener` until `shutdown` resolves, then waits for requests underway.
///
/// The accept loop runs as a task of its own, not in the caller's future: a daemon awaits this
/// from `block_on`, whose thread does not drive the I/O driver, so each accept there would wait
/// for a worker to see the event and wake the main thread, and each new connection's task for
/// a worker to be woken in turn. On a worker, the connection's task goes to the front of the
/// same worker's queue and runs at once: two thread wake-ups fewer per connection, which a
/// claim that opens the relay pays every time (a fresh connection's claim → `201`, from a
/// Python client: 453 → 387 µs p50; docs/benchmarks.md).
pub async fn serve(
    listener: TcpListener,
    router: Router,
    tls: Option<Arc<rustls::ServerConfig>>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    match tokio::spawn(accept_loop(listener, router, tls, shutdown)).await {
        Ok(served) => served,
        Err(e) => Err(std::io::Error::other(format!("accept loop: {e}"))),
    }
}

async fn accept_loop(
    listener: TcpListener,
    router: Router,
    tls: Option<Arc<rustls::ServerConfig>>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let acceptor = tls.map(tokio_rustls::TlsAcceptor::from);
    let graceful = GracefulShutdown::new();
    let mut http = auto::Builder::new(TokioExecutor::new());
    // Slow-header clients are cut off rather than holding a connection forever.
    http.http1().timer(TokioTimer::new()).header_read_timeout(Duration::from_secs(30));
    let http = Arc::new(http);
    tokio::pin!(shutdown);
    loop {
        let (tcp, addr) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(conn) => conn,
                // Out of descriptors and the like: wait a little rather than spin.
                Err(e) => {
                    tracing::warn!("accept: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        // The relay forwards silkd's small frames as they come: Nagle plus the client's delayed
        // ACK would hold the second of two back-to-back frames for ~40 ms.
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!("TCP_NODELAY: {e}");
        }
        let (router, acceptor, http) = (router.clone(), acceptor.clone(), http.clone());
        let watcher = graceful.watcher();
        // A request with a body wakes its own connection's task (see `in_place`).
        tokio::spawn(crate::in_place::in_place(async move {
            let after = AfterUpgrade::default();
            let slot = after.clone();
            let service = hyper::service::service_fn(move |mut req: hyper::Request<_>| {
                req.extensions_mut().insert(ClientAddr(addr));
                // Only a request that asks to upgrade can leave work for after it.
                if req.headers().contains_key(hyper::header::UPGRADE) {
                    req.extensions_mut().insert(slot.clone());
                }
                tower::ServiceExt::oneshot(router.clone(), req)
            });
            let served = match acceptor {
                None => {
                    watcher
                        .watch(http.serve_connection_with_upgrades(TokioIo::new(tcp), service))
                        .await
                }
                Some(acceptor) => {
                    let tls =
                        match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                            Ok(Ok(tls)) => tls,
                            Ok(Err(e)) => return tracing::debug!(%addr, "TLS handshake: {e}"),
                            Err(_) => return tracing::debug!(%addr, "TLS handshake timed out"),
                        };
                    let conn = http.serve_connection_with_upgrades(TokioIo::new(tls), service);
                    watcher.watch(conn).await
                }
            };
            if let Err(e) = served {
                tracing::debug!(%addr, "connection: {e}");
            }
            if let Some(work) = after.take() {
                work.await;
            }
        }));
    }
    drop(listener);
    // Requests in flight finish; a connection that stays (a relay, a long exec stream) is cut
    // after the grace: its sandbox keeps running, and the client reconnects to the next start.
    if tokio::time::timeout(SHUTDOWN_GRACE, graceful.shutdown()).await.is_err() {
        tracing::info!("connections still open after {SHUTDOWN_GRACE:?}: closed");
    }
    Ok(())
}
