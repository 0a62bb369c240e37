//! The shepherd role: `pcp-node --shepherd`.

mod aggregation;
mod args;
mod book;
mod committees;
mod compile;
mod hellos;
mod layout;
mod leadership;
mod resume;
mod screen;
mod setup;
mod table;
mod trust;

pub(crate) use args::{SPARSE_OUTER_LR, Screen, ShepherdArgs, ShepherdPlan, parse_encoding, parse_share, parse_trim};
pub(super) use leadership::LeaseKeeper;
use setup::ShepherdMeta;
pub(crate) use trust::{Trust, TrustArgs, parse_key};

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use pcp_bootstrap::{BlobStore, Event, InboundId, Node, PeerId, Stats};
use pcp_protocol::diloco::aggregate::Rejection;
use pcp_protocol::diloco::compress;
use pcp_protocol::diloco::fragments;
use pcp_protocol::diloco::shepherd::{self, Action, Input, LeaveReason, Shepherd};
use pcp_protocol::failover::Fence;
use pcp_protocol::failover::candidate as consensus_core;
use pcp_protocol::{BlobHash, PublicKey, RunId, Verified};
use pcp_schema::{
    Ack, AckCode, Contribution, Heartbeat, MessageKind, NodeHello, ParameterRef, RoundAnnouncement, RunManifest,
    SignedEnvelope,
};
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::Refusal;
use super::consensus::Consensus;
use super::retention::Retention;
use super::wire::{self, LeaderState, Signer, peer_name};
use crate::observe::events::{self as ev, Events};
use crate::training::checkpoint::{Checkpoint, TensorRef, save_refs};
use crate::training::device::Placement;
use crate::training::engine::Engine;
use crate::training::schedule::validation_loss;

/// A training step and an engine a standby prepares on its [`OwnEngine::on`],
/// so that it leads at once when elected.
#[derive(Debug)]
pub(crate) struct Prepared {
    pub(crate) step: pcp_graph::TrainModule,
    pub(crate) engine: Engine,
}

/// The coordinator's own engine, which screens contributions and computes the
/// validation loss: where it runs (`--backend` and `--target`; the host CPU by
/// default), and the one a standby prepared, if any.
#[derive(Debug)]
pub(crate) struct OwnEngine {
    pub(crate) on: Placement,
    pub(crate) prepared: Option<Prepared>,
}

impl OwnEngine {
    /// An engine on `on`, not prepared yet.
    pub(crate) fn on(on: Placement) -> Self {
        Self { on, prepared: None }
    }
}

/// How a shepherd begins.
#[derive(Debug)]
pub(crate) enum Start {
    /// A new run.
    New,
    /// The run checkpointed in the state directory (`--resume`).
    Resume(Box<Checkpoint>),
    /// A candidate elected for `term` takes over from the replicated state.
    Succeed {
        /// The run's manifest, as its last leader served it.
        manifest: Box<RunManifest>,
        /// The state after the last completed round.
        state: Box<LeaderState>,
        /// The term it won.
        term: u64,
    },
}

/// Why a shepherd stopped.
#[derive(Debug)]
pub(crate) enum Outcome {
    /// The run is over, or the node is shutting down.
    Done,
    /// It saw a higher term and is a candidate again.
    SteppedDown {
        /// The run's manifest.
        manifest: Box<RunManifest>,
        /// The higher term, or its own when it stepped aside.
        term: u64,
        /// Its own state: the standby it becomes holds it.
        state: Box<LeaderState>,
    },
}

/// What a host (`sim`) can observe of a running shepherd.
#[derive(Debug, Default, Clone)]
pub(crate) struct ShepherdHooks {
    /// Told the number of each round as it opens (never blocks the shepherd).
    pub(crate) opened: Option<mpsc::Sender<u64>>,
    /// A standby candidate tells it is standing by (`None`) and each completed
    /// round whose state it replicated.
    pub(crate) replicated: Option<mpsc::Sender<Option<u64>>>,
}

/// How often the shepherd gossips a heartbeat on the run's topic.
const HEARTBEAT_GOSSIP: Duration = Duration::from_secs(2);
/// How long the shepherd stays up after the last round so workers see it end.
const FAREWELL: Duration = Duration::from_secs(3);

