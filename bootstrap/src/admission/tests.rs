//! [`Admission`] without a swarm: connections are told by hand, heads are built
//! unsigned (the codec verifies signatures before asking), and waits run on tokio's
//! paused clock.

use std::net::{Ipv4Addr, Ipv6Addr};
use std::time::Duration;

use pcp_protocol::Identity;
use pcp_schema::EnvelopeHeader;

use super::*;

fn head(kind: MessageKind, signer: &Identity, run: RunId, round: u64, payload_len: u64) -> FrameHead {
    FrameHead {
        header: EnvelopeHeader { kind, signer: signer.public().0, run: run.0, round, nonce: 1, unix_ms: 1 },
        payload_len,
        payload_hash: [0; 32],
        signature: [0; 64],
    }
}

fn identity(i: u64) -> Identity {
    let mut secret = [7u8; 32];
    secret[..8].copy_from_slice(&i.to_le_bytes());
    Identity::from_secret(secret)
}

/// The connection of `who` from `ip`.
fn remote(who: &Identity, ip: IpAddr) -> Remote {
    let peer = crate::ids::peer_of(&who.public()).expect("a valid key");
    Remote { peer, key: Some(who.public()), address: Some(crate::ip_limits::address_key(ip)) }
}

const HOME: IpAddr = IpAddr::V4(Ipv4Addr::new(192, 0, 2, 1));

#[test]
fn a_run_that_carries_reads_the_round_before_the_open_one_and_no_older() {
    let admission = Arc::new(Admission::default());
    let (slow, fast, joiner) = (identity(1), identity(2), identity(3));
    let run = RunId([8; 32]);
    let ask = |who: &Identity, round| {
        admission.permit(&head(MessageKind::Contribution, who, run, round, 10), who.public(), &remote(who, HOME))
    };
    admission.serve(run, 1000);
    admission.open_round(run, 1, &[slow.public(), fast.public()]);
    drop(ask(&fast, 1).expect("in time"));
    // without carry, the round before is closed to contributions
    admission.open_round(run, 2, &[slow.public(), fast.public(), joiner.public()]);
    assert!(matches!(ask(&slow, 1), Err(Refusal::NotOpen { round: 1, .. })));

    admission.carry(run);
    admission.open_round(run, 3, &[slow.public(), fast.public(), joiner.public()]);
    // round 2, closed as 3 opens, is still read from its participants, its permits counted
    drop(ask(&slow, 2).expect("a late contribution for the round before"));
    drop(ask(&slow, 2).expect("and its retry"));
    assert!(matches!(ask(&slow, 2), Err(Refusal::Spent { round: 2, .. })));
    drop(ask(&joiner, 2).expect("the joiner was a participant of round 2"));
    drop(ask(&slow, 3).expect("and the open round"));
    // two rounds old: refused
    admission.open_round(run, 4, &[slow.public()]);
    assert!(matches!(ask(&fast, 2), Err(Refusal::NotOpen { round: 2, .. })));
    assert!(matches!(ask(&joiner, 4), Err(Refusal::NotParticipant { .. })));
    drop(ask(&joiner, 3).expect("round 3 is the round before"));
}

