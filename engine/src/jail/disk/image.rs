//! A fixed-size ext4 filesystem in a sparse image file, loop-mounted: the bound for data
//! directories on any other filesystem (this kernel has no ext4/XFS project quotas). A full disk
//! is `ENOSPC` inside the sandbox and nothing outside its image notices.
//!
//! The loop device is configured with `LO_FLAGS_AUTOCLEAR` and its descriptor closed once the
//! filesystem is mounted: the mount holds it, and the last unmount detaches it, so no daemon
//! state outlives a sandbox. Deleting files inside punches holes in the image (`discard`), so
//! the host's free space follows what sandboxes hold, not what they once wrote.

use std::ffi::CString;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

const LOOP_CTL_GET_FREE: u32 = 0x4C82;
const LOOP_CONFIGURE: u32 = 0x4C0A;
const LO_FLAGS_AUTOCLEAR: u32 = 4;
/// The loop device reads and writes the image without the host's page cache: a sandbox's file
/// data is cached once (by its own ext4), not twice.
const LO_FLAGS_DIRECT_IO: u32 = 16;
const LOOP_MAJOR: u32 = 7;

/// `struct loop_info64`.
#[repr(C)]
struct LoopInfo64 {
    device: u64,
    inode: u64,
    rdevice: u64,
    offset: u64,
    sizelimit: u64,
    number: u32,
    encrypt_type: u32,
    encrypt_key_size: u32,
    flags: u32,
    file_name: [u8; 64],
    crypt_name: [u8; 64],
    encrypt_key: [u8; 32],
    init: [u64; 2],
}

/// `struct loop_config`.
#[repr(C)]
struct LoopConfig {
    fd: u32,
    block_size: u32,
    info: LoopInfo64,
    reserved: [u64; 8],
}

/// Whether this host can make images: `mkfs.ext4` runs and loop devices can be had.
pub fn available() -> bool {
    Path::new("/dev/loop-control").exists()
        && Command::new("mkfs.ext4")
            .arg("-V")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
}

/// The version of [`make`]'s options, in the blanks' names: a blank made by another is not used.
const BLANK_VERSION: &str = "v3";

