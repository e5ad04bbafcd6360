//! A few boxes per size tier, each with a formatted, mounted image, made off the claim path: a
//! new sandbox's box is one of them, renamed into place, instead of a directory made, a blank
//! copied, attached and mounted in it (2.5 ms on a quiet disk here, up to 15 ms beside other
//! writes: mostly the attach's wait for it) and its directories made. A tier is stocked once
//! a sandbox of that size has been made.
//!
//! On disk: `disks/<instance>/<n>/{disk.img,disk/{upper,work},root,lower}`, one instance
//! directory per engine, held by an `flock` on `disks/<instance>/lock` for the engine's life. An
//! engine removes the instance directories whose lock it can take (their engine is gone), so a
//! crashed node leaks no mount, and two engines on one data directory (a test's reopen) leave
//! each other's stock alone.

use std::ffi::CString;
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use super::{BOX_DIRS, DiskSizes, image};
use crate::Size;

/// Images kept ready per tier in use.
const TARGET: usize = 2;
/// Threads making images. Making one is mostly waiting for the disk (attaching it for direct
/// I/O first writes the copied blank through: 1.3 ms on a quiet disk here, up to 15 beside
/// other writes), so two make twice as many in the same time, which starts that follow each
/// other closely need (docs/engine.md).
const REFILLERS: usize = 2;
const TIERS: [Size; 3] = [Size::Small, Size::Medium, Size::Large];

#[derive(Debug)]
pub struct Stock {
    shared: Arc<Shared>,
    refillers: Vec<JoinHandle<()>>,
    _lock: File,
}

#[derive(Debug)]
struct Shared {
    dir: PathBuf,
    blanks: PathBuf,
    sizes: DiskSizes,
    state: Mutex<State>,
    wake: Condvar,
}

#[derive(Debug, Default)]
struct State {
    /// Mounted images per tier (index as in `TIERS`).
    ready: [Vec<PathBuf>; 3],
    /// Images being made per tier.
    making: [usize; 3],
    /// Tiers a sandbox has been made in.
    wanted: [bool; 3],
    next: u64,
    closed: bool,
}

fn tier(size: Size) -> usize {
    TIERS.iter().position(|t| *t == size).unwrap_or(0)
}

impl Stock {
    /// Opens the stock under `disks`, clearing what dead engines left there.
    pub fn open(disks: &Path, blanks: &Path, sizes: DiskSizes) -> io::Result<Stock> {
        std::fs::create_dir_all(disks)?;
        clear_abandoned(disks);
        let instance = format!("{}-{:x}", std::process::id(), super::super::host::now_ms());
        let dir = disks.join(instance);
        std::fs::create_dir(&dir)?;
        let lock = File::create(dir.join("lock"))?;
        // SAFETY: plain syscall on an open descriptor.
        if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            return Err(io::Error::last_os_error());
        }
        let shared = Arc::new(Shared {
            dir,
            blanks: blanks.to_path_buf(),
            sizes,
            state: Mutex::new(State::default()),
            wake: Condvar::new(),
        });
        let mut stock = Stock { shared, refillers: vec![], _lock: lock };
        for _ in 0..REFILLERS {
            let shared = stock.shared.clone();
            let refiller = std::thread::Builder::new().name("disk-stock".into());
            stock.refillers.push(refiller.spawn(move || refill(&shared))?);
        }
        Ok(stock)
    }

    /// Renames a box of `size`'s tier to `box_dir`, which must not exist (`AlreadyExists`,
    /// and the box stays in the stock); `false` when the tier has none ready or the rename
    /// failed otherwise (the caller makes the box). Either way the tier is stocked from now on,
    /// from the next [`restock`](Self::restock).
    pub fn take(&self, size: Size, box_dir: &Path) -> io::Result<bool> {
        let entry = {
            let mut state = self.shared.state.lock().unwrap_or_else(|e| e.into_inner());
            state.wanted[tier(size)] = true;
            state.ready[tier(size)].pop()
        };
        let Some(entry) = entry else { return Ok(false) };
        // One rename moves the box with its mount (the mount follows its directory): no mount
        // call, and nothing left behind to remove.
        match rename_noreplace(&entry, box_dir) {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                let mut state = self.shared.state.lock().unwrap_or_else(|e| e.into_inner());
                state.ready[tier(size)].push(entry);
                Err(e)
            }
            Err(e) => {
                // Another filesystem under `boxes` (EXDEV), say: this box the slow way.
                tracing::debug!("taking a box from the stock: {e}");
                remove_entry(&entry);
                Ok(false)
            }
        }
    }

    /// Lets the stock make up for what was taken. The engine calls it once the start that
    /// took an image is done rather than at the take: an image made beside a start (a copy of
    /// the blank, a loop attach, a mount on the other core) made that start 2–4 ms slower.
    pub fn restock(&self) {
        self.shared.wake.notify_all();
    }
}

