//! Two tenants on a three-node mesh (forward mode, one shared store), attacked from each side:
//! a tenant's key reaches its own sandboxes, checkpoints and templates through any node and
//! nothing of the other's (the same 404 as an unknown id, on every route); quotas hold across
//! the mesh for claims, forks, branches and checkpoints (429 naming the limit); a change made on
//! one node is in force on the others within the refresh bound; promoted templates are named
//! per tenant; a rotated key stops working everywhere; a deleted tenant leaves nothing.

mod common;

use common::mesh::*;
use common::*;
use serde_json::{Value, json};

const REFRESH: &str = "tenant_refresh_ms = 200\n";

struct Fleet {
    _dir: tempfile::TempDir,
    nodes: Vec<Sandboxd>,
}

fn fleet() -> Fleet {
    let dir = tempfile::tempdir().unwrap();
    certs(dir.path(), &["a", "b", "c"]);
    let store = dir.path().join("store");
    let cfg = format!(
        "{REFRESH}[[pools]]\ntemplate = \"host\"\nwarm = 1\nwarm_max = 1\n[store.fs]\nroot = \"{}\"\n",
        store.display()
    );
    let a = forwarding_node(dir.path(), "a", 21, None, &cfg);
    let join = mesh_addr(&a);
    let b = forwarding_node(dir.path(), "b", 22, Some(&join), &cfg);
    let c = forwarding_node(dir.path(), "c", 23, Some(&join), &cfg);
    for n in [&a, &b, &c] {
        eventually("a mesh of three", || peer_names(n).len() == 2);
    }
    Fleet { _dir: dir, nodes: vec![a, b, c] }
}

fn create(n: &Sandboxd, name: &str, max_sandboxes: u64, max_checkpoints: u64) -> String {
    let body = json!({ "name": name, "max_sandboxes": max_sandboxes,
        "max_checkpoints": max_checkpoints, "max_store_bytes": 1u64 << 40 });
    let (status, v) = n.req("POST", "/v1/tenants", Some(ROOT), Some(&body.to_string()));
    assert_eq!(status, 201, "{v}");
    assert_eq!(v["name"], name);
    v["api_key"].as_str().unwrap().to_string()
}

fn claim(n: &Sandboxd, key: &str, body: &str) -> (u16, Value) {
    n.req("POST", "/v1/sandboxes", Some(key), Some(body))
}

fn live(n: &Sandboxd, tenant: &str) -> u64 {
    let (status, v) = n.req("GET", &format!("/v1/tenants/{tenant}"), Some(ROOT), None);
    assert_eq!(status, 200, "{v}");
    v["usage"]["live_sandboxes"].as_u64().unwrap()
}

