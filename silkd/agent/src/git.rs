//! The `git` verb: one operation per call, run with the sandbox's own `git` binary (`--git`,
//! found in the children's base `PATH` unless given as a path) through the process table.
//!
//! Output is parsed from git's machine formats (`status --porcelain=v2 --branch -z`,
//! `for-each-ref` with NUL separators) under `LC_ALL=C`; failures become typed errors carrying
//! git's own message. A missing binary is `Unsupported`, a directory that is not a repository is
//! `NotFound`. `Cancel` or a client that leaves kills git.
//!
//! **Credentials** for `clone`/`pull`/`push` never touch the disk or any argv: they travel in
//! two environment variables of the git process only (`SILK_GIT_USERNAME`,
//! `SILK_GIT_PASSWORD`; environments are readable only by the same user and root), and the one
//! credential helper git is given (`-c credential.helper=` first clears any configured helper,
//! such as `store`, that could write them to disk) is a shell function that prints them back.
//! `GIT_TERMINAL_PROMPT=0` makes a missing or wrong credential fail instead of waiting on a
//! prompt.

use std::path::{Path, PathBuf};

use silk_proto::{
    Command, ErrorKind, Frame, FrameReader, FrameWriter, GitBranch, GitFile, GitOp, GitReply,
    GitRequest, GitStatus, ProtoError, WireError,
};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite};

use crate::call::{Agent, CallResult, Fail};
use crate::files::{checked_path, io_error};
use crate::process::KillOnDrop;
use crate::procs::BASE_PATH;

/// git's stdout kept at most (status of a huge tree); past it the status is truncated.
const MAX_STDOUT: u64 = 32 << 20;
/// git's stderr kept at most, for error messages.
const MAX_STDERR: u64 = 64 << 10;
const DEFAULT_STATUS_LIMIT: u32 = 1000;

const HELPER: &str = "!f() { test \"$1\" = get && \
    printf 'username=%s\\npassword=%s\\n' \"$SILK_GIT_USERNAME\" \"$SILK_GIT_PASSWORD\"; }; f";

/// What one git run produced.
struct Output {
    code: i32,
    stdout: Vec<u8>,
    stderr: String,
    /// stdout was longer than [`MAX_STDOUT`] and was cut.
    cut: bool,
}

pub async fn git<R, W>(
    agent: &Agent,
    req: GitRequest,
    rd: &mut FrameReader<R>,
    wr: &mut FrameWriter<W>,
) -> CallResult
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let repo = checked_path(&req.repo)?;
    let binary = find_git(&agent.options.git).ok_or_else(|| {
        WireError::new(
            ErrorKind::Unsupported,
            format!("git is not installed in this sandbox ({} not found)", agent.options.git),
        )
    })?;
    let work = async {
        let git = Git { agent, binary: &binary, repo: &repo, user: req.user.clone() };
        git.op(req.op, req.credentials).await
    };
    let reply = tokio::select! {
        reply = work => reply?,
        frame = rd.recv() => match frame {
            // Dropping `work` kills git (see `Git::run`).
            Ok(Some(Frame::Cancel)) => {
                return Err(Fail::Call(WireError::new(ErrorKind::Conflict, "git cancelled")));
            }
            Ok(Some(other)) => {
                return Err(Fail::Call(WireError::new(
                    ErrorKind::BadRequest,
                    format!("{} sent during a git call; git was stopped", other.name()),
                )));
            }
            Ok(None) => return Err(Fail::Conn(ProtoError::Truncated)),
            Err(e) => return Err(Fail::Conn(e)),
        },
    };
    if let Some(reply) = reply {
        wr.queue(&Frame::GitReply(reply))?;
    }
    Ok(wr.send(&Frame::Done).await?)
}

/// The git binary: `--git` as a path, or looked up in the children's base `PATH`.
fn find_git(name: &str) -> Option<PathBuf> {
    let runnable = |p: &Path| {
        use std::os::unix::fs::PermissionsExt;
        std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    };
    if name.contains('/') {
        return Some(PathBuf::from(name)).filter(|p| runnable(p));
    }
    BASE_PATH.split(':').map(|dir| Path::new(dir).join(name)).find(|p| runnable(p))
}

