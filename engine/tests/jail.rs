//! The jail backend: the shared engine contract, plus what is specific to jails (templates,
//! re-adoption after a restart, a sandbox whose silkd dies).

mod common;

use common::*;
use silk_engine::*;

#[test]
fn contract_goldens() {
    let h = Harness::new();
    contract::goldens_are_reused_and_carry_the_warmup(&h.engine, &h.host());
}

#[test]
fn contract_clones() {
    let h = Harness::new();
    contract::clones_are_separate_machines(&h.engine, &h.host());
}

#[test]
fn contract_snapshots() {
    let h = Harness::new();
    contract::snapshot_and_restore_keep_the_filesystem(&h.engine, &h.host(), h.data.path());
}

#[test]
fn contract_snapshots_from_a_stream() {
    let h = Harness::new();
    contract::snapshots_restore_from_a_stream(&h.engine, &h.host(), h.data.path());
}

#[test]
fn contract_stop_and_resume() {
    let h = Harness::new();
    contract::stopped_sandboxes_resume_on_their_files(&h.engine, &h.host(), h.data.path());
}

#[test]
fn contract_errors() {
    let h = Harness::new();
    contract::errors_are_typed(&h.engine, &h.host(), h.data.path());
}

#[test]
fn contract_goldens_travel() {
    let (a, b) = (Harness::new(), Harness::new());
    contract::goldens_travel_between_engines(
        (&a.engine, &a.host()),
        (&b.engine, &b.host()),
        a.data.path(),
    );
}

#[test]
fn contract_promote() {
    let h = Harness::new();
    contract::goldens_from_snapshots_keep_every_change(&h.engine, &h.host(), h.data.path());
}

#[test]
fn capabilities_say_what_the_jail_cannot_do() {
    let h = Harness::new();
    let caps = h.engine.capabilities();
    assert!(!caps.egress);
    // Memory where CRIU works (tests/memory.rs), and why not where it does not.
    assert_eq!(caps.memory_snapshot, h.engine.memory_why_not().is_none());
}

#[test]
fn host_template_is_stable_and_missing_templates_are_reported() {
    let h = Harness::new();
    assert_eq!(h.host(), h.host());
    let missing =
        TemplateDef { name: "gone".into(), source: TemplateSource::Dir("/no/such/rootfs".into()) };
    assert!(matches!(h.engine.template(&missing), Err(EngineError::TemplateNotFound(_))));
    let corrupt = h.data.path().join("corrupt.tar");
    std::fs::write(&corrupt, vec![0x42; 4096]).unwrap();
    let image = TemplateDef { name: "bad".into(), source: TemplateSource::Image(corrupt) };
    assert!(matches!(h.engine.template(&image), Err(EngineError::BadTemplate(_))));
}

#[test]
fn a_restarted_engine_readopts_running_jails_and_sees_dead_ones() {
    let h = Harness::new();
    let g = h.golden(&[]);
    let a = h.engine.clone_golden(&g, &id("r-a"), &small()).unwrap();
    let b = h.engine.clone_golden(&g, &id("r-b"), &small()).unwrap();
    ok(&a, "echo kept > /root/state");

    let restarted = h.reopen();
    let listed = restarted.list().unwrap();
    assert_eq!(listed.len(), 2);
    assert!(listed.iter().all(|i| i.running));
    let again = listed.iter().find(|i| i.id == a.id).unwrap();
    assert_eq!(ok(again, "cat /root/state"), "kept", "the same sandbox, still usable");

    // silkd (the jail's PID 1) dies: the jail is over, and list says so.
    kill_silkd(&restarted, &b);
    restarted.destroy(&b.id).unwrap();
    assert!(traces(&h, &b.id, b.pid).is_empty());
}

/// SIGKILLs a jail's silkd (its PID 1) and waits until `engine` lists the jail as not running.
fn kill_silkd(engine: &dyn Engine, jail: &BoxInfo) {
    unsafe { libc::kill(jail.pid.unwrap() as i32, libc::SIGKILL) };
    let stopped = (0..500).any(|_| {
        std::thread::sleep(std::time::Duration::from_millis(10));
        engine.list().unwrap().iter().any(|i| i.id == jail.id && !i.running)
    });
    assert!(stopped, "a jail whose silkd died is listed as not running");
}

