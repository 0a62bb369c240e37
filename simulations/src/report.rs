//! What a simulation reports, and the table it prints.

use std::io::Write;

use serde::Serialize;

use crate::compute::{ComputeModel, StepTimeSource};
use crate::decode::DecodeCost;
use crate::model::ModelSpec;
use crate::network::Link;
use crate::world::WorldConfig;

/// One round of one strategy.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct RoundStats {
    /// The round (1-based).
    pub round: u64,
    /// When it closed, seconds since the start.
    pub end_s: f64,
    /// Wall-clock from the previous round's close (or the start) to this close.
    pub wall_s: f64,
    /// Workers expected to contribute.
    pub participants: u64,
    /// Contributions averaged.
    pub contributors: u64,
    /// Closed at its deadline with a quorum rather than with every live participant answered.
    pub at_quorum: bool,
    /// Contributions that arrived after their round closed.
    pub dropped_late: u64,
    /// Contributions refused by validation (NaN from hostile workers).
    pub dropped_rejected: u64,
    /// Rounds a worker gave up (a newer round or its deadline came first).
    pub abandoned: u64,
    /// The inner-step time of contributions averaged (in this round or a later one)
    /// that ran inside this round's wall-time window, over participants × the
    /// window; at most 1.
    pub utilization: f64,
    /// The inner steps of the contributions averaged (in this round or a later one)
    /// that ran inside this round's wall-time window, each contribution's steps
    /// spread evenly over the time they took (the analytic strategies: contributors
    /// × τ); × the model's tokens per step, the tokens trained in the window.
    pub trained_steps: f64,
    /// Bytes into the shepherd.
    pub shepherd_bytes_in: f64,
    /// Bytes out of the shepherd.
    pub shepherd_bytes_out: f64,
    /// Mean bytes into a participant.
    pub worker_bytes_in: f64,
    /// Mean bytes out of a participant.
    pub worker_bytes_out: f64,
    /// DiLoCo star: heartbeat requests into the shepherd.
    #[serde(skip_serializing_if = "is_zero_f64")]
    pub control_bytes_in: f64,
    /// DiLoCo star: the announcement and heartbeat answers out of the shepherd.
    #[serde(skip_serializing_if = "is_zero_f64")]
    pub control_bytes_out: f64,
    /// Overlap: contributions for the round before, arrived after it closed and
    /// averaged into this one.
    #[serde(skip_serializing_if = "is_zero")]
    pub carried: u64,
    /// Overlap: the round's compute budget, seconds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub budget_s: Option<f64>,
    /// Overlap: times a worker's steps were done and compute waited for the
    /// network (its round not announced yet, or an update two rounds late).
    #[serde(skip_serializing_if = "is_zero")]
    pub update_late: u64,
    /// Overlap: the seconds of compute those waits cost, all workers together.
    #[serde(skip_serializing_if = "is_zero_f64")]
    pub waited_s: f64,
    /// Overlap: rounds of steps a worker ended early, at the median worker's end.
    #[serde(skip_serializing_if = "is_zero")]
    pub cut_short: u64,
    /// Overlap: contributions sent before the update they follow arrived, the next
    /// steps starting two outer updates behind (staleness depth 2).
    #[serde(skip_serializing_if = "is_zero")]
    pub sent_ahead: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

fn is_zero_f64(n: &f64) -> bool {
    *n == 0.0
}

