//! Ratings: how far a shepherd trusts each participant, learned over rounds from
//! its screen.
//!
//! A participant's rating is an exponential moving average (EMA) of the held-out
//! loss improvement its screened contributions made, at the scale they were
//! applied: `before − after`, the loss at the round's parameters less the loss
//! with the bounded contribution applied alone. It sets the participant's weight
//! in the mean, as a trust factor on its samples:
//!
//! * **Probation.** A key with fewer than [`Policy::probation_rounds`] screened
//!   contributions that passed counts at [`Policy::probation_weight`], and every
//!   one of its contributions is screened (no sampling).
//! * **Rated.** Out of probation, its factor is its rating over the median rating
//!   of the rated participants, at most 1: a peer whose contributions improve the
//!   loss as much as a typical one counts in full, one that sends tiny updates
//!   (a drag attack) counts as little as they help.
//! * **Caught.** A contribution that fails the screen costs the peer its rating:
//!   it is on probation again, from nothing, where every contribution is screened
//!   ([`Ratings::returning`]: whatever the round's budget). From its second catch
//!   it also sits out ([`Ratings::sits_out`]): its contributions are refused
//!   unscreened for 1 round after its second catch, 2 after its third, 4, … (at
//!   most [`MAX_SIT_OUT`]). Junk sent the instant each round opens then spends
//!   the screening budget a few times per key over a run, not every round, and
//!   cannot keep honest newcomers out of it, while an honest worker the screen
//!   refuses once (an update that overshoots on the held-out batch late in
//!   training) loses that round and its weight, not also the next.
//!
//! Ratings also rank participants where a round takes only some of them (the
//! shepherd's `max_participants` and `aggregate_max`): rated peers first, best
//! first. They hold a bounded number of peers ([`MAX_RATED`]); past it the least
//! trusted go.
//!
//! This is the loss-delta scoring of Templar's Gauntlet with an EMA in place of
//! OpenSkill's rating: each round gives one score per screened peer, not a
//! ranking of peers against each other, so a moving average is the simpler fit.

use std::collections::BTreeMap;

/// The most peers rated at once.
pub const MAX_RATED: usize = 65_536;

/// The most rounds a caught peer sits out.
pub const MAX_SIT_OUT: u64 = 64;

/// How ratings turn into weights.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Policy {
    /// Screened contributions a new key must pass before it counts in full.
    pub probation_rounds: u32,
    /// A key on probation's trust factor.
    pub probation_weight: f64,
    /// The EMA's weight on the newest score.
    pub alpha: f64,
}

impl Default for Policy {
    fn default() -> Self {
        Self { probation_rounds: 3, probation_weight: 0.25, alpha: 0.5 }
    }
}

/// One peer's record.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rating {
    /// Screens passed since it was last caught (or joined).
    pub passed: u32,
    /// The EMA of its loss improvements (0 before any).
    pub score: f64,
    /// The round it was first rated in (its seniority).
    pub since: u64,
    /// Times the screen caught it.
    pub caught: u32,
    /// Its contributions are refused unscreened up to this round.
    pub sits_out_until: u64,
}

/// Every peer's rating.
#[derive(Clone, Debug, PartialEq)]
pub struct Ratings<P> {
    policy: Policy,
    peers: BTreeMap<P, Rating>,
}

impl<P: Ord + Clone> Ratings<P> {
    /// No one rated yet.
    pub fn new(policy: Policy) -> Self {
        Self { policy, peers: BTreeMap::new() }
    }

    /// The policy.
    pub fn policy(&self) -> Policy {
        self.policy
    }

    /// `peer`'s record, if it has one.
    pub fn get(&self, peer: &P) -> Option<&Rating> {
        self.peers.get(peer)
    }

    /// Whether `peer` is on probation (new, or caught since).
    pub fn on_probation(&self, peer: &P) -> bool {
        self.peers.get(peer).is_none_or(|r| r.passed < self.policy.probation_rounds)
    }

    /// `peer`'s contribution to `round` passed the screen, improving the held-out
    /// loss by `improvement`.
    pub fn passed(&mut self, peer: &P, round: u64, improvement: f64) {
        let improvement = if improvement.is_finite() { improvement.max(0.0) } else { 0.0 };
        let alpha = self.policy.alpha.clamp(0.0, 1.0);
        self.make_room(peer);
        let fresh = Rating { passed: 0, score: 0.0, since: round, caught: 0, sits_out_until: 0 };
        let r = self.peers.entry(peer.clone()).or_insert(fresh);
        r.score = if r.passed == 0 { improvement } else { (1.0 - alpha) * r.score + alpha * improvement };
        r.passed = r.passed.saturating_add(1);
    }

