//! Shepherd failover with three coordinator candidates across processes: the
//! shepherd `s` (node 1) and the standbys `c1` and `c2` (nodes 2 and 3), three
//! workers (nodes 4–6), each node in its own network namespace of one lab
//! (`support/netns.rs`, root only: without it the tests print why and pass, unless
//! `PCP_REQUIRE_NETNS=1`). Once rounds run and both standbys hold a round's state,
//! each test does one thing to the leader for a few leases and undoes it:
//!
//! * a one-way cut: nothing the leader sends arrives, what others send it does;
//! * a pause: `SIGSTOP`, then `SIGCONT`;
//! * a partition into {leader, one worker} and {both standbys, the other workers}.
//!
//! Then the rounds workers trained must form one chain (each round from one set of
//! parameters, the result of the round before it), whoever led them, and rounds
//! must resume after the heal. One test does the cut under a heartbeat flood:
//! `pcp-node loadtest --flood` in [`FLOOD_ADDRESSES`] more namespaces, [`FLOOD_KEYS`]
//! fresh keys in all (never admitted) heartbeating all three candidates and
//! gossiping on the run's topic from before the workers join to the end. (From one
//! address a node takes 64 connections at most: the keys are spread over several.) `bench/majority_lab.sh` runs this file N times with
//! both cores kept busy.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::Value;

#[path = "support/chain.rs"]
#[allow(dead_code, reason = "shared with failover_cli.rs")]
mod chain;
#[path = "support/cluster.rs"]
#[allow(dead_code, reason = "shared with the other multi-process tests")]
mod cluster;
#[path = "support/common.rs"]
mod common;
#[path = "support/namespaces.rs"]
mod namespaces;
#[path = "support/net.rs"]
mod net;
#[path = "support/netns.rs"]
#[allow(dead_code, reason = "shared with failover_cli.rs")]
mod netns;

use chain::{applied, empty_rounds, hash, one_base_a_round, one_chain, round, short};
use cluster::{Proc, events, find, last_events, now, shepherd_args, t, wait_for};
use net::{LONG, Net, SETUP, serial, workdir};
use netns::Lab;

/// The leader's lease (`--lease-ms`): as in `failover_cli.rs`, long enough that
/// two busy cores do not make a healthy leader look dead.
const LEASE: Duration = Duration::from_millis(2000);

/// How long after the heal two rounds that workers trained must have completed.
/// After a heal the deposed side hears the higher term within a lease (leases go
/// out every third of one) and steps down; a term whose candidate cannot lead
/// lapses in one lease more (two at most: 4 s); a new leader's first round has a
/// deadline of at least 10 s; each round (τ = 10) takes 1–5 s on two busy cores,
/// and its commit waits for the standbys at most 4 leases (8 s). Two rounds: about
/// 4 + 2 × (10 + 8) = 40 s at worst; 90 s is twice that.
const PATIENCE: Duration = Duration::from_secs(90);

/// The candidates, nodes 1, 2 and 3 (`s` leads first).
const CANDIDATES: [&str; 3] = ["s", "c1", "c2"];
/// The workers, nodes 4, 5 and 6.
const WORKERS: [&str; 3] = ["w4", "w5", "w6"];
/// Nodes in the lab.
const NODES: usize = CANDIDATES.len() + WORKERS.len();
/// The flood's addresses: namespaces after the nodes'.
const FLOOD_ADDRESSES: usize = 4;
/// Fresh keys in the flood, in all.
const FLOOD_KEYS: usize = 200;

/// Node `name`'s number in the lab.
fn node(name: &str) -> usize {
    1 + CANDIDATES.iter().chain(&WORKERS).position(|n| *n == name).unwrap_or_else(|| panic!("no node {name}"))
}

/// A run with three candidates and three workers in a lab, round 2 completed and
/// held by both standbys. Its processes are killed when it is dropped (before the
/// lab that it borrows).
struct Cluster<'a> {
    net: Net<'a>,
    lab: &'a Lab,
    /// Node `i`'s process is `procs[i - 1]`.
    procs: Vec<Proc>,
    /// The workers' peer ids.
    workers: Vec<String>,
    /// The flood's processes, one per address.
    flood: Vec<Proc>,
}

