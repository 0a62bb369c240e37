//! `pcp-node sim`: a whole DiLoCo run on one machine.
//!
//! The shepherd and every worker run the `protocol::diloco` state machines
//! with their own IREE session (their own device-resident parameters and
//! AdamW state). Today they exchange messages over in-process channels:
//! round announcements carry the parameters, contributions carry the encoded
//! pseudo-gradient (fp32, bf16 or int8) exactly as they will on the wire.

use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use pcp_protocol::diloco::Tensors;
use pcp_protocol::diloco::compress::{self, Encoding};
use pcp_protocol::diloco::shepherd::{self, Action, Input, Shepherd};
use pcp_protocol::diloco::worker::{self, Worker};
use serde_json::json;
use tokio::sync::mpsc;
use tokio::task::JoinSet;

use crate::Failure;
use crate::config::Experiment;
use crate::data::Sampler;
use crate::events::Events;
use crate::join::NetArgs;
use crate::model::Model;
use crate::train::{Corpus, DeviceArgs, default_corpus, learning_rate, load_engine};

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
    /// pseudo-gradient ×1000 (repeatable).
    #[arg(long, value_name = "KIND:NODE")]
    hostile: Vec<String>,
    /// Pseudo-gradient encoding: fp32, bf16 or int8.
    #[arg(long, default_value = "fp32")]
    encoding: String,
    /// Inner learning rate.
    #[arg(long, default_value_t = 3e-3)]
    lr: f64,
    /// Outer learning rate.
    #[arg(long, default_value_t = 0.7)]
    outer_lr: f32,
    /// Outer Nesterov momentum.
    #[arg(long, default_value_t = 0.9)]
    outer_momentum: f32,
    /// Run seed.
    #[arg(long, default_value_t = 1337)]
    seed: u64,
    #[command(flatten)]
    device: DeviceArgs,
}

/// Messages from workers to the shepherd.
#[derive(Debug)]
enum Up {
    Joined(u32),
    Heartbeat(u32),
    Contribution { peer: u32, round: u64, samples: u64, loss: f32, bytes: Vec<u8> },
}

/// A round announcement: parameters and deadline.
#[derive(Debug, Clone)]
struct Round {
    round: u64,
    deadline_ms: u64,
    params: std::sync::Arc<Tensors>,
}

fn now_ms(start: Instant) -> u64 {
    start.elapsed().as_millis() as u64
}

/// How a hostile worker corrupts its pseudo-gradient.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Hostile {
    Nan,
    Scale(f32),
}

struct WorkerCtx {
    peer: u32,
    hostile: Option<Hostile>,
    tau: u64,
    total_steps: u64,
    lr: f64,
    seed: u64,
    encoding: Encoding,
    batch: usize,
    block: usize,
    up: mpsc::Sender<Up>,
    start: Instant,
}

