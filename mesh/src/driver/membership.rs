//! The task that owns the membership core: it feeds the core packets, timers, states and the
//! time, and carries out what comes out (datagrams, state pushes, timers, this node's own
//! probe of a peer declared down, the view the API reads). Apart from the connections it sends
//! on (`conns`).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::sync::mpsc;

use super::conns::connection;
use super::{Cmd, Inner, lock};
use crate::MeshError;
use crate::core::{Membership, NodeId, Output, Peer, StateChange, StateMessage, TICK};
use crate::wire::write_frame;

/// This node's own look at a peer the failure detector declared down: our state sent on a
/// stream of its own and acknowledged by the peer within [`Inner::verify_within`].
async fn probe(inner: &Arc<Inner>, id: &NodeId) -> bool {
    // It closed our connection itself (it left, or stopped): no need to wait for a dial.
    let closed = lock(&inner.conns).get(&id.addr).is_some_and(|c| {
        matches!(c.conn.close_reason(), Some(quinn::ConnectionError::ApplicationClosed(_)))
    });
    if closed {
        return false;
    }
    let attempt = async {
        let conn = connection(inner, id).await.ok()?;
        let mut send = conn.open_uni().await.ok()?;
        // Our version: a state message it reads whole, as it reads every state stream.
        let state = lock(&inner.view).0.clone();
        let version = StateMessage::Change(StateChange::between(&state, &state));
        write_frame(&mut send, &version).await.ok()?;
        send.finish().ok()?;
        send.stopped().await.ok()?;
        Some(())
    };
    matches!(tokio::time::timeout(inner.verify_within, attempt).await, Ok(Some(())))
}
pub(super) async fn membership_task(
    inner: Arc<Inner>,
    mut core: Membership,
    mut rx: mpsc::UnboundedReceiver<Cmd>,
    join: Vec<SocketAddr>,
) {
    for seed in &join {
        core.join(*seed);
    }
    apply(&inner, &mut core);
    let started = tokio::time::Instant::now();
    let mut tick = tokio::time::interval(TICK);
    let mut rejoin = tokio::time::interval(Duration::from_secs(1));
    loop {
        tokio::select! {
            cmd = rx.recv() => match cmd {
                Some(Cmd::Packet(p)) => core.handle_packet(&p),
                Some(Cmd::Timer(t)) => core.handle_timer(t),
                Some(Cmd::State(msg)) => {
                    core.apply_message(msg);
                }
                Some(Cmd::Verified(id, alive)) => core.verified(id, alive),
                Some(Cmd::Local(f)) => {
                    core.tick(started.elapsed());
                    core.update_local(f);
                }
                Some(Cmd::Leave(done)) => {
                    core.leave();
                    let sends = apply(&inner, &mut core);
                    for s in sends {
                        let _ = s.await;
                    }
                    let _ = done.send(());
                    return;
                }
                None => return,
            },
            _ = tick.tick() => core.tick(started.elapsed()),
            _ = rejoin.tick() => core.knock(&join),
        }
        apply(&inner, &mut core);
    }
}

/// Carries out the core's output; returns the packet sends (awaited only when leaving).
fn apply(inner: &Arc<Inner>, core: &mut Membership) -> Vec<tokio::task::JoinHandle<()>> {
    let mut sends = vec![];
    let mut changed = false;
    for out in core.drain() {
        match out {
            Output::Packet(to, data) => {
                let inner2 = inner.clone();
                inner.gossip_bytes.fetch_add(data.len() as u64, Ordering::Relaxed);
                sends.push(tokio::spawn(async move {
                    match connection(&inner2, &to).await {
                        Ok(conn) => {
                            if let Err(e) = conn.send_datagram(data) {
                                tracing::debug!(peer = to.name, "datagram: {e}");
                            }
                        }
                        Err(e) => tracing::debug!(peer = to.name, "{e}"),
                    }
                }));
            }
            Output::Timer(after, timer) => {
                let cmds = inner.cmds.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(after).await;
                    let _ = cmds.send(Cmd::Timer(timer));
                });
            }
            Output::Up(id) => {
                tracing::info!(peer = id.name, addr = %id.addr, "peer up");
                changed = true;
            }
            Output::State(id, msg) => push_state(inner, id, *msg),
            Output::Verify { id, again } => {
                let inner2 = inner.clone();
                tokio::spawn(async move {
                    if again {
                        tokio::time::sleep(Duration::from_secs(2)).await;
                    }
                    let alive = probe(&inner2, &id).await;
                    let _ = inner2.cmds.send(Cmd::Verified(id, alive));
                });
            }
            Output::Down(id) => {
                tracing::info!(peer = id.name, addr = %id.addr, "peer down");
                if let Some(c) = lock(&inner.conns).remove(&id.addr) {
                    c.conn.close(0u32.into(), b"declared down");
                }
                lock(&inner.dials).remove(&id.addr);
                changed = true;
            }
        }
    }
    let peers: Vec<Peer> = core.peers().cloned().collect();
    let mut view = lock(&inner.view);
    if changed || *view.1 != peers || view.0 != *core.me() {
        *view = (core.me().clone(), Arc::new(peers));
    }
    sends
}

fn push_state(inner: &Arc<Inner>, to: NodeId, msg: StateMessage) {
    let inner = inner.clone();
    tokio::spawn(async move {
        let sent = async {
            let conn = connection(&inner, &to).await?;
            let mut send = conn.open_uni().await.map_err(|e| MeshError::Io(e.to_string()))?;
            let n = write_frame(&mut send, &msg).await?;
            send.finish().map_err(|e| MeshError::Io(e.to_string()))?;
            Ok::<_, MeshError>(n)
        };
        match sent.await {
            Ok(n) => {
                inner.gossip_bytes.fetch_add(n as u64, Ordering::Relaxed);
            }
            Err(e) => tracing::debug!(peer = to.name, "state push: {e}"),
        }
    });
}
