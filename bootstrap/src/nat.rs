//! NAT traversal bookkeeping, free of the swarm: which connections go through a relay,
//! peers waiting for a hole punch, relays to reserve on, the reachability verdict, and
//! how the NAT in front of this node maps its port.
//!
//! The event loop feeds it what the swarm reports (connections, AutoNAT verdicts,
//! confirmed addresses, identify) and asks it what to do: which relays to listen on,
//! which relayed connections a direct one has replaced, whose blob requests wait.

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::time::Duration;

use libp2p::multiaddr::Protocol;
use libp2p::swarm::ConnectionId;
use libp2p::{Multiaddr, PeerId};
use tokio::time::Instant;

use crate::config::NatConfig;
use crate::events::{NatMapping, Reachability};
use crate::seeds::Backoff;

/// How long a relayed connection that a direct one replaced stays open while requests
/// on it finish.
pub(crate) const UPGRADE_GRACE: Duration = Duration::from_secs(10);
/// Peers whose observed addresses (and QUIC addresses, and relay offers) are kept.
const MAX_OBSERVERS: usize = 32;
/// A relay given with `--relay` that refused or dropped a reservation is tried again
/// after this long (doubling, at most a minute).
const RELAY_RETRY: Duration = Duration::from_secs(5);
/// Failures in a row after which a relay found among the peers is given up.
const FOUND_RELAY_TRIES: u32 = 3;
/// Peers dialled over QUIC to learn how the NAT maps ports, when TCP connections
/// (whose observations cannot be compared with QUIC ones) left it unknown.
const QUIC_PROBES: usize = 2;
/// How long after an AutoNAT v2 dial-back failed the node is called private, unless
/// another address is confirmed meanwhile: the client tests all its candidates at once,
/// so their answers come together.
pub(crate) const SETTLE: Duration = Duration::from_secs(2);

/// Whether an address goes through a relay.
pub(crate) fn is_relayed(addr: &Multiaddr) -> bool {
    addr.iter().any(|p| matches!(p, Protocol::P2pCircuit))
}

/// The relay named in a relayed address: the `/p2p/` before `/p2p-circuit`.
pub(crate) fn relay_of(addr: &Multiaddr) -> Option<PeerId> {
    let mut last = None;
    for p in addr.iter() {
        match p {
            Protocol::P2p(peer) => last = Some(peer),
            Protocol::P2pCircuit => return last,
            _ => {}
        }
    }
    None
}

/// Whether an IP address is reachable from the internet at large: not loopback,
/// private (RFC 1918, IPv6 unique local), link-local, shared (CGNAT) or unspecified.
pub(crate) fn is_global(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => {
            let [a, b, ..] = v4.octets();
            !(v4.is_loopback()
                || v4.is_private()
                || v4.is_link_local()
                || v4.is_unspecified()
                || v4.is_broadcast()
                || (a == 100 && (64..128).contains(&b)))
        }
        IpAddr::V6(v6) => {
            let first = v6.segments()[0];
            !(v6.is_loopback() || v6.is_unspecified() || (first & 0xfe00) == 0xfc00 || (first & 0xffc0) == 0xfe80)
        }
    }
}

/// Whether an IP address is publicly routable: [`is_global`], and not in the ranges
/// reserved for documentation (192.0.2.0/24, 198.51.100.0/24, 203.0.113.0/24,
/// 2001:db8::/32) or benchmarking (198.18.0.0/15, which labs, the NAT tests among
/// them, use for their "internet"). A node listening on such an address takes it as
/// its public address; in a lab `--external-address` says so.
pub(crate) fn is_routable(ip: IpAddr) -> bool {
    is_global(ip)
        && match ip {
            IpAddr::V4(v4) => {
                let [a, b, c, _] = v4.octets();
                !(a == 198 && (b & 0xfe) == 18
                    || (a, b, c) == (192, 0, 2)
                    || (a, b, c) == (198, 51, 100)
                    || (a, b, c) == (203, 0, 113))
            }
            IpAddr::V6(v6) => !(v6.segments()[0] == 0x2001 && v6.segments()[1] == 0x0db8),
        }
}

/// Whether `addr`, a new listen address, is one this node may take as its public
/// address at once: its IP is publicly routable ([`is_routable`]) and was given
/// explicitly among the `configured` listen addresses (not found on an interface
/// behind `0.0.0.0`, which may sit behind a firewall the operator did not open).
pub(crate) fn listens_publicly(addr: &Multiaddr, configured: &[Multiaddr]) -> bool {
    let Some((ip, port, quic)) = ip_port(addr) else { return false };
    port != 0
        && !is_relayed(addr)
        && is_routable(ip)
        && configured.iter().filter_map(ip_port).any(|(c, _, q)| c == ip && q == quic)
}

