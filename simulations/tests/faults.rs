//! The fault simulator (`pcp-node simulate --faults`) over CI's seeds: every
//! seeded schedule keeps invariants (a) to (f), so do the seeds named for the
//! rules they once broke, and each failover rule the simulated nodes are made to
//! leave out is caught within those seeds.

use clap::Parser;
use pcp_protocol::failover::candidate::Action;
use pcp_protocol::failover::candidate::trace::Trace;
use pcp_simulations::faults::{Invariant, Outcome, Rule, simulate, simulate_traced};
use pcp_simulations::{Error, SimulateArgs};

/// The seeds CI runs.
const SEEDS: u64 = 20_000;

/// Seeds that broke earlier rules (the best-effort candidates, and the old
/// invariant (c)), run by name whatever `SEEDS` is.
const NAMED: [u64; 11] = [19423, 25057, 26732, 28449, 4676, 5030, 21957, 26883, 34139, 2790, 701];

/// Runs seeds `0..SEEDS` without `without`, on every core; the broken ones, by seed.
fn sweep(without: Option<Rule>) -> Vec<Outcome> {
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get()) as u64;
    let mut broken: Vec<Outcome> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                s.spawn(move || {
                    (0..SEEDS)
                        .filter(|seed| seed % threads == t)
                        .map(|seed| simulate(seed, without))
                        .filter(|o| o.violation.is_some())
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles.into_iter().flat_map(|h| h.join().expect("a simulation thread panicked")).collect()
    });
    broken.sort_by_key(|o| o.seed);
    broken
}

/// The first seed (in order) whose schedule breaks an invariant without `rule`.
fn first_caught(rule: Rule) -> Option<Outcome> {
    (0..SEEDS).map(|seed| simulate(seed, Some(rule))).find(|o| o.violation.is_some())
}

/// A report of `broken`: how many broke each invariant, in runs of each size,
/// then each seed (the first 100) with its violation and how to reproduce it.
fn report(broken: &[Outcome], of: usize) -> String {
    let mut counts: std::collections::BTreeMap<(String, usize), usize> = std::collections::BTreeMap::new();
    for o in broken {
        let invariant = o.violation.as_ref().map(|v| v.invariant.to_string()).unwrap_or_default();
        *counts.entry((invariant, o.candidates)).or_default() += 1;
    }
    let mut report = format!("{} of {of} seeds broke an invariant:\n", broken.len());
    for ((invariant, candidates), n) in &counts {
        report.push_str(&format!("  {invariant} with {candidates} candidates: {n}\n"));
    }
    for o in broken.iter().take(100) {
        let v = o.violation.as_ref().map(ToString::to_string).unwrap_or_default();
        report.push_str(&format!(
            "seed {} ({} candidates): {v}\n  reproduce: pcp-node simulate --faults --seed {}\n",
            o.seed, o.candidates, o.seed
        ));
    }
    report
}

#[test]
fn every_seed_keeps_the_invariants() {
    let broken = sweep(None);
    assert!(broken.is_empty(), "{}", report(&broken, SEEDS as usize));
}

#[test]
fn the_named_seeds_keep_the_invariants() {
    let broken: Vec<Outcome> =
        NAMED.iter().map(|seed| simulate(*seed, None)).filter(|o| o.violation.is_some()).collect();
    assert!(broken.is_empty(), "{}", report(&broken, NAMED.len()));
}

/// Each rule of the majority the simulated nodes are made to leave out breaks an
/// invariant within CI's seeds (docs/failover.md, the rules removed):
/// without the up-to-date vote a candidate behind a committed round is elected,
/// and the workers' chains refuse the rounds it redoes, so the run stalls;
/// without the commit term, Raft's figure 8; without the commit, a released
/// round is redone. (The fence, the workers' chain, the
/// lease's gate on deadlines and check-quorum are defence in depth under the
/// majority: no seed of CI's breaks without one of them.)
#[test]
fn each_rule_left_out_is_caught() {
    let expect = [
        (Rule::UpToDate, Invariant::Progress),
        (Rule::CommitTerm, Invariant::ReleasedKept),
        (Rule::Commit, Invariant::ReleasedKept),
    ];
    for (rule, invariant) in expect {
        let caught =
            first_caught(rule).unwrap_or_else(|| panic!("without {rule}: no seed of {SEEDS} broke an invariant"));
        let v = caught.violation.expect("a violation");
        assert_eq!(
            v.invariant, invariant,
            "without {rule}: seed {} broke {} first: {v}\n  reproduce: pcp-node simulate --faults --seed {} --faults-without {rule}",
            caught.seed, v.invariant, caught.seed
        );
    }
}

