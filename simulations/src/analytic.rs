//! Strategies pcp has no state machine for, modelled round by round with the
//! same world, links and [`fair_share`] flows as the star: DiLoCo through
//! regional aggregators, Streaming DiLoCo, and synchronous data-parallel
//! ring all-reduce. Churn is not applied to them (they use the initial
//! workers); stragglers, jitter and hostile workers are. In sparse runs the
//! hierarchy's workers and aggregators fetch the shepherd's update after the
//! first round (everyone took part in the previous one); Streaming DiLoCo and
//! all-reduce move fp32 parameters and the encoded pseudo-gradient, and nothing
//! here charges the shepherd's (or an aggregator's) decode time.

use std::collections::VecDeque;

use pcp_protocol::diloco::shepherd;
use rand::Rng;

use crate::network::{Flow, fair_share};
use crate::report::{RoundStats, StrategyReport, Summary};
use crate::world::{NodeSpec, Stream, World, rng};

/// What the analytic strategies need besides the world.
#[derive(Clone, Debug, PartialEq)]
pub struct Setup {
    /// Rounds (for all-reduce: groups of τ steps).
    pub rounds: u64,
    /// Workers.
    pub workers: usize,
    /// Inner steps per round.
    pub tau: u64,
    /// Seconds per step on a typical worker.
    pub step_seconds: f64,
    /// Bytes of the fp32 parameters.
    pub params_bytes: f64,
    /// Bytes of one encoded pseudo-gradient (or gradient, for all-reduce).
    pub contribution_bytes: f64,
    /// Sparse runs: bytes of the shepherd's update, fetched instead of the parameters
    /// by whoever holds the previous round's.
    pub update_bytes: Option<f64>,
    /// Shepherd work between rounds, seconds.
    pub overhead_s: f64,
    /// Parameters are served at `swarm` × the hub's uplink.
    pub swarm: f64,
    /// Streaming DiLoCo fragments.
    pub fragments: u32,
    /// Deadline settings (aggregators use the shepherd's rule).
    pub shepherd: shepherd::Config,
    /// The run seed.
    pub seed: u64,
}

fn population(world: &mut World, n: usize) -> Vec<NodeSpec> {
    (0..n).map(|_| world.draw_node()).collect()
}

/// Per-worker step times of one round, with jitter.
fn steps(world: &World, nodes: &[NodeSpec], setup: &Setup, rng: &mut impl Rng) -> Vec<f64> {
    let jitter = setup.step_seconds * world.config.jitter;
    nodes
        .iter()
        .map(|n| {
            let noise = if jitter > 0.0 { rng.gen_range(-1.0..=1.0) } else { 0.0 };
            (setup.step_seconds * n.slowdown + jitter * noise).max(0.0)
        })
        .collect()
}

/// The shepherd's adaptive deadline: factor × median of recent durations.
#[derive(Debug)]
struct Deadline {
    config: shepherd::Config,
    recent: VecDeque<f64>,
}

impl Deadline {
    fn new(config: shepherd::Config) -> Self {
        Self { config, recent: VecDeque::new() }
    }

    fn get(&self) -> f64 {
        if self.recent.is_empty() {
            return self.config.initial_deadline_ms as f64 / 1e3;
        }
        let mut v: Vec<f64> = self.recent.iter().copied().collect();
        v.sort_by(f64::total_cmp);
        (self.config.deadline_factor * v[v.len() / 2])
            .clamp(self.config.min_deadline_ms as f64 / 1e3, self.config.max_deadline_ms as f64 / 1e3)
    }

    fn record(&mut self, d: f64) {
        self.recent.push_back(d);
        while self.recent.len() > self.config.deadline_window.max(1) {
            self.recent.pop_front();
        }
    }
}

