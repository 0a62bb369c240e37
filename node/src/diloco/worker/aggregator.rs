//! A volunteer's aggregator (`--aggregate`): the shards an announcement assigns
//! this node, summed by [`pcp_protocol::diloco::aggregator::Aggregator`]. Its
//! driver takes the workers' slices and the shepherd's accepts (requests to
//! this node), forwards slices to the other replicas, reports each slice to the
//! shepherd, fetches accepted slices it lacks from their workers, and at the
//! close stores each shard's mean as a blob and signs its hash for the shepherd.
//! It serves the slices it took as blobs for [`SERVED_ROUNDS`] rounds: a
//! screening committee's members fetch them here, not over their workers'
//! uplinks.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use pcp_bootstrap::{BlobStore, Event, InboundId, Node, PeerId};
use pcp_protocol::diloco::aggregate::Bounds;
use pcp_protocol::diloco::aggregation::{Accept, ShardUpdate, SumError, shard_tensors, update_hash};
use pcp_protocol::diloco::aggregator::{Action, Aggregator, Input, Place, ShardSpec};
use pcp_protocol::diloco::compress::{self, Encoding};
use pcp_protocol::{BlobHash, PublicKey, RunId, Verified};
use pcp_schema::{
    Accepts, Ack, AckCode, MessageKind, ParameterRef, RoundAnnouncement, ShardFailure, ShardVote, Slice,
    SliceReportEntry, SliceReports,
};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::Leader;
use super::heartbeats::Latest;
use crate::diloco::wire::{Signer, peer_name};
use crate::observe::events::{self as ev, Events};

/// Slices held a shard at most: the largest round's participants.
const MAX_SLICES: usize = 16_384;
/// How long after a round's close an aggregator waits for accepted slices it
/// fetches before it gives the shard up (the shepherd then sums it).
const GIVE_UP: Duration = Duration::from_secs(15);
/// A request to another node gives up after this long.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// Rounds whose slices an aggregator serves: the newest it heard of and the two
/// before (a contribution carried into the next round is screened in it).
const SERVED_ROUNDS: u64 = 3;
/// The bytes of slices not yet accepted an aggregator holds in memory by default
/// (`--aggregate-memory`); the rest wait on disk ([`Action::Spill`]).
pub(crate) const DEFAULT_MEMORY: u64 = 1 << 30;

/// Slices an aggregator keeps as blobs to serve, with their rounds: written on
/// blocking threads, released by its driver.
pub(super) type Served = std::sync::Arc<std::sync::Mutex<Vec<(u64, BlobHash)>>>;

/// What the aggregator needs of the run and the node.
pub(super) struct AggregatorTask {
    pub(super) node: Node,
    pub(super) signer: Signer,
    pub(super) run: RunId,
    pub(super) me: PublicKey,
    /// Testing only: a hostile aggregator's attack (`agg-alter`, `agg-drop`, `agg-stall`,
    /// `agg-misreport`, `agg-mute`).
    pub(super) hostile: Option<super::Attack>,
    pub(super) sizes: Vec<usize>,
    pub(super) encoding: Encoding,
    pub(super) store: BlobStore,
    /// Slices kept as blobs to serve, with their rounds ([`AggregatorTask::serve`]).
    pub(super) served: Served,
    /// Where slices past the memory budget wait, and the budget in bytes.
    pub(super) spill: (PathBuf, usize),
    pub(super) events: Events,
    pub(super) leader: watch::Receiver<Leader>,
    pub(super) latest: watch::Receiver<Latest>,
    pub(super) requests: mpsc::Receiver<Event>,
    /// This worker's own slices of the shards it sums.
    pub(super) own: Option<std::sync::Arc<tokio::sync::Mutex<mpsc::Receiver<Slice>>>>,
    pub(super) cancel: CancellationToken,
}

/// An aggregate-only node's aggregator (`pcp-node loadtest --aggregate`): the
/// driver a volunteer runs, fed by its owner's announcements and requests rather
/// than a worker's heartbeat task; it follows one leader and records no events.
pub(crate) struct Standalone {
    latest: watch::Sender<Latest>,
    requests: mpsc::Sender<Event>,
    node: Node,
    _task: super::heartbeats::AbortOnDrop,
}

