use super::*;

#[test]
fn a_resumed_shepherd_waits_a_grace_period_for_its_workers() {
    let cfg = Config { start_workers: 2, resume_grace_ms: 1000, ..config() };
    let mut first = Shepherd::new(cfg.clone(), vec![vec![0.0, 0.0]]);
    first.handle(Input::Joined(1), 0);
    assert!(opened(&first.handle(Input::Joined(2), 0)).is_some());
    first.handle(contribution(1, 1, 1.0), 10);
    assert!(completed(&first.handle(contribution(2, 1, 1.0), 10)).is_some());

    // both workers come back: the round opens as soon as they have
    let mut s = Shepherd::<u32>::resume(cfg.clone(), first.snapshot());
    assert!(opened(&s.handle(Input::Joined(1), 100)).is_none(), "waits for the second worker");
    assert_eq!(opened(&s.handle(Input::Joined(2), 200)), Some((2, vec![1, 2])));

    // only one comes back: the round opens once the grace period is over
    let mut s = Shepherd::<u32>::resume(cfg, first.snapshot());
    assert!(opened(&s.handle(Input::Joined(1), 100)).is_none());
    assert!(opened(&s.handle(Input::Heartbeat(1), 500)).is_none());
    assert!(opened(&s.handle(Input::Heartbeat(1), 1099)).is_none());
    assert_eq!(opened(&s.handle(Input::Heartbeat(1), 1100)), Some((2, vec![1])));
}

#[test]
fn fragment_rounds_move_only_their_fragment_and_refuse_other_shapes() {
    for sparse in [None, Some(Settings::parse("sparse:chunk=2,k=1,bits=8,down=2").expect("parses"))] {
        let cfg = Config { start_workers: 2, fragments: vec![0..1, 1..2], sparse, ..config() };
        let mut s = Shepherd::new(cfg, vec![vec![1.0, 1.0], vec![5.0, 5.0]]);
        s.handle(Input::Joined(1), 0);
        s.handle(Input::Joined(2), 0);
        assert_eq!(&*s.round_sizes(1), &[2, 0]);
        assert_eq!(&*s.round_sizes(2), &[0, 2]);
        // round 1 syncs fragment 0: a whole-model contribution is the wrong shape
        let whole = Delta::Dense(vec![vec![0.5, 0.5], vec![0.5, 0.5]]);
        let a = s.handle(Input::contribution(1, 1, 10, 2.0, whole), 1);
        assert!(a.iter().any(|a| matches!(a, Action::Rejected { .. })), "{a:?}");
        let part = |v: f32, first: bool| {
            let t = vec![v, v];
            Delta::Dense(if first { vec![t, vec![]] } else { vec![vec![], t] })
        };
        for peer in [1, 2] {
            s.handle(Input::contribution(peer, 1, 10, 2.0, part(0.5, true)), 2);
        }
        assert_eq!(s.completed(), 1);
        assert_eq!(s.params()[1], vec![5.0, 5.0], "fragment 1 did not move in round 1");
        assert!(s.params()[0][0] < 1.0, "fragment 0 moved: {:?}", s.params());
        let first = s.params()[0].clone();
        for peer in [1, 2] {
            s.handle(Input::contribution(peer, 2, 10, 2.0, part(0.5, false)), 3);
        }
        assert_eq!(s.completed(), 2);
        assert_eq!(s.params()[0], first, "fragment 0 did not move in round 2");
        assert!(s.params()[1][0] < 5.0, "fragment 1 moved: {:?}", s.params());
    }
}

fn config() -> Config {
    Config {
        rounds: 3,
        initial_deadline_ms: 1000,
        min_deadline_ms: 100,
        heartbeat_timeout_ms: 500,
        outer_lr: 1.0,
        outer_momentum: 0.0,
        ..Config::default()
    }
}

fn contribution(peer: u32, round: u64, v: f32) -> Input<u32> {
    Input::contribution(peer, round, 10, 2.0, Delta::Dense(vec![vec![v, v]]))
}

fn opened(actions: &[Action<u32>]) -> Option<(u64, Vec<u32>)> {
    actions.iter().find_map(|a| match a {
        Action::OpenRound { round, participants, .. } => Some((*round, participants.clone())),
        _ => None,
    })
}

fn completed(actions: &[Action<u32>]) -> Option<RoundSummary<u32>> {
    actions.iter().find_map(|a| match a {
        Action::RoundCompleted(s) => Some(s.clone()),
        _ => None,
    })
}

#[test]
fn a_round_whose_every_contribution_is_rejected_closes_unchanged() {
    let mut s = Shepherd::new(Config { start_workers: 2, ..config() }, vec![vec![1.0, 1.0]]);
    s.handle(Input::Joined(1), 0);
    s.handle(Input::Joined(2), 0);
    let rejected = |peer| Input::Malformed { peer, round: 1, reason: Rejection::NoSamples };
    assert!(completed(&s.handle(rejected(1), 10)).is_none(), "worker 2 has not answered");
    let a = s.handle(rejected(2), 20);
    let summary = completed(&a).expect("everyone answered: the round closes instead of waiting forever");
    assert!(summary.contributors.is_empty());
    assert_eq!(summary.excluded, vec![1, 2]);
    assert_eq!(s.params(), &vec![vec![1.0, 1.0]], "nothing accepted, nothing moved");
    assert_eq!(opened(&a), Some((2, vec![1, 2])));
    // momentum from an earlier round does not move an empty one either
    s.handle(contribution(1, 2, 0.5), 30);
    completed(&s.handle(contribution(2, 2, 0.5), 40)).expect("round 2");
    let after_two = s.params().clone();
    s.handle(Input::Malformed { peer: 1, round: 3, reason: Rejection::NoSamples }, 50);
    completed(&s.handle(Input::Malformed { peer: 2, round: 3, reason: Rejection::NoSamples }, 60)).expect("round 3");
    assert_eq!(s.params(), &after_two);
}

