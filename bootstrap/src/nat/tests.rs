use super::*;

fn addr(s: &str) -> Multiaddr {
    s.parse().expect("valid multiaddr")
}

fn peer() -> PeerId {
    PeerId::random()
}

#[test]
fn relayed_addresses_name_their_relay() {
    let relay = peer();
    let dst = peer();
    let a = addr(&format!("/ip4/198.18.0.1/udp/4001/quic-v1/p2p/{relay}/p2p-circuit/p2p/{dst}"));
    assert!(is_relayed(&a));
    assert_eq!(relay_of(&a), Some(relay));
    assert!(!is_relayed(&addr("/ip4/198.18.0.1/tcp/4001")));
    assert_eq!(relay_of(&addr(&format!("/ip4/1.2.3.4/tcp/1/p2p/{relay}"))), None);
}

#[test]
fn reachability_is_public_once_an_address_is_confirmed_and_private_on_failed_dial_backs() {
    let mut nat = Nat::new(NatConfig::default(), false);
    let t0 = Instant::now();
    let settled = t0 + SETTLE;
    assert_eq!(nat.update_reachability(t0), None, "unknown at first");
    nat.autonat_v2_failed(t0);
    assert_eq!(nat.update_reachability(t0), None, "the other candidates' answers may still come");
    assert_eq!(nat.update_reachability(settled), Some(Reachability::Private));
    assert!(!nat.should_relay());
    assert!(Nat::new(NatConfig::default(), true).should_relay(), "a seed relays from the start");
    // a relayed address does not make the node public; one not of our relays is refused
    let relay = peer();
    let ours = addr(&format!("/ip4/198.18.0.1/udp/1/quic-v1/p2p/{relay}"));
    let mut nat = Nat::new(NatConfig { relays: vec![ours.clone()], ..NatConfig::default() }, false);
    nat.autonat_v2_failed(t0);
    nat.update_reachability(settled);
    let swapped = addr(&format!("/ip4/198.18.0.103/tcp/40743/p2p/{relay}/p2p-circuit/p2p/{}", peer()));
    assert!(!nat.confirmed(&swapped), "an observed address swapped into a relay address");
    assert!(nat.confirmed(&ours.with(Protocol::P2pCircuit)));
    assert_eq!(nat.update_reachability(settled), None);
    assert_eq!(nat.relayed_addrs().len(), 1);
    let public = addr("/ip4/198.18.0.7/udp/4001/quic-v1");
    nat.confirmed(&public);
    assert_eq!(nat.update_reachability(settled), Some(Reachability::Public(public.clone())));
    assert!(nat.should_relay());
    nat.expired(&public);
    assert_eq!(nat.update_reachability(settled), Some(Reachability::Private));
    assert!(!nat.should_relay());
}

