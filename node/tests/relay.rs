//! The relay end to end: silkd's protocol through a real node, on its own `GET …/agent`
//! connection or on the connection of the claim that asked for it (with silkd's answer in the
//! `101` when the claim asked for that too).

mod common;

use common::*;
use serde_json::{Value, json};

#[test]
fn relay_carries_the_silkd_protocol() {
    let node = Sandboxd::start(ONE_WARM);
    let s = node.claim("{}");
    let (id, token) = (s["id"].as_str().unwrap(), s["token"].as_str().unwrap());

    let stream = upgrade(node.addr, id, token);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async move {
        let mut conn = relay_connection(stream);
        use silk_proto::*;
        let (out, code) = relay_exec(&mut conn, &["sh", "-c", "echo through the relay"]).await;
        assert_eq!(code, 0);
        assert_eq!(out, b"through the relay\n");
        // Files too, on the same relayed connection.
        conn.queue(&Frame::Write(WriteRequest {
            path: "/tmp/relayed".into(),
            mode: None,
            parents: false,
        }))
        .unwrap();
        conn.queue(&Frame::Data(bytes::Bytes::from(vec![7u8; 300_000]))).unwrap();
        conn.send(&Frame::Eof).await.unwrap();
        assert_eq!(conn.recv().await.unwrap(), Some(Frame::Done));
        conn.send(&Frame::Read(ReadRequest { path: "/tmp/relayed".into(), offset: 0, len: None }))
            .await
            .unwrap();
        let mut n = 0;
        loop {
            match conn.recv().await.unwrap().unwrap() {
                Frame::Data(b) => {
                    assert!(b.iter().all(|x| *x == 7));
                    n += b.len();
                }
                Frame::Done => break,
                other => panic!("unexpected {}", other.name()),
            }
        }
        assert_eq!(n, 300_000);
    });

    // Without the upgrade header: a clear 426.
    let (status, v) = node.req("GET", &format!("/v1/sandboxes/{id}/agent"), Some(token), None);
    assert_eq!((status, v["error"]["code"].as_str()), (426, Some("upgrade_required")));
}

#[test]
fn a_warm_sandbox_whose_silkd_died_in_its_pool_is_claimed_with_a_working_relay() {
    let node = Sandboxd::start(ONE_WARM);
    node.wait_warm(1);
    // The pool holds a connection to each waiting sandbox's silkd for the claim's relay. This
    // one's processes die while it waits (an OOM kill): that connection is closed now.
    let waiting = node.boxes();
    assert_eq!(waiting.len(), 1, "one warm sandbox and nothing else: {waiting:?}");
    node.kill_sandbox_processes(waiting[0].id.as_str());

    // The claim asks for silkd's answer before its 101: it comes from the restarted silkd.
    let (status, row, answered, stream) = claim_asking(node.addr, ROOT, "{}");
    assert!(status.contains(" 101 "), "{status} {row}");
    let id = row["id"].as_str().unwrap().to_string();
    assert_eq!((id.as_str(), row["tier"].as_str()), (waiting[0].id.as_str(), Some("warm")));
    let answered = answered.expect("silkd's answer in the 101");
    assert_eq!(answered["agent_version"], env!("CARGO_PKG_VERSION"), "{answered}");
    assert!(answered["uptime_ms"].as_u64().unwrap() < 60_000, "a new silkd: {answered}");
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async move {
        let mut conn = relay_connection(stream);
        let (out, code) = relay_exec(&mut conn, &["hostname"]).await;
        assert_eq!((out, code), (format!("{id}\n").into_bytes(), 0), "a restarted silkd answers");
    });
}

