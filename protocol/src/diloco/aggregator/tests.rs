use super::*;
use crate::diloco::Tensors;
use crate::diloco::aggregate::RunningMean;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::BTreeMap;

const SIZES: [usize; 2] = [12, 5];
const ROUND: u64 = 4;
const SHARD: usize = 3;
const A: u8 = 1;
const B: u8 = 2;
const C: u8 = 3;

fn tensors(rng: &mut StdRng) -> Tensors {
    SIZES.iter().map(|n| (0..*n).map(|_| rng.gen_range(-1.0f32..1.0)).collect()).collect()
}

fn bytes(t: &Tensors) -> Vec<u8> {
    compress::encode(t, Encoding::F32)
}

fn spec(replicas: Vec<u8>, place: Place) -> ShardSpec<u8> {
    ShardSpec { shard: SHARD, tensors: 0..2, sizes: SIZES.to_vec(), bounds: Bounds::none(), replicas, place }
}

fn assigned(agg: &mut Aggregator<u8>, place: Place) {
    let shards = vec![spec(vec![A, B], place)];
    assert!(agg.handle(Input::Assigned { round: ROUND, encoding: Encoding::F32, shards }).is_empty());
}

fn slice(worker: u8, bytes: Vec<u8>, forwarded: bool) -> Input<u8> {
    Input::Slice { round: ROUND, shard: SHARD, worker, bytes, forwarded }
}

fn accepted(worker: u8, b: &[u8], seq: u64) -> Input<u8> {
    let accept = Accept { seq, weight: 1.0 + seq as f64, norm: 0.0, bound: f64::INFINITY };
    Input::Accepted { round: ROUND, shard: SHARD, worker, hash: slice_hash(b), accept }
}

fn published(actions: &[Action<u8>]) -> Option<ShardUpdate> {
    actions.iter().find_map(|a| match a {
        Action::Publish { update, .. } => Some(update.clone()),
        _ => None,
    })
}

/// The shepherd's own mean of `contributions`, in order, with the accepts' weights.
fn reference(contributions: &[Tensors]) -> Tensors {
    let mut mean = RunningMean::default();
    for (seq, t) in contributions.iter().enumerate() {
        mean.push(Delta::Dense(t.clone()), 1.0 + seq as f64, 0.0, f64::INFINITY, &SIZES);
    }
    mean.finish().unwrap()
}

#[test]
fn replicas_fed_in_different_orders_publish_the_shepherds_mean() {
    let mut rng = StdRng::seed_from_u64(7);
    let workers = [10u8, 11, 12];
    let contributions: Vec<Tensors> = workers.iter().map(|_| tensors(&mut rng)).collect();
    let encoded: Vec<Vec<u8>> = contributions.iter().map(bytes).collect();
    let mut first = Aggregator::new(16, 1);
    let mut second = Aggregator::new(16, 2);
    assigned(&mut first, Place::Replica(0));
    assigned(&mut second, Place::Replica(1));
    // the first replica takes the uploads in order, reports each and forwards it
    for (w, b) in workers.iter().zip(&encoded) {
        let out = first.handle(slice(*w, b.clone(), false));
        assert!(
            out.iter().any(|a| matches!(a, Action::Forward { to, worker, .. } if to == &vec![B] && worker == w)),
            "{out:?}"
        );
        let hash = slice_hash(b);
        assert!(out.iter().any(|a| matches!(a, Action::Report { hash: h, .. } if *h == hash)), "{out:?}");
    }
    // the second gets the forwards in reverse, and the accepts before some slices
    second.handle(accepted(workers[0], &encoded[0], 0));
    for i in (0..3).rev() {
        let out = second.handle(slice(workers[i], encoded[i].clone(), true));
        assert!(!out.iter().any(|a| matches!(a, Action::Forward { .. })), "a forward is not forwarded again");
    }
    for (i, (w, b)) in workers.iter().zip(&encoded).enumerate().skip(1) {
        second.handle(accepted(*w, b, i as u64));
    }
    for (i, (w, b)) in workers.iter().zip(&encoded).enumerate().rev() {
        first.handle(accepted(*w, b, i as u64));
    }
    let a = published(&first.handle(Input::Closed { round: ROUND, count: 3 })).expect("the first publishes");
    let b = published(&second.handle(Input::Closed { round: ROUND, count: 3 })).expect("the second publishes");
    assert_eq!(a.hash, b.hash, "the replicas agree bit for bit");
    assert_eq!(a.mean, reference(&contributions), "the shard's mean is the shepherd's");
    assert_eq!(a.hash, crate::diloco::aggregation::update_hash(ROUND, SHARD, &a.mean, a.total));
    assert!(first.rounds().is_empty() && second.rounds().is_empty(), "a published round is forgotten");
}

