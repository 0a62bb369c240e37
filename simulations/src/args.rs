//! The command line of `pcp-node simulate`.

use std::path::PathBuf;

use pcp_protocol::diloco::compress::Encoding;
use pcp_protocol::diloco::sparse::Settings;
use serde::Serialize;

use crate::aggregators::HostileAggregator;
use crate::compute::Device;
use crate::cpu::ScreenerAttack;
use crate::faults::Rule;
use crate::network::Profile;

/// Which strategies to simulate.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Strategy {
    /// DiLoCo in the `--topology` chosen.
    Diloco,
    /// Synchronous data-parallel training with a ring all-reduce every step.
    Allreduce,
    /// Streaming DiLoCo: staggered fragment syncs overlapping compute.
    Streaming,
    /// DiLoCo star and hierarchical, Streaming DiLoCo and all-reduce.
    All,
}

/// The shepherd's screen of contributions (pcp-node `--screen`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ScreenMode {
    /// Norm bounds only: no forward pass.
    Norm,
    /// Two forward passes per screened contribution on the shepherd's held-out batch.
    Score,
}

/// How DiLoCo contributions reach the shepherd.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Topology {
    /// Every worker talks to the shepherd (pcp today; real state machines).
    Star,
    /// The star with parameter-shard aggregators, as pcp-node runs them: each
    /// shard summed by --aggregator-replicas volunteers (--aggregators shards, or the
    /// fewest whose slices are at most 256 KiB, a control message's size).
    Hierarchical,
}

/// Pseudo-gradient encodings on the wire: `fp32`, `bf16`, `int8` or `sparse[:…]`, spelled as
/// `pcp-node --encoding` spells them (and serialized so).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WireEncoding {
    /// 4 bytes a value.
    Fp32,
    /// 2 bytes a value.
    Bf16,
    /// 1 byte a value and a scale per tensor.
    Int8,
    /// SparseLoCo's chunked top-k (`pcp-node --encoding sparse`, its defaults unless the spec
    /// names others): workers holding the previous round's parameters fetch only the
    /// shepherd's update.
    Sparse(Settings),
}

impl WireEncoding {
    /// The protocol's encoding.
    pub fn encoding(self) -> Encoding {
        match self {
            Self::Fp32 => Encoding::F32,
            Self::Bf16 => Encoding::Bf16,
            Self::Int8 => Encoding::Int8,
            Self::Sparse(s) => Encoding::Sparse(s),
        }
    }

    /// The spelling `pcp-node --encoding` takes: a dense name, or the sparse settings in full.
    pub fn spec(self) -> String {
        match self {
            Self::Sparse(s) => s.spec(),
            dense => dense.encoding().name().to_owned(),
        }
    }
}

impl std::str::FromStr for WireEncoding {
    type Err = String;

    fn from_str(spec: &str) -> Result<Self, String> {
        Ok(match Encoding::parse_spec(spec)? {
            Encoding::F32 => Self::Fp32,
            Encoding::Bf16 => Self::Bf16,
            Encoding::Int8 => Self::Int8,
            Encoding::Sparse(s) => Self::Sparse(s),
        })
    }
}

impl std::fmt::Display for WireEncoding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.spec())
    }
}

impl Serialize for WireEncoding {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&self.spec())
    }
}

