//! The fleet section, measured through the SDK as a user would: claim tiers (request → a handle
//! whose silkd answered `info`; a clone both right after a warm claim and on a quiet node), a
//! burst of concurrent clone claims, and refill recovery after a drained pool. Floors,
//! interleaved A B B A with the measured arm: one loopback HTTP round trip for claims, and
//! `unshare` of the same namespaces + overlay mount + `/bin/true` for clones.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;
use silkmesh::{Client, Size, Tier};

use crate::node::{Http, NodeProc};
use crate::report::{Samples, host_stamp, table, us};

#[derive(Debug, clap::Args)]
pub struct FleetArgs {
    /// A statically linked silkd (default: $SILKD_STATIC).
    #[arg(long, env = "SILKD_STATIC")]
    pub silkd: PathBuf,
    /// Claims per tier.
    #[arg(long, default_value_t = 40)]
    pub claims: usize,
    /// Concurrent clone claims in the burst.
    #[arg(long, default_value_t = 8)]
    pub burst: usize,
    /// Warm target of the pool (also the refill-recovery size).
    #[arg(long, default_value_t = 6)]
    pub warm: usize,
    #[arg(long, default_value = "/var/tmp")]
    pub dir: PathBuf,
}

/// A busybox root filesystem per cold template: cold means "no golden yet", so each cold claim
/// needs a template nobody claimed before.
fn cold_templates(dir: &std::path::Path, n: usize) -> anyhow::Result<String> {
    let mut toml = String::new();
    for i in 0..n {
        let root = dir.join(format!("cold{i}"));
        for d in ["bin", "etc", "tmp", "proc", "dev", "run", "root"] {
            std::fs::create_dir_all(root.join(d))?;
        }
        std::fs::copy("/bin/busybox", root.join("bin/busybox"))
            .context("busybox-static is needed for cold templates")?;
        std::os::unix::fs::symlink("busybox", root.join("bin/sh"))?;
        std::fs::write(root.join("etc/passwd"), "root:x:0:0:root:/root:/bin/sh\n")?;
        toml.push_str(&format!("[templates.cold{i}]\ndir = \"{}\"\n", root.display()));
    }
    Ok(toml)
}

pub async fn run(args: FleetArgs) -> anyhow::Result<()> {
    let work = args.dir.join(format!("silkbench-fleet-{}", std::process::id()));
    std::fs::create_dir_all(&work)?;
    let templates = cold_templates(&work, args.claims)?;
    let config = format!(
        "max_claims = 100000\n[[pools]]\ntemplate = \"host\"\nwarm = {w}\nwarm_max = {w}\n{templates}",
        w = args.warm
    );
    let node = NodeProc::start(&args.silkd, &work, &config)?;
    let result = sections(&args, &node, &work).await;
    drop(node);
    // Disk images of sandboxes a killed node left are still mounted.
    silk_engine::jail::unmount_under(&work);
    let _ = std::fs::remove_dir_all(&work);
    result
}

async fn claim_ready(
    client: &Client,
    template: &str,
    size: Size,
) -> anyhow::Result<(Duration, Tier, silkmesh::Sandbox)> {
    let (parts, tier, sb) = claim_parts(client, template, size, Ask::InClaim).await?;
    Ok((parts.total, tier, sb))
}

/// Where silkd's first answer after a claim comes from.
#[derive(Clone, Copy, PartialEq)]
enum Ask {
    /// The claim asks for it (`answered(true)`): the node asks silkd before its `101`.
    InClaim,
    /// The claim returns at its `101`; then the handle's first call is an `info`.
    Afterwards,
}

/// Where a claim → silkd's first answer went: the claim's answer in the SDK, the node's own
/// work on it (`claim_micros`), and the first `info` after it (its own call: `Afterwards`;
/// the next call on the claim's connection: `InClaim`, not part of `total`).
struct ClaimParts {
    total: Duration,
    answered: Duration,
    node: Duration,
    first_info: Duration,
}

