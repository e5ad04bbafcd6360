//! Watching a frame stream go by without touching it: a relay that copies bytes between a client
//! and silkd feeds each chunk it copies to a [`Sniffer`], which follows the frame boundaries and
//! hands out the small control frames (a request to run a program, say) decoded. Bulk frames
//! (stdin, stdout, data) and any frame larger than [`MAX_SNIFFED`] are skipped by their length,
//! never buffered, so watching costs a few comparisons per chunk. A stream that breaks the
//! framing (a length past [`MAX_FRAME`]) ends the watching; the bytes still flow.

use bytes::BytesMut;

use crate::{Frame, MAX_FRAME, codec};

/// Control frames up to this size are decoded; larger ones are skipped.
pub const MAX_SNIFFED: usize = 64 * 1024;
const LEN_PREFIX: usize = 4;
/// The tag of the last byte-stream variant (`Data`): bulk frames have tags 0..=3.
const TAG_BULK_LAST: u8 = 3;

#[derive(Debug, Default)]
pub struct Sniffer {
    /// A frame's length prefix and tag, as far as they have arrived.
    head: Vec<u8>,
    /// Bytes of the current frame still to pass over.
    skip: usize,
    /// The current frame's body, when it is decoded, and its length.
    body: Option<(usize, BytesMut)>,
    /// The stream broke the framing: nothing more is decoded.
    lost: bool,
}

impl Sniffer {
    /// Takes the next `data` of the stream; the control frames it completes go to `out`.
    pub fn feed(&mut self, mut data: &[u8], out: &mut Vec<Frame>) {
        while !data.is_empty() && !self.lost {
            if self.skip > 0 {
                let n = self.skip.min(data.len());
                self.skip -= n;
                data = &data[n..];
                continue;
            }
            if let Some((len, body)) = &mut self.body {
                let n = (*len - body.len()).min(data.len());
                body.extend_from_slice(&data[..n]);
                data = &data[n..];
                if body.len() == *len {
                    let (_, body) = self.body.take().expect("a body");
                    if let Ok(frame) = codec::decode_body(body) {
                        out.push(frame);
                    }
                }
                continue;
            }
            let n = (LEN_PREFIX + 1 - self.head.len()).min(data.len());
            self.head.extend_from_slice(&data[..n]);
            data = &data[n..];
            if self.head.len() < LEN_PREFIX + 1 {
                continue;
            }
            let len = u32::from_le_bytes([self.head[0], self.head[1], self.head[2], self.head[3]])
                as usize;
            let tag = self.head[LEN_PREFIX];
            self.head.clear();
            if len == 0 || len > MAX_FRAME {
                self.lost = true;
            } else if tag <= TAG_BULK_LAST || len > MAX_SNIFFED {
                self.skip = len - 1;
            } else {
                let mut body = BytesMut::with_capacity(len);
                body.extend_from_slice(&[tag]);
                self.body = Some((len, body));
                if len == 1 {
                    // A one-byte body is complete with its tag.
                    let (_, body) = self.body.take().expect("a body");
                    if let Ok(frame) = codec::decode_body(body) {
                        out.push(frame);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Command, ExecRequest};

    fn encoded(frames: &[Frame]) -> Vec<u8> {
        let mut buf = BytesMut::new();
        for f in frames {
            codec::encode(f, &mut buf).unwrap();
        }
        buf.to_vec()
    }

    fn exec(argv: &[&str]) -> Frame {
        Frame::Exec(ExecRequest {
            command: Command {
                argv: argv.iter().map(|s| s.to_string()).collect(),
                cwd: None,
                env: vec![],
                user: None,
            },
            stdin: true,
            timeout_ms: None,
        })
    }

    #[test]
    fn control_frames_come_out_whatever_the_chunking_and_bulk_is_skipped() {
        let big = Frame::Stdin(vec![7u8; 200_000].into());
        let frames = [
            exec(&["ls", "-l"]),
            big,
            Frame::Eof,
            Frame::Spawn(Command {
                argv: vec!["sleep".into()],
                cwd: None,
                env: vec![],
                user: None,
            }),
        ];
        let bytes = encoded(&frames);
        for chunk in [1, 3, 5, 4096, bytes.len()] {
            let (mut s, mut out) = (Sniffer::default(), vec![]);
            for piece in bytes.chunks(chunk) {
                s.feed(piece, &mut out);
            }
            assert_eq!(out.len(), 3, "chunks of {chunk}: {out:?}");
            assert_eq!(out[0], frames[0]);
            assert_eq!(out[1], Frame::Eof);
            assert_eq!(out[2], frames[3]);
            assert!(s.body.is_none() && s.head.is_empty(), "nothing held after a whole stream");
        }
    }

    #[test]
    fn a_broken_stream_stops_the_watching_not_the_bytes() {
        let (mut s, mut out) = (Sniffer::default(), vec![]);
        s.feed(&[0xff, 0xff, 0xff, 0xff, 9], &mut out);
        s.feed(&encoded(&[exec(&["id"])]), &mut out);
        assert!(out.is_empty() && s.lost);
    }
}
