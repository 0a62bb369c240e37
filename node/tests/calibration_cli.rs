//! The simulator against the node: `pcp-node loadtest` (a real shepherd process and N
//! synthetic workers over loopback) and `pcp-node simulate` of the same configuration
//! give round times within 25 % of each other, at N = 100 and N = 300. That is a
//! timing of this machine's two cores, which the shepherd shares with N synthetic
//! workers: `bench/calibration.sh` holds it (`PCP_CALIBRATION_BENCH`). Every run
//! holds what is not timing: the shepherd's disk after the run, and every round
//! aggregating at least 95% of the contributions sent on time.
//!
//! The configuration is `bench/loadtest/gpt2-124m.json`: the node's gpt2-124m
//! (nanoGPT's untied head, GPT-2's 50,257 tokens: 163,037,184 parameters), sparse
//! pseudo-gradients, τ = 2, a modelled inner step of 2 s, the norm screen and no
//! validation. The simulator is given the same: `--params`, a loopback link for the
//! workers and the shepherd, one region, two aggregate threads, and workers that fetch
//! nothing and never straggle (`--synthetic-workers --stragglers 0 --jitter 0`), as the
//! loadtest's.
//!
//! Each loadtest moves 1.5 GB a round through one shepherd on this machine's cores,
//! for minutes, and the synthetic workers' Rust is slow unoptimized: the tests run in
//! an optimized build (`scripts/test.sh` runs the suite with `--release`), one at a
//! time, and are ignored in a debug one. The 300-worker one is a benchmark
//! (`bench/calibration.sh`), not run by `scripts/test.sh`.

use std::cell::RefCell;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use serde_json::Value;

#[path = "support/common.rs"]
mod common;
use common::bytes_under;

#[path = "support/serial.rs"]
mod serial;

#[path = "support/cluster.rs"]
#[allow(dead_code, reason = "shared with the other multi-process tests")]
mod cluster;
use cluster::{Proc, pcp_node, wait_for, wait_unless};

/// The node's gpt2-124m with GPT-2's vocabulary (`vocab_size` in the config).
const PARAMS: &str = "163037184";
/// Five, so that three rounds are timed (the second to the fourth) and their median
/// is one round's: the second can run slow while round 1's checkpoint is written back.
const ROUNDS: u64 = 5;
const STEP_MS: u64 = 2000;
/// Set by `bench/calibration.sh`: the round times must agree within 25%.
const BENCH: &str = "PCP_CALIBRATION_BENCH";

/// The median of `v`.
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The loadtest's round times (from a round's announcement to the next's) after
/// the first, which also holds every worker's start.
fn loadtest_rounds(dir: &Path, workers: usize) -> (Vec<f64>, Value) {
    let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("../bench/loadtest/gpt2-124m.json");
    let events = dir.join("shepherd.jsonl");
    let n = workers.to_string();
    let args: Vec<String> = [
        "--shepherd",
        "--pow-bits",
        "0",
        "--config",
        &config.display().to_string(),
        "--encoding",
        "sparse:k=2",
        "--no-overlap",
        "--screen",
        "norm",
        // the synthetic workers send a few payloads in turn: copies of each other
        "--no-copy-check",
        "--rounds",
        &ROUNDS.to_string(),
        "--min-workers",
        &n,
        // one round's blobs and one checkpoint: gpt2-124m's round is 4 GB on disk
        "--keep-rounds",
        "1",
        "--no-tui",
        "--listen",
        "/ip4/127.0.0.1/tcp/0",
        "--data-dir",
        &dir.join("shepherd").display().to_string(),
        "--events",
        &events.display().to_string(),
    ]
    .map(str::to_owned)
    .to_vec();
    let shepherd = RefCell::new(Proc::spawn("shepherd", Command::new(pcp_node()), &args, &dir.join("shepherd.log")));
    // a shepherd that cannot start (a full disk) fails the test at once, not at the timeout
    let listening = wait_unless(
        &events,
        "the shepherd to listen",
        Duration::from_secs(120),
        |e| e["event"] == "listening",
        || shepherd.borrow_mut().exited(),
    );
    let addr =
        format!("{}/p2p/{}", listening["addr"].as_str().expect("addr"), listening["peer"].as_str().expect("peer"));
    let json = dir.join("loadtest.json");
    let run = Command::new(pcp_node())
        .args(["loadtest", "--shepherd", &addr, "--workers", &n, "--step-ms", &STEP_MS.to_string()])
        .args([
            "--rounds",
            &ROUNDS.to_string(),
            "--timeout-s",
            "900",
            "--shepherd-pid",
            &shepherd.borrow().pid().to_string(),
        ])
        .args(["--json", &json.display().to_string(), "--data-dir", &dir.join("workers").display().to_string()])
        .output()
        .expect("loadtest runs");
    assert!(run.status.success(), "loadtest: {}", String::from_utf8_lossy(&run.stderr));
    let report: Value = serde_json::from_slice(&std::fs::read(&json).expect("the loadtest report")).expect("json");
    // the shepherd's disk after the run: the initial parameters (pinned), the last
    // round's parameters with their shards, its update and state, and one checkpoint,
    // 3.9 GB measured; the leak this guards against added about 1.5 GB a round
    wait_for(&events, "the run to finish", Duration::from_secs(120), |e| e["event"] == "run_finished");
    let disk = bytes_under(&dir.join("shepherd"));
    let params_bytes = 4 * PARAMS.parse::<u64>().expect("a count");
    eprintln!("{workers} workers: the shepherd's data directory holds {:.2} GB after the run", disk as f64 / 1e9);
    assert!(disk <= 7 * params_bytes, "the shepherd kept {disk} bytes, more than 7 × the parameters' {params_bytes}");
    let rounds = report["rounds"].as_array().expect("rounds");
    let seconds = rounds.iter().skip(1).filter_map(|r| r["seconds"].as_f64()).collect::<Vec<_>>();
    assert!(seconds.len() as u64 >= ROUNDS - 2, "rounds timed: {report}");
    (seconds, report)
}

