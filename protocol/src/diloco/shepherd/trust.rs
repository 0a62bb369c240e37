//! Tests of the rules against untrusted participants: claims checked against the
//! manifest, per-tensor bounds, ratings, and the caps on a round.

use super::*;
use crate::diloco::sparse::{self, Layout, Packed};

fn config() -> Config {
    Config {
        rounds: 5,
        start_workers: 3,
        initial_deadline_ms: 1000,
        min_deadline_ms: 100,
        heartbeat_timeout_ms: 1_000_000,
        outer_lr: 1.0,
        outer_momentum: 0.0,
        sample_unit: 10,
        max_steps: 5,
        ..Config::default()
    }
}

fn send(peer: u32, round: u64, samples: u64, delta: Vec<Vec<f32>>) -> Input<u32> {
    Input::contribution(peer, round, samples, 2.0, Delta::Dense(delta))
}

fn rejection(actions: &[Action<u32>], who: u32) -> Option<Rejection> {
    actions.iter().find_map(|a| match a {
        Action::Rejected { peer, reason, .. } if *peer == who => Some(reason.clone()),
        _ => None,
    })
}

fn summary(actions: &[Action<u32>]) -> Option<RoundSummary<u32>> {
    actions.iter().find_map(|a| match a {
        Action::RoundCompleted(s) => Some(s.clone()),
        _ => None,
    })
}

/// A run of `rounds` where workers 1 and 2 send honest updates and worker 3 sends
/// `hostile(round)` (or nothing): the parameters after each round.
fn run(cfg: &Config, hostile: Option<&dyn Fn(u64) -> Input<u32>>) -> Vec<Tensors> {
    let workers = if hostile.is_some() { 3 } else { 2 };
    let mut s = Shepherd::new(Config { start_workers: workers, ..cfg.clone() }, vec![vec![0.0; 4]]);
    for p in 1..=workers as u32 {
        s.handle(Input::Joined(p), 0);
    }
    let mut after = Vec::new();
    for r in 1..=cfg.rounds {
        let now = r * 10;
        s.handle(send(1, r, 50, vec![vec![0.1, 0.2, 0.1, 0.0]]), now);
        let mut a = s.handle(send(2, r, 40, vec![vec![0.2, 0.1, 0.0, 0.1]]), now);
        if let Some(h) = hostile {
            a = s.handle(h(r), now);
        }
        assert!(summary(&a).is_some(), "round {r} closes once everyone answered");
        after.push(s.params().clone());
    }
    after
}

#[test]
fn a_claim_of_u64_max_samples_is_refused_and_the_rounds_match_the_rounds_without_it() {
    let cfg = config();
    let honest = run(&cfg, None);
    for claim in [u64::MAX, 1_000_000_000_000, 51, 60] {
        let liar = move |r| send(3, r, claim, vec![vec![-5.0, 9.0, 3.0, -1.0]]);
        let attacked = run(&cfg, Some(&liar));
        assert_eq!(attacked, honest, "a claim of {claim} samples moved the parameters");
    }
    // each refusal names the claim and the manifest's limit
    let mut s = Shepherd::new(Config { start_workers: 1, ..config() }, vec![vec![0.0; 4]]);
    s.handle(Input::Joined(1), 0);
    let a = s.handle(send(1, 1, u64::MAX, vec![vec![1.0; 4]]), 1);
    let reason = rejection(&a, 1).expect("refused");
    assert_eq!(reason, Rejection::Samples { claimed: u64::MAX, unit: 10, max: 50 });
    assert!(reason.to_string().contains("at most 50"), "{reason}");
    assert_eq!(s.check_samples(30), Ok(()), "three whole steps");
    assert!(matches!(s.check_samples(35), Err(Rejection::Samples { .. })), "not whole steps");
    assert_eq!(s.check_samples(0), Err(Rejection::NoSamples));
}