#[test]
fn contributions_only_from_participants_of_the_open_round_and_up_to_its_size() {
    let admission = Arc::new(Admission::default());
    let (worker, joined_late) = (identity(1), identity(2));
    let run = RunId([9; 32]);
    let ask = |who: &Identity, round, len| {
        admission.permit(&head(MessageKind::Contribution, who, run, round, len), who.public(), &remote(who, HOME))
    };

    assert!(matches!(ask(&worker, 1, 10), Err(Refusal::NotServed { .. })));
    admission.serve(run, 1000);
    // a hello or heartbeat makes a signer known, not a participant
    admission.know(run, worker.public());
    assert!(matches!(ask(&worker, 1, 10), Err(Refusal::NotOpen { round: 1, .. })));
    admission.open_round(run, 1, &[worker.public()]);
    admission.know(run, joined_late.public());
    assert!(matches!(ask(&joined_late, 1, 10), Err(Refusal::NotParticipant { .. })));
    assert!(matches!(ask(&worker, 2, 10), Err(Refusal::NotOpen { round: 2, .. })));
    assert!(matches!(ask(&worker, 1, 1001), Err(Refusal::TooLarge { max: 1000, .. })));
    let first = ask(&worker, 1, 1000).expect("a participant's contribution");
    assert!(matches!(ask(&worker, 1, 1000), Err(Refusal::Busy { .. })), "one at a time");
    drop(first);
    let retry = ask(&worker, 1, 1000).expect("and its retry");
    drop(retry);
    assert!(matches!(ask(&worker, 1, 10), Err(Refusal::Spent { round: 1, .. })));

    // the next round: the round before is closed, the permits are new
    admission.open_round(run, 2, &[worker.public(), joined_late.public()]);
    assert!(matches!(ask(&worker, 1, 10), Err(Refusal::NotOpen { round: 1, .. })));
    assert!(ask(&joined_late, 2, 1000).is_ok());
    assert!(admission.is_participant(run, joined_late.public()));
    admission.forget(run, joined_late.public());
    assert!(matches!(ask(&joined_late, 2, 10), Err(Refusal::NotParticipant { .. })));
    assert!(!admission.is_known(run, joined_late.public()));
}

#[test]
fn a_head_sent_by_another_peer_takes_none_of_its_signers_permits() {
    let admission = Arc::new(Admission::default());
    let (worker, thief) = (identity(1), identity(2));
    let run = RunId([9; 32]);
    admission.serve(run, 1000);
    admission.open_round(run, 1, &[worker.public()]);
    let captured = head(MessageKind::Contribution, &worker, run, 1, 1000);
    for _ in 0..10 {
        let refused = admission.permit(&captured, worker.public(), &remote(&thief, HOME));
        assert!(matches!(refused, Err(Refusal::NotSender { .. })), "{refused:?}");
    }
    let refused = admission.permit(&captured, worker.public(), &Remote { key: None, ..remote(&thief, HOME) });
    assert!(matches!(refused, Err(Refusal::NotSender { .. })), "a peer id without a key");
    for _ in 0..CONTRIBUTIONS_PER_ROUND {
        assert!(admission.permit(&captured, worker.public(), &remote(&worker, HOME)).is_ok());
    }
    assert!(matches!(admission.permit(&captured, worker.public(), &remote(&worker, HOME)), Err(Refusal::Spent { .. })));
}

/// A burst of participants larger than the budget: the one that finds it full
/// waits and is read when a permit comes back, not refused; past its wait, it is.
#[tokio::test(start_paused = true)]
async fn a_contribution_waits_for_room_instead_of_being_refused() {
    let admission = Arc::new(Admission::default());
    let run = RunId([9; 32]);
    admission.serve(run, 1000);
    let workers: Vec<Identity> = (0..66).map(identity).collect();
    let keys: Vec<PublicKey> = workers.iter().map(Identity::public).collect();
    admission.open_round(run, 1, &keys);
    let head = |who: &Identity| head(MessageKind::Contribution, who, run, 1, 1000);
    let mut held: Vec<Permit> = workers[..64]
        .iter()
        .map(|w| admission.permit(&head(w), w.public(), &remote(w, HOME)).expect("the budget's first 64"))
        .collect();
    let last = &workers[64];
    let waiting = {
        let (admission, head, from) = (admission.clone(), head(last), remote(last, HOME));
        let key = last.public();
        tokio::spawn(async move { admission.wait_for_room(&head, key, &from, Duration::from_secs(60)).await })
    };
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert!(!waiting.is_finished(), "it waits while the budget is full");
    assert_eq!(admission.receiving(), 65, "64 being read, one waiting");
    held.pop();
    let permit = waiting.await.expect("joins").expect("read once a permit came back");
    held.push(permit);
    // nothing comes back: refused once its wait is over
    let other = &workers[65];
    let (other_head, from) = (head(other), remote(other, HOME));
    let refused = admission.wait_for_room(&other_head, other.public(), &from, Duration::from_secs(60)).await;
    assert!(matches!(refused, Err(Refusal::Full { .. })));
}

