"""The egress test's 'internet', run in its upstream namespace (stdlib only): HTTP servers on the
addresses given (`/` names the address, `/big` is 2 MiB, `/1m` 1 MiB), a TCP server on ADDR:7000 that greets
and holds every connection open until its client closes it, and a UDP sink on ADDR:9999 that appends what reaches it to
LOG. Usage: upstream.py ADDR LOG HTTP_ADDR..."""
import http.server, socket, socketserver, sys, threading

BIG = b"x" * (2 << 20)
PAGES = {"/big": BIG, "/1m": BIG[: 1 << 20]}

class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = PAGES.get(self.path) or f"hello from {self.server.server_address[0]}\n".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass

def hold(addr):
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((addr, 7000))
    s.listen(64)
    while True:
        c, _ = s.accept()
        c.sendall(b"hi\n")
        threading.Thread(target=lambda c=c: (c.recv(1), c.close()), daemon=True).start()

def sink(addr, log):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind((addr, 9999))
    while True:
        data, peer = s.recvfrom(2048)
        with open(log, "a") as f:
            f.write(f"{peer[0]} {data!r}\n")

special, log, servers = sys.argv[1], sys.argv[2], sys.argv[3:]
threading.Thread(target=hold, args=(special,), daemon=True).start()
threading.Thread(target=sink, args=(special, log), daemon=True).start()
for addr in servers:
    srv = http.server.ThreadingHTTPServer((addr, 80), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
print("ready", flush=True)
threading.Event().wait()
