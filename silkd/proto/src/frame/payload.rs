//! The types [`Frame`](super::Frame)'s variants carry: exit statuses and errors, the handshake,
//! each verb family's requests and replies (processes, files, sessions and ptys, search, watch,
//! git). Apart from the enum so that its file reads as the wire's list of variants.

use serde::{Deserialize, Serialize};

use crate::error::ErrorKind;

/// How a process ended. `code` follows the shell convention: 128 + signal when killed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExitStatus {
    pub code: i32,
    pub signal: Option<i32>,
    /// The agent killed the process because the call's timeout passed.
    pub timed_out: bool,
}

/// The error carried by an `Error` frame.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{kind:?}: {message}")]
pub struct WireError {
    pub kind: ErrorKind,
    pub message: String,
}

impl WireError {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        WireError { kind, message: message.into() }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    /// The protocol version the client speaks.
    pub protocol: u32,
    /// Free-form client name, for logs.
    pub client: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Welcome {
    pub protocol: u32,
    pub agent_version: String,
    /// Verb families this agent serves, e.g. `exec`, `files`, `tar`.
    pub capabilities: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentInfo {
    pub agent_version: String,
    pub protocol: u32,
    pub uptime_ms: u64,
    /// Live processes the agent started (foreground and detached).
    pub processes: u32,
    pub sessions: u32,
    pub connections: u32,
}

/// What to run and as whom. The environment is merged onto a clean base (PATH, HOME, USER, ...).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct Command {
    pub argv: Vec<String>,
    pub cwd: Option<String>,
    pub env: Vec<(String, String)>,
    /// A user name or numeric uid from the sandbox's `/etc/passwd`; `None` keeps the agent's.
    pub user: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct ExecRequest {
    pub command: Command,
    /// The client will send `Stdin` frames (ended by `Eof`); otherwise stdin is `/dev/null`.
    pub stdin: bool,
    /// Kill the process group after this long.
    pub timeout_ms: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcInfo {
    pub pid: u32,
    pub argv: Vec<String>,
    /// Unix time in milliseconds.
    pub started_ms: u64,
    /// Started by `Spawn` (its output is kept) rather than `Exec`.
    pub detached: bool,
    /// `None` while running.
    pub exit: Option<ExitStatus>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReadRequest {
    pub path: String,
    pub offset: u64,
    /// Read at most this many bytes; `None` reads to the end.
    pub len: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WriteRequest {
    pub path: String,
    /// Permission bits for a new file (default 0o644); an existing file keeps its own.
    pub mode: Option<u32>,
    /// Create missing parent directories.
    pub parents: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum FileKind {
    File,
    Dir,
    Symlink,
    Other,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileStat {
    pub kind: FileKind,
    pub size: u64,
    /// Permission bits (`st_mode & 0o7777`).
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    /// Modification time, unix milliseconds.
    pub mtime_ms: i64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DirEntry {
    pub name: String,
    pub stat: FileStat,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct SessionRequest {
    /// A name chosen by the client (letters, digits, `-`, `_`, `.`); `None` lets the agent pick.
    pub id: Option<String>,
    pub cwd: Option<String>,
    pub env: Vec<(String, String)>,
    pub user: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionInfo {
    pub id: String,
    /// The session shell's pid (it shows in `Ps`).
    pub pid: u32,
    /// Unix time in milliseconds.
    pub created_ms: u64,
    /// Unix time in milliseconds of the end of the last call (or creation).
    pub last_used_ms: u64,
    /// A call is running in it.
    pub busy: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionExecRequest {
    pub id: String,
    /// Shell source, run by the session's `sh` as with `eval`; stdin is `/dev/null`.
    pub script: String,
    /// Kill the session after this long (its shell state is lost with it).
    pub timeout_ms: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PtyRequest {
    /// `argv` empty runs `/bin/sh`.
    pub command: Command,
    pub cols: u16,
    pub rows: u16,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FindRequest {
    /// A directory (searched recursively, symlinks not followed) or one file.
    pub path: String,
    /// A regular expression (Rust `regex` syntax), matched line by line.
    pub pattern: String,
    /// Only files whose name matches this glob (`*`, `?`, `[...]`, `{a,b}`; a glob with `/`
    /// matches the path relative to `path`, where `**` spans directories).
    pub glob: Option<String>,
    /// Skip files larger than this (default 16 MiB).
    pub max_file_bytes: Option<u64>,
    /// Stop after this many matches.
    pub max_matches: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Match {
    pub path: String,
    /// 1-based.
    pub line: u64,
    /// The line without its newline, lossily UTF-8, cut at 4 KiB.
    pub text: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplaceRequest {
    /// Files rewritten in this order; the first failure stops the call.
    pub paths: Vec<String>,
    pub pattern: String,
    /// `$1`, `${name}` expand to capture groups; `$$` is a literal `$`.
    pub replacement: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WatchRequest {
    pub path: String,
    /// Watch every directory below `path` too, including ones created later.
    pub recursive: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum EventKind {
    Created,
    Modified,
    Deleted,
    /// `path` moved to `to`, both inside the watched tree.
    Renamed,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WatchEvent {
    pub kind: EventKind,
    pub path: String,
    /// The new path of a `Renamed` event.
    pub to: Option<String>,
    pub dir: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GitRequest {
    /// The repository's working tree (for `Clone`, the directory to create).
    pub repo: String,
    pub op: GitOp,
    /// Run git as this user (see [`Command::user`]).
    pub user: Option<String>,
    /// For `Clone`/`Pull`/`Push` over http(s): handed to git in memory, never on disk or argv.
    pub credentials: Option<GitCredentials>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum GitOp {
    /// At most `limit` files (default 1000); the reply says when more were left out.
    Status {
        limit: Option<u32>,
    },
    /// Stage these paths; empty stages everything (`add -A`).
    Add {
        paths: Vec<String>,
    },
    Commit {
        message: String,
        author: Option<GitAuthor>,
    },
    BranchList,
    BranchCreate {
        name: String,
        start: Option<String>,
    },
    Checkout {
        branch: String,
    },
    BranchDelete {
        name: String,
        force: bool,
    },
    Clone {
        url: String,
        branch: Option<String>,
    },
    Pull {
        remote: Option<String>,
        branch: Option<String>,
    },
    Push {
        remote: Option<String>,
        branch: Option<String>,
        set_upstream: bool,
    },
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GitAuthor {
    pub name: String,
    pub email: String,
}

#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GitCredentials {
    pub username: String,
    pub password: String,
}

impl std::fmt::Debug for GitCredentials {
    /// Keeps the password out of logs.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GitCredentials")
            .field("username", &self.username)
            .field("password", &"<redacted>")
            .finish()
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum GitReply {
    Status(GitStatus),
    Branches(Vec<GitBranch>),
    /// `Commit`: the new commit's id.
    Committed {
        oid: String,
    },
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GitStatus {
    /// `None` on a detached HEAD.
    pub branch: Option<String>,
    /// `None` before the first commit.
    pub oid: Option<String>,
    pub upstream: Option<String>,
    pub ahead: u32,
    pub behind: u32,
    pub files: Vec<GitFile>,
    /// More files changed than the request's limit; `files` holds the first ones.
    pub truncated: bool,
}

/// One changed path. `staged` and `unstaged` are git's porcelain letters (`M`, `A`, `D`, `R`,
/// `C`, `T`, `U`) or `.` for unchanged; untracked files are `?` in both.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GitFile {
    pub path: String,
    /// The source path of a rename or copy.
    pub orig_path: Option<String>,
    pub staged: char,
    pub unstaged: char,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GitBranch {
    pub name: String,
    pub current: bool,
    pub oid: String,
    pub upstream: Option<String>,
}
