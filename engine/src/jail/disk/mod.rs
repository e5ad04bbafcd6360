//! Disk limits: a sandbox's files (its overlay upper and work directories, `boxes/<id>/disk/`)
//! live where the kernel bounds them, so a sandbox that fills its disk stops at its tier and
//! nothing else on the host notices. The mechanism follows the data directory's filesystem:
//! on btrfs a subvolume with a qgroup limit ([`btrfs`]); elsewhere a fixed-size ext4 image,
//! loop-mounted ([`image`]), taken from a [`stock`] made ahead. Without either (no mkfs.ext4
//! or loop devices) disks are not bounded and the node's `min_free_mib` reserve is what keeps
//! the host's disk from filling.

mod btrfs;
mod image;
mod stock;

use std::io;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};

use crate::{DiskMechanism, Size};
pub use image::unmount_under;
use stock::Stock;

/// Bytes a sandbox of each size may refer to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DiskSizes {
    pub small: u64,
    pub medium: u64,
    pub large: u64,
}

impl Default for DiskSizes {
    fn default() -> Self {
        DiskSizes { small: 2 << 30, medium: 8 << 30, large: 32 << 30 }
    }
}

impl DiskSizes {
    pub fn of(&self, size: Size) -> u64 {
        match size {
            Size::Small => self.small,
            Size::Medium => self.medium,
            Size::Large => self.large,
        }
    }
}

/// The engine's disk bound: its mechanism, the tiers' sizes and the stock of images.
#[derive(Debug)]
pub struct Disks {
    mechanism: DiskMechanism,
    sizes: DiskSizes,
    stock: Option<Stock>,
    /// Blank images new ones are copied from (see [`image::make_copy`]).
    blanks: PathBuf,
}

impl Disks {
    /// Picks the mechanism for the data directory's filesystem (turning btrfs quotas on), and
    /// mounts again the images of boxes a host reboot unmounted (made while `bound` was on).
    pub fn open(data_dir: &Path, sizes: DiskSizes, bound: bool) -> Disks {
        let boxes = data_dir.join("boxes");
        let blanks = data_dir.join("disk-blanks");
        image::sweep_blanks(&blanks);
        remount_images(&boxes);
        if !bound {
            return Disks { mechanism: DiskMechanism::None, sizes, stock: None, blanks };
        }
        let unbounded = |why: String| {
            tracing::warn!("sandboxes' disk use is not bounded: {why}");
            DiskMechanism::None
        };
        let mechanism = match btrfs::is_btrfs(&boxes) {
            Ok(true) => match btrfs::enable_quotas(&boxes) {
                Ok(()) => DiskMechanism::BtrfsQgroup,
                Err(e) => unbounded(format!("enabling btrfs quotas: {e}")),
            },
            Ok(false) if image::available() => match image::probe(&data_dir.join("disks")) {
                Ok(()) => DiskMechanism::Ext4Image,
                Err(e) => unbounded(format!("a trial ext4 image did not mount: {e}")),
            },
            Ok(false) => unbounded("mkfs.ext4 or /dev/loop-control is missing".into()),
            Err(e) => unbounded(e.to_string()),
        };
        let stock = match mechanism {
            DiskMechanism::Ext4Image => Stock::open(&data_dir.join("disks"), &blanks, sizes)
                .inspect_err(|e| tracing::warn!("no stock of disk images: {e}"))
                .ok(),
            _ => None,
        };
        Disks { mechanism, sizes, stock, blanks }
    }

    pub fn mechanism(&self) -> DiskMechanism {
        self.mechanism
    }

    /// Lets the stock replace the images taken since the last call (see [`Stock::restock`]).
    pub fn restock(&self) {
        if let Some(stock) = &self.stock {
            stock.restock();
        }
    }

    /// Makes the box directory `box_dir` (0700; `AlreadyExists` if it is there), with its disk
    /// `box_dir/disk` bounded to `size`'s tier when there is a size. A bounded box of a stocked
    /// tier is a box from the stock, renamed into place; it holds its [`BOX_DIRS`] already.
    pub fn make_box(&self, box_dir: &Path, size: Option<Size>) -> io::Result<()> {
        if let (Some(size), Some(stock)) = (size, &self.stock)
            && stock.take(size, box_dir)?
        {
            return Ok(());
        }
        std::fs::DirBuilder::new().mode(0o700).create(box_dir)?;
        let Some(size) = size else { return Ok(()) };
        let bytes = self.sizes.of(size);
        let made = match self.mechanism {
            DiskMechanism::None => Ok(()),
            DiskMechanism::BtrfsQgroup => btrfs::create_limited(box_dir, "disk", bytes),
            DiskMechanism::Ext4Image => {
                let (image, at) = (box_dir.join("disk.img"), box_dir.join("disk"));
                std::fs::create_dir(&at)
                    .and_then(|()| image::make_copy(&self.blanks, &image, bytes))
                    .and_then(|()| image::mount(&image, &at))
            }
        };
        made.map_err(|e| {
            let _ = remove_box(box_dir);
            // Not `AlreadyExists` whatever it was: that would say the box's id is taken.
            io::Error::other(format!("making the sandbox's disk: {e}"))
        })
    }
}

/// The directories of a new box besides its disk: the jail's root mount point and the lower
/// layers' (`JailEngine::start`). The stock makes them in its boxes; a start makes what is not
/// there.
pub const BOX_DIRS: [&str; 2] = ["root", "lower"];

/// Removes a box directory, its disk unmounted first (whatever is mounted there: the removal
/// must never walk into a filesystem it did not mean to empty).
pub fn remove_box(box_dir: &Path) -> io::Result<()> {
    unmount_disk(box_dir)?;
    super::host::remove_tree(box_dir)
}

/// Unmounts a box's disk image, if one is mounted there.
pub fn unmount_disk(box_dir: &Path) -> io::Result<()> {
    let disk = box_dir.join("disk");
    if image::is_mountpoint(&disk) {
        match image::unmount(&disk) {
            // A btrfs subvolume has a device of its own but is no mount.
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {}
            other => other?,
        }
    }
    Ok(())
}

/// Mounts the image of every box whose image is not mounted (after a host reboot), checking
/// it first: a crash can leave it half written.
fn remount_images(boxes: &Path) {
    let Ok(entries) = std::fs::read_dir(boxes) else { return };
    for entry in entries.flatten() {
        let (image, at) = (entry.path().join("disk.img"), entry.path().join("disk"));
        if image.is_file() && at.is_dir() && !image::is_mountpoint(&at) {
            if image::attached(&image) {
                // Still in use (a jail whose host mount went: mounting it twice corrupts it).
                tracing::warn!(image = %image.display(), "attached to a loop device; not remounted");
                continue;
            }
            image::repair(&image);
            if let Err(e) = image::mount(&image, &at) {
                tracing::warn!(image = %image.display(), "mounting a sandbox's disk: {e}");
            }
        }
    }
}

/// Where a box keeps its upper and work directories: `disk/` when it has a bounded disk,
/// else the box directory itself (boxes made without one).
pub fn files_dir(box_dir: &Path) -> PathBuf {
    let disk = box_dir.join("disk");
    if disk.is_dir() { disk } else { box_dir.to_path_buf() }
}
