//! [`Sandbox`]: a handle on one claimed sandbox — its lifecycle calls on the node's API and the
//! relay connections that carry silkd calls. The verb families live in their own modules
//! (`process`, `pty`, `files`, `search`, `git`, `forward`) as `impl Sandbox` blocks.
//!
//! Short calls borrow a connection from the handle's pool and give it back when their terminal
//! frame arrives (see `conn`); long streams (watch, pty, port forward, attach) dial their own.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use hyper::Method;
use serde::Deserialize;
use serde_json::json;
use silk_proto::{AgentInfo, Frame, Hello, PROTOCOL_VERSION, Welcome};

use crate::client::{Client, SandboxInfo, Tier, path_segment};
use crate::conn::{ConnStats, HasPool, Pool, RelayConn};
use crate::error::{Error, Result};

/// One claimed sandbox. Cheap to clone; clones share the connection pool, and with
/// auto-release the sandbox is released when the last clone (and every stream started from it)
/// is dropped.
#[derive(Debug, Clone)]
pub struct Sandbox {
    pub(crate) inner: Arc<Inner>,
}

#[derive(Debug)]
pub(crate) struct Inner {
    client: Client,
    info: SandboxInfo,
    token: String,
    claim_took: Option<Duration>,
    auto_release: AtomicBool,
    released: AtomicBool,
    pool: Pool,
    /// silkd's `info` answer right after the claim (`ClaimBuilder::answered`).
    answered: std::sync::OnceLock<AgentInfo>,
}

impl HasPool for Inner {
    fn pool(&self) -> &Pool {
        &self.pool
    }
}

impl Sandbox {
    pub(crate) fn new(
        client: Client,
        info: SandboxInfo,
        token: String,
        claim_took: Option<Duration>,
        auto_release: bool,
    ) -> Sandbox {
        let pool = Pool::new(client.max_idle());
        Sandbox {
            inner: Arc::new(Inner {
                client,
                info,
                token,
                claim_took,
                auto_release: AtomicBool::new(auto_release),
                released: AtomicBool::new(false),
                pool,
                answered: std::sync::OnceLock::new(),
            }),
        }
    }

    pub fn id(&self) -> &str {
        &self.inner.info.id
    }

    /// The bearer token this handle uses: the sandbox's own token from a claim, or whatever
    /// token it was opened with.
    pub fn token(&self) -> &str {
        &self.inner.token
    }

    pub fn tier(&self) -> Tier {
        self.inner.info.tier
    }

    /// The claim as the node reported it when this handle was made.
    pub fn info(&self) -> &SandboxInfo {
        &self.inner.info
    }

    /// silkd's `info` answer, made after the claim on the handle's first connection, for a
    /// claim sent with [`answered`](crate::ClaimBuilder::answered).
    pub fn answered(&self) -> Option<&AgentInfo> {
        self.inner.answered.get()
    }

    /// Keeps silkd's answer from the claim's `101` (JSON), or asks for one when the node did
    /// not check. A sandbox whose silkd cannot answer is released (best effort) before the
    /// error is returned: the caller gets no handle to it.
    pub(crate) async fn ask_answered(
        &self,
        from_node: Option<hyper::header::HeaderValue>,
    ) -> Result<()> {
        let info = match from_node {
            Some(json) => serde_json::from_slice(json.as_bytes()).map_err(|e| {
                Error::Protocol(format!("claim: silkd's answer in the 101 is not `info`: {e}"))
            }),
            None => self.agent_info().await,
        };
        let info = match info {
            Ok(info) => info,
            Err(e) => {
                let _ = self.release().await;
                return Err(e);
            }
        };
        let _ = self.inner.answered.set(info);
        Ok(())
    }

    /// How long the node took to serve the claim (claims made by this handle only).
    pub fn claim_took(&self) -> Option<Duration> {
        self.inner.claim_took
    }

    /// Release the sandbox when the last handle is dropped: a task is spawned on the current
    /// tokio runtime to send the `DELETE`. A runtime that is shutting down may not run it; call
    /// [`release`](Self::release) where the release must happen.
    pub fn set_auto_release(&self, yes: bool) {
        self.inner.auto_release.store(yes, Ordering::Relaxed);
    }

    /// Relay connection counters of this handle (dialled, reused, idle).
    pub fn connection_stats(&self) -> ConnStats {
        self.inner.pool.stats()
    }

    pub(crate) fn client(&self) -> &Client {
        &self.inner.client
    }

    /// Closes idle relay connections (the sandbox is about to stop).
    pub(crate) fn clear_connections(&self) {
        self.inner.pool.clear();
    }

    fn path(&self, tail: &str) -> Result<String> {
        Ok(format!("/v1/sandboxes/{}{tail}", path_segment(self.id())?))
    }

    /// Destroys the sandbox. Idle relay connections are closed first.
    pub async fn release(&self) -> Result<()> {
        self.inner.pool.clear();
        let path = self.path("")?;
        self.inner.client.http().json(Method::DELETE, &path, Some(self.token()), None).await?;
        self.inner.released.store(true, Ordering::Relaxed);
        Ok(())
    }