async fn claim_parts(
    client: &Client,
    template: &str,
    size: Size,
    ask: Ask,
) -> anyhow::Result<(ClaimParts, Tier, silkmesh::Sandbox)> {
    let t = Instant::now();
    let sb = client.claim(template).size(size).answered(ask == Ask::InClaim).send().await?;
    let answered = t.elapsed();
    anyhow::ensure!((ask == Ask::InClaim) == sb.answered().is_some(), "silkd's answer");
    let info = Instant::now();
    sb.agent_info().await?;
    let first_info = info.elapsed();
    let total = if ask == Ask::InClaim { answered } else { t.elapsed() };
    let node = sb.claim_took().unwrap_or_default();
    Ok((ClaimParts { total, answered, node, first_info }, sb.tier(), sb))
}

/// One loopback HTTP round trip on a kept connection: the floor for a warm claim.
fn http_floor(http: &mut Http) -> anyhow::Result<Duration> {
    let t = Instant::now();
    http.call("GET", "/healthz", "")?;
    Ok(t.elapsed())
}

async fn wait_warm(client: &Client, n: usize) -> anyhow::Result<Duration> {
    let t = Instant::now();
    for _ in 0..6000 {
        let info = client.info().await?;
        if info.pools.first().is_some_and(|p| p.warm == n as u64 && p.starting == 0) {
            return Ok(t.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    anyhow::bail!("pool never refilled to {n}")
}

async fn sections(args: &FleetArgs, node: &NodeProc, work: &std::path::Path) -> anyhow::Result<()> {
    println!("## fleet (through the SDK)\n\n{}, engine jail", host_stamp());
    let client =
        Client::builder(format!("http://{}", node.addr)).token(crate::node::TOKEN).build()?;
    wait_warm(&client, args.warm).await?;
    let mut http = Http::connect(node.addr)?;

    // Tiers, A B B A with the HTTP floor.
    let (mut floor, mut warm, mut clone, mut cold) =
        (Samples::default(), Samples::default(), Samples::default(), Samples::default());
    let (mut node_work, mut next_info) = (Samples::default(), Samples::default());
    let (mut warm_after, mut answered, mut first_info) =
        (Samples::default(), Samples::default(), Samples::default());
    let (mut clone_node, mut clone_around, mut clone_info) =
        (Samples::default(), Samples::default(), Samples::default());
    let mut keep = vec![];
    for round in 0..args.claims {
        // A warm claim of each kind, on a full pool, in alternating order.
        for ask in if round % 2 == 0 {
            [Ask::InClaim, Ask::Afterwards]
        } else {
            [Ask::Afterwards, Ask::InClaim]
        } {
            wait_warm(&client, args.warm).await?;
            floor.push(http_floor(&mut http)?);
            let (parts, tier, sb) = claim_parts(&client, "host", Size::Small, ask).await?;
            anyhow::ensure!(tier == Tier::Warm, "expected a warm hit");
            if ask == Ask::InClaim {
                warm.push(parts.total);
                node_work.push(parts.node);
                next_info.push(parts.first_info);
            } else {
                warm_after.push(parts.total);
                answered.push(parts.answered);
                first_info.push(parts.first_info);
            }
            keep.push(sb);
        }
        // Medium has no pool: the host golden serves it, the clone tier.
        let (parts, tier, sb) = claim_parts(&client, "host", Size::Medium, Ask::InClaim).await?;
        anyhow::ensure!(tier == Tier::Clone, "expected a clone");
        clone.push(parts.total);
        clone_node.push(parts.node);
        clone_around.push(parts.answered.saturating_sub(parts.node));
        clone_info.push(parts.first_info);
        keep.push(sb);
        floor.push(http_floor(&mut http)?);
        for sb in keep.drain(..) {
            sb.release().await?;
        }
    }
    // A pool miss on a quiet node, as a first claim of a size without a pool meets it: the arm
    // above claims its clone right after a warm claim, beside that claim's refill and the last
    // round's teardowns.
    let mut quiet_clone = Samples::default();
    for _ in 0..args.claims {
        wait_warm(&client, args.warm).await?;
        tokio::time::sleep(Duration::from_millis(200)).await;
        let (d, tier, sb) = claim_ready(&client, "host", Size::Medium).await?;
        anyhow::ensure!(tier == Tier::Clone, "expected a clone");
        quiet_clone.push(d);
        sb.release().await?;
    }
    // Cold claims last: each one starts a golden build in the background (so the next claim of
    // its template clones), which would load the machine under the warm and clone arms.
    for i in 0..args.claims {
        let (d, tier, sb) = claim_ready(&client, &format!("cold{i}"), Size::Small).await?;
        anyhow::ensure!(tier == Tier::Cold, "expected a cold boot");
        cold.push(d);
        sb.release().await?;
    }
    let scratch = work.join("floor");
    let template = node.work.join("data/engine/templates");
    let host_root = std::fs::read_dir(&template)?
        .flatten()
        .find(|e| e.file_name().to_string_lossy().starts_with("host-"))
        .map(|e| e.path().join("root"))
        .context("host template not materialised")?;
    let mut unshare = Samples::default();
    for i in 0..args.claims.min(50) {
        unshare.push(crate::engine::floor_once(&scratch.join(i.to_string()), &host_root)?);
    }
    let ratio = |s: &Samples, f: &Samples| s.pct(0.5).as_secs_f64() / f.pct(0.5).as_secs_f64();
    let row = |name: &str, s: &Samples, f: &Samples| {
        vec![
            name.into(),
            us(s.pct(0.5)),
            us(s.pct(0.9)),
            us(s.pct(1.0)),
            s.len().to_string(),
            format!("{:.2}", ratio(s, f)),
        ]
    };
    table(
        "claim tiers: SDK request → handle whose silkd answered `info`",
        &["arm", "p50", "p90", "max", "n", "p50 ratio to its floor"],
        &[
            row("loopback HTTP round trip (floor for warm)", &floor, &floor),
            row("warm hit (the claim asks silkd: `answered(true)`)", &warm, &floor),
            row("warm hit, then a first `info` call", &warm_after, &floor),
            row("unshare 6 ns + overlay + /bin/true (floor for clone, cold)", &unshare, &unshare),
            row("clone from golden, right after a warm claim", &clone, &unshare),
            row("clone from golden, 0.2 s after the node went quiet", &quiet_clone, &unshare),
            row("cold boot from template", &cold, &unshare),
        ],
    );

    let part = |name: &str, s: &Samples| {
        vec![name.into(), us(s.pct(0.5)), us(s.pct(0.9)), format!("{:.2}", ratio(s, &floor))]
    };
    table(
        "warm hit through the SDK, in parts",
        &["part", "p50", "p90", "p50 ratio to the HTTP round trip"],
        &[
            part("asking in the claim: the node's claim (`claim_micros`)", &node_work),
            part("… the next `info` on the claim's connection (not in the claim)", &next_info),
            part("then a first `info` call: the claim's `101`", &answered),
            part("… the first `info` on the claim's connection", &first_info),
        ],
    );
    table(
        "clone right after a warm claim, in parts",
        &["part", "p50", "p90", "p50 ratio to the HTTP round trip"],
        &[
            part("the node's claim (`claim_micros`: the engine's clone, the journal)", &clone_node),
            part(
                "the rest of the claim's answer (HTTP, the relay opened, silkd's `info`, the `101`)",
                &clone_around,
            ),
            part("the next `info` on the claim's connection (not in the claim)", &clone_info),
        ],
    );

    // Time to first command: claim → `true` answered, a warm pool, an idle gap before each (as
    // a user's agent starts a task). Floor: `true` on a sandbox whose relay connection is open,
    // and one HTTP round trip.
    let (mut first, mut exec_floor, mut rtt) =
        (Samples::default(), Samples::default(), Samples::default());
    let kept = client.claim("host").send().await?;
    kept.run(["true"]).await?;
    for _ in 0..args.claims {
        wait_warm(&client, args.warm).await?;
        tokio::time::sleep(Duration::from_millis(50)).await;
        rtt.push(http_floor(&mut http)?);
        let t = Instant::now();
        kept.run(["true"]).await?;
        exec_floor.push(t.elapsed());
        let t = Instant::now();
        let sb = client.claim("host").send().await?;
        anyhow::ensure!(sb.tier() == Tier::Warm, "expected a warm hit");
        sb.run(["true"]).await?;
        first.push(t.elapsed());
        sb.release().await?;
    }
    kept.release().await?;
    let floor = rtt.pct(0.5) + exec_floor.pct(0.5);
    let ratio = |s: &Samples| format!("{:.2}", s.pct(0.5).as_secs_f64() / floor.as_secs_f64());
    table(
        "time to first command: SDK claim → `run([\"true\"])` answered, warm pool, 50 ms idle before each",
        &["arm", "p50", "p90", "max", "p50 ratio to RTT + exec"],
        &[
            vec![
                "HTTP round trip".into(),
                us(rtt.pct(0.5)),
                us(rtt.pct(0.9)),
                us(rtt.pct(1.0)),
                "".into(),
            ],
            vec![
                "`run([\"true\"])` on an open sandbox (exec floor)".into(),
                us(exec_floor.pct(0.5)),
                us(exec_floor.pct(0.9)),
                us(exec_floor.pct(1.0)),
                "".into(),
            ],
            vec![
                "claim → first `run([\"true\"])` answered".into(),
                us(first.pct(0.5)),
                us(first.pct(0.9)),
                us(first.pct(1.0)),
                ratio(&first),
            ],
        ],
    );

    // Burst of concurrent clones.
    let t = Instant::now();
    // Collected, so every claim is under way before the first is awaited (a lazy `map` would
    // spawn each only when the one before it had finished: a sequence, not a burst).
    let claims: Vec<_> = (0..args.burst)
        .map(|_| {
            let client = client.clone();
            tokio::spawn(async move { claim_ready(&client, "host", Size::Medium).await })
        })
        .collect();
    let mut per = Samples::default();
    let mut made = vec![];
    for c in claims {
        let (d, _, sb) = c.await??;
        per.push(d);
        made.push(sb);
    }
    let wall = t.elapsed();
    for sb in made {
        sb.release().await?;
    }
    // What the cores could do at best, from this run's clone p50: the claims split over them,
    // with a fifth for the rest (issue 23's goal).
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as u32;
    let bound = clone.pct(0.5) * args.burst as u32 / cores * 6 / 5;
    table(
        &format!("burst of {} concurrent clone claims", args.burst),
        &[
            "per claim p50",
            "per claim p90",
            "wall",
            "burst × clone p50 / cores × 1.2",
            "wall / that",
        ],
        &[vec![
            us(per.pct(0.5)),
            us(per.pct(0.9)),
            us(wall),
            us(bound),
            format!("{:.2}", wall.as_secs_f64() / bound.as_secs_f64()),
        ]],
    );

    // Refill recovery: drain the pool, time until it is back at target.
    wait_warm(&client, args.warm).await?;
    let mut drained = vec![];
    for _ in 0..args.warm {
        drained.push(client.claim("host").send().await?);
    }
    let recovery = wait_warm(&client, args.warm).await?;
    for sb in drained {
        sb.release().await?;
    }
    table(
        &format!("refill recovery: pool of {} drained to 0", args.warm),
        &["time back to target", "per sandbox"],
        &[vec![us(recovery), us(recovery / args.warm as u32)]],
    );
    Ok(())
}
