//! The references a shepherd's bounds and budget learn from: the global norm
//! bound's, each tensor's norm and largest magnitude, and the time an inner step
//! takes. Identities are cheap, so none of them is a vote per key:
//!
//! * **Screened and accepted only.** A contribution counts if it was accepted
//!   and screened: the score screen passed it ([`super::Screen::Passed`]), or the
//!   run has no score screen, whose norm bounds are then the screen. One let
//!   through unscored (sampling past the screening budget) counts for nothing.
//! * **By earned weight.** Each sender weighs by its earned work
//!   ([`Earned`]): the samples of its screened, accepted contributions in past
//!   rounds, each round's decayed by [`EARNED_DECAY`], and nothing again once
//!   the screen catches it. A key that earned nothing has no say in a round where
//!   any other contributor earned something; where none did (a run's first
//!   rounds), each counts once. A contribution earns its samples only if its
//!   norm is at least [`EARNING_FLOOR`] of the norm reference: a drag of tiny
//!   updates, which the norm bound lets through, earns nothing. Under
//!   `--screen norm` nothing else tells good work from bad, so keys that keep
//!   sending updates of an honest norm earn their say over rounds; the score
//!   screen is what refuses those that do not help.
//! * **Zero and non-finite values are left out.**
//! * **A bounded move.** Each reference moves by at most [`REFERENCE_STEP`] a
//!   round (×2 up, ÷2 down) from the one before, so no round can set a bound to 0
//!   or to 10⁶ × its value, whoever sends what.
//! * **A rise needs three quarters.** A norm reference falls to the weighted
//!   median, but rises only as far as [`RISE_SHARE`] of the round's weight
//!   reaches ([`next_reference`]). The screen scores a direction, not its size
//!   (`committee::Losses::improvement`), so updates of an honest direction at the
//!   bound pass it; where such senders held half a round's screened weight (the
//!   screen samples a few contributions past its budget, and which arrive first
//!   changes from round to round), a median doubled the bound in each of two rounds
//!   (nanogpt-small, 9 of 20 `sleeper:4:huge`). A higher bound is the dangerous way:
//!   a lower one only scales honest updates down.
//! * **Claims within what is seen.** The step time is the sender's claim
//!   (`train_ms`, its time in inner steps since its last contribution) over the
//!   inner steps its samples make, at most [`SEEN_FACTOR`] × what the shepherd
//!   saw: the time from its contribution to the round before to this one (from
//!   the round's opening when it sent none; twice, for the jitter of uploads
//!   between the sends and the arrivals). An overlapping worker trains between its sends, and
//!   waits there too, so the shepherd cannot see its compute alone: the claim
//!   stays, and a liar's weighs by its earned work like any other reference
//!   (claims of 1 ms from fresh keys, or from a minority of the earned weight,
//!   move nothing), and can only lower the step time by ÷2 a round.
//! * **A pace no claim sets.** A majority of the earned weight could still halve
//!   the step time every round (the screen's false refusals can hand sleepers
//!   that majority). So a fall stops at the step time whose budget is
//!   [`PACE_SHARE`] of the round just closed, which the shepherd timed itself:
//!   under the attack the budget holds where it was if the workers' compute was
//!   under three quarters of the round, and otherwise falls to about three
//!   times the round's own overhead (the close, the uploads, the announcement),
//!   where it would fall to one step. The pace only stops falls: it never raises
//!   the step time, so a long round (a run's start, a checkpoint) lengthens no
//!   budget.

use std::collections::BTreeMap;

/// The most a reference moves in one round, as a factor either way.
pub const REFERENCE_STEP: f64 = 2.0;

/// The share of each sender's earned work that every closed round forgets.
pub const EARNED_DECAY: f64 = 1.0 / 16.0;

/// A step time claimed is at most this × the time the shepherd saw.
pub const SEEN_FACTOR: f64 = 2.0;

/// A fall of the step time stops at a budget of this share of the round just
/// closed.
pub const PACE_SHARE: f64 = 0.75;

/// A contribution earns its samples if its norm is at least this share of the
/// norm reference (`REFERENCE_STEP`⁻²: two rounds of the most a reference moves).
pub const EARNING_FLOOR: f64 = 1.0 / (REFERENCE_STEP * REFERENCE_STEP);

/// The least share of a round's weight at or above a norm reference's new value
/// for it to rise there.
pub const RISE_SHARE: f64 = 0.75;

/// The most senders whose earned work is kept; past it the least earned go.
pub const MAX_EARNED: usize = 65_536;