async fn worker_task(
    ctx: WorkerCtx,
    mut engine: crate::engine::Engine,
    train: crate::data::Split,
    mut rounds: mpsc::Receiver<Round>,
) -> anyhow::Result<()> {
    let mut machine = Worker::new(ctx.peer.to_le_bytes().to_vec(), ctx.seed, ctx.tau);
    let mut inner_step = 0u64;
    ctx.up.send(Up::Joined(ctx.peer)).await.ok();
    let mut heartbeat = tokio::time::interval(Duration::from_millis(500));
    loop {
        let round = tokio::select! {
            r = rounds.recv() => match r { Some(r) => r, None => return Ok(()) },
            _ = heartbeat.tick() => {
                ctx.up.send(Up::Heartbeat(ctx.peer)).await.ok();
                continue;
            }
        };
        let mut actions = machine.handle(
            worker::Input::RoundOpened { round: round.round, deadline_ms: round.deadline_ms, participant: true },
            now_ms(ctx.start),
        );
        while let Some(action) = actions.pop() {
            match action {
                worker::Action::FetchParams(r) => {
                    engine.set_params(round.params.as_ref().clone()).await?;
                    actions.extend(machine.handle(worker::Input::ParamsReady(r), now_ms(ctx.start)));
                }
                worker::Action::Train { round: r, steps, seed } => {
                    let mut sampler = Sampler::new(train.clone(), ctx.batch, ctx.block, seed)?;
                    let mut loss_sum = 0.0f64;
                    for _ in 0..steps {
                        inner_step += 1;
                        let lr = learning_rate(
                            inner_step,
                            ctx.total_steps,
                            ctx.lr,
                            ctx.lr / 10.0,
                            (ctx.total_steps / 20).min(100),
                        );
                        loss_sum += f64::from(engine.step(inner_step, lr as f32, &sampler.next_batch()).await?);
                        if heartbeat_due(&mut heartbeat) {
                            ctx.up.send(Up::Heartbeat(ctx.peer)).await.ok();
                        }
                    }
                    let end = engine.params().await?;
                    let mut delta: Tensors = round
                        .params
                        .iter()
                        .zip(&end)
                        .map(|(s, e)| s.iter().zip(e).map(|(s, e)| s - e).collect())
                        .collect();
                    match ctx.hostile {
                        Some(Hostile::Nan) => delta[0][0] = f32::NAN,
                        Some(Hostile::Scale(k)) => delta.iter_mut().flatten().for_each(|v| *v *= k),
                        None => {}
                    }
                    let bytes = compress::encode(&delta, ctx.encoding);
                    let samples = steps * (ctx.batch * ctx.block) as u64;
                    let loss = (loss_sum / steps.max(1) as f64) as f32;
                    ctx.up.send(Up::Contribution { peer: ctx.peer, round: r, samples, loss, bytes }).await.ok();
                    actions.extend(machine.handle(worker::Input::Trained(r), now_ms(ctx.start)));
                }
                worker::Action::Send(r) => {
                    actions.extend(machine.handle(worker::Input::Sent(r), now_ms(ctx.start)));
                }
                worker::Action::Abandon(_) => {}
            }
        }
    }
}

fn heartbeat_due(interval: &mut tokio::time::Interval) -> bool {
    use std::task::{Context, Poll};
    let waker = std::task::Waker::noop();
    matches!(interval.poll_tick(&mut Context::from_waker(waker)), Poll::Ready(_))
}