/// DiLoCo with one aggregator per region: the shepherd sends the parameters
/// to the aggregators, each aggregator serves its region's workers, collects
/// their contributions until all have answered or its deadline (the
/// shepherd's rule: 2× the median of recent rounds), sums them and forwards
/// one contribution of the same size. The shepherd then sees one
/// contribution per region. Aggregators have the shepherd's link profile and
/// relay whole blobs (store and forward).
pub fn hierarchical(mut world: World, setup: &Setup, progress: &mut dyn FnMut(u64)) -> StrategyReport {
    let nodes = population(&mut world, setup.workers);
    let mut jitter = rng(setup.seed, Stream::Jitter);
    let regions = world.aggregators.len();
    let mut deadlines: Vec<Deadline> = (0..regions).map(|_| Deadline::new(setup.shepherd.clone())).collect();
    let mut rounds = Vec::new();
    let mut t = 0.0f64;
    for r in 1..=setup.rounds {
        let start = t + if r > 1 { setup.overhead_s } else { 0.0 };
        let step = steps(&world, &nodes, setup, &mut jitter);
        // every aggregator and worker holds the previous round's parameters
        let fetch = match setup.update_bytes {
            Some(update) if r > 1 => update,
            _ => setup.params_bytes,
        };
        // shepherd -> aggregators
        let level1: Vec<Flow> = world.aggregators.iter().map(|a| Flow { start, bytes: fetch, cap: a.down }).collect();
        let got = fair_share(world.shepherd.up, &level1);
        let mut stats = RoundStats { round: r, ..RoundStats::default() };
        let mut compute = 0.0;
        let mut forwards = Vec::with_capacity(regions);
        for (k, got_k) in got.iter().enumerate() {
            let agg = world.aggregators[k];
            let ready = got_k + world.aggregator_latency(k);
            let members: Vec<usize> = (0..nodes.len()).filter(|i| nodes[*i].region == k).collect();
            if members.is_empty() {
                continue;
            }
            let fetches: Vec<Flow> = members
                .iter()
                .map(|i| {
                    let n = &nodes[*i];
                    let lat = world.latency(n, k, &agg);
                    Flow { start: world.next_poll(n, ready) + 3.0 * lat, bytes: fetch, cap: n.link.down }
                })
                .collect();
            let fetched = fair_share(agg.up * setup.swarm.max(1.0), &fetches);
            let uploads: Vec<Flow> = members
                .iter()
                .zip(&fetched)
                .map(|(i, f)| {
                    let n = &nodes[*i];
                    let lat = world.latency(n, k, &agg);
                    let train = setup.tau as f64 * step[*i];
                    Flow { start: f + lat + train, bytes: setup.contribution_bytes, cap: n.link.up }
                })
                .collect();
            let uploaded = fair_share(agg.down, &uploads);
            let arrivals: Vec<f64> =
                members.iter().zip(&uploaded).map(|(i, u)| u + world.latency(&nodes[*i], k, &agg)).collect();
            let cutoff = ready + deadlines[k].get();
            let last = arrivals.iter().copied().fold(ready, f64::max);
            let close = if last <= cutoff { last } else { cutoff };
            stats.at_quorum |= last > cutoff;
            deadlines[k].record(close - ready);
            for (i, a) in members.iter().zip(&arrivals) {
                stats.participants += 1;
                if *a > close {
                    stats.dropped_late += 1;
                } else if nodes[*i].hostile {
                    stats.dropped_rejected += 1;
                    compute += setup.tau as f64 * step[*i];
                } else {
                    stats.contributors += 1;
                    compute += setup.tau as f64 * step[*i];
                }
            }
            stats.worker_bytes_in += fetch * members.len() as f64;
            stats.worker_bytes_out += setup.contribution_bytes * members.len() as f64;
            forwards.push(Flow { start: close, bytes: setup.contribution_bytes, cap: agg.up });
        }
        let forwarded = fair_share(world.shepherd.down, &forwards);
        let end = forwarded.iter().zip(0..).map(|(f, k)| f + world.aggregator_latency(k)).fold(start, f64::max);
        let p = stats.participants.max(1) as f64;
        stats.end_s = end;
        stats.wall_s = end - t;
        stats.utilization = compute / (p * stats.wall_s.max(1e-9));
        stats.trained_steps = stats.contributors as f64 * setup.tau as f64;
        stats.shepherd_bytes_in = setup.contribution_bytes * forwards.len() as f64;
        stats.shepherd_bytes_out = fetch * regions as f64;
        stats.worker_bytes_in /= p;
        stats.worker_bytes_out /= p;
        rounds.push(stats);
        t = end;
        progress(r);
    }
    report("diloco-hierarchical", rounds)
}

