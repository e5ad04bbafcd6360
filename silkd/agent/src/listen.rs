//! The listeners silkd can serve on.

use std::path::PathBuf;

use tokio::net::{TcpListener, UnixListener};
use tokio_vsock::{VMADDR_CID_ANY, VsockAddr, VsockListener};

/// Where to listen, as given on the command line.
#[derive(Debug, Clone)]
pub enum ListenAddr {
    Unix(PathBuf),
    Tcp(std::net::SocketAddr),
    Vsock(u32),
    /// An already listening unix socket inherited as this fd (the jail engine binds the socket
    /// on the host side, where the sandbox cannot replace it, and passes it in).
    Fd(i32),
}

#[derive(Debug)]
pub enum Listener {
    Unix(UnixListener, PathBuf),
    Tcp(TcpListener),
    Vsock(VsockListener),
}

impl Listener {
    pub async fn bind(addr: &ListenAddr) -> std::io::Result<Listener> {
        Ok(match addr {
            ListenAddr::Unix(path) => {
                // A socket file left by an earlier run would make bind fail.
                match std::fs::remove_file(path) {
                    Ok(()) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => return Err(e),
                }
                Listener::Unix(UnixListener::bind(path)?, path.clone())
            }
            ListenAddr::Tcp(addr) => Listener::Tcp(TcpListener::bind(addr).await?),
            ListenAddr::Vsock(port) => {
                Listener::Vsock(VsockListener::bind(VsockAddr::new(VMADDR_CID_ANY, *port))?)
            }
            ListenAddr::Fd(fd) => {
                use std::os::fd::FromRawFd;
                // SAFETY: the caller hands this process the fd; it is owned from here on.
                let std = unsafe { std::os::unix::net::UnixListener::from_raw_fd(*fd) };
                // It arrives without close-on-exec (it had to survive our own exec): set it, or
                // every command run in the sandbox would inherit the agent's listening socket
                // and could accept the connections meant for silkd.
                // SAFETY: plain fcntl on a descriptor this process owns.
                if unsafe { libc::fcntl(*fd, libc::F_SETFD, libc::FD_CLOEXEC) } != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                std.set_nonblocking(true)?;
                // The path is the host's (outside the jail), so removing it at shutdown is a
                // harmless miss inside a sandbox.
                let path = std
                    .local_addr()?
                    .as_pathname()
                    .map_or_else(|| PathBuf::from("inherited"), PathBuf::from);
                Listener::Unix(UnixListener::from_std(std)?, path)
            }
        })
    }

    pub fn describe(&self) -> String {
        match self {
            Listener::Unix(_, path) => format!("unix:{}", path.display()),
            Listener::Tcp(l) => l.local_addr().map_or("tcp:?".into(), |a| format!("tcp:{a}")),
            Listener::Vsock(l) => {
                l.local_addr().map_or("vsock:?".into(), |a| format!("vsock:{}", a.port()))
            }
        }
    }
}
