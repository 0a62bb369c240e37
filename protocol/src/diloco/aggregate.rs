//! Validating, bounding and averaging pseudo-gradients from untrusted workers.
//!
//! A round's contributions are averaged as they arrive ([`RunningMean`]): each
//! is validated, bounded and added to one sum, and not kept, so the shepherd's
//! memory does not grow with its workers. The buffered [`aggregate`] and
//! [`trimmed_mean`] remain for the coordinate-wise trimmed mean, which needs
//! every contribution at once.

use super::Tensors;
use super::sparse::{Packed, SparseTensors};

/// A decoded contribution: dense tensors, or a sparse message's kept entries.
#[derive(Clone, Debug, PartialEq)]
pub enum Delta {
    /// One value per parameter.
    Dense(Tensors),
    /// The kept entries of every tensor ([`super::sparse`]).
    Sparse(SparseTensors),
    /// A sparse message checked but not unpacked ([`Packed`]): what
    /// [`super::compress::decode_delta`] gives for sparse runs. Its validation
    /// costs nothing more (the norm was measured by the check) and it is added
    /// straight from its bytes.
    Packed(Packed),
}

impl From<Tensors> for Delta {
    fn from(t: Tensors) -> Self {
        Self::Dense(t)
    }
}

impl Delta {
    /// Checks the delta against the parameter sizes; returns its L2 norm.
    pub fn validate(&self, sizes: &[usize]) -> Result<f64, Rejection> {
        match self {
            Self::Dense(t) => validate(t, sizes),
            Self::Sparse(s) => {
                if s.len() != sizes.len() {
                    return Err(Rejection::Count { got: s.len(), expected: sizes.len() });
                }
                let mut sum = 0.0f64;
                for (index, (t, n)) in s.iter().zip(sizes).enumerate() {
                    if t.indices.len() != t.values.len() || t.indices.iter().any(|i| *i as usize >= *n) {
                        return Err(Rejection::Shape { index, got: t.indices.len(), expected: *n });
                    }
                    for v in &t.values {
                        if !v.is_finite() {
                            return Err(Rejection::NonFinite { index });
                        }
                        sum += f64::from(*v) * f64::from(*v);
                    }
                }
                Ok(sum.sqrt())
            }
            Self::Packed(p) => {
                if p.sizes().len() != sizes.len() {
                    return Err(Rejection::Count { got: p.sizes().len(), expected: sizes.len() });
                }
                if let Some((index, (got, expected))) = p.sizes().zip(sizes).enumerate().find(|(_, (g, e))| g != *e) {
                    return Err(Rejection::Shape { index, got, expected: *expected });
                }
                match p.non_finite() {
                    Some(index) => Err(Rejection::NonFinite { index }),
                    None => Ok(p.norm()),
                }
            }
        }
    }

    /// Adds `weight` × the delta to `sum` (shapes validated).
    pub fn add_to(&self, sum: &mut Tensors, weight: f32) {
        self.add_on(sum, weight, 1);
    }

    /// [`Delta::add_to`], a packed delta's large tensors split over `threads`
    /// threads (the sum is the same, bit for bit, whatever the threads).
    pub fn add_on(&self, sum: &mut Tensors, weight: f32, threads: usize) {
        match self {
            Self::Dense(t) => {
                for (s, d) in sum.iter_mut().zip(t) {
                    s.iter_mut().zip(d).for_each(|(s, d)| *s += weight * d);
                }
            }
            Self::Sparse(t) => super::sparse::subtract(sum, t, -weight),
            Self::Packed(p) => p.add_to(sum, weight, threads),
        }
    }

    /// Each tensor's L2 norm and largest magnitude (of a sparse delta: of its kept
    /// entries). Validated deltas only (finite values).
    pub fn tensor_stats(&self) -> Vec<(f64, f32)> {
        match self {
            Self::Dense(t) => t.iter().map(|v| stats_of(v)).collect(),
            Self::Sparse(s) => s.iter().map(|t| stats_of(&t.values)).collect(),
            Self::Packed(p) => p.tensor_stats(),
        }
    }

