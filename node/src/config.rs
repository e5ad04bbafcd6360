//! The node's configuration: one TOML file, every key optional, unknown keys rejected with the
//! key named. Flags and `SANDBOXD_*` environment variables override the file (see `main.rs`).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use silk_engine::{Lane, Size};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// HTTP listen address.
    pub listen: SocketAddr,
    /// Where the journal, templates, goldens and sandboxes live.
    pub data_dir: PathBuf,
    /// The root API token. When unset, the node refuses to listen beyond loopback unless
    /// `allow_open_listen` is set.
    pub api_token: Option<String>,
    pub allow_open_listen: bool,
    /// The engine; only `jail` exists today.
    pub engine: String,
    /// The silkd binary put into sandboxes (static, so it runs in any rootfs); default: `silkd`
    /// next to the `sandboxd` binary.
    pub silkd: Option<PathBuf>,
    /// The `silk-jail` launcher; default: next to the `sandboxd` binary.
    pub launcher: Option<PathBuf>,
    /// Keep sandboxes' process memory (hibernate, checkpoint, fork, move, archive) where CRIU
    /// works; `false`: files only.
    pub memory: bool,
    /// The CRIU binary; default: `/usr/local/sbin/criu` (what `scripts/install-criu` installs),
    /// else `/usr/sbin/criu`.
    pub criu: Option<PathBuf>,
    /// The host uid and gid that is root inside every sandbox (65536 ids from there are the
    /// sandboxes'; see docs/engine.md).
    pub sandbox_id_base: u32,
    /// Live claims this node accepts before answering 429.
    pub max_claims: usize,
    /// The most warm sandboxes one pool may keep (`warm` and `warm_max`): a bound on what
    /// one line of `PUT /v1/pools` can make this node start.
    pub max_warm: usize,
    /// Free space (MiB) the data directory's filesystem keeps: below it the node refuses new
    /// sandboxes and checkpoints with 507, so the journal and running sandboxes keep room.
    pub min_free_mib: u64,
    /// Largest request body, in bytes (413 beyond).
    pub max_body_bytes: usize,
    /// Lease when a claim names none, and the cap on any lease.
    pub default_ttl_seconds: u64,
    pub max_ttl_seconds: u64,
    /// fsync every journal commit (survives power loss, not only a killed process).
    pub journal_fsync: bool,
    /// Engine operations (refill, teardown) run at once in the background.
    pub background_concurrency: usize,
    /// Output a buffered `POST /exec` keeps per stream.
    pub exec_output_cap: usize,
    /// Templates besides the built-in `host`.
    pub templates: BTreeMap<String, TemplateConfig>,
    /// Registries images are pulled from, by host (`[registries."HOST:PORT"]`): plain HTTP, a
    /// CA, credentials (docs/templates.md).
    pub registries: BTreeMap<String, silk_registry::RegistrySettings>,
    /// Pull only from the registries listed under `[registries]`.
    pub only_listed_registries: bool,
    /// A docker `config.json` holding registry credentials (default: `$REGISTRY_AUTH_FILE`,
    /// `$DOCKER_CONFIG/config.json`, `~/.docker/config.json`).
    pub registry_auth_file: Option<PathBuf>,
    /// The layer cache's bound (MiB): least recently used layers go beyond it.
    pub layer_cache_mib: u64,
    /// The most one image may be: its compressed layers, and what they unpack to (MiB).
    pub max_image_mib: u64,
    pub max_image_unpacked_mib: u64,
    /// Copies of this node's checkpoints kept on its disk for their branches here (MiB; 0:
    /// none): past it the least recently used go. Only checkpoints that kept memory leave one.
    pub checkpoint_copies_mib: u64,
    /// Warm pools.
    pub pools: Vec<PoolConfig>,
    /// Where checkpoints and archives go (and, across nodes, goldens).
    pub store: StoreConfig,
    /// Archive a sandbox after this long hibernated (never when unset).
    pub archive_after_seconds: Option<u64>,
    /// Delete an archive (and release its claim) after this long archived (never when unset).
    pub archive_retention_seconds: Option<u64>,
    /// Join a mesh of nodes (none when unset).
    pub mesh: Option<MeshSection>,
    /// Serve E2B's API (control plane and envd) so the stock e2b SDKs work (off when unset).
    pub e2b: Option<E2bSection>,
    /// Disk each size tier may use (where the data directory's filesystem can bound it).
    pub disk: DiskSection,
    /// Lookups of sandboxes held by other nodes (peers asked, the store when none has it) one
    /// client address may cause: per minute sustained, and at once (0 per minute: no limit).
    pub lookups_per_minute: u32,
    pub lookup_burst: u32,
    /// How often the node re-reads the fleet's tenants from the store (a change made on another
    /// node is in force here within this plus one store round trip).
    pub tenant_refresh_ms: u64,
    /// How often running sandboxes are metered into the usage journal (a kill -9 loses at
    /// most this much of it).
    pub usage_interval_seconds: u64,
    /// The audit journal: whole argv of execs (default: argv[0] only), and its rotation.
    pub audit_exec_args: bool,
    pub audit_max_bytes: u64,
    pub audit_keep: usize,
    /// A bearer token `/metrics` requires (open when unset; the root token is accepted too).
    pub metrics_token: Option<String>,
    /// Serve the API over TLS (plain HTTP when unset).
    pub tls: Option<TlsSection>,
    /// The egress lane (docs/network.md).
    pub egress: EgressSection,
    /// Preview URLs (docs/network.md).
    pub previews: PreviewsSection,
}

