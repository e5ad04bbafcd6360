//! A TCP fault proxy for tests: put between a node and its S3 server, it passes traffic
//! through, or slows every request, or resets connections, or refuses them as a stopped
//! server would — switched while the node runs.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::time::Duration;

/// What the proxy does to traffic now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Fault {
    /// Traffic passes untouched.
    Pass,
    /// Every request waits [`SLOW`] before it goes on.
    Slow,
    /// Every connection, new or open, is reset at its next byte.
    Reset,
    /// Connections are refused (reset at once): the server is stopped.
    Down,
}

/// The delay of [`Fault::Slow`].
pub const SLOW: Duration = Duration::from_millis(500);

#[derive(Debug)]
pub struct FaultProxy {
    pub addr: SocketAddr,
    fault: Arc<AtomicU8>,
    closed: Arc<AtomicBool>,
}

impl FaultProxy {
    /// Listens on `127.0.0.1:0` and forwards every connection to `upstream`.
    pub fn start(upstream: SocketAddr) -> FaultProxy {
        let listener = TcpListener::bind("127.0.0.1:0").expect("a loopback port");
        let addr = listener.local_addr().expect("an address");
        let fault = Arc::new(AtomicU8::new(Fault::Pass as u8));
        let closed = Arc::new(AtomicBool::new(false));
        let (f, c) = (fault.clone(), closed.clone());
        std::thread::spawn(move || {
            for client in listener.incoming() {
                if c.load(Ordering::Relaxed) {
                    return;
                }
                let Ok(client) = client else { continue };
                if now(&f) == Fault::Down {
                    reset(&client);
                    continue;
                }
                let Ok(server) = TcpStream::connect(upstream) else {
                    reset(&client);
                    continue;
                };
                let f = f.clone();
                std::thread::spawn(move || pump_both(client, server, f));
            }
        });
        FaultProxy { addr, fault, closed }
    }

    pub fn set(&self, fault: Fault) {
        self.fault.store(fault as u8, Ordering::Relaxed);
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.closed.store(true, Ordering::Relaxed);
        let _ = TcpStream::connect(self.addr); // wakes the accept loop so it sees `closed`
    }
}

fn now(fault: &AtomicU8) -> Fault {
    match fault.load(Ordering::Relaxed) {
        0 => Fault::Pass,
        1 => Fault::Slow,
        2 => Fault::Reset,
        _ => Fault::Down,
    }
}

/// Closes with a RST rather than a FIN: what a crashed or restarting server's host sends.
fn reset(s: &TcpStream) {
    let linger = libc::linger { l_onoff: 1, l_linger: 0 };
    // SAFETY: setsockopt on a socket this proxy owns, with a value of the size it names.
    unsafe {
        libc::setsockopt(
            std::os::fd::AsRawFd::as_raw_fd(s),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&raw const linger).cast(),
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        );
    }
    let _ = s.shutdown(Shutdown::Both);
}

/// Client to server on this thread, server to client on another. A request is what the
/// client sends after the server last spoke (or first): under `Slow` it waits before going on.
fn pump_both(client: TcpStream, server: TcpStream, fault: Arc<AtomicU8>) {
    let answered = Arc::new(AtomicBool::new(true));
    let (c2, s2, f2, a2) = (
        client.try_clone().expect("a socket"),
        server.try_clone().expect("a socket"),
        fault.clone(),
        answered.clone(),
    );
    std::thread::spawn(move || pump(s2, c2, &f2, |_| a2.store(true, Ordering::Relaxed)));
    pump(client, server, &fault, |f| {
        if f == Fault::Slow && answered.swap(false, Ordering::Relaxed) {
            std::thread::sleep(SLOW);
        }
    });
}

fn pump(mut from: TcpStream, mut to: TcpStream, fault: &AtomicU8, mut before: impl FnMut(Fault)) {
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let f = now(fault);
        if matches!(f, Fault::Reset | Fault::Down) {
            reset(&from);
            reset(&to);
            return;
        }
        before(f);
        if to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let _ = to.shutdown(Shutdown::Write);
}
