//! Seed peers that cannot be reached, and listen addresses that are taken: the
//! reasons in words a volunteer understands, exponential backoff between retries,
//! and a check that a TCP port is free before the swarm listens on it.

use std::error::Error as StdError;
use std::io;
use std::net::{IpAddr, SocketAddr, TcpListener};
use std::time::Duration;

use libp2p::multiaddr::Protocol;
use libp2p::swarm::DialError;
use libp2p::{Multiaddr, TransportError};
use tokio::time::Instant;

/// Longest wait between two attempts to reach a seed.
pub(crate) const SEED_RETRY_MAX: Duration = Duration::from_secs(60);

/// When to try an unreachable seed again: the wait starts at `base` and doubles with
/// each failure in a row, up to [`SEED_RETRY_MAX`]. A connection resets it.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Backoff {
    failures: u32,
    next: Option<Instant>,
}

impl Backoff {
    /// Records a failure at `now`; returns how long until the next attempt.
    pub(crate) fn failed(&mut self, now: Instant, base: Duration) -> Duration {
        let wait = base.saturating_mul(1 << self.failures.min(16)).min(SEED_RETRY_MAX);
        self.failures = self.failures.saturating_add(1);
        self.next = Some(now + wait);
        wait
    }

    /// The seed answered.
    pub(crate) fn reset(&mut self) {
        *self = Self::default();
    }

    /// Whether the seed may be dialled at `now`.
    pub(crate) fn ready(&self, now: Instant) -> bool {
        self.next.is_none_or(|t| t <= now)
    }

    /// Whether the seed failed and its wait is over: time to retry it.
    pub(crate) fn due(&self, now: Instant) -> bool {
        self.next.is_some_and(|t| t <= now)
    }
}

/// Why a dial failed, in a few words (`connection refused`, `timed out`, …).
/// `None` for outcomes that are not failures of the seed (the dial was aborted, or
/// skipped because a connection already exists).
pub(crate) fn dial_reason(error: &DialError) -> Option<String> {
    Some(match error {
        DialError::Aborted | DialError::DialPeerConditionFalse(_) => return None,
        DialError::LocalPeerId { .. } => "that is this node's own address".into(),
        DialError::NoAddresses => "no address to dial".into(),
        DialError::WrongPeerId { obtained, .. } => format!("the peer at that address is {obtained}"),
        DialError::Denied { cause } => format!("refused by this node: {}", cause_of(cause)),
        DialError::Transport(errors) => {
            let mut reasons: Vec<String> = errors.iter().map(|(_, e)| transport_reason(e)).collect();
            reasons.dedup();
            if reasons.is_empty() { "no transport could dial it".into() } else { reasons.join("; ") }
        }
    })
}

/// Why a transport failed, in a few words.
pub(crate) fn transport_reason(error: &TransportError<io::Error>) -> String {
    match error {
        TransportError::MultiaddrNotSupported(addr) => {
            format!("{addr} is not a supported address (use …/tcp/PORT or …/udp/PORT/quic-v1)")
        }
        TransportError::Other(e) => cause_of(e),
    }
}

/// The most telling cause in `error`'s chain: a known I/O error kind in words, or else
/// the innermost message.
pub(crate) fn cause_of(error: &(dyn StdError + 'static)) -> String {
    if let Some(io) = error.downcast_ref::<io::Error>() {
        // an I/O error wrapping another reports the inner one's source, not the inner one
        if let Some(inner) = io.get_ref() {
            return cause_of(inner);
        }
        if let Some(words) = io_kind(io.kind()) {
            return words.into();
        }
    }
    match error.source() {
        Some(source) => cause_of(source),
        None => {
            let text = error.to_string();
            // `Address already in use (os error 98)`: the words are enough
            let text = text.split(" (os error ").next().unwrap_or_default().trim().trim_end_matches('.');
            let mut chars = text.chars();
            chars.next().map_or_else(String::new, |c| c.to_lowercase().chain(chars).collect())
        }
    }
}

fn io_kind(kind: io::ErrorKind) -> Option<&'static str> {
    Some(match kind {
        io::ErrorKind::ConnectionRefused => "connection refused",
        io::ErrorKind::ConnectionReset => "connection reset",
        io::ErrorKind::ConnectionAborted => "connection aborted",
        io::ErrorKind::TimedOut => "timed out",
        io::ErrorKind::HostUnreachable => "host unreachable",
        io::ErrorKind::NetworkUnreachable => "network unreachable",
        io::ErrorKind::NetworkDown => "network down",
        io::ErrorKind::AddrInUse => "address already in use",
        io::ErrorKind::AddrNotAvailable => "address not available on this machine",
        io::ErrorKind::PermissionDenied => "permission denied",
        _ => return None,
    })
}

