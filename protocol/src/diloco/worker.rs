//! The worker's state machine: fetch the round's parameters, run τ inner
//! steps, send the pseudo-gradient. Optimizer state lives in the host's
//! training engine and persists across rounds; only parameters are reset to
//! the shepherd's at the start of each round.
//!
//! Without overlap (the default) a worker runs one round at a time: fetch,
//! train τ steps, send, and abandons a round whose deadline passes before it is
//! sent ([`Input::DeadlineExtended`] moves that deadline when the shepherd
//! extends it). A shepherd extends a round that has no quorum at its deadline,
//! so a round that lapsed is taken up again, from its fetch, when its deadline
//! is extended past now: were every participant's round to lapse (a fetch from a
//! leader cut off, then replaced), the shepherd would extend a round nobody
//! trains, and its workers would wait for a next round that never opens.
//!
//! # Overlap ([`Worker::with_overlap`])
//!
//! Compute does not wait for the network: a worker that has finished round r's
//! steps sends its contribution and starts round r+1's steps at once, from its
//! own parameters θ_end(r), while the upload, the shepherd's aggregation and
//! the download of θ_global(r+1) happen. When θ_global(r+1) arrives, d inner
//! steps later, the host merges it by **rebase**:
//!
//! ```text
//! θ_local ← θ_global(r+1) + (θ_local − θ_end(r))
//! ```
//!
//! keeping the d steps of local progress made since the send and replacing
//! their base by the shepherd's new parameters. (Streaming DiLoCo's α-mix
//! θ_local ← α·θ_local + (1−α)·θ_global with α = 0 would drop the d steps;
//! rebase keeps them.) Optimizer state is not touched by a rebase.
//!
//! **A contribution never needs the update (staleness depth 2).** A rebase is
//! a translation, so round r+1's pseudo-gradient θ_global(r+1) − θ_end(r+1) is
//! exactly minus the local progress made since the send of round r, whether or
//! not θ_global(r+1) has been merged meanwhile. A worker whose round-(r+1)
//! steps are done before θ_global(r+1) arrived therefore sends at once and
//! goes on with round r+2; only the base of those steps is staler (it lacks
//! two outer updates instead of one). Compute waits ([`Action::UpdateLate`])
//! only when that would make the base three updates stale (round r+2's steps
//! are done and θ_global(r+1) is still not merged) or when the round it has
//! trained has not been announced to it yet (a contribution names its round).
//! [`Action::Train`]'s `behind` says how many outer updates the base lacks
//! when the steps start, and [`Worker::behind`] at any time.
//!
//! **Time-boxed rounds.** The shepherd announces a compute budget with each
//! round ([`Input::Budget`]; the median worker's time for τ steps). Every
//! [`Action::Train`] carries the latest budget: the host runs inner steps
//! until it has done τ or the budget is spent (no step starts once it is
//! spent; at least one step runs), and reports the steps it did in its
//! contribution. The shepherd's mean is weighted by samples, so a straggler
//! contributes fewer tokens instead of holding the round. A budget of 0 is no
//! budget (τ steps; an announcement from a shepherd without budgets reads 0).
//! A budget counted from each worker's own start lets a worker that started
//! late stay late, and such lags add up round after round like a random walk
//! until its contributions miss their round; so the announcement also names when
//! the median worker's steps of the round end, and a worker training that round
//! ahead stops there if it is later ([`Action::EndSteps`]): laggards catch up
//! within a round. (Not for a fresh start, whose steps begin when its fetch
//! ends.)
//!
//! **Late contributions are carried, not dropped.** An overlapping shepherd adds
//! a contribution for round r that arrives after r closed, while r+1 is open,
//! to round r+1's mean. So an overlapping worker does not abandon a round at
//! its deadline, nor a send in flight when the next round opens; a send is
//! abandoned once two newer rounds opened (it would be refused). A worker may
//! even still be training round r when r+1 opens: it finishes r (carried), and
//! trains r+1 from there, one round behind, as long as it heard round r's
//! announcement (it must fetch θ_global(r)). A round two newer than the one it
//! trains, or one it is not in, abandons its training ([`Action::Abandon`]) and
//! it starts afresh with [`Action::FetchParams`].
//!
//! **What the host keeps.** The *anchor*: the parameters at its last send (at a
//! fresh start, the fetched parameters), and at depth 2 also the one before.
//! `Send(t)` sends anchor(t−1) − θ and makes θ anchor(t). `Rebase(t)` adds
//! θ_global(t) − anchor(t−1) to θ and to every anchor from t−1 on (anchor(t−1)
//! becomes θ_global(t)); anchor(t−1) can go once both `Send(t)` and
//! `Rebase(t)` are done. Without depth 2 (the rebase before the send) this is
//! the plain θ_global(t) − θ_end(t). `FetchUpdate`s are asked one at a time,
//! in round order (a sparse update applies to the previous round's
//! parameters), and rebases come in round order.
//!
//! With overlap the inputs and actions run, for a worker in every round:
//!
//! ```text
//! Budget(r), RoundOpened(r) -> FetchParams(r)                (its first round: no overlap)
//! ParamsReady(r)    -> Train{r, behind 0}
//! Trained(r)        -> Send(r), Train{r+1, behind 1}         (r+1 from its own parameters)
//! Sent(r)           -> (nothing)
//! Budget(r+1), RoundOpened(r+1) -> FetchUpdate(r+1)          (beside the training)
//! ParamsReady(r+1)  -> Rebase(r+1)                           (training goes on)
//! Trained(r+1)      -> Send(r+1), Train{r+2, behind 1}
//! ```
//!
//! or, when the update is late, `Trained(r+1) -> Send(r+1), Train{r+2, behind
//! 2}` and later `ParamsReady(r+1) -> Rebase(r+1)`; when round r+1 has not
//! been announced by the end of its steps, `Trained(r+1) -> UpdateLate(r+1)`
//! and `RoundOpened(r+1) -> FetchUpdate(r+1), Send(r+1), Train{r+2, behind
//! 2}`. Actions are in the order the host must carry them out.

