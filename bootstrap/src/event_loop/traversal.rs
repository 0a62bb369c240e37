//! NAT traversal in the event loop: what the relay client and service, DCUtR, AutoNAT
//! v1 and v2 and UPnP report, turned into [`Nat`](crate::nat::Nat) updates, swarm
//! actions (listening on relays, closing relayed connections a direct one replaced,
//! switching the relay service) and [`Event`]s.

use libp2p::core::ConnectedPoint;
use libp2p::core::transport::ListenerId;
use libp2p::swarm::ConnectionId;
use libp2p::swarm::dial_opts::{DialOpts, PeerCondition};
use libp2p::{PeerId, autonat, dcutr, identify, relay, upnp};
use tokio::time::Instant;

use super::EventLoop;
use crate::events::{Event, NetStatus, Reachability, RelayService};
use crate::nat::relay_of;

impl EventLoop {
    /// Records a new connection; a relayed one is reported.
    pub(super) fn nat_connected(&mut self, peer: PeerId, id: ConnectionId, endpoint: &ConnectedPoint) {
        let relayed = endpoint.is_relayed();
        let (addr, dialled) = match endpoint {
            ConnectedPoint::Dialer { address, .. } => (address, true),
            ConnectedPoint::Listener { local_addr, send_back_addr } => {
                // an inbound relayed connection's relay is in our (circuit) address
                (if relayed { local_addr } else { send_back_addr }, false)
            }
        };
        let replaces = self.nat.connected(id, peer, relayed, (addr, dialled), Instant::now());
        if replaces && self.nat.mark_punched(peer) {
            // the direct connection came while DCUtR punched: whichever side's dial won,
            // the punch worked (DCUtR reports only the dial it made itself)
            tracing::info!(%peer, %addr, "hole punched: direct connection");
            self.report_punch(peer, Ok(addr.clone()));
        }
        if relayed {
            let relay = relay_of(addr);
            tracing::debug!(%peer, %addr, inbound = !dialled, "relayed connection");
            self.emit(Event::RelayedConnection { peer, relay, addr: addr.clone(), inbound: !dialled });
        } else {
            self.close_upgraded(Instant::now());
        }
    }

    /// What identify told: the address the peer sees us at, and whether it relays.
    pub(super) fn nat_identified(&mut self, peer: PeerId, id: ConnectionId, info: &identify::Info) {
        self.nat.observed(id, &info.observed_addr);
        self.nat.peer_quic_addr(peer, &info.listen_addrs);
        if let Some(addr) = self.nat.inbound_proof(id, &info.observed_addr)
            && !self.swarm.external_addresses().any(|a| *a == addr)
        {
            // a peer dialled this address: it is reachable
            self.swarm.add_external_address(addr.clone());
            if self.nat.confirmed(&addr) {
                tracing::info!(%addr, %peer, "external address confirmed: a peer dialled it");
                self.update_reachability();
            }
        }
        if let Some(mapping) = self.nat.mapping_changed() {
            tracing::info!("NAT port mapping: {} (from the addresses peers see this node at)", mapping.name());
        }
        if info.protocols.contains(&relay::HOP_PROTOCOL_NAME) {
            let dialled = self.nat.dialled_addr(&peer);
            let seed = self.seeds.iter().any(|(p, _)| *p == Some(peer));
            self.nat.offers_relay(peer, dialled, &info.listen_addrs, seed);
            self.listen_on_relays();
        } else {
            self.nat.forget_relay_candidate(&peer);
        }
    }

    /// Takes `addr` as a public address of this node, confirmed (`why`: declared with
    /// `--external-address`, or a publicly routable listen address).
    pub(super) fn declare_external(&mut self, addr: libp2p::Multiaddr, why: &str) {
        if self.swarm.external_addresses().any(|a| *a == addr) {
            return;
        }
        self.swarm.add_external_address(addr.clone());
        if self.nat.confirmed(&addr) {
            tracing::info!(%addr, "external address confirmed: {why}");
            self.update_reachability();
        }
    }

