//! Hostile workers, for tests, benchmarks and `sim --hostile`: what a worker
//! that attacks the run sends instead of its honest pseudo-gradient.
//!
//! An attack is a [`Hostile`] kind, from round 1 or, as `sleeper:R:KIND`, only
//! after R honest rounds (a key that earned its rating, then turns).

use std::sync::{Arc, Mutex};

use pcp_protocol::diloco::Tensors;
use pcp_protocol::diloco::committee::Losses;

/// How a hostile worker corrupts its pseudo-gradient.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Hostile {
    /// One value is NaN.
    Nan,
    /// Everything × the factor (`scale`: 1000, `huge`: 10⁶).
    Scale(f32),
    /// −Δ: the honest pseudo-gradient, sign-flipped (the same norm).
    Flip,
    /// Random values with the honest pseudo-gradient's norm.
    Noise,
    /// Honest training, but also gossips round announcements it signs itself, as if
    /// it led a term.
    Forge,
    /// Random values at the honest norm, claiming 10^12 samples.
    Inflate,
    /// The honest norm on four coordinates of the largest tensor, against the
    /// honest direction.
    Concentrate,
    /// −Δ, sent only once the next round is announced (an overlapping run carries
    /// it into that round).
    Late,
    /// One inner step's Δ × 0.01, sent as soon as it is made: tiny, early and in
    /// the honest direction, to drag the norm bound down.
    Drag,
    /// One of N identities sending the same random direction at the honest norm
    /// (`sim` starts the other N − 1).
    Sybil(u32),
    /// Δ = 0: no work, claiming τ steps.
    Zero,
    /// 4 × the last round's public update (θ before − θ after, which every
    /// worker sees): a free rider.
    Copy,
    /// One of N identities sending one honest Δ, computed by whichever of them
    /// finishes first (`sim` starts the other N − 1 and gives them one slot).
    Replay(u32),
    /// Honest work, claiming it took 1 ms (to cut everyone's step budget).
    Timing,
    /// Honest work, but an aggregated contribution's slices are deleted from its
    /// store as they are sent to its aggregators: it serves no screening
    /// committee (as a sender dodging the screen, or a volunteer gone once it
    /// uploaded, does).
    Withhold,
    /// Junk the instant a round opens: one inner step, sent as random values at
    /// that step's norm.
    Early,
    /// An aggregator's (`--aggregate`): honest training, but it signs a wrong sum
    /// of its shards (their mean negated).
    AggAlter,
    /// An aggregator's: it signs its shards' sum without half their inputs (the
    /// mean and its divisor halved).
    AggDrop,
    /// An aggregator's: it reports the slices but never votes on its shards.
    AggStall,
    /// An aggregator's: it reports each slice's norms at a hundredth of the truth
    /// (to drag the bounds down), and sums honestly.
    AggMisreport,
    /// An aggregator's: it never reports a slice, and sums and votes honestly.
    AggMute,
    /// A screener's (`--screeners`): honest training, but every contribution it
    /// screens looks harmful (the loss with it above the loss without).
    ScreenHigh,
    /// A screener's: every contribution it screens looks helpful (the loss with
    /// it well below the loss without and reversed).
    ScreenLow,
}

/// The kinds `--hostile` takes, for its errors.
pub(crate) const HOSTILE_KINDS: &str = "nan, scale, huge, flip, noise, forge, inflate, concentrate, late, drag, \
     zero, copy, timing, withhold, early, agg-alter, agg-drop, agg-stall, agg-misreport, agg-mute, screen-high, screen-low, sybil:N, replay:N, or sleeper:R:KIND (KIND after R \
     honest rounds)";

/// An attack: its kind, and the honest rounds before it (a sleeper's).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Attack {
    /// What it sends.
    pub(crate) kind: Hostile,
    /// Rounds it stays honest first.
    pub(crate) honest_rounds: u64,
}

impl Attack {
    /// `KIND` or `sleeper:R:KIND`.
    pub(crate) fn parse(s: &str) -> Option<Self> {
        if let Some(rest) = s.strip_prefix("sleeper:") {
            let (rounds, kind) = rest.split_once(':')?;
            let honest_rounds = rounds.parse().ok()?;
            let kind = Hostile::parse(kind)?;
            return Some(Self { kind, honest_rounds });
        }
        Hostile::parse(s).map(|kind| Self { kind, honest_rounds: 0 })
    }

    /// The kind it sends in `round` (none while a sleeper is honest).
    pub(crate) fn at(self, round: u64) -> Option<Hostile> {
        (round > self.honest_rounds).then_some(self.kind)
    }
}

