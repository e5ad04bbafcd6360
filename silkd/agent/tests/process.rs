//! Process verbs against a real silkd: exec, stdin, timeouts, spawn/ps/logs/attach/kill,
//! client disconnect, and 100 MiB through stdout.

mod common;

use bytes::Bytes;
use common::*;
use silk_proto::*;

#[tokio::test]
async fn exec_streams_output_and_reports_exit_codes() {
    let silkd = Silkd::start();
    let mut c = silkd.connect().await;
    let r = c.sh("echo out; echo err >&2; exit 3").await;
    assert!(matches!(r.frames[0], Frame::Started { .. }));
    assert_eq!((r.stdout().as_str(), r.stderr().as_str()), ("out\n", "err\n"));
    assert_eq!(r.exit(), ExitStatus { code: 3, signal: None, timed_out: false });

    // Calls run back to back on the same connection.
    let r = c.exec(&["true"]).await;
    assert_eq!(r.exit().code, 0);
    let r = c.sh("kill -TERM $$").await;
    assert_eq!(r.exit(), ExitStatus { code: 128 + 15, signal: Some(15), timed_out: false });
}

#[tokio::test]
async fn exec_env_is_clean_and_merged_cwd_and_user_apply() {
    let silkd = Silkd::start();
    let mut c = silkd.connect().await;
    let req = Frame::Exec(ExecRequest {
        command: Command {
            argv: vec![
                "sh".into(),
                "-c".into(),
                "pwd; echo $FOO; echo ${SECRET_FROM_HOST:-unset}; echo $PATH; id -u".into(),
            ],
            cwd: Some("/tmp".into()),
            env: vec![("FOO".into(), "bar".into())],
            user: Some("nobody".into()),
        },
        ..Default::default()
    });
    let r = c.call(req).await;
    let out = r.stdout();
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[0], "/tmp");
    assert_eq!(lines[1], "bar");
    assert_eq!(lines[2], "unset");
    assert!(lines[3].contains("/usr/bin"), "{out}");
    assert_ne!(lines[4], "0", "dropped to nobody");
    assert_eq!(r.exit().code, 0);
}

#[tokio::test]
async fn agent_environment_does_not_leak_into_children() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("s.sock");
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_silkd"));
    cmd.arg("--unix").arg(&socket).env("SILK_HOST_SECRET", "leak");
    let silkd = Silkd::launch(cmd, socket, dir);
    let mut c = silkd.connect().await;
    let r = c.sh("echo ${SILK_HOST_SECRET:-clean}").await;
    assert_eq!(r.stdout(), "clean\n");
}

#[tokio::test]
async fn exec_stdin_streams_in_until_eof() {
    let silkd = Silkd::start();
    let mut c = silkd.connect().await;
    let mut req = exec_req(&["sh", "-c", "wc -c; cat >/dev/null"]);
    if let Frame::Exec(e) = &mut req {
        e.stdin = true;
    }
    c.send(req).await;
    for _ in 0..10 {
        c.send(Frame::Stdin(Bytes::from(vec![b'x'; 100_000]))).await;
    }
    c.send(Frame::Eof).await;
    let r = c.reply().await;
    assert_eq!(r.stdout().trim(), "1000000");
    assert_eq!(r.exit().code, 0);
}

#[tokio::test]
async fn exec_timeout_kills_the_process_group() {
    let silkd = Silkd::start();
    let mut c = silkd.connect().await;
    let mut req = exec_req(&["sh", "-c", "sleep 30 & echo $!; wait"]);
    if let Frame::Exec(e) = &mut req {
        e.timeout_ms = Some(200);
    }
    let r = c.call(req).await;
    let exit = r.exit();
    assert!(exit.timed_out);
    assert_eq!(exit.signal, Some(9));
    let grandchild: u32 = r.stdout().trim().parse().unwrap();
    eventually("background sleep killed with its group", || !pid_alive(grandchild)).await;
}

#[tokio::test]
async fn cancel_kills_the_foreground_process() {
    let silkd = Silkd::start();
    let mut c = silkd.connect().await;
    c.send(exec_req(&["sleep", "30"])).await;
    let Some(Frame::Started { pid }) = c.conn.recv().await.unwrap() else { panic!() };
    c.send(Frame::Cancel).await;
    let r = c.reply().await;
    assert_eq!(r.exit().signal, Some(9));
    assert!(!pid_alive(pid));
    assert_eq!(c.exec(&["true"]).await.exit().code, 0, "connection still usable");
}

#[tokio::test]
async fn client_disconnect_kills_a_silent_child() {
    let silkd = Silkd::start();
    let mut c = silkd.connect().await;
    c.send(exec_req(&["sleep", "30"])).await;
    let Some(Frame::Started { pid }) = c.conn.recv().await.unwrap() else { panic!() };
    assert!(pid_alive(pid));
    drop(c);
    eventually("silent child killed after disconnect", || !pid_alive(pid)).await;
}

#[tokio::test]
async fn exec_errors_are_typed_and_the_connection_survives() {
    let silkd = Silkd::start();
    let mut c = silkd.connect().await;
    assert_eq!(c.exec(&[]).await.error_kind(), Some(ErrorKind::BadRequest));
    assert_eq!(c.exec(&["/no/such/binary"]).await.error_kind(), Some(ErrorKind::NotFound));
    let mut req = exec_req(&["true"]);
    if let Frame::Exec(e) = &mut req {
        e.command.cwd = Some("/no/such/dir".into());
    }
    assert_eq!(c.call(req).await.error_kind(), Some(ErrorKind::NotFound));
    let mut req = exec_req(&["true"]);
    if let Frame::Exec(e) = &mut req {
        e.command.user = Some("no-such-user".into());
    }
    assert_eq!(c.call(req).await.error_kind(), Some(ErrorKind::BadRequest), "an unknown user");
    assert_eq!(c.exec(&["true"]).await.exit().code, 0);
}