#[test]
fn a_jail_whose_silkd_died_comes_back_from_its_files() {
    let h = Harness::new();
    let g = h.golden(&[]);
    let a = h.engine.clone_golden(&g, &id("x-a"), &small()).unwrap();
    ok(&a, "mkdir -p /root/work && echo kept > /root/work/state");
    kill_silkd(&h.engine, &a);

    let tar = h.data.path().join("x-a.tar");
    let snap = h.engine.snapshot(&a.id, SnapshotMode::Stop, Memory::Off, &tar).unwrap();
    assert!(traces(&h, &a.id, a.pid).is_empty(), "a stop snapshot removes the dead jail");
    let back = h.engine.restore(&snap, &a.id, &small(), Memory::Off).unwrap();
    assert!(back.running);
    assert_eq!(ok(&back, "cat /root/work/state"), "kept");
    h.engine.destroy(&back.id).unwrap();
}

/// A start hands the connection its silkd answered the readiness probe on to that sandbox's
/// first caller, once: the first call then opens no connection into the jail. No sandbox's is
/// handed out for another id, and a stop closes one nobody took.
#[test]
fn a_start_hands_its_answered_connection_to_that_sandboxs_first_caller_only() {
    let h = Harness::new();
    let g = h.golden(&[]);
    let a = h.engine.clone_golden(&g, &id("p-a"), &small()).unwrap();
    let b = h.engine.clone_golden(&g, &id("p-b"), &small()).unwrap();
    ok(&a, "echo a > /root/who");
    ok(&b, "echo b > /root/who");
    assert!(h.engine.take_answered(&id("p-c")).is_none(), "no start, no connection");
    let to_a = h.engine.take_answered(&a.id).expect("a's start kept the probe's connection");
    assert!(h.engine.take_answered(&a.id).is_none(), "handed out once");
    assert_eq!(run_on(to_a, "cat /root/who"), "a");

    h.engine.stop(&b.id, Memory::Off).unwrap();
    assert!(h.engine.take_answered(&b.id).is_none(), "the stop closed the one not taken");
    let back = h.engine.resume(&b.id).unwrap();
    let to_b = h.engine.take_answered(&back.id).expect("a wake keeps its probe's connection too");
    assert_eq!(run_on(to_b, "cat /root/who"), "b");
    h.engine.destroy(&a.id).unwrap();
    h.engine.destroy(&b.id).unwrap();
}

/// Runs `script` over `conn` (a connection to some silkd) and returns its trimmed stdout.
fn run_on(conn: std::os::unix::net::UnixStream, script: &str) -> String {
    use silk_proto::{Command, ExecRequest, Frame, decode, encode};
    use std::io::{Read, Write};
    let mut conn = conn;
    conn.set_nonblocking(false).unwrap();
    conn.set_read_timeout(Some(std::time::Duration::from_secs(30))).unwrap();
    let argv = ["/bin/sh", "-c", script].map(String::from).to_vec();
    let exec = ExecRequest {
        command: Command { argv, ..Default::default() },
        stdin: false,
        timeout_ms: Some(30_000),
    };
    let mut out = bytes::BytesMut::new();
    encode(&Frame::Exec(exec), &mut out).unwrap();
    conn.write_all(&out).unwrap();
    let (mut buf, mut stdout) = (bytes::BytesMut::new(), Vec::new());
    loop {
        while let Some(frame) = decode(&mut buf).unwrap() {
            match frame {
                Frame::Stdout(b) => stdout.extend_from_slice(&b),
                Frame::Exit(status) => {
                    assert_eq!(status.code, 0, "`{script}` failed");
                    return String::from_utf8_lossy(&stdout).trim().to_string();
                }
                Frame::Error(e) => panic!("`{script}`: {e}"),
                _ => {}
            }
        }
        let mut chunk = [0u8; 4096];
        let n = conn.read(&mut chunk).unwrap();
        assert!(n > 0, "silkd closed the connection");
        buf.extend_from_slice(&chunk[..n]);
    }
}

