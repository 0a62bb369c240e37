//! Who may lead a run: the acting shepherd holds a lease, renewed by its signed
//! heartbeats, and when the lease lapses the next candidate in a fixed succession
//! asks for the next term.
//!
//! The run manifest names the creator and the other coordinator candidates. The
//! succession is the creator first, then the others ordered by
//! `blake3(run ‖ key)`, and **term `t` belongs to exactly one candidate**: the
//! `(t − 1) mod n`-th. Every node computes the same succession from the manifest,
//! and a lease for term `t` is valid only when signed by term `t`'s candidate.
//! When a candidate has heard no valid lease for `lease_ms`, the term it waits for
//! moves on by one; when that term is its own, it campaigns. A dead successor costs one more lease period (the term after
//! it comes up), so `k` dead candidates in a row delay failover by `k + 1` leases.
//!
//! A term's owner still needs votes to lead it (see
//! [`crate::failover::candidate`]): the succession only says who may ask, so two
//! candidates never campaign for one term and a vote needs no randomized timeout.
//! This type is the follower's view: what workers run, and the order candidates
//! count lapses in.
//!
//! Workers never claim a term. They follow the highest valid term they have seen
//! and refuse leases (and so announcements) of lower terms, of keys that are not
//! candidates, and of candidates claiming a term that is not theirs.
//!
//! A lapse is counted only by a node that was listening through the whole lease
//! period: each lapse needs a full lease from the previous one (a node whose loop
//! stalled for a minute counts one lapse, not sixty), and a tick that comes more
//! than half a lease after the previous one restarts the wait instead (the node
//! could not have heard the leases sent meanwhile). A candidate whose turn comes
//! but that may not lead (it does not hold the latest replicated state, see
//! [`crate::failover`]) defers: its term lapses like a dead candidate's.
//!
//! Pure, like the rest of this crate: time comes in as `now_ms`, which must be a
//! **monotonic** clock (milliseconds since the process started): a step of the wall
//! clock must not make a lease lapse.

use crate::{PublicKey, RunId};

/// A run's id: blake3 over the creator's key, the model, a random salt and the
/// other candidates' keys. It binds the candidates to the run, so a manifest served
/// by a successor (signed by it, not by the creator) is checked against the id
/// every worker already trusts.
pub fn run_id(creator: &PublicKey, model_hash: &[u8; 32], salt: &[u8; 32], candidates: &[PublicKey]) -> RunId {
    let mut h = blake3::Hasher::new();
    h.update(b"pcp/run-id/v2");
    h.update(&creator.0);
    h.update(model_hash);
    h.update(salt);
    h.update(&(candidates.len() as u64).to_le_bytes());
    for c in candidates {
        h.update(&c.0);
    }
    RunId(*h.finalize().as_bytes())
}

/// The candidates of a run in the order they take terms.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Succession {
    order: Vec<PublicKey>,
}

impl Succession {
    /// The creator (term 1's leader), then the other candidates by
    /// `blake3(run ‖ key)`; duplicates and the creator among `candidates` are
    /// dropped.
    pub fn new(run: RunId, creator: PublicKey, candidates: &[PublicKey]) -> Self {
        let mut rest: Vec<PublicKey> = candidates.iter().copied().filter(|c| *c != creator).collect();
        rest.sort_by_key(|key| {
            let mut h = blake3::Hasher::new();
            h.update(&run.0);
            h.update(&key.0);
            (*h.finalize().as_bytes(), key.0)
        });
        rest.dedup();
        let mut order = vec![creator];
        order.extend(rest);
        Self { order }
    }

    /// The candidate that leads term `term` (terms start at 1).
    pub fn leader(&self, term: u64) -> PublicKey {
        let n = self.order.len() as u64;
        self.order[(term.max(1) - 1).rem_euclid(n) as usize]
    }

    /// Whether `key` is a candidate.
    pub fn contains(&self, key: &PublicKey) -> bool {
        self.order.contains(key)
    }

    /// A succession in `order` as another node computed it (a recorded trace's).
    pub fn from_order(order: Vec<PublicKey>) -> Self {
        Self { order }
    }

    /// The candidates, in order.
    pub fn order(&self) -> &[PublicKey] {
        &self.order
    }
}

