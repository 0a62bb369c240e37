//! The dashboard's state from events: shepherd and worker views, bounds.

use serde_json::{Value, json};

use super::*;

impl State {
    /// Applies the event `name` with `fields`, as it is written.
    pub(crate) fn apply_named(&mut self, name: &str, fields: &Value, now_ms: u64) {
        self.apply(&Event::named(name, fields.clone()), now_ms);
    }
}

pub(crate) const W1: &str = "12D3KooWQm6U7mxrTKoEqGbF9JGTcL2Dey1rEKK9nDLGP2VqYhHa";
pub(crate) const W2: &str = "12D3KooWHd7bQwKpJTMW8qgzNXVwUFC8d1t6mSafRjW4kXAUBjGc";
pub(crate) const W3: &str = "12D3KooWSHEPHERDxRNhqYR8azJc2VAgDhT6rpYQsPzoUv3aDk5e";
pub(crate) const RUN: &str = "9f3b2c1d4e5f60718293a4b5c6d7e8f9091a2b3c4d5e6f708192a3b4c5d6e7f8";
/// 2026-01-01T00:00:00Z, in unix milliseconds.
pub(crate) const T0: u64 = 1_767_225_600_000;

/// Feeds events to a state, each `dt` milliseconds after the last.
struct Feed {
    s: State,
    at: u64,
}

impl Feed {
    fn e(&mut self, name: &str, fields: Value, dt: u64) {
        self.at += dt;
        self.s.apply_named(name, &fields, self.at);
    }
}

/// A shepherd two rounds into a three-round run, with one worker rejected in round 2.
pub(crate) fn shepherd(mode: Mode) -> State {
    let mut f = Feed { s: State::new(mode), at: T0 };
    f.e("listening", json!({"peer": W3, "addr": "/ip4/127.0.0.1/tcp/4001"}), 0);
    f.e("run_started", json!({"run": RUN, "model": "nanogpt-small", "rounds": 3, "tau": 10}), 10);
    if mode == Mode::Sim {
        f.e("worker_started", json!({"worker": 1, "peer": W1, "round": 0}), 10);
        f.e("worker_started", json!({"worker": 2, "peer": W2, "round": 0}), 10);
        f.e("listening", json!({"peer": W1, "addr": "/ip4/127.0.0.1/tcp/40123"}), 10);
        f.e("listening", json!({"peer": W2, "addr": "/ip4/127.0.0.1/tcp/40124"}), 10);
    }
    f.e("peer_connected", json!({"peer": W1, "addr": "/ip4/10.0.0.7/tcp/40123"}), 10);
    f.e("peer_connected", json!({"peer": W2, "addr": "/ip4/10.0.0.8/udp/4001/quic-v1"}), 10);
    f.e("compile_started", json!({"backend": "cpu", "target": "znver3"}), 10);
    f.e("artifact_published", json!({"backend": "cpu", "target": "znver3"}), 2_000);
    f.e("worker_joined", json!({"peer": W1, "backend": "cpu:znver3"}), 10);
    f.e("worker_joined", json!({"peer": W2, "backend": "vulkan"}), 10);
    for round in 1..=2u64 {
        let deadline = f.at + 60_000;
        f.e("round_started", json!({"round": round, "deadline_unix_ms": deadline, "participants": [W1, W2]}), 0);
        let sent = json!({"round": round, "peer": W1, "tokens": 20480, "accepted": true, "reason": ""});
        f.e("contribution_received", sent, 4_000);
        let (accepted, reason) =
            if round == 2 { (false, "no improvement: held-out loss 3.1 -> 3.2") } else { (true, "") };
        let sent = json!({"round": round, "peer": W2, "tokens": 20480, "accepted": accepted, "reason": reason});
        f.e("contribution_received", sent, 1_000);
        if !accepted {
            f.e("contribution_rejected", json!({"round": round, "peer": W2, "reason": reason}), 0);
        }
        let peers = if accepted { json!([W1, W2]) } else { json!([W1]) };
        let completed = json!({
            "round": round, "contributors": if accepted { 2 } else { 1 },
            "mean_loss": 4.2 - 0.4 * round as f64, "val_loss": 4.05 - 0.3 * round as f64,
            "bytes_in": 880_000, "bytes_out": 1_760_000, "seconds": 5.0, "peers": peers, "excluded": [],
        });
        f.e("round_completed", completed, 500);
    }
    let deadline = f.at + 40_000;
    f.e("round_started", json!({"round": 3, "deadline_unix_ms": deadline, "participants": [W1, W2]}), 0);
    f.e("contribution_received", json!({"round": 3, "peer": W1, "tokens": 20480, "accepted": true}), 2_000);
    f.s.tick(f.at + 8_000);
    f.s
}

