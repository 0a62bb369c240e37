//! The shepherd's flags, and the plan resolved from them, a config and a checkpoint.

use std::path::{Path, PathBuf};

use pcp_bootstrap::PeerId;
use pcp_protocol::diloco::compress::Encoding;
use pcp_protocol::{BlobHash, PublicKey};
use pcp_schema::RunManifest;

use crate::Failure;
use crate::diloco::retention::Retention;
use crate::diloco::wire::LeaderState;
use crate::training::checkpoint::Checkpoint;
use crate::training::config::Experiment;
use crate::training::data::{Corpus, default_corpus};
use crate::training::device::Placement;
use crate::training::model::Model;

use super::setup::ShepherdMeta;
use super::trust::{Trust, TrustArgs};
use super::{OwnEngine, Start};

/// Flags of `pcp-node --shepherd`.
#[derive(Debug, Clone, Default, clap::Args)]
pub(crate) struct ShepherdArgs {
    /// Be the shepherd of a new run (or of the checkpointed one with --resume).
    #[arg(long)]
    pub(crate) shepherd: bool,
    /// An experiment file (PCP's keys and pcp's own); flags override it.
    #[arg(long, requires = "shepherd")]
    pub(crate) config: Option<PathBuf>,
    /// nanogpt-small, nanogpt-medium, or a StableHLO loss module (.mlir).
    #[arg(long, requires = "shepherd")]
    pub(crate) model: Option<String>,
    /// The corpus [default: the demo corpus].
    #[arg(long, requires = "shepherd")]
    pub(crate) data: Option<PathBuf>,
    /// Outer rounds.
    #[arg(long, requires = "shepherd")]
    pub(crate) rounds: Option<u64>,
    /// Inner steps per round (τ).
    #[arg(long, requires = "shepherd")]
    pub(crate) tau: Option<u64>,
    /// Peak inner learning rate.
    #[arg(long, requires = "shepherd")]
    pub(crate) lr: Option<f64>,
    /// Outer Nesterov learning rate.
    #[arg(long, requires = "shepherd")]
    pub(crate) outer_lr: Option<f64>,
    /// Outer Nesterov momentum.
    #[arg(long, requires = "shepherd")]
    pub(crate) outer_momentum: Option<f64>,
    /// Run seed: initialisation and data order.
    #[arg(long, requires = "shepherd")]
    pub(crate) seed: Option<u64>,
    /// f32, or bf16: the step's matmuls and attention in bf16, weights, AdamW state,
    /// pseudo-gradients and loss in f32 (recorded in the manifest) [default: f32].
    #[arg(long, requires = "shepherd")]
    pub(crate) precision: Option<String>,
    /// Activations the step's backward recomputes instead of keeping: none, attention,
    /// elementwise or blocks (recorded in the manifest) [default: elementwise].
    #[arg(long, requires = "shepherd")]
    pub(crate) recompute: Option<String>,
    /// Workers that must have joined before round 1 opens.
    #[arg(long, default_value_t = 1, requires = "shepherd")]
    pub(crate) min_workers: usize,
    /// Pseudo-gradient encoding workers must use: `sparse` (SparseLoCo: chunked
    /// top-k with error feedback, sparse updates both ways;
    /// `sparse:chunk=64,k=4,bits=2,decay=0.5,down=8,downbits=4` spells out the
    /// defaults), fp32, bf16 or int8.
    #[arg(long, default_value = "sparse", requires = "shepherd")]
    pub(crate) encoding: String,
    /// Workers train the next round while a round's contribution, aggregation and
    /// update are on the way, and rebase onto the update when it arrives: compute
    /// never waits for the network unless the update is a whole round late. The
    /// default; `--no-overlap` runs lockstep rounds.
    #[arg(long, overrides_with = "no_overlap", requires = "shepherd")]
    pub(crate) overlap: bool,
    /// Lockstep rounds: workers wait for each round's update before training on.
    #[arg(long, overrides_with = "overlap", requires = "shepherd")]
    pub(crate) no_overlap: bool,
    /// Streaming DiLoCo: split the parameters into P fragments by layer and sync one
    /// per round, in turn, every τ/P inner steps, each with its own outer step (τ
    /// must be a multiple of P; --rounds counts rounds of τ steps, so P × --rounds
    /// syncs).
    #[arg(long, default_value_t = 1, value_name = "P", requires = "shepherd")]
    pub(crate) fragments: u32,
    /// Drop a worker that has not sent a heartbeat for this long.
    #[arg(long, default_value_t = 10_000, requires = "shepherd")]
    pub(crate) heartbeat_timeout_ms: u64,
    /// Threads that add the round's contributions to its running sum (0: every
    /// core of this machine).
    #[arg(long, default_value_t = 0, value_name = "N", requires = "shepherd")]
    pub(crate) aggregate_threads: usize,
    /// Cut each round's sum into N parameter shards, each summed by
    /// --aggregator-replicas rated volunteers (nodes started with --aggregate)
    /// that the announcement names: the shepherd reads their reports and shard
    /// means, not the contributions. 0: the shepherd sums alone, as it also does
    /// while too few rated volunteers are live. Under the score screen, only
    /// while committees screen (--screeners, and a round's slice of the withheld
    /// split left): their members fetch each contribution's slices from its
    /// shards' aggregators, or else its sender. Needs a top-k or dense encoding. Past a few hundred volunteers,
    /// about one shard for every 60 (docs/running-a-run.md).
    #[arg(long, default_value_t = 0, value_name = "N", requires = "shepherd")]
    pub(crate) aggregators: usize,
    /// Volunteers summing each shard; their signed hashes of the shard's mean must
    /// agree.
    #[arg(long, default_value_t = 2, value_name = "R", value_parser = clap::value_parser!(u64).range(1..16),
          requires = "shepherd")]
    pub(crate) aggregator_replicas: u64,
    /// The share of aggregated shards the shepherd sums itself whatever their
    /// replicas vote (a spot check: replicas that lie alike are caught), drawn each
    /// round from a secret of this shepherd and summed as the round's contributions
    /// are accepted; past 1,000 participants a round the share shrinks so the
    /// checks read no more slices.
    #[arg(long, default_value_t = pcp_protocol::diloco::aggregation::DEFAULT_SPOT_RATE, value_name = "RATE",
          value_parser = crate::diloco::parse_share, requires = "shepherd")]
    pub(crate) aggregator_spot_rate: f64,
    /// A round with more participants than this lists them in a blob the
    /// announcement names, not inline (an announcement stays within the control cap).
    #[arg(long, default_value_t = crate::diloco::participants::DEFAULT_INLINE, value_name = "N", requires = "shepherd")]
    pub(crate) participants_inline: usize,
    /// Accept copies: contributions too close to another of their round or to the
    /// last update are refused unless this is given (`pcp-node loadtest`'s
    /// synthetic workers send a few payloads in turn).
    #[arg(long, requires = "shepherd")]
    pub(crate) no_copy_check: bool,
    /// Continue the run checkpointed in <data-dir>/shepherd, from the newest of its
    /// checkpoint and the state it wrote after every round.
    #[arg(long, requires = "shepherd")]
    pub(crate) resume: bool,
    /// Write a checkpoint (the parameters, the optimizer's state and the run's
    /// metadata, in <data-dir>/shepherd) after every K rounds, the first and the
    /// last. The state the shepherd writes after every round for its candidates is
    /// what --resume starts from while it is in the blob store, so a resume loses no
    /// round; without it (deleted, or a damaged store) it loses up to K − 1.
    #[arg(long, default_value_t = crate::diloco::retention::DEFAULT_CHECKPOINT_ROUNDS, value_name = "K",
          value_parser = clap::value_parser!(u64).range(1..), requires = "shepherd")]
    pub(crate) checkpoint_rounds: u64,
    /// How contributions are screened besides NaN, shape and norm checks: `score`
    /// rejects one that does not lower the loss on a held-out batch when applied
    /// alone; `norm` only bounds norms.
    #[arg(long, default_value = "score", requires = "shepherd")]
    pub(crate) screen: String,
    /// Aggregate by the coordinate-wise mean trimmed by this fraction at each end
    /// (with 3 or more contributions), instead of the token-weighted mean.
    #[arg(long, default_value_t = 0.0, value_parser = parse_trim, requires = "shepherd")]
    pub(crate) trim: f64,
    /// With --shepherd: a coordinator candidate that takes over when this shepherd's
    /// lease lapses (a peer id, a hex public key, or a node's identity.key;
    /// repeatable). Without --shepherd: be a standby candidate of --run, ready to lead.
    #[arg(long, num_args = 0..=1, default_missing_value = "", value_name = "PEER")]
    pub(crate) candidate: Vec<String>,
    /// The leader's lease: candidates take over after this long without a heartbeat.
    /// Workers heartbeat at most half of it apart.
    #[arg(long, default_value_t = pcp_protocol::diloco::liveness::DEFAULT_LEASE_MS, requires = "shepherd")]
    pub(crate) lease_ms: u64,
    /// How the candidates agree on a leader and on each round. `majority` (the
    /// default from 3 candidates): a majority of all the candidates elects, holds
    /// the lease and commits a round, so no single fault forks the run or loses a
    /// released round. `best-effort` (the default with 1 or 2): a majority of the
    /// candidates still heard, so one of two may die, but a cut between them makes
    /// two leaders (docs/failover.md: "Shepherd failover").
    #[arg(long, value_parser = ["majority", "best-effort"], requires = "shepherd")]
    pub(crate) failover: Option<String>,
    #[command(flatten)]
    pub(crate) trust: TrustArgs,
}

