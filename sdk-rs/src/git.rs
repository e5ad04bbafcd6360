//! Git in the sandbox: one call per operation, run by silkd with the sandbox's own `git`.
//! Credentials for clone/pull/push travel in memory to the git process only (see
//! `docs/protocol.md`).

use silk_proto::{Frame, GitOp, GitReply, GitRequest, GitStatus};

use crate::error::{Error, Result};
use crate::sandbox::Sandbox;

impl Sandbox {
    /// Runs one git operation; `Status`, `BranchList` and `Commit` answer with a reply.
    pub async fn git(&self, request: GitRequest) -> Result<Option<GitReply>> {
        let mut reply = None;
        self.unary(Frame::Git(request), |f| match f {
            Frame::GitReply(r) => {
                reply = Some(r);
                Ok(())
            }
            other => Err(Error::unexpected(&other, "git")),
        })
        .await?;
        Ok(reply)
    }

    /// `git` on `repo` as silkd's user, without credentials.
    pub async fn git_op(&self, repo: &str, op: GitOp) -> Result<Option<GitReply>> {
        self.git(GitRequest { repo: repo.into(), op, user: None, credentials: None }).await
    }

    /// The structured status of the repository at `repo`.
    pub async fn git_status(&self, repo: &str) -> Result<GitStatus> {
        match self.git_op(repo, GitOp::Status { limit: None }).await? {
            Some(GitReply::Status(s)) => Ok(s),
            _ => Err(Error::Protocol("git status ended without a status".into())),
        }
    }
}
