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
//! with `--json`. In a round whose announcement names aggregators a synthetic worker
//! commits to its slices and sends them to the shards' aggregators, as a worker does;
//! `--aggregate` makes the synthetic nodes volunteers that sum shards and train
//! nothing ([`aggregate`]).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use pcp_bootstrap::{BlobStore, Config, Event, EventLoop, Multiaddr, Node, PeerId};
use pcp_protocol::diloco::Tensors;
use pcp_protocol::diloco::compress::{self, Encoding};
use pcp_protocol::diloco::liveness;
use pcp_protocol::{Identity, PublicKey, RunId, Verified};
use pcp_schema::{
    Ack, Backend, Capabilities, Contribution, Heartbeat, MessageKind, NodeHello, ParameterRef, RoundAnnouncement,
    RunManifest,
};
use rand::{Rng as _, SeedableRng as _};
use tokio::sync::{Mutex, mpsc};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::Failure;
use crate::diloco::wire::{self, Signer};

mod aggregate;
mod flood;
mod leave;
mod screen;

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
    /// The shepherd's process id, on this machine: its CPU time and resident memory
    /// are sampled and reported each round.
    #[arg(long, value_name = "PID")]
    shepherd_pid: Option<u32>,
    /// Distinct random pseudo-gradients made once and sent in turn (making one of
    /// gpt2-124m's takes a second; a worker's compute is a sleep). With twice
    /// `--workers`, no two contributions of a round, or of one round and one carried
    /// from the round before, are the same bytes; with fewer, the shepherd's copy
    /// check refuses the copies, and committees screen a contribution, named by its
    /// hash, once.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u64).range(1..=16_384))]
    payloads: u64,
    /// The synthetic nodes volunteer to aggregate (their hello's offer) and sum the
    /// shards the shepherd assigns them, as `pcp-node --aggregate` does; they train
    /// nothing. Each listens on an ephemeral 127.0.0.1 port and serves the DHT, so
    /// the workers find it.
    #[arg(long)]
    aggregate: bool,
    /// The synthetic workers sit on screening committees: each answers a screen
    /// request after this many milliseconds with losses that pass it, computing
    /// nothing (run the shepherd with `--screen-spot-rate 0`, or its spot checks
    /// catch them).
    #[arg(long, value_name = "MS")]
    screen_ms: Option<u64>,
    #[command(flatten)]
    flood: flood::FloodArgs,
    #[command(flatten)]
    leave: leave::LeaveArgs,
}

/// One round's outcome across the synthetic workers.
#[derive(Debug, Default, Clone, serde::Serialize)]
struct RoundRow {
    round: u64,
    /// Contributions sent to this round.
    sent: u64,
    /// Sent while the round was open (before any worker heard of the next one).
    on_time: u64,
    /// Aggregated: answered accepted.
    accepted: u64,
    /// Answered refused, by the reason's kind.
    refused: BTreeMap<String, u64>,
    /// Not answered (a timeout or a broken connection).
    dropped: u64,
    /// Contribution bytes sent (the encoded pseudo-gradients).
    bytes_up: u64,
    /// Aggregated rounds: slices sent to the aggregators, and taken by them.
    slices_sent: u64,
    slices_taken: u64,
    /// Screen requests of this round answered (`--screen-ms`).
    screens: u64,
    /// Seconds from the first worker hearing of this round to the first hearing of
    /// the next.
    seconds: Option<f64>,
    /// The shepherd's CPU seconds (user + system) in that time (`--shepherd-pid`).
    shepherd_cpu_s: Option<f64>,
    /// Its largest resident set in that time, bytes.
    shepherd_rss: Option<u64>,
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
    /// When a synthetic worker first heard of each round.
    opened: BTreeMap<u64, Instant>,
    /// Heartbeats answered with the whole announcement, and with a small heartbeat
    /// saying the one held is current; the answers' payload bytes.
    announcements: u64,
    current: u64,
    answer_bytes: u64,
    /// Workers in their modelled compute now, and contributions sent and not yet
    /// answered: the progress line's figures.
    training: u64,
    in_flight: u64,
    /// Heartbeats that found no answer within [`ASK_TIMEOUT`].
    unanswered: u64,
    /// Rounds whose announcement named a participants blob.
    participant_blobs: std::collections::BTreeSet<u64>,
}

