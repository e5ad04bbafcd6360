//! Keeping a jail's processes across stop/start and in snapshots (docs/engine.md, "Memory").
//!
//! - **Hibernate** (`stop`) asks silkd to close its connections, then CRIU dumps the jail into
//!   `boxes/<id>/memory` and ends it; **wake** (`resume`) restores from there on the same files.
//! - **Snapshots** carry the images inside the layer tar, as its first entry, named
//!   `../silkmesh-memory` — a name no capture of a sandbox's files can produce (no path has a
//!   `..` component) and that `layer::apply` refuses — holding a flat tar of CRIU's image files
//!   followed by a keyed blake3 MAC of it (or zeros, [`UNSEALED`], for a sink whose readers a
//!   signing store vouches for). Snapshots travel through the shared store, which the
//!   engine does not trust: images whose MAC does not verify under this engine's key are never
//!   given to CRIU (running as root, it would do what they say). The files restore anyway.
//!
//! Every failure to keep memory leaves the files as they are and says why; the caller decides
//! (`Memory::Required`) whether that fails the operation.

use std::io::{Read, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::JailEngine;
use super::criu::Dump;
use crate::{EngineError, Result, SandboxId, probe};

/// The name of a snapshot's memory entry (see the module docs).
const ENTRY: &[u8] = b"../silkmesh-memory";
const MAC_LEN: usize = 32;
/// The MAC of memory images written for readers a signed store vouches for
/// ([`crate::SnapshotSink::vouched`]): no MAC. It verifies nothing, so any other reader refuses
/// the images, as it refuses any it cannot verify.
const UNSEALED: [u8; MAC_LEN] = [0; MAC_LEN];
/// The largest memory entry read back (a sandbox's memory is bounded far below it).
const MAX_ENTRY: u64 = 64 << 30;

/// Lane `egress` keeps files only: CRIU would have to recreate the jail's veth with the node's
/// end (it can only restore a veth given the other end), and its open connections are the
/// node proxy's, which a restore elsewhere or later cannot bring back.
fn no_egress(spec: &crate::BoxSpec) -> std::result::Result<(), String> {
    match spec.lane {
        crate::Lane::Egress => {
            Err("lane egress keeps files only (its network is the node's)".into())
        }
        crate::Lane::None => Ok(()),
    }
}

/// The key that authenticates memory images: given by the node (derived from its fleet's API
/// token, so every node of a fleet shares it), else one of this data directory's own.
pub(super) fn memory_key(data_dir: &Path, given: Option<[u8; 32]>) -> Result<[u8; 32]> {
    if let Some(key) = given {
        return Ok(key);
    }
    let path = data_dir.join("memory.key");
    if let Ok(bytes) = std::fs::read(&path)
        && let Ok(key) = <[u8; 32]>::try_from(bytes.as_slice())
    {
        return Ok(key);
    }
    let mut key = [0u8; 32];
    // SAFETY: getrandom fills the buffer it is given.
    if unsafe { libc::getrandom(key.as_mut_ptr().cast(), key.len(), 0) } != 32 {
        return Err(EngineError::Host("getrandom failed".into()));
    }
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&path)
        .map_err(EngineError::io("write memory.key"))?;
    file.write_all(&key).map_err(EngineError::io("write memory.key"))?;
    Ok(key)
}

impl JailEngine {
    /// Why this engine cannot keep memory, if it cannot.
    pub(super) fn criu(&self) -> std::result::Result<&super::criu::Criu, String> {
        self.criu.as_ref().map_err(Clone::clone)
    }

    /// Dumps the running jail `id` (its init is `pid`) into `images` (made here; removed again
    /// on failure). silkd closes its connections first, then the jail is frozen; with
    /// `frozen_at` it stays so (the caller thaws it) and the moment is noted there. With
    /// `leave_running` the jail goes on, else CRIU ends it. `Err` is why not: the jail is then
    /// still running (frozen, with `frozen_at`).
    pub(super) fn dump_memory(
        &self,
        id: &SandboxId,
        pid: u32,
        images: &Path,
        leave_running: bool,
        frozen_at: Option<&mut Option<std::time::Instant>>,
    ) -> std::result::Result<Duration, String> {
        self.criu()?;
        let record = self.record(id).map_err(|e| e.to_string())?;
        no_egress(&record.info.spec)?;
        probe::quiesce(&record.info.agent, Duration::from_secs(5))
            .map_err(|e| format!("silkd could not close its connections: {e}"))?;
        // Frozen here rather than by CRIU, at a moment no thread is inside a fork: CRIU cannot
        // stop a vfork() parent, and would wait out its whole timeout before failing.
        let mut attempts = 0;
        loop {
            if let Err(e) = self.cgroups.freeze(id, true) {
                let _ = self.cgroups.freeze(id, false);
                return Err(e.to_string());
            }
            if !self.cgroups.mid_fork(id) || attempts == 200 {
                break;
            }
            attempts += 1;
            self.cgroups.freeze(id, false).map_err(|e| e.to_string())?;
            std::thread::sleep(Duration::from_micros(500));
        }
        let owns_freeze = frozen_at.is_none();
        if let Some(at) = frozen_at {
            *at = Some(std::time::Instant::now());
        }
        let dumped = self.dump_frozen(id, pid, images, leave_running, &record);
        if dumped.is_err() && owns_freeze {
            let _ = self.cgroups.freeze(id, false);
        }
        dumped
    }