#[test]
fn a_slice_other_than_the_committed_one_is_dropped_and_the_committed_one_fetched() {
    let mut rng = StdRng::seed_from_u64(8);
    let (honest, other) = (tensors(&mut rng), tensors(&mut rng));
    let mut agg = Aggregator::new(16, 1);
    assigned(&mut agg, Place::Replica(1));
    // the worker sent this replica `other` but committed `honest`
    agg.handle(slice(10, bytes(&other), true));
    agg.handle(accepted(10, &bytes(&honest), 0));
    let out = agg.handle(Input::Closed { round: ROUND, count: 1 });
    let hash = slice_hash(&bytes(&honest));
    assert_eq!(out, vec![Action::Fetch { round: ROUND, shard: SHARD, worker: 10, hash }]);
    // the fetched slice completes the shard
    let update = published(&agg.handle(slice(10, bytes(&honest), true))).expect("published once fetched");
    assert_eq!(update.mean, reference(&[honest]));
}

#[test]
fn bad_slices_are_refused_and_memory_is_bounded() {
    let mut rng = StdRng::seed_from_u64(9);
    let mut agg = Aggregator::new(2, 1);
    assigned(&mut agg, Place::Replica(0));
    let refusal = |out: Vec<Action<u8>>| match out.as_slice() {
        [Action::Refuse { reason, .. }] => reason.clone(),
        other => panic!("{other:?}"),
    };
    // garbage, and tensors of the wrong sizes
    assert!(matches!(refusal(agg.handle(slice(10, vec![7; 9], false))), SliceRefusal::Invalid { .. }));
    let wrong = bytes(&vec![vec![0.5; 3]]);
    assert!(matches!(refusal(agg.handle(slice(10, wrong, false))), SliceRefusal::Invalid { .. }));
    // a shard or round not assigned here
    let other_shard = Input::Slice { round: ROUND, shard: SHARD + 1, worker: 10, bytes: vec![], forwarded: false };
    assert_eq!(refusal(agg.handle(other_shard)), SliceRefusal::NotAssigned { round: ROUND, shard: SHARD + 1 });
    let other_round = Input::Slice { round: ROUND + 1, shard: SHARD, worker: 10, bytes: vec![], forwarded: false };
    assert_eq!(refusal(agg.handle(other_round)), SliceRefusal::NotAssigned { round: ROUND + 1, shard: SHARD });
    // two slices held, a third refused; a second, different slice from one worker refused
    let (t1, t2, t3) = (tensors(&mut rng), tensors(&mut rng), tensors(&mut rng));
    assert!(agg.handle(slice(10, bytes(&t1), false)).iter().any(|a| matches!(a, Action::Report { .. })));
    assert!(agg.handle(slice(10, bytes(&t1), false)).is_empty(), "the same slice again is a no-op");
    assert_eq!(refusal(agg.handle(slice(10, bytes(&t2), false))), SliceRefusal::Duplicate { shard: SHARD });
    agg.handle(slice(11, bytes(&t2), false));
    assert_eq!(refusal(agg.handle(slice(12, bytes(&t3), false))), SliceRefusal::Full { shard: SHARD, max: 2 });
}

#[test]
fn an_auditor_fetches_every_accepted_slice_after_the_close() {
    let mut rng = StdRng::seed_from_u64(10);
    let contributions: Vec<Tensors> = (0..3).map(|_| tensors(&mut rng)).collect();
    let mut auditor = Aggregator::new(16, 1);
    assigned(&mut auditor, Place::Auditor);
    for (i, t) in contributions.iter().enumerate() {
        assert!(auditor.handle(accepted(20 + i as u8, &bytes(t), i as u64)).is_empty());
    }
    let out = auditor.handle(Input::Closed { round: ROUND, count: 3 });
    assert_eq!(out.iter().filter(|a| matches!(a, Action::Fetch { .. })).count(), 3, "{out:?}");
    let mut update = None;
    for (i, t) in contributions.iter().enumerate().rev() {
        let out = auditor.handle(slice(20 + i as u8, bytes(t), true));
        assert!(!out.iter().any(|a| matches!(a, Action::Forward { .. })), "an auditor forwards nothing");
        update = update.or(published(&out));
    }
    assert_eq!(update.expect("published").mean, reference(&contributions));
}

