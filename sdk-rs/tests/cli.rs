//! The `sbx` binary against a real sandboxd: exit codes pass through, `run` releases what it
//! claimed, `cp` round-trips a tree, and `shell` drives a terminal (through a local pty pair).

mod common;

use std::io::{BufRead, Read, Write};
use std::os::fd::{FromRawFd, OwnedFd};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use common::*;
use serde_json::Value;

fn sbx(node: &Sandboxd) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_sbx"));
    c.env("SBX_ADDR", node.url()).env("SBX_TOKEN", ROOT).env_remove("SBX_SANDBOX_TOKEN");
    c
}

fn json_of(out: &std::process::Output) -> Value {
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

fn live(node: &Sandboxd) -> usize {
    let out = sbx(node).args(["ls", "--json"]).output().unwrap();
    json_of(&out)["sandboxes"].as_array().unwrap().len()
}

#[test]
fn exit_codes_pass_through_and_run_releases() {
    let node = Sandboxd::start(ONE_WARM);
    let out = sbx(&node).args(["run", "--", "sh", "-c", "echo out; exit 3"]).output().unwrap();
    assert_eq!(out.status.code(), Some(3), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(out.stdout, b"out\n");
    assert_eq!(live(&node), 0, "run released its sandbox");
    let out = sbx(&node).args(["run", "--", "/no/such/program"]).output().unwrap();
    assert_eq!(out.status.code(), Some(125), "sbx's own failure");
    assert!(String::from_utf8_lossy(&out.stderr).contains("NotFound"));
    assert_eq!(live(&node), 0, "released on failure too");

    // Ctrl-C while the command runs: the command dies, the sandbox is released, exit 130.
    let mut child = sbx(&node)
        .args(["run", "--", "sh", "-c", "echo started; exec sleep 600"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut started = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap()).read_line(&mut started).unwrap();
    assert_eq!(started, "started\n");
    assert_eq!(live(&node), 1);
    // SAFETY: kill(2) on the child this test spawned and has not reaped.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    assert_eq!(child.wait().unwrap().code(), Some(130));
    assert_eq!(live(&node), 0, "released on Ctrl-C");

    let claimed = json_of(
        &sbx(&node)
            .args(["claim", "--label", "who=cli", "--ttl", "60", "--json"])
            .output()
            .unwrap(),
    );
    let (id, token) = (claimed["id"].as_str().unwrap(), claimed["token"].as_str().unwrap());
    assert_eq!(claimed["metadata"]["who"], "cli");
    // The sandbox token alone is enough for commands on that sandbox.
    let out = sbx(&node)
        .env_remove("SBX_TOKEN")
        .env("SBX_SANDBOX_TOKEN", token)
        .args(["exec", id, "--", "sh", "-c", "echo to-err >&2; exit 5"])
        .output()
        .unwrap();
    assert_eq!((out.status.code(), &out.stderr[..]), (Some(5), &b"to-err\n"[..]));
    let mut child = sbx(&node)
        .args(["exec", "-i", id, "--", "tr", "a-z", "A-Z"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(b"piped through\n").unwrap();
    let out = child.wait_with_output().unwrap();
    assert_eq!((out.status.code(), &out.stdout[..]), (Some(0), &b"PIPED THROUGH\n"[..]));
    let out =
        json_of(&sbx(&node).args(["exec", "--json", id, "--", "echo", "hi"]).output().unwrap());
    assert_eq!((out["exit_code"].as_i64(), out["stdout"].as_str()), (Some(0), Some("hi\n")));

    let listed = String::from_utf8(sbx(&node).arg("ls").output().unwrap().stdout).unwrap();
    assert!(listed.contains(id) && listed.contains("who=cli"), "{listed}");
    let info = String::from_utf8(sbx(&node).arg("info").output().unwrap().stdout).unwrap();
    assert!(info.contains("engine jail") && info.contains("host"), "{info}");
    let pools = json_of(&sbx(&node).args(["pools", "--json"]).output().unwrap());
    assert_eq!(pools["pools"][0]["template"], "host");

    let out = sbx(&node).args(["rm", id]).output().unwrap();
    assert!(out.status.success());
    let out = sbx(&node).args(["rm", id]).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not_found"));
}

#[test]
fn cp_round_trips_a_tree_and_a_file() {
    let node = Sandboxd::start(ONE_WARM);
    let claimed = json_of(&sbx(&node).args(["claim", "--json"]).output().unwrap());
    let id = claimed["id"].as_str().unwrap();
    let local = tempfile::tempdir().unwrap();
    let tree = local.path().join("tree");
    make_tree(&tree);
    let cp = |src: &str, dst: &str| {
        let out = sbx(&node).args(["cp", src, dst]).output().unwrap();
        assert!(out.status.success(), "cp {src} {dst}: {}", String::from_utf8_lossy(&out.stderr));
    };
    // Onto an existing directory: lands inside it, under its own name (both ways).
    cp(tree.to_str().unwrap(), &format!("{id}:/tmp"));
    let back = local.path().join("back");
    std::fs::create_dir(&back).unwrap();
    cp(&format!("{id}:/tmp/tree"), back.to_str().unwrap());
    assert_eq!(tree_hash(&tree), tree_hash(&back.join("tree")));
    // Onto a new name: becomes the copy.
    cp(tree.to_str().unwrap(), &format!("{id}:/tmp/copy"));
    cp(&format!("{id}:/tmp/copy"), local.path().join("again").to_str().unwrap());
    assert_eq!(tree_hash(&tree), tree_hash(&local.path().join("again")));
    // Single files, mode kept.
    cp(tree.join("run.sh").to_str().unwrap(), &format!("{id}:/tmp/tool"));
    cp(&format!("{id}:/tmp/tool"), local.path().join("tool").to_str().unwrap());
    assert_eq!(std::fs::read(local.path().join("tool")).unwrap(), b"#!/bin/sh\necho ran\n");
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(local.path().join("tool")).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o755);
    let out = sbx(&node).args(["cp", &format!("{id}:/tmp/missing"), "x"]).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(sbx(&node).args(["rm", id]).output().unwrap().status.success());
}

/// A pty pair: (master, slave), 80x24.
fn openpty() -> (OwnedFd, OwnedFd) {
    let (mut master, mut slave) = (-1, -1);
    let size = libc::winsize { ws_row: 24, ws_col: 80, ws_xpixel: 0, ws_ypixel: 0 };
    // SAFETY: openpty writes two descriptors into the given ints; name and termios may be null.
    let rc = unsafe {
        libc::openpty(&mut master, &mut slave, std::ptr::null_mut(), std::ptr::null(), &size)
    };
    assert_eq!(rc, 0, "openpty: {}", std::io::Error::last_os_error());
    // SAFETY: both descriptors were just opened and are owned by nobody else.
    unsafe { (OwnedFd::from_raw_fd(master), OwnedFd::from_raw_fd(slave)) }
}

fn canonical(fd: &OwnedFd) -> bool {
    use std::os::fd::AsRawFd;
    // SAFETY: termios is plain old data filled by tcgetattr.
    let mut t: libc::termios = unsafe { std::mem::zeroed() };
    // SAFETY: a valid descriptor and a writable termios.
    assert_eq!(unsafe { libc::tcgetattr(fd.as_raw_fd(), &mut t) }, 0);
    t.c_lflag & libc::ICANON != 0 && t.c_lflag & libc::ECHO != 0
}

#[test]
fn shell_drives_a_terminal() {
    let node = Sandboxd::start(ONE_WARM);
    let claimed = json_of(&sbx(&node).args(["claim", "--json"]).output().unwrap());
    let id = claimed["id"].as_str().unwrap();
    let (master, slave) = openpty();
    assert!(canonical(&slave));
    let mut child = sbx(&node)
        .args(["shell", id])
        .env("TERM", "xterm")
        .stdin(Stdio::from(slave.try_clone().unwrap()))
        .stdout(Stdio::from(slave.try_clone().unwrap()))
        .stderr(Stdio::from(slave.try_clone().unwrap()))
        .spawn()
        .unwrap();

    // Everything the terminal shows, read on a thread (a pty master read blocks).
    let (tx, rx) = mpsc::channel::<Vec<u8>>();
    let mut reader = std::fs::File::from(master.try_clone().unwrap());
    std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        while let Ok(n) = reader.read(&mut buf) {
            if n == 0 || tx.send(buf[..n].to_vec()).is_err() {
                break;
            }
        }
    });
    let mut screen = String::new();
    let mut wait_for = |what: &str| {
        while !screen.contains(what) {
            let chunk = rx
                .recv_timeout(Duration::from_secs(30))
                .unwrap_or_else(|_| panic!("terminal never showed {what:?}; it shows {screen:?}"));
            screen.push_str(&String::from_utf8_lossy(&chunk));
        }
    };
    let mut typer = std::fs::File::from(master);
    // The remote shell's prompt says it is ready for input.
    wait_for("# ");
    typer.write_all(b"echo hello-$((6*7))\n").unwrap();
    wait_for("hello-42");
    typer.write_all(b"exit 4\n").unwrap();
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(4), "the shell's exit code passes through");
    assert!(canonical(&slave), "sbx restored the terminal");
    assert!(sbx(&node).args(["rm", id]).output().unwrap().status.success());
}

#[test]
fn lifecycle_verbs() {
    let node = Sandboxd::start(ONE_WARM);
    let claimed = json_of(&sbx(&node).args(["claim", "--json"]).output().unwrap());
    let id = claimed["id"].as_str().unwrap().to_string();
    let ok = |args: &[&str]| {
        let out = sbx(&node).args(args).output().unwrap();
        assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    };
    ok(&["exec", &id, "--", "sh", "-c", "echo kept > /root/f"]);
    assert_eq!(ok(&["hibernate", &id]).trim(), format!("{id} hibernated (processes kept)"));
    assert_eq!(ok(&["wake", &id]).trim(), format!("{id} claimed (processes kept)"));
    let off = ok(&["hibernate", &id, "--memory", "off"]);
    assert!(off.starts_with(&format!("{id} hibernated (files only: ")), "{off}");
    let bad = sbx(&node).args(["hibernate", &id, "--memory", "sometimes"]).output().unwrap();
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("one of auto, required, off"));
    ok(&["wake", &id]);
    let ck = ok(&["checkpoint", &id, "--name", "cli"]).trim().to_string();
    assert!(ck.starts_with("ck_"), "{ck}");
    assert!(ok(&["checkpoints"]).contains(&ck));
    let branch = json_of(&sbx(&node).args(["branch", &ck, "--json"]).output().unwrap());
    let bid = branch["sandboxes"][0]["id"].as_str().unwrap();
    assert_eq!(ok(&["exec", bid, "--", "cat", "/root/f"]), "kept\n");
    let forked = json_of(&sbx(&node).args(["fork", &id, "-n", "2", "--json"]).output().unwrap());
    assert_eq!(forked["sandboxes"].as_array().unwrap().len(), 2);
    assert!(ok(&["promote", &id, "cli-made"]).starts_with("cli-made "));
    assert!(ok(&["templates"]).contains("promoted"));
    assert_eq!(ok(&["archive", &id]).trim(), format!("{id} archived (processes kept)"));
    assert_eq!(ok(&["exec", &id, "--", "cat", "/root/f"]), "kept\n", "exec wakes it");
    ok(&["rm-checkpoint", &ck]);
    ok(&["rm-template", "cli-made"]);
    let out = sbx(&node).args(["fork", &id, "-n", "99"]).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("count"), "a clear error");
}