#[test]
fn a_seed_replays_exactly_and_seeds_differ() {
    let a = simulate(7, None);
    assert_eq!(a, simulate(7, None), "same seed, same run");
    assert_ne!(a.log, simulate(8, None).log);
    assert!(a.violation.is_none() && a.progress_ms.is_some(), "{a:?}");
    assert!(a.log.iter().any(|l| l.contains("nemesis:")), "the nemesis acted: {:#?}", a.log);
}

#[derive(Debug, Parser)]
struct Cli {
    #[command(flatten)]
    args: SimulateArgs,
}

fn args(line: &str) -> SimulateArgs {
    Cli::parse_from(format!("simulate {line}").split_whitespace()).args
}

/// What `pcp-node simulate --faults` prints, and the one-line error naming the
/// broken invariant that makes it exit non-zero.
#[test]
fn the_command_prints_the_run_and_names_a_broken_invariant() {
    let mut out = Vec::new();
    let outcome =
        pcp_simulations::run_faults(&args("--faults --seed 3"), &mut out).expect("seed 3 keeps the invariants");
    let text = String::from_utf8(out).expect("utf-8");
    assert!(text.starts_with("fault simulation, seed 3:"), "{text}");
    assert!(text.contains(" leads term 1 from round 0"), "{text}");
    assert!(text.lines().last().is_some_and(|l| l.starts_with("ok: faults healed at")), "{text}");
    assert_eq!(outcome.seed, 3);

    let commit = first_caught(Rule::Commit).expect("the commit rule is caught");
    let mut out = Vec::new();
    let line = format!("--faults --seed {} --faults-without commit", commit.seed);
    let err =
        pcp_simulations::run_faults(&args(&line), &mut out).expect_err("an invariant breaks without the commit rule");
    assert!(matches!(err, Error::Broken(_)));
    let message = err.to_string();
    assert!(message.starts_with("invariant (c) broken at t="), "{message}");
    assert!(!message.contains('\n'), "one line: {message}");
    let text = String::from_utf8(out).expect("utf-8");
    assert!(text.contains("without the commit rule") && text.ends_with(&format!("{message}\n")), "{text}");
}

/// Every candidate a seeded run started, replayed from its recording (through JSON,
/// as pcp-node writes its own with `PCP_CONSENSUS_TRACE=1`) through a fresh
/// protocol candidate, does exactly what it did: the simulator's candidates are
/// the protocol's, driven only through their inputs.
#[test]
fn recorded_candidates_replay_exactly() {
    for seed in [7, 19423, 701] {
        let (outcome, traces) = simulate_traced(seed);
        assert!(outcome.violation.is_none(), "seed {seed}: {:?}", outcome.violation);
        assert!(traces.len() >= outcome.candidates, "seed {seed}: {} recordings", traces.len());
        for t in &traces {
            let json = serde_json::to_string(t).expect("a trace serializes");
            let back: Trace = serde_json::from_str(&json).expect("a trace parses");
            assert_eq!(&back, t);
            if let Err(e) = back.replay() {
                panic!("seed {seed}: the candidate of {:?} diverged: {e}", t.start.me);
            }
        }
        let commits = traces.iter().flat_map(|t| &t.steps).flat_map(|s| &s.actions);
        let committed = commits.filter(|a| matches!(a, Action::Commit(_))).count();
        assert!(committed >= 1, "seed {seed}: no commit recorded");
    }
}
