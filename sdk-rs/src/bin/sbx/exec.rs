//! Running programs in a sandbox from the terminal: `exec` (streamed, or collected as JSON),
//! stdin forwarding, and `shell` (a pty).

use std::time::Duration;

use anyhow::Context;
use bytes::Bytes;
use serde_json::json;
use silkmesh::{Chunk, Exec, Output, Sandbox};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::{ExecOpts, term};

pub(crate) async fn exec(sandbox: &Sandbox, opts: &ExecOpts, json: bool) -> anyhow::Result<i32> {
    let mut b = sandbox.exec(opts.command.iter().cloned());
    if let Some(cwd) = &opts.cwd {
        b = b.cwd(cwd);
    }
    for (k, v) in &opts.env {
        b = b.env(k, v);
    }
    if let Some(u) = &opts.user {
        b = b.user(u);
    }
    if let Some(t) = opts.timeout {
        b = b.timeout(Duration::from_secs(t));
    }
    if opts.interactive {
        b = b.stdin_stream();
    }
    let exec = b.start().await?;
    if opts.interactive {
        forward_stdin(&exec)?;
    }
    if json {
        let out = exec.collect().await?;
        println!("{}", serde_json::to_string_pretty(&output_json(&out))?);
        return Ok(out.code());
    }
    stream(exec).await
}

/// Copies this process's stdin into the exec's, from a task of its own, then ends it.
fn forward_stdin(exec: &Exec) -> anyhow::Result<()> {
    let stdin = exec.stdin()?;
    tokio::spawn(async move {
        let mut local = tokio::io::stdin();
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            match local.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if stdin.write(Bytes::copy_from_slice(&buf[..n])).await.is_err() {
                        return;
                    }
                }
            }
        }
        let _ = stdin.close().await;
    });
    Ok(())
}

/// Streams output to our stdout/stderr as it comes; returns the exit code.
async fn stream(mut exec: Exec) -> anyhow::Result<i32> {
    let (mut out, mut err) = (tokio::io::stdout(), tokio::io::stderr());
    while let Some(chunk) = exec.next().await? {
        match chunk {
            Chunk::Stdout(b) => {
                out.write_all(&b).await?;
                out.flush().await?;
            }
            Chunk::Stderr(b) => {
                err.write_all(&b).await?;
                err.flush().await?;
            }
        }
    }
    let status = exec.status().context("exec ended without a status")?;
    Ok(status.code)
}

fn output_json(out: &Output) -> serde_json::Value {
    json!({
        "exit_code": out.status.code,
        "signal": out.status.signal,
        "timed_out": out.status.timed_out,
        "stdout": out.stdout_str(),
        "stderr": out.stderr_str(),
    })
}

/// `sbx shell`: the local terminal in raw mode, bytes both ways, the window size followed.
pub(crate) async fn shell(sandbox: &Sandbox, command: Vec<String>) -> anyhow::Result<i32> {
    use tokio::signal::unix::{SignalKind, signal};
    let (cols, rows) = term::size(1).or_else(|| term::size(0)).unwrap_or((80, 24));
    let mut b = sandbox.pty(cols, rows);
    if !command.is_empty() {
        b = b.command(command);
    }
    if let Ok(t) = std::env::var("TERM") {
        b = b.env("TERM", t);
    }
    let mut pty = b.open().await?;
    let mut winch = signal(SignalKind::window_change())?;
    let raw = term::RawMode::enable(0)?;
    let result = async {
        let (mut stdin, mut stdout) = (tokio::io::stdin(), tokio::io::stdout());
        let mut buf = vec![0u8; 16 * 1024];
        let mut stdin_open = true;
        let (output, input) = pty.split();
        loop {
            tokio::select! {
                shown = output.read() => match shown? {
                    Some(b) => {
                        stdout.write_all(&b).await?;
                        stdout.flush().await?;
                    }
                    None => break,
                },
                typed = stdin.read(&mut buf), if stdin_open => match typed {
                    Ok(0) | Err(_) => stdin_open = false,
                    Ok(n) => input.write(Bytes::copy_from_slice(&buf[..n])).await?,
                },
                _ = winch.recv() => {
                    if let Some((cols, rows)) = term::size(1).or_else(|| term::size(0)) {
                        input.resize(cols, rows).await?;
                    }
                }
            }
        }
        anyhow::Ok(output.status().map_or(0, |s| s.code))
    }
    .await;
    drop(raw);
    result
}
