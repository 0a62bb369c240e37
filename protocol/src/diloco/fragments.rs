//! Streaming DiLoCo's fragments and the parameter shards a round is published in.
//!
//! With P fragments the model's tensors are split into P contiguous groups in
//! argument order (by layer, as the built-in models and exported modules list
//! their parameters from the embedding up), balanced by size: fragment p's first
//! tensor is the first whose cumulative size reaches p/P of the total. A run with
//! P fragments syncs one fragment per round, in turn: round r syncs fragment
//! (r − 1) mod P, after τ/P inner steps, so that each fragment is synced every τ
//! inner steps at an offset of p·τ/P, each with its own outer step.
//!
//! Shards are what a round's parameters are published in: each fragment, split
//! further where a shard would pass [`SHARD_BYTES`]. A worker holding the last
//! round's parameters fetches only the shards whose hash changed.

use std::ops::Range;

/// The most fp32 bytes a parameter shard holds (one tensor larger than this is a
/// shard of its own).
pub const SHARD_BYTES: usize = 4 << 20;

/// Why a run cannot be split as asked.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FragmentError {
    /// Fewer tensors than fragments.
    #[error("{fragments} fragments asked of a model with {tensors} parameter tensors")]
    TooMany {
        /// Fragments asked.
        fragments: usize,
        /// Tensors the model has.
        tensors: usize,
    },
    /// τ is not a multiple of the fragments.
    #[error("τ={tau} is not a multiple of {fragments} fragments")]
    Uneven {
        /// τ.
        tau: u64,
        /// Fragments asked.
        fragments: usize,
    },
    /// Zero fragments.
    #[error("a run has at least 1 fragment")]
    Zero,
}

/// The tensor ranges of `p` fragments of tensors of `sizes` (see the module docs).
pub fn split(sizes: &[usize], p: usize) -> Result<Vec<Range<usize>>, FragmentError> {
    if p == 0 {
        return Err(FragmentError::Zero);
    }
    if p > sizes.len() {
        return Err(FragmentError::TooMany { fragments: p, tensors: sizes.len() });
    }
    let total: usize = sizes.iter().sum();
    let mut ranges = Vec::with_capacity(p);
    let mut start = 0;
    let mut cumulative = 0usize;
    for (i, n) in sizes.iter().enumerate() {
        cumulative += n;
        let fragment = ranges.len();
        // leave at least one tensor for each fragment still to come
        let left = sizes.len() - (i + 1);
        let due = cumulative as u128 * p as u128 >= (fragment as u128 + 1) * total as u128;
        if fragment + 1 < p && (due || left == p - fragment - 1) {
            ranges.push(start..i + 1);
            start = i + 1;
        }
    }
    ranges.push(start..sizes.len());
    Ok(ranges)
}

/// The fragment round `round` (1-based) syncs.
pub fn of_round(round: u64, fragments: usize) -> usize {
    (round.saturating_sub(1) % fragments.max(1) as u64) as usize
}

/// Inner steps per round of a run with τ and `fragments`: τ/P.
pub fn steps_per_round(tau: u64, fragments: usize) -> Result<u64, FragmentError> {
    let p = fragments as u64;
    if p == 0 {
        return Err(FragmentError::Zero);
    }
    if !tau.is_multiple_of(p) || tau < p {
        return Err(FragmentError::Uneven { tau, fragments });
    }
    Ok(tau / p)
}

/// The shards of a round's parameters: each fragment's tensors, cut where a shard
/// would pass [`SHARD_BYTES`].
pub fn shards(sizes: &[usize], fragments: &[Range<usize>]) -> Vec<Range<usize>> {
    let mut out = Vec::new();
    for f in fragments {
        let mut start = f.start;
        let mut bytes = 0usize;
        for i in f.clone() {
            let b = sizes[i] * 4;
            if i > start && bytes + b > SHARD_BYTES {
                out.push(start..i);
                start = i;
                bytes = 0;
            }
            bytes += b;
        }
        if start < f.end {
            out.push(start..f.end);
        }
    }
    out
}

/// `sizes` with every tensor outside `range` set to 0: the shapes a fragment's
/// pseudo-gradient and update have (empty tensors outside it).
pub fn masked(sizes: &[usize], range: &Range<usize>) -> Vec<usize> {
    sizes.iter().enumerate().map(|(i, n)| if range.contains(&i) { *n } else { 0 }).collect()
}

#[cfg(test)]
#[expect(clippy::single_range_in_vec_init, reason = "lists of one fragment's range")]
mod tests {
    use super::*;

    #[test]
    fn fragments_are_contiguous_balanced_and_never_empty() {
        assert_eq!(split(&[10, 10, 10, 10], 2).unwrap(), vec![0..2, 2..4]);
        assert_eq!(split(&[10, 10, 10, 10], 1).unwrap(), vec![0..4]);
        assert_eq!(split(&[10, 10, 10, 10], 4).unwrap(), vec![0..1, 1..2, 2..3, 3..4]);
        // a large first tensor takes a fragment alone; the rest still get one each
        assert_eq!(split(&[100, 1, 1, 1], 3).unwrap(), vec![0..1, 1..2, 2..4]);
        assert_eq!(split(&[1, 1, 1, 100], 2).unwrap(), vec![0..3, 3..4]);
        assert_eq!(split(&[1, 2], 3), Err(FragmentError::TooMany { fragments: 3, tensors: 2 }));
        assert_eq!(split(&[1, 2], 0), Err(FragmentError::Zero));
        for p in 1..=7 {
            let sizes: Vec<usize> = (0..13).map(|i| 1 + (i * 37) % 11).collect();
            let ranges = split(&sizes, p).unwrap();
            assert_eq!(ranges.len(), p);
            assert_eq!(ranges.first().unwrap().start, 0);
            assert_eq!(ranges.last().unwrap().end, 13);
            assert!(ranges.windows(2).all(|w| w[0].end == w[1].start && w[0].start < w[0].end));
        }
    }

    #[test]
    fn rounds_take_fragments_in_turn_and_tau_splits_evenly() {
        assert_eq!((1..=5).map(|r| of_round(r, 2)).collect::<Vec<_>>(), vec![0, 1, 0, 1, 0]);
        assert_eq!(of_round(7, 1), 0);
        assert_eq!(steps_per_round(20, 4), Ok(5));
        assert_eq!(steps_per_round(20, 3), Err(FragmentError::Uneven { tau: 20, fragments: 3 }));
        assert_eq!(steps_per_round(2, 4), Err(FragmentError::Uneven { tau: 2, fragments: 4 }));
    }

    #[test]
    fn shards_cut_fragments_at_the_size_limit() {
        let big = SHARD_BYTES / 4;
        let sizes = [big / 2, big / 2, big / 2, 10, big * 2];
        assert_eq!(shards(&sizes, &[0..5]), vec![0..2, 2..4, 4..5]);
        assert_eq!(shards(&sizes, &[0..1, 1..5]), vec![0..1, 1..3, 3..4, 4..5]);
        assert_eq!(masked(&[3, 4, 5], &(1..2)), vec![0, 4, 0]);
    }
}
