//! The gossip section: the membership core at fleet sizes no test machine runs as processes,
//! in the deterministic simulation (`silk_mesh::sim`): the bytes each node sends while every
//! node's state changes and some nodes flap, how fast a change reaches every node, how fast a
//! killed node leaves every view under packet loss, and whether a live node is ever declared
//! down over a long run.
//!
//! | measurement | beside it |
//! |---|---|
//! | bytes sent per node per second under churn | the same churn with state re-sent to every peer every second (the design before) |
//! | state change → held by every node (p50/p99/max) | the goal (2 s) |
//! | kill → gone from every live view, with loss | the goal (5 s) |

use std::time::{Duration, Instant};

use anyhow::ensure;
use silk_mesh::NodeState;
use silk_mesh::core::{StateChange, StateMessage};
use silk_mesh::sim::{Sim, SimConfig};

use crate::report::{host_stamp, table};

#[derive(Debug, clap::Args)]
pub struct GossipArgs {
    /// Simulated nodes.
    #[arg(long, default_value_t = 500)]
    nodes: usize,
    /// Virtual seconds of churn per arm.
    #[arg(long, default_value_t = 120)]
    churn_seconds: u64,
    /// Virtual minutes of the long run (no live node may be declared down).
    #[arg(long, default_value_t = 10)]
    minutes: u64,
    /// Nodes killed one after another for the failure-detection figure.
    #[arg(long, default_value_t = 5)]
    kills: usize,
}

const S: fn(u64) -> Duration = Duration::from_secs;

fn converged(cfg: SimConfig) -> anyhow::Result<Sim> {
    let nodes = cfg.nodes;
    let mut sim = Sim::new(cfg);
    let took = sim.run_until_true(S(600), Sim::converged);
    ensure!(took.is_some(), "{nodes} simulated nodes did not converge in 600 s");
    Ok(sim)
}

fn ms(d: Duration) -> String {
    format!("{} ms", d.as_millis())
}

pub fn run(args: GossipArgs) -> anyhow::Result<()> {
    let n = args.nodes;
    let flapping = (n / 100).max(1);
    println!("\n## gossip (the membership core, simulated)\n\n{}", host_stamp());

    // 0. What each kind of state message weighs, for the simulated node's record.
    let sim = converged(SimConfig::new(2))?;
    let me = sim.node(0).me().clone();
    let next = NodeState { seq: me.seq + 1, claims: me.claims + 1, ..me.clone() };
    let size = StateMessage::wire_len;
    table(
        "state messages on the wire (a record with two pools, a golden, a template, a tenant)",
        &["message", "bytes"],
        &[
            vec![
                "the whole record (`Full`)".into(),
                size(&StateMessage::Full(me.clone())).to_string(),
            ],
            vec![
                "a count changed (`Change`)".into(),
                size(&StateMessage::Change(StateChange::between(&me, &next))).to_string(),
            ],
            vec![
                "the version alone (a refresh)".into(),
                size(&StateMessage::Change(StateChange::between(&me, &me))).to_string(),
            ],
        ],
    );

    // 1. Churn: every node's state changes every 30 s, 1 % of nodes flap.
    let mut rows = vec![];
    // The design before sends N² states a second: simulating it is slow, and its rate steady,
    // so its arm runs 20 virtual seconds.
    let before = args.churn_seconds.min(20);
    for (arm, full_every, loss, seconds) in [
        (
            "before: the whole state to every peer at each change and every second",
            Some(S(1)),
            0.0,
            before,
        ),
        (
            "this build: changed fields at each change, the version every 30 s",
            None,
            0.0,
            args.churn_seconds,
        ),
        ("this build, 5 % packet loss", None, 0.05, args.churn_seconds),
    ] {
        let wall = Instant::now();
        let mut sim = converged(SimConfig { loss, ..SimConfig::new(n) })?;
        sim.set_full_every(full_every);
        let r = sim.churn(S(seconds), S(30), flapping);
        rows.push(vec![
            format!("{arm} ({seconds} s)"),
            format!("{:.0}", r.bytes_per_node_s),
            format!("{:.0}", r.state_bytes_per_node_s),
            format!("{:.0}", r.bytes_per_node_s - r.state_bytes_per_node_s),
            ms(r.spread_pct(0.5)),
            ms(r.spread_pct(0.99)),
            ms(r.spread_pct(1.0)),
            format!("{} / {}", r.unspread, r.spread.len() + r.unspread),
            r.false_downs.to_string(),
            format!("{:.0} s", wall.elapsed().as_secs_f64()),
        ]);
    }
    table(
        &format!(
            "{n} nodes, every state changing every 30 s, {flapping} flapping (down 5 s of every 30)"
        ),
        &[
            "arm",
            "bytes / node / s",
            "of it state",
            "of it SWIM",
            "change spread p50",
            "p99",
            "max",
            "not spread",
            "live nodes declared down",
            "wall",
        ],
        &rows,
    );

    // 2. Failure detection with 5 % loss: kill a node, wait until no live node lists it.
    let mut sim = converged(SimConfig { loss: 0.05, seed: 11, ..SimConfig::new(n) })?;
    let mut took = vec![];
    for k in 0..args.kills {
        let victim = n - 1 - k * 7;
        let name = format!("n{victim}");
        sim.kill(victim);
        let gone = sim.run_until_true(S(30), |sim| {
            (0..n).filter(|&i| sim.alive(i)).all(|i| sim.node(i).peer(&name).is_none())
        });
        took.push(gone.ok_or_else(|| anyhow::anyhow!("{name} still listed 30 s after its kill"))?);
        let t = sim.now();
        sim.run_until(t + S(5));
    }
    took.sort_unstable();
    table(
        &format!(
            "{n} nodes, 5 % packet loss: kill → gone from every live view (n = {})",
            took.len()
        ),
        &["p50", "max", "goal"],
        &[vec![ms(took[took.len() / 2]), ms(took[took.len() - 1]), "5000 ms".into()]],
    );

    // 3. A long run with loss: no live node is ever declared down.
    let wall = Instant::now();
    let mut sim = converged(SimConfig { loss: 0.05, seed: 5, ..SimConfig::new(n) })?;
    let r = sim.churn(S(args.minutes * 60), S(30), 0);
    table(
        &format!("{n} nodes, 5 % packet loss, {} virtual minutes", args.minutes),
        &["live nodes declared down", "changes not spread", "bytes / node / s", "wall"],
        &[vec![
            r.false_downs.to_string(),
            r.unspread.to_string(),
            format!("{:.0}", r.bytes_per_node_s),
            format!("{:.0} s", wall.elapsed().as_secs_f64()),
        ]],
    );
    Ok(())
}