    fn dump_frozen(
        &self,
        id: &SandboxId,
        pid: u32,
        images: &Path,
        leave_running: bool,
        record: &super::Record,
    ) -> std::result::Result<Duration, String> {
        let criu = self.criu()?;
        super::dev_check::dev_as_launched(pid)?;
        let _ = std::fs::remove_dir_all(images);
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(images)
            .map_err(|e| format!("mkdir {}: {e}", images.display()))?;
        let binds = record.info.base.template.binds.iter().map(|(_, inside)| inside.as_path());
        let dump = Dump {
            id,
            pid,
            images,
            log: &self.box_dir(id).join("criu-dump.log"),
            binds: binds.collect(),
            freezer: &self.cgroups.freezer_dir(id),
            leave_running,
            launcher: &self.launcher,
        };
        let dumped = criu.dump(&dump);
        if dumped.is_err() {
            let _ = std::fs::remove_dir_all(images);
        }
        dumped
    }

    /// Writes the memory entry for the images in `dir` to `out`: a tar header, the images as a
    /// flat tar, their MAC, padding. The images are mapped and shared with `out`
    /// ([`crate::SnapshotSink::share`]), then hashed: a sink that keeps them uncopied (the
    /// node's spool) has the store cutting them on one core while the MAC is computed on this.
    /// For a sink whose readers are all vouched for ([`crate::SnapshotSink::vouched`]) the MAC
    /// is [`UNSEALED`] instead: no pass over the images at all here.
    pub(super) fn write_memory_entry(
        &self,
        dir: &Path,
        out: &mut (impl crate::SnapshotSink + ?Sized),
    ) -> Result<u64> {
        let mut files = vec![];
        for entry in std::fs::read_dir(dir).map_err(EngineError::io("read memory images"))? {
            let entry = entry.map_err(EngineError::io("read memory images"))?;
            let meta = entry.metadata().map_err(EngineError::io("stat a memory image"))?;
            if !meta.is_file() {
                return Err(EngineError::Host(format!("{:?} in memory images", entry.path())));
            }
            files.push((entry.file_name().to_string_lossy().into_owned(), meta.len()));
        }
        files.sort();
        let inner: u64 =
            files.iter().map(|(_, len)| 512 + len.div_ceil(512) * 512).sum::<u64>() + 1024;
        let size = inner + MAC_LEN as u64;
        let pack = |e| EngineError::io("pack memory images")(e);
        let mut header = tar::Header::new_old();
        header.as_old_mut().name[..ENTRY.len()].copy_from_slice(ENTRY);
        header.set_size(size);
        header.set_mode(0o600);
        header.set_entry_type(tar::EntryType::Regular);
        header.set_cksum();
        out.write_all(header.as_bytes()).map_err(pack)?;
        let mut mac = (!out.vouched()).then(|| blake3::Hasher::new_keyed(&self.memory_key));
        // Headers and padding: hashed, and copied into `out`'s buffer.
        fn small<S: Write + ?Sized>(
            mac: &mut Option<blake3::Hasher>,
            out: &mut S,
            bytes: &[u8],
        ) -> std::io::Result<()> {
            if let Some(mac) = mac {
                mac.update(bytes);
            }
            out.write_all(bytes)
        }
        for (name, len) in &files {
            let file =
                std::fs::File::open(dir.join(name)).map_err(EngineError::io("open image"))?;
            let mut h = tar::Header::new_gnu();
            h.set_path(name).map_err(pack)?;
            h.set_size(*len);
            h.set_mode(0o600);
            h.set_entry_type(tar::EntryType::Regular);
            h.set_cksum();
            small(&mut mac, out, h.as_bytes()).map_err(pack)?;
            // The length `inner` counted, or an error: the entry's header holds its size.
            let image = super::mapped::Mapped::of(&file, *len).map_err(pack)?;
            out.share(image.clone()).map_err(pack)?;
            if let Some(mac) = &mut mac {
                mac.update(&image);
            }
            let pad = (512 - len % 512) % 512;
            small(&mut mac, out, &ZEROS[..pad as usize]).map_err(pack)?;
        }
        small(&mut mac, out, &ZEROS[..1024]).map_err(pack)?;
        let tag = mac.map_or(UNSEALED, |mac| *mac.finalize().as_bytes());
        out.write_all(&tag).map_err(pack)?;
        let pad = (512 - size % 512) % 512;
        out.write_all(&ZEROS[..pad as usize]).map_err(pack)?;
        Ok(512 + size + pad)
    }

