//! A coordinator candidate, sans-IO: who leads a run, when a round's state is
//! committed, and when the leader may act. pcp-node and the fault simulator
//! (`pcp-node simulate --faults`) both drive this one type; they differ only in
//! how messages travel and states are fetched.
//!
//! Raft's rules on a log of one entry per round, with the run's fixed
//! [succession](crate::election::Succession) kept as a priority:
//!
//! * **Terms are owned.** Term `t` belongs to one candidate, as in
//!   [`crate::election`]: two leaders of one term cannot exist, and a vote needs
//!   no `voted_for` to be safe (it is kept anyway). A candidate counts a lapse for
//!   each lease period it hears no lease; when the term it then awaits is its own,
//!   it campaigns.
//! * **Votes, persisted.** A campaign asks first for *pre-votes* (no state
//!   changes, so a candidate cut off from the others cannot raise the run's term
//!   and depose a healthy leader when it returns), then, with a majority of them,
//!   takes the term, persists `(term, vote)` ([`Action::Persist`]) and asks for
//!   votes. A candidate grants a vote for a term at least its own, to that term's
//!   owner, when the owner's state ranks at least as high as its own ("at least as
//!   up to date"), and, for a pre-vote, when it has heard no live leader within a
//!   lease. A majority of votes elects.
//! * **States ranked by the term that committed them.** A state is
//!   [`Replica`]`{term, round, params}`; a new leader's first act is to commit the
//!   state it holds *under its own term* (Raft's no-op entry): followers that hold
//!   the same round and parameters take the new term at once, others fetch it.
//!   So a state that lost its majority (Raft's figure 8) can never outrank one a
//!   later leader committed.
//! * **Commit by majority, no timeout.** A state is committed once a majority of the
//!   candidates (the leader included) hold it, and only then does the leader tell
//!   workers ([`Action::Commit`]). A slow candidate only slows the commit while a
//!   majority is slower still.
//! * **The lease by majority.** The leader acts (opens and completes rounds) only
//!   while a majority answered a lease sent within `lease − lease/4`; a follower
//!   grants no pre-vote within a lease of hearing its leader, so a leader that
//!   may act has no rival. A leader that hears no majority for two leases (of
//!   listening) steps aside.
//!
//! **Best effort** ([`Mode::BestEffort`], runs of 1 or 2 candidates): a majority
//! of two is both, so one dead candidate would stop the run; best effort counts
//! the majority among the candidates heard within [`BEST_EFFORT_DEAD_LEASES`]
//! leases instead, and a
//! state keeps the term that produced it (a candidate that led alone and completed
//! nothing does not outrank the other's rounds). It survives a dead candidate, but
//! not a cut between the two: each side elects itself (the failure
//! model of docs/failover.md).
//!
//! Time is `now_ms` of a clock that counts suspend (`CLOCK_BOOTTIME` in
//! pcp-node): a leader that slept through its lease wakes with it expired. A tick
//! more than half a lease after the previous one restarts the wait instead of
//! counting lapses (the node was not listening, and what it missed is queued).

use std::collections::{BTreeMap, BTreeSet};

use super::{CHECK_QUORUM_LEASES, LEASE_MARGIN_DIVISOR, Replica};
use crate::PublicKey;
use crate::election::{Rejection, Succession};

/// Best effort counts a candidate unheard for this many leases as dead: a lossy
/// link between two live ones (a third of the messages lost for seconds) must not
/// make each count alone.
pub const BEST_EFFORT_DEAD_LEASES: u64 = 4;

/// How a run's candidates agree.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Mode {
    /// A majority of all the run's candidates elects, holds the lease and commits.
    Majority,
    /// A majority of the candidates heard within [`BEST_EFFORT_DEAD_LEASES`] leases
    /// (runs of 1–2).
    BestEffort,
}

impl Mode {
    /// The mode a run of `candidates` gets unless told otherwise: majority from 3.
    pub fn for_candidates(candidates: usize) -> Self {
        if candidates >= 3 { Self::Majority } else { Self::BestEffort }
    }

