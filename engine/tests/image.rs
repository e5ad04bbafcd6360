//! Image templates: a `docker save` style tarball and an OCI image layout, built here from
//! Debian's busybox-static (installed by scripts/install-test-deps), booted as sandboxes.

mod common;

use std::path::Path;

use common::*;
use silk_engine::*;

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
    b.append_data(&mut h, path, data).unwrap();
}

fn dir(b: &mut tar::Builder<Vec<u8>>, path: &str) {
    let mut h = header();
    h.set_entry_type(tar::EntryType::Directory);
    h.set_size(0);
    h.set_mode(0o755);
    b.append_data(&mut h, path, std::io::empty()).unwrap();
}

fn link(b: &mut tar::Builder<Vec<u8>>, path: &str, target: &str) {
    let mut h = header();
    h.set_entry_type(tar::EntryType::Symlink);
    h.set_mode(0o777);
    h.set_size(0);
    b.append_link(&mut h, path, target).unwrap();
}

/// Layer 1: busybox with its applets, /etc, and files layer 2 will hide.
/// Layer 2: a whiteout, an opaque directory, and a new file.
fn layers() -> (Vec<u8>, Vec<u8>) {
    let busybox =
        std::fs::read("/bin/busybox").expect("busybox-static: run scripts/install-test-deps");
    let mut l1 = tar::Builder::new(Vec::new());
    for d in ["bin", "etc", "tmp", "proc", "dev", "run", "root", "work", "opaque"] {
        dir(&mut l1, d);
    }
    file(&mut l1, "bin/busybox", &busybox, 0o755);
    for applet in ["sh", "cat", "echo", "ls", "hostname", "test", "pwd", "env"] {
        link(&mut l1, &format!("bin/{applet}"), "busybox");
    }
    file(&mut l1, "etc/passwd", b"root:x:0:0:root:/root:/bin/sh\n", 0o644);
    file(&mut l1, "etc/doomed", b"removed by layer 2\n", 0o644);
    file(&mut l1, "opaque/old", b"hidden by layer 2\n", 0o644);
    let mut l2 = tar::Builder::new(Vec::new());
    file(&mut l2, "etc/.wh.doomed", b"", 0o644);
    file(&mut l2, "opaque/.wh..wh..opq", b"", 0o644);
    file(&mut l2, "opaque/new", b"layer 2\n", 0o644);
    (l1.into_inner().unwrap(), l2.into_inner().unwrap())
}

const CONFIG: &str = r#"{"config":{"Env":["PATH=/bin","GREETING=hello from the image"],"WorkingDir":"/work","User":"root"}}"#;

