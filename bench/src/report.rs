//! Samples, percentiles, the host stamp, and markdown tables.

use std::time::Duration;

/// Round-trip samples of one arm.
#[derive(Debug, Default)]
pub struct Samples(Vec<Duration>);

impl Samples {
    pub fn push(&mut self, d: Duration) {
        self.0.push(d);
    }

    pub fn pct(&self, p: f64) -> Duration {
        let mut v = self.0.clone();
        v.sort();
        v[((v.len() - 1) as f64 * p).round() as usize]
    }

    pub fn extend(&mut self, other: Samples) {
        self.0.extend(other.0);
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }
}

pub fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1e3)
}

pub fn us(d: Duration) -> String {
    format!("{:.1} µs", d.as_secs_f64() * 1e6)
}

/// Host, kernel and commit: every table is stamped so numbers are never read out of context.
pub fn host_stamp() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_else(|| "?".into());
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    // systemd-detect-virt prints "none" on bare metal; without it, /proc/cpuinfo's hypervisor flag.
    let virt = command_output("systemd-detect-virt", &[]).unwrap_or_else(|| {
        let flags = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        if flags.contains(" hypervisor") { "vm".into() } else { "none".into() }
    });
    let mem_gib = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| m.lines().next()?.split_whitespace().nth(1)?.parse::<u64>().ok())
        .map_or(0.0, |kib| kib as f64 / (1 << 20) as f64);
    let commit =
        command_output("git", &["rev-parse", "--short", "HEAD"]).unwrap_or_else(|| "?".into());
    let date = command_output("date", &["-u", "+%Y-%m-%d %H:%M UTC"]).unwrap_or_default();
    // Every nftables table with a prerouting or input hook is walked by every loopback packet:
    // 46 egress tables left by killed nodes made this host's HTTP round trip 222 µs, not 49.
    let tables = command_output("nft", &["list", "tables"]).map_or(0, |t| t.lines().count());
    format!(
        "host: {cpu}, {cores} cores, {mem_gib:.0} GiB, kernel {}, virt {virt}, commit {commit}, {date}, nftables tables: {tables}",
        kernel.trim()
    )
}

fn command_output(cmd: &str, args: &[&str]) -> Option<String> {
    let out = std::process::Command::new(cmd).args(args).output().ok()?;
    Some(String::from_utf8_lossy(&out.stdout).trim().to_string()).filter(|s| !s.is_empty())
}

/// Prints a markdown table.
pub fn table(title: &str, header: &[&str], rows: &[Vec<String>]) {
    println!("\n### {title}\n");
    println!("| {} |", header.join(" | "));
    println!("|{}|", header.iter().map(|_| "---").collect::<Vec<_>>().join("|"));
    for row in rows {
        println!("| {} |", row.join(" | "));
    }
}
