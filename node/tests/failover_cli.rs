//! Shepherd failover across processes (issue 28): a standby that starts late, a
//! leader cut off from its workers, and two candidates cut off from each other.
//! The partitions run each node in its own network namespace on one bridge
//! (`support/netns.rs`, root only: without it they print why and pass, unless
//! `PCP_REQUIRE_NETNS=1`, as in `scripts/test.sh`), and cut links by dropping
//! packets while the processes run.

use std::collections::BTreeSet;
use std::time::Duration;

use serde_json::Value;

#[path = "support/chain.rs"]
mod chain;
#[path = "support/cluster.rs"]
#[allow(dead_code, reason = "shared with majority_cli.rs")]
mod cluster;
#[path = "support/common.rs"]
mod common;
#[path = "support/namespaces.rs"]
mod namespaces;
#[path = "support/net.rs"]
mod net;
#[path = "support/netns.rs"]
mod netns;

use chain::{Applied, applied, chain, empty_rounds, hash, one_base_a_round, one_chain, round};
use cluster::{find, now, shepherd_args, t, wait_for, wait_unless};
use net::{LONG, Net, SETUP, serial, workdir};
use netns::Lab;

/// The lab does what the tests below rely on: nodes reach each other, a cut drops
/// what it names and nothing else, and a heal restores it.
#[test]
fn the_lab_cuts_and_heals_links() {
    let Some(lab) = Lab::for_test(3) else { return };
    let sockets: Vec<std::net::UdpSocket> = (1..=3).map(|i| lab.udp(i)).collect();
    for s in &sockets {
        s.set_read_timeout(Some(Duration::from_millis(300))).expect("timeout");
    }
    let reaches = |i: usize, j: usize| {
        let (from, to) = (&sockets[i - 1], &sockets[j - 1]);
        let sent = [i as u8, j as u8, probe_id()];
        from.send_to(&sent, to.local_addr().expect("addr")).expect("send");
        let mut got = [0u8; 3];
        // earlier probes' strays are skipped
        while let Ok((n, _)) = to.recv_from(&mut got) {
            if got[..n] == sent {
                return true;
            }
        }
        false
    };
    let all = |expect: &[(usize, usize, bool)], what: &str| {
        for &(i, j, up) in expect {
            assert_eq!(reaches(i, j), up, "{what}: {i}→{j} should be {}", if up { "up" } else { "cut" });
        }
    };
    all(&[(1, 2, true), (2, 1, true), (1, 3, true), (3, 2, true)], "a new lab");
    lab.cut_one_way(1, 2);
    all(&[(1, 2, false), (2, 1, true), (1, 3, true), (3, 2, true)], "1→2 cut");
    lab.heal(1, 2);
    all(&[(1, 2, true), (2, 1, true)], "healed");
    lab.cut(1, 2);
    all(&[(1, 2, false), (2, 1, false), (1, 3, true), (3, 1, true), (2, 3, true)], "1↔2 cut");
    lab.cut(1, 2); // twice is once
    lab.heal(1, 2);
    all(&[(1, 2, true), (2, 1, true), (1, 3, true)], "healed");
}

