//! The load section: mixed load from many clients on one throwaway node for a long while, to
//! see whether anything drifts. Each client keeps one to three sandboxes of its own and calls
//! claim, exec, a file write (exec), hibernate, wake, checkpoint and release on them as fast as
//! the node answers. Reported per window: throughput and p50/p99 of each operation, and the
//! node's RSS and open fds; at the end the slope of both (least squares over every sample after
//! the first window) and every answer that was not a success.
//!
//! | measurement | floor beside it |
//! |---|---|
//! | each operation's p50/p99 per window | the same operation in the first window (drift is the ratio) |
//! | RSS and fds over time | their first sample after warm-up (the slope should be flat) |

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::node::{Http, NodeProc, json};
use crate::report::{Samples, host_stamp, ms, table};

#[derive(Debug, clap::Args)]
pub struct LoadArgs {
    /// A statically linked silkd (default: $SILKD_STATIC).
    #[arg(long, env = "SILKD_STATIC")]
    silkd: PathBuf,
    #[arg(long, default_value_t = 30)]
    minutes: u64,
    #[arg(long, default_value_t = 16)]
    clients: usize,
    /// One row of the over-time tables per this many seconds.
    #[arg(long, default_value_t = 300)]
    window_secs: u64,
    #[arg(long, default_value = "/var/tmp")]
    dir: PathBuf,
}

const OPS: [&str; 7] = ["claim", "exec", "write", "hibernate", "wake", "checkpoint", "release"];

/// What the clients saw in one window.
#[derive(Default)]
struct Window {
    /// Successful calls' times, by operation.
    ok: BTreeMap<&'static str, Samples>,
    /// Other answers: (operation, status, error code) → count.
    refused: BTreeMap<(&'static str, u16, String), u64>,
}

pub fn run(args: LoadArgs) -> anyhow::Result<()> {
    let work = args.dir.join(format!("silkbench-load-{}", std::process::id()));
    std::fs::create_dir_all(&work)?;
    let config = "max_claims = 100000\n[[pools]]\ntemplate = \"host\"\nwarm = 8\nwarm_max = 8\n";
    let result = NodeProc::start(&args.silkd, &work, config).and_then(|node| measure(&args, &node));
    silk_engine::jail::unmount_under(&work);
    let _ = std::fs::remove_dir_all(&work);
    result
}

fn measure(args: &LoadArgs, node: &NodeProc) -> anyhow::Result<()> {
    let windows = args.minutes * 60 / args.window_secs.max(1);
    let window = Duration::from_secs(args.window_secs);
    let seen: Arc<Vec<Mutex<Window>>> =
        Arc::new((0..windows.max(1)).map(|_| Mutex::new(Window::default())).collect());
    let start = Instant::now();
    let end = start + window * windows.max(1) as u32;
    let clients: Vec<_> = (0..args.clients)
        .map(|c| {
            let (seen, addr) = (seen.clone(), node.addr);
            std::thread::spawn(move || client(addr, c as u64, start, window, end, &seen))
        })
        .collect();
    // RSS and fds every 10 s.
    let mut usage = vec![];
    while Instant::now() < end {
        let t = start.elapsed().as_secs_f64();
        usage.push((t, rss_kib(node.pid())?, fds(node.pid())?));
        std::thread::sleep(
            Duration::from_secs(10).min(end.saturating_duration_since(Instant::now())),
        );
    }
    for c in clients {
        c.join().map_err(|_| anyhow::anyhow!("a client panicked"))??;
    }
    report(args, &seen, &usage);
    Ok(())
}

fn client(
    addr: std::net::SocketAddr,
    seed: u64,
    start: Instant,
    window: Duration,
    end: Instant,
    seen: &[Mutex<Window>],
) -> anyhow::Result<()> {
    let mut http = Http::connect(addr)?;
    let mut rng = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut next = move |n: u64| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng % n
    };
    let mut mine: Vec<String> = vec![];
    let mut written = 0u64;
    while Instant::now() < end {
        let pick = next(100);
        let (op, method, path, body) = if mine.is_empty() || (pick < 8 && mine.len() < 3) {
            ("claim", "POST", "/v1/sandboxes".to_string(), "{}".to_string())
        } else {
            let id = &mine[next(mine.len() as u64) as usize];
            let base = format!("/v1/sandboxes/{id}");
            match pick {
                0..=44 => {
                    ("exec", "POST", format!("{base}/exec"), argv("cat /root/n 2>/dev/null; true"))
                }
                45..=69 => {
                    written += 1;
                    (
                        "write",
                        "POST",
                        format!("{base}/exec"),
                        argv(&format!("echo {written} > /root/n")),
                    )
                }
                70..=77 => ("hibernate", "POST", format!("{base}/hibernate"), String::new()),
                78..=85 => ("wake", "POST", format!("{base}/wake"), String::new()),
                86..=91 => ("checkpoint", "POST", format!("{base}/checkpoint"), String::new()),
                _ => ("release", "DELETE", base, String::new()),
            }
        };
        let t = Instant::now();
        let (status, answer) = http.call(method, &path, &body)?;
        let took = t.elapsed();
        let w = ((t - start).as_secs_f64() / window.as_secs_f64()) as usize;
        let mut w = seen[w.min(seen.len() - 1)].lock().unwrap_or_else(|p| p.into_inner());
        if (200..300).contains(&status) {
            w.ok.entry(op).or_default().push(took);
        } else {
            let code = json(&answer)["error"]["code"].as_str().unwrap_or("-").to_string();
            *w.refused.entry((op, status, code)).or_default() += 1;
        }
        drop(w);
        match (op, status) {
            ("claim", 201) => mine.push(json(&answer)["id"].as_str().unwrap_or_default().into()),
            ("release", 204) => mine.retain(|id| !path.ends_with(id.as_str())),
            _ => {}
        }
    }
    for id in mine {
        http.call("DELETE", &format!("/v1/sandboxes/{id}"), "")?;
    }
    Ok(())
}

