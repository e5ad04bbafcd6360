//! Test support shared by the node's tests, the SDK's tests and the benchmarks: a real
//! `sandboxd` process (real jail engine) on a loopback address, a minimal HTTP/1.1 client, and
//! cleanup of everything the node leaves (its sandboxes outlive it by design) through the
//! engine's own `list`/`destroy`, never by guessing its cgroup names or reading its files.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::Duration;

use serde_json::Value;

pub mod fault;
pub mod images;
pub mod netns;
pub mod registry;

/// The static silkd the suite builds (`SILKD_STATIC`; scripts/test sets it).
pub fn static_silkd() -> PathBuf {
    let path = std::env::var_os("SILKD_STATIC").map(PathBuf::from).expect(
        "SILKD_STATIC is not set: run the suite through scripts/test (it builds a static silkd)",
    );
    assert!(path.is_file(), "SILKD_STATIC={} does not exist", path.display());
    path
}

/// A binary of this workspace beside the running one: the target directory of a test
/// (`target/<profile>/deps/…`) or of a tool such as silkbench (`target/<profile>/…`).
pub fn sibling(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("the running binary");
    let mut dir = exe.parent().expect("a directory").to_path_buf();
    if dir.file_name().is_some_and(|n| n == "deps") {
        dir.pop();
    }
    let path = dir.join(name);
    assert!(
        path.is_file(),
        "{} missing: build it first (cargo build -p sandboxd -p silk-engine --bins; scripts/test does)",
        path.display()
    );
    path
}

/// How to launch a node.
#[derive(Debug, Clone)]
pub struct Launch {
    /// The `sandboxd` binary (default: the one beside this binary).
    pub sandboxd: PathBuf,
    pub silkd: PathBuf,
    /// The API's address (`127.0.0.1:0` picks a port).
    pub listen: String,
    pub root_token: String,
    /// TOML appended to the harness's own keys (top-level keys first, then tables).
    pub extra: String,
}

impl Launch {
    pub fn new(root_token: &str, extra: &str) -> Launch {
        Launch {
            sandboxd: sibling("sandboxd"),
            silkd: static_silkd(),
            listen: "127.0.0.1:0".into(),
            root_token: root_token.into(),
            extra: extra.into(),
        }
    }
}

/// A running `sandboxd` process; dropping it stops the node and removes every sandbox it left.
#[derive(Debug)]
pub struct Node {
    pub child: Option<Child>,
    pub addr: SocketAddr,
    /// Where its config and data live (a temporary directory, or one the caller gave).
    work: Work,
    pub config: PathBuf,
    silkd: PathBuf,
    launcher: PathBuf,
    sandboxd: PathBuf,
    /// `SANDBOXD_CRASH_AT` for the next launch: the node kills itself at that point.
    pub crash_at: Option<String>,
}

#[derive(Debug)]
enum Work {
    Temp(tempfile::TempDir),
    At(PathBuf),
}

impl Work {
    fn path(&self) -> &Path {
        match self {
            Work::Temp(t) => t.path(),
            Work::At(p) => p,
        }
    }
}

/// Test nodes pull images only from the registries a test lists (on loopback): a template or
/// a fuzzed request naming any other (`python:3.12` is Docker Hub's) is refused before a
/// connection is made, so no test sends traffic off this host.
const REGISTRIES: &str = "only_listed_registries = true\n";

impl Node {
    /// Starts a node in a temporary directory of its own.
    pub fn start(launch: Launch) -> std::io::Result<Node> {
        Node::start_in(launch, Work::Temp(tempfile::tempdir()?))
    }

    /// Starts a node whose config and data live under `work` (kept afterwards).
    pub fn start_at(launch: Launch, work: &Path) -> std::io::Result<Node> {
        Node::start_in(launch, Work::At(work.to_path_buf()))
    }

    fn start_in(launch: Launch, work: Work) -> std::io::Result<Node> {
        let config = work.path().join("sandboxd.toml");
        let launcher = sibling("silk-jail");
        let toml = format!(
            "listen = \"{}\"\ndata_dir = \"{}\"\napi_token = \"{}\"\nsilkd = \"{}\"\nlauncher = \"{}\"\n{REGISTRIES}{}\n",
            launch.listen,
            work.path().join("data").display(),
            launch.root_token,
            launch.silkd.display(),
            launcher.display(),
            launch.extra,
        );
        std::fs::write(&config, toml)?;
        let mut node = Node {
            child: None,
            addr: "127.0.0.1:1".parse().expect("an address"),
            work,
            config,
            silkd: launch.silkd,
            launcher,
            sandboxd: launch.sandboxd,
            crash_at: None,
        };
        node.launch()?;
        Ok(node)
    }

