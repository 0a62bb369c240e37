use super::*;

fn open(round: u64, deadline_ms: u64, participant: bool) -> Input {
    Input::RoundOpened { round, deadline_ms, participant }
}

fn train(round: u64, behind: u64) -> Action {
    Action::Train { round, steps: 5, seed: data_seed(1, b"me", round), budget_ms: None, behind }
}

fn overlapping() -> Worker {
    Worker::new(b"me".to_vec(), 1, 5).with_overlap(true)
}

/// An overlapping worker that has trained and sent round 1 and trains round 2 ahead.
fn ahead_of_round_two() -> Worker {
    let mut w = overlapping();
    assert_eq!(w.handle(open(1, 100, true), 0), vec![Action::FetchParams(1)]);
    assert_eq!(w.handle(Input::ParamsReady(1), 1), vec![train(1, 0)]);
    assert_eq!(w.handle(Input::Trained(1), 10), vec![Action::Send(1), train(2, 1)]);
    assert_eq!((w.phase(), w.sending(), w.behind()), (Phase::Ahead(2), &[1][..], 1));
    w
}

#[test]
fn a_round_end_to_end() {
    let mut w = Worker::new(b"me".to_vec(), 1, 50);
    assert!(!w.overlaps());
    assert_eq!(
        w.handle(Input::RoundOpened { round: 1, deadline_ms: 100, participant: true }, 0),
        vec![Action::FetchParams(1)]
    );
    let train = w.handle(Input::ParamsReady(1), 1);
    assert_eq!(
        train,
        vec![Action::Train { round: 1, steps: 50, seed: data_seed(1, b"me", 1), budget_ms: None, behind: 0 }]
    );
    assert_eq!(w.handle(Input::Trained(1), 50), vec![Action::Send(1)]);
    assert!(w.handle(Input::Sent(1), 60).is_empty());
    assert_eq!(w.phase(), Phase::Idle);
}

#[test]
fn non_participants_wait_and_newer_rounds_preempt() {
    let mut w = Worker::new(b"me".to_vec(), 1, 5);
    assert!(w.handle(Input::RoundOpened { round: 3, deadline_ms: 100, participant: false }, 0).is_empty());
    w.handle(Input::RoundOpened { round: 4, deadline_ms: 100, participant: true }, 0);
    w.handle(Input::ParamsReady(4), 1);
    let a = w.handle(Input::RoundOpened { round: 5, deadline_ms: 200, participant: true }, 2);
    assert_eq!(a, vec![Action::Abandon(4), Action::FetchParams(5)]);
    // A stale completion for round 4 changes nothing.
    assert!(w.handle(Input::Trained(4), 3).is_empty());
    assert_eq!(w.handle(Input::Tick, 201), vec![Action::Abandon(5)]);
}

#[test]
fn an_extended_deadline_keeps_a_lockstep_round() {
    let mut w = Worker::new(b"me".to_vec(), 1, 5);
    w.handle(open(1, 100, true), 0);
    // the shepherd had no quorum at 100 and moved the deadline to 300
    assert!(w.handle(Input::DeadlineExtended { round: 1, deadline_ms: 300 }, 90).is_empty());
    // an extension of another round, or an earlier deadline, changes nothing
    w.handle(Input::DeadlineExtended { round: 7, deadline_ms: 10_000 }, 91);
    w.handle(Input::DeadlineExtended { round: 1, deadline_ms: 50 }, 92);
    assert_eq!(w.handle(Input::ParamsReady(1), 150), vec![train(1, 0)]);
    assert_eq!(w.handle(Input::Trained(1), 250), vec![Action::Send(1)]);
    // without the extension the round is abandoned at its deadline
    let mut w = Worker::new(b"me".to_vec(), 1, 5);
    w.handle(open(1, 100, true), 0);
    assert_eq!(w.handle(Input::ParamsReady(1), 150), vec![train(1, 0), Action::Abandon(1)]);
}

