//! Parameter-shard aggregators in real nodes (`pcp-node sim --aggregators 2`):
//! every worker volunteers, the shepherd assigns each shard two of them, reads
//! their reports and shard means instead of the contributions, and a hostile
//! aggregator's wrong sum is caught, summed again by the shepherd, and never
//! applied; a wrong report of a slice is settled by the shepherd's own
//! inspection of it, and so is a slice a replica never reports (before, one
//! misreporting or mute aggregator stalled the run).

use std::path::Path;
use std::process::Command;

use serde_json::Value;

#[path = "support/common.rs"]
mod common;
use common::corpus;

/// Runs an aggregated sim of 4 nodes (3 workers) and returns the shepherd's events;
/// no shard is spot-checked unless `extra` says so. Lockstep rounds: overlapping
/// rounds of this model last half a second, and on a loaded machine a worker a
/// round behind sends slices of a round its aggregator no longer sums (the
/// shepherd then reads them) or misses the round, which these tests do not test.
fn sim(dir: &Path, rounds: u32, hostile: &[&str], extra: &[&str]) -> Vec<Value> {
    sim_logged(dir, rounds, hostile, extra).0
}

/// [`sim`], and its log (stderr).
fn sim_logged(dir: &Path, rounds: u32, hostile: &[&str], extra: &[&str]) -> (Vec<Value>, String) {
    let ev = dir.join("events.jsonl");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_pcp-node"));
    cmd.env("PCP_ARTIFACT_CACHE", std::env::temp_dir().join("pcp-test-artifact-cache").join("artifacts"))
        .args(["sim", "--rounds", &rounds.to_string(), "--tau", "10", "--seed", "7"])
        .args(["--aggregators", "2", "--no-overlap", "--data", &corpus()])
        .args(["--events", ev.to_str().expect("utf8"), "--data-dir", dir.to_str().expect("utf8")]);
    for h in hostile {
        cmd.args(["--hostile", h]);
    }
    if !extra.contains(&"--screen") {
        cmd.args(["--screen", "norm"]);
    }
    if !extra.contains(&"--nodes") {
        cmd.args(["--nodes", "4"]);
    }
    if !extra.contains(&"--aggregator-spot-rate") {
        cmd.args(["--aggregator-spot-rate", "0"]);
    }
    cmd.args(extra);
    let out = cmd.output().expect("runs");
    let log = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{log}");
    let events =
        std::fs::read_to_string(&ev).expect("events").lines().map(|l| serde_json::from_str(l).expect("json")).collect();
    (events, log)
}

fn named<'a>(events: &'a [Value], name: &str) -> Vec<&'a Value> {
    events.iter().filter(|e| e["event"] == name).collect()
}

#[test]
fn honest_aggregators_sum_every_round_and_the_shepherd_reads_no_contribution() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (events, log) = sim_logged(dir.path(), 3, &[], &[]);
    honest_rounds(&events, &log);
    assert!(spill_dirs(dir.path()).is_empty(), "1 GiB holds every slice of a small run");
}

/// With no memory for slices not yet accepted, every slice waits on disk until its
/// accept comes, is read back and summed: the same rounds. Two workers that send
/// the same slices (`replay:2:1`) each keep their own on disk: when the files were
/// named by the slice's hash, the first read deleted the other's (4 reads failed
/// in this run, and `loadtest`'s shared payloads failed 51–93 an aggregator).
#[test]
fn aggregators_with_no_memory_for_slices_spill_them_and_sum_the_same() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (events, log) = sim_logged(dir.path(), 3, &[], &["--aggregate-memory", "0"]);
    honest_rounds(&events, &log);
    let replayed = tempfile::tempdir().expect("tempdir");
    let (events, log) = sim_logged(replayed.path(), 3, &["replay:2:1"], &["--aggregate-memory", "0"]);
    assert!(!log.contains("reading the spilled slice"), "a spilled slice was lost:\n{log}");
    assert_eq!(named(&events, "round_completed").len(), 3, "every round closes");
    assert!(named(&events, "shard_aggregated").iter().all(|s| s["recomputed"] == false));
    let spills = spill_dirs(dir.path());
    assert!(!spills.is_empty(), "the aggregators spilled");
    for d in spills {
        // read back once accepted, deleted with their round
        let left: Vec<_> = std::fs::read_dir(&d).expect("readable").collect();
        assert!(left.len() <= 4, "{} holds {} slices: only the last rounds' may wait", d.display(), left.len());
    }
}

