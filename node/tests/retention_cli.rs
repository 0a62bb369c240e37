//! A store that does not fill the disk: after 30 rounds of `pcp-node sim`, every
//! node's blob store is no larger than after 5 rounds, give or take one round's blobs.

use std::path::Path;
use std::process::Command;

use serde_json::Value;

#[path = "support/common.rs"]
mod common;
use common::{bytes_under, corpus};

/// Runs a 3-node sim of `rounds` short rounds in `dir`; returns the shepherd's events.
fn sim(dir: &Path, rounds: u64) -> Vec<Value> {
    let ev = dir.join("events.jsonl");
    let out = Command::new(env!("CARGO_BIN_EXE_pcp-node"))
        .env("PCP_ARTIFACT_CACHE", std::env::temp_dir().join("pcp-test-artifact-cache").join("artifacts"))
        .args(["sim", "--nodes", "3", "--rounds", &rounds.to_string(), "--tau", "2", "--seed", "7"])
        .args(["--encoding", "fp32", "--no-overlap", "--screeners", "0"])
        .args(["--data", &corpus()])
        .args(["--events", ev.to_str().expect("utf8"), "--data-dir", dir.to_str().expect("utf8")])
        .output()
        .expect("runs");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let events: Vec<Value> =
        std::fs::read_to_string(&ev).expect("events").lines().map(|l| serde_json::from_str(l).expect("json")).collect();
    let completed = events.iter().filter(|e| e["event"] == "round_completed").count() as u64;
    assert_eq!(completed, rounds, "the sim ran every round");
    events
}

#[test]
fn thirty_rounds_leave_every_store_as_large_as_five() {
    let (five, thirty) = (tempfile::tempdir().expect("tempdir"), tempfile::tempdir().expect("tempdir"));
    sim(five.path(), 5);
    let events = sim(thirty.path(), 30);

    let released: Vec<&Value> = events.iter().filter(|e| e["event"] == "blobs_released").collect();
    let blobs: u64 = released.iter().map(|e| e["count"].as_u64().expect("count")).sum();
    // every round past the kept two gives up its parameters unless a kept round
    // still uses them (a round whose every contribution the screen refused keeps the
    // parameters it began with); round 1's are the run's initial ones, which stay.
    // (The sim's shepherd has no standby candidates: it writes no state blobs.)
    let params = |round: u64| {
        events
            .iter()
            .find(|e| e["event"] == "round_started" && e["round"] == round)
            .and_then(|e| e["params_hash"].as_str())
            .unwrap_or_else(|| panic!("round {round} started"))
    };
    let kept: std::collections::BTreeSet<&str> = (29..=30).map(params).collect();
    let dropped: std::collections::BTreeSet<&str> =
        (2..=28).map(params).filter(|p| !kept.contains(p) && *p != params(1)).collect();
    let expected = dropped.len() as u64;
    assert!(expected > 0, "the run's parameters changed");
    assert!(blobs >= expected, "{blobs} blobs released, {expected} expected: {released:?}");
    // one round's blobs: the most a round released
    let round_bytes = released.iter().map(|e| e["bytes"].as_u64().expect("bytes")).max().expect("a release");
    assert!(released.iter().all(|e| e["failed"] == 0), "{released:?}");

    for node in ["shepherd", "worker-1", "worker-2"] {
        let store = |dir: &Path| {
            let blobs = dir.join("sim").join(node).join("blobs");
            assert!(blobs.is_dir(), "no store at {}", blobs.display());
            bytes_under(&blobs)
        };
        let (after5, after30) = (store(five.path()), store(thirty.path()));
        eprintln!("{node}: {after5} bytes of blobs after 5 rounds, {after30} after 30");
        assert!(
            after30 <= after5 + round_bytes,
            "{node}'s store grew from {after5} bytes after 5 rounds to {after30} after 30 (one round: {round_bytes})"
        );
    }
}

#[test]
fn keep_rounds_must_be_at_least_one() {
    for bad in ["0", "-1", "two", "99999999999999999999"] {
        let out = Command::new(env!("CARGO_BIN_EXE_pcp-node"))
            .args(["sim", &format!("--keep-rounds={bad}"), "--data-dir", "/nonexistent/never-created"])
            .output()
            .expect("runs");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "--keep-rounds {bad}: {stderr}");
        assert!(stderr.starts_with("error: ") && stderr.contains("--keep-rounds"), "{stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
}
