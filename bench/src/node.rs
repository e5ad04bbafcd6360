//! The node section: a throwaway `sandboxd` (release build, jail engine) measured over HTTP.
//!
//! | measurement | floor beside it |
//! |---|---|
//! | warm claim, request → 201 with a usable handle | `GET /healthz` on the same kept connection |
//! | `info` and `exec /bin/true` through the relay (kept upgraded connection) | the same calls on a direct connection to the sandbox's silkd socket |

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use silk_proto::{Command, Connection, ExecRequest, Frame};

use crate::report::{Samples, host_stamp, table, us};

#[derive(Debug, clap::Args)]
pub struct NodeArgs {
    /// A statically linked silkd (default: $SILKD_STATIC).
    #[arg(long, env = "SILKD_STATIC")]
    silkd: PathBuf,
    /// Warm claims to time.
    #[arg(long, default_value_t = 200)]
    claims: usize,
    /// Round trips per arm for the relay comparison.
    #[arg(long, default_value_t = 2000)]
    rtt_iters: usize,
    #[arg(long, default_value = "/var/tmp")]
    dir: PathBuf,
    /// A `sandboxd` of another build (e.g. before a change), measured in the same run: the two
    /// nodes take turns call by call, and each gets its own rows.
    #[arg(long)]
    baseline: Option<PathBuf>,
}

pub(crate) const TOKEN: &str = "bench-root-token";

/// A kept-alive HTTP/1.1 connection.
pub(crate) struct Http {
    reader: BufReader<TcpStream>,
    writer: TcpStream,
}

impl Http {
    pub(crate) fn connect(addr: SocketAddr) -> anyhow::Result<Http> {
        let s = TcpStream::connect(addr)?;
        s.set_nodelay(true)?;
        Ok(Http { reader: BufReader::new(s.try_clone()?), writer: s })
    }

    pub(crate) fn call(
        &mut self,
        method: &str,
        path: &str,
        body: &str,
    ) -> anyhow::Result<(u16, String)> {
        write!(
            self.writer,
            "{method} {path} HTTP/1.1\r\nHost: bench\r\nAuthorization: Bearer {TOKEN}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )?;
        let mut line = String::new();
        self.reader.read_line(&mut line)?;
        let status: u16 = line.split_whitespace().nth(1).context("status line")?.parse()?;
        let mut len = 0;
        loop {
            line.clear();
            self.reader.read_line(&mut line)?;
            if line == "\r\n" {
                break;
            }
            if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                len = v.trim().parse()?;
            }
        }
        let mut body = vec![0; len];
        self.reader.read_exact(&mut body)?;
        Ok((status, String::from_utf8_lossy(&body).into_owned()))
    }
}

pub(crate) fn json(body: &str) -> serde_json::Value {
    serde_json::from_str(body).unwrap_or_default()
}

/// A throwaway `sandboxd` (the release build next to this binary) on 127.0.0.1:0 with its own data
/// directory under `work`. Dropping it kills the node and destroys every jail it left.
pub(crate) struct NodeProc {
    pub addr: SocketAddr,
    pub work: PathBuf,
    /// The process, stopped and its sandboxes removed on drop (see `silk_testkit::Node`).
    _node: silk_testkit::Node,
}

impl NodeProc {
    /// `extra` is TOML appended after the node's own keys (top-level keys first, then tables).
    pub fn start(
        silkd: &std::path::Path,
        work: &std::path::Path,
        extra: &str,
    ) -> anyhow::Result<NodeProc> {
        let sandboxd = std::env::current_exe()?.with_file_name("sandboxd");
        NodeProc::start_binary(&sandboxd, silkd, work, extra)
    }

    /// [`start`](Self::start) with a given `sandboxd` binary.
    pub fn start_binary(
        sandboxd: &std::path::Path,
        silkd: &std::path::Path,
        work: &std::path::Path,
        extra: &str,
    ) -> anyhow::Result<NodeProc> {
        let launch = silk_testkit::Launch {
            sandboxd: sandboxd.to_path_buf(),
            silkd: silkd.to_path_buf(),
            listen: "127.0.0.1:0".into(),
            root_token: TOKEN.into(),
            extra: extra.into(),
        };
        let node = silk_testkit::Node::start_at(launch, work)
            .context("start sandboxd (build it: cargo build --release -p sandboxd)")?;
        Ok(NodeProc { addr: node.addr, work: work.to_path_buf(), _node: node })
    }
}

pub fn run(args: NodeArgs) -> anyhow::Result<()> {
    let work = args.dir.join(format!("silkbench-node-{}", std::process::id()));
    std::fs::create_dir_all(&work)?;
    let config = "max_claims = 100000\n[[pools]]\ntemplate = \"host\"\nwarm = 4\nwarm_max = 4\n";
    let result = (|| {
        let mut nodes = vec![];
        let this = std::env::current_exe()?.with_file_name("sandboxd");
        for (name, binary) in std::iter::once(("this build", this))
            .chain(args.baseline.clone().map(|b| ("baseline", b)))
        {
            let dir = work.join(name.replace(' ', "-"));
            std::fs::create_dir_all(&dir)?;
            nodes.push((name, NodeProc::start_binary(&binary, &args.silkd, &dir, config)?));
        }
        sections(&args, &nodes)
    })();
    // Disk images of sandboxes a killed node left are still mounted.
    silk_engine::jail::unmount_under(&work);
    let _ = std::fs::remove_dir_all(&work);
    result
}

