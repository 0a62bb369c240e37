//! Failover: who leads a run, when a round is committed, which contributions a
//! leader may apply, and which rounds a worker may follow. The rules pcp-node runs
//! and the fault simulator (`pcp-node simulate --faults`) checks, sans-IO like the
//! rest of this crate: time comes in as milliseconds of a clock that counts
//! suspend.
//!
//! * **The candidate** ([`Candidate`]): Raft's election, lease and commit on a log
//!   of one state per round, with the run's fixed succession as a priority (see
//!   [`candidate`]).
//! * **Check-quorum** ([`Quorum`]): a leader that hears from no majority of its last
//!   round's contributors for [`CHECK_QUORUM_LEASES`] lease periods steps aside,
//!   so that a candidate the workers can reach takes over.
//! * **Fencing** ([`Fence`]): a contribution names the term, the round and the
//!   parameters hash it was trained from; any other is refused.
//! * **Workers never move back** ([`Chain`]): a worker follows an announcement only
//!   if it extends what it applied: a later round, from the parameters it holds
//!   when the round is the next one.

use std::collections::BTreeMap;

pub mod candidate;

pub use candidate::{Candidate, HardState, Mode};

use crate::PublicKey;

/// A leader that hears from no majority of its last round's contributors for this
/// many lease periods steps aside.
pub const CHECK_QUORUM_LEASES: u64 = 3;

/// The leader's margin: it acts only on leases a majority answered within
/// `lease − lease / 4`, so it stops before a follower's lease (which runs from
/// when it received the lease, later than it was sent) can expire, with clocks
/// whose rates differ by up to 25 % over one lease.
pub const LEASE_MARGIN_DIVISOR: u64 = 4;

/// A candidate's state, by its place in the run's history: the term of the leader
/// that last committed it (a new leader takes the state it leads from into its
/// own term), the rounds it completed, and its parameters hash.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct Replica {
    /// The term whose leader last committed it (or completed it, until then).
    pub term: u64,
    /// Rounds completed.
    pub round: u64,
    /// The parameters after `round`.
    pub params: [u8; 32],
}

impl Replica {
    /// The order of states: the term first, then the round. A deposed term's longer
    /// branch ranks below what a later term committed.
    pub fn rank(&self) -> (u64, u64) {
        (self.term, self.round)
    }

    /// Whether this state supersedes `held`.
    pub fn newer_than(&self, held: &Replica) -> bool {
        self.rank() > held.rank()
    }
}

/// Check-quorum: the leader's record of which of its last round's contributors it
/// still hears from.
#[derive(Clone, Debug)]
pub struct Quorum {
    window_ms: u64,
    /// The last completed round's contributors, and when each was last heard.
    expected: BTreeMap<PublicKey, u64>,
    /// Other workers following this leader, and when each was last heard: they
    /// stand in for contributors gone for good (bounded by [`Quorum::OTHERS`]).
    others: BTreeMap<PublicKey, u64>,
    /// When the current set was installed: no verdict for a window after.
    since_ms: u64,
    /// The previous [`Quorum::check`]: a check long after it restarts the window.
    checked_ms: u64,
    /// Workers enough to close a round: a leader that hears this many is not cut
    /// off, whatever became of the rest of its last round's contributors.
    needed: usize,
}

impl Quorum {
    /// A quorum check over `window_ms` (at least [`CHECK_QUORUM_LEASES`] leases).
    pub fn new(window_ms: u64, now_ms: u64) -> Self {
        Self {
            window_ms: window_ms.max(1),
            expected: BTreeMap::new(),
            others: BTreeMap::new(),
            since_ms: now_ms,
            checked_ms: now_ms,
            needed: usize::MAX,
        }
    }

    /// A leader that hears `needed` workers (what closes a round: the shepherd's
    /// minimum quorum, at least one) keeps its term even when that is no majority
    /// of its last round's contributors: some of them may be gone for good, and
    /// every candidate would hear as few (terms would churn, rounds never close).
    pub fn needing(mut self, needed: usize) -> Self {
        self.needed = needed.max(1);
        self
    }

