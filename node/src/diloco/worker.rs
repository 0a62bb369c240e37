//! The worker role: the default for a node that is not a shepherd.

mod disk;
mod heartbeats;
mod host;
mod hostile;
mod join;
mod pow;
mod send;

pub(crate) use hostile::{Attack, HOSTILE_KINDS, Hostile, ReplaySlot};

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use pcp_bootstrap::{Event, Node, PeerId};
use pcp_protocol::diloco::Tensors;
use pcp_protocol::diloco::compress::{self, Encoding};
use pcp_protocol::diloco::fragments;
use pcp_protocol::diloco::sparse::{self, ErrorFeedback, Layout};
use pcp_protocol::election::Election;
use pcp_protocol::failover::Chain;
use pcp_protocol::{BlobHash, PublicKey, RunId};
use pcp_runtime::Device;
use pcp_schema::{Contribution, ParameterRef, RoundAnnouncement, RunManifest};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::RoleIo;
use super::wire::{self, Signer};
use crate::Failure;
use crate::observe::events::{self as ev, Events};
use crate::training::data::Corpus;
use crate::training::data::Sampler;
use crate::training::engine::Engine;
use crate::training::schedule::learning_rate;
use disk::{chain_path, feedback_path, load_chain, load_feedback, load_term, save_chain, save_feedback, term_path};
use heartbeats::{AbortOnDrop, Heartbeats, Latest, Opening, newer_arrives};
use join::{Joined, discover};
use send::{Courier, Delivery, Outgoing};

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
    /// A join certificate from the run's authorizer (`pcp-node certify` writes one),
    /// for a run that admits only certified keys.
    #[arg(long, value_name = "FILE")]
    pub(crate) certificate: Option<std::path::PathBuf>,
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
    /// Testing only: send corrupted pseudo-gradients (`nan`, `scale` for ×1000, `flip`,
    /// `noise`, `inflate`, `concentrate`, `late`, `drag`, `sybil:N`).
    #[arg(long, hide = true, value_name = "KIND")]
    pub(crate) hostile: Option<String>,
    /// The device memory a training step may use (e.g. 8GB) [default: on cpu, the
    /// host's available memory; on cuda and rocm, the GPU's free memory as
    /// nvidia-smi or rocm-smi reports it]. Sent in the hello: the
    /// shepherd gives a device too small for the run's batch a step that
    /// accumulates gradients over micro-batches.
    #[arg(long, value_name = "SIZE", value_parser = crate::training::memory::parse_size)]
    pub(crate) free_memory: Option<u64>,
}