    /// Its name on the command line and in events.
    pub fn name(self) -> &'static str {
        match self {
            Self::Majority => "majority",
            Self::BestEffort => "best-effort",
        }
    }
}

/// What a candidate persists before it sends anything after a change.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct HardState {
    /// The highest term it took or followed.
    pub term: u64,
    /// Whom it voted for in `term`.
    pub voted_for: Option<PublicKey>,
}

/// A rule the fault simulator can leave out, to check that its invariants catch
/// the absence (`pcp-node simulate --faults --faults-without RULE`). Nothing else
/// should.
#[doc(hidden)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum LeftOut {
    /// Voters grant whatever state the campaigner holds.
    UpToDate,
    /// A new leader's state keeps the term that produced it (Raft's figure 8).
    CommitTerm,
}

/// What candidates send each other.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Message {
    /// The leader of `term` holds `state` (every candidate is to hold it too).
    Lease {
        /// The leader's term.
        term: u64,
        /// When it was sent, on the leader's clock (echoed in the answer).
        sent_ms: u64,
        /// The leader's latest state.
        state: Replica,
    },
    /// A candidate answers a lease (or says it now holds the leader's state).
    Answer {
        /// The term the answerer follows: above the leader's, the leader steps down.
        term: u64,
        /// The lease answered.
        sent_ms: u64,
        /// What the answerer holds.
        held: Option<Replica>,
    },
    /// The owner of `term` asks for a (pre-)vote.
    VoteRequest {
        /// The term it campaigns for.
        term: u64,
        /// Its state.
        held: Option<Replica>,
        /// A pre-vote: nobody changes state.
        pre: bool,
    },
    /// The answer to a [`Message::VoteRequest`].
    Vote {
        /// The term asked for, or the voter's own when higher.
        term: u64,
        /// Whether it is granted.
        granted: bool,
        /// The answer to a pre-vote.
        pre: bool,
    },
}

impl Message {
    /// The term it carries.
    pub fn term(&self) -> u64 {
        match *self {
            Self::Lease { term, .. }
            | Self::Answer { term, .. }
            | Self::VoteRequest { term, .. }
            | Self::Vote { term, .. } => term,
        }
    }
}

/// What a candidate is told.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Input {
    /// Time passes (a host ticks at least every lease / 5).
    Tick,
    /// A signed message from candidate `from`.
    Message {
        /// The signer.
        from: PublicKey,
        /// What it says.
        msg: Message,
    },
    /// This candidate now holds `state`: fetched and checked after
    /// [`Action::Fetch`], or completed by its own shepherd while leading.
    Holds(Replica),
    /// The leader's host gives up its term (it lost its workers).
    StepAside,
}

/// Why a candidate does not lead any more.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Stop {
    /// It saw `newer`, a higher term.
    Newer(u64),
    /// Its host stepped aside ([`Input::StepAside`]).
    Aside,
    /// Best effort: another candidate holds a newer state (the two led apart while
    /// cut off); it steps aside so that one leads.
    Behind,
}

/// What the host does.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Action {
    /// Write this before sending anything that follows it.
    Persist(HardState),
    /// Send `msg` to candidate `to`.
    Send {
        /// The candidate.
        to: PublicKey,
        /// The message.
        msg: Message,
    },
    /// Fetch `state`'s blob from `from` and answer [`Input::Holds`] once it is
    /// checked.
    Fetch {
        /// The state.
        state: Replica,
        /// Who holds it.
        from: PublicKey,
    },
    /// The state this candidate holds changed (a fetch landed, or a new leader's
    /// term was taken on the same parameters): keep it.
    Held(Replica),
    /// No lease of `term` was heard for a lease period.
    LeaseExpired {
        /// The term.
        term: u64,
        /// Its owner.
        leader: PublicKey,
    },
    /// This candidate's turn came for `term` and it asks for votes (`pre` first).
    Campaign {
        /// The term.
        term: u64,
        /// Whether these are pre-votes.
        pre: bool,
    },
    /// This candidate's turn came and it did not campaign: it holds no state, or
    /// may not vote yet.
    Deferred {
        /// The term passed over.
        term: u64,
    },
    /// `leader` leads `term`: this candidate follows it.
    Elected {
        /// The term.
        term: u64,
        /// Its leader.
        leader: PublicKey,
    },
    /// This candidate won `term`: lead from `from` (its state under the new term),
    /// whose round is not yet committed under it.
    Lead {
        /// The term.
        term: u64,
        /// The state to lead from.
        from: Replica,
    },
    /// A majority holds `state`: workers may learn of it (the announcement of the
    /// round after it).
    Commit(Replica),
    /// This candidate led `term` and stopped.
    Stopped {
        /// The term it led.
        term: u64,
        /// Why.
        why: Stop,
    },
    /// A message was refused.
    Rejected {
        /// Its signer.
        from: PublicKey,
        /// Why.
        reason: Rejection,
    },
}

