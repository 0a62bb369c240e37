//! The worker role: the default for a node that is not a shepherd.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context as _;
use std::sync::Arc;

use pcp_bootstrap::{Event, Node, PeerId, RequestError};
use pcp_protocol::diloco::Tensors;
use pcp_protocol::diloco::compress::{self, Encoding};
use pcp_protocol::diloco::sparse::{self, ErrorFeedback, Layout, Settings};
use pcp_protocol::diloco::worker::{self, Worker};
use pcp_protocol::election::{self, Election, Succession};
use pcp_protocol::failover::Chain;
use pcp_protocol::{BlobHash, PublicKey, RunId, Verified};
use pcp_runtime::Device;
use pcp_schema::{
    Ack, ArtifactRef, Backend, Capabilities, Contribution, Heartbeat, Message as _, MessageKind, NodeHello,
    ParameterRef, RoundAnnouncement, RunManifest,
};
use serde_json::json;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::RoleIo;
use super::wire::{self, Signer, peer_name};
use crate::Failure;
use crate::data::Sampler;
use crate::engine::Engine;
use crate::events::Events;
use crate::train::{Corpus, learning_rate};

/// Flags of the worker role.
#[derive(Debug, Clone, Default, clap::Args)]
pub(crate) struct WorkerArgs {
    /// The backend this node trains on: cpu, cuda, rocm, vulkan or metal.
    #[arg(long, default_value = "cpu")]
    pub(crate) backend: String,
    /// The device target: an LLVM CPU name, sm_XX, gfx9XX… [default: the host CPU]
    #[arg(long)]
    pub(crate) target: Option<String>,
    /// Join this run (its id, in hex) instead of the first one the DHT knows.
    #[arg(long, value_name = "RUN_ID")]
    pub(crate) run: Option<String>,
    /// Only route, gossip and serve blobs; never train.
    #[arg(long)]
    pub(crate) no_train: bool,
    /// Use the GPU of this ordinal (sets CUDA_VISIBLE_DEVICES and HIP_VISIBLE_DEVICES
    /// for this process); `--scale` gives worker i ordinal i.
    #[arg(long, value_name = "ORDINAL")]
    pub(crate) device_id: Option<u32>,
    /// Run this many workers as child processes of this one, worker i on device
    /// ordinal i with data directory <data-dir>/worker-i, restarted with backoff
    /// when they exit, stopped together on SIGINT or SIGTERM.
    #[arg(long, value_name = "N", conflicts_with_all = ["shepherd", "no_train", "device_id"])]
    pub(crate) scale: Option<usize>,
    /// Testing only: send corrupted pseudo-gradients (`nan`, or `scale` for ×1000).
    #[arg(long, hide = true, value_name = "KIND")]
    pub(crate) hostile: Option<String>,
}

/// How a hostile worker corrupts its pseudo-gradient.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Hostile {
    /// One value is NaN.
    Nan,
    /// Everything ×1000.
    Scale(f32),
    /// −Δ: the honest pseudo-gradient, sign-flipped (the same norm).
    Flip,
    /// Random values with the honest pseudo-gradient's norm.
    Noise,
    /// Honest training, but also gossips round announcements it signs itself, as if
    /// it led a term.
    Forge,
}

impl Hostile {
    pub(crate) fn parse(s: &str) -> Option<Self> {
        match s {
            "nan" => Some(Self::Nan),
            "scale" => Some(Self::Scale(1000.0)),
            "flip" => Some(Self::Flip),
            "noise" => Some(Self::Noise),
            "forge" => Some(Self::Forge),
            _ => None,
        }
    }
}

/// A worker's resolved settings.
#[derive(Debug, Clone)]
pub(crate) struct WorkerPlan {
    device: Device,
    backend: String,
    target: String,
    run: Option<RunId>,
    pub(crate) hostile: Option<Hostile>,
    /// Print progress on stdout.
    pub(crate) verbose: bool,
}

impl WorkerPlan {
    /// Checks the flags, and that this build can run the backend.
    pub(crate) fn new(args: &WorkerArgs) -> Result<Self, Failure> {
        let (device, target) =
            crate::devices::resolve(&args.backend, args.target.as_deref()).map_err(Failure::input)?;
        let run = match &args.run {
            Some(r) => Some(r.parse::<RunId>().map_err(|e| Failure::input(anyhow::anyhow!("--run {r:?}: {e}")))?),
            None => None,
        };
        let hostile = match &args.hostile {
            Some(h) => Some(Hostile::parse(h).ok_or_else(|| {
                Failure::input(anyhow::anyhow!("--hostile takes nan, scale, flip, noise or forge, got {h:?}"))
            })?),
            None => None,
        };
        Ok(Self {
            device,
            backend: device.name().to_owned(),
            target: target.target.unwrap_or_default(),
            run,
            hostile,
            verbose: true,
        })
    }
}

/// How often a worker heartbeats (and so polls for rounds).
const HEARTBEAT: Duration = Duration::from_millis(500);
/// A contribution lost on the way is sent again, this many times in all, while its
/// round is open.
const MAX_SENDS: u32 = 8;
/// How often a worker without a run asks the DHT again.
const DISCOVERY_RETRY: Duration = Duration::from_secs(2);
/// Blob fetches give up after this long.
const FETCH_TIMEOUT: Duration = Duration::from_secs(300);
/// A heartbeat with no answer within this long counts as missed.
const HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(10);