/// Why a lease (and so an announcement under it) is refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error, serde::Serialize, serde::Deserialize)]
pub enum Rejection {
    /// The signer is not one of the run's candidates.
    #[error("signed by a key that is not a candidate of the run")]
    NotCandidate,
    /// A candidate claimed a term that belongs to another.
    #[error("claims term {term}, which is another candidate's")]
    NotTheirTurn {
        /// The claimed term.
        term: u64,
    },
    /// A lower term than the one this node follows.
    #[error("stale term {term}; the run is at term {current}")]
    Stale {
        /// The claimed term.
        term: u64,
        /// The term this node follows.
        current: u64,
    },
}

/// What happened, for the host to act on and record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// `leader` leads from `term` on: this node now follows it (or is it).
    Elected {
        /// The new term.
        term: u64,
        /// Its leader.
        leader: PublicKey,
    },
    /// No valid lease was heard from `leader`, the holder of `term`, for a lease
    /// period.
    LeaseExpired {
        /// The term whose lease lapsed.
        term: u64,
        /// The candidate that held it (or whose turn it was).
        leader: PublicKey,
    },
    /// This node led `term` and saw a valid higher term: it is a candidate again.
    SteppedDown {
        /// The term it led.
        term: u64,
        /// The term it saw.
        newer: u64,
    },
    /// This candidate's turn came for `term`, but it may not lead (it is behind
    /// another live candidate, or holds no state yet): the term lapses.
    Deferred {
        /// The term passed over.
        term: u64,
    },
    /// This node led `term` and stopped without seeing a higher term (it lost its
    /// workers, see [`crate::failover::Quorum`]): the next candidate takes over.
    SteppedAside {
        /// The term it led.
        term: u64,
    },
    /// A lease was refused.
    Rejected {
        /// Its signer.
        from: PublicKey,
        /// Why.
        reason: Rejection,
    },
}

/// One node's view of who leads: a candidate's (which may claim terms) or a
/// worker's (which only follows).
#[derive(Clone, Debug)]
pub struct Election {
    me: PublicKey,
    succession: Succession,
    lease_ms: u64,
    /// The term this node follows; 0 before it has heard any.
    term: u64,
    leading: bool,
    /// When a valid lease of `term` was last heard (or this node took it).
    heard_ms: u64,
    /// Lease periods that lapsed since the lease of `term` was last heard.
    lapsed: u64,
    /// The highest term reported as lapsed, so each is reported once.
    reported: u64,
    /// The previous tick: a tick long after it restarts the wait.
    ticked_ms: u64,
}

impl Election {
    /// A node that knows the run's succession at `now_ms`. The creator starts as
    /// term 1's leader; everyone else follows term 1 from `now_ms`, as if its lease
    /// had just been heard.
    pub fn new(me: PublicKey, succession: Succession, lease_ms: u64, now_ms: u64) -> Self {
        let leading = succession.leader(1) == me;
        Self {
            me,
            succession,
            lease_ms: lease_ms.max(1),
            term: 1,
            leading,
            heard_ms: now_ms,
            lapsed: 0,
            reported: 0,
            ticked_ms: now_ms,
        }
    }

    /// A node that comes back believing it led (or followed) `term`, as a
    /// shepherd restarted with `--resume` does: it leads again only if `term` is
    /// its own, until it hears a higher one.
    pub fn resume(me: PublicKey, succession: Succession, lease_ms: u64, term: u64, now_ms: u64) -> Self {
        let term = term.max(1);
        let leading = succession.leader(term) == me;
        Self { term, leading, ..Self::new(me, succession, lease_ms, now_ms) }
    }

    /// This node's key.
    pub fn me(&self) -> PublicKey {
        self.me
    }

    /// The term this node follows.
    pub fn term(&self) -> u64 {
        self.term
    }

    /// The leader this node follows.
    pub fn leader(&self) -> PublicKey {
        self.succession.leader(self.term)
    }

    /// The candidate whose lease this node awaits: the leader of its term, or, once
    /// that lease has lapsed `k` times, the leader of the term `k` later. A
    /// follower heartbeats it.
    pub fn awaited(&self) -> PublicKey {
        if self.leading { self.me } else { self.succession.leader(self.term + self.lapsed) }
    }

    /// Whether this node leads: it should send leases (heartbeats) of [`Self::term`].
    pub fn is_leader(&self) -> bool {
        self.leading
    }

    /// The run's succession.
    pub fn succession(&self) -> &Succession {
        &self.succession
    }

