//! The sans-IO codec: frames to bytes and back, with no sockets involved.
//!
//! A frame on the wire is a `u32` little-endian body length followed by the postcard encoding of
//! a [`Frame`]. The four byte-stream variants (`Stdin`, `Stdout`, `Stderr`, `Data`) have tags
//! 0..=3 and a body of `tag, varint(len), payload`; [`decode`] recognises them and hands out the
//! payload as a [`Bytes`] slice of the read buffer, so the only copy of bulk data on the receive
//! path is the socket read itself. Every other frame goes through postcard.

use bytes::{Buf, BufMut, Bytes, BytesMut};

use crate::{Frame, MAX_FRAME, ProtoError};

const LEN_PREFIX: usize = 4;
/// Tags of the byte-stream variants, in `Frame` order.
const TAG_STDIN: u8 = 0;
const TAG_DATA: u8 = 3;

/// Appends `frame` to `dst`. On error `dst` is left as it was.
pub fn encode(frame: &Frame, dst: &mut BytesMut) -> Result<(), ProtoError> {
    let start = dst.len();
    dst.put_u32_le(0); // patched below, once the body length is known
    let body = postcard::serialize_with_flavor(frame, BytesMutFlavor(dst))
        .map_err(|e| ProtoError::Malformed(e.to_string()));
    let body = match body {
        Ok(()) => dst.len() - start - LEN_PREFIX,
        Err(e) => {
            dst.truncate(start);
            return Err(e);
        }
    };
    if body > MAX_FRAME {
        dst.truncate(start);
        return Err(ProtoError::TooLarge(body));
    }
    dst[start..start + LEN_PREFIX].copy_from_slice(&(body as u32).to_le_bytes());
    Ok(())
}

/// Takes one frame off the front of `src`, or returns `Ok(None)` (having reserved room for the
/// rest of the frame) when `src` does not hold a whole frame yet.
///
/// A frame whose body fails to decode is consumed and reported as [`ProtoError::Malformed`], so
/// the caller may answer and keep reading. [`ProtoError::TooLarge`] leaves `src` untouched: the
/// stream cannot be trusted after it.
pub fn decode(src: &mut BytesMut) -> Result<Option<Frame>, ProtoError> {
    if src.len() < LEN_PREFIX {
        return Ok(None);
    }
    let len = u32::from_le_bytes([src[0], src[1], src[2], src[3]]) as usize;
    if len > MAX_FRAME {
        return Err(ProtoError::TooLarge(len));
    }
    if src.len() < LEN_PREFIX + len {
        src.reserve(LEN_PREFIX + len - src.len());
        return Ok(None);
    }
    src.advance(LEN_PREFIX);
    let body = src.split_to(len);
    decode_body(body).map(Some)
}

pub(crate) fn decode_body(mut body: BytesMut) -> Result<Frame, ProtoError> {
    let Some(&tag) = body.first() else {
        return Err(ProtoError::Malformed("empty frame body".into()));
    };
    if tag > TAG_DATA {
        let (frame, rest) = postcard::take_from_bytes::<Frame>(&body)
            .map_err(|e| ProtoError::Malformed(e.to_string()))?;
        if !rest.is_empty() {
            return Err(ProtoError::Malformed(format!("{} trailing bytes", rest.len())));
        }
        return Ok(frame);
    }
    let (payload_len, varint_len) = read_varint(&body[1..])?;
    if payload_len != (body.len() - 1 - varint_len) as u64 {
        return Err(ProtoError::Malformed("data length disagrees with frame length".into()));
    }
    body.advance(1 + varint_len);
    let payload: Bytes = body.freeze();
    Ok(match tag - TAG_STDIN {
        0 => Frame::Stdin(payload),
        1 => Frame::Stdout(payload),
        2 => Frame::Stderr(payload),
        _ => Frame::Data(payload),
    })
}

/// What the front of a receive buffer holds, for a reader that moves a `Data` frame's payload
/// without buffering it (silkd's `write` splices it from the socket into the file): the
/// frame's header is read, its payload is left on the socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Front {
    /// This many more bytes, at least, before anything can be said.
    Need(usize),
    /// A `Data` frame: `header` bytes, then `payload` bytes (buffered or not yet read).
    Data { header: usize, payload: usize },
    /// Any other frame, `len` bytes with its length prefix: [`decode`] it once buffered.
    Other { len: usize },
}

