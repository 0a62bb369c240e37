//! A worker's side of the run's failover: whose leases it takes, and which
//! announced rounds it trains. Sans-IO, `(state, input, now) -> actions`, as the
//! node's worker and the fault simulator (`pcp-node simulate --faults`) both
//! drive it.
//!
//! * [`Leases`]: the run's [`Election`] as a follower. A lease (a round
//!   announcement, the leader's heartbeat, either gossiped) counts only if its
//!   signer is the candidate whose turn its term is, and the term is not below
//!   the one the worker follows. A higher term is saved ([`Action::SaveTerm`])
//!   before the worker follows its leader ([`Action::Follow`]), so a restart
//!   never follows a lower one.
//! * [`Rounds`]: the announcements it acts on. One is taken only if it opens
//!   later than the last one taken ([`Opening`]'s order: term, round, then when
//!   it opened, so a leader that reopens a round is heard). A round the worker
//!   trains must be one its [`Chain`] admits, a later round or the same round
//!   from the same parameters, and the chain is saved ([`Action::SaveChain`])
//!   before the worker trains from it: a worker never moves back nor onto
//!   another branch, across restarts too.
//! * [`moot`] and [`newer`]: what makes a send, a fetch or steps under way
//!   moot.
//!
//! [`Follower`] holds both, for a host with one owner; the node keeps
//! [`Leases`] on its heartbeat task and [`Rounds`] on its training loop.

use crate::PublicKey;
use crate::election::{self, Election, Succession};
use crate::failover::{Behind, Chain};

/// What the host carries out, in order, before it acts on what it was given.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Keep this term on disk: the highest the worker followed.
    SaveTerm(u64),
    /// Follow `leader` from `term` on: heartbeat it and fetch from it.
    Follow {
        /// The new term.
        term: u64,
        /// Its leader.
        leader: PublicKey,
    },
    /// A lease was refused (record it).
    Rejected {
        /// Its signer.
        from: PublicKey,
        /// The term it claimed.
        term: u64,
        /// Why.
        reason: election::Rejection,
    },
    /// Keep this chain on disk before training from it.
    SaveChain(Chain),
}

/// Which opening of a round an announcement is. Ordered by term, then round,
/// then `opened_ms`: a higher term's announcement is newer whatever its round (a
/// successor may reopen an earlier round), and a leader that restarted within
/// its term and reopened a round opened it later.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Opening {
    /// The term it was announced under.
    pub term: u64,
    /// The round.
    pub round: u64,
    /// When it opened, on the leader's clock (pcp-node: the round's deadline).
    pub opened_ms: u64,
}

/// A verified round announcement, as the follower sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Announced {
    /// Which opening it is.
    pub opening: Opening,
    /// The parameters the round starts from (`None`: it names none).
    pub base: Option<[u8; 32]>,
    /// Whether this worker is among its participants.
    pub participant: bool,
    /// It announces the run's end.
    pub finished: bool,
}

/// What an announcement asks of the worker.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Take {
    /// The run is over.
    Finished,
    /// Not later than the last one taken: nothing new.
    Seen,
    /// A round to train that the worker's chain does not admit: it sits the
    /// round out.
    Refused(Behind),
    /// Taken: a round to train ([`Take::Train`]), or one it is not in.
    Skip,
    /// Taken: train this round (its chain is saved first).
    Train,
}

/// The run's election, as a follower ([module docs](self)).
#[derive(Clone, Debug)]
pub struct Leases {
    election: Election,
    /// The highest term saved.
    saved: u64,
}

impl Leases {
    /// A follower of `succession` that saved `term` (0: none) before, at `now_ms`.
    pub fn new(me: PublicKey, succession: Succession, lease_ms: u64, term: u64, now_ms: u64) -> Self {
        Self { election: Election::resume(me, succession, lease_ms, term, now_ms), saved: term }
    }

    /// A lease of `term` signed by `from`: whether it counts, and what to do.
    pub fn lease(&mut self, from: PublicKey, term: u64, now_ms: u64) -> (bool, Vec<Action>) {
        let mut valid = true;
        let mut actions = Vec::new();
        for action in self.election.on_lease(from, term, now_ms) {
            match action {
                election::Action::Rejected { from, reason } => {
                    valid = false;
                    actions.push(Action::Rejected { from, term, reason });
                }
                election::Action::Elected { term, leader } => {
                    if term > self.saved {
                        self.saved = term;
                        actions.push(Action::SaveTerm(term));
                    }
                    actions.push(Action::Follow { term, leader });
                }
                _ => {}
            }
        }
        (valid, actions)
    }

