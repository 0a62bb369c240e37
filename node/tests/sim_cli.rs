//! `pcp-node sim`: DiLoCo with real training engines on one machine.

use std::path::PathBuf;
use std::process::Command;

use pcp_protocol::failover::candidate::Action;
use pcp_protocol::failover::candidate::trace::{Start, Step, Trace};
use serde_json::Value;

#[path = "support/common.rs"]
mod common;
#[path = "support/serial.rs"]
mod serial;
use common::corpus;

/// `pcp-node` with the artifact cache the tests share.
fn pcp_node() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_pcp-node"));
    cmd.env("PCP_ARTIFACT_CACHE", std::env::temp_dir().join("pcp-test-artifact-cache").join("artifacts"));
    cmd
}

#[test]
fn workers_train_die_and_join() {
    let _serial = serial::serial();
    let dir = tempfile::tempdir().expect("tempdir");
    let ev = dir.path().join("events.jsonl");
    let out = pcp_node()
        .args([
            "sim",
            "--encoding",
            "fp32",
            "--no-overlap",
            "--screeners",
            "0",
            "--nodes",
            "4",
            "--rounds",
            "4",
            "--tau",
            "20",
            "--kill-at",
            "2:2",
            "--join-at",
            "2",
            "--data",
            &corpus(),
        ])
        .args(["--events", ev.to_str().expect("utf8"), "--data-dir", dir.path().to_str().expect("utf8")])
        .output()
        .expect("runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("round contributors"), "{stdout}");
    let events: Vec<Value> =
        std::fs::read_to_string(&ev).expect("events").lines().map(|l| serde_json::from_str(l).expect("json")).collect();
    let two = worker_peer(&events, 2);
    let rounds: Vec<&Value> = events.iter().filter(|e| e["event"] == "round_completed").collect();
    assert_eq!(rounds.len(), 4);
    let contributors: Vec<u64> = rounds.iter().map(|r| r["contributors"].as_u64().expect("n")).collect();
    // Worker 2 dies as round 2 opens: round 2 completes without it, and the worker
    // that starts then (its heartbeats stop the round from closing early) joins in 3.
    assert_eq!(contributors, vec![3, 2, 3, 3], "the joiner of round 2 contributes from round 3");
    assert_eq!(rounds[1]["excluded"], serde_json::json!([two]));
    assert!(events.iter().any(|e| e["event"] == "worker_left" && e["peer"] == two.as_str()));
    assert_eq!(events.iter().filter(|e| e["event"] == "worker_joined").count(), 4);
    let val = |i: usize| rounds[i]["val_loss"].as_f64().expect("val_loss");
    assert!(val(3) < val(0), "validation loss {} -> {}", val(0), val(3));
    // fp32 pseudo-gradients: at most 1.05x the parameter bytes per worker.
    let params_bytes = 4.0 * 110_464.0;
    for r in &rounds {
        let per_worker = r["bytes_in"].as_f64().expect("bytes_in") / r["contributors"].as_f64().expect("n");
        assert!(per_worker <= 1.05 * params_bytes, "{per_worker} bytes per worker");
    }
}

/// Runs `pcp-node sim` with `extra` flags; returns its events.
fn sim(extra: &[&str]) -> Vec<Value> {
    sim_rounds(3, extra)
}

fn sim_rounds(rounds: u64, extra: &[&str]) -> Vec<Value> {
    sim_with_workers(rounds, extra).0
}

/// The peer id of sim worker `n`.
fn worker_peer(events: &[Value], n: u64) -> String {
    events
        .iter()
        .find(|e| e["event"] == "worker_started" && e["worker"] == n)
        .and_then(|e| e["peer"].as_str())
        .expect("worker_started event")
        .to_owned()
}

fn final_val(events: &[Value]) -> f64 {
    let rounds: Vec<&Value> = events.iter().filter(|e| e["event"] == "round_completed").collect();
    rounds.last().and_then(|r| r["val_loss"].as_f64()).expect("a completed round with val_loss")
}

#[test]
fn hostile_workers_are_rejected_or_bounded() {
    let _serial = serial::serial();
    // the norm bound alone (the loss screen would reject the x1000 worker outright)
    let events = sim(&["--nodes", "5", "--hostile", "nan:1", "--hostile", "scale:2", "--screen", "norm"]);
    let rejected: Vec<&Value> = events.iter().filter(|e| e["event"] == "contribution_rejected").collect();
    assert_eq!(rejected.len(), 3, "the NaN worker is rejected every round");
    let one = worker_peer(&events, 1);
    assert!(
        rejected
            .iter()
            .all(|e| e["peer"] == one.as_str() && e["reason"].as_str().is_some_and(|r| r.contains("non-finite"))),
        "{rejected:?}"
    );
    for r in events.iter().filter(|e| e["event"] == "round_completed") {
        assert!(r["clipped"].as_u64().expect("clipped") >= 1, "the x1000 worker is bounded: {r}");
    }
    // each scaled contribution is an event naming its peer, norm and bound
    let two = worker_peer(&events, 2);
    let clipped: Vec<&Value> = events.iter().filter(|e| e["event"] == "contribution_clipped").collect();
    assert!(clipped.iter().filter(|e| e["peer"] == two.as_str()).count() == 3, "{clipped:?}");
    assert!(clipped.iter().all(|e| e["reason"].as_str().is_some_and(|r| r.contains("above the round's bound"))));
    // The same run where worker 2 is honest: bounding leaves it no worse off.
    let honest = final_val(&sim(&["--nodes", "5", "--hostile", "nan:1", "--screen", "norm"]));
    let attacked = final_val(&events);
    assert!(
        attacked.is_finite() && attacked < honest + 0.1,
        "validation loss {attacked} with a x1000 worker vs {honest} without"
    );
}

/// Byzantine workers of typical norm: one sends −Δ, one random values at Δ's norm.
/// The loss screen rejects their contributions (each an event with its reason), never
/// an honest one, and after 6 rounds the run is within 5% of a run of its two honest
/// workers alone.
///
/// Random values raise the held-out loss clearly in the first rounds, where Δ is
/// large, and are always refused there. Later, near a minimum of the held-out batch,
/// they move it by a hair either way: measured over 5 runs on 2 cores (and one in CI), the noise worker
/// was refused in 3 to 6 of 6 rounds (always in rounds 1 and 2), and the final loss
/// was at most 2.8% above the two honest workers' alone.
#[test]
fn sign_flipped_and_noise_contributions_are_screened_out() {
    let _serial = serial::serial();
    let events = sim_rounds(6, &["--nodes", "5", "--hostile", "flip:1", "--hostile", "noise:2"]);
    let (flip, noise) = (worker_peer(&events, 1), worker_peer(&events, 2));
    let rejected: Vec<&Value> = events.iter().filter(|e| e["event"] == "contribution_rejected").collect();
    let count = |peer: &str| rejected.iter().filter(|e| e["peer"] == peer).count();
    assert_eq!(count(&flip), 6, "the sign-flipping worker is rejected every round: {rejected:?}");
    for round in [1, 2] {
        assert!(
            rejected.iter().any(|e| e["peer"] == noise.as_str() && e["round"] == round),
            "the noise worker is rejected in round {round}, where its harm is clear: {rejected:?}"
        );
    }
    assert_eq!(count(&flip) + count(&noise), rejected.len(), "honest contributions pass the screen: {rejected:?}");
    assert!(
        rejected.iter().all(|e| e["reason"].as_str().is_some_and(|r| r.starts_with("no improvement: held-out loss")
            || r.starts_with("too small an improvement")
            || r.starts_with("sitting out"))),
        "{rejected:?}"
    );
    let honest = final_val(&sim_rounds(6, &["--nodes", "3"]));
    let attacked = final_val(&events);
    assert!(
        attacked <= honest * 1.05,
        "validation loss {attacked} with flip and noise workers vs {honest} with the two honest workers alone"
    );
}

/// `--trim`: the coordinate-wise trimmed mean takes every contribution (the norm
/// screen rejects none) and the ×1000 and sign-flipped workers cannot stop the
/// loss from falling; a fraction outside [0, 0.5) is refused by the parser.
#[test]
fn a_trimmed_mean_outvotes_extreme_coordinates() {
    let _serial = serial::serial();
    let events =
        sim(&["--nodes", "5", "--hostile", "scale:1", "--hostile", "flip:2", "--screen", "norm", "--trim", "0.25"]);
    let rounds: Vec<&Value> = events.iter().filter(|e| e["event"] == "round_completed").collect();
    assert_eq!(rounds.len(), 3);
    for r in &rounds {
        assert_eq!(r["contributors"].as_u64(), Some(4), "every contribution is averaged: {r}");
    }
    let val: Vec<f64> = rounds.iter().filter_map(|r| r["val_loss"].as_f64()).collect();
    assert!(val.len() == 3 && val.iter().all(|v| v.is_finite()) && val[val.len() - 1] < val[0], "{val:?}");

    let out = pcp_node().args(["sim", "--trim", "0.5"]).output().expect("runs");
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a fraction from 0 to below 0.5"));
}

/// `pcp-node simulate` counts an exported `.mlir` model from its IR (parameters,
/// tokens per batch, FLOPs of the fused step) and writes its report; bad input is
/// one line and exit code 2.
#[test]
fn simulate_counts_an_exported_model() {
    let _serial = serial::serial();
    let model = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/models/nanogpt_small.mlir");
    if !model.exists() {
        // ../shared is part of every checkout this project runs in; say so loudly if not.
        panic!("{} is missing", model.display());
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let out = pcp_node()
        .args(["simulate", "--nodes", "40", "--rounds", "3", "--tau", "50", "--device", "cpu-2core"])
        .arg("--model")
        .arg(&model)
        .arg("--out")
        .arg(dir.path())
        .output()
        .expect("pcp-node simulate");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // The exported model's 109,377 parameters, counted from its signature.
    assert!(stdout.contains("(109377 params"), "{stdout}");
    assert!(stdout.contains("diloco-star"), "{stdout}");
    let report: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("report.json")).expect("report.json"))
            .expect("report.json parses");
    assert!(report.to_string().contains("nanogpt_small.mlir"), "{report}");

    for (args, needle) in [
        (vec!["simulate", "--model", "/nonexistent.mlir"], "/nonexistent.mlir"),
        (vec!["simulate", "--nodes", "1"], "--nodes must be at least 2"),
    ] {
        let out = pcp_node().args(&args).output().expect("pcp-node simulate");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(needle) && stderr.trim().lines().count() == 1, "{args:?}: {stderr}");
    }
}

