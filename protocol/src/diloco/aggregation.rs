//! Parameter-shard aggregators: the round's sum split by the parameter shards
//! a round is published in ([`super::fragments::shards`]), each shard summed by
//! `R` volunteers, so the shepherd no longer reads every contribution. Sans-IO
//! and deterministic: anyone holding a round's seed and its accepted list can
//! audit an aggregator.
//!
//! * **Who sums what** ([`assign`]). The volunteers (rated keys that offered
//!   `--aggregate`) are ordered by `blake3(seed ‖ round ‖ key)`, and shard `s`'s
//!   replica `j` is volunteer `(s·R + j) mod M` of that order: every volunteer
//!   gets ⌈N·R/M⌉ shards at most, a shard's replicas are distinct, and nobody
//!   picks its shards. Fewer than `R` volunteers: no assignment (the shepherd sums
//!   alone).
//! * **Slices are committed.** A worker sends each shard's slice of its
//!   contribution (the contribution's tensors in the shard, encoded alone) to
//!   the shard's aggregators, and the shepherd, in its signed contribution, the
//!   slices' hashes ([`slice_hash`]). An aggregator checks a slice against the
//!   hash the shepherd forwards before it uses it.
//! * **What the shepherd learns of a slice** ([`inspect`]): the aggregator decodes
//!   and validates it, bounds it by the round's per-tensor bounds (the
//!   shepherd's, sliced: [`shard_bounds`]), and reports each tensor's raw
//!   statistics (the next round's references) and its bounded norm. The
//!   contribution's bounded norm is the root of the shards' squares
//!   ([`contribution_norm`]), from which the shepherd decides acceptance and the
//!   norm bound, as it does alone.
//! * **Exactly the accepted set, in one order** ([`ShardSum`]). The shepherd
//!   numbers what it accepts (`seq`, from 0) and sends each aggregator the same
//!   [`Accept`]s: the weight, the bounded norm and the bound of
//!   [`RunningMean::push`]. An aggregator adds them in `seq` order whatever order
//!   they arrive in, so replicas agree bit for bit, and publishes the shard's mean
//!   and its hash ([`ShardUpdate`], [`update_hash`]).
//! * **Audits.** A share of shards, drawn from the seed at the manifest's rate
//!   ([`spot_checked`]), gets one more summer after the fact: an auditor, the
//!   volunteer outside the shard's replicas that ranks lowest for it
//!   ([`auditor`]), who sums the same committed slices and votes with the
//!   replicas. Replicas that agree on a wrong sum are caught unless the auditor
//!   lies with them; the shepherd's own work stays the disputes.
//! * **The replicas vote** ([`Votes`]). All of a shard's voters (replicas and any
//!   auditor) signing one hash is agreement. Disagreement, or a voter silent past
//!   the deadline, makes the shepherd recompute the shard from the committed
//!   slices (so does a spot check with no auditor to draw); every voter whose
//!   hash differs from its own, or that never answered, is a liar
//!   ([`Votes::liars`]) and loses the role.
//! * **The shepherd's record of a round** ([`Collect`]): commitments, the
//!   replicas' reports (a contribution is ready once they all agree, disputed
//!   when they do not), the accepted list and the votes.

use std::collections::BTreeMap;
use std::ops::Range;

pub mod collect;
pub use collect::{Collect, CollectError, Reported};

use super::Tensors;
use super::aggregate::{Bounds, Delta, Rejection, RunningMean};

/// One shard's replicas, in replica order, for every shard of a round.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Assignment<P> {
    round: u64,
    shards: Vec<Vec<P>>,
}

impl<P: Clone + PartialEq> Assignment<P> {
    /// The round assigned.
    pub fn round(&self) -> u64 {
        self.round
    }

    /// Shards assigned.
    pub fn shards(&self) -> usize {
        self.shards.len()
    }

    /// Shard `shard`'s replicas (empty past the last shard).
    pub fn replicas(&self, shard: usize) -> &[P] {
        self.shards.get(shard).map_or(&[], Vec::as_slice)
    }

    /// The shards `key` sums, ascending.
    pub fn shards_of(&self, key: &P) -> Vec<usize> {
        self.shards.iter().enumerate().filter(|(_, r)| r.contains(key)).map(|(s, _)| s).collect()
    }
}

