//! Untrusted participants against a shepherd process, each attacker a process of
//! its own: a worker that lies about its samples, strangers to an allowlisted run,
//! and identities without a proof of work. (Forty identities on one address are in
//! `sybils_cli.rs`, alone in their binary: they measure round times.) And the
//! attackers' tool, `pcp-node loadtest`, which ends at once when the shepherd it
//! watches dies. One test at a time: the 4,097 hellos' swarms would take the cores
//! another test's rounds need.

use serde_json::Value;

#[path = "support/common.rs"]
mod common;

#[path = "support/serial.rs"]
mod serial;

#[path = "support/runs.rs"]
#[allow(dead_code, reason = "shared with sybils_cli.rs")]
mod runs;
use runs::*;

/// A run of `rounds` rounds of τ=20 with two honest workers and, with `liar`, a
/// third that sends random values claiming 10^12 samples: the final val loss, and
/// the liar's contributions (accepted, reason) from the shepherd's record.
fn liar_run(flags: &[&str], rounds: u64, liar: bool) -> (f64, Vec<(bool, String)>) {
    let dir = tempfile::tempdir().expect("tempdir");
    let workers = if liar { "3" } else { "2" };
    let rounds_flag = rounds.to_string();
    let mut extra = vec!["--rounds", &rounds_flag, "--tau", "20"];
    extra.extend(["--min-workers", workers]);
    extra.extend(flags);
    let (_shepherd, addr, record) = shepherd(dir.path(), &extra);
    let _w1 = worker(dir.path(), "w1", &addr, &[]);
    let _w2 = worker(dir.path(), "w2", &addr, &[]);
    let liar_peer = peer_of(&dir.path().join("liar"));
    let _liar = liar.then(|| worker(dir.path(), "liar", &addr, &["--hostile", "inflate"]));
    let last = completed(&record, rounds);
    let received: Vec<(bool, String)> = events(&record)
        .into_iter()
        .filter(|e| e["event"] == "contribution_received" && e["peer"] == liar_peer.as_str())
        .map(|e| (e["accepted"].as_bool().unwrap_or(true), e["reason"].as_str().unwrap_or_default().to_owned()))
        .collect();
    (last["val_loss"].as_f64().expect("val loss"), received)
}

/// A worker that heartbeats like any other, sends random values and claims 10^12
/// samples, beside two honest workers: the run ends within 3% of the honest run's
/// val loss with sparse pseudo-gradients and the default screen, and within 10% with
/// fp32 and the norm screen alone. Its claim is refused every time, by name.
#[test]
fn a_worker_claiming_a_trillion_samples_is_refused_and_the_run_keeps_its_loss() {
    let _one = serial::serial();
    for (flags, within) in [(&["--encoding", "sparse"][..], 0.03), (&["--screen", "norm"][..], 0.10)] {
        let (honest, _) = liar_run(flags, 6, false);
        let (attacked, liar) = liar_run(flags, 6, true);
        eprintln!("{flags:?}: val loss {attacked:.4} with the liar, {honest:.4} without");
        assert!(!liar.is_empty(), "{flags:?}: the liar sent nothing");
        for (accepted, reason) in &liar {
            assert!(!accepted, "{flags:?}: a claim of 10^12 samples was accepted");
            assert!(reason.contains("claims 1000000000000 samples"), "{flags:?}: {reason}");
        }
        let gap = (attacked - honest) / honest;
        assert!(gap < within, "{flags:?}: val loss {attacked:.4} against {honest:.4} honest ({:+.1}%)", gap * 100.0);
    }
}