#[test]
fn a_candidate_takes_over_a_killed_shepherd_and_the_run_ends_as_without_the_kill() {
    let _serial = serial::serial();
    // three candidates: a majority elects the successor and commits each round
    let flags = ["--nodes", "7", "--candidates", "3"];
    let (killed, traces) = sim_traced(8, &[&flags[..], &["--kill-shepherd-at", "3"]].concat());
    // each candidate's run, as the node recorded it, replays exactly through the
    // protocol's candidate (the type the fault simulator drives)
    assert!(traces.len() >= 3, "{} recordings", traces.len());
    for (path, trace) in &traces {
        if let Err(e) = trace.replay() {
            panic!("{}: the recorded candidate diverged on replay: {e}", path.display());
        }
    }
    let leads = traces.iter().flat_map(|(_, t)| &t.steps).flat_map(|s| &s.actions);
    assert!(leads.filter(|a| matches!(a, Action::Lead { .. })).count() >= 1, "a standby's election is recorded");
    let rounds: Vec<&Value> = killed.iter().filter(|e| e["event"] == "round_completed").collect();
    let numbers: Vec<u64> = rounds.iter().map(|r| r["round"].as_u64().expect("round")).collect();
    assert_eq!(numbers, (1..=8).collect::<Vec<_>>(), "every round completed exactly once");
    let elected: Vec<&Value> = killed.iter().filter(|e| e["event"] == "shepherd_elected").collect();
    assert_eq!(elected.len(), 1, "{elected:?}");
    assert_eq!(elected[0]["term"], 2);
    assert_eq!(elected[0]["round"], 2, "the successor resumes after the last completed round");
    // the chain of parameters continues: round 3 starts from round 2's
    assert_eq!(elected[0]["params_hash"], rounds[1]["params_hash"]);
    for pair in rounds.windows(2) {
        let next = pair[1]["round"].as_u64().expect("round");
        let started =
            killed.iter().rfind(|e| e["event"] == "round_started" && e["round"] == next).expect("the round started");
        assert_eq!(started["params_hash"], pair[0]["params_hash"], "round {next} starts where {} ended", next - 1);
    }
    assert!(killed.iter().any(|e| e["event"] == "lease_expired" && e["term"] == 1));
    let calm = sim_rounds(8, &flags);
    let (a, b) = (final_val(&killed), final_val(&calm));
    assert!((a - b).abs() / b < 0.02, "val loss {a} with the kill, {b} without");
}

