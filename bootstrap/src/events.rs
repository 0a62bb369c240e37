//! What the network layer reports to its owner.

use libp2p::{Multiaddr, PeerId};
use pcp_protocol::{BlobHash, RunId, Verified};

use crate::ids::InboundId;

/// Whether others can dial this node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reachability {
    /// A peer dialed us back at this address.
    Public(Multiaddr),
    /// Peers tried and could not dial us back.
    Private,
    /// Not known yet.
    Unknown,
}

/// A network event.
#[derive(Debug, Clone)]
pub enum Event {
    /// Listening on a new address.
    Listening {
        /// The address.
        addr: Multiaddr,
    },
    /// A connection to a peer is up.
    PeerConnected {
        /// The peer.
        peer: PeerId,
        /// Its address on this connection.
        addr: Multiaddr,
    },
    /// A seed peer (`Config::bootstrap`) could not be reached; it is dialled again
    /// after `retry_in` (exponential backoff, capped at a minute).
    BootstrapFailed {
        /// The seed's address, as configured.
        addr: Multiaddr,
        /// Why, in a few words (`connection refused`, `timed out`, …).
        reason: String,
        /// How long until the next attempt.
        retry_in: std::time::Duration,
    },
    /// A peer entered the Kademlia routing table.
    PeerDiscovered {
        /// The peer.
        peer: PeerId,
    },
    /// A blob was fetched, verified and stored.
    BlobFetched {
        /// The blob.
        hash: BlobHash,
        /// Its size.
        bytes: u64,
        /// Providers that delivered verified chunks.
        providers: usize,
        /// Wall time of the fetch.
        seconds: f64,
        /// Chunks fetched over the network.
        chunks: u32,
        /// Of those, chunks that came through a relay.
        chunks_relayed: u32,
    },
    /// A peer sent something invalid (bad signature, replay, bad chunk).
    MessageRejected {
        /// The peer.
        peer: PeerId,
        /// What was wrong.
        reason: String,
    },
    /// Reachability changed.
    Reachability(Reachability),
    /// A relay accepted (or renewed) this node's reservation: peers can reach it at
    /// `addr` through the relay.
    RelayReserved {
        /// The relay.
        relay: PeerId,
        /// This node's address through the relay (`…/p2p/<relay>/p2p-circuit`).
        addr: Multiaddr,
        /// Whether it renews an earlier reservation.
        renewal: bool,
        /// Bytes each circuit through the relay may carry, if it said.
        limit_bytes: Option<u64>,
        /// How long each circuit through the relay may last, if it said.
        limit_seconds: Option<u64>,
    },
    /// A reservation on a relay failed or ended.
    RelayLost {
        /// The relay.
        relay: PeerId,
        /// Why, in a few words.
        reason: String,
    },
    /// A connection through a relay is up (its remote address holds `/p2p-circuit`).
    RelayedConnection {
        /// The peer at the far end.
        peer: PeerId,
        /// The relay it goes through, when the address names it.
        relay: Option<PeerId>,
        /// The connection's remote address.
        addr: Multiaddr,
        /// Whether the peer dialled this node.
        inbound: bool,
    },
    /// A hole punch (DCUtR) over a relayed connection to `peer` finished: a direct
    /// connection (its remote address) or why not.
    HolePunched {
        /// The peer.
        peer: PeerId,
        /// The direct connection's remote address, or the reason it failed.
        result: Result<Multiaddr, String>,
    },
    /// This node, as a relay, accepted, refused or closed a reservation or circuit for
    /// others.
    Relayed(RelayService),
    /// The router mapped a port for this node (UPnP), or said why not.
    PortMapping {
        /// The mapped external address, or why there is none.
        result: Result<Multiaddr, String>,
    },
    /// A verified gossip message for a run this node subscribed to.
    Gossip {
        /// The run.
        run: RunId,
        /// The peer that forwarded it.
        from: PeerId,
        /// The verified envelope.
        message: Box<Verified>,
    },
    /// A verified DiLoCo request, signed by the peer that sent it. Answer it with
    /// [`crate::Node::respond`].
    Request {
        /// The peer (and signer).
        peer: PeerId,
        /// Pass to [`crate::Node::respond`].
        id: InboundId,
        /// The verified envelope.
        message: Box<Verified>,
        /// A contribution's share of the run's budget of contributions in flight: drop
        /// it once the contribution is handled (see [`crate::admission::Hold`]).
        hold: Option<crate::admission::Hold>,
    },
}