/// A run this worker joined.
#[derive(Debug, Clone)]
struct Joined {
    shepherd: PeerId,
    shepherd_key: PublicKey,
    manifest: RunManifest,
    artifact: ArtifactRef,
    /// The run's coordinator candidates, in the order they take terms.
    succession: Succession,
}

/// The leader a worker follows: where it fetches parameters and sends
/// contributions.
type Leader = (PeerId, PublicKey);

/// What the heartbeat task learned last.
#[derive(Debug, Clone)]
enum Latest {
    Nothing,
    Round(Box<RoundAnnouncement>),
    /// The shepherd refused us (another run now, say): discover again.
    Refused(String),
}

/// Runs a worker until its run finishes or `cancel` fires.
pub(crate) async fn run(
    plan: WorkerPlan,
    io: RoleIo,
    gossip: mpsc::Receiver<Event>,
    cancel: CancellationToken,
) -> anyhow::Result<()> {
    let RoleIo { node, identity, events, data_dir } = io;
    let (node, events) = (&node, &events);
    // the dashboard, when it is up, owns stdout and shows the rounds itself
    let plan = WorkerPlan { verbose: plan.verbose && !crate::tui::owns_stdout(), ..plan };
    let mut signer = Signer::new(identity);
    let gossip = Arc::new(tokio::sync::Mutex::new(gossip));
    loop {
        let Some(joined) = discover(&plan, node, &mut signer, &cancel).await? else { return Ok(()) };
        let io = TrainIo { node, events, data_dir: &data_dir, cancel: &cancel };
        match train(&plan, io, &mut signer, &joined, gossip.clone()).await? {
            Outcome::Finished | Outcome::Cancelled => return Ok(()),
            Outcome::Rejoin(reason) => {
                tracing::warn!("leaving run {}: {reason}", RunId(joined.manifest.run));
                events.emit("run_left", json!({"run": RunId(joined.manifest.run).to_hex(), "reason": reason}));
            }
        }
    }
}

/// Finds a run and joins it: the signed manifest with an artifact for this node.
async fn discover(
    plan: &WorkerPlan,
    node: &Node,
    signer: &mut Signer,
    cancel: &CancellationToken,
) -> anyhow::Result<Option<Joined>> {
    let key = plan.run.map_or_else(wire::runs_key, wire::run_key);
    let mut said = false;
    loop {
        let providers = node.providers(key, 8).await?;
        for peer in providers {
            match join(plan, node, signer, peer).await {
                Ok(joined) => return Ok(Some(joined)),
                Err(JoinError::Fatal(e)) => return Err(e),
                Err(JoinError::Skip(reason)) => tracing::debug!(%peer, "not joining: {reason}"),
            }
        }
        if !said && plan.verbose {
            println!("looking for a run to join (asking the DHT every {} s)…", DISCOVERY_RETRY.as_secs());
            said = true;
        }
        tokio::select! {
            () = cancel.cancelled() => return Ok(None),
            () = tokio::time::sleep(DISCOVERY_RETRY) => {}
        }
    }
}

#[derive(Debug)]
enum JoinError {
    /// Try another shepherd, or later.
    Skip(String),
    /// The shepherd cannot serve this node at all.
    Fatal(anyhow::Error),
}

async fn join(plan: &WorkerPlan, node: &Node, signer: &mut Signer, peer: PeerId) -> Result<Joined, JoinError> {
    let me = signer.identity().public();
    let hello = NodeHello {
        peer: me.0,
        protocol_version: wire::PROTOCOL_VERSION,
        agent: format!("pcp-node/{}", env!("CARGO_PKG_VERSION")),
        capabilities: Capabilities {
            backends: vec![Backend { name: plan.backend.clone(), targets: vec![plan.target.clone()] }],
            free_memory_bytes: 0,
        },
    };
    // a hello is for whichever run the shepherd runs: bound to the zero run id
    let envelope = signer.seal(plan.run.unwrap_or(RunId([0; 32])), 0, &hello);
    let answer = node.request(peer, envelope).await.map_err(|e| JoinError::Skip(e.to_string()))?;
    match answer.kind() {
        MessageKind::RunManifest => {
            let manifest: RunManifest = answer.decode().map_err(|e| JoinError::Skip(e.to_string()))?;
            let run = RunId(manifest.run);
            let creator = PublicKey(manifest.shepherd);
            let candidates: Vec<PublicKey> = manifest.candidates.iter().map(|k| PublicKey(*k)).collect();
            // the id binds the creator and the candidates: a successor's manifest is checked against it
            if pcp_protocol::election::run_id(&creator, &manifest.model_hash, &manifest.salt, &candidates) != run {
                return Err(JoinError::Skip(format!("the manifest of run {run} does not hash to its id")));
            }
            let succession = Succession::new(run, creator, &candidates);
            if !succession.contains(&answer.signer()) {
                return Err(JoinError::Skip("the manifest is signed by a key that is not a candidate".into()));
            }
            if plan.run.is_some_and(|r| r.0 != manifest.run) {
                return Err(JoinError::Skip(format!("{peer} runs {}", RunId(manifest.run))));
            }
            let wanted = |a: &&ArtifactRef| a.backend == plan.backend && a.target == plan.target;
            let Some(artifact) = manifest.artifacts.iter().find(wanted).cloned() else {
                return Err(JoinError::Skip("the manifest has no artifact for this backend".into()));
            };
            Ok(Joined { shepherd: peer, shepherd_key: answer.signer(), manifest, artifact, succession })
        }
        MessageKind::Ack => {
            let ack: Ack = answer.decode().map_err(|e| JoinError::Skip(e.to_string()))?;
            if ack.reason.starts_with(super::STANDBY) {
                Err(JoinError::Skip(ack.reason))
            } else if ack.reason.contains("cannot compile") || ack.reason.contains("unknown backend") {
                Err(JoinError::Fatal(anyhow::anyhow!("{}", ack.reason)))
            } else {
                Err(JoinError::Skip(ack.reason))
            }
        }
        other => Err(JoinError::Skip(format!("answered a hello with {}", other.tag()))),
    }
}