/// A candidate's role.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Role {
    Follower,
    /// Campaigning for `term` (pre-votes while `pre`), with the grants so far.
    Campaign {
        term: u64,
        pre: bool,
        grants: BTreeSet<PublicKey>,
        asked_ms: u64,
    },
    Leader(Box<Lead>),
}

/// A leader's record of its followers.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Lead {
    /// Per follower: the latest lease it answered (send time), what it holds.
    answers: BTreeMap<PublicKey, (u64, Option<Replica>)>,
    /// When the last lease went out.
    sent_ms: u64,
    /// The latest state committed under this term.
    committed: Option<Replica>,
}

/// A coordinator candidate: follower, campaigner or leader of a run.
#[derive(Clone, Debug)]
pub struct Candidate {
    me: PublicKey,
    succession: Succession,
    lease_ms: u64,
    mode: Mode,
    hard: HardState,
    role: Role,
    held: Option<Replica>,
    /// Whether it may vote: true unless its host says it lost the state it held
    /// ([`Candidate::lost_state`]), until it holds a leader's state again (a
    /// candidate that lost its disk must not vote a state it helped commit out of
    /// existence).
    voter: bool,
    /// When a valid lease of the followed term was last heard (or the wait restarted).
    heard_ms: u64,
    /// When a valid lease was last heard from a leader: a pre-vote is refused
    /// within a lease of it.
    leader_heard_ms: Option<u64>,
    /// Lease periods that lapsed since.
    lapsed: u64,
    /// The highest term reported as lapsed.
    reported: u64,
    ticked_ms: u64,
    /// It takes no term before this (it stepped aside).
    not_before_ms: u64,
    /// When each other candidate was last heard (any message): best effort's
    /// majority counts these.
    seen: BTreeMap<PublicKey, u64>,
    /// The state being fetched, and when it was asked for.
    fetching: Option<(Replica, u64)>,
    /// The last lease heard from the followed leader (its send time), for answers.
    lease_sent_ms: u64,
    /// The term whose leader it last heard (reported once as elected).
    following: u64,
    /// Rules left out (the fault simulator's checks only).
    left_out: Option<LeftOut>,
}

impl Candidate {
    /// A candidate starting at `now_ms`: `hard` as persisted (`None`: a new
    /// candidate, which has voted in no term), holding `held`. The run's creator
    /// starting a new run is term 1's leader: use [`Candidate::create`].
    pub fn new(
        me: PublicKey,
        succession: Succession,
        lease_ms: u64,
        mode: Mode,
        hard: Option<HardState>,
        held: Option<Replica>,
        now_ms: u64,
    ) -> Self {
        let lease_ms = lease_ms.max(1);
        Self {
            me,
            succession,
            lease_ms,
            mode,
            hard: hard.unwrap_or_default(),
            role: Role::Follower,
            held,
            voter: true,
            heard_ms: now_ms,
            leader_heard_ms: None,
            lapsed: 0,
            reported: 0,
            ticked_ms: now_ms,
            not_before_ms: 0,
            seen: BTreeMap::new(),
            fetching: None,
            lease_sent_ms: 0,
            following: 0,
            left_out: None,
        }
    }

