//! The shepherd's state machine: `handle(input, now_ms) -> actions`.
//!
//! Rounds: the shepherd opens round r for the workers alive at that moment
//! (a worker that joins mid-round starts at the next one) with a deadline,
//! accepts one validated contribution per participant, and closes the round
//! when every live participant has answered, or at the deadline once a
//! quorum has. Each accepted contribution is bounded in norm and added to a
//! running sample-weighted sum as it arrives ([`RunningMean`]); closing applies
//! the outer step: Nesterov for dense encodings, and for sparse ones
//! SparseLoCo's plain averaged step, re-sparsified through the shepherd's own
//! error feedback so that the update it publishes is sparse too. Workers silent
//! for longer than the heartbeat timeout are dropped and no longer waited for.
//!
//! The norm bound cannot wait for the round's median without keeping every
//! contribution, so each contribution is held to the bound in force when it
//! arrives: the norm factor × the lower median of the norms accepted in the
//! previous round and so far in this one ([`running_bound`](super::aggregate::running_bound)). The first round
//! of a run, with no previous norms, holds its first contribution until a
//! second arrives. With `trim`, every contribution is held until the round
//! closes (the trimmed mean needs them all); sparse runs refuse `trim`.
//!
//! # Overlapping workers ([`Config::overlap`])
//!
//! Workers that overlap rounds ([`super::worker::Worker::with_overlap`]) train
//! round r+1 while round r syncs, so what must not hold a round is a slow
//! worker or a slow link. Three rules, on only with `overlap` (lockstep rounds
//! are unchanged):
//!
//! * **Time-boxed rounds.** Each round has a compute budget, τ × the median time
//!   per inner step of the contributions averaged in the last round that reported
//!   any (× `budget_factor`), learned from their [`Timing`] (the workers' own
//!   claims, by earned weight, falling no lower than a budget of three quarters
//!   of the last round: [`reference`]) and given to workers with the round
//!   ([`Shepherd::budget_ms`]). A worker runs τ steps or the budget,
//!   whichever ends first, and its contribution is weighted by the samples it
//!   trained on, so a straggler adds fewer tokens instead of holding the round:
//!   its compute still counts in full. This is the time-boxed step of
//!   asynchronous local-SGD systems, applied to a DiLoCo round. With the budget
//!   goes [`Shepherd::steps_end_ms`], when the median worker's steps of the round
//!   end (the median send of the last round's contributions plus the budget): a
//!   worker that trains the round ahead stops there even before its budget, so
//!   one that started late catches up instead of drifting later round after
//!   round (a budget counted from each worker's own start lets such lags add up).
//! * **A deadline after the budget.** Overlapping workers start round r+1's
//!   steps when they send round r's contribution, so what a late round costs is
//!   a worker waiting for the next round's announcement once its next steps are
//!   done. A time-boxed round therefore waits for late links as long as that
//!   costs no one compute and no longer: once half its participants were accepted,
//!   its deadline becomes the median time their contributions were sent (the
//!   arrival less the send-to-arrival time of their [`Timing`]) plus the budget,
//!   less the time the shepherd's close takes (as the host reports it,
//!   [`Shepherd::announced`]) and an announcement takes to reach the workers
//!   ([`Overlap::notice_ms`]); before that it is two budgets after the opening
//!   (within the deadline bounds). [`Shepherd::deadline_ms`] gives the deadline
//!   in force. A round still closes as soon as every participant answered, and
//!   without quorum at the deadline it is extended as in lockstep. (A deadline fixed
//!   at the opening cannot do this: a round's steps begin before it opens, by as
//!   much as the last round's slowest upload; and one set from the last round's
//!   contributions in time is biased early by the late ones it lacks, a bias
//!   that feeds on itself: an earlier deadline, fewer in time, an earlier
//!   estimate.)
//! * **One-round-late contributions are carried over.** A contribution for round
//!   r that arrives after r closed, while r+1 is open, is validated, bounded and
//!   added to round r+1's mean like the others (a one-round-stale
//!   pseudo-gradient: with the workers' rebase it is still the progress of τ
//!   steps, taken one outer step earlier), and named in the summary's `carried`.
//!   Only from a participant of round r that had not answered it, at most one per
//!   worker and round; anything older is refused as late. (Not with fragments:
//!   round r+1 syncs another fragment.) The slowest links thus never discard
//!   compute unless they are more than a round late.
//!
//! A late pseudo-gradient is the staleness of asynchronous DiLoCo: bounded to
//! one round here, and weighted like any other by its samples and norm bound.
//! A [`Snapshot`] keeps the step time (the budget's reference), but not what
//! these rules learn of the last round (its sends and participants): a resumed
//! shepherd's first round has a budget, no steps end, and carries nothing over.
//!
//! A host drives them so: with every [`Action::OpenRound`], announce
//! [`Shepherd::budget_ms`] and [`Shepherd::steps_end_ms`] too (0 for none); give
//! each [`Input::Contribution`] its [`Timing`]; and after each input, tick the
//! state machine at [`Shepherd::deadline_ms`] if it moved.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use super::Tensors;
use super::aggregate::{Accepted, Bounds, Delta, Rejection, RunningMean, norm_bound, trimmed_mean};
use super::outer::Nesterov;
use super::rating::{Policy, Ratings};
use super::sketch::Sketch;
use super::sparse::{ErrorFeedback, Settings};
use reference::{References, bounded_move, tensor_references, weighted_median};

mod applied;
mod close;
mod copies;
mod input;
pub mod reference;
mod snapshot;
mod step;

pub use applied::Applied;
pub use input::{Input, Report, Screen, Timing};
pub use snapshot::{Learned, Snapshot};
use step::Outer;

