//! The sandboxes' user namespace and the id range their files are stored in (see the crate's
//! `jail` docs, "Ids").

use std::io::BufRead;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::process::Stdio;

use super::JailEngine;
use crate::layer::{self, ID_COUNT, Ids};
use crate::{Engine, EngineError, Result};

impl JailEngine {
    /// Jails started before sandboxes had a user namespace run as host root: stop them, so the
    /// next access starts them again (from their files) inside one.
    pub(super) fn stop_unconfined(&self) {
        let Ok(boxes) = self.list() else { return };
        for info in boxes.into_iter().filter(|b| b.running) {
            if self.record(&info.id).is_ok_and(|r| r.id_base.is_none()) {
                tracing::warn!(sandbox = %info.id, "stopping a jail that runs without a user namespace");
                let _ = self.kill(&info.id, info.pid);
            }
        }
    }

    /// Goldens stored in another id range (none: built before sandboxes had a user namespace)
    /// move into this one (a marker file `ids` says which range a layer is in).
    pub(super) fn shift_old_goldens(&self) -> Result<()> {
        let Ok(entries) = std::fs::read_dir(self.cfg.data_dir.join("goldens")) else {
            return Ok(());
        };
        for entry in entries.flatten() {
            let dir = entry.path();
            if !dir.join("golden.json").is_file() {
                continue;
            }
            // No marker: built before sandboxes had a user namespace, with host ids.
            let stored = std::fs::read_to_string(dir.join("ids"))
                .ok()
                .and_then(|s| s.trim().parse::<u32>().ok())
                .unwrap_or(0);
            if stored != self.ids.base {
                tracing::info!("moving golden {} into the sandbox id range", dir.display());
                layer::shift_ids(&dir.join("layer"), stored, self.ids)?;
                mark_ids(&dir, self.ids)?;
            }
        }
        Ok(())
    }
}

/// Makes the user namespace every sandbox enters: `silk-jail --hold-userns` unshares one, the
/// engine (root, so allowed to map any ids) maps 65536 ids from `ids.base` and keeps a
/// descriptor of it, then lets the holder exit. The namespace lives as long as the descriptor
/// and the jails in it. Public for the bench, which measures what entering it costs.
pub fn user_namespace(launcher: &Path, ids: Ids) -> Result<OwnedFd> {
    let mut holder = std::process::Command::new(launcher)
        .arg("--hold-userns")
        .arg(ids.base.to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(EngineError::io(format!("run {}", launcher.display())))?;
    let made = (|| {
        let mut line = String::new();
        let stdout = holder.stdout.take().expect("piped");
        std::io::BufReader::new(stdout).read_line(&mut line).map_err(EngineError::io("read"))?;
        if line.trim() != "ready" {
            return Err(EngineError::Host("could not create a user namespace".into()));
        }
        let proc = PathBuf::from(format!("/proc/{}", holder.id()));
        let map = format!("0 {} {ID_COUNT}\n", ids.base);
        for file in ["uid_map", "gid_map"] {
            std::fs::write(proc.join(file), &map).map_err(EngineError::io(format!(
                "write {file} of the sandboxes' user namespace"
            )))?;
        }
        let ns =
            std::fs::File::open(proc.join("ns/user")).map_err(EngineError::io("open userns"))?;
        Ok(OwnedFd::from(ns))
    })();
    drop(holder.stdin.take());
    let status = holder.wait().map_err(EngineError::io("wait for the userns holder"))?;
    match made {
        Err(e) if !status.success() => {
            let mut why = String::new();
            if let Some(mut err) = holder.stderr.take() {
                let _ = std::io::Read::read_to_string(&mut err, &mut why);
            }
            Err(EngineError::Host(format!("{e}: {}", why.trim())))
        }
        made => made,
    }
}

/// Marks a golden directory's layer as stored in the range `ids`.
pub(super) fn mark_ids(golden_dir: &Path, ids: Ids) -> Result<()> {
    std::fs::write(golden_dir.join("ids"), ids.base.to_string())
        .map_err(EngineError::io("write golden ids"))
}
