//! What the dashboard shows, kept up to date by the events the node emits.
//!
//! [`State::apply`] takes a typed event (those of `--events FILE`, see
//! [`crate::observe::events::Event`]) and the time it arrived; nothing here reads a clock, so a test drives it exactly.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt;

use crate::observe::events::kinds::{self as ev, Event};

/// Completed rounds kept for the loss chart and the summary.
pub(crate) const MAX_ROUNDS: usize = 500;
/// Workers kept in the table; beyond it, rows of workers that left make room.
const MAX_WORKERS: usize = 1024;
/// A worker's own contributions kept.
const MAX_MINE: usize = 100;
/// Peers whose address or connection is remembered.
const MAX_PEERS: usize = 4096;

/// Which dashboard: the node's role decides what it can know.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// A shepherd (or a standby coordinator candidate): the run and its workers.
    Shepherd,
    /// A worker: the run it joined and its own contributions.
    Worker,
    /// `pcp-node sim`: the shepherd's view of the whole simulated network.
    Sim,
}

impl Mode {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Shepherd => "shepherd",
            Self::Worker => "worker",
            Self::Sim => "sim",
        }
    }
}

/// What the run (or this node) is doing now.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Phase {
    /// Loading the model and compiling before the run starts.
    Starting,
    /// Compiling the training step for a worker's (backend, target).
    Compiling(String),
    /// The run started; round 1 waits for its first workers.
    WaitingForWorkers,
    /// A worker asks the DHT for a run.
    Looking,
    /// A worker joined and waits for a round to open.
    Joined,
    /// Round N is open.
    Training(u64),
    /// A worker joined while round N was open and waits for the next.
    SittingOut(u64),
    /// Round N completed; the next is not open yet.
    Completed(u64),
    /// A standby coordinator candidate, ready to take over.
    Standby,
    /// The run is over.
    Finished,
    /// A worker left its run, for this reason, and looks for another.
    Left(String),
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Starting => write!(f, "starting"),
            Self::Compiling(target) => write!(f, "compiling for {target}"),
            Self::WaitingForWorkers => write!(f, "waiting for workers"),
            Self::Looking => write!(f, "looking for a run"),
            Self::Joined => write!(f, "joined; waiting for a round"),
            Self::Training(round) => write!(f, "training round {round}"),
            Self::SittingOut(round) => write!(f, "joined during round {round}; waiting for the next"),
            Self::Completed(round) => write!(f, "round {round} completed"),
            Self::Standby => write!(f, "standby candidate"),
            Self::Finished => write!(f, "finished"),
            Self::Left(reason) => write!(f, "left the run: {reason}"),
        }
    }
}

/// Where a worker stands, as its shepherd sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Status {
    /// `sim` started its node; it has not joined yet.
    Starting,
    /// Joined; not in an open round.
    Joined,
    /// A participant of the open round that has not contributed yet.
    Training,
    /// Contributed to the open round.
    Sent,
    /// A participant that did not contribute before its round closed.
    Missed,
    /// Said goodbye.
    Left,
    /// Stopped heartbeating.
    TimedOut,
    /// `sim --kill-at` stopped it.
    Killed,
}

impl Status {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Starting => "starting",
            Self::Joined => "joined",
            Self::Training => "training",
            Self::Sent => "sent",
            Self::Missed => "missed",
            Self::Left => "left",
            Self::TimedOut => "timed out",
            Self::Killed => "killed",
        }
    }

    /// Gone from the run: its row may make room for a new worker.
    pub(crate) fn gone(self) -> bool {
        matches!(self, Self::Left | Self::TimedOut | Self::Killed)
    }
}

/// The fate of a contribution.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Verdict {
    pub(crate) round: u64,
    /// `None` while the shepherd has not answered.
    pub(crate) accepted: Option<bool>,
    /// Why it was rejected (or clipped); empty otherwise.
    pub(crate) reason: String,
}

/// A row of the workers table.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct WorkerRow {
    /// The worker's peer id.
    pub(crate) peer: String,
    /// Its number in `sim` (1-based).
    pub(crate) node: Option<u64>,
    /// `backend` or `backend:target`.
    pub(crate) backend: String,
    pub(crate) status: Status,
    /// Tokens of its last contribution over the time from its round's opening to
    /// its arrival (fetching, training and sending).
    pub(crate) tokens_per_s: Option<f64>,
    pub(crate) last: Option<Verdict>,
    /// Order of appearance.
    seq: u64,
}