/// A `--candidate` value: a peer id, a hex ed25519 public key, or a path to a
/// node's `identity.key` (or its data directory).
pub(crate) fn parse_candidate(spec: &str) -> Result<PublicKey, Failure> {
    if let Ok(peer) = spec.parse::<PeerId>() {
        return pcp_bootstrap::key_of(&peer)
            .ok_or_else(|| Failure::input(anyhow::anyhow!("--candidate {spec}: the peer id embeds no ed25519 key")));
    }
    if let Ok(key) = spec.parse::<BlobHash>() {
        return Ok(PublicKey(key.0));
    }
    let path = Path::new(spec);
    let dir = if path.is_dir() { path.to_path_buf() } else { path.parent().unwrap_or(Path::new(".")).to_path_buf() };
    if path.is_dir() || path.file_name().is_some_and(|n| n == "identity.key") && path.exists() {
        let identity = pcp_bootstrap::load_or_create(&dir)
            .map_err(|e| Failure::input(anyhow::anyhow!("--candidate {spec}: {e}")))?;
        return Ok(identity.public());
    }
    Err(Failure::input(anyhow::anyhow!(
        "--candidate {spec:?} is neither a peer id, a hex public key nor a node's identity.key"
    )))
}

/// A trim fraction: from 0 (the weighted mean) to below 0.5.
pub(crate) fn parse_trim(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(t) if (0.0..0.5).contains(&t) => Ok(t),
        _ => Err(format!("{s:?} is not a fraction from 0 to below 0.5")),
    }
}

