//! The jail engine's configuration: where it keeps its files and finds its helpers.

use std::path::PathBuf;
use std::time::Duration;

use super::{DEFAULT_ID_BASE, DiskSizes, LaneNet};

/// Where the engine keeps its files and finds its helpers.
#[derive(Debug, Clone)]
pub struct JailConfig {
    pub data_dir: PathBuf,
    /// A statically linked silkd (it runs inside any root filesystem).
    pub silkd: PathBuf,
    /// The `silk-jail` launcher.
    pub launcher: PathBuf,
    /// How long a new sandbox's silkd gets to answer `info`.
    pub ready_timeout: Duration,
    /// The cgroup filesystem mount.
    pub cgroup_root: PathBuf,
    /// The host uid and gid that is root inside every sandbox; ids 0..65536 inside are
    /// `id_base..id_base + 65536` on the host.
    pub id_base: u32,
    /// Disk each size tier may use, where the data directory's filesystem can bound it.
    pub disk: DiskSizes,
    /// Whether to bound sandboxes' disks at all (off: no images, no subvolumes).
    pub bound_disks: bool,
    /// Keep processes' memory through CRIU where it works (off: files only, always).
    pub memory: bool,
    /// The CRIU binary (`None`: looked for in /usr/local/sbin, /usr/sbin, /usr/local/bin).
    pub criu: Option<PathBuf>,
    /// The key memory images in snapshots are authenticated with; every node that should
    /// restore another's images needs the same (`None`: one of this data directory's own).
    pub memory_key: Option<[u8; 32]>,
    /// The egress lane's addresses and bandwidth (`None`: lane `egress` is not offered).
    pub lane: Option<LaneNet>,
}

impl JailConfig {
    pub fn new(
        data_dir: impl Into<PathBuf>,
        silkd: impl Into<PathBuf>,
        launcher: impl Into<PathBuf>,
    ) -> JailConfig {
        JailConfig {
            data_dir: data_dir.into(),
            silkd: silkd.into(),
            launcher: launcher.into(),
            ready_timeout: Duration::from_secs(10),
            cgroup_root: PathBuf::from("/sys/fs/cgroup"),
            id_base: DEFAULT_ID_BASE,
            disk: DiskSizes::default(),
            bound_disks: true,
            memory: true,
            criu: None,
            memory_key: None,
            lane: None,
        }
    }
}
