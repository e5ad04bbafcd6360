//! The MCP server through a real MCP client: the Python SDK from PyPI (`mcp`, in the venv
//! `scripts/e2b-venv` makes, named by `E2B_PYTHON`) runs `tests/mcp/drive.py` against `sbx mcp`
//! (stdio) and a node's `/mcp` (streamable HTTP): the tools and their schemas, a sandbox's whole
//! life (exec, files, find/replace, git, checkpoint → branch, fork ×2 independent, hibernate →
//! wake, release), tool errors that name the bad field, and another principal's sandbox not
//! found.

mod common;

use std::process::Command;

use common::*;
use serde_json::Value;

fn python() -> String {
    std::env::var("E2B_PYTHON").expect("E2B_PYTHON: run the suite through scripts/test")
}

fn drive(args: &[&str], env: &[(&str, String)]) -> Value {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/mcp/drive.py");
    let mut c = Command::new(python());
    c.arg(script).args(args);
    for (k, v) in env {
        c.env(k, v);
    }
    let out = c.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "drive.py {args:?}: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_str(stdout.lines().last().unwrap_or_default()).unwrap()
}

fn state(node: &Sandboxd, id: &str) -> Option<String> {
    let (status, v) =
        silk_testkit::http(node.addr, "GET", &format!("/v1/sandboxes/{id}"), Some(ROOT), None, "");
    (status == 200).then(|| v["state"].as_str().unwrap().to_string())
}

#[test]
fn sbx_mcp_serves_every_verb_over_stdio_and_releases_what_it_made() {
    let node = Sandboxd::start(ONE_WARM);
    let env = [("SBX_ADDR", node.url()), ("SBX_TOKEN", ROOT.to_string())];
    let seen = drive(&["stdio", env!("CARGO_BIN_EXE_sbx")], &env);
    assert!(seen["progress"].as_u64().unwrap() >= 2, "progress notifications: {seen}");
    // The server ended with its client: what it created (and did not release) went with it,
    // but for what it was asked to keep.
    let left = seen["left"].as_str().unwrap();
    assert_eq!(state(&node, left), None, "released at exit");
    let kept = seen["kept"].as_str().unwrap();
    assert_eq!(state(&node, kept).as_deref(), Some("claimed"), "kept");
}

#[test]
fn a_nodes_mcp_endpoint_acts_with_the_callers_key() {
    let node = Sandboxd::start(ONE_WARM);
    let url = format!("{}/mcp", node.url());
    let seen = drive(&["http", &url, ROOT], &[]);
    assert!(seen["progress"].as_u64().unwrap() >= 2, "{seen}");
    // Stateless: nothing is released for the caller when its requests end.
    let kept = seen["left"].as_str().unwrap();
    assert_eq!(state(&node, kept).as_deref(), Some("claimed"));

    // Another principal (a tenant) sees none of root's sandboxes through it.
    let (status, t) = silk_testkit::http(
        node.addr,
        "POST",
        "/v1/tenants",
        Some(ROOT),
        Some(
            r#"{"name": "other", "max_sandboxes": 2, "max_checkpoints": 1, "max_store_bytes": 1000000}"#,
        ),
        "application/json",
    );
    assert_eq!(status, 201, "{t}");
    let key = t["api_key"].as_str().unwrap();
    let seen = drive(&["foreign", &url, key, kept], &[]);
    assert_eq!(seen["refused"], 4);
    assert_eq!(state(&node, kept).as_deref(), Some("claimed"), "untouched");
    // No key, a wrong key: 401 before any MCP.
    for token in [None, Some("wrong")] {
        let (status, _) =
            silk_testkit::http(node.addr, "POST", "/mcp", token, Some("{}"), "application/json");
        assert_eq!(status, 401);
    }
}