/// `--aggregator-spot-rate`: a share from 0 to 1.
pub(crate) fn parse_share(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(t) if (0.0..=1.0).contains(&t) => Ok(t),
        _ => Err(format!("{s:?} is not a share from 0 to 1")),
    }
}

/// How a shepherd screens contributions beyond NaN, shapes and the norm bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Screen {
    /// Only the norm bound.
    Norm,
    /// Also the loss-delta score on a held-out batch.
    Score,
}

impl Screen {
    /// The name `parse` takes, as the run manifest records it.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Norm => "norm",
            Self::Score => "score",
        }
    }

    pub(crate) fn parse(name: &str) -> Result<Self, Failure> {
        match name {
            "norm" => Ok(Self::Norm),
            "score" => Ok(Self::Score),
            _ => Err(Failure::input(anyhow::anyhow!("unknown --screen {name:?}; expected score or norm"))),
        }
    }
}

/// Everything the shepherd needs, resolved from flags, config and checkpoint.
#[derive(Debug)]
pub(crate) struct ShepherdPlan {
    pub(super) experiment: Experiment,
    pub(super) model: Model,
    pub(super) corpus_path: PathBuf,
    pub(super) corpus: Corpus,
    pub(super) rounds: u64,
    pub(super) tau: u64,
    pub(super) min_workers: usize,
    pub(super) encoding: Encoding,
    pub(super) heartbeat_timeout_ms: u64,
    /// Threads adding contributions, and the shards aggregators sum.
    pub(crate) aggregation: Aggregation,
    /// Participants a round lists inline (`--participants-inline`).
    pub(crate) participants_inline: usize,
    /// Copies are refused (not `--no-copy-check`).
    pub(crate) copy_check: bool,
    pub(super) start: Start,
    pub(super) state_dir: PathBuf,
    /// The other coordinator candidates (a new run's; a resumed or inherited run's
    /// come from its checkpoint or manifest).
    pub(crate) candidates: Vec<PublicKey>,
    /// The leader's lease.
    pub(crate) lease_ms: u64,
    /// The manifest's failover mode (see [`RunManifest::failover`]).
    pub(crate) failover: u8,
    /// Where compiled artifacts are cached [default: `<data-dir>/artifacts`].
    pub(crate) artifacts_dir: Option<PathBuf>,
    /// Print the round table on stdout.
    pub(crate) table: bool,
    /// How contributions are screened.
    pub(crate) screen: Screen,
    /// The trimmed mean's fraction (0: the token-weighted mean).
    pub(crate) trim: f64,
    /// Workers overlap rounds (the manifest's `overlap`).
    pub(crate) overlap: bool,
    /// Streaming DiLoCo's fragments (1: the whole model each round); `rounds` and
    /// `tau` are then per sync: P × the rounds asked, τ/P steps.
    pub(super) fragments: u32,
    /// The blobs of recent rounds, and those pinned (`--keep-rounds`).
    pub(crate) retention: Retention,
    /// Its own engine: where it runs, and one a standby candidate loaded ahead.
    pub(crate) engine: OwnEngine,
    /// Who may join, and how far they are trusted.
    pub(crate) trust: Trust,
    /// The screen's split, withheld from the published corpus (set at start).
    pub(super) screen_split: Option<crate::training::data::Split>,
}

