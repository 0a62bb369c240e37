//! Failover: which candidate may take over, when a leader must stop, and which
//! contributions a leader may apply. The rules the node runs and the fault
//! simulator (`pcp-node simulate --faults`) checks, sans-IO like the rest of this
//! crate: time comes in as monotonic milliseconds.
//!
//! * **Up-to-date succession** ([`Standby`]): a candidate may take its term only if
//!   it holds a replicated state ([`Replica`]) and no live candidate it heard from
//!   holds a newer one, by `(term, round)`, the term that produced the state first
//!   (Raft's "at least as up to date"). A candidate behind defers: its term lapses,
//!   and the next one's comes up.
//! * **Check-quorum** ([`Quorum`]): a leader that hears from no majority of its last
//!   round's contributors for [`CHECK_QUORUM_LEASES`] lease periods steps aside.
//! * **Leader lease** ([`LeaderLease`]): while another candidate answers its leases,
//!   the leader completes and opens rounds only until `lease − margin` after the
//!   last lease a candidate answered; a follower's lease runs from when it received
//!   that lease, later than it was sent, so the leader stops first. The margin,
//!   [`LEASE_MARGIN_DIVISOR`], covers clocks running at different rates.
//! * **Fencing** ([`Fence`]): a contribution names the term, the round and the
//!   parameters hash it was trained from; any other is refused.
//! * **Commit** ([`Commit`]): workers learn a completed round (the announcement of
//!   the next) only once every live candidate holds its state, so a successor
//!   never leads from behind what workers applied. A candidate is live while it
//!   answered within two leases; the wait for it ends with its liveness.
//! * **Step aside when behind** ([`Commit::newer_than`]): the up-to-date rule,
//!   kept after the election. When a live candidate holds a newer state than the
//!   leader's (the leader could not hear that candidate when it took its term), the
//!   leader completes nothing and steps aside; the succession moves on, and the
//!   candidates behind defer, until the holder of the newest state leads.
//! * **Workers never move back** ([`Chain`]): a worker follows an announcement only
//!   if it extends what it applied: a later round, from the parameters it holds
//!   when the round is the next one.

use std::collections::BTreeMap;

pub mod candidate;

pub use candidate::{Candidate, HardState, Mode};

use crate::PublicKey;
use crate::election::{self, Election};

/// A leader that hears from no majority of its last round's contributors for this
/// many lease periods steps aside.
pub const CHECK_QUORUM_LEASES: u64 = 3;

/// The leader's margin: it stops acting `lease / 4` before a follower's lease can
/// expire, enough for clocks whose rates differ by up to 25 % over one lease.
pub const LEASE_MARGIN_DIVISOR: u64 = 4;

/// A candidate's replicated state, by its place in the run's history: the term of
/// the leader that produced it, the rounds it completed, and its parameters hash.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Replica {
    /// The term whose leader completed `round`.
    pub term: u64,
    /// Rounds completed.
    pub round: u64,
    /// The parameters after `round`.
    pub params: [u8; 32],
}

impl Replica {
    /// The order of states: the producing term first, then the round. A deposed
    /// term's longer branch ranks below the winner's.
    pub fn rank(&self) -> (u64, u64) {
        (self.term, self.round)
    }

    /// Whether this state supersedes `held`.
    pub fn newer_than(&self, held: &Replica) -> bool {
        self.rank() > held.rank()
    }
}

/// What a standby candidate is told.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Input {
    /// Time passes.
    Tick,
    /// A signed lease of `term` from candidate `from` (its heartbeat or announcement).
    Lease {
        /// The signer.
        from: PublicKey,
        /// The term it claims.
        term: u64,
    },
    /// This candidate now holds `replica` (fetched and checked).
    Replicated(Replica),
    /// Another candidate says what it holds (its heartbeat); `None` while it holds
    /// nothing or stepped aside.
    Peer {
        /// The candidate.
        from: PublicKey,
        /// What it holds.
        held: Option<Replica>,
    },
}

/// What the host of a standby does.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Something the election decided (lapses, refusals, terms followed).
    Election(election::Action),
    /// Lead `term` from `from`.
    Lead {
        /// The term taken.
        term: u64,
        /// The state to lead from.
        from: Replica,
    },
    /// This candidate's turn came and it did not take it.
    Deferred {
        /// The term passed over.
        term: u64,
        /// The newer state it defers to, and its holder; `None` when it holds no
        /// state itself.
        to: Option<(PublicKey, Replica)>,
    },
}

