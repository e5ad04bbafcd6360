//! The session table: every live persistent shell by id, shared by all connections. The session
//! verbs (`session`) and the idle sweep run on top of it; this module knows nothing of calls or
//! the agent, so the agent state can hold it without a cycle.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use silk_proto::{ErrorKind, ExitStatus, SessionInfo, WireError};
use tokio::net::unix::pipe;
use tokio::sync::watch;

/// Live sessions at most; more is `ResourceExhausted`.
const MAX_SESSIONS: usize = 256;

/// The session table, shared by every connection. A clone is another handle on the same table
/// (a shell's exit watcher holds one to remove its session).
#[derive(Debug, Default, Clone)]
pub struct Sessions {
    map: Arc<Mutex<HashMap<String, Arc<Session>>>>,
}

#[derive(Debug)]
pub struct Session {
    pub id: String,
    pub pid: u32,
    pub created_ms: u64,
    pub last_used_ms: AtomicU64,
    /// Held for the length of a call: a second concurrent call is `Conflict`.
    pub shell: tokio::sync::Mutex<Shell>,
    /// Set once the shell exited.
    pub exit: watch::Receiver<Option<ExitStatus>>,
}

/// The host ends of a session shell's pipes.
#[derive(Debug)]
pub struct Shell {
    pub stdin: pipe::Sender,
    pub stdout: pipe::Receiver,
    pub stderr: pipe::Receiver,
    /// fd 3 of the shell: marker lines only.
    pub status: pipe::Receiver,
}

fn lock(
    map: &Mutex<HashMap<String, Arc<Session>>>,
) -> MutexGuard<'_, HashMap<String, Arc<Session>>> {
    // Only this module holds the lock, never across an await or a panic point.
    map.lock().unwrap_or_else(|p| p.into_inner())
}

impl Sessions {
    pub fn len(&self) -> usize {
        lock(&self.map).len()
    }

    pub fn get(&self, id: &str) -> Result<Arc<Session>, WireError> {
        lock(&self.map)
            .get(id)
            .cloned()
            .ok_or_else(|| WireError::new(ErrorKind::NotFound, format!("no session {id:?}")))
    }

    /// Refuses to start a session `id` when one has that id or the table is full. Reserves
    /// nothing: [`insert_new`](Self::insert_new) checks the id again.
    pub fn check_room(&self, id: &str) -> Result<(), WireError> {
        let map = lock(&self.map);
        if map.contains_key(id) {
            return Err(WireError::new(ErrorKind::Conflict, format!("session {id:?} exists")));
        }
        if map.len() >= MAX_SESSIONS {
            return Err(WireError::new(
                ErrorKind::ResourceExhausted,
                format!("{MAX_SESSIONS} sessions are live already"),
            ));
        }
        Ok(())
    }

    /// Adds `session`; false (and nothing added) when another session took its id meanwhile.
    pub fn insert_new(&self, session: Arc<Session>) -> bool {
        let mut map = lock(&self.map);
        if map.contains_key(&session.id) {
            return false;
        }
        map.insert(session.id.clone(), session);
        true
    }

    /// Removes `session` if the table still holds this very session under its id (a newer one
    /// with the same id stays).
    pub fn remove(&self, session: &Arc<Session>) {
        let mut map = lock(&self.map);
        if map.get(&session.id).is_some_and(|s| Arc::ptr_eq(s, session)) {
            map.remove(&session.id);
        }
    }

    /// Every session's info, in no particular order.
    pub fn infos(&self) -> Vec<SessionInfo> {
        lock(&self.map).values().map(|s| s.info()).collect()
    }

    /// Removes sessions idle since before `now_ms - idle` that no call holds, and returns their
    /// shells' pids for the caller to kill.
    pub fn take_idle(&self, now_ms: u64, idle: Duration) -> Vec<u32> {
        let cutoff = now_ms.saturating_sub(idle.as_millis() as u64);
        let mut map = lock(&self.map);
        let idle: Vec<String> = map
            .values()
            .filter(|s| {
                s.last_used_ms.load(Ordering::Relaxed) < cutoff && s.shell.try_lock().is_ok()
            })
            .map(|s| s.id.clone())
            .collect();
        idle.iter().filter_map(|id| map.remove(id)).map(|s| s.pid).collect()
    }
}

impl Session {
    pub fn info(&self) -> SessionInfo {
        SessionInfo {
            id: self.id.clone(),
            pid: self.pid,
            created_ms: self.created_ms,
            last_used_ms: self.last_used_ms.load(Ordering::Relaxed),
            busy: self.shell.try_lock().is_err(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::procs::pipe_pair;

    fn fake_session(id: &str, last_used_ms: u64) -> Arc<Session> {
        let (_stdin_r, stdin_w) = pipe_pair().unwrap();
        let shell = Shell {
            stdin: pipe::Sender::from_owned_fd(stdin_w).unwrap(),
            stdout: pipe::Receiver::from_owned_fd(pipe_pair().unwrap().0).unwrap(),
            stderr: pipe::Receiver::from_owned_fd(pipe_pair().unwrap().0).unwrap(),
            status: pipe::Receiver::from_owned_fd(pipe_pair().unwrap().0).unwrap(),
        };
        Arc::new(Session {
            id: id.into(),
            pid: last_used_ms as u32,
            created_ms: 0,
            last_used_ms: AtomicU64::new(last_used_ms),
            shell: tokio::sync::Mutex::new(shell),
            exit: watch::channel(None).1,
        })
    }

    #[tokio::test]
    async fn idle_sessions_are_taken_by_age_unless_busy() {
        let sessions = Sessions::default();
        let busy = fake_session("busy", 1_000);
        for s in [fake_session("old", 1_001), busy.clone(), fake_session("fresh", 9_000)] {
            lock(&sessions.map).insert(s.id.clone(), s);
        }
        let held = busy.shell.try_lock().unwrap();
        assert_eq!(sessions.take_idle(10_000, Duration::from_secs(5)), vec![1_001]);
        assert_eq!(sessions.len(), 2);
        drop(held);
        assert_eq!(sessions.take_idle(10_000, Duration::from_secs(5)), vec![1_000]);
        assert_eq!(sessions.len(), 1, "only the fresh one is left");
    }
}
