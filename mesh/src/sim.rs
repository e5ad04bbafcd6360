//! A deterministic simulation of the membership core: N nodes on a virtual network (fixed
//! latency, seeded packet loss) under a virtual clock, ticked and pushing state as the driver
//! does. Used by the tests for the edge cases (loss, a killed node, a leave, a restart, a
//! pause) and by the bench for gossip volume, convergence and failure detection at sizes no test
//! machine could run as processes ([`Sim::churn`]).

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};
use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use foca::Timer;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::core::{Membership, NodeId, NodeState, Output, StateMessage, TICK, swim_config};

#[derive(Debug, Clone)]
pub struct SimConfig {
    pub nodes: usize,
    /// Probability that a packet is lost.
    pub loss: f64,
    pub latency: Duration,
    pub seed: u64,
    pub probe_period: Duration,
    pub probe_rtt: Duration,
    pub suspect_to_down: Duration,
    pub state_refresh: Duration,
    /// Probability that a state message is lost (as with a connection that broke under it).
    pub state_loss: f64,
    /// The design before changes and versions (for the bench's comparison): the whole state
    /// to every peer at every change and this often.
    pub full_every: Option<Duration>,
}

impl SimConfig {
    /// The driver's defaults (see `MeshConfig::new`).
    pub fn new(nodes: usize) -> SimConfig {
        SimConfig {
            nodes,
            loss: 0.0,
            latency: Duration::from_millis(1),
            seed: 1,
            probe_period: Duration::from_millis(500),
            probe_rtt: Duration::from_millis(150),
            suspect_to_down: Duration::from_millis(1500),
            state_refresh: crate::STATE_REFRESH,
            state_loss: 0.0,
            full_every: None,
        }
    }
}

enum Event {
    /// Packets and states reach whatever listens at the node's address now.
    Packet(usize, Bytes),
    State(usize, StateMessage),
    /// Timers, ticks and probes belong to one start of a node (its generation).
    Timer(usize, u32, Timer<NodeId>),
    Tick(usize, u32),
    /// Node `i`'s own probe of a doubted peer comes back: alive or not.
    Verified(usize, u32, NodeId, bool),
}

/// The running simulation.
pub struct Sim {
    cfg: SimConfig,
    now: Duration,
    nodes: Vec<Membership>,
    dead: Vec<bool>,
    /// Dead by leaving (its endpoint closed: a probe fails at once).
    left: Vec<bool>,
    /// Counts each node's starts.
    generation: Vec<u32>,
    /// Paused (SIGSTOP, a frozen VM): what reaches it is lost, its own timers wait in `held`.
    paused: Vec<bool>,
    held: Vec<Vec<Event>>,
    /// What node `i` sends before `muted_until[i]` is lost (a connection its peer had closed).
    muted_until: Vec<Duration>,
    queue: BinaryHeap<Reverse<(Duration, u64)>>,
    events: BTreeMap<u64, Event>,
    next: u64,
    rng: StdRng,
    by_addr: BTreeMap<SocketAddr, usize>,
    /// Bytes each node sent (membership packets and state messages).
    pub sent_bytes: Vec<u64>,
    /// Of those, state messages, and their number.
    pub state_bytes: Vec<u64>,
    pub state_messages: Vec<u64>,
    /// Times a node declared a live node (as it is now, not an earlier start of it) down.
    pub false_downs: u64,
}

impl std::fmt::Debug for Sim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sim").field("now", &self.now).field("nodes", &self.nodes.len()).finish()
    }
}

fn addr(i: usize) -> SocketAddr {
    SocketAddr::from(([10, 0, (i / 250) as u8, (i % 250 + 1) as u8], 7946))
}

