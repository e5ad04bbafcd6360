//! The launcher (`silk-jail`): turns a [`LaunchSpec`] into a running jail with silkd as PID 1.
//!
//! It runs as its own short-lived, single-threaded process, so everything between `fork` and
//! `exec` is plain syscalls on data prepared beforehand. The jail is built as a table of steps;
//! each names the attack it stops (the tests in `engine/tests/isolation.rs` and
//! `node/tests/escape.rs` make each attack):
//!
//! | step | stops |
//! |---|---|
//! | join the sandbox's cgroups, new mount, pid, uts, ipc, net, cgroup namespaces (owned by the sandboxes' user namespace, which CRIU needs; the launcher stays host root; the net namespace may have been made ahead by the server, for this jail only) | seeing or signalling host processes, host network, host hostname; cpu/memory/pid exhaustion |
//! | `fork`: the child is PID 1 of the new pid namespace and the rest runs in it | |
//! | id-mapped, read-only, `nosuid,nodev` views of the template and of host binds | template files looking unowned; writes to templates |
//! | overlay root `nosuid,nodev` (golden + template below, the sandbox's upper directory on top) | setuid and device files of the sandbox acting on the host |
//! | every mount target inside the root opened with `openat2(RESOLVE_IN_ROOT \| RESOLVE_NO_MAGICLINKS)` and mounted through its fd | a symlink planted in the sandbox's files redirecting a mount onto a host path |
//! | a minimal `/dev` (tmpfs, nodes made here), private devpts, `/dev/shm` | host devices |
//! | `/proc` with runc's masked paths (`/dev/null` or an empty read-only directory bound over them) and read-only `/proc/{bus,fs,irq,sys,sysrq-trigger}` | global sysctls (`kernel.core_pattern`: host root), sysrq, kernel memory and keys |
//! | silkd bound read-only over a regular file at `/run/silkd` (made there if missing; anything else there stops the launch) | a sandbox's file standing in for silkd |
//! | hostname, loopback up | |
//! | `pivot_root` into the root, old root detached | reaching any host path |
//! | enter the engine's user namespace (root inside = an unprivileged host id), drop supplementary groups | every capability acting on the host; files the sandbox makes being host-root-owned |
//! | `/etc/hostname`, `/etc/machine-id` (and in lane `egress` `/etc/resolv.conf`) written *after* all of the above, as the sandbox's root, never through a symlink | the launcher writing host files through symlinks the sandbox planted |
//! | capability bounding set, `no_new_privs`, seccomp | what the namespaces leave (see `seccomp.rs`) |
//!
//! The parent learns through a close-on-exec pipe whether the child reached `exec` (EOF) or
//! failed (an error message), prints the child's host pid, and exits. The jail is not our child
//! afterwards: it outlives the node process, which re-adopts it on restart.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::seccomp;

mod namespaces;
pub mod restore;
pub mod serve;
mod sys;
use namespaces::{enter_new_namespaces, join_cgroups, listen_inside, make_network_namespace};
use sys::*;

/// The fd number silkd's listening socket has in the jail.
pub const LISTEN_FD: i32 = 3;
/// The fd number of the user namespace the jail enters (the engine's; see `JailEngine::new`).
pub const USERNS_FD: i32 = 4;
/// The abstract unix socket name silkd listens on, in the jail's network namespace.
pub const AGENT_NAME: &str = "silkd";