/// Reads the front of `src` (see [`Front`]) without consuming it. Errors as [`decode`] would.
pub fn front(src: &[u8]) -> Result<Front, ProtoError> {
    if src.len() < LEN_PREFIX + 1 {
        return Ok(Front::Need(LEN_PREFIX + 1 - src.len()));
    }
    let len = u32::from_le_bytes([src[0], src[1], src[2], src[3]]) as usize;
    if len > MAX_FRAME {
        return Err(ProtoError::TooLarge(len));
    }
    if src[LEN_PREFIX] != TAG_DATA {
        return Ok(Front::Other { len: LEN_PREFIX + len });
    }
    // The body is the tag, the payload's length as a varint, the payload: the frame's length
    // fixes how long that varint must be.
    let varint = (1..=10)
        .find(|&v| len > v && varint_len((len - 1 - v) as u64) == v)
        .ok_or_else(|| ProtoError::Malformed("data length disagrees with frame length".into()))?;
    let header = LEN_PREFIX + 1 + varint;
    if src.len() < header {
        return Ok(Front::Need(header - src.len()));
    }
    let (payload, _) = read_varint(&src[LEN_PREFIX + 1..header])?;
    if payload != (len - 1 - varint) as u64 {
        return Err(ProtoError::Malformed("data length disagrees with frame length".into()));
    }
    Ok(Front::Data { header, payload: payload as usize })
}

pub(crate) fn varint_len(mut n: u64) -> usize {
    let mut len = 1;
    while n >= 0x80 {
        n >>= 7;
        len += 1;
    }
    len
}

/// Decodes postcard's LEB128 varint for a `usize` (at most 10 bytes).
fn read_varint(src: &[u8]) -> Result<(u64, usize), ProtoError> {
    let mut value = 0u64;
    for (i, &byte) in src.iter().take(10).enumerate() {
        value |= u64::from(byte & 0x7f) << (7 * i);
        if byte & 0x80 == 0 {
            return Ok((value, i + 1));
        }
    }
    Err(ProtoError::Malformed("bad length varint".into()))
}

/// Lets postcard serialise straight into the caller's buffer.
struct BytesMutFlavor<'a>(&'a mut BytesMut);

