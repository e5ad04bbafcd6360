//! The request bodies under mutation: the seeded quick pass of the node's `bodies` fuzz target
//! (`node/fuzz`, which runs the node's own parser, `node/src/api/body.rs`). The node reads a
//! body only if it is one JSON object, then as the route's type; this pass checks the types'
//! side of that contract with the same object-only rule: no panic, and any body a type accepts,
//! serialized again (as the SDK would send that value), reads back as the same value. A type
//! that loses or changes a field on the way round would make the node act on something other
//! than what the client meant.

use std::fmt::Debug;

use serde::Serialize;
use serde::de::DeserializeOwned;
use silk_api::*;

/// What the node accepts, minus the integral-float leniency (`15.0` for `15`), which is the
/// node's, not the types'.
fn parse<T: DeserializeOwned>(body: &[u8]) -> Option<T> {
    if body.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return None;
    }
    serde_json::from_slice(body).ok()
}

/// Reads `body` as `T`; if accepted, checks the round trip. Says whether it was accepted.
fn check<T: DeserializeOwned + Serialize + PartialEq + Debug>(body: &[u8]) -> bool {
    let Some(value) = parse::<T>(body) else { return false };
    let again = serde_json::to_vec(&value).expect("a request body serializes");
    let read = parse::<T>(&again);
    assert_eq!(read.as_ref(), Some(&value), "{} came back as {}", show(body), show(&again));
    true
}

fn show(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Every request type the node reads a body as; returns how many accepted `body`.
fn check_all(body: &[u8]) -> usize {
    [
        check::<ClaimRequest>(body),
        check::<ExecRequest>(body),
        check::<ForkRequest>(body),
        check::<TenantRequest>(body),
        check::<TenantPatch>(body),
        check::<Pools>(body),
        check::<PreviewRequest>(body),
        check::<CheckpointRequest>(body),
        check::<BranchRequest>(body),
        check::<MoveRequest>(body),
        check::<StopRequest>(body),
        check::<RenewRequest>(body),
    ]
    .into_iter()
    .filter(|&accepted| accepted)
    .count()
}

/// Real bodies, one or more per type (the seed corpus of the fuzz target holds the same).
const SEEDS: &[&str] = &[
    r#"{"template":"python","size":"medium","lane":"egress","ttl_seconds":600,"metadata":{"k":"v","a":"b"},"on_expire":"archive","egress":{"allow":["*.pypi.org","203.0.113.0/24"],"deny":["evil.example.com"]}}"#,
    r#"{"argv":["/bin/sh","-c","echo hi"],"cwd":"/tmp","env":{"A":"1"},"user":"root","stdin":"data","timeout_seconds":30}"#,
    r#"{"count":3,"ttl_seconds":60,"memory":"required"}"#,
    r#"{"name":"team-a","max_sandboxes":10,"max_checkpoints":5,"max_store_bytes":1073741824,"max_sandbox_seconds":3600}"#,
    r#"{"max_sandboxes":1,"max_sandbox_seconds":0}"#,
    r#"{"pools":[{"template":"host","size":"small","lane":"none","warm":2,"warm_max":4,"idle_hibernate_seconds":300,"memory":"off","memory_golden":true,"egress":{"allow":["*"]}}]}"#,
    r#"{"port":8080,"ttl_seconds":3600}"#,
    r#"{"name":"before-upgrade","memory":"auto"}"#,
    r#"{"ttl_seconds":60,"metadata":{"x":"y"},"on_expire":"destroy","memory":"off"}"#,
    r#"{"to":"node-b","memory":"required"}"#,
    r#" {} "#,
];

/// Bytes that matter to JSON, inserted more often than random ones.
const JSON_BYTES: &[u8] = b"{}[]\",:0123456789.eE-+ \\nul";

#[test]
fn mutated_bodies_read_back_as_what_they_said() {
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    for seed in SEEDS {
        assert!(check_all(seed.as_bytes()) > 0, "seed {seed} is a valid body");
    }
    let mut accepted = 0;
    for case in 0..20_000 {
        let mut data = SEEDS[case % SEEDS.len()].as_bytes().to_vec();
        for _ in 0..1 + next() % 4 {
            let at = (next() as usize) % (data.len() + 1);
            match next() % 6 {
                0 if at < data.len() => data[at] ^= 1 << (next() % 8),
                1 => data.insert(at, JSON_BYTES[next() as usize % JSON_BYTES.len()]),
                2 => data.insert(at, next() as u8),
                3 if at < data.len() => drop(data.remove(at)),
                // A piece of another body: fields, values and nesting from other types.
                4 => {
                    let other = SEEDS[next() as usize % SEEDS.len()].as_bytes();
                    let from = next() as usize % other.len();
                    let to = (from + 1 + next() as usize % 40).min(other.len());
                    data.splice(at..at, other[from..to].iter().copied());
                }
                5 => data.truncate(at),
                _ => {}
            }
        }
        accepted += check_all(&data);
    }
    // The mutations leave plenty of bodies that still parse: the round trip is exercised.
    assert!(accepted > 1_000, "only {accepted} accepted");
}
