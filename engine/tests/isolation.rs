//! The isolation suite, run from inside real sandboxes: what a sandbox must not see or do.
//! Raw system calls go through perl's `syscall` (the host template binds the host's /usr).

mod common;

use common::*;
use silk_engine::*;

/// errno text of a raw syscall made inside the sandbox.
fn syscall(b: &BoxInfo, nr: u32, args: &str) -> String {
    ok(b, &format!("perl -e '$r = syscall({nr}{args}); print $r < 0 ? \"$!\" : \"ok\"'"))
}

#[test]
fn a_sandbox_sees_nothing_of_the_host_or_its_neighbours() {
    let h = Harness::new();
    let g = h.golden(&[]);
    let a = h.engine.clone_golden(&g, &id("iso-a"), &small()).unwrap();
    let b = h.engine.clone_golden(&g, &id("iso-b"), &small()).unwrap();
    ok(&b, "echo secret > /root/b-secret");

    // Files: no host /etc/shadow, an empty /root, no data dir, no neighbour's files.
    assert_ne!(sh(&a, "cat /etc/shadow").0, 0);
    assert_eq!(ok(&a, "ls -A /root"), "");
    let data = h.data.path().display().to_string();
    assert_ne!(sh(&a, &format!("ls {data}")).0, 0, "the node's data dir is not visible");
    assert_ne!(sh(&a, "cat /root/b-secret").0, 0);
    assert_ne!(sh(&a, "ls /home/user/.. /proc/1/root/ 2>/dev/null | grep -q b-secret").0, 0);
    let host_passwd = std::fs::read_to_string("/etc/passwd").unwrap();
    assert_ne!(ok(&a, "cat /etc/passwd"), host_passwd.trim(), "the sandbox has its own /etc");

    // Processes: only the sandbox's own; silkd is PID 1.
    // silkd plus this command's own processes, nothing else.
    let comms = ok(&a, "cat /proc/[0-9]*/comm");
    assert!(comms.lines().all(|c| ["silkd", "sh", "cat"].contains(&c)), "{comms}");
    assert_eq!(ok(&a, "cat /proc/1/comm"), "silkd");
    assert_ne!(sh(&a, &format!("test -e /proc/{}", std::process::id())).0, 0);

    // Descriptors: a command holds its pipes and nothing of silkd's (above all not the agent's
    // listening socket, or it could accept the connections meant for silkd).
    let fds = ok(&a, "ls -l /proc/self/fd/ | grep -c socket: || true");
    assert_eq!(fds, "0", "a command inherited a socket");

    // /dev: only the minimal set.
    let dev = ok(&a, "ls /dev | tr '\\n' ' '");
    assert_eq!(dev, "fd full null ptmx pts random shm stderr stdin stdout tty urandom zero");
    h.engine.destroy(&a.id).unwrap();
    h.engine.destroy(&b.id).unwrap();
}

#[test]
fn a_sandbox_cannot_reach_past_its_namespaces() {
    let h = Harness::new();
    let g = h.golden(&[]);
    let a = h.engine.clone_golden(&g, &id("iso-sys"), &small()).unwrap();
    let eperm = "Operation not permitted";

    assert_ne!(sh(&a, "mount -t tmpfs none /mnt").0, 0, "cannot mount");
    assert_eq!(syscall(&a, 165, ", 0, 0, 0, 0, 0"), eperm, "mount(2)");
    assert_eq!(syscall(&a, 175, ", 0, 0, 0"), eperm, "init_module");
    assert_eq!(syscall(&a, 313, ", 0, 0, 0"), eperm, "finit_module");
    assert_eq!(syscall(&a, 169, ", 0, 0, 0, 0"), eperm, "reboot");
    assert_eq!(syscall(&a, 321, ", 0, 0, 0"), eperm, "bpf");
    assert_eq!(syscall(&a, 250, ", 0, 0"), eperm, "keyctl");
    assert_eq!(syscall(&a, 298, ", 0, 0, 0, 0, 0"), eperm, "perf_event_open");
    assert_ne!(sh(&a, "unshare -U true").0, 0, "no user namespaces");

    let host_name = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap();
    let _ = sh(&a, "hostname pwned");
    assert_eq!(std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap(), host_name);

    let status = ok(&a, "grep -E '^(CapEff|NoNewPrivs)' /proc/self/status");
    assert!(status.contains("NoNewPrivs:\t1"), "{status}");
    let eff = u64::from_str_radix(
        status
            .lines()
            .find(|l| l.starts_with("CapEff"))
            .unwrap()
            .split_whitespace()
            .nth(1)
            .unwrap(),
        16,
    )
    .unwrap();
    assert_eq!(eff & (1 << 21), 0, "no CAP_SYS_ADMIN");
    assert_eq!(eff & (1 << 16), 0, "no CAP_SYS_MODULE");
    assert_eq!(eff & (1 << 27), 0, "no CAP_MKNOD");
    h.engine.destroy(&a.id).unwrap();
}

