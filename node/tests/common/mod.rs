//! Harness: a real sandboxd process (real jail engine) on 127.0.0.1 and a minimal HTTP/1.1
//! client, so the tests exercise exactly what users do.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::Duration;

use serde_json::Value;

pub mod schema;

pub const ROOT: &str = "root-token-for-tests";

pub fn static_silkd() -> PathBuf {
    let path = std::env::var_os("SILKD_STATIC").map(PathBuf::from).expect(
        "SILKD_STATIC is not set: run the suite through scripts/test (it builds a static silkd)",
    );
    assert!(path.is_file(), "SILKD_STATIC={} does not exist", path.display());
    path
}

/// `silk-jail` from the same target directory as this test binary.
pub fn launcher() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let path = exe.parent().unwrap().parent().unwrap().join("silk-jail");
    assert!(path.is_file(), "{} missing: build the workspace (scripts/test does)", path.display());
    path
}

pub struct Sandboxd {
    pub child: Option<Child>,
    pub addr: SocketAddr,
    pub dir: tempfile::TempDir,
    pub config: PathBuf,
    /// `SANDBOXD_CRASH_AT` for the next launch: the node kills itself at that point.
    pub crash_at: Option<String>,
}

impl Sandboxd {
    /// Starts a node whose config is `extra` TOML appended to the harness's own keys.
    pub fn start(extra: &str) -> Sandboxd {
        Sandboxd::start_at("127.0.0.1:0", extra)
    }

    /// [`start`](Self::start) with the API on `listen` (e.g. `127.0.0.2:0`).
    pub fn start_at(listen: &str, extra: &str) -> Sandboxd {
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("sandboxd.toml");
        let toml = format!(
            "listen = \"{listen}\"\ndata_dir = \"{}\"\napi_token = \"{ROOT}\"\nsilkd = \"{}\"\nlauncher = \"{}\"\n{extra}\n",
            dir.path().join("data").display(),
            static_silkd().display(),
            launcher().display()
        );
        std::fs::write(&config, toml).unwrap();
        let mut node = Sandboxd {
            child: None,
            addr: "127.0.0.1:1".parse().unwrap(),
            dir,
            config,
            crash_at: None,
        };
        node.launch();
        node
    }

