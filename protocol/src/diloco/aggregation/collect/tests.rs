use super::*;
use crate::diloco::aggregate::{Bounds, Delta};
use crate::diloco::aggregation::{assign, inspect, slice_hash, update_hash};
use crate::diloco::compress::{self, Encoding};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const ROUND: u64 = 3;
/// Two shards: tensors 0..2 and 2..3.
const SIZES: [usize; 3] = [6, 4, 5];

fn key(i: u8) -> Vec<u8> {
    vec![i; 32]
}

fn ranges() -> Vec<Range<usize>> {
    vec![0..2, 2..3]
}

fn collect(max: usize) -> Collect<Vec<u8>> {
    let volunteers: Vec<Vec<u8>> = (1..=4).map(key).collect();
    let a = assign(&[9; 32], ROUND, 2, 2, &volunteers).unwrap();
    let voters = (0..2).map(|s| a.replicas(s).to_vec()).collect();
    Collect::new(a, ranges(), voters, max)
}

/// A worker's contribution, cut into the two shards' encoded slices and reports.
fn slices(rng: &mut StdRng) -> Vec<(Vec<u8>, SliceReport)> {
    let t: Vec<Vec<f32>> = SIZES.iter().map(|n| (0..*n).map(|_| rng.gen_range(-1.0f32..1.0)).collect()).collect();
    ranges()
        .into_iter()
        .map(|r| {
            let part = t[r.clone()].to_vec();
            let bytes = compress::encode(&part, Encoding::F32);
            let (_, report) = inspect(Delta::Dense(part), &SIZES[r], &Bounds::none()).unwrap();
            (bytes, report)
        })
        .collect()
}

fn hashes(s: &[(Vec<u8>, SliceReport)]) -> Vec<[u8; 32]> {
    s.iter().map(|(b, _)| slice_hash(b)).collect()
}

/// Every replica of every shard reports `s` for `worker`; the last answer.
fn report_all(c: &mut Collect<Vec<u8>>, worker: &Vec<u8>, s: &[(Vec<u8>, SliceReport)]) -> Reported {
    let mut last = Reported::Waiting;
    for (shard, (b, r)) in s.iter().enumerate() {
        for from in c.assignment.replicas(shard).to_vec() {
            last = c.report(&from, worker, shard, slice_hash(b), r.clone()).unwrap();
        }
    }
    last
}

#[test]
fn a_contribution_is_ready_once_every_replica_agrees_and_is_numbered_in_order() {
    let mut rng = StdRng::seed_from_u64(1);
    let mut c = collect(8);
    let (w1, w2) = (key(20), key(21));
    let (s1, s2) = (slices(&mut rng), slices(&mut rng));
    c.commit(w1.clone(), hashes(&s1)).unwrap();
    c.commit(w2.clone(), hashes(&s2)).unwrap();
    // one replica of one shard: waiting
    let first = c.assignment.replicas(0)[0].clone();
    let got = c.report(&first, &w1, 0, slice_hash(&s1[0].0), s1[0].1.clone()).unwrap();
    assert_eq!(got, Reported::Waiting);
    assert_eq!(c.accept(&w1, 1.0, 1.0), Err(CollectError::NotReady));
    assert_eq!(
        c.report(&first, &w1, 0, slice_hash(&s1[0].0), s1[0].1.clone()),
        Err(CollectError::Reported { shard: 0 })
    );
    // the rest: ready, with the whole contribution's bounded norm and raw statistics
    let rest = c.assignment.replicas(0)[1].clone();
    c.report(&rest, &w1, 0, slice_hash(&s1[0].0), s1[0].1.clone()).unwrap();
    for from in c.assignment.replicas(1).to_vec() {
        c.report(&from, &w1, 1, slice_hash(&s1[1].0), s1[1].1.clone()).unwrap();
    }
    let Reported::Ready { norm, raw } = c.state(&w1) else { panic!("{:?}", c.state(&w1)) };
    let whole = (s1[0].1.bounded_norm.powi(2) + s1[1].1.bounded_norm.powi(2)).sqrt();
    assert!((norm - whole).abs() < 1e-12);
    assert_eq!(raw.len(), 3);
    assert!(matches!(report_all(&mut c, &w2, &s2), Reported::Ready { .. }));
    // accepted in the shepherd's order, each once
    let a2 = c.accept(&w2, 2.0, 5.0).unwrap();
    let a1 = c.accept(&w1, 1.0, 5.0).unwrap();
    assert_eq!((a2.seq, a1.seq), (0, 1));
    assert_eq!((a1.weight, a1.bound, a1.norm), (1.0, 5.0, norm));
    assert_eq!(c.accept(&w1, 1.0, 5.0), Err(CollectError::NotReady));
    let listed = c.accepted(1);
    assert_eq!(
        listed.iter().map(|(p, h, a)| (p.clone(), *h, a.seq)).collect::<Vec<_>>(),
        vec![(w2.clone(), hashes(&s2)[1], 0), (w1.clone(), hashes(&s1)[1], 1)]
    );
}

