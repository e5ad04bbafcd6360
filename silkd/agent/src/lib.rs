//! silkd: the agent inside every sandbox. It serves silk-proto on one listener (unix socket,
//! TCP or vsock) and runs as PID 1 of the sandbox or as an ordinary process.
//!
//! One module per verb family: `process` (exec, spawn, ps, logs, attach, kill), `files`
//! (read, write, stat, list, mkdir, rm, rename), `tree` (tar push and pull). `server` owns the
//! accept loop and the per-connection call loop; `procs` owns children and reaping.

mod files;
mod listen;
mod process;
mod procs;
mod ring;
mod server;
mod tree;
mod users;

pub use listen::{ListenAddr, Listener};
pub use server::{Agent, Options, run};