/// A standby candidate: it follows the leader, holds the latest state it
/// replicated, and leads when its term comes if it is up to date.
#[derive(Clone, Debug)]
pub struct Standby {
    election: Election,
    held: Option<Replica>,
    /// What other candidates said they hold, and when (bounded by the succession).
    peers: BTreeMap<PublicKey, (Option<Replica>, u64)>,
    /// It takes no term before this: it stepped aside (see [`Standby::set_aside`]).
    not_before_ms: u64,
}

impl Standby {
    /// A standby following `election` (made with [`Election::resume`] at the term it
    /// knows), holding `held` if anything.
    pub fn new(election: Election, held: Option<Replica>) -> Self {
        Self { election, held, peers: BTreeMap::new(), not_before_ms: 0 }
    }

    /// A leader that stepped aside at `now_ms` (it lost its workers, or was behind)
    /// takes no term for [`CHECK_QUORUM_LEASES`] leases: the next candidate takes
    /// over one lease after its last lease, and this one, whose wait for that
    /// candidate's first lease ends at the same moment, must not race it for the
    /// term after.
    pub fn set_aside(mut self, now_ms: u64) -> Self {
        self.not_before_ms = now_ms + CHECK_QUORUM_LEASES * self.election.lease_ms();
        self
    }

    /// The election it follows.
    pub fn election(&self) -> &Election {
        &self.election
    }

    /// The state it would lead from.
    pub fn held(&self) -> Option<Replica> {
        self.held
    }

    /// A candidate heard within two lease periods holding a newer state than this
    /// one, if any: whom it defers to.
    pub fn ahead(&self, now_ms: u64) -> Option<(PublicKey, Replica)> {
        let fresh = 2 * self.election.lease_ms();
        self.peers
            .iter()
            .filter(|(_, (_, at))| now_ms.saturating_sub(*at) <= fresh)
            .filter_map(|(k, (r, _))| r.map(|r| (*k, r)))
            .filter(|(_, r)| self.held.is_none_or(|h| r.newer_than(&h)))
            .max_by_key(|(_, r)| r.rank())
    }

    /// Whether it may take a term now.
    pub fn may_lead(&self, now_ms: u64) -> bool {
        self.held.is_some() && now_ms >= self.not_before_ms && self.ahead(now_ms).is_none()
    }

    /// One input at `now_ms`.
    pub fn handle(&mut self, input: Input, now_ms: u64) -> Vec<Action> {
        match input {
            Input::Tick => {
                let may_lead = self.may_lead(now_ms);
                let mut out = Vec::new();
                for a in self.election.tick_gated(now_ms, may_lead) {
                    match a {
                        election::Action::Elected { term, leader } if leader == self.me() => {
                            let from = self.held.expect("may_lead implies a held state");
                            out.push(Action::Election(election::Action::Elected { term, leader }));
                            out.push(Action::Lead { term, from });
                        }
                        election::Action::Deferred { term } => {
                            out.push(Action::Deferred { term, to: self.ahead(now_ms) });
                        }
                        a => out.push(Action::Election(a)),
                    }
                }
                out
            }
            Input::Lease { from, term } => {
                self.election.on_lease(from, term, now_ms).into_iter().map(Action::Election).collect()
            }
            Input::Replicated(replica) => {
                if self.held.is_none_or(|h| replica.newer_than(&h)) {
                    self.held = Some(replica);
                }
                Vec::new()
            }
            Input::Peer { from, held } => {
                if from != self.me() && self.election.succession().contains(&from) {
                    self.peers.insert(from, (held, now_ms));
                }
                Vec::new()
            }
        }
    }

    fn me(&self) -> PublicKey {
        self.election.me()
    }
}

/// Check-quorum: the leader's record of which of its last round's contributors it
/// still hears from.
#[derive(Clone, Debug)]
pub struct Quorum {
    window_ms: u64,
    /// The last completed round's contributors, and when each was last heard.
    expected: BTreeMap<PublicKey, u64>,
    /// When the current set was installed: no verdict for a window after.
    since_ms: u64,
    /// The previous [`Quorum::check`]: a check long after it restarts the window.
    checked_ms: u64,
}

