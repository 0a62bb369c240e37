//! The outer optimizer's step at a round's close: Nesterov on the mean, or
//! SparseLoCo's error feedback and its sparse update (encoded on the shepherd's
//! add threads).

use crate::diloco::Tensors;
use crate::diloco::outer::Nesterov;
use crate::diloco::sparse::{self, ErrorFeedback, SparseTensors};

/// The outer optimizer.
#[derive(Clone, Debug, PartialEq)]
pub(super) enum Outer {
    /// DiLoCo's Nesterov step on the mean.
    Nesterov(Nesterov),
    /// SparseLoCo: θ ← θ − Û, Û the sparse top-k of the error feedback plus lr × the mean.
    Sparse {
        /// The outer learning rate.
        lr: f32,
        /// The shepherd's error feedback (decay 1) in the update's layout.
        feedback: ErrorFeedback,
    },
}

impl Outer {
    /// Nesterov's velocity, or the sparse error feedback: what a snapshot keeps.
    pub(super) fn state(&self) -> &Tensors {
        match self {
            Self::Nesterov(n) => &n.velocity,
            Self::Sparse { feedback, .. } => &feedback.buffer,
        }
    }

    pub(super) fn state_mut(&mut self) -> &mut Tensors {
        match self {
            Self::Nesterov(n) => &mut n.velocity,
            Self::Sparse { feedback, .. } => &mut feedback.buffer,
        }
    }

    /// Applies `round`'s mean; returns the sparse update (seeded with the round), if
    /// any, encoded and decoded on `threads` threads.
    pub(super) fn step(
        &mut self,
        params: &mut Tensors,
        mean: &Tensors,
        round: u64,
        threads: usize,
    ) -> Option<(Vec<u8>, SparseTensors)> {
        match self {
            Self::Nesterov(n) => {
                n.step(params, mean);
                None
            }
            Self::Sparse { lr, feedback } => {
                let (bytes, sent) = feedback.compress_seeded_on(mean, *lr, round, threads);
                sparse::subtract(params, &sent, 1.0);
                Some((bytes, sent))
            }
        }
    }
}