/// Checks an address given as this node's public address (`--external-address`): an
/// IP address (not `0.0.0.0` or `::`) or a DNS name, then `/tcp/PORT` or
/// `/udp/PORT/quic-v1`, with a port other than 0, not through a relay and without a
/// `/p2p/` suffix (the node adds its own).
pub fn parse_external_address(text: &str) -> Result<Multiaddr, crate::error::ExternalAddrError> {
    let fail = |reason: &str| crate::error::ExternalAddrError { addr: text.to_owned(), reason: reason.to_owned() };
    let addr: Multiaddr = text.trim().parse().map_err(|e| fail(&format!("is not a multiaddr: {e}")))?;
    let mut parts = addr.iter();
    match parts.next() {
        Some(Protocol::Ip4(ip)) if ip.is_unspecified() => return Err(fail("is no address peers can dial (0.0.0.0)")),
        Some(Protocol::Ip6(ip)) if ip.is_unspecified() => return Err(fail("is no address peers can dial (::)")),
        Some(Protocol::Ip4(_) | Protocol::Ip6(_) | Protocol::Dns(_) | Protocol::Dns4(_) | Protocol::Dns6(_)) => {}
        _ => return Err(fail("must start with /ip4/, /ip6/ or /dns/, e.g. /ip4/203.0.113.7/udp/4001/quic-v1")),
    }
    let port = match (parts.next(), parts.next()) {
        (Some(Protocol::Tcp(port)), None) => port,
        (Some(Protocol::Udp(port)), Some(Protocol::QuicV1)) if parts.next().is_none() => port,
        (_, Some(Protocol::P2p(_))) | (Some(Protocol::Udp(_)), Some(Protocol::QuicV1)) => {
            return Err(fail("must not end in /p2p/<peer id> or go through a relay: the node adds its own id"));
        }
        _ => return Err(fail("must end in /tcp/PORT or /udp/PORT/quic-v1")),
    };
    if port == 0 {
        return Err(fail("has port 0: give the port peers dial"));
    }
    Ok(addr)
}

/// The IP address and port of an address (TCP or QUIC).
fn ip_port(addr: &Multiaddr) -> Option<(IpAddr, u16, bool)> {
    let mut ip = None;
    let mut port = None;
    let mut quic = false;
    for p in addr.iter() {
        match p {
            Protocol::Ip4(a) => ip = Some(IpAddr::V4(a)),
            Protocol::Ip6(a) => ip = Some(IpAddr::V6(a)),
            Protocol::Tcp(p) => port = Some(p),
            Protocol::Udp(p) => port = Some(p),
            Protocol::QuicV1 => quic = true,
            _ => {}
        }
    }
    Some((ip?, port?, quic))
}

/// One connection as the NAT bookkeeping sees it.
#[derive(Debug, Clone)]
struct Conn {
    peer: PeerId,
    relayed: bool,
    /// The peer's address, for a direct connection.
    remote: Option<Multiaddr>,
    /// Whether this node dialled it.
    dialled: bool,
}

/// A connected peer that offers the relay service.
#[derive(Debug, Clone)]
struct Candidate {
    peer: PeerId,
    /// Where this node dialled it.
    addr: Multiaddr,
    /// When it may be tried again after a failed reservation.
    backoff: Backoff,
    /// Failed reservations in a row.
    failures: u32,
}

/// A relay this node reserves (or means to reserve) a slot on.
#[derive(Debug, Clone)]
pub(crate) struct Relay {
    /// The relay.
    pub(crate) peer: PeerId,
    /// The address to listen on: the relay's address, `/p2p/<relay>/p2p-circuit`.
    pub(crate) addr: Multiaddr,
    /// Given with `--relay` (kept whatever AutoNAT says) rather than found.
    pub(crate) explicit: bool,
    /// Whether the relay accepted the reservation.
    pub(crate) reserved: bool,
    /// When to try again after a failure.
    backoff: Backoff,
    /// Whether a listener on it is open.
    pub(crate) listening: bool,
}

