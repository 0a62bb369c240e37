//! `pcp-node sim`: a whole DiLoCo run on one machine.
//!
//! The shepherd and every worker are real nodes, each with its own identity, data
//! directory and libp2p swarm listening on loopback; the workers join through the
//! shepherd's address exactly as `pcp-node --bootstrap …` does. They run in one
//! process so that a single command shows a whole network. `--kill-at` stops a
//! worker's node abruptly (its swarm and heartbeats vanish) and `--join-at` starts
//! one more when a round opens.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use pcp_bootstrap::Multiaddr;
use pcp_bootstrap::multiaddr::Protocol;
use pcp_protocol::diloco::compress::Encoding;
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::Failure;
use crate::commands::join::{NetArgs, Role, run_node};
use crate::commands::train::{Corpus, DeviceArgs, default_corpus};
use crate::diloco::{
    Attack, ReplaySlot, Retention, RetentionArgs, ShepherdHooks, ShepherdPlan, WorkerArgs, WorkerPlan,
};
use crate::observe::events::{Event, Events, ShepherdKilled, WorkerKilled, WorkerRestarted, WorkerStarted};
use crate::training::config::Experiment;
use crate::training::device::Placement;
use crate::training::model::Model;

#[derive(Debug, clap::Args)]
pub(crate) struct SimArgs {
    /// Nodes: one shepherd and N-1 workers.
    #[arg(long, default_value_t = 4)]
    nodes: usize,
    /// Outer rounds.
    #[arg(long, default_value_t = 5)]
    rounds: u64,
    /// Inner steps per round (τ).
    #[arg(long, default_value_t = 50)]
    tau: u64,
    /// nanogpt-small, nanogpt-medium or a .mlir loss module.
    #[arg(long, default_value = "nanogpt-small")]
    model: String,
    /// Sequences per inner step (presets only) [default: the preset's].
    #[arg(long)]
    batch: Option<usize>,
    /// The corpus [default: the demo corpus].
    #[arg(long)]
    data: Option<PathBuf>,
    /// Kill worker NODE (1-based) when round ROUND opens: `ROUND:NODE`.
    #[arg(long, value_name = "ROUND:NODE")]
    kill_at: Option<String>,
    /// Start killed worker NODE again, with its identity and data directory, when
    /// round ROUND opens: `ROUND:NODE`.
    #[arg(long, value_name = "ROUND:NODE")]
    restart_at: Option<String>,
    /// Start one more worker when round ROUND opens.
    #[arg(long, value_name = "ROUND")]
    join_at: Option<u64>,
    /// Make worker NODE hostile: `nan:NODE` sends NaN, `scale:NODE` its
    /// pseudo-gradient ×1000, `flip:NODE` −Δ, `noise:NODE` random values at Δ's norm,
    /// `inflate:NODE` noise claiming 10^12 samples, `concentrate:NODE` Δ's norm on four
    /// coordinates, `late:NODE` −Δ after the deadline, `drag:NODE` one step's Δ × 0.01
    /// at once, `sybil:N:NODE` N identities (NODE and N − 1 more) sending one random
    /// direction, `huge:NODE` ×10^6, `zero:NODE` Δ = 0, `copy:NODE` 4 × the last
    /// update, `replay:N:NODE` N identities sending one honest Δ, `timing:NODE` a claim
    /// of 1 ms, `early:NODE` junk at once, `sleeper:R:KIND:NODE` KIND after R honest
    /// rounds (repeatable).
    #[arg(long, value_name = "KIND:NODE")]
    hostile: Vec<String>,
    /// Make worker NODE a slower device: MS milliseconds longer per inner step
    /// (repeatable), to see time-boxed rounds and carried contributions.
    #[arg(long, value_name = "NODE:MS")]
    slow: Vec<String>,
    /// Pseudo-gradient encoding: `sparse` (SparseLoCo: chunked top-k with error
    /// feedback, sparse updates both ways;
    /// `sparse:chunk=64,k=4,bits=2,decay=0.5,down=8,downbits=4` spells out the
    /// defaults), fp32, bf16 or int8.
    #[arg(long, default_value = "sparse")]
    encoding: String,
    /// A round with more participants than this lists them in a blob the
    /// announcement names (the shepherd's `--participants-inline`).
    #[arg(long, default_value_t = crate::diloco::participants::DEFAULT_INLINE, value_name = "N")]
    participants_inline: usize,
    /// f32, or bf16: the step's matmuls and attention in bf16, weights, AdamW state,
    /// pseudo-gradients and loss in f32.
    #[arg(long, default_value = "f32")]
    precision: String,
    /// Activations the step's backward recomputes instead of keeping: none,
    /// attention, elementwise (the default: everything but the matmuls' outputs) or blocks.
    #[arg(long, default_value = "elementwise")]
    recompute: String,
    /// Workers train the next round while a round syncs, and rebase onto the
    /// shepherd's update when it arrives. The default; `--no-overlap` runs lockstep
    /// rounds.
    #[arg(long, overrides_with = "no_overlap")]
    overlap: bool,
    /// Lockstep rounds: workers wait for each round's update before training on.
    #[arg(long, overrides_with = "overlap")]
    no_overlap: bool,
    /// Streaming DiLoCo: P fragments by layer, one synced per round every τ/P inner
    /// steps (P × --rounds syncs).
    #[arg(long, default_value_t = 1, value_name = "P")]
    fragments: u32,
    /// Inner learning rate.
    #[arg(long, default_value_t = 3e-3)]
    lr: f64,
    /// Outer learning rate [default: 0.7; sparse runs: 3.0].
    #[arg(long)]
    outer_lr: Option<f32>,
    /// Outer Nesterov momentum.
    #[arg(long, default_value_t = 0.9)]
    outer_momentum: f32,
    /// Run seed.
    #[arg(long, default_value_t = 1337)]
    seed: u64,
    /// How the shepherd screens contributions: `score` (held-out loss of θ − Δ must
    /// fall) or `norm` (norm bound only).
    #[arg(long, default_value = "score")]
    screen: String,
    /// Aggregate by the coordinate-wise mean trimmed by this fraction at each end
    /// (with 3 or more contributions), instead of the token-weighted mean.
    #[arg(long, default_value_t = 0.0, value_parser = crate::diloco::parse_trim)]
    trim: f64,
    /// Cut each round's sum into N parameter shards summed by volunteers: every
    /// worker offers to aggregate (`--aggregate`), and the shepherd assigns
    /// --aggregator-replicas of them a shard (under the score screen, while
    /// committees screen: --screeners).
    #[arg(long, default_value_t = 0, value_name = "N")]
    aggregators: usize,
    /// Volunteers summing each shard.
    #[arg(long, default_value_t = 2, value_name = "R", value_parser = clap::value_parser!(u64).range(1..16))]
    aggregator_replicas: u64,
    /// The memory each aggregator's slices not yet accepted may take (`--aggregate-memory`);
    /// 0 keeps every one on disk until its accept comes.
    #[arg(long, value_name = "SIZE", value_parser = crate::training::memory::parse_size)]
    aggregate_memory: Option<u64>,
    /// The share of aggregated shards the shepherd spot-checks (sums itself).
    #[arg(long, default_value_t = pcp_protocol::diloco::aggregation::DEFAULT_SPOT_RATE, value_name = "RATE",
          value_parser = crate::diloco::parse_share)]
    aggregator_spot_rate: f64,
    /// A worker silent for this long is dropped.
    #[arg(long, default_value_t = 5_000)]
    heartbeat_timeout_ms: u64,
    #[command(flatten)]
    device: DeviceArgs,
    /// Run worker NODE on another backend than `--backend`, as a heterogeneous run:
    /// `1:cuda`, `2:rocm:gfx942`, `1:vulkan` (repeatable). The shepherd compiles one
    /// artifact per (backend, target) its workers announce.
    #[arg(long, value_name = "NODE:BACKEND[:TARGET]")]
    worker_backend: Vec<String>,
    /// Where the shepherd and the candidates screen and validate: `vulkan`,
    /// `cuda:sm_90`, … [default: `--backend` and `--target`]
    #[arg(long, value_name = "BACKEND[:TARGET]")]
    shepherd_backend: Option<String>,
    /// Nodes 1..=K are standby coordinator candidates instead of workers: they
    /// replicate the shepherd's state each round and take over when its lease lapses.
    #[arg(long, default_value_t = 0, value_name = "K")]
    candidates: usize,
    /// Kill the shepherd (node 0) when round ROUND opens; a candidate takes over.
    #[arg(long, value_name = "ROUND", requires = "candidates")]
    kill_shepherd_at: Option<u64>,
    /// The leader's lease: candidates take over after this long without a heartbeat.
    /// Workers heartbeat at most half of it apart.
    #[arg(long, default_value_t = pcp_protocol::diloco::liveness::DEFAULT_LEASE_MS)]
    lease_ms: u64,
    #[command(flatten)]
    pub(crate) retention: RetentionArgs,
    #[command(flatten)]
    pub(crate) trust: crate::diloco::TrustArgs,
}

