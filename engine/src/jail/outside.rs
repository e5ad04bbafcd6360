//! A node's engine directory seen from outside the node: its sandboxes listed without opening
//! the engine (for tools and tests beside a running node), and all of them removed once the
//! node has stopped (`sandboxd clean`, test harnesses).

use std::path::Path;

use super::{JailConfig, JailEngine, Record, start_time, unmount_under};
use crate::{BoxInfo, Engine, Result};

/// The sandboxes recorded under a jail engine's data directory, as `Engine::list` reports
/// them, read without opening the engine (no repairs, no locks): for tools and tests that look
/// at a node while it runs.
pub fn recorded_boxes(data_dir: &Path) -> Vec<BoxInfo> {
    let Ok(entries) = std::fs::read_dir(data_dir.join("boxes")) else { return vec![] };
    let mut out = vec![];
    for entry in entries.flatten() {
        let Ok(bytes) = std::fs::read(entry.path().join("box.json")) else { continue };
        let Ok(record) = serde_json::from_slice::<Record>(&bytes) else { continue };
        let pid = record
            .info
            .pid
            .filter(|&p| start_time(p).is_some_and(|t| Some(t) == record.start_time));
        out.push(BoxInfo { pid, running: pid.is_some(), ..record.info });
    }
    out.sort_by(|a, b| a.id.cmp(&b.id));
    out
}

/// Removes every sandbox under a stopped node's engine directory (they outlive their node by
/// design, for its next start to re-adopt): the engine opened on it repairs what a kill cut
/// short (starts with no record, frozen boxes), destroys every box it lists, and the disk
/// images still mounted there are unmounted. How many boxes it removed; a box that cannot be
/// removed does not stop the others (the first such error is returned after). Never while a
/// node runs on that directory.
pub fn remove_all(mut cfg: JailConfig) -> Result<usize> {
    let dir = cfg.data_dir.clone();
    // Only removing: no stock of disk images is made.
    cfg.bound_disks = false;
    let (mut removed, mut failed) = (0, None);
    if dir.join("boxes").is_dir() {
        let engine = JailEngine::new(cfg)?;
        for b in engine.list()? {
            match engine.destroy(&b.id) {
                Ok(()) => removed += 1,
                Err(e) => failed = failed.or(Some(e)),
            }
        }
        // A box whose directory went before its processes (a node killed mid-removal, or its
        // data taken away) still has its group: what runs there goes too.
        for id in engine.cgroups.groups() {
            if let Err(e) = engine.cgroups.remove(&id) {
                failed = failed.or(Some(e));
            }
        }
    }
    unmount_under(&dir);
    match failed {
        Some(e) => Err(e),
        None => Ok(removed),
    }
}