/// The shepherd's host: the state machine plus its swarm, compiler and device, and
/// its parts: the artifacts it compiles, its leadership, the open round's book and
/// the tensors' layout.
pub(super) struct Host {
    node: Node,
    store: BlobStore,
    signer: Signer,
    run: RunId,
    manifest: RunManifest,
    machine: Shepherd<PublicKey>,
    events: Events,
    plan: ShepherdPlan,
    /// The step's module and the artifacts compiled from it, per worker target.
    artifacts: compile::Artifacts,
    /// Each worker's hello: the proof it carried (checked again at every
    /// contribution) and its backend; bounded, and released as workers leave.
    hellos: hellos::Hellos,
    /// The signed announcement of the open (or final) round, as workers see it, and
    /// its payload's hash (a worker that names it in its heartbeat holds it). Set by
    /// [`Shepherd::set_published`] only.
    published: Option<(SignedEnvelope, [u8; 32])>,
    /// Who leads the run, in which term, what is committed and replicated.
    lead: leadership::Leadership,
    /// The open round's traffic, bases and losses.
    book: book::RoundBook,
    /// How the parameters split into tensors, shards and fragments.
    layout: layout::Layout,
    /// The model on this host's CPU, for validation and the loss screen (none when
    /// the run uses neither).
    engine: Option<Engine>,
    /// The loss screen: its split, the open round's secret batch, its cost.
    screener: screen::Screener,
    hooks: ShepherdHooks,
    out: std::io::Stdout,
    /// DHT announcements of the run in progress, and requests sent unawaited.
    background: JoinSet<()>,
    /// Aggregated rounds (`--aggregators`).
    aggregation: aggregation::Aggregation,
}

impl std::fmt::Debug for Host {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Host").field("run", &self.run).finish()
    }
}

/// The most a round's deadline waits for contributions still being read.
const MAX_RECEIVING_EXTENSION_MS: u64 = 60_000;
/// A step that holds the role this long is excused to its workers' heartbeat
/// timeouts ([`pcp_protocol::diloco::Shepherd::excuse`]).
const DEAF_AFTER: std::time::Duration = std::time::Duration::from_secs(1);
/// A request that holds the role this long is logged (debug): the heartbeats behind it wait.
const SLOW_REQUEST: std::time::Duration = std::time::Duration::from_millis(200);

/// Contributors of the open round whose traffic `round_completed` reports.
const MAX_BACKEND_RECORDS: usize = 4096;
/// A contribution's bytes besides its encoded pseudo-gradient: the capnp message's
/// fields (run, round, counts, loss, the pseudo-gradient's reference).
const CONTRIBUTION_OVERHEAD: usize = 4096;

fn served(stats: &Stats) -> u64 {
    stats.bytes_served
}

impl Host {
    pub(super) async fn main_loop(
        &mut self,
        requests: &mut super::inbox::Inbox,
        cancel: &CancellationToken,
    ) -> anyhow::Result<Outcome> {
        let mut tick = tokio::time::interval(Duration::from_millis(200));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut gossip = tokio::time::interval(HEARTBEAT_GOSSIP);
        let mut finished_at: Option<Instant> = None;
        self.on_consensus(Vec::new()).await?;
        self.gossip_heartbeat().await;
        loop {
            if finished_at.is_some_and(|t| t.elapsed() >= FAREWELL) {
                break;
            }
            if self.lead.stepped_down.is_none() {
                self.lead.keeper.alive(self.lead.consensus.lease_heartbeat());
            } else {
                self.lead.keeper.set(None);
            }
            if let Some(term) = self.lead.stepped_down {
                // the standby it becomes holds this state (the consensus decides whose it follows)
                let state = Box::new(self.leader_state(&[], &[]));
                return Ok(Outcome::SteppedDown { manifest: Box::new(self.manifest.clone()), term, state });
            }
            tokio::select! {
                () = cancel.cancelled() => break,
                Some(_) = self.background.join_next() => {}
                Some(done) = self.lead.consensus.sends.join_next() => {
                    if let Ok(sent) = done {
                        let actions = self.lead.consensus.on_answer(sent)?;
                        self.on_consensus(actions).await?;
                    }
                }
                event = requests.recv() => match event {
                    Some(Event::Request { peer, id, message, hold }) => {
                        // a contribution keeps its share of the budget until it is handled
                        let (kind, started) = (message.kind(), std::time::Instant::now());
                        self.on_request(peer, id, *message).await?;
                        drop(hold);
                        let took = started.elapsed();
                        if took > SLOW_REQUEST {
                            tracing::debug!(kind = kind.tag(), ?took, "a slow request: heartbeats wait meanwhile");
                        }
                    }
                    Some(_) => {}
                    None => break,
                },
                Some(Ok(fetched)) = self.aggregation.fetches.join_next() => self.on_fetched(fetched).await?,
                Some(Ok(answer)) = self.screener.committees.answers.join_next() => self.on_screen_answer(answer).await?,
                Some(Ok(whole)) = self.screener.committees.fetching.join_next() => self.on_sliced(whole).await?,
                Some(done) = self.artifacts.compiles.join_next() => match done {
                    Ok(result) => self.on_compiled(result).await?,
                    Err(e) => tracing::warn!("compile task failed: {e}"),
                },
                _ = tick.tick() => {
                    self.machine.heard(requests.take_heard(), self.now_ms());
                    self.expire_hellos();
                    self.expire_votes();
                    self.expire_reports();
                    self.committee_tick().await?;
                    let actions = self.lead.consensus.handle(consensus_core::Input::Tick)?;
                    self.on_consensus(actions).await?;
                    if self.lead.stepped_down.is_none() && self.lead.consensus.core().is_leader() {
                        // as the simulator: the round's deadlines run only while a majority
                        // answers this leader's lease
                        if self.lead.consensus.may_act() {
                            self.step(Input::Tick).await?;
                        }
                        self.release().await;
                        self.check_quorum()?;
                    }
                }
                _ = gossip.tick() => self.gossip_heartbeat().await,
            }
            if self.machine.is_finished() && finished_at.is_none() {
                finished_at = Some(Instant::now());
                self.finish()?;
            }
        }
        Ok(Outcome::Done)
    }

