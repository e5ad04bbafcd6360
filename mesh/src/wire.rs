//! Frames on QUIC streams: the silk-proto framing (a `u32` LE length, then a postcard body, at
//! most 4 MiB) around the mesh's own message types.

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::MeshError;

pub const MAX_FRAME: usize = 4 << 20;

/// Writes one frame; returns its size on the wire.
pub async fn write_frame<T: Serialize>(
    send: &mut quinn::SendStream,
    msg: &T,
) -> Result<usize, MeshError> {
    let body = postcard::to_stdvec(msg).map_err(|e| MeshError::Codec(e.to_string()))?;
    if body.len() > MAX_FRAME {
        return Err(MeshError::Codec(format!("a {} byte frame exceeds {MAX_FRAME}", body.len())));
    }
    let mut frame = Vec::with_capacity(4 + body.len());
    frame.extend_from_slice(&(body.len() as u32).to_le_bytes());
    frame.extend_from_slice(&body);
    send.write_all(&frame).await.map_err(|e| MeshError::Io(e.to_string()))?;
    Ok(frame.len())
}

/// Reads one frame; `None` when the stream ended cleanly before one began.
pub async fn read_frame<T: DeserializeOwned>(
    recv: &mut quinn::RecvStream,
) -> Result<Option<T>, MeshError> {
    let mut len = [0u8; 4];
    match recv.read_exact(&mut len).await {
        Ok(()) => {}
        Err(quinn::ReadExactError::FinishedEarly(0)) => return Ok(None),
        Err(e) => return Err(MeshError::Io(e.to_string())),
    }
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_FRAME {
        return Err(MeshError::Codec(format!("a {len} byte frame exceeds {MAX_FRAME}")));
    }
    let mut body = vec![0; len];
    recv.read_exact(&mut body).await.map_err(|e| MeshError::Io(e.to_string()))?;
    postcard::from_bytes(&body).map(Some).map_err(|e| MeshError::Codec(e.to_string()))
}
