//! `pcp-node loadtest`: N synthetic workers against a real shepherd, over real
//! libp2p connections, in one process.
//!
//! Each synthetic worker is a node of its own (its own identity and swarm), says
//! hello like a worker, heartbeats every half second, and for every round it takes
//! part in sends a real signed, well-formed contribution of the run's size and
//! encoding, after a sleep of the modelled step time × τ in place of compute. Its
//! pseudo-gradient is random, at `--norm`: what a Sybil would send, or the load of
//! honest workers whose quality does not matter. At the end it prints a table of
//! each round (contributions sent, accepted, refused and why) and writes it as JSON
//! with `--json`.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use pcp_bootstrap::{Config, EventLoop, Multiaddr, Node, PeerId};
use pcp_protocol::diloco::Tensors;
use pcp_protocol::diloco::compress::{self, Encoding};
use pcp_protocol::diloco::sparse::ErrorFeedback;
use pcp_protocol::{Identity, PublicKey, RunId};
use pcp_schema::{
    Ack, Backend, Capabilities, Contribution, Heartbeat, MessageKind, NodeHello, ParameterRef, RoundAnnouncement,
    RunManifest,
};
use rand::{Rng as _, SeedableRng as _};
use tokio::sync::Mutex;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::Failure;
use crate::diloco::wire::{self, Signer};

#[derive(Debug, Clone, clap::Args)]
pub(crate) struct LoadtestArgs {
    /// The shepherd's address, with its `/p2p/<peer id>`.
    #[arg(long)]
    shepherd: Multiaddr,
    /// Synthetic workers.
    #[arg(long, default_value_t = 10)]
    workers: usize,
    /// The modelled time of one inner step, milliseconds: a worker sends τ × this
    /// after a round opens.
    #[arg(long, default_value_t = 0)]
    step_ms: u64,
    /// The L2 norm of each random pseudo-gradient.
    #[arg(long, default_value_t = 0.05)]
    norm: f64,
    /// Stop after this many rounds (0: when the run finishes).
    #[arg(long, default_value_t = 0)]
    rounds: u64,
    /// Give up after this many seconds.
    #[arg(long, default_value_t = 600)]
    timeout_s: u64,
    /// Write the per-round table as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Seed of the identities and pseudo-gradients.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Say no hello: heartbeat and send one contribution as strangers would, and
    /// record how the shepherd answers (a test of `--admit`).
    #[arg(long)]
    skip_hello: bool,
}

/// One round's outcome across the synthetic workers.
#[derive(Debug, Default, Clone, serde::Serialize)]
struct RoundRow {
    round: u64,
    sent: u64,
    accepted: u64,
    refused: BTreeMap<String, u64>,
}

/// What every synthetic worker records.
#[derive(Debug, Default)]
struct Tally {
    rounds: BTreeMap<u64, RoundRow>,
    joined: u64,
    refused_hello: BTreeMap<String, u64>,
    /// `--skip-hello`: the answers to a stranger's heartbeat and contribution.
    refused_heartbeat: BTreeMap<String, u64>,
    refused_contribution: BTreeMap<String, u64>,
    /// Every synthetic worker's peer id.
    peers: Vec<String>,
}

/// The reason's kind: its text up to the first colon or digit (so counts group).
fn reason_kind(reason: &str) -> String {
    let cut = reason.find(|c: char| c == ':' || c.is_ascii_digit()).unwrap_or(reason.len());
    reason[..cut].trim().to_owned()
}