    /// [`JailEngine::open_snapshot_stream`] on a snapshot file.
    pub(super) fn open_snapshot(
        &self,
        tar: &Path,
        into: &Path,
    ) -> Result<(Box<dyn Read>, std::result::Result<bool, String>)> {
        let file =
            std::fs::File::open(tar).map_err(EngineError::io(format!("open {}", tar.display())))?;
        self.open_snapshot_stream(file, into, false)
    }

    /// Reads a snapshot's memory entry, if it starts with one, from `input` read once (a
    /// download as it arrives, a file). The images are unpacked into `into` (a new directory)
    /// as they pass, and the MAC over every byte of the entry is checked at its end: images it
    /// does not verify are removed, never given to CRIU. Unpacking ahead of the MAC uses what
    /// the store sent only as flat names of regular files, each created new with `O_NOFOLLOW`
    /// in that directory, and saves a spool: each byte is read, hashed and written once.
    /// Returns the layer tar that follows (the whole input when there is no entry) and what
    /// became of the images: `Ok(true)` unpacked, `Ok(false)` none in this snapshot, `Err` why
    /// they cannot be used. A `vouched` stream (`Snapshot::vouched`) is not MAC-checked.
    pub(super) fn open_snapshot_stream<'a>(
        &self,
        mut input: impl Read + 'a,
        into: &Path,
        vouched: bool,
    ) -> Result<(Box<dyn Read + 'a>, std::result::Result<bool, String>)> {
        let read = |e: std::io::Error| EngineError::io("read snapshot")(e);
        let mut head = [0u8; 512];
        let n = read_full(&mut input, &mut head).map_err(read)?;
        let Some(size) = memory_entry(&head, n)? else {
            let layer = std::io::Cursor::new(head[..n].to_vec()).chain(input);
            return Ok((Box::new(layer), Ok(false)));
        };
        let mut entry = Hashed {
            input: (&mut input).take(size - MAC_LEN as u64),
            hasher: (!vouched).then(|| blake3::Hasher::new_keyed(&self.memory_key)),
        };
        let unpacked = unpack_images(&mut entry, into);
        // To the entry's end whatever the unpack made of it: the MAC covers every byte.
        let drained = std::io::copy(&mut entry, &mut std::io::sink());
        let (short, hash) = (entry.input.limit() > 0, entry.hasher.map(|h| h.finalize()));
        let mut tag = [0u8; MAC_LEN];
        let padding = size.div_ceil(512) * 512 - size;
        let tail = drained.and_then(|_| {
            let tagged = read_full(&mut input, &mut tag)?;
            let skipped = std::io::copy(&mut (&mut input).take(padding), &mut std::io::sink())?;
            Ok(short || tagged != MAC_LEN || skipped != padding)
        });
        let verdict = match tail {
            Err(e) => Err(read(e)),
            Ok(true) => Err(EngineError::BadRequest("snapshot: truncated memory entry".into())),
            Ok(false) if hash.is_some_and(|hash| hash != blake3::Hash::from(tag)) => {
                Ok(Err(if tag == UNSEALED {
                    "its memory image has no MAC of its own (written for a store that signs \
                     its manifests), and this copy's manifest is not signed with this fleet's key"
                } else {
                    "its memory image was not made by this fleet (MAC mismatch)"
                }
                .to_string()))
            }
            Ok(false) => Ok(unpacked.map(|()| true)),
        };
        if !matches!(verdict, Ok(Ok(true))) {
            let _ = std::fs::remove_dir_all(into);
        }
        Ok((Box::new(input), verdict?))
    }
}