    /// Recomputes the reachability verdict; on a change reports it, switches the relay
    /// service, and reserves on relays when private. Reservations made while private
    /// stay when the node turns public: libp2p's relay client panics when a relay
    /// listener is removed while its reservation is in flight (0.22), and a slot on a
    /// relay costs little.
    pub(super) fn update_reachability(&mut self) {
        if let Some(verdict) = self.nat.update_reachability(Instant::now()) {
            match &verdict {
                Reachability::Public(addr) => tracing::info!(%addr, "reachability: public"),
                Reachability::Private => tracing::info!(
                    "reachability: private: peers cannot dial this node{}",
                    if self.config.nat.auto_relay { "; reserving a slot on a relay" } else { "" }
                ),
                Reachability::Unknown => tracing::info!("reachability: unknown"),
            }
            self.reachability = verdict.clone();
            self.listen_on_relays();
            self.emit(Event::Reachability(verdict));
        }
        // the relay service follows the verdict (a seed relays from the start)
        if let Some(on) = self.nat.relay_switch() {
            self.relay_open.store(on, std::sync::atomic::Ordering::Relaxed);
            let limits = &self.config.nat.relay_limits;
            if on {
                tracing::info!(
                    "relaying for peers behind NATs (at most {} reservations, {} circuits of {} MiB and {} s each)",
                    limits.max_reservations,
                    limits.max_circuits,
                    limits.max_circuit_bytes >> 20,
                    limits.max_circuit_duration.as_secs()
                );
            }
            self.emit(Event::Relayed(RelayService::Status { enabled: on }));
        }
    }

    /// Starts reserving on the relays that are due (explicit ones, and found ones while
    /// private).
    pub(super) fn listen_on_relays(&mut self) {
        let now = Instant::now();
        for addr in self.nat.relays_to_listen(now) {
            match self.swarm.listen_on(addr.clone()) {
                Ok(id) => {
                    tracing::info!(%addr, "reserving a slot on relay");
                    self.relay_listeners.insert(id, addr);
                }
                Err(e) => {
                    let reason = crate::seeds::transport_reason(&e);
                    tracing::warn!(%addr, "cannot reserve on relay: {reason}");
                    if let Some((relay, _)) = self.nat.relay_closed(&addr, now) {
                        let (reason, _) = self.nat.reservation_failed(relay, reason);
                        self.emit(Event::RelayLost { relay, reason });
                    }
                }
            }
        }
    }

    /// A listener closed: if it was on a relay, the reservation is gone.
    pub(super) fn listener_closed(&mut self, id: ListenerId, reason: Result<(), std::io::Error>) {
        let Some(addr) = self.relay_listeners.remove(&id) else { return };
        let reason = match &reason {
            Ok(()) => "the relay closed the reservation".to_owned(),
            Err(e) => crate::seeds::cause_of(e),
        };
        let Some((relay, retry)) = self.nat.relay_closed(&addr, Instant::now()) else { return };
        let (reason, loud) = self.nat.reservation_failed(relay, reason);
        let retrying = retry.map(|wait| format!("; retrying in {} s", wait.as_secs())).unwrap_or_default();
        if loud {
            tracing::warn!(%addr, "relay reservation lost: {reason}{retrying}");
        } else {
            tracing::debug!(%addr, "relay reservation lost: {reason}{retrying}");
        }
        self.emit(Event::RelayLost { relay, reason });
        self.listen_on_relays();
    }

    /// AutoNAT v2: a server tried to dial one of our candidate addresses back.
    pub(super) fn on_autonat_v2(&mut self, event: autonat::v2::client::Event) {
        match event.result {
            Ok(()) => tracing::debug!(addr = %event.tested_addr, server = %event.server, "AutoNAT v2: dialled back"),
            Err(e) => {
                tracing::debug!(addr = %event.tested_addr, server = %event.server, "AutoNAT v2: not dialled back: {e}");
                self.nat.autonat_v2_failed(Instant::now());
                self.update_reachability();
            }
        }
    }

