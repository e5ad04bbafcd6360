"""The stock e2b SDK against the local cluster's load balancer (HAProxy in front of three nodes,
TLS; the test sets E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY and SSL_CERT_FILE). Each call may
reach any node: one that does not hold the sandbox forwards the call to the one that does."""

from e2b import Sandbox, SandboxNotRunningException, SandboxUnreachableException


def check(cond, what):
    if not cond:
        raise AssertionError(what)
    print("ok", what, flush=True)


boxes = [Sandbox.create(timeout=300, envs={"N": str(i)}) for i in range(3)]
check(len({b.sandbox_id for b in boxes}) == 3, "three sandboxes created through the balancer")
for round in range(4):
    for i, b in enumerate(boxes):
        r = b.commands.run(f"echo $N-{round}")
        check(r.stdout == f"{i}-{round}\n", f"sandbox {i}: a command, round {round}")
        b.files.write(f"f{round}.txt", f"{i}/{round}")
        check(b.files.read(f"f{round}.txt") == f"{i}/{round}", f"sandbox {i}: write then read, round {round}")
h = boxes[0].commands.run("sleep 30", background=True)
check(h.pid in [p.pid for p in boxes[0].commands.list()], "a background command is listed from any node")
check(boxes[0].commands.kill(h.pid) is True, "and killed from any node")
blob = bytes(range(256)) * 8192
boxes[1].files.write("/tmp/blob", blob)
check(bytes(boxes[1].files.read("/tmp/blob", format="bytes")) == blob, "2 MiB through the mesh")
check(boxes[2].pause() is True, "pause through the balancer")
again = Sandbox.connect(boxes[2].sandbox_id)
check(again.files.read("f3.txt") == "2/3", "connect resumes it, files kept")
for b in boxes:
    check(Sandbox.get_info(b.sandbox_id).sandbox_id == b.sandbox_id, "get_info from any node")
    check(b.kill() is True, "kill through the balancer")
for _ in range(3):  # whichever node the balancer picks: the sandbox is gone everywhere
    try:
        boxes[0].files.read("f0.txt")
        check(False, "a killed sandbox's files cannot be read")
    except (SandboxNotRunningException, SandboxUnreachableException):
        check(True, "a killed sandbox is not running, from any node")
print("done", flush=True)
