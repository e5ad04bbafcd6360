//! Connecting to a sandbox's silkd, wherever its engine put it.
//!
//! The jail engine's silkd listens on an abstract unix socket in the jail's own network
//! namespace ([`AgentAddr::Netns`]): nothing of the host's is open inside the jail, which is
//! what lets CRIU dump it whole, and no host process but root (which may enter the namespace)
//! can reach it. A client makes its socket *in* that namespace (socket(2) binds a socket to the
//! caller's network namespace for life), then connects to the name from anywhere.

use std::ffi::CString;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;

use crate::AgentAddr;

/// How long a connect waits for room in silkd's accept queue (see [`queue_full`]).
pub const QUEUE_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// What a connection to silkd may hold on its way there (`SO_SNDBUF`: a unix stream's sender's
/// buffer bounds what is queued for the peer; the kernel doubles it for its bookkeeping). At
/// the default (about 208 KiB) a bulk upload hands the CPU between sender and silkd every few
/// hundred KiB: `silkbench agent` measured the 1 GiB write at 0.66-0.75x `cat` before, see
/// docs/benchmarks.md for after. Memory is taken only while bytes wait, never reserved. silkd
/// keeps the default toward its clients: there a bigger buffer lets a stream whose reader
/// stopped (a `find`, a command's output) run that much further before backpressure holds it.
const SEND_BUFFER: usize = 1 << 20;

