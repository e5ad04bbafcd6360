//! The connection for the client's next upgrade (a claim, a relay), dialled ahead of need over
//! plain `http://` (see `crate::http`).

use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::net::TcpStream;

/// One connection to the node dialled ahead of need, for the next upgrade (a claim, a relay):
/// a fresh connect and the node's accept cost ~100 µs on the path of a call on loopback here.
/// Dialled after each upgrade that took a connection; taken only while it is young (the node
/// closes a connection that sent nothing for 30 s, a proxy in front may sooner) and still open
/// and silent, else dropped and the call dials its own. Held outside any runtime (`std`), so a
/// client used from another runtime later still can take it.
#[derive(Debug, Default)]
pub(crate) struct Spare {
    conn: Mutex<Option<(String, Instant, std::net::TcpStream)>>,
    dialling: AtomicBool,
}

/// How long a spare connection is offered after it was dialled.
const SPARE_FOR: Duration = Duration::from_secs(10);

impl Spare {
    /// The spare connection to `addr`, if there is one still fit to carry a request.
    pub(crate) fn take(&self, addr: &str) -> Option<TcpStream> {
        let (to, dialled, tcp) = self.conn.lock().unwrap_or_else(|e| e.into_inner()).take()?;
        let fit = to == addr && dialled.elapsed() < SPARE_FOR && open_and_silent(&tcp);
        // Non-blocking, as `into_std` left it (tokio refuses a blocking one).
        fit.then(|| TcpStream::from_std(tcp).ok()).flatten()
    }

    /// Dials the next spare connection to `addr` in the background, unless one is there or
    /// being dialled: 2 ms after the upgrade that took the last, so that the node's accept is
    /// not on the path of that call's own first round trips (dialled at once, it was, and the
    /// gain was lost: `silkbench fleet`, two pairs each way).
    pub(crate) fn refill(self: &Arc<Self>, addr: String, connect_timeout: Duration) {
        let held = self.conn.lock().unwrap_or_else(|e| e.into_inner()).is_some();
        if held || self.dialling.swap(true, Ordering::AcqRel) {
            return;
        }
        let spare = self.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(2)).await;
            let dialled = tokio::time::timeout(connect_timeout, TcpStream::connect(&addr)).await;
            if let Ok(Ok(tcp)) = dialled
                && tcp.set_nodelay(true).is_ok()
                && let Ok(tcp) = tcp.into_std()
            {
                *spare.conn.lock().unwrap_or_else(|e| e.into_inner()) =
                    Some((addr, Instant::now(), tcp));
            }
            spare.dialling.store(false, Ordering::Release);
        });
    }
}

/// Whether nothing can be read from `tcp` yet and it is not closed: a non-blocking one-byte
/// `MSG_PEEK` must find no data (EAGAIN). The node never speaks first on a connection.
fn open_and_silent(tcp: &std::net::TcpStream) -> bool {
    let mut byte = 0u8;
    // SAFETY: recv(2) of at most one byte into `byte`, on a descriptor `tcp` owns.
    let n = unsafe {
        libc::recv(tcp.as_raw_fd(), (&raw mut byte).cast(), 1, libc::MSG_PEEK | libc::MSG_DONTWAIT)
    };
    n < 0 && std::io::Error::last_os_error().kind() == std::io::ErrorKind::WouldBlock
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_spare_connection_is_taken_only_open_silent_young_and_to_its_address() {
        use std::io::Write;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let offer = |dialled: Instant| {
            let tcp = std::net::TcpStream::connect(&addr).unwrap();
            tcp.set_nonblocking(true).unwrap(); // as `refill` leaves it
            let (server, _) = listener.accept().unwrap();
            let spare = Spare::default();
            *spare.conn.lock().unwrap() = Some((addr.clone(), dialled, tcp));
            (spare, server)
        };
        let (spare, _server) = offer(Instant::now());
        assert!(spare.take("127.0.0.1:1").is_none(), "taken for another address");
        let (spare, _server) = offer(Instant::now());
        assert!(spare.take(&addr).is_some(), "an open, silent, young one is taken");
        assert!(spare.take(&addr).is_none(), "taken twice");
        let (spare, server) = offer(Instant::now());
        drop(server);
        std::thread::sleep(Duration::from_millis(20));
        assert!(spare.take(&addr).is_none(), "closed by the node");
        let (spare, mut server) = offer(Instant::now());
        server.write_all(b"HTTP/1.1 408 Request Timeout\r\n\r\n").unwrap();
        std::thread::sleep(Duration::from_millis(20));
        assert!(spare.take(&addr).is_none(), "the node spoke first");
        let old = Instant::now().checked_sub(SPARE_FOR + Duration::from_secs(1)).unwrap();
        let (spare, _server) = offer(old);
        assert!(spare.take(&addr).is_none(), "too old: the node may close it any moment");
    }
}
