//! Image import: a `docker save` tarball, a tar of an OCI image layout, or an image pulled from a
//! registry, flattened into one root directory, with the image's config (env, working
//! directory, user) kept.
//!
//! The outer archive is unpacked into a scratch directory (the tar crate refuses entries that
//! escape it); the manifest names the config and the layers, which are applied in order with
//! whiteouts honoured (see `layer`).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::layer::{self, Whiteouts};
use crate::template::PulledImage;
use crate::{EngineError, Result};

/// The parts of an image config a sandbox keeps.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageConfig {
    pub env: Vec<(String, String)>,
    pub cwd: Option<String>,
    pub user: Option<String>,
}

fn bad(msg: impl Into<String>) -> EngineError {
    EngineError::BadTemplate(msg.into())
}

pub fn import(archive: &Path, root: &Path) -> Result<ImageConfig> {
    let scratch = root.with_file_name("outer");
    let file = std::fs::File::open(archive).map_err(EngineError::io("open image"))?;
    tar::Archive::new(file)
        .unpack(&scratch)
        .map_err(|e| bad(format!("image archive {}: {e}", archive.display())))?;
    let result = (|| {
        let (config, layers) = manifest(&scratch)?;
        std::fs::create_dir_all(root).map_err(EngineError::io("mkdir rootfs"))?;
        for layer in &layers {
            let file = std::fs::File::open(layer)
                .map_err(|_| bad(format!("layer {} is missing", layer.display())))?;
            layer::apply(layer::decompress(file)?, root, Whiteouts::Delete, layer::Ids::HOST)?;
        }
        image_config(&config)
    })();
    let _ = std::fs::remove_dir_all(&scratch);
    result
}

/// Unpacks a pulled image's layers into `root`, bottom first, stopping (`TooLarge`, `DiskFull`)
/// as soon as they unpack to more than the image may, or the disk reaches its reserve.
pub fn import_pulled(image: &PulledImage, root: &Path) -> Result<ImageConfig> {
    std::fs::create_dir_all(root).map_err(EngineError::io("mkdir rootfs"))?;
    let budget = Budget::new(image, root);
    for path in &image.layers {
        let file = std::fs::File::open(path)
            .map_err(EngineError::io(format!("open layer {}", path.display())))?;
        let counted = Counted { input: layer::decompress(file)?, budget: &budget };
        if let Err(e) = layer::apply(counted, root, Whiteouts::Delete, layer::Ids::HOST) {
            // The tar reader reports the budget's refusal as a read error: say what it was.
            return Err(budget.exceeded.take().unwrap_or(e));
        }
    }
    let config: Value =
        serde_json::from_slice(&image.config).map_err(|e| bad(format!("image config: {e}")))?;
    Ok(config_of(&config))
}

/// Bytes an unpacking image may still write, and the free space it must leave.
struct Budget {
    left: std::cell::Cell<u64>,
    max: u64,
    min_free: u64,
    root: PathBuf,
    since_check: std::cell::Cell<u64>,
    exceeded: std::cell::Cell<Option<EngineError>>,
}

/// How often the unpacking checks the disk reserve.
const RESERVE_CHECK_EVERY: u64 = 16 << 20;

impl Budget {
    fn new(image: &PulledImage, root: &Path) -> Budget {
        Budget {
            left: image.max_bytes.into(),
            max: image.max_bytes,
            min_free: image.min_free_bytes,
            root: root.to_path_buf(),
            since_check: 0.into(),
            exceeded: None.into(),
        }
    }

    fn spend(&self, n: u64) -> std::io::Result<()> {
        let refuse = |e: EngineError| {
            let msg = e.to_string();
            self.exceeded.set(Some(e));
            Err(std::io::Error::other(msg))
        };
        match self.left.get().checked_sub(n) {
            Some(left) => self.left.set(left),
            None => {
                let max = self.max;
                return refuse(EngineError::TooLarge(format!(
                    "the image unpacks to over {max} bytes"
                )));
            }
        }
        self.since_check.set(self.since_check.get() + n);
        if self.since_check.get() >= RESERVE_CHECK_EVERY {
            self.since_check.set(0);
            let free = free_bytes(&self.root).unwrap_or(u64::MAX);
            if free < self.min_free {
                let (free, min) = (free >> 20, self.min_free >> 20);
                return refuse(EngineError::DiskFull(format!("{free} MiB free, {min} MiB kept")));
            }
        }
        Ok(())
    }
}

fn free_bytes(path: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).ok()?;
    // SAFETY: a valid C string and a zeroed out-parameter of the right type.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    (unsafe { libc::statvfs(c.as_ptr(), &mut st) } == 0).then(|| st.f_bavail * st.f_frsize)
}

struct Counted<'a, R> {
    input: R,
    budget: &'a Budget,
}

impl<R: std::io::Read> std::io::Read for Counted<'_, R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.input.read(buf)?;
        self.budget.spend(n as u64)?;
        Ok(n)
    }
}

fn read_json(path: &Path) -> Result<Value> {
    let bytes = std::fs::read(path).map_err(|_| bad(format!("{} is missing", path.display())))?;
    serde_json::from_slice(&bytes).map_err(|e| bad(format!("{}: {e}", path.display())))
}