/// A run that admits only the keys of its allowlist: a worker on it trains; keys
/// not on it are refused at hello, at a heartbeat and at a contribution, each with a
/// one-line reason.
#[test]
fn an_allowlisted_run_refuses_other_keys_at_hello_and_at_contribution() {
    let _one = serial::serial();
    let dir = tempfile::tempdir().expect("tempdir");
    let identity = pcp_bootstrap::load_or_create(&dir.path().join("w1")).expect("an identity");
    let list = dir.path().join("allowlist.txt");
    std::fs::write(&list, format!("# the run's workers\n{}\n", hex::encode(identity.public().0))).expect("writes");
    let list = list.display().to_string();
    // more rounds than the test lasts: a release build runs 30 rounds of τ=5 in
    // under 25 s, and a shepherd whose run ended answers no stranger
    let (_shepherd, addr, events) =
        shepherd(dir.path(), &["--rounds", "10000", "--tau", "5", "--min-workers", "1", "--admit", "allowlist", &list]);
    let _w1 = worker(dir.path(), "w1", &addr, &[]);
    completed(&events, 1);
    // strangers without a hello are done once answered; those saying hello retry until the timeout
    let loadtest = |name: &str, extra: &[&str]| -> Value {
        let json = dir.path().join(format!("{name}.json"));
        let timeout = if extra.contains(&"--skip-hello") { "120" } else { "8" };
        let mut args = s(&["loadtest", "--shepherd", &addr, "--workers", "2", "--timeout-s", timeout]);
        args.extend(s(extra));
        args.extend(["--json".into(), json.display().to_string()]);
        args.extend(["--data-dir".into(), dir.path().join(name).display().to_string()]);
        Proc::spawn(name, dir.path(), &args).wait();
        serde_json::from_slice(&std::fs::read(&json).expect("the loadtest report")).expect("json")
    };
    let one_line = |reasons: &Value, what: &str, needle: &str| {
        let reasons = reasons.as_object().expect("reasons");
        assert!(!reasons.is_empty(), "no {what} refused");
        for reason in reasons.keys() {
            assert!(reason.contains(needle) && !reason.contains('\n'), "{what}: {reason:?}");
        }
    };
    let hello = loadtest("strangers", &[]);
    assert_eq!(hello["joined"], 0, "{hello}");
    one_line(&hello["refused_hello"], "hello", "is not on the run's allowlist");
    let stranger = loadtest("no-hello", &["--skip-hello"]);
    one_line(&stranger["refused_heartbeat"], "heartbeat", "is not on the run's allowlist");
    // a contribution is refused unread, before its payload (its stream is reset): the
    // shepherd records why, in one line
    assert!(!stranger["refused_contribution"].as_object().expect("reasons").is_empty(), "{stranger}");
    for peer in stranger["peers"].as_array().expect("peers") {
        let peer = peer.as_str().expect("a peer id");
        let refused = wait_for(&events, "a stranger's contribution refused", |e| {
            e["event"] == "message_rejected"
                && e["peer"] == peer
                && e["reason"].as_str().is_some_and(|r| r.contains("contribution"))
        });
        let reason = refused["reason"].as_str().unwrap_or_default();
        assert!(!reason.contains('\n') && reason.contains("contribution from"), "{reason:?}");
    }
    // the listed worker trained on
    let w1 = pcp_bootstrap::keypair(&identity).public().to_peer_id().to_string();
    wait_for(&events, "a contribution of the listed worker", |e| {
        e["event"] == "contribution_received" && e["peer"] == w1.as_str() && e["accepted"] == true
    });
}

/// An open run that asks a proof of work of each identity: a worker solves it and
/// trains; an identity without one is refused at hello, by name.
#[test]
fn an_open_run_asks_each_identity_a_proof_of_work() {
    let _one = serial::serial();
    let dir = tempfile::tempdir().expect("tempdir");
    let (_shepherd, addr, record) =
        shepherd(dir.path(), &["--rounds", "30", "--tau", "5", "--min-workers", "1", "--pow-bits", "16"]);
    let w1 = peer_of(&dir.path().join("w1"));
    let _w1 = worker(dir.path(), "w1", &addr, &[]);
    wait_for(&record, "a contribution of the worker that solved it", |e| {
        e["event"] == "contribution_received" && e["peer"] == w1.as_str() && e["accepted"] == true
    });
    let json = dir.path().join("strangers.json");
    let mut args = s(&["loadtest", "--shepherd", &addr, "--workers", "1", "--timeout-s", "5"]);
    args.extend(["--json".into(), json.display().to_string()]);
    args.extend(["--data-dir".into(), dir.path().join("strangers").display().to_string()]);
    Proc::spawn("strangers", dir.path(), &args).wait();
    let report: Value = serde_json::from_slice(&std::fs::read(&json).expect("the report")).expect("json");
    assert_eq!(report["joined"], 0, "{report}");
    let reasons = report["refused_hello"].as_object().expect("reasons");
    assert!(!reasons.is_empty() && reasons.keys().all(|r| r.contains("the run needs 16")), "{report}");
}

/// One-time hellos, one more than the 4,096 a shepherd keeps, from identities that
/// never heartbeat (`loadtest --leave-after-hello`): when nothing released them, the
/// hello after the 4,096th was refused for good, the honest worker's with it
/// (`hellos.rs`' `one_time_hellos_cannot_lock_newcomers_out` replays that table).
/// Now each is answered with the manifest, the shepherd keeps at most 4,096 hellos,
/// and an honest worker that joins next contributes in the first round it can (a
/// run that waits for one worker opens with it) and the next.
#[test]
#[cfg_attr(
    debug_assertions,
    ignore = "4,097 swarms take minutes in a debug build: scripts/test.sh runs the suite in release"
)]
fn one_time_hellos_do_not_lock_out_the_worker_after_them() {
    let _one = serial::serial();
    let dir = tempfile::tempdir().expect("tempdir");
    let (_shepherd, addr, record) = shepherd(dir.path(), &["--rounds", "3", "--tau", "5", "--min-workers", "1"]);
    let json = dir.path().join("hellos.json");
    let mut args = s(&["loadtest", "--shepherd", &addr, "--workers", "4097", "--leave-after-hello"]);
    args.extend(s(&["--hello-concurrency", "64", "--timeout-s", "600", "--json"]));
    args.extend([json.display().to_string(), "--data-dir".into(), dir.path().join("hellos").display().to_string()]);
    let started = std::time::Instant::now();
    Proc::spawn("hellos", dir.path(), &args).wait();
    let report: Value = serde_json::from_slice(&std::fs::read(&json).expect("the report")).expect("json");
    eprintln!("4,097 one-time hellos in {:.1?}: {report}", started.elapsed());
    assert_eq!(report["admitted"], 4097, "every one-time hello is answered with the manifest: {report}");
    let w1 = peer_of(&dir.path().join("w1"));
    let _w1 = worker(dir.path(), "w1", &addr, &[]);
    for round in 1..=2 {
        let done = completed(&record, round);
        assert!(done["peers"].as_array().is_some_and(|p| p.iter().any(|p| p == w1.as_str())), "round {round}: {done}");
    }
    let held = wait_for(&record, "admission_held", |e| e["event"] == "admission_held" && e["round"] == 2);
    assert!(held["hellos"].as_u64().is_some_and(|h| h <= 4096) && held["live"] == 1, "{held}");
}