/// `[previews]`: how preview URLs look. With `domain` set they are `{port}-{id}.{domain}`
/// (point a wildcard DNS name and certificate at the nodes or their load balancer); without
/// it they are paths under the address the preview was asked at.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PreviewsSection {
    pub domain: Option<String>,
    /// `http` or `https` in the URLs (default: the API's).
    pub scheme: Option<String>,
    /// A port to put in host-based URLs (default: none, the scheme's).
    pub port: Option<u16>,
}

/// `[egress]`: the network lane `egress` gives sandboxes (docs/network.md).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EgressSection {
    /// Offer lane `egress` (it also needs `nft` and `ip`; without them it is off, and says why).
    pub enabled: bool,
    /// The lane's addresses: its first is the gateway, the others go to sandboxes. Nodes on one
    /// host need lanes that do not overlap.
    pub cidr: String,
    /// The policy of pools that set none: allows nothing when unset.
    pub default: Option<silk_api::EgressPolicy>,
    /// Private networks (10/8, 172.16/12, 192.168/16, 100.64/10 or parts) sandboxes may reach
    /// when their policy allows them too; the guard refuses them otherwise.
    pub open_private: Vec<String>,
    /// Where the lane's resolver asks (this host's resolv.conf servers when empty).
    pub dns: Vec<SocketAddr>,
    /// Connections one sandbox may have open at once.
    pub max_connections: usize,
    /// Bandwidth each way per size tier, Mbit/s (0: unlimited).
    pub small_mbit: u32,
    pub medium_mbit: u32,
    pub large_mbit: u32,
}

impl Default for EgressSection {
    fn default() -> Self {
        EgressSection {
            enabled: true,
            cidr: "10.88.0.0/16".into(),
            default: None,
            open_private: vec![],
            dns: vec![],
            max_connections: 256,
            small_mbit: 100,
            medium_mbit: 250,
            large_mbit: 1000,
        }
    }
}

/// `[tls]`: the API's certificate (PEM chain and key), and a CA whose certificates clients
/// must present when set (mutual TLS).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsSection {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub client_ca: Option<PathBuf>,
}

/// `[disk]`: MiB a sandbox of each size may use.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DiskSection {
    /// Off: sandboxes' disks are not bounded (no image or subvolume per sandbox).
    pub bounded: bool,
    pub small_mib: u64,
    pub medium_mib: u64,
    pub large_mib: u64,
}

impl Default for DiskSection {
    fn default() -> Self {
        DiskSection { bounded: true, small_mib: 2048, medium_mib: 8192, large_mib: 32768 }
    }
}

