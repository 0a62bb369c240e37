//! A contribution's score on a held-out batch: the losses the shepherd's screen
//! computes, and that a screening committee's members compute alike on their
//! own devices.

use pcp_protocol::diloco::Tensors;
use pcp_protocol::diloco::aggregate::Delta;
use pcp_protocol::diloco::committee::Losses;

use crate::training::data::Batch;
use crate::training::engine::Engine;

/// The loss on `batch` at `params` (`before`, when known already), with `applied`
/// (the contribution as the round applies it) added at `scale`, and with it
/// subtracted. The engine's own parameters are left as they are.
pub(crate) async fn losses(
    engine: &Engine,
    params: &Tensors,
    (applied, scale): (&Delta, f32),
    batch: &Batch,
    before: Option<f32>,
) -> anyhow::Result<Losses> {
    let before = match before {
        Some(b) => b,
        None => engine.eval_at(params.clone(), batch).await?,
    };
    let after = loss_moved(engine, params, applied, scale, batch).await?;
    let reversed = loss_moved(engine, params, applied, -scale, batch).await?;
    Ok(Losses { before, after, reversed })
}

/// The loss with `delta` applied at `sign` × its scale: a pseudo-gradient is
/// θ_start − θ_end, so the step it stands for subtracts it.
async fn loss_moved(engine: &Engine, params: &Tensors, delta: &Delta, sign: f32, batch: &Batch) -> anyhow::Result<f32> {
    let mut moved = params.clone();
    delta.add_to(&mut moved, -sign);
    engine.eval_at(moved, batch).await
}

/// How long fetching one slice of an aggregated contribution may take.
pub(crate) const SLICE_FETCH: std::time::Duration = std::time::Duration::from_secs(10);
/// How long a slice is sought from its shard's aggregators before its sender is
/// asked instead.
pub(crate) const HOLDER_FETCH: std::time::Duration = std::time::Duration::from_secs(3);
/// Slices of one contribution fetched at once.
const SLICES_IN_FLIGHT: usize = 16;

/// Who serves an aggregated contribution's slices: each shard's aggregators (in
/// shard order; none named: the sender alone), then its sender.
#[derive(Clone, Copy)]
pub(crate) struct Holders<'a> {
    pub(crate) sender: pcp_protocol::PublicKey,
    pub(crate) aggregators: &'a [Vec<[u8; 32]>],
}

