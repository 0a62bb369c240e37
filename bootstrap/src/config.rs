//! Node configuration.

use std::path::PathBuf;
use std::time::Duration;

use libp2p::Multiaddr;
use pcp_schema::MAX_BLOB_SIZE;

/// Established connections a node holds unless its role asks more: a worker or a
/// router talks to its shepherd, candidates, DHT neighbours and the peers it
/// fetches from or serves.
pub const DEFAULT_MAX_CONNECTIONS: u32 = 512;

/// How a node runs. [`Config::new`] gives production defaults.
#[derive(Debug, Clone)]
pub struct Config {
    /// Data directory: identity key and blob store.
    pub data_dir: PathBuf,
    /// Addresses to listen on (QUIC first, TCP as fallback).
    pub listen: Vec<Multiaddr>,
    /// Seed peers, each with a `/p2p/<peer-id>` suffix or without.
    pub bootstrap: Vec<Multiaddr>,
    /// Answer DHT queries from the start, as a seed (no `bootstrap`) always does. Other
    /// nodes serve the DHT only once an external address of theirs is confirmed, and
    /// until then no peer's routing table holds them: a run's coordinator candidates
    /// set this so that its workers and the other candidates know where to reach them
    /// before the leader that introduced them dies.
    pub dht_server: bool,
    /// How often to re-run the Kademlia bootstrap and re-dial lost seed peers.
    pub rebootstrap_interval: Duration,
    /// How often to retry the seeds while no peer at all is connected.
    pub recovery_interval: Duration,
    /// How long a peer that sent a bad chunk or message stays banned.
    pub ban_duration: Duration,
    /// Largest blob fetched or stored.
    pub max_blob_size: u64,
    /// Chunk requests in flight per provider.
    pub chunk_window: usize,
    /// A blob is in transfer while an answer to a peer's request for it is not yet
    /// sent, and for this long after (the fetcher's next request follows), or after
    /// this node fetched it: a [`crate::Node::release`] of it waits until then.
    pub transfer_linger: Duration,
    /// Capacity of the command queue.
    pub command_queue: usize,
    /// Capacity of the event queue; events beyond it are dropped and counted.
    pub event_queue: usize,
    /// Idle connections are closed after this long.
    pub idle_timeout: Duration,
    /// Established connections in all ([`DEFAULT_MAX_CONNECTIONS`] for a worker or a
    /// router; a shepherd raises it to admit its run's participants, whom the
    /// admission caps of `crate::admission` bound per address and by run).
    pub max_connections: u32,
    /// Agent string sent in identify.
    pub agent: String,
    /// Offer TLS 1.3 (`/tls/1.0.0`) before noise on TCP connections. With `false` TCP
    /// offers noise only (the fallback every libp2p peer speaks).
    pub tcp_tls: bool,
    /// NAT traversal: relays, hole punching, UPnP.
    pub nat: NatConfig,
}

/// How a node gets through NATs and helps others through theirs.
#[derive(Debug, Clone)]
pub struct NatConfig {
    /// Relays to hold a reservation on whatever AutoNAT says, each ending in
    /// `/p2p/<relay peer id>` (`--relay`).
    pub relays: Vec<Multiaddr>,
    /// Reserve a slot on relays found among the connected peers once AutoNAT says this
    /// node cannot be dialled (at most [`NatConfig::auto_relays`] of them).
    pub auto_relay: bool,
    /// How many relays to reserve on automatically.
    pub auto_relays: usize,
    /// Relay for others (circuit relay v2) while this node is publicly reachable.
    pub relay_service: bool,
    /// What this node spends on relaying for others.
    pub relay_limits: RelayLimits,
    /// Turn relayed connections into direct ones by hole punching (DCUtR).
    pub hole_punching: bool,
    /// How long blob requests to a peer reachable only through a relay wait for a hole
    /// punch to finish before they go through the relay.
    pub punch_wait: Duration,
    /// Ask the local router for a port mapping (UPnP IGD).
    pub upnp: bool,
    /// This node's public addresses, declared by its operator (`--external-address`):
    /// confirmed at once, without a peer's dial-back. Relay reservations are answered
    /// with them, the DHT serves from them and identify tells peers them. A node that
    /// no peer can test (the only public node of a network: AutoNAT asks only peers
    /// this node dialled) or whose interface does not hold its public address (a
    /// cloud's 1:1 NAT, a port forward) is confirmed no other way. See
    /// [`crate::parse_external_address`].
    pub external_addresses: Vec<Multiaddr>,
}

impl Default for NatConfig {
    fn default() -> Self {
        Self {
            relays: Vec::new(),
            auto_relay: true,
            auto_relays: 2,
            relay_service: true,
            relay_limits: RelayLimits::default(),
            hole_punching: true,
            punch_wait: Duration::from_secs(5),
            upnp: false,
            external_addresses: Vec::new(),
        }
    }
}

/// The bounds of the relay service (circuit relay v2 server). A circuit is one relayed
/// connection: it is closed when it has carried `max_circuit_bytes` (both directions
/// together) or lasted `max_circuit_duration`, and its peers then dial again (a new
/// circuit, within the rate limits) or go on over a hole-punched direct connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RelayLimits {
    /// Reservations held at once (peers reachable through this node).
    pub max_reservations: usize,
    /// Reservations per peer.
    pub max_reservations_per_peer: usize,
    /// How long a reservation lasts before its holder must renew it.
    pub reservation_duration: Duration,
    /// Circuits open at once.
    pub max_circuits: usize,
    /// Circuits per peer, as source or destination.
    pub max_circuits_per_peer: usize,
    /// A circuit's lifetime.
    pub max_circuit_duration: Duration,
    /// Bytes a circuit carries, both directions together.
    pub max_circuit_bytes: u64,
}

impl Default for RelayLimits {
    fn default() -> Self {
        Self {
            max_reservations: 128,
            max_reservations_per_peer: 4,
            reservation_duration: Duration::from_secs(3600),
            max_circuits: 32,
            max_circuits_per_peer: 8,
            max_circuit_duration: Duration::from_secs(30 * 60),
            max_circuit_bytes: 256 << 20,
        }
    }
}

impl Config {
    /// Defaults: listen on every interface (QUIC and TCP, ephemeral ports), no seeds.
    pub fn new(data_dir: PathBuf) -> Self {
        Self {
            data_dir,
            listen: vec![
                "/ip4/0.0.0.0/udp/0/quic-v1".parse().expect("valid literal multiaddr"),
                "/ip4/0.0.0.0/tcp/0".parse().expect("valid literal multiaddr"),
            ],
            bootstrap: Vec::new(),
            dht_server: false,
            rebootstrap_interval: Duration::from_secs(60),
            recovery_interval: Duration::from_secs(2),
            ban_duration: Duration::from_secs(600),
            max_blob_size: MAX_BLOB_SIZE,
            chunk_window: 8,
            transfer_linger: Duration::from_secs(5),
            command_queue: 64,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            event_queue: 4096,
            idle_timeout: Duration::from_secs(30),
            agent: format!("pcp-node/{}", env!("CARGO_PKG_VERSION")),
            tcp_tls: true,
            nat: NatConfig::default(),
        }
    }

    /// Loopback-only listening (QUIC and TCP on ephemeral ports), for tests and benches.
    pub fn loopback(data_dir: PathBuf) -> Self {
        Self {
            listen: vec![
                "/ip4/127.0.0.1/udp/0/quic-v1".parse().expect("valid literal multiaddr"),
                "/ip4/127.0.0.1/tcp/0".parse().expect("valid literal multiaddr"),
            ],
            ..Self::new(data_dir)
        }
    }
}
