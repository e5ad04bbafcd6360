//! How a call ends when it does not end well. On its own (it needs only silk-proto) so the
//! fuzz targets, which compile single verbs' modules, use this very file.

use silk_proto::{ProtoError, WireError};

/// Why a call did not end with a success terminal frame.
#[derive(Debug)]
pub enum Fail {
    /// Answer with this error; the connection stays usable.
    Call(WireError),
    /// The connection is unusable.
    Conn(ProtoError),
}

impl From<WireError> for Fail {
    fn from(e: WireError) -> Self {
        Fail::Call(e)
    }
}

impl From<ProtoError> for Fail {
    fn from(e: ProtoError) -> Self {
        Fail::Conn(e)
    }
}

pub type CallResult = Result<(), Fail>;