/// Everything the launcher needs, written by the engine as JSON.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LaunchSpec {
    pub hostname: String,
    /// Where the overlay is mounted (on the host, inside the new mount namespace only).
    pub root: PathBuf,
    /// Read-only layers, top first.
    pub lowers: Vec<Lower>,
    pub upper: PathBuf,
    pub work: PathBuf,
    /// Host directories bound read-only and id-mapped: (host path, path inside the root).
    pub binds: Vec<(PathBuf, PathBuf)>,
    /// The silkd binary on the host (static, so it runs in any root filesystem).
    pub silkd: PathBuf,
    /// cgroup directories to join.
    pub cgroups: Vec<PathBuf>,
    /// silkd's stdout and stderr.
    pub log: PathBuf,
    /// The host uid and gid that is root inside (owner of the jail's own tmpfs mounts).
    pub root_id: u32,
    /// Extra silkd arguments (an image's default env, working directory and user).
    #[serde(default)]
    pub silkd_args: Vec<String>,
    /// `/etc/resolv.conf`, written as the sandbox's root (lane `egress`: the node's resolver).
    #[serde(default)]
    pub resolv_conf: Option<String>,
}

/// One read-only layer of the overlay.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Lower {
    pub path: PathBuf,
    /// For a layer whose files carry host ids (a template: root is host uid 0), an empty
    /// directory where an id-mapped view of `path` is attached first, so root's files look
    /// root-owned inside. `None` for layers already stored in the sandbox's id range (goldens).
    pub idmapped_at: Option<PathBuf>,
}

/// Capabilities root keeps inside a sandbox (like a container's default set, minus `MKNOD`: no
/// device cgroup guards device nodes here, so creating them is not allowed at all). They are
/// capabilities of the sandbox's user namespace, so none of them acts on the host.
const KEEP_CAPS: &[u32] = &[
    0,  // CHOWN
    1,  // DAC_OVERRIDE
    3,  // FOWNER
    4,  // FSETID
    5,  // KILL
    6,  // SETGID
    7,  // SETUID
    8,  // SETPCAP
    10, // NET_BIND_SERVICE
    13, // NET_RAW
    18, // SYS_CHROOT
    29, // AUDIT_WRITE
    31, // SETFCAP
];

/// runc's default masked paths under /proc: a file gets /dev/null bound over it, a directory
/// [`EMPTY_DIR`] bound read-only. Paths this kernel lacks are skipped. (/sys is not mounted at
/// all.)
pub const MASKED: &[&str] = &[
    "proc/acpi",
    "proc/kcore",
    "proc/keys",
    "proc/latency_stats",
    "proc/timer_list",
    "proc/timer_stats",
    "proc/sched_debug",
    "proc/scsi",
];

/// An empty directory in the jail's `/dev`, bound read-only over the masked directories. runc
/// mounts an empty tmpfs there instead; CRIU then tars and untars that tmpfs at every dump and
/// restore (~3 ms and ~2 ms here, for `/proc/acpi`), where a bind of a directory in `/dev`
/// (which the dump names as external) costs nothing. The restore's `/dev` has it too.
pub const EMPTY_DIR: &std::ffi::CStr = c".empty";

/// runc's default read-only paths under /proc.
pub const READ_ONLY: &[&str] =
    &["proc/bus", "proc/fs", "proc/irq", "proc/sys", "proc/sysrq-trigger"];

fn c(path: &Path) -> CString {
    CString::new(path.as_os_str().as_bytes()).expect("launch paths have no NUL bytes")
}

fn cs(s: &str) -> CString {
    CString::new(s).expect("no NUL bytes")
}

/// A filesystem mounted at a path inside the root.
struct FsMount {
    at: CString,
    fstype: CString,
    flags: libc::c_ulong,
    data: CString,
}

/// Every string and table the child uses, allocated before `fork`.
struct Plan {
    root: CString,
    /// (layer, where its id-mapped view goes).
    idmapped: Vec<(CString, CString)>,
    overlay: CString,
    /// (host dir, path inside the root).
    binds: Vec<(CString, CString)>,
    dev: FsMount,
    dev_nodes: Vec<(CString, u32, u32)>,
    dev_links: Vec<(CString, CString)>,
    /// After /dev: devpts and shm; then /proc, /tmp and /run.
    mounts: Vec<FsMount>,
    masked: Vec<CString>,
    read_only: Vec<CString>,
    silkd_source: CString,
    root_id: u32,
    machine_id: CString,
    hostname: CString,
    hostname_line: CString,
    resolv_conf: Option<CString>,
    log: CString,
    exe: CString,
    /// Owns the strings `argv_ptrs` points into.
    _argv: Vec<CString>,
    argv_ptrs: Vec<*const libc::c_char>,
    envp: [CString; 2],
    filter: Vec<libc::sock_filter>,
}

