//! The worker role: the default for a node that is not a shepherd.

mod aggregator;
mod disk;
mod heartbeats;
mod hostile;
mod join;
mod pow;
mod round;
mod screener;
mod send;
mod slices;

pub(crate) use aggregator::Standalone;
pub(crate) use hostile::{Attack, HOSTILE_KINDS, Hostile, ReplaySlot};
pub(crate) use screener::request_overhead as screen_request_overhead;
pub(crate) use slices::{commit as commit_slices, cut as cut_slices, send as send_slices};

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use pcp_bootstrap::{Event, Node, PeerId};
use pcp_protocol::diloco::Tensors;
use pcp_protocol::diloco::compress::{self, Encoding};
use pcp_protocol::diloco::follower::{Leases, Rounds};
use pcp_protocol::diloco::fragments;
use pcp_protocol::diloco::sparse::{self, ErrorFeedback, Layout};
use pcp_protocol::{BlobHash, PublicKey, RunId};
use pcp_runtime::Device;
use pcp_schema::{RoundAnnouncement, RunManifest};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::RoleIo;
use super::wire::{self, Signer};
use crate::Failure;
use crate::observe::events::{self as ev, Events};
use crate::training::data::Corpus;
use crate::training::engine::Engine;
use disk::{chain_path, feedback_path, load_chain, load_feedback, load_term, term_path};
use heartbeats::{AbortOnDrop, Heartbeats, Latest};
use join::{Joined, discover};

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
    /// Offer to sum parameter shards of the run: a shepherd with --aggregators
    /// assigns shards to rated volunteers in its announcements, and this node sums
    /// the slices its workers send (it still trains unless --no-train).
    #[arg(long)]
    pub(crate) aggregate: bool,
    /// With --aggregate: the memory the slices not yet accepted may take (default
    /// 1GiB); the rest wait on disk, in the data directory, until their accepts come.
    #[arg(long, value_name = "SIZE", value_parser = crate::training::memory::parse_size)]
    pub(crate) aggregate_memory: Option<u64>,
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
    /// It offers to sum parameter shards (`--aggregate`).
    pub(crate) aggregate: bool,
    /// The bytes of slices not yet accepted its aggregator holds in memory (`--aggregate-memory`).
    aggregate_memory: u64,
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
            aggregate: args.aggregate,
            aggregate_memory: args.aggregate_memory.unwrap_or(aggregator::DEFAULT_MEMORY),
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
    // a volunteer aggregator takes this worker's own slices straight (a node cannot dial itself)
    let (own_slices, own_rx) = match plan.aggregate {
        true => {
            let (tx, rx) = mpsc::channel(OWN_SLICES);
            (Some(tx), Some(Arc::new(tokio::sync::Mutex::new(rx))))
        }
        false => (None, None),
    };
    loop {
        let Some(joined) = discover(&plan, (node, &data_dir), &mut signer, &cancel).await? else { return Ok(()) };
        let io = TrainIo { node, events, data_dir: &data_dir, cancel: &cancel, own_slices: own_slices.as_ref() };
        match train(&plan, io, &mut signer, &joined, (gossip.clone(), own_rx.clone())).await? {
            Outcome::Finished | Outcome::Cancelled => return Ok(()),
            Outcome::Rejoin(reason) => {
                tracing::warn!("leaving run {}: {reason}", RunId(joined.manifest.run));
                events.emit(ev::Event::RunLeft(ev::RunLeft { run: RunId(joined.manifest.run).to_hex(), reason }));
            }
        }
    }
}

/// Records (and, verbose, prints) that this worker joined `joined`'s run, and how
/// its device takes the run's batch.
fn say_joined(plan: &WorkerPlan, events: &Events, joined: &Joined, encoding: Encoding, micro_batches: u32) {
    let m = &joined.manifest;
    let run = RunId(m.run);
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
    /// A volunteer aggregator's: where this worker's slices of its own shards go.
    own_slices: Option<&'a mpsc::Sender<pcp_schema::Slice>>,
}