impl ShepherdPlan {
    /// The experiment the run trains.
    pub(crate) fn experiment(&self) -> &Experiment {
        &self.experiment
    }

    /// Resolves `args` (config file, flags, or the checkpoint with `--resume`).
    pub(crate) fn new(args: &ShepherdArgs, data_dir: &Path) -> Result<Self, Failure> {
        let state_dir = data_dir.join("shepherd");
        let mut resumed = if args.resume {
            Some(Checkpoint::load(&state_dir).map_err(|e| Failure::input(e.context("--resume")))?)
        } else {
            None
        };
        let candidates = args.candidate.iter().map(|c| parse_candidate(c)).collect::<Result<Vec<_>, _>>()?;
        let mut experiment = match (&resumed, &args.config) {
            (Some(c), _) => ShepherdMeta::of(c).map_err(Failure::input)?.experiment,
            (None, Some(path)) => Experiment::load_warned(path).map_err(Failure::input)?,
            (None, None) => Experiment { warmup_steps: 25, ..Experiment::default() },
        };
        if resumed.is_none() {
            experiment.override_with(args.model.as_ref(), args.data.as_ref(), args.lr, args.seed);
            experiment.tau = args.tau.unwrap_or(experiment.tau);
            experiment.outer_loop_steps = args.rounds.unwrap_or(experiment.outer_loop_steps);
            experiment.outer_lr = args.outer_lr.unwrap_or(experiment.outer_lr);
            experiment.nesterov_momentum = args.outer_momentum.unwrap_or(experiment.nesterov_momentum);
            experiment.set_precision(args.precision.as_deref()).map_err(Failure::input)?;
            experiment.set_recompute(args.recompute.as_deref()).map_err(Failure::input)?;
        } else if args.rounds.is_some() {
            // more rounds for a resumed run are allowed; everything else is the run's
            experiment.outer_loop_steps = args.rounds.unwrap_or(experiment.outer_loop_steps);
        }
        if experiment.tau == 0 || experiment.outer_loop_steps == 0 {
            return Err(Failure::input(anyhow::anyhow!("--tau and --rounds must be at least 1")));
        }
        let encoding = parse_encoding(&args.encoding, args.trim)?;
        if encoding.sparse().is_some() && args.outer_lr.is_none() && resumed.is_none() {
            experiment.outer_lr = SPARSE_OUTER_LR;
        }
        let corpus_path = match &experiment.data_path {
            Some(p) => PathBuf::from(p),
            None => default_corpus().ok_or_else(|| {
                Failure::input(anyhow::anyhow!("no --data given and no demo corpus found; run scripts/setup.sh"))
            })?,
        };
        experiment.data_path = Some(corpus_path.display().to_string());
        let corpus =
            Corpus::load(&corpus_path, &experiment.tokenizer, None, experiment.val_fraction).map_err(Failure::input)?;
        let source = experiment.model.clone().unwrap_or_else(|| "nanogpt-small".to_owned());
        experiment.model = Some(source.clone());
        let model = Model::load_with_batch(&source, experiment.vocab(corpus.vocab.size()), experiment.batch_size)
            .map_err(Failure::input)?;
        if let Some(c) = resumed.as_mut() {
            let names: Vec<String> = model.params.iter().map(|p| p.name.clone()).collect();
            let sizes: Vec<usize> = model.params.iter().map(|p| p.ty.elements().max(0) as usize).collect();
            super::setup::newest_state(c, &state_dir, data_dir, &names, &sizes)
                .map_err(|e| Failure::input(e.context("--resume")))?;
        }
        Self {
            rounds: experiment.outer_loop_steps,
            tau: experiment.tau,
            experiment,
            model,
            corpus_path,
            corpus,
            min_workers: args.min_workers.max(1),
            encoding,
            heartbeat_timeout_ms: args.heartbeat_timeout_ms.max(500),
            aggregation: Aggregation {
                threads: aggregate_threads(args.aggregate_threads),
                shards: args.aggregators,
                replicas: args.aggregator_replicas as usize,
                spot_rate: args.aggregator_spot_rate,
            },
            participants_inline: args.participants_inline,
            copy_check: !args.no_copy_check,
            start: resumed.map_or(Start::New, |c| Start::Resume(Box::new(c))),
            state_dir,
            candidates,
            lease_ms: args.lease_ms.max(500),
            failover: match args.failover.as_deref() {
                Some("majority") => 1,
                Some("best-effort") => 2,
                _ => 0,
            },
            artifacts_dir: None,
            table: true,
            screen: Screen::parse(&args.screen)?,
            trim: args.trim,
            overlap: !args.no_overlap,
            fragments: 1,
            retention: Retention::default(),
            engine: OwnEngine::on(Placement::cpu()),
            trust: Trust::from_args(&args.trust, pcp_protocol::admit::DEFAULT_POW_BITS)?,
            screen_split: None,
        }
        .with_fragments(args.fragments)
    }