/// One completed round, for the loss chart.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct RoundPoint {
    pub(crate) round: u64,
    /// The mean inner loss of the contributions (on a worker: its own).
    pub(crate) mean_loss: Option<f64>,
    /// The validation loss after the round (shepherd only).
    pub(crate) val_loss: Option<f64>,
    pub(crate) contributors: u64,
    pub(crate) seconds: Option<f64>,
    pub(crate) bytes_in: u64,
    pub(crate) bytes_out: u64,
}

/// Bytes moved: in the last round and in all.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Traffic {
    pub(crate) last_in: u64,
    pub(crate) last_out: u64,
    pub(crate) total_in: u64,
    pub(crate) total_out: u64,
    /// The last round's utilization: seconds in inner steps over wall seconds (a
    /// worker's own; the shepherd's: its contributors' together).
    pub(crate) utilization: Option<f64>,
}

/// One of a worker's own rounds.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct MyRound {
    pub(crate) round: u64,
    pub(crate) tokens: u64,
    pub(crate) tokens_per_s: Option<f64>,
    pub(crate) loss: Option<f64>,
    pub(crate) bytes: u64,
    /// Accepted, rejected (with the shepherd's reason) or abandoned.
    pub(crate) outcome: Outcome,
}

/// What became of a worker's round.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Outcome {
    Accepted,
    Rejected(String),
    Abandoned(String),
}

/// A worker's own contributions.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Mine {
    pub(crate) accepted: u64,
    pub(crate) rejected: u64,
    pub(crate) abandoned: u64,
    pub(crate) tokens: u64,
    /// The newest last.
    pub(crate) recent: VecDeque<MyRound>,
}

/// Where the node stands behind NATs, from its `reachability_changed`, `relay_*` and
/// `hole_punched` events.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct NatView {
    /// `public`, `private` or `unknown`; `None` before the first verdict.
    pub(crate) reachability: Option<String>,
    /// The relay holding this node's reservation.
    pub(crate) relay: Option<String>,
    /// Hole punches that worked and that failed.
    pub(crate) punched: u64,
    pub(crate) punch_failed: u64,
    /// Connections that went through a relay.
    pub(crate) relayed: u64,
}

impl NatView {
    /// Whether there is anything to show.
    pub(crate) fn known(&self) -> bool {
        self.reachability.is_some() || self.relay.is_some() || self.relayed > 0
    }

    fn apply(&mut self, event: &Event) -> bool {
        match event {
            Event::ReachabilityChanged(e) => self.reachability = nonempty(&e.reachability),
            Event::RelayReserved(e) => self.relay = nonempty(&e.relay),
            Event::RelayLost(e) => {
                if self.relay.as_deref() == Some(e.relay.as_str()) {
                    self.relay = None;
                }
            }
            Event::HolePunched(e) if e.result == "ok" => self.punched += 1,
            Event::HolePunched(_) => self.punch_failed += 1,
            Event::RelayedConnection(_) => self.relayed += 1,
            _ => return false,
        }
        true
    }
}