impl Sim {
    /// Starts every node; each joins through node 0.
    pub fn new(cfg: SimConfig) -> Sim {
        let mut sim = Sim {
            now: Duration::ZERO,
            nodes: vec![],
            dead: vec![false; cfg.nodes],
            left: vec![false; cfg.nodes],
            generation: vec![0; cfg.nodes],
            paused: vec![false; cfg.nodes],
            held: (0..cfg.nodes).map(|_| vec![]).collect(),
            muted_until: vec![Duration::ZERO; cfg.nodes],
            queue: BinaryHeap::new(),
            events: BTreeMap::new(),
            next: 0,
            rng: StdRng::seed_from_u64(cfg.seed),
            by_addr: BTreeMap::new(),
            sent_bytes: vec![0; cfg.nodes],
            state_bytes: vec![0; cfg.nodes],
            state_messages: vec![0; cfg.nodes],
            false_downs: 0,
            cfg,
        };
        for i in 0..sim.cfg.nodes {
            let node = sim.start(i, 1);
            sim.nodes.push(node);
            sim.by_addr.insert(addr(i), i);
            sim.joined(i);
        }
        sim
    }

    /// Node `i` at start `epoch`, with the state a node of a small fleet publishes: two pools,
    /// a golden and a template digest, a tenant.
    fn start(&self, i: usize, epoch: u64) -> Membership {
        let name = format!("n{i}");
        let id = NodeId { name: name.clone(), addr: addr(i), epoch, renewal: 0 };
        // A digest's length (64 hex digits).
        let digest = |what: &str| format!("{what}{i:0>58}");
        let state = NodeState {
            name,
            epoch,
            seq: 1,
            api: format!("http://{}:7777", addr(i).ip()),
            warm: BTreeMap::from([
                ("host/small/none".to_string(), 2),
                ("python/medium/egress".to_string(), 4),
            ]),
            goldens: vec![digest("golden")],
            templates: vec![digest("template")],
            claims: 10,
            capacity: 1000,
            tenants: BTreeMap::from([("acme".to_string(), 10)]),
            tenant_seconds: BTreeMap::from([("acme".to_string(), 86_400)]),
            ..Default::default()
        };
        let swim = swim_config(self.cfg.probe_period, self.cfg.probe_rtt, self.cfg.suspect_to_down);
        let seed = self.cfg.seed ^ i as u64 ^ (epoch << 32);
        Membership::new(id, swim, seed, state, self.cfg.state_refresh)
    }

    /// Node `i` (just started) joins through node 0 and starts ticking.
    fn joined(&mut self, i: usize) {
        let jitter = Duration::from_micros(i as u64 * 997 % 250_000);
        self.at(jitter, Event::Tick(i, self.generation[i]));
        if i > 0 {
            self.nodes[i].join(addr(0));
            self.flush(i);
        }
    }

    pub fn now(&self) -> Duration {
        self.now
    }

    pub fn node(&self, i: usize) -> &Membership {
        &self.nodes[i]
    }

    /// Switches the design-before emulation on or off (see [`SimConfig::full_every`]).
    pub fn set_full_every(&mut self, every: Option<Duration>) {
        self.cfg.full_every = every;
    }

    /// Node `i` runs (neither killed nor left, or started again since).
    pub fn alive(&self, i: usize) -> bool {
        !self.dead[i]
    }

    fn at(&mut self, after: Duration, e: Event) {
        self.next += 1;
        self.queue.push(Reverse((self.now + after, self.next)));
        self.events.insert(self.next, e);
    }

    /// Carries out node `i`'s output.
    fn flush(&mut self, i: usize) {
        let generation = self.generation[i];
        let muted = self.now < self.muted_until[i];
        for out in self.nodes[i].drain() {
            match out {
                Output::Packet(to, data) => {
                    self.sent_bytes[i] += data.len() as u64;
                    if let Some(&j) = self.by_addr.get(&to.addr)
                        && !self.rng.random_bool(self.cfg.loss)
                        && !muted
                    {
                        self.at(self.cfg.latency, Event::Packet(j, data));
                    }
                }
                Output::Timer(after, t) => self.at(after, Event::Timer(i, generation, t)),
                Output::Up(_) => {}
                Output::State(to, msg) => self.push_state(i, &to, *msg),
                Output::Down(id) => {
                    let j = self.by_addr.get(&id.addr).copied();
                    if j.is_some_and(|j| !self.dead[j] && self.nodes[j].id() == &id) {
                        self.false_downs += 1;
                    }
                }
                Output::Verify { id, again } => {
                    // A direct probe: a round trip if it is alive (and the network lets it
                    // through) or left (its endpoint closed answers at once), the driver's bound
                    // if it died silently.
                    let j = self.by_addr.get(&id.addr).copied();
                    let alive = j.is_some_and(|j| !self.dead[j] && !self.paused[j])
                        && !self.rng.random_bool(self.cfg.loss);
                    let left = j.is_some_and(|j| self.left[j]);
                    let probe =
                        if alive || left { self.cfg.latency * 2 } else { self.cfg.probe_rtt * 4 };
                    let wait = if again { Duration::from_secs(2) } else { Duration::ZERO };
                    self.at(wait + probe, Event::Verified(i, generation, id, alive));
                }
            }
        }
    }

