//! Screening committees: who scores a contribution, how their scores become one
//! verdict, and when the shepherd checks them itself. Sans-IO and deterministic,
//! so anyone holding a round's revealed screen seed can audit it.
//!
//! * **Chosen by the seed.** Each round's screen seed is committed in its
//!   announcement and revealed in the next one. A contribution's committee is
//!   the `k` eligible screeners (rated workers, its sender left out) whose
//!   `blake3(seed ‖ contribution hash ‖ key)` ranks lowest ([`committee`]):
//!   rendezvous hashing, so a contributor, who knows neither the seed nor,
//!   before it sends, its contribution's place among the others, cannot pick its
//!   screeners, and a screener cannot pick what it scores.
//! * **The median decides.** A screener returns the held-out losses it computed
//!   ([`Losses`]: before, after, reversed). Once [`Tally::quorum`] of the `k` have
//!   answered, the verdict is the median of each loss ([`Tally::verdict`]): up to
//!   ⌈k/2⌉ − 1 lying screeners move it no further than an honest one's.
//! * **Spot checks.** The shepherd scores a share of contributions itself
//!   ([`spot_checked`], drawn from the seed at the manifest's rate). A screener
//!   whose losses disagree with the shepherd's by more than the numeric noise of
//!   different devices ([`agrees`]: [`ABS_TOLERANCE`] plus [`REL_TOLERANCE`] of
//!   the loss) is caught: it loses its rating and its screening role.
//! * **A round's machine** ([`screening::Screening`]): assigns each contribution
//!   its committee on receipt, takes a verdict only from agreeing answers, and
//!   asks the shepherd to score it whenever they disagree, fall silent or the
//!   spot check draws it.

use super::rating::Ratings;

pub mod screening;

/// Screeners a committee in open runs (`--screeners`' default there), where
/// identities are free and a round's contributions too many for the shepherd's
/// own screen.
pub const DEFAULT_SCREENERS: u32 = 3;

/// The share of committee-screened contributions the shepherd scores itself
/// (`--screen-spot-rate`'s default).
pub const DEFAULT_SPOT_RATE: f64 = 0.1;

/// Losses within this much of the shepherd's agree, whatever their size.
pub const ABS_TOLERANCE: f32 = 2e-3;
/// And within this share of the loss: the spread of one loss between f32 and
/// bf16 steps on different devices (`docs/gpus.md`: 1.1e-3 relative, bf16).
pub const REL_TOLERANCE: f32 = 5e-3;

/// The least share of its step at which a contribution must do best
/// ([`Losses::best_step`]). Random values mostly raise the loss both ways, and the
/// sliver of slope they have is best at a ten-thousandth of their step (on a small
/// model's sparse updates some point downhill on the batch with a best step past
/// this, early or late in a run, and meet the gain bar instead); an honest
/// contribution late in a run is best at a quarter of its step (the fitted gain,
/// [`Losses::improvement`], measures a direction, so without this bar a run's
/// first round, which has no gain bar yet, would pass junk that happens to
/// point downhill).
pub const MIN_BEST_STEP: f64 = 1.0 / 32.0;

/// The held-out losses a screen computes for one contribution.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Losses {
    /// At the round's parameters.
    pub before: f32,
    /// With the contribution applied alone.
    pub after: f32,
    /// With it applied reversed.
    pub reversed: f32,
}

impl Losses {
    /// Whether the contribution points downhill ([`Self::improves`]) and its best
    /// step lowers the loss by at least `min_gain` ([`Self::improvement`]).
    pub fn passed(&self, min_gain: f64) -> bool {
        self.improves() && self.improvement() >= min_gain
    }

    /// Whether the contribution points downhill and is not mostly noise: it lowers
    /// the loss more than its opposite does (NaN does not), and its best step
    /// ([`Self::best_step`]) is at least [`MIN_BEST_STEP`] of it, whatever the gain.
    pub fn improves(&self) -> bool {
        self.downhill() && self.best_step() >= MIN_BEST_STEP
    }