impl Standalone {
    /// Starts the driver of `identity`'s node for `run`, whose tensors have `sizes`
    /// elements in `encoding`, following `leader`; its means go to `store`.
    pub(crate) fn spawn(
        (node, identity): (Node, pcp_protocol::Identity),
        run: RunId,
        (sizes, encoding): (Vec<usize>, Encoding),
        (store, leader): (BlobStore, (PeerId, PublicKey)),
        spill: PathBuf,
        cancel: CancellationToken,
    ) -> Self {
        let (latest_tx, latest) = watch::channel(Latest::Nothing);
        // the leader never changes: its receiver keeps the value once the sender is gone
        let (_, leader) = watch::channel(leader);
        let (tx, requests) = mpsc::channel(crate::diloco::inbox::CONTROL_QUEUE);
        let task = AggregatorTask {
            node: node.clone(),
            me: identity.public(),
            signer: Signer::new(identity),
            run,
            hostile: None,
            sizes,
            encoding,
            store,
            served: Served::default(),
            spill: (spill, usize::try_from(DEFAULT_MEMORY).unwrap_or(usize::MAX)),
            events: Events::default(),
            leader,
            latest,
            requests,
            own: None,
            cancel,
        };
        let task = super::heartbeats::AbortOnDrop(tokio::spawn(task.run()));
        Self { latest: latest_tx, requests: tx, node, _task: task }
    }

    /// The leader's latest announcement: the shards it assigns are summed here.
    pub(crate) fn announced(&self, a: RoundAnnouncement) {
        let _ = self.latest.send(Latest::Round(Box::new(a)));
    }

    /// A request to this node (a slice, the accepts); one the driver cannot take
    /// (its queue is full) is left unanswered at once.
    pub(crate) fn request(&self, request: Event) {
        let Event::Request { id, .. } = &request else { return };
        let id = *id;
        if self.requests.try_send(request).is_err() {
            self.node.leave_unanswered(id);
        }
    }
}

/// A fetched slice: its round, shard and worker, and its bytes or why not.
type Fetched = (u64, usize, [u8; 32], Result<Vec<u8>, String>);

/// The driver's state besides its task's inputs.
struct Driver {
    machine: Aggregator<[u8; 32]>,
    signer: Signer,
    /// Rounds assigned, with each assigned shard's replicas.
    rounds: BTreeMap<u64, BTreeMap<usize, Vec<[u8; 32]>>>,
    /// Each assigned shard's slice length, by round: a fetched slice is read only
    /// up to it.
    lengths: BTreeMap<(u64, usize), u64>,
    /// When each round's count came.
    closed: BTreeMap<u64, Instant>,
    fetches: JoinSet<Fetched>,
    sends: JoinSet<()>,
    /// The newest round this driver has heard of (assigned here or not).
    heard: u64,
    /// Slice reports not yet sent, by round, and the sends of those that were.
    reports: BTreeMap<u64, Vec<SliceReportEntry>>,
    reporting: JoinSet<()>,
    /// Slices spilled to disk ([`Action::Spill`]), by round.
    spilled: BTreeMap<u64, Vec<PathBuf>>,
}

/// Report sends in flight at once: reports that come meanwhile go together next.
const REPORTS_IN_FLIGHT: usize = 2;
/// The reports' bytes a message carries at most, reckoned as [`report_bytes`]:
/// half a small frame, the most the shepherd's admission reads of a request that
/// is not a contribution ([`pcp_bootstrap::admission::SMALL_FRAME`]), for the
/// encoding's own overhead.
const REPORTS_PER_MESSAGE: usize = pcp_bootstrap::admission::SMALL_FRAME / 2;

/// What a report takes in its message, at most: its shard, worker, hash and bounded
/// norm, each tensor's norm and largest magnitude, and their pointers.
fn report_bytes(r: &SliceReportEntry) -> usize {
    128 + 16 * r.norms.len().max(r.maxes.len())
}

