//! A restore: brings a jail back from CRIU images, in a launcher the server forks (see `serve`:
//! the engine sends a [`RestoreSpec`], silkd's log attached). The launcher prepares,
//! in a mount namespace of its own (gone when CRIU exits, so the host's mount table never sees
//! any of it), what the dump declared external, then execs `criu restore`, which recreates the
//! jail's own namespaces, mounts and processes:
//!
//! - the overlay root (template, golden and the box's upper directory, as at launch), given
//!   to CRIU as `--root`;
//! - id-mapped views of the template's host binds (`bind<i>`), silkd (`silkd`) and a fresh
//!   `/dev` (`dev`: tmpfs with the same nodes the launcher makes), in a staging directory any
//!   uid may traverse: CRIU binds them from inside the restored user namespace, whose root is an
//!   unprivileged host id that cannot pass the engine's 0700 directories;
//! - silkd's log, which the dump declared an external file, as an inherited descriptor.
//!
//! Joining the sandbox's cgroups first puts every restored process in them (CRIU is told to
//! leave cgroups alone).

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::sys::{RO_NOSUID_NODEV, attach, clone_tree};
use super::{DEV_LINKS, DEV_NODES, Lower, USERNS_FD, overlay_options};

/// The descriptor silkd's log arrives on, for CRIU's `--inherit-fd`.
pub const LOG_FD: i32 = 5;

/// Everything a restore needs, sent by the engine as JSON.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RestoreSpec {
    pub criu: PathBuf,
    /// CRIU's image directory.
    pub images: PathBuf,
    /// CRIU's own log of the restore.
    pub criu_log: PathBuf,
    /// Where CRIU writes the restored init's host pid.
    pub pidfile: PathBuf,
    pub root: PathBuf,
    pub lowers: Vec<Lower>,
    pub upper: PathBuf,
    pub work: PathBuf,
    /// The template's host binds, in the order the dump named them (`bind0`, `bind1`, ...).
    pub binds: Vec<PathBuf>,
    pub silkd: PathBuf,
    /// An empty directory every uid may traverse (0711, root's).
    pub staging: PathBuf,
    /// The host uid and gid that is root inside.
    pub root_id: u32,
    pub cgroups: Vec<PathBuf>,
    /// The dump's key for silkd's log (`file[<mnt>:<ino>]`).
    pub log_key: String,
    /// A copy under a new id (branch, fork): its hostname, set in the restored uts namespace
    /// and written to `/etc/hostname`, with a new `/etc/machine-id`.
    pub hostname: Option<String>,
    /// The dump left the network namespace out: CRIU makes a new one, its loopback up.
    #[serde(default)]
    pub empty_net: bool,
}

fn os(what: &str) -> String {
    format!("{what}: {}", std::io::Error::last_os_error())
}

fn c(path: &Path) -> CString {
    CString::new(path.as_os_str().as_bytes()).expect("restore paths have no NUL bytes")
}

fn mount(
    src: &str,
    at: &Path,
    fstype: &str,
    flags: libc::c_ulong,
    data: &str,
) -> Result<(), String> {
    let (src, at_c, fstype, data) = (
        CString::new(src).unwrap(),
        c(at),
        CString::new(fstype).unwrap(),
        CString::new(data).unwrap(),
    );
    // SAFETY: valid C strings.
    if unsafe {
        libc::mount(src.as_ptr(), at_c.as_ptr(), fstype.as_ptr(), flags, data.as_ptr().cast())
    } != 0
    {
        return Err(os(&format!("mount {fstype:?} on {}", at.display())));
    }
    Ok(())
}

/// Attaches a detached copy of `source` (id-mapped through the sandboxes' user namespace when
/// `idmap`), read-only, onto `at`.
fn bind(source: &Path, at: &Path, idmap: bool) -> Result<(), String> {
    // SAFETY: plain syscalls on descriptors opened here.
    unsafe {
        let tree = clone_tree(
            libc::AT_FDCWD,
            &c(source),
            false,
            RO_NOSUID_NODEV,
            idmap.then_some(USERNS_FD),
        );
        if tree < 0 {
            return Err(os(&format!("clone {}", source.display())));
        }
        let target = libc::open(c(at).as_ptr(), libc::O_PATH | libc::O_CLOEXEC);
        if target < 0 {
            libc::close(tree);
            return Err(os(&format!("open {}", at.display())));
        }
        let rc = attach(tree, target);
        libc::close(target);
        if rc < 0 {
            return Err(os(&format!("attach {}", source.display())));
        }
    }
    Ok(())
}

