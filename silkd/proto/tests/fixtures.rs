//! Golden byte fixtures: one sample of every frame variant, encoded and compared with the bytes
//! stored in `tests/fixtures/frames.hex`. A change to the wire format fails here; if the change is
//! intended (a new variant appended), regenerate with `SILK_BLESS=1 cargo test -p silk-proto`.

use std::collections::BTreeSet;

use bytes::{Bytes, BytesMut};
use silk_proto::*;

/// Pinned so that adding a variant is a deliberate act here too.
const VARIANTS: usize = 53;

fn stat() -> FileStat {
    FileStat {
        kind: FileKind::File,
        size: 4096,
        mode: 0o644,
        uid: 1000,
        gid: 100,
        mtime_ms: 1_700_000_000_123,
    }
}

fn command() -> Command {
    Command {
        argv: vec!["sh".into(), "-c".into(), "echo hi".into()],
        cwd: Some("/work".into()),
        env: vec![("LANG".into(), "C.UTF-8".into())],
        user: Some("nobody".into()),
    }
}

fn samples() -> Vec<Frame> {
    let exit = ExitStatus { code: 137, signal: Some(9), timed_out: true };
    vec![
        Frame::Stdin(Bytes::from_static(b"input\n")),
        Frame::Stdout(Bytes::from_static(b"hello\n")),
        Frame::Stderr(Bytes::from_static(b"oops\n")),
        Frame::Data(Bytes::from_static(&[0, 1, 2, 255])),
        Frame::Eof,
        Frame::Cancel,
        Frame::Exit(exit),
        Frame::Done,
        Frame::Error(WireError::new(ErrorKind::NotFound, "no such file: /x")),
        Frame::Hello(Hello { protocol: 1, client: "sdk-rs/0.1".into() }),
        Frame::Info,
        Frame::Exec(ExecRequest { command: command(), stdin: true, timeout_ms: Some(30_000) }),
        Frame::Spawn(command()),
        Frame::Ps,
        Frame::Logs { pid: 42 },
        Frame::Attach { pid: 42 },
        Frame::Kill { pid: 42, signal: 15 },
        Frame::Read(ReadRequest { path: "/etc/hosts".into(), offset: 10, len: Some(100) }),
        Frame::Write(WriteRequest { path: "/tmp/f".into(), mode: Some(0o600), parents: true }),
        Frame::Stat { path: "/tmp".into() },
        Frame::List { path: "/".into() },
        Frame::Mkdir { path: "/a/b".into(), parents: true },
        Frame::Rm { path: "/a".into(), recursive: true },
        Frame::Rename { from: "/a".into(), to: "/b".into() },
        Frame::Push { path: "/srv".into() },
        Frame::Pull { path: "/srv".into() },
        Frame::Welcome(Welcome {
            protocol: 1,
            agent_version: "0.1.0".into(),
            capabilities: vec!["exec".into(), "files".into()],
        }),
        Frame::InfoReply(AgentInfo {
            agent_version: "0.1.0".into(),
            protocol: 1,
            uptime_ms: 1234,
            processes: 2,
            sessions: 0,
            connections: 1,
        }),
        Frame::Started { pid: 7 },
        Frame::Spawned { pid: 8 },
        Frame::Procs(vec![ProcInfo {
            pid: 8,
            argv: vec!["sleep".into(), "9".into()],
            started_ms: 1_700_000_000_000,
            detached: true,
            exit: Some(ExitStatus { code: 0, signal: None, timed_out: false }),
        }]),
        Frame::StatReply(stat()),
        Frame::Entries(vec![DirEntry { name: "f".into(), stat: stat() }]),
        Frame::Dropped { bytes: 65536 },
        Frame::SessionCreate(SessionRequest {
            id: Some("build".into()),
            cwd: Some("/work".into()),
            env: vec![("CI".into(), "1".into())],
            user: Some("nobody".into()),
        }),
        Frame::SessionList,
        Frame::SessionRm { id: "build".into() },
        Frame::SessionExec(SessionExecRequest {
            id: "build".into(),
            script: "cd src && make".into(),
            timeout_ms: Some(60_000),
        }),
        Frame::PtyOpen(PtyRequest { command: command(), cols: 120, rows: 40 }),
        Frame::PtyResize { pid: 42, cols: 100, rows: 30 },
        Frame::Find(FindRequest {
            path: "/src".into(),
            pattern: "fn \\w+".into(),
            glob: Some("*.rs".into()),
            max_file_bytes: Some(1 << 20),
            max_matches: Some(500),
        }),
        Frame::Replace(ReplaceRequest {
            paths: vec!["/src/a.rs".into(), "/src/b.rs".into()],
            pattern: "foo(\\d)".into(),
            replacement: "bar$1".into(),
        }),
        Frame::Watch(WatchRequest { path: "/src".into(), recursive: true }),
        Frame::Git(GitRequest {
            repo: "/src".into(),
            op: GitOp::Push { remote: Some("origin".into()), branch: None, set_upstream: true },
            user: None,
            credentials: Some(GitCredentials { username: "u".into(), password: "p".into() }),
        }),
        Frame::PortForward { port: 8080 },
        Frame::Ready,
        Frame::Sessions(vec![SessionInfo {
            id: "build".into(),
            pid: 9,
            created_ms: 1_700_000_000_000,
            last_used_ms: 1_700_000_000_500,
            busy: false,
        }]),
        Frame::Matches(vec![Match {
            path: "/src/a.rs".into(),
            line: 3,
            text: "fn main() {".into(),
        }]),
        Frame::Replaced { path: "/src/a.rs".into(), count: 2 },
        Frame::Events(vec![
            WatchEvent {
                kind: EventKind::Renamed,
                path: "/src/a".into(),
                to: Some("/src/b".into()),
                dir: false,
            },
            WatchEvent { kind: EventKind::Created, path: "/src/d".into(), to: None, dir: true },
        ]),
        Frame::GitReply(GitReply::Status(GitStatus {
            branch: Some("main".into()),
            oid: Some("0123456789abcdef0123456789abcdef01234567".into()),
            upstream: Some("origin/main".into()),
            ahead: 1,
            behind: 2,
            files: vec![GitFile {
                path: "b.rs".into(),
                orig_path: Some("a.rs".into()),
                staged: 'R',
                unstaged: '.',
            }],
            truncated: false,
        })),
        Frame::Quiesce,
        Frame::Chown { path: "/home/user/a".into(), user: "user".into() },
    ]
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[test]
fn every_variant_matches_its_golden_bytes() {
    let samples = samples();
    assert_eq!(samples.len(), VARIANTS);
    assert_eq!(Frame::NAMES.len(), VARIANTS);
    let covered: BTreeSet<_> = samples.iter().map(Frame::name).collect();
    assert_eq!(covered, Frame::NAMES.iter().copied().collect(), "one sample per variant");

    let mut lines = String::new();
    for frame in &samples {
        let mut buf = BytesMut::new();
        encode(frame, &mut buf).unwrap();
        lines.push_str(&format!("{} {}\n", frame.name(), hex(&buf)));
        // Round trip: the bytes decode to the same frame, consuming exactly the frame.
        let mut input = buf.clone();
        assert_eq!(decode(&mut input).unwrap().as_ref(), Some(frame));
        assert!(input.is_empty());
    }

    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/frames.hex");
    if std::env::var_os("SILK_BLESS").is_some() {
        std::fs::write(path, &lines).unwrap();
    }
    let golden = std::fs::read_to_string(path).expect("fixtures missing: run with SILK_BLESS=1");
    for (want, got) in golden.lines().zip(lines.lines()) {
        assert_eq!(got, want, "wire bytes changed");
    }
    assert_eq!(golden.lines().count(), VARIANTS);
}

#[test]
fn wire_tags_follow_the_declared_order() {
    // Tag = index in NAMES: the first byte of each body.
    for (i, frame) in samples().iter().enumerate() {
        let mut buf = BytesMut::new();
        encode(frame, &mut buf).unwrap();
        assert_eq!(buf[4] as usize, i, "{}", frame.name());
        assert_eq!(Frame::NAMES[i], frame.name());
    }
}
