//! Templates: where a sandbox's root filesystem comes from, and its content digest.
//!
//! - `host`: a small skeleton root (its own `/etc`, empty mount points) with the host's `/usr`,
//!   `/bin`, `/sbin` and `/lib*` bound read-only. Never the host's `/etc`, `/root`, `/home` or
//!   `/var`. Zero download.
//! - a directory rootfs, used in place (overlaid, never copied). Its digest covers the tree's
//!   metadata (paths, modes, sizes, mtimes), so editing it in place yields a new template.
//! - an image tarball (`docker save` style or an OCI image layout packed as a tar), flattened
//!   once into the engine's data directory.
//!
//! Templates are immutable: a resolved template is only ever read, and new content means a new
//! digest and a new directory.

use std::os::unix::fs::{MetadataExt, PermissionsExt, symlink};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::{Digest, EngineError, Result, Template, oci};

/// Bumped when the way templates are materialised changes, so old directories are not reused.
const FORMAT: &str = "silk-template-v2";

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TemplateSource {
    Host,
    Dir(PathBuf),
    /// A `docker save` tarball or a tar of an OCI image layout.
    Image(PathBuf),
    /// An image pulled from a registry, its blobs in the node's layer cache.
    Pulled(PulledImage),
}

/// A registry image as the node pulled it: digests checked, nothing unpacked yet.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PulledImage {
    /// The image manifest's digest (`sha256:…`): the template's identity.
    pub digest: String,
    /// The image config (JSON).
    pub config: Vec<u8>,
    /// Layer blobs, bottom first (plain, gzip or zstd tars).
    pub layers: Vec<PathBuf>,
    /// The most bytes the layers may unpack to.
    pub max_bytes: u64,
    /// Free space the data directory's filesystem keeps while they unpack.
    pub min_free_bytes: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TemplateDef {
    pub name: String,
    pub source: TemplateSource,
}

impl TemplateDef {
    pub fn host() -> TemplateDef {
        TemplateDef { name: "host".into(), source: TemplateSource::Host }
    }
}

/// Resolves `def`, materialising it under `dir` on first use.
pub(crate) fn resolve(def: &TemplateDef, dir: &Path) -> Result<Template> {
    match &def.source {
        TemplateSource::Host => host(def, dir),
        TemplateSource::Dir(root) => directory(def, root),
        TemplateSource::Image(archive) => image(def, archive, dir),
        TemplateSource::Pulled(pulled) => self::pulled(def, pulled, dir),
    }
}

/// Host directories bound into a `host` sandbox, when they are real directories on this host
/// (on merged-/usr systems `/bin` and friends are symlinks into `/usr`, recreated as symlinks).
const HOST_DIRS: &[&str] = &["usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32"];

fn host(def: &TemplateDef, dir: &Path) -> Result<Template> {
    let mut hasher = blake3::Hasher::new();
    hasher.update(FORMAT.as_bytes()).update(b"host");
    let mut layout = vec![];
    for name in HOST_DIRS {
        let path = Path::new("/").join(name);
        match std::fs::symlink_metadata(&path) {
            Ok(m) if m.file_type().is_symlink() => {
                let target =
                    std::fs::read_link(&path).map_err(EngineError::io("read host link"))?;
                hasher.update(format!("{name}->{}", target.display()).as_bytes());
                layout.push((name.to_string(), Some(target)));
            }
            Ok(m) if m.is_dir() => {
                hasher.update(format!("{name}/").as_bytes());
                layout.push((name.to_string(), None));
            }
            _ => {}
        }
    }
    // The dynamic linker's cache and the alternatives links are host facts the skeleton copies.
    let ld_cache = std::fs::read("/etc/ld.so.cache").unwrap_or_default();
    hasher.update(&ld_cache);
    let digest = Digest::of(&hasher);
    let home = dir.join(format!("host-{}", digest.short()));
    let root = home.join("root");
    if !root.is_dir() {
        build_atomically(&home, |staging| {
            let root = staging.join("root");
            host_skeleton(&root, &layout, &ld_cache)
        })?;
    }
    let binds = layout
        .iter()
        .filter(|(_, link)| link.is_none())
        .map(|(name, _)| (Path::new("/").join(name), PathBuf::from(name)))
        .collect();
    Ok(Template { name: def.name.clone(), digest, root, binds, env: vec![], cwd: None, user: None })
}

