//! silkd: the agent inside every sandbox. It serves silk-proto on one listener (unix socket,
//! TCP or vsock) and runs as PID 1 of the sandbox or as an ordinary process.
//!
//! One module per verb family: `process` (exec, spawn, ps, logs, attach, kill), `files`
//! (read, write, stat, list, mkdir, rm, rename), `tree` (tar push and pull), `session`
//! (persistent shells), `pty` (terminals), `search` (find, replace), `watch` (inotify), `git`,
//! `forward` (port forwarding). `server` owns the accept loop and the per-connection call loop;
//! `procs` owns children and reaping.

mod files;
mod forward;
mod git;
mod listen;
pub mod log;
mod process;
mod procs;
mod pty;
mod ring;
mod search;
mod server;
mod session;
mod tree;
mod users;
mod watch;

pub use listen::{ListenAddr, Listener};
pub use procs::Defaults;
pub use server::{Agent, Options, run};