impl AggregatorTask {
    /// Runs until cancelled or the worker's channels close.
    pub(super) async fn run(mut self) {
        let threads = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
        let mut d = Driver {
            machine: Aggregator::new(MAX_SLICES, threads).holding(self.spill.1),
            signer: Signer::new(self.signer.identity().clone()),
            rounds: BTreeMap::new(),
            lengths: BTreeMap::new(),
            closed: BTreeMap::new(),
            fetches: JoinSet::new(),
            sends: JoinSet::new(),
            heard: 0,
            reports: BTreeMap::new(),
            reporting: JoinSet::new(),
            spilled: BTreeMap::new(),
        };
        // what a run before this one left there is of no use
        let _ = std::fs::remove_dir_all(&self.spill.0);
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        let own = self.own.clone();
        let mut own = match &own {
            Some(o) => Some(o.lock().await),
            None => None,
        };
        loop {
            tokio::select! {
                Some(slice) = async { match own.as_mut() { Some(rx) => rx.recv().await, None => None } } => {
                    let (round, shard) = (slice.round, slice.shard as usize);
                    if d.rounds.get(&round).is_some_and(|r| r.contains_key(&shard)) {
                        // (this worker's own slice is in the store already, and served)
                        let input = Input::Slice { round, shard, worker: self.me.0, bytes: slice.bytes, forwarded: false };
                        let actions = d.machine.handle(input);
                        self.carry_out(&mut d, actions);
                    }
                }
                () = self.cancel.cancelled() => return,
                changed = self.latest.changed() => {
                    if changed.is_err() {
                        return;
                    }
                    let latest = self.latest.borrow_and_update().clone();
                    if let Latest::Round(a) = latest {
                        self.assigned(&mut d, &a);
                        d.heard = d.heard.max(a.round);
                        self.unserve(&mut d);
                    }
                }
                event = self.requests.recv() => match event {
                    Some(Event::Request { id, message, .. }) => self.on_request(&mut d, id, *message).await,
                    Some(_) => {}
                    None => return,
                },
                Some(Ok((round, shard, worker, bytes))) = d.fetches.join_next() => match bytes {
                    Ok(bytes) => {
                        // (a fetched slice is in the store, and served, already)
                        let actions = d.machine.handle(Input::Slice { round, shard, worker, bytes, forwarded: true });
                        self.carry_out(&mut d, actions);
                    }
                    Err(e) => tracing::warn!(round, shard, "fetching {}'s slice: {e}", peer_name(&PublicKey(worker))),
                },
                Some(_) = d.sends.join_next() => {}
                Some(_) = d.reporting.join_next() => self.flush_reports(&mut d, false),
                _ = tick.tick() => {
                    let late: Vec<u64> = d.closed.iter().filter(|(_, at)| at.elapsed() >= GIVE_UP).map(|(r, _)| *r).collect();
                    for round in late {
                        d.closed.remove(&round);
                        let actions = d.machine.handle(Input::GiveUp { round });
                        self.carry_out(&mut d, actions);
                    }
                }
            }
        }
    }

    /// An announcement that names this node among a shard's replicas.
    fn assigned(&self, d: &mut Driver, a: &RoundAnnouncement) {
        if a.aggregators.is_empty() || d.rounds.contains_key(&a.round) {
            return;
        }
        let Some(tensors) = shard_tensors(&self.sizes, a.aggregators.len()) else { return };
        let mut specs = Vec::new();
        let mut mine = BTreeMap::new();
        for (shard, (range, s)) in tensors.into_iter().zip(&a.aggregators).enumerate() {
            let Some(j) = s.replicas.iter().position(|k| *k == self.me.0) else { continue };
            let sizes = self.sizes[range.clone()].to_vec();
            d.lengths.insert((a.round, shard), compress::encoded_len(&sizes, self.encoding) as u64);
            let bounds = Bounds { tensor: s.tensor_bounds.clone(), element: s.element_bounds.clone() };
            mine.insert(shard, s.replicas.clone());
            specs.push(ShardSpec {
                shard,
                tensors: range,
                sizes,
                bounds,
                replicas: s.replicas.clone(),
                place: Place::Replica(j),
            });
        }
        if specs.is_empty() {
            return;
        }
        self.admit(a, &specs);
        tracing::info!(round = a.round, "summing shards {:?} of round {}", mine.keys().collect::<Vec<_>>(), a.round);
        d.rounds.insert(a.round, mine);
        let keep = a.round.saturating_sub(2);
        d.rounds.retain(|r, _| *r >= keep);
        d.lengths.retain(|(r, _), _| *r >= keep);
        d.closed.retain(|r, _| *r >= keep);
        d.machine.handle(Input::Assigned { round: a.round, encoding: self.encoding, shards: specs });
    }

