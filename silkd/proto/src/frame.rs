//! Every frame that crosses the wire, in both directions, as one enum.
//!
//! The postcard encoding of an enum starts with the variant index, so **variants are only ever
//! appended**: reordering or removing one changes the wire format (the golden fixtures catch it).
//! The four byte-stream variants come first so their tag is a single byte the codec can recognise
//! and slice without copying (see `codec`).

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::error::ErrorKind;

/// One frame. Requests go client → agent, replies agent → client; the byte-stream and control
/// variants are used by both sides as documented on each.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Frame {
    // ---- byte streams (tags 0..=3; decoded as slices of the read buffer) ----
    /// Client → agent: bytes for the foreground process's stdin.
    Stdin(Bytes),
    /// Agent → client: process stdout.
    Stdout(Bytes),
    /// Agent → client: process stderr.
    Stderr(Bytes),
    /// Either way: file or tar content (`Write`/`Push` upload, `Read`/`Pull` download).
    Data(Bytes),

    // ---- stream control ----
    /// Client → agent: the client's input stream for this call is complete. Agent → client
    /// (`PortForward` only): the far side's byte stream is complete.
    Eof,
    /// Client → agent: abandon the running call (the foreground process is killed).
    Cancel,

    // ---- terminal frames: every call ends with exactly one of these ----
    /// A process call ended.
    Exit(ExitStatus),
    /// A non-process call succeeded.
    Done,
    /// The call failed; the connection stays usable unless its framing broke.
    Error(WireError),

    // ---- requests ----
    /// Optional first frame of a connection.
    Hello(Hello),
    /// Readiness probe and counters.
    Info,
    /// Run a foreground process, streaming its stdio.
    Exec(ExecRequest),
    /// Start a detached process whose output is kept in a bounded ring.
    Spawn(Command),
    /// List processes started by the agent.
    Ps,
    /// Replay a detached process's output ring.
    Logs {
        pid: u32,
    },
    /// Replay then follow a detached process's output until it exits.
    Attach {
        pid: u32,
    },
    /// Send a signal to a live process (its process group).
    Kill {
        pid: u32,
        signal: i32,
    },
    /// Stream a file's content.
    Read(ReadRequest),
    /// Replace a file atomically with the `Data` frames that follow, ended by `Eof`.
    Write(WriteRequest),
    /// Metadata of one path (not following a final symlink).
    Stat {
        path: String,
    },
    /// Directory entries, sent in batches.
    List {
        path: String,
    },
    Mkdir {
        path: String,
        parents: bool,
    },
    Rm {
        path: String,
        recursive: bool,
    },
    Rename {
        from: String,
        to: String,
    },
    /// Extract the tar stream carried by the following `Data` frames (ended by `Eof`) into a
    /// directory; nothing changes unless the stream ends cleanly.
    Push {
        path: String,
    },
    /// Send a path (file or tree) as a tar stream.
    Pull {
        path: String,
    },

    // ---- replies (always followed by a terminal frame) ----
    Welcome(Welcome),
    InfoReply(AgentInfo),
    /// First frame of an `Exec`: the foreground process is running.
    Started {
        pid: u32,
    },
    Spawned {
        pid: u32,
    },
    Procs(Vec<ProcInfo>),
    StatReply(FileStat),
    Entries(Vec<DirEntry>),
    /// `Attach`/`Logs`: this many bytes fell out of the ring before they could be sent.
    Dropped {
        bytes: u64,
    },

    // ---- sessions, pty, search, watch, git, port forwarding (appended in protocol 1) ----
    /// Start a persistent shell session.
    SessionCreate(SessionRequest),
    /// List live sessions.
    SessionList,
    /// End a session (its shell's process group is killed).
    SessionRm {
        id: String,
    },
    /// Run a script in a session's shell; `cd` and `export` carry over to later calls.
    SessionExec(SessionExecRequest),
    /// Run a command on a new pseudo-terminal, streaming its input and output.
    PtyOpen(PtyRequest),
    /// Set a pty's window size: a request of its own (any connection), or a control frame
    /// inside the `PtyOpen` call that owns the pty.
    PtyResize {
        pid: u32,
        cols: u16,
        rows: u16,
    },
    /// Search file contents under a tree.
    Find(FindRequest),
    /// Rewrite files with a regex, atomically per file.
    Replace(ReplaceRequest),
    /// Stream filesystem events under a path until the client sends `Cancel`.
    Watch(WatchRequest),
    /// Run one git operation.
    Git(GitRequest),
    /// A byte stream to `127.0.0.1:port` inside the sandbox.
    PortForward {
        port: u16,
    },
    /// `Watch`: every watch is armed; `PortForward`: connected. Nothing after it is missed.
    Ready,
    /// `SessionCreate` (the new session) and `SessionList`.
    Sessions(Vec<SessionInfo>),
    /// `Find`: a batch of matching lines.
    Matches(Vec<Match>),
    /// `Replace`: one file done.
    Replaced {
        path: String,
        count: u64,
    },
    /// `Watch`: a batch of events, in the order they happened.
    Events(Vec<WatchEvent>),
    /// `Git`: the structured result of operations that have one.
    GitReply(GitReply),

    // ---- appended after protocol 1 (an older agent answers it `BadRequest`) ----
    /// The node, before a process checkpoint: every other connection is closed (their
    /// foreground processes end as on any hang-up), then `Done`, then this connection closes
    /// too, so the sandbox holds no socket of the host's when it is dumped.
    Quiesce,
    /// Give a path (not following a final symlink) to a user (see [`Command::user`]) and its
    /// primary group: what a client writing files on a user's behalf asks after the write.
    Chown {
        path: String,
        user: String,
    },
}

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

