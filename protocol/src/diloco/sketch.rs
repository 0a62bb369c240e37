//! Sketches of pseudo-gradients, to tell copies: a contribution too close to
//! another of its round (a replay of one Δ from many keys) or to the last public
//! update (a free rider's scaled copy) is refused.
//!
//! A [`Sketch`] is a CountSketch of the update: each value, by its tensor and
//! flat index, is added with a sign to one of [`WIDTH`] buckets, both chosen by
//! a keyed hash. It is linear, so a copy or a scaled copy of a vector sketches to
//! the same direction exactly, and an inner product of two sketches estimates
//! the vectors' (with a relative error of about `1/√WIDTH` for unrelated
//! vectors). The key is the shepherd's own: a sender does not know the buckets.
//!
//! The rule: a contribution whose sketch has a cosine of at least the threshold
//! ([`DEFAULT_SIMILARITY`], 0.9999) with an accepted contribution of the same
//! round, or with the last round's update (θ before − θ after, published to every
//! worker), is refused ([`super::aggregate::Rejection::TooSimilar`]). Honest
//! workers train on different data, and their pseudo-gradients are far from
//! parallel; the threshold catches copies with noise of up to about 1% of their
//! norm. A copy with more noise than that is a noisy contribution for the screen.
//!
//! A sparse run's update is sparse too, and a free rider's top-k of a scaled copy
//! of it keeps only part of it, its values quantized to a few bits: its sketch's
//! cosine with the update's is the share of the update's norm it kept, below the
//! threshold. So a sparse contribution is also held against the update's support
//! ([`support_share`]): the share of the entries it kept that the update holds,
//! with the update's sign. A copy of any part of the update, at any precision,
//! scores 1; an honest top-k, which picks its entries by its own values, shares
//! some of them with the update and agrees with it in sign on some of those. A
//! share of at least [`SUPPORT_SHARE`] over at least [`MIN_SHARED`] entries is a
//! copy.

use super::Tensors;
use super::aggregate::Delta;
use super::sparse::SparseTensors;

/// Entries a sparse contribution must keep for [`support_share`] to say: a
/// handful is too few.
pub const MIN_SHARED: usize = 16;

/// The share of a sparse contribution's entries on the last update's support, with
/// its sign, from which it is a copy of the update.
pub const SUPPORT_SHARE: f64 = 0.95;

/// The cosine with the update before the last at which a sparse contribution's
/// support is walked against that update too ([`support_share`]): a copy of it
/// (a copier a round behind) keeps a top-k of its values, whose cosine with it
/// is about √(the kept share of its norm), 0.7–0.9; honest top-k work leans on
/// an older update far less (`docs/threat-model.md`), and is spared the second
/// walk.
pub const SUSPECT_COSINE: f64 = 0.5;

/// Buckets of a sketch.
pub const WIDTH: usize = 256;

/// The cosine from which two contributions are copies.
pub const DEFAULT_SIMILARITY: f64 = 0.9999;

/// A CountSketch of a pseudo-gradient ([`WIDTH`] buckets).
#[derive(Clone, Debug, PartialEq)]
pub struct Sketch {
    buckets: Vec<f64>,
}

