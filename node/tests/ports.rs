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
    for bad in [None, Some(other["token"].as_str().unwrap()), Some("sbt_forged")] {
        assert_eq!(get(node.addr, &base, bad).0, 404, "{bad:?}");
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