    /// The delta bounded one tensor at a time: tensor t scaled down to at most
    /// `bounds.tensor[t]` in norm, then every value clipped to
    /// ±`bounds.element[t]` (a sparse message: its value tables, see
    /// [`Packed::bounded`]). Returns the bounded delta, its norm, and what the
    /// bounds changed. A delta the bounds leave alone is returned as it is.
    ///
    /// Scaling first keeps a scaled-up honest delta's shape: 10⁶ × an honest Δ
    /// comes out as that Δ at the bound. Clipped first, it would be ±clip in every
    /// value, a sign vector at the bound (with that order, 9 of 20 fp32 sleepers
    /// sending it past the screen's budget cost 21% of the val loss). A delta
    /// whose norm sits on a few values is still clipped once scaled.
    pub fn bounded(self, bounds: &Bounds) -> (Self, f64, Clipping) {
        let stats = self.tensor_stats();
        let at = |v: &[f64], t: usize| v.get(t).copied().unwrap_or(f64::INFINITY);
        let mut clipping = Clipping::default();
        let scales: Vec<f32> = stats
            .iter()
            .enumerate()
            .map(|(t, (norm, _))| {
                let bound = at(&bounds.tensor, t);
                if *norm > bound {
                    clipping.tensors += 1;
                    (bound / norm) as f32
                } else {
                    1.0
                }
            })
            .collect();
        let clips: Vec<f32> =
            (0..stats.len()).map(|t| bounds.element.get(t).copied().unwrap_or(f32::INFINITY)).collect();
        let over_clip = stats.iter().zip(scales.iter().zip(&clips)).any(|((_, max), (s, c))| max * s > *c);
        match self {
            Self::Packed(p) => {
                if clipping.tensors == 0 && !over_clip {
                    let norm = p.norm();
                    return (Self::Packed(p), norm, clipping);
                }
                // a value clipped to ±c after the scale s is one clipped to ±c/s before it
                let before: Vec<f32> =
                    clips.iter().zip(&scales).map(|(c, s)| if *s > 0.0 { c / s } else { *c }).collect();
                let (p, count) = p.bounded(&scales, &before);
                clipping.elements = count;
                let norm = p.norm();
                (Self::Packed(p), norm, clipping)
            }
            Self::Dense(mut t) => {
                scale_values(t.iter_mut().map(Vec::as_mut_slice), &scales);
                clip_values(t.iter_mut().map(Vec::as_mut_slice), &clips, &mut clipping);
                let d = Self::Dense(t);
                let norm = d.norm();
                (d, norm, clipping)
            }
            Self::Sparse(mut s) => {
                scale_values(s.iter_mut().map(|t| t.values.as_mut_slice()), &scales);
                clip_values(s.iter_mut().map(|t| t.values.as_mut_slice()), &clips, &mut clipping);
                let d = Self::Sparse(s);
                let norm = d.norm();
                (d, norm, clipping)
            }
        }
    }

    /// The bytes the delta holds in memory.
    pub fn len_bytes(&self) -> usize {
        match self {
            Self::Dense(t) => 4 * t.iter().map(Vec::len).sum::<usize>(),
            Self::Sparse(s) => 8 * s.iter().map(|t| t.values.len()).sum::<usize>(),
            Self::Packed(p) => p.len_bytes(),
        }
    }

    /// The L2 norm of the whole delta.
    pub fn norm(&self) -> f64 {
        match self {
            Self::Packed(p) => p.norm(),
            _ => self.tensor_stats().iter().map(|(n, _)| n * n).sum::<f64>().sqrt(),
        }
    }

    /// The delta as dense tensors of `sizes` elements.
    pub fn to_dense(&self, sizes: &[usize]) -> Tensors {
        match self {
            Self::Dense(t) => t.clone(),
            Self::Sparse(_) | Self::Packed(_) => {
                let mut dense: Tensors = sizes.iter().map(|n| vec![0.0; *n]).collect();
                self.add_to(&mut dense, 1.0);
                dense
            }
        }
    }

    /// The delta times `scale` (a global norm bound's; `sizes` unused), as a
    /// screen applies it: a sparse one stays sparse, its kept values scaled, so
    /// its screen uploads its entries, not the model's size; itself when `scale`
    /// is 1.
    pub fn scaled(self, scale: f32, _sizes: &[usize]) -> Self {
        if scale == 1.0 {
            return self;
        }
        let mut out = match self {
            Self::Packed(p) => Self::Sparse(p.unpack()),
            other => other,
        };
        match &mut out {
            Self::Dense(t) => t.iter_mut().flatten().for_each(|v| *v *= scale),
            Self::Sparse(s) => s.iter_mut().flat_map(|t| t.values.iter_mut()).for_each(|v| *v *= scale),
            Self::Packed(_) => {}
        }
        out
    }
}

/// Per-tensor limits on one contribution ([`Delta::bounded`]): a tensor is
/// scaled down to at most `tensor[t]` in L2 norm, then its elements are clipped
/// to ±`element[t]`. Missing entries are no limit.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Bounds {
    /// Each tensor's norm bound.
    pub tensor: Vec<f64>,
    /// Each tensor's element clip.
    pub element: Vec<f32>,
}

impl Bounds {
    /// No limits.
    pub fn none() -> Self {
        Self::default()
    }
}

/// What [`Delta::bounded`] changed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Clipping {
    /// Values clipped to their tensor's element clip.
    pub elements: u64,
    /// Tensors scaled down to their norm bound.
    pub tensors: usize,
}

impl Clipping {
    /// Whether the bounds changed anything.
    pub fn any(&self) -> bool {
        self.elements > 0 || self.tensors > 0
    }
}