impl Hostile {
    pub(crate) fn parse(s: &str) -> Option<Self> {
        match s {
            "nan" => Some(Self::Nan),
            "scale" => Some(Self::Scale(1000.0)),
            "huge" => Some(Self::Scale(1e6)),
            "flip" => Some(Self::Flip),
            "noise" => Some(Self::Noise),
            "forge" => Some(Self::Forge),
            "inflate" => Some(Self::Inflate),
            "concentrate" => Some(Self::Concentrate),
            "late" => Some(Self::Late),
            "drag" => Some(Self::Drag),
            "zero" => Some(Self::Zero),
            "copy" => Some(Self::Copy),
            "timing" => Some(Self::Timing),
            "withhold" => Some(Self::Withhold),
            "early" => Some(Self::Early),
            "agg-alter" => Some(Self::AggAlter),
            "agg-drop" => Some(Self::AggDrop),
            "agg-stall" => Some(Self::AggStall),
            "agg-misreport" => Some(Self::AggMisreport),
            "agg-mute" => Some(Self::AggMute),
            "screen-high" => Some(Self::ScreenHigh),
            "screen-low" => Some(Self::ScreenLow),
            _ => {
                let count =
                    |prefix: &str| s.strip_prefix(prefix).and_then(|n| n.parse::<u32>().ok()).filter(|n| *n >= 1);
                match (count("sybil:"), count("replay:")) {
                    (Some(n), _) => Some(Self::Sybil(n)),
                    (_, Some(n)) => Some(Self::Replay(n)),
                    _ => None,
                }
            }
        }
    }

    /// The inner steps a round takes: one for a drag or an early attack, else τ.
    pub(crate) fn steps(hostile: Option<Self>, tau: u64) -> u64 {
        match hostile {
            Some(Self::Drag | Self::Early) => tau.min(1),
            _ => tau,
        }
    }

    /// What a screener attacking in `round` reports for a contribution whose
    /// honest losses are `honest`: `screen-high` makes it look harmful,
    /// `screen-low` helpful; anyone else reports the truth.
    pub(crate) fn screened(attack: Option<Attack>, round: u64, honest: Losses) -> Losses {
        let before = honest.before;
        match attack.and_then(|a| a.at(round)) {
            Some(Self::ScreenHigh) => Losses { before, after: before + 0.5, reversed: before - 0.5 },
            Some(Self::ScreenLow) => Losses { before, after: before - 0.5, reversed: before + 0.5 },
            _ => honest,
        }
    }

    /// The identities the attack runs as (`sybil:N`, `replay:N`: N).
    pub(crate) fn identities(self) -> u32 {
        match self {
            Self::Sybil(n) | Self::Replay(n) => n,
            _ => 1,
        }
    }
}

/// The Δ a `replay:N` group sends in a round: the first to finish puts its own.
pub(crate) type ReplaySlot = Arc<Mutex<Option<(u64, Tensors)>>>;

/// What an attacker remembers between rounds.
#[derive(Debug, Default)]
pub(crate) struct Attacker {
    /// `copy`: the last two global parameters the worker fetched, the older first:
    /// their difference is the last public update.
    globals: (Option<Tensors>, Option<Tensors>),
}

impl Attacker {
    /// The worker fetched the global parameters `params` (a round's, as its
    /// announcement names them): a copier keeps the last two, honest rounds
    /// included, whether it trains from them (lockstep) or merges their update
    /// into its own (overlap).
    pub(crate) fn fetched(&mut self, attack: Option<Attack>, params: &Tensors) {
        if attack.is_some_and(|a| a.kind == Hostile::Copy) {
            self.globals.0 = self.globals.1.replace(params.clone());
        }
    }

    /// Corrupts `delta`, round `round`'s honest pseudo-gradient, as `attack` does
    /// in that round (`replay`: through the group's `slot`).
    pub(crate) fn corrupt(
        &mut self,
        attack: Option<Attack>,
        round: u64,
        delta: &mut Tensors,
        slot: Option<&ReplaySlot>,
        fragment: std::ops::Range<usize>,
    ) {
        let kind = attack.and_then(|a| a.at(round));
        match kind {
            Some(Hostile::Nan) => delta[fragment.start][0] = f32::NAN,
            Some(Hostile::Scale(k)) => delta.iter_mut().flatten().for_each(|v| *v *= k),
            Some(Hostile::Flip | Hostile::Late) => delta.iter_mut().flatten().for_each(|v| *v = -*v),
            Some(Hostile::Noise | Hostile::Inflate | Hostile::Sybil(_) | Hostile::Early) => noise_like(delta, round),
            Some(Hostile::Concentrate) => concentrate(delta, round),
            Some(Hostile::Drag) => delta.iter_mut().flatten().for_each(|v| *v *= 0.01),
            Some(Hostile::Zero) => delta.iter_mut().flatten().for_each(|v| *v = 0.0),
            Some(Hostile::Copy) => {
                // 4 × the last public update as a pseudo-gradient (θ before it − θ
                // after), where the delta has tensors
                if let (Some(before), Some(after)) = &self.globals {
                    for ((d, p), s) in delta.iter_mut().zip(before).zip(after) {
                        if !d.is_empty() {
                            d.iter_mut().zip(p.iter().zip(s)).for_each(|(d, (p, s))| *d = 4.0 * (p - s));
                        }
                    }
                }
            }
            Some(Hostile::Replay(_)) => {
                if let Some(slot) = slot {
                    let mut slot = slot.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                    match slot.as_ref() {
                        Some((r, shared)) if *r == round => delta.clone_from(shared),
                        _ => *slot = Some((round, delta.clone())),
                    }
                }
            }
            // honest pseudo-gradients: their attacks are elsewhere (the heartbeats, the claimed timing, the slices'
            // serving, the aggregator, the screener)
            Some(
                Hostile::Forge
                | Hostile::Timing
                | Hostile::Withhold
                | Hostile::AggAlter
                | Hostile::AggDrop
                | Hostile::AggStall
                | Hostile::AggMisreport
                | Hostile::AggMute
                | Hostile::ScreenHigh
                | Hostile::ScreenLow,
            )
            | None => {}
        }
    }
}

