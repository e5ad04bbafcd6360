"""The stock Python MCP client (PyPI `mcp`) against silkmesh's MCP server, for sdk-rs/tests/mcp.rs.

    drive.py stdio SBX_BINARY      -- `sbx mcp` as a subprocess (SBX_ADDR, SBX_TOKEN from the env)
    drive.py http URL KEY          -- a node's /mcp with `Authorization: Bearer KEY`
    drive.py foreign URL KEY ID    -- as KEY, every tool on sandbox ID must say it is not found
    drive.py move URL KEY ID TO    -- moves sandbox ID to node TO, then runs a command in it

Prints one JSON line of what it saw; any assertion failing exits non-zero with the reason.
"""

import asyncio
import json
import os
import sys

from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client

TOOLS = {
    "sandbox_create", "sandbox_list", "sandbox_info", "sandbox_exec", "sandbox_write_file",
    "sandbox_read_file", "sandbox_list_files", "sandbox_find", "sandbox_replace", "sandbox_git",
    "sandbox_hibernate", "sandbox_wake", "sandbox_checkpoint", "sandbox_branch", "sandbox_fork",
    "sandbox_move", "sandbox_release", "sandbox_preview_url",
}


async def call(s, tool, progress=None, **args):
    r = await s.call_tool(tool, args, progress_callback=progress)
    return r.is_error, r.structured_content or {}, "".join(getattr(c, "text", "") for c in r.content)


async def ok(s, tool, **args):
    err, v, text = await call(s, tool, **args)
    assert not err, f"{tool}: {text}"
    return v


async def scenario(s):
    seen = {}
    tools = (await s.list_tools()).tools
    names = {t.name for t in tools}
    assert names == TOOLS, names ^ TOOLS
    schema = {t.name: t.input_schema for t in tools}
    assert schema["sandbox_exec"]["required"] == ["id"], schema["sandbox_exec"]
    assert set(schema["sandbox_exec"]["properties"]) >= {"id", "command", "argv", "cwd", "env", "timeout_seconds"}
    assert "count" in schema["sandbox_fork"]["required"]

    progress = []

    async def note(p, total, message):
        progress.append(message)

    r = await s.call_tool("sandbox_create", {"metadata": {"by": "mcp"}}, progress_callback=note)
    assert not r.is_error, r.content
    sb = r.structured_content["id"]
    assert "token" not in r.structured_content, "a sandbox token given to the agent"
    seen["created"] = sb
    out = await ok(s, "sandbox_exec", id=sb, command="echo hi; echo err >&2; exit 3")
    assert (out["exit_code"], out["stdout"], out["stderr"]) == (3, "hi\n", "err\n"), out
    big = await ok(s, "sandbox_exec", id=sb, argv=["head", "-c", "100000", "/dev/zero"])
    assert big["stdout_truncated"] and len(big["stdout"]) == 65536, (big["stdout_truncated"], len(big["stdout"]))
    await ok(s, "sandbox_write_file", id=sb, path="/root/w/note.txt", content="hello mcp\n")
    got = await ok(s, "sandbox_read_file", id=sb, path="/root/w/note.txt")
    assert (got["content"], got["encoding"], got["truncated"]) == ("hello mcp\n", "utf8", False), got
    await ok(s, "sandbox_write_file", id=sb, path="/root/w/bin", content="AAEC/w==", encoding="base64")
    got = await ok(s, "sandbox_read_file", id=sb, path="/root/w/bin")
    assert (got["content"], got["encoding"]) == ("AAEC/w==", "base64"), got
    names = {e["name"] for e in (await ok(s, "sandbox_list_files", id=sb, path="/root/w"))["entries"]}
    assert names == {"note.txt", "bin"}, names
    found = await ok(s, "sandbox_find", id=sb, path="/root/w", pattern="hel+o")
    assert [m["line"] for m in found["matches"]] == [1], found
    rep = await ok(s, "sandbox_replace", id=sb, paths=["/root/w/note.txt"], pattern="mcp", replacement="tools")
    assert rep["files"] == [{"path": "/root/w/note.txt", "count": 1}], rep
    await ok(s, "sandbox_exec", id=sb, command="cd /root/w && git init -q && git add note.txt && "
             "git -c user.name=t -c user.email=t@x commit -qm one")
    st = await ok(s, "sandbox_git", id=sb, repo="/root/w", action="status")
    assert st["reply"]["Status"]["files"], st

    ck = await ok(s, "sandbox_checkpoint", id=sb, name="mcp")
    br = await ok(s, "sandbox_branch", checkpoint=ck["id"])
    assert (await ok(s, "sandbox_exec", id=br["id"], command="cat /root/w/note.txt"))["stdout"] == "hello tools\n"
    forked = (await ok(s, "sandbox_fork", id=sb, count=2))["sandboxes"]
    assert len(forked) == 2
    a, b = forked[0]["id"], forked[1]["id"]
    await ok(s, "sandbox_exec", id=a, command="echo mine > /root/w/note.txt")
    assert (await ok(s, "sandbox_exec", id=b, command="cat /root/w/note.txt"))["stdout"] == "hello tools\n"
    assert (await ok(s, "sandbox_exec", id=sb, command="cat /root/w/note.txt"))["stdout"] == "hello tools\n"
    h = await ok(s, "sandbox_hibernate", id=sb)
    assert h["state"] == "hibernated", h
    w = await ok(s, "sandbox_wake", id=sb)
    assert w["state"] == "claimed", w
    assert (await ok(s, "sandbox_exec", id=sb, command="cat /root/w/note.txt"))["stdout"] == "hello tools\n"
    pv = await ok(s, "sandbox_preview_url", id=sb, port=8000, ttl_seconds=60)
    assert "token=pv_8000_" in pv["url"] and pv["port"] == 8000, pv
    listed = {x["id"] for x in (await ok(s, "sandbox_list", metadata={"by": "mcp"}))["sandboxes"]}
    assert sb in listed, listed

    err, _, text = await call(s, "sandbox_fork", id=sb, count=0)
    assert err and "count" in text, text
    err, _, text = await call(s, "sandbox_exec", id=sb)
    assert err and "command" in text, text
    err, _, text = await call(s, "sandbox_exec", id=sb, comand="true")
    assert err and "comand" in text, text
    slow = await ok(s, "sandbox_exec", id=sb, command="sleep 30", timeout_seconds=1)
    assert slow["timed_out"], slow
    err, _, text = await call(s, "sandbox_info", id="sb-00000000-000000000000")
    assert err and "not_found" in text, text

    for extra in (br["id"], a, b):
        await ok(s, "sandbox_release", id=extra)
    kept = await ok(s, "sandbox_create", keep=True)
    seen["progress"] = len(progress)
    seen["left"] = sb
    seen["kept"] = kept["id"]
    return seen


