//! Feeds arbitrary bytes as a tar stream to the agent's `push` (`silkd/agent/src/tree.rs`,
//! compiled here on its own) and checks `tree::mutations::check`: no panic; nothing created,
//! written or linked through outside the target (a canary beside it stays as it was); no
//! staging left; a failed push changes nothing; disk taken bounded by the stream. The first
//! byte picks the target (existing or new) and whether the headers' checksums are set again
//! after the fuzzer's edits (so they reach the fields behind the checksum). The root is fixed
//! (`$TMPDIR/silk-push-fuzz`), so the seed corpus can name the canary by its absolute path; run
//! one such fuzzer at a time.
#![no_main]

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{LazyLock, OnceLock};

use libfuzzer_sys::fuzz_target;

#[allow(dead_code)]
#[path = "../../src/tree.rs"]
mod tree;

#[allow(dead_code)]
#[path = "../../src/files.rs"]
mod files;

#[allow(dead_code)]
#[path = "../../src/users.rs"]
mod users;

/// The agent's `call::Fail` and `CallResult` (their own file there).
#[allow(dead_code)]
#[path = "../../src/fail.rs"]
mod call;

static RT: LazyLock<tokio::runtime::Runtime> =
    LazyLock::new(|| tokio::runtime::Builder::new_current_thread().build().unwrap());
static ROOT: OnceLock<PathBuf> = OnceLock::new();
/// The last push went through: the layout must be made again (a failed one changed nothing).
static DIRTY: AtomicBool = AtomicBool::new(true);

fuzz_target!(|data: &[u8]| {
    let Some((&flags, tar)) = data.split_first() else { return };
    let root = ROOT.get_or_init(|| std::env::temp_dir().join("silk-push-fuzz"));
    if DIRTY.swap(false, Ordering::Relaxed) {
        tree::mutations::lay_out(root);
    }
    let mut tar = tar.to_vec();
    if flags & 2 != 0 {
        tree::mutations::repair(&mut tar);
    }
    if tree::mutations::check(&RT, root, &tar, flags & 1 != 0) {
        DIRTY.store(true, Ordering::Relaxed);
    }
});