#[test]
fn a_private_node_reserves_on_found_relays_and_retries_given_ones() {
    let explicit = peer();
    let config = NatConfig {
        relays: vec![addr(&format!("/ip4/198.18.0.9/tcp/4001/p2p/{explicit}"))],
        auto_relays: 1,
        ..NatConfig::default()
    };
    let mut nat = Nat::new(config, false);
    let now = Instant::now();
    // an explicit relay is listened on at once, whatever AutoNAT says
    let first = nat.relays_to_listen(now);
    assert_eq!(first, vec![addr(&format!("/ip4/198.18.0.9/tcp/4001/p2p/{explicit}/p2p-circuit"))]);
    let (r1, r2) = (peer(), peer());
    let (a1, a2) = (addr("/ip4/198.18.0.1/udp/4001/quic-v1"), addr("/ip4/198.18.0.2/udp/4001/quic-v1"));
    nat.offers_relay(r1, Some(a1.clone()), std::slice::from_ref(&a1), false);
    nat.offers_relay(r2, Some(a2.clone()), std::slice::from_ref(&a2), false);
    nat.offers_relay(peer(), None, &[], false); // it dialled us: no address to reach it at
    let natted = addr("/ip4/198.18.0.103/udp/5555/quic-v1"); // hole punched: a NAT's port
    nat.offers_relay(peer(), Some(natted), &[addr("/ip4/192.168.3.11/udp/5555/quic-v1")], false);
    assert!(nat.relays_to_listen(now).is_empty(), "not private yet");
    nat.autonat_v2_failed(now);
    nat.update_reachability(now + SETTLE);
    let found = nat.relays_to_listen(now);
    assert_eq!(found, vec![addr(&format!("/ip4/198.18.0.1/udp/4001/quic-v1/p2p/{r1}/p2p-circuit"))]);
    assert!(nat.relays_to_listen(now).is_empty(), "one at a time");
    // the found relay refuses: the next one is tried, and it again after a while,
    // until it failed three times in a row
    assert_eq!(nat.relay_closed(&found[0], now), Some((r1, Some(RELAY_RETRY))));
    let next = nat.relays_to_listen(now);
    assert_eq!(next, vec![addr(&format!("/ip4/198.18.0.2/udp/4001/quic-v1/p2p/{r2}/p2p-circuit"))]);
    assert!(nat.reserved(&r2).is_some());
    // r2 drops it (its failures start again from one); r1 is asked again, and given
    // up after its third refusal in a row
    assert!(nat.relay_closed(&next[0], now).is_some_and(|(p, retry)| p == r2 && retry.is_some()));
    let later = |k: u64| now + Duration::from_secs(120 * k);
    assert_eq!(nat.relays_to_listen(later(1)), found, "r1 again");
    assert!(nat.relay_closed(&found[0], later(1)).is_some_and(|(_, retry)| retry.is_some()));
    assert_eq!(nat.relays_to_listen(later(2)), found, "r1 once more");
    assert_eq!(nat.relay_closed(&found[0], later(2)), Some((r1, None)), "given up");
    assert_eq!(nat.relays_to_listen(later(3)), next, "r2 is left");
    // the explicit one failing is retried after a backoff
    let (_, retry) = nat.relay_closed(&first[0], now).expect("ours");
    assert!(retry.is_some());
    assert!(nat.relays_to_listen(now).is_empty());
    assert_eq!(nat.relays_to_listen(now + Duration::from_secs(60)).len(), 1);
    // public: the reservations stay (libp2p's relay client cannot drop one in flight)
    nat.confirmed(&addr("/ip4/198.18.0.7/udp/4001/quic-v1"));
    nat.update_reachability(now + SETTLE);
    assert_eq!(nat.relays().len(), 2);
}

#[test]
fn blob_requests_wait_for_the_hole_punch_and_relayed_connections_close_once_direct() {
    let mut nat = Nat::new(NatConfig::default(), false);
    let now = Instant::now();
    let (relay, b) = (peer(), peer());
    let relayed = ConnectionId::new_unchecked(1);
    let direct = ConnectionId::new_unchecked(2);
    let via = addr(&format!("/ip4/198.18.0.1/udp/1/quic-v1/p2p/{relay}/p2p-circuit/p2p/{b}"));
    nat.connected(relayed, b, true, (&via, true), now);
    assert!(nat.held(&b, now), "a punch is tried first");
    assert_eq!(nat.peer_counts(), (0, 1));
    assert!(!nat.held(&b, now + Duration::from_secs(11)), "not for ever");
    // the punch works: requests wait until the relayed connection is gone
    assert!(nat.connected(direct, b, false, (&addr("/ip4/198.18.0.22/udp/4001/quic-v1"), false), now));
    assert!(nat.mark_punched(b) && !nat.mark_punched(b), "reported once");
    assert_eq!(nat.dialled_addr(&b), None, "b dialled us");
    assert!(nat.held(&b, now));
    assert!(nat.relayed_to_close(now, |_| false).is_empty(), "busy: kept for a while");
    assert_eq!(nat.relayed_to_close(now, |_| true), vec![(b, relayed)]);
    assert!(nat.replaced_by_direct(&b, relayed), "a request lost on the relayed connection is asked again");
    assert!(!nat.replaced_by_direct(&b, direct), "one lost on the direct connection counts");
    nat.disconnected(relayed);
    assert!(nat.replaced_by_direct(&b, relayed), "also once the relayed connection is gone");
    assert!(!nat.held(&b, now));
    assert_eq!(nat.peer_counts(), (1, 0));
    assert!(!nat.is_relayed_conn(relayed) && !nat.is_relayed_conn(direct));
}

/// Connects `nat` to a new peer through a new relay on connection `id`.
fn relayed_peer(nat: &mut Nat, id: usize, now: Instant) -> PeerId {
    let (relay, to) = (peer(), peer());
    let via = addr(&format!("/ip4/198.18.0.1/udp/1/quic-v1/p2p/{relay}/p2p-circuit/p2p/{to}"));
    nat.connected(ConnectionId::new_unchecked(id), to, true, (&via, true), now);
    to
}

