//! The system calls the launcher's child makes between `fork` and `exec`: no allocation, raw
//! descriptors, results as the kernel gives them (negative on failure, errno set).

use std::ffi::CStr;

use super::KEEP_CAPS;

/// `/proc/self/fd/<fd>`, written into `buf` without allocating: mounting onto this path mounts
/// onto exactly the file `fd` was opened on.
pub(super) fn fd_path(fd: i32, buf: &mut [u8; 32]) -> *const libc::c_char {
    const PREFIX: &[u8] = b"/proc/self/fd/";
    buf[..PREFIX.len()].copy_from_slice(PREFIX);
    let mut digits = [0u8; 10];
    let (mut n, mut len) = (fd as u32, 0);
    loop {
        digits[len] = b'0' + (n % 10) as u8;
        len += 1;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    for i in 0..len {
        buf[PREFIX.len() + i] = digits[len - 1 - i];
    }
    buf[PREFIX.len() + len] = 0;
    buf.as_ptr().cast()
}

/// Opens `rel` inside the root, refusing any symlink on the way (and `/proc` magic links):
/// runc's rule for mount points. A link would at best resolve inside the root
/// (`RESOLVE_IN_ROOT` keeps that too), but it could still move `/proc` somewhere a later mount
/// hides, leaving its masks to resolve nowhere; a rootfs with a symlinked `/proc` or `/tmp` does
/// not start.
pub(super) unsafe fn open_in_root(root: i32, rel: &CStr, flags: i32) -> i32 {
    /// `struct open_how` (libc's is non-exhaustive).
    #[repr(C)]
    struct OpenHow {
        flags: u64,
        mode: u64,
        resolve: u64,
    }
    let how = OpenHow {
        flags: (flags | libc::O_CLOEXEC) as u64,
        mode: 0,
        resolve: libc::RESOLVE_IN_ROOT | libc::RESOLVE_NO_MAGICLINKS | libc::RESOLVE_NO_SYMLINKS,
    };
    unsafe {
        libc::syscall(
            libc::SYS_openat2,
            root,
            rel.as_ptr(),
            &how as *const OpenHow,
            std::mem::size_of::<OpenHow>(),
        ) as i32
    }
}

/// A detached copy of the mount tree at `path` (relative to `dirfd`), with `attrs` set on it
/// (and id-mapped through `userns` when given); -1 on failure.
pub(super) unsafe fn clone_tree(
    dirfd: i32,
    path: &CStr,
    empty: bool,
    attrs: u64,
    userns: Option<i32>,
) -> i32 {
    unsafe {
        let mut flags = libc::OPEN_TREE_CLONE | libc::OPEN_TREE_CLOEXEC | libc::AT_RECURSIVE as u32;
        if empty {
            flags |= libc::AT_EMPTY_PATH as u32;
        }
        let tree = libc::syscall(libc::SYS_open_tree, dirfd, path.as_ptr(), flags) as i32;
        if tree < 0 {
            return tree;
        }
        let mut attr: libc::mount_attr = std::mem::zeroed();
        attr.attr_set = attrs;
        if let Some(ns) = userns {
            attr.attr_set |= libc::MOUNT_ATTR_IDMAP;
            attr.userns_fd = ns as u64;
        }
        let rc = libc::syscall(
            libc::SYS_mount_setattr,
            tree,
            c"".as_ptr(),
            libc::AT_EMPTY_PATH | libc::AT_RECURSIVE,
            &attr as *const libc::mount_attr,
            std::mem::size_of::<libc::mount_attr>(),
        );
        if rc < 0 {
            libc::close(tree);
            return -1;
        }
        tree
    }
}

/// Attaches the detached tree `tree` onto the file `target_fd` was opened on.
pub(super) unsafe fn attach(tree: i32, target_fd: i32) -> i32 {
    unsafe {
        let rc = libc::syscall(
            libc::SYS_move_mount,
            tree,
            c"".as_ptr(),
            target_fd,
            c"".as_ptr(),
            libc::MOVE_MOUNT_F_EMPTY_PATH | libc::MOVE_MOUNT_T_EMPTY_PATH,
        ) as i32;
        libc::close(tree);
        rc
    }
}

pub(super) const RO_NOSUID_NODEV: u64 =
    libc::MOUNT_ATTR_RDONLY | libc::MOUNT_ATTR_NOSUID | libc::MOUNT_ATTR_NODEV;

/// Replaces the file at `path` with `content`. A symlink there is removed, not followed. Best
/// effort: an image without `/etc` still starts.
pub(super) unsafe fn write_file(path: &CStr, content: &[u8], mode: libc::mode_t) {
    unsafe {
        // O_NONBLOCK: a FIFO there must not hang the launcher (nothing reads it yet).
        let flags = libc::O_WRONLY
            | libc::O_CREAT
            | libc::O_TRUNC
            | libc::O_NOFOLLOW
            | libc::O_NONBLOCK
            | libc::O_CLOEXEC;
        let mut fd = libc::open(path.as_ptr(), flags, mode);
        let mut st: libc::stat = std::mem::zeroed();
        if fd >= 0 && (libc::fstat(fd, &mut st) != 0 || st.st_mode & libc::S_IFMT != libc::S_IFREG)
        {
            libc::close(fd);
            fd = -1;
        }
        if fd < 0 {
            // A symlink, FIFO or other non-file there: replaced, never written through.
            libc::unlink(path.as_ptr());
            fd = libc::open(path.as_ptr(), flags | libc::O_EXCL, mode);
        }
        if fd >= 0 {
            libc::write(fd, content.as_ptr().cast(), content.len());
            libc::close(fd);
        }
    }
}

/// `ip link set lo up`, with an ioctl.
pub(super) unsafe fn loopback_up() -> i32 {
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
pub(super) unsafe fn drop_caps() -> i32 {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fd_paths_are_written_without_allocating() {
        let mut buf = [0u8; 32];
        for fd in [0, 7, 10, 1234, i32::MAX] {
            // SAFETY: fd_path writes a NUL-terminated string into buf.
            let s = unsafe { CStr::from_ptr(fd_path(fd, &mut buf)) };
            assert_eq!(s.to_str().unwrap(), format!("/proc/self/fd/{fd}"));
        }
    }
}
