//! The membership core, without I/O: foca (SWIM) plus the view of every live node's state.
//! Packets, timers, state updates and the time go in; packets to send, timers to set, state
//! pushes and membership changes come out. The driver feeds it from QUIC and tokio; the
//! simulation in the tests feeds it from a virtual network and a virtual clock.
//!
//! **State pushes** ([`StateMessage`]). A node's state goes from the node itself to each peer
//! (never relayed: the driver takes a message naming N only on a connection whose certificate
//! names N, so relaying would let any member speak for another):
//! - whole, to a peer that comes up or asks for it (`Want`);
//! - as a [`StateChange`] (the fields that differ, a few dozen bytes) to every peer when it
//!   changes, at most once per [`push_gap`] (later changes wait for the next
//!   [`Membership::tick`]);
//! - as its version alone (an empty change) to a peer that heard nothing from us for `refresh`.
//!
//! A peer that gets a change or a version it cannot apply (it missed one: a push lost with its
//! connection, or two pushes overtaking each other) asks for the whole state, so every view
//! heals within `refresh`. At 500 nodes a change costs 499 small messages once, and a quiet
//! node one version per peer per `refresh`: not every state to every peer every second.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use foca::{AccumulatingRuntime, Foca, NoCustomBroadcast, OwnedNotification, PostcardCodec, Timer};
use rand::SeedableRng;
use rand::rngs::StdRng;
use serde::{Deserialize, Serialize};

/// A node as the membership protocol knows it. Its cluster-wide address is its QUIC endpoint: a
/// node that restarts on the same address (a higher `epoch`) replaces its old identity; one that
/// comes back on a new address is a new member, and the old one is declared down.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct NodeId {
    pub name: String,
    /// The node's QUIC endpoint.
    pub addr: SocketAddr,
    /// Counts the node's starts (persisted by the node, not taken from a clock).
    pub epoch: u64,
    /// Counts rejoins within one start (after being declared down).
    pub renewal: u32,
}

impl foca::Identity for NodeId {
    type Addr = SocketAddr;

    fn renew(&self) -> Option<Self> {
        Some(NodeId { renewal: self.renewal + 1, ..self.clone() })
    }

    fn addr(&self) -> SocketAddr {
        self.addr
    }

    fn win_addr_conflict(&self, other: &Self) -> bool {
        (self.epoch, self.renewal) > (other.epoch, other.renewal)
    }
}

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
    fn apply(self, base: &NodeState) -> NodeState {
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

/// A live member and what it last said about itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Peer {
    pub id: NodeId,
    pub state: Option<NodeState>,
}

/// Work for the driver.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Output {
    /// Send this membership packet (a QUIC datagram).
    Packet(NodeId, Bytes),
    /// Call [`Membership::handle_timer`] with this after the delay.
    Timer(Duration, Timer<NodeId>),
    /// A member joined.
    Up(NodeId),
    /// Send this on a state stream to this peer.
    State(NodeId, Box<StateMessage>),
    Down(NodeId),
    /// The failure detector says this member is down, which a lying member can make it say:
    /// probe it directly and report with [`Membership::verified`]. It stays a peer until then.
    /// `again`: it answered the last probe, yet has not come back up: probe it again in a
    /// while (a node that refutes the rumour comes back soon; one that left stops answering).
    Verify {
        id: NodeId,
        again: bool,
    },
}

type Swim = Foca<NodeId, PostcardCodec, StdRng, NoCustomBroadcast>;

/// See the module docs.
pub struct Membership {
    foca: Swim,
    runtime: AccumulatingRuntime<NodeId>,
    me: NodeState,
    peers: BTreeMap<String, Peer>,
    /// States received before their member came up (gossip can beat SWIM).
    early: BTreeMap<String, NodeState>,
    /// Peers declared down that this node is probing before it believes it.
    doubted: BTreeMap<String, NodeId>,
    /// Members that said themselves they are down (left) in a packet just handled: believed
    /// without a probe (the driver takes a packet from N only on a connection N's certificate
    /// names, so no one else can say it for N).
    left: BTreeSet<String>,
    /// Output produced outside `drain` (a verification's verdict), emitted by the next one.
    pending: Vec<Output>,
    /// The time as of the last [`Membership::tick`].
    now: Duration,
    /// A peer that heard nothing from this node for this long gets its state again.
    refresh: Duration,
    /// When each peer was last sent anything of our state, and the version it was sent.
    sent: BTreeMap<String, (Duration, u64)>,
    /// Our state as of the last push to every peer (changes are made against it), when that
    /// was, and whether a change has waited since.
    pushed: NodeState,
    pushed_at: Option<Duration>,
    unpushed: bool,
}

