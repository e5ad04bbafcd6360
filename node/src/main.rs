//! The `sandboxd` binary: configuration (file, then environment, then flags), logging, and the
//! server with graceful shutdown on SIGTERM/SIGINT.

use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;

use clap::Parser;
use sandboxd::config::Config;

/// The silkmesh node daemon.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Args {
    /// A TOML config file; every key is optional.
    #[arg(long, env = "SANDBOXD_CONFIG")]
    config: Option<PathBuf>,
    /// HTTP listen address (config `listen`).
    #[arg(long, env = "SANDBOXD_LISTEN")]
    listen: Option<SocketAddr>,
    /// Data directory (config `data_dir`).
    #[arg(long, env = "SANDBOXD_DATA_DIR")]
    data_dir: Option<PathBuf>,
    /// Root API token (config `api_token`).
    #[arg(long, env = "SANDBOXD_API_TOKEN", hide_env_values = true)]
    api_token: Option<String>,
    /// Serve E2B's API on this address (config `[e2b] listen`).
    #[arg(long, env = "SANDBOXD_E2B_LISTEN")]
    e2b_listen: Option<SocketAddr>,
    /// The silkd binary put into sandboxes (config `silkd`).
    #[arg(long, env = "SANDBOXD_SILKD")]
    silkd: Option<PathBuf>,
    /// Print the effective configuration as TOML and exit.
    #[arg(long)]
    print_config: bool,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Debug, clap::Subcommand)]
enum Command {
    /// Mesh certificates.
    Mesh {
        #[command(subcommand)]
        what: MeshCommand,
    },
    /// Certificates for the API's TLS.
    Tls {
        #[command(subcommand)]
        what: TlsCommand,
    },
    /// Removes every sandbox a stopped node left in its data directory (sandboxes outlive
    /// their node by design, for the next start to re-adopt). Run it only once the node has
    /// stopped.
    Clean,
}

#[derive(Debug, clap::Subcommand)]
enum MeshCommand {
    /// The cluster CA.
    Ca {
        #[command(subcommand)]
        what: CaCommand,
    },
    /// Node certificates.
    Cert {
        #[command(subcommand)]
        what: CertCommand,
    },
}

#[derive(Debug, clap::Subcommand)]
enum TlsCommand {
    /// Write a development CA (`ca.pem`, once per DIR) and a certificate it signed for the
    /// names given (`NAME.pem`, `NAME.key` after the first); clients trust `ca.pem`
    /// (`SBX_CA`). For production, use certificates from your own CA.
    SelfSigned {
        #[arg(long)]
        dir: PathBuf,
        /// A DNS name or IP address clients use to reach the node (repeat for more).
        #[arg(long = "name", required = true)]
        names: Vec<String>,
    },
}

#[derive(Debug, clap::Subcommand)]
enum CaCommand {
    /// Create `ca.pem` and `ca.key` in DIR (never overwrites).
    Init {
        #[arg(long)]
        dir: PathBuf,
    },
}

#[derive(Debug, clap::Subcommand)]
enum CertCommand {
    /// Issue `NAME.pem` and `NAME.key` in DIR, signed by DIR's CA (never overwrites); prints
    /// their paths and the certificate's serial.
    Issue {
        #[arg(long)]
        dir: PathBuf,
        /// The node's name (its `mesh.name`).
        #[arg(long)]
        node: String,
        /// Days the certificate is valid.
        #[arg(long, default_value_t = silk_mesh::tls::DEFAULT_DAYS)]
        days: u32,
    },
    /// Replace `NAME.pem` and `NAME.key` with a new certificate (new key, serial and validity);
    /// a running node takes it into use within a second, with no restart.
    Renew {
        #[arg(long)]
        dir: PathBuf,
        #[arg(long)]
        node: String,
        #[arg(long, default_value_t = silk_mesh::tls::DEFAULT_DAYS)]
        days: u32,
    },
}

fn mesh_command(what: MeshCommand) -> anyhow::Result<()> {
    match what {
        MeshCommand::Ca { what: CaCommand::Init { dir } } => {
            let ca = silk_mesh::tls::init_ca(&dir)?;
            println!("{}", ca.display());
        }
        MeshCommand::Cert { what } => {
            let (cert, key) = match what {
                CertCommand::Issue { dir, node, days } => silk_mesh::tls::issue(&dir, &node, days)?,
                CertCommand::Renew { dir, node, days } => silk_mesh::tls::renew(&dir, &node, days)?,
            };
            let serial = silk_mesh::tls::serial_hex(&cert)?;
            println!("{}\n{}\nserial:{serial}", cert.display(), key.display());
        }
    }
    Ok(())
}

fn config(args: &Args) -> anyhow::Result<Config> {
    let mut cfg = match &args.config {
        Some(path) => Config::load(path)?,
        None => Config::default(),
    };
    if let Some(listen) = args.listen {
        cfg.listen = listen;
    }
    if let Some(dir) = &args.data_dir {
        cfg.data_dir = dir.clone();
    }
    if let Some(token) = &args.api_token {
        cfg.api_token = Some(token.clone());
    }
    if let Some(listen) = args.e2b_listen {
        match &mut cfg.e2b {
            Some(e2b) => e2b.listen = listen,
            None => cfg.e2b = Some(sandboxd::config::E2bSection::new(listen)),
        }
    }
    if let Some(silkd) = &args.silkd {
        cfg.silkd = Some(silkd.clone());
    }
    cfg.validate()?;
    Ok(cfg)
}

fn main() -> anyhow::Result<()> {
    // One TLS provider for the process (ring, as quinn uses): the registry client's HTTPS
    // takes the process default.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let mut args = Args::parse();
    let command = args.command.take();
    match command {
        Some(Command::Mesh { what }) => return mesh_command(what),
        Some(Command::Tls { what: TlsCommand::SelfSigned { dir, names } }) => {
            let dev = sandboxd::tls::self_signed(&dir, &names)?;
            println!("[tls]\ncert = {:?}\nkey = {:?}", dev.cert, dev.key);
            println!("# clients: SBX_CA={}", dev.ca.display());
            return Ok(());
        }
        _ => {}
    }
    let cfg = config(&args)?;
    if let Some(Command::Clean) = command {
        let removed = sandboxd::clean(&cfg)?;
        println!("removed {removed} sandboxes from {}", cfg.data_dir.display());
        return Ok(());
    }
    if args.print_config {
        let mut shown = cfg.clone();
        for secret in [&mut shown.api_token, &mut shown.metrics_token] {
            if secret.is_some() {
                *secret = Some("<set>".into());
            }
        }
        print!("{}", toml::to_string_pretty(&shown)?);
        return Ok(());
    }
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("SANDBOXD_LOG")
                .unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind(cfg.listen).await?;
        let addr = listener.local_addr()?;
        // Claims report where they live: the bound address, also when the config said port 0.
        let daemon = sandboxd::start(Config { listen: addr, ..cfg }).await?;
        // The readiness line: scripts and tests wait for it.
        let mut out = std::io::stdout().lock();
        writeln!(out, "sandboxd listening on {addr}")?;
        out.flush()?;
        drop(out);
        sandboxd::serve(daemon, listener, shutdown_signal()).await?;
        anyhow::Ok(())
    })
}

async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) =
        (signal(SignalKind::terminate()), signal(SignalKind::interrupt()))
    else {
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
}