const PASSWD: &str = "root:x:0:0:root:/root:/bin/sh\n\
user:x:1000:1000:user:/home/user:/bin/sh\n\
nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n";
const GROUP: &str = "root:x:0:\nuser:x:1000:\nnogroup:x:65534:\n";

fn host_skeleton(root: &Path, layout: &[(String, Option<PathBuf>)], ld_cache: &[u8]) -> Result<()> {
    let mkdir = |p: &Path, mode: u32| -> Result<()> {
        std::fs::create_dir_all(p).map_err(EngineError::io(format!("mkdir {}", p.display())))?;
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode))
            .map_err(EngineError::io("chmod"))
    };
    for (name, link) in layout {
        match link {
            Some(target) => symlink(target, root.join(name)).map_err(EngineError::io("symlink"))?,
            None => mkdir(&root.join(name), 0o755)?,
        }
    }
    for (name, mode) in [
        ("etc", 0o755),
        ("proc", 0o555),
        ("dev", 0o755),
        ("tmp", 0o1777),
        ("run", 0o755),
        ("root", 0o700),
        ("home/user", 0o755),
        ("var/tmp", 0o1777),
        ("mnt", 0o755),
        ("opt", 0o755),
    ] {
        mkdir(&root.join(name), mode)?;
    }
    std::os::unix::fs::chown(root.join("home/user"), Some(1000), Some(1000))
        .map_err(EngineError::io("chown home"))?;
    let etc = root.join("etc");
    let write = |name: &str, content: &[u8]| {
        std::fs::write(etc.join(name), content)
            .map_err(EngineError::io(format!("write /etc/{name}")))
    };
    write("passwd", PASSWD.as_bytes())?;
    write("group", GROUP.as_bytes())?;
    write("hosts", b"127.0.0.1\tlocalhost\n::1\tlocalhost\n")?;
    write("resolv.conf", b"# lane none: no network\n")?;
    write("hostname", b"sandbox\n")?;
    write("nsswitch.conf", b"passwd: files\ngroup: files\nhosts: files dns\n")?;
    if !ld_cache.is_empty() {
        write("ld.so.cache", ld_cache)?;
    }
    // Debian resolves many commands (awk, editor, ...) through /etc/alternatives symlinks.
    if let Ok(entries) = std::fs::read_dir("/etc/alternatives") {
        mkdir(&etc.join("alternatives"), 0o755)?;
        for entry in entries.flatten() {
            if let Ok(target) = std::fs::read_link(entry.path()) {
                let _ = symlink(target, etc.join("alternatives").join(entry.file_name()));
            }
        }
    }
    Ok(())
}

fn directory(def: &TemplateDef, root: &Path) -> Result<Template> {
    let meta = std::fs::metadata(root)
        .map_err(|_| EngineError::TemplateNotFound(format!("{} ({})", def.name, root.display())))?;
    if !meta.is_dir() {
        return Err(EngineError::BadTemplate(format!("{} is not a directory", root.display())));
    }
    let mut hasher = blake3::Hasher::new();
    hasher.update(FORMAT.as_bytes()).update(b"dir");
    hash_tree(root, Path::new(""), &mut hasher)?;
    Ok(Template {
        name: def.name.clone(),
        digest: Digest::of(&hasher),
        root: root.to_path_buf(),
        binds: vec![],
        env: vec![],
        cwd: None,
        user: None,
    })
}

