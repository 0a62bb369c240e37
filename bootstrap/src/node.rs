//! The handle to a running node: a Clone wrapper around the command queue. It knows
//! the event loop only through [`Command`]s and the [`EventLoop`] it builds.

use std::sync::Arc;
use std::time::Duration;

use libp2p::{Multiaddr, PeerId};
use pcp_protocol::{BlobHash, Identity, PublicKey, RunId};
use tokio::sync::{mpsc, oneshot};

use crate::admission::Admission;
use crate::command::{Command, FetchReport, Released};
use crate::config::Config;
use crate::error::{DialError, FetchError, GossipError, RequestError, StartError, Stopped};
use crate::event_loop::EventLoop;
use crate::events::{Event, NetStatus, Reachability, Stats};
use crate::ids::InboundId;

/// A handle to a running node. Cheap to clone; every method talks to the event loop
/// over a bounded queue.
#[derive(Debug, Clone)]
pub struct Node {
    commands: mpsc::Sender<Command>,
    unanswered: mpsc::Sender<InboundId>,
    peer_id: PeerId,
    public: PublicKey,
    admission: Arc<Admission>,
}

impl Node {
    /// Builds a node (its swarm listens at once) and returns its handle, its event
    /// stream and the event loop to run.
    pub fn new(identity: &Identity, config: Config) -> Result<(Self, mpsc::Receiver<Event>, EventLoop), StartError> {
        let (tx, rx) = mpsc::channel(config.command_queue.max(1));
        // room for every request that can be waiting: those within the cap, and contributions
        let (unanswered, unanswered_rx) = mpsc::channel(2 * crate::event_loop::MAX_RPC_INBOUND);
        let (event_tx, event_rx) = mpsc::channel(config.event_queue.max(1));
        let admission = Arc::new(Admission::default());
        let event_loop = EventLoop::new(identity, config, (rx, unanswered_rx), event_tx, admission.clone())?;
        let (peer_id, public) = (event_loop.peer_id(), identity.public());
        let node = Self { commands: tx, unanswered, peer_id, public, admission };
        Ok((node, event_rx, event_loop))
    }

    /// This node's PeerId.
    pub fn peer_id(&self) -> PeerId {
        self.peer_id
    }

    /// The runs this node serves and their participants: what it agrees to read, and
    /// from whom, before reading it (see [`crate::admission`]).
    pub fn admission(&self) -> &Arc<Admission> {
        &self.admission
    }

    /// This node's signing key (the same key as its PeerId).
    pub fn public_key(&self) -> PublicKey {
        self.public
    }

    async fn ask<T>(&self, make: impl FnOnce(oneshot::Sender<T>) -> Command) -> Result<T, Stopped> {
        let (tx, rx) = oneshot::channel();
        self.commands.send(make(tx)).await.map_err(|_| Stopped)?;
        rx.await.map_err(|_| Stopped)
    }

    /// Addresses the node listens on.
    pub async fn listen_addrs(&self) -> Result<Vec<Multiaddr>, Stopped> {
        self.ask(Command::ListenAddrs).await
    }

    /// Addresses others confirmed they can dial.
    pub async fn external_addrs(&self) -> Result<Vec<Multiaddr>, Stopped> {
        self.ask(Command::ExternalAddrs).await
    }

    /// The current reachability verdict.
    pub async fn reachability(&self) -> Result<Reachability, Stopped> {
        self.ask(Command::Reachability).await
    }

    /// Where this node stands behind NATs: reachability, external and relayed addresses,
    /// the NAT's port mapping, direct and relayed peers.
    pub async fn net_status(&self) -> Result<NetStatus, Stopped> {
        self.ask(Command::NetStatus).await
    }

    /// Dials an address.
    pub async fn dial(&self, addr: Multiaddr) -> Result<(), DialError> {
        self.ask(|reply| Command::Dial { addr, reply }).await?
    }

    /// Peers in the Kademlia routing table.
    pub async fn routing_peers(&self) -> Result<Vec<PeerId>, Stopped> {
        self.ask(Command::RoutingPeers).await
    }

