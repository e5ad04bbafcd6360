//! The ports route: HTTP and WebSocket to a server inside a sandbox (`tests/ports/server.py`,
//! the stdlib only, on 127.0.0.1:8000 in a sandbox with no network), over silkd's port forward.
//! The sandbox token opens it and never reaches the server; others' tokens and no token are the
//! 404 of nothing; a port nothing listens on is `502 port_closed`.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};

use common::*;

/// One request on a new connection (`Connection: close`): the status and the body.
fn raw(addr: SocketAddr, request: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.write_all(request.as_bytes()).unwrap();
    let mut answer = String::new();
    s.read_to_string(&mut answer).unwrap();
    let (head, body) = answer.split_once("\r\n\r\n").unwrap_or((&answer, ""));
    (head.split(' ').nth(1).unwrap().parse().unwrap(), body.to_string())
}

fn get(addr: SocketAddr, path: &str, token: Option<&str>) -> (u16, String) {
    let auth = token.map(|t| format!("Authorization: Bearer {t}\r\n")).unwrap_or_default();
    raw(
        addr,
        &format!("GET {path} HTTP/1.1\r\nHost: preview.example\r\n{auth}Connection: close\r\n\r\n"),
    )
}

#[test]
fn http_and_websockets_reach_a_port_inside_the_sandbox() {
    let node = Sandboxd::start("[[pools]]\ntemplate = \"host\"\nwarm = 1\n");
    let c = node.claim("{}");
    let (id, token) = (c["id"].as_str().unwrap(), c["token"].as_str().unwrap());
    let server =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/ports/server.py"))
            .unwrap();
    let body = serde_json::json!({ "argv": ["sh", "-c", "cat > /tmp/server.py"], "stdin": server })
        .to_string();
    let (status, v) =
        node.req("POST", &format!("/v1/sandboxes/{id}/exec"), Some(token), Some(&body));
    assert_eq!(status, 200, "{v}");
    node.exec(id, token, "setsid python3 /tmp/server.py >/tmp/server.log 2>&1 < /dev/null &");
    let base = format!("/v1/sandboxes/{id}/ports/8000");
    eventually("the server listens", || get(node.addr, &base, Some(token)).0 == 200);

    // The path, query, method and body pass; the sandbox token does not; Host is the port's.
    let (status, seen) = get(node.addr, &format!("{base}/a/b?x=1&y=2"), Some(token));
    assert_eq!(status, 200, "{seen}");
    assert!(seen.starts_with("/a/b?x=1&y=2\n"), "{seen}");
    assert!(!seen.to_lowercase().contains("authorization") && !seen.contains(token), "{seen}");
    assert!(seen.contains("host: localhost:8000\n"), "{seen}");
    assert!(seen.contains("x-forwarded-host: preview.example\n"), "{seen}");
    let post = format!(
        "POST {base}/form HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\nContent-Length: 5\r\nConnection: close\r\n\r\nhello"
    );
    let (status, seen) = raw(node.addr, &post);
    assert_eq!(status, 200);
    assert!(seen.starts_with("/form\n") && seen.ends_with("body=hello"), "{seen}");

    // Nobody else's way in: no token, another sandbox's, a forged one.
    let other = node.claim("{}");
    for bad in [Some(other["token"].as_str().unwrap()), Some(WRONG_TOKEN)] {
        assert_eq!(get(node.addr, &base, bad).0, 404, "{bad:?}");
    }
    for none_at_all in [None, Some("sbt_forged")] {
        assert_eq!(get(node.addr, &base, none_at_all).0, 401, "{none_at_all:?}");
    }
    let (status, v) = get(node.addr, &format!("/v1/sandboxes/{id}/ports/8001/"), Some(token));
    assert_eq!(status, 502, "{v}");
    assert!(v.contains("port_closed"), "{v}");
    for port in ["0", "65536", "http"] {
        assert_eq!(
            get(node.addr, &format!("/v1/sandboxes/{id}/ports/{port}/"), Some(token)).0,
            400
        );
    }

    // A WebSocket: upgraded through the node, frames echoed both ways.
    let mut ws = TcpStream::connect(node.addr).unwrap();
    write!(ws, "GET {base}/ws HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\nConnection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n").unwrap();
    let mut reader = BufReader::new(ws.try_clone().unwrap());
    let mut line = String::new();
    reader.read_line(&mut line).unwrap();
    assert!(line.starts_with("HTTP/1.1 101"), "{line}");
    let mut headers = String::new();
    while line != "\r\n" {
        line.clear();
        reader.read_line(&mut line).unwrap();
        headers += &line;
    }
    assert!(headers.contains("s3pPLMBiTxaQ9kYGzzhZRbK+xOo="), "the server's accept: {headers}");
    for text in ["ping", "through the port forward"] {
        let mask = [1u8, 2, 3, 4];
        let mut frame = vec![0x81, 0x80 | text.len() as u8];
        frame.extend(mask);
        frame.extend(text.bytes().enumerate().map(|(i, b)| b ^ mask[i % 4]));
        ws.write_all(&frame).unwrap();
        let mut head = [0u8; 2];
        reader.read_exact(&mut head).unwrap();
        let mut echoed = vec![0u8; (head[1] & 127) as usize];
        reader.read_exact(&mut echoed).unwrap();
        assert_eq!((head[0], echoed.as_slice()), (0x81, text.as_bytes()));
    }
}

