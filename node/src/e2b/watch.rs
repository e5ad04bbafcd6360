//! envd's polled directory watches (what the sync SDK's `files.watch_dir` uses):
//! `CreateWatcher` starts a silkd `Watch` on a connection a driver task owns and answers once
//! silkd armed it (so a change made after the answer is seen); `GetWatcherEvents` takes what
//! came since the last call; `RemoveWatcher` cancels it. A watch that overflows or fails is
//! reported by the next `GetWatcherEvents`, never silently dropped. `WatchDir` (the async
//! SDK's) is the same watch as a stream.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use serde::Deserialize;
use serde_json::{Value, json};
use silk_proto::{EventKind, Frame, WatchEvent, WatchRequest};
use tokio::sync::{mpsc, oneshot};

use super::connect::{self, Code};
use super::envd::{Agent, code_of, lost, message};
use super::procs::Event;

/// Events a watcher keeps between polls; past this the watch ends with `resource_exhausted`
/// (a sandbox must not grow the node's memory by making changes nobody polls).
const MAX_QUEUED: usize = 10_000;

#[derive(Debug)]
struct Watcher {
    sandbox: String,
    events: Mutex<Vec<Value>>,
    /// Why the watch ended by itself, once it did.
    failed: Mutex<Option<connect::Error>>,
    stop: Mutex<Option<oneshot::Sender<()>>>,
}

