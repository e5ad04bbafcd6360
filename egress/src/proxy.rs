//! The transparent proxy: nftables redirects every TCP connection a sandbox opens here; the
//! proxy reads where it was going (`SO_ORIGINAL_DST`), asks [`Lanes::open`], and either
//! connects there from the node and copies both ways, or resets the sandbox's connection.

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use crate::Shared;

pub(crate) async fn serve(shared: Arc<Shared>, listener: TcpListener) {
    loop {
        match listener.accept().await {
            Ok((conn, peer)) => {
                tokio::spawn(handle(shared.clone(), conn, peer));
            }
            Err(e) => {
                tracing::warn!("egress proxy accept: {e}");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
        }
    }
}

/// Where nftables' redirect found the connection going.
fn original_dst(conn: &TcpStream) -> Option<SocketAddrV4> {
    let mut addr: libc::sockaddr_in = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    const SO_ORIGINAL_DST: libc::c_int = 80;
    // SAFETY: getsockopt writes at most `len` bytes into `addr`.
    let rc = unsafe {
        libc::getsockopt(
            conn.as_raw_fd(),
            libc::SOL_IP,
            SO_ORIGINAL_DST,
            (&mut addr as *mut libc::sockaddr_in).cast(),
            &mut len,
        )
    };
    (rc == 0 && i32::from(addr.sin_family) == libc::AF_INET).then(|| {
        SocketAddrV4::new(
            Ipv4Addr::from(u32::from_be(addr.sin_addr.s_addr)),
            u16::from_be(addr.sin_port),
        )
    })
}

/// Closes the sandbox's side with a reset: what a refused connection looks like from inside.
fn reset(conn: TcpStream) {
    // A zero linger does not block the drop (the deprecation is about a non-zero one).
    #[allow(deprecated)]
    let _ = conn.set_linger(Some(std::time::Duration::ZERO));
    drop(conn);
}

async fn handle(shared: Arc<Shared>, conn: TcpStream, peer: SocketAddr) {
    // Not from a claimed sandbox of the lane (a warm one, or someone reaching the port from
    // outside): nothing to do for it.
    let Some((addr, lease)) = shared.lease(peer) else { return reset(conn) };
    let Some(dst) = original_dst(&conn) else { return reset(conn) };
    let counters = &shared.counters;
    // DNS over TCP to the lane's resolver (a client retrying an answer too large for UDP):
    // not served, and counted as what it is.
    if dst.port() == 53 && *dst.ip() == shared.cfg.lane.nth(1) {
        counters.deny(crate::Denied::Protocol);
        return reset(conn);
    }
    let decided = {
        let guard = shared.guard.lock().unwrap_or_else(|e| e.into_inner()).clone();
        shared.lanes().open(
            addr,
            &lease,
            *dst.ip(),
            &guard,
            shared.cfg.max_connections,
            Instant::now(),
        )
    };
    if let Err(why) = decided {
        counters.deny(why);
        tracing::debug!(sandbox = lease.sandbox, %dst, reason = why.as_str(), "egress refused");
        return reset(conn);
    }
    counters.connections.fetch_add(1, Ordering::Relaxed);
    counters.open.fetch_add(1, Ordering::Relaxed);
    let upstream = tokio::time::timeout(shared.cfg.connect_timeout, TcpStream::connect(dst)).await;
    match upstream {
        Ok(Ok(up)) => {
            let _ = up.set_nodelay(true);
            let _ = conn.set_nodelay(true);
            let (conn_read, conn_write) = conn.into_split();
            let (up_read, up_write) = up.into_split();
            let (out_done, out_watch) = tokio::sync::watch::channel(false);
            let (back_done, back_watch) = tokio::sync::watch::channel(false);
            tokio::join!(
                pump(conn_read, up_write, &counters.bytes_out, out_done, back_watch),
                pump(up_read, conn_write, &counters.bytes_in, back_done, out_watch),
            );
        }
        Ok(Err(e)) => {
            tracing::debug!(sandbox = lease.sandbox, %dst, "egress connect: {e}");
            reset(conn);
        }
        Err(_) => reset(conn),
    }
    counters.open.fetch_sub(1, Ordering::Relaxed);
    shared.lanes().closed(addr);
}

/// Once one direction has ended, how long the other may stay silent before the connection is
/// dropped: a sandbox whose process exited leaves a half-closed connection that a server which
/// never closes would otherwise hold open (and count against the sandbox's limit) for ever.
const HALF_CLOSED_IDLE: Duration = Duration::from_secs(30);

/// Copies one direction, counting its bytes as they pass; at its end, shuts the write side (a
/// half-close passed on) and says so to the other direction through `done`.
async fn pump(
    mut from: impl AsyncRead + Unpin,
    mut to: impl AsyncWrite + Unpin,
    bytes: &AtomicU64,
    done: watch::Sender<bool>,
    mut other: watch::Receiver<bool>,
) {
    let mut buf = vec![0u8; 16 << 10];
    loop {
        let read = if *other.borrow() {
            match tokio::time::timeout(HALF_CLOSED_IDLE, from.read(&mut buf)).await {
                Ok(read) => read,
                Err(_) => break,
            }
        } else {
            tokio::select! {
                read = from.read(&mut buf) => read,
                _ = other.changed() => continue,
            }
        };
        match read {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                if to.write_all(&buf[..n]).await.is_err() {
                    break;
                }
                bytes.fetch_add(n as u64, Ordering::Relaxed);
            }
        }
    }
    let _ = to.shutdown().await;
    let _ = done.send(true);
}