    /// Tells the node's admission whose slices of round `a` to read, and how large:
    /// each participant one a shard summed here and a retry, and each shard's first
    /// replica, forwarding, one a participant.
    fn admit(&self, a: &RoundAnnouncement, specs: &[ShardSpec<[u8; 32]>]) {
        let mut senders: Vec<(PublicKey, usize)> =
            a.participants.iter().map(|p| (PublicKey(*p), 2 * specs.len())).collect();
        for spec in specs.iter().filter(|s| s.place != Place::Replica(0)) {
            if let Some(first) = spec.replicas.first() {
                senders.push((PublicKey(*first), a.participants.len()));
            }
        }
        let longest = specs.iter().map(|s| compress::encoded_len(&s.sizes, self.encoding)).max().unwrap_or(0);
        let max_len = Slice::encoded_len(longest);
        self.node.admission().aggregate((self.run, a.round), &senders, max_len);
    }

    async fn on_request(&self, d: &mut Driver, id: InboundId, message: Verified) {
        let binding = message.binding();
        let answer = match message.kind() {
            _ if binding.run != self.run => Err(format!("this aggregator sums run {}, not {}", self.run, binding.run)),
            MessageKind::Slice if self.ahead(d, binding.round) => {
                // its worker heard of the round first: it sends again
                let ack = Ack::refuse(self.run.0, binding.round, AckCode::WrongRound, "not assigned here yet");
                let envelope = d.signer.seal(self.run, binding.round, &ack);
                let _ = self.node.respond(id, envelope).await;
                return;
            }
            MessageKind::Slice => self.on_slice(d, &message),
            MessageKind::Accepts => self.on_accepts(d, &message),
            other => Err(format!("a worker does not answer {} requests", other.tag())),
        };
        let ack = match answer {
            Ok(()) => Ack::accept(self.run.0, binding.round),
            Err(reason) => {
                tracing::debug!("refused a {} request: {reason}", message.kind().tag());
                Ack::refuse(self.run.0, binding.round, AckCode::Malformed, reason)
            }
        };
        let envelope = d.signer.seal(self.run, binding.round, &ack);
        let _ = self.node.respond(id, envelope).await;
    }

    /// Whether `round` is newer than every round this driver has heard of: its
    /// announcement is on its way here.
    fn ahead(&self, d: &Driver, round: u64) -> bool {
        round > d.heard
    }

    fn on_slice(&self, d: &mut Driver, message: &Verified) -> Result<(), String> {
        let slice: Slice = message.decode().map_err(|e| format!("bad slice: {e}"))?;
        let (round, shard) = (slice.round, slice.shard as usize);
        let replicas = d
            .rounds
            .get(&round)
            .and_then(|r| r.get(&shard))
            .ok_or_else(|| format!("shard {shard} of round {round} is not summed here"))?;
        let signer = message.signer().0;
        // from its worker, or forwarded by the shard's first replica
        let forwarded = match signer {
            s if s == slice.worker => false,
            s if replicas.first() == Some(&s) => true,
            _ => return Err("a slice signed by neither its worker nor the shard's first replica".into()),
        };
        let kept = slice.bytes.clone();
        let input = Input::Slice { round, shard, worker: slice.worker, bytes: slice.bytes, forwarded };
        let actions = d.machine.handle(input);
        let refused = actions.iter().find_map(|a| match a {
            Action::Refuse { reason, .. } => Some(reason.to_string()),
            _ => None,
        });
        // only a slice the machine took is served: a refused one (a duplicate, a
        // retry's junk) costs no disk
        if refused.is_none() {
            self.serve(round, kept);
        }
        self.carry_out(d, actions);
        refused.map_or(Ok(()), Err)
    }

