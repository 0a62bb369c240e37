//! How a run's steps go: the learning-rate schedule, and the validation loss that
//! `train` and the DiLoCo shepherd report alike.

use crate::training::data::{Sampler, Split};
use crate::training::engine::Engine;

/// Warmup, then cosine decay to `min_lr` at `total` steps; `step` is 1-based.
pub(crate) fn learning_rate(step: u64, total: u64, peak: f64, min: f64, warmup: u64) -> f64 {
    if warmup > 0 && step <= warmup {
        return peak * step as f64 / warmup as f64;
    }
    let span = total.saturating_sub(warmup).max(1) as f64;
    let progress = ((step - warmup) as f64 / span).min(1.0);
    min + 0.5 * (peak - min) * (1.0 + (std::f64::consts::PI * progress).cos())
}

/// The mean loss of `engine`'s parameters over `batches` validation batches of
/// `(batch, block)`, fixed by `seed`: `train` and the DiLoCo shepherd report the same
/// measure.
pub(crate) async fn validation_loss(
    engine: &Engine,
    val: &Split,
    (batch, block): (usize, usize),
    seed: u64,
    batches: u64,
) -> anyhow::Result<f64> {
    let mut sampler = Sampler::new(val.clone(), batch, block, seed ^ 0x5eed_0f7a)?;
    let mut total = 0.0;
    for _ in 0..batches.max(1) {
        total += f64::from(engine.eval(&sampler.next_batch()).await?);
    }
    Ok(total / batches.max(1) as f64)
}