#[test]
fn the_budget_keeps_room_for_first_contributions_over_retries() {
    let admission = Arc::new(Admission::default());
    let run = RunId([9; 32]);
    admission.serve(run, 1000);
    assert_eq!(contribution_budget(1000), 64_000);
    // more participants than the budget holds at once
    let workers: Vec<Identity> = (0..66).map(identity).collect();
    let keys: Vec<PublicKey> = workers.iter().map(Identity::public).collect();
    admission.open_round(run, 1, &keys);
    let ask = |who: &Identity| {
        admission.permit(&head(MessageKind::Contribution, who, run, 1, 1000), who.public(), &remote(who, HOME))
    };
    // the first sends, its stream breaks, and it retries while 65 have not sent: no room
    drop(ask(&workers[0]).expect("a first contribution"));
    assert!(matches!(ask(&workers[0]), Err(Refusal::Full { budget: 64_000, .. })));
    let held: Vec<Permit> = workers[1..65].iter().map(|w| ask(w).expect("the firsts fill the budget")).collect();
    assert!(matches!(ask(&workers[65]), Err(Refusal::Full { .. })), "full");
    drop(held);
    // one has not sent yet: its room is kept, the rest is the retry's
    let retry = ask(&workers[0]).expect("room for the retry");
    assert!(ask(&workers[65]).is_ok());
    drop(retry);
    assert_eq!(admission.lock().contribution_bytes, 0);
}

#[test]
fn small_frames_are_shared_per_signer_per_address_and_per_pool() {
    let admission = Arc::new(Admission::default());
    let run = RunId([3; 32]);
    admission.serve(run, 1 << 20);
    let (participant, known) = (identity(1), identity(2));
    admission.open_round(run, 1, &[participant.public()]);
    admission.know(run, known.public());
    let small = SMALL_FRAME as u64;
    let frame = (SMALL_FRAME + FRAME_COST) as u64;
    let ask = |who: &Identity, ip: IpAddr, len| {
        admission.permit(&head(MessageKind::Heartbeat, who, run, 1, len), who.public(), &remote(who, ip))
    };
    let stranger = identity(3);
    assert!(matches!(ask(&stranger, HOME, small + 1), Err(Refusal::TooLarge { .. })));

    // one signer: two of the largest
    let mine: Vec<Permit> = (0..2).map(|_| ask(&stranger, HOME, small).expect("within its allowance")).collect();
    assert!(matches!(ask(&stranger, HOME, small), Err(Refusal::Budget { scope: "this signer", .. })));
    drop(mine);

    // one address with many keys: ADDRESS_BUDGET, whatever the keys
    let per_address = ADDRESS_BUDGET / frame as usize;
    let sybils: Vec<Identity> = (100..100 + per_address as u64 + 1).map(identity).collect();
    let held: Vec<Permit> =
        sybils[..per_address].iter().map(|s| ask(s, HOME, small).expect("within the address's allowance")).collect();
    let last = sybils.last().expect("one more");
    assert!(matches!(ask(last, HOME, small), Err(Refusal::Budget { scope: "its address", .. })));
    // an IPv6 /64 is one address; the next /64 is another
    let v6 = |last: u16, net: u16| IpAddr::V6(Ipv6Addr::new(0x2001, 0xdb8, 0, net, 0, 0, 0, last));
    let v6_held: Vec<Permit> = sybils[..per_address]
        .iter()
        .enumerate()
        .map(|(i, s)| ask(s, v6(i as u16, 1), small).expect("another address"))
        .collect();
    assert!(matches!(ask(last, v6(999, 1), small), Err(Refusal::Budget { scope: "its address", .. })));
    assert!(ask(last, v6(999, 2), small).is_ok());
    // the known worker and the participant are not kept out by the strangers at their address
    let heartbeat = ask(&known, HOME, small).expect("a known worker's own allowance");
    assert_eq!(admission.known_bytes(), frame as usize);
    drop(heartbeat);
    let participant_frames: Vec<Permit> = (0..64).map(|_| ask(&participant, HOME, small).expect("free")).collect();
    drop((held, v6_held, participant_frames));
    assert_eq!((admission.stranger_bytes(), admission.known_bytes()), (0, 0));
    assert!(admission.lock().per_address.is_empty() && admission.lock().per_signer.is_empty());

    // strangers from many addresses share STRANGER_BUDGET; known workers have their own
    let fill = STRANGER_BUDGET / frame as usize;
    let many: Vec<Identity> = (1000..1000 + fill as u64).map(identity).collect();
    let ip = |i: usize| IpAddr::V4(Ipv4Addr::new(10, 0, (i >> 8) as u8, i as u8));
    let held: Vec<Permit> =
        many.iter().enumerate().map(|(i, s)| ask(s, ip(i), small).expect("within the pool")).collect();
    assert!(matches!(ask(last, ip(fill + 1), small), Err(Refusal::Budget { scope: "strangers", .. })));
    let heartbeat = ask(&known, HOME, small).expect("a known worker's own pool");
    assert_eq!(admission.known_bytes(), frame as usize);
    drop((held, heartbeat));
    assert_eq!((admission.stranger_bytes(), admission.known_bytes()), (0, 0));
}

