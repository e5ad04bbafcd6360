//! Test images built from Debian's busybox-static (`/bin/busybox`, installed by
//! scripts/install-test-deps): a `docker save` tarball, a multi-platform OCI image layout, and a
//! hostile archive, ready for [`crate::registry::Registry`] to push.

use std::io::Write;
use std::path::Path;

use serde_json::{Value, json};

pub const INDEX: &str = "application/vnd.oci.image.index.v1+json";
pub const MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
pub const CONFIG: &str = "application/vnd.oci.image.config.v1+json";
pub const LAYER_GZIP: &str = "application/vnd.oci.image.layer.v1.tar+gzip";

/// The applets linked to busybox in every image.
const APPLETS: [&str; 10] = ["sh", "cat", "echo", "ls", "test", "pwd", "env", "true", "wc", "head"];

/// The base layer's directories.
const BASE_DIRS: [&str; 6] = ["bin", "etc", "tmp", "proc", "dev", "root"];

/// A docker-archive (`docker save`) tarball of one layer: busybox and its applets in /bin,
/// /etc/passwd, /tmp, and the `extra` files (path, content; mode 0755, so a script can run),
/// with config `Env` `PATH=/bin` and `GREETING=<greeting>`, `WorkingDir` `/`.
pub fn busybox_archive(out: &Path, greeting: &str, extra: &[(&str, Vec<u8>)]) {
    let mut layer = busybox_layer();
    let mut made: Vec<String> = BASE_DIRS.map(String::from).to_vec();
    for (path, data) in extra {
        let path = path.trim_start_matches('/');
        // Parent directories first, as `docker save` would have them.
        let mut parent = String::new();
        for part in path.split('/').collect::<Vec<_>>().split_last().map_or(&[][..], |(_, p)| p) {
            parent = if parent.is_empty() { part.to_string() } else { format!("{parent}/{part}") };
            if !made.contains(&parent) {
                dir(&mut layer, &parent);
                made.push(parent.clone());
            }
        }
        file(&mut layer, path, data, 0o755);
    }
    let layer = layer.into_inner().expect("a layer");
    docker_archive(out, &image_config("linux", "amd64", greeting, &[&layer]), &[layer]);
}