    /// `peer` was caught: a contribution to `round` failed the screen. Its rating
    /// is gone, it is on probation again, and from its second catch it sits out
    /// the next 2^(catches − 2) rounds (at most [`MAX_SIT_OUT`]).
    pub fn caught(&mut self, peer: &P, round: u64) {
        self.make_room(peer);
        let caught = self.peers.get(peer).map_or(0, |r| r.caught).saturating_add(1);
        let rounds = match caught {
            1 => 0,
            n => 1u64.checked_shl(n - 2).unwrap_or(MAX_SIT_OUT).min(MAX_SIT_OUT),
        };
        let sits_out_until = round.saturating_add(rounds);
        self.peers.insert(peer.clone(), Rating { passed: 0, score: 0.0, since: round, caught, sits_out_until });
    }

    /// `peer`'s contribution to `round` pointed downhill but improved the loss too
    /// little (a weak catch): its rating is gone and it is on probation again, as
    /// at its first catch, but no weak catch makes it sit out. Honest gains have a
    /// long low tail, so an honest worker's contribution falls under the bar now
    /// and then, and over a long run those would add up to sit-outs of 64 rounds;
    /// weak junk gains nothing by it, as a key on probation is screened every
    /// time. A later catch as harmful ([`Self::caught`]) counts this one.
    pub fn caught_weak(&mut self, peer: &P, round: u64) {
        self.make_room(peer);
        let (caught, sits_out_until) = self.peers.get(peer).map_or((0, 0), |r| (r.caught, r.sits_out_until));
        let rating = Rating { passed: 0, score: 0.0, since: round, caught: caught.max(1), sits_out_until };
        self.peers.insert(peer.clone(), rating);
    }

    /// Whether `peer`'s contribution to `round` is refused unscreened: the screen
    /// caught it lately ([`Self::caught`]).
    pub fn sits_out(&self, peer: &P, round: u64) -> bool {
        self.peers.get(peer).is_some_and(|r| round <= r.sits_out_until)
    }

    /// Whether `peer`, caught before, is past any sit-out and still on probation
    /// as of `round`: each of its contributions is owed a screen until it leaves
    /// probation, whatever the round's budget (the shepherd's screen), so an
    /// honest worker the screen refused once is not also kept out by the budget.
    /// From the second catch each doubles the next sit-out, so a key owes at most
    /// [`Policy::probation_rounds`] such screens per catch, and junk, caught again
    /// at its first, one per catch: a few over a run.
    pub fn returning(&self, peer: &P, round: u64) -> bool {
        self.peers
            .get(peer)
            .is_some_and(|r| r.caught > 0 && round > r.sits_out_until && r.passed < self.policy.probation_rounds)
    }

