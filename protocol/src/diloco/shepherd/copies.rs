//! The copy check: a contribution too close to another of its round, or to one
//! of the last two updates, is refused ([`crate::diloco::sketch`]).

use super::Shepherd;
use crate::diloco::aggregate::{Delta, Rejection};
use crate::diloco::sketch::{self, Sketch};

impl<P: Ord + Clone> Shepherd<P> {
    /// With the copy check on, `delta`'s sketch, or its refusal as a copy of an
    /// accepted contribution of the open round or of one of the last two updates
    /// (a copier a round behind takes the one before the last for the last).
    pub(super) fn check_copy(&self, delta: &Delta) -> Result<Option<Sketch>, Rejection> {
        if self.config.similarity > 1.0 {
            return Ok(None);
        }
        // the sketch and the share on the update's support in one pass, on the add threads
        let [update, older] = &self.refs.update_sparse;
        let (key, threads) = (self.config.sketch_key, self.config.add_threads);
        let (sketch, on_support) = sketch::sketch_and_share(key, delta, update.as_ref(), threads);
        let threshold = self.config.similarity;
        for update in [&self.refs.update_sketch, &self.refs.older_update_sketch].into_iter().flatten() {
            let cosine = sketch.cosine(update);
            if cosine >= threshold {
                return Err(Rejection::TooSimilar { cosine, to_update: true });
            }
        }
        // a sparse run: a copy of part of the update, at any precision, lies on its support
        if let Some(share) = on_support.filter(|s| *s >= sketch::SUPPORT_SHARE) {
            return Err(Rejection::OnUpdate { share });
        }
        // and a copy of the update before it, from a copier a round behind, leans on
        // that update's sketch: only such a contribution's support is walked again
        if let (Some(older), Some(older_sketch)) = (older, &self.refs.older_update_sketch)
            && sketch.cosine(older_sketch) >= sketch::SUSPECT_COSINE
            && let Some(share) = sketch::support_share(older, delta)
            && share >= sketch::SUPPORT_SHARE
        {
            return Err(Rejection::OnUpdate { share });
        }
        let others = self.open.iter().flat_map(|o| o.sketches.iter());
        if let Some(cosine) = others.map(|o| sketch.cosine(o)).find(|c| *c >= threshold) {
            return Err(Rejection::TooSimilar { cosine, to_update: false });
        }
        Ok(Some(sketch))
    }
}
