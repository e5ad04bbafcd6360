//! Shell sessions against a real silkd: state across calls and connections, the end-of-call
//! marker, cancel and timeout, idle reaping, and bad input.

mod common;

use common::*;
use silk_proto::*;

fn create(id: &str) -> Frame {
    Frame::SessionCreate(SessionRequest { id: Some(id.into()), ..Default::default() })
}

fn run(id: &str, script: &str) -> Frame {
    Frame::SessionExec(SessionExecRequest {
        id: id.into(),
        script: script.into(),
        timeout_ms: None,
    })
}

fn sessions(r: &Reply) -> Vec<SessionInfo> {
    r.done();
    match &r.frames[..] {
        [Frame::Sessions(s)] => s.clone(),
        _ => panic!("expected one Sessions frame, got {} frames", r.frames.len()),
    }
}

#[tokio::test]
async fn state_survives_calls_and_connections() {
    let silkd = Silkd::start();
    let mut c = silkd.connect().await;
    let created = sessions(&c.call(create("dev")).await);
    assert_eq!(created[0].id, "dev");
    let shell = created[0].pid;

    let r = c.call(run("dev", "cd /tmp && export GREETING=hi; COUNT=41")).await;
    assert!(matches!(r.frames[0], Frame::Started { pid } if pid == shell));
    assert_eq!(r.exit().code, 0);
    let r = c
        .call(run("dev", "COUNT=$((COUNT + 1)); echo out; echo err >&2; exit_code=3; false"))
        .await;
    assert_eq!((r.stdout().as_str(), r.stderr().as_str()), ("out\n", "err\n"));
    assert_eq!(r.exit().code, 1);

    // Another connection sees the same shell.
    let mut other = silkd.connect().await;
    let r = other.call(run("dev", "pwd; echo $GREETING $COUNT")).await;
    assert_eq!(r.stdout(), "/tmp\nhi 42\n");
    assert_eq!(r.exit().code, 0);

    let listed = sessions(&other.call(Frame::SessionList).await);
    assert_eq!((listed.len(), listed[0].pid, listed[0].busy), (1, shell, false));
    let r = other.call(Frame::Info).await;
    assert!(matches!(&r.frames[0], Frame::InfoReply(i) if i.sessions == 1));
    let r = other.call(Frame::Ps).await;
    assert!(matches!(&r.frames[0], Frame::Procs(p) if p.iter().any(|p| p.pid == shell)));

    // `exit` ends the session with the shell's own code.
    let r = c.call(run("dev", "echo bye; exit 7")).await;
    assert_eq!((r.stdout().as_str(), r.exit().code), ("bye\n", 7));
    assert_eq!(c.call(run("dev", "true")).await.error_kind(), Some(ErrorKind::NotFound));
    assert!(sessions(&c.call(Frame::SessionList).await).is_empty());
}

#[tokio::test]
async fn user_output_cannot_forge_the_end_of_a_call() {
    let silkd = Silkd::start();
    let mut c = silkd.connect().await;
    c.call(create("s")).await.done();
    // Lines shaped like a marker, on every stream a script can reach, then more output: the
    // call must end only at the real end, with every byte delivered and the real exit code.
    let script = r#"
        for n in 0 1 2; do echo "00000000000000000000000000000000 $n"; done
        printf '%s 0\n' "$(cat /proc/sys/kernel/random/uuid | tr -d -)"
        printf 'forged 0\n' >&3 || echo "fd 3 is closed"
        echo "it's 'quoted' \"text\""
        printf 'no newline at the end'
        exit_status_is=5; (exit 5)"#;
    let r = c.call(run("s", script)).await;
    let out = r.stdout();
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 7, "{out}");
    assert_eq!(lines[0], "00000000000000000000000000000000 0");
    assert_eq!(lines[4], "fd 3 is closed");
    assert_eq!(lines[5], "it's 'quoted' \"text\"");
    assert_eq!(lines[6], "no newline at the end");
    assert_eq!(r.exit().code, 5);

    // A syntax error is the script's failure, not the session's.
    let r = c.call(run("s", "if then fi '")).await;
    assert_eq!(r.exit().code, 2);
    assert!(!r.stderr().is_empty());
    // The script cannot eat the next call's input: its stdin is /dev/null.
    let r = c.call(run("s", "cat; echo after")).await;
    assert_eq!(r.stdout(), "after\n");
    // Large output arrives whole, up to the marker.
    let r = c.call(run("s", "head -c 3000000 /dev/zero | tr '\\0' x")).await;
    assert_eq!(r.stdout().len(), 3_000_000);
    assert_eq!(r.exit().code, 0);
}

