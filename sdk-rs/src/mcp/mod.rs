//! An MCP server over this SDK: every sandbox verb as a Model Context Protocol tool, for agent
//! frameworks and coding assistants. Two ways to run it: `sbx mcp` (stdio, with a [`Session`]
//! that keeps the sandboxes it created alive and releases them when it ends) and a node's `/mcp`
//! (streamable HTTP, stateless: one SDK client per caller's key, and sandbox handles per caller
//! kept only to reuse connections).
//!
//! Tools take a sandbox `id` and act with the caller's key (root or a tenant's): a sandbox of
//! another principal is "not found", as on the HTTP API. Every failure — a bad argument, a node
//! error, a command that cannot start — is a tool error (`isError`) whose text says what went
//! wrong, never a crash of the server.

mod args;
mod callers;
mod output;
mod session;

use std::time::Duration;

use rmcp::handler::server::wrapper::Parameters;
use rmcp::model::{CallToolResult, Implementation, ServerCapabilities, ServerConfig};
use rmcp::service::RequestContext;
use rmcp::{ErrorData, RoleServer, ServerHandler, tool, tool_handler, tool_router};
use serde_json::{Value, json};

pub use args::*;
use callers::Clients;
pub use callers::Tools;
pub use rmcp;
pub use session::Session;

use output::{
    base64_decode, base64_encode, capped, collect_capped, done, failed, result, to_json,
    with_progress,
};

use crate::{Error, Memory};

/// Output kept per stream of an exec; the rest is dropped and flagged.
pub const OUTPUT_CAP: usize = 64 << 10;
/// How long an exec may run when the call names no timeout.
pub const EXEC_TIMEOUT: u64 = 600;
/// The most a `sandbox_read_file` returns.
pub const READ_CAP: u64 = 1 << 20;