/// Replaces `delta` with uniform noise of the same L2 norm (a hostile worker's
/// pseudo-gradient of typical size), seeded by the round.
pub(crate) fn noise_like(delta: &mut Tensors, round: u64) {
    use rand::{Rng, SeedableRng};
    let norm = delta.iter().flatten().map(|v| f64::from(*v).powi(2)).sum::<f64>().sqrt();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(round ^ 0x0015_e0ff);
    delta.iter_mut().flatten().for_each(|v| *v = rng.gen_range(-1.0f32..1.0));
    let drawn = delta.iter().flatten().map(|v| f64::from(*v).powi(2)).sum::<f64>().sqrt().max(f64::MIN_POSITIVE);
    let k = (norm / drawn) as f32;
    delta.iter_mut().flatten().for_each(|v| *v *= k);
}

/// Puts the honest norm on four coordinates of the largest tensor, each against
/// the honest value there (a hostile worker's concentrated update), seeded by the round.
fn concentrate(delta: &mut Tensors, round: u64) {
    use rand::{Rng, SeedableRng};
    let norm = delta.iter().flatten().map(|v| f64::from(*v).powi(2)).sum::<f64>().sqrt();
    let Some(largest) = (0..delta.len()).max_by_key(|i| delta[*i].len()) else { return };
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(round ^ 0x0c0c_0c0c);
    let n = delta[largest].len();
    let picked: Vec<(usize, f32)> = (0..4.min(n))
        .map(|_| {
            let i = rng.gen_range(0..n);
            (i, delta[largest][i])
        })
        .collect();
    delta.iter_mut().flatten().for_each(|v| *v = 0.0);
    for (i, honest) in picked {
        delta[largest][i] = -honest.signum() * (norm / 2.0) as f32;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_parse_and_a_sleeper_is_honest_first() {
        let sleeper = Attack::parse("sleeper:4:zero").expect("parses");
        assert_eq!(sleeper, Attack { kind: Hostile::Zero, honest_rounds: 4 });
        assert_eq!((sleeper.at(4), sleeper.at(5)), (None, Some(Hostile::Zero)));
        assert_eq!(Attack::parse("huge").map(|a| a.kind), Some(Hostile::Scale(1e6)));
        assert_eq!(Attack::parse("replay:3").map(|a| a.kind.identities()), Some(3));
        for bad in ["sleeper:x:zero", "sleeper:4", "sleeper:4:nope", "replay:0", "nope"] {
            assert_eq!(Attack::parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn a_copier_sends_four_times_the_last_update_and_a_replay_group_one_delta() {
        let copy = Some(Attack::parse("sleeper:1:copy").expect("parses"));
        let mut a = Attacker::default();
        let mut d = vec![vec![0.5, 0.5]];
        a.fetched(copy, &vec![vec![1.0, 2.0]]);
        a.corrupt(copy, 1, &mut d, None, 0..1);
        assert_eq!(d, vec![vec![0.5, 0.5]], "honest in round 1");
        a.fetched(copy, &vec![vec![0.75, 2.5]]);
        a.corrupt(copy, 2, &mut d, None, 0..1);
        assert_eq!(d, vec![vec![1.0, -2.0]], "4 × (θ₁ − θ₂)");
        // under overlap its own steps are no part of it: only what it fetched is
        let mut d = vec![vec![9.0, 9.0]];
        a.corrupt(copy, 3, &mut d, None, 0..1);
        assert_eq!(d, vec![vec![1.0, -2.0]], "the last update it fetched, whatever it trained");
        a.fetched(copy, &vec![vec![0.5, 2.5]]);
        a.corrupt(copy, 4, &mut d, None, 0..1);
        assert_eq!(d, vec![vec![1.0, 0.0]], "4 × (θ₂ − θ₃)");
        let slot = ReplaySlot::default();
        let replay = Some(Attack { kind: Hostile::Replay(2), honest_rounds: 0 });
        let (mut first, mut second) = (vec![vec![1.0]], vec![vec![7.0]]);
        Attacker::default().corrupt(replay, 3, &mut first, Some(&slot), 0..1);
        Attacker::default().corrupt(replay, 3, &mut second, Some(&slot), 0..1);
        assert_eq!(first, second, "the group sends the first Δ made");
    }
}