/// A round abandoned at its deadline is taken up again when the shepherd extends
/// that deadline (it had no quorum): were every participant's fetch late, the
/// shepherd would otherwise extend a round nobody trains.
#[test]
fn a_lapsed_lockstep_round_is_taken_up_again_when_its_deadline_is_extended() {
    let mut w = Worker::new(b"me".to_vec(), 1, 5);
    w.handle(open(3, 100, true), 0);
    // the fetch (from a leader since cut off) ends past the deadline
    assert_eq!(w.handle(Input::ParamsReady(3), 150), vec![train(3, 0), Action::Abandon(3)]);
    assert_eq!(w.phase(), Phase::Idle);
    // an extension already past, or of another round, changes nothing
    assert!(w.handle(Input::DeadlineExtended { round: 3, deadline_ms: 140 }, 160).is_empty());
    assert!(w.handle(Input::DeadlineExtended { round: 4, deadline_ms: 10_000 }, 161).is_empty());
    // extended past now: fetched again, trained and sent
    assert_eq!(w.handle(Input::DeadlineExtended { round: 3, deadline_ms: 400 }, 170), vec![Action::FetchParams(3)]);
    assert_eq!(w.handle(Input::ParamsReady(3), 180), vec![train(3, 0)]);
    assert_eq!(w.handle(Input::Trained(3), 250), vec![Action::Send(3)]);
    assert!(w.handle(Input::Sent(3), 260).is_empty());
    // once sent, a later extension of it asks nothing
    assert!(w.handle(Input::DeadlineExtended { round: 3, deadline_ms: 900 }, 270).is_empty());
    // a newer round forgets the lapsed one
    let mut w = Worker::new(b"me".to_vec(), 1, 5);
    w.handle(open(3, 100, true), 0);
    w.handle(Input::Tick, 101);
    w.handle(open(4, 300, false), 102);
    assert!(w.handle(Input::DeadlineExtended { round: 3, deadline_ms: 400 }, 103).is_empty());
}

#[test]
fn overlap_trains_the_next_round_while_sending_and_rebases_onto_its_update() {
    let mut w = ahead_of_round_two();
    assert!(w.handle(Input::Sent(1), 12).is_empty());
    assert!(w.sending().is_empty());
    // round 2 opens: its parameters are fetched beside the training, then merged
    assert_eq!(w.handle(open(2, 200, true), 15), vec![Action::FetchUpdate(2)]);
    assert_eq!(w.phase(), Phase::Merging(2));
    assert_eq!(w.handle(Input::ParamsReady(2), 16), vec![Action::Rebase(2)]);
    assert_eq!((w.phase(), w.behind()), (Phase::Training(2), 0));
    assert_eq!(w.handle(Input::Trained(2), 20), vec![Action::Send(2), train(3, 1)]);
    // the next announcement does not abandon the send in flight: a late one is carried over
    assert_eq!(w.handle(open(3, 300, true), 22), vec![Action::FetchUpdate(3)]);
    assert_eq!(w.sending(), &[2]);
    // a repeated announcement changes nothing
    assert!(w.handle(open(3, 300, true), 23).is_empty());
    assert!(w.handle(open(2, 200, true), 23).is_empty());
    assert_eq!(w.handle(Input::ParamsReady(3), 24), vec![Action::Rebase(3)]);
    assert!(!w.update_late());
    // two rounds later the send would be refused: it is dropped
    assert_eq!(w.handle(Input::Trained(3), 30), vec![Action::Send(3), train(4, 1)]);
    assert_eq!(w.handle(open(4, 400, true), 31), vec![Action::Abandon(2), Action::FetchUpdate(4)]);
    assert_eq!(w.sending(), &[3]);
}