    fn launch(&mut self) {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_sandboxd"));
        cmd.arg("--config")
            .arg(&self.config)
            .env(
                "SANDBOXD_LOG",
                std::env::var("SANDBOXD_TEST_LOG").unwrap_or_else(|_| "warn".into()),
            )
            .stdout(Stdio::piped());
        match &self.crash_at {
            Some(point) => cmd.env("SANDBOXD_CRASH_AT", point),
            None => cmd.env_remove("SANDBOXD_CRASH_AT"),
        };
        let mut child = cmd.spawn().unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
        let addr = line
            .trim()
            .strip_prefix("sandboxd listening on ")
            .unwrap_or_else(|| panic!("readiness line {line:?}"));
        self.addr = addr.parse().unwrap();
        self.child = Some(child);
    }

    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            c.kill().unwrap();
            c.wait().unwrap();
        }
    }

    pub fn restart(&mut self) {
        self.kill9();
        self.launch();
    }

    /// Waits for the node process to end by itself (a crash point), then starts it again
    /// without the crash point.
    pub fn wait_crash_and_restart(&mut self) {
        let mut child = self.child.take().expect("running");
        let status = child.wait().unwrap();
        assert!(!status.success(), "the node was to crash, it exited with {status}");
        self.crash_at = None;
        self.launch();
    }

    pub fn data(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    /// Jails the engine knows about (claimed and warm).
    pub fn jails(&self) -> usize {
        std::fs::read_dir(self.data().join("engine/boxes")).map(|d| d.count()).unwrap_or(0)
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

impl Sandboxd {
    /// This node's cgroup parent for `controller` (named after its engine's data directory).
    fn cgroup_parent(&self, controller: &str) -> PathBuf {
        let engine = self.data().join("engine");
        let instance = blake3::hash(engine.as_os_str().as_encoded_bytes()).to_hex();
        Path::new("/sys/fs/cgroup").join(controller).join(format!("silkmesh-{}", &instance[..12]))
    }

    /// How many processes one sandbox has on the host (none when it is stopped or gone).
    pub fn sandbox_processes(&self, id: &str) -> usize {
        let procs = self.cgroup_parent("pids").join(id).join("cgroup.procs");
        std::fs::read_to_string(procs).unwrap_or_default().lines().count()
    }

    /// Kills every process of one sandbox, silkd first among them: what an OOM kill or a host
    /// reboot does to it.
    pub fn kill_sandbox_processes(&self, id: &str) {
        kill_group(&self.cgroup_parent("pids").join(id));
    }
}

/// SIGKILLs everything in a cgroup until it is empty.
fn kill_group(group: &Path) {
    for _ in 0..500 {
        let procs = std::fs::read_to_string(group.join("cgroup.procs")).unwrap_or_default();
        if procs.trim().is_empty() {
            return;
        }
        for pid in procs.lines().filter_map(|l| l.trim().parse::<i32>().ok()) {
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

impl Drop for Sandboxd {
    fn drop(&mut self) {
        // Stop the node, then kill whatever its jails left: everything in this node's own cgroup
        // parent, never another node's.
        self.kill9();
        for ctl in ["memory", "cpu", "pids", "freezer"] {
            let group = self.cgroup_parent(ctl);
            let Ok(sandboxes) = std::fs::read_dir(&group) else { continue };
            for sandbox in sandboxes.flatten().filter(|s| s.path().is_dir()) {
                kill_group(&sandbox.path());
                let _ = std::fs::remove_dir(sandbox.path());
            }
            let _ = std::fs::remove_dir(&group);
        }
        // Sandboxes' disk images stay mounted when their node dies (by design): the temp
        // directory can only go once they are unmounted.
        silk_engine::jail::unmount_under(&self.data());
    }
}

/// One HTTP/1.1 request on a fresh connection; the body is parsed as JSON when it is JSON.
pub fn http(
    addr: SocketAddr,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: Option<&str>,
    content_type: &str,
) -> (u16, Value) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    if let Some(t) = token {
        head.push_str(&format!("Authorization: Bearer {t}\r\n"));
    }
    let body = body.unwrap_or("");
    if !body.is_empty() || method == "POST" || method == "PUT" {
        head.push_str(&format!(
            "Content-Type: {content_type}\r\nContent-Length: {}\r\n",
            body.len()
        ));
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes()).unwrap();
    s.write_all(body.as_bytes()).unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let text = String::from_utf8_lossy(&raw);
    let (head, rest) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status: u16 = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    let value = serde_json::from_str(rest).unwrap_or(Value::String(rest.to_string()));
    conforms(addr, method, path, status, &value);
    (status, value)
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

/// Like [`http`], but a connection the server drops (a crash) is `None` instead of a panic.
pub fn try_http(
    addr: SocketAddr,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: &str,
) -> Option<(u16, Value)> {
    let mut s = TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n{}Content-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        token.map(|t| format!("Authorization: Bearer {t}\r\n")).unwrap_or_default(),
        body.len()
    );
    s.write_all(head.as_bytes()).ok()?;
    s.write_all(body.as_bytes()).ok()?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).ok()?;
    let text = String::from_utf8_lossy(&raw);
    let (head, rest) = text.split_once("\r\n\r\n")?;
    let status: u16 = head.split_whitespace().nth(1)?.parse().ok()?;
    let value = serde_json::from_str(rest).unwrap_or(Value::String(rest.to_string()));
    conforms(addr, method, path, status, &value);
    Some((status, value))
}

/// `[store.s3]` for the local S3 server `scripts/start-s3` runs (scripts/test starts it), under
/// a prefix of its own. Never skipped: without the server the test fails saying so.
pub fn s3_store_toml() -> String {
    let var = |v: &str| {
        std::env::var(v).unwrap_or_else(|_| {
            panic!("{v} is not set: run the suite through scripts/test, or eval \"$(scripts/start-s3)\"")
        })
    };
    let _ = (var("AWS_ACCESS_KEY_ID"), var("AWS_SECRET_ACCESS_KEY"));
    let prefix = format!(
        "node-{}-{}/",
        std::process::id(),
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos()
    );
    format!(
        "[store.s3]\nbucket = \"{}\"\nregion = \"{}\"\nendpoint = \"{}\"\npath_style = true\nprefix = \"{prefix}\"\n",
        var("SILK_S3_BUCKET"),
        var("SILK_S3_REGION"),
        var("SILK_S3_ENDPOINT")
    )
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

pub fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    for _ in 0..3000 {
        if cond() {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!("timed out waiting for: {what}");
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