/// How often the driver calls [`Membership::tick`].
pub const TICK: Duration = Duration::from_millis(250);

/// The least time between two pushes of a changed state to every peer: a change costs
/// `peers × state size` bytes, so a node whose state changes all the time sends at most about
/// 500 states a second, whatever the cluster's size (20 peers: 40 ms, i.e. at once; 500 or
/// more: one push a second).
pub fn push_gap(peers: usize) -> Duration {
    (Duration::from_millis(2) * peers as u32).min(Duration::from_secs(1))
}

impl std::fmt::Debug for Membership {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Membership")
            .field("me", &self.me.name)
            .field("peers", &self.peers.len())
            .finish()
    }
}

/// Failure detection tuned for a LAN: a dead node is suspected after one probe period and
/// declared down `suspect_to_down` later.
pub fn swim_config(
    probe_period: Duration,
    probe_rtt: Duration,
    suspect_to_down: Duration,
) -> foca::Config {
    let mut c = foca::Config::simple();
    c.probe_period = probe_period;
    c.probe_rtt = probe_rtt;
    c.suspect_to_down_after = suspect_to_down;
    c.remove_down_after = Duration::from_secs(60);
    // Fits a QUIC datagram on any path (quinn's initial MTU is 1200).
    c.max_packet_size = std::num::NonZeroUsize::new(1100).expect("non-zero");
    c.notify_down_members = true;
    c.periodic_announce = Some(foca::PeriodicParams {
        frequency: Duration::from_secs(10),
        num_members: std::num::NonZeroUsize::new(1).expect("non-zero"),
    });
    // While there is news (a member up or down), 3 members every 200 ms: news reaches 500
    // nodes in about 6 rounds (memberlist's LAN setting); nothing is sent without news.
    c.periodic_gossip = Some(foca::PeriodicParams {
        frequency: Duration::from_millis(200),
        num_members: std::num::NonZeroUsize::new(3).expect("non-zero"),
    });
    c
}

impl Membership {
    /// `refresh`: how long a peer may go without hearing our state (see the module docs).
    pub fn new(
        id: NodeId,
        config: foca::Config,
        seed: u64,
        me: NodeState,
        refresh: Duration,
    ) -> Membership {
        let foca = Foca::new(id, config, StdRng::seed_from_u64(seed), PostcardCodec);
        Membership {
            foca,
            runtime: AccumulatingRuntime::new(),
            pushed: me.clone(),
            me,
            peers: BTreeMap::new(),
            early: BTreeMap::new(),
            doubted: BTreeMap::new(),
            left: BTreeSet::new(),
            pending: vec![],
            now: Duration::ZERO,
            refresh,
            sent: BTreeMap::new(),
            pushed_at: None,
            unpushed: false,
        }
    }

    pub fn id(&self) -> &NodeId {
        self.foca.identity()
    }

    pub fn me(&self) -> &NodeState {
        &self.me
    }

    /// Joins through a seed known only by its address.
    pub fn join(&mut self, seed: SocketAddr) {
        // Announcements are accepted by whoever owns the address, whatever name we guess.
        let placeholder = NodeId { name: String::new(), addr: seed, epoch: 0, renewal: 0 };
        if let Err(e) = self.foca.announce(placeholder, &mut self.runtime) {
            tracing::debug!("announce to {seed}: {e}");
        }
    }

    /// Who a membership packet says sent it (its header): the driver checks that against the
    /// certificate of the connection it came on.
    pub fn sender(packet: &[u8]) -> Option<NodeId> {
        use foca::Codec;
        PostcardCodec.decode_header(packet).ok().map(|h| h.src)
    }

