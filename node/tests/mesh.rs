//! The mesh between real sandboxd processes on 127.0.0.x: membership, capacity gossip, claim
//! placement by redirect and by forwarding, ownership from every node, drain, a killed node,
//! and a node whose certificate comes from another CA.
//!
//! Sandboxes that move between these nodes (and branch, and wake where their archive is) are
//! in `mesh_moves.rs`.

mod common;

use std::time::{Duration, Instant};

use common::mesh::*;
use common::*;

/// The `Location` of a redirect.
fn location(n: &Sandboxd, method: &str, path: &str, token: &str, body: Option<&str>) -> String {
    let (status, location, v) = raw(n.addr, method, path, token, body.unwrap_or(""));
    location.unwrap_or_else(|| panic!("no Location in a {status}: {v}"))
}

#[test]
fn three_nodes_place_claims_on_warm_peers_and_answer_for_every_sandbox() {
    let dir = tempfile::tempdir().unwrap();
    certs(dir.path(), &["a", "b", "c"]);
    let a =
        node(dir.path(), "a", 2, None, "[[pools]]\ntemplate = \"host\"\nwarm = 2\nwarm_max = 2\n");
    let seed = mesh_addr(&a);
    let b = node(dir.path(), "b", 3, Some(&seed), "pools = []\n");
    let c = node(dir.path(), "c", 4, Some(&seed), "pools = []\n");
    eventually("a full mesh", || {
        peer_names(&a) == ["b", "c"] && peer_names(&b) == ["a", "c"] && peer_names(&c) == ["a", "b"]
    });
    a.wait_warm(2);
    let t = Instant::now();
    eventually("a's warm capacity on b and c", || {
        peer_warm(&b, "a") == Some(2) && peer_warm(&c, "a") == Some(2)
    });
    assert!(t.elapsed() < Duration::from_secs(1), "capacity took {:?} to spread", t.elapsed());

    // b has no warm pool: its claim goes to a, one hop.
    let (first, status, claimed) = follow(&b, "POST", "/v1/sandboxes", ROOT, Some("{}"));
    assert_eq!((first, status), (307, 201), "{claimed}");
    assert_eq!(claimed["tier"], "warm");
    assert!(claimed["owner"].as_str().unwrap().starts_with("127.0.0.2:"), "{claimed}");
    let location = location(&b, "POST", "/v1/sandboxes", ROOT, Some("{}"));
    assert!(location.ends_with("/v1/sandboxes?no_redirect=1"), "{location}");
    // The retry is served where it lands, never bounced again.
    let (status, v) = b.req("POST", "/v1/sandboxes?no_redirect=1", Some(ROOT), Some("{}"));
    assert_eq!(status, 201, "{v}");
    assert!(v["owner"].as_str().unwrap().starts_with("127.0.0.3:"), "served by b itself: {v}");

    // Ownership: every node answers for the sandbox; a wrong token is the same 404 everywhere.
    let (id, token) = (claimed["id"].as_str().unwrap(), claimed["token"].as_str().unwrap());
    for n in [&a, &b, &c] {
        let (_, status, row) = follow(n, "GET", &format!("/v1/sandboxes/{id}"), token, None);
        assert_eq!((status, row["id"].as_str()), (200, Some(id)), "{row}");
        let (first, status, v) =
            follow(n, "GET", &format!("/v1/sandboxes/{id}"), WRONG_TOKEN, None);
        assert_eq!(
            (first, status, v["error"]["code"].as_str()),
            (404, 404, Some("not_found")),
            "{v}"
        );
        let (_, status, out) = follow(
            n,
            "POST",
            &format!("/v1/sandboxes/{id}/exec"),
            token,
            Some(r#"{"argv":["hostname"]}"#),
        );
        assert_eq!(
            (status, out["stdout"].as_str()),
            (200, Some(format!("{id}\n").as_str())),
            "{out}"
        );
    }
    let (status, _) = c.req("GET", "/v1/sandboxes/sb-00000000-000000000000", Some(ROOT), None);
    assert_eq!(status, 404, "an id nobody holds");

    // Drain a: its warm capacity leaves the gossip within a second; claims stay local.
    assert_eq!(a.req("POST", "/v1/drain", Some(ROOT), None).0, 200);
    let t = Instant::now();
    eventually("a's drain on b", || {
        peers(&b)["peers"].as_array().unwrap().iter().any(|p| {
            p["name"] == "a"
                && p["draining"] == true
                && p["warm"].as_object().is_some_and(|w| w.is_empty())
        })
    });
    assert!(t.elapsed() < Duration::from_secs(1), "drain took {:?} to spread", t.elapsed());
    let (first, _, v) = follow(&c, "POST", "/v1/sandboxes", ROOT, Some("{}"));
    assert_eq!(first, 201, "no redirect to a draining node: {v}");
    assert_eq!(a.req("DELETE", "/v1/drain", Some(ROOT), None).0, 200);
    eventually("a undrained on b", || peer_warm(&b, "a").is_some_and(|w| w > 0));

    // Kill a: it leaves every view within 5 s, and claims keep succeeding without it.
    let mut a = a;
    a.kill9();
    let t = Instant::now();
    eventually("a declared down", || peer_names(&b) == ["c"] && peer_names(&c) == ["b"]);
    let took = t.elapsed();
    assert!(took < Duration::from_secs(5), "failure detection took {took:?}");
    println!("failure detected in {took:?}");
    let (first, status, v) = follow(&b, "POST", "/v1/sandboxes", ROOT, Some("{}"));
    assert_eq!((first, status), (201, 201), "never sent to a dead node: {v}");
}

#[test]
fn forward_mode_serves_claims_calls_and_the_relay_through_one_node() {
    let dir = tempfile::tempdir().unwrap();
    certs(dir.path(), &["owner", "front"]);
    let owner = node(
        dir.path(),
        "owner",
        5,
        None,
        "[[pools]]\ntemplate = \"host\"\nwarm = 1\nwarm_max = 1\n",
    );
    let mut front_cfg = String::from("pools = []\n");
    front_cfg.push_str("");
    let front = Sandboxd::start_at(
        "127.0.0.6:0",
        &format!(
            "pools = []\n[mesh]\nname = \"front\"\nlisten = \"127.0.0.6:0\"\njoin = [\"{}\"]\nforward = true\nca = \"{d}/ca.pem\"\ncert = \"{d}/front.pem\"\nkey = \"{d}/front.key\"\n",
            mesh_addr(&owner),
            d = dir.path().display()
        ),
    );
    owner.wait_warm(1);
    eventually("front sees owner's capacity", || peer_warm(&front, "owner") == Some(1));

    // The client talks to `front` only.
    let (status, claimed) = front.req("POST", "/v1/sandboxes", Some(ROOT), Some("{}"));
    assert_eq!(status, 201, "forwarded, not redirected: {claimed}");
    assert!(claimed["owner"].as_str().unwrap().starts_with("127.0.0.5:"));
    let (id, token) = (claimed["id"].as_str().unwrap(), claimed["token"].as_str().unwrap());
    let out = front.exec(id, token, "echo forwarded; hostname");
    assert_eq!(out["stdout"], format!("forwarded\n{id}\n"));
    let (status, _) = front.req("GET", &format!("/v1/sandboxes/{id}"), Some(WRONG_TOKEN), None);
    assert_eq!(status, 404);
    // A forwarded answer is the owner's own: status, headers (all but the date) and body.
    let get = format!("GET /v1/sandboxes/{id} HTTP/1.1\r\nAuthorization: Bearer {token}\r\n");
    let (direct, forwarded) = (raw_answer(owner.addr, &get), raw_answer(front.addr, &get));
    assert!(direct.0.contains(" 200 "), "{direct:?}");
    assert_eq!(forwarded, direct);
    // Forwarded answers leave the client's connection open: two calls on one connection.
    let mut kept = std::net::TcpStream::connect(front.addr).unwrap();
    for _ in 0..2 {
        use std::io::{BufRead, Read, Write};
        write!(kept, "{get}Host: x\r\n\r\n").unwrap();
        let mut reader = std::io::BufReader::new(&kept);
        let (mut line, mut length) = (String::new(), 0);
        reader.read_line(&mut line).unwrap();
        assert!(line.contains(" 200 "), "{line}");
        while line != "\r\n" {
            line.clear();
            reader.read_line(&mut line).unwrap();
            if let Some(n) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                length = n.trim().parse().unwrap();
            }
        }
        let mut body = vec![0; length];
        reader.read_exact(&mut body).unwrap();
        assert!(reader.buffer().is_empty());
    }
    // A body too large to keep for a resend (here 100 000 bytes of stdin) streams through once.
    let big = serde_json::json!({ "argv": ["wc", "-c"], "stdin": "x".repeat(100_000) });
    let (status, out) =
        front.req("POST", &format!("/v1/sandboxes/{id}/exec"), Some(token), Some(&big.to_string()));
    assert_eq!((status, out["stdout"].as_str().map(str::trim)), (200, Some("100000")), "{out}");
    // So is a refusal on the relay path: the owner's JSON error, not the front's text.
    let plain =
        format!("GET /v1/sandboxes/{id}/agent HTTP/1.1\r\nAuthorization: Bearer {token}\r\n");
    let (status, headers, body) = raw_answer(front.addr, &plain);
    assert!(status.contains(" 426 "), "{status} {body}");
    assert!(headers.iter().any(|h| h == "content-type: application/json"), "{headers:?}");
    assert!(body.contains("\"upgrade_required\""), "{body}");

    // The data plane through front: an upgraded connection carrying silk-proto to the sandbox.
    let stream = upgrade(front.addr, id, token);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async move {
        let mut conn = relay_connection(stream);
        let (out, code) = relay_exec(&mut conn, &["echo", "relayed"]).await;
        assert_eq!(code, 0);
        assert_eq!(out, b"relayed\n");
    });
    // Its silkd dies (an OOM kill): a forwarded relay restarts it on the owner, as a local one
    // does.
    owner.kill_sandbox_processes(id);
    let stream = upgrade(front.addr, id, token);
    rt.block_on(async move {
        let mut conn = relay_connection(stream);
        let (out, code) = relay_exec(&mut conn, &["echo", "restarted"]).await;
        assert_eq!((code, out), (0, b"restarted\n".to_vec()));
    });
    let (status, _) = front.req("DELETE", &format!("/v1/sandboxes/{id}"), Some(token), None);
    assert_eq!(status, 204);
    let (status, _) = owner.req("GET", &format!("/v1/sandboxes/{id}"), Some(token), None);
    assert_eq!(status, 404, "released on the owner");

    // A claim that asks for the relay and for silkd's answer, placed on the owner through
    // front: the owner's `101`, row and answer come back through front, and the connection
    // reaches the new sandbox's silkd.
    owner.wait_warm(1);
    eventually("front sees owner's capacity", || peer_warm(&front, "owner") == Some(1));
    let (status, row, answered, stream) = claim_asking(front.addr, ROOT, "{}");
    assert!(status.contains(" 101 "), "{status} {row}");
    assert!(answered.is_some_and(|a| a["connections"] == 1), "the owner asked its silkd");
    assert!(row["owner"].as_str().unwrap().starts_with("127.0.0.5:"), "{row}");
    let id = row["id"].as_str().unwrap().to_string();
    rt.block_on(async move {
        let mut conn = relay_connection(stream);
        let (out, code) = relay_exec(&mut conn, &["hostname"]).await;
        assert_eq!((code, out), (0, format!("{id}\n").into_bytes()));
    });
}

