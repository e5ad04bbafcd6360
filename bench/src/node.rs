//! The node section: a throwaway `sandboxd` (release build, jail engine) measured over HTTP.
//!
//! | measurement | floor beside it |
//! |---|---|
//! | warm claim, request → 201 with a usable handle | `GET /healthz` on the same kept connection |
//! | two more warm claims right after it, back to back (the same work with warm caches) | the same |
//! | `info` and `exec /bin/true` through the relay (kept upgraded connection) | the same calls on a direct connection to the sandbox's silkd socket |
//!
//! With `--tls`, a second node of this build serves its API over TLS (a development
//! certificate) and is measured the same way, call for call beside the plain one.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use silk_proto::{Command, Connection, ExecRequest, Frame};

mod scale;

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
    /// Also measure this build with its API over TLS.
    #[arg(long)]
    tls: bool,
    /// Also time a burst of this many claims from a pool pre-filled with as many, by
    /// `--burst-clients` clients at once, beside as many `GET /healthz` (0: skipped).
    #[arg(long, default_value_t = 0)]
    burst: usize,
    #[arg(long, default_value_t = 16)]
    burst_clients: usize,
    /// Also time `GET /v1/checkpoints` with this many checkpoints in the node's (fs) store,
    /// on this build and the baseline (0: skipped).
    #[arg(long, default_value_t = 0)]
    checkpoints: usize,
}

pub(crate) const TOKEN: &str = "bench-root-token";

/// A kept-alive HTTP/1.1 connection (over TLS when made by [`Http::connect_tls`]).
pub(crate) struct Http {
    io: BufReader<Box<dyn Duplex>>,
}

/// A blocking byte stream both ways: a socket, or TLS over one.
pub(crate) trait Duplex: Read + Write + Send {}
impl<T: Read + Write + Send> Duplex for T {}

impl Http {
    pub(crate) fn connect(addr: SocketAddr) -> anyhow::Result<Http> {
        let s = TcpStream::connect(addr)?;
        s.set_nodelay(true)?;
        Ok(Http { io: BufReader::new(Box::new(s)) })
    }

    /// TLS to `addr`, trusting `tls`'s roots, its certificate checked for 127.0.0.1.
    pub(crate) fn connect_tls(
        addr: SocketAddr,
        tls: &std::sync::Arc<rustls::ClientConfig>,
    ) -> anyhow::Result<Http> {
        let s = TcpStream::connect(addr)?;
        s.set_nodelay(true)?;
        let name = rustls::pki_types::ServerName::try_from("127.0.0.1")?;
        let conn = rustls::ClientConnection::new(tls.clone(), name)?;
        Ok(Http { io: BufReader::new(Box::new(rustls::StreamOwned::new(conn, s))) })
    }

