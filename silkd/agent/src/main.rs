//! The `silkd` binary: parses flags, sets up PID 1 duties, and serves until told to stop.

use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use silkd::{ListenAddr, Listener, Options};

/// The silkmesh agent. Serves silk-proto on exactly one listener.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Args {
    /// Listen on a unix socket at this path.
    #[arg(long, conflicts_with_all = ["tcp", "vsock"])]
    unix: Option<PathBuf>,
    /// Listen on a TCP address (development; there is no authentication).
    #[arg(long, conflicts_with = "vsock")]
    tcp: Option<std::net::SocketAddr>,
    /// Listen on this vsock port (inside a VM).
    #[arg(long)]
    vsock: Option<u32>,
    /// Serve an already listening unix socket inherited as this file descriptor.
    #[arg(long, conflicts_with_all = ["unix", "tcp", "vsock"])]
    listen_fd: Option<i32>,
    /// Bytes of output kept per detached process.
    #[arg(long, default_value_t = 1 << 20)]
    ring_bytes: usize,
    /// Milliseconds children get between SIGTERM and SIGKILL at shutdown.
    #[arg(long, default_value_t = 2000)]
    shutdown_grace_ms: u64,
    /// Seconds a shell session may go without a call before it is killed.
    #[arg(long, default_value_t = 30 * 60)]
    session_idle_secs: u64,
    /// Events a `watch` call may have queued for a slow client before it ends with an
    /// overflow error.
    #[arg(long, default_value_t = 16_384)]
    watch_queue: usize,
    /// The git binary (a name looked up in the children's PATH, or a path).
    #[arg(long, default_value = "git")]
    git: String,
    /// An environment variable every command gets (under its request's own), as KEY=VALUE.
    /// Repeatable; the jail engine passes an image template's `Env` here.
    #[arg(long = "env", value_name = "KEY=VALUE")]
    env: Vec<String>,
    /// Working directory for commands whose request names none (an image's `WorkingDir`).
    #[arg(long)]
    default_cwd: Option<String>,
    /// User for commands whose request names none (an image's `User`).
    #[arg(long)]
    default_user: Option<String>,
    /// Working directory that relative paths resolve against.
    #[arg(long)]
    workdir: Option<PathBuf>,
    /// Most bytes silkd's own log (its stderr) may hold when it is a file: past this the file
    /// starts over, so nothing a sandbox makes silkd log fills the host's disk.
    #[arg(long, default_value_t = 4 << 20)]
    log_max_bytes: u64,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if std::process::id() == 1 {
        // As a sandbox's init: processes of the sandbox run with the same ids, so without this
        // they could ptrace silkd, read its memory or reopen its descriptors (its log file on
        // the host among them) through /proc/1/fd. Reset by exec: commands stay dumpable.
        // SAFETY: plain prctl.
        unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) };
    }
    let log = silkd::log::CappedStderr::new(args.log_max_bytes);
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("SILKD_LOG")
                .unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(move || log)
        .init();

    let addr = match (&args.unix, args.tcp, args.vsock) {
        (Some(path), _, _) => ListenAddr::Unix(path.clone()),
        (_, Some(addr), _) => ListenAddr::Tcp(addr),
        (_, _, Some(port)) => ListenAddr::Vsock(port),
        _ => match args.listen_fd {
            Some(fd) => ListenAddr::Fd(fd),
            None => ListenAddr::Unix("/run/silkd.sock".into()),
        },
    };
    if let Some(dir) = &args.workdir {
        std::env::set_current_dir(dir)?;
    }
    // Outside a pid namespace, adopt orphans of our children so the reaper still sees them all.
    // SAFETY: plain prctl.
    if std::process::id() != 1 {
        unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
    }

    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(async {
        let listener = Listener::bind(&addr).await?;
        // The readiness line: supervisors and tests wait for it instead of polling.
        let mut stdout = std::io::stdout().lock();
        writeln!(stdout, "silkd listening on {}", listener.describe())?;
        stdout.flush()?;
        drop(stdout);
        let options = Options {
            ring_bytes: args.ring_bytes,
            shutdown_grace: Duration::from_millis(args.shutdown_grace_ms),
            session_idle: Duration::from_secs(args.session_idle_secs),
            watch_queue: args.watch_queue,
            git: args.git,
            defaults: silkd::Defaults {
                env: args
                    .env
                    .iter()
                    .map(|kv| kv.split_once('=').map(|(k, v)| (k.to_string(), v.to_string())))
                    .collect::<Option<_>>()
                    .ok_or_else(|| anyhow::anyhow!("--env takes KEY=VALUE"))?,
                cwd: args.default_cwd,
                user: args.default_user,
            },
        };
        silkd::run(listener, options, std::future::pending()).await?;
        anyhow::Ok(())
    })?;
    // Do not wait for blocking workers stuck on a client that is gone.
    runtime.shutdown_timeout(Duration::from_millis(100));
    Ok(())
}
