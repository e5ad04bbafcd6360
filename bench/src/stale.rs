//! Work directories of `silkbench` runs that were killed. A signal skips the cleanup that runs
//! on drop, so their nodes keep running, with their sandboxes, mounted disks and egress tables;
//! the tables tax every loopback packet of the host, floors included (see the host stamp). Each
//! run first removes the directories under `/var/tmp` (every section's default `--dir`) named
//! `silkbench-…-<pid>` whose pid is no live `silkbench`: it kills the nodes running from them,
//! has each node's `sandboxd clean` remove what it left (sandboxes, disks, its table), then
//! unmounts what is left under the directory and deletes it.

use std::path::{Path, PathBuf};

pub fn sweep(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let pid = name.strip_prefix("silkbench-").and_then(|r| r.rsplit('-').next());
        let Some(pid) = pid.and_then(|p| p.parse::<u32>().ok()) else { continue };
        if running_silkbench(pid) {
            continue;
        }
        let work = entry.path();
        eprintln!("silkbench: removing {} (left by a run that was killed)", work.display());
        kill_nodes_under(&work);
        let sandboxd = std::env::current_exe().map(|e| e.with_file_name("sandboxd"));
        for config in configs_under(&work, 3) {
            if let Ok(sandboxd) = &sandboxd {
                let _ = std::process::Command::new(sandboxd)
                    .arg("--config")
                    .arg(&config)
                    .arg("clean")
                    .stdout(std::process::Stdio::null())
                    .status();
            }
        }
        silk_engine::jail::unmount_under(&work);
        let _ = std::fs::remove_dir_all(&work);
    }
}

/// Whether `pid` is a `silkbench` that has not exited (a killed one can linger as a zombie).
fn running_silkbench(pid: u32) -> bool {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // `pid (comm) state …`: the name may hold spaces and parentheses, the state follows the last.
    let Some((head, tail)) = stat.rsplit_once(") ") else { return false };
    head.ends_with("(silkbench") && !tail.starts_with('Z')
}

/// SIGKILLs every `sandboxd` whose command line names a path under `work`.
fn kill_nodes_under(work: &Path) {
    let Ok(procs) = std::fs::read_dir("/proc") else { return };
    let under = work.to_string_lossy().into_owned();
    for p in procs.flatten() {
        let Ok(pid) = p.file_name().to_string_lossy().parse::<i32>() else { continue };
        let cmdline = std::fs::read(p.path().join("cmdline")).unwrap_or_default();
        let args: Vec<String> =
            cmdline.split(|b| *b == 0).map(|a| String::from_utf8_lossy(a).into_owned()).collect();
        let is_node = args.first().is_some_and(|a| a.ends_with("/sandboxd"));
        if is_node && args.iter().any(|a| a.starts_with(&under)) {
            // SAFETY: kill(2) on a pid just read from /proc.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    }
    // The nodes' journal locks go with them.
    std::thread::sleep(std::time::Duration::from_millis(200));
}

/// The `sandboxd.toml` files under `dir`, at most `depth` levels down.
fn configs_under(dir: &Path, depth: usize) -> Vec<PathBuf> {
    let mut found = vec![];
    let Ok(entries) = std::fs::read_dir(dir) else { return found };
    for e in entries.flatten() {
        let path = e.path();
        let is_dir = e.file_type().is_ok_and(|t| t.is_dir());
        if is_dir && depth > 0 {
            found.extend(configs_under(&path, depth - 1));
        } else if path.file_name().is_some_and(|n| n == "sandboxd.toml") {
            found.push(path);
        }
    }
    found
}