#[test]
fn a_node_with_a_certificate_from_another_ca_cannot_join() {
    let (good, evil) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    certs(good.path(), &["a"]);
    certs(evil.path(), &["x"]);
    let a = node(good.path(), "a", 7, None, "pools = []\n");
    let x = node(evil.path(), "x", 8, Some(&mesh_addr(&a)), "pools = []\n");
    std::thread::sleep(Duration::from_secs(3));
    assert!(peer_names(&a).is_empty(), "a let x in");
    assert!(peer_names(&x).is_empty(), "x got in");
    // And claims on x never point at a.
    let (status, _) = x.req("POST", "/v1/sandboxes", Some(ROOT), Some("{}"));
    assert_eq!(status, 201);

    // A node configured with another node's certificate refuses to start, and says why.
    sandboxd(&["mesh", "cert", "issue", "--dir", good.path().to_str().unwrap(), "--node", "b"]);
    let config = good.path().join("wrong.toml");
    let d = good.path().display();
    std::fs::write(
        &config,
        format!(
            "listen = \"127.0.0.9:0\"\ndata_dir = \"{d}/wrong\"\napi_token = \"{ROOT}\"\n[mesh]\nname = \"a\"\nlisten = \"127.0.0.9:0\"\nca = \"{d}/ca.pem\"\ncert = \"{d}/b.pem\"\nkey = \"{d}/b.key\"\n"
        ),
    )
    .unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_sandboxd"))
        .arg("--config")
        .arg(&config)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("is not a certificate for node \"a\""), "{stderr}");
    // Refused before it touched the host: no firewall table is left for its data directory.
    let table = silk_egress::names(&good.path().join("wrong")).0;
    assert!(!silk_egress::nft::exists(&table), "a refused start left its egress table");
}

