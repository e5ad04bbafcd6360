//! `sbx cp SRC DST`: copies between the local machine and a sandbox, with `cp -r` naming.
//! A side written `ID:/path` is in sandbox `ID`. A directory source copied onto an existing
//! directory lands inside it (under its own name); otherwise the destination becomes the copy.
//! Directories travel as tar streams (push/pull); a single file is pulled as a one-entry tar
//! stream and pushed as a streamed atomic write, its mode kept either way. A large copy prints one progress line on stderr when stderr is a terminal.
//! A pull that left entries out (devices, FIFOs, unsafe paths or links) or cleared set-id bits
//! says so in one warning line on stderr.

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use silkmesh::{Client, ErrorKind, FileKind, PullReport, Sandbox};

/// One side of a copy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Side {
    Local(PathBuf),
    Remote { id: String, path: String },
}

impl Side {
    /// `ID:/path` is remote when `ID` looks like a sandbox id (no `/`, no `.` prefix), so
    /// `./a:b` and `/tmp/a:b` stay local.
    pub fn parse(s: &str) -> Side {
        if let Some((id, path)) = s.split_once(':') {
            let is_id = !id.is_empty()
                && !id.starts_with('.')
                && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
            if is_id {
                let path = if path.is_empty() { "." } else { path };
                return Side::Remote { id: id.into(), path: path.into() };
            }
        }
        Side::Local(PathBuf::from(s))
    }
}

/// What a pull left out or changed, if anything: the sandbox sent entries a pull refuses to
/// create as they are.
fn pull_warning(r: &PullReport) -> Option<String> {
    let counts = [
        (r.skipped_devices, "device"),
        (r.skipped_fifos, "FIFO"),
        (r.skipped_unsafe_paths, "unsafe path"),
        (r.skipped_links, "unsafe link"),
    ];
    let skipped: Vec<String> = counts
        .iter()
        .filter(|(n, _)| *n > 0)
        .map(|(n, what)| format!("{n} {what}{}", if *n == 1 { "" } else { "s" }))
        .collect();
    let mut parts = vec![];
    if !skipped.is_empty() {
        parts.push(format!("skipped {}", skipped.join(", ")));
    }
    if r.cleared_setid > 0 {
        let n = r.cleared_setid;
        let entries = if n == 1 { "entry" } else { "entries" };
        parts.push(format!("cleared set-uid/set-gid on {n} {entries}"));
    }
    (!parts.is_empty()).then(|| format!("the pulled tar was not taken as is: {}", parts.join("; ")))
}

fn remote_name(path: &str) -> Option<&str> {
    path.trim_end_matches('/').rsplit('/').next().filter(|n| !n.is_empty() && *n != ".")
}

fn join_remote(dir: &str, name: &str) -> String {
    format!("{}/{name}", dir.trim_end_matches('/'))
}

/// What a remote path is, or `None` if it does not exist.
async fn remote_kind(sandbox: &Sandbox, path: &str) -> anyhow::Result<Option<FileKind>> {
    match sandbox.stat(path).await {
        Ok(s) => Ok(Some(s.kind)),
        Err(e) if e.agent_kind() == Some(ErrorKind::NotFound) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

pub async fn run(
    client: &Client,
    sandbox_token: Option<&str>,
    src: &str,
    dst: &str,
) -> anyhow::Result<u64> {
    let mut progress = ProgressLine::new();
    let moved = match (Side::parse(src), Side::parse(dst)) {
        (Side::Local(from), Side::Remote { id, path }) => {
            let sandbox = client.sandbox(&id, sandbox_token).await?;
            let meta = std::fs::metadata(&from).with_context(|| from.display().to_string())?;
            let into_dir = remote_kind(&sandbox, &path).await? == Some(FileKind::Dir);
            let local_name = from.file_name().and_then(|n| n.to_str());
            let path = match (into_dir, local_name) {
                (true, Some(name)) => join_remote(&path, name),
                _ => path,
            };
            let transfer = if meta.is_dir() {
                sandbox.push(&from, &path)
            } else {
                sandbox.push_file(&from, &path)
            };
            transfer.progress(|n| progress.update(n)).await?
        }
        (Side::Remote { id, path }, Side::Local(to)) => {
            let sandbox = client.sandbox(&id, sandbox_token).await?;
            let kind = remote_kind(&sandbox, &path)
                .await?
                .with_context(|| format!("{id}:{path} does not exist"))?;
            let into_dir = to.is_dir();
            let transfer = match (kind == FileKind::Dir, into_dir, remote_name(&path)) {
                (true, true, Some(name)) => sandbox.pull(&path, to.join(name)),
                (true, _, _) => sandbox.pull(&path, &to),
                (false, true, _) => sandbox.pull(&path, &to),
                (false, false, _) => sandbox.pull_file(&path, &to),
            };
            let report = transfer.progress(|n| progress.update(n)).await?;
            progress.finish();
            if let Some(warning) = pull_warning(&report) {
                eprintln!("sbx: warning: {warning}");
            }
            report.bytes
        }
        (Side::Local(_), Side::Local(_)) => bail!("neither side is in a sandbox (write ID:/path)"),
        (Side::Remote { .. }, Side::Remote { .. }) => {
            bail!("both sides are in sandboxes; copy through a local directory")
        }
    };
    progress.finish();
    Ok(moved)
}

/// One line on stderr, rewritten in place at most a few times a second, for copies past a few
/// MiB, and only when stderr is a terminal (scripts get no noise).
struct ProgressLine {
    enabled: bool,
    shown: bool,
    last: Instant,
}

impl ProgressLine {
    fn new() -> ProgressLine {
        ProgressLine {
            enabled: std::io::stderr().is_terminal(),
            shown: false,
            last: Instant::now(),
        }
    }

    fn update(&mut self, bytes: u64) {
        if !self.enabled || bytes < 8 << 20 || self.last.elapsed() < Duration::from_millis(200) {
            return;
        }
        self.last = Instant::now();
        self.shown = true;
        let mut err = std::io::stderr();
        let _ = write!(err, "\rcopied {:.1} MiB", bytes as f64 / (1 << 20) as f64);
        let _ = err.flush();
    }

    fn finish(&mut self) {
        if self.shown {
            self.shown = false;
            eprintln!();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sides_parse_like_scp() {
        assert_eq!(
            Side::parse("sb-1:/tmp/x"),
            Side::Remote { id: "sb-1".into(), path: "/tmp/x".into() }
        );
        assert_eq!(Side::parse("sb-1:"), Side::Remote { id: "sb-1".into(), path: ".".into() });
        assert_eq!(Side::parse("./a:b"), Side::Local("./a:b".into()));
        assert_eq!(Side::parse("/tmp/a:b"), Side::Local("/tmp/a:b".into()));
        assert_eq!(Side::parse("plain"), Side::Local("plain".into()));
        assert_eq!(remote_name("/a/b/"), Some("b"));
        assert_eq!(remote_name("/"), None);
        assert_eq!(join_remote("/a/", "b"), "/a/b");
    }

    #[test]
    fn a_pull_warns_only_when_something_was_left_out() {
        let mut r = PullReport::default();
        assert_eq!(pull_warning(&r), None);
        r.skipped_devices = 2;
        r.skipped_unsafe_paths = 1;
        r.cleared_setid = 1;
        assert_eq!(
            pull_warning(&r).unwrap(),
            "the pulled tar was not taken as is: skipped 2 devices, 1 unsafe path; \
             cleared set-uid/set-gid on 1 entry"
        );
    }
}