#[test]
fn rounds_average_contributions_and_finish() {
    // No norm bound: this test is about averaging and round mechanics.
    let mut s = Shepherd::new(Config { norm_factor: f64::INFINITY, ..config() }, vec![vec![1.0, 1.0]]);
    assert_eq!(opened(&s.handle(Input::Joined(1), 0)), Some((1, vec![1])));
    // Worker 2 joins mid-round: it starts at round 2.
    s.handle(Input::Joined(2), 10);
    let a = s.handle(contribution(1, 1, 0.5), 20);
    let summary = completed(&a).expect("round 1 closes: its only participant answered");
    assert_eq!(summary.contributors, vec![1]);
    assert_eq!(s.params(), &vec![vec![0.5, 0.5]]);
    assert_eq!(opened(&a), Some((2, vec![1, 2])));
    s.handle(contribution(1, 2, 0.1), 30);
    assert_eq!(s.open_round(), Some(2), "still waiting for worker 2");
    let a = s.handle(contribution(2, 2, 0.3), 40);
    assert_eq!(completed(&a).map(|c| c.contributors), Some(vec![1, 2]));
    assert!((s.params()[0][0] - 0.3).abs() < 1e-6);
    s.handle(contribution(1, 3, 0.0), 50);
    let a = s.handle(contribution(2, 3, 0.0), 60);
    assert!(a.contains(&Action::Finished));
    assert!(s.is_finished());
}

#[test]
fn dead_worker_is_excluded_at_the_deadline() {
    // A long minimum deadline: the heartbeat timeout, not the deadline, ends round 2.
    let mut s = Shepherd::new(Config { start_workers: 2, min_deadline_ms: 5_000, ..config() }, vec![vec![0.0, 0.0]]);
    s.handle(Input::Joined(1), 0);
    s.handle(Input::Joined(2), 0);
    s.handle(contribution(1, 1, 0.2), 10);
    s.handle(contribution(2, 1, 0.2), 10);
    // Round 2: worker 2 dies (no more heartbeats).
    s.handle(Input::Heartbeat(1), 300);
    s.handle(contribution(1, 2, 0.1), 400);
    assert_eq!(s.open_round(), Some(2));
    let a = s.handle(Input::Tick, 700);
    assert!(a.contains(&Action::WorkerLeft { peer: 2, reason: LeaveReason::Timeout }));
    let summary = completed(&a).expect("closes once the dead worker is dropped");
    assert_eq!((summary.contributors, summary.excluded), (vec![1], vec![2]));
}

#[test]
fn every_silent_worker_expires_once_its_own_timeout_passes() {
    // timeout 500: 1 goes silent at 0, 2 at 400, 3 keeps heartbeating
    let mut s = Shepherd::new(Config { start_workers: 3, ..config() }, vec![vec![0.0, 0.0]]);
    for p in 1..=3 {
        s.handle(Input::Joined(p), 0);
    }
    s.handle(Input::Heartbeat(2), 400);
    s.handle(Input::Heartbeat(3), 400);
    let a = s.handle(Input::Heartbeat(3), 501);
    assert_eq!(a, vec![Action::WorkerLeft { peer: 1, reason: LeaveReason::Timeout }]);
    s.handle(Input::Heartbeat(3), 800);
    assert!(s.handle(Input::Tick, 900).is_empty(), "2 was seen at 400");
    let a = s.handle(Input::Tick, 901);
    assert!(a.contains(&Action::WorkerLeft { peer: 2, reason: LeaveReason::Timeout }), "{a:?}");
    assert_eq!(s.workers().copied().collect::<Vec<_>>(), vec![3]);
}

#[test]
fn time_the_shepherd_was_deaf_does_not_count_against_its_workers() {
    // timeout 500: both heartbeat at 400, then the host is busy for 2,000 ms
    let mut s = Shepherd::new(Config { start_workers: 3, ..config() }, vec![vec![0.0, 0.0]]);
    for p in 1..=2 {
        s.handle(Input::Joined(p), 0);
        s.handle(Input::Heartbeat(p), 400);
    }
    s.excuse(2_000);
    assert!(s.handle(Input::Tick, 2_400).is_empty(), "seen at 400, deaf 2,000 ms: 0 ms of silence");
    assert!(s.handle(Input::Heartbeat(1), 2_900).is_empty(), "500 ms of silence: not past the timeout");
    let a = s.handle(Input::Tick, 2_901);
    assert_eq!(a, vec![Action::WorkerLeft { peer: 2, reason: LeaveReason::Timeout }], "2's silence is its own");
    assert_eq!(s.workers().copied().collect::<Vec<_>>(), vec![1]);
}

