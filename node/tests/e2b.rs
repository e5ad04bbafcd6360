//! E2B's API on a real node: the stock e2b Python SDK (a venv made by scripts/e2b-venv, which
//! scripts/test runs and names in `E2B_PYTHON`), sync and async, creates, runs commands, moves
//! files, watches, lists, pauses, connects and kills through it; the stock JavaScript SDK
//! (scripts/e2b-js, `E2B_JS_MODULES`) runs a smoke script; and the listener refuses callers
//! without the key or a sandbox's access token, answering in E2B's error shape.

mod common;

use std::net::SocketAddr;
use std::process::Command;

use common::*;

fn python() -> String {
    std::env::var("E2B_PYTHON").expect(
        "E2B_PYTHON is not set: run the suite through scripts/test (scripts/e2b-venv makes it)",
    )
}

/// A node with E2B's API on a port of its own; its address.
fn node_with_e2b() -> (Sandboxd, SocketAddr) {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let e2b: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let node = Sandboxd::start(&format!(
        "[[pools]]\ntemplate = \"host\"\nwarm = 1\n[e2b]\nlisten = \"{e2b}\"\n"
    ));
    (node, e2b)
}

/// Runs one of the SDK scripts in tests/e2b/ with `program` against a fresh node, pointed at it
/// as a user would (`E2B_API_URL`, `E2B_SANDBOX_URL`, `E2B_API_KEY`); it must print `done` and
/// leave no sandbox behind.
fn run_sdk_script(program: &str, script: &str, env: &[(&str, String)]) {
    let (node, e2b) = node_with_e2b();
    node.wait_warm(1);
    let url = format!("http://{e2b}");
    let out = Command::new(program)
        .arg(format!("{}/tests/e2b/{script}", env!("CARGO_MANIFEST_DIR")))
        .env("E2B_API_URL", &url)
        .env("E2B_SANDBOX_URL", &url)
        .env("E2B_API_KEY", ROOT)
        .env("NO_PROXY", "127.0.0.1")
        .envs(env.iter().map(|(k, v)| (k, v)))
        .env_remove("HTTP_PROXY")
        .env_remove("HTTPS_PROXY")
        .env_remove("http_proxy")
        .env_remove("https_proxy")
        .output()
        .unwrap();
    let (stdout, stderr) =
        (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && stdout.contains("done"), "{}\n{stdout}\n{stderr}", out.status);
    assert_eq!(
        node.req("GET", "/v1/sandboxes", Some(ROOT), None).1["sandboxes"],
        serde_json::json!([]),
        "everything it made is gone"
    );
}

#[test]
fn the_stock_python_sdk_drives_sandboxes() {
    run_sdk_script(&python(), "sdk_sync.py", &[]);
}

#[test]
fn the_async_python_sdk_streams_watches_and_input() {
    run_sdk_script(&python(), "sdk_async.py", &[]);
}

#[test]
fn the_stock_javascript_sdk_runs_a_smoke_script() {
    let modules = std::env::var("E2B_JS_MODULES").expect(
        "E2B_JS_MODULES is not set: run the suite through scripts/test (scripts/e2b-js makes it)",
    );
    run_sdk_script("node", "sdk_smoke.cjs", &[("NODE_PATH", modules)]);
}

/// One HTTP/1.1 request; the status and the JSON answer (`null` when there is none).
fn call(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: impl AsRef<[u8]>,
) -> (u16, serde_json::Value) {
    use std::io::{Read, Write};
    let body = body.as_ref();
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n");
    for (k, v) in headers {
        head += &format!("{k}: {v}\r\n");
    }
    if !headers.iter().any(|(k, _)| k.eq_ignore_ascii_case("content-type")) {
        head += "Content-Type: application/json\r\n";
    }
    head += &format!("Content-Length: {}\r\n\r\n", body.len());
    s.write_all(head.as_bytes()).unwrap();
    s.write_all(body).unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).unwrap();
    let (head, body) = raw.split_once("\r\n\r\n").unwrap();
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    (status, serde_json::from_str(body).unwrap_or(serde_json::Value::Null))
}

