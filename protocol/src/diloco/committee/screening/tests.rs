use super::*;

fn key(i: u8) -> Vec<u8> {
    vec![i; 32]
}

fn keys(n: u8) -> Vec<Vec<u8>> {
    (1..=n).map(key).collect()
}

/// An honest score: the loss falls from 3.0 to 2.9, and rises reversed.
const HONEST: Losses = Losses { before: 3.0, after: 2.9, reversed: 3.1 };
/// Another device's honest score: within the noise of [`HONEST`].
const HONEST_ELSEWHERE: Losses = Losses { before: 3.001, after: 2.9005, reversed: 3.1002 };
/// A `screen-low` lie: a contribution that helps nothing made to look good.
const LOW: Losses = Losses { before: 3.0, after: 2.0, reversed: 3.5 };

fn config(k: usize, spot_rate: f64) -> Config {
    Config { k, spot_rate, wait_ms: 1_000 }
}

fn id(i: u8) -> ContributionId {
    [i; 32]
}

/// Receives contribution `i` from `sender` at time 0; returns its committee.
fn receive(s: &mut Screening<Vec<u8>>, i: u8, sender: u8) -> Vec<Vec<u8>> {
    let actions = s.on(Input::Received { contribution: id(i), sender: key(sender), now_ms: 0 }).expect("received");
    match actions.as_slice() {
        [Action::Request { contribution, screeners }] if *contribution == id(i) => screeners.clone(),
        other => panic!("expected a request, got {other:?}"),
    }
}

fn report(s: &mut Screening<Vec<u8>>, i: u8, screener: &[u8], losses: Losses) -> Vec<Action<Vec<u8>>> {
    s.on(Input::Reported { contribution: id(i), screener: screener.to_vec(), losses }).expect("counted")
}

#[test]
fn an_agreeing_committee_decides_once_every_member_answered() {
    let mut s = Screening::new([7; 32], config(3, 0.0), keys(10), Vec::new());
    let members = receive(&mut s, 1, 4);
    assert_eq!(members.len(), 3);
    assert!(!members.contains(&key(4)), "the sender never screens itself");
    assert!(report(&mut s, 1, &members[0], HONEST).is_empty());
    assert!(report(&mut s, 1, &members[1], HONEST_ELSEWHERE).is_empty(), "a quorum waits for the last member");
    let actions = report(&mut s, 1, &members[2], HONEST);
    assert_eq!(actions, [Action::Verdict { contribution: id(1), losses: HONEST, source: Source::Committee }]);
    assert_eq!(s.pending(), 0);
    assert!(matches!(report_err(&mut s, 1, &members[0]), Ignored::Unknown(_)), "decided: later answers are ignored");
}

fn report_err(s: &mut Screening<Vec<u8>>, i: u8, screener: &[u8]) -> Ignored {
    s.on(Input::Reported { contribution: id(i), screener: screener.to_vec(), losses: HONEST }).expect_err("ignored")
}

#[test]
fn a_lying_member_makes_the_shepherd_score_and_is_caught_and_barred() {
    let mut s = Screening::new([7; 32], config(3, 0.0), keys(10), Vec::new());
    let members = receive(&mut s, 1, 9);
    let liar = members[1].clone();
    report(&mut s, 1, &members[0], HONEST);
    report(&mut s, 1, &liar, LOW);
    let actions = report(&mut s, 1, &members[2], HONEST_ELSEWHERE);
    assert_eq!(actions, [Action::Score { contribution: id(1), why: Why::Disagreement }]);
    let actions = s.on(Input::Scored { contribution: id(1), losses: HONEST }).expect("asked");
    assert_eq!(
        actions,
        [
            Action::Caught { screener: liar.clone(), contribution: id(1), claimed: LOW, checked: HONEST },
            Action::Verdict { contribution: id(1), losses: HONEST, source: Source::Shepherd },
        ]
    );
    assert_eq!(s.barred(), std::slice::from_ref(&liar));
    // never on a committee again, this round or the next, and its answers no longer count
    for i in 2..40 {
        assert!(!receive(&mut s, i, 9).contains(&liar), "contribution {i}");
    }
    assert!(matches!(report_err(&mut s, 2, &liar), Ignored::Barred(_)));
    let mut next = Screening::new([8; 32], config(3, 0.0), keys(10), s.barred().to_vec());
    for i in 0..40 {
        assert!(!receive(&mut next, i, 9).contains(&liar));
    }
}