    /// This node's reservations and circuits as a relay client.
    pub(super) fn on_relay_client(&mut self, event: relay::client::Event) {
        match event {
            relay::client::Event::ReservationReqAccepted { relay_peer_id, renewal, limit } => {
                let Some(addr) = self.nat.reserved(&relay_peer_id) else { return };
                let limit_bytes = limit.as_ref().and_then(|l| l.data_in_bytes());
                let limit_seconds = limit.as_ref().and_then(|l| l.duration()).map(|d| d.as_secs());
                if renewal {
                    tracing::debug!(%addr, "relay reservation renewed");
                } else {
                    tracing::info!(%addr, "reachable through relay {relay_peer_id}");
                    // provider records carry the addresses of their announcement: say
                    // again what this node provides, now with an address peers can dial
                    let provided: Vec<_> = self.provided.iter().copied().collect();
                    for hash in provided {
                        self.provide(hash, None);
                    }
                }
                self.emit(Event::RelayReserved { relay: relay_peer_id, addr, renewal, limit_bytes, limit_seconds });
            }
            relay::client::Event::OutboundCircuitEstablished { relay_peer_id, .. } => {
                tracing::debug!(relay = %relay_peer_id, "circuit through relay opened");
            }
            relay::client::Event::InboundCircuitEstablished { src_peer_id, .. } => {
                tracing::debug!(peer = %src_peer_id, "a peer reached this node through a relay");
            }
        }
    }

    /// What this node did as a relay for others.
    #[allow(deprecated, reason = "libp2p still emits the deprecated failure events; they are logged")]
    pub(super) fn on_relay_service(&mut self, event: relay::Event) {
        let service = match event {
            relay::Event::ReservationReqAccepted { src_peer_id, renewed: false } => {
                tracing::debug!(peer = %src_peer_id, "relaying for a peer (reservation)");
                if self.nat.warn_addressless_relay() {
                    tracing::warn!(
                        peer = %src_peer_id,
                        "relaying with no confirmed public address: reservations carry none, so peers cannot \
                         reach {src_peer_id} through this node. No peer has dialled this node back (AutoNAT asks \
                         only peers it dialled): start it with --external-address <its public address>"
                    );
                }
                RelayService::Reservation { peer: src_peer_id, refused: None }
            }
            relay::Event::ReservationReqDenied { src_peer_id, status } => {
                tracing::info!(peer = %src_peer_id, "relay reservation refused: {status:?}");
                RelayService::Reservation { peer: src_peer_id, refused: Some(format!("{status:?}")) }
            }
            relay::Event::CircuitReqAccepted { src_peer_id, dst_peer_id } => {
                tracing::debug!(src = %src_peer_id, dst = %dst_peer_id, "relaying a circuit");
                RelayService::Circuit { src: src_peer_id, dst: dst_peer_id, state: "opened", reason: None }
            }
            relay::Event::CircuitReqDenied { src_peer_id, dst_peer_id, status } => {
                tracing::info!(src = %src_peer_id, dst = %dst_peer_id, "relay circuit refused: {status:?}");
                let reason = Some(format!("{status:?}"));
                RelayService::Circuit { src: src_peer_id, dst: dst_peer_id, state: "refused", reason }
            }
            relay::Event::CircuitClosed { src_peer_id, dst_peer_id, error } => {
                let reason = error.map(|e| e.to_string());
                if let Some(reason) = &reason {
                    tracing::info!(src = %src_peer_id, dst = %dst_peer_id, "relay circuit closed: {reason}");
                }
                RelayService::Circuit { src: src_peer_id, dst: dst_peer_id, state: "closed", reason }
            }
            other => {
                tracing::debug!("relay service: {other:?}");
                return;
            }
        };
        self.emit(Event::Relayed(service));
    }

    /// A hole punch finished: on success the relayed connections go once idle.
    pub(super) fn on_hole_punch(&mut self, event: dcutr::Event) {
        let peer = event.remote_peer_id;
        let direct = match &event.result {
            Ok(id) => self.nat.remote_of(*id).cloned(),
            // the other side's dial may have won while ours failed
            Err(_) => self.nat.direct_addr(&peer).cloned(),
        };
        match (direct, event.result) {
            (Some(addr), _) => {
                if self.nat.mark_punched(peer) {
                    tracing::info!(%peer, %addr, "hole punched: direct connection");
                    self.report_punch(peer, Ok(addr));
                }
            }
            (None, Ok(_)) => {}
            (None, Err(e)) => match self.nat.punch_failed(&peer, e.to_string(), Instant::now()) {
                Some(reason) => self.report_failed_punch(peer, reason),
                None => tracing::debug!(%peer, "hole punch attempt failed: {e}; waiting for the other side's dial"),
            },
        }
        self.close_upgraded(Instant::now());
        self.drive_all();
    }

