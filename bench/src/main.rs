//! `silkbench`: measures silkmesh and prints markdown tables, each beside a floor measured in the
//! same run (these machines are noisy; only ratios within one run mean much).
//!
//! Sections grow with the system: `agent` (silkd over a unix socket), `verbs` (silkd's find,
//! watch and session verbs), `engine` (jail starts).

mod agent;
mod engine;
mod journal;
mod node;
mod report;
mod verbs;

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(about = "silkmesh benchmarks: tables beside same-run floors")]
struct Args {
    #[command(subcommand)]
    section: Section,
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
    /// Warm claim over HTTP and the relay's overhead, on a throwaway sandboxd (needs root).
    Node(node::NodeArgs),
    /// Internal: the floor's echo server (run as a separate process, like silkd).
    #[command(hide = true)]
    EchoServer { socket: std::path::PathBuf },
}

fn main() -> anyhow::Result<()> {
    let runtime = || tokio::runtime::Builder::new_multi_thread().enable_all().build();
    match Args::parse().section {
        Section::Agent(a) => runtime()?.block_on(agent::run(a)),
        Section::Verbs(v) => runtime()?.block_on(verbs::run(v)),
        Section::EchoServer { socket } => runtime()?.block_on(agent::echo_server(socket)),
        // Synchronous, like the engine itself.
        Section::Engine(e) => engine::run(e),
        Section::Journal(j) => journal::run(j),
        Section::Node(n) => node::run(n),
    }
}
