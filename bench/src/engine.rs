//! The engine section: jail clone and cold boot (until silkd answers `info`), beside the floor
//! measured in the same run: `unshare` of the same namespaces + an overlay mount of the same
//! template + exec of `/bin/true`, done with syscalls from a Rust loop.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;
use silk_engine::jail::{JailConfig, JailEngine};
use silk_engine::{BoxSpec, Engine, Lane, Size, TemplateDef, Warmup};

use crate::report::{Samples, host_stamp, table, us};

#[derive(Debug, clap::Args)]
pub struct EngineArgs {
    /// A statically linked silkd (default: $SILKD_STATIC).
    #[arg(long, env = "SILKD_STATIC")]
    silkd: PathBuf,
    /// The silk-jail launcher (default: next to this binary).
    #[arg(long)]
    launcher: Option<PathBuf>,
    /// Sandboxes per arm.
    #[arg(long, default_value_t = 100)]
    iters: usize,
    /// Data directory for the throwaway engine.
    #[arg(long, default_value = "/var/tmp")]
    dir: PathBuf,
}

pub fn run(args: EngineArgs) -> anyhow::Result<()> {
    let launcher =
        args.launcher.clone().unwrap_or(std::env::current_exe()?.with_file_name("silk-jail"));
    let data = args.dir.join(format!("silkbench-engine-{}", std::process::id()));
    let result = sections(&args, launcher, &data);
    let _ = std::fs::remove_dir_all(&data);
    result
}

fn sections(args: &EngineArgs, launcher: PathBuf, data: &std::path::Path) -> anyhow::Result<()> {
    let engine = JailEngine::new(JailConfig::new(data, &args.silkd, launcher))?;
    let template = engine.template(&TemplateDef::host())?;
    let golden = engine.prepare(&template, &Warmup::default())?;
    let spec = BoxSpec::new(Size::Small, Lane::None);
    println!("## jail engine\n\n{}", host_stamp());

    let scratch = data.join("floor");
    // A peer tool, when installed: bubblewrap starting /bin/true in the same kinds of namespaces.
    let bwrap = which("bwrap");
    let (mut floor, mut clone, mut cold, mut peer) =
        (Samples::default(), Samples::default(), Samples::default(), Samples::default());
    for i in 0..args.iters + 5 {
        let warm = i >= 5;
        // A B C C B A: the order of the arms reverses every iteration.
        let order = if i % 2 == 0 { [0, 1, 2, 3] } else { [3, 2, 1, 0] };
        for arm in order {
            let d = match arm {
                0 => floor_once(&scratch.join(i.to_string()), &template.root)?,
                1 | 2 => {
                    let id = format!("bench-{arm}-{i}").parse()?;
                    let t = Instant::now();
                    if arm == 1 {
                        engine.clone_golden(&golden, &id, &spec)?;
                    } else {
                        engine.boot(&template, &id, &spec)?;
                    }
                    let d = t.elapsed();
                    engine.destroy(&id)?;
                    d
                }
                _ => match &bwrap {
                    Some(bwrap) => bwrap_once(bwrap)?,
                    None => continue,
                },
            };
            if warm {
                [&mut floor, &mut clone, &mut cold, &mut peer][arm].push(d);
            }
        }
    }
    let row = |name: &str, s: &Samples| {
        vec![
            name.to_string(),
            us(s.pct(0.5)),
            us(s.pct(0.9)),
            us(s.pct(1.0)),
            format!("{:.2}", s.pct(0.5).as_secs_f64() / floor.pct(0.5).as_secs_f64()),
        ]
    };
    table(
        &format!(
            "jail sandbox start, golden → silkd answers `info` (n = {} per arm, host template)",
            floor.len()
        ),
        &["arm", "p50", "p90", "max", "p50 ratio"],
        &[
            row("floor: unshare 6 namespaces + overlay mount + exec /bin/true", &floor),
            row("clone from golden", &clone),
            row("cold boot from template", &cold),
        ]
        .into_iter()
        .chain(
            (peer.len() > 0)
                .then(|| row("peer: bwrap --unshare-all, /usr bound, /bin/true", &peer)),
        )
        .collect::<Vec<_>>(),
    );
    if bwrap.is_none() {
        println!("\n(no peer arm: bubblewrap is not installed)");
    }
    Ok(())
}

fn which(tool: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")?
        .to_str()?
        .split(':')
        .map(|d| PathBuf::from(d).join(tool))
        .find(|p| p.is_file())
}

fn bwrap_once(bwrap: &std::path::Path) -> anyhow::Result<Duration> {
    let t = Instant::now();
    let status = std::process::Command::new(bwrap)
        .args(["--unshare-all", "--die-with-parent", "--ro-bind", "/usr", "/usr"])
        .args([
            "--symlink",
            "usr/bin",
            "/bin",
            "--symlink",
            "usr/lib",
            "/lib",
            "--symlink",
            "usr/lib64",
            "/lib64",
        ])
        .args(["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "/bin/true"])
        .status()?;
    anyhow::ensure!(status.success(), "bwrap failed");
    Ok(t.elapsed())
}

/// The floor: the same namespaces and overlay mount, then `exec /bin/true`, timed to exit.
pub(crate) fn floor_once(
    dir: &std::path::Path,
    lower: &std::path::Path,
) -> anyhow::Result<Duration> {
    let (upper, work, root) = (dir.join("upper"), dir.join("work"), dir.join("root"));
    for d in [&upper, &work, &root] {
        std::fs::create_dir_all(d)?;
    }
    let cstr = |p: &std::path::Path| CString::new(p.as_os_str().as_bytes()).context("path");
    let target = cstr(&root)?;
    let opts = CString::new(format!(
        "lowerdir={},upperdir={},workdir={}",
        lower.display(),
        upper.display(),
        work.display()
    ))?;
    let mut cmd = std::process::Command::new("/bin/true");
    // SAFETY: only syscalls on data prepared before fork.
    unsafe {
        cmd.pre_exec(move || {
            let flags = libc::CLONE_NEWNS
                | libc::CLONE_NEWPID
                | libc::CLONE_NEWUTS
                | libc::CLONE_NEWIPC
                | libc::CLONE_NEWNET
                | libc::CLONE_NEWCGROUP;
            let null: *const libc::c_char = std::ptr::null();
            if libc::unshare(flags) != 0
                || libc::mount(
                    null,
                    c"/".as_ptr(),
                    null,
                    libc::MS_REC | libc::MS_PRIVATE,
                    std::ptr::null(),
                ) != 0
                || libc::mount(
                    c"overlay".as_ptr(),
                    target.as_ptr(),
                    c"overlay".as_ptr(),
                    0,
                    opts.as_ptr().cast(),
                ) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let t = Instant::now();
    let status = cmd.status()?;
    let d = t.elapsed();
    anyhow::ensure!(status.success(), "floor run failed");
    std::fs::remove_dir_all(dir)?;
    Ok(d)
}