/// Makes a sparse image of `bytes` at `image` (which must not exist) holding an empty ext4.
/// Nothing is zeroed: block groups are marked initialised (`assume_storage_prezeroed`), so a
/// 2 GiB image holds 84 KiB of data. No journal: no jbd2 thread per sandbox and cheaper
/// mounts; what a host crash leaves, `e2fsck -p` repairs before the next mount. No resize
/// inode: its reserved descriptor blocks (1 MiB written at 2 GiB, growth nobody asks of a
/// sandbox's disk) were 13/14 of every copy, and of what attaching it for direct I/O writes
/// through to the disk first (14 images made at once: 55 ms → 17 ms here). Flex groups of one
/// block group: the allocator reads ahead and sets up the bitmaps of as many groups as a flex
/// group holds (up to 8 here) on a fresh image's first directory, through the loop device;
/// now of one (`upper` and `work` made: 281 → 188 µs of CPU, 407 → 234 µs of wall here).
pub fn make(image: &Path, bytes: u64) -> io::Result<()> {
    let file = OpenOptions::new().write(true).create_new(true).mode(0o600).open(image)?;
    file.set_len(bytes)?;
    drop(file);
    let out = Command::new("mkfs.ext4")
        .args(["-q", "-F", "-b", "4096", "-m", "0", "-G", "1", "-O", "^has_journal,^resize_inode"])
        .args(["-E", "nodiscard,lazy_itable_init=1,assume_storage_prezeroed=1"])
        .arg(image)
        .stdin(Stdio::null())
        .output()?;
    if !out.status.success() {
        return Err(io::Error::other(format!(
            "mkfs.ext4: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(())
}

/// Makes `image` (which must not exist) as a copy of a blank image of `bytes`, made once in
/// `blanks` by [`make`]. Copying the blank's written blocks (84 KiB; its holes stay holes)
/// costs a fraction of mkfs's ~6 ms and its process, and writes nothing through to the disk:
/// mkfs fsyncs its image on the way out, a stall for every writer on the host's filesystem at
/// each sandbox made. The copies share the blank's UUID; nothing mounts them by UUID.
pub fn make_copy(blanks: &Path, image: &Path, bytes: u64) -> io::Result<()> {
    let blank = blanks.join(format!("blank-{BLANK_VERSION}-{bytes}.img"));
    if !blank.exists() {
        std::fs::create_dir_all(blanks)?;
        let id = format!("{}-{:?}", std::process::id(), std::thread::current().id());
        let tmp = blanks.join(format!(".blank-{bytes}-{}", id.replace(['(', ')'], "")));
        let _ = std::fs::remove_file(&tmp);
        // Whole or not there: mkfs synced it, and the rename is atomic.
        if let Err(e) = make(&tmp, bytes).and_then(|()| std::fs::rename(&tmp, &blank)) {
            let _ = std::fs::remove_file(&tmp);
            return Err(e);
        }
    }
    let dst = OpenOptions::new().write(true).create_new(true).mode(0o600).open(image)?;
    if let Err(e) = copy_sparse(&blank, &dst) {
        // A filesystem without copy_file_range or holes: this image the slow way.
        tracing::debug!("copying a blank disk image: {e}; making {} with mkfs", image.display());
        drop(dst);
        std::fs::remove_file(image)?;
        return make(image, bytes);
    }
    Ok(())
}

/// Removes blanks half made by a process that died making them (an hour old: one being made
/// now by another engine on this data directory takes milliseconds), and those made with
/// another version's options.
pub fn sweep_blanks(blanks: &Path) {
    let Ok(entries) = std::fs::read_dir(blanks) else { return };
    let hour_ago = std::time::SystemTime::now() - std::time::Duration::from_secs(3600);
    let current = format!("blank-{BLANK_VERSION}-");
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let stale = e.metadata().and_then(|m| m.modified()).is_ok_and(|t| t < hour_ago);
        let half_made = stale && name.starts_with(".blank-");
        if half_made || (name.starts_with("blank-") && !name.starts_with(&current)) {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

/// Copies `from` into the empty file `dst`, its data ranges only (`SEEK_DATA`/`SEEK_HOLE`),
/// each with `copy_file_range`: the kernel copies within the page cache, and holes stay holes.
/// Refused (before anything is copied) where the filesystem reports no holes.
fn copy_sparse(from: &Path, dst: &File) -> io::Result<()> {
    let src = File::open(from)?;
    let meta = src.metadata()?;
    dst.set_len(meta.len())?;
    let (fd_in, fd_out) = (src.as_raw_fd(), dst.as_raw_fd());
    // The data ranges, found first: more of them than the blank has blocks means this
    // filesystem does not report holes, and a copy would allocate the whole image.
    let mut ranges = vec![];
    let mut at: libc::off_t = 0;
    loop {
        // SAFETY: plain syscalls on descriptors open for the whole function.
        let data = unsafe { libc::lseek(fd_in, at, libc::SEEK_DATA) };
        if data < 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::ENXIO) {
                break;
            }
            return Err(e);
        }
        let hole = unsafe { libc::lseek(fd_in, data, libc::SEEK_HOLE) };
        if hole < 0 {
            return Err(io::Error::last_os_error());
        }
        ranges.push((data, hole));
        at = hole;
    }
    let data: i64 = ranges.iter().map(|(d, h)| h - d).sum();
    if data as u64 > 2 * meta.blocks() * 512 + (1 << 20) {
        return Err(io::Error::other("the filesystem reports no holes"));
    }
    for (data, hole) in ranges {
        let (mut off_in, mut off_out) = (data, data);
        while off_in < hole {
            let left = (hole - off_in) as usize;
            // SAFETY: valid descriptors and offsets that outlive the call.
            let n =
                unsafe { libc::copy_file_range(fd_in, &mut off_in, fd_out, &mut off_out, left, 0) };
            match n {
                n if n < 0 => return Err(io::Error::last_os_error()),
                0 => return Err(io::Error::other("the blank image shrank while copied")),
                _ => {}
            }
        }
    }
    Ok(())
}

/// Mounts the filesystem in `image` at `at` (nosuid, nodev: a sandbox's setuid files mean
/// nothing on the host).
pub fn mount(image: &Path, at: &Path) -> io::Result<()> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(image)?;
    let (device, path) = attach(&file)?;
    let source = CString::new(path.as_os_str().as_bytes()).map_err(io::Error::other)?;
    let target = CString::new(at.as_os_str().as_bytes()).map_err(io::Error::other)?;
    let flags = libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOATIME;
    // SAFETY: NUL-terminated strings that live across the call.
    let mounted = unsafe {
        libc::mount(
            source.as_ptr(),
            target.as_ptr(),
            c"ext4".as_ptr(),
            flags,
            // A host disk that fills under a sparse image shows inside as I/O errors: the
            // sandbox's filesystem stops writing rather than lose data silently.
            c"discard,errors=remount-ro".as_ptr().cast(),
        )
    };
    let result = if mounted == 0 { Ok(()) } else { Err(io::Error::last_os_error()) };
    drop(device); // the mount (if any) holds the device now; without one it detaches
    result
}

/// Makes, mounts and unmounts a small image in `dir`: whether this host can really attach and
/// mount one (an old kernel without `LOOP_CONFIGURE`, a container whose device cgroup refuses
/// loop devices cannot), before every sandbox depends on it.
pub fn probe(dir: &Path) -> io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let (image, at) = (dir.join("probe.img"), dir.join("probe"));
    let _ = std::fs::remove_file(&image);
    let _ = std::fs::create_dir(&at);
    let tried =
        make(&image, 16 << 20).and_then(|()| mount(&image, &at)).and_then(|()| unmount(&at));
    let _ = std::fs::remove_file(&image);
    let _ = std::fs::remove_dir(&at);
    tried
}

/// Whether a loop device has `image` as its backing file (`/sys/block/loopN/loop/backing_file`
/// names the file's current path).
pub fn attached(image: &Path) -> bool {
    let Ok(devices) = std::fs::read_dir("/sys/block") else { return false };
    devices.flatten().filter(|d| d.file_name().to_string_lossy().starts_with("loop")).any(|d| {
        std::fs::read_to_string(d.path().join("loop/backing_file"))
            .is_ok_and(|f| Path::new(f.trim_end()) == image)
    })
}

/// Checks and repairs what a host crash left in an image before it is mounted again.
pub fn repair(image: &Path) {
    let status = Command::new("e2fsck")
        .args(["-p", "-f"])
        .arg(image)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    // 0: clean, 1: errors fixed; anything else still gets a mount attempt, which says more.
    if let Ok(s) = status
        && s.code().is_some_and(|c| c > 1)
    {
        tracing::warn!(image = %image.display(), "e2fsck exited with {s}");
    }
}

/// Attaches `file` to a free loop device; returns the device's open descriptor and path.
fn attach(file: &File) -> io::Result<(File, PathBuf)> {
    let control = OpenOptions::new().read(true).write(true).open("/dev/loop-control")?;
    let mut config = LoopConfig {
        fd: file.as_raw_fd() as u32,
        block_size: 4096,
        // SAFETY: all-zero is a valid loop_info64.
        info: unsafe { std::mem::zeroed() },
        reserved: [0; 8],
    };
    config.info.flags = LO_FLAGS_AUTOCLEAR | LO_FLAGS_DIRECT_IO;
    // Another attacher can take the device between GET_FREE and CONFIGURE (EBUSY): ask again.
    for _ in 0..64 {
        // SAFETY: LOOP_CTL_GET_FREE takes no argument.
        let n = unsafe { libc::ioctl(control.as_raw_fd(), LOOP_CTL_GET_FREE as libc::Ioctl) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        let path = PathBuf::from(format!("/dev/loop{n}"));
        let device = open_device(&path, n as u32)?;
        // SAFETY: the ioctl reads `config`, alive here.
        if unsafe { libc::ioctl(device.as_raw_fd(), LOOP_CONFIGURE as libc::Ioctl, &config) } == 0 {
            return Ok((device, path));
        }
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EBUSY) {
            return Err(e);
        }
    }
    Err(io::Error::other("no free loop device after 64 tries"))
}

/// Opens `/dev/loopN`, making the node where /dev is not a devtmpfs (some containers).
fn open_device(path: &Path, n: u32) -> io::Result<File> {
    let open =
        || OpenOptions::new().read(true).write(true).custom_flags(libc::O_CLOEXEC).open(path);
    match open() {
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            let c = CString::new(path.as_os_str().as_bytes()).map_err(io::Error::other)?;
            // SAFETY: plain syscall on a NUL-terminated path.
            let made = unsafe {
                libc::mknod(c.as_ptr(), libc::S_IFBLK | 0o660, libc::makedev(LOOP_MAJOR, n))
            };
            if made != 0 && io::Error::last_os_error().raw_os_error() != Some(libc::EEXIST) {
                return Err(io::Error::last_os_error());
            }
            open()
        }
        other => other,
    }
}

/// Whether something is mounted at `dir` (it sits on another device than its parent).
pub fn is_mountpoint(dir: &Path) -> bool {
    let parent = dir.parent().unwrap_or(dir);
    match (std::fs::symlink_metadata(dir), std::fs::symlink_metadata(parent)) {
        (Ok(d), Ok(p)) => d.is_dir() && d.dev() != p.dev(),
        _ => false,
    }
}

/// Detaches the mount at `at` (lazily: a jail still dying keeps it until it is gone).
pub fn unmount(at: &Path) -> io::Result<()> {
    let c = CString::new(at.as_os_str().as_bytes()).map_err(io::Error::other)?;
    // SAFETY: NUL-terminated path.
    if unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH | libc::UMOUNT_NOFOLLOW) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Detaches every mount at or under `dir`, deepest first. For harnesses that remove a data
/// directory whose node was killed (its sandboxes' disks stay mounted by design).
pub fn unmount_under(dir: &Path) {
    let Ok(table) = std::fs::read_to_string("/proc/self/mountinfo") else { return };
    let mut targets: Vec<PathBuf> = table
        .lines()
        .filter_map(|line| line.split(' ').nth(4))
        .map(|field| PathBuf::from(unescape(field)))
        .filter(|target| target.starts_with(dir))
        .collect();
    targets.sort_by_key(|t| std::cmp::Reverse(t.components().count()));
    for target in targets {
        let _ = unmount(&target);
    }
}

/// mountinfo writes space, tab, newline and backslash as `\ooo`.
fn unescape(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let octal = bytes.get(i + 1..i + 4).and_then(|d| {
            let s = std::str::from_utf8(d).ok()?;
            u8::from_str_radix(s, 8).ok()
        });
        match (bytes[i], octal) {
            (b'\\', Some(b)) => {
                out.push(b);
                i += 4;
            }
            (b, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use std::io::{Seek, SeekFrom, Write};

    use super::*;

    #[test]
    fn loop_structs_have_the_kernels_layout() {
        assert_eq!(std::mem::size_of::<LoopInfo64>(), 232);
        assert_eq!(std::mem::offset_of!(LoopInfo64, flags), 52);
        assert_eq!(std::mem::size_of::<LoopConfig>(), 304);
    }

    #[test]
    fn mountinfo_escapes_are_undone() {
        assert_eq!(unescape(r"/tmp/a\040b\134c"), r"/tmp/a b\c");
        assert_eq!(unescape("/plain"), "/plain");
    }

    #[test]
    fn blanks_of_other_versions_are_swept_and_this_ones_kept() {
        let dir = tempfile::tempdir().unwrap();
        let current = format!("blank-{BLANK_VERSION}-{}.img", 2u64 << 30);
        for name in ["blank-v1-2147483648.img", &current, ".blank-2147483648-1-2", "other"] {
            File::create(dir.path().join(name)).unwrap();
        }
        sweep_blanks(dir.path());
        let mut left: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        // The half-made one is minutes old, not an hour: another engine may be making it.
        assert_eq!(left, [".blank-2147483648-1-2", current.as_str(), "other"]);
    }

    #[test]
    fn a_sparse_copy_has_the_same_bytes_and_keeps_the_holes() {
        let dir = tempfile::tempdir().unwrap();
        let from = dir.path().join("from");
        let mut f = File::create(&from).unwrap();
        f.set_len(64 << 20).unwrap();
        for at in [0u64, 1 << 20, (64 << 20) - 4096] {
            f.seek(SeekFrom::Start(at)).unwrap();
            f.write_all(&[at as u8 | 1; 4096]).unwrap();
        }
        drop(f);
        let to = dir.path().join("to");
        copy_sparse(&from, &File::create(&to).unwrap()).unwrap();
        assert_eq!(std::fs::read(&from).unwrap(), std::fs::read(&to).unwrap());
        let blocks = std::fs::metadata(&to).unwrap().blocks() * 512;
        assert!(blocks < 1 << 20, "{blocks} bytes allocated for 12 KiB of data");
    }
}