struct Git<'a> {
    agent: &'a Agent,
    binary: &'a Path,
    repo: &'a Path,
    user: Option<String>,
}

impl Git<'_> {
    async fn op(
        &self,
        op: GitOp,
        credentials: Option<silk_proto::GitCredentials>,
    ) -> Result<Option<GitReply>, WireError> {
        let mut env: Vec<(String, String)> = vec![];
        let mut args: Vec<String> = vec![];
        if let Some(c) = credentials {
            if [&c.username, &c.password].iter().any(|s| s.contains(['\n', '\0'])) {
                return Err(WireError::new(ErrorKind::BadRequest, "credentials contain a newline"));
            }
            env.push(("SILK_GIT_USERNAME".into(), c.username));
            env.push(("SILK_GIT_PASSWORD".into(), c.password));
            args.extend(["-c".into(), "credential.helper=".into()]);
            args.extend(["-c".into(), format!("credential.helper={HELPER}")]);
        }
        let arg = |s: &str| s.to_string();
        match op {
            GitOp::Status { limit } => {
                self.need_repo()?;
                let limit = limit.unwrap_or(DEFAULT_STATUS_LIMIT) as usize;
                args.extend(["status", "--porcelain=v2", "--branch", "-z"].map(arg));
                // Status only reads; do not take the index lock to refresh it.
                env.push(("GIT_OPTIONAL_LOCKS".into(), "0".into()));
                let out = self.run_ok("status", args, env, self.repo).await?;
                let mut status = parse_status(&out.stdout, limit);
                status.truncated |= out.cut;
                Ok(Some(GitReply::Status(status)))
            }
            GitOp::Add { paths } => {
                self.need_repo()?;
                args.extend(["add", "-A", "--"].map(arg));
                args.extend(paths);
                self.run_ok("add", args, env, self.repo).await.map(|_| None)
            }
            GitOp::Commit { message, author } => {
                self.need_repo()?;
                if let Some(a) = author {
                    for who in ["AUTHOR", "COMMITTER"] {
                        env.push((format!("GIT_{who}_NAME"), a.name.clone()));
                        env.push((format!("GIT_{who}_EMAIL"), a.email.clone()));
                    }
                }
                // The message is the caller's own text, not a secret: argv is fine for it.
                args.extend(["commit", "-q", "-m"].map(arg));
                args.push(message);
                self.run_ok("commit", args, env, self.repo).await?;
                let out = self
                    .run_ok("rev-parse", vec![arg("rev-parse"), arg("HEAD")], vec![], self.repo)
                    .await?;
                let oid = String::from_utf8_lossy(&out.stdout).trim().to_string();
                Ok(Some(GitReply::Committed { oid }))
            }
            GitOp::BranchList => {
                self.need_repo()?;
                let format =
                    "--format=%(HEAD)%00%(refname:short)%00%(objectname)%00%(upstream:short)";
                args.extend(["for-each-ref", format, "refs/heads"].map(arg));
                let out = self.run_ok("branch list", args, env, self.repo).await?;
                Ok(Some(GitReply::Branches(parse_branches(&out.stdout))))
            }
            GitOp::BranchCreate { name, start } => {
                self.need_repo()?;
                args.extend([arg("branch"), not_option(name)?]);
                args.extend(start.map(not_option).transpose()?);
                self.run_ok("branch create", args, env, self.repo).await.map(|_| None)
            }
            GitOp::Checkout { branch } => {
                self.need_repo()?;
                args.extend([arg("switch"), not_option(branch)?]);
                self.run_ok("checkout", args, env, self.repo).await.map(|_| None)
            }
            GitOp::BranchDelete { name, force } => {
                self.need_repo()?;
                args.extend([
                    arg("branch"),
                    arg(if force { "-D" } else { "-d" }),
                    not_option(name)?,
                ]);
                self.run_ok("branch delete", args, env, self.repo).await.map(|_| None)
            }
            GitOp::Clone { url, branch } => {
                if std::fs::symlink_metadata(self.repo).is_ok_and(|m| !m.is_dir())
                    || std::fs::read_dir(self.repo).is_ok_and(|mut d| d.next().is_some())
                {
                    return Err(WireError::new(
                        ErrorKind::Conflict,
                        format!("{} exists and is not an empty directory", self.repo.display()),
                    ));
                }
                let parent = match self.repo.parent() {
                    Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
                    _ => PathBuf::from("."),
                };
                std::fs::metadata(&parent).map_err(|e| io_error(&parent, e))?;
                env.push(("GIT_TERMINAL_PROMPT".into(), "0".into()));
                args.extend(["clone", "-q"].map(arg));
                if let Some(b) = branch {
                    args.extend([arg("--branch"), not_option(b)?]);
                }
                args.extend([arg("--"), url, self.repo.to_string_lossy().into_owned()]);
                self.run_ok("clone", args, env, &parent).await.map(|_| None)
            }
            GitOp::Pull { remote, branch } => {
                self.need_repo()?;
                env.push(("GIT_TERMINAL_PROMPT".into(), "0".into()));
                args.extend(["pull", "-q", "--ff-only"].map(arg));
                args.extend(remote.map(not_option).transpose()?);
                args.extend(branch.map(not_option).transpose()?);
                self.run_ok("pull", args, env, self.repo).await.map(|_| None)
            }
            GitOp::Push { remote, branch, set_upstream } => {
                self.need_repo()?;
                env.push(("GIT_TERMINAL_PROMPT".into(), "0".into()));
                args.extend(["push", "-q"].map(arg));
                if set_upstream {
                    args.push(arg("--set-upstream"));
                }
                args.extend(remote.map(not_option).transpose()?);
                args.extend(branch.map(not_option).transpose()?);
                self.run_ok("push", args, env, self.repo).await.map(|_| None)
            }
        }
    }

    /// The repository directory must exist; whether it is a repository, git says.
    fn need_repo(&self) -> Result<(), WireError> {
        match std::fs::metadata(self.repo) {
            Ok(m) if m.is_dir() => Ok(()),
            Ok(_) => Err(WireError::new(
                ErrorKind::BadRequest,
                format!("{} is not a directory", self.repo.display()),
            )),
            Err(e) => Err(io_error(self.repo, e)),
        }
    }

    /// Runs git and turns a non-zero exit into a typed error.
    async fn run_ok(
        &self,
        what: &str,
        args: Vec<String>,
        env: Vec<(String, String)>,
        cwd: &Path,
    ) -> Result<Output, WireError> {
        let out = self.run(args, env, cwd).await?;
        if out.code != 0 {
            return Err(git_error(what, self.repo, &out));
        }
        Ok(out)
    }

    async fn run(
        &self,
        args: Vec<String>,
        mut env: Vec<(String, String)>,
        cwd: &Path,
    ) -> Result<Output, WireError> {
        env.push(("LC_ALL".into(), "C".into()));
        let mut argv = vec![self.binary.to_string_lossy().into_owned()];
        argv.extend(args);
        let cmd = Command {
            argv,
            cwd: Some(cwd.to_string_lossy().into_owned()),
            env,
            user: self.user.clone(),
        };
        let child = self.agent.procs.start(&cmd, false)?;
        // If this future is dropped (cancel, client gone), git dies with it.
        let mut guard = KillOnDrop { procs: &self.agent.procs, pid: Some(child.pid) };
        let (pid, procs) = (child.pid, &self.agent.procs);
        let mut stdout_pipe = child.stdout;
        let stdout = async {
            let mut out = Vec::new();
            let read = (&mut stdout_pipe).take(MAX_STDOUT + 1).read_to_end(&mut out).await;
            let cut = out.len() as u64 > MAX_STDOUT;
            if cut || read.is_err() {
                // Too much to keep (a status of a huge tree): stop git rather than read on. This
                // also ends its stderr, which the other half of the join is reading.
                out.truncate(MAX_STDOUT as usize);
                let _ = procs.kill(pid, libc::SIGKILL);
            }
            (out, cut)
        };
        // Read stderr to its end (so git never blocks on it) but keep only its head.
        let stderr = async {
            let mut kept = Vec::new();
            let mut buf = vec![0u8; 16 * 1024];
            let mut pipe = child.stderr;
            while let Ok(n @ 1..) = pipe.read(&mut buf).await {
                let room = (MAX_STDERR as usize).saturating_sub(kept.len());
                kept.extend_from_slice(&buf[..n.min(room)]);
            }
            kept
        };
        let ((stdout, cut), stderr) = tokio::join!(stdout, stderr);
        let status = child
            .exited
            .await
            .map_err(|_| WireError::new(ErrorKind::Internal, "git's exit status was lost"))?;
        guard.pid = None;
        Ok(Output {
            code: if cut { 0 } else { status.code },
            stdout,
            stderr: String::from_utf8_lossy(&stderr).into_owned(),
            cut,
        })
    }
}

