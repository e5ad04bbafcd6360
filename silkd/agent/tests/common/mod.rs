//! Test harness: a real silkd process on a temp unix socket, and a small client over silk-proto.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};

use bytes::Bytes;
use silk_proto::*;
use tokio::net::UnixStream;

pub struct Silkd {
    pub child: Child,
    pub socket: PathBuf,
    pub dir: tempfile::TempDir,
}

impl Silkd {
    pub fn start() -> Silkd {
        Self::start_with(&[])
    }

    /// Starts silkd with extra flags and waits for its readiness line.
    pub fn start_with(extra: &[&str]) -> Silkd {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("silkd.sock");
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_silkd"));
        cmd.arg("--unix").arg(&socket).args(extra);
        Self::launch(cmd, socket, dir)
    }

    pub fn launch(
        mut cmd: std::process::Command,
        socket: PathBuf,
        dir: tempfile::TempDir,
    ) -> Silkd {
        let mut child = cmd.stdout(Stdio::piped()).spawn().expect("start silkd");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
        assert!(line.starts_with("silkd listening on"), "unexpected readiness line {line:?}");
        Silkd { child, socket, dir }
    }

    pub async fn connect(&self) -> Client {
        Client { conn: Connection::new(UnixStream::connect(&self.socket).await.unwrap()) }
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }
}

impl Drop for Silkd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What a call produced: every non-terminal frame, then the terminal one.
#[derive(Debug)]
pub struct Reply {
    pub frames: Vec<Frame>,
    pub end: Frame,
}

impl Reply {
    pub fn error_kind(&self) -> Option<ErrorKind> {
        match &self.end {
            Frame::Error(e) => Some(e.kind),
            _ => None,
        }
    }

    pub fn stream(&self, pick: fn(&Frame) -> Option<&Bytes>) -> Vec<u8> {
        self.frames.iter().filter_map(pick).flat_map(|b| b.iter().copied()).collect()
    }

    pub fn stdout(&self) -> String {
        String::from_utf8(self.stream(|f| if let Frame::Stdout(b) = f { Some(b) } else { None }))
            .unwrap()
    }

    pub fn stderr(&self) -> String {
        String::from_utf8(self.stream(|f| if let Frame::Stderr(b) = f { Some(b) } else { None }))
            .unwrap()
    }

    pub fn data(&self) -> Vec<u8> {
        self.stream(|f| if let Frame::Data(b) = f { Some(b) } else { None })
    }

    pub fn exit(&self) -> ExitStatus {
        match &self.end {
            Frame::Exit(status) => *status,
            other => panic!("expected Exit, got {other:?}"),
        }
    }

    pub fn done(&self) {
        assert_eq!(self.end, Frame::Done, "frames: {:?}", self.frames);
    }
}

pub struct Client {
    pub conn: Connection<UnixStream>,
}

impl Client {
    pub async fn send(&mut self, frame: Frame) {
        self.conn.send(&frame).await.unwrap();
    }

    /// The next frame; the connection must not close.
    pub async fn recv(&mut self) -> Frame {
        self.conn.recv().await.unwrap().expect("connection closed mid-call")
    }

    /// Reads `Stdout` until `needle` appears in it, and returns everything read. Panics if the
    /// call ends first.
    pub async fn stdout_until(&mut self, needle: &str) -> String {
        let mut out = Vec::new();
        loop {
            match self.recv().await {
                Frame::Stdout(b) => {
                    out.extend_from_slice(&b);
                    let text = String::from_utf8_lossy(&out);
                    if text.contains(needle) {
                        return text.into_owned();
                    }
                }
                f if f.is_terminal() => panic!(
                    "call ended with {} before {needle:?} appeared in {:?}",
                    f.name(),
                    String::from_utf8_lossy(&out)
                ),
                _ => {}
            }
        }
    }

    /// Reads frames until the terminal one.
    pub async fn reply(&mut self) -> Reply {
        let mut frames = vec![];
        loop {
            let frame = self.conn.recv().await.unwrap().expect("connection closed mid-call");
            if frame.is_terminal() {
                return Reply { frames, end: frame };
            }
            frames.push(frame);
        }
    }

    pub async fn call(&mut self, frame: Frame) -> Reply {
        self.send(frame).await;
        self.reply().await
    }

    pub async fn exec(&mut self, argv: &[&str]) -> Reply {
        self.call(exec_req(argv)).await
    }

    pub async fn sh(&mut self, script: &str) -> Reply {
        self.exec(&["sh", "-c", script]).await
    }

    pub async fn write(&mut self, path: &Path, content: &[u8]) -> Reply {
        self.conn
            .queue(&Frame::Write(WriteRequest { path: path_str(path), mode: None, parents: false }))
            .unwrap();
        for chunk in content.chunks(DATA_CHUNK) {
            self.send(Frame::Data(Bytes::copy_from_slice(chunk))).await;
        }
        self.call(Frame::Eof).await
    }

    pub async fn read(&mut self, path: &Path) -> Reply {
        self.call(Frame::Read(ReadRequest { path: path_str(path), offset: 0, len: None })).await
    }
}

pub fn exec_req(argv: &[&str]) -> Frame {
    Frame::Exec(ExecRequest {
        command: Command {
            argv: argv.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        },
        ..Default::default()
    })
}

pub fn path_str(path: &Path) -> String {
    path.to_str().unwrap().to_string()
}

pub fn pid_alive(pid: u32) -> bool {
    // A zombie still has a /proc entry; look at its state.
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => !stat.rsplit(')').next().unwrap_or("").trim_start().starts_with('Z'),
        Err(_) => false,
    }
}

/// Polls `cond` until it holds, for at most five seconds (for effects in another process that
/// send no signal we could wait on, such as a pid disappearing).
pub async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    for _ in 0..500 {
        if cond() {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    panic!("timed out waiting for: {what}");
}
