//! Seeded random windows of a token split, resumable from a checkpoint.

use rand_chacha::ChaCha8Rng;
use rand_chacha::rand_core::{RngCore, SeedableRng};
use serde::{Deserialize, Serialize};

use super::tokens::Split;

/// Why a sampler could not be built or resumed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum SampleError {
    /// Batch or block size is zero.
    #[error("batch size {batch} and block size {block} must both be positive")]
    EmptyShape {
        /// The batch size.
        batch: usize,
        /// The block size.
        block: usize,
    },
    /// The split cannot hold one window and its next-token target.
    #[error("{data}: {len} tokens is too short for one window of block size {block} (needs {})", block + 1)]
    TooShort {
        /// The split, e.g. `train.bin (val split)`.
        data: String,
        /// Its length in tokens.
        len: usize,
        /// The block size.
        block: usize,
    },
    /// A saved state has a malformed generator position.
    #[error("the saved sampler position {word_pos:?} is not a non-negative integer")]
    BadState {
        /// The saved position.
        word_pos: String,
    },
    /// A saved state was taken with another batch shape.
    #[error("the saved sampler drew [{saved_batch}, {saved_block}] batches, not [{batch}, {block}]")]
    ShapeChanged {
        /// The saved batch size.
        saved_batch: usize,
        /// The saved block size.
        saved_block: usize,
        /// The batch size asked for.
        batch: usize,
        /// The block size asked for.
        block: usize,
    },
}

/// One batch of windows: `inputs[b, t]` and `targets[b, t] = inputs[b, t + 1]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Batch {
    batch: usize,
    block: usize,
    inputs: Vec<u16>,
    targets: Vec<u16>,
}

impl Batch {
    /// `[batch, block]`.
    pub(crate) fn shape(&self) -> [usize; 2] {
        [self.batch, self.block]
    }

    /// The input tokens, row-major, as `i64`.
    pub(crate) fn inputs_i64(&self) -> Vec<i64> {
        self.inputs.iter().map(|&token| i64::from(token)).collect()
    }

    /// The target tokens, row-major, as `i64`.
    pub(crate) fn targets_i64(&self) -> Vec<i64> {
        self.targets.iter().map(|&token| i64::from(token)).collect()
    }

    /// The input tokens, row-major, as `i32`.
    pub(crate) fn inputs_i32(&self) -> Vec<i32> {
        self.inputs.iter().map(|&token| i32::from(token)).collect()
    }

    /// The target tokens, row-major, as `i32`.
    pub(crate) fn targets_i32(&self) -> Vec<i32> {
        self.targets.iter().map(|&token| i32::from(token)).collect()
    }

    /// A batch of `rows` windows from `tokens`, row-major, `rows` × (block + 1) of
    /// them: each row's first `block` are its inputs, its last `block` its targets.
    /// `None` unless they make whole rows of at least two tokens.
    pub(crate) fn from_windows(rows: usize, tokens: &[u16]) -> Option<Self> {
        if rows == 0 || !tokens.len().is_multiple_of(rows) || tokens.len() / rows < 2 {
            return None;
        }
        let width = tokens.len() / rows;
        let (mut inputs, mut targets) = (Vec::new(), Vec::new());
        for row in tokens.chunks_exact(width) {
            inputs.extend_from_slice(&row[..width - 1]);
            targets.extend_from_slice(&row[1..]);
        }
        Some(Self { batch: rows, block: width - 1, inputs, targets })
    }

    /// The batch's windows, as [`Self::from_windows`] takes them.
    pub(crate) fn windows(&self) -> Vec<u16> {
        let mut out = Vec::with_capacity(self.batch * (self.block + 1));
        for (inputs, targets) in self.inputs.chunks_exact(self.block).zip(self.targets.chunks_exact(self.block)) {
            out.extend_from_slice(inputs);
            out.extend_from_slice(&targets[self.block - 1..]);
        }
        out
    }

