//! The little of DNS the resolver needs: read a query's question, answer it `REFUSED` or
//! empty, and read the IPv4 addresses (and their TTLs) out of an upstream answer. Everything
//! here reads bytes a sandbox or an upstream server wrote: every offset is checked, no pointer
//! is followed (names are only skipped), and anything malformed is `None`.

use std::net::Ipv4Addr;

use crate::policy::normalise;

const HEADER: usize = 12;
pub const TYPE_A: u16 = 1;
pub const TYPE_AAAA: u16 = 28;
const CLASS_IN: u16 = 1;
pub const RCODE_SERVFAIL: u8 = 2;
pub const RCODE_NXDOMAIN: u8 = 3;
pub const RCODE_REFUSED: u8 = 5;

/// A query's question.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Query {
    pub id: u16,
    /// Normalised (lower case, no trailing dot).
    pub name: String,
    pub qtype: u16,
    /// Where the question section ends.
    end: usize,
}

fn u16_at(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_be_bytes([*b.get(at)?, *b.get(at + 1)?]))
}

/// A standard query (opcode 0) with one question whose name has no compression pointer.
pub fn parse_query(b: &[u8]) -> Option<Query> {
    let flags = u16_at(b, 2)?;
    let is_response = flags & 0x8000 != 0;
    let opcode = (flags >> 11) & 0xf;
    if is_response || opcode != 0 || u16_at(b, 4)? != 1 {
        return None;
    }
    let mut at = HEADER;
    let mut name = String::new();
    loop {
        let len = usize::from(*b.get(at)?);
        at += 1;
        match len {
            0 => break,
            1..=63 => {
                let label = b.get(at..at + len)?;
                if !name.is_empty() {
                    name.push('.');
                }
                name.push_str(std::str::from_utf8(label).ok()?);
                at += len;
            }
            _ => return None,
        }
    }
    let qtype = u16_at(b, at)?;
    u16_at(b, at + 2)?;
    Some(Query { id: u16_at(b, 0)?, name: normalise(&name)?, qtype, end: at + 4 })
}

/// An answer to `query` (the bytes it came in, `raw`) with no records and `rcode`.
pub fn reply(raw: &[u8], query: &Query, rcode: u8) -> Vec<u8> {
    let mut out = raw[..query.end].to_vec();
    let recursion_desired = out[2] & 0x01;
    out[2] = 0x80 | recursion_desired; // a response, opcode 0, not authoritative
    out[3] = 0x80 | (rcode & 0x0f); // recursion available
    out[6..12].fill(0); // no answer, authority or additional records
    out
}

/// Skips a name (labels, ending in a zero or a pointer); where the next field starts.
fn skip_name(b: &[u8], mut at: usize) -> Option<usize> {
    loop {
        let len = *b.get(at)?;
        match len {
            0 => return Some(at + 1),
            l if l & 0xc0 == 0xc0 => return b.get(at + 1).map(|_| at + 2),
            l if l <= 63 => at += 1 + usize::from(l),
            _ => return None,
        }
    }
}

