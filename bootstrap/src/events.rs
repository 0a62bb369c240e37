//! What the network layer reports to its owner.

use libp2p::{Multiaddr, PeerId};
use pcp_protocol::{BlobHash, RunId, Verified};

use crate::rpc::InboundId;

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
    },
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
}