/// The NAT traversal state of one node.
#[derive(Debug)]
pub(crate) struct Nat {
    config: NatConfig,
    conns: HashMap<ConnectionId, Conn>,
    /// Peers reachable only through a relay while a hole punch is tried: since when.
    punching: HashMap<PeerId, Instant>,
    /// Peers with a direct connection that replaced relayed ones: since when. Their
    /// relayed connections are closed once idle, or after [`UPGRADE_GRACE`].
    upgraded: HashMap<PeerId, Instant>,
    /// When an AutoNAT v2 server first failed to dial one of our candidates back.
    v2_failed: Option<Instant>,
    /// A seed: the network's entry point, public by configuration. It relays from the
    /// start (AutoNAT cannot test a node that dials nobody).
    seed: bool,
    /// Confirmed external addresses, not relayed.
    external: Vec<Multiaddr>,
    /// Confirmed addresses through relays.
    relayed: Vec<Multiaddr>,
    reachability: Reachability,
    /// Relays, explicit ones first.
    relays: Vec<Relay>,
    /// Connected peers that offer the relay service, with the address we dialled them
    /// at, in the order they were found.
    hop: Vec<Candidate>,
    /// What peers at other IP addresses observed as this node's address, by the
    /// observer's IP address and transport (QUIC or not).
    observed: BTreeMap<(IpAddr, bool), Multiaddr>,
    /// This node's own (interface) IP addresses, from its listen addresses.
    own_ips: Vec<IpAddr>,
    /// Its listen addresses (not relayed).
    listen: Vec<Multiaddr>,
    /// A QUIC address of each directly connected peer, from identify.
    quic_addrs: HashMap<PeerId, Multiaddr>,
    /// Peers dialled over QUIC to learn the mapping.
    quic_probed: std::collections::HashSet<PeerId>,
    /// The mapping last reported.
    reported_mapping: NatMapping,
    /// Peers whose relayed connection a direct one replaced, reported as punched.
    punched: std::collections::HashSet<PeerId>,
    /// Why a hole punch attempt failed, for peers still in their wait: reported only
    /// if no direct connection comes before the wait ends.
    /// (With when the wait began.)
    punch_errors: HashMap<PeerId, (String, Instant)>,
    /// Whether the relay service is on.
    relaying: bool,
    /// Relays whose reservation came back with no address, already logged.
    addressless: std::collections::HashSet<PeerId>,
    /// Why the last reservation failed, while no relay holds one.
    relay_problem: Option<(PeerId, String)>,
    /// The last hole punch's outcome.
    last_punch: Option<(PeerId, Result<Multiaddr, String>)>,
    /// Whether this node, relaying with no public address, said so.
    warned_addressless: bool,
}

impl Nat {
    pub(crate) fn new(config: NatConfig, seed: bool) -> Self {
        let relays = config
            .relays
            .iter()
            .filter_map(|addr| {
                let peer = match addr.iter().last() {
                    Some(Protocol::P2p(peer)) => peer,
                    _ => return None,
                };
                let addr = if is_relayed(addr) { addr.clone() } else { addr.clone().with(Protocol::P2pCircuit) };
                Some(Relay {
                    peer,
                    addr,
                    explicit: true,
                    reserved: false,
                    backoff: Backoff::default(),
                    listening: false,
                })
            })
            .collect();
        Self {
            config,
            conns: HashMap::new(),
            punching: HashMap::new(),
            upgraded: HashMap::new(),
            v2_failed: None,
            seed,
            external: Vec::new(),
            relayed: Vec::new(),
            reachability: Reachability::Unknown,
            relays,
            hop: Vec::new(),
            observed: BTreeMap::new(),
            own_ips: Vec::new(),
            listen: Vec::new(),
            quic_addrs: HashMap::new(),
            quic_probed: std::collections::HashSet::new(),
            reported_mapping: NatMapping::Unknown,
            punched: std::collections::HashSet::new(),
            punch_errors: HashMap::new(),
            relaying: false,
            addressless: std::collections::HashSet::new(),
            relay_problem: None,
            last_punch: None,
            warned_addressless: false,
        }
    }

    // ---- connections and hole punching -------------------------------------------

    /// A connection is up: `relayed` or direct to `remote`, dialled by this node or not.
    /// Returns whether it is a direct connection to a peer that was reachable only
    /// through a relay (the hole punch worked, whichever side's dial won).
    pub(crate) fn connected(
        &mut self,
        id: ConnectionId,
        peer: PeerId,
        relayed: bool,
        (remote, dialled): (&Multiaddr, bool),
        now: Instant,
    ) -> bool {
        // a punch in progress: the peer was reachable only through a relay
        // (or one whose attempt failed while the other side's dial was landing)
        let tried = self.punching.contains_key(&peer) || self.punch_errors.contains_key(&peer);
        let replaces = !relayed && tried && !self.has_direct(&peer);
        let remote = (!relayed).then(|| remote.clone());
        self.conns.insert(id, Conn { peer, relayed, remote, dialled });
        if relayed {
            if self.config.hole_punching && !self.has_direct(&peer) {
                self.punching.entry(peer).or_insert(now);
            }
        } else {
            self.punching.remove(&peer);
            self.punch_errors.remove(&peer);
            if self.has_relayed(&peer) {
                self.upgraded.entry(peer).or_insert(now);
            }
        }
        replaces
    }