/// A byte that tells one probe from the ones before it.
fn probe_id() -> u8 {
    static NEXT: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// The reproduction: a shepherd naming candidate `b` with a 0.5 s lease
/// runs with one worker; once round 3 is done `b` starts as a standby. The run
/// must go on as before: `b` never leads, nobody sees the live shepherd's lease
/// lapse, and the rounds form one chain. Nodes 1 (shepherd), 2 (worker) and 3
/// (`b`) when `net` is a lab.
fn a_late_standby_does_not_stall(net: &Net, lease_ms: &str, before_b: impl FnOnce()) {
    std::fs::create_dir_all(net.data("b")).expect("candidate dir");
    let b_dir = net.data("b");
    let args = shepherd_args(&["--min-workers", "1", "--rounds", "40", "--tau", "10", "--lease-ms", lease_ms]);
    let mut args: Vec<&str> = args.iter().map(String::as_str).collect();
    args.extend(["--candidate", &b_dir]);
    let _a = net.start(1, "a", &args);
    let (_, a_addr) = net.address("a");
    let run = net.run_id("a");
    let _w = net.start(2, "w", &["--bootstrap", &a_addr]);
    net.completed("a", 3, SETUP);

    before_b();
    let _b = net.start(3, "b", &["--candidate", "--run", &run, "--bootstrap", &a_addr]);
    let started = now();
    // while the shepherd lives, b never leads and the worker never gives up on it
    // (from the start: the shepherd lives throughout)
    let wrong = || {
        let of = |who: &'static str, name: &str| find(&net.events(who), name).into_iter().map(move |e| (who, e));
        let mut seen: Vec<(&str, Value)> = of("b", "shepherd_elected").chain(of("a", "stepped_down")).collect();
        seen.extend(of("w", "lease_expired"));
        if seen.is_empty() {
            return None;
        }
        // b's own lapses are not wrong in themselves, but say how it came to lead
        seen.extend(of("b", "lease_expired"));
        seen.sort_by(|x, y| t(&x.1).total_cmp(&t(&y.1)));
        let seen: Vec<String> =
            seen.iter().map(|(who, e)| format!("{who}, {:.1} s after b started: {e}", t(e) - started)).collect();
        Some(format!("the healthy shepherd was given up on:\n{}", seen.join("\n")))
    };
    wait_unless(&net.events("b"), "b to stand by", SETUP, |e| e["event"] == "standby", wrong);
    let standing = find(&net.events("a"), "round_completed").last().map(round).expect("round 3 completed");
    // b is a working standby: it holds the state of a round completed after it started
    wait_unless(
        &net.events("b"),
        "b to replicate a round's state",
        LONG,
        |e| e["event"] == "state_replicated" && e["round"].as_u64().is_some_and(|r| r > standing),
        wrong,
    );
    let more = standing + 4;
    wait_unless(
        &net.events("a"),
        &format!("round {more}"),
        LONG,
        |e| e["event"] == "round_completed" && e["round"].as_u64().is_some_and(|r| r >= more),
        wrong,
    );
    if let Some(wrong) = wrong() {
        panic!("{wrong}");
    }
    // every round once, each from the previous round's result
    let rounds: Vec<u64> = find(&net.events("a"), "round_completed").iter().map(round).collect();
    assert_eq!(rounds, (1..=rounds.len() as u64).collect::<Vec<_>>(), "rounds completed out of order or twice");
    chain(&[("a", net.events("a")), ("b", net.events("b"))]);
}

#[test]
fn a_standby_started_late_does_not_stall_a_healthy_run() {
    let _serial = serial();
    let dir = workdir("pcp-failover-");
    a_late_standby_does_not_stall(&Net { dir: dir.path(), lab: None }, "500", || {});
}

/// As above, with the standby on a 2 Mbit/s downlink, where fetching each round's
/// state (0.9 MB) takes 3.6 s. The leader's leases travel on the same connection,
/// behind those transfers, so the lease is sized for the link (8 s, twice a
/// state's transfer; docs/development.md: a lease shorter than that cannot tell a slow link
/// from a dead leader, as 0.5 s here showed: the standby took terms while the
/// leader lived).
#[test]
fn a_standby_started_late_on_a_slow_link_does_not_stall_a_healthy_run() {
    let _serial = serial();
    let dir = workdir("pcp-failover-");
    let Some(lab) = Lab::for_test(3) else { return };
    a_late_standby_does_not_stall(&Net { dir: dir.path(), lab: Some(&lab) }, "8000", || lab.slow_down(3, "2mbit"));
}

#[test]
fn a_leader_cut_off_from_its_workers_is_replaced() {
    let _serial = serial();
    let dir = workdir("pcp-failover-");
    let Some(lab) = Lab::for_test(4) else { return };
    let net = Net { dir: dir.path(), lab: Some(&lab) };
    let lease = Duration::from_millis(2000);
    // the shepherd's cut-off is noticed and it steps down within this long
    let bound = lease * 5;
    std::fs::create_dir_all(net.data("c")).expect("candidate dir");
    let c_dir = net.data("c");
    let lease_ms = lease.as_millis().to_string();
    let args = shepherd_args(&["--min-workers", "2", "--rounds", "40", "--tau", "10", "--lease-ms", &lease_ms]);
    let mut args: Vec<&str> = args.iter().map(String::as_str).collect();
    args.extend(["--candidate", &c_dir]);
    let _s = net.start(1, "s", &args);
    let (_, s_addr) = net.address("s");
    let run = net.run_id("s");
    let _c = net.start(2, "c", &["--candidate", "--run", &run, "--bootstrap", &s_addr]);
    wait_for(&net.events("c"), "c to stand by", SETUP, |e| e["event"] == "standby");
    // the workers know both candidates from the start: one they never happened to
    // connect to is unreachable once the shepherd, their only seed, is cut off
    let (_, c_addr) = net.address("c");
    let _w3 = net.start(3, "w3", &["--bootstrap", &s_addr, "--bootstrap", &c_addr]);
    let _w4 = net.start(4, "w4", &["--bootstrap", &s_addr, "--bootstrap", &c_addr]);

    net.completed("s", 2, SETUP);
    wait_for(&net.events("c"), "c to hold round 2's state", LONG, |e| {
        e["event"] == "state_replicated" && e["round"].as_u64().is_some_and(|r| r >= 2)
    });
    // the shepherd still reaches the standby, but no worker
    lab.cut(1, 3);
    lab.cut(1, 4);
    let cut_at = now();
    eprintln!("cut the shepherd (node 1) from its workers (nodes 3 and 4)");

    let down =
        wait_for(&net.events("s"), "the cut-off shepherd to step down", bound * 3, |e| e["event"] == "stepped_down");
    eprintln!("stepped down {:.1} s after the cut: {down}", t(&down) - cut_at);
    assert!(t(&down) - cut_at <= bound.as_secs_f64(), "the cut-off shepherd stepped down only after {bound:?}: {down}");
    if let Some(reason) = down.get("reason") {
        assert!(reason.as_str().is_some_and(|r| !r.is_empty()), "an empty reason: {down}");
    }
    let elected = wait_for(&net.events("c"), "the standby to lead", bound * 3, |e| e["event"] == "shepherd_elected");
    eprintln!("the standby led {:.1} s after the cut: {elected}", t(&elected) - cut_at);
    assert!(elected["term"].as_u64().is_some_and(|t| t >= 2), "{elected}");
    let from = round(&elected);
    // its first round has a fresh deadline of at least 10 s; rounds take about 1 s
    net.completed("c", from + 2, Duration::from_secs(60));

    let leaders = [("s", net.events("s")), ("c", net.events("c"))];
    let results = chain(&leaders);
    if from > 0 {
        let (previous, _) = &results[&from];
        assert!(hash(&elected) == *previous, "the successor does not start from round {from}'s result: {elected}");
    }
    // the new leader's rounds were trained by the workers the old one lost
    let workers = [net.address("w3").0, net.address("w4").0];
    let led: Vec<Applied> = applied(&leaders, &workers).into_iter().filter(|a| a.leader == "c").collect();
    assert!(led.iter().filter(|a| a.result.is_some()).count() >= 2, "{led:?}");
}

#[test]
fn cutting_the_link_between_two_candidates_never_gives_two_leaders_whose_rounds_workers_apply() {
    let _serial = serial();
    let dir = workdir("pcp-failover-");
    let Some(lab) = Lab::for_test(4) else { return };
    let net = Net { dir: dir.path(), lab: Some(&lab) };
    std::fs::create_dir_all(net.data("c")).expect("candidate dir");
    let c_dir = net.data("c");
    let lease = Duration::from_millis(2000);
    let lease_ms = lease.as_millis().to_string();
    let args = shepherd_args(&["--min-workers", "2", "--rounds", "40", "--tau", "10", "--lease-ms", &lease_ms]);
    let mut args: Vec<&str> = args.iter().map(String::as_str).collect();
    args.extend(["--candidate", &c_dir]);
    let _s = net.start(1, "s", &args);
    let (_, s_addr) = net.address("s");
    let run = net.run_id("s");
    let _c = net.start(2, "c", &["--candidate", "--run", &run, "--bootstrap", &s_addr]);
    wait_for(&net.events("c"), "c to stand by", SETUP, |e| e["event"] == "standby");
    // the workers know both candidates from the start: one they never happened to
    // connect to is unreachable once the shepherd, their only seed, is cut off
    let (_, c_addr) = net.address("c");
    let _w3 = net.start(3, "w3", &["--bootstrap", &s_addr, "--bootstrap", &c_addr]);
    let _w4 = net.start(4, "w4", &["--bootstrap", &s_addr, "--bootstrap", &c_addr]);
    let workers = [net.address("w3").0, net.address("w4").0];
    let leaders = [("s", net.events("s")), ("c", net.events("c"))];
    let completed_since =
        |since: f64| leaders.iter().flat_map(|(_, p)| find(p, "round_completed")).filter(|e| t(e) > since).count();
    let finished = || ["s", "c", "w3", "w4"].iter().any(|n| !find(&net.events(n), "run_finished").is_empty());

    net.completed("s", 2, SETUP);
    wait_for(&net.events("c"), "c to hold round 2's state", LONG, |e| {
        e["event"] == "state_replicated" && e["round"].as_u64().is_some_and(|r| r >= 2)
    });
    // the candidates lose each other; every worker still reaches both
    lab.cut(1, 2);
    let cut_at = now();
    eprintln!("cut the shepherd (node 1) from the standby (node 2)");
    // long enough for the standby's lease to lapse a few times over, and for rounds
    // to complete, if anyone leads them
    std::thread::sleep(lease * 5);
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while completed_since(cut_at) < 3 && !finished() && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(200));
    }
    eprintln!(
        "while cut ({:.0} s): {} rounds completed; the standby {}",
        now() - cut_at,
        completed_since(cut_at),
        match find(&net.events("c"), "shepherd_elected").first() {
            Some(e) => format!("led term {} from round {}", e["term"], e["round"]),
            None => "did not lead".to_owned(),
        }
    );
    one_chain(&applied(&leaders, &workers), &empty_rounds(&leaders));

    lab.heal(1, 2);
    let healed_at = now();
    eprintln!("healed the link");
    let patience = Duration::from_secs(90);
    let deadline = std::time::Instant::now() + patience;
    while completed_since(healed_at) < 2 && !finished() {
        assert!(
            std::time::Instant::now() < deadline,
            "the run made no progress in {patience:?} after the link healed; the last events:\ns:\n{}\nc:\n{}\nw3:\n{}",
            cluster::last_events(&net.events("s"), 15),
            cluster::last_events(&net.events("c"), 15),
            cluster::last_events(&net.events("w3"), 15),
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let trained = applied(&leaders, &workers);
    one_chain(&trained, &empty_rounds(&leaders));
    one_base_a_round(&["w3", "w4"].map(|w| net.events(w)));
    let by: BTreeSet<&str> = trained.iter().map(|a| a.leader.as_str()).collect();
    eprintln!("workers applied rounds 1..={} led by {by:?}", trained.last().map_or(0, |a| a.round));
}