/// Refuses a name git would read as an option.
fn not_option(name: String) -> Result<String, WireError> {
    if name.is_empty() || name.starts_with('-') {
        return Err(WireError::new(ErrorKind::BadRequest, format!("bad git name {name:?}")));
    }
    Ok(name)
}

/// Maps a failed git run to an error kind by git's (C locale) message.
fn git_error(what: &str, repo: &Path, out: &Output) -> WireError {
    let text = format!("{}\n{}", out.stderr, String::from_utf8_lossy(&out.stdout));
    let lower = text.to_lowercase();
    let has = |needles: &[&str]| needles.iter().any(|n| lower.contains(n));
    let kind = if has(&["not a git repository"]) {
        return WireError::new(
            ErrorKind::NotFound,
            format!("{} is not a git repository", repo.display()),
        );
    } else if has(&[
        "authentication failed",
        "could not read username",
        "could not read password",
        "permission denied",
        "returned error: 403",
    ]) {
        ErrorKind::PermissionDenied
    } else if has(&[
        "could not resolve host",
        "connection refused",
        "timed out",
        "unable to access",
        "could not read from remote",
    ]) {
        ErrorKind::Unavailable
    } else if has(&[
        "already exists",
        "nothing to commit",
        "not fully merged",
        "rejected",
        "conflict",
        "would be overwritten",
        "not possible to fast-forward",
        "diverging",
    ]) {
        ErrorKind::Conflict
    } else if has(&[
        "did not match any",
        "not found",
        "does not exist",
        "invalid reference",
        "no such",
    ]) {
        ErrorKind::NotFound
    } else {
        ErrorKind::BadRequest
    };
    let message: String =
        text.trim().lines().filter(|l| !l.trim().is_empty()).collect::<Vec<_>>().join("; ");
    let message: String = message.chars().take(2000).collect();
    WireError::new(kind, format!("git {what} failed (exit {}): {message}", out.code))
}

