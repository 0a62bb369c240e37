//! The shepherd's state machine: `handle(input, now_ms) -> actions`.
//!
//! Rounds: the shepherd opens round r for the workers alive at that moment
//! (a worker that joins mid-round starts at the next one) with a deadline,
//! accepts one validated contribution per participant, and closes the round
//! when every live participant has answered, or at the deadline once a
//! quorum has. Each accepted contribution is bounded in norm and added to a
//! running sample-weighted sum as it arrives ([`RunningMean`]); closing applies
//! the outer step: Nesterov for dense encodings, and for sparse ones
//! SparseLoCo's plain averaged step, re-sparsified through the shepherd's own
//! error feedback so that the update it publishes is sparse too. Workers silent
//! for longer than the heartbeat timeout are dropped and no longer waited for.
//!
//! The norm bound cannot wait for the round's median without keeping every
//! contribution, so each contribution is held to the bound in force when it
//! arrives: the norm factor × the lower median of the norms accepted in the
//! previous round and so far in this one ([`running_bound`]). The first round
//! of a run, with no previous norms, holds its first contribution until a
//! second arrives. With `trim`, every contribution is held until the round
//! closes (the trimmed mean needs them all); sparse runs refuse `trim`.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use super::Tensors;
use super::aggregate::{Accepted, Delta, Rejection, RunningMean, norm_bound, running_bound, trimmed_mean};
use super::outer::Nesterov;
use super::sparse::{self, ErrorFeedback, Settings};

/// Shepherd settings.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    /// Rounds to run.
    pub rounds: u64,
    /// Workers that must have joined before the first round opens (after a
    /// resume: before the first round it opens, or `resume_grace_ms` after its
    /// first input, whichever comes first).
    pub start_workers: usize,
    /// How long a resumed shepherd waits for `start_workers` to come back.
    pub resume_grace_ms: u64,
    /// Contributions needed to close a round at its deadline.
    pub min_quorum: usize,
    /// The deadline of the first rounds, before any durations are known.
    pub initial_deadline_ms: u64,
    /// Lower bound on an adaptive deadline.
    pub min_deadline_ms: u64,
    /// Upper bound on an adaptive deadline.
    pub max_deadline_ms: u64,
    /// Deadline = factor × median duration of recent rounds.
    pub deadline_factor: f64,
    /// Recent rounds the median looks at.
    pub deadline_window: usize,
    /// Drop a worker not heard from for this long.
    pub heartbeat_timeout_ms: u64,
    /// Outer learning rate.
    pub outer_lr: f32,
    /// Outer Nesterov momentum.
    pub outer_momentum: f32,
    /// Contribution norms are bounded to factor × the lower median of recent
    /// norms (1.0: a ×1000 worker counts no more than a typical one).
    pub norm_factor: f64,
    /// With 3 or more contributions, aggregate by the coordinate-wise mean
    /// trimmed by this fraction at each end ([`trimmed_mean`]) instead of the
    /// sample-weighted mean; 0 (the default) keeps the weighted mean.
    pub trim: f64,
    /// A sparse run: contributions are sparse, the outer step is
    /// θ ← θ − Û where Û is the chunked top-k of the shepherd's error feedback
    /// plus `outer_lr` × the mean (no momentum), published as the round's update.
    pub sparse: Option<Settings>,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            rounds: 10,
            start_workers: 1,
            resume_grace_ms: 5_000,
            min_quorum: 1,
            initial_deadline_ms: 120_000,
            min_deadline_ms: 5_000,
            max_deadline_ms: 600_000,
            deadline_factor: 2.0,
            deadline_window: 5,
            heartbeat_timeout_ms: 15_000,
            outer_lr: 0.7,
            outer_momentum: 0.9,
            norm_factor: 1.0,
            trim: 0.0,
            sparse: None,
        }
    }
}

/// What happens to the shepherd.
#[derive(Clone, Debug, PartialEq)]
pub enum Input<P> {
    /// A worker asked to join.
    Joined(P),
    /// A worker said goodbye (or its connection closed for good).
    Left(P),
    /// A worker is alive.
    Heartbeat(P),
    /// A verified, decoded contribution.
    Contribution {
        /// Who sent it (the envelope's signer).
        peer: P,
        /// The round it claims.
        round: u64,
        /// Samples (tokens) trained on.
        samples: u64,
        /// The worker's mean inner loss.
        loss: f32,
        /// θ_start − θ_end, dense or sparse.
        delta: Delta,
    },
    /// A contribution that could not even be decoded or verified.
    Malformed {
        /// Who sent it.
        peer: P,
        /// The round it claims.
        round: u64,
        /// Why.
        reason: Rejection,
    },
    /// Time passed.
    Tick,
}