/// Why training on a run stopped.
#[derive(Debug)]
enum Outcome {
    Finished,
    Cancelled,
    Rejoin(String),
}

/// Fetches a blob (the shepherd first) and reads it.
async fn fetch(node: &Node, hash: [u8; 32], shepherd: PeerId, what: &str) -> anyhow::Result<std::path::PathBuf> {
    let report = node
        .fetch_from(BlobHash(hash), vec![shepherd], FETCH_TIMEOUT)
        .await
        .with_context(|| format!("fetching the {what}"))?;
    Ok(report.path)
}

fn read(path: &Path) -> anyhow::Result<Vec<u8>> {
    std::fs::read(path).with_context(|| format!("reading {}", path.display()))
}

/// What a worker's training loop works with.
#[derive(Clone, Copy, Debug)]
struct TrainIo<'a> {
    node: &'a Node,
    events: &'a Events,
    data_dir: &'a Path,
    cancel: &'a CancellationToken,
}

/// A round's starting parameters and how they were had.
struct RoundParams {
    params: Tensors,
    /// Bytes fetched for them: the update's or the parameters' blob, or 0.
    bytes: u64,
    /// `held` (unchanged), `update` (the sparse update applied) or `full`.
    via: &'static str,
}

/// The parameters a round starts from. A worker that holds the previous round's
/// parameters reuses them when they did not change, and in a sparse run fetches
/// only the update and applies it, checking the result against the announced
/// hash; anyone else (a joiner, a worker that missed rounds, a failed check)
/// fetches the whole parameters blob.
async fn round_params(
    node: &Node,
    from: PeerId,
    announcement: &RoundAnnouncement,
    held: Option<&(BlobHash, Tensors)>,
    sizes: &[usize],
    down: Option<Layout>,
) -> anyhow::Result<RoundParams> {
    let params_ref = announcement.parameters.first().context("the announcement names no parameters")?;
    let want = BlobHash(params_ref.blob);
    if let Some((hash, params)) = held {
        if *hash == want {
            return Ok(RoundParams { params: params.clone(), bytes: 0, via: "held" });
        }
        if let (Some(update), Some(layout)) = (&announcement.update, down)
            && BlobHash(update.base) == *hash
        {
            let applied = async {
                let bytes = read(&fetch(node, update.blob.blob, from, "round update").await?)?;
                // the update closed the previous round, and is seeded with it
                let seed = announcement.round.saturating_sub(1);
                let sent = sparse::decode_seeded(&bytes, sizes, layout, seed).context("the round's update")?;
                let mut next = params.clone();
                sparse::subtract(&mut next, &sent, 1.0);
                anyhow::ensure!(wire::params_hash(&next) == want, "the updated parameters do not hash to {want}");
                Ok(next)
            };
            match applied.await {
                Ok(params) => return Ok(RoundParams { params, bytes: update.blob.size, via: "update" }),
                Err(e) => tracing::warn!("round {}: {e:#}; fetching the whole parameters", announcement.round),
            }
        }
    }
    let path = fetch(node, params_ref.blob, from, "round parameters").await?;
    let params = wire::read_params(&read(&path)?, sizes)?;
    Ok(RoundParams { params, bytes: params_ref.size, via: "full" })
}

/// Where a sparse run's error feedback survives a restart.
fn feedback_path(data_dir: &Path, run: RunId) -> PathBuf {
    data_dir.join("worker").join(format!("feedback-{}.bin", run.to_hex()))
}

fn chain_path(data_dir: &Path, run: RunId) -> PathBuf {
    data_dir.join("worker").join(format!("chain-{}.json", run.to_hex()))
}

/// The highest term this worker followed and the round it last trained, saved for
/// `run` (fencing across restarts); nothing when absent or damaged.
fn load_chain(path: &Path) -> Chain {
    let read = || -> anyhow::Result<Chain> {
        let v: serde_json::Value = serde_json::from_slice(&std::fs::read(path)?)?;
        let params = hex::decode(v["params"].as_str().context("params")?)?;
        Ok(Chain {
            term: v["term"].as_u64().context("term")?,
            round: v["round"].as_u64().context("round")?,
            params: params.try_into().map_err(|_| anyhow::anyhow!("params is not 32 bytes"))?,
        })
    };
    match read() {
        Ok(chain) => chain,
        Err(e) => {
            if path.exists() {
                tracing::warn!("ignoring {}: {e:#}", path.display());
            }
            Chain::default()
        }
    }
}

