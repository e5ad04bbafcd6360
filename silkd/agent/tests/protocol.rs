//! Connection-level behaviour against a real silkd: handshake, bad frames, concurrency,
//! listeners, shutdown, and PID 1 duty.

mod common;

use bytes::{BufMut, Bytes, BytesMut};
use common::*;
use silk_proto::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[tokio::test]
async fn hello_and_info() {
    let silkd = Silkd::start();
    let mut c = silkd.connect().await;
    let r = c.call(Frame::Hello(Hello { protocol: PROTOCOL_VERSION, client: "test".into() })).await;
    r.done();
    let Frame::Welcome(w) = &r.frames[0] else { panic!("expected Welcome") };
    assert_eq!(w.protocol, PROTOCOL_VERSION);
    for verb in ["exec", "sessions", "pty", "search", "watch", "git", "port_forward"] {
        assert!(w.capabilities.contains(&verb.to_string()), "{verb}");
    }

    let r = c.call(Frame::Hello(Hello { protocol: 99, client: "future".into() })).await;
    assert_eq!(r.error_kind(), Some(ErrorKind::Unsupported));

    let r = c.call(Frame::Info).await;
    r.done();
    let Frame::InfoReply(info) = &r.frames[0] else { panic!("expected InfoReply") };
    assert_eq!(info.protocol, PROTOCOL_VERSION);
    assert_eq!(info.processes, 0);
    assert_eq!(info.connections, 1);
}

#[tokio::test]
async fn malformed_frames_get_bad_request_and_the_connection_stays_usable() {
    let silkd = Silkd::start();
    let mut c = silkd.connect().await;
    // An unknown verb (tag past the last variant), then a body that is not postcard at all.
    for body in [&[0x7fu8][..], &[10, 1, 2, 3], &[11, 0xff, 0xff, 0xff]] {
        let mut raw = BytesMut::new();
        raw.put_u32_le(body.len() as u32);
        raw.put_slice(body);
        c.conn.get_mut().write_all(&raw).await.unwrap();
        let r = c.reply().await;
        assert_eq!(r.error_kind(), Some(ErrorKind::BadRequest));
    }
    // A reply sent as a request.
    assert_eq!(c.call(Frame::Done).await.error_kind(), Some(ErrorKind::BadRequest));
    assert_eq!(c.call(Frame::Procs(vec![])).await.error_kind(), Some(ErrorKind::BadRequest));
    assert_eq!(c.call(Frame::Ready).await.error_kind(), Some(ErrorKind::BadRequest));
    assert_eq!(c.call(Frame::Events(vec![])).await.error_kind(), Some(ErrorKind::BadRequest));
    // Stray stream frames between calls are ignored, not answered.
    c.send(Frame::Stdin(Bytes::from_static(b"late"))).await;
    c.send(Frame::Eof).await;
    c.call(Frame::Info).await.done();
}

#[tokio::test]
async fn an_oversize_frame_is_answered_then_the_connection_closes() {
    let silkd = Silkd::start();
    let mut c = silkd.connect().await;
    c.conn.get_mut().write_all(&((MAX_FRAME as u32) + 1).to_le_bytes()).await.unwrap();
    let r = c.reply().await;
    assert_eq!(r.error_kind(), Some(ErrorKind::BadRequest));
    let mut rest = vec![];
    c.conn.get_mut().read_to_end(&mut rest).await.unwrap();
    assert!(rest.is_empty(), "closed after the error");
    // The agent itself is fine.
    silkd.connect().await.call(Frame::Info).await.done();
}