/// Totals and means over a strategy's rounds.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Summary {
    /// Rounds completed.
    pub rounds: u64,
    /// Simulated seconds until the last round closed.
    pub total_s: f64,
    /// Mean wall-clock per round, every round (the first included).
    pub mean_round_s: f64,
    /// Overall utilization: the compute counted in every round's window over the
    /// participants × wall time of every round (see [`RoundStats::utilization`]); at most 1.
    pub utilization: f64,
    /// The first round of the steady state: rounds before it are skipped (the first
    /// 2, or the first 10% of the rounds when that is more, keeping at least the last).
    pub steady_from_round: u64,
    /// The median wall-clock of the steady rounds.
    pub steady_round_s: f64,
    /// [`Summary::utilization`] over the steady rounds only.
    pub steady_utilization: f64,
    /// Overlap: the same as `utilization` (kept for older readers).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub overall_utilization: Option<f64>,
    /// Goodput, every round: the tokens of the contributions averaged per second of
    /// wall time ([`RoundStats::trained_steps`] over the rounds' wall time), over the
    /// workers the run started with × one device's tokens per second alone
    /// ([`Settings::device_tokens_per_s`]). Set by [`Summary::set_goodput`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub goodput: Option<f64>,
    /// [`Summary::goodput`] over the steady rounds only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub steady_goodput: Option<f64>,
    /// The tokens of the contributions averaged per second of wall time, every round
    /// (a model that names its tokens per step).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokens_per_s: Option<f64>,
    /// [`Summary::tokens_per_s`] over the steady rounds only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub steady_tokens_per_s: Option<f64>,
    /// DiLoCo star: what the shepherd's CPU did.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shepherd: Option<ShepherdSummary>,
    /// DiLoCo star with aggregators: what they did.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub aggregators: Option<crate::aggregators::AggregatorTotals>,
    /// Mean bytes into the shepherd per round.
    pub shepherd_bytes_in: f64,
    /// Mean bytes out of the shepherd per round.
    pub shepherd_bytes_out: f64,
    /// Mean bytes into a worker per round.
    pub worker_bytes_in: f64,
    /// Mean bytes out of a worker per round.
    pub worker_bytes_out: f64,
    /// Rounds closed at their deadline.
    pub rounds_at_quorum: u64,
    /// Rounds closed with every live participant answered.
    pub rounds_all_answered: u64,
    /// Late contributions.
    pub dropped_late: u64,
    /// Rejected contributions.
    pub dropped_rejected: u64,
    /// Abandoned worker rounds.
    pub abandoned: u64,
    /// Overlap: contributions carried over a round.
    #[serde(skip_serializing_if = "is_zero")]
    pub carried: u64,
    /// The most bytes into a worker in a round (a sync), the mean over the
    /// round's participants, over the rounds after the first (whose parameters
    /// every worker fetches whole).
    pub peak_worker_bytes_in: f64,
    /// The most bytes out of a worker in a round, the mean over its participants.
    pub peak_worker_bytes_out: f64,
}

/// The shepherd's CPU over a DiLoCo star run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct ShepherdSummary {
    /// Its event loop's work.
    pub cpu: crate::cpu::CpuTotals,
    /// Workers that could not join: the shepherd's connections were all taken.
    pub refused_joins: u64,
    /// Heartbeats alone needed more than the event loop (the simulator capped their share at 95%).
    pub heartbeat_overload: bool,
}

/// Rounds skipped before the steady state: 2, or 10% of `n` if more, leaving at least one.
pub fn steady_skip(n: usize) -> usize {
    2usize.max(n / 10).min(n.saturating_sub(1))
}

/// Compute over participants × wall time of `rounds` (each round's utilization weighted).
fn utilization(rounds: &[RoundStats]) -> f64 {
    let (c, t) = rounds.iter().fold((0.0, 0.0), |(c, t), r| {
        let capacity = r.participants as f64 * r.wall_s;
        (c + r.utilization.min(1.0) * capacity, t + capacity)
    });
    if t > 0.0 { c / t } else { 0.0 }
}

/// Inner steps of the contributions averaged per second of `rounds`' wall time.
fn steps_per_s(rounds: &[RoundStats]) -> f64 {
    let (steps, wall) = rounds.iter().fold((0.0, 0.0), |(s, w), r| (s + r.trained_steps, w + r.wall_s));
    if wall > 0.0 { steps / wall } else { 0.0 }
}

/// The median of `values` (0 for none).
fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    match values.len() {
        0 => 0.0,
        n if n % 2 == 1 => values[n / 2],
        n => (values[n / 2 - 1] + values[n / 2]) / 2.0,
    }
}