    fn push_state(&mut self, i: usize, to: &NodeId, msg: StateMessage) {
        let msg = match msg {
            StateMessage::Change(_) if self.cfg.full_every.is_some() => {
                StateMessage::Full(self.nodes[i].me().clone())
            }
            msg => msg,
        };
        // What the driver sends: a 4-byte length and the postcard body, on a stream.
        let n = msg.wire_len() as u64;
        self.sent_bytes[i] += n;
        self.state_bytes[i] += n;
        self.state_messages[i] += 1;
        if let Some(&j) = self.by_addr.get(&to.addr)
            && !self.rng.random_bool(self.cfg.state_loss)
            && self.now >= self.muted_until[i]
        {
            self.at(self.cfg.latency, Event::State(j, msg));
        }
    }

    /// Delivers `packet` to node `i` now, as if a member sent it (a forged one, say).
    pub fn inject(&mut self, i: usize, packet: Bytes) {
        self.nodes[i].handle_packet(&packet);
        self.flush(i);
    }

    /// A membership packet from node `from` to node `to` that says node `about` is down: what a
    /// lying member sends.
    pub fn rumour_down(&self, from: usize, to: usize, about: usize) -> Bytes {
        use bytes::BufMut;
        use foca::Codec;
        let id = |i: usize| self.nodes[i].id().clone();
        let header = foca::Header {
            src: id(from),
            src_incarnation: 0,
            dst: id(to),
            message: foca::Message::Gossip,
        };
        let mut buf = bytes::BytesMut::new();
        let mut codec = foca::PostcardCodec;
        codec.encode_header(&header, &mut buf).expect("a header encodes");
        buf.put_u16(1);
        let member = foca::Member::new(id(about), 0, foca::State::Down);
        codec.encode_member(&member, &mut buf).expect("a member encodes");
        buf.freeze()
    }

    /// Stops node `i` without a word: its packets and timers vanish.
    pub fn kill(&mut self, i: usize) {
        self.dead[i] = true;
    }

    /// Node `i` leaves the cluster, saying so.
    pub fn leave(&mut self, i: usize) {
        self.nodes[i].leave();
        self.flush(i);
        self.dead[i] = true;
        self.left[i] = true;
    }

    /// Pauses node `i` (SIGSTOP): what is sent to it is lost, and its timers fire only when it
    /// is resumed.
    pub fn pause(&mut self, i: usize) {
        self.paused[i] = true;
    }

    /// Resumes node `i`: every timer that came due while it was paused fires now, as a stopped
    /// process finds them on SIGCONT, and what it sends for the next `muted` is lost, as on the
    /// connections its peers closed meanwhile.
    pub fn resume(&mut self, i: usize, muted: Duration) {
        self.paused[i] = false;
        self.muted_until[i] = self.now + muted;
        for e in std::mem::take(&mut self.held[i]) {
            self.at(Duration::ZERO, e);
        }
    }

    /// Node `i` starts again after a kill, as its next epoch (a flap).
    pub fn restart(&mut self, i: usize) {
        let epoch = self.nodes[i].id().epoch + 1;
        self.nodes[i] = self.start(i, epoch);
        (self.dead[i], self.left[i]) = (false, false);
        self.generation[i] += 1;
        self.joined(i);
    }

