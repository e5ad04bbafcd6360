//! The commands envd started, while they run: each is a silkd `Exec` whose connection a driver
//! task owns, so the command outlives the HTTP stream that started it (the SDK's background
//! commands; a client that disconnects), later streams attach to it (`Connect`), and its stdin
//! takes input from other calls (`SendInput`, `CloseStdin`). Events go to every attached
//! stream with backpressure: a slow reader slows the command, as a pipe would, and loses
//! nothing.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use serde_json::{Value, json};
use silk_proto::{Connection, Frame};
use tokio::net::UnixStream;
use tokio::sync::mpsc;

use super::connect::{self, Code};

/// What a command's stdin receives.
#[derive(Debug)]
pub enum Input {
    Data(Bytes),
    Close,
    /// A pty's new window size.
    Resize {
        cols: u16,
        rows: u16,
    },
}

/// An event as the streams send it: a framed `{"event": …}` message, or the end of the stream
/// (`Err`: the error it carries).
#[derive(Debug, Clone)]
pub enum Event {
    Message(Bytes),
    End(Option<connect::Error>),
}

/// What a driven call is: its config for `List`, its tag, whether it is a pty.
struct Started {
    config: Value,
    tag: Option<String>,
    pty: bool,
}

#[derive(Debug)]
struct Proc {
    /// `{cmd, args, envs, cwd}` as started, for `List`.
    config: Value,
    tag: Option<String>,
    pty: bool,
    input: mpsc::Sender<Input>,
    subscribers: Mutex<Vec<mpsc::Sender<Event>>>,
}

/// Running commands by (sandbox, pid).
#[derive(Debug, Default)]
pub struct Procs {
    table: Mutex<HashMap<(String, u32), Arc<Proc>>>,
}

impl Procs {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<(String, u32), Arc<Proc>>> {
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs the `Exec` already sent on the agent's connection: the returned receiver gets its
    /// events from `start` on. The command is listed once silkd says it started.
    /// `pty`: the call is a `PtyOpen`, whose output is the terminal's.
    pub fn drive(
        self: &Arc<Self>,
        agent: super::envd::Agent,
        config: Value,
        tag: Option<String>,
        pty: bool,
    ) -> mpsc::Receiver<Event> {
        let (first, events) = mpsc::channel(64);
        let procs = self.clone();
        tokio::spawn(async move {
            // The sandbox counts as in use while the command runs.
            let super::envd::Agent { id, conn, active, live } = agent;
            procs.run(id, conn, Started { config, tag, pty }, first).await;
            drop((active, live));
        });
        events
    }

    async fn run(
        self: Arc<Self>,
        id: String,
        mut conn: Connection<UnixStream>,
        how: Started,
        first: mpsc::Sender<Event>,
    ) {
        let Started { config, tag, pty } = how;
        let output = if pty { "pty" } else { "stdout" };
        let (input_tx, mut input) = mpsc::channel::<Input>(16);
        let mut proc: Option<Arc<Proc>> = None;
        let mut pid = None;
        let mut pending = Some(first);
        let end = loop {
            let frame = tokio::select! {
                frame = conn.recv() => frame,
                Some(data) = input.recv() => {
                    let frame = match (data, pid) {
                        (Input::Data(b), _) => Frame::Stdin(b),
                        (Input::Close, _) => Frame::Eof,
                        (Input::Resize { cols, rows }, Some(pid)) => {
                            Frame::PtyResize { pid, cols, rows }
                        }
                        (Input::Resize { .. }, None) => continue,
                    };
                    if let Err(e) = conn.send(&frame).await {
                        break Some(lost(e));
                    }
                    continue;
                }
            };
            let message = match frame {
                Ok(Some(Frame::Started { pid: started })) => {
                    let p = Arc::new(Proc {
                        config: config.clone(),
                        tag: tag.clone(),
                        pty,
                        input: input_tx.clone(),
                        subscribers: Mutex::new(pending.take().into_iter().collect()),
                    });
                    self.lock().insert((id.clone(), started), p.clone());
                    (proc, pid) = (Some(p), Some(started));
                    event(json!({ "start": { "pid": started } }))
                }
                Ok(Some(Frame::Stdout(b))) => event(json!({ "data": { output: b64(&b) } })),
                Ok(Some(Frame::Stderr(b))) => event(json!({ "data": { "stderr": b64(&b) } })),
                Ok(Some(Frame::Exit(status))) => {
                    if status.timed_out {
                        let e = "the command's timeout passed: it was killed";
                        break Some(connect::Error::new(Code::DeadlineExceeded, e));
                    }
                    let text = match status.signal {
                        Some(sig) => format!("signal: {sig}"),
                        None => format!("exit status {}", status.code),
                    };
                    // Killed by a signal: envd's -1.
                    let code = if status.signal.is_some() { -1 } else { status.code };
                    let mut end = json!({ "exitCode": code, "status": text });
                    if status.signal.is_none() {
                        end["exited"] = json!(true);
                    } else {
                        end["error"] = json!(text);
                    }
                    let last = event(json!({ "end": end }));
                    // Gone from the table before the last event goes out: a stream attaches
                    // before (and gets it) or finds no command, never one without its `end`.
                    if let Some(pid) = pid.take() {
                        self.lock().remove(&(id.clone(), pid));
                    }
                    broadcast(proc.as_deref(), pending.as_ref(), Event::Message(last)).await;
                    break None;
                }
                Ok(Some(Frame::Error(e))) => {
                    break Some(connect::Error::new(super::envd::code_of(e.kind), e.message));
                }
                Ok(Some(_)) => continue,
                Ok(None) => break Some(lost("closed the connection")),
                Err(e) => break Some(lost(e)),
            };
            broadcast(proc.as_deref(), pending.as_ref(), Event::Message(message)).await;
        };
        if let Some(pid) = pid {
            self.lock().remove(&(id, pid));
        }
        broadcast(proc.as_deref(), pending.as_ref(), Event::End(end)).await;
    }

