use super::*;
use crate::diloco::compress::{self, Encoding};
use crate::diloco::sparse::Settings;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn key(i: u16) -> Vec<u8> {
    let mut k = vec![0; 32];
    k[..2].copy_from_slice(&i.to_le_bytes());
    k
}

fn keys(n: u16) -> Vec<Vec<u8>> {
    (1..=n).map(key).collect()
}

fn tensors(rng: &mut StdRng, sizes: &[usize], scale: f32) -> Tensors {
    sizes.iter().map(|n| (0..*n).map(|_| rng.gen_range(-scale..scale)).collect()).collect()
}

/// The shepherd's own mean of `contributions` (tensors of `sizes`, each with its
/// weight), bounded by `bounds` and the norm bound `bound`, and each one's bounded norm.
fn shepherds_mean(
    contributions: &[(Tensors, f64)],
    bounds: &Bounds,
    bound: f64,
    sizes: &[usize],
) -> (Tensors, Vec<f64>) {
    let mut alone = RunningMean::default();
    let mut norms = Vec::new();
    for (t, w) in contributions {
        let (bounded, norm, _) = Delta::Dense(t.clone()).bounded(bounds);
        norms.push(norm);
        alone.push(bounded, *w, norm, bound, sizes);
    }
    (alone.finish().unwrap(), norms)
}

#[test]
fn shards_are_spread_evenly_over_distinct_replicas_whatever_the_order() {
    let seed = [3; 32];
    let all = keys(7);
    let a = assign(&seed, 5, 20, 2, &all).unwrap();
    assert_eq!((a.round(), a.shards()), (5, 20));
    for s in 0..20 {
        let r = a.replicas(s);
        assert_eq!(r.len(), 2);
        assert_ne!(r[0], r[1], "a shard's replicas are distinct");
    }
    // 40 places over 7 volunteers: ⌈40/7⌉ = 6 at most each
    for k in &all {
        let load = a.shards_of(k).len();
        assert!((5..=6).contains(&load), "{load} shards for one volunteer");
    }
    let mut shuffled = all.clone();
    shuffled.reverse();
    shuffled.extend(all.iter().take(3).cloned());
    assert_eq!(assign(&seed, 5, 20, 2, &shuffled), Some(a.clone()), "order and duplicates change nothing");
    assert_ne!(assign(&seed, 6, 20, 2, &all), Some(a.clone()), "another round, another draw");
    assert_ne!(assign(&[4; 32], 5, 20, 2, &all), Some(a), "another seed, another draw");
}

#[test]
fn too_few_volunteers_leave_the_sum_to_the_shepherd() {
    assert!(assign(&[1; 32], 1, 4, 2, &keys(1)).is_none());
    assert!(assign(&[1; 32], 1, 4, 2, &[key(1), key(1)]).is_none(), "one key twice is one volunteer");
    assert!(assign(&[1; 32], 1, 0, 2, &keys(5)).is_none());
    assert!(assign(&[1; 32], 1, 4, 0, &keys(5)).is_none());
    let one = assign(&[1; 32], 1, 4, 1, &keys(1)).unwrap();
    assert!((0..4).all(|s| one.replicas(s) == [key(1)]));
    assert!(one.replicas(4).is_empty());
}

#[test]
fn a_slice_hash_is_its_blob_id() {
    let h = slice_hash(b"abc");
    assert_eq!(h, slice_hash(b"abc"));
    assert_eq!(h, *blake3::hash(b"abc").as_bytes(), "a slice's blob id");
    assert_ne!(h, slice_hash(b"abd"));
}

/// The round the shepherd would sum alone, and the same round summed by shard:
/// every shard's mean is the shepherd's mean of its tensors, bit for bit.
#[test]
fn shards_summed_apart_are_the_shepherds_mean_bit_for_bit() {
    let mut rng = StdRng::seed_from_u64(11);
    let sizes = [40, 7, 100, 3, 64];
    let shards = [0..2, 2..3, 3..5];
    let bounds = Bounds { tensor: vec![1.0, 0.5, 2.0, 0.1, 1.5], element: vec![0.3, 0.2, 0.25, 0.05, 0.4] };
    let bound = 2.5;
    let contributions: Vec<(Tensors, f64)> =
        (0..9).map(|i| (tensors(&mut rng, &sizes, 0.5), 10.0 + f64::from(i))).collect();
    let (alone, norms) = shepherds_mean(&contributions, &bounds, bound, &sizes);

    for (s, range) in shards.iter().enumerate() {
        let shard_sizes = sizes[range.clone()].to_vec();
        let sb = shard_bounds(&bounds, range);
        let mut sum = ShardSum::new(7, s, shard_sizes.clone(), 2);
        // accepts arrive in reverse: the order added is the shepherd's
        for (seq, (t, w)) in contributions.iter().enumerate().rev() {
            let (bounded, report) = inspect(Delta::Dense(t[range.clone()].to_vec()), &shard_sizes, &sb).unwrap();
            assert_eq!(report.raw.len(), range.len());
            let accept = Accept { seq: seq as u64, weight: *w, norm: norms[seq], bound };
            sum.accept(accept, bounded).unwrap();
        }
        let update = sum.finish(contributions.len() as u64).unwrap();
        assert_eq!(update.mean, alone[range.clone()].to_vec(), "shard {s}");
        assert_eq!(update.hash, update_hash(7, s, &alone[range.clone()].to_vec(), update.total));
    }
}