/// A request with extra header lines: the status, the head and the body.
fn with_headers(addr: SocketAddr, path: &str, host: &str, extra: &str) -> (u16, String, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    write!(s, "GET {path} HTTP/1.1\r\nHost: {host}\r\n{extra}Connection: close\r\n\r\n").unwrap();
    let mut answer = String::new();
    s.read_to_string(&mut answer).unwrap();
    let (head, body) = answer.split_once("\r\n\r\n").unwrap_or((&answer, ""));
    (head.split(' ').nth(1).unwrap().parse().unwrap(), head.to_string(), body.to_string())
}

fn header<'a>(head: &'a str, name: &str) -> Option<&'a str> {
    head.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.eq_ignore_ascii_case(name).then(|| v.trim())
    })
}

/// Starts tests/ports/server.py in a sandbox and waits until it answers.
fn serve_in(node: &Sandboxd, id: &str, token: &str) {
    let server =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/ports/server.py"))
            .unwrap();
    let body =
        serde_json::json!({ "argv": ["sh", "-c", "cat > /root/server.py"], "stdin": server })
            .to_string();
    let (status, v) =
        node.req("POST", &format!("/v1/sandboxes/{id}/exec"), Some(token), Some(&body));
    assert_eq!(status, 200, "{v}");
    node.exec(id, token, "setsid python3 /root/server.py >/tmp/server.log 2>&1 < /dev/null &");
    let base = format!("/v1/sandboxes/{id}/ports/8000");
    eventually("the server listens", || get(node.addr, &base, Some(token)).0 == 200);
}

fn preview(node: &Sandboxd, id: &str, token: &str, body: &str) -> serde_json::Value {
    let (status, v) =
        node.req("POST", &format!("/v1/sandboxes/{id}/previews"), Some(token), Some(body));
    assert_eq!(status, 201, "{v}");
    v
}