/// A worker's own slices its aggregator holds, queued at most.
const OWN_SLICES: usize = 64;

/// The requests of the worker's role, and a volunteer aggregator's own slices.
type Inbound = (
    Arc<tokio::sync::Mutex<mpsc::Receiver<Event>>>,
    Option<Arc<tokio::sync::Mutex<mpsc::Receiver<pcp_schema::Slice>>>>,
);

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
/// whole parameters blob when the run has one shard (a sharded round has no whole
/// blob: the shepherd writes its parameters once, as shards).
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
        return shards(src, announcement, held).await;
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
    (gossip, own_rx): Inbound,
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
    engine.screens_sparse(wire::manifest_sparse_screen(m));
    if let Err(e) = node.subscribe(run).await {
        tracing::warn!("subscribing to run {run}: {e}");
    }
    let me = signer.identity().public();
    say_joined(plan, events, joined, encoding, micro_batches);

    let (latest_tx, latest) = watch::channel(Latest::Nothing);
    let (deadline_tx, deadline) = watch::channel((0u64, 0u64));
    let (round_tx, round_rx) = watch::channel(0u64);
    let (leader_tx, leader) = watch::channel((joined.shepherd, joined.shepherd_key));
    // the leader's screen requests, scored between inner steps
    let (screen_tx, screen_rx) = mpsc::channel(screener::QUEUED);
    let screen_len = compress::encoded_len(&sizes, encoding) + screener::request_overhead(sizes.len());
    node.admission().screen_for(run, joined.shepherd_key, screen_len);
    let screens = screener::Screens {
        requests: screen_rx,
        signer: Signer::new(signer.identity().clone()),
        before: None,
        resident: None,
    };
    let heartbeat = Heartbeats {
        node: node.clone(),
        signer: Signer::new(signer.identity().clone()),
        run,
        leases: Leases::new(me, joined.succession.clone(), m.lease_ms.max(500), chain.term, wire::mono_ms()),
        term_file,
        heard: false,
        leader: leader_tx,
        latest: latest_tx,
        deadline: deadline_tx,
        round: round_rx,
        events: events.clone(),
        gossip,
        forge: plan.hostile.is_some_and(|a| a.kind == Hostile::Forge),
        known: None,
        participants: None,
        aggregator: None,
        screens: (screen_tx, screen_len),
        lease_ms: m.lease_ms.max(500),
    };
    // a volunteer's aggregator takes the requests addressed to it
    let (heartbeat, _aggregator) = match plan.aggregate {
        false => (heartbeat, None),
        true => {
            let (tx, requests) = mpsc::channel(crate::diloco::inbox::CONTROL_QUEUE);
            let task = aggregator::AggregatorTask {
                node: node.clone(),
                signer: Signer::new(signer.identity().clone()),
                run,
                me,
                hostile: plan.hostile,
                sizes: sizes.clone(),
                encoding,
                store: pcp_bootstrap::BlobStore::open(data_dir)?,
                served: aggregator::Served::default(),
                spill: (
                    data_dir.join("aggregator-spill"),
                    usize::try_from(plan.aggregate_memory).unwrap_or(usize::MAX),
                ),
                events: events.clone(),
                leader: leader.clone(),
                latest: latest.clone(),
                requests,
                own: own_rx,
                cancel: io.cancel.child_token(),
            };
            (Heartbeats { aggregator: Some(tx), ..heartbeat }, Some(AbortOnDrop(tokio::spawn(task.run()))))
        }
    };
    let _heartbeat = AbortOnDrop(tokio::spawn(heartbeat.run()));
    let trainer = Trainer {
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
        rounds: Rounds::new(chain),
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
    round::run(trainer, signer, screens, deadline).await
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
    /// The rounds it takes: the chain it follows, and the last announcement taken.
    rounds: Rounds,
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