impl<'a> Cluster<'a> {
    /// Starts `s`, then `c1` and `c2` once each stands by, then (with `flood`) the
    /// flood on all three, then the workers, and waits until round 2 is complete
    /// and both standbys hold its state.
    fn start(lab: &'a Lab, dir: &'a Path, flood: bool) -> Self {
        let net = Net { dir, lab: Some(lab) };
        let started = now();
        let dirs = ["c1", "c2"].map(|c| net.data(c));
        for d in &dirs {
            std::fs::create_dir_all(d).expect("candidate dir");
        }
        let (lease_ms, min) = (LEASE.as_millis().to_string(), WORKERS.len().to_string());
        // more rounds than any test lasts: the run never finishes under it
        let mut args =
            shepherd_args(&["--min-workers", &min, "--rounds", "1000", "--tau", "10", "--lease-ms", &lease_ms]);
        for d in &dirs {
            args.extend(["--candidate".to_owned(), d.clone()]);
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let mut procs = vec![net.start(node("s"), "s", &args)];
        let (_, s_addr) = net.address("s");
        let run = net.run_id("s");
        // each standby knows the ones before it: the candidates reach each other
        // without the shepherd
        let mut seeds = vec![s_addr];
        for c in ["c1", "c2"] {
            let mut args = vec!["--candidate", "--run", &run];
            args.extend(seeds.iter().flat_map(|a| ["--bootstrap", a.as_str()]));
            let p = net.start(node(c), c, &args);
            wait_for(&net.events(c), &format!("{c} to stand by"), SETUP, |e| e["event"] == "standby");
            procs.push(p);
            seeds.push(net.address(c).1);
        }
        let floods = 1..=if flood { FLOOD_ADDRESSES } else { 0 };
        let flood = floods
            .map(|f| {
                let mut args = ["loadtest", "--shepherd", &seeds[0], "--flood", &run].map(str::to_owned).to_vec();
                args.extend(seeds[1..].iter().flat_map(|a| ["--flood-at".to_owned(), a.clone()]));
                let (keys, seed) = ((FLOOD_KEYS / FLOOD_ADDRESSES).to_string(), f.to_string());
                args.extend(["--workers", &keys, "--seed", &seed, "--timeout-s", "3600"].map(str::to_owned));
                args.extend(["--data-dir".to_owned(), net.data(&format!("flood{f}"))]);
                let log = dir.join(format!("flood{f}.log"));
                Proc::spawn(&format!("flood{f}"), lab.cmd(NODES + f, cluster::pcp_node()), &args, &log)
            })
            .collect();
        // the workers know every candidate from the start: one they never happened
        // to connect to is unreachable once the shepherd, their seed, is cut off
        let args: Vec<&str> = seeds.iter().flat_map(|a| ["--bootstrap", a.as_str()]).collect();
        for w in WORKERS {
            procs.push(net.start(node(w), w, &args));
        }
        let workers = WORKERS.iter().map(|w| net.address(w).0).collect();
        net.completed("s", 2, SETUP);
        for c in ["c1", "c2"] {
            wait_for(&net.events(c), &format!("{c} to hold round 2's state"), LONG, |e| {
                e["event"] == "state_replicated" && e["round"].as_u64().is_some_and(|r| r >= 2)
            });
        }
        eprintln!("the cluster ran round 2, held by both standbys, {:.1} s after it started", now() - started);
        Self { net, lab, procs, workers, flood }
    }

    /// Each flood process's last line of counts (see `pcp-node loadtest --flood`):
    /// each must have had heartbeats answered and gossip published.
    fn flood_counts(&self) -> Vec<String> {
        (1..=self.flood.len())
            .map(|f| {
                let out = std::fs::read_to_string(self.net.dir.join(format!("flood{f}.out"))).unwrap_or_default();
                let line = out.lines().rev().find(|l| l.starts_with("flood:")).map(str::to_owned);
                let line = line.unwrap_or_else(|| panic!("flood{f} printed no counts"));
                let count = |what: &str| -> u64 {
                    let at = line.find(what).unwrap_or_else(|| panic!("no {what:?} in {line:?}")) + what.len();
                    line[at..].split(|c: char| !c.is_ascii_digit()).next().and_then(|n| n.parse().ok()).unwrap_or(0)
                };
                assert!(count("answered ") > 0, "no heartbeat of flood{f} was answered: {line}");
                assert!(count("gossip published ") > 0, "flood{f} published no gossip: {line}");
                format!("flood{f} {line}")
            })
            .collect()
    }

    /// The candidates' names and event files.
    fn leaders(&self) -> Vec<(&'static str, std::path::PathBuf)> {
        CANDIDATES.iter().map(|c| (*c, self.net.events(c))).collect()
    }

    /// Sends `signal` (`STOP`, `CONT`) to node `name`.
    fn signal(&self, name: &str, signal: &str) {
        let pid = self.procs[node(name) - 1].pid().to_string();
        let status = Command::new("kill").args([&format!("-{signal}"), &pid]).status().expect("kill runs");
        assert!(status.success(), "kill -{signal} {pid} ({name}): {status}");
    }

    /// Panics unless `s` still leads: no standby took a term, and `s` never
    /// stepped down (the faults below are the leader's).
    fn s_leads(&self) {
        let mut wrong: Vec<Value> = find(&self.net.events("s"), "stepped_down");
        for c in ["c1", "c2"] {
            wrong.extend(find(&self.net.events(c), "shepherd_elected"));
        }
        assert!(wrong.is_empty(), "the healthy shepherd was replaced before any fault: {wrong:?}");
    }

    /// The rounds that workers trained and whose leader completed them after
    /// `since`: (round, leader).
    fn trained_since(&self, since: f64) -> BTreeSet<(u64, String)> {
        let trained = applied(&self.leaders(), &self.workers);
        let mut out = BTreeSet::new();
        for (name, path) in self.leaders() {
            for e in find(&path, "round_completed").iter().filter(|e| t(e) > since) {
                let (r, h) = (round(e), hash(e));
                if trained.iter().any(|a| a.leader == name && a.round == r && a.result.as_deref() == Some(&h)) {
                    out.insert((r, name.to_owned()));
                }
            }
        }
        out
    }

    /// What the candidates did about leadership and rounds after `since`, and what
    /// the workers followed, heard and sent, in order, timed from `since`.
    fn timeline(&self, since: f64) -> String {
        const SHOWN: [&str; 11] = [
            "shepherd_elected",
            "round_started",
            "leader_followed",
            "round_announced",
            "contribution_sent",
            "stepped_down",
            "deferred",
            "lease_expired",
            "commit_timed_out",
            "round_completed",
            "round_refused",
        ];
        let mut seen: Vec<(f64, String)> = Vec::new();
        for name in CANDIDATES.iter().chain(&WORKERS) {
            for e in events(&self.net.events(name)) {
                let kind = e["event"].as_str().unwrap_or_default();
                if t(&e) < since || !SHOWN.contains(&kind) || (WORKERS.contains(name) && kind == "round_completed") {
                    continue;
                }
                let mut what = format!("{name} {kind}");
                for key in ["term", "round", "newer", "reason", "to", "their_round", "accepted"] {
                    if let Some(v) = e.get(key).filter(|v| !v.is_null()) {
                        what.push_str(&format!(" {key}={v}"));
                    }
                }
                if let Some(h) = e["params_hash"].as_str() {
                    what.push_str(&format!(" params={}", short(h)));
                }
                seen.push((t(&e) - since, what));
            }
        }
        seen.sort_by(|a, b| a.0.total_cmp(&b.0));
        seen.iter().map(|(dt, what)| format!("  {dt:+7.1} s  {what}")).collect::<Vec<_>>().join("\n")
    }

    /// Panics unless the rounds workers trained form one chain (whoever led them)
    /// and no worker trained a round from two sets of parameters; `when` says at
    /// which point of the test, and the timeline from `since` is printed first.
    fn one_chain(&self, when: &str, since: f64) {
        eprintln!("{when}: the leaders and workers since the fault:\n{}", self.timeline(since));
        one_chain(&applied(&self.leaders(), &self.workers), &empty_rounds(&self.leaders()));
        one_base_a_round(&WORKERS.map(|w| self.net.events(w)));
    }
}

/// The leader `s` of a running cluster is hit by `fault` for `hold`, which `heal`
/// then undoes: the rounds workers trained form one chain while it lasts and after,
/// and two rounds that workers trained complete within [`PATIENCE`] of the heal.
/// With `flood`, all of it under the flood.
fn the_run_survives(
    what: &str,
    hold: Duration,
    flood: bool,
    fault: impl FnOnce(&Cluster),
    heal: impl FnOnce(&Cluster),
) {
    let _serial = serial();
    let dir = workdir("pcp-majority-");
    let Some(lab) = Lab::for_test(NODES + FLOOD_ADDRESSES) else { return };
    let cluster = Cluster::start(&lab, dir.path(), flood);
    cluster.s_leads();
    let before = find(&cluster.net.events("s"), "round_completed").last().map(round).expect("round 2 completed");

    fault(&cluster);
    let fault_at = now();
    eprintln!("{what} after round {before}, for {hold:?}");
    std::thread::sleep(hold);
    let during = cluster.trained_since(fault_at);
    let elected: Vec<String> = ["c1", "c2"]
        .iter()
        .flat_map(|c| find(&cluster.net.events(c), "shepherd_elected").into_iter().map(move |e| (c, e)))
        .map(|(c, e)| {
            format!("{c} led term {} from round {} {:.1} s after the fault", e["term"], e["round"], t(&e) - fault_at)
        })
        .collect();
    eprintln!("while it lasted: workers trained rounds {during:?}; {elected:?}");
    cluster.one_chain("before the heal", fault_at);

    heal(&cluster);
    let healed_at = now();
    eprintln!("healed {:.1} s after the fault", healed_at - fault_at);
    let deadline = Instant::now() + PATIENCE;
    let mut resumed = Vec::new();
    loop {
        let done = cluster.trained_since(healed_at);
        while resumed.len() < done.len().min(2) {
            resumed.push(now() - healed_at);
        }
        if done.len() >= 2 {
            break;
        }
        if Instant::now() >= deadline {
            let last: Vec<String> = CANDIDATES
                .iter()
                .chain(&WORKERS)
                .map(|n| format!("{n}:\n{}", last_events(&cluster.net.events(n), 16)))
                .collect();
            panic!(
                "{} rounds that workers trained completed in {PATIENCE:?} after the heal ({done:?}); since the fault:\n{}\nthe last events:\n{}",
                done.len(),
                cluster.timeline(fault_at),
                last.join("\n"),
            );
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    eprintln!(
        "after the heal, the first round workers trained completed in {:.1} s, the second in {:.1} s",
        resumed[0], resumed[1]
    );
    cluster.one_chain("at the end", fault_at);
    let trained = applied(&cluster.leaders(), &cluster.workers);
    let by: BTreeSet<&str> = trained.iter().map(|a| a.leader.as_str()).collect();
    eprintln!(
        "workers trained rounds 1..={} led by {by:?}; the test took {:.0} s from the fault",
        trained.last().map_or(0, |a| a.round),
        now() - fault_at
    );
    for line in cluster.flood_counts() {
        eprintln!("{line}");
    }
}

#[test]
fn a_leader_whose_packets_are_all_dropped_for_five_leases_is_replaced_without_a_fork() {
    the_run_survives(
        "cut everything s sends (one way)",
        LEASE * 5,
        false,
        |c| (2..=NODES).for_each(|j| c.lab.cut_one_way(node("s"), j)),
        |c| (2..=NODES).for_each(|j| c.lab.heal(node("s"), j)),
    );
}

#[test]
fn a_leader_paused_for_three_leases_wakes_without_a_fork() {
    the_run_survives("SIGSTOP s", LEASE * 3, false, |c| c.signal("s", "STOP"), |c| c.signal("s", "CONT"));
}

/// {s, w4} | {c1, c2, w5, w6}: the leader keeps one worker, the standbys the rest.
#[test]
fn a_partition_of_the_leader_and_one_worker_from_the_rest_never_forks_the_run() {
    let (small, large) = ([node("s"), node("w4")], [node("c1"), node("c2"), node("w5"), node("w6")]);
    let pairs = move || small.into_iter().flat_map(move |a| large.into_iter().map(move |b| (a, b)));
    the_run_survives(
        "partition {s, w4} | {c1, c2, w5, w6}",
        LEASE * 6,
        false,
        |c| pairs().for_each(|(a, b)| c.lab.cut(a, b)),
        |c| pairs().for_each(|(a, b)| c.lab.heal(a, b)),
    );
}

/// The one-way cut while [`FLOOD_KEYS`] fresh keys heartbeat the three candidates
/// and gossip on the run's topic: the flood costs the healthy leader no lease (it
/// still leads at the fault), and the failover and the heal go as without it.
/// Before the run's gossip was its candidates' alone, every node forwarded the
/// fresh keys' gossip, and the healthy leader's lease lapsed within seconds of the
/// flood's start. Ten nodes' worth of processes in a debug build outrun two cores:
/// it runs in an optimized build (`scripts/test.sh` runs the suite in release).
#[test]
#[cfg_attr(
    debug_assertions,
    ignore = "the flood's processes outrun two cores in a debug build: scripts/test.sh runs the suite in release"
)]
fn a_leader_cut_off_under_a_heartbeat_flood_is_replaced_without_a_fork() {
    the_run_survives(
        "cut everything s sends (one way), under a flood",
        LEASE * 5,
        true,
        |c| (2..=NODES).for_each(|j| c.lab.cut_one_way(node("s"), j)),
        |c| (2..=NODES).for_each(|j| c.lab.heal(node("s"), j)),
    );
}
