//! Strategies pcp has no state machine for, modelled round by round with the
//! same world, links and [`fair_share`] flows as the star: Streaming DiLoCo,
//! and synchronous data-parallel ring all-reduce. Churn is not applied to them (they use the initial
//! workers); stragglers, jitter and hostile workers are. Streaming DiLoCo and
//! all-reduce move fp32 parameters and the encoded pseudo-gradient, and nothing
//! here charges the shepherd's decode time.

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
    /// Shepherd work between rounds, seconds.
    pub overhead_s: f64,
    /// Parameters are served at `swarm` × the hub's uplink.
    pub swarm: f64,
    /// Streaming DiLoCo fragments.
    pub fragments: u32,
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
