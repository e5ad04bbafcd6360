//! What every verb gets and gives back: the shared [`Agent`] state and its [`Options`], and the
//! [`Fail`]/[`CallResult`] a call ends with.
//!
//! This sits between the dispatch (`server`) and the state tables (`procs`, `sessions`, `ptys`):
//! verbs import it, it imports only the tables, so no verb needs `server` and `server` is the
//! only module that knows every verb.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64};
use std::time::{Duration, Instant};

use silk_proto::{ErrorKind, Frame, ProtoError, WireError};

use crate::procs::{Defaults, Procs};
use crate::ptys::Ptys;
use crate::sessions::Sessions;

/// Tunables.
#[derive(Debug, Clone)]
pub struct Options {
    /// Bytes of output kept per detached process.
    pub ring_bytes: usize,
    /// How long children get between SIGTERM and SIGKILL at shutdown.
    pub shutdown_grace: Duration,
    /// A session with no call for this long is killed.
    pub session_idle: Duration,
    /// Watch events queued per `watch` call before the call ends with an overflow error.
    pub watch_queue: usize,
    /// The git binary: a name looked up in the children's base `PATH`, or a path.
    pub git: String,
    /// Environment, working directory and user for commands whose request names none.
    pub defaults: Defaults,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            ring_bytes: 1 << 20,
            shutdown_grace: Duration::from_secs(2),
            session_idle: Duration::from_secs(30 * 60),
            watch_queue: 16_384,
            git: "git".into(),
            defaults: Defaults::default(),
        }
    }
}

/// State shared by every connection.
#[derive(Debug)]
pub struct Agent {
    pub procs: Procs,
    pub sessions: Sessions,
    pub ptys: Ptys,
    pub options: Options,
    /// When the agent started serving, for `Info`'s uptime.
    pub(crate) started: Instant,
    /// Connections open now, for `Info`; kept by the accept loop.
    pub(crate) connections: AtomicU32,
    /// Numbers connections, so a `Quiesce` can tell its own from the rest.
    pub(crate) next_connection: AtomicU64,
    /// `Quiesce`: the number of the connection that asked; every other one closes.
    pub(crate) quiesce: tokio::sync::watch::Sender<u64>,
    /// PID 1 made itself dumpable for a checkpoint (see `server::quiesce`).
    pub(crate) dumpable: AtomicBool,
}

impl Agent {
    /// A fresh agent: no children, sessions or ptys yet; its uptime starts now.
    pub fn new(options: Options) -> Agent {
        Agent {
            procs: Procs::new(options.defaults.clone()),
            sessions: Sessions::default(),
            ptys: Ptys::default(),
            options,
            started: Instant::now(),
            connections: AtomicU32::new(0),
            next_connection: AtomicU64::new(1),
            quiesce: tokio::sync::watch::Sender::new(0),
            dumpable: AtomicBool::new(false),
        }
    }
}

pub use crate::fail::{CallResult, Fail};

/// What a streaming call answers to a frame it has no use for: another request (the call is
/// abandoned with `BadRequest`, `what` saying what happened), the client closing the connection,
/// or a frame that does not decode.
pub fn interrupted(frame: Result<Option<Frame>, ProtoError>, what: &str) -> Fail {
    match frame {
        Ok(Some(other)) => Fail::Call(WireError::new(
            ErrorKind::BadRequest,
            format!("{} sent {what}", other.name()),
        )),
        Ok(None) => Fail::Conn(ProtoError::Truncated),
        Err(e) if e.is_recoverable() => {
            Fail::Call(WireError::new(ErrorKind::BadRequest, e.to_string()))
        }
        Err(e) => Fail::Conn(e),
    }
}
