//! What the controller asks of other nodes. Only a move crosses nodes from inside the
//! controller (its files stream to the target, which starts the sandbox as they arrive; a lost
//! answer is settled by asking it later), and a tenant's quota counts its sandboxes everywhere,
//! so that is all this trait carries. The mesh layer (`crate::fleet`) implements it; a node
//! alone has none, and the controller's tests can bring their own.

use std::future::Future;
use std::pin::Pin;

use crate::claims::ClaimRecord;
use crate::error::NodeError;

pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A sandbox's files on their way to a peer: the stream ends in an error, not at its end, when
/// the capture failed half way, so a receiver never takes part of them for the whole.
pub type SnapshotBytes = Pin<Box<dyn tokio::io::AsyncRead + Send>>;

/// A peer a sandbox can move to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerNode {
    pub name: String,
    /// Its API's address, as it advertises it.
    pub api: String,
}

pub trait Fleet: Send + Sync + std::fmt::Debug {
    /// The peer a move goes to: `to` by name, or the least loaded live peer with room.
    fn move_target(&self, to: Option<&str>) -> Result<PeerNode, NodeError>;

    /// Hands sandbox `record`, moved as `name`, to `peer` with its files: `snapshot` says what
    /// they are over (a `StoredSnapshot` as JSON) and `files` streams them, the bytes
    /// `Engine::write_snapshot` writes. The peer starts the sandbox as they arrive and takes
    /// them for the whole only if `files` ended without an error; `Ok` once it has journalled
    /// it. An error with code `peer_unavailable` when its answer was lost (it may or may not
    /// have taken it); any other error: it did not.
    fn hand_over<'a>(
        &'a self,
        peer: &'a str,
        record: &'a ClaimRecord,
        name: &'a str,
        snapshot: &'a str,
        files: SnapshotBytes,
    ) -> BoxFuture<'a, Result<(), NodeError>>;

    /// Whether `peer` holds sandbox `id`: `None` while it cannot say (no answer, or it is
    /// starting it right now).
    fn holds<'a>(&'a self, peer: &'a str, id: &'a str) -> BoxFuture<'a, Option<bool>>;

    /// Notes that sandbox `id` moved from this node to `peer`: while `peer` is not a live
    /// member (paused, restarting, not yet admitted again), a call for `id` here is answered
    /// "try again" rather than "no such sandbox".
    fn moved(&self, id: &str, peer: &str);

    /// Live sandboxes of `tenant` on the other nodes, as they last said.
    fn tenant_sandboxes(&self, tenant: &str) -> u64;

    /// Sandbox-seconds of `tenant` this month on the other nodes, as they last said.
    fn tenant_seconds(&self, tenant: &str) -> u64;
}
