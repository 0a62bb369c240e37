//! `run`: checks the settings, simulates each strategy, prints the table and
//! writes the report and plots.

use std::io::{IsTerminal, Write};

use pcp_protocol::diloco::aggregate::DEFAULT_BATCH;
use pcp_protocol::diloco::shepherd;

use crate::aggregators::{AggregatorSetup, commitment_bytes, commitment_s};
use crate::analytic::{self, Setup};
use crate::args::{ScreenMode, SimulateArgs, Strategy, Topology};
use crate::calibration::Calibration;
use crate::compute::{ComputeModel, StepTimeSource};
use crate::decode::DecodeCost;
use crate::diloco::{ScreenPolicy, ShepherdCosts, StarSetup, Swarm, run_star};
use crate::error::Error;
use crate::model::{ModelPreset, ModelSpec};
use crate::plot;
use crate::report::FragmentCost;
use crate::report::{Report, Settings, StrategyReport, SweepPoint};
use crate::world::{World, WorldConfig};

fn check(args: &SimulateArgs) -> Result<(), Error> {
    let bad = |what: &str| Err(Error::Invalid(what.to_owned()));
    let fraction = |f: f64| (0.0..=1.0).contains(&f);
    if args.nodes < 2 {
        return bad("--nodes must be at least 2 (a shepherd and a worker)");
    }
    if args.nodes > 1_000_000 {
        return bad("--nodes is at most 1,000,000");
    }
    if args.rounds == 0 || args.tau == 0 {
        return bad("--rounds and --tau must be at least 1");
    }
    if args.step_seconds.is_some_and(|s| !(s.is_finite() && s > 0.0)) {
        return bad("--step-seconds must be a positive number");
    }
    if args.flops_per_step.is_some_and(|s| !(s.is_finite() && s > 0.0)) {
        return bad("--flops-per-step must be a positive number");
    }
    if args.decode_seconds.is_some_and(|s| !(s.is_finite() && s >= 0.0)) {
        return bad("--decode-seconds must be a number, at least 0");
    }
    if args.params == Some(0) {
        return bad("--params must be at least 1");
    }
    if [args.stragglers, args.hostile, args.crash_fraction, args.jitter].iter().any(|f| !fraction(*f)) {
        return bad("--stragglers, --hostile, --crash-fraction and --jitter are fractions in [0, 1]");
    }
    let finite_nonneg = [
        args.overhead_seconds.unwrap_or(0.0),
        args.churn_per_hour,
        args.initial_deadline_s,
        args.min_deadline_s,
        args.max_deadline_s,
        args.heartbeat_timeout_s,
    ];
    if finite_nonneg.iter().any(|v| !(v.is_finite() && *v >= 0.0)) {
        return bad("times and rates must be finite and not negative");
    }
    let swarm_ok = args.swarm.is_none_or(|s| s.is_finite() && s >= 1.0);
    if !swarm_ok || !args.straggler_slowdown.is_finite() {
        return bad("--swarm must be at least 1 and --straggler-slowdown finite");
    }
    if args.regions == 0 || args.fragments == Some(0) || args.sweep_rounds == 0 || args.aggregate_threads == Some(0) {
        return bad("--regions, --fragments, --sweep-rounds and --aggregate-threads must be at least 1");
    }
    if !(fraction(args.screen_sample) && args.screen_share.is_finite() && args.screen_share >= 0.0) {
        return bad("--screen-sample is a fraction in [0, 1] and --screen-share a share, at least 0");
    }
    if !fraction(args.screen_spot_rate) || !fraction(args.hostile_screeners) {
        return bad("--screen-spot-rate and --hostile-screeners are fractions in [0, 1]");
    }
    if args.hostile_screeners > 0.0 && args.screeners() == 0 {
        return bad("--hostile-screeners needs committees (--screeners)");
    }
    if args.screeners.is_some_and(|k| k > 0) && (!args.overlap() || args.screen != ScreenMode::Score) {
        return bad("--screeners needs the score screen and overlapped rounds, as the node runs them");
    }
    if args.max_connections == 0 {
        return bad("--max-connections must be at least 1");
    }
    if args.sweep_nodes.iter().any(|n| !(2..=1_000_000).contains(n)) {
        return bad("--sweep-nodes are between 2 and 1,000,000");
    }
    if args.min_deadline_s > args.max_deadline_s {
        return bad("--min-deadline-s exceeds --max-deadline-s");
    }
    Ok(())
}