/// An OCI image layout directory (what skopeo's `oci:` transport reads) whose `index.json` has
/// one entry, tagged `latest`: an image index with one image per `(os, arch)` of `platforms`.
/// Each image has the busybox layer (shared by all) and a layer with `/platform` holding
/// `os/arch`, so a test can tell which one was pulled. Gzip layers, sha256 digests.
pub fn busybox_index(dir: &Path, platforms: &[(&str, &str)]) {
    let blobs = dir.join("blobs/sha256");
    std::fs::create_dir_all(&blobs).expect("creating the layout's blob directory");
    let put = |data: &[u8], media_type: &str| -> Value {
        let digest = sha256(data);
        std::fs::write(blobs.join(&digest[7..]), data).expect("writing a blob");
        json!({"mediaType": media_type, "digest": digest, "size": data.len()})
    };
    let base = busybox_layer().into_inner().expect("a layer");
    let base_gz = gzip(&base);
    let mut manifests = Vec::new();
    for (os, arch) in platforms {
        let mut top = tar::Builder::new(Vec::new());
        file(&mut top, "platform", format!("{os}/{arch}").as_bytes(), 0o644);
        let top = top.into_inner().expect("a layer");
        let greeting = format!("hello from {os}/{arch}");
        let config = image_config(os, arch, &greeting, &[&base, &top]);
        let manifest = json!({
            "schemaVersion": 2,
            "mediaType": MANIFEST,
            "config": put(config.as_bytes(), CONFIG),
            "layers": [put(&base_gz, LAYER_GZIP), put(&gzip(&top), LAYER_GZIP)],
        })
        .to_string();
        let mut entry = put(manifest.as_bytes(), MANIFEST);
        entry["platform"] = json!({"os": os, "architecture": arch});
        manifests.push(entry);
    }
    let index = json!({"schemaVersion": 2, "mediaType": INDEX, "manifests": manifests}).to_string();
    let mut entry = put(index.as_bytes(), INDEX);
    entry["annotations"] = json!({"org.opencontainers.image.ref.name": "latest"});
    let top = json!({"schemaVersion": 2, "mediaType": INDEX, "manifests": [entry]});
    std::fs::write(dir.join("index.json"), top.to_string()).expect("writing index.json");
    std::fs::write(dir.join("oci-layout"), r#"{"imageLayoutVersion":"1.0.0"}"#)
        .expect("writing oci-layout");
}

/// A docker archive whose one layer has an entry `../../escaped`, out of the root it unpacks
/// in: an importer must refuse it.
pub fn escaping_archive(out: &Path) {
    let mut layer = tar::Builder::new(Vec::new());
    let mut h = header();
    h.set_size(1);
    h.set_mode(0o644);
    // Written into the header by hand: the tar crate refuses `..` in a path it is given.
    let name = b"../../escaped";
    h.as_old_mut().name[..name.len()].copy_from_slice(name);
    h.set_cksum();
    layer.append(&h, &b"x"[..]).expect("a tar entry");
    let layer = layer.into_inner().expect("a layer");
    docker_archive(out, &image_config("linux", "amd64", "escaping", &[&layer]), &[layer]);
}

/// `sha256:<hex>` of `data`.
pub fn sha256(data: &[u8]) -> String {
    let d = ring::digest::digest(&ring::digest::SHA256, data);
    let hex: String = d.as_ref().iter().map(|b| format!("{b:02x}")).collect();
    format!("sha256:{hex}")
}

/// The base layer: busybox, its applets, /etc/passwd, and the usual empty directories.
fn busybox_layer() -> tar::Builder<Vec<u8>> {
    let busybox =
        std::fs::read("/bin/busybox").expect("busybox-static: run scripts/install-test-deps");
    let mut l = tar::Builder::new(Vec::new());
    for d in BASE_DIRS {
        dir(&mut l, d);
    }
    file(&mut l, "bin/busybox", &busybox, 0o755);
    for applet in APPLETS {
        link(&mut l, &format!("bin/{applet}"), "busybox");
    }
    file(&mut l, "etc/passwd", b"root:x:0:0:root:/root:/bin/sh\n", 0o644);
    l
}

/// An image config whose `rootfs.diff_ids` are the (uncompressed) `layers`' digests, which
/// skopeo checks the layers against.
fn image_config(os: &str, arch: &str, greeting: &str, layers: &[&[u8]]) -> String {
    json!({
        "architecture": arch,
        "os": os,
        "config": {"Env": ["PATH=/bin", format!("GREETING={greeting}")], "WorkingDir": "/"},
        "rootfs": {"type": "layers", "diff_ids": layers.iter().map(|l| sha256(l)).collect::<Vec<_>>()},
    })
    .to_string()
}

/// `docker save`'s layout: manifest.json, the config, and each layer as `<n>/layer.tar`.
fn docker_archive(out: &Path, config: &str, layers: &[Vec<u8>]) {
    let config_name = format!("{}.json", &sha256(config.as_bytes())[7..]);
    let names: Vec<String> = (0..layers.len()).map(|i| format!("layer{i}/layer.tar")).collect();
    let manifest =
        json!([{"Config": config_name, "RepoTags": ["silk-test/busybox:latest"], "Layers": names}]);
    let mut b = tar::Builder::new(Vec::new());
    file(&mut b, "manifest.json", manifest.to_string().as_bytes(), 0o644);
    file(&mut b, &config_name, config.as_bytes(), 0o644);
    for (name, layer) in names.iter().zip(layers) {
        file(&mut b, name, layer, 0o644);
    }
    std::fs::write(out, b.into_inner().expect("an archive"))
        .unwrap_or_else(|e| panic!("writing {}: {e}", out.display()));
}

fn gzip(data: &[u8]) -> Vec<u8> {
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    gz.write_all(data).expect("gzip");
    gz.finish().expect("gzip")
}

fn header() -> tar::Header {
    let mut h = tar::Header::new_gnu();
    h.set_uid(0);
    h.set_gid(0);
    h.set_mtime(1_700_000_000);
    h
}

fn file(b: &mut tar::Builder<Vec<u8>>, path: &str, data: &[u8], mode: u32) {
    let mut h = header();
    h.set_size(data.len() as u64);
    h.set_mode(mode);
    b.append_data(&mut h, path, data).expect("a tar file");
}

fn dir(b: &mut tar::Builder<Vec<u8>>, path: &str) {
    let mut h = header();
    h.set_entry_type(tar::EntryType::Directory);
    h.set_size(0);
    h.set_mode(0o755);
    b.append_data(&mut h, path, std::io::empty()).expect("a tar directory");
}

fn link(b: &mut tar::Builder<Vec<u8>>, path: &str, target: &str) {
    let mut h = header();
    h.set_entry_type(tar::EntryType::Symlink);
    h.set_mode(0o777);
    h.set_size(0);
    b.append_link(&mut h, path, target).expect("a tar symlink");
}
