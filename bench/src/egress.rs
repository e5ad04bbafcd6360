//! The egress section: lane `egress` on a node in a network namespace whose only way out is an
//! upstream namespace (`silk_testkit::netns`), nothing leaving the machine.
//!
//! | measurement | floor beside it |
//! |---|---|
//! | warm claim, lane `egress` | warm claim, lane `none` |
//! | GET of 1 MiB from upstream inside a sandbox (through the guard and proxy; no bandwidth limit) | the same GET from the node's own namespace |
//! | connection setup to an upstream server, connect → its first byte | the same from the node's namespace |
//! | request through the ports route to a server in the sandbox | a new connection to it from inside the sandbox |

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;
use serde_json::json;
use silk_testkit::netns::{Network, PROBE};

use crate::node::{Http, NodeProc, json};
use crate::report::{Samples, host_stamp, ms, table, us};

#[derive(Debug, clap::Args)]
pub struct EgressArgs {
    /// A statically linked silkd (default: $SILKD_STATIC).
    #[arg(long, env = "SILKD_STATIC")]
    silkd: PathBuf,
    /// Warm claims per lane.
    #[arg(long, default_value_t = 40)]
    claims: usize,
    /// GETs, connections and port-route requests per arm.
    #[arg(long, default_value_t = 50)]
    iters: usize,
    #[arg(long, default_value = "/var/tmp")]
    dir: PathBuf,
}

const CONFIG: &str = "max_claims = 1000\n[egress]\ndns = [\"192.0.2.1:53\"]\nsmall_mbit = 0\n\
    default = { allow = [\"allowed.test\", \"hold.test\"] }\n\n\
    [[pools]]\ntemplate = \"host\"\nwarm = 2\nwarm_max = 2\n\n\
    [[pools]]\ntemplate = \"host\"\nlane = \"egress\"\nwarm = 2\nwarm_max = 2\n";

pub fn run(args: EgressArgs) -> anyhow::Result<()> {
    let work = args.dir.join(format!("silkbench-egress-{}", std::process::id()));
    std::fs::create_dir_all(&work)?;
    let net = Network::new(&work.join("udp.log"));
    // This process (and the node it starts) lives in the node's namespace from here on.
    net.enter_node();
    let result = (|| {
        let node = NodeProc::start(&args.silkd, &work, CONFIG)?;
        sections(&args, &node)
    })();
    silk_engine::jail::unmount_under(&work);
    let _ = std::fs::remove_dir_all(&work);
    result
}

