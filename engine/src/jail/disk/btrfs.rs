//! btrfs: a subvolume per sandbox with a qgroup limit on what it refers to (`max_rfer`); a write
//! past it fails with `EDQUOT` inside the sandbox. Made with ioctls (the btrfs CLI costs a
//! process start per sandbox).

use std::ffi::CString;
use std::os::fd::AsRawFd;
use std::path::Path;

const BTRFS_SUPER_MAGIC: i64 = 0x9123_683e;
/// `_IOWR(0x94, 40, struct btrfs_ioctl_quota_ctl_args)`.
const BTRFS_IOC_QUOTA_CTL: u32 = 0xc010_9428;
/// `_IO(0x94, 46)`.
const BTRFS_IOC_QUOTA_RESCAN_WAIT: u32 = 0x0000_942e;
/// `_IOW(0x94, 24, struct btrfs_ioctl_vol_args_v2)`.
const BTRFS_IOC_SUBVOL_CREATE_V2: u32 = 0x5000_9418;
const BTRFS_QUOTA_CTL_ENABLE: u64 = 1;
const BTRFS_SUBVOL_QGROUP_INHERIT: u64 = 1 << 2;
const BTRFS_QGROUP_INHERIT_SET_LIMITS: u64 = 1;
const BTRFS_QGROUP_LIMIT_MAX_RFER: u64 = 1;

#[repr(C)]
struct QuotaCtlArgs {
    cmd: u64,
    status: u64,
}

#[repr(C)]
struct QgroupLimit {
    flags: u64,
    max_rfer: u64,
    max_excl: u64,
    rsv_rfer: u64,
    rsv_excl: u64,
}

/// `struct btrfs_qgroup_inherit` with no qgroups after it.
#[repr(C)]
struct QgroupInherit {
    flags: u64,
    num_qgroups: u64,
    num_ref_copies: u64,
    num_excl_copies: u64,
    lim: QgroupLimit,
}

/// `struct btrfs_ioctl_vol_args_v2` (4096 bytes).
#[repr(C)]
struct VolArgsV2 {
    fd: i64,
    transid: u64,
    flags: u64,
    size: u64,
    qgroup_inherit: *const QgroupInherit,
    unused: [u64; 2],
    name: [u8; 4040],
}

/// Whether `dir` is on btrfs.
pub fn is_btrfs(dir: &Path) -> std::io::Result<bool> {
    let file = std::fs::File::open(dir)?;
    // SAFETY: fstatfs fills `st` on success.
    unsafe {
        let mut st: libc::statfs = std::mem::zeroed();
        if libc::fstatfs(file.as_raw_fd(), &mut st) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(st.f_type as i64 == BTRFS_SUPER_MAGIC)
    }
}

/// Turns quotas on for the filesystem holding `dir` (idempotent; the first time the kernel
/// rescans the filesystem, which this waits for).
pub fn enable_quotas(dir: &Path) -> std::io::Result<()> {
    let file = std::fs::File::open(dir)?;
    let mut args = QuotaCtlArgs { cmd: BTRFS_QUOTA_CTL_ENABLE, status: 0 };
    // SAFETY: the ioctls take the struct given (or nothing) on an open directory.
    unsafe {
        if libc::ioctl(file.as_raw_fd(), BTRFS_IOC_QUOTA_CTL as libc::Ioctl, &mut args) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        libc::ioctl(file.as_raw_fd(), BTRFS_IOC_QUOTA_RESCAN_WAIT as libc::Ioctl);
    }
    Ok(())
}

/// Creates the subvolume `name` in `parent`, its referenced bytes limited to `max_bytes`, in
/// one ioctl (the qgroup is made with the subvolume, limits set).
pub fn create_limited(parent: &Path, name: &str, max_bytes: u64) -> std::io::Result<()> {
    let dir = std::fs::File::open(parent)?;
    let inherit = QgroupInherit {
        flags: BTRFS_QGROUP_INHERIT_SET_LIMITS,
        num_qgroups: 0,
        num_ref_copies: 0,
        num_excl_copies: 0,
        lim: QgroupLimit {
            flags: BTRFS_QGROUP_LIMIT_MAX_RFER,
            max_rfer: max_bytes,
            max_excl: 0,
            rsv_rfer: 0,
            rsv_excl: 0,
        },
    };
    let name = CString::new(name).map_err(std::io::Error::other)?;
    let bytes = name.as_bytes();
    if bytes.len() >= 4040 || bytes.contains(&b'/') {
        return Err(std::io::Error::from_raw_os_error(libc::EINVAL));
    }
    let mut args = VolArgsV2 {
        fd: 0,
        transid: 0,
        flags: BTRFS_SUBVOL_QGROUP_INHERIT,
        size: std::mem::size_of::<QgroupInherit>() as u64,
        qgroup_inherit: &inherit,
        unused: [0; 2],
        name: [0; 4040],
    };
    args.name[..bytes.len()].copy_from_slice(bytes);
    // SAFETY: the ioctl reads `args` and the inherit struct it points to, both alive here.
    if unsafe { libc::ioctl(dir.as_raw_fd(), BTRFS_IOC_SUBVOL_CREATE_V2 as libc::Ioctl, &args) }
        != 0
    {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ioctl_structs_have_the_kernels_sizes() {
        assert_eq!(std::mem::size_of::<VolArgsV2>(), 4096);
        assert_eq!(std::mem::size_of::<QgroupInherit>(), 72);
        assert_eq!(std::mem::size_of::<QgroupLimit>(), 40);
        assert_eq!(std::mem::size_of::<QuotaCtlArgs>(), 16);
    }
}