/// The model `--model` names: a preset, or a custom one from `--params` and `--flops-per-step`.
fn resolve(args: &SimulateArgs) -> Result<ModelSpec, Error> {
    if let Some(preset) = ModelPreset::parse(&args.model) {
        return Ok(preset.spec());
    }
    match (args.params, args.flops_per_step) {
        (Some(params), Some(flops)) => Ok(ModelSpec {
            name: args.model.clone(),
            tensor_sizes: vec![params],
            tokens_per_step: 0,
            flops_per_step: flops,
        }),
        _ => Err(Error::Invalid(format!(
            "--model {} is not nanogpt-small, nanogpt-medium or gpt2-124m; give --params and --flops-per-step for it",
            args.model
        ))),
    }
}

/// The model simulated: `base` with `--params` and `--flops-per-step` applied.
fn effective_model(args: &SimulateArgs, base: &ModelSpec) -> ModelSpec {
    let model = match args.params {
        Some(p) if p != base.params() => base.with_params(p),
        _ => base.clone(),
    };
    let flops = args.flops_per_step.unwrap_or(model.flops_per_step);
    ModelSpec { flops_per_step: flops, ..model }
}

/// The calibration table: `--calibration FILE`, or the committed one.
fn table(args: &SimulateArgs) -> Result<Calibration, Error> {
    match &args.calibration {
        Some(path) if !args.calibrate => Calibration::load(path),
        _ => Ok(Calibration::embedded()),
    }
}

/// The entries a contribution keeps in the run's top-k sparse layout, which its
/// screen uploads (`None`: another encoding, uploaded dense).
fn screened_entries(args: &SimulateArgs, sizes: &[usize]) -> Option<f64> {
    let up = args.encoding.encoding().sparse()?.up;
    (!up.strided).then(|| sizes.iter().map(|n| up.kept_in(*n) as f64).sum())
}

/// The shepherd's CPU costs for the model from `table` (see [`crate::diloco::cpu`]):
/// `--decode-seconds` replaces the table's decode and add with core-seconds spread
/// over the aggregate threads, one contribution at a time.
fn shepherd_costs(args: &SimulateArgs, base: &ModelSpec, table: &Calibration) -> (ShepherdCosts, DecodeCost) {
    let model = effective_model(args, base);
    let sizes: Vec<usize> = model.tensor_sizes.iter().map(|n| *n as usize).collect();
    let threads = args.aggregate_threads.unwrap_or(table.cores).max(1);
    let sparse = args.encoding.encoding().sparse().is_some();
    let (decode_s, add_core_s, add_batch, decode) = match args.decode_seconds {
        Some(s) => (table.ed25519_verify_s, s, 1, DecodeCost::given(s)),
        None => {
            let (d, a) = (table.decode_s(&sizes, args.encoding), table.add_s(&sizes, args.encoding));
            let source = format!(
                "measured: calibration table ({}, {} cores): decode and check {:.2} ms on the event loop, add {:.2} \
                 ms of a core{}",
                table.cpu,
                table.cores,
                d * 1e3,
                a * 1e3,
                if sparse { format!(" in batches of {DEFAULT_BATCH}") } else { String::new() }
            );
            (
                table.ed25519_verify_s + d,
                a,
                if sparse { DEFAULT_BATCH } else { 1 },
                DecodeCost { seconds: d + a, source },
            )
        }
    };
    let cipher = table.chacha20poly1305_s_per_byte;
    let costs = ShepherdCosts {
        threads,
        decode_s,
        per_byte_s: table.blake3_s_per_byte + cipher,
        verify_s: table.ed25519_verify_s,
        add_core_s,
        transport_s_per_byte: table.transport_s_per_byte,
        copy_check_core_s: match args.no_copy_check || args.decode_seconds.is_some() {
            true => 0.0,
            false => table.copy_check_s(&sizes, args.encoding),
        },
        add_batch,
        // a forward pass is a third of a training step, on the run's batch × block
        forward_s: match args.shepherd_device {
            Some(device) => model.flops_per_step / 3.0 / device.flops(),
            None => model.flops_per_step / 3.0 / table.forward_flops_per_core / threads as f64,
        },
        forward_on: match args.shepherd_device {
            Some(device) => format!("{} (derived: a third of its modelled step)", device.name()),
            None => format!("{threads} cores (measured rate)"),
        },
        screen: (args.screen == ScreenMode::Score).then_some(ScreenPolicy {
            share: args.screen_share,
            sample: args.screen_sample,
            probation_rounds: args.probation_rounds,
            screeners: args.screeners(),
            spot_rate: args.screen_spot_rate,
            liars: (args.hostile_screeners > 0.0).then_some((args.screener_attack, args.hostile_screeners)),
            host: crate::cpu::screen_host(model.params() as f64, screened_entries(args, &sizes)),
        }),
        eval_batches: args.eval_batches,
        close_s: table.close_s_per_param * model.params() as f64,
        shards_s: table.shards_s_per_param * model.params() as f64,
        checkpoint_s: table.checkpoint_s_per_param * model.params() as f64,
        checkpoint_rounds: args.checkpoint_rounds,
        heartbeat_s: table.ed25519_verify_s
            + table.ed25519_sign_s
            + cipher * (crate::diloco::HEARTBEAT_REQUEST_BYTES + crate::diloco::HEARTBEAT_ANSWER_BYTES),
        cipher_s_per_byte: cipher,
        max_connections: args.max_connections,
    };
    (costs, decode)
}