    /// Keeps a slice this node took as a blob it serves, by its hash (the hash
    /// its worker committed to), on a blocking thread (hashing and writing a
    /// slice takes 0.85-2.3 ns a byte): a screening committee's members fetch it
    /// here first. Not kept when the store holds it already (this node's own
    /// slice, or the same bytes from another worker) or cannot take it (its
    /// members then ask the worker).
    fn serve(&self, round: u64, bytes: Vec<u8>) {
        let (store, served) = (self.store.clone(), self.served.clone());
        tokio::task::spawn_blocking(move || {
            let hash = BlobHash(pcp_protocol::diloco::aggregation::slice_hash(&bytes));
            if store.contains(&hash) {
                return;
            }
            let len = bytes.len() as u64;
            match store.put_stream_with(len, pcp_bootstrap::Durability::Volatile, &mut |w| w.write_all(&bytes)) {
                Ok(hash) => served.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push((round, hash)),
                Err(e) => tracing::debug!(round, "keeping a slice to serve: {e}"),
            }
        });
    }

    /// Releases the served slices of rounds more than [`SERVED_ROUNDS`] behind
    /// the newest heard of (a slice a peer is fetching goes when its transfer
    /// ends).
    fn unserve(&self, d: &mut Driver) {
        let keep = d.heard.saturating_sub(SERVED_ROUNDS - 1);
        let mut served = self.served.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let old: Vec<BlobHash> = served.extract_if(.., |(round, _)| *round < keep).map(|(_, h)| h).collect();
        drop(served);
        if !old.is_empty() {
            let node = self.node.clone();
            d.sends.spawn(async move {
                let _ = node.release(old).await;
            });
        }
    }

    fn on_accepts(&self, d: &mut Driver, message: &Verified) -> Result<(), String> {
        let leader = self.leader.borrow().1;
        if message.signer() != leader {
            return Err("accepts not signed by the run's leader".into());
        }
        let accepts: Accepts = message.decode().map_err(|e| format!("bad accepts: {e}"))?;
        let round = accepts.round;
        let mut actions = Vec::new();
        for e in accepts.entries {
            let accept = Accept { seq: e.seq, weight: e.weight, norm: e.norm, bound: e.bound };
            for (shard, hash) in e.hashes {
                let shard = shard as usize;
                if d.rounds.get(&round).is_some_and(|r| r.contains_key(&shard)) {
                    actions.extend(d.machine.handle(Input::Accepted { round, shard, worker: e.worker, hash, accept }));
                }
            }
        }
        if let Some(count) = accepts.closed {
            d.closed.insert(round, Instant::now());
            actions.extend(d.machine.handle(Input::Closed { round, count }));
        }
        self.carry_out(d, actions);
        Ok(())
    }