use std::collections::VecDeque;

use super::data_seed;

/// Where the worker is in a round.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Waiting for a round.
    Idle,
    /// Fetching the round's parameters.
    Fetching(u64),
    /// Running inner steps (from the round's own parameters, fetched or merged).
    Training(u64),
    /// Sending the pseudo-gradient.
    Sending(u64),
    /// Overlap: running the inner steps of a round that has not opened yet (or
    /// not for this worker yet), from its own parameters.
    Ahead(u64),
    /// Overlap: the round opened with this worker in it; its parameters are being
    /// fetched, beside the inner steps, for the rebase.
    Merging(u64),
}

/// What happens to the worker.
#[derive(Clone, Debug, PartialEq)]
pub enum Input {
    /// The shepherd opened `round`; `participant` says whether we are in it.
    RoundOpened {
        /// The round.
        round: u64,
        /// Unix milliseconds.
        deadline_ms: u64,
        /// Whether this worker was included.
        participant: bool,
    },
    /// The round's parameters are loaded (after [`Action::FetchParams`]), or
    /// fetched and ready to rebase onto (after [`Action::FetchUpdate`]).
    ParamsReady(u64),
    /// The inner steps finished (τ, or fewer when the budget ran out).
    Trained(u64),
    /// The contribution was delivered.
    Sent(u64),
    /// Something failed for `round`; wait for the next one.
    Failed(u64),
    /// Time passed.
    Tick,
    /// The compute budget announced with `round` (give it with the round's
    /// announcement, before [`Input::RoundOpened`]): every later
    /// [`Action::Train`] carries it. 0: no budget.
    Budget {
        /// The round it was announced with.
        round: u64,
        /// Milliseconds of inner steps a round.
        budget_ms: u64,
        /// When the median worker's steps of `round` end, Unix milliseconds: a
        /// worker that trains `round` ahead stops by then ([`Action::EndSteps`]).
        /// 0: no such time.
        end_ms: u64,
    },
    /// The shepherd moved `round`'s deadline (it had no quorum at the deadline).
    DeadlineExtended {
        /// The round.
        round: u64,
        /// Unix milliseconds.
        deadline_ms: u64,
    },
}

