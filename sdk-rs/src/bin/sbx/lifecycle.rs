//! `sbx hibernate | wake | archive | checkpoint | checkpoints | branch | fork | mv | promote |
//! templates | rm-checkpoint | rm-template`.

use clap::Subcommand;
use serde_json::json;
use silkmesh::{Checkpoint, Client, Memory, Sandbox, SandboxInfo};

use crate::{SandboxToken, Target, table};

#[derive(Debug, Subcommand)]
pub enum Lifecycle {
    /// Stop a sandbox, freeing the host, its files (and processes) kept; the next call on it
    /// wakes it.
    Hibernate {
        #[command(flatten)]
        target: Target,
        #[command(flatten)]
        memory: MemoryArg,
    },
    /// Start a hibernated or archived sandbox now.
    Wake(Target),
    /// Move a sandbox's files (and processes) to the object store and free the host.
    Archive {
        #[command(flatten)]
        target: Target,
        #[command(flatten)]
        memory: MemoryArg,
    },
    /// Capture a sandbox's files (and processes) into the store while it keeps running; prints
    /// the `ck_` id.
    Checkpoint {
        #[command(flatten)]
        target: Target,
        /// A name to remember it by.
        #[arg(long)]
        name: Option<String>,
        #[command(flatten)]
        memory: MemoryArg,
    },
    /// List checkpoints: of one sandbox (with its token), or all of them (root token).
    Checkpoints {
        /// Only this sandbox's checkpoints.
        #[arg(long)]
        sandbox: Option<String>,
        #[command(flatten)]
        token: SandboxToken,
    },
    /// A new sandbox from a checkpoint; prints its id and token.
    Branch {
        /// The checkpoint (`ck_...`).
        checkpoint: String,
        #[command(flatten)]
        token: SandboxToken,
        #[command(flatten)]
        memory: MemoryArg,
    },
    /// New sandboxes from a sandbox's current files, all or none; prints their ids and tokens.
    Fork {
        #[command(flatten)]
        target: Target,
        /// How many (1-16).
        #[arg(long, short = 'n', default_value_t = 1)]
        count: usize,
        #[command(flatten)]
        memory: MemoryArg,
    },
    /// Move a sandbox to another node of the mesh; it keeps its id and token.
    Mv {
        #[command(flatten)]
        target: Target,
        /// The node to move to (default: the least loaded peer).
        #[arg(long)]
        to: Option<String>,
        #[command(flatten)]
        memory: MemoryArg,
    },
    /// Publish a sandbox's files as a template that later claims clone from.
    Promote {
        #[command(flatten)]
        target: Target,
        /// The template's name.
        template: String,
    },
    /// Templates: list them (built in, configured, promoted, registered), or add, show or
    /// refresh one from a registry image.
    Templates {
        #[command(subcommand)]
        what: Option<Templates>,
    },
    /// Delete a checkpoint.
    RmCheckpoint {
        checkpoint: String,
        #[command(flatten)]
        token: SandboxToken,
    },
    /// Delete a promoted or registered template.
    RmTemplate { template: String },
}

#[derive(Debug, Subcommand)]
pub enum Templates {
    /// Register a registry image as a template on the whole fleet, and follow its pull.
    Add {
        name: String,
        /// An image reference: `python:3.12`, `ghcr.io/org/base:v4`, `host:port/repo@sha256:…`.
        image: String,
        /// A command run once before the template's golden is frozen (repeatable: argv).
        #[arg(long)]
        warmup: Vec<String>,
    },
    /// One template, with its pull on the node.
    Show { name: String },
    /// Resolve a registry template's reference again (a moved tag is pulled).
    Refresh { name: String },
}

/// `--memory auto|required|off`.
#[derive(Debug, clap::Args)]
pub struct MemoryArg {
    /// Keep the processes' memory: `auto` (where the node can, else files only, saying why),
    /// `required` (else fail, changing nothing) or `off` (files only: processes restart).
    #[arg(long = "memory", default_value = "auto", value_parser = parse_memory)]
    memory: Memory,
}