    /// The largest token it holds (0 for none).
    pub(crate) fn max_token(&self) -> u16 {
        self.inputs.iter().chain(&self.targets).copied().max().unwrap_or(0)
    }

    /// The batch as `k` micro-batches of `batch / k` consecutive rows each (`k`
    /// divides the batch; [`crate::training::memory`] chooses it so).
    pub(crate) fn split(&self, k: usize) -> Vec<Batch> {
        let rows = self.batch / k.max(1);
        let len = rows * self.block;
        (0..k.max(1))
            .map(|i| Batch {
                batch: rows,
                block: self.block,
                inputs: self.inputs[i * len..(i + 1) * len].to_vec(),
                targets: self.targets[i * len..(i + 1) * len].to_vec(),
            })
            .collect()
    }
}

/// Everything needed to resume a [`Sampler`] exactly, for checkpoints.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct SamplerState {
    /// The seed the sampler started from.
    pub(crate) seed: u64,
    /// The ChaCha8 word position, as a decimal string (JSON has no u128).
    pub(crate) word_pos: String,
    /// Batches drawn so far.
    pub(crate) batches: u64,
    /// The batch size.
    pub(crate) batch: usize,
    /// The block size.
    pub(crate) block: usize,
}

/// Draws seeded random windows from one split.
#[derive(Debug, Clone)]
pub(crate) struct Sampler {
    data: Split,
    batch: usize,
    block: usize,
    seed: u64,
    rng: ChaCha8Rng,
    batches: u64,
}

impl Sampler {
    /// A sampler of `[batch, block]` windows of `data`, seeded with `seed`.
    pub(crate) fn new(data: Split, batch: usize, block: usize, seed: u64) -> Result<Self, SampleError> {
        if batch == 0 || block == 0 {
            return Err(SampleError::EmptyShape { batch, block });
        }
        if data.len() <= block {
            return Err(SampleError::TooShort { data: data.describe(), len: data.len(), block });
        }
        Ok(Self { data, batch, block, seed, rng: ChaCha8Rng::seed_from_u64(seed), batches: 0 })
    }

    /// Resumes a sampler from a saved state: it draws exactly the batches the
    /// original would have drawn next.
    pub(crate) fn resume(data: Split, state: &SamplerState) -> Result<Self, SampleError> {
        let mut sampler = Self::new(data, state.batch, state.block, state.seed)?;
        let word_pos =
            state.word_pos.parse::<u128>().map_err(|_| SampleError::BadState { word_pos: state.word_pos.clone() })?;
        sampler.rng.set_word_pos(word_pos);
        sampler.batches = state.batches;
        Ok(sampler)
    }

    /// Resumes from `state`, checking that the batch shape is unchanged.
    pub(crate) fn resume_with_shape(
        data: Split,
        batch: usize,
        block: usize,
        state: &SamplerState,
    ) -> Result<Self, SampleError> {
        if (state.batch, state.block) != (batch, block) {
            return Err(SampleError::ShapeChanged { saved_batch: state.batch, saved_block: state.block, batch, block });
        }
        Self::resume(data, state)
    }

    /// The state to save in a checkpoint.
    pub(crate) fn state(&self) -> SamplerState {
        SamplerState {
            seed: self.seed,
            word_pos: self.rng.get_word_pos().to_string(),
            batches: self.batches,
            batch: self.batch,
            block: self.block,
        }
    }

    /// Batches drawn so far.
    #[cfg(test)]
    pub(crate) fn batches(&self) -> u64 {
        self.batches
    }