#[test]
fn lane_none_has_only_loopback_and_cannot_reach_the_host() {
    let h = Harness::new();
    let g = h.golden(&[]);
    let a = h.engine.clone_golden(&g, &id("iso-net"), &small()).unwrap();
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let (code, _) = sh(
        &a,
        &format!(
            "perl -MIO::Socket::INET -e 'IO::Socket::INET->new(\"127.0.0.1:{port}\") or exit 3'"
        ),
    );
    assert_eq!(code, 3, "the host's loopback is not the sandbox's");
    let ifaces = ok(&a, "tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' '");
    assert_eq!(ifaces, "lo");
    // Loopback itself works inside.
    ok(
        &a,
        "perl -MIO::Socket::INET -e '$l = IO::Socket::INET->new(Listen => 1, LocalAddr => \"127.0.0.1:7000\") or die; IO::Socket::INET->new(\"127.0.0.1:7000\") or die'",
    );
    h.engine.destroy(&a.id).unwrap();
}

#[test]
fn memory_and_pids_limits_hold_inside_and_the_host_is_unaffected() {
    let h = Harness::new();
    let g = h.golden(&[]);
    let spec = BoxSpec {
        limits: Some(Limits { cpu_millis: 500, memory_bytes: 64 << 20, pids: 32 }),
        ..small()
    };
    let a = h.engine.clone_golden(&g, &id("iso-lim"), &spec).unwrap();
    // silkd and what it starts are in the sandbox's own groups, each of them.
    ok(&a, "sleep 60 >/dev/null 2>&1 &");
    assert_eq!(outside_own_cgroups(&a), Vec::<String>::new());
    // 256 MiB in a 64 MiB sandbox: the allocating process is killed, silkd survives.
    let (code, _) = sh(&a, "perl -e '$x = \"a\" x (256 * 1024 * 1024); print length($x)'");
    assert_ne!(code, 0, "allocation past the limit must fail");
    assert_eq!(ok(&a, "echo alive"), "alive");

    // A fork bomb in slow motion: the pid limit stops it well below 100 processes.
    let out = ok(
        &a,
        "perl -e 'for $n (1..100) { $p = fork(); if (!defined $p) { print \"stopped at $n\"; exit 0 } if ($p == 0) { close STDOUT; close STDERR; sleep 30; exit 0 } } print \"unbounded\"'",
    );
    assert!(out.starts_with("stopped at"), "{out}");
    h.engine.destroy(&a.id).unwrap();
    assert!(traces(&h, &a.id, a.pid).is_empty(), "{:?}", traces(&h, &a.id, a.pid));
}

fn box_dir(h: &Harness, b: &BoxInfo) -> std::path::PathBuf {
    h.data.path().join("boxes").join(b.id.as_str())
}