#[test]
fn a_large_run_waits_for_its_slower_heartbeats() {
    // timeout 500 configured; 10,000 workers heartbeat every 2.5 s, so the shepherd
    // waits 4 of those intervals (10 s) before it drops one
    let n = 10_000u32;
    let mut s = Shepherd::new(Config { start_workers: n as usize + 1, ..config() }, vec![vec![0.0, 0.0]]);
    for p in 1..=n {
        s.handle(Input::Joined(p), 0);
    }
    assert_eq!(crate::diloco::liveness::timeout_ms(500, n as usize), 10_000);
    for p in 2..=n {
        s.handle(Input::Heartbeat(p), 2_500);
    }
    assert!(s.handle(Input::Tick, 10_000).is_empty(), "1 was silent 10 s: not past 4 intervals");
    let a = s.handle(Input::Tick, 10_001);
    assert_eq!(a, vec![Action::WorkerLeft { peer: 1, reason: LeaveReason::Timeout }]);
    assert_eq!(s.workers().count(), n as usize - 1);
}

#[test]
fn heartbeats_heard_but_not_handled_keep_their_workers() {
    // timeout 500: 1's heartbeats are only heard (a busy host), 2 is silent, 9 unknown
    let mut s = Shepherd::new(Config { start_workers: 3, ..config() }, vec![vec![0.0, 0.0]]);
    for p in 1..=2 {
        s.handle(Input::Joined(p), 0);
    }
    s.heard([1, 9], 400);
    let a = s.handle(Input::Tick, 501);
    assert_eq!(a, vec![Action::WorkerLeft { peer: 2, reason: LeaveReason::Timeout }]);
    assert_eq!(s.workers().copied().collect::<Vec<_>>(), vec![1], "9 did not join by being heard");
    assert_eq!(s.handle(Input::Tick, 900), vec![], "heard at 400");
}

#[test]
fn deadline_closes_with_quorum_and_stragglers_are_late() {
    let mut cfg = config();
    cfg.heartbeat_timeout_ms = 10_000;
    cfg.start_workers = 2;
    let mut s = Shepherd::new(cfg, vec![vec![0.0, 0.0]]);
    s.handle(Input::Joined(1), 0);
    s.handle(Input::Joined(2), 0);
    s.handle(contribution(1, 1, 0.2), 100);
    assert!(completed(&s.handle(Input::Tick, 999)).is_none());
    let a = s.handle(Input::Tick, 1000);
    assert_eq!(completed(&a).map(|c| c.excluded), Some(vec![2]));
    let a = s.handle(contribution(2, 1, 0.2), 1100);
    assert!(a.contains(&Action::Rejected { peer: 2, round: 1, reason: Rejection::Late { round: 1 } }));
}

#[test]
fn hostile_contributions_are_rejected_or_bounded() {
    let mut s = Shepherd::new(Config { start_workers: 4, ..config() }, vec![vec![0.0, 0.0]]);
    for p in 1..=4 {
        s.handle(Input::Joined(p), 0);
    }
    let nan = s.handle(Input::contribution(4, 1, 10, 1.0, Delta::Dense(vec![vec![f32::NAN, 0.0]])), 1);
    assert!(matches!(nan[0], Action::Rejected { reason: Rejection::NonFinite { index: 0 }, .. }));
    let shape = s.handle(Input::contribution(3, 1, 10, 1.0, vec![vec![0.0]].into()), 1);
    assert!(matches!(shape[0], Action::Rejected { reason: Rejection::Shape { .. }, .. }));
    let wrong_round = s.handle(contribution(1, 7, 0.1), 1);
    assert!(matches!(wrong_round[0], Action::Rejected { reason: Rejection::WrongRound { got: 7, current: 1 }, .. }));
    let stranger = s.handle(contribution(9, 1, 0.1), 1);
    assert!(matches!(stranger[0], Action::Rejected { reason: Rejection::NotParticipant { round: 1 }, .. }));
    s.handle(contribution(1, 1, 0.1), 2);
    let dup = s.handle(contribution(1, 1, 0.1), 2);
    assert!(matches!(dup[0], Action::Rejected { reason: Rejection::Duplicate { round: 1 }, .. }));
    // Round 2 everyone honest but 4, which scales its update ×1000.
    let a = s.handle(contribution(2, 1, 0.1), 3);
    assert!(completed(&a).is_some(), "rejected participants are not waited for");
    for p in 1..=3 {
        s.handle(contribution(p, 2, 0.1), 10);
    }
    let a = s.handle(contribution(4, 2, 100.0), 11);
    let summary = completed(&a).expect("round 2");
    assert_eq!(summary.clipped, 1);
    assert_eq!(summary.scaled.len(), 1, "the scaled contribution is named: {:?}", summary.scaled);
    assert!(s.params()[0][0].abs() < 0.6, "bounded: {}", s.params()[0][0]);
}

#[test]
fn deadlines_adapt_to_recent_rounds() {
    let mut s = Shepherd::new(config(), vec![vec![0.0, 0.0]]);
    s.handle(Input::Joined(1), 0);
    let a = s.handle(contribution(1, 1, 0.0), 200);
    // Round 1 took 200 ms: round 2's deadline is 2 × 200 after it opens.
    assert!(a.iter().any(|x| matches!(x, Action::OpenRound { round: 2, deadline_ms: 600, .. })), "{a:?}");
}

fn overlapping(workers: usize) -> Config {
    Config {
        start_workers: workers,
        heartbeat_timeout_ms: 1_000_000,
        min_deadline_ms: 100,
        norm_factor: f64::INFINITY,
        rounds: 10,
        overlap: Some(Overlap { notice_ms: 100, ..Overlap::new(50) }),
        ..config()
    }
}