    /// The direct connection to `peer`'s address, if any.
    pub(crate) fn direct_addr(&self, peer: &PeerId) -> Option<&Multiaddr> {
        self.conns.values().find(|c| c.peer == *peer && !c.relayed).and_then(|c| c.remote.as_ref())
    }

    /// Records that a hole punch to `peer` worked; `false` when it was already reported
    /// (both sides' dials, and DCUtR's own report, come for one punch).
    pub(crate) fn mark_punched(&mut self, peer: PeerId) -> bool {
        self.punched.insert(peer)
    }

    /// The address this node dialled `peer` at over a direct connection, if any.
    pub(crate) fn dialled_addr(&self, peer: &PeerId) -> Option<Multiaddr> {
        self.conns.values().find(|c| c.peer == *peer && c.dialled && !c.relayed).and_then(|c| c.remote.clone())
    }

    /// A connection closed.
    pub(crate) fn disconnected(&mut self, id: ConnectionId) {
        let Some(conn) = self.conns.remove(&id) else { return };
        if !self.conns.values().any(|c| c.peer == conn.peer) {
            self.punched.remove(&conn.peer);
        }
        if !self.has_relayed(&conn.peer) {
            self.upgraded.remove(&conn.peer);
            self.punching.remove(&conn.peer);
        }
        if !self.has_direct(&conn.peer) {
            self.upgraded.remove(&conn.peer);
        }
    }

    /// The peer's address on direct connection `id`.
    pub(crate) fn remote_of(&self, id: ConnectionId) -> Option<&Multiaddr> {
        self.conns.get(&id).and_then(|c| c.remote.as_ref())
    }

    /// Whether connection `id` goes through a relay.
    pub(crate) fn is_relayed_conn(&self, id: ConnectionId) -> bool {
        self.conns.get(&id).is_some_and(|c| c.relayed)
    }

    /// Whether a request to `peer` lost on connection `id` was lost to that
    /// connection's replacement: `id` went through a relay (or is already closed)
    /// and the peer is connected directly now.
    pub(crate) fn replaced_by_direct(&self, peer: &PeerId, id: ConnectionId) -> bool {
        self.has_direct(peer) && self.conns.get(&id).is_none_or(|c| c.relayed)
    }

    fn has_direct(&self, peer: &PeerId) -> bool {
        self.conns.values().any(|c| c.peer == *peer && !c.relayed)
    }

    fn has_relayed(&self, peer: &PeerId) -> bool {
        self.conns.values().any(|c| c.peer == *peer && c.relayed)
    }

    /// A hole punch attempt to `peer` failed with `reason`: the reason to report now
    /// (its traffic goes through the relay), or `None` while the peer's wait lasts.
    /// The other side's dial of the same punch may still land: on loopback it wins
    /// often enough, and its side closes the relayed connection, breaking the stream
    /// that reports this error just before the direct connection is seen here. The
    /// side that opened the exchange also tries its dial up to 3 times. The reason is
    /// reported by [`Nat::expire_punches`] if no direct connection came.
    pub(crate) fn punch_failed(&mut self, peer: &PeerId, reason: String, now: Instant) -> Option<String> {
        if self.punch_pending(peer, now) {
            let since = self.punching.get(peer).copied().unwrap_or(now);
            self.punch_errors.insert(*peer, (reason, since));
            return None;
        }
        self.punching.remove(peer);
        self.punch_errors.remove(peer);
        Some(reason)
    }

    /// Whether `peer` is reachable only through a relay while a hole punch is tried
    /// (unless this node is behind a symmetric NAT, where punches fail).
    fn punch_pending(&self, peer: &PeerId, now: Instant) -> bool {
        self.mapping() != NatMapping::Symmetric
            && self
                .punching
                .get(peer)
                .is_some_and(|since| now.duration_since(*since) < self.config.punch_wait && !self.has_direct(peer))
    }

    /// Whether bulk requests (blob chunks) to `peer` should wait: a hole punch to it
    /// is pending, or a direct connection just replaced its relayed ones.
    pub(crate) fn held(&self, peer: &PeerId, now: Instant) -> bool {
        self.punch_pending(peer, now) || (self.upgraded.contains_key(peer) && self.has_relayed(peer))
    }

