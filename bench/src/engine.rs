//! The engine section: jail clone and cold boot (until silkd answers `info`), beside the floor
//! measured in the same run: `unshare` of the same namespaces + an overlay mount of the same
//! template + exec of `/bin/true`, done with syscalls from a Rust loop. Clones run on two
//! engines: one bounding disks as the data directory's filesystem allows, one not.

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
    let engine = JailEngine::new(JailConfig::new(data.join("bounded"), &args.silkd, &launcher))?;
    let template = engine.template(&TemplateDef::host())?;
    let golden = engine.prepare(&template, &Warmup::default())?;
    let mut cfg = JailConfig::new(data.join("unbounded"), &args.silkd, &launcher);
    cfg.bound_disks = false;
    let unbounded = JailEngine::new(cfg)?;
    let free_golden =
        unbounded.prepare(&unbounded.template(&TemplateDef::host())?, &Warmup::default())?;
    let mechanism = engine.capabilities().disk_mechanism;
    let spec = BoxSpec::new(Size::Small, Lane::None);
    println!("## jail engine\n\n{}", host_stamp());

    let scratch = data.join("floor");
    // A peer tool, when installed: bubblewrap starting /bin/true in the same kinds of namespaces.
    let bwrap = which("bwrap");
    let mut arms: [Samples; 5] = Default::default();
    for i in 0..args.iters + 5 {
        let warm = i >= 5;
        // A B C C B A: the order of the arms reverses every iteration.
        let order = if i % 2 == 0 { [0, 1, 2, 3, 4] } else { [4, 3, 2, 1, 0] };
        for arm in order {
            let d = match arm {
                0 => floor_once(&scratch.join(i.to_string()), &template.root)?,
                1..=3 => {
                    let id = format!("bench-{arm}-{i}").parse()?;
                    let t = Instant::now();
                    match arm {
                        1 => engine.clone_golden(&golden, &id, &spec)?,
                        2 => engine.boot(&template, &id, &spec)?,
                        _ => unbounded.clone_golden(&free_golden, &id, &spec)?,
                    };
                    let d = t.elapsed();
                    if arm == 3 {
                        unbounded.destroy(&id)?
                    } else {
                        engine.destroy(&id)?
                    }
                    d
                }
                _ => match &bwrap {
                    Some(bwrap) => bwrap_once(bwrap)?,
                    None => continue,
                },
            };
            if warm {
                arms[arm].push(d);
            }
        }
    }
    let [floor, clone, cold, free_clone, peer] = arms;
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
            row(&format!("clone from golden (disk: {mechanism:?})"), &clone),
            row(&format!("cold boot from template (disk: {mechanism:?})"), &cold),
            row("clone from golden, disk not bounded", &free_clone),
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
    isolation_steps(args, &launcher, data, &template.root)
}

/// What each isolation step of the launcher costs: the floor again, then the floor plus one
/// step at a time (an id-mapped template layer under the overlay; entering the sandboxes' user
/// namespace; `/proc` with its masked and read-only paths), each timed to `/bin/true`'s exit.
fn isolation_steps(
    args: &EngineArgs,
    launcher: &std::path::Path,
    data: &std::path::Path,
    lower: &std::path::Path,
) -> anyhow::Result<()> {
    use std::os::fd::AsRawFd;
    let userns = silk_engine::jail::user_namespace(
        launcher,
        silk_engine::layer::Ids { base: silk_engine::jail::DEFAULT_ID_BASE },
    )?;
    let ns = userns.as_raw_fd();
    let scratch = data.join("steps");
    let names = [
        "floor: unshare 6 namespaces + overlay mount + exec /bin/true",
        "+ the template id-mapped under the overlay",
        "+ entering the sandboxes' user namespace",
        "+ /proc with 8 masked and 5 read-only paths",
    ];
    let mut samples: Vec<Samples> = names.iter().map(|_| Samples::default()).collect();
    for i in 0..args.iters + 5 {
        let order = if i % 2 == 0 { [0, 1, 2, 3] } else { [3, 2, 1, 0] };
        for arm in order {
            let steps = Steps {
                idmap: (arm == 1).then_some(ns),
                userns: (arm == 2).then_some(ns),
                proc: arm == 3,
            };
            let d = floor_with(&scratch.join(format!("{i}-{arm}")), lower, steps)?;
            if i >= 5 {
                samples[arm].push(d);
            }
        }
    }
    let floor = samples[0].pct(0.5);
    let rows: Vec<Vec<String>> = names
        .iter()
        .zip(&samples)
        .map(|(name, s)| {
            vec![
                name.to_string(),
                us(s.pct(0.5)),
                us(s.pct(0.9)),
                format!("{:+.0} µs", (s.pct(0.5).as_secs_f64() - floor.as_secs_f64()) * 1e6),
            ]
        })
        .collect();
    table(
        &format!("what each isolation step adds (n = {} per arm)", samples[0].len()),
        &["arm", "p50", "p90", "p50 − floor"],
        &rows,
    );
    Ok(())
}

