//! Feeds arbitrary bytes to the E2B listener's Connect envelope reader and checks its contract
//! (`connect::check_reader`: no panic, bounded, cut-independent, JSON re-frames to itself). The
//! module is compiled here on its own (it is pure): the fuzzer builds none of the node.
#![no_main]

use libfuzzer_sys::fuzz_target;

#[allow(dead_code)]
#[path = "../../src/e2b/connect.rs"]
mod connect;

fuzz_target!(|data: &[u8]| connect::check_reader(data));