/// Jails never share a network namespace, whether the launcher made theirs on the start or
/// ahead of it (the launcher server keeps a few made between starts): started in pairs after a
/// pause (the namespaces made ahead) and back to back (more than were made ahead).
#[test]
fn every_jail_has_a_network_namespace_of_its_own() {
    let h = Harness::new();
    let g = h.golden(&[]);
    let mut jails = vec![];
    for i in 0..10 {
        if i % 2 == 0 && i < 6 {
            std::thread::sleep(std::time::Duration::from_millis(150));
        }
        jails.push(h.engine.clone_golden(&g, &id(&format!("n-{i}")), &small()).unwrap());
    }
    let net = |pid: u32| std::fs::read_link(format!("/proc/{pid}/ns/net")).unwrap();
    let nets: std::collections::HashSet<_> = jails.iter().map(|j| net(j.pid.unwrap())).collect();
    assert_eq!(nets.len(), jails.len(), "two jails share a network namespace");
    assert!(!nets.contains(&net(std::process::id())), "a jail in the host's");
    for j in &jails {
        // Only its own loopback, up: its silkd answered on it through the engine.
        assert_eq!(ok(j, "sed -n '3,$s/:.*//p' /proc/net/dev | tr -d ' '"), "lo");
        h.engine.destroy(&j.id).unwrap();
    }
}

#[test]
fn destroy_leaves_nothing_behind() {
    let h = Harness::new();
    let g = h.golden(&[]);
    let a = h.engine.clone_golden(&g, &id("d-a"), &small()).unwrap();
    ok(&a, "sleep 100 >/dev/null 2>&1 & echo started");
    assert!(!traces(&h, &a.id, a.pid).is_empty());
    h.engine.destroy(&a.id).unwrap();
    assert_eq!(traces(&h, &a.id, a.pid), Vec::<String>::new());
}

/// A stop returns before its overlay is unmounted (a sync of all the sandbox wrote): that runs
/// behind it, holding the overlay open. A wake right after mounts it again over the same files
/// and finds every one, and a destroy right after leaves nothing behind.
#[test]
fn a_stopped_box_is_unmounted_behind_the_stop() {
    let h = Harness::new();
    let g = h.golden(&[]);
    let a = h.engine.clone_golden(&g, &id("u-a"), &small()).unwrap();
    ok(&a, "head -c 67108864 /dev/urandom > /root/big && echo kept > /root/small");
    h.engine.stop(&a.id, Memory::Off).unwrap();
    let back = h.engine.resume(&a.id).unwrap();
    assert_eq!(ok(&back, "cat /root/small; wc -c < /root/big"), "kept\n67108864");
    ok(&back, "head -c 67108864 /dev/urandom > /root/again");
    h.engine.stop(&a.id, Memory::Off).unwrap();
    h.engine.destroy(&a.id).unwrap();
    assert_eq!(traces(&h, &a.id, back.pid), Vec::<String>::new());
}

#[test]
fn a_sandbox_frozen_by_a_crash_mid_snapshot_is_thawed_at_start() {
    let h = Harness::new();
    let g = h.golden(&[]);
    let a = h.engine.clone_golden(&g, &id("f-a"), &small()).unwrap();
    // What a kill -9 inside `snapshot` leaves: the sandbox's freezer cgroup still FROZEN.
    let instance = blake3::hash(h.data.path().as_os_str().as_encoded_bytes()).to_hex();
    let state = std::path::Path::new("/sys/fs/cgroup/freezer")
        .join(format!("silkmesh-{}", &instance[..12]))
        .join("f-a/freezer.state");
    let v2 = std::path::Path::new("/sys/fs/cgroup")
        .join(format!("silkmesh-{}", &instance[..12]))
        .join("f-a/cgroup.freeze");
    if state.exists() {
        std::fs::write(&state, "FROZEN").unwrap();
    } else {
        std::fs::write(&v2, "1").unwrap();
    }
    let restarted = h.reopen();
    let again = restarted.list().unwrap().into_iter().find(|i| i.id == a.id).unwrap();
    assert_eq!(ok(&again, "echo thawed"), "thawed");
    restarted.destroy(&a.id).unwrap();
}