/// Bytes a worker sent (`bytes` of each accepted contribution) and fetched (its
/// reported `bytes_down`), per round, from the shepherd's events.
fn traffic(events: &[Value]) -> Vec<(u64, u64, u64)> {
    events
        .iter()
        .filter(|e| e["event"] == "contribution_received" && e["accepted"] == true)
        .map(|e| {
            let n = |k: &str| e[k].as_u64().expect(k);
            (n("round"), n("bytes"), n("bytes_down"))
        })
        .collect()
}

#[test]
fn sparse_runs_send_a_hundredth_and_fetch_a_twentieth_at_the_loss_of_fp32() {
    let _serial = serial::serial();
    let run = |encoding: &str| sim_rounds(6, &["--nodes", "4", "--encoding", encoding]);
    // `sparse:k=2`, the opt-in at 115× fewer bytes (the default k 4 sends 61× fewer)
    let (dense, sparse) = (run("fp32"), run("sparse:k=2"));
    let dense_up = traffic(&dense).iter().map(|t| t.1).max().expect("fp32 contributions");
    let rounds: Vec<&Value> = sparse.iter().filter(|e| e["event"] == "round_completed").collect();
    assert_eq!(rounds.len(), 6);
    let sparse_traffic = traffic(&sparse);
    assert!(sparse_traffic.len() >= 15, "most contributions accepted: {sparse_traffic:?}");
    for (round, up, down) in &sparse_traffic {
        assert!(*up * 100 <= dense_up, "round {round}: {up} bytes up, fp32 sends {dense_up}");
        if *round >= 2 {
            // from the second round on a worker holds the last parameters and fetches the update
            assert!(*down * 20 <= dense_up, "round {round}: {down} bytes down, fp32 parameters are {dense_up}");
        }
    }
    assert!(rounds[1..].iter().all(|r| r["update_bytes"].as_u64().is_some_and(|b| b > 0)));
    // the loss: measured 2.6% behind fp32 after 6 rounds of τ=20 (2.4906 vs 2.4270; it
    // catches up by round 20, see the table in docs/diloco.md); the bound leaves room for the
    // rounds' timing, which decides which contributions make each round
    let (d, s) = (final_val(&dense), final_val(&sparse));
    assert!(s <= d * 1.06, "sparse val loss {s} vs fp32 {d}");
}