fn argv(script: &str) -> String {
    serde_json::json!({ "argv": ["sh", "-c", script] }).to_string()
}

fn rss_kib(pid: u32) -> anyhow::Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap_or("VmRSS: 0 kB");
    Ok(line.split_whitespace().nth(1).unwrap_or("0").parse()?)
}

fn fds(pid: u32) -> anyhow::Result<u64> {
    Ok(std::fs::read_dir(format!("/proc/{pid}/fd"))?.count() as u64)
}

/// Least-squares slope of `y` over `x`.
fn slope(points: &[(f64, f64)]) -> f64 {
    let n = points.len() as f64;
    let (mx, my) = points.iter().fold((0.0, 0.0), |(a, b), (x, y)| (a + x / n, b + y / n));
    let (num, den) = points
        .iter()
        .fold((0.0, 0.0), |(a, b), (x, y)| (a + (x - mx) * (y - my), b + (x - mx) * (x - mx)));
    if den == 0.0 { 0.0 } else { num / den }
}

fn report(args: &LoadArgs, seen: &[Mutex<Window>], usage: &[(f64, u64, u64)]) {
    println!("## load (sandboxd, jail engine, local store)\n\n{}", host_stamp());
    println!(
        "\n{} clients for {} min; windows of {} s; ratios are to the first window's p50.",
        args.clients, args.minutes, args.window_secs
    );
    let seen: Vec<_> = seen.iter().map(|w| w.lock().unwrap_or_else(|p| p.into_inner())).collect();
    let first = &seen[0];
    let mut rows = vec![];
    for (i, w) in seen.iter().enumerate() {
        let calls: usize = w.ok.values().map(Samples::len).sum();
        let mut row = vec![
            format!("{}–{} s", i as u64 * args.window_secs, (i as u64 + 1) * args.window_secs),
            format!("{:.0}/s", calls as f64 / args.window_secs as f64),
        ];
        for op in OPS {
            row.push(match (w.ok.get(op), first.ok.get(op)) {
                (Some(s), Some(f)) if s.len() > 0 => format!(
                    "{} / {} ({:.2}×)",
                    ms(s.pct(0.5)),
                    ms(s.pct(0.99)),
                    s.pct(0.5).as_secs_f64() / f.pct(0.5).as_secs_f64()
                ),
                _ => "-".into(),
            });
        }
        rows.push(row);
    }
    let mut header = vec!["window", "calls"];
    header.extend(OPS);
    table(
        "per window: successful calls, and p50 / p99 of each operation (ratio to the first window's p50)",
        &header,
        &rows,
    );

    let steady: Vec<_> = usage.iter().filter(|u| u.0 >= args.window_secs as f64).collect();
    let rss: Vec<(f64, f64)> = steady.iter().map(|u| (u.0 / 60.0, u.1 as f64)).collect();
    let fd: Vec<(f64, f64)> = steady.iter().map(|u| (u.0 / 60.0, u.2 as f64)).collect();
    let rows: Vec<Vec<String>> = usage
        .iter()
        .filter(|u| (u.0 as u64) % args.window_secs < 10)
        .map(|u| {
            vec![
                format!("{:.0} s", u.0),
                format!("{:.1} MiB", u.1 as f64 / 1024.0),
                u.2.to_string(),
            ]
        })
        .collect();
    table("sandboxd RSS and open fds (one sample per window)", &["at", "RSS", "fds"], &rows);
    println!(
        "\nslope after the first window ({} samples every 10 s): RSS {:+.1} KiB/min, fds {:+.2}/min",
        steady.len(),
        slope(&rss),
        slope(&fd)
    );

    let mut refused: BTreeMap<(&str, u16, String), u64> = BTreeMap::new();
    for w in &seen {
        for (k, n) in &w.refused {
            *refused.entry((k.0, k.1, k.2.clone())).or_default() += n;
        }
    }
    let rows: Vec<Vec<String>> = refused
        .iter()
        .map(|((op, status, code), n)| {
            vec![op.to_string(), status.to_string(), code.clone(), n.to_string()]
        })
        .collect();
    if rows.is_empty() {
        println!("\nevery call succeeded");
    } else {
        table("answers that were not a success", &["operation", "status", "code", "count"], &rows);
    }
}
