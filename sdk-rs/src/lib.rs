//! silkmesh: the Rust SDK for silkmesh sandbox nodes.
//!
//! A [`Client`] talks to one node's HTTP API (claim, list, info, pools). A claim returns a
//! [`Sandbox`], which carries every silkd verb over the node's relay (`GET
//! /v1/sandboxes/{id}/agent` with `Upgrade: silkd`, then raw silk-proto frames):
//!
//! | family | calls |
//! |---|---|
//! | lifecycle | [`Sandbox::release`], [`Sandbox::renew`], [`Sandbox::refresh`], auto-release, [`Sandbox::hibernate`], [`Sandbox::wake`], [`Sandbox::archive`], [`Sandbox::checkpoint`], [`Sandbox::fork`], [`Sandbox::promote`], [`Client::branch`] |
//! | process | [`Sandbox::exec`] (streaming [`Exec`]), [`Sandbox::run`], `spawn`, `ps`, `logs`, `attach`, `kill` |
//! | sessions | `session_create`, `session_list`, `session_rm`, `session_exec` |
//! | pty | [`Sandbox::pty`] → [`Pty`] (read, write, resize) |
//! | files | `read`, `write`, `stat`, `list`, `mkdir`, `rm`, `rename`, [`Sandbox::push`], [`Sandbox::pull`] |
//! | search | [`Sandbox::find`] (a `Stream`), `replace`, [`Sandbox::watch`] (a `Stream`) |
//! | git | [`Sandbox::git`], `git_status` |
//! | network | [`Sandbox::forward`]: a local listener forwarded to a port inside |
//!
//! ```no_run
//! # async fn demo() -> silkmesh::Result<()> {
//! let client = silkmesh::Client::builder("http://127.0.0.1:7777").token("root-token").build()?;
//! let sandbox = client.claim("host").send().await?;
//! let out = sandbox.run(["sh", "-c", "echo hi"]).await?;
//! assert_eq!(out.stdout_str(), "hi\n");
//! sandbox.release().await?;
//! # Ok(()) }
//! ```
//!
//! Each handle keeps up to 8 idle relay connections for 30 s and reuses them (see
//! [`Sandbox::connection_stats`]); a `307` from the node is followed once. Errors are one
//! [`Error`] enum: the node's API errors, silkd's error kinds, non-zero exits where a call asked
//! for success, and transport failures.

mod client;
mod conn;
mod error;
mod files;
mod forward;
mod git;
mod http;
mod lifecycle;
#[cfg(feature = "mcp")]
pub mod mcp;
mod process;
mod pty;
mod sandbox;
mod search;
mod spare;
mod tls;

pub use client::{
    ClaimBuilder, Client, ClientBuilder, EgressPolicy, Lane, Listing, NodeInfo, PoolConfig,
    PoolStatus, Preview, SandboxInfo, SandboxState, Size, Tier,
};
pub use conn::ConnStats;
pub use error::{Error, Result};
pub use files::{PullReport, Transfer, WriteOptions};
pub use forward::PortForward;
pub use lifecycle::{Checkpoint, Memory, TemplateInfo, TemplateKind};
pub use process::{Attach, Chunk, Exec, ExecBuilder, ExecStdin, Logs, Output};
pub use pty::{Pty, PtyBuilder, PtyInput, PtyOutput};
pub use sandbox::Sandbox;
pub use search::{Find, Replaced, Watch};
pub use silk_api::FleetView;
pub use silk_api::PullStatus;

/// The wire types the SDK's calls take and return, re-exported so callers need no other crate.
pub use silk_proto::{
    AgentInfo, DirEntry, ErrorKind, EventKind, ExitStatus, FileKind, FileStat, FindRequest,
    GitAuthor, GitBranch, GitCredentials, GitFile, GitOp, GitReply, GitRequest, GitStatus, Match,
    ProcInfo, ReplaceRequest, SessionInfo, SessionRequest, WatchEvent, Welcome,
};