    /// Does what the machine asked.
    fn carry_out(&self, d: &mut Driver, actions: Vec<Action<[u8; 32]>>) {
        let mut reports: BTreeMap<u64, Vec<SliceReportEntry>> = BTreeMap::new();
        let mut loaded = Vec::new();
        for action in actions {
            match action {
                Action::Spill { round, shard, worker, hash: _, bytes } => {
                    let path = self.spill_path(round, shard, worker);
                    let written = std::fs::create_dir_all(&self.spill.0).and_then(|()| std::fs::write(&path, &bytes));
                    if let Err(e) = written {
                        // read back as lost: the committed slice is fetched from its worker
                        tracing::warn!(round, shard, "spilling a slice to {}: {e}", path.display());
                    }
                    d.spilled.entry(round).or_default().push(path);
                }
                Action::Load { round, shard, worker, hash: _ } => {
                    let path = self.spill_path(round, shard, worker);
                    let bytes = std::fs::read(&path).unwrap_or_else(|e| {
                        tracing::warn!(round, shard, "reading the spilled slice {}: {e}", path.display());
                        Vec::new()
                    });
                    let _ = std::fs::remove_file(&path);
                    loaded.push(Input::Loaded { round, shard, worker, bytes });
                }
                Action::Forward { round, shard, worker, to, bytes } => {
                    let slice = Slice { run: self.run.0, round, shard: shard as u32, worker, bytes };
                    for key in to {
                        self.send(d, key, round, &slice);
                    }
                }
                Action::Report { round, shard, worker, hash, mut report } => {
                    match self.hostile.and_then(|a| a.at(round)) {
                        Some(super::Hostile::AggMisreport) => {
                            report.raw.iter_mut().for_each(|(n, m)| (*n, *m) = (*n / 100.0, *m / 100.0));
                            report.bounded_norm /= 100.0;
                        }
                        Some(super::Hostile::AggMute) => continue,
                        _ => {}
                    }
                    let (norms, maxes) = report.raw.into_iter().unzip();
                    let entry = SliceReportEntry {
                        shard: shard as u32,
                        worker,
                        hash,
                        norms,
                        maxes,
                        bounded_norm: report.bounded_norm,
                    };
                    reports.entry(round).or_default().push(entry);
                }
                Action::Refuse { round, worker, reason } => {
                    tracing::debug!(round, "refused {}'s slice: {reason}", peer_name(&PublicKey(worker)));
                }
                Action::Fetch { round, shard, worker, hash } => {
                    let node = self.node.clone();
                    let from: Vec<PeerId> = pcp_bootstrap::peer_of(&PublicKey(worker)).into_iter().collect();
                    // a slice is exactly its shard's message in the run's encoding: no larger one is read
                    let max = d.lengths.get(&(round, shard)).copied().unwrap_or(0);
                    let limits = (REQUEST_TIMEOUT, max);
                    d.fetches.spawn(async move {
                        let bytes = crate::diloco::wire::fetch_bounded(&node, BlobHash(hash), from, limits).await;
                        (round, shard, worker, bytes)
                    });
                }
                Action::Publish { round, shard, update } => {
                    // (the round's other shards keep their give-up timer)
                    let seconds = d.closed.get(&round).map_or(0.0, |at| at.elapsed().as_secs_f64());
                    let Some(update) = self.corrupt(round, shard, update) else { continue };
                    let blob = update.to_blob();
                    let outcome = match self.store.put_bytes(&blob) {
                        Ok(hash) => {
                            let size = blob.len() as u64;
                            let r = ParameterRef {
                                name: format!("shard-mean-{shard}"),
                                shard: shard as u32,
                                blob: hash.0,
                                size,
                            };
                            Ok((update.hash, r))
                        }
                        Err(e) => {
                            tracing::warn!(round, shard, "storing the shard's mean: {e}");
                            Err(ShardFailure::Missing)
                        }
                    };
                    self.vote(d, (round, shard, seconds), outcome);
                }
                Action::Failed { round, shard, error } => {
                    tracing::warn!(round, shard, "could not sum the shard: {error}");
                    let failure = match error {
                        SumError::Missing { .. } => ShardFailure::Missing,
                        SumError::Duplicate { .. } => ShardFailure::Duplicate,
                        SumError::PastClose { .. } => ShardFailure::PastClose,
                    };
                    self.vote(d, (round, shard, 0.0), Err(failure));
                }
            }
        }
        for (round, reports) in reports {
            d.reports.entry(round).or_default().extend(reports);
        }
        self.flush_reports(d, false);
        // a loaded slice's actions load nothing more
        for input in loaded {
            let actions = d.machine.handle(input);
            self.carry_out(d, actions);
        }
        // the spilled slices of rounds the machine has let go
        let live = d.machine.rounds();
        for (_, paths) in d.spilled.extract_if(.., |round, _| !live.contains(round)) {
            for path in paths {
                let _ = std::fs::remove_file(path);
            }
        }
    }

    /// Where `worker`'s spilled slice of `shard` in `round` waits: by worker, not by
    /// hash, since workers that send the same slice (a replay, the load test's
    /// shared payloads) each need their own.
    fn spill_path(&self, round: u64, shard: usize, worker: [u8; 32]) -> PathBuf {
        self.spill.0.join(format!("{round}-{shard}-{}", hex::encode(worker)))
    }

