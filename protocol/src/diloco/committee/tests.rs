use super::*;
use crate::diloco::rating::Policy;

fn key(i: u8) -> Vec<u8> {
    vec![i; 32]
}

fn keys(n: u8) -> Vec<Vec<u8>> {
    (1..=n).map(key).collect()
}

fn losses(before: f32, after: f32, reversed: f32) -> Losses {
    Losses { before, after, reversed }
}

#[test]
fn a_committee_is_k_keys_without_its_sender_whatever_the_order() {
    let (seed, c) = ([7; 32], [9; 32]);
    let all = keys(20);
    let chosen = committee(&seed, &c, &key(3), &all, 3);
    assert_eq!(chosen.len(), 3);
    assert!(!chosen.contains(&key(3)), "the sender never screens itself");
    let mut shuffled = all.clone();
    shuffled.reverse();
    shuffled.extend(all.iter().take(5).cloned());
    assert_eq!(committee(&seed, &c, &key(3), &shuffled, 3), chosen, "order and duplicates change nothing");
    assert_eq!(committee(&seed, &c, &key(3), &all[..2], 3).len(), 2, "fewer when fewer are eligible");
}

#[test]
fn committees_change_with_the_seed_and_the_contribution_and_spread_the_load() {
    let all = keys(30);
    let a = committee(&[1; 32], &[1; 32], &key(1), &all, 3);
    assert_ne!(a, committee(&[2; 32], &[1; 32], &key(1), &all, 3), "another seed, another committee");
    assert_ne!(a, committee(&[1; 32], &[2; 32], &key(1), &all, 3), "another contribution too");
    // 1,000 contributions of 30 senders, 3 screeners each: every worker screens
    // about 100, none more than twice that
    let mut load = std::collections::BTreeMap::<Vec<u8>, u32>::new();
    for i in 0..1000u32 {
        let mut c = [0u8; 32];
        c[..4].copy_from_slice(&i.to_le_bytes());
        for p in committee(&[5; 32], &c, &all[(i % 30) as usize], &all, 3) {
            *load.entry(p).or_default() += 1;
        }
    }
    assert_eq!(load.len(), 30);
    assert!(load.values().all(|n| (50..=200).contains(n)), "{load:?}");
}

#[test]
fn spot_checks_follow_the_rate_and_the_seed() {
    let draws = |rate: f64| {
        (0..10_000u32)
            .filter(|i| {
                let mut c = [0u8; 32];
                c[..4].copy_from_slice(&i.to_le_bytes());
                spot_checked(&[3; 32], &c, rate)
            })
            .count()
    };
    assert_eq!(draws(0.0), 0);
    assert_eq!(draws(1.0), 10_000);
    let tenth = draws(0.1);
    assert!((900..=1100).contains(&tenth), "{tenth}");
    assert_eq!(spot_checked(&[3; 32], &[8; 32], 0.5), spot_checked(&[3; 32], &[8; 32], 0.5), "deterministic");
}

#[test]
fn the_median_of_a_majority_decides_and_a_lying_minority_cannot_move_it() {
    let mut t = Tally::new(keys(3));
    assert_eq!(t.quorum(), 2);
    t.answer(&key(1), losses(2.0, 1.9, 2.1)).expect("a member");
    assert_eq!(t.verdict(), None, "one of three is no quorum");
    // a liar claims a junk contribution helps a lot
    t.answer(&key(2), losses(2.0, 0.1, 9.0)).expect("a member");
    t.answer(&key(3), losses(2.0, 1.91, 2.09)).expect("a member");
    let v = t.verdict().expect("a quorum");
    assert_eq!(v, losses(2.0, 1.9, 2.1), "the median of each loss");
    assert!(v.passed(0.05) && !v.passed(0.5));
    assert_eq!(t.answer(&key(3), losses(1.0, 1.0, 1.0)), Err(Refused::Duplicate));
    assert_eq!(t.answer(&key(9), losses(1.0, 1.0, 1.0)), Err(Refused::NotMember));
    assert_eq!(Tally::new(keys(1)).answer(&key(1), losses(f32::NAN, 1.0, 1.0)), Err(Refused::NonFinite));
}