    /// Checks a lease of `term` signed by `from` without acting on it: what a
    /// worker asks before it takes a round announcement.
    pub fn check(&self, from: &PublicKey, term: u64) -> Result<(), Rejection> {
        if !self.succession.contains(from) {
            return Err(Rejection::NotCandidate);
        }
        if term == 0 || self.succession.leader(term) != *from {
            return Err(Rejection::NotTheirTurn { term });
        }
        if term < self.term {
            return Err(Rejection::Stale { term, current: self.term });
        }
        Ok(())
    }

    /// A signed lease of `term` from `from` (its heartbeat or announcement).
    pub fn on_lease(&mut self, from: PublicKey, term: u64, now_ms: u64) -> Vec<Action> {
        let mut actions = Vec::new();
        if let Err(reason) = self.check(&from, term) {
            actions.push(Action::Rejected { from, reason });
            return actions;
        }
        if term > self.term {
            if self.leading {
                actions.push(Action::SteppedDown { term: self.term, newer: term });
            }
            self.term = term;
            self.leading = from == self.me;
            actions.push(Action::Elected { term, leader: from });
        }
        self.heard_ms = now_ms;
        self.lapsed = 0;
        actions
    }

    /// Time passes: a lapsed lease is reported, and a candidate whose turn has come
    /// takes its term (then it must send a lease at once).
    pub fn tick(&mut self, now_ms: u64) -> Vec<Action> {
        self.tick_gated(now_ms, true)
    }

    /// [`Self::tick`] for a candidate that may lead only when `may_lead`: when its
    /// turn comes and it may not, it defers and its term lapses like a dead
    /// candidate's.
    pub fn tick_gated(&mut self, now_ms: u64, may_lead: bool) -> Vec<Action> {
        let mut actions = Vec::new();
        let stalled = now_ms.saturating_sub(self.ticked_ms) > self.lease_ms / 2;
        self.ticked_ms = now_ms;
        if self.leading {
            self.heard_ms = now_ms;
            return actions;
        }
        if stalled {
            // this node was not listening: leases may have come and gone unheard
            self.heard_ms = self.heard_ms.max(now_ms.saturating_sub(self.lease_ms / 2));
        }
        if now_ms.saturating_sub(self.heard_ms) < self.lease_ms {
            return actions;
        }
        let lapsed_term = self.term + self.lapsed;
        if lapsed_term > self.reported {
            self.reported = lapsed_term;
            actions.push(Action::LeaseExpired { term: lapsed_term, leader: self.succession.leader(lapsed_term) });
        }
        // the next lapse needs a full lease of listening from this one
        self.lapsed += 1;
        self.heard_ms = now_ms;
        let next = self.term + self.lapsed;
        if self.succession.contains(&self.me) && self.succession.leader(next) == self.me {
            if may_lead {
                self.term = next;
                self.leading = true;
                self.lapsed = 0;
                actions.push(Action::Elected { term: next, leader: self.me });
            } else {
                actions.push(Action::Deferred { term: next });
            }
        }
        actions
    }

    /// A leader stops leading without a higher term (it lost its workers): it
    /// follows its own term as lapsed, so the next candidate is awaited at once
    /// and takes over one lease after this node's last lease.
    pub fn step_aside(&mut self, now_ms: u64) -> Vec<Action> {
        if !self.leading {
            return Vec::new();
        }
        self.leading = false;
        self.lapsed = 1;
        self.reported = self.reported.max(self.term);
        self.heard_ms = now_ms;
        self.ticked_ms = now_ms;
        vec![Action::SteppedAside { term: self.term }]
    }

