//! Views of the whole fleet from any node of a three-node mesh: the sandboxes list (root's and
//! a tenant's, paged), `/v1/fleet`, the audit journal and the usage journal gathered over the
//! mesh; usage metered before a kill -9 is still there after the restart; a peer that does not
//! answer is named in the answer, never silently left out.

mod common;

use std::collections::BTreeSet;

use common::mesh::*;
use common::*;
use serde_json::{Value, json};

fn ids(v: &Value) -> BTreeSet<String> {
    v["sandboxes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["id"].as_str().unwrap().to_string())
        .collect()
}

#[test]
fn any_node_answers_for_the_whole_fleet_and_names_a_node_that_does_not() {
    let dir = tempfile::tempdir().unwrap();
    certs(dir.path(), &["a", "b", "c"]);
    let cfg = format!(
        "tenant_refresh_ms = 200\nusage_interval_seconds = 1\n[[pools]]\ntemplate = \"host\"\nwarm = 1\nwarm_max = 1\n[store.fs]\nroot = \"{}\"\n",
        dir.path().join("store").display()
    );
    let a = forwarding_node(dir.path(), "a", 31, None, &cfg);
    let join = mesh_addr(&a);
    let mut b = forwarding_node(dir.path(), "b", 32, Some(&join), &cfg);
    let c = forwarding_node(dir.path(), "c", 33, Some(&join), &cfg);
    for n in [&a, &b, &c] {
        eventually("a mesh of three", || peer_names(n).len() == 2);
    }
    let body = json!({"name": "team", "max_sandboxes": 10, "max_checkpoints": 1, "max_store_bytes": 1u64 << 30});
    let (status, t) = a.req("POST", "/v1/tenants", Some(ROOT), Some(&body.to_string()));
    assert_eq!(status, 201, "{t}");
    let key = t["api_key"].as_str().unwrap().to_string();
    for n in [&b, &c] {
        eventually("the tenant is known", || {
            n.req("GET", "/v1/tenants/team", Some(&key), None).0 == 200
        });
    }

    // One tenant sandbox on each node, and one of root's on a.
    let mut team = BTreeSet::new();
    for n in [&a, &b, &c] {
        let (status, s) = n.req("POST", "/v1/sandboxes?no_redirect=1", Some(&key), Some("{}"));
        assert_eq!(status, 201, "{s}");
        team.insert(s["id"].as_str().unwrap().to_string());
    }
    let (status, r) = a.req("POST", "/v1/sandboxes?no_redirect=1", Some(ROOT), Some("{}"));
    assert_eq!(status, 201, "{r}");
    let root_id = r["id"].as_str().unwrap().to_string();

    for n in [&a, &b, &c] {
        let (status, all) = n.req("GET", "/v1/sandboxes", Some(ROOT), None);
        assert_eq!(status, 200, "{all}");
        let mut want = team.clone();
        want.insert(root_id.clone());
        assert_eq!(ids(&all), want, "root's list through {}", n.addr);
        let (_, mine) = n.req("GET", "/v1/sandboxes", Some(&key), None);
        assert_eq!(ids(&mine), team, "the tenant's list through {}", n.addr);
        let (_, here) = n.req("GET", "/v1/sandboxes?scope=node", Some(&key), None);
        assert_eq!(ids(&here).len(), 1, "scope=node: this node's only");
    }
    // Pages of one walk the whole list once, in a stable order.
    let (mut seen, mut cursor) = (vec![], None::<String>);
    loop {
        let q = cursor.as_ref().map_or(String::new(), |c| format!("&cursor={c}"));
        let (status, page) = b.req("GET", &format!("/v1/sandboxes?limit=1{q}"), Some(ROOT), None);
        assert_eq!(status, 200, "{page}");
        seen.extend(ids(&page));
        match page["next_cursor"].as_str() {
            Some(next) => cursor = Some(next.to_string()),
            None => break,
        }
    }
    assert_eq!(seen.len(), 4, "{seen:?}");
    assert_eq!(seen.iter().collect::<BTreeSet<_>>().len(), 4);

    let (status, fleet) = c.req("GET", "/v1/fleet", Some(ROOT), None);
    assert_eq!(status, 200, "{fleet}");
    let names: BTreeSet<&str> =
        fleet["nodes"].as_array().unwrap().iter().map(|n| n["name"].as_str().unwrap()).collect();
    assert_eq!(names, BTreeSet::from(["a", "b", "c"]));
    assert_eq!(c.req("GET", "/v1/fleet", Some(&key), None).0, 401, "root only");

    // The audit journal of every node, through one.
    let (_, audit) = c.req("GET", "/v1/audit", Some(&key), None);
    let claimed: BTreeSet<String> = audit["entries"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["action"] == "claim")
        .map(|e| e["target"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(claimed, team, "{audit}");

    // Usage, summed over the fleet; kept across a kill -9 of a node.
    let seconds = |n: &Sandboxd| {
        let (status, u) = n.req("GET", "/v1/usage?tenant=team", Some(ROOT), None);
        assert_eq!(status, 200, "{u}");
        assert!(u["unreachable"].is_null(), "{u}");
        u["rows"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["sandbox_seconds"].as_u64().unwrap())
            .sum::<u64>()
    };
    let on_b = |b: &Sandboxd| {
        let (_, u) = b.req("GET", "/v1/usage?tenant=team&scope=node", Some(ROOT), None);
        u["rows"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["sandbox_seconds"].as_u64().unwrap())
            .sum::<u64>()
    };
    eventually("every node metered its sandbox", || seconds(&a) >= 3 && on_b(&b) >= 1);
    let before = on_b(&b);
    b.kill9();
    b.restart();
    assert!(on_b(&b) >= before, "metered seconds survive kill -9");
    eventually("b meters on after its restart", || on_b(&b) > before);
    let (_, tenant) = a.req("GET", "/v1/tenants/team", Some(&key), None);
    assert!(tenant["usage"]["sandbox_seconds"].as_u64().unwrap() >= 1, "{tenant}");
    eventually("b is back in the mesh", || peer_names(&a).contains(&"b".to_string()));

    // A node that does not answer is named, and the others' sandboxes are still listed.
    b.kill9();
    let (status, partial) = a.req("GET", "/v1/sandboxes", Some(ROOT), None);
    assert_eq!(status, 200, "{partial}");
    if partial["unreachable"] != json!(["b"]) {
        // b was declared down before the list was asked: it is no longer in the fleet.
        assert!(!peer_names(&a).contains(&"b".to_string()), "{partial}");
    }
    assert!(ids(&partial).contains(&root_id));
}

#[test]
fn a_tenant_past_its_sandbox_seconds_gets_no_new_sandboxes_and_keeps_its_running_ones() {
    let n = Sandboxd::start(
        "usage_interval_seconds = 1\n[[pools]]\ntemplate = \"host\"\nwarm = 1\nwarm_max = 2\n",
    );
    let body = json!({"name": "metered", "max_sandboxes": 5, "max_checkpoints": 1,
        "max_store_bytes": 1u64 << 30, "max_sandbox_seconds": 2});
    let (status, t) = n.req("POST", "/v1/tenants", Some(ROOT), Some(&body.to_string()));
    assert_eq!(status, 201, "{t}");
    let key = t["api_key"].as_str().unwrap().to_string();
    let (status, s) = n.req("POST", "/v1/sandboxes", Some(&key), Some("{}"));
    assert_eq!(status, 201, "{s}");
    eventually("two sandbox-seconds are metered", || {
        let (_, t) = n.req("GET", "/v1/tenants/metered", Some(&key), None);
        t["usage"]["sandbox_seconds"].as_u64() >= Some(2)
    });
    let (status, v) = n.req("POST", "/v1/sandboxes", Some(&key), Some("{}"));
    assert_eq!(status, 429, "{v}");
    assert_eq!(v["error"]["code"], "quota_exceeded");
    assert!(v["error"]["message"].as_str().unwrap().contains("max_sandbox_seconds 2"), "{v}");
    let out = n.exec(s["id"].as_str().unwrap(), s["token"].as_str().unwrap(), "echo still");
    assert_eq!(out["stdout"], "still\n");
    // Raising the limit lets it claim again.
    let (status, _) =
        n.req("PATCH", "/v1/tenants/metered", Some(ROOT), Some(r#"{"max_sandbox_seconds":0}"#));
    assert_eq!(status, 200);
    assert_eq!(n.req("POST", "/v1/sandboxes", Some(&key), Some("{}")).0, 201);
}

#[test]
fn with_the_store_down_tenants_still_authenticate_and_tenant_changes_answer_503() {
    let mut n = Sandboxd::start("[[pools]]\ntemplate = \"host\"\nwarm = 1\nwarm_max = 2\n");
    let body = json!({"name": "team", "max_sandboxes": 5, "max_checkpoints": 1, "max_store_bytes": 1u64 << 30});
    let (status, t) = n.req("POST", "/v1/tenants", Some(ROOT), Some(&body.to_string()));
    assert_eq!(status, 201, "{t}");
    let key = t["api_key"].as_str().unwrap().to_string();
    // The node starts again with its store unreachable (nothing listens on port 9).
    let dead = "[store.s3]\nbucket = \"b\"\nendpoint = \"http://127.0.0.1:9\"\npath_style = true\nmax_attempts = 1\nconnect_timeout_ms = 200\n";
    let config = std::fs::read_to_string(&n.config).unwrap();
    std::fs::write(&n.config, format!("{config}{dead}")).unwrap();
    n.restart();
    // The tenant's key still works: from the records this node read last.
    let (status, s) = n.req("POST", "/v1/sandboxes", Some(&key), Some("{}"));
    assert_eq!(status, 201, "{s}");
    assert_eq!(s["tenant"], "team");
    let other =
        json!({"name": "later", "max_sandboxes": 1, "max_checkpoints": 1, "max_store_bytes": 1});
    let (status, v) = n.req("POST", "/v1/tenants", Some(ROOT), Some(&other.to_string()));
    assert_eq!((status, v["error"]["code"].as_str()), (503, Some("store_unavailable")), "{v}");
    let (status, v) = n.req("POST", "/v1/tenants/team/rotate", Some(ROOT), None);
    assert_eq!((status, v["error"]["code"].as_str()), (503, Some("store_unavailable")), "{v}");
    // Nothing was lost: the old key still works.
    assert_eq!(
        n.req("GET", &format!("/v1/sandboxes/{}", s["id"].as_str().unwrap()), Some(&key), None).0,
        200
    );
}
