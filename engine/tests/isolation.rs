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