    /// Draws the next batch.
    pub(crate) fn next_batch(&mut self) -> Batch {
        let starts = self.data.len() - self.block;
        let mut inputs = Vec::with_capacity(self.batch * self.block);
        let mut targets = Vec::with_capacity(self.batch * self.block);
        for _ in 0..self.batch {
            let start = below(&mut self.rng, starts);
            // `start + block < len`, checked in `new`, so every index exists.
            let window = (start..=start + self.block).map(|index| self.data.get(index).unwrap_or(0));
            let window: Vec<u16> = window.collect();
            inputs.extend_from_slice(&window[..self.block]);
            targets.extend_from_slice(&window[1..]);
        }
        self.batches += 1;
        Batch { batch: self.batch, block: self.block, inputs, targets }
    }
}

/// A uniform integer in `0..bound` (`bound > 0`), without modulo bias.
fn below(rng: &mut ChaCha8Rng, bound: usize) -> usize {
    let bound = bound as u64;
    // Reject the incomplete top range so every residue is equally likely.
    let zone = u64::MAX - u64::MAX % bound;
    loop {
        let draw = rng.next_u64();
        if draw < zone {
            // The result is below `bound`, which came from a usize.
            return usize::try_from(draw % bound).unwrap_or_default();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::training::data::Tokens;

    fn corpus(len: u16) -> Tokens {
        Tokens::from_vec((0..len).collect(), "corpus")
    }

    #[test]
    fn targets_are_inputs_shifted_by_one() {
        let mut sampler = Sampler::new(corpus(1000).all(), 4, 8, 7).unwrap();
        for _ in 0..20 {
            let batch = sampler.next_batch();
            assert_eq!(batch.shape(), [4, 8]);
            let inputs = batch.inputs_i64();
            let targets = batch.targets_i64();
            assert_eq!(inputs.len(), 32);
            for row in 0..4 {
                let row_inputs = &inputs[row * 8..row * 8 + 8];
                let row_targets = &targets[row * 8..row * 8 + 8];
                // The corpus is 0, 1, 2, ...: windows are runs of consecutive tokens.
                for t in 0..8 {
                    assert_eq!(row_inputs[t], row_inputs[0] + t as i64);
                    assert_eq!(row_targets[t], row_inputs[t] + 1);
                }
                assert!(row_targets[7] < 1000);
            }
            assert_eq!(batch.inputs_i32(), inputs.iter().map(|&x| x as i32).collect::<Vec<_>>());
            assert_eq!(batch.targets_i32().len(), 32);
        }
    }

    #[test]
    fn a_batch_travels_as_its_windows() {
        let batch = Sampler::new(corpus(1000).all(), 3, 8, 5).unwrap().next_batch();
        let windows = batch.windows();
        assert_eq!(windows.len(), 3 * 9);
        assert_eq!(Batch::from_windows(3, &windows), Some(batch.clone()));
        assert_eq!(batch.max_token(), windows.iter().copied().max().unwrap());
        assert_eq!(Batch::from_windows(0, &windows), None, "no rows");
        assert_eq!(Batch::from_windows(2, &windows), None, "not whole rows");
        assert_eq!(Batch::from_windows(3, &windows[..3]), None, "rows of one token");
    }

    #[test]
    fn same_seed_same_batches_other_seed_other_batches() {
        let draw = |seed| {
            let mut sampler = Sampler::new(corpus(5000).all(), 2, 16, seed).unwrap();
            (0..5).map(|_| sampler.next_batch()).collect::<Vec<_>>()
        };
        assert_eq!(draw(1), draw(1));
        assert_ne!(draw(1), draw(2));
    }

    #[test]
    fn resume_reproduces_the_remaining_batches() {
        let data = corpus(3000).all();
        let mut original = Sampler::new(data.clone(), 3, 5, 42).unwrap();
        for _ in 0..7 {
            original.next_batch();
        }
        let json = serde_json::to_string(&original.state()).unwrap();
        let state: SamplerState = serde_json::from_str(&json).unwrap();
        assert_eq!(state.batches, 7);
        let mut resumed = Sampler::resume_with_shape(data, 3, 5, &state).unwrap();
        for _ in 0..10 {
            assert_eq!(original.next_batch(), resumed.next_batch());
        }
        assert_eq!(resumed.batches(), 17);
    }

    #[test]
    fn resume_rejects_a_corrupt_state() {
        let data = corpus(100).all();
        let mut state = Sampler::new(data.clone(), 2, 4, 0).unwrap().state();
        state.word_pos = "-3".to_owned();
        let err = Sampler::resume(data, &state).unwrap_err();
        assert_eq!(err.to_string(), "the saved sampler position \"-3\" is not a non-negative integer");
    }

    #[test]
    fn resume_rejects_another_shape() {
        let data = corpus(100).all();
        let state = Sampler::new(data.clone(), 2, 4, 0).unwrap().state();
        let err = Sampler::resume_with_shape(data, 2, 8, &state).unwrap_err();
        assert_eq!(err.to_string(), "the saved sampler drew [2, 4] batches, not [2, 8]");
    }

    #[test]
    fn windows_cover_the_whole_split() {
        // A split of block + 1 tokens has exactly one window.
        let mut sampler = Sampler::new(corpus(9).all(), 1, 8, 3).unwrap();
        let batch = sampler.next_batch();
        assert_eq!(batch.inputs_i64(), (0..8).collect::<Vec<_>>());
        assert_eq!(batch.targets_i64(), (1..9).collect::<Vec<_>>());
        // Every start of a longer split is reachable, and only those.
        let mut sampler = Sampler::new(corpus(12).all(), 1, 8, 3).unwrap();
        let mut seen = std::collections::BTreeSet::new();
        for _ in 0..200 {
            seen.insert(sampler.next_batch().inputs_i64()[0]);
        }
        assert_eq!(seen.into_iter().collect::<Vec<_>>(), vec![0, 1, 2, 3]);
    }

    #[test]
    fn val_split_windows_stay_in_the_split() {
        let (_, val) = corpus(1000).split(0.1).unwrap();
        let mut sampler = Sampler::new(val, 8, 16, 5).unwrap();
        for _ in 0..50 {
            let batch = sampler.next_batch();
            assert!(batch.inputs_i64().iter().all(|&token| (900..1000).contains(&token)));
            assert!(batch.targets_i64().iter().all(|&token| (900..1000).contains(&token)));
        }
    }

    #[test]
    fn too_short_split_names_the_data() {
        let (_, val) = corpus(100).split(0.1).unwrap();
        let err = Sampler::new(val, 4, 10, 0).unwrap_err();
        assert_eq!(
            err.to_string(),
            "corpus (val split): 10 tokens is too short for one window of block size 10 (needs 11)"
        );
        assert!(matches!(Sampler::new(corpus(100).all(), 0, 4, 0), Err(SampleError::EmptyShape { .. })));
    }

    #[test]
    fn too_short_file_names_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tiny.bin");
        std::fs::write(&path, [1, 0, 2, 0, 3, 0]).unwrap();
        let tokens = Tokens::open_bin(&path, crate::training::data::TokenFormat::NanoGpt).unwrap();
        let err = Sampler::new(tokens.all(), 1, 3, 0).unwrap_err().to_string();
        assert_eq!(err, format!("{}: 3 tokens is too short for one window of block size 3 (needs 4)", path.display()));
    }

    #[test]
    fn samples_from_a_mapped_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("train.bin");
        let bytes: Vec<u8> = (0u16..500).flat_map(u16::to_le_bytes).collect();
        std::fs::write(&path, bytes).unwrap();
        let tokens = Tokens::open_bin(&path, crate::training::data::TokenFormat::NanoGpt).unwrap();
        let mut sampler = Sampler::new(tokens.all(), 2, 4, 9).unwrap();
        let batch = sampler.next_batch();
        let inputs = batch.inputs_i64();
        assert_eq!(inputs[1], inputs[0] + 1);
        assert_eq!(batch.targets_i64()[3], inputs[3] + 1);
    }
}
