//! `sbx`: silkmesh sandboxes from the command line, built on the SDK.
//!
//! Output is for people by default and JSON with `--json`. The node's address and root token
//! come from `--addr`/`--token` or `SBX_ADDR`/`SBX_TOKEN`; commands on one sandbox use
//! `--sandbox-token`/`SBX_SANDBOX_TOKEN` when given, else the root token.
//!
//! Exit status: `exec`, `run` and `shell` pass the remote program's code through (128 + signal
//! when it was killed); when sbx itself fails they exit 125 (as `docker run` does), other
//! commands exit 1.

mod cp;
mod exec;
mod lifecycle;
mod term;

use exec::{exec, shell};

use std::io::Write;
use std::process::ExitCode;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use serde_json::json;
use silkmesh::{Client, EgressPolicy, Lane, Sandbox, SandboxInfo, Size};

/// silkmesh sandboxes from the command line.
#[derive(Debug, Parser)]
#[command(name = "sbx", version)]
struct Cli {
    /// The node's API address.
    #[arg(long, env = "SBX_ADDR", default_value = "http://127.0.0.1:7777", global = true)]
    addr: String,
    /// The node's root API token.
    #[arg(long, env = "SBX_TOKEN", hide_env_values = true, global = true)]
    token: Option<String>,
    /// For an https:// address: a PEM file of the CA certificates to trust instead of the
    /// system's.
    #[arg(long, env = "SBX_CA", global = true)]
    ca: Option<std::path::PathBuf>,
    /// A client certificate (PEM) for nodes that require one; with --key.
    #[arg(long, env = "SBX_CERT", global = true, requires = "key")]
    cert: Option<std::path::PathBuf>,
    /// The client certificate's key (PEM).
    #[arg(long, env = "SBX_KEY", global = true, requires = "cert")]
    key: Option<std::path::PathBuf>,
    /// Print JSON for scripts instead of text for people.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: Cmd,
}

/// A sandbox id and the token to use for it.
#[derive(Debug, Args)]
struct Target {
    /// The sandbox id.
    id: String,
    #[command(flatten)]
    token: SandboxToken,
}

#[derive(Debug, Args)]
struct SandboxToken {
    /// The sandbox's own token (printed by `sbx claim`); default: the root token.
    #[arg(long, env = "SBX_SANDBOX_TOKEN", hide_env_values = true)]
    sandbox_token: Option<String>,
}

#[derive(Debug, Args)]
struct ClaimOpts {
    /// Template to claim from.
    #[arg(long, default_value = "host")]
    template: String,
    /// Size tier: small, medium or large.
    #[arg(long)]
    size: Option<Size>,
    /// Lease in seconds (default: the node's).
    #[arg(long)]
    ttl: Option<u64>,
    /// A metadata label, `key=value` (repeatable).
    #[arg(long = "label", value_parser = key_value)]
    labels: Vec<(String, String)>,
    /// Network lane: none (loopback only) or egress.
    #[arg(long)]
    lane: Option<Lane>,
    /// Lane egress: a name (`*.suffix`, `*`) or IPv4 network it may reach (repeatable; narrows
    /// the pool's policy). Implies --lane egress.
    #[arg(long)]
    allow: Vec<String>,
    /// Lane egress: a name or network it may not reach (repeatable).
    #[arg(long)]
    deny: Vec<String>,
}

