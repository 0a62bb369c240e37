//! The simulator as the node is built: calibrated (so reproducible), with the
//! shepherd's caps, and utilization that is a fraction of wall time.

use clap::Parser;
use pcp_simulations::{Report, SimulateArgs, run, to_json};

#[derive(Debug, Parser)]
struct Cli {
    #[command(flatten)]
    args: SimulateArgs,
}

fn args(extra: &str) -> SimulateArgs {
    Cli::parse_from(format!("simulate {extra}").split_whitespace()).args
}

fn simulate(extra: &str) -> (Report, String) {
    let mut table = Vec::new();
    let report = run(&args(extra), &mut table).expect("runs");
    (report, String::from_utf8(table).expect("utf-8"))
}

/// Acceptance: the planet's default run, twice, gives the same bytes (its costs
/// come from the calibration file; nothing is measured at start-up).
#[test]
fn ten_thousand_nodes_twice_give_the_same_report() {
    let line = "--nodes 10000 --rounds 100 --seed 7";
    let (a, table_a) = simulate(line);
    let (b, table_b) = simulate(line);
    assert_eq!(to_json(&a).expect("json"), to_json(&b).expect("json"));
    assert_eq!(table_a, table_b);
    assert!(a.settings.decode.source.contains("calibration table"), "{:?}", a.settings.decode);
    assert_eq!(a.settings.shepherd_cpu.threads, 2, "the calibration machine's cores");
}

/// Utilization is compute over participants × wall time, steady and overall, and
/// never passes 1: with overlap (steps before a round opens), sparse, fragments,
/// churn and the screen.
#[test]
fn utilization_is_a_fraction_of_wall_time() {
    let planet = "--model gpt2-124m --profile residential --device h100 --tau 500 --encoding sparse";
    let configs = [
        format!("--nodes 60 --rounds 12 {planet} --screen norm --overhead-seconds 0 --lockstep --seed 1"),
        format!("--nodes 60 --rounds 12 {planet} --screen norm --overhead-seconds 0 --overlap --seed 2"),
        format!("--nodes 60 --rounds 12 {planet} --overlap --seed 3"),
        format!("--nodes 40 --rounds 12 {planet} --overlap --fragments 4 --screen norm --seed 4"),
        format!("--nodes 60 --rounds 12 {planet} --overlap --churn-per-hour 6 --hostile 0.1 --screen norm --seed 5"),
        "--nodes 30 --rounds 8 --model nanogpt-small --tau 50 --step-seconds 0.01 --encoding fp32 --lockstep --seed 6"
            .to_owned(),
    ];
    for line in &configs {
        let (r, _) = simulate(line);
        let s = &r.strategies[0];
        let m = &s.summary;
        for u in [m.utilization, m.steady_utilization] {
            assert!((0.0..=1.0).contains(&u), "{line}: {m:?}");
        }
        // goodput counts tokens, not seconds: ± the steps' jitter of 1
        for g in [m.goodput, m.steady_goodput] {
            assert!(g.is_some_and(|g| (0.0..=1.05).contains(&g)), "{line}: {m:?}");
        }
        for round in &s.rounds {
            assert!((0.0..=1.0).contains(&round.utilization), "{line}: {round:?}");
        }
        // the overall figure is the rounds' compute over their participant-seconds
        let (c, t) = s.rounds.iter().fold((0.0, 0.0), |(c, t), r| {
            let p = r.participants as f64 * r.wall_s;
            (c + r.utilization * p, t + p)
        });
        assert!((m.utilization - c / t).abs() < 1e-9, "{line}: {m:?}");
        assert_eq!(m.steady_from_round, 3.max(1 + s.rounds.len() as u64 / 10), "{line}");
    }
    // overlapped rounds with a free shepherd keep workers busy in steady state, not in round 1
    let (r, table) = simulate(&configs[1]);
    let m = &r.strategies[0].summary;
    assert!(m.steady_utilization > 0.85 && m.utilization < m.steady_utilization, "{m:?}");
    assert!(table.contains("steady"), "{table}");
}

/// The score screen costs two forward passes a screened contribution on the
/// shepherd's CPU: with gpt2-124m on 2 cores it dominates the round, and past the
/// budget workers on probation are refused.
#[test]
fn the_score_screen_costs_the_shepherd_forward_passes() {
    let base = "--nodes 40 --rounds 6 --model gpt2-124m --profile residential --device h100 --tau 500 --encoding sparse \
                --overlap --seed 8";
    let (norm, _) = simulate(&format!("{base} --screen norm"));
    let (score, table) = simulate(base);
    let (n, s) = (&norm.strategies[0].summary, &score.strategies[0].summary);
    let cpu = s.shepherd.expect("a star").cpu;
    // two passes of 13.6 s each: the table's 81 GFLOP/s a core (measured) on its 2 cores
    assert!(cpu.screened >= 8 && cpu.screen_s > 2.0 * 13.6 * cpu.screened as f64 * 0.9, "{cpu:?}");
    assert!(s.mean_round_s > 3.0 * n.mean_round_s, "{s:?} vs {n:?}");
    assert!(s.steady_utilization < n.steady_utilization, "{s:?} vs {n:?}");
    assert_eq!(n.shepherd.expect("a star").cpu.screened, 0);
    assert!(table.contains("screen score"), "{table}");
}