/// The L2 norm and largest magnitude of `values`.
fn stats_of(values: &[f32]) -> (f64, f32) {
    let norm = values.iter().map(|v| f64::from(*v).powi(2)).sum::<f64>().sqrt();
    (norm, values.iter().map(|v| v.abs()).fold(0.0f32, f32::max))
}

fn clip_values<'a>(tensors: impl Iterator<Item = &'a mut [f32]>, clips: &[f32], clipping: &mut Clipping) {
    for (values, clip) in tensors.zip(clips) {
        for v in values.iter_mut() {
            if v.abs() > *clip {
                *v = v.signum() * *clip;
                clipping.elements += 1;
            }
        }
    }
}

fn scale_values<'a>(tensors: impl Iterator<Item = &'a mut [f32]>, scales: &[f32]) {
    for (values, scale) in tensors.zip(scales) {
        if *scale < 1.0 {
            values.iter_mut().for_each(|v| *v *= *scale);
        }
    }
}

/// Packed contributions a [`RunningMean`] holds before it adds them, by default.
pub const DEFAULT_BATCH: usize = 32;
/// The most bytes of packed contributions a [`RunningMean`] holds before it adds
/// them, whatever its batch: 128 MiB, 33 gpt2-124m contributions at the default
/// sparse layout (3.9 MB each).
pub const BATCH_BYTES: usize = 128 << 20;

/// The sample-weighted mean of a round's contributions, each scaled down to the
/// norm bound in force when it arrived, kept as one running sum: memory is one
/// copy of the parameters, whatever the number of contributions, plus a batch of
/// packed contributions not added yet.
///
/// Packed (sparse) contributions given by value ([`RunningMean::push`]) are held
/// in a batch, up to `batch` of them or [`BATCH_BYTES`], and then added together
/// block by block of the sum ([`super::sparse::add_batch`]), so the sum crosses
/// the memory bus once a batch rather than once a contribution. The result is
/// the same, bit for bit, as adding each in turn: every element receives the
/// same additions in the same order. A dense or unpacked contribution, or one
/// given by reference ([`RunningMean::add`]), adds the batch first and then
/// itself.
#[derive(Clone, Debug, PartialEq)]
pub struct RunningMean {
    sum: Option<Tensors>,
    /// The weights added (held ones included): the mean's divisor.
    total: f64,
    threads: usize,
    /// Most packed contributions held before they are added (0 and 1: none held).
    batch: usize,
    /// Packed contributions not added yet, with their weights, in arrival order.
    pending: Vec<(Packed, f32)>,
    /// Their bytes.
    pending_bytes: usize,
}

impl Default for RunningMean {
    fn default() -> Self {
        Self::with_batch(1, DEFAULT_BATCH)
    }
}

impl RunningMean {
    /// A mean that adds packed sparse contributions on `threads` threads, in
    /// batches of [`DEFAULT_BATCH`].
    pub fn with_threads(threads: usize) -> Self {
        Self::with_batch(threads, DEFAULT_BATCH)
    }

    /// A mean that adds packed contributions on `threads` threads, holding up to
    /// `batch` of them (and at most [`BATCH_BYTES`]) before adding them
    /// together; a batch of 0 or 1 adds each at once.
    pub fn with_batch(threads: usize, batch: usize) -> Self {
        Self { sum: None, total: 0.0, threads, batch, pending: Vec::new(), pending_bytes: 0 }
    }

    /// Adds a validated contribution of `norm` and `weight` (its samples, times
    /// any trust factor), bounded to `bound`, at once (after any held batch);
    /// returns whether it was scaled down. The weight counts in the mean's divisor
    /// in full, the norm bound's scale only in its sum: a contribution scaled down
    /// moves the mean less.
    pub fn add(&mut self, delta: &Delta, weight: f64, norm: f64, bound: f64, sizes: &[usize]) -> bool {
        let (w, scaled) = Self::weight(weight, norm, bound);
        self.flush();
        let threads = self.threads.max(1);
        delta.add_on(self.sum_for(sizes), w, threads);
        self.total += if weight.is_finite() { weight.max(0.0) } else { 0.0 };
        scaled
    }

    /// [`RunningMean::add`] of a contribution the mean may keep: a packed one is
    /// held in the batch and added with it (the sum is the same).
    pub fn push(&mut self, delta: Delta, weight: f64, norm: f64, bound: f64, sizes: &[usize]) -> bool {
        let Delta::Packed(packed) = delta else { return self.add(&delta, weight, norm, bound, sizes) };
        let total = if weight.is_finite() { weight.max(0.0) } else { 0.0 };
        let (weight, scaled) = Self::weight(weight, norm, bound);
        self.sum_for(sizes);
        self.total += total;
        self.pending_bytes += packed.len_bytes();
        self.pending.push((packed, weight));
        if self.pending.len() >= self.batch || self.pending_bytes >= BATCH_BYTES {
            self.flush();
        }
        scaled
    }