impl Quorum {
    /// A quorum check over `window_ms` (at least [`CHECK_QUORUM_LEASES`] leases).
    pub fn new(window_ms: u64, now_ms: u64) -> Self {
        Self { window_ms: window_ms.max(1), expected: BTreeMap::new(), since_ms: now_ms, checked_ms: now_ms }
    }

    /// A round completed with `contributors`: they are the quorum from now on.
    pub fn round_completed(&mut self, contributors: &[PublicKey], now_ms: u64) {
        let before = std::mem::take(&mut self.expected);
        for c in contributors {
            // a contributor was just heard (it contributed)
            let heard = before.get(c).copied().unwrap_or(now_ms).max(now_ms.saturating_sub(self.window_ms / 2));
            self.expected.insert(*c, heard);
        }
        if before.is_empty() {
            self.since_ms = now_ms;
        }
    }

    /// The leader heard from `peer` (a heartbeat or a contribution).
    pub fn heard(&mut self, peer: &PublicKey, now_ms: u64) {
        if let Some(at) = self.expected.get_mut(peer) {
            *at = (*at).max(now_ms);
        }
    }

    /// How many of the expected contributors were heard within the window, of how
    /// many.
    pub fn heard_of(&self, now_ms: u64) -> (usize, usize) {
        let heard = self.expected.values().filter(|at| now_ms.saturating_sub(**at) < self.window_ms).count();
        (heard, self.expected.len())
    }

    /// [`Self::lost`], as the leader's loop asks it on every tick: a tick that comes
    /// more than a third of the window after the previous one (the loop was busy,
    /// and the heartbeats queued meanwhile are still to be read) restarts the window
    /// instead of judging.
    pub fn check(&mut self, now_ms: u64) -> bool {
        if now_ms.saturating_sub(self.checked_ms) > self.window_ms / 3 {
            self.since_ms = now_ms;
            for at in self.expected.values_mut() {
                *at = (*at).max(now_ms.saturating_sub(self.window_ms / 2));
            }
        }
        self.checked_ms = now_ms;
        self.lost(now_ms)
    }

    /// Whether the leader lost its quorum: it heard from no majority of its last
    /// round's contributors within the window (never before a round completed, nor
    /// within a window of the first).
    pub fn lost(&self, now_ms: u64) -> bool {
        let (heard, of) = self.heard_of(now_ms);
        of > 0 && now_ms.saturating_sub(self.since_ms) >= self.window_ms && heard < of / 2 + 1
    }
}

/// The leader's own view of its lease.
#[derive(Clone, Debug)]
pub struct LeaderLease {
    lease_ms: u64,
    /// The send time of the latest lease some candidate answered.
    answered_sent_ms: Option<u64>,
    /// When a candidate last answered.
    answered_at_ms: u64,
    /// The previous [`LeaderLease::check`].
    checked_ms: Option<u64>,
}

impl LeaderLease {
    /// A leader's lease of `lease_ms`.
    pub fn new(lease_ms: u64) -> Self {
        Self { lease_ms: lease_ms.max(1), answered_sent_ms: None, answered_at_ms: 0, checked_ms: None }
    }

    /// A candidate answered the lease sent at `sent_ms`.
    pub fn answered(&mut self, sent_ms: u64, now_ms: u64) {
        self.answered_sent_ms = Some(self.answered_sent_ms.map_or(sent_ms, |s| s.max(sent_ms)));
        self.answered_at_ms = now_ms;
    }

    /// Whether the leader may complete or open a round now: no candidate answers
    /// (nobody can take the term from a lease it never got: a run needs no live
    /// standby), or the last answered lease is younger than `lease − margin`. A
    /// candidate that stops answering for two leases is taken as gone.
    pub fn may_act(&self, now_ms: u64) -> bool {
        match self.answered_sent_ms {
            None => true,
            Some(_) if now_ms.saturating_sub(self.answered_at_ms) >= 2 * self.lease_ms => true,
            Some(sent) => now_ms < sent + self.lease_ms - self.lease_ms / LEASE_MARGIN_DIVISOR,
        }
    }

