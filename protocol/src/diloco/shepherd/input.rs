//! What happens to the shepherd: its [`Input`]s. A contribution is one input,
//! with how it was made ([`Timing`]) and the screen's verdict on it ([`Screen`]),
//! so that the state machine decides on it whole and a host has no order of
//! inputs to keep.

use crate::diloco::Tensors;
use crate::diloco::aggregate::{Delta, Rejection};

/// What happens to the shepherd.
#[derive(Clone, Debug, PartialEq)]
pub enum Input<P> {
    /// A worker asked to join.
    Joined(P),
    /// A worker said goodbye (or its connection closed for good).
    Left(P),
    /// A worker is alive.
    Heartbeat(P),
    /// A verified, decoded contribution.
    Contribution {
        /// Who sent it (the envelope's signer).
        peer: P,
        /// The round it claims.
        round: u64,
        /// Samples (tokens) trained on.
        samples: u64,
        /// The worker's mean inner loss.
        loss: f32,
        /// θ_start − θ_end, dense or sparse.
        delta: Delta,
        /// How it was made, if the host knows (an overlapping run learns its
        /// budget and deadline from the accepted contributions'; a lockstep run
        /// ignores it).
        timing: Option<Timing>,
        /// The screen's verdict (a failed screen is an [`Input::Malformed`]).
        screen: Screen,
    },
    /// A contribution its aggregators summed: what their agreed reports say of it
    /// ([`crate::diloco::aggregation::Collect`]). The shepherd holds none of its
    /// tensors: once it is added, an [`super::Action::Added`] tells the host to
    /// pass it on, and the round's close waits for the aggregators' mean
    /// ([`Input::Aggregated`]). One made for the round before, carried over (an
    /// overlapping run), is added to the open round's: the host sends its slices
    /// to the open round's aggregators, which bound them by its bounds.
    Reported {
        /// Who sent it (the signer of its slice commitments).
        peer: P,
        /// The round it claims.
        round: u64,
        /// Samples (tokens) trained on.
        samples: u64,
        /// The worker's mean inner loss.
        loss: f32,
        /// What the aggregators reported of it.
        report: Report,
        /// How it was made, as for a contribution.
        timing: Option<Timing>,
        /// The screen's verdict.
        screen: Screen,
    },
    /// The aggregators' mean of the contributions an aggregated round added
    /// ([`super::Action::Aggregate`]): each shard's mean, joined in model order,
    /// and the weights it divides by (`None`: the round is given up, and its
    /// contributions added alone are applied).
    Aggregated {
        /// The round.
        round: u64,
        /// The mean and its total weight.
        mean: Option<(Tensors, f64)>,
    },
    /// A contribution refused before the state machine decides on it: it could
    /// not be decoded or verified, or the screen refused it (one it failed,
    /// [`Rejection::NoImprovement`] or [`Rejection::SmallImprovement`], catches
    /// its sender).
    Malformed {
        /// Who sent it.
        peer: P,
        /// The round it claims.
        round: u64,
        /// Why.
        reason: Rejection,
    },
    /// Time passed.
    Tick,
}

/// How a contribution was made: the inner steps the worker ran and their time
/// (its claim, from its message), and how long the contribution took from its
/// send to the host's measure (the transfer and its queue; the state machine
/// takes its send to be that long before the contribution's input).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Timing {
    /// Inner steps run.
    pub steps: u64,
    /// Milliseconds they took.
    pub train_ms: u64,
    /// Milliseconds from the send to the host's measure.
    pub transfer_ms: u64,
}

/// What a contribution's aggregators agreed on ([`crate::diloco::aggregation::Reported::Ready`]).
#[derive(Clone, Debug, PartialEq)]
pub struct Report {
    /// Each tensor's raw (L2 norm, largest magnitude), in model order.
    pub raw: Vec<(f64, f32)>,
    /// Its L2 norm once bounded by the round's per-tensor bounds.
    pub bounded_norm: f64,
}

impl Report {
    /// Its raw L2 norm, checked against the round's `sizes`: one statistic a
    /// tensor, all finite and not negative.
    pub fn validate(&self, sizes: &[usize]) -> Result<f64, Rejection> {
        if self.raw.len() != sizes.len() {
            return Err(Rejection::Count { got: self.raw.len(), expected: sizes.len() });
        }
        if let Some(index) = self.raw.iter().position(|(n, m)| !(n.is_finite() && *n >= 0.0 && m.is_finite())) {
            return Err(Rejection::NonFinite { index });
        }
        if !(self.bounded_norm.is_finite() && self.bounded_norm >= 0.0) {
            return Err(Rejection::NonFinite { index: 0 });
        }
        Ok(self.raw.iter().map(|(n, _)| n * n).sum::<f64>().sqrt())
    }
}

/// The screen's verdict on a contribution the state machine is given.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Screen {
    /// The score screen passed it: it lowered the held-out loss by `improvement`
    /// (the loss without it less the loss with it) at the scale it is applied.
    /// With ratings, this rates its sender, and its contribution can be a
    /// reference.
    Passed {
        /// The loss without it less the loss with it.
        improvement: f64,
    },
    /// Not scored: the run has no score screen, or sampling let it through. With
    /// ratings, such a contribution is never a reference.
    Unscreened,
}

impl Screen {
    /// The improvement a passed screen measured.
    pub fn improvement(self) -> Option<f64> {
        match self {
            Self::Passed { improvement } => Some(improvement),
            Self::Unscreened => None,
        }
    }
}

#[cfg(test)]
impl<P> Input<P> {
    /// A contribution, untimed and unscreened.
    pub(super) fn contribution(peer: P, round: u64, samples: u64, loss: f32, delta: Delta) -> Self {
        Self::Contribution { peer, round, samples, loss, delta, timing: None, screen: Screen::Unscreened }
    }

    /// This contribution, with a screen that passed it at `improvement`.
    pub(super) fn passed(mut self, improvement: f64) -> Self {
        if let Self::Contribution { screen, .. } = &mut self {
            *screen = Screen::Passed { improvement };
        }
        self
    }

    /// This contribution, made in `steps` inner steps of `train_ms` and sent
    /// `transfer_ms` before its input.
    pub(super) fn timed(mut self, steps: u64, train_ms: u64, transfer_ms: u64) -> Self {
        if let Self::Contribution { timing, .. } = &mut self {
            *timing = Some(Timing { steps, train_ms, transfer_ms });
        }
        self
    }
}