    /// Peers held by [`Nat::held`].
    pub(crate) fn held_peers(&self, now: Instant) -> Vec<PeerId> {
        let mut peers: Vec<PeerId> =
            self.punching.keys().chain(self.upgraded.keys()).copied().filter(|p| self.held(p, now)).collect();
        peers.sort_unstable();
        peers.dedup();
        peers
    }

    /// Forgets hole punches that outlived the wait (their peers' requests go through
    /// the relay); returns the peers whose wait just ended, each with the error of its
    /// failed attempt to report, if one failed (also for peers whose relayed
    /// connection closed during the wait).
    pub(crate) fn expire_punches(&mut self, now: Instant) -> Vec<(PeerId, Option<String>)> {
        let wait = self.config.punch_wait;
        let mut over: Vec<PeerId> =
            self.punching.iter().filter(|(_, since)| now.duration_since(**since) >= wait).map(|(p, _)| *p).collect();
        for p in &over {
            self.punching.remove(p);
        }
        // a relayed connection that closed during the wait: its direct one may be next
        over.extend(
            self.punch_errors
                .iter()
                .filter(|(p, (_, since))| !self.punching.contains_key(*p) && now.duration_since(*since) >= wait)
                .map(|(p, _)| *p),
        );
        over.sort_unstable();
        over.dedup();
        over.into_iter().map(|p| (p, self.punch_errors.remove(&p).map(|(reason, _)| reason))).collect()
    }

    /// The relayed connections to close now: those of upgraded peers that are `idle`
    /// (no request in flight either way), or past [`UPGRADE_GRACE`].
    pub(crate) fn relayed_to_close(
        &mut self,
        now: Instant,
        idle: impl Fn(&PeerId) -> bool,
    ) -> Vec<(PeerId, ConnectionId)> {
        let due: Vec<PeerId> = self
            .upgraded
            .iter()
            .filter(|(peer, since)| idle(peer) || now.duration_since(**since) >= UPGRADE_GRACE)
            .map(|(p, _)| *p)
            .collect();
        let mut out = Vec::new();
        for peer in due {
            self.upgraded.remove(&peer);
            out.extend(self.conns.iter().filter(|(_, c)| c.peer == peer && c.relayed).map(|(id, _)| (peer, *id)));
        }
        out
    }

    /// Why no hole punch to a peer came within the wait, as far as this node can tell.
    pub(crate) fn no_punch_reason(&self) -> String {
        let wait = self.config.punch_wait.as_secs();
        let why = match self.mapping() {
            NatMapping::Symmetric => {
                "this node's NAT is symmetric (a new public port for every peer): hole punching cannot work"
            }
            _ if self.observed.is_empty() => {
                "no peer has told this node the address it sees it at, so it had none to offer the punch"
            }
            _ => "the peer's NAT or firewall let none of the punch's packets through (a symmetric NAT?)",
        };
        format!("no direct connection within {wait} s of the relayed one: {why}")
    }

    /// Records a hole punch's outcome, for [`Nat::last_punch`].
    pub(crate) fn punch_outcome(&mut self, peer: PeerId, result: Result<Multiaddr, String>) {
        self.last_punch = Some((peer, result));
    }

    /// The last hole punch's outcome.
    pub(crate) fn last_punch(&self) -> Option<&(PeerId, Result<Multiaddr, String>)> {
        self.last_punch.as_ref()
    }

    /// Peers connected directly, and peers connected only through a relay.
    pub(crate) fn peer_counts(&self) -> (usize, usize) {
        let mut direct = std::collections::HashSet::new();
        let mut relayed = std::collections::HashSet::new();
        for c in self.conns.values() {
            if c.relayed {
                relayed.insert(c.peer);
            } else {
                direct.insert(c.peer);
            }
        }
        let only_relayed = relayed.difference(&direct).count();
        (direct.len(), only_relayed)
    }

    // ---- reachability ------------------------------------------------------------

    /// An AutoNAT v2 server could not dial one of our candidate addresses back.
    pub(crate) fn autonat_v2_failed(&mut self, now: Instant) {
        self.v2_failed.get_or_insert(now);
    }

    /// An external address was confirmed (by AutoNAT, UPnP, or a relay reservation).
    /// Returns `false` for a relayed address that is not one of our reservations: libp2p's
    /// identify makes candidates of relay listen addresses with an observed IP and port
    /// swapped in, and an AutoNAT v2 dial-back through the relay "confirms" them.
    pub(crate) fn confirmed(&mut self, addr: &Multiaddr) -> bool {
        let relayed = is_relayed(addr);
        if relayed {
            let mut base = addr.clone();
            if matches!(base.iter().last(), Some(Protocol::P2p(_))) {
                base.pop();
            }
            if !self.relays.iter().any(|r| r.addr == base) {
                return false;
            }
        }
        let list = if relayed { &mut self.relayed } else { &mut self.external };
        if !list.contains(addr) {
            list.push(addr.clone());
        }
        true
    }

