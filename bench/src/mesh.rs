//! The mesh section: throwaway sandboxd processes in one mesh on loopback, and the membership
//! core in simulation for cluster sizes no test machine runs as processes.
//!
//! | measurement | floor beside it |
//! |---|---|
//! | claim on a node with an empty pool → `307` → warm claim on the peer | the same warm claim asked of the peer directly, and `GET /healthz` (one HTTP round trip) |
//! | buffered exec through a forward-mode node | the same exec on the owner |
//! | failure detection: `kill -9` of a node → gone from a peer's `/v1/peers` | the configured bound (suspicion + probe period) |
//! | gossip bytes per node per second, real 3-node mesh and simulated 3/20 nodes | — |
//! | 100 MiB between two mesh endpoints on the bulk lane (TLS over TCP): wall and CPU | the same on a QUIC stream |

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use silk_mesh::sim::{Sim, SimConfig};

use crate::node::{Http, NodeProc};
use crate::report::{Samples, host_stamp, ms, table, us};

#[derive(Debug, clap::Args)]
pub struct MeshArgs {
    /// A statically linked silkd (default: $SILKD_STATIC).
    #[arg(long, env = "SILKD_STATIC")]
    silkd: PathBuf,
    /// Claims per arm.
    #[arg(long, default_value_t = 100)]
    claims: usize,
    /// Exec round trips per arm.
    #[arg(long, default_value_t = 200)]
    execs: usize,
    /// Nodes killed for the failure-detection figure.
    #[arg(long, default_value_t = 20)]
    kills: usize,
    #[arg(long, default_value = "/var/tmp")]
    dir: PathBuf,
}

fn json(body: &str) -> serde_json::Value {
    serde_json::from_str(body).unwrap_or_default()
}