    /// A plan for `sim`: everything from arguments, nothing from files.
    #[allow(clippy::too_many_arguments, reason = "sim's flags, passed through")]
    pub(crate) fn for_sim(
        experiment: Experiment,
        model: Model,
        corpus_path: PathBuf,
        corpus: Corpus,
        min_workers: usize,
        encoding: Encoding,
        heartbeat_timeout_ms: u64,
        state_dir: PathBuf,
    ) -> Self {
        Self {
            rounds: experiment.outer_loop_steps,
            tau: experiment.tau,
            experiment,
            model,
            corpus_path,
            corpus,
            min_workers,
            encoding,
            heartbeat_timeout_ms,
            aggregation: Aggregation::alone(),
            participants_inline: crate::diloco::participants::DEFAULT_INLINE,
            copy_check: true,
            start: Start::New,
            state_dir,
            candidates: Vec::new(),
            lease_ms: 5_000,
            failover: 0,
            artifacts_dir: None,
            table: true,
            screen: Screen::Score,
            trim: 0.0,
            overlap: false,
            fragments: 1,
            retention: Retention::default(),
            engine: OwnEngine::on(Placement::cpu()),
            trust: Trust::default(),
            screen_split: None,
        }
    }
}

/// How a round's contributions are added.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Aggregation {
    /// Threads adding contributions (`--aggregate-threads`; at least 1).
    pub(crate) threads: usize,
    /// Parameter shards volunteers sum (`--aggregators`; 0: the shepherd alone).
    pub(crate) shards: usize,
    /// Volunteers a shard (`--aggregator-replicas`).
    pub(crate) replicas: usize,
    /// The share of shards spot-checked (`--aggregator-spot-rate`).
    pub(crate) spot_rate: f64,
}

impl Aggregation {
    /// The shepherd adds alone, on every core.
    pub(crate) fn alone() -> Self {
        Self { threads: aggregate_threads(0), shards: 0, replicas: 2, spot_rate: 0.0 }
    }
}

