//! The launcher (`silk-jail`): turns a [`LaunchSpec`] into a running jail with silkd as PID 1.
//!
//! It runs as its own short-lived, single-threaded process, so everything between `fork` and
//! `exec` is plain syscalls on data prepared beforehand. Order of work:
//!
//! 1. join the sandbox's cgroups (made by the engine, limits already set), then `unshare` mount,
//!    pid, uts, ipc, net and cgroup namespaces;
//! 2. `fork`: the child is PID 1 of the new pid namespace. It builds the root (overlay, read-only
//!    binds, `/proc`, a minimal `/dev` with a private devpts, tmpfs `/tmp` and `/run`, silkd bound
//!    at `/run/silkd`, a fresh machine-id), sets the hostname, brings loopback up, pivots into the
//!    root and detaches the old one, drops capabilities, sets `no_new_privs`, installs the seccomp
//!    filter and execs silkd on the listening socket the engine passed as fd 3;
//! 3. the parent learns through a close-on-exec pipe whether the child reached `exec` (EOF) or
//!    failed (an error message), prints the child's host pid, and exits. The jail is not our
//!    child afterwards: it outlives the node process, which re-adopts it on restart.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::seccomp;

/// The fd number silkd's listening socket has in the launcher and in the jail.
pub const LISTEN_FD: i32 = 3;

/// Everything the launcher needs, written by the engine as JSON.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LaunchSpec {
    pub hostname: String,
    /// Where the overlay is mounted (on the host, inside the new mount namespace only).
    pub root: PathBuf,
    /// Read-only layers, top first.
    pub lowers: Vec<PathBuf>,
    pub upper: PathBuf,
    pub work: PathBuf,
    /// Host directories bound read-only: (host path, path inside the root).
    pub binds: Vec<(PathBuf, PathBuf)>,
    /// The silkd binary on the host (static, so it runs in any root filesystem).
    pub silkd: PathBuf,
    /// cgroup directories to join.
    pub cgroups: Vec<PathBuf>,
    /// silkd's stdout and stderr.
    pub log: PathBuf,
    /// Extra silkd arguments (an image's default env, working directory and user).
    #[serde(default)]
    pub silkd_args: Vec<String>,
}

/// Capabilities root keeps inside a sandbox (like a container's default set, minus `MKNOD`: no
/// device cgroup guards device nodes here, so creating them is not allowed at all).
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

fn c(path: &Path) -> CString {
    CString::new(path.as_os_str().as_bytes()).expect("launch paths have no NUL bytes")
}

fn cs(s: &str) -> CString {
    CString::new(s).expect("no NUL bytes")
}

/// A mount to perform inside the child, prepared before `fork`.
struct Mount {
    source: Option<CString>,
    target: CString,
    fstype: Option<CString>,
    flags: libc::c_ulong,
    data: Option<CString>,
}

/// Every string and table the child uses, allocated before `fork`.
struct Plan {
    root: CString,
    mounts: Vec<Mount>,
    /// Bind targets to remount read-only after binding.
    readonly: Vec<CString>,
    dev_nodes: Vec<(CString, u32, u32)>,
    dev_links: Vec<(CString, CString)>,
    dirs: Vec<(CString, u32)>,
    silkd_target: CString,
    silkd_source: CString,
    machine_id: CString,
    hostname: CString,
    hostname_line: CString,
    log: CString,
    exe: CString,
    /// Owns the strings `argv_ptrs` points into.
    _argv: Vec<CString>,
    argv_ptrs: Vec<*const libc::c_char>,
    envp: [CString; 2],
    cgroup_procs: Vec<CString>,
    filter: Vec<libc::sock_filter>,
}

