//! Connection fairness by address: caps on handshaking connections per transport and
//! per remote IP, and on established connections per remote IP.
//!
//! `libp2p-connection-limits` counts connections per peer and in total, but a silent
//! socket has no peer yet: 64 of them from one host filled the shared pending limit
//! and kept every other peer out. Here TCP and QUIC each have their own pending budget
//! (a TCP flood does not starve QUIC joins), one IP may hold only a few of it, and the
//! swarm's handshake timeout frees a silent socket's slot within seconds. Loopback is
//! exempt from the per-IP caps: `pcp-node sim` runs many nodes on one address. An IPv6
//! address counts as its /64 ([`address_key`]): one host commonly holds a whole /64, and
//! would otherwise have 2^64 addresses' worth of slots.

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::IpAddr;
use std::task::{Context, Poll};

use libp2p::core::transport::PortUse;
use libp2p::core::{Endpoint, Multiaddr};
use libp2p::multiaddr::Protocol;
use libp2p::swarm::{
    ConnectionClosed, ConnectionDenied, ConnectionId, FromSwarm, ListenFailure, NetworkBehaviour, THandler,
    THandlerInEvent, THandlerOutEvent, ToSwarm, dummy,
};
use libp2p::{PeerId, core::ConnectedPoint};

/// Handshaking inbound connections per transport (TCP, QUIC).
pub(crate) const MAX_PENDING_PER_TRANSPORT: usize = 64;
/// Handshaking inbound connections per remote IP (IPv6: per /64) and transport.
pub(crate) const MAX_PENDING_PER_IP: usize = 8;
/// Established connections per remote IP (IPv6: per /64; both directions).
pub(crate) const MAX_ESTABLISHED_PER_IP: usize = 64;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Transport {
    Tcp,
    Quic,
}

fn transport(addr: &Multiaddr) -> Transport {
    if addr.iter().any(|p| matches!(p, Protocol::QuicV1 | Protocol::Quic)) { Transport::Quic } else { Transport::Tcp }
}

/// The first IP address in `addr` (a relayed address's is its relay's).
pub(crate) fn ip(addr: &Multiaddr) -> Option<IpAddr> {
    addr.iter().find_map(|p| match p {
        Protocol::Ip4(a) => Some(IpAddr::V4(a)),
        Protocol::Ip6(a) => Some(IpAddr::V6(a)),
        _ => None,
    })
}

/// The address a budget shared per address counts `ip` under: an IPv4 address as it is
/// (an IPv4-mapped IPv6 one too), an IPv6 address as its /64, which one host commonly
/// holds whole.
pub(crate) fn address_key(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(_) => ip,
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6((u128::from(v6) & !((1u128 << 64) - 1)).into()),
        },
    }
}

/// The IPv6 /48 an [`address_key`] lies in (`None` for an IPv4 one): the prefix a
/// home or an office is commonly given whole, 65,536 /64s.
pub(crate) fn network_48(key: IpAddr) -> Option<IpAddr> {
    match key {
        IpAddr::V4(_) => None,
        IpAddr::V6(v6) => Some(IpAddr::V6((u128::from(v6) & !((1u128 << 80) - 1)).into())),
    }
}

/// A [`network_48`] as shown in messages, with its `/48`.
pub(crate) fn show_network(network: &IpAddr) -> String {
    format!("{network}/48")
}

/// The [`address_key`] of a connection's remote address, if it has an IP.
pub(crate) fn address_of(addr: &Multiaddr) -> Option<IpAddr> {
    ip(addr).map(address_key)
}

/// The key the per-IP caps count a connection from `addr` under: its [`address_key`],
/// or `None` for loopback (exempt) and for an address without an IP.
fn limited(addr: &Multiaddr) -> Option<IpAddr> {
    ip(addr).filter(|ip| !ip.is_loopback()).map(address_key).filter(|key| !key.is_loopback())
}