fn quota(v: &Value, limit: &str) {
    assert_eq!(v["error"]["code"], "quota_exceeded", "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains(limit), "{v}");
}

#[test]
fn two_tenants_share_a_mesh_and_neither_reaches_the_other() {
    let f = fleet();
    let [a, b, c] = [&f.nodes[0], &f.nodes[1], &f.nodes[2]];
    let k1 = create(a, "team-1", 2, 1);
    let k2 = create(a, "team-2", 3, 1);
    // Known on every node within the refresh bound.
    for n in [b, c] {
        eventually("the tenants are known", || {
            n.req("GET", "/v1/tenants/team-1", Some(&k1), None).0 == 200
                && n.req("GET", "/v1/tenants/team-2", Some(&k2), None).0 == 200
        });
    }
    // A tenant key is not root: node routes and other tenants' records stay closed.
    for (method, path) in [
        ("GET", "/v1/info"),
        ("GET", "/v1/pools"),
        ("POST", "/v1/drain"),
        ("GET", "/v1/tenants"),
        ("GET", "/v1/peers"),
    ] {
        assert_eq!(b.req(method, path, Some(&k1), None).0, 401, "{method} {path}");
    }
    assert_eq!(b.req("GET", "/v1/tenants/team-2", Some(&k1), None).0, 404);
    let (status, _) = b.req(
        "POST",
        "/v1/tenants",
        Some(&k1),
        Some(r#"{"name":"x","max_sandboxes":9,"max_checkpoints":9,"max_store_bytes":9}"#),
    );
    assert_eq!(status, 401);

    // team-1 claims through a and b; its sandboxes are its own.
    let (status, s1) = claim(a, &k1, r#"{"metadata":{"who":"one"}}"#);
    assert_eq!(status, 201, "{s1}");
    assert_eq!(s1["tenant"], "team-1");
    let (status, s2) = claim(b, &k1, "{}");
    assert_eq!(status, 201, "{s2}");
    let (id1, tok1) =
        (s1["id"].as_str().unwrap().to_string(), s1["token"].as_str().unwrap().to_string());
    let id2 = s2["id"].as_str().unwrap().to_string();
    let (status, t2s) = claim(c, &k2, "{}");
    assert_eq!(status, 201, "{t2s}");
    let id3 = t2s["id"].as_str().unwrap().to_string();

    // Isolation, both ways, through every node, on every sandbox route.
    for n in [a, b, c] {
        for (key, id) in [(&k2, &id1), (&k1, &id3)] {
            for (method, path, body) in [
                ("GET", format!("/v1/sandboxes/{id}"), None),
                ("DELETE", format!("/v1/sandboxes/{id}"), None),
                ("POST", format!("/v1/sandboxes/{id}/exec"), Some(r#"{"argv":["id"]}"#)),
                ("POST", format!("/v1/sandboxes/{id}/renew"), Some(r#"{"ttl_seconds":60}"#)),
                ("POST", format!("/v1/sandboxes/{id}/checkpoint"), Some("{}")),
                ("GET", format!("/v1/sandboxes/{id}/checkpoints"), None),
                ("POST", format!("/v1/sandboxes/{id}/fork"), Some(r#"{"count":1}"#)),
                ("POST", format!("/v1/sandboxes/{id}/hibernate"), Some("")),
                ("POST", format!("/v1/sandboxes/{id}/promote"), Some(r#"{"template":"x"}"#)),
                ("POST", format!("/v1/sandboxes/{id}/move"), Some("{}")),
            ] {
                let (status, v) = n.req(method, &path, Some(key), body);
                assert_eq!(status, 404, "{method} {path} with another tenant's key: {v}");
            }
            let head = format!(
                "GET /v1/sandboxes/{id}/agent HTTP/1.1\r\nAuthorization: Bearer {key}\r\nConnection: upgrade\r\nUpgrade: silkd\r\n"
            );
            let (line, _, _) = raw_answer(n.addr, &head);
            assert!(line.contains(" 404 "), "the relay with another tenant's key: {line}");
        }
        // Its own, through any node (forwarded to the owner).
        let out = n.exec(&id1, &k1, "echo mine");
        assert_eq!(out["stdout"], "mine\n", "{out}");
    }
    // Lists show a tenant its own only.
    let (_, list) = a.req("GET", "/v1/sandboxes", Some(&k2), None);
    assert!(
        list["sandboxes"].as_array().unwrap().iter().all(|s| s["tenant"] == "team-2"),
        "{list}"
    );

    // Quota across the mesh: team-1 has 2 of 2; a claim through c (which holds none of them)
    // is refused once c has heard of them.
    eventually("c counts team-1's sandboxes", || live(c, "team-1") == 2);
    let (status, v) = claim(c, &k1, "{}");
    assert_eq!(status, 429, "{v}");
    quota(&v, "max_sandboxes 2");
    // So is a fork by a sandbox's own token.
    let (status, v) =
        a.req("POST", &format!("/v1/sandboxes/{id1}/fork"), Some(&tok1), Some(r#"{"count":1}"#));
    assert_eq!(status, 429, "{v}");
    quota(&v, "max_sandboxes 2");

    // Checkpoints: one allowed, the second refused; the other tenant cannot see or branch it.
    let (status, ck) =
        a.req("POST", &format!("/v1/sandboxes/{id1}/checkpoint"), Some(&k1), Some("{}"));
    assert_eq!(status, 201, "{ck}");
    let ck = ck["id"].as_str().unwrap().to_string();
    let (status, v) =
        a.req("POST", &format!("/v1/sandboxes/{id1}/checkpoint"), Some(&tok1), Some("{}"));
    assert_eq!(status, 429, "{v}");
    quota(&v, "max_checkpoints 1");
    for n in [a, b, c] {
        assert_eq!(n.req("GET", &format!("/v1/checkpoints/{ck}"), Some(&k2), None).0, 404);
        assert_eq!(
            n.req("POST", &format!("/v1/checkpoints/{ck}/claim"), Some(&k2), Some("{}")).0,
            404
        );
        let (_, all) = n.req("GET", "/v1/checkpoints", Some(&k2), None);
        assert_eq!(all["checkpoints"], json!([]), "team-2 sees no checkpoint of team-1");
    }
    let (_, own) = b.req("GET", "/v1/checkpoints", Some(&k1), None);
    assert_eq!(own["checkpoints"][0]["id"], ck.as_str());
    // A branch counts against the quota too.
    let (status, v) = b.req("POST", &format!("/v1/checkpoints/{ck}/claim"), Some(&k1), Some("{}"));
    assert_eq!(status, 429, "{v}");
    quota(&v, "max_sandboxes 2");

    // A limit raised on b is in force on c within the bound: the branch goes through.
    let (status, v) =
        b.req("PATCH", "/v1/tenants/team-1", Some(ROOT), Some(r#"{"max_sandboxes":3}"#));
    assert_eq!((status, v["limits"]["max_sandboxes"].as_u64()), (200, Some(3)), "{v}");
    eventually("c knows the new limit", || {
        let (_, t) = c.req("GET", "/v1/tenants/team-1", Some(ROOT), None);
        t["limits"]["max_sandboxes"] == 3
    });
    // On c itself: a branch is otherwise sent to a, which keeps the checkpoint's copy and may
    // not know the new limit yet.
    let branch = format!("/v1/checkpoints/{ck}/claim?no_redirect=1");
    let (status, branched) = c.req("POST", &branch, Some(&k1), Some("{}"));
    assert_eq!(status, 201, "{branched}");
    assert_eq!(branched["tenant"], "team-1");

    // Templates are named per tenant and seen by their tenant only.
    let (status, t) = a.req(
        "POST",
        &format!("/v1/sandboxes/{id1}/promote"),
        Some(&k1),
        Some(r#"{"template":"base"}"#),
    );
    assert_eq!((status, t["name"].as_str()), (201, Some("team-1/base")), "{t}");
    let (_, mine) = a.req("GET", "/v1/templates", Some(&k1), None);
    let (_, theirs) = a.req("GET", "/v1/templates", Some(&k2), None);
    let names = |v: &Value| -> Vec<String> {
        v["templates"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["name"].as_str().unwrap().to_string())
            .collect()
    };
    assert!(names(&mine).contains(&"team-1/base".to_string()));
    assert!(!names(&theirs).iter().any(|n| n.starts_with("team-1/")), "{theirs}");
    let (status, v) = a.req(
        "POST",
        "/v1/sandboxes?no_redirect=1",
        Some(&k2),
        Some(r#"{"template":"team-1/base"}"#),
    );
    assert_eq!((status, v["error"]["code"].as_str()), (404, Some("template_not_found")), "{v}");
    assert_eq!(a.req("DELETE", "/v1/templates/team-1%2Fbase", Some(&k2), None).0, 404);

    // Rotation: the old key stops working on every node within the bound (it is no
    // credential at all now: 401).
    let (status, rotated) = b.req("POST", "/v1/tenants/team-1/rotate", Some(ROOT), None);
    assert_eq!(status, 200, "{rotated}");
    let k1b = rotated["api_key"].as_str().unwrap().to_string();
    // A node may drop the old key (revoked) a moment before it reads the new one.
    for n in [a, b, c] {
        eventually("the old key is refused and the new one taken", || {
            n.req("GET", &format!("/v1/sandboxes/{id1}"), Some(&k1), None).0 == 401
                && n.req("GET", &format!("/v1/sandboxes/{id1}"), Some(&k1b), None).0 == 200
        });
    }

    // Deletion: refused while it has sandboxes; forced, it leaves nothing on any node.
    let (status, v) = c.req("DELETE", "/v1/tenants/team-1", Some(ROOT), None);
    assert_eq!(status, 409, "{v}");
    assert_eq!(c.req("DELETE", "/v1/tenants/team-1?force=true", Some(ROOT), None).0, 204);
    for n in [a, b, c] {
        eventually("team-1's sandboxes are gone", || {
            n.req("GET", &format!("/v1/sandboxes/{id2}"), Some(ROOT), None).0 == 404
                && n.req("GET", &format!("/v1/sandboxes/{id1}"), Some(ROOT), None).0 == 404
        });
    }
    assert_eq!(a.req("GET", &format!("/v1/checkpoints/{ck}"), Some(ROOT), None).0, 404);
    eventually("team-1's template is gone", || {
        let (_, all) = a.req("GET", "/v1/templates", Some(ROOT), None);
        !names(&all).contains(&"team-1/base".to_string())
    });
    // team-2 is untouched.
    assert_eq!(a.req("GET", &format!("/v1/sandboxes/{id3}"), Some(&k2), None).0, 200);
}