    /// An external address expired.
    pub(crate) fn expired(&mut self, addr: &Multiaddr) {
        self.external.retain(|a| a != addr);
        self.relayed.retain(|a| a != addr);
    }

    /// The verdict from what is known at `now`; `Some` when it changed.
    pub(crate) fn update_reachability(&mut self, now: Instant) -> Option<Reachability> {
        let verdict = if let Some(addr) = self.external.first() {
            Reachability::Public(addr.clone())
        } else if self.v2_failed.is_some_and(|at| now.duration_since(at) >= SETTLE) {
            Reachability::Private
        } else {
            Reachability::Unknown
        };
        if verdict == self.reachability {
            return None;
        }
        self.reachability = verdict.clone();
        Some(verdict)
    }

    /// Whether this node should relay for others: it is public (or a seed) and allowed to.
    pub(crate) fn should_relay(&self) -> bool {
        self.config.relay_service && (self.seed || matches!(self.reachability, Reachability::Public(_)))
    }

    /// The relay service's new state when it should change.
    pub(crate) fn relay_switch(&mut self) -> Option<bool> {
        let on = self.should_relay();
        (on != self.relaying).then(|| {
            self.relaying = on;
            on
        })
    }

    pub(crate) fn external(&self) -> &[Multiaddr] {
        &self.external
    }

    pub(crate) fn relayed_addrs(&self) -> &[Multiaddr] {
        &self.relayed
    }

    // ---- relays ------------------------------------------------------------------

    /// A connected peer offers the relay service; `dialled` is the address this node
    /// dialled it at (`None` when it dialled us: we do not know where to reach it), and
    /// `listen` the addresses it says it listens on. Every pcp node offers the service
    /// (and refuses while it is not reachable), so only a peer dialled at one of its own
    /// listen addresses, which no NAT stands in front of, is a candidate; and a `seed`
    /// of this node's (`--bootstrap`), reachable where it was dialled whatever it lists:
    /// the one public node of a network, behind a cloud's 1:1 NAT, lists only its
    /// private address unless its operator declared the public one, and a reservation
    /// on it says which (see [`Nat::reservation_failed`]).
    pub(crate) fn offers_relay(&mut self, peer: PeerId, dialled: Option<Multiaddr>, listen: &[Multiaddr], seed: bool) {
        // a given relay that refused before (it was not relaying yet) is asked again now
        for relay in self.relays.iter_mut().filter(|r| r.peer == peer && r.explicit && !r.listening) {
            relay.backoff.reset();
        }
        let Some(addr) = dialled.filter(|a| !is_relayed(a)) else { return };
        let at = ip_port(&addr);
        if at.is_none() || !(seed || listen.iter().any(|l| !is_relayed(l) && ip_port(l) == at)) {
            return;
        }
        if !self.hop.iter().any(|c| c.peer == peer) && self.hop.len() < MAX_OBSERVERS {
            self.hop.push(Candidate { peer, addr, backoff: Backoff::default(), failures: 0 });
        }
    }

    /// A peer no longer offers the relay service (or is gone).
    pub(crate) fn forget_relay_candidate(&mut self, peer: &PeerId) {
        self.hop.retain(|c| c.peer != *peer);
    }

    /// The relays to start listening on now: explicit ones, and while this node is
    /// private, found ones up to [`NatConfig::auto_relays`].
    pub(crate) fn relays_to_listen(&mut self, now: Instant) -> Vec<Multiaddr> {
        let private = matches!(self.reachability, Reachability::Private);
        if self.config.auto_relay && private {
            let found = self.relays.iter().filter(|r| !r.explicit).count();
            let want = self.config.auto_relays.saturating_sub(found);
            let candidates: Vec<(PeerId, Multiaddr)> = self
                .hop
                .iter()
                .filter(|c| c.backoff.ready(now) && !self.relays.iter().any(|r| r.peer == c.peer))
                .take(want)
                .map(|c| (c.peer, c.addr.clone()))
                .collect();
            for (peer, addr) in candidates {
                let mut addr = addr;
                if !matches!(addr.iter().last(), Some(Protocol::P2p(_))) {
                    addr.push(Protocol::P2p(peer));
                }
                self.relays.push(Relay {
                    peer,
                    addr: addr.with(Protocol::P2pCircuit),
                    explicit: false,
                    reserved: false,
                    backoff: Backoff::default(),
                    listening: false,
                });
            }
        }
        let mut out = Vec::new();
        for relay in &mut self.relays {
            if !relay.listening && relay.backoff.ready(now) && (relay.explicit || private) {
                relay.listening = true;
                out.push(relay.addr.clone());
            }
        }
        out
    }

