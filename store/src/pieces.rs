//! A snapshot stream as the pieces its writer hands over ([`Pieces`]), and the chunks cut from
//! them with as few copies as the pieces allow ([`Chunks`]).
//!
//! A chunk that lies inside one piece is a slice of it, not a copy: a piece that is a mapped
//! memory image of hundreds of MiB is cut and hashed where it lies. Only a chunk that spans the
//! end of a piece is copied, into a buffer of at most the largest chunk.

use std::future::Future;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt};

use crate::chunk::Chunker;

/// A snapshot stream, piece by piece, in order.
pub trait Pieces: Send {
    /// The next piece, `None` at the stream's end. An empty piece is skipped, not an end.
    fn next_piece(&mut self) -> impl Future<Output = std::io::Result<Option<Bytes>>> + Send;
}

/// Any reader as pieces of `size` bytes (one copy, as any read makes).
pub(crate) struct ReadPieces<R> {
    reader: R,
    size: usize,
    /// Read into, and reused once every piece cut from it was dropped: a fresh buffer costs a
    /// page fault per 4 KiB written.
    buf: BytesMut,
}

impl<R: AsyncRead + Unpin + Send> ReadPieces<R> {
    pub(crate) fn new(reader: R, size: usize) -> ReadPieces<R> {
        ReadPieces { reader, size, buf: BytesMut::new() }
    }
}

impl<R: AsyncRead + Unpin + Send> Pieces for ReadPieces<R> {
    async fn next_piece(&mut self) -> std::io::Result<Option<Bytes>> {
        self.buf.reserve(self.size);
        while self.buf.len() < self.size {
            if self.reader.read_buf(&mut self.buf).await? == 0 {
                break;
            }
        }
        Ok((!self.buf.is_empty()).then(|| self.buf.split().freeze()))
    }
}

/// The chunks of a stream of pieces, cut by a [`Chunker`].
pub(crate) struct Chunks<P> {
    pieces: P,
    /// Bytes before `piece` not yet in a chunk: copied here because a chunk spans the end of
    /// the piece they came from. Never more than the largest chunk.
    carry: BytesMut,
    /// What is left of the current piece.
    piece: Bytes,
    /// The pieces ended.
    ended: bool,
}

impl<P: Pieces> Chunks<P> {
    pub(crate) fn new(pieces: P) -> Chunks<P> {
        Chunks { pieces, carry: BytesMut::new(), piece: Bytes::new(), ended: false }
    }

    /// The next chunk, `None` at the stream's end. The cut points are the chunker's over the
    /// stream as one buffer, however it was split into pieces.
    pub(crate) async fn next(&mut self, chunker: &Chunker) -> std::io::Result<Option<Bytes>> {
        let max = chunker.params().max as usize;
        loop {
            if self.carry.is_empty() {
                // Cut where the bytes lie when the piece holds all a cut may look at.
                if self.piece.len() >= max || (self.ended && !self.piece.is_empty()) {
                    let len = chunker.cut(&self.piece[..self.piece.len().min(max)]);
                    return Ok(Some(self.piece.split_to(len)));
                }
                if self.ended {
                    return Ok(None);
                }
                // The piece's rest is too short to cut from alone and more may follow.
                self.carry.extend_from_slice(&self.piece);
                self.piece = Bytes::new();
            }
            if self.piece.is_empty() && !self.ended {
                // No hold on the spent piece's buffer while the next is read (it may reuse it).
                self.piece = Bytes::new();
                match self.pieces.next_piece().await? {
                    Some(piece) => self.piece = piece,
                    None => self.ended = true,
                }
                continue;
            }
            // Up to `max` bytes in `carry`, the piece's first ones copied after it.
            let take = (max - self.carry.len()).min(self.piece.len());
            self.carry.extend_from_slice(&self.piece[..take]);
            if self.carry.len() < max && !self.ended {
                // All of the piece went into `carry` and still too few bytes to cut.
                self.piece = Bytes::new();
                continue;
            }
            let len = chunker.cut(&self.carry);
            // What follows the cut goes back to the piece where it came from it (uncopied);
            // only bytes of an earlier piece stay in `carry`.
            let rest = self.carry.len() - len;
            let back = take.min(rest);
            self.carry.truncate(self.carry.len() - back);
            let _ = self.piece.split_to(take - back);
            return Ok(Some(self.carry.split_to(len).freeze()));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chunk::ChunkParams;

    /// Pieces given from a list.
    struct Given(std::collections::VecDeque<Bytes>);

    impl Pieces for Given {
        async fn next_piece(&mut self) -> std::io::Result<Option<Bytes>> {
            Ok(self.0.pop_front())
        }
    }

    fn stream(len: usize, seed: u64) -> Vec<u8> {
        let mut x = seed;
        (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 24) as u8
            })
            .collect()
    }