    /// Starts the process on the node's config and waits for its readiness line.
    pub fn launch(&mut self) -> std::io::Result<()> {
        let mut cmd = std::process::Command::new(&self.sandboxd);
        cmd.arg("--config")
            .arg(&self.config)
            .env(
                "SANDBOXD_LOG",
                std::env::var("SANDBOXD_TEST_LOG").unwrap_or_else(|_| "warn".into()),
            )
            .stdout(Stdio::piped())
            // Its own process group: at the end, a launcher it left half way through starting a
            // sandbox goes with it (see `Drop`).
            .process_group(0);
        match &self.crash_at {
            Some(point) => cmd.env("SANDBOXD_CRASH_AT", point),
            None => cmd.env_remove("SANDBOXD_CRASH_AT"),
        };
        let mut child = cmd.spawn()?;
        let mut line = String::new();
        let stdout = child.stdout.take().expect("piped");
        BufReader::new(stdout).read_line(&mut line)?;
        let addr = line.trim().strip_prefix("sandboxd listening on ").and_then(|a| a.parse().ok());
        let Some(addr) = addr else {
            let _ = child.kill();
            let _ = child.wait();
            return Err(std::io::Error::other(format!("readiness line {line:?}")));
        };
        self.addr = addr;
        self.child = Some(child);
        Ok(())
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn work(&self) -> &Path {
        self.work.path()
    }

    pub fn data(&self) -> PathBuf {
        self.work.path().join("data")
    }

    /// The node process's pid while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    /// Stops the process as `kill -9` does (its sandboxes keep running).
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    pub fn restart(&mut self) {
        self.kill9();
        self.launch().expect("the node starts again");
    }

    /// Waits for the process to end by itself (a crash point), then starts it again without
    /// the crash point.
    pub fn wait_crash_and_restart(&mut self) {
        let mut child = self.child.take().expect("running");
        let status = child.wait().expect("wait");
        assert!(!status.success(), "the node was to crash, it exited with {status}");
        self.crash_at = None;
        self.launch().expect("the node starts again");
    }

    /// The sandboxes its engine holds (claimed, warm, stopped), as the engine lists them.
    pub fn boxes(&self) -> Vec<silk_engine::BoxInfo> {
        silk_engine::jail::recorded_boxes(&self.data().join("engine"))
    }

    /// Jails the engine holds.
    pub fn jails(&self) -> usize {
        self.boxes().len()
    }

    /// How many processes sandbox `id` runs (none when it is stopped or gone): those in the pid
    /// namespace of its init.
    pub fn sandbox_processes(&self, id: &str) -> usize {
        self.pid_namespace(id).map_or(0, |ns| in_namespace(&ns))
    }

    /// Kills sandbox `id`'s init (silkd), which takes every process of its pid namespace with
    /// it, and waits until the last is gone: what an OOM kill or a host reboot does to a sandbox.
    pub fn kill_sandbox_processes(&self, id: &str) {
        let (Some(init), Some(ns)) = (self.init_pid(id), self.pid_namespace(id)) else { return };
        // SAFETY: kill(2) on a pid the engine recorded for this sandbox, checked live.
        unsafe { libc::kill(init as i32, libc::SIGKILL) };
        for _ in 0..2500 {
            if in_namespace(&ns) == 0 {
                return;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        panic!("the processes of {id} outlived their init");
    }

    fn pid_namespace(&self, id: &str) -> Option<PathBuf> {
        std::fs::read_link(format!("/proc/{}/ns/pid", self.init_pid(id)?)).ok()
    }

    fn init_pid(&self, id: &str) -> Option<u32> {
        self.boxes().into_iter().find(|b| b.id.as_str() == id)?.pid
    }
}

/// How many processes live in the pid namespace `ns` (a `/proc/<pid>/ns/pid` link's target).
fn in_namespace(ns: &Path) -> usize {
    let Ok(procs) = std::fs::read_dir("/proc") else { return 0 };
    procs
        .flatten()
        .filter(|p| p.file_name().to_string_lossy().bytes().all(|b| b.is_ascii_digit()))
        .filter(|p| std::fs::read_link(p.path().join("ns/pid")).is_ok_and(|n| n == ns))
        .count()
}

impl Drop for Node {
    fn drop(&mut self) {
        if let Some(group) = self.child.as_ref().map(Child::id) {
            // The node's whole group: a jail launcher it started and that is still starting its
            // sandbox would otherwise finish after the cleanup below (a started jail has left
            // the group).
            // SAFETY: kill(2) on the process group this harness made for the node.
            unsafe { libc::kill(-(group as i32), libc::SIGKILL) };
        }
        self.kill9();
        remove_sandboxes(&self.data().join("engine"), &self.silkd, &self.launcher);
        // Its egress lane's nftables table (in the network namespace this thread is in, which
        // is the node's: it started from this thread).
        let table = silk_egress::names(&self.data()).0;
        let _ = silk_egress::nft::remove(&table);
        silk_egress::orphans::unregister(
            std::path::Path::new(silk_egress::orphans::REGISTRY),
            &table,
        );
    }
}

/// Removes every sandbox a stopped node left under its engine directory, through the engine
/// (`silk_engine::jail::remove_all`), and whatever disk images are still mounted under its data.
pub fn remove_sandboxes(engine_dir: &Path, silkd: &Path, launcher: &Path) {
    let cfg = silk_engine::jail::JailConfig::new(engine_dir, silkd, launcher);
    if let Err(e) = silk_engine::jail::remove_all(cfg) {
        eprintln!("removing the sandboxes under {}: {e}", engine_dir.display());
    }
    if let Some(data) = engine_dir.parent() {
        silk_engine::jail::unmount_under(data);
    }
}

/// One HTTP/1.1 request on a fresh connection; the body is parsed as JSON when it is JSON
/// (else returned as a string).
pub fn http(
    addr: SocketAddr,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: Option<&str>,
    content_type: &str,
) -> (u16, Value) {
    try_http(addr, method, path, token, body, content_type)
        .unwrap_or_else(|| panic!("{method} {path}: the node dropped the connection"))
}

/// Like [`http`], but a connection the server drops (a crash) is `None` instead of a panic.
pub fn try_http(
    addr: SocketAddr,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: Option<&str>,
    content_type: &str,
) -> Option<(u16, Value)> {
    let s = TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(60))).ok()?;
    exchange(s, &addr.to_string(), method, path, token, body, content_type)
}

/// Trust for [`https`]: the CA certificates in a PEM file.
pub fn tls_client(ca_pem: &Path) -> std::sync::Arc<rustls::ClientConfig> {
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls::pki_types::CertificateDer::pem_file_iter(ca_pem).expect("a CA file") {
        roots.add(cert.expect("a PEM certificate")).expect("a CA certificate");
    }
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("TLS versions")
        .with_root_certificates(roots)
        .with_no_client_auth();
    std::sync::Arc::new(config)
}

/// [`http`] over TLS to `addr`, checking its certificate names `name` (a DNS name or IP).
#[allow(clippy::too_many_arguments)]
pub fn https(
    tls: &std::sync::Arc<rustls::ClientConfig>,
    name: &str,
    addr: SocketAddr,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: Option<&str>,
) -> (u16, Value) {
    let server = rustls::pki_types::ServerName::try_from(name.to_string()).expect("a server name");
    let conn = rustls::ClientConnection::new(tls.clone(), server).expect("a TLS client");
    let tcp = TcpStream::connect(addr).unwrap_or_else(|e| panic!("connect {addr}: {e}"));
    tcp.set_read_timeout(Some(Duration::from_secs(60))).expect("a timeout");
    let stream = rustls::StreamOwned::new(conn, tcp);
    exchange(stream, name, method, path, token, body, "application/json")
        .unwrap_or_else(|| panic!("{method} https://{name}{path}: no answer"))
}

/// One request on `s` and the whole answer (`Connection: close`).
fn exchange(
    mut s: impl Read + Write,
    host: &str,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: Option<&str>,
    content_type: &str,
) -> Option<(u16, Value)> {
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n");
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
    s.write_all(head.as_bytes()).ok()?;
    s.write_all(body.as_bytes()).ok()?;
    s.flush().ok()?;
    let mut raw = Vec::new();
    // A TLS peer that closes without close_notify still gave a whole answer (Connection:
    // close): keep what arrived.
    if let Err(e) = s.read_to_end(&mut raw)
        && (raw.is_empty() || e.kind() != std::io::ErrorKind::UnexpectedEof)
    {
        return None;
    }
    let text = String::from_utf8_lossy(&raw);
    let (head, rest) = text.split_once("\r\n\r\n")?;
    let status: u16 = head.split_whitespace().nth(1)?.parse().ok()?;
    Some((status, serde_json::from_str(rest).unwrap_or(Value::String(rest.to_string()))))
}

/// Polls `cond` (an explicit check, not a timing) until it holds, for at most 30 s.
pub fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    for _ in 0..3000 {
        if cond() {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!("timed out waiting for: {what}");
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
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos()
    );
    format!(
        "[store.s3]\nbucket = \"{}\"\nregion = \"{}\"\nendpoint = \"{}\"\npath_style = true\nprefix = \"{prefix}\"\n",
        var("SILK_S3_BUCKET"),
        var("SILK_S3_REGION"),
        var("SILK_S3_ENDPOINT")
    )
}