#[test]
fn a_contribution_concentrated_on_one_coordinate_is_clipped_to_the_rated_peers_scale() {
    let cfg = Config { rounds: 3, tensor_factor: 2.0, element_factor: 2.0, ..config() };
    // worker 3 puts a norm of 10 on one coordinate from round 2 (round 1 is honest: the reference)
    let concentrate = |r| {
        let d = if r == 1 { vec![0.1, 0.1, 0.1, 0.1] } else { vec![10.0, 0.0, 0.0, 0.0] };
        send(3, r, 50, vec![d])
    };
    let attacked = run(&cfg, Some(&concentrate));
    let honest = run(&cfg, None);
    // element clip: 2 × the median largest magnitude (0.2): the coordinate moves by at most
    // 0.4 × its weight of 50/140
    let moved = (attacked[1][0][0] - attacked[0][0][0]) - (honest[1][0][0] - honest[0][0][0]);
    assert!(moved.abs() < 0.2, "the concentrated coordinate moved by {moved}");
    // the summary names the contribution and what was clipped
    let mut s = Shepherd::new(Config { start_workers: 3, ..cfg.clone() }, vec![vec![0.0; 4]]);
    for p in 1..=3 {
        s.handle(Input::Joined(p), 0);
    }
    for r in 1..=2 {
        s.handle(send(1, r, 50, vec![vec![0.1, 0.2, 0.1, 0.0]]), r);
        s.handle(send(2, r, 40, vec![vec![0.2, 0.1, 0.0, 0.1]]), r);
        let a = s.handle(concentrate(r), r);
        let sum = summary(&a).expect("closes");
        if r == 2 {
            assert_eq!(sum.bounded, vec![(3, 1, 1)], "its tensor scaled to the bound, then its one value clipped");
        } else {
            assert!(sum.bounded.is_empty(), "no reference in round 1: {:?}", sum.bounded);
        }
    }
}

/// A scaled-up honest delta (`huge`: 10⁶ × an honest Δ) comes out as that Δ at
/// its tensor's bound: the scale comes before the element clip. Clipped first, it
/// would be ±clip in every value, a sign vector at the bound (cosine 0.91 to the
/// honest Δ here), which averaged unscreened costs an fp32 run 21% of its loss
/// (`bench/sleepers.sh`, 9 of 20 sleepers past the screen's budget).
#[test]
fn a_scaled_up_honest_delta_keeps_its_shape_at_the_bound() {
    let honest: Vec<f32> = (0..64).map(|i| ((i * 37 % 11) as f32 - 5.0) * 1e-2).collect();
    let norm = |v: &[f32]| v.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
    // the references: a tensor bound of 2 × the honest norm, an element clip of 4 × its largest value
    let bounds = Bounds { tensor: vec![2.0 * norm(&honest)], element: vec![4.0 * 0.05] };
    let huge = Delta::Dense(vec![honest.iter().map(|v| v * 1e6).collect()]);
    let (bounded, n, clipping) = huge.bounded(&bounds);
    let Delta::Dense(t) = bounded else { panic!("dense stays dense") };
    let dot: f64 = t[0].iter().zip(&honest).map(|(a, b)| f64::from(*a) * f64::from(*b)).sum();
    let cosine = dot / (norm(&t[0]) * norm(&honest));
    assert!(cosine > 0.9999, "cosine {cosine}: the honest shape is kept");
    assert!((n / (2.0 * norm(&honest)) - 1.0).abs() < 1e-4, "at the bound: {n}");
    assert_eq!((clipping.tensors, clipping.elements), (1, 0));
}

#[test]
fn a_sparse_message_is_bounded_like_its_dense_form() {
    let sizes = [256usize, 64];
    let tensors: Tensors =
        sizes.iter().map(|n| (0..*n).map(|i| ((i * 37 % 11) as f32 - 5.0) * 1e-2).collect()).collect();
    let layout = Layout { chunk: 64, k: 4, bits: 2, strided: false };
    let (bytes, _) = sparse::encode_seeded(&tensors, layout, 3);
    let packed = Delta::Packed(Packed::check(&bytes, &sizes, layout, 3).expect("checks"));
    let bounds = Bounds { tensor: vec![0.05, f64::INFINITY], element: vec![0.03, 0.01] };
    let dense = Delta::Dense(packed.to_dense(&sizes));
    let (a, na, ca) = packed.bounded(&bounds);
    let (b, nb, cb) = dense.bounded(&bounds);
    assert_eq!(ca.tensors, cb.tensors);
    assert!(ca.elements > 0 && ca.elements == cb.elements, "{ca:?} {cb:?}");
    assert!((na - nb).abs() < 1e-6, "{na} {nb}");
    let (a, b) = (a.to_dense(&sizes), b.to_dense(&sizes));
    for (x, y) in a.iter().flatten().zip(b.iter().flatten()) {
        assert!((x - y).abs() < 1e-6, "{x} {y}");
    }
    assert!(a[1].iter().all(|v| v.abs() <= 0.01 + 1e-7), "element clip");
    assert!(na <= 0.05 + 1e-6 + a[1].iter().map(|v| f64::from(*v).powi(2)).sum::<f64>().sqrt());
}