#[test]
fn a_contributions_norm_is_its_shards_reports_together() {
    let mut rng = StdRng::seed_from_u64(2);
    let sizes = [30, 30, 30];
    let bounds = Bounds { tensor: vec![0.8, 9.0, 0.4], element: vec![0.2, 9.0, 0.1] };
    let t = tensors(&mut rng, &sizes, 0.5);
    let (_, whole, _) = Delta::Dense(t.clone()).bounded(&bounds);
    let reports: Vec<SliceReport> = [0..1, 1..3]
        .iter()
        .map(|r| inspect(Delta::Dense(t[r.clone()].to_vec()), &sizes[r.clone()], &shard_bounds(&bounds, r)).unwrap().1)
        .collect();
    assert!((contribution_norm(&reports) - whole).abs() < 1e-9 * whole, "{} vs {whole}", contribution_norm(&reports));
}

#[test]
fn a_bad_slice_is_refused_before_it_is_bounded() {
    let nan = Delta::Dense(vec![vec![1.0, f32::NAN]]);
    assert!(matches!(inspect(nan, &[2], &Bounds::none()), Err(Rejection::NonFinite { index: 0 })));
    let short = Delta::Dense(vec![vec![1.0]]);
    assert!(inspect(short, &[2], &Bounds::none()).is_err());
}

/// Two replicas fed the same accepts in different orders, on different thread
/// counts, sign the same hash of sparse slices.
#[test]
fn replicas_agree_on_sparse_slices_whatever_the_arrival_order_and_threads() {
    let mut rng = StdRng::seed_from_u64(5);
    let sizes = vec![4096, 640];
    let encoding = Encoding::Sparse(Settings::default());
    let slices: Vec<Vec<u8>> = (0..40).map(|_| compress::encode(&tensors(&mut rng, &sizes, 1.0), encoding)).collect();
    let run = |threads: usize, order: &[usize]| {
        let mut sum = ShardSum::new(2, 0, sizes.clone(), threads);
        for &i in order {
            let delta = compress::decode_delta(&slices[i], &sizes, encoding).unwrap();
            let (bounded, report) = inspect(delta, &sizes, &Bounds::none()).unwrap();
            let accept = Accept { seq: i as u64, weight: 1.0 + i as f64, norm: report.bounded_norm, bound: 20.0 };
            sum.accept(accept, bounded).unwrap();
        }
        sum.finish(slices.len() as u64).unwrap()
    };
    let forward: Vec<usize> = (0..slices.len()).collect();
    let mut shuffled = forward.clone();
    shuffled.rotate_left(17);
    shuffled.swap(3, 30);
    let (a, b) = (run(1, &forward), run(4, &shuffled));
    assert_eq!(a.hash, b.hash);
    assert_eq!(a.mean, b.mean);
}

#[test]
fn a_sum_takes_each_place_once_and_closes_only_complete() {
    let sizes = vec![2];
    let one = || Delta::Dense(vec![vec![1.0, 2.0]]);
    let at = |seq| Accept { seq, weight: 1.0, norm: 1.0, bound: 10.0 };
    let mut sum = ShardSum::new(1, 0, sizes.clone(), 1);
    sum.accept(at(1), one()).unwrap();
    assert_eq!(sum.added(), 0, "place 1 waits for place 0");
    assert_eq!(sum.accept(at(1), one()), Err(SumError::Duplicate { seq: 1 }));
    sum.accept(at(0), one()).unwrap();
    assert_eq!(sum.added(), 2);
    assert_eq!(sum.accept(at(0), one()), Err(SumError::Duplicate { seq: 0 }));
    sum.accept(at(3), one()).unwrap();
    // a close at 3 misses nothing before the 3 but holds a place past it
    let mut short = ShardSum::new(1, 0, sizes.clone(), 1);
    short.accept(at(0), one()).unwrap();
    assert_eq!(short.finish(2).unwrap_err(), SumError::Missing { count: 2, missing: 1 });
    assert_eq!(sum.finish(3).unwrap_err(), SumError::PastClose { seq: 3, count: 3 });
    let mut long = ShardSum::new(1, 0, sizes.clone(), 1);
    long.accept(at(0), one()).unwrap();
    long.accept(at(1), one()).unwrap();
    assert_eq!(long.finish(1).unwrap_err(), SumError::PastClose { seq: 1, count: 1 });
    // nothing accepted: zeros, and a hash of them
    let empty = ShardSum::new(1, 0, sizes, 1).finish(0).unwrap();
    assert_eq!((empty.mean, empty.total), (vec![vec![0.0, 0.0]], 0.0));
}

