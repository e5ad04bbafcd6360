//! `silkbench` with no section: every section in turn, each in its own process (so one section's
//! state cannot colour the next), their tables echoed and, with `--append`, added dated to a
//! results page. `--quick` shrinks every count: CI runs it as a smoke test.

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::Stdio;

use anyhow::Context;

#[derive(Debug, clap::Args)]
pub struct AllArgs {
    /// Small counts: a smoke run that checks every table is produced.
    #[arg(long)]
    pub quick: bool,
    /// Append the tables, dated, to this markdown file (e.g. docs/benchmarks.md).
    #[arg(long)]
    pub append: Option<PathBuf>,
    /// A statically linked silkd for the jail sections (default: $SILKD_STATIC).
    #[arg(long, env = "SILKD_STATIC")]
    pub silkd: Option<PathBuf>,
}

/// (section, full-size arguments, quick arguments)
const SECTIONS: &[(&str, &[&str], &[&str])] = &[
    (
        "agent",
        &[],
        &["--rtt-iters", "500", "--exec-iters", "50", "--read-mib", "32", "--tree-files", "300"],
    ),
    (
        "verbs",
        &[],
        &["--files", "500", "--find-runs", "1", "--watch-iters", "20", "--exec-iters", "20"],
    ),
    ("engine", &[], &["--iters", "5"]),
    ("journal", &[], &["--commits", "50"]),
    ("node", &[], &["--claims", "5", "--rtt-iters", "50"]),
    ("fleet", &[], &["--claims", "2", "--burst", "2", "--warm", "2"]),
    ("sdk", &[], &["--iters", "50"]),
    ("lifecycle", &[], &["--iters", "1", "--tree-mib", "4"]),
    ("memory", &[], &["--iters", "1", "--mib", "16"]),
    ("mesh", &[], &["--claims", "3", "--execs", "10", "--kills", "1"]),
    ("gossip", &[], &["--nodes", "30", "--churn-seconds", "30", "--minutes", "1", "--kills", "1"]),
    ("cluster", &[], &["--iters", "1", "--tree-mib", "4", "--memory-mib", "32"]),
    ("store", &[], &["--size-mib", "64"]),
    ("registry", &[], &["--size-mib", "8", "--runs", "1"]),
    ("egress", &[], &["--claims", "3", "--iters", "5"]),
    ("mcp", &[], &["--iters", "30"]),
];

pub fn run(args: AllArgs) -> anyhow::Result<()> {
    let silkd = args
        .silkd
        .clone()
        .context("set SILKD_STATIC or --silkd (scripts/build-static-silkd release prints it)")?;
    let exe = std::env::current_exe()?;
    let mut report = String::new();
    let mut failed = vec![];
    for (section, full, quick) in SECTIONS {
        let extra = if args.quick { quick } else { full };
        let mut child = std::process::Command::new(&exe)
            .arg(section)
            .args(*extra)
            .env("SILKD_STATIC", &silkd)
            .stdout(Stdio::piped())
            .spawn()
            .with_context(|| format!("start section {section}"))?;
        let stdout = child.stdout.take().context("stdout")?;
        for line in BufReader::new(stdout).lines() {
            let line = line?;
            println!("{line}");
            report.push_str(&line);
            report.push('\n');
        }
        if !child.wait()?.success() {
            eprintln!("silkbench: section {section} failed");
            failed.push(*section);
        }
        report.push('\n');
    }
    if let Some(path) = &args.append {
        let date =
            std::process::Command::new("date").arg("-u").arg("+%Y-%m-%d %H:%M UTC").output()?;
        let mut f = std::fs::OpenOptions::new().append(true).create(true).open(path)?;
        let kind = if args.quick { " (quick)" } else { "" };
        write!(
            f,
            "\n### Run of {}{kind}\n\n{report}",
            String::from_utf8_lossy(&date.stdout).trim()
        )?;
    }
    anyhow::ensure!(failed.is_empty(), "sections failed: {}", failed.join(", "));
    Ok(())
}