/// `--aggregate-threads`: `n`, or every core of this machine for 0.
pub(crate) fn aggregate_threads(n: usize) -> usize {
    if n > 0 { n } else { std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get) }
}

impl ShepherdPlan {
    /// The plan with `p` Streaming DiLoCo fragments: P × the rounds, of τ/P steps.
    pub(crate) fn with_fragments(mut self, p: u32) -> Result<Self, Failure> {
        let p = p.max(1);
        let per_round = pcp_protocol::diloco::fragments::steps_per_round(self.tau, p as usize)
            .map_err(|e| Failure::input(anyhow::anyhow!("--fragments {p}: {e}")))?;
        let tensors = self.model.params.len();
        if p as usize > tensors {
            return Err(Failure::input(anyhow::anyhow!(
                "--fragments {p}: the model has only {tensors} parameter tensors"
            )));
        }
        self.rounds *= u64::from(p);
        self.tau = per_round;
        self.fragments = p;
        Ok(self)
    }

    /// A plan for a candidate elected for `term`: the run's manifest, experiment,
    /// model and corpus as fetched from the network, and the replicated state.
    #[allow(clippy::too_many_arguments, reason = "everything a successor inherits")]
    pub(crate) fn successor(
        manifest: RunManifest,
        experiment: Experiment,
        model: Model,
        corpus_path: PathBuf,
        corpus: Corpus,
        state: LeaderState,
        term: u64,
        data_dir: &Path,
        engine: OwnEngine,
    ) -> Result<Self, Failure> {
        let encoding = Encoding::parse(&manifest.encoding)
            .ok_or_else(|| Failure::input(anyhow::anyhow!("the run uses encoding {:?}", manifest.encoding)))?;
        let screen = Screen::parse(if manifest.screen.is_empty() { "score" } else { &manifest.screen })?;
        let trust = Trust::from_manifest(&manifest.admission)?;
        Ok(Self {
            rounds: manifest.rounds,
            tau: u64::from(manifest.inner_steps),
            experiment,
            model,
            corpus_path,
            corpus,
            min_workers: 1,
            encoding,
            heartbeat_timeout_ms: 10_000,
            // a successor sums alone (the run's spot-check rate kept)
            aggregation: Aggregation {
                spot_rate: f64::from(manifest.admission.aggregator_spot_rate),
                ..Aggregation::alone()
            },
            participants_inline: crate::diloco::participants::DEFAULT_INLINE,
            copy_check: true,
            candidates: manifest.candidates.iter().map(|k| PublicKey(*k)).collect(),
            lease_ms: manifest.lease_ms,
            failover: manifest.failover,
            screen,
            trim: f64::from(manifest.trim),
            overlap: manifest.overlap,
            fragments: manifest.fragments.max(1),
            start: Start::Succeed { manifest: Box::new(manifest), state: Box::new(state), term },
            state_dir: data_dir.join("shepherd"),
            artifacts_dir: None,
            table: true,
            retention: Retention::default(),
            engine,
            trust,
            screen_split: None,
        })
    }
}

/// A sparse run's outer learning rate unless `--outer-lr` says otherwise. The
/// averaged sparse update has no momentum (as in SparseLoCo, error feedback
/// stands in for it), and each kept entry is averaged with the workers that did
/// not keep it, so it is scaled up: 3 was best of 0.7, 1, 3, 4 and 8 (the
/// table in docs/diloco.md; 4 and 8 diverged).
pub(crate) const SPARSE_OUTER_LR: f64 = 3.0;

/// Parses `--encoding`, refusing the trimmed mean for sparse runs: it needs every
/// contribution at once, which sparse runs never keep.
pub(crate) fn parse_encoding(spec: &str, trim: f64) -> Result<Encoding, Failure> {
    let encoding = Encoding::parse_spec(spec).map_err(|e| Failure::input(anyhow::anyhow!("{e}")))?;
    if encoding.sparse().is_some() && trim > 0.0 {
        return Err(Failure::input(anyhow::anyhow!(
            "--trim cannot be used with --encoding sparse (the default; add --encoding fp32 for a trimmed mean): \
             the trimmed mean needs every contribution at once, and a sparse run adds each to one running sum"
        )));
    }
    Ok(encoding)
}
