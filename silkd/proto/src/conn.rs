//! Frames over tokio streams.
//!
//! [`FrameReader`] and [`FrameWriter`] own one direction each, so a server can read a client's
//! input stream while it writes output (split the socket into owned halves first).
//! [`Connection`] bundles both over one stream for clients that take turns.
//!
//! Byte-stream frames are written with a vectored write of the header and the caller's payload,
//! so sending bulk data does not copy it into the write buffer.

use bytes::{Buf, BufMut, Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::{Frame, ProtoError, codec};

const READ_CHUNK: usize = 64 * 1024;
/// Payloads at least this big skip the write buffer (vectored write instead of a copy).
const ZERO_COPY_MIN: usize = 16 * 1024;

/// Reads frames from one half of a stream.
#[derive(Debug)]
pub struct FrameReader<R> {
    io: R,
    buf: BytesMut,
}

impl<R: AsyncRead + Unpin> FrameReader<R> {
    pub fn new(io: R) -> Self {
        FrameReader { io, buf: BytesMut::with_capacity(READ_CHUNK) }
    }

    /// The next frame, or `None` when the peer closed the stream between frames.
    /// Cancel-safe: dropping the future loses no bytes.
    pub async fn recv(&mut self) -> Result<Option<Frame>, ProtoError> {
        recv(&mut self.io, &mut self.buf).await
    }

    pub fn get_mut(&mut self) -> &mut R {
        &mut self.io
    }

    /// Bytes read from the stream and not yet decoded. A call that reads the stream itself
    /// (silkd's `write` splices payloads off the socket) starts from them, and puts back what
    /// it read past its own end.
    pub fn buffered(&mut self) -> &mut BytesMut {
        &mut self.buf
    }
}

/// Writes frames to one half of a stream.
#[derive(Debug)]
pub struct FrameWriter<W> {
    io: W,
    buf: BytesMut,
}

impl<W: AsyncWrite + Unpin> FrameWriter<W> {
    pub fn new(io: W) -> Self {
        FrameWriter { io, buf: BytesMut::with_capacity(4096) }
    }

    /// Buffers a frame; it goes out with the next [`send`](Self::send) or [`flush`](Self::flush).
    pub fn queue(&mut self, frame: &Frame) -> Result<(), ProtoError> {
        codec::encode(frame, &mut self.buf)
    }

    /// Writes everything queued plus `frame`.
    pub async fn send(&mut self, frame: &Frame) -> Result<(), ProtoError> {
        send(&mut self.io, &mut self.buf, frame).await
    }

    pub async fn flush(&mut self) -> Result<(), ProtoError> {
        flush(&mut self.io, &mut self.buf).await
    }

    pub fn get_mut(&mut self) -> &mut W {
        &mut self.io
    }
}

/// Both directions over one stream.
#[derive(Debug)]
pub struct Connection<S> {
    io: S,
    rbuf: BytesMut,
    wbuf: BytesMut,
}

impl<S: AsyncRead + AsyncWrite + Unpin> Connection<S> {
    pub fn new(io: S) -> Self {
        Connection { io, rbuf: BytesMut::with_capacity(READ_CHUNK), wbuf: BytesMut::new() }
    }

    pub async fn recv(&mut self) -> Result<Option<Frame>, ProtoError> {
        recv(&mut self.io, &mut self.rbuf).await
    }

    pub fn queue(&mut self, frame: &Frame) -> Result<(), ProtoError> {
        codec::encode(frame, &mut self.wbuf)
    }

    pub async fn send(&mut self, frame: &Frame) -> Result<(), ProtoError> {
        send(&mut self.io, &mut self.wbuf, frame).await
    }

    pub async fn flush(&mut self) -> Result<(), ProtoError> {
        flush(&mut self.io, &mut self.wbuf).await
    }

    /// Half-closes the write side (the peer reads end of stream).
    pub async fn shutdown(&mut self) -> Result<(), ProtoError> {
        self.flush().await?;
        Ok(self.io.shutdown().await?)
    }

    pub fn get_mut(&mut self) -> &mut S {
        &mut self.io
    }

    pub fn into_inner(self) -> S {
        self.io
    }
}

async fn recv<R: AsyncRead + Unpin>(
    io: &mut R,
    buf: &mut BytesMut,
) -> Result<Option<Frame>, ProtoError> {
    loop {
        if let Some(frame) = codec::decode(buf)? {
            return Ok(Some(frame));
        }
        if buf.capacity() - buf.len() < READ_CHUNK / 4 {
            buf.reserve(READ_CHUNK);
        }
        if io.read_buf(buf).await? == 0 {
            return if buf.is_empty() { Ok(None) } else { Err(ProtoError::Truncated) };
        }
    }
}

async fn send<W: AsyncWrite + Unpin>(
    io: &mut W,
    buf: &mut BytesMut,
    frame: &Frame,
) -> Result<(), ProtoError> {
    match stream_payload(frame) {
        Some((tag, payload)) if payload.len() >= ZERO_COPY_MIN => {
            // Header into the buffer, payload straight from the caller's `Bytes`.
            let total = 1 + codec::varint_len(payload.len() as u64) + payload.len();
            if total > crate::MAX_FRAME {
                return Err(ProtoError::TooLarge(total));
            }
            buf.put_u32_le(total as u32);
            buf.put_u8(tag);
            put_varint(buf, payload.len() as u64);
            let mut chain = buf.split().freeze().chain(payload.clone());
            io.write_all_buf(&mut chain).await?;
            Ok(())
        }
        _ => {
            codec::encode(frame, buf)?;
            flush(io, buf).await
        }
    }
}

async fn flush<W: AsyncWrite + Unpin>(io: &mut W, buf: &mut BytesMut) -> Result<(), ProtoError> {
    if !buf.is_empty() {
        io.write_all(buf).await?;
        buf.clear();
    }
    Ok(())
}

fn stream_payload(frame: &Frame) -> Option<(u8, &Bytes)> {
    match frame {
        Frame::Stdin(b) => Some((0, b)),
        Frame::Stdout(b) => Some((1, b)),
        Frame::Stderr(b) => Some((2, b)),
        Frame::Data(b) => Some((3, b)),
        _ => None,
    }
}

fn put_varint(buf: &mut BytesMut, mut n: u64) {
    while n >= 0x80 {
        buf.put_u8((n as u8) | 0x80);
        n >>= 7;
    }
    buf.put_u8(n as u8);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn big_and_small_frames_cross_a_duplex_pipe_in_order() {
        let (a, b) = tokio::io::duplex(8192);
        let mut left = Connection::new(a);
        let mut right = Connection::new(b);
        let big = Frame::Data(Bytes::from((0..300_000u32).map(|i| i as u8).collect::<Vec<_>>()));
        let sent = vec![Frame::Info, big, Frame::Eof, Frame::Stdout(Bytes::from_static(b"x"))];
        let writer = {
            let sent = sent.clone();
            tokio::spawn(async move {
                for f in &sent {
                    left.send(f).await.unwrap();
                }
                left.shutdown().await.unwrap();
            })
        };
        let mut got = vec![];
        while let Some(f) = right.recv().await.unwrap() {
            got.push(f);
        }
        writer.await.unwrap();
        assert_eq!(got, sent);
    }

    #[tokio::test]
    async fn eof_mid_frame_is_truncated() {
        let (a, b) = tokio::io::duplex(64);
        let mut right = Connection::new(b);
        let mut left = a;
        left.write_all(&[9, 0, 0, 0, 10]).await.unwrap();
        drop(left);
        assert!(matches!(right.recv().await, Err(ProtoError::Truncated)));
    }
}