fn parse_memory(s: &str) -> Result<Memory, String> {
    serde_json::from_value(json!(s)).map_err(|_| "one of auto, required, off".to_string())
}

pub async fn run(c: &Client, cmd: Lifecycle, json: bool) -> anyhow::Result<i32> {
    let open = |t: &Target| {
        let (c, id, token) = (c.clone(), t.id.clone(), t.token.sandbox_token.clone());
        async move { c.sandbox(&id, token.as_deref()).await }
    };
    match cmd {
        Lifecycle::Hibernate { target, memory } => {
            state(&open(&target).await?.hibernate_with(memory.memory).await?, json)
        }
        Lifecycle::Wake(t) => state(&open(&t).await?.wake().await?, json),
        Lifecycle::Archive { target, memory } => {
            state(&open(&target).await?.archive_with(memory.memory).await?, json)
        }
        Lifecycle::Checkpoint { target, name, memory } => {
            let ck = open(&target).await?.checkpoint_with(name.as_deref(), memory.memory).await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&ck)?);
            } else {
                println!("{}", ck.id);
                if let Some(why) = &ck.memory_note {
                    eprintln!("files only (processes will restart in a branch): {why}");
                }
            }
        }
        Lifecycle::Checkpoints { sandbox, token } => {
            let list = match &sandbox {
                Some(id) => {
                    c.sandbox(id, token.sandbox_token.as_deref()).await?.checkpoints().await?
                }
                None => c.checkpoints().await?,
            };
            if json {
                println!("{}", serde_json::to_string_pretty(&json!({ "checkpoints": list }))?);
            } else {
                print_checkpoints(&list);
            }
        }
        Lifecycle::Branch { checkpoint, token, memory } => {
            let token = token.sandbox_token.as_deref();
            let s = c.branch_with(&checkpoint, token, memory.memory).await?;
            new_sandboxes(&[s], json)?;
        }
        Lifecycle::Fork { target, count, memory } => {
            let kids = open(&target).await?.fork_with(count, memory.memory).await?;
            new_sandboxes(&kids, json)?;
        }
        Lifecycle::Mv { target, to, memory } => {
            let info = open(&target).await?.move_with(to.as_deref(), memory.memory).await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&info)?);
            } else {
                println!("{} moved to {}", info.id, info.owner);
            }
        }
        Lifecycle::Promote { target, template } => {
            let t = open(&target).await?.promote(&template).await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&t)?);
            } else {
                println!("{} {}", t.name, t.digest.unwrap_or_default());
            }
        }
        Lifecycle::Templates { what: None } => {
            let list = c.templates().await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&json!({ "templates": list }))?);
            } else {
                let rows: Vec<Vec<String>> = list
                    .iter()
                    .map(|t| {
                        let digest = t.image_digest.as_deref().or(t.digest.as_deref());
                        let digest = digest.map_or("-", |d| &d[..16.min(d.len())]);
                        let status = t.status.map_or("-".to_string(), |s| s.to_string());
                        let image = t.image.clone().unwrap_or_else(|| "-".into());
                        vec![t.name.clone(), t.kind.to_string(), digest.into(), status, image]
                    })
                    .collect();
                table(&["NAME", "KIND", "DIGEST", "PULL", "IMAGE"], &rows);
            }
        }
        Lifecycle::Templates { what: Some(Templates::Add { name, image, warmup }) } => {
            let t = c.register_template(&name, &image, &warmup).await?;
            return follow_pull(c, &t.name, json).await;
        }
        Lifecycle::Templates { what: Some(Templates::Show { name }) } => {
            println!("{}", serde_json::to_string_pretty(&c.template(&name).await?)?);
        }
        Lifecycle::Templates { what: Some(Templates::Refresh { name }) } => {
            let t = c.refresh_template(&name).await?;
            return follow_pull(c, &t.name, json).await;
        }
        Lifecycle::RmCheckpoint { checkpoint, token } => {
            c.delete_checkpoint(&checkpoint, token.sandbox_token.as_deref()).await?;
            done(json, "deleted", &checkpoint);
        }
        Lifecycle::RmTemplate { template } => {
            c.delete_template(&template).await?;
            done(json, "deleted", &template);
        }
    }
    Ok(0)
}

