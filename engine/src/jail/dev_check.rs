//! What a dump refuses in a jail's `/dev`. The sandbox's root owns its `/dev` and may rename
//! what is in it; the dump names `/dev` as external and the restore makes a fresh one, whose
//! links (`fd` → `/proc/self/fd`) lead into the restoring CRIU's own descriptors. So paths
//! CRIU records under `/dev` must not pass where the fresh `/dev` has a link. Apart from the
//! dump (`memory.rs`) so the checks read as one rule and test without a jail.

use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

/// `Err` says why the jail of `pid` (frozen) may not be dumped: a mask's source moved
/// ([`masks_moved`]) or one of the launcher's links replaced ([`dev_links_replaced`]).
pub(super) fn dev_as_launched(pid: u32) -> Result<(), String> {
    let mounts = std::fs::read_to_string(format!("/proc/{pid}/mountinfo"))
        .map_err(|e| format!("read the sandbox's mounts: {e}"))?;
    match masks_moved(&mounts).or_else(|| dev_links_replaced(pid)) {
        Some(why) => Err(why),
        None => Ok(()),
    }
}

/// Why the jail's masks cannot be dumped, if they cannot: `None` when every mount of its `/dev`
/// filesystem (in `mountinfo`, read while the sandbox is frozen) is `/dev` itself or a mask
/// bound from `/dev/null` or `/dev/.empty` where the launcher put them. The sandbox's root owns
/// `/dev` and may rename what is in it, which changes a mask's root to a path it chose; CRIU's
/// restore binds that path under the restored `/dev`, following its symlinks (`/dev/fd` is
/// `/proc/self/fd`: CRIU's own descriptors, host files). Such a sandbox keeps its files only.
fn masks_moved(mountinfo: &str) -> Option<String> {
    // `id parent major:minor root mount-point …`
    let mounts: Vec<[&str; 3]> = mountinfo
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split(' ').take(5).collect();
            (f.len() == 5).then(|| [f[2], f[3], f[4]])
        })
        .collect();
    let Some([dev, ..]) = mounts.iter().find(|[_, root, at]| *at == "/dev" && *root == "/") else {
        return Some("the sandbox's /dev is not where the launcher mounted it".into());
    };
    let moved = mounts.iter().find(|[device, root, at]| {
        device == dev && !(*at == "/dev" && *root == "/") && !["/null", "/.empty"].contains(root)
    })?;
    Some(format!(
        "the source of the mask at {} was moved to /dev{} inside the sandbox",
        moved[2], moved[1]
    ))
}

/// Why the jail's `/dev` cannot be dumped, if it cannot: the launcher's symlinks in it (`fd`,
/// `stdin`, …) must still be those symlinks. A restore makes a fresh `/dev` with them, and
/// CRIU opens what the dump recorded under `/dev` (a file a process holds open, a mask's
/// source) by its path there: a path through a name the sandbox had made a directory would,
/// in the restored `/dev`, go through the launcher's link to `/proc/self/fd` into CRIU's own
/// descriptors. While every such name is a symlink, no recorded path can pass through one.
fn dev_links_replaced(pid: u32) -> Option<String> {
    use std::os::fd::AsRawFd;
    // The jail's root (a magic link), then its `/dev` itself, not a symlink there.
    let dev = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_PATH | libc::O_DIRECTORY | libc::O_NOFOLLOW)
        .open(format!("/proc/{pid}/root/dev"));
    let dev = match dev {
        Ok(dev) => dev,
        Err(e) => return Some(format!("open the sandbox's /dev: {e}")),
    };
    for (target, name) in super::launch::DEV_LINKS {
        // The last component is read as a link, never followed.
        let at = format!("/proc/self/fd/{}/{name}", dev.as_raw_fd());
        if !std::fs::read_link(at).is_ok_and(|link| link == Path::new(target)) {
            return Some(format!("/dev/{name} inside the sandbox is no longer a link to {target}"));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mask_whose_source_was_moved_is_not_dumped() {
        let dev = "81 80 0:44 / /dev rw,nosuid - tmpfs tmpfs rw\n";
        let keys = |root: &str| format!("90 86 0:44 {root} /proc/keys rw - tmpfs tmpfs rw\n");
        let acpi = "89 86 0:44 /.empty /proc/acpi ro - tmpfs tmpfs rw\n";
        let shm = "85 81 0:46 / /dev/shm rw - tmpfs tmpfs rw\n";
        // Another filesystem's binds are not the masks' business.
        let tmp_bind = "95 81 0:48 /x /tmp/y rw - tmpfs tmpfs rw\n";
        assert_eq!(masks_moved(&format!("{dev}{shm}{}{acpi}{tmp_bind}", keys("/null"))), None);
        let moved = masks_moved(&format!("{dev}{}{acpi}", keys("/fd/3/x"))).unwrap();
        assert!(moved.contains("/proc/keys") && moved.contains("/dev/fd/3/x"), "{moved}");
        assert!(masks_moved(&format!("{dev}{}", keys("/null//deleted"))).is_some());
        assert!(masks_moved(&format!("{dev}{}", keys("/.empty/../null"))).is_some());
        assert!(masks_moved(&keys("/null")).is_some(), "no /dev at all");
    }
}
