//! Every frame that crosses the wire, in both directions, as one enum.
//!
//! The postcard encoding of an enum starts with the variant index, so **variants are only ever
//! appended**: reordering or removing one changes the wire format (the golden fixtures catch it).
//! The four byte-stream variants come first so their tag is a single byte the codec can recognise
//! and slice without copying (see `codec`).
//!
//! This file holds the enum, its tag order and its names; the types its variants carry are in
//! `payload`, re-exported here.

use bytes::Bytes;
use serde::{Deserialize, Serialize};

mod payload;

pub use payload::*;

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
