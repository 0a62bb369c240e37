//! The close of a round: who is in, the norm bound and the references for the
//! next round, then the outer step. A round whose contributions aggregators
//! summed ([`Held::Remote`]) closes in two steps: its decisions at once, then
//! the step once the host hands back their mean ([`Input::Aggregated`]); the
//! next round opens then.

use super::*;

/// An open round's contributions summed by aggregators.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct Remote<P> {
    /// Added and not yet told the host ([`Action::Added`]): (peer, its round,
    /// weight, bounded norm, bound), in order.
    pub(super) added: Vec<(P, u64, f64, f64, f64)>,
    /// Added in all.
    pub(super) count: u64,
}

impl<P> Default for Remote<P> {
    fn default() -> Self {
        Self { added: Vec::new(), count: 0 }
    }
}

/// An aggregated round, closed and waiting for its aggregators' mean.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct Pending<P> {
    /// The mean of the contributions the shepherd added itself (carried over
    /// from the previous round), with its total weight.
    local: Option<(Tensors, f64)>,
    /// The round's summary, its update to come.
    summary: RoundSummary<P>,
    /// Contributions for the round that came while it was aggregated: carried
    /// into the next once it opens (at most one a participant).
    late: Vec<Input<P>>,
}

/// How long the last closes took: from the input that closed a round to the
/// announcement of the next, as the host reports it ([`Shepherd::announced`]).
/// A time-boxed round closes this much earlier ([`Shepherd::lead_ms`]).
#[derive(Clone, Debug, Default, PartialEq)]
pub(super) struct CloseTimes {
    /// When the round being closed was decided.
    decided_ms: Option<u64>,
    /// The last [`CLOSES_KEPT`] closes, milliseconds, oldest first.
    recent: VecDeque<u64>,
}

/// Closes [`CloseTimes`] keeps: its lower median passes over a checkpoint's close
/// (one round in ten by default) and follows a lasting change within three.
const CLOSES_KEPT: usize = 5;

impl CloseTimes {
    pub(super) fn decided(&mut self, now_ms: u64) {
        self.decided_ms = Some(now_ms);
    }

    fn announced(&mut self, now_ms: u64) {
        let Some(at) = self.decided_ms.take() else { return };
        self.recent.push_back(now_ms.saturating_sub(at));
        while self.recent.len() > CLOSES_KEPT {
            self.recent.pop_front();
        }
    }

    /// The lower median of the recent closes; 0 before any.
    pub(super) fn typical_ms(&self) -> u64 {
        let mut sorted: Vec<u64> = self.recent.iter().copied().collect();
        sorted.sort_unstable();
        sorted.get(sorted.len().saturating_sub(1) / 2).copied().unwrap_or(0)
    }
}

impl<P: Ord + Clone> Shepherd<P> {
    /// The host announced the round the last close opened, at `now_ms` (the
    /// time it took, from the input that closed the round, is the close a
    /// time-boxed round's deadline leaves room for: see [`Self::lead_ms`]).
    /// Without a close pending (the first round, a reopened one) it is ignored.
    pub fn announced(&mut self, now_ms: u64) {
        self.refs.close.announced(now_ms);
    }

    /// Overlap: how long before the median worker's steps of the next round end a
    /// time-boxed round's deadline comes, its budget `budget_ms`: the notice (at most
    /// a quarter of the budget: short rounds, a small model's, would otherwise close
    /// before anyone but the fastest is done) and the typical close, so that the
    /// next announcement reaches the median worker as its steps end instead of a
    /// close later (at most half the budget in all). What the earlier deadline
    /// leaves out is carried into the next round.
    pub(super) fn lead_ms(&self, budget_ms: u64) -> u64 {
        let notice = self.config.overlap.map_or(0, |o| o.notice_ms).min(budget_ms / 4);
        notice.saturating_add(self.refs.close.typical_ms()).min(budget_ms / 2)
    }

    /// Tells the host the aggregated contributions added since it was last told
    /// ([`Action::Added`]).
    pub(super) fn tell_added(&mut self, actions: &mut Vec<Action<P>>) {
        let round = self.completed + 1;
        if let Some(open) = self.open.as_mut() {
            Self::tell(round, &mut open.remote.added, actions);
        }
    }

    fn tell(round: u64, added: &mut Vec<(P, u64, f64, f64, f64)>, actions: &mut Vec<Action<P>>) {
        let added = std::mem::take(added).into_iter();
        let added = added.map(|(peer, of, weight, norm, bound)| Action::Added { round, peer, of, weight, norm, bound });
        actions.extend(added);
    }