/// What the worker asks its host to do.
#[derive(Clone, Debug, PartialEq)]
pub enum Action {
    /// Fetch and load the parameters of `round`.
    FetchParams(u64),
    /// Run inner steps on data ordered by `seed`: from the parameters just
    /// loaded, or (overlap, right after `Send(round − 1)`) from the current ones,
    /// which the host keeps as the anchor (module docs).
    Train {
        /// The round.
        round: u64,
        /// τ: the most steps to run.
        steps: u64,
        /// This worker's data seed for the round.
        seed: u64,
        /// Overlap: stop once this many milliseconds of steps are spent, even
        /// before τ (at least one step; no step starts past it). `None`: τ steps.
        budget_ms: Option<u64>,
        /// The outer updates the starting parameters lack: 0 from fetched
        /// parameters, 1 trained ahead (overlap), 2 trained ahead of an update
        /// still on its way (depth 2).
        behind: u64,
    },
    /// Send the pseudo-gradient of `round` (θ_start − θ_end; overlap: the anchor
    /// minus the current parameters).
    Send(u64),
    /// Drop the work of `round` (its deadline passed or a newer round opened).
    Abandon(u64),
    /// Overlap: fetch the parameters of `round` (sparse runs: its update, applied
    /// to the held θ_global(round − 1)) beside the inner steps in progress, without
    /// touching the parameters being trained; answer [`Input::ParamsReady`].
    FetchUpdate(u64),
    /// Overlap: merge the fetched θ_global(round) into the training by rebase,
    /// θ ← θ + (θ_global(round) − anchor(round − 1)), moving the newer anchor too,
    /// before the next inner step.
    Rebase(u64),
    /// Overlap: the steps of `round` are done and it cannot be sent yet: it has
    /// not been announced to this worker, or θ_global(round − 1) is not merged
    /// (the base would be three updates stale). Compute waits until
    /// [`Input::RoundOpened`] or [`Input::ParamsReady`].
    UpdateLate(u64),
    /// Overlap: stop the inner steps of `round` (trained ahead) by `end_ms`, Unix
    /// milliseconds, if they would run longer (a step under way finishes; at least
    /// one step runs), then answer [`Input::Trained`] as usual: the round's steps
    /// end when the median worker's do, so a worker that started them late
    /// catches up instead of drifting later round after round.
    EndSteps {
        /// The round.
        round: u64,
        /// Unix milliseconds.
        end_ms: u64,
    },
}

/// Overlap: where an outer update θ_global(round) not merged yet stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Update {
    /// The round has not been announced to this worker yet.
    Awaited,
    /// Announced; its fetch waits for the one before it.
    Announced,
    /// [`Action::FetchUpdate`] asked.
    Fetching,
    /// Fetched; its rebase waits for the send of the round before it.
    Ready,
}

/// Overlap: the rounds trained one after another since a fresh start.
#[derive(Clone, Debug)]
struct Chain {
    /// The round trained (or, `fresh`, whose parameters are fetched).
    round: u64,
    /// Its parameters are being fetched ([`Action::FetchParams`]): no steps yet.
    fresh: bool,
    /// Its steps are done and it is not sent yet.
    done: bool,
    /// The outer updates not merged yet, oldest first (rounds up to `round + 1`).
    updates: VecDeque<(u64, Update)>,
}

impl Chain {
    fn fresh(round: u64) -> Self {
        Self { round, fresh: true, done: false, updates: VecDeque::new() }
    }

    /// Whether the round trained has been announced to this worker.
    fn announced(&self) -> bool {
        !self.updates.contains(&(self.round, Update::Awaited))
    }
}