    /// Leaves `rule` out: for the fault simulator only.
    #[doc(hidden)]
    pub fn leave_out(mut self, rule: LeftOut) -> Self {
        self.left_out = Some(rule);
        self
    }

    /// The creator of a new run: term 1's leader from the initial state, which the
    /// manifest commits. Its actions: persist term 1, lead, commit the initial state.
    pub fn create(
        me: PublicKey,
        succession: Succession,
        lease_ms: u64,
        mode: Mode,
        initial: Replica,
        now_ms: u64,
    ) -> (Self, Vec<Action>) {
        let mut c = Self::new(me, succession, lease_ms, mode, Some(HardState::default()), None, now_ms);
        let initial = Replica { term: 1, ..initial };
        c.hard = HardState { term: 1, voted_for: Some(me) };
        c.held = Some(initial);
        let mut out = vec![Action::Persist(c.hard), Action::Held(initial)];
        c.become_leader(initial, now_ms, &mut out);
        // the manifest carries the initial state: it is committed from the start
        if let Role::Leader(l) = &mut c.role {
            l.committed = Some(initial);
        }
        out.push(Action::Commit(initial));
        (c, out)
    }

    /// This candidate kept its term and vote but lost the state it held (its disk
    /// was restored without the state's blob, say): it holds nothing, and may not
    /// vote until it holds a leader's state again, or a majority could elect a
    /// candidate behind a round it helped commit.
    pub fn lost_state(mut self) -> Self {
        self.voter = self.succession.order() == [self.me];
        self.held = None;
        self
    }

    /// This candidate's key.
    pub fn me(&self) -> PublicKey {
        self.me
    }

    /// The run's succession.
    pub fn succession(&self) -> &Succession {
        &self.succession
    }

    /// The lease, ms.
    pub fn lease_ms(&self) -> u64 {
        self.lease_ms
    }

    /// The mode.
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// What it persists.
    pub fn hard_state(&self) -> HardState {
        self.hard
    }

    /// The term it follows, leads or campaigns for.
    pub fn term(&self) -> u64 {
        self.hard.term
    }

    /// The state it holds.
    pub fn held(&self) -> Option<Replica> {
        self.held
    }

    /// Whether it leads.
    pub fn is_leader(&self) -> bool {
        matches!(self.role, Role::Leader(_))
    }

    /// The leader it follows (itself when leading), once it knows one.
    pub fn leader(&self) -> Option<PublicKey> {
        (self.hard.term > 0).then(|| self.succession.leader(self.hard.term))
    }

    /// The term whose leader it last heard (its own while leading) and that leader:
    /// what it tells workers to follow. A term it campaigned for and lost is not one.
    pub fn following(&self) -> Option<(u64, PublicKey)> {
        if self.is_leader() {
            return Some((self.hard.term, self.me));
        }
        (self.following > 0).then(|| (self.following, self.succession.leader(self.following)))
    }

    /// The candidate whose lease it awaits: its term's owner, or, after `k` lapses,
    /// the owner of the term `k` later. Workers and followers heartbeat it.
    pub fn awaited(&self) -> PublicKey {
        if self.is_leader() { self.me } else { self.succession.leader(self.hard.term.max(1) + self.lapsed) }
    }

    /// The latest state committed under this leader's term.
    pub fn committed(&self) -> Option<Replica> {
        match &self.role {
            Role::Leader(l) => l.committed,
            _ => None,
        }
    }

    /// Whether the leader may act: a majority answered a lease sent within
    /// `lease − lease/4`. False when it does not lead.
    pub fn may_act(&self, now_ms: u64) -> bool {
        let Role::Leader(l) = &self.role else { return false };
        let fresh = self.lease_ms - self.lease_ms / LEASE_MARGIN_DIVISOR;
        let answered = l.answers.values().filter(|(sent, _)| now_ms < sent.saturating_add(fresh)).count();
        answered + 1 >= self.quorum(now_ms)
    }

