//! `silkbench`: measures silkmesh and prints markdown tables, each beside a floor measured in the
//! same run (these machines are noisy; only ratios within one run mean much).
//!
//! Sections grow with the system. Today: `agent` (silkd over a unix socket).

mod agent;
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
    /// Internal: the floor's echo server (run as a separate process, like silkd).
    #[command(hide = true)]
    EchoServer { socket: std::path::PathBuf },
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(async {
        match args.section {
            Section::Agent(a) => agent::run(a).await,
            Section::EchoServer { socket } => agent::echo_server(socket).await,
        }
    })
}