/// [`stepped`], made in `train_ms` and sent `transfer_ms` before its input.
fn timed(peer: u32, round: u64, steps: u64, train_ms: u64, transfer_ms: u64) -> Input<u32> {
    stepped(peer, round, steps).timed(steps, train_ms, transfer_ms)
}

/// `steps` inner steps of 10 samples from `peer` to `round` (with
/// [`overlapping`]'s `sample_unit` of 10).
fn stepped(peer: u32, round: u64, steps: u64) -> Input<u32> {
    let delta = Delta::Dense(vec![vec![0.1, 0.1]]);
    Input::contribution(peer, round, steps * 10, 2.0, delta)
}

/// (a): the budget is τ × the step time of the last round's contributions
/// (claims at most what the shepherd saw, by earned weight); (c): the deadline
/// waits for late links as long as the next round still reaches the workers
/// before their next steps are done.
#[test]
fn overlapping_rounds_are_time_boxed_by_the_step_time() {
    let config = || Config { sample_unit: 10, max_steps: 50, initial_deadline_ms: 10_000, ..overlapping(3) };
    let mut s = Shepherd::new(config(), vec![vec![0.0, 0.0]]);
    for p in 1..=3 {
        s.handle(Input::Joined(p), 0);
    }
    assert_eq!(s.budget_ms(), None, "no timing yet: τ steps");
    // round 1 opened at 0: 10, 20 and 80 ms a step (the last a straggler that ran
    // 25 of its 50 steps), the third claiming more than it could have (9 s by 2 s)
    for (p, steps, train, at) in [(1, 50, 500, 600), (2, 50, 1000, 1100), (3, 25, 9000, 2000)] {
        s.handle(timed(p, 1, steps, train, 10), at);
    }
    assert_eq!(s.completed(), 1);
    // the median 20 ms a step × τ = 50: a 1000 ms budget
    assert_eq!(s.budget_ms(), Some(1000));
    let summary_budget = |a: &[Action<u32>]| completed(a).and_then(|c| c.budget_ms);
    // round 2 opened at 2000: its deadline is two budgets later until half the
    // participants answered
    assert_eq!(s.deadline_ms(), Some(4000));
    s.handle(timed(1, 2, 50, 1000, 10), 2960);
    assert_eq!(s.deadline_ms(), Some(4000));
    // the second of three sent at 2950 too: the median worker started round 3's steps
    // then and is done with them at 3950; the round closes 100 ms (the notice) before
    s.handle(timed(2, 2, 50, 1000, 10), 2960);
    assert_eq!(s.deadline_ms(), Some(3850));
    assert!(completed(&s.handle(Input::Tick, 3849)).is_none());
    let a = s.handle(Input::Tick, 3850);
    assert_eq!(summary_budget(&a), Some(1000));
    assert_eq!(completed(&a).map(|c| c.excluded), Some(vec![3]));
    // round 3's deadline (5850) passes with no contribution: extended
    let a = s.handle(Input::Tick, 7000);
    assert!(a.iter().any(|a| matches!(a, Action::DeadlineExtended { round: 3, .. })), "{a:?}");
    // a deadline that would already have passed is the next millisecond: the round
    // closes at the next input, not in the one that settled it (the host holds it
    // there for contributions still being read)
    s.handle(timed(1, 3, 50, 5000, 5000), 7000);
    assert!(completed(&s.handle(timed(2, 3, 50, 5000, 5000), 7000)).is_none());
    assert_eq!(s.deadline_ms(), Some(7001));
    assert!(completed(&s.handle(Input::Tick, 7001)).is_some());
    // claims of 100 ms a step: the reference moves at most ×2 a round, 40 ms
    assert_eq!(s.budget_ms(), Some(2000));

    // what does not count: a claim above what the shepherd saw, a refused
    // contribution; a budget under a millisecond is none
    let claims = |train_ms: u64| {
        let mut s = Shepherd::new(Config { start_workers: 2, ..config() }, vec![vec![0.0, 0.0]]);
        s.handle(Input::Joined(1), 0);
        s.handle(Input::Joined(2), 0);
        for (p, at) in [(1, 400), (2, 600)] {
            s.handle(timed(p, 1, 50, train_ms, 10), at);
        }
        s.budget_ms()
    };
    assert_eq!(claims(300), Some(300));
    assert_eq!(claims(1_000_000), Some(800), "no more than twice the 400 ms seen");
    let mut s = Shepherd::new(Config { start_workers: 2, ..config() }, vec![vec![0.0, 0.0]]);
    s.handle(Input::Joined(1), 0);
    s.handle(Input::Joined(2), 0);
    s.handle(timed(1, 1, 50, 0, 0), 1);
    // refused (no samples): its claim of 9 s does not count
    let a = s.handle(stepped(2, 1, 0).timed(50, 9_000, 0), 9000);
    assert!(a.contains(&Action::Rejected { peer: 2, round: 1, reason: Rejection::NoSamples }), "{a:?}");
    assert_eq!(s.completed(), 1);
    assert_eq!(s.budget_ms(), None, "a budget of 0 ms (0 ms a step) is no budget");
    // a lockstep shepherd ignores timings
    let mut s = Shepherd::new(Config { overlap: None, ..config() }, vec![vec![0.0, 0.0]]);
    s.handle(Input::Joined(1), 0);
    s.handle(timed(1, 1, 50, 500, 0), 500);
    assert_eq!(s.budget_ms(), None);
}