fn settings(
    args: &SimulateArgs,
    base: &ModelSpec,
    nodes: usize,
    rounds: u64,
    (costs, decode, cpu): (&ShepherdCosts, &DecodeCost, &str),
) -> Result<Settings, Error> {
    let model = effective_model(args, base);
    let star = strategies(args).contains(&"diloco-star");
    let fragments = if star { star_fragments(args, &model)?.0 } else { Vec::new() };
    let flops = model.flops_per_step;
    let compute = match args.step_seconds {
        Some(s) => ComputeModel::measured(s),
        None => ComputeModel::from_flops(flops, args.device.flops(), args.device.name()),
    };
    let compute = if args.one_machine {
        let workers = nodes - 1;
        ComputeModel {
            step_seconds: compute.step_seconds * workers as f64,
            source: format!("{}, × {workers}: the workers share one machine", compute.source),
        }
    } else {
        compute
    };
    let encoding = args.encoding.encoding();
    let step_time_source =
        if args.step_seconds.is_some() { StepTimeSource::Measured } else { StepTimeSource::FlopModel };
    let tokens = model.tokens_per_step;
    let device_tokens_per_s = (tokens > 0).then(|| tokens as f64 / compute.step_seconds);
    let world = WorldConfig {
        profile: args.profile,
        shepherd_profile: args.shepherd_profile,
        regions: if args.profile.spans_regions() { args.regions } else { 1 },
        stragglers: args.stragglers,
        straggler_slowdown: args.straggler_slowdown,
        jitter: args.jitter,
        hostile: args.hostile,
        // the node's workers heartbeat slower in a large run (at its size from the start)
        poll_s: args.poll_ms.max(pcp_protocol::diloco::liveness::interval_ms(nodes.saturating_sub(1), args.lease_ms))
            as f64
            / 1e3,
    };
    let shepherd_link = World::new(world.clone(), args.seed).shepherd;
    let sizes: Vec<usize> = model.tensor_sizes.iter().map(|n| *n as usize).collect();
    Ok(Settings {
        nodes,
        rounds,
        tau: args.tau,
        encoding: args.encoding.spec(),
        overlap: args.overlap(),
        params: model.params(),
        params_bytes: model.encoded_bytes(pcp_protocol::diloco::compress::Encoding::F32),
        contribution_bytes: model.encoded_bytes(encoding),
        update_bytes: encoding.sparse().map(|s| s.down().encoded_len(&sizes) as u64),
        decode: decode.clone(),
        shepherd_cpu: costs.clone(),
        calibration_cpu: cpu.to_owned(),
        model,
        compute,
        step_time_source,
        device_tokens_per_s,
        world,
        shepherd_link,
        fragments,
        seed: args.seed,
    })
}

/// The largest slice of the default shard count: a control message's size
/// (`pcp_schema::MAX_CONTROL_MESSAGE`, 256 KiB; pcp-node's slices may be larger).
const SLICE_CAP_BYTES: f64 = 256.0 * 1024.0;