/// Everything the dashboard shows.
#[derive(Debug, Clone)]
pub(crate) struct State {
    pub(crate) mode: Mode,
    /// The time of the last event or tick, in unix milliseconds.
    pub(crate) now_ms: u64,
    /// The run's id, in hex.
    pub(crate) run: Option<String>,
    pub(crate) model: Option<String>,
    pub(crate) rounds_total: Option<u64>,
    pub(crate) tau: Option<u64>,
    /// The run's pseudo-gradient encoding (`fp32`, `int8`, `sparse`, …).
    pub(crate) encoding: Option<String>,
    /// The leader's term, once there was an election.
    pub(crate) term: Option<u64>,
    /// This node's peer id (in `sim`, the shepherd's) and first listen address.
    pub(crate) me: Option<String>,
    pub(crate) listen: Option<String>,
    /// A worker's shepherd.
    pub(crate) shepherd: Option<String>,
    /// A worker's `backend:target`.
    pub(crate) backend: Option<String>,
    pub(crate) phase: Phase,
    /// The open (or last) round and when it opened and closes, in unix milliseconds.
    pub(crate) round: u64,
    pub(crate) opened_ms: u64,
    pub(crate) deadline_ms: Option<u64>,
    /// When the last few rounds opened: a contribution may arrive after its round
    /// completed (the last one completes it) and the next opened.
    opened: VecDeque<(u64, u64)>,
    pub(crate) started_ms: Option<u64>,
    pub(crate) workers: BTreeMap<String, WorkerRow>,
    pub(crate) rounds: VecDeque<RoundPoint>,
    pub(crate) traffic: Traffic,
    pub(crate) mine: Mine,
    /// Distinct peers this node (in `sim`: any node) connected to.
    pub(crate) peers: BTreeSet<String>,
    /// The address each peer listens on or was seen at.
    pub(crate) addrs: BTreeMap<String, String>,
    /// Requests refused before they were read (bad signatures, replays, …).
    pub(crate) messages_rejected: u64,
    /// Whether peers can dial this node, and through what.
    pub(crate) nat: NatView,
    /// The user asked to quit; the node is stopping.
    pub(crate) quitting: bool,
    seq: u64,
}

/// `s`, unless it is empty (a field an event left out).
fn nonempty(s: &str) -> Option<String> {
    (!s.is_empty()).then(|| s.to_owned())
}

/// A finite number (an events file writes NaN as null).
fn finite(v: f64) -> Option<f64> {
    v.is_finite().then_some(v)
}

/// A deadline, unless it is unset (0).
fn deadline(ms: u64) -> Option<u64> {
    (ms > 0).then_some(ms)
}

/// `backend` or `backend:target`.
fn backend_name(backend: &str, target: &str) -> String {
    if target.is_empty() { backend.to_owned() } else { format!("{backend}:{target}") }
}

impl State {
    pub(crate) fn new(mode: Mode) -> Self {
        Self {
            mode,
            now_ms: 0,
            run: None,
            model: None,
            rounds_total: None,
            tau: None,
            encoding: None,
            term: None,
            me: None,
            listen: None,
            shepherd: None,
            backend: None,
            phase: if mode == Mode::Worker { Phase::Looking } else { Phase::Starting },
            round: 0,
            opened_ms: 0,
            deadline_ms: None,
            opened: VecDeque::new(),
            started_ms: None,
            workers: BTreeMap::new(),
            rounds: VecDeque::new(),
            traffic: Traffic::default(),
            mine: Mine::default(),
            peers: BTreeSet::new(),
            addrs: BTreeMap::new(),
            messages_rejected: 0,
            nat: NatView::default(),
            quitting: false,
            seq: 0,
        }
    }

    /// The clock moved on without an event.
    pub(crate) fn tick(&mut self, now_ms: u64) {
        self.now_ms = self.now_ms.max(now_ms);
    }

    /// Rows in the order workers appeared (in `sim`, by node number).
    pub(crate) fn worker_rows(&self) -> Vec<&WorkerRow> {
        let mut rows: Vec<&WorkerRow> = self.workers.values().collect();
        rows.sort_by_key(|r| (r.node.unwrap_or(u64::MAX), r.seq));
        rows
    }

    /// Rounds completed, as the last round point says.
    pub(crate) fn completed(&self) -> u64 {
        self.rounds.back().map_or(0, |r| r.round)
    }

    /// The open round's progress from its opening to its deadline, from 0 to 1.
    pub(crate) fn round_progress(&self) -> Option<f64> {
        let deadline = self.deadline_ms?;
        let span = deadline.saturating_sub(self.opened_ms).max(1);
        let elapsed = self.now_ms.saturating_sub(self.opened_ms);
        Some((elapsed as f64 / span as f64).clamp(0.0, 1.0))
    }

