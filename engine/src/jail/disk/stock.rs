//! A few formatted, mounted images per size tier, made off the claim path: a new sandbox takes
//! one by moving its mount instead of copying a blank, attaching it and mounting it (2.5 ms
//! on a quiet disk here, up to 15 ms beside other writes: mostly the attach's wait for it). A tier is stocked once a sandbox of that size
//! has been made.
//!
//! On disk: `disks/<instance>/<n>/{disk.img,mnt}`, one instance directory per engine, held
//! by an `flock` on `disks/<instance>/lock` for the engine's life. An engine removes the instance
//! directories whose lock it can take (their engine is gone), so a crashed node leaks no mount,
//! and two engines on one data directory (a test's reopen) leave each other's stock alone.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use super::{DiskSizes, image};
use crate::Size;

/// Images kept ready per tier in use.
const TARGET: usize = 2;
/// Threads making images. Making one is mostly waiting for the disk (attaching it for direct
/// I/O first writes the copied blank through: 1.3 ms on a quiet disk here, up to 15 beside
/// other writes), so two make twice as many in
/// the same time, which starts that follow each other closely need (docs/engine.md).
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
    /// Entries whose image was taken: empty directories the refiller removes, off the start's
    /// path (two `rmdir`s cost ~0.57 ms on a data directory mounted with `discard`).
    spent: Vec<PathBuf>,
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

    /// A mounted empty image of `size`'s tier, moved to `image` and mounted at `at` (an empty
    /// directory); `false` when the tier has none ready (the caller makes one). Either way the
    /// tier is stocked from now on, from the next [`restock`](Self::restock).
    pub fn take(&self, size: Size, image: &Path, at: &Path) -> io::Result<bool> {
        let entry = {
            let mut state = self.shared.state.lock().unwrap_or_else(|e| e.into_inner());
            state.wanted[tier(size)] = true;
            state.ready[tier(size)].pop()
        };
        let Some(entry) = entry else { return Ok(false) };
        let mnt = entry.join("mnt");
        // The file first (the loop device keeps it open across the rename), so that a box with
        // a mounted disk always has its image beside it. A failed rename leaves the entry to
        // the stock's own cleanup.
        std::fs::rename(entry.join("disk.img"), image)?;
        // A move where the data directory's mount is private; else a bind and an unmount
        // (which waits for an RCU grace period: ~0.4 ms).
        let moved = image::move_mount(&mnt, at)
            .or_else(|_| image::bind(&mnt, at).and_then(|()| image::unmount(&mnt)));
        if let Err(e) = moved {
            // Mounted nowhere after this: the loop device goes with the last mount.
            for mounted in [at, mnt.as_path()] {
                if image::is_mountpoint(mounted) {
                    let _ = image::unmount(mounted);
                }
            }
            let _ = std::fs::remove_file(image);
            remove_entry(&entry);
            return Err(e);
        }
        self.shared.state.lock().unwrap_or_else(|e| e.into_inner()).spent.push(entry);
        Ok(true)
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
        let (size, n, spent) = {
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
            (TIERS[short], state.next, std::mem::take(&mut state.spent))
        };
        for entry in spent {
            let _ = std::fs::remove_dir(entry.join("mnt"));
            let _ = std::fs::remove_dir(&entry);
        }
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
    std::fs::create_dir(entry)?;
    std::fs::create_dir(entry.join("mnt"))?;
    image::make_copy(blanks, &entry.join("disk.img"), bytes)?;
    image::mount(&entry.join("disk.img"), &entry.join("mnt"))?;
    // Every sandbox's overlay needs its upper and work directories in its disk (see
    // `JailEngine::start`): made now, they are not made on the start's path, where the first
    // directories of a new filesystem cost ~0.5 ms (its bitmaps and root block read through
    // the loop device).
    std::fs::create_dir(entry.join("mnt/upper"))?;
    std::fs::create_dir(entry.join("mnt/work"))
}

fn remove_entry(entry: &Path) {
    let mnt = entry.join("mnt");
    if image::is_mountpoint(&mnt) {
        let _ = image::unmount(&mnt);
    }
    // Only what this module made: an image file and empty directories.
    let _ = std::fs::remove_file(entry.join("disk.img"));
    let _ = std::fs::remove_dir(&mnt);
    let _ = std::fs::remove_dir(entry);
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