    /// The open round's per-tensor bounds: what its aggregators bound slices by
    /// ([`super::super::aggregation::shard_bounds`]).
    pub fn round_bounds(&self) -> Option<&Bounds> {
        self.open.as_ref().map(|o| &o.bounds)
    }

    /// The round an aggregated close waits on, if any.
    pub fn aggregating(&self) -> Option<u64> {
        self.pending.as_ref().map(|p| p.summary.round)
    }

    /// Holds `input`, a contribution for the round being aggregated, until the
    /// next round opens (`None`); gives back any other input.
    pub(super) fn hold_late(&mut self, input: Input<P>) -> Option<Input<P>> {
        let (Input::Contribution { round, .. } | Input::Reported { round, .. }) = &input else { return Some(input) };
        let Some(pending) = self.pending.as_mut().filter(|p| p.summary.round == *round) else { return Some(input) };
        let participants = pending.summary.contributors.len() + pending.summary.excluded.len();
        if pending.late.len() < participants {
            pending.late.push(input);
        }
        None
    }

    /// The aggregators' mean of `round` ([`Input::Aggregated`]): joined with what
    /// the shepherd added itself, and applied; the next round opens, and the
    /// contributions that came meanwhile are carried into it. A mean of another
    /// shape than the round's is dropped.
    pub(super) fn aggregated(
        &mut self,
        round: u64,
        mean: Option<(Tensors, f64)>,
        now_ms: u64,
        actions: &mut Vec<Action<P>>,
    ) {
        let Some(pending) = self.pending.take_if(|p| p.summary.round == round) else { return };
        let sizes = self.round_sizes(round);
        let fits = |m: &Tensors| m.len() == sizes.len() && m.iter().zip(sizes.iter()).all(|(t, n)| t.len() == *n);
        let remote = mean.filter(|(m, t)| fits(m) && t.is_finite() && *t >= 0.0);
        let mean = join(pending.local, remote);
        self.apply(mean, pending.summary, actions);
        self.progress(now_ms, actions);
        for input in pending.late {
            actions.extend(self.handle(input, now_ms));
        }
    }

    pub(super) fn close(&mut self, now_ms: u64, at_deadline: bool, actions: &mut Vec<Action<P>>) {
        let Some(mut open) = self.open.take() else { return };
        self.refs.close.decided(now_ms);
        let round = self.completed + 1;
        let peers: Vec<P> = open.accepted.keys().cloned().collect();
        let averaged = || open.accepted.values().chain(open.carried.values());
        let samples: u64 = averaged().fold(0u64, |sum, e| sum.saturating_add(e.samples));
        let mean_loss = averaged().map(|e| f64::from(e.loss) * e.samples as f64).sum::<f64>() / samples.max(1) as f64;
        let previous = self.previous_norms(round);
        let sizes = self.round_sizes(round).into_owned();
        let bound = norm_bound(&previous, &open.norms, self.config.norm_factor);
        let local = open.held.iter().all(|(_, _, h)| matches!(h, Held::Local(_)));
        let mut total = 0.0;
        let mean = if self.config.trim > 0.0 && open.held.len() >= 3 && local {
            // the trimmed mean: every contribution was held
            let mut held = Vec::with_capacity(open.held.len());
            for (p, e, h) in std::mem::take(&mut open.held) {
                let Held::Local(d) = h else { continue };
                if e.norm > bound {
                    open.scaled.push((p, e.norm));
                }
                held.push(Accepted { samples: e.samples, delta: d.to_dense(&sizes), norm: e.norm });
            }
            open.bound = bound;
            Some(trimmed_mean(&held, bound, self.config.trim).0)
        } else {
            if !open.held.is_empty() {
                // held until the close: bounded by all of this round's norms (one alone: its own)
                Self::flush(&mut open, bound, &sizes);
            }
            let sum = std::mem::take(&mut open.mean);
            total = sum.total();
            sum.finish()
        };
        let duration_ms = now_ms.saturating_sub(open.started_ms);
        self.durations.push_back(duration_ms);
        while self.durations.len() > self.config.deadline_window.max(1) {
            self.durations.pop_front();
        }
        // the references ([`reference`]): from the screened, accepted contributions by
        // their senders' earned weights, each moved a bounded factor
        let stats = std::mem::take(&mut open.stats);
        self.refs.tensors = tensor_references(&self.refs.tensors, &stats);
        let norms: Vec<(f64, f64)> = open.references.iter().map(|r| (r.norm, r.weight)).collect();
        if let Some(norm) = reference::next_reference(&norms, lower_median(&previous)) {
            // with ratings, arrivals stay out of the pool from this close on
            self.rated_norms = self.config.rating.is_some();
            self.norms = [norm].into();
            if self.config.fragments.len() > 1 {
                let fragment = crate::diloco::fragments::of_round(round, self.config.fragments.len());
                self.fragment_norms.insert(fragment, self.norms.iter().copied().collect());
            }
        }
        let excluded = open.participants.iter().filter(|p| !open.accepted.contains_key(p)).cloned().collect();
        self.refs.earned.close_round(open.references.drain(..).filter(|r| r.earns).map(|r| (r.peer, r.samples)));
        if let Some(overlap) = self.config.overlap {
            if let Some(ms) = weighted_median(&open.step_ms) {
                let budget_steps = overlap.tau as f64 * overlap.budget_factor;
                let claimed = bounded_move(ms, self.refs.step_ms);
                self.refs.step_ms = Some(reference::paced(claimed, self.refs.step_ms, duration_ms, budget_steps));
            }
            let answered = std::mem::take(&mut open.answered);
            self.previous = Some(Closed { round, participants: std::mem::take(&mut open.participants), answered });
        }
        let summary = RoundSummary {
            round,
            contributors: peers,
            excluded,
            mean_loss,
            clipped: open.scaled.len(),
            scaled: open.scaled,
            norm_bound: open.bound,
            duration_ms,
            update: None,
            carried: open.carried.into_keys().collect(),
            budget_ms: open.budget_ms,
            at_deadline,
            bounded: open.bounded,
            discounted: open.discounted,
        };
        if open.remote.count == 0 {
            return self.apply(mean, summary, actions);
        }
        Self::tell(round, &mut open.remote.added, actions);
        actions.push(Action::Aggregate { round, count: open.remote.count });
        self.pending = Some(Pending { local: mean.map(|m| (m, total)), summary, late: Vec::new() });
    }

