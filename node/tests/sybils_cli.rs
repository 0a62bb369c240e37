//! Forty identities on one address against a shepherd process, alone in this test
//! binary (cargo runs a binary's tests in parallel, and this one measures round
//! times): the shepherd and an honest worker each pinned to a core, as on machines
//! of their own, and the attackers (`pcp-node loadtest`) niced on the shepherd's.

use std::time::{Duration, Instant};

use serde_json::Value;

#[path = "support/common.rs"]
mod common;

#[path = "support/process.rs"]
#[allow(dead_code, reason = "shared with the other attack tests")]
mod process;

#[path = "support/runs.rs"]
#[allow(dead_code, reason = "shared with trust_cli.rs")]
mod runs;
use runs::*;

/// The median of `v`.
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Forty identities on one address say hello and heartbeat like workers, then send
/// well-formed contributions of the run's size every round: the shepherd's resident
/// memory grows by less than 256 MiB, rounds keep within 1.5× of their pace before
/// the attack, and the honest worker's contributions are accepted in every round.
#[test]
fn forty_identities_on_one_address_neither_bloat_nor_stall_the_shepherd() {
    const ROUNDS: u64 = 11;
    let dir = tempfile::tempdir().expect("tempdir");
    // the shepherd and the honest worker each on a core of its own, as on machines of their own
    let (shepherd, addr, record) =
        shepherd_on(dir.path(), Some(0), &["--rounds", "11", "--tau", "20", "--min-workers", "1"]);
    let honest_peer = peer_of(&dir.path().join("w1"));
    let _w1 = worker_on(dir.path(), "w1", Some(1), &addr, &[]);
    completed(&record, 4);
    let before_rss = process::memory(shepherd.pid(), "VmRSS:").expect("the shepherd's memory");
    let json = dir.path().join("loadtest.json");
    // the attackers' own compute is theirs, on their machines: here it yields the
    // shepherd's core to it
    let mut attack = Proc::spawn_on(
        "loadtest",
        dir.path(),
        0,
        true,
        &s(&["loadtest", "--shepherd", &addr, "--workers", "40", "--norm", "0.05", "--timeout-s", "280"])
            .into_iter()
            .chain(["--json".into(), json.display().to_string()])
            .chain(["--data-dir".into(), dir.path().join("attackers").display().to_string()])
            .collect::<Vec<_>>(),
    );
    // the shepherd's memory, sampled until the run ends
    let mut peak = before_rss;
    let deadline = Instant::now() + LONG;
    while !events(&record).iter().any(|e| e["event"] == "round_completed" && e["round"] == ROUNDS) {
        assert!(Instant::now() < deadline, "the run did not end");
        if let Ok(rss) = process::memory(shepherd.pid(), "VmRSS:") {
            peak = peak.max(rss);
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    attack.wait();
    let all = events(&record);
    let seconds = |r: u64| {
        all.iter()
            .find(|e| e["event"] == "round_completed" && e["round"] == r)
            .and_then(|e| e["seconds"].as_f64())
            .expect("round seconds")
    };
    // rounds 2 to 4 before the attack (round 1 compiles); from round 6 every attacker
    // takes part: their medians (a round's time on shared cores has outliers)
    let before = median((2..=4).map(seconds).collect());
    let during: Vec<f64> = (6..=ROUNDS).map(seconds).collect();
    let pace = median(during.clone());
    let report: Value = serde_json::from_slice(&std::fs::read(&json).expect("the loadtest report")).expect("json");
    eprintln!(
        "shepherd RSS {} MiB before, {} MiB at most; rounds {before:.2} s before, {during:?} s during; attackers: {report}",
        before_rss >> 20,
        peak >> 20
    );
    let sent: u64 = report["rounds"].as_array().expect("rounds").iter().map(|r| r["sent"].as_u64().unwrap_or(0)).sum();
    assert!(report["joined"].as_u64() == Some(40), "every identity joined: {report}");
    assert!(sent >= 40 * 4, "the attackers sent {sent} contributions");
    assert!(peak - before_rss < 256 << 20, "the shepherd grew by {} MiB", (peak - before_rss) >> 20);
    assert!(pace <= 1.5 * before, "rounds took {pace:.2} s under attack (median), {before:.2} s before");
    for r in 1..=ROUNDS {
        let accepted = all.iter().any(|e| {
            e["event"] == "contribution_received"
                && e["round"] == r
                && e["peer"] == honest_peer.as_str()
                && e["accepted"] == true
        });
        assert!(accepted, "the honest worker's contribution to round {r} was not accepted");
    }
}