/// Runs `pcp-node sim --rounds ROUNDS --tau 20` with `extra` flags and `env` in a
/// new data directory; returns the directory and the shepherd's events.
fn run_sim(rounds: u64, extra: &[&str], env: &[(&str, &str)]) -> (tempfile::TempDir, Vec<Value>) {
    let dir = tempfile::tempdir().expect("tempdir");
    let ev = dir.path().join("events.jsonl");
    let rounds = rounds.to_string();
    let out = pcp_node()
        .envs(env.iter().copied())
        .args(["sim", "--rounds", &rounds, "--tau", "20", "--data", &corpus()])
        // the lockstep fp32 rounds these tests were written for, unless `extra` names its own
        .args(["--no-overlap"])
        .args(if extra.contains(&"--encoding") { &[][..] } else { &["--encoding", "fp32"][..] })
        // the shepherd's own screen, unless `extra` names committees (open runs default to 3)
        .args(if extra.contains(&"--screeners") { &[][..] } else { &["--screeners", "0"][..] })
        .args(extra)
        .args(["--events", ev.to_str().expect("utf8"), "--data-dir", dir.path().to_str().expect("utf8")])
        .output()
        .expect("runs");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let events =
        std::fs::read_to_string(&ev).expect("events").lines().map(|l| serde_json::from_str(l).expect("json")).collect();
    (dir, events)
}

