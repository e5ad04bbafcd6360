//! The cluster section: what the shared store costs and saves between nodes.
//!
//! | measurement | floor beside it |
//! |---|---|
//! | golden: fetch from the store and install vs build (boot, warmup, freeze) | — (the two arms are each other's reference) |
//! | move a sandbox with a written tree to another node | `tar` of an equal tree to a file + sync |
//! | wake an archive on another node after its node died | the same floor |

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use silk_engine::jail::{JailConfig, JailEngine};
use silk_engine::{Engine, TemplateDef, Warmup};

use crate::lifecycle::{exec, tar_floor, timed, tree};
use crate::node::{Http, NodeProc};
use crate::report::{Samples, host_stamp, ms, table};

#[derive(Debug, clap::Args)]
pub struct ClusterArgs {
    /// A statically linked silkd (default: $SILKD_STATIC).
    #[arg(long, env = "SILKD_STATIC")]
    silkd: PathBuf,
    #[arg(long, default_value_t = 5)]
    iters: usize,
    /// The written tree, in 1 MiB files.
    #[arg(long, default_value_t = 100)]
    tree_mib: usize,
    /// What the process of the sandbox moved with its memory holds, in MiB.
    #[arg(long, default_value_t = 256)]
    memory_mib: usize,
    /// The CRIU binary for that move's floor.
    #[arg(long, default_value = "/usr/local/sbin/criu")]
    criu: PathBuf,
    #[arg(long, default_value = "/var/tmp")]
    dir: PathBuf,
}

pub fn run(args: ClusterArgs) -> anyhow::Result<()> {
    let work = args.dir.join(format!("silkbench-cluster-{}", std::process::id()));
    std::fs::create_dir_all(&work)?;
    let result = measure(&args, &work);
    // Disk images of sandboxes a killed node left are still mounted.
    silk_engine::jail::unmount_under(&work);
    let _ = std::fs::remove_dir_all(&work);
    result
}

