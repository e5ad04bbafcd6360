//! Search and watch: `find` and `watch` as [`Stream`]s, and `replace`.
//!
//! Both streams are fed by a small task that owns the connection and hands batches over a
//! bounded channel, so silkd's backpressure reaches the caller: a consumer that stops polling
//! stops the task's reads, and silkd stops its walk within a few batches. Dropping a stream drops
//! the task's channel; the task then closes the connection, which ends the call on silkd's side.
//! A `find` that ran to its `Done` gives its connection back to the pool; a watch dials its own
//! and closes it at the end.
//!
//! `Stream` comes from `futures-core` (the trait every async stream library implements; no
//! runtime and no other code): the SDK's streams work with `StreamExt` from futures-util or
//! tokio-stream without pulling either in. Each stream also has an inherent `next()`.

use std::collections::VecDeque;
use std::pin::Pin;
use std::task::{Context, Poll};

use crate::conn::{RelayRead, RelayWrite};
use futures_core::Stream;
use silk_proto::{
    FindRequest, Frame, FrameWriter, Match, ReplaceRequest, WatchEvent, WatchRequest,
};
use tokio::sync::mpsc;

use crate::conn::{RelayConn, recv};
use crate::error::{Error, Result};
use crate::sandbox::Sandbox;

/// Batches buffered between the reader task and the consumer.
const BATCHES: usize = 2;

/// Reads batches until the terminal frame; `Done` ends the stream (and may pool the connection).
fn spawn_reader<T: Send + 'static>(
    sandbox: Option<Sandbox>,
    mut rd: silk_proto::FrameReader<RelayRead>,
    wr: Option<FrameWriter<RelayWrite>>,
    what: &'static str,
    batch: fn(Frame) -> std::result::Result<Vec<T>, &'static str>,
) -> mpsc::Receiver<Result<Vec<T>>> {
    let (tx, rx) = mpsc::channel(BATCHES);
    tokio::spawn(async move {
        loop {
            let frame = tokio::select! {
                () = tx.closed() => return,
                f = recv(&mut rd) => f,
            };
            let item = match frame {
                Ok(Frame::Done) => {
                    if let (Some(s), Some(wr)) = (&sandbox, wr) {
                        s.put_back(RelayConn { rd, wr });
                    }
                    return;
                }
                Ok(Frame::Error(e)) => Err(e.into()),
                Ok(f) => match batch(f) {
                    Ok(items) => Ok(items),
                    Err(name) => {
                        Err(Error::Protocol(format!("unexpected {name} frame during {what}")))
                    }
                },
                Err(e) => Err(e),
            };
            let end = item.is_err();
            if tx.send(item).await.is_err() || end {
                return;
            }
        }
    });
    rx
}

fn poll_batches<T>(
    queue: &mut VecDeque<T>,
    rx: &mut mpsc::Receiver<Result<Vec<T>>>,
    cx: &mut Context<'_>,
) -> Poll<Option<Result<T>>> {
    loop {
        if let Some(item) = queue.pop_front() {
            return Poll::Ready(Some(Ok(item)));
        }
        match rx.poll_recv(cx) {
            Poll::Ready(Some(Ok(batch))) => queue.extend(batch),
            Poll::Ready(Some(Err(e))) => return Poll::Ready(Some(Err(e))),
            Poll::Ready(None) => return Poll::Ready(None),
            Poll::Pending => return Poll::Pending,
        }
    }
}

/// Matching lines, in walk order. Ends when the walk is done (or `max_matches` is reached).
#[derive(Debug)]
pub struct Find {
    rx: mpsc::Receiver<Result<Vec<Match>>>,
    queue: VecDeque<Match>,
}

impl Find {
    pub async fn next(&mut self) -> Option<Result<Match>> {
        std::future::poll_fn(|cx| poll_batches(&mut self.queue, &mut self.rx, cx)).await
    }
}

impl Stream for Find {
    type Item = Result<Match>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        poll_batches(&mut this.queue, &mut this.rx, cx)
    }
}

/// Filesystem events under a path, from the moment [`Sandbox::watch`] returned. Ends with an
/// error if events were lost (queue overflow), or normally when the watched path is deleted or
/// after [`cancel`](Watch::cancel).
#[derive(Debug)]
pub struct Watch {
    rx: mpsc::Receiver<Result<Vec<WatchEvent>>>,
    queue: VecDeque<WatchEvent>,
    wr: Option<FrameWriter<RelayWrite>>,
}

impl Watch {
    pub async fn next(&mut self) -> Option<Result<WatchEvent>> {
        std::future::poll_fn(|cx| poll_batches(&mut self.queue, &mut self.rx, cx)).await
    }

    /// Stops watching: events already delivered stay readable, then the stream ends.
    pub async fn cancel(&mut self) -> Result<()> {
        match self.wr.as_mut() {
            Some(wr) => Ok(wr.send(&Frame::Cancel).await?),
            None => Ok(()),
        }
    }
}

impl Stream for Watch {
    type Item = Result<WatchEvent>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        poll_batches(&mut this.queue, &mut this.rx, cx)
    }
}

/// One file a `replace` rewrote (or left alone: `count` 0).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Replaced {
    pub path: String,
    pub count: u64,
}

impl Sandbox {
    /// Searches file contents; see [`FindRequest`] for the glob, size and match limits.
    pub async fn find(&self, request: FindRequest) -> Result<Find> {
        let mut conn = self.conn().await?;
        conn.send(&Frame::Find(request)).await?;
        let rx = spawn_reader(Some(self.clone()), conn.rd, Some(conn.wr), "find", |f| match f {
            Frame::Matches(m) => Ok(m),
            other => Err(other.name()),
        });
        Ok(Find { rx, queue: VecDeque::new() })
    }

    /// Rewrites `paths` in order, atomically per file. The first failure ends the call: the files
    /// before it stay rewritten, the ones after it are untouched, and the error names the file.
    pub async fn replace(&self, request: ReplaceRequest) -> Result<Vec<Replaced>> {
        let mut done = vec![];
        self.unary(Frame::Replace(request), |f| match f {
            Frame::Replaced { path, count } => {
                done.push(Replaced { path, count });
                Ok(())
            }
            other => Err(Error::unexpected(&other, "replace")),
        })
        .await?;
        Ok(done)
    }

    /// Watches `path` (and below, with `recursive`); returns once every watch is armed, so any
    /// change after this call is reported.
    pub async fn watch(&self, path: &str, recursive: bool) -> Result<Watch> {
        let mut conn = self.dial().await?;
        conn.send(&Frame::Watch(WatchRequest { path: path.into(), recursive })).await?;
        match conn.recv().await? {
            Frame::Ready => {}
            Frame::Error(e) => return Err(e.into()),
            other => return Err(Error::unexpected(&other, "watch")),
        }
        let rx = spawn_reader(None, conn.rd, None, "watch", |f| match f {
            Frame::Events(e) => Ok(e),
            other => Err(other.name()),
        });
        Ok(Watch { rx, queue: VecDeque::new(), wr: Some(conn.wr) })
    }
}
