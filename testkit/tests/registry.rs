//! The registry harness against the real thing: each kind of registry takes the test images
//! from skopeo and serves them back, and the harness sees what was fetched.

use serde_json::Value;
use silk_testkit::images;
use silk_testkit::registry::{Auth, Registry};

const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
const DOCKER_MANIFEST: &str = "application/vnd.docker.distribution.manifest.v2+json";

fn manifest(reg: &Registry, name: &str, reference: &str, accept: &str) -> Value {
    let (status, body) = reg.get(&format!("/v2/{name}/manifests/{reference}"), accept);
    assert_eq!(status, 200, "manifest {name}:{reference}: {}", String::from_utf8_lossy(&body));
    serde_json::from_slice(&body).expect("a JSON manifest")
}

/// Pushes the busybox archive gzip then zstd, and the two-platform index; checks what the
/// registry serves and that `blob_gets` sees a blob fetch but no push or HEAD.
fn push_and_fetch(reg: &Registry) {
    let work = tempfile::tempdir().unwrap();
    let archive = work.path().join("busybox.tar");
    images::busybox_archive(
        &archive,
        "hi",
        &[("usr/local/bin/hello", b"#!/bin/sh\necho hello\n".to_vec())],
    );

    let gz = reg.push_archive(&archive, "silk/busybox:gz", false);
    let m = manifest(reg, "silk/busybox", &gz, &format!("{DOCKER_MANIFEST}, {OCI_MANIFEST}"));
    assert_eq!(m["mediaType"], DOCKER_MANIFEST);
    assert_eq!(m["layers"][0]["mediaType"], "application/vnd.docker.image.rootfs.diff.tar.gzip");
    assert!(reg.blob_gets().is_empty(), "skopeo pushes with HEAD and uploads, no blob GET");

    // The same layer again, zstd: a new blob, not the gzip one reused.
    let zstd = reg.push_archive(&archive, "silk/busybox:zstd", true);
    let mz = manifest(reg, "silk/busybox", "zstd", OCI_MANIFEST);
    assert_eq!(mz["mediaType"], OCI_MANIFEST);
    assert_eq!(mz["layers"][0]["mediaType"], "application/vnd.oci.image.layer.v1.tar+zstd");
    assert_ne!(mz["layers"][0]["digest"], m["layers"][0]["digest"]);
    assert_ne!(zstd, gz);

    let layer = mz["layers"][0]["digest"].as_str().unwrap().to_string();
    let (status, blob) = reg.get(&format!("/v2/silk/busybox/blobs/{layer}"), "*/*");
    assert_eq!(status, 200);
    assert_eq!(images::sha256(&blob), layer, "the blob served is the one named");
    assert_eq!(blob[..4], [0x28, 0xb5, 0x2f, 0xfd], "a zstd frame");
    assert_eq!(reg.blob_gets(), [layer.as_str()]);

    // Corrupted in storage: same length, another digest.
    reg.corrupt_blob(&layer);
    let (status, bad) = reg.get(&format!("/v2/silk/busybox/blobs/{layer}"), "*/*");
    assert_eq!((status, bad.len()), (200, blob.len()));
    assert_ne!(images::sha256(&bad), layer);

    let layout = work.path().join("layout");
    images::busybox_index(&layout, &[("linux", "arm64"), ("linux", "amd64")]);
    let index_digest = reg.push_oci_layout(&layout, "silk/multi:latest");
    let index = manifest(reg, "silk/multi", "latest", images::INDEX);
    assert_eq!(index["mediaType"], images::INDEX);
    let (_, raw) = reg.get("/v2/silk/multi/manifests/latest", images::INDEX);
    assert_eq!(images::sha256(&raw), index_digest, "the index's digest is the one returned");
    let platforms: Vec<&str> = index["manifests"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["platform"]["architecture"].as_str().unwrap())
        .collect();
    assert_eq!(platforms, ["arm64", "amd64"]);
    let amd64 = index["manifests"][1]["digest"].as_str().unwrap();
    let image = manifest(reg, "silk/multi", amd64, OCI_MANIFEST);
    let top = image["layers"][1]["digest"].as_str().unwrap();
    let (status, gz_layer) = reg.get(&format!("/v2/silk/multi/blobs/{top}"), "*/*");
    assert_eq!(status, 200);
    assert_eq!(images::sha256(&gz_layer), top);
    assert_eq!(reg.blob_gets(), [layer.clone(), layer, top.to_string()]);
}

#[test]
fn an_anonymous_registry_serves_what_skopeo_pushed() {
    let mut reg = Registry::start("127.0.0.11", Auth::Anonymous);
    assert!(reg.host().starts_with("127.0.0.11:"));
    push_and_fetch(&reg);
    assert_eq!(reg.token_requests(), 0);
    reg.stop();
    assert!(std::net::TcpStream::connect(reg.addr()).is_err(), "a stopped registry refuses");
}

