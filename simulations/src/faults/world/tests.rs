use super::*;

#[test]
fn a_clock_that_stopped_wakes_where_it_stopped() {
    let mut clock = Clock { start: 1_000, rate: 1_000, jump: 0, stopped: 0 };
    let asleep = clock.local(5_000);
    // a pause from 5 s to 9 s that the clock counts: it jumps on waking
    assert_eq!(clock.local(9_000), asleep + 4_000);
    // one that stopped it
    clock.stopped += 4_000;
    assert_eq!(clock.local(9_000), asleep);
    assert_eq!(clock.local(9_500), asleep + 500);
}

/// A seed's candidates and transfer times.
type Shape = (usize, (u64, u64));

#[test]
fn seeds_draw_their_shape() {
    let shapes: Vec<Shape> = (0..2_000).map(shape).collect();
    let share = |f: &dyn Fn(&Shape) -> bool| shapes.iter().filter(|s| f(s)).count() * 100 / 2_000;
    assert!((10..20).contains(&share(&|s| s.0 == 2)), "{}", share(&|s| s.0 == 2));
    assert!((10..20).contains(&share(&|s| s.0 == 5)));
    assert!((15..25).contains(&share(&|s| s.1 == (4_000, 40_000))));
    assert_eq!(Mode::for_candidates(2), Mode::BestEffort);
    assert_eq!(Mode::for_candidates(3), Mode::Majority);
}

/// Delivers `msg` from `from` to worker `to` at once: what it sends back.
fn to_worker(w: &mut World, from: usize, to: usize, msg: Msg) -> Vec<(usize, Msg)> {
    let mut sent = Vec::new();
    w.handle(to, |role, ctx| {
        if let Role::Worker(worker) = role {
            worker.on_msg(from, msg, ctx);
        }
        sent = ctx.sends.iter().map(|(to, msg, _)| (*to, *msg)).collect();
    });
    sent
}

/// Gossip: a worker forwards an announcement it takes, once, to two other
/// workers, as its signer's, and takes a forwarded one as a lease from its
/// signer; a deposed leader's announcement forwarded late is refused without a
/// word (a lease straight from that leader is answered with the newer term).
#[test]
fn a_forwarded_stale_announcement_is_refused() {
    use super::super::msg::Announce;
    use super::super::worker::GOSSIP_FANOUT;
    let mut w = World::new(1, Rules::without(None));
    let c = w.setup.candidates;
    let (me, relay) = (c, c + 1);
    w.start(me, None);
    let leader = |term: u64| w.setup.index(&w.setup.succession.leader(term));
    let (deposed, current) = (leader(1), leader(2));
    let (base, _) = World::initial();
    let announce = |term| Announce { term, round: 1, base, participants: 0b1111, opened_ms: 10 };
    let gossip = |origin, term| Msg::Gossip { origin, term, epoch: 1, sent: 10, announce: announce(term) };

    // the worker follows term 2
    let lease = Msg::Lease { term: 2, epoch: 1, sent: 5, announce: None };
    assert!(to_worker(&mut w, current, me, lease).is_empty());
    // term 1's announcement, forwarded: refused, no answer, not forwarded
    assert!(to_worker(&mut w, relay, me, gossip(deposed, 1)).is_empty());
    // term 2's: taken from its signer (the fetch goes to it), forwarded to two others
    let sent = to_worker(&mut w, relay, me, gossip(current, 2));
    assert!(sent.contains(&(current, Msg::Fetch { want: base })), "{sent:?}");
    let forwards: Vec<usize> = sent.iter().filter(|(_, m)| *m == gossip(current, 2)).map(|(to, _)| *to).collect();
    assert_eq!(forwards.len(), GOSSIP_FANOUT, "{sent:?}");
    assert!(forwards.iter().all(|to| *to >= c && *to != me) && forwards[0] != forwards[1], "{forwards:?}");
    // once only
    assert!(to_worker(&mut w, relay + 1, me, gossip(current, 2)).is_empty());
    // the deposed leader's own lease is answered with the term the worker follows
    let stale = Msg::Lease { term: 1, epoch: 1, sent: 10, announce: Some(announce(1)) };
    assert!(matches!(to_worker(&mut w, deposed, me, stale)[..], [(to, Msg::Relay { .. })] if to == deposed));
}

#[test]
fn what_a_queued_cut_holds_goes_in_order_when_it_heals() {
    let mut w = World::new(1, Rules::without(None));
    let f = Fault { start: 0, end: 5_000, kind: Kind::Queue { from: 0, to: 1, both: false } };
    w.link_fault(f, true);
    assert!(w.net.holds(0, 1) && !w.net.holds(1, 0));
    let msgs: Vec<Msg> =
        (0..20).map(|i| Msg::Relay { follows: super::super::msg::Follow { term: i, leader: 0 } }).collect();
    for (i, msg) in msgs.iter().enumerate() {
        w.now = 100 * i as u64;
        w.handle(0, |_, ctx| ctx.send(1, *msg));
    }
    assert_eq!(w.held.len(), 20);
    assert!(w.queue.iter().all(|Reverse(s)| !matches!(s.ev, Ev::Deliver { .. })), "nothing went");
    w.now = 5_000;
    w.link_fault(f, false);
    assert!(w.held.is_empty());
    let mut delivered: Vec<(u64, u64, Msg)> = w
        .queue
        .iter()
        .filter_map(|Reverse(s)| match s.ev {
            Ev::Deliver { from: 0, to: 1, msg, sender: Some(0) } => Some((s.at, s.seq, msg)),
            _ => None,
        })
        .collect();
    delivered.sort_by_key(|(at, seq, _)| (*at, *seq));
    assert!(delivered.iter().all(|(at, _, _)| *at >= 5_000));
    assert_eq!(delivered.into_iter().map(|(_, _, m)| m).collect::<Vec<_>>(), msgs);
}