/// The bucket and sign of value `index` of tensor `tensor` under `key`.
fn slot(key: u64, tensor: usize, index: usize) -> (usize, f64) {
    let x = (index as u64) ^ key.rotate_left(tensor as u32 % 64) ^ ((tensor as u64) << 40);
    let h = x.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ key;
    let h = (h ^ (h >> 29)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    let bucket = (h >> 56) as usize % WIDTH;
    let sign = if h & (1 << 20) == 0 { 1.0 } else { -1.0 };
    (bucket, sign)
}

impl Sketch {
    fn empty() -> Self {
        Self { buckets: vec![0.0; WIDTH] }
    }

    fn add(&mut self, key: u64, tensor: usize, index: usize, value: f32) {
        let (bucket, sign) = slot(key, tensor, index);
        self.buckets[bucket] += sign * f64::from(value);
    }

    /// The sketch of dense tensors.
    pub fn of_tensors(key: u64, tensors: &Tensors) -> Self {
        let mut s = Self::empty();
        for (t, values) in tensors.iter().enumerate() {
            for (i, v) in values.iter().enumerate() {
                if *v != 0.0 {
                    s.add(key, t, i, *v);
                }
            }
        }
        s
    }

    /// The sketch of a contribution, dense or sparse (visiting only kept entries).
    pub fn of(key: u64, delta: &Delta) -> Self {
        sketch_and_share(key, delta, None, 1).0
    }

    /// The sketch of sparse tensors (a sparse run's update: the sketch of θ before
    /// − θ after without a pass over the parameters).
    pub fn of_sparse(key: u64, sparse: &SparseTensors) -> Self {
        let mut out = Self::empty();
        for (t, tensor) in sparse.iter().enumerate() {
            for (i, v) in tensor.indices.iter().zip(&tensor.values) {
                out.add(key, t, *i as usize, *v);
            }
        }
        out
    }

    /// `a − b` (a sketch of the difference: sketches are linear).
    pub fn difference(a: &Self, b: &Self) -> Self {
        Self { buckets: a.buckets.iter().zip(&b.buckets).map(|(x, y)| x - y).collect() }
    }

    /// The cosine of the two sketches (0 if either is zero).
    pub fn cosine(&self, other: &Self) -> f64 {
        let dot: f64 = self.buckets.iter().zip(&other.buckets).map(|(a, b)| a * b).sum();
        let na: f64 = self.buckets.iter().map(|a| a * a).sum::<f64>().sqrt();
        let nb: f64 = other.buckets.iter().map(|b| b * b).sum::<f64>().sqrt();
        if na == 0.0 || nb == 0.0 { 0.0 } else { dot / (na * nb) }
    }
}

/// A contribution's [`Sketch`] and, given the last `update`, its [`support_share`],
/// in one pass over its entries, its tensors split over `threads` threads (sketches
/// add; the parts are summed in tensor order, so one thread count gives one result).
pub fn sketch_and_share(
    key: u64,
    delta: &Delta,
    update: Option<&SparseTensors>,
    threads: usize,
) -> (Sketch, Option<f64>) {
    let sizes: Vec<usize> = match delta {
        Delta::Dense(t) => t.iter().map(Vec::len).collect(),
        Delta::Sparse(s) => s.iter().map(|t| t.indices.len()).collect(),
        Delta::Packed(p) => p.sizes().collect(),
    };
    let groups = super::sparse::groups(&sizes, threads);
    let parts: Vec<Part> = if groups.len() <= 1 {
        vec![Part::of(key, delta, update, 0..sizes.len())]
    } else {
        std::thread::scope(|scope| {
            let handles: Vec<_> =
                groups.into_iter().map(|range| scope.spawn(move || Part::of(key, delta, update, range))).collect();
            // a panic in a sketching thread is a bug here: it surfaces as one
            handles.into_iter().map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e))).collect()
        })
    };
    let mut whole = Part { sketch: Sketch::empty(), kept: 0, agree: 0 };
    for part in parts {
        whole.sketch.buckets.iter_mut().zip(&part.sketch.buckets).for_each(|(a, b)| *a += b);
        (whole.kept, whole.agree) = (whole.kept + part.kept, whole.agree + part.agree);
    }
    let sparse = !matches!(delta, Delta::Dense(_));
    let share =
        (sparse && update.is_some() && whole.kept >= MIN_SHARED).then(|| whole.agree as f64 / whole.kept as f64);
    (whole.sketch, share)
}

/// A range of tensors' part of [`sketch_and_share`].
struct Part {
    sketch: Sketch,
    /// Non-zero entries kept, and those the update holds with their sign.
    kept: usize,
    agree: usize,
}