#[test]
fn a_peer_caught_by_the_screen_loses_its_rating_and_probation_counts_less() {
    let cfg = Config { rating: Some(Policy { probation_rounds: 1, probation_weight: 0.25, alpha: 0.5 }), ..config() };
    let mut s = Shepherd::new(Config { start_workers: 2, ..cfg }, vec![vec![0.0; 4]]);
    s.handle(Input::Joined(1), 0);
    s.handle(Input::Joined(2), 0);
    // round 1: 1 passes its screen, 2 is caught
    s.handle(send(1, 1, 50, vec![vec![1.0, 0.0, 0.0, 0.0]]).passed(0.5), 1);
    let caught = Rejection::NoImprovement { before: 1.0, after: 1.2, reversed: 0.9 };
    let a = s.handle(Input::Malformed { peer: 2, round: 1, reason: caught.clone() }, 1);
    assert!(summary(&a).is_some());
    assert!(!s.ratings().on_probation(&1) && s.ratings().on_probation(&2));
    assert!(!s.sits_out(&2, 2) && s.screen_owed(&2, 2), "a first catch: probation, screened, no sit-out");
    // round 2: both send the same samples; 2 on probation counts a quarter
    let before = s.params().clone();
    s.handle(send(2, 2, 50, vec![vec![0.0, 0.0, 1.0, 0.0]]), 2);
    let a = s.handle(send(1, 2, 50, vec![vec![0.0, 1.0, 0.0, 0.0]]), 2);
    let sum = summary(&a).expect("round 2");
    assert_eq!(sum.discounted, vec![(2, 0.25, true)]);
    let p = s.params();
    let moved = |i: usize| before[0][i] - p[0][i];
    assert!((moved(1) - 0.8).abs() < 1e-6 && (moved(2) - 0.2).abs() < 1e-6, "weights 1 and 0.25: {p:?}");
    // round 3: 2 is caught again, and sits round 4 out (refused unscreened)
    s.handle(Input::Malformed { peer: 2, round: 3, reason: caught }, 3);
    assert!(summary(&s.handle(send(1, 3, 50, vec![vec![0.0, 0.0, 0.0, 1.0]]).passed(0.5), 3)).is_some());
    let a = s.handle(send(2, 4, 50, vec![vec![0.0, 0.0, 1.0, 0.0]]), 4);
    assert_eq!(rejection(&a, 2), Some(Rejection::SitsOut { until: 4 }));
    assert!(!s.screen_owed(&2, 4) && s.screen_owed(&2, 5), "owed screens once back");
}

#[test]
fn tiny_early_contributions_do_not_drag_the_bound_once_peers_are_rated() {
    let policy = Policy { probation_rounds: 1, probation_weight: 0.25, alpha: 0.5 };
    let cfg = Config { rating: Some(policy), start_workers: 4, ..config() };
    let mut s = Shepherd::new(cfg, vec![vec![0.0; 4]]);
    for p in 1..=4 {
        s.handle(Input::Joined(p), 0);
    }
    // round 1: the honest 1 and 2 are rated; 3 and 4 stay on probation (no screen)
    for p in [1, 2] {
        s.handle(send(p, 1, 50, vec![vec![1.0, 0.0, 0.0, 0.0]]).passed(0.1), 1);
    }
    s.handle(send(3, 1, 50, vec![vec![1.0, 0.0, 0.0, 0.0]]), 1);
    assert!(summary(&s.handle(send(4, 1, 50, vec![vec![1.0, 0.0, 0.0, 0.0]]), 1)).is_some());
    // round 2: 3 and 4 send tiny updates first; the honest ones are not scaled down
    s.handle(send(3, 2, 50, vec![vec![1e-4, 0.0, 0.0, 0.0]]), 2);
    s.handle(send(4, 2, 50, vec![vec![1e-4, 0.0, 0.0, 0.0]]), 2);
    s.handle(send(1, 2, 50, vec![vec![1.0, 0.0, 0.0, 0.0]]), 2);
    let a = s.handle(send(2, 2, 50, vec![vec![1.0, 0.0, 0.0, 0.0]]), 2);
    let sum = summary(&a).expect("round 2");
    assert!(sum.scaled.is_empty(), "honest contributions scaled down: {:?}", sum.scaled);
    assert!((sum.norm_bound - 1.0).abs() < 1e-9, "the rated peers' norm: {}", sum.norm_bound);
}