    /// [`Self::may_act`], as the leader asks it before it acts (at least on every
    /// tick of its loop). A question more than half a lease after the previous one
    /// means the leader was not listening (its loop or its whole machine was
    /// suspended, and the answers queued meanwhile are still to be read): the
    /// silence does not count as the candidates' death, which now takes a lease of
    /// listening. A leader suspended for two leases would otherwise wake to take
    /// every candidate for gone and tell workers of a round at once, while a
    /// successor leads.
    pub fn check(&mut self, now_ms: u64) -> bool {
        if self.checked_ms.is_some_and(|at| now_ms.saturating_sub(at) > self.lease_ms / 2) {
            self.answered_at_ms = self.answered_at_ms.max(now_ms.saturating_sub(self.lease_ms));
        }
        self.checked_ms = Some(now_ms);
        self.may_act(now_ms)
    }
}

/// What a contribution was trained from, and what the open round is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fence {
    /// The leader's term.
    pub term: u64,
    /// The open round.
    pub round: u64,
    /// The parameters the round starts from.
    pub params: [u8; 32],
}

/// Why a contribution is fenced off.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Fenced {
    /// Trained under another term.
    #[error("contribution of term {got}; this leader's term is {expected}")]
    Term {
        /// The contribution's term.
        got: u64,
        /// The leader's.
        expected: u64,
    },
    /// For another round.
    #[error("contribution for round {got}; round {expected} is open")]
    Round {
        /// The contribution's round.
        got: u64,
        /// The open one.
        expected: u64,
    },
    /// Trained from other parameters.
    #[error("contribution trained from parameters {got}, not the round's {expected}")]
    Params {
        /// Short hex of the contribution's parameters hash.
        got: String,
        /// Short hex of the round's.
        expected: String,
    },
}

impl Fence {
    /// Accepts a contribution naming `(term, round, params)`, or says why not.
    pub fn check(&self, term: u64, round: u64, params: &[u8; 32]) -> Result<(), Fenced> {
        if term != self.term {
            return Err(Fenced::Term { got: term, expected: self.term });
        }
        if round != self.round {
            return Err(Fenced::Round { got: round, expected: self.round });
        }
        if *params != self.params {
            let short = |p: &[u8; 32]| p[..6].iter().map(|b| format!("{b:02x}")).collect::<String>();
            return Err(Fenced::Params { got: short(params), expected: short(&self.params) });
        }
        Ok(())
    }
}

/// The longest a round waits for the live candidates to hold its state, in
/// leases: a candidate that cannot keep up (a slow link, a failing disk) must not
/// stall the run. Past it the round is released, and a successor may lead from
/// behind what workers applied; workers then refuse its rounds ([`Chain`]) until
/// it loses its quorum and steps aside.
pub const COMMIT_WAIT_LEASES: u64 = 4;

/// The leader's commit rule: which candidates must hold a completed round before
/// workers learn of it.
#[derive(Clone, Debug)]
pub struct Commit {
    lease_ms: u64,
    /// Each other candidate: what it said it holds, and when it last answered.
    candidates: BTreeMap<PublicKey, (Option<Replica>, u64)>,
}

impl Commit {
    /// A commit rule over leases of `lease_ms`.
    pub fn new(lease_ms: u64) -> Self {
        Self { lease_ms: lease_ms.max(1), candidates: BTreeMap::new() }
    }

    /// Candidate `from` answered, holding `held`.
    pub fn heard(&mut self, from: PublicKey, held: Option<Replica>, now_ms: u64) {
        self.candidates.insert(from, (held, now_ms));
    }

    /// Whether a round opened at `opened_ms` has waited [`COMMIT_WAIT_LEASES`].
    pub fn overdue(&self, opened_ms: u64, now_ms: u64) -> bool {
        now_ms.saturating_sub(opened_ms) >= COMMIT_WAIT_LEASES * self.lease_ms
    }

    /// The live candidates that do not hold `(term, round)` yet: empty when workers
    /// may learn of it.
    pub fn waiting_for(&self, term: u64, round: u64, now_ms: u64) -> Vec<PublicKey> {
        self.candidates
            .iter()
            .filter(|(_, (_, at))| now_ms.saturating_sub(*at) < 2 * self.lease_ms)
            .filter(|(_, (held, _))| held.is_none_or(|h| h.rank() < (term, round)))
            .map(|(k, _)| *k)
            .collect()
    }