/// A worker's resolved settings.
#[derive(Debug, Clone)]
pub(crate) struct WorkerPlan {
    device: Device,
    backend: String,
    target: String,
    run: Option<RunId>,
    pub(crate) hostile: Option<Attack>,
    /// `replay:N`: the slot its identities share (`sim` gives one).
    pub(crate) replay: Option<ReplaySlot>,
    /// Print progress on stdout.
    pub(crate) verbose: bool,
    /// Rounds whose blobs this worker keeps (`--keep-rounds`).
    pub(crate) keep_rounds: usize,
    /// A slower device: this much longer per inner step (`sim --slow`).
    pub(crate) step_delay: Option<std::time::Duration>,
    /// The memory a step may use, as the hello reports it (0: unknown), and
    /// where that figure came from: `flag`, `host` or `unknown`.
    free_memory: (u64, &'static str),
    /// The join certificate the hello carries (empty: none).
    certificate: Vec<u8>,
}

impl WorkerPlan {
    /// Checks the flags, and that this build can run the backend.
    pub(crate) fn new(args: &WorkerArgs) -> Result<Self, Failure> {
        let (device, target) =
            crate::training::device::resolve(&args.backend, args.target.as_deref()).map_err(Failure::input)?;
        let run = match &args.run {
            Some(r) => Some(r.parse::<RunId>().map_err(|e| Failure::input(anyhow::anyhow!("--run {r:?}: {e}")))?),
            None => None,
        };
        let hostile = match &args.hostile {
            Some(h) => Some(
                Attack::parse(h)
                    .ok_or_else(|| Failure::input(anyhow::anyhow!("--hostile takes {HOSTILE_KINDS}, got {h:?}")))?,
            ),
            None => None,
        };
        let certificate = match &args.certificate {
            None => Vec::new(),
            Some(path) => read_certificate(path).map_err(Failure::input)?,
        };
        Ok(Self {
            certificate,
            device,
            backend: device.name().to_owned(),
            target: target.target.unwrap_or_default(),
            run,
            hostile,
            replay: None,
            verbose: true,
            keep_rounds: super::retention::DEFAULT_KEEP_ROUNDS,
            step_delay: None,
            free_memory: match args.free_memory {
                Some(bytes) => (bytes, "flag"),
                None => match crate::training::memory::device_free(device) {
                    (Some(bytes), from) => (bytes, from),
                    (None, from) => (0, from),
                },
            },
        })
    }
}

/// A join certificate file: its bytes, or their hex.
fn read_certificate(path: &Path) -> anyhow::Result<Vec<u8>> {
    // a certificate is 136 bytes (272 in hex): anything much larger is not one
    let len = std::fs::metadata(path).with_context(|| format!("--certificate {}", path.display()))?.len();
    anyhow::ensure!(len <= 4096, "--certificate {}: {len} bytes is no join certificate", path.display());
    let bytes = std::fs::read(path).with_context(|| format!("--certificate {}", path.display()))?;
    let text = String::from_utf8_lossy(&bytes);
    let bytes = match hex::decode(text.trim()) {
        Ok(decoded) => decoded,
        Err(_) => bytes,
    };
    pcp_protocol::admit::JoinCertificate::from_bytes(&bytes)
        .with_context(|| format!("--certificate {}", path.display()))?;
    Ok(bytes)
}

/// Blob fetches give up after this long.
const FETCH_TIMEOUT: Duration = Duration::from_secs(300);

/// The leader a worker follows: where it fetches parameters and sends
/// contributions.
type Leader = (PeerId, PublicKey);

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
    let plan = WorkerPlan { verbose: plan.verbose && !crate::observe::tui::owns_stdout(), ..plan };
    let mut signer = Signer::new(identity);
    let gossip = Arc::new(tokio::sync::Mutex::new(gossip));
    loop {
        let Some(joined) = discover(&plan, (node, &data_dir), &mut signer, &cancel).await? else { return Ok(()) };
        let io = TrainIo { node, events, data_dir: &data_dir, cancel: &cancel };
        match train(&plan, io, &mut signer, &joined, gossip.clone()).await? {
            Outcome::Finished | Outcome::Cancelled => return Ok(()),
            Outcome::Rejoin(reason) => {
                tracing::warn!("leaving run {}: {reason}", RunId(joined.manifest.run));
                events.emit(ev::Event::RunLeft(ev::RunLeft { run: RunId(joined.manifest.run).to_hex(), reason }));
            }
        }
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
    /// Bytes fetched for them: the update's, the changed shards' or the whole
    /// parameters' blob, or 0.
    bytes: u64,
    /// `held` (unchanged), `update` (the sparse update applied), `shards` (the
    /// changed shards fetched) or `full`.
    via: &'static str,
    /// Shards fetched, of how many (0 of 0: the run has a single shard).
    shards: (usize, usize),
}

/// The parameters a worker started its last round from: their blob hash and the
/// announced hashes of their shards.
#[derive(Debug)]
struct Held {
    hash: BlobHash,
    params: Tensors,
    shards: Vec<[u8; 32]>,
}

/// What a worker needs to fetch a round's parameters, off its training loop.
#[derive(Clone, Debug)]
struct ParamsSource {
    node: Node,
    /// The leader, asked first (the DHT is asked for more providers meanwhile).
    from: PeerId,
    sizes: Vec<usize>,
    /// The run's shards: the tensors of each.
    shards: Vec<std::ops::Range<usize>>,
    /// A sparse run's update layout.
    down: Option<Layout>,
    /// The run's fragments: an update changes the one its round synced.
    fragments: Vec<std::ops::Range<usize>>,
}

/// The parameters a round starts from. A worker that holds the previous round's
/// parameters reuses them when they did not change; in a sparse run it fetches
/// only the update and applies it; in a run published in shards it fetches only
/// the shards whose hash changed, in parallel, each from the leader and any peer
/// that has it. The result is checked against the announced hash. Anyone else (a
/// joiner, a worker that missed rounds, a failed check) fetches every shard, or the
/// whole parameters blob when the run has one shard.
async fn round_params(
    src: &ParamsSource,
    announcement: &RoundAnnouncement,
    held: Option<&Held>,
) -> anyhow::Result<RoundParams> {
    let params_ref = announcement.parameters.first().context("the announcement names no parameters")?;
    let want = BlobHash(params_ref.blob);
    let r = announcement.round;
    if let Some(h) = held {
        if h.hash == want {
            return Ok(RoundParams { params: h.params.clone(), bytes: 0, via: "held", shards: (0, 0) });
        }
        if let (Some(update), Some(layout)) = (&announcement.update, src.down)
            && BlobHash(update.base) == h.hash
        {
            let applied = async {
                let bytes = read(&fetch(&src.node, update.blob.blob, src.from, "round update").await?)?;
                // the update closed the previous round, and is seeded with it; it
                // changes the fragment that round synced
                let seed = r.saturating_sub(1);
                let fragment = &src.fragments[fragments::of_round(seed, src.fragments.len())];
                let sizes = fragments::masked(&src.sizes, fragment);
                let sent = sparse::decode_seeded(&bytes, &sizes, layout, seed).context("the round's update")?;
                let mut next = h.params.clone();
                sparse::subtract(&mut next, &sent, 1.0);
                anyhow::ensure!(wire::params_hash(&next) == want, "the updated parameters do not hash to {want}");
                Ok(next)
            };
            match applied.await {
                Ok(params) => {
                    return Ok(RoundParams { params, bytes: update.blob.size, via: "update", shards: (0, 0) });
                }
                Err(e) => tracing::warn!("round {r}: {e:#}; fetching the parameters"),
            }
        }
    }
    if announcement.parameters.len() > 1 {
        match shards(src, announcement, held).await {
            Ok(fetched) => return Ok(fetched),
            Err(e) => tracing::warn!("round {r}: {e:#}; fetching the whole parameters"),
        }
    }
    let path = fetch(&src.node, params_ref.blob, src.from, "round parameters").await?;
    let params = wire::read_params(&read(&path)?, &src.sizes)?;
    Ok(RoundParams { params, bytes: params_ref.size, via: "full", shards: (0, 0) })
}

/// The round's parameters from its shards: those `held` has under the same hash are
/// reused, the rest fetched in parallel.
async fn shards(src: &ParamsSource, a: &RoundAnnouncement, held: Option<&Held>) -> anyhow::Result<RoundParams> {
    let refs = &a.parameters[1..];
    anyhow::ensure!(
        refs.len() == src.shards.len(),
        "{} shards announced, the run has {}",
        refs.len(),
        src.shards.len()
    );
    let mut parts: Vec<Option<Tensors>> = vec![None; refs.len()];
    let mut fetching = JoinSet::new();
    for (i, (r, range)) in refs.iter().zip(&src.shards).enumerate() {
        match held.filter(|h| h.shards.get(i) == Some(&r.blob)) {
            Some(h) => parts[i] = Some(h.params[range.clone()].to_vec()),
            None => {
                let (node, from, hash) = (src.node.clone(), src.from, r.blob);
                let sizes = src.sizes[range.clone()].to_vec();
                fetching.spawn(async move {
                    let path = fetch(&node, hash, from, &format!("parameter shard {}", i + 1)).await?;
                    anyhow::Ok((i, wire::read_params(&read(&path)?, &sizes)?))
                });
            }
        }
    }
    let fetched = fetching.len();
    let mut bytes = 0;
    while let Some(done) = fetching.join_next().await {
        let (i, tensors) = done.context("a shard fetch failed")??;
        bytes += refs[i].size;
        parts[i] = Some(tensors);
    }
    let params: Tensors = parts.into_iter().flat_map(|p| p.unwrap_or_default()).collect();
    let want = BlobHash(a.parameters[0].blob);
    anyhow::ensure!(
        params.len() == src.sizes.len() && wire::params_hash(&params) == want,
        "the shards do not make up parameters {want}"
    );
    Ok(RoundParams { params, bytes, via: "shards", shards: (fetched, refs.len()) })
}

async fn train(
    plan: &WorkerPlan,
    io: TrainIo<'_>,
    signer: &mut Signer,
    joined: &Joined,
    gossip: Arc<tokio::sync::Mutex<mpsc::Receiver<Event>>>,
) -> anyhow::Result<Outcome> {
    let TrainIo { node, events, data_dir, .. } = io;
    let m = &joined.manifest;
    let run = RunId(m.run);
    let vmfb = read(&fetch(node, joined.artifact.blob, joined.shepherd, "training artifact").await?)?;
    let corpus_path = fetch(node, m.data.blob, joined.shepherd, "corpus").await?;
    let corpus = Corpus::load(&corpus_path, &m.data.tokenizer, None, m.data.val_fraction)?;
    let sizes = wire::sizes(m);
    let encoding = Encoding::parse(&m.encoding).with_context(|| format!("the run uses encoding {:?}", m.encoding))?;
    let feedback_file = feedback_path(data_dir, run);
    let feedback = encoding.sparse().map(|s| load_feedback(&feedback_file, &sizes, s));
    // what this worker trained last, and the highest term it followed: it never
    // moves back, across restarts too
    let chain_file = chain_path(data_dir, run);
    let term_file = term_path(data_dir, run);
    let mut chain = load_chain(&chain_file);
    chain.term = chain.term.max(load_term(&term_file));
    let zeros: Tensors = sizes.iter().map(|n| vec![0.0; *n]).collect();
    let mut engine =
        Engine::new(plan.device, vmfb, wire::shapes(m), zeros, None, m.state_per_param as usize, m.data.int64).await?;
    // a device too small for the run's batch: the shepherd compiled a micro-batch step for it
    let micro_batches = joined.artifact.micro_batches.max(1);
    engine.accumulate(micro_batches as usize).await?;
    if let Err(e) = node.subscribe(run).await {
        tracing::warn!("subscribing to run {run}: {e}");
    }
    let me = signer.identity().public();
    events.emit(ev::Event::RunJoined(ev::RunJoined {
        run: run.to_hex(),
        shepherd: joined.shepherd.to_string(),
        backend: plan.backend.clone(),
        target: plan.target.clone(),
        artifact: BlobHash(joined.artifact.blob).to_hex(),
        screen: m.screen.clone(),
        trim: f64::from(m.trim),
        rounds: m.rounds,
        tau: u64::from(m.inner_steps),
        encoding: encoding.name().to_owned(),
        encoding_spec: encoding.spec(),
        overlap: m.overlap,
    }));
    let recompute = if joined.artifact.recompute.is_empty() { &m.recompute } else { &joined.artifact.recompute };
    events.emit(ev::Event::MicroBatches(ev::MicroBatches {
        batch: u64::from(m.data.batch),
        micro_batches: u64::from(micro_batches),
        micro_batch: u64::from(m.data.batch / micro_batches),
        free_bytes: plan.free_memory.0,
        free_from: plan.free_memory.1.to_owned(),
        estimate_bytes: joined.artifact.estimate_bytes,
        recompute: recompute.clone(),
        cache_bytes: 0,
    }));
    if plan.verbose && micro_batches > 1 {
        println!(
            "this device ({:.2} GB free) trains each batch of {} as {micro_batches} micro-batches of {}, recompute {recompute}",
            plan.free_memory.0 as f64 / 1e9,
            m.data.batch,
            m.data.batch / micro_batches,
        );
    }
    if plan.verbose {
        println!(
            "joined run {run} ({}): shepherd {}, {} rounds of τ={}{}, artifact for {} ({:.1} MB)",
            m.name,
            joined.shepherd,
            m.rounds,
            m.inner_steps,
            if m.overlap { ", overlapped" } else { "" },
            if plan.target.is_empty() { plan.backend.clone() } else { format!("{}:{}", plan.backend, plan.target) },
            joined.artifact.size as f64 / 1e6
        );
    }

    let (latest_tx, latest) = watch::channel(Latest::Nothing);
    let (round_tx, round_rx) = watch::channel(0u64);
    let (leader_tx, leader) = watch::channel((joined.shepherd, joined.shepherd_key));
    let heartbeat = Heartbeats {
        node: node.clone(),
        signer: Signer::new(signer.identity().clone()),
        run,
        election: Election::resume(me, joined.succession.clone(), m.lease_ms.max(500), chain.term, wire::mono_ms()),
        term_file,
        saved_term: chain.term,
        heard: false,
        leader: leader_tx,
        latest: latest_tx,
        round: round_rx,
        events: events.clone(),
        gossip,
        forge: plan.hostile.is_some_and(|a| a.kind == Hostile::Forge),
        known: None,
        participants: None,
    };
    let _heartbeat = AbortOnDrop(tokio::spawn(heartbeat.run()));
    let mut trainer = Trainer {
        plan,
        io,
        m,
        run,
        me,
        corpus,
        sizes,
        encoding,
        feedback,
        feedback_file,
        chain,
        chain_file,
        held: None,
        shards: wire::shard_ranges(m)?,
        fragments: fragments::split(&wire::sizes(m), m.fragments.max(1) as usize)?,
        trained: None,
        retention: super::Retention::new(plan.keep_rounds),
        engine,
        adam_step: 0,
        latest,
        leader,
        round_tx,
        clock: Clock::default(),
        attacker: hostile::Attacker::default(),
    };
    host::run(&mut trainer, signer).await
}

/// A worker's time in inner steps since its last contribution, and since when.
#[derive(Debug, Default)]
struct Clock {
    since: Option<Instant>,
    train_s: f64,
}

impl Clock {
    /// Work began (the first fetch of a round): the wall clock starts if it had not.
    fn start(&mut self) {
        self.since.get_or_insert_with(Instant::now);
    }

