//! Screening committees' members, and the lying ones (`--hostile-screeners`).
//!
//! The node's `Screening` machine draws a contribution's committee among the
//! round's eligible screeners: the rated senders whose own contribution to the
//! round arrived before it, less those caught lying. Its verdict comes only from
//! agreement: a committee whose answers disagree is scored by the shepherd, and
//! every member its score contradicts is caught (barred from screening for the
//! run, and its rating lost). A committee of liars only agrees with itself: the
//! shepherd's spot check catches it, and otherwise its lie decides. Lying
//! screeners here lie alike (`screen-high`: every contribution hurts the loss;
//! `screen-low`: every contribution helps it), as the node's hostile kinds do;
//! an honest member's answer never agrees with a liar's.
//!
//! Members are drawn only when liars are set (from their own stream), so a run
//! without them draws what it did before.

use std::collections::{BTreeMap, BTreeSet};

use pcp_protocol::diloco::committee::screening::may_defer;
use rand::Rng;
use rand_chacha::ChaCha8Rng;
use serde::Serialize;

/// What a lying screener reports (pcp-node's `--hostile screen-high` and `screen-low`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ScreenerAttack {
    /// The loss with the contribution half a nat above the loss without it: an
    /// honest contribution looks harmful.
    ScreenHigh,
    /// Half a nat below: any contribution looks helpful.
    ScreenLow,
}

/// The liars among the workers: each one of `share` of them, drawn as first seen.
#[derive(Debug)]
struct Liars {
    attack: ScreenerAttack,
    share: f64,
    rng: ChaCha8Rng,
    seen: BTreeMap<u32, bool>,
}

/// A contribution's committee, as its answers would come.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Draw {
    /// Every member answers honestly.
    Honest,
    /// Some members lie (these): the answers disagree.
    Disputed(Vec<u32>),
    /// Every member lies alike (these): the answers agree on the lie.
    Lying(Vec<u32>, ScreenerAttack),
}

/// The round's eligible screeners, those barred for the run and the liars.
#[derive(Debug, Default)]
pub(crate) struct Committees {
    eligible: Vec<u32>,
    barred: BTreeSet<u32>,
    liars: Option<Liars>,
    caught: Vec<u32>,
    /// Contributions waiting for their committees' verdicts: until when (µs), and
    /// the bytes each holds meanwhile.
    waiting: Vec<(u64, f64)>,
}

impl Committees {
    /// Committees where `liars` (an attack and the share of workers doing it, drawn
    /// from `rng`) lie.
    pub(crate) fn new(liars: Option<(ScreenerAttack, f64)>, rng: ChaCha8Rng) -> Self {
        let liars = liars.map(|(attack, share)| Liars { attack, share, rng, seen: BTreeMap::new() });
        Self { liars, ..Self::default() }
    }

    /// The round's eligible screeners.
    pub(crate) fn eligible(&self) -> usize {
        self.eligible.len()
    }

    /// `w`'s contribution to the round arrived: it may screen the round's later ones.
    pub(crate) fn enlist(&mut self, w: u32) {
        if !self.barred.contains(&w) {
            self.eligible.push(w);
        }
    }

    /// Whether a contribution holding `bytes` may wait for its verdict at `now`
    /// (µs) beside those waiting (the node's `may_defer`).
    pub(crate) fn room(&mut self, now: u64, bytes: f64) -> bool {
        self.waiting.retain(|(until, _)| *until > now);
        let held: f64 = self.waiting.iter().map(|(_, b)| b).sum();
        may_defer(self.waiting.len(), held as usize, bytes as usize)
    }

    /// A contribution holding `bytes` waits for its verdict until `until` (µs).
    pub(crate) fn wait(&mut self, until: u64, bytes: f64) {
        self.waiting.push((until, bytes));
    }

    /// A new round: nobody has sent to it yet.
    pub(crate) fn next_round(&mut self) {
        self.eligible.clear();
    }

    /// The committee of `k` members of a contribution (at most the eligible).
    pub(crate) fn draw(&mut self, k: u32) -> Draw {
        let Some(liars) = self.liars.as_mut() else { return Draw::Honest };
        let m = (k as usize).min(self.eligible.len());
        let members: Vec<u32> = rand::seq::index::sample(&mut liars.rng, self.eligible.len(), m)
            .into_iter()
            .map(|i| self.eligible[i])
            .collect();
        let lying: Vec<u32> = members.iter().copied().filter(|w| liars.lies(*w)).collect();
        match lying.len() {
            0 => Draw::Honest,
            n if n == members.len() => Draw::Lying(lying, liars.attack),
            _ => Draw::Disputed(lying),
        }
    }

    /// The shepherd's score contradicted `liars`: barred from screening, their ratings lost.
    pub(crate) fn catch(&mut self, liars: &[u32]) {
        for w in liars {
            if self.barred.insert(*w) {
                self.caught.push(*w);
            }
        }
        self.eligible.retain(|w| !self.barred.contains(w));
    }

    /// The screeners caught since the last call (the state machine takes their ratings).
    pub(crate) fn take_caught(&mut self) -> Vec<u32> {
        std::mem::take(&mut self.caught)
    }
}

impl Liars {
    fn lies(&mut self, w: u32) -> bool {
        let (share, rng) = (self.share, &mut self.rng);
        *self.seen.entry(w).or_insert_with(|| rng.gen_bool(share.clamp(0.0, 1.0)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn without_liars_every_committee_is_honest_and_a_caught_liar_screens_no_more() {
        let mut honest = Committees::new(None, ChaCha8Rng::seed_from_u64(1));
        (0..5).for_each(|w| honest.enlist(w));
        assert_eq!(honest.draw(3), Draw::Honest);
        let mut all = Committees::new(Some((ScreenerAttack::ScreenHigh, 1.0)), ChaCha8Rng::seed_from_u64(1));
        (0..5).for_each(|w| all.enlist(w));
        let Draw::Lying(liars, ScreenerAttack::ScreenHigh) = all.draw(3) else { panic!("every member lies") };
        assert_eq!(liars.len(), 3);
        all.catch(&liars);
        all.catch(&liars);
        assert_eq!(all.take_caught(), liars, "each caught once");
        assert_eq!(all.eligible(), 2);
        all.next_round();
        (0..5).for_each(|w| all.enlist(w));
        assert_eq!(all.eligible(), 2, "barred for the run");
    }

    #[test]
    fn a_committee_with_some_liars_disagrees() {
        let mut some = Committees::new(Some((ScreenerAttack::ScreenLow, 0.5)), ChaCha8Rng::seed_from_u64(7));
        (0..40).for_each(|w| some.enlist(w));
        let draws: Vec<Draw> = (0..50).map(|_| some.draw(3)).collect();
        assert!(draws.iter().any(|d| matches!(d, Draw::Disputed(l) if !l.is_empty() && l.len() < 3)), "{draws:?}");
        assert!(draws.contains(&Draw::Honest));
        assert!(draws.iter().any(|d| matches!(d, Draw::Lying(l, ScreenerAttack::ScreenLow) if l.len() == 3)));
    }
}