/// Runs `pcp-node sim` with `extra` flags and `PCP_CONSENSUS_TRACE=1`; returns its
/// events and each candidate's recorded run (`<data-dir>/consensus/<run>.trace.jsonl`).
fn sim_traced(rounds: u64, extra: &[&str]) -> (Vec<Value>, Vec<(std::path::PathBuf, Trace)>) {
    let (dir, events) = run_sim(rounds, extra, &[("PCP_CONSENSUS_TRACE", "1")]);
    let mut traces = Vec::new();
    let mut dirs = vec![dir.path().to_path_buf()];
    while let Some(d) = dirs.pop() {
        for entry in std::fs::read_dir(&d).expect("a data directory").flatten() {
            let path = entry.path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.to_string_lossy().ends_with(".trace.jsonl") {
                let text = std::fs::read_to_string(&path).expect("a recording");
                let mut lines = text.lines();
                let head: Value = serde_json::from_str(lines.next().expect("a start line")).expect("json");
                let start: Start = serde_json::from_value(head["start"].clone()).expect("a start");
                let started: Vec<Action> = serde_json::from_value(head["started"].clone()).expect("its actions");
                let steps: Vec<Step> = lines.map(|l| serde_json::from_str(l).expect("a step")).collect();
                traces.push((path, Trace { start, started, steps }));
            }
        }
    }
    (events, traces)
}

/// Runs `pcp-node sim` with `extra` flags; returns the shepherd's events and each
/// worker's (`<data-dir>/sim/worker-N/events.jsonl`), by worker number.
fn sim_with_workers(rounds: u64, extra: &[&str]) -> (Vec<Value>, Vec<Vec<Value>>) {
    let (dir, events) = run_sim(rounds, extra, &[]);
    let read = |path: &std::path::Path| -> Vec<Value> {
        std::fs::read_to_string(path)
            .unwrap_or_default()
            .lines()
            .map(|l| serde_json::from_str(l).expect("json"))
            .collect()
    };
    let workers = (1..=8).map(|n| read(&dir.path().join(format!("sim/worker-{n}/events.jsonl")))).collect();
    (events, workers)
}

#[test]
fn overlapped_workers_train_while_rounds_sync_and_report_utilization() {
    let _serial = serial::serial();
    // sparse k 2, as these overlap tests' bounds were measured with (and as they ran
    // before k 4 became the default; k 4's screen excluded the slow worker more often)
    let (lockstep, _) = sim_with_workers(5, &["--nodes", "4", "--encoding", "sparse:k=2"]);
    let (overlap, workers) = sim_with_workers(5, &["--nodes", "4", "--encoding", "sparse:k=2", "--overlap"]);
    assert!(overlap.iter().any(|e| e["event"] == "run_started" && e["overlap"] == true));
    let rounds: Vec<&Value> = overlap.iter().filter(|e| e["event"] == "round_completed").collect();
    assert_eq!(rounds.len(), 5);
    for r in &rounds {
        let u = r["utilization"].as_f64().unwrap_or_else(|| panic!("round without utilization: {r}"));
        assert!(u > 0.0 && u <= 1.0, "{r}");
    }
    for (n, events) in workers.iter().take(3).enumerate() {
        // each worker merged rounds 2..=5 into steps it had trained ahead
        let merged: Vec<&Value> = events.iter().filter(|e| e["event"] == "update_merged").collect();
        assert_eq!(merged.len(), 4, "worker {}: {merged:?}", n + 1);
        assert!(merged.iter().any(|e| e["after_steps"].as_u64().is_some_and(|d| d > 0)), "{merged:?}");
        let sent: Vec<&Value> = events.iter().filter(|e| e["event"] == "contribution_sent").collect();
        assert_eq!(sent.len(), 5, "worker {}", n + 1);
        assert!(sent.iter().all(|e| e["accepted"] == true && e["utilization"].as_f64().is_some()), "{sent:?}");
    }
    // the rebase costs little loss: measured 2.2–3.7% behind lockstep after 5 rounds of
    // τ=20 on 2 cores, where the shepherd's round takes as long as the workers' and
    // d, the steps trained ahead, is 8–20 of 20; 6.2% once on a loaded machine, where d
    // grows
    let (l, o) = (final_val(&lockstep), final_val(&overlap));
    assert!(o <= l * 1.08, "overlap val loss {o} vs lockstep {l}");
}