/// The rank of `key` in `round`'s order under `seed` (lower first).
fn rank(seed: &[u8; 32], round: u64, key: &[u8]) -> [u8; 32] {
    let mut h = blake3::Hasher::new();
    h.update(b"pcp/aggregators/v1");
    h.update(seed);
    h.update(&round.to_le_bytes());
    h.update(&(key.len() as u64).to_le_bytes());
    h.update(key);
    *h.finalize().as_bytes()
}

/// Who sums each of `shards` shards in `round` (see the module docs): `replicas`
/// distinct volunteers a shard, the load spread evenly, the same whatever the
/// order of `volunteers` (duplicates count once). `None` with no shards, no
/// replicas, or fewer distinct volunteers than replicas.
pub fn assign<P: AsRef<[u8]> + Clone + PartialEq>(
    seed: &[u8; 32],
    round: u64,
    shards: usize,
    replicas: usize,
    volunteers: &[P],
) -> Option<Assignment<P>> {
    let mut ranked: Vec<([u8; 32], &P)> = volunteers.iter().map(|p| (rank(seed, round, p.as_ref()), p)).collect();
    ranked.sort_by(|a, b| a.0.cmp(&b.0).then_with(|| a.1.as_ref().cmp(b.1.as_ref())));
    ranked.dedup_by(|a, b| a.1 == b.1);
    let m = ranked.len();
    if shards == 0 || replicas == 0 || m < replicas {
        return None;
    }
    let shards = (0..shards).map(|s| (0..replicas).map(|j| ranked[(s * replicas + j) % m].1.clone()).collect());
    Some(Assignment { round, shards: shards.collect() })
}

/// The hash a worker commits for a shard's slice of its contribution: the blake3
/// content id of its encoded bytes, so that anyone holding the slice serves it
/// as a blob ([`crate::diloco`] nodes fetch a slice they lack by it). Its round
/// and shard are bound by the signed contribution that lists it.
pub fn slice_hash(bytes: &[u8]) -> [u8; 32] {
    *blake3::hash(bytes).as_bytes()
}

/// An aggregated contribution's id: blake3 of its slices' hashes in shard order
/// (its commitment), as a whole contribution's is blake3 of its bytes; what
/// screening committees name it by.
pub fn sliced_id(hashes: &[[u8; 32]]) -> [u8; 32] {
    let mut h = blake3::Hasher::new();
    h.update(b"pcp sliced contribution");
    for hash in hashes {
        h.update(hash);
    }
    *h.finalize().as_bytes()
}

/// The tensors of each of `shards` aggregation shards of a model whose tensors
/// have `sizes` elements: contiguous and balanced by elements
/// ([`super::fragments::split`]); `None` for 0 shards or more than the tensors.
pub fn shard_tensors(sizes: &[usize], shards: usize) -> Option<Vec<Range<usize>>> {
    super::fragments::split(sizes, shards).ok()
}

/// The round's per-tensor bounds restricted to the tensors of one shard.
pub fn shard_bounds(bounds: &Bounds, tensors: &Range<usize>) -> Bounds {
    let cut = |len: usize| tensors.start.min(len)..tensors.end.min(len);
    Bounds {
        tensor: bounds.tensor[cut(bounds.tensor.len())].to_vec(),
        element: bounds.element[cut(bounds.element.len())].to_vec(),
    }
}

/// What an aggregator reports of one slice: each tensor's raw L2 norm and largest
/// magnitude, and the slice's L2 norm once bounded.
#[derive(Clone, Debug, PartialEq)]
pub struct SliceReport {
    /// Each tensor's raw (norm, largest magnitude), as [`Delta::tensor_stats`].
    pub raw: Vec<(f64, f32)>,
    /// The bounded slice's L2 norm.
    pub bounded_norm: f64,
}

/// Validates a decoded slice against the shard's tensor `sizes`, and bounds it by
/// the shard's `bounds`: the bounded slice (what [`ShardSum::accept`] adds) and the
/// report.
pub fn inspect(slice: Delta, sizes: &[usize], bounds: &Bounds) -> Result<(Delta, SliceReport), Rejection> {
    slice.validate(sizes)?;
    let raw = slice.tensor_stats();
    let (bounded, bounded_norm, _) = slice.bounded(bounds);
    Ok((bounded, SliceReport { raw, bounded_norm }))
}

/// A contribution's bounded norm from its shards' reports (every shard's, once).
pub fn contribution_norm<'a>(reports: impl IntoIterator<Item = &'a SliceReport>) -> f64 {
    reports.into_iter().map(|r| r.bounded_norm * r.bounded_norm).sum::<f64>().sqrt()
}

