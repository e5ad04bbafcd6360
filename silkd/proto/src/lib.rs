//! silk-proto: the one protocol between clients and silkd, carried unchanged through the node's
//! relay.
//!
//! # Primer
//! - **Framing**: `u32` little-endian body length, then the postcard encoding of a [`Frame`].
//!   A body may not exceed [`MAX_FRAME`]; bulk bytes travel raw in `Stdin`/`Stdout`/`Stderr`/
//!   `Data` frames and are decoded as slices of the read buffer (no second copy).
//! - **Calls**: the client sends one request frame; the agent answers with zero or more reply or
//!   stream frames and exactly one terminal frame: `Exit`, `Done` or `Error`. Calls that take an
//!   input stream (`Exec` with stdin, `Write`, `Push`, `PtyOpen`, `PortForward`) read
//!   `Stdin`/`Data` frames from the client until `Eof`; streaming calls (`Attach`, `Find`,
//!   `Watch`) stop at the client's `Cancel`. `PortForward` also sends `Eof` to the client when
//!   the far side's stream ends (half-close). A connection carries one call at a time, back to
//!   back; many connections run concurrently. The client may send `Hello` first to learn the
//!   version and capabilities.
//! - **Closing**: the client closes the connection when done. Closing during a call cancels it:
//!   the agent kills the call's foreground process and discards partial writes. Input-stream
//!   frames that arrive after their call ended (a race with the process exiting) are ignored.
//! - **Errors**: `Error{kind, message}` with a closed [`ErrorKind`] set. A frame that does not
//!   decode is answered with `BadRequest` and the connection stays usable; an oversize length
//!   prefix breaks the framing, so the agent answers and closes.

mod codec;
mod conn;
mod error;
mod frame;
pub mod sniff;
#[cfg(feature = "tar")]
pub mod tarstream;

pub use codec::{Front, decode, encode, front};
pub use conn::{Connection, FrameReader, FrameWriter};
pub use error::{ErrorKind, ProtoError};
pub use frame::*;
pub use sniff::Sniffer;

/// The protocol version spoken by this crate. Bumped on any incompatible change.
pub const PROTOCOL_VERSION: u32 = 1;

/// Largest frame body accepted or produced, in bytes.
pub const MAX_FRAME: usize = 4 << 20;

/// Payload size senders use for byte-stream frames: big enough to amortise per-frame costs,
/// small enough to interleave stdout and stderr and to keep memory per connection bounded.
pub const DATA_CHUNK: usize = 256 * 1024;
