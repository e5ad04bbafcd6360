use std::time::Instant;
fn main() {
    let buf: Vec<u8> = (0..256usize << 20).map(|i| (i * 7 + i / 4096) as u8).collect();
    for _ in 0..3 {
        let t = Instant::now();
        let h = blake3::hash(&buf);
        let d = t.elapsed();
        println!("one-shot {:?} {:.0} MiB/s {}", d, 256.0 / d.as_secs_f64(), &h.to_hex()[..8]);
        let t = Instant::now();
        let mut k = blake3::Hasher::new_keyed(&[7; 32]);
        for c in buf.chunks(8192) { k.update(c); }
        let d = t.elapsed();
        println!("8K updates {:?} {:.0} MiB/s", d, 256.0 / d.as_secs_f64());
        let t = Instant::now();
        let mut k = blake3::Hasher::new_keyed(&[7; 32]);
        for c in buf.chunks(1 << 20) { k.update(c); }
        let d = t.elapsed();
        println!("1M updates {:?} {:.0} MiB/s", d, 256.0 / d.as_secs_f64());
        let t = Instant::now();
        let mut n = 0u64;
        for c in buf.chunks(1 << 20) { n += c.iter().map(|&b| b as u64).sum::<u64>(); }
        println!("sum {:?} {n}", t.elapsed());
    }
}