/// Raises `sock`'s send buffer to `bytes`: past `net.core.wmem_max` when the caller may
/// (`SO_SNDBUFFORCE`, CAP_NET_ADMIN: the node), else up to it. Best effort: a smaller buffer
/// only costs throughput.
fn widen_send_buffer(sock: &impl AsFd, bytes: usize) {
    let fd = sock.as_fd().as_raw_fd();
    let value = libc::c_int::try_from(bytes).unwrap_or(libc::c_int::MAX);
    for opt in [libc::SO_SNDBUFFORCE, libc::SO_SNDBUF] {
        // SAFETY: setsockopt with an int option value on a descriptor the caller holds.
        let set = unsafe {
            libc::setsockopt(
                fd,
                libc::SOL_SOCKET,
                opt,
                (&raw const value).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if set == 0 {
            return;
        }
    }
}

/// Whether `e` says silkd's accept queue is full: silkd is busy or, more often, throttled by
/// its sandbox's CPU limit for the rest of a scheduler period (up to 100 ms) while a burst of
/// connections arrives. A connect then fails at once; the caller waits for room (briefly:
/// silkd accepts again within the period) rather than answering "agent unavailable".
pub fn queue_full(e: &std::io::Error) -> bool {
    e.kind() == std::io::ErrorKind::WouldBlock
}

/// [`try_connect`], waiting up to [`QUEUE_WAIT`] (this thread sleeps) while silkd's accept
/// queue is full.
pub fn connect(addr: &AgentAddr) -> std::io::Result<UnixStream> {
    let deadline = std::time::Instant::now() + QUEUE_WAIT;
    let mut pause = std::time::Duration::from_micros(500);
    loop {
        match try_connect(addr) {
            Err(e) if queue_full(&e) && std::time::Instant::now() < deadline => {
                std::thread::sleep(pause);
                pause = (pause * 2).min(std::time::Duration::from_millis(20));
            }
            connected => return connected,
        }
    }
}

/// Connects to the silkd at `addr`, non-blocking (an instant answer either way: a unix
/// socket's connect succeeds or fails without waiting, `WouldBlock` when its backlog is full).
pub fn try_connect(addr: &AgentAddr) -> std::io::Result<UnixStream> {
    let stream = connect_to(addr)?;
    widen_send_buffer(&stream, SEND_BUFFER);
    Ok(stream)
}

fn connect_to(addr: &AgentAddr) -> std::io::Result<UnixStream> {
    match addr {
        AgentAddr::Unix(path) => {
            let stream = UnixStream::connect(path)?;
            stream.set_nonblocking(true)?;
            Ok(stream)
        }
        AgentAddr::Netns { pid, start_time, name } => {
            let ns = open_netns(*pid, *start_time)?;
            let socket = socket_in(&ns)?;
            connect_abstract(&socket, name)?;
            Ok(UnixStream::from(socket))
        }
        AgentAddr::Vsock { .. } => Err(std::io::Error::new(
            std::io::ErrorKind::Unsupported,
            "vsock agents need a VM engine",
        )),
    }
}

/// The network namespace of the jail whose init is `pid`, checked against the start time the
/// engine recorded, so a pid reused by another process is never entered.
fn open_netns(pid: u32, start_time: u64) -> std::io::Result<OwnedFd> {
    let gone = || std::io::Error::new(std::io::ErrorKind::NotFound, "the sandbox's silkd is gone");
    let path = CString::new(format!("/proc/{pid}/ns/net")).expect("no NUL");
    // SAFETY: plain open of a path we own.
    let fd = unsafe { libc::open(path.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(gone());
    }
    // SAFETY: `fd` was just opened and is ours.
    let ns = unsafe { OwnedFd::from_raw_fd(fd) };
    // Checked after the open: had the pid been reused before it, the start time differs now.
    if crate::jail::start_time(pid) != Some(start_time) {
        return Err(gone());
    }
    Ok(ns)
}

/// A unix stream socket of the network namespace `ns`: this thread enters it, makes the socket
/// and goes back.
fn socket_in(ns: &OwnedFd) -> std::io::Result<OwnedFd> {
    let own = std::fs::File::open("/proc/thread-self/ns/net")?;
    // SAFETY: setns and socket on descriptors we hold; see below for the way back.
    unsafe {
        if libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let fd = libc::socket(
            libc::AF_UNIX,
            libc::SOCK_STREAM | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
            0,
        );
        let made = std::io::Error::last_os_error();
        if libc::setns(own.as_raw_fd(), libc::CLONE_NEWNET) != 0 {
            // A thread left in a sandbox's network namespace would make every later socket of
            // this thread there: nothing is safe to do but stop.
            eprintln!("silk-engine: cannot return to the host network namespace: {made}");
            std::process::abort();
        }
        if fd < 0 {
            return Err(made);
        }
        Ok(OwnedFd::from_raw_fd(fd))
    }
}

fn connect_abstract(socket: &OwnedFd, name: &str) -> std::io::Result<()> {
    // SAFETY: a zeroed sockaddr_un is valid; the name fits (checked).
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let name = name.as_bytes();
    if name.len() + 1 > addr.sun_path.len() {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidInput, "name too long"));
    }
    // Abstract: a leading NUL, then the name (not NUL-terminated; the length says where it ends).
    for (i, b) in name.iter().enumerate() {
        addr.sun_path[i + 1] = *b as libc::c_char;
    }
    let len = std::mem::size_of::<libc::sa_family_t>() + 1 + name.len();
    // SAFETY: connect on our socket with a properly sized address.
    let rc = unsafe {
        libc::connect(
            socket.as_raw_fd(),
            (&addr as *const libc::sockaddr_un).cast(),
            len as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn send_buffer(sock: &UnixStream) -> usize {
        let mut value: libc::c_int = 0;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: getsockopt into a local int of the size given.
        let got = unsafe {
            libc::getsockopt(
                sock.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_SNDBUF,
                (&raw mut value).cast(),
                &mut len,
            )
        };
        assert_eq!(got, 0, "{}", std::io::Error::last_os_error());
        value as usize
    }

    #[test]
    fn a_connection_to_silkd_may_hold_a_mebibyte_on_its_way() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("silkd.sock");
        let _listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let plain = UnixStream::connect(&path).unwrap();
        let dialled = try_connect(&AgentAddr::Unix(path)).unwrap();
        // The kernel doubles what is set (its bookkeeping rides in the same budget).
        assert!(send_buffer(&dialled) >= SEND_BUFFER, "{} bytes", send_buffer(&dialled));
        assert!(send_buffer(&plain) < SEND_BUFFER, "the default is smaller: the test tests");
    }
}