/// `who` connects from `addr` on connection `id`.
fn connect(admission: &Admission, id: usize, who: &Identity, addr: &str) {
    let peer = crate::ids::peer_of(&who.public()).expect("a valid key");
    admission.connected(ConnectionId::new_unchecked(id), peer, &addr.parse().expect("a multiaddr"));
}

#[test]
fn an_address_holds_at_most_the_cap_of_a_runs_workers_until_one_is_forgotten() {
    let admission = Admission::default();
    let run = RunId([6; 32]);
    let workers: Vec<Identity> = (0..5).map(identity).collect();
    assert!(matches!(admission.admit_worker(run, workers[0].public(), 2), Err(AdmitError::NotServed { .. })));
    admission.serve(run, 10);
    assert_eq!(
        admission.admit_worker(run, workers[0].public(), 2),
        Err(AdmitError::NotConnected { signer: workers[0].public() })
    );
    for (i, w) in workers[..3].iter().enumerate() {
        connect(&admission, i, w, "/ip4/203.0.113.5/udp/4001/quic-v1");
    }
    admission.admit_worker(run, workers[0].public(), 2).expect("the first of its address");
    admission.admit_worker(run, workers[1].public(), 2).expect("the second");
    admission.admit_worker(run, workers[0].public(), 2).expect("admitted again: no other slot");
    let crowded = admission.admit_worker(run, workers[2].public(), 2);
    assert_eq!(
        crowded.as_ref().err().map(ToString::to_string),
        Some(format!(
            "worker {} refused: 203.0.113.5 already has 2 worker identities in run {run}, \
             the most one address may have",
            workers[2].public()
        ))
    );
    assert!(!admission.is_known(run, workers[2].public()));
    // another run has its own count
    let other = RunId([7; 32]);
    admission.serve(other, 10);
    admission.admit_worker(other, workers[2].public(), 2).expect("another run");
    // a heartbeat (know) keeps the slot; forgetting frees it
    admission.know(run, workers[1].public());
    assert!(admission.admit_worker(run, workers[2].public(), 2).is_err());
    admission.forget(run, workers[1].public());
    admission.admit_worker(run, workers[2].public(), 2).expect("a freed slot");

    // a worker that moves to another address takes its slot along
    connect(&admission, 10, &workers[0], "/ip4/198.51.100.1/tcp/4001");
    admission.admit_worker(run, workers[0].public(), 2).expect("its new address");
    admission.disconnected(ConnectionId::new_unchecked(10));
    connect(&admission, 3, &workers[3], "/ip4/203.0.113.5/tcp/4001");
    admission.admit_worker(run, workers[3].public(), 2).expect("the slot worker 0 left");
    // once its connections close, a worker cannot be admitted
    admission.disconnected(ConnectionId::new_unchecked(0));
    assert!(matches!(admission.admit_worker(run, workers[0].public(), 2), Err(AdmitError::NotConnected { .. })));
}

#[test]
fn an_ipv6_64_is_one_address() {
    let admission = Admission::default();
    let run = RunId([6; 32]);
    admission.serve(run, 10);
    let workers: Vec<Identity> = (0..3).map(identity).collect();
    connect(&admission, 0, &workers[0], "/ip6/2001:db8:0:1::a/udp/4001/quic-v1");
    connect(&admission, 1, &workers[1], "/ip6/2001:db8:0:1:ffff::b/tcp/4001");
    connect(&admission, 2, &workers[2], "/ip6/2001:db8:0:2::a/tcp/4001");
    admission.admit_worker(run, workers[0].public(), 1).expect("the /64's one");
    let crowded = admission.admit_worker(run, workers[1].public(), 1);
    assert!(
        matches!(&crowded, Err(e @ AdmitError::Crowded { .. }) if e.to_string().contains("2001:db8:0:1::/64")),
        "{crowded:?}"
    );
    admission.admit_worker(run, workers[2].public(), 1).expect("another /64");
}