fn warm(http: &mut Http) -> anyhow::Result<()> {
    for _ in 0..6000 {
        let (_, info) = http.call("GET", "/v1/info", "")?;
        let pools = json(&info)["pools"].clone();
        if pools.as_array().is_some_and(|p| p.iter().all(|p| p["warm"] == 2 && p["starting"] == 0))
        {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    anyhow::bail!("the pools did not refill")
}

/// Runs the probe's `steps` in a sandbox; its one result per step.
fn probe(
    http: &mut Http,
    id: &str,
    steps: serde_json::Value,
) -> anyhow::Result<Vec<serde_json::Value>> {
    let body = json!({ "argv": ["python3", "-c", PROBE, steps.to_string()] }).to_string();
    let (status, v) = http.call("POST", &format!("/v1/sandboxes/{id}/exec"), &body)?;
    anyhow::ensure!(status == 200, "exec: {v}");
    let out = json(&v)["stdout"].as_str().unwrap_or_default().to_string();
    serde_json::from_str(out.trim()).with_context(|| format!("probe said {out:?}: {v}"))
}

/// The same steps run in the node's own namespace (the floor).
fn probe_here(steps: serde_json::Value) -> anyhow::Result<Vec<serde_json::Value>> {
    let out =
        std::process::Command::new("python3").args(["-c", PROBE, &steps.to_string()]).output()?;
    Ok(serde_json::from_slice(&out.stdout)?)
}

fn samples(v: &serde_json::Value) -> Samples {
    let mut s = Samples::default();
    for x in v.as_array().into_iter().flatten() {
        s.push(Duration::from_secs_f64(x.as_f64().unwrap_or_default()));
    }
    s
}

fn row(what: &str, s: &Samples, floor: &Samples, unit: fn(Duration) -> String) -> Vec<String> {
    let ratio = s.pct(0.5).as_secs_f64() / floor.pct(0.5).as_secs_f64();
    vec![
        what.into(),
        unit(s.pct(0.5)),
        unit(s.pct(0.9)),
        unit(floor.pct(0.5)),
        format!("{ratio:.2}×"),
    ]
}

fn sections(args: &EgressArgs, node: &NodeProc) -> anyhow::Result<()> {
    println!("{}", host_stamp());
    let mut http = Http::connect(node.addr)?;
    warm(&mut http)?;

    // Warm claims, the lanes taking turns, the pools refilled before each (a refill running
    // beside a claim would cost it the CPU).
    let (mut egress, mut none) = (Samples::default(), Samples::default());
    for _ in 0..args.claims {
        for (lane, s) in [("egress", &mut egress), ("none", &mut none)] {
            let t0 = Instant::now();
            let (status, body) =
                http.call("POST", "/v1/sandboxes", &format!("{{\"lane\":\"{lane}\"}}"))?;
            s.push(t0.elapsed());
            let v = json(&body);
            anyhow::ensure!(status == 201 && v["tier"] == "warm", "claim: {body}");
            http.call(
                "DELETE",
                &format!("/v1/sandboxes/{}", v["id"].as_str().unwrap_or_default()),
                "",
            )?;
            warm(&mut http)?;
        }
    }
    let header = ["measurement", "p50", "p90", "floor p50", "ratio"];
    table(
        "Egress: warm claim, request → 201 (kept connection)",
        &header,
        &[row("lane egress (floor: lane none)", &egress, &none, us)],
    );

    // One sandbox for the data path.
    let (_, body) = http.call("POST", "/v1/sandboxes", r#"{"lane":"egress"}"#)?;
    let id = json(&body)["id"].as_str().context("claimed")?.to_string();
    // Resolve once: the address is this sandbox's to reach from then on.
    probe(&mut http, &id, json!([["resolve", "allowed.test"], ["resolve", "hold.test"]]))?;
    let url = "http://198.51.100.10/1m";
    let n = args.iters;
    let inside =
        probe(&mut http, &id, json!([["fetch", url, n], ["greet", "198.51.100.12", 7000, n]]))?;
    let here = probe_here(json!([["fetch", url, n], ["greet", "198.51.100.12", 7000, n]]))?;
    table(
        "Egress: data path from inside a sandbox (floor: the node's own namespace; Python clients both)",
        &header,
        &[
            row("GET 1 MiB from upstream", &samples(&inside[0]), &samples(&here[0]), ms),
            row("connect → first byte", &samples(&inside[1]), &samples(&here[1]), us),
        ],
    );

    // The ports route beside a direct connection to the same server.
    let serve = json!({ "argv": ["sh", "-c", "cd /root && echo hi > x && setsid python3 -m http.server 8000 >/dev/null 2>&1 < /dev/null &"] });
    http.call("POST", &format!("/v1/sandboxes/{id}/exec"), &serve.to_string())?;
    // The floor: the same request from inside the sandbox's network namespace (the node cannot
    // open a connection into the lane: its table drops what a sandbox did not start).
    let pid = std::fs::read_dir(node.work.join("data/engine/boxes"))?
        .flatten()
        .find_map(|e| {
            let b: serde_json::Value =
                serde_json::from_slice(&std::fs::read(e.path().join("box.json")).ok()?).ok()?;
            (b["info"]["id"] == id.as_str()).then(|| b["info"]["pid"].as_u64())?
        })
        .context("the sandbox's pid")?;
    let route = format!("/v1/sandboxes/{id}/ports/8000/x");
    for _ in 0..200 {
        if http.call("GET", &route, "")?.0 == 200 {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut proxied = Samples::default();
    for _ in 0..n {
        let t0 = Instant::now();
        let (status, _) = http.call("GET", &route, "")?;
        proxied.push(t0.elapsed());
        anyhow::ensure!(status == 200, "ports route: {status}");
    }
    let direct = std::thread::scope(|s| s.spawn(|| direct_gets(pid, n)).join())
        .map_err(|_| anyhow::anyhow!("the direct client panicked"))??;
    table(
        "Ports route: GET to a server in the sandbox (floor: a new connection to it from inside the sandbox)",
        &header,
        &[row("through the node's ports route", &proxied, &direct, us)],
    );
    Ok(())
}

/// `n` GETs of `/x` on a new connection each, from a thread inside the network namespace of the
/// process `pid`.
fn direct_gets(pid: u64, n: usize) -> anyhow::Result<Samples> {
    use std::os::fd::AsRawFd;
    let ns = std::fs::File::open(format!("/proc/{pid}/ns/net"))?;
    // SAFETY: setns on this (scoped, short-lived) thread only, with a namespace file just opened.
    anyhow::ensure!(unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } == 0, "setns");
    let mut direct = Samples::default();
    for _ in 0..n {
        let t0 = Instant::now();
        let mut s = TcpStream::connect(("127.0.0.1", 8000))?;
        s.set_nodelay(true)?;
        write!(s, "GET /x HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")?;
        let mut answer = Vec::new();
        s.read_to_end(&mut answer)?;
        direct.push(t0.elapsed());
        anyhow::ensure!(
            answer.starts_with(b"HTTP/1.0 200"),
            "direct: {}",
            String::from_utf8_lossy(&answer)
        );
    }
    Ok(direct)
}