/// Shepherd settings.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    /// Rounds to run.
    pub rounds: u64,
    /// Workers that must have joined before the first round opens (after a
    /// resume: before the first round it opens, or `resume_grace_ms` after its
    /// first input, whichever comes first).
    pub start_workers: usize,
    /// How long a resumed shepherd waits for `start_workers` to come back.
    pub resume_grace_ms: u64,
    /// Contributions needed to close a round at its deadline.
    pub min_quorum: usize,
    /// The deadline of the first rounds, before any durations are known.
    pub initial_deadline_ms: u64,
    /// Lower bound on an adaptive deadline.
    pub min_deadline_ms: u64,
    /// Upper bound on an adaptive deadline.
    pub max_deadline_ms: u64,
    /// Deadline = factor × median duration of recent rounds.
    pub deadline_factor: f64,
    /// Recent rounds the median looks at.
    pub deadline_window: usize,
    /// Drop a worker not heard from for this long (or [`super::liveness::timeout_ms`]).
    pub heartbeat_timeout_ms: u64,
    /// Outer learning rate.
    pub outer_lr: f32,
    /// Outer Nesterov momentum.
    pub outer_momentum: f32,
    /// Contribution norms are bounded to factor × the lower median of recent
    /// norms (1.0: a ×1000 worker counts no more than a typical one).
    pub norm_factor: f64,
    /// With 3 or more contributions, aggregate by the coordinate-wise mean
    /// trimmed by this fraction at each end ([`trimmed_mean`]) instead of the
    /// sample-weighted mean; 0 (the default) keeps the weighted mean.
    pub trim: f64,
    /// A sparse run: contributions are sparse, the outer step is
    /// θ ← θ − Û where Û is the chunked top-k of the shepherd's error feedback
    /// plus `outer_lr` × the mean (no momentum), published as the round's update.
    pub sparse: Option<Settings>,
    /// Threads a sparse contribution is added to the round's sum on (its large
    /// tensors split into ranges); the sum does not depend on it.
    pub add_threads: usize,
    /// Streaming DiLoCo's fragments: the tensors of each; round r syncs fragment
    /// (r − 1) mod P, its contributions carry that fragment's tensors (the others
    /// empty) and its outer step moves only them. Empty: the whole model each round.
    pub fragments: Vec<std::ops::Range<usize>>,
    /// Workers overlap rounds: time-boxed rounds, a deadline after the budget and
    /// contributions carried over one round (the module docs). `None`: lockstep.
    pub overlap: Option<Overlap>,
    /// Samples in one inner step, batch × block, from the manifest: a contribution
    /// may claim only whole steps of it, at most `max_steps` of them. 0: claims are
    /// not checked (tests of other rules).
    pub sample_unit: u64,
    /// τ: the most inner steps a round's contribution may claim.
    pub max_steps: u64,
    /// Each tensor of a contribution is scaled down to this × the median norm of
    /// that tensor in the reference contributions of its last round (infinite: off).
    pub tensor_factor: f64,
    /// Each value of a contribution is clipped to this × the median largest
    /// magnitude of its tensor in those contributions (infinite: off).
    pub element_factor: f64,
    /// Ratings from the screen ([`Screen::Passed`]) set each participant's trust
    /// factor, and rated peers' contributions are the bounds' reference. `None`:
    /// every contribution counts by its samples alone.
    pub rating: Option<Policy>,
    /// At most this many contributions are aggregated a round, from the best-rated
    /// participants; 0: all.
    pub aggregate_max: usize,
    /// At most this many participants a round, the best-rated workers; 0: all.
    pub max_participants: usize,
    /// Participants are untrusted: once half of a round's participants answered, it
    /// waits at most `deadline_factor` × the time that took (a few that hold their
    /// contributions back cannot stretch rounds to the deadline). Also with `rating`.
    pub untrusted: bool,
    /// A contribution whose sketch has at least this cosine with another accepted
    /// contribution of its round, or with the last round's update, is a copy and
    /// refused ([`super::sketch`]; above 1: off).
    pub similarity: f64,
    /// The key of the sketches' hash: the shepherd's secret.
    pub sketch_key: u64,
}

/// The settings of an overlapping run ([`Config::overlap`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Overlap {
    /// τ, the most inner steps a worker runs a round.
    pub tau: u64,
    /// The round's compute budget is this × τ × the median time per inner step.
    pub budget_factor: f64,
    /// How long a round's announcement takes to reach the workers (their
    /// heartbeat interval and a trip), milliseconds: a time-boxed round closes
    /// this long before the workers would wait for the next one (at most a
    /// quarter of the round's budget).
    pub notice_ms: u64,
}

impl Overlap {
    /// Budgets of τ × the median step time, and a second's notice.
    pub fn new(tau: u64) -> Self {
        Self { tau, budget_factor: 1.0, notice_ms: 1_000 }
    }
}

impl Default for Config {
    fn default() -> Self {
        Self {
            rounds: 10,
            start_workers: 1,
            resume_grace_ms: 5_000,
            min_quorum: 1,
            initial_deadline_ms: 120_000,
            min_deadline_ms: 5_000,
            max_deadline_ms: 600_000,
            deadline_factor: 2.0,
            deadline_window: 5,
            heartbeat_timeout_ms: 15_000,
            outer_lr: 0.7,
            outer_momentum: 0.9,
            norm_factor: 1.0,
            trim: 0.0,
            sparse: None,
            add_threads: 1,
            fragments: Vec::new(),
            overlap: None,
            sample_unit: 0,
            max_steps: 0,
            tensor_factor: f64::INFINITY,
            element_factor: f64::INFINITY,
            rating: None,
            aggregate_max: 0,
            max_participants: 0,
            untrusted: false,
            similarity: f64::INFINITY,
            sketch_key: 0,
        }
    }
}

/// A closed round.
#[derive(Clone, Debug, PartialEq)]
pub struct RoundSummary<P> {
    /// The round.
    pub round: u64,
    /// Who contributed.
    pub contributors: Vec<P>,
    /// Participants who did not contribute by the deadline.
    pub excluded: Vec<P>,
    /// Sample-weighted mean of the workers' inner losses.
    pub mean_loss: f64,
    /// Contributions scaled down by the norm bound.
    pub clipped: usize,
    /// The contributions scaled down to the norm bound, each with its norm.
    pub scaled: Vec<(P, f64)>,
    /// The norm bound used.
    pub norm_bound: f64,
    /// From opening to closing.
    pub duration_ms: u64,
    /// A sparse run's update (θ_before − θ_after, [`sparse`] format), to publish.
    pub update: Option<Vec<u8>>,
    /// Overlap: workers whose contribution for the previous round arrived after it
    /// closed and was averaged into this one.
    pub carried: Vec<P>,
    /// Overlap: the round's compute budget, if it had one.
    pub budget_ms: Option<u64>,
    /// Contributions the per-tensor bounds changed: (peer, values clipped, tensors
    /// scaled down).
    pub bounded: Vec<(P, u64, usize)>,
    /// Contributions counted at less than full trust: (peer, factor, whether it was
    /// on probation; else its rating was below the median).
    pub discounted: Vec<(P, f64, bool)>,
    /// It closed because its deadline passed (with a quorum), not because every
    /// live participant had answered.
    pub at_deadline: bool,
}

/// Why a worker left.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LeaveReason {
    /// It said so.
    Left,
    /// No heartbeat within the timeout.
    Timeout,
}

