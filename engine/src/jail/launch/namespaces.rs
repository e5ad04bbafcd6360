//! The launcher's first steps: the sandbox's cgroups, the jail's namespaces (owned by the
//! sandboxes' user namespace, joined by the launcher while it stays host root) and silkd's
//! listening socket inside them.

use std::ffi::CStr;
use std::path::PathBuf;

use super::{AGENT_NAME, LISTEN_FD, USERNS_FD, cs};

/// Moves this (single-threaded) process into each of `dirs`, a sandbox's groups, so that
/// everything it starts is born in them. On v1 it writes `0` to `tasks`: moving the writing
/// thread alone skips the lock that holds every thread group of the host still
/// (`cgroup_threadgroup_rwsem`), whose write side waits out an RCU grace period after any quiet
/// spell: 7.5 ms per start on this project's hosts against 0.3 ms (docs/benchmarks.md). v2 has
/// no `tasks`, so there the process goes through `cgroup.procs`.
pub(super) fn join_cgroups(dirs: &[PathBuf]) -> Result<(), String> {
    use std::io::Write;
    for dir in dirs {
        let joined = match std::fs::OpenOptions::new().write(true).open(dir.join("tasks")) {
            Ok(mut tasks) => tasks.write_all(b"0"),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                std::fs::write(dir.join("cgroup.procs"), std::process::id().to_string())
            }
            Err(e) => Err(e),
        };
        joined.map_err(|e| format!("join cgroup {}: {e}", dir.display()))?;
    }
    Ok(())
}

/// The namespaces a jail gets that the sandboxes' user namespace owns (the pid namespace is
/// the launcher's own: a new one has no `/proc/PID/ns/pid_for_children` to join before its
/// first process exists, and CRIU does not ask who owns it).
const NAMESPACES: &[(&CStr, i32)] = &[
    (c"mnt", libc::CLONE_NEWNS),
    (c"uts", libc::CLONE_NEWUTS),
    (c"ipc", libc::CLONE_NEWIPC),
    (c"net", libc::CLONE_NEWNET),
    (c"cgroup", libc::CLONE_NEWCGROUP),
];

/// Makes the jail's namespaces *owned by the sandboxes' user namespace* (but pid) and moves
/// this process (still host root) into them. A helper joins the user namespace and unshares them there; the
/// launcher joins them with `setns`, which host root may do (a capability in a user namespace
/// holds in all its descendants). Ownership by the jail's own user namespace is what process
/// checkpointing (CRIU) needs to dump and recreate the jail; what the sandbox's root may do
/// with it is still bounded by its capability set (no `CAP_SYS_ADMIN`, `CAP_NET_ADMIN`) and
/// the seccomp filter (no mount, unshare or setns at all). Mounts the launcher makes in them are
/// host root's, made after the copy, so the copied host mounts are locked and detached with the
/// old root.
///
/// `net`, a network namespace made ahead by [`make_network_namespace`], is joined (and closed)
/// instead of a new one.
///
/// # Safety
/// Forks: call only from a single-threaded process.
pub(super) unsafe fn enter_new_namespaces(net: Option<i32>) -> Result<(), String> {
    let os = |what: &str| format!("{what}: {}", std::io::Error::last_os_error());
    let made_here = |flag: &i32| net.is_none() || *flag != libc::CLONE_NEWNET;
    let namespaces: Vec<_> = NAMESPACES.iter().filter(|(_, flag)| made_here(flag)).collect();
    let flags = namespaces.iter().fold(0, |f, (_, flag)| f | flag);
    unsafe {
        let helper = Helper::unshare(flags).map_err(|e| format!("make the jail's namespaces: {e}"));
        let joined = helper.as_ref().map_err(Clone::clone).and_then(|helper| {
            // All opened before any is joined: the mount namespace changes what /proc is.
            let mut fds = vec![];
            for (name, flag) in &namespaces {
                let fd = helper.open(name);
                if fd < 0 {
                    break;
                }
                fds.push((fd, *flag, name));
            }
            let joined = if fds.len() < namespaces.len() {
                Err(os("open the jail's namespaces"))
            } else {
                fds.iter().try_for_each(|(fd, flag, name)| {
                    if libc::setns(*fd, *flag) != 0 {
                        let name = name.to_string_lossy();
                        return Err(os(&format!("join /proc/{}/ns/{name}", helper.pid)));
                    }
                    Ok(())
                })
            };
            for (fd, ..) in fds {
                libc::close(fd);
            }
            joined
        });
        if let Ok(helper) = helper {
            helper.release(true);
        }
        joined?;
        if let Some(net) = net {
            let entered = libc::setns(net, libc::CLONE_NEWNET);
            let why = os("join the network namespace made ahead");
            libc::close(net);
            if entered != 0 {
                return Err(why);
            }
        }
        if libc::unshare(libc::CLONE_NEWPID) != 0 {
            return Err(os("unshare the pid namespace"));
        }
        Ok(())
    }
}

