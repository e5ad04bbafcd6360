//! sandboxd end to end: a real node process with the real jail engine, driven over HTTP.

mod common;

use std::io::Write;

use common::*;
use serde_json::{Value, json};

#[test]
fn claims_are_served_in_three_tiers() {
    let dir = tempfile::tempdir().unwrap();
    let rootfs = busybox_rootfs(dir.path());
    let node =
        Sandboxd::start(&format!("{ONE_WARM}[templates.tiny]\ndir = \"{}\"\n", rootfs.display()));
    node.wait_warm(1);

    let warm = node.claim(r#"{"metadata": {"who": "first"}}"#);
    assert_eq!(warm["tier"], "warm");
    assert!(warm["token"].as_str().unwrap().starts_with("sbt_"));
    let clone = node.claim("{}");
    assert_eq!(clone["tier"], "clone", "the pool was empty; the golden exists");
    let cold = node.claim(r#"{"template": "tiny"}"#);
    assert_eq!(cold["tier"], "cold", "no golden for this template yet");

    // The cold claim built the template's golden for next time.
    eventually("golden of tiny", || {
        node.info()["goldens"].as_array().is_some_and(|g| g.iter().any(|t| t == "tiny"))
    });
    assert_eq!(node.claim(r#"{"template": "tiny"}"#)["tier"], "clone");

    for s in [&warm, &clone, &cold] {
        let id = s["id"].as_str().unwrap();
        let out = node.exec(id, s["token"].as_str().unwrap(), "hostname");
        assert_eq!(out["stdout"], format!("{id}\n"));
    }
    let (_, metrics) = node.req("GET", "/metrics", None, None);
    let metrics = metrics.as_str().unwrap().to_string();
    for (tier, n) in [("warm", 1), ("clone", 2), ("cold", 1)] {
        assert!(
            metrics.contains(&format!("silkmesh_claims_total{{tier=\"{tier}\"}} {n}")),
            "{tier}"
        );
    }
    assert!(metrics.contains("silkmesh_claim_seconds_bucket"));

    // Refill follows a warm hit.
    node.wait_warm(1);
}

#[test]
fn buffered_exec_with_stdin_exit_codes_and_an_output_cap() {
    let node = Sandboxd::start(&format!("exec_output_cap = 1000\n{ONE_WARM}"));
    let s = node.claim("{}");
    let (id, token) = (s["id"].as_str().unwrap(), s["token"].as_str().unwrap());
    let path = format!("/v1/sandboxes/{id}/exec");
    let body = json!({ "argv": ["sh", "-c", "cat; echo oops >&2; exit 3"], "stdin": "fed in\n" })
        .to_string();
    let (status, v) = node.req("POST", &path, Some(token), Some(&body));
    assert_eq!(status, 200, "{v}");
    assert_eq!(
        (v["exit_code"].as_i64(), v["stdout"].as_str(), v["stderr"].as_str()),
        (Some(3), Some("fed in\n"), Some("oops\n"))
    );

    let v = node.exec(id, token, "head -c 5000 /dev/zero | tr '\\0' x");
    assert_eq!(v["stdout"].as_str().unwrap().len(), 1000);
    assert_eq!(v["stdout_truncated"], true);

    let body = json!({ "argv": ["sleep", "30"], "timeout_seconds": 1 }).to_string();
    let (_, v) = node.req("POST", &path, Some(token), Some(&body));
    assert_eq!(v["timed_out"], true);
    let (status, v) = node.req("POST", &path, Some(token), Some(r#"{"argv": []}"#));
    assert_eq!((status, v["error"]["code"].as_str()), (400, Some("bad_request")));
    let (status, _) =
        node.req("POST", &path, Some(token), Some(r#"{"argv": ["/no/such/program"]}"#));
    assert_eq!(status, 404);
}

#[test]
fn leases_expire_and_renew() {
    let node = Sandboxd::start(ONE_WARM);
    let short = node.claim(r#"{"ttl_seconds": 1}"#);
    let kept = node.claim(r#"{"ttl_seconds": 1}"#);
    let (kid, ktoken) = (kept["id"].as_str().unwrap(), kept["token"].as_str().unwrap());
    let (status, v) = node.req(
        "POST",
        &format!("/v1/sandboxes/{kid}/renew"),
        Some(ktoken),
        Some(r#"{"ttl_seconds": 120}"#),
    );
    assert_eq!(status, 200, "{v}");
    assert!(v["deadline_ms"].as_u64().unwrap() > kept["deadline_ms"].as_u64().unwrap() + 100_000);

    let sid = short["id"].as_str().unwrap().to_string();
    eventually("the short lease is reaped", || {
        node.req("GET", &format!("/v1/sandboxes/{sid}"), Some(ROOT), None).0 == 404
    });
    eventually("its jail is gone", || !node.data().join("engine/boxes").join(&sid).exists());
    assert_eq!(node.req("GET", &format!("/v1/sandboxes/{kid}"), Some(ktoken), None).0, 200);
    let (status, _) = node.req(
        "POST",
        &format!("/v1/sandboxes/{kid}/renew"),
        Some(ktoken),
        Some(r#"{"ttl_seconds": 999999}"#),
    );
    assert_eq!(status, 400, "past the cap");
}

#[test]
fn auth_hides_sandboxes_from_wrong_tokens() {
    let node = Sandboxd::start(ONE_WARM);
    let (status, v) = node.req("POST", "/v1/sandboxes", None, Some("{}"));
    assert_eq!((status, v["error"]["code"].as_str()), (401, Some("unauthorized")));
    assert_eq!(node.req("POST", "/v1/sandboxes", Some("wrong"), Some("{}")).0, 401);
    assert_eq!(node.req("GET", "/v1/info", None, None).0, 401);

    let a = node.claim("{}");
    let b = node.claim("{}");
    let (aid, atoken, btoken) =
        (a["id"].as_str().unwrap(), a["token"].as_str().unwrap(), b["token"].as_str().unwrap());
    let path = format!("/v1/sandboxes/{aid}");
    assert_eq!(node.req("GET", &path, Some(atoken), None).0, 200);
    assert_eq!(node.req("GET", &path, Some(ROOT), None).0, 200);
    // Another sandbox's token: the same 404 as an unknown id. No credential, or one no node
    // could take: 401, for a known id as for an unknown one.
    let unknown = "/v1/sandboxes/sb-5cbc7f78-000000000000";
    for (wrong, answer) in [
        (Some(btoken), (404, "not_found")),
        (Some("sbt_nope"), (401, "unauthorized")),
        (None, (401, "unauthorized")),
    ] {
        for path in [path.as_str(), unknown] {
            let (status, v) = node.req("GET", path, wrong, None);
            assert_eq!((status, v["error"]["code"].as_str()), (answer.0, Some(answer.1)), "{path}");
            assert_eq!(node.req("DELETE", path, wrong, None).0, answer.0);
        }
    }
    assert_eq!(node.req("GET", "/v1/sandboxes/sb-doesnotexist", Some(ROOT), None).0, 404);
    assert_eq!(
        node.exec(aid, atoken, "echo alive")["stdout"],
        "alive\n",
        "failed deletes changed nothing"
    );
    assert_eq!(node.req("DELETE", &path, Some(atoken), None).0, 204);
    assert_eq!(node.req("GET", &path, Some(ROOT), None).0, 404);
}

#[test]
fn a_node_without_the_egress_lane_says_so() {
    let node = Sandboxd::start("[egress]\nenabled = false\n");
    let (got, v) = node.req("POST", "/v1/sandboxes", Some(ROOT), Some(r#"{"lane": "egress"}"#));
    assert_eq!((got, v["error"]["code"].as_str()), (501, Some("unsupported")), "{v}");
}

#[test]
fn bad_input_gets_the_right_4xx() {
    let node = Sandboxd::start(&format!("max_body_bytes = 2000\n{ONE_WARM}"));
    let cases: Vec<(&str, u16, &str)> = vec![
        (r#"{"sise": "small"}"#, 400, "bad_request"),
        (r#"{"size": "huge"}"#, 400, "bad_request"),
        (r#"{"lane": "wifi"}"#, 400, "bad_request"),
        (r#"{"ttl_seconds": 100000}"#, 400, "bad_request"),
        (r#"{"ttl_seconds": -1}"#, 400, "bad_request"),
        ("not json", 400, "bad_request"),
        (r#"{"template": "nope"}"#, 404, "template_not_found"),
        // A body the document accepts, refused by a rule it states in words: 422.
        (r#"{"egress": {"allow": ["a.test"]}}"#, 422, "invalid"),
        (r#"{"lane": "egress", "egress": {"allow": ["not a name"]}}"#, 422, "invalid"),
        (r#"{"lane": "egress", "egress": {"allow": [], "alow": []}}"#, 400, "bad_request"),
    ];
    for (body, status, code) in cases {
        let (got, v) = node.req("POST", "/v1/sandboxes", Some(ROOT), Some(body));
        assert_eq!((got, v["error"]["code"].as_str()), (status, Some(code)), "{body} -> {v}");
    }
    let many: serde_json::Map<String, Value> =
        (0..17).map(|i| (format!("k{i}"), json!("v"))).collect();
    let (got, _) = node.req(
        "POST",
        "/v1/sandboxes",
        Some(ROOT),
        Some(&json!({ "metadata": many }).to_string()),
    );
    assert_eq!(got, 400);
    let huge = json!({ "metadata": { "k": "v".repeat(3000) } }).to_string();
    let (got, v) = node.req("POST", "/v1/sandboxes", Some(ROOT), Some(&huge));
    assert_eq!((got, v["error"]["code"].as_str()), (413, Some("payload_too_large")));
    let (got, _) = http(node.addr, "POST", "/v1/sandboxes", Some(ROOT), Some("{}"), "text/plain");
    assert_eq!(got, 415);
    let (got, v) = node.req("POST", "/v1/sandboxes", Some(ROOT), Some(" "));
    assert_eq!((got, v["error"]["code"].as_str()), (400, Some("bad_request")), "{v}");
    let (got, v) = node.req("GET", "/v1/nothing-here", Some(ROOT), None);
    assert_eq!((got, v["error"]["code"].as_str()), (404, Some("no_route")));
    assert_eq!(node.req("PATCH", "/v1/sandboxes", Some(ROOT), Some("{}")).0, 405);
    let (got, _) = node.req("GET", "/v1/sandboxes?color=blue", Some(ROOT), None);
    assert_eq!(got, 400);
    assert_eq!(node.info()["claims"], 0, "nothing was claimed by any of that");
    // No body at all is a claim with every default.
    let (got, v) = node.req("POST", "/v1/sandboxes", Some(ROOT), Some(""));
    assert_eq!((got, v["template"].as_str()), (201, Some("host")), "{v}");
}

#[test]
fn max_claims_drain_and_metadata_filters() {
    let node = Sandboxd::start(&format!("max_claims = 2\n{ONE_WARM}"));
    node.claim(r#"{"metadata": {"team": "a"}}"#);
    let b = node.claim(r#"{"metadata": {"team": "b", "run": "7"}}"#);
    let (status, v) = node.req("POST", "/v1/sandboxes", Some(ROOT), Some("{}"));
    assert_eq!((status, v["error"]["code"].as_str()), (429, Some("node_full")));

    let (_, v) = node.req("GET", "/v1/sandboxes?metadata=team%3Db", Some(ROOT), None);
    let rows = v["sandboxes"].as_array().unwrap();
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0]["id"], b["id"]);
    assert!(rows[0].get("token").is_none(), "lists never carry tokens");
    let (_, v) = node.req("GET", "/v1/sandboxes?no_redirect=1", Some(ROOT), None);
    assert_eq!(v["sandboxes"].as_array().unwrap().len(), 2);
    assert_eq!(v["sandboxes"][0]["owner"], node.addr.to_string(), "the bound address, not port 0");

    let bid = b["id"].as_str().unwrap();
    assert_eq!(node.req("DELETE", &format!("/v1/sandboxes/{bid}"), Some(ROOT), None).0, 204);
    assert_eq!(node.req("POST", "/v1/drain", Some(ROOT), None).0, 200);
    let (status, v) = node.req("POST", "/v1/sandboxes", Some(ROOT), Some("{}"));
    assert_eq!((status, v["error"]["code"].as_str()), (503, Some("draining")));
    assert_eq!(node.info()["claims"], 1, "live claims keep running while draining");
    assert_eq!(node.req("DELETE", "/v1/drain", Some(ROOT), None).0, 200);
    node.claim("{}");
}

#[test]
fn pools_are_replaced_at_runtime_and_persist() {
    let mut node = Sandboxd::start(ONE_WARM);
    let body = r#"{"pools": [{"template": "host", "size": "medium", "warm": 2}]}"#;
    let (status, v) = node.req("PUT", "/v1/pools", Some(ROOT), Some(body));
    assert_eq!(status, 200, "{v}");
    node.wait_warm(2);
    assert_eq!(node.info()["pools"][0]["size"], "medium");
    let (status, _) = node.req(
        "PUT",
        "/v1/pools",
        Some(ROOT),
        Some(r#"{"pools": [{"template": "ghost", "warm": 1}]}"#),
    );
    assert_eq!(status, 422);
    node.restart();
    let (_, v) = node.req("GET", "/v1/pools", Some(ROOT), None);
    assert_eq!(v["pools"][0]["size"], "medium");
    assert_eq!(v["pools"][0]["warm"], 2);
}

/// Claim bursts with `kill -9` of the node in between: every acknowledged claim survives the
/// restart and still works, and no jail is left over.
#[test]
fn acknowledged_claims_survive_kill_9() {
    let mut node = Sandboxd::start(ONE_WARM);
    let mut acknowledged: Vec<(String, String)> = vec![];
    for round in 0..3 {
        let addr = node.addr;
        let burst: Vec<_> = (0..4)
            .map(|i| {
                std::thread::spawn(move || {
                    let body =
                        json!({ "metadata": { "round": round.to_string(), "i": i.to_string() } })
                            .to_string();
                    http(addr, "POST", "/v1/sandboxes", Some(ROOT), Some(&body), "application/json")
                })
            })
            .collect();
        for t in burst {
            let (status, v) = t.join().unwrap();
            assert_eq!(status, 201, "{v}");
            acknowledged
                .push((v["id"].as_str().unwrap().into(), v["token"].as_str().unwrap().into()));
        }
        // A claim in flight when the node dies: acknowledged or not, nothing may leak.
        let in_flight = std::thread::spawn(move || {
            let mut s = std::net::TcpStream::connect(addr).unwrap();
            let _ = write!(
                s,
                "POST /v1/sandboxes HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ROOT}\r\nContent-Type: application/json\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{{}}"
            );
        });
        in_flight.join().unwrap();
        node.restart();
        for (id, token) in &acknowledged {
            let out = node.exec(id, token, "hostname");
            assert_eq!(out["stdout"], format!("{id}\n"), "round {round}: {id} lost");
        }
    }
    let (_, v) = node.req("GET", "/v1/sandboxes", Some(ROOT), None);
    let live = v["sandboxes"].as_array().unwrap().len();
    assert!(live >= acknowledged.len());
    node.wait_warm(1);
    assert_eq!(node.jails(), live + 1, "every jail is a claim or the one warm sandbox");
}

#[test]
fn openapi_document_matches_the_routes() {
    let node = Sandboxd::start("max_ttl_seconds = 600\npools = []\n");
    let (status, doc) = node.req("GET", "/v1/openapi.json", None, None);
    assert_eq!(status, 200);
    assert_eq!(doc["openapi"], "3.1.0");
    // This node's own limits, and every field a claim answers with.
    let schemas = &doc["components"]["schemas"];
    assert_eq!(schemas["ClaimRequest"]["properties"]["ttl_seconds"]["maximum"], 600);
    let (status, claimed) = node.req("POST", "/v1/sandboxes", Some(ROOT), Some("{}"));
    assert_eq!(status, 201, "{claimed}");
    for field in claimed.as_object().unwrap().keys() {
        assert!(schemas["Sandbox"]["properties"][field].is_object(), "{field} is undocumented");
    }
    let paths = doc["paths"].as_object().unwrap();
    assert!(paths.len() >= 10);
    for (path, item) in paths {
        for method in item.as_object().unwrap().keys().filter(|m| *m != "parameters") {
            let concrete = path.replace("{id}", "sb-unknown").replace("{name}", "unknown");
            let body = (method == "post" || method == "put").then_some("{}");
            let (status, v) = node.req(&method.to_uppercase(), &concrete, Some(ROOT), body);
            assert_ne!(
                v["error"]["code"], "no_route",
                "{method} {path} is documented but not routed"
            );
            assert_ne!(status, 405, "{method} {path}");
            for code in item[method]["responses"].as_object().unwrap().keys() {
                code.parse::<u16>().unwrap();
            }
        }
    }
    // The print-config flag shows the effective config, env overrides applied.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_sandboxd"))
        .args(["--print-config"])
        .env("SANDBOXD_LISTEN", "127.0.0.1:9999")
        .env("SANDBOXD_API_TOKEN", "secret")
        .output()
        .unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("listen = \"127.0.0.1:9999\""), "{text}");
    assert!(!text.contains("secret"), "tokens are never printed");
    let bad = std::process::Command::new(env!("CARGO_BIN_EXE_sandboxd"))
        .args(["--print-config", "--listen", "0.0.0.0:1"])
        .output()
        .unwrap();
    assert!(!bad.status.success(), "open listen without a token is refused");
}

#[test]
fn clean_removes_a_stopped_nodes_sandboxes_and_refuses_a_running_one() {
    let mut node = Sandboxd::start(ONE_WARM);
    node.claim("{}");
    node.wait_warm(1);
    let clean = |node: &Sandboxd| {
        std::process::Command::new(env!("CARGO_BIN_EXE_sandboxd"))
            .arg("--config")
            .arg(&node.config)
            .arg("clean")
            .output()
            .unwrap()
    };
    let refused = clean(&node);
    assert!(!refused.status.success(), "clean ran beside a live node");
    assert!(String::from_utf8_lossy(&refused.stderr).contains("stop it first"), "{refused:?}");
    assert_eq!(node.jails(), 2, "a refused clean touched the node's sandboxes");
    node.kill9();
    let done = clean(&node);
    assert!(done.status.success(), "{done:?}");
    assert!(String::from_utf8_lossy(&done.stdout).starts_with("removed 2 sandboxes"), "{done:?}");
    assert_eq!((node.jails(), node.boxes().iter().filter(|b| b.running).count()), (0, 0));
}

#[test]
fn sigterm_keeps_the_claims_removes_the_warm_pool_and_a_start_says_what_it_found() {
    let mut node = Sandboxd::start(ONE_WARM);
    let s = node.claim("{}");
    let (id, token) = (s["id"].as_str().unwrap(), s["token"].as_str().unwrap());
    node.wait_warm(1);
    assert_eq!(node.jails(), 2);
    let mut child = node.child.take().unwrap();
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    assert!(child.wait().unwrap().success(), "clean exit on SIGTERM");
    assert!(std::net::TcpStream::connect(node.addr).is_err(), "no longer accepting");
    let left: Vec<String> = node.boxes().iter().map(|b| b.id.to_string()).collect();
    assert_eq!(left, [id], "the warm sandbox went with the node; the claim stays");
    let log = launch_logged(&mut node);
    assert!(log.contains(&format!("re-adopted 1 claims: {id} (running)")), "{log}");
    assert_eq!(node.exec(id, token, "hostname")["stdout"], format!("{id}\n"), "re-adopted");

    // After a crash, the start removes the warm sandbox left behind and names it.
    node.wait_warm(1);
    let warm = node.boxes().into_iter().map(|b| b.id.to_string()).find(|b| b != id).unwrap();
    node.kill9();
    let log = launch_logged(&mut node);
    assert!(log.contains("removed 1 sandboxes no claim holds") && log.contains(&warm), "{log}");
    assert!(log.contains(&format!("re-adopted 1 claims: {id} (running)")), "{log}");
}

/// Starts the node's process again with its log at `info` kept: the log of its start.
fn launch_logged(node: &mut Sandboxd) -> String {
    use std::io::BufRead;
    use std::os::unix::process::CommandExt;
    let log = node.work().join("start.log");
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_sandboxd"))
        .arg("--config")
        .arg(&node.config)
        .env("SANDBOXD_LOG", "info")
        .stdout(std::process::Stdio::piped())
        .stderr(std::fs::File::create(&log).unwrap())
        .process_group(0)
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    node.addr = line.trim().strip_prefix("sandboxd listening on ").unwrap().parse().unwrap();
    node.child = Some(child);
    std::fs::read_to_string(log).unwrap()
}

#[test]
fn a_second_node_on_a_live_data_directory_stops_before_it_joins_the_mesh() {
    let certs = tempfile::tempdir().unwrap();
    let d = certs.path().to_str().unwrap();
    let sandboxd = |args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_sandboxd")).args(args).output().unwrap()
    };
    assert!(sandboxd(&["mesh", "ca", "init", "--dir", d]).status.success());
    assert!(sandboxd(&["mesh", "cert", "issue", "--dir", d, "--node", "solo"]).status.success());
    let node = Sandboxd::start(&format!(
        "pools = []\n[mesh]\nname = \"solo\"\nlisten = \"127.0.0.1:0\"\nca = \"{d}/ca.pem\"\ncert = \"{d}/solo.pem\"\nkey = \"{d}/solo.key\"\n"
    ));
    let epoch = || std::fs::read_to_string(node.data().join("mesh-epoch")).unwrap();
    // The live node's egress table (none where nftables is missing: then both are empty).
    let table = silk_egress::names(&node.data()).0;
    let rules = || {
        let out =
            std::process::Command::new("nft").args(["list", "table", "inet", &table]).output();
        out.map(|o| String::from_utf8_lossy(&o.stdout).into_owned()).unwrap_or_default()
    };
    let (before, rules_before) = (epoch(), rules());
    let second = sandboxd(&["--config", node.config.to_str().unwrap()]);
    assert!(!second.status.success(), "a second node ran on a live data directory");
    let stderr = String::from_utf8_lossy(&second.stderr);
    assert!(stderr.contains("already open in another process"), "{stderr}");
    assert_eq!(epoch(), before, "the second process bumped the live node's mesh epoch");
    // It did not rewrite the live node's firewall with ports only it listened on.
    assert_eq!(rules(), rules_before, "the second process rewrote the live node's table");
}

#[test]
fn a_node_gone_for_good_leaves_no_egress_table_once_another_node_starts() {
    // Two nodes killed: one whose data directory is then deleted (a throwaway node: it never
    // comes back), one whose directory stays (its next start replaces its table, which fences
    // its sandboxes meanwhile). Every packet of the host walks every table left behind.
    let mut gone = Sandboxd::start("pools = []\n");
    let mut stopped = Sandboxd::start("pools = []\n");
    let table = |n: &Sandboxd| silk_egress::names(&n.data()).0;
    let (gone_table, stopped_table) = (table(&gone), table(&stopped));
    gone.kill9();
    stopped.kill9();
    std::fs::remove_dir_all(gone.data()).unwrap();
    assert!(silk_egress::nft::exists(&gone_table), "the lane's table (is nftables installed?)");
    assert!(silk_egress::nft::exists(&stopped_table));

    let next = Sandboxd::start("pools = []\n");
    assert!(!silk_egress::nft::exists(&gone_table), "a node gone for good left its table");
    assert!(silk_egress::nft::exists(&stopped_table), "a stopped node's table went");
    assert!(silk_egress::nft::exists(&table(&next)));
}