/// What the shepherd asks its host to do.
#[derive(Clone, Debug, PartialEq)]
pub enum Action<P> {
    /// Publish the parameters and announce `round` to `participants`.
    OpenRound {
        /// The round.
        round: u64,
        /// Unix milliseconds.
        deadline_ms: u64,
        /// Who is expected to contribute.
        participants: Vec<P>,
    },
    /// A contribution was refused (for the events stream).
    Rejected {
        /// From whom.
        peer: P,
        /// For which round.
        round: u64,
        /// Why.
        reason: Rejection,
    },
    /// A round closed and the parameters moved: checkpoint now.
    RoundCompleted(RoundSummary<P>),
    /// A new worker.
    WorkerJoined(P),
    /// A worker is gone.
    WorkerLeft {
        /// Who.
        peer: P,
        /// Why.
        reason: LeaveReason,
    },
    /// The round deadline passed below quorum and was extended.
    DeadlineExtended {
        /// The round.
        round: u64,
        /// The new deadline.
        deadline_ms: u64,
    },
    /// A contribution summed by aggregators ([`Input::Reported`]) was added to
    /// the round at the bound in force: the host numbers it
    /// ([`super::aggregation::Collect::accept`]) and passes it to the aggregators.
    Added {
        /// The round.
        round: u64,
        /// Whose.
        peer: P,
        /// The round it was made for: `round`, or the one before it, carried over.
        of: u64,
        /// Its weight in the mean.
        weight: f64,
        /// Its bounded norm.
        norm: f64,
        /// The norm bound it is held to.
        bound: f64,
    },
    /// An aggregated round closed with `count` contributions added by its
    /// aggregators: the host gathers their mean and hands it back
    /// ([`Input::Aggregated`]); the parameters move, and the next round opens,
    /// then.
    Aggregate {
        /// The round.
        round: u64,
        /// Contributions the aggregators added.
        count: u64,
    },
    /// Every round is done.
    Finished,
}

/// A contribution the round holds before adding it: its tensors, or (summed by
/// aggregators) what they reported of them.
#[derive(Clone, Debug, PartialEq)]
enum Held {
    Local(Delta),
    /// What its aggregators reported, and the round it was made for.
    Remote(Report, u64),
}

/// An accepted contribution, once added to the round's sum.
#[derive(Clone, Debug, PartialEq)]
struct Entry {
    samples: u64,
    loss: f32,
    norm: f64,
    /// Its weight in the mean: samples × trust factor.
    weight: f64,
    /// Its sender was on probation when it arrived.
    probation: bool,
    /// It was screened (the score screen passed it, or the run has none): it can
    /// be a reference ([`reference`]).
    screened: bool,
}

/// A screened, accepted contribution as a reference: its sender, samples, raw
/// norm, its sender's earned weight when it arrived, and whether its samples are
/// earned (its norm is at least [`reference::EARNING_FLOOR`] of the reference).
#[derive(Clone, Debug, PartialEq)]
struct Reference<P> {
    peer: P,
    samples: u64,
    norm: f64,
    weight: f64,
    earns: bool,
}

#[derive(Clone, Debug, PartialEq)]
struct OpenRound<P> {
    started_ms: u64,
    deadline_ms: u64,
    participants: BTreeSet<P>,
    answered: BTreeSet<P>,
    accepted: BTreeMap<P, Entry>,
    /// Overlap: contributions for the previous round carried into this one.
    carried: BTreeMap<P, Entry>,
    /// Overlap: the compute budget.
    budget_ms: Option<u64>,
    /// Overlap: the milliseconds per inner step the shepherd saw of the screened
    /// contributions accepted, with their senders' earned weights, and when those
    /// in time were sent, from their [`Timing`].
    step_ms: Vec<(f64, f64)>,
    sent_ms: Vec<u64>,
    /// Overlap: the deadline was set from the sends of half the participants.
    settled: bool,
    /// Overlap: when the median worker's steps of this round should end.
    steps_end_ms: Option<u64>,
    /// The raw norms accepted so far.
    norms: Vec<f64>,
    /// The finite norms of the previous round and of this one so far, sorted: the
    /// running bound's median without sorting them again for every contribution.
    pool: Vec<f64>,
    /// The bounded, weighted sum of what was added.
    mean: RunningMean,
    /// Contributions not added yet: the first of a run (no bound yet), or all of
    /// them with the trimmed mean.
    held: Vec<(P, Entry, Held)>,
    /// The contributions summed by aggregators.
    remote: close::Remote<P>,
    /// Contributions scaled down to the bound, with their norms.
    scaled: Vec<(P, f64)>,
    /// The last bound applied.
    bound: f64,
    /// The per-tensor bounds of this round's contributions.
    bounds: Bounds,
    /// The median rating of the participants that are rated, when it opened.
    median_rating: Option<f64>,
    /// `--aggregate-max`: the participants whose contributions are aggregated.
    selected: Option<BTreeSet<P>>,
    /// Per-tensor (norm, largest magnitude) of the screened, accepted contributions,
    /// with their senders' earned weights: the next bounds' reference.
    stats: Vec<(f64, Vec<(f64, f32)>)>,
    /// Contributions the per-tensor bounds changed.
    bounded: Vec<(P, u64, usize)>,
    /// Contributions counted at a trust factor below 1 (and whether on probation).
    discounted: Vec<(P, f64, bool)>,
    /// The screened, accepted contributions: the next norm bound's reference and
    /// the work their senders earn.
    references: Vec<Reference<P>>,
    /// The participants rated (out of probation) when it opened.
    rated: BTreeSet<P>,
    /// The deadline rules that fired ([`Self::probation_grace`]).
    cut: Cut,
    /// Bytes of `held`.
    held_bytes: usize,
    /// Sketches of the contributions accepted (copies are refused).
    sketches: Vec<Sketch>,
}

/// The shepherd.
#[derive(Clone, Debug)]
pub struct Shepherd<P> {
    config: Config,
    sizes: Vec<usize>,
    params: Tensors,
    outer: Outer,
    completed: u64,
    open: Option<OpenRound<P>>,
    finished: bool,
    workers: BTreeMap<P, u64>,
    /// No worker was last seen before this: `expire` scans only once one may
    /// have timed out, so an input costs O(log workers), not O(workers).
    earliest_seen: u64,
    durations: VecDeque<u64>,
    norms: VecDeque<f64>,
    /// With fragments: each fragment's last round's norms (its bound's start).
    fragment_norms: BTreeMap<usize, Vec<f64>>,
    /// Rounds completed when this shepherd started, and its first input's time.
    start: Start,
    /// Overlap: the round closed last, whose late contributions are carried over.
    previous: Option<Closed<P>>,
    /// Overlap: a time-boxed round and the median send of its contributions, from
    /// its settled deadline ([`Self::settle`]).
    sent_ms: Option<(u64, u64)>,
    /// Ratings from the screen.
    ratings: Ratings<P>,
    /// Earned work, the step time's and each tensor's reference ([`reference`]).
    refs: References<P>,
    /// Whether the last round's norms ([`Self::norms`]) are rated peers' only: the
    /// running bound then does not take this round's arrivals in.
    rated_norms: bool,
    /// When each worker joined (the ranking's seniority among unrated peers).
    joined: BTreeMap<P, u64>,
    /// An aggregated round closed and waiting for its aggregators' mean.
    pending: Option<close::Pending<P>>,
}

