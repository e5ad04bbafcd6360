//! Replay under damage, checked on arbitrary bytes by the fuzz target (`node/fuzz`, target
//! `journal`, which compiles this module on its own) and by a seeded pass in the tests.
//!
//! Two properties. Any bytes: replay answers records or an error, never panics, and what it
//! answers is what the writer would keep (each record's bytes decode to it, the torn tail cut
//! off replays the same, a compaction of the result replays the same, and a batch appended after
//! the cut is read back). A real log damaged (bits flipped, bytes inserted, dropped, cut, copied
//! over): every record replay answers is one that was written under that key; and unless whole
//! ranges were moved about, the answer is the state after some prefix of the batches, as a torn
//! tail leaves it.

use super::*;

/// The record the checks (and the journal's tests) journal: version 2, upgraded from
/// [`OldRec`] (version 1).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(super) struct Rec {
    pub(super) seq: u64,
    pub(super) note: String,
}

impl Record for Rec {
    const VERSION: u32 = 2;
    type Previous = OldRec;
    fn upgrade(old: OldRec) -> Rec {
        Rec { seq: old.seq, note: "upgraded".into() }
    }
}

/// `Rec` as version 1 wrote it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(super) struct OldRec {
    pub(super) seq: u64,
}

impl Past for OldRec {
    const VERSION: u32 = 1;
    type Before = NoOlder;
    fn upgrade(before: NoOlder) -> OldRec {
        match before {}
    }
}

type State = BTreeMap<String, Rec>;

/// The fuzz target's property. The first byte picks: even, the rest is a log as it is; odd, the
/// rest drives damage to a real log (see [`mutate`]).
pub fn check(data: &[u8]) {
    let Some((&mode, rest)) = data.split_first() else { return };
    if mode & 1 == 0 {
        check_any(rest);
    } else {
        // Two bytes a draw, so a position can reach past the first 256 bytes of the log.
        let mut draws = rest.chunks(2);
        let mut next = move || {
            draws.next().map_or(0, |d| d.iter().rev().fold(0, |n, &b| n << 8 | u64::from(b)))
        };
        let old = mode & 2 != 0;
        let (log, spliced) = mutate(&Written::new(old).log, 8, &mut next);
        check_damaged(old, &log, spliced);
    }
}

/// Any bytes: no panic, and a replay's answer is consistent with itself and with what the writer
/// does next (truncate the torn tail, append; or compact).
fn check_any(buf: &[u8]) {
    let Ok(r) = replay::<Rec>(buf) else { return };
    assert!((HEADER_LEN..=buf.len()).contains(&r.valid_len));
    assert!(r.encoded.keys().eq(r.values.keys()));
    for (key, bytes) in &r.encoded {
        let (k, v): (String, Option<Rec>) = postcard::from_bytes(bytes).expect("kept bytes decode");
        assert_eq!((&k, v.as_ref()), (key, r.values.get(key)));
    }
    // What `Journal::open` leaves on disk: the log cut to its valid length.
    let cut = &buf[..r.valid_len];
    let again = replay::<Rec>(cut).expect("the cut log replays");
    assert_eq!((again.values.clone(), again.valid_len), (r.values.clone(), r.valid_len));
    // Or compacts (as `Writer::compact` does, always after an upgrade): the same records.
    let mut image = header(Rec::VERSION).to_vec();
    image.resize(HEADER_LEN + FRAME_HEADER, 0);
    image = postcard::to_io(&r.encoded.len(), image).unwrap();
    r.encoded.values().for_each(|b| image.extend_from_slice(b));
    seal_frame(&mut image[HEADER_LEN..]).unwrap();
    let compacted = replay::<Rec>(&image).expect("a compacted image replays");
    assert_eq!(compacted.values, r.values);
    assert!(!compacted.upgraded);
    // Then appends (to the cut log, or to the compacted one after an upgrade: nothing is
    // appended in the new format to a log in the old one): the next batch is read back.
    let (frame, _) = encode_batch(vec![Change::Put("appended".into(), rec(99))]).unwrap();
    let base = if r.upgraded { &image[..] } else { cut };
    let appended = replay::<Rec>(&[base, &frame].concat())
        .unwrap_or_else(|(at, why)| panic!("an appended batch does not replay: {at}: {why}"));
    let mut expected = r.values;
    expected.insert("appended".into(), rec(99));
    assert_eq!(appended.values, expected);
}

/// A real log after damage: what replay answers was written (see the module docs).
fn check_damaged(old: bool, log: &[u8], spliced: bool) {
    check_any(log);
    let Ok(r) = replay::<Rec>(log) else { return };
    let written = Written::new(old);
    for (key, value) in &r.values {
        assert!(
            written.puts.iter().any(|(k, v)| k == key && v == value),
            "replay of a damaged log answered {key:?} = {value:?}, which was never written"
        );
    }
    if !spliced {
        assert!(written.states.contains(&r.values), "not the state after any prefix of batches");
    }
}