#[test]
fn a_basic_auth_registry_refuses_strangers() {
    let user = "alice".to_string();
    let reg = Registry::start("127.0.0.12", Auth::Basic { user, password: "s3cret".into() });
    push_and_fetch(&reg);
    let (status, _) = curl_status(&reg, "/v2/silk/busybox/tags/list", None);
    assert_eq!(status, 401);
    let (status, _) = curl_status(&reg, "/v2/silk/busybox/tags/list", Some("alice:wrong"));
    assert_eq!(status, 401);
    let (status, body) = curl_status(&reg, "/v2/silk/busybox/tags/list", Some("alice:s3cret"));
    assert_eq!(status, 200, "{body}");
}

#[test]
fn a_token_auth_registry_takes_tokens_from_its_server() {
    let user = "bob".to_string();
    let reg = Registry::start("127.0.0.13", Auth::Token { user, password: "hunter2".into() });
    push_and_fetch(&reg);
    assert!(reg.token_requests() > 0);
    let (status, _) = curl_status(&reg, "/v2/silk/busybox/tags/list", None);
    assert_eq!(status, 401, "no token");
    // The protocol by hand: the challenge names the realm, the realm gives a token.
    let out = curl(&["-si", &format!("http://{}/v2/silk/busybox/tags/list", reg.host())]);
    let challenge = out
        .lines()
        .find_map(|l| l.strip_prefix("Www-Authenticate: Bearer "))
        .unwrap_or_else(|| panic!("no Bearer challenge in {out}"));
    let param = |k: &str| {
        let start = challenge.find(&format!("{k}=\"")).unwrap() + k.len() + 2;
        challenge[start..].split('"').next().unwrap().to_string()
    };
    let url = format!("{}?service={}&scope={}", param("realm"), param("service"), param("scope"));
    assert_eq!(param("scope"), "repository:silk/busybox:pull");
    let wrong = curl(&["-s", "-o", "/dev/null", "-w", "%{http_code}", "-u", "bob:nope", &url]);
    assert_eq!(wrong, "401");
    let before = reg.token_requests();
    let answer: Value = serde_json::from_str(&curl(&["-s", "-u", "bob:hunter2", &url])).unwrap();
    assert_eq!(reg.token_requests(), before + 1);
    assert_eq!(answer["expires_in"], 300);
    let token = answer["token"].as_str().unwrap();
    let tags = curl(&[
        "-s",
        "-H",
        &format!("Authorization: Bearer {token}"),
        &format!("http://{}/v2/silk/busybox/tags/list", reg.host()),
    ]);
    let tags: Value = serde_json::from_str(&tags).unwrap();
    let mut tags: Vec<&str> =
        tags["tags"].as_array().unwrap().iter().map(|t| t.as_str().unwrap()).collect();
    tags.sort();
    assert_eq!(tags, ["gz", "zstd"]);
    // The OAuth2 form (POST), as some clients ask.
    let form = format!(
        "grant_type=password&username=bob&password=hunter2&client_id=silk&service={}&scope={}",
        param("service"),
        param("scope")
    );
    let posted: Value =
        serde_json::from_str(&curl(&["-s", "--data", &form, &param("realm")])).unwrap();
    let token = posted["access_token"].as_str().unwrap();
    let (status, _) = curl_status_bearer(&reg, "/v2/silk/busybox/tags/list", token);
    assert_eq!(status, 200);
    // An anonymous token grants nothing.
    let anon: Value = serde_json::from_str(&curl(&["-s", &url])).unwrap();
    let anon = anon["token"].as_str().unwrap();
    let (status, _) = curl_status_bearer(&reg, "/v2/silk/busybox/tags/list", anon);
    assert_eq!(status, 401);
}

#[test]
fn the_escaping_archive_pushes() {
    let reg = Registry::start("127.0.0.11", Auth::Anonymous);
    let work = tempfile::tempdir().unwrap();
    let archive = work.path().join("evil.tar");
    images::escaping_archive(&archive);
    let digest = reg.push_archive(&archive, "silk/evil:latest", false);
    manifest(&reg, "silk/evil", &digest, DOCKER_MANIFEST);
}

fn curl(args: &[&str]) -> String {
    let out = std::process::Command::new("curl").args(args).output().expect("curl");
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// Status and body of `GET path` with curl, `-u creds` when given.
fn curl_status(reg: &Registry, path: &str, creds: Option<&str>) -> (u16, String) {
    let url = format!("http://{}{path}", reg.host());
    let mut args = vec!["-s", "-w", "\n%{http_code}", url.as_str()];
    if let Some(c) = creds {
        args.extend(["-u", c]);
    }
    split_status(curl(&args))
}

fn curl_status_bearer(reg: &Registry, path: &str, token: &str) -> (u16, String) {
    let url = format!("http://{}{path}", reg.host());
    let auth = format!("Authorization: Bearer {token}");
    split_status(curl(&["-s", "-w", "\n%{http_code}", "-H", &auth, &url]))
}

fn split_status(out: String) -> (u16, String) {
    let (body, status) = out.rsplit_once('\n').unwrap_or(("", &out));
    (status.parse().expect("a status"), body.to_string())
}
