//! The tools' arguments: their JSON schemas are what MCP clients show and check. Unknown fields
//! are refused, so a misspelt argument is an error naming it rather than a silent default.

use std::collections::BTreeMap;

use rmcp::schemars::{self, JsonSchema};
use serde::Deserialize;

use crate::{GitOp, Memory, Size};

#[derive(Debug, Clone, Copy, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum SizeArg {
    /// 1 cpu, 512 MiB.
    Small,
    /// 2 cpus, 1 GiB.
    Medium,
    /// 4 cpus, 4 GiB.
    Large,
}

impl From<SizeArg> for Size {
    fn from(s: SizeArg) -> Size {
        match s {
            SizeArg::Small => Size::Small,
            SizeArg::Medium => Size::Medium,
            SizeArg::Large => Size::Large,
        }
    }
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateArgs {
    /// The template (default `host`).
    pub template: Option<String>,
    pub size: Option<SizeArg>,
    /// The lease in seconds (the node's default when absent; renewable).
    pub ttl_seconds: Option<u64>,
    /// Labels to find it by later.
    pub metadata: Option<BTreeMap<String, String>>,
    /// Keep it when this MCP server ends (stdio): by default the server releases the sandboxes
    /// it created when it exits.
    pub keep: Option<bool>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ListArgs {
    /// Only sandboxes whose metadata has every one of these pairs.
    pub metadata: Option<BTreeMap<String, String>>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct IdArgs {
    /// The sandbox's id (`sb-…`).
    pub id: String,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ExecArgs {
    pub id: String,
    /// A shell command line, run with `sh -c`.
    pub command: Option<String>,
    /// The program and its arguments, run as they are (instead of `command`).
    pub argv: Option<Vec<String>>,
    /// The working directory (default: the user's home).
    pub cwd: Option<String>,
    pub env: Option<BTreeMap<String, String>>,
    /// Kill it after this many seconds.
    pub timeout_seconds: Option<u64>,
    /// Text for its standard input.
    pub stdin: Option<String>,
}

#[derive(Debug, Clone, Copy, Default, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Encoding {
    #[default]
    Utf8,
    Base64,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct WriteArgs {
    pub id: String,
    /// An absolute path, or one relative to the user's home.
    pub path: String,
    pub content: String,
    /// How `content` is given (default utf8).
    pub encoding: Option<Encoding>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ReadArgs {
    pub id: String,
    pub path: String,
    /// At most this many bytes (default and limit 1 MiB).
    pub max_bytes: Option<u64>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PathArgs {
    pub id: String,
    pub path: String,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct FindArgs {
    pub id: String,
    /// A directory (searched recursively) or a file.
    pub path: String,
    /// A regular expression (Rust regex syntax), matched line by line.
    pub pattern: String,
    /// Only files whose name matches this glob (`*.py`; with a `/`, the path under `path`).
    pub glob: Option<String>,
    /// Stop after this many matches (default 200, limit 10000).
    pub max_matches: Option<u64>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ReplaceArgs {
    pub id: String,
    /// The files to rewrite, in order; the first failure stops the call.
    pub paths: Vec<String>,
    pub pattern: String,
    /// `$1`, `${name}` expand to capture groups; `$$` is a `$`.
    pub replacement: String,
}

#[derive(Debug, Clone, Copy, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum GitAction {
    Status,
    Add,
    Commit,
    Branches,
    BranchCreate,
    Checkout,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct GitArgs {
    pub id: String,
    /// The repository's working tree.
    pub repo: String,
    pub action: GitAction,
    /// `add`: the paths to stage (all when absent).
    pub paths: Option<Vec<String>>,
    /// `commit`: the message.
    pub message: Option<String>,
    /// `branch_create`, `checkout`: the branch.
    pub branch: Option<String>,
}

impl GitArgs {
    pub(super) fn op(&self) -> Result<GitOp, String> {
        let need = |v: &Option<String>, name: &str| {
            v.clone().ok_or_else(|| format!("{name}: required for {:?}", self.action))
        };
        Ok(match self.action {
            GitAction::Status => GitOp::Status { limit: None },
            GitAction::Add => GitOp::Add { paths: self.paths.clone().unwrap_or_default() },
            GitAction::Commit => {
                GitOp::Commit { message: need(&self.message, "message")?, author: None }
            }
            GitAction::Branches => GitOp::BranchList,
            GitAction::BranchCreate => {
                GitOp::BranchCreate { name: need(&self.branch, "branch")?, start: None }
            }
            GitAction::Checkout => GitOp::Checkout { branch: need(&self.branch, "branch")? },
        })
    }
}

#[derive(Debug, Clone, Copy, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum MemoryArg {
    /// Keep the processes where the node can, else the files only.
    Auto,
    /// Keep the processes, or fail.
    Required,
    /// Files only: processes restart on wake.
    Off,
}

impl From<MemoryArg> for Memory {
    fn from(m: MemoryArg) -> Memory {
        match m {
            MemoryArg::Auto => Memory::Auto,
            MemoryArg::Required => Memory::Required,
            MemoryArg::Off => Memory::Off,
        }
    }
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct MemoryArgs {
    pub id: String,
    pub memory: Option<MemoryArg>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CheckpointArgs {
    pub id: String,
    /// A name to find it by.
    pub name: Option<String>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct BranchArgs {
    /// The checkpoint's id (`ck_…`).
    pub checkpoint: String,
    /// Keep the new sandbox when this MCP server ends (stdio).
    pub keep: Option<bool>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ForkArgs {
    pub id: String,
    /// How many copies, 1 to 16.
    pub count: usize,
    /// Keep the copies when this MCP server ends (stdio).
    pub keep: Option<bool>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct MoveArgs {
    pub id: String,
    /// The node's name (default: the least loaded peer).
    pub to: Option<String>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PreviewArgs {
    pub id: String,
    pub port: u16,
    pub ttl_seconds: Option<u64>,
}