/// The device nodes of a jail's `/dev`: (name, major, minor).
const DEV_NODES: &[(&str, u32, u32)] = &[
    ("null", 1, 3),
    ("zero", 1, 5),
    ("full", 1, 7),
    ("random", 1, 8),
    ("urandom", 1, 9),
    ("tty", 5, 0),
];

/// The symlinks of a jail's `/dev`: (target, name).
pub(crate) const DEV_LINKS: &[(&str, &str)] = &[
    ("pts/ptmx", "ptmx"),
    ("/proc/self/fd", "fd"),
    ("/proc/self/fd/0", "stdin"),
    ("/proc/self/fd/1", "stdout"),
    ("/proc/self/fd/2", "stderr"),
];

/// The overlay root's mount options. Overlay features captures do not understand (redirects,
/// metacopy) stay off, whatever this kernel's defaults.
fn overlay_options(lowers: &[Lower], upper: &Path, work: &Path) -> String {
    let lowers = lowers
        .iter()
        .map(|l| l.idmapped_at.as_ref().unwrap_or(&l.path).display().to_string())
        .collect::<Vec<_>>()
        .join(":");
    format!(
        "lowerdir={lowers},upperdir={},workdir={},redirect_dir=off,metacopy=off,index=off",
        upper.display(),
        work.display()
    )
}

fn plan(spec: &LaunchSpec) -> Plan {
    let overlay = overlay_options(&spec.lowers, &spec.upper, &spec.work);
    let nosuid_nodev = libc::MS_NOSUID | libc::MS_NODEV;
    let owner = format!("uid={0},gid={0}", spec.root_id);
    let fs = |at: &str, fstype: &str, flags: libc::c_ulong, data: &str| FsMount {
        at: cs(at),
        fstype: cs(fstype),
        flags,
        data: cs(data),
    };
    let mounts = vec![
        fs(
            "dev/pts",
            "devpts",
            libc::MS_NOSUID | libc::MS_NOEXEC,
            "newinstance,ptmxmode=0666,mode=620",
        ),
        fs("dev/shm", "tmpfs", nosuid_nodev | libc::MS_NOEXEC, &format!("mode=1777,{owner}")),
        fs("proc", "proc", nosuid_nodev | libc::MS_NOEXEC, ""),
    ];
    let dev_nodes = DEV_NODES.iter().map(|(n, ma, mi)| (cs(n), *ma, *mi)).collect();
    let dev_links = DEV_LINKS.iter().map(|(target, name)| (cs(target), cs(name))).collect();
    let mut id = [0u8; 16];
    // SAFETY: getrandom fills the buffer it is given.
    unsafe { libc::getrandom(id.as_mut_ptr().cast(), id.len(), 0) };
    let machine_id: String = id.iter().map(|b| format!("{b:02x}")).collect::<String>() + "\n";
    let argv: Vec<CString> = ["silkd", "--listen-fd", &LISTEN_FD.to_string()]
        .into_iter()
        .map(cs)
        .chain(spec.silkd_args.iter().map(|a| cs(a)))
        .collect();
    Plan {
        root: c(&spec.root),
        idmapped: spec
            .lowers
            .iter()
            .filter_map(|l| Some((c(&l.path), c(l.idmapped_at.as_ref()?))))
            .collect(),
        overlay: cs(&overlay),
        binds: spec.binds.iter().map(|(host, inside)| (c(host), c(inside))).collect(),
        dev: fs(
            "dev",
            "tmpfs",
            libc::MS_NOSUID | libc::MS_NOEXEC,
            &format!("mode=755,size=64k,{owner}"),
        ),
        dev_nodes,
        dev_links,
        mounts,
        masked: MASKED.iter().map(|p| cs(p)).collect(),
        read_only: READ_ONLY.iter().map(|p| cs(p)).collect(),
        silkd_source: c(&spec.silkd),
        root_id: spec.root_id,
        machine_id: cs(&machine_id),
        hostname: cs(&spec.hostname),
        hostname_line: cs(&format!("{}\n", spec.hostname)),
        resolv_conf: spec.resolv_conf.as_deref().map(cs),
        log: c(&spec.log),
        exe: cs("/run/silkd"),
        argv_ptrs: argv.iter().map(|a| a.as_ptr()).chain([std::ptr::null()]).collect(),
        _argv: argv,
        envp: [
            cs("PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"),
            cs("HOME=/root"),
        ],
        filter: seccomp::program(),
    }
}