fn sandboxd(args: &[&str]) -> anyhow::Result<()> {
    let exe = std::env::current_exe()?.with_file_name("sandboxd");
    let out = std::process::Command::new(exe).args(args).output()?;
    ensure!(out.status.success(), "sandboxd {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    Ok(())
}

fn mesh_toml(certs: &Path, name: &str, join: Option<&str>, forward: bool) -> String {
    let d = certs.display();
    let join = join.map(|j| format!("join = [\"{j}\"]\n")).unwrap_or_default();
    format!(
        "[mesh]\nname = \"{name}\"\nlisten = \"127.0.0.1:0\"\n{join}forward = {forward}\nca = \"{d}/ca.pem\"\ncert = \"{d}/{name}.pem\"\nkey = \"{d}/{name}.key\"\n"
    )
}

fn start(
    args: &MeshArgs,
    work: &Path,
    certs: &Path,
    name: &str,
    pools: &str,
    join: Option<&str>,
    forward: bool,
) -> anyhow::Result<NodeProc> {
    let dir = work.join(name);
    std::fs::create_dir_all(&dir)?;
    sandboxd(&["mesh", "cert", "issue", "--dir", certs.to_str().context("path")?, "--node", name])?;
    NodeProc::start(
        &args.silkd,
        &dir,
        &format!("max_claims = 100000\n{pools}{}", mesh_toml(certs, name, join, forward)),
    )
}

fn peers(http: &mut Http) -> anyhow::Result<serde_json::Value> {
    let (status, body) = http.call("GET", "/v1/peers", "")?;
    ensure!(status == 200, "/v1/peers: {status} {body}");
    Ok(json(&body))
}

fn until(
    what: &str,
    limit: Duration,
    mut cond: impl FnMut() -> anyhow::Result<bool>,
) -> anyhow::Result<Duration> {
    let t = Instant::now();
    while !cond()? {
        if t.elapsed() > limit {
            bail!("timed out waiting for {what}");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    Ok(t.elapsed())
}

fn mesh_addr(http: &mut Http) -> anyhow::Result<String> {
    let (_, info) = http.call("GET", "/v1/info", "")?;
    Ok(json(&info)["mesh"]["addr"].as_str().context("mesh addr")?.to_string())
}

pub fn run(args: MeshArgs) -> anyhow::Result<()> {
    let work = args.dir.join(format!("silkbench-mesh-{}", std::process::id()));
    let certs = work.join("certs");
    std::fs::create_dir_all(&work)?;
    let result = sandboxd(&["mesh", "ca", "init", "--dir", certs.to_str().context("path")?])
        .and_then(|()| measure(&args, &work, &certs));
    // Disk images of sandboxes a killed node left are still mounted.
    silk_engine::jail::unmount_under(&work);
    let _ = std::fs::remove_dir_all(&work);
    result
}

fn measure(args: &MeshArgs, work: &Path, certs: &Path) -> anyhow::Result<()> {
    println!("## mesh (sandboxd processes on loopback, QUIC + mutual TLS)\n\n{}", host_stamp());
    let pool = "[[pools]]\ntemplate = \"host\"\nwarm = 4\nwarm_max = 4\n";
    let a = start(args, work, certs, "a", pool, None, false)?;
    let mut ha = Http::connect(a.addr)?;
    let seed = mesh_addr(&mut ha)?;
    let b = start(args, work, certs, "b", "pools = []\n", Some(&seed), false)?;
    let f = start(args, work, certs, "f", "pools = []\n", Some(&seed), true)?;
    let (mut hb, mut hf) = (Http::connect(b.addr)?, Http::connect(f.addr)?);
    until("a full mesh", Duration::from_secs(20), || {
        Ok(peers(&mut ha)?["peers"].as_array().map_or(0, Vec::len) == 2
            && peers(&mut hb)?["peers"].as_array().map_or(0, Vec::len) == 2)
    })?;

    // 1. Local warm claim on a vs redirected claim via b (b → 307 → a).
    let warm = |h: &mut Http| -> anyhow::Result<bool> {
        let (_, info) = h.call("GET", "/v1/info", "")?;
        Ok(json(&info)["pools"][0]["warm"] == 4)
    };
    let peer_warm = |h: &mut Http| -> anyhow::Result<bool> {
        Ok(peers(h)?["peers"]
            .as_array()
            .context("peers")?
            .iter()
            .any(|p| p["name"] == "a" && p["warm"]["host/small/none"] == 4))
    };
    let (mut floor, mut local, mut redirected) =
        (Samples::default(), Samples::default(), Samples::default());
    let (mut answer, mut retried) = (Samples::default(), Samples::default());
    let mut held = vec![];
    for _ in 0..args.claims {
        until("a's pool refilled", Duration::from_secs(30), || {
            Ok(warm(&mut ha)? && peer_warm(&mut hb)?)
        })?;
        let t = Instant::now();
        ha.call("GET", "/healthz", "")?;
        floor.push(t.elapsed());
        // a idle for one round trip to b before its claim, as in the redirected arm: an idle
        // node's worker takes tens of µs to wake, and that is not the redirect's cost.
        hb.call("GET", "/healthz", "")?;
        let t = Instant::now();
        let (status, body) = ha.call("POST", "/v1/sandboxes", "{}")?;
        local.push(t.elapsed());
        ensure!(status == 201 && json(&body)["tier"] == "warm", "local claim: {status} {body}");
        held.push(json(&body)["id"].as_str().context("id")?.to_string());
        // The same conditions for both arms: a's pool full, its refill idle.
        until("a's pool refilled", Duration::from_secs(30), || {
            Ok(warm(&mut ha)? && peer_warm(&mut hb)?)
        })?;
        let t = Instant::now();
        let (status, body) = hb.call("POST", "/v1/sandboxes", "{}")?;
        let answered = t.elapsed();
        ensure!(status == 307, "b did not redirect: {status} {body}");
        let (status, body) = ha.call("POST", "/v1/sandboxes?no_redirect=1", "{}")?;
        redirected.push(t.elapsed());
        answer.push(answered);
        retried.push(t.elapsed() - answered);
        ensure!(
            status == 201 && json(&body)["tier"] == "warm",
            "redirected claim: {status} {body}"
        );
        held.push(json(&body)["id"].as_str().context("id")?.to_string());
        for id in held.drain(..) {
            ha.call("DELETE", &format!("/v1/sandboxes/{id}"), "")?;
        }
    }
    let row = |name: &str, s: &Samples| {
        vec![
            name.to_string(),
            us(s.pct(0.5)),
            us(s.pct(0.9)),
            format!("{:.2}", s.pct(0.5).as_secs_f64() / floor.pct(0.5).as_secs_f64()),
        ]
    };
    let extra = redirected.pct(0.5).saturating_sub(local.pct(0.5));
    table(
        &format!(
            "claim placement (n = {}; kept connections; the redirect costs {} more at p50 = {:.2} HTTP round trips)",
            local.len(),
            us(extra),
            extra.as_secs_f64() / floor.pct(0.5).as_secs_f64()
        ),
        &["arm", "p50", "p90", "p50 / RTT"],
        &[
            row("`GET /healthz` round trip (floor)", &floor),
            row("warm claim on the node with the pool", &local),
            row("claim on an empty node → 307 → warm claim on the peer", &redirected),
            row("… of which the empty node's 307 answer", &answer),
            row("… of which the warm claim on the peer", &retried),
        ],
    );

    // 2. Forwarded exec vs direct, on one sandbox of a.
    until("a's pool refilled", Duration::from_secs(30), || warm(&mut ha))?;
    let (_, body) = ha.call("POST", "/v1/sandboxes", "{}")?;
    let id = json(&body)["id"].as_str().context("id")?.to_string();
    let exec = r#"{"argv": ["/bin/true"]}"#;
    let path = format!("/v1/sandboxes/{id}/exec");
    let (mut direct, mut forwarded) = (Samples::default(), Samples::default());
    for i in 0..args.execs + 10 {
        let t = Instant::now();
        let (s1, _) = ha.call("POST", &path, exec)?;
        let d = t.elapsed();
        let t = Instant::now();
        let (s2, body) = hf.call("POST", &path, exec)?;
        let fw = t.elapsed();
        ensure!(s1 == 200 && s2 == 200, "exec: {s1} / {s2} {body}");
        if i >= 10 {
            direct.push(d);
            forwarded.push(fw);
        }
    }
    let rel =
        |s: &Samples| format!("{:.2}", s.pct(0.5).as_secs_f64() / direct.pct(0.5).as_secs_f64());
    table(
        &format!("buffered `exec /bin/true` (n = {})", direct.len()),
        &["arm", "p50", "p90", "ratio"],
        &[
            vec![
                "on the owner (floor)".into(),
                us(direct.pct(0.5)),
                us(direct.pct(0.9)),
                rel(&direct),
            ],
            vec![
                "through a forward-mode node (QUIC lookup + call)".into(),
                us(forwarded.pct(0.5)),
                us(forwarded.pct(0.9)),
                rel(&forwarded),
            ],
        ],
    );
    ha.call("DELETE", &format!("/v1/sandboxes/{id}"), "")?;

    // 3. Gossip volume on the real 3-node mesh over 5 s.
    let sent = |h: &mut Http| -> anyhow::Result<u64> {
        Ok(peers(h)?["gossip_bytes_sent"].as_u64().unwrap_or(0))
    };
    let before = [sent(&mut ha)?, sent(&mut hb)?, sent(&mut hf)?];
    std::thread::sleep(Duration::from_secs(5));
    let after = [sent(&mut ha)?, sent(&mut hb)?, sent(&mut hf)?];
    let real: f64 = after.iter().zip(before).map(|(a, b)| (a - b) as f64).sum::<f64>() / 3.0 / 5.0;

    // 4. Failure detection: start a node, wait until a lists it, kill -9 it, time until a drops it.
    let mut detect = Samples::default();
    for k in 0..args.kills {
        let name = format!("k{k}");
        let victim = start(args, work, certs, &name, "pools = []\n", Some(&seed), false)?;
        until("the victim joined", Duration::from_secs(20), || {
            Ok(peers(&mut ha)?["peers"]
                .as_array()
                .context("peers")?
                .iter()
                .any(|p| p["name"] == name.as_str()))
        })?;
        let t = Instant::now();
        drop(victim); // kill -9, then its jails are cleaned
        until("the victim declared down", Duration::from_secs(20), || {
            Ok(!peers(&mut ha)?["peers"]
                .as_array()
                .context("peers")?
                .iter()
                .any(|p| p["name"] == name.as_str()))
        })?;
        detect.push(t.elapsed());
    }
    table(
        &format!(
            "failure detection, kill -9 → gone from a peer's view (n = {}; probe 500 ms, suspicion 1500 ms)",
            detect.len()
        ),
        &["p50", "p90", "max", "bound"],
        &[vec![
            format!("{:.2} s", detect.pct(0.5).as_secs_f64()),
            format!("{:.2} s", detect.pct(0.9).as_secs_f64()),
            format!("{:.2} s", detect.pct(1.0).as_secs_f64()),
            "5 s".into(),
        ]],
    );

    // 5. Gossip volume, simulated: membership packets plus state pushes, 60 virtual seconds.
    let mut rows = vec![vec!["3 (real processes, 5 s)".to_string(), format!("{:.0}", real)]];
    for n in [3, 20] {
        let mut sim = Sim::new(SimConfig::new(n));
        sim.run_until_true(Duration::from_secs(30), Sim::converged)
            .context("simulated mesh converges")?;
        let (t0, b0): (Duration, u64) = (sim.now(), sim.sent_bytes.iter().sum());
        sim.run_until(t0 + Duration::from_secs(60));
        let b1: u64 = sim.sent_bytes.iter().sum();
        rows.push(vec![
            format!("{n} (simulated, 60 s)"),
            format!("{:.0}", (b1 - b0) as f64 / n as f64 / 60.0),
        ]);
    }
    table(
        "gossip sent per node (SWIM datagrams + state pushes: on change, refresh 30 s)",
        &["nodes", "bytes / node / s"],
        &rows,
    );
    drop((a, b, f));
    bulk_bytes(certs)
}

/// Process CPU time (user + system) so far.
fn cpu_time() -> Duration {
    // SAFETY: getrusage fills the struct it is given.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// A move's transport: 100 MiB from one mesh endpoint to another (both in this process, so
/// the CPU is both ends'), on a QUIC stream and on the bulk lane, rounds alternating.
fn bulk_bytes(certs: &Path) -> anyhow::Result<()> {
    use silk_mesh::{Mesh, MeshConfig, NodeState, TlsFiles, tls, wire};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    const MIB: usize = 100;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    rt.block_on(async {
        let mut nodes = vec![];
        for name in ["p", "q"] {
            let (cert, key) = tls::issue(certs, name, 1)?;
            let files = TlsFiles { ca: certs.join("ca.pem"), cert, key };
            let mut cfg = MeshConfig::new(name, "127.0.0.1:0".parse()?, files);
            cfg.join = nodes.first().map(|(m, _): &(Mesh, _)| vec![m.id().addr]).unwrap_or_default();
            nodes.push(Mesh::start(cfg, NodeState::default()).await?);
        }
        let (q, mut calls) = nodes.pop().context("q")?;
        let (p, _) = nodes.pop().context("p")?;
        // q reads each call to its end and answers how many bytes came.
        tokio::spawn(async move {
            while let Some(mut call) = calls.recv().await {
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 1 << 20];
                    let mut n = 0u64;
                    while let Ok(k @ 1..) = call.recv.read(&mut buf).await {
                        n += k as u64;
                    }
                    let _ = wire::write_frame(&mut call.send, &n).await;
                    let _ = call.send.shutdown().await;
                });
            }
        });
        let deadline = Instant::now() + Duration::from_secs(20);
        while p.peer("q").is_none() {
            ensure!(Instant::now() < deadline, "p and q did not mesh");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let chunk = vec![7u8; 1 << 20];
        let (mut quic, mut bulk) = ([Samples::default(), Samples::default()], [Samples::default(), Samples::default()]);
        for round in 0..10 {
            let (cpu, t) = (cpu_time(), Instant::now());
            let n: Option<u64> = if round % 2 == 0 {
                let (mut send, mut recv) = p.open("q").await?;
                for _ in 0..MIB {
                    send.write_all(&chunk).await?;
                }
                send.finish()?;
                wire::read_frame(&mut recv).await?
            } else {
                let mut call = p.open_bulk("q").await?;
                for _ in 0..MIB {
                    call.write_all(&chunk).await?;
                }
                call.shutdown().await?;
                wire::read_frame(&mut call).await?
            };
            ensure!(n == Some((MIB as u64) << 20), "q read {n:?} bytes");
            let arm = if round % 2 == 0 { &mut quic } else { &mut bulk };
            arm[0].push(t.elapsed());
            arm[1].push(cpu_time() - cpu);
        }
        let row = |name: &str, s: &[Samples; 2]| {
            vec![
                name.to_string(),
                ms(s[0].pct(0.5)),
                format!("{:.0}", MIB as f64 / s[0].pct(0.5).as_secs_f64()),
                ms(s[1].pct(0.5)),
                format!("{:.2}", s[0].pct(0.5).as_secs_f64() / quic[0].pct(0.5).as_secs_f64()),
            ]
        };
        table(
            &format!("{MIB} MiB between two mesh endpoints in one process (n = 5 each, alternating; CPU: both ends)"),
            &["transport", "wall p50", "MiB/s", "CPU p50", "wall / QUIC"],
            &[row("QUIC stream", &quic), row("bulk lane (TLS over TCP)", &bulk)],
        );
        p.leave().await;
        q.leave().await;
        Ok(())
    })
}