    /// Milliseconds in inner steps and of wall time since the last lap; restarts.
    fn lap(&mut self) -> (u64, u64) {
        let wall = self.since.replace(Instant::now()).map_or(0.0, |s| s.elapsed().as_secs_f64());
        let train = std::mem::take(&mut self.train_s).min(wall);
        ((train * 1e3) as u64, (wall * 1e3) as u64)
    }
}

/// A round's inner steps so far.
#[derive(Debug, Default)]
struct Progress {
    taken: u64,
    loss_sum: f64,
}

/// Why a round's parameters did not arrive.
enum Fetched {
    Got(RoundParams),
    Failed(String),
    Cancelled,
}

/// A worker in a run: its engine, its error feedback and the chain it follows.
struct Trainer<'a> {
    plan: &'a WorkerPlan,
    io: TrainIo<'a>,
    m: &'a RunManifest,
    run: RunId,
    me: PublicKey,
    corpus: Corpus,
    sizes: Vec<usize>,
    encoding: Encoding,
    feedback: Option<ErrorFeedback>,
    feedback_file: PathBuf,
    chain: Chain,
    chain_file: PathBuf,
    /// The parameters the last round started from, by blob hash.
    held: Option<Arc<Held>>,
    /// The run's shards: the tensors of each.
    shards: Vec<std::ops::Range<usize>>,
    /// The run's Streaming DiLoCo fragments: the tensors of each (one: all).
    fragments: Vec<std::ops::Range<usize>>,
    /// The last round this worker sent a contribution for: its parameters outside
    /// the fragment the next round brings are its own to keep.
    trained: Option<u64>,
    /// The blobs of its recent rounds, kept; older ones are released.
    retention: super::Retention,
    engine: Engine,
    adam_step: u64,
    latest: watch::Receiver<Latest>,
    leader: watch::Receiver<Leader>,
    /// The round this worker trains, for its heartbeats.
    round_tx: watch::Sender<u64>,
    clock: Clock,
    /// A hostile worker's memory (tests).
    attacker: hostile::Attacker,
}