/// The `early` attack: junk sent the instant a round opens is refused, and does
/// not count toward the half of the participants that settles a time-boxed
/// round's deadline. (Counted, two junk senders of five settled round 2 on the
/// first honest send, at 2890 here; in `bench/sleepers.sh`'s fp32 run, 9 of 20
/// junk senders left 3 or 4 contributions a round and cost 20% of the loss.)
#[test]
fn refused_junk_does_not_settle_a_time_boxed_round() {
    let config = Config { sample_unit: 10, max_steps: 50, initial_deadline_ms: 10_000, ..overlapping(5) };
    let mut s = Shepherd::new(config, vec![vec![0.0, 0.0]]);
    for p in 1..=5 {
        s.handle(Input::Joined(p), 0);
    }
    for p in 1..=5 {
        s.handle(timed(p, 1, 50, 1000, 10), 1000);
    }
    assert_eq!((s.completed(), s.budget_ms()), (1, Some(1000)));
    // round 2 opened at 1000: two budgets until half the participants were taken
    assert_eq!(s.deadline_ms(), Some(3000));
    let a = s.handle(stepped(3, 2, 0), 1001);
    assert!(a.contains(&Action::Rejected { peer: 3, round: 2, reason: Rejection::NoSamples }), "{a:?}");
    s.handle(stepped(4, 2, 0), 1002);
    s.handle(timed(1, 2, 50, 1000, 10), 2000);
    // three of five answered, one taken: not settled on that one send
    assert_eq!(s.deadline_ms(), Some(3000));
    s.handle(timed(2, 2, 50, 1000, 10), 2500);
    assert_eq!(s.deadline_ms(), Some(3000));
    assert!(completed(&s.handle(Input::Tick, 2999)).is_none());
    let a = s.handle(Input::Tick, 3000);
    assert_eq!(completed(&a).map(|c| c.contributors), Some(vec![1, 2]));
}

/// A time-boxed round closes the shepherd's typical close earlier than the notice
/// alone would have it (the lower median of the last closes, at most half the
/// budget in all), so the next announcement reaches the median worker as its
/// steps end, not a close later.
#[test]
fn a_time_boxed_round_leaves_room_for_the_close() {
    let config = Config { sample_unit: 10, max_steps: 50, initial_deadline_ms: 10_000, ..overlapping(3) };
    // round 2's deadline when round 1's close took `closes` (each announced that
    // long after its round was decided; the last is round 1's)
    let deadline = |closes: &[u64]| {
        let mut s = Shepherd::new(config.clone(), vec![vec![0.0, 0.0]]);
        for p in 1..=3 {
            s.handle(Input::Joined(p), 0);
        }
        for close in closes {
            // a close before the first: decided and announced with nothing open
            s.refs.close.decided(0);
            s.announced(*close);
        }
        for (p, at) in [(1, 600), (2, 1100), (3, 2000)] {
            s.handle(timed(p, 1, 50, 1000, 10), at);
        }
        assert_eq!((s.completed(), s.budget_ms()), (1, Some(1000)));
        // round 1 closed at 2000, the input that decided it
        s.announced(2000 + closes.last().copied().unwrap_or(0));
        s.handle(timed(1, 2, 50, 1000, 10), 2960);
        s.handle(timed(2, 2, 50, 1000, 10), 2960);
        s.deadline_ms()
    };
    // the median worker is done at 3950: the notice (100 ms) and the close before
    assert_eq!(deadline(&[]), Some(3850));
    assert_eq!(deadline(&[200]), Some(3650));
    // a checkpoint's long close among short ones moves nothing
    assert_eq!(deadline(&[200, 200, 200, 2000]), Some(3650));
    // at most half the budget
    assert_eq!(deadline(&[5000]), Some(3450));
}

/// The `timing` attack: keys that earned nothing cannot cut the budget by
/// claiming 1 ms, however many they are, and neither can sleepers holding a
/// minority of the earned weight. (With the median of claims, ten fresh keys
/// set a 50 ms budget in one round.)
#[test]
fn fresh_keys_and_a_minority_claiming_fast_steps_do_not_move_the_step_budget() {
    let config = |workers| Config { sample_unit: 10, max_steps: 50, start_workers: workers, ..overlapping(workers) };
    let mut s = Shepherd::new(config(2), vec![vec![0.0, 0.0]]);
    s.handle(Input::Joined(1), 0);
    s.handle(Input::Joined(2), 0);
    for p in [1, 2] {
        s.handle(timed(p, 1, 50, 1000, 0), 1000);
    }
    assert_eq!(s.budget_ms(), Some(1000));
    for sybil in 10..20 {
        s.handle(Input::Joined(sybil), 1000);
    }
    // round 2 is the honest workers' and the fresh keys' (joined before it opened)
    let opened = s.deadline_ms().expect("open") - 2 * s.budget_ms().expect("budget");
    for sybil in 10..20 {
        s.handle(timed(sybil, 2, 50, 1, 0), opened + 1);
    }
    for p in [1, 2] {
        s.handle(timed(p, 2, 50, 1000, 0), opened + 1000);
    }
    assert_eq!((s.completed(), s.budget_ms()), (2, Some(1000)));

    // three of seven, honest for two rounds, then claiming 1 ms
    let mut s = Shepherd::new(config(7), vec![vec![0.0, 0.0]]);
    for p in 1..=7 {
        s.handle(Input::Joined(p), 0);
    }
    let mut at = 0;
    for round in 1..=8 {
        at += 1000;
        for p in 1..=7 {
            let train = if p >= 5 && round > 2 { 1 } else { 1000 };
            s.handle(timed(p, round, 50, train, 0), at);
        }
        assert_eq!(s.completed(), round);
        assert_eq!(s.budget_ms(), Some(1000), "round {round}");
    }
}

