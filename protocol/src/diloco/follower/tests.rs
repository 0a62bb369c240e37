use super::*;

const LEASE: u64 = 1000;

fn key(i: u8) -> PublicKey {
    PublicKey([i; 32])
}

/// A run whose candidates 1, 2 and 3 lead terms 1, 2, 3, 4, … in turn.
fn follower(term: u64, chain: Chain) -> Follower {
    let succession = Succession::from_order(vec![key(1), key(2), key(3)]);
    Follower::new(key(9), succession, LEASE, term, chain, 0)
}

/// An announcement from `leader`, as a host that owns both halves hears it: its
/// lease first, then the round, with every action in order (`None`: the lease does
/// not count).
fn hear(f: &mut Follower, leader: PublicKey, a: &Announced, now_ms: u64) -> (Option<Take>, Vec<Action>) {
    let (valid, mut actions) = f.leases.lease(leader, a.opening.term, now_ms);
    if !valid {
        return (None, actions);
    }
    let (take, save) = f.rounds.announced(a);
    actions.extend(save);
    (Some(take), actions)
}

fn announced(term: u64, round: u64, opened_ms: u64, base: u8) -> Announced {
    Announced {
        opening: Opening { term, round, opened_ms },
        base: Some([base; 32]),
        participant: true,
        finished: false,
    }
}

#[test]
fn a_higher_term_is_saved_before_its_leader_is_followed() {
    let mut f = follower(1, Chain::default());
    let (valid, actions) = f.leases.lease(key(2), 2, 10);
    assert!(valid);
    assert_eq!(actions, vec![Action::SaveTerm(2), Action::Follow { term: 2, leader: key(2) }]);
    let (valid, actions) = f.leases.lease(key(2), 2, 20);
    assert!(valid && actions.is_empty(), "the same term again: a lease, nothing to save");
    assert_eq!(f.leases.leader(), key(2));
}

#[test]
fn a_lease_out_of_turn_or_stale_is_refused() {
    let mut f = follower(2, Chain::default());
    let (valid, actions) = f.leases.lease(key(3), 2, 10);
    assert!(!valid, "term 2 is candidate 2's");
    assert!(matches!(
        &actions[..],
        [Action::Rejected { term: 2, reason: election::Rejection::NotTheirTurn { .. }, .. }]
    ));
    let (valid, actions) = f.leases.lease(key(1), 1, 10);
    assert!(!valid, "below the term it follows");
    assert!(matches!(&actions[..], [Action::Rejected { reason: election::Rejection::Stale { .. }, .. }]));
    let (valid, _) = f.leases.lease(key(7), 5, 10);
    assert!(!valid, "not a candidate");
}

#[test]
fn a_restart_resumes_the_saved_term_and_chain() {
    let chain = Chain { term: 4, round: 9, params: [9; 32] };
    let f = follower(3, chain);
    assert_eq!(f.leases.term(), 4, "the chain's term if it is the higher");
    assert_eq!(f.rounds.chain(), chain);
}

#[test]
fn a_lapsed_lease_names_the_next_candidate() {
    let mut f = follower(1, Chain::default());
    for now in (250..LEASE).step_by(250) {
        assert!(f.leases.tick(now).is_empty(), "within the lease");
    }
    assert_eq!(f.leases.tick(LEASE), vec![(1, key(1))]);
    assert_eq!(f.leases.awaited(), key(2));
}

#[test]
fn an_announcement_is_taken_once_and_its_chain_saved_first() {
    let mut f = follower(1, Chain::default());
    let a = announced(1, 1, 100, 1);
    let (take, actions) = hear(&mut f, key(1), &a, 10);
    assert_eq!(take, Some(Take::Train));
    assert_eq!(actions, vec![Action::SaveChain(Chain { term: 1, round: 1, params: [1; 32] })]);
    assert_eq!(hear(&mut f, key(1), &a, 20).0, Some(Take::Seen), "the same one again");
    let older = announced(1, 1, 50, 1);
    assert_eq!(hear(&mut f, key(1), &older, 20).0, Some(Take::Seen), "an earlier opening, reordered");
}