/// An [`address_key`] as shown in messages: an IPv6 one with its `/64`.
pub(crate) fn show_address(key: &IpAddr) -> String {
    match key {
        IpAddr::V4(v4) => v4.to_string(),
        IpAddr::V6(v6) => format!("{v6}/64"),
    }
}

/// Why a connection was refused.
#[derive(Debug, thiserror::Error)]
pub(crate) enum Denied {
    #[error("{0:?}: {MAX_PENDING_PER_TRANSPORT} connections already handshaking")]
    Pending(Transport),
    #[error("{}: {MAX_PENDING_PER_IP} {:?} connections from this address already handshaking", show_address(.1), .0)]
    PendingPerIp(Transport, IpAddr),
    #[error("{}: {MAX_ESTABLISHED_PER_IP} connections from this address already established", show_address(.0))]
    EstablishedPerIp(IpAddr),
}

/// The counts, and the decisions on them. Per IP means per [`limited`] key.
#[derive(Debug, Default)]
pub(crate) struct IpLimits {
    pending: HashMap<ConnectionId, (Option<IpAddr>, Transport)>,
    pending_per_ip: HashMap<(IpAddr, Transport), usize>,
    established: HashMap<ConnectionId, IpAddr>,
    established_per_ip: HashMap<IpAddr, usize>,
}

fn decrement<K: std::hash::Hash + Eq>(map: &mut HashMap<K, usize>, key: K) {
    if let Some(n) = map.get_mut(&key) {
        *n -= 1;
        if *n == 0 {
            map.remove(&key);
        }
    }
}

impl IpLimits {
    fn pending_inbound(&mut self, id: ConnectionId, remote: &Multiaddr) -> Result<(), Denied> {
        let (ip, transport) = (limited(remote), transport(remote));
        if self.pending.values().filter(|(_, t)| *t == transport).count() >= MAX_PENDING_PER_TRANSPORT {
            return Err(Denied::Pending(transport));
        }
        if let Some(ip) = ip {
            let n = self.pending_per_ip.entry((ip, transport)).or_default();
            if *n >= MAX_PENDING_PER_IP {
                return Err(Denied::PendingPerIp(transport, ip));
            }
            *n += 1;
        }
        self.pending.insert(id, (ip, transport));
        Ok(())
    }

    fn pending_done(&mut self, id: ConnectionId) {
        if let Some((Some(ip), transport)) = self.pending.remove(&id) {
            decrement(&mut self.pending_per_ip, (ip, transport));
        }
    }

    fn established(&mut self, id: ConnectionId, remote: &Multiaddr) -> Result<(), Denied> {
        self.pending_done(id);
        let Some(ip) = limited(remote) else {
            return Ok(());
        };
        if self.established_per_ip.get(&ip).copied().unwrap_or(0) >= MAX_ESTABLISHED_PER_IP {
            return Err(Denied::EstablishedPerIp(ip));
        }
        Ok(())
    }

    fn opened(&mut self, id: ConnectionId, remote: &Multiaddr) {
        if let Some(ip) = limited(remote) {
            self.established.insert(id, ip);
            *self.established_per_ip.entry(ip).or_default() += 1;
        }
    }

    fn closed(&mut self, id: ConnectionId) {
        if let Some(ip) = self.established.remove(&id) {
            decrement(&mut self.established_per_ip, ip);
        }
    }
}

impl NetworkBehaviour for IpLimits {
    type ConnectionHandler = dummy::ConnectionHandler;
    type ToSwarm = Infallible;

    fn handle_pending_inbound_connection(
        &mut self,
        id: ConnectionId,
        _: &Multiaddr,
        remote: &Multiaddr,
    ) -> Result<(), ConnectionDenied> {
        self.pending_inbound(id, remote).map_err(ConnectionDenied::new)
    }

