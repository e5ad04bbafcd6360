"""A server for node/tests/ports.rs, run inside a sandbox on 127.0.0.1:8000 with the stdlib
only: a plain request is answered with what it carried (request line, headers, body); a
WebSocket upgrade is accepted and every text frame echoed."""

import base64
import hashlib
import socket
import threading

GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"


def handle(c):
    f = c.makefile("rb")
    target = f.readline().decode().split(" ")[1]
    headers = {}
    while True:
        line = f.readline().decode()
        if line in ("\r\n", "\n", ""):
            break
        k, v = line.split(":", 1)
        headers[k.strip().lower()] = v.strip()
    if headers.get("upgrade", "").lower() == "websocket":
        accept = base64.b64encode(hashlib.sha1((headers["sec-websocket-key"] + GUID).encode()).digest()).decode()
        c.sendall(f"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Accept: {accept}\r\n\r\n".encode())
        while True:
            head = f.read(2)
            if len(head) < 2:
                return
            n = head[1] & 127
            mask = f.read(4) if head[1] & 128 else b"\0\0\0\0"
            data = bytes(b ^ mask[i % 4] for i, b in enumerate(f.read(n)))
            c.sendall(bytes([0x81, len(data)]) + data)
    body = f.read(int(headers.get("content-length", "0"))).decode()
    seen = target + "\n" + "".join(f"{k}: {v}\n" for k, v in sorted(headers.items())) + "body=" + body
    out = seen.encode()
    c.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(out) + out)
    c.close()


s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", 8000))
s.listen()
while True:
    conn, _ = s.accept()
    threading.Thread(target=handle, args=(conn,), daemon=True).start()