    /// Changes node `i`'s state, as the driver does; returns the new version.
    pub fn update(&mut self, i: usize, f: impl FnOnce(&mut NodeState)) -> Option<(u64, u64)> {
        self.nodes[i].tick(self.now);
        let changed = self.nodes[i].update_local(f).map(|s| s.version());
        self.flush(i);
        changed
    }

    /// Runs until `until` (virtual time).
    pub fn run_until(&mut self, until: Duration) {
        while let Some(Reverse((t, n))) = self.queue.peek().copied() {
            if t > until {
                break;
            }
            self.queue.pop();
            self.now = t;
            let Some(e) = self.events.remove(&n) else { continue };
            let (i, generation) = match &e {
                Event::Packet(i, _) | Event::State(i, _) => (*i, self.generation[*i]),
                Event::Timer(i, g, _) | Event::Tick(i, g) | Event::Verified(i, g, _, _) => (*i, *g),
            };
            if self.dead[i] || generation != self.generation[i] {
                continue;
            }
            if self.paused[i] {
                if matches!(e, Event::Timer(..) | Event::Tick(..) | Event::Verified(..)) {
                    self.held[i].push(e);
                }
                continue;
            }
            match e {
                Event::Packet(_, data) => self.nodes[i].handle_packet(&data),
                Event::Verified(_, _, id, alive) => self.nodes[i].verified(id, alive),
                Event::Timer(_, _, t) => self.nodes[i].handle_timer(t),
                Event::State(_, msg) => {
                    self.nodes[i].apply_message(msg);
                }
                Event::Tick(..) => {
                    // As the driver does: a node alone keeps knocking on its seed.
                    if i > 0 && self.nodes[i].peers().next().is_none() {
                        self.nodes[i].join(addr(0));
                    }
                    // ... and once a second, its rejoin tick (the driver's `knock`; the seed
                    // knocking above is the same at every tick here).
                    if self.now.as_millis() % 1000 < TICK.as_millis() {
                        self.nodes[i].knock(&[]);
                    }
                    self.nodes[i].tick(self.now);
                    if let Some(every) = self.cfg.full_every
                        && self.now.as_millis() % every.as_millis() < TICK.as_millis()
                    {
                        let me = StateMessage::Full(self.nodes[i].me().clone());
                        let peers: Vec<NodeId> =
                            self.nodes[i].peers().map(|p| p.id.clone()).collect();
                        for p in peers {
                            self.push_state(i, &p, me.clone());
                        }
                    }
                    self.at(TICK, Event::Tick(i, generation));
                }
            }
            self.flush(i);
        }
        self.now = until;
    }

    /// Runs in small steps until `cond` holds; returns the virtual time it took, or `None`
    /// after `limit`.
    pub fn run_until_true(
        &mut self,
        limit: Duration,
        mut cond: impl FnMut(&Sim) -> bool,
    ) -> Option<Duration> {
        let start = self.now;
        while self.now - start <= limit {
            if cond(self) {
                return Some(self.now - start);
            }
            let step = self.now + Duration::from_millis(10);
            self.run_until(step);
        }
        None
    }

    /// Whether every live node sees exactly the other live nodes. (Peers are keyed by name,
    /// and a name has one address here: the right count of live addresses is the right set.)
    pub fn converged(&self) -> bool {
        let live = self.dead.iter().filter(|d| !**d).count();
        (0..self.nodes.len()).filter(|&i| !self.dead[i]).all(|i| {
            self.nodes[i].peers().count() == live - 1
                && self.nodes[i]
                    .peers()
                    .all(|p| self.by_addr.get(&p.id.addr).is_some_and(|&j| j != i && !self.dead[j]))
        })
    }
}

/// What [`Sim::churn`] measured.
#[derive(Debug, Clone)]
pub struct ChurnReport {
    pub nodes: usize,
    pub length: Duration,
    /// Bytes sent per node per second, all of it and state messages alone.
    pub bytes_per_node_s: f64,
    pub state_bytes_per_node_s: f64,
    /// For each state change of a steady node: how long until every other steady node held it
    /// (sorted; in steps of 10 ms).
    pub spread: Vec<Duration>,
    /// Changes that had not reached every steady node when the run ended.
    pub unspread: usize,
    /// Live nodes declared down (see [`Sim::false_downs`]).
    pub false_downs: u64,
}

