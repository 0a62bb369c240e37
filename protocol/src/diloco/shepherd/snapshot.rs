//! What a shepherd resumes from: its state after the last completed round, and
//! what it learned of its workers (their ratings and earned work) and of honest
//! updates (the references its bounds and budget start from), so that a resumed
//! or elected shepherd keeps every live worker's standing: a rated peer stays
//! rated, a caught one stays on probation and sits out what it owes, and no round
//! after a resume can reset a bound.
//!
//! Bounded: the ratings and earned work are the live workers' only (those of
//! keys that left are not kept; a resumed shepherd keeps those it resumed with
//! until its first round closes, so that a snapshot taken before its workers are
//! back loses nothing), at most [`MAX_RATED`] and [`MAX_EARNED`]
//! records, and the tensor references one per tensor. Not kept: the copy
//! check's sketches (their key is each shepherd's own secret) and what the
//! overlap rules learn of each worker's timing (module docs of
//! [`super`](crate::diloco::shepherd)).

use super::Shepherd;
use super::reference::MAX_EARNED;
use crate::diloco::Tensors;
use crate::diloco::rating::{MAX_RATED, Rating};

/// Everything needed to resume a shepherd after its last completed round.
#[derive(Clone, Debug, PartialEq)]
pub struct Snapshot<P> {
    /// Rounds completed.
    pub completed: u64,
    /// Current parameters.
    pub params: Tensors,
    /// Outer momentum (a sparse run: the shepherd's error feedback).
    pub velocity: Tensors,
    /// Recent round durations.
    pub durations: Vec<u64>,
    /// The norms accepted in the last round that accepted any (the next
    /// round's norm bound).
    pub norms: Vec<f64>,
    /// What it learned of its workers and of honest updates.
    pub learned: Learned<P>,
}

/// A snapshot's ratings and references ([`super::reference`]).
#[derive(Clone, Debug, PartialEq)]
pub struct Learned<P> {
    /// The live workers' ratings, by key (at most [`MAX_RATED`]).
    pub ratings: Vec<(P, Rating)>,
    /// The live workers' earned work, in samples (at most [`MAX_EARNED`]).
    pub earned: Vec<(P, f64)>,
    /// Each tensor's (norm, largest magnitude) reference: the per-tensor bounds'.
    pub tensors: Vec<Option<(f64, f32)>>,
    /// Overlap: the milliseconds an inner step takes (the budget's reference).
    pub step_ms: Option<f64>,
    /// Whether [`Snapshot::norms`] are rated peers' only (the running bound then
    /// leaves a round's arrivals out of its pool).
    pub rated_norms: bool,
}

impl<P> Default for Learned<P> {
    fn default() -> Self {
        Self { ratings: Vec::new(), earned: Vec::new(), tensors: Vec::new(), step_ms: None, rated_norms: false }
    }
}

impl<P: Ord + Clone> Shepherd<P> {
    /// Resumes from a snapshot taken after a completed round: its parameters,
    /// momentum and history, every rating and earned work it lists, and its
    /// references (non-finite values dropped, at most one per tensor).
    pub fn resume(config: super::Config, snapshot: Snapshot<P>) -> Self {
        let mut s = Self::new(config, snapshot.params);
        *s.outer.state_mut() = snapshot.velocity;
        s.completed = snapshot.completed;
        s.start.resumed_at = snapshot.completed;
        s.durations = snapshot.durations.into();
        s.norms = snapshot.norms.into();
        if s.config.fragments.len() > 1 && s.completed > 0 {
            let last = crate::diloco::fragments::of_round(s.completed, s.config.fragments.len());
            s.fragment_norms.insert(last, s.norms.iter().copied().collect());
        }
        s.finished = s.completed >= s.config.rounds;
        let learned = snapshot.learned;
        for (peer, rating) in learned.ratings.into_iter().take(MAX_RATED) {
            s.ratings.restore(peer, rating);
        }
        for (peer, work) in learned.earned.into_iter().take(MAX_EARNED) {
            s.refs.earned.restore(peer, work);
        }
        let finite = |(n, m): (f64, f32)| n.is_finite() && n > 0.0 && m.is_finite() && m > 0.0;
        s.refs.tensors = learned.tensors.into_iter().take(s.sizes.len()).map(|t| t.filter(|t| finite(*t))).collect();
        s.refs.step_ms = learned.step_ms.filter(|ms| ms.is_finite() && *ms > 0.0);
        s.rated_norms = learned.rated_norms;
        s
    }

    /// The state after the last completed round, with the live workers' ratings
    /// and earned work (until a resumed shepherd closes its first round, every
    /// one it resumed with: its workers may not be back yet).
    pub fn snapshot(&self) -> Snapshot<P> {
        Snapshot {
            completed: self.completed,
            params: self.params.clone(),
            velocity: self.outer.state().clone(),
            durations: self.durations.iter().copied().collect(),
            norms: self.norms.iter().copied().collect(),
            learned: self.learned(),
        }
    }