    fn now_ms(&self) -> u64 {
        wire::unix_ms()
    }

    async fn respond(&mut self, id: InboundId, envelope: SignedEnvelope) -> anyhow::Result<()> {
        self.node.respond(id, envelope).await?;
        Ok(())
    }

    async fn refuse(&mut self, id: InboundId, round: u64, refusal: impl Into<Refusal>) -> anyhow::Result<()> {
        let ack = refusal.into().ack(self.run.0, round);
        let envelope = self.signer.seal(self.run, round, &ack);
        self.respond(id, envelope).await
    }

    /// A contribution for `round`: fed to the state machine as one input (with its timing
    /// and the screen's verdict), recorded, and answered; by committees, once they
    /// decided ([`committees`]).
    async fn on_contribution(
        &mut self,
        id: InboundId,
        key: PublicKey,
        round: u64,
        message: &Verified,
    ) -> anyhow::Result<()> {
        self.lead.quorum.heard(&key, wire::mono_ms());
        let mut received = None;
        let mut busy = (0, 0);
        let input = match message.decode::<Contribution>() {
            Ok(c) if !c.slice_hashes.is_empty() => return self.on_commitment(id, key, c).await,
            Ok(c) => {
                let stats = (c.samples, c.loss, c.delta.len(), c.bytes_down);
                received = Some(stats);
                busy = (c.train_ms, c.wall_ms);
                // overlap: how it was made (its budget and deadline learn from it)
                let transfer_ms = match c.sent_unix_ms {
                    0 => 0,
                    sent => wire::unix_ms().saturating_sub(sent),
                };
                let timing = shepherd::Timing { steps: u64::from(c.inner_steps), train_ms: c.train_ms, transfer_ms };
                let bytes = self.screener.by_committees().then(|| c.delta.clone());
                let input = match self.admit(key) {
                    Ok(()) => self.contribution_input(key, round, c, timing),
                    Err(refusal) => {
                        Input::Malformed { peer: key, round, reason: Rejection::NotAdmitted(refusal.reason) }
                    }
                };
                let input = match bytes {
                    Some(bytes) => match self.defer((id, &bytes), input, (stats, busy)).await? {
                        committees::Deferral::Deferred => return Ok(()),
                        committees::Deferral::Not(input) | committees::Deferral::Full(input) => *input,
                    },
                    None => input,
                };
                self.screened(input).await?
            }
            Err(e) => Input::Malformed {
                peer: key,
                round,
                reason: Rejection::Encoding(format!("undecodable contribution: {e}")),
            },
        };
        self.conclude(id, key, round, input, received, busy).await
    }