/// `--worker-backend` specs: worker → (backend, target).
fn parse_worker_backends(specs: &[String]) -> Result<BTreeMap<u32, WorkerArgs>, Failure> {
    let mut backends = BTreeMap::new();
    for spec in specs {
        let bad = || Failure::input(anyhow::anyhow!("--worker-backend takes NODE:BACKEND[:TARGET], got {spec:?}"));
        let mut parts = spec.splitn(3, ':');
        let node: u32 = parts.next().and_then(|n| n.parse().ok()).filter(|n| *n > 0).ok_or_else(bad)?;
        let backend = parts.next().filter(|b| !b.is_empty()).ok_or_else(bad)?.to_owned();
        let target = parts.next().map(str::to_owned);
        backends.insert(node, WorkerArgs { backend, target, ..WorkerArgs::default() });
    }
    Ok(backends)
}

fn parse_kill(spec: &str) -> Result<(u64, u32), Failure> {
    let bad = || Failure::input(anyhow::anyhow!("--kill-at and --restart-at take ROUND:NODE, got {spec:?}"));
    let (r, n) = spec.split_once(':').ok_or_else(bad)?;
    Ok((r.parse().map_err(|_| bad())?, n.parse().map_err(|_| bad())?))
}

fn parse_hostile(specs: &[String]) -> Result<BTreeMap<u32, Attack>, Failure> {
    let mut hostile = BTreeMap::new();
    for spec in specs {
        let bad = || {
            Failure::input(anyhow::anyhow!(
                "--hostile takes KIND:NODE, KIND one of {}, got {spec:?}",
                crate::diloco::HOSTILE_KINDS
            ))
        };
        let (kind, node) = spec.rsplit_once(':').ok_or_else(bad)?;
        hostile.insert(node.parse().map_err(|_| bad())?, Attack::parse(kind).ok_or_else(bad)?);
    }
    Ok(hostile)
}