/// Hashes a tree's shape and metadata in a stable (sorted) order.
fn hash_tree(dir: &Path, rel: &Path, hasher: &mut blake3::Hasher) -> Result<()> {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .map_err(EngineError::io(format!("read {}", dir.display())))?
        .filter_map(|e| e.ok())
        .collect();
    entries.sort_by_key(|e| e.file_name());
    for entry in entries {
        let path = entry.path();
        let m = std::fs::symlink_metadata(&path).map_err(EngineError::io("stat"))?;
        let name = rel.join(entry.file_name());
        hasher.update(name.as_os_str().as_encoded_bytes());
        hasher.update(&[0]);
        for n in
            [m.mode() as u64, m.size(), m.mtime() as u64, m.mtime_nsec() as u64, m.uid() as u64]
        {
            hasher.update(&n.to_le_bytes());
        }
        if m.is_dir() {
            hash_tree(&path, &name, hasher)?;
        }
    }
    Ok(())
}

fn image(def: &TemplateDef, archive: &Path, dir: &Path) -> Result<Template> {
    let file = std::fs::File::open(archive).map_err(|_| {
        EngineError::TemplateNotFound(format!("{} ({})", def.name, archive.display()))
    })?;
    let mut hasher = blake3::Hasher::new();
    hasher.update(FORMAT.as_bytes()).update(b"image");
    hasher.update_reader(file).map_err(EngineError::io("hash image"))?;
    let digest = Digest::of(&hasher);
    let home = dir.join(format!("image-{}", digest.short()));
    let config_path = home.join("config.json");
    if !config_path.is_file() {
        build_atomically(&home, |staging| {
            let config = oci::import(archive, &staging.join("root"))?;
            add_mount_points(&staging.join("root"))?;
            add_default_user(&staging.join("root"))?;
            let json = serde_json::to_vec_pretty(&config)
                .map_err(|e| EngineError::BadTemplate(e.to_string()))?;
            std::fs::write(staging.join("config.json"), json)
                .map_err(EngineError::io("write config"))
        })?;
    }
    let config: oci::ImageConfig = serde_json::from_slice(
        &std::fs::read(&config_path).map_err(EngineError::io("read image config"))?,
    )
    .map_err(|e| EngineError::BadTemplate(format!("image config: {e}")))?;
    Ok(Template {
        name: def.name.clone(),
        digest,
        root: home.join("root"),
        binds: vec![],
        env: config.env,
        cwd: config.cwd,
        user: config.user,
    })
}

fn pulled(def: &TemplateDef, image: &PulledImage, dir: &Path) -> Result<Template> {
    let mut hasher = blake3::Hasher::new();
    hasher.update(FORMAT.as_bytes()).update(b"pulled").update(image.digest.as_bytes());
    let digest = Digest::of(&hasher);
    let home = dir.join(format!("pulled-{}", digest.short()));
    let config_path = home.join("config.json");
    if !config_path.is_file() {
        build_atomically(&home, |staging| {
            let root = staging.join("root");
            let config = oci::import_pulled(image, &root)?;
            add_mount_points(&root)?;
            add_default_user(&root)?;
            let json = serde_json::to_vec_pretty(&config)
                .map_err(|e| EngineError::BadTemplate(e.to_string()))?;
            std::fs::write(staging.join("config.json"), json)
                .map_err(EngineError::io("write config"))
        })?;
    }
    let config: oci::ImageConfig = serde_json::from_slice(
        &std::fs::read(&config_path).map_err(EngineError::io("read image config"))?,
    )
    .map_err(|e| EngineError::BadTemplate(format!("image config: {e}")))?;
    Ok(Template {
        name: def.name.clone(),
        digest,
        root: home.join("root"),
        binds: vec![],
        env: config.env,
        cwd: config.cwd,
        user: config.user,
    })
}