/// The shards of the hierarchical topology: `--aggregators`, or the fewest whose
/// slices of a contribution fit pcp-node's control cap (at least 2).
fn hierarchical_shards(args: &SimulateArgs, settings: &Settings) -> usize {
    match args.aggregators {
        0 => ((settings.contribution_bytes as f64 / SLICE_CAP_BYTES).ceil() as usize).max(2),
        n => n,
    }
}

/// The star's aggregators (`shards` of them; 0: none), with the shepherd's cost per
/// contribution from the calibration table.
fn aggregators(args: &SimulateArgs, settings: &Settings, shards: usize) -> Option<AggregatorSetup> {
    if shards == 0 {
        return None;
    }
    let c = &settings.shepherd_cpu;
    let bytes = commitment_bytes(shards, args.aggregator_replicas, settings.model.tensor_sizes.len());
    Some(AggregatorSetup {
        shards,
        replicas: args.aggregator_replicas,
        profile: args.aggregator_profile,
        cores: args.aggregator_cores,
        spot_rate: args.aggregator_spot_rate,
        hostile: (args.hostile_aggregators > 0.0).then_some((args.aggregator_attack, args.hostile_aggregators)),
        vote_timeout_s: args.vote_timeout_s,
        report_s: REPORT_S,
        commit_s: commitment_s(c.verify_s, c.per_byte_s, bytes),
        commit_bytes: bytes,
    })
}

/// Seconds from a slice's arrival at its aggregators to their report at the shepherd:
/// reports go in batches every 100 ms, plus a trip.
const REPORT_S: f64 = 0.15;

fn shepherd_config(args: &SimulateArgs, rounds: u64) -> shepherd::Config {
    let ms = |s: f64| (s * 1e3).round() as u64;
    shepherd::Config {
        rounds,
        min_quorum: args.min_quorum,
        initial_deadline_ms: ms(args.initial_deadline_s),
        min_deadline_ms: ms(args.min_deadline_s),
        max_deadline_ms: ms(args.max_deadline_s),
        heartbeat_timeout_ms: ms(args.heartbeat_timeout_s),
        ..shepherd::Config::default()
    }
}

fn strategies(args: &SimulateArgs) -> Vec<&'static str> {
    match (args.strategy, args.topology) {
        (Strategy::Diloco, Topology::Star) => vec!["diloco-star"],
        (Strategy::Diloco, Topology::Hierarchical) => vec!["diloco-hierarchical"],
        (Strategy::Streaming, _) => vec!["streaming-diloco"],
        (Strategy::Allreduce, _) => vec!["allreduce"],
        (Strategy::All, _) => vec!["diloco-star", "diloco-hierarchical", "streaming-diloco", "allreduce"],
    }
}

/// Streaming DiLoCo's fragments unless `--fragments` says otherwise.
const STREAMING_FRAGMENTS: u32 = 4;

/// The DiLoCo star's fragments (`--fragments`, 1 by default): what a round syncing
/// each moves and costs, and the inner steps of a round, τ/P. Empty: the whole
/// model every round.
fn star_fragments(args: &SimulateArgs, model: &ModelSpec) -> Result<(Vec<FragmentCost>, u64), Error> {
    use pcp_protocol::diloco::{compress, fragments};
    let p = args.fragments.unwrap_or(1) as usize;
    if p <= 1 {
        return Ok((Vec::new(), args.tau));
    }
    let invalid = |e: fragments::FragmentError| Error::Invalid(format!("--fragments {p}: {e}"));
    let sizes: Vec<usize> = model.tensor_sizes.iter().map(|n| *n as usize).collect();
    let steps = fragments::steps_per_round(args.tau, p).map_err(invalid)?;
    let total = sizes.iter().sum::<usize>().max(1) as f64;
    let encoding = args.encoding.encoding();
    let costs = fragments::split(&sizes, p)
        .map_err(invalid)?
        .iter()
        .map(|range| {
            let masked = fragments::masked(&sizes, range);
            let params: usize = masked.iter().sum();
            FragmentCost {
                contribution_bytes: compress::encoded_len(&masked, encoding) as f64,
                fetch_bytes: match encoding.sparse() {
                    Some(s) => s.down().encoded_len(&masked) as f64,
                    None => 4.0 * params as f64,
                },
                work: params as f64 / total,
            }
        })
        .collect();
    Ok((costs, steps))
}