fn parse_slow(specs: &[String]) -> Result<BTreeMap<u32, Duration>, Failure> {
    let mut slow = BTreeMap::new();
    for spec in specs {
        let bad = || Failure::input(anyhow::anyhow!("--slow takes NODE:MS, got {spec:?}"));
        let (node, ms) = spec.split_once(':').ok_or_else(bad)?;
        slow.insert(node.parse().map_err(|_| bad())?, Duration::from_millis(ms.parse().map_err(|_| bad())?));
    }
    Ok(slow)
}

/// Loopback listening on ephemeral ports (TCP only: one less handshake per node).
fn loopback() -> Vec<Multiaddr> {
    vec![Multiaddr::empty().with(Protocol::Ip4(std::net::Ipv4Addr::LOCALHOST)).with(Protocol::Tcp(0))]
}

/// Runs the sim until its run ends, the process is interrupted, or `quit` (the
/// dashboard's `q`) is cancelled.
pub(crate) async fn run(args: SimArgs, net: &NetArgs, quit: CancellationToken) -> Result<(), Failure> {
    if args.nodes < 2 + args.candidates {
        return Err(Failure::input(anyhow::anyhow!(
            "--nodes must be at least 2 + --candidates (a shepherd, the candidates and a worker)"
        )));
    }
    let _metrics = crate::observe::metrics::serve(net.metrics).await.map_err(Failure::input)?;
    let churn = Churn {
        kill_at: args.kill_at.as_deref().map(parse_kill).transpose()?,
        restart_at: args.restart_at.as_deref().map(parse_kill).transpose()?,
        join_at: args.join_at,
        next: 0,
    };
    let worker_args = WorkerArgs {
        backend: args.device.backend.clone(),
        target: args.device.target.clone(),
        aggregate: args.aggregators > 0,
        aggregate_memory: args.aggregate_memory,
        ..WorkerArgs::default()
    };
    let worker_plan = WorkerPlan::new(&worker_args)?;
    let worker_plans = parse_worker_backends(&args.worker_backend)?
        .into_iter()
        .map(|(n, a)| Ok((n, WorkerPlan::new(&a)?)))
        .collect::<Result<_, Failure>>()?;
    // `sybil:N:NODE`, `replay:N:NODE`: NODE and N − 1 more identities, numbered after
    // the others; a replay's share one slot
    let mut hostile: BTreeMap<u32, (Attack, Option<ReplaySlot>)> = BTreeMap::new();
    let mut next = args.nodes as u32;
    for (node, attack) in parse_hostile(&args.hostile)? {
        let slot = matches!(attack.kind, crate::diloco::Hostile::Replay(_)).then(ReplaySlot::default);
        hostile.insert(node, (attack, slot.clone()));
        for _ in 1..attack.kind.identities() {
            hostile.insert(next, (attack, slot.clone()));
            next += 1;
        }
    }
    let slow = parse_slow(&args.slow)?;
    let churn = Churn { next, ..churn };
    // Every node gets its own directory; blobs from earlier sims are dropped, the
    // compiled artifacts kept.
    let root = net.data_dir.join("sim");
    clear(&root);
    let own = own_placement(&args)?;
    let mut plan = shepherd_plan(&args, net, &root)?;
    plan.engine.on = own.clone();
    let _wandb = crate::observe::wandb::Bridge::start(Some(plan.experiment()), "sim");
    let (opened_tx, opened) = mpsc::channel(16);
    let (replicated_tx, replicated) = mpsc::channel(64);
    let hooks = ShepherdHooks { opened: Some(opened_tx), replicated: None };
    let candidate_hooks = ShepherdHooks { replicated: Some(replicated_tx), ..hooks.clone() };
    let shepherd_net = NetArgs {
        bootstrap: Vec::new(),
        listen: loopback(),
        nat: Default::default(),
        data_dir: root.join("shepherd"),
        events: net.events.clone(),
        metrics: None,
    };
    let cancel = CancellationToken::new();
    let mut nodes: JoinSet<(u32, Result<(), Failure>)> = JoinSet::new();
    let (addr_tx, mut addrs) = mpsc::channel(8);
    let shepherd_cancel = cancel.child_token();
    {
        let cancel = shepherd_cancel.clone();
        let role = Role::Shepherd(Box::new(plan), hooks);
        nodes.spawn(async move { (0, run_node(&shepherd_net, role, false, Some(addr_tx), cancel).await) });
    }
    let shepherd_addr = tokio::time::timeout(Duration::from_secs(30), addrs.recv())
        .await
        .ok()
        .flatten()
        .ok_or_else(|| anyhow::anyhow!("the shepherd's node did not start listening"))?;
    let shepherd_peer = pcp_bootstrap::load_or_create(&root.join("shepherd"))?;
    let bootstrap = shepherd_addr.with(Protocol::P2p(pcp_bootstrap::keypair(&shepherd_peer).public().to_peer_id()));
    let mut cluster = Cluster {
        worker_plan,
        worker_plans,
        hostile,
        slow,
        keep_rounds: args.retention.keep(),
        own,
        events: Events::open(net.events.as_deref()).map_err(Failure::input)?,
        events_path: net.events.clone(),
        root,
        bootstrap,
        cancel,
        nodes,
        workers: BTreeMap::new(),
    };
    let replicated = cluster.stand_by(&args, candidate_hooks, replicated).await?;
    let kill = ShepherdKill {
        at: args.kill_shepherd_at,
        when: None,
        killed: false,
        holding: BTreeMap::new(),
        candidates: args.candidates,
        token: shepherd_cancel,
    };
    let result = cluster.direct(args.candidates as u32, churn, kill, (opened, replicated), quit).await;
    cluster.cancel.cancel();
    while cluster.nodes.join_next().await.is_some() {}
    result
}