async def foreign(s, sb):
    for tool, args in [("sandbox_info", {}), ("sandbox_exec", {"command": "true"}),
                       ("sandbox_release", {}), ("sandbox_fork", {"count": 1})]:
        err, _, text = await call(s, tool, id=sb, **args)
        assert err and "not_found" in text, (tool, text)
    return {"refused": 4}


async def move(s, sb, to):
    moved = await ok(s, "sandbox_move", id=sb, to=to)
    out = await ok(s, "sandbox_exec", id=sb, command="cat /root/moved")
    return {"owner": moved["owner"], "stdout": out["stdout"]}


async def main():
    mode = sys.argv[1]
    if mode == "stdio":
        params = StdioServerParameters(command=sys.argv[2], args=["mcp"], env=dict(os.environ))
        async with stdio_client(params) as (r, w), ClientSession(r, w) as s:
            await s.initialize()
            seen = await scenario(s)
    else:
        import httpx2
        from mcp.client.streamable_http import streamable_http_client

        headers = {"Authorization": f"Bearer {sys.argv[3]}"}
        async with httpx2.AsyncClient(headers=headers, timeout=120) as http:
            async with streamable_http_client(sys.argv[2], http_client=http) as (r, w), ClientSession(r, w) as s:
                await s.initialize()
                if mode == "http":
                    seen = await scenario(s)
                elif mode == "foreign":
                    seen = await foreign(s, sys.argv[4])
                else:
                    seen = await move(s, sys.argv[4], sys.argv[5])
    print(json.dumps(seen))


asyncio.run(main())
