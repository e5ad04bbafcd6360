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

pub use crate::state::{NodeState, StateChange, StateMessage};

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
    /// Renewed after the cluster declared this node down, and no member has spoken to it since
    /// (see [`Membership::reannounce`]).
    rejoined: bool,
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
            rejoined: false,
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

    /// The driver's rejoin tick (every second): seeds that were not up yet when this node
    /// started, knocked on while it knows no peer; and a rejoined node's announcements.
    pub fn knock(&mut self, seeds: &[SocketAddr]) {
        if self.peers.is_empty() {
            for seed in seeds {
                self.join(*seed);
            }
        }
        self.reannounce();
    }

    /// After a rejoin, until a member speaks to this node: its new identity announced to every
    /// peer it knew. foca gossips the renewal once and then waits for a member to speak first,
    /// and that one packet often goes out on the connection the peer that declared us down has
    /// just closed (a node paused past failure detection: SIGSTOP, a frozen VM); a peer that
    /// declared us down never speaks first, so without this both would stay silent for good.
    fn reannounce(&mut self) {
        if !self.rejoined {
            return;
        }
        let known: Vec<NodeId> = self.peers.values().map(|p| p.id.clone()).collect();
        for id in known {
            if let Err(e) = self.foca.announce(id, &mut self.runtime) {
                tracing::debug!("announce after a rejoin: {e}");
            }
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
        let version = StateChange::between(&self.me, &self.me);
        for id in quiet {
            self.send(id, StateMessage::Change(version.clone()));
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
                let current = self.held(&change.name);
                let held = current.map(NodeState::version);
                if held == Some((change.epoch, change.base)) {
                    let next = change.apply(current.expect("held"));
                    return self.apply_state(next);
                }
                // Missed one (or never had it): ask for the whole state, once we know the peer.
                if held.is_none_or(|v| v < (change.epoch, change.seq))
                    && let Some(id) = self.peers.get(&change.name).map(|p| p.id.clone())
                {
                    self.send(id, StateMessage::Want { name: self.me.name.clone() });
                }
                false
            }
        }
    }

    /// What this node holds of `name`'s state: a peer's, or one that came before its member
    /// came up.
    fn held(&self, name: &str) -> Option<&NodeState> {
        self.peers.get(name).and_then(|p| p.state.as_ref()).or_else(|| self.early.get(name))
    }

    /// A peer's state from gossip: kept if newer than what we have. A node's own entry is never
    /// overwritten by anyone else.
    pub fn apply_state(&mut self, state: NodeState) -> bool {
        if state.name == self.me.name {
            return false;
        }
        if self.held(&state.name).is_some_and(|c| c.version() >= state.version()) {
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
            // Told that we are here: the peer may have declared us down too (our packets lost
            // while we could not hear it), and then neither side would speak first. An
            // announcement makes it answer: with a feed of members, or that we are down, and
            // then we renew and rejoin (see `reannounce`).
            if let Err(e) = self.foca.announce(id.clone(), &mut self.runtime) {
                tracing::debug!("announce to a doubted peer: {e}");
            }
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
                OwnedNotification::Rejoin(_) => self.rejoined = true,
                OwnedNotification::Active => self.rejoined = false,
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

/// Membership packets under mutation, for the fuzz target `gossip` and its quick pass.
#[cfg(any(test, fuzzing))]
pub mod mutations;