/// Workers on many /64s of one IPv6 /48 (one household's free prefix) fill at most
/// [`MAX_64S_PER_48`] /64s of a run; another /48 is not kept out, and a /64 freed
/// takes one more.
#[test]
fn an_ipv6_48_holds_workers_on_at_most_max_64s_per_48_of_its_64s() {
    let admission = Admission::default();
    let run = RunId([6; 32]);
    admission.serve(run, 10);
    let in_48 = |net: u16, host: u16| format!("/ip6/2001:db8:7:{net:x}::{host:x}/udp/4001/quic-v1");
    let sybils: Vec<Identity> = (0..MAX_64S_PER_48 as u64 + 2).map(|i| identity(100 + i)).collect();
    for (i, s) in sybils.iter().enumerate() {
        connect(&admission, i, s, &in_48(i as u16, 1));
    }
    for s in &sybils[..MAX_64S_PER_48] {
        admission.admit_worker(run, s.public(), 4).expect("a /64 of the /48's first 16");
    }
    let refused = admission.admit_worker(run, sybils[MAX_64S_PER_48].public(), 4);
    assert_eq!(
        refused.as_ref().err().map(ToString::to_string),
        Some(format!(
            "worker {} refused: 2001:db8:7::/48 already has workers of run {run} on 16 /64s, the most one /48 may have",
            sybils[MAX_64S_PER_48].public()
        ))
    );
    assert!(!admission.is_known(run, sybils[MAX_64S_PER_48].public()));
    // more keys on a /64 already counted are still the cap per address's to refuse
    let neighbour = identity(999);
    connect(&admission, 500, &neighbour, &in_48(0, 2));
    admission.admit_worker(run, neighbour.public(), 4).expect("a /64 the /48 already counts");
    // a worker moving between two /64s of the /48 keeps its place
    connect(&admission, 501, &sybils[1], &in_48(0x100, 1));
    admission.admit_worker(run, sybils[1].public(), 4).expect("moved: its old /64 is free");
    // another /48 is not kept out
    let other = identity(1000);
    connect(&admission, 502, &other, "/ip6/2001:db8:8:1::1/tcp/4001");
    admission.admit_worker(run, other.public(), 4).expect("another /48");
    // a /64 given back takes one more
    admission.worker_left(run, sybils[2].public());
    admission.admit_worker(run, sybils[MAX_64S_PER_48].public(), 4).expect("a freed /64");
    assert!(matches!(
        admission.admit_worker(run, sybils[MAX_64S_PER_48 + 1].public(), 4),
        Err(AdmitError::CrowdedNetwork { .. })
    ));
    let inner = admission.lock();
    assert_eq!(inner.runs[&run].known.networks_held(), 2);
}