impl Frame {
    /// True for the frames that end a call.
    pub fn is_terminal(&self) -> bool {
        matches!(self, Frame::Exit(_) | Frame::Done | Frame::Error(_))
    }

    /// The variant's name, for logs and for the fixture test. The match is exhaustive on
    /// purpose: a new variant does not compile until it is named here and in [`Frame::NAMES`].
    pub fn name(&self) -> &'static str {
        match self {
            Frame::Stdin(_) => "Stdin",
            Frame::Stdout(_) => "Stdout",
            Frame::Stderr(_) => "Stderr",
            Frame::Data(_) => "Data",
            Frame::Eof => "Eof",
            Frame::Cancel => "Cancel",
            Frame::Exit(_) => "Exit",
            Frame::Done => "Done",
            Frame::Error(_) => "Error",
            Frame::Hello(_) => "Hello",
            Frame::Info => "Info",
            Frame::Exec(_) => "Exec",
            Frame::Spawn(_) => "Spawn",
            Frame::Ps => "Ps",
            Frame::Logs { .. } => "Logs",
            Frame::Attach { .. } => "Attach",
            Frame::Kill { .. } => "Kill",
            Frame::Read(_) => "Read",
            Frame::Write(_) => "Write",
            Frame::Stat { .. } => "Stat",
            Frame::List { .. } => "List",
            Frame::Mkdir { .. } => "Mkdir",
            Frame::Rm { .. } => "Rm",
            Frame::Rename { .. } => "Rename",
            Frame::Push { .. } => "Push",
            Frame::Pull { .. } => "Pull",
            Frame::Welcome(_) => "Welcome",
            Frame::InfoReply(_) => "InfoReply",
            Frame::Started { .. } => "Started",
            Frame::Spawned { .. } => "Spawned",
            Frame::Procs(_) => "Procs",
            Frame::StatReply(_) => "StatReply",
            Frame::Entries(_) => "Entries",
            Frame::Dropped { .. } => "Dropped",
            Frame::SessionCreate(_) => "SessionCreate",
            Frame::SessionList => "SessionList",
            Frame::SessionRm { .. } => "SessionRm",
            Frame::SessionExec(_) => "SessionExec",
            Frame::PtyOpen(_) => "PtyOpen",
            Frame::PtyResize { .. } => "PtyResize",
            Frame::Find(_) => "Find",
            Frame::Replace(_) => "Replace",
            Frame::Watch(_) => "Watch",
            Frame::Git(_) => "Git",
            Frame::PortForward { .. } => "PortForward",
            Frame::Ready => "Ready",
            Frame::Sessions(_) => "Sessions",
            Frame::Matches(_) => "Matches",
            Frame::Replaced { .. } => "Replaced",
            Frame::Events(_) => "Events",
            Frame::GitReply(_) => "GitReply",
            Frame::Quiesce => "Quiesce",
            Frame::Chown { .. } => "Chown",
        }
    }

    /// Every variant name, in wire-tag order.
    pub const NAMES: &'static [&'static str] = &[
        "Stdin",
        "Stdout",
        "Stderr",
        "Data",
        "Eof",
        "Cancel",
        "Exit",
        "Done",
        "Error",
        "Hello",
        "Info",
        "Exec",
        "Spawn",
        "Ps",
        "Logs",
        "Attach",
        "Kill",
        "Read",
        "Write",
        "Stat",
        "List",
        "Mkdir",
        "Rm",
        "Rename",
        "Push",
        "Pull",
        "Welcome",
        "InfoReply",
        "Started",
        "Spawned",
        "Procs",
        "StatReply",
        "Entries",
        "Dropped",
        "SessionCreate",
        "SessionList",
        "SessionRm",
        "SessionExec",
        "PtyOpen",
        "PtyResize",
        "Find",
        "Replace",
        "Watch",
        "Git",
        "PortForward",
        "Ready",
        "Sessions",
        "Matches",
        "Replaced",
        "Events",
        "GitReply",
        "Quiesce",
        "Chown",
    ];
}