    pub fn handle_packet(&mut self, data: &[u8]) {
        if let Err(e) = self.foca.handle_data(data, &mut self.runtime) {
            tracing::debug!("membership packet: {e}");
        }
        // A member that says it is down itself is leaving.
        if let Some(src) = Membership::sender(data)
            && self.foca.iter_members().all(|m| m.id().name != src.name)
        {
            self.left.insert(src.name);
        }
    }

    pub fn handle_timer(&mut self, timer: Timer<NodeId>) {
        if let Err(e) = self.foca.handle_timer(timer, &mut self.runtime) {
            tracing::debug!("membership timer: {e}");
        }
    }

    /// Tells the cluster this node is leaving (peers learn at once, not by failure detection).
    pub fn leave(&mut self) {
        if let Err(e) = self.foca.leave_cluster(&mut self.runtime) {
            tracing::debug!("leave: {e}");
        }
    }

    /// Changes this node's own state; returns it with its version bumped if anything changed.
    /// The change goes to every peer now, or at the first tick once [`push_gap`] has passed.
    pub fn update_local(&mut self, f: impl FnOnce(&mut NodeState)) -> Option<NodeState> {
        let mut next = self.me.clone();
        f(&mut next);
        (next.epoch, next.seq) = (self.me.epoch, self.me.seq);
        if next == self.me {
            return None;
        }
        next.seq += 1;
        self.me = next.clone();
        self.unpushed = true;
        self.push_if_due();
        Some(next)
    }

    /// Advances the core's clock (the driver ticks it every [`TICK`]): a change that waited
    /// goes out, and peers that heard nothing for `refresh` get our version.
    pub fn tick(&mut self, now: Duration) {
        self.now = self.now.max(now);
        self.push_if_due();
        let quiet: Vec<NodeId> = self
            .peers
            .values()
            .filter(|p| self.sent.get(&p.id.name).is_none_or(|t| self.now >= t.0 + self.refresh))
            .map(|p| p.id.clone())
            .collect();
        for id in quiet {
            let version = StateChange::between(&self.me, &self.me);
            self.send(id, StateMessage::Change(version));
        }
    }

    fn push_if_due(&mut self) {
        let gap = push_gap(self.peers.len());
        if !self.unpushed || self.pushed_at.is_some_and(|t| self.now < t + gap) {
            return;
        }
        self.unpushed = false;
        self.pushed_at = Some(self.now);
        let change = StateChange::between(&self.pushed, &self.me);
        let ids: Vec<NodeId> = self.peers.values().map(|p| p.id.clone()).collect();
        for id in ids {
            // A peer sent something other than the last push gets the whole state.
            let msg = match self.sent.get(&id.name) {
                Some((_, seq)) if *seq == self.pushed.seq => StateMessage::Change(change.clone()),
                _ => StateMessage::Full(self.me.clone()),
            };
            self.send(id, msg);
        }
        self.pushed = self.me.clone();
    }

    fn send(&mut self, id: NodeId, msg: StateMessage) {
        if !matches!(msg, StateMessage::Want { .. }) {
            self.sent.insert(id.name.clone(), (self.now, self.me.seq));
        }
        self.pending.push(Output::State(id, Box::new(msg)));
    }

    /// A message from a peer's state stream, from the node it names (the driver checked).
    /// Returns whether that node's state here changed.
    pub fn apply_message(&mut self, msg: StateMessage) -> bool {
        match msg {
            StateMessage::Full(state) => self.apply_state(state),
            StateMessage::Want { name } => {
                if let Some(id) = self.peers.get(&name).map(|p| p.id.clone()) {
                    self.send(id, StateMessage::Full(self.me.clone()));
                }
                false
            }
            StateMessage::Change(change) => {
                if change.name == self.me.name {
                    return false;
                }
                let current = self
                    .peers
                    .get(&change.name)
                    .and_then(|p| p.state.as_ref())
                    .or_else(|| self.early.get(&change.name));
                let held = current.map(NodeState::version);
                if held == Some((change.epoch, change.base)) {
                    let next = change.apply(current.expect("held"));
                    return self.apply_state(next);
                }
                // Missed one (or never had it): ask for the whole state, once we know the peer.
                if held.is_none_or(|v| v < (change.epoch, change.seq))
                    && let Some(id) = self.peers.get(&change.name).map(|p| p.id.clone())
                {
                    let want = StateMessage::Want { name: self.me.name.clone() };
                    self.pending.push(Output::State(id, Box::new(want)));
                }
                false
            }
        }
    }