#[tokio::test]
async fn sixty_four_concurrent_connections_mixing_verbs() {
    let silkd = Silkd::start();
    let mut tasks = vec![];
    for i in 0..64 {
        let mut c = silkd.connect().await;
        let file = silkd.path(&format!("f{i}"));
        tasks.push(tokio::spawn(async move {
            for round in 0..5 {
                let text = format!("conn {i} round {round}");
                let r = c.sh(&format!("echo '{text}'")).await;
                assert_eq!(r.stdout().trim(), text);
                c.write(&file, text.as_bytes()).await.done();
                assert_eq!(c.read(&file).await.data(), text.as_bytes());
                c.call(Frame::Stat { path: path_str(&file) }).await.done();
                c.call(Frame::Info).await.done();
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
}

#[tokio::test]
async fn tcp_listener_serves_the_same_protocol() {
    let dir = tempfile::tempdir().unwrap();
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_silkd"))
        .args(["--tcp", "127.0.0.1:0"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(child.stdout.take().unwrap()),
        &mut line,
    )
    .unwrap();
    let addr = line.trim().rsplit("tcp:").next().unwrap().to_string();
    let stream = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let mut conn = Connection::new(stream);
    conn.send(&exec_req(&["echo", "over tcp"])).await.unwrap();
    let mut out = vec![];
    loop {
        match conn.recv().await.unwrap().unwrap() {
            Frame::Stdout(b) => out.extend_from_slice(&b),
            Frame::Exit(e) => {
                assert_eq!(e.code, 0);
                break;
            }
            _ => {}
        }
    }
    assert_eq!(out, b"over tcp\n");
    child.kill().unwrap();
    child.wait().unwrap();
    drop(dir);
}

#[tokio::test]
async fn sigterm_stops_children_and_exits_cleanly() {
    let mut silkd = Silkd::start();
    let mut c = silkd.connect().await;
    let r = c
        .call(Frame::Spawn(Command {
            argv: vec!["sleep".into(), "30".into()],
            ..Default::default()
        }))
        .await;
    let Frame::Spawned { pid } = r.frames[0] else { panic!() };
    // SAFETY: signalling our own child process.
    unsafe { libc::kill(silkd.child.id() as i32, libc::SIGTERM) };
    let status = silkd.child.wait().unwrap();
    assert!(status.success(), "{status:?}");
    assert!(!pid_alive(pid), "children are stopped with the agent");
    assert!(!silkd.socket.exists(), "socket file removed");
}

/// silkd as PID 1 of a fresh pid namespace must reap orphans it never started: a shell
/// double-forks a sleeper and exits; when the sleeper ends it is re-parented to silkd, which must
/// collect it so no zombie is left.
#[tokio::test]
async fn pid1_reaps_double_forked_orphans() {
    if unsafe { libc::geteuid() } != 0 {
        panic!("this test needs root (pid namespaces); run the suite through scripts/test");
    }
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("pid1.sock");
    let mut cmd = std::process::Command::new("unshare");
    cmd.args(["--pid", "--fork", "--mount-proc", "--kill-child"])
        .arg(env!("CARGO_BIN_EXE_silkd"))
        .arg("--unix")
        .arg(&socket);
    let silkd = Silkd::launch(cmd, socket, dir);
    let mut c = silkd.connect().await;
    let r = c.sh("echo $PPID; cat /proc/1/comm").await;
    assert_eq!(r.stdout().lines().nth(1), Some("silkd"), "silkd is PID 1");

    let r = c.sh("sh -c 'sleep 0.2 & echo $!' ").await;
    let orphan: u32 = r.stdout().trim().parse().unwrap();
    let stat = format!("/proc/{orphan}/stat");
    let script = format!(
        "for i in $(seq 1 300); do [ -e {stat} ] || exit 0; sleep 0.01; done; cat {stat}; exit 1"
    );
    let r = c.sh(&script).await;
    assert_eq!(r.exit().code, 0, "orphan {orphan} not reaped: {}", r.stdout());

    // And no zombie anywhere in the namespace.
    let r = c.sh("cat /proc/[0-9]*/stat 2>/dev/null | awk '{print $3}' | grep -c Z || true").await;
    assert_eq!(r.stdout().trim(), "0");
}