impl Part {
    fn of(key: u64, delta: &Delta, update: Option<&SparseTensors>, tensors: std::ops::Range<usize>) -> Self {
        let mut part = Self { sketch: Sketch::empty(), kept: 0, agree: 0 };
        if let Delta::Dense(t) = delta {
            for (index, values) in t.iter().enumerate().take(tensors.end).skip(tensors.start) {
                for (i, v) in values.iter().enumerate().filter(|(_, v)| **v != 0.0) {
                    part.sketch.add(key, index, i, *v);
                }
            }
            return part;
        }
        // the tensor being walked, the update's part of it and cursor in it, and the
        // last index seen
        let (mut tensor, mut of, mut at, mut last) = (usize::MAX, None, 0usize, 0u32);
        let mut visit = |t: usize, i: usize, v: f32| {
            if v == 0.0 {
                return;
            }
            part.sketch.add(key, t, i, v);
            part.kept += 1;
            let i = i as u32;
            if t != tensor {
                (tensor, of, at, last) = (t, update.and_then(|u| u.get(t)), 0, 0);
            }
            let Some(u) = of else { return };
            if i < last {
                at = u.indices.partition_point(|x| *x < i);
            }
            last = i;
            while u.indices.get(at).is_some_and(|x| *x < i) {
                at += 1;
            }
            if u.indices.get(at) == Some(&i) && u.values[at] != 0.0 && (u.values[at] > 0.0) == (v > 0.0) {
                part.agree += 1;
            }
        };
        match delta {
            Delta::Dense(_) => {}
            Delta::Sparse(s) => {
                for (t, tensor) in s.iter().enumerate().take(tensors.end).skip(tensors.start) {
                    for (i, v) in tensor.indices.iter().zip(&tensor.values) {
                        visit(t, *i as usize, *v);
                    }
                }
            }
            Delta::Packed(p) => p.for_each_kept(tensors, visit),
        }
        part
    }
}

