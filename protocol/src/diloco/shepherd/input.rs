//! What happens to the shepherd: its [`Input`]s. A contribution is one input,
//! with how it was made ([`Timing`]) and the screen's verdict on it ([`Screen`]),
//! so that the state machine decides on it whole and a host has no order of
//! inputs to keep.

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