    fn handle_established_inbound_connection(
        &mut self,
        id: ConnectionId,
        _: PeerId,
        _: &Multiaddr,
        remote: &Multiaddr,
    ) -> Result<THandler<Self>, ConnectionDenied> {
        self.established(id, remote).map_err(ConnectionDenied::new)?;
        Ok(dummy::ConnectionHandler)
    }

    fn handle_established_outbound_connection(
        &mut self,
        id: ConnectionId,
        _: PeerId,
        remote: &Multiaddr,
        _: Endpoint,
        _: PortUse,
    ) -> Result<THandler<Self>, ConnectionDenied> {
        self.established(id, remote).map_err(ConnectionDenied::new)?;
        Ok(dummy::ConnectionHandler)
    }

    fn on_swarm_event(&mut self, event: FromSwarm) {
        match event {
            FromSwarm::ConnectionEstablished(e) => {
                let remote = match e.endpoint {
                    ConnectedPoint::Dialer { address, .. } => address,
                    ConnectedPoint::Listener { send_back_addr, .. } => send_back_addr,
                };
                self.opened(e.connection_id, remote);
            }
            FromSwarm::ConnectionClosed(ConnectionClosed { connection_id, .. }) => self.closed(connection_id),
            FromSwarm::ListenFailure(ListenFailure { connection_id, .. }) => self.pending_done(connection_id),
            _ => {}
        }
    }

    fn on_connection_handler_event(&mut self, _: PeerId, _: ConnectionId, event: THandlerOutEvent<Self>) {
        match event {}
    }

