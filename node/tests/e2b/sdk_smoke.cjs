// The stock e2b JavaScript SDK (pinned in scripts/e2b/js, found through NODE_PATH) against a
// node's E2B listener: create, run, write, read, kill. Every check prints "ok <what>".
const { Sandbox, CommandExitError } = require("e2b");

function check(cond, what) {
  if (!cond) throw new Error(`failed: ${what}`);
  console.log("ok", what);
}

(async () => {
  const s = await Sandbox.create({ timeoutMs: 120_000, envs: { FROM_CREATE: "yes" } });
  check(s.sandboxId.startsWith("sb-"), "create");
  const r = await s.commands.run("whoami; echo $FROM_CREATE; echo err >&2");
  check(r.stdout === "user\nyes\n" && r.stderr === "err\n" && r.exitCode === 0, "commands.run");
  try {
    await s.commands.run("exit 5");
    check(false, "a failing command throws");
  } catch (e) {
    check(e instanceof CommandExitError && e.exitCode === 5, "a failing command throws CommandExitError");
  }
  await s.files.write("js.txt", "from js");
  check((await s.files.read("/home/user/js.txt")) === "from js", "files.write and files.read");
  check((await s.commands.run("cat js.txt")).stdout === "from js", "a command sees the file");
  await s.kill();
  check(!(await Sandbox.list().nextItems()).some((x) => x.sandboxId === s.sandboxId), "kill");
  console.log("done");
})().catch((e) => {
  console.error(e);
  process.exit(1);
});