    /// The most other workers it remembers.
    pub const OTHERS: usize = 4096;

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
            return;
        }
        self.others.insert(*peer, now_ms);
        if self.others.len() > Self::OTHERS {
            // the one heard longest ago goes
            let oldest = self.others.iter().min_by_key(|(_, at)| **at).map(|(k, _)| *k);
            if let Some(k) = oldest {
                self.others.remove(&k);
            }
        }
    }

    /// How many workers following this leader were heard within the window (the
    /// expected contributors, and others in place of those gone), of how many
    /// contributors the last round had.
    pub fn heard_of(&self, now_ms: u64) -> (usize, usize) {
        let fresh = |at: &&u64| now_ms.saturating_sub(**at) < self.window_ms;
        let heard = self.expected.values().filter(fresh).count() + self.others.values().filter(fresh).count();
        (heard.min(self.expected.len()), self.expected.len())
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
    /// round's contributors within the window, nor from as many workers as close a
    /// round ([`Quorum::needing`]) (never before a round completed, nor within a
    /// window of the first).
    pub fn lost(&self, now_ms: u64) -> bool {
        let (heard, of) = self.heard_of(now_ms);
        of > 0 && now_ms.saturating_sub(self.since_ms) >= self.window_ms && heard < (of / 2 + 1).min(self.needed)
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
    /// Trained under a later term than this leader's: a newer leader exists.
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
    ///
    /// An earlier term's contribution to the same round from the same parameters
    /// is taken: it is the same work, and a successor that resumed from the state
    /// its predecessor announced the round from reopens that round, and the
    /// workers send what they trained for it to the new leader.
    pub fn check(&self, term: u64, round: u64, params: &[u8; 32]) -> Result<(), Fenced> {
        if term > self.term {
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

    const LEASE: u64 = 1000;

    fn key(i: u8) -> PublicKey {
        PublicKey([i; 32])
    }

    fn replica(term: u64, round: u64) -> Replica {
        Replica { term, round, params: [round as u8; 32] }
    }

    /// H2: a state a later term committed supersedes a deposed term's longer branch.
    #[test]
    fn a_newer_term_supersedes_a_longer_deposed_branch() {
        assert!(replica(2, 7).newer_than(&replica(1, 8)));
        assert!(!replica(1, 8).newer_than(&replica(2, 7)));
        assert!(replica(2, 8).newer_than(&replica(2, 7)));
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
        }
        assert!(q.lost(30_000), "one of three heard");
        assert_eq!(q.heard_of(30_000), (1, 3));
        // another worker following this leader stands in for a contributor gone for good
        for t in (30_500..=31_000).step_by(500) {
            q.heard(&key(10), t);
            q.heard(&key(99), t);
        }
        assert!(!q.lost(31_000), "two heard, one of them not a contributor");
        assert_eq!(q.heard_of(31_000), (2, 3));
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
    fn a_worker_never_moves_back_nor_onto_another_branch() {
        let mut w = Chain::default();
        assert_eq!(w.admits(1, 5, &[1; 32]), Ok(()), "a joiner follows anything");
        w.follow(1, 5, [1; 32]);
        assert_eq!(w.admits(2, 5, &[1; 32]), Ok(()), "a successor reopening the round");
        assert_eq!(w.admits(2, 5, &[2; 32]), Err(Behind::Fork { round: 5 }));
        assert_eq!(w.admits(2, 4, &[0; 32]), Err(Behind::Round { round: 4, trained: 5 }));
        assert_eq!(w.admits(1, 6, &[3; 32]), Ok(()));
    }

    /// M2: a contribution for a later term, another round or other parameters is
    /// refused; an earlier term's for this round from these parameters is the
    /// same work and taken.
    #[test]
    fn contributions_are_fenced_by_term_round_and_parameters() {
        let f = Fence { term: 2, round: 7, params: [7; 32] };
        assert_eq!(f.check(2, 7, &[7; 32]), Ok(()));
        assert_eq!(f.check(1, 7, &[7; 32]), Ok(()));
        assert_eq!(f.check(3, 7, &[7; 32]), Err(Fenced::Term { got: 3, expected: 2 }));
        assert_eq!(f.check(1, 8, &[7; 32]), Err(Fenced::Round { got: 8, expected: 7 }));
        assert!(matches!(f.check(1, 7, &[6; 32]), Err(Fenced::Params { .. })));
        assert_eq!(f.check(2, 8, &[7; 32]), Err(Fenced::Round { got: 8, expected: 7 }));
        assert!(matches!(f.check(2, 7, &[6; 32]), Err(Fenced::Params { .. })));
        assert!(f.check(2, 7, &[6; 32]).unwrap_err().to_string().contains("060606060606"));
    }
}