#[test]
fn a_spot_check_catches_a_screener_beyond_the_devices_noise() {
    let checked = losses(2.5, 2.4, 2.6);
    assert!(agrees(&losses(2.5, 2.4, 2.6), &checked));
    assert!(agrees(&losses(2.503, 2.402, 2.598), &checked), "bf16 on another device");
    assert!(!agrees(&losses(2.5, 2.3, 2.6), &checked), "a better 'after' than it is");
    assert!(!agrees(&losses(2.5, f32::NAN, 2.6), &checked));
    let mut t = Tally::new(keys(3));
    t.answer(&key(1), checked).expect("member");
    t.answer(&key(2), losses(2.5, 2.0, 3.0)).expect("member");
    assert_eq!(t.disagreeing(&checked), vec![key(2)]);
}

#[test]
fn only_rated_keys_that_neither_sit_out_nor_lied_may_screen() {
    let mut ratings = Ratings::new(Policy::default());
    for round in 1..=3 {
        for p in [1, 2, 3] {
            ratings.passed(&key(p), round, 0.1);
        }
    }
    ratings.passed(&key(4), 3, 0.1); // on probation
    ratings.caught(&key(3), 3); // sits out
    let candidates = keys(5);
    assert_eq!(eligible(&ratings, 4, &candidates, &[]), vec![key(1), key(2)]);
    assert_eq!(eligible(&ratings, 4, &candidates, &[key(2)]), vec![key(1)], "a caught liar is barred");
}

#[test]
fn the_screen_scores_a_contribution_at_its_best_step_along_its_direction() {
    let l = |before, after, reversed| Losses { before, after, reversed };
    // an honest contribution late in a run overshoots at the whole step: its best
    // step, 0.27 of it, still lowers the loss (nanogpt-small, fp32)
    let honest = l(2.6866, 2.7308, 2.8340);
    assert!(honest.improves());
    assert!((honest.best_step() - 0.2693).abs() < 1e-3, "{}", honest.best_step());
    assert!((honest.improvement() - 0.00695).abs() < 1e-4, "{}", honest.improvement());
    assert!(honest.passed(0.0007) && !honest.passed(0.01));
    // undershooting: the whole step is best, and its gain is before − after
    let early = l(3.0, 2.5, 3.6);
    assert_eq!(early.best_step(), 1.0);
    assert!((early.improvement() - 0.5).abs() < 1e-6);
    // the same direction at twice the norm: half the step, the same gain; at four
    // times, its best step falls under the bar
    let parabola = |s: f32| 2.0 - 0.1 * s + 0.5 * s * s;
    let at = |k: f32| l(parabola(0.0), parabola(k), parabola(-k));
    let (one, two, four) = (at(1.0), at(2.0), at(4.0));
    assert!((one.best_step() - 0.1).abs() < 1e-4 && (two.best_step() - 0.05).abs() < 1e-4);
    assert!((one.improvement() - two.improvement()).abs() < 1e-4, "{one:?} {two:?}");
    assert!((four.best_step() - 0.025).abs() < 1e-4 && !four.improves());
    // uphill, flat, reversed or not finite: no gain, and no pass at any bar
    for refused in [l(2.0, 2.1, 1.9), l(2.0, 2.0, 2.0), l(2.0, f32::NAN, 2.1), l(f32::INFINITY, 1.0, 2.0)] {
        assert!(!refused.improves() && refused.improvement() == 0.0 && !refused.passed(0.0), "{refused:?}");
    }
    // random values raise the loss both ways: a sliver of slope, best at a sliver
    // of the step, is no improvement, even with no gain bar (a run's first round)
    let noise = l(2.0, 2.0999, 2.1001);
    assert!(noise.best_step() > 0.0 && noise.best_step() < MIN_BEST_STEP);
    assert!(!noise.improves() && noise.improvement() == 0.0 && !noise.passed(0.0));
}