fn save_chain(path: &Path, chain: &Chain) -> anyhow::Result<()> {
    let dir = path.parent().context("chain path has no parent")?;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let tmp = path.with_extension("tmp");
    let v = json!({"term": chain.term, "round": chain.round, "params": hex::encode(chain.params)});
    std::fs::write(&tmp, v.to_string()).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("renaming {}", tmp.display()))?;
    Ok(())
}

/// The error-feedback buffer saved for `run`, if any fits these sizes, else zeros.
fn load_feedback(path: &Path, sizes: &[usize], settings: Settings) -> ErrorFeedback {
    let mut feedback = ErrorFeedback::new(sizes, settings.decay(), settings.up);
    match std::fs::read(path) {
        Ok(bytes) => match wire::read_params(&bytes, sizes) {
            Ok(buffer) => feedback.buffer = buffer,
            Err(e) => tracing::warn!("ignoring {}: {e:#}", path.display()),
        },
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => tracing::warn!("reading {}: {e}", path.display()),
    }
    feedback
}

/// Saves the error feedback atomically (a temporary file renamed over the old).
fn save_feedback(path: &Path, feedback: &ErrorFeedback) -> anyhow::Result<()> {
    let dir = path.parent().context("feedback path has no parent")?;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, wire::params_blob(&feedback.buffer)).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("renaming {}", tmp.display()))?;
    Ok(())
}

