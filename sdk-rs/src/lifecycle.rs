//! Lifecycle beyond one claim: hibernate and wake, checkpoint and branch, fork, promote,
//! archive. All of them are calls on the node's API; see `docs/api.md` for what each keeps.
//! Files are kept exactly; processes and their memory too where the node can (CRIU on the jail
//! engine), as each call's [`Memory`] asks — [`SandboxInfo::memory_snapshot`] and
//! `memory_note` say what happened. A call that keeps memory closes the sandbox's open
//! connections (streams in progress end; sessions and spawned processes go on).

use hyper::Method;
use serde::Deserialize;
use serde_json::{Value, json};

use crate::client::{Claimed, Client, SandboxInfo, path_segment};
use crate::error::{Error, Result};
use crate::sandbox::Sandbox;

pub use silk_api::{Checkpoint, Memory, TemplateKind};

/// A template as `GET /v1/templates` lists it.
pub type TemplateInfo = silk_api::Template;

fn checkpoint_path(id: &str, tail: &str) -> Result<String> {
    Ok(format!("/v1/checkpoints/{}{tail}", path_segment(id)?))
}

impl Sandbox {
    async fn lifecycle(&self, verb: &str, body: Option<&Value>) -> Result<Value> {
        let path = format!("/v1/sandboxes/{}/{verb}", path_segment(self.id())?);
        self.client().call(Method::POST, &path, Some(self.token()), body).await
    }

    /// Snapshots and stops the sandbox, freeing the host (idempotent). The lease keeps running;
    /// the next call on the sandbox wakes it.
    pub async fn hibernate(&self) -> Result<SandboxInfo> {
        self.hibernate_with(Memory::Auto).await
    }

    /// [`hibernate`](Self::hibernate), keeping the processes' memory as `memory` says.
    pub async fn hibernate_with(&self, memory: Memory) -> Result<SandboxInfo> {
        self.clear_connections();
        parse(self.lifecycle("hibernate", Some(&json!({ "memory": memory }))).await?)
    }

    /// Starts a hibernated or archived sandbox now (any data-plane call would too).
    pub async fn wake(&self) -> Result<SandboxInfo> {
        parse(self.lifecycle("wake", None).await?)
    }

    /// Moves the sandbox's files into the object store and frees the host; access or
    /// [`wake`](Self::wake) restores it with a fresh lease.
    pub async fn archive(&self) -> Result<SandboxInfo> {
        self.archive_with(Memory::Auto).await
    }

    /// [`archive`](Self::archive), keeping the processes' memory as `memory` says.
    pub async fn archive_with(&self, memory: Memory) -> Result<SandboxInfo> {
        self.clear_connections();
        parse(self.lifecycle("archive", Some(&json!({ "memory": memory }))).await?)
    }

    /// Captures the sandbox's files (and its processes' memory, where the node can) into the
    /// store while it keeps running.
    pub async fn checkpoint(&self, name: Option<&str>) -> Result<Checkpoint> {
        self.checkpoint_with(name, Memory::Auto).await
    }

    /// [`checkpoint`](Self::checkpoint), keeping the processes' memory as `memory` says.
    pub async fn checkpoint_with(&self, name: Option<&str>, memory: Memory) -> Result<Checkpoint> {
        if memory != Memory::Off {
            self.clear_connections();
        }
        let body = json!({ "name": name, "memory": memory });
        parse(self.lifecycle("checkpoint", Some(&body)).await?)
    }

    /// This sandbox's checkpoints, oldest first.
    pub async fn checkpoints(&self) -> Result<Vec<Checkpoint>> {
        let path = format!("/v1/sandboxes/{}/checkpoints", path_segment(self.id())?);
        let c: silk_api::CheckpointList =
            self.client().call(Method::GET, &path, Some(self.token()), None).await?;
        Ok(c.checkpoints)
    }

    /// `count` (1–16) new sandboxes from the current files, all or none; each has its own id,
    /// token and lease.
    pub async fn fork(&self, count: usize) -> Result<Vec<Sandbox>> {
        self.fork_with(count, Memory::Auto).await
    }

    /// [`fork`](Self::fork), each child continuing the parent's processes as `memory` says.
    pub async fn fork_with(&self, count: usize, memory: Memory) -> Result<Vec<Sandbox>> {
        #[derive(Deserialize)]
        struct Forked {
            sandboxes: Vec<Claimed>,
        }
        if memory != Memory::Off {
            self.clear_connections();
        }
        let body = json!({ "count": count, "memory": memory });
        let forked: Forked = parse(self.lifecycle("fork", Some(&body)).await?)?;
        Ok(forked.sandboxes.into_iter().map(|c| c.into_sandbox(self.client(), false)).collect())
    }