/// One contribution the shepherd accepted, as every aggregator adds it: the
/// arguments of [`RunningMean::push`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Accept {
    /// Its place in the round's order, from 0.
    pub seq: u64,
    /// Its weight (samples, times any trust factor).
    pub weight: f64,
    /// Its bounded norm ([`contribution_norm`]).
    pub norm: f64,
    /// The norm bound in force when it was added.
    pub bound: f64,
}

/// Why an aggregator cannot take an accept or finish a shard.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SumError {
    /// This place in the order was taken already.
    #[error("contribution {seq} of the round's order was added already")]
    Duplicate {
        /// The place.
        seq: u64,
    },
    /// The round closed with places still missing.
    #[error("the round closed at {count} contributions and {missing} of them never reached this aggregator")]
    Missing {
        /// Contributions the round accepted.
        count: u64,
        /// The first place missing.
        missing: u64,
    },
    /// Places past the close were given.
    #[error("contribution {seq} is past the round's {count}")]
    PastClose {
        /// The place.
        seq: u64,
        /// Contributions the round accepted.
        count: u64,
    },
}

/// One shard's mean of a round, published as a blob.
#[derive(Clone, Debug, PartialEq)]
pub struct ShardUpdate {
    /// The weighted mean of the accepted slices (zeros when none).
    pub mean: Tensors,
    /// The weights added: the mean's divisor.
    pub total: f64,
    /// [`update_hash`] of it.
    pub hash: [u8; 32],
}

/// The hash an aggregator signs for shard `shard`'s update of `round`: its mean's
/// little-endian f32 bytes and divisor, domain-separated.
pub fn update_hash(round: u64, shard: usize, mean: &Tensors, total: f64) -> [u8; 32] {
    let mut h = blake3::Hasher::new();
    h.update(b"pcp/aggregators/update/v1");
    h.update(&round.to_le_bytes());
    h.update(&(shard as u64).to_le_bytes());
    h.update(&total.to_le_bytes());
    h.update(&(mean.len() as u64).to_le_bytes());
    for t in mean {
        h.update(&(t.len() as u64).to_le_bytes());
        for v in t {
            h.update(&v.to_le_bytes());
        }
    }
    *h.finalize().as_bytes()
}

/// Why a shard update blob was not taken.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum UpdateError {
    /// Not a shard update.
    #[error("not a shard update blob")]
    Magic,
    /// The divisor is not a finite, non-negative number.
    #[error("a shard update's total weight is not a finite, non-negative number")]
    Total,
    /// The mean did not decode to the shard's tensors.
    #[error("a shard update's mean: {0}")]
    Mean(#[from] super::compress::DecodeError),
}

const UPDATE_MAGIC: &[u8; 5] = b"PCPU\x01";

impl ShardUpdate {
    /// The update as a blob: `PCPU`, version 1, its total weight (f64, little-endian),
    /// then its mean as an fp32 message ([`super::compress`]).
    pub fn to_blob(&self) -> Vec<u8> {
        let sizes: Vec<usize> = self.mean.iter().map(Vec::len).collect();
        let mut out = Vec::with_capacity(13 + super::compress::encoded_len(&sizes, super::compress::Encoding::F32));
        out.extend_from_slice(UPDATE_MAGIC);
        out.extend_from_slice(&self.total.to_le_bytes());
        super::compress::encode_dense_into(&self.mean, super::compress::Encoding::F32, &mut out);
        out
    }

    /// The length of [`ShardUpdate::to_blob`] for a mean of tensors of `sizes`.
    pub fn blob_len(sizes: &[usize]) -> usize {
        UPDATE_MAGIC.len() + 8 + super::compress::encoded_len(sizes, super::compress::Encoding::F32)
    }

    /// Reads shard `shard`'s update of `round` (tensors of `sizes`) from its blob,
    /// and hashes it ([`update_hash`]).
    pub fn from_blob(round: u64, shard: usize, bytes: &[u8], sizes: &[usize]) -> Result<Self, UpdateError> {
        let body = bytes.strip_prefix(UPDATE_MAGIC).ok_or(UpdateError::Magic)?;
        let (total, mean) = body.split_first_chunk::<8>().ok_or(UpdateError::Magic)?;
        let total = f64::from_le_bytes(*total);
        if !(total.is_finite() && total >= 0.0) {
            return Err(UpdateError::Total);
        }
        let (mean, encoding) = super::compress::decode(mean, sizes)?;
        if encoding != super::compress::Encoding::F32 {
            return Err(UpdateError::Magic);
        }
        let hash = update_hash(round, shard, &mean, total);
        Ok(Self { mean, total, hash })
    }
}

