//! Templates pulled from a real registry (Debian's docker-registry, distribution v2) on loopback,
//! with images pushed to it by skopeo from tarballs built here (silk-testkit): by tag and by
//! digest, zstd layers, a multi-platform index; a tag pinned until refreshed; runtime
//! registration on a two-node fleet sharing one store, the second node taking the layers from the
//! store and not the registry; and every kind of bad image answering its own error, with nothing
//! half-made used.

mod common;

use std::path::Path;

use common::*;
use serde_json::{Value, json};
use silk_testkit::images;
use silk_testkit::registry::{Auth, Registry};

const REFRESH: &str = "tenant_refresh_ms = 200\n";

fn registries(hosts: &[&Registry]) -> String {
    hosts.iter().map(|r| format!("[registries.\"{}\"]\ninsecure = true\n", r.host())).collect()
}

fn push(r: &Registry, dir: &Path, repo_tag: &str, greeting: &str, zstd: bool) -> String {
    let archive = dir.join(format!("{}.tar", repo_tag.replace([':', '/'], "-")));
    images::busybox_archive(&archive, greeting, &[]);
    r.push_archive(&archive, repo_tag, zstd)
}

fn claim(n: &Sandboxd, template: &str) -> (u16, Value) {
    let body = json!({ "template": template, "ttl_seconds": 120 }).to_string();
    n.req("POST", "/v1/sandboxes", Some(ROOT), Some(&body))
}

/// Claims `template` and runs `script` in it.
fn run(n: &Sandboxd, template: &str, script: &str) -> String {
    let (status, v) = claim(n, template);
    assert_eq!(status, 201, "claim {template}: {v}");
    let (id, token) = (v["id"].as_str().unwrap(), v["token"].as_str().unwrap());
    let out = n.exec(id, token, script);
    n.req("DELETE", &format!("/v1/sandboxes/{id}"), Some(token), None);
    out["stdout"].as_str().unwrap().trim().to_string()
}

fn template(n: &Sandboxd, name: &str) -> (u16, Value) {
    n.req("GET", &format!("/v1/templates/{}", name.replace('/', "%2F")), Some(ROOT), None)
}

fn register(n: &Sandboxd, name: &str, image: &str, wait: bool) -> (u16, Value) {
    let body = json!({ "name": name, "image": image }).to_string();
    let path = if wait { "/v1/templates?wait=true" } else { "/v1/templates" };
    n.req("POST", path, Some(ROOT), Some(&body))
}