/// A closed round.
#[derive(Clone, Debug, PartialEq)]
pub struct RoundSummary<P> {
    /// The round.
    pub round: u64,
    /// Who contributed.
    pub contributors: Vec<P>,
    /// Participants who did not contribute by the deadline.
    pub excluded: Vec<P>,
    /// Sample-weighted mean of the workers' inner losses.
    pub mean_loss: f64,
    /// Contributions scaled down by the norm bound.
    pub clipped: usize,
    /// The contributions scaled down to the norm bound, each with its norm.
    pub scaled: Vec<(P, f64)>,
    /// The norm bound used.
    pub norm_bound: f64,
    /// From opening to closing.
    pub duration_ms: u64,
    /// A sparse run's update (θ_before − θ_after, [`sparse`] format), to publish.
    pub update: Option<Vec<u8>>,
}

/// Why a worker left.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LeaveReason {
    /// It said so.
    Left,
    /// No heartbeat within the timeout.
    Timeout,
}

/// What the shepherd asks its host to do.
#[derive(Clone, Debug, PartialEq)]
pub enum Action<P> {
    /// Publish the parameters and announce `round` to `participants`.
    OpenRound {
        /// The round.
        round: u64,
        /// Unix milliseconds.
        deadline_ms: u64,
        /// Who is expected to contribute.
        participants: Vec<P>,
    },
    /// A contribution was refused (for the events stream).
    Rejected {
        /// From whom.
        peer: P,
        /// For which round.
        round: u64,
        /// Why.
        reason: Rejection,
    },
    /// A round closed and the parameters moved: checkpoint now.
    RoundCompleted(RoundSummary<P>),
    /// A new worker.
    WorkerJoined(P),
    /// A worker is gone.
    WorkerLeft {
        /// Who.
        peer: P,
        /// Why.
        reason: LeaveReason,
    },
    /// The round deadline passed below quorum and was extended.
    DeadlineExtended {
        /// The round.
        round: u64,
        /// The new deadline.
        deadline_ms: u64,
    },
    /// Every round is done.
    Finished,
}

/// An accepted contribution, once added to the round's sum.
#[derive(Clone, Debug, PartialEq)]
struct Entry {
    samples: u64,
    loss: f32,
    norm: f64,
}

#[derive(Clone, Debug, PartialEq)]
struct OpenRound<P> {
    started_ms: u64,
    deadline_ms: u64,
    participants: BTreeSet<P>,
    answered: BTreeSet<P>,
    accepted: BTreeMap<P, Entry>,
    /// The raw norms accepted so far.
    norms: Vec<f64>,
    /// The bounded, weighted sum of what was added.
    mean: RunningMean,
    /// Contributions not added yet: the first of a run (no bound yet), or all of
    /// them with the trimmed mean.
    held: Vec<(P, Delta)>,
    /// Contributions scaled down to the bound, with their norms.
    scaled: Vec<(P, f64)>,
    /// The last bound applied.
    bound: f64,
}

/// The outer optimizer.
#[derive(Clone, Debug, PartialEq)]
enum Outer {
    /// DiLoCo's Nesterov step on the mean.
    Nesterov(Nesterov),
    /// SparseLoCo: θ ← θ − Û, Û the sparse top-k of the error feedback plus lr × the mean.
    Sparse {
        /// The outer learning rate.
        lr: f32,
        /// The shepherd's error feedback (decay 1) in the update's layout.
        feedback: ErrorFeedback,
    },
}

impl Outer {
    /// Nesterov's velocity, or the sparse error feedback: what a snapshot keeps.
    fn state(&self) -> &Tensors {
        match self {
            Self::Nesterov(n) => &n.velocity,
            Self::Sparse { feedback, .. } => &feedback.buffer,
        }
    }

    fn state_mut(&mut self) -> &mut Tensors {
        match self {
            Self::Nesterov(n) => &mut n.velocity,
            Self::Sparse { feedback, .. } => &mut feedback.buffer,
        }
    }