/// A worker reached through a relay is counted in the run's relayed pool, not under
/// the relay's address: workers behind one public relay are not held to one address's
/// cap, nor kept out by the relay's own workers; the pool holds
/// [`RELAYED_POOL_FACTOR`] × the cap; a direct connection (a hole punch) is preferred.
#[test]
fn a_relayed_worker_counts_in_the_relayed_pool_not_under_its_relays_address() {
    let admission = Admission::default();
    let run = RunId([6; 32]);
    admission.serve(run, 10);
    let relay = identity(99);
    let relay_peer = crate::ids::peer_of(&relay.public()).expect("a valid key");
    let relayed = format!("/ip4/192.0.2.50/udp/4001/quic-v1/p2p/{relay_peer}/p2p-circuit");
    // the relay is a worker itself, filling its address's cap of 1
    connect(&admission, 0, &relay, "/ip4/192.0.2.50/udp/4001/quic-v1");
    admission.admit_worker(run, relay.public(), 1).expect("the relay's own address");
    let pool = RELAYED_POOL_FACTOR;
    let behind: Vec<Identity> = (0..pool as u64 + 2).map(|i| identity(200 + i)).collect();
    for (i, w) in behind.iter().enumerate() {
        connect(&admission, 1 + i, w, &relayed);
    }
    for w in &behind[..pool] {
        admission.admit_worker(run, w.public(), 1).expect("the relayed pool, not the relay's address");
    }
    {
        let inner = admission.lock();
        let known = &inner.runs[&run].known;
        assert_eq!((known.at(Slot::Relayed), known.at(Slot::Address(ip4(192, 0, 2, 50)))), (pool, 1));
    }
    let full = admission.admit_worker(run, behind[pool].public(), 1);
    assert_eq!(
        full.as_ref().err().map(ToString::to_string),
        Some(format!(
            "worker {} refused: run {run} already has 16 workers reached only through a relay, the most it takes \
             (a direct connection counts by its own address)",
            behind[pool].public()
        ))
    );
    // a hole punch: the worker is counted under its own address, its pool slot is free
    connect(&admission, 100, &behind[0], "/ip4/203.0.113.77/udp/4001/quic-v1");
    admission.admit_worker(run, behind[0].public(), 1).expect("direct: its own address");
    admission.admit_worker(run, behind[pool].public(), 1).expect("the pool slot it gave back");
    // a direct worker whose address is full is not admitted through a relay instead
    let twin = identity(300);
    connect(&admission, 101, &twin, "/ip4/203.0.113.77/tcp/4001");
    connect(&admission, 102, &twin, &relayed);
    assert!(matches!(admission.admit_worker(run, twin.public(), 1), Err(AdmitError::Crowded { .. })));
    // one that left gives its pool slot back
    admission.worker_left(run, behind[1].public());
    admission.admit_worker(run, behind[pool + 1].public(), 1).expect("a slot given back");
}

/// An address full of workers takes a new key once one of them has left (the
/// shepherd says so when its heartbeats stop), and that one keeps the permits of the
/// round it was named a participant of.
#[test]
fn a_worker_that_left_frees_its_slot_and_keeps_its_rounds_permits() {
    let admission = Arc::new(Admission::default());
    let run = RunId([6; 32]);
    admission.serve(run, 1000);
    let workers: Vec<Identity> = (0..6).map(identity).collect();
    for (i, w) in workers.iter().enumerate() {
        connect(&admission, i, w, "/ip4/198.51.100.9/udp/4001/quic-v1");
    }
    for w in &workers[..4] {
        admission.admit_worker(run, w.public(), 4).expect("the address's first 4");
    }
    assert!(matches!(admission.admit_worker(run, workers[4].public(), 4), Err(AdmitError::Crowded { .. })));
    admission.open_round(run, 1, &[workers[0].public()]);
    admission.worker_left(run, workers[0].public());
    assert!(!admission.is_known(run, workers[0].public()));
    admission.admit_worker(run, workers[4].public(), 4).expect("the slot of the worker that left");
    assert!(matches!(admission.admit_worker(run, workers[5].public(), 4), Err(AdmitError::Crowded { .. })));
    // its late contribution is still read
    let head = head(MessageKind::Contribution, &workers[0], run, 1, 10);
    let from = remote(&workers[0], IpAddr::V4(Ipv4Addr::new(198, 51, 100, 9)));
    assert!(admission.permit(&head, workers[0].public(), &from).is_ok());
    // forgetting frees a slot too
    admission.forget(run, workers[1].public());
    admission.admit_worker(run, workers[5].public(), 4).expect("the slot of a forgotten worker");
}

fn ip4(a: u8, b: u8, c: u8, d: u8) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(a, b, c, d))
}