#[derive(Debug, Args)]
struct ExecOpts {
    /// Forward this terminal's stdin to the command.
    #[arg(short = 'i', long)]
    interactive: bool,
    /// Working directory inside the sandbox.
    #[arg(long)]
    cwd: Option<String>,
    /// An environment variable, `KEY=value` (repeatable).
    #[arg(long = "env", short = 'e', value_parser = key_value)]
    env: Vec<(String, String)>,
    /// Run as this user of the sandbox.
    #[arg(long)]
    user: Option<String>,
    /// Kill the command after this many seconds.
    #[arg(long)]
    timeout: Option<u64>,
    /// The command and its arguments, after `--`.
    #[arg(last = true, required = true)]
    command: Vec<String>,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Claim a sandbox; prints its id and token.
    Claim(ClaimOpts),
    /// List live sandboxes.
    Ls {
        /// Only sandboxes with this label, `key=value` (repeatable).
        #[arg(long = "label", value_parser = key_value)]
        labels: Vec<(String, String)>,
    },
    /// Release (destroy) a sandbox.
    Rm(Target),
    /// Run a command in a sandbox, streaming its output; its exit code is sbx's.
    Exec {
        #[command(flatten)]
        target: Target,
        #[command(flatten)]
        opts: ExecOpts,
    },
    /// Claim a sandbox, run one command in it, release it (also on failure or Ctrl-C).
    Run {
        #[command(flatten)]
        claim: ClaimOpts,
        #[command(flatten)]
        opts: ExecOpts,
    },
    /// An interactive shell (or `-- CMD...`) on a terminal in the sandbox.
    Shell {
        #[command(flatten)]
        target: Target,
        /// The program to run instead of /bin/sh.
        #[arg(last = true)]
        command: Vec<String>,
    },
    /// Copy files or directories; one side is `ID:/path`.
    Cp {
        src: String,
        dst: String,
        #[command(flatten)]
        token: SandboxToken,
    },
    /// The node: version, engine, claims, pools (every node's with --fleet).
    Info {
        /// Every node of the fleet, one line each.
        #[arg(long)]
        fleet: bool,
    },
    /// The warm pool configuration.
    Pools,
    /// Print a preview URL of a port: a browser opens it without the sandbox token.
    Open {
        #[command(flatten)]
        target: Target,
        port: u16,
        /// How long it works, in seconds (default an hour, at most a day).
        #[arg(long)]
        ttl: Option<u64>,
    },
    /// Forward local port LOCAL (on 127.0.0.1) to REMOTE inside the sandbox until Ctrl-C.
    PortForward {
        #[command(flatten)]
        target: Target,
        /// `LOCAL:REMOTE` (LOCAL 0 picks a free port), or REMOTE for the same local port.
        ports: String,
    },
    /// An MCP server on stdin/stdout: every sandbox verb as a tool, for agent frameworks and
    /// coding assistants (docs/mcp.md). Sandboxes it creates are renewed while it runs and
    /// released when it ends, unless created with `keep`.
    Mcp,
    #[command(flatten)]
    Lifecycle(lifecycle::Lifecycle),
}

fn key_value(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .filter(|(k, _)| !k.is_empty())
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .ok_or_else(|| format!("{s:?} is not key=value"))
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime =
        match tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build() {
            Ok(rt) => rt,
            Err(e) => {
                eprintln!("sbx: cannot start the runtime: {e}");
                return ExitCode::from(1);
            }
        };
    let passes_code = matches!(cli.command, Cmd::Exec { .. } | Cmd::Run { .. } | Cmd::Shell { .. });
    let code = runtime.block_on(dispatch(cli)).unwrap_or_else(|e| {
        eprintln!("sbx: {e:#}");
        if passes_code { 125 } else { 1 }
    });
    let _ = std::io::stdout().flush();
    // Exit without waiting for the runtime: a blocking read of stdin (exec -i, shell) would
    // otherwise hold the process open until the user pressed a key.
    std::process::exit(code)
}

fn client(cli: &Cli) -> anyhow::Result<Client> {
    let addr =
        if cli.addr.contains("://") { cli.addr.clone() } else { format!("http://{}", cli.addr) };
    let mut b = Client::builder(addr);
    if let Some(t) = &cli.token {
        b = b.token(t.clone());
    }
    if let Some(ca) = &cli.ca {
        b = b.ca_file(ca);
    }
    if let (Some(cert), Some(key)) = (&cli.cert, &cli.key) {
        b = b.client_cert(cert, key);
    }
    Ok(b.build()?)
}

