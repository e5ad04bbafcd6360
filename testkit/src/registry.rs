//! A real OCI registry on loopback for tests: Debian's `docker-registry` (distribution 2.8,
//! installed by scripts/install-test-deps) in a temporary directory, one process per
//! [`Registry`], plain HTTP, anonymous or behind basic or token auth. Images go in with `skopeo`
//! (built by [`crate::images`]); what a client then fetched is read back from the registry's
//! own request log.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use base64::Engine;
use serde_json::Value;

mod token;

/// Who may use a [`Registry`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Auth {
    Anonymous,
    /// `htpasswd` (bcrypt) basic auth. Distribution 2.8 accepts it over plain HTTP.
    Basic {
        user: String,
        password: String,
    },
    /// Bearer tokens from a token server the harness runs beside the registry.
    Token {
        user: String,
        password: String,
    },
}

/// A running registry; dropping it kills the registry (and its token server) and removes its
/// files.
#[derive(Debug)]
pub struct Registry {
    addr: SocketAddr,
    auth: Auth,
    /// Config, storage, log, password file and token certificate.
    dir: tempfile::TempDir,
    child: Option<Child>,
    token: Option<token::TokenServer>,
    /// Numbers the marker requests of [`Registry::blob_gets`].
    syncs: AtomicUsize,
}

impl Registry {
    /// Starts `docker-registry serve` on `ip` (a 127.0.0.x address) and a free port, storage on
    /// the filesystem in a temporary directory, and waits until `GET /v2/` answers (200, or 401
    /// behind auth).
    pub fn start(ip: &str, auth: Auth) -> Registry {
        let dir = tempfile::tempdir().expect("a temporary directory for the registry");
        let (auth_yaml, token) = match &auth {
            Auth::Anonymous => (String::new(), None),
            Auth::Basic { user, password } => {
                let out = Command::new("htpasswd")
                    .args(["-Bbn", user, password])
                    .output()
                    .expect("htpasswd (apache2-utils): run scripts/install-test-deps");
                assert!(out.status.success(), "htpasswd: {}", String::from_utf8_lossy(&out.stderr));
                let file = dir.path().join("htpasswd");
                std::fs::write(&file, out.stdout).expect("writing the htpasswd file");
                let yaml = format!(
                    "auth:\n  htpasswd:\n    realm: silk-test\n    path: {}\n",
                    file.display()
                );
                (yaml, None)
            }
            Auth::Token { user, password } => {
                let cert = dir.path().join("token-cert.pem");
                let server = token::TokenServer::start(ip, user, password, &cert);
                let yaml = format!(
                    "auth:\n  token:\n    realm: {}\n    service: {}\n    issuer: {}\n    rootcertbundle: {}\n",
                    server.realm(),
                    token::SERVICE,
                    token::ISSUER,
                    cert.display()
                );
                (yaml, Some(server))
            }
        };
        let log = dir.path().join("registry.log");
        // The port is found free, then bound by the registry: another process can take it in
        // between, so a registry that could not bind is started again on another.
        for _ in 0..5 {
            let probe = TcpListener::bind((ip, 0)).unwrap_or_else(|e| panic!("binding {ip}: {e}"));
            let addr = probe.local_addr().expect("a local address");
            drop(probe);
            let config = dir.path().join("config.yml");
            std::fs::write(&config, config_yaml(addr, &dir.path().join("storage"), &auth_yaml))
                .expect("writing the registry config");
            let out = std::fs::File::create(&log).expect("creating the registry log");
            let mut child = Command::new("docker-registry")
                .arg("serve")
                .arg(&config)
                .stdin(Stdio::null())
                .stdout(out.try_clone().expect("a log handle"))
                .stderr(out)
                .spawn()
                .expect("docker-registry: run scripts/install-test-deps");
            if wait_ready(&mut child, addr) {
                let child = Some(child);
                return Registry { addr, auth, dir, child, token, syncs: AtomicUsize::new(0) };
            }
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            assert!(text.contains("address already in use"), "the registry did not start:\n{text}");
        }
        panic!("the registry found no free port on {ip}");
    }