/// A liar's lie, high or low, cannot be the verdict: with one liar on a committee
/// of three, the shepherd scores it and its own losses decide.
#[test]
fn no_lie_of_one_member_is_ever_the_verdict() {
    let high = Losses { before: 3.0, after: 3.9, reversed: 2.5 };
    for lie in [LOW, high] {
        for seat in 0..3 {
            let mut s = Screening::new([3; 32], config(3, 0.0), keys(6), Vec::new());
            let members = receive(&mut s, 1, 1);
            let mut actions = Vec::new();
            for (m, member) in members.iter().enumerate() {
                actions = report(&mut s, 1, member, if m == seat { lie } else { HONEST });
            }
            assert_eq!(actions, [Action::Score { contribution: id(1), why: Why::Disagreement }], "{lie:?} at {seat}");
            let actions = s.on(Input::Scored { contribution: id(1), losses: HONEST }).expect("asked");
            assert!(matches!(actions.last(), Some(Action::Verdict { losses: HONEST, .. })), "{actions:?}");
        }
    }
}

#[test]
fn a_silent_member_is_named_and_a_silent_majority_makes_the_shepherd_score() {
    let mut s = Screening::new([7; 32], config(3, 0.0), keys(10), Vec::new());
    let members = receive(&mut s, 1, 1);
    report(&mut s, 1, &members[0], HONEST);
    report(&mut s, 1, &members[2], HONEST_ELSEWHERE);
    assert!(s.on(Input::Tick { now_ms: 999 }).expect("tick").is_empty(), "the wait has not passed");
    let actions = s.on(Input::Tick { now_ms: 1_000 }).expect("tick");
    assert_eq!(
        actions,
        [
            Action::Silent { contribution: id(1), screeners: vec![members[1].clone()] },
            Action::Verdict { contribution: id(1), losses: HONEST, source: Source::Committee },
        ]
    );
    assert!(s.barred().is_empty(), "silence is not a lie");

    let members = receive(&mut s, 2, 1);
    report(&mut s, 2, &members[0], HONEST);
    let actions = s.on(Input::Tick { now_ms: 1_000 }).expect("tick");
    assert_eq!(
        actions,
        [
            Action::Silent { contribution: id(2), screeners: members[1..].to_vec() },
            Action::Score { contribution: id(2), why: Why::Silence },
        ]
    );
    assert!(s.on(Input::Tick { now_ms: 5_000 }).expect("tick").is_empty(), "asked once");
}

/// A member that declines (its request refused: a screener takes a few at once)
/// settles the committee as soon as the others answered, rather than at the end
/// of the wait: before, a committee one of whose members refused waited out its
/// whole wait (10 s in pcp-node) even with a quorum answered.
#[test]
fn a_declining_member_settles_its_committee_without_the_wait() {
    let mut s = Screening::new([7; 32], config(3, 0.0), keys(10), Vec::new());
    let declined = |s: &mut Screening<Vec<u8>>, i: u8, m: &[u8]| {
        s.on(Input::Declined { contribution: id(i), screener: m.to_vec() }).expect("counted")
    };
    let members = receive(&mut s, 1, 1);
    assert!(report(&mut s, 1, &members[0], HONEST).is_empty());
    assert!(declined(&mut s, 1, &members[1]).is_empty(), "one member still to answer");
    assert!(declined(&mut s, 1, &members[1]).is_empty(), "declining twice counts once");
    assert!(declined(&mut s, 1, &key(200)).is_empty(), "a non-member is ignored");
    let actions = report(&mut s, 1, &members[2], HONEST_ELSEWHERE);
    assert_eq!(
        actions,
        [
            Action::Silent { contribution: id(1), screeners: vec![members[1].clone()] },
            Action::Verdict { contribution: id(1), losses: HONEST, source: Source::Committee },
        ]
    );
    // no quorum left: the shepherd scores it at once
    let members = receive(&mut s, 2, 1);
    assert!(declined(&mut s, 2, &members[0]).is_empty());
    let actions = declined(&mut s, 2, &members[1]);
    assert_eq!(
        actions,
        [
            Action::Silent { contribution: id(2), screeners: members.clone() },
            Action::Score { contribution: id(2), why: Why::Silence },
        ]
    );
    assert!(s.on(Input::Tick { now_ms: 5_000 }).expect("tick").is_empty(), "asked once");
}