    /// Updates the state with `event`, which arrived at `now_ms`.
    pub(crate) fn apply(&mut self, event: &Event, now_ms: u64) {
        self.tick(now_ms);
        if self.nat.apply(event) {
            return;
        }
        match event {
            Event::Listening(e) => self.on_listening(&e.peer, &e.addr),
            Event::PeerConnected(e) => {
                if !e.peer.is_empty() {
                    if self.peers.len() < MAX_PEERS {
                        self.peers.insert(e.peer.clone());
                    }
                    if !e.addr.is_empty() && !self.addrs.contains_key(&e.peer) {
                        self.remember_addr(&e.peer, &e.addr);
                    }
                }
            }
            Event::MessageRejected(_) => self.messages_rejected += 1,
            Event::ShepherdElected(ev::ShepherdElected { term, .. })
            | Event::LeaseExpired(ev::LeaseExpired { term, .. })
            | Event::SteppedDown(ev::SteppedDown { newer: term, .. }) => self.see_term(*term),
            Event::LeaderFollowed(e) => {
                self.see_term(e.term);
                if self.mode == Mode::Worker {
                    self.shepherd = nonempty(&e.peer).or(self.shepherd.take());
                }
            }
            Event::Standby(e) => {
                self.see_term(e.term);
                if self.mode != Mode::Worker {
                    self.phase = Phase::Standby;
                }
            }
            _ if self.mode == Mode::Worker => self.apply_worker(event),
            _ => self.apply_shepherd(event),
        }
    }

    /// The highest leader term seen.
    fn see_term(&mut self, term: u64) {
        self.term = Some(self.term.map_or(term, |t| t.max(term)));
    }

    fn on_listening(&mut self, peer: &str, addr: &str) {
        if peer.is_empty() || addr.is_empty() {
            return;
        }
        // in `sim` the shepherd's node listens first; the others are its workers
        if self.me.is_none() {
            self.me = Some(peer.to_owned());
        }
        if self.me.as_deref() == Some(peer) && self.listen.is_none() {
            self.listen = Some(addr.to_owned());
        }
        if !self.addrs.contains_key(peer) {
            self.remember_addr(peer, addr);
        }
    }

    fn remember_addr(&mut self, peer: &str, addr: &str) {
        if self.addrs.len() >= MAX_PEERS {
            // make room: forget a peer that is not in the workers table
            let stranger = self.addrs.keys().find(|p| !self.workers.contains_key(*p)).cloned();
            match stranger {
                Some(p) => self.addrs.remove(&p),
                None => return,
            };
        }
        self.addrs.insert(peer.to_owned(), addr.to_owned());
    }

    /// The row of `peer`, made if there is room.
    fn row(&mut self, peer: &str) -> Option<&mut WorkerRow> {
        if !self.workers.contains_key(peer) {
            if self.workers.len() >= MAX_WORKERS {
                let gone = self.worker_rows().into_iter().find(|r| r.status.gone()).map(|r| r.peer.clone());
                self.workers.remove(&gone?);
            }
            self.seq += 1;
            let row = WorkerRow {
                peer: peer.to_owned(),
                node: None,
                backend: String::new(),
                status: Status::Joined,
                tokens_per_s: None,
                last: None,
                seq: self.seq,
            };
            self.workers.insert(peer.to_owned(), row);
        }
        self.workers.get_mut(peer)
    }

    fn push_round(&mut self, point: RoundPoint) {
        if self.rounds.len() >= MAX_ROUNDS {
            self.rounds.pop_front();
        }
        self.rounds.push_back(point);
    }