async fn dispatch(cli: Cli) -> anyhow::Result<i32> {
    let c = client(&cli)?;
    let json = cli.json;
    match cli.command {
        Cmd::Claim(opts) => {
            let sandbox = claim(&c, &opts).await?;
            if json {
                let mut v = serde_json::to_value(sandbox.info())?;
                v["token"] = json!(sandbox.token());
                v["claim_micros"] = json!(sandbox.claim_took().map(|d| d.as_micros() as u64));
                println!("{}", serde_json::to_string_pretty(&v)?);
            } else {
                let info = sandbox.info();
                println!("id:      {}", info.id);
                println!("token:   {}", sandbox.token());
                let took = sandbox
                    .claim_took()
                    .map(|d| format!(" in {:.2} ms", d.as_secs_f64() * 1e3))
                    .unwrap_or_default();
                println!("tier:    {:?}{took}", info.tier);
                println!("expires: {}", expires(info.deadline_ms));
            }
            Ok(0)
        }
        Cmd::Ls { labels } => {
            let filter: Vec<(&str, &str)> =
                labels.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
            let listing = c.listing(&filter).await?;
            let (rows, missing) = (listing.sandboxes, listing.unreachable);
            if json {
                let all = json!({ "sandboxes": rows, "unreachable": missing });
                println!("{}", serde_json::to_string_pretty(&all)?);
            } else {
                print_list(&rows);
            }
            if !missing.is_empty() {
                eprintln!(
                    "sbx: nodes {} did not answer; their sandboxes are missing",
                    missing.join(", ")
                );
            }
            Ok(0)
        }
        Cmd::Rm(t) => {
            let sandbox = c.sandbox(&t.id, t.token.sandbox_token.as_deref()).await?;
            sandbox.release().await?;
            if json {
                println!("{}", json!({ "released": t.id }));
            } else {
                println!("released {}", t.id);
            }
            Ok(0)
        }
        Cmd::Exec { target, opts } => {
            let sandbox = c.sandbox(&target.id, target.token.sandbox_token.as_deref()).await?;
            exec(&sandbox, &opts, json).await
        }
        Cmd::Run { claim: claim_opts, opts } => run(&c, &claim_opts, &opts, json).await,
        Cmd::Mcp => {
            use tokio::signal::unix::{SignalKind, signal};
            let (mut int, mut term) =
                (signal(SignalKind::interrupt())?, signal(SignalKind::terminate())?);
            let session = silkmesh::mcp::Session::new(c.clone());
            let renewing = session.keep_alive(Duration::from_secs(15));
            let tools = silkmesh::mcp::Tools::new(c.clone(), Some(session.clone()));
            // The client closing stdin, or asking the server to stop (SIGTERM, Ctrl-C): either
            // way what it created goes with it.
            let served = tokio::select! {
                served = silkmesh::mcp::serve_stdio(tools) => served,
                _ = int.recv() => Ok(()),
                _ = term.recv() => Ok(()),
            };
            renewing.abort();
            let released = session.close().await;
            if !released.is_empty() {
                eprintln!("sbx mcp: released {}", released.join(" "));
            }
            served?;
            Ok(0)
        }
        Cmd::Open { target, port, ttl } => {
            let sandbox = c.sandbox(&target.id, target.token.sandbox_token.as_deref()).await?;
            let preview = sandbox.preview(port, ttl.map(Duration::from_secs)).await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&preview)?);
            } else {
                println!("{}", preview.url);
            }
            Ok(0)
        }
        Cmd::PortForward { target, ports } => {
            let (local, remote) = match ports.split_once(':') {
                Some((l, r)) => (l.parse()?, r.parse()?),
                None => (ports.parse()?, ports.parse()?),
            };
            let sandbox = c.sandbox(&target.id, target.token.sandbox_token.as_deref()).await?;
            let forward = sandbox.forward(remote, local).await?;
            // Listening for Ctrl-C before saying it ends the forward: a SIGINT sent as soon as
            // the line appears (a script's) must end it cleanly, not kill the process.
            use tokio::signal::unix::{SignalKind, signal};
            let mut int = signal(SignalKind::interrupt())?;
            eprintln!(
                "forwarding {} -> {}:{remote} (Ctrl-C ends it)",
                forward.local_addr(),
                target.id
            );
            int.recv().await;
            Ok(0)
        }
        Cmd::Shell { target, command } => {
            let sandbox = c.sandbox(&target.id, target.token.sandbox_token.as_deref()).await?;
            shell(&sandbox, command).await
        }
        Cmd::Cp { src, dst, token } => {
            let moved = cp::run(&c, token.sandbox_token.as_deref(), &src, &dst).await?;
            if json {
                println!("{}", json!({ "src": src, "dst": dst, "tar_bytes": moved }));
            }
            Ok(0)
        }
        Cmd::Info { fleet: true } => {
            let view = c.fleet().await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&view)?);
            } else {
                let rows: Vec<Vec<String>> = view
                    .nodes
                    .iter()
                    .map(|n| {
                        let warm: u64 = n.pools.iter().map(|p| p.warm).sum();
                        vec![
                            n.name.clone(),
                            n.version.clone(),
                            format!("{} of {}", n.claims, n.max_claims),
                            warm.to_string(),
                            if n.draining { "draining".into() } else { "ok".into() },
                            duration(Duration::from_millis(n.uptime_ms)),
                        ]
                    })
                    .collect();
                table(&["NODE", "VERSION", "CLAIMS", "WARM", "STATE", "UPTIME"], &rows);
            }
            if !view.unreachable.is_empty() {
                eprintln!("sbx: nodes {} did not answer", view.unreachable.join(", "));
            }
            Ok(0)
        }
        Cmd::Info { fleet: false } => {
            let info = c.info().await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&info)?);
            } else {
                println!("node:     silkmesh {} (engine {})", info.version, info.engine);
                println!("claims:   {} of {}", info.claims, info.max_claims);
                println!("draining: {}", if info.draining { "yes" } else { "no" });
                println!("uptime:   {}", duration(Duration::from_millis(info.uptime_ms)));
                let caps = &info.capabilities;
                let memory = match caps["memory_snapshot"].as_bool() {
                    Some(true) => "kept (hibernate, checkpoint, fork, move, archive)".to_string(),
                    _ => format!("files only: {}", caps["memory_note"].as_str().unwrap_or("-")),
                };
                println!("memory:   {memory}");
                let rows: Vec<Vec<String>> = info
                    .pools
                    .iter()
                    .map(|p| {
                        vec![
                            p.template.clone(),
                            p.size.to_string(),
                            p.lane.to_string(),
                            p.warm.to_string(),
                            p.starting.to_string(),
                            p.target.to_string(),
                            if p.backing_off { "backing off".into() } else { "ok".into() },
                        ]
                    })
                    .collect();
                println!();
                table(&["TEMPLATE", "SIZE", "LANE", "WARM", "STARTING", "TARGET", "STATE"], &rows);
            }
            Ok(0)
        }
        Cmd::Lifecycle(cmd) => lifecycle::run(&c, cmd, json).await,
        Cmd::Pools => {
            let pools = c.pools().await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&json!({ "pools": pools }))?);
            } else {
                let rows: Vec<Vec<String>> = pools
                    .iter()
                    .map(|p| {
                        vec![
                            p.template.clone(),
                            p.size.to_string(),
                            p.lane.to_string(),
                            p.warm.to_string(),
                            p.warm_max.map_or("-".into(), |m| m.to_string()),
                        ]
                    })
                    .collect();
                table(&["TEMPLATE", "SIZE", "LANE", "WARM", "WARM_MAX"], &rows);
            }
            Ok(0)
        }
    }
}