#[test]
fn a_claim_that_asks_for_the_relay_runs_calls_on_its_own_connection() {
    let node = Sandboxd::start(ONE_WARM);
    node.wait_warm(1);
    // Metadata beyond ASCII and with a DEL: the row travels in a header, and arrives whole.
    let metadata = "caf\u{e9} \u{7f} \u{1f980}";
    let body = json!({ "metadata": { "note": metadata } }).to_string();
    let (status, row, stream) = claim_upgraded(node.addr, ROOT, &body);
    assert!(status.contains(" 101 "), "{status} {row}");
    let (id, token) = (row["id"].as_str().unwrap(), row["token"].as_str().unwrap());
    assert_eq!(
        (row["tier"].as_str(), row["metadata"]["note"].as_str()),
        (Some("warm"), Some(metadata))
    );
    let (status, held) = node.req("GET", &format!("/v1/sandboxes/{id}"), Some(token), None);
    assert_eq!((status, &held["metadata"]), (200, &row["metadata"]), "the claim is the node's");

    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async move {
        let mut conn = relay_connection(stream);
        for _ in 0..2 {
            let (out, code) = relay_exec(&mut conn, &["hostname"]).await;
            assert_eq!((out, code), (format!("{id}\n").into_bytes(), 0), "this sandbox's silkd");
        }
    });
    // The claim is audited as a claim, with its status, and the program run through it too.
    let (_, audit) = node.req("GET", "/v1/audit?limit=100", Some(ROOT), None);
    let entries = audit["entries"].as_array().unwrap();
    let of = |action: &str, status: u16| {
        let by = |e: &&Value| e["action"] == action && e["target"] == id && e["status"] == status;
        entries.iter().filter(by).count()
    };
    assert_eq!((of("claim", 101), of("exec", 101)), (1, 2), "{audit}");

    // A row too large for a header (16 values of 512 characters) is the plain 201, token and
    // all: proxies cap response headers, and the token must not be lost to one.
    let big: serde_json::Map<String, Value> =
        (0..16).map(|i| (format!("k{i}"), json!("v".repeat(512)))).collect();
    let body = json!({ "metadata": big }).to_string();
    let (status, row, _) = claim_upgraded(node.addr, ROOT, &body);
    assert!(status.contains(" 201 "), "{status}");
    assert!(row["token"].as_str().is_some_and(|t| !t.is_empty()), "{row}");
    assert_eq!(row["metadata"]["k15"].as_str().map(str::len), Some(512));

    // A claim that asks for silkd's answer gets it in its 101, from that sandbox's silkd, on
    // the connection it goes on to use (silkd counts it), and the relay runs calls after it.
    node.wait_warm(1);
    let (status, row, answered, stream) = claim_asking(node.addr, ROOT, "{}");
    assert!(status.contains(" 101 "), "{status} {row}");
    let answered = answered.expect("silkd's answer in the 101");
    assert_eq!(answered["connections"], 1, "{answered}");
    let id = row["id"].as_str().unwrap().to_string();
    rt.block_on(async move {
        let mut conn = relay_connection(stream);
        let (out, code) = relay_exec(&mut conn, &["hostname"]).await;
        assert_eq!((out, code), (format!("{id}\n").into_bytes(), 0), "this sandbox's silkd");
    });
    // Without the ask, no answer is put in the 101.
    node.wait_warm(1);
    let (status, _, answered, _) = claim_asking_if(node.addr, ROOT, "{}", None);
    assert_eq!((status.contains(" 101 "), answered), (true, None));

    // An ask for anything but `info` is refused before anything is claimed.
    let (status, error, _, _) = claim_asking_if(node.addr, ROOT, "{}", Some("everything"));
    assert!(status.contains(" 400 "), "{status}");
    assert_eq!(error["error"]["code"], "bad_request", "{error}");

    // A refused claim is the usual JSON error, and the connection never switches.
    let (status, error, _) = claim_upgraded(node.addr, ROOT, r#"{"template": "nope"}"#);
    assert!(status.contains(" 404 "), "{status}");
    assert_eq!(error["error"]["code"], "template_not_found");
    let (status, error, _) = claim_upgraded(node.addr, "wrong", "{}");
    assert!(status.contains(" 401 "), "{status} {error}");
}