#[test]
fn rounds_take_the_best_rated_participants_and_aggregate_at_most_the_cap() {
    let policy = Policy { probation_rounds: 1, probation_weight: 0.25, alpha: 0.5 };
    let cfg = Config { rating: Some(policy), start_workers: 3, max_participants: 3, aggregate_max: 2, ..config() };
    let mut s = Shepherd::new(cfg, vec![vec![0.0; 4]]);
    for p in 1..=5 {
        s.handle(Input::Joined(p), u64::from(p));
    }
    // round 1 takes the three that joined first, and aggregates the first two of them
    let participants = |s: &Shepherd<u32>| s.open.as_ref().map(|o| o.participants.iter().copied().collect::<Vec<_>>());
    assert_eq!(participants(&s), Some(vec![1, 2, 3]));
    for (p, score) in [(1, 0.1), (2, 0.2)] {
        s.handle(send(p, 1, 50, vec![vec![0.1; 4]]).passed(score), 6);
    }
    // 3 is third of three: not aggregated, but its screen still rates it
    let a = s.handle(send(3, 1, 50, vec![vec![0.1; 4]]).passed(0.3), 6);
    assert_eq!(rejection(&a, 3), Some(Rejection::NotSelected { max: 2 }));
    assert!(!s.ratings().on_probation(&3));
    assert_eq!(summary(&a).expect("round 1").contributors, vec![1, 2]);
    // round 2: the rated 1, 2 and 3 again (the newcomers wait); the best two are 3 and 2
    assert_eq!(participants(&s), Some(vec![1, 2, 3]));
    let a = s.handle(send(1, 2, 50, vec![vec![0.1; 4]]), 7);
    assert_eq!(rejection(&a, 1), Some(Rejection::NotSelected { max: 2 }));
}

#[test]
fn participants_on_probation_do_not_hold_a_round_once_the_rated_ones_answered() {
    let policy = Policy { probation_rounds: 1, probation_weight: 0.25, alpha: 0.5 };
    let long = 100_000;
    let cfg = Config { rating: Some(policy), start_workers: 2, min_deadline_ms: long, ..config() };
    let mut s = Shepherd::new(cfg, vec![vec![0.0; 4]]);
    s.handle(Input::Joined(1), 0);
    s.handle(Input::Joined(2), 0);
    // 3 joins during round 1: on probation in round 2, and silent
    s.handle(Input::Joined(3), 5);
    for p in [1, 2] {
        s.handle(send(p, 1, 50, vec![vec![0.1; 4]]).passed(0.1), 10);
    }
    assert_eq!(s.completed(), 1);
    // round 2 opened at 10; the rated 1 and 2 answer at 410: 3 has a quarter of that, 100 ms
    s.handle(send(1, 2, 50, vec![vec![0.1; 4]]), 410);
    s.handle(send(2, 2, 50, vec![vec![0.1; 4]]), 410);
    assert_eq!(s.deadline_ms(), Some(510));
    assert!(summary(&s.handle(Input::Tick, 509)).is_none());
    let sum = summary(&s.handle(Input::Tick, 510)).expect("closed at the grace, not the deadline");
    assert_eq!((sum.excluded, sum.at_deadline), (vec![3], true));
}

#[test]
fn a_round_waits_no_longer_than_twice_the_time_half_its_participants_took() {
    let policy = Policy { probation_rounds: 3, probation_weight: 0.25, alpha: 0.5 };
    // a first round waits at least a tenth of its initial deadline (compiles): 2 s here
    let cfg = Config { rating: Some(policy), start_workers: 4, initial_deadline_ms: 20_000, ..config() };
    let mut s = Shepherd::new(cfg, vec![vec![0.0; 4]]);
    for p in 1..=4 {
        s.handle(Input::Joined(p), 0);
    }
    // everyone is new; 1 and 2 answer at 1000 ms, 3 and 4 hold back for the deadline
    s.handle(send(1, 1, 50, vec![vec![0.1; 4]]), 1_000);
    s.handle(send(2, 1, 50, vec![vec![0.1; 4]]), 1_000);
    assert_eq!(s.deadline_ms(), Some(2_000), "twice the time half of them took, not ten minutes");
    let sum = summary(&s.handle(Input::Tick, 2_000)).expect("closed");
    assert_eq!(sum.excluded, vec![3, 4]);
}