#[test]
fn root_inside_is_an_unprivileged_host_id_and_templates_still_look_root_owned() {
    use std::os::unix::fs::MetadataExt;
    let h = Harness::new();
    let g = h.golden(&["sh", "-c", "echo warm > /root/warm"]);
    let a = h.engine.clone_golden(&g, &id("iso-userns"), &small()).unwrap();
    let base = silk_engine::jail::DEFAULT_ID_BASE;

    // Not the identity map: uid 0 inside is `base` outside.
    let map = ok(&a, "cat /proc/self/uid_map");
    let fields: Vec<&str> = map.split_whitespace().collect();
    assert_eq!(fields, ["0", &base.to_string(), "65536"], "{map}");
    assert_eq!(
        ok(&a, "cat /proc/self/gid_map").split_whitespace().nth(1),
        Some(&*base.to_string())
    );
    // Template files (host root's), golden files (the range's) and / look root-owned inside,
    // and root can change them (copy-up through the id-mapped template layer).
    assert_eq!(
        ok(&a, "stat -c '%u:%g' /etc/passwd /usr/bin/env /root/warm / /dev/null /tmp"),
        "0:0\n0:0\n0:0\n0:0\n0:0\n0:0"
    );
    ok(
        &a,
        "echo '10.0.0.1 extra' >> /etc/hosts && adduser_line='x:x:1000:1000::/:/bin/sh' && echo made > /made",
    );
    ok(
        &a,
        "mkdir -p /home/user/d && chown 1000:1000 /home/user/d && touch /home/user/d/f && chown 1000 /home/user/d/f",
    );
    // On the host those files belong to the range, never to host root.
    let upper = upper_dir(&h, &a.id);
    for (path, uid) in [("made", base), ("etc/hosts", base), ("home/user/d/f", base + 1000)] {
        let meta = std::fs::symlink_metadata(upper.join(path)).unwrap();
        assert_eq!(meta.uid(), uid, "{path} is owned by {} on the host", meta.uid());
    }
    // Root inside holds nothing over the host: a host-owned file it can see through /proc
    // (its own log, opened before it entered the namespace) is out of reach.
    let (code, _) = sh(&a, "echo x >> /proc/1/fd/2");
    assert_ne!(code, 0, "a sandbox wrote to silkd's log through /proc/1/fd/2");
    let (code, _) = sh(&a, "cat /proc/1/environ");
    assert_ne!(code, 0, "silkd is not dumpable: its memory and fds are not the sandbox's");
    h.engine.destroy(&a.id).unwrap();
}

#[test]
fn proc_hides_host_kernel_state_and_refuses_global_writes() {
    let h = Harness::new();
    let g = h.golden(&[]);
    let a = h.engine.clone_golden(&g, &id("iso-proc"), &small()).unwrap();
    let core_pattern = std::fs::read_to_string("/proc/sys/kernel/core_pattern").unwrap();

    // The write that would hand host root to the sandbox: refused, even of the same value.
    let (code, _) = sh(&a, "cat /proc/sys/kernel/core_pattern > /proc/sys/kernel/core_pattern");
    assert_ne!(code, 0, "core_pattern is writable");
    let (code, _) = sh(&a, "echo '|/tmp/x' > /proc/sys/kernel/core_pattern");
    assert_ne!(code, 0);
    assert_eq!(std::fs::read_to_string("/proc/sys/kernel/core_pattern").unwrap(), core_pattern);
    for sysctl in ["vm/drop_caches", "kernel/panic", "kernel/hostname", "net/ipv4/ip_forward"] {
        let (code, _) = sh(&a, &format!("echo 1 > /proc/sys/{sysctl}"));
        assert_ne!(code, 0, "/proc/sys/{sysctl} is writable");
    }
    if std::path::Path::new("/proc/sysrq-trigger").exists() {
        let (code, _) = sh(&a, "echo h > /proc/sysrq-trigger");
        assert_ne!(code, 0, "sysrq-trigger is writable");
    }
    // Masked: read as empty (a file) or an empty directory.
    for masked in ["kcore", "keys", "timer_list", "sched_debug", "latency_stats", "timer_stats"] {
        if std::path::Path::new("/proc").join(masked).exists() {
            assert_eq!(ok(&a, &format!("wc -c < /proc/{masked}")), "0", "/proc/{masked}");
        }
    }
    for masked in ["acpi", "scsi"] {
        if std::path::Path::new("/proc").join(masked).is_dir() {
            assert_eq!(ok(&a, &format!("ls -A /proc/{masked} | wc -l")), "0", "/proc/{masked}");
        }
    }
    // Read-only, and the sandbox cannot undo it.
    let mounts = ok(&a, "cat /proc/self/mountinfo");
    for ro in ["/proc/sys", "/proc/bus", "/proc/fs", "/proc/irq"] {
        let line = mounts.lines().find(|l| l.split(' ').nth(4) == Some(ro));
        assert!(
            line.is_some_and(|l| l.split(' ').nth(5).unwrap().starts_with("ro")),
            "{ro}: {line:?}"
        );
    }
    let (code, _) = sh(&a, "umount /proc/sys || umount -l /proc/kcore");
    assert_ne!(code, 0);
    assert!(mounts.lines().all(|l| l.split(' ').nth(4) != Some("/sys")), "/sys is not mounted");
    // The overlay root and every writable mount are nosuid,nodev; `/tmp` and `/run` are the
    // root's own directories.
    for target in ["/tmp", "/run"] {
        assert!(mounts.lines().all(|l| l.split(' ').nth(4) != Some(target)), "{target} is a mount");
    }
    for target in ["/", "/dev/shm"] {
        let line = mounts.lines().find(|l| l.split(' ').nth(4) == Some(target)).unwrap();
        let opts = line.split(' ').nth(5).unwrap();
        assert!(opts.contains("nosuid") && opts.contains("nodev"), "{target}: {opts}");
    }
    // Binding a low port works although the sandbox's root has no capability over the
    // network namespace (it belongs to the host).
    ok(
        &a,
        "perl -MIO::Socket::INET -e 'IO::Socket::INET->new(Listen => 1, LocalAddr => \"127.0.0.1:80\") or die \"$!\"'",
    );
    h.engine.destroy(&a.id).unwrap();
}

