//! The `--events` record is a machine interface: a seeded `pcp-node sim` must emit
//! the events and fields in `golden/sim_events.json`, field for field. Renaming or
//! dropping a field that dashboards, metrics or scripts read fails here; a new
//! event or field is added to the golden file on purpose (`PCP_BLESS=1 cargo test
//! -p pcp-node --test events_golden` rewrites it, and the diff is reviewed).

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::process::Command;

use serde_json::Value;

#[path = "support/common.rs"]
mod common;
use common::corpus;

/// Event name → its fields, from JSONL files.
fn shapes(files: &[PathBuf]) -> BTreeMap<String, BTreeSet<String>> {
    let mut out: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for file in files {
        for line in std::fs::read_to_string(file).unwrap_or_default().lines() {
            let v: Value = serde_json::from_str(line).expect("every line is JSON");
            let name = v["event"].as_str().expect("every line names its event").to_owned();
            let keys = v.as_object().expect("every line is an object").keys().filter(|k| *k != "t" && *k != "event");
            out.entry(name).or_default().extend(keys.cloned());
        }
    }
    out
}

#[test]
fn a_seeded_sim_emits_the_golden_events_field_for_field() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ev = dir.path().join("events.jsonl");
    let out = Command::new(env!("CARGO_BIN_EXE_pcp-node"))
        .env("PCP_ARTIFACT_CACHE", std::env::temp_dir().join("pcp-test-artifact-cache").join("artifacts"))
        // the defaults: sparse pseudo-gradients, overlapped rounds
        .args(["sim", "--nodes", "4", "--rounds", "3", "--tau", "10", "--seed", "7"])
        .args(["--kill-at", "2:1", "--join-at", "2", "--data", &corpus()])
        .args(["--events", ev.to_str().expect("utf8"), "--data-dir", dir.path().to_str().expect("utf8")])
        .output()
        .expect("runs");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // the defaults a public run gets: sparse k 4 both ways, overlapped rounds
    let started: Value = std::fs::read_to_string(&ev)
        .expect("events")
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).expect("json"))
        .find(|e| e["event"] == "run_started")
        .expect("run_started");
    assert_eq!(started["overlap"], true, "{started}");
    assert_eq!(started["encoding_spec"], "sparse:chunk=64,k=4,bits=2,decay=0.5,down=8,downbits=4", "{started}");
    let mut files = vec![ev];
    files.extend((1..=4).map(|n| dir.path().join(format!("sim/worker-{n}/events.jsonl"))));
    // an aggregated run, one of whose aggregators lies: the aggregators' events
    let agg = tempfile::tempdir().expect("tempdir");
    let agg_ev = agg.path().join("events.jsonl");
    let out = Command::new(env!("CARGO_BIN_EXE_pcp-node"))
        .env("PCP_ARTIFACT_CACHE", std::env::temp_dir().join("pcp-test-artifact-cache").join("artifacts"))
        .args(["sim", "--nodes", "4", "--rounds", "2", "--tau", "10", "--seed", "7", "--screen", "norm"])
        .args(["--aggregators", "2", "--hostile", "agg-alter:1", "--data", &corpus()])
        .args(["--events", agg_ev.to_str().expect("utf8"), "--data-dir", agg.path().to_str().expect("utf8")])
        .output()
        .expect("runs");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    files.push(agg_ev);
    // screening by committees, one of whose screeners lies: the committees' events
    let screened = tempfile::tempdir().expect("tempdir");
    let screened_ev = screened.path().join("events.jsonl");
    let out = Command::new(env!("CARGO_BIN_EXE_pcp-node"))
        .env("PCP_ARTIFACT_CACHE", std::env::temp_dir().join("pcp-test-artifact-cache").join("artifacts"))
        // one screener a committee, every verdict spot-checked: committees form from
        // round 2 on whatever the arrival order, and a lie is caught when told
        .args(["sim", "--nodes", "5", "--rounds", "4", "--tau", "10", "--seed", "7", "--screeners", "1"])
        .args(["--screen-spot-rate", "1", "--probation-rounds", "1", "--hostile", "screen-high:4"])
        .args(["--data", &corpus()])
        .args(["--events", screened_ev.to_str().expect("utf8"), "--data-dir", screened.path().to_str().expect("utf8")])
        .output()
        .expect("runs");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    files.push(screened_ev);
    files.extend((1..=4).map(|n| screened.path().join(format!("sim/worker-{n}/events.jsonl"))));
    let got = shapes(&files);
    let golden_path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/golden/sim_events.json");
    if std::env::var_os("PCP_BLESS").is_some() {
        std::fs::write(&golden_path, serde_json::to_string_pretty(&got).expect("json") + "\n").expect("writes");
        return;
    }
    let golden: BTreeMap<String, BTreeSet<String>> =
        serde_json::from_str(&std::fs::read_to_string(&golden_path).expect("golden file")).expect("golden json");
    for (name, fields) in &got {
        let Some(expected) = golden.get(name) else {
            panic!("event {name} is not in {}: add it with PCP_BLESS=1", golden_path.display())
        };
        assert_eq!(fields, expected, "the fields of {name} changed");
    }
    // the events every such run has: a timing-dependent one (a clipped contribution,
    // a late update) may be absent, these may not
    for name in [
        "run_started",
        "round_started",
        "contribution_received",
        "round_completed",
        "checkpoint",
        "run_finished",
        "worker_started",
        "worker_killed",
        "run_joined",
        "round_announced",
        "params_fetched",
        "contribution_sent",
        "update_merged",
        "aggregator_assigned",
        "shard_aggregated",
        "aggregate_disputed",
        "screen_assigned",
        "screen_reported",
        "screen_decided",
        "screen_answered",
    ] {
        assert!(got.contains_key(name), "no {name} event");
    }
}