impl Summary {
    /// Sums and averages `rounds`.
    pub fn of(rounds: &[RoundStats]) -> Self {
        let n = rounds.len().max(1) as f64;
        let mean = |f: fn(&RoundStats) -> f64| rounds.iter().map(f).sum::<f64>() / n;
        let steady = &rounds[steady_skip(rounds.len())..];
        Self {
            rounds: rounds.len() as u64,
            total_s: rounds.last().map_or(0.0, |r| r.end_s),
            mean_round_s: mean(|r| r.wall_s),
            utilization: utilization(rounds),
            steady_from_round: steady.first().map_or(0, |r| r.round),
            steady_round_s: median(steady.iter().map(|r| r.wall_s).collect()),
            steady_utilization: utilization(steady),
            overall_utilization: None,
            goodput: None,
            steady_goodput: None,
            tokens_per_s: None,
            steady_tokens_per_s: None,
            shepherd: None,
            shepherd_bytes_in: mean(|r| r.shepherd_bytes_in),
            shepherd_bytes_out: mean(|r| r.shepherd_bytes_out),
            worker_bytes_in: mean(|r| r.worker_bytes_in),
            worker_bytes_out: mean(|r| r.worker_bytes_out),
            rounds_at_quorum: rounds.iter().filter(|r| r.at_quorum).count() as u64,
            rounds_all_answered: rounds.iter().filter(|r| !r.at_quorum).count() as u64,
            dropped_late: rounds.iter().map(|r| r.dropped_late).sum(),
            dropped_rejected: rounds.iter().map(|r| r.dropped_rejected).sum(),
            abandoned: rounds.iter().map(|r| r.abandoned).sum(),
            carried: rounds.iter().map(|r| r.carried).sum(),
            peak_worker_bytes_in: rounds
                .iter()
                .skip(usize::from(rounds.len() > 1))
                .map(|r| r.worker_bytes_in)
                .fold(0.0, f64::max),
            peak_worker_bytes_out: rounds.iter().map(|r| r.worker_bytes_out).fold(0.0, f64::max),
            aggregators: None,
        }
    }

    /// Sets goodput from `rounds`' trained steps, overall and over the steady rounds
    /// (those of [`Summary::steady_utilization`]): steps averaged per second over
    /// `workers` × the steps a second of one device alone (`1 / step_seconds`, the step
    /// time the run used); with the model's `tokens_per_step` (0: unknown) also the
    /// tokens a second. Both rates count tokens, so a straggler's slower steps weigh
    /// what its tokens do.
    pub fn set_goodput(&mut self, rounds: &[RoundStats], workers: usize, step_seconds: f64, tokens_per_step: u64) {
        let steady = &rounds[steady_skip(rounds.len())..];
        let (all, steady) = (steps_per_s(rounds), steps_per_s(steady));
        let alone = workers as f64 / step_seconds;
        let share = |rate: f64| if alone > 0.0 && alone.is_finite() { rate / alone } else { 0.0 };
        (self.goodput, self.steady_goodput) = (Some(share(all)), Some(share(steady)));
        let tokens = (tokens_per_step > 0).then_some(tokens_per_step as f64);
        (self.tokens_per_s, self.steady_tokens_per_s) = (tokens.map(|t| t * all), tokens.map(|t| t * steady));
    }
}

/// One strategy's run.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct StrategyReport {
    /// `diloco-star`, `diloco-hierarchical`, `streaming-diloco` or `allreduce`.
    pub strategy: String,
    /// `protocol` (pcp's real shepherd and worker state machines) or `analytic`.
    pub engine: String,
    /// Every round.
    pub rounds: Vec<RoundStats>,
    /// Over all rounds.
    pub summary: Summary,
}

/// One point of the node-count sweep.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SweepPoint {
    /// Strategy name.
    pub strategy: String,
    /// Nodes (shepherd included).
    pub nodes: usize,
    /// Mean wall-clock per round.
    pub mean_round_s: f64,
    /// Mean compute utilization.
    pub utilization: f64,
    /// Goodput over every round ([`Summary::goodput`]).
    pub goodput: f64,
    /// Mean bytes into the shepherd per round.
    pub shepherd_bytes_in: f64,
}

/// The settings a report was made with.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Settings {
    /// Nodes, shepherd included.
    pub nodes: usize,
    /// Rounds asked for.
    pub rounds: u64,
    /// Inner steps per round.
    pub tau: u64,
    /// Pseudo-gradient encoding as `--encoding` spells it (sparse: its settings in full).
    pub encoding: String,
    /// Workers overlap rounds (the default; `--lockstep` turns it off). It applies to
    /// the DiLoCo star; the analytic strategies keep their own models.
    pub overlap: bool,
    /// The model.
    pub model: ModelSpec,
    /// Parameters.
    pub params: u64,
    /// Bytes of the fp32 parameters blob a worker fetches each round.
    pub params_bytes: u64,
    /// Bytes of one encoded pseudo-gradient.
    pub contribution_bytes: u64,
    /// Sparse runs: bytes of the shepherd's update, which a worker holding the previous
    /// round's parameters fetches instead of the parameters blob.
    pub update_bytes: Option<u64>,
    /// What the shepherd spends on each contribution (decode, validate, add).
    pub decode: DecodeCost,
    /// The shepherd's CPU costs the DiLoCo star is simulated with.
    pub shepherd_cpu: crate::cpu::ShepherdCosts,
    /// The machine the calibration table was measured on.
    pub calibration_cpu: String,
    /// Step time.
    pub compute: ComputeModel,
    /// Where the step time came from: the device preset's FLOP model, or a measured
    /// `--step-seconds`.
    pub step_time_source: StepTimeSource,
    /// One device's tokens per second alone, what goodput is measured against: the
    /// model's tokens per step over the step time (with `--one-machine`, a worker's
    /// share of the one machine). None when the model names no tokens per step.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device_tokens_per_s: Option<f64>,
    /// The world.
    pub world: WorldConfig,
    /// The shepherd's drawn link.
    pub shepherd_link: Link,
    /// The DiLoCo star's fragments (`--fragments`, more than one): what a round
    /// syncing each moves and costs.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub fragments: Vec<FragmentCost>,
    /// The seed.
    pub seed: u64,
}