/// The deadline rules of [`Shepherd::probation_grace`] that fired in a round.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Cut {
    /// Every rated participant answered: the deadline gives those on probation a grace.
    graced: bool,
    /// Half the participants answered: the deadline was cut to a factor of that time.
    halved: bool,
}

/// When a shepherd started.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Start {
    /// Rounds completed then (non-zero after a resume).
    resumed_at: u64,
    /// The time of the first input.
    first_input_ms: Option<u64>,
}

/// Overlap: the last closed round, for the contributions carried over from it.
#[derive(Clone, Debug, PartialEq)]
struct Closed<P> {
    round: u64,
    participants: BTreeSet<P>,
    /// Who answered it (in time, carried or refused): no second contribution.
    answered: BTreeSet<P>,
}

impl<P: Ord + Clone> Shepherd<P> {
    /// A shepherd starting from `params`.
    pub fn new(config: Config, params: Tensors) -> Self {
        let sizes: Vec<usize> = params.iter().map(Vec::len).collect();
        let outer = match config.sparse {
            Some(s) => Outer::Sparse { lr: config.outer_lr, feedback: ErrorFeedback::new(&sizes, 1.0, s.down()) },
            None => Outer::Nesterov(Nesterov::new(config.outer_lr, config.outer_momentum, &params)),
        };
        let ratings = Ratings::new(config.rating.unwrap_or_default());
        Self {
            config,
            sizes,
            params,
            outer,
            completed: 0,
            open: None,
            finished: false,
            workers: BTreeMap::new(),
            earliest_seen: u64::MAX,
            durations: VecDeque::new(),
            norms: VecDeque::new(),
            fragment_norms: BTreeMap::new(),
            start: Start::default(),
            previous: None,
            sent_ms: None,
            ratings,
            refs: References::new(),
            rated_norms: false,
            joined: BTreeMap::new(),
            pending: None,
        }
    }

