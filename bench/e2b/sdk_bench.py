"""Times the stock e2b SDK (sync) against a node's E2B listener, for `silkbench e2b`: prints
one JSON object of samples in milliseconds. Env: E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY,
BENCH_ITERS, BENCH_MIB."""

import json
import os
import time
import urllib.request

from e2b import Sandbox

iters = int(os.environ.get("BENCH_ITERS", "20"))
mib = int(os.environ.get("BENCH_MIB", "50"))
url = os.environ["E2B_API_URL"]


def ms(t0):
    return (time.perf_counter() - t0) * 1000.0


out = {"floor": [], "create_first_run": [], "run": [], "write": [], "read": []}
# The floor: a bare HTTP request from this process (a kept connection, as the SDK keeps one).
opener = urllib.request.build_opener()
for _ in range(iters * 5):
    t0 = time.perf_counter()
    opener.open(url + "/health").read()
    out["floor"].append(ms(t0))

for _ in range(iters):
    t0 = time.perf_counter()
    s = Sandbox.create(timeout=120)
    s.commands.run("true")
    out["create_first_run"].append(ms(t0))
    for _ in range(5):
        t0 = time.perf_counter()
        s.commands.run("true")
        out["run"].append(ms(t0))
    s.kill()

s = Sandbox.create(timeout=300)
blob = os.urandom(mib << 20)
for _ in range(3):
    t0 = time.perf_counter()
    s.files.write("/root/blob", blob)
    out["write"].append(ms(t0))
    t0 = time.perf_counter()
    got = s.files.read("/root/blob", format="bytes")
    out["read"].append(ms(t0))
    assert len(got) == len(blob)
s.kill()
print(json.dumps(out))