    /// A contribution's `input`, screened: recorded, fed to the state machine and
    /// answered through `id`.
    async fn conclude(
        &mut self,
        id: InboundId,
        key: PublicKey,
        round: u64,
        input: Input<PublicKey>,
        received: Option<(u64, f32, usize, u64)>,
        busy: (u64, u64),
    ) -> anyhow::Result<()> {
        if let Some((_, _, bytes, bytes_down)) = received
            && (self.book.traffic.len() < MAX_BACKEND_RECORDS || self.book.traffic.contains_key(&key))
        {
            // before the step: the contribution that closes the round is in its event
            self.book.traffic.insert(key, book::Traffic { up: bytes as u64, down: bytes_down, busy });
        }
        let rejected = self.step(input).await?;
        let reason = rejected.into_iter().find(|(p, _)| *p == key).map(|(_, r)| r);
        if let Some((tokens, loss, bytes, bytes_down)) = received {
            self.events.emit(ev::Event::ContributionReceived(ev::ContributionReceived {
                round,
                peer: peer_name(&key),
                tokens,
                loss: f64::from(loss),
                bytes: bytes as u64,
                bytes_down,
                accepted: reason.is_none(),
                reason: reason.as_ref().map(ToString::to_string).unwrap_or_default(),
            }));
        }
        // the sender is told the code and a reason without the screen's losses
        let ack = match reason {
            None => Ack::accept(self.run.0, round),
            Some(r) => Ack::refuse(self.run.0, round, r.code(), r.told()),
        };
        let envelope = self.signer.seal(self.run, round, &ack);
        self.respond(id, envelope).await
    }

    async fn on_request(&mut self, peer: PeerId, id: InboundId, message: Verified) -> anyhow::Result<()> {
        let key = message.signer();
        let binding = message.binding();
        // a hello may be for whichever run this shepherd runs (the zero run id)
        let any_run = message.kind() == MessageKind::NodeHello && binding.run == RunId([0; 32]);
        if binding.run != self.run && !any_run {
            return self
                .refuse(
                    id,
                    binding.round,
                    Refusal::new(AckCode::WrongRun, format!("this shepherd runs {}, not {}", self.run, binding.run)),
                )
                .await;
        }
        match message.kind() {
            MessageKind::NodeHello => match message.decode::<NodeHello>() {
                Ok(hello) => self.on_hello(id, key, hello).await,
                Err(e) => self.refuse(id, 0, format!("bad hello: {e}")).await,
            },
            MessageKind::Heartbeat => match message.decode::<Heartbeat>() {
                // a candidate: a standby following this leader, or another leader's lease
                Ok(hb) if self.lead.consensus.core().succession().contains(&key) => {
                    if let Some((reply, actions)) = self.lead.consensus.on_request(key, &hb)? {
                        self.on_consensus(actions).await?;
                        return match reply {
                            Some(reply) => {
                                let envelope = self.signer.seal(self.run, reply.round, &reply);
                                self.respond(id, envelope).await
                            }
                            None => {
                                let reason = format!("{} of run {}", super::STANDBY, self.run);
                                self.refuse(id, binding.round, Refusal::new(AckCode::Standby, reason)).await
                            }
                        };
                    }
                    if self.lead.stepped_down.is_some() {
                        let reason = format!("{} of run {}: stepped down", super::STANDBY, self.run);
                        return self.refuse(id, binding.round, Refusal::new(AckCode::Standby, reason)).await;
                    }
                    let envelope = match &self.lead.opened {
                        Some(o) => o.envelope.clone(),
                        None => self.current_announcement(),
                    };
                    self.respond(id, envelope).await
                }
                Ok(hb) => {
                    // a worker already past this leader's rounds (it refuses them: workers never
                    // move back) is not part of its quorum: a leader behind them steps aside
                    if hb.round <= self.machine.completed() + 1 {
                        self.lead.quorum.heard(&key, wire::mono_ms());
                    }
                    if hb.follows > self.lead.consensus.term() && hb.follows > self.lead.reported_term {
                        // a worker follows a newer term (its word alone proves nothing: the
                        // new leader's answer to this one's lease does)
                        self.lead.reported_term = hb.follows;
                        self.events.emit(ev::Event::HigherTermReported(ev::HigherTermReported {
                            term: self.lead.consensus.term(),
                            reported: hb.follows,
                            peer: peer_name(&key),
                        }));
                    }
                    // a resumed (or elected) shepherd's workers come back with heartbeats, not
                    // hellos; a key the run never admitted is told to say hello
                    if !self.machine.workers().any(|w| *w == key) {
                        if let Err(reason) = self.admit_rejoin(key) {
                            return self.refuse(id, binding.round, reason).await;
                        }
                        self.step(Input::Joined(key)).await?;
                    }
                    self.node.admission().know(self.run, key);
                    self.step(Input::Heartbeat(key)).await?;
                    // a worker holding the current announcement hears only that it is
                    // current, with this leader's term (its lease): a few hundred bytes
                    // rather than the announcement, twice a second
                    let hash = self.published.as_ref().map(|(_, hash)| *hash);
                    if hash.is_some() && hb.known == hash {
                        let (round, lease) = self.lease();
                        let current = Heartbeat { known: hash, held: None, ..lease };
                        let envelope = self.signer.seal(self.run, round, &current);
                        return self.respond(id, envelope).await;
                    }
                    let envelope = self.current_announcement();
                    self.respond(id, envelope).await
                }
                Err(e) => self.refuse(id, binding.round, format!("bad heartbeat: {e}")).await,
            },
            MessageKind::Contribution => self.on_contribution(id, key, binding.round, &message).await,
            MessageKind::SliceReports => self.on_slice_reports(id, &message).await,
            MessageKind::ShardVote => self.on_shard_vote(id, &message).await,
            other => {
                tracing::debug!(%peer, "unexpected {} request", other.tag());
                self.refuse(id, binding.round, format!("a shepherd does not answer {} requests", other.tag())).await
            }
        }
    }