/// The worker.
#[derive(Clone, Debug)]
pub struct Worker {
    peer: Vec<u8>,
    run_seed: u64,
    tau: u64,
    phase: Phase,
    deadline_ms: u64,
    overlap: bool,
    /// Overlap: the rounds trained since the last fresh start.
    chain: Option<Chain>,
    /// Overlap: the contributions on their way.
    in_flight: Vec<u64>,
    /// Overlap: the last round sent (a repeated announcement of it is not trained again).
    sent: Option<u64>,
    /// Overlap: the newest round announced (to this worker or not).
    heard: Option<u64>,
    /// Lockstep: the round abandoned at its deadline, until another opens (an
    /// extension of its deadline takes it up again).
    lapsed: Option<u64>,
    /// The latest budget announced, and the round it came with.
    budget: Option<(u64, u64)>,
    /// Overlap: the latest end of a round's steps announced.
    end: Option<(u64, u64)>,
}

impl Worker {
    /// A worker identified by `peer` bytes in a run with `run_seed` and τ.
    pub fn new(peer: Vec<u8>, run_seed: u64, tau: u64) -> Self {
        Self {
            peer,
            run_seed,
            tau,
            phase: Phase::Idle,
            deadline_ms: u64::MAX,
            overlap: false,
            chain: None,
            in_flight: Vec::new(),
            sent: None,
            heard: None,
            lapsed: None,
            budget: None,
            end: None,
        }
    }

    /// Trains the next round while a round's contribution, aggregation and
    /// update are on their way, and rebases onto the update (the module docs).
    pub fn with_overlap(mut self, overlap: bool) -> Self {
        self.overlap = overlap;
        self
    }

    /// Whether the worker overlaps rounds.
    pub fn overlaps(&self) -> bool {
        self.overlap
    }

    /// The current phase.
    pub fn phase(&self) -> Phase {
        if !self.overlap {
            return self.phase;
        }
        match &self.chain {
            None => Phase::Idle,
            Some(c) if c.fresh => Phase::Fetching(c.round),
            Some(c) if !c.announced() => Phase::Ahead(c.round),
            Some(c) if c.updates.iter().any(|(r, _)| *r == c.round) => Phase::Merging(c.round),
            Some(c) => Phase::Training(c.round),
        }
    }

    /// Overlap: the rounds whose contributions are on their way, oldest first.
    pub fn sending(&self) -> &[u64] {
        &self.in_flight
    }

    /// Overlap: the steps of the round trained are done and it waits to be sent
    /// ([`Action::UpdateLate`]).
    pub fn update_late(&self) -> bool {
        self.chain.as_ref().is_some_and(|c| c.done)
    }

    /// Overlap: the outer updates the parameters being trained lack (0 after a
    /// fresh fetch or once every update is merged; at most 2).
    pub fn behind(&self) -> u64 {
        self.chain.as_ref().map_or(0, |c| c.updates.len() as u64)
    }

    /// The compute budget the next [`Action::Train`] carries.
    pub fn budget_ms(&self) -> Option<u64> {
        self.budget.map(|(_, ms)| ms).filter(|ms| *ms > 0)
    }

    fn round(&self) -> Option<u64> {
        match self.phase() {
            Phase::Idle => None,
            Phase::Fetching(r) | Phase::Training(r) | Phase::Sending(r) | Phase::Ahead(r) | Phase::Merging(r) => {
                Some(r)
            }
        }
    }

    fn train(&self, round: u64, behind: u64) -> Action {
        let budget_ms = if self.overlap { self.budget_ms() } else { None };
        Action::Train { round, steps: self.tau, seed: data_seed(self.run_seed, &self.peer, round), budget_ms, behind }
    }

    fn idle(&mut self) {
        self.phase = Phase::Idle;
    }