fn docker_save(out: &Path) {
    let (l1, l2) = layers();
    let mut b = tar::Builder::new(Vec::new());
    file(&mut b, "manifest.json", br#"[{"Config":"config.json","RepoTags":["tiny:latest"],"Layers":["l1/layer.tar","l2/layer.tar"]}]"#, 0o644);
    file(&mut b, "config.json", CONFIG.as_bytes(), 0o644);
    file(&mut b, "l1/layer.tar", &l1, 0o644);
    file(&mut b, "l2/layer.tar", &l2, 0o644);
    std::fs::write(out, b.into_inner().unwrap()).unwrap();
}

fn oci_layout(out: &Path) {
    let (l1, l2) = layers();
    let mut l2_gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    std::io::Write::write_all(&mut l2_gz, &l2).unwrap();
    let l2 = l2_gz.finish().unwrap();
    let name = |data: &[u8]| blake3::hash(data).to_hex().to_string();
    let (c, a, b2) = (name(CONFIG.as_bytes()), name(&l1), name(&l2));
    let manifest = format!(
        r#"{{"config":{{"digest":"sha256:{c}"}},"layers":[{{"digest":"sha256:{a}"}},{{"digest":"sha256:{b2}"}}]}}"#
    );
    let m = name(manifest.as_bytes());
    let mut b = tar::Builder::new(Vec::new());
    file(&mut b, "oci-layout", br#"{"imageLayoutVersion":"1.0.0"}"#, 0o644);
    file(
        &mut b,
        "index.json",
        format!(r#"{{"manifests":[{{"digest":"sha256:{m}"}}]}}"#).as_bytes(),
        0o644,
    );
    file(&mut b, &format!("blobs/sha256/{m}"), manifest.as_bytes(), 0o644);
    file(&mut b, &format!("blobs/sha256/{c}"), CONFIG.as_bytes(), 0o644);
    file(&mut b, &format!("blobs/sha256/{a}"), &l1, 0o644);
    file(&mut b, &format!("blobs/sha256/{b2}"), &l2, 0o644);
    std::fs::write(out, b.into_inner().unwrap()).unwrap();
}

fn check_image(h: &Harness, archive: &Path, sandbox: &str) {
    let def =
        TemplateDef { name: "tiny".into(), source: TemplateSource::Image(archive.to_path_buf()) };
    let t = h.engine.template(&def).unwrap();
    assert_eq!(t.cwd.as_deref(), Some("/work"));
    assert!(t.env.contains(&("GREETING".into(), "hello from the image".into())));
    assert_eq!(h.engine.template(&def).unwrap().digest, t.digest, "imported once, same digest");

    let b = h.engine.boot(&t, &id(sandbox), &small()).unwrap();
    assert_eq!(ok(&b, "cat /opaque/new"), "layer 2");
    // The image's config applies to commands that do not say otherwise.
    assert_eq!(ok(&b, "echo $GREETING; pwd"), "hello from the image\n/work");
    assert_ne!(sh(&b, "test -e /etc/doomed").0, 0, "whiteout honoured");
    assert_ne!(sh(&b, "test -e /opaque/old").0, 0, "opaque directory honoured");
    assert_eq!(ok(&b, "hostname"), sandbox);
    // E2B's default account, added because the image lacks it; the image's own lines stay.
    let passwd = ok(&b, "cat /etc/passwd");
    assert!(
        passwd.starts_with("root:x:0:0:") && passwd.contains("\nuser:x:1000:1000:"),
        "{passwd}"
    );
    assert!(ok(&b, "cat /etc/group").contains("user:x:1000:"));
    let home = ok(&b, "ls -ldn /home/user");
    let fields: Vec<&str> = home.split_whitespace().collect();
    assert_eq!(fields[2..4], ["1000", "1000"], "home owned by user: {home}");
    assert_ne!(
        sh(&b, "test -e /usr/bin/perl").0,
        0,
        "nothing of the host's /usr in an image sandbox"
    );
    h.engine.destroy(&b.id).unwrap();
}

#[test]
fn docker_save_tarball_boots_with_layers_applied_in_order() {
    let h = Harness::new();
    let archive = h.data.path().join("tiny.tar");
    docker_save(&archive);
    check_image(&h, &archive, "img-docker");
}

#[test]
fn oci_layout_with_a_gzip_layer_boots_the_same_image() {
    let h = Harness::new();
    let archive = h.data.path().join("tiny-oci.tar");
    oci_layout(&archive);
    check_image(&h, &archive, "img-oci");
}

#[test]
fn a_layer_escaping_its_root_is_refused() {
    let h = Harness::new();
    let mut evil = tar::Builder::new(Vec::new());
    let mut hdr = header();
    hdr.set_size(1);
    hdr.set_mode(0o644);
    let name = b"../../escaped";
    hdr.as_old_mut().name[..name.len()].copy_from_slice(name);
    hdr.set_cksum();
    evil.append(&hdr, &b"x"[..]).unwrap();
    let mut b = tar::Builder::new(Vec::new());
    file(&mut b, "manifest.json", br#"[{"Config":"config.json","Layers":["evil.tar"]}]"#, 0o644);
    file(&mut b, "config.json", CONFIG.as_bytes(), 0o644);
    file(&mut b, "evil.tar", &evil.into_inner().unwrap(), 0o644);
    let archive = h.data.path().join("evil.tar");
    std::fs::write(&archive, b.into_inner().unwrap()).unwrap();
    let def = TemplateDef { name: "evil".into(), source: TemplateSource::Image(archive) };
    assert!(matches!(h.engine.template(&def), Err(EngineError::Unsafe(_))));
    assert!(!h.data.path().join("escaped").exists() && !Path::new("/tmp/escaped").exists());
}

/// An image is hostile input: links it plants where the account is added (`/etc/passwd`, `/etc`,
/// `/home`) are never followed to the host.
#[test]
fn adding_the_default_user_follows_no_link_of_the_image() {
    let h = Harness::new();
    let host = h.data.path().join("host-files");
    std::fs::create_dir_all(host.join("etc")).unwrap();
    std::fs::write(host.join("passwd"), "host's\n").unwrap();
    let busybox = std::fs::read("/bin/busybox").unwrap();
    for (name, plant) in [("passwd-link", "etc/passwd"), ("etc-link", "etc"), ("home-link", "home")]
    {
        let mut layer = tar::Builder::new(Vec::new());
        dir(&mut layer, "bin");
        file(&mut layer, "bin/busybox", &busybox, 0o755);
        if plant != "etc" {
            dir(&mut layer, "etc");
        }
        let target = match plant {
            "etc/passwd" => host.join("passwd"),
            _ => host.join("etc"),
        };
        link(&mut layer, plant, target.to_str().unwrap());
        let mut b = tar::Builder::new(Vec::new());
        file(&mut b, "manifest.json", br#"[{"Config":"config.json","Layers":["l.tar"]}]"#, 0o644);
        file(&mut b, "config.json", CONFIG.as_bytes(), 0o644);
        file(&mut b, "l.tar", &layer.into_inner().unwrap(), 0o644);
        let archive = h.data.path().join(format!("{name}.tar"));
        std::fs::write(&archive, b.into_inner().unwrap()).unwrap();
        let def = TemplateDef { name: name.into(), source: TemplateSource::Image(archive) };
        h.engine.template(&def).unwrap();
        assert_eq!(std::fs::read_to_string(host.join("passwd")).unwrap(), "host's\n", "{name}");
        let planted: Vec<_> = std::fs::read_dir(host.join("etc")).unwrap().collect();
        assert!(planted.is_empty(), "{name}: nothing written into the link's target");
    }
}