fn plan(spec: &LaunchSpec) -> Plan {
    let at = |rel: &str| c(&spec.root.join(rel));
    let lowers = spec.lowers.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(":");
    let overlay = format!(
        "lowerdir={lowers},upperdir={},workdir={}",
        spec.upper.display(),
        spec.work.display()
    );
    let nosuid_nodev = libc::MS_NOSUID | libc::MS_NODEV;
    let mut mounts = vec![Mount {
        source: Some(cs("overlay")),
        target: c(&spec.root),
        fstype: Some(cs("overlay")),
        flags: 0,
        data: Some(cs(&overlay)),
    }];
    let mut readonly = vec![];
    for (host, inside) in &spec.binds {
        let target = c(&spec.root.join(inside));
        mounts.push(Mount {
            source: Some(c(host)),
            target: target.clone(),
            fstype: None,
            flags: libc::MS_BIND | libc::MS_REC,
            data: None,
        });
        readonly.push(target);
    }
    let tmpfs = |rel: &str, opts: &str, flags: libc::c_ulong| Mount {
        source: Some(cs("tmpfs")),
        target: at(rel),
        fstype: Some(cs("tmpfs")),
        flags,
        data: Some(cs(opts)),
    };
    mounts.push(Mount {
        source: Some(cs("proc")),
        target: at("proc"),
        fstype: Some(cs("proc")),
        flags: nosuid_nodev | libc::MS_NOEXEC,
        data: None,
    });
    // /dev must allow device nodes: it holds the few the launcher makes (and no one else can).
    mounts.push(tmpfs("dev", "mode=755,size=64k", libc::MS_NOSUID | libc::MS_NOEXEC));
    mounts.push(tmpfs("tmp", "mode=1777", nosuid_nodev));
    mounts.push(tmpfs("run", "mode=755", nosuid_nodev));
    // After /dev exists: devpts and shm inside it (dirs made in between, see `child`).
    let late_mounts = [
        Mount {
            source: Some(cs("devpts")),
            target: at("dev/pts"),
            fstype: Some(cs("devpts")),
            flags: libc::MS_NOSUID | libc::MS_NOEXEC,
            data: Some(cs("newinstance,ptmxmode=0666,mode=620")),
        },
        tmpfs("dev/shm", "mode=1777", nosuid_nodev | libc::MS_NOEXEC),
    ];
    mounts.extend(late_mounts);
    let dev_nodes = [
        ("null", 1, 3),
        ("zero", 1, 5),
        ("full", 1, 7),
        ("random", 1, 8),
        ("urandom", 1, 9),
        ("tty", 5, 0),
    ]
    .iter()
    .map(|(n, ma, mi)| (at(&format!("dev/{n}")), *ma, *mi))
    .collect();
    let dev_links = [
        ("pts/ptmx", "ptmx"),
        ("/proc/self/fd", "fd"),
        ("/proc/self/fd/0", "stdin"),
        ("/proc/self/fd/1", "stdout"),
        ("/proc/self/fd/2", "stderr"),
    ]
    .iter()
    .map(|(target, name)| (cs(target), at(&format!("dev/{name}"))))
    .collect();
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
        mounts,
        readonly,
        dev_nodes,
        dev_links,
        dirs: vec![(at("dev/pts"), 0o755), (at("dev/shm"), 0o1777)],
        silkd_target: at("run/silkd"),
        silkd_source: c(&spec.silkd),
        machine_id: cs(&machine_id),
        hostname: cs(&spec.hostname),
        hostname_line: cs(&format!("{}\n", spec.hostname)),
        log: c(&spec.log),
        exe: cs("/run/silkd"),
        argv_ptrs: argv.iter().map(|a| a.as_ptr()).chain([std::ptr::null()]).collect(),
        _argv: argv,
        envp: [
            cs("PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"),
            cs("HOME=/root"),
        ],
        cgroup_procs: spec.cgroups.iter().map(|d| c(&d.join("cgroup.procs"))).collect(),
        filter: seccomp::program(),
    }
}

