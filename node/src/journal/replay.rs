//! Replay: reading a whole log back, telling a torn tail (truncated away) from damage inside
//! (refused), and the live records it leaves.

use super::*;

/// What replaying a log yields.
pub(super) struct Replay<T> {
    pub(super) values: BTreeMap<String, T>,
    /// The same records as the writer keeps them: each key's `(key, Some(value))` encoding.
    pub(super) encoded: BTreeMap<String, Vec<u8>>,
    /// Bytes up to the end of the last good frame; anything after it is a torn tail.
    pub(super) valid_len: usize,
    /// The log was in the previous format: its records were upgraded, and it must be rewritten.
    pub(super) upgraded: bool,
}

/// Replays a whole log: one in `T`'s format, or in the one before, upgraded. Errors carry the
/// byte offset and the reason.
pub(super) fn replay<T: Record>(buf: &[u8]) -> Result<Replay<T>, (usize, String)> {
    if buf.len() < HEADER_LEN || buf[..MAGIC_LEN] != MAGIC {
        return Err((0, "not a journal (bad magic)".into()));
    }
    let version = u32::from_le_bytes([buf[8], buf[9], buf[10], buf[11]]);
    if version == T::VERSION {
        return replay_as::<T>(buf);
    }
    let old = replay_past::<T::Previous>(version, buf)
        .map_err(|(at, why)| (at, format!("{why}; this build writes {}", T::VERSION)))?;
    let mut replay = Replay {
        values: BTreeMap::new(),
        encoded: BTreeMap::new(),
        valid_len: old.valid_len,
        upgraded: true,
    };
    for (key, value) in old.values {
        let value = T::upgrade(value);
        let bytes = postcard::to_allocvec(&(&key, Some(&value)))
            .map_err(|e| (0, format!("re-encoding {key} in version {}: {e}", T::VERSION)))?;
        replay.encoded.insert(key.clone(), bytes);
        replay.values.insert(key, value);
    }
    Ok(replay)
}

/// Replays a log in format `version` as `P`s: read as the format it is, then upgraded step by
/// step.
fn replay_past<P: Past>(version: u32, buf: &[u8]) -> Result<Replay<P>, (usize, String)> {
    if P::VERSION == 0 || version > P::VERSION {
        return Err((8, format!("format version {version} is not one this build reads")));
    }
    if version == P::VERSION {
        return replay_as::<P>(buf);
    }
    let before = replay_past::<P::Before>(version, buf)?;
    let values = before.values.into_iter().map(|(k, v)| (k, P::upgrade(v))).collect();
    Ok(Replay { values, encoded: BTreeMap::new(), valid_len: before.valid_len, upgraded: true })
}

/// Replays the frames of a log whose records are `T`s.
fn replay_as<T: DeserializeOwned>(buf: &[u8]) -> Result<Replay<T>, (usize, String)> {
    let mut replay =
        Replay { values: BTreeMap::new(), encoded: BTreeMap::new(), valid_len: 0, upgraded: false };
    let mut pos = HEADER_LEN;
    while pos < buf.len() {
        let payload = match frame_at(buf, pos) {
            Ok(payload) => payload,
            Err(bad) => {
                return match valid_frame_after(buf, pos) {
                    Scan::Nothing => {
                        replay.valid_len = pos;
                        Ok(replay)
                    }
                    Scan::Found(at) => {
                        Err((pos, format!("{bad}, yet a valid batch follows at byte {at}")))
                    }
                    Scan::GaveUp => Err((
                        pos,
                        format!("{bad}, and too much follows to tell a torn tail from damage"),
                    )),
                };
            }
        };
        apply(&mut replay, payload).map_err(|reason| {
            (pos, format!("batch with a good checksum does not decode: {reason}"))
        })?;
        pos += FRAME_HEADER + payload.len();
    }
    replay.valid_len = pos;
    Ok(replay)
}

/// The payload of the frame at `pos`, or why there is no good frame there.
pub(super) fn frame_at(buf: &[u8], pos: usize) -> Result<&[u8], &'static str> {
    let rest = &buf[pos..];
    if rest.len() < FRAME_HEADER {
        return Err("incomplete batch header");
    }
    let len = u32::from_le_bytes([rest[0], rest[1], rest[2], rest[3]]) as usize;
    if len == 0 {
        // Never written: even an empty batch has a one-byte payload.
        return Err("zero-length batch");
    }
    let Some(payload) = rest.get(FRAME_HEADER..FRAME_HEADER + len) else {
        return Err("batch runs past the end of the file");
    };
    if checksum(payload) != rest[4..FRAME_HEADER] {
        return Err("batch checksum mismatch");
    }
    Ok(payload)
}

pub(super) enum Scan {
    Nothing,
    Found(usize),
    GaveUp,
}

/// Looks for a good frame starting anywhere after the bad one at `bad`. An unfinished append
/// leaves only a prefix of frames, so after a torn frame there is nothing good; a good frame
/// there means acknowledged data lies beyond the damage.
pub(super) fn valid_frame_after(buf: &[u8], bad: usize) -> Scan {
    let mut budget = SCAN_BUDGET;
    for at in bad + 1..buf.len().saturating_sub(FRAME_HEADER) {
        let len = u32::from_le_bytes([buf[at], buf[at + 1], buf[at + 2], buf[at + 3]]) as usize;
        if len == 0 || len > buf.len() - at - FRAME_HEADER {
            continue;
        }
        let Some(left) = budget.checked_sub(len) else {
            return Scan::GaveUp;
        };
        budget = left;
        if frame_at(buf, at).is_ok() {
            return Scan::Found(at);
        }
    }
    Scan::Nothing
}

/// Applies one batch's payload to the replayed state.
pub(super) fn apply<T: DeserializeOwned>(
    replay: &mut Replay<T>,
    payload: &[u8],
) -> Result<(), String> {
    let (count, mut rest) =
        postcard::take_from_bytes::<usize>(payload).map_err(|e| e.to_string())?;
    for _ in 0..count {
        let (entry, after) =
            postcard::take_from_bytes::<(String, Option<T>)>(rest).map_err(|e| e.to_string())?;
        let bytes = &rest[..rest.len() - after.len()];
        rest = after;
        match entry {
            (key, Some(value)) => {
                replay.encoded.insert(key.clone(), bytes.to_vec());
                replay.values.insert(key, value);
            }
            (key, None) => {
                replay.encoded.remove(&key);
                replay.values.remove(&key);
            }
        }
    }
    if !rest.is_empty() {
        return Err(format!("{} trailing bytes", rest.len()));
    }
    Ok(())
}