#[test]
fn a_punch_attempt_that_failed_while_the_other_sides_dial_landed_is_reported_punched() {
    let mut nat = Nat::new(NatConfig::default(), false);
    let now = Instant::now();
    let b = relayed_peer(&mut nat, 1, now);
    // the other side closed the relayed connection for its direct one, breaking our stream
    assert_eq!(nat.punch_failed(&b, "Inbound stream error: IO error".into(), now), None);
    nat.disconnected(ConnectionId::new_unchecked(1));
    let direct = addr("/ip4/198.18.0.22/udp/4001/quic-v1");
    assert!(nat.connected(ConnectionId::new_unchecked(2), b, false, (&direct, false), now), "punched");
    assert_eq!(nat.expire_punches(now + Duration::from_secs(60)), vec![], "no failure to report");
    // a relayed connection that closed with no direct one: its failure is reported
    let c = relayed_peer(&mut nat, 3, now);
    assert_eq!(nat.punch_failed(&c, "cut".into(), now), None);
    nat.disconnected(ConnectionId::new_unchecked(3));
    assert_eq!(nat.expire_punches(now), vec![], "not before the wait is over");
    let later = now + NatConfig::default().punch_wait;
    assert_eq!(nat.expire_punches(later), vec![(c, Some("cut".to_owned()))]);
}

#[test]
fn a_failed_punch_sends_requests_through_the_relay() {
    let mut nat = Nat::new(NatConfig::default(), false);
    let now = Instant::now();
    let (relay, c) = (peer(), peer());
    let via = addr(&format!("/ip4/198.18.0.1/tcp/1/p2p/{relay}/p2p-circuit/p2p/{c}"));
    nat.connected(ConnectionId::new_unchecked(7), c, true, (&via, true), now);
    assert_eq!(nat.held_peers(now), vec![c]);
    // a failed attempt is reported, and the requests let go, once the wait is over
    assert_eq!(nat.punch_failed(&c, "no luck".into(), now), None);
    assert!(nat.held(&c, now));
    let later = now + NatConfig::default().punch_wait;
    assert!(!nat.held(&c, later));
    assert_eq!(nat.expire_punches(later), vec![(c, Some("no luck".to_owned()))]);
    assert_eq!(nat.expire_punches(later), vec![], "once");
    assert_eq!(nat.punch_failed(&c, "again".into(), later), Some("again".to_owned()), "after the wait: at once");
    // behind a symmetric NAT a punch cannot work: nothing waits for one
    let mut sym = Nat::new(NatConfig::default(), false);
    sym.observed_from(&addr("/ip4/198.18.0.1/udp/9/quic-v1"), &addr("/ip4/198.18.0.103/udp/1111/quic-v1"));
    sym.observed_from(&addr("/ip4/198.18.0.2/udp/9/quic-v1"), &addr("/ip4/198.18.0.103/udp/2222/quic-v1"));
    sym.connected(ConnectionId::new_unchecked(9), c, true, (&via, true), now);
    assert!(!sym.held(&c, now));
    // without hole punching nothing waits
    let mut off = Nat::new(NatConfig { hole_punching: false, ..NatConfig::default() }, false);
    off.connected(ConnectionId::new_unchecked(8), c, true, (&via, true), now);
    assert!(!off.held(&c, now));
}

#[test]
fn the_mapping_is_told_from_what_peers_at_two_addresses_observed() {
    let mut nat = Nat::new(NatConfig::default(), false);
    nat.listening(&addr("/ip4/192.168.1.2/udp/4001/quic-v1"));
    assert_eq!(nat.mapping(), NatMapping::Unknown);
    let seed = addr("/ip4/198.18.0.1/udp/9/quic-v1");
    nat.connected(ConnectionId::new_unchecked(1), peer(), false, (&seed, true), Instant::now());
    nat.observed(ConnectionId::new_unchecked(1), &addr("/ip4/198.18.0.11/udp/4001/quic-v1"));
    assert_eq!(nat.mapping(), NatMapping::Unknown, "one observer is not enough");
    nat.observed(ConnectionId::new_unchecked(2), &addr("/ip4/198.18.0.11/udp/9999/quic-v1"));
    assert_eq!(nat.mapping(), NatMapping::Unknown, "an unknown connection is ignored");
    nat.observed_from(&addr("/ip4/198.18.0.2/udp/9/quic-v1"), &addr("/ip4/198.18.0.11/udp/4001/quic-v1"));
    assert_eq!(nat.mapping(), NatMapping::EndpointIndependent);
    nat.observed_from(&addr("/ip4/198.18.0.3/udp/9/quic-v1"), &addr("/ip4/198.18.0.11/udp/51234/quic-v1"));
    assert_eq!(nat.mapping(), NatMapping::Symmetric);

    let mut open = Nat::new(NatConfig::default(), false);
    open.listening(&addr("/ip4/198.18.0.5/udp/4001/quic-v1"));
    open.observed_from(&addr("/ip4/198.18.0.1/udp/9/quic-v1"), &addr("/ip4/198.18.0.5/udp/4001/quic-v1"));
    open.observed_from(&addr("/ip4/198.18.0.2/udp/9/quic-v1"), &addr("/ip4/198.18.0.5/udp/4001/quic-v1"));
    assert_eq!(open.mapping(), NatMapping::None);
}