    /// Finite, and lower with the contribution than with its opposite.
    fn downhill(&self) -> bool {
        self.all_finite() && self.after < self.reversed
    }

    /// The most the contribution lowers the loss at a share `s` of its step,
    /// 0 ≤ `s` ≤ 1, along the parabola through its three losses (at −1, 0 and +1
    /// step; [`Self::best_step`]). It is `before − after` where the whole step is
    /// best, and more where the whole step overshoots: a contribution alone carries
    /// its own minibatches' noise, which a round's mean averages away, so late in a
    /// run an honest one overshoots the held-out batch at the whole step
    /// (nanogpt-small, fp32: 2.7308 with it, 2.6866 without, 2.8340 reversed; its
    /// best step, 0.27 of it, lowers the loss by 0.0069). The gain is the
    /// direction's, whatever its norm: scaling a contribution moves its best step,
    /// not the gain there, so the norm bounds, not the screen, hold its size.
    /// 0 where it does not improve ([`Self::improves`]).
    pub fn improvement(&self) -> f64 {
        if !self.improves() {
            return 0.0;
        }
        let s = self.best_step();
        let (slope, curve) = self.shape();
        -(slope * s + curve * s * s / 2.0)
    }

    /// The share of its step, in (0, 1], at which the contribution lowers the loss
    /// most along the parabola through its three losses (1 where the parabola has
    /// no minimum short of the whole step); 0 where it does not point downhill.
    pub fn best_step(&self) -> f64 {
        if !self.downhill() {
            return 0.0;
        }
        let (slope, curve) = self.shape();
        if curve > 0.0 { (-slope / curve).min(1.0) } else { 1.0 }
    }

    /// The parabola's slope and curvature at the round's parameters, in steps.
    fn shape(&self) -> (f64, f64) {
        let (b, a, r) = (f64::from(self.before), f64::from(self.after), f64::from(self.reversed));
        ((a - r) / 2.0, a + r - 2.0 * b)
    }

    fn all_finite(&self) -> bool {
        self.before.is_finite() && self.after.is_finite() && self.reversed.is_finite()
    }
}

/// The rank of `key` in `contribution`'s draw from `seed` (lower is drawn first).
fn rank(seed: &[u8; 32], contribution: &[u8; 32], key: &[u8]) -> [u8; 32] {
    let mut h = blake3::Hasher::new();
    h.update(b"pcp/screen-committee/v1");
    h.update(seed);
    h.update(contribution);
    h.update(&(key.len() as u64).to_le_bytes());
    h.update(key);
    *h.finalize().as_bytes()
}

/// The committee that scores the contribution hashed `contribution`, sent by
/// `sender`: the `k` keys of `eligible` (without `sender`) that rank lowest for it
/// under `seed`, in that order. Fewer when fewer are eligible. The same inputs
/// give the same committee whatever the order of `eligible`.
pub fn committee<P: AsRef<[u8]> + Clone + PartialEq>(
    seed: &[u8; 32],
    contribution: &[u8; 32],
    sender: &P,
    eligible: &[P],
    k: usize,
) -> Vec<P> {
    let mut ranked: Vec<([u8; 32], &P)> =
        eligible.iter().filter(|p| *p != sender).map(|p| (rank(seed, contribution, p.as_ref()), p)).collect();
    ranked.sort_by(|a, b| a.0.cmp(&b.0).then_with(|| a.1.as_ref().cmp(b.1.as_ref())));
    ranked.dedup_by(|a, b| a.1 == b.1);
    ranked.into_iter().take(k).map(|(_, p)| p.clone()).collect()
}

/// Whether the shepherd scores the contribution hashed `contribution` itself,
/// with probability `rate` (0: never, 1: always), drawn from `seed`.
pub fn spot_checked(seed: &[u8; 32], contribution: &[u8; 32], rate: f64) -> bool {
    if rate <= 0.0 {
        return false;
    }
    let mut h = blake3::Hasher::new();
    h.update(b"pcp/screen-spot-check/v1");
    h.update(seed);
    h.update(contribution);
    let mut first = [0u8; 8];
    first.copy_from_slice(&h.finalize().as_bytes()[..8]);
    // the top 53 bits as a uniform draw in [0, 1)
    let draw = (u64::from_le_bytes(first) >> 11) as f64 / (1u64 << 53) as f64;
    draw < rate
}

