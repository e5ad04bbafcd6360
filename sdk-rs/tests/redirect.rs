//! Redirect following against tiny local servers: a `307` is followed once, to the same method
//! and body, with `no_redirect=1` added to the retry; a second `307` is an error.

mod common;

use common::FakeHttp;
use silkmesh::{Client, Error, Tier};

fn redirect_to(location: &str) -> String {
    format!(
        "HTTP/1.1 307 Temporary Redirect\r\nLocation: {location}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    )
}

fn json(status: &str, body: &str) -> String {
    format!(
        "HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
}

/// A claim's answer in the node's shape (`silk_api::Sandbox`, every field it always sends).
const CLAIMED: &str = r#"{"id": "sb-elsewhere", "tier": "warm", "token": "sbt_peer", "template": "host",
    "size": "small", "lane": "none", "state": "claimed", "owner": "127.0.0.1:1", "created_ms": 1,
    "deadline_ms": 2, "on_expire": "destroy", "metadata": {}, "agent_path": "/x",
    "lease_seconds": 300, "state_since_ms": 1, "from_checkpoint": null, "forked_from": null,
    "memory_snapshot": false}"#;

#[tokio::test]
async fn a_claim_follows_one_307_with_no_redirect_added() {
    let peer = FakeHttp::start(|req| {
        if req.line == "POST /v1/sandboxes?no_redirect=1 HTTP/1.1" {
            json("201 Created", CLAIMED)
        } else {
            json("500 Internal Server Error", r#"{"error": {"code": "wrong", "message": "?"}}"#)
        }
    })
    .await;
    let to = format!("{}/v1/sandboxes", peer.url());
    let first = FakeHttp::start(move |_| redirect_to(&to)).await;

    let client = Client::builder(first.url()).token("root").build().unwrap();
    let s = client.claim("host").metadata("k", "v").send().await.unwrap();
    assert_eq!((s.id(), s.token(), s.tier()), ("sb-elsewhere", "sbt_peer", Tier::Warm));

    let asked = first.seen();
    assert_eq!(asked.len(), 1);
    assert_eq!(asked[0].line, "POST /v1/sandboxes HTTP/1.1");
    let retried = peer.seen();
    assert_eq!(retried.len(), 1, "one hop");
    assert_eq!(retried[0].line, "POST /v1/sandboxes?no_redirect=1 HTTP/1.1");
    assert_eq!(retried[0].body, asked[0].body, "the same body is sent again");
    let body: serde_json::Value = serde_json::from_str(&retried[0].body).unwrap();
    assert_eq!(
        (body["template"].as_str(), body["metadata"]["k"].as_str()),
        (Some("host"), Some("v"))
    );
    assert_eq!(retried[0].header("authorization"), Some("Bearer root"));
}

#[tokio::test]
async fn a_second_307_is_not_followed() {
    let loop_back = std::sync::Arc::new(std::sync::OnceLock::<String>::new());
    let target = loop_back.clone();
    let peer = FakeHttp::start(move |_| redirect_to(target.get().unwrap())).await;
    let to = format!("{}/v1/sandboxes", peer.url());
    let first = FakeHttp::start(move |_| redirect_to(&to)).await;
    loop_back.set(format!("{}/v1/sandboxes", first.url())).unwrap();

    let client = Client::builder(first.url()).token("root").build().unwrap();
    match client.claim("host").send().await {
        Err(Error::TooManyRedirects { location }) => {
            assert_eq!(location, format!("{}/v1/sandboxes", first.url()));
        }
        other => panic!("{other:?}"),
    }
    assert_eq!((first.seen().len(), peer.seen().len()), (1, 1), "exactly one hop taken");
}

#[tokio::test]
async fn a_relative_location_keeps_its_query_and_gains_no_redirect() {
    let server = FakeHttp::start(|req| {
        if req.target() == "/v1/pools" {
            redirect_to("/v1/pools-elsewhere?zone=a")
        } else if req.target() == "/v1/pools-elsewhere?zone=a&no_redirect=1" {
            json("200 OK", r#"{"pools": [{"template": "host", "warm": 3}]}"#)
        } else {
            json("404 Not Found", r#"{"error": {"code": "no_route", "message": "no"}}"#)
        }
    })
    .await;
    let client = Client::builder(server.url()).token("root").build().unwrap();
    let pools = client.pools().await.unwrap();
    assert_eq!((pools[0].template.as_str(), pools[0].warm), ("host", 3));
    assert_eq!(server.seen().len(), 2);

    // A 307 without a Location cannot be followed, and says so.
    let broken = FakeHttp::start(|_| {
        "HTTP/1.1 307 Temporary Redirect\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".into()
    })
    .await;
    let client = Client::builder(broken.url()).token("root").build().unwrap();
    assert!(matches!(client.info().await, Err(Error::Protocol(_))));
}

#[tokio::test]
async fn error_bodies_are_typed_and_other_statuses_keep_their_text() {
    let server = FakeHttp::start(|req| {
        if req.target() == "/v1/info" {
            json(
                "429 Too Many Requests",
                r#"{"error": {"code": "node_full", "message": "at max_claims"}}"#,
            )
        } else {
            "HTTP/1.1 502 Bad Gateway\r\nContent-Length: 4\r\nConnection: close\r\n\r\ngone".into()
        }
    })
    .await;
    let client = Client::builder(server.url()).token("root").build().unwrap();
    match client.info().await {
        Err(e @ Error::Api { status: 429, .. }) => {
            assert!(e.is_retryable());
            assert!(
                matches!(e, Error::Api { ref code, ref message, .. } if code == "node_full" && message == "at max_claims")
            );
        }
        other => panic!("{other:?}"),
    }
    match client.pools().await {
        Err(Error::Api { status: 502, code, message }) => {
            assert_eq!((code.as_str(), message.as_str()), ("http_502", "gone"));
        }
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn a_redirect_to_a_dead_node_falls_back_to_the_origin_once() {
    // A port nothing listens on: the node the origin chose has died.
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dead_url = format!("http://{}/v1/sandboxes", dead.local_addr().unwrap());
    drop(dead);
    let origin = FakeHttp::start(move |req| {
        if req.line.contains("no_redirect=1") {
            json("201 Created", CLAIMED)
        } else {
            redirect_to(&dead_url)
        }
    })
    .await;
    let client = Client::builder(origin.url()).token("root").build().unwrap();
    let s = client.claim("host").send().await.unwrap();
    assert_eq!(s.id(), "sb-elsewhere");
    let lines: Vec<String> = origin.seen().iter().map(|r| r.line.clone()).collect();
    assert_eq!(
        lines,
        ["POST /v1/sandboxes HTTP/1.1", "POST /v1/sandboxes?no_redirect=1 HTTP/1.1"],
        "asked once, then served by the origin itself"
    );
}

/// A claim's `101` names the sandbox in its `silk-sandbox` header: if the connection then
/// cannot become the relay (here, bytes before any request), the claim still stands and its
/// token reaches the caller; the first call dials a relay of its own.
#[tokio::test]
async fn a_101_that_names_the_sandbox_is_a_claim_even_if_the_relay_breaks() {
    let row = CLAIMED.replace('\n', " ");
    let node = FakeHttp::start(move |_| {
        format!(
            "HTTP/1.1 101 Switching Protocols\r\nConnection: upgrade\r\nUpgrade: silkd\r\nsilk-sandbox: {row}\r\n\r\nnot silk-proto"
        )
    })
    .await;
    let client = Client::builder(node.url()).token("root").build().unwrap();
    let s = client.claim("host").send().await.unwrap();
    assert_eq!((s.id(), s.token(), s.tier()), ("sb-elsewhere", "sbt_peer", Tier::Warm));
    assert_eq!(s.connection_stats().dialled, 0, "the broken connection was not kept");
    let asked = node.seen();
    assert_eq!(asked.len(), 1);
    assert_eq!(asked[0].header("upgrade"), Some("silkd"));
}

/// A redirect target that took the claim and then broke the connection may have claimed: the
/// request is not sent again to the origin (only a target that could not be reached is).
#[tokio::test]
async fn a_claim_a_redirect_target_took_is_not_sent_again() {
    let target = FakeHttp::start(|_| String::new()).await;
    let to = format!("{}/v1/sandboxes", target.url());
    let origin = FakeHttp::start(move |_| redirect_to(&to)).await;
    let client = Client::builder(origin.url()).token("root").build().unwrap();
    let err = client.claim("host").send().await.unwrap_err();
    assert!(matches!(err, Error::Transport { .. }), "{err:?}");
    assert_eq!((origin.seen().len(), target.seen().len()), (1, 1), "one hop, no fallback");
}

/// A claim that asked for silkd's answer and cannot get one (the node put none in its `101`,
/// and the sandbox's relay answers no frame) is an error, and the sandbox it claimed is
/// released: the caller gets no handle to it.
#[tokio::test]
async fn a_claim_whose_silkd_cannot_answer_is_released_and_an_error() {
    let row = CLAIMED.replace('\n', " ");
    let node = FakeHttp::start(move |req| {
        if req.line.starts_with("DELETE ") {
            return "HTTP/1.1 204 No Content\r\n\r\n".to_string();
        }
        format!(
            "HTTP/1.1 101 Switching Protocols\r\nConnection: upgrade\r\nUpgrade: silkd\r\nsilk-sandbox: {row}\r\n\r\nnot silk-proto"
        )
    })
    .await;
    let client = Client::builder(node.url()).token("root").build().unwrap();
    let err = client.claim("host").answered(true).send().await.unwrap_err();
    assert!(!matches!(err, Error::Api { .. }), "{err:?}");
    let lines: Vec<String> = node.seen().iter().map(|r| r.line.clone()).collect();
    assert_eq!(lines[0], "POST /v1/sandboxes HTTP/1.1");
    assert_eq!(node.seen()[0].header("silk-ask"), Some("info"), "the node was asked to check");
    assert_eq!(
        lines.last().map(String::as_str),
        Some("DELETE /v1/sandboxes/sb-elsewhere HTTP/1.1")
    );
}
