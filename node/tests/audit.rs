//! The audit journal of a real node: each call that changes something is one entry with the
//! right principal (root, a tenant, a sandbox's own token, nobody), action, target and status;
//! an exec records its program but not its arguments (unless `audit_exec_args`); a tenant reads
//! its own entries only; entries reach the disk without anyone reading them and survive kill -9.

mod common;

use common::*;
use serde_json::{Value, json};

fn entries(n: &Sandboxd, token: &str, query: &str) -> Vec<Value> {
    let (status, v) = n.req("GET", &format!("/v1/audit{query}"), Some(token), None);
    assert_eq!(status, 200, "{v}");
    v["entries"].as_array().unwrap().clone()
}

fn find<'a>(all: &'a [Value], action: &str, target: &str) -> &'a Value {
    all.iter()
        .find(|e| e["action"] == action && e["target"] == target)
        .unwrap_or_else(|| panic!("no {action} of {target} in {all:#?}"))
}

#[test]
fn every_change_is_recorded_with_who_did_it_and_survives_kill_9() {
    let mut n = Sandboxd::start("[[pools]]\ntemplate = \"host\"\nwarm = 1\nwarm_max = 2\n");
    let body = json!({"name": "team-a", "max_sandboxes": 5, "max_checkpoints": 1, "max_store_bytes": 1u64 << 30});
    let (status, t) = n.req("POST", "/v1/tenants", Some(ROOT), Some(&body.to_string()));
    assert_eq!(status, 201, "{t}");
    let key = t["api_key"].as_str().unwrap().to_string();

    let by_root = n.claim("{}");
    let root_id = by_root["id"].as_str().unwrap().to_string();
    let (status, by_tenant) = n.req("POST", "/v1/sandboxes", Some(&key), Some("{}"));
    assert_eq!(status, 201, "{by_tenant}");
    let (tid, ttoken) =
        (by_tenant["id"].as_str().unwrap().to_string(), by_tenant["token"].as_str().unwrap());
    let argv = r#"{"argv":["sh","-c","echo the-secret-argument"]}"#;
    let (status, _) = n.req("POST", &format!("/v1/sandboxes/{tid}/exec"), Some(ttoken), Some(argv));
    assert_eq!(status, 200);
    let (status, _) = n.req(
        "POST",
        &format!("/v1/sandboxes/{root_id}/renew"),
        Some(ROOT),
        Some(r#"{"ttl_seconds":60}"#),
    );
    assert_eq!(status, 200);
    assert_eq!(
        n.req("DELETE", &format!("/v1/sandboxes/{root_id}"), Some(WRONG_TOKEN), None).0,
        404
    );
    // Through the relay: the opening, and each program run on it (after bulk data too).
    let stream = upgrade(n.addr, &tid, ttoken);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async move {
        let mut conn = relay_connection(stream);
        let (_, code) = relay_exec(&mut conn, &["true", "relay-secret-1"]).await;
        assert_eq!(code, 0);
        conn.queue(&silk_proto::Frame::Write(silk_proto::WriteRequest {
            path: "/tmp/bulk".into(),
            mode: None,
            parents: false,
        }))
        .unwrap();
        conn.queue(&silk_proto::Frame::Data(bytes::Bytes::from(vec![1u8; 200_000]))).unwrap();
        conn.send(&silk_proto::Frame::Eof).await.unwrap();
        assert_eq!(conn.recv().await.unwrap(), Some(silk_proto::Frame::Done));
        let (out, _) = relay_exec(&mut conn, &["echo", "relay-secret-2"]).await;
        assert_eq!(out, b"relay-secret-2\n");
    });
    assert_eq!(n.req("POST", "/v1/drain", Some(ROOT), None).0, 200);
    assert_eq!(n.req("DELETE", "/v1/drain", Some(ROOT), None).0, 200);
    assert_eq!(n.req("DELETE", &format!("/v1/sandboxes/{root_id}"), Some(ROOT), None).0, 204);
    // Reads are not recorded.
    assert_eq!(n.req("GET", &format!("/v1/sandboxes/{tid}"), Some(&key), None).0, 200);

    let all = entries(&n, ROOT, "");
    let who =
        |e: &Value| (e["principal"].as_str().unwrap().to_string(), e["status"].as_u64().unwrap());
    assert_eq!(who(find(&all, "create_tenant", "team-a")), ("root".into(), 201));
    assert_eq!(who(find(&all, "claim", &root_id)), ("root".into(), 201));
    let claim = find(&all, "claim", &tid);
    assert_eq!(who(claim), ("tenant:team-a".into(), 201));
    assert_eq!(claim["tenant"], "team-a");
    let exec = find(&all, "exec", &tid);
    assert_eq!(who(exec), (format!("sandbox:{tid}"), 200));
    assert_eq!((exec["detail"].as_str(), exec["tenant"].as_str()), (Some("sh"), Some("team-a")));
    let text = serde_json::to_string(&all).unwrap();
    assert!(!text.contains("the-secret-argument") && !text.contains("relay-secret"), "arguments");
    assert_eq!(who(find(&all, "renew", &root_id)), ("root".into(), 200));
    assert!(
        all.iter().any(|e| e["action"] == "release"
            && e["principal"] == "anonymous"
            && e["status"] == 404),
        "a refused release is recorded too: {all:#?}"
    );
    assert_eq!(who(find(&all, "relay", &tid)), (format!("sandbox:{tid}"), 101));
    let relayed: Vec<&str> = all
        .iter()
        .filter(|e| e["action"] == "exec" && e["status"] == 101)
        .map(|e| e["detail"].as_str().unwrap())
        .collect();
    assert_eq!(relayed, ["true", "echo"], "each program run through the relay: {all:#?}");
    assert!(
        all.iter().any(|e| e["action"] == "drain") && all.iter().any(|e| e["action"] == "undrain")
    );
    assert!(
        !all.iter().any(|e| e["action"] == tid.as_str() || e["action"] == "get"),
        "reads: {all:#?}"
    );
    let times: Vec<u64> = all.iter().map(|e| e["time_ms"].as_u64().unwrap()).collect();
    assert!(times.windows(2).all(|w| w[0] <= w[1]), "oldest first");

    // A tenant reads its own entries, whatever it asks for; root can ask for one tenant's.
    for query in ["", "?tenant=other"] {
        let own = entries(&n, &key, query);
        assert!(!own.is_empty() && own.iter().all(|e| e["tenant"] == "team-a"), "{own:#?}");
    }
    assert_eq!(entries(&n, ROOT, "?tenant=team-a").len(), entries(&n, &key, "").len());
    assert!(entries(&n, ROOT, &format!("?since={}", u64::MAX / 2)).is_empty());
    assert_eq!(
        n.req("GET", "/v1/audit", Some(ttoken), None).0,
        401,
        "a sandbox token is no reader"
    );

    // On disk within the flush interval without anyone reading; kept across kill -9.
    let (status, last) = n.req("POST", "/v1/sandboxes", Some(&key), Some("{}"));
    assert_eq!(status, 201);
    let last_id = last["id"].as_str().unwrap().to_string();
    let log = n.data().join("audit/audit.log");
    eventually("the entry is flushed", || {
        std::fs::read_to_string(&log).unwrap_or_default().contains(&last_id)
    });
    n.kill9();
    n.restart();
    let after = entries(&n, ROOT, "");
    find(&after, "claim", &last_id);
    assert!(after.len() >= all.len());
}

#[test]
fn audit_exec_args_records_the_whole_command() {
    let n = Sandboxd::start("audit_exec_args = true\n[[pools]]\ntemplate = \"host\"\nwarm = 1\n");
    let c = n.claim("{}");
    let (id, token) = (c["id"].as_str().unwrap(), c["token"].as_str().unwrap());
    let argv = r#"{"argv":["echo","all","of","it"]}"#;
    assert_eq!(n.req("POST", &format!("/v1/sandboxes/{id}/exec"), Some(token), Some(argv)).0, 200);
    let all = entries(&n, ROOT, "");
    assert_eq!(find(&all, "exec", id)["detail"], "echo all of it");
}
