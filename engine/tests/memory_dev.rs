//! The jail's `/dev` as a dump and a restore meet it: the masks' sources are no tmpfs of their
//! own, and a sandbox that moves them or replaces the launcher's links there keeps its files
//! only (CRIU's restore would follow such paths into its own descriptors). Apart from
//! `memory.rs` (what memory keeps) because these are about what a dump refuses.

mod common;

use common::memory::*;
use common::*;
use silk_engine::*;

/// A masked directory under /proc (`/proc/acpi` here) is an empty directory bound read-only
/// from the jail's `/dev`, which the dump names as external: CRIU tars only the one tmpfs a
/// sandbox writes to (`/dev/shm`; `/tmp` and `/run` are the root's), at every dump and restore,
/// and the mask holds after a wake. (Were it a tmpfs of its own, as runc mounts it, a second
/// image.)
#[test]
fn masked_directories_cost_the_dump_no_tmpfs_and_stay_masked_after_a_wake() {
    let (h, b) = memory_box("m-masked");
    ok(&b, COUNTER);
    let acpi = std::path::Path::new("/proc/acpi").is_dir();
    let masked =
        "ls -A /proc/acpi | wc -l; grep ' /proc/acpi ' /proc/self/mountinfo | cut -d' ' -f4,6";
    if acpi {
        assert_eq!(ok(&b, masked), "0\n/.empty ro,nosuid,nodev,noexec,relatime");
    }
    assert!(h.engine.stop(&b.id, Memory::Required).unwrap().kept);
    assert_eq!(tmpfs_images(&h, &b.id).len(), 1, "{:?}", tmpfs_images(&h, &b.id));
    let woken = wake(&h, &b.id);
    if acpi {
        assert_eq!(ok(&woken, masked), "0\n/.empty ro,nosuid,nodev,noexec,relatime");
        let (code, _) = sh(&woken, "touch /proc/acpi/x");
        assert_ne!(code, 0, "the mask is writable");
    }
}

/// The sandbox's root owns its `/dev` and may rename what is in it, the masks' sources too: a
/// mask moved under a path that the restored `/dev` resolves through its symlinks (`/dev/fd` is
/// `/proc/self/fd`: CRIU's own descriptors) would have CRIU bind a host file over it at the
/// restore. Such a dump is refused (files only), and after a wake the masks' directory is still
/// not the sandbox's to fill.
#[test]
fn a_sandbox_that_moves_a_masks_source_keeps_its_files_only() {
    let (h, b) = memory_box("m-mask-moved");
    ok(&b, COUNTER);
    // Woken once: the attack meets the /dev a restore made.
    assert!(h.engine.stop(&b.id, Memory::Required).unwrap().kept);
    let b = wake(&h, &b.id);
    let (code, _) = sh(&b, "touch /dev/.empty/x");
    assert_ne!(code, 0, "the masks' directory is the sandbox's");
    assert!(std::path::Path::new("/proc/keys").exists(), "this host masks no /proc/keys");
    ok(&b, "rm /dev/fd && mkdir -p /dev/fd/3 && mv /dev/null /dev/fd/3/x");
    let refused = h.engine.stop(&b.id, Memory::Required).unwrap_err();
    assert!(
        matches!(&refused, EngineError::MemoryFailed(why) if why.contains("/dev/fd/3/x")),
        "{refused}"
    );
    let kept = h.engine.stop(&b.id, Memory::Auto).unwrap();
    assert!(!kept.kept, "{kept:?}");
    let mut woken = h.engine.resume(&b.id).unwrap();
    assert_eq!(ok(&woken, "wc -c < /proc/keys"), "0", "masked as the launcher made it");

    // A file a process holds open under a name that is one of the launcher's links in the
    // restored /dev (`fd` → /proc/self/fd): its path would lead CRIU's restore into its own
    // descriptors. Refused too, for each of those names.
    for name in ["fd", "stdin"] {
        ok(
            &woken,
            &format!(
                "rm /dev/{name} && mkdir -p /dev/{name}/4 && echo hi > /dev/{name}/4/x && \
                 (exec 7</dev/{name}/4/x; exec sleep 1000) >/dev/null 2>&1 &"
            ),
        );
        let refused = h.engine.stop(&woken.id, Memory::Required).unwrap_err();
        assert!(
            matches!(&refused, EngineError::MemoryFailed(why) if why.contains(&format!("/dev/{name} "))),
            "{refused}"
        );
        // Files only: the restart makes its /dev afresh.
        assert!(!h.engine.stop(&woken.id, Memory::Auto).unwrap().kept);
        woken = h.engine.resume(&woken.id).unwrap();
    }
}
