//! A deterministic simulation of the membership core: N nodes on a virtual network (fixed
//! latency, seeded packet loss) under a virtual clock, with node state pushed the way the driver
//! pushes it. Used by the tests for the edge cases (loss, a killed node, a leave) and by the
//! bench for gossip volume at sizes no test machine could run as processes.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};
use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use foca::Timer;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::core::{Membership, NodeId, NodeState, Output, swim_config};

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
    pub state_interval: Duration,
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
            state_interval: Duration::from_secs(1),
        }
    }
}

enum Event {
    Packet(usize, Bytes),
    Timer(usize, Timer<NodeId>),
    State(usize, NodeState),
    Tick(usize),
    /// Node `i`'s own probe of a doubted peer comes back: alive or not.
    Verified(usize, NodeId, bool),
}

/// The running simulation.
pub struct Sim {
    cfg: SimConfig,
    now: Duration,
    nodes: Vec<Membership>,
    dead: Vec<bool>,
    /// Dead by leaving (its endpoint closed: a probe fails at once).
    left: Vec<bool>,
    queue: BinaryHeap<Reverse<(Duration, u64)>>,
    events: BTreeMap<u64, Event>,
    next: u64,
    rng: StdRng,
    by_addr: BTreeMap<SocketAddr, usize>,
    /// Bytes each node sent (membership packets and state messages).
    pub sent_bytes: Vec<u64>,
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
            queue: BinaryHeap::new(),
            events: BTreeMap::new(),
            next: 0,
            rng: StdRng::seed_from_u64(cfg.seed),
            by_addr: BTreeMap::new(),
            sent_bytes: vec![0; cfg.nodes],
            cfg,
        };
        for i in 0..sim.cfg.nodes {
            let name = format!("n{i}");
            let id = NodeId { name: name.clone(), addr: addr(i), epoch: 1, renewal: 0 };
            let state = NodeState {
                name,
                epoch: 1,
                seq: 1,
                api: format!("http://{}:7777", addr(i).ip()),
                warm: BTreeMap::from([("host/small/none".to_string(), 2)]),
                capacity: 1000,
                ..Default::default()
            };
            let swim =
                swim_config(sim.cfg.probe_period, sim.cfg.probe_rtt, sim.cfg.suspect_to_down);
            sim.nodes.push(Membership::new(id, swim, sim.cfg.seed ^ i as u64, state));
            sim.by_addr.insert(addr(i), i);
            let jitter = Duration::from_millis(i as u64);
            sim.at(sim.cfg.state_interval + jitter, Event::Tick(i));
            if i > 0 {
                sim.nodes[i].join(addr(0));
                sim.flush(i);
            }
        }
        sim
    }

    pub fn now(&self) -> Duration {
        self.now
    }

    pub fn node(&self, i: usize) -> &Membership {
        &self.nodes[i]
    }

    fn at(&mut self, after: Duration, e: Event) {
        self.next += 1;
        self.queue.push(Reverse((self.now + after, self.next)));
        self.events.insert(self.next, e);
    }

    /// Carries out node `i`'s output.
    fn flush(&mut self, i: usize) {
        for out in self.nodes[i].drain() {
            match out {
                Output::Packet(to, data) => {
                    self.sent_bytes[i] += data.len() as u64;
                    if let Some(&j) = self.by_addr.get(&to.addr)
                        && !self.rng.random_bool(self.cfg.loss)
                    {
                        self.at(self.cfg.latency, Event::Packet(j, data));
                    }
                }
                Output::Timer(after, t) => self.at(after, Event::Timer(i, t)),
                Output::Up(to) => self.push_state(i, &to),
                Output::Down(_) => {}
                Output::Verify { id, again } => {
                    // A direct probe: a round trip if it is alive (and the network lets it
                    // through) or left (its endpoint closed answers at once), the driver's bound
                    // if it died silently.
                    let j = self.by_addr.get(&id.addr).copied();
                    let alive =
                        j.is_some_and(|j| !self.dead[j]) && !self.rng.random_bool(self.cfg.loss);
                    let left = j.is_some_and(|j| self.left[j]);
                    let probe =
                        if alive || left { self.cfg.latency * 2 } else { self.cfg.probe_rtt * 4 };
                    let wait = if again { Duration::from_secs(2) } else { Duration::ZERO };
                    self.at(wait + probe, Event::Verified(i, id, alive));
                }
            }
        }
    }

    fn push_state(&mut self, i: usize, to: &NodeId) {
        let state = self.nodes[i].me().clone();
        // What the driver sends: a 4-byte length and the postcard body, on a stream.
        self.sent_bytes[i] += 4 + postcard::to_stdvec(&state).map(|b| b.len()).unwrap_or(0) as u64;
        if let Some(&j) = self.by_addr.get(&to.addr) {
            self.at(self.cfg.latency, Event::State(j, state));
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

    /// Changes node `i`'s state and pushes it to its peers, as the driver does.
    pub fn update(&mut self, i: usize, f: impl FnOnce(&mut NodeState)) {
        if self.nodes[i].update_local(f).is_some() {
            let peers: Vec<NodeId> = self.nodes[i].peers().map(|p| p.id.clone()).collect();
            for p in peers {
                self.push_state(i, &p);
            }
        }
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
            let i = match &e {
                Event::Packet(i, _)
                | Event::Timer(i, _)
                | Event::State(i, _)
                | Event::Tick(i)
                | Event::Verified(i, _, _) => *i,
            };
            if self.dead[i] {
                continue;
            }
            match e {
                Event::Packet(_, data) => self.nodes[i].handle_packet(&data),
                Event::Verified(_, id, alive) => self.nodes[i].verified(id, alive),
                Event::Timer(_, t) => self.nodes[i].handle_timer(t),
                Event::State(_, s) => {
                    self.nodes[i].apply_state(s);
                }
                Event::Tick(_) => {
                    // As the driver does: a node alone keeps knocking on its seed.
                    if i > 0 && self.nodes[i].peers().next().is_none() {
                        self.nodes[i].join(addr(0));
                    }
                    let peers: Vec<NodeId> = self.nodes[i].peers().map(|p| p.id.clone()).collect();
                    for p in peers {
                        self.push_state(i, &p);
                    }
                    self.at(self.cfg.state_interval, Event::Tick(i));
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

    /// Whether every live node sees exactly the other live nodes.
    pub fn converged(&self) -> bool {
        let live: Vec<usize> = (0..self.nodes.len()).filter(|i| !self.dead[*i]).collect();
        live.iter().all(|&i| {
            let mut seen: Vec<&str> = self.nodes[i].peers().map(|p| p.id.name.as_str()).collect();
            seen.sort_unstable();
            let mut want: Vec<String> =
                live.iter().filter(|&&j| j != i).map(|j| format!("n{j}")).collect();
            want.sort_unstable();
            seen == want.iter().map(String::as_str).collect::<Vec<_>>()
        })
    }
}