/// Polls template `name` until its pull on the node ends, with a progress bar on a terminal.
/// Exit code 1 when the pull failed.
async fn follow_pull(c: &Client, name: &str, json: bool) -> anyhow::Result<i32> {
    use silkmesh::PullStatus;
    let bar = (!json).then(|| {
        let bar = indicatif::ProgressBar::new(0);
        let style = indicatif::ProgressStyle::with_template(
            "{msg} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
        );
        if let Ok(style) = style {
            bar.set_style(style.progress_chars("=> "));
        }
        bar.set_message(format!("pulling {name}"));
        bar
    });
    loop {
        let t = c.template(name).await?;
        if let Some(bar) = &bar {
            bar.set_length(t.bytes_total.unwrap_or(0));
            bar.set_position(t.bytes_done.unwrap_or(0));
        }
        match t.status {
            Some(PullStatus::Ready) | None => {
                if let Some(bar) = bar {
                    bar.finish_and_clear();
                    let digest = t.image_digest.as_deref().unwrap_or("-");
                    println!("{} ready {digest}", t.name);
                } else {
                    println!("{}", serde_json::to_string_pretty(&t)?);
                }
                return Ok(0);
            }
            Some(PullStatus::Failed) => {
                if let Some(bar) = bar {
                    bar.abandon();
                }
                let e = t.error.as_ref();
                if json {
                    println!("{}", serde_json::to_string_pretty(&t)?);
                } else {
                    let (code, message) =
                        e.map_or(("failed", ""), |e| (e.code.as_str(), &*e.message));
                    eprintln!("{name}: {code}: {message}");
                }
                return Ok(1);
            }
            Some(PullStatus::Pending | PullStatus::Pulling) => {
                tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            }
        }
    }
}

fn state(info: &SandboxInfo, json: bool) {
    if json {
        println!("{}", serde_json::to_string_pretty(info).unwrap_or_default());
    } else {
        // What became of its processes, when that is news.
        let memory = match (&info.memory_note, info.memory_snapshot) {
            (Some(why), _) => format!(" (files only: {why})"),
            (None, true) => " (processes kept)".to_string(),
            (None, false) => String::new(),
        };
        println!("{} {}{memory}", info.id, info.state);
    }
}

fn done(json: bool, what: &str, name: &str) {
    if json {
        println!("{}", json!({ what: name }));
    } else {
        println!("{what} {name}");
    }
}

fn new_sandboxes(list: &[Sandbox], json: bool) -> anyhow::Result<()> {
    if json {
        let rows: Vec<_> = list
            .iter()
            .map(|s| {
                let mut v = serde_json::to_value(s.info()).unwrap_or_default();
                v["token"] = json!(s.token());
                v
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&json!({ "sandboxes": rows }))?);
    } else {
        let rows: Vec<Vec<String>> =
            list.iter().map(|s| vec![s.id().to_string(), s.token().to_string()]).collect();
        table(&["ID", "TOKEN"], &rows);
    }
    Ok(())
}

fn print_checkpoints(list: &[Checkpoint]) {
    let rows: Vec<Vec<String>> = list
        .iter()
        .map(|ck| {
            vec![
                ck.id.clone(),
                ck.name.clone().unwrap_or_else(|| "-".into()),
                ck.sandbox.clone(),
                ck.template.clone(),
                format!("{:.1} MiB", ck.bytes as f64 / (1 << 20) as f64),
            ]
        })
        .collect();
    table(&["CHECKPOINT", "NAME", "SANDBOX", "TEMPLATE", "SIZE"], &rows);
}
