//! The values engines take and return. User input is parsed into these at the edge, so a
//! `SandboxId` or a `Size` past this point is always valid.

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::EngineError;

/// A sandbox id: 1–64 of `[a-z0-9_-]`, so it is safe in paths, cgroup names and hostnames.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct SandboxId(String);

impl SandboxId {
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl TryFrom<String> for SandboxId {
    type Error = EngineError;

    fn try_from(s: String) -> Result<Self, EngineError> {
        let ok = !s.is_empty()
            && s.len() <= 64
            && s.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
            && !s.starts_with('-');
        if ok {
            Ok(SandboxId(s))
        } else {
            Err(EngineError::BadRequest(format!("bad sandbox id {s:?}")))
        }
    }
}

impl std::str::FromStr for SandboxId {
    type Err = EngineError;

    fn from_str(s: &str) -> Result<Self, EngineError> {
        SandboxId::try_from(s.to_string())
    }
}

impl From<SandboxId> for String {
    fn from(id: SandboxId) -> String {
        id.0
    }
}

impl std::fmt::Display for SandboxId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// A blake3 content digest: exactly 64 lowercase hex digits. Digests arrive from the shared
/// store and from peers and become directory names (`goldens/<short>`), so they are parsed like
/// [`SandboxId`]: one that is not 64 hex digits never gets this far. Serialized as the plain
/// string, so journals and JSON written before the check read the same.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Digest(String);

impl Digest {
    pub fn of(hasher: &blake3::Hasher) -> Digest {
        Digest(hasher.finalize().to_hex().to_string())
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The first 16 hex digits, for directory names and logs.
    pub fn short(&self) -> &str {
        &self.0[..16]
    }
}

impl TryFrom<String> for Digest {
    type Error = EngineError;

    fn try_from(s: String) -> Result<Self, EngineError> {
        if s.len() == 64 && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) {
            Ok(Digest(s))
        } else {
            Err(EngineError::BadRequest(format!("bad digest {s:?}: not 64 lowercase hex digits")))
        }
    }
}

impl std::str::FromStr for Digest {
    type Err = EngineError;

    fn from_str(s: &str) -> Result<Self, EngineError> {
        Digest::try_from(s.to_string())
    }
}

impl From<Digest> for String {
    fn from(d: Digest) -> String {
        d.0
    }
}

impl std::fmt::Display for Digest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// Size tiers and network lanes are the API's (`none`: a network namespace with only loopback).
pub use silk_api::{Lane, Memory, Size};

/// Where [`Engine::write_snapshot`](crate::Engine::write_snapshot) writes: any writer, and one
/// that can take bytes the engine already holds (a mapped memory image, hundreds of MiB) without
/// copying them says so in [`SnapshotSink::share`].
pub trait SnapshotSink: std::io::Write {
    /// Writes `bytes` next. The default copies them (`write_all`).
    fn share(&mut self, bytes: bytes::Bytes) -> std::io::Result<()> {
        self.write_all(&bytes)
    }

    /// Whether every reader of these bytes will have them vouched for
    /// ([`Snapshot::vouched`](crate::Snapshot::vouched): a store that signs its manifests).
    /// Memory images are then written without a MAC of their own, which only such a reader
    /// restores. The default: no.
    fn vouched(&self) -> bool {
        false
    }
}

impl SnapshotSink for Vec<u8> {}
impl SnapshotSink for std::fs::File {}
impl SnapshotSink for std::io::PipeWriter {}
impl SnapshotSink for std::io::Sink {}

impl<S: SnapshotSink + ?Sized> SnapshotSink for &mut S {
    fn share(&mut self, bytes: bytes::Bytes) -> std::io::Result<()> {
        (**self).share(bytes)
    }

    fn vouched(&self) -> bool {
        (**self).vouched()
    }
}

impl<S: SnapshotSink + ?Sized> SnapshotSink for std::io::BufWriter<S> {
    fn share(&mut self, bytes: bytes::Bytes) -> std::io::Result<()> {
        // What is buffered comes first.
        std::io::Write::flush(self)?;
        self.get_mut().share(bytes)
    }