/// Unpacks a tar of images into `into`, a new directory. Only flat names of regular files
/// pass, each created new (a name given twice fails).
fn unpack_images(input: impl Read, into: &Path) -> std::result::Result<(), String> {
    let _ = std::fs::remove_dir_all(into);
    std::fs::DirBuilder::new().mode(0o700).create(into).map_err(|e| e.to_string())?;
    // Images are mostly a few large page files: 1 MiB at a time (`io::copy` moves 8 KiB).
    let mut buf = vec![0u8; 1 << 20];
    let mut archive = tar::Archive::new(input);
    for entry in archive.entries().map_err(|e| e.to_string())? {
        let mut entry = entry.map_err(|e| e.to_string())?;
        let path = entry.path().map_err(|e| e.to_string())?.into_owned();
        let name = path.to_str().unwrap_or_default().to_string();
        let flat = !name.is_empty()
            && !name.starts_with('.')
            && name.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
        if !flat || entry.header().entry_type() != tar::EntryType::Regular {
            return Err(format!("bad memory image entry {name:?}"));
        }
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(into.join(&name))
            .map_err(|e| e.to_string())?;
        loop {
            match entry.read(&mut buf).map_err(|e| e.to_string())? {
                0 => break,
                n => file.write_all(&buf[..n]).map_err(|e| e.to_string())?,
            }
        }
    }
    Ok(())
}

/// Zeros for a tar's padding and its end.
static ZEROS: [u8; 1024] = [0; 1024];

/// A reader that hashes what passes (when it has a hasher).
struct Hashed<R: Read> {
    input: R,
    hasher: Option<blake3::Hasher>,
}

impl<R: Read> Read for Hashed<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.input.read(buf)?;
        if let Some(hasher) = &mut self.hasher {
            hasher.update(&buf[..n]);
        }
        Ok(n)
    }
}

/// The size of the memory entry a snapshot starts with, from its first `n` bytes (`head`);
/// `None` where it starts with something else (the layer tar itself).
fn memory_entry(head: &[u8; 512], n: usize) -> Result<Option<u64>> {
    let header = tar::Header::from_byte_slice(head);
    let name = &header.as_old().name;
    if !(n == 512 && name.starts_with(ENTRY) && name[ENTRY.len()] == 0) {
        return Ok(None);
    }
    let size = header.size().unwrap_or(u64::MAX);
    if !(MAC_LEN as u64..=MAX_ENTRY).contains(&size) {
        return Err(EngineError::BadRequest("snapshot: bad memory entry".into()));
    }
    Ok(Some(size))
}

/// Reads until `buf` is full or the input ends; how much was read.
fn read_full(input: &mut (impl Read + ?Sized), buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match input.read(&mut buf[n..])? {
            0 => break,
            k => n += k,
        }
    }
    Ok(n)
}

/// A staging directory for a restore's external mounts: under `/run`, traversable by any uid
/// (see `launch::restore`), one per sandbox.
pub(super) fn staging_dir(instance: &str, id: &SandboxId) -> Result<PathBuf> {
    let parent = PathBuf::from("/run/silkmesh-criu");
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o711)
        .create(&parent)
        .map_err(EngineError::io("mkdir /run/silkmesh-criu"))?;
    let dir = parent.join(format!("{instance}-{id}"));
    let _ = std::fs::remove_dir(&dir);
    std::fs::DirBuilder::new()
        .mode(0o711)
        .create(&dir)
        .map_err(EngineError::io(format!("mkdir {}", dir.display())))?;
    Ok(dir)
}

