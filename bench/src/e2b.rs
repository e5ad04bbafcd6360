//! The E2B section: the same work through the stock e2b Python SDK (against the node's E2B
//! listener) and through sdk-rs (the node's own API and relay), on one throwaway sandboxd and
//! warm pool, beside the floor of each client: a bare HTTP request from the same Python
//! process, and the SDK's own `info` round trip.
//!
//! | measurement | both clients |
//! |---|---|
//! | create (warm claim) → first `true` answered; `true` on a live sandbox; write and read of a 50 MiB file | e2b Python SDK 2.63.0 (`scripts/e2b-venv`), sdk-rs |

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;

use crate::node::{NodeProc, TOKEN};
use crate::report::{Samples, host_stamp, ms, table};

#[derive(Debug, clap::Args)]
pub struct E2bArgs {
    /// A statically linked silkd (default: $SILKD_STATIC).
    #[arg(long, env = "SILKD_STATIC")]
    silkd: PathBuf,
    /// The python of a venv with the e2b SDK (scripts/e2b-venv prints it).
    #[arg(long, env = "E2B_PYTHON")]
    python: PathBuf,
    /// Creates (each followed by five runs) per client.
    #[arg(long, default_value_t = 20)]
    iters: usize,
    /// The file written and read.
    #[arg(long, default_value_t = 50)]
    mib: usize,
    #[arg(long, default_value = "/var/tmp")]
    dir: PathBuf,
}

pub fn run(args: E2bArgs) -> anyhow::Result<()> {
    let work = args.dir.join(format!("silkbench-e2b-{}", std::process::id()));
    std::fs::create_dir_all(&work)?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let config = format!(
        "[[pools]]\ntemplate = \"host\"\nwarm = 2\nwarm_max = 2\n[e2b]\nlisten = \"127.0.0.1:{port}\"\n"
    );
    let result = NodeProc::start(&args.silkd, &work, &config).and_then(|node| {
        let python = python_side(&args, port)?;
        let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
        let rust = runtime.block_on(rust_side(&args, &node))?;
        report(&args, &python, &rust);
        Ok(())
    });
    silk_engine::jail::unmount_under(&work);
    let _ = std::fs::remove_dir_all(&work);
    result
}

/// Samples by name (milliseconds).
type Timings = std::collections::BTreeMap<String, Samples>;

fn python_side(args: &E2bArgs, port: u16) -> anyhow::Result<Timings> {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/e2b/sdk_bench.py");
    let url = format!("http://127.0.0.1:{port}");
    let out = std::process::Command::new(&args.python)
        .arg(script)
        .env("E2B_API_URL", &url)
        .env("E2B_SANDBOX_URL", &url)
        .env("E2B_API_KEY", TOKEN)
        .env("NO_PROXY", "127.0.0.1")
        .env("BENCH_ITERS", args.iters.to_string())
        .env("BENCH_MIB", args.mib.to_string())
        .output()
        .context("run the e2b SDK")?;
    anyhow::ensure!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    let mut timings = Timings::new();
    for (name, samples) in v.as_object().context("an object")? {
        let s = timings.entry(name.clone()).or_default();
        for x in samples.as_array().context("samples")? {
            s.push(Duration::from_secs_f64(x.as_f64().unwrap_or(0.0) / 1000.0));
        }
    }
    Ok(timings)
}

async fn rust_side(args: &E2bArgs, node: &NodeProc) -> anyhow::Result<Timings> {
    let client = silkmesh::Client::builder(format!("http://{}", node.addr)).token(TOKEN).build()?;
    let mut t = Timings::new();
    let mut push = |name: &str, d: Duration| t.entry(name.to_string()).or_default().push(d);
    for _ in 0..args.iters {
        let t0 = Instant::now();
        let s = client.claim("host").ttl(Duration::from_secs(120)).send().await?;
        s.run(["true"]).await?;
        push("create_first_run", t0.elapsed());
        for _ in 0..5 {
            let t0 = Instant::now();
            s.run(["true"]).await?;
            push("run", t0.elapsed());
        }
        for _ in 0..5 {
            let t0 = Instant::now();
            client.info().await?;
            push("floor", t0.elapsed());
        }
        s.release().await?;
    }
    let s = client.claim("host").ttl(Duration::from_secs(300)).send().await?;
    let blob = bytes::Bytes::from(vec![7u8; args.mib << 20]);
    for _ in 0..3 {
        let t0 = Instant::now();
        s.write("/root/blob", blob.clone()).await?;
        push("write", t0.elapsed());
        let t0 = Instant::now();
        let got = s.read("/root/blob").await?;
        push("read", t0.elapsed());
        anyhow::ensure!(got.len() == blob.len(), "read back {} bytes", got.len());
    }
    s.release().await?;
    Ok(t)
}

fn report(args: &E2bArgs, python: &Timings, rust: &Timings) {
    println!("## e2b (the stock Python SDK vs sdk-rs, one node)\n\n{}", host_stamp());
    let rows = [
        ("floor", "the client's floor: a bare HTTP request (Python) / `info` (sdk-rs)"),
        ("create_first_run", "create (warm claim) → first `true` answered"),
        ("run", "`true` on a live sandbox"),
        ("write", &format!("write {} MiB", args.mib)),
        ("read", &format!("read {} MiB", args.mib)),
    ];
    let mut out = vec![];
    for (key, name) in rows {
        let (p, r) = (python.get(key), rust.get(key));
        let p50 = |s: Option<&Samples>| s.map_or(Duration::ZERO, |s| s.pct(0.5));
        let ratio = p50(p).as_secs_f64() / p50(r).as_secs_f64().max(1e-9);
        out.push(vec![name.to_string(), ms(p50(p)), ms(p50(r)), format!("{ratio:.2}")]);
    }
    table(
        &format!("e2b Python SDK vs sdk-rs (p50; {} creates, 5 runs each)", args.iters),
        &["work", "e2b Python SDK", "sdk-rs", "Python / Rust"],
        &out,
    );
}