/// The share of the entries a sparse `delta` kept that `update` holds with the
/// same sign; `None` for a dense delta, or one that kept fewer than [`MIN_SHARED`]
/// entries. `update`'s indices are strictly increasing per tensor (as
/// [`super::sparse::SparseTensor`] keeps them). The delta's entries come in
/// increasing order too, so the two are walked together: a merge, not a search
/// an entry (an entry out of order is searched for).
pub fn support_share(update: &SparseTensors, delta: &Delta) -> Option<f64> {
    sketch_and_share(0, delta, Some(update), 1).1
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::diloco::sparse::{self, Layout, Packed};

    /// A deterministic pseudo-random vector of `n` values.
    fn noise(seed: u64, n: usize) -> Vec<f32> {
        let mut x = seed.wrapping_mul(0x2545_F491_4F6C_DD1D) | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                ((x >> 40) as f32 / (1u64 << 24) as f32) - 0.5
            })
            .collect()
    }

    /// A sparse tensor of `values` at every `step`-th index from `first`.
    fn strided(first: u32, step: u32, values: &[f32]) -> sparse::SparseTensor {
        let indices = (0..values.len() as u32).map(|j| first + j * step).collect();
        sparse::SparseTensor { indices, values: values.to_vec() }
    }

    #[test]
    fn a_sparse_updates_sketch_is_the_parameters_sketches_difference() {
        let key = 0x5eed;
        let before = vec![noise(1, 3000), noise(2, 500)];
        let update = vec![strided(1, 3, &noise(3, 900)), strided(0, 5, &noise(4, 100))];
        let mut after = before.clone();
        sparse::subtract(&mut after, &update, 1.0);
        let through_params = Sketch::difference(&Sketch::of_tensors(key, &before), &Sketch::of_tensors(key, &after));
        let direct = Sketch::of_sparse(key, &update);
        assert!(direct.cosine(&through_params) > 0.999_999, "{}", direct.cosine(&through_params));
        let norm = |s: &Sketch| s.buckets.iter().map(|b| b * b).sum::<f64>().sqrt();
        assert!((norm(&direct) / norm(&through_params) - 1.0).abs() < 1e-4);
    }

    #[test]
    fn one_pass_on_any_threads_gives_the_sketch_and_share_of_each_check() {
        let sizes = [4096, 64, 2048, 1000];
        let tensors: Tensors = sizes.iter().enumerate().map(|(t, n)| noise(20 + t as u64, *n)).collect();
        let layout = Layout { chunk: 64, k: 4, bits: 2, strided: false };
        let (bytes, decoded) = sparse::encode_seeded(&tensors, layout, 3);
        let packed = Delta::Packed(Packed::check(&bytes, &sizes, layout, 3).expect("its own message"));
        let (_, update) = sparse::encode_seeded(
            &tensors.iter().map(|t| t.iter().map(|v| v * 0.5 + 0.01).collect()).collect(),
            Layout { k: 8, ..layout },
            4,
        );
        let key = 0x5eed;
        let alone = (Sketch::of(key, &Delta::Sparse(decoded.clone())), support_share(&update, &Delta::Sparse(decoded)));
        assert!(alone.1.is_some());
        for threads in [1, 2, 3, 8] {
            let (sketch, share) = sketch_and_share(key, &packed, Some(&update), threads);
            assert!(sketch.cosine(&alone.0) > 0.999_999_9, "{threads} threads");
            assert_eq!(share, alone.1, "{threads} threads");
        }
        // without an update, no share; a dense delta's sketch is its tensors'
        assert_eq!(sketch_and_share(key, &packed, None, 2).1, None);
        let (dense, share) = sketch_and_share(key, &Delta::Dense(tensors.clone()), Some(&update), 2);
        assert!(dense.cosine(&Sketch::of_tensors(key, &tensors)) > 0.999_999_9);
        assert_eq!(share, None);
    }

    #[test]
    fn a_top_k_of_a_scaled_update_lies_on_its_support_and_an_honest_top_k_does_not() {
        // the update: 2,000 entries of tensor 0, every other index
        let u = noise(5, 2000);
        let update = vec![strided(0, 2, &u)];
        // the free rider keeps the largest half of 4 × the update, at 2 bits (sign and a level)
        let mut order: Vec<usize> = (0..u.len()).collect();
        order.sort_by(|a, b| u[*b].abs().total_cmp(&u[*a].abs()));
        let mut kept: Vec<usize> = order[..1000].to_vec();
        kept.sort_unstable();
        let level = |v: f32| v.signum() * if v.abs() > 1.5 { 2.0 } else { 1.0 };
        let copy = sparse::SparseTensor {
            indices: kept.iter().map(|j| 2 * *j as u32).collect(),
            values: kept.iter().map(|j| level(4.0 * u[*j])).collect(),
        };
        let copy = Delta::Sparse(vec![copy]);
        assert_eq!(support_share(&update, &copy), Some(1.0));
        // its sketch against the update's keeps only its share of the norm: missed there
        let whole = Sketch::of(9, &Delta::Sparse(update.clone()));
        assert!(Sketch::of(9, &copy).cosine(&whole) < DEFAULT_SIMILARITY);
        // an honest top-k: its own values, on indices half of which the update holds
        let honest = Delta::Sparse(vec![strided(0, 1, &noise(6, 2000))]);
        let h = support_share(&update, &honest).expect("kept 2,000 entries");
        assert!((0.15..0.35).contains(&h), "{h}");
        // a copy with a tenth of its entries elsewhere is a noisy contribution for the screen
        let Delta::Sparse(c) = &copy else { unreachable!() };
        let mut mixed = c[0].clone();
        for j in 0..100 {
            mixed.indices[j * 10] += 1;
        }
        let mixed = support_share(&update, &Delta::Sparse(vec![mixed])).expect("kept");
        assert!((0.85..SUPPORT_SHARE).contains(&mixed), "{mixed}");
        // too few entries, a dense delta: no verdict; entries beyond the update's tensors are not on it
        let few = Delta::Sparse(vec![strided(0, 2, &u[..MIN_SHARED - 1])]);
        assert_eq!(support_share(&update, &few), None);
        assert_eq!(support_share(&update, &Delta::Dense(vec![vec![1.0; 4000]])), None);
        let elsewhere = Delta::Sparse(vec![sparse::SparseTensor::default(), strided(0, 1, &[1.0; 64])]);
        assert_eq!(support_share(&update, &elsewhere), Some(0.0));
    }

    #[test]
    fn copies_and_scaled_copies_are_parallel_and_unrelated_vectors_are_not() {
        let a = vec![noise(1, 5000), noise(2, 300)];
        let b = vec![noise(3, 5000), noise(4, 300)];
        let key = 77;
        let (sa, sb) = (Sketch::of_tensors(key, &a), Sketch::of_tensors(key, &b));
        assert!((sa.cosine(&sa) - 1.0).abs() < 1e-12);
        let scaled: Tensors = a.iter().map(|t| t.iter().map(|v| v * 4.0).collect()).collect();
        assert!(sa.cosine(&Sketch::of_tensors(key, &scaled)) >= DEFAULT_SIMILARITY);
        // a copy with 0.5% noise is still a copy; unrelated vectors are far apart
        let noisy: Tensors =
            a.iter().zip(&b).map(|(x, y)| x.iter().zip(y).map(|(x, y)| x + 0.005 * y).collect()).collect();
        assert!(sa.cosine(&Sketch::of_tensors(key, &noisy)) >= DEFAULT_SIMILARITY);
        assert!(sa.cosine(&sb).abs() < 0.3, "{}", sa.cosine(&sb));
        // related but different (half shared): well below the threshold
        let half: Tensors = a.iter().zip(&b).map(|(x, y)| x.iter().zip(y).map(|(x, y)| x + y).collect()).collect();
        let c = sa.cosine(&Sketch::of_tensors(key, &half));
        assert!((0.5..0.9).contains(&c), "{c}");
        // a difference of sketches is the sketch of the difference
        let diff: Tensors = a.iter().zip(&b).map(|(x, y)| x.iter().zip(y).map(|(x, y)| x - y).collect()).collect();
        let d = Sketch::difference(&sa, &sb);
        assert!((d.cosine(&Sketch::of_tensors(key, &diff)) - 1.0).abs() < 1e-9);
    }

    /// Why the key is the shepherd's secret, and why no aggregator can sketch a
    /// slice for it: whoever knows the key can push a copy's sketch off its
    /// original's with a perturbation a few hundredths of a percent of its norm,
    /// every value of it signed into one bucket, where random noise needs about 1%
    /// (`√(2 (1 − 0.9999))` of the norm, spread over every bucket). The gain grows
    /// as `√(n / WIDTH)`: about 700× at gpt2-124m's size.
    #[test]
    fn a_known_key_lets_a_copy_escape_with_a_perturbation_too_small_to_matter() {
        let key = 0xc0ffee;
        let n = 1 << 20;
        let a = vec![noise(21, n)];
        let norm = |t: &[f32]| t.iter().map(|v| f64::from(*v) * f64::from(*v)).sum::<f64>().sqrt();
        let original = Sketch::of_tensors(key, &a);
        // knowing the key: a tiny value in every entry of bucket 0, with its sign
        let mut aimed = vec![0.0f32; n];
        for (i, d) in aimed.iter_mut().enumerate() {
            let (bucket, sign) = slot(key, 0, i);
            if bucket == 0 {
                *d = 0.0015 * sign as f32;
            }
        }
        let share = norm(&aimed) / norm(&a[0]);
        let moved = |d: &[f32]| vec![a[0].iter().zip(d).map(|(x, d)| x + d).collect::<Vec<f32>>()];
        let escaped = original.cosine(&Sketch::of_tensors(key, &moved(&aimed)));
        assert!(share < 5e-4, "the aimed perturbation is {:.4}% of the norm", share * 100.0);
        assert!(escaped < DEFAULT_SIMILARITY, "aimed: cosine {escaped}");
        // blind: random noise of the same norm leaves a copy
        let blind = noise(22, n);
        let scale = (norm(&aimed) / norm(&blind)) as f32;
        let blind: Vec<f32> = blind.iter().map(|v| v * scale).collect();
        let caught = original.cosine(&Sketch::of_tensors(key, &moved(&blind)));
        assert!(caught >= DEFAULT_SIMILARITY, "blind: cosine {caught}");
    }

    #[test]
    fn a_sparse_message_sketches_as_its_dense_form() {
        let sizes = [640usize, 64];
        let tensors: Tensors = sizes.iter().enumerate().map(|(i, n)| noise(i as u64 + 9, *n)).collect();
        let layout = Layout { chunk: 64, k: 4, bits: 2, strided: false };
        let (bytes, kept) = sparse::encode_seeded(&tensors, layout, 3);
        let packed = Delta::Packed(Packed::check(&bytes, &sizes, layout, 3).expect("checks"));
        let dense = Delta::Dense(packed.to_dense(&sizes));
        let (sp, sd, ss) = (Sketch::of(5, &packed), Sketch::of(5, &dense), Sketch::of(5, &Delta::Sparse(kept)));
        assert!((sp.cosine(&sd) - 1.0).abs() < 1e-9);
        assert!((ss.cosine(&sd) - 1.0).abs() < 1e-9);
    }
}