/// The socket address of a `/ip4|ip6/…/tcp/PORT` address with a fixed port.
fn fixed_tcp_port(addr: &Multiaddr) -> Option<SocketAddr> {
    let mut parts = addr.iter();
    let ip: IpAddr = match parts.next()? {
        Protocol::Ip4(ip) => ip.into(),
        Protocol::Ip6(ip) => ip.into(),
        _ => return None,
    };
    match (parts.next()?, parts.next()) {
        (Protocol::Tcp(port), None | Some(Protocol::P2p(_))) if port != 0 => Some(SocketAddr::new(ip, port)),
        _ => None,
    }
}

/// Fails with `AddrInUse` if another socket listens on `addr`'s TCP port.
///
/// libp2p's TCP transport sets `SO_REUSEPORT` on every listening socket (there is no
/// option to turn it off), so a second node listening on the same port would share it
/// with the first and the kernel would split incoming connections between them. A
/// socket without `SO_REUSEPORT` cannot bind a port another socket listens on: binding
/// one first turns the silent sharing into an error. Addresses with port 0 and QUIC
/// addresses (UDP sockets are bound without `SO_REUSEPORT`) need no check.
pub(crate) fn check_port_free(addr: &Multiaddr) -> io::Result<()> {
    match fixed_tcp_port(addr) {
        Some(socket) => TcpListener::bind(socket).map(drop),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_up_to_the_cap_and_resets() {
        let now = Instant::now();
        let base = Duration::from_secs(2);
        let mut b = Backoff::default();
        assert!(b.ready(now) && !b.due(now));
        let waits: Vec<u64> = (0..8).map(|_| b.failed(now, base).as_secs()).collect();
        assert_eq!(waits, [2, 4, 8, 16, 32, 60, 60, 60]);
        assert!(!b.ready(now + Duration::from_secs(59)));
        assert!(b.due(now + Duration::from_secs(60)));
        b.reset();
        assert!(b.ready(now) && !b.due(now));
        assert_eq!(b.failed(now, base), base);
        // thousands of failures do not overflow
        for _ in 0..10_000 {
            b.failed(now, base);
        }
        assert_eq!(b.failed(now, base), SEED_RETRY_MAX);
    }

    #[test]
    fn reasons_are_short() {
        let refused = io::Error::from(io::ErrorKind::ConnectionRefused);
        assert_eq!(cause_of(&refused), "connection refused");
        let wrapped = io::Error::other(io::Error::from(io::ErrorKind::TimedOut));
        assert_eq!(cause_of(&wrapped), "timed out");
        let custom = io::Error::other("Handshake with the remote timed out.");
        assert_eq!(cause_of(&custom), "handshake with the remote timed out");
        let os = io::Error::other("Address already in use (os error 98)");
        assert_eq!(cause_of(&os), "address already in use");
        let e = DialError::Transport(vec![(
            "/ip4/127.0.0.1/tcp/9".parse().expect("addr"),
            TransportError::Other(io::Error::from(io::ErrorKind::ConnectionRefused)),
        )]);
        assert_eq!(dial_reason(&e).as_deref(), Some("connection refused"));
        assert_eq!(dial_reason(&DialError::Aborted), None);
    }

    #[test]
    fn a_taken_tcp_port_is_detected() {
        let taken = TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = taken.local_addr().expect("addr").port();
        let addr: Multiaddr = format!("/ip4/127.0.0.1/tcp/{port}").parse().expect("addr");
        let e = check_port_free(&addr).expect_err("the port is taken");
        assert_eq!(e.kind(), io::ErrorKind::AddrInUse);
        // QUIC on the same port number is another protocol; port 0 is always free
        assert!(check_port_free(&format!("/ip4/127.0.0.1/udp/{port}/quic-v1").parse().expect("addr")).is_ok());
        assert!(check_port_free(&"/ip4/127.0.0.1/tcp/0".parse().expect("addr")).is_ok());
        drop(taken);
        assert!(check_port_free(&addr).is_ok());
    }
}