#[test]
fn a_partitioned_peer_is_dropped_and_rejoins_and_a_restarted_one_returns_at_its_new_address() {
    let dir = tempfile::tempdir().unwrap();
    certs(dir.path(), &["a", "b"]);
    let a = node(dir.path(), "a", 9, None, "pools = []\n");
    let mut b = node(
        dir.path(),
        "b",
        10,
        Some(&mesh_addr(&a)),
        "[[pools]]\ntemplate = \"host\"\nwarm = 1\nwarm_max = 1\n",
    );
    eventually("b's capacity on a", || peer_warm(&a, "b") == Some(1));

    // A partition: b stops answering (SIGSTOP freezes every packet it would send or read).
    let pid = b.child.as_ref().unwrap().id() as i32;
    unsafe { libc::kill(pid, libc::SIGSTOP) };
    eventually("a drops the unreachable b", || peer_names(&a).is_empty());
    let (first, _, v) = follow(&a, "POST", "/v1/sandboxes", ROOT, Some("{}"));
    assert_eq!(first, 201, "no redirect to an unreachable peer: {v}");
    unsafe { libc::kill(pid, libc::SIGCONT) };
    eventually("b rejoins after the partition heals", || peer_names(&a) == ["b"]);

    // A restart on new ports: a learns the new addresses and a newer epoch, and sends claims there.
    let epoch = peers(&a)["peers"][0]["epoch"].as_u64().unwrap();
    b.restart();
    let api = format!("http://{}", b.addr);
    eventually("b back at its new address", || {
        let p = peers(&a);
        let b_row = p["peers"].as_array().unwrap().iter().find(|p| p["name"] == "b").cloned();
        b_row.is_some_and(|r| {
            r["api"] == api.as_str() && r["epoch"].as_u64() > Some(epoch) && r["warm"][KEY] == 1
        })
    });
    let location = location(&a, "POST", "/v1/sandboxes", ROOT, Some("{}"));
    assert!(location.starts_with(&api), "{location} is not b's new address {api}");
}