/// An aggregator's sum of one shard in one round: accepted slices added in the
/// shepherd's order whatever order they arrive in.
#[derive(Debug)]
pub struct ShardSum {
    round: u64,
    shard: usize,
    sizes: Vec<usize>,
    mean: RunningMean,
    /// The next place to add.
    next: u64,
    /// Places that arrived early, with their bounded slices.
    early: BTreeMap<u64, (Accept, Delta)>,
}

impl ShardSum {
    /// An empty sum of `shard` (tensors of `sizes`) in `round`, adding packed slices
    /// on `threads` threads.
    pub fn new(round: u64, shard: usize, sizes: Vec<usize>, threads: usize) -> Self {
        Self { round, shard, sizes, mean: RunningMean::with_threads(threads), next: 0, early: BTreeMap::new() }
    }

    /// Adds a bounded slice ([`inspect`]) at its place, or holds it until the
    /// places before it are added.
    pub fn accept(&mut self, accept: Accept, slice: Delta) -> Result<(), SumError> {
        if accept.seq < self.next || self.early.contains_key(&accept.seq) {
            return Err(SumError::Duplicate { seq: accept.seq });
        }
        self.early.insert(accept.seq, (accept, slice));
        while let Some((a, d)) = self.early.remove(&self.next) {
            self.mean.push(d, a.weight, a.norm, a.bound, &self.sizes);
            self.next += 1;
        }
        Ok(())
    }

    /// Places added so far (every place before it).
    pub fn added(&self) -> u64 {
        self.next
    }

    /// The shard's update once the round closed at `count` accepted contributions:
    /// an error if one of them is missing or a place past them was given.
    pub fn finish(self, count: u64) -> Result<ShardUpdate, SumError> {
        if let Some(seq) = self.early.keys().copied().find(|s| *s >= count) {
            return Err(SumError::PastClose { seq, count });
        }
        if self.next < count {
            return Err(SumError::Missing { count, missing: self.next });
        }
        if self.next > count {
            return Err(SumError::PastClose { seq: count, count });
        }
        let total = self.mean.total();
        let mean = self.mean.finish().unwrap_or_else(|| self.sizes.iter().map(|n| vec![0.0; *n]).collect());
        let hash = update_hash(self.round, self.shard, &mean, total);
        Ok(ShardUpdate { mean, total, hash })
    }
}

/// The share of aggregated shards a shepherd recomputes whatever their replicas
/// say, when a run names none (pcp-node's and the simulator's
/// `--aggregator-spot-rate`).
pub const DEFAULT_SPOT_RATE: f64 = 0.05;

/// The most contributions a round's spot checks read at the full rate: in a round
/// of more, the share of shards checked shrinks so that the checks read as many
/// slices as at this size ([`spot_share`]). A spot check sums its shard on the
/// shepherd, reading every slice of it through the shepherd's downlink, as the
/// round gathers: in the simulator at 1,000 gpt2-124m H100 volunteers, 5% of the
/// shards cost 0.5 points of utilization (93.3% → 92.8%); at 10,000 the same share
/// summed at the close cost 36 points (91.3% → 54.9%), and the shrunk share 0.6.
pub const SPOT_CONTRIBUTIONS: u64 = 1_000;

/// The share of shards spot-checked in a round of `contributions` at the rate
/// `rate`: `rate` up to [`SPOT_CONTRIBUTIONS`], then `rate` × that / `contributions`.
pub fn spot_share(rate: f64, contributions: u64) -> f64 {
    if contributions <= SPOT_CONTRIBUTIONS { rate } else { rate * SPOT_CONTRIBUTIONS as f64 / contributions as f64 }
}

/// Whether the shepherd recomputes shard `shard` of `round` whatever its replicas
/// say, with probability `rate` (0: never, 1: always), drawn from `seed`.
pub fn spot_checked(seed: &[u8; 32], round: u64, shard: usize, rate: f64) -> bool {
    if rate <= 0.0 {
        return false;
    }
    let mut h = blake3::Hasher::new();
    h.update(b"pcp/aggregators/spot-check/v1");
    h.update(seed);
    h.update(&round.to_le_bytes());
    h.update(&(shard as u64).to_le_bytes());
    let mut first = [0u8; 8];
    first.copy_from_slice(&h.finalize().as_bytes()[..8]);
    // the top 53 bits as a uniform draw in [0, 1)
    let draw = (u64::from_le_bytes(first) >> 11) as f64 / (1u64 << 53) as f64;
    draw < rate
}

