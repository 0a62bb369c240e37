//! The worker role: the default for a node that is not a shepherd.

mod host;
mod hostile;
mod pow;

pub(crate) use hostile::{Attack, HOSTILE_KINDS, Hostile, ReplaySlot};

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use std::sync::Arc;

use pcp_bootstrap::{Event, Node, PeerId, RequestError};
use pcp_protocol::diloco::Tensors;
use pcp_protocol::diloco::compress::{self, Encoding};
use pcp_protocol::diloco::fragments;
use pcp_protocol::diloco::sparse::{self, ErrorFeedback, Layout, Settings, SparseTensors};
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
use crate::observe::events::{self as ev, Events};
use crate::training::data::Corpus;
use crate::training::data::Sampler;
use crate::training::engine::Engine;
use crate::training::schedule::learning_rate;

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

/// How often a worker heartbeats (and so polls for rounds).
const HEARTBEAT: Duration = Duration::from_millis(500);
/// A contribution lost on the way is sent again, this many times in all, while its
/// round is open.
const MAX_SENDS: u32 = 8;
/// How long a contribution's answer is still awaited once an announcement made
/// it moot: the close that sent the announcement may also have acknowledged it.
const ANSWER_GRACE: Duration = Duration::from_secs(1);
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

/// Finds a run and joins it: the signed manifest with an artifact for this node.
async fn discover(
    plan: &WorkerPlan,
    (node, data_dir): (&Node, &Path),
    signer: &mut Signer,
    cancel: &CancellationToken,
) -> anyhow::Result<Option<Joined>> {
    let key = plan.run.map_or_else(wire::runs_key, wire::run_key);
    let mut said = false;
    loop {
        let providers = node.providers(key, 8).await?;
        for peer in providers {
            match join(plan, (node, data_dir), signer, peer).await {
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

async fn join(
    plan: &WorkerPlan,
    (node, data_dir): (&Node, &Path),
    signer: &mut Signer,
    peer: PeerId,
) -> Result<Joined, JoinError> {
    let me = signer.identity().public();
    // the proof of work kept for the run named, if any (see `pow`)
    let kept = plan.run.and_then(|run| pow::cached(data_dir, run, &me)).map_or(0, |(nonce, _)| nonce);
    let hello = NodeHello {
        peer: me.0,
        protocol_version: wire::PROTOCOL_VERSION,
        agent: format!("pcp-node/{}", env!("CARGO_PKG_VERSION")),
        capabilities: Capabilities {
            backends: vec![Backend { name: plan.backend.clone(), targets: vec![plan.target.clone()] }],
            free_memory_bytes: plan.free_memory.0,
        },
        certificate: plan.certificate.clone(),
        pow_nonce: kept,
    };
    // a hello is for whichever run the shepherd runs: bound to the zero run id
    let envelope = signer.seal(plan.run.unwrap_or(RunId([0; 32])), 0, &hello);
    let mut answer = node.request(peer, envelope).await.map_err(|e| JoinError::Skip(e.to_string()))?;
    // an open run that asks a proof of work of each identity: solve it, and say hello
    // again (asked for more while it solved, go on from the nonce found)
    let mut tries = 0;
    while let Some((run, bits)) = pow_asked(&answer) {
        tries += 1;
        if tries > pow::MAX_TRIES {
            return Err(JoinError::Skip(format!("run {run} still asks a proof of work of {bits} bits")));
        }
        let nonce = pow::solve(data_dir, run, me, bits).await.map_err(|e| JoinError::Skip(format!("{e:#}")))?;
        let hello = NodeHello { pow_nonce: nonce, ..hello.clone() };
        let envelope = signer.seal(plan.run.unwrap_or(RunId([0; 32])), 0, &hello);
        answer = node.request(peer, envelope).await.map_err(|e| JoinError::Skip(e.to_string()))?;
    }
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
            // the run's gossip is its candidates' alone (`Admission::may_gossip`)
            node.admission().candidates(run, succession.order());
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
            match ack.code {
                pcp_schema::AckCode::NoArtifact => Err(JoinError::Fatal(anyhow::anyhow!("{}", ack.reason))),
                _ => Err(JoinError::Skip(ack.reason)),
            }
        }
        other => Err(JoinError::Skip(format!("answered a hello with {}", other.tag()))),
    }
}

/// A shepherd's refusal that asks a proof of work: its run and the bits it needs (at
/// most [`pcp_protocol::admit::MAX_POW_BITS`]; a run that asks more is not joined).
fn pow_asked(answer: &pcp_protocol::Verified) -> Option<(RunId, u8)> {
    if answer.kind() != MessageKind::Ack {
        return None;
    }
    let ack: Ack = answer.decode().ok()?;
    let bits = ack.pow_bits;
    let asked = ack.code == pcp_schema::AckCode::ProofOfWork && bits <= pcp_protocol::admit::MAX_POW_BITS;
    asked.then_some((RunId(ack.run), bits))
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

/// Where a sparse run's error feedback survives a restart.
fn feedback_path(data_dir: &Path, run: RunId) -> PathBuf {
    data_dir.join("worker").join(format!("feedback-{}.bin", run.to_hex()))
}

fn chain_path(data_dir: &Path, run: RunId) -> PathBuf {
    data_dir.join("worker").join(format!("chain-{}.json", run.to_hex()))
}

/// Where a worker keeps the highest term it has seen for `run` (a lease it
/// followed, whether or not it trained a round of it): across a restart it never
/// follows a lower one.
fn term_path(data_dir: &Path, run: RunId) -> PathBuf {
    data_dir.join("worker").join(format!("term-{}.json", run.to_hex()))
}

/// The highest term saved at `path`; 0 when absent, damaged or longer than a
/// record (4 KiB).
fn load_term(path: &Path) -> u64 {
    std::fs::read(path)
        .ok()
        .filter(|b| b.len() <= 4096)
        .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
        .and_then(|v| v["term"].as_u64())
        .unwrap_or(0)
}

fn save_term(path: &Path, term: u64) -> anyhow::Result<()> {
    let dir = path.parent().context("term path has no parent")?;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, json!({ "term": term }).to_string()).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("renaming {}", tmp.display()))?;
    Ok(())
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

/// An announcement's identity: round, term and deadline. A successor's reopening
/// of a round, or a restarted shepherd's, is a new round to train.
type Key = (u64, u64, u64);

fn key(a: &RoundAnnouncement) -> Key {
    (a.round, a.term, a.deadline_unix_ms)
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

/// A contribution ready to send, and what its sender must remember.
#[derive(Debug)]
struct Outgoing {
    contribution: Contribution,
    /// The sparse entries it takes from the error feedback (given back if refused).
    sent: Option<SparseTensors>,
    trained_s: f64,
    /// A late attacker's: sent only after its round closed.
    late: bool,
}

/// How a sent contribution fared.
#[derive(Debug)]
struct Delivery {
    accepted: bool,
    reason: String,
    wire_bytes: u64,
}

/// Where contributions go: the node, the followed leader, and the announcements
/// that make a send moot.
#[derive(Clone, Debug)]
struct Courier {
    node: Node,
    run: RunId,
    leader: watch::Receiver<Leader>,
    latest: watch::Receiver<Latest>,
    cancel: CancellationToken,
}

impl Courier {
    /// Waits until the round after `this` is announced, and a moment more (a late
    /// attacker's send time).
    async fn after_close(&self, this: Key) {
        let mut watching = self.latest.clone();
        newer_arrives(&mut watching, this).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
    }

    /// Sends `contribution` to the followed leader. A send to a leader that died (or
    /// refused it unread) must not hold up the round that replaces it: an
    /// announcement that makes it moot abandons it ([`superseded`]). One lost on
    /// the way (a cut link, a leader busy past the timeout) is sent again while the
    /// round is open, so that the round does not wait on it for good. `None`:
    /// cancelled.
    async fn deliver(&self, signer: &mut Signer, contribution: &Contribution, this: Key) -> Option<Delivery> {
        let r = contribution.round;
        let mut envelope = signer.seal(self.run, r, contribution);
        let wire_bytes = envelope.encode().len() as u64;
        let mut watching = self.latest.clone();
        let mut tries = 0u32;
        let answer = loop {
            let (to, to_key) = *self.leader.borrow();
            let request = self.node.request(to, envelope);
            tokio::pin!(request);
            let answer = tokio::select! {
                () = self.cancel.cancelled() => return None,
                answer = &mut request => Some((answer, to_key)),
                () = superseded(&mut watching, this) => tokio::select! {
                    // the leader's answer and the announcement its close sent race
                    // (gossip can win): an answer already on its way still counts
                    () = self.cancel.cancelled() => return None,
                    answer = &mut request => Some((answer, to_key)),
                    () = tokio::time::sleep(ANSWER_GRACE) => None,
                },
            };
            tries += 1;
            match answer {
                Some((Err(e @ (RequestError::Failed { .. } | RequestError::Busy { .. })), _))
                    if tries < MAX_SENDS && !newer_round(&self.latest, this) =>
                {
                    tracing::warn!("round {r}: sending the contribution failed ({e}); sending it again");
                    tokio::select! {
                        () = self.cancel.cancelled() => return None,
                        () = newer_arrives(&mut watching, this) => break None,
                        () = tokio::time::sleep(HEARTBEAT * 2) => {}
                    }
                    envelope = signer.seal(self.run, r, contribution);
                }
                other => break other,
            }
        };
        let (accepted, reason) = match answer {
            Some((answer, to_key)) => ack_of(answer, to_key),
            None => (false, "abandoned: a newer announcement made it moot before the answer".to_owned()),
        };
        Some(Delivery { accepted, reason, wire_bytes })
    }
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
    fn consider(&mut self, a: Box<RoundAnnouncement>, done: &mut Option<Key>) -> Next {
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
        let this = key(&a);
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
            () = newer_arrives(&mut watching, key(a)) => Fetched::Failed("a newer announcement".into()),
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

/// Waits until an announcement makes a send for `current` moot (forever if the
/// heartbeat task stops): a newer term (the leader changed), the same round
/// announced again (a restarted leader reopened it: the send went to the old
/// one), a round two or more past it, the run's end, or a refusal. The next round
/// of the same term does not: the contribution that closes a round is answered
/// after the next round is announced.
async fn superseded(latest: &mut watch::Receiver<Latest>, current: Key) {
    let moot = |l: &Latest| match l {
        Latest::Round(a) => {
            a.term > current.1 || a.finished || a.round >= current.0 + 2 || (a.round == current.0 && key(a) > current)
        }
        Latest::Refused(_) => true,
        Latest::Nothing => false,
    };
    while !moot(&latest.borrow()) {
        if latest.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
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
    /// Where the highest term it followed is kept, and that term.
    term_file: PathBuf,
    saved_term: u64,
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
    /// The hash of the announcement last put in `latest` (see `known` in the
    /// heartbeat's schema): the leader answers a heartbeat naming its current one
    /// with a small heartbeat of its own.
    known: Option<[u8; 32]>,
    /// The last participants blob fetched (see [`super::participants`]).
    participants: super::participants::Cached,
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
                            let Some(latest) = self.with_participants(latest, peer).await else { continue };
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
                        let Some(latest) = self.on_gossip(&message) else { continue };
                        let leader = self.leader.borrow().0;
                        let Some(latest) = self.with_participants(latest, leader).await else { continue };
                        if self.latest.send(latest).is_err() {
                            return;
                        }
                    }
                    Some(_) => {}
                    None => return,
                },
            }
        }
    }

    /// An announcement with its participants filled in from its blob, fetched from
    /// `from` (`None`: the blob could not be had; the next heartbeat asks again).
    async fn with_participants(&mut self, latest: Latest, from: PeerId) -> Option<Latest> {
        let Latest::Round(mut a) = latest else { return Some(latest) };
        match super::participants::resolve(&self.node, &mut a, from, &mut self.participants).await {
            Ok(()) => Some(Latest::Round(a)),
            Err(e) => {
                tracing::warn!("run {}: {e:#}", self.run);
                self.known = None;
                None
            }
        }
    }

    /// Reports a lapsed lease; the next heartbeat goes to the candidate awaited.
    fn expire(&mut self) {
        for action in self.election.tick(wire::mono_ms()) {
            if let election::Action::LeaseExpired { term, leader } = action {
                tracing::warn!("run {}: the lease of term {term} lapsed; asking the next candidate", self.run);
                self.events.emit(ev::Event::LeaseExpired(ev::LeaseExpired { term, peer: peer_name(&leader) }));
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
            consensus: None,
            known: self.known,
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
                    if term > self.saved_term {
                        // kept before it acts on the term: a restart never follows a lower one
                        match save_term(&self.term_file, term) {
                            Ok(()) => self.saved_term = term,
                            Err(e) => tracing::warn!("saving the followed term: {e:#}"),
                        }
                    }
                    if let Some(peer) = pcp_bootstrap::peer_of(&leader) {
                        if *self.leader.borrow() != (peer, leader) {
                            self.events
                                .emit(ev::Event::LeaderFollowed(ev::LeaderFollowed { term, peer: peer.to_string() }));
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
                self.known = Some(v.payload_hash());
                Ok(Some(Latest::Round(Box::new(a))))
            }
            // the announcement this worker holds is still current: a lease, no news
            MessageKind::Heartbeat => {
                let hb: Heartbeat = v.decode().map_err(|e| e.to_string())?;
                if hb.run != self.run.0 || hb.term == 0 {
                    return Err("answered a heartbeat with another run's or a term-less heartbeat".to_owned());
                }
                if hb.known.is_none() || hb.known != self.known {
                    self.known = None; // the next heartbeat asks for the announcement itself
                    return Ok(None);
                }
                self.lease(key, hb.term, "heartbeat answer");
                Ok(None)
            }
            MessageKind::Ack => {
                self.known = None;
                let ack: Ack = v.decode().map_err(|e| e.to_string())?;
                if ack.code == pcp_schema::AckCode::Standby {
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
                self.known = Some(message.payload_hash());
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
            participants_blob: None,
            finished: false,
            term: self.election.term() + 1,
            state: None,
            update: None,
            budget_ms: 0,
            steps_end_unix_ms: 0,
            screen_commit: [0; 32],
            screen_reveal: [0; 32],
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

    /// A worker keeps the highest term it has seen (a lease, whether or not it
    /// trained a round of it); a damaged or oversized file reads as none.
    #[test]
    fn the_highest_term_seen_survives_a_restart() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = term_path(dir.path(), RunId([3; 32]));
        assert_eq!(load_term(&path), 0, "nothing saved");
        save_term(&path, 7).expect("saves");
        assert_eq!(load_term(&path), 7);
        std::fs::write(&path, b"not json").expect("writes");
        assert_eq!(load_term(&path), 0, "damage is ignored");
        std::fs::write(&path, vec![b' '; 5000]).expect("writes");
        assert_eq!(load_term(&path), 0, "an oversized file is not read");
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