async fn train(
    plan: &WorkerPlan,
    io: TrainIo<'_>,
    signer: &mut Signer,
    joined: &Joined,
    gossip: Arc<tokio::sync::Mutex<mpsc::Receiver<Event>>>,
) -> anyhow::Result<Outcome> {
    let TrainIo { node, events, data_dir, cancel } = io;
    let m = &joined.manifest;
    let run = RunId(m.run);
    let vmfb = read(&fetch(node, joined.artifact.blob, joined.shepherd, "training artifact").await?)?;
    let corpus_path = fetch(node, m.data.blob, joined.shepherd, "corpus").await?;
    let corpus = Corpus::load(&corpus_path, &m.data.tokenizer, None, m.data.val_fraction)?;
    let (batch, block) = (m.data.batch as usize, m.data.block as usize);
    let sizes = wire::sizes(m);
    let encoding = Encoding::parse(&m.encoding).with_context(|| format!("the run uses encoding {:?}", m.encoding))?;
    let settings = encoding.sparse();
    let feedback_file = feedback_path(data_dir, run);
    let mut feedback = settings.map(|s| load_feedback(&feedback_file, &sizes, s));
    // what this worker trained last, and the highest term it followed: it never
    // moves back, across restarts too
    let chain_file = chain_path(data_dir, run);
    let mut chain = load_chain(&chain_file);
    // the parameters the last round started from, by blob hash
    let mut held: Option<(BlobHash, Tensors)> = None;
    let mut bytes_down = 0u64;
    let zeros: Tensors = sizes.iter().map(|n| vec![0.0; *n]).collect();
    let mut engine =
        Engine::new(plan.device, vmfb, wire::shapes(m), zeros, None, m.state_per_param as usize, m.data.int64).await?;
    if let Err(e) = node.subscribe(run).await {
        tracing::warn!("subscribing to run {run}: {e}");
    }
    let me = signer.identity().public();
    events.emit(
        "run_joined",
        json!({"run": run.to_hex(), "shepherd": joined.shepherd.to_string(), "backend": plan.backend,
               "target": plan.target, "artifact": BlobHash(joined.artifact.blob).to_hex(),
               "screen": m.screen, "trim": m.trim, "rounds": m.rounds, "tau": m.inner_steps,
               "encoding": encoding.name(), "encoding_spec": encoding.spec()}),
    );
    if plan.verbose {
        println!(
            "joined run {run} ({}): shepherd {}, {} rounds of τ={}, artifact for {} ({:.1} MB)",
            m.name,
            joined.shepherd,
            m.rounds,
            m.inner_steps,
            if plan.target.is_empty() { plan.backend.clone() } else { format!("{}:{}", plan.backend, plan.target) },
            joined.artifact.size as f64 / 1e6
        );
    }

    let (latest_tx, mut latest) = watch::channel(Latest::Nothing);
    let (round_tx, round_rx) = watch::channel(0u64);
    let (leader_tx, leader) = watch::channel((joined.shepherd, joined.shepherd_key));
    let heartbeat = Heartbeats {
        node: node.clone(),
        signer: Signer::new(signer.identity().clone()),
        run,
        election: Election::resume(me, joined.succession.clone(), m.lease_ms.max(500), chain.term, wire::mono_ms()),
        heard: false,
        leader: leader_tx,
        latest: latest_tx,
        round: round_rx,
        events: events.clone(),
        gossip,
        forge: plan.hostile == Some(Hostile::Forge),
    };
    let _heartbeat = AbortOnDrop(tokio::spawn(heartbeat.run()));

    let mut machine = Worker::new(me.0.to_vec(), m.seed, u64::from(m.inner_steps));
    let mut adam_step = 0u64;
    // the last announcement handled: a shepherd that restarted reopens a round with a
    // new deadline, and that is a new round to train
    let mut done: Option<(u64, u64, u64)> = None;
    loop {
        tokio::select! {
            () = cancel.cancelled() => return Ok(Outcome::Cancelled),
            changed = latest.changed() => if changed.is_err() {
                return Ok(Outcome::Rejoin("the heartbeat task stopped".into()));
            },
        }
        let announcement = match latest.borrow_and_update().clone() {
            Latest::Nothing => continue,
            Latest::Refused(reason) => return Ok(Outcome::Rejoin(reason)),
            Latest::Round(a) => a,
        };
        if announcement.finished {
            events.emit("run_finished", json!({"run": run.to_hex(), "rounds": announcement.round}));
            if plan.verbose {
                println!("run {run} finished after {} rounds", announcement.round);
            }
            return Ok(Outcome::Finished);
        }
        let r = announcement.round;
        // a successor's reopening of a round is a new round to train, whatever its deadline
        let this = (r, announcement.term, announcement.deadline_unix_ms);
        if r == 0 || done.is_some_and(|d| d >= this) {
            continue;
        }
        let participant = announcement.participants.contains(&me.0);
        let base = announcement.parameters.first().map(|p| p.blob);
        if let Some(base) = base.filter(|_| participant) {
            if let Err(behind) = chain.admits(announcement.term, r, &base) {
                tracing::warn!("run {run}: not training round {r} of term {}: {behind}", announcement.term);
                events.emit(
                    "round_refused",
                    json!({"round": r, "term": announcement.term, "reason": behind.to_string()}),
                );
                done = Some(this);
                continue;
            }
            chain.follow(announcement.term, r, base);
            if let Err(e) = save_chain(&chain_file, &chain) {
                tracing::warn!("saving the followed chain: {e:#}");
            }
        }
        let mut actions = machine.handle(
            worker::Input::RoundOpened { round: r, deadline_ms: announcement.deadline_unix_ms, participant },
            wire::unix_ms(),
        );
        done = Some(this);
        events.emit(
            "round_announced",
            json!({"round": r, "deadline_unix_ms": announcement.deadline_unix_ms, "participant": participant}),
        );
        if !participant {
            continue;
        }
        let _ = round_tx.send(r);
        if announcement.parameters.is_empty() {
            continue;
        }
        while let Some(action) = actions.pop() {
            match action {
                worker::Action::FetchParams(r) => {
                    let from = leader.borrow().0;
                    // a leader that dies mid-fetch is replaced: a newer announcement (or the
                    // end of the run) abandons the fetch, and a failed fetch only this round
                    let mut watching = latest.clone();
                    let fetched = tokio::select! {
                        () = cancel.cancelled() => return Ok(Outcome::Cancelled),
                        () = newer_arrives(&mut watching, this) => None,
                        fetched = round_params(node, from, &announcement, held.as_ref(), &sizes,
                                               settings.map(|s| s.down())) => Some(fetched),
                    };
                    let fetched = match fetched {
                        Some(Ok(fetched)) => fetched,
                        Some(Err(e)) => {
                            tracing::warn!("round {r}: {e:#}");
                            events.emit("round_abandoned", json!({"round": r, "steps": 0, "reason": format!("{e:#}")}));
                            actions.extend(machine.handle(worker::Input::Failed(r), wire::unix_ms()));
                            break;
                        }
                        None => {
                            events.emit(
                                "round_abandoned",
                                json!({"round": r, "steps": 0, "reason": "a newer announcement"}),
                            );
                            actions.extend(machine.handle(worker::Input::Failed(r), wire::unix_ms()));
                            break;
                        }
                    };
                    bytes_down = fetched.bytes;
                    tracing::debug!("round {r}: parameters {} ({} bytes)", fetched.via, fetched.bytes);
                    let hash = announcement.parameters.first().map(|p| BlobHash(p.blob));
                    engine.set_params(fetched.params.clone()).await?;
                    held = hash.map(|h| (h, fetched.params));
                    actions.extend(machine.handle(worker::Input::ParamsReady(r), wire::unix_ms()));
                }
                worker::Action::Train { round: r, steps, seed } => {
                    let start = engine.params().await?;
                    let mut sampler = Sampler::new(corpus.train.clone(), batch, block, seed)?;
                    let mut loss_sum = 0.0f64;
                    let mut taken = 0u64;
                    let training = std::time::Instant::now();
                    for i in 0..steps {
                        if cancel.is_cancelled() {
                            return Ok(Outcome::Cancelled);
                        }
                        if newer_round(&latest, this) {
                            break;
                        }
                        adam_step += 1;
                        let global = (r - 1) * steps + i + 1;
                        let s = &m.schedule;
                        let lr = learning_rate(global, s.total_steps, s.learning_rate, s.min_lr, s.warmup_steps);
                        loss_sum += f64::from(engine.step(adam_step, lr as f32, &sampler.next_batch()).await?);
                        taken += 1;
                    }
                    if taken < steps {
                        events.emit("round_abandoned", json!({"round": r, "steps": taken}));
                        actions.extend(machine.handle(worker::Input::Failed(r), wire::unix_ms()));
                        break;
                    }
                    let end = engine.params().await?;
                    let trained_s = training.elapsed().as_secs_f64();
                    let mut delta: Tensors =
                        start.iter().zip(&end).map(|(s, e)| s.iter().zip(e).map(|(s, e)| s - e).collect()).collect();
                    match plan.hostile {
                        Some(Hostile::Nan) => delta[0][0] = f32::NAN,
                        Some(Hostile::Scale(k)) => delta.iter_mut().flatten().for_each(|v| *v *= k),
                        Some(Hostile::Flip) => delta.iter_mut().flatten().for_each(|v| *v = -*v),
                        Some(Hostile::Noise) => noise_like(&mut delta, r),
                        Some(Hostile::Forge) | None => {}
                    }
                    let loss = (loss_sum / taken.max(1) as f64) as f32;
                    let (bytes, sent) = match feedback.as_mut() {
                        Some(ef) => {
                            let (bytes, sent) = ef.compress_seeded(&delta, 1.0, r);
                            (bytes, Some(sent))
                        }
                        None => (compress::encode(&delta, encoding), None),
                    };
                    drop(delta);
                    let contribution = Contribution {
                        run: run.0,
                        round: r,
                        inner_steps: taken as u32,
                        samples: taken * (batch * block) as u64,
                        pseudo_gradient: ParameterRef {
                            name: "delta".into(),
                            shard: 0,
                            blob: *blake3::hash(&bytes).as_bytes(),
                            size: bytes.len() as u64,
                        },
                        loss,
                        delta: bytes,
                        bytes_down,
                        term: announcement.term,
                        params_hash: base.unwrap_or_default(),
                    };
                    let mut envelope = signer.seal(run, r, &contribution);
                    let wire_bytes = envelope.encode().len() as u64;
                    // a send to a leader that died (or refused it unread) must not hold up the
                    // round that replaces it: a newer announcement abandons the send. One lost
                    // on the way (a cut link, a leader busy past the timeout) is sent again
                    // while the round is open, so that the round does not wait on it for good.
                    let mut watching = latest.clone();
                    let mut tries = 0u32;
                    let answer = loop {
                        let (to, to_key) = *leader.borrow();
                        let answer = tokio::select! {
                            () = cancel.cancelled() => return Ok(Outcome::Cancelled),
                            () = newer_arrives(&mut watching, this) => None,
                            answer = node.request(to, envelope) => Some((answer, to_key)),
                        };
                        tries += 1;
                        match answer {
                            Some((Err(e @ (RequestError::Failed { .. } | RequestError::Busy { .. })), _))
                                if tries < MAX_SENDS && !newer_round(&latest, this) =>
                            {
                                tracing::warn!("round {r}: sending the contribution failed ({e}); sending it again");
                                tokio::select! {
                                    () = cancel.cancelled() => return Ok(Outcome::Cancelled),
                                    () = newer_arrives(&mut watching, this) => break None,
                                    () = tokio::time::sleep(HEARTBEAT * 2) => {}
                                }
                                envelope = signer.seal(run, r, &contribution);
                            }
                            other => break other,
                        }
                    };
                    let (accepted, reason) = match answer {
                        Some((answer, to_key)) => ack_of(answer, to_key),
                        None => (false, "abandoned: a newer announcement arrived before the answer".to_owned()),
                    };
                    if let (Some(ef), Some(sent)) = (feedback.as_mut(), sent) {
                        // what was not taken is sent again later, not lost
                        if !accepted {
                            sparse::subtract(&mut ef.buffer, &sent, -1.0);
                        }
                        if let Err(e) = save_feedback(&feedback_file, ef) {
                            tracing::warn!("saving the error feedback: {e:#}");
                        }
                    }
                    let param_bytes = 4 * sizes.iter().sum::<usize>() as u64;
                    events.emit(
                        "contribution_sent",
                        json!({"round": r, "loss": loss, "bytes": wire_bytes, "param_bytes": param_bytes,
                               "ratio": wire_bytes as f64 / param_bytes as f64, "accepted": accepted, "reason": reason,
                               "tokens": taken * (batch * block) as u64, "seconds": trained_s,
                               "bytes_up": wire_bytes, "bytes_down": bytes_down}),
                    );
                    if plan.verbose {
                        let verdict = if accepted { "accepted".to_owned() } else { format!("rejected: {reason}") };
                        println!(
                            "round {r}: {taken} steps, mean loss {loss:.4}, sent {:.2} MB, {verdict}",
                            wire_bytes as f64 / 1e6
                        );
                    }
                    actions.extend(machine.handle(worker::Input::Trained(r), wire::unix_ms()));
                }
                worker::Action::Send(r) => {
                    actions.extend(machine.handle(worker::Input::Sent(r), wire::unix_ms()));
                }
                worker::Action::Abandon(_) => {}
            }
        }
    }
}