#[test]
fn replicas_that_agree_are_applied_unless_a_spot_check_is_drawn() {
    let (h, other) = ([1; 32], [2; 32]);
    let mut votes = Votes::new(keys(2));
    assert_eq!(votes.outcome(false, false), Outcome::Waiting);
    votes.vote(&key(1), h).unwrap();
    assert_eq!(votes.outcome(false, false), Outcome::Waiting);
    assert_eq!(votes.vote(&key(1), h), Err(Refused::Duplicate));
    assert_eq!(votes.vote(&key(9), h), Err(Refused::NotAssigned));
    votes.vote(&key(2), h).unwrap();
    assert_eq!(votes.outcome(false, false), Outcome::Agreed(h));
    assert_eq!(votes.outcome(true, false), Outcome::Recompute, "a spot check recomputes an agreed shard");
    assert!(votes.liars(&h).is_empty(), "honest replicas survive their spot check");
    assert_eq!(votes.liars(&other), keys(2), "both signed what the shepherd did not compute");
}

#[test]
fn a_wrong_sum_or_silence_is_recomputed_and_its_replica_caught() {
    let (good, bad) = ([1; 32], [2; 32]);
    // agg-alter and agg-drop: a hash that is not the others'
    let mut votes = Votes::new(keys(2));
    votes.vote(&key(1), bad).unwrap();
    assert_eq!(votes.outcome(false, false), Outcome::Waiting, "one vote is no disagreement yet");
    votes.vote(&key(2), good).unwrap();
    assert_eq!(votes.outcome(false, false), Outcome::Recompute, "a disagreement recomputes at once");
    assert_eq!(votes.liars(&good), vec![key(1)]);
    // agg-stall: silence until the deadline
    let mut votes = Votes::new(keys(2));
    votes.vote(&key(2), good).unwrap();
    assert_eq!(votes.outcome(false, false), Outcome::Waiting);
    assert_eq!(votes.outcome(false, true), Outcome::Recompute);
    assert_eq!(votes.liars(&good), vec![key(1)]);
    // one replica, one lie: only a spot check finds it
    let mut alone = Votes::new(keys(1));
    alone.vote(&key(1), bad).unwrap();
    assert_eq!(alone.outcome(false, false), Outcome::Agreed(bad));
    assert_eq!(alone.outcome(true, false), Outcome::Recompute);
    assert_eq!(alone.liars(&good), vec![key(1)]);
}

#[test]
fn spot_checks_are_drawn_at_their_rate_from_the_seed() {
    let seed = [5; 32];
    assert!(!(0..100).any(|s| spot_checked(&seed, 1, s, 0.0)));
    assert!((0..100).all(|s| spot_checked(&seed, 1, s, 1.0)));
    let drawn = (0..10_000).filter(|s| spot_checked(&seed, 1, *s, 0.1)).count();
    assert!((900..1100).contains(&drawn), "{drawn} of 10,000 at 0.1");
    assert_eq!(spot_checked(&seed, 1, 3, 0.5), spot_checked(&seed, 1, 3, 0.5));
}

#[test]
fn an_auditor_is_drawn_outside_the_replicas_and_votes_with_them() {
    let seed = [8; 32];
    let all = keys(6);
    let a = assign(&seed, 2, 3, 2, &all).unwrap();
    for s in 0..3 {
        let audit = auditor(&seed, 2, s, &all, a.replicas(s)).unwrap();
        assert!(!a.replicas(s).contains(&audit), "shard {s}: the auditor is not a replica");
        let mut shuffled = all.clone();
        shuffled.reverse();
        assert_eq!(auditor(&seed, 2, s, &shuffled, a.replicas(s)), Some(audit.clone()), "order changes nothing");
        // replicas that agree on a wrong sum are caught by an honest auditor
        let mut voters = a.replicas(s).to_vec();
        voters.push(audit.clone());
        let mut votes = Votes::new(voters);
        for r in a.replicas(s) {
            votes.vote(r, [2; 32]).unwrap();
        }
        assert_eq!(votes.outcome(false, false), Outcome::Waiting, "the auditor has yet to vote");
        votes.vote(&audit, [1; 32]).unwrap();
        assert_eq!(votes.outcome(false, false), Outcome::Recompute);
        assert_eq!(votes.liars(&[1; 32]), a.replicas(s).to_vec());
    }
    assert_eq!(auditor(&seed, 2, 0, &keys(2), &keys(2)), None, "nobody left to audit");
}