/// Earned work below this many samples is forgotten.
const FORGOTTEN: f64 = 1e-3;

/// Each sender's earned work: decayed samples of its screened, accepted
/// contributions.
#[derive(Clone, Debug, PartialEq)]
pub struct Earned<P> {
    work: BTreeMap<P, f64>,
}

impl<P> Default for Earned<P> {
    fn default() -> Self {
        Self { work: BTreeMap::new() }
    }
}

impl<P: Ord + Clone> Earned<P> {
    /// `peer`'s earned work (0 for a key that earned nothing).
    pub fn weight(&self, peer: &P) -> f64 {
        self.work.get(peer).copied().unwrap_or(0.0)
    }

    /// A round closed: every sender's work decays by [`EARNED_DECAY`], then each of
    /// `credited` (a screened, accepted contribution's sender and its samples)
    /// earns its samples.
    pub fn close_round(&mut self, credited: impl IntoIterator<Item = (P, u64)>) {
        for w in self.work.values_mut() {
            *w *= 1.0 - EARNED_DECAY;
        }
        self.work.retain(|_, w| *w >= FORGOTTEN);
        for (peer, samples) in credited {
            *self.work.entry(peer).or_insert(0.0) += samples as f64;
        }
        if self.work.len() > MAX_EARNED {
            let mut by_work: Vec<(f64, P)> = self.work.iter().map(|(p, w)| (*w, p.clone())).collect();
            by_work.sort_by(|a, b| a.0.total_cmp(&b.0));
            let excess = self.work.len() - MAX_EARNED;
            for (_, p) in by_work.into_iter().take(excess) {
                self.work.remove(&p);
            }
        }
    }

    /// The screen caught `peer`: what it earned is gone.
    pub fn forfeit(&mut self, peer: &P) {
        self.work.remove(peer);
    }

    /// Every sender's earned work, for a snapshot.
    pub fn records(&self) -> impl Iterator<Item = (&P, f64)> {
        self.work.iter().map(|(p, w)| (p, *w))
    }

    /// Sets `peer`'s earned work as a snapshot kept it: ignored below what is
    /// forgotten, non-finite, or past [`MAX_EARNED`] senders.
    pub fn restore(&mut self, peer: P, work: f64) {
        if work.is_finite() && work >= FORGOTTEN && (self.work.len() < MAX_EARNED || self.work.contains_key(&peer)) {
            self.work.insert(peer, work);
        }
    }

    /// Senders with earned work.
    pub fn len(&self) -> usize {
        self.work.len()
    }

    /// Whether no sender earned anything.
    pub fn is_empty(&self) -> bool {
        self.work.is_empty()
    }
}

/// The lower weighted median of `(value, weight)` pairs: the smallest value at
/// which the weight of the values up to it reaches half the total. Zero, negative
/// and non-finite values are left out; where the weights left sum to nothing,
/// each value counts once. `None` when no value is left.
pub fn weighted_median(values: &[(f64, f64)]) -> Option<f64> {
    weighted_quantile(values, 0.5)
}

/// The smallest value at which the weight of the values up to it reaches `q` of
/// the total, as [`weighted_median`] leaves values out and weighs them.
pub fn weighted_quantile(values: &[(f64, f64)], q: f64) -> Option<f64> {
    let mut kept: Vec<(f64, f64)> = values
        .iter()
        .filter(|(v, _)| v.is_finite() && *v > 0.0)
        .map(|(v, w)| (*v, if w.is_finite() && *w > 0.0 { *w } else { 0.0 }))
        .collect();
    if kept.is_empty() {
        return None;
    }
    if kept.iter().map(|(_, w)| w).sum::<f64>() <= 0.0 {
        kept.iter_mut().for_each(|(_, w)| *w = 1.0);
    }
    kept.sort_by(|a, b| a.0.total_cmp(&b.0));
    let reach = kept.iter().map(|(_, w)| w).sum::<f64>() * q.clamp(0.0, 1.0);
    let mut sum = 0.0;
    for (v, w) in &kept {
        sum += w;
        if sum >= reach {
            return Some(*v);
        }
    }
    kept.last().map(|(v, _)| *v)
}

/// A norm reference's next value from a round's `(value, weight)` pairs and the
/// one before ([`bounded_move`] from `previous`): down to the weighted median,
/// up only as far as [`RISE_SHARE`] of the weight reaches (the weighted quantile
/// at 1 − [`RISE_SHARE`]), so that a rise needs three quarters of the weight. With
/// no value left, `None`; with no positive `previous`, the median.
pub fn next_reference(values: &[(f64, f64)], previous: Option<f64>) -> Option<f64> {
    let median = weighted_median(values)?;
    let Some(p) = previous.filter(|p| p.is_finite() && *p > 0.0) else { return Some(median) };
    let next = if median > p { weighted_quantile(values, 1.0 - RISE_SHARE)?.max(p) } else { median };
    Some(bounded_move(next, Some(p)))
}

