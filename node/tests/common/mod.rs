//! Harness: a real sandboxd process (real jail engine) on a loopback address, launched and
//! cleaned up by `silk-testkit`, and a minimal HTTP/1.1 client whose every answer is checked
//! against the node's own OpenAPI document (`schema`), so the tests exercise exactly what users
//! do and the document stays true.
#![allow(dead_code, unused_imports)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};

use serde_json::Value;
pub use silk_testkit::{eventually, s3_store_toml, sibling, static_silkd};

pub mod mesh;
pub mod schema;

pub const ROOT: &str = "root-token-for-tests";

/// A pool of one warm sandbox of the host template.
pub const ONE_WARM: &str = "[[pools]]\ntemplate = \"host\"\nwarm = 1\nwarm_max = 1\n";

/// A well-formed sandbox token no sandbox has: it gets past the shape check (a malformed one is a
/// 401 on every node) and is refused where ownership is decided, with the 404 of an unknown id.
pub const WRONG_TOKEN: &str =
    "sbt_0000000000000000000000000000000000000000000000000000000000000000";

/// `silk-jail` from the same target directory as this test binary.
pub fn launcher() -> PathBuf {
    sibling("silk-jail")
}

/// A node (see `silk_testkit::Node`, which it derefs to) with this suite's root token.
pub struct Sandboxd(silk_testkit::Node);

impl std::ops::Deref for Sandboxd {
    type Target = silk_testkit::Node;
    fn deref(&self) -> &silk_testkit::Node {
        &self.0
    }
}

impl std::ops::DerefMut for Sandboxd {
    fn deref_mut(&mut self) -> &mut silk_testkit::Node {
        &mut self.0
    }
}

impl Sandboxd {
    /// Starts a node whose config is `extra` TOML appended to the harness's own keys.
    pub fn start(extra: &str) -> Sandboxd {
        Sandboxd::start_at("127.0.0.1:0", extra)
    }

    /// [`start`](Self::start) with its config and data under `work` (kept afterwards).
    pub fn start_in(work: &Path, extra: &str) -> Sandboxd {
        let launch = silk_testkit::Launch {
            sandboxd: PathBuf::from(env!("CARGO_BIN_EXE_sandboxd")),
            ..silk_testkit::Launch::new(ROOT, extra)
        };
        Sandboxd(silk_testkit::Node::start_at(launch, work).expect("the node starts"))
    }

    /// [`start`](Self::start) with the API on `listen` (e.g. `127.0.0.2:0`).
    pub fn start_at(listen: &str, extra: &str) -> Sandboxd {
        let launch = silk_testkit::Launch {
            sandboxd: PathBuf::from(env!("CARGO_BIN_EXE_sandboxd")),
            listen: listen.into(),
            ..silk_testkit::Launch::new(ROOT, extra)
        };
        Sandboxd(silk_testkit::Node::start(launch).expect("the node starts"))
    }

    pub fn req(
        &self,
        method: &str,
        path: &str,
        token: Option<&str>,
        body: Option<&str>,
    ) -> (u16, Value) {
        http(self.addr, method, path, token, body, "application/json")
    }

    pub fn claim(&self, body: &str) -> Value {
        let (status, v) = self.req("POST", "/v1/sandboxes", Some(ROOT), Some(body));
        assert_eq!(status, 201, "claim failed: {v}");
        v
    }

    pub fn info(&self) -> Value {
        self.req("GET", "/v1/info", Some(ROOT), None).1
    }

    /// Waits until the first pool has `n` warm sandboxes and none starting.
    pub fn wait_warm(&self, n: u64) {
        eventually(&format!("{n} warm"), || {
            let info = self.info();
            info["pools"][0]["warm"] == n && info["pools"][0]["starting"] == 0
        });
    }

    pub fn exec(&self, id: &str, token: &str, script: &str) -> Value {
        let body = serde_json::json!({ "argv": ["sh", "-c", script] }).to_string();
        let (status, v) =
            self.req("POST", &format!("/v1/sandboxes/{id}/exec"), Some(token), Some(&body));
        assert_eq!(status, 200, "exec failed: {v}");
        v
    }
}

/// One HTTP/1.1 request on a fresh connection (see `silk_testkit::http`); the answer must be
/// one the node's OpenAPI document describes.
pub fn http(
    addr: SocketAddr,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: Option<&str>,
    content_type: &str,
) -> (u16, Value) {
    let (status, value) = silk_testkit::http(addr, method, path, token, body, content_type);
    conforms(addr, method, path, status, &value);
    (status, value)
}