    /// The tensor sizes of round `round`'s contributions: its fragment's, the other
    /// tensors empty (every tensor without fragments).
    pub fn round_sizes(&self, round: u64) -> std::borrow::Cow<'_, [usize]> {
        match self.config.fragments.len() {
            0 | 1 => std::borrow::Cow::Borrowed(&self.sizes),
            p => {
                let range = &self.config.fragments[super::fragments::of_round(round, p)];
                std::borrow::Cow::Owned(super::fragments::masked(&self.sizes, range))
            }
        }
    }

    /// The norms round `round`'s bound starts from: the last round's, or with
    /// fragments the last round's of the same fragment (their sizes differ).
    fn previous_norms(&self, round: u64) -> Vec<f64> {
        match self.config.fragments.len() {
            0 | 1 => self.norms.iter().copied().collect(),
            p => self.fragment_norms.get(&super::fragments::of_round(round, p)).cloned().unwrap_or_default(),
        }
    }

    /// Current parameters.
    pub fn params(&self) -> &Tensors {
        &self.params
    }

    /// The outer optimizer's momentum: [`Shepherd::snapshot`]'s `velocity`, not copied.
    pub fn velocity(&self) -> &Tensors {
        self.outer.state()
    }

    /// The recent round durations and norms [`Shepherd::snapshot`] records.
    pub fn history(&self) -> (Vec<u64>, Vec<f64>) {
        (self.durations.iter().copied().collect(), self.norms.iter().copied().collect())
    }

    /// Moves the open round's deadline `by_ms` later, and returns it: a host that
    /// held the round's announcement back (until the candidates hold the state it
    /// names) gives its workers the time it waited.
    pub fn postpone(&mut self, by_ms: u64) -> Option<u64> {
        let open = self.open.as_mut()?;
        open.deadline_ms = open.deadline_ms.saturating_add(by_ms);
        Some(open.deadline_ms)
    }

    /// The host heard from `peers` at `now_ms` without handling their heartbeats one
    /// by one (it was too busy to answer them): their last sightings move to
    /// `now_ms`, with nothing else decided. Unknown peers are ignored.
    pub fn heard(&mut self, peers: impl IntoIterator<Item = P>, now_ms: u64) {
        for peer in peers {
            if let Some(seen) = self.workers.get_mut(&peer) {
                *seen = (*seen).max(now_ms);
            }
        }
    }

    /// The host heard no one for `ms` (it was busy with one input, closing a round
    /// say): every worker's last sighting moves `ms` later, so that the shepherd's
    /// own deafness is not taken for its workers' silence. A shepherd that spends
    /// longer closing a round than the heartbeat timeout would otherwise drop every
    /// worker of the run at the next input.
    pub fn excuse(&mut self, ms: u64) {
        for seen in self.workers.values_mut() {
            *seen = seen.saturating_add(ms);
        }
        if self.earliest_seen != u64::MAX {
            self.earliest_seen = self.earliest_seen.saturating_add(ms);
        }
    }

    /// Overlap: the open round's compute budget (announce it with the round: a
    /// worker stops its inner steps at τ or the budget, whichever comes first).
    /// `None`: no budget yet (before any timing) or a lockstep run.
    pub fn budget_ms(&self) -> Option<u64> {
        self.open.as_ref().and_then(|o| o.budget_ms)
    }

    /// Overlap: when the median worker's inner steps of the open round should end
    /// (the median send of the last round's contributions plus the budget), to
    /// announce with the round: a worker trained ahead stops its steps there even
    /// before the budget, so that one that fell behind catches up instead of
    /// drifting later round after round. `None` before the first settled round.
    pub fn steps_end_ms(&self) -> Option<u64> {
        self.open.as_ref().and_then(|o| o.steps_end_ms)
    }

    /// The open round's deadline, Unix milliseconds: an overlapping run's moves
    /// earlier once half the participants were accepted (module docs), and the host
    /// should then tick the state machine at the new one.
    pub fn deadline_ms(&self) -> Option<u64> {
        self.open.as_ref().map(|o| o.deadline_ms)
    }

    /// The open round, if any.
    pub fn open_round(&self) -> Option<u64> {
        self.open.as_ref().map(|_| self.completed + 1)
    }

    /// Its settings.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Rounds completed.
    pub fn completed(&self) -> u64 {
        self.completed
    }

    /// Live workers.
    pub fn workers(&self) -> impl Iterator<Item = &P> {
        self.workers.keys()
    }

    /// Whether every round is done.
    pub fn is_finished(&self) -> bool {
        self.finished
    }

    /// The ratings the screen has set.
    pub fn ratings(&self) -> &Ratings<P> {
        &self.ratings
    }

    /// Whether `peer`'s contribution to `round` is refused unscreened: the screen
    /// caught it lately (ratings on; [`Ratings::sits_out`]). A host asks before it
    /// spends its screen on the contribution.
    pub fn sits_out(&self, peer: &P, round: u64) -> bool {
        self.config.rating.is_some() && self.ratings.sits_out(peer, round)
    }

    /// Whether `peer`'s contribution must be screened whatever the sampling: it is
    /// on probation (ratings on).
    pub fn must_screen(&self, peer: &P) -> bool {
        self.config.rating.is_some() && self.ratings.on_probation(peer)
    }

    /// Whether `peer`'s contribution to `round` is owed a screen whatever the
    /// budget: it is back on probation after sitting out a catch
    /// ([`Ratings::returning`]).
    pub fn screen_owed(&self, peer: &P, round: u64) -> bool {
        self.config.rating.is_some() && self.ratings.returning(peer, round)
    }

    /// Checks a contribution's claimed samples against the manifest: whole inner
    /// steps of `sample_unit`, at most `max_steps` of them.
    pub fn check_samples(&self, samples: u64) -> Result<(), Rejection> {
        if samples == 0 {
            return Err(Rejection::NoSamples);
        }
        let unit = self.config.sample_unit;
        if unit == 0 {
            return Ok(());
        }
        let max = unit.saturating_mul(self.config.max_steps.max(1));
        if samples > max || !samples.is_multiple_of(unit) {
            return Err(Rejection::Samples { claimed: samples, unit, max });
        }
        Ok(())
    }

    /// The global norm bound a contribution of `norm` arriving now is held to
    /// (as [`Self::accept`] would compute it).
    fn bound_now(&self, open: &OpenRound<P>, norm: f64) -> f64 {
        let factor = self.config.norm_factor;
        let mut pool = open.pool.clone();
        if !self.rated_norms && norm.is_finite() {
            let at = pool.partition_point(|n| n.total_cmp(&norm).is_lt());
            pool.insert(at, norm);
        }
        match pool.get(pool.len().saturating_sub(1) / 2) {
            Some(median) => factor * median,
            None => f64::INFINITY,
        }
    }

    /// Advances the state machine.
    pub fn handle(&mut self, input: Input<P>, now_ms: u64) -> Vec<Action<P>> {
        let mut actions = Vec::new();
        self.start.first_input_ms.get_or_insert(now_ms);
        let Some(input) = self.hold_late(input) else { return actions };
        match input {
            Input::Joined(peer) => {
                self.earliest_seen = self.earliest_seen.min(now_ms);
                if self.workers.insert(peer.clone(), now_ms).is_none() {
                    self.joined.insert(peer.clone(), now_ms);
                    actions.push(Action::WorkerJoined(peer));
                }
            }
            Input::Heartbeat(peer) => {
                if let Some(seen) = self.workers.get_mut(&peer) {
                    *seen = now_ms;
                }
            }
            Input::Left(peer) => self.remove(peer, LeaveReason::Left, &mut actions),
            Input::Contribution { peer, round, samples, loss, delta, timing, screen } => {
                let held = Held::Local(delta);
                self.contribution(peer, round, (samples, loss), held, timing, screen, now_ms, &mut actions);
            }
            Input::Reported { peer, round, samples, loss, report, timing, screen } => {
                let held = Held::Remote(report, round);
                self.contribution(peer, round, (samples, loss), held, timing, screen, now_ms, &mut actions);
            }
            Input::Aggregated { round, mean } => self.aggregated(round, mean, now_ms, &mut actions),
            Input::Malformed { peer, round, reason } => {
                let caught = matches!(reason, Rejection::NoImprovement { .. } | Rejection::SmallImprovement { .. });
                if caught && self.config.rating.is_some() {
                    let weak = matches!(reason, Rejection::SmallImprovement { .. });
                    if weak { self.ratings.caught_weak(&peer, round) } else { self.ratings.caught(&peer, round) }
                }
                if caught {
                    self.refs.earned.forfeit(&peer);
                }
                self.reject(peer, round, reason, &mut actions);
            }
            Input::Tick => {}
        }
        self.tell_added(&mut actions);
        self.expire(now_ms, &mut actions);
        self.progress(now_ms, &mut actions);
        actions
    }

    /// A contribution, whole or summed by aggregators: refused, or accepted and
    /// added (or held) ([`Self::accept`]).
    #[allow(clippy::too_many_arguments)]
    fn contribution(
        &mut self,
        peer: P,
        round: u64,
        (samples, loss): (u64, f32),
        held: Held,
        timing: Option<Timing>,
        screen: Screen,
        now_ms: u64,
        actions: &mut Vec<Action<P>>,
    ) {
        if let Some(seen) = self.workers.get_mut(&peer) {
            *seen = now_ms;
        }
        // only overlapping runs learn from how contributions were made
        let timing = timing.filter(|_| self.config.overlap.is_some());
        let score = screen.improvement();
        let result = self.admit(&peer, round).and_then(|carried| {
            if self.sits_out(&peer, round) {
                let until = self.ratings.get(&peer).map_or(round, |r| r.sits_out_until);
                return Err(Rejection::SitsOut { until });
            }
            self.check_samples(samples)?;
            // a carried contribution has its round's shape: the same without fragments
            let sizes = self.round_sizes(self.completed + 1);
            let norm = match &held {
                Held::Local(delta) => delta.validate(&sizes)?,
                Held::Remote(report, _) => report.validate(&sizes)?,
            };
            // no work: a zero update counts for nothing and would only dilute the mean
            if norm == 0.0 {
                return Err(Rejection::Empty);
            }
            Ok((norm, carried))
        });
        let result = result.and_then(|(norm, carried)| {
            let sketch = match &held {
                Held::Local(delta) => self.check_copy(delta)?,
                Held::Remote(..) => None,
            };
            Ok((norm, carried, sketch))
        });
        match result {
            Ok((norm, carried, sketch)) => {
                let (factor, selected) = self.trust(&peer);
                let probation = self.config.rating.is_some() && self.ratings.on_probation(&peer);
                if let Some(improvement) = score.filter(|_| self.config.rating.is_some()) {
                    self.ratings.passed(&peer, round, improvement);
                }
                if !selected {
                    let max = self.config.aggregate_max;
                    self.reject(peer, round, Rejection::NotSelected { max }, actions);
                } else {
                    let sent_ms = timing.map(|t| now_ms.saturating_sub(t.transfer_ms));
                    let weight = samples as f64 * factor;
                    let screened = self.config.rating.is_none() || score.is_some();
                    let entry = Entry { samples, loss, norm, weight, probation, screened };
                    // the step time: its claim over the steps its samples make (the
                    // claimed steps only in tests that check no samples), at most
                    // what the shepherd saw (reference.rs)
                    let steps = match self.config.sample_unit {
                        0 => timing.map_or(0, |t| t.steps),
                        unit => samples / unit,
                    };
                    let opened = self.open.as_ref().map(|o| o.started_ms);
                    let seen = self.refs.observed_step_ms(&peer, round, carried, now_ms, opened, steps);
                    let claimed = timing.filter(|_| steps > 0).map(|t| t.train_ms as f64 / steps as f64);
                    let step_ms = claimed.map(|c| seen.map_or(c, |s| c.min(reference::SEEN_FACTOR * s)));
                    self.refs.arrived(peer.clone(), round, now_ms);
                    if let (Some(sketch), Some(open)) = (sketch, self.open.as_mut()) {
                        open.sketches.push(sketch);
                    }
                    self.accept(peer, entry, held, carried, step_ms, sent_ms);
                }
            }
            Err(reason) => self.reject(peer, round, reason, actions),
        }
    }

    /// `peer`'s trust factor in the open round, and whether the round aggregates
    /// its contribution (`--aggregate-max`).
    fn trust(&self, peer: &P) -> (f64, bool) {
        let Some(open) = self.open.as_ref() else { return (1.0, true) };
        let selected = open.selected.as_ref().is_none_or(|s| s.contains(peer));
        let factor = match self.config.rating {
            Some(_) => self.ratings.factor(peer, open.median_rating),
            None => 1.0,
        };
        (factor, selected)
    }

    /// Adds a validated contribution (`carried`: the previous round's, late) to the
    /// open round's sum, or holds it while the round has no bound yet (or for the
    /// trimmed mean).
    fn accept(&mut self, peer: P, entry: Entry, held: Held, carried: bool, step_ms: Option<f64>, sent_ms: Option<u64>) {
        let round = self.completed + 1;
        let no_previous = self.previous_norms(round).is_empty();
        let sizes = self.round_sizes(round).into_owned();
        let (factor, trim) = (self.config.norm_factor, self.config.trim > 0.0);
        let earned = self.refs.earned.weight(&peer);
        let floor = lower_median(&self.previous_norms(round)).map_or(0.0, |r| r * reference::EARNING_FLOOR);
        let per_tensor = self.config.tensor_factor.is_finite() || self.config.element_factor.is_finite();
        let rated_pool = self.rated_norms;
        let untrusted = self.config.untrusted;
        let Some(open) = self.open.as_mut() else { return };
        // the per-tensor bounds, one contribution at a time; the raw statistics are
        // the next round's reference
        let (held, bounded_norm) = match held {
            Held::Local(delta) if per_tensor => {
                if entry.screened {
                    open.stats.push((earned, delta.tensor_stats()));
                }
                let (delta, norm, clipping) = delta.bounded(&open.bounds);
                if clipping.any() {
                    open.bounded.push((peer.clone(), clipping.elements, clipping.tensors));
                }
                (Held::Local(delta), norm)
            }
            // its aggregators bounded it by this round's bounds, and reported its raw statistics
            Held::Remote(report, of) if per_tensor => {
                let norm = report.bounded_norm;
                if entry.screened {
                    open.stats.push((earned, report.raw.clone()));
                }
                (Held::Remote(report, of), norm)
            }
            held => (held, entry.norm),
        };
        if entry.weight < entry.samples as f64 {
            open.discounted.push((peer.clone(), entry.weight / entry.samples.max(1) as f64, entry.probation));
        }
        if let Some(ms) = step_ms.filter(|_| entry.screened) {
            open.step_ms.push((ms, earned));
        }
        if let Some(sent) = sent_ms.filter(|_| !carried) {
            open.sent_ms.push(sent);
        }
        open.norms.push(entry.norm);
        if entry.screened {
            let (samples, norm, earns) = (entry.samples, entry.norm, entry.norm >= floor);
            let reference = Reference { peer: peer.clone(), samples, norm, weight: earned, earns };
            open.references.push(reference);
        }
        // the pool is the last round's rated norms alone when it has them (untrusted:
        // the last round's norms whenever there are any): the first to arrive cannot
        // drag the bound down
        if entry.norm.is_finite() && entry.norm > 0.0 && !rated_pool && (no_previous || !untrusted) {
            let at = open.pool.partition_point(|n| n.total_cmp(&entry.norm).is_lt());
            open.pool.insert(at, entry.norm);
        }
        if carried {
            if let Some(previous) = self.previous.as_mut() {
                previous.answered.insert(peer.clone());
            }
            open.carried.insert(peer.clone(), entry.clone());
        } else {
            open.answered.insert(peer.clone());
            open.accepted.insert(peer.clone(), entry.clone());
        }
        let entry = Entry { norm: bounded_norm, ..entry };
        if let Held::Local(delta) = &held {
            open.held_bytes += delta.len_bytes();
        }
        open.held.push((peer, entry, held));
        // `running_bound` over the previous round's norms and this one's, kept sorted;
        // without a previous round an untrusted one holds its contributions until it
        // closes (up to FIRST_ROUND_HOLD bytes), so that a few tiny ones that arrive
        // first cannot set the bound for the rest
        let waiting = match untrusted {
            true => no_previous && open.held_bytes < FIRST_ROUND_HOLD,
            false => no_previous && open.norms.len() < 2,
        };
        let median = open.pool.get(open.pool.len().saturating_sub(1) / 2).copied();
        if !trim
            && !waiting
            && let Some(median) = median
        {
            Self::flush(open, factor * median, &sizes);
        }
    }

    /// Adds every held contribution to the sum, bounded by `bound`.
    fn flush(open: &mut OpenRound<P>, bound: f64, sizes: &[usize]) {
        open.bound = bound;
        open.held_bytes = 0;
        for (peer, e, held) in std::mem::take(&mut open.held) {
            let scaled = match held {
                Held::Local(delta) => open.mean.push(delta, e.weight, e.norm, bound, sizes),
                // its aggregators add it as the mean would ([`super::aggregation::ShardSum`])
                Held::Remote(_, of) => {
                    open.remote.added.push((peer.clone(), of, e.weight, e.norm, bound));
                    open.remote.count += 1;
                    e.norm > bound
                }
            };
            if scaled {
                open.scaled.push((peer, e.norm));
            }
        }
    }

    fn reject(&mut self, peer: P, round: u64, reason: Rejection, actions: &mut Vec<Action<P>>) {
        // A participant whose answer was refused is not waited for again.
        let current = self.completed + 1;
        if let Some(open) = self.open.as_mut().filter(|o| round == current && o.participants.contains(&peer)) {
            open.answered.insert(peer.clone());
        }
        // nor is a late one carried over after a refusal
        if let Some(previous) = self.previous.as_mut().filter(|p| p.round == round && p.participants.contains(&peer)) {
            previous.answered.insert(peer.clone());
        }
        actions.push(Action::Rejected { peer, round, reason });
    }

    /// Whether `peer` may contribute for `round` now: `Ok(false)` to the open
    /// round, `Ok(true)` carried over from the previous one (overlap).
    fn admit(&self, peer: &P, round: u64) -> Result<bool, Rejection> {
        let current = self.completed + 1;
        let carry = self.config.overlap.is_some() && self.config.fragments.len() <= 1 && self.open.is_some();
        if let Some(previous) = self.previous.as_ref().filter(|p| carry && round + 1 == current && p.round == round) {
            if !previous.participants.contains(peer) {
                return Err(Rejection::NotParticipant { round });
            }
            let again = self.open.as_ref().is_some_and(|o| o.carried.contains_key(peer));
            if again || previous.answered.contains(peer) {
                return Err(Rejection::Duplicate { round });
            }
            return Ok(true);
        }
        if round <= self.completed {
            return Err(Rejection::Late { round });
        }
        let Some(open) = self.open.as_ref().filter(|_| round == current) else {
            return Err(Rejection::WrongRound { got: round, current });
        };
        if !open.participants.contains(peer) {
            return Err(Rejection::NotParticipant { round });
        }
        if open.answered.contains(peer) {
            return Err(Rejection::Duplicate { round });
        }
        Ok(false)
    }

    fn remove(&mut self, peer: P, reason: LeaveReason, actions: &mut Vec<Action<P>>) {
        self.refs.left(&peer);
        if self.workers.remove(&peer).is_some() {
            actions.push(Action::WorkerLeft { peer, reason });
        }
    }

    fn expire(&mut self, now_ms: u64, actions: &mut Vec<Action<P>>) {
        let timeout = super::liveness::timeout_ms(self.config.heartbeat_timeout_ms, self.workers.len());
        if now_ms.saturating_sub(self.earliest_seen) <= timeout {
            return;
        }
        let dead: Vec<P> = self
            .workers
            .iter()
            .filter(|(_, seen)| now_ms.saturating_sub(**seen) > timeout)
            .map(|(p, _)| p.clone())
            .collect();
        self.earliest_seen = self
            .workers
            .iter()
            .filter(|(_, seen)| now_ms.saturating_sub(**seen) <= timeout)
            .map(|(_, seen)| *seen)
            .min()
            .unwrap_or(u64::MAX);
        for peer in dead {
            self.remove(peer, LeaveReason::Timeout, actions);
        }
    }

    fn deadline(&self) -> u64 {
        if self.durations.is_empty() {
            return self.config.initial_deadline_ms;
        }
        let mut recent: Vec<u64> = self.durations.iter().copied().collect();
        recent.sort_unstable();
        let median = recent[recent.len() / 2] as f64;
        ((self.config.deadline_factor * median) as u64).clamp(self.config.min_deadline_ms, self.config.max_deadline_ms)
    }

    /// Overlap: the next round's compute budget, τ × factor × the step time's
    /// reference ([`reference`]; `None` before any, or under a millisecond).
    fn budget(&self) -> Option<u64> {
        let overlap = self.config.overlap?;
        let median = self.refs.step_ms?;
        let budget = (overlap.tau as f64 * overlap.budget_factor * median).min(self.config.max_deadline_ms as f64);
        Some(budget as u64).filter(|b| *b > 0)
    }

    /// Overlap: a time-boxed round's deadline until half its participants were accepted:
    /// two budgets after it opened (within the bounds), then
    /// [`Self::settle`]'s.
    fn boxed_deadline(&self, now_ms: u64, budget_ms: u64) -> u64 {
        let wait = budget_ms.saturating_mul(2).clamp(self.config.min_deadline_ms, self.config.max_deadline_ms);
        now_ms.saturating_add(wait)
    }

    /// Overlap: once half the participants of a time-boxed round were accepted, its
    /// deadline becomes the median send of their contributions plus the budget,
    /// less [`Self::lead_ms`]: when the median worker, which started the next round's
    /// steps at its send, will be done with them, less the time the close and the
    /// next round's announcement take to reach it. Waiting for the slow links until then costs
    /// no worker any compute; what comes later is carried over. (Never later than
    /// the deadline it had, and after now: a round settled past that time closes at
    /// the next input, not in the one that settled it, so that its host first holds
    /// it for contributions already on their way, as at any deadline.)
    fn settle(&mut self, now_ms: u64) {
        let round = self.completed + 1;
        let Some(budget) = self.open.as_ref().and_then(|o| o.budget_ms.filter(|_| !o.settled)) else { return };
        let lead = self.lead_ms(budget);
        let Some(open) = self.open.as_mut() else { return };
        // half of them taken in time, not merely answered: refused junk sent the
        // instant a round opens would otherwise settle it on the first honest
        // sends, and every later honest contribution would be carried or late
        if open.accepted.len() * 2 < open.participants.len() {
            return;
        }
        open.settled = true;
        open.sent_ms.sort_unstable();
        if let Some(sent) = open.sent_ms.get(open.sent_ms.len() / 2) {
            let deadline = sent.saturating_add(budget).saturating_sub(lead).max(now_ms + 1);
            open.deadline_ms = open.deadline_ms.min(deadline);
            self.sent_ms = Some((round, *sent));
        }
    }

    fn progress(&mut self, now_ms: u64, actions: &mut Vec<Action<P>>) {
        if self.finished {
            return;
        }
        self.settle(now_ms);
        self.probation_grace(now_ms);
        if let Some(open) = &self.open {
            let waiting = open.participants.iter().any(|p| self.workers.contains_key(p) && !open.answered.contains(p));
            let quorum = open.accepted.len() + open.carried.len() >= self.config.min_quorum.max(1);
            // everyone answered: close, even with every contribution rejected (the
            // round then leaves the parameters as they were and the run goes on)
            let everyone = !waiting && !open.answered.is_empty();
            // every participant left before answering, and others are here: the round
            // opens again for them (extending it would wait for the gone forever)
            let orphaned = open.answered.is_empty()
                && open.carried.is_empty()
                && !open.participants.iter().any(|p| self.workers.contains_key(p))
                && !self.workers.is_empty();
            if everyone || now_ms >= open.deadline_ms && quorum {
                self.close(now_ms, !everyone, actions);
            } else if orphaned && now_ms >= open.deadline_ms {
                self.open = None;
            } else if now_ms >= open.deadline_ms {
                let extended = now_ms + self.deadline();
                let round = self.completed + 1;
                if let Some(open) = self.open.as_mut() {
                    open.deadline_ms = extended;
                }
                actions.push(Action::DeadlineExtended { round, deadline_ms: extended });
            }
        }
        let waiting_for_start = if self.completed == 0 {
            true
        } else {
            let since = now_ms.saturating_sub(self.start.first_input_ms.unwrap_or(now_ms));
            self.completed == self.start.resumed_at && since < self.config.resume_grace_ms
        };
        let enough = if waiting_for_start { self.config.start_workers.max(1) } else { 1 };
        if self.open.is_none() && self.pending.is_none() && !self.finished && self.workers.len() >= enough {
            let budget_ms = self.budget();
            // the median worker started this round's steps when it sent the last round's
            let last = self.completed;
            let steps_end_ms = self.sent_ms.filter(|(r, _)| *r == last).zip(budget_ms).map(|((_, s), b)| s + b);
            let deadline_ms = budget_ms.map_or_else(|| now_ms + self.deadline(), |b| self.boxed_deadline(now_ms, b));
            let participants = self.choose_participants();
            let median_rating = self.ratings.median(participants.iter());
            let selected = match self.config.aggregate_max {
                0 => None,
                max if participants.len() <= max => None,
                max => Some(self.rank(participants.iter().cloned()).into_iter().take(max).collect()),
            };
            let bounds = self.bounds();
            let rated: BTreeSet<P> = match self.config.rating {
                Some(_) => participants.iter().filter(|p| !self.ratings.on_probation(p)).cloned().collect(),
                None => BTreeSet::new(),
            };
            let mut pool: Vec<f64> =
                self.previous_norms(self.completed + 1).into_iter().filter(|n| n.is_finite()).collect();
            pool.sort_by(f64::total_cmp);
            actions.push(Action::OpenRound {
                round: self.completed + 1,
                deadline_ms,
                participants: participants.iter().cloned().collect(),
            });
            self.open = Some(OpenRound {
                started_ms: now_ms,
                deadline_ms,
                participants,
                answered: BTreeSet::new(),
                accepted: BTreeMap::new(),
                carried: BTreeMap::new(),
                budget_ms,
                step_ms: Vec::new(),
                sent_ms: Vec::new(),
                settled: false,
                steps_end_ms,
                norms: Vec::new(),
                pool,
                mean: RunningMean::with_threads(self.config.add_threads),
                held: Vec::new(),
                remote: close::Remote::default(),
                scaled: Vec::new(),
                bound: f64::INFINITY,
                bounds,
                median_rating,
                selected,
                stats: Vec::new(),
                bounded: Vec::new(),
                discounted: Vec::new(),
                references: Vec::new(),
                rated,
                cut: Cut::default(),
                held_bytes: 0,
                sketches: Vec::new(),
            });
        }
    }

    /// Ratings on, two rules that keep untrusted participants from holding a round
    /// (forty silent Sybils, or a few that send only after the deadline, would
    /// otherwise stretch every round to its deadline, ten minutes for the first):
    ///
    /// * once half the live participants answered, the deadline is at most
    ///   `deadline_factor` × the time that took (and no less than the minimum; in
    ///   a run's first round, whose time includes compiling each worker's step,
    ///   no less than a tenth of the initial deadline);
    /// * once every rated live participant answered, those on probation have
    ///   [`PROBATION_GRACE`] of the round so far to answer.
    ///
    /// (A time-boxed round of an overlapping run settles its deadline itself.)
    fn probation_grace(&mut self, now_ms: u64) {
        if self.config.rating.is_none() && !self.config.untrusted {
            return;
        }
        let first = self.durations.is_empty();
        let min = match first {
            true => self.config.min_deadline_ms.max(self.config.initial_deadline_ms / 10),
            false => self.config.min_deadline_ms,
        };
        let factor = self.config.deadline_factor;
        let Some(open) = self.open.as_mut() else { return };
        let live = |p: &&P| self.workers.contains_key(*p);
        if !open.cut.halved && open.budget_ms.is_none() {
            let participants = open.participants.iter().filter(live).count();
            if !open.answered.is_empty() && open.answered.len() * 2 >= participants {
                open.cut.halved = true;
                let elapsed = now_ms.saturating_sub(open.started_ms);
                let wait = ((elapsed as f64 * factor) as u64).max(min);
                open.deadline_ms = open.deadline_ms.min(open.started_ms.saturating_add(wait));
            }
        }
        if open.cut.graced || open.rated.is_empty() {
            return;
        }
        if open.rated.iter().filter(live).all(|p| open.answered.contains(p)) {
            open.cut.graced = true;
            let grace = (now_ms.saturating_sub(open.started_ms) as f64 * PROBATION_GRACE) as u64;
            open.deadline_ms = open.deadline_ms.min(now_ms.saturating_add(grace));
        }
    }

    /// `peers` best first: rated before probation, by rating, then the earliest
    /// joined, then by key.
    fn rank(&self, peers: impl Iterator<Item = P>) -> Vec<P> {
        let mut ranked: Vec<(bool, f64, u64, P)> = peers
            .map(|p| {
                let score = self.ratings.get(&p).map_or(0.0, |r| r.score);
                let joined = self.joined.get(&p).copied().unwrap_or(u64::MAX);
                (self.ratings.on_probation(&p), score, joined, p)
            })
            .collect();
        ranked.sort_by(|a, b| a.0.cmp(&b.0).then(b.1.total_cmp(&a.1)).then(a.2.cmp(&b.2)).then(a.3.cmp(&b.3)));
        ranked.into_iter().map(|(_, _, _, p)| p).collect()
    }

    /// The next round's participants: every live worker, or the best-ranked
    /// `max_participants` of them.
    fn choose_participants(&self) -> BTreeSet<P> {
        match self.config.max_participants {
            max if max > 0 && self.workers.len() > max => {
                self.rank(self.workers.keys().cloned()).into_iter().take(max).collect()
            }
            _ => self.workers.keys().cloned().collect(),
        }
    }

    /// The per-tensor bounds of the next round, from each tensor's reference.
    fn bounds(&self) -> Bounds {
        let (tf, ef) = (self.config.tensor_factor, self.config.element_factor);
        if !(tf.is_finite() || ef.is_finite()) {
            return Bounds::none();
        }
        let tensor = self.refs.tensors.iter().map(|r| r.map_or(f64::INFINITY, |(n, _)| tf * n)).collect();
        let element =
            self.refs.tensors.iter().map(|r| r.map_or(f32::INFINITY, |(_, m)| (ef * f64::from(m)) as f32)).collect();
        Bounds { tensor, element }
    }
}

/// The most bytes of contributions an untrusted run's first round holds until it
/// closes (its norm bound is then the median of all of them); past it, they are
/// bounded by the median of those held.
pub const FIRST_ROUND_HOLD: usize = 128 << 20;

/// Once every rated participant answered, the share of the round so far that
/// participants on probation still have to answer (see `Shepherd::probation_grace`).
pub const PROBATION_GRACE: f64 = 0.25;

/// The lower median of the positive finite `values`, if any.
fn lower_median(values: &[f64]) -> Option<f64> {
    let mut kept: Vec<f64> = values.iter().copied().filter(|n| n.is_finite() && *n > 0.0).collect();
    kept.sort_by(f64::total_cmp);
    kept.get(kept.len().saturating_sub(1) / 2).copied()
}

#[cfg(test)]
mod sybil;
#[cfg(test)]
mod trust;

#[cfg(test)]
mod tests;
