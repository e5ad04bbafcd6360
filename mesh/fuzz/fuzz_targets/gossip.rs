//! Feeds arbitrary bytes, as a membership packet (a QUIC datagram from a peer), to a member of
//! a three-node cluster and checks `core::mutations::check_packet`: no panic, headers encode
//! back to themselves, the member never lists itself as a peer nor takes a state for itself,
//! and what it sends still fits a datagram.
#![no_main]

use libfuzzer_sys::fuzz_target;
use silk_mesh::core::mutations::{check_packet, cluster};

fuzz_target!(|data: &[u8]| check_packet(&mut cluster(), data));