/// One GET on a fresh connection: the status, the head and the body.
fn get(addr: &str, path: &str, extra: &str) -> (u16, String, String) {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    write!(s, "GET {path} HTTP/1.1\r\nHost: {addr}\r\n{extra}Connection: close\r\n\r\n").unwrap();
    let mut answer = String::new();
    s.read_to_string(&mut answer).unwrap();
    let (head, body) = answer.split_once("\r\n\r\n").unwrap_or((&answer, ""));
    (head.split(' ').nth(1).unwrap().parse().unwrap(), head.to_string(), body.to_string())
}

#[test]
fn open_prints_a_preview_url_and_port_forward_reaches_a_port() {
    let node = Sandboxd::start(ONE_WARM);
    let claimed = json_of(&sbx(&node).args(["claim", "--json"]).output().unwrap());
    let id = claimed["id"].as_str().unwrap();
    let serve = "echo served > /root/page.txt; cd /root && setsid python3 -m http.server 8000 >/dev/null 2>&1 < /dev/null &";
    let out = sbx(&node).args(["exec", id, "--", "sh", "-c", serve]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));

    // `sbx open`: a URL a browser opens with no token of its own.
    let url =
        String::from_utf8(sbx(&node).args(["open", id, "8000"]).output().unwrap().stdout).unwrap();
    let url = url.trim();
    let rest = url.strip_prefix("http://").unwrap();
    let (addr, path) = rest.split_once('/').unwrap();
    assert_eq!(addr, node.addr.to_string(), "{url}");
    let page = format!("/{}", path.replace("/?", "/page.txt?"));
    let (status, head, body) = get(addr, &page, "");
    assert_eq!(status, 303, "{head}{body}");
    let cookie = head.lines().find_map(|l| l.strip_prefix("set-cookie: ")).unwrap();
    let cookie = cookie.split(';').next().unwrap();
    let location = head.lines().find_map(|l| l.strip_prefix("location: ")).unwrap();
    silk_testkit::eventually("the server listens", || {
        get(addr, location, &format!("Cookie: {cookie}\r\n")).0 != 502
    });
    let (status, _, body) = get(addr, location, &format!("Cookie: {cookie}\r\n"));
    assert_eq!((status, body.as_str()), (200, "served\n"));

    // `sbx port-forward`: a local port to the sandbox's, until Ctrl-C.
    let mut child =
        sbx(&node).args(["port-forward", id, "0:8000"]).stderr(Stdio::piped()).spawn().unwrap();
    let mut line = String::new();
    std::io::BufReader::new(child.stderr.take().unwrap()).read_line(&mut line).unwrap();
    let local = line.split_whitespace().nth(1).unwrap().to_string();
    let (status, _, body) = get(&local, "/page.txt", "");
    assert_eq!((status, body.as_str()), (200, "served\n"), "{line}");
    // SAFETY: kill(2) on the child this test spawned and has not reaped.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    assert!(child.wait().unwrap().success());
    // Ctrl-C the moment the line appears (as a script would): a clean end, not a kill.
    for _ in 0..3 {
        let mut child =
            sbx(&node).args(["port-forward", id, "0:8000"]).stderr(Stdio::piped()).spawn().unwrap();
        let mut line = String::new();
        std::io::BufReader::new(child.stderr.take().unwrap()).read_line(&mut line).unwrap();
        // SAFETY: kill(2) on the child this test spawned and has not reaped.
        unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
        let status = child.wait().unwrap();
        assert!(status.success(), "{status} after {line:?}");
    }

    // `sbx claim --allow`: lane egress under that policy.
    let claimed = json_of(
        &sbx(&node)
            .args(["claim", "--allow", "pypi.org", "--deny", "x.pypi.org", "--json"])
            .output()
            .unwrap(),
    );
    assert_eq!(claimed["lane"], "egress");
    assert_eq!(
        claimed["egress"],
        serde_json::json!({ "allow": ["pypi.org"], "deny": ["x.pypi.org"] })
    );
}

