"""The stock e2b SDK (sync client, pinned in scripts/e2b/requirements.txt) against a node's E2B
listener: E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY come from the Rust test that runs this.
Every check prints "ok <what>"; the first that fails raises, and the test reports it."""

import hashlib
import io
import os

from e2b import (
    CommandExitException,
    PtySize,
    FileNotFoundException,
    InvalidArgumentException,
    Sandbox,
    SandboxException,
    TimeoutException,
)
from e2b.sandbox.sandbox_api import SandboxQuery


def check(cond, what):
    if not cond:
        raise AssertionError(what)
    print("ok", what, flush=True)


s = Sandbox.create(timeout=300, metadata={"suite": "e2b", "k": "v w"}, envs={"FROM_CREATE": "yes"})
check(s.sandbox_id.startswith("sb-"), "create")

r = s.commands.run("whoami; pwd")
check(r.stdout == "user\n/home/user\n", "run: as E2B's default user, in its home")
check(s.commands.run("whoami", user="root").stdout == "root\n", "run: as the user named")
try:
    s.commands.run("true", user="nosuch")
    check(False, "an unknown user raises")
except InvalidArgumentException:
    check(True, "run: an unknown user is InvalidArgumentException")

r = s.commands.run("echo hi; echo err >&2")
check((r.stdout, r.stderr, r.exit_code) == ("hi\n", "err\n", 0), "run: stdout, stderr, exit code")
try:
    s.commands.run("echo partial; exit 3")
    check(False, "a failing command raises")
except CommandExitException as e:
    check((e.exit_code, e.stdout) == (3, "partial\n"), "a failing command raises CommandExitException")
r = s.commands.run('echo "$FROM_CREATE $X"; pwd', envs={"X": "y"}, cwd="/tmp")
check(r.stdout == "yes y\n/tmp\n", "run: create's envVars, the call's envs, cwd")
seen = []
s.commands.run("for i in 1 2 3; do echo $i; done", on_stdout=seen.append)
check("".join(seen) == "1\n2\n3\n", "run: on_stdout streams the output")
try:
    s.commands.run("sleep 30", timeout=1)
    check(False, "a command past its timeout raises")
except TimeoutException:
    check(True, "a command past its timeout raises TimeoutException")

h = s.commands.run("echo started; sleep 30", background=True)
check(h.pid > 0, "a background command starts")
check(h.pid in [p.pid for p in s.commands.list()], "commands.list shows it")
h.disconnect()
check(h.pid in [p.pid for p in s.commands.list()], "it runs on after its stream is closed")
attached = s.commands.connect(h.pid)
check(s.commands.kill(h.pid) is True, "commands.kill")
try:
    attached.wait()
    check(False, "a killed command's wait raises")
except CommandExitException as e:
    check(e.exit_code == -1, "connect: the attached stream sees it killed")
check(s.commands.kill(h.pid) is False, "commands.kill of a gone command is False")
h = s.commands.run("read line; echo got $line", background=True, stdin=True)
s.commands.send_stdin(h.pid, "hello\n")
check(h.wait().stdout == "got hello\n", "send_stdin")
h = s.commands.run("head -c 6", background=True, stdin=True)
s.commands.stream_input(h.pid, ["abc", b"def"])
check(h.wait().stdout == "abcdef", "stream_input")
h = s.commands.run("cat", background=True, stdin=True)
s.commands.send_stdin(h.pid, "abc")
s.commands.close_stdin(h.pid)
check(h.wait().stdout == "abc", "close_stdin ends the input")

seen = []
term = s.pty.create(PtySize(rows=24, cols=80))
s.pty.resize(term.pid, PtySize(rows=30, cols=100))
s.pty.send_stdin(term.pid, b"stty size; echo pty-$((40+2)); exit\n")
term.wait(on_pty=seen.append)
out = b"".join(bytes(x) for x in seen)
check(b"30 100" in out and b"pty-42" in out, "pty: create, resize, input, output, exit")

s.files.write("/tmp/a.txt", "hello")
check(s.files.read("/tmp/a.txt") == "hello", "files: write and read text")
blob = os.urandom(3 << 20)
s.files.write("b.bin", blob)
check(bytes(s.files.read("/home/user/b.bin", format="bytes")) == blob, "files: 3 MiB of bytes round trip, a relative path in the user's home")
big = os.urandom(1 << 20) * 50
s.files.write("/tmp/big.bin", io.BytesIO(big))
digest = hashlib.sha256()
for chunk in s.files.read("/tmp/big.bin", format="stream"):
    digest.update(chunk)
