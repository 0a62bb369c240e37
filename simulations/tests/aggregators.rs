//! Parameter-shard aggregators in the simulated planet: a thousand H100s over
//! residential links, gpt2-124m, τ = 500, sparse with overlap, the norm screen and
//! no close (`--overhead-seconds 0`): what the shepherd's reading and adding cost,
//! and what aggregators (156 shards, 2 replicas, datacenter links) take off it.

use clap::Parser;
use pcp_simulations::report::StrategyReport;
use pcp_simulations::{Report, SimulateArgs, run, to_json};

#[derive(Debug, Parser)]
struct Cli {
    #[command(flatten)]
    args: SimulateArgs,
}

const BASE: &str = "--nodes 1000 --rounds 20 --model gpt2-124m --profile residential --device h100 --tau 500 \
                    --encoding sparse --overlap --seed 5 --screen norm --overhead-seconds 0";

fn simulate(extra: &str) -> Report {
    let line = format!("simulate {BASE} {extra}");
    let args = Cli::parse_from(line.split_whitespace()).args;
    run(&args, &mut Vec::new()).expect("runs")
}

fn star(report: &Report) -> &StrategyReport {
    report.strategies.iter().find(|s| s.strategy == "diloco-star+overlap").expect("the star ran")
}

#[test]
fn aggregators_keep_a_thousand_h100s_busy_where_one_shepherd_cannot() {
    let alone = simulate("");
    let shared = simulate("--aggregators 156");
    let unchecked = simulate("--aggregators 156 --aggregator-spot-rate 0");
    let (a, s) = (&star(&alone).summary, &star(&shared).summary);
    assert!(a.steady_utilization < 0.5, "one shepherd reading every contribution: {a:?}");
    // the shepherd sums 5% of the shards itself (spot checks) as the round gathers
    // (summed after the votes, they held it at 89.5%)
    assert!(s.steady_utilization >= 0.9, "with aggregators: {s:?}");
    let u = &star(&unchecked).summary;
    assert!(u.steady_utilization >= 0.9 && u.steady_utilization > s.steady_utilization, "{u:?}");
    let (busy_a, busy_s) = (a.shepherd.unwrap().cpu.busy_s, s.shepherd.unwrap().cpu.busy_s);
    assert!(busy_s * 20.0 < busy_a, "the shepherd's loop: {busy_s} s against {busy_a} s");
    assert!(
        s.shepherd_bytes_in * 10.0 < a.shepherd_bytes_in,
        "{} against {}",
        s.shepherd_bytes_in,
        a.shepherd_bytes_in
    );
    let t = s.aggregators.expect("aggregators ran");
    assert_eq!(t.rounds, 20);
    assert!(t.agreed > 0 && t.spot_checks > 0, "{t:?}");
    assert_eq!(t.recomputed, t.spot_checks, "honest volunteers: only spot checks: {t:?}");
    assert_eq!((t.caught, t.applied_wrong), (0, 0), "honest volunteers: {t:?}");
    assert!(a.aggregators.is_none());
    // the same seed, the same bytes
    assert_eq!(to_json(&shared).expect("json"), to_json(&simulate("--aggregators 156")).expect("json"));
}

#[test]
fn hostile_aggregators_are_caught_and_cost_little_pace() {
    let honest = star(&simulate("--aggregators 156")).summary.clone();
    for kind in ["agg-alter", "agg-drop", "agg-stall"] {
        let report = simulate(&format!("--aggregators 156 --hostile-aggregators 0.05 --aggregator-attack {kind}"));
        let s = &star(&report).summary;
        let t = s.aggregators.expect("aggregators ran");
        assert!(t.caught > 0 && t.recomputed >= t.caught / 2, "{kind}: {t:?}");
        assert_eq!(t.applied_wrong, 0, "{kind}: no wrong sum applied in this seeded run: {t:?}");
        assert!(
            s.steady_round_s <= 1.5 * honest.steady_round_s,
            "{kind}: rounds {} s against {} s honest",
            s.steady_round_s,
            honest.steady_round_s
        );
        assert!(s.steady_utilization >= 0.8 * honest.steady_utilization, "{kind}: {s:?}");
    }
}