#[test]
fn reports_of_strangers_other_slices_or_wrong_shapes_are_refused() {
    let mut rng = StdRng::seed_from_u64(2);
    let mut c = collect(1);
    let w = key(20);
    let s = slices(&mut rng);
    assert_eq!(c.commit(w.clone(), vec![[0; 32]]), Err(CollectError::Shards { got: 1, shards: 2 }));
    c.commit(w.clone(), hashes(&s)).unwrap();
    assert_eq!(c.commit(w.clone(), hashes(&s)), Err(CollectError::Committed));
    assert_eq!(c.commit(key(21), hashes(&s)), Err(CollectError::Full { max: 1 }));
    let replica = c.assignment.replicas(0)[0].clone();
    let stranger = key(99);
    let h0 = slice_hash(&s[0].0);
    assert_eq!(c.report(&stranger, &w, 0, h0, s[0].1.clone()), Err(CollectError::NotReplica { shard: 0 }));
    assert_eq!(c.report(&replica, &key(21), 0, h0, s[0].1.clone()), Err(CollectError::NoCommitment));
    assert_eq!(c.report(&replica, &w, 0, [1; 32], s[0].1.clone()), Err(CollectError::WrongSlice { shard: 0 }));
    // shard 1's report (one tensor) given as shard 0's (two)
    assert_eq!(c.report(&replica, &w, 0, h0, s[1].1.clone()), Err(CollectError::Tensors { shard: 0, got: 1, want: 2 }));
}

#[test]
fn a_replica_that_lies_about_a_slice_disputes_it_and_is_named_when_settled() {
    let mut rng = StdRng::seed_from_u64(3);
    let mut c = collect(8);
    let w = key(20);
    let s = slices(&mut rng);
    c.commit(w.clone(), hashes(&s)).unwrap();
    let [honest, liar] = [0, 1].map(|j| c.assignment.replicas(0)[j].clone());
    let h0 = slice_hash(&s[0].0);
    // the liar shrinks the norm, to get a large slice accepted unscaled
    let small = SliceReport { bounded_norm: s[0].1.bounded_norm / 100.0, ..s[0].1.clone() };
    c.report(&liar, &w, 0, h0, small).unwrap();
    assert_eq!(c.reporters(&w, 0), vec![liar.clone()]);
    assert!(c.reporters(&w, 1).is_empty() && c.reporters(&key(99), 0).is_empty());
    let got = c.report(&honest, &w, 0, h0, s[0].1.clone()).unwrap();
    assert_eq!(got, Reported::Disputed { shard: 0 });
    for from in c.assignment.replicas(1).to_vec() {
        c.report(&from, &w, 1, slice_hash(&s[1].0), s[1].1.clone()).unwrap();
    }
    assert_eq!(c.state(&w), Reported::Disputed { shard: 0 });
    assert_eq!(c.accept(&w, 1.0, 1.0), Err(CollectError::NotReady), "a disputed contribution waits");
    // the shepherd inspects the slice itself: the liar is named, and the norm is the true one
    let (liars, state) = c.settle(&w, 0, s[0].1.clone()).unwrap();
    assert_eq!(liars, vec![liar]);
    let Reported::Ready { norm, .. } = state else { panic!("{state:?}") };
    let whole = (s[0].1.bounded_norm.powi(2) + s[1].1.bounded_norm.powi(2)).sqrt();
    assert!((norm - whole).abs() < 1e-12);
}

#[test]
fn votes_agree_or_name_the_liars() {
    let mut c = collect(8);
    let mean = vec![vec![0.25f32; 6], vec![0.5; 4]];
    let good = update_hash(ROUND, 0, &mean, 2.0);
    let [a, b] = [0, 1].map(|j| c.assignment.replicas(0)[j].clone());
    assert_eq!(c.outcome(0, false, false), Outcome::Waiting);
    c.vote(&a, 0, good).unwrap();
    assert_eq!(c.vote(&a, 0, good), Err(CollectError::Vote { shard: 0, refused: Refused::Duplicate }));
    assert_eq!(c.vote(&key(99), 0, good), Err(CollectError::Vote { shard: 0, refused: Refused::NotAssigned }));
    assert_eq!(c.outcome(0, false, false), Outcome::Waiting);
    assert_eq!(c.outcome(0, false, true), Outcome::Recompute, "silence past the deadline");
    c.vote(&b, 0, [7; 32]).unwrap();
    assert_eq!(c.outcome(0, false, false), Outcome::Recompute);
    assert_eq!(c.liars(0, &good), vec![b]);
    // shard 1 agrees
    for from in c.assignment.replicas(1).to_vec() {
        c.vote(&from, 1, good).unwrap();
    }
    assert_eq!(c.outcome(1, false, false), Outcome::Agreed(good));
    assert_eq!(c.outcome(1, true, false), Outcome::Recompute, "a spot check recomputes anyway");
}
