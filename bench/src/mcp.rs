//! The MCP section: `sandbox_exec` of `/bin/true` through the MCP server, over stdio (`sbx mcp`
//! next to this binary, JSON-RPC lines on its pipes) and over a node's `/mcp` (streamable HTTP,
//! a kept connection), beside the floor: the same exec through sdk-rs, which is what the tools
//! call. The arms take turns call by call, the order rotating.
//!
//! | measurement | floor beside it |
//! |---|---|
//! | `tools/call sandbox_exec` answered, stdio and HTTP | `Sandbox::run(["/bin/true"])` on a kept relay connection |

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;
use serde_json::{Value, json};
use silkmesh::Client;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::process::{Child, ChildStdin, ChildStdout};

use crate::node::{NodeProc, TOKEN};
use crate::report::{Samples, host_stamp, table, us};

#[derive(Debug, clap::Args)]
pub struct McpArgs {
    /// A statically linked silkd (default: $SILKD_STATIC).
    #[arg(long, env = "SILKD_STATIC")]
    silkd: PathBuf,
    /// Timed calls per arm.
    #[arg(long, default_value_t = 300)]
    iters: usize,
    #[arg(long, default_value = "/var/tmp")]
    dir: PathBuf,
}

const WARMUP: usize = 20;

pub async fn run(args: McpArgs) -> anyhow::Result<()> {
    let work = args.dir.join(format!("silkbench-mcp-{}", std::process::id()));
    std::fs::create_dir_all(&work)?;
    let config = "[[pools]]\ntemplate = \"host\"\nwarm = 1\nwarm_max = 1\n";
    let result = match NodeProc::start(&args.silkd, &work, config) {
        Ok(node) => measure(&args, &node).await,
        Err(e) => Err(e),
    };
    silk_engine::jail::unmount_under(&work);
    let _ = std::fs::remove_dir_all(&work);
    result
}

/// `sbx mcp` as a child, initialized.
struct Stdio {
    _child: Child,
    to: ChildStdin,
    from: tokio::io::Lines<BufReader<ChildStdout>>,
    next: u64,
}

impl Stdio {
    async fn start(url: &str) -> anyhow::Result<Stdio> {
        let sbx = std::env::current_exe()?.with_file_name("sbx");
        let mut child = tokio::process::Command::new(&sbx)
            .arg("mcp")
            .env("SBX_ADDR", url)
            .env("SBX_TOKEN", TOKEN)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .with_context(|| {
                format!("{} (build it: cargo build --release -p silkmesh-sdk)", sbx.display())
            })?;
        let to = child.stdin.take().context("stdin")?;
        let from = BufReader::new(child.stdout.take().context("stdout")?).lines();
        let mut s = Stdio { _child: child, to, from, next: 1 };
        s.call("initialize", initialize()).await?;
        s.send(&json!({"jsonrpc": "2.0", "method": "notifications/initialized"})).await?;
        Ok(s)
    }

    async fn send(&mut self, v: &Value) -> anyhow::Result<()> {
        self.to.write_all(format!("{v}\n").as_bytes()).await?;
        Ok(())
    }

    async fn call(&mut self, method: &str, params: Value) -> anyhow::Result<Value> {
        let id = self.next;
        self.next += 1;
        self.send(&json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params})).await?;
        loop {
            let line = self.from.next_line().await?.context("sbx mcp ended")?;
            let v: Value = serde_json::from_str(&line)?;
            if v["id"] == id {
                return Ok(v);
            }
        }
    }
}

fn initialize() -> Value {
    json!({
        "protocolVersion": "2025-06-18",
        "capabilities": {},
        "clientInfo": {"name": "silkbench", "version": "0"},
    })
}

/// `/mcp` on one kept connection.
struct Http {
    io: BufReader<TcpStream>,
    next: u64,
}