    /// How many candidates make a majority now.
    fn quorum(&self, now_ms: u64) -> usize {
        let n = match self.mode {
            Mode::Majority => self.succession.order().len(),
            Mode::BestEffort => {
                let live = BEST_EFFORT_DEAD_LEASES * self.lease_ms;
                1 + self
                    .succession
                    .order()
                    .iter()
                    .filter(|k| **k != self.me)
                    .filter(|k| self.seen.get(*k).is_some_and(|at| now_ms.saturating_sub(*at) < live))
                    .count()
            }
        };
        n / 2 + 1
    }

    /// One input at `now_ms`.
    pub fn handle(&mut self, input: Input, now_ms: u64) -> Vec<Action> {
        let mut out = Vec::new();
        match input {
            Input::Tick => self.tick(now_ms, &mut out),
            Input::Message { from, msg } => self.message(from, msg, now_ms, &mut out),
            Input::Holds(state) => self.holds(state, now_ms, &mut out),
            Input::StepAside => {
                if self.is_leader() {
                    self.stop(Stop::Aside, now_ms, &mut out);
                    self.not_before_ms = now_ms + CHECK_QUORUM_LEASES * self.lease_ms;
                }
            }
        }
        out
    }

    fn others(&self) -> impl Iterator<Item = PublicKey> + '_ {
        self.succession.order().iter().copied().filter(move |k| *k != self.me)
    }

    fn broadcast(&self, msg: Message, out: &mut Vec<Action>) {
        out.extend(self.others().map(|to| Action::Send { to, msg }));
    }

    fn tick(&mut self, now_ms: u64, out: &mut Vec<Action>) {
        let stalled = now_ms.saturating_sub(self.ticked_ms) > self.lease_ms / 2;
        self.ticked_ms = now_ms;
        if stalled {
            // not listening meanwhile: the others' messages are queued, not missing
            for at in self.seen.values_mut() {
                *at = (*at).max(now_ms.saturating_sub(self.lease_ms));
            }
        }
        if let Role::Leader(l) = &self.role {
            // a leader that lost its majority stops acting (see `may_act`) but keeps
            // its term: a higher one reaches it once the cut heals
            if now_ms.saturating_sub(l.sent_ms) >= self.lease_ms / 3 {
                self.send_leases(now_ms, out);
            }
            self.try_commit(now_ms, out);
            return;
        }
        if let Some(state) = self.held.filter(|_| self.succession.order() == [self.me]) {
            // alone: nobody else can take its term, so it leads that term again at once
            // (a resumed shepherd keeps the term its workers follow)
            let hard = HardState { term: self.hard.term.max(1), voted_for: Some(self.me) };
            if hard != self.hard {
                self.hard = hard;
                out.push(Action::Persist(hard));
            }
            self.become_leader(state, now_ms, out);
            return;
        }
        if stalled {
            self.heard_ms = self.heard_ms.max(now_ms.saturating_sub(self.lease_ms / 2));
        }
        if let Role::Campaign { term, pre, asked_ms, .. } = self.role.clone()
            && now_ms.saturating_sub(asked_ms) >= self.lease_ms / 4
        {
            // ask again whoever has not granted (a request may have been lost)
            self.ask(term, pre, now_ms, out);
        }
        if now_ms.saturating_sub(self.heard_ms) < self.lease_ms {
            return;
        }
        let lapsed_term = self.hard.term.max(1) + self.lapsed;
        if lapsed_term > self.reported {
            self.reported = lapsed_term;
            out.push(Action::LeaseExpired { term: lapsed_term, leader: self.succession.leader(lapsed_term) });
        }
        self.lapsed += 1;
        self.heard_ms = now_ms;
        self.role = Role::Follower;
        let next = self.hard.term.max(1) + self.lapsed;
        if self.succession.leader(next) != self.me {
            return;
        }
        if self.held.is_none() || !self.voter || now_ms < self.not_before_ms {
            out.push(Action::Deferred { term: next });
            return;
        }
        self.role = Role::Campaign { term: next, pre: true, grants: BTreeSet::from([self.me]), asked_ms: now_ms };
        out.push(Action::Campaign { term: next, pre: true });
        self.ask(next, true, now_ms, out);
        self.check_votes(now_ms, out);
    }

    /// Sends (pre-)vote requests to the candidates that have not granted.
    fn ask(&mut self, term: u64, pre: bool, now_ms: u64, out: &mut Vec<Action>) {
        let Role::Campaign { grants, asked_ms, .. } = &mut self.role else { return };
        *asked_ms = now_ms;
        let msg = Message::VoteRequest { term, held: self.held, pre };
        let grants = grants.clone();
        out.extend(self.others().filter(|k| !grants.contains(k)).map(|to| Action::Send { to, msg }));
    }

    fn send_leases(&mut self, now_ms: u64, out: &mut Vec<Action>) {
        let (Role::Leader(l), Some(state)) = (&mut self.role, self.held) else { return };
        l.sent_ms = now_ms;
        self.broadcast(Message::Lease { term: self.hard.term, sent_ms: now_ms, state }, out);
    }

    /// A majority holds the leader's state: commit it.
    fn try_commit(&mut self, now_ms: u64, out: &mut Vec<Action>) {
        let quorum = self.quorum(now_ms);
        let (Role::Leader(l), Some(state)) = (&mut self.role, self.held) else { return };
        if l.committed == Some(state) {
            return;
        }
        let holders = 1 + l.answers.values().filter(|(_, held)| *held == Some(state)).count();
        if holders >= quorum {
            l.committed = Some(state);
            out.push(Action::Commit(state));
        }
    }

    fn become_leader(&mut self, state: Replica, now_ms: u64, out: &mut Vec<Action>) {
        let term = self.hard.term;
        // under a majority the state takes the new term (Raft's no-op entry); best
        // effort keeps the term that produced it: a candidate that led alone (cut
        // off, without workers) must not outrank the rounds the other one completed
        let from = match self.mode {
            Mode::Majority if self.left_out != Some(LeftOut::CommitTerm) => Replica { term, ..state },
            _ => state,
        };
        self.held = Some(from);
        self.lapsed = 0;
        self.fetching = None;
        self.following = term;
        self.role = Role::Leader(Box::new(Lead { answers: BTreeMap::new(), sent_ms: now_ms, committed: None }));
        out.push(Action::Held(from));
        out.push(Action::Elected { term, leader: self.me });
        out.push(Action::Lead { term, from });
        self.send_leases(now_ms, out);
        self.try_commit(now_ms, out);
    }

    /// Leading stops: it follows its own term as lapsed, so the next owner's turn
    /// comes a lease later.
    fn stop(&mut self, why: Stop, now_ms: u64, out: &mut Vec<Action>) {
        if !self.is_leader() {
            return;
        }
        out.push(Action::Stopped { term: self.hard.term, why });
        self.role = Role::Follower;
        if matches!(why, Stop::Newer(_)) {
            return;
        }
        self.lapsed = 1;
        self.reported = self.reported.max(self.hard.term);
        self.heard_ms = now_ms;
        self.ticked_ms = now_ms;
    }

    /// Takes a higher term `term` (led by its owner).
    fn adopt(&mut self, term: u64, now_ms: u64, out: &mut Vec<Action>) {
        if term <= self.hard.term {
            return;
        }
        self.stop(Stop::Newer(term), now_ms, out);
        self.role = Role::Follower;
        self.fetching = None;
        self.hard = HardState { term, voted_for: None };
        self.lapsed = 0;
        self.heard_ms = now_ms;
        out.push(Action::Persist(self.hard));
    }

    fn message(&mut self, from: PublicKey, msg: Message, now_ms: u64, out: &mut Vec<Action>) {
        if from == self.me {
            return;
        }
        if !self.succession.contains(&from) {
            out.push(Action::Rejected { from, reason: Rejection::NotCandidate });
            return;
        }
        self.seen.insert(from, now_ms);
        match msg {
            Message::Lease { term, sent_ms, state } => self.lease(from, term, sent_ms, state, now_ms, out),
            Message::Answer { term, sent_ms, held } => {
                if term > self.hard.term {
                    self.adopt(term, now_ms, out);
                    return;
                }
                if self.mode == Mode::BestEffort
                    && self.is_leader()
                    && term == self.hard.term
                    && Self::rank(held) > Self::rank(self.held)
                {
                    // best effort: the two led apart; the newer state's holder leads
                    self.stop(Stop::Behind, now_ms, out);
                    self.not_before_ms = now_ms + CHECK_QUORUM_LEASES * self.lease_ms;
                    return;
                }
                if let Role::Leader(l) = &mut self.role
                    && term == self.hard.term
                {
                    let e = l.answers.entry(from).or_insert((0, None));
                    e.0 = e.0.max(sent_ms);
                    e.1 = held;
                    self.try_commit(now_ms, out);
                }
            }
            Message::VoteRequest { term, held, pre } => self.vote(from, term, held, pre, now_ms, out),
            Message::Vote { term, granted, pre } => {
                if term > self.hard.term && !(pre && granted) {
                    self.adopt(term, now_ms, out);
                    return;
                }
                let Role::Campaign { term: t, pre: p, grants, .. } = &mut self.role else { return };
                if *t == term && *p == pre && granted {
                    grants.insert(from);
                    self.check_votes(now_ms, out);
                }
            }
        }
    }

    /// A campaign with a majority of grants moves on: from pre-votes to votes, from
    /// votes to leading.
    fn check_votes(&mut self, now_ms: u64, out: &mut Vec<Action>) {
        let quorum = self.quorum(now_ms);
        let Role::Campaign { term, pre, grants, .. } = &self.role else { return };
        if grants.len() < quorum {
            return;
        }
        let term = *term;
        if *pre {
            // the real vote: take the term and vote for itself first
            self.hard = HardState { term, voted_for: Some(self.me) };
            self.lapsed = 0;
            self.heard_ms = now_ms;
            out.push(Action::Persist(self.hard));
            out.push(Action::Campaign { term, pre: false });
            self.role = Role::Campaign { term, pre: false, grants: BTreeSet::from([self.me]), asked_ms: now_ms };
            self.ask(term, false, now_ms, out);
            self.check_votes(now_ms, out);
            return;
        }
        let Some(state) = self.held else { return };
        self.become_leader(state, now_ms, out);
    }

    fn rank(held: Option<Replica>) -> (u64, u64) {
        held.map_or((0, 0), |r| r.rank())
    }

    fn vote(
        &mut self,
        from: PublicKey,
        term: u64,
        held: Option<Replica>,
        pre: bool,
        now_ms: u64,
        out: &mut Vec<Action>,
    ) {
        // a refused pre-vote names the voter's own term (the campaigner takes it only
        // when higher than its own); a refused vote the higher of the two
        let refuse = |c: &Self, out: &mut Vec<Action>| {
            let term = if pre { c.hard.term } else { term.max(c.hard.term) };
            out.push(Action::Send { to: from, msg: Message::Vote { term, granted: false, pre } });
        };
        if self.succession.leader(term) != from {
            out.push(Action::Rejected { from, reason: Rejection::NotTheirTurn { term } });
            return refuse(self, out);
        }
        // a candidate that lost its disk votes once it holds a leader's state again (under
        // a majority it could vote a committed round out of existence); best effort has
        // no such guarantee to keep, and a live candidate holding nothing would block
        let abstains = !self.voter && self.mode == Mode::Majority;
        let behind = Self::rank(held) < Self::rank(self.held) && self.left_out != Some(LeftOut::UpToDate);
        if term < self.hard.term || abstains || behind {
            return refuse(self, out);
        }
        if pre {
            // a live leader (this one, or the one followed) keeps its term
            let leading = self.may_act(now_ms);
            let followed = self.leader_heard_ms.is_some_and(|at| now_ms.saturating_sub(at) < self.lease_ms);
            if leading || followed || term <= self.hard.term {
                return refuse(self, out);
            }
            out.push(Action::Send { to: from, msg: Message::Vote { term, granted: true, pre } });
            return;
        }
        self.adopt(term, now_ms, out);
        if self.hard.voted_for.is_some_and(|v| v != from) {
            return refuse(self, out);
        }
        if self.hard.voted_for.is_none() {
            self.hard.voted_for = Some(from);
            out.push(Action::Persist(self.hard));
        }
        self.heard_ms = now_ms;
        out.push(Action::Send { to: from, msg: Message::Vote { term, granted: true, pre } });
    }

    fn lease(&mut self, from: PublicKey, term: u64, sent_ms: u64, state: Replica, now_ms: u64, out: &mut Vec<Action>) {
        if self.succession.leader(term) != from || term == 0 {
            out.push(Action::Rejected { from, reason: Rejection::NotTheirTurn { term } });
            return;
        }
        if term < self.hard.term {
            out.push(Action::Rejected { from, reason: Rejection::Stale { term, current: self.hard.term } });
            let msg = Message::Answer { term: self.hard.term, sent_ms, held: self.held };
            out.push(Action::Send { to: from, msg });
            return;
        }
        if term > self.hard.term {
            self.adopt(term, now_ms, out);
        }
        if !matches!(self.role, Role::Follower) {
            // a campaign for this term lost to... nobody else can hold it; a leader of it is this node
            if self.is_leader() {
                return;
            }
            self.role = Role::Follower;
        }
        if self.following != term || self.lapsed > 0 {
            self.following = term;
            out.push(Action::Elected { term, leader: from });
        }
        self.heard_ms = now_ms;
        self.leader_heard_ms = Some(now_ms);
        self.lapsed = 0;
        self.lease_sent_ms = sent_ms;
        match self.held {
            Some(h) if h == state => {}
            // best effort: a leader behind this candidate's state (they led apart)
            // hears so in the answer, and steps aside
            Some(h) if self.mode == Mode::BestEffort && h.rank() > state.rank() => {}
            // the same round and parameters: the new leader's term is taken at once
            Some(h) if h.round == state.round && h.params == state.params => {
                self.held = Some(state);
                out.push(Action::Held(state));
            }
            _ => {
                let asked = self.fetching.is_some_and(|(s, at)| s == state && now_ms < at + self.lease_ms);
                if !asked {
                    self.fetching = Some((state, now_ms));
                    out.push(Action::Fetch { state, from });
                }
            }
        }
        if self.held == Some(state) {
            // it holds what the run's leader holds: it may vote from now on
            self.voter = true;
        }
        let msg = Message::Answer { term: self.hard.term, sent_ms, held: self.held };
        out.push(Action::Send { to: from, msg });
    }

    fn holds(&mut self, state: Replica, now_ms: u64, out: &mut Vec<Action>) {
        if self.is_leader() {
            // its shepherd completed a round: the new state goes to the candidates
            if state.term == self.hard.term && Self::rank(Some(state)) > Self::rank(self.held) {
                self.held = Some(state);
                out.push(Action::Held(state));
                self.send_leases(now_ms, out);
                self.try_commit(now_ms, out);
            }
            return;
        }
        // a fetch landed: the followed leader's state, asked for under the term this
        // candidate follows (a higher term since drops the fetch), or the run's
        // initial state by a candidate holding nothing (which does not make it a voter)
        let wanted = self.fetching.is_some_and(|(s, _)| s == state);
        if !wanted && self.held.is_some() {
            return;
        }
        if wanted {
            self.fetching = None;
            // the leader's state, fetched: it may vote from now on
            self.voter = true;
        }
        self.held = Some(state);
        out.push(Action::Held(state));
        if let Some(leader) = self.leader().filter(|l| *l != self.me) {
            // the leader may be waiting for this to commit
            let msg = Message::Answer { term: self.hard.term, sent_ms: self.lease_sent_ms, held: self.held };
            out.push(Action::Send { to: leader, msg });
        }
    }
}

pub mod trace;

#[cfg(test)]
mod tests;