    /// Resets the lease to `ttl` from now; returns the new deadline (unix milliseconds).
    pub async fn renew(&self, ttl: Duration) -> Result<u64> {
        #[derive(Deserialize)]
        struct Renewed {
            deadline_ms: u64,
        }
        let body = json!({ "ttl_seconds": ttl.as_secs().max(1) });
        let path = self.path("/renew")?;
        let r: Renewed =
            self.inner.client.call(Method::POST, &path, Some(self.token()), Some(&body)).await?;
        Ok(r.deadline_ms)
    }

    /// A URL that opens port `port` to a browser without this sandbox's token, for `ttl`
    /// (whole seconds, at most a day; an hour when `None`).
    pub async fn preview(&self, port: u16, ttl: Option<Duration>) -> Result<crate::Preview> {
        let mut body = json!({ "port": port });
        if let Some(ttl) = ttl {
            body["ttl_seconds"] = json!(ttl.as_secs().max(1));
        }
        let path = self.path("/previews")?;
        self.inner.client.call(Method::POST, &path, Some(self.token()), Some(&body)).await
    }

    /// Revokes a preview made by [`preview`](Self::preview).
    pub async fn revoke_preview(&self, token: &str) -> Result<()> {
        let path = self.path(&format!("/previews/{token}"))?;
        self.inner.client.http().json(Method::DELETE, &path, Some(self.token()), None).await?;
        Ok(())
    }

    /// The claim as the node reports it now (state, lease deadline).
    pub async fn refresh(&self) -> Result<SandboxInfo> {
        let path = self.path("")?;
        self.inner.client.call(Method::GET, &path, Some(self.token()), None).await
    }

    /// silkd's `Info`: version, uptime, live processes, sessions and connections.
    pub async fn agent_info(&self) -> Result<AgentInfo> {
        let mut reply = None;
        self.unary(Frame::Info, |f| match f {
            Frame::InfoReply(i) => {
                reply = Some(i);
                Ok(())
            }
            other => Err(Error::unexpected(&other, "info")),
        })
        .await?;
        reply.ok_or_else(|| Error::Protocol("info ended without a reply".into()))
    }

    /// silkd's `Hello`: its protocol version and capabilities.
    pub async fn hello(&self) -> Result<Welcome> {
        let mut reply = None;
        let hello = Hello { protocol: PROTOCOL_VERSION, client: client_name() };
        self.unary(Frame::Hello(hello), |f| match f {
            Frame::Welcome(w) => {
                reply = Some(w);
                Ok(())
            }
            other => Err(Error::unexpected(&other, "hello")),
        })
        .await?;
        reply.ok_or_else(|| Error::Protocol("hello ended without a reply".into()))
    }

    // ---- relay connections ----

    /// A new relay connection, not from the pool (for long streams).
    pub(crate) async fn dial(&self) -> Result<RelayConn> {
        let path = self.path("/agent")?;
        let stream = self.inner.client.http().upgrade(&path, self.token()).await?;
        self.inner.pool.count_dial();
        Ok(RelayConn::new(stream))
    }

    /// Keeps a relay connection opened with the claim for the first call.
    pub(crate) fn adopt(&self, stream: crate::conn::NodeStream) {
        self.inner.pool.count_dial();
        self.put_back(RelayConn::new(stream));
    }

    /// An idle connection from the pool, or a new one.
    pub(crate) async fn conn(&self) -> Result<RelayConn> {
        match self.inner.pool.take() {
            Some(c) => Ok(c),
            None => self.dial().await,
        }
    }

    /// Gives back a connection whose call ended with its terminal frame.
    pub(crate) fn put_back(&self, conn: RelayConn) {
        if self.inner.pool.put(conn) {
            let owner: std::sync::Weak<Inner> = Arc::downgrade(&self.inner);
            self.inner.client.reaper().watch(owner as std::sync::Weak<dyn HasPool>);
        }
    }

    /// A call with no input stream that ends with `Done`: every frame before it goes to
    /// `on_frame`. The connection is pooled again afterwards, also after an `Error` frame (the
    /// call ended cleanly; the connection stays usable).
    pub(crate) async fn unary(
        &self,
        request: Frame,
        mut on_frame: impl FnMut(Frame) -> Result<()>,
    ) -> Result<()> {
        let mut conn = self.conn().await?;
        conn.send(&request).await?;
        loop {
            match conn.recv().await? {
                Frame::Done => {
                    self.put_back(conn);
                    return Ok(());
                }
                Frame::Error(e) => {
                    self.put_back(conn);
                    return Err(e.into());
                }
                other if other.is_terminal() => return Err(Error::unexpected(&other, "a call")),
                other => {
                    // A protocol error leaves the reply half read: drop the connection with it.
                    on_frame(other)?;
                }
            }
        }
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        if !self.auto_release.load(Ordering::Relaxed) || self.released.load(Ordering::Relaxed) {
            return;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let client = self.client.clone();
        let token = self.token.clone();
        let Ok(path) = path_segment(&self.info.id).map(|id| format!("/v1/sandboxes/{id}")) else {
            return;
        };
        rt.spawn(async move {
            let _ = client.http().json(Method::DELETE, &path, Some(&token), None).await;
        });
    }
}

pub(crate) fn client_name() -> String {
    format!("silkmesh-sdk/{}", env!("CARGO_PKG_VERSION"))
}