#[test]
fn a_golden_whose_digest_only_shares_a_prefix_never_passes_for_another() {
    // Golden directories are named by a digest's first 16 digits; a digest named by a hostile
    // store can share them with a real golden's.
    let h = Harness::new();
    let real = h.golden(&["sh", "-c", "echo real > /root/which"]);
    let tar = h.data.path().join("real.tar");
    h.engine.export_golden(&real, &tar).unwrap();
    let lookalike: Digest = format!("{}{}", real.digest.short(), "0".repeat(48)).parse().unwrap();
    assert_ne!(lookalike, real.digest);
    assert!(h.engine.find_golden(&lookalike).is_none());
    let err = h.engine.import_golden(&real.template, &lookalike, &tar).unwrap_err();
    assert!(err.to_string().contains("holds another golden"), "{err}");
    assert_eq!(h.engine.find_golden(&real.digest), Some(real));
}

/// silkd stopped (here SIGSTOP; in life its CPU limit throttles it for the rest of a scheduler
/// period) while connections arrive: once its accept queue is full a connect fails at once with
/// `WouldBlock`, and `agent::connect` waits for room instead of reporting silkd unreachable.
#[test]
fn a_full_accept_queue_makes_a_connect_wait_not_fail() {
    let h = Harness::new();
    let g = h.golden(&[]);
    let a = h.engine.clone_golden(&g, &id("q-a"), &small()).unwrap();
    let pid = a.pid.unwrap() as i32;
    unsafe { libc::kill(pid, libc::SIGSTOP) };
    let mut queued = vec![];
    let full = loop {
        match silk_engine::agent::try_connect(&a.agent) {
            Ok(s) => queued.push(s),
            Err(e) => break e,
        }
        assert!(queued.len() < 100_000, "the accept queue never filled");
    };
    assert!(silk_engine::agent::queue_full(&full), "{full}");
    let thaw = std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_millis(300));
        unsafe { libc::kill(pid, libc::SIGCONT) };
    });
    drop(queued);
    silk_engine::agent::connect(&a.agent).expect("a connect waits for room in the queue");
    thaw.join().unwrap();
    assert_eq!(ok(&a, "echo served"), "served");
    h.engine.destroy(&a.id).unwrap();
}

/// The jail's copies share one unpacked layer: it lives as long as any copy (stopped, resumed,
/// across a restart) and goes with the last one.
#[test]
fn forks_share_one_layer_until_the_last_copy_goes() {
    let h = Harness::new();
    let forks = h.data.path().join("forks");
    let layers = || std::fs::read_dir(&forks).unwrap().count();
    let kids = contract::forks_start_from_the_source_and_go_their_own_ways(
        &h.engine,
        &h.host(),
        h.data.path(),
    );
    assert_eq!(layers(), 1, "one layer for the three copies (the failed fork left none)");
    // The copy that rewrote a shared file in place did not write through to the layer.
    let shared = std::fs::read_dir(&forks).unwrap().next().unwrap().unwrap().path();
    assert_eq!(std::fs::read_to_string(shared.join("layer/srv/f/mod")).unwrap(), "mod\n");
    assert_eq!(std::fs::read_to_string(shared.join("layer/srv/f/keep")).unwrap(), "keep\n");

    h.engine.destroy(&kids[0].id).unwrap();
    h.engine.stop(&kids[1].id, Memory::Off).unwrap();
    // A stopped copy forks too: its two layers become the new fork's one.
    let scratch = h.data.path().join("g.tar");
    let grandkid = h.engine.fork(&kids[1].id, &[id("k-8")], &small(), Memory::Off, &scratch);
    let grandkid = grandkid.unwrap().pop().unwrap();
    assert_eq!(ok(&grandkid, "cat /srv/f/same /srv/f/keep"), "same\nkeep");
    assert_eq!(layers(), 2);
    h.engine.destroy(&grandkid.id).unwrap();
    assert_eq!(layers(), 1);
    let restarted = h.reopen();
    let back = restarted.resume(&kids[1].id).unwrap();
    assert_eq!(ok(&back, "cat /srv/f/keep"), "keep");
    restarted.destroy(&back.id).unwrap();
    assert_eq!(layers(), 1, "a copy still runs on it");
    restarted.destroy(&kids[2].id).unwrap();
    assert_eq!(layers(), 0, "the last copy took the layer with it");
}