fn simulate(args: &SimulateArgs, settings: &Settings, name: &str, progress: &mut dyn FnMut(u64)) -> StrategyReport {
    let world = World::new(settings.world.clone(), args.seed);
    let workers = settings.nodes - 1;
    let step_seconds = settings.compute.step_seconds;
    let shepherd = shepherd_config(args, settings.rounds);
    // the hierarchical topology is the star with parameter-shard aggregators, as
    // pcp-node runs them (`--aggregators`, or enough shards for the slices to fit)
    let hierarchical = name == "diloco-hierarchical";
    if name == "diloco-star" || hierarchical {
        let fragments = settings.fragments.clone();
        let tau = if fragments.len() > 1 { args.tau / fragments.len() as u64 } else { args.tau };
        let setup = StarSetup {
            rounds: settings.rounds,
            workers,
            tau,
            step_seconds,
            // synthetic workers fetch no parameters and no updates
            params_bytes: if args.synthetic_workers { 0.0 } else { settings.params_bytes as f64 },
            contribution_bytes: settings.contribution_bytes as f64,
            update_bytes: if args.synthetic_workers { Some(0.0) } else { settings.update_bytes.map(|u| u as f64) },
            cpu: match args.overhead_seconds {
                // a given overhead replaces the modelled close
                Some(_) => {
                    let cpu = settings.shepherd_cpu.clone();
                    ShepherdCosts { eval_batches: 0, close_s: 0.0, shards_s: 0.0, checkpoint_s: 0.0, ..cpu }
                }
                None => settings.shepherd_cpu.clone(),
            },
            overlap: args.overlap(),
            overhead_s: args.overhead_seconds.unwrap_or(0.0),
            swarm: args.swarm.map_or(Swarm::Peers, Swarm::Factor),
            fragments,
            churn_per_hour: args.churn_per_hour,
            crash_fraction: args.crash_fraction,
            shepherd,
            aggregators: match hierarchical {
                true => aggregators(args, settings, hierarchical_shards(args, settings)),
                false => aggregators(args, settings, args.aggregators),
            },
            seed: args.seed,
        };
        let mut report = run_star(world, &setup, progress);
        if hierarchical {
            report.strategy = report.strategy.replacen("diloco-star", "diloco-hierarchical", 1);
        }
        return with_goodput(report, settings);
    }
    let setup = Setup {
        rounds: settings.rounds,
        workers,
        tau: args.tau,
        step_seconds,
        params_bytes: settings.params_bytes as f64,
        contribution_bytes: settings.contribution_bytes as f64,
        overhead_s: args.overhead_seconds.unwrap_or(0.0),
        swarm: args.swarm.unwrap_or(1.0),
        fragments: args.fragments.unwrap_or(STREAMING_FRAGMENTS),
        seed: args.seed,
    };
    let report = match name {
        "streaming-diloco" => analytic::streaming(world, &setup, progress),
        _ => analytic::allreduce(world, &setup, progress),
    };
    with_goodput(report, settings)
}

/// `report` with its summary's goodput against the workers the run started with.
fn with_goodput(mut report: StrategyReport, settings: &Settings) -> StrategyReport {
    let workers = settings.nodes - 1;
    let (step, tokens) = (settings.compute.step_seconds, settings.model.tokens_per_step);
    report.summary.set_goodput(&report.rounds, workers, step, tokens);
    report
}

/// Simulates what `args` asks, prints the table to `out`, and with `--out`
/// writes `report.json` and PNG plots there. A progress bar is drawn on
/// stderr when it is a terminal.
pub fn run(args: &SimulateArgs, out: &mut impl Write) -> Result<Report, Error> {
    check(args)?;
    let model = resolve(args)?;
    run_with_model(args, &model, out)
}