    /// Time passes: the terms whose lease lapsed, and the candidate each names
    /// (the worker heartbeats [`Self::awaited`] from now on).
    pub fn tick(&mut self, now_ms: u64) -> Vec<(u64, PublicKey)> {
        let lapsed = self.election.tick(now_ms).into_iter();
        lapsed
            .filter_map(|a| match a {
                election::Action::LeaseExpired { term, leader } => Some((term, leader)),
                _ => None,
            })
            .collect()
    }

    /// The term followed.
    pub fn term(&self) -> u64 {
        self.election.term()
    }

    /// The leader followed.
    pub fn leader(&self) -> PublicKey {
        self.election.leader()
    }

    /// The candidate whose lease the worker awaits (its heartbeats go there).
    pub fn awaited(&self) -> PublicKey {
        self.election.awaited()
    }
}

/// The announcements a worker takes ([module docs](self)).
#[derive(Clone, Debug, Default)]
pub struct Rounds {
    chain: Chain,
    /// The last announcement taken.
    seen: Option<Opening>,
    /// The fault simulator leaves the chain out, to show what it prevents.
    unchained: bool,
}

impl Rounds {
    /// A worker that saved `chain` before (`Chain::default()`: none).
    pub fn new(chain: Chain) -> Self {
        Self { chain, seen: None, unchained: false }
    }

    /// Leaves the chain's check out: any later announcement is trained (the fault
    /// simulator's `--faults-without chain`).
    pub fn leave_out_chain(mut self) -> Self {
        self.unchained = true;
        self
    }

    /// The chain followed.
    pub fn chain(&self) -> Chain {
        self.chain
    }

    /// The last announcement taken.
    pub fn seen(&self) -> Option<Opening> {
        self.seen
    }

    /// Whether `a` would be taken: the run's end, or later than the last one taken.
    pub fn is_new(&self, a: &Announced) -> bool {
        a.finished || Some(a.opening) > self.seen
    }

    /// An announcement whose lease counted: what it asks, and what to save first.
    pub fn announced(&mut self, a: &Announced) -> (Take, Option<Action>) {
        if a.finished {
            return (Take::Finished, None);
        }
        if a.opening.round == 0 || !self.is_new(a) {
            return (Take::Seen, None);
        }
        self.seen = Some(a.opening);
        let Some(base) = a.base.filter(|_| a.participant) else { return (Take::Skip, None) };
        let Opening { term, round, .. } = a.opening;
        if !self.unchained
            && let Err(behind) = self.chain.admits(term, round, &base)
        {
            return (Take::Refused(behind), None);
        }
        self.chain.follow(term, round, base);
        (Take::Train, Some(Action::SaveChain(self.chain)))
    }
}

/// Both halves, for a host that owns them together.
#[derive(Clone, Debug)]
pub struct Follower {
    /// Whose leases it takes.
    pub leases: Leases,
    /// Which rounds it trains.
    pub rounds: Rounds,
}

impl Follower {
    /// A worker starting with what it saved: `term` and `chain` (0 and
    /// `Chain::default()`: nothing).
    pub fn new(me: PublicKey, succession: Succession, lease_ms: u64, term: u64, chain: Chain, now_ms: u64) -> Self {
        let term = term.max(chain.term);
        Self { leases: Leases::new(me, succession, lease_ms, term, now_ms), rounds: Rounds::new(chain) }
    }
}

/// Whether `latest` (the newest announcement heard) makes a send for `current`
/// moot: a newer term (the leader changed), the same round opened again (the send
/// went to its old opening), a round two or more past it, or the run's end. The
/// next round of the same term does not: the contribution that closes a round is
/// answered after the next round is announced.
pub fn moot(current: Opening, latest: &Announced) -> bool {
    let a = latest.opening;
    a.term > current.term
        || latest.finished
        || a.round >= current.round + 2
        || (a.round == current.round && a > current)
}

/// Whether `latest` is newer than `current` (or the run's end): what makes a fetch
/// for `current` moot.
pub fn newer(current: Opening, latest: &Announced) -> bool {
    latest.opening > current || latest.finished
}

#[cfg(test)]
mod tests;
