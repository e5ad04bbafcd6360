//! The membership core in the deterministic simulation: joining, state gossip, failure
//! detection with and without packet loss, leave, a rejoin after a false suspicion or a pause,
//! and a hundred nodes under churn (changes, flapping members, loss). `silkbench mesh` runs the
//! same churn at 500 nodes.

use std::time::Duration;

use silk_mesh::core::StateMessage;
use silk_mesh::sim::{Sim, SimConfig};

const S: fn(u64) -> Duration = Duration::from_secs;

#[test]
fn twenty_nodes_converge_and_spread_state() {
    let mut sim = Sim::new(SimConfig::new(20));
    let took = sim.run_until_true(S(10), Sim::converged).expect("20 nodes converge");
    println!("20 nodes converged in {took:?}");
    sim.update(7, |s| {
        s.warm.insert("py/small/none".into(), 5);
    });
    let took = sim
        .run_until_true(S(1), |sim| {
            (0..20).filter(|i| *i != 7).all(|i| {
                sim.node(i).peers().any(|p| {
                    p.id.name == "n7"
                        && p.state.as_ref().is_some_and(|s| s.warm.get("py/small/none") == Some(&5))
                })
            })
        })
        .expect("a state change reaches every node within a second");
    println!("state change everywhere in {took:?}");
}

#[test]
fn a_killed_node_is_declared_down_within_five_seconds_even_with_loss() {
    for loss in [0.0, 0.05] {
        let mut sim = Sim::new(SimConfig { loss, seed: 7, ..SimConfig::new(8) });
        sim.run_until_true(S(10), Sim::converged).expect("converged");
        sim.kill(3);
        let took = sim
            .run_until_true(S(5), |sim| {
                (0..8).filter(|i| *i != 3).all(|i| sim.node(i).peers().all(|p| p.id.name != "n3"))
            })
            .unwrap_or_else(|| panic!("n3 still listed 5 s after it died (loss {loss})"));
        println!("loss {loss}: down everywhere after {took:?}");
        // Nobody else was thrown out on the way.
        assert!(sim.converged(), "loss {loss}: live nodes lost each other");
    }
}

#[test]
fn a_leaving_node_is_gone_at_once_and_own_state_is_never_overwritten() {
    let mut sim = Sim::new(SimConfig::new(5));
    sim.run_until_true(S(10), Sim::converged).expect("converged");
    sim.leave(4);
    let took = sim
        .run_until_true(S(1), |sim| (0..4).all(|i| sim.node(i).peers().all(|p| p.id.name != "n4")))
        .expect("leave spreads within a second");
    assert!(took < Duration::from_millis(500), "leave took {took:?}");
    // A forged, newer state for n0 sent to n0 itself changes nothing there.
    let mut forged = sim.node(0).me().clone();
    forged.seq += 100;
    forged.draining = true;
    let mut core = silk_mesh::core::Membership::new(
        sim.node(0).id().clone(),
        silk_mesh::core::swim_config(S(1), Duration::from_millis(300), S(2)),
        1,
        sim.node(0).me().clone(),
        S(30),
    );
    assert!(!core.apply_state(forged));
    assert!(!core.me().draining);
}

#[test]
fn a_node_paused_past_failure_detection_is_a_peer_again_soon_after_it_resumes() {
    let mut sim = Sim::new(SimConfig::new(3));
    sim.run_until_true(S(10), Sim::converged).expect("converged");
    // Paused (SIGSTOP, a frozen VM) until both others have declared it down.
    sim.pause(2);
    let without = |sim: &Sim| (0..2).all(|i| sim.node(i).peers().all(|p| p.id.name != "n2"));
    sim.run_until_true(S(10), without).expect("the paused node declared down");
    let t = sim.now();
    sim.run_until(t + S(2));
    // Resumed, and what it sends for 3 s is lost (on connections its peers closed meanwhile):
    // its own probes fail, so it declares both others down while they have declared it down.
    // Neither side of SWIM speaks first then; before the node announced itself to the peers its
    // direct probe found alive, it stayed out for good (and with 0.5 s of loss, was back in 0.5 s).
    sim.resume(2, S(3));
    let took = sim
        .run_until_true(S(10), Sim::converged)
        .expect("the resumed node is a peer of both others again within 10 s");
    println!("back in the mesh {took:?} after it resumed");
}

#[test]
fn the_simulation_is_deterministic() {
    let run = || {
        let mut sim = Sim::new(SimConfig { loss: 0.1, seed: 42, ..SimConfig::new(6) });
        sim.run_until(S(5));
        sim.sent_bytes.clone()
    };
    assert_eq!(run(), run());
}

