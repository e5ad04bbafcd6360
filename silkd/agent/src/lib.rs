//! silkd: the agent inside every sandbox. It serves silk-proto on one listener (unix socket,
//! TCP or vsock) and runs as PID 1 of the sandbox or as an ordinary process.
//!
//! One module per verb family: `process` (exec, spawn, ps, logs, attach, kill), `files`
//! (read, write, stat, list, mkdir, rm, rename), `tree` (tar push and pull), `session`
//! (persistent shells), `pty` (terminals), `search` (find, replace), `watch` (inotify), `git`,
//! `forward` (port forwarding). `server` owns the accept loop and the per-connection call loop
//! and dispatches each request to its verb; `call` holds what every verb shares (the `Agent`
//! state, `Fail`). State tables sit below the verbs: `procs` owns children and reaping,
//! `sessions` the live shells, `ptys` the live terminals. Imports only go down that list
//! (server → verbs → call → tables), never back up; a verb may use another verb module's
//! helpers (`files`' path checks, `process`'s `KillOnDrop`), and those modules import no verb.

mod call;
mod fail;
mod files;
mod forward;
mod git;
mod listen;
pub mod log;
mod process;
mod procs;
mod pty;
mod ptys;
mod ring;
mod search;
mod server;
mod session;
mod sessions;
mod tree;
mod users;
mod watch;

pub use call::{Agent, Options};
pub use listen::{ListenAddr, Listener};
pub use procs::Defaults;
pub use server::run;
