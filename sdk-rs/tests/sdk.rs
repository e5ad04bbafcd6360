//! The SDK end to end: a real sandboxd (jail engine) and every verb family through the relay.

mod common;

use std::future::poll_fn;
use std::pin::Pin;
use std::time::Duration;

use common::*;
use futures_core::Stream;
use silkmesh::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn agent_kind<T: std::fmt::Debug>(r: Result<T>) -> ErrorKind {
    match r {
        Err(Error::Agent { kind, .. }) => kind,
        other => panic!("expected an agent error, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lifecycle_listing_and_typed_errors() {
    let node = Sandboxd::start(ONE_WARM);
    let c = node.client();
    let info = c.info().await.unwrap();
    assert_eq!((info.engine.as_str(), info.pools[0].template.as_str()), ("jail", "host"));
    let pools = c.pools().await.unwrap();
    assert_eq!((pools[0].template.as_str(), pools[0].warm), ("host", 1));

    let s = c
        .claim("host")
        .size(Size::Small)
        .ttl(Duration::from_secs(120))
        .metadata("team", "sdk")
        .send()
        .await
        .unwrap();
    assert!(s.token().starts_with("sbt_"), "{}", s.token());
    assert!(Tier::ALL.contains(&s.tier()));
    assert_eq!(s.info().metadata["team"], "sdk");
    let other = c.claim("host").metadata("team", "other").send().await.unwrap();
    assert_eq!(c.list().await.unwrap().len(), 2);
    let mine = c.list_by(&[("team", "sdk")]).await.unwrap();
    assert_eq!(mine.iter().map(|r| r.id.as_str()).collect::<Vec<_>>(), [s.id()]);

    let before = s.refresh().await.unwrap().deadline_ms;
    let after = s.renew(Duration::from_secs(3600)).await.unwrap();
    assert!(after > before + 3_000_000, "{before} -> {after}");

    // Opened by id: with the sandbox's own token, or with the root token.
    let by_token = c.sandbox(s.id(), Some(s.token())).await.unwrap();
    assert_eq!(by_token.run(["hostname"]).await.unwrap().stdout_str(), format!("{}\n", s.id()));
    let by_root = c.sandbox(s.id(), None).await.unwrap();
    assert_eq!(by_root.info().id, s.id());
    let hello = by_root.hello().await.unwrap();
    assert!(hello.protocol >= 1 && hello.capabilities.iter().any(|c| c == "exec"), "{hello:?}");

    // API errors: typed from the node's error body.
    match c.sandbox("sb-doesnotexist", None).await {
        Err(Error::Api { status: 404, code, .. }) => assert_eq!(code, "not_found"),
        other => panic!("{other:?}"),
    }
    match c.sandbox(s.id(), Some(other.token())).await {
        Err(Error::Api { status: 404, code, .. }) => assert_eq!(code, "not_found", "no hint"),
        other => panic!("{other:?}"),
    }
    let anonymous = Client::new(&node.url()).unwrap();
    match anonymous.info().await {
        Err(e @ Error::Api { status: 401, .. }) => assert!(!e.is_retryable()),
        other => panic!("{other:?}"),
    }
    assert!(matches!(c.claim("no-such-template").send().await,
        Err(Error::Api { status: 404, ref code, .. }) if code == "template_not_found"));

    // Agent errors: typed from silkd's error kinds.
    assert_eq!(agent_kind(s.stat("/no/such/path").await), ErrorKind::NotFound);
    assert_eq!(agent_kind(s.read("/").await), ErrorKind::BadRequest);
    assert_eq!(agent_kind(s.mkdir("/etc", false).await), ErrorKind::Conflict);
    assert_eq!(agent_kind(s.run(["/no/such/program"]).await), ErrorKind::NotFound);
    assert_eq!(agent_kind(s.session_exec("no-session", "true").await), ErrorKind::NotFound);
    assert_eq!(agent_kind(s.kill(999_999, 9).await), ErrorKind::NotFound);
    assert_eq!(agent_kind(s.exec(Vec::<String>::new()).run().await), ErrorKind::BadRequest);
    // Every one of those left its pooled connection usable.
    assert_eq!(s.connection_stats().dialled, 1, "{:?}", s.connection_stats());

    // A non-zero exit is an error only where success was asked for.
    let script = ["sh", "-c", "echo out; echo err >&2; exit 4"];
    assert_eq!(s.run(script).await.unwrap().code(), 4);
    match s.run_checked(script).await {
        Err(Error::NonZeroExit { code: 4, signal: None, stdout, stderr }) => {
            assert_eq!((&stdout[..], &stderr[..]), (&b"out\n"[..], &b"err\n"[..]));
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(s.run_checked(["true"]).await.unwrap().code(), 0);

    // Release; and auto-release of a dropped handle, only when asked.
    s.release().await.unwrap();
    assert!(matches!(c.sandbox(s.id(), None).await, Err(Error::Api { status: 404, .. })));
    let kept = c.claim("host").send().await.unwrap();
    let kept_id = kept.id().to_string();
    drop(kept);
    let other_id = other.id().to_string();
    other.set_auto_release(true);
    drop(other);
    eventually("the auto-released sandbox is gone", || async {
        c.list().await.unwrap().iter().all(|r| r.id != other_id)
    })
    .await;
    let left = c.list().await.unwrap();
    assert_eq!(left.iter().map(|r| r.id.as_str()).collect::<Vec<_>>(), [kept_id.as_str()]);
    c.sandbox(&kept_id, None).await.unwrap().release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn processes_and_sessions() {
    let node = Sandboxd::start(ONE_WARM);
    let s = node.client().claim("host").send().await.unwrap();

    // Streaming exec: chunks on both streams, then the status.
    let mut e = s.exec(["sh", "-c", "echo one; echo two >&2; exit 7"]).start().await.unwrap();
    assert!(e.pid() > 1);
    let (mut out, mut err) = (vec![], vec![]);
    while let Some(chunk) = e.next().await.unwrap() {
        match chunk {
            Chunk::Stdout(b) => out.extend_from_slice(&b),
            Chunk::Stderr(b) => err.extend_from_slice(&b),
        }
    }
    assert_eq!((&out[..], &err[..], e.status().unwrap().code), (&b"one\n"[..], &b"two\n"[..], 7));

    // Interactive stdin: each line comes back before the next is sent.
    let mut cat = s.exec(["cat"]).stdin_stream().start().await.unwrap();
    for line in ["ping\n", "pong\n"] {
        cat.write_stdin(line).await.unwrap();
        let mut got = vec![];
        while got != line.as_bytes() {
            match cat.next().await.unwrap() {
                Some(Chunk::Stdout(b)) => got.extend_from_slice(&b),
                other => panic!("{other:?}"),
            }
        }
    }
    let writer = cat.stdin().unwrap();
    tokio::spawn(async move { writer.close().await.unwrap() }).await.unwrap();
    assert_eq!(cat.wait().await.unwrap().code, 0);

    // Fed stdin, env, cwd, user.
    let out = s
        .exec(["sh", "-c", "cat; echo $GREETING; pwd; id -u"])
        .stdin("fed\n")
        .env("GREETING", "hello")
        .cwd("/tmp")
        .user("65534")
        .run()
        .await
        .unwrap();
    assert_eq!(out.stdout_str(), "fed\nhello\n/tmp\n65534\n");

    // Large fed stdin flows while the output is read (cat would stall on full pipes otherwise).
    let input: Vec<u8> = (0..5_000_000u32).map(|i| (i % 241) as u8).collect();
    let out = s.exec(["cat"]).stdin(input.clone()).run().await.unwrap();
    assert!(out.success() && out.stdout == input);

    // Cancel and timeout kill the process group.
    let e = s.exec(["sleep", "600"]).start().await.unwrap();
    e.cancel().await.unwrap();
    assert_eq!(e.wait().await.unwrap().signal, Some(9));
    let out = s.exec(["sleep", "600"]).timeout(Duration::from_millis(100)).run().await.unwrap();
    assert!(out.status.timed_out);

    // Detached: spawn, ps, logs, attach (replay, then live), kill.
    let pid = s.spawn(["sh", "-c", "echo started; exec sleep 600"]).await.unwrap();
    let procs = s.ps().await.unwrap();
    let p = procs.iter().find(|p| p.pid == pid).expect("spawned process listed");
    assert!(p.detached && p.exit.is_none());
    eventually("the spawned process printed", || async {
        s.logs(pid).await.unwrap().stdout() == b"started\n"
    })
    .await;
    let mut attach = s.attach(pid).await.unwrap();
    assert_eq!(attach.next().await.unwrap(), Some(Chunk::Stdout("started\n".into())));
    s.kill(pid, libc::SIGTERM).await.unwrap();
    assert_eq!(attach.next().await.unwrap(), None);
    let status = attach.status().expect("attach saw the exit");
    assert_eq!((status.code, status.signal), (128 + libc::SIGTERM, Some(libc::SIGTERM)));
    assert_eq!(attach.dropped(), 0);
    let procs = s.ps().await.unwrap();
    assert!(procs.iter().find(|p| p.pid == pid).unwrap().exit.is_some());
    assert_eq!(agent_kind(s.kill(pid, 9).await), ErrorKind::NotFound, "never a reaped pid");

    // Attach can stop following early; the process keeps running.
    let pid = s.spawn(["sh", "-c", "echo a; exec sleep 600"]).await.unwrap();
    let mut attach = s.attach(pid).await.unwrap();
    assert_eq!(attach.next().await.unwrap(), Some(Chunk::Stdout("a\n".into())));
    attach.cancel().await.unwrap();
    assert_eq!(attach.next().await.unwrap(), None);
    assert!(attach.status().is_none());
    assert!(s.ps().await.unwrap().iter().find(|p| p.pid == pid).unwrap().exit.is_none());
    s.kill(pid, 9).await.unwrap();

    // Sessions keep cwd and environment across calls.
    let session = s
        .session_create(SessionRequest { id: Some("work".into()), ..Default::default() })
        .await
        .unwrap();
    assert_eq!(session.id, "work");
    s.session_exec("work", "cd /tmp && export X=42").await.unwrap();
    let out = s.session_exec("work", "pwd; echo $X").await.unwrap();
    assert_eq!(out.stdout_str(), "/tmp\n42\n");
    let mut streamed = s.session_exec_stream("work", "echo streamed; false", None).await.unwrap();
    assert_eq!(streamed.next().await.unwrap(), Some(Chunk::Stdout("streamed\n".into())));
    assert_eq!(streamed.wait().await.unwrap().code, 1);
    let ids: Vec<String> = s.session_list().await.unwrap().into_iter().map(|s| s.id).collect();
    assert_eq!(ids, ["work"]);
    s.session_rm("work").await.unwrap();
    assert!(s.session_list().await.unwrap().is_empty());
    s.release().await.unwrap();
}

/// The next item through the `Stream` impl itself (what `StreamExt::next` does).
async fn poll_next<S: Stream + Unpin>(s: &mut S) -> Option<S::Item> {
    poll_fn(|cx| Pin::new(&mut *s).poll_next(cx)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn files_trees_search_watch_and_git() {
    let node = Sandboxd::start(ONE_WARM);
    let s = node.client().claim("host").send().await.unwrap();

    // Files.
    s.write("/tmp/a.txt", "alpha\n").await.unwrap();
    assert_eq!(&s.read("/tmp/a.txt").await.unwrap()[..], b"alpha\n");
    assert_eq!(&s.read_range("/tmp/a.txt", 1, Some(3)).await.unwrap()[..], b"lph");
    let opts = WriteOptions { mode: Some(0o600), parents: true };
    s.write_with("/tmp/x/y/z.txt", "zz", opts).await.unwrap();
    let st = s.stat("/tmp/x/y/z.txt").await.unwrap();
    assert_eq!((st.kind, st.size, st.mode), (FileKind::File, 2, 0o600));
    let big: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
    let sent = s.write_from("/tmp/big.bin", &big[..], WriteOptions::default()).await.unwrap();
    assert_eq!(sent, big.len() as u64);
    let mut back = vec![];
    assert_eq!(s.read_into("/tmp/big.bin", &mut back).await.unwrap(), big.len() as u64);
    assert!(back == big);
    s.mkdir("/tmp/m/n", true).await.unwrap();
    s.rename("/tmp/a.txt", "/tmp/m/a.txt").await.unwrap();
    let mut names: Vec<(String, FileKind)> =
        s.list("/tmp/m").await.unwrap().into_iter().map(|e| (e.name, e.stat.kind)).collect();
    names.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(names, [("a.txt".into(), FileKind::File), ("n".into(), FileKind::Dir)]);
    assert_eq!(agent_kind(s.stat("/tmp/a.txt").await), ErrorKind::NotFound);
    assert_eq!(agent_kind(s.rm("/tmp/m", false).await), ErrorKind::Conflict);
    s.rm("/tmp/m", true).await.unwrap();
    assert_eq!(agent_kind(s.stat("/tmp/m").await), ErrorKind::NotFound);

    // Push and pull of a local tree; it comes back identical.
    let local = tempfile::tempdir().unwrap();
    let tree = local.path().join("tree");
    make_tree(&tree);
    let pushed = s.push(&tree, "/tmp/tree").await.unwrap();
    assert!(pushed > 700 * 1024);
    let out = s.run_checked(["sh", "-c", "cat /tmp/tree/README && /tmp/tree/run.sh"]).await;
    assert_eq!(out.unwrap().stdout_str(), "hello tree\nran\n");
    let mut seen = 0;
    let pulled =
        s.pull("/tmp/tree", local.path().join("back")).progress(|n| seen = n).await.unwrap();
    assert_eq!(seen, pulled.bytes);
    assert_eq!(pulled.skipped() + pulled.cleared_setid, 0);
    assert_eq!(tree_hash(&tree), tree_hash(&local.path().join("back")));
    s.push_file(tree.join("run.sh"), "/tmp/renamed.sh").await.unwrap();
    assert_eq!(s.stat("/tmp/renamed.sh").await.unwrap().mode, 0o755);
    s.pull_file("/tmp/renamed.sh", local.path().join("r.sh")).await.unwrap();
    assert_eq!(std::fs::read(local.path().join("r.sh")).unwrap(), b"#!/bin/sh\necho ran\n");
    assert!(matches!(
        s.pull_file("/tmp/tree", local.path().join("nope")).await,
        Err(Error::Invalid(_))
    ));
    assert_eq!(
        agent_kind(s.pull("/tmp/none", local.path().join("none")).await),
        ErrorKind::NotFound
    );

    // Find as a stream; replace.
    s.write_with("/tmp/code/a.rs", "fn main() {\n    needle_1();\n}\n", opts).await.unwrap();
    s.write_with("/tmp/code/b.txt", "needle_2\n", opts).await.unwrap();
    s.write_with("/tmp/code/sub/c.rs", "nothing\nneedle_3 here\n", opts).await.unwrap();
    let find = |max| FindRequest {
        path: "/tmp/code".into(),
        pattern: "needle_[0-9]".into(),
        glob: Some("*.rs".into()),
        max_file_bytes: None,
        max_matches: max,
    };
    let mut found = s.find(find(None)).await.unwrap();
    let mut hits = vec![];
    while let Some(m) = poll_next(&mut found).await {
        let m = m.unwrap();
        hits.push((m.path, m.line, m.text));
    }
    hits.sort();
    assert_eq!(
        hits,
        [
            ("/tmp/code/a.rs".into(), 2, "    needle_1();".into()),
            ("/tmp/code/sub/c.rs".into(), 2, "needle_3 here".into())
        ]
    );
    let mut one = s.find(find(Some(1))).await.unwrap();
    assert!(one.next().await.unwrap().is_ok());
    assert!(one.next().await.is_none());
    let replaced = s
        .replace(ReplaceRequest {
            paths: vec!["/tmp/code/a.rs".into(), "/tmp/code/b.txt".into()],
            pattern: "needle_([0-9])".into(),
            replacement: "pin_$1".into(),
        })
        .await
        .unwrap();
    let counts: Vec<u64> = replaced.iter().map(|r| r.count).collect();
    assert_eq!(counts, [1, 1]);
    assert_eq!(&s.read("/tmp/code/b.txt").await.unwrap()[..], b"pin_2\n");

    // Watch as a stream: armed when the call returns, so the next change is seen.
    s.mkdir("/tmp/watched", false).await.unwrap();
    let mut watch = s.watch("/tmp/watched", true).await.unwrap();
    s.run_checked(["touch", "/tmp/watched/new.txt"]).await.unwrap();
    loop {
        let ev = poll_next(&mut watch).await.expect("stream open").unwrap();
        if ev.path == "/tmp/watched/new.txt" {
            assert_eq!((ev.kind, ev.dir), (EventKind::Created, false));
            break;
        }
    }
    watch.cancel().await.unwrap();
    while let Some(ev) = watch.next().await {
        ev.unwrap();
    }

    // Git on a repository made in the sandbox (the host template binds the host's git).
    let host_git =
        ["/usr/bin/git", "/usr/local/bin/git"].iter().any(|p| std::path::Path::new(p).exists());
    if host_git {
        s.run_checked(["sh", "-c", "git init -q /tmp/repo && echo hi > /tmp/repo/f.txt"])
            .await
            .unwrap();
        let st = s.git_status("/tmp/repo").await.unwrap();
        assert_eq!(st.files.len(), 1);
        assert_eq!((st.files[0].path.as_str(), st.files[0].unstaged), ("f.txt", '?'));
        s.git_op("/tmp/repo", GitOp::Add { paths: vec![] }).await.unwrap();
        let author = GitAuthor { name: "T".into(), email: "t@example.com".into() };
        let commit = GitOp::Commit { message: "first".into(), author: Some(author) };
        let Some(GitReply::Committed { oid }) = s.git_op("/tmp/repo", commit).await.unwrap() else {
            panic!("no commit id");
        };
        let st = s.git_status("/tmp/repo").await.unwrap();
        assert_eq!((st.files.len(), st.oid.as_deref()), (0, Some(oid.as_str())));
        assert_eq!(agent_kind(s.git_status("/tmp").await), ErrorKind::NotFound);
    } else {
        eprintln!("no git on this host: the git checks were skipped");
    }
    s.release().await.unwrap();
}

/// A line-echo server inside the sandbox that closes its side only after the client's end of
/// stream, so both half-closes are exercised.
const ECHO_SERVER: &str = r#"
use IO::Socket::INET;
my $l = IO::Socket::INET->new(LocalAddr => '127.0.0.1', LocalPort => 7000, Listen => 8, ReuseAddr => 1) or die "listen: $!";
$| = 1; print "listening\n";
while (my $c = $l->accept) {
    while (1) { my $n = sysread($c, my $buf, 65536); last if !$n; syswrite($c, $buf); }
    shutdown($c, 1); close($c);
}
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pty_and_port_forward() {
    let node = Sandboxd::start(ONE_WARM);
    let s = node.client().claim("host").send().await.unwrap();

    // A terminal: what is typed runs, resize reaches the program, exit ends the call.
    let mut pty = s.pty(80, 24).open().await.unwrap();
    let mut screen = String::new();
    pty.write("echo pty-$((6*7))\n").await.unwrap();
    while !screen.contains("pty-42") {
        let b = pty.read().await.unwrap().expect("terminal open");
        screen.push_str(&String::from_utf8_lossy(&b));
    }
    pty.resize(100, 40).await.unwrap();
    pty.write("stty size\n").await.unwrap();
    while !screen.contains("40 100") {
        let b = pty.read().await.unwrap().expect("terminal open");
        screen.push_str(&String::from_utf8_lossy(&b));
    }
    pty.write("exit 3\n").await.unwrap();
    while pty.read().await.unwrap().is_some() {}
    assert_eq!(pty.status().unwrap().code, 3);

    // Port forward to an echo server inside the sandbox.
    let pid = s.spawn(["perl", "-e", ECHO_SERVER]).await.unwrap();
    eventually("the echo server listens", || async {
        s.logs(pid).await.unwrap().stdout() == b"listening\n"
    })
    .await;
    let fwd = s.forward(7000, 0).await.unwrap();
    let local = fwd.local_addr();
    let round_trip = |payload: Vec<u8>| async move {
        let mut conn = tokio::net::TcpStream::connect(local).await.unwrap();
        conn.write_all(&payload).await.unwrap();
        conn.shutdown().await.unwrap(); // half-close: the server still answers
        let mut back = vec![];
        conn.read_to_end(&mut back).await.unwrap();
        back == payload
    };
    let big: Vec<u8> = (0..600_000u32).map(|i| (i % 253) as u8).collect();
    let (a, b) = tokio::join!(round_trip(big), round_trip(b"small".to_vec()));
    assert!(a && b, "both forwarded connections echoed their bytes");
    assert_eq!(fwd.failures(), 0);

    // Nothing listens: the local connection is closed, and the failure counted.
    let dead = s.forward(7001, 0).await.unwrap();
    let mut conn = tokio::net::TcpStream::connect(dead.local_addr()).await.unwrap();
    let mut back = vec![];
    let _ = conn.read_to_end(&mut back).await;
    assert!(back.is_empty());
    eventually("the failed forward is counted", || async { dead.failures() == 1 }).await;
    s.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_are_reused_and_redirects_reach_the_relay() {
    let node = Sandboxd::start(ONE_WARM);
    let c = node.client();
    let s = c.claim("host").send().await.unwrap();
    // The claim asked for the relay: its connection is kept for the first call.
    assert_eq!(s.connection_stats(), ConnStats { dialled: 1, reused: 0, idle: 1 });
    for _ in 0..3 {
        s.run(["true"]).await.unwrap();
    }
    let stats = s.connection_stats();
    assert_eq!((stats.dialled, stats.reused, stats.idle), (1, 3, 1));
    // A client that keeps no connections claims without one.
    let bare = Client::builder(node.url()).token(ROOT).max_idle_connections(0);
    let t = bare.clone().build().unwrap().claim("host").send().await.unwrap();
    assert_eq!(t.connection_stats(), ConnStats::default());
    t.run(["true"]).await.unwrap();
    assert_eq!(t.connection_stats(), ConnStats { dialled: 1, reused: 0, idle: 0 });
    t.release().await.unwrap();
    // A claim that asks for silkd's answer has it when it returns: the node asked on the
    // claim's connection (no call of ours ran on it yet), or, for a client that keeps no
    // connections, the handle asked itself.
    for (client, stats) in [
        (c.clone(), ConnStats { dialled: 1, reused: 0, idle: 1 }),
        (bare.build().unwrap(), ConnStats { dialled: 1, reused: 0, idle: 0 }),
    ] {
        let asked = client.claim("host").answered(true).send().await.unwrap();
        assert_eq!(asked.connection_stats(), stats);
        let answered = asked.answered().expect("silkd's answer").clone();
        let now = asked.agent_info().await.unwrap();
        assert_eq!(answered.agent_version, now.agent_version);
        assert!(answered.uptime_ms <= now.uptime_ms, "{answered:?} then {now:?}");
        asked.release().await.unwrap();
    }
    assert!(s.answered().is_none(), "a claim that did not ask has no answer");
    // silkd agrees: one live connection (the node's readiness probe may still be closing).
    eventually("silkd counts one connection", || async {
        s.agent_info().await.unwrap().connections == 1
    })
    .await;
    assert_eq!(s.connection_stats().dialled, 1, "every info call reused the one connection");

    // Two calls at once need two connections; both are kept afterwards. (Calls that take a
    // while: two `true`s can run one after the other on one connection.)
    let (a, b) = tokio::join!(s.run(["sleep", "0.3"]), s.run(["sleep", "0.3"]));
    a.unwrap();
    b.unwrap();
    let stats = s.connection_stats();
    assert_eq!((stats.dialled, stats.idle), (2, 2));
    // Long streams dial their own and leave the pool alone.
    let watch = s.watch("/tmp", false).await.unwrap();
    assert_eq!((s.connection_stats().dialled, s.connection_stats().idle), (3, 2));
    drop(watch);
    // Redirects: a node answering 307 for everything sends us to the real one, once.
    let real = node.addr;
    let proxy = FakeHttp::start(move |req| {
        let target = req.target().to_string();
        format!(
            "HTTP/1.1 307 Temporary Redirect\r\nLocation: http://{real}{target}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        )
    })
    .await;
    let via = Client::builder(proxy.url()).token(ROOT).build().unwrap();
    let redirected = via.sandbox(s.id(), Some(s.token())).await.unwrap();
    assert_eq!(redirected.run(["echo", "via"]).await.unwrap().stdout_str(), "via\n");
    let seen: Vec<String> = proxy.seen().iter().map(|r| r.line.clone()).collect();
    let id = s.id();
    assert_eq!(
        seen,
        [
            format!("GET /v1/sandboxes/{id} HTTP/1.1"),
            format!("GET /v1/sandboxes/{id}/agent HTTP/1.1")
        ]
    );
    s.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hibernate_checkpoint_branch_fork_promote_archive() {
    let node = Sandboxd::start(ONE_WARM);
    let c = node.client();
    let s = c.claim("host").send().await.unwrap();
    s.write("/root/state", "v1").await.unwrap();

    let h = s.hibernate().await.unwrap();
    assert_eq!(h.state, SandboxState::Hibernated);
    assert!(h.memory_snapshot, "{:?}", h.memory_note);
    // The next call wakes it, through a fresh relay connection.
    assert_eq!(s.read("/root/state").await.unwrap(), "v1");
    assert_eq!(s.refresh().await.unwrap().state, SandboxState::Claimed);

    let ck = s.checkpoint(Some("before-v2")).await.unwrap();
    assert!(ck.id.starts_with("ck_") && ck.uploaded_bytes.is_some(), "{ck:?}");
    s.write("/root/state", "v2").await.unwrap();
    assert_eq!(s.checkpoints().await.unwrap()[0].name.as_deref(), Some("before-v2"));
    let b = c.branch(&ck.id, Some(s.token())).await.unwrap();
    assert_eq!(b.info().from_checkpoint.as_deref(), Some(ck.id.as_str()));
    assert_eq!(b.read("/root/state").await.unwrap(), "v1");

    let kids = s.fork(2).await.unwrap();
    assert_eq!(kids.len(), 2);
    for k in &kids {
        assert_eq!(k.read("/root/state").await.unwrap(), "v2");
        assert_eq!(k.info().forked_from.as_deref(), Some(s.id()));
    }
    match s.fork(17).await {
        Err(Error::Api { status: 400, .. }) => {}
        other => panic!("fork of 17: {other:?}"),
    }

    let t = s.promote("sdk-made").await.unwrap();
    assert!(t.digest.is_some_and(|d| d.len() == 64));
    let p = c.claim("sdk-made").send().await.unwrap();
    assert_eq!(p.read("/root/state").await.unwrap(), "v2");
    assert!(
        c.templates()
            .await
            .unwrap()
            .iter()
            .any(|t| t.name == "sdk-made" && t.kind == TemplateKind::Promoted)
    );
    c.delete_template("sdk-made").await.unwrap();

    assert_eq!(s.archive().await.unwrap().state, SandboxState::Archived);
    assert_eq!(s.wake().await.unwrap().state, SandboxState::Claimed);
    assert_eq!(s.read("/root/state").await.unwrap(), "v2");
    c.delete_checkpoint(&ck.id, None).await.unwrap();
    assert!(c.checkpoints().await.unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread")]
async fn a_claim_after_the_node_restarted_dials_afresh_rather_than_take_a_dead_spare_connection() {
    // A fixed port: the client finds the node again after its restart.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut launch = silk_testkit::Launch::new(ROOT, ONE_WARM);
    launch.listen = format!("127.0.0.1:{port}");
    let mut node = silk_testkit::Node::start(launch).expect("the node starts");
    let client = Client::builder(node.url()).token(ROOT).build().unwrap();
    let first = client.claim("host").send().await.unwrap();
    assert_eq!(first.exec(["true"]).run().await.unwrap().code(), 0);
    // The client has dialled its next connection ahead by now; the node that accepted it dies.
    tokio::time::sleep(Duration::from_millis(200)).await;
    node.restart();
    let second = client.claim("host").send().await.expect("a claim after the restart");
    assert_eq!(second.exec(["true"]).run().await.unwrap().code(), 0);
}