/// The aggregators' spill directories under `dir`.
fn spill_dirs(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut found = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let path = entry.path();
            if path.is_dir() {
                if path.file_name().is_some_and(|n| n == "aggregator-spill") {
                    found.push(path.clone());
                }
                stack.push(path);
            }
        }
    }
    found
}

/// Every round of an honest aggregated run: every contribution summed by the
/// aggregators, none read by the shepherd, no shard recomputed.
fn honest_rounds(events: &[Value], log: &str) {
    let rounds = named(events, "round_completed");
    assert_eq!(rounds.len(), 3, "every round closes");
    let rejected = named(events, "contribution_rejected");
    for r in &rounds {
        assert_eq!(r["contributors"], 3, "every worker's contribution is summed: {r}\nrejected: {rejected:?}\n{log}");
        assert_eq!(r["bytes_in"], 0, "the shepherd reads no contribution: {r}");
    }
    assert!(named(events, "aggregator_assigned").len() >= 3, "volunteers are assigned shards");
    let shards = named(events, "shard_aggregated");
    assert_eq!(shards.len(), 6, "two shards a round: {shards:?}");
    assert!(shards.iter().all(|s| s["recomputed"] == false && s["contributions"] == 3), "{shards:?}");
    assert!(named(events, "aggregate_disputed").is_empty());
}

#[test]
fn a_hostile_aggregator_is_caught_its_sum_never_applied_and_the_run_goes_on() {
    for kind in ["agg-alter", "agg-drop", "sleeper:1:agg-stall", "agg-misreport", "sleeper:1:agg-mute"] {
        let dir = tempfile::tempdir().expect("tempdir");
        let events = sim(dir.path(), 4, &[&format!("{kind}:1")], &[]);
        let liar = named(&events, "worker_started")
            .into_iter()
            .find(|e| e["worker"] == 1)
            .and_then(|e| e["peer"].as_str())
            .expect("worker 1 started")
            .to_owned();
        let disputes = named(&events, "aggregate_disputed");
        assert!(!disputes.is_empty(), "{kind}: the liar is caught");
        for d in &disputes {
            assert_eq!(d["liars"], serde_json::json!([liar]), "{kind}: only the liar loses its role: {d}");
        }
        // every shard it lied about was summed by the shepherd, whose hash was applied
        // (a misreporter or a mute one sums honestly: the shepherd inspects the slices
        // it lied about or kept silent on)
        let recomputed: Vec<_> =
            named(&events, "shard_aggregated").into_iter().filter(|s| s["recomputed"] == true).collect();
        let wrong_sums = if kind.contains("agg-misreport") || kind.contains("agg-mute") { 0 } else { disputes.len() };
        assert_eq!(recomputed.len(), wrong_sums, "{kind}: {recomputed:?}");
        // once caught it sums no more, and every round trains all three workers
        let last = disputes.iter().filter_map(|d| d["round"].as_u64()).max().expect("a round");
        let assigned = named(&events, "aggregator_assigned");
        assert!(!assigned.iter().any(|a| a["round"].as_u64() > Some(last) && a["peer"] == liar.as_str()), "{kind}");
        let rounds = named(&events, "round_completed");
        assert_eq!(rounds.len(), 4, "{kind}: every round closes");
        assert!(rounds.iter().all(|r| r["contributors"] == 3), "{kind}: {rounds:?}");
    }
}