/// (b): a contribution is minus the progress since the last send, so it goes
/// without the update; compute waits only at depth 3.
#[test]
fn a_late_update_does_not_hold_the_send_until_it_is_two_rounds_late() {
    let mut w = ahead_of_round_two();
    assert_eq!(w.handle(open(2, 200, true), 15), vec![Action::FetchUpdate(2)]);
    // round 2's steps are done, θ(2) is not here: send anyway, train round 3 two updates behind
    assert_eq!(w.handle(Input::Trained(2), 20), vec![Action::Send(2), train(3, 2)]);
    assert_eq!((w.phase(), w.behind(), w.update_late()), (Phase::Ahead(3), 2, false));
    // round 3 opens: its fetch waits for round 2's (a sparse update applies to θ(2)), and
    // round 1's send, if still on its way, would be refused now
    assert_eq!(w.handle(open(3, 300, true), 25), vec![Action::Abandon(1)]);
    assert_eq!(w.phase(), Phase::Merging(3));
    // round 3's steps are done and θ(2) still is not: now compute waits
    assert_eq!(w.handle(Input::Trained(3), 30), vec![Action::UpdateLate(3)]);
    assert!(w.update_late());
    assert!(w.handle(Input::Trained(3), 31).is_empty(), "reported once");
    assert_eq!(
        w.handle(Input::ParamsReady(2), 35),
        vec![Action::Rebase(2), Action::Send(3), train(4, 2), Action::FetchUpdate(3)],
        "rebase, send the waiting round, go on, and fetch the next update"
    );
    assert_eq!(w.handle(Input::ParamsReady(3), 36), vec![Action::Rebase(3)]);
    assert_eq!((w.phase(), w.behind()), (Phase::Ahead(4), 1));
    // a fetch nobody asked for changes nothing
    assert!(w.handle(Input::ParamsReady(7), 37).is_empty());
    assert!(w.handle(Input::ParamsReady(3), 37).is_empty());
}

#[test]
fn steps_done_before_their_round_opened_wait_for_its_announcement() {
    let mut w = ahead_of_round_two();
    // τ steps of round 2 are done before round 2 even opened: it cannot be named yet
    assert_eq!(w.handle(Input::Trained(2), 20), vec![Action::UpdateLate(2)]);
    assert!(w.update_late());
    assert_eq!(
        w.handle(open(2, 200, true), 25),
        vec![Action::Send(2), train(3, 2), Action::FetchUpdate(2)],
        "announced: send at once, θ(2) follows"
    );
    assert_eq!((w.phase(), w.sending(), w.update_late()), (Phase::Ahead(3), &[1, 2][..], false));
    assert_eq!(w.handle(Input::ParamsReady(2), 26), vec![Action::Rebase(2)]);
}

/// (c), on the worker's side: a round that closed while it was still trained is
/// finished and sent (carried over), and the next is trained one round behind.
#[test]
fn a_worker_one_round_behind_finishes_its_round_and_goes_on() {
    let mut w = ahead_of_round_two();
    w.handle(Input::Sent(1), 12);
    w.handle(open(2, 200, true), 15);
    // round 2 closes without this worker's contribution and round 3 opens
    assert!(w.handle(open(3, 300, true), 18).is_empty(), "nothing abandoned, θ(3) after θ(2)");
    assert_eq!(w.phase(), Phase::Merging(2));
    assert_eq!(w.handle(Input::ParamsReady(2), 19), vec![Action::Rebase(2), Action::FetchUpdate(3)]);
    // θ(3) arrives before round 2 is sent: its rebase needs round 2's anchor
    assert!(w.handle(Input::ParamsReady(3), 20).is_empty());
    assert_eq!(
        w.handle(Input::Trained(2), 21),
        vec![Action::Send(2), Action::Rebase(3), train(3, 0)],
        "round 3 starts from θ(3) itself"
    );
    // two rounds behind is too far: the round trained is dropped and it starts afresh
    let mut w = ahead_of_round_two();
    w.handle(open(2, 200, true), 15);
    assert_eq!(w.handle(open(3, 300, true), 18), vec![Action::Abandon(1)], "round 1's send is moot");
    assert_eq!(w.handle(open(4, 400, true), 30), vec![Action::Abandon(2), Action::FetchParams(4)]);
    assert_eq!(w.behind(), 0);
    // and so is a round newer than the next when it missed the announcement of its own
    let mut w = ahead_of_round_two();
    assert_eq!(w.handle(open(3, 300, true), 50), vec![Action::Abandon(1), Action::Abandon(2), Action::FetchParams(3)]);
    assert_eq!((w.phase(), w.sending()), (Phase::Fetching(3), &[][..]));
    // stale completions change nothing
    assert!(w.handle(Input::Trained(2), 51).is_empty());
    assert!(w.handle(Input::ParamsReady(2), 51).is_empty());
    assert!(w.handle(Input::Sent(1), 51).is_empty());
}

