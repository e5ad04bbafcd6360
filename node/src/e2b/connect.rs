//! The Connect protocol as E2B's envd speaks it with the JSON codec: unary calls are a JSON
//! body each way (`application/json`); streams are 5-byte envelopes (`flags: u8`, big-endian
//! `u32` length, payload) of `application/connect+json`, ended by an envelope with flag `0x02`
//! whose payload is `{}` or `{"error": {...}}`. Errors carry a code string whose HTTP status
//! is fixed by the protocol. Pure: no I/O here.

use bytes::{BufMut, Bytes, BytesMut};
use serde::Serialize;

/// A message envelope.
const MESSAGE: u8 = 0x00;
/// The compressed flag: never used by the SDK (compression is off), refused.
const COMPRESSED: u8 = 0x01;
/// The end-of-stream envelope.
const END: u8 = 0x02;

/// A Connect error code (the subset envd answers with).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Code {
    InvalidArgument,
    NotFound,
    AlreadyExists,
    PermissionDenied,
    Unauthenticated,
    DeadlineExceeded,
    ResourceExhausted,
    FailedPrecondition,
    Unimplemented,
    Internal,
    Unavailable,
}

impl Code {
    pub fn as_str(self) -> &'static str {
        match self {
            Code::InvalidArgument => "invalid_argument",
            Code::NotFound => "not_found",
            Code::AlreadyExists => "already_exists",
            Code::PermissionDenied => "permission_denied",
            Code::Unauthenticated => "unauthenticated",
            Code::DeadlineExceeded => "deadline_exceeded",
            Code::ResourceExhausted => "resource_exhausted",
            Code::FailedPrecondition => "failed_precondition",
            Code::Unimplemented => "unimplemented",
            Code::Internal => "internal",
            Code::Unavailable => "unavailable",
        }
    }

    /// The HTTP status the protocol gives the code on a unary answer.
    pub fn http_status(self) -> u16 {
        match self {
            Code::InvalidArgument | Code::FailedPrecondition => 400,
            Code::Unauthenticated => 401,
            Code::PermissionDenied => 403,
            Code::NotFound => 404,
            Code::AlreadyExists => 409,
            Code::ResourceExhausted => 429,
            Code::Internal => 500,
            Code::Unimplemented => 501,
            Code::Unavailable => 503,
            Code::DeadlineExceeded => 504,
        }
    }
}

/// A Connect error: its code and a message for people.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Error {
    pub code: Code,
    pub message: String,
}

impl Error {
    pub fn new(code: Code, message: impl Into<String>) -> Error {
        Error { code, message: message.into() }
    }

    /// The JSON body of a unary error answer (and the `error` of an end-of-stream envelope).
    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({ "code": self.code.as_str(), "message": self.message })
    }
}

/// One message framed as an envelope.
pub fn envelope(message: &impl Serialize) -> Bytes {
    let json = serde_json::to_vec(message).expect("envd messages serialize");
    frame(MESSAGE, &json)
}

/// The end-of-stream envelope: `{}` or the error.
pub fn end(error: Option<&Error>) -> Bytes {
    let body = match error {
        None => serde_json::json!({}),
        Some(e) => serde_json::json!({ "error": e.json() }),
    };
    frame(END, body.to_string().as_bytes())
}

fn frame(flags: u8, payload: &[u8]) -> Bytes {
    let mut out = BytesMut::with_capacity(5 + payload.len());
    out.put_u8(flags);
    out.put_u32(payload.len() as u32);
    out.put_slice(payload);
    out.freeze()
}

/// Reads envelopes from a client's stream of bytes, which may cut them anywhere.
#[derive(Debug, Default)]
pub struct Envelopes {
    buf: BytesMut,
    ended: bool,
}

impl Envelopes {
    /// At most this many bytes in one message: what a request may cost is bounded.
    pub const MAX_MESSAGE: usize = 4 << 20;

    /// Bytes after the end-of-stream envelope are dropped, never kept.
    pub fn push(&mut self, bytes: &[u8]) {
        if !self.ended {
            self.buf.extend_from_slice(bytes);
        }
    }

    /// The next whole message's payload, `Ok(None)` when more bytes are needed (or after the
    /// end-of-stream envelope).
    pub fn next_message(&mut self) -> Result<Option<Bytes>, Error> {
        loop {
            if self.ended || self.buf.len() < 5 {
                return Ok(None);
            }
            let flags = self.buf[0];
            let len = u32::from_be_bytes([self.buf[1], self.buf[2], self.buf[3], self.buf[4]]);
            let len = len as usize;
            if len > Self::MAX_MESSAGE {
                return Err(Error::new(Code::ResourceExhausted, "message larger than 4 MiB"));
            }
            if flags & COMPRESSED != 0 {
                return Err(Error::new(Code::Internal, "compressed messages are not accepted"));
            }
            if self.buf.len() < 5 + len {
                return Ok(None);
            }
            let mut whole = self.buf.split_to(5 + len);
            let payload = whole.split_off(5).freeze();
            match flags {
                MESSAGE => return Ok(Some(payload)),
                END => {
                    self.ended = true;
                    self.buf.clear();
                }
                other => {
                    return Err(Error::new(
                        Code::InvalidArgument,
                        format!("envelope flags {other}"),
                    ));
                }
            }
        }
    }

    /// Bytes received but not yet a whole envelope (less than one message's bound).
    pub fn pending(&self) -> usize {
        self.buf.len()
    }
}

