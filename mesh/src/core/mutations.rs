//! Membership packets under mutation: the property of the fuzz target `gossip` (`mesh/fuzz`),
//! and its seeded quick pass. A member of a three-node cluster takes packets of every kind the
//! protocol has (made by foca's own codec) damaged, or arbitrary bytes: it must not panic, a
//! header it reads must encode back to itself, it must never list itself as a peer nor take a
//! new state for itself, and every packet it sends must still fit a datagram.

use super::*;
use bytes::BufMut;
use foca::{Codec, Header, Member, Message, State};

fn id(i: u8) -> NodeId {
    NodeId {
        name: format!("n{i}"),
        addr: SocketAddr::from(([10, 0, 0, i + 1], 7946)),
        epoch: 1,
        renewal: 0,
    }
}

fn member(i: u8) -> Membership {
    let swim = swim_config(
        Duration::from_millis(500),
        Duration::from_millis(150),
        Duration::from_millis(1500),
    );
    let state =
        NodeState { name: format!("n{i}"), api: format!("http://n{i}"), ..Default::default() };
    Membership::new(id(i), swim, u64::from(i), state, Duration::from_secs(30))
}

/// Three members that have found each other, delivering packets at once and firing every
/// timer but those that would declare a member down.
pub fn cluster() -> Vec<Membership> {
    let mut nodes: Vec<Membership> = (0..3).map(member).collect();
    nodes[1].join(id(0).addr);
    nodes[2].join(id(0).addr);
    for _ in 0..20 {
        if nodes.iter().all(|n| n.peers().count() == 2) {
            break;
        }
        for i in 0..nodes.len() {
            for out in nodes[i].drain() {
                match out {
                    Output::Packet(to, data) => {
                        if let Some(n) = nodes.iter_mut().find(|n| n.id().addr == to.addr) {
                            n.handle_packet(&data);
                        }
                    }
                    Output::Timer(_, Timer::ChangeSuspectToDown { .. } | Timer::RemoveDown(_)) => {}
                    Output::Timer(_, timer) => nodes[i].handle_timer(timer),
                    _ => {}
                }
            }
        }
    }
    assert!(nodes.iter().all(|n| n.peers().count() == 2), "the cluster formed");
    nodes
}

/// A packet from member `src` to member 0 of each kind of message, with cluster updates.
pub fn packets() -> Vec<Vec<u8>> {
    let messages = [
        Message::Ping(7),
        Message::Ack(7),
        Message::PingReq { target: id(2), probe_number: 3 },
        Message::IndirectPing { origin: id(2), probe_number: 3 },
        Message::IndirectAck { target: id(2), probe_number: 3 },
        Message::ForwardedAck { origin: id(2), probe_number: 3 },
        Message::Announce,
        Message::Feed,
        Message::Gossip,
        Message::Broadcast,
        Message::TurnUndead,
    ];
    let updates = [
        Member::new(id(2), 1, State::Alive),
        Member::new(id(0), 0, State::Suspect),
        Member::new(id(3), 0, State::Down),
    ];
    let mut out = vec![];
    for (k, message) in messages.into_iter().enumerate() {
        let n = if matches!(message, Message::Announce | Message::Broadcast) { 0 } else { k % 4 };
        let header = Header { src: id(1 + k as u8 % 2), src_incarnation: 0, dst: id(0), message };
        let mut buf = bytes::BytesMut::new();
        PostcardCodec.encode_header(&header, &mut buf).expect("a header encodes");
        if n > 0 {
            buf.put_u16(n as u16);
            for m in &updates[..n.min(3)] {
                PostcardCodec.encode_member(m, &mut buf).expect("a member encodes");
            }
        }
        out.push(buf.to_vec());
    }
    out
}

/// Member 0 of `nodes` takes `data`; checks what it makes of it.
pub fn check_packet(nodes: &mut [Membership], data: &[u8]) {
    if let Ok(header) = PostcardCodec.decode_header(data) {
        let mut again = bytes::BytesMut::new();
        PostcardCodec.encode_header(&header, &mut again).expect("a decoded header encodes");
        assert_eq!(PostcardCodec.decode_header(&again[..]).ok(), Some(header.clone()));
        assert_eq!(Membership::sender(data), Some(header.src));
    }
    let me = nodes[0].me().clone();
    nodes[0].handle_packet(data);
    for out in nodes[0].drain() {
        if let Output::Packet(_, packet) = out {
            assert!(packet.len() <= 1100, "a {} byte packet does not fit", packet.len());
        }
    }
    assert_eq!(nodes[0].me(), &me);
    let names: BTreeSet<&str> = nodes[0].peers().map(|p| p.id.name.as_str()).collect();
    assert_eq!(names.len(), nodes[0].peers().count(), "one peer per name");
    assert!(!names.contains(me.name.as_str()), "itself as a peer");
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Found by the seeded pass: a member can gossip an identity with this node's name at
    /// another member's address. foca takes it for that member renewed (`Rename`), and the
    /// view made it a peer under this node's own name, dropping the real member. The
    /// driver checks a packet's sender against its certificate, not the members it
    /// gossips, so any member could do this; now the renamed one just goes.
    #[test]
    fn a_member_gossiped_under_our_own_name_is_never_a_peer() {
        let mut nodes = cluster();
        let impostor = NodeId { name: "n0".into(), addr: id(1).addr, epoch: 2, renewal: 0 };
        let header =
            Header { src: id(2), src_incarnation: 0, dst: id(0), message: Message::Gossip };
        let mut buf = bytes::BytesMut::new();
        PostcardCodec.encode_header(&header, &mut buf).unwrap();
        buf.put_u16(1);
        PostcardCodec.encode_member(&Member::new(impostor, 0, State::Alive), &mut buf).unwrap();
        check_packet(&mut nodes, &buf);
        assert!(nodes[0].peers().all(|p| p.id.name != "n0"));
    }

    /// 20 000 packets of every kind, damaged (bits flipped, bytes inserted or dropped,
    /// cut short, a piece of another packet spliced in), into one long-lived member.
    #[test]
    fn mutated_packets_keep_the_membership_sane() {
        let seeds = packets();
        let mut nodes = cluster();
        for seed in &seeds {
            check_packet(&mut nodes, seed);
        }
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for case in 0..20_000 {
            if case % 2_000 == 0 {
                nodes = cluster();
            }
            let mut data = seeds[case % seeds.len()].clone();
            for _ in 0..1 + next() % 3 {
                let at = (next() as usize) % (data.len() + 1);
                match next() % 5 {
                    0 if at < data.len() => data[at] ^= 1 << (next() % 8),
                    1 => data.insert(at, next() as u8),
                    2 if at < data.len() => drop(data.remove(at)),
                    3 => {
                        let other = &seeds[next() as usize % seeds.len()];
                        let from = next() as usize % other.len();
                        let to = (from + 1 + next() as usize % 32).min(other.len());
                        data.splice(at..at, other[from..to].iter().copied());
                    }
                    _ => data.truncate(at),
                }
            }
            check_packet(&mut nodes, &data);
        }
    }
}