#[test]
fn an_overlapped_worker_killed_mid_overlap_rejoins_and_contributes() {
    let _serial = serial::serial();
    let (shepherd, workers) = sim_with_workers(
        10,
        &["--nodes", "4", "--encoding", "sparse:k=2", "--overlap", "--kill-at", "3:1", "--restart-at", "4:1"],
    );
    let rounds: Vec<&Value> = shepherd.iter().filter(|e| e["event"] == "round_completed").collect();
    assert_eq!(rounds.len(), 10, "the run completes");
    assert!(shepherd.iter().any(|e| e["event"] == "worker_restarted" && e["worker"] == 1));
    let victim = worker_peer(&shepherd, 1);
    let with_victim = |r: &&&Value| r["peers"].as_array().expect("peers").iter().any(|p| *p == victim);
    assert!(
        rounds.iter().skip(4).any(|r| with_victim(&r)),
        "the restarted worker contributes to a round after its restart: {rounds:?}"
    );
    // it joined twice, and what it sent after the restart was accepted: all of it but
    // its first send, which comes from a fresh fetch and a full round of steps while
    // the others' rounds take a few hundred milliseconds, so on a loaded machine it
    // may arrive after its round closed (`late`, or refused unread once two newer
    // rounds opened)
    let w1 = &workers[0];
    assert_eq!(w1.iter().filter(|e| e["event"] == "run_joined").count(), 2);
    let after: Vec<&Value> = w1
        .iter()
        .skip_while(|e| e["event"] != "run_joined")
        .skip(1)
        .skip_while(|e| e["event"] != "run_joined")
        .filter(|e| e["event"] == "contribution_sent")
        .collect();
    assert!(after.len() >= 2 && after.iter().skip(1).all(|e| e["accepted"] == true), "{after:?}");
}

#[test]
fn a_slow_worker_in_an_overlapped_run_is_time_boxed_and_carried_not_waited_for() {
    let _serial = serial::serial();
    // worker 3 takes 150 ms longer per inner step: the shepherd's rounds are time-boxed
    // (a budget from the median worker's step time, announced with each round), and
    // what worker 3 sends after its round closed is carried into the next one
    let (shepherd, workers) =
        sim_with_workers(8, &["--nodes", "4", "--encoding", "sparse:k=2", "--overlap", "--slow", "3:150"]);
    let rounds: Vec<&Value> = shepherd.iter().filter(|e| e["event"] == "round_completed").collect();
    assert_eq!(rounds.len(), 8, "the run completes");
    assert!(rounds.iter().skip(1).any(|r| r["budget_ms"].as_u64().is_some_and(|b| b > 0)), "budgets: {rounds:?}");
    let slow = worker_peer(&shepherd, 3);
    let named = |r: &&Value, key: &str| r[key].as_array().is_some_and(|a| a.iter().any(|p| *p == slow));
    let counted = rounds.iter().filter(|r| named(r, "peers") || named(r, "carried")).count();
    assert!(counted >= 4, "the slow worker's compute counts in {counted} of 8 rounds: {rounds:?}");
    // it ran fewer steps than τ when its budget or the median worker's steps ended,
    // or its contribution came a round late and was carried
    let full = 20 * 8 * 256; // τ × the preset's batch × block
    let sent: Vec<&Value> = workers[2].iter().filter(|e| e["event"] == "contribution_sent").collect();
    let boxed = sent.iter().any(|e| e["tokens"].as_u64().is_some_and(|t| t < full));
    let carried = rounds.iter().any(|r| named(r, "carried"));
    assert!(boxed || carried, "neither time-boxed nor carried: {sent:?}");
    // the fast workers never sent anything the shepherd refused
    for w in [0, 1] {
        let refused: Vec<&Value> =
            workers[w].iter().filter(|e| e["event"] == "contribution_sent" && e["accepted"] != true).collect();
        assert!(refused.is_empty(), "worker {}: {refused:?}", w + 1);
    }
}