    /// The scale that brings `norm` down to `bound` (1: within it).
    fn scale(norm: f64, bound: f64) -> f64 {
        if norm > bound { bound / norm } else { 1.0 }
    }

    /// The weight a contribution is added with: its own (finite, not negative),
    /// scaled down to the bound.
    fn weight(weight: f64, norm: f64, bound: f64) -> (f32, bool) {
        let weight = if weight.is_finite() { weight.max(0.0) } else { 0.0 };
        let scale = Self::scale(norm, bound);
        ((scale * weight) as f32, scale < 1.0)
    }

    /// The sum, allocated at `sizes` on first use.
    fn sum_for(&mut self, sizes: &[usize]) -> &mut Tensors {
        self.sum.get_or_insert_with(|| sizes.iter().map(|n| vec![0.0; *n]).collect())
    }

    /// Adds the held batch to the sum now.
    pub fn flush(&mut self) {
        if self.pending.is_empty() {
            return;
        }
        if let Some(sum) = self.sum.as_mut() {
            let batch: Vec<(&Packed, f32)> = self.pending.iter().map(|(p, w)| (p, *w)).collect();
            super::sparse::add_batch(sum, &batch, self.threads.max(1));
        }
        self.pending.clear();
        self.pending_bytes = 0;
    }

    /// The weights added (held ones included): what the mean divides by.
    pub fn total(&self) -> f64 {
        self.total
    }

    /// Packed contributions held, not yet added to the sum.
    pub fn held(&self) -> usize {
        self.pending.len()
    }

    /// The mean, or `None` if nothing was added.
    pub fn finish(mut self) -> Option<Tensors> {
        self.flush();
        let mut sum = self.sum?;
        let inv = if self.total > 0.0 { 1.0 / self.total } else { 0.0 };
        sum.iter_mut().flatten().for_each(|v| *v = (f64::from(*v) * inv) as f32);
        Some(sum)
    }
}

/// Why a contribution was refused.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum Rejection {
    /// Trained under another term, or from other parameters than the open
    /// round's (see [`crate::failover::Fence`]).
    #[error("fenced: {0}")]
    Fenced(String),
    /// For a round that is not open.
    #[error("wrong round: contribution for round {got}, round {current} is open")]
    WrongRound {
        /// The contribution's round.
        got: u64,
        /// The open round.
        current: u64,
    },
    /// For a round that already closed: a straggler.
    #[error("late: round {round} already closed")]
    Late {
        /// The closed round.
        round: u64,
    },
    /// From a peer that was not asked to take part in this round.
    #[error("not a participant in round {round}")]
    NotParticipant {
        /// The round.
        round: u64,
    },
    /// A second contribution from the same peer for the same round.
    #[error("duplicate contribution for round {round}")]
    Duplicate {
        /// The round.
        round: u64,
    },
    /// The wrong number of tensors.
    #[error("wrong tensor count: {got}, expected {expected}")]
    Count {
        /// Tensors received.
        got: usize,
        /// Tensors expected.
        expected: usize,
    },
    /// A tensor of the wrong size.
    #[error("wrong shape: tensor {index} has {got} elements, expected {expected}")]
    Shape {
        /// Which tensor.
        index: usize,
        /// Elements received.
        got: usize,
        /// Elements expected.
        expected: usize,
    },
    /// NaN or infinity.
    #[error("non-finite value in tensor {index}")]
    NonFinite {
        /// Which tensor.
        index: usize,
    },
    /// Claims to have trained on nothing.
    #[error("no samples")]
    NoSamples,
    /// Every value is zero: no work, and it would only dilute the mean.
    #[error("empty: every value of the update is zero")]
    Empty,
    /// Its sender sits out: the screen refused its contributions lately
    /// ([`super::rating::Ratings::sits_out`]).
    #[error("sitting out: the screen refused this key's contributions lately; it may contribute after round {until}")]
    SitsOut {
        /// The last round it sits out.
        until: u64,
    },
    /// A copy: too close to another contribution of the round, or to the last
    /// round's public update ([`super::sketch`]).
    #[error("too similar: a cosine of {cosine:.6} with {}", if *.to_update { "the last round's update" } else { "another contribution of this round" })]
    TooSimilar {
        /// The sketches' cosine.
        cosine: f64,
        /// With the last update (else with another contribution).
        to_update: bool,
    },
    /// A sparse contribution whose kept entries lie on the last round's sparse
    /// update or the one before it, with its signs: a copy of part of it
    /// ([`super::sketch::support_share`]).
    #[error("a copy of a recent round's update: {:.1}% of its entries are the update's, with its signs", .share * 100.0)]
    OnUpdate {
        /// The share of its entries on the update's support with the update's sign.
        share: f64,
    },
    /// Claims more samples than the run's manifest allows a round (τ inner steps
    /// of batch × block tokens), or a count that is not a whole number of steps.
    #[error("claims {claimed} samples; the run allows whole steps of {unit}, at most {max} (τ × batch × block)")]
    Samples {
        /// What it claimed.
        claimed: u64,
        /// Samples in one inner step (batch × block).
        unit: u64,
        /// The most a round allows.
        max: u64,
    },
    /// On probation (it counts only screened) while the round's screening budget
    /// is spent.
    #[error(
        "not screened: the round's screening budget is spent, and a contribution on probation counts only screened"
    )]
    Unscreened,
    /// The run's admission refused its sender (`--admit`): the reason.
    #[error("not admitted: {0}")]
    NotAdmitted(String),
    /// Not among the round's best-rated contributions (`--aggregate-max`): its
    /// screen still counts toward its rating.
    #[error("not aggregated: the round aggregates its {max} best-rated participants")]
    NotSelected {
        /// The round's aggregate cap.
        max: usize,
    },
    /// The encoded tensors did not decode.
    #[error("undecodable: {0}")]
    Encoding(String),
    /// Applied alone, the contribution does not point downhill on the shepherd's
    /// held-out batch (it lowers the loss less than its opposite would), or does
    /// best at a sliver of its step, as random values do (a loss-delta screen in
    /// the spirit of Templar's Gauntlet; `committee::Losses::improves`).
    #[error(
        "no improvement: held-out loss {after:.4} with it, {before:.4} without, {reversed:.4} with it reversed \
         (needs it below reversed, and at its best past 1/32 of its step)"
    )]
    NoImprovement {
        /// The loss at the round's parameters.
        before: f32,
        /// The loss at the parameters minus this pseudo-gradient.
        after: f32,
        /// The loss at the parameters plus this pseudo-gradient.
        reversed: f32,
    },
    /// Applied alone at its best step (`committee::Losses::improvement`), it
    /// lowers the held-out loss, but by less than the least the screen asks (a
    /// share of the rated peers' median improvement).
    #[error("too small an improvement: held-out loss falls by {gain:.5} at best, the screen asks at least {needed:.5}")]
    SmallImprovement {
        /// How much it lowered the loss at its best step.
        gain: f64,
        /// The least the screen asked.
        needed: f64,
    },
}