pub(crate) async fn run(args: SimArgs, net: &NetArgs) -> Result<(), Failure> {
    if args.nodes < 2 {
        return Err(Failure::input(anyhow::anyhow!("--nodes must be at least 2 (a shepherd and a worker)")));
    }
    let encoding = Encoding::parse(&args.encoding).ok_or_else(|| {
        Failure::input(anyhow::anyhow!("unknown --encoding {:?}; expected fp32, bf16 or int8", args.encoding))
    })?;
    let kill_at = match &args.kill_at {
        Some(spec) => {
            let (r, n) = spec
                .split_once(':')
                .ok_or_else(|| Failure::input(anyhow::anyhow!("--kill-at takes ROUND:NODE, got {spec:?}")))?;
            let parse = |s: &str| {
                s.parse::<u64>()
                    .map_err(|_| Failure::input(anyhow::anyhow!("--kill-at takes ROUND:NODE, got {spec:?}")))
            };
            Some((parse(r)?, parse(n)? as u32))
        }
        None => None,
    };
    let mut hostile = BTreeMap::new();
    for spec in &args.hostile {
        let bad = || Failure::input(anyhow::anyhow!("--hostile takes nan:NODE or scale:NODE, got {spec:?}"));
        let (kind, node) = spec.split_once(':').ok_or_else(bad)?;
        let node: u32 = node.parse().map_err(|_| bad())?;
        let kind = match kind {
            "nan" => Hostile::Nan,
            "scale" => Hostile::Scale(1000.0),
            _ => return Err(bad()),
        };
        hostile.insert(node, kind);
    }
    let data_path = args.data.clone().or_else(default_corpus).ok_or_else(|| {
        Failure::input(anyhow::anyhow!("no --data given and no demo corpus found; run scripts/setup.sh"))
    })?;
    let corpus = Corpus::load(&data_path, "char", None, 0.1).map_err(Failure::input)?;
    let model = Model::load(&args.model, corpus.vocab.size()).map_err(Failure::input)?;
    let (batch, block) = model.batch_block()?;
    let experiment = Experiment {
        model: Some(args.model.clone()),
        learning_rate: args.lr,
        seed: args.seed,
        ..Experiment::default()
    };
    let events = Events::open(net.events.as_deref()).map_err(Failure::input)?;
    let start = Instant::now();

    let mut shepherd_engine =
        load_engine(&experiment, &model, &args.device, &net.data_dir, None).await.map_err(Failure::input)?;
    let params = model.init(args.seed);
    let param_bytes: u64 = params.iter().map(|p| 4 * p.len() as u64).sum();
    let sizes: Vec<usize> = params.iter().map(Vec::len).collect();
    let config = shepherd::Config {
        rounds: args.rounds,
        start_workers: args.nodes - 1,
        initial_deadline_ms: 600_000,
        min_deadline_ms: 10_000,
        heartbeat_timeout_ms: 5_000,
        outer_lr: args.outer_lr,
        outer_momentum: args.outer_momentum,
        ..shepherd::Config::default()
    };
    let mut shepherd = Shepherd::<u32>::new(config, params);
    let (up_tx, mut up_rx) = mpsc::channel::<Up>(64);
    let mut workers: BTreeMap<u32, mpsc::Sender<Round>> = BTreeMap::new();
    let mut tasks: JoinSet<(u32, anyhow::Result<()>)> = JoinSet::new();
    let mut handles: BTreeMap<u32, tokio::task::AbortHandle> = BTreeMap::new();
    let total_steps = args.rounds * args.tau;

    let spawn = |peer: u32,
                 tasks: &mut JoinSet<(u32, anyhow::Result<()>)>,
                 engine,
                 workers: &mut BTreeMap<u32, mpsc::Sender<Round>>| {
        let (tx, rx) = mpsc::channel(4);
        workers.insert(peer, tx);
        let ctx = WorkerCtx {
            peer,
            hostile: hostile.get(&peer).copied(),
            tau: args.tau,
            total_steps,
            lr: args.lr,
            seed: args.seed,
            encoding,
            batch,
            block,
            up: up_tx.clone(),
            start,
        };
        let train = corpus.train.clone();
        tasks.spawn(async move { (peer, worker_task(ctx, engine, train, rx).await) })
    };
    for peer in 1..args.nodes as u32 {
        let engine = load_engine(&experiment, &model, &args.device, &net.data_dir, None).await?;
        let handle = spawn(peer, &mut tasks, engine, &mut workers);
        handles.insert(peer, handle);
    }

    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "sim: 1 shepherd + {} workers, {} rounds of τ={} on {} ({} parameters, {:.2} MB), {} pseudo-gradients",
        args.nodes - 1,
        args.rounds,
        args.tau,
        args.model,
        sizes.iter().sum::<usize>(),
        param_bytes as f64 / 1e6,
        encoding.name()
    )?;
    writeln!(
        out,
        "{:>5} {:>12} {:>10} {:>10} {:>8} {:>9} {:>9}",
        "round", "contributors", "mean loss", "val loss", "seconds", "MB sent", "MB recv"
    )?;
    let mut bytes_in = 0u64;
    let mut bytes_out = 0u64;
    let mut next_peer = args.nodes as u32;
    let mut tick = tokio::time::interval(Duration::from_millis(200));
    let mut last_val = f64::NAN;
    loop {
        let input = tokio::select! {
            Some(msg) = up_rx.recv() => match msg {
                Up::Joined(p) => Input::Joined(p),
                Up::Heartbeat(p) => Input::Heartbeat(p),
                Up::Contribution { peer, round, samples, loss, bytes } => {
                    bytes_in += bytes.len() as u64;
                    match compress::decode(&bytes, &sizes) {
                        Ok((delta, _)) => Input::Contribution { peer, round, samples, loss, delta },
                        Err(e) => Input::Malformed { peer, round, reason: pcp_protocol::diloco::aggregate::Rejection::Encoding(e.to_string()) },
                    }
                }
            },
            _ = tick.tick() => Input::Tick,
            Some(done) = tasks.join_next() => {
                if let Ok((peer, Err(e))) = done {
                    tracing::warn!("worker {peer} failed: {e:#}");
                }
                Input::Tick
            }
        };
        for action in shepherd.handle(input, now_ms(start)) {
            match action {
                Action::OpenRound { round, deadline_ms, participants } => {
                    let victim = kill_at.filter(|(r, _)| *r == round).map(|(_, v)| v);
                    if let Some((victim, handle)) = victim.and_then(|v| handles.remove(&v).map(|h| (v, h))) {
                        handle.abort();
                        workers.remove(&victim);
                        events.emit("worker_killed", json!({"round": round, "worker": victim}));
                    }
                    if args.join_at == Some(round) {
                        let engine = load_engine(&experiment, &model, &args.device, &net.data_dir, None).await?;
                        let handle = spawn(next_peer, &mut tasks, engine, &mut workers);
                        handles.insert(next_peer, handle);
                        next_peer += 1;
                    }
                    let announcement =
                        Round { round, deadline_ms, params: std::sync::Arc::new(shepherd.params().clone()) };
                    for p in participants {
                        let Some(tx) = workers.get(&p) else { continue };
                        if tx.send(announcement.clone()).await.is_ok() {
                            bytes_out += param_bytes;
                        }
                    }
                    events.emit("round_started", json!({"round": round, "deadline_ms": deadline_ms}));
                }
                Action::Rejected { peer, round, reason } => {
                    events.emit(
                        "contribution_rejected",
                        json!({"round": round, "peer": peer.to_string(), "reason": reason.to_string()}),
                    );
                }
                Action::WorkerJoined(p) => events.emit("worker_joined", json!({"peer": p.to_string()})),
                Action::WorkerLeft { peer, reason } => {
                    events.emit(
                        "worker_left",
                        json!({"peer": peer.to_string(), "reason": format!("{reason:?}").to_lowercase()}),
                    );
                }
                Action::DeadlineExtended { round, deadline_ms } => {
                    events.emit("deadline_extended", json!({"round": round, "deadline_ms": deadline_ms}))
                }
                Action::RoundCompleted(summary) => {
                    last_val = validate(&mut shepherd_engine, shepherd.params().clone(), &corpus, batch, block).await?;
                    events.emit("round_completed", json!({
                        "round": summary.round, "contributors": summary.contributors.len(), "mean_loss": summary.mean_loss,
                        "val_loss": last_val, "bytes_in": bytes_in, "bytes_out": bytes_out, "seconds": summary.duration_ms as f64 / 1e3,
                        "excluded": summary.excluded.iter().map(u32::to_string).collect::<Vec<_>>(), "clipped": summary.clipped,
                    }));
                    writeln!(
                        out,
                        "{:>5} {:>12} {:>10.4} {:>10.4} {:>8.1} {:>9.2} {:>9.2}",
                        summary.round,
                        summary.contributors.len(),
                        summary.mean_loss,
                        last_val,
                        summary.duration_ms as f64 / 1e3,
                        bytes_out as f64 / 1e6,
                        bytes_in as f64 / 1e6
                    )?;
                    bytes_in = 0;
                    bytes_out = 0;
                }
                Action::Finished => {}
            }
        }
        if shepherd.is_finished() {
            break;
        }
    }
    tasks.abort_all();
    writeln!(
        out,
        "done: {} rounds in {:.1} s, final val loss {last_val:.4}",
        shepherd.completed(),
        start.elapsed().as_secs_f64()
    )?;
    Ok(())
}

/// The validation loss of `params` on fixed validation batches.
async fn validate(
    engine: &mut crate::engine::Engine,
    params: Tensors,
    corpus: &Corpus,
    batch: usize,
    block: usize,
) -> anyhow::Result<f64> {
    engine.set_params(params).await.context("loading parameters for validation")?;
    let mut sampler = Sampler::new(corpus.val.clone(), batch, block, 0x5eed)?;
    let mut total = 0.0;
    for _ in 0..8 {
        total += f64::from(engine.eval(&sampler.next_batch()).await?);
    }
    Ok(total / 8.0)
}