pub(crate) async fn run(args: LoadtestArgs, data_dir: PathBuf) -> Result<(), Failure> {
    let Some(shepherd) = args.shepherd.iter().find_map(|p| match p {
        pcp_bootstrap::multiaddr::Protocol::P2p(peer) => Some(peer),
        _ => None,
    }) else {
        return Err(Failure::input(anyhow::anyhow!("--shepherd {} has no /p2p/<peer id>", args.shepherd)));
    };
    let tally = Arc::new(Mutex::new(Tally::default()));
    let mut peers = Vec::new();
    let cancel = CancellationToken::new();
    let mut tasks = JoinSet::new();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(args.seed);
    for i in 0..args.workers {
        let identity = Identity::from_secret(rng.r#gen());
        let config = Config {
            bootstrap: vec![args.shepherd.clone()],
            ..Config::loopback(data_dir.join(format!("synthetic-{i}")))
        };
        peers.push(pcp_bootstrap::keypair(&identity).public().to_peer_id().to_string());
        let (node, _events, event_loop): (Node, _, EventLoop) =
            Node::new(&identity, config).map_err(|e| Failure::input(anyhow::anyhow!("synthetic worker {i}: {e}")))?;
        let task_cancel = cancel.child_token();
        tasks.spawn(event_loop.run(task_cancel.clone()));
        let worker = Synthetic { node, signer: Signer::new(identity), shepherd, args: args.clone(), index: i };
        let tally = tally.clone();
        tasks.spawn(async move {
            if let Err(e) = worker.run(tally, task_cancel).await {
                tracing::warn!("synthetic worker {i}: {e:#}");
            }
        });
    }
    tally.lock().await.peers = peers;
    let deadline = tokio::time::sleep(Duration::from_secs(args.timeout_s));
    tokio::pin!(deadline);
    let mut left = args.workers;
    loop {
        tokio::select! {
            () = &mut deadline => break,
            _ = tokio::signal::ctrl_c() => break,
            done = tasks.join_next() => match done {
                None => break,
                // an event loop ends only when cancelled; a worker when its run is over
                Some(_) => {
                    left = left.saturating_sub(1);
                    if left == 0 {
                        break;
                    }
                }
            },
        }
    }
    cancel.cancel();
    tasks.shutdown().await;
    let tally = tally.lock().await;
    report(&tally, args.json.as_deref())
}

fn report(tally: &Tally, json: Option<&std::path::Path>) -> Result<(), Failure> {
    use std::io::Write as _;
    let mut out = std::io::stdout().lock();
    let write = |e: std::io::Error| Failure::from(anyhow::anyhow!("writing the report: {e}"));
    writeln!(out, "joined: {}; hellos refused: {:?}", tally.joined, tally.refused_hello).map_err(write)?;
    if !tally.refused_heartbeat.is_empty() || !tally.refused_contribution.is_empty() {
        writeln!(
            out,
            "without a hello: heartbeats refused {:?}, contributions refused {:?}",
            tally.refused_heartbeat, tally.refused_contribution
        )
        .map_err(write)?;
    }
    writeln!(out, "{:>5} {:>6} {:>9}  refused", "round", "sent", "accepted").map_err(write)?;
    for row in tally.rounds.values() {
        writeln!(out, "{:>5} {:>6} {:>9}  {:?}", row.round, row.sent, row.accepted, row.refused).map_err(write)?;
    }
    if let Some(path) = json {
        let value = serde_json::json!({
            "joined": tally.joined,
            "refused_hello": tally.refused_hello,
            "refused_heartbeat": tally.refused_heartbeat,
            "refused_contribution": tally.refused_contribution,
            "peers": tally.peers,
            "rounds": tally.rounds.values().collect::<Vec<_>>(),
        });
        std::fs::write(path, serde_json::to_vec_pretty(&value).map_err(|e| Failure::from(anyhow::anyhow!("{e}")))?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// One synthetic worker.
struct Synthetic {
    node: Node,
    signer: Signer,
    shepherd: PeerId,
    args: LoadtestArgs,
    index: usize,
}

impl Synthetic {
    fn me(&self) -> PublicKey {
        self.signer.identity().public()
    }

    /// Says hello until the shepherd answers with its manifest.
    async fn join(&mut self, tally: &Mutex<Tally>, cancel: &CancellationToken) -> anyhow::Result<Option<RunManifest>> {
        let hello = NodeHello {
            peer: self.me().0,
            protocol_version: wire::PROTOCOL_VERSION,
            agent: "pcp-node loadtest".into(),
            capabilities: Capabilities {
                backends: vec![Backend { name: "cpu".into(), targets: vec![String::new()] }],
                free_memory_bytes: 0,
            },
            certificate: Vec::new(),
            pow_nonce: 0,
        };
        loop {
            let envelope = self.signer.seal(RunId([0; 32]), 0, &hello);
            match self.node.request(self.shepherd, envelope).await {
                Ok(answer) if answer.kind() == MessageKind::RunManifest => return Ok(Some(answer.decode()?)),
                Ok(answer) => {
                    let reason = answer.decode::<Ack>().map(|a| a.reason).unwrap_or_default();
                    *tally.lock().await.refused_hello.entry(reason).or_default() += 1;
                }
                Err(e) => tracing::debug!("synthetic worker {}: hello: {e}", self.index),
            }
            tokio::select! {
                () = cancel.cancelled() => return Ok(None),
                () = tokio::time::sleep(Duration::from_secs(1)) => {}
            }
        }
    }

    /// A stranger: a heartbeat (for the zero run, whose refusal names the run, then
    /// for the run) and a contribution, without a hello; records the answers.
    async fn stranger(&mut self, tally: &Mutex<Tally>) -> anyhow::Result<()> {
        let mut run = RunId([0; 32]);
        let mut refusal = String::new();
        for _ in 0..2 {
            let hb = Heartbeat {
                run: run.0,
                round: 0,
                unix_ms: wire::unix_ms(),
                free_memory_bytes: 0,
                term: 0,
                follows: 0,
                held: None,
                consensus: None,
            };
            // the connection may still be opening: a few tries
            let mut answer = None;
            for _ in 0..20 {
                let envelope = self.signer.seal(run, 0, &hb);
                match self.node.request(self.shepherd, envelope).await {
                    Ok(a) => {
                        answer = Some(a);
                        break;
                    }
                    Err(_) => tokio::time::sleep(Duration::from_millis(500)).await,
                }
            }
            let ack: Ack = answer.context("the shepherd never answered a heartbeat")?.decode()?;
            (run, refusal) = (RunId(ack.run), ack.reason);
        }
        *tally.lock().await.refused_heartbeat.entry(refusal).or_default() += 1;
        let contribution = contribution(run, 1, (1, 1), vec![0u8; 1024], (1, [0; 32]), 0);
        let envelope = self.signer.seal(run, 1, &contribution);
        let reason = match self.node.request(self.shepherd, envelope).await {
            Ok(answer) => answer.decode::<Ack>().map(|a| a.reason).unwrap_or_else(|e| e.to_string()),
            Err(e) => e.to_string(),
        };
        *tally.lock().await.refused_contribution.entry(reason).or_default() += 1;
        Ok(())
    }

    async fn run(mut self, tally: Arc<Mutex<Tally>>, cancel: CancellationToken) -> anyhow::Result<()> {
        if self.args.skip_hello {
            return self.stranger(&tally).await;
        }
        let Some(manifest) = self.join(&tally, &cancel).await? else { return Ok(()) };
        tally.lock().await.joined += 1;
        let run = RunId(manifest.run);
        let sizes = wire::sizes(&manifest);
        let encoding = Encoding::parse_spec(&manifest.encoding).map_err(|e| anyhow::anyhow!("{e}"))?;
        let mut feedback = encoding.sparse().map(|s| ErrorFeedback::new(&sizes, s.decay(), s.up));
        let tokens = u64::from(manifest.data.batch) * u64::from(manifest.data.block);
        let tau = u64::from(manifest.inner_steps);
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(self.args.seed ^ (self.index as u64) << 20);
        let (mut done, mut term) = (0u64, 0u64);
        let mut tick = tokio::time::interval(Duration::from_millis(500));
        loop {
            tokio::select! {
                () = cancel.cancelled() => return Ok(()),
                _ = tick.tick() => {}
            }
            let hb = Heartbeat {
                run: run.0,
                round: done,
                unix_ms: wire::unix_ms(),
                free_memory_bytes: 0,
                term: 0,
                follows: term,
                held: None,
                consensus: None,
            };
            let envelope = self.signer.seal(run, done, &hb);
            let Ok(answer) = self.node.request(self.shepherd, envelope).await else { continue };
            if answer.kind() != MessageKind::RoundAnnouncement {
                continue;
            }
            let a: RoundAnnouncement = answer.decode()?;
            term = term.max(a.term);
            let last = if self.args.rounds > 0 { self.args.rounds } else { u64::MAX };
            if a.finished || done >= last {
                return Ok(());
            }
            if a.round <= done || !a.participants.contains(&self.me().0) {
                continue;
            }
            done = a.round;
            tokio::select! {
                () = cancel.cancelled() => return Ok(()),
                () = tokio::time::sleep(Duration::from_millis(self.args.step_ms.saturating_mul(tau))) => {}
            }
            let delta = random_delta(&sizes, self.args.norm, &mut rng);
            let bytes = match feedback.as_mut() {
                Some(ef) => ef.compress_seeded(&delta, 1.0, a.round).0,
                None => compress::encode(&delta, encoding),
            };
            let params = a.parameters.first().map(|p| p.blob).unwrap_or_default();
            let steps = (tau, tau * tokens);
            let contribution = contribution(run, a.round, steps, bytes, (a.term, params), self.args.step_ms * tau);
            let envelope = self.signer.seal(run, a.round, &contribution);
            let outcome = self.node.request(self.shepherd, envelope).await;
            let mut tally = tally.lock().await;
            let row = tally.rounds.entry(a.round).or_insert_with(|| RoundRow { round: a.round, ..RoundRow::default() });
            row.sent += 1;
            match outcome.map_err(|e| e.to_string()).and_then(|v| v.decode::<Ack>().map_err(|e| e.to_string())) {
                Ok(ack) if ack.accepted => row.accepted += 1,
                Ok(ack) => *row.refused.entry(reason_kind(&ack.reason)).or_default() += 1,
                Err(e) => *row.refused.entry(reason_kind(&e)).or_default() += 1,
            }
        }
    }
}

/// A contribution to `round` of `(steps, samples)`, carrying `delta`, trained from
/// the announcement of `(term, params hash)` in `train_ms`.
fn contribution(
    run: RunId,
    round: u64,
    (steps, samples): (u64, u64),
    delta: Vec<u8>,
    (term, params_hash): (u64, [u8; 32]),
    train_ms: u64,
) -> Contribution {
    Contribution {
        run: run.0,
        round,
        inner_steps: steps as u32,
        samples,
        pseudo_gradient: ParameterRef {
            name: "delta".into(),
            shard: 0,
            blob: *blake3::hash(&delta).as_bytes(),
            size: delta.len() as u64,
        },
        loss: 3.0,
        delta,
        bytes_down: 0,
        term,
        params_hash,
        train_ms,
        wall_ms: train_ms,
        sent_unix_ms: wire::unix_ms(),
    }
}

/// Random values at L2 norm `norm`.
fn random_delta(sizes: &[usize], norm: f64, rng: &mut rand_chacha::ChaCha8Rng) -> Tensors {
    let mut t: Tensors = sizes.iter().map(|n| (0..*n).map(|_| rng.gen_range(-1.0f32..1.0)).collect()).collect();
    let drawn = t.iter().flatten().map(|v| f64::from(*v).powi(2)).sum::<f64>().sqrt().max(f64::MIN_POSITIVE);
    let k = (norm / drawn) as f32;
    t.iter_mut().flatten().for_each(|v| *v *= k);
    t
}
