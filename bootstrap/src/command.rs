//! What the [`crate::Node`] handle asks of the event loop: one [`Command`] per
//! operation, answered on a `oneshot`, and what the answers carry besides errors.

use std::path::PathBuf;
use std::time::Duration;

use libp2p::{Multiaddr, PeerId};
use pcp_protocol::{BlobHash, RunId, Verified};
use pcp_schema::SignedEnvelope;
use tokio::sync::oneshot;

use crate::error::{DialError, FetchError, GossipError, RequestError};
use crate::events::{NetStatus, Reachability, Stats};
use crate::ids::InboundId;

/// A command from a [`crate::Node`] handle.
#[derive(Debug)]
pub(crate) enum Command {
    ListenAddrs(oneshot::Sender<Vec<Multiaddr>>),
    ExternalAddrs(oneshot::Sender<Vec<Multiaddr>>),
    Reachability(oneshot::Sender<Reachability>),
    NetStatus(oneshot::Sender<NetStatus>),
    Dial {
        addr: Multiaddr,
        reply: oneshot::Sender<Result<(), DialError>>,
    },
    RoutingPeers(oneshot::Sender<Vec<PeerId>>),
    ConnectedPeers(oneshot::Sender<Vec<PeerId>>),
    Provide {
        hash: BlobHash,
        reply: oneshot::Sender<()>,
    },
    Fetch {
        hash: BlobHash,
        hint: Vec<PeerId>,
        timeout: Duration,
        reply: oneshot::Sender<Result<FetchReport, FetchError>>,
    },
    Subscribe {
        run: RunId,
        reply: oneshot::Sender<Result<(), GossipError>>,
    },
    Publish {
        run: RunId,
        data: Vec<u8>,
        reply: oneshot::Sender<Result<(), GossipError>>,
    },
    Stats(oneshot::Sender<Stats>),
    Providers {
        key: BlobHash,
        max: usize,
        reply: oneshot::Sender<Vec<PeerId>>,
    },
    /// Looks `peer` up in the DHT and keeps its addresses, for a request to a peer
    /// this node has no address of.
    FindPeer {
        peer: PeerId,
        reply: oneshot::Sender<bool>,
    },
    Request {
        peer: PeerId,
        envelope: SignedEnvelope,
        reply: oneshot::Sender<Result<Verified, RequestError>>,
    },
    /// Answered in turn with the other commands, without a reply: a role answering
    /// hundreds of heartbeats a second does not wait on the event loop for each.
    Respond {
        id: InboundId,
        envelope: SignedEnvelope,
    },
    Release {
        hashes: Vec<BlobHash>,
        reply: oneshot::Sender<Released>,
    },
}

/// A completed fetch.
#[derive(Debug, Clone)]
pub struct FetchReport {
    /// The blob.
    pub hash: BlobHash,
    /// Where it is stored.
    pub path: PathBuf,
    /// Its size.
    pub bytes: u64,
    /// Providers that delivered verified chunks (0 if it was already local).
    pub providers: usize,
    /// Chunks fetched over the network; fewer than the blob has when a download resumed.
    pub chunks_fetched: u32,
    /// Of those, chunks that came through a relay.
    pub chunks_relayed: u32,
    /// Wall time.
    pub seconds: f64,
}

/// What became of blobs handed to [`crate::Node::release`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Released {
    /// Blobs deleted at once.
    pub removed: usize,
    /// Blobs a transfer holds (a peer fetching them from this node, or this node
    /// fetching them): deleted when it ends, or after a bounded time.
    pub deferred: usize,
    /// Bytes of both (deferred blobs at their size now).
    pub bytes: u64,
    /// Blobs that were not in the store.
    pub absent: usize,
    /// Blobs whose deletion failed (logged with the path and the OS error).
    pub failed: usize,
}
