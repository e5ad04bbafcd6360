//! Encode/decode cost of a small request and of a 256 KiB data frame.

use bytes::{Bytes, BytesMut};
use criterion::{BatchSize, Criterion, Throughput, black_box, criterion_group, criterion_main};
use silk_proto::{Command, DATA_CHUNK, ExecRequest, Frame, decode, encode};

fn small_request() -> Frame {
    Frame::Exec(ExecRequest {
        command: Command { argv: vec!["true".into()], ..Default::default() },
        ..Default::default()
    })
}

fn codec(c: &mut Criterion) {
    let mut group = c.benchmark_group("codec");
    for (name, frame) in [
        ("exec_request", small_request()),
        ("data_256k", Frame::Data(Bytes::from(vec![0x5a; DATA_CHUNK]))),
    ] {
        let mut encoded = BytesMut::new();
        encode(&frame, &mut encoded).unwrap();
        group.throughput(Throughput::Bytes(encoded.len() as u64));
        let mut buf = BytesMut::with_capacity(encoded.len());
        group.bench_function(format!("encode/{name}"), |b| {
            b.iter(|| {
                buf.clear();
                encode(black_box(&frame), &mut buf).unwrap();
            })
        });
        group.bench_function(format!("decode/{name}"), |b| {
            // A fresh read buffer each time, as a socket read would produce; the copy that makes
            // it is setup, not timed.
            b.iter_batched(
                || encoded.clone(),
                |mut input| black_box(decode(&mut input).unwrap().unwrap()),
                BatchSize::SmallInput,
            )
        });
    }
    group.finish();
}

criterion_group!(benches, codec);
criterion_main!(benches);