    /// A reservation on `relay` failed for `reason`: the reason to report (one that
    /// came back with no address names `--external-address`) and whether to log it
    /// loudly (the first time for that relay).
    pub(crate) fn reservation_failed(&mut self, relay: PeerId, reason: String) -> (String, bool) {
        let (reason, loud) = if reason.to_ascii_lowercase().contains("at least one address in reservation") {
            let reason = format!(
                "relay {relay} has no confirmed public address (its reservation came back with none): \
                 start it with --external-address <its public address>"
            );
            (reason, self.addressless.insert(relay))
        } else {
            (reason, true)
        };
        if !self.relays.iter().any(|r| r.reserved) {
            self.relay_problem = Some((relay, reason.clone()));
        }
        (reason, loud)
    }

    /// Why the last reservation failed, while no relay holds one.
    pub(crate) fn relay_problem(&self) -> Option<&(PeerId, String)> {
        self.relay_problem.as_ref().filter(|_| !self.relays.iter().any(|r| r.reserved))
    }

    /// Whether this node, relaying for others, should say that it has no confirmed
    /// public address to give them (once).
    pub(crate) fn warn_addressless_relay(&mut self) -> bool {
        let warn = self.external.is_empty() && !self.warned_addressless;
        self.warned_addressless |= warn;
        warn
    }

    /// The relay a listen address reserves on, if it is one of ours.
    fn relay_mut(&mut self, addr: &Multiaddr) -> Option<&mut Relay> {
        let peer = relay_of(addr)?;
        self.relays.iter_mut().find(|r| r.peer == peer)
    }

    /// The reservation on `relay` was accepted.
    pub(crate) fn reserved(&mut self, relay: &PeerId) -> Option<Multiaddr> {
        let r = self.relays.iter_mut().find(|r| r.peer == *relay)?;
        r.reserved = true;
        r.backoff.reset();
        if let Some(c) = self.hop.iter_mut().find(|c| c.peer == *relay) {
            c.failures = 0;
            c.backoff.reset();
        }
        Some(r.addr.clone())
    }

    /// The listener on relay address `addr` closed (`reason` when it failed). Returns
    /// the relay and when it will be tried again: a given relay after a backoff; a found
    /// one makes room for another candidate and is tried again after a backoff, or
    /// given up (`None`) after [`FOUND_RELAY_TRIES`] failures in a row.
    pub(crate) fn relay_closed(&mut self, addr: &Multiaddr, now: Instant) -> Option<(PeerId, Option<Duration>)> {
        let relay = self.relay_mut(addr)?;
        relay.listening = false;
        relay.reserved = false;
        let peer = relay.peer;
        if relay.explicit {
            let wait = relay.backoff.failed(now, RELAY_RETRY);
            return Some((peer, Some(wait)));
        }
        self.relays.retain(|r| r.peer != peer);
        let candidate = self.hop.iter_mut().find(|c| c.peer == peer)?;
        candidate.failures += 1;
        if candidate.failures >= FOUND_RELAY_TRIES {
            self.hop.retain(|c| c.peer != peer);
            return Some((peer, None));
        }
        Some((peer, Some(candidate.backoff.failed(now, RELAY_RETRY))))
    }

    /// The relays and whether each holds our reservation.
    #[cfg(test)]
    pub(crate) fn relays(&self) -> &[Relay] {
        &self.relays
    }

    // ---- NAT mapping -------------------------------------------------------------

    /// This node listens on `addr` (its own IP addresses are not NATed ones).
    pub(crate) fn listening(&mut self, addr: &Multiaddr) {
        if is_relayed(addr) {
            return;
        }
        if let Some((ip, _, _)) = ip_port(addr)
            && !self.own_ips.contains(&ip)
        {
            self.own_ips.push(ip);
        }
        self.listen.push(addr.clone());
    }

    /// The peer on inbound connection `id` says it reached this node at `observed`:
    /// when that is one of this node's listen addresses with a global IP, the peer
    /// dialled it, which proves it dialable (as an AutoNAT dial-back would). Returns
    /// the address to confirm. A node that only ever receives connections (a seed) is
    /// confirmed this way: AutoNAT v2 asks peers it has dialled.
    pub(crate) fn inbound_proof(&self, id: ConnectionId, observed: &Multiaddr) -> Option<Multiaddr> {
        let conn = self.conns.get(&id)?;
        if conn.relayed || conn.dialled {
            return None;
        }
        let seen = ip_port(observed)?;
        if !is_global(seen.0) {
            return None;
        }
        self.listen.iter().find(|a| ip_port(a) == Some(seen)).cloned()
    }