/// A jail's `/dev` as the launcher makes it, in `dir`.
fn make_dev(dir: &Path, root_id: u32) -> Result<(), String> {
    let owner = format!("uid={root_id},gid={root_id}");
    mount(
        "tmpfs",
        dir,
        "tmpfs",
        libc::MS_NOSUID | libc::MS_NOEXEC,
        &format!("mode=755,size=64k,{owner}"),
    )?;
    for (name, major, minor) in DEV_NODES {
        let path = c(&dir.join(name));
        // SAFETY: plain syscalls on a path made here.
        unsafe {
            if libc::mknod(path.as_ptr(), libc::S_IFCHR | 0o666, libc::makedev(*major, *minor)) != 0
                || libc::chmod(path.as_ptr(), 0o666) != 0
                || libc::lchown(path.as_ptr(), root_id, root_id) != 0
            {
                return Err(os(&format!("make /dev/{name}")));
            }
        }
    }
    for (sub, mode) in [("pts", 0o755), ("shm", 0o1777)] {
        std::fs::create_dir(dir.join(sub)).map_err(|e| format!("mkdir /dev/{sub}: {e}"))?;
        std::os::unix::fs::chown(dir.join(sub), Some(root_id), Some(root_id))
            .map_err(|e| format!("chown /dev/{sub}: {e}"))?;
        std::fs::set_permissions(dir.join(sub), std::os::unix::fs::PermissionsExt::from_mode(mode))
            .map_err(|e| format!("chmod /dev/{sub}: {e}"))?;
    }
    // The masks' source stays the host root's, as the launcher makes it: the sandbox's root
    // may not put anything in it.
    let empty = dir.join(super::EMPTY_DIR.to_str().expect("ASCII"));
    std::fs::create_dir(&empty).map_err(|e| format!("mkdir /dev/.empty: {e}"))?;
    std::fs::set_permissions(&empty, std::os::unix::fs::PermissionsExt::from_mode(0o555))
        .map_err(|e| format!("chmod /dev/.empty: {e}"))?;
    for (target, link) in DEV_LINKS {
        std::os::unix::fs::symlink(target, dir.join(link))
            .map_err(|e| format!("symlink /dev/{link}: {e}"))?;
    }
    Ok(())
}

/// Prepares the mounts, runs CRIU and gives a copy its own identity; returns the restored
/// init's host pid. `Err` says why not (CRIU's reasons are in its log).
pub fn run(spec: &RestoreSpec) -> Result<u32, String> {
    let status =
        prepare(spec)?.status().map_err(|e| format!("run {}: {e}", spec.criu.display()))?;
    if !status.success() {
        return Err(format!("criu restore failed ({status})"));
    }
    let pid: u32 = std::fs::read_to_string(&spec.pidfile)
        .ok()
        .and_then(|p| p.trim().parse().ok())
        .ok_or("criu wrote no pid")?;
    if let Some(hostname) = &spec.hostname {
        rename(pid, hostname, spec.root_id)?;
    }
    Ok(pid)
}

