//! The audit journal's cost on a call's path: what the HTTP layer adds to every call that
//! changes something — an entry built (principal, action, target: a few short strings) and
//! handed to the journal's writer — against the same entry built and dropped (the floor). The
//! writer runs on the runtime meanwhile, as in a node. Each sample is 100 calls.

use std::time::Instant;

use silk_api::AuditEntry;

use crate::report::{Samples, host_stamp, table, us};

#[derive(Debug, clap::Args)]
pub struct AuditArgs {
    /// Samples (of 100 calls each).
    #[arg(long, default_value_t = 2000)]
    samples: usize,
    #[arg(long, default_value = "/var/tmp")]
    dir: std::path::PathBuf,
}

fn entry(i: usize) -> AuditEntry {
    AuditEntry {
        time_ms: 1_796_000_000_000 + i as u64,
        node: "n1".to_string(),
        principal: "tenant:team-a".to_string(),
        tenant: Some("team-a".to_string()),
        action: "claim".to_string(),
        target: Some(format!("sb-0123abcd-{i:012x}")),
        status: 201,
        detail: None,
    }
}

pub fn run(args: AuditArgs) -> anyhow::Result<()> {
    let dir = args.dir.join(format!("silkbench-audit-{}", std::process::id()));
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build()?;
    let audit = rt.block_on(async { sandboxd::audit::Audit::open(&dir, 1 << 30, 1) })?;
    let (mut floor, mut recorded) = (Samples::default(), Samples::default());
    for s in 0..args.samples + 50 {
        let t = Instant::now();
        for i in 0..100 {
            std::hint::black_box(entry(i));
        }
        let f = t.elapsed() / 100;
        let t = Instant::now();
        for i in 0..100 {
            audit.record(entry(i));
        }
        let r = t.elapsed() / 100;
        if s >= 50 {
            floor.push(f);
            recorded.push(r);
        }
        // Let the writer drain, as the gaps between a node's calls do.
        std::thread::sleep(std::time::Duration::from_micros(200));
    }
    let dropped = audit.dropped.load(std::sync::atomic::Ordering::Relaxed);
    drop(rt);
    let _ = std::fs::remove_dir_all(&dir);
    println!("## audit journal\n\n{}", host_stamp());
    let row = |name: &str, s: &Samples| {
        vec![
            name.to_string(),
            us(s.pct(0.5)),
            us(s.pct(0.9)),
            format!("{:.2}", s.pct(0.5).as_secs_f64() / floor.pct(0.5).as_secs_f64()),
        ]
    };
    table(
        &format!("per call (mean of 100 per sample, {} samples; {dropped} dropped)", args.samples),
        &["step", "p50", "p90", "p50 ratio"],
        &[
            row("entry built and dropped (floor)", &floor),
            row("entry built and recorded", &recorded),
        ],
    );
    Ok(())
}