#[test]
fn an_inbound_connection_at_a_global_listen_address_proves_it_dialable() {
    let mut nat = Nat::new(NatConfig::default(), true);
    let listen = addr("/ip4/198.18.0.1/udp/4001/quic-v1");
    let lan = addr("/ip4/192.168.1.5/udp/4001/quic-v1");
    nat.listening(&listen);
    nat.listening(&lan);
    let now = Instant::now();
    let (inbound, outbound) = (ConnectionId::new_unchecked(1), ConnectionId::new_unchecked(2));
    nat.connected(inbound, peer(), false, (&addr("/ip4/198.18.0.101/udp/5/quic-v1"), false), now);
    assert_eq!(nat.inbound_proof(inbound, &listen), Some(listen.clone()));
    assert_eq!(nat.inbound_proof(inbound, &addr("/ip4/198.18.0.1/udp/4002/quic-v1")), None, "another port");
    assert_eq!(nat.inbound_proof(inbound, &lan), None, "a neighbour on the LAN proves nothing");
    nat.connected(outbound, peer(), false, (&addr("/ip4/198.18.0.2/udp/5/quic-v1"), true), now);
    assert_eq!(nat.inbound_proof(outbound, &listen), None, "this node dialled it");
    for (ip, global) in
        [("198.18.0.1", true), ("8.8.8.8", true), ("10.1.2.3", false), ("100.64.0.1", false), ("127.0.0.1", false)]
    {
        assert_eq!(is_global(ip.parse().expect("ip")), global, "{ip}");
    }
    assert!(!is_global("fd00::1".parse().expect("ip")) && is_global("2001:db8::1".parse().expect("ip")));
}

#[test]
fn an_external_address_is_checked_where_it_is_given() {
    for ok in ["/ip4/203.0.113.7/udp/4001/quic-v1", "/ip4/203.0.113.7/tcp/4001", "/dns4/relay.example/tcp/443"] {
        assert_eq!(parse_external_address(ok).map(|a| a.to_string()), Ok(ok.to_owned()));
    }
    let id = peer();
    for (bad, says) in [
        ("/ip4/1.2.3", "is not a multiaddr"),
        ("/ip4/0.0.0.0/udp/4001/quic-v1", "0.0.0.0"),
        ("/ip6/::/tcp/1", "(::)"),
        ("/udp/4001/quic-v1", "must start with /ip4/"),
        ("/ip4/1.2.3.4/udp/4001", "/udp/PORT/quic-v1"),
        ("/ip4/1.2.3.4/tcp/0", "port 0"),
        (&format!("/ip4/1.2.3.4/tcp/1/p2p/{id}"), "/p2p/"),
        (&format!("/ip4/1.2.3.4/udp/1/quic-v1/p2p/{id}/p2p-circuit"), "relay"),
    ] {
        let e = parse_external_address(bad).expect_err(bad);
        assert!(e.to_string().contains(bad) && e.to_string().contains(says), "{bad}: {e}");
    }
}

#[test]
fn only_an_explicit_routable_listen_address_counts_as_public() {
    let explicit = [addr("/ip4/8.8.4.4/udp/4001/quic-v1"), addr("/ip4/0.0.0.0/tcp/0")];
    assert!(listens_publicly(&addr("/ip4/8.8.4.4/udp/4001/quic-v1"), &explicit));
    assert!(!listens_publicly(&addr("/ip4/8.8.4.4/tcp/4001"), &explicit), "TCP was not given on it");
    assert!(!listens_publicly(&addr("/ip4/9.9.9.9/tcp/4001"), &explicit), "found behind 0.0.0.0");
    let lab = [addr("/ip4/198.18.0.1/udp/4001/quic-v1"), addr("/ip4/10.0.0.1/udp/4001/quic-v1")];
    assert!(!listens_publicly(&lab[0], &lab), "the benchmarking range is a lab's");
    assert!(!listens_publicly(&lab[1], &lab), "private");
    for (ip, routable) in [("8.8.8.8", true), ("198.19.1.1", false), ("203.0.113.7", false), ("2001:db8::1", false)] {
        assert_eq!(is_routable(ip.parse().expect("ip")), routable, "{ip}");
    }
}

