//! Harness: a real sandboxd process (real jail engine, static silkd from `SILKD_STATIC`) on
//! 127.0.0.1, launched and cleaned up by `silk-testkit` as the node's tests do, plus helpers
//! shared by the SDK and CLI tests: a tree hash, a bounded wait and a fake HTTP server.
#![allow(dead_code, unused_imports)]

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

pub const ROOT: &str = "root-token-for-sdk-tests";
pub const ONE_WARM: &str = "[[pools]]\ntemplate = \"host\"\nwarm = 1\nwarm_max = 2\n";

pub use silk_testkit::{sibling, static_silkd};

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
        let launch = silk_testkit::Launch::new(ROOT, extra);
        Sandboxd(silk_testkit::Node::start(launch).expect("the node starts"))
    }

    pub fn client(&self) -> silkmesh::Client {
        silkmesh::Client::builder(self.url()).token(ROOT).build().unwrap()
    }
}

/// A small tree with nested directories, an empty directory, an executable, a symlink and a
/// file of several data chunks, for push/pull and cp round trips.
pub fn make_tree(root: &Path) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(root.join("src/deep/er")).unwrap();
    std::fs::create_dir_all(root.join("empty")).unwrap();
    std::fs::write(root.join("README"), "hello tree\n").unwrap();
    std::fs::write(root.join("src/main.rs"), "fn main() {}\n").unwrap();
    let big: Vec<u8> =
        (0..(700 * 1024u32)).map(|i| (i.wrapping_mul(2654435761) >> 13) as u8).collect();
    std::fs::write(root.join("src/deep/er/blob.bin"), big).unwrap();
    std::fs::write(root.join("run.sh"), "#!/bin/sh\necho ran\n").unwrap();
    std::fs::set_permissions(root.join("run.sh"), std::fs::Permissions::from_mode(0o755)).unwrap();
    std::os::unix::fs::symlink("src/main.rs", root.join("link")).unwrap();
}

/// A hash of a tree: relative paths, kinds, permission bits, contents and symlink targets.
pub fn tree_hash(root: &Path) -> String {
    use std::os::unix::fs::PermissionsExt;
    let mut h = blake3::Hasher::new();
    let mut entries: Vec<_> = walkdir::WalkDir::new(root)
        .min_depth(1)
        .follow_links(false)
        .into_iter()
        .map(|e| e.unwrap())
        .collect();
    entries.sort_by(|a, b| a.path().cmp(b.path()));
    for e in entries {
        let rel = e.path().strip_prefix(root).unwrap();
        let meta = e.path().symlink_metadata().unwrap();
        h.update(rel.to_string_lossy().as_bytes());
        h.update(b"\0");
        if meta.file_type().is_symlink() {
            h.update(b"L");
            h.update(std::fs::read_link(e.path()).unwrap().to_string_lossy().as_bytes());
        } else if meta.is_dir() {
            h.update(b"D");
        } else {
            h.update(format!("F{:o}", meta.permissions().mode() & 0o777).as_bytes());
            h.update(&std::fs::read(e.path()).unwrap());
        }
        h.update(b"\0");
    }
    h.finalize().to_hex().to_string()
}

/// Polls `cond` (an explicit check, not a timing) until it holds, for at most 30 s.
pub async fn eventually<F, Fut>(what: &str, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    for _ in 0..3000 {
        if cond().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("timed out waiting for: {what}");
}

/// One request a [`FakeHttp`] received.
#[derive(Debug, Clone)]
pub struct Seen {
    /// `METHOD target HTTP/1.1`.
    pub line: String,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl Seen {
    pub fn target(&self) -> &str {
        self.line.split(' ').nth(1).unwrap_or("")
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }
}

/// A tiny HTTP/1.1 server for redirect tests: records each request and writes the raw response
/// `answer` returns, then closes the connection.
pub struct FakeHttp {
    pub addr: SocketAddr,
    seen: std::sync::Arc<std::sync::Mutex<Vec<Seen>>>,
    task: tokio::task::JoinHandle<()>,
}

impl FakeHttp {
    pub async fn start(answer: impl Fn(&Seen) -> String + Send + Sync + 'static) -> FakeHttp {
        use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let answer = std::sync::Arc::new(answer);
        let log = seen.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((socket, _)) = listener.accept().await else { return };
                let (log, answer) = (log.clone(), answer.clone());
                tokio::spawn(async move {
                    let mut reader = tokio::io::BufReader::new(socket);
                    let mut line = String::new();
                    if reader.read_line(&mut line).await.unwrap_or(0) == 0 {
                        return;
                    }
                    let mut headers = vec![];
                    loop {
                        let mut h = String::new();
                        reader.read_line(&mut h).await.unwrap();
                        let h = h.trim_end();
                        if h.is_empty() {
                            break;
                        }
                        let (k, v) = h.split_once(':').unwrap();
                        headers.push((k.trim().to_string(), v.trim().to_string()));
                    }
                    let len = headers
                        .iter()
                        .find(|(k, _)| k.eq_ignore_ascii_case("content-length"))
                        .map_or(0, |(_, v)| v.parse().unwrap());
                    let mut body = vec![0; len];
                    reader.read_exact(&mut body).await.unwrap();
                    let req = Seen {
                        line: line.trim_end().to_string(),
                        headers,
                        body: String::from_utf8(body).unwrap(),
                    };
                    let response = answer(&req);
                    log.lock().unwrap().push(req);
                    let mut socket = reader.into_inner();
                    let _ = socket.write_all(response.as_bytes()).await;
                    let _ = socket.shutdown().await;
                });
            }
        });
        FakeHttp { addr, seen, task }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }
}

impl Drop for FakeHttp {
    fn drop(&mut self) {
        self.task.abort();
    }
}