/// `pcp-node simulate`: predict what pcp does with many nodes before renting any.
#[derive(Clone, Debug, PartialEq, clap::Args, Serialize)]
pub struct SimulateArgs {
    /// Nodes, the shepherd included (workers = nodes − 1).
    #[arg(long, default_value_t = 10_000)]
    pub nodes: usize,
    /// Outer rounds.
    #[arg(long, default_value_t = 100)]
    pub rounds: u64,
    /// Model: nanogpt-small, nanogpt-medium, gpt2-124m, or any name given --params and
    /// --flops-per-step (pcp-node counts them for a .mlir).
    #[arg(long, default_value = "gpt2-124m")]
    pub model: String,
    /// Parameter count, overriding the preset's (its FLOPs scale with it).
    #[arg(long)]
    pub params: Option<u64>,
    /// Workers' link profile.
    #[arg(long, value_enum, default_value_t = Profile::Residential)]
    pub profile: Profile,
    /// The shepherd's (and aggregators') link profile.
    #[arg(long, value_enum, default_value_t = Profile::Datacenter)]
    pub shepherd_profile: Profile,
    /// Regions (continents) workers are spread over; crossing costs half an 80–250 ms RTT.
    #[arg(long, default_value_t = 4)]
    pub regions: usize,
    /// Strategy to simulate.
    #[arg(long, value_enum, default_value_t = Strategy::Diloco)]
    pub strategy: Strategy,
    /// DiLoCo topology.
    #[arg(long, value_enum, default_value_t = Topology::Star)]
    pub topology: Topology,
    /// Inner steps per round.
    #[arg(long, default_value_t = 500)]
    pub tau: u64,
    /// Pseudo-gradient encoding: fp32, bf16, int8 or sparse[:chunk=N,k=N,…], as
    /// `pcp-node --encoding` takes it [default: sparse, as pcp-node's: chunks of 64, top 4].
    #[arg(long, default_value = "sparse")]
    pub encoding: WireEncoding,
    /// Seed of everything random (with --faults: the fault schedule).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Run the deterministic fault simulator instead: 3 candidates and 4 workers on the real
    /// election, failover, shepherd and worker rules, one seeded schedule of crashes, partitions,
    /// lossy links and clock jumps; prints what happened and fails naming a broken invariant.
    #[arg(long)]
    pub faults: bool,
    /// With --faults: the simulated nodes leave out this failover rule (the invariants should catch it).
    #[arg(long, value_enum, requires = "faults")]
    pub faults_without: Option<Rule>,
    /// Directory for report.json and PNG plots.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Device preset for the step time (FLOPs / sustained FLOP/s).
    #[arg(long, value_enum, default_value_t = Device::H100)]
    pub device: Device,
    /// The shepherd screens and validates on this device (pcp-node `--backend` and
    /// `--target` on a shepherd): a forward pass a third of the device's modelled
    /// step. Default: on its CPU's aggregate threads, at the calibration table's rate.
    #[arg(long, value_enum)]
    pub shepherd_device: Option<Device>,
    /// Measured seconds per inner step (`pcp-node bench step`), overriding the FLOP model.
    #[arg(long)]
    pub step_seconds: Option<f64>,
    /// FLOPs per inner step (e.g. counted from pcp's IR), overriding the preset's.
    #[arg(long)]
    pub flops_per_step: Option<f64>,
    /// All workers share the one machine the step time was measured on (`pcp-node sim`): its
    /// throughput is split, so a step takes workers × the step time alone.
    #[arg(long)]
    pub one_machine: bool,
    /// Workers as `pcp-node loadtest`'s: a sleep stands for their compute, so they fetch
    /// neither parameters nor updates (only announcements), and the shepherd's reading,
    /// adding and closing set the round. The calibration test compares the two so.
    #[arg(long)]
    pub synthetic_workers: bool,
    /// Seconds the shepherd spends between closing a round and announcing the next (validation,
    /// checkpoint), replacing the DiLoCo star's modelled close (--eval-batches forward passes and
    /// the calibration table's cost per parameter) [default: the star models it; the other
    /// strategies 0].
    #[arg(long)]
    pub overhead_seconds: Option<f64>,
    /// Core-seconds the shepherd spends decoding, validating and adding one contribution,
    /// spread over the aggregate threads in place of the calibration table's decode, add
    /// and copy check [default: from the calibration table, for the model and encoding].
    #[arg(long)]
    pub decode_seconds: Option<f64>,
    /// Threads the shepherd adds contributions, screens and validates on (pcp-node
    /// `--aggregate-threads`, default all its cores) [default: the cores of the machine the
    /// calibration table was measured on]. Each contribution's signature check, hash,
    /// decryption and decode run on its one event-loop thread whatever this says.
    #[arg(long, visible_alias = "shepherd-cores")]
    pub aggregate_threads: Option<usize>,
    /// The shepherd checkpoints after every this many rounds (pcp-node
    /// `--checkpoint-rounds`), after the last and after the first; a close that
    /// checkpoints takes the calibration table's checkpoint cost too.
    #[arg(long, value_name = "K", default_value_t = pcp_protocol::diloco::checkpoint::DEFAULT_CHECKPOINT_ROUNDS,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub checkpoint_rounds: u64,
    /// The shepherd's screen (pcp-node `--screen`): `score` runs two forward passes per
    /// screened contribution on a held-out batch (batch × block tokens); `norm` checks norms only.
    #[arg(long, value_enum, default_value_t = ScreenMode::Score)]
    pub screen: ScreenMode,
    /// Share of the last round's duration (less its screening) screening may take past the
    /// first 8 screens of a round (pcp-node `--screen-share`).
    #[arg(long, default_value_t = 0.25)]
    pub screen_share: f64,
    /// Past the budget, a rated peer's contribution is screened with this probability
    /// (pcp-node `--screen-sample`); one on probation is refused for the round.
    #[arg(long, default_value_t = 0.25)]
    pub screen_sample: f64,
    /// Screeners a committee (pcp-node `--screeners`): rated workers score each
    /// contribution on their devices between their inner steps (each worker about
    /// this many a round, two forward passes each, a forward pass a third of a
    /// step); the shepherd scores a round's contributions before two rated senders'
    /// arrived, and the spot checks. Overlapped runs, as the node runs them; with
    /// --aggregators the members fetch each contribution from its sender, whose
    /// upload carries K more copies. 0: the shepherd screens. Default: 3 under the
    /// score screen with overlapped rounds (an open run's, as pcp-node's), else 0.
    #[arg(long, value_name = "K")]
    pub screeners: Option<u32>,
    /// With --screeners: the share of contributions the shepherd spot-checks while
    /// its screening is within --screen-share (pcp-node `--screen-spot-rate`).
    #[arg(long, default_value_t = pcp_protocol::diloco::committee::DEFAULT_SPOT_RATE)]
    pub screen_spot_rate: f64,
    /// With --screeners: the share of workers that lie when they screen, doing
    /// --screener-attack (the shepherd's score catches them when their committee
    /// disagrees or is spot-checked; a committee of liars alone decides otherwise).
    #[arg(long, default_value_t = 0.0)]
    pub hostile_screeners: f64,
    /// What lying screeners report (pcp-node's `--hostile screen-high`, `screen-low`).
    #[arg(long, value_enum, default_value_t = ScreenerAttack::ScreenHigh)]
    pub screener_attack: ScreenerAttack,
    /// Screens a key must pass before it is rated (pcp-node `--probation-rounds`).
    #[arg(long, default_value_t = 3)]
    pub probation_rounds: u32,
    /// Validation batches the shepherd evaluates when a round closes (pcp-node's eval_batches).
    #[arg(long, default_value_t = 8)]
    pub eval_batches: u64,
    /// The shepherd holds no contribution it reads itself to the copy check (pcp-node
    /// `--no-copy-check`; on by default, as in the node, at the calibration table's cost).
    #[arg(long)]
    pub no_copy_check: bool,
    /// Connections the shepherd admits (pcp-node: 16,384); workers beyond it cannot join.
    #[arg(long, default_value_t = 16_384)]
    pub max_connections: usize,
    /// The shepherd's CPU costs: read this calibration table instead of the committed one
    /// (`simulations/calibration.json`); with --calibrate, write the new table here.
    #[arg(long)]
    pub calibration: Option<PathBuf>,
    /// Measure the shepherd's CPU costs on this machine and write the calibration table (to
    /// --calibration FILE, or stdout) instead of simulating.
    #[arg(long)]
    pub calibrate: bool,
    /// Workers overlap rounds, the default (as pcp-node's): they train round r+1 from their own
    /// parameters while round r's contribution, the shepherd's aggregation and the update are
    /// on their way, and rebase onto the update when it arrives; a contribution may go before
    /// the update (staleness depth 2). The shepherd time-boxes rounds (a compute budget of τ ×
    /// the median step time, a deadline that costs no worker compute) and carries
    /// contributions one round late into the next round (DiLoCo star; the strategy is named
    /// diloco-star+overlap). The flag only says so; --lockstep turns overlap off.
    #[arg(long = "overlap", id = "overlap_flag", conflicts_with = "lockstep")]
    pub overlap_flag: bool,
    /// Lockstep rounds (pcp-node's --no-overlap): a worker fetches round r's parameters, trains
    /// τ steps, sends, and waits for round r+1; the shepherd closes a round when every
    /// participant answered or at its deadline (the strategy is named diloco-star).
    #[arg(long, visible_alias = "no-overlap")]
    pub lockstep: bool,
    /// Workers' shortest heartbeat interval (they learn of a round from its answer),
    /// milliseconds; larger runs heartbeat slower, as pcp-node's workers do
    /// (`pcp_protocol::diloco::liveness`: 0.25 ms a worker, at most half the lease).
    #[arg(long, default_value_t = 500)]
    pub poll_ms: u64,
    /// The leader's lease (pcp-node's `--lease-ms`), milliseconds: it caps the
    /// workers' heartbeat interval at half of it.
    #[arg(long, default_value_t = pcp_protocol::diloco::liveness::DEFAULT_LEASE_MS)]
    pub lease_ms: u64,
    /// Fraction of workers that are stragglers.
    #[arg(long, default_value_t = 0.05)]
    pub stragglers: f64,
    /// Stragglers' steps take 1.5× to this many times longer.
    #[arg(long, default_value_t = 4.0)]
    pub straggler_slowdown: f64,
    /// Per-round step-time noise, ± this fraction.
    #[arg(long, default_value_t = 0.05)]
    pub jitter: f64,
    /// Fraction of hostile workers (they send NaN; the shepherd's validation rejects it).
    #[arg(long, default_value_t = 0.0)]
    pub hostile: f64,
    /// Parameter-shard aggregators (DiLoCo star): the round's sum is split into this many
    /// shards, each summed by --aggregator-replicas volunteers that offered `--aggregate`,
    /// and the shepherd reads each contribution's commitment, not its bytes; 0: the
    /// shepherd sums alone.
    #[arg(long, default_value_t = 0)]
    pub aggregators: usize,
    /// Volunteers that sum each aggregated shard (they must agree bit for bit).
    #[arg(long, default_value_t = 2)]
    pub aggregator_replicas: usize,
    /// The aggregator volunteers' link profile.
    #[arg(long, value_enum, default_value_t = Profile::Datacenter)]
    pub aggregator_profile: Profile,
    /// Cores each aggregator volunteer checks and adds slices on (at the calibration table's speed).
    #[arg(long, default_value_t = 2)]
    pub aggregator_cores: usize,
    /// Share of shards the shepherd recomputes from the committed slices whatever their
    /// replicas say.
    #[arg(long, default_value_t = pcp_protocol::diloco::aggregation::DEFAULT_SPOT_RATE)]
    pub aggregator_spot_rate: f64,
    /// Fraction of aggregator volunteers that are hostile, doing --aggregator-attack.
    #[arg(long, default_value_t = 0.0)]
    pub hostile_aggregators: f64,
    /// What hostile aggregators do.
    #[arg(long, value_enum, default_value_t = HostileAggregator::AggAlter)]
    pub aggregator_attack: HostileAggregator,
    /// Seconds after a round's close its shards' votes are waited for; a silent replica's
    /// shard is recomputed then.
    #[arg(long, default_value_t = 5.0)]
    pub vote_timeout_s: f64,
    /// Expected leaves per worker per hour, with as many Poisson joins (DiLoCo star only).
    #[arg(long, default_value_t = 0.0)]
    pub churn_per_hour: f64,
    /// Fraction of leaves that are crashes, noticed after the heartbeat timeout.
    #[arg(long, default_value_t = 0.5)]
    pub crash_fraction: f64,
    /// The round's blobs are served at this multiple of the shepherd's uplink (1: the shepherd
    /// alone) [default, DiLoCo star: a peer-to-peer swarm, as pcp-node's content-addressed blobs
    /// are: the shepherd's uplink plus every participant's, less its own contribution's upload;
    /// other strategies: 1].
    #[arg(long)]
    pub swarm: Option<f64>,
    /// Streaming DiLoCo's fragments P: the model's tensors in P groups, one synced per round
    /// after τ/P inner steps [default: DiLoCo star 1 (the whole model each round), run through
    /// the real state machines overlapped and --lockstep; streaming-diloco 4].
    #[arg(long)]
    pub fragments: Option<u32>,
    /// Contributions that close a round at its deadline.
    #[arg(long, default_value_t = 1)]
    pub min_quorum: usize,
    /// The first round's deadline, seconds (pcp-node: 600).
    #[arg(long, default_value_t = 600.0)]
    pub initial_deadline_s: f64,
    /// Shortest adaptive deadline, seconds (pcp-node: 10).
    #[arg(long, default_value_t = 10.0)]
    pub min_deadline_s: f64,
    /// Longest adaptive deadline, seconds (pcp-node: 600).
    #[arg(long, default_value_t = 600.0)]
    pub max_deadline_s: f64,
    /// Heartbeat timeout, seconds (pcp-node: 10).
    #[arg(long, default_value_t = 10.0)]
    pub heartbeat_timeout_s: f64,
    /// Also simulate every strategy at each of --sweep-nodes (with --sweep-rounds rounds each).
    #[arg(long)]
    pub sweep: bool,
    /// Node counts of the sweep.
    #[arg(long, value_delimiter = ',', default_value = "10,100,1000,10000")]
    pub sweep_nodes: Vec<usize>,
    /// Rounds per sweep point.
    #[arg(long, default_value_t = 10)]
    pub sweep_rounds: u64,
}

impl SimulateArgs {
    /// Whether workers overlap rounds: the default, off with `--lockstep`.
    pub fn overlap(&self) -> bool {
        !self.lockstep
    }

    /// Screeners a committee: `--screeners`, or an open run's default (3 under
    /// the score screen with overlapped rounds, where the node's committees
    /// screen; 0 otherwise).
    pub fn screeners(&self) -> u32 {
        let committees = self.overlap() && self.screen == ScreenMode::Score;
        self.screeners.unwrap_or(if committees { pcp_protocol::diloco::committee::DEFAULT_SCREENERS } else { 0 })
    }
}
