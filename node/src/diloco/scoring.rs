//! A contribution's score on a held-out batch: the losses the shepherd's screen
//! computes, and that a screening committee's members compute alike on their
//! own devices.

use pcp_protocol::diloco::Tensors;
use pcp_protocol::diloco::aggregate::Delta;
use pcp_protocol::diloco::committee::Losses;

use crate::training::data::Batch;
use crate::training::engine::{Engine, Moved, Resident};

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
    let delta = Prepared::of(engine, applied)?.upload(engine).await?;
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

/// A contribution made ready on the host for its upload: its kept entries where
/// the engine's module scatters them (`eval_sparse`), else dense.
pub(crate) enum Prepared {
    /// Each tensor's kept flat indices and values ([`sparse`]).
    Sparse(Vec<Vec<i32>>, Tensors),
    /// One dense tensor a parameter ([`dense`]).
    Dense(Tensors),
}

impl Prepared {
    /// `applied` made ready for `engine`'s screen.
    pub(crate) fn of(engine: &Engine, applied: &Delta) -> anyhow::Result<Self> {
        let sizes = engine.sizes();
        Ok(match engine.sparse_screen().and_then(|layout| sparse(applied, layout, &sizes)) {
            Some((indices, values)) => Self::Sparse(indices, values),
            None => Self::Dense(dense(applied, &sizes)?),
        })
    }

    /// Uploaded to `engine`'s device.
    pub(crate) async fn upload(self, engine: &Engine) -> anyhow::Result<Moved> {
        match self {
            Self::Sparse(indices, values) => {
                tracing::debug!(entries = values.iter().map(Vec::len).sum::<usize>(), "a screen uploads its entries");
                engine.moved_sparse(indices, values).await
            }
            Self::Dense(dense) => {
                tracing::debug!("a screen uploads its contribution dense");
                engine.moved_dense(dense).await
            }
        }
    }
}

/// `delta` as `eval_sparse` takes it in `layout`: each tensor's flat indices (as
/// i32) and values, `layout.kept_in` of each, ascending and distinct (sorted
/// here if they came in another order, so a sender cannot make its screen cost
/// the dense upload that way). `None` (the dense upload then) for a dense delta,
/// or one that holds another count of entries in a tensor (a fragment's, whose
/// other tensors are empty), an index twice or one past its tensor.
fn sparse(delta: &Delta, layout: pcp_graph::SparseScreen, sizes: &[usize]) -> Option<(Vec<Vec<i32>>, Tensors)> {
    let tensors = match delta {
        Delta::Dense(_) => return None,
        // borrowed: its entries copied
        Delta::Sparse(s) => s.clone(),
        // unpacked: its entries moved
        Delta::Packed(p) => p.unpack(),
    };
    if tensors.len() != sizes.len() {
        return None;
    }
    let mut indices = Vec::with_capacity(sizes.len());
    let mut values = Vec::with_capacity(sizes.len());
    for (mut t, n) in tensors.into_iter().zip(sizes) {
        if t.indices.len() != layout.kept_in(*n) || t.values.len() != t.indices.len() {
            return None;
        }
        if !t.indices.windows(2).all(|w| w[0] < w[1]) {
            let mut pairs: Vec<(u32, f32)> = t.indices.iter().copied().zip(t.values.iter().copied()).collect();
            pairs.sort_unstable_by_key(|(i, _)| *i);
            (t.indices, t.values) = pairs.into_iter().unzip();
            if !t.indices.windows(2).all(|w| w[0] < w[1]) {
                return None;
            }
        }
        if t.indices.last().is_some_and(|i| (*i as usize) >= *n || *i >= i32::MAX as u32) {
            return None;
        }
        // each below i32::MAX (checked): the same bits, collected in place
        indices.push(t.indices.into_iter().map(|i| i as i32).collect());
        values.push(t.values);
    }
    Some((indices, values))
}

/// `delta` as one dense tensor of each of `sizes`: a tensor it leaves empty (a
/// fragment's others) as zeros. The error names a tensor of another size.
fn dense(delta: &Delta, sizes: &[usize]) -> anyhow::Result<Tensors> {
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
            Ok::<_, String>((delta, shard_sizes))
        }
    });
    let mut slices = futures::stream::iter(fetches).buffered(SLICES_IN_FLIGHT);
    let mut joined = Vec::new();
    while let Some(slice) = slices.next().await {
        joined.push(slice?);
    }
    Ok(join(joined))
}