#[tool_router]
impl Tools {
    #[tool(description = "Create a sandbox from a template (a warm one in well under a \
        millisecond when the node has one ready). Returns its id, state and lease.")]
    async fn sandbox_create(
        &self,
        Parameters(a): Parameters<CreateArgs>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        result(
            async {
                let client = self.client(&ctx)?;
                let mut b = client.claim(a.template.as_deref().unwrap_or("host"));
                if let Some(size) = a.size {
                    b = b.size(size.into());
                }
                if let Some(ttl) = a.ttl_seconds {
                    b = b.ttl(Duration::from_secs(ttl));
                }
                for (k, v) in a.metadata.unwrap_or_default() {
                    b = b.metadata(k, v);
                }
                let sb = with_progress(&ctx, "create", b.auto_release(false).send())
                    .await
                    .map_err(failed)?;
                self.remember(&[&sb], a.keep.unwrap_or(false));
                Ok(done(to_json(sb.info())))
            }
            .await,
        )
    }

    #[tool(description = "List the sandboxes this key may see, optionally only those whose \
        metadata has every given key=value.")]
    async fn sandbox_list(
        &self,
        Parameters(a): Parameters<ListArgs>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        result(
            async {
                let client = self.client(&ctx)?;
                let metadata = a.metadata.unwrap_or_default();
                let pairs: Vec<(&str, &str)> =
                    metadata.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
                let all = client.list_by(&pairs).await.map_err(failed)?;
                Ok(done(json!({ "sandboxes": all })))
            }
            .await,
        )
    }

    #[tool(description = "A sandbox's state, template, size, lease and metadata.")]
    async fn sandbox_info(
        &self,
        Parameters(a): Parameters<IdArgs>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        result(
            async {
                let sb = self.sandbox(&ctx, &a.id).await?;
                let info = sb.refresh().await;
                if info.is_err() {
                    self.forget(&a.id);
                }
                Ok(done(to_json(info.map_err(failed)?)))
            }
            .await,
        )
    }

    #[tool(description = "Run a command in a sandbox and wait for it: `command` runs in \
        `sh -c`, or give `argv`. Returns the exit code and stdout/stderr, each cut at 64 KiB \
        (flagged as truncated). A hibernated sandbox is woken first.")]
    async fn sandbox_exec(
        &self,
        Parameters(a): Parameters<ExecArgs>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        result(
            async {
                let argv = match (a.command, a.argv) {
                    (Some(c), None) => vec!["sh".to_string(), "-c".into(), c],
                    (None, Some(argv)) if !argv.is_empty() => argv,
                    _ => return Err(failed("give either `command` or a non-empty `argv`")),
                };
                let sb = self.sandbox(&ctx, &a.id).await?;
                let mut run = sb.exec(argv);
                if let Some(cwd) = a.cwd {
                    run = run.cwd(cwd);
                }
                for (k, v) in a.env.unwrap_or_default() {
                    run = run.env(k, v);
                }
                if let Some(stdin) = a.stdin {
                    run = run.stdin(stdin);
                }
                run = run.timeout(Duration::from_secs(a.timeout_seconds.unwrap_or(EXEC_TIMEOUT)));
                let (status, out, err) =
                    with_progress(&ctx, "exec", collect_capped(run)).await.map_err(failed)?;
                let (stdout, stdout_truncated) = capped(&out, OUTPUT_CAP);
                let (stderr, stderr_truncated) = capped(&err, OUTPUT_CAP);
                Ok(done(json!({
                    "exit_code": status.code,
                    "signal": status.signal,
                    "timed_out": status.timed_out,
                    "stdout": stdout,
                    "stderr": stderr,
                    "stdout_truncated": stdout_truncated,
                    "stderr_truncated": stderr_truncated,
                })))
            }
            .await,
        )
    }

    #[tool(description = "Write a file in a sandbox (created or replaced, parent directories \
        made). `content` is text, or base64 with `encoding: base64`.")]
    async fn sandbox_write_file(
        &self,
        Parameters(a): Parameters<WriteArgs>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        result(
            async {
                let bytes = match a.encoding.unwrap_or_default() {
                    Encoding::Utf8 => a.content.into_bytes(),
                    Encoding::Base64 => base64_decode(&a.content)
                        .ok_or_else(|| failed("content: not valid base64"))?,
                };
                let sb = self.sandbox(&ctx, &a.id).await?;
                let n = bytes.len();
                let parent = a.path.rsplit_once('/').map(|(p, _)| p).filter(|p| !p.is_empty());
                if let Some(parent) = parent {
                    sb.mkdir(parent, true).await.map_err(failed)?;
                }
                sb.write(&a.path, bytes).await.map_err(failed)?;
                Ok(done(json!({ "path": a.path, "bytes": n })))
            }
            .await,
        )
    }

    #[tool(description = "Read a file of a sandbox: text when it is UTF-8, else base64 \
        (`encoding` says which). At most `max_bytes` (default and limit 1 MiB; `truncated` \
        says when there is more).")]
    async fn sandbox_read_file(
        &self,
        Parameters(a): Parameters<ReadArgs>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        result(
            async {
                let cap = a.max_bytes.unwrap_or(READ_CAP).min(READ_CAP);
                let sb = self.sandbox(&ctx, &a.id).await?;
                let bytes = sb.read_range(&a.path, 0, Some(cap + 1)).await.map_err(failed)?;
                let truncated = bytes.len() as u64 > cap;
                let bytes = &bytes[..bytes.len().min(cap as usize)];
                // Text cut inside a character at the cap is still text, up to that character.
                let (content, encoding, bytes) = match std::str::from_utf8(bytes) {
                    Ok(text) => (text.to_string(), "utf8", bytes),
                    Err(e) if truncated && e.error_len().is_none() => {
                        let text = &bytes[..e.valid_up_to()];
                        (String::from_utf8_lossy(text).into_owned(), "utf8", text)
                    }
                    Err(_) => (base64_encode(bytes), "base64", bytes),
                };
                Ok(done(json!({
                    "path": a.path, "content": content, "encoding": encoding,
                    "bytes": bytes.len(), "truncated": truncated,
                })))
            }
            .await,
        )
    }

    #[tool(description = "List a directory of a sandbox: names, kinds, sizes.")]
    async fn sandbox_list_files(
        &self,
        Parameters(a): Parameters<PathArgs>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        result(
            async {
                let sb = self.sandbox(&ctx, &a.id).await?;
                let entries = sb.list(&a.path).await.map_err(failed)?;
                Ok(done(json!({ "path": a.path, "entries": entries })))
            }
            .await,
        )
    }

    #[tool(description = "Search file contents in a sandbox with a regular expression (Rust \
        regex syntax), line by line, under `path`; `glob` narrows the files.")]
    async fn sandbox_find(
        &self,
        Parameters(a): Parameters<FindArgs>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        result(
            async {
                let sb = self.sandbox(&ctx, &a.id).await?;
                let limit = a.max_matches.unwrap_or(200).min(10_000);
                let request = crate::FindRequest {
                    path: a.path,
                    pattern: a.pattern,
                    glob: a.glob,
                    max_file_bytes: None,
                    max_matches: Some(limit),
                };
                let mut found = sb.find(request).await.map_err(failed)?;
                let mut matches = vec![];
                while let Some(m) = found.next().await {
                    matches.push(m.map_err(failed)?);
                }
                let limited = matches.len() as u64 >= limit;
                Ok(done(json!({ "matches": matches, "limited": limited })))
            }
            .await,
        )
    }

    #[tool(description = "Replace every match of a regular expression in the given files of a \
        sandbox (`$1`, `${name}` expand capture groups). Returns the count per file.")]
    async fn sandbox_replace(
        &self,
        Parameters(a): Parameters<ReplaceArgs>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        result(
            async {
                let sb = self.sandbox(&ctx, &a.id).await?;
                let request = crate::ReplaceRequest {
                    paths: a.paths,
                    pattern: a.pattern,
                    replacement: a.replacement,
                };
                let replaced = sb.replace(request).await.map_err(failed)?;
                let files: Vec<Value> = replaced
                    .into_iter()
                    .map(|r| json!({ "path": r.path, "count": r.count }))
                    .collect();
                Ok(done(json!({ "files": files })))
            }
            .await,
        )
    }

    #[tool(description = "Git in a sandbox's repository: status, add, commit, branches, \
        branch_create, checkout.")]
    async fn sandbox_git(
        &self,
        Parameters(a): Parameters<GitArgs>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        result(
            async {
                let op = a.op().map_err(failed)?;
                let sb = self.sandbox(&ctx, &a.id).await?;
                let reply = sb.git_op(&a.repo, op).await.map_err(failed)?;
                Ok(done(json!({ "reply": reply })))
            }
            .await,
        )
    }

    #[tool(description = "Hibernate a sandbox: it stops using CPU and memory; its files (and, \
        where the node keeps memory, its processes) are kept. Any later call wakes it.")]
    async fn sandbox_hibernate(
        &self,
        Parameters(a): Parameters<MemoryArgs>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        result(
            async {
                let sb = self.sandbox(&ctx, &a.id).await?;
                let memory = a.memory.map_or(Memory::Auto, Into::into);
                let info = with_progress(&ctx, "hibernate", sb.hibernate_with(memory))
                    .await
                    .map_err(failed)?;
                Ok(done(to_json(info)))
            }
            .await,
        )
    }

    #[tool(description = "Wake a hibernated or archived sandbox now.")]
    async fn sandbox_wake(
        &self,
        Parameters(a): Parameters<IdArgs>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        result(
            async {
                let sb = self.sandbox(&ctx, &a.id).await?;
                let info = with_progress(&ctx, "wake", sb.wake()).await.map_err(failed)?;
                Ok(done(to_json(info)))
            }
            .await,
        )
    }

    #[tool(description = "Checkpoint a sandbox into the store (files, and processes where the \
        node keeps memory); it keeps running. Branch new sandboxes from it later.")]
    async fn sandbox_checkpoint(
        &self,
        Parameters(a): Parameters<CheckpointArgs>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        result(
            async {
                let sb = self.sandbox(&ctx, &a.id).await?;
                let ck = with_progress(&ctx, "checkpoint", sb.checkpoint(a.name.as_deref()))
                    .await
                    .map_err(failed)?;
                Ok(done(to_json(ck)))
            }
            .await,
        )
    }

    #[tool(description = "A new sandbox from a checkpoint (`ck_…`), continuing from the \
        checkpoint's moment.")]
    async fn sandbox_branch(
        &self,
        Parameters(a): Parameters<BranchArgs>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        result(
            async {
                let client = self.client(&ctx)?;
                let sb = with_progress(&ctx, "branch", client.branch(&a.checkpoint, None))
                    .await
                    .map_err(failed)?;
                self.remember(&[&sb], a.keep.unwrap_or(false));
                Ok(done(to_json(sb.info())))
            }
            .await,
        )
    }

    #[tool(description = "Fork a sandbox into `count` (1-16) independent copies of its current \
        files (and processes where the node keeps memory).")]
    async fn sandbox_fork(
        &self,
        Parameters(a): Parameters<ForkArgs>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        result(
            async {
                if !(1..=16).contains(&a.count) {
                    return Err(failed(format!("count: {} is not 1 to 16", a.count)));
                }
                let sb = self.sandbox(&ctx, &a.id).await?;
                let children =
                    with_progress(&ctx, "fork", sb.fork(a.count)).await.map_err(failed)?;
                self.remember(&children.iter().collect::<Vec<_>>(), a.keep.unwrap_or(false));
                let infos: Vec<Value> = children.iter().map(|c| to_json(c.info())).collect();
                Ok(done(json!({ "sandboxes": infos })))
            }
            .await,
        )
    }

    #[tool(description = "Move a sandbox to another node of the mesh (`to`, or the least \
        loaded); it keeps its id.")]
    async fn sandbox_move(
        &self,
        Parameters(a): Parameters<MoveArgs>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        result(
            async {
                let sb = self.sandbox(&ctx, &a.id).await?;
                let info = with_progress(&ctx, "move", sb.move_to(a.to.as_deref()))
                    .await
                    .map_err(failed)?;
                Ok(done(to_json(info)))
            }
            .await,
        )
    }

    #[tool(description = "Release (destroy) a sandbox.")]
    async fn sandbox_release(
        &self,
        Parameters(a): Parameters<IdArgs>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        result(
            async {
                let sb = self.sandbox(&ctx, &a.id).await?;
                let released = sb.release().await;
                self.forget(&a.id);
                released.map_err(failed)?;
                if let Some(s) = &self.session {
                    s.released(&a.id);
                }
                Ok(done(json!({ "id": a.id, "released": true })))
            }
            .await,
        )
    }

    #[tool(description = "A URL that opens a port of a sandbox in a browser without any other \
        credential (signed, expiring: `ttl_seconds`, default 3600, at most 86400).")]
    async fn sandbox_preview_url(
        &self,
        Parameters(a): Parameters<PreviewArgs>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        result(
            async {
                let sb = self.sandbox(&ctx, &a.id).await?;
                let ttl = a.ttl_seconds.map(Duration::from_secs);
                let mut p = sb.preview(a.port, ttl).await.map_err(failed)?;
                // Through a node's /mcp the SDK reached the node at its own address: the URL
                // gets the host the caller used instead.
                let original = ctx
                    .extensions
                    .get::<::http::request::Parts>()
                    .and_then(|parts| parts.headers.get("host"))
                    .and_then(|h| h.to_str().ok());
                if let (Clients::PerCaller(_), Some(host)) = (&self.clients, original) {
                    let own = sb.client().url().trim_end_matches('/').to_string();
                    if let Some(rest) = p.url.strip_prefix(&own) {
                        let scheme = own.split("://").next().unwrap_or("http");
                        p.url = format!("{scheme}://{host}{rest}");
                    }
                }
                Ok(done(to_json(p)))
            }
            .await,
        )
    }
}

#[tool_handler]
impl ServerHandler for Tools {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
            .with_server_info(Implementation::new("silkmesh", env!("CARGO_PKG_VERSION")))
            .with_instructions(
                "silkmesh sandboxes: isolated Linux machines to run code in. Create one \
                 (sandbox_create), run commands and edit files in it by id, checkpoint, branch, \
                 fork or hibernate it, and release it when done.",
            )
    }
}

/// Serves `tools` on stdin/stdout until the client closes its side.
pub async fn serve_stdio(tools: Tools) -> Result<(), Error> {
    use rmcp::ServiceExt;
    let io = |e: &dyn std::fmt::Display| Error::Invalid(format!("mcp: {e}"));
    let running = tools.serve(rmcp::transport::stdio()).await.map_err(|e| io(&e))?;
    running.waiting().await.map_err(|e| io(&e))?;
    Ok(())
}
