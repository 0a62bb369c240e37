//! What a host's screen needs of the machine: a contribution as the open round
//! applies it, with the bounds and scale that make it (so a screener on another
//! device applies it alike), and a screener's loss of its rating when its score
//! is caught lying.

use super::{Bounds, Delta, Shepherd};

/// A contribution as the open round applies it ([`Shepherd::applied`]).
#[derive(Clone, Debug, PartialEq)]
pub struct Applied {
    /// The contribution bounded and scaled.
    pub delta: Delta,
    /// The round's per-tensor bounds it was held to ([`Delta::bounded`]).
    pub bounds: Bounds,
    /// The global norm bound's scale after them ([`Delta::scaled`]; 1: within it).
    pub scale: f32,
}

impl<P: Ord + Clone> Shepherd<P> {
    /// `peer` screened a contribution on its committee, and its losses contradict
    /// the shepherd's own: it loses its rating (ratings on), as a sender the
    /// screen catches does.
    pub fn screener_caught(&mut self, peer: &P) {
        if self.config.rating.is_some() {
            self.ratings.caught(peer, self.completed + 1);
        }
    }

    /// A contribution to the open round as the round would apply it: bounded per
    /// tensor, then scaled down to the norm bound in force now (what the screen
    /// should score). `None` without an open round or for a delta of the wrong shape.
    pub fn as_applied(&self, delta: &Delta) -> Option<Delta> {
        self.applied(delta).map(|a| a.delta)
    }

    /// [`Self::as_applied`], with the bounds and the scale that made it: what a
    /// screener needs to apply the contribution as the round would.
    pub fn applied(&self, delta: &Delta) -> Option<Applied> {
        let open = self.open.as_ref()?;
        let sizes = self.round_sizes(self.completed + 1);
        delta.validate(&sizes).ok()?;
        let (bounded, norm, _) = delta.clone().bounded(&open.bounds);
        let (bounds, scale) = self.bounds_for(norm)?;
        Some(Applied { delta: bounded.scaled(scale, &sizes), bounds, scale })
    }

    /// The open round's per-tensor bounds, and the global norm bound's scale for
    /// a contribution whose norm is `bounded_norm` once they bound it (an
    /// aggregated contribution's, as its aggregators report it): what its
    /// screeners apply it with.
    pub fn bounds_for(&self, bounded_norm: f64) -> Option<(Bounds, f32)> {
        let open = self.open.as_ref()?;
        let bound = self.bound_now(open, bounded_norm);
        let scale = if bounded_norm <= bound || !bound.is_finite() { 1.0 } else { (bound / bounded_norm) as f32 };
        Some((open.bounds.clone(), scale))
    }
}