#[test]
fn too_few_screeners_make_the_shepherd_score_alone() {
    // two eligible, one of them the sender: no majority of 3
    let mut s = Screening::new([7; 32], config(3, 0.0), keys(2), Vec::new());
    let actions = s.on(Input::Received { contribution: id(1), sender: key(1), now_ms: 0 }).expect("received");
    assert_eq!(actions, [Action::Score { contribution: id(1), why: Why::NoCommittee }]);
    let actions = s.on(Input::Scored { contribution: id(1), losses: HONEST }).expect("asked");
    assert_eq!(actions, [Action::Verdict { contribution: id(1), losses: HONEST, source: Source::Shepherd }]);
    // --screeners 0: the shepherd screens every contribution, as without committees
    let mut s = Screening::new([7; 32], config(0, 0.0), keys(10), Vec::new());
    let actions = s.on(Input::Received { contribution: id(1), sender: key(1), now_ms: 0 }).expect("received");
    assert_eq!(actions, [Action::Score { contribution: id(1), why: Why::NoCommittee }]);
    // two of three eligible: a majority, and the verdict once both answered
    let mut s = Screening::new([7; 32], config(3, 0.0), keys(3), Vec::new());
    let members = receive(&mut s, 1, 1);
    assert_eq!(members.len(), 2);
    report(&mut s, 1, &members[0], HONEST);
    assert_eq!(report(&mut s, 1, &members[1], HONEST).len(), 1);
}

/// A majority that lies alike agrees with itself: only the spot check catches it,
/// at the spot rate. At rate 1 every contribution is checked and both liars are
/// caught at once; at rate 0 the lie passes (the limit the docs state).
#[test]
fn a_colluding_majority_is_caught_by_the_spot_check_only() {
    for (rate, caught) in [(1.0, true), (0.0, false)] {
        let mut s = Screening::new([7; 32], config(3, rate), keys(10), Vec::new());
        let members = receive(&mut s, 1, 1);
        report(&mut s, 1, &members[0], LOW);
        report(&mut s, 1, &members[1], LOW);
        let actions = report(&mut s, 1, &members[2], HONEST);
        // the honest member disagrees with the liars' median
        assert_eq!(actions, [Action::Score { contribution: id(1), why: Why::Disagreement }]);
        s.on(Input::Scored { contribution: id(1), losses: HONEST }).expect("asked");
        assert_eq!(s.barred().len(), 2, "both liars, whatever the rate");
        // a committee of liars only
        let mut s = Screening::new([7; 32], config(3, rate), keys(4), Vec::new());
        let members = receive(&mut s, 1, 4);
        let mut actions = Vec::new();
        for m in &members {
            actions = report(&mut s, 1, m, LOW);
        }
        if caught {
            assert_eq!(actions, [Action::Score { contribution: id(1), why: Why::SpotCheck }]);
            let actions = s.on(Input::Scored { contribution: id(1), losses: HONEST }).expect("asked");
            assert_eq!(actions.iter().filter(|a| matches!(a, Action::Caught { .. })).count(), 3);
        } else {
            assert_eq!(actions, [Action::Verdict { contribution: id(1), losses: LOW, source: Source::Committee }]);
        }
    }
}

#[test]
fn spot_checks_follow_the_rate() {
    let mut s = Screening::new([5; 32], config(3, 0.1), keys(20), Vec::new());
    let mut spot = 0;
    for i in 0..=255u8 {
        let members = receive(&mut s, i, 20);
        let mut actions = Vec::new();
        for m in &members {
            actions = report(&mut s, i, m, HONEST);
        }
        if actions == [Action::Score { contribution: id(i), why: Why::SpotCheck }] {
            spot += 1;
            s.on(Input::Scored { contribution: id(i), losses: HONEST }).expect("asked");
        }
    }
    assert!((12..=40).contains(&spot), "{spot} of 256 at 10%");
}

#[test]
fn bad_inputs_are_named_and_change_nothing() {
    let mut s = Screening::new([7; 32], config(3, 0.0), keys(10), Vec::new());
    let members = receive(&mut s, 1, 1);
    let dup = s.on(Input::Received { contribution: id(1), sender: key(1), now_ms: 0 }).expect_err("duplicate");
    assert!(matches!(dup, Ignored::Duplicate(_)), "{dup}");
    let stranger = (1..=10).map(key).find(|k| !members.contains(k) && *k != key(1)).expect("a stranger");
    let e = report_err(&mut s, 1, &stranger);
    assert_eq!(e, Ignored::Answer { id: "01010101".into(), why: Refused::NotMember });
    report(&mut s, 1, &members[0], HONEST);
    assert!(matches!(report_err(&mut s, 1, &members[0]), Ignored::Answer { why: Refused::Duplicate, .. }));
    let nan = Losses { after: f32::NAN, ..HONEST };
    let e = s.on(Input::Reported { contribution: id(1), screener: members[1].clone(), losses: nan }).expect_err("nan");
    assert!(matches!(e, Ignored::Answer { why: Refused::NonFinite, .. }), "{e}");
    let e = s.on(Input::Scored { contribution: id(1), losses: HONEST }).expect_err("not asked");
    assert!(matches!(e, Ignored::NotAsked(_)), "{e}");
    assert!(matches!(report_err(&mut s, 9, &members[0]), Ignored::Unknown(_)));
    assert_eq!(s.pending(), 1);
    assert_eq!(report(&mut s, 1, &members[1], HONEST).len(), 0);
    assert_eq!(report(&mut s, 1, &members[2], HONEST).len(), 1, "still decided by its members");
}