/// `new` moved at most [`REFERENCE_STEP`] either way from `previous` (none, or
/// not a positive finite value: `new` as it is).
pub fn bounded_move(new: f64, previous: Option<f64>) -> f64 {
    match previous.filter(|p| p.is_finite() && *p > 0.0) {
        Some(p) => new.clamp(p / REFERENCE_STEP, p * REFERENCE_STEP),
        None => new,
    }
}

/// The step time's next reference: `claimed` (the round's weighted median claim,
/// moved by [`bounded_move`]), but, where it falls below `previous`, no lower than
/// the step time that gives a budget of [`PACE_SHARE`] of the round just closed
/// (`round_ms`, over `budget_steps`: τ × the budget's factor). Never above the
/// larger of `claimed` and `previous`.
pub fn paced(claimed: f64, previous: Option<f64>, round_ms: u64, budget_steps: f64) -> f64 {
    let Some(previous) = previous.filter(|p| p.is_finite() && *p > 0.0) else { return claimed };
    if claimed >= previous || budget_steps.is_nan() || budget_steps <= 0.0 {
        return claimed;
    }
    let pace = PACE_SHARE * round_ms as f64 / budget_steps;
    claimed.max(pace.min(previous))
}

/// Each tensor's reference (norm, largest magnitude) from a round's screened,
/// accepted contributions' statistics and their senders' weights, each moved as
/// [`next_reference`] moves one from `previous`. A tensor no contribution carried
/// keeps its reference.
pub fn tensor_references(previous: &[Option<(f64, f32)>], stats: &[(f64, Vec<(f64, f32)>)]) -> Vec<Option<(f64, f32)>> {
    let tensors = stats.iter().map(|(_, s)| s.len()).max().unwrap_or(0).max(previous.len());
    (0..tensors)
        .map(|t| {
            let before = previous.get(t).copied().flatten();
            let norms: Vec<(f64, f64)> = stats.iter().filter_map(|(w, s)| s.get(t).map(|x| (x.0, *w))).collect();
            let maxes: Vec<(f64, f64)> =
                stats.iter().filter_map(|(w, s)| s.get(t).map(|x| (f64::from(x.1), *w))).collect();
            let n = next_reference(&norms, before.map(|b| b.0));
            let m = next_reference(&maxes, before.map(|b| f64::from(b.1)));
            match (n, m) {
                (Some(n), Some(m)) => Some((n, m as f32)),
                _ => before,
            }
        })
        .collect()
}

/// What the references learn between rounds, beside the global norm's (which
/// the shepherd keeps in its snapshot).
#[derive(Clone, Debug, PartialEq)]
pub(super) struct References<P> {
    /// Each sender's earned work.
    pub(super) earned: Earned<P>,
    /// Each worker's last accepted contribution: its round and when it arrived.
    arrivals: BTreeMap<P, (u64, u64)>,
    /// Overlap: milliseconds an inner step takes (the budget's reference).
    pub(super) step_ms: Option<f64>,
    /// Each tensor's (norm, largest magnitude): the per-tensor bounds' reference.
    pub(super) tensors: Vec<Option<(f64, f32)>>,
    /// The copy check: the sketch of the last round's update.
    pub(super) update_sketch: Option<crate::diloco::sketch::Sketch>,
    /// The copy check: the sketch of the update before it (a copier a round
    /// behind takes it for the last).
    pub(super) older_update_sketch: Option<crate::diloco::sketch::Sketch>,
    /// The copy check: the sketch of the parameters after the last close.
    pub(super) params_sketch: Option<crate::diloco::sketch::Sketch>,
    /// The copy check, a sparse run: the last round's update itself and the one
    /// before it, held against sparse contributions on their support
    /// ([`crate::diloco::sketch::support_share`]; a copier a round behind copies
    /// the older).
    pub(super) update_sparse: [Option<crate::diloco::sparse::SparseTensors>; 2],
    /// How long the last closes took (the deadline's lead).
    pub(super) close: super::close::CloseTimes,
}