#[test]
fn a_shepherd_follows_rounds_and_workers() {
    let s = shepherd(Mode::Shepherd);
    assert_eq!(s.phase, Phase::Training(3));
    assert_eq!(s.completed(), 2);
    assert_eq!(s.rounds.len(), 2);
    assert_eq!(s.rounds[1].val_loss, Some(4.05 - 0.6));
    let rows = s.worker_rows();
    assert_eq!(rows.iter().map(|r| r.peer.as_str()).collect::<Vec<_>>(), [W1, W2]);
    assert_eq!(rows[0].status, Status::Sent);
    assert_eq!(rows[1].status, Status::Training);
    // 20480 tokens in the 2 s since round 3 opened
    assert_eq!(rows[0].tokens_per_s, Some(10_240.0));
    let last = rows[1].last.as_ref().expect("a verdict");
    assert_eq!((last.round, last.accepted), (2, Some(false)));
    assert!(last.reason.starts_with("no improvement"), "{}", last.reason);
    assert_eq!(s.traffic.total_in, 1_760_000);
    assert_eq!(s.addrs.get(W2).map(String::as_str), Some("/ip4/10.0.0.8/udp/4001/quic-v1"));
    // opened 2 s + 8 s ago, 40 s to the deadline
    let progress = s.round_progress().expect("an open round");
    assert!((progress - 10.0 / 40.0).abs() < 1e-9, "{progress}");
}

#[test]
fn the_contribution_that_completes_a_round_is_reported_after_the_next_opens() {
    let mut s = State::new(Mode::Shepherd);
    s.apply_named("worker_joined", &json!({"peer": W1, "backend": "cpu"}), T0);
    s.apply_named("round_started", &json!({"round": 1, "participants": [W1]}), T0);
    s.apply_named("round_completed", &json!({"round": 1, "peers": [W1], "mean_loss": 3.0}), T0 + 2_000);
    s.apply_named("round_started", &json!({"round": 2, "participants": [W1]}), T0 + 2_000);
    let sent = json!({"round": 1, "peer": W1, "tokens": 4096, "accepted": true, "reason": ""});
    s.apply_named("contribution_received", &sent, T0 + 2_000);
    let row = &s.workers[W1];
    assert_eq!(row.status, Status::Training, "it trains round 2 now");
    assert_eq!(row.tokens_per_s, Some(2048.0), "4096 tokens in the 2 s of round 1");
    assert_eq!(row.last, Some(Verdict { round: 1, accepted: Some(true), reason: String::new() }));
    // the last round: its last contributor is done, not missing
    s.apply_named("round_completed", &json!({"round": 2, "peers": [W1], "mean_loss": 2.0}), T0 + 4_000);
    assert_eq!(s.workers[W1].status, Status::Sent);
}

#[test]
fn sim_rows_follow_node_numbers_and_kills() {
    let mut s = shepherd(Mode::Sim);
    assert_eq!(s.worker_rows()[0].node, Some(1));
    assert_eq!(s.addrs.get(W1).map(String::as_str), Some("/ip4/127.0.0.1/tcp/40123"), "listening wins");
    assert_eq!(s.me.as_deref(), Some(W3));
    s.apply_named("worker_killed", &json!({"round": 3, "worker": 2}), T0 + 60_000);
    s.apply_named("worker_left", &json!({"peer": W2, "reason": "heartbeat timeout"}), T0 + 65_000);
    assert_eq!(s.workers[W2].status, Status::Killed);
    s.apply_named(
        "round_completed",
        &json!({"round": 3, "contributors": 1, "peers": [W1], "excluded": [W2], "mean_loss": 3.0}),
        T0 + 66_000,
    );
    assert_eq!(s.phase, Phase::Finished, "the last of 3 rounds");
    // a worker's run_finished does not end the shepherd's run early, and a
    // worker's events do not show on the shepherd's dashboard
    let mut t = shepherd(Mode::Sim);
    t.apply_named("run_finished", &json!({"run": RUN, "rounds": 3}), T0 + 70_000);
    t.apply_named("contribution_sent", &json!({"round": 3, "accepted": true, "bytes": 5}), T0 + 70_000);
    assert_eq!(t.phase, Phase::Training(3));
    assert!(t.mine.recent.is_empty());
    t.apply_named("run_finished", &json!({"rounds": 3, "val_loss": 2.0}), T0 + 70_000);
    assert_eq!(t.phase, Phase::Finished);
}