#[test]
fn a_worker_fetching_afresh_when_the_next_round_opens_catches_up_through_its_update() {
    let mut w = overlapping();
    w.handle(open(5, 100, true), 0);
    assert!(w.handle(open(6, 200, true), 50).is_empty(), "the fetch of θ(5) goes on");
    assert_eq!(w.handle(Input::ParamsReady(5), 60), vec![train(5, 0), Action::FetchUpdate(6)]);
    assert_eq!(w.handle(Input::Trained(5), 70), vec![Action::Send(5), train(6, 1)]);
    assert_eq!(w.handle(Input::ParamsReady(6), 71), vec![Action::Rebase(6)]);
}

/// (a): the budget announced with a round rides on every later Train.
#[test]
fn the_announced_budget_time_boxes_the_steps() {
    let mut w = overlapping();
    assert!(w.handle(Input::Budget { round: 1, budget_ms: 8_000, end_ms: 0 }, 0).is_empty());
    w.handle(open(1, 100, true), 0);
    let boxed = |round, behind, budget_ms| Action::Train {
        round,
        steps: 5,
        seed: data_seed(1, b"me", round),
        budget_ms,
        behind,
    };
    assert_eq!(w.handle(Input::ParamsReady(1), 1), vec![boxed(1, 0, Some(8_000))]);
    // an older round's budget, arriving late, does not replace a newer one
    w.handle(Input::Budget { round: 3, budget_ms: 7_000, end_ms: 0 }, 2);
    w.handle(Input::Budget { round: 2, budget_ms: 9_000, end_ms: 0 }, 3);
    assert_eq!(w.budget_ms(), Some(7_000));
    assert_eq!(w.handle(Input::Trained(1), 10), vec![Action::Send(1), boxed(2, 1, Some(7_000))]);
    // a budget of 0 is no budget: τ steps
    w.handle(Input::Budget { round: 4, budget_ms: 0, end_ms: 0 }, 11);
    assert_eq!(w.budget_ms(), None);
    w.handle(open(2, 200, true), 12);
    w.handle(Input::ParamsReady(2), 13);
    assert_eq!(w.handle(Input::Trained(2), 20), vec![Action::Send(2), boxed(3, 1, None)]);
    // a lockstep worker runs τ steps whatever the budget
    let mut w = Worker::new(b"me".to_vec(), 1, 5);
    w.handle(Input::Budget { round: 1, budget_ms: 8_000, end_ms: 0 }, 0);
    w.handle(open(1, 100, true), 0);
    assert_eq!(w.handle(Input::ParamsReady(1), 1), vec![train(1, 0)]);
}