async fn claim(c: &Client, opts: &ClaimOpts) -> anyhow::Result<Sandbox> {
    let mut b = c.claim(&opts.template);
    if let Some(size) = opts.size {
        b = b.size(size);
    }
    if let Some(ttl) = opts.ttl {
        b = b.ttl(Duration::from_secs(ttl));
    }
    for (k, v) in &opts.labels {
        b = b.metadata(k, v);
    }
    if let Some(lane) = opts.lane {
        b = b.lane(lane);
    }
    if !opts.allow.is_empty() || !opts.deny.is_empty() {
        b = b.egress(EgressPolicy { allow: opts.allow.clone(), deny: opts.deny.clone() });
    }
    Ok(b.send().await?)
}

/// `sbx run`: claim, exec, release. The release happens whatever the exec did, and on Ctrl-C or
/// SIGTERM (the command is killed first: dropping its connection makes silkd kill it).
async fn run(
    c: &Client,
    claim_opts: &ClaimOpts,
    opts: &ExecOpts,
    json: bool,
) -> anyhow::Result<i32> {
    use tokio::signal::unix::{SignalKind, signal};
    // Listening before the claim: a Ctrl-C while it is under way is held until the claim
    // answered, and then releases what it got instead of leaking it until its lease ends.
    let mut int = signal(SignalKind::interrupt())?;
    let mut term = signal(SignalKind::terminate())?;
    let sandbox = claim(c, claim_opts).await?;
    let outcome = tokio::select! {
        biased;
        _ = int.recv() => Ok(130),
        _ = term.recv() => Ok(143),
        r = exec(&sandbox, opts, json) => r,
    };
    let released = sandbox.release().await;
    let code = outcome?;
    released.with_context(|| format!("release {}", sandbox.id()))?;
    Ok(code)
}

fn expires(deadline_ms: u64) -> String {
    let now = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
    if deadline_ms <= now {
        "now".into()
    } else {
        format!("in {}", duration(Duration::from_millis(deadline_ms - now)))
    }
}

fn duration(d: Duration) -> String {
    let s = d.as_secs();
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m{:02}s", s / 60, s % 60),
        _ => format!("{}h{:02}m", s / 3600, (s % 3600) / 60),
    }
}

fn print_list(rows: &[SandboxInfo]) {
    let rows: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            let labels: Vec<String> = r.metadata.iter().map(|(k, v)| format!("{k}={v}")).collect();
            vec![
                r.id.clone(),
                r.template.clone(),
                r.size.to_string(),
                r.tier.to_string(),
                r.state.to_string(),
                expires(r.deadline_ms),
                labels.join(","),
            ]
        })
        .collect();
    table(&["ID", "TEMPLATE", "SIZE", "TIER", "STATE", "EXPIRES", "LABELS"], &rows);
}

/// Columns padded to their widest cell.
fn table(header: &[&str], rows: &[Vec<String>]) {
    let mut width: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for row in rows {
        for (w, cell) in width.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: Vec<&str>| {
        let padded: Vec<String> =
            cells.iter().zip(&width).map(|(c, w)| format!("{c:<w$}")).collect();
        println!("{}", padded.join("  ").trim_end());
    };
    line(header.to_vec());
    for row in rows {
        line(row.iter().map(String::as_str).collect());
    }
}