/// Parses `git status --porcelain=v2 --branch -z`, keeping the first `limit` files.
fn parse_status(out: &[u8], limit: usize) -> GitStatus {
    let mut status = GitStatus {
        branch: None,
        oid: None,
        upstream: None,
        ahead: 0,
        behind: 0,
        files: vec![],
        truncated: false,
    };
    let text = String::from_utf8_lossy(out);
    let mut records = text.split('\0').filter(|r| !r.is_empty());
    while let Some(record) = records.next() {
        if let Some(header) = record.strip_prefix("# ") {
            let (key, value) = header.split_once(' ').unwrap_or((header, ""));
            match key {
                "branch.oid" if value != "(initial)" => status.oid = Some(value.into()),
                "branch.head" if value != "(detached)" => status.branch = Some(value.into()),
                "branch.upstream" => status.upstream = Some(value.into()),
                "branch.ab" => {
                    for part in value.split(' ') {
                        if let Some(n) = part.strip_prefix('+') {
                            status.ahead = n.parse().unwrap_or(0);
                        } else if let Some(n) = part.strip_prefix('-') {
                            status.behind = n.parse().unwrap_or(0);
                        }
                    }
                }
                _ => {}
            }
            continue;
        }
        // Fields before the path: ordinary 8, renamed/copied 9 (then the original path as its
        // own record), unmerged 10, untracked/ignored 1.
        let (fields, renamed) = match record.as_bytes().first() {
            Some(b'1') => (8, false),
            Some(b'2') => (9, true),
            Some(b'u') => (10, false),
            Some(b'?') => (1, false),
            _ => continue, // `!` (ignored) is never asked for
        };
        let parts: Vec<&str> = record.splitn(fields + 1, ' ').collect();
        let Some(path) = parts.get(fields) else { continue };
        let orig_path = if renamed { records.next().map(str::to_string) } else { None };
        if status.files.len() >= limit {
            status.truncated = true;
            continue;
        }
        let (staged, unstaged) = if fields == 1 {
            ('?', '?')
        } else {
            let mut xy = parts.get(1).unwrap_or(&"..").chars();
            (xy.next().unwrap_or('.'), xy.next().unwrap_or('.'))
        };
        status.files.push(GitFile { path: path.to_string(), orig_path, staged, unstaged });
    }
    status
}

