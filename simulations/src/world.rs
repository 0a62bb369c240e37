//! The simulated world: the shepherd's and every worker's link, region,
//! compute speed and honesty, all drawn from one seed.
//!
//! Each kind of randomness has its own ChaCha8 stream of the seed, so adding
//! a worker or a churn event never changes the draws of another kind.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;

use crate::network::{Link, Profile};

/// RNG streams of one seed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Stream {
    World = 1,
    Churn = 2,
    Jitter = 3,
    Delta = 4,
    Screen = 5,
    Aggregators = 6,
    Screeners = 7,
}

/// The generator of `stream` for `seed`.
pub(crate) fn rng(seed: u64, stream: Stream) -> ChaCha8Rng {
    let mut r = ChaCha8Rng::seed_from_u64(seed);
    r.set_stream(stream as u64);
    r
}

/// What the world is drawn from.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct WorldConfig {
    /// Workers' link profile.
    pub profile: Profile,
    /// The shepherd's (and regional aggregators') link profile.
    pub shepherd_profile: Profile,
    /// Regions (continents); the shepherd is in region 0.
    pub regions: usize,
    /// Fraction of workers that are stragglers.
    pub stragglers: f64,
    /// A straggler's step takes 1.5× to this many times longer.
    pub straggler_slowdown: f64,
    /// Per-round step-time noise: ± this fraction.
    pub jitter: f64,
    /// Fraction of workers that send NaN pseudo-gradients.
    pub hostile: f64,
    /// Heartbeat (round polling) interval, seconds.
    pub poll_s: f64,
}

/// One worker.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct NodeSpec {
    /// Its link.
    pub link: Link,
    /// Its region.
    pub region: usize,
    /// Step-time multiplier (1 for most, more for stragglers).
    pub slowdown: f64,
    /// Whether it sends NaN.
    pub hostile: bool,
    /// Offset of its heartbeat ticks within the poll interval, seconds.
    pub poll_phase: f64,
}

/// The drawn world.
#[derive(Clone, Debug)]
pub struct World {
    /// Settings.
    pub config: WorldConfig,
    /// The shepherd's link.
    pub shepherd: Link,
    /// Extra one-way latency between regions (half an 80–250 ms RTT).
    inter: Vec<Vec<f64>>,
    rng: ChaCha8Rng,
}

impl World {
    /// Draws the shepherd and the region latencies.
    pub fn new(config: WorldConfig, seed: u64) -> Self {
        let mut rng = rng(seed, Stream::World);
        let regions = if config.profile.spans_regions() { config.regions.max(1) } else { 1 };
        let shepherd = config.shepherd_profile.draw(&mut rng);
        // a link a region is drawn and left unused, so that the latencies drawn
        // next keep each seed's world
        for _ in 0..regions {
            config.shepherd_profile.draw(&mut rng);
        }
        let mut inter = vec![vec![0.0; regions]; regions];
        for (a, b) in (0..regions).flat_map(|a| (a + 1..regions).map(move |b| (a, b))) {
            let one_way = rng.gen_range(0.080..0.250) / 2.0;
            inter[a][b] = one_way;
            inter[b][a] = one_way;
        }
        Self { config: WorldConfig { regions, ..config }, shepherd, inter, rng }
    }

    /// Draws the next worker.
    pub fn draw_node(&mut self) -> NodeSpec {
        let c = &self.config;
        let link = c.profile.draw(&mut self.rng);
        let region = self.rng.gen_range(0..c.regions.max(1));
        let slowdown = if self.rng.r#gen::<f64>() < c.stragglers {
            self.rng.gen_range(1.5..c.straggler_slowdown.max(1.5 + 1e-9))
        } else {
            1.0
        };
        let hostile = self.rng.r#gen::<f64>() < c.hostile;
        let poll_phase = self.rng.r#gen::<f64>() * c.poll_s;
        NodeSpec { link, region, slowdown, hostile, poll_phase }
    }

    /// One-way latency between a worker and a hub in `region` with link `hub`.
    pub fn latency(&self, node: &NodeSpec, region: usize, hub: &Link) -> f64 {
        node.link.latency + hub.latency + self.inter[node.region][region]
    }

    /// The slowest hop of a ring through `nodes` ordered by region: two access
    /// latencies plus the slowest crossing between consecutive regions.
    pub fn ring_hop(&self, nodes: &[NodeSpec]) -> f64 {
        let access = nodes.iter().map(|n| n.link.latency).fold(0.0, f64::max);
        let r = self.inter.len();
        let cross = (0..r).map(|k| self.inter[k][(k + 1) % r]).fold(0.0, f64::max);
        2.0 * access + cross
    }

    /// The first heartbeat tick of `node` at or after `t`.
    pub fn next_poll(&self, node: &NodeSpec, t: f64) -> f64 {
        let p = self.config.poll_s;
        if p <= 0.0 {
            return t;
        }
        let k = ((t - node.poll_phase) / p).ceil().max(0.0);
        node.poll_phase + k * p
    }
}