/// Streaming DiLoCo in a star: the parameters are split into `fragments`
/// parts synchronized on a staggered schedule, one every τ/F inner steps, and
/// each fragment's exchange (every worker's fragment of the pseudo-gradient
/// in, the fragment's new parameters out) overlaps the next τ/F steps of
/// compute. Workers stall only when an exchange takes longer than its window:
/// a round lasts max(τ × slowest step, F × exchange time). Every worker waits
/// for every other (no quorum), so stragglers set the pace.
pub fn streaming(mut world: World, setup: &Setup, progress: &mut dyn FnMut(u64)) -> StrategyReport {
    let nodes = population(&mut world, setup.workers);
    let mut jitter = rng(setup.seed, Stream::Jitter);
    let f = f64::from(setup.fragments.max(1));
    let hub = world.shepherd;
    let lat: Vec<f64> = nodes.iter().map(|n| world.latency(n, 0, &hub)).collect();
    let up: Vec<Flow> =
        nodes.iter().map(|n| Flow { start: 0.0, bytes: setup.contribution_bytes / f, cap: n.link.up }).collect();
    let down: Vec<Flow> =
        nodes.iter().map(|n| Flow { start: 0.0, bytes: setup.params_bytes / f, cap: n.link.down }).collect();
    let max_lat = lat.iter().copied().fold(0.0, f64::max);
    let exchange = fair_share(hub.down, &up).into_iter().fold(0.0, f64::max)
        + fair_share(hub.up * setup.swarm.max(1.0), &down).into_iter().fold(0.0, f64::max)
        + 2.0 * max_lat;
    let mut rounds = Vec::new();
    let mut t = 0.0;
    for r in 1..=setup.rounds {
        let step = steps(&world, &nodes, setup, &mut jitter);
        let compute: Vec<f64> = step.iter().map(|s| setup.tau as f64 * s).collect();
        let slowest = compute.iter().copied().fold(0.0, f64::max);
        let wall = slowest.max(f * exchange) + setup.overhead_s;
        let n = nodes.len().max(1) as f64;
        let hostile = nodes.iter().filter(|x| x.hostile).count() as u64;
        t += wall;
        rounds.push(RoundStats {
            round: r,
            end_s: t,
            wall_s: wall,
            participants: nodes.len() as u64,
            contributors: nodes.len() as u64 - hostile,
            dropped_rejected: hostile,
            utilization: compute.iter().sum::<f64>() / (n * wall.max(1e-9)),
            trained_steps: (nodes.len() as u64 - hostile) as f64 * setup.tau as f64,
            shepherd_bytes_in: setup.contribution_bytes * n,
            shepherd_bytes_out: setup.params_bytes * n / setup.swarm.max(1.0),
            worker_bytes_in: setup.params_bytes,
            worker_bytes_out: setup.contribution_bytes,
            ..RoundStats::default()
        });
        progress(r);
    }
    report("streaming-diloco", rounds)
}

/// Synchronous data-parallel training with a ring all-reduce of the
/// gradient (in the run's encoding) after every step: each step takes the
/// slowest worker's compute plus `2(N−1)/N × bytes / slowest link + 2(N−1) ×
/// the slowest hop's latency` (no overlap of communication with the backward
/// pass). A "round" is τ steps, the same tokens as a DiLoCo round. No
/// shepherd; hostile workers are not filtered (all-reduce cannot).
pub fn allreduce(mut world: World, setup: &Setup, progress: &mut dyn FnMut(u64)) -> StrategyReport {
    let nodes = population(&mut world, setup.workers);
    let mut jitter = rng(setup.seed, Stream::Jitter);
    let n = nodes.len().max(1) as f64;
    let slowest_link = nodes.iter().map(|x| x.link.up.min(x.link.down)).fold(f64::INFINITY, f64::min);
    let hop = world.ring_hop(&nodes);
    let moved = 2.0 * (n - 1.0) / n * setup.contribution_bytes;
    let comm = if nodes.len() > 1 { moved / slowest_link + 2.0 * (n - 1.0) * hop } else { 0.0 };
    let mut rounds = Vec::new();
    let mut t = 0.0;
    for r in 1..=setup.rounds {
        let step = steps(&world, &nodes, setup, &mut jitter);
        let slowest = step.iter().copied().fold(0.0, f64::max);
        let wall = setup.tau as f64 * (slowest + comm);
        t += wall;
        let tau = setup.tau as f64;
        rounds.push(RoundStats {
            round: r,
            end_s: t,
            wall_s: wall,
            participants: nodes.len() as u64,
            contributors: nodes.len() as u64,
            utilization: step.iter().map(|s| tau * s).sum::<f64>() / (n * wall.max(1e-9)),
            trained_steps: n * tau,
            worker_bytes_in: tau * moved,
            worker_bytes_out: tau * moved,
            ..RoundStats::default()
        });
        progress(r);
    }
    report("allreduce", rounds)
}

fn report(name: &str, rounds: Vec<RoundStats>) -> StrategyReport {
    let summary = Summary::of(&rounds);
    StrategyReport { strategy: name.into(), engine: "analytic".into(), rounds, summary }
}
