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
use serde_json::json;
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::Failure;
use crate::config::Experiment;
use crate::diloco::{Hostile, ShepherdHooks, ShepherdPlan, WorkerArgs, WorkerPlan};
use crate::events::Events;
use crate::join::{NetArgs, Role, run_node};
use crate::model::Model;
use crate::train::{Corpus, DeviceArgs, default_corpus};

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
    /// Start one more worker when round ROUND opens.
    #[arg(long, value_name = "ROUND")]
    join_at: Option<u64>,
    /// Make worker NODE hostile: `nan:NODE` sends NaN, `scale:NODE` sends its
    /// pseudo-gradient ×1000, `flip:NODE` sends −Δ, `noise:NODE` random values at Δ's
    /// norm (repeatable).
    #[arg(long, value_name = "KIND:NODE")]
    hostile: Vec<String>,
    /// Pseudo-gradient encoding: fp32, bf16, int8, or `sparse` (SparseLoCo: chunked
    /// top-k with error feedback, sparse updates both ways;
    /// `sparse:chunk=4096,k=64,bits=2,decay=0.95,down=256` spells out the defaults).
    #[arg(long, default_value = "fp32")]
    encoding: String,
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
    /// Nodes 1..=K are standby coordinator candidates instead of workers: they
    /// replicate the shepherd's state each round and take over when its lease lapses.
    #[arg(long, default_value_t = 0, value_name = "K")]
    candidates: usize,
    /// Kill the shepherd (node 0) when round ROUND opens; a candidate takes over.
    #[arg(long, value_name = "ROUND", requires = "candidates")]
    kill_shepherd_at: Option<u64>,
    /// The leader's lease: candidates take over after this long without a heartbeat.
    #[arg(long, default_value_t = 5_000)]
    lease_ms: u64,
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
    let bad = || Failure::input(anyhow::anyhow!("--kill-at takes ROUND:NODE, got {spec:?}"));
    let (r, n) = spec.split_once(':').ok_or_else(bad)?;
    Ok((r.parse().map_err(|_| bad())?, n.parse().map_err(|_| bad())?))
}