    /// Moves the parameters by `mean` and reports the round closed.
    fn apply(&mut self, mean: Option<Tensors>, mut summary: RoundSummary<P>, actions: &mut Vec<Action<P>>) {
        // the copy check's sketch of the update θ before − θ after (sketches are linear):
        // a sparse step's from the update itself; Nesterov's from the parameters' (kept
        // from the last close, one pass over the parameters a round)
        let (round, applied) = (summary.round, mean.is_some());
        let copies = self.config.similarity <= 1.0 && applied;
        let dense = matches!(self.outer, Outer::Nesterov(_));
        if copies && dense && self.refs.params_sketch.is_none() {
            self.refs.params_sketch = Some(Sketch::of_tensors(self.config.sketch_key, &self.params));
        }
        let threads = self.config.add_threads;
        let stepped = mean.and_then(|mean| self.outer.step(&mut self.params, &mean, round, threads));
        summary.update = stepped.map(|(bytes, sent)| {
            if copies {
                self.refs.updated(Sketch::of_sparse(self.config.sketch_key, &sent));
                let [last, older] = &mut self.refs.update_sparse;
                *older = last.replace(sent);
            }
            bytes
        });
        if copies && dense {
            let key = self.config.sketch_key;
            let after = Sketch::of_tensors(key, &self.params);
            if let Some(before) = self.refs.params_sketch.replace(after.clone()) {
                self.refs.updated(Sketch::difference(&before, &after));
            }
        }
        self.completed = summary.round;
        actions.push(Action::RoundCompleted(summary));
        if self.completed >= self.config.rounds {
            self.finished = true;
            actions.push(Action::Finished);
        }
    }
}

/// Two weighted means joined: (a·wa + b·wb) / (wa + wb).
fn join(a: Option<(Tensors, f64)>, b: Option<(Tensors, f64)>) -> Option<Tensors> {
    match (a, b) {
        (None, None) => None,
        (Some((m, _)), None) | (None, Some((m, _))) => Some(m),
        (Some((a, wa)), Some((b, wb))) if wa + wb > 0.0 => {
            let (fa, fb) = (wa / (wa + wb), wb / (wa + wb));
            let joined = a
                .iter()
                .zip(&b)
                .map(|(x, y)| x.iter().zip(y).map(|(x, y)| (f64::from(*x) * fa + f64::from(*y) * fb) as f32).collect());
            Some(joined.collect())
        }
        (Some((a, _)), Some(_)) => Some(a),
    }
}
