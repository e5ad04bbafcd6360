"""Run inside a sandbox: tries each step of the JSON list in argv[1] and prints one JSON result
per step. A connection the egress guard refuses is accepted, then reset: it reads as 'refused'."""
import json, socket, sys, time, urllib.request

def step(s):
    kind = s[0]
    try:
        if kind == "resolve":
            return sorted({a[4][0] for a in socket.getaddrinfo(s[1], 80, socket.AF_INET, socket.SOCK_STREAM)})
        if kind == "get":
            t0 = time.monotonic()
            body = urllib.request.urlopen(s[1], timeout=10).read()
            return {"ok": body[:40].decode(errors="replace"), "bytes": len(body), "seconds": time.monotonic() - t0}
        if kind == "hold":
            conns, greeted = [], 0
            for _ in range(s[3]):
                try:
                    c = socket.create_connection((s[1], s[2]), timeout=5)
                except (ConnectionResetError, ConnectionRefusedError):
                    # The guard's reset of a connection past the limit can land before connect()
                    # returns: that one is simply not greeted.
                    continue
                conns.append(c)
                try:
                    greeted += c.recv(3) == b"hi\n"
                except OSError:
                    pass
            return {"greeted": greeted}
        if kind == "greet":  # n connections, each timed from connect() to its greeting
            out = []
            for _ in range(s[3]):
                t0 = time.monotonic()
                with socket.create_connection((s[1], s[2]), timeout=5) as c:
                    assert c.recv(3) == b"hi\n"
                out.append(time.monotonic() - t0)
            return out
        if kind == "fetch":  # n GETs of a URL, each timed
            out = []
            for _ in range(s[2]):
                t0 = time.monotonic()
                urllib.request.urlopen(s[1], timeout=10).read()
                out.append(time.monotonic() - t0)
            return out
        if kind == "udp":
            u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            u.sendto(b"leak", (s[1], s[2]))
            return "sent"
    except (ConnectionResetError, ConnectionRefusedError, BrokenPipeError) as e:
        return {"err": "refused"}
    except urllib.error.URLError as e:
        if isinstance(e.reason, (ConnectionResetError, ConnectionRefusedError)):
            return {"err": "refused"}
        if isinstance(e.reason, socket.gaierror):
            return {"err": "no name"}
        return {"err": repr(e.reason)}
    except socket.gaierror:
        return {"err": "no name"}
    except Exception as e:
        if "RemoteDisconnected" in type(e).__name__ or "closed connection" in str(e):
            return {"err": "refused"}
        return {"err": repr(e)}

print(json.dumps([step(s) for s in json.loads(sys.argv[1])]))