/// The `timing` attack by a majority of the earned weight (the screen's false
/// refusals can hand sleepers that majority): four of seven, honest for two
/// rounds, then claiming 1 ms a step, move the weighted median of claims ÷2 a
/// round. The step time stops falling at a budget of [`reference::PACE_SHARE`]
/// (¾) of the round just closed, which no claim sets: each worker runs steps of
/// 20 ms for the budget (at most τ = 50) and its contribution arrives `upload`
/// ms after its steps end. Where the honest budget is under ¾ of the round, it
/// holds; otherwise it falls to about 3 × the upload, not to a step.
#[test]
fn a_majority_claiming_fast_steps_cuts_the_budget_to_three_quarters_of_the_round_at_most() {
    // deadlines past every arrival: each round closes once all seven answered
    let config = Config { sample_unit: 10, max_steps: 50, rounds: 13, min_deadline_ms: 5_000, ..overlapping(7) };
    let budgets = |upload: u64| {
        let mut s = Shepherd::new(config.clone(), vec![vec![0.0, 0.0]]);
        for p in 1..=7 {
            s.handle(Input::Joined(p), 0);
        }
        let (mut opened, mut budgets) = (0, Vec::new());
        for round in 1..=12 {
            let steps = s.budget_ms().map_or(50, |b| (b / 20).clamp(1, 50));
            let arrives = opened + steps * 20 + upload;
            for p in 1..=7 {
                let train = if p >= 4 && round > 2 { 1 } else { steps * 20 };
                s.handle(timed(p, round, steps, train, 0), arrives);
            }
            assert_eq!(s.completed(), round);
            opened = arrives;
            budgets.push(s.budget_ms().unwrap_or(0));
        }
        budgets
    };
    // without the pace (measured with 500 ms uploads): 1000, 1000, 500, 250, 125, 62, 31, then
    // 25–50 ms, one or two steps of 20 ms a round
    assert_eq!(budgets(500), vec![1000; 12], "compute was under ¾ of each round: held");
    let fast = budgets(100);
    assert_eq!(&fast[..2], &[1000, 1000], "honest rounds: τ × 20 ms");
    assert!(fast.iter().all(|b| *b >= 250), "{fast:?}");
    let last = *fast.last().expect("rounds");
    assert!((250..=350).contains(&last), "3 × the 100 ms upload: {fast:?}");
}

#[test]
fn a_contribution_one_round_late_is_carried_into_the_next_round() {
    let cfg = Config { initial_deadline_ms: 100, ..overlapping(3) };
    let mut s = Shepherd::new(cfg, vec![vec![0.0, 0.0]]);
    for p in 1..=3 {
        s.handle(Input::Joined(p), 0);
    }
    s.handle(contribution(1, 1, 0.1), 10);
    s.handle(contribution(2, 1, 0.1), 10);
    let a = s.handle(Input::Tick, 100);
    assert_eq!(completed(&a).map(|c| (c.contributors, c.excluded)), Some((vec![1, 2], vec![3])));
    assert!((s.params()[0][0] + 0.1).abs() < 1e-6, "{:?}", s.params());
    // a fourth worker joins for round 3
    s.handle(Input::Joined(4), 101);
    // round 2 is open: 3's round-1 contribution is late, and carried
    assert!(s.handle(contribution(3, 1, 0.4), 110).is_empty(), "accepted");
    // a second one from 3 for round 1, one from 1 (averaged in round 1 already),
    // and one from 4 (not in round 1) are refused
    let refused = |a: Vec<Action<u32>>| match a.first() {
        Some(Action::Rejected { reason, .. }) => reason.clone(),
        other => panic!("{other:?}"),
    };
    assert_eq!(refused(s.handle(contribution(3, 1, 0.4), 111)), Rejection::Duplicate { round: 1 });
    assert_eq!(refused(s.handle(contribution(1, 1, 0.4), 111)), Rejection::Duplicate { round: 1 });
    assert_eq!(refused(s.handle(contribution(4, 1, 0.4), 111)), Rejection::NotParticipant { round: 1 });
    // 3 still sends its round-2 contribution: both are averaged, one round late and on time
    let a: Vec<Action<u32>> = (1..=3).flat_map(|p| s.handle(contribution(p, 2, 0.1), 120)).collect();
    let summary = completed(&a).expect("everyone answered round 2");
    assert_eq!((summary.round, summary.contributors, summary.carried), (2, vec![1, 2, 3], vec![3]));
    // the mean of 0.4 (carried) and three 0.1s, equally weighted: 0.175
    assert!((s.params()[0][0] + 0.1 + 0.175).abs() < 1e-6, "{:?}", s.params());
    // round 3 is open: round 1 is two rounds old
    assert_eq!(refused(s.handle(contribution(3, 1, 0.4), 130)), Rejection::Late { round: 1 });
    assert_eq!(refused(s.handle(contribution(2, 1, 0.4), 130)), Rejection::Late { round: 1 });
    // a carried NaN is refused, and not tried again
    s.handle(contribution(1, 3, 0.1), 140);
    s.handle(contribution(2, 3, 0.1), 140);
    s.handle(contribution(4, 3, 0.1), 140);
    completed(&s.handle(Input::Tick, 10_000)).expect("round 3 at its deadline, without 3");
    let nan = Input::contribution(3, 3, 10, 1.0, Delta::Dense(vec![vec![f32::NAN, 0.0]]));
    assert_eq!(refused(s.handle(nan, 10_001)), Rejection::NonFinite { index: 0 });
    assert_eq!(refused(s.handle(contribution(3, 3, 0.1), 10_002)), Rejection::Duplicate { round: 3 });
}