impl JailEngine {
    /// Starts the box `id` (its directories made, its files in place) from the images in
    /// `boxes/<id>/memory`, removed once used; under another id than the dumped one, as a copy
    /// with its own hostname and machine id. `Err` is why not; nothing of the attempt is left
    /// running.
    pub(super) fn restore_memory(
        &self,
        base: crate::Base,
        id: &SandboxId,
        spec: &crate::BoxSpec,
    ) -> std::result::Result<crate::BoxInfo, String> {
        let criu = self.criu()?;
        no_egress(spec)?;
        let dir = self.box_dir(id);
        let images = dir.join("memory");
        let json = std::fs::read(images.join("memory.json"))
            .map_err(|e| format!("read memory.json: {e}"))?;
        let meta = super::criu::DumpMeta::parse(&json)?;
        if meta.binds != base.template.binds.len() {
            return Err("the template's host binds changed since the dump".into());
        }
        if meta.empty_net && !criu.empty_net {
            return Err(format!(
                "dumped without its network namespace, which {} cannot make again \
                 (scripts/install-criu's CRIU can)",
                criu.bin.display()
            ));
        }
        let hostname = (meta.id != *id).then(|| id.to_string());
        // CRIU reads some images from inside the restored user namespace: as host root before
        // its id map is written, as the sandbox's root after (a race inside CRIU). Readable by
        // both, then; nothing but root reaches this directory (the box's is root's, 0700).
        use std::os::unix::fs::PermissionsExt;
        for entry in std::fs::read_dir(&images).map_err(|e| e.to_string())?.flatten() {
            std::fs::set_permissions(entry.path(), std::fs::Permissions::from_mode(0o644))
                .map_err(|e| e.to_string())?;
        }
        std::fs::set_permissions(&images, std::fs::Permissions::from_mode(0o755))
            .map_err(|e| e.to_string())?;
        let cgroups = self.cgroups.create(id, spec.limits()).map_err(|e| e.to_string())?;
        let restored = (|| {
            let staging = staging_dir(&self.instance, id).map_err(|e| e.to_string())?;
            let files = super::disk::files_dir(&dir);
            let (criu_log, pidfile) = (dir.join("criu-restore.log"), dir.join("restore.pid"));
            let _ = std::fs::remove_file(&pidfile);
            let restore = super::launch::restore::RestoreSpec {
                criu: criu.bin.clone(),
                images: images.clone(),
                criu_log: criu_log.clone(),
                pidfile,
                root: dir.join("root"),
                lowers: self.lowers(&base, &dir).map_err(|e| e.to_string())?,
                upper: files.join("upper"),
                work: files.join("work"),
                binds: base.template.binds.iter().map(|(host, _)| host.clone()).collect(),
                silkd: self.cfg.silkd.clone(),
                staging: staging.clone(),
                root_id: self.ids.base,
                cgroups,
                log_key: meta.log_key,
                hostname,
                empty_net: meta.empty_net,
            };
            let log = self.agent_log(&dir)?;
            let ran = self.launcher.restore(restore, std::os::fd::AsFd::as_fd(&log));
            let _ = std::fs::remove_dir(&staging);
            ran.map_err(|why| super::criu::failure(&criu_log, &why))
        })();
        let pid = match restored {
            Ok(pid) => pid,
            Err(e) => {
                let _ = self.cgroups.remove(id);
                return Err(e);
            }
        };
        let started = super::start_time(pid);
        let info = crate::BoxInfo {
            id: id.clone(),
            base,
            spec: spec.clone(),
            agent: super::agent_addr(pid, started),
            pid: Some(pid),
            running: true,
            created_ms: super::host::now_ms(),
            memory: crate::MemoryKept::yes(),
            address: None,
        };
        let saved = self.save(&super::Record {
            info: info.clone(),
            start_time: started,
            id_base: Some(self.ids.base),
        });
        let ready = saved.map_err(|e| e.to_string()).and_then(|()| {
            probe::ready(&info.agent, self.cfg.ready_timeout).map_err(|e| e.to_string())
        });
        match ready {
            Ok(answered) => answered.into_iter().for_each(|conn| self.answered.keep(id, conn)),
            Err(e) => {
                let _ = self.kill(id, Some(pid));
                return Err(format!("the restored silkd does not answer: {e}"));
            }
        }
        // Spent: deleted behind the wake (a rename here, not a file at a time).
        let _ = self.trash.discard(&images);
        Ok(info)
    }

    /// Starts box `id` from its golden's memory `images`: linked into the box's own `memory`
    /// directory (CRIU writes its statistics beside the images it restores; the golden's stay
    /// as built), then restored under the box's name.
    pub(super) fn restore_golden_memory(
        &self,
        images: &Path,
        base: &crate::Base,
        id: &SandboxId,
        spec: &crate::BoxSpec,
    ) -> std::result::Result<crate::BoxInfo, String> {
        no_egress(spec)?;
        let mine = self.box_dir(id).join("memory");
        let restored = super::forks::link_files(images, &mine)
            .map_err(|e| format!("link the golden's memory images: {e}"))
            .and_then(|()| self.restore_memory(base.clone(), id, spec));
        if restored.is_err() {
            let _ = std::fs::remove_dir_all(&mine);
        }
        restored
    }

    /// silkd's log, opened for a restore: CRIU reopens it from inside the restored user
    /// namespace (through /proc/self/fd, which checks the file's permissions again), so the
    /// sandbox's root must own it.
    fn agent_log(&self, dir: &Path) -> std::result::Result<std::fs::File, String> {
        use std::os::unix::fs::OpenOptionsExt;
        let log = std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(dir.join("agent.log"))
            .map_err(|e| format!("open agent.log: {e}"))?;
        std::os::unix::fs::fchown(&log, Some(self.ids.base), Some(self.ids.base))
            .map_err(|e| format!("chown agent.log: {e}"))?;
        Ok(log)
    }
}