/// (a), continued: a worker that trains a round ahead stops its steps when the
/// median worker's end, so a late start does not make it late for good.
#[test]
fn the_announced_end_of_the_steps_stops_a_late_worker() {
    let mut w = ahead_of_round_two();
    let budget = |round, end_ms| Input::Budget { round, budget_ms: 8_000, end_ms };
    assert_eq!(w.handle(budget(2, 500), 12), vec![Action::EndSteps { round: 2, end_ms: 500 }]);
    // told once; an older announcement, or one without an end, tells nothing
    assert!(w.handle(budget(2, 600), 13).is_empty());
    assert!(w.handle(budget(1, 700), 13).is_empty());
    assert!(w.handle(budget(2, 0), 13).is_empty());
    w.handle(open(2, 200, true), 14);
    w.handle(Input::ParamsReady(2), 15);
    // round 3 is announced before round 2 is sent (this worker is a round behind):
    // round 3's steps get their end as they start
    assert!(w.handle(budget(3, 900), 16).is_empty());
    w.handle(open(3, 300, true), 16);
    let boxed = |round, behind| Action::Train {
        round,
        steps: 5,
        seed: data_seed(1, b"me", round),
        budget_ms: Some(8_000),
        behind,
    };
    assert_eq!(
        w.handle(Input::Trained(2), 20),
        vec![Action::Send(2), boxed(3, 1), Action::EndSteps { round: 3, end_ms: 900 }]
    );
    // steps that are done, a fresh start and a lockstep worker get no end
    let mut w = ahead_of_round_two();
    w.handle(Input::Trained(2), 20);
    assert!(w.handle(budget(2, 500), 21).is_empty());
    let mut w = overlapping();
    w.handle(budget(4, 500), 0);
    w.handle(open(4, 100, true), 0);
    assert_eq!(w.handle(Input::ParamsReady(4), 1), vec![boxed(4, 0)]);
    let mut w = Worker::new(b"me".to_vec(), 1, 5);
    w.handle(open(1, 100, true), 0);
    w.handle(Input::ParamsReady(1), 1);
    assert!(w.handle(budget(1, 500), 2).is_empty());
}

#[test]
fn a_round_without_this_worker_abandons_the_work_ahead() {
    let mut w = ahead_of_round_two();
    w.handle(Input::Sent(1), 11);
    assert_eq!(w.handle(open(2, 200, false), 15), vec![Action::Abandon(2)]);
    assert_eq!(w.phase(), Phase::Idle);
    // its next round starts afresh from the shepherd's parameters
    assert_eq!(w.handle(open(3, 300, true), 30), vec![Action::FetchParams(3)]);
    assert_eq!(w.handle(Input::ParamsReady(3), 31), vec![train(3, 0)]);
}

#[test]
fn overlapping_workers_abandon_nothing_at_a_deadline() {
    let mut w = ahead_of_round_two();
    w.handle(Input::Sent(1), 11);
    assert!(w.handle(Input::Tick, 150).is_empty());
    w.handle(open(2, 200, true), 160);
    assert!(w.handle(Input::Tick, 201).is_empty(), "a late contribution is carried over");
    assert_eq!(w.phase(), Phase::Merging(2));
    w.handle(Input::ParamsReady(2), 202);
    assert_eq!(w.handle(Input::Trained(2), 250), vec![Action::Send(2), train(3, 1)]);
}

#[test]
fn a_failed_send_does_not_stop_the_round_ahead_and_a_failed_round_does() {
    let mut w = ahead_of_round_two();
    assert!(w.handle(Input::Failed(1), 12).is_empty());
    assert_eq!((w.phase(), w.sending()), (Phase::Ahead(2), &[][..]));
    assert!(w.handle(Input::Failed(2), 13).is_empty());
    assert_eq!(w.phase(), Phase::Idle);
    // a failed update fetch too
    let mut w = ahead_of_round_two();
    w.handle(open(2, 200, true), 15);
    w.handle(Input::Failed(2), 16);
    assert_eq!(w.phase(), Phase::Idle);
}

#[test]
fn a_worker_that_joins_mid_run_overlaps_from_its_second_round() {
    let mut w = overlapping();
    // it fetches round 7's parameters like any worker: it has nothing to train from
    assert_eq!(w.handle(open(7, 100, true), 0), vec![Action::FetchParams(7)]);
    assert_eq!(w.handle(Input::ParamsReady(7), 1), vec![train(7, 0)]);
    assert_eq!(w.handle(Input::Trained(7), 9), vec![Action::Send(7), train(8, 1)]);
    assert_eq!(w.handle(open(8, 200, true), 12), vec![Action::FetchUpdate(8)]);
}