    /// Applies `round`'s mean; returns the sparse update (seeded with the round), if any.
    fn step(&mut self, params: &mut Tensors, mean: &Tensors, round: u64) -> Option<Vec<u8>> {
        match self {
            Self::Nesterov(n) => {
                n.step(params, mean);
                None
            }
            Self::Sparse { lr, feedback } => {
                let (bytes, sent) = feedback.compress_seeded(mean, *lr, round);
                sparse::subtract(params, &sent, 1.0);
                Some(bytes)
            }
        }
    }
}

/// Everything needed to resume a shepherd after its last completed round.
#[derive(Clone, Debug, PartialEq)]
pub struct Snapshot {
    /// Rounds completed.
    pub completed: u64,
    /// Current parameters.
    pub params: Tensors,
    /// Outer momentum (a sparse run: the shepherd's error feedback).
    pub velocity: Tensors,
    /// Recent round durations.
    pub durations: Vec<u64>,
    /// The norms accepted in the last round that accepted any (the next
    /// round's norm bound).
    pub norms: Vec<f64>,
}

/// The shepherd.
#[derive(Clone, Debug)]
pub struct Shepherd<P> {
    config: Config,
    sizes: Vec<usize>,
    params: Tensors,
    outer: Outer,
    completed: u64,
    open: Option<OpenRound<P>>,
    finished: bool,
    workers: BTreeMap<P, u64>,
    /// No worker was last seen before this: `expire` scans only once one may
    /// have timed out, so an input costs O(log workers), not O(workers).
    earliest_seen: u64,
    durations: VecDeque<u64>,
    norms: VecDeque<f64>,
    /// Rounds completed when this shepherd started (non-zero after a resume).
    resumed_at: u64,
    /// The time of the first input.
    first_input_ms: Option<u64>,
}

impl<P: Ord + Clone> Shepherd<P> {
    /// A shepherd starting from `params`.
    pub fn new(config: Config, params: Tensors) -> Self {
        let sizes: Vec<usize> = params.iter().map(Vec::len).collect();
        let outer = match config.sparse {
            Some(s) => Outer::Sparse { lr: config.outer_lr, feedback: ErrorFeedback::new(&sizes, 1.0, s.down()) },
            None => Outer::Nesterov(Nesterov::new(config.outer_lr, config.outer_momentum, &params)),
        };
        Self {
            config,
            sizes,
            params,
            outer,
            completed: 0,
            open: None,
            finished: false,
            workers: BTreeMap::new(),
            earliest_seen: u64::MAX,
            durations: VecDeque::new(),
            norms: VecDeque::new(),
            resumed_at: 0,
            first_input_ms: None,
        }
    }

    /// Resumes from a snapshot taken after a completed round.
    pub fn resume(config: Config, snapshot: Snapshot) -> Self {
        let mut s = Self::new(config, snapshot.params);
        *s.outer.state_mut() = snapshot.velocity;
        s.completed = snapshot.completed;
        s.resumed_at = snapshot.completed;
        s.durations = snapshot.durations.into();
        s.norms = snapshot.norms.into();
        s.finished = s.completed >= s.config.rounds;
        s
    }

    /// The state after the last completed round.
    pub fn snapshot(&self) -> Snapshot {
        Snapshot {
            completed: self.completed,
            params: self.params.clone(),
            velocity: self.outer.state().clone(),
            durations: self.durations.iter().copied().collect(),
            norms: self.norms.iter().copied().collect(),
        }
    }

    /// Current parameters.
    pub fn params(&self) -> &Tensors {
        &self.params
    }

    /// Moves the open round's deadline `by_ms` later, and returns it: a host that
    /// held the round's announcement back (until the candidates hold the state it
    /// names) gives its workers the time it waited.
    pub fn postpone(&mut self, by_ms: u64) -> Option<u64> {
        let open = self.open.as_mut()?;
        open.deadline_ms = open.deadline_ms.saturating_add(by_ms);
        Some(open.deadline_ms)
    }

    /// The open round, if any.
    pub fn open_round(&self) -> Option<u64> {
        self.open.as_ref().map(|_| self.completed + 1)
    }

    /// Rounds completed.
    pub fn completed(&self) -> u64 {
        self.completed
    }

    /// Live workers.
    pub fn workers(&self) -> impl Iterator<Item = &P> {
        self.workers.keys()
    }