    /// The newest state a live candidate holds that is newer than `state` (by
    /// [`Replica::rank`]), and its holder: the up-to-date rule, kept after the
    /// election. A leader that could not hear that candidate when it took its term
    /// (it was cut off or down, or the leader was) steps aside for it instead of
    /// completing rounds from behind.
    pub fn newer_than(&self, state: &Replica, now_ms: u64) -> Option<(PublicKey, Replica)> {
        self.candidates
            .iter()
            .filter(|(_, (_, at))| now_ms.saturating_sub(*at) < 2 * self.lease_ms)
            .filter_map(|(k, (held, _))| held.map(|h| (*k, h)))
            .filter(|(_, h)| h.newer_than(state))
            .max_by_key(|(k, h)| (h.rank(), *k))
    }
}

/// What a worker applied: the last round whose result it trained from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Chain {
    /// The highest term it followed.
    pub term: u64,
    /// The round it last trained (0 before any).
    pub round: u64,
    /// The parameters that round started from.
    pub params: [u8; 32],
}

/// Why a worker does not follow an announcement.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Behind {
    /// The round is at or below one this worker trained.
    #[error("round {round} is not after round {trained}, which this worker trained")]
    Round {
        /// The announced round.
        round: u64,
        /// The worker's.
        trained: u64,
    },
    /// The same round from other parameters: another branch.
    #[error("round {round} starts from other parameters than this worker trained it from")]
    Fork {
        /// The round.
        round: u64,
    },
}

impl Chain {
    /// Whether the worker may train round `round` from `params` under `term`:
    /// a later round, or the round it trained again from the same parameters (a
    /// successor reopening it).
    pub fn admits(&self, term: u64, round: u64, params: &[u8; 32]) -> Result<(), Behind> {
        if self.round == 0 {
            return Ok(());
        }
        if round == self.round {
            return if *params == self.params && term >= self.term { Ok(()) } else { Err(Behind::Fork { round }) };
        }
        if round < self.round {
            return Err(Behind::Round { round, trained: self.round });
        }
        Ok(())
    }

