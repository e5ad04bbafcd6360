//! What the lifecycle tests (lifecycle.rs, kill9.rs) share: a claimed sandbox, its calls, and
//! a tree of files whose hash says whether it came through intact.
#![allow(dead_code)]

use serde_json::Value;

use super::common::*;

/// A tree with nested directories, modes, a symlink, an empty file, 4 MiB of noise and a
/// deleted template file.
pub const WRITE_TREE: &str = "mkdir -p /srv/t/a/b && echo one > /srv/t/a/one && printf '' > /srv/t/empty \
    && head -c 4194304 /dev/urandom > /srv/t/a/b/noise && chmod 640 /srv/t/a/one \
    && ln -s a/one /srv/t/link && rm /etc/hosts";

/// Everything a user would notice about the tree: paths, types, modes, sizes, link targets and
/// contents.
pub const HASH_TREE: &str = "cd /srv/t && { find . -printf '%p %y %m %s %l\\n' | sort; \
    find . -type f -print0 | sort -z | xargs -0 sha256sum; test -e /etc/hosts && echo hosts; } | sha256sum";

pub struct Box {
    pub id: String,
    pub token: String,
}

pub fn claim(node: &Sandboxd, body: &str) -> Box {
    let v = node.claim(body);
    Box { id: v["id"].as_str().unwrap().into(), token: v["token"].as_str().unwrap().into() }
}

pub fn child(v: &Value) -> Box {
    Box { id: v["id"].as_str().unwrap().into(), token: v["token"].as_str().unwrap().into() }
}

pub fn sh(node: &Sandboxd, b: &Box, script: &str) -> String {
    let v = node.exec(&b.id, &b.token, script);
    assert_eq!(v["exit_code"], 0, "{script}: {v}");
    v["stdout"].as_str().unwrap().trim().to_string()
}

pub fn post(node: &Sandboxd, b: &Box, verb: &str, body: &str) -> (u16, Value) {
    node.req("POST", &format!("/v1/sandboxes/{}/{verb}", b.id), Some(&b.token), Some(body))
}

pub fn state(node: &Sandboxd, b: &Box) -> String {
    let (status, v) = node.req("GET", &format!("/v1/sandboxes/{}", b.id), Some(&b.token), None);
    assert_eq!(status, 200, "{v}");
    v["state"].as_str().unwrap().to_string()
}

pub fn running(node: &Sandboxd, b: &Box) -> bool {
    node.sandbox_processes(&b.id) > 0
}

/// How many files are under `dir`, at any depth (0 when it does not exist).
pub fn files_under(dir: &std::path::Path) -> usize {
    std::fs::read_dir(dir).map_or(0, |entries| {
        entries.flatten().map(|e| if e.path().is_dir() { files_under(&e.path()) } else { 1 }).sum()
    })
}