    /// Whether every round is done.
    pub fn is_finished(&self) -> bool {
        self.finished
    }

    /// Advances the state machine.
    pub fn handle(&mut self, input: Input<P>, now_ms: u64) -> Vec<Action<P>> {
        let mut actions = Vec::new();
        self.first_input_ms.get_or_insert(now_ms);
        match input {
            Input::Joined(peer) => {
                self.earliest_seen = self.earliest_seen.min(now_ms);
                if self.workers.insert(peer.clone(), now_ms).is_none() {
                    actions.push(Action::WorkerJoined(peer));
                }
            }
            Input::Heartbeat(peer) => {
                if let Some(seen) = self.workers.get_mut(&peer) {
                    *seen = now_ms;
                }
            }
            Input::Left(peer) => self.remove(peer, LeaveReason::Left, &mut actions),
            Input::Contribution { peer, round, samples, loss, delta } => {
                if let Some(seen) = self.workers.get_mut(&peer) {
                    *seen = now_ms;
                }
                let result = self.admit(&peer, round).and_then(|()| {
                    if samples == 0 {
                        return Err(Rejection::NoSamples);
                    }
                    delta.validate(&self.sizes)
                });
                match result {
                    Ok(norm) => self.accept(peer, Entry { samples, loss, norm }, delta),
                    Err(reason) => self.reject(peer, round, reason, &mut actions),
                }
            }
            Input::Malformed { peer, round, reason } => self.reject(peer, round, reason, &mut actions),
            Input::Tick => {}
        }
        self.expire(now_ms, &mut actions);
        self.progress(now_ms, &mut actions);
        actions
    }

    /// Adds a validated contribution to the open round's sum, or holds it while
    /// the round has no bound yet (or for the trimmed mean).
    fn accept(&mut self, peer: P, entry: Entry, delta: Delta) {
        let previous: Vec<f64> = self.norms.iter().copied().collect();
        let (factor, trim) = (self.config.norm_factor, self.config.trim > 0.0);
        let Some(open) = self.open.as_mut() else { return };
        open.answered.insert(peer.clone());
        open.norms.push(entry.norm);
        open.accepted.insert(peer.clone(), entry);
        open.held.push((peer, delta));
        if !trim && let Some(bound) = running_bound(&previous, &open.norms, factor) {
            Self::flush(open, bound, &self.sizes);
        }
    }

    /// Adds every held contribution to the sum, bounded by `bound`.
    fn flush(open: &mut OpenRound<P>, bound: f64, sizes: &[usize]) {
        open.bound = bound;
        for (peer, delta) in std::mem::take(&mut open.held) {
            let Some(e) = open.accepted.get(&peer) else { continue };
            if open.mean.add(&delta, e.samples, e.norm, bound, sizes) {
                open.scaled.push((peer, e.norm));
            }
        }
    }

    fn reject(&mut self, peer: P, round: u64, reason: Rejection, actions: &mut Vec<Action<P>>) {
        // A participant whose answer was refused is not waited for again.
        let current = self.completed + 1;
        if let Some(open) = self.open.as_mut().filter(|o| round == current && o.participants.contains(&peer)) {
            open.answered.insert(peer.clone());
        }
        actions.push(Action::Rejected { peer, round, reason });
    }

    fn admit(&self, peer: &P, round: u64) -> Result<(), Rejection> {
        let current = self.completed + 1;
        if round <= self.completed {
            return Err(Rejection::Late { round });
        }
        let Some(open) = self.open.as_ref().filter(|_| round == current) else {
            return Err(Rejection::WrongRound { got: round, current });
        };
        if !open.participants.contains(peer) {
            return Err(Rejection::NotParticipant { round });
        }
        if open.answered.contains(peer) {
            return Err(Rejection::Duplicate { round });
        }
        Ok(())
    }

    fn remove(&mut self, peer: P, reason: LeaveReason, actions: &mut Vec<Action<P>>) {
        if self.workers.remove(&peer).is_some() {
            actions.push(Action::WorkerLeft { peer, reason });
        }
    }