    fn report_failed_punch(&mut self, peer: PeerId, reason: String) {
        tracing::info!(%peer, "hole punch failed: {reason}; traffic goes through the relay");
        self.report_punch(peer, Err(reason));
    }

    /// Reports a hole punch's outcome (the event, and [`NetStatus::last_punch`]).
    fn report_punch(&mut self, peer: PeerId, result: Result<libp2p::Multiaddr, String>) {
        self.nat.punch_outcome(peer, result.clone());
        self.emit(Event::HolePunched { peer, result });
    }

    /// The router's answer to a port mapping request.
    pub(super) fn on_upnp(&mut self, event: upnp::Event) {
        let result = match event {
            upnp::Event::NewExternalAddr { external_addr, .. } => {
                tracing::info!(addr = %external_addr, "UPnP: the router mapped a port");
                Ok(external_addr)
            }
            upnp::Event::ExpiredExternalAddr { external_addr, .. } => {
                tracing::warn!(addr = %external_addr, "UPnP: the port mapping expired");
                Err(format!("the mapping of {external_addr} expired"))
            }
            upnp::Event::GatewayNotFound => {
                tracing::warn!("UPnP: no router answered (no IGD gateway on this network)");
                Err("no UPnP gateway found".to_owned())
            }
            upnp::Event::NonRoutableGateway => {
                tracing::warn!("UPnP: the router is itself behind a NAT; its mapping would not help");
                Err("the UPnP gateway is not on the public internet".to_owned())
            }
        };
        self.emit(Event::PortMapping { result });
    }

    /// Hole punches that took too long, relayed connections to close, relays to retry.
    pub(super) fn nat_housekeeping(&mut self, now: Instant) {
        // a failed dial-back becomes "private" once the other candidates' answers had time
        self.update_reachability();
        for (peer, failed) in self.nat.expire_punches(now) {
            // DCUtR reports nothing on the side whose dial failed: say why as far as known
            let reason = failed.unwrap_or_else(|| self.nat.no_punch_reason());
            self.report_failed_punch(peer, reason);
        }
        self.close_upgraded(now);
        self.listen_on_relays();
        for (peer, addr) in self.nat.quic_probes() {
            // a second QUIC observer tells whether the NAT keeps one port for all peers
            tracing::debug!(%peer, %addr, "dialling over QUIC to learn the NAT's port mapping");
            let opts = DialOpts::peer_id(peer).addresses(vec![addr]).condition(PeerCondition::Always).build();
            if let Err(e) = self.swarm.dial(opts) {
                tracing::debug!(%peer, "QUIC probe: {e}");
            }
        }
    }

    /// Closes the relayed connections that direct ones replaced, once nothing is in
    /// flight on them (or the grace is over).
    fn close_upgraded(&mut self, now: Instant) {
        let (transfers, rpc_out, rpc_in) = (&self.transfers, &self.outbox.sent, &self.rpc_in);
        let idle = |peer: &PeerId| {
            !transfers.is_busy_with(peer)
                && !rpc_out.values().any(|(p, _, _)| p == peer)
                && !rpc_in.values().any(|(_, _, p)| p == peer)
        };
        for (peer, id) in self.nat.relayed_to_close(now, idle) {
            tracing::debug!(%peer, "closing the relayed connection: a direct one replaced it");
            self.swarm.close_connection(id);
        }
    }

    /// Advances every fetch (after a change of which peers are held).
    pub(super) fn drive_all(&mut self) {
        self.transfers.drive_all();
        self.poll_transfers();
    }

    /// Where this node stands behind NATs.
    pub(super) fn net_status(&self) -> NetStatus {
        let (direct_peers, relayed_peers) = self.nat.peer_counts();
        NetStatus {
            reachability: self.reachability.clone(),
            external: self.nat.external().to_vec(),
            relayed: self.nat.relayed_addrs().to_vec(),
            mapping: self.nat.mapping(),
            direct_peers,
            relayed_peers,
            relay_problem: self.nat.relay_problem().cloned(),
            last_punch: self.nat.last_punch().cloned(),
        }
    }
}
