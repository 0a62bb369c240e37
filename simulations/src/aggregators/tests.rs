use super::*;

fn setup(hostile: Option<(HostileAggregator, f64)>) -> AggregatorSetup {
    AggregatorSetup {
        shards: 4,
        replicas: 2,
        profile: Profile::Datacenter,
        cores: 2,
        spot_rate: 0.0,
        hostile,
        vote_timeout_s: 5.0,
        report_s: 0.1,
        commit_s: 1e-4,
        commit_bytes: 1e3,
    }
}

fn close(pool: &mut Pool, round: u64) -> Closed {
    assert!(pool.open(round));
    // 100 contributions of 1 MB between 1 s and 2 s, closed at 3 s
    pool.close(round, 3_000_000, (100, 1_000_000, 2_000_000), 1e6, 0.01, 4e6, (1e9, 2))
}

#[test]
fn honest_replicas_agree_and_the_means_are_gathered_soon_after_the_close() {
    let mut pool = Pool::new(setup(None), 1);
    let c = close(&mut pool, 1);
    assert_eq!(pool.totals.applied_wrong, 0);
    assert_eq!((pool.totals.agreed, pool.totals.recomputed, pool.totals.caught), (4, 0, 0));
    assert_eq!(c.recompute_s, 0.0);
    // datacenter volunteers: the slices are in long before the close; gathering 4 MB is ms
    assert!(c.ready_us > 3_000_000 && c.ready_us < 3_100_000, "{}", c.ready_us);
}

#[test]
fn each_hostile_kind_is_recomputed_caught_and_never_applied() {
    for kind in [HostileAggregator::AggAlter, HostileAggregator::AggDrop, HostileAggregator::AggStall] {
        let mut pool = Pool::new(setup(Some((kind, 0.5))), 7);
        let hostile = pool.volunteers.iter().filter(|v| v.hostile.is_some()).count() as u64;
        assert!(hostile > 0, "{kind:?}: the draw gives some hostile volunteers");
        let first = close(&mut pool, 1);
        assert!(pool.totals.recomputed > 0 && pool.totals.caught > 0, "{kind:?}: {:?}", pool.totals);
        assert!(first.recompute_s > 0.0);
        if kind == HostileAggregator::AggStall {
            assert!(first.ready_us >= 8_000_000, "{kind:?}: silence is waited for until the vote deadline");
        }
        for round in 2..6 {
            // a wrong sum is applied only where every replica lies alike (alter, or drop)
            assert!(pool.open(round));
            let a = pool.assignment.clone().unwrap();
            let colluding = (0..a.shards())
                .filter(|s| {
                    a.replicas(*s).iter().all(|k| {
                        let v = pool.volunteers[u32::from_le_bytes(*k) as usize];
                        v.hostile.is_some() && kind != HostileAggregator::AggStall
                    })
                })
                .count() as u64;
            let wrong = pool.totals.applied_wrong;
            pool.close(round, 3_000_000, (100, 1_000_000, 2_000_000), 1e6, 0.01, 4e6, (1e9, 2));
            assert_eq!(pool.totals.applied_wrong - wrong, colluding, "{kind:?} round {round}");
        }
        // every hostile volunteer assigned is caught, and caught ones are assigned no more
        assert!(pool.totals.caught <= hostile);
        let recomputed = pool.totals.recomputed;
        close(&mut pool, 9);
        if pool.totals.caught == hostile {
            assert_eq!(pool.totals.recomputed, recomputed, "{kind:?}: no liars left, nothing to recompute");
        }
    }
}

#[test]
fn a_lone_replica_that_lies_is_found_only_by_spot_checks() {
    let s = AggregatorSetup { replicas: 1, hostile: Some((HostileAggregator::AggAlter, 1.0)), ..setup(None) };
    let mut pool = Pool::new(s.clone(), 3);
    close(&mut pool, 1);
    assert_eq!(pool.totals.applied_wrong, 4, "with one replica and no spot checks a lie is applied");
    // every shard spot-checked: the shepherd sums each itself and catches every liar
    let mut checked = Pool::new(AggregatorSetup { spot_rate: 1.0, ..s.clone() }, 3);
    close(&mut checked, 1);
    assert_eq!(checked.totals.applied_wrong, 0, "{:?}", checked.totals);
    assert_eq!((checked.totals.spot_checks, checked.totals.recomputed), (4, 4));
    assert!(checked.totals.caught > 0, "{:?}", checked.totals);
    // half the shards checked: only the unchecked lies are applied
    let mut half = Pool::new(AggregatorSetup { spot_rate: 0.5, ..s }, 3);
    close(&mut half, 1);
    assert_eq!(half.totals.applied_wrong + half.totals.spot_checks, 4, "{:?}", half.totals);
}

#[test]
fn too_few_volunteers_leave_the_sum_to_the_shepherd() {
    let mut pool = Pool::new(AggregatorSetup { shards: 1, ..setup(Some((HostileAggregator::AggStall, 1.0))) }, 2);
    close(&mut pool, 1);
    assert_eq!(pool.totals.caught, 2);
    assert!(!pool.open(2), "no volunteer left");
    let c = pool.close(2, 5_000_000, (10, 0, 0), 1e6, 0.01, 4e6, (1e9, 2));
    assert_eq!(c.ready_us, 5_000_000);
}

#[test]
fn spot_checks_are_summed_as_the_round_gathers_not_after_its_votes() {
    // every shard spot-checked: 100 slices of each read and added between 1 s and
    // 3 s, so the means are in soon after the close, as an honest round's are
    let mut checked = Pool::new(AggregatorSetup { spot_rate: 1.0, ..setup(None) }, 1);
    let c = close(&mut checked, 1);
    assert_eq!((checked.totals.spot_checks, checked.totals.recomputed, checked.totals.caught), (4, 4, 0));
    assert!(c.recompute_s > 0.0, "the shepherd read and added them");
    let honest = close(&mut Pool::new(setup(None), 1), 1);
    assert!(c.ready_us < honest.ready_us + 20_000, "{} against {}", c.ready_us, honest.ready_us);
    // summed after the votes, one shard after another, the four would take 0.5 s
    // of adds (100 × 0.01 core-s a contribution, a quarter a shard, on 2 threads)
    assert!(c.ready_us < 3_100_000, "{}", c.ready_us);
}