    /// Advances the state machine.
    pub fn handle(&mut self, input: Input, now_ms: u64) -> Vec<Action> {
        match input {
            Input::Budget { round, budget_ms, end_ms } => {
                if self.budget.is_none_or(|(r, _)| round >= r) {
                    self.budget = Some((round, budget_ms));
                }
                if !self.overlap || end_ms == 0 || self.end.is_some_and(|(r, _)| round <= r) {
                    return Vec::new();
                }
                self.end = Some((round, end_ms));
                // the round trained ahead, steps under way
                match &self.chain {
                    Some(c) if c.round == round && !c.fresh && !c.done => vec![Action::EndSteps { round, end_ms }],
                    _ => Vec::new(),
                }
            }
            input if self.overlap => self.overlapped(input),
            input => self.lockstep(input, now_ms),
        }
    }

    /// One round at a time.
    fn lockstep(&mut self, input: Input, now_ms: u64) -> Vec<Action> {
        let mut actions = Vec::new();
        match input {
            Input::RoundOpened { round, deadline_ms, participant } => {
                if self.round().is_some_and(|r| r >= round) {
                    return actions;
                }
                self.lapsed = None;
                if let Some(old) = self.round() {
                    actions.push(Action::Abandon(old));
                    self.idle();
                }
                if participant {
                    self.phase = Phase::Fetching(round);
                    self.deadline_ms = deadline_ms;
                    actions.push(Action::FetchParams(round));
                }
            }
            Input::DeadlineExtended { round, deadline_ms } if self.round() == Some(round) => {
                self.deadline_ms = self.deadline_ms.max(deadline_ms);
            }
            Input::DeadlineExtended { round, deadline_ms } if self.lapsed == Some(round) && deadline_ms > now_ms => {
                self.lapsed = None;
                self.phase = Phase::Fetching(round);
                self.deadline_ms = deadline_ms;
                actions.push(Action::FetchParams(round));
            }
            Input::ParamsReady(r) if self.phase == Phase::Fetching(r) => {
                self.phase = Phase::Training(r);
                actions.push(self.train(r, 0));
            }
            Input::Trained(r) if self.phase == Phase::Training(r) => {
                self.phase = Phase::Sending(r);
                actions.push(Action::Send(r));
            }
            Input::Sent(r) | Input::Failed(r) if self.round() == Some(r) => self.idle(),
            _ => {}
        }
        let expired = now_ms > self.deadline_ms && !matches!(self.phase, Phase::Sending(_));
        if let Some(r) = self.round().filter(|_| expired) {
            actions.push(Action::Abandon(r));
            self.idle();
            self.lapsed = Some(r);
        }
        actions
    }

    /// Overlapped rounds (the module docs). Deadlines abandon nothing: the
    /// shepherd carries a late contribution over to the next round.
    fn overlapped(&mut self, input: Input) -> Vec<Action> {
        let mut actions = Vec::new();
        match input {
            Input::RoundOpened { round, deadline_ms, participant } => {
                if self.heard.is_some_and(|h| round <= h) || self.sent.is_some_and(|s| round <= s) {
                    return actions;
                }
                self.heard = Some(round);
                self.deadline_ms = deadline_ms;
                // a contribution two rounds old would be refused
                self.in_flight.retain(|s| {
                    let keep = s + 1 >= round;
                    if !keep {
                        actions.push(Action::Abandon(*s));
                    }
                    keep
                });
                self.opened(round, participant, &mut actions);
            }
            Input::DeadlineExtended { round, deadline_ms } if self.heard == Some(round) => {
                self.deadline_ms = self.deadline_ms.max(deadline_ms);
            }
            Input::ParamsReady(r) => {
                let Some(c) = self.chain.as_mut() else { return actions };
                if c.fresh && c.round == r {
                    c.fresh = false;
                    actions.push(self.train(r, 0));
                } else if let Some(u) = c.updates.iter_mut().find(|(t, u)| *t == r && *u == Update::Fetching) {
                    u.1 = Update::Ready;
                } else {
                    return actions;
                }
                self.progress(&mut actions);
            }
            Input::Trained(r) => {
                let Some(c) = self.chain.as_mut().filter(|c| c.round == r && !c.fresh && !c.done) else {
                    return actions;
                };
                c.done = true;
                self.progress(&mut actions);
                if self.chain.as_ref().is_some_and(|c| c.done && c.round == r) {
                    actions.push(Action::UpdateLate(r));
                }
            }
            Input::Sent(r) | Input::Failed(r) if self.in_flight.contains(&r) => self.in_flight.retain(|s| *s != r),
            // the round trained, or an update it needs, failed: start afresh
            Input::Failed(r)
                if self.chain.as_ref().is_some_and(|c| c.round == r || c.updates.iter().any(|(t, _)| *t == r)) =>
            {
                self.chain = None;
            }
            _ => {}
        }
        actions
    }