    /// The tensor sizes of round `round`'s pseudo-gradients: its fragment's, the
    /// other tensors empty (every tensor without fragments).
    fn round_sizes(&self, round: u64) -> Vec<usize> {
        fragments::masked(
            &self.layout.sizes,
            &self.layout.fragments[fragments::of_round(round, self.layout.fragments.len())],
        )
    }

    /// The contribution `c` as the state machine's input, unscreened (or why it is malformed).
    fn contribution_input(
        &mut self,
        key: PublicKey,
        round: u64,
        c: Contribution,
        timing: shepherd::Timing,
    ) -> Input<PublicKey> {
        self.book.bytes_in += c.delta.len() as u64;
        let malformed = |reason: String| Input::Malformed { peer: key, round, reason: Rejection::Encoding(reason) };
        if c.run != self.run.0 || c.round != round {
            return malformed("the contribution's run or round differs from its envelope's".into());
        }
        if c.pseudo_gradient.blob != *blake3::hash(&c.delta).as_bytes() {
            return malformed("the pseudo-gradient does not hash to its content id".into());
        }
        // fencing: trained from this term's announcement of the open round, from its
        // parameters (or, carried over in an overlapping run, of the round before)
        let base = match self.machine.open_round() {
            Some(open) if open == round => self.book.round_base,
            _ => self.book.last_base.filter(|(r, _)| *r == round).map(|(_, b)| b),
        };
        if let Some(base) = base {
            let fence = Fence { term: self.lead.consensus.term(), round, params: base.0 };
            if let Err(e) = fence.check(c.term, c.round, &c.params_hash) {
                return Input::Malformed { peer: key, round, reason: Rejection::Fenced(e.to_string()) };
            }
        }
        match compress::decode_delta_seeded(&c.delta, &self.round_sizes(round), self.plan.encoding, round) {
            Ok(delta) => Input::Contribution {
                peer: key,
                round,
                samples: c.samples,
                loss: c.loss,
                delta,
                timing: Some(timing),
                screen: shepherd::Screen::Unscreened,
            },
            Err(e) => malformed(e.to_string()),
        }
    }

    fn set_published(&mut self, envelope: Option<SignedEnvelope>) {
        self.published = envelope.map(|e| {
            let hash = *blake3::hash(&e.payload).as_bytes();
            (e, hash)
        });
    }

    /// The announcement of the open round, or a waiting one (round 0) before the first.
    fn current_announcement(&mut self) -> SignedEnvelope {
        if let Some((p, _)) = &self.published {
            return p.clone();
        }
        let announcement = RoundAnnouncement {
            run: self.run.0,
            round: self.machine.completed(),
            parameters: Vec::new(),
            deadline_unix_ms: 0,
            participants: Vec::new(),
            participants_blob: None,
            finished: false,
            term: self.lead.consensus.term(),
            state: self.lead.state.clone(),
            update: None,
            budget_ms: 0,
            steps_end_unix_ms: 0,
            screen_commit: [0; 32],
            screen_reveal: [0; 32],
            aggregators: Vec::new(),
        };
        self.signer.seal(self.run, self.machine.completed(), &announcement)
    }