/// Sets the restored jail's hostname and writes its `/etc/hostname` and a new
/// `/etc/machine-id` (resolved inside its root, no link followed, owned by its root).
fn rename(pid: u32, hostname: &str, root_id: u32) -> Result<(), String> {
    let uts = std::fs::File::open(format!("/proc/{pid}/ns/uts"))
        .map_err(|e| format!("open the restored uts namespace: {e}"))?;
    // SAFETY: plain syscalls; this process exits right after.
    unsafe {
        if libc::setns(std::os::fd::AsRawFd::as_raw_fd(&uts), libc::CLONE_NEWUTS) != 0
            || libc::sethostname(hostname.as_ptr().cast(), hostname.len()) != 0
        {
            return Err(os("set the restored hostname"));
        }
    }
    let root = std::fs::File::open(format!("/proc/{pid}/root"))
        .map_err(|e| format!("open the restored root: {e}"))?;
    let mut id = [0u8; 16];
    // SAFETY: getrandom fills the buffer it is given.
    unsafe { libc::getrandom(id.as_mut_ptr().cast(), id.len(), 0) };
    let machine_id: String = id.iter().map(|b| format!("{b:02x}")).collect::<String>() + "\n";
    for (path, content, mode) in
        [(c"etc/hostname", format!("{hostname}\n"), 0o644), (c"etc/machine-id", machine_id, 0o444)]
    {
        // Best effort, as at launch: an image without /etc still runs.
        // SAFETY: plain syscalls on descriptors held here.
        unsafe {
            let fd = super::sys::open_in_root(
                std::os::fd::AsRawFd::as_raw_fd(&root),
                path,
                libc::O_WRONLY
                    | libc::O_CREAT
                    | libc::O_TRUNC
                    | libc::O_NOFOLLOW
                    | libc::O_NONBLOCK,
            );
            if fd < 0 {
                continue;
            }
            let mut st: libc::stat = std::mem::zeroed();
            if libc::fstat(fd, &mut st) == 0 && st.st_mode & libc::S_IFMT == libc::S_IFREG {
                libc::write(fd, content.as_ptr().cast(), content.len());
                libc::fchown(fd, root_id, root_id);
                libc::fchmod(fd, mode);
            }
            libc::close(fd);
        }
    }
    Ok(())
}

fn prepare(spec: &RestoreSpec) -> Result<std::process::Command, String> {
    super::join_cgroups(&spec.cgroups)?;
    // SAFETY: plain syscalls in a single-threaded process.
    unsafe {
        if libc::unshare(libc::CLONE_NEWNS) != 0 {
            return Err(os("unshare the mount namespace"));
        }
        if libc::mount(
            std::ptr::null(),
            c"/".as_ptr(),
            std::ptr::null(),
            libc::MS_REC | libc::MS_PRIVATE,
            std::ptr::null(),
        ) != 0
        {
            return Err(os("make / private"));
        }
    }
    for lower in &spec.lowers {
        if let Some(at) = &lower.idmapped_at {
            bind(&lower.path, at, true)?;
        }
    }
    let overlay = overlay_options(&spec.lowers, &spec.upper, &spec.work);
    mount("overlay", &spec.root, "overlay", libc::MS_NOSUID | libc::MS_NODEV, &overlay)?;
    let staging = &spec.staging;
    mount("tmpfs", staging, "tmpfs", libc::MS_NOSUID | libc::MS_NODEV, "mode=711,size=64k")?;
    let dev = staging.join("dev");
    std::fs::create_dir(&dev).map_err(|e| format!("mkdir staging dev: {e}"))?;
    make_dev(&dev, spec.root_id)?;
    let silkd = staging.join("silkd");
    std::fs::write(&silkd, b"").map_err(|e| format!("staging silkd: {e}"))?;
    bind(&spec.silkd, &silkd, false)?;
    let mut criu = std::process::Command::new(&spec.criu);
    criu.arg("restore")
        .arg("--images-dir")
        .arg(&spec.images)
        .arg("--root")
        .arg(&spec.root)
        .args(["--restore-detached", "--tcp-established", "--manage-cgroups=ignore", "-v2"])
        .arg("--log-file")
        .arg(&spec.criu_log)
        .arg("--pidfile")
        .arg(&spec.pidfile)
        .arg("--ext-mount-map")
        .arg(format!("silkd:{}", silkd.display()))
        .arg("--ext-mount-map")
        .arg(format!("dev:{}", dev.display()))
        .arg("--inherit-fd")
        .arg(format!("fd[{LOG_FD}]:{}", spec.log_key))
        .stdin(std::process::Stdio::null());
    if spec.empty_net {
        criu.args(["--empty-ns", "net"]);
    }
    for (i, host) in spec.binds.iter().enumerate() {
        let at = staging.join(format!("bind{i}"));
        std::fs::create_dir(&at).map_err(|e| format!("mkdir staging bind: {e}"))?;
        bind(host, &at, true)?;
        criu.arg("--ext-mount-map").arg(format!("bind{i}:{}", at.display()));
    }
    Ok(criu)
}
