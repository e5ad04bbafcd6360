//! An engine that runs nothing, for tests of what sits above engines (the node's controller):
//! sandboxes are records in memory and their files a map, so those tests need no root,
//! namespaces or silkd and run in milliseconds. What crosses the trait is real: snapshots and
//! golden layers are tar files the caller can move through a store, and a restore reads the
//! files back from one. Failures are injected per operation.
//!
//! Behind the `fake` feature; never in a production build.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

use crate::{
    AgentAddr, Base, BoxInfo, BoxSpec, Caps, Digest, DiskMechanism, Engine, EngineError, Golden,
    Memory, MemoryKept, Result, SandboxId, Snapshot, SnapshotMode, Template, TemplateDef,
    TemplateSource, Warmup,
};

/// The operations failures can be injected into.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    Template,
    Prepare,
    Clone,
    Boot,
    Snapshot,
    Stop,
    Resume,
    Restore,
    Destroy,
}

type Files = BTreeMap<String, Vec<u8>>;

#[derive(Debug)]
pub struct FakeEngine {
    /// Where snapshot-independent files go: golden layers.
    dir: PathBuf,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    boxes: BTreeMap<SandboxId, FakeBox>,
    goldens: HashMap<Digest, (Golden, Files)>,
    /// Calls of each operation still to fail.
    failing: HashMap<Op, usize>,
    calls: HashMap<Op, u64>,
}

#[derive(Debug)]
struct FakeBox {
    info: BoxInfo,
    files: Files,
}

impl FakeEngine {
    /// An engine keeping its golden layers under `dir`.
    pub fn new(dir: impl Into<PathBuf>) -> FakeEngine {
        let dir = dir.into();
        let _ = std::fs::create_dir_all(&dir);
        FakeEngine { dir, state: Mutex::default() }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The next `times` calls of `op` fail with a host error (and change nothing).
    pub fn fail(&self, op: Op, times: usize) {
        self.lock().failing.insert(op, times);
    }

    /// How many times `op` was called (failed calls included).
    pub fn calls(&self, op: Op) -> u64 {
        self.lock().calls.get(&op).copied().unwrap_or(0)
    }

    /// Writes a file in a sandbox, as a process in it would.
    pub fn write_file(&self, id: &SandboxId, path: &str, bytes: &[u8]) -> Result<()> {
        let mut st = self.lock();
        let b = st.boxes.get_mut(id).ok_or_else(|| EngineError::NotFound(id.to_string()))?;
        if !b.info.running {
            return Err(EngineError::NotReady(format!("{id} is stopped")));
        }
        b.files.insert(path.to_string(), bytes.to_vec());
        Ok(())
    }

    /// A file in a sandbox (running or stopped).
    pub fn read_file(&self, id: &SandboxId, path: &str) -> Option<Vec<u8>> {
        self.lock().boxes.get(id)?.files.get(path).cloned()
    }

    /// Whether the sandbox exists and runs.
    pub fn running(&self, id: &SandboxId) -> bool {
        self.lock().boxes.get(id).is_some_and(|b| b.info.running)
    }

    /// Counts the call and fails it if a failure is due.
    fn enter(&self, op: Op) -> Result<MutexGuard<'_, State>> {
        let mut st = self.lock();
        *st.calls.entry(op).or_default() += 1;
        if let Some(left) = st.failing.get_mut(&op)
            && *left > 0
        {
            *left -= 1;
            return Err(EngineError::Host(format!("injected failure of {op:?}")));
        }
        Ok(st)
    }

    fn start(
        &self,
        st: &mut State,
        base: Base,
        id: &SandboxId,
        spec: &BoxSpec,
        files: Files,
    ) -> Result<BoxInfo> {
        if st.boxes.contains_key(id) {
            return Err(EngineError::Exists(id.to_string()));
        }
        let info = BoxInfo {
            id: id.clone(),
            base,
            spec: spec.clone(),
            agent: AgentAddr::Unix(self.dir.join(format!("{id}.sock"))),
            pid: None,
            running: true,
            created_ms: 0,
            memory: MemoryKept::default(),
            address: None,
        };
        st.boxes.insert(id.clone(), FakeBox { info: info.clone(), files });
        Ok(info)
    }
}

/// Writes `files` as a tar at `into` (complete or absent: written beside it, then renamed).
fn write_tar(files: &Files, into: &Path) -> Result<u64> {
    let partial = into.with_extension("partial");
    let file = std::fs::File::create(&partial).map_err(EngineError::io("create tar"))?;
    let mut tar = tar::Builder::new(file);
    for (path, bytes) in files {
        let mut header = tar::Header::new_gnu();
        header.set_size(bytes.len() as u64);
        header.set_mode(0o644);
        header.set_cksum();
        tar.append_data(&mut header, path, bytes.as_slice())
            .map_err(EngineError::io("write tar"))?;
    }
    let file = tar.into_inner().map_err(EngineError::io("finish tar"))?;
    file.sync_all().map_err(EngineError::io("sync tar"))?;
    let bytes = file.metadata().map_err(EngineError::io("stat tar"))?.len();
    std::fs::rename(&partial, into).map_err(EngineError::io("commit tar"))?;
    Ok(bytes)
}