    /// Remembers a directly connected peer's QUIC address (from identify).
    pub(crate) fn peer_quic_addr(&mut self, peer: PeerId, listen: &[Multiaddr]) {
        if self.quic_addrs.len() >= MAX_OBSERVERS && !self.quic_addrs.contains_key(&peer) {
            return;
        }
        let quic = listen
            .iter()
            .find(|a| !is_relayed(a) && ip_port(a).is_some_and(|(ip, port, quic)| quic && port != 0 && is_global(ip)));
        if let Some(addr) = quic {
            self.quic_addrs.insert(peer, addr.clone());
        }
    }

    /// Peers to dial over QUIC now so that two of them report where they see this
    /// node's QUIC socket, while the mapping is unknown (each is dialled once).
    pub(crate) fn quic_probes(&mut self) -> Vec<(PeerId, Multiaddr)> {
        if self.mapping() != NatMapping::Unknown || self.quic_probed.len() >= QUIC_PROBES {
            return Vec::new();
        }
        let seen: Vec<IpAddr> = self.observed.keys().filter(|(_, quic)| *quic).map(|(ip, _)| *ip).collect();
        let want = 2usize.saturating_sub(seen.len());
        let mut out: Vec<(PeerId, Multiaddr)> = self
            .quic_addrs
            .iter()
            .filter(|(p, a)| {
                !self.quic_probed.contains(*p)
                    && self.conns.values().any(|c| c.peer == **p && !c.relayed)
                    && ip_port(a).is_some_and(|(ip, _, _)| !seen.contains(&ip))
            })
            .map(|(p, a)| (*p, a.clone()))
            .collect();
        out.sort_by_key(|(p, _)| *p);
        out.truncate(want.min(QUIC_PROBES - self.quic_probed.len()));
        self.quic_probed.extend(out.iter().map(|(p, _)| *p));
        out
    }

    /// The peer on connection `id` observed this node at `observed`.
    pub(crate) fn observed(&mut self, id: ConnectionId, observed: &Multiaddr) {
        let Some(remote) = self.conns.get(&id).and_then(|c| c.remote.clone()) else { return };
        self.observed_from(&remote, observed);
    }

    /// A peer at `remote` (a direct connection) observed this node at `observed`.
    fn observed_from(&mut self, remote: &Multiaddr, observed: &Multiaddr) {
        if is_relayed(remote) || is_relayed(observed) {
            return;
        }
        let (Some((from, _, _)), Some((_, _, quic))) = (ip_port(remote), ip_port(observed)) else { return };
        if from.is_loopback() {
            return;
        }
        let key = (from, quic);
        if self.observed.len() >= MAX_OBSERVERS && !self.observed.contains_key(&key) {
            return;
        }
        self.observed.insert(key, observed.clone());
    }

    /// The mapping, when it differs from the one last reported.
    pub(crate) fn mapping_changed(&mut self) -> Option<NatMapping> {
        let now = self.mapping();
        (now != self.reported_mapping).then(|| {
            self.reported_mapping = now;
            now
        })
    }

    /// How the NAT maps ports, from what peers at two or more IP addresses observed.
    /// Observations of QUIC are compared with QUIC ones, TCP with TCP.
    pub(crate) fn mapping(&self) -> NatMapping {
        let seen: Vec<(IpAddr, u16, bool)> = self.observed.values().filter_map(ip_port).collect();
        if seen.is_empty() {
            return NatMapping::Unknown;
        }
        let observers: std::collections::HashSet<IpAddr> = self.observed.keys().map(|(ip, _)| *ip).collect();
        if seen.iter().all(|(ip, _, _)| self.own_ips.contains(ip)) && observers.len() >= 2 {
            return NatMapping::None;
        }
        for quic in [true, false] {
            let ports: Vec<(IpAddr, u16)> =
                seen.iter().filter(|(_, _, q)| *q == quic).map(|(ip, port, _)| (*ip, *port)).collect();
            if ports.len() < 2 {
                continue;
            }
            if ports.iter().any(|p| *p != ports[0]) {
                return NatMapping::Symmetric;
            }
            return NatMapping::EndpointIndependent;
        }
        NatMapping::Unknown
    }
}

#[cfg(test)]
mod tests;