#[test]
fn carried_contributions_make_a_quorum_and_lockstep_or_fragment_runs_refuse_them() {
    let cfg = Config { initial_deadline_ms: 100, min_deadline_ms: 100, max_deadline_ms: 100, ..overlapping(2) };
    let mut s = Shepherd::new(cfg.clone(), vec![vec![0.0, 0.0]]);
    s.handle(Input::Joined(1), 0);
    s.handle(Input::Joined(2), 0);
    s.handle(contribution(1, 1, 0.1), 10);
    completed(&s.handle(Input::Tick, 100)).expect("round 1 at its deadline");
    // round 2: only 2's late round-1 contribution arrives; it is a quorum at the deadline
    s.handle(contribution(2, 1, 0.1), 150);
    let summary = completed(&s.handle(Input::Tick, 200)).expect("closes with the carried one");
    assert_eq!((summary.contributors, summary.carried), (vec![], vec![2]));
    for cfg in [Config { overlap: None, ..cfg.clone() }, Config { fragments: vec![0..1, 1..2], ..cfg.clone() }] {
        let params = if cfg.fragments.is_empty() { vec![vec![0.0, 0.0]] } else { vec![vec![0.0, 0.0]; 2] };
        let mut s = Shepherd::new(cfg.clone(), params);
        s.handle(Input::Joined(1), 0);
        s.handle(Input::Joined(2), 0);
        let part = |peer| {
            let t = vec![0.1, 0.1];
            let delta = if cfg.fragments.is_empty() { vec![t] } else { vec![t, vec![]] };
            Input::contribution(peer, 1, 10, 2.0, Delta::Dense(delta))
        };
        s.handle(part(1), 10);
        completed(&s.handle(Input::Tick, 100)).expect("round 1");
        let a = s.handle(part(2), 150);
        assert!(a.contains(&Action::Rejected { peer: 2, round: 1, reason: Rejection::Late { round: 1 } }), "{a:?}");
    }
}

#[test]
fn snapshot_resumes_identically() {
    let mut cfg = config();
    cfg.outer_momentum = 0.9;
    let mut s = Shepherd::new(cfg.clone(), vec![vec![1.0, 2.0]]);
    s.handle(Input::Joined(1), 0);
    s.handle(contribution(1, 1, 0.3), 5);
    let snap = s.snapshot();
    let mut r = Shepherd::<u32>::resume(cfg, snap.clone());
    assert_eq!(r.snapshot(), snap);
    r.handle(Input::Joined(1), 10);
    s.handle(contribution(1, 2, 0.2), 10);
    assert_eq!(r.open_round(), Some(2));
    r.handle(contribution(1, 2, 0.2), 10);
    assert_eq!(r.params(), s.params());
}