/// [`run`] for a model the caller describes (exact tensor sizes, tokens and
/// FLOPs per step, e.g. counted from a StableHLO module); `--model` only names
/// it, and `--params` and `--flops-per-step` still override it.
pub fn run_with_model(args: &SimulateArgs, model: &ModelSpec, out: &mut impl Write) -> Result<Report, Error> {
    check(args)?;
    if model.params() == 0 || !(model.flops_per_step.is_finite() && model.flops_per_step > 0.0) {
        return Err(Error::Invalid(format!("model {} has no parameters or no FLOPs per step", model.name)));
    }
    let names = strategies(args);
    let table = table(args)?;
    let (costs, decode) = shepherd_costs(args, model, &table);
    let cpu = format!("{}, {} cores", table.cpu, table.cores);
    let main = settings(args, model, args.nodes, args.rounds, (&costs, &decode, &cpu))?;
    let sweep_nodes: &[usize] = if args.sweep { &args.sweep_nodes } else { &[] };
    let total = names.len() as u64 * (args.rounds + sweep_nodes.len() as u64 * args.sweep_rounds);
    let bar = if std::io::stderr().is_terminal() {
        let bar = indicatif::ProgressBar::new(total);
        if let Ok(style) = indicatif::ProgressStyle::with_template("{msg:>28} {wide_bar} {pos}/{len} rounds {elapsed}")
        {
            bar.set_style(style);
        }
        bar
    } else {
        indicatif::ProgressBar::hidden()
    };
    let mut done = 0u64;
    let mut reports = Vec::new();
    for name in &names {
        bar.set_message(format!("{name}, {} nodes", args.nodes));
        let mut tick = |r: u64| bar.set_position(done + r);
        reports.push(simulate(args, &main, name, &mut tick));
        done += args.rounds;
        bar.set_position(done);
    }
    let mut sweep = Vec::new();
    for &nodes in sweep_nodes {
        let s = settings(args, model, nodes, args.sweep_rounds, (&costs, &decode, &cpu))?;
        for name in &names {
            bar.set_message(format!("sweep: {name}, {nodes} nodes"));
            let mut tick = |r: u64| bar.set_position(done + r);
            let r = simulate(args, &s, name, &mut tick);
            done += args.sweep_rounds;
            sweep.push(SweepPoint {
                strategy: r.strategy,
                nodes,
                mean_round_s: r.summary.mean_round_s,
                utilization: r.summary.utilization,
                goodput: r.summary.goodput.unwrap_or(0.0),
                shepherd_bytes_in: r.summary.shepherd_bytes_in,
            });
        }
    }
    bar.finish_and_clear();
    let report = Report { settings: main, strategies: reports, sweep };
    report.write_table(out).map_err(Error::Table)?;
    if let Some(dir) = &args.out {
        std::fs::create_dir_all(dir).map_err(|source| Error::Write { path: dir.clone(), source })?;
        let path = dir.join("report.json");
        let json = to_json(&report)?;
        std::fs::write(&path, json).map_err(|source| Error::Write { path: path.clone(), source })?;
        let written = plot::all(&report, dir)?;
        writeln!(out, "wrote {} and {} plots to {}", path.display(), written, dir.display()).map_err(Error::Table)?;
    }
    Ok(report)
}

/// The report as pretty JSON (what `report.json` holds): same seed, same bytes.
pub fn to_json(report: &Report) -> Result<String, Error> {
    Ok(serde_json::to_string_pretty(report)? + "\n")
}

/// `simulate --calibrate`: measures the shepherd's CPU costs on this machine
/// ([`Calibration::measure`], the node's figures copied from the committed
/// table) and writes the table to `--calibration FILE`, or to `out`.
pub fn calibrate(args: &SimulateArgs, out: &mut impl Write) -> Result<Calibration, Error> {
    let table = Calibration::measure(&Calibration::embedded());
    let json = serde_json::to_string_pretty(&table)? + "\n";
    match &args.calibration {
        Some(path) => {
            std::fs::write(path, json).map_err(|source| Error::Write { path: path.clone(), source })?;
            writeln!(out, "wrote the calibration table to {}", path.display()).map_err(Error::Table)?;
        }
        None => out.write_all(json.as_bytes()).map_err(Error::Table)?,
    }
    Ok(table)
}

/// `pcp-node simulate --faults`: runs `args.seed`'s fault schedule
/// ([`crate::faults`]), prints what happened to `out`, and fails with the broken
/// invariant.
pub fn run_faults(args: &SimulateArgs, out: &mut impl Write) -> Result<crate::faults::Outcome, Error> {
    let outcome = crate::faults::simulate(args.seed, args.faults_without);
    outcome.write(out).map_err(Error::Table)?;
    match &outcome.violation {
        Some(v) => Err(Error::Broken(v.clone())),
        None => Ok(outcome),
    }
}
