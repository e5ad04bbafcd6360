//! Feeds arbitrary bytes, as a stream of frames (state messages or numbers), to the steps of
//! `wire::read_frame` and checks `wire::mutations::check`: no panic, nothing allocated past the
//! 4 MiB cap (run with `-malloc_limit_mb=5`), every frame read writes back to itself, and the
//! messages read are applied at most once and never as the member's own.
#![no_main]

use libfuzzer_sys::fuzz_target;
use silk_mesh::core::mutations::cluster;
use silk_mesh::wire::mutations::check;

fuzz_target!(|data: &[u8]| check(data, &mut cluster()));