#[test]
fn a_rumour_that_a_live_peer_is_down_does_not_drop_it() {
    let mut sim = Sim::new(SimConfig::new(3));
    sim.run_until_true(Duration::from_secs(10), Sim::converged).expect("converged");
    // n1 tells n0 that n2 is down; n2 is alive.
    let lie = sim.rumour_down(1, 0, 2);
    sim.inject(0, lie);
    let names =
        |sim: &Sim| -> Vec<String> { sim.node(0).peers().map(|p| p.id.name.clone()).collect() };
    // The failure detector believed it (this is what a lie does)...
    assert_eq!(sim.node(0).doubted().collect::<Vec<_>>(), ["n2"], "the rumour was not taken");
    // ...yet n2 stays a peer until n0's own probe says otherwise.
    assert!(names(&sim).contains(&"n2".to_string()), "dropped on a rumour: {:?}", names(&sim));
    // n0's own probe finds it alive: it stays (and the cluster settles with it in).
    let t = sim.now();
    sim.run_until(t + Duration::from_secs(5));
    assert!(names(&sim).contains(&"n2".to_string()), "{:?}", names(&sim));
    assert!(sim.converged());
    // A peer that is really gone still goes, once the probe agrees.
    sim.kill(2);
    let gone = sim
        .run_until_true(Duration::from_secs(10), |s| !s.node(0).peers().any(|p| p.id.name == "n2"));
    assert!(gone.is_some(), "a dead peer was kept");
}

#[test]
fn a_quiet_node_sends_its_version_once_per_refresh_not_its_state_every_second() {
    let mut sim = Sim::new(SimConfig::new(10));
    sim.run_until_true(S(10), Sim::converged).expect("converged");
    let t = sim.now();
    sim.run_until(t + S(5)); // the pushes of the joins are over
    let (bytes, messages) = (sim.state_bytes.clone(), sim.state_messages.clone());
    sim.run_until(t + S(5) + S(60));
    // Each of 9 peers hears our version twice a minute (refresh 30 s), not our state 60 times.
    for i in 0..10 {
        let sent = sim.state_messages[i] - messages[i];
        assert!((9..=27).contains(&sent), "n{i} sent {sent} state messages in a quiet minute");
        let each = (sim.state_bytes[i] - bytes[i]) / sent;
        assert!(each < 40, "n{i}: {each} bytes a message: a version should be a few dozen");
    }
}

#[test]
fn a_change_is_sent_as_its_fields_and_a_peer_that_missed_one_asks_for_the_whole_state() {
    // A tenth of state messages lost, as with connections breaking under them (a lost change
    // is found at the peer's next change or refresh; its `Want` or the answer can be lost too).
    let mut sim = Sim::new(SimConfig { state_loss: 0.1, seed: 9, ..SimConfig::new(20) });
    sim.run_until_true(S(10), Sim::converged).expect("converged");
    let t = sim.now();
    sim.run_until(t + S(40)); // the joins' states healed by now
    let bytes = sim.state_bytes[4];
    let messages = sim.state_messages[4];
    let mut version = None;
    for k in 0..5 {
        version = sim.update(4, |s| s.claims += 1 + k);
        let t = sim.now();
        sim.run_until(t + S(2));
    }
    // The changes themselves: a few dozen bytes each, however big the state.
    let full = StateMessage::Full(sim.node(4).me().clone()).wire_len() as u64;
    let each = (sim.state_bytes[4] - bytes) / (sim.state_messages[4] - messages);
    assert!(each * 3 < full, "{each} bytes a message for a {full} byte state");
    // Every peer comes to hold the last version through refreshes, lost messages or not.
    let version = version.unwrap();
    let healed = sim.run_until_true(S(95), |sim| {
        (0..20).filter(|&i| i != 4).all(|i| {
            sim.node(i).peer("n4").and_then(|p| p.state.as_ref()).map(|s| s.version())
                == Some(version)
        })
    });
    assert!(healed.is_some(), "a peer still holds an old state of n4");
}

#[test]
fn a_hundred_nodes_under_churn_spread_every_change_and_declare_no_live_node_down() {
    let mut sim = Sim::new(SimConfig { loss: 0.05, seed: 3, ..SimConfig::new(100) });
    sim.run_until_true(S(60), Sim::converged).expect("100 nodes converge with 5 % loss");
    // Every node changes every 30 s; one node flaps (down 5 s, back as its next start).
    let report = sim.churn(S(90), S(30), 1);
    println!(
        "100 nodes, 5 % loss: {:.0} B/s per node ({:.0} of it state), spread p50 {:?} p99 {:?}",
        report.bytes_per_node_s,
        report.state_bytes_per_node_s,
        report.spread_pct(0.5),
        report.spread_pct(0.99)
    );
    assert!(report.spread.len() >= 99 * 3, "{} changes measured", report.spread.len());
    assert_eq!(report.unspread, 0, "changes that never reached every node");
    assert!(report.spread_pct(1.0) <= S(2), "slowest change took {:?}", report.spread_pct(1.0));
    assert_eq!(report.false_downs, 0, "live nodes declared down");
    // Whether the flapping node ended up or down, every view settles on the same members.
    sim.run_until_true(S(10), Sim::converged).expect("the views agree after the churn");
}