#[test]
fn callers_without_the_key_or_the_access_token_are_refused() {
    let (node, e2b) = node_with_e2b();
    let body = r#"{"templateID":"base","metadata":{},"envVars":{}}"#;
    let create = |key: &str| call(e2b, "POST", "/v2/sandboxes", &[("X-API-Key", key)], body);
    let (status, v) = create("wrong");
    assert_eq!((status, &v["code"]), (401, &serde_json::json!(401)), "{v}");
    assert!(v["message"].is_string());
    let (_, listed) = node.req("GET", "/v1/sandboxes", Some(ROOT), None);
    assert!(listed["sandboxes"].as_array().unwrap().is_empty(), "{listed}");

    let (status, v) = create(ROOT);
    assert_eq!(status, 201, "{v}");
    let (id, token) = (v["sandboxID"].as_str().unwrap(), v["envdAccessToken"].as_str().unwrap());
    assert_eq!((v["templateID"].as_str(), v["envdVersion"].is_string()), (Some("base"), true));

    // envd: the sandbox's own token stats a path; none, a forged one, the root token or a
    // native sandbox token do not.
    let stat = |token: &str| {
        let headers = [("E2b-Sandbox-Id", id), ("X-Access-Token", token)];
        call(e2b, "POST", "/filesystem.Filesystem/Stat", &headers, r#"{"path":"/"}"#)
    };
    let (status, v) = stat(token);
    assert_eq!((status, v["entry"]["type"].as_str()), (200, Some("FILE_TYPE_DIRECTORY")), "{v}");
    let forged = format!("ea_{}", "0".repeat(64));
    let other = node.claim("{}");
    let native = other["token"].as_str().unwrap();
    for bad in ["", "sbt_x", forged.as_str(), ROOT, native] {
        let (status, v) = stat(bad);
        assert_eq!(status, 401, "{bad:?}: {v}");
    }
    // Another sandbox's id with this one's token: refused, without saying whether it exists.
    let headers = [("E2b-Sandbox-Id", other["id"].as_str().unwrap()), ("X-Access-Token", token)];
    assert_eq!(call(e2b, "GET", "/health", &headers, "").0, 401);
    let headers = [("E2b-Sandbox-Id", "sb-none"), ("X-Access-Token", token)];
    assert_eq!(call(e2b, "GET", "/health", &headers, "").0, 401);

    // What is not served says so, in E2B's shape.
    let (status, v) =
        call(e2b, "GET", &format!("/sandboxes/{id}/metrics"), &[("X-API-Key", ROOT)], "");
    assert_eq!((status, &v["code"]), (501, &serde_json::json!(501)), "{v}");

    // A sandbox that is gone, with its own token: the SDK's "not running" (502, "was not
    // found").
    let (status, _) = call(e2b, "DELETE", &format!("/sandboxes/{id}"), &[("X-API-Key", ROOT)], "");
    assert_eq!(status, 204);
    let headers = [("E2b-Sandbox-Id", id), ("X-Access-Token", token)];
    let (status, v) = call(e2b, "GET", "/health", &headers, "");
    assert_eq!(status, 502, "{v}");
    assert!(v["message"].as_str().unwrap().contains("was not found"), "{v}");

    // Each of those calls is in the audit journal, with who made it.
    let (_, audit) = node.req("GET", "/v1/audit", Some(ROOT), None);
    let entries = audit["entries"].as_array().unwrap();
    let has = |action: &str, principal: &str, status: u64| {
        entries
            .iter()
            .any(|e| e["action"] == action && e["principal"] == principal && e["status"] == status)
    };
    assert!(has("e2b.create", "anonymous", 401), "{audit:#}");
    assert!(has("e2b.create", "root", 201), "{audit:#}");
    assert!(has("e2b.Stat", &format!("sandbox:{id}"), 200), "{audit:#}");
    assert!(has("e2b.Stat", "anonymous", 401), "{audit:#}");
    assert!(has("e2b.kill", "root", 204), "{audit:#}");
}

/// An upload that is not whole (a body that is not gzip, one cut short, an encoding not served)
/// is refused and leaves the file as it was; a whole gzip body is written decompressed.
#[test]
fn bad_uploads_are_refused_and_keep_the_old_file() {
    use std::io::Write as _;
    let (_node, e2b) = node_with_e2b();
    let body = r#"{"templateID":"base"}"#;
    let (status, v) = call(e2b, "POST", "/sandboxes", &[("X-API-Key", ROOT)], body);
    assert_eq!(status, 201, "{v}");
    let (id, token) = (v["sandboxID"].as_str().unwrap(), v["envdAccessToken"].as_str().unwrap());
    let envd = [("E2b-Sandbox-Id", id), ("X-Access-Token", token)];
    let write = |encoding: Option<&str>, body: &[u8]| {
        let mut headers = envd.to_vec();
        headers.push(("Content-Type", "application/octet-stream"));
        headers.extend(encoding.map(|e| ("Content-Encoding", e)));
        call(e2b, "POST", "/files?path=/tmp/f", &headers, body)
    };
    let size = || {
        let (_, v) =
            call(e2b, "POST", "/filesystem.Filesystem/Stat", &envd, r#"{"path":"/tmp/f"}"#);
        v["entry"]["size"].as_str().unwrap().to_string()
    };
    assert_eq!(write(None, b"old").0, 200);
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    gz.write_all(&b"new content ".repeat(10_000)).unwrap();
    let gz = gz.finish().unwrap();
    for (encoding, bad) in
        [("gzip", b"not gzip at all".as_slice()), ("gzip", &gz[..gz.len() - 4]), ("br", &gz)]
    {
        let (status, v) = write(Some(encoding), bad);
        assert_eq!(status, 400, "{encoding}, {} bytes: {v}", bad.len());
        assert_eq!(size(), "3", "the old file is kept");
    }
    assert_eq!(write(Some("gzip"), &gz).0, 200);
    assert_eq!(size(), "120000");
}

#[test]
fn a_tenant_sees_and_reaches_only_its_own_sandboxes_and_snapshots() {
    let (node, e2b) = node_with_e2b();
    let tenant = |name: &str| {
        let body = serde_json::json!({ "name": name, "max_sandboxes": 4, "max_checkpoints": 2,
            "max_store_bytes": 1u64 << 40 });
        let (status, v) = node.req("POST", "/v1/tenants", Some(ROOT), Some(&body.to_string()));
        assert_eq!(status, 201, "{v}");
        v["api_key"].as_str().unwrap().to_string()
    };
    let (k1, k2) = (tenant("team-1"), tenant("team-2"));
    let as_ = |key: &str, method: &str, path: &str, body: &str| {
        call(e2b, method, path, &[("X-API-Key", key)], body)
    };
    let body = r#"{"templateID":"base","metadata":{},"envVars":{}}"#;
    let (status, v) = as_(&k1, "POST", "/v2/sandboxes", body);
    assert_eq!(status, 201, "{v}");
    let id = v["sandboxID"].as_str().unwrap().to_string();
    let (status, snap) = as_(&k1, "POST", &format!("/sandboxes/{id}/snapshots"), "{}");
    assert_eq!(status, 201, "{snap}");
    let snap = snap["snapshotID"].as_str().unwrap().to_string();

    // The other tenant's key: every call on them is the same 404 as for nothing at all.
    for (method, path, body) in [
        ("GET", format!("/sandboxes/{id}"), ""),
        ("POST", format!("/sandboxes/{id}/pause"), ""),
        ("POST", format!("/v2/sandboxes/{id}/connect"), "{}"),
        ("POST", format!("/sandboxes/{id}/timeout"), r#"{"timeout": 60}"#),
        ("POST", format!("/sandboxes/{id}/fork"), "{}"),
        ("POST", format!("/sandboxes/{id}/snapshots"), "{}"),
        ("DELETE", format!("/templates/{snap}"), ""),
        ("DELETE", format!("/sandboxes/{id}"), ""),
    ] {
        let (status, v) = as_(&k2, method, &path, body);
        assert_eq!(status, 404, "{method} {path}: {v}");
    }
    let from_snap = format!(r#"{{"templateID":"{snap}","metadata":{{}},"envVars":{{}}}}"#);
    assert_eq!(as_(&k2, "POST", "/v2/sandboxes", &from_snap).0, 404);
    assert_eq!(as_(&k2, "GET", "/v2/sandboxes", "").1, serde_json::json!([]));
    assert_eq!(as_(&k2, "GET", "/snapshots", "").1, serde_json::json!([]));

    // Its own tenant, and root, still have them.
    assert_eq!(as_(&k1, "GET", "/v2/sandboxes", "").1.as_array().unwrap().len(), 1);
    assert_eq!(as_(&k1, "GET", &format!("/sandboxes/{id}"), "").0, 200);
    let (status, v) = as_(&k1, "POST", "/v2/sandboxes", &from_snap);
    assert_eq!(status, 201, "{v}");
    assert_eq!(as_(ROOT, "GET", "/v2/sandboxes", "").1.as_array().unwrap().len(), 2);
}