impl ChurnReport {
    /// The `q` quantile of `spread` (0.5: the median).
    pub fn spread_pct(&self, q: f64) -> Duration {
        let n = self.spread.len();
        if n == 0 {
            return Duration::ZERO;
        }
        self.spread[((n as f64 * q).ceil() as usize).clamp(1, n) - 1]
    }
}

impl Sim {
    /// Takes out of `spreading` (node → the version it changed to, and when) the changes every
    /// other steady node holds now, adding how long they took to `spread`.
    fn arrived(
        &self,
        spreading: &mut BTreeMap<usize, ((u64, u64), Duration)>,
        spread: &mut Vec<Duration>,
        steady: usize,
    ) {
        spreading.retain(|&i, &mut (version, since)| {
            let name = format!("n{i}");
            let everywhere = (0..steady).filter(|&j| j != i).all(|j| {
                self.nodes[j]
                    .peer(&name)
                    .and_then(|p| p.state.as_ref())
                    .is_some_and(|s| s.version() >= version)
            });
            if everywhere {
                spread.push(self.now - since);
            }
            !everywhere
        });
    }

    /// Runs `length` of virtual time in which every node changes its state every
    /// `change_every` (each at its own phase) and `flapping` nodes (the last ones) go down
    /// without a word for 5 s and come back as their next start, every 30 s. The cluster must
    /// have converged first.
    pub fn churn(
        &mut self,
        length: Duration,
        change_every: Duration,
        flapping: usize,
    ) -> ChurnReport {
        let n = self.nodes.len();
        let steady = n - flapping;
        let start = self.now;
        let sent0: u64 = self.sent_bytes.iter().sum();
        let state0: u64 = self.state_bytes.iter().sum();
        let downs0 = self.false_downs;
        let step = Duration::from_millis(10);
        let phase = |i: usize, every: Duration| every * (i as u32 * 7919 % 1000) / 1000;
        // Per steady node: its next change, and the change still spreading (version, since).
        let mut next: Vec<Duration> = (0..steady).map(|i| start + phase(i, change_every)).collect();
        let mut spreading: BTreeMap<usize, ((u64, u64), Duration)> = BTreeMap::new();
        let mut spread = vec![];
        let mut unspread = 0;
        let flap_every = Duration::from_secs(30);
        let mut flap_at: Vec<Duration> =
            (steady..n).map(|i| start + phase(i, flap_every)).collect();
        while self.now < start + length {
            for (i, next) in next.iter_mut().enumerate() {
                if self.now >= *next {
                    *next += change_every;
                    if let Some(v) = self.update(i, |s| s.claims += 1) {
                        // A change that overtakes one still spreading: the older one counts as
                        // not spread.
                        unspread += usize::from(spreading.insert(i, (v, self.now)).is_some());
                    }
                }
            }
            for (k, i) in (steady..n).enumerate() {
                if self.now >= flap_at[k] {
                    if self.dead[i] {
                        self.restart(i);
                        flap_at[k] += flap_every - Duration::from_secs(5);
                    } else {
                        self.kill(i);
                        flap_at[k] += Duration::from_secs(5);
                    }
                }
            }
            let now = self.now;
            self.arrived(&mut spreading, &mut spread, steady);
            self.run_until(now + step);
        }
        // Changes made just before the end are still on their way: let them arrive (no new
        // changes, no flaps), for as long as the slowest may take.
        let end = self.now + Duration::from_secs(5);
        while !spreading.is_empty() && self.now < end {
            let now = self.now;
            self.arrived(&mut spreading, &mut spread, steady);
            self.run_until(now + step);
        }
        spread.sort_unstable();
        let secs = length.as_secs_f64() * n as f64;
        ChurnReport {
            nodes: n,
            length,
            bytes_per_node_s: (self.sent_bytes.iter().sum::<u64>() - sent0) as f64 / secs,
            state_bytes_per_node_s: (self.state_bytes.iter().sum::<u64>() - state0) as f64 / secs,
            spread,
            unspread: unspread + spreading.len(),
            false_downs: self.false_downs - downs0,
        }
    }
}
