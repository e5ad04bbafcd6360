//! Feeds arbitrary bytes to the frame decoder: it must never panic, and every frame it accepts
//! must re-encode to bytes that decode to the same frame.
#![no_main]

use bytes::BytesMut;
use libfuzzer_sys::fuzz_target;
use silk_proto::{ProtoError, decode, encode};

fuzz_target!(|data: &[u8]| {
    let mut input = BytesMut::from(data);
    loop {
        match decode(&mut input) {
            Ok(Some(frame)) => {
                let mut again = BytesMut::new();
                encode(&frame, &mut again).expect("a decoded frame re-encodes");
                assert_eq!(decode(&mut again).unwrap().as_ref(), Some(&frame));
            }
            Err(ProtoError::Malformed(_)) => continue,
            Ok(None) | Err(_) => break,
        }
    }
});