/// The same contributions and answers give the same actions whatever order the
/// eligible screeners are listed in.
#[test]
fn the_order_of_the_screeners_changes_nothing() {
    let run = |eligible: Vec<Vec<u8>>| {
        let mut s = Screening::new([9; 32], config(3, 0.2), eligible, Vec::new());
        let mut all = Vec::new();
        for i in 0..30 {
            let members = receive(&mut s, i, i % 12 + 1);
            for (n, m) in members.iter().enumerate() {
                all.extend(report(&mut s, i, m, if n == 0 && i % 5 == 0 { LOW } else { HONEST }));
            }
            if s.pending() > 0 {
                all.extend(s.on(Input::Scored { contribution: id(i), losses: HONEST }).expect("asked"));
            }
            all.push(Action::Request { contribution: id(i), screeners: members });
        }
        all
    };
    let mut reversed = keys(12);
    reversed.reverse();
    assert_eq!(run(keys(12)), run(reversed));
}

#[test]
fn screeners_enlisted_as_their_own_contributions_arrive_screen_the_later_ones() {
    // nobody eligible when the round opens: the first contributions are the shepherd's
    let mut s: Screening<Vec<u8>> = Screening::new([7; 32], config(3, 0.0), Vec::new(), vec![key(9)]);
    let first = s.on(Input::Received { contribution: id(1), sender: key(1), now_ms: 0 }).expect("received");
    assert_eq!(first, [Action::Score { contribution: id(1), why: Why::NoCommittee }]);
    for k in [1, 2, 2, 9] {
        s.enlist(key(k));
    }
    assert_eq!(s.eligible(), [key(1), key(2)], "once each, and never a barred screener");
    // two eligible besides the sender: a committee of two, a quorum of three's
    assert_eq!(receive(&mut s, 2, 3).len(), 2);
    // its own sender is left out: one is not a quorum
    let own = s.on(Input::Received { contribution: id(3), sender: key(1), now_ms: 0 }).expect("received");
    assert_eq!(own, [Action::Score { contribution: id(3), why: Why::NoCommittee }]);
}

/// A spot check the shepherd has no budget for is waived: the agreeing median
/// decides. Only a spot check is waived: a disagreement must be scored.
#[test]
fn a_spot_check_may_be_waived_and_a_disagreement_may_not() {
    let mut s = Screening::new([7; 32], config(3, 1.0), keys(10), Vec::new());
    let members = receive(&mut s, 1, 1);
    let mut actions = Vec::new();
    for m in &members {
        actions = report(&mut s, 1, m, HONEST);
    }
    assert_eq!(actions, [Action::Score { contribution: id(1), why: Why::SpotCheck }]);
    let actions = s.on(Input::Waived { contribution: id(1) }).expect("a spot check");
    assert_eq!(actions, [Action::Verdict { contribution: id(1), losses: HONEST, source: Source::Committee }]);
    assert_eq!(s.pending(), 0);
    // a disagreement
    let members = receive(&mut s, 2, 1);
    report(&mut s, 2, &members[0], LOW);
    report(&mut s, 2, &members[1], HONEST);
    let actions = report(&mut s, 2, &members[2], HONEST);
    assert_eq!(actions, [Action::Score { contribution: id(2), why: Why::Disagreement }]);
    assert!(matches!(s.on(Input::Waived { contribution: id(2) }), Err(Ignored::NotAsked(_))));
    assert!(matches!(s.on(Input::Waived { contribution: id(9) }), Err(Ignored::Unknown(_))));
}

/// A contribution the shepherd cannot have to score (an aggregated one whose
/// sender serves it no slice) is withdrawn: no verdict, nobody caught, and a
/// member's late answer is ignored.
#[test]
fn a_withdrawn_contribution_leaves_without_a_verdict() {
    let mut s = Screening::new([7; 32], config(3, 0.0), keys(10), Vec::new());
    let members = receive(&mut s, 1, 1);
    assert!(report(&mut s, 1, &members[0], LOW).is_empty());
    let actions = s.on(Input::Withdrawn { contribution: id(1) }).expect("withdrawn");
    assert!(actions.is_empty(), "{actions:?}");
    assert_eq!(s.pending(), 0);
    assert!(matches!(report_err(&mut s, 1, &members[1]), Ignored::Unknown(_)));
    assert!(s.on(Input::Tick { now_ms: 5_000 }).expect("tick").is_empty());
    let again = s.on(Input::Withdrawn { contribution: id(1) }).expect_err("unknown");
    assert!(matches!(again, Ignored::Unknown(_)));
}