/// A destroy frees the id at once (a box of that id may start again right away: a sandbox moved
/// back, or woken here from its archive) and the files go behind it; what a crash left in the
/// trash goes when the next engine opens.
#[test]
fn a_destroyed_box_frees_its_id_at_once_and_its_files_go_behind_it() {
    let h = Harness::new();
    let host = h.host();
    let trash = h.data.path().join("trash");
    let entries = || std::fs::read_dir(&trash).unwrap().count();
    let a = h.engine.boot(&host, &id("t-1"), &small()).unwrap();
    ok(
        &a,
        "head -c 4194304 /dev/urandom > /root/four && mkdir -p /root/d/e && echo x > /root/d/e/f",
    );
    h.engine.destroy(&a.id).unwrap();
    assert_eq!(traces(&h, &a.id, a.pid), Vec::<String>::new(), "the box is gone at once");
    let again = h.engine.boot(&host, &id("t-1"), &small()).unwrap();
    assert_eq!(ok(&again, "test -e /root/four && echo old || echo new"), "new");
    h.engine.destroy(&again.id).unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while entries() > 0 {
        assert!(std::time::Instant::now() < deadline, "the trash was not emptied");
        std::thread::sleep(std::time::Duration::from_millis(10));
    }

    // A crash between a box's move into the trash and its deletion.
    std::fs::create_dir_all(trash.join("t-2.1.2.0/upper/deep")).unwrap();
    std::fs::write(trash.join("t-2.1.2.0/upper/deep/file"), "x").unwrap();
    // An engine that closes has finished its deletions.
    drop(h.reopen());
    assert_eq!(entries(), 0, "the next engine deleted what the crash left");
}

/// Deleting a destroyed box walks a tree its sandbox wrote: links planted there to host files
/// and directories are removed as links, never followed.
#[test]
fn deleting_a_box_never_follows_the_links_its_sandbox_planted() {
    let data = tempfile::tempdir().unwrap();
    let host = tempfile::tempdir().unwrap();
    std::fs::create_dir(host.path().join("dir")).unwrap();
    for kept in ["dir/kept", "file"] {
        std::fs::write(host.path().join(kept), "host file\n").unwrap();
    }
    let mut cfg = silk_engine::jail::JailConfig::new(
        data.path(),
        static_silkd(),
        env!("CARGO_BIN_EXE_silk-jail"),
    );
    // The upper directory then sits in the box itself (not in a disk image), so the deletion
    // meets the sandbox's files one by one.
    cfg.bound_disks = false;
    let engine = silk_engine::jail::JailEngine::new(cfg).unwrap();
    let template = engine.template(&TemplateDef::host()).unwrap();
    let b = engine.boot(&template, &id("t-3"), &small()).unwrap();
    let h = host.path().display();
    ok(
        &b,
        &format!(
            "ln -s {h}/dir /root/dir && ln -s {h}/file /root/file && mkdir /root/d && ln -s {h} /root/d/up"
        ),
    );
    engine.destroy(&b.id).unwrap();
    // An engine that closes has finished its deletions.
    drop(engine);
    assert_eq!(std::fs::read_dir(data.path().join("trash")).unwrap().count(), 0, "deleted");
    for kept in ["dir/kept", "file"] {
        let content = std::fs::read_to_string(host.path().join(kept));
        assert_eq!(content.ok().as_deref(), Some("host file\n"), "{kept}: deleted through a link");
    }
}

/// A fork layer no copy links (a crash between its unpack and its release) goes at start.
#[test]
fn a_fork_layer_left_by_a_crash_is_removed_at_start() {
    let h = Harness::new();
    let left = h.data.path().join("forks/k-9-1");
    std::fs::create_dir_all(left.join("layer/srv")).unwrap();
    std::fs::write(left.join("ref"), "k-9-1").unwrap();
    let _restarted = h.reopen();
    assert!(!left.exists());
}

