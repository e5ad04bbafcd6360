//! Frames on the mesh's call streams (QUIC streams, bulk-lane connections): the silk-proto
//! framing (a `u32` LE length, then a postcard body, at most 4 MiB) around the mesh's own
//! message types.

use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::MeshError;

pub const MAX_FRAME: usize = 4 << 20;

fn io(e: std::io::Error) -> MeshError {
    MeshError::Io(e.to_string())
}

/// Writes one frame; returns its size on the wire.
pub async fn write_frame<T: Serialize>(
    send: &mut (impl AsyncWrite + Unpin + ?Sized),
    msg: &T,
) -> Result<usize, MeshError> {
    let body = postcard::to_stdvec(msg).map_err(|e| MeshError::Codec(e.to_string()))?;
    if body.len() > MAX_FRAME {
        return Err(MeshError::Codec(format!("a {} byte frame exceeds {MAX_FRAME}", body.len())));
    }
    let mut frame = Vec::with_capacity(4 + body.len());
    frame.extend_from_slice(&(body.len() as u32).to_le_bytes());
    frame.extend_from_slice(&body);
    send.write_all(&frame).await.map_err(io)?;
    // A TLS stream holds what it was given until flushed (a QUIC stream sends it anyway).
    send.flush().await.map_err(io)?;
    Ok(frame.len())
}

/// Reads one frame; `None` when the stream ended cleanly before one began.
pub async fn read_frame<T: DeserializeOwned>(
    recv: &mut (impl AsyncRead + Unpin + ?Sized),
) -> Result<Option<T>, MeshError> {
    let mut len = [0u8; 4];
    let mut got = 0;
    while got < len.len() {
        match recv.read(&mut len[got..]).await.map_err(io)? {
            0 if got == 0 => return Ok(None),
            0 => return Err(MeshError::Io("the stream ended inside a frame".into())),
            n => got += n,
        }
    }
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_FRAME {
        return Err(MeshError::Codec(format!("a {len} byte frame exceeds {MAX_FRAME}")));
    }
    let mut body = vec![0; len];
    recv.read_exact(&mut body).await.map_err(io)?;
    postcard::from_bytes(&body).map(Some).map_err(|e| MeshError::Codec(e.to_string()))
}

/// Frames under mutation: the property of the fuzz target `frame` (`mesh/fuzz`) and its seeded
/// quick pass. `read_frame` reads a stream; [`mutations::read`] takes the same steps on
/// bytes (the length, the cap checked before the body is allocated, postcard), and
/// [`mutations::write`] those of `write_frame`.
#[cfg(any(test, fuzzing))]
pub mod mutations {
    use super::*;
    use crate::core::{Membership, NodeState, StateChange, StateMessage};

    /// `write_frame`'s bytes.
    pub fn write<T: Serialize>(msg: &T) -> Result<Vec<u8>, MeshError> {
        let body = postcard::to_stdvec(msg).map_err(|e| MeshError::Codec(e.to_string()))?;
        if body.len() > MAX_FRAME {
            return Err(MeshError::Codec(format!("a {} byte frame exceeds", body.len())));
        }
        Ok([&(body.len() as u32).to_le_bytes()[..], &body].concat())
    }

    /// `read_frame` on a stream holding `input`: consumes one frame.
    pub fn read<T: DeserializeOwned>(input: &mut &[u8]) -> Result<Option<T>, MeshError> {
        let eof = || MeshError::Io("finished early".into());
        if input.is_empty() {
            return Ok(None);
        }
        let Some((len, rest)) = input.split_first_chunk::<4>() else { return Err(eof()) };
        let len = u32::from_le_bytes(*len) as usize;
        if len > MAX_FRAME {
            return Err(MeshError::Codec(format!("a {len} byte frame exceeds {MAX_FRAME}")));
        }
        let mut body = vec![0; len];
        body.copy_from_slice(rest.get(..len).ok_or_else(eof)?);
        *input = &rest[len..];
        postcard::from_bytes(&body).map(Some).map_err(|e| MeshError::Codec(e.to_string()))
    }