#[test]
fn loopback_is_exempt_unless_counted() {
    let admission = Admission::default();
    let run = RunId([6; 32]);
    admission.serve(run, 10);
    let workers: Vec<Identity> = (0..3).map(identity).collect();
    for (i, w) in workers.iter().enumerate() {
        connect(&admission, i, w, "/ip4/127.0.0.1/tcp/4001");
    }
    connect(&admission, 9, &workers[2], "/ip6/::1/tcp/4001");
    for w in &workers {
        admission.admit_worker(run, w.public(), 1).expect("loopback is not counted");
    }
    let admission = Admission::default();
    admission.serve(run, 10);
    admission.count_loopback(true);
    for (i, w) in workers.iter().enumerate() {
        connect(&admission, i, w, "/ip4/127.0.0.1/tcp/4001");
    }
    admission.admit_worker(run, workers[0].public(), 2).expect("one");
    admission.admit_worker(run, workers[1].public(), 2).expect("two");
    let crowded = admission.admit_worker(run, workers[2].public(), 2);
    assert!(matches!(crowded, Err(AdmitError::Crowded { max_per_address: 2, .. })), "{crowded:?}");
    admission.forget(run, workers[0].public());
    admission.admit_worker(run, workers[2].public(), 2).expect("a forgotten worker's slot");
}

#[test]
fn a_worker_forgotten_as_the_longest_silent_frees_its_slot() {
    let admission = Admission::default();
    let run = RunId([6; 32]);
    admission.serve(run, 10);
    admission.count_loopback(true);
    let (first, second) = (identity(1), identity(2));
    connect(&admission, 0, &first, "/ip4/203.0.113.5/tcp/1");
    connect(&admission, 1, &second, "/ip4/203.0.113.5/tcp/2");
    admission.admit_worker(run, first.public(), 1).expect("the address's one");
    assert!(admission.admit_worker(run, second.public(), 1).is_err());
    for i in 0..MAX_KNOWN as u64 {
        admission.know(run, identity(1000 + i).public());
    }
    assert!(!admission.is_known(run, first.public()));
    admission.admit_worker(run, second.public(), 1).expect("the slot of a worker no longer known");
    let inner = admission.lock();
    let known = &inner.runs[&run].known;
    assert_eq!(known.slots_held(), 1);
}

#[test]
fn connections_remembered_are_bounded() {
    let admission = Admission::default();
    for i in 0..MAX_CONNECTIONS + 10 {
        connect(&admission, i, &identity(i as u64), "/ip4/203.0.113.5/tcp/1");
    }
    assert_eq!(admission.lock().connections.len(), MAX_CONNECTIONS);
    for i in 0..MAX_CONNECTIONS + 10 {
        admission.disconnected(ConnectionId::new_unchecked(i));
    }
    assert!(admission.lock().connections.is_empty());
}

#[test]
fn a_run_knows_at_most_max_known_signers_the_longest_silent_out_first() {
    let admission = Admission::default();
    let run = RunId([4; 32]);
    admission.serve(run, 10);
    let keys: Vec<PublicKey> = (0..MAX_KNOWN as u64 + 2).map(|i| identity(i).public()).collect();
    for k in &keys[..MAX_KNOWN] {
        admission.know(run, *k);
    }
    // the first speaks again: the second is now the longest silent
    admission.know(run, keys[0]);
    admission.know(run, keys[MAX_KNOWN]);
    assert!(admission.is_known(run, keys[0]) && admission.is_known(run, keys[MAX_KNOWN]));
    assert!(!admission.is_known(run, keys[1]));
    assert!(!admission.is_known(RunId([5; 32]), keys[0]), "only for runs served");
}

/// Once a node knows a run's candidates, only they may gossip on its topic: a fresh
/// key's gossip is dropped at the first hop (and not forwarded); a run whose
/// candidates it does not know yet takes anyone's.
#[test]
fn only_the_candidates_gossip_once_they_are_known() {
    let admission = Admission::default();
    let (run, other) = (RunId([1; 32]), RunId([2; 32]));
    let (leader, standby, fresh) = (identity(1).public(), identity(2).public(), identity(3).public());
    assert!(admission.may_gossip(run, fresh), "candidates not known yet: anyone");
    admission.candidates(run, &[leader, standby]);
    assert!(admission.may_gossip(run, leader) && admission.may_gossip(run, standby));
    assert!(!admission.may_gossip(run, fresh));
    assert!(admission.may_gossip(other, fresh), "another run's candidates are not this one's");
}