impl Http {
    async fn call(&mut self, method: &str, params: Value) -> anyhow::Result<Value> {
        let id = self.next;
        self.next += 1;
        let body = json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params});
        let body = body.to_string();
        let head = format!(
            "POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {TOKEN}\r\n\
             Content-Type: application/json\r\nAccept: application/json, text/event-stream\r\n\
             MCP-Protocol-Version: 2025-06-18\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        self.io.get_mut().write_all(head.as_bytes()).await?;
        let mut line = String::new();
        self.io.read_line(&mut line).await?;
        let status = line.split_whitespace().nth(1).unwrap_or_default().to_string();
        let (mut len, mut chunked) = (None, false);
        loop {
            line.clear();
            self.io.read_line(&mut line).await?;
            if line == "\r\n" || line.is_empty() {
                break;
            }
            let l = line.to_ascii_lowercase();
            if let Some(v) = l.strip_prefix("content-length:") {
                len = Some(v.trim().parse::<usize>()?);
            }
            chunked |= l.starts_with("transfer-encoding:") && l.contains("chunked");
        }
        let mut body = vec![];
        if chunked {
            loop {
                line.clear();
                self.io.read_line(&mut line).await?;
                let n = usize::from_str_radix(line.trim(), 16)?;
                let mut chunk = vec![0; n + 2];
                self.io.read_exact(&mut chunk).await?;
                body.extend_from_slice(&chunk[..n]);
                if n == 0 {
                    break;
                }
            }
        } else {
            body.resize(len.context("a length")?, 0);
            self.io.read_exact(&mut body).await?;
        }
        let text = String::from_utf8_lossy(&body);
        anyhow::ensure!(status == "200", "/mcp answered {status}: {text}");
        // An SSE answer (a server that chose a stream): its `data:` line.
        let json = text.lines().find_map(|l| l.strip_prefix("data: ")).unwrap_or(&text);
        Ok(serde_json::from_str(json)?)
    }
}

fn exec_params(id: &str) -> Value {
    json!({"name": "sandbox_exec", "arguments": {"id": id, "argv": ["/bin/true"]}})
}

fn check(answer: &Value) -> anyhow::Result<()> {
    let r = &answer["result"];
    anyhow::ensure!(
        r["isError"] == false && r["structuredContent"]["exit_code"] == 0,
        "sandbox_exec: {answer}"
    );
    Ok(())
}

async fn measure(args: &McpArgs, node: &NodeProc) -> anyhow::Result<()> {
    let url = format!("http://{}", node.addr);
    let client = Client::builder(&url).token(TOKEN).build()?;
    let sandbox = client.claim("host").send().await?;
    let id = sandbox.id().to_string();
    let mut stdio = Stdio::start(&url).await?;
    let mut http = Http { io: BufReader::new(TcpStream::connect(node.addr).await?), next: 1 };
    http.call("initialize", initialize()).await?;
    println!("## MCP (sbx mcp over stdio, a node's /mcp over HTTP)\n\n{}", host_stamp());
    let (mut floor, mut over_stdio, mut over_http) =
        (Samples::default(), Samples::default(), Samples::default());
    for i in 0..WARMUP + args.iters {
        let mut took = [Duration::ZERO; 3];
        for arm in 0..3 {
            let which = (i + arm) % 3;
            let t = Instant::now();
            match which {
                0 => anyhow::ensure!(sandbox.run(["/bin/true"]).await?.success(), "true failed"),
                1 => check(&stdio.call("tools/call", exec_params(&id)).await?)?,
                _ => check(&http.call("tools/call", exec_params(&id)).await?)?,
            }
            took[which] = t.elapsed();
        }
        if i >= WARMUP {
            floor.push(took[0]);
            over_stdio.push(took[1]);
            over_http.push(took[2]);
        }
    }
    let row = |arm: &str, s: &Samples| {
        vec![
            arm.to_string(),
            us(s.pct(0.5)),
            us(s.pct(0.9)),
            us(s.pct(0.99)),
            format!("{:.2}×", s.pct(0.5).as_secs_f64() / floor.pct(0.5).as_secs_f64()),
        ]
    };
    table(
        &format!(
            "`sandbox_exec` of `/bin/true`, call → answer (n = {} per arm, rotating)",
            args.iters
        ),
        &["arm", "p50", "p90", "p99", "p50 vs floor"],
        &[
            row("sdk-rs `run` on a kept relay connection (floor)", &floor),
            row("MCP over stdio (`sbx mcp`)", &over_stdio),
            row("MCP over HTTP (a node's `/mcp`, kept connection)", &over_http),
        ],
    );
    sandbox.release().await?;
    Ok(())
}