/// A worker that contributed two rounds (one rejected) and trains a third.
pub(crate) fn worker() -> State {
    let mut f = Feed { s: State::new(Mode::Worker), at: T0 };
    f.e("listening", json!({"peer": W1, "addr": "/ip4/192.168.1.20/udp/4001/quic-v1"}), 0);
    f.e("peer_connected", json!({"peer": W3, "addr": "/ip4/203.0.113.5/udp/4001/quic-v1"}), 100);
    f.e("blob_fetched", json!({"bytes": 2_500_000, "seconds": 0.5}), 500);
    f.e("blob_fetched", json!({"bytes": 1_100_000, "seconds": 0.2}), 200);
    let joined = json!({"run": RUN, "shepherd": W3, "backend": "cuda", "target": "sm_90", "rounds": 20, "tau": 50});
    f.e("run_joined", joined, 100);
    for round in 1..=2u64 {
        let deadline = f.at + 30_000;
        f.e("round_announced", json!({"round": round, "deadline_unix_ms": deadline, "participant": true}), 0);
        f.e("blob_fetched", json!({"bytes": 441_856, "seconds": 0.1}), 200);
        let (accepted, reason) = if round == 2 { (false, "norm 9.1 above the round's bound 3.0") } else { (true, "") };
        let sent = json!({"round": round, "loss": 3.9 - 0.3 * round as f64, "bytes": 442_000,
            "tokens": 40_960, "seconds": 4.0, "accepted": accepted, "reason": reason});
        f.e("contribution_sent", sent, 4_500);
    }
    let deadline = f.at + 30_000;
    f.e("round_announced", json!({"round": 3, "deadline_unix_ms": deadline, "participant": true}), 0);
    f.s.tick(f.at + 12_000);
    f.s
}

#[test]
fn a_worker_counts_its_contributions() {
    let s = worker();
    assert_eq!(s.phase, Phase::Training(3));
    assert_eq!((s.mine.accepted, s.mine.rejected, s.mine.tokens), (1, 1, 81_920));
    assert_eq!(s.mine.recent[0].tokens_per_s, Some(10_240.0));
    assert_eq!(s.mine.recent[1].outcome, Outcome::Rejected("norm 9.1 above the round's bound 3.0".into()));
    assert_eq!(s.traffic.total_in, 2_500_000 + 1_100_000 + 2 * 441_856);
    assert_eq!(s.traffic.total_out, 884_000);
    assert_eq!(s.backend.as_deref(), Some("cuda:sm_90"));
    assert!((s.round_progress().expect("open") - 0.4).abs() < 1e-9);
}

#[test]
fn memory_is_bounded() {
    let mut s = State::new(Mode::Shepherd);
    for round in 1..=(MAX_ROUNDS as u64 + 20) {
        s.apply_named("round_completed", &json!({"round": round, "mean_loss": 1.0}), T0 + round);
    }
    assert_eq!(s.rounds.len(), MAX_ROUNDS);
    assert_eq!(s.rounds.front().map(|r| r.round), Some(21));
    for i in 0..(MAX_WORKERS + 10) {
        let peer = format!("peer-{i}");
        s.apply_named("worker_joined", &json!({"peer": peer, "backend": "cpu"}), T0);
        if i % 2 == 0 {
            s.apply_named("worker_left", &json!({"peer": peer, "reason": "left"}), T0);
        }
    }
    assert_eq!(s.workers.len(), MAX_WORKERS);
    assert!(s.workers.contains_key(&format!("peer-{}", MAX_WORKERS + 9)), "a newcomer replaces a leaver");
    for i in 0..(MAX_PEERS + 10) {
        s.apply_named("peer_connected", &json!({"peer": format!("p{i}"), "addr": "/ip4/1.2.3.4/tcp/1"}), T0);
    }
    assert!(s.peers.len() <= MAX_PEERS && s.addrs.len() <= MAX_PEERS);
}