    async fn chunks(pieces: Vec<Bytes>, chunker: &Chunker) -> Vec<Bytes> {
        let mut chunks = Chunks::new(Given(pieces.into()));
        let mut out = vec![];
        while let Some(chunk) = chunks.next(chunker).await.unwrap() {
            out.push(chunk);
        }
        out
    }

    fn split(bytes: &Bytes, sizes: &[usize]) -> Vec<Bytes> {
        let (mut at, mut out, mut k) = (0, vec![], 0);
        while at < bytes.len() {
            let n = sizes[k % sizes.len()].min(bytes.len() - at);
            out.push(bytes.slice(at..at + n));
            (at, k) = (at + n, k + 1);
        }
        out
    }

    #[tokio::test]
    async fn the_cuts_do_not_depend_on_how_the_stream_was_split() {
        let chunker = Chunker::new(ChunkParams { min: 16384, avg: 65536, max: 262144 }).unwrap();
        let bytes = Bytes::from(stream(3 << 20, 7));
        let whole = chunks(vec![bytes.clone()], &chunker).await;
        let lens: Vec<usize> = whole.iter().map(Bytes::len).collect();
        assert!(lens.len() > 10, "{lens:?}");
        assert_eq!(whole.concat(), bytes);
        // Pieces shorter and longer than a chunk, empty ones, odd sizes, one byte at a time.
        for sizes in
            [&[1usize][..], &[511, 0, 4096], &[262143], &[262144], &[262145, 3], &[1 << 20]]
        {
            let pieces = if sizes == [1] {
                split(&bytes.slice(..300_000), sizes)
            } else {
                split(&bytes, sizes)
            };
            let want = if sizes == [1] {
                chunks(vec![bytes.slice(..300_000)], &chunker).await
            } else {
                whole.clone()
            };
            assert_eq!(chunks(pieces, &chunker).await, want, "pieces of {sizes:?}");
        }
    }

    #[tokio::test]
    async fn a_chunk_inside_one_piece_is_not_copied() {
        let chunker = Chunker::new(ChunkParams { min: 16384, avg: 65536, max: 262144 }).unwrap();
        let big = Bytes::from(stream(2 << 20, 9));
        let small = Bytes::from(stream(1000, 3));
        let got = chunks(vec![small.clone(), big.clone(), small.clone()], &chunker).await;
        let inside = |c: &Bytes| {
            let (start, end) = (big.as_ptr() as usize, big.as_ptr() as usize + big.len());
            (start..end).contains(&(c.as_ptr() as usize))
        };
        // Only the bytes near the big piece's two ends are copied: at most the largest chunk
        // at each, with the small pieces'.
        let copied: usize = got.iter().filter(|c| !inside(c)).map(Bytes::len).sum();
        assert!(copied <= 2 * 262144 + 2 * small.len(), "{copied} bytes copied");
        assert!(got.iter().filter(|c| inside(c)).count() > 4);
        assert_eq!(got.concat(), [&small[..], &big[..], &small[..]].concat());
    }

    #[tokio::test]
    async fn an_empty_stream_has_no_chunks() {
        let chunker = Chunker::new(ChunkParams::default()).unwrap();
        assert!(chunks(vec![], &chunker).await.is_empty());
        assert!(chunks(vec![Bytes::new()], &chunker).await.is_empty());
    }

    #[tokio::test]
    async fn a_reader_gives_pieces_of_its_size_and_then_the_rest() {
        let bytes = stream(10_000, 5);
        let mut pieces = ReadPieces::new(&bytes[..], 4096);
        let mut got = vec![];
        while let Some(piece) = pieces.next_piece().await.unwrap() {
            got.push(piece.len());
        }
        assert_eq!(got, [4096, 4096, 1808]);
    }
}