    /// A stream of frames as the first byte says: state messages (what the driver reads from a
    /// peer's state stream) or `u64`s. Every frame read writes back to a frame that reads the
    /// same; a state holds no more than its bytes spelled out; and a member applies a message
    /// at most once (a newer version replaces, the same one is ignored), never one for itself;
    /// `nodes`: a cluster (`core::mutations::cluster`), whose first member takes the messages.
    pub fn check(data: &[u8], nodes: &mut [Membership]) {
        let Some((&which, mut input)) = data.split_first() else { return };
        loop {
            let before = input.len();
            if which & 1 == 0 {
                let Ok(Some(msg)) = read::<StateMessage>(&mut input) else { break };
                let again = write(&msg).expect("a read message writes");
                assert_eq!(read::<StateMessage>(&mut &again[..]).unwrap().as_ref(), Some(&msg));
                if let StateMessage::Full(state) = &msg {
                    let text = state.name.len()
                        + state.api.len()
                        + state.public.as_ref().map_or(0, String::len);
                    let lists: usize =
                        state.goldens.iter().chain(&state.templates).map(String::len).sum();
                    let maps: usize = [&state.warm, &state.tenants]
                        .iter()
                        .flat_map(|m| m.keys())
                        .map(String::len)
                        .sum();
                    assert!(text + lists + maps <= before - input.len(), "more read than sent");
                }
                let mine = msg.name() == nodes[0].me().name;
                let me = nodes[0].me().clone();
                let applied = nodes[0].apply_message(msg.clone());
                assert!(!(mine && applied), "took a state for itself");
                assert_eq!(nodes[0].me(), &me, "its own state changed");
                assert!(!nodes[0].apply_message(msg), "the same message applied twice");
            } else {
                let Ok(Some(n)) = read::<u64>(&mut input) else { break };
                assert_eq!(read::<u64>(&mut &write(&n).unwrap()[..]).unwrap(), Some(n));
            }
            assert!(input.len() < before, "a frame read takes its bytes");
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        /// 20 000 streams of real frames (states, numbers), damaged: bits flipped, bytes
        /// inserted or dropped, a length rewritten, cut short, a piece of another spliced in.
        #[test]
        fn mutated_frames_are_refused_or_read_back_whole() {
            let full = NodeState {
                name: "n1".into(),
                epoch: 3,
                seq: 9,
                api: "http://127.0.0.2:7777".into(),
                public: Some("https://n1.example.com".into()),
                warm: [("host/small/none".to_string(), 2)].into(),
                goldens: vec!["ab".repeat(32)],
                templates: vec!["debian-12".into()],
                claims: 4,
                capacity: 100,
                draining: true,
                tenants: [("team-a".to_string(), 3)].into(),
                tenant_seconds: [("team-a".to_string(), 7200)].into(),
            };
            let own = NodeState { name: "n0".into(), ..NodeState::default() };
            let next = NodeState { seq: 10, claims: 5, draining: false, ..full.clone() };
            let states = [
                write(&StateMessage::Full(full.clone())).unwrap(),
                write(&StateMessage::Change(StateChange::between(&full, &next))).unwrap(),
                write(&StateMessage::Full(own)).unwrap(),
                write(&StateMessage::Want { name: "n1".into() }).unwrap(),
            ]
            .concat();
            let numbers = [write(&41u64).unwrap(), write(&u64::MAX).unwrap()].concat();
            let seeds = [[&[0][..], &states].concat(), [&[1][..], &numbers].concat()];
            let mut nodes = crate::core::mutations::cluster();
            let mut state = 0x2545_f491_4f6c_dd1du64;
            let mut next = move || {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                state
            };
            let mut read_back = 0;
            for case in 0..20_000 {
                if case % 2_000 == 0 {
                    nodes = crate::core::mutations::cluster();
                }
                let mut data = seeds[case % seeds.len()].clone();
                for _ in 0..1 + next() % 3 {
                    let at = 1 + (next() as usize) % data.len();
                    match next() % 6 {
                        0 if at < data.len() => data[at] ^= 1 << (next() % 8),
                        1 => data.insert(at, next() as u8),
                        2 if at < data.len() => drop(data.remove(at)),
                        3 if at + 4 <= data.len() => data[at..at + 4]
                            .copy_from_slice(&(next() as u32 >> (next() % 32)).to_le_bytes()),
                        4 => {
                            let other = &seeds[next() as usize % seeds.len()];
                            let from = 1 + next() as usize % (other.len() - 1);
                            let to = (from + 1 + next() as usize % 32).min(other.len());
                            data.splice(at..at, other[from..to].iter().copied());
                        }
                        _ => data.truncate(at),
                    }
                }
                check(&data, &mut nodes);
                let mut input = &data[1..];
                if data[0] == 0 && matches!(read::<StateMessage>(&mut input), Ok(Some(_))) {
                    read_back += 1;
                }
            }
            assert!(read_back > 1_000, "only {read_back} states read: the round trip is idle");
        }

        #[test]
        fn a_length_past_the_cap_is_refused_before_any_body() {
            let mut input = &((MAX_FRAME + 1) as u32).to_le_bytes()[..];
            assert!(matches!(read::<u64>(&mut input), Err(MeshError::Codec(_))));
            let mut input = &(MAX_FRAME as u32).to_le_bytes()[..];
            assert!(matches!(read::<u64>(&mut input), Err(MeshError::Io(_))));
        }
    }
}
