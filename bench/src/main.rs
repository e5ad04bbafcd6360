//! `silkbench`: measures silkmesh and prints markdown tables, each beside a floor measured in the
//! same run (these machines are noisy; only ratios within one run mean much).
//!
//! Sections: `agent` (silkd over a unix socket), `verbs` (find, watch, sessions), `engine` (jail
//! starts), `journal`, `node` (warm claim over HTTP, the relay), `fleet` (claim tiers, burst,
//! refill through the SDK), `sdk` (connection reuse), `lifecycle` (hibernate … archive), `memory` (the same keeping
//! processes, beside CRIU run directly), `store`. With no section, all of them (see
//! `all`).

mod agent;
mod all;
mod audit;
mod cluster;
mod e2b;
mod egress;
mod engine;
mod fleet;
mod gossip;
mod journal;
mod lifecycle;
mod load;
mod mcp;
mod memory;
mod mesh;
mod node;
mod registry;
mod report;
mod sdk;
mod stale;
mod store;
mod verbs;

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(about = "silkmesh benchmarks: tables beside same-run floors")]
struct Args {
    /// One section; without one, every section runs in turn.
    #[command(subcommand)]
    section: Option<Section>,
    #[command(flatten)]
    all: all::AllArgs,
}

#[derive(Debug, Subcommand)]
enum Section {
    /// silkd round trips and throughput over a kept unix-socket connection.
    Agent(agent::AgentArgs),
    /// silkd `find` vs grep, `watch` latency vs raw inotify, session exec vs exec round trips.
    Verbs(verbs::VerbsArgs),
    /// Jail clone and cold boot beside unshare + overlay + exec (needs root).
    Engine(engine::EngineArgs),
    /// Claims journal commit time at 100, 1000 and 5000 live claims beside a raw append.
    Journal(journal::JournalArgs),
    /// The audit journal's cost on a call's path.
    Audit(audit::AuditArgs),
    /// Warm claim over HTTP and the relay's overhead, on a throwaway sandboxd (needs root).
    Node(node::NodeArgs),
    /// Claim tiers, a burst of clones and refill recovery through the SDK (needs root).
    Fleet(fleet::FleetArgs),
    /// Hibernate, wake, checkpoint, branch, fork, archive with a 100 MiB tree (needs root).
    Lifecycle(lifecycle::LifecycleArgs),
    /// Hibernate, wake, checkpoint, branch, fork keeping processes (CRIU) beside `criu dump` /
    /// `criu restore` run directly (needs root and CRIU).
    Memory(memory::MemoryArgs),
    /// Redirected vs local claims, forwarded exec, failure detection, gossip volume (needs root).
    Mesh(mesh::MeshArgs),
    /// The membership core simulated at fleet sizes: gossip bytes under churn, how fast a change
    /// spreads, failure detection with loss, no live node declared down over a long run.
    Gossip(gossip::GossipArgs),
    /// Golden fetch vs build, move and wake-anywhere between two nodes (needs root).
    Cluster(cluster::ClusterArgs),
    /// Snapshot put/get on fs and S3 beside cp, dedup ratio, chunking + hashing on one core.
    Store(store::StoreArgs),
    /// A ~100 MB image pulled from a registry on loopback beside `skopeo copy`, and from the
    /// store as a second node does (needs docker-registry and skopeo: scripts/install-test-deps).
    Registry(registry::RegistryArgs),
    /// SDK exec/info round trips: kept relay connection vs one dialled per call (needs root).
    Sdk(sdk::SdkArgs),
    /// The stock e2b Python SDK vs sdk-rs on one node: create → first run, run, 50 MiB files
    /// (needs root and `scripts/e2b-venv`).
    E2b(e2b::E2bArgs),
    /// Lane egress beside floors: warm claims, a 1 MiB GET, connection setup, the ports route
    /// (needs root, nftables, dnsmasq).
    Egress(egress::EgressArgs),
    /// `sandbox_exec` through the MCP server over stdio and HTTP beside sdk-rs (needs root and
    /// the release `sbx`).
    Mcp(mcp::McpArgs),
    /// Mixed load from many clients for a long while: per-window throughput and p50/p99 of
    /// each operation, the node's RSS and fds and their slope (needs root).
    Load(load::LoadArgs),
    /// Internal: the floor's echo server (run as a separate process, like silkd).
    #[command(hide = true)]
    EchoServer { socket: std::path::PathBuf },
}

fn main() -> anyhow::Result<()> {
    let runtime = || tokio::runtime::Builder::new_multi_thread().enable_all().build();
    let args = Args::parse();
    stale::sweep(std::path::Path::new("/var/tmp"));
    let Some(section) = args.section else {
        return all::run(args.all);
    };
    match section {
        Section::Agent(a) => runtime()?.block_on(agent::run(a)),
        Section::Verbs(v) => runtime()?.block_on(verbs::run(v)),
        Section::Sdk(a) => runtime()?.block_on(sdk::run(a)),
        Section::EchoServer { socket } => runtime()?.block_on(agent::echo_server(socket)),
        // Synchronous, like the engine itself.
        Section::Engine(e) => engine::run(e),
        Section::Lifecycle(a) => lifecycle::run(a),
        Section::Memory(a) => memory::run(a),
        Section::Mesh(a) => mesh::run(a),
        Section::Gossip(g) => gossip::run(g),
        Section::Cluster(a) => cluster::run(a),
        Section::Journal(j) => journal::run(j),
        Section::Audit(a) => audit::run(a),
        Section::Node(n) => node::run(n),
        Section::Fleet(f) => runtime()?.block_on(fleet::run(f)),
        Section::Store(s) => store::run(s),
        Section::Registry(r) => registry::run(r),
        Section::E2b(e) => e2b::run(e),
        Section::Egress(e) => egress::run(e),
        Section::Mcp(m) => runtime()?.block_on(mcp::run(m)),
        Section::Load(l) => load::run(l),
    }
}
