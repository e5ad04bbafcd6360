//! Feeds arbitrary bytes to the claims journal's replay, as a log or as damage done to a real
//! log, and checks its contract (`journal::mutations::check`: no panic; what it answers is
//! consistent and, from a damaged log, was written). The journal module is compiled here on its
//! own: the fuzzer builds none of the node.
#![no_main]

use libfuzzer_sys::fuzz_target;

#[allow(dead_code)]
#[path = "../../src/journal/mod.rs"]
mod journal;

fuzz_target!(|data: &[u8]| journal::mutations::check(data));