    fn poll(&mut self, _: &mut Context<'_>) -> Poll<ToSwarm<Self::ToSwarm, THandlerInEvent<Self>>> {
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(s: &str) -> Multiaddr {
        s.parse().expect("valid multiaddr")
    }

    #[test]
    fn one_address_cannot_fill_the_pending_budget_and_tcp_cannot_starve_quic() {
        let mut limits = IpLimits::default();
        let mut next = 0;
        let mut id = || {
            next += 1;
            ConnectionId::new_unchecked(next)
        };
        let flood = addr("/ip4/203.0.113.7/tcp/5000");
        for _ in 0..MAX_PENDING_PER_IP {
            assert!(limits.pending_inbound(id(), &flood).is_ok());
        }
        let err = limits.pending_inbound(id(), &flood).err();
        assert!(matches!(err, Some(Denied::PendingPerIp(Transport::Tcp, _))), "{err:?}");
        // many addresses fill the TCP budget
        for i in 0..MAX_PENDING_PER_TRANSPORT - MAX_PENDING_PER_IP {
            let a = addr(&format!("/ip4/198.51.100.{i}/tcp/4000"));
            assert!(limits.pending_inbound(id(), &a).is_ok(), "slot {i}");
        }
        let other = addr("/ip4/192.0.2.1/tcp/4000");
        assert!(matches!(limits.pending_inbound(id(), &other), Err(Denied::Pending(Transport::Tcp))));
        // QUIC has its own budget, from the same flooding address too
        let quic = addr("/ip4/203.0.113.7/udp/4001/quic-v1");
        let quic_id = id();
        assert!(limits.pending_inbound(quic_id, &quic).is_ok());
        // a finished handshake frees its slot
        assert!(limits.established(quic_id, &quic).is_ok());
        assert!(!limits.pending.contains_key(&quic_id));
    }

    #[test]
    fn established_connections_per_address_are_capped_but_not_on_loopback() {
        let mut limits = IpLimits::default();
        let remote = addr("/ip4/203.0.113.9/udp/4001/quic-v1");
        for i in 0..MAX_ESTABLISHED_PER_IP {
            let id = ConnectionId::new_unchecked(i);
            assert!(limits.established(id, &remote).is_ok());
            limits.opened(id, &remote);
        }
        let extra = ConnectionId::new_unchecked(9999);
        assert!(matches!(limits.established(extra, &remote), Err(Denied::EstablishedPerIp(_))));
        limits.closed(ConnectionId::new_unchecked(0));
        assert!(limits.established(extra, &remote).is_ok());
        let local = addr("/ip4/127.0.0.1/tcp/4000");
        for i in 0..2 * MAX_ESTABLISHED_PER_IP {
            let id = ConnectionId::new_unchecked(20_000 + i);
            assert!(limits.pending_inbound(id, &local).is_ok());
            assert!(limits.established(id, &local).is_ok());
            limits.opened(id, &local);
        }
    }

    #[test]
    fn connections_from_one_ipv6_64_are_counted_together() {
        let mut limits = IpLimits::default();
        let from = |host: u32, net: u16| addr(&format!("/ip6/2001:db8:0:{net:x}::{host:x}/udp/4001/quic-v1"));
        // every connection from another address of the same /64
        for i in 0..MAX_ESTABLISHED_PER_IP {
            let id = ConnectionId::new_unchecked(i);
            assert!(limits.established(id, &from(i as u32 + 1, 1)).is_ok());
            limits.opened(id, &from(i as u32 + 1, 1));
        }
        let extra = ConnectionId::new_unchecked(9999);
        let denied = limits.established(extra, &from(0xffff, 1)).err().map(|e| e.to_string());
        assert_eq!(
            denied.as_deref(),
            Some("2001:db8:0:1::/64: 64 connections from this address already established"),
            "a fresh address of a full /64"
        );
        assert!(limits.established(extra, &from(1, 2)).is_ok(), "the next /64 is another address");
        limits.closed(ConnectionId::new_unchecked(3));
        assert!(limits.established(extra, &from(0xffff, 1)).is_ok(), "a closed connection frees its slot");

        // handshakes too: one /64 holds MAX_PENDING_PER_IP of them
        let mut limits = IpLimits::default();
        for i in 0..MAX_PENDING_PER_IP {
            let id = ConnectionId::new_unchecked(i);
            assert!(limits.pending_inbound(id, &from(i as u32 + 1, 7)).is_ok());
        }
        let denied = limits.pending_inbound(ConnectionId::new_unchecked(100), &from(0xabc, 7));
        assert!(matches!(denied, Err(Denied::PendingPerIp(Transport::Quic, _))), "{denied:?}");
        limits.pending_done(ConnectionId::new_unchecked(0));
        assert!(limits.pending_inbound(ConnectionId::new_unchecked(100), &from(0xabc, 7)).is_ok());

        // IPv6 loopback is exempt, though its /64 (::) is not a loopback address
        let mut limits = IpLimits::default();
        let local = addr("/ip6/::1/tcp/4000");
        for i in 0..2 * MAX_ESTABLISHED_PER_IP {
            let id = ConnectionId::new_unchecked(i);
            assert!(limits.pending_inbound(id, &local).is_ok());
            assert!(limits.established(id, &local).is_ok());
            limits.opened(id, &local);
        }
        assert!(limits.established_per_ip.is_empty() && limits.pending_per_ip.is_empty());
    }

    #[test]
    fn an_ipv6_host_is_its_64() {
        let of = |s: &str| address_of(&addr(s)).map(|ip| ip.to_string());
        assert_eq!(of("/ip4/203.0.113.9/tcp/1"), Some("203.0.113.9".into()));
        assert_eq!(of("/ip6/2001:db8:1:2:aaaa::1/tcp/1"), Some("2001:db8:1:2::".into()));
        assert_eq!(of("/ip6/2001:db8:1:2:bbbb::9/udp/1/quic-v1"), of("/ip6/2001:db8:1:2::1/tcp/1"));
        assert_ne!(of("/ip6/2001:db8:1:3::1/tcp/1"), of("/ip6/2001:db8:1:2::1/tcp/1"));
        assert_eq!(of("/ip6/::ffff:203.0.113.9/tcp/1"), Some("203.0.113.9".into()));
        assert_eq!(of("/dns4/example.com/tcp/1"), None);
    }
}