#[test]
fn a_preview_opens_through_any_node_of_the_mesh() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    // Redirect mode: a browser would not carry the preview's cookie along a redirect, so the
    // node that does not hold the sandbox forwards previews whatever its mode.
    let (a, b) = pair(dir.path(), &store, (41, 42));
    let c = a.claim("{}");
    let (id, token) = (c["id"].as_str().unwrap(), c["token"].as_str().unwrap());
    let serve = "mkdir -p /srv/www && echo hello-preview > /srv/www/index.html && cd /srv/www && \
                 setsid python3 -m http.server 8000 >/dev/null 2>&1 < /dev/null &";
    exec_via(&a, id, token, serve);
    let port = format!("/v1/sandboxes/{id}/ports/8000/");
    let direct = format!("GET {port} HTTP/1.1\r\nAuthorization: Bearer {token}\r\n");
    eventually("the server listens", || raw_answer(a.addr, &direct).0.contains(" 200 "));
    let (status, p) = a.req(
        "POST",
        &format!("/v1/sandboxes/{id}/previews"),
        Some(token),
        Some(r#"{"port": 8000}"#),
    );
    assert_eq!(status, 201, "{p}");
    let pv = p["token"].as_str().unwrap();

    // Through b: the first visit is answered there (its signature checked with the fleet's
    // key from the shared store), the page is the owner's sandbox's.
    let (status, headers, _) = raw_answer(b.addr, &format!("GET {port}?token={pv} HTTP/1.1\r\n"));
    assert!(status.contains(" 303 "), "{status}");
    assert!(headers.contains(&format!("location: {port}")), "{headers:?}");
    let page = format!("GET {port}index.html HTTP/1.1\r\nCookie: silkmesh_preview={pv}\r\n");
    let (status, _, body) = raw_answer(b.addr, &page);
    assert!(status.contains(" 200 ") && body.contains("hello-preview"), "{status} {body}");
    // Revoked on the owner: refused through b too, and a forged token never leaves b.
    let revoke = format!("/v1/sandboxes/{id}/previews/{pv}");
    assert_eq!(a.req("DELETE", &revoke, Some(token), None).0, 204);
    assert!(raw_answer(b.addr, &page).0.contains(" 404 "), "revoked");
    let forged = format!(
        "GET {port} HTTP/1.1\r\nCookie: silkmesh_preview=pv_8000_9999999999999_{}_{}\r\n",
        "0".repeat(32),
        "0".repeat(32)
    );
    assert!(raw_answer(b.addr, &forged).0.contains(" 404 "), "forged");
}