/// `params_fetched` events of a worker: (round, via, bytes, shards fetched, of).
fn fetches(events: &[Value]) -> Vec<(u64, String, u64, u64, u64)> {
    events
        .iter()
        .filter(|e| e["event"] == "params_fetched")
        .map(|e| {
            let n = |k: &str| e[k].as_u64().unwrap_or_else(|| panic!("{k} in {e}"));
            (n("round"), e["via"].as_str().expect("via").to_owned(), n("bytes"), n("shards"), n("of"))
        })
        .collect()
}

#[test]
fn fragments_sync_a_part_per_round_and_workers_fetch_only_changed_shards() {
    let _serial = serial::serial();
    // DiLoCo: 4 rounds of τ=20; Streaming DiLoCo with 2 fragments: 8 syncs of 10 steps
    let (dense, _) = sim_with_workers(4, &["--nodes", "4"]);
    let (streaming, workers) = sim_with_workers(4, &["--nodes", "4", "--fragments", "2", "--join-at", "6"]);
    let rounds: Vec<&Value> = streaming.iter().filter(|e| e["event"] == "round_completed").collect();
    assert_eq!(rounds.len(), 8, "4 rounds of 2 fragments are 8 syncs");
    // the peak upload per sync falls by about P (the fragments are split by size)
    let peak = |events: &[Value]| {
        events.iter().filter(|e| e["event"] == "contribution_received").filter_map(|e| e["bytes"].as_u64()).max()
    };
    let (d, s) = (peak(&dense).expect("dense"), peak(&streaming).expect("streaming"));
    assert!((s as f64) < 0.6 * d as f64, "peak bytes per sync {s} vs DiLoCo's {d}");
    // workers in the run fetch one shard of two each round; the joiner fetches both
    for (n, events) in workers.iter().take(3).enumerate() {
        let f = fetches(events);
        assert!(f.len() >= 7, "worker {}: {f:?}", n + 1);
        assert_eq!((f[0].1.as_str(), f[0].3, f[0].4), ("shards", 2, 2), "worker {}: {f:?}", n + 1);
        for later in &f[1..] {
            assert_eq!((later.1.as_str(), later.3, later.4), ("shards", 1, 2), "worker {}: {f:?}", n + 1);
            assert!(later.2 < f[0].2, "one shard is smaller than both: {f:?}");
        }
    }
    let joiner = fetches(&workers[3]);
    assert!(!joiner.is_empty(), "the joiner fetched");
    assert_eq!((joiner[0].1.as_str(), joiner[0].3, joiner[0].4), ("shards", 2, 2), "{joiner:?}");
    // the loss of the same rounds of τ steps stays within 3% of DiLoCo's
    let (l, f) = (final_val(&dense), final_val(&streaming));
    assert!(f <= l * 1.03, "fragments val loss {f} vs DiLoCo {l}");
}

