//! The SDK section: round trips through `silkmesh-sdk` on a throwaway sandboxd (release build,
//! jail engine), with the handle's relay connections kept and reused vs a new relay connection
//! dialled for every call (TCP connect + `Upgrade: silkd` + 101), in one run with the arms
//! alternating call by call.
//!
//! | measurement | comparison arms |
//! |---|---|
//! | `exec /bin/true` and `info` through the SDK on a kept relay connection (its default) | the same calls with `max_idle_connections(0)` (one dial per call); the floor: the same frames written by hand on a kept upgraded connection, no SDK |

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use silk_proto::{Command, Connection, ExecRequest, Frame};
use silkmesh::{Client, Sandbox};
use tokio::net::TcpStream;

use crate::node::{NodeProc, TOKEN, call, upgrade};
use crate::report::{Samples, host_stamp, table, us};

#[derive(Debug, clap::Args)]
pub struct SdkArgs {
    /// A statically linked silkd (default: $SILKD_STATIC).
    #[arg(long, env = "SILKD_STATIC")]
    silkd: PathBuf,
    /// Timed round trips per arm and call.
    #[arg(long, default_value_t = 1000)]
    iters: usize,
    #[arg(long, default_value = "/var/tmp")]
    dir: PathBuf,
}

const WARMUP: usize = 50;

pub async fn run(args: SdkArgs) -> anyhow::Result<()> {
    let work = args.dir.join(format!("silkbench-sdk-{}", std::process::id()));
    std::fs::create_dir_all(&work)?;
    let config = "[[pools]]\ntemplate = \"host\"\nwarm = 1\nwarm_max = 1\n";
    let result = match NodeProc::start(&args.silkd, &work, config) {
        Ok(node) => measure(&args, node.addr).await,
        Err(e) => Err(e),
    };
    // Disk images of sandboxes a killed node left are still mounted.
    silk_engine::jail::unmount_under(&work);
    let _ = std::fs::remove_dir_all(&work);
    result
}

/// Which call an arm times.
#[derive(Debug, Clone, Copy)]
enum Call {
    Exec,
    Info,
}

async fn once(s: &Sandbox, what: Call) -> anyhow::Result<std::time::Duration> {
    let t = Instant::now();
    match what {
        Call::Exec => {
            let out = s.run(["/bin/true"]).await?;
            anyhow::ensure!(out.success(), "/bin/true failed: {out:?}");
        }
        Call::Info => {
            s.agent_info().await?;
        }
    }
    Ok(t.elapsed())
}

/// The floor: the same call as bare frames on a kept upgraded connection.
async fn raw(conn: &mut Connection<TcpStream>, what: Call) -> anyhow::Result<std::time::Duration> {
    let frame = match what {
        Call::Exec => Frame::Exec(ExecRequest {
            command: Command { argv: vec!["/bin/true".into()], ..Default::default() },
            ..Default::default()
        }),
        Call::Info => Frame::Info,
    };
    let t = Instant::now();
    call(conn, &frame).await?;
    Ok(t.elapsed())
}

async fn measure(args: &SdkArgs, addr: SocketAddr) -> anyhow::Result<()> {
    let url = format!("http://{addr}");
    let kept = Client::builder(&url).token(TOKEN).build()?;
    let dialling = Client::builder(&url).token(TOKEN).max_idle_connections(0).build()?;
    let sandbox = kept.claim("host").send().await?;
    let per_call = dialling.sandbox(sandbox.id(), Some(sandbox.token())).await?;
    println!("## SDK (silkmesh-sdk through the node's relay)\n\n{}", host_stamp());
    let mut floor_conn = upgrade(addr, sandbox.id()).await?;
    let mut rows = vec![];
    for (name, what) in [("`exec /bin/true`", Call::Exec), ("`info`", Call::Info)] {
        let (mut floor, mut reuse, mut dial) =
            (Samples::default(), Samples::default(), Samples::default());
        for i in 0..WARMUP + args.iters {
            // Rotate which arm goes first, so drift and caches favour none of them.
            let (mut f, mut r, mut d) = (None, None, None);
            for arm in 0..3 {
                match (i + arm) % 3 {
                    0 => f = Some(raw(&mut floor_conn, what).await?),
                    1 => r = Some(once(&sandbox, what).await?),
                    _ => d = Some(once(&per_call, what).await?),
                }
            }
            if i >= WARMUP {
                floor.push(f.context("floor")?);
                reuse.push(r.context("reuse")?);
                dial.push(d.context("dial")?);
            }
        }
        let row = |arm: &str, s: &Samples| {
            vec![
                format!("{name} {arm}"),
                us(s.pct(0.5)),
                us(s.pct(0.9)),
                us(s.pct(0.99)),
                us(s.pct(1.0)),
                format!("{:.2}", s.pct(0.5).as_secs_f64() / floor.pct(0.5).as_secs_f64()),
            ]
        };
        rows.push(row("raw frames on a kept relay connection (floor)", &floor));
        rows.push(row("SDK, kept relay connection (reuse)", &reuse));
        rows.push(row("SDK, new relay connection per call", &dial));
    }
    let (k, d) = (sandbox.connection_stats(), per_call.connection_stats());
    table(
        &format!("SDK round trip, reuse vs dial per call (n = {} per arm, rotating)", args.iters),
        &["arm", "p50", "p90", "p99", "max", "p50 vs floor"],
        &rows,
    );
    println!(
        "\nrelay connections dialled: reuse arm {} (reused {}), dial arm {} (reused {})",
        k.dialled, k.reused, d.dialled, d.reused
    );
    anyhow::ensure!(k.dialled == 1 && d.reused == 0, "the arms did not do what they say");
    sandbox.release().await?;
    Ok(())
}