/// Watches by id.
#[derive(Debug, Default)]
pub struct Watchers {
    table: Mutex<HashMap<String, Arc<Watcher>>>,
    next: std::sync::atomic::AtomicU64,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct CreateRequest {
    path: String,
    #[serde(default)]
    recursive: bool,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct WatcherRequest {
    watcher_id: String,
}

impl Watchers {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<Watcher>>> {
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub async fn create(
        self: &Arc<Self>,
        mut agent: Agent,
        user: &str,
        body: &[u8],
    ) -> Result<Value, connect::Error> {
        let dir = arm(&mut agent, user, message(body)?).await?;
        // Ids are per node and checked against the caller's sandbox: a counter will do.
        let id = format!("w{}", self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
        let (stop_tx, mut stop) = oneshot::channel();
        let watcher = Arc::new(Watcher {
            sandbox: agent.id.clone(),
            events: Mutex::default(),
            failed: Mutex::default(),
            stop: Mutex::new(Some(stop_tx)),
        });
        self.lock().insert(id.clone(), watcher.clone());
        let (watchers, watcher_id) = (self.clone(), id.clone());
        tokio::spawn(async move {
            let mut last = None;
            let ended = loop {
                let frame = tokio::select! {
                    frame = agent.conn.recv() => frame,
                    _ = &mut stop => {
                        let _ = agent.conn.send(&Frame::Cancel).await;
                        return;
                    }
                };
                match frame {
                    Ok(Some(Frame::Events(events))) => {
                        let mut queue = watcher.events.lock().unwrap_or_else(|p| p.into_inner());
                        queue.extend(events.iter().flat_map(|e| mapped(&dir, e)).filter(|e| {
                            let repeat = last.as_ref() == Some(e);
                            last = Some(e.clone());
                            !repeat
                        }));
                        if queue.len() > MAX_QUEUED {
                            let e = format!("more than {MAX_QUEUED} events since the last poll");
                            break Some(connect::Error::new(Code::ResourceExhausted, e));
                        }
                    }
                    Ok(Some(Frame::Done)) => break None,
                    Ok(Some(Frame::Error(e))) => {
                        break Some(connect::Error::new(code_of(e.kind), e.message));
                    }
                    Ok(Some(_)) => {}
                    Ok(None) => break Some(lost("closed the connection")),
                    Err(e) => break Some(lost(e)),
                }
            };
            let why = ended.unwrap_or_else(gone);
            *watcher.failed.lock().unwrap_or_else(|p| p.into_inner()) = Some(why);
            // Kept a while for a poll to learn why it ended, then forgotten.
            tokio::time::sleep(std::time::Duration::from_secs(60)).await;
            watchers.lock().remove(&watcher_id);
        });
        Ok(json!({ "watcherId": id }))
    }

    fn get(&self, sandbox: &str, body: &[u8]) -> Result<(String, Arc<Watcher>), connect::Error> {
        let req: WatcherRequest = message(body)?;
        let found = self.lock().get(&req.watcher_id).cloned();
        match found {
            Some(w) if w.sandbox == sandbox => Ok((req.watcher_id, w)),
            _ => {
                Err(connect::Error::new(Code::NotFound, format!("no watcher {:?}", req.watcher_id)))
            }
        }
    }

    pub fn events(&self, sandbox: &str, body: &[u8]) -> Result<Value, connect::Error> {
        let (_, w) = self.get(sandbox, body)?;
        let events = std::mem::take(&mut *w.events.lock().unwrap_or_else(|p| p.into_inner()));
        if events.is_empty()
            && let Some(why) = w.failed.lock().unwrap_or_else(|p| p.into_inner()).clone()
        {
            return Err(why);
        }
        Ok(json!({ "events": events }))
    }

    /// `WatchDir`: `start`, then each event as `filesystem`, until the client leaves (the watch
    /// is cancelled) or the watch ends (the stream's end says why).
    pub async fn stream(
        mut agent: Agent,
        user: &str,
        request: &[u8],
    ) -> Result<mpsc::Receiver<Event>, connect::Error> {
        let dir = arm(&mut agent, user, super::process::stream_request(request)?).await?;
        let (tx, rx) = mpsc::channel(64);
        let _ = tx.try_send(Event::Message(connect::envelope(&json!({ "start": {} }))));
        tokio::spawn(async move {
            let mut last = None;
            let why = 'watch: loop {
                let frame = tokio::select! {
                    frame = agent.conn.recv() => frame,
                    () = tx.closed() => break None,
                };
                match frame {
                    Ok(Some(Frame::Events(events))) => {
                        for e in events.iter().flat_map(|e| mapped(&dir, e)) {
                            if last.as_ref() == Some(&e) {
                                continue;
                            }
                            last = Some(e.clone());
                            let message = connect::envelope(&json!({ "filesystem": e }));
                            if tx.send(Event::Message(message)).await.is_err() {
                                break 'watch None;
                            }
                        }
                    }
                    Ok(Some(Frame::Done)) => break Some(gone()),
                    Ok(Some(Frame::Error(e))) => {
                        break Some(connect::Error::new(code_of(e.kind), e.message));
                    }
                    Ok(Some(_)) => {}
                    Ok(None) => break Some(lost("closed the connection")),
                    Err(e) => break Some(lost(e)),
                }
            };
            match why {
                Some(why) => drop(tx.send(Event::End(Some(why))).await),
                None => drop(agent.conn.send(&Frame::Cancel).await),
            }
        });
        Ok(rx)
    }

    pub fn remove(&self, sandbox: &str, body: &[u8]) -> Result<Value, connect::Error> {
        let (id, w) = self.get(sandbox, body)?;
        self.lock().remove(&id);
        if let Some(stop) = w.stop.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = stop.send(());
        }
        Ok(json!({}))
    }
}

fn gone() -> connect::Error {
    connect::Error::new(Code::NotFound, "the watched directory is gone")
}

/// Starts silkd's `Watch` of the request's directory on the agent's connection, answering once
/// it is armed (so a change made after the answer is seen): the directory, absolute.
async fn arm(agent: &mut Agent, user: &str, req: CreateRequest) -> Result<String, connect::Error> {
    let path = super::files::absolute(&req.path, user);
    let watch = WatchRequest { path: path.clone(), recursive: req.recursive };
    agent.conn.send(&Frame::Watch(watch)).await.map_err(lost)?;
    match agent.conn.recv().await.map_err(lost)? {
        Some(Frame::Ready) => Ok(path.trim_end_matches('/').to_string()),
        Some(Frame::Error(e)) => Err(connect::Error::new(code_of(e.kind), e.message)),
        other => Err(lost(format!("unexpected answer to Watch: {other:?}"))),
    }
}

/// A silkd event as envd's (an event the same as the one before it is dropped, as inotify
/// coalesces them: the write of a file made for a user, then given to it, is one `WRITE`):
/// `name` relative to the watched directory; a rename is the old
/// name's `RENAME` and the new name's `CREATE`, as envd reports it. silkd writes a file whole
/// into a staging name beside it and renames it into place: that shows as the file's `CREATE`
/// and `WRITE`, as envd's own write does, and the staging name never shows.
fn mapped(dir: &str, e: &WatchEvent) -> Vec<Value> {
    let name = |path: &str| {
        path.strip_prefix(dir).map(|p| p.trim_start_matches('/')).unwrap_or(path).to_string()
    };
    let one = |path: &str, kind: &str| json!({ "name": name(path), "type": kind });
    let staged = staging(&e.path);
    match (e.kind, &e.to) {
        (EventKind::Renamed, Some(to)) if staged => {
            vec![one(to, "EVENT_TYPE_CREATE"), one(to, "EVENT_TYPE_WRITE")]
        }
        _ if staged => vec![],
        (EventKind::Created, _) => vec![one(&e.path, "EVENT_TYPE_CREATE")],
        (EventKind::Modified, _) => vec![one(&e.path, "EVENT_TYPE_WRITE")],
        (EventKind::Deleted, _) => vec![one(&e.path, "EVENT_TYPE_REMOVE")],
        (EventKind::Renamed, to) => {
            let mut out = vec![one(&e.path, "EVENT_TYPE_RENAME")];
            out.extend(to.iter().map(|to| one(to, "EVENT_TYPE_CREATE")));
            out
        }
    }
}

/// Whether `path` is silkd's staging name for a write: `.<name>.silk-<pid>-<n>`.
fn staging(path: &str) -> bool {
    let file = path.rsplit('/').next().unwrap_or(path);
    let Some((name, suffix)) = file.strip_prefix('.').and_then(|f| f.rsplit_once(".silk-")) else {
        return false;
    };
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    !name.is_empty() && suffix.split_once('-').is_some_and(|(a, b)| digits(a) && digits(b))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(kind: EventKind, path: &str, to: Option<&str>) -> WatchEvent {
        WatchEvent { kind, path: path.into(), to: to.map(Into::into), dir: false }
    }

    #[test]
    fn events_read_as_envd_reports_them() {
        let names = |e: &WatchEvent| -> Vec<(String, String)> {
            mapped("/w", e)
                .iter()
                .map(|v| (v["name"].as_str().unwrap().into(), v["type"].as_str().unwrap().into()))
                .collect()
        };
        let pair = |n: &str, t: &str| (n.to_string(), format!("EVENT_TYPE_{t}"));
        // A write through silkd: staged, then renamed into place.
        assert!(names(&ev(EventKind::Created, "/w/.x.txt.silk-12-3", None)).is_empty());
        assert!(names(&ev(EventKind::Modified, "/w/.x.txt.silk-12-3", None)).is_empty());
        let placed = ev(EventKind::Renamed, "/w/.x.txt.silk-12-3", Some("/w/x.txt"));
        assert_eq!(names(&placed), [pair("x.txt", "CREATE"), pair("x.txt", "WRITE")]);
        // A user's rename, in a subdirectory of a recursive watch.
        let moved = ev(EventKind::Renamed, "/w/d/a", Some("/w/d/b"));
        assert_eq!(names(&moved), [pair("d/a", "RENAME"), pair("d/b", "CREATE")]);
        assert_eq!(names(&ev(EventKind::Deleted, "/w/b", None)), [pair("b", "REMOVE")]);
        // Names that only look like staging names are the user's.
        for path in ["/w/.silk-1-2", "/w/.x.silk-1", "/w/x.silk-1-2", "/w/.x.silk-a-2"] {
            assert_eq!(names(&ev(EventKind::Created, path, None)).len(), 1, "{path}");
        }
    }
}
