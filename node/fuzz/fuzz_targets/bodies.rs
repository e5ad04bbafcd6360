//! Feeds arbitrary bytes to the node's request body parser (`node/src/api/body.rs`, compiled
//! here on its own with a stand-in for the node's error type) as each request type of the API.
//! The contract: no panic; only a JSON object is accepted; and an accepted body, serialized
//! again, parses to the same value (so what the node acts on is what the body said, and what
//! the SDK sends for a value is read as that value).
#![no_main]

use libfuzzer_sys::fuzz_target;
use serde::Serialize;
use serde::de::DeserializeOwned;
use silk_api::*;

#[allow(dead_code)]
#[path = "../../src/api/body.rs"]
mod body;

/// What `body.rs` needs of the node's error type.
mod error {
    pub use silk_api::Code;

    #[derive(Debug)]
    pub struct NodeError {
        pub code: Code,
        pub message: String,
    }

    impl NodeError {
        pub fn new(code: Code, message: impl Into<String>) -> NodeError {
            NodeError { code, message: message.into() }
        }

        pub fn bad_request(message: impl Into<String>) -> NodeError {
            NodeError::new(Code::BadRequest, message)
        }
    }

    impl axum::response::IntoResponse for NodeError {
        fn into_response(self) -> axum::response::Response {
            self.message.into_response()
        }
    }
}

fn check<T: DeserializeOwned + Serialize + PartialEq + std::fmt::Debug>(data: &[u8]) {
    let value = match body::parse::<T>(data) {
        Ok(value) => value,
        // A refusal is the client's fault, always: 400, never a 500.
        Err(e) => return assert!(matches!(e.code, Code::BadRequest), "{e:?}"),
    };
    assert_eq!(data.iter().find(|b| !b.is_ascii_whitespace()), Some(&b'{'), "only an object");
    let again = serde_json::to_vec(&value).expect("a request body serializes");
    match body::parse::<T>(&again) {
        Ok(read) => assert_eq!(read, value, "{}", String::from_utf8_lossy(&again)),
        Err(e) => panic!("{} does not parse again: {}", String::from_utf8_lossy(&again), e.message),
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&which, body)) = data.split_first() else { return };
    match which % 12 {
        0 => check::<ClaimRequest>(body),
        1 => check::<ExecRequest>(body),
        2 => check::<ForkRequest>(body),
        3 => check::<TenantRequest>(body),
        4 => check::<TenantPatch>(body),
        5 => check::<Pools>(body),
        6 => check::<PreviewRequest>(body),
        7 => check::<CheckpointRequest>(body),
        8 => check::<BranchRequest>(body),
        9 => check::<MoveRequest>(body),
        10 => check::<StopRequest>(body),
        _ => check::<RenewRequest>(body),
    }
});