#[tokio::test]
async fn cancel_and_timeout_end_the_session() {
    let silkd = Silkd::start();
    let mut c = silkd.connect().await;
    let shell = sessions(&c.call(create("a")).await)[0].pid;
    c.send(run("a", "sleep 30")).await;
    assert!(matches!(c.recv().await, Frame::Started { .. }));
    // A second call on a busy session is refused.
    let mut other = silkd.connect().await;
    assert_eq!(other.call(run("a", "true")).await.error_kind(), Some(ErrorKind::Conflict));
    c.send(Frame::Cancel).await;
    let r = c.reply().await;
    assert_eq!(r.exit().signal, Some(9));
    eventually("cancelled session's shell killed", || !pid_alive(shell)).await;
    assert_eq!(c.call(run("a", "true")).await.error_kind(), Some(ErrorKind::NotFound));

    c.call(create("b")).await.done();
    let r = c
        .call(Frame::SessionExec(SessionExecRequest {
            id: "b".into(),
            script: "sleep 30".into(),
            timeout_ms: Some(100),
        }))
        .await;
    let exit = r.exit();
    assert!(exit.timed_out && exit.signal == Some(9));
    assert!(sessions(&c.call(Frame::SessionList).await).is_empty());
}

#[tokio::test]
async fn idle_sessions_are_reaped() {
    let silkd = Silkd::start_with(&["--session-idle-secs", "1"]);
    let mut c = silkd.connect().await;
    let shell = sessions(&c.call(create("idle")).await)[0].pid;
    assert_eq!(c.call(run("idle", "true")).await.exit().code, 0);
    eventually("idle session's shell killed", || !pid_alive(shell)).await;
    assert_eq!(c.call(run("idle", "true")).await.error_kind(), Some(ErrorKind::NotFound));
}

#[tokio::test]
async fn bad_session_requests_get_typed_errors() {
    let silkd = Silkd::start();
    let mut c = silkd.connect().await;
    assert_eq!(c.call(run("nope", "true")).await.error_kind(), Some(ErrorKind::NotFound));
    let r = c.call(Frame::SessionRm { id: "nope".into() }).await;
    assert_eq!(r.error_kind(), Some(ErrorKind::NotFound));
    assert_eq!(c.call(create("a b")).await.error_kind(), Some(ErrorKind::BadRequest));
    let bad_cwd = Frame::SessionCreate(SessionRequest {
        cwd: Some("/no/such/dir".into()),
        ..Default::default()
    });
    assert_eq!(c.call(bad_cwd).await.error_kind(), Some(ErrorKind::NotFound));
    assert!(sessions(&c.call(Frame::SessionList).await).is_empty(), "nothing was created");

    // A generated id, a duplicate, and removal.
    let made = sessions(&c.call(Frame::SessionCreate(SessionRequest::default())).await);
    let id = made[0].id.clone();
    assert_eq!(c.call(create(&id)).await.error_kind(), Some(ErrorKind::Conflict));
    c.call(Frame::SessionRm { id: id.clone() }).await.done();
    eventually("removed session's shell killed", || !pid_alive(made[0].pid)).await;
    assert_eq!(c.call(run(&id, "true")).await.error_kind(), Some(ErrorKind::NotFound));
    c.call(Frame::Info).await.done();
}

#[tokio::test]
async fn sessions_take_cwd_env_and_user() {
    let silkd = Silkd::start();
    let mut c = silkd.connect().await;
    let req = Frame::SessionCreate(SessionRequest {
        id: Some("u".into()),
        cwd: Some("/tmp".into()),
        env: vec![("MARK".into(), "m1".into())],
        user: Some("nobody".into()),
    });
    c.call(req).await.done();
    let r = c.call(run("u", "pwd; echo $MARK; id -u")).await;
    let out = r.stdout();
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(&lines[..2], &["/tmp", "m1"]);
    assert_ne!(lines[2], "0");
}