    /// Peers with an open connection.
    pub async fn connected_peers(&self) -> Result<Vec<PeerId>, Stopped> {
        self.ask(Command::ConnectedPeers).await
    }

    /// Announces a blob in the store as provided by this node.
    pub async fn provide(&self, hash: BlobHash) -> Result<(), Stopped> {
        self.ask(|reply| Command::Provide { hash, reply }).await
    }

    /// Deletes blobs from the store and stops announcing them. A blob that a peer is
    /// fetching from this node (a chunk or outboard request in flight, or one within
    /// the last few seconds), or that this node is fetching, is deleted when that
    /// transfer ends, and at the latest a few minutes later; one added to the store
    /// or fetched again meanwhile is kept.
    pub async fn release(&self, hashes: Vec<BlobHash>) -> Result<Released, Stopped> {
        self.ask(|reply| Command::Release { hashes, reply }).await
    }

    /// Fetches a blob from its providers, verifying every chunk, into the store.
    pub async fn fetch(&self, hash: BlobHash, timeout: Duration) -> Result<FetchReport, FetchError> {
        self.ask(|reply| Command::Fetch { hash, hint: Vec::new(), timeout, reply }).await?
    }

    /// Like [`Node::fetch`], starting with `providers` known to have the blob (a
    /// shepherd that announced it, say) while the DHT is asked for more.
    pub async fn fetch_from(
        &self,
        hash: BlobHash,
        providers: Vec<PeerId>,
        timeout: Duration,
    ) -> Result<FetchReport, FetchError> {
        self.ask(|reply| Command::Fetch { hash, hint: providers, timeout, reply }).await?
    }

    /// Subscribes to a run's gossip topic.
    pub async fn subscribe(&self, run: RunId) -> Result<(), GossipError> {
        self.ask(|reply| Command::Subscribe { run, reply }).await?
    }

    /// Publishes an encoded signed envelope on a run's topic.
    pub async fn publish(&self, run: RunId, data: Vec<u8>) -> Result<(), GossipError> {
        self.ask(|reply| Command::Publish { run, data, reply }).await?
    }

    /// Peers that announced `key` in the DHT (at most `max`; empty if none answered
    /// before the query ended).
    pub async fn providers(&self, key: BlobHash, max: usize) -> Result<Vec<PeerId>, Stopped> {
        self.ask(|reply| Command::Providers { key, max, reply }).await
    }

    /// Finds `peer`'s addresses through the DHT (the peers it asks know them when it
    /// is a DHT server), so that a request can dial it; `true` when it is connected
    /// or its addresses were found.
    pub async fn find_peer(&self, peer: PeerId) -> Result<bool, Stopped> {
        self.ask(|reply| Command::FindPeer { peer, reply }).await
    }

    /// Sends a signed request to `peer` and returns its verified, signed answer.
    pub async fn request(
        &self,
        peer: PeerId,
        envelope: pcp_schema::SignedEnvelope,
    ) -> Result<pcp_protocol::Verified, RequestError> {
        self.ask(|reply| Command::Request { peer, envelope, reply }).await?
    }

    /// Answers an inbound request (see [`Event::Request`]); an unknown or expired id
    /// is ignored. Waits only for room in the node's command queue: the answer goes
    /// out in turn with the commands before it.
    pub async fn respond(&self, id: InboundId, envelope: pcp_schema::SignedEnvelope) -> Result<(), Stopped> {
        self.commands.send(Command::Respond { id, envelope }).await.map_err(|_| Stopped)
    }

    /// Leaves an inbound request unanswered, at once: its stream resets, so the
    /// requester learns now, not at its timeout, that no answer comes (a role too
    /// busy to take the request). Its queue has room for every request that can be
    /// waiting; `false` only once the node has stopped.
    pub fn leave_unanswered(&self, id: InboundId) -> bool {
        self.unanswered.try_send(id).is_ok()
    }

    /// Counters.
    pub async fn stats(&self) -> Result<Stats, Stopped> {
        self.ask(Command::Stats).await
    }
}