impl Rejection {
    /// The refusal's code, which the sender's program decides on.
    pub fn code(&self) -> pcp_schema::AckCode {
        use pcp_schema::AckCode as C;
        match self {
            Self::Fenced(_) => C::Fenced,
            Self::WrongRound { .. } => C::WrongRound,
            Self::Late { .. } => C::Late,
            Self::NotParticipant { .. } => C::NotParticipant,
            Self::Duplicate { .. } => C::Duplicate,
            Self::Count { .. } | Self::Shape { .. } | Self::NonFinite { .. } | Self::Encoding(_) => C::Malformed,
            Self::NoSamples | Self::Samples { .. } => C::Samples,
            Self::Empty => C::Empty,
            Self::TooSimilar { .. } | Self::OnUpdate { .. } => C::TooSimilar,
            Self::SitsOut { .. } => C::SitsOut,
            Self::Unscreened => C::Unscreened,
            Self::NotAdmitted(_) => C::NotAdmitted,
            Self::NotSelected { .. } => C::NotSelected,
            Self::NoImprovement { .. } | Self::SmallImprovement { .. } => C::Screen,
        }
    }

    /// What the sender is told: the reason, except that the screen's verdicts say
    /// nothing of its losses (each answer would read the secret batch's), which
    /// only the shepherd's own record keeps.
    pub fn told(&self) -> String {
        match self {
            Self::NoImprovement { .. } | Self::SmallImprovement { .. } => {
                "refused by the shepherd's screen: applied alone, it did not help enough on its held-out batch".into()
            }
            Self::TooSimilar { to_update: true, .. } | Self::OnUpdate { .. } => {
                "too similar to the last round's update".into()
            }
            Self::TooSimilar { to_update: false, .. } => "too similar to another contribution of this round".into(),
            other => other.to_string(),
        }
    }
}

/// Checks `delta` against the parameter sizes; returns its L2 norm.
pub fn validate(delta: &Tensors, sizes: &[usize]) -> Result<f64, Rejection> {
    if delta.len() != sizes.len() {
        return Err(Rejection::Count { got: delta.len(), expected: sizes.len() });
    }
    let mut sum = 0.0f64;
    for (index, (t, expected)) in delta.iter().zip(sizes).enumerate() {
        if t.len() != *expected {
            return Err(Rejection::Shape { index, got: t.len(), expected: *expected });
        }
        for v in t {
            if !v.is_finite() {
                return Err(Rejection::NonFinite { index });
            }
            sum += f64::from(*v) * f64::from(*v);
        }
    }
    Ok(sum.sqrt())
}

/// A validated contribution.
#[derive(Clone, Debug, PartialEq)]
pub struct Accepted {
    /// Samples (tokens) it trained on: its weight in the average.
    pub samples: u64,
    /// θ_start − θ_end.
    pub delta: Tensors,
    /// ‖delta‖₂.
    pub norm: f64,
}