/// A path named inside the archive, kept inside the scratch directory.
fn inside(scratch: &Path, name: &str) -> Result<PathBuf> {
    let path = layer::resolve(scratch, Path::new(name))?;
    Ok(path)
}

/// `(config path, layer paths)` from `manifest.json` (docker save) or `index.json` (OCI layout).
fn manifest(scratch: &Path) -> Result<(PathBuf, Vec<PathBuf>)> {
    let docker = scratch.join("manifest.json");
    if docker.is_file() {
        let m = read_json(&docker)?;
        let first = m.get(0).ok_or_else(|| bad("manifest.json lists no image"))?;
        let config = first["Config"].as_str().ok_or_else(|| bad("manifest.json: no Config"))?;
        let layers = first["Layers"].as_array().ok_or_else(|| bad("manifest.json: no Layers"))?;
        let layers = layers
            .iter()
            .map(|l| {
                l.as_str()
                    .ok_or_else(|| bad("manifest.json: bad layer"))
                    .and_then(|l| inside(scratch, l))
            })
            .collect::<Result<_>>()?;
        return Ok((inside(scratch, config)?, layers));
    }
    let index = read_json(&scratch.join("index.json"))
        .map_err(|_| bad("neither manifest.json nor index.json: not an image archive"))?;
    let blob = |digest: &Value| -> Result<PathBuf> {
        let digest = digest.as_str().ok_or_else(|| bad("bad digest"))?;
        let (algo, hex) =
            digest.split_once(':').ok_or_else(|| bad(format!("bad digest {digest}")))?;
        if !hex.bytes().all(|b| b.is_ascii_hexdigit()) || algo.contains(['/', '.']) {
            return Err(bad(format!("bad digest {digest}")));
        }
        inside(scratch, &format!("blobs/{algo}/{hex}"))
    };
    let manifest = read_json(&blob(&index["manifests"][0]["digest"])?)?;
    let layers = manifest["layers"]
        .as_array()
        .ok_or_else(|| bad("OCI manifest: no layers"))?
        .iter()
        .map(|l| blob(&l["digest"]))
        .collect::<Result<_>>()?;
    Ok((blob(&manifest["config"]["digest"])?, layers))
}

fn image_config(path: &Path) -> Result<ImageConfig> {
    Ok(config_of(&read_json(path)?))
}

fn config_of(c: &Value) -> ImageConfig {
    let c = &c["config"];
    let env = c["Env"]
        .as_array()
        .map(|vars| {
            vars.iter()
                .filter_map(|v| {
                    v.as_str()?.split_once('=').map(|(k, v)| (k.to_string(), v.to_string()))
                })
                .collect()
        })
        .unwrap_or_default();
    let text = |key: &str| c[key].as_str().filter(|s| !s.is_empty()).map(str::to_string);
    ImageConfig { env, cwd: text("WorkingDir"), user: text("User") }
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};

    use super::*;

    fn gzip(data: &[u8]) -> Vec<u8> {
        let mut out = flate2::write::GzEncoder::new(vec![], flate2::Compression::fast());
        out.write_all(data).unwrap();
        out.finish().unwrap()
    }

    /// A layer tar holding one file of `len` zero bytes.
    fn zeros_layer(len: usize) -> Vec<u8> {
        let mut tar = tar::Builder::new(vec![]);
        let mut header = tar::Header::new_gnu();
        header.set_size(len as u64);
        header.set_mode(0o644);
        header.set_entry_type(tar::EntryType::Regular);
        tar.append_data(&mut header, "zeros", std::io::repeat(0).take(len as u64)).unwrap();
        tar.into_inner().unwrap()
    }

    fn pull(layer: &[u8], dir: &Path, max_bytes: u64) -> (Result<ImageConfig>, u64) {
        let blob = dir.join("blob");
        std::fs::write(&blob, layer).unwrap();
        let image = PulledImage {
            digest: "sha256:0".into(),
            config: b"{}".to_vec(),
            layers: vec![blob],
            max_bytes,
            min_free_bytes: 0,
        };
        let root = dir.join("root");
        let result = import_pulled(&image, &root);
        let written = std::fs::metadata(root.join("zeros")).map_or(0, |m| m.len());
        (result, written)
    }

    #[test]
    fn a_layer_unpacks_within_the_images_budget_however_often_it_is_compressed() {
        let dir = tempfile::tempdir().unwrap();
        let (result, written) = pull(&gzip(&zeros_layer(64 << 10)), dir.path(), 1 << 20);
        assert!(result.is_ok(), "{result:?}");
        assert_eq!(written, 64 << 10);

        let dir = tempfile::tempdir().unwrap();
        let (result, written) = pull(&gzip(&zeros_layer(4 << 20)), dir.path(), 1 << 20);
        assert!(matches!(result, Err(EngineError::TooLarge(_))), "{result:?}");
        assert!(written <= 1 << 20, "{written} bytes written past a 1 MiB budget");

        // A gzip of a gzip: only the outer one is undone, the rest is no tar. Were the inner
        // one undone too, its 4 MiB would land uncounted.
        let dir = tempfile::tempdir().unwrap();
        let (result, written) = pull(&gzip(&gzip(&zeros_layer(4 << 20))), dir.path(), 1 << 20);
        assert!(result.is_err(), "a doubly compressed layer was taken");
        assert_eq!(written, 0);
    }
}