impl postcard::ser_flavors::Flavor for BytesMutFlavor<'_> {
    type Output = ();

    fn try_push(&mut self, data: u8) -> postcard::Result<()> {
        self.0.put_u8(data);
        Ok(())
    }

    fn try_extend(&mut self, data: &[u8]) -> postcard::Result<()> {
        self.0.extend_from_slice(data);
        Ok(())
    }

    fn finalize(self) -> postcard::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ExecRequest, Frame};

    fn roundtrip(frame: Frame) {
        let mut buf = BytesMut::new();
        encode(&frame, &mut buf).unwrap();
        assert_eq!(decode(&mut buf).unwrap(), Some(frame));
        assert!(buf.is_empty());
    }

    #[test]
    fn data_frames_roundtrip_through_the_fast_path() {
        for len in [0usize, 1, 127, 128, 16_383, 16_384, 256 * 1024] {
            let payload = Bytes::from(vec![0xa5; len]);
            roundtrip(Frame::Stdin(payload.clone()));
            roundtrip(Frame::Stdout(payload.clone()));
            roundtrip(Frame::Stderr(payload.clone()));
            roundtrip(Frame::Data(payload));
        }
    }

    #[test]
    fn fast_path_agrees_with_postcard() {
        let frame = Frame::Data(Bytes::from_static(&[7; 300]));
        let via_postcard = postcard::to_allocvec(&frame).unwrap();
        let mut buf = BytesMut::new();
        encode(&frame, &mut buf).unwrap();
        assert_eq!(&buf[4..], &via_postcard[..]);
        let decoded: Frame = postcard::from_bytes(&via_postcard).unwrap();
        assert_eq!(decode_body(BytesMut::from(&via_postcard[..])).unwrap(), decoded);
    }

    #[test]
    fn partial_input_yields_none_until_complete() {
        let mut whole = BytesMut::new();
        encode(&Frame::Exec(ExecRequest::default()), &mut whole).unwrap();
        encode(&Frame::Done, &mut whole).unwrap();
        let mut buf = BytesMut::new();
        let mut frames = vec![];
        for byte in whole.iter() {
            buf.put_u8(*byte);
            while let Some(f) = decode(&mut buf).unwrap() {
                frames.push(f);
            }
        }
        assert_eq!(frames, vec![Frame::Exec(ExecRequest::default()), Frame::Done]);
    }

    #[test]
    fn oversize_length_is_rejected_before_buffering() {
        let mut buf = BytesMut::new();
        buf.put_u32_le(MAX_FRAME as u32 + 1);
        assert!(matches!(decode(&mut buf), Err(ProtoError::TooLarge(_))));
        let huge = Frame::Data(Bytes::from(vec![0; MAX_FRAME]));
        let mut out = BytesMut::from(&b"keep"[..]);
        assert!(matches!(encode(&huge, &mut out), Err(ProtoError::TooLarge(_))));
        assert_eq!(&out[..], b"keep");
    }

    #[test]
    fn malformed_body_is_consumed_and_the_next_frame_decodes() {
        let mut buf = BytesMut::new();
        buf.put_u32_le(1);
        buf.put_u8(0xfe); // an unknown variant tag
        encode(&Frame::Info, &mut buf).unwrap();
        assert!(matches!(decode(&mut buf), Err(ProtoError::Malformed(_))));
        assert_eq!(decode(&mut buf).unwrap(), Some(Frame::Info));
    }

    #[test]
    fn trailing_bytes_and_bad_data_lengths_are_malformed() {
        let mut buf = BytesMut::new();
        buf.put_u32_le(2);
        buf.put_slice(&[10, 0]); // `Info` plus one stray byte
        assert!(matches!(decode(&mut buf), Err(ProtoError::Malformed(_))));
        buf.put_u32_le(3);
        buf.put_slice(&[3, 5, 0]); // `Data` claiming 5 bytes, carrying 1
        assert!(matches!(decode(&mut buf), Err(ProtoError::Malformed(_))));
        buf.put_u32_le(0);
        assert!(matches!(decode(&mut buf), Err(ProtoError::Malformed(_))));
    }

    #[test]
    fn front_reads_a_data_header_and_leaves_its_payload() {
        for len in [0usize, 1, 127, 128, 16_383, 16_384, 256 * 1024] {
            let mut buf = BytesMut::new();
            encode(&Frame::Data(Bytes::from(vec![1; len])), &mut buf).unwrap();
            let header = buf.len() - len;
            // Byte by byte: never more asked for than the header still lacks.
            let mut at = 0;
            while let Front::Need(n) = front(&buf[..at]).unwrap() {
                assert!(at + n <= header, "{len}: asked for {n} at {at} of a {header}-byte header");
                at += n;
            }
            assert_eq!(at, header, "{len}");
            assert_eq!(front(&buf[..at]).unwrap(), Front::Data { header, payload: len });
        }
        let mut buf = BytesMut::new();
        encode(&Frame::Eof, &mut buf).unwrap();
        assert_eq!(front(&buf).unwrap(), Front::Other { len: buf.len() });
        // A length the varint cannot agree with, and one that disagrees with it.
        assert!(matches!(front(&[1, 0, 0, 0, TAG_DATA]), Err(ProtoError::Malformed(_))));
        assert!(matches!(front(&[3, 0, 0, 0, TAG_DATA, 5]), Err(ProtoError::Malformed(_))));
        let mut big = BytesMut::new();
        big.put_u32_le(MAX_FRAME as u32 + 1);
        big.put_u8(TAG_DATA);
        assert!(matches!(front(&big), Err(ProtoError::TooLarge(_))));
    }

    /// A cheap stand-in for the fuzz target that runs in every `cargo test`: random and mutated
    /// inputs must never panic the decoder.
    #[test]
    fn decoder_never_panics_on_garbage() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let mut valid = BytesMut::new();
        encode(&Frame::Exec(ExecRequest::default()), &mut valid).unwrap();
        for _ in 0..20_000 {
            let mut input = valid.clone();
            for _ in 0..(next() % 4) {
                let at = next() as usize % input.len();
                input[at] = next() as u8;
            }
            let len = next() as usize % 64;
            let mut buf = BytesMut::new();
            buf.put_u32_le(len as u32);
            buf.extend((0..len).map(|_| next() as u8));
            for mut b in [input, buf] {
                while let Ok(Some(_)) | Err(ProtoError::Malformed(_)) = decode(&mut b) {
                    if b.is_empty() {
                        break;
                    }
                }
            }
        }
    }
}