/// Like [`http`], but a connection the server drops (a crash) is `None` instead of a panic.
pub fn try_http(
    addr: SocketAddr,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: &str,
) -> Option<(u16, Value)> {
    let answer = silk_testkit::try_http(addr, method, path, token, Some(body), "application/json")?;
    conforms(addr, method, path, answer.0, &answer.1);
    Some(answer)
}

/// Panics unless the answer is one the node's OpenAPI document describes (status and body).
pub fn conforms(addr: SocketAddr, method: &str, path: &str, status: u16, body: &Value) {
    static DOCS: std::sync::Mutex<Vec<(SocketAddr, Value)>> = std::sync::Mutex::new(vec![]);
    if path.starts_with("/v1/openapi.json") {
        return;
    }
    let mut docs = DOCS.lock().unwrap_or_else(|p| p.into_inner());
    if !docs.iter().any(|(a, _)| *a == addr) {
        let Some(doc) = document(addr) else { return }; // the node died meanwhile
        docs.push((addr, doc));
    }
    let doc = &docs.iter().find(|(a, _)| *a == addr).expect("just added").1;
    if let Some(wrong) = schema::check_answer(doc, method, path, status, body) {
        panic!("an answer the API document does not describe: {wrong}\nbody: {body}");
    }
}

fn document(addr: SocketAddr) -> Option<Value> {
    let mut s = TcpStream::connect(addr).ok()?;
    write!(s, "GET /v1/openapi.json HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").ok()?;
    let mut raw = String::new();
    s.read_to_string(&mut raw).ok()?;
    serde_json::from_str(raw.split_once("\r\n\r\n")?.1).ok()
}

/// `GET /v1/sandboxes/{id}/agent` with `Upgrade: silkd` on a new connection: asserts the `101`,
/// reads its headers, and returns the bare stream (nothing of silkd's read yet).
pub fn upgrade(addr: SocketAddr, id: &str, token: &str) -> TcpStream {
    let mut stream = TcpStream::connect(addr).unwrap();
    write!(stream, "GET /v1/sandboxes/{id}/agent HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\nConnection: upgrade\r\nUpgrade: silkd\r\n\r\n").unwrap();
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut line = String::new();
    reader.read_line(&mut line).unwrap();
    assert!(line.contains("101"), "{line}");
    while line != "\r\n" {
        line.clear();
        reader.read_line(&mut line).unwrap();
    }
    assert!(reader.buffer().is_empty(), "silkd bytes read with the headers");
    stream
}

/// `POST /v1/sandboxes` with `body`, asking for the relay: the status line, the `101`'s
/// `silk-sandbox` row (JSON) or the refusal's body, and the connection (silkd's after a `101`).
pub fn claim_upgraded(addr: SocketAddr, token: &str, body: &str) -> (String, Value, TcpStream) {
    let (status, row, _, stream) = claim_asking_if(addr, token, body, None);
    (status, row, stream)
}

/// [`claim_upgraded`] that also asks for silkd's `info` answer (`silk-ask: info`), and the
/// `101`'s `silk-agent-info` (JSON).
pub fn claim_asking(
    addr: SocketAddr,
    token: &str,
    body: &str,
) -> (String, Value, Option<Value>, TcpStream) {
    claim_asking_if(addr, token, body, Some("info"))
}

pub fn claim_asking_if(
    addr: SocketAddr,
    token: &str,
    body: &str,
    ask: Option<&str>,
) -> (String, Value, Option<Value>, TcpStream) {
    let mut stream = TcpStream::connect(addr).unwrap();
    let ask = ask.map(|v| format!("silk-ask: {v}\r\n")).unwrap_or_default();
    write!(stream, "POST /v1/sandboxes HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\nConnection: upgrade\r\nUpgrade: silkd\r\n{ask}Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}", body.len()).unwrap();
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let (mut status, mut line, mut row, mut length) = (String::new(), vec![], None, 0);
    let mut answered = None;
    reader.read_line(&mut status).unwrap();
    loop {
        line.clear();
        reader.read_until(b'\n', &mut line).unwrap();
        if line == b"\r\n" {
            break;
        }
        let text = String::from_utf8(line.clone()).expect("a header of UTF-8");
        let (name, value) = text.split_once(':').unwrap();
        match name.to_ascii_lowercase().as_str() {
            "silk-sandbox" => row = Some(serde_json::from_str(value.trim()).unwrap()),
            "silk-agent-info" => answered = Some(serde_json::from_str(value.trim()).unwrap()),
            "content-length" => length = value.trim().parse().unwrap(),
            _ => {}
        }
    }
    if !status.contains(" 101 ") {
        let mut body = vec![0; length];
        reader.read_exact(&mut body).unwrap();
        return (status, serde_json::from_slice(&body).unwrap_or(Value::Null), answered, stream);
    }
    assert!(reader.buffer().is_empty(), "silkd bytes read with the headers");
    (status, row.expect("a 101 carries the sandbox's row"), answered, stream)
}