#[test]
fn preview_urls_open_a_port_to_a_browser_until_revoked_expired_or_released() {
    let mut node = Sandboxd::start(
        "[previews]\ndomain = \"preview.test\"\n\n[[pools]]\ntemplate = \"host\"\nwarm = 1\n",
    );
    let c = node.claim("{}");
    let (id, token) =
        (c["id"].as_str().unwrap().to_string(), c["token"].as_str().unwrap().to_string());
    serve_in(&node, &id, &token);
    let p = preview(&node, &id, &token, r#"{"port": 8000, "ttl_seconds": 600}"#);
    let pv = p["token"].as_str().unwrap().to_string();
    assert_eq!(p["url"], format!("http://8000-{id}.preview.test/?token={pv}"));
    let host = format!("8000-{id}.preview.test");

    // The first visit trades the token for a cookie and drops it from the address.
    let (status, head, _) =
        with_headers(node.addr, &format!("/app/page?x=1&token={pv}"), &host, "");
    assert_eq!(status, 303, "{head}");
    assert_eq!(header(&head, "location"), Some("/app/page?x=1"));
    let cookie = header(&head, "set-cookie").unwrap().to_string();
    assert!(cookie.starts_with(&format!("silkmesh_preview={pv}; Path=/;")), "{cookie}");
    assert!(cookie.contains("HttpOnly"), "{cookie}");
    // With the cookie, any path of the host is the sandbox's server's, the API's too; neither
    // the preview token nor its cookie reaches the server, the page's own cookies do.
    let carry = format!("Cookie: theme=dark; silkmesh_preview={pv}\r\n");
    for path in ["/app/page?x=1", "/v1/info"] {
        let (status, _, seen) = with_headers(node.addr, path, &host, &carry);
        assert_eq!(status, 200, "{seen}");
        assert!(seen.starts_with(&format!("{path}\n")), "{seen}");
        assert!(!seen.contains(&pv) && !seen.contains("silkmesh_preview"), "{seen}");
        assert!(seen.contains("cookie: theme=dark\n"), "{seen}");
    }
    // The first visit's redirect stays on the host, whatever path it came with.
    let (status, head, _) =
        with_headers(node.addr, &format!("//evil.test/x?token={pv}"), &host, "");
    assert_eq!((status, header(&head, "location")), (303, Some("/evil.test/x")));
    // The host in any case; a cookie of the name a page set does not lock the visitor out;
    // the path reaches the server as sent (`%2F` is not a separator, `%3F` not a query).
    let shadowed = format!("Cookie: silkmesh_preview=pv_1_2_3; silkmesh_preview={pv}\r\n");
    let loud = host.to_ascii_uppercase();
    let (status, _, seen) = with_headers(node.addr, "/a%2Fb%3Fc", &loud, &shadowed);
    assert_eq!((status, seen.lines().next()), (200, Some("/a%2Fb%3Fc")), "{seen}");

    // The path form works with the same token (its cookie is scoped to the port's path).
    let path = format!("/v1/sandboxes/{id}/ports/8000/here?token={pv}");
    let (status, head, _) = with_headers(node.addr, &path, "node.test", "");
    assert_eq!(status, 303);
    assert_eq!(
        header(&head, "location"),
        Some(format!("/v1/sandboxes/{id}/ports/8000/here").as_str())
    );
    assert!(
        header(&head, "set-cookie")
            .unwrap()
            .contains(&format!("Path=/v1/sandboxes/{id}/ports/8000/;"))
    );
    let (status, _, seen) = with_headers(
        node.addr,
        &format!("/v1/sandboxes/{id}/ports/8000/here"),
        "node.test",
        &carry,
    );
    assert_eq!((status, seen.lines().next()), (200, Some("/here")));

    // Refused, as the same 404 as an unknown sandbox: another port's token, a forged one,
    // another sandbox's, a revoked one, an expired one. No credential at all is a 401.
    let other = node.claim("{}");
    let (o_id, o_token) = (other["id"].as_str().unwrap(), other["token"].as_str().unwrap());
    let theirs =
        preview(&node, o_id, o_token, r#"{"port": 8000}"#)["token"].as_str().unwrap().to_string();
    let port_9 =
        preview(&node, &id, &token, r#"{"port": 9000}"#)["token"].as_str().unwrap().to_string();
    // The mac's last digit changed: a token nobody signed.
    let flipped = if pv.ends_with('0') { '1' } else { '0' };
    let forged = format!("{}{flipped}", &pv[..pv.len() - 1]);
    let short = preview(&node, &id, &token, r#"{"port": 8000, "ttl_seconds": 1}"#)["token"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(with_headers(node.addr, "/", &host, "").0, 401);
    for bad in [
        &format!("Cookie: silkmesh_preview={theirs}\r\n"),
        &format!("Cookie: silkmesh_preview={port_9}\r\n"),
        &format!("Cookie: silkmesh_preview={forged}\r\n"),
    ] {
        assert_eq!(with_headers(node.addr, "/", &host, bad).0, 404, "{bad}");
    }
    assert_eq!(with_headers(node.addr, &format!("/?token={theirs}"), &host, "").0, 404);
    std::thread::sleep(std::time::Duration::from_millis(1100));
    assert_eq!(
        with_headers(node.addr, "/", &host, &format!("Cookie: silkmesh_preview={short}\r\n")).0,
        404,
        "expired"
    );
    for (status, v) in [
        (400, r#"{"port": 0}"#),
        (400, r#"{"port": 80, "ttl_seconds": 86401}"#),
        (400, r#"{"port": 70000}"#),
    ] {
        assert_eq!(
            node.req("POST", &format!("/v1/sandboxes/{id}/previews"), Some(&token), Some(v)).0,
            status,
            "{v}"
        );
    }
    assert_eq!(
        node.req(
            "POST",
            &format!("/v1/sandboxes/{id}/previews"),
            Some(o_token),
            Some(r#"{"port": 8000}"#)
        )
        .0,
        404,
        "another sandbox's token"
    );

    // A restarted node still honours it (the claim journals it); then revoked, it is gone.
    node.restart();
    assert_eq!(with_headers(node.addr, "/", &host, &carry).0, 200, "after a restart");
    let revoke = format!("/v1/sandboxes/{id}/previews/{pv}");
    assert_eq!(node.req("DELETE", &revoke, Some(&token), None).0, 204);
    assert_eq!(node.req("DELETE", &revoke, Some(&token), None).0, 404);
    assert_eq!(with_headers(node.addr, "/", &host, &carry).0, 404, "revoked");

    // A released sandbox's previews all go with it.
    let live =
        preview(&node, &id, &token, r#"{"port": 8000}"#)["token"].as_str().unwrap().to_string();
    let live_cookie = format!("Cookie: silkmesh_preview={live}\r\n");
    assert_eq!(with_headers(node.addr, "/", &host, &live_cookie).0, 200);
    assert_eq!(node.req("DELETE", &format!("/v1/sandboxes/{id}"), Some(&token), None).0, 204);
    assert_eq!(with_headers(node.addr, "/", &host, &live_cookie).0, 404, "released");
}