    /// Feeds the state machine and performs its actions; returns the rejections.
    /// A round whose deadline comes while contributions are still being read (or
    /// wait for room to be read: a burst of a thousand is read in turn), or while
    /// committed contributions' slice reports keep coming, waits for them, a second
    /// at a time, up to [`MAX_RECEIVING_EXTENSION_MS`] a round: they were sent in time.
    fn hold_deadline_while_receiving(&mut self) {
        let (Some(round), Some(deadline)) = (self.machine.open_round(), self.machine.deadline_ms()) else { return };
        let now = self.now_ms();
        let arriving = self.aggregation.arriving(round) + self.screener.committees.screening(round);
        if now < deadline || self.node.admission().receiving() + arriving == 0 {
            return;
        }
        let extended = match self.book.receiving_extension {
            (r, ms) if r == round => ms,
            _ => 0,
        };
        if extended >= MAX_RECEIVING_EXTENSION_MS {
            return;
        }
        let by = now - deadline + 1000;
        if let Some(deadline_ms) = self.machine.postpone(by) {
            self.book.receiving_extension = (round, extended + by);
            self.events
                .emit(ev::Event::DeadlineExtended(ev::DeadlineExtended { round, deadline_unix_ms: deadline_ms }));
        }
    }

    async fn step(&mut self, input: Input<PublicKey>) -> anyhow::Result<Vec<(PublicKey, Rejection)>> {
        // every input may close the round at its deadline, not only the tick
        self.hold_deadline_while_receiving();
        let now = self.now_ms();
        let mut rejected = Vec::new();
        let deaf = std::time::Instant::now();
        let actions = self.machine.handle(input, now);
        if actions.iter().any(|a| matches!(a, Action::RoundCompleted(_))) {
            self.book.close = vec![("outer step", deaf.elapsed())];
        }
        for action in actions {
            match action {
                Action::OpenRound { round, deadline_ms, participants } => {
                    self.open_round(round, deadline_ms, participants, deaf).await?;
                }
                Action::Rejected { peer, round, reason } => {
                    tracing::warn!(peer = %peer_name(&peer), round, "contribution rejected: {reason}");
                    self.events.emit(ev::Event::ContributionRejected(ev::ContributionRejected {
                        round,
                        peer: peer_name(&peer),
                        reason: reason.to_string(),
                    }));
                    rejected.push((peer, reason));
                }
                Action::RoundCompleted(summary) => self.round_completed(summary).await?,
                Action::WorkerJoined(p) => {
                    tracing::info!(peer = %peer_name(&p), "worker joined");
                    self.hello_joined(p);
                    let backend = self.hellos.backend(&p);
                    self.events.emit(ev::Event::WorkerJoined(ev::WorkerJoined { peer: peer_name(&p), backend }));
                }
                Action::WorkerLeft { peer, reason } => {
                    let reason = match reason {
                        LeaveReason::Left => ev::Departure::Left,
                        LeaveReason::Timeout => ev::Departure::HeartbeatTimeout,
                    };
                    tracing::info!(peer = %peer_name(&peer), "worker left: {reason:?}");
                    self.aggregation.left(&peer);
                    self.hello_left(peer);
                    self.events.emit(ev::Event::WorkerLeft(ev::WorkerLeft { peer: peer_name(&peer), reason }));
                }
                Action::DeadlineExtended { round, deadline_ms } => {
                    self.events.emit(ev::Event::DeadlineExtended(ev::DeadlineExtended {
                        round,
                        deadline_unix_ms: deadline_ms,
                    }));
                }
                Action::Finished => {}
                Action::Added { round, peer, of, weight, norm, bound } => {
                    self.added((round, of), peer, (weight, norm, bound));
                }
                Action::Aggregate { round, count } => self.aggregate(round, count),
            }
        }
        self.send_accepts();
        // a close (the outer step, writing the round's blobs) holds this loop for seconds:
        // heartbeats dropped meanwhile are no worker's silence
        let took = deaf.elapsed();
        if took > DEAF_AFTER {
            self.machine.excuse(took.as_millis() as u64);
        }
        Ok(rejected)
    }