/// `[e2b]`: E2B's API on a listener of its own (docs/e2b.md).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct E2bSection {
    /// Both planes on one address, so `E2B_API_URL` and `E2B_SANDBOX_URL` are the same.
    pub listen: SocketAddr,
    /// E2B template ids → this node's template names.
    #[serde(default = "e2b_templates")]
    pub templates: BTreeMap<String, String>,
}

fn e2b_templates() -> BTreeMap<String, String> {
    BTreeMap::from([("base".to_string(), "host".to_string())])
}

impl E2bSection {
    pub fn new(listen: SocketAddr) -> E2bSection {
        E2bSection { listen, templates: e2b_templates() }
    }
}

/// `[mesh]`: this node's place in the mesh.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MeshSection {
    /// This node's name: unique in the mesh, and the name on its certificate.
    pub name: String,
    /// The QUIC (UDP) address of the mesh endpoint.
    pub listen: SocketAddr,
    /// Peers to join through; any live member will do.
    #[serde(default)]
    pub join: Vec<SocketAddr>,
    /// The cluster CA and this node's certificate and key (`sandboxd mesh ca init`,
    /// `sandboxd mesh cert issue`).
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
    /// The API URL peers use to reach this node (default `http://<listen>`, `https://` with
    /// `[tls]`).
    pub advertise: Option<String>,
    /// The API URL clients are redirected to, when it differs (NAT, a proxy).
    pub public_url: Option<String>,
    /// Forward claims and the data plane through this node instead of redirecting clients (for
    /// nodes behind a load balancer that clients cannot reach one by one).
    #[serde(default)]
    pub forward: bool,
    /// A revocation list: one node name or `serial:<hex>` per line, re-read when it changes;
    /// a node it names is refused at every handshake and its connections are closed.
    pub revoked: Option<PathBuf>,
    #[serde(default = "default_probe_period_ms")]
    pub probe_period_ms: u64,
    #[serde(default = "default_probe_rtt_ms")]
    pub probe_rtt_ms: u64,
    /// A suspected node is declared down after this long without refuting.
    #[serde(default = "default_suspect_to_down_ms")]
    pub suspect_to_down_ms: u64,
    /// Moves' files go node to node on the bulk lane: TLS over TCP at `listen`'s port number,
    /// beside QUIC on UDP (a third of QUIC's CPU per byte). Off where only UDP passes between
    /// nodes: they then go on QUIC (a peer whose lane cannot be reached gets them on QUIC too).
    #[serde(default = "yes")]
    pub bulk_lane: bool,
}

fn default_probe_period_ms() -> u64 {
    500
}
fn default_probe_rtt_ms() -> u64 {
    150
}
fn default_suspect_to_down_ms() -> u64 {
    1500
}
fn yes() -> bool {
    true
}

/// `[store]`: a local directory (`[store.fs]`, default `<data_dir>/store`) or an S3 bucket
/// (`[store.s3]`), and the snapshot store's settings (`[store.snapshots]`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StoreConfig {
    pub fs: Option<silk_store::fs::FsConfig>,
    pub s3: Option<silk_store::s3::S3Config>,
    #[serde(default)]
    pub snapshots: silk_store::SnapshotConfig,
    /// Collect chunks no snapshot names this often (0: never). Safe on every node at once.
    #[serde(default = "default_gc_interval")]
    pub gc_interval_seconds: u64,
}

impl Default for StoreConfig {
    fn default() -> StoreConfig {
        StoreConfig {
            fs: None,
            s3: None,
            snapshots: silk_store::SnapshotConfig::default(),
            gc_interval_seconds: default_gc_interval(),
        }
    }
}