    /// Attaches a stream to a running command: `None` when there is no such command.
    pub fn attach(&self, id: &str, pid: u32) -> Option<mpsc::Receiver<Event>> {
        // Subscribed under the table's lock: the command cannot leave the table in between.
        let table = self.lock();
        let proc = table.get(&(id.to_string(), pid))?;
        let (tx, rx) = mpsc::channel(64);
        let _ = tx.try_send(Event::Message(event(json!({ "start": { "pid": pid } }))));
        proc.subscribers.lock().unwrap_or_else(|p| p.into_inner()).push(tx);
        Some(rx)
    }

    /// Whether a running command is a pty.
    pub fn is_pty(&self, id: &str, pid: u32) -> bool {
        self.lock().get(&(id.to_string(), pid)).is_some_and(|p| p.pty)
    }

    /// Where a running command's stdin goes: `None` when there is no such command.
    pub fn input(&self, id: &str, pid: u32) -> Option<mpsc::Sender<Input>> {
        self.lock().get(&(id.to_string(), pid)).map(|p| p.input.clone())
    }

    /// The running commands of sandbox `id`, as `List` answers them.
    pub fn list(&self, id: &str) -> Vec<Value> {
        let table = self.lock();
        let mut out: Vec<(u32, Value)> = table
            .iter()
            .filter(|((sandbox, _), _)| sandbox == id)
            .map(|((_, pid), p)| {
                let mut v = json!({ "pid": pid, "config": p.config });
                if let Some(tag) = &p.tag {
                    v["tag"] = json!(tag);
                }
                (*pid, v)
            })
            .collect();
        out.sort_by_key(|(pid, _)| *pid);
        out.into_iter().map(|(_, v)| v).collect()
    }
}

/// Sends `event` to every attached stream, waiting for each (backpressure); streams whose
/// reader left are dropped. Before the command started, only its starter listens.
async fn broadcast(proc: Option<&Proc>, first: Option<&mpsc::Sender<Event>>, event: Event) {
    let targets: Vec<mpsc::Sender<Event>> = match proc {
        Some(p) => p.subscribers.lock().unwrap_or_else(|p| p.into_inner()).clone(),
        None => first.into_iter().cloned().collect(),
    };
    let mut gone = vec![];
    for (i, tx) in targets.iter().enumerate() {
        if tx.send(event.clone()).await.is_err() {
            gone.push(i);
        }
    }
    if let (Some(p), false) = (proc, gone.is_empty()) {
        p.subscribers.lock().unwrap_or_else(|p| p.into_inner()).retain(|tx| !tx.is_closed());
    }
}

fn event(e: Value) -> Bytes {
    connect::envelope(&json!({ "event": e }))
}

fn b64(b: &[u8]) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode(b)
}

fn lost(e: impl std::fmt::Display) -> connect::Error {
    connect::Error::new(Code::Unavailable, format!("silkd: {e}"))
}