/// Whether a screener's `claimed` losses agree with the shepherd's `checked`
/// ones, within what different devices and precisions give ([`ABS_TOLERANCE`],
/// [`REL_TOLERANCE`]). A non-finite claim never agrees.
pub fn agrees(claimed: &Losses, checked: &Losses) -> bool {
    let close = |c: f32, s: f32| (c - s).abs() <= ABS_TOLERANCE + REL_TOLERANCE * s.abs();
    claimed.all_finite()
        && close(claimed.before, checked.before)
        && close(claimed.after, checked.after)
        && close(claimed.reversed, checked.reversed)
}

/// Why a screener's answer was not counted.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    /// It is not on the contribution's committee.
    #[error("not on this contribution's committee")]
    NotMember,
    /// It answered already.
    #[error("answered already")]
    Duplicate,
    /// A loss was NaN or infinite.
    #[error("a non-finite loss")]
    NonFinite,
}

/// The answers of one contribution's committee so far.
#[derive(Clone, Debug)]
pub struct Tally<P> {
    members: Vec<P>,
    answers: Vec<(P, Losses)>,
}

impl<P: Clone + PartialEq> Tally<P> {
    /// A committee of `members` ([`committee`]) that has not answered yet.
    pub fn new(members: Vec<P>) -> Self {
        Self { members, answers: Vec::new() }
    }

    /// The committee.
    pub fn members(&self) -> &[P] {
        &self.members
    }

    /// Answers that count: at most one per member, all finite.
    pub fn answer(&mut self, from: &P, losses: Losses) -> Result<(), Refused> {
        if !self.members.contains(from) {
            return Err(Refused::NotMember);
        }
        if self.answers.iter().any(|(p, _)| p == from) {
            return Err(Refused::Duplicate);
        }
        if !losses.all_finite() {
            return Err(Refused::NonFinite);
        }
        self.answers.push((from.clone(), losses));
        Ok(())
    }

    /// The answers so far, in arrival order.
    pub fn answers(&self) -> &[(P, Losses)] {
        &self.answers
    }

    /// Answers needed for a verdict: a strict majority of the committee.
    pub fn quorum(&self) -> usize {
        self.members.len() / 2 + 1
    }

    /// The committee's verdict once a quorum answered: the lower median of each
    /// loss over the answers. `None` before (the shepherd then scores it itself,
    /// or waits).
    pub fn verdict(&self) -> Option<Losses> {
        if self.members.is_empty() || self.answers.len() < self.quorum() {
            return None;
        }
        let median = |f: fn(&Losses) -> f32| {
            let mut v: Vec<f32> = self.answers.iter().map(|(_, l)| f(l)).collect();
            v.sort_by(f32::total_cmp);
            v[(v.len() - 1) / 2]
        };
        Some(Losses { before: median(|l| l.before), after: median(|l| l.after), reversed: median(|l| l.reversed) })
    }

    /// The members whose answers disagree with the shepherd's own `checked`
    /// losses ([`agrees`]): each is caught.
    pub fn disagreeing(&self, checked: &Losses) -> Vec<P> {
        self.answers.iter().filter(|(_, l)| !agrees(l, checked)).map(|(p, _)| p.clone()).collect()
    }
}

/// The keys that may screen in `round`: rated (out of probation), not sitting out,
/// and not among `barred` (caught lying as screeners), sorted.
pub fn eligible<P: Ord + Clone>(ratings: &Ratings<P>, round: u64, candidates: &[P], barred: &[P]) -> Vec<P> {
    let mut out: Vec<P> = candidates
        .iter()
        .filter(|p| ratings.get(p).is_some() && !ratings.on_probation(p) && !ratings.sits_out(p, round))
        .filter(|p| !barred.contains(p))
        .cloned()
        .collect();
    out.sort();
    out.dedup();
    out
}

#[cfg(test)]
mod tests;