fn rec(seq: u64) -> Rec {
    Rec { seq, note: format!("note-{seq}") }
}

/// A real log: batches committed through the writer's own encoding, with what they wrote.
struct Written {
    log: Vec<u8>,
    /// Every `(key, record)` put, as replay answers it (upgraded, for an old log).
    puts: Vec<(String, Rec)>,
    /// The state after each prefix of the batches, the empty one first.
    states: Vec<State>,
}

impl Written {
    /// A log in the current version, or (`old`) one in the version before, which replay upgrades.
    fn new(old: bool) -> Written {
        use Change::{Delete, Put};
        let p = |k: &str, seq| Put(k.to_string(), rec(seq));
        let batches = vec![
            vec![p("a", 1), p("b", 2), p("c", 3)],
            vec![Delete("b".into()), p("a", 4)],
            vec![p("", 5), p("ключ", 6)],
            vec![Delete("missing".into())],
            vec![p("b", 7), Delete("c".into()), p("d", 300)],
            vec![Put("c".into(), Rec { seq: 9, note: "x".repeat(200) })],
        ];
        let mut w = Written { log: vec![], puts: vec![], states: vec![State::new()] };
        w.log = header(if old { OldRec::VERSION } else { Rec::VERSION }).to_vec();
        for batch in batches {
            let mut state = w.states.last().expect("the empty state").clone();
            let mut old_batch = vec![];
            for change in &batch {
                match change {
                    Put(key, value) => {
                        let value = if old {
                            Rec::upgrade(OldRec { seq: value.seq })
                        } else {
                            value.clone()
                        };
                        old_batch.push(Put(key.clone(), OldRec { seq: value.seq }));
                        w.puts.push((key.clone(), value.clone()));
                        state.insert(key.clone(), value);
                    }
                    Delete(key) => {
                        old_batch.push(Delete(key.clone()));
                        state.remove(key);
                    }
                }
            }
            let frame = if old { encode_batch(old_batch) } else { encode_batch(batch) };
            w.log.extend_from_slice(&frame.expect("encodes").0);
            w.states.push(state);
        }
        w
    }
}

/// Damages `log` with up to `max_ops` edits drawn from `next`: a bit flipped, a byte inserted or
/// dropped, a `u32` overwritten (lengths are `u32`s), the end cut off, a range copied in or cut
/// out. Says whether a range was moved (a copied or dropped whole frame replays cleanly).
pub(super) fn mutate(log: &[u8], max_ops: u64, next: &mut impl FnMut() -> u64) -> (Vec<u8>, bool) {
    let mut data = log.to_vec();
    let mut spliced = false;
    for _ in 0..1 + next() % max_ops {
        let len = data.len();
        let at = next() as usize % (len + 1);
        let to = (at + 1 + next() as usize % 64).min(len);
        match next() % 8 {
            0 | 1 if at < len => data[at] ^= 1 << (next() % 8),
            2 => data.insert(at, next() as u8),
            3 if at < len => drop(data.remove(at)),
            4 if at + 4 <= len => {
                let n = if next() & 1 == 0 { next() % 300 } else { next() << 8 | next() };
                data[at..at + 4].copy_from_slice(&(n as u32).to_le_bytes());
            }
            5 => data.truncate(at),
            6 if at < to => {
                let piece = data[at..to].to_vec();
                let into = next() as usize % (len + 1);
                data.splice(into..into, piece);
                spliced = true;
            }
            7 if at < to => {
                data.drain(at..to);
                spliced = true;
            }
            _ => {}
        }
    }
    (data, spliced)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fuzz target's properties over a seeded quick pass: 20 000 damaged logs (both
    /// versions) and as many arbitrary ones made by damaging them harder.
    #[test]
    fn replay_of_damaged_logs_answers_only_written_records() {
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let logs = [Written::new(false).log, Written::new(true).log];
        let (mut answered, mut refused) = (0, 0);
        for case in 0..20_000 {
            let old = case % 2 == 1;
            let (log, spliced) = mutate(&logs[case % 2], 4, &mut next);
            check_damaged(old, &log, spliced);
            match replay::<Rec>(&log) {
                Ok(_) => answered += 1,
                Err(_) => refused += 1,
            }
            let (garbage, _) = mutate(&log, 32, &mut next);
            check_any(&garbage);
        }
        // Both outcomes are exercised, not just one.
        assert!(answered > 1000 && refused > 1000, "{answered} answered, {refused} refused");
    }

    #[test]
    fn the_real_logs_replay_to_their_last_state() {
        for old in [false, true] {
            let w = Written::new(old);
            let r = replay::<Rec>(&w.log).unwrap();
            assert_eq!(&r.values, w.states.last().unwrap());
            assert_eq!(r.upgraded, old);
            check(&[[u8::from(old) * 2 + 1].as_slice(), &[0; 8]].concat());
        }
    }
}