/// The bound a contribution arriving now is held to: `factor` × the lower
/// median of the norms accepted in the previous round and so far in this one
/// (`current` includes its own). `None` while there is no previous round and
/// fewer than two norms: the round then holds its first contributions until a
/// second arrives or it closes.
pub fn running_bound(previous: &[f64], current: &[f64], factor: f64) -> Option<f64> {
    if previous.is_empty() && current.len() < 2 {
        return None;
    }
    let mut all: Vec<f64> = previous.iter().chain(current).copied().filter(|n| n.is_finite()).collect();
    if all.is_empty() {
        return None;
    }
    all.sort_by(f64::total_cmp);
    Some(factor * all[(all.len() - 1) / 2])
}

/// The norm bound for a round: `factor` × the lower median of this round's
/// norms, or, with a single contribution, of recent rounds' accepted norms
/// too. One hostile worker cannot move a lower median, so it cannot scale
/// the bound up; this round's own norms keep the bound from lagging behind
/// updates that shrink as training converges.
pub fn norm_bound(history: &[f64], current: &[f64], factor: f64) -> f64 {
    let pool: Vec<f64> =
        if current.len() >= 2 { current.to_vec() } else { history.iter().chain(current).copied().collect() };
    let mut all: Vec<f64> = pool.into_iter().filter(|n| n.is_finite()).collect();
    if all.is_empty() {
        return f64::INFINITY;
    }
    all.sort_by(f64::total_cmp);
    factor * all[(all.len() - 1) / 2]
}

/// The sample-weighted mean of the contributions, each first scaled down to
/// at most `bound` in norm. Returns the mean and how many were scaled.
pub fn aggregate(contributions: &[Accepted], bound: f64) -> (Tensors, usize) {
    let Some(first) = contributions.first() else { return (Vec::new(), 0) };
    let total: f64 = contributions.iter().map(|c| c.samples as f64).sum();
    let mut mean: Vec<Vec<f64>> = first.delta.iter().map(|t| vec![0.0; t.len()]).collect();
    let mut clipped = 0;
    for c in contributions {
        let scale = if c.norm > bound {
            clipped += 1;
            bound / c.norm
        } else {
            1.0
        };
        let w = scale * c.samples as f64 / total;
        for (m, d) in mean.iter_mut().zip(&c.delta) {
            for (m, d) in m.iter_mut().zip(d) {
                *m += w * f64::from(*d);
            }
        }
    }
    (mean.into_iter().map(|t| t.into_iter().map(|v| v as f32).collect()).collect(), clipped)
}