impl Tally {
    /// One line of progress: who has joined, trains, waits for an answer.
    fn progress(&self) -> String {
        let answered: u64 = self.rounds.values().map(|r| r.sent).sum();
        let round = self.opened.keys().next_back().copied().unwrap_or(0);
        format!(
            "loadtest: {} joined; round {round} heard of; {} training, {} contributions in flight, {answered} answered; {} heartbeats unanswered",
            self.joined, self.training, self.in_flight, self.unanswered
        )
    }
}

/// The reason's kind: its text up to the first colon or digit (so counts group).
fn reason_kind(reason: &str) -> String {
    let cut = reason.find(|c: char| c == ':' || c.is_ascii_digit()).unwrap_or(reason.len());
    reason[..cut].trim().to_owned()
}

pub(crate) async fn run(args: LoadtestArgs, data_dir: PathBuf) -> Result<(), Failure> {
    if let Some(run) = args.flood.flood {
        let how = (args.workers, args.seed, Duration::from_secs(args.timeout_s));
        return flood::run(run, &args.shepherd, &args.flood, how, &data_dir).await;
    }
    let Some(shepherd) = args.shepherd.iter().find_map(|p| match p {
        pcp_bootstrap::multiaddr::Protocol::P2p(peer) => Some(peer),
        _ => None,
    }) else {
        return Err(Failure::input(anyhow::anyhow!("--shepherd {} has no /p2p/<peer id>", args.shepherd)));
    };
    if args.leave.leave_after_hello {
        let how = (args.workers, args.seed, Duration::from_secs(args.timeout_s));
        return leave::run((&args.shepherd, shepherd), &args.leave, how, &data_dir, args.json.as_deref()).await;
    }
    let tally = Arc::new(Mutex::new(Tally::default()));
    let payloads = Arc::new(tokio::sync::OnceCell::new());
    let mut peers = Vec::new();
    let cancel = CancellationToken::new();
    let mut tasks = JoinSet::new();
    // the swarms apart: one ends when its worker is done and drops its handle, and
    // only the workers are counted
    let mut loops = JoinSet::new();
    // the shepherd's process, when given: sampled, and watched so that a shepherd that
    // dies (a full disk, a crash) ends the loadtest at once rather than at --timeout-s
    let gone = CancellationToken::new();
    let sampler = args.shepherd_pid.map(|pid| tokio::spawn(sample(pid, cancel.child_token(), gone.clone())));
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(args.seed);
    let slicer = Arc::new(aggregate::Slicer::open(&data_dir.join("synthetic-slices")).map_err(Failure::input)?);
    for i in 0..args.workers {
        let identity = Identity::from_secret(rng.r#gen());
        let dir = data_dir.join(format!("synthetic-{i}"));
        let mut config = dial_only(vec![args.shepherd.clone()], dir.clone());
        if args.aggregate {
            // the workers of the run dial it with their slices
            config.listen = vec!["/ip4/127.0.0.1/tcp/0".parse().expect("a valid multiaddr")];
            config.dht_server = true;
            config.max_connections = crate::commands::join::COORDINATOR_MAX_CONNECTIONS;
        }
        peers.push(pcp_bootstrap::keypair(&identity).public().to_peer_id().to_string());
        let (node, events, event_loop): (Node, _, EventLoop) =
            Node::new(&identity, config).map_err(|e| Failure::input(anyhow::anyhow!("synthetic worker {i}: {e}")))?;
        let store = BlobStore::open(&dir).map_err(|e| Failure::input(anyhow::anyhow!("synthetic worker {i}: {e}")))?;
        let task_cancel = cancel.child_token();
        loops.spawn(event_loop.run(task_cancel.clone()));
        let worker = Synthetic {
            node,
            signer: Signer::new(identity),
            shepherd,
            args: args.clone(),
            index: i,
            payloads: payloads.clone(),
            events: (args.aggregate || args.screen_ms.is_some()).then_some(events),
            slicer: slicer.clone(),
            store,
            dir,
        };
        let tally = tally.clone();
        tasks.spawn(async move {
            if let Err(e) = worker.run(tally, task_cancel).await {
                tracing::warn!("synthetic worker {i}: {e:#}");
            }
        });
        if i % 32 == 31 {
            // the shepherd handshakes a few dozen connections at a time
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    tally.lock().await.peers = peers;
    let deadline = tokio::time::sleep(Duration::from_secs(args.timeout_s));
    tokio::pin!(deadline);
    let mut left = args.workers;
    let mut progress = tokio::time::interval(PROGRESS_EVERY);
    loop {
        tokio::select! {
            () = &mut deadline => break,
            () = gone.cancelled() => break,
            _ = progress.tick() => tracing::info!("{}", tally.lock().await.progress()),
            _ = tokio::signal::ctrl_c() => break,
            done = tasks.join_next() => match done {
                None => break,
                // a worker ends when its run is over
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
    let samples = match sampler {
        Some(task) => task.await.unwrap_or_default(),
        None => Vec::new(),
    };
    tasks.shutdown().await;
    loops.shutdown().await;
    let mut tally = tally.lock().await;
    tally.measure(&samples);
    report(&tally, args.json.as_deref())?;
    // a shepherd that exits after its run ended (its farewell) leaves the workers that
    // had not heard of the end yet to time out: not a failure
    match args.shepherd_pid {
        Some(pid) if gone.is_cancelled() && left == args.workers => Err(Failure::from(anyhow::anyhow!(
            "the shepherd (pid {pid}) exited before any of the {} synthetic workers saw its run end; {}",
            args.workers,
            tally.progress()
        ))),
        _ => Ok(()),
    }
}

/// A synthetic node's swarm, under `dir`: it only dials `peers` (no listener, no
/// QUIC endpoint of its own, no relay reservation or service, no hole punching).
fn dial_only(peers: Vec<Multiaddr>, dir: PathBuf) -> Config {
    Config {
        bootstrap: peers,
        listen: Vec::new(),
        nat: pcp_bootstrap::NatConfig {
            auto_relay: false,
            relay_service: false,
            hole_punching: false,
            ..pcp_bootstrap::NatConfig::default()
        },
        ..Config::new(dir)
    }
}

/// One reading of the shepherd's process: when, its CPU seconds, its resident bytes.
type Sample = (Instant, f64, u64);

/// Reads `/proc/<pid>` four times a second until cancelled; cancels `gone` once the
/// process has exited (no longer there, or a zombie with no memory) in two readings
/// running.
async fn sample(pid: u32, cancel: CancellationToken, gone: CancellationToken) -> Vec<Sample> {
    let mut samples = Vec::new();
    let mut tick = tokio::time::interval(Duration::from_millis(250));
    let mut missed = 0;
    loop {
        tokio::select! {
            () = cancel.cancelled() => return samples,
            _ = tick.tick() => {}
        }
        match read_proc(pid) {
            Some(s) => {
                missed = 0;
                samples.push(s);
            }
            None => {
                missed += 1;
                if missed >= 2 {
                    gone.cancel();
                    return samples;
                }
            }
        }
    }
}

/// The CPU seconds (user + system) and resident bytes of process `pid` now.
fn read_proc(pid: u32) -> Option<Sample> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // after the command's closing parenthesis: state is field 3, utime 14, stime 15
    let fields: Vec<&str> = stat.get(stat.rfind(')')? + 2..)?.split_whitespace().collect();
    let ticks: u64 = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let rss_kb: u64 = status.lines().find(|l| l.starts_with("VmRSS:"))?.split_whitespace().nth(1)?.parse().ok()?;
    // USER_HZ is 100 on Linux
    Some((Instant::now(), ticks as f64 / 100.0, rss_kb << 10))
}

impl Tally {
    /// Each round's duration, and the shepherd's CPU and peak memory in it.
    fn measure(&mut self, samples: &[Sample]) {
        let opened: Vec<(u64, Instant)> = self.opened.iter().map(|(r, t)| (*r, *t)).collect();
        for pair in opened.windows(2) {
            let ((round, start), (_, end)) = (pair[0], pair[1]);
            let Some(row) = self.rounds.get_mut(&round) else { continue };
            row.seconds = Some(end.duration_since(start).as_secs_f64());
            let within: Vec<&Sample> = samples.iter().filter(|(t, ..)| *t >= start && *t <= end).collect();
            if let (Some(first), Some(last)) = (within.first(), within.last()) {
                row.shepherd_cpu_s = Some(last.1 - first.1);
                row.shepherd_rss = within.iter().map(|s| s.2).max();
            }
        }
    }
}

fn report(tally: &Tally, json: Option<&std::path::Path>) -> Result<(), Failure> {
    use std::io::Write as _;
    let mut out = std::io::stdout().lock();
    let write = |e: std::io::Error| Failure::from(anyhow::anyhow!("writing the report: {e}"));
    writeln!(out, "joined: {}; hellos refused: {:?}", tally.joined, tally.refused_hello).map_err(write)?;
    writeln!(
        out,
        "heartbeats answered: {} with the announcement, {} with \"current\" ({} bytes of answers)",
        tally.announcements, tally.current, tally.answer_bytes
    )
    .map_err(write)?;
    if !tally.participant_blobs.is_empty() {
        writeln!(out, "rounds whose participants came as a blob: {:?}", tally.participant_blobs).map_err(write)?;
    }
    if !tally.refused_heartbeat.is_empty() || !tally.refused_contribution.is_empty() {
        writeln!(
            out,
            "without a hello: heartbeats refused {:?}, contributions refused {:?}",
            tally.refused_heartbeat, tally.refused_contribution
        )
        .map_err(write)?;
    }
    writeln!(
        out,
        "{:>5} {:>6} {:>7} {:>9} {:>8} {:>9} {:>8} {:>12} {:>11}  refused",
        "round", "sent", "on time", "accepted", "dropped", "MB up", "seconds", "shepherd cpu", "shepherd MiB"
    )
    .map_err(write)?;
    let opt = |v: Option<f64>| v.map_or_else(|| "-".to_owned(), |v| format!("{v:.2}"));
    for row in tally.rounds.values() {
        writeln!(
            out,
            "{:>5} {:>6} {:>7} {:>9} {:>8} {:>9.1} {:>8} {:>12} {:>11}  {:?}",
            row.round,
            row.sent,
            row.on_time,
            row.accepted,
            row.dropped,
            row.bytes_up as f64 / 1e6,
            opt(row.seconds),
            opt(row.shepherd_cpu_s),
            row.shepherd_rss.map_or_else(|| "-".to_owned(), |b| format!("{}", b >> 20)),
            row.refused
        )
        .map_err(write)?;
    }
    for row in tally.rounds.values().filter(|r| r.slices_sent > 0) {
        writeln!(
            out,
            "round {}: {} slices sent to the aggregators, {} taken",
            row.round, row.slices_sent, row.slices_taken
        )
        .map_err(write)?;
    }
    for row in tally.rounds.values().filter(|r| r.screens > 0) {
        writeln!(out, "round {}: {} screen requests answered", row.round, row.screens).map_err(write)?;
    }
    if let Some(path) = json {
        let value = serde_json::json!({
            "joined": tally.joined,
            "refused_hello": tally.refused_hello,
            "refused_heartbeat": tally.refused_heartbeat,
            "refused_contribution": tally.refused_contribution,
            "peers": tally.peers,
            "heartbeat_answers": {
                "announcements": tally.announcements,
                "current": tally.current,
                "bytes": tally.answer_bytes,
            },
            "rounds": tally.rounds.values().collect::<Vec<_>>(),
            "participant_blobs": tally.participant_blobs,
        });
        std::fs::write(path, serde_json::to_vec_pretty(&value).map_err(|e| Failure::from(anyhow::anyhow!("{e}")))?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// How long a synthetic worker waits for the answer to a hello or a heartbeat.
const ASK_TIMEOUT: Duration = Duration::from_secs(5);
/// How often the loadtest prints its progress line (stderr).
const PROGRESS_EVERY: Duration = Duration::from_secs(10);

/// One synthetic worker.
struct Synthetic {
    node: Node,
    signer: Signer,
    shepherd: PeerId,
    args: LoadtestArgs,
    index: usize,
    /// The run's pseudo-gradients, encoded: made once by the first worker to join.
    payloads: Arc<tokio::sync::OnceCell<Vec<Vec<u8>>>>,
    /// `--aggregate`: the node's events, whose requests go to its aggregator.
    events: Option<mpsc::Receiver<Event>>,
    /// Aggregated rounds: the slices cut, shared by the synthetic workers.
    slicer: Arc<aggregate::Slicer>,
    /// The node's blob store, which serves its slices.
    store: BlobStore,
    /// Its data directory.
    dir: PathBuf,
}

impl Synthetic {
    fn me(&self) -> PublicKey {
        self.signer.identity().public()
    }

    /// A hello or heartbeat to the shepherd, given up after [`ASK_TIMEOUT`] as a
    /// worker's are (a lost answer must not stall it past the heartbeat timeout).
    async fn ask(&self, envelope: pcp_schema::SignedEnvelope) -> anyhow::Result<Verified> {
        match tokio::time::timeout(ASK_TIMEOUT, self.node.request(self.shepherd, envelope)).await {
            Ok(answer) => Ok(answer?),
            Err(_) => anyhow::bail!("no answer in {ASK_TIMEOUT:?}"),
        }
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
                aggregate: self.args.aggregate,
            },
            certificate: Vec::new(),
            pow_nonce: 0,
        };
        loop {
            let envelope = self.signer.seal(RunId([0; 32]), 0, &hello);
            match self.ask(envelope).await {
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
            let hb = Heartbeat::new(run.0, 0, wire::unix_ms());
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
        let layout = sizes.clone();
        let (standalone, mut requests) = self.aggregator(run, (&layout, encoding), &cancel)?;
        let mut served = aggregate::Served::default();
        let (count, norm, seed) = (self.args.payloads as usize, self.args.norm, self.args.seed);
        let made = self.payloads.clone();
        let payloads = made
            .get_or_try_init(|| async move {
                tokio::task::spawn_blocking(move || make_payloads(&sizes, encoding, norm, seed, count)).await
            })
            .await?;
        let tokens = u64::from(manifest.data.batch) * u64::from(manifest.data.block);
        let tau = u64::from(manifest.inner_steps);
        let (mut done, mut term, mut known) = (0u64, 0u64, None);
        let mut participants: crate::diloco::participants::Cached = None;
        let mut tick = tokio::time::interval(Duration::from_millis(liveness::HEARTBEAT_MS));
        // heartbeats slow down in a large run, as a worker's do
        let (mut period, mut asked) = (Duration::from_millis(liveness::HEARTBEAT_MS), None::<Instant>);
        // a round trained (its modelled compute: a sleep), then its contribution on its
        // way; heartbeats go on meanwhile, as a worker's do
        let mut training: Option<(std::pin::Pin<Box<tokio::time::Sleep>>, RoundAnnouncement)> = None;
        let mut sending: JoinSet<Sent> = JoinSet::new();
        // one contribution on its way at a time, as a worker's (the shepherd refuses a second)
        let mut queued: std::collections::VecDeque<RoundAnnouncement> = std::collections::VecDeque::new();
        let shape = Shape { run, sizes: &layout, encoding, steps: (tau, tau * tokens) };
        loop {
            tokio::select! {
                () = cancel.cancelled() => return Ok(()),
                _ = tick.tick() => {}
                Some(request) = async { match requests.as_mut() { Some(rx) => rx.recv().await, None => None } } => {
                    match &standalone {
                        Some(aggregator) => aggregator.request(request),
                        None => self.screen(run, request, &tally).await,
                    }
                    continue;
                }
                () = async { training.as_mut().expect("guarded").0.as_mut().await }, if training.is_some() => {
                    let (_, a) = training.take().expect("guarded");
                    tally.lock().await.training -= 1;
                    if sending.is_empty() {
                        self.send(&a, (payloads, shape), (&tally, &mut served), &mut sending).await?;
                    } else {
                        queued.push_back(a);
                    }
                    continue;
                }
                Some(Ok(sent)) = sending.join_next() => {
                    record(&tally, sent, self.index).await;
                    if let Some(a) = queued.pop_front() {
                        self.send(&a, (payloads, shape), (&tally, &mut served), &mut sending).await?;
                    }
                    // its last round answered: done, whether or not it hears the run end
                    // (a shepherd whose run is over may stop before it says so)
                    let idle = sending.is_empty() && training.is_none();
                    if self.args.rounds > 0 && done >= self.args.rounds && idle {
                        return Ok(());
                    }
                    continue;
                }
            }
            if asked.is_some_and(|at| at.elapsed() + period / 4 < period) {
                continue;
            }
            asked = Some(Instant::now());
            let hb = Heartbeat { follows: term, known, ..Heartbeat::new(run.0, done, wire::unix_ms()) };
            let envelope = self.signer.seal(run, done, &hb);
            let Ok(answer) = self.ask(envelope).await else {
                tally.lock().await.unanswered += 1;
                continue;
            };
            tally.lock().await.heard(&answer);
            if answer.kind() != MessageKind::RoundAnnouncement {
                continue; // the announcement held is current (or a refusal)
            }
            let mut a: RoundAnnouncement = answer.decode()?;
            // past the shepherd's inline threshold the participants are a blob
            if a.participants_blob.is_some() {
                tally.lock().await.participant_blobs.insert(a.round);
            }
            let resolved = crate::diloco::participants::resolve(&self.node, &mut a, self.shepherd, &mut participants);
            if let Err(e) = resolved.await {
                tracing::debug!("synthetic worker {}: {e:#}", self.index);
                continue; // asked again at the next heartbeat
            }
            known = Some(answer.payload_hash());
            term = term.max(a.term);
            period = Duration::from_millis(liveness::interval_ms(a.participants.len(), manifest.lease_ms.max(500)));
            tally.lock().await.opened.entry(a.round).or_insert_with(Instant::now);
            if let Some(aggregator) = &standalone {
                // it sums what it is assigned, and trains nothing
                let over = self.args.rounds > 0 && a.round > self.args.rounds + 1;
                if a.finished || over {
                    return Ok(());
                }
                aggregator.announced(a);
                continue;
            }
            let last = if self.args.rounds > 0 { self.args.rounds } else { u64::MAX };
            if a.finished || (done >= last && sending.is_empty() && training.is_none()) {
                // the answers on their way are recorded first; one queued behind them is moot
                while let Some(Ok(sent)) = sending.join_next().await {
                    record(&tally, sent, self.index).await;
                }
                return Ok(());
            }
            if a.round <= done || done >= last || !a.participants.contains(&self.me().0) {
                continue;
            }
            done = a.round;
            let compute = Duration::from_millis(self.args.step_ms.saturating_mul(tau));
            training = Some((Box::pin(tokio::time::sleep(compute)), a));
            tally.lock().await.training += 1;
        }
    }
}

/// A contribution sent: its round, whether its round was still open, its bytes, its
/// slices (an aggregated round's) sent and taken, and the shepherd's answer.
struct Sent {
    round: u64,
    on_time: bool,
    size: u64,
    slices: (u64, u64),
    answer: Result<Verified, String>,
}

/// Whether `answer` is an ack that accepted.
fn accepted(answer: &Result<Verified, String>) -> bool {
    answer.as_ref().ok().and_then(|v| v.decode::<Ack>().ok()).is_some_and(|ack| ack.accepted)
}

impl Synthetic {
    /// An aggregate-only node's driver (`--aggregate`), and the node's events, whose
    /// requests go to it (or, for a screener, to [`Self::screen`]).
    fn aggregator(
        &mut self,
        run: RunId,
        (sizes, encoding): (&[usize], Encoding),
        cancel: &CancellationToken,
    ) -> anyhow::Result<(Option<crate::diloco::Standalone>, Option<mpsc::Receiver<Event>>)> {
        let Some(events) = self.events.take() else { return Ok((None, None)) };
        if !self.args.aggregate {
            // a screener (`--screen-ms`): it reads the shepherd's screen requests
            screen::enlist(&self.node, self.shepherd, run, (sizes, encoding))?;
            return Ok((None, Some(events)));
        }
        let key = pcp_bootstrap::key_of(&self.shepherd).context("the shepherd's peer id names no key")?;
        let node = (self.node.clone(), self.signer.identity().clone());
        let (store, leader) = (self.store.clone(), (self.shepherd, key));
        let cancel = cancel.child_token();
        let spill = self.dir.join("aggregator-spill");
        let driver =
            crate::diloco::Standalone::spawn(node, run, (sizes.to_vec(), encoding), (store, leader), spill, cancel);
        Ok((Some(driver), Some(events)))
    }
}

/// What a synthetic worker's contribution is made of: its run, the model's tensor
/// sizes and encoding, and the steps and samples it claims.
#[derive(Clone, Copy)]
struct Shape<'a> {
    run: RunId,
    sizes: &'a [usize],
    encoding: Encoding,
    steps: (u64, u64),
}

impl Synthetic {
    /// Round `a` trained: its contribution on its way in `sending` (an aggregated
    /// round's commitment, then its slices once the shepherd takes it), made of one
    /// of `payloads`.
    async fn send(
        &mut self,
        a: &RoundAnnouncement,
        (payloads, shape): (&[Vec<u8>], Shape<'_>),
        (tally, served): (&Mutex<Tally>, &mut aggregate::Served),
        sending: &mut JoinSet<Sent>,
    ) -> anyhow::Result<()> {
        // with 2 × --workers payloads, worker i sends payload i in even rounds and
        // i + workers in odd ones, so no two contributions of a round, or of one round
        // and one carried from the round before, are the same bytes; with fewer, the
        // workers take them in turn, a round further each round
        let round = a.round as usize;
        let offset = if payloads.len() >= 2 * self.args.workers { (round % 2) * self.args.workers } else { round };
        let payload = (self.index + offset) % payloads.len();
        let mut bytes = payloads[payload].clone();
        if shape.encoding.sparse().is_some() && !pcp_protocol::diloco::sparse::reseed(&mut bytes, a.round) {
            anyhow::bail!("the run's sparse layout is strided: its messages cannot be made ahead");
        }
        let (run, me) = (shape.run, self.me());
        let params = a.parameters.first().map(|p| p.blob).unwrap_or_default();
        let size = bytes.len() as u64;
        let train_ms = self.args.step_ms * shape.steps.0;
        let mut c = contribution(run, a.round, shape.steps, bytes, (a.term, params), train_ms);
        let cut = match a.aggregators.is_empty() {
            true => None,
            false => {
                let cut = self.slicer.cut(&mut c, (a, payload), (shape.sizes, shape.encoding), me, &self.store)?;
                served.add(&self.store, a.round, c.slice_hashes.clone());
                Some(cut)
            }
        };
        let envelope = self.signer.seal(run, a.round, &c);
        drop(c);
        let on_time = {
            let mut tally = tally.lock().await;
            tally.in_flight += 1;
            !tally.opened.contains_key(&(a.round + 1))
        };
        let (node, shepherd, round) = (self.node.clone(), self.shepherd, a.round);
        let mut signer = cut.is_some().then(|| Signer::new(self.signer.identity().clone()));
        let slicer = self.slicer.clone();
        sending.spawn(async move {
            let answer = node.request(shepherd, envelope).await.map_err(|e| e.to_string());
            // an aggregated round's slices go once the shepherd holds their commitment
            let slices = match (signer.as_mut(), cut) {
                (Some(signer), Some(cut)) if accepted(&answer) => {
                    let _turn = slicer.turn().await;
                    let slices = cut.slices(me);
                    let taken = crate::diloco::send_slices((&node, None), signer, run, &slices).await;
                    (slices.len() as u64, taken as u64)
                }
                _ => (0, 0),
            };
            Sent { round, on_time, size, slices, answer }
        });
        Ok(())
    }
}

impl Synthetic {
    /// Answers `request` if it is a screen request and this worker screens
    /// (`--screen-ms`), counted by its round.
    async fn screen(&mut self, run: RunId, request: Event, tally: &Mutex<Tally>) {
        let Some(ms) = self.args.screen_ms else { return };
        let round = match &request {
            Event::Request { message, .. } => message.binding().round,
            _ => 0,
        };
        if screen::answer(&self.node, &mut self.signer, run, request, Duration::from_millis(ms)) {
            let mut tally = tally.lock().await;
            tally.rounds.entry(round).or_insert_with(|| RoundRow { round, ..RoundRow::default() }).screens += 1;
        }
    }
}

impl Tally {
    /// Counts a heartbeat's answer: the announcement, or "current".
    fn heard(&mut self, answer: &Verified) {
        self.answer_bytes += answer.payload_len() as u64;
        match answer.kind() {
            MessageKind::RoundAnnouncement => self.announcements += 1,
            MessageKind::Heartbeat => self.current += 1,
            _ => {}
        }
    }
}

/// Records a contribution's answer.
async fn record(tally: &Mutex<Tally>, sent: Sent, index: usize) {
    let Sent { round, on_time, size, slices, answer: outcome } = sent;
    let mut tally = tally.lock().await;
    tally.in_flight -= 1;
    let row = tally.rounds.entry(round).or_insert_with(|| RoundRow { round, ..RoundRow::default() });
    row.sent += 1;
    row.on_time += u64::from(on_time);
    row.bytes_up += size;
    row.slices_sent += slices.0;
    row.slices_taken += slices.1;
    match outcome {
        Ok(v) => match v.decode::<Ack>() {
            Ok(ack) if ack.accepted => row.accepted += 1,
            Ok(ack) => *row.refused.entry(reason_kind(&ack.reason)).or_default() += 1,
            Err(e) => *row.refused.entry(reason_kind(&e.to_string())).or_default() += 1,
        },
        Err(e) => {
            row.dropped += 1;
            tracing::debug!("synthetic worker {index}: contribution to round {round}: {e}");
        }
    }
}

/// `count` random pseudo-gradients of `sizes` at L2 norm `norm`, encoded.
fn make_payloads(sizes: &[usize], encoding: Encoding, norm: f64, seed: u64, count: usize) -> Vec<Vec<u8>> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed ^ 0x9a71_0ad5);
    (0..count).map(|_| compress::encode(&random_delta(sizes, norm, &mut rng), encoding)).collect()
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
        slice_hashes: Vec::new(),
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