fn default_gc_interval() -> u64 {
    3600
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TemplateConfig {
    /// A root filesystem directory.
    pub dir: Option<PathBuf>,
    /// A `docker save` tarball or a tar of an OCI image layout.
    pub image: Option<PathBuf>,
    /// An image reference pulled from its registry (`python:3.12`, `ghcr.io/org/x@sha256:…`);
    /// a tag is resolved once and pinned until `POST /v1/templates/{name}/refresh`.
    #[serde(rename = "ref")]
    pub reference: Option<String>,
    /// Run once before the golden is frozen.
    #[serde(default)]
    pub warmup: Vec<String>,
    #[serde(default = "default_warmup_timeout")]
    pub warmup_timeout_seconds: u64,
}

pub(crate) fn default_warmup_timeout() -> u64 {
    120
}

pub use silk_api::PoolConfig;

impl Default for Config {
    fn default() -> Self {
        Config {
            listen: "127.0.0.1:7777".parse().expect("valid address"),
            data_dir: PathBuf::from("/var/lib/silkmesh"),
            api_token: None,
            allow_open_listen: false,
            engine: "jail".into(),
            silkd: None,
            launcher: None,
            memory: true,
            criu: None,
            sandbox_id_base: silk_engine::jail::DEFAULT_ID_BASE,
            max_claims: 1000,
            max_warm: silk_api::MAX_WARM,
            min_free_mib: 1024,
            max_body_bytes: 1 << 20,
            default_ttl_seconds: 300,
            max_ttl_seconds: 86_400,
            journal_fsync: false,
            background_concurrency: 2,
            exec_output_cap: 1 << 20,
            templates: BTreeMap::new(),
            registries: BTreeMap::new(),
            registry_auth_file: None,
            only_listed_registries: false,
            layer_cache_mib: 10 << 10,
            max_image_mib: 8 << 10,
            max_image_unpacked_mib: 24 << 10,
            checkpoint_copies_mib: 4 << 10,
            pools: vec![PoolConfig {
                template: "host".into(),
                size: Size::Small,
                lane: Lane::None,
                warm: 2,
                warm_max: None,
                idle_hibernate_seconds: None,
                memory: silk_api::Memory::Auto,
                memory_golden: false,
                egress: None,
            }],
            store: StoreConfig::default(),
            archive_after_seconds: None,
            archive_retention_seconds: None,
            disk: DiskSection::default(),
            mesh: None,
            e2b: None,
            tls: None,
            egress: EgressSection::default(),
            previews: PreviewsSection::default(),
            lookups_per_minute: 1200,
            lookup_burst: 100,
            metrics_token: None,
            tenant_refresh_ms: 2000,
            usage_interval_seconds: 60,
            audit_exec_args: false,
            audit_max_bytes: 64 << 20,
            audit_keep: 5,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {0}: {1}")]
    Read(PathBuf, std::io::Error),
    #[error("{0}: {1}")]
    Parse(PathBuf, String),
    #[error("invalid config: {0}")]
    Invalid(String),
}

impl Config {
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError::Read(path.into(), e))?;
        Config::parse(&text).map_err(|e| match e {
            ConfigError::Parse(_, msg) => ConfigError::Parse(path.into(), msg),
            other => other,
        })
    }

    pub fn parse(text: &str) -> Result<Config, ConfigError> {
        let cfg: Config =
            toml::from_str(text).map_err(|e| ConfigError::Parse(PathBuf::new(), e.to_string()))?;
        Ok(cfg)
    }

    /// The URL clients reach this node's API at when nothing else is said: `https://` when
    /// it serves TLS.
    pub fn own_url(&self) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://{}", self.listen)
    }

    /// Checks what types alone cannot.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |m: String| Err(ConfigError::Invalid(m));
        if self.engine != "jail" {
            return bad(format!("engine {:?} is not available (only \"jail\")", self.engine));
        }
        // An empty token would make `Authorization: Bearer ` (nothing after it) the root token.
        if self.api_token.as_deref().is_some_and(|t| t.trim().is_empty()) {
            return bad("api_token is empty: set a secret, or leave the key out".into());
        }
        if self.metrics_token.as_deref().is_some_and(|t| t.trim().is_empty()) {
            return bad("metrics_token is empty: set a secret, or leave the key out".into());
        }
        if self.api_token.is_none() && !self.listen.ip().is_loopback() && !self.allow_open_listen {
            return bad(format!(
                "listen {} is not loopback and no api_token is set; set one (or allow_open_listen = true)",
                self.listen
            ));
        }
        if let Some(e2b) = &self.e2b
            && self.api_token.is_none()
            && !e2b.listen.ip().is_loopback()
            && !self.allow_open_listen
        {
            return bad(format!(
                "e2b.listen {} is not loopback and no api_token is set; set one (or allow_open_listen = true)",
                e2b.listen
            ));
        }
        if self.default_ttl_seconds == 0 || self.default_ttl_seconds > self.max_ttl_seconds {
            return bad("default_ttl_seconds must be between 1 and max_ttl_seconds".into());
        }
        for (name, t) in &self.templates {
            if name == "host" {
                // The built-in template: its files are the host's, only its warmup is set here.
                if t.dir.is_some() || t.image.is_some() || t.reference.is_some() {
                    return bad("template host is built in: give it only a warmup".into());
                }
            } else if [t.dir.is_some(), t.image.is_some(), t.reference.is_some()]
                .iter()
                .filter(|set| **set)
                .count()
                != 1
            {
                return bad(format!("template {name}: set exactly one of dir, image and ref"));
            }
        }
        if let Some(m) = &self.mesh {
            if !silk_mesh::tls::valid_node_name(&m.name) {
                return bad(format!(
                    "mesh.name {:?}: 1-64 of a-z A-Z 0-9 - . forming a DNS name, not \"silkmesh\"",
                    m.name
                ));
            }
            if m.probe_rtt_ms == 0 || m.probe_rtt_ms >= m.probe_period_ms {
                return bad("mesh: probe_rtt_ms must be above 0 and below probe_period_ms".into());
            }
        }
        if self.store.fs.is_some() && self.store.s3.is_some() {
            return bad("set at most one of [store.fs] and [store.s3]".into());
        }
        crate::egress::validate(&self.egress, &self.pools).map_err(ConfigError::Invalid)?;
        for p in &self.pools {
            if p.template != "host" && !self.templates.contains_key(&p.template) {
                return bad(format!("pool template {:?} is not defined", p.template));
            }
            if p.warm.max(p.warm_max.unwrap_or(0)) > self.max_warm {
                return bad(format!(
                    "pool {}: warm and warm_max are at most max_warm ({})",
                    p.template, self.max_warm
                ));
            }
            if p.warm_max.is_some_and(|m| m < p.warm) {
                return bad(format!("pool {}: warm_max is below warm", p.template));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_key_is_optional_and_unknown_keys_are_named() {
        assert_eq!(Config::parse("").unwrap(), Config::default());
        let err =
            Config::parse("listen = \"127.0.0.1:1\"\nlisten_port = 3\n").unwrap_err().to_string();
        assert!(err.contains("listen_port"), "{err}");
        let err = Config::parse("[[pools]]\ntemplate = \"host\"\nwarm = 1\nwarmth = 2\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("warmth"), "{err}");
    }

    #[test]
    fn validation_catches_what_types_cannot() {
        let mut c = Config { listen: "0.0.0.0:7777".parse().unwrap(), ..Config::default() };
        assert!(c.validate().is_err(), "open listen without a token");
        c.api_token = Some("t".into());
        assert!(c.validate().is_ok());
        for empty in ["", "  "] {
            c.api_token = Some(empty.into());
            assert!(c.validate().unwrap_err().to_string().contains("api_token is empty"));
        }
        let c = Config::parse("[[pools]]\ntemplate = \"nope\"\nwarm = 1\n").unwrap();
        assert!(c.validate().unwrap_err().to_string().contains("nope"));
        // E2B's listener follows the same rule as the API's.
        let mut c = Config::parse("[e2b]\nlisten = \"0.0.0.0:3000\"\n").unwrap();
        assert_eq!(c.e2b.as_ref().unwrap().templates["base"], "host");
        assert!(c.validate().unwrap_err().to_string().contains("e2b.listen"));
        c.api_token = Some("t".into());
        assert!(c.validate().is_ok());
    }
}