    /// `127.0.0.x:PORT`: the host part of an image reference.
    pub fn host(&self) -> String {
        self.addr.to_string()
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `GET path` (e.g. `/v2/NAME/manifests/TAG`) with `Accept: accept`, authenticated as the
    /// registry's user when it has auth (a token for `repository:NAME:pull`, which counts in
    /// [`Registry::token_requests`]). Returns the status and body.
    pub fn get(&self, path: &str, accept: &str) -> (u16, Vec<u8>) {
        let auth = match &self.auth {
            Auth::Anonymous => None,
            Auth::Basic { user, password } => Some(format!("Basic {}", basic_auth(user, password))),
            Auth::Token { .. } => {
                let name = repository(path).unwrap_or_else(|| panic!("no repository in {path}"));
                let token = self.token.as_ref().expect("a token server");
                Some(format!("Bearer {}", token.token(&format!("repository:{name}:pull"))))
            }
        };
        let mut headers = vec![("Accept", accept)];
        if let Some(a) = &auth {
            headers.push(("Authorization", a));
        }
        http_get(self.addr, path, &headers)
    }

    /// Pushes a docker-archive (`docker save`) tarball as `<host>/<repo_tag>` with skopeo and
    /// returns the pushed manifest's digest. Layers go gzip-compressed in a Docker schema 2
    /// manifest, or, with `zstd`, zstd-compressed in an OCI manifest
    /// (`application/vnd.oci.image.layer.v1.tar+zstd`).
    pub fn push_archive(&self, archive: &Path, repo_tag: &str, zstd: bool) -> String {
        let mut args: Vec<String> = Vec::new();
        if zstd {
            // skopeo 1.9 compresses to the asked format only with --dest-compress too, and
            // writes zstd layers only in an OCI manifest.
            args.extend(
                ["--format", "oci", "--dest-compress", "--dest-compress-format", "zstd"]
                    .map(String::from),
            );
        }
        args.push(format!("docker-archive:{}", archive.display()));
        self.skopeo_copy(args, repo_tag)
    }

    /// Pushes every image of an OCI layout directory's index (`skopeo copy --all`, the layout's
    /// one entry being an image index) and returns the index's digest.
    pub fn push_oci_layout(&self, layout: &Path, repo_tag: &str) -> String {
        self.skopeo_copy(vec!["--all".into(), format!("oci:{}", layout.display())], repo_tag)
    }

    /// `skopeo copy <args…> docker://<host>/<repo_tag>`; the pushed manifest's digest.
    fn skopeo_copy(&self, args: Vec<String>, repo_tag: &str) -> String {
        let work = tempfile::tempdir().expect("a temporary directory for skopeo");
        let digest_file = work.path().join("digest");
        let mut cmd = Command::new("skopeo");
        cmd.args(["copy", "--quiet", "--insecure-policy", "--dest-tls-verify=false"])
            .arg("--digestfile")
            .arg(&digest_file);
        match &self.auth {
            Auth::Anonymous => {}
            Auth::Basic { user, password } | Auth::Token { user, password } => {
                cmd.arg("--dest-creds").arg(format!("{user}:{password}"));
            }
        }
        // skopeo (as root) remembers in /var/lib/containers/cache which compressed blobs it
        // pushed where, and 1.9 then reuses one whatever compression was asked: a zstd push
        // after a gzip push of the same layer would send the gzip blob. A blob-info cache of its
        // own per push (its rootless location, under XDG_DATA_HOME) leaves it nothing to reuse.
        cmd.env("_CONTAINERS_ROOTLESS_UID", "65534")
            .env("XDG_DATA_HOME", work.path())
            .env("XDG_RUNTIME_DIR", work.path())
            .env("XDG_CONFIG_HOME", work.path());
        cmd.args(&args).arg(format!("docker://{}/{repo_tag}", self.host()));
        let out = cmd.output().expect("skopeo: run scripts/install-test-deps");
        assert!(
            out.status.success(),
            "skopeo copy {args:?} to {repo_tag}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let digest = std::fs::read_to_string(&digest_file).expect("skopeo's digest file");
        let digest = digest.trim().to_string();
        assert!(digest.starts_with("sha256:"), "skopeo's digest {digest:?}");
        digest
    }

    /// The blob digests the registry served to `GET /v2/<name>/blobs/<digest>` (status 200, 206
    /// or 307), in the order its log has them. HEAD requests and uploads do not count.
    pub fn blob_gets(&self) -> Vec<String> {
        self.sync_log();
        let log = std::fs::read_to_string(self.dir.path().join("registry.log")).unwrap_or_default();
        log.lines()
            .filter_map(|line| serde_json::from_str::<Value>(line).ok())
            .filter(|v| v["msg"] == "response completed" && v["http.request.method"] == "GET")
            .filter(|v| matches!(v["http.response.status"].as_u64(), Some(200 | 206 | 307)))
            .filter_map(|v| {
                let uri = v["http.request.uri"].as_str()?;
                let path = uri.split('?').next()?;
                let (name, digest) = path.strip_prefix("/v2/")?.rsplit_once("/blobs/")?;
                (!name.is_empty() && digest.starts_with("sha256:")).then(|| digest.to_string())
            })
            .collect()
    }

    /// The registry logs a request once it has written the answer, so a client can hold a whole
    /// blob a moment before its line is in the log. A marker request made now and seen in the
    /// log puts what was served before it there too (answered or refused, every request is
    /// logged with its URI).
    fn sync_log(&self) {
        if self.child.is_none() {
            return; // stopped: its log is complete
        }
        let n = self.syncs.fetch_add(1, Ordering::SeqCst);
        let marker = format!("/v2/?silk-log-sync={n}");
        if try_http_get(self.addr, &marker, &[]).is_none() {
            return; // not answering (it died): nothing more will reach its log
        }
        let log = self.dir.path().join("registry.log");
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if std::fs::read_to_string(&log).unwrap_or_default().contains(&format!("\"{marker}\""))
            {
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        panic!("the registry never logged {marker}");
    }

    /// Overwrites the stored bytes of blob `digest` (`sha256:…`) with as many different ones, so
    /// the registry serves content that no longer matches its digest.
    pub fn corrupt_blob(&self, digest: &str) {
        let hex = digest.strip_prefix("sha256:").unwrap_or_else(|| panic!("not sha256: {digest}"));
        let path = self
            .dir
            .path()
            .join(format!("storage/docker/registry/v2/blobs/sha256/{}/{hex}/data", &hex[..2]));
        let mut data = std::fs::read(&path)
            .unwrap_or_else(|e| panic!("blob {digest} is not stored ({}): {e}", path.display()));
        for b in &mut data {
            *b ^= 0xff;
        }
        std::fs::write(&path, data).expect("rewriting the blob");
    }

    /// Kills the registry: its address then refuses connections (the port is left unused).
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Requests the token server has had (0 without token auth).
    pub fn token_requests(&self) -> usize {
        self.token.as_ref().map_or(0, token::TokenServer::requests)
    }

    /// Where the registry keeps its files (its log is `registry.log`).
    pub fn dir(&self) -> PathBuf {
        self.dir.path().to_path_buf()
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        self.stop();
    }
}

fn config_yaml(addr: SocketAddr, storage: &Path, auth: &str) -> String {
    // The json formatter at info level logs every request ("response completed", with
    // http.request.method/uri and http.response.status), which is what blob_gets reads; the
    // Apache-style access log would only repeat it.
    format!(
        "version: 0.1
log:
  level: info
  formatter: json
  accesslog:
    disabled: true
storage:
  filesystem:
    rootdirectory: {}
  maintenance:
    uploadpurging:
      enabled: false
http:
  addr: {addr}
  secret: silk-test-registry-secret
{auth}",
        storage.display()
    )
}

/// Until `GET /v2/` answers (200, or 401 behind auth); false when the process ended first.
fn wait_ready(child: &mut Child, addr: SocketAddr) -> bool {
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        if child.try_wait().expect("the registry's status").is_some() {
            return false;
        }
        if let Some((200 | 401, _)) = try_http_get(addr, "/v2/", &[]) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
    panic!("the registry on {addr} did not answer in 20 s");
}

/// NAME in `/v2/NAME/manifests/…`, `/v2/NAME/blobs/…` or `/v2/NAME/tags/…`.
fn repository(path: &str) -> Option<&str> {
    let rest = path.strip_prefix("/v2/")?;
    ["/manifests/", "/blobs/", "/tags/"].iter().find_map(|m| rest.rsplit_once(m)).map(|(n, _)| n)
}

/// One `GET` on a fresh connection (`Connection: close`): the status and body.
pub(crate) fn http_get(addr: SocketAddr, path: &str, headers: &[(&str, &str)]) -> (u16, Vec<u8>) {
    try_http_get(addr, path, headers)
        .unwrap_or_else(|| panic!("GET http://{addr}{path}: no answer"))
}

fn try_http_get(addr: SocketAddr, path: &str, headers: &[(&str, &str)]) -> Option<(u16, Vec<u8>)> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(30))).ok()?;
    let mut head = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes()).ok()?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).ok()?;
    let end = raw.windows(4).position(|w| w == b"\r\n\r\n")?;
    let status_line = String::from_utf8_lossy(&raw[..end]).to_string();
    let status = status_line.split_whitespace().nth(1)?.parse().ok()?;
    Some((status, raw[end + 4..].to_vec()))
}

/// `user:password` in base64: a docker `config.json`'s `auth`, and HTTP basic auth.
pub fn basic_auth(user: &str, password: &str) -> String {
    base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"))
}