    /// Moves the sandbox to another node of the mesh (`to`, or the least loaded peer). It keeps
    /// its id and token; this handle keeps working through any node. Files are exact; its
    /// processes continue there where both nodes keep memory (else they restart).
    pub async fn move_to(&self, to: Option<&str>) -> Result<SandboxInfo> {
        self.move_with(to, Memory::Auto).await
    }

    /// [`move_to`](Self::move_to), carrying the processes' memory as `memory` says.
    pub async fn move_with(&self, to: Option<&str>, memory: Memory) -> Result<SandboxInfo> {
        self.clear_connections();
        let body = json!({ "to": to, "memory": memory });
        parse(self.lifecycle("move", Some(&body)).await?)
    }

    /// Publishes the sandbox's files as template `name`: later claims of it clone from them.
    /// Promoting again under the same name replaces it.
    pub async fn promote(&self, name: &str) -> Result<TemplateInfo> {
        parse(self.lifecycle("promote", Some(&json!({ "template": name }))).await?)
    }
}

impl Client {
    /// Every checkpoint in the node's store (root token).
    pub async fn checkpoints(&self) -> Result<Vec<Checkpoint>> {
        let c: silk_api::CheckpointList =
            self.call(Method::GET, "/v1/checkpoints", self.root_token(), None).await?;
        Ok(c.checkpoints)
    }

    /// A new sandbox from a checkpoint. `token`: the token of the sandbox it was taken from,
    /// or `None` for the client's root token.
    pub async fn branch(&self, checkpoint: &str, token: Option<&str>) -> Result<Sandbox> {
        self.branch_with(checkpoint, token, Memory::Auto).await
    }

    /// [`branch`](Self::branch), continuing the checkpoint's processes as `memory` says.
    pub async fn branch_with(
        &self,
        checkpoint: &str,
        token: Option<&str>,
        memory: Memory,
    ) -> Result<Sandbox> {
        let token = token.or(self.root_token());
        let path = checkpoint_path(checkpoint, "/claim")?;
        let body = json!({ "memory": memory });
        let c: Claimed = self.call(Method::POST, &path, token, Some(&body)).await?;
        Ok(c.into_sandbox(self, false))
    }

    pub async fn delete_checkpoint(&self, checkpoint: &str, token: Option<&str>) -> Result<()> {
        let path = checkpoint_path(checkpoint, "")?;
        self.http().json(Method::DELETE, &path, token.or(self.root_token()), None).await?;
        Ok(())
    }

    /// Built-in, configured and promoted templates.
    pub async fn templates(&self) -> Result<Vec<TemplateInfo>> {
        #[derive(Deserialize)]
        struct Templates {
            templates: Vec<TemplateInfo>,
        }
        let t: Templates = self.call(Method::GET, "/v1/templates", self.root_token(), None).await?;
        Ok(t.templates)
    }

    /// Registers the registry image `image` (`python:3.12`, `ghcr.io/org/base:v4`, `…@sha256:…`)
    /// as template `name` on the whole fleet (root; a tenant's key registers `<tenant>/<name>`).
    /// The reference is pinned to its digest now; the pull goes on after the answer: watch it
    /// with [`Client::template`].
    pub async fn register_template(
        &self,
        name: &str,
        image: &str,
        warmup: &[String],
    ) -> Result<TemplateInfo> {
        let body = json!({ "name": name, "image": image, "warmup": warmup });
        self.call(Method::POST, "/v1/templates", self.root_token(), Some(&body)).await
    }

    /// One template; for a registry image, with its pull on the node that answers.
    pub async fn template(&self, name: &str) -> Result<TemplateInfo> {
        let path = format!("/v1/templates/{}", path_segment(name)?);
        self.call(Method::GET, &path, self.root_token(), None).await
    }

    /// Resolves a registry template's reference again: on a new digest it is pinned to it, and
    /// warm sandboxes of the old image are replaced.
    pub async fn refresh_template(&self, name: &str) -> Result<TemplateInfo> {
        let path = format!("/v1/templates/{}/refresh", path_segment(name)?);
        self.call(Method::POST, &path, self.root_token(), None).await
    }

    /// Deletes a promoted or registered template; sandboxes made from it keep running.
    pub async fn delete_template(&self, name: &str) -> Result<()> {
        let path = format!("/v1/templates/{}", path_segment(name)?);
        self.http().json(Method::DELETE, &path, self.root_token(), None).await?;
        Ok(())
    }
}

fn parse<T: serde::de::DeserializeOwned>(v: Value) -> Result<T> {
    serde_json::from_value(v).map_err(|e| Error::Protocol(format!("unexpected answer: {e}")))
}