    /// What [`Shepherd::snapshot`] keeps of its ratings and references, without
    /// copying the parameters.
    pub fn learned(&self) -> Learned<P> {
        let returning = self.start.resumed_at > 0 && self.completed == self.start.resumed_at;
        let live = |p: &P| returning || self.workers.contains_key(p);
        Learned {
            ratings: self.ratings.records().filter(|(p, _)| live(p)).map(|(p, r)| (p.clone(), *r)).collect(),
            earned: self.refs.earned.records().filter(|(p, _)| live(p)).map(|(p, w)| (p.clone(), w)).collect(),
            tensors: self.refs.tensors.clone(),
            step_ms: self.refs.step_ms,
            rated_norms: self.rated_norms,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::{Action, Config, Input};
    use super::*;
    use crate::diloco::aggregate::{Delta, Rejection};
    use crate::diloco::rating::Policy;

    fn config() -> Config {
        Config {
            rounds: 5,
            start_workers: 3,
            initial_deadline_ms: 1000,
            min_deadline_ms: 100,
            heartbeat_timeout_ms: 1_000_000,
            outer_lr: 1.0,
            outer_momentum: 0.0,
            rating: Some(Policy { probation_rounds: 1, probation_weight: 0.25, alpha: 0.5 }),
            tensor_factor: 4.0,
            ..Config::default()
        }
    }

    fn send(peer: u32, round: u64, v: f32) -> Input<u32> {
        let delta = Delta::Dense(vec![vec![v, 0.5 * v], vec![v * f32::from(peer as u8)]]);
        Input::contribution(peer, round, 10, 2.0, delta)
    }

    fn refused(actions: &[Action<u32>], who: u32) -> Option<Rejection> {
        actions.iter().find_map(|a| match a {
            Action::Rejected { peer, reason, .. } if *peer == who => Some(reason.clone()),
            _ => None,
        })
    }

    /// Two rounds: 1 and 2 pass their screens, 3 passes round 1 and is caught in
    /// round 2, and 4 is rated in round 1, then leaves.
    fn two_rounds() -> Shepherd<u32> {
        let mut s = Shepherd::new(Config { start_workers: 4, ..config() }, vec![vec![0.0; 2], vec![0.0]]);
        for p in 1..=4 {
            s.handle(Input::Joined(p), 0);
        }
        // 3 is caught in rounds 1 and 2: from its second catch it sits out
        let caught = Rejection::NoImprovement { before: 1.0, after: 1.2, reversed: 0.9 };
        for p in [1, 2, 4] {
            s.handle(send(p, 1, 0.1).passed(0.1 * f64::from(p)), 1);
        }
        s.handle(Input::Malformed { peer: 3, round: 1, reason: caught.clone() }, 1);
        assert_eq!(s.completed(), 1);
        s.handle(Input::Left(4), 2);
        for p in 1..=2 {
            s.handle(send(p, 2, 0.2).passed(0.2), 3);
        }
        s.handle(Input::Malformed { peer: 3, round: 2, reason: caught }, 3);
        assert_eq!(s.completed(), 2);
        s
    }

    #[test]
    fn a_resumed_shepherd_keeps_every_live_workers_rating_and_the_references() {
        let s = two_rounds();
        let snap = s.snapshot();
        let l = &snap.learned;
        assert_eq!(l.ratings.iter().map(|(p, _)| *p).collect::<Vec<_>>(), vec![1, 2, 3], "the live workers' only");
        assert!(!l.earned.is_empty() && l.earned.iter().all(|(p, _)| *p != 4), "{:?}", l.earned);
        assert!(l.tensors.len() == 2 && l.tensors.iter().all(Option::is_some), "{:?}", l.tensors);
        assert!(l.rated_norms);
        let r = Shepherd::resume(config(), snap.clone());
        assert_eq!(r.snapshot(), snap);
        for p in 1..=3 {
            assert_eq!(r.ratings().get(&p), s.ratings().get(&p), "worker {p}'s rating");
            assert_eq!(r.refs.earned.weight(&p), s.refs.earned.weight(&p), "worker {p}'s earned work");
        }
        assert!(!r.ratings().on_probation(&1), "a rated peer stays rated");
        assert_eq!(r.ratings().get(&4), None, "a key that left is not kept");
        assert_eq!(r.refs.tensors, s.refs.tensors);
        assert_eq!(r.rated_norms, s.rated_norms);
    }

    #[test]
    fn a_key_caught_before_the_snapshot_still_sits_out_after_resume() {
        let mut r = Shepherd::resume(config(), two_rounds().snapshot());
        for p in 1..=3 {
            r.handle(Input::Joined(p), 10);
        }
        assert!(r.sits_out(&3, 3));
        let a = r.handle(send(3, 3, 0.3), 11);
        assert_eq!(refused(&a, 3), Some(Rejection::SitsOut { until: 3 }));
        assert!(!r.must_screen(&1), "a rated peer need not be screened");
    }

    #[test]
    fn resume_drops_what_no_snapshot_could_hold() {
        let mut snap = two_rounds().snapshot();
        snap.learned.tensors = vec![Some((f64::NAN, 1.0)), Some((1.0, 0.5)), Some((2.0, 1.0))];
        snap.learned.step_ms = Some(f64::INFINITY);
        snap.learned.earned.push((9, f64::NAN));
        let r = Shepherd::resume(config(), snap);
        assert_eq!(r.refs.tensors, vec![None, Some((1.0, 0.5))], "non-finite dropped, one per tensor");
        assert_eq!(r.refs.step_ms, None);
        assert_eq!(r.refs.earned.weight(&9), 0.0);
    }
}