#[test]
fn a_round_reopened_by_its_leader_is_taken_again_from_the_same_parameters() {
    let mut f = follower(1, Chain::default());
    hear(&mut f, key(1), &announced(1, 3, 100, 3), 10);
    assert_eq!(hear(&mut f, key(1), &announced(1, 3, 200, 3), 20).0, Some(Take::Train));
}

#[test]
fn a_worker_never_moves_back_nor_onto_another_branch() {
    let mut f = follower(1, Chain::default());
    hear(&mut f, key(1), &announced(1, 5, 100, 5), 10);
    let (take, actions) = hear(&mut f, key(2), &announced(2, 5, 200, 6), 20);
    assert_eq!(take, Some(Take::Refused(Behind::Fork { round: 5 })), "round 5 from other parameters");
    assert_eq!(
        actions,
        vec![Action::SaveTerm(2), Action::Follow { term: 2, leader: key(2) }],
        "the lease still counts"
    );
    let (take, _) = hear(&mut f, key(3), &announced(3, 4, 300, 4), 30);
    assert_eq!(take, Some(Take::Refused(Behind::Round { round: 4, trained: 5 })), "an earlier round");
    assert_eq!(f.rounds.chain(), Chain { term: 1, round: 5, params: [5; 32] }, "the chain did not move");
    let (take, _) = hear(&mut f, key(1), &announced(4, 6, 400, 6), 40);
    assert_eq!(take, Some(Take::Train), "the next round, from whoever leads");
}

#[test]
fn without_the_chain_any_later_announcement_is_trained() {
    let mut rounds = Rounds::new(Chain::default()).leave_out_chain();
    rounds.announced(&announced(1, 5, 100, 5));
    assert_eq!(rounds.announced(&announced(2, 4, 200, 4)).0, Take::Train);
}

#[test]
fn a_round_it_is_not_in_is_taken_without_its_chain() {
    let mut f = follower(1, Chain::default());
    let a = Announced { participant: false, ..announced(1, 2, 100, 2) };
    assert_eq!(hear(&mut f, key(1), &a, 10), (Some(Take::Skip), vec![]));
    assert_eq!(f.rounds.seen(), Some(a.opening));
    assert_eq!(f.rounds.chain(), Chain::default());
    let zero = announced(1, 0, 200, 0);
    assert_eq!(hear(&mut f, key(1), &zero, 20).0, Some(Take::Seen), "round 0 opens nothing");
}

#[test]
fn a_refused_lease_takes_nothing() {
    let mut f = follower(2, Chain::default());
    let (take, actions) = hear(&mut f, key(1), &announced(1, 1, 100, 1), 10);
    assert_eq!(take, None);
    assert!(matches!(&actions[..], [Action::Rejected { .. }]));
    assert_eq!(f.rounds.seen(), None);
}

#[test]
fn sends_and_fetches_are_moot_by_the_rules() {
    let current = Opening { term: 2, round: 5, opened_ms: 100 };
    let at = |term, round, opened_ms| Announced { finished: false, ..announced(term, round, opened_ms, 0) };
    assert!(!moot(current, &at(2, 6, 200)), "the next round of the same term answers the send");
    assert!(moot(current, &at(2, 7, 300)), "two rounds on");
    assert!(moot(current, &at(3, 5, 50)), "a new term");
    assert!(moot(current, &at(2, 5, 150)), "the round reopened");
    assert!(!moot(current, &at(2, 5, 100)), "the same opening");
    assert!(moot(current, &Announced { finished: true, ..at(2, 5, 100) }), "the run's end");
    assert!(newer(current, &at(2, 6, 200)) && newer(current, &at(3, 4, 0)));
    assert!(!newer(current, &at(2, 5, 100)) && !newer(current, &at(1, 9, 900)));
}