#[tokio::test]
async fn hundred_mib_through_stdout_arrives_intact() {
    let silkd = Silkd::start();
    let file = silkd.path("big");
    let data: Vec<u8> =
        (0..100u32 << 20).map(|i| (i.wrapping_mul(2654435761) >> 13) as u8).collect();
    std::fs::write(&file, &data).unwrap();
    let mut c = silkd.connect().await;
    c.send(exec_req(&["cat", file.to_str().unwrap()])).await;
    let mut hasher = blake3::Hasher::new();
    let mut n = 0;
    let end = loop {
        match c.conn.recv().await.unwrap().unwrap() {
            Frame::Stdout(b) => {
                n += b.len();
                hasher.update(&b);
            }
            Frame::Started { .. } => {}
            other => break other,
        }
    };
    assert_eq!(n, data.len());
    assert_eq!(hasher.finalize(), blake3::hash(&data));
    assert!(matches!(end, Frame::Exit(ExitStatus { code: 0, .. })));
}

#[tokio::test]
async fn spawn_ps_logs_attach_and_kill() {
    let silkd = Silkd::start();
    let mut c = silkd.connect().await;
    let spawn = |script: &str| {
        Frame::Spawn(Command {
            argv: vec!["sh".into(), "-c".into(), script.into()],
            ..Default::default()
        })
    };

    // A process that finished: logs replay its output; ps shows its exit.
    let r = c.call(spawn("echo one; echo two >&2; exit 4")).await;
    let Frame::Spawned { pid: done_pid } = r.frames[0] else { panic!("{r:?}") };
    r.done();
    let r = c.call(Frame::Attach { pid: done_pid }).await;
    assert_eq!((r.stdout().as_str(), r.stderr().as_str()), ("one\n", "two\n"));
    assert_eq!(r.exit().code, 4);
    let r = c.call(Frame::Logs { pid: done_pid }).await;
    assert_eq!(r.stdout(), "one\n");
    r.done();

    // A live one: attach sees every line exactly once, in order, across replay and follow.
    let r = c.call(spawn("for i in $(seq 1 50); do echo line$i; sleep 0.01; done")).await;
    let Frame::Spawned { pid } = r.frames[0] else { panic!() };
    let mut other = silkd.connect().await;
    let r = other.call(Frame::Attach { pid }).await;
    let want: String = (1..=50).map(|i| format!("line{i}\n")).collect();
    assert_eq!(r.stdout(), want);
    assert_eq!(r.exit().code, 0);

    // Kill a live detached process; ps reflects it.
    let r = c.call(spawn("sleep 30")).await;
    let Frame::Spawned { pid: sleeper } = r.frames[0] else { panic!() };
    let r = c.call(Frame::Ps).await;
    let Frame::Procs(procs) = &r.frames[0] else { panic!() };
    assert!(procs.iter().any(|p| p.pid == sleeper && p.exit.is_none() && p.detached));
    assert!(procs.iter().any(|p| p.pid == done_pid && p.exit.map(|e| e.code) == Some(4)));
    c.call(Frame::Kill { pid: sleeper, signal: 15 }).await.done();
    let r = c.call(Frame::Attach { pid: sleeper }).await;
    assert_eq!(r.exit().signal, Some(15));

    // The reaped pid is never signalled again.
    let r = c.call(Frame::Kill { pid: sleeper, signal: 9 }).await;
    assert_eq!(r.error_kind(), Some(ErrorKind::NotFound));
    let r = c.call(Frame::Kill { pid: 1, signal: 9 }).await;
    assert_eq!(r.error_kind(), Some(ErrorKind::NotFound), "not our child");
    let r = c.call(Frame::Kill { pid: done_pid, signal: 0 }).await;
    assert_eq!(r.error_kind(), Some(ErrorKind::BadRequest));
    assert_eq!(c.call(Frame::Logs { pid: 999_999 }).await.error_kind(), Some(ErrorKind::NotFound));
}

#[tokio::test]
async fn ring_overflow_is_reported_as_dropped_bytes() {
    let silkd = Silkd::start_with(&["--ring-bytes", "65536"]);
    let mut c = silkd.connect().await;
    let r = c
        .call(Frame::Spawn(Command {
            argv: vec!["sh".into(), "-c".into(), "head -c 1000000 /dev/zero".into()],
            ..Default::default()
        }))
        .await;
    let Frame::Spawned { pid } = r.frames[0] else { panic!() };
    // Let it finish unobserved, so the ring overflows before anyone reads it.
    for _ in 0..500 {
        let r = c.call(Frame::Ps).await;
        let Frame::Procs(procs) = &r.frames[0] else { panic!() };
        if procs.iter().any(|p| p.pid == pid && p.exit.is_some()) {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    let r = c.call(Frame::Attach { pid }).await;
    let Frame::Dropped { bytes } = r.frames[0] else {
        panic!("first frame is {}", r.frames[0].name())
    };
    let kept = r.stream(|f| if let Frame::Stdout(b) = f { Some(b) } else { None }).len() as u64;
    assert_eq!(bytes + kept, 1_000_000, "every byte is either delivered or counted as dropped");
    assert!(kept <= 65536 + 65536);
}