#[test]
fn a_reservation_with_no_address_names_the_flag_once_per_relay() {
    let mut nat = Nat::new(NatConfig::default(), false);
    let (relay, other) = (peer(), peer());
    let empty = "protocol violation: expected at least one address in reservation".to_owned();
    let (reason, loud) = nat.reservation_failed(relay, empty.clone());
    assert!(loud && reason.contains(&relay.to_string()) && reason.contains("--external-address"), "{reason}");
    assert_eq!(nat.reservation_failed(relay, empty), (reason.clone(), false), "said once");
    assert_eq!(nat.relay_problem(), Some(&(relay, reason)));
    assert_eq!(nat.reservation_failed(other, "timed out".into()), ("timed out".to_owned(), true));
    // a seed dialled at an address it does not list (a cloud's 1:1 NAT) is a candidate
    let at = addr("/ip4/198.18.0.1/udp/4001/quic-v1");
    nat.offers_relay(other, Some(at.clone()), &[addr("/ip4/10.10.0.1/udp/4001/quic-v1")], false);
    nat.offers_relay(relay, Some(at), &[addr("/ip4/10.10.0.1/udp/4001/quic-v1")], true);
    let now = Instant::now();
    nat.autonat_v2_failed(now);
    nat.update_reachability(now + SETTLE);
    let found = nat.relays_to_listen(now);
    assert_eq!(found, vec![addr(&format!("/ip4/198.18.0.1/udp/4001/quic-v1/p2p/{relay}/p2p-circuit"))]);
    assert!(nat.reserved(&relay).is_some());
    assert_eq!(nat.relay_problem(), None, "a relay holds the reservation");
    // a relay with no confirmed address of its own says so once
    assert!(nat.warn_addressless_relay() && !nat.warn_addressless_relay());
}

#[test]
fn a_punch_that_never_came_says_why() {
    let mut nat = Nat::new(NatConfig::default(), false);
    assert!(nat.no_punch_reason().contains("no peer has told this node"), "{}", nat.no_punch_reason());
    nat.observed_from(&addr("/ip4/198.18.0.1/udp/9/quic-v1"), &addr("/ip4/198.18.0.103/udp/1111/quic-v1"));
    assert!(nat.no_punch_reason().contains("the peer's NAT"), "{}", nat.no_punch_reason());
    nat.observed_from(&addr("/ip4/198.18.0.2/udp/9/quic-v1"), &addr("/ip4/198.18.0.103/udp/2222/quic-v1"));
    assert!(nat.no_punch_reason().contains("symmetric"), "{}", nat.no_punch_reason());
    let now = Instant::now();
    let c = relayed_peer(&mut nat, 1, now);
    assert_eq!(nat.expire_punches(now + NatConfig::default().punch_wait), vec![(c, None)], "the caller says why");
}

#[test]
fn a_second_quic_observer_is_dialled_while_the_mapping_is_unknown() {
    let mut nat = Nat::new(NatConfig::default(), false);
    let now = Instant::now();
    let (seed, p2) = (peer(), peer());
    let seed_at = addr("/ip4/198.18.0.1/udp/4001/quic-v1");
    nat.connected(ConnectionId::new_unchecked(1), seed, false, (&seed_at, true), now);
    nat.observed(ConnectionId::new_unchecked(1), &addr("/ip4/198.18.0.103/udp/7777/quic-v1"));
    // p2 was reached over TCP: its QUIC address comes from identify
    nat.connected(ConnectionId::new_unchecked(2), p2, false, (&addr("/ip4/198.18.0.2/tcp/4001"), true), now);
    nat.observed(ConnectionId::new_unchecked(2), &addr("/ip4/198.18.0.103/tcp/8888"));
    nat.peer_quic_addr(seed, std::slice::from_ref(&seed_at));
    nat.peer_quic_addr(p2, &[addr("/ip4/127.0.0.1/udp/4001/quic-v1"), addr("/ip4/198.18.0.2/udp/4001/quic-v1")]);
    assert_eq!(nat.mapping(), NatMapping::Unknown);
    assert_eq!(nat.quic_probes(), vec![(p2, addr("/ip4/198.18.0.2/udp/4001/quic-v1"))]);
    assert!(nat.quic_probes().is_empty(), "once");
}