#[test]
fn a_relaunch_never_writes_through_symlinks_the_sandbox_planted() {
    let h = Harness::new();
    let g = h.golden(&[]);
    let a = h.engine.clone_golden(&g, &id("iso-links"), &small()).unwrap();
    let host = tempfile::tempdir().unwrap();
    let (hostname, machine_id) = (host.path().join("hostname"), host.path().join("machine-id"));
    std::fs::write(&machine_id, "host file\n").unwrap();
    ok(
        &a,
        &format!(
            "ln -sf {} /etc/hostname && ln -sf {} /etc/machine-id",
            hostname.display(),
            machine_id.display()
        ),
    );
    // And a relative escape through a planted directory link.
    ok(&a, "rm -rf /opt && ln -s ../../../../../../../.. /opt");
    h.engine.stop(&a.id, Memory::Off).unwrap();
    let a = h.engine.resume(&a.id).unwrap();
    assert!(!hostname.exists(), "the launcher created a host file through a symlink");
    assert_eq!(std::fs::read_to_string(&machine_id).unwrap(), "host file\n");
    // Inside, the files are the sandbox's own again.
    assert_eq!(ok(&a, "cat /etc/hostname"), "iso-links");
    assert_eq!(ok(&a, "test -L /etc/machine-id || wc -c < /etc/machine-id"), "33");
    h.engine.destroy(&a.id).unwrap();
}

/// silkd is bound over `/run/silkd`, a file of the sandbox's own tree (`/run` is no tmpfs). An
/// image may hold a link or a FIFO there: the launcher, still host root when it binds silkd,
/// neither follows the link onto a host file nor blocks on the FIFO. The image does not start.
#[test]
fn an_image_with_a_planted_silkd_mount_point_does_not_start() {
    use std::os::unix::fs::MetadataExt;
    let h = Harness::new();
    let host = tempfile::tempdir().unwrap();
    let target = host.path().join("target");
    std::fs::write(&target, "host file\n").unwrap();
    for name in ["link", "fifo"] {
        let root = host.path().join(name);
        for dir in ["dev", "proc", "tmp", "run", "etc"] {
            std::fs::create_dir_all(root.join(dir)).unwrap();
        }
        let at = root.join("run/silkd");
        if name == "link" {
            std::os::unix::fs::symlink(&target, &at).unwrap();
        } else {
            let at = std::ffi::CString::new(at.as_os_str().as_encoded_bytes()).unwrap();
            // SAFETY: mkfifo on a path made here.
            assert_eq!(unsafe { libc::mkfifo(at.as_ptr(), 0o644) }, 0);
        }
        let def = TemplateDef { name: name.into(), source: TemplateSource::Dir(root) };
        let refused = h
            .engine
            .template(&def)
            .and_then(|t| h.engine.prepare(&t, &Warmup::default()))
            .and_then(|g| h.engine.clone_golden(&g, &id(&format!("iso-run-{name}")), &small()))
            .unwrap_err();
        assert!(refused.to_string().contains("/run/silkd is not a regular file"), "{refused}");
    }
    let meta = std::fs::metadata(&target).unwrap();
    assert_eq!((meta.uid(), meta.gid()), (0, 0), "the launcher chowned a host file");
    assert_eq!(std::fs::read_to_string(&target).unwrap(), "host file\n");
}