/// The IPv4 addresses an upstream answer to query `id` carries (class IN, type A records of
/// its answer section, whatever name: a CNAME chain's last name holds them), with their TTLs
/// in seconds. `None`: not an answer to it.
pub fn addresses(b: &[u8], id: u16) -> Option<Vec<(Ipv4Addr, u32)>> {
    if u16_at(b, 0)? != id || u16_at(b, 2)? & 0x8000 == 0 {
        return None;
    }
    let (questions, answers) = (u16_at(b, 4)?, u16_at(b, 6)?);
    let mut at = HEADER;
    for _ in 0..questions {
        at = skip_name(b, at)? + 4;
    }
    let mut out = vec![];
    for _ in 0..answers {
        at = skip_name(b, at)?;
        let (rtype, class) = (u16_at(b, at)?, u16_at(b, at + 2)?);
        let ttl = u32::from_be_bytes(b.get(at + 4..at + 8)?.try_into().ok()?);
        let len = usize::from(u16_at(b, at + 8)?);
        let data = b.get(at + 10..at + 10 + len)?;
        if rtype == TYPE_A && class == CLASS_IN && len == 4 {
            out.push((Ipv4Addr::new(data[0], data[1], data[2], data[3]), ttl));
        }
        at += 10 + len;
    }
    Some(out)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A query for `name` of `qtype`, id 0x1234, recursion desired.
    pub(crate) fn query(name: &str, qtype: u16) -> Vec<u8> {
        let mut q = vec![0x12, 0x34, 0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0];
        for label in name.split('.') {
            q.push(label.len() as u8);
            q.extend_from_slice(label.as_bytes());
        }
        q.extend_from_slice(&[0, (qtype >> 8) as u8, qtype as u8, 0, 1]);
        q
    }

    /// An upstream's answer to `q`: a CNAME then A records (names as pointers to the question).
    pub(crate) fn answer(q: &[u8], addrs: &[([u8; 4], u32)]) -> Vec<u8> {
        let mut a = q.to_vec();
        a[2] |= 0x80;
        a[3] = 0x80;
        a[7] = 1 + addrs.len() as u8;
        // CNAME of the question's name, to "x" + the same name (a pointer into the question).
        a.extend_from_slice(&[0xc0, 12, 0, 5, 0, 1, 0, 0, 0, 60, 0, 4, 1, b'x', 0xc0, 12]);
        let cname_at = (a.len() - 4) as u8;
        for (ip, ttl) in addrs {
            a.extend_from_slice(&[0xc0, cname_at, 0, 1, 0, 1]);
            a.extend_from_slice(&ttl.to_be_bytes());
            a.extend_from_slice(&[0, 4]);
            a.extend_from_slice(ip);
        }
        a
    }

    #[test]
    fn a_query_is_read_and_refused() {
        let raw = query("PyPI.org", TYPE_A);
        let q = parse_query(&raw).unwrap();
        assert_eq!((q.id, q.name.as_str(), q.qtype), (0x1234, "pypi.org", TYPE_A));
        let r = reply(&raw, &q, RCODE_REFUSED);
        assert_eq!(&r[..4], &[0x12, 0x34, 0x81, 0x85]);
        assert_eq!(&r[4..12], &[0, 1, 0, 0, 0, 0, 0, 0]);
        assert_eq!(&r[12..], &raw[12..]);
    }

    #[test]
    fn addresses_come_out_of_an_answer_through_a_cname() {
        let raw = query("files.pythonhosted.org", TYPE_A);
        let a = answer(&raw, &[([198, 51, 100, 10], 300), ([198, 51, 100, 11], 20)]);
        let got = addresses(&a, 0x1234).unwrap();
        assert_eq!(
            got,
            [("198.51.100.10".parse().unwrap(), 300), ("198.51.100.11".parse().unwrap(), 20)]
        );
        assert_eq!(addresses(&a, 0x9999), None, "another query's answer");
        assert_eq!(addresses(&raw, 0x1234), None, "not an answer");
    }

    /// Queries and answers mutated (bytes flipped, inserted, dropped, counts rewritten), 20 000
    /// seeded cases: no panic, and whatever parses answers with its own question.
    #[test]
    fn mutated_packets_never_panic_or_misanswer() {
        let q = query("a.files.pythonhosted.org", TYPE_A);
        let seeds = [q.clone(), answer(&q, &[([198, 51, 100, 10], 300), ([1, 2, 3, 4], 0)])];
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for case in 0..20_000 {
            let mut data = seeds[case % seeds.len()].clone();
            for _ in 0..1 + next() % 4 {
                let at = (next() as usize) % (data.len() + 1);
                match next() % 4 {
                    0 if at < data.len() => data[at] ^= 1 << (next() % 8),
                    1 => data.insert(at, next() as u8),
                    2 if at < data.len() => drop(data.remove(at)),
                    _ if at + 2 <= data.len() => data[at..at + 2].copy_from_slice(&[0, 0xff]),
                    _ => {}
                }
            }
            if let Some(parsed) = parse_query(&data) {
                let r = reply(&data, &parsed, RCODE_NXDOMAIN);
                assert_eq!(&r[..2], &data[..2]);
                assert_eq!(r[2] & 0x80, 0x80);
                assert_eq!(parse_query(&r), None, "a reply is not a query");
                assert!(normalise(&parsed.name).as_deref() == Some(parsed.name.as_str()));
            }
            if let Some(found) = addresses(&data, u16_at(&data, 0).unwrap_or(0)) {
                assert!(found.len() <= usize::from(u16_at(&data, 6).unwrap()));
            }
        }
    }

    #[test]
    fn malformed_bytes_are_refused_not_misread() {
        let raw = query("pypi.org", TYPE_A);
        let a = answer(&raw, &[([1, 2, 3, 4], 5)]);
        for cut in 0..a.len() {
            // Cut short anywhere: nothing, or the records that were whole.
            if let Some(found) = addresses(&a[..cut], 0x1234) {
                assert!(found.is_empty() || cut == a.len());
            }
        }
        for cut in 0..raw.len() {
            assert_eq!(parse_query(&raw[..cut]), None);
        }
        let mut pointer = raw.clone();
        pointer[12] = 0xc0; // a compression pointer in a query
        assert_eq!(parse_query(&pointer), None);
        let mut two = raw.clone();
        two[5] = 2; // two questions
        assert_eq!(parse_query(&two), None);
        let mut bad = raw.clone();
        bad[13] = b' '; // not a name
        assert_eq!(parse_query(&bad), None);
    }
}