/// The launcher is one process the engine keeps (`silk-jail --serve`): a start forks it. One
/// that died is replaced by the next start, a start goes on while others run, and the server
/// goes when its engine does.
#[test]
fn the_launcher_server_is_replaced_when_it_dies_and_goes_with_its_engine() {
    let h = Harness::new();
    let g = h.golden(&[]);
    let server = h.engine.launcher_pid().expect("the golden's start ran the server");
    assert!(pid_alive(server));
    let cmdline = std::fs::read(format!("/proc/{server}/cmdline")).unwrap();
    assert!(cmdline.ends_with(b"--serve\0"), "{:?}", String::from_utf8_lossy(&cmdline));

    // Four at once: each answer reaches the start that asked for it.
    let started: Vec<BoxInfo> = std::thread::scope(|s| {
        let starts: Vec<_> = (0..4)
            .map(|i| {
                let (h, g) = (&h, &g);
                s.spawn(move || h.engine.clone_golden(g, &id(&format!("l-{i}")), &small()))
            })
            .collect();
        starts.into_iter().map(|t| t.join().unwrap().unwrap()).collect()
    });
    for (i, b) in started.iter().enumerate() {
        assert_eq!(ok(b, "hostname"), format!("l-{i}"));
    }
    assert_eq!(h.engine.launcher_pid(), Some(server), "one server for all of them");

    // SAFETY: kill(2) on the server this engine reported.
    unsafe { libc::kill(server as i32, libc::SIGKILL) };
    assert!((0..500).any(|_| {
        std::thread::sleep(std::time::Duration::from_millis(2));
        !pid_alive(server)
    }));
    let after = h.engine.clone_golden(&g, &id("l-after"), &small()).unwrap();
    assert_eq!(ok(&after, "hostname"), "l-after");
    let replaced = h.engine.launcher_pid().unwrap();
    assert_ne!(replaced, server);

    for b in started.iter().chain([&after]) {
        h.engine.destroy(&b.id).unwrap();
    }
    drop(h);
    assert!(
        (0..500).any(|_| {
            std::thread::sleep(std::time::Duration::from_millis(2));
            !pid_alive(replaced)
        }),
        "the server outlived its engine"
    );
}

#[test]
fn a_criu_a_killed_node_left_running_goes_when_the_next_engine_opens() {
    use std::os::unix::process::CommandExt;
    use std::process::Command;
    let h = Harness::new();
    let ours = h.data.path().join("trash/sb-gone/memory");
    let other = tempfile::tempdir().unwrap();
    // Processes named criu working on a directory, as CRIU's forks do (the system's python:
    // a pyenv shim would exec another with its own name). An orphan's parent, a subshell,
    // exits at once and init adopts it, as when their node was killed.
    let orphan = |dir: &std::path::Path| -> u32 {
        let script = format!(
            "(exec -a criu /usr/bin/python3 -c 'import time; time.sleep(300)' dump \
             --images-dir '{}' >/dev/null 2>&1 & echo $!)",
            dir.display()
        );
        let out = Command::new("bash").args(["-c", &script]).output().unwrap();
        String::from_utf8(out.stdout).unwrap().trim().parse().unwrap()
    };
    // Running: there and not a zombie (init reaps the killed orphan when it gets to it).
    let running = |pid: u32| {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        let state = stat.rsplit_once(')').and_then(|(_, r)| r.split_whitespace().next());
        state.is_some_and(|s| s != "Z" && s != "X")
    };
    let ppid = |pid: u32| {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        stat.rsplit_once(')').and_then(|(_, r)| r.split_whitespace().nth(1)?.parse::<u32>().ok())
    };
    let (left, elsewhere) = (orphan(&ours), orphan(other.path()));
    // One whose parent lives: a running engine's CRIU.
    let mut live = Command::new("/usr/bin/python3")
        .arg0("criu")
        .args(["-c", "import time; time.sleep(300)", "dump", "--images-dir"])
        .arg(&ours)
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while ppid(left) != Some(1) || ppid(elsewhere) != Some(1) {
        assert!(std::time::Instant::now() < deadline, "the orphans were not adopted by init");
        std::thread::sleep(std::time::Duration::from_millis(10));
    }

    let _restarted = h.reopen();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while running(left) {
        assert!(std::time::Instant::now() < deadline, "the orphaned criu still runs");
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    // Not this engine's, and one whose parent lives: left alone.
    assert!(running(elsewhere) && running(live.id()));
    unsafe { libc::kill(elsewhere as i32, libc::SIGKILL) };
    live.kill().unwrap();
    live.wait().unwrap();
}