/// An upgraded stream as a silk-proto connection.
pub fn relay_connection(stream: TcpStream) -> silk_proto::Connection<tokio::net::TcpStream> {
    stream.set_nonblocking(true).unwrap();
    silk_proto::Connection::new(tokio::net::TcpStream::from_std(stream).unwrap())
}

/// Runs `argv` over a silk-proto connection; returns its stdout and exit code.
pub async fn relay_exec(
    conn: &mut silk_proto::Connection<tokio::net::TcpStream>,
    argv: &[&str],
) -> (Vec<u8>, i32) {
    use silk_proto::*;
    let command =
        Command { argv: argv.iter().map(|a| a.to_string()).collect(), ..Default::default() };
    conn.send(&Frame::Exec(ExecRequest { command, ..Default::default() })).await.unwrap();
    let mut out = vec![];
    loop {
        match conn.recv().await.unwrap().unwrap() {
            Frame::Stdout(b) => out.extend_from_slice(&b),
            Frame::Exit(e) => return (out, e.code),
            _ => {}
        }
    }
}

/// A tiny busybox root filesystem directory, for a template with no pool and no golden.
pub fn busybox_rootfs(dir: &Path) -> PathBuf {
    let root = dir.join("rootfs");
    for d in ["bin", "etc", "tmp", "proc", "dev", "run", "root"] {
        std::fs::create_dir_all(root.join(d)).unwrap();
    }
    std::fs::copy("/bin/busybox", root.join("bin/busybox"))
        .expect("busybox-static: run scripts/install-test-deps");
    for applet in ["sh", "echo", "cat", "hostname"] {
        std::os::unix::fs::symlink("busybox", root.join("bin").join(applet)).unwrap();
    }
    std::fs::write(root.join("etc/passwd"), "root:x:0:0:root:/root:/bin/sh\n").unwrap();
    root
}

/// A btrfs filesystem in an image file, loop-mounted at `at` for the value's life (the disk
/// limit tests need a data directory on btrfs; `scripts/install-test-deps` installs
/// btrfs-progs).
pub struct LoopFs {
    _image: tempfile::TempDir,
    at: PathBuf,
}

impl LoopFs {
    /// A 1 GiB filesystem of `kind` (`btrfs`, `ext4`) in an image file, mounted at `at`.
    pub fn mount_at(at: &Path, kind: &str) -> LoopFs {
        let image = tempfile::tempdir().unwrap();
        let img = image.path().join("fs.img");
        std::fs::File::create(&img).unwrap().set_len(1 << 30).unwrap();
        let ok = |cmd: &mut std::process::Command| cmd.status().is_ok_and(|s| s.success());
        let mkfs = format!("mkfs.{kind}");
        assert!(ok(std::process::Command::new(&mkfs).arg("-q").arg(&img)), "{mkfs}");
        std::fs::create_dir_all(at).unwrap();
        assert!(ok(std::process::Command::new("mount").args(["-o", "loop"]).arg(&img).arg(at)));
        LoopFs { _image: image, at: at.to_path_buf() }
    }
}

impl Drop for LoopFs {
    fn drop(&mut self) {
        silk_engine::jail::unmount_under(&self.at);
    }
}

/// The value of metric `name` (an unlabelled counter or gauge) on `n`'s `/metrics`.
pub fn metric(n: &Sandboxd, name: &str) -> u64 {
    let (_, v) = n.req("GET", "/metrics", Some(ROOT), None);
    let text = v.as_str().unwrap_or_default().to_string();
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|rest| rest.trim().parse().ok()))
        .unwrap_or_else(|| panic!("no {name} in {text}"))
}

/// Sends `head` (a request line and headers, no blank line) on a new connection and returns the
/// status line, the headers but `date` (lower-cased names, in order) and the body.
pub fn raw_answer(addr: std::net::SocketAddr, head: &str) -> (String, Vec<String>, String) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    write!(s, "{head}Host: x\r\nConnection: close\r\n\r\n").unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).unwrap();
    let (head, body) = raw.split_once("\r\n\r\n").unwrap();
    let mut lines = head.lines();
    let status = lines.next().unwrap().to_string();
    let headers = lines
        .map(|l| {
            let (name, value) = l.split_once(':').unwrap();
            format!("{}: {}", name.to_ascii_lowercase(), value.trim())
        })
        .filter(|h| !h.starts_with("date:"))
        .collect();
    (status, headers, body.to_string())
}