/// Gives an imported image the directories a jail mounts its own filesystems on, when it lacks
/// them (an image built `FROM scratch` often has no `/proc` or `/run`), as container runtimes
/// do. Whatever the image has there instead (a file, a link) is left as it is.
fn add_mount_points(root: &Path) -> Result<()> {
    for (name, mode) in [("dev", 0o755), ("proc", 0o555), ("tmp", 0o1777), ("run", 0o755)] {
        let path = root.join(name);
        if std::fs::symlink_metadata(&path).is_err() {
            std::fs::create_dir(&path).map_err(EngineError::io(format!("mkdir /{name}")))?;
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode))
                .map_err(EngineError::io(format!("chmod /{name}")))?;
        }
    }
    Ok(())
}

/// The account E2B's SDKs run commands as, which every template the node materialises has.
const USER_LINE: &str = "user:x:1000:1000:user:/home/user:/bin/sh\n";
const USER_GROUP_LINE: &str = "user:x:1000:\n";

/// Gives an imported image the `user` account (uid 1000, home `/home/user`) when its
/// `/etc/passwd` lacks one. The tree is the image's, so hostile: nothing in it is followed (only
/// this builder writes the staging tree, so checking then writing is not racy). An `/etc` or
/// `/home` that is a symlink is left as it is, and so is the image.
fn add_default_user(root: &Path) -> Result<()> {
    let kind = |p: &Path| std::fs::symlink_metadata(p).ok().map(|m| m.file_type());
    let etc = root.join("etc");
    match kind(&etc) {
        None => std::fs::create_dir(&etc).map_err(EngineError::io("mkdir /etc"))?,
        Some(t) if t.is_dir() => {}
        Some(_) => return Ok(()),
    }
    for (name, line, mode) in [("passwd", USER_LINE, 0o644), ("group", USER_GROUP_LINE, 0o644)] {
        let path = etc.join(name);
        let content = match kind(&path) {
            None => String::new(),
            Some(t) if t.is_file() => std::fs::read_to_string(&path).unwrap_or_default(),
            Some(_) => return Ok(()),
        };
        if content.lines().any(|l| l.starts_with("user:")) {
            continue;
        }
        let sep = if content.is_empty() || content.ends_with('\n') { "" } else { "\n" };
        use std::io::Write as _;
        use std::os::unix::fs::OpenOptionsExt as _;
        std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .mode(mode)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&path)
            .and_then(|mut f| f.write_all(format!("{sep}{line}").as_bytes()))
            .map_err(EngineError::io(format!("add user to /etc/{name}")))?;
    }
    let home = root.join("home");
    match kind(&home) {
        None => std::fs::create_dir(&home).map_err(EngineError::io("mkdir /home"))?,
        Some(t) if t.is_dir() => {}
        Some(_) => return Ok(()),
    }
    let user_home = home.join("user");
    if kind(&user_home).is_none() {
        std::fs::create_dir(&user_home).map_err(EngineError::io("mkdir /home/user"))?;
        std::os::unix::fs::lchown(&user_home, Some(1000), Some(1000))
            .map_err(EngineError::io("chown /home/user"))?;
    }
    Ok(())
}

/// Builds `dest` in a sibling staging directory and renames it into place, so a crash or an
/// error never leaves a half-built template that later looks complete.
pub(crate) fn build_atomically(dest: &Path, build: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    let parent = dest.parent().ok_or_else(|| EngineError::Host("bad data dir".into()))?;
    std::fs::create_dir_all(parent)
        .map_err(EngineError::io(format!("mkdir {}", parent.display())))?;
    let name = dest.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    // Unique per call: concurrent builders of one template each stage their own copy.
    let staging = parent.join(format!(".{name}.building-{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&staging);
    std::fs::create_dir(&staging).map_err(EngineError::io("mkdir staging"))?;
    let built = build(&staging);
    if built.is_ok() {
        match std::fs::rename(&staging, dest) {
            Ok(()) => return Ok(()),
            // Another builder won the race with identical content.
            Err(_) if dest.exists() => {}
            Err(e) => {
                let _ = std::fs::remove_dir_all(&staging);
                return Err(EngineError::io("install template")(e));
            }
        }
    }
    let _ = std::fs::remove_dir_all(&staging);
    built
}