    /// Announces round `round`, decided on the input handled from `input_at`.
    async fn open_round(
        &mut self,
        round: u64,
        deadline_ms: u64,
        participants: Vec<PublicKey>,
        input_at: Instant,
    ) -> anyhow::Result<()> {
        // contribution-sized reads are for this round's participants only (see pcp_bootstrap::admission)
        self.node.admission().open_round(self.run, round, &participants);
        let shards_at = Instant::now();
        let parameters = self.publish_params()?;
        if !self.book.close.is_empty() {
            self.book.close.push(("parameters", shards_at.elapsed()));
        }
        let hash = BlobHash(parameters[0].blob);
        let shards = parameters[1..].to_vec();
        self.book.last_base = self.book.round_base.replace(hash).map(|b| (round - 1, b));
        // past the inline threshold, the participants go in a blob of their own
        let (listed, participants_blob) =
            super::participants::publish(&self.store, &participants, self.plan.participants_inline)?;
        // the blobs of rounds older than this node keeps go
        let stored = &parameters[usize::from(parameters.len() > 1)..];
        let kept: Vec<BlobHash> = stored.iter().chain(&participants_blob).map(|p| BlobHash(p.blob)).collect();
        self.plan.retention.advance(&self.node, &self.events, round, kept).await;
        self.book.traffic.clear();
        // the screen's secret batch for this round: committed now, revealed with the next
        if self.plan.overlap && self.plan.screen == Screen::Score {
            self.screener.based(round, self.machine.params());
        }
        let (screen_commit, screen_reveal) = self.screener.open(round);
        if self.screener.committees_open() {
            self.open_committees(round, hash).await?;
        } else if self.screener.by_committees() && round.checked_sub(1) == Some(self.screener.slices()) {
            tracing::warn!(
                "round {round}: the withheld split's {} slices are spent (one a round of committees); \
                 the shepherd screens alone from now on",
                self.screener.slices()
            );
        }
        let aggregators = self.assign_aggregators(round, &participants);
        // the deadline was set at the input that closed the last round; the close (the
        // outer step, the parameters' shards, a checkpoint when due: 3 s for gpt2-124m)
        // came between, and the workers get the whole window after the announcement
        let late_ms = input_at.elapsed().as_millis() as u64;
        if !self.book.close.is_empty() {
            let phases: Vec<String> = std::mem::take(&mut self.book.close)
                .iter()
                .map(|(name, d)| format!("{name} {:.2} s", d.as_secs_f64()))
                .collect();
            tracing::info!("round {} closed in {:.2} s: {}", round - 1, late_ms as f64 / 1e3, phases.join(", "));
        }
        let deadline_ms = match late_ms {
            0 => deadline_ms,
            ms => self.machine.postpone(ms).unwrap_or(deadline_ms),
        };
        let announcement = RoundAnnouncement {
            run: self.run.0,
            round,
            parameters,
            deadline_unix_ms: deadline_ms,
            participants: listed,
            participants_blob,
            finished: false,
            term: self.lead.consensus.term(),
            state: self.lead.state.clone(),
            update: self.book.update.clone(),
            // overlap: the round's compute budget, and when the median worker's steps end
            budget_ms: self.machine.budget_ms().unwrap_or(0),
            steps_end_unix_ms: self.machine.steps_end_ms().unwrap_or(0),
            screen_commit,
            screen_reveal,
            aggregators,
        };
        let envelope = self.signer.seal(self.run, round, &announcement);
        self.book.served_at_open = self.node.stats().await.map(|s| served(&s)).unwrap_or(0);
        let held_back = announcement;
        let event = ev::RoundStarted {
            round,
            deadline_unix_ms: deadline_ms,
            params_hash: hash.to_hex(),
            participants: participants.iter().map(peer_name).collect(),
            term: self.lead.consensus.term(),
            waited_ms: 0,
        };
        let state = self.lead.state_replica.map(|r| (r.round, r.params));
        let at = Instant::now();
        self.lead.opened = Some(leadership::Opened { round, state, envelope, event, at, held_back });
        self.release().await;
        self.store_shards(round, &shards)
    }

    /// The held-out loss at `params`, or NaN with `eval_batches: 0` (a run that
    /// does not validate: a load test's, or a model too large for the shepherd's CPU).
    async fn validate(&mut self) -> anyhow::Result<f64> {
        if self.plan.experiment.eval_batches == 0 {
            return Ok(f64::NAN);
        }
        let params = self.machine.params().clone();
        let engine = self.engine.as_mut().context("validation without the model on this host")?;
        engine.set_params(params).await.context("loading parameters for validation")?;
        let shape = (self.manifest.data.batch as usize, self.manifest.data.block as usize);
        let e = &self.plan.experiment;
        validation_loss(engine, &self.plan.corpus.val, shape, e.seed, e.eval_batches).await
    }