    fn vouched(&self) -> bool {
        self.get_ref().vouched()
    }
}

/// What [`Engine::write_snapshot`](crate::Engine::write_snapshot) says of the bytes it wrote.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Streamed {
    /// Whether the sandbox's memory went along, and if not, why.
    pub memory: MemoryKept,
    /// How long a running sandbox was frozen for the capture.
    pub freeze_ms: Option<u64>,
    /// The bytes of the copy kept on this host, when one was (`write_snapshot`'s `keep`).
    pub kept: Option<u64>,
}

/// Whether an operation carried a sandbox's process memory, and if not, why.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryKept {
    pub kept: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub why_not: Option<String>,
}

impl MemoryKept {
    pub fn yes() -> MemoryKept {
        MemoryKept { kept: true, why_not: None }
    }

    pub fn no(why: impl Into<String>) -> MemoryKept {
        MemoryKept { kept: false, why_not: Some(why.into()) }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Limits {
    /// CPU quota in thousandths of a core.
    pub cpu_millis: u32,
    pub memory_bytes: u64,
    pub pids: u32,
}

impl Limits {
    /// A size tier's limits: cpu as a quota of cores, memory, and a process limit.
    pub fn of(size: Size) -> Limits {
        match size {
            Size::Small => Limits { cpu_millis: 1000, memory_bytes: 512 << 20, pids: 512 },
            Size::Medium => Limits { cpu_millis: 2000, memory_bytes: 1 << 30, pids: 1024 },
            Size::Large => Limits { cpu_millis: 4000, memory_bytes: 4 << 30, pids: 4096 },
        }
    }
}

/// How a sandbox is shaped.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BoxSpec {
    pub size: Size,
    pub lane: Lane,
    /// Overrides the size tier's limits (tests use this to make limits small).
    pub limits: Option<Limits>,
}

impl BoxSpec {
    pub fn new(size: Size, lane: Lane) -> BoxSpec {
        BoxSpec { size, lane, limits: None }
    }

    pub fn limits(&self) -> Limits {
        self.limits.unwrap_or_else(|| Limits::of(self.size))
    }
}

/// An immutable template, ready to be the bottom layer of sandboxes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Template {
    pub name: String,
    pub digest: Digest,
    /// The root filesystem directory (for `host`, a small skeleton the host's dirs bind into).
    pub root: PathBuf,
    /// Host directories bound read-only into the sandbox: (host path, path inside).
    pub binds: Vec<(PathBuf, PathBuf)>,
    /// Image config kept from OCI images: environment, working directory, user.
    pub env: Vec<(String, String)>,
    pub cwd: Option<String>,
    pub user: Option<String>,
}

/// What to run once in a fresh sandbox before freezing it as the golden.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Warmup {
    pub argv: Vec<String>,
    pub timeout: Duration,
    /// Keep the processes the warmup leaves running: the golden holds their memory and clones
    /// continue them (where the engine keeps memory; otherwise the golden is files only).
    #[serde(default)]
    pub memory: bool,
}

/// A template plus its warmup result, frozen.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Golden {
    pub digest: Digest,
    pub template: Template,
    /// The read-only layer holding what the warmup changed.
    pub layer: PathBuf,
}

/// The layers a sandbox runs on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Base {
    pub template: Template,
    pub golden: Option<Golden>,
}

/// Where a sandbox's silkd listens.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum AgentAddr {
    Unix(PathBuf),
    /// An abstract unix socket `name` in the network namespace of the process `pid` (the
    /// jail's init, told from a reused pid by its start time): see [`crate::agent`].
    Netns {
        pid: u32,
        start_time: u64,
        name: String,
    },
    Vsock {
        cid: u32,
        port: u32,
    },
}

