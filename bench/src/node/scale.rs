//! The node section's arms at scale, each on a node of its own: a burst of claims from a pool
//! pre-filled to its size, and listing many checkpoints.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use super::{Http, NodeArgs, NodeProc, json, wait_warm_for};
use crate::report::{Samples, table, us};

/// `total` calls of `call` by `clients` threads at once, each on its own kept connection:
/// the wall time and each call's latency.
fn spread(
    addr: SocketAddr,
    clients: usize,
    total: usize,
    call: impl Fn(&mut Http) -> anyhow::Result<()> + Sync,
) -> anyhow::Result<(Duration, Samples)> {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let next = AtomicUsize::new(0);
    let mut conns =
        (0..clients).map(|_| Http::connect(addr)).collect::<anyhow::Result<Vec<_>>>()?;
    let start = std::sync::Barrier::new(clients + 1);
    let (wall, per_client) = std::thread::scope(|scope| {
        let workers: Vec<_> = conns
            .iter_mut()
            .map(|http| {
                let (next, start, call) = (&next, &start, &call);
                scope.spawn(move || -> anyhow::Result<Samples> {
                    let mut took = Samples::default();
                    start.wait();
                    while next.fetch_add(1, Ordering::Relaxed) < total {
                        let t = Instant::now();
                        call(http)?;
                        took.push(t.elapsed());
                    }
                    Ok(took)
                })
            })
            .collect();
        start.wait();
        let t0 = Instant::now();
        let joined: Vec<_> = workers.into_iter().map(|w| w.join()).collect();
        (t0.elapsed(), joined)
    });
    let mut all = Samples::default();
    for joined in per_client {
        all.extend(joined.map_err(|_| anyhow::anyhow!("a client thread panicked"))??);
    }
    Ok((wall, all))
}

/// A burst of claims from a pool pre-filled to the burst's size (disks unbounded: a loop
/// device per sandbox is not what is measured), beside the same number of `GET /healthz`.
pub(super) fn burst(args: &NodeArgs, work: &std::path::Path) -> anyhow::Result<()> {
    let n = args.burst;
    let dir = work.join("burst");
    std::fs::create_dir_all(&dir)?;
    let config = format!(
        "max_claims = 100000\nmax_warm = {n}\n[disk]\nbounded = false\n[[pools]]\n\
         template = \"host\"\nwarm = {n}\nwarm_max = {n}\n"
    );
    let node = NodeProc::start(&args.silkd, &dir, &config)?;
    let mut http = Http::connect(node.addr)?;
    let t = Instant::now();
    wait_warm_for(&mut http, n, Duration::from_secs(600))?;
    let filled = t.elapsed();
    let clients = args.burst_clients;
    let (floor_wall, floor) = spread(node.addr, clients, n, |h| {
        let (status, _) = h.call("GET", "/healthz", "")?;
        anyhow::ensure!(status == 200, "healthz answered {status}");
        Ok(())
    })?;
    let (claims_wall, claims) = spread(node.addr, clients, n, |h| {
        let (status, body) = h.call("POST", "/v1/sandboxes", "{}")?;
        anyhow::ensure!(status == 201, "claim answered {status}: {body}");
        anyhow::ensure!(json(&body)["tier"] == "warm", "not a warm hit: {body}");
        Ok(())
    })?;
    let row = |what: String, wall: Duration, took: &Samples| {
        vec![
            what,
            us(wall),
            format!("{:.0}", n as f64 / wall.as_secs_f64()),
            us(took.pct(0.5)),
            us(took.pct(0.99)),
            format!("{:.2}", wall.as_secs_f64() / floor_wall.as_secs_f64()),
        ]
    };
    table(
        &format!(
            "burst: {n} claims from a pool pre-filled with {n} (filled in {:.1} s), {clients} clients on kept connections",
            filled.as_secs_f64()
        ),
        &["arm", "wall", "per second", "p50", "p99", "wall ratio"],
        &[
            row(format!("{n} × `GET /healthz` (floor)"), floor_wall, &floor),
            row(format!("{n} × `POST /v1/sandboxes`, warm hits"), claims_wall, &claims),
        ],
    );
    Ok(())
}

/// `GET /v1/checkpoints` with `--checkpoints` of them in the store (small ones, written here
/// through the store's own snapshot API), on each build in turn, beside `GET /healthz`.
pub(super) fn listing(args: &NodeArgs, work: &std::path::Path) -> anyhow::Result<()> {
    let n = args.checkpoints;
    let store_dir = work.join("listing-store");
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let t = Instant::now();
    rt.block_on(async {
        let cfg =
            silk_store::fs::FsConfig { fsync: false, ..silk_store::fs::FsConfig::new(&store_dir) };
        let store: std::sync::Arc<dyn silk_store::ObjectStore> =
            std::sync::Arc::new(silk_store::fs::FsStore::open(cfg).await?);
        let snaps = silk_store::SnapshotStore::new(store, Default::default(), None)?;
        for i in 0..n {
            let name = silk_store::SnapshotName::checkpoint(&format!("{i:032x}"))?;
            let meta = [("sandbox", "sb-bench"), ("template", "host"), ("token_hash", "x")]
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .into();
            snaps.put(&name, &b"a small checkpoint"[..], meta).await?;
        }
        anyhow::Ok(())
    })?;
    let filled = t.elapsed();
    let config = format!("[store.fs]\nroot = {store_dir:?}\n");
    let this = std::env::current_exe()?.with_file_name("sandboxd");
    let mut rows = vec![];
    for (name, binary) in
        std::iter::once(("this build", this)).chain(args.baseline.clone().map(|b| ("baseline", b)))
    {
        let dir = work.join(format!("listing-{}", name.replace(' ', "-")));
        std::fs::create_dir_all(&dir)?;
        let node = NodeProc::start_binary(&binary, &args.silkd, &dir, &config)?;
        let mut http = Http::connect(node.addr)?;
        // The first listing after a start reads every manifest; a node that listed before
        // reads only the ones it has not seen (this build), so the two are shown apart.
        let (mut floor, mut first, mut list) =
            (Samples::default(), Samples::default(), Samples::default());
        for i in 0..6 {
            let t = Instant::now();
            http.call("GET", "/healthz", "")?;
            floor.push(t.elapsed());
            let t = Instant::now();
            let (status, body) = http.call("GET", "/v1/checkpoints", "")?;
            if i == 0 { &mut first } else { &mut list }.push(t.elapsed());
            anyhow::ensure!(status == 200, "list answered {status}");
            let listed = json(&body)["checkpoints"].as_array().map_or(0, Vec::len);
            anyhow::ensure!(listed == n, "listed {listed} of {n}");
        }
        rows.push(super::row(&format!("{name}: `GET /healthz` (floor)"), &floor, &floor));
        rows.push(super::row(
            &format!("{name}: first `GET /v1/checkpoints` after its start, {n} listed"),
            &first,
            &floor,
        ));
        rows.push(super::row(
            &format!("{name}: later `GET /v1/checkpoints` (n = 5), {n} listed"),
            &list,
            &floor,
        ));
    }
    table(
        &format!(
            "listing {n} checkpoints in the fs store (written in {:.1} s)",
            filled.as_secs_f64()
        ),
        &["arm", "p50", "p90", "max", "p50 ratio"],
        &rows,
    );
    Ok(())
}
