//! What a node tells the others about itself ([`NodeState`]), and the messages that carry it
//! on a state stream ([`StateMessage`]: the whole record, the fields that changed, or a request
//! for the whole record). When each is sent is the core's business (`core`).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// What a node tells the others about itself. Never per-sandbox data, never secrets.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct NodeState {
    pub name: String,
    /// The version: the node's epoch, then a counter within it. A newer version replaces an
    /// older one; an older or equal one is ignored.
    pub epoch: u64,
    pub seq: u64,
    /// The node's API address as peers reach it (`http://127.0.0.2:7777`).
    pub api: String,
    /// The address clients reach it by, when different (behind NAT or a proxy).
    pub public: Option<String>,
    /// Warm sandboxes ready, by pool key (`template/size/lane`).
    pub warm: BTreeMap<String, u32>,
    /// Golden and template digests this node holds.
    pub goldens: Vec<String>,
    pub templates: Vec<String>,
    pub claims: u32,
    pub capacity: u32,
    pub draining: bool,
    /// Live sandboxes per tenant (for fleet-wide quotas).
    pub tenants: BTreeMap<String, u32>,
    /// Sandbox-seconds per tenant this calendar month (UTC).
    pub tenant_seconds: BTreeMap<String, u64>,
}

impl NodeState {
    pub fn version(&self) -> (u64, u64) {
        (self.epoch, self.seq)
    }

    /// Where clients should be sent.
    pub fn client_url(&self) -> &str {
        self.public.as_deref().unwrap_or(&self.api)
    }
}

/// The fields of a node's state that changed between two versions (`base` → `seq`, one
/// epoch), each whole. With none, it says only "I am at `seq`".
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct StateChange {
    pub name: String,
    pub epoch: u64,
    pub base: u64,
    pub seq: u64,
    pub api: Option<String>,
    pub public: Option<Option<String>>,
    pub warm: Option<BTreeMap<String, u32>>,
    pub goldens: Option<Vec<String>>,
    pub templates: Option<Vec<String>>,
    pub claims: Option<u32>,
    pub capacity: Option<u32>,
    pub draining: Option<bool>,
    pub tenants: Option<BTreeMap<String, u32>>,
    pub tenant_seconds: Option<BTreeMap<String, u64>>,
}

impl StateChange {
    /// What turns `old` into `new` (two versions of one node's state in one epoch).
    pub fn between(old: &NodeState, new: &NodeState) -> StateChange {
        fn changed<T: Clone + PartialEq>(old: &T, new: &T) -> Option<T> {
            (old != new).then(|| new.clone())
        }
        StateChange {
            name: new.name.clone(),
            epoch: new.epoch,
            base: old.seq,
            seq: new.seq,
            api: changed(&old.api, &new.api),
            public: changed(&old.public, &new.public),
            warm: changed(&old.warm, &new.warm),
            goldens: changed(&old.goldens, &new.goldens),
            templates: changed(&old.templates, &new.templates),
            claims: changed(&old.claims, &new.claims),
            capacity: changed(&old.capacity, &new.capacity),
            draining: changed(&old.draining, &new.draining),
            tenants: changed(&old.tenants, &new.tenants),
            tenant_seconds: changed(&old.tenant_seconds, &new.tenant_seconds),
        }
    }

    /// The state at `seq`, from `base`'s (the caller checked it is at this change's base).
    pub(crate) fn apply(self, base: &NodeState) -> NodeState {
        let mut s = base.clone();
        s.seq = self.seq;
        s.api = self.api.unwrap_or(s.api);
        s.public = self.public.unwrap_or(s.public);
        s.warm = self.warm.unwrap_or(s.warm);
        s.goldens = self.goldens.unwrap_or(s.goldens);
        s.templates = self.templates.unwrap_or(s.templates);
        s.claims = self.claims.unwrap_or(s.claims);
        s.capacity = self.capacity.unwrap_or(s.capacity);
        s.draining = self.draining.unwrap_or(s.draining);
        s.tenants = self.tenants.unwrap_or(s.tenants);
        s.tenant_seconds = self.tenant_seconds.unwrap_or(s.tenant_seconds);
        s
    }
}

/// What travels on a state stream (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum StateMessage {
    Full(NodeState),
    Change(StateChange),
    /// The sender (`name`) missed a change: send it the whole state.
    Want {
        name: String,
    },
}

impl StateMessage {
    /// Its size as a frame on a stream (a 4-byte length, then the postcard body).
    pub fn wire_len(&self) -> usize {
        4 + postcard::to_stdvec(self).map_or(0, |b| b.len())
    }

    /// The node the message speaks for: the one the connection's certificate must name.
    pub fn name(&self) -> &str {
        match self {
            StateMessage::Full(s) => &s.name,
            StateMessage::Change(c) => &c.name,
            StateMessage::Want { name } => name,
        }
    }
}