/// Runs the launcher. Returns the jail's host pid, or why it could not start. `net`: a network
/// namespace made ahead for this jail (see `serve`), else one is made here.
pub fn run(spec: &LaunchSpec, net: Option<i32>) -> Result<u32, String> {
    let plan = plan(spec);
    join_cgroups(&spec.cgroups)?;
    // SAFETY: plain syscalls on a single-threaded process.
    unsafe {
        enter_new_namespaces(net)?;
        listen_inside()?;
        let mut pipe = [0; 2];
        if libc::pipe2(pipe.as_mut_ptr(), libc::O_CLOEXEC) != 0 {
            return Err(format!("pipe: {}", std::io::Error::last_os_error()));
        }
        match libc::fork() {
            -1 => Err(format!("fork: {}", std::io::Error::last_os_error())),
            0 => {
                libc::close(pipe[0]);
                let (step, errno) = child(&plan);
                // Report and die; the pipe is the only channel back.
                let msg = format!("{step}: {}", std::io::Error::from_raw_os_error(errno));
                libc::write(pipe[1], msg.as_ptr().cast(), msg.len());
                libc::_exit(1);
            }
            pid => {
                libc::close(pipe[1]);
                let mut buf = [0u8; 512];
                let n = libc::read(pipe[0], buf.as_mut_ptr().cast(), buf.len());
                if n < 0 {
                    libc::kill(pid, libc::SIGKILL);
                    return Err(format!(
                        "read the child's report: {}",
                        std::io::Error::last_os_error()
                    ));
                }
                if n > 0 {
                    let mut status = 0;
                    libc::waitpid(pid, &mut status, 0);
                    return Err(String::from_utf8_lossy(&buf[..n as usize]).into_owned());
                }
                Ok(pid as u32)
            }
        }
    }
}

/// `silk-jail --hold-userns BASE`: enters a new user namespace and waits for stdin to close, so
/// the engine can write its id maps and keep a handle on it (see `JailEngine::new`). It first
/// becomes host uid/gid `BASE` (the sandboxes' root): the kernel charges what processes in a
/// user namespace hold (inotify instances and watches, pending signals, message queues) to its
/// creator as well, and that must be the sandboxes' own id, not host root's — or one sandbox
/// could use up root's inotify instances and break the host's daemons.
pub fn hold_user_namespace(base: u32) -> Result<(), String> {
    let os = |what: &str| format!("{what}: {}", std::io::Error::last_os_error());
    // SAFETY: plain syscalls in a single-threaded process.
    unsafe {
        if libc::setgroups(0, std::ptr::null()) != 0 {
            return Err(os("setgroups"));
        }
        if libc::setresgid(base, base, base) != 0 || libc::setresuid(base, base, base) != 0 {
            return Err(os("become the sandboxes' root id"));
        }
        if libc::unshare(libc::CLONE_NEWUSER) != 0 {
            return Err(os("unshare(CLONE_NEWUSER)"));
        }
    }
    println!("ready");
    let _ = std::io::Read::read_to_end(&mut std::io::stdin(), &mut vec![]);
    Ok(())
}