#[test]
fn replicas_that_lie_alike_are_caught_by_spot_checks() {
    // every worker signs the same wrong sum (its shard's mean negated), so every
    // shard's replicas agree on it
    let liars = ["agg-alter:1", "agg-alter:2", "agg-alter:3"];
    let dir = tempfile::tempdir().expect("tempdir");
    let unchecked = sim(dir.path(), 2, &liars, &[]);
    assert!(named(&unchecked, "aggregate_disputed").is_empty(), "without spot checks the lie passes");
    let applied = named(&unchecked, "shard_aggregated");
    assert!(!applied.is_empty() && applied.iter().all(|s| s["recomputed"] == false), "{applied:?}");
    let dir = tempfile::tempdir().expect("tempdir");
    let checked = sim(dir.path(), 2, &liars, &["--aggregator-spot-rate", "1"]);
    let disputes = named(&checked, "aggregate_disputed");
    assert!(!disputes.is_empty(), "a spot check catches them");
    let shards = named(&checked, "shard_aggregated");
    assert!(shards.iter().all(|s| s["recomputed"] == true), "only the shepherd's sums are applied: {shards:?}");
    assert!(named(&checked, "round_completed").iter().all(|r| r["contributors"] == 3));
}

/// The score screen in an aggregated run: committees of rated workers screen
/// each contribution from its slices, fetched from its shards' aggregators (the
/// shepherd never holds one whole, and fetches the slices itself only for what
/// it scores: a round's first contributions, before two screeners are
/// committed; round 1, before anyone is rated, is neither aggregated nor
/// screened by committees). A worker sending its Δ reversed after two honest
/// rounds is refused by the screen, the honest ones are summed. A worker that
/// deletes its slices once its aggregators took them (`withhold`) is screened
/// all the same: its aggregators serve them (before, when members fetched from
/// the sender alone, its contributions were refused unscreened).
#[test]
fn committees_screen_aggregated_contributions_from_their_slices() {
    let dir = tempfile::tempdir().expect("tempdir");
    let extra = ["--nodes", "5", "--screen", "score", "--screeners", "3", "--probation-rounds", "0"];
    let hostile = ["sleeper:2:flip:1", "withhold:2"];
    let (events, log) = sim_logged(dir.path(), 4, &hostile, &[extra.as_slice(), &["--screen-spot-rate", "0"]].concat());
    let rounds = named(&events, "round_completed");
    assert_eq!(rounds.len(), 4, "every round closes\n{log}");
    // round 1 has no rated volunteer to aggregate: its contributions come whole
    assert!(rounds.iter().skip(1).all(|r| r["bytes_in"] == 0), "the shepherd reads no contribution: {rounds:?}");
    assert!(rounds.iter().all(|r| r["contributors"].as_u64() >= Some(3)), "{rounds:?}\n{log}");
    let decided = named(&events, "screen_decided");
    let by = |source: &str| decided.iter().filter(|d| d["source"] == source).count();
    assert!(by("committee") >= 2, "committees decide once workers are rated: {decided:?}\n{log}");
    let fetched = decided.iter().filter(|d| d["source"] == "shepherd" && d["round"].as_u64() > Some(1)).count();
    assert!(fetched >= 1, "the shepherd scores an aggregated contribution from its slices: {decided:?}");
    assert!(named(&events, "screen_assigned").len() >= 2);
    let shards = named(&events, "shard_aggregated");
    assert!(!shards.is_empty() && shards.iter().all(|s| s["recomputed"] == false), "{shards:?}");
    let liar = named(&events, "worker_started")
        .iter()
        .find(|e| e["worker"] == 1)
        .and_then(|e| e["peer"].as_str())
        .map(str::to_owned);
    let refused: Vec<_> = decided.iter().filter(|d| d["passed"] == false).collect();
    assert!(refused.iter().any(|d| d["round"].as_u64() > Some(1)), "the reversed Δ is refused: {decided:?}");
    assert!(refused.iter().all(|d| liar.as_deref().is_none_or(|l| d["peer"] == l)), "only the liar: {refused:?}");
    let withholder = named(&events, "worker_started")
        .iter()
        .find(|e| e["worker"] == 2)
        .and_then(|e| e["peer"].as_str())
        .map(str::to_owned)
        .expect("worker 2 started");
    let screened: Vec<_> =
        decided.iter().filter(|d| d["peer"] == withholder.as_str() && d["round"].as_u64() > Some(1)).collect();
    assert!(screened.len() >= 2, "the withholder's slices are screened from its aggregators: {decided:?}\n{log}");
    let unscreened: Vec<_> =
        named(&events, "contribution_rejected").into_iter().filter(|r| r["peer"] == withholder.as_str()).collect();
    assert!(unscreened.is_empty(), "the withholder is not refused unscreened: {unscreened:?}");
}