fn read_tar(path: &Path) -> Result<Files> {
    let file =
        std::fs::File::open(path).map_err(EngineError::io(format!("open {}", path.display())))?;
    let mut files = Files::new();
    let mut archive = tar::Archive::new(file);
    for entry in archive.entries().map_err(EngineError::io("read tar"))? {
        let mut entry = entry.map_err(EngineError::io("read tar"))?;
        let path =
            entry.path().map_err(EngineError::io("tar path"))?.to_string_lossy().into_owned();
        let mut bytes = vec![];
        std::io::Read::read_to_end(&mut entry, &mut bytes).map_err(EngineError::io("read tar"))?;
        files.insert(path, bytes);
    }
    Ok(files)
}

impl Engine for FakeEngine {
    fn name(&self) -> &'static str {
        "fake"
    }

    fn capabilities(&self) -> Caps {
        Caps {
            memory_snapshot: false,
            egress: false,
            disk_limit: false,
            disk_mechanism: DiskMechanism::None,
        }
    }

    fn template(&self, def: &TemplateDef) -> Result<Template> {
        drop(self.enter(Op::Template)?);
        let root = match &def.source {
            TemplateSource::Host => self.dir.join("host"),
            TemplateSource::Dir(dir) if dir.is_dir() => dir.clone(),
            TemplateSource::Dir(dir) => {
                return Err(EngineError::BadTemplate(format!(
                    "{} is not a directory",
                    dir.display()
                )));
            }
            TemplateSource::Image(image) => image.clone(),
            TemplateSource::Pulled(image) => PathBuf::from(&image.digest),
        };
        let mut hasher = blake3::Hasher::new();
        hasher.update(b"fake-template");
        // The host template is the same on every fake host (two nodes in one test agree on it,
        // as two nodes of one fleet do); any other is named by its path.
        match &def.source {
            TemplateSource::Host => hasher.update(b"host"),
            _ => hasher.update(root.as_os_str().as_encoded_bytes()),
        };
        Ok(Template {
            name: def.name.clone(),
            digest: Digest::of(&hasher),
            root,
            binds: vec![],
            env: vec![],
            cwd: None,
            user: None,
        })
    }

    fn prepare(&self, template: &Template, warmup: &Warmup) -> Result<Golden> {
        let digest = self.golden_digest(template, warmup);
        let mut st = self.enter(Op::Prepare)?;
        if let Some((g, _)) = st.goldens.get(&digest) {
            return Ok(g.clone());
        }
        if warmup.argv.first().is_some_and(|a| a == "false") {
            return Err(EngineError::WarmupFailed("`false` exited with 1".into()));
        }
        let files = Files::from([("warmup".to_string(), warmup.argv.join(" ").into_bytes())]);
        let layer = self.dir.join(format!("golden-{}.tar", digest.short()));
        write_tar(&files, &layer)?;
        let golden = Golden { digest: digest.clone(), template: template.clone(), layer };
        st.goldens.insert(digest, (golden.clone(), files));
        Ok(golden)
    }

    fn golden_digest(&self, template: &Template, warmup: &Warmup) -> Digest {
        let mut hasher = blake3::Hasher::new();
        hasher.update(b"fake-golden").update(template.digest.as_str().as_bytes());
        for arg in &warmup.argv {
            hasher.update(&(arg.len() as u64).to_le_bytes()).update(arg.as_bytes());
        }
        Digest::of(&hasher)
    }

    fn find_golden(&self, digest: &Digest) -> Option<Golden> {
        self.lock().goldens.get(digest).map(|(g, _)| g.clone())
    }

    fn export_golden(&self, golden: &Golden, into: &Path) -> Result<()> {
        let files = self.lock().goldens.get(&golden.digest).map(|(_, f)| f.clone());
        let files = files.ok_or_else(|| EngineError::NotFound(golden.digest.to_string()))?;
        write_tar(&files, into).map(drop)
    }

    fn import_golden(
        &self,
        template: &Template,
        digest: &Digest,
        layer_tar: &Path,
    ) -> Result<Golden> {
        if let Some(g) = self.find_golden(digest) {
            return Ok(g);
        }
        let files = read_tar(layer_tar)?;
        let layer = self.dir.join(format!("golden-{}.tar", digest.short()));
        write_tar(&files, &layer)?;
        let golden = Golden { digest: digest.clone(), template: template.clone(), layer };
        self.lock().goldens.insert(digest.clone(), (golden.clone(), files));
        Ok(golden)
    }

    fn clone_golden(&self, golden: &Golden, id: &SandboxId, spec: &BoxSpec) -> Result<BoxInfo> {
        let mut st = self.enter(Op::Clone)?;
        let files = st.goldens.get(&golden.digest).map(|(_, f)| f.clone());
        let files = files.ok_or_else(|| EngineError::NotFound(golden.digest.to_string()))?;
        let base = Base { template: golden.template.clone(), golden: Some(golden.clone()) };
        self.start(&mut st, base, id, spec, files)
    }

    fn boot(&self, template: &Template, id: &SandboxId, spec: &BoxSpec) -> Result<BoxInfo> {
        let mut st = self.enter(Op::Boot)?;
        let base = Base { template: template.clone(), golden: None };
        self.start(&mut st, base, id, spec, Files::new())
    }

    fn snapshot(
        &self,
        id: &SandboxId,
        mode: SnapshotMode,
        _memory: Memory,
        into: &Path,
    ) -> Result<Snapshot> {
        let mut st = self.enter(Op::Snapshot)?;
        let b = st.boxes.get(id).ok_or_else(|| EngineError::NotFound(id.to_string()))?;
        let bytes = write_tar(&b.files, into)?;
        let snapshot = Snapshot {
            base: b.info.base.clone(),
            spec: b.info.spec.clone(),
            layer_tar: into.to_path_buf(),
            bytes,
            memory: false,
            memory_why_not: Some("the fake engine keeps no memory".into()),
            freeze_ms: None,
            vouched: false,
        };
        if mode == SnapshotMode::Stop {
            st.boxes.remove(id);
        }
        Ok(snapshot)
    }

    fn stop(&self, id: &SandboxId, _memory: Memory) -> Result<MemoryKept> {
        let mut st = self.enter(Op::Stop)?;
        let b = st.boxes.get_mut(id).ok_or_else(|| EngineError::NotFound(id.to_string()))?;
        b.info.running = false;
        Ok(MemoryKept::no("the fake engine keeps no memory"))
    }

    fn resume(&self, id: &SandboxId) -> Result<BoxInfo> {
        let mut st = self.enter(Op::Resume)?;
        let b = st.boxes.get_mut(id).ok_or_else(|| EngineError::NotFound(id.to_string()))?;
        b.info.running = true;
        Ok(b.info.clone())
    }

    fn golden_from_snapshot(&self, snapshot: &Snapshot) -> Result<Golden> {
        let mut files = match &snapshot.base.golden {
            Some(g) => {
                self.lock().goldens.get(&g.digest).map(|(_, f)| f.clone()).unwrap_or_default()
            }
            None => Files::new(),
        };
        files.extend(read_tar(&snapshot.layer_tar)?);
        let mut hasher = blake3::Hasher::new();
        hasher.update(b"fake-promoted");
        for (path, bytes) in &files {
            hasher
                .update(path.as_bytes())
                .update(&(bytes.len() as u64).to_le_bytes())
                .update(bytes);
        }
        let digest = Digest::of(&hasher);
        let layer = self.dir.join(format!("golden-{}.tar", digest.short()));
        write_tar(&files, &layer)?;
        let golden =
            Golden { digest: digest.clone(), template: snapshot.base.template.clone(), layer };
        self.lock().goldens.insert(digest, (golden.clone(), files));
        Ok(golden)
    }

    fn restore(
        &self,
        snapshot: &Snapshot,
        id: &SandboxId,
        spec: &BoxSpec,
        _memory: Memory,
    ) -> Result<BoxInfo> {
        let mut files = match &snapshot.base.golden {
            Some(g) => {
                self.lock().goldens.get(&g.digest).map(|(_, f)| f.clone()).unwrap_or_default()
            }
            None => Files::new(),
        };
        files.extend(read_tar(&snapshot.layer_tar)?);
        let mut st = self.enter(Op::Restore)?;
        self.start(&mut st, snapshot.base.clone(), id, spec, files)
    }

    fn destroy(&self, id: &SandboxId) -> Result<()> {
        let mut st = self.enter(Op::Destroy)?;
        st.boxes.remove(id).map(drop).ok_or_else(|| EngineError::NotFound(id.to_string()))
    }

    fn list(&self) -> Result<Vec<BoxInfo>> {
        Ok(self.lock().boxes.values().map(|b| b.info.clone()).collect())
    }

    fn agent(&self, id: &SandboxId) -> Result<AgentAddr> {
        let st = self.lock();
        let b = st.boxes.get(id).ok_or_else(|| EngineError::NotFound(id.to_string()))?;
        Ok(b.info.agent.clone())
    }
}
