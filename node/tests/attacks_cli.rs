//! Cheap identities against `pcp-node sim`: sleepers that turn to zeros, free
//! riders that copy the last update, replays of one Δ from many keys, claims of
//! fast steps, and a round whose participants come as a blob. One short run per
//! attack; the matrices over more rounds are `bench/hostile.sh`'s.

use std::process::Command;

use serde_json::Value;

#[path = "support/common.rs"]
mod common;
#[path = "support/serial.rs"]
mod serial;
use common::corpus;

/// Runs `pcp-node sim --rounds ROUNDS --tau 10` with `extra`: the shepherd's events.
fn sim(rounds: u64, extra: &[&str]) -> Vec<Value> {
    let dir = tempfile::tempdir().expect("tempdir");
    let ev = dir.path().join("events.jsonl");
    let rounds = rounds.to_string();
    let out = Command::new(env!("CARGO_BIN_EXE_pcp-node"))
        .env("PCP_ARTIFACT_CACHE", std::env::temp_dir().join("pcp-test-artifact-cache").join("artifacts"))
        .args(["sim", "--rounds", &rounds, "--tau", "10", "--data", &corpus()])
        // the shepherd's own screen, unless `extra` names committees (open runs default to 3)
        .args(if extra.contains(&"--screeners") { &[][..] } else { &["--screeners", "0"][..] })
        .args(extra)
        .args(["--events", ev.to_str().expect("utf8"), "--data-dir", dir.path().to_str().expect("utf8")])
        .output()
        .expect("runs");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    std::fs::read_to_string(&ev).expect("events").lines().map(|l| serde_json::from_str(l).expect("json")).collect()
}

/// The peer id of sim worker `n`.
fn peer(events: &[Value], n: u64) -> String {
    let started = events.iter().find(|e| e["event"] == "worker_started" && e["worker"] == n);
    started.and_then(|e| e["peer"].as_str()).expect("worker_started event").to_owned()
}

/// The rounds in which `peer`'s contribution was refused, with the reasons.
fn refused<'a>(events: &'a [Value], peer: &str) -> Vec<(u64, &'a str)> {
    events
        .iter()
        .filter(|e| e["event"] == "contribution_rejected" && e["peer"] == peer)
        .map(|e| (e["round"].as_u64().expect("round"), e["reason"].as_str().expect("reason")))
        .collect()
}

/// The peers averaged into each round.
fn contributors(events: &[Value]) -> Vec<Vec<String>> {
    let rounds = events.iter().filter(|e| e["event"] == "round_completed");
    rounds.map(|r| serde_json::from_value(r["peers"].clone()).expect("peers")).collect()
}

/// `sleeper:1:zero`, `copy` and `timing` in one lockstep fp32 run under the norm
/// screen, with every round's participants in a blob (`--participants-inline 1`).
/// The zeros (which drove the norm bound to 0 when zeros counted) and the copies of
/// the last update are refused; the timing liar's honest work counts; the honest
/// workers, who learn the participants from the blob, are averaged every round.
#[test]
fn zeros_and_copies_are_refused_and_participants_come_as_a_blob() {
    let _serial = serial::serial();
    let events = sim(
        4,
        &[
            "--nodes",
            "6",
            "--no-overlap",
            "--encoding",
            "fp32",
            "--screen",
            "norm",
            "--participants-inline",
            "1",
            "--hostile",
            "sleeper:1:zero:1",
            "--hostile",
            "copy:2",
            "--hostile",
            "timing:3",
        ],
    );
    let (zero, copy, timing) = (peer(&events, 1), peer(&events, 2), peer(&events, 3));
    let zeros = refused(&events, &zero);
    assert_eq!(zeros.iter().map(|(r, _)| *r).collect::<Vec<_>>(), [2, 3, 4], "honest in round 1: {zeros:?}");
    assert!(zeros.iter().all(|(_, why)| why.starts_with("empty")), "{zeros:?}");
    let copies = refused(&events, &copy);
    assert_eq!(copies.iter().map(|(r, _)| *r).collect::<Vec<_>>(), [2, 3, 4], "no update to copy in round 1");
    assert!(copies.iter().all(|(_, why)| why.contains("too similar") && why.contains("update")), "{copies:?}");
    assert!(refused(&events, &timing).is_empty(), "its work is honest; its claim is ignored");
    let rounds = contributors(&events);
    assert_eq!(rounds.len(), 4);
    for (i, peers) in rounds.iter().enumerate() {
        for n in [3, 4, 5] {
            assert!(peers.contains(&peer(&events, n)), "round {}: worker {n} averaged: {peers:?}", i + 1);
        }
    }
    let bounds: Vec<f64> = events
        .iter()
        .filter(|e| e["event"] == "round_completed")
        .map(|r| r["norm_bound"].as_f64().expect("norm_bound"))
        .collect();
    assert!(bounds[1..].iter().all(|b| *b >= bounds[0] / 10.0), "the bound holds: {bounds:?}");
}

/// `copy` under overlap, in the default sparse encoding: a worker that trains
/// from its own parameters and merges each update into them still copies the
/// last public update, the difference of the last two global parameters it
/// fetched (not of its own anchors, its steps and merges, which no copy check
/// could match), and the copy check (the update's support, or the one before
/// it for a copier a round behind, under the norm screen so that no loss screen
/// stands in front of it) refuses it from round 3 on, when the copier holds two
/// fetched rounds.
#[test]
fn a_copy_of_the_last_update_is_refused_under_overlap() {
    let _serial = serial::serial();
    let events = sim(5, &["--nodes", "4", "--screen", "norm", "--hostile", "copy:1"]);
    let copy = peer(&events, 1);
    let copies = refused(&events, &copy);
    assert!(copies.iter().all(|(_, why)| why.contains("a copy of a recent round's update")), "{copies:?}");
    let refused_rounds: Vec<u64> = copies.iter().map(|(r, _)| *r).collect();
    for round in 3..=5 {
        assert!(refused_rounds.contains(&round), "round {round}'s copy refused: {copies:?}");
    }
    for (i, peers) in contributors(&events).iter().enumerate().skip(2) {
        assert!(!peers.contains(&copy), "round {}: the copy averaged: {peers:?}", i + 1);
    }
}

/// `replay:3`: one Δ sent by three keys counts at most once a round (which of them
/// makes a round, if any, is the rounds' timing on two cores).
#[test]
fn a_delta_replayed_from_three_keys_counts_once() {
    let _serial = serial::serial();
    let events = sim(3, &["--nodes", "4", "--no-overlap", "--encoding", "fp32", "--hostile", "replay:3:1"]);
    // worker 1 and identities 4 and 5 replay; workers 2 and 3 are honest
    let replayers = [peer(&events, 1), peer(&events, 4), peer(&events, 5)];
    let mut counted = 0;
    for (i, peers) in contributors(&events).iter().enumerate() {
        let these = replayers.iter().filter(|p| peers.contains(p)).count();
        assert!(these <= 1, "round {}: {peers:?}", i + 1);
        counted += these;
    }
    let copies: Vec<(u64, &str)> = replayers.iter().flat_map(|p| refused(&events, p)).collect();
    assert!(counted >= 1 && copies.len() >= 2, "counted {counted}, refused {copies:?}");
    assert!(copies.iter().all(|(_, why)| why.contains("another contribution")), "{copies:?}");
}