/// Steps added to the floor in [`floor_with`]: user namespace descriptors to id-map the lower
/// layer through and to enter, and whether to mount /proc with its masks.
#[derive(Clone, Copy)]
struct Steps {
    idmap: Option<i32>,
    userns: Option<i32>,
    proc: bool,
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
    floor_with(dir, lower, Steps { idmap: None, userns: None, proc: false })
}

fn floor_with(
    dir: &std::path::Path,
    lower: &std::path::Path,
    steps: Steps,
) -> anyhow::Result<Duration> {
    let (upper, work, root, mapped) =
        (dir.join("upper"), dir.join("work"), dir.join("root"), dir.join("lower"));
    for d in [&upper, &work, &root, &mapped] {
        std::fs::create_dir_all(d)?;
    }
    let cstr = |p: &std::path::Path| CString::new(p.as_os_str().as_bytes()).context("path");
    let target = cstr(&root)?;
    let (lower_c, mapped_c) = (cstr(lower)?, cstr(&mapped)?);
    let proc_dir = cstr(&root.join("proc"))?;
    // The launcher's own lists; a directory (judged on the host's /proc, the same kernel) gets
    // an empty tmpfs, a file /dev/null.
    let masks: Vec<(CString, bool)> = silk_engine::jail::launch::MASKED
        .iter()
        .map(|p| (cstr(&root.join(p)).expect("path"), std::path::Path::new("/").join(p).is_dir()))
        .collect();
    let read_only: Vec<CString> = silk_engine::jail::launch::READ_ONLY
        .iter()
        .map(|p| cstr(&root.join(p)).expect("path"))
        .collect();
    let opts = CString::new(format!(
        "lowerdir={},upperdir={},workdir={}",
        if steps.idmap.is_some() { mapped.display() } else { lower.display() },
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
            let fail = || Err(std::io::Error::last_os_error());
            if libc::unshare(flags) != 0
                || libc::mount(
                    null,
                    c"/".as_ptr(),
                    null,
                    libc::MS_REC | libc::MS_PRIVATE,
                    std::ptr::null(),
                ) != 0
            {
                return fail();
            }
            if let Some(ns) = steps.idmap {
                let tree = libc::syscall(
                    libc::SYS_open_tree,
                    libc::AT_FDCWD,
                    lower_c.as_ptr(),
                    libc::OPEN_TREE_CLONE | libc::OPEN_TREE_CLOEXEC,
                ) as i32;
                let mut attr: libc::mount_attr = std::mem::zeroed();
                attr.attr_set = libc::MOUNT_ATTR_IDMAP | libc::MOUNT_ATTR_RDONLY;
                attr.userns_fd = ns as u64;
                if tree < 0
                    || libc::syscall(
                        libc::SYS_mount_setattr,
                        tree,
                        c"".as_ptr(),
                        libc::AT_EMPTY_PATH,
                        &attr as *const libc::mount_attr,
                        std::mem::size_of::<libc::mount_attr>(),
                    ) != 0
                    || libc::syscall(
                        libc::SYS_move_mount,
                        tree,
                        c"".as_ptr(),
                        libc::AT_FDCWD,
                        mapped_c.as_ptr(),
                        libc::MOVE_MOUNT_F_EMPTY_PATH,
                    ) != 0
                {
                    return fail();
                }
            }
            if libc::mount(
                c"overlay".as_ptr(),
                target.as_ptr(),
                c"overlay".as_ptr(),
                0,
                opts.as_ptr().cast(),
            ) != 0
            {
                return fail();
            }
            if steps.proc {
                let ro = libc::MS_BIND | libc::MS_REMOUNT | libc::MS_RDONLY;
                if libc::mount(
                    c"proc".as_ptr(),
                    proc_dir.as_ptr(),
                    c"proc".as_ptr(),
                    0,
                    std::ptr::null(),
                ) != 0
                {
                    return fail();
                }
                for (path, dir) in &masks {
                    let rc = if *dir {
                        libc::mount(
                            c"tmpfs".as_ptr(),
                            path.as_ptr(),
                            c"tmpfs".as_ptr(),
                            libc::MS_RDONLY,
                            c"size=0".as_ptr().cast(),
                        )
                    } else {
                        libc::mount(
                            c"/dev/null".as_ptr(),
                            path.as_ptr(),
                            null,
                            libc::MS_BIND,
                            std::ptr::null(),
                        )
                    };
                    let missing = *libc::__errno_location() == libc::ENOENT;
                    if rc != 0 && !missing {
                        return fail();
                    }
                }
                for path in &read_only {
                    if libc::mount(
                        path.as_ptr(),
                        path.as_ptr(),
                        null,
                        libc::MS_BIND | libc::MS_REC,
                        std::ptr::null(),
                    ) == 0
                        && libc::mount(null, path.as_ptr(), null, ro, std::ptr::null()) != 0
                    {
                        return fail();
                    }
                }
            }
            if let Some(ns) = steps.userns
                && (libc::setns(ns, libc::CLONE_NEWUSER) != 0
                    || libc::setgroups(0, std::ptr::null()) != 0
                    || libc::setresgid(0, 0, 0) != 0
                    || libc::setresuid(0, 0, 0) != 0)
            {
                return fail();
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