mod props {
    use super::*;
    use proptest::prelude::{any, prop_assert_eq, proptest};

    proptest! {
        /// Whatever the tensors, weights, bounds, cut into shards and order of
        /// arrival, the shards' means are the shepherd's mean, bit for bit.
        #[test]
        fn any_cut_and_any_order_give_the_shepherds_mean(
            sizes in proptest::collection::vec(1usize..40, 1..6),
            n in 1usize..8,
            seed in any::<u64>(),
            cut in any::<u64>(),
            bound in 0.1f64..10.0,
        ) {
            let mut rng = StdRng::seed_from_u64(seed);
            let contributions: Vec<(Tensors, f64)> =
                (0..n).map(|_| (tensors(&mut rng, &sizes, 1.0), rng.gen_range(1.0..50.0))).collect();
            let bounds = Bounds {
                tensor: sizes.iter().map(|_| rng.gen_range(0.1..3.0)).collect(),
                element: sizes.iter().map(|_| rng.gen_range(0.05f32..1.0)).collect(),
            };
            let (alone, norms) = shepherds_mean(&contributions, &bounds, bound, &sizes);
            // shard boundaries from the bits of `cut`
            let mut shards = Vec::new();
            let mut start = 0;
            for i in 1..sizes.len() {
                if cut >> i & 1 == 1 {
                    shards.push(start..i);
                    start = i;
                }
            }
            shards.push(start..sizes.len());
            let mut order: Vec<usize> = (0..n).collect();
            order.rotate_left((seed % n as u64) as usize);
            for (s, range) in shards.iter().enumerate() {
                let shard_sizes = sizes[range.clone()].to_vec();
                let sb = shard_bounds(&bounds, range);
                let mut sum = ShardSum::new(1, s, shard_sizes.clone(), 1 + s % 3);
                for &i in &order {
                    let (t, w) = &contributions[i];
                    let (bounded, _) = inspect(Delta::Dense(t[range.clone()].to_vec()), &shard_sizes, &sb).unwrap();
                    sum.accept(Accept { seq: i as u64, weight: *w, norm: norms[i], bound }, bounded).unwrap();
                }
                let update = sum.finish(n as u64).unwrap();
                prop_assert_eq!(update.mean, alone[range.clone()].to_vec());
            }
        }
    }
}

#[test]
fn a_shard_update_blob_reads_back_with_its_hash_and_refuses_what_it_is_not() {
    let mean: Tensors = vec![vec![0.5, -1.25, 3.0], vec![], vec![2.0]];
    let update = ShardUpdate { hash: update_hash(4, 1, &mean, 12.5), mean, total: 12.5 };
    let blob = update.to_blob();
    assert_eq!(blob.len(), ShardUpdate::blob_len(&[3, 0, 1]));
    assert_eq!(ShardUpdate::from_blob(4, 1, &blob, &[3, 0, 1]), Ok(update.clone()));
    // another round or shard hashes otherwise: a replica's vote for it does not match
    assert_ne!(ShardUpdate::from_blob(5, 1, &blob, &[3, 0, 1]).map(|u| u.hash), Ok(update.hash));
    assert!(matches!(ShardUpdate::from_blob(4, 1, &blob, &[3, 1]), Err(UpdateError::Mean(_))));
    assert_eq!(ShardUpdate::from_blob(4, 1, &blob[..4], &[3, 0, 1]), Err(UpdateError::Magic));
    let mut nan = blob.clone();
    nan[5..13].copy_from_slice(&f64::NAN.to_le_bytes());
    assert_eq!(ShardUpdate::from_blob(4, 1, &nan, &[3, 0, 1]), Err(UpdateError::Total));
}

#[test]
fn spot_checks_read_no_more_slices_past_a_thousand_contributions() {
    use super::{SPOT_CONTRIBUTIONS, spot_share};
    assert_eq!(spot_share(0.05, 10), 0.05);
    assert_eq!(spot_share(0.05, SPOT_CONTRIBUTIONS), 0.05);
    for n in [2_000u64, 10_000, 100_000] {
        let read = spot_share(0.05, n) * n as f64;
        assert!((read - 0.05 * SPOT_CONTRIBUTIONS as f64).abs() < 1e-9, "{n}: {read}");
    }
    assert_eq!(spot_share(0.0, 5_000), 0.0);
}