/// The auditor of shard `shard` in `round`: the volunteer outside `replicas`
/// that ranks lowest for the shard under `seed`; `None` when every volunteer is a
/// replica.
pub fn auditor<P: AsRef<[u8]> + Clone + PartialEq>(
    seed: &[u8; 32],
    round: u64,
    shard: usize,
    volunteers: &[P],
    replicas: &[P],
) -> Option<P> {
    let rank = |key: &[u8]| {
        let mut h = blake3::Hasher::new();
        h.update(b"pcp/aggregators/audit/v1");
        h.update(seed);
        h.update(&round.to_le_bytes());
        h.update(&(shard as u64).to_le_bytes());
        h.update(&(key.len() as u64).to_le_bytes());
        h.update(key);
        *h.finalize().as_bytes()
    };
    volunteers
        .iter()
        .filter(|p| !replicas.contains(p))
        .map(|p| (rank(p.as_ref()), p))
        .min_by(|a, b| a.0.cmp(&b.0).then_with(|| a.1.as_ref().cmp(b.1.as_ref())))
        .map(|(_, p)| p.clone())
}

/// Why a replica's vote was not counted.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    /// It is not one of the shard's replicas.
    #[error("not an aggregator of this shard")]
    NotAssigned,
    /// It voted already.
    #[error("voted already")]
    Duplicate,
}

/// What the shepherd does with a shard's votes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Replicas have yet to answer, and the deadline has not passed.
    Waiting,
    /// Every replica signed this hash, and no spot check was drawn: apply it.
    Agreed([u8; 32]),
    /// Recompute the shard from its committed slices, then [`Votes::liars`].
    Recompute,
}

/// The replicas' signed hashes of one shard's update.
#[derive(Clone, Debug)]
pub struct Votes<P> {
    replicas: Vec<P>,
    votes: Vec<(P, [u8; 32])>,
}

impl<P: Clone + PartialEq> Votes<P> {
    /// No votes yet from `replicas` ([`Assignment::replicas`]).
    pub fn new(replicas: Vec<P>) -> Self {
        Self { replicas, votes: Vec::new() }
    }

    /// Counts `from`'s hash: one vote a replica.
    pub fn vote(&mut self, from: &P, hash: [u8; 32]) -> Result<(), Refused> {
        if !self.replicas.contains(from) {
            return Err(Refused::NotAssigned);
        }
        if self.votes.iter().any(|(p, _)| p == from) {
            return Err(Refused::Duplicate);
        }
        self.votes.push((from.clone(), hash));
        Ok(())
    }

    /// The votes so far, in arrival order.
    pub fn votes(&self) -> &[(P, [u8; 32])] {
        &self.votes
    }

    /// What to do now: `spot` is a spot check the shepherd makes itself (one drawn
    /// with no [`auditor`] to vote), `expired` whether the shard's deadline has
    /// passed. Any disagreement means a recompute at once; silence, only at the
    /// deadline.
    pub fn outcome(&self, spot: bool, expired: bool) -> Outcome {
        let first = self.votes.first().map(|(_, h)| *h);
        if self.votes.iter().any(|(_, h)| Some(*h) != first) {
            return Outcome::Recompute;
        }
        let all = !self.replicas.is_empty() && self.votes.len() == self.replicas.len();
        match (all, first) {
            (true, Some(hash)) if !spot => Outcome::Agreed(hash),
            (true, _) => Outcome::Recompute,
            (false, _) if expired => Outcome::Recompute,
            (false, _) => Outcome::Waiting,
        }
    }

    /// The replicas that lied, given the shepherd's own hash of the shard: every
    /// vote for another hash, and every replica that did not vote.
    pub fn liars(&self, recomputed: &[u8; 32]) -> Vec<P> {
        self.replicas
            .iter()
            .filter(|p| self.votes.iter().find(|(v, _)| v == *p).is_none_or(|(_, h)| h != recomputed))
            .cloned()
            .collect()
    }
}

#[cfg(test)]
mod tests;