#[test]
fn a_missing_slice_fails_the_shard_at_the_give_up_and_old_rounds_are_forgotten() {
    let mut rng = StdRng::seed_from_u64(11);
    let t = tensors(&mut rng);
    let mut agg = Aggregator::new(16, 1);
    assigned(&mut agg, Place::Replica(0));
    agg.handle(accepted(10, &bytes(&t), 0));
    let out = agg.handle(Input::Closed { round: ROUND, count: 1 });
    assert!(matches!(out.as_slice(), [Action::Fetch { worker: 10, .. }]), "{out:?}");
    let out = agg.handle(Input::GiveUp { round: ROUND });
    assert_eq!(
        out,
        vec![Action::Failed { round: ROUND, shard: SHARD, error: SumError::Missing { count: 1, missing: 0 } }]
    );
    assert!(agg.rounds().is_empty());
    // assigned rounds past KEEP_ROUNDS go unfinished
    for round in 10..15 {
        let shards = vec![spec(vec![A, C], Place::Replica(0))];
        agg.handle(Input::Assigned { round, encoding: Encoding::F32, shards });
    }
    assert_eq!(agg.rounds(), (15 - KEEP_ROUNDS..15).collect::<Vec<_>>());
}

#[test]
fn slices_past_the_memory_budget_are_spilled_and_read_back_once_accepted() {
    // a flood of valid slices nobody has accepted yet: without a budget every one
    // is held in memory; with a budget of two slices the rest go to disk, each
    // reported all the same, and the shard sums to the same mean
    let mut rng = StdRng::seed_from_u64(12);
    let contributions: Vec<Tensors> = (0..6).map(|_| tensors(&mut rng)).collect();
    let len = bytes(&contributions[0]).len();
    let mut unbounded = Aggregator::new(64, 1);
    assigned(&mut unbounded, Place::Replica(1));
    let mut budget = Aggregator::new(64, 1).holding(2 * len);
    assigned(&mut budget, Place::Replica(1));
    let mut disk = BTreeMap::new();
    for (i, t) in contributions.iter().enumerate() {
        let worker = 10 + i as u8;
        unbounded.handle(slice(worker, bytes(t), true));
        let out = budget.handle(slice(worker, bytes(t), true));
        assert!(out.iter().any(|a| matches!(a, Action::Report { .. })), "every slice is reported: {out:?}");
        for a in out {
            if let Action::Spill { worker, hash, bytes, .. } = a {
                assert_eq!(hash, slice_hash(&bytes));
                disk.insert(worker, bytes);
            }
        }
    }
    assert_eq!(unbounded.held_bytes(), 6 * len, "unbounded, the flood is held whole");
    assert_eq!(budget.held_bytes(), 2 * len);
    assert_eq!(disk.keys().copied().collect::<Vec<_>>(), vec![12, 13, 14, 15]);
    // a spilled slice sent again is a no-op, another one from the same worker a duplicate
    assert!(budget.handle(slice(12, bytes(&contributions[2]), true)).is_empty());
    let other = bytes(&tensors(&mut rng));
    assert!(matches!(budget.handle(slice(12, other, true)).as_slice(), [Action::Refuse { .. }]));
    // the accepts come: held slices are added, spilled ones read back
    for (i, t) in contributions.iter().enumerate() {
        let worker = 10 + i as u8;
        let out = budget.handle(accepted(worker, &bytes(t), i as u64));
        let loads: Vec<_> = out.iter().filter(|a| matches!(a, Action::Load { .. })).collect();
        assert_eq!(loads.len(), usize::from(i >= 2), "{out:?}");
        if i == 3 {
            // lost on disk: the committed slice is fetched from its worker at the close
            assert!(budget.handle(Input::Loaded { round: ROUND, shard: SHARD, worker, bytes: Vec::new() }).is_empty());
        } else if i >= 2 {
            let bytes = disk.remove(&worker).expect("spilled");
            assert!(budget.handle(Input::Loaded { round: ROUND, shard: SHARD, worker, bytes }).is_empty());
        }
    }
    assert_eq!(budget.held_bytes(), 0);
    let out = budget.handle(Input::Closed { round: ROUND, count: 6 });
    let hash = slice_hash(&bytes(&contributions[3]));
    assert_eq!(out, vec![Action::Fetch { round: ROUND, shard: SHARD, worker: 13, hash }]);
    let update = published(&budget.handle(slice(13, bytes(&contributions[3]), true))).expect("published");
    assert_eq!(update.mean, reference(&contributions));
}