/// Waits for `cond` no longer than a registered template takes to reach every node.
fn within_bound(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while !cond() {
        assert!(std::time::Instant::now() < deadline, "not within 5 s: {what}");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

fn code(v: &Value) -> &str {
    v["error"]["code"].as_str().unwrap_or("")
}

#[test]
fn configured_refs_pull_by_tag_and_digest_zstd_and_multi_platform_and_tags_stay_pinned() {
    let dir = tempfile::tempdir().unwrap();
    let r = Registry::start("127.0.0.61", Auth::Anonymous);
    let v1 = push(&r, dir.path(), "tiny:v1", "hello v1", false);
    push(&r, dir.path(), "tiny-zstd:v1", "hello zstd", true);
    let layout = dir.path().join("multi");
    images::busybox_index(&layout, &[("linux", "arm64"), ("linux", "amd64")]);
    r.push_oci_layout(&layout, "multi:latest");
    let h = r.host();
    let n = Sandboxd::start(&format!(
        "[templates.tag]\nref = \"{h}/tiny:v1\"\n[templates.digest]\nref = \"{h}/tiny@{v1}\"\n\
         [templates.zstd]\nref = \"{h}/tiny-zstd:v1\"\n[templates.multi]\nref = \"{h}/multi\"\n{}",
        registries(&[&r])
    ));

    let (status, v) = template(&n, "tag");
    assert_eq!(status, 200, "{v}");
    assert_eq!((v["kind"].as_str(), v["status"].as_str()), (Some("configured"), Some("pending")));
    assert_eq!(run(&n, "tag", "echo $GREETING"), "hello v1");
    let (_, v) = template(&n, "tag");
    assert_eq!(v["status"], "ready", "{v}");
    assert_eq!(v["image_digest"], v1.as_str(), "a tag is pinned to the manifest it named");
    assert_eq!(v["bytes_done"], v["bytes_total"]);
    assert_eq!(run(&n, "digest", "echo $GREETING"), "hello v1");
    assert_eq!(
        run(&n, "zstd", "echo $GREETING; cat /etc/passwd | head -1"),
        "hello zstd\nroot:x:0:0:root:/root:/bin/sh"
    );
    assert_eq!(run(&n, "multi", "cat /platform"), "linux/amd64", "the index's amd64 image");

    // A configured name is no name to register.
    let (status, v) = register(&n, "tag", &format!("{h}/tiny:v1"), false);
    assert_eq!((status, code(&v)), (409, "conflict"), "{v}");

    // The tag moves: the template stays on the image it was pinned to until a refresh, its
    // warm sandboxes too; a refresh replaces those.
    let pools = r#"{"pools": [{"template": "tag", "warm": 1}]}"#;
    assert_eq!(n.req("PUT", "/v1/pools", Some(ROOT), Some(pools)).0, 200);
    n.wait_warm(1);
    let v2 = push(&r, dir.path(), "tiny:v1", "hello v2", false);
    assert_ne!(v1, v2);
    assert_eq!(run(&n, "tag", "echo $GREETING"), "hello v1");
    n.wait_warm(1);
    let (status, v) = n.req("POST", "/v1/templates/tag/refresh", Some(ROOT), None);
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["image_digest"], v2.as_str());
    eventually("the refreshed image is pulled", || template(&n, "tag").1["status"] == "ready");
    assert_eq!(run(&n, "tag", "echo $GREETING"), "hello v2", "the old warm sandbox was flushed");
    // A template that is no registry image has nothing to refresh.
    let (status, v) = n.req("POST", "/v1/templates/host/refresh", Some(ROOT), None);
    assert_eq!((status, code(&v)), (409, "conflict"), "{v}");
}

#[test]
fn a_registered_template_runs_on_every_node_and_the_second_takes_its_layers_from_the_store() {
    let dir = tempfile::tempdir().unwrap();
    let auth = Auth::Token { user: "fleet".into(), password: "pull-secret".into() };
    let r = Registry::start("127.0.0.62", auth);
    let digest = push(&r, dir.path(), "agent/base:v4", "hello fleet", false);
    let auth_file = dir.path().join("config.json");
    let basic = silk_testkit::registry::basic_auth("fleet", "pull-secret");
    std::fs::write(&auth_file, json!({ "auths": { r.host(): { "auth": basic } } }).to_string())
        .unwrap();
    let store = dir.path().join("store");
    let cfg = format!(
        "{REFRESH}registry_auth_file = \"{}\"\n{}[store.fs]\nroot = \"{}\"\n",
        auth_file.display(),
        registries(&[&r]),
        store.display()
    );
    let mut a = Sandboxd::start_at("127.0.0.62:0", &cfg);
    let b = Sandboxd::start_at("127.0.0.63:0", &cfg);

    let image = format!("{}/agent/base:v4", r.host());
    let tokens = r.token_requests();
    let (status, v) = register(&a, "base", &image, true);
    assert_eq!(status, 201, "{v}");
    assert_eq!((v["kind"].as_str(), v["status"].as_str()), (Some("registered"), Some("ready")));
    assert_eq!(v["image_digest"], digest.as_str());
    assert!(r.token_requests() > tokens, "the registry's bearer challenge was followed");
    let pulled_once = r.blob_gets();
    assert!(!pulled_once.is_empty());
    assert_eq!(run(&a, "base", "echo $GREETING"), "hello fleet");

    // In force on the other node within the stated bound (the refresh period plus a store round
    // trip; 5 s leaves room for a loaded machine), and pulled there from the store.
    within_bound("b knows the template", || template(&b, "base").0 == 200);
    assert_eq!(run(&b, "base", "echo $GREETING"), "hello fleet");
    let (_, v) = template(&b, "base");
    assert_eq!(v["status"], "ready", "{v}");
    assert_eq!(r.blob_gets(), pulled_once, "b pulled no blob from the registry");

    // A registered template outlives its node's restart (kill -9).
    a.restart();
    assert_eq!(template(&a, "base").0, 200);
    assert_eq!(run(&a, "base", "echo $GREETING"), "hello fleet");

    // Names are the fleet's: a clash is refused, whoever holds the name.
    let (status, v) = register(&b, "base", &image, false);
    assert_eq!((status, code(&v)), (409, "conflict"), "{v}");
    let (status, v) = register(&b, "host", &image, false);
    assert_eq!((status, code(&v)), (409, "conflict"), "{v}");
    let (status, _) = register(&b, "Bad Name", &image, false);
    assert_eq!(status, 400);

    // Deleted on one node: gone from every node, and claims of it are refused.
    let (status, _) = a.req("DELETE", "/v1/templates/base", Some(ROOT), None);
    assert_eq!(status, 204);
    within_bound("b forgets the template", || template(&b, "base").0 == 404);
    let (status, v) = claim(&b, "base");
    assert_eq!((status, code(&v)), (404, "template_not_found"), "{v}");
    // ... and its name is free again.
    let (status, v) = register(&b, "base", &image, false);
    assert_eq!(status, 202, "{v}");
    assert!(matches!(v["status"].as_str(), Some("pending" | "pulling" | "ready")), "{v}");

    // A tenant's template is named under its tenant, and no other tenant's to see or change.
    let key = |name: &str| {
        let body = json!({ "name": name, "max_sandboxes": 4, "max_checkpoints": 4,
            "max_store_bytes": 1u64 << 30 });
        let (status, v) = a.req("POST", "/v1/tenants", Some(ROOT), Some(&body.to_string()));
        assert_eq!(status, 201, "{v}");
        v["api_key"].as_str().unwrap().to_string()
    };
    let (acme, beta) = (key("acme"), key("beta"));
    let body = json!({ "name": "mine", "image": image }).to_string();
    let (status, v) = a.req("POST", "/v1/templates?wait=true", Some(&acme), Some(&body));
    assert_eq!((status, v["name"].as_str()), (201, Some("acme/mine")), "{v}");
    let path = "/v1/templates/acme%2Fmine";
    assert_eq!(a.req("GET", path, Some(&acme), None).0, 200);
    assert_eq!(a.req("GET", path, Some(&beta), None).0, 404);
    assert_eq!(a.req("DELETE", path, Some(&beta), None).0, 404);
    assert_eq!(a.req("POST", &format!("{path}/refresh"), Some(&beta), None).0, 404);
    let claim_as = |key: &str| {
        let body = json!({ "template": "acme/mine", "ttl_seconds": 60 }).to_string();
        a.req("POST", "/v1/sandboxes", Some(key), Some(&body))
    };
    let (status, v) = claim_as(&beta);
    assert_eq!((status, code(&v)), (404, "template_not_found"), "{v}");
    let (status, v) = claim_as(&acme);
    assert_eq!(status, 201, "{v}");
    let (id, token) = (v["id"].as_str().unwrap(), v["token"].as_str().unwrap());
    assert_eq!(a.exec(id, token, "echo $GREETING")["stdout"], "hello fleet\n");
    assert_eq!(a.req("DELETE", path, Some(&acme), None).0, 204);
    // A deleted tenant's registered templates go with it, from the whole fleet.
    let (status, v) = a.req("POST", "/v1/templates", Some(&acme), Some(&body));
    assert_eq!(status, 202, "{v}");
    a.req("DELETE", &format!("/v1/sandboxes/{id}"), Some(token), None);
    within_bound("b knows the tenant's template", || template(&b, "acme/mine").0 == 200);
    let (status, v) = a.req("DELETE", "/v1/tenants/acme?force=true", Some(ROOT), None);
    assert_eq!(status, 204, "{v}");
    assert_eq!(template(&a, "acme/mine").0, 404);
    within_bound("b forgets the tenant's template", || template(&b, "acme/mine").0 == 404);
}

#[test]
fn bad_images_answer_their_own_codes_and_nothing_half_made_is_used() {
    let dir = tempfile::tempdir().unwrap();
    let open = Registry::start("127.0.0.64", Auth::Anonymous);
    let locked = Registry::start(
        "127.0.0.64",
        Auth::Basic { user: "alice".into(), password: "right".into() },
    );
    let mut gone = Registry::start("127.0.0.64", Auth::Anonymous);
    let auth_file = dir.path().join("config.json");
    let wrong = silk_testkit::registry::basic_auth("alice", "wrong");
    std::fs::write(
        &auth_file,
        json!({ "auths": { locked.host(): { "auth": wrong } } }).to_string(),
    )
    .unwrap();
    let n = Sandboxd::start(&format!(
        "max_image_mib = 4\nmax_image_unpacked_mib = 8\nregistry_auth_file = \"{}\"\n{}",
        auth_file.display(),
        registries(&[&open, &locked, &gone])
    ));
    let (o, l, g) = (open.host(), locked.host(), gone.host());
    push(&locked, dir.path(), "private:v1", "secret", false);
    gone.stop();

    let refused = |image: &str, status: u16, want: &str| {
        let (got, v) = register(&n, "bad", image, false);
        assert_eq!((got, code(&v)), (status, want), "{image}: {v}");
        assert_eq!(template(&n, "bad").0, 404, "a refused registration leaves nothing");
    };
    refused(&format!("{o}/nope:v1"), 404, "image_not_found");
    refused(&format!("{l}/private:v1"), 403, "registry_denied");
    refused(&format!("{g}/tiny:v1"), 502, "registry_unavailable");
    refused("docker.io/library/python:3.12", 403, "registry_denied");
    refused("UPPER/Case::bad", 422, "invalid");
    let arm = dir.path().join("arm");
    images::busybox_index(&arm, &[("linux", "arm64")]);
    open.push_oci_layout(&arm, "arm:latest");
    refused(&format!("{o}/arm"), 422, "image_platform");

    // Found and pinned, then refused while pulling or unpacking: the template stays, failed,
    // and a claim of it answers the same error. Nothing of it is in the layer cache or used.
    let failing = |name: &str, image: &str, status: u16, want: &str| {
        let (got, v) = register(&n, name, image, true);
        assert_eq!((got, code(&v)), (status, want), "{image}: {v}");
        let (_, v) = template(&n, name);
        assert_eq!(
            (v["status"].as_str(), v["error"]["code"].as_str()),
            (Some("failed"), Some(want)),
            "{v}"
        );
        let (got, v) = claim(&n, name);
        assert_eq!((got, code(&v)), (status, want), "claim of {name}: {v}");
    };
    let corrupt = dir.path().join("corrupt.tar");
    images::busybox_archive(&corrupt, "corrupt", &[("/big", vec![7; 1 << 20])]);
    let digest = open.push_archive(&corrupt, "corrupt:v1", false);
    let layer = layer_digest(&open, "corrupt", &digest);
    open.corrupt_blob(&layer);
    failing("corrupt", &format!("{o}/corrupt:v1"), 502, "image_digest_mismatch");
    assert!(!n.data().join("layers/sha256").join(&layer[7..]).exists(), "no corrupt blob kept");

    let evil = dir.path().join("evil.tar");
    images::escaping_archive(&evil);
    open.push_archive(&evil, "evil:v1", false);
    failing("evil", &format!("{o}/evil:v1"), 422, "image_unsafe");
    assert!(!Path::new("/tmp/escaped").exists() && !n.data().join("escaped").exists());

    // A decompression bomb: 16 MiB of zeros is a few KiB of gzip, over the 8 MiB unpacked cap.
    let bomb = dir.path().join("bomb.tar");
    images::busybox_archive(&bomb, "bomb", &[("/zeros", vec![0; 16 << 20])]);
    open.push_archive(&bomb, "bomb:v1", false);
    failing("bomb", &format!("{o}/bomb:v1"), 413, "image_too_large");

    // Over max_image_mib as the manifest declares it: 6 MiB that does not compress.
    let huge = dir.path().join("huge.tar");
    let mut noise = vec![0u8; 6 << 20];
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for b in &mut noise {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
    images::busybox_archive(&huge, "huge", &[("/noise", noise)]);
    open.push_archive(&huge, "huge:v1", false);
    failing("huge", &format!("{o}/huge:v1"), 413, "image_too_large");

    // The right password opens the basic-auth registry the wrong one could not.
    let right = dir.path().join("right.json");
    let basic = silk_testkit::registry::basic_auth("alice", "right");
    std::fs::write(&right, json!({ "auths": { l.clone(): { "auth": basic } } }).to_string())
        .unwrap();
    let trusted = Sandboxd::start(&format!(
        "registry_auth_file = \"{}\"\n{}",
        right.display(),
        registries(&[&locked])
    ));
    let (got, v) = register(&trusted, "private", &format!("{l}/private:v1"), true);
    assert_eq!(got, 201, "{v}");
    assert_eq!(run(&trusted, "private", "echo $GREETING"), "secret");

    // The disk reserve: a node that keeps more free space than the disk has pulls nothing.
    let full = Sandboxd::start(&format!("min_free_mib = 1000000000\n{}", registries(&[&open])));
    let (got, v) = register(&full, "tiny", &format!("{o}/corrupt@{digest}"), true);
    assert_eq!((got, code(&v)), (507, "insufficient_storage"), "{v}");
}

/// The digest of the (only) layer of `repo`'s manifest `digest`.
fn layer_digest(r: &Registry, repo: &str, digest: &str) -> String {
    let accept = "application/vnd.docker.distribution.manifest.v2+json";
    let (status, body) = r.get(&format!("/v2/{repo}/manifests/{digest}"), accept);
    assert_eq!(status, 200);
    let m: Value = serde_json::from_slice(&body).unwrap();
    m["layers"][0]["digest"].as_str().unwrap().to_string()
}