/// Everything a run produced.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Report {
    /// The settings.
    pub settings: Settings,
    /// One entry per strategy simulated.
    pub strategies: Vec<StrategyReport>,
    /// The node-count sweep (empty without `--sweep`).
    pub sweep: Vec<SweepPoint>,
}

/// `1.23 GB`-style sizes.
pub fn bytes(b: f64) -> String {
    let units = [("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)];
    for (name, size) in units {
        if b >= size {
            return format!("{:.2} {name}", b / size);
        }
    }
    format!("{b:.0} B")
}

/// `85 µs`, `3.2 ms`, `12.3 s`, `4.5 min` or `2.1 h`.
pub fn seconds(s: f64) -> String {
    if s > 0.0 && s < 1e-3 {
        format!("{:.0} µs", s * 1e6)
    } else if s > 0.0 && s < 0.1 {
        format!("{:.1} ms", s * 1e3)
    } else if s >= 7200.0 {
        format!("{:.1} h", s / 3600.0)
    } else if s >= 120.0 {
        format!("{:.1} min", s / 60.0)
    } else {
        format!("{s:.2} s")
    }
}

impl Report {
    /// Prints the per-strategy table (and the sweep, if any) to `out`.
    pub fn write_table(&self, out: &mut impl Write) -> std::io::Result<()> {
        let s = &self.settings;
        writeln!(
            out,
            "{} nodes, {} ({} params, {} fp32), tau {}, {} pseudo-gradients ({}{}), {} rounds, step {}, {} \
             workers{}",
            s.nodes,
            s.model.name,
            s.params,
            bytes(s.params_bytes as f64),
            s.tau,
            s.encoding,
            bytes(s.contribution_bytes as f64),
            s.update_bytes.map_or(String::new(), |u| format!("; update {}", bytes(u as f64))),
            if s.overlap { "overlapped" } else { "lockstep" },
            seconds(s.compute.step_seconds),
            s.world.profile.name(),
            if s.world.regions > 1 { format!(" over {} regions", s.world.regions) } else { String::new() }
        )?;
        self.write_goodput_basis(out)?;
        writeln!(
            out,
            "shepherd link {}/s up, {}/s down ({})",
            bytes(s.shepherd_link.up),
            bytes(s.shepherd_link.down),
            s.world.shepherd_profile.name()
        )?;
        writeln!(
            out,
            "shepherd decode + validate + add {} a contribution ({})",
            seconds(s.decode.seconds),
            s.decode.source
        )?;
        writeln!(
            out,
            "{:<20} {:>6} {:>10} {:>6} {:>7} {:>10} {:>6} {:>7} {:>10} {:>10} {:>10} {:>10} {:>13} {:>12}",
            "strategy",
            "rounds",
            "round",
            "util",
            "goodput",
            "steady",
            "util",
            "goodput",
            "shep in",
            "shep out",
            "worker in",
            "worker out",
            "quorum/all",
            "late/reject"
        )?;
        for r in &self.strategies {
            let m = &r.summary;
            writeln!(
                out,
                "{:<20} {:>6} {:>10} {:>5.1}% {:>7} {:>10} {:>5.1}% {:>7} {:>10} {:>10} {:>10} {:>10} {:>13} {:>12}",
                r.strategy,
                m.rounds,
                seconds(m.mean_round_s),
                100.0 * m.utilization,
                percent(m.goodput),
                seconds(m.steady_round_s),
                100.0 * m.steady_utilization,
                percent(m.steady_goodput),
                bytes(m.shepherd_bytes_in),
                bytes(m.shepherd_bytes_out),
                bytes(m.worker_bytes_in),
                bytes(m.worker_bytes_out),
                format!("{}/{}", m.rounds_at_quorum, m.rounds_all_answered),
                format!("{}/{}", m.dropped_late, m.dropped_rejected),
            )?;
        }
        writeln!(
            out,
            "(round: mean of every round; steady: median from round {} on, the first 2 or 10% skipped; util: compute \
             of the contributions averaged, in the wall-time window it ran in, / (participants x wall time); goodput: \
             tokens of the contributions averaged per second / (workers x one device's tokens/s alone); bytes are \
             means per round)",
            self.strategies.first().map_or(0, |r| r.summary.steady_from_round)
        )?;
        self.write_shepherd(out)?;
        for r in &self.strategies {
            let m = &r.summary;
            let fragments = if r.strategy.starts_with("diloco-star") && s.fragments.len() > 1 {
                format!(", {} fragments: one synced a round", s.fragments.len())
            } else {
                String::new()
            };
            writeln!(
                out,
                "{}: peak per worker and sync {} in (after round 1), {} out{fragments}",
                r.strategy,
                bytes(m.peak_worker_bytes_in),
                bytes(m.peak_worker_bytes_out),
            )?;
            if let (Some(all), Some(steady)) = (m.tokens_per_s, m.steady_tokens_per_s) {
                writeln!(out, "{}: trains {} tokens/s ({} steady)", r.strategy, count(all), count(steady))?;
            }
        }
        for r in &self.strategies {
            let m = &r.summary;
            if m.overall_utilization.is_some() {
                let last = r.rounds.last();
                let budget =
                    last.and_then(|l| l.budget_s).map_or(String::new(), |b| format!(", last budget {}", seconds(b)));
                writeln!(out, "{}: {} contributions carried over a round{}", r.strategy, m.carried, budget)?;
            }
        }
        if !self.sweep.is_empty() {
            writeln!(out, "\nsweep: mean round time / utilization / shepherd bytes in per round")?;
            let mut nodes: Vec<usize> = self.sweep.iter().map(|p| p.nodes).collect();
            nodes.dedup();
            write!(out, "{:<20}", "strategy")?;
            for n in &nodes {
                write!(out, " {:>28}", format!("{n} nodes"))?;
            }
            writeln!(out)?;
            let mut names: Vec<&str> = Vec::new();
            for p in &self.sweep {
                if !names.contains(&p.strategy.as_str()) {
                    names.push(&p.strategy);
                }
            }
            for name in names {
                write!(out, "{name:<20}")?;
                for n in &nodes {
                    match self.sweep.iter().find(|p| p.strategy == name && p.nodes == *n) {
                        Some(p) => write!(
                            out,
                            " {:>28}",
                            format!(
                                "{} / {:.0}% / {}",
                                seconds(p.mean_round_s),
                                100.0 * p.utilization,
                                bytes(p.shepherd_bytes_in)
                            )
                        )?,
                        None => write!(out, " {:>28}", "-")?,
                    }
                }
                writeln!(out)?;
            }
        }
        Ok(())
    }
}

/// `12.3%`, or `-` for none.
fn percent(f: Option<f64>) -> String {
    f.map_or_else(|| "-".into(), |f| format!("{:.1}%", 100.0 * f))
}

/// `1.23 M`-style counts.
pub fn count(n: f64) -> String {
    for (name, size) in [("G", 1e9), ("M", 1e6), ("k", 1e3)] {
        if n >= size {
            return format!("{:.2} {name}", n / size);
        }
    }
    format!("{n:.0}")
}

impl Report {
    /// What goodput is measured against: the workers, one device's tokens per second
    /// alone, and where its step time came from.
    fn write_goodput_basis(&self, out: &mut impl Write) -> std::io::Result<()> {
        let s = &self.settings;
        let alone = match s.device_tokens_per_s {
            Some(t) => format!("{} tokens/s alone ({} tokens a step", count(t), s.model.tokens_per_step),
            None => format!("{} steps/s alone (the model names no tokens a step", count(1.0 / s.compute.step_seconds)),
        };
        writeln!(
            out,
            "goodput against {} workers x one device's {alone}; step {} from {}: {})",
            s.nodes.saturating_sub(1),
            seconds(s.compute.step_seconds),
            s.step_time_source.describe(),
            s.compute.source
        )
    }

    /// The shepherd's CPU model and what it did (DiLoCo star), with its assumptions.
    fn write_shepherd(&self, out: &mut impl Write) -> std::io::Result<()> {
        let s = &self.settings;
        let c = &s.shepherd_cpu;
        let star: Vec<&StrategyReport> = self.strategies.iter().filter(|r| r.summary.shepherd.is_some()).collect();
        if star.is_empty() {
            return Ok(());
        }
        let mut screen = match c.screen {
            Some(p) if p.screeners > 0 => format!(
                "screen score by committees of {} (a screen two forward passes of a worker's device, a third of a \
                 step each; {:.0}% spot-checked within a {:.0}% share)",
                p.screeners,
                100.0 * p.spot_rate,
                100.0 * p.share
            ),
            Some(p) => format!("screen score ({:.0}% share, {:.0}% sample)", 100.0 * p.share, 100.0 * p.sample),
            None => "screen norm".into(),
        };
        screen += &match c.copy_check_core_s {
            0.0 => "; no copy check".into(),
            s => format!("; copy check {} of the loop a contribution read", seconds(s / c.threads.max(1) as f64)),
        };
        writeln!(
            out,
            "shepherd CPU (calibration: {}; {} aggregate threads): a forward pass {} on {} ({}), {} validation batches and {} \
             of parameters a close ({} of shards written after the announcement; {} more with a checkpoint, every {} \
             rounds), {} a heartbeat (every {}), {} connections at most",
            s.calibration_cpu,
            c.threads,
            seconds(c.forward_s),
            c.forward_on,
            screen,
            c.eval_batches,
            seconds(c.close_s),
            seconds(c.shards_s),
            seconds(c.checkpoint_s),
            c.checkpoint_rounds,
            seconds(c.heartbeat_s),
            seconds(s.world.poll_s),
            c.max_connections,
        )?;
        for r in star {
            let Some(sh) = r.summary.shepherd else { continue };
            let t = sh.cpu;
            writeln!(
                out,
                "{}: shepherd loop busy {} ({} screening {} contributions, {} closing), {} refused unscreened, {} joins \
                 refused, heartbeats {:.0}% of the loop{}",
                r.strategy,
                seconds(t.busy_s),
                seconds(t.screen_s),
                t.screened,
                seconds(t.close_s),
                t.over_budget,
                sh.refused_joins,
                100.0 * t.peak_heartbeat_load,
                if sh.heartbeat_overload { " (OVERLOADED: modelled at 95%)" } else { "" },
            )?;
            if c.screen.is_some_and(|p| p.screeners > 0) {
                writeln!(
                    out,
                    "{}: committees decided {} contributions alone; the shepherd scored {} ({} spot checks); {} \
                     found {} contributions waiting for verdicts (or 1 GiB) and went to its own screen",
                    r.strategy,
                    t.by_committee,
                    t.screened,
                    t.spot_checks,
                    t.undeferred,
                    pcp_protocol::diloco::committee::screening::MAX_DEFERRED
                )?;
                if let Some((attack, share)) = c.screen.and_then(|p| p.liars) {
                    writeln!(
                        out,
                        "{}: lying screeners ({:?}, {:.0}% of workers): {} caught; {} disputed contributions the shepherd \
                         scored; {} honest contributions refused by committees of liars",
                        r.strategy,
                        attack,
                        100.0 * share,
                        t.screeners_caught,
                        t.disputed,
                        t.misjudged
                    )?;
                }
            }
            writeln!(
                out,
                "{}: serving blobs took {} of the shepherd's cores off the loop",
                r.strategy,
                seconds(t.serve_s)
            )?;
            if let Some(a) = r.summary.aggregators {
                writeln!(
                    out,
                    "{}: aggregators summed {} rounds: {} shards agreed, {} recomputed ({} spot checks, {} of the \
                     shepherd's threads), {} volunteers caught, {} wrong sums applied, {} a round from the close to \
                     the means gathered",
                    r.strategy,
                    a.rounds,
                    a.agreed,
                    a.recomputed,
                    a.spot_checks,
                    seconds(a.recompute_s),
                    a.caught,
                    a.applied_wrong,
                    seconds(a.wait_s / a.rounds.max(1) as f64),
                )?;
            }
        }
        Ok(())
    }
}

/// What a round that syncs one fragment moves and costs.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct FragmentCost {
    /// Bytes of a contribution: the fragment's tensors encoded, the others empty.
    pub contribution_bytes: f64,
    /// Bytes a worker holding the previous round's parameters fetches: the
    /// fragment's sparse update, or its changed fp32 shards.
    pub fetch_bytes: f64,
    /// The fragment's share of the shepherd's per-contribution work (of the
    /// parameters).
    pub work: f64,
}