impl Drop for Stock {
    fn drop(&mut self) {
        self.shared.state.lock().unwrap_or_else(|e| e.into_inner()).closed = true;
        self.shared.wake.notify_all();
        for refiller in self.refillers.drain(..) {
            let _ = refiller.join();
        }
        remove_instance(&self.shared.dir);
    }
}

/// Makes images for wanted tiers below target until the stock closes.
fn refill(shared: &Shared) {
    // Below the claim path's priority: a stock image is made while nothing waits for it.
    // SAFETY: plain syscalls on this thread (mkfs inherits the nice value).
    unsafe { libc::setpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t, 10) };
    loop {
        let (size, n) = {
            let mut state = shared.state.lock().unwrap_or_else(|e| e.into_inner());
            let short = loop {
                if state.closed {
                    return;
                }
                let short = (0..TIERS.len())
                    .find(|&t| state.wanted[t] && state.ready[t].len() + state.making[t] < TARGET);
                match short {
                    Some(t) => break t,
                    None => state = shared.wake.wait(state).unwrap_or_else(|e| e.into_inner()),
                }
            };
            state.next += 1;
            state.making[short] += 1;
            (TIERS[short], state.next)
        };
        let entry = shared.dir.join(n.to_string());
        match make_entry(&entry, &shared.blanks, shared.sizes.of(size)) {
            Ok(()) => {
                let mut state = shared.state.lock().unwrap_or_else(|e| e.into_inner());
                state.making[tier(size)] -= 1;
                state.ready[tier(size)].push(entry);
            }
            Err(e) => {
                tracing::warn!("stocking a {size:?} disk: {e}; the tier is no longer stocked");
                remove_entry(&entry);
                let mut state = shared.state.lock().unwrap_or_else(|e| e.into_inner());
                state.making[tier(size)] -= 1;
                state.wanted[tier(size)] = false;
            }
        }
    }
}

fn make_entry(entry: &Path, blanks: &Path, bytes: u64) -> io::Result<()> {
    std::fs::DirBuilder::new().mode(0o700).create(entry)?;
    for dir in BOX_DIRS.iter().chain(&["disk"]) {
        std::fs::create_dir(entry.join(dir))?;
    }
    image::make_copy(blanks, &entry.join("disk.img"), bytes)?;
    image::mount(&entry.join("disk.img"), &entry.join("disk"))?;
    // Every sandbox's overlay needs its upper and work directories in its disk (see
    // `JailEngine::start`): made now, they are not made on the start's path, where the first
    // directories of a new filesystem cost ~0.65 ms (its bitmaps and inode table read through
    // the loop device).
    std::fs::create_dir(entry.join("disk/upper"))?;
    std::fs::create_dir(entry.join("disk/work"))
}

/// Where an entry's image is mounted: `disk`, or `mnt` in a stock a build before 2eeb514 left.
const MOUNTS: [&str; 2] = ["disk", "mnt"];

fn remove_entry(entry: &Path) {
    for at in MOUNTS.map(|m| entry.join(m)) {
        if image::is_mountpoint(&at) {
            let _ = image::unmount(&at);
        }
    }
    // Only what this module made: an image file and directories, empty ones but for the
    // image's, which go with it.
    let _ = std::fs::remove_file(entry.join("disk.img"));
    for dir in BOX_DIRS.iter().chain(&MOUNTS) {
        let _ = std::fs::remove_dir(entry.join(dir));
    }
    let _ = std::fs::remove_dir(entry);
}

/// `rename(2)` that fails with `EEXIST` rather than replace `to`.
fn rename_noreplace(from: &Path, to: &Path) -> io::Result<()> {
    let from = CString::new(from.as_os_str().as_bytes()).map_err(io::Error::other)?;
    let to = CString::new(to.as_os_str().as_bytes()).map_err(io::Error::other)?;
    // SAFETY: NUL-terminated paths that live across the call.
    let renamed = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            from.as_ptr(),
            libc::AT_FDCWD,
            to.as_ptr(),
            libc::RENAME_NOREPLACE,
        )
    };
    if renamed != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn remove_instance(dir: &Path) {
    if let Ok(entries) = std::fs::read_dir(dir) {
        for entry in entries.flatten().filter(|e| e.path().is_dir()) {
            remove_entry(&entry.path());
        }
    }
    let _ = std::fs::remove_file(dir.join("lock"));
    let _ = std::fs::remove_dir(dir);
}

/// Removes the instance directories no live engine holds.
fn clear_abandoned(disks: &Path) {
    let Ok(instances) = std::fs::read_dir(disks) else { return };
    for instance in instances.flatten() {
        let Ok(lock) = File::open(instance.path().join("lock")) else {
            remove_instance(&instance.path());
            continue;
        };
        // SAFETY: plain syscall on an open descriptor.
        if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
            remove_instance(&instance.path());
        }
    }
}