#[test]
fn setuid_files_a_sandbox_makes_give_nothing_on_the_host() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let h = Harness::new();
    let g = h.golden(&[]);
    let a = h.engine.clone_golden(&g, &id("iso-suid"), &small()).unwrap();
    ok(&a, "cp /bin/sh /opt/rootsh && chmod 4755 /opt/rootsh && ls -l /opt/rootsh");
    let file = upper_dir(&h, &a.id).join("opt/rootsh");
    let meta = std::fs::metadata(&file).unwrap();
    assert_ne!(meta.uid(), 0, "a setuid file owned by host root");
    for dir in [h.data.path().to_path_buf(), h.data.path().join("boxes"), box_dir(&h, &a)] {
        let mode = std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o700, "{} is {mode:o}", dir.display());
    }
    // An unprivileged host user cannot run it, let alone as root.
    let out = std::process::Command::new("runuser")
        .args(["-u", "nobody", "--"])
        .arg(&file)
        .args(["-c", "id -u"])
        .output()
        .unwrap();
    assert!(!out.status.success() || String::from_utf8_lossy(&out.stdout).trim() != "0", "{out:?}");
    // Inside, setuid does nothing either (no_new_privs, nosuid).
    assert_eq!(
        ok(&a, "setpriv --reuid=65534 --regid=65534 --clear-groups /opt/rootsh -c 'id -u'"),
        "65534"
    );
    h.engine.destroy(&a.id).unwrap();
}

#[test]
fn captures_stay_the_size_of_the_data() {
    let h = Harness::new();
    let g = h.golden(&[]);
    let a = h.engine.clone_golden(&g, &id("iso-sparse"), &small()).unwrap();
    ok(
        &a,
        "truncate -s 64G /root/sparse && echo tail >> /root/sparse \
         && head -c 67108864 /dev/urandom > /root/data \
         && for i in $(seq 200); do ln /root/data /root/link$i; done",
    );
    let snap_path = h.data.path().join("sparse.tar");
    let snap =
        h.engine.snapshot(&a.id, SnapshotMode::KeepRunning, Memory::Off, &snap_path).unwrap();
    assert!(
        snap.bytes < 70 << 20,
        "a 64 MiB file, 200 links to it and a 64 GiB sparse file captured as {} bytes",
        snap.bytes
    );
    let b = h.engine.restore(&snap, &id("iso-sparse-b"), &small(), Memory::Off).unwrap();
    assert_eq!(
        ok(&b, "stat -c %s /root/sparse; stat -c %h /root/data; tail -c 5 /root/sparse"),
        "68719476741\n201\ntail"
    );
    assert_eq!(ok(&a, "md5sum < /root/data"), ok(&b, "md5sum < /root/link7"));
    h.engine.destroy(&a.id).unwrap();
    h.engine.destroy(&b.id).unwrap();
}

#[test]
fn a_file_named_like_a_whiteout_cannot_delete_files_on_restore() {
    let h = Harness::new();
    let g = h.golden(&[]);
    let a = h.engine.clone_golden(&g, &id("iso-wh"), &small()).unwrap();
    ok(&a, "touch /etc/.wh.passwd");
    let err = h
        .engine
        .snapshot(&a.id, SnapshotMode::KeepRunning, Memory::Off, &h.data.path().join("wh.tar"))
        .unwrap_err();
    assert!(matches!(err, EngineError::BadRequest(_)), "{err}");
    assert!(err.to_string().contains(".wh.passwd"), "{err}");
    assert_eq!(ok(&a, "echo still running"), "still running");
    h.engine.destroy(&a.id).unwrap();
}