    /// Sends the reports held to the leader, in as few messages as fit, unless
    /// [`REPORTS_IN_FLIGHT`] sends are on their way (`force`: at once, as before a
    /// vote, which the shepherd weighs against them).
    fn flush_reports(&self, d: &mut Driver, force: bool) {
        if d.reports.is_empty() || (!force && d.reporting.len() >= REPORTS_IN_FLIGHT) {
            return;
        }
        let leader = self.leader.borrow().1;
        for (round, reports) in std::mem::take(&mut d.reports) {
            let mut chunk: Vec<SliceReportEntry> = Vec::new();
            let mut bytes = 0;
            for report in reports {
                if !chunk.is_empty() && bytes + report_bytes(&report) > REPORTS_PER_MESSAGE {
                    let reports = SliceReports { run: self.run.0, round, reports: std::mem::take(&mut chunk) };
                    self.send_into((&mut d.signer, &mut d.reporting), leader.0, round, &reports);
                    bytes = 0;
                }
                bytes += report_bytes(&report);
                chunk.push(report);
            }
            let reports = SliceReports { run: self.run.0, round, reports: chunk };
            self.send_into((&mut d.signer, &mut d.reporting), leader.0, round, &reports);
        }
    }

    /// A hostile aggregator's shard mean (`None`: it never votes).
    fn corrupt(&self, round: u64, shard: usize, update: ShardUpdate) -> Option<ShardUpdate> {
        let (mean, total) = match self.hostile.and_then(|a| a.at(round)) {
            Some(super::Hostile::AggStall) => return None,
            Some(super::Hostile::AggAlter) => {
                (update.mean.into_iter().map(|t| t.into_iter().map(|v| -v).collect()).collect(), update.total)
            }
            Some(super::Hostile::AggDrop) => (update.mean, update.total * 0.5),
            _ => return Some(update),
        };
        let hash = update_hash(round, shard, &mean, total);
        Some(ShardUpdate { mean, total, hash })
    }

    /// Signs shard `shard`'s outcome for the shepherd.
    fn vote(
        &self,
        d: &mut Driver,
        (round, shard, seconds): (u64, usize, f64),
        outcome: Result<([u8; 32], ParameterRef), ShardFailure>,
    ) {
        if let Ok((hash, _)) = &outcome {
            self.events.emit(ev::Event::ShardAggregated(ev::ShardAggregated {
                round,
                shard: shard as u64,
                hash: hex::encode(hash),
                contributions: 0,
                recomputed: false,
                seconds,
            }));
        }
        let vote = ShardVote { run: self.run.0, round, shard: shard as u32, outcome };
        self.flush_reports(d, true);
        let leader = self.leader.borrow().1;
        self.send(d, leader.0, round, &vote);
    }

    /// Sends `message` to `key` without waiting for its answer.
    fn send<M: pcp_protocol::Signable>(&self, d: &mut Driver, key: [u8; 32], round: u64, message: &M) {
        self.send_into((&mut d.signer, &mut d.sends), key, round, message);
    }

    /// [`Self::send`], its task in `sends`.
    fn send_into<M: pcp_protocol::Signable>(
        &self,
        (signer, sends): (&mut Signer, &mut JoinSet<()>),
        key: [u8; 32],
        round: u64,
        message: &M,
    ) {
        let Some(peer) = pcp_bootstrap::peer_of(&PublicKey(key)) else { return };
        let envelope = signer.seal(self.run, round, message);
        let node = self.node.clone();
        sends.spawn(async move {
            let _ = node.find_peer(peer).await;
            match tokio::time::timeout(REQUEST_TIMEOUT, node.request(peer, envelope)).await {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => tracing::debug!(%peer, "an aggregator's request: {e}"),
                Err(_) => tracing::debug!(%peer, "an aggregator's request: no answer"),
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use pcp_schema::Message as _;

    use super::*;

    #[test]
    fn a_message_of_reports_reckoned_within_its_share_fits_a_small_frame() {
        for tensors in [1, 5, 40, 400] {
            let report = SliceReportEntry {
                shard: u32::MAX,
                worker: [7; 32],
                hash: [9; 32],
                norms: vec![1.0; tensors],
                maxes: vec![1.0; tensors],
                bounded_norm: 1.0,
            };
            let n = (REPORTS_PER_MESSAGE / report_bytes(&report)).max(1);
            let message = SliceReports { run: [1; 32], round: u64::MAX, reports: vec![report; n] };
            let len = message.encode().len();
            assert!(len <= pcp_bootstrap::admission::SMALL_FRAME, "{n} reports of {tensors} tensors: {len} bytes");
        }
    }
}
