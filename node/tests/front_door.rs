//! What a node does for a caller before, or without, authentication: nothing that costs the
//! fleet. A call on an unknown id with no token asks no peer (and no store); with a token, such
//! lookups are rate-limited per client; `/metrics` requires its token once one is set; and a
//! body past the limit gets a `413` that a client still writing it (Python's urllib) can read.

mod common;

use common::mesh::*;
use common::*;

fn metric(n: &Sandboxd, name: &str) -> u64 {
    let (_, v) = n.req("GET", "/metrics", Some(ROOT), None);
    let text = v.as_str().unwrap_or_default().to_string();
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|rest| rest.trim().parse().ok()))
        .unwrap_or_else(|| panic!("no {name} in {text}"))
}

#[test]
fn unknown_ids_cost_no_lookup_without_a_token_and_lookups_are_limited_per_client() {
    let dir = tempfile::tempdir().unwrap();
    certs(dir.path(), &["a", "b"]);
    // One lookup a minute after a burst of three: the test never waits for a refill.
    let a = node(dir.path(), "a", 1, None, "lookups_per_minute = 1\nlookup_burst = 3\n");
    let b = node(dir.path(), "b", 2, Some(&mesh_addr(&a)), "");
    eventually("a sees b", || peer_names(&a) == ["b"]);

    // No token, or one no sandbox could have: 401, and no peer is asked.
    for i in 0..50 {
        let path = format!("/v1/sandboxes/sb-b-{i:04}");
        for bearer in [None, Some("guessed-token")] {
            let (status, body) = a.req("GET", &path, bearer, None);
            assert_eq!(status, 401, "{body}");
            let exec = Some(r#"{"argv":["id"]}"#);
            assert_eq!(a.req("POST", &format!("{path}/exec"), bearer, exec).0, 401);
        }
    }
    assert_eq!(metric(&a, "silkmesh_owner_lookups_total"), 0, "asked peers with no token");

    // With a well-formed token (the node cannot tell a guess from a real one before asking),
    // the client's burst is looked up and the rest are refused with 429 and Retry-After.
    let mut statuses = vec![];
    for i in 0..6 {
        let path = format!("/v1/sandboxes/sb-b-{i:04}");
        statuses.push(a.req("GET", &path, Some(WRONG_TOKEN), None).0);
    }
    assert_eq!(statuses, [404, 404, 404, 429, 429, 429]);
    assert_eq!(metric(&a, "silkmesh_owner_lookups_total"), 3);
    assert_eq!(metric(&a, "silkmesh_owner_lookups_limited_total"), 3);
    let head = format!("GET /v1/sandboxes/sb-b-0001 HTTP/1.1\r\nAuthorization: Bearer {ROOT}\r\n");
    let (status, headers, body) = raw_answer(a.addr, &head);
    assert!(status.contains("429"), "{status}");
    assert!(headers.contains(&"retry-after: 1".to_string()), "{headers:?}");
    assert!(body.contains("rate_limited"), "{body}");

    // A sandbox the client may use is still found through the limited node once the owner is
    // known; other clients are not limited by this one. (b claims from its own pool: one that
    // is still filling would send the claim to a.)
    eventually("b has a warm sandbox", || b.info()["pools"][0]["warm"].as_u64() > Some(0));
    let claimed = b.claim("{}");
    let (id, token) = (claimed["id"].as_str().unwrap(), claimed["token"].as_str().unwrap());
    let (status, _) = b.req("GET", &format!("/v1/sandboxes/{id}"), Some(token), None);
    assert_eq!(status, 200);
}

#[test]
fn metrics_require_their_token_once_one_is_set() {
    let n = Sandboxd::start("metrics_token = \"scrape-secret\"\n");
    assert_eq!(n.req("GET", "/metrics", None, None).0, 401);
    assert_eq!(n.req("GET", "/metrics", Some("wrong"), None).0, 401);
    let (status, text) = n.req("GET", "/metrics", Some("scrape-secret"), None);
    assert_eq!(status, 200);
    assert!(text.as_str().unwrap().contains("silkmesh_claims_total"));
    assert_eq!(n.req("GET", "/metrics", Some(ROOT), None).0, 200, "root reads them too");
    // The metrics token is good for nothing else.
    assert_eq!(n.req("GET", "/v1/info", Some("scrape-secret"), None).0, 401);
}

#[test]
fn a_client_still_writing_a_too_large_body_reads_the_413() {
    let n = Sandboxd::start("max_body_bytes = 65536\n");
    // 32 MiB: far more than the socket buffers hold, so a node that answered and closed
    // without reading would leave urllib with a broken pipe instead of the answer.
    let script = r#"
import json, sys, urllib.request, urllib.error
url, token = sys.argv[1], sys.argv[2]
req = urllib.request.Request(url + "/v1/sandboxes", data=b" " * (32 << 20), method="POST",
    headers={"Authorization": "Bearer " + token, "Content-Type": "application/json"})
try:
    urllib.request.urlopen(req, timeout=60)
    print("accepted")
except urllib.error.HTTPError as e:
    print(e.code, json.load(e)["error"]["code"])
"#;
    let out = std::process::Command::new("python3")
        .args(["-c", script, &n.url(), ROOT])
        .output()
        .expect("python3 (scripts/install-test-deps installs it)");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "413 payload_too_large");
    // The node is fine and takes normal bodies afterwards.
    assert_eq!(n.req("GET", "/v1/info", Some(ROOT), None).0, 200);
}