/// Workers' contributions to three rounds, each tensor its own shard: a shepherd
/// given them whole, and one given its aggregators' reports and mean.
#[test]
fn an_aggregated_round_moves_the_parameters_as_the_whole_contributions_would() {
    use crate::diloco::aggregation::{Collect, Reported, ShardSum, assign, inspect, shard_bounds, slice_hash};
    use rand::{Rng, SeedableRng};
    let cfg = Config { start_workers: 3, tensor_factor: 1.5, element_factor: 4.0, ..config() };
    let sizes = [6usize, 4];
    let params: Tensors = sizes.iter().map(|n| vec![0.5; *n]).collect();
    let (mut whole, mut summed) = (Shepherd::new(cfg.clone(), params.clone()), Shepherd::new(cfg, params));
    let workers: Vec<Vec<u8>> = (1..=3u8).map(|i| vec![i; 32]).collect();
    let aggregators: Vec<Vec<u8>> = (10..=12u8).map(|i| vec![i; 32]).collect();
    for w in &workers {
        whole.handle(Input::Joined(w.clone()), 0);
        summed.handle(Input::Joined(w.clone()), 0);
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    for round in 1..=3u64 {
        let t = round * 10;
        let bounds = summed.round_bounds().expect("open").clone();
        let assignment = assign(&[3; 32], round, sizes.len(), 1, &aggregators).expect("assigned");
        let mut collect = Collect::new(assignment.clone(), vec![0..1, 1..2], vec![Vec::new(); 2], 8);
        let mut sums: Vec<ShardSum> =
            sizes.iter().enumerate().map(|(s, n)| ShardSum::new(round, s, vec![*n], 1)).collect();
        let mut slices = BTreeMap::new();
        let mut actions = Vec::new();
        for (i, w) in workers.iter().enumerate() {
            let scale = 0.2 * (i + 1) as f32 * round as f32;
            let delta: Tensors =
                sizes.iter().map(|n| (0..*n).map(|_| rng.gen_range(-scale..scale)).collect()).collect();
            whole.handle(Input::contribution(w.clone(), round, 10, 2.0, Delta::Dense(delta.clone())), t);
            let hashes = (0..sizes.len()).map(|s| slice_hash(&[i as u8, s as u8])).collect::<Vec<_>>();
            collect.commit(w.clone(), hashes.clone()).expect("committed");
            let mut ready = Reported::Waiting;
            for (s, tensor) in delta.into_iter().enumerate() {
                let slice = Delta::Dense(vec![tensor]);
                let (bounded, report) =
                    inspect(slice, &sizes[s..=s], &shard_bounds(&bounds, &(s..s + 1))).expect("valid");
                slices.insert((w.clone(), s), bounded);
                let replica = assignment.replicas(s)[0].clone();
                ready = collect.report(&replica, w, s, hashes[s], report).expect("reported");
            }
            let Reported::Ready { norm, raw } = ready else { panic!("not ready: {ready:?}") };
            let report = Report { raw, bounded_norm: norm };
            let input = Input::Reported {
                peer: w.clone(),
                round,
                samples: 10,
                loss: 2.0,
                report,
                timing: None,
                screen: Screen::Unscreened,
            };
            actions.extend(summed.handle(input, t));
        }
        assert!(!actions.iter().any(|a| matches!(a, Action::RoundCompleted(_))), "waits for the mean: {actions:?}");
        assert_eq!(summed.aggregating(), Some(round));
        let count = actions.iter().find_map(|a| match a {
            Action::Aggregate { round: r, count } if *r == round => Some(*count),
            _ => None,
        });
        assert_eq!(count, Some(3), "{actions:?}");
        for a in &actions {
            if let Action::Added { peer, weight, bound, .. } = a {
                let accept = collect.accept(peer, *weight, *bound).expect("ready");
                for (s, sum) in sums.iter_mut().enumerate() {
                    sum.accept(accept, slices[&(peer.clone(), s)].clone()).expect("in order");
                }
            }
        }
        let updates: Vec<_> = sums.into_iter().map(|s| s.finish(3).expect("complete")).collect();
        let total = updates[0].total;
        let mean: Tensors = updates.into_iter().flat_map(|u| u.mean).collect();
        let done = summed.handle(Input::Aggregated { round, mean: Some((mean, total)) }, t + 1);
        assert!(done.iter().any(|a| matches!(a, Action::RoundCompleted(s) if s.round == round)), "{done:?}");
        assert_eq!(whole.completed(), round);
        assert_eq!(summed.completed(), round);
        for (a, b) in whole.params().iter().flatten().zip(summed.params().iter().flatten()) {
            assert!((a - b).abs() <= 1e-5 * a.abs().max(1.0), "round {round}: {a} against {b}");
        }
    }
    assert_ne!(whole.params()[0][0], 0.5, "the parameters moved");
}

#[test]
fn an_aggregated_mean_of_the_wrong_shape_moves_nothing_and_a_late_report_is_carried_over() {
    let cfg = Config { start_workers: 3, heartbeat_timeout_ms: 10_000, overlap: Some(Overlap::new(4)), ..config() };
    let mut s = Shepherd::new(cfg, vec![vec![1.0, 1.0]]);
    for peer in 1..=3u32 {
        s.handle(Input::Joined(peer), 0);
    }
    let report = |peer, raw: Vec<(f64, f32)>| Input::Reported {
        peer,
        round: 1,
        samples: 10,
        loss: 2.0,
        report: Report { raw, bounded_norm: 1.0 },
        timing: None,
        screen: Screen::Unscreened,
    };
    s.handle(report(1, vec![(1.0, 0.8)]), 1);
    // a report with another number of tensors than the round's is refused
    let bad = s.handle(report(2, vec![]), 2);
    assert!(bad.iter().any(|a| matches!(a, Action::Rejected { reason: Rejection::Count { .. }, .. })), "{bad:?}");
    // worker 3 is silent: the round closes at its deadline
    let a = s.handle(Input::Tick, 1001);
    assert!(a.iter().any(|a| matches!(a, Action::Aggregate { round: 1, count: 1 })), "{a:?}");
    assert!(s.handle(Input::Heartbeat(3), 1002).is_empty(), "no round opens while aggregating");
    // worker 3's report comes while round 1 is aggregated: it waits for round 2, to be carried into it
    assert!(s.handle(report(3, vec![(1.0, 0.8)]), 1002).is_empty());
    let mut done = s.handle(Input::Aggregated { round: 1, mean: Some((vec![vec![0.5; 3]], 10.0)) }, 1003);
    assert!(done.iter().any(|a| matches!(a, Action::RoundCompleted(_))), "{done:?}");
    assert_eq!(opened(&done).map(|(r, _)| r), Some(2), "the next round opens once the mean is in: {done:?}");
    assert_eq!(s.params(), &vec![vec![1.0, 1.0]], "a mean of the wrong shape is dropped");
    assert!(!done.iter().any(|a| matches!(a, Action::Rejected { .. })), "carried over: {done:?}");
    done.extend(s.handle(Input::Tick, 10_000));
    let added = done.iter().find_map(|a| match a {
        Action::Added { round, peer, of, .. } => Some((*round, *peer, *of)),
        _ => None,
    });
    assert_eq!(added, Some((2, 3, 1)), "{done:?}");
    assert!(done.iter().any(|a| matches!(a, Action::Aggregate { round: 2, count: 1 })), "{done:?}");
}