    /// The leases this node awaits lapse after `lease_ms` without one.
    pub fn lease_ms(&self) -> u64 {
        self.lease_ms
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(i: u8) -> PublicKey {
        PublicKey([i; 32])
    }

    const RUN: RunId = RunId([9; 32]);
    const LEASE: u64 = 1000;

    fn succession() -> Succession {
        Succession::new(RUN, key(1), &[key(2), key(3), key(1), key(2)])
    }

    /// Ticks `e` every 100 ms up to `to`, as a node's loop does.
    fn until(e: &mut Election, to: u64) -> Vec<Action> {
        let mut out = Vec::new();
        let mut t = e.ticked_ms;
        while t < to {
            t = (t + 100).min(to);
            out.extend(e.tick(t));
        }
        out
    }

    fn elected(actions: &[Action]) -> Option<(u64, PublicKey)> {
        actions.iter().find_map(|a| match a {
            Action::Elected { term, leader } => Some((*term, *leader)),
            _ => None,
        })
    }

    #[test]
    fn a_run_id_binds_its_creator_salt_and_candidates() {
        let id = run_id(&key(1), &[2; 32], &[3; 32], &[key(4), key(5)]);
        assert_eq!(id, run_id(&key(1), &[2; 32], &[3; 32], &[key(4), key(5)]));
        assert_ne!(id, run_id(&key(1), &[2; 32], &[3; 32], &[key(4)]), "a dropped candidate");
        assert_ne!(id, run_id(&key(1), &[2; 32], &[3; 32], &[key(4), key(6)]), "a swapped candidate");
        assert_ne!(id, run_id(&key(9), &[2; 32], &[3; 32], &[key(4), key(5)]), "another creator");
        assert_ne!(id, run_id(&key(1), &[2; 32], &[4; 32], &[key(4), key(5)]), "another salt");
    }

    #[test]
    fn the_succession_is_the_creator_then_a_hash_order_every_node_agrees_on() {
        let s = succession();
        assert_eq!(s.order().len(), 3, "duplicates and the creator dropped");
        assert_eq!(s.leader(1), key(1));
        let again = Succession::new(RUN, key(1), &[key(3), key(2)]);
        assert_eq!(s, again, "the order does not depend on how the manifest lists them");
        assert_eq!(s.leader(4), key(1), "terms cycle through the candidates");
        assert_eq!(s.leader(2), s.order()[1]);
        // another run orders the same keys by its own hashes
        let other = Succession::new(RunId([8; 32]), key(1), &[key(2), key(3)]);
        assert_eq!(other.order()[0], key(1));
    }

    #[test]
    fn a_follower_awaits_the_candidate_whose_term_comes_next() {
        let s = succession();
        let mut worker = Election::new(key(50), s.clone(), LEASE, 0);
        assert_eq!(worker.awaited(), key(1));
        until(&mut worker, LEASE);
        assert_eq!((worker.term(), worker.awaited()), (1, s.leader(2)), "one lapse: term 2's candidate");
        until(&mut worker, 2 * LEASE);
        assert_eq!(worker.awaited(), s.leader(3), "two lapses: term 3's");
        assert_eq!(elected(&worker.on_lease(s.leader(2), 2, 2 * LEASE + 1)), Some((2, s.leader(2))));
        assert_eq!(worker.awaited(), s.leader(2), "a valid lease resets the wait");
        let leader = Election::new(key(1), s, LEASE, 0);
        assert_eq!(leader.awaited(), key(1), "a leader awaits itself");
    }

    #[test]
    fn the_next_candidate_takes_the_next_term_one_lease_after_the_last_heartbeat() {
        let s = succession();
        let (second, third) = (s.leader(2), s.leader(3));
        let mut leader = Election::new(key(1), s.clone(), LEASE, 0);
        let mut next = Election::new(second, s.clone(), LEASE, 0);
        let mut after = Election::new(third, s.clone(), LEASE, 0);
        let mut worker = Election::new(key(50), s.clone(), LEASE, 0);
        assert!(leader.is_leader() && !next.is_leader() && !worker.is_leader());
        // heartbeats keep the lease
        for t in [400, 800, 1200] {
            for e in [&mut next, &mut after, &mut worker] {
                assert!(e.on_lease(key(1), 1, t).is_empty());
                assert!(until(e, t + 100).is_empty());
            }
            assert!(until(&mut leader, t).is_empty());
        }
        // the leader dies after 1200: at 2200 its lease has lapsed everywhere
        assert!(until(&mut next, 2199).is_empty());
        let a = until(&mut next, 2200);
        assert!(a.contains(&Action::LeaseExpired { term: 1, leader: key(1) }));
        assert_eq!(elected(&a), Some((2, second)));
        assert!(next.is_leader());
        // the others report the lapse but wait for term 2's lease
        let a = until(&mut after, 2200);
        assert_eq!(a, vec![Action::LeaseExpired { term: 1, leader: key(1) }]);
        assert!(elected(&until(&mut worker, 2200)).is_none());
        for e in [&mut after, &mut worker] {
            assert_eq!(elected(&e.on_lease(second, 2, 2210)), Some((2, second)));
            assert_eq!(e.leader(), second);
        }
        // and do not take term 3 while term 2's leases come
        for t in [2600, 3000, 3400] {
            after.on_lease(second, 2, t);
            assert!(elected(&until(&mut after, t + 500)).is_none());
        }
    }

    #[test]
    fn a_dead_successor_costs_one_more_lease() {
        let s = succession();
        let third = s.leader(3);
        let mut after = Election::new(third, s.clone(), LEASE, 0);
        let mut worker = Election::new(key(50), s.clone(), LEASE, 0);
        assert!(elected(&until(&mut after, 1000)).is_none(), "term 2 is the dead successor's");
        let a = until(&mut after, 2000);
        assert!(a.contains(&Action::LeaseExpired { term: 2, leader: s.leader(2) }));
        assert_eq!(elected(&a), Some((3, third)));
        // a worker that heard nothing meanwhile jumps straight to term 3
        assert_eq!(elected(&worker.on_lease(third, 3, 2001)), Some((3, third)));
        // a tick long after the last one restarts the wait: the node was not listening
        let mut w = Election::new(key(50), s, LEASE, 0);
        assert!(w.tick(5000).is_empty(), "a stalled node counts no lapse at once");
        let lapses = until(&mut w, 6000).iter().filter(|a| matches!(a, Action::LeaseExpired { .. })).count();
        assert_eq!(lapses, 1, "one lapse per lease of listening");
        assert_eq!(w.term(), 1, "a worker never moves the term on its own");
    }

    /// H1: a standby next in line whose loop was blocked (a 120 s state fetch)
    /// while the leader kept sending leases must not take a term on waking: the
    /// leases queued meanwhile are still to be read.
    #[test]
    fn a_stalled_standby_does_not_take_a_term_from_a_live_leader() {
        let s = succession();
        let second = s.leader(2);
        let mut standby = Election::new(second, s.clone(), LEASE, 0);
        assert!(until(&mut standby, 400).is_empty());
        // blocked from 400 to 120_400; its first tick comes before the queued leases
        let a = standby.tick(120_400);
        assert!(elected(&a).is_none() && !standby.is_leader(), "{a:?}");
        assert!(standby.on_lease(key(1), 1, 120_410).is_empty(), "the queued lease is the live leader's");
        assert!(elected(&until(&mut standby, 121_300)).is_none());
        // and if the leader really is gone, one lease of listening later it leads
        assert_eq!(elected(&until(&mut standby, 121_410)), Some((2, second)));
    }

    #[test]
    fn a_candidate_that_may_not_lead_defers_and_its_term_lapses() {
        let s = succession();
        let (second, third) = (s.leader(2), s.leader(3));
        let mut behind = Election::new(second, s.clone(), LEASE, 0);
        let mut ahead = Election::new(third, s.clone(), LEASE, 0);
        let mut t = 0;
        let mut deferred = false;
        while t < 2000 {
            t += 100;
            for a in behind.tick_gated(t, false) {
                deferred |= a == Action::Deferred { term: 2 };
                assert!(!matches!(a, Action::Elected { .. }), "{a:?}");
            }
            assert!(elected(&ahead.tick(t)).is_none() || t == 2000);
        }
        assert!(deferred && !behind.is_leader());
        assert!(ahead.is_leader() && ahead.term() == 3, "the term after the deferred one comes up");
    }

    #[test]
    fn a_leader_that_steps_aside_is_succeeded_one_lease_later() {
        let s = succession();
        let second = s.leader(2);
        let mut leader = Election::new(key(1), s.clone(), LEASE, 0);
        let mut next = Election::new(second, s.clone(), LEASE, 0);
        next.on_lease(key(1), 1, 500);
        assert_eq!(leader.step_aside(500), vec![Action::SteppedAside { term: 1 }]);
        assert!(!leader.is_leader());
        assert_eq!(leader.awaited(), second, "it awaits the next candidate at once");
        assert!(until(&mut leader, 1400).iter().all(|a| !matches!(a, Action::LeaseExpired { term: 1, .. })));
        assert_eq!(elected(&until(&mut next, 1500)), Some((2, second)));
        assert_eq!(elected(&leader.on_lease(second, 2, 1510)), Some((2, second)));
    }

    #[test]
    fn a_stale_leader_steps_down_and_its_leases_are_refused() {
        let s = succession();
        let second = s.leader(2);
        // the old leader comes back believing it leads term 1
        let mut old = Election::resume(key(1), s.clone(), LEASE, 1, 5000);
        assert!(old.is_leader());
        let mut worker = Election::new(key(50), s.clone(), LEASE, 0);
        worker.on_lease(second, 2, 4000);
        assert_eq!(
            worker.on_lease(key(1), 1, 5001),
            vec![Action::Rejected { from: key(1), reason: Rejection::Stale { term: 1, current: 2 } }]
        );
        assert_eq!(worker.leader(), second);
        let a = old.on_lease(second, 2, 5002);
        assert_eq!(a[0], Action::SteppedDown { term: 1, newer: 2 });
        assert_eq!(elected(&a), Some((2, second)));
        assert!(!old.is_leader());
    }

    #[test]
    fn forged_and_out_of_turn_leases_are_refused() {
        let s = succession();
        let mut worker = Election::new(key(50), s.clone(), LEASE, 0);
        let stranger = key(77);
        assert_eq!(
            worker.on_lease(stranger, 2, 10),
            vec![Action::Rejected { from: stranger, reason: Rejection::NotCandidate }]
        );
        let third = s.leader(3);
        assert_eq!(
            worker.on_lease(third, 2, 10),
            vec![Action::Rejected { from: third, reason: Rejection::NotTheirTurn { term: 2 } }]
        );
        assert_eq!(worker.check(&third, 0), Err(Rejection::NotTheirTurn { term: 0 }));
        assert_eq!(worker.term(), 1);
    }

    /// Seeded runs of 3 candidates and 2 workers over a lossy network (a fifth of
    /// the leases lost, so candidates sometimes take a term while its predecessor
    /// lives), with the creator killed and restarted as a stale leader: never two
    /// leaders of one term, and once the network is reliable again one leader
    /// remains, holding the highest term, and everyone follows it.
    #[test]
    fn never_two_leaders_of_one_term() {
        let s = succession();
        for seed in 0..50u64 {
            let mut rng = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
            let mut next = move || {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                rng
            };
            let keys: Vec<PublicKey> = s.order().iter().copied().chain([key(50), key(51)]).collect();
            let mut nodes: Vec<Election> = keys.iter().map(|k| Election::new(*k, s.clone(), LEASE, 0)).collect();
            let mut alive = vec![true; keys.len()];
            let mut leaders: std::collections::BTreeMap<u64, PublicKey> = Default::default();
            for step in 0..400u64 {
                let now = step * 50;
                if step == 40 + seed % 40 {
                    alive[0] = false; // the creator dies
                }
                if step == 250 {
                    alive[0] = true; // and comes back believing it leads term 1
                    nodes[0] = Election::resume(keys[0], s.clone(), LEASE, 1, now);
                }
                for i in 0..nodes.len() {
                    if !alive[i] {
                        continue;
                    }
                    for a in nodes[i].tick(now) {
                        if let Action::Elected { term, leader } = a {
                            assert_eq!(*leaders.entry(term).or_insert(leader), leader, "seed {seed}");
                        }
                    }
                    if nodes[i].is_leader() && step % 8 == 0 {
                        let (from, term) = (keys[i], nodes[i].term());
                        for j in 0..nodes.len() {
                            // lossy: a fifth of the leases are dropped, until the last 80 steps
                            if j != i && alive[j] && (step >= 320 || next() % 5 != 0) {
                                for a in nodes[j].on_lease(from, term, now) {
                                    if let Action::Elected { term, leader } = a {
                                        assert_eq!(*leaders.entry(term).or_insert(leader), leader, "seed {seed}");
                                    }
                                }
                            }
                        }
                    }
                }
            }
            let top = nodes.iter().map(Election::term).max().unwrap_or(0);
            assert!(top >= 2, "seed {seed}: the creator's death moved the term on");
            assert!(!nodes[0].is_leader() || top % 3 == 1, "seed {seed}: the stale creator stepped down");
            let leading: Vec<usize> = (0..nodes.len()).filter(|i| nodes[*i].is_leader()).collect();
            assert_eq!(leading.len(), 1, "seed {seed}: one leader at the end, {leading:?}");
            assert_eq!(nodes[leading[0]].term(), top, "seed {seed}: the leader holds the highest term");
            assert!(nodes.iter().all(|n| n.term() == top), "seed {seed}: everyone follows it");
        }
    }
}