check(digest.hexdigest() == hashlib.sha256(big).hexdigest(), "files: a 50 MiB stream each way")
check(s.commands.run("sha256sum /tmp/big.bin").stdout.split()[0] == digest.hexdigest(), "files: the sandbox has those 50 MiB")
s.commands.run("rm /tmp/big.bin")
s.files.write("gz.txt", "zipped " * 1000, gzip=True)
check(s.files.read("gz.txt") == "zipped " * 1000, "files: a gzip upload")
s.files.write("notes.txt", "mine")
r = s.commands.run("echo more >> notes.txt; stat -c %U notes.txt; cat notes.txt")
check(r.stdout == "user\nminemore\n", "files: what the user writes is the user's")
written = s.files.write_files([{"path": "/tmp/m/1.txt", "data": "one"}, {"path": "/tmp/m/2.txt", "data": b"two"}])
check([w.path for w in written] == ["/tmp/m/1.txt", "/tmp/m/2.txt"], "files: write_files (multipart)")
check(s.commands.run("cat /tmp/m/1.txt /tmp/m/2.txt").stdout == "onetwo", "files: what write_files wrote")
check(s.files.exists("/tmp/a.txt") and not s.files.exists("/tmp/none"), "files: exists")
info = s.files.get_info("/tmp/a.txt")
check((info.size, info.type.value, info.path) == (5, "file", "/tmp/a.txt"), "files: get_info")
check(s.files.make_dir("/tmp/d/e") is True, "files: make_dir")
check(s.commands.run("stat -c %U /tmp/d/e").stdout == "user\n", "files: make_dir makes the user's directory")
check(s.files.make_dir("/tmp/d/e") is False, "files: make_dir of an existing dir is False")
moved = s.files.rename("/tmp/a.txt", "/tmp/d/a.txt")
check(moved.path == "/tmp/d/a.txt", "files: rename")
names = sorted(e.path for e in s.files.list("/tmp/d", depth=2))
check(names == ["/tmp/d/a.txt", "/tmp/d/e"], "files: list with depth")
s.files.remove("/tmp/d")
check(not s.files.exists("/tmp/d/a.txt"), "files: remove")
try:
    s.files.read("/tmp/none")
    check(False, "reading a missing file raises")
except FileNotFoundException:
    check(True, "files: a missing file is FileNotFoundException")

import time

s.files.make_dir("/tmp/w")
watcher = s.files.watch_dir("/tmp/w")
s.files.write("/tmp/w/x.txt", "1")
s.commands.run("mv /tmp/w/x.txt /tmp/w/y.txt && rm /tmp/w/y.txt")
seen = []
for _ in range(100):
    seen += [(e.name, e.type.value) for e in watcher.get_new_events()]
    if ("y.txt", "remove") in seen:
        break
    time.sleep(0.05)
check(seen == [("x.txt", "create"), ("x.txt", "write"), ("x.txt", "rename"), ("y.txt", "create"), ("y.txt", "remove")], f"watch_dir: create, write, rename, remove ({seen})")
watcher.stop()
check(True, "watch_dir: stop")

got = s.get_info()
check((got.sandbox_id, got.metadata.get("k"), got.state.value) == (s.sandbox_id, "v w", "running"), "get_info")
listed = Sandbox.list(query=SandboxQuery(metadata={"k": "v w"})).next_items()
check([x.sandbox_id for x in listed] == [s.sandbox_id], "list with a metadata filter")
check(Sandbox.list(query=SandboxQuery(metadata={"k": "other"})).next_items() == [], "list: a filter that matches none")
s.set_timeout(120)
check(True, "set_timeout")

s.commands.run("echo forked-from > ~/origin")
kids = s.fork(count=2, timeout=120)
check(len(kids) == 2 and all(isinstance(k, Sandbox) for k in kids), "fork: two children")
for k in kids:
    check(k.commands.run("cat ~/origin; echo $FROM_CREATE").stdout == "forked-from\nyes\n", "fork: a child has the files and the envVars")
kids[0].commands.run("echo mine > ~/origin")
check(kids[1].commands.run("cat ~/origin").stdout == "forked-from\n", "fork: children diverge")
for k in kids:
    k.kill()
snap = s.create_snapshot(name="before-pause")
check(snap.snapshot_id.startswith("ck_") and snap.names == ["before-pause"], "create_snapshot")
listed_snaps = [x.snapshot_id for x in Sandbox.list_snapshots(sandbox_id=s.sandbox_id).next_items()]
check(snap.snapshot_id in listed_snaps, "list_snapshots")
from_snap = Sandbox.create(template=snap.snapshot_id, timeout=120)
check(from_snap.commands.run("cat ~/origin").stdout == "forked-from\n", "create from a snapshot")
from_snap.kill()
check(Sandbox.delete_snapshot(snap.snapshot_id) is True, "delete_snapshot")
check(Sandbox.delete_snapshot(snap.snapshot_id) is False, "delete_snapshot of a gone one is False")

check(s.pause() is True, "pause")
check(Sandbox.get_info(s.sandbox_id).state.value == "paused", "paused in get_info")
again = Sandbox.connect(s.sandbox_id)
check(again.files.read("b.bin", format="bytes") == blob, "connect resumes it, files kept")
check(again.commands.run("echo back").stdout == "back\n", "connect: commands run again")

p = Sandbox.create(timeout=2, lifecycle={"on_timeout": "pause"})
p.files.write("/tmp/kept", "asleep")
for _ in range(300):
    if Sandbox.get_info(p.sandbox_id).state.value == "paused":
        break
    time.sleep(0.1)
check(Sandbox.get_info(p.sandbox_id).state.value == "paused", "lifecycle on_timeout pause: paused at the timeout")
check(p.files.read("/tmp/kept") == "asleep", "a call resumes it (auto-resume), its files kept")
check(Sandbox.get_info(p.sandbox_id).state.value == "running", "running again, with a new timeout")
p.kill()

check(s.kill() is True, "kill")
check(Sandbox.kill(s.sandbox_id) is False, "kill of a gone sandbox is False")
try:
    Sandbox.get_info(s.sandbox_id)
    check(False, "get_info of a gone sandbox raises")
except SandboxException:
    check(True, "get_info of a gone sandbox raises")
try:
    Sandbox.create(template="nope")
    check(False, "an unknown template raises")
except SandboxException as e:
    check("nope" in str(e), "create: an unknown template is an error naming it")
print("done", flush=True)