    /// A peer's state from gossip: kept if newer than what we have. A node's own entry is never
    /// overwritten by anyone else.
    pub fn apply_state(&mut self, state: NodeState) -> bool {
        if state.name == self.me.name {
            return false;
        }
        let current = self
            .peers
            .get(&state.name)
            .and_then(|p| p.state.as_ref())
            .or_else(|| self.early.get(&state.name));
        if current.is_some_and(|c| c.version() >= state.version()) {
            return false;
        }
        match self.peers.get_mut(&state.name) {
            Some(peer) => peer.state = Some(state),
            None => {
                self.early.insert(state.name.clone(), state);
            }
        }
        true
    }

    /// The verdict of this node's own probe of a member the failure detector declared down:
    /// alive, it stays a peer (it refutes the rumour and comes back under a renewed identity);
    /// not, it goes.
    pub fn verified(&mut self, id: NodeId, alive: bool) {
        if self.doubted.get(&id.name) != Some(&id) {
            return; // it came back, or left, meanwhile
        }
        if alive {
            tracing::info!(peer = id.name, "declared down by the cluster, but answers: kept");
            self.pending.push(Output::Verify { id, again: true });
            return;
        }
        self.doubted.remove(&id.name);
        if self.peers.get(&id.name).is_some_and(|p| p.id == id) {
            self.peers.remove(&id.name);
            self.sent.remove(&id.name);
        }
        self.pending.push(Output::Down(id));
    }

    /// Peers the failure detector declared down that this node is still probing.
    pub fn doubted(&self) -> impl Iterator<Item = &str> {
        self.doubted.keys().map(String::as_str)
    }

    /// Live members (never this node).
    pub fn peers(&self) -> impl Iterator<Item = &Peer> {
        self.peers.values()
    }

    pub fn peer(&self, name: &str) -> Option<&Peer> {
        self.peers.get(name)
    }

    /// Everything the last calls produced, in order.
    pub fn drain(&mut self) -> Vec<Output> {
        let mut out = std::mem::take(&mut self.pending);
        while let Some(n) = self.runtime.to_notify() {
            match n {
                // Our own name at another address: this node before a restart, still being
                // gossiped until it is declared down. Never a peer.
                OwnedNotification::MemberUp(id) if id.name == self.me.name => {}
                OwnedNotification::MemberUp(id) => {
                    self.doubted.remove(&id.name);
                    let state = self.early.remove(&id.name).filter(|s| s.epoch >= id.epoch);
                    let kept = self.peers.get(&id.name).and_then(|p| p.state.clone());
                    let state = state.or(kept.filter(|s| s.epoch >= id.epoch));
                    self.peers.insert(id.name.clone(), Peer { id: id.clone(), state });
                    self.sent.insert(id.name.clone(), (self.now, self.me.seq));
                    out.push(Output::Up(id.clone()));
                    out.push(Output::State(id, Box::new(StateMessage::Full(self.me.clone()))));
                }
                // Kept until this node's own probe agrees: a member can gossip that another is
                // down, and the failure detector believes it.
                OwnedNotification::MemberDown(id)
                    if self.peers.get(&id.name).is_some_and(|p| p.id == id)
                        && !self.left.contains(&id.name) =>
                {
                    self.doubted.insert(id.name.clone(), id.clone());
                    out.push(Output::Verify { id, again: false });
                }
                OwnedNotification::MemberDown(id) => {
                    if self.peers.get(&id.name).is_some_and(|p| p.id == id) {
                        self.peers.remove(&id.name);
                        self.sent.remove(&id.name);
                    }
                    self.doubted.remove(&id.name);
                    out.push(Output::Down(id));
                }
                OwnedNotification::Rename(old, new) => {
                    // Renamed to our own name (gossiped at another member's address): the old
                    // member goes, and, as in `MemberUp`, our name is never a peer.
                    if let Some(p) = self.peers.remove(&old.name)
                        && new.name != self.me.name
                    {
                        self.peers.insert(new.name.clone(), Peer { id: new, state: p.state });
                    }
                }
                _ => {}
            }
        }
        self.left.clear();
        while let Some((to, data)) = self.runtime.to_send() {
            out.push(Output::Packet(to, data));
        }
        while let Some((after, timer)) = self.runtime.to_schedule() {
            out.push(Output::Timer(after, timer));
        }
        out
    }
}