/// Screening by committees (`--screeners 3`), with a lying screener of each
/// kind and a worker sending noise: every liar whose lie a committee counted is
/// caught (`screener_caught`) and no honest screener is; some verdicts are the
/// committees' own; and honest contributions are accepted in every round.
///
/// The noise is refused in round 1, where it raises the loss, and in most of its
/// rounds, and it never leaves probation: whenever it passes, it is averaged in
/// at the probation weight. It does pass now and then: the screen scores a
/// contribution at its best step, and on this model's sparse updates random
/// values that happen to point downhill lower the held-out batch by 3–21% of
/// the last round's median gain in a round or two of 8, as weak honest
/// contributions late in a run do (`docs/threat-model.md`, "A direction, not a
/// size"). Over seven runs of this test here the noise passed in 0–2 rounds of 8,
/// always on probation.
#[test]
fn lying_screeners_are_caught_and_honest_contributions_still_pass() {
    let _serial = serial::serial();
    let dir = tempfile::tempdir().expect("tempdir");
    let ev = dir.path().join("events.jsonl");
    let out = pcp_node()
        .args(["sim", "--nodes", "8", "--rounds", "8", "--tau", "20", "--seed", "1337", "--screeners", "3"])
        .args(["--hostile", "screen-high:5", "--hostile", "screen-low:6", "--hostile", "noise:7"])
        .args(["--data", &corpus(), "--events", ev.to_str().expect("utf8")])
        .args(["--data-dir", dir.path().to_str().expect("utf8")])
        .output()
        .expect("runs");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let events: Vec<Value> =
        std::fs::read_to_string(&ev).expect("events").lines().map(|l| serde_json::from_str(l).expect("json")).collect();
    fn of<'a>(events: &'a [Value], name: &'static str) -> impl Iterator<Item = &'a Value> {
        events.iter().filter(move |e| e["event"] == name)
    }
    let (high, low, noise) = (worker_peer(&events, 5), worker_peer(&events, 6), worker_peer(&events, 7));
    let caught: std::collections::BTreeSet<&str> =
        of(&events, "screener_caught").filter_map(|e| e["screener"].as_str()).collect();
    // a lie is the truth's `before` with `after` 0.5 away: counted reports of one
    let lied: std::collections::BTreeSet<&str> = of(&events, "screen_reported")
        .filter(|e| {
            let (b, a) = (e["before"].as_f64().unwrap_or(0.0), e["after"].as_f64().unwrap_or(0.0));
            ((a - b).abs() - 0.5).abs() < 1e-3
        })
        .filter_map(|e| e["screener"].as_str())
        .collect();
    assert!(!lied.is_empty(), "no liar ever screened: {:?}", of(&events, "screen_assigned").collect::<Vec<_>>());
    assert!(lied.iter().all(|l| *l == high || *l == low), "only the liars lie: {lied:?}");
    assert_eq!(lied, caught, "every liar that screened is caught, and nobody else");
    let decided: Vec<&Value> = of(&events, "screen_decided").collect();
    assert!(decided.iter().any(|e| e["source"] == "committee"), "committees decide: {decided:?}");
    let noisy: Vec<&Value> = of(&events, "contribution_received").filter(|e| e["peer"] == noise.as_str()).collect();
    let passed: Vec<&Value> = noisy.iter().copied().filter(|e| e["accepted"] == true).collect();
    assert!(
        noisy.iter().any(|e| e["round"] == 1 && e["accepted"] == false),
        "the noise is refused in round 1: {noisy:?}"
    );
    assert!(2 * passed.len() < noisy.len(), "the noise is refused in most of its rounds: {noisy:?}");
    for e in passed {
        let discounted = of(&events, "contribution_discounted")
            .any(|d| d["peer"] == e["peer"] && d["round"] == e["round"] && d["reason"] == "probation");
        assert!(discounted, "noise that passes is averaged in at the probation weight: {e}");
    }
    let honest = |e: &&Value| e["peer"] != high.as_str() && e["peer"] != low.as_str() && e["peer"] != noise.as_str();
    for round in 1..=8 {
        assert!(
            of(&events, "contribution_received").filter(honest).any(|e| e["round"] == round && e["accepted"] == true),
            "round {round} accepted no honest contribution"
        );
    }
}
