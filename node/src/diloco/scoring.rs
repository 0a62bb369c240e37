//! A contribution's score on a held-out batch: the losses the shepherd's screen
//! computes, and that a screening committee's members compute alike on their
//! own devices.

use pcp_protocol::diloco::Tensors;
use pcp_protocol::diloco::aggregate::Delta;
use pcp_protocol::diloco::committee::Losses;

use crate::training::data::Batch;
use crate::training::engine::{Engine, Resident};

/// The loss on `batch` at `base`, the round's parameters resident on `engine`'s
/// device (`before`, when known already), with `applied` (the contribution as
/// the round applies it) added at `scale`, and with it subtracted. The
/// contribution is uploaded once and both moves happen on the device, so the
/// host copies no parameters; the engine's own parameters are left as they are.
pub(crate) async fn losses(
    engine: &Engine,
    base: &Resident,
    (applied, scale): (&Delta, f32),
    batch: &Batch,
    before: Option<f32>,
) -> anyhow::Result<Losses> {
    let delta = engine.resident(dense(applied, &engine.sizes())?).await?;
    // `before` from the same function as the others (a finite delta at 0 moves
    // nothing), so a contribution of zeros scores no gain to the last bit
    let before = match before {
        Some(b) => b,
        None => engine.eval_moved(base, &delta, 0.0, batch).await?,
    };
    // a pseudo-gradient is θ_start − θ_end, so the step it stands for subtracts it
    let after = engine.eval_moved(base, &delta, -scale, batch).await?;
    let reversed = engine.eval_moved(base, &delta, scale, batch).await?;
    Ok(Losses { before, after, reversed })
}

/// `delta` as one dense tensor of each of `sizes`: a tensor it leaves empty (a
/// fragment's others) as zeros. The error names a tensor of another size.
pub(crate) fn dense(delta: &Delta, sizes: &[usize]) -> anyhow::Result<Tensors> {
    let mut out = match delta {
        Delta::Dense(t) => t.clone(),
        Delta::Sparse(_) | Delta::Packed(_) => {
            let mut out: Tensors = sizes.iter().map(|n| vec![0.0; *n]).collect();
            delta.add_to(&mut out, 1.0);
            out
        }
    };
    anyhow::ensure!(out.len() == sizes.len(), "a contribution of {} tensors, the model has {}", out.len(), sizes.len());
    for (i, (t, n)) in out.iter_mut().zip(sizes).enumerate() {
        if t.is_empty() {
            *t = vec![0.0; *n];
        }
        anyhow::ensure!(t.len() == *n, "tensor {i} of the contribution has {} values, the model's {n}", t.len());
    }
    Ok(out)
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
        let base = engine.resident(start.clone()).await?;
        let l = losses(&engine, &base, (&Delta::Dense(delta.clone()), 1.0), &held_out, None).await?;
        assert!(l.improves(), "{l:?}");
        assert_eq!(engine.params().await?, end, "scoring leaves the engine's parameters");
        assert_eq!(engine.eval(&held_out).await?, engine.eval_at(end.clone(), &held_out).await?);
        // the device's move is the host's: the loss at start − Δ is the loss at the end
        let host = engine.eval_at(end.clone(), &held_out).await?;
        assert!((l.after - host).abs() <= 1e-4 * host.abs(), "moved on the device {}, on the host {host}", l.after);
        let back: Tensors =
            start.iter().zip(&delta).map(|(a, d)| a.iter().zip(d).map(|(x, y)| x + y).collect()).collect();
        let host = engine.eval_at(back, &held_out).await?;
        assert!(
            (l.reversed - host).abs() <= 1e-4 * host.abs(),
            "reversed on the device {}, on the host {host}",
            l.reversed
        );
        // a fragment's contribution: the tensors it leaves empty are zeros
        let mut first: Tensors = delta.iter().map(|_| Vec::new()).collect();
        first[0] = delta[0].clone();
        let f = losses(&engine, &base, (&Delta::Dense(first), 1.0), &held_out, Some(l.before)).await?;
        assert!(f.after.is_finite() && f.after != l.after, "{f:?}");
        let zeros: Tensors = start.iter().map(|t| vec![0.0; t.len()]).collect();
        let z = losses(&engine, &base, (&Delta::Dense(zeros), 1.0), &held_out, Some(l.before)).await?;
        assert_eq!((z.before, z.after, z.reversed), (l.before, l.before, l.before), "{z:?}");
        let short: Tensors = vec![vec![0.0; 3]];
        let e = losses(&engine, &base, (&Delta::Dense(short), 1.0), &held_out, None).await.unwrap_err();
        assert!(e.to_string().contains("a contribution of 1 tensors"), "{e}");
        Ok(())
    }
}