/// The simulator's steady round time for the same configuration.
fn simulated_round(dir: &Path, workers: usize) -> (f64, Value) {
    let out = dir.join("sim");
    let nodes = (workers + 1).to_string();
    let run = Command::new(pcp_node())
        .args(["simulate", "--nodes", &nodes, "--rounds", &ROUNDS.to_string(), "--model", "gpt2-124m"])
        .args(["--params", PARAMS, "--encoding", "sparse:k=2", "--tau", "2", "--step-seconds", "2"])
        .args(["--profile", "loopback", "--shepherd-profile", "loopback", "--regions", "1"])
        .args(["--screen", "norm", "--eval-batches", "0", "--aggregate-threads", "2", "--no-copy-check"])
        // the loadtest's workers: no fetches, no stragglers, no jitter; lockstep, as its shepherd (--no-overlap)
        .args(["--synthetic-workers", "--stragglers", "0", "--jitter", "0", "--lockstep"])
        .args(["--out", &out.display().to_string()])
        .output()
        .expect("simulate runs");
    assert!(run.status.success(), "simulate: {}", String::from_utf8_lossy(&run.stderr));
    let report: Value =
        serde_json::from_slice(&std::fs::read(out.join("report.json")).expect("report.json")).expect("json");
    let steady = report["strategies"][0]["summary"]["steady_round_s"].as_f64().expect("steady_round_s");
    (steady, report["strategies"][0]["summary"].clone())
}

fn agree(workers: usize) {
    let dir = tempfile::tempdir().expect("tempdir");
    let (measured, report) = loadtest_rounds(dir.path(), workers);
    let (simulated, summary) = simulated_round(dir.path(), workers);
    let node = median(measured.clone());
    eprintln!(
        "{workers} workers: loadtest rounds {measured:.2?} s (median {node:.2} s), simulate {simulated:.2} s \
         ({:+.0} %); loadtest {report}; simulate {summary}",
        (simulated / node - 1.0) * 100.0
    );
    // the agreement is a timing of this machine's two cores: `bench/calibration.sh`
    // holds it to 25%; every run holds the shepherd's disk and the rounds' aggregation
    let apart = format!("{workers} workers: simulate's round {simulated:.2} s, loadtest's {node:.2} s");
    if std::env::var_os(BENCH).is_some() {
        assert!((simulated / node - 1.0).abs() <= 0.25, "{apart}: more than 25 % apart");
    }
    let rounds = report["rounds"].as_array().expect("rounds");
    for r in rounds {
        let (on_time, accepted) = (r["on_time"].as_u64().unwrap_or(0), r["accepted"].as_u64().unwrap_or(0));
        assert!(accepted * 100 >= on_time * 95, "round {}: {accepted} of {on_time} on time aggregated", r["round"]);
    }
}

#[test]
#[cfg_attr(debug_assertions, ignore = "minutes of an optimized binary: scripts/test.sh runs the suite in release")]
fn simulate_agrees_with_loadtest_at_100_workers() {
    let _one = serial::serial();
    agree(100);
}

/// A benchmark, not a CI check: minutes of a saturated machine. One build ran
/// rounds of 12.7, 13.1, 15.4 and 17.4 s (the last inside `scripts/test.sh`), and
/// the landed 632749b 14.0 s, against the simulator's 11.4 s.
#[test]
#[ignore = "a timing benchmark of a saturated 2-core machine: bench/calibration.sh runs it"]
fn simulate_agrees_with_loadtest_at_300_workers() {
    let _one = serial::serial();
    agree(300);
}