    fn apply_shepherd(&mut self, event: &Event) {
        match event {
            Event::RunStarted(e) => {
                self.run = nonempty(&e.run);
                self.model = nonempty(&e.model);
                self.rounds_total = Some(e.rounds);
                self.tau = Some(e.tau);
                self.encoding = nonempty(&e.encoding);
                self.round = e.resumed_round;
                self.started_ms = Some(self.now_ms);
                self.phase = Phase::WaitingForWorkers;
            }
            Event::CompileStarted(e) if !matches!(self.phase, Phase::Training(_)) => {
                let backend = if e.backend.is_empty() { "?" } else { &e.backend };
                self.phase = Phase::Compiling(backend_name(backend, &e.target));
            }
            Event::ArtifactPublished(_) | Event::CompileFailed(_) if matches!(self.phase, Phase::Compiling(_)) => {
                self.phase = if self.round > 0 { Phase::Completed(self.round) } else { Phase::WaitingForWorkers };
            }
            Event::WorkerStarted(e) => {
                if e.peer.is_empty() {
                    return;
                }
                if let Some(row) = self.row(&e.peer) {
                    row.node = Some(e.worker);
                    row.status = Status::Starting;
                }
            }
            Event::WorkerKilled(e) => {
                if let Some(row) = self.workers.values_mut().find(|r| r.node == Some(e.worker)) {
                    row.status = Status::Killed;
                }
            }
            Event::WorkerJoined(e) => {
                if e.peer.is_empty() {
                    return;
                }
                if let Some(row) = self.row(&e.peer) {
                    if !e.backend.is_empty() {
                        row.backend = e.backend.clone();
                    }
                    row.status = Status::Joined;
                }
            }
            Event::WorkerLeft(e) => {
                if let Some(row) = self.workers.get_mut(&e.peer) {
                    row.status = if row.status == Status::Killed {
                        Status::Killed
                    } else if e.reason == ev::Departure::HeartbeatTimeout {
                        Status::TimedOut
                    } else {
                        Status::Left
                    };
                }
            }
            Event::RoundStarted(e) => self.on_round_started(e),
            Event::DeadlineExtended(e) if e.round == self.round => {
                self.deadline_ms = deadline(e.deadline_unix_ms).or(self.deadline_ms);
            }
            Event::ContributionReceived(e) => {
                if e.peer.is_empty() {
                    return;
                }
                let round = e.round;
                let opened = self.opened.iter().find(|(r, _)| *r == round).map(|(_, at)| *at);
                let elapsed_s = opened.map_or(0.0, |at| self.now_ms.saturating_sub(at) as f64 / 1e3);
                let rate = (elapsed_s > 0.0).then(|| e.tokens as f64 / elapsed_s);
                let verdict = Verdict { round, accepted: Some(e.accepted), reason: e.reason.clone() };
                // the last contribution completes its round, and the next opens, before it is reported
                let open = round == self.round && matches!(self.phase, Phase::Training(_));
                if let Some(row) = self.row(&e.peer) {
                    row.tokens_per_s = rate.or(row.tokens_per_s);
                    row.last = Some(verdict);
                    if open && !row.status.gone() {
                        row.status = Status::Sent;
                    }
                }
            }
            Event::ContributionRejected(e) => {
                if let Some(row) = self.workers.get_mut(&e.peer) {
                    row.last = Some(Verdict { round: e.round, accepted: Some(false), reason: e.reason.clone() });
                }
            }
            Event::ContributionClipped(e) => {
                if let Some(row) = self.workers.get_mut(&e.peer) {
                    let reason = format!("clipped: {}", e.reason);
                    row.last = Some(Verdict { round: e.round, accepted: Some(true), reason });
                }
            }
            Event::RoundCompleted(e) => self.on_round_completed(e),
            // a worker's run_finished (in `sim`, every worker's) names the run
            Event::RunFinished(e) if e.run.is_none() => {
                self.phase = Phase::Finished;
                self.deadline_ms = None;
            }
            _ => {}
        }
    }

    fn on_round_started(&mut self, e: &ev::RoundStarted) {
        let round = e.round;
        self.round = round;
        self.opened_ms = self.now_ms;
        if self.opened.len() >= 8 {
            self.opened.pop_front();
        }
        self.opened.push_back((round, self.now_ms));
        self.deadline_ms = deadline(e.deadline_unix_ms);
        self.phase = Phase::Training(round);
        for peer in &e.participants {
            if let Some(row) = self.row(peer)
                && !row.status.gone()
            {
                row.status = Status::Training;
            }
        }
    }

