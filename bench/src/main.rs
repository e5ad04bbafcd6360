//! `silkbench`: measures silkmesh and prints markdown tables, each beside a floor measured in the
//! same run (these machines are noisy; only ratios within one run mean much).
//!
//! Sections grow with the system: `agent` (silkd over a unix socket), `engine` (jail starts).

mod agent;
mod engine;
mod report;

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
    /// Jail clone and cold boot beside unshare + overlay + exec (needs root).
    Engine(engine::EngineArgs),
    /// Internal: the floor's echo server (run as a separate process, like silkd).
    #[command(hide = true)]
    EchoServer { socket: std::path::PathBuf },
}

fn main() -> anyhow::Result<()> {
    let runtime = || tokio::runtime::Builder::new_multi_thread().enable_all().build();
    match Args::parse().section {
        Section::Agent(a) => runtime()?.block_on(agent::run(a)),
        Section::EchoServer { socket } => runtime()?.block_on(agent::echo_server(socket)),
        // Synchronous, like the engine itself.
        Section::Engine(e) => engine::run(e),
    }
}