/// A new network namespace owned by the sandboxes' user namespace, as
/// [`enter_new_namespaces`] makes one, for a later jail: its descriptor, close-on-exec and
/// numbered 10 or above (out of the way of the jail's own). Making one costs ~0.5 ms of CPU
/// (`copy_net_ns`), which the launcher server spends between starts rather than on one.
///
/// # Safety
/// Forks: call only from a single-threaded process holding the user namespace at
/// [`USERNS_FD`] and ignoring `SIGCHLD` (the kernel reaps the helper).
pub(super) unsafe fn make_network_namespace() -> Result<i32, String> {
    unsafe {
        let helper = Helper::unshare(libc::CLONE_NEWNET)
            .map_err(|e| format!("make a network namespace: {e}"))?;
        let fd = helper.open(c"net");
        let moved = if fd < 0 { -1 } else { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 10) };
        let why =
            format!("open the network namespace made ahead: {}", std::io::Error::last_os_error());
        if fd >= 0 {
            libc::close(fd);
        }
        // The helper goes; the namespace lives on in the descriptor.
        helper.release(false);
        if moved < 0 { Err(why) } else { Ok(moved) }
    }
}

/// A child that joined the sandboxes' user namespace and unshared namespaces there, kept alive
/// (so that they can be opened through its `/proc/PID/ns`) until released.
struct Helper {
    pid: libc::pid_t,
    /// The write end of the pipe the helper waits on: closing it lets the helper exit.
    hold: i32,
}

impl Helper {
    /// Forks the helper and waits until it unshared `flags` (or says why it could not).
    ///
    /// # Safety
    /// Forks: call only from a single-threaded process holding the user namespace at
    /// [`USERNS_FD`].
    unsafe fn unshare(flags: i32) -> Result<Helper, String> {
        let os = |what: &str| format!("{what}: {}", std::io::Error::last_os_error());
        unsafe {
            // `ready` carries the helper's errno (or nothing: done); `hold` keeps it alive.
            let (mut ready, mut hold) = ([0; 2], [0; 2]);
            if libc::pipe2(ready.as_mut_ptr(), libc::O_CLOEXEC) != 0
                || libc::pipe2(hold.as_mut_ptr(), libc::O_CLOEXEC) != 0
            {
                return Err(os("pipe"));
            }
            let pid = libc::fork();
            if pid < 0 {
                return Err(os("fork"));
            }
            if pid == 0 {
                libc::close(ready[0]);
                libc::close(hold[1]);
                if libc::setns(USERNS_FD, libc::CLONE_NEWUSER) != 0 || libc::unshare(flags) != 0 {
                    let errno = *libc::__errno_location();
                    libc::write(ready[1], (&errno as *const i32).cast(), 4);
                    libc::_exit(1);
                }
                libc::close(ready[1]);
                let mut byte = 0u8;
                libc::read(hold[0], (&mut byte as *mut u8).cast(), 1);
                libc::_exit(0);
            }
            libc::close(ready[1]);
            libc::close(hold[0]);
            let helper = Helper { pid, hold: hold[1] };
            let mut errno = 0i32;
            let n = libc::read(ready[0], (&mut errno as *mut i32).cast(), 4);
            libc::close(ready[0]);
            if n != 0 {
                // Dead or dying: reaped as on success.
                helper.release(true);
                let errno = if n == 4 { errno } else { libc::EIO };
                return Err(std::io::Error::from_raw_os_error(errno).to_string());
            }
            Ok(helper)
        }
    }

    /// Opens the helper's namespace `name` (`/proc/PID/ns/NAME`); -1 if it cannot.
    unsafe fn open(&self, name: &CStr) -> i32 {
        let path = cs(&format!("/proc/{}/ns/{}", self.pid, name.to_string_lossy()));
        unsafe { libc::open(path.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) }
    }

    /// Lets the helper exit; `wait`s for it where the caller reaps its children (the server
    /// ignores `SIGCHLD`: there the kernel does).
    unsafe fn release(self, wait: bool) {
        unsafe {
            libc::close(self.hold);
            if wait {
                libc::waitpid(self.pid, std::ptr::null_mut(), 0);
            }
        }
    }
}

/// silkd's listening socket, made here in the jail's network namespace (abstract, so no file
/// of the host's is open in the jail) and left at [`LISTEN_FD`] for the child.
///
/// # Safety
/// Plain syscalls; [`LISTEN_FD`] must be free.
pub(super) unsafe fn listen_inside() -> Result<(), String> {
    let os = |what: &str| format!("{what}: {}", std::io::Error::last_os_error());
    unsafe {
        let fd = libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
        if fd < 0 {
            return Err(os("agent socket"));
        }
        let mut addr: libc::sockaddr_un = std::mem::zeroed();
        addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
        for (i, b) in AGENT_NAME.bytes().enumerate() {
            addr.sun_path[i + 1] = b as libc::c_char;
        }
        let len = std::mem::size_of::<libc::sa_family_t>() + 1 + AGENT_NAME.len();
        if libc::bind(fd, (&addr as *const libc::sockaddr_un).cast(), len as libc::socklen_t) != 0
            || libc::listen(fd, 1024) != 0
        {
            return Err(os("bind the agent socket"));
        }
        if fd != LISTEN_FD && (libc::dup2(fd, LISTEN_FD) < 0 || libc::close(fd) != 0) {
            return Err(os("place the agent socket"));
        }
        Ok(())
    }
}
