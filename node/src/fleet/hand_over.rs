//! A move's files handed to the peer that takes the sandbox, on the bulk lane or a QUIC
//! stream, beside the peer's answer.

use silk_mesh::{Mesh, wire};
use tokio::io::{AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::{PeerReply, PeerRequest, unreachable_peer};
use crate::error::NodeError;
use crate::node::fleet::SnapshotBytes;

/// A hand-over's answer, and whether the files were captured whole.
type HandedOver = (PeerReply, std::io::Result<()>);

/// A hand-over on the bulk lane. The peer's answer is awaited while the files are sent: a
/// refusal comes before it has read them all, and stops the sending.
pub(super) async fn bulk(
    stream: silk_mesh::bulk::BulkStream,
    req: &PeerRequest,
    mut files: SnapshotBytes,
) -> Result<HandedOver, NodeError> {
    let abort = silk_mesh::bulk::Abort::of(&stream).map_err(unreachable_peer)?;
    let mut stream = stream;
    wire::write_frame(&mut stream, req).await.map_err(unreachable_peer)?;
    let (mut recv, mut send) = tokio::io::split(stream);
    let answer = wire::read_frame::<PeerReply>(&mut recv);
    tokio::pin!(answer);
    let captured = tokio::select! {
        reply = &mut answer => return Ok((answered(reply)?, Ok(()))),
        captured = copy_files(&mut files, &mut send) => captured,
    };
    drop(files);
    // Finished (`close_notify`) only after the last byte of a whole capture; else ended
    // without it, and the peer refuses what came.
    match &captured {
        Ok(()) => drop(send.shutdown().await),
        Err(_) => abort.abort(),
    }
    Ok((answered(answer.await)?, captured))
}

/// A hand-over on a QUIC stream: finished after the last byte of a whole capture, reset if
/// the capture failed.
pub(super) async fn quic(
    mesh: &Mesh,
    peer: &str,
    req: &PeerRequest,
    mut files: SnapshotBytes,
) -> Result<HandedOver, NodeError> {
    let (mut send, mut recv) = mesh.open(peer).await.map_err(unreachable_peer)?;
    wire::write_frame(&mut send, req).await.map_err(unreachable_peer)?;
    let captured = copy_files(&mut files, &mut send).await;
    match &captured {
        Ok(()) => drop(send.finish()),
        Err(_) => drop(send.reset(0u32.into())),
    }
    drop(files);
    Ok((answered(wire::read_frame(&mut recv).await)?, captured))
}

/// Copies a capture to the peer in 1 MiB reads: `Err` only for the capture's own failure.
/// A write that fails is the peer no longer reading (it refused): its answer says why.
async fn copy_files(
    files: &mut SnapshotBytes,
    to: &mut (impl AsyncWrite + Unpin),
) -> std::io::Result<()> {
    let mut buf = vec![0u8; 1 << 20];
    loop {
        match files.read(&mut buf).await? {
            0 => return Ok(()),
            n if to.write_all(&buf[..n]).await.is_err() => return Ok(()),
            _ => {}
        }
    }
}

fn answered(
    reply: Result<Option<PeerReply>, silk_mesh::MeshError>,
) -> Result<PeerReply, NodeError> {
    reply.map_err(unreachable_peer)?.ok_or_else(|| unreachable_peer("the peer closed the call"))
}