fn measure(args: &ClusterArgs, work: &Path) -> anyhow::Result<()> {
    println!("## cluster (two nodes sharing a local-directory store)\n\n{}", host_stamp());
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let exe = std::env::current_exe()?;

    // 1. A golden: built (boot + warmup writing the tree + freeze) vs fetched from the store.
    let (mut build, mut fetch) = (Samples::default(), Samples::default());
    let store = rt.block_on(silk_store::fs::FsStore::open(silk_store::fs::FsConfig::new(
        work.join("store"),
    )))?;
    let store = std::sync::Arc::new(store);
    let snapshots =
        silk_store::SnapshotStore::new(store, silk_store::SnapshotConfig::default(), None)?;
    for i in 0..args.iters {
        let engine = |n: &str| {
            JailEngine::new(JailConfig::new(
                work.join(format!("{n}-{i}")),
                &args.silkd,
                exe.with_file_name("silk-jail"),
            ))
        };
        let (a, b) = (engine("a")?, engine("b")?);
        let def = TemplateDef::host();
        let (ta, tb) = (a.template(&def)?, b.template(&def)?);
        // The round number makes every warmup (so every golden) new.
        let warmup = Warmup {
            argv: vec![
                "sh".into(),
                "-c".into(),
                format!("{}; echo {i} > /etc/round", tree(args.tree_mib)),
            ],
            timeout: Duration::from_secs(300),
            memory: false,
        };
        let t = Instant::now();
        let g = a.prepare(&ta, &warmup)?;
        build.push(t.elapsed());
        let name = silk_store::SnapshotName::golden("host", g.digest.as_str())?;
        let tar = work.join("golden.tar");
        a.export_golden(&g, &tar)?;
        rt.block_on(async {
            let f = tokio::fs::File::open(&tar).await?;
            snapshots.put(&name, f, Default::default()).await?;
            anyhow::Ok(())
        })?;
        std::fs::remove_file(&tar)?;
        let t = Instant::now();
        let down = work.join("golden-down.tar");
        rt.block_on(async {
            let mut f = tokio::fs::File::create(&down).await?;
            snapshots.get(&name, &mut f).await?;
            anyhow::Ok(())
        })?;
        let got = b.import_golden(&tb, &g.digest, &down)?;
        fetch.push(t.elapsed());
        ensure!(got.digest == g.digest);
        std::fs::remove_file(&down)?;
        for e in [&a, &b] {
            for x in e.list()? {
                let _ = e.destroy(&x.id);
            }
        }
        std::fs::remove_dir_all(work.join(format!("a-{i}")))?;
        std::fs::remove_dir_all(work.join(format!("b-{i}")))?;
    }
    table(
        &format!("golden with a {} MiB warmup result (n = {})", args.tree_mib, build.len()),
        &["arm", "p50", "max", "ratio"],
        &[
            vec![
                "build: boot, warmup, freeze".into(),
                ms(build.pct(0.5)),
                ms(build.pct(1.0)),
                "1.00".into(),
            ],
            vec![
                "fetch from the store and install".into(),
                ms(fetch.pct(0.5)),
                ms(fetch.pct(1.0)),
                format!("{:.2}", fetch.pct(0.5).as_secs_f64() / build.pct(0.5).as_secs_f64()),
            ],
        ],
    );

    // 2 and 3: two meshed nodes sharing the store.
    let certs = work.join("certs");
    let sandboxd = exe.with_file_name("sandboxd");
    let cmd = |args: &[&str]| std::process::Command::new(&sandboxd).args(args).output();
    ensure!(
        cmd(&["mesh", "ca", "init", "--dir", certs.to_str().context("path")?])?.status.success()
    );
    let node = |name: &str, port: u16, join: u16| -> anyhow::Result<NodeProc> {
        ensure!(
            cmd(&[
                "mesh",
                "cert",
                "issue",
                "--dir",
                certs.to_str().context("path")?,
                "--node",
                name
            ])?
            .status
            .success()
        );
        let dir = work.join(name);
        std::fs::create_dir_all(&dir)?;
        let d = certs.display();
        NodeProc::start(
            &args.silkd,
            &dir,
            &format!(
                "[[pools]]\ntemplate = \"host\"\nwarm = 1\nwarm_max = 1\n[store.fs]\nroot = \"{}\"\n[mesh]\nname = \"{name}\"\nlisten = \"127.0.0.1:{port}\"\njoin = [\"127.0.0.1:{join}\"]\nca = \"{d}/ca.pem\"\ncert = \"{d}/{name}.pem\"\nkey = \"{d}/{name}.key\"\n",
                work.join("shared").display()
            ),
        )
    };
    let free = || silk_mesh::free_port(std::net::Ipv4Addr::LOCALHOST.into());
    let (pa, pb) = (free()?, free()?);
    let a = node("a", pa, pb)?;
    let b = node("b", pb, pa)?;
    let (mut ha, mut hb) = (Http::connect(a.addr)?, Http::connect(b.addr)?);
    let meshed = |h: &mut Http| -> anyhow::Result<bool> {
        let (_, v) = timed(h, "GET", "/v1/info", "", 200)?;
        Ok(v["mesh"]["peers"] == 1)
    };
    for _ in 0..2000 {
        if meshed(&mut ha)? && meshed(&mut hb)? {
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let mut floors = Samples::default();
    let mut moves = Samples::default();
    for i in 0..args.iters {
        floors.push(tar_floor(work, args.tree_mib)?);
        let (src, dst) = if i % 2 == 0 { (&mut ha, "b") } else { (&mut hb, "a") };
        let (_, c) = timed(src, "POST", "/v1/sandboxes?no_redirect=1", "{}", 201)?;
        let id = c["id"].as_str().context("id")?.to_string();
        exec(src, &id, &tree(args.tree_mib))?;
        let (d, v) = timed(
            src,
            "POST",
            &format!("/v1/sandboxes/{id}/move"),
            // Files only, as the tar floor (a node with CRIU would keep memory by default).
            &format!(r#"{{"to": "{dst}", "memory": "off"}}"#),
            200,
        )?;
        ensure!(v["node"] == dst, "{v}");
        moves.push(d);
        let other = if dst == "b" { &mut hb } else { &mut ha };
        timed(other, "DELETE", &format!("/v1/sandboxes/{id}?no_redirect=1"), "", 204)?;
    }
    let memory_moves = memory_moves(args, work, &mut ha, &mut hb)?;
    drop(a);

    // 3. Wake on b an archive whose node (a fresh `c` each round) died.
    let mut wakes = Samples::default();
    for i in 0..args.iters {
        let pc = free()?;
        let c = node(&format!("c{i}"), pc, pb)?;
        let mut hc = Http::connect(c.addr)?;
        for _ in 0..2000 {
            if meshed(&mut hc)? {
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let (_, s) = timed(&mut hc, "POST", "/v1/sandboxes?no_redirect=1", "{}", 201)?;
        let id = s["id"].as_str().context("id")?.to_string();
        exec(&mut hc, &id, &tree(args.tree_mib))?;
        timed(&mut hc, "POST", &format!("/v1/sandboxes/{id}/archive"), "", 200)?;
        drop(hc);
        drop(c); // kill -9
        // b must no longer see c before it will wake the archive itself.
        for _ in 0..2000 {
            let (_, v) = timed(&mut hb, "GET", "/v1/info", "", 200)?;
            if v["mesh"]["peers"] == 0 {
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let (d, row) = timed(&mut hb, "POST", &format!("/v1/sandboxes/{id}/wake"), "", 200)?;
        ensure!(row["state"] == "claimed", "{row}");
        wakes.push(d);
        timed(&mut hb, "DELETE", &format!("/v1/sandboxes/{id}"), "", 204)?;
    }
    let ratio =
        |s: &Samples| format!("{:.2}", s.pct(0.5).as_secs_f64() / floors.pct(0.5).as_secs_f64());
    table(
        &format!(
            "between nodes, a sandbox with a {} MiB written tree (n = {})",
            args.tree_mib,
            moves.len()
        ),
        &["operation", "p50", "max", "p50 / floor"],
        &[
            vec![
                format!("`tar` {} MiB to a file + sync (floor)", args.tree_mib),
                ms(floors.pct(0.5)),
                ms(floors.pct(1.0)),
                "1.00".into(),
            ],
            vec![
                "move to the other node".into(),
                ms(moves.pct(0.5)),
                ms(moves.pct(1.0)),
                ratio(&moves),
            ],
            vec![
                "wake on another node an archive whose node died".into(),
                ms(wakes.pct(0.5)),
                ms(wakes.pct(1.0)),
                ratio(&wakes),
            ],
        ],
    );
    drop(b);
    if let Some((floors, moves)) = memory_moves {
        table(
            &format!(
                "a move keeping memory: a process holding {} MiB (n = {})",
                args.memory_mib,
                moves.len()
            ),
            &["operation", "p50", "max", "p50 / floor"],
            &[
                vec![
                    "`criu dump` + `criu restore` of an equal tree on the host (floor)".into(),
                    ms(floors.pct(0.5)),
                    ms(floors.pct(1.0)),
                    "1.00".into(),
                ],
                vec![
                    "move to the other node, memory required".into(),
                    ms(moves.pct(0.5)),
                    ms(moves.pct(1.0)),
                    format!("{:.2}", moves.pct(0.5).as_secs_f64() / floors.pct(0.5).as_secs_f64()),
                ],
            ],
        );
    }
    Ok(())
}

/// Moves of a sandbox whose process holds `args.memory_mib` MiB, its memory kept, both ways,
/// beside CRIU dumping and restoring an equal tree on the host: the same processes carried
/// with no jail, no network and no node around them. `None` without CRIU.
fn memory_moves(
    args: &ClusterArgs,
    work: &Path,
    ha: &mut Http,
    hb: &mut Http,
) -> anyhow::Result<Option<(Samples, Samples)>> {
    if !args.criu.is_file() {
        println!("(no move keeping memory: {} is not there)\n", args.criu.display());
        return Ok(None);
    }
    let [_, (_, script, ready)] = crate::memory::kinds(args.memory_mib);
    // Still running, wherever it is: not only the files it left. (The pattern does not match
    // this script's own command line.)
    let alive = "for p in /proc/[0-9]*; do grep -q 'bytearra[y]' $p/cmdline 2>/dev/null && \
                 exit 0; done; exit 1";
    let (mut floors, mut moves) = (Samples::default(), Samples::default());
    for i in 0..args.iters {
        let (dump, restore) = crate::memory::criu_floor(&args.criu, work, &script, ready)?;
        floors.push(dump + restore);
        let (src, dst, to) =
            if i % 2 == 0 { (&mut *ha, &mut *hb, "b") } else { (&mut *hb, &mut *ha, "a") };
        let medium = r#"{"size": "medium"}"#;
        let (_, c) = timed(src, "POST", "/v1/sandboxes?no_redirect=1", medium, 201)?;
        let id = c["id"].as_str().context("id")?.to_string();
        exec(src, &id, &script)?;
        exec(src, &id, &crate::memory::until_ready(ready))?;
        let (d, v) = timed(
            src,
            "POST",
            &format!("/v1/sandboxes/{id}/move"),
            &format!(r#"{{"to": "{to}", "memory": "required"}}"#),
            200,
        )?;
        ensure!(v["node"] == to && v["memory_snapshot"] == true, "{v}");
        moves.push(d);
        exec(dst, &id, alive).context("the moved process")?;
        timed(dst, "DELETE", &format!("/v1/sandboxes/{id}?no_redirect=1"), "", 204)?;
    }
    Ok(Some((floors, moves)))
}