/// Membership packets under mutation: the property of the fuzz target `gossip` (`mesh/fuzz`),
/// and its seeded quick pass. A member of a three-node cluster takes packets of every kind the
/// protocol has (made by foca's own codec) damaged, or arbitrary bytes: it must not panic, a
/// header it reads must encode back to itself, it must never list itself as a peer nor take a
/// new state for itself, and every packet it sends must still fit a datagram.
#[cfg(any(test, fuzzing))]
pub mod mutations {
    use super::*;
    use bytes::BufMut;
    use foca::{Codec, Header, Member, Message, State};

    fn id(i: u8) -> NodeId {
        NodeId {
            name: format!("n{i}"),
            addr: SocketAddr::from(([10, 0, 0, i + 1], 7946)),
            epoch: 1,
            renewal: 0,
        }
    }

    fn member(i: u8) -> Membership {
        let swim = swim_config(
            Duration::from_millis(500),
            Duration::from_millis(150),
            Duration::from_millis(1500),
        );
        let state =
            NodeState { name: format!("n{i}"), api: format!("http://n{i}"), ..Default::default() };
        Membership::new(id(i), swim, u64::from(i), state, Duration::from_secs(30))
    }

    /// Three members that have found each other, delivering packets at once and firing every
    /// timer but those that would declare a member down.
    pub fn cluster() -> Vec<Membership> {
        let mut nodes: Vec<Membership> = (0..3).map(member).collect();
        nodes[1].join(id(0).addr);
        nodes[2].join(id(0).addr);
        for _ in 0..20 {
            if nodes.iter().all(|n| n.peers().count() == 2) {
                break;
            }
            for i in 0..nodes.len() {
                for out in nodes[i].drain() {
                    match out {
                        Output::Packet(to, data) => {
                            if let Some(n) = nodes.iter_mut().find(|n| n.id().addr == to.addr) {
                                n.handle_packet(&data);
                            }
                        }
                        Output::Timer(
                            _,
                            Timer::ChangeSuspectToDown { .. } | Timer::RemoveDown(_),
                        ) => {}
                        Output::Timer(_, timer) => nodes[i].handle_timer(timer),
                        _ => {}
                    }
                }
            }
        }
        assert!(nodes.iter().all(|n| n.peers().count() == 2), "the cluster formed");
        nodes
    }

    /// A packet from member `src` to member 0 of each kind of message, with cluster updates.
    pub fn packets() -> Vec<Vec<u8>> {
        let messages = [
            Message::Ping(7),
            Message::Ack(7),
            Message::PingReq { target: id(2), probe_number: 3 },
            Message::IndirectPing { origin: id(2), probe_number: 3 },
            Message::IndirectAck { target: id(2), probe_number: 3 },
            Message::ForwardedAck { origin: id(2), probe_number: 3 },
            Message::Announce,
            Message::Feed,
            Message::Gossip,
            Message::Broadcast,
            Message::TurnUndead,
        ];
        let updates = [
            Member::new(id(2), 1, State::Alive),
            Member::new(id(0), 0, State::Suspect),
            Member::new(id(3), 0, State::Down),
        ];
        let mut out = vec![];
        for (k, message) in messages.into_iter().enumerate() {
            let n =
                if matches!(message, Message::Announce | Message::Broadcast) { 0 } else { k % 4 };
            let header =
                Header { src: id(1 + k as u8 % 2), src_incarnation: 0, dst: id(0), message };
            let mut buf = bytes::BytesMut::new();
            PostcardCodec.encode_header(&header, &mut buf).expect("a header encodes");
            if n > 0 {
                buf.put_u16(n as u16);
                for m in &updates[..n.min(3)] {
                    PostcardCodec.encode_member(m, &mut buf).expect("a member encodes");
                }
            }
            out.push(buf.to_vec());
        }
        out
    }

