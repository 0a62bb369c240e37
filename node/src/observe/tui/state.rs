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
                    let timeout = e.reason.contains("timeout");
                    row.status = if row.status == Status::Killed {
                        Status::Killed
                    } else if timeout {
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
pub(crate) mod tests {
    use serde_json::{Value, json};

    use super::*;

    impl State {
        /// Applies the event `name` with `fields`, as it is written.
        pub(crate) fn apply_named(&mut self, name: &str, fields: &Value, now_ms: u64) {
            self.apply(&Event::named(name, fields.clone()), now_ms);
        }
    }

    pub(crate) const W1: &str = "12D3KooWQm6U7mxrTKoEqGbF9JGTcL2Dey1rEKK9nDLGP2VqYhHa";
    pub(crate) const W2: &str = "12D3KooWHd7bQwKpJTMW8qgzNXVwUFC8d1t6mSafRjW4kXAUBjGc";
    pub(crate) const W3: &str = "12D3KooWSHEPHERDxRNhqYR8azJc2VAgDhT6rpYQsPzoUv3aDk5e";
    pub(crate) const RUN: &str = "9f3b2c1d4e5f60718293a4b5c6d7e8f9091a2b3c4d5e6f708192a3b4c5d6e7f8";
    /// 2026-01-01T00:00:00Z, in unix milliseconds.
    pub(crate) const T0: u64 = 1_767_225_600_000;

    /// Feeds events to a state, each `dt` milliseconds after the last.
    struct Feed {
        s: State,
        at: u64,
    }

    impl Feed {
        fn e(&mut self, name: &str, fields: Value, dt: u64) {
            self.at += dt;
            self.s.apply_named(name, &fields, self.at);
        }
    }

    /// A shepherd two rounds into a three-round run, with one worker rejected in round 2.
    pub(crate) fn shepherd(mode: Mode) -> State {
        let mut f = Feed { s: State::new(mode), at: T0 };
        f.e("listening", json!({"peer": W3, "addr": "/ip4/127.0.0.1/tcp/4001"}), 0);
        f.e("run_started", json!({"run": RUN, "model": "nanogpt-small", "rounds": 3, "tau": 10}), 10);
        if mode == Mode::Sim {
            f.e("worker_started", json!({"worker": 1, "peer": W1, "round": 0}), 10);
            f.e("worker_started", json!({"worker": 2, "peer": W2, "round": 0}), 10);
            f.e("listening", json!({"peer": W1, "addr": "/ip4/127.0.0.1/tcp/40123"}), 10);
            f.e("listening", json!({"peer": W2, "addr": "/ip4/127.0.0.1/tcp/40124"}), 10);
        }
        f.e("peer_connected", json!({"peer": W1, "addr": "/ip4/10.0.0.7/tcp/40123"}), 10);
        f.e("peer_connected", json!({"peer": W2, "addr": "/ip4/10.0.0.8/udp/4001/quic-v1"}), 10);
        f.e("compile_started", json!({"backend": "cpu", "target": "znver3"}), 10);
        f.e("artifact_published", json!({"backend": "cpu", "target": "znver3"}), 2_000);
        f.e("worker_joined", json!({"peer": W1, "backend": "cpu:znver3"}), 10);
        f.e("worker_joined", json!({"peer": W2, "backend": "vulkan"}), 10);
        for round in 1..=2u64 {
            let deadline = f.at + 60_000;
            f.e("round_started", json!({"round": round, "deadline_unix_ms": deadline, "participants": [W1, W2]}), 0);
            let sent = json!({"round": round, "peer": W1, "tokens": 20480, "accepted": true, "reason": ""});
            f.e("contribution_received", sent, 4_000);
            let (accepted, reason) =
                if round == 2 { (false, "no improvement: held-out loss 3.1 -> 3.2") } else { (true, "") };
            let sent = json!({"round": round, "peer": W2, "tokens": 20480, "accepted": accepted, "reason": reason});
            f.e("contribution_received", sent, 1_000);
            if !accepted {
                f.e("contribution_rejected", json!({"round": round, "peer": W2, "reason": reason}), 0);
            }
            let peers = if accepted { json!([W1, W2]) } else { json!([W1]) };
            let completed = json!({
                "round": round, "contributors": if accepted { 2 } else { 1 },
                "mean_loss": 4.2 - 0.4 * round as f64, "val_loss": 4.05 - 0.3 * round as f64,
                "bytes_in": 880_000, "bytes_out": 1_760_000, "seconds": 5.0, "peers": peers, "excluded": [],
            });
            f.e("round_completed", completed, 500);
        }
        let deadline = f.at + 40_000;
        f.e("round_started", json!({"round": 3, "deadline_unix_ms": deadline, "participants": [W1, W2]}), 0);
        f.e("contribution_received", json!({"round": 3, "peer": W1, "tokens": 20480, "accepted": true}), 2_000);
        f.s.tick(f.at + 8_000);
        f.s
    }

    #[test]
    fn a_shepherd_follows_rounds_and_workers() {
        let s = shepherd(Mode::Shepherd);
        assert_eq!(s.phase, Phase::Training(3));
        assert_eq!(s.completed(), 2);
        assert_eq!(s.rounds.len(), 2);
        assert_eq!(s.rounds[1].val_loss, Some(4.05 - 0.6));
        let rows = s.worker_rows();
        assert_eq!(rows.iter().map(|r| r.peer.as_str()).collect::<Vec<_>>(), [W1, W2]);
        assert_eq!(rows[0].status, Status::Sent);
        assert_eq!(rows[1].status, Status::Training);
        // 20480 tokens in the 2 s since round 3 opened
        assert_eq!(rows[0].tokens_per_s, Some(10_240.0));
        let last = rows[1].last.as_ref().expect("a verdict");
        assert_eq!((last.round, last.accepted), (2, Some(false)));
        assert!(last.reason.starts_with("no improvement"), "{}", last.reason);
        assert_eq!(s.traffic.total_in, 1_760_000);
        assert_eq!(s.addrs.get(W2).map(String::as_str), Some("/ip4/10.0.0.8/udp/4001/quic-v1"));
        // opened 2 s + 8 s ago, 40 s to the deadline
        let progress = s.round_progress().expect("an open round");
        assert!((progress - 10.0 / 40.0).abs() < 1e-9, "{progress}");
    }

    #[test]
    fn the_contribution_that_completes_a_round_is_reported_after_the_next_opens() {
        let mut s = State::new(Mode::Shepherd);
        s.apply_named("worker_joined", &json!({"peer": W1, "backend": "cpu"}), T0);
        s.apply_named("round_started", &json!({"round": 1, "participants": [W1]}), T0);
        s.apply_named("round_completed", &json!({"round": 1, "peers": [W1], "mean_loss": 3.0}), T0 + 2_000);
        s.apply_named("round_started", &json!({"round": 2, "participants": [W1]}), T0 + 2_000);
        let sent = json!({"round": 1, "peer": W1, "tokens": 4096, "accepted": true, "reason": ""});
        s.apply_named("contribution_received", &sent, T0 + 2_000);
        let row = &s.workers[W1];
        assert_eq!(row.status, Status::Training, "it trains round 2 now");
        assert_eq!(row.tokens_per_s, Some(2048.0), "4096 tokens in the 2 s of round 1");
        assert_eq!(row.last, Some(Verdict { round: 1, accepted: Some(true), reason: String::new() }));
        // the last round: its last contributor is done, not missing
        s.apply_named("round_completed", &json!({"round": 2, "peers": [W1], "mean_loss": 2.0}), T0 + 4_000);
        assert_eq!(s.workers[W1].status, Status::Sent);
    }

    #[test]
    fn sim_rows_follow_node_numbers_and_kills() {
        let mut s = shepherd(Mode::Sim);
        assert_eq!(s.worker_rows()[0].node, Some(1));
        assert_eq!(s.addrs.get(W1).map(String::as_str), Some("/ip4/127.0.0.1/tcp/40123"), "listening wins");
        assert_eq!(s.me.as_deref(), Some(W3));
        s.apply_named("worker_killed", &json!({"round": 3, "worker": 2}), T0 + 60_000);
        s.apply_named("worker_left", &json!({"peer": W2, "reason": "heartbeat timeout"}), T0 + 65_000);
        assert_eq!(s.workers[W2].status, Status::Killed);
        s.apply_named(
            "round_completed",
            &json!({"round": 3, "contributors": 1, "peers": [W1], "excluded": [W2], "mean_loss": 3.0}),
            T0 + 66_000,
        );
        assert_eq!(s.phase, Phase::Finished, "the last of 3 rounds");
        // a worker's run_finished does not end the shepherd's run early, and a
        // worker's events do not show on the shepherd's dashboard
        let mut t = shepherd(Mode::Sim);
        t.apply_named("run_finished", &json!({"run": RUN, "rounds": 3}), T0 + 70_000);
        t.apply_named("contribution_sent", &json!({"round": 3, "accepted": true, "bytes": 5}), T0 + 70_000);
        assert_eq!(t.phase, Phase::Training(3));
        assert!(t.mine.recent.is_empty());
        t.apply_named("run_finished", &json!({"rounds": 3, "val_loss": 2.0}), T0 + 70_000);
        assert_eq!(t.phase, Phase::Finished);
    }

    /// A worker that contributed two rounds (one rejected) and trains a third.
    pub(crate) fn worker() -> State {
        let mut f = Feed { s: State::new(Mode::Worker), at: T0 };
        f.e("listening", json!({"peer": W1, "addr": "/ip4/192.168.1.20/udp/4001/quic-v1"}), 0);
        f.e("peer_connected", json!({"peer": W3, "addr": "/ip4/203.0.113.5/udp/4001/quic-v1"}), 100);
        f.e("blob_fetched", json!({"bytes": 2_500_000, "seconds": 0.5}), 500);
        f.e("blob_fetched", json!({"bytes": 1_100_000, "seconds": 0.2}), 200);
        let joined = json!({"run": RUN, "shepherd": W3, "backend": "cuda", "target": "sm_90", "rounds": 20, "tau": 50});
        f.e("run_joined", joined, 100);
        for round in 1..=2u64 {
            let deadline = f.at + 30_000;
            f.e("round_announced", json!({"round": round, "deadline_unix_ms": deadline, "participant": true}), 0);
            f.e("blob_fetched", json!({"bytes": 441_856, "seconds": 0.1}), 200);
            let (accepted, reason) =
                if round == 2 { (false, "norm 9.1 above the round's bound 3.0") } else { (true, "") };
            let sent = json!({"round": round, "loss": 3.9 - 0.3 * round as f64, "bytes": 442_000,
                "tokens": 40_960, "seconds": 4.0, "accepted": accepted, "reason": reason});
            f.e("contribution_sent", sent, 4_500);
        }
        let deadline = f.at + 30_000;
        f.e("round_announced", json!({"round": 3, "deadline_unix_ms": deadline, "participant": true}), 0);
        f.s.tick(f.at + 12_000);
        f.s
    }

    #[test]
    fn a_worker_counts_its_contributions() {
        let s = worker();
        assert_eq!(s.phase, Phase::Training(3));
        assert_eq!((s.mine.accepted, s.mine.rejected, s.mine.tokens), (1, 1, 81_920));
        assert_eq!(s.mine.recent[0].tokens_per_s, Some(10_240.0));
        assert_eq!(s.mine.recent[1].outcome, Outcome::Rejected("norm 9.1 above the round's bound 3.0".into()));
        assert_eq!(s.traffic.total_in, 2_500_000 + 1_100_000 + 2 * 441_856);
        assert_eq!(s.traffic.total_out, 884_000);
        assert_eq!(s.backend.as_deref(), Some("cuda:sm_90"));
        assert!((s.round_progress().expect("open") - 0.4).abs() < 1e-9);
    }

    #[test]
    fn memory_is_bounded() {
        let mut s = State::new(Mode::Shepherd);
        for round in 1..=(MAX_ROUNDS as u64 + 20) {
            s.apply_named("round_completed", &json!({"round": round, "mean_loss": 1.0}), T0 + round);
        }
        assert_eq!(s.rounds.len(), MAX_ROUNDS);
        assert_eq!(s.rounds.front().map(|r| r.round), Some(21));
        for i in 0..(MAX_WORKERS + 10) {
            let peer = format!("peer-{i}");
            s.apply_named("worker_joined", &json!({"peer": peer, "backend": "cpu"}), T0);
            if i % 2 == 0 {
                s.apply_named("worker_left", &json!({"peer": peer, "reason": "left"}), T0);
            }
        }
        assert_eq!(s.workers.len(), MAX_WORKERS);
        assert!(s.workers.contains_key(&format!("peer-{}", MAX_WORKERS + 9)), "a newcomer replaces a leaver");
        for i in 0..(MAX_PEERS + 10) {
            s.apply_named("peer_connected", &json!({"peer": format!("p{i}"), "addr": "/ip4/1.2.3.4/tcp/1"}), T0);
        }
        assert!(s.peers.len() <= MAX_PEERS && s.addrs.len() <= MAX_PEERS);
    }
}