    pub(crate) fn call(
        &mut self,
        method: &str,
        path: &str,
        body: &str,
    ) -> anyhow::Result<(u16, String)> {
        // One write, as an HTTP client sends a request: `write!` on the socket itself would send
        // each piece of the format as its own segment (the socket has TCP_NODELAY), and the
        // node would wake for every one of them.
        let request = format!(
            "{method} {path} HTTP/1.1\r\nHost: bench\r\nAuthorization: Bearer {TOKEN}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        self.io.get_mut().write_all(request.as_bytes())?;
        let mut line = String::new();
        self.io.read_line(&mut line)?;
        let status: u16 = line.split_whitespace().nth(1).context("status line")?.parse()?;
        let mut len = 0;
        loop {
            line.clear();
            self.io.read_line(&mut line)?;
            if line == "\r\n" {
                break;
            }
            if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                len = v.trim().parse()?;
            }
        }
        let mut body = vec![0; len];
        self.io.read_exact(&mut body)?;
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

    /// The node's process id.
    pub fn pid(&self) -> u32 {
        self._node.child.as_ref().map_or(0, std::process::Child::id)
    }
}

pub fn run(args: NodeArgs) -> anyhow::Result<()> {
    let work = args.dir.join(format!("silkbench-node-{}", std::process::id()));
    std::fs::create_dir_all(&work)?;
    let config = "max_claims = 100000\n[[pools]]\ntemplate = \"host\"\nwarm = 4\nwarm_max = 4\n";
    let result = (|| {
        let mut nodes = vec![];
        let this = std::env::current_exe()?.with_file_name("sandboxd");
        for (name, binary) in std::iter::once(("this build", this.clone()))
            .chain(args.baseline.clone().map(|b| ("baseline", b)))
        {
            let dir = work.join(name.replace(' ', "-"));
            std::fs::create_dir_all(&dir)?;
            let node = NodeProc::start_binary(&binary, &args.silkd, &dir, config)?;
            nodes.push((name, node, None));
        }
        if args.tls {
            let certs = work.join("certs");
            let made = std::process::Command::new(&this)
                .args(["tls", "self-signed", "--name", "127.0.0.1", "--dir"])
                .arg(&certs)
                .output()?;
            anyhow::ensure!(made.status.success(), "{}", String::from_utf8_lossy(&made.stderr));
            let tls = format!(
                "{config}[tls]\ncert = {:?}\nkey = {:?}\n",
                certs.join("127.0.0.1.pem"),
                certs.join("127.0.0.1.key")
            );
            let dir = work.join("this-build-tls");
            std::fs::create_dir_all(&dir)?;
            let node = NodeProc::start_binary(&this, &args.silkd, &dir, &tls)?;
            nodes.push((
                "this build over TLS",
                node,
                Some(silk_testkit::tls_client(&certs.join("ca.pem"))),
            ));
        }
        sections(&args, &nodes)?;
        drop(nodes);
        if args.burst > 0 {
            scale::burst(&args, &work)?;
        }
        if args.checkpoints > 0 {
            scale::listing(&args, &work)?;
        }
        Ok(())
    })();
    // Disk images of sandboxes a killed node left are still mounted.
    silk_engine::jail::unmount_under(&work);
    let _ = std::fs::remove_dir_all(&work);
    result
}

fn wait_warm(http: &mut Http, n: usize) -> anyhow::Result<()> {
    wait_warm_for(http, n, Duration::from_secs(15))
}

pub(crate) fn wait_warm_for(http: &mut Http, n: usize, within: Duration) -> anyhow::Result<()> {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        let (_, info) = http.call("GET", "/v1/info", "")?;
        if json(&info)["pools"][0]["warm"] == n {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    bail!("pool never reached {n} warm")
}

pub(crate) fn row(name: &str, s: &Samples, f: &Samples) -> Vec<String> {
    vec![
        name.into(),
        us(s.pct(0.5)),
        us(s.pct(0.9)),
        us(s.pct(1.0)),
        format!("{:.2}", s.pct(0.5).as_secs_f64() / f.pct(0.5).as_secs_f64()),
    ]
}

/// One claim that must be a warm hit: its round trip, the node's own account of it
/// (`claim_micros`) and the sandbox's id.
fn warm_claim(http: &mut Http) -> anyhow::Result<(Duration, Duration, String)> {
    let t = Instant::now();
    let (status, body) = http.call("POST", "/v1/sandboxes", "{}")?;
    let took = t.elapsed();
    anyhow::ensure!(status == 201, "claim answered {status}: {body}");
    let body = json(&body);
    anyhow::ensure!(body["tier"] == "warm", "not a warm hit: {body}");
    let micros = body["claim_micros"].as_u64().context("claim_micros")?;
    let id = body["id"].as_str().context("id")?.to_string();
    Ok((took, Duration::from_micros(micros), id))
}

/// Per node: kept connection, floor and claim samples, this iteration's claimed sandboxes.
struct Arm<'a> {
    name: &'a str,
    node: &'a NodeProc,
    tls: Option<&'a std::sync::Arc<rustls::ClientConfig>>,
    http: Http,
    floor: Samples,
    claim: Samples,
    /// The node's own account of each claim (`claim_micros`).
    node_work: Samples,
    /// `POST /v1/sandboxes` refused after its parsing and auth: the claim's HTTP path alone.
    refused: Samples,
    /// Two more claims right after the timed one, and the node's account of them: the same
    /// work with its code and data still in the caches the idle gap had cooled.
    back_to_back: Samples,
    back_to_back_node: Samples,
    /// This iteration's claims, released at the start of the next.
    last: Vec<String>,
}

type TlsClient = Option<std::sync::Arc<rustls::ClientConfig>>;

fn sections(args: &NodeArgs, nodes: &[(&str, NodeProc, TlsClient)]) -> anyhow::Result<()> {
    println!("## node (sandboxd)\n\n{}", host_stamp());
    let mut arms = nodes
        .iter()
        .map(|(name, node, tls)| {
            let http = match tls {
                Some(tls) => Http::connect_tls(node.addr, tls)?,
                None => Http::connect(node.addr)?,
            };
            Ok(Arm {
                name,
                node,
                tls: tls.as_ref(),
                http,
                floor: Samples::default(),
                claim: Samples::default(),
                node_work: Samples::default(),
                refused: Samples::default(),
                back_to_back: Samples::default(),
                back_to_back_node: Samples::default(),
                last: vec![],
            })
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    for i in 0..args.claims {
        // With a baseline, the nodes take turns, the order reversed every iteration.
        let order: Vec<usize> =
            if i % 2 == 0 { (0..arms.len()).collect() } else { (0..arms.len()).rev().collect() };
        // Every node quiet first: the last claim released (its teardown runs in the
        // background), every pool refilled, a moment for the teardowns to end.
        for arm in &mut arms {
            for id in std::mem::take(&mut arm.last) {
                arm.http.call("DELETE", &format!("/v1/sandboxes/{id}"), "")?;
            }
        }
        for arm in &mut arms {
            wait_warm(&mut arm.http, 4)?;
        }
        std::thread::sleep(Duration::from_millis(5));
        for a in order {
            let arm = &mut arms[a];
            // Threads that slept through the pause wake up on these, not on the timed calls.
            for _ in 0..3 {
                arm.http.call("GET", "/healthz", "")?;
            }
            let t = Instant::now();
            arm.http.call("GET", "/healthz", "")?;
            arm.floor.push(t.elapsed());
            let t = Instant::now();
            let (status, body) =
                arm.http.call("POST", "/v1/sandboxes", r#"{"template":"no-such"}"#)?;
            arm.refused.push(t.elapsed());
            anyhow::ensure!(
                status == 404,
                "a claim of an unknown template answered {status}: {body}"
            );
            let (d, node, id) = warm_claim(&mut arm.http)?;
            arm.claim.push(d);
            arm.node_work.push(node);
            arm.last.push(id);
            // The pool held 4: these are warm hits too.
            for _ in 0..2 {
                let (d, node, id) = warm_claim(&mut arm.http)?;
                arm.back_to_back.push(d);
                arm.back_to_back_node.push(node);
                arm.last.push(id);
            }
        }
    }
    let mut rows = vec![];
    for arm in &arms {
        for (what, samples) in [
            ("`GET /healthz` round trip (floor)", &arm.floor),
            ("`POST /v1/sandboxes`, warm hit → 201", &arm.claim),
            ("… of which the node's claim (`claim_micros`)", &arm.node_work),
            ("`POST /v1/sandboxes`, unknown template → 404", &arm.refused),
            ("`POST /v1/sandboxes`, 2nd and 3rd claims back to back → 201", &arm.back_to_back),
            ("… of which the node's claim", &arm.back_to_back_node),
        ] {
            rows.push(row(&format!("{}: {what}", arm.name), samples, &arm.floor));
        }
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
        let id = arm.last.last().cloned().context("no sandbox")?;
        let record = arm.node.work.join("data/engine/boxes").join(&id).join("box.json");
        let record: serde_json::Value = serde_json::from_slice(&std::fs::read(record)?)?;
        let agent: silk_engine::AgentAddr =
            serde_json::from_value(record["info"]["agent"].clone())?;
        rt.block_on(async {
            let mut relayed = upgrade_with(arm.node.addr, &id, arm.tls).await?;
            let direct = tokio::net::UnixStream::from_std(silk_engine::agent::connect(&agent)?)?;
            let mut direct = Connection::new(direct);
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
    connect_cost(&arms[0], args.rtt_iters)
}

/// What opening a connection to a sandbox's silkd costs the node (`silk_engine::agent::connect`:
/// its network namespace entered and left on the calling thread) beside a plain connect to a
/// unix socket by path (the floor: how the node reached silkd before it listened inside).
fn connect_cost(arm: &Arm<'_>, iters: usize) -> anyhow::Result<()> {
    let id = arm.last.last().cloned().context("no sandbox")?;
    let record = arm.node.work.join("data/engine/boxes").join(&id).join("box.json");
    let record: serde_json::Value = serde_json::from_slice(&std::fs::read(record)?)?;
    let agent: silk_engine::AgentAddr = serde_json::from_value(record["info"]["agent"].clone())?;
    let path = arm.node.work.join("floor.sock");
    let listener = std::os::unix::net::UnixListener::bind(&path)?;
    std::thread::spawn(move || {
        for s in listener.incoming() {
            drop(s)
        }
    });
    let (mut floor, mut ours) = (Samples::default(), Samples::default());
    for i in 0..iters + 50 {
        let t = Instant::now();
        drop(std::os::unix::net::UnixStream::connect(&path)?);
        let f = t.elapsed();
        let t = Instant::now();
        drop(silk_engine::agent::connect(&agent)?);
        if i >= 50 {
            floor.push(f);
            ours.push(t.elapsed());
        }
    }
    table(
        "connecting to silkd (alternating, n per arm as above)",
        &["arm", "p50", "p90", "max", "p50 ratio"],
        &[
            row("connect to a unix socket by path (floor)", &floor, &floor),
            row("connect into the jail's network namespace (`agent::connect`)", &ours, &floor),
        ],
    );
    Ok(())
}

pub(crate) async fn upgrade(
    addr: SocketAddr,
    id: &str,
) -> anyhow::Result<Connection<tokio::net::TcpStream>> {
    let tcp = tokio::net::TcpStream::connect(addr).await?;
    tcp.set_nodelay(true)?;
    upgrade_on(tcp, id).await
}

/// An async byte stream both ways: a socket, or TLS over one.
pub(crate) trait AsyncDuplex:
    tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send
{
}
impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send> AsyncDuplex for T {}

/// [`upgrade`], over TLS when `tls` is given.
async fn upgrade_with(
    addr: SocketAddr,
    id: &str,
    tls: Option<&std::sync::Arc<rustls::ClientConfig>>,
) -> anyhow::Result<Connection<Box<dyn AsyncDuplex>>> {
    let tcp = tokio::net::TcpStream::connect(addr).await?;
    tcp.set_nodelay(true)?;
    let stream: Box<dyn AsyncDuplex> = match tls {
        None => Box::new(tcp),
        Some(tls) => {
            let mut config = (**tls).clone();
            // The relay is an HTTP/1.1 upgrade.
            config.alpn_protocols = vec![b"http/1.1".to_vec()];
            let name = rustls::pki_types::ServerName::try_from("127.0.0.1")?;
            let connector = tokio_rustls::TlsConnector::from(std::sync::Arc::new(config));
            Box::new(connector.connect(name, tcp).await?)
        }
    };
    upgrade_on(stream, id).await
}

async fn upgrade_on<S: AsyncDuplex>(mut s: S, id: &str) -> anyhow::Result<Connection<S>> {
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
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