/// `loadtest --shepherd-pid` watches the shepherd's process: when the shepherd dies
/// mid-run (a full disk, a crash), the loadtest writes its report and fails at once
/// with one line naming the shepherd, rather than waiting out `--timeout-s`.
#[test]
fn a_loadtest_ends_at_once_when_the_shepherd_dies() {
    let _one = serial::serial();
    let dir = tempfile::tempdir().expect("tempdir");
    let (mut shepherd, addr, events) = shepherd(dir.path(), &["--rounds", "30", "--tau", "5", "--min-workers", "2"]);
    let json = dir.path().join("loadtest.json");
    let mut args = s(&["loadtest", "--shepherd", &addr, "--workers", "2", "--step-ms", "200", "--timeout-s", "600"]);
    args.extend(["--shepherd-pid".into(), shepherd.pid().to_string(), "--json".into(), json.display().to_string()]);
    args.extend(["--data-dir".into(), dir.path().join("synthetic").display().to_string()]);
    let mut loadtest = Proc::spawn("loadtest", dir.path(), &args);
    completed(&events, 1);
    shepherd.kill();
    let killed = std::time::Instant::now();
    let status = loadtest.wait();
    let waited = killed.elapsed();
    let stderr = loadtest.stderr();
    assert!(!status.success(), "the loadtest succeeded without its shepherd: {stderr}");
    assert!(waited < std::time::Duration::from_secs(60), "the loadtest took {waited:?} to notice");
    let line = stderr.lines().find(|l| l.contains("the shepherd (pid")).unwrap_or_default();
    assert!(line.contains(&format!("pid {}) exited", shepherd.pid())), "{stderr}");
    let report: Value = serde_json::from_slice(&std::fs::read(&json).expect("the report")).expect("json");
    assert!(report["rounds"].as_array().is_some_and(|r| !r.is_empty()), "{report}");
}

/// Committees keep pace with a round that arrives at once: 30 synthetic workers
/// that sit on committees (`loadtest --screen-ms 100`: each answers a screen
/// request after 100 ms, computing nothing) against a shepherd with committees of
/// 3, no spot checks (the synthetic losses would be caught) and no probation.
/// From round 2 committees decide contributions, and no contribution of any round
/// is accepted unscreened (`screen_round`'s `skipped`, which counts what the
/// shepherd's spent budget let through).
#[test]
fn committees_of_synthetic_screeners_screen_every_contribution() {
    let _one = serial::serial();
    let dir = tempfile::tempdir().expect("tempdir");
    let flags = [
        "--overlap",
        "--encoding",
        "sparse",
        "--rounds",
        "4",
        "--tau",
        "20",
        "--min-workers",
        "30",
        "--screeners",
        "3",
        "--screen-spot-rate",
        "0",
        "--probation-rounds",
        "0",
    ];
    let (_shepherd, addr, events) = shepherd(dir.path(), &flags);
    let json = dir.path().join("loadtest.json");
    let mut args = s(&["loadtest", "--shepherd", &addr, "--workers", "30", "--rounds", "4", "--step-ms", "20"]);
    args.extend(s(&["--screen-ms", "100", "--payloads", "60", "--timeout-s", "300"]));
    args.extend(["--json".into(), json.display().to_string()]);
    args.extend(["--data-dir".into(), dir.path().join("synthetic").display().to_string()]);
    Proc::spawn("loadtest", dir.path(), &args).wait();
    let report: Value = serde_json::from_slice(&std::fs::read(&json).expect("the loadtest report")).expect("json");
    let rounds = report["rounds"].as_array().expect("rounds");
    let answered: u64 = rounds.iter().filter_map(|r| r["screens"].as_u64()).sum();
    let record = wait_for(&events, "round 4's screen", |e| e["event"] == "screen_round" && e["round"] == 4);
    let all = runs::events(&events);
    let by_committee = all.iter().filter(|e| e["event"] == "screen_decided" && e["source"] == "committee").count();
    // a verdict takes a quorum of its committee, 2 of 3
    assert!(by_committee >= 20 && answered >= 2 * by_committee as u64, "{by_committee} decided, {answered} answered");
    for e in all.iter().filter(|e| e["event"] == "screen_round") {
        assert_eq!(e["skipped"], 0, "{e}");
        assert_eq!(e["over_budget"], 0, "{e}");
    }
    assert!(record["screened"].as_u64().is_some(), "{record}");
}