#[test]
fn templates_add_follows_a_registry_pull_and_reports_a_bad_image() {
    use silk_testkit::registry::{Auth, Registry};
    let dir = tempfile::tempdir().unwrap();
    let registry = Registry::start("127.0.0.65", Auth::Anonymous);
    let archive = dir.path().join("tiny.tar");
    silk_testkit::images::busybox_archive(&archive, "hello from sbx", &[]);
    let digest = registry.push_archive(&archive, "tiny:v1", false);
    let host = registry.host();
    let node = Sandboxd::start(&format!("[registries.\"{host}\"]\ninsecure = true\n"));
    let out = sbx(&node).args(["templates", "add", "tiny", &format!("{host}/tiny:v1")]).output();
    let out = out.unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), format!("tiny ready {digest}"));
    let run = ["run", "--template", "tiny", "--", "sh", "-c", "echo $GREETING"];
    let out = sbx(&node).args(run).output().unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "hello from sbx\n");
    let listed = sbx(&node).args(["templates"]).output().unwrap();
    let listed = String::from_utf8_lossy(&listed.stdout).to_string();
    assert!(
        listed
            .lines()
            .any(|l| l.starts_with("tiny") && l.contains("registered") && l.contains("ready")),
        "{listed}"
    );

    let out = sbx(&node).args(["templates", "add", "nope", &format!("{host}/nope:v1")]).output();
    let out = out.unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("image_not_found"), "{out:?}");
}