    /// The median score of the rated peers among `among` (out of probation), if any.
    pub fn median<'a>(&self, among: impl Iterator<Item = &'a P>) -> Option<f64>
    where
        P: 'a,
    {
        let mut scores: Vec<f64> = among
            .filter(|p| !self.on_probation(p))
            .filter_map(|p| self.peers.get(p).map(|r| r.score))
            .filter(|s| s.is_finite())
            .collect();
        scores.sort_by(f64::total_cmp);
        scores.get(scores.len().saturating_sub(1) / 2).copied().filter(|_| !scores.is_empty())
    }

    /// `peer`'s trust factor in (0, 1], given the rated peers' `median` score: the
    /// probation weight on probation, else its score over the median (at most 1).
    pub fn factor(&self, peer: &P, median: Option<f64>) -> f64 {
        if self.on_probation(peer) {
            return self.policy.probation_weight.clamp(0.0, 1.0);
        }
        let score = self.peers.get(peer).map_or(0.0, |r| r.score);
        match median {
            Some(m) if m > 0.0 => (score / m).clamp(0.0, 1.0),
            _ => 1.0,
        }
    }

    /// Keeps at most [`MAX_RATED`] records: before a new one, the least trusted goes.
    fn make_room(&mut self, peer: &P) {
        if self.peers.len() < MAX_RATED || self.peers.contains_key(peer) {
            return;
        }
        let worst = self
            .peers
            .iter()
            .min_by(|a, b| a.1.passed.cmp(&b.1.passed).then(a.1.score.total_cmp(&b.1.score)))
            .map(|(p, _)| p.clone());
        if let Some(worst) = worst {
            self.peers.remove(&worst);
        }
    }

    /// Every record, for a snapshot.
    pub fn records(&self) -> impl Iterator<Item = (&P, &Rating)> {
        self.peers.iter()
    }

    /// Sets `peer`'s record as a snapshot kept it (at most [`MAX_RATED`] records:
    /// past it the least trusted go). A non-finite score counts as none.
    pub fn restore(&mut self, peer: P, mut rating: Rating) {
        if !rating.score.is_finite() {
            rating.score = 0.0;
        }
        self.make_room(&peer);
        self.peers.insert(peer, rating);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_key_is_on_probation_until_it_passes_and_loses_its_rating_when_caught() {
        let mut r = Ratings::new(Policy { probation_rounds: 2, probation_weight: 0.25, alpha: 0.5 });
        assert!(r.on_probation(&1));
        assert_eq!(r.factor(&1, None), 0.25);
        r.passed(&1, 1, 0.2);
        assert!(r.on_probation(&1));
        r.passed(&1, 2, 0.4);
        assert!(!r.on_probation(&1));
        assert!((r.get(&1).expect("rated").score - 0.3).abs() < 1e-12, "the EMA of 0.2 and 0.4");
        assert_eq!(r.factor(&1, Some(0.3)), 1.0);
        assert!((r.factor(&1, Some(0.6)) - 0.5).abs() < 1e-12, "half the median improvement: half the weight");
        r.caught(&1, 3);
        assert!(r.on_probation(&1));
        assert_eq!(r.get(&1).map(|x| (x.passed, x.score)), Some((0, 0.0)));
    }

    #[test]
    fn a_caught_peer_sits_out_twice_as_long_each_time() {
        let mut r = Ratings::new(Policy::default());
        assert!(!r.sits_out(&1, 1));
        r.caught(&1, 0);
        assert!(!r.sits_out(&1, 1) && r.on_probation(&1), "none after the first catch: probation alone");
        assert!(r.returning(&1, 1), "every contribution owed a screen");
        r.caught(&1, 1);
        assert!(r.sits_out(&1, 2) && !r.sits_out(&1, 3), "1 round after the second");
        r.caught(&1, 3);
        assert!(r.sits_out(&1, 5) && !r.sits_out(&1, 6), "2 after the third");
        r.caught(&1, 6);
        assert!(r.sits_out(&1, 10) && !r.sits_out(&1, 11), "4 after the fourth");
        assert!(!r.returning(&1, 10) && r.returning(&1, 11), "owed screens once it is back");
        r.passed(&1, 11, 0.1);
        r.passed(&1, 12, 0.1);
        assert!(r.returning(&1, 13), "until it leaves probation");
        r.passed(&1, 13, 0.1);
        assert!(!r.returning(&1, 14), "out of probation");
        for round in 11..100 {
            r.caught(&1, round);
        }
        assert!(r.sits_out(&1, 99 + MAX_SIT_OUT) && !r.sits_out(&1, 100 + MAX_SIT_OUT), "at most MAX_SIT_OUT");
        // passing keeps the count: a peer that turns again sits out longer
        r.passed(&2, 1, 0.1);
        assert_eq!(r.get(&2).map(|x| x.caught), Some(0));
    }

    /// An honest worker whose contribution fell under the gain bar twice sat out
    /// the round after the second (sparse, 9 of 20 `sleeper:4:huge`, rounds 9 and
    /// 11); weak catches now cost the rating and probation alone.
    #[test]
    fn weak_catches_cost_the_rating_and_probation_but_never_a_sit_out() {
        let mut r = Ratings::new(Policy::default());
        r.passed(&1, 1, 0.2);
        for round in [5, 7, 9, 11] {
            r.caught_weak(&1, round);
            assert!(r.on_probation(&1) && r.get(&1).map(|x| x.score) == Some(0.0), "round {round}");
            assert!(!r.sits_out(&1, round + 1) && r.returning(&1, round + 1), "screened, never sitting out");
        }
        assert_eq!(r.get(&1).map(|x| x.caught), Some(1));
        // a harmful catch after them is the second: it sits out a round
        r.caught(&1, 12);
        assert!(r.sits_out(&1, 13) && !r.sits_out(&1, 14));
        // and a weak one after that leaves a sit-out running as it was
        r.caught_weak(&1, 13);
        assert!(r.sits_out(&1, 13) && !r.sits_out(&1, 14));
    }

    #[test]
    fn the_median_is_over_rated_peers() {
        let mut r = Ratings::new(Policy { probation_rounds: 1, ..Policy::default() });
        r.passed(&3, 1, 0.1);
        r.passed(&2, 2, 0.5);
        r.passed(&4, 1, 0.5);
        r.caught(&5, 1);
        assert_eq!(r.median([1, 2, 3, 4].iter()), Some(0.5));
        assert_eq!(r.median([1, 5].iter()), None, "no rated peer");
    }

    #[test]
    fn ratings_stay_bounded() {
        let mut r = Ratings::new(Policy::default());
        for p in 0..(MAX_RATED as u64 + 10) {
            r.caught(&p, 1);
        }
        assert_eq!(r.records().count(), MAX_RATED);
        // a non-finite improvement counts as none
        r.passed(&0, 2, f64::NAN);
        assert_eq!(r.get(&0).map(|x| x.score), Some(0.0));
    }
}
