//! Why an operation failed: one error per operation of the [`crate::Node`] handle.
//! Imports nothing of the crate but the store's error.

use libp2p::{Multiaddr, PeerId};
use pcp_protocol::{BlobHash, RunId};

use crate::store::StoreError;

/// Why a node could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The blob store could not be opened.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// A transport or behaviour could not be built.
    #[error("building the libp2p swarm: {0}")]
    Swarm(String),
    /// Listening on an address failed.
    #[error("listening on {addr}: {reason}")]
    Listen {
        /// The address.
        addr: Multiaddr,
        /// Why.
        reason: String,
    },
}

/// Why an address cannot be declared as this node's public address
/// ([`crate::parse_external_address`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{addr:?} {reason}")]
pub struct ExternalAddrError {
    /// The address as given.
    pub addr: String,
    /// What is wrong with it.
    pub reason: String,
}

/// The event loop has stopped.
#[derive(Debug, Clone, Copy, thiserror::Error)]
#[error("the node's event loop has stopped")]
pub struct Stopped;

/// Why a dial failed.
#[derive(Debug, thiserror::Error)]
pub enum DialError {
    /// The event loop has stopped.
    #[error(transparent)]
    Stopped(#[from] Stopped),
    /// libp2p refused or failed the dial.
    #[error("dialing {addr}: {reason}")]
    Dial {
        /// The address.
        addr: Multiaddr,
        /// Why.
        reason: String,
    },
}

/// Why a blob fetch failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum FetchError {
    /// The event loop has stopped.
    #[error(transparent)]
    Stopped(#[from] Stopped),
    /// No provider delivered the blob in time.
    #[error(
        "fetching blob {hash}: timed out after {seconds:.0} s with {done}/{total} chunks ({providers} providers known)"
    )]
    TimedOut {
        /// The blob.
        hash: BlobHash,
        /// Seconds waited.
        seconds: f64,
        /// Chunks verified (kept on disk for a resume).
        done: u32,
        /// Chunks in the blob (0 while the outboard is unknown).
        total: u32,
        /// Providers known.
        providers: usize,
    },
    /// Too many downloads are in progress.
    #[error("fetching blob {hash}: {max} downloads already in progress")]
    Busy {
        /// The blob.
        hash: BlobHash,
        /// The limit.
        max: usize,
    },
    /// The blob is larger than this node accepts.
    #[error("blob {hash} has {size} bytes, over the limit of {max}")]
    TooLarge {
        /// The blob.
        hash: BlobHash,
        /// Its size.
        size: u64,
        /// The limit.
        max: u64,
    },
    /// The store failed.
    #[error("storing blob {hash}: {reason}")]
    Store {
        /// The blob.
        hash: BlobHash,
        /// The store error.
        reason: String,
    },
}

/// Why a gossip operation failed.
#[derive(Debug, thiserror::Error)]
pub enum GossipError {
    /// The event loop has stopped.
    #[error(transparent)]
    Stopped(#[from] Stopped),
    /// gossipsub refused.
    #[error("gossip on run {run}: {reason}")]
    Refused {
        /// The run.
        run: RunId,
        /// Why.
        reason: String,
    },
}

/// Why a request got no verified answer.
#[derive(Debug, Clone, thiserror::Error)]
pub enum RequestError {
    /// The event loop has stopped.
    #[error(transparent)]
    Stopped(#[from] Stopped),
    /// Too many requests are in flight.
    #[error("request to {peer}: {max} requests already in flight")]
    Busy {
        /// The peer.
        peer: PeerId,
        /// The limit.
        max: usize,
    },
    /// The request did not get through (dial failure, timeout, stream reset, refusal).
    #[error("request to {peer}: {reason}")]
    Failed {
        /// The peer.
        peer: PeerId,
        /// Why.
        reason: String,
    },
    /// The answer did not verify, or was signed by someone other than the peer.
    #[error("answer from {peer} rejected: {reason}")]
    Rejected {
        /// The peer.
        peer: PeerId,
        /// Why.
        reason: String,
    },
}