/// What this node did as a relay for others.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RelayService {
    /// The relay service was switched on (the node is publicly reachable) or off.
    Status {
        /// Whether it now relays.
        enabled: bool,
    },
    /// A reservation: `peer` is now reachable through this node, or was refused.
    Reservation {
        /// Who asked.
        peer: PeerId,
        /// `None` when accepted, else why not.
        refused: Option<String>,
    },
    /// A circuit from `src` to `dst` was opened, refused, or closed.
    Circuit {
        /// The dialling peer.
        src: PeerId,
        /// The peer dialled through this node.
        dst: PeerId,
        /// `opened`, `refused` or `closed`.
        state: &'static str,
        /// Why it was refused or closed, if it was not a normal end.
        reason: Option<String>,
    },
}

/// Where this node stands behind NATs, for `pcp-node status` and the dashboard.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetStatus {
    /// The AutoNAT verdict.
    pub reachability: Reachability,
    /// Addresses others confirmed they can dial (not through a relay).
    pub external: Vec<Multiaddr>,
    /// Addresses through relays this node holds a reservation on.
    pub relayed: Vec<Multiaddr>,
    /// How the NAT in front of this node maps ports, as peers observed them.
    pub mapping: NatMapping,
    /// Peers connected directly and through a relay.
    pub direct_peers: usize,
    /// Peers connected only through a relay.
    pub relayed_peers: usize,
    /// While no relay holds a reservation of this node: the relay that last failed
    /// one, and why (one with no public address of its own, say).
    pub relay_problem: Option<(PeerId, String)>,
    /// The last hole punch: the peer, and the direct connection's address or why
    /// there is none.
    pub last_punch: Option<(PeerId, Result<Multiaddr, String>)>,
}

/// How a NAT maps this node's listening port, from the addresses peers at different
/// IP addresses observed for it (identify).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NatMapping {
    /// Fewer than two peers at different addresses have reported what they see.
    Unknown,
    /// Peers see this node at its own address: no NAT.
    None,
    /// Every peer sees the same port (endpoint-independent mapping, as most home
    /// routers do): hole punching can open direct connections.
    EndpointIndependent,
    /// Peers see different ports (symmetric NAT: a new port per destination): hole
    /// punching fails and other NATed peers reach this node only through a relay.
    Symmetric,
}

impl NatMapping {
    /// A short name for events and logs.
    pub fn name(self) -> &'static str {
        match self {
            Self::Unknown => "unknown",
            Self::None => "none",
            Self::EndpointIndependent => "endpoint-independent",
            Self::Symmetric => "symmetric",
        }
    }
}

impl Reachability {
    /// A short name for events and logs: `public`, `private` or `unknown`.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Public(_) => "public",
            Self::Private => "private",
            Self::Unknown => "unknown",
        }
    }
}

/// Counters, for operators and tests.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    /// Gossip messages rejected (signature, replay, malformed).
    pub messages_rejected: u64,
    /// Blob chunks or outboards that failed verification.
    pub chunks_rejected: u64,
    /// Peers banned.
    pub peers_banned: u64,
    /// Events dropped because the event queue was full.
    pub events_dropped: u64,
    /// Blob requests served.
    pub chunks_served: u64,
    /// Blob chunk bytes served.
    pub bytes_served: u64,
    /// Blob chunks fetched over relayed connections.
    pub chunks_relayed: u64,
    /// Blobs deleted from the store after their owner released them.
    pub blobs_removed: u64,
    /// Bytes those freed.
    pub bytes_removed: u64,
}