    /// Writes a checkpoint of the parameters (`params_hash`, computed at the close)
    /// and the outer optimizer's state.
    fn checkpoint(
        &self,
        contributors: &[PublicKey],
        excluded: &[PublicKey],
        params_hash: BlobHash,
    ) -> anyhow::Result<PathBuf> {
        // borrowed, written as they go: gpt2-124m's parameters and momentum are a GB
        let (durations, norms) = self.machine.history();
        let specs: Vec<(String, Vec<usize>)> = self
            .manifest
            .tensors
            .iter()
            .map(|spec| (format!("velocity.{}", spec.name), spec.shape.iter().map(|d| *d as usize).collect()))
            .collect();
        let mut tensors = Vec::new();
        for (((p, v), spec), (velocity, shape)) in
            self.machine.params().iter().zip(self.machine.velocity()).zip(&self.manifest.tensors).zip(&specs)
        {
            tensors.push(TensorRef { name: &spec.name, shape, data: p });
            tensors.push(TensorRef { name: velocity, shape, data: v });
        }
        let meta = ShepherdMeta {
            role: "shepherd".into(),
            run: self.run.to_hex(),
            experiment: self.plan.experiment.clone(),
            model: self.plan.model.source.clone(),
            vocab: Some(self.plan.corpus.vocab.clone()),
            durations,
            norms,
            contributors: contributors.len(),
            workers: contributors.iter().chain(excluded).map(|k| hex::encode(k.0)).collect(),
            params_hash: params_hash.to_hex(),
            creator: Some(hex::encode(self.manifest.shepherd)),
            salt: Some(hex::encode(self.manifest.salt)),
            candidates: self.manifest.candidates.iter().map(hex::encode).collect(),
            term: self.lead.consensus.term(),
            learned: wire::LearnedRecord::of(&self.machine.learned()),
        };
        let meta = serde_json::to_value(meta)?;
        // a checkpoint per kept round (`--keep-rounds`): gpt2-124m's is 1.3 GB
        save_refs(&self.plan.state_dir, self.machine.completed(), &meta, &tensors, self.plan.retention.rounds())
    }

    /// The blobs this host kept and pinned, for the standby it becomes.
    /// Its consensus, which the standby it becomes goes on with, and its blobs'
    /// retention.
    pub(super) fn into_parts(self) -> (Box<Consensus>, Retention) {
        (self.lead.consensus, self.plan.retention)
    }

    fn finish(&mut self) -> anyhow::Result<()> {
        let blob = wire::params_blob(self.machine.params());
        let hash = self.store.put_bytes(&blob)?;
        let round = self.machine.completed();
        let announcement = RoundAnnouncement {
            run: self.run.0,
            round,
            parameters: vec![ParameterRef { name: "params".into(), shard: 0, blob: hash.0, size: blob.len() as u64 }],
            deadline_unix_ms: 0,
            participants: Vec::new(),
            participants_blob: None,
            finished: true,
            term: self.lead.consensus.term(),
            state: self.lead.state.clone(),
            update: None,
            budget_ms: 0,
            steps_end_unix_ms: 0,
            screen_commit: [0; 32],
            screen_reveal: [0; 32],
            aggregators: Vec::new(),
        };
        let envelope = self.signer.seal(self.run, round, &announcement);
        self.lead.opened = None;
        self.set_published(Some(envelope));
        self.events.emit(ev::Event::RunFinished(ev::RunFinished {
            run: None,
            rounds: round,
            val_loss: Some(self.book.last_val),
            params_hash: Some(hash.to_hex()),
            seconds: Some(self.book.started.elapsed().as_secs_f64()),
        }));
        if self.plan.table {
            writeln!(
                self.out.lock(),
                "done: {round} rounds in {:.1} s, val loss {:.4} -> {:.4}, parameters {}",
                self.book.started.elapsed().as_secs_f64(),
                self.book.first_val,
                self.book.last_val,
                hash
            )?;
        }
        Ok(())
    }
}

fn file_name(path: &Path) -> String {
    path.file_name().map_or_else(|| path.display().to_string(), |n| n.to_string_lossy().into_owned())
}