/// Runs the launcher. Returns the jail's host pid, or why it could not start.
pub fn run(spec: &LaunchSpec) -> Result<u32, String> {
    let plan = plan(spec);
    let me = std::process::id().to_string();
    for procs in &plan.cgroup_procs {
        std::fs::write(procs.to_str().unwrap_or_default(), &me)
            .map_err(|e| format!("join cgroup {procs:?}: {e}"))?;
    }
    let flags = libc::CLONE_NEWNS
        | libc::CLONE_NEWPID
        | libc::CLONE_NEWUTS
        | libc::CLONE_NEWIPC
        | libc::CLONE_NEWNET
        | libc::CLONE_NEWCGROUP;
    // SAFETY: plain syscalls on a single-threaded process.
    unsafe {
        if libc::unshare(flags) != 0 {
            return Err(format!("unshare: {}", std::io::Error::last_os_error()));
        }
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
    unsafe {
        check!("setsid", libc::setsid());
        let log = libc::open(
            p.log.as_ptr(),
            libc::O_WRONLY | libc::O_CREAT | libc::O_APPEND | libc::O_CLOEXEC,
            0o600,
        );
        check!("open log", log);
        let devnull = libc::open(c"/dev/null".as_ptr(), libc::O_RDONLY);
        check!("open /dev/null", devnull);
        check!("stdin", libc::dup2(devnull, 0));
        check!("stdout", libc::dup2(log, 1));
        check!("stderr", libc::dup2(log, 2));
        check!(
            "make / private",
            libc::mount(null, c"/".as_ptr(), null, libc::MS_REC | libc::MS_PRIVATE, nodata)
        );
        for (i, m) in p.mounts.iter().enumerate() {
            if i == p.mounts.len() - 2 {
                // /dev is mounted: fill it before devpts and shm go in.
                for (dir, mode) in &p.dirs {
                    check!("mkdir in /dev", libc::mkdir(dir.as_ptr(), *mode));
                }
                for (node, major, minor) in &p.dev_nodes {
                    check!(
                        "mknod",
                        libc::mknod(
                            node.as_ptr(),
                            libc::S_IFCHR | 0o666,
                            libc::makedev(*major, *minor)
                        )
                    );
                    check!("chmod dev", libc::chmod(node.as_ptr(), 0o666));
                }
                for (target, link) in &p.dev_links {
                    check!("symlink in /dev", libc::symlink(target.as_ptr(), link.as_ptr()));
                }
            }
            let opt = |s: &Option<CString>| s.as_ref().map_or(null, |s| s.as_ptr());
            check!(
                "mount",
                libc::mount(
                    opt(&m.source),
                    m.target.as_ptr(),
                    opt(&m.fstype),
                    m.flags,
                    opt(&m.data).cast()
                )
            );
            if p.readonly.iter().any(|t| t == &m.target) {
                let ro = libc::MS_BIND
                    | libc::MS_REMOUNT
                    | libc::MS_RDONLY
                    | libc::MS_NOSUID
                    | libc::MS_NODEV;
                check!(
                    "remount bind read-only",
                    libc::mount(null, m.target.as_ptr(), null, ro, nodata)
                );
            }
        }
        // silkd: an empty file on the fresh /run tmpfs, with the host binary bound over it.
        let fd = libc::open(
            p.silkd_target.as_ptr(),
            libc::O_WRONLY | libc::O_CREAT | libc::O_CLOEXEC,
            0o755,
        );
        check!("create /run/silkd", fd);
        libc::close(fd);
        check!(
            "bind silkd",
            libc::mount(
                p.silkd_source.as_ptr(),
                p.silkd_target.as_ptr(),
                null,
                libc::MS_BIND,
                nodata
            )
        );
        check!(
            "remount silkd",
            libc::mount(
                null,
                p.silkd_target.as_ptr(),
                null,
                libc::MS_BIND
                    | libc::MS_REMOUNT
                    | libc::MS_RDONLY
                    | libc::MS_NOSUID
                    | libc::MS_NODEV,
                nodata
            )
        );
        check!("sethostname", libc::sethostname(p.hostname.as_ptr(), p.hostname.as_bytes().len()));
        check!("loopback", loopback_up());
        check!("chdir root", libc::chdir(p.root.as_ptr()));
        // /etc/hostname agrees with the hostname (the skeleton's says `sandbox`).
        let hn = libc::open(
            c"etc/hostname".as_ptr(),
            libc::O_WRONLY | libc::O_CREAT | libc::O_TRUNC | libc::O_CLOEXEC,
            0o644,
        );
        if hn >= 0 {
            libc::write(hn, p.hostname_line.as_ptr().cast(), p.hostname_line.as_bytes().len());
            libc::close(hn);
        }
        let mid = libc::open(
            c"etc/machine-id".as_ptr(),
            libc::O_WRONLY | libc::O_CREAT | libc::O_TRUNC | libc::O_CLOEXEC,
            0o444,
        );
        if mid >= 0 {
            libc::write(mid, p.machine_id.as_ptr().cast(), p.machine_id.as_bytes().len());
            libc::close(mid);
        }
        check!(
            "pivot_root",
            libc::syscall(libc::SYS_pivot_root, c".".as_ptr(), c".".as_ptr()) as i32
        );
        check!("detach old root", libc::umount2(c".".as_ptr(), libc::MNT_DETACH));
        check!("chdir /", libc::chdir(c"/".as_ptr()));
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
        // The listening socket must survive exec.
        check!("keep listen fd", libc::fcntl(LISTEN_FD, libc::F_SETFD, 0));
        let envp = [p.envp[0].as_ptr(), p.envp[1].as_ptr(), null];
        libc::execve(p.exe.as_ptr(), p.argv_ptrs.as_ptr(), envp.as_ptr());
        ("exec silkd", *libc::__errno_location())
    }
}

/// `ip link set lo up`, with an ioctl.
unsafe fn loopback_up() -> i32 {
    unsafe {
        let sock = libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0);
        if sock < 0 {
            return sock;
        }
        let mut req: libc::ifreq = std::mem::zeroed();
        req.ifr_name[0] = b'l' as libc::c_char;
        req.ifr_name[1] = b'o' as libc::c_char;
        req.ifr_ifru.ifru_flags =
            (libc::IFF_UP | libc::IFF_LOOPBACK | libc::IFF_RUNNING) as libc::c_short;
        let rc = libc::ioctl(sock, libc::SIOCSIFFLAGS, &req);
        libc::close(sock);
        rc
    }
}