fn wait_warm(http: &mut Http, n: usize) -> anyhow::Result<()> {
    for _ in 0..3000 {
        let (_, info) = http.call("GET", "/v1/info", "")?;
        if json(&info)["pools"][0]["warm"] == n {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    bail!("pool never reached {n} warm")
}

fn row(name: &str, s: &Samples, f: &Samples) -> Vec<String> {
    vec![
        name.into(),
        us(s.pct(0.5)),
        us(s.pct(0.9)),
        us(s.pct(1.0)),
        format!("{:.2}", s.pct(0.5).as_secs_f64() / f.pct(0.5).as_secs_f64()),
    ]
}

/// Per node: kept connection, floor and claim samples, the last claimed sandbox.
struct Arm<'a> {
    name: &'a str,
    node: &'a NodeProc,
    http: Http,
    floor: Samples,
    claim: Samples,
    last: Option<String>,
}

fn sections(args: &NodeArgs, nodes: &[(&str, NodeProc)]) -> anyhow::Result<()> {
    println!("## node (sandboxd)\n\n{}", host_stamp());
    let mut arms = nodes
        .iter()
        .map(|(name, node)| {
            Ok(Arm {
                name,
                node,
                http: Http::connect(node.addr)?,
                floor: Samples::default(),
                claim: Samples::default(),
                last: None,
            })
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    for i in 0..args.claims {
        // With a baseline, the nodes take turns, the order reversed every iteration.
        let order: Vec<usize> =
            if i % 2 == 0 { (0..arms.len()).collect() } else { (0..arms.len()).rev().collect() };
        for a in order {
            let arm = &mut arms[a];
            wait_warm(&mut arm.http, 4)?;
            let t = Instant::now();
            arm.http.call("GET", "/healthz", "")?;
            arm.floor.push(t.elapsed());
            let t = Instant::now();
            let (status, body) = arm.http.call("POST", "/v1/sandboxes", "{}")?;
            let d = t.elapsed();
            anyhow::ensure!(status == 201, "claim answered {status}: {body}");
            let body = json(&body);
            anyhow::ensure!(body["tier"] == "warm", "not a warm hit: {body}");
            arm.claim.push(d);
            if let Some(id) = arm.last.replace(body["id"].as_str().context("id")?.to_string()) {
                arm.http.call("DELETE", &format!("/v1/sandboxes/{id}"), "")?;
            }
        }
    }
    let mut rows = vec![];
    for arm in &arms {
        rows.push(row(
            &format!("{}: `GET /healthz` round trip (floor)", arm.name),
            &arm.floor,
            &arm.floor,
        ));
        rows.push(row(
            &format!("{}: `POST /v1/sandboxes`, warm hit → 201", arm.name),
            &arm.claim,
            &arm.floor,
        ));
    }
    table(
        &format!("warm claim over HTTP (kept connection, n = {})", arms[0].claim.len()),
        &["arm", "p50", "p90", "max", "p50 ratio"],
        &rows,
    );

    // Relay vs direct, on each node's last claimed sandbox, once every pool's refill is done.
    for arm in &mut arms {
        wait_warm(&mut arm.http, 4)?;
    }
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let mut rows = vec![];
    for arm in &arms {
        let id = arm.last.clone().context("no sandbox")?;
        let socket = arm.node.work.join("data/engine/boxes").join(&id).join("agent.sock");
        rt.block_on(async {
            let mut relayed = upgrade(arm.node.addr, &id).await?;
            let mut direct = Connection::new(tokio::net::UnixStream::connect(&socket).await?);
            let exec = Frame::Exec(ExecRequest {
                command: Command { argv: vec!["/bin/true".into()], ..Default::default() },
                ..Default::default()
            });
            for (name, request, iters) in [
                ("`info`", Frame::Info, args.rtt_iters),
                ("`exec /bin/true`", exec, args.rtt_iters / 4),
            ] {
                let (mut d, mut r) = (Samples::default(), Samples::default());
                for i in 0..iters + 50 {
                    let t = Instant::now();
                    call(&mut direct, &request).await?;
                    let dd = t.elapsed();
                    let t = Instant::now();
                    call(&mut relayed, &request).await?;
                    if i >= 50 {
                        d.push(dd);
                        r.push(t.elapsed());
                    }
                }
                rows.push(row(
                    &format!("{}: {name} direct to silkd's socket (floor)", arm.name),
                    &d,
                    &d,
                ));
                rows.push(row(&format!("{}: {name} through the node's relay", arm.name), &r, &d));
            }
            anyhow::Ok(())
        })?;
    }
    table(
        "relay overhead (kept connections, alternating calls)",
        &["arm", "p50", "p90", "max", "p50 ratio"],
        &rows,
    );
    Ok(())
}

pub(crate) async fn upgrade(
    addr: SocketAddr,
    id: &str,
) -> anyhow::Result<Connection<tokio::net::TcpStream>> {
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    s.set_nodelay(true)?;
    s.write_all(format!("GET /v1/sandboxes/{id}/agent HTTP/1.1\r\nHost: bench\r\nAuthorization: Bearer {TOKEN}\r\nConnection: upgrade\r\nUpgrade: silkd\r\n\r\n").as_bytes()).await?;
    let mut reader = tokio::io::BufReader::new(s);
    let mut line = String::new();
    reader.read_line(&mut line).await?;
    anyhow::ensure!(line.contains(" 101 "), "upgrade answered {line}");
    loop {
        line.clear();
        reader.read_line(&mut line).await?;
        if line == "\r\n" {
            break;
        }
    }
    anyhow::ensure!(reader.buffer().is_empty(), "bytes after the 101");
    Ok(Connection::new(reader.into_inner()))
}

pub(crate) async fn call<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin>(
    c: &mut Connection<S>,
    f: &Frame,
) -> anyhow::Result<()> {
    c.send(f).await?;
    loop {
        let frame = c.recv().await?.context("closed")?;
        if frame.is_terminal() {
            anyhow::ensure!(!matches!(frame, Frame::Error(_)), "call failed");
            return Ok(());
        }
    }
}