    /// The worker trains `round` from `params` under `term`.
    pub fn follow(&mut self, term: u64, round: u64, params: [u8; 32]) {
        *self = Self { term: term.max(self.term), round, params };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::RunId;
    use crate::election::Succession;

    const LEASE: u64 = 1000;

    fn key(i: u8) -> PublicKey {
        PublicKey([i; 32])
    }

    fn replica(term: u64, round: u64) -> Replica {
        Replica { term, round, params: [round as u8; 32] }
    }

    fn succession() -> Succession {
        Succession::new(RunId([9; 32]), key(1), &[key(2), key(3)])
    }

    fn standby(i: usize, held: Option<Replica>) -> Standby {
        let s = succession();
        let me = s.order()[i];
        Standby::new(Election::new(me, s, LEASE, 0), held)
    }

    fn tick_until(s: &mut Standby, from: u64, to: u64) -> Vec<Action> {
        (1..=(to - from) / 100).flat_map(|i| s.handle(Input::Tick, from + i * 100)).collect()
    }

    /// H2: a state from the winner's term supersedes a deposed term's longer branch.
    #[test]
    fn a_newer_term_supersedes_a_longer_deposed_branch() {
        assert!(replica(2, 7).newer_than(&replica(1, 8)));
        assert!(!replica(1, 8).newer_than(&replica(2, 7)));
        assert!(replica(2, 8).newer_than(&replica(2, 7)));
        let mut s = standby(2, Some(replica(1, 8)));
        s.handle(Input::Replicated(replica(2, 7)), 10);
        assert_eq!(s.held(), Some(replica(2, 7)));
        s.handle(Input::Replicated(replica(1, 9)), 20);
        assert_eq!(s.held(), Some(replica(2, 7)), "the deposed branch is not taken back");
    }

    /// Up-to-date succession: the candidate whose turn comes defers to a live one
    /// that holds a newer state, which leads a lease later.
    #[test]
    fn a_candidate_behind_a_live_one_defers_to_it() {
        let s = succession();
        let (second, third) = (s.order()[1], s.order()[2]);
        let (i2, i3) = (1, 2);
        let mut behind = standby(i2, Some(replica(1, 5)));
        let mut ahead = standby(i3, Some(replica(1, 6)));
        let mut actions = Vec::new();
        let mut led = None;
        for t in (100..=3000).step_by(100) {
            behind.handle(Input::Peer { from: third, held: ahead.held() }, t);
            ahead.handle(Input::Peer { from: second, held: behind.held() }, t);
            actions.extend(behind.handle(Input::Tick, t));
            for a in ahead.handle(Input::Tick, t) {
                if let Action::Lead { term, from } = a {
                    led = led.or(Some((term, from, t)));
                }
            }
        }
        assert!(actions.contains(&Action::Deferred { term: 2, to: Some((third, replica(1, 6))) }), "{actions:?}");
        assert!(!actions.iter().any(|a| matches!(a, Action::Lead { .. })));
        assert_eq!(led, Some((3, replica(1, 6), 2000)), "term 3 is taken a lease after term 2 lapsed");
    }

    /// A candidate that has not yet replicated anything never leads (H1: the late
    /// standby that would lead from round 0).
    #[test]
    fn a_candidate_without_a_state_never_leads() {
        let mut s = standby(1, None);
        let a = tick_until(&mut s, 0, 5000);
        assert!(a.iter().any(|a| matches!(a, Action::Deferred { term: 2, to: None })), "{a:?}");
        assert!(!a.iter().any(|a| matches!(a, Action::Lead { .. })));
        s.handle(Input::Replicated(replica(1, 3)), 5000);
        let a = tick_until(&mut s, 5000, 9000);
        assert!(a.iter().any(|a| matches!(a, Action::Lead { from, .. } if *from == replica(1, 3))), "{a:?}");
    }

    /// Someone's claim ages out: a candidate that went silent no longer holds the
    /// others back.
    #[test]
    fn a_silent_candidate_stops_holding_the_others_back() {
        let third = succession().order()[2];
        let mut s = standby(1, Some(replica(1, 5)));
        s.handle(Input::Peer { from: third, held: Some(replica(1, 9)) }, 0);
        assert!(!s.may_lead(2 * LEASE));
        assert!(s.may_lead(2 * LEASE + 1));
        s.handle(Input::Peer { from: key(77), held: Some(replica(9, 9)) }, 3000);
        assert!(s.may_lead(3000), "a non-candidate's claim is ignored");
    }

    /// H3: a leader that hears from no majority of its last round's contributors
    /// for the window has lost its quorum; one that hears a majority has not.
    #[test]
    fn check_quorum_needs_a_majority_of_the_last_round() {
        let window = CHECK_QUORUM_LEASES * LEASE;
        let mut q = Quorum::new(window, 0);
        assert!(!q.lost(100_000), "no verdict before a round completed");
        let workers = [key(10), key(11), key(12)];
        q.round_completed(&workers, 1000);
        assert!(!q.lost(1000 + window - 1));
        for t in (1000..=20_000).step_by(500) {
            q.heard(&key(10), t);
            q.heard(&key(11), t);
            assert!(!q.lost(t), "two of three heard at {t}");
        }
        for t in (20_500..=30_000).step_by(500) {
            q.heard(&key(10), t);
            q.heard(&key(99), t); // not one of the round's contributors
        }
        assert!(q.lost(30_000), "one of three heard");
        assert_eq!(q.heard_of(30_000), (1, 3));
        // a loop that was busy does not judge on waking: the heartbeats it queued come next
        let mut q = Quorum::new(window, 0);
        q.round_completed(&workers, 1000);
        for t in (1000..=10_000).step_by(500) {
            q.heard(&key(10), t);
            q.heard(&key(11), t);
            assert!(!q.check(t));
        }
        assert!(!q.check(60_000), "the first check after a stall restarts the window");
        for w in &workers {
            q.heard(w, 60_010);
        }
        assert!(!q.check(60_100));
    }

    #[test]
    fn the_leader_stops_acting_before_a_followers_lease_can_expire() {
        let mut l = LeaderLease::new(LEASE);
        assert!(l.may_act(1_000_000), "no candidate answered: nobody can take the term");
        l.answered(10_000, 10_050);
        assert!(l.may_act(10_000 + LEASE - LEASE / LEASE_MARGIN_DIVISOR - 1));
        assert!(!l.may_act(10_000 + LEASE - LEASE / LEASE_MARGIN_DIVISOR));
        // the follower received it no earlier than it was sent: its lease runs to at least 11_000
        l.answered(10_600, 10_650);
        assert!(l.may_act(11_000));
        assert!(l.may_act(10_650 + 2 * LEASE), "a candidate silent for two leases is gone");
        // a leader suspended for those two leases has not heard them go silent
        let mut l = LeaderLease::new(LEASE);
        l.answered(10_000, 10_050);
        for t in (10_050..=10_500).step_by(100) {
            assert!(l.check(t));
        }
        assert!(!l.check(10_500 + 3 * LEASE), "woken: it was not listening");
        assert!(!l.check(10_500 + 3 * LEASE + LEASE / 2), "it listens for a lease first");
        let mut t = 10_500 + 3 * LEASE + LEASE / 2;
        while t < 10_500 + 4 * LEASE {
            t += 100;
            l.check(t);
        }
        assert!(l.check(10_500 + 4 * LEASE), "a lease of silence while listening: gone");
    }

    #[test]
    fn workers_learn_a_round_once_every_live_candidate_holds_it() {
        let mut c = Commit::new(LEASE);
        assert!(c.waiting_for(1, 3, 0).is_empty(), "no candidate: nothing to wait for");
        c.heard(key(2), Some(replica(1, 2)), 100);
        c.heard(key(3), Some(replica(1, 3)), 100);
        assert_eq!(c.waiting_for(1, 3, 200), vec![key(2)]);
        c.heard(key(2), Some(replica(1, 3)), 300);
        assert!(c.waiting_for(1, 3, 400).is_empty());
        assert_eq!(c.waiting_for(1, 4, 400).len(), 2);
        assert_eq!(c.waiting_for(1, 4, 300 + 2 * LEASE), Vec::<PublicKey>::new(), "silent for two leases: gone");
        assert!(!c.overdue(1000, 1000 + COMMIT_WAIT_LEASES * LEASE - 1));
        assert!(c.overdue(1000, 1000 + COMMIT_WAIT_LEASES * LEASE), "a candidate that cannot keep up stalls nobody");
    }

    /// A leader hears that a live candidate holds a newer state than the one it
    /// leads from: it steps aside for the newest.
    #[test]
    fn a_leader_behind_a_live_candidate_finds_the_newest_state() {
        let mut c = Commit::new(LEASE);
        let base = replica(1, 3);
        c.heard(key(2), Some(replica(1, 2)), 100);
        assert_eq!(c.newer_than(&base, 200), None, "an older state holds nobody back");
        c.heard(key(3), Some(replica(1, 5)), 100);
        assert_eq!(c.newer_than(&base, 200), Some((key(3), replica(1, 5))));
        c.heard(key(2), Some(replica(2, 4)), 150);
        assert_eq!(c.newer_than(&base, 200), Some((key(2), replica(2, 4))), "the newest by (term, round)");
        assert_eq!(c.newer_than(&replica(3, 1), 200), None, "a newer term outranks longer branches");
        assert_eq!(c.newer_than(&base, 150 + 2 * LEASE), None, "silent for two leases: gone");
    }

    #[test]
    fn a_worker_never_moves_back_nor_onto_another_branch() {
        let mut w = Chain::default();
        assert_eq!(w.admits(1, 5, &[1; 32]), Ok(()), "a joiner follows anything");
        w.follow(1, 5, [1; 32]);
        assert_eq!(w.admits(2, 5, &[1; 32]), Ok(()), "a successor reopening the round");
        assert_eq!(w.admits(2, 5, &[2; 32]), Err(Behind::Fork { round: 5 }));
        assert_eq!(w.admits(2, 4, &[0; 32]), Err(Behind::Round { round: 4, trained: 5 }));
        assert_eq!(w.admits(1, 6, &[3; 32]), Ok(()));
    }

    /// M2: a contribution for another term, round or parameters is refused.
    #[test]
    fn contributions_are_fenced_by_term_round_and_parameters() {
        let f = Fence { term: 2, round: 7, params: [7; 32] };
        assert_eq!(f.check(2, 7, &[7; 32]), Ok(()));
        assert_eq!(f.check(1, 7, &[7; 32]), Err(Fenced::Term { got: 1, expected: 2 }));
        assert_eq!(f.check(2, 8, &[7; 32]), Err(Fenced::Round { got: 8, expected: 7 }));
        assert!(matches!(f.check(2, 7, &[6; 32]), Err(Fenced::Params { .. })));
        assert!(f.check(2, 7, &[6; 32]).unwrap_err().to_string().contains("060606060606"));
    }
}