/// A sandbox as the engine knows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BoxInfo {
    pub id: SandboxId,
    pub base: Base,
    pub spec: BoxSpec,
    pub agent: AgentAddr,
    /// The host pid of the sandbox's init (silkd), while it runs.
    pub pid: Option<u32>,
    pub running: bool,
    pub created_ms: u64,
    /// For the start that made it running: whether its processes came back from memory.
    #[serde(default)]
    pub memory: MemoryKept,
    /// Its address in the egress lane (lane `egress` only; it keeps it while it hibernates).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub address: Option<std::net::Ipv4Addr>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum SnapshotMode {
    /// Pause, capture, resume.
    KeepRunning,
    /// Pause, capture, destroy the sandbox.
    Stop,
}

/// A captured sandbox: its base, its spec, and its filesystem changes as an OCI-style layer tar
/// (whiteouts as `.wh.` entries), so any node with the same base can restore it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Snapshot {
    pub base: Base,
    pub spec: BoxSpec,
    pub layer_tar: PathBuf,
    pub bytes: u64,
    /// Process memory was captured (into the layer tar; see the jail engine's `memory`).
    pub memory: bool,
    /// Why it was not, when it was not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_why_not: Option<String>,
    /// How long a running sandbox was frozen for it (`KeepRunning` only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub freeze_ms: Option<u64>,
    /// For `read_snapshot`: the caller vouches that the stream is what a node of this fleet
    /// wrote (the node: a manifest signed with the fleet's key, every chunk checked against
    /// its id), so its memory images' own MAC is not checked again. Never kept.
    #[serde(skip)]
    pub vouched: bool,
}

impl Snapshot {
    /// Whether its memory came along, and if not, why.
    pub fn memory_kept(&self) -> MemoryKept {
        MemoryKept { kept: self.memory, why_not: self.memory_why_not.clone() }
    }
}

/// What an engine can do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Caps {
    /// Snapshots keep process memory; a restore resumes processes.
    pub memory_snapshot: bool,
    /// Lanes other than `none`.
    pub egress: bool,
    /// Disk use of a sandbox is bounded.
    pub disk_limit: bool,
    /// How (`none` when it is not).
    pub disk_mechanism: DiskMechanism,
}

/// How an engine bounds a sandbox's disk use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DiskMechanism {
    /// Not bounded.
    None,
    /// A btrfs subvolume per sandbox with a qgroup limit on what it refers to.
    BtrfsQgroup,
    /// A fixed-size ext4 filesystem in a sparse image file per sandbox, loop-mounted.
    Ext4Image,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sandbox_ids_are_path_and_hostname_safe() {
        for good in ["a", "sb-1", "x_y", &"a".repeat(64)] {
            assert!(good.parse::<SandboxId>().is_ok(), "{good}");
        }
        for bad in ["", "A", "a/b", "..", "-a", "a b", &"a".repeat(65), "é"] {
            assert!(bad.parse::<SandboxId>().is_err(), "{bad}");
        }
    }

    #[test]
    fn digests_are_64_lowercase_hex() {
        let of = Digest::of(&blake3::Hasher::new());
        assert_eq!(of.as_str().parse::<Digest>().unwrap(), of);
        assert_eq!(of.short(), &of.as_str()[..16]);
        let good = "0123456789abcdef".repeat(4);
        assert!(good.parse::<Digest>().is_ok());
        // Each of these would become a directory name under goldens/ (or panic in `short`).
        for bad in [
            String::new(),
            "ab".into(),
            "0123456789ABCDEF".repeat(4),
            "a".repeat(63),
            "a".repeat(65),
            format!("../../{}", "a".repeat(58)),
            format!("{}/", "a".repeat(63)),
            format!("{}g", "a".repeat(63)),
        ] {
            assert!(bad.parse::<Digest>().is_err(), "{bad}");
            let json = serde_json::to_string(&bad).unwrap();
            assert!(serde_json::from_str::<Digest>(&json).is_err(), "{bad} through serde");
        }
        // The wire form is the bare string, as the old newtype wrote it.
        assert_eq!(serde_json::to_string(&of).unwrap(), format!("\"{}\"", of.as_str()));
        let back: Digest = serde_json::from_str(&format!("\"{}\"", of.as_str())).unwrap();
        assert_eq!(back, of);
    }
}