impl<P: Ord + Clone> References<P> {
    pub(super) fn new() -> Self {
        Self {
            earned: Earned::default(),
            arrivals: BTreeMap::new(),
            step_ms: None,
            tensors: Vec::new(),
            update_sketch: None,
            older_update_sketch: None,
            params_sketch: None,
            update_sparse: [None, None],
            close: super::close::CloseTimes::default(),
        }
    }

    /// The milliseconds an inner step of `peer`'s contribution to `round`, arriving
    /// at `now_ms`, took as the shepherd saw it: from its contribution to the round
    /// before (or from the open round's opening at `opened_ms`, unless `carried`),
    /// over its `steps`. `None` without steps or a start.
    pub(super) fn observed_step_ms(
        &self,
        peer: &P,
        round: u64,
        carried: bool,
        now_ms: u64,
        opened_ms: Option<u64>,
        steps: u64,
    ) -> Option<f64> {
        let before = self.arrivals.get(peer).filter(|(r, _)| r + 1 == round).map(|(_, at)| *at);
        let start = before.or(opened_ms.filter(|_| !carried))?;
        (steps > 0).then(|| now_ms.saturating_sub(start) as f64 / steps as f64)
    }

    /// `peer`'s contribution to `round` was accepted at `now_ms`.
    pub(super) fn arrived(&mut self, peer: P, round: u64, now_ms: u64) {
        self.arrivals.insert(peer, (round, now_ms));
    }

    /// The copy check's sketch of the update just applied; the one before it
    /// is kept as the older.
    pub(super) fn updated(&mut self, sketch: crate::diloco::sketch::Sketch) {
        self.older_update_sketch = self.update_sketch.replace(sketch);
    }