/// The `connect-timeout-ms` header's value, if it is a valid one.
pub fn timeout_ms(header: Option<&str>) -> Option<u64> {
    header?.trim().parse::<u64>().ok().filter(|&ms| ms > 0)
}

/// The reader's contract, checked on arbitrary input by the fuzz target (`node/fuzz`) and by a
/// seeded pass in the tests: no panic, never more held than one message's bound, the same
/// answer however the bytes are cut (the first byte says where), and every JSON message
/// re-framed reads back byte for byte.
#[cfg(any(test, fuzzing))]
pub fn check_reader(data: &[u8]) {
    fn read(parts: &[&[u8]]) -> (Vec<Bytes>, Option<Code>) {
        let mut r = Envelopes::default();
        let mut got = vec![];
        for part in parts {
            r.push(part);
            loop {
                match r.next_message() {
                    Ok(Some(m)) => got.push(m),
                    Ok(None) => break,
                    Err(e) => return (got, Some(e.code)),
                }
            }
            assert!(r.pending() < Envelopes::MAX_MESSAGE + 5);
        }
        (got, None)
    }
    let Some((&cut, rest)) = data.split_first() else { return };
    let cut = (cut as usize * rest.len()) / 255;
    let whole = read(&[rest]);
    assert_eq!(read(&[&rest[..cut], &rest[cut..]]), whole);
    for m in whole.0 {
        if let Ok(v) = serde_json::from_slice::<serde_json::Value>(&m) {
            // The framing is checked, not serde_json's float parsing (not exact by default: the
            // first fuzz campaign found 6.666666666666665e52 read back one ulp off).
            let (again, error) = read(&[&envelope(&v)]);
            assert!(error.is_none());
            assert_eq!(again[0], serde_json::to_vec(&v).unwrap());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fuzz target's property over a seeded quick pass: streams the SDK sends, mutated
    /// (bytes flipped, inserted, dropped, lengths rewritten), 20 000 cases.
    #[test]
    fn the_reader_keeps_its_contract_on_mutated_streams() {
        let seeds: Vec<Vec<u8>> = vec![
            envelope(&serde_json::json!({"process": {"cmd": "/bin/bash", "args": ["-l", "-c", "ls"]}, "stdin": true})).to_vec(),
            [
                envelope(&serde_json::json!({"start": {"process": {"pid": 7}}})),
                envelope(&serde_json::json!({"data": {"stdin": "aGVsbG8="}})),
                envelope(&serde_json::json!({"keepalive": {}})),
                end(None),
            ]
            .concat(),
            end(Some(&Error::new(Code::NotFound, "gone"))).to_vec(),
        ];
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for case in 0..20_000 {
            let mut data = seeds[case % seeds.len()].clone();
            for _ in 0..next() % 4 {
                let at = (next() as usize) % (data.len() + 1);
                match next() % 4 {
                    0 if at < data.len() => data[at] ^= 1 << (next() % 8),
                    1 => data.insert(at, next() as u8),
                    2 if at < data.len() => drop(data.remove(at)),
                    _ if at + 4 < data.len() => data[at..at + 4]
                        .copy_from_slice(&(next() as u32 >> (next() % 32)).to_be_bytes()),
                    _ => {}
                }
            }
            data.insert(0, next() as u8);
            check_reader(&data);
        }
    }

    #[test]
    fn envelopes_cut_anywhere_come_back_whole() {
        let a = envelope(&serde_json::json!({"process": {"cmd": "/bin/bash"}}));
        let b = envelope(&serde_json::json!({"x": 1}));
        let all: Vec<u8> = [a.as_ref(), b.as_ref(), end(None).as_ref()].concat();
        for cut in 0..all.len() {
            let mut r = Envelopes::default();
            let mut got = vec![];
            for part in [&all[..cut], &all[cut..]] {
                r.push(part);
                while let Some(m) = r.next_message().unwrap() {
                    got.push(serde_json::from_slice::<serde_json::Value>(&m).unwrap());
                }
            }
            assert_eq!(got.len(), 2, "cut at {cut}");
            assert_eq!(got[0]["process"]["cmd"], "/bin/bash");
            assert_eq!(r.pending(), 0);
        }
    }

    #[test]
    fn hostile_envelopes_are_refused_not_buffered() {
        let mut r = Envelopes::default();
        r.push(&[0, 0xff, 0xff, 0xff, 0xff]);
        assert_eq!(r.next_message().unwrap_err().code, Code::ResourceExhausted);
        let mut r = Envelopes::default();
        r.push(&frame(COMPRESSED, b"{}"));
        assert_eq!(r.next_message().unwrap_err().code, Code::Internal);
        let mut r = Envelopes::default();
        r.push(&frame(0x80, b"{}"));
        assert_eq!(r.next_message().unwrap_err().code, Code::InvalidArgument);
    }

    #[test]
    fn the_end_envelope_carries_the_error() {
        let e = Error::new(Code::DeadlineExceeded, "too slow");
        let bytes = end(Some(&e));
        assert_eq!(bytes[0], END);
        let v: serde_json::Value = serde_json::from_slice(&bytes[5..]).unwrap();
        assert_eq!(v["error"]["code"], "deadline_exceeded");
        assert_eq!(&end(None)[5..], b"{}");
        assert_eq!(Code::NotFound.http_status(), 404);
        assert_eq!(timeout_ms(Some("60000")), Some(60000));
        assert_eq!(timeout_ms(Some("0")), None);
        assert_eq!(timeout_ms(Some("x")), None);
    }
}