/// The jail's PID 1 before `exec`. Returns only on failure: the step and its errno.
///
/// # Safety
/// Runs between `fork` and `exec`: raw syscalls only, on data from `plan`.
unsafe fn child(p: &Plan) -> (&'static str, i32) {
    macro_rules! check {
        ($step:expr, $call:expr) => {
            if $call < 0 {
                return ($step, *libc::__errno_location());
            }
        };
    }
    let null: *const libc::c_char = std::ptr::null();
    let nodata: *const libc::c_void = std::ptr::null();
    let mut buf = [0u8; 32];
    let mut buf2 = [0u8; 32];
    unsafe {
        // Modes below are meant exactly; silkd gets a conventional umask back before exec.
        libc::umask(0);
        check!("setsid", libc::setsid());
        // No O_NOFOLLOW: the box directory is root's alone (no link can be planted there), and
        // CRIU reopens this file by its flags through /proc/PID/fd, a link.
        let log = libc::open(
            p.log.as_ptr(),
            libc::O_WRONLY | libc::O_CREAT | libc::O_APPEND | libc::O_CLOEXEC,
            0o600,
        );
        check!("open log", log);
        check!("stdout", libc::dup2(log, 1));
        check!("stderr", libc::dup2(log, 2));
        libc::close(log);
        check!(
            "make / private",
            libc::mount(null, c"/".as_ptr(), null, libc::MS_REC | libc::MS_PRIVATE, nodata)
        );
        for (layer, at) in &p.idmapped {
            let tree = clone_tree(libc::AT_FDCWD, layer, false, RO_NOSUID_NODEV, Some(USERNS_FD));
            check!("id-map a template layer", tree);
            let target =
                libc::open(at.as_ptr(), libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC);
            check!("open id-mapped layer mount point", target);
            check!("attach id-mapped layer", attach(tree, target));
            libc::close(target);
        }
        check!(
            "mount overlay root",
            libc::mount(
                c"overlay".as_ptr(),
                p.root.as_ptr(),
                c"overlay".as_ptr(),
                libc::MS_NOSUID | libc::MS_NODEV,
                p.overlay.as_ptr().cast()
            )
        );
        // From here on every path inside the root is the sandbox's and resolved inside it.
        let root = libc::open(p.root.as_ptr(), libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC);
        check!("open root", root);
        for (host, inside) in &p.binds {
            let tree = clone_tree(libc::AT_FDCWD, host, false, RO_NOSUID_NODEV, Some(USERNS_FD));
            check!("id-map a host bind", tree);
            let target = open_in_root(root, inside, libc::O_PATH | libc::O_DIRECTORY);
            check!("open bind target", target);
            check!("attach host bind", attach(tree, target));
            libc::close(target);
        }
        let fs_mount = |m: &FsMount, buf: &mut [u8; 32]| -> i32 {
            let target = open_in_root(root, &m.at, libc::O_PATH | libc::O_DIRECTORY);
            if target < 0 {
                return target;
            }
            let rc = libc::mount(
                m.fstype.as_ptr(),
                fd_path(target, buf),
                m.fstype.as_ptr(),
                m.flags,
                m.data.as_ptr().cast(),
            );
            libc::close(target);
            rc
        };
        check!("mount /dev", fs_mount(&p.dev, &mut buf));
        let dev = open_in_root(root, c"dev", libc::O_PATH | libc::O_DIRECTORY);
        check!("open /dev", dev);
        check!("mkdir /dev/pts", libc::mkdirat(dev, c"pts".as_ptr(), 0o755));
        check!("mkdir /dev/shm", libc::mkdirat(dev, c"shm".as_ptr(), 0o1777));
        check!("mkdir /dev/.empty", libc::mkdirat(dev, EMPTY_DIR.as_ptr(), 0o555));
        for (node, major, minor) in &p.dev_nodes {
            check!(
                "mknod",
                libc::mknodat(
                    dev,
                    node.as_ptr(),
                    libc::S_IFCHR | 0o666,
                    libc::makedev(*major, *minor)
                )
            );
            // Owned by the sandbox's root, like the rest of its /dev.
            check!(
                "chown a device node",
                libc::fchownat(dev, node.as_ptr(), p.root_id, p.root_id, libc::AT_SYMLINK_NOFOLLOW)
            );
        }
        for (target, link) in &p.dev_links {
            check!("symlink in /dev", libc::symlinkat(target.as_ptr(), dev, link.as_ptr()));
        }
        // stdin is the jail's own /dev/null, not a host file.
        let devnull = libc::openat(dev, c"null".as_ptr(), libc::O_RDONLY | libc::O_NOFOLLOW);
        check!("open /dev/null", devnull);
        check!("stdin", libc::dup2(devnull, 0));
        libc::close(devnull);
        libc::close(dev);
        for m in &p.mounts {
            check!("mount a jail filesystem", fs_mount(m, &mut buf));
        }
        let devnull = open_in_root(root, c"dev/null", libc::O_PATH);
        check!("open /dev/null to mask with", devnull);
        let empty = open_in_root(root, c"dev/.empty", libc::O_PATH | libc::O_DIRECTORY);
        check!("open /dev/.empty to mask with", empty);
        for path in &p.masked {
            let target = open_in_root(root, path, libc::O_PATH | libc::O_NOFOLLOW);
            if target < 0 && *libc::__errno_location() == libc::ENOENT {
                continue; // this kernel has no such file
            }
            check!("open a masked path", target);
            let mut st: libc::stat = std::mem::zeroed();
            check!("stat a masked path", libc::fstat(target, &mut st));
            let rc = if st.st_mode & libc::S_IFMT == libc::S_IFDIR {
                let attrs = RO_NOSUID_NODEV | libc::MOUNT_ATTR_NOEXEC;
                let tree = clone_tree(empty, c"", true, attrs, None);
                if tree < 0 { tree } else { attach(tree, target) }
            } else {
                libc::mount(
                    fd_path(devnull, &mut buf2),
                    fd_path(target, &mut buf),
                    null,
                    libc::MS_BIND,
                    nodata,
                )
            };
            check!("mask a /proc path", rc);
            libc::close(target);
        }
        libc::close(devnull);
        libc::close(empty);
        for path in &p.read_only {
            let target = open_in_root(root, path, libc::O_PATH | libc::O_NOFOLLOW);
            if target < 0 && *libc::__errno_location() == libc::ENOENT {
                continue;
            }
            check!("open a read-only path", target);
            let tree =
                clone_tree(target, c"", true, RO_NOSUID_NODEV | libc::MOUNT_ATTR_NOEXEC, None);
            check!("read-only copy of a /proc path", tree);
            check!("make a /proc path read-only", attach(tree, target));
            libc::close(target);
        }
        // silkd: bound over a regular file at /run/silkd. `/tmp` and `/run` are the root's own
        // directories, as in a container or a VM: what a sandbox keeps there is on its disk
        // and in its captures, and a dump has no tmpfs of theirs to tar and untar (~2 ms
        // each way per tmpfs, a process of its own). The file stays in the sandbox's upper
        // directory for the next launch; `mknodat` follows nothing and leaves what is there.
        let run = open_in_root(root, c"run", libc::O_PATH | libc::O_DIRECTORY);
        check!("open /run", run);
        if libc::mknodat(run, c"silkd".as_ptr(), libc::S_IFREG | 0o755, 0) != 0
            && *libc::__errno_location() != libc::EEXIST
        {
            return ("create /run/silkd", *libc::__errno_location());
        }
        let target =
            libc::openat(run, c"silkd".as_ptr(), libc::O_PATH | libc::O_NOFOLLOW | libc::O_CLOEXEC);
        check!("open /run/silkd", target);
        let mut st: libc::stat = std::mem::zeroed();
        check!("stat /run/silkd", libc::fstat(target, &mut st));
        if st.st_mode & libc::S_IFMT != libc::S_IFREG {
            return ("/run/silkd is not a regular file", libc::EEXIST);
        }
        // The sandbox's root owns it, as it owns the rest of its files (one from a golden's
        // layer already does: no copy-up into this box's upper directory for it).
        if (st.st_uid, st.st_gid) != (p.root_id, p.root_id) {
            check!(
                "chown /run/silkd",
                libc::fchownat(target, c"".as_ptr(), p.root_id, p.root_id, libc::AT_EMPTY_PATH)
            );
        }
        let tree = clone_tree(libc::AT_FDCWD, &p.silkd_source, false, RO_NOSUID_NODEV, None);
        check!("clone silkd", tree);
        check!("bind silkd", attach(tree, target));
        libc::close(target);
        libc::close(run);
        libc::close(root);
        check!("sethostname", libc::sethostname(p.hostname.as_ptr(), p.hostname.as_bytes().len()));
        check!("loopback", loopback_up());
        // The network namespace belongs to the host's user namespace, so the sandbox's root
        // holds no CAP_NET_BIND_SERVICE over it: open every port to it, as Docker does.
        let ports = libc::open(
            c"/proc/sys/net/ipv4/ip_unprivileged_port_start".as_ptr(),
            libc::O_WRONLY | libc::O_CLOEXEC,
        );
        check!("open ip_unprivileged_port_start", ports);
        check!(
            "set ip_unprivileged_port_start",
            libc::write(ports, c"0".as_ptr().cast(), 1) as i32
        );
        libc::close(ports);
        check!("chdir root", libc::chdir(p.root.as_ptr()));
        check!(
            "pivot_root",
            libc::syscall(libc::SYS_pivot_root, c".".as_ptr(), c".".as_ptr()) as i32
        );
        check!("detach old root", libc::umount2(c".".as_ptr(), libc::MNT_DETACH));
        check!("chdir /", libc::chdir(c"/".as_ptr()));
        // Become the sandbox's root: an unprivileged id on the host, root only over what its
        // user namespace owns (nothing but its mapped files: every namespace above belongs to
        // the host's user namespace).
        check!("enter the user namespace", libc::setns(USERNS_FD, libc::CLONE_NEWUSER));
        libc::close(USERNS_FD);
        check!("drop supplementary groups", libc::setgroups(0, std::ptr::null()));
        check!("setresgid", libc::setresgid(0, 0, 0));
        check!("setresuid", libc::setresuid(0, 0, 0));
        // The sandbox's own files, written with the sandbox's own rights, never through a link.
        write_file(c"/etc/hostname", p.hostname_line.as_bytes(), 0o644);
        write_file(c"/etc/machine-id", p.machine_id.as_bytes(), 0o444);
        if let Some(conf) = &p.resolv_conf {
            write_file(c"/etc/resolv.conf", conf.as_bytes(), 0o644);
        }
        libc::umask(0o022);
        check!("drop capabilities", drop_caps());
        check!("no_new_privs", libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0));
        let prog =
            libc::sock_fprog { len: p.filter.len() as u16, filter: p.filter.as_ptr() as *mut _ };
        check!(
            "seccomp",
            libc::prctl(
                libc::PR_SET_SECCOMP,
                libc::SECCOMP_MODE_FILTER,
                &prog as *const libc::sock_fprog
            )
        );
        // Nothing of the host's but the listening socket reaches silkd (and its commands).
        check!(
            "close inherited fds",
            libc::syscall(libc::SYS_close_range, LISTEN_FD + 1, u32::MAX, 0) as i32
        );
        // The listening socket must survive exec.
        check!("keep listen fd", libc::fcntl(LISTEN_FD, libc::F_SETFD, 0));
        let envp = [p.envp[0].as_ptr(), p.envp[1].as_ptr(), null];
        libc::execve(p.exe.as_ptr(), p.argv_ptrs.as_ptr(), envp.as_ptr());
        ("exec silkd", *libc::__errno_location())
    }
}