    fn expire(&mut self, now_ms: u64, actions: &mut Vec<Action<P>>) {
        let timeout = self.config.heartbeat_timeout_ms;
        if now_ms.saturating_sub(self.earliest_seen) <= timeout {
            return;
        }
        let dead: Vec<P> = self
            .workers
            .iter()
            .filter(|(_, seen)| now_ms.saturating_sub(**seen) > timeout)
            .map(|(p, _)| p.clone())
            .collect();
        self.earliest_seen = self
            .workers
            .iter()
            .filter(|(_, seen)| now_ms.saturating_sub(**seen) <= timeout)
            .map(|(_, seen)| *seen)
            .min()
            .unwrap_or(u64::MAX);
        for peer in dead {
            self.remove(peer, LeaveReason::Timeout, actions);
        }
    }

    fn deadline(&self) -> u64 {
        if self.durations.is_empty() {
            return self.config.initial_deadline_ms;
        }
        let mut recent: Vec<u64> = self.durations.iter().copied().collect();
        recent.sort_unstable();
        let median = recent[recent.len() / 2] as f64;
        ((self.config.deadline_factor * median) as u64).clamp(self.config.min_deadline_ms, self.config.max_deadline_ms)
    }

    fn progress(&mut self, now_ms: u64, actions: &mut Vec<Action<P>>) {
        if self.finished {
            return;
        }
        if let Some(open) = &self.open {
            let waiting = open.participants.iter().any(|p| self.workers.contains_key(p) && !open.answered.contains(p));
            let quorum = open.accepted.len() >= self.config.min_quorum.max(1);
            // everyone answered: close, even with every contribution rejected (the
            // round then leaves the parameters as they were and the run goes on)
            if !waiting && !open.answered.is_empty() || now_ms >= open.deadline_ms && quorum {
                self.close(now_ms, actions);
            } else if now_ms >= open.deadline_ms {
                let extended = now_ms + self.deadline();
                let round = self.completed + 1;
                if let Some(open) = self.open.as_mut() {
                    open.deadline_ms = extended;
                }
                actions.push(Action::DeadlineExtended { round, deadline_ms: extended });
            }
        }
        let waiting_for_start = if self.completed == 0 {
            true
        } else {
            let since = now_ms.saturating_sub(self.first_input_ms.unwrap_or(now_ms));
            self.completed == self.resumed_at && since < self.config.resume_grace_ms
        };
        let enough = if waiting_for_start { self.config.start_workers.max(1) } else { 1 };
        if self.open.is_none() && !self.finished && self.workers.len() >= enough {
            let deadline_ms = now_ms + self.deadline();
            let participants: BTreeSet<P> = self.workers.keys().cloned().collect();
            actions.push(Action::OpenRound {
                round: self.completed + 1,
                deadline_ms,
                participants: participants.iter().cloned().collect(),
            });
            self.open = Some(OpenRound {
                started_ms: now_ms,
                deadline_ms,
                participants,
                answered: BTreeSet::new(),
                accepted: BTreeMap::new(),
                norms: Vec::new(),
                mean: RunningMean::default(),
                held: Vec::new(),
                scaled: Vec::new(),
                bound: f64::INFINITY,
            });
        }
    }

    fn close(&mut self, now_ms: u64, actions: &mut Vec<Action<P>>) {
        let Some(mut open) = self.open.take() else { return };
        let round = self.completed + 1;
        let peers: Vec<P> = open.accepted.keys().cloned().collect();
        let samples: u64 = open.accepted.values().map(|e| e.samples).sum();
        let mean_loss =
            open.accepted.values().map(|e| f64::from(e.loss) * e.samples as f64).sum::<f64>() / samples.max(1) as f64;
        let previous: Vec<f64> = self.norms.iter().copied().collect();
        let bound = norm_bound(&previous, &open.norms, self.config.norm_factor);
        let mean = if self.config.trim > 0.0 && open.held.len() >= 3 {
            // the trimmed mean: every contribution was held
            let mut held = Vec::with_capacity(open.held.len());
            for (p, d) in std::mem::take(&mut open.held) {
                let Some(e) = open.accepted.get(&p) else { continue };
                if e.norm > bound {
                    open.scaled.push((p, e.norm));
                }
                held.push(Accepted { samples: e.samples, delta: d.to_dense(&self.sizes), norm: e.norm });
            }
            open.bound = bound;
            Some(trimmed_mean(&held, bound, self.config.trim).0)
        } else {
            if !open.held.is_empty() {
                // held until the close: bounded by all of this round's norms (one alone: its own)
                Self::flush(&mut open, bound, &self.sizes);
            }
            std::mem::take(&mut open.mean).finish()
        };
        let update = mean.and_then(|mean| self.outer.step(&mut self.params, &mean, round));
        self.completed = round;
        let duration_ms = now_ms.saturating_sub(open.started_ms);
        self.durations.push_back(duration_ms);
        while self.durations.len() > self.config.deadline_window.max(1) {
            self.durations.pop_front();
        }
        if !open.norms.is_empty() {
            self.norms = open.norms.iter().copied().take(MAX_NORMS).collect();
        }
        let excluded = open.participants.iter().filter(|p| !peers.contains(p)).cloned().collect();
        actions.push(Action::RoundCompleted(RoundSummary {
            round,
            contributors: peers,
            excluded,
            mean_loss,
            clipped: open.scaled.len(),
            scaled: open.scaled,
            norm_bound: open.bound,
            duration_ms,
            update,
        }));
        if self.completed >= self.config.rounds {
            self.finished = true;
            actions.push(Action::Finished);
        }
    }
}

