//! The `port_forward` verb: one TCP connection to `127.0.0.1:<port>` inside the sandbox,
//! carried as `Data` frames both ways.
//!
//! silkd connects first and answers `Ready` (or `NotFound` when nothing listens). Each direction
//! then runs on its own, so a peer that is slow to read one way never stalls the other, and each
//! closes on its own (half-close): the client's `Eof` shuts down the write side of the TCP
//! connection, and the TCP side's end of stream reaches the client as an `Eof` frame from silkd.
//! The call ends with `Done` once both directions are closed, or at once on the client's
//! `Cancel` (the TCP connection is dropped). A TCP error ends it with `Unavailable`.

use std::net::Ipv4Addr;
use std::sync::atomic::{AtomicBool, Ordering};

use bytes::BytesMut;
use silk_proto::{ErrorKind, Frame, FrameReader, FrameWriter, WireError};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::call::{CallResult, Fail, interrupted};

const READ_CHUNK: usize = 64 * 1024;

fn broken(port: u16, e: std::io::Error) -> Fail {
    Fail::Call(WireError::new(ErrorKind::Unavailable, format!("127.0.0.1:{port}: {e}")))
}

pub async fn forward<R, W>(
    port: u16,
    rd: &mut FrameReader<R>,
    wr: &mut FrameWriter<W>,
) -> CallResult
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    if port == 0 {
        return Err(WireError::new(ErrorKind::BadRequest, "port 0").into());
    }
    let stream = TcpStream::connect((Ipv4Addr::LOCALHOST, port)).await.map_err(|e| {
        let kind = match e.kind() {
            std::io::ErrorKind::ConnectionRefused => ErrorKind::NotFound,
            _ => ErrorKind::Unavailable,
        };
        WireError::new(kind, format!("nothing accepts on 127.0.0.1:{port}: {e}"))
    })?;
    stream.set_nodelay(true).map_err(|e| broken(port, e))?;
    let (mut tcp_r, mut tcp_w) = stream.into_split();
    wr.send(&Frame::Ready).await?;

    // Both directions live in this task (the atomics only make the future `Send`); these say
    // which have closed.
    let (up_closed, down_closed) = (AtomicBool::new(false), AtomicBool::new(false));
    // Client → TCP. Returns when the call is over: both sides closed, or `Cancel`.
    let up = async {
        loop {
            match rd.recv().await {
                Ok(Some(Frame::Data(data))) if !up_closed.load(Ordering::Relaxed) => {
                    tcp_w.write_all(&data).await.map_err(|e| broken(port, e))?;
                }
                Ok(Some(Frame::Eof)) if !up_closed.load(Ordering::Relaxed) => {
                    tcp_w.shutdown().await.map_err(|e| broken(port, e))?;
                    up_closed.store(true, Ordering::Relaxed);
                    if down_closed.load(Ordering::Relaxed) {
                        return Ok(());
                    }
                }
                Ok(Some(Frame::Cancel)) => return Ok(()),
                other => return Err(interrupted(other, "during a port forward; it was closed")),
            }
        }
    };
    // TCP → client, until the TCP side's end of stream.
    let down = async {
        let mut buf = BytesMut::new();
        loop {
            buf.reserve(READ_CHUNK);
            match tcp_r.read_buf(&mut buf).await {
                Ok(0) => {
                    wr.send(&Frame::Eof).await?;
                    down_closed.store(true, Ordering::Relaxed);
                    return Ok::<(), Fail>(());
                }
                Ok(_) => wr.send(&Frame::Data(buf.split().freeze())).await?,
                Err(e) => return Err(broken(port, e)),
            }
        }
    };
    {
        tokio::pin!(up, down);
        let mut down_open = true;
        loop {
            tokio::select! {
                ended = &mut up => {
                    ended?;
                    break;
                }
                ended = &mut down, if down_open => {
                    ended?;
                    down_open = false;
                    if up_closed.load(Ordering::Relaxed) {
                        break;
                    }
                }
            }
        }
    }
    Ok(wr.send(&Frame::Done).await?)
}