/// Parses `for-each-ref` lines of `HEAD\0name\0oid\0upstream`.
fn parse_branches(out: &[u8]) -> Vec<GitBranch> {
    String::from_utf8_lossy(out)
        .lines()
        .filter_map(|line| {
            let f: Vec<&str> = line.split('\0').collect();
            let [head, name, oid, upstream] = f[..] else { return None };
            Some(GitBranch {
                name: name.into(),
                current: head == "*",
                oid: oid.into(),
                upstream: Some(upstream.to_string()).filter(|u| !u.is_empty()),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn porcelain_v2_is_parsed_with_renames_and_a_limit() {
        let out = b"# branch.oid 1111111111111111111111111111111111111111\0\
# branch.head main\0# branch.upstream origin/main\0# branch.ab +2 -1\0\
1 M. N... 100644 100644 100644 aaaa bbbb src/a b.rs\0\
2 R. N... 100644 100644 100644 aaaa aaaa R100 new.rs\0old.rs\0\
u UU N... 100644 100644 100644 100644 a b c both.rs\0\
? untracked file.txt\0";
        let s = parse_status(out, 10);
        assert_eq!(s.branch.as_deref(), Some("main"));
        assert_eq!(s.upstream.as_deref(), Some("origin/main"));
        assert_eq!((s.ahead, s.behind), (2, 1));
        let files: Vec<_> = s
            .files
            .iter()
            .map(|f| (f.path.as_str(), f.orig_path.as_deref(), f.staged, f.unstaged))
            .collect();
        assert_eq!(
            files,
            vec![
                ("src/a b.rs", None, 'M', '.'),
                ("new.rs", Some("old.rs"), 'R', '.'),
                ("both.rs", None, 'U', 'U'),
                ("untracked file.txt", None, '?', '?'),
            ]
        );
        assert!(!s.truncated);
        let s = parse_status(out, 2);
        assert_eq!(s.files.len(), 2);
        assert!(s.truncated);

        let fresh = parse_status(b"# branch.oid (initial)\0# branch.head (detached)\0", 10);
        assert_eq!((fresh.oid, fresh.branch), (None, None));
    }

    #[test]
    fn branches_are_parsed() {
        let b = parse_branches(b"*\0main\0abc\0origin/main\n \0dev\0def\0\n");
        assert_eq!(b.len(), 2);
        assert!(b[0].current && b[0].upstream.as_deref() == Some("origin/main"));
        assert!(!b[1].current && b[1].upstream.is_none());
    }
}
