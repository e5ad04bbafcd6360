//! Our CRIU patches (scripts/criu-*.patch) as the jail engine sees them: each test fails on a
//! CRIU without its patch.

mod common;

use common::memory::*;
use common::*;
use silk_engine::*;

#[test]
fn tmpfs_contents_are_dumped_as_plain_tars_and_gzipped_ones_from_before_still_restore() {
    let (h, b) = memory_box("m-tmpfs");
    ok(&b, COUNTER);
    let sum = ok(&b, "head -c 1048576 /dev/urandom > /dev/shm/blob && sha256sum /dev/shm/blob");
    let (pid, before) = (ok(&b, "cat /tmp/pid"), count(&b));
    assert!(h.engine.stop(&b.id, Memory::Required).unwrap().kept);
    let images = tmpfs_images(&h, &b.id);
    assert!(!images.is_empty(), "no tmpfs image");
    for image in &images {
        // gzip ran at ~25 MB/s over what a sandbox keeps in a tmpfs (scripts/criu-tmpfs-uncompressed.patch).
        let head = std::fs::read(image).unwrap();
        assert_ne!(head.get(..2), Some(&[0x1f, 0x8b][..]), "{} is gzip'd", image.display());
    }
    let woken = wake(&h, &b.id);
    continues(&woken, before, &pid);
    assert_eq!(ok(&woken, "sha256sum /dev/shm/blob"), sum);

    // Images dumped by a CRIU that still compressed them (a sandbox hibernated before the
    // upgrade) restore as they were.
    let before = count(&woken);
    assert!(h.engine.stop(&b.id, Memory::Required).unwrap().kept);
    for image in tmpfs_images(&h, &b.id) {
        let gzip = std::process::Command::new("gzip").args(["-n", "-1"]).arg(&image).status();
        assert!(gzip.unwrap().success());
        let mut gz = image.clone().into_os_string();
        gz.push(".gz");
        std::fs::rename(gz, &image).unwrap();
        assert_eq!(std::fs::read(&image).unwrap().get(..2), Some(&[0x1f, 0x8b][..]));
    }
    let woken = wake(&h, &b.id);
    continues(&woken, before, &pid);
    assert_eq!(ok(&woken, "sha256sum /dev/shm/blob"), sum);
}

#[test]
fn a_jails_network_namespace_is_left_out_of_its_dump_and_comes_back_with_its_loopback_up() {
    // Nothing in it is the sandbox's to change, so CRIU saves none of it and restores a new one
    // (`--empty-ns net`, scripts/criu-empty-ns-loopback.patch): what listened on the loopback
    // before the dump answers on it after.
    let (h, b) = memory_box("m-net");
    let get = "python3 -c \"import urllib.request as u; u.urlopen('http://127.0.0.1:8000/')\"";
    ok(
        &b,
        &format!(
            "python3 -m http.server 8000 --bind 127.0.0.1 >/dev/null 2>&1 & \
         until {get} 2>/dev/null; do busybox sleep 0.05; done"
        ),
    );
    assert!(h.engine.stop(&b.id, Memory::Required).unwrap().kept);
    let dir = images_dir(&h, &b.id);
    let images: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    for saved in ["ifaddr-", "route-", "rule-", "iptables-", "ip6tables-", "nftables-"] {
        assert!(!images.iter().any(|i| i.starts_with(saved)), "{saved}* in {images:?}");
    }
    let woken = wake(&h, &b.id);
    // (With the loopback down, the connect fails at once: the network is unreachable.)
    ok(&woken, get);
}

#[test]
fn criu_keeps_its_kernel_probe_whatever_run_is_and_after_a_failed_save() {
    // CRIU probes the kernel on every run (~20 ms) unless /run/criu.kdat holds the answers, which
    // stock CRIU writes only on a tmpfs /run and never again once a failed save has left
    // /run/criu.kdat.tmp behind (scripts/criu-kdat-cache-off-tmpfs.patch).
    let (h, b) = memory_box("m-kdat");
    ok(&b, COUNTER);
    let cache = std::path::Path::new("/run/criu.kdat");
    std::fs::write("/run/criu.kdat.tmp", b"").unwrap();
    let _ = std::fs::remove_file(cache);
    assert!(h.engine.stop(&b.id, Memory::Required).unwrap().kept);
    let kept = std::fs::read(cache).expect("no /run/criu.kdat after a dump");
    let tmpfs = {
        let run = std::ffi::CString::new("/run").unwrap();
        // SAFETY: statfs fills the struct it is given.
        let mut st: libc::statfs = unsafe { std::mem::zeroed() };
        assert_eq!(unsafe { libc::statfs(run.as_ptr(), &mut st) }, 0);
        st.f_type == libc::TMPFS_MAGIC
    };
    if !tmpfs {
        let boot = std::fs::read("/proc/sys/kernel/random/boot_id").unwrap();
        assert!(kept.ends_with(&boot), "the cache outside a tmpfs does not carry the boot's id");
    }
    wake(&h, &b.id);
    let _ = std::fs::remove_file("/run/criu.kdat.tmp");
}

#[test]
fn connections_a_jails_namespace_tracks_are_kept_through_a_hibernate() {
    // CRIU walks the host's whole conntrack table to dump a namespace's entries, so it is asked
    // only when the namespace tracks some (scripts/criu-conntrack-none.patch). A sandbox cannot
    // make its namespace track (no nftables inside); the host's root can: then they are kept.
    let (h, b) = memory_box("m-ct");
    let rules = "table ip t { chain c { type filter hook output priority 0; ct state new,established accept; }; }";
    let tracked = std::process::Command::new("nsenter")
        .arg("-t")
        .arg(b.pid.unwrap().to_string())
        .args(["-n", "nft", rules])
        .status()
        .unwrap();
    assert!(tracked.success());
    ok(&b, COUNTER);
    // One datagram on the loopback: tracked for 30 s, and nothing is sent after the wake, so
    // only an entry kept through the dump counts there.
    let held = "python3 -c 'import socket, time; d = socket.SOCK_DGRAM; \
                a = socket.socket(socket.AF_INET, d); a.bind((\"127.0.0.1\", 7000)); \
                b = socket.socket(socket.AF_INET, d); b.sendto(b\"x\", (\"127.0.0.1\", 7000)); \
                a.recv(1); open(\"/tmp/held\", \"w\"); time.sleep(86400)' >/dev/null 2>&1 & \
                until test -e /tmp/held; do busybox sleep 0.05; done";
    ok(&b, held);
    let tracking = || ok(&b, "cat /proc/sys/net/netfilter/nf_conntrack_count");
    assert_ne!(tracking(), "0", "the connection is not tracked");
    let (pid, before) = (ok(&b, "cat /tmp/pid"), count(&b));
    assert!(h.engine.stop(&b.id, Memory::Required).unwrap().kept);
    let woken = wake(&h, &b.id);
    continues(&woken, before, &pid);
    let tracking = ok(&woken, "cat /proc/sys/net/netfilter/nf_conntrack_count");
    assert_ne!(tracking, "0", "the tracked connection was not kept");
}