    /// `peer` is no longer a worker.
    pub(super) fn left(&mut self, peer: &P) {
        self.arrivals.remove(peer);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pace_stops_a_fall_at_three_quarters_of_the_round_and_raises_nothing() {
        // a claimed fall from 20 ms to 10 ms a step, τ = 50: a round of 2 s allows a
        // budget of 1.5 s, 30 ms a step (held at 20); one of 600 ms, 9 ms (the
        // claim's 10 ms); one of 1.2 s, 18 ms
        assert_eq!(paced(10.0, Some(20.0), 2_000, 50.0), 20.0);
        assert_eq!(paced(10.0, Some(20.0), 600, 50.0), 10.0);
        assert_eq!(paced(10.0, Some(20.0), 1_200, 50.0), 18.0);
        // a rise, a first reference, or no budget: the claim as it is
        assert_eq!(paced(30.0, Some(20.0), 60_000, 50.0), 30.0);
        assert_eq!(paced(10.0, None, 60_000, 50.0), 10.0);
        assert_eq!(paced(10.0, Some(20.0), 60_000, 0.0), 10.0);
        // a long round (a start, a checkpoint) holds the step time, never raises it
        assert_eq!(paced(10.0, Some(20.0), 600_000, 50.0), 20.0);
    }

    #[test]
    fn the_weighted_median_is_the_lower_median_at_equal_weights_and_leaves_zeros_out() {
        let equal = |v: &[f64]| v.iter().map(|v| (*v, 1.0)).collect::<Vec<_>>();
        assert_eq!(weighted_median(&equal(&[4.0, 1.0, 3.0, 2.0])), Some(2.0));
        assert_eq!(weighted_median(&equal(&[5.0, 1.0, 3.0])), Some(3.0));
        assert_eq!(weighted_median(&equal(&[0.0, 0.0, 0.0, 2.0])), Some(2.0), "zeros are no reference");
        assert_eq!(weighted_median(&equal(&[f64::NAN, f64::INFINITY, 0.0])), None);
        // weights: two keys with no earned work cannot outvote one that earned
        assert_eq!(weighted_median(&[(1.0, 0.0), (1.0, 0.0), (9.0, 5.0)]), Some(9.0));
        // where nobody earned anything, each value counts once
        assert_eq!(weighted_median(&[(1.0, 0.0), (2.0, 0.0), (9.0, 0.0)]), Some(2.0));
        // a minority of weight cannot move it, however extreme its values
        let honest = [(1.0, 10.0), (1.1, 10.0), (1.2, 10.0), (0.9, 10.0)];
        let mut attacked = honest.to_vec();
        attacked.extend([(1e6, 10.0), (1e6, 10.0), (1e6, 10.0)]);
        let m = weighted_median(&attacked).expect("some");
        assert!((0.9..=1.2).contains(&m), "{m}");
    }

    #[test]
    fn a_reference_falls_with_the_median_and_rises_only_as_three_quarters_of_the_weight_reach() {
        let equal = |v: &[f64]| v.iter().map(|v| (*v, 1.0)).collect::<Vec<_>>();
        // 11 honest norms about 1, 9 keys at 1.5 × the reference: the median (1.08) is
        // honest, and nothing rises above the reference of 1
        let mut attacked: Vec<f64> = (0..11).map(|i| 0.9 + 0.02 * f64::from(i)).collect();
        attacked.extend([1.5; 9]);
        assert_eq!(next_reference(&equal(&attacked), Some(1.0)), Some(1.0));
        // the same 9 holding 11 of 20 in a sample past the budget: a median would
        // double the bound (at most), the quarter holds it
        let mut majority: Vec<f64> = (0..9).map(|i| 0.9 + 0.02 * f64::from(i)).collect();
        majority.extend([1e6; 11]);
        assert_eq!(weighted_median(&equal(&majority)).map(|m| bounded_move(m, Some(1.0))), Some(2.0));
        assert_eq!(next_reference(&equal(&majority), Some(1.0)), Some(1.0));
        // a rise that three quarters of the weight carry goes through, bounded
        assert_eq!(next_reference(&equal(&[1.5, 1.6, 1.7, 1.8]), Some(1.0)), Some(1.5));
        assert_eq!(next_reference(&equal(&[5.0, 6.0, 7.0, 8.0]), Some(1.0)), Some(2.0));
        // a fall follows the median, bounded; with nothing before, the median
        assert_eq!(next_reference(&equal(&[0.5, 0.6, 0.7, 2.0]), Some(1.0)), Some(0.6));
        assert_eq!(next_reference(&equal(&[0.1, 0.1, 0.1]), Some(1.0)), Some(0.5));
        assert_eq!(next_reference(&equal(&[3.0, 4.0, 5.0]), None), Some(4.0));
        assert_eq!(next_reference(&equal(&[0.0, f64::NAN]), Some(1.0)), None);
        // by weight: fresh keys (no earned work) carry no rise; the earned keys'
        // median is a fall
        let fresh = [(0.9, 10.0), (1.0, 10.0), (5.0, 0.0), (5.0, 0.0), (5.0, 0.0)];
        assert_eq!(next_reference(&fresh, Some(1.0)), Some(0.9));
    }

    #[test]
    fn a_reference_moves_at_most_a_factor_of_two_a_round() {
        assert_eq!(bounded_move(0.0, Some(4.0)), 2.0);
        assert_eq!(bounded_move(1e6, Some(4.0)), 8.0);
        assert_eq!(bounded_move(5.0, Some(4.0)), 5.0);
        assert_eq!(bounded_move(5.0, None), 5.0);
        assert_eq!(bounded_move(5.0, Some(0.0)), 5.0, "no positive reference to move from");
    }

    #[test]
    fn earned_work_decays_is_forfeited_and_stays_bounded() {
        let mut e = Earned::default();
        e.close_round([(1u32, 100), (2, 50)]);
        assert_eq!(e.weight(&1), 100.0);
        e.close_round([(2, 50)]);
        assert_eq!(e.weight(&1), 100.0 * (1.0 - EARNED_DECAY));
        assert_eq!(e.weight(&2), 50.0 * (1.0 - EARNED_DECAY) + 50.0);
        e.forfeit(&2);
        assert_eq!(e.weight(&2), 0.0);
        assert_eq!(e.weight(&3), 0.0, "never contributed");
        let mut many = Earned::default();
        many.close_round((0..MAX_EARNED as u32 + 10).map(|p| (p, u64::from(p) + 1)));
        assert_eq!(many.len(), MAX_EARNED);
        assert_eq!(many.weight(&0), 0.0, "the least earned go first");
        assert!(many.weight(&(MAX_EARNED as u32 + 9)) > 0.0);
    }

    #[test]
    fn tensor_references_keep_untouched_tensors_and_move_a_bounded_factor() {
        let previous = vec![Some((1.0, 0.5)), Some((2.0, 1.0))];
        // tensor 0 sent as zeros by everyone: it keeps its reference; tensor 1 asks 100×
        let stats = vec![(1.0, vec![(0.0, 0.0), (200.0, 100.0)]), (1.0, vec![(0.0, 0.0), (200.0, 100.0)])];
        let next = tensor_references(&previous, &stats);
        assert_eq!(next, vec![Some((1.0, 0.5)), Some((4.0, 2.0))]);
        assert_eq!(tensor_references(&[], &[(0.0, vec![(3.0, 1.5)])]), vec![Some((3.0, 1.5))]);
    }
}