#[test]
fn seccomp_is_no_looser_than_dockers_default() {
    let h = Harness::new();
    let g = h.golden(&[]);
    let a = h.engine.clone_golden(&g, &id("iso-seccomp"), &small()).unwrap();
    let eperm = "Operation not permitted";
    // socket(AF_VSOCK, SOCK_STREAM, 0): vsock ignores network namespaces.
    assert_eq!(syscall(&a, 41, ", 40, 1, 0"), eperm, "socket(AF_VSOCK)");
    assert_eq!(syscall(&a, 41, ", 38, 5, 0"), eperm, "socket(AF_ALG)");
    // personality(ADDR_NO_RANDOMIZE) and (READ_IMPLIES_EXEC); a query stays allowed.
    assert_eq!(syscall(&a, 135, ", 0x40000"), eperm, "personality(ADDR_NO_RANDOMIZE)");
    assert_eq!(syscall(&a, 135, ", 0x400000"), eperm, "personality(READ_IMPLIES_EXEC)");
    assert_eq!(syscall(&a, 135, ", 0xffffffff"), "ok");
    assert_eq!(syscall(&a, 438, ", 0, 0, 0"), eperm, "pidfd_getfd");
    assert_eq!(syscall(&a, 312, ", 0, 0, 0, 0, 0"), eperm, "kcmp");
    assert_eq!(syscall(&a, 300, ", 0, 0"), eperm, "fanotify_init");
    assert_eq!(syscall(&a, 237, ", 0, 0, 0, 0, 0, 0"), eperm, "mbind");
    assert_eq!(syscall(&a, 170, ", 0, 0"), eperm, "sethostname");
    // clone with a namespace flag (CLONE_NEWNS | SIGCHLD).
    assert_eq!(syscall(&a, 56, ", 0x20011, 0, 0, 0, 0"), eperm, "clone(CLONE_NEWNS)");
    assert_ne!(sh(&a, "unshare -m true").0, 0, "unshare");
    assert_ne!(sh(&a, "mknod /tmp/sda b 8 0").0, 0, "mknod");
    // Plain processes and sockets still work.
    ok(&a, "sh -c 'echo child' && perl -MSocket -e 'socket(S, AF_UNIX, SOCK_STREAM, 0) or die'");
    h.engine.destroy(&a.id).unwrap();
}

#[test]
fn a_sandbox_cannot_use_up_host_roots_inotify_instances() {
    // The kernel charges a user namespace's inotify instances to its creator too: with host
    // root as the creator, one sandbox could leave root's daemons without inotify.
    let h = Harness::new();
    let g = h.golden(&[]);
    let a = h.engine.clone_golden(&g, &id("iso-inotify"), &small()).unwrap();
    let limit: usize = std::fs::read_to_string("/proc/sys/fs/inotify/max_user_instances")
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let holder = a.clone();
    let script = format!(
        "perl -e 'for (1..{}) {{ $r = syscall(294, 0); push @k, $r if $r >= 0 }} \
         open F, \">/tmp/held\"; print F scalar(@k); close F; sleep 5'",
        limit + 16
    );
    let holding = std::thread::spawn(move || sh(&holder, &script));
    let mut held = String::new();
    for _ in 0..200 {
        held = ok(&a, "cat /tmp/held 2>/dev/null || true");
        if !held.is_empty() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert!(!held.is_empty(), "the sandbox never reported");
    // While the sandbox holds all it could get, host root still gets one.
    // SAFETY: plain syscalls.
    let fd = unsafe { libc::inotify_init1(libc::IN_CLOEXEC) };
    let err = std::io::Error::last_os_error();
    assert!(fd >= 0, "host root has no inotify instance left ({err}) while a sandbox holds {held}");
    unsafe { libc::close(fd) };
    holding.join().unwrap();
    h.engine.destroy(&a.id).unwrap();
}