/// A shepherd on an accelerator (pcp-node `--backend` on a shepherd) screens and
/// validates in milliseconds: a round of 1,000 volunteers that sums by
/// aggregators is then paced by their compute, where on its CPU the close's 8
/// validation batches (13.5 s each) held every round (12 rounds: 87% steady
/// against 5.7%; 20 rounds: 92.6%, docs/simulator.md).
#[test]
fn a_shepherd_on_an_accelerator_validates_in_milliseconds() {
    let base = "--nodes 1000 --rounds 12 --model gpt2-124m --profile residential --device h100 --tau 500 \
                --encoding sparse --overlap --seed 5";
    let (cpu, _) = simulate(&format!("{base} --screen norm --aggregators 156"));
    let (device, table) = simulate(&format!("{base} --screen norm --aggregators 156 --shepherd-device h100"));
    let (c, d) = (&cpu.strategies[0].summary, &device.strategies[0].summary);
    assert!(table.contains("a forward pass 5.5 ms on h100 (derived"), "{table}");
    assert!(c.steady_utilization < 0.1, "{c:?}");
    assert!(d.steady_utilization > 0.8, "{d:?}");
    // with the score screen the shepherd still reads every contribution
    let (score, _) = simulate(&format!("{base} --screeners 3 --shepherd-device h100"));
    let s = &score.strategies[0].summary;
    assert!(s.steady_utilization < 0.1, "{s:?}");
}

/// Workers beyond the shepherd's connections cannot join.
#[test]
fn the_connection_cap_keeps_workers_out() {
    let (r, table) = simulate(
        "--nodes 31 --rounds 2 --model nanogpt-small --tau 10 --step-seconds 0.01 --screen norm --max-connections 20",
    );
    let s = &r.strategies[0];
    assert!(s.rounds.iter().all(|r| r.participants == 20), "{:?}", s.rounds);
    assert_eq!(s.summary.shepherd.expect("a star").refused_joins, 10);
    assert!(table.contains("10 joins refused"), "{table}");
}

/// Past 4,096 participants the announcement carries a participants blob's hash, and
/// every participant fetches the blob (32 bytes a participant) from the swarm.
#[test]
fn a_large_round_lists_its_participants_in_a_blob() {
    let base = "--rounds 2 --model nanogpt-small --tau 10 --step-seconds 0.01 --screen norm --profile datacenter \
                --encoding fp32 --seed 3 --decode-seconds 0 --lease-ms 1000"; // heartbeats every 500 ms
    let (small, _) = simulate(&format!("{base} --nodes 4097"));
    let (large, _) = simulate(&format!("{base} --nodes 4098"));
    let params = small.settings.params_bytes as f64;
    let (a, b) = (&small.strategies[0].rounds[1], &large.strategies[0].rounds[1]);
    assert_eq!(a.worker_bytes_in, params, "{a:?}");
    assert_eq!(b.worker_bytes_in, params + 32.0 * 4097.0, "{b:?}");
    // the inline list is in the announcement: 4,096 × (1 kB + 32 B × 4,096) out of the shepherd
    assert!(a.control_bytes_out > 4096.0 * (1000.0 + 32.0 * 4096.0), "{a:?}");
    assert!(b.control_bytes_out < a.control_bytes_out / 10.0, "{b:?}");
}

/// `pcp-node loadtest`'s setup: every node on one machine's loopback, a given step
/// time, the norm screen.
#[test]
fn a_loopback_loadtest_is_expressible() {
    let (r, _) = simulate(
        "--nodes 101 --rounds 5 --model nanogpt-small --encoding sparse --tau 20 --step-seconds 0.05 --lockstep \
         --profile loopback --shepherd-profile loopback --screen norm --stragglers 0 --jitter 0 --seed 1",
    );
    assert_eq!(r.settings.world.regions, 1);
    let s = &r.strategies[0].summary;
    assert_eq!(s.rounds, 5);
    // a round is τ × 50 ms of steps, a heartbeat and the shepherd's close
    assert!(s.steady_round_s > 1.0 && s.steady_round_s < 3.0, "{s:?}");
    assert!(s.steady_utilization > 0.3, "{s:?}");
}

/// A round's deadline starts at its announcement, not at the input that closed the
/// last round: the 300-worker calibration run (a 163 M-parameter model whose close
/// takes 11.4 s, more than half its first round's 7.95 s) aggregates every
/// contribution of every round. Before, round 2's deadline lapsed 4.5 s after its
/// announcement and 296 of its 300 contributions came late.
#[test]
fn a_slow_close_does_not_eat_the_next_rounds_window() {
    let (r, _) = simulate(
        "--nodes 301 --rounds 4 --model gpt2-124m --params 163037184 --encoding sparse:k=2 --tau 2 \
         --step-seconds 2 --profile loopback --shepherd-profile loopback --regions 1 --screen norm \
         --eval-batches 0 --aggregate-threads 2 --synthetic-workers --stragglers 0 --jitter 0 --lockstep",
    );
    let s = &r.strategies[0];
    assert_eq!(s.summary.rounds, 4, "{:?}", s.summary);
    for round in &s.rounds {
        assert_eq!((round.contributors, round.dropped_late, round.at_quorum), (300, 0, false), "{round:?}");
    }
}