/// What the next announcement asks of the worker.
enum Next {
    /// Train this round.
    Train(Box<RoundAnnouncement>),
    /// Nothing for this worker (not a participant, already trained, refused).
    Skip,
    /// Stop training on this run.
    Stop(Outcome),
}

impl Trainer<'_> {
    fn tau(&self) -> u64 {
        u64::from(self.m.inner_steps)
    }

    /// The tensors round `r` syncs (every tensor without fragments).
    fn fragment(&self, r: u64) -> std::ops::Range<usize> {
        self.fragments[fragments::of_round(r, self.fragments.len())].clone()
    }

    /// Loads round `a`'s parameters into the engine. After sending the previous
    /// round, only the fragment that round synced is taken from them (all of them
    /// without fragments): the other fragments' local progress is this worker's
    /// until their own round. Anyone else starts from all of them.
    async fn load(&mut self, a: &RoundAnnouncement, params: &Tensors) -> anyhow::Result<()> {
        if self.fragments.len() > 1 && self.trained == Some(a.round - 1) {
            let mut local = self.engine.params().await?;
            for i in self.fragment(a.round - 1) {
                local[i].clone_from(&params[i]);
            }
            self.engine.set_params(local).await
        } else {
            self.engine.set_params(params.clone()).await
        }
    }

    fn courier(&self) -> Courier {
        Courier {
            node: self.io.node.clone(),
            run: self.run,
            leader: self.leader.clone(),
            latest: self.latest.clone(),
            cancel: self.io.cancel.clone(),
        }
    }

    /// A sampler for this worker's data in round `r`.
    fn sampler(&self, r: u64) -> anyhow::Result<Sampler> {
        let seed = pcp_protocol::diloco::data_seed(self.m.seed, &self.me.0, r);
        Ok(Sampler::new(self.corpus.train.clone(), self.m.data.batch as usize, self.m.data.block as usize, seed)?)
    }

    /// What `a` asks of the worker, if it is newer than `done`: the run's end, a
    /// round to train, or nothing. A round this worker takes part in is checked
    /// against the chain it follows.
    fn consider(&mut self, a: Box<RoundAnnouncement>, done: &mut Option<Opening>) -> Next {
        if a.finished {
            self.io.events.emit(ev::Event::RunFinished(ev::RunFinished {
                run: Some(self.run.to_hex()),
                rounds: a.round,
                ..ev::RunFinished::default()
            }));
            if self.plan.verbose {
                println!("run {} finished after {} rounds", self.run, a.round);
            }
            return Next::Stop(Outcome::Finished);
        }
        let this = Opening::of(&a);
        if a.round == 0 || done.is_some_and(|d| d >= this) {
            return Next::Skip;
        }
        *done = Some(this);
        let participant = a.participants.contains(&self.me.0);
        if let Some(base) = a.parameters.first().map(|p| p.blob).filter(|_| participant) {
            if let Err(behind) = self.chain.admits(a.term, a.round, &base) {
                tracing::warn!("run {}: not training round {} of term {}: {behind}", self.run, a.round, a.term);
                self.io.events.emit(ev::Event::RoundRefused(ev::RoundRefused {
                    round: a.round,
                    term: a.term,
                    reason: behind.to_string(),
                }));
                return Next::Skip;
            }
            self.chain.follow(a.term, a.round, base);
            if let Err(e) = save_chain(&self.chain_file, &self.chain) {
                tracing::warn!("saving the followed chain: {e:#}");
            }
        }
        self.io.events.emit(ev::Event::RoundAnnounced(ev::RoundAnnounced {
            round: a.round,
            deadline_unix_ms: a.deadline_unix_ms,
            participant,
        }));
        if !participant {
            return Next::Skip;
        }
        let _ = self.round_tx.send(a.round);
        if a.parameters.is_empty() { Next::Skip } else { Next::Train(a) }
    }

    /// Fetches the parameters `a` announces (see [`round_params`]), off this task.
    fn fetch_task(&self, a: &RoundAnnouncement) -> impl Future<Output = anyhow::Result<RoundParams>> + Send + 'static {
        let src = ParamsSource {
            node: self.io.node.clone(),
            from: self.leader.borrow().0,
            sizes: self.sizes.clone(),
            shards: self.shards.clone(),
            down: self.encoding.sparse().map(|s| s.down()),
            fragments: self.fragments.clone(),
        };
        let (a, held) = (a.clone(), self.held.clone());
        async move { round_params(&src, &a, held.as_deref()).await }
    }

    /// Fetches round `a`'s parameters; a newer announcement (a leader that died
    /// mid-fetch was replaced) or cancellation ends the wait.
    async fn fetch_round(&mut self, a: &RoundAnnouncement) -> Fetched {
        self.clock.start();
        let mut watching = self.latest.clone();
        tokio::select! {
            () = self.io.cancel.cancelled() => Fetched::Cancelled,
            () = newer_arrives(&mut watching, Opening::of(a)) => Fetched::Failed("a newer announcement".into()),
            fetched = self.fetch_task(a) => match fetched {
                Ok(p) => Fetched::Got(p),
                Err(e) => Fetched::Failed(format!("{e:#}")),
            },
        }
    }

    /// Remembers `params` as round `a`'s start (what a sparse update applies to).
    async fn hold(&mut self, a: &RoundAnnouncement, params: &RoundParams) {
        tracing::debug!("round {}: parameters {} ({} bytes)", a.round, params.via, params.bytes);
        self.io.events.emit(ev::Event::ParamsFetched(ev::ParamsFetched {
            round: a.round,
            via: params.via.to_owned(),
            bytes: params.bytes,
            shards: params.shards.0 as u64,
            of: params.shards.1 as u64,
        }));
        self.held = a.parameters.first().map(|p| {
            let shards = a.parameters[1..].iter().map(|s| s.blob).collect();
            Arc::new(Held { hash: BlobHash(p.blob), params: params.params.clone(), shards })
        });
        // the blobs of rounds older than this worker keeps go
        let used = a.parameters.iter().map(|p| p.blob).chain(a.update.as_ref().map(|u| u.blob.blob));
        self.retention.advance(self.io.node, self.io.events, a.round, used.map(BlobHash)).await;
    }

    /// Inner step `i` of round `r`: its loss.
    async fn step(&mut self, r: u64, i: u64, sampler: &mut Sampler) -> anyhow::Result<f32> {
        self.adam_step += 1;
        let global = (r - 1) * self.tau() + i + 1;
        let s = &self.m.schedule;
        let lr = learning_rate(global, s.total_steps, s.learning_rate, s.min_lr, s.warmup_steps);
        let started = Instant::now();
        let loss = self.engine.step(self.adam_step, lr as f32, &sampler.next_batch()).await?;
        if let Some(delay) = self.plan.step_delay {
            tokio::time::sleep(delay).await;
        }
        self.clock.train_s += started.elapsed().as_secs_f64();
        Ok(loss)
    }

    /// Round `a`'s contribution: θ_start − θ_end, encoded (through the error
    /// feedback in a sparse run).
    fn outgoing(&mut self, a: &RoundAnnouncement, start: &Tensors, end: &Tensors, progress: &Progress) -> Outgoing {
        let r = a.round;
        // θ_start − θ_end over the round's fragment; the other tensors are empty
        let fragment = self.fragment(r);
        let mut delta: Tensors = (0..start.len())
            .map(|i| match fragment.contains(&i) {
                true => start[i].iter().zip(&end[i]).map(|(s, e)| s - e).collect(),
                false => Vec::new(),
            })
            .collect();
        self.trained = Some(r);
        let hostile = self.plan.hostile.and_then(|a| a.at(r));
        if self.plan.hostile.is_some() {
            let slot = self.plan.replay.as_ref();
            self.attacker.corrupt(self.plan.hostile, r, start, &mut delta, slot, fragment.clone());
        }
        // a free rider's zeros, copy or replay go on the wire as they are, not
        // through its error feedback (which would send its honest residuals)
        let verbatim = matches!(hostile, Some(Hostile::Zero | Hostile::Copy | Hostile::Replay(_)));
        let (bytes, sent) = match (self.feedback.as_mut(), self.encoding.sparse()) {
            (Some(_), Some(s)) if verbatim => (sparse::encode_seeded(&delta, s.up, r).0, None),
            (Some(ef), _) => {
                let (bytes, sent) = ef.compress_seeded(&delta, 1.0, r);
                (bytes, Some(sent))
            }
            (None, _) => (compress::encode(&delta, self.encoding), None),
        };
        drop(delta);
        let trained_s = self.clock.train_s;
        let (train_ms, wall_ms) = self.clock.lap();
        let tokens = u64::from(self.m.data.batch) * u64::from(self.m.data.block);
        let contribution = Contribution {
            run: self.run.0,
            round: r,
            inner_steps: progress.taken as u32,
            samples: match hostile {
                Some(Hostile::Inflate) => 1_000_000_000_000,
                _ => progress.taken * tokens,
            },
            pseudo_gradient: ParameterRef {
                name: "delta".into(),
                shard: 0,
                blob: *blake3::hash(&bytes).as_bytes(),
                size: bytes.len() as u64,
            },
            loss: (progress.loss_sum / progress.taken.max(1) as f64) as f32,
            delta: bytes,
            bytes_down: 0,
            term: a.term,
            params_hash: a.parameters.first().map(|p| p.blob).unwrap_or_default(),
            // `timing`: a claim of 1 ms for the round's steps
            train_ms: if hostile == Some(Hostile::Timing) { 1 } else { train_ms },
            wall_ms,
            sent_unix_ms: wire::unix_ms(),
        };
        let late = hostile == Some(Hostile::Late);
        Outgoing { contribution, sent, trained_s, late }
    }

    /// After a send: a refused contribution's sparse entries go back into the error
    /// feedback (sent again later, not lost), and the event says how it fared.
    fn finish(&mut self, out: Outgoing, delivery: &Delivery) {
        let c = &out.contribution;
        if let (Some(ef), Some(sent)) = (self.feedback.as_mut(), &out.sent) {
            if !delivery.accepted {
                sparse::subtract(&mut ef.buffer, sent, -1.0);
            }
            if let Err(e) = save_feedback(&self.feedback_file, ef) {
                tracing::warn!("saving the error feedback: {e:#}");
            }
        }
        let param_bytes = 4 * self.sizes.iter().sum::<usize>() as u64;
        let wire_bytes = delivery.wire_bytes;
        let utilization = (c.wall_ms > 0).then(|| c.train_ms as f64 / c.wall_ms as f64);
        self.io.events.emit(ev::Event::ContributionSent(ev::ContributionSent {
            round: c.round,
            loss: f64::from(c.loss),
            bytes: wire_bytes,
            param_bytes,
            ratio: wire_bytes as f64 / param_bytes as f64,
            accepted: delivery.accepted,
            reason: delivery.reason.clone(),
            tokens: c.samples,
            seconds: out.trained_s,
            bytes_up: wire_bytes,
            bytes_down: c.bytes_down,
            utilization,
            train_s: c.train_ms as f64 / 1e3,
            wall_s: c.wall_ms as f64 / 1e3,
        }));
        if self.plan.verbose {
            let verdict =
                if delivery.accepted { "accepted".to_owned() } else { format!("rejected: {}", delivery.reason) };
            println!(
                "round {}: {} steps, mean loss {:.4}, sent {:.2} MB, {verdict}",
                c.round,
                c.inner_steps,
                c.loss,
                wire_bytes as f64 / 1e6
            );
        }
    }
}