    fn on_round_completed(&mut self, e: &ev::RoundCompleted) {
        let round = e.round;
        let point = RoundPoint {
            round,
            mean_loss: finite(e.mean_loss),
            val_loss: finite(e.val_loss),
            contributors: e.contributors,
            seconds: finite(e.seconds),
            bytes_in: e.bytes_in,
            bytes_out: e.bytes_out,
        };
        self.traffic.last_in = point.bytes_in;
        self.traffic.last_out = point.bytes_out;
        self.traffic.utilization = e.utilization.or(self.traffic.utilization);
        self.traffic.total_in += point.bytes_in;
        self.traffic.total_out += point.bytes_out;
        self.push_round(point);
        for peer in &e.peers {
            let Some(row) = self.workers.get_mut(peer) else { continue };
            if row.last.as_ref().is_none_or(|v| v.round != round || v.accepted.is_none()) {
                row.last = Some(Verdict { round, accepted: Some(true), reason: String::new() });
            }
            if row.status == Status::Training {
                row.status = Status::Sent;
            }
        }
        for peer in &e.excluded {
            if let Some(row) = self.workers.get_mut(peer)
                && !row.status.gone()
            {
                row.status = Status::Missed;
            }
        }
        for row in self.workers.values_mut() {
            if row.status == Status::Training {
                row.status = Status::Missed;
            }
        }
        self.round = round;
        self.deadline_ms = None;
        self.phase =
            if self.rounds_total.is_some_and(|t| round >= t) { Phase::Finished } else { Phase::Completed(round) };
    }

    fn push_mine(&mut self, mine: MyRound) {
        if self.mine.recent.len() >= MAX_MINE {
            self.mine.recent.pop_front();
        }
        self.mine.recent.push_back(mine);
    }

    fn apply_worker(&mut self, event: &Event) {
        match event {
            Event::RunJoined(e) => {
                self.run = nonempty(&e.run);
                self.shepherd = nonempty(&e.shepherd);
                let backend = if e.backend.is_empty() { "?" } else { &e.backend };
                self.backend = Some(backend_name(backend, &e.target));
                self.rounds_total = Some(e.rounds);
                self.tau = Some(e.tau);
                self.encoding = nonempty(&e.encoding).or(self.encoding.take());
                self.started_ms.get_or_insert(self.now_ms);
                self.phase = Phase::Joined;
            }
            Event::RoundAnnounced(e) => {
                self.round = e.round;
                self.opened_ms = self.now_ms;
                self.deadline_ms = deadline(e.deadline_unix_ms);
                self.phase = if e.participant { Phase::Training(e.round) } else { Phase::SittingOut(e.round) };
            }
            Event::BlobFetched(e) => {
                self.traffic.last_in = e.bytes;
                self.traffic.total_in += e.bytes;
            }
            Event::ContributionSent(e) => {
                let (round, tokens, bytes) = (e.round, e.tokens, e.bytes);
                let loss = finite(e.loss);
                let tokens_per_s = Some(e.seconds).filter(|s| *s > 0.0).map(|s| tokens as f64 / s);
                let outcome = if e.accepted {
                    self.mine.accepted += 1;
                    Outcome::Accepted
                } else {
                    self.mine.rejected += 1;
                    Outcome::Rejected(e.reason.clone())
                };
                self.mine.tokens += tokens;
                self.traffic.utilization = e.utilization.or(self.traffic.utilization);
                self.traffic.last_out = bytes;
                self.traffic.total_out += bytes;
                self.push_mine(MyRound { round, tokens, tokens_per_s, loss, bytes, outcome });
                self.push_round(RoundPoint {
                    round,
                    mean_loss: loss,
                    val_loss: None,
                    contributors: 1,
                    seconds: None,
                    bytes_in: 0,
                    bytes_out: bytes,
                });
                self.deadline_ms = None;
                self.phase = Phase::Completed(round);
            }
            Event::RoundAbandoned(e) => {
                let reason = e.reason.clone().unwrap_or_else(|| format!("after {} steps", e.steps));
                self.mine.abandoned += 1;
                self.push_mine(MyRound {
                    round: e.round,
                    tokens: 0,
                    tokens_per_s: None,
                    loss: None,
                    bytes: 0,
                    outcome: Outcome::Abandoned(reason),
                });
                self.deadline_ms = None;
            }
            Event::RunLeft(e) => {
                self.phase = Phase::Left(e.reason.clone());
                self.deadline_ms = None;
            }
            Event::RunFinished(_) => {
                self.phase = Phase::Finished;
                self.deadline_ms = None;
            }
            _ => {}
        }
    }
}

#[cfg(test)]
pub(crate) mod tests;