/// Shrinks the bounding set and the process's capability sets to [`KEEP_CAPS`].
unsafe fn drop_caps() -> i32 {
    unsafe {
        let mut keep: u64 = 0;
        for cap in KEEP_CAPS {
            keep |= 1 << cap;
        }
        for cap in 0..64u32 {
            if keep & (1 << cap) == 0
                && libc::prctl(libc::PR_CAPBSET_DROP, cap as libc::c_ulong, 0, 0, 0) < 0
            {
                // EINVAL: past the last capability this kernel knows.
                if *libc::__errno_location() == libc::EINVAL {
                    break;
                }
                return -1;
            }
        }
        #[repr(C)]
        struct Header {
            version: u32,
            pid: i32,
        }
        #[repr(C)]
        struct Data {
            effective: u32,
            permitted: u32,
            inheritable: u32,
        }
        let header = Header { version: 0x2008_0522, pid: 0 }; // _LINUX_CAPABILITY_VERSION_3
        let lo = keep as u32;
        let hi = (keep >> 32) as u32;
        let data = [
            Data { effective: lo, permitted: lo, inheritable: 0 },
            Data { effective: hi, permitted: hi, inheritable: 0 },
        ];
        libc::syscall(libc::SYS_capset, &header, data.as_ptr()) as i32
    }
}