/// Drops the blobs, checkpoints and worker and candidate directories of an earlier
/// sim under `root`; the compiled artifacts stay.
fn clear(root: &std::path::Path) {
    let shepherd_dir = root.join("shepherd");
    let _ = std::fs::remove_dir_all(shepherd_dir.join("blobs"));
    let _ = std::fs::remove_dir_all(shepherd_dir.join("shepherd"));
    for entry in std::fs::read_dir(root).into_iter().flatten().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with("worker-") || name.starts_with("candidate-") {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

/// The shepherd's plan from sim's flags: the experiment, model, corpus and run settings.
fn shepherd_plan(args: &SimArgs, net: &NetArgs, root: &std::path::Path) -> Result<ShepherdPlan, Failure> {
    let encoding = crate::diloco::parse_encoding(&args.encoding, args.trim)?;
    let outer_lr = match (args.outer_lr, encoding) {
        (Some(lr), _) => f64::from(lr),
        (None, Encoding::Sparse(_)) => crate::diloco::SPARSE_OUTER_LR,
        (None, _) => Experiment::default().outer_lr,
    };
    let data_path = args.data.clone().or_else(default_corpus).ok_or_else(|| {
        Failure::input(anyhow::anyhow!("no --data given and no demo corpus found; run scripts/setup.sh"))
    })?;
    let corpus = Corpus::load(&data_path, "char", None, 0.1).map_err(Failure::input)?;
    let model = Model::load_with_batch(&args.model, corpus.vocab.size(), args.batch).map_err(Failure::input)?;
    let total = args.rounds * args.tau;
    let mut experiment = Experiment {
        model: Some(args.model.clone()),
        data_path: Some(data_path.display().to_string()),
        learning_rate: args.lr,
        min_lr: args.lr / 10.0,
        warmup_steps: (total / 20).min(100),
        seed: args.seed,
        batch_size: args.batch,
        tau: args.tau,
        outer_loop_steps: args.rounds,
        outer_lr,
        nesterov_momentum: f64::from(args.outer_momentum),
        ..Experiment::default()
    };
    experiment.set_precision(Some(&args.precision)).map_err(Failure::input)?;
    experiment.set_recompute(Some(&args.recompute)).map_err(Failure::input)?;
    let mut candidates = Vec::new();
    for n in 1..=args.candidates as u32 {
        candidates.push(pcp_bootstrap::load_or_create(&candidate_dir(root, n))?.public());
    }
    let mut plan = ShepherdPlan::for_sim(
        experiment,
        model,
        data_path,
        corpus,
        args.nodes - 1 - args.candidates,
        encoding,
        args.heartbeat_timeout_ms,
        root.join("shepherd").join("shepherd"),
    );
    plan.table = true;
    plan.screen = crate::diloco::Screen::parse(&args.screen)?;
    plan.trust = crate::diloco::Trust::from_args(&args.trust, 0)?;
    plan.trim = args.trim;
    plan.aggregation.shards = args.aggregators;
    plan.aggregation.replicas = args.aggregator_replicas as usize;
    plan.aggregation.spot_rate = args.aggregator_spot_rate;
    plan.overlap = !args.no_overlap;
    plan.participants_inline = args.participants_inline;
    let mut plan = plan.with_fragments(args.fragments)?;
    plan.candidates = candidates;
    plan.retention = Retention::new(args.retention.keep());
    plan.lease_ms = args.lease_ms.max(500);
    // share the compile cache of `train` and `generate` in the same data directory
    plan.artifacts_dir = Some(net.data_dir.join("artifacts"));
    Ok(plan)
}

/// `--shepherd-backend`, or `--backend` and `--target`: where the shepherd and
/// the candidates run their own engines.
fn own_placement(args: &SimArgs) -> Result<Placement, Failure> {
    let (backend, target) = match &args.shepherd_backend {
        Some(spec) => match spec.split_once(':') {
            Some((b, t)) => (b.to_owned(), Some(t.to_owned())),
            None => (spec.clone(), None),
        },
        None => (args.device.backend.clone(), args.device.target.clone()),
    };
    Placement::resolve(&backend, target.as_deref())
        .map_err(|e| Failure::input(e.context("the shepherd's engine (--shepherd-backend)")))
}

fn candidate_dir(root: &std::path::Path, n: u32) -> PathBuf {
    root.join(format!("candidate-{n}"))
}

/// The sim's nodes besides the shepherd, and what it needs to start more.
struct Cluster {
    worker_plan: WorkerPlan,
    /// `--worker-backend`'s plans, by worker.
    worker_plans: BTreeMap<u32, WorkerPlan>,
    /// `--hostile`, by worker, with a replay group's slot.
    hostile: BTreeMap<u32, (Attack, Option<ReplaySlot>)>,
    /// `--slow`: extra time per inner step, by worker.
    slow: BTreeMap<u32, Duration>,
    keep_rounds: usize,
    /// Where the candidates' engines run (`--shepherd-backend`).
    own: Placement,
    events: Events,
    /// `--events`: the candidates write there too.
    events_path: Option<PathBuf>,
    root: PathBuf,
    /// The shepherd's address.
    bootstrap: Multiaddr,
    cancel: CancellationToken,
    nodes: JoinSet<(u32, Result<(), Failure>)>,
    /// Running workers, by number.
    workers: BTreeMap<u32, CancellationToken>,
}

impl Cluster {
    fn net(&self, data_dir: PathBuf, events: Option<PathBuf>) -> NetArgs {
        NetArgs {
            bootstrap: vec![self.bootstrap.clone()],
            listen: loopback(),
            nat: Default::default(),
            data_dir,
            events,
            metrics: None,
        }
    }

    /// Starts worker `n` (again, after a kill: same identity and directory).
    fn spawn_worker(&mut self, n: u32, round: u64) -> Result<(), Failure> {
        let dir = self.root.join(format!("worker-{n}"));
        let identity = pcp_bootstrap::load_or_create(&dir)?;
        let peer = pcp_bootstrap::keypair(&identity).public().to_peer_id();
        self.events.emit(Event::WorkerStarted(WorkerStarted { worker: n as u64, peer: peer.to_string(), round }));
        let mut plan = self.worker_plans.get(&n).unwrap_or(&self.worker_plan).clone();
        plan.verbose = false;
        if let Some((attack, slot)) = self.hostile.get(&n) {
            plan.hostile = Some(*attack);
            plan.replay = slot.clone();
        }
        plan.step_delay = self.slow.get(&n).copied();
        plan.keep_rounds = self.keep_rounds;
        // each worker's own record (utilization, merges, sends) beside its store
        let worker_net = self.net(dir.clone(), Some(dir.join("events.jsonl")));
        let token = self.cancel.child_token();
        let node_cancel = token.clone();
        self.nodes.spawn(async move { (n, run_node(&worker_net, Role::Worker(plan), false, None, node_cancel).await) });
        self.workers.insert(n, token);
        Ok(())
    }

    /// Starts the candidates and, once they stand by (so that they hold every
    /// round), the workers.
    async fn stand_by(
        &mut self,
        args: &SimArgs,
        hooks: ShepherdHooks,
        mut replicated: mpsc::Receiver<Option<u64>>,
    ) -> Result<mpsc::Receiver<Option<u64>>, Failure> {
        for n in 1..=args.candidates as u32 {
            let candidate_net = self.net(candidate_dir(&self.root, n), self.events_path.clone());
            let role = Role::Candidate(None, hooks.clone(), Retention::new(self.keep_rounds), self.own.clone());
            let token = self.cancel.child_token();
            self.nodes.spawn(async move { (n, run_node(&candidate_net, role, false, None, token).await) });
        }
        let mut standing = 0;
        while standing < args.candidates {
            match tokio::time::timeout(Duration::from_secs(120), replicated.recv()).await {
                Ok(Some(None)) => standing += 1,
                Ok(Some(Some(_))) => {}
                _ => return Err(anyhow::anyhow!("the candidates did not stand by within 120 s").into()),
            }
        }
        for n in args.candidates as u32 + 1..args.nodes as u32 {
            self.spawn_worker(n, 0)?;
        }
        // the other identities of `sybil:N:NODE` attackers
        let extra: Vec<u32> = self.hostile.keys().copied().filter(|n| *n >= args.nodes as u32).collect();
        for n in extra {
            self.spawn_worker(n, 0)?;
        }
        Ok(replicated)
    }

    /// Runs the sim until the leader's node ends: kills, restarts and joins as
    /// rounds open, the shepherd's kill once the candidates hold the state.
    async fn direct(
        &mut self,
        leaders: u32,
        mut churn: Churn,
        mut kill: ShepherdKill,
        (mut opened, mut replicated): (mpsc::Receiver<u64>, mpsc::Receiver<Option<u64>>),
        quit: CancellationToken,
    ) -> Result<(), Failure> {
        let mut sigterm = crate::commands::join::terminate_signal()?;
        loop {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => return Err(anyhow::anyhow!("interrupted").into()),
                () = quit.cancelled() => return Err(anyhow::anyhow!("interrupted").into()),
                _ = sigterm.recv() => return Err(anyhow::anyhow!("terminated").into()),
                Some(Some(round)) = replicated.recv() => kill.replicated(round, &self.events),
                Some(round) = opened.recv() => {
                    kill.opened(round, &self.events);
                    self.churn(&mut churn, round)?;
                }
                done = self.nodes.join_next() => match done {
                    // the killed shepherd's node stops; the run goes on under a candidate
                    Some(Ok((0, _))) if kill.killed => {}
                    Some(Ok((n, result))) if n <= leaders => return result,
                    Some(Ok((n, Err(e)))) => tracing::warn!("worker {n} failed: {:#}", e.error()),
                    Some(Ok(_)) => {}
                    Some(Err(e)) => return Err(anyhow::anyhow!("a node task failed: {e}").into()),
                    None => return Ok(()),
                },
            }
        }
    }

    /// `--kill-at`, `--restart-at` and `--join-at` when `round` opens.
    fn churn(&mut self, churn: &mut Churn, round: u64) -> Result<(), Failure> {
        if let Some((_, victim)) = churn.kill_at.filter(|(r, _)| *r == round)
            && let Some(token) = self.workers.remove(&victim)
        {
            token.cancel();
            self.events.emit(Event::WorkerKilled(WorkerKilled { round, worker: victim as u64 }));
        }
        if let Some((_, n)) = churn.restart_at.filter(|(r, n)| *r == round && !self.workers.contains_key(n)) {
            self.spawn_worker(n, round)?;
            self.events.emit(Event::WorkerRestarted(WorkerRestarted { round, worker: n as u64 }));
        }
        if churn.join_at == Some(round) {
            self.spawn_worker(churn.next, round)?;
            churn.next += 1;
        }
        Ok(())
    }
}

/// Workers killed, restarted and added as rounds open.
#[derive(Debug, Clone, Copy)]
struct Churn {
    kill_at: Option<(u64, u32)>,
    restart_at: Option<(u64, u32)>,
    join_at: Option<u64>,
    /// The number the next joiner gets.
    next: u32,
}

/// `--kill-shepherd-at R`: once round R is open and every candidate holds the
/// state after round R−1, the shepherd dies during round R.
#[derive(Debug)]
struct ShepherdKill {
    at: Option<u64>,
    /// A round that opened before the candidates held the state before it.
    when: Option<u64>,
    killed: bool,
    /// Candidates holding each round's state.
    holding: BTreeMap<u64, usize>,
    candidates: usize,
    token: CancellationToken,
}

impl ShepherdKill {
    fn kill(&mut self, round: u64, events: &Events) {
        self.killed = true;
        self.token.cancel();
        events.emit(Event::ShepherdKilled(ShepherdKilled { round, node: 0 }));
    }

    /// A candidate holds the state after `round`.
    fn replicated(&mut self, round: u64, events: &Events) {
        *self.holding.entry(round).or_default() += 1;
        if self.when.is_some_and(|r| self.holding.get(&(r - 1)).copied().unwrap_or(0) >= self.candidates) {
            self.when = None;
            self.kill(round + 1, events);
        }
    }

    /// Round `round` opened.
    fn opened(&mut self, round: u64, events: &Events) {
        if self.at == Some(round) && !self.killed {
            if round == 1 || self.holding.get(&(round - 1)).copied().unwrap_or(0) >= self.candidates {
                self.kill(round, events);
            } else {
                self.when = Some(round);
            }
        }
    }
}