/// Random inputs, seeded: an overlapping worker never sends a round twice,
/// sends a round only once the update before it is merged (depth ≤ 2), rebases
/// in round order only after the send before, fetches one update at a time,
/// trains rounds in order and never trains from a base more than two updates
/// behind.
#[test]
fn random_inputs_keep_the_overlap_invariants() {
    use rand::{Rng, SeedableRng};
    // how often each rule came up, over every seed
    let mut seen = std::collections::BTreeMap::<&str, u32>::new();
    for seed in 0..300u64 {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let mut w = overlapping();
        let mut sent = Vec::new();
        // since the last fresh start: its round, the rounds rebased, the fetch in flight
        let (mut start, mut rebased, mut fetching): (u64, Vec<u64>, Option<u64>) = (0, Vec::new(), None);
        let (mut last_train, mut latest) = (0, 1);
        for now in 0..400u64 {
            // announcements go forward (or repeat); completions may be stale
            latest += u64::from(rng.gen_bool(0.1));
            let r = rng.gen_range(latest.saturating_sub(2).max(1)..=latest + 1);
            let input = match rng.gen_range(0..8) {
                0 => open(latest, now + rng.gen_range(0..40), rng.gen_bool(0.9)),
                1 | 2 => Input::ParamsReady(r),
                3 | 4 => Input::Trained(r),
                5 => Input::Sent(r),
                6 => Input::Failed(r),
                _ => Input::Budget { round: latest, budget_ms: rng.gen_range(0..3), end_ms: rng.gen_range(0..3) * now },
            };
            if matches!(input, Input::ParamsReady(p) if fetching == Some(p)) {
                fetching = None;
            }
            for a in w.handle(input, now) {
                let rule = match &a {
                    Action::Train { behind: 2, .. } => "depth 2",
                    Action::Rebase(_) => "rebase",
                    Action::UpdateLate(_) => "late",
                    Action::EndSteps { .. } => "end",
                    Action::Abandon(_) => "abandon",
                    _ => "other",
                };
                *seen.entry(rule).or_default() += 1;
                match a {
                    Action::FetchParams(r) => {
                        (start, fetching) = (r, None);
                        rebased.clear();
                    }
                    Action::Send(r) => {
                        assert!(!sent.contains(&r), "seed {seed}: round {r} sent twice");
                        assert!(r == start || rebased.contains(&(r - 1)) || r - 1 == start, "seed {seed}: {r}");
                        sent.push(r);
                    }
                    Action::Rebase(r) => {
                        assert!(rebased.last().is_none_or(|l| *l < r), "seed {seed}: rebase {r} after {rebased:?}");
                        assert!(sent.contains(&(r - 1)), "seed {seed}: rebase {r} before the send of {}", r - 1);
                        assert_ne!(fetching, Some(r), "seed {seed}: rebased {r} while fetching it");
                        rebased.push(r);
                    }
                    Action::FetchUpdate(r) => {
                        assert!(fetching.is_none(), "seed {seed}: fetch {r} beside {fetching:?}");
                        fetching = Some(r);
                    }
                    Action::Train { round, behind, budget_ms, .. } => {
                        assert!(round >= last_train, "seed {seed}: trains {round} after {last_train}");
                        assert!(behind <= 2 && budget_ms != Some(0), "seed {seed}: {behind} {budget_ms:?}");
                        last_train = round;
                    }
                    Action::EndSteps { round, end_ms } => {
                        assert!(round == last_train && end_ms > 0, "seed {seed}: ends {round} at {end_ms}");
                    }
                    _ => {}
                }
            }
            if w.phase() == Phase::Idle {
                (start, fetching) = (0, None);
                rebased.clear();
            }
            assert!(w.behind() <= 2, "seed {seed}");
            assert!(w.sending().windows(2).all(|p| p[0] < p[1]), "seed {seed}");
        }
    }
    for rule in ["depth 2", "rebase", "late", "end", "abandon"] {
        assert!(seen.get(rule).is_some_and(|n| *n > 10), "{rule} seldom came up: {seen:?}");
    }
}