/// An aggregated contribution made whole to be scored: each of its `hashes` (one
/// slice a shard, in shard order) fetched from its shard's aggregators, which
/// took it before the shepherd heard of the contribution, or else from its
/// sender (so a committee's copies cost the sender's uplink nothing while its
/// aggregators serve them), decoded as its shard's tensors of `sizes` in
/// `encoding`, and joined, dense. A slice is read only up to its shard's
/// encoded length; a slice fetched here is released once read (one this node
/// held already is kept). The error names the slice.
pub(crate) async fn fetch_sliced(
    node: &pcp_bootstrap::Node,
    from: Holders<'_>,
    hashes: &[[u8; 32]],
    (sizes, encoding): (&[usize], pcp_protocol::diloco::compress::Encoding),
) -> Result<Delta, String> {
    use futures::StreamExt as _;
    use pcp_protocol::diloco::compress;
    let tensors = pcp_protocol::diloco::aggregation::shard_tensors(sizes, hashes.len())
        .ok_or_else(|| format!("{} slices of a model of {} tensors", hashes.len(), sizes.len()))?;
    let sender: Vec<_> = pcp_bootstrap::peer_of(&from.sender).into_iter().collect();
    let me = node.peer_id();
    let fetches = tensors.into_iter().zip(hashes.iter().copied()).enumerate().map(|(shard, (range, hash))| {
        let shard_sizes = sizes[range].to_vec();
        let keys = from.aggregators.get(shard).map_or(&[][..], Vec::as_slice);
        let held: Vec<_> = keys
            .iter()
            .filter_map(|k| pcp_bootstrap::peer_of(&pcp_protocol::PublicKey(*k)))
            .filter(|p| *p != me)
            .collect();
        let (sender, node) = (sender.clone(), node.clone());
        async move {
            let hash = pcp_protocol::BlobHash(hash);
            let max = compress::encoded_len(&shard_sizes, encoding) as u64;
            let fetch = |from, timeout| crate::diloco::wire::fetch_bounded_report(&node, hash, from, (timeout, max));
            let (mut read, mut fetched) = (Err(String::new()), false);
            if !held.is_empty() {
                (read, fetched) = fetch(held, HOLDER_FETCH).await;
                if let Err(e) = &read {
                    tracing::debug!(shard, "slice {hash} from its aggregators: {e}; asking its sender");
                }
            }
            if read.is_err() {
                (read, fetched) = fetch(sender, SLICE_FETCH).await;
            }
            if fetched {
                let _ = node.release(vec![hash]).await;
            }
            let bytes = read.map_err(|e| format!("slice {shard}: {e}"))?;
            let delta =
                compress::decode_delta(&bytes, &shard_sizes, encoding).map_err(|e| format!("slice {shard}: {e}"))?;
            delta.validate(&shard_sizes).map_err(|e| format!("slice {shard}: {e}"))?;
            Ok::<_, String>(delta.to_dense(&shard_sizes))
        }
    });
    let mut joined: Tensors = Vec::with_capacity(sizes.len());
    let mut slices = futures::stream::iter(fetches).buffered(SLICES_IN_FLIGHT);
    while let Some(slice) = slices.next().await {
        joined.extend(slice?);
    }
    Ok(Delta::Dense(joined))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::commands::train::{DeviceArgs, load_engine};
    use crate::training::config::Experiment;
    use crate::training::data::{Corpus, Sampler, default_corpus};
    use crate::training::model::Model;

    /// A real pseudo-gradient (θ_start − θ_end of 20 steps) lowers the held-out
    /// loss, and more than its opposite does; a zero one changes nothing; and the
    /// engine that scored them keeps training from its own parameters.
    #[tokio::test(flavor = "current_thread")]
    async fn a_trained_pseudo_gradient_improves_and_the_engine_keeps_its_parameters() -> anyhow::Result<()> {
        let corpus = Corpus::load(&default_corpus().expect("the demo corpus"), "char", None, 0.1)?;
        let model = Model::load_with_batch("nanogpt-small", corpus.vocab.size(), None)?;
        let experiment = Experiment { model: Some("nanogpt-small".into()), ..Experiment::default() };
        let device = DeviceArgs { backend: "cpu".into(), target: None };
        // the artifacts the multi-process tests share (PCP_ARTIFACT_CACHE)
        let cache = std::env::temp_dir().join("pcp-test-artifact-cache");
        let mut engine = load_engine(&experiment, &model, &device, &cache, None, 1).await?;
        let (batch, block) = model.batch_block()?;
        let start = engine.params().await?;
        let mut sampler = Sampler::new(corpus.train.clone(), batch, block, 1)?;
        for s in 1..=20 {
            engine.step(s, 3e-3, &sampler.next_batch()).await?;
        }
        let end = engine.params().await?;
        let delta: Tensors =
            start.iter().zip(&end).map(|(a, b)| a.iter().zip(b).map(|(x, y)| x - y).collect()).collect();
        let held_out = Sampler::new(corpus.val.clone(), batch, block, 2)?.next_batch();
        let l = losses(&engine, &start, (&Delta::Dense(delta), 1.0), &held_out, None).await?;
        assert!(l.improves(), "{l:?}");
        assert_eq!(engine.params().await?, end, "scoring leaves the engine's parameters");
        assert_eq!(engine.eval(&held_out).await?, engine.eval_at(end.clone(), &held_out).await?);
        let zeros: Tensors = start.iter().map(|t| vec![0.0; t.len()]).collect();
        let z = losses(&engine, &start, (&Delta::Dense(zeros), 1.0), &held_out, Some(l.before)).await?;
        assert_eq!((z.before, z.after, z.reversed), (l.before, l.before, l.before), "{z:?}");
        Ok(())
    }
}