/// Replaces `delta` with uniform noise of the same L2 norm (a hostile worker's
/// pseudo-gradient of typical size), seeded by the round.
fn noise_like(delta: &mut Tensors, round: u64) {
    use rand::{Rng, SeedableRng};
    let norm = delta.iter().flatten().map(|v| f64::from(*v).powi(2)).sum::<f64>().sqrt();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(round ^ 0x0015_e0ff);
    delta.iter_mut().flatten().for_each(|v| *v = rng.gen_range(-1.0f32..1.0));
    let drawn = delta.iter().flatten().map(|v| f64::from(*v).powi(2)).sum::<f64>().sqrt().max(f64::MIN_POSITIVE);
    let k = (norm / drawn) as f32;
    delta.iter_mut().flatten().for_each(|v| *v *= k);
}

/// Waits until an announcement newer than `current` arrives (forever if the
/// heartbeat task stops).
async fn newer_arrives(latest: &mut watch::Receiver<Latest>, current: (u64, u64, u64)) {
    while !newer_round(latest, current) {
        if latest.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

/// Whether an announcement newer than `(round, term, deadline)` (or the run's end)
/// arrived.
fn newer_round(latest: &watch::Receiver<Latest>, current: (u64, u64, u64)) -> bool {
    match &*latest.borrow() {
        Latest::Round(a) => (a.round, a.term, a.deadline_unix_ms) > current || a.finished,
        Latest::Refused(_) => true,
        Latest::Nothing => false,
    }
}

fn ack_of(answer: Result<Verified, RequestError>, shepherd: PublicKey) -> (bool, String) {
    match answer {
        Ok(v) if v.signer() == shepherd => match v.decode::<Ack>() {
            Ok(ack) => (ack.accepted, ack.reason),
            Err(e) => (false, format!("unreadable answer: {e}")),
        },
        Ok(_) => (false, "answer signed by someone else".into()),
        Err(e) => (false, e.to_string()),
    }
}

/// Aborts a task when dropped: the heartbeat task lives exactly as long as `train`.
#[derive(Debug)]
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Heartbeats to the leader; each answer is its current round announcement. It
/// follows the run's election: announcements and gossiped leases are checked
/// against the succession and the term, and when the leader's lease lapses the
/// heartbeats go to the candidate whose term comes next.
#[derive(Debug)]
struct Heartbeats {
    node: Node,
    signer: Signer,
    run: RunId,
    election: Election,
    /// Whether a valid lease was heard yet: until then the heartbeats go to the
    /// candidate that answered the hello.
    heard: bool,
    leader: watch::Sender<Leader>,
    latest: watch::Sender<Latest>,
    round: watch::Receiver<u64>,
    events: Events,
    gossip: Arc<tokio::sync::Mutex<mpsc::Receiver<Event>>>,
    /// A hostile worker's forgeries (tests).
    forge: bool,
}

type Asked = (PublicKey, PeerId, Result<Verified, String>);

impl Heartbeats {
    async fn run(mut self) {
        let mut tick = tokio::time::interval(HEARTBEAT);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut missed = 0u32;
        let mut asking: JoinSet<Asked> = JoinSet::new();
        let gossip = self.gossip.clone();
        let mut gossip = gossip.lock().await;
        let mut beats = 0u64;
        loop {
            tokio::select! {
                _ = tick.tick() => {
                    beats += 1;
                    self.expire();
                    if asking.is_empty() {
                        self.ask(&mut asking);
                    }
                    if self.forge && beats.is_multiple_of(4) {
                        self.forge().await;
                    }
                }
                Some(done) = asking.join_next() => {
                    let Ok((key, peer, answer)) = done else { continue };
                    match answer.and_then(|v| self.read(key, &v)) {
                        Ok(Some(latest)) => {
                            missed = 0;
                            if self.latest.send(latest).is_err() {
                                return;
                            }
                        }
                        Ok(None) => missed = 0,
                        Err(reason) => {
                            missed += 1;
                            if missed == 1 || missed.is_multiple_of(20) {
                                tracing::warn!(shepherd = %peer, "heartbeat failed ({missed} in a row): {reason}");
                            }
                        }
                    }
                }
                event = gossip.recv() => match event {
                    Some(Event::Gossip { run, message, .. }) if run == self.run => {
                        if let Some(latest) = self.on_gossip(&message)
                            && self.latest.send(latest).is_err()
                        {
                            return;
                        }
                    }
                    Some(_) => {}
                    None => return,
                },
            }
        }
    }

    /// Reports a lapsed lease; the next heartbeat goes to the candidate awaited.
    fn expire(&mut self) {
        for action in self.election.tick(wire::mono_ms()) {
            if let election::Action::LeaseExpired { term, leader } = action {
                tracing::warn!("run {}: the lease of term {term} lapsed; asking the next candidate", self.run);
                self.events.emit("lease_expired", json!({"term": term, "peer": peer_name(&leader)}));
                self.heard = true; // from now on the election says whom to ask
            }
        }
    }

    fn ask(&mut self, asking: &mut JoinSet<Asked>) {
        let key = if self.heard { self.election.awaited() } else { self.leader.borrow().1 };
        let Some(peer) = pcp_bootstrap::peer_of(&key) else { return };
        let round = *self.round.borrow();
        let hb = Heartbeat {
            run: self.run.0,
            round,
            unix_ms: wire::unix_ms(),
            free_memory_bytes: 0,
            term: 0,
            follows: self.election.term(),
            held: None,
        };
        let envelope = self.signer.seal(self.run, round, &hb);
        let node = self.node.clone();
        asking.spawn(async move {
            let answer = match tokio::time::timeout(HEARTBEAT_TIMEOUT, node.request(peer, envelope)).await {
                Ok(Ok(v)) => Ok(v),
                Ok(Err(e)) => Err(e.to_string()),
                Err(_) => Err("no answer".to_owned()),
            };
            (key, peer, answer)
        });
    }

    /// Checks a lease of `term` signed by `from`; rejected ones are recorded.
    fn lease(&mut self, from: PublicKey, term: u64, what: &str) -> bool {
        let mut valid = true;
        for action in self.election.on_lease(from, term, wire::mono_ms()) {
            match action {
                election::Action::Rejected { from, reason } => {
                    valid = false;
                    tracing::warn!("run {}: refused a {what} from {}: {reason}", self.run, peer_name(&from));
                    wire::lease_rejected(&self.events, what, &from, term, &reason);
                }
                election::Action::Elected { term, leader } => {
                    if let Some(peer) = pcp_bootstrap::peer_of(&leader) {
                        if *self.leader.borrow() != (peer, leader) {
                            self.events.emit("leader_followed", json!({"term": term, "peer": peer.to_string()}));
                        }
                        let _ = self.leader.send((peer, leader));
                    }
                }
                _ => {}
            }
        }
        if valid {
            self.heard = true;
        }
        valid
    }

    /// An answer to a heartbeat sent to `key`: the round to train (or none).
    fn read(&mut self, key: PublicKey, v: &Verified) -> Result<Option<Latest>, String> {
        if v.signer() != key {
            return Err("answer signed by someone else".to_owned());
        }
        match v.kind() {
            MessageKind::RoundAnnouncement => {
                let a: RoundAnnouncement = v.decode().map_err(|e| e.to_string())?;
                if a.run != self.run.0 {
                    return Ok(Some(Latest::Refused(format!("the shepherd now runs {}", RunId(a.run)))));
                }
                if !self.lease(key, a.term, "round announcement") {
                    return Ok(None);
                }
                Ok(Some(Latest::Round(Box::new(a))))
            }
            MessageKind::Ack => {
                let ack: Ack = v.decode().map_err(|e| e.to_string())?;
                if ack.reason.starts_with(super::STANDBY) {
                    return Ok(None); // the candidate awaited does not lead yet
                }
                Ok(Some(Latest::Refused(ack.reason)))
            }
            other => Err(format!("answered a heartbeat with {}", other.tag())),
        }
    }

    /// A gossiped announcement or leader heartbeat: a lease to check, and maybe a
    /// round to train sooner than the next heartbeat's answer brings it.
    fn on_gossip(&mut self, message: &Verified) -> Option<Latest> {
        match message.kind() {
            MessageKind::RoundAnnouncement => {
                let a: RoundAnnouncement = message.decode().ok()?;
                if a.run != self.run.0 || !self.lease(message.signer(), a.term, "round announcement") {
                    return None;
                }
                Some(Latest::Round(Box::new(a)))
            }
            MessageKind::Heartbeat => {
                let hb: Heartbeat = message.decode().ok()?;
                if hb.run == self.run.0 && hb.term > 0 {
                    self.lease(message.signer(), hb.term, "leader heartbeat");
                }
                None
            }
            _ => None,
        }
    }

    /// A hostile worker claims the next term on the run's topic.
    async fn forge(&mut self) {
        let forged = RoundAnnouncement {
            run: self.run.0,
            round: 1_000_000,
            parameters: Vec::new(),
            deadline_unix_ms: wire::unix_ms() + 60_000,
            participants: Vec::new(),
            finished: false,
            term: self.election.term() + 1,
            state: None,
            update: None,
        };
        let envelope = self.signer.seal(self.run, forged.round, &forged);
        if let Err(e) = self.node.publish(self.run, envelope.encode()).await {
            tracing::debug!("gossiping a forgery: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// M1: a worker keeps the highest term and the chain it followed across a
    /// restart, so a stale leader's announcements stay refused and it never trains a
    /// round it already trained from other parameters.
    #[test]
    fn the_followed_chain_survives_a_restart_and_damage_is_ignored() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = chain_path(dir.path(), RunId([3; 32]));
        assert_eq!(load_chain(&path), Chain::default(), "nothing saved: a joiner");
        let mut chain = Chain::default();
        chain.follow(4, 17, [9; 32]);
        save_chain(&path, &chain).expect("saves");
        let back = load_chain(&path);
        assert_eq!(back, chain);
        assert!(back.admits(4, 16, &[1; 32]).is_err(), "an older round stays refused after the restart");
        assert!(back.admits(5, 17, &[8; 32]).is_err(), "the same round from other parameters too");
        std::fs::write(&path, b"{\"term\": 1}").expect("writes");
        assert_eq!(load_chain(&path), Chain::default(), "a damaged file is ignored, not fatal");
    }

    #[test]
    fn the_error_feedback_survives_a_restart_and_damage_is_ignored() {
        let dir = tempfile::tempdir().expect("tempdir");
        let run = RunId([9; 32]);
        let path = feedback_path(dir.path(), run);
        let settings = Settings::default();
        // nothing saved yet: zeros
        let mut ef = load_feedback(&path, &[100, 3], settings);
        assert_eq!(ef.buffer, vec![vec![0.0; 100], vec![0.0; 3]]);
        let delta: Tensors = vec![(0..100).map(|i| i as f32 * 0.01 - 0.3).collect(), vec![0.5, -0.25, 1.0]];
        ef.compress_seeded(&delta, 1.0, 1);
        save_feedback(&path, &ef).expect("saves");
        let back = load_feedback(&path, &[100, 3], settings);
        assert_eq!(back.buffer, ef.buffer, "what was not sent survives the restart");
        assert!(back.buffer.iter().flatten().any(|v| *v != 0.0));
        // another run's shapes, or a damaged file: a fresh buffer, not a crash
        assert_eq!(load_feedback(&path, &[99, 3], settings).buffer, vec![vec![0.0; 99], vec![0.0; 3]]);
        std::fs::write(&path, b"junk").expect("writes");
        assert_eq!(load_feedback(&path, &[100, 3], settings).buffer, vec![vec![0.0; 100], vec![0.0; 3]]);
    }
}