/// Norms a round keeps for the next round's bound.
const MAX_NORMS: usize = 4096;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_resumed_shepherd_waits_a_grace_period_for_its_workers() {
        let cfg = Config { start_workers: 2, resume_grace_ms: 1000, ..config() };
        let mut first = Shepherd::new(cfg.clone(), vec![vec![0.0, 0.0]]);
        first.handle(Input::Joined(1), 0);
        assert!(opened(&first.handle(Input::Joined(2), 0)).is_some());
        first.handle(contribution(1, 1, 1.0), 10);
        assert!(completed(&first.handle(contribution(2, 1, 1.0), 10)).is_some());

        // both workers come back: the round opens as soon as they have
        let mut s = Shepherd::<u32>::resume(cfg.clone(), first.snapshot());
        assert!(opened(&s.handle(Input::Joined(1), 100)).is_none(), "waits for the second worker");
        assert_eq!(opened(&s.handle(Input::Joined(2), 200)), Some((2, vec![1, 2])));

        // only one comes back: the round opens once the grace period is over
        let mut s = Shepherd::<u32>::resume(cfg, first.snapshot());
        assert!(opened(&s.handle(Input::Joined(1), 100)).is_none());
        assert!(opened(&s.handle(Input::Heartbeat(1), 500)).is_none());
        assert!(opened(&s.handle(Input::Heartbeat(1), 1099)).is_none());
        assert_eq!(opened(&s.handle(Input::Heartbeat(1), 1100)), Some((2, vec![1])));
    }

    fn config() -> Config {
        Config {
            rounds: 3,
            initial_deadline_ms: 1000,
            min_deadline_ms: 100,
            heartbeat_timeout_ms: 500,
            outer_lr: 1.0,
            outer_momentum: 0.0,
            ..Config::default()
        }
    }

    fn contribution(peer: u32, round: u64, v: f32) -> Input<u32> {
        Input::Contribution { peer, round, samples: 10, loss: 2.0, delta: Delta::Dense(vec![vec![v, v]]) }
    }

    fn opened(actions: &[Action<u32>]) -> Option<(u64, Vec<u32>)> {
        actions.iter().find_map(|a| match a {
            Action::OpenRound { round, participants, .. } => Some((*round, participants.clone())),
            _ => None,
        })
    }

    fn completed(actions: &[Action<u32>]) -> Option<RoundSummary<u32>> {
        actions.iter().find_map(|a| match a {
            Action::RoundCompleted(s) => Some(s.clone()),
            _ => None,
        })
    }

    #[test]
    fn a_round_whose_every_contribution_is_rejected_closes_unchanged() {
        let mut s = Shepherd::new(Config { start_workers: 2, ..config() }, vec![vec![1.0, 1.0]]);
        s.handle(Input::Joined(1), 0);
        s.handle(Input::Joined(2), 0);
        let rejected = |peer| Input::Malformed { peer, round: 1, reason: Rejection::NoSamples };
        assert!(completed(&s.handle(rejected(1), 10)).is_none(), "worker 2 has not answered");
        let a = s.handle(rejected(2), 20);
        let summary = completed(&a).expect("everyone answered: the round closes instead of waiting forever");
        assert!(summary.contributors.is_empty());
        assert_eq!(summary.excluded, vec![1, 2]);
        assert_eq!(s.params(), &vec![vec![1.0, 1.0]], "nothing accepted, nothing moved");
        assert_eq!(opened(&a), Some((2, vec![1, 2])));
        // momentum from an earlier round does not move an empty one either
        s.handle(contribution(1, 2, 0.5), 30);
        completed(&s.handle(contribution(2, 2, 0.5), 40)).expect("round 2");
        let after_two = s.params().clone();
        s.handle(Input::Malformed { peer: 1, round: 3, reason: Rejection::NoSamples }, 50);
        completed(&s.handle(Input::Malformed { peer: 2, round: 3, reason: Rejection::NoSamples }, 60))
            .expect("round 3");
        assert_eq!(s.params(), &after_two);
    }

    #[test]
    fn rounds_average_contributions_and_finish() {
        // No norm bound: this test is about averaging and round mechanics.
        let mut s = Shepherd::new(Config { norm_factor: f64::INFINITY, ..config() }, vec![vec![1.0, 1.0]]);
        assert_eq!(opened(&s.handle(Input::Joined(1), 0)), Some((1, vec![1])));
        // Worker 2 joins mid-round: it starts at round 2.
        s.handle(Input::Joined(2), 10);
        let a = s.handle(contribution(1, 1, 0.5), 20);
        let summary = completed(&a).expect("round 1 closes: its only participant answered");
        assert_eq!(summary.contributors, vec![1]);
        assert_eq!(s.params(), &vec![vec![0.5, 0.5]]);
        assert_eq!(opened(&a), Some((2, vec![1, 2])));
        s.handle(contribution(1, 2, 0.1), 30);
        assert_eq!(s.open_round(), Some(2), "still waiting for worker 2");
        let a = s.handle(contribution(2, 2, 0.3), 40);
        assert_eq!(completed(&a).map(|c| c.contributors), Some(vec![1, 2]));
        assert!((s.params()[0][0] - 0.3).abs() < 1e-6);
        s.handle(contribution(1, 3, 0.0), 50);
        let a = s.handle(contribution(2, 3, 0.0), 60);
        assert!(a.contains(&Action::Finished));
        assert!(s.is_finished());
    }

    #[test]
    fn dead_worker_is_excluded_at_the_deadline() {
        // A long minimum deadline: the heartbeat timeout, not the deadline, ends round 2.
        let mut s =
            Shepherd::new(Config { start_workers: 2, min_deadline_ms: 5_000, ..config() }, vec![vec![0.0, 0.0]]);
        s.handle(Input::Joined(1), 0);
        s.handle(Input::Joined(2), 0);
        s.handle(contribution(1, 1, 0.2), 10);
        s.handle(contribution(2, 1, 0.2), 10);
        // Round 2: worker 2 dies (no more heartbeats).
        s.handle(Input::Heartbeat(1), 300);
        s.handle(contribution(1, 2, 0.1), 400);
        assert_eq!(s.open_round(), Some(2));
        let a = s.handle(Input::Tick, 700);
        assert!(a.contains(&Action::WorkerLeft { peer: 2, reason: LeaveReason::Timeout }));
        let summary = completed(&a).expect("closes once the dead worker is dropped");
        assert_eq!((summary.contributors, summary.excluded), (vec![1], vec![2]));
    }

    #[test]
    fn every_silent_worker_expires_once_its_own_timeout_passes() {
        // timeout 500: 1 goes silent at 0, 2 at 400, 3 keeps heartbeating
        let mut s = Shepherd::new(Config { start_workers: 3, ..config() }, vec![vec![0.0, 0.0]]);
        for p in 1..=3 {
            s.handle(Input::Joined(p), 0);
        }
        s.handle(Input::Heartbeat(2), 400);
        s.handle(Input::Heartbeat(3), 400);
        let a = s.handle(Input::Heartbeat(3), 501);
        assert_eq!(a, vec![Action::WorkerLeft { peer: 1, reason: LeaveReason::Timeout }]);
        s.handle(Input::Heartbeat(3), 800);
        assert!(s.handle(Input::Tick, 900).is_empty(), "2 was seen at 400");
        let a = s.handle(Input::Tick, 901);
        assert!(a.contains(&Action::WorkerLeft { peer: 2, reason: LeaveReason::Timeout }), "{a:?}");
        assert_eq!(s.workers().copied().collect::<Vec<_>>(), vec![3]);
    }

    #[test]
    fn deadline_closes_with_quorum_and_stragglers_are_late() {
        let mut cfg = config();
        cfg.heartbeat_timeout_ms = 10_000;
        cfg.start_workers = 2;
        let mut s = Shepherd::new(cfg, vec![vec![0.0, 0.0]]);
        s.handle(Input::Joined(1), 0);
        s.handle(Input::Joined(2), 0);
        s.handle(contribution(1, 1, 0.2), 100);
        assert!(completed(&s.handle(Input::Tick, 999)).is_none());
        let a = s.handle(Input::Tick, 1000);
        assert_eq!(completed(&a).map(|c| c.excluded), Some(vec![2]));
        let a = s.handle(contribution(2, 1, 0.2), 1100);
        assert!(a.contains(&Action::Rejected { peer: 2, round: 1, reason: Rejection::Late { round: 1 } }));
    }

    #[test]
    fn hostile_contributions_are_rejected_or_bounded() {
        let mut s = Shepherd::new(Config { start_workers: 4, ..config() }, vec![vec![0.0, 0.0]]);
        for p in 1..=4 {
            s.handle(Input::Joined(p), 0);
        }
        let nan = s.handle(
            Input::Contribution {
                peer: 4,
                round: 1,
                samples: 10,
                loss: 1.0,
                delta: Delta::Dense(vec![vec![f32::NAN, 0.0]]),
            },
            1,
        );
        assert!(matches!(nan[0], Action::Rejected { reason: Rejection::NonFinite { index: 0 }, .. }));
        let shape = s.handle(
            Input::Contribution { peer: 3, round: 1, samples: 10, loss: 1.0, delta: vec![vec![0.0]].into() },
            1,
        );
        assert!(matches!(shape[0], Action::Rejected { reason: Rejection::Shape { .. }, .. }));
        let wrong_round = s.handle(contribution(1, 7, 0.1), 1);
        assert!(matches!(
            wrong_round[0],
            Action::Rejected { reason: Rejection::WrongRound { got: 7, current: 1 }, .. }
        ));
        let stranger = s.handle(contribution(9, 1, 0.1), 1);
        assert!(matches!(stranger[0], Action::Rejected { reason: Rejection::NotParticipant { round: 1 }, .. }));
        s.handle(contribution(1, 1, 0.1), 2);
        let dup = s.handle(contribution(1, 1, 0.1), 2);
        assert!(matches!(dup[0], Action::Rejected { reason: Rejection::Duplicate { round: 1 }, .. }));
        // Round 2 everyone honest but 4, which scales its update ×1000.
        let a = s.handle(contribution(2, 1, 0.1), 3);
        assert!(completed(&a).is_some(), "rejected participants are not waited for");
        for p in 1..=3 {
            s.handle(contribution(p, 2, 0.1), 10);
        }
        let a = s.handle(contribution(4, 2, 100.0), 11);
        let summary = completed(&a).expect("round 2");
        assert_eq!(summary.clipped, 1);
        assert_eq!(summary.scaled.len(), 1, "the scaled contribution is named: {:?}", summary.scaled);
        assert!(s.params()[0][0].abs() < 0.6, "bounded: {}", s.params()[0][0]);
    }

    #[test]
    fn deadlines_adapt_to_recent_rounds() {
        let mut s = Shepherd::new(config(), vec![vec![0.0, 0.0]]);
        s.handle(Input::Joined(1), 0);
        let a = s.handle(contribution(1, 1, 0.0), 200);
        // Round 1 took 200 ms: round 2's deadline is 2 × 200 after it opens.
        assert!(a.iter().any(|x| matches!(x, Action::OpenRound { round: 2, deadline_ms: 600, .. })), "{a:?}");
    }

    #[test]
    fn snapshot_resumes_identically() {
        let mut cfg = config();
        cfg.outer_momentum = 0.9;
        let mut s = Shepherd::new(cfg.clone(), vec![vec![1.0, 2.0]]);
        s.handle(Input::Joined(1), 0);
        s.handle(contribution(1, 1, 0.3), 5);
        let snap = s.snapshot();
        let mut r = Shepherd::<u32>::resume(cfg, snap.clone());
        assert_eq!(r.snapshot(), snap);
        r.handle(Input::Joined(1), 10);
        s.handle(contribution(1, 2, 0.2), 10);
        assert_eq!(r.open_round(), Some(2));
        r.handle(contribution(1, 2, 0.2), 10);
        assert_eq!(r.params(), s.params());
    }
}