fn parse_hostile(specs: &[String]) -> Result<BTreeMap<u32, Hostile>, Failure> {
    let mut hostile = BTreeMap::new();
    for spec in specs {
        let bad = || {
            Failure::input(anyhow::anyhow!(
                "--hostile takes nan:NODE, scale:NODE, flip:NODE or noise:NODE, got {spec:?}"
            ))
        };
        let (kind, node) = spec.split_once(':').ok_or_else(bad)?;
        hostile.insert(node.parse().map_err(|_| bad())?, Hostile::parse(kind).ok_or_else(bad)?);
    }
    Ok(hostile)
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
    let _metrics = crate::metrics::serve(net.metrics).await.map_err(Failure::input)?;
    let encoding = crate::diloco::parse_encoding(&args.encoding, args.trim)?;
    let outer_lr = match (args.outer_lr, encoding) {
        (Some(lr), _) => f64::from(lr),
        (None, Encoding::Sparse(_)) => crate::diloco::SPARSE_OUTER_LR,
        (None, _) => Experiment::default().outer_lr,
    };
    let kill_at = args.kill_at.as_deref().map(parse_kill).transpose()?;
    let hostile = parse_hostile(&args.hostile)?;
    let worker_args = WorkerArgs {
        backend: args.device.backend.clone(),
        target: args.device.target.clone(),
        ..WorkerArgs::default()
    };
    let worker_plan = WorkerPlan::new(&worker_args)?;
    let mut worker_plans = BTreeMap::new();
    for (node, args) in parse_worker_backends(&args.worker_backend)? {
        worker_plans.insert(node, WorkerPlan::new(&args)?);
    }
    let data_path = args.data.clone().or_else(default_corpus).ok_or_else(|| {
        Failure::input(anyhow::anyhow!("no --data given and no demo corpus found; run scripts/setup.sh"))
    })?;
    let corpus = Corpus::load(&data_path, "char", None, 0.1).map_err(Failure::input)?;
    let model = Model::load_with_batch(&args.model, corpus.vocab.size(), args.batch).map_err(Failure::input)?;
    let total = args.rounds * args.tau;
    let experiment = Experiment {
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

    // Every node gets its own directory; blobs from earlier sims are dropped, the
    // compiled artifacts kept.
    let root = net.data_dir.join("sim");
    let shepherd_dir = root.join("shepherd");
    let _ = std::fs::remove_dir_all(shepherd_dir.join("blobs"));
    let _ = std::fs::remove_dir_all(shepherd_dir.join("shepherd"));
    for entry in std::fs::read_dir(&root).into_iter().flatten().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with("worker-") || name.starts_with("candidate-") {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
    let candidate_dir = |n: u32| root.join(format!("candidate-{n}"));
    let mut candidate_keys = Vec::new();
    for n in 1..=args.candidates as u32 {
        candidate_keys.push(pcp_bootstrap::load_or_create(&candidate_dir(n))?.public());
    }
    let _wandb = crate::wandb::Bridge::start(Some(&experiment), "sim");
    let mut plan = ShepherdPlan::for_sim(
        experiment,
        model,
        data_path,
        corpus,
        args.nodes - 1 - args.candidates,
        encoding,
        args.heartbeat_timeout_ms,
        shepherd_dir.join("shepherd"),
    );
    plan.table = true;
    plan.screen = crate::diloco::Screen::parse(&args.screen)?;
    plan.trim = args.trim;
    plan.candidates = candidate_keys;
    plan.lease_ms = args.lease_ms.max(500);
    // share the compile cache of `train` and `generate` in the same data directory
    plan.artifacts_dir = Some(net.data_dir.join("artifacts"));
    let (opened_tx, mut opened) = mpsc::channel(16);
    let (replicated_tx, mut replicated) = mpsc::channel(64);
    let hooks = ShepherdHooks { opened: Some(opened_tx), replicated: None };
    let candidate_hooks = ShepherdHooks { replicated: Some(replicated_tx), ..hooks.clone() };
    let shepherd_net = NetArgs {
        bootstrap: Vec::new(),
        listen: loopback(),
        nat: Default::default(),
        data_dir: shepherd_dir,
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
    let events = Events::open(net.events.as_deref()).map_err(Failure::input)?;

    let mut workers: BTreeMap<u32, CancellationToken> = BTreeMap::new();
    let spawn = |n: u32, round: u64, nodes: &mut JoinSet<(u32, Result<(), Failure>)>| -> Result<_, Failure> {
        let dir = root.join(format!("worker-{n}"));
        let identity = pcp_bootstrap::load_or_create(&dir)?;
        let peer = pcp_bootstrap::keypair(&identity).public().to_peer_id();
        events.emit("worker_started", json!({"worker": n, "peer": peer.to_string(), "round": round}));
        let mut plan = worker_plans.get(&n).unwrap_or(&worker_plan).clone();
        plan.verbose = false;
        plan.hostile = hostile.get(&n).copied();
        let worker_net = NetArgs {
            bootstrap: vec![bootstrap.clone()],
            listen: loopback(),
            nat: Default::default(),
            data_dir: dir,
            events: None,
            metrics: None,
        };
        let token = cancel.child_token();
        let node_cancel = token.clone();
        nodes.spawn(async move { (n, run_node(&worker_net, Role::Worker(plan), false, None, node_cancel).await) });
        Ok(token)
    };
    for n in 1..=args.candidates as u32 {
        let candidate_net = NetArgs {
            bootstrap: vec![bootstrap.clone()],
            listen: loopback(),
            nat: Default::default(),
            data_dir: candidate_dir(n),
            events: net.events.clone(),
            metrics: None,
        };
        let role = Role::Candidate(None, candidate_hooks.clone());
        let token = cancel.child_token();
        nodes.spawn(async move { (n, run_node(&candidate_net, role, false, None, token).await) });
    }
    // the candidates stand by before round 1 can open, so that they hold every round
    let mut standing = 0;
    while standing < args.candidates {
        match tokio::time::timeout(Duration::from_secs(120), replicated.recv()).await {
            Ok(Some(None)) => standing += 1,
            Ok(Some(Some(_))) => {}
            _ => return Err(anyhow::anyhow!("the candidates did not stand by within 120 s").into()),
        }
    }
    for n in args.candidates as u32 + 1..args.nodes as u32 {
        workers.insert(n, spawn(n, 0, &mut nodes)?);
    }
    let leaders = args.candidates as u32;
    let mut shepherd_killed = false;
    // `--kill-shepherd-at R`: once round R is open and every candidate holds the state
    // after round R-1, the shepherd dies during round R
    let mut kill_when: Option<u64> = None;
    let mut holding: BTreeMap<u64, usize> = BTreeMap::new();
    let mut next = args.nodes as u32;
    let mut sigterm = crate::join::terminate_signal()?;
    let result = loop {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => break Err(anyhow::anyhow!("interrupted").into()),
            () = quit.cancelled() => break Err(anyhow::anyhow!("interrupted").into()),
            _ = sigterm.recv() => break Err(anyhow::anyhow!("terminated").into()),
            Some(Some(round)) = replicated.recv() => {
                *holding.entry(round).or_default() += 1;
                if kill_when.is_some_and(|r| holding.get(&(r - 1)).copied().unwrap_or(0) >= args.candidates) {
                    kill_when = None;
                    shepherd_killed = true;
                    shepherd_cancel.cancel();
                    events.emit("shepherd_killed", json!({"round": round + 1, "node": 0}));
                }
            }
            Some(round) = opened.recv() => {
                if args.kill_shepherd_at == Some(round) && !shepherd_killed {
                    if round == 1 || holding.get(&(round - 1)).copied().unwrap_or(0) >= args.candidates {
                        shepherd_killed = true;
                        shepherd_cancel.cancel();
                        events.emit("shepherd_killed", json!({"round": round, "node": 0}));
                    } else {
                        kill_when = Some(round);
                    }
                }
                if let Some((_, victim)) = kill_at.filter(|(r, _)| *r == round)
                    && let Some(token) = workers.remove(&victim)
                {
                    token.cancel();
                    events.emit("worker_killed", json!({"round": round, "worker": victim}));
                }
                if args.join_at == Some(round) {
                    workers.insert(next, spawn(next, round, &mut nodes)?);
                    next += 1;
                }
            }
            done = nodes.join_next() => match done {
                // the killed shepherd's node stops; the run goes on under a candidate
                Some(Ok((0, _))) if shepherd_killed => {}
                Some(Ok((n, result))) if n <= leaders => break result,
                Some(Ok((n, Err(e)))) => tracing::warn!("worker {n} failed: {:#}", e.error()),
                Some(Ok(_)) => {}
                Some(Err(e)) => break Err(anyhow::anyhow!("a node task failed: {e}").into()),
                None => break Ok(()),
            },
        }
    };
    cancel.cancel();
    while nodes.join_next().await.is_some() {}
    result
}