/// The coordinate-wise trimmed mean of the contributions, each first scaled down
/// to at most `bound` in norm: in every coordinate the `⌊trim × n⌋` largest and
/// smallest of the n values are dropped (at most all but one or two) and the rest
/// averaged, unweighted. A few workers sending extreme values, in any
/// coordinates, move no coordinate beyond the honest values' range. Returns the
/// mean and how many contributions were scaled.
pub fn trimmed_mean(contributions: &[Accepted], bound: f64, trim: f64) -> (Tensors, usize) {
    let Some(first) = contributions.first() else { return (Vec::new(), 0) };
    let n = contributions.len();
    let k = ((trim.clamp(0.0, 0.5) * n as f64) as usize).min((n - 1) / 2);
    let scales: Vec<f64> = contributions.iter().map(|c| if c.norm > bound { bound / c.norm } else { 1.0 }).collect();
    let clipped = scales.iter().filter(|s| **s < 1.0).count();
    let mut column = vec![0.0f64; n];
    let mean = first
        .delta
        .iter()
        .enumerate()
        .map(|(t, tensor)| {
            (0..tensor.len())
                .map(|i| {
                    for ((slot, c), scale) in column.iter_mut().zip(contributions).zip(&scales) {
                        *slot = scale * f64::from(c.delta[t][i]);
                    }
                    column.sort_by(f64::total_cmp);
                    let kept = &column[k..n - k];
                    (kept.iter().sum::<f64>() / kept.len() as f64) as f32
                })
                .collect()
        })
        .collect();
    (mean, clipped)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_screen_refusal_tells_its_code_and_none_of_the_losses() {
        let r = Rejection::NoImprovement { before: 2.2662, after: 2.2663, reversed: 2.2661 };
        assert_eq!(r.code(), pcp_schema::AckCode::Screen);
        assert!(r.to_string().contains("2.2662"), "the shepherd's record keeps them: {r}");
        assert!(!r.told().chars().any(|c| c.is_ascii_digit()), "{}", r.told());
        let small = Rejection::SmallImprovement { gain: 0.001, needed: 0.002 };
        assert!(!small.told().chars().any(|c| c.is_ascii_digit()), "{}", small.told());
        assert_eq!(Rejection::Late { round: 3 }.told(), "late: round 3 already closed");
        assert_eq!(Rejection::Empty.code(), pcp_schema::AckCode::Empty);
    }

    #[test]
    fn trimmed_mean_drops_the_extremes_of_every_coordinate() {
        let c = |samples, delta: Vec<f32>| {
            let norm = delta.iter().map(|v| f64::from(*v).powi(2)).sum::<f64>().sqrt();
            Accepted { samples, delta: vec![delta], norm }
        };
        // five workers; one sends a huge first coordinate, another a huge negative second
        let all = [
            c(1, vec![1.0, 2.0]),
            c(1, vec![2.0, 3.0]),
            c(9, vec![3.0, 4.0]),
            c(1, vec![100.0, 1.0]),
            c(1, vec![0.0, -100.0]),
        ];
        let (mean, clipped) = trimmed_mean(&all, f64::INFINITY, 0.2);
        assert_eq!(clipped, 0);
        // first coordinate: drop 0 and 100, mean of 1, 2, 3; second: drop -100 and 4
        assert_eq!(mean, vec![vec![2.0, 2.0]]);
        // trim 0 is the unweighted mean; too large a trim keeps the median
        assert_eq!(trimmed_mean(&all, f64::INFINITY, 0.0).0, vec![vec![106.0 / 5.0, -90.0 / 5.0]]);
        assert_eq!(trimmed_mean(&all, f64::INFINITY, 0.9).0, vec![vec![2.0, 2.0]]);
        // the norm bound applies first
        let (_, clipped) = trimmed_mean(&all, 10.0, 0.2);
        assert_eq!(clipped, 2);
        assert_eq!(trimmed_mean(&[], 1.0, 0.2), (Vec::new(), 0));
    }

    #[test]
    fn validation_names_the_problem() {
        let sizes = [2, 1];
        assert_eq!(validate(&vec![vec![3.0, 4.0], vec![0.0]], &sizes), Ok(5.0));
        assert_eq!(validate(&vec![vec![1.0, 1.0]], &sizes), Err(Rejection::Count { got: 1, expected: 2 }));
        assert_eq!(
            validate(&vec![vec![1.0], vec![0.0]], &sizes),
            Err(Rejection::Shape { index: 0, got: 1, expected: 2 })
        );
        assert_eq!(validate(&vec![vec![1.0, f32::NAN], vec![0.0]], &sizes), Err(Rejection::NonFinite { index: 0 }));
        assert_eq!(
            validate(&vec![vec![1.0, 1.0], vec![f32::INFINITY]], &sizes),
            Err(Rejection::NonFinite { index: 1 })
        );
    }

    #[test]
    fn the_running_mean_matches_the_buffered_one() {
        let a = Accepted { samples: 3, delta: vec![vec![1.0, 0.0]], norm: 1.0 };
        let b = Accepted { samples: 1, delta: vec![vec![5.0, 0.0]], norm: 5.0 };
        let (buffered, clipped) = aggregate(&[a.clone(), b.clone()], 2.0);
        assert_eq!(clipped, 1);
        let mut running = RunningMean::default();
        assert!(!running.add(&Delta::Dense(a.delta), 3.0, 1.0, 2.0, &[2]));
        assert!(running.add(&Delta::Dense(b.delta), 1.0, 5.0, 2.0, &[2]));
        assert_eq!(running.finish(), Some(buffered));
        assert_eq!(RunningMean::default().finish(), None);
    }

    #[test]
    fn a_batched_mean_is_the_same_bits_as_adding_one_at_a_time() {
        use crate::diloco::sparse::{self, Layout, Packed, SparseTensor};
        use rand::{Rng, SeedableRng};
        // a tensor past the threads' threshold and the block, a small one, an empty one
        let sizes = [(1 << 20) + 4099, 300, 0];
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let mut tensors = |scale: f32| -> Tensors {
            sizes.iter().map(|n| (0..*n).map(|_| rng.gen_range(-scale..scale)).collect()).collect()
        };
        let layouts = [
            Layout { chunk: 64, k: 2, bits: 2, strided: false },
            Layout { chunk: 4096, k: 64, bits: 4, strided: false },
            Layout { chunk: 16, k: 1, bits: 8, strided: true },
        ];
        // (the delta the batched mean is given, what the reference adds, samples, norm)
        let mut deltas: Vec<(Delta, Delta, u64, f64)> = Vec::new();
        for i in 0..40u64 {
            let t = tensors(1e-2 * (1 + i % 5) as f32);
            let (given, reference) = match i % 7 {
                // a dense one and an unpacked sparse one now and then, packed ones mostly
                3 => (Delta::Dense(t.clone()), Delta::Dense(t)),
                5 => {
                    let s: sparse::SparseTensors = t
                        .iter()
                        .map(|v| SparseTensor {
                            indices: (0..v.len() as u32).step_by(97).collect(),
                            values: v.iter().step_by(97).copied().collect(),
                        })
                        .collect();
                    (Delta::Sparse(s.clone()), Delta::Sparse(s))
                }
                _ => {
                    let layout = layouts[(i % 3) as usize];
                    let seed = i % 4;
                    let (bytes, sent) = sparse::encode_seeded(&t, layout, seed);
                    let packed = Packed::check(&bytes, &sizes, layout, seed).expect("checks");
                    (Delta::Packed(packed), Delta::Sparse(sent))
                }
            };
            let norm = given.validate(&sizes).expect("valid");
            deltas.push((given, reference, 1 + i % 3, norm));
        }
        let bound = deltas.iter().map(|d| d.3).sum::<f64>() / deltas.len() as f64;
        let mut reference = RunningMean::with_batch(1, 1);
        for (_, r, samples, norm) in &deltas {
            reference.add(r, *samples as f64, *norm, bound, &sizes);
        }
        let expected = reference.finish().expect("a mean");
        let bits =
            |t: &Tensors| -> Vec<Vec<u32>> { t.iter().map(|v| v.iter().map(|x| x.to_bits()).collect()).collect() };
        for (threads, batch) in [(1, 32), (3, 5), (2, 64), (4, 1)] {
            let mut mean = RunningMean::with_batch(threads, batch);
            let mut scaled = 0;
            for (d, _, samples, norm) in deltas.iter().cloned() {
                scaled += usize::from(mean.push(d, samples as f64, norm, bound, &sizes));
                assert!(mean.held() < batch.max(1), "the batch is bounded");
            }
            assert!(scaled > 0 && scaled < deltas.len(), "some are scaled down to the bound");
            assert_eq!(mean.total(), deltas.iter().map(|d| d.2).sum::<u64>() as f64);
            let got = mean.finish().expect("a mean");
            assert!(bits(&got) == bits(&expected), "{threads} threads, batch {batch}: not the same bits");
        }
    }

    #[test]
    fn sparse_deltas_validate_and_add_like_their_dense_form() {
        use crate::diloco::sparse::SparseTensor;
        let sparse = Delta::Sparse(vec![SparseTensor { indices: vec![0, 2], values: vec![3.0, 4.0] }]);
        assert_eq!(sparse.validate(&[3]), Ok(5.0));
        assert_eq!(sparse.to_dense(&[3]), vec![vec![3.0, 0.0, 4.0]]);
        assert!(matches!(sparse.validate(&[2]), Err(Rejection::Shape { .. })));
        assert!(matches!(sparse.validate(&[3, 1]), Err(Rejection::Count { .. })));
        let nan = Delta::Sparse(vec![SparseTensor { indices: vec![1], values: vec![f32::NAN] }]);
        assert_eq!(nan.validate(&[3]), Err(Rejection::NonFinite { index: 0 }));
    }

    #[test]
    fn the_running_bound_waits_for_two_norms_without_history() {
        assert_eq!(running_bound(&[], &[3.0], 1.0), None);
        assert_eq!(running_bound(&[], &[3.0, 1.0], 1.0), Some(1.0));
        assert_eq!(running_bound(&[2.0, 2.0, 9.0], &[1000.0], 1.0), Some(2.0));
        assert_eq!(running_bound(&[2.0], &[], 2.0), Some(4.0));
    }

    #[test]
    fn weighted_by_samples() {
        let a = Accepted { samples: 3, delta: vec![vec![1.0]], norm: 1.0 };
        let b = Accepted { samples: 1, delta: vec![vec![5.0]], norm: 5.0 };
        let (mean, clipped) = aggregate(&[a, b], f64::INFINITY);
        assert_eq!((mean, clipped), (vec![vec![2.0]], 0));
    }

    #[test]
    fn one_hostile_worker_is_bounded() {
        let honest = |v: f32| Accepted { samples: 1, delta: vec![vec![v, v]], norm: f64::from(v) * 2f64.sqrt() };
        let hostile = Accepted { samples: 1, delta: vec![vec![1000.0, 1000.0]], norm: 1000.0 * 2f64.sqrt() };
        let all = [honest(1.0), honest(1.1), honest(0.9), hostile];
        let norms: Vec<f64> = all.iter().map(|c| c.norm).collect();
        let bound = norm_bound(&[], &norms, 2.0);
        assert!(bound < 2.2 * 2f64.sqrt() * 1.1, "{bound}");
        let (mean, clipped) = aggregate(&all, bound);
        assert_eq!(clipped, 1);
        assert!(mean[0][0] < 1.3, "the hostile worker moved the mean to {}", mean[0][0]);
        // Two contributors: the lower median keeps the honest scale.
        assert!(norm_bound(&[5.0, 5.0], &[1.0, 1000.0], 2.0) <= 2.0);
        // A lone hostile contributor is bounded by recent rounds.
        assert_eq!(norm_bound(&[1.0, 1.2, 0.9], &[1000.0], 1.0), 1.0);
    }
}