    /// Member 0 of `nodes` takes `data`; checks what it makes of it.
    pub fn check_packet(nodes: &mut [Membership], data: &[u8]) {
        if let Ok(header) = PostcardCodec.decode_header(data) {
            let mut again = bytes::BytesMut::new();
            PostcardCodec.encode_header(&header, &mut again).expect("a decoded header encodes");
            assert_eq!(PostcardCodec.decode_header(&again[..]).ok(), Some(header.clone()));
            assert_eq!(Membership::sender(data), Some(header.src));
        }
        let me = nodes[0].me().clone();
        nodes[0].handle_packet(data);
        for out in nodes[0].drain() {
            if let Output::Packet(_, packet) = out {
                assert!(packet.len() <= 1100, "a {} byte packet does not fit", packet.len());
            }
        }
        assert_eq!(nodes[0].me(), &me);
        let names: BTreeSet<&str> = nodes[0].peers().map(|p| p.id.name.as_str()).collect();
        assert_eq!(names.len(), nodes[0].peers().count(), "one peer per name");
        assert!(!names.contains(me.name.as_str()), "itself as a peer");
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        /// Found by the seeded pass: a member can gossip an identity with this node's name at
        /// another member's address. foca takes it for that member renewed (`Rename`), and the
        /// view made it a peer under this node's own name, dropping the real member. The
        /// driver checks a packet's sender against its certificate, not the members it
        /// gossips, so any member could do this; now the renamed one just goes.
        #[test]
        fn a_member_gossiped_under_our_own_name_is_never_a_peer() {
            let mut nodes = cluster();
            let impostor = NodeId { name: "n0".into(), addr: id(1).addr, epoch: 2, renewal: 0 };
            let header =
                Header { src: id(2), src_incarnation: 0, dst: id(0), message: Message::Gossip };
            let mut buf = bytes::BytesMut::new();
            PostcardCodec.encode_header(&header, &mut buf).unwrap();
            buf.put_u16(1);
            PostcardCodec.encode_member(&Member::new(impostor, 0, State::Alive), &mut buf).unwrap();
            check_packet(&mut nodes, &buf);
            assert!(nodes[0].peers().all(|p| p.id.name != "n0"));
        }

        /// 20 000 packets of every kind, damaged (bits flipped, bytes inserted or dropped,
        /// cut short, a piece of another packet spliced in), into one long-lived member.
        #[test]
        fn mutated_packets_keep_the_membership_sane() {
            let seeds = packets();
            let mut nodes = cluster();
            for seed in &seeds {
                check_packet(&mut nodes, seed);
            }
            let mut state = 0x9e37_79b9_7f4a_7c15u64;
            let mut next = move || {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                state
            };
            for case in 0..20_000 {
                if case % 2_000 == 0 {
                    nodes = cluster();
                }
                let mut data = seeds[case % seeds.len()].clone();
                for _ in 0..1 + next() % 3 {
                    let at = (next() as usize) % (data.len() + 1);
                    match next() % 5 {
                        0 if at < data.len() => data[at] ^= 1 << (next() % 8),
                        1 => data.insert(at, next() as u8),
                        2 if at < data.len() => drop(data.remove(at)),
                        3 => {
                            let other = &seeds[next() as usize % seeds.len()];
                            let from = next() as usize % other.len();
                            let to = (from + 1 + next() as usize % 32).min(other.len());
                            data.splice(at..at, other[from..to].iter().copied());
                        }
                        _ => data.truncate(at),
                    }
                }
                check_packet(&mut nodes, &data);
            }
        }
    }
}