    /// Overlap: round `round` was announced, newer than any heard before.
    fn opened(&mut self, round: u64, participant: bool, actions: &mut Vec<Action>) {
        let Some(c) = self.chain.as_mut() else {
            if participant {
                self.chain = Some(Chain::fresh(round));
                actions.push(Action::FetchParams(round));
            }
            return;
        };
        let t = c.round;
        if participant && round == t && !c.announced() {
            // the round trained ahead opened: its parameters are fetched beside the steps
            if let Some(u) = c.updates.iter_mut().find(|(r, _)| *r == round) {
                u.1 = Update::Announced;
            }
        } else if participant && round == t + 1 && c.announced() && c.updates.len() < 2 {
            // round t closed before it was sent: it is carried over, and round t+1 is
            // trained from there, one round behind (the base lacking at most two updates)
            c.updates.push_back((round, Update::Announced));
        } else {
            actions.push(Action::Abandon(t));
            self.chain = None;
            if participant {
                self.chain = Some(Chain::fresh(round));
                actions.push(Action::FetchParams(round));
            }
            return;
        }
        self.progress(actions);
    }

    /// Overlap: does what the chain allows now, in order: rebases the fetched
    /// updates whose anchor exists, sends the round trained if it may go and
    /// starts the next one, and asks for the next fetch.
    fn progress(&mut self, actions: &mut Vec<Action>) {
        loop {
            let Some(c) = self.chain.as_mut() else { return };
            // rebase θ_global(u) once fetched and once round u − 1 was sent (its anchor)
            while let Some(&(u, Update::Ready)) = c.updates.front() {
                if u > c.round {
                    break;
                }
                c.updates.pop_front();
                actions.push(Action::Rebase(u));
            }
            let t = c.round;
            let sendable = c.done && c.announced() && c.updates.front().is_none_or(|(u, _)| *u >= t);
            if !sendable {
                break;
            }
            actions.push(Action::Send(t));
            self.in_flight.push(t);
            self.sent = Some(t);
            c.round = t + 1;
            c.done = false;
            if !c.updates.iter().any(|(u, _)| *u == t + 1) {
                c.updates.push_back((t + 1, Update::Awaited));
            }
            // a fetched θ_global(t+1) can be merged now that round t is sent
            while let Some(&(u, Update::Ready)) = c.updates.front() {
                if u > t + 1 {
                    break;
                }
                c.updates.pop_front();
                actions.push(Action::Rebase(u));
            }
            let behind = c.updates.len() as u64;
            actions.push(self.train(t + 1, behind));
            if let Some((_, end_ms)) = self.end.filter(|(r, _)| *r == t + 1) {
                // its round announced already (one round behind): catch up
                actions.push(Action::EndSteps { round: t + 1, end_ms });
            }
        }
        let Some(c) = self.chain.as_mut() else { return };
        if !c.fresh
            && !c.updates.iter().any(|(_, u)| *u == Update::Fetching)
            && let Some(u) = c.updates.iter_mut().find(|(_, u)| *u == Update::Announced)
        {
            u.1 = Update::Fetching;
            actions.push(Action::FetchUpdate(u.0));
        }
    }
}

#[cfg(test)]
mod tests;