/// Slices of one contribution (each decoded with its shard's sizes), in shard
/// order, as one delta: sparse if every slice is, else dense.
fn join(slices: Vec<(Delta, Vec<usize>)>) -> Delta {
    if slices.iter().any(|(d, _)| matches!(d, Delta::Dense(_))) {
        return Delta::Dense(slices.into_iter().flat_map(|(d, sizes)| d.to_dense(&sizes)).collect());
    }
    let joined = slices.into_iter().flat_map(|(delta, _)| match delta {
        Delta::Sparse(s) => s,
        Delta::Packed(p) => p.unpack(),
        Delta::Dense(_) => Vec::new(),
    });
    Delta::Sparse(joined.collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use pcp_protocol::diloco::sparse::{SparseTensor, SparseTensors};

    fn entries(indices: &[u32], values: &[f32]) -> SparseTensor {
        SparseTensor { indices: indices.to_vec(), values: values.to_vec() }
    }

    /// The graph's count of a layout's kept entries is the protocol's, and only a
    /// contribution holding exactly them, ascending, goes up sparse.
    #[test]
    fn a_sparse_upload_holds_the_layouts_entries_in_order() {
        let layout = pcp_graph::SparseScreen { chunk: 4, k: 1 };
        let protocol = pcp_protocol::diloco::sparse::Layout { chunk: 4, k: 1, bits: 2, strided: false };
        for n in [1, 3, 4, 5, 8, 9, 64, 1000, 1_000_003] {
            assert_eq!(layout.kept_in(n), protocol.kept_in(n), "{n} elements");
        }
        let sizes = [8, 5];
        let good: SparseTensors = vec![entries(&[1, 6], &[1.0, 2.0]), entries(&[0, 4], &[3.0, 4.0])];
        let (indices, values) = sparse(&Delta::Sparse(good.clone()), layout, &sizes).expect("sparse");
        assert_eq!((indices, values), (vec![vec![1, 6], vec![0, 4]], vec![vec![1.0, 2.0], vec![3.0, 4.0]]));
        let mut unordered = good.clone();
        (unordered[0].indices, unordered[0].values) = (vec![6, 1], vec![2.0, 1.0]);
        let sorted = sparse(&Delta::Sparse(unordered), layout, &sizes).expect("sorted");
        assert_eq!(sorted, sparse(&Delta::Sparse(good.clone()), layout, &sizes).expect("sparse"), "sorted as it came");
        let mut twice = good.clone();
        twice[0].indices = vec![6, 6];
        let mut outside = good.clone();
        outside[1].indices = vec![0, 5];
        let mut fragment = good.clone();
        fragment[1] = entries(&[], &[]);
        for (why, delta) in [("an index twice", twice), ("past the tensor", outside), ("a fragment's", fragment)] {
            assert!(sparse(&Delta::Sparse(delta), layout, &sizes).is_none(), "{why}");
        }
        assert!(sparse(&Delta::Dense(vec![vec![0.0; 8], vec![0.0; 5]]), layout, &sizes).is_none());
        // scaled, it stays sparse, and is what the dense scale gives
        let scaled = Delta::Sparse(good.clone()).scaled(0.5, &sizes);
        assert!(matches!(scaled, Delta::Sparse(_)));
        let dense = Delta::Dense(Delta::Sparse(good.clone()).to_dense(&sizes)).scaled(0.5, &sizes);
        assert_eq!(scaled.to_dense(&sizes), dense.to_dense(&sizes));
        // an aggregated contribution's slices join sparse, or dense if one is
        let slices =
            vec![(Delta::Sparse(vec![good[0].clone()]), vec![8]), (Delta::Sparse(vec![good[1].clone()]), vec![5])];
        assert!(matches!(join(slices.clone()), Delta::Sparse(s) if s == good));
        let mixed = vec![slices[0].clone(), (Delta::Dense(vec![vec![1.0; 5]]), vec![5])];
        let Delta::Dense(joined) = join(mixed) else { panic!("dense") };
        assert_eq!(joined[1], vec![1.0; 5]);
        assert_eq!(joined[0][6], 2.0);
    }
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
        // a sparse contribution, scattered on the device, scores as it does made dense
        let encoding = pcp_protocol::diloco::compress::Encoding::parse_spec("sparse").map_err(anyhow::Error::msg)?;
        let layout = crate::diloco::wire::sparse_screen(encoding).expect("top-k");
        let sizes = engine.sizes();
        let bytes = pcp_protocol::diloco::compress::encode(&delta, encoding);
        let packed = pcp_protocol::diloco::compress::decode_delta(&bytes, &sizes, encoding)?;
        assert!(sparse(&packed, layout, &sizes).is_some(), "a top-k contribution goes up sparse");
        let made_dense = Delta::Dense(packed.to_dense(&sizes));
        let d = losses(&engine, &base, (&made_dense, 0.5), &held_out, Some(l.before)).await?;
        let mut sparse_engine = load_engine(&experiment, &model, &device, &cache, None, 1).await?;
        assert!(sparse_engine.sparse_screen().is_none());
        sparse_engine = crate::commands::train::load_screening_engine(
            &experiment,
            &model,
            &device,
            &cache,
            None,
            (1, Some(layout)),
        )
        .await?;
        let sparse_base = sparse_engine.resident(start.clone()).await?;
        let p = losses(&sparse_engine, &sparse_base, (&packed, 0.5), &held_out, Some(l.before)).await?;
        let close = |a: f32, b: f32| (a - b).abs() <= 1e-5 * b.abs();
        assert!(close(p.after, d.after) && close(p.reversed, d.reversed), "sparse {p:?}, dense {d:?}");
        assert!(p.after != l.before, "it moved the parameters: {p:?}");
        let short: Tensors = vec![vec![0.0; 3]];
        let e = losses(&engine, &base, (&Delta::Dense(short), 1.0), &held_out, None).await.unwrap_err();
        assert!(e.to_string().contains("a contribution of 1 tensors"), "{e}");
        Ok(())
    }
}