#[test]
fn an_aggregator_reads_large_slices_only_from_the_senders_it_named_for_the_round() {
    let admission = Arc::new(Admission::default());
    let (worker, replica, stranger) = (identity(1), identity(2), identity(3));
    let run = RunId([9; 32]);
    let big = (4 * SMALL_FRAME) as u64;
    let ask = |who: &Identity, round, len| {
        admission.permit(&head(MessageKind::Slice, who, run, round, len), who.public(), &remote(who, HOME))
    };
    // a slice is a small frame until the node aggregates the round
    assert!(matches!(ask(&worker, 1, big), Err(Refusal::TooLarge { .. })));
    admission.aggregate((run, 1), &[(worker.public(), 2), (replica.public(), 1)], big as usize);
    let held = ask(&worker, 1, big).expect("a named worker's slice").hold().expect("held past its read");
    drop(ask(&worker, 1, big).expect("its second"));
    assert!(matches!(ask(&worker, 1, big), Err(Refusal::SlicesSpent { round: 1, .. })));
    assert!(matches!(ask(&replica, 1, big + 1), Err(Refusal::TooLarge { .. })), "past the round's length");
    assert!(matches!(ask(&stranger, 1, big), Err(Refusal::TooLarge { .. })), "a stranger's is a small frame");
    assert!(matches!(ask(&worker, 2, big), Err(Refusal::TooLarge { .. })), "a round not aggregated here");
    drop(ask(&replica, 1, big).expect("the first replica, forwarding"));
    drop(held);
    // the newest rounds are kept
    for round in 2..=5 {
        admission.aggregate((run, round), &[(worker.public(), 1)], 10);
    }
    assert!(matches!(ask(&replica, 1, big), Err(Refusal::TooLarge { .. })), "round 1 is forgotten");
    drop(ask(&worker, 5, 10).expect("the newest round"));
}

#[test]
fn slices_in_flight_fill_their_budget_and_free_it_when_handled() {
    let admission = Arc::new(Admission::default());
    let run = RunId([10; 32]);
    let workers: Vec<Identity> = (0..=SLICES_IN_FLIGHT as u64).map(identity).collect();
    let senders: Vec<(PublicKey, usize)> = workers.iter().map(|w| (w.public(), 1)).collect();
    admission.aggregate((run, 1), &senders, 1000);
    let ask = |who: &Identity| {
        admission.permit(&head(MessageKind::Slice, who, run, 1, 1000), who.public(), &remote(who, HOME))
    };
    let mut held: Vec<Permit> = workers[..SLICES_IN_FLIGHT].iter().map(|w| ask(w).expect("room")).collect();
    let last = &workers[SLICES_IN_FLIGHT];
    assert!(matches!(ask(last), Err(Refusal::Full { kind: "slice", budget: 64_000, .. })));
    held.pop();
    drop(ask(last).expect("room once one is handled"));
}

#[test]
fn a_worker_reads_large_screen_requests_only_from_its_runs_leader_and_a_few_at_once() {
    let admission = Arc::new(Admission::default());
    let (leader, successor, stranger) = (identity(1), identity(2), identity(3));
    let run = RunId([11; 32]);
    let big = (4 * SMALL_FRAME) as u64;
    let ask = |who: &Identity, run, len| {
        admission.permit(&head(MessageKind::ScreenRequest, who, run, 1, len), who.public(), &remote(who, HOME))
    };
    // a small frame until the node screens for the run
    assert!(matches!(ask(&leader, run, big), Err(Refusal::TooLarge { .. })));
    admission.screen_for(run, leader.public(), big as usize);
    let mut held: Vec<Permit> = (0..SCREENS_IN_FLIGHT).map(|_| ask(&leader, run, big).expect("the leader's")).collect();
    assert!(matches!(ask(&leader, run, big), Err(Refusal::Full { kind: "screen request", .. })));
    held.pop();
    drop(ask(&leader, run, big).expect("room once one is handled"));
    assert!(matches!(ask(&leader, run, big + 1), Err(Refusal::TooLarge { .. })), "past the run's length");
    assert!(matches!(ask(&stranger, run, big), Err(Refusal::TooLarge { .. })), "a stranger's is a small frame");
    assert!(matches!(ask(&leader, RunId([12; 32]), big), Err(Refusal::TooLarge { .. })), "another run's");
    // a new leader replaces the last
    admission.screen_for(run, successor.public(), big as usize);
    assert!(matches!(ask(&leader, run, big), Err(Refusal::TooLarge { .. })));
    drop(held);
    drop(ask(&successor, run, big).expect("the new leader's"));
}
