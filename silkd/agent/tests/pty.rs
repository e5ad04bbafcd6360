//! Terminals against a real silkd: echo, resize (by pid and in-band), exit codes, ps and kill.

mod common;

use bytes::Bytes;
use common::*;
use silk_proto::*;

fn pty(argv: &[&str], cols: u16, rows: u16) -> Frame {
    Frame::PtyOpen(PtyRequest {
        command: Command {
            argv: argv.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        },
        cols,
        rows,
    })
}

fn input(text: &str) -> Frame {
    Frame::Stdin(Bytes::copy_from_slice(text.as_bytes()))
}

async fn started(c: &mut Client) -> u32 {
    match c.recv().await {
        Frame::Started { pid } => pid,
        other => panic!("expected Started, got {}", other.name()),
    }
}

#[tokio::test]
async fn echo_resize_and_exit() {
    let silkd = Silkd::start();
    let mut c = silkd.connect().await;
    c.send(pty(&[], 80, 24)).await;
    let pid = started(&mut c).await;

    // The quotes make the output differ from the echoed input line.
    c.send(input("echo hel''lo; stty size\n")).await;
    let out = c.stdout_until("24 80").await;
    assert!(out.contains("hello\r\n"), "{out:?}");

    // Resize by pid from another connection; the program sees it.
    let mut other = silkd.connect().await;
    other.call(Frame::PtyResize { pid, cols: 100, rows: 30 }).await.done();
    c.send(input("stty size\n")).await;
    c.stdout_until("30 100").await;
    // And in-band, inside the call.
    c.send(Frame::PtyResize { pid, cols: 120, rows: 40 }).await;
    c.send(input("stty size\n")).await;
    c.stdout_until("40 120").await;

    // It is an ordinary child of silkd.
    let r = other.call(Frame::Ps).await;
    assert!(matches!(&r.frames[0], Frame::Procs(p) if p.iter().any(|p| p.pid == pid)));

    c.send(input("tty; exit 3\n")).await;
    let r = c.reply().await;
    assert!(r.stdout().contains("/dev/pts/"), "a real terminal");
    assert_eq!(r.exit().code, 3);

    // The pty is gone with its process.
    let r = other.call(Frame::PtyResize { pid, cols: 10, rows: 10 }).await;
    assert_eq!(r.error_kind(), Some(ErrorKind::NotFound));
    assert_eq!(c.exec(&["true"]).await.exit().code, 0, "connection still usable");
}

#[tokio::test]
async fn pty_input_is_echoed_back() {
    let silkd = Silkd::start();
    let mut c = silkd.connect().await;
    c.send(pty(&["cat"], 80, 24)).await;
    started(&mut c).await;
    c.send(input("ping\n")).await;
    // The terminal echoes the line, then cat prints it: two copies.
    let out = c.stdout_until("ping\r\nping\r\n").await;
    assert!(out.starts_with("ping"));
    c.send(input("\u{4}")).await; // ^D: end of input for cat
    assert_eq!(c.reply().await.exit().code, 0);
}

#[tokio::test]
async fn pty_process_can_be_killed_and_cancelled() {
    let silkd = Silkd::start();
    let mut c = silkd.connect().await;
    c.send(pty(&["sleep", "30"], 80, 24)).await;
    let pid = started(&mut c).await;
    let mut other = silkd.connect().await;
    other.call(Frame::Kill { pid, signal: 9 }).await.done();
    assert_eq!(c.reply().await.exit().signal, Some(9));

    c.send(pty(&["sleep", "30"], 80, 24)).await;
    let pid = started(&mut c).await;
    c.send(Frame::Cancel).await;
    assert_eq!(c.reply().await.exit().signal, Some(9));
    assert!(!pid_alive(pid));
}

#[tokio::test]
async fn bad_pty_requests_get_typed_errors() {
    let silkd = Silkd::start();
    let mut c = silkd.connect().await;
    assert_eq!(c.call(pty(&[], 0, 24)).await.error_kind(), Some(ErrorKind::BadRequest));
    assert_eq!(
        c.call(pty(&["/no/such/program"], 80, 24)).await.error_kind(),
        Some(ErrorKind::NotFound)
    );
    let r = c.call(Frame::PtyResize { pid: 999_999, cols: 80, rows: 24 }).await;
    assert_eq!(r.error_kind(), Some(ErrorKind::NotFound));
    c.call(Frame::Info).await.done();
}
