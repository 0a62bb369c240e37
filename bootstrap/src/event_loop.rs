//! The swarm's event loop: one task owns the swarm and serves the [`crate::Node`]
//! handle's [`Command`]s. It turns swarm events into calls on the state it owns and
//! performs what that state asks for: blob transfer is [`Transfers`] (downloads,
//! answers to peers, releases), NAT traversal is [`Nat`] (see `traversal`), and the
//! DHT, gossip and signed requests are handled here.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures::StreamExt;
use libp2p::core::transport::ListenerId;
use libp2p::multiaddr::Protocol;
use libp2p::request_response::{self, InboundRequestId, OutboundRequestId, ResponseChannel};
use libp2p::swarm::{ConnectionId, SwarmEvent, dial_opts::DialOpts};
use libp2p::{Multiaddr, PeerId, Swarm, gossipsub, identify, kad, noise, tcp};
use pcp_protocol::{BlobHash, Identity, PublicKey, RunId};
use pcp_schema::BlobRequest;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::admission::Admission;
use crate::behaviour::{Behaviour, BehaviourEvent, KAD_PROTOCOL};
use crate::blocking::Blocking;
use crate::codec::BlobReply;
use crate::command::Command;
use crate::config::Config;
use crate::error::{DialError, GossipError, RequestError, StartError};
use crate::events::{Event, Reachability, Stats};
use crate::identity_file::keypair;
use crate::ids::InboundId;
use crate::mux;
use crate::nat::Nat;
use crate::rpc::Frame;
use crate::seeds::{Backoff, check_port_free, dial_reason, transport_reason};
use crate::store::BlobStore;
use crate::tls;
use crate::transfers::{Action, Done, Serve, Served, Transfers};

mod dht;
mod outbox;
mod replay;
mod traversal;

use replay::Replay;

/// Where a request's answer goes.
type Reply = oneshot::Sender<Result<pcp_protocol::Verified, RequestError>>;

/// How often the store is rescanned for blobs to provide.
const RESCAN: Duration = Duration::from_secs(5);
/// Most blocking threads hashing, reading and writing chunks at once.
const BLOB_WORKERS: usize = 4;
/// Blob jobs waiting for a thread; beyond this they run on the event loop itself.
const BLOB_QUEUE: usize = 256;
/// Inbound DiLoCo requests waiting for their answer, contributions aside (the run's
/// budget of contributions in flight bounds those: see [`crate::Hold`]). A shepherd of
/// a thousand workers has two thousand heartbeats a second to answer.
pub(crate) const MAX_RPC_INBOUND: usize = 4096;
/// A connection's transport handshake (TCP: security and multiplexer; QUIC: TLS) must
/// finish within this long: a silent socket holds a pending slot no longer.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(4);
/// Refused inbound requests are logged once per peer per interval, with a count.
const DROP_LOG_INTERVAL: Duration = Duration::from_secs(10);

/// Outbound DiLoCo requests in flight.
const MAX_RPC_OUTBOUND: usize = 256;
/// An inbound request not answered within this long is dropped.
const RPC_ANSWER_TIMEOUT: Duration = crate::rpc::RPC_TIMEOUT;
/// Provider lookups in flight.
const MAX_LOOKUPS: usize = 64;

/// Blob work done on a blocking thread.
enum Work {
    /// A download's (see [`Transfers`]).
    Transfer(Done),
    /// A chunk read for a peer, and where its answer goes.
    Read(Served, ResponseChannel<BlobReply>),
}

/// A provider lookup for [`Command::Providers`], or a peer's for [`Command::FindPeer`].
#[derive(Debug)]
struct Lookup {
    found: Vec<PeerId>,
    max: usize,
    reply: LookupReply,
}

/// Where a lookup's result goes.
#[derive(Debug)]
enum LookupReply {
    /// The providers found.
    Providers(oneshot::Sender<Vec<PeerId>>),
    /// Whether the peer's addresses were found (and are now dialable).
    Peer(PeerId, oneshot::Sender<bool>),
}

/// Owns the swarm. Run it with [`EventLoop::run`].
#[allow(missing_debug_implementations)]
pub struct EventLoop {
    swarm: Swarm<Behaviour>,
    config: Config,
    commands: mpsc::Receiver<Command>,
    /// Requests the node's user left unanswered ([`Node::leave_unanswered`]): a queue
    /// of their own, twice [`MAX_RPC_INBOUND`], so that one is never refused (a
    /// refused one would hold its place among those waiting for answers until its
    /// timeout, and a shepherd busy closing a round drops hundreds of heartbeats a
    /// second: they would fill the table and crowd out the contributions).
    unanswered: mpsc::Receiver<InboundId>,
    events: mpsc::Sender<Event>,
    seeds: Vec<(Option<PeerId>, Multiaddr)>,
    /// When to retry each seed (same order as `seeds`).
    seed_retry: Vec<Backoff>,
    /// Seed dials in flight: the index of the seed.
    seed_dials: HashMap<ConnectionId, usize>,
    /// Downloads, answers to peers' blob requests, and releases (see [`Transfers`]).
    transfers: Transfers<OutboundRequestId, InboundRequestId>,
    /// Provider queries for downloads.
    provider_queries: HashMap<kad::QueryId, BlobHash>,
    provide_replies: HashMap<kad::QueryId, oneshot::Sender<()>>,
    provided: HashSet<BlobHash>,
    banned: HashMap<PeerId, Instant>,
    work: Blocking<Work>,
    subscriptions: HashSet<RunId>,
    replay: Replay,
    lookups: HashMap<kad::QueryId, Lookup>,
    /// Requests in flight: to whom, for which run (its answer must be bound to it).
    /// Outbound DiLoCo requests in flight, and those waiting their turn.
    outbox: outbox::Outbox,
    /// Requests waiting for the owner's answer: the channel, when it came, from whom.
    rpc_in: HashMap<InboundId, (ResponseChannel<Frame>, Instant, PeerId)>,
    /// NAT traversal: relayed connections, hole punches, relays, reachability.
    nat: Nat,
    /// Listeners on relays (reservations), by their relay address.
    relay_listeners: HashMap<ListenerId, Multiaddr>,
    /// Whether the relay service takes reservations and circuits now.
    relay_open: Arc<std::sync::atomic::AtomicBool>,
    next_inbound: u64,
    reachability: Reachability,
    stats: Stats,
    last_rebootstrap: Instant,
    last_recovery: Instant,
    /// Inbound requests refused and not yet logged, per peer: count, last reason.
    refused: HashMap<PeerId, (u64, String)>,
    /// When each peer's refusals were last logged.
    refusals_logged: HashMap<PeerId, Instant>,
    /// Refused requests from no known sender (more refusing peers than the codec counts
    /// one by one), and when they were last logged.
    unverified_refusals: (u64, String),
    unverified_logged: Option<Instant>,
    admission: Arc<Admission>,
    last_rescan: Option<Instant>,
}

/// Blocking threads for blob work: one per core, at least 2 (one may wait on the disk while
/// the other hashes), at most [`BLOB_WORKERS`]. More than the cores only adds switching.
fn blob_workers() -> usize {
    std::thread::available_parallelism().map_or(2, |n| n.get().clamp(2, BLOB_WORKERS))
}

fn topic(run: RunId) -> gossipsub::IdentTopic {
    gossipsub::IdentTopic::new(format!("pcp/run/{}", run.to_hex()))
}

fn kad_key(hash: &BlobHash) -> kad::RecordKey {
    kad::RecordKey::new(hash.as_bytes())
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// Whether an address is a QUIC address (preferred over TCP).
fn is_quic(addr: &Multiaddr) -> bool {
    addr.iter().any(|p| matches!(p, Protocol::QuicV1))
}

/// Splits a trailing `/p2p/<id>` off an address.
fn split_peer(addr: &Multiaddr) -> (Option<PeerId>, Multiaddr) {
    let mut base = addr.clone();
    match base.pop() {
        Some(Protocol::P2p(peer)) => (Some(peer), base),
        _ => (None, addr.clone()),
    }
}

impl EventLoop {
    pub(crate) fn new(
        identity: &Identity,
        config: Config,
        (commands, unanswered): (mpsc::Receiver<Command>, mpsc::Receiver<InboundId>),
        events: mpsc::Sender<Event>,
        admission: Arc<Admission>,
    ) -> Result<Self, StartError> {
        let store = BlobStore::open(&config.data_dir)?.with_max_size(config.max_blob_size);
        let key = keypair(identity);
        let behaviour_config = config.clone();
        let tcp_tls = config.tcp_tls;
        let relay_open = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let gate = relay_open.clone();
        let mut swarm = libp2p::SwarmBuilder::with_existing_identity(key)
            .with_tokio()
            .with_tcp(
                tcp::Config::default().nodelay(true),
                (move |key: &libp2p::identity::Keypair| tls::Config::new(key, tcp_tls), noise::Config::new),
                mux::Config::default,
            )
            .map_err(|e| StartError::Swarm(format!("tcp transport: {e}")))?
            .with_quic()
            // relayed connections are secured and multiplexed as TCP ones are
            .with_relay_client(
                (move |key: &libp2p::identity::Keypair| tls::Config::new(key, tcp_tls), noise::Config::new),
                mux::Config::default,
            )
            .map_err(|e| StartError::Swarm(format!("relay client transport: {e}")))?
            .with_behaviour(|key, relay_client| {
                Behaviour::new(key, &behaviour_config, admission.clone(), relay_client, gate)
            })
            .map_err(|e| StartError::Swarm(format!("behaviour: {e}")))?
            .with_swarm_config(|c| c.with_idle_connection_timeout(config.idle_timeout))
            .with_connection_timeout(HANDSHAKE_TIMEOUT)
            .build();
        // every port is checked before the first listener takes one of them
        for addr in &config.listen {
            check_port_free(addr)
                .map_err(|e| StartError::Listen { addr: addr.clone(), reason: crate::seeds::cause_of(&e) })?;
        }
        for addr in &config.listen {
            swarm
                .listen_on(addr.clone())
                .map_err(|e| StartError::Listen { addr: addr.clone(), reason: transport_reason(&e) })?;
        }
        let mut seeds: Vec<_> = config.bootstrap.iter().map(split_peer).collect();
        seeds.sort_by_key(|(_, a)| !is_quic(a));
        let now = Instant::now();
        Ok(Self {
            swarm,
            commands,
            unanswered,
            events,
            transfers: Transfers::new(store, config.transfer_linger, config.chunk_window),
            seed_retry: vec![Backoff::default(); seeds.len()],
            seed_dials: HashMap::new(),
            seeds,
            provider_queries: HashMap::new(),
            provide_replies: HashMap::new(),
            provided: HashSet::new(),
            banned: HashMap::new(),
            work: Blocking::new(blob_workers(), BLOB_QUEUE),
            subscriptions: HashSet::new(),
            replay: Replay::new(admission.clone()),
            lookups: HashMap::new(),
            outbox: outbox::Outbox::default(),
            rpc_in: HashMap::new(),
            nat: Nat::new(config.nat.clone(), config.bootstrap.is_empty()),
            relay_listeners: HashMap::new(),
            relay_open,
            next_inbound: 0,
            reachability: Reachability::Unknown,
            stats: Stats::default(),
            last_rebootstrap: now,
            refused: HashMap::new(),
            refusals_logged: HashMap::new(),
            unverified_refusals: (0, String::new()),
            unverified_logged: None,
            admission,
            last_recovery: now,
            last_rescan: None,
            config,
        })
    }

    pub(crate) fn peer_id(&self) -> PeerId {
        *self.swarm.local_peer_id()
    }

    /// Runs until `cancel` fires or every handle is dropped.
    pub async fn run(mut self, cancel: CancellationToken) {
        for addr in self.config.nat.external_addresses.clone() {
            self.declare_external(addr, "declared (--external-address)");
        }
        self.dial_seeds(false);
        self.listen_on_relays();
        self.update_reachability();
        let mut tick = tokio::time::interval(Duration::from_millis(500));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = cancel.cancelled() => break,
                event = self.swarm.select_next_some() => self.on_swarm(event),
                Some(work) = self.work.next(), if !self.work.is_idle() => {
                    self.worked(work);
                    self.poll_transfers();
                }
                command = self.commands.recv() => match command {
                    Some(c) => self.on_command(c),
                    None => break,
                },
                // the channel dropped: the requester's stream resets
                Some(id) = self.unanswered.recv() => {
                    self.rpc_in.remove(&id);
                }
                _ = tick.tick() => self.housekeeping(),
            }
        }
        // no transfer outlives the loop: what waited for one goes now
        self.transfers.stop(Instant::now());
    }

    fn emit(&mut self, event: Event) -> bool {
        let sent = self.events.try_send(event).is_ok();
        if !sent {
            self.stats.events_dropped += 1;
        }
        sent
    }

    /// Dials the seeds that are not connected, not being dialled and not waiting out a
    /// backoff; with `only_due`, only those whose backoff just ended.
    fn dial_seeds(&mut self, only_due: bool) {
        let local = self.peer_id();
        let now = Instant::now();
        for (index, (peer, addr)) in self.seeds.clone().into_iter().enumerate() {
            let retry = self.seed_retry[index];
            if peer == Some(local)
                || !retry.ready(now)
                || (only_due && !retry.due(now))
                || self.seed_dials.values().any(|i| *i == index)
            {
                continue;
            }
            if let Some(peer) = peer {
                if self.swarm.is_connected(&peer) {
                    continue;
                }
                self.swarm.behaviour_mut().kad.add_address(&peer, addr.clone());
            }
            let opts = match peer {
                Some(peer) => DialOpts::peer_id(peer).addresses(vec![addr.clone()]).build(),
                None => DialOpts::unknown_peer_id().address(addr.clone()).build(),
            };
            let id = opts.connection_id();
            match self.swarm.dial(opts) {
                Ok(()) => {
                    self.seed_dials.insert(id, index);
                }
                Err(e) => self.seed_failed(index, &e),
            }
        }
    }

    /// One line and one `message_rejected` event per peer whose requests were refused,
    /// with the count: at once for the first, then at most once per [`DROP_LOG_INTERVAL`].
    fn log_refusals(&mut self, now: Instant) {
        // what the codec refused (see `Admission::refused`)
        for (peer, count, reason) in self.admission.take_refusals() {
            self.stats.messages_rejected += count;
            match peer {
                Some(peer) => {
                    let entry = self.refused.entry(peer).or_default();
                    entry.0 += count;
                    entry.1 = reason;
                }
                None => {
                    self.unverified_refusals.0 += count;
                    self.unverified_refusals.1 = reason;
                }
            }
        }
        if self.unverified_refusals.0 > 0
            && self.unverified_logged.is_none_or(|t| now.duration_since(t) >= DROP_LOG_INTERVAL)
        {
            let (count, reason) = std::mem::take(&mut self.unverified_refusals);
            tracing::warn!("{count} requests from unknown peers refused; the last: {reason}");
            self.unverified_logged = Some(now);
        }
        self.refusals_logged.retain(|_, at| now.duration_since(*at) < DROP_LOG_INTERVAL);
        let due: Vec<PeerId> = self.refused.keys().filter(|p| !self.refusals_logged.contains_key(p)).copied().collect();
        for peer in due {
            let Some((count, reason)) = self.refused.remove(&peer) else { continue };
            self.refusals_logged.insert(peer, now);
            let what = if count == 1 { "request".to_owned() } else { format!("{count} requests") };
            tracing::warn!(%peer, "{what} refused: {reason}");
            self.emit(Event::MessageRejected { peer, reason: format!("{what} refused: {reason}") });
        }
    }

    /// A seed could not be reached: says why, and when it will be tried again.
    fn seed_failed(&mut self, index: usize, error: &libp2p::swarm::DialError) {
        let Some(reason) = dial_reason(error) else {
            tracing::debug!(seed = %self.seeds[index].1, "seed dial: {error}");
            return;
        };
        let retry_in = self.seed_retry[index].failed(Instant::now(), self.config.recovery_interval);
        let (peer, base) = &self.seeds[index];
        let addr = match peer {
            Some(peer) => base.clone().with(Protocol::P2p(*peer)),
            None => base.clone(),
        };
        tracing::warn!("bootstrap {addr}: {reason}; retrying in {} s", retry_in.as_secs());
        self.emit(Event::BootstrapFailed { addr, reason, retry_in });
    }

    fn housekeeping(&mut self) {
        let now = Instant::now();
        let expired: Vec<PeerId> = self.banned.iter().filter(|(_, until)| **until <= now).map(|(p, _)| *p).collect();
        for peer in expired {
            self.banned.remove(&peer);
            self.swarm.behaviour_mut().blocked.unblock_peer(peer);
        }
        if !self.seeds.is_empty() {
            let alone = self.swarm.connected_peers().next().is_none();
            if alone && now.duration_since(self.last_recovery) >= self.config.recovery_interval {
                // every seed is unreachable: keep trying them until one answers
                self.last_recovery = now;
                self.dial_seeds(false);
            }
            // seeds that failed are retried when their backoff ends, peers or not
            self.dial_seeds(true);
            if now.duration_since(self.last_rebootstrap) >= self.config.rebootstrap_interval {
                self.last_rebootstrap = now;
                self.dial_seeds(false);
                let _ = self.swarm.behaviour_mut().kad.bootstrap();
            }
        }
        if self.last_rescan.is_none_or(|t| now.duration_since(t) >= RESCAN) {
            self.last_rescan = Some(now);
            self.provide_store();
        }
        self.replay.prune(now_ms());
        self.log_refusals(now);
        // requests the owner never answered: dropping the channel resets the stream
        self.rpc_in.retain(|_, (_, since, _)| now.duration_since(*since) < RPC_ANSWER_TIMEOUT);
        self.nat_housekeeping(now);
        self.transfers.housekeeping(now);
        self.poll_transfers();
    }

    fn on_command(&mut self, command: Command) {
        match command {
            Command::ListenAddrs(reply) => {
                let _ = reply.send(self.swarm.listeners().cloned().collect());
            }
            Command::ExternalAddrs(reply) => {
                let _ = reply.send(self.swarm.external_addresses().cloned().collect());
            }
            Command::Reachability(reply) => {
                let _ = reply.send(self.reachability.clone());
            }
            Command::NetStatus(reply) => {
                let _ = reply.send(self.net_status());
            }
            Command::Dial { addr, reply } => {
                let result = self.swarm.dial(addr.clone()).map_err(|e| DialError::Dial { addr, reason: e.to_string() });
                let _ = reply.send(result);
            }
            Command::RoutingPeers(reply) => {
                let mut peers = Vec::new();
                for bucket in self.swarm.behaviour_mut().kad.kbuckets() {
                    peers.extend(bucket.iter().map(|e| *e.node.key.preimage()));
                }
                let _ = reply.send(peers);
            }
            Command::ConnectedPeers(reply) => {
                let _ = reply.send(self.swarm.connected_peers().copied().collect());
            }
            Command::Provide { hash, reply } => self.provide(hash, Some(reply)),
            Command::Fetch { hash, hint, timeout, reply } => {
                let local = self.peer_id();
                let hint = hint.into_iter().filter(|p| *p != local && !self.banned.contains_key(p));
                self.transfers.fetch(hash, hint, timeout, reply, Instant::now());
                self.poll_transfers();
            }
            Command::Subscribe { run, reply } => {
                let result = self
                    .swarm
                    .behaviour_mut()
                    .gossipsub
                    .subscribe(&topic(run))
                    .map(|_| ())
                    .map_err(|e| GossipError::Refused { run, reason: e.to_string() });
                if result.is_ok() {
                    self.subscriptions.insert(run);
                }
                let _ = reply.send(result);
            }
            Command::Publish { run, data, reply } => {
                let result = self
                    .swarm
                    .behaviour_mut()
                    .gossipsub
                    .publish(topic(run), data)
                    .map(|_| ())
                    .map_err(|e| GossipError::Refused { run, reason: e.to_string() });
                let _ = reply.send(result);
            }
            Command::Stats(reply) => {
                let mut stats = self.stats;
                self.transfers.count(&mut stats);
                let _ = reply.send(stats);
            }
            Command::Providers { key, max, reply } => {
                if self.lookups.len() >= MAX_LOOKUPS {
                    let _ = reply.send(Vec::new());
                    return;
                }
                let id = self.swarm.behaviour_mut().kad.get_providers(kad_key(&key));
                let reply = LookupReply::Providers(reply);
                self.lookups.insert(id, Lookup { found: Vec::new(), max: max.max(1), reply });
            }
            Command::FindPeer { peer, reply } => {
                if self.swarm.is_connected(&peer) {
                    let _ = reply.send(true);
                    return;
                }
                if self.lookups.len() >= MAX_LOOKUPS {
                    let _ = reply.send(false);
                    return;
                }
                let id = self.swarm.behaviour_mut().kad.get_closest_peers(peer);
                let reply = LookupReply::Peer(peer, reply);
                self.lookups.insert(id, Lookup { found: Vec::new(), max: 1, reply });
            }
            Command::Request { peer, envelope, reply } => {
                if self.outbox.sent.len() >= MAX_RPC_OUTBOUND {
                    let _ = reply.send(Err(RequestError::Busy { peer, max: MAX_RPC_OUTBOUND }));
                    return;
                }
                if self.outbox.may_send(peer) {
                    self.send_rpc(peer, envelope, reply);
                } else if let Err(reply) = self.outbox.wait(peer, (envelope, reply)) {
                    let _ = reply.send(Err(RequestError::Busy { peer, max: outbox::MAX_QUEUED }));
                }
            }
            Command::Release { hashes, reply } => {
                let released = self.transfers.release(hashes, Instant::now());
                self.poll_transfers();
                let _ = reply.send(released);
            }
            Command::Respond { id, envelope } => {
                if let Some((channel, _, _)) = self.rpc_in.remove(&id)
                    && self.swarm.behaviour_mut().rpc.send_response(channel, envelope).is_err()
                {
                    tracing::debug!(%id, "answer dropped: the requester is gone");
                }
            }
        }
    }

    fn on_swarm(&mut self, event: SwarmEvent<BehaviourEvent>) {
        match event {
            SwarmEvent::NewListenAddr { address, .. } => {
                self.nat.listening(&address);
                self.emit(Event::Listening { addr: address.clone() });
                if crate::nat::listens_publicly(&address, &self.config.listen) {
                    self.declare_external(address, "listening on a public IP address");
                }
            }
            SwarmEvent::ConnectionEstablished { peer_id, connection_id, endpoint, num_established, .. } => {
                self.nat_connected(peer_id, connection_id, &endpoint);
                if let Some(index) = self.seed_dials.remove(&connection_id) {
                    self.seed_retry[index].reset();
                }
                for (index, (peer, _)) in self.seeds.iter().enumerate() {
                    if *peer == Some(peer_id) {
                        self.seed_retry[index].reset();
                    }
                }
                let addr = endpoint.get_remote_address().clone();
                tracing::debug!(%peer_id, %addr, "connected");
                if num_established.get() == 1 {
                    // extra connections (AutoNAT dial-backs) are not new peers
                    self.transfers.connected(&peer_id);
                    self.emit(Event::PeerConnected { peer: peer_id, addr });
                }
                if self.seeds.iter().any(|(p, _)| *p == Some(peer_id)) {
                    let _ = self.swarm.behaviour_mut().kad.bootstrap();
                }
            }
            SwarmEvent::OutgoingConnectionError { connection_id, error, .. } => {
                if let Some(index) = self.seed_dials.remove(&connection_id) {
                    self.seed_failed(index, &error);
                }
            }
            SwarmEvent::ExternalAddrConfirmed { address } => {
                if self.nat.confirmed(&address) {
                    tracing::info!(%address, "external address confirmed");
                    self.update_reachability();
                } else {
                    tracing::debug!(%address, "not a relay address of ours: dropped");
                    self.swarm.remove_external_address(&address);
                }
            }
            SwarmEvent::ExternalAddrExpired { address } => {
                tracing::info!(%address, "external address expired");
                self.nat.expired(&address);
                self.update_reachability();
            }
            SwarmEvent::ConnectionClosed { connection_id, .. } => {
                self.nat.disconnected(connection_id);
            }
            SwarmEvent::ListenerClosed { listener_id, reason, .. } => self.listener_closed(listener_id, reason),
            SwarmEvent::Behaviour(event) => self.on_behaviour(event),
            _ => {}
        }
    }

    fn on_behaviour(&mut self, event: BehaviourEvent) {
        match event {
            BehaviourEvent::Identify(identify::Event::Received { peer_id, connection_id, info })
                if info.protocols.contains(&KAD_PROTOCOL) =>
            {
                self.nat_identified(peer_id, connection_id, &info);
                // a DHT server: route to it at the addresses it listens on, QUIC first
                let mut addrs = info.listen_addrs;
                addrs.sort_by_key(|a| !is_quic(a));
                for addr in addrs {
                    if !addr.iter().any(|p| match p {
                        Protocol::Ip4(ip) => ip.is_unspecified(),
                        Protocol::Ip6(ip) => ip.is_unspecified(),
                        _ => false,
                    }) {
                        self.swarm.behaviour_mut().kad.add_address(&peer_id, addr);
                    }
                }
            }
            BehaviourEvent::Kad(event) => self.on_kad(event),
            BehaviourEvent::Gossipsub(gossipsub::Event::Message { propagation_source, message_id, message }) => {
                self.on_gossip(propagation_source, message_id, message)
            }
            BehaviourEvent::Identify(identify::Event::Received { peer_id, connection_id, info }) => {
                self.nat_identified(peer_id, connection_id, &info);
            }
            BehaviourEvent::AutonatClient(event) => self.on_autonat_v2(event),
            BehaviourEvent::RelayClient(event) => self.on_relay_client(event),
            BehaviourEvent::Relay(event) => self.on_relay_service(event),
            BehaviourEvent::Dcutr(event) => self.on_hole_punch(event),
            BehaviourEvent::Upnp(event) => self.on_upnp(event),
            BehaviourEvent::Blob(event) => self.on_blob(event),
            BehaviourEvent::Rpc(event) => self.on_rpc(event),
            _ => {}
        }
    }

    /// Sends a DiLoCo request to `peer` (its turn came: see [`outbox`]).
    fn send_rpc(&mut self, peer: PeerId, envelope: pcp_schema::SignedEnvelope, reply: Reply) {
        let run = RunId(envelope.header.run);
        let id = self.swarm.behaviour_mut().rpc.send_request(&peer, envelope);
        self.outbox.sent.insert(id, (peer, run, reply));
    }

    /// A request to `peer` ended: the next waiting for it goes.
    fn next_rpc(&mut self, peer: PeerId) {
        if let Some((envelope, reply)) = self.outbox.done(peer) {
            self.send_rpc(peer, envelope, reply);
        }
    }

    fn on_rpc(&mut self, event: request_response::Event<Frame, Frame>) {
        match event {
            request_response::Event::Message { peer, message, .. } => match message {
                request_response::Message::Request { request, channel, .. } => {
                    // the codec verified it, and that `peer` signed it (see `crate::rpc`)
                    let verdict = match request {
                        Frame::Request(v, hold) => {
                            let run = v.binding().run;
                            let fresh = self.replay.check(&v, run, now_ms());
                            fresh.map(|()| (v, hold)).map_err(|e| e.to_string())
                        }
                        Frame::In(_) => Err("an answer where a request belongs".to_owned()),
                        Frame::Refused(reason) => Err(reason),
                        Frame::Out(_) => Err("an unverified request".to_owned()),
                    };
                    match verdict {
                        // a contribution read in full is never dropped here: its hold bounds them
                        Ok((verified, hold)) if self.rpc_in.len() < MAX_RPC_INBOUND || hold.is_some() => {
                            let id = InboundId(self.next_inbound);
                            self.next_inbound += 1;
                            self.rpc_in.insert(id, (channel, Instant::now(), peer));
                            if !self.emit(Event::Request { peer, id, message: Box::new(verified), hold }) {
                                self.rpc_in.remove(&id);
                            }
                        }
                        Ok(_) => tracing::debug!(%peer, "request dropped: {MAX_RPC_INBOUND} waiting for answers"),
                        Err(reason) => {
                            self.stats.messages_rejected += 1;
                            tracing::debug!(%peer, "rejected request: {reason}");
                            self.emit(Event::MessageRejected { peer, reason });
                        }
                    }
                }
                request_response::Message::Response { request_id, response } => {
                    if let Some((peer, run, reply)) = self.outbox.sent.remove(&request_id) {
                        self.next_rpc(peer);
                        let result = match response {
                            Frame::In(verified) => self
                                .replay
                                .fresh(&verified, run, now_ms())
                                .map(|()| verified)
                                .map_err(|e| e.to_string()),
                            Frame::Refused(reason) => Err(reason),
                            Frame::Request(..) => Err("a request where an answer belongs".to_owned()),
                            Frame::Out(_) => Err("an unverified answer".to_owned()),
                        }
                        .map_err(|reason| {
                            self.stats.messages_rejected += 1;
                            RequestError::Rejected { peer, reason }
                        });
                        if let Err(RequestError::Rejected { reason, .. }) = &result {
                            self.emit(Event::MessageRejected { peer, reason: reason.clone() });
                        }
                        let _ = reply.send(result);
                    }
                }
            },
            request_response::Event::OutboundFailure { request_id, error, peer, .. } => {
                if let Some((_, _, reply)) = self.outbox.sent.remove(&request_id) {
                    self.next_rpc(peer);
                    let _ = reply.send(Err(RequestError::Failed { peer, reason: error.to_string() }));
                }
            }
            request_response::Event::InboundFailure { peer, error, .. } => {
                tracing::debug!(%peer, "inbound request failed: {error}");
            }
            request_response::Event::ResponseSent { .. } => {}
        }
    }

    fn on_gossip(&mut self, source: PeerId, id: gossipsub::MessageId, message: gossipsub::Message) {
        use pcp_schema::Message as _;
        let run = self.subscriptions.iter().copied().find(|r| topic(*r).hash() == message.topic);
        let verdict = match run {
            None => Err(Some("message for a run this node is not in".to_string())),
            Some(run) => match pcp_schema::SignedEnvelope::decode(&message.data) {
                Err(e) => Err(Some(e.to_string())),
                // only the run's candidates gossip: anyone else's is refused unverified
                Ok(envelope) => {
                    self.replay.gate_gossip(run, PublicKey(envelope.header.signer), Instant::now()).and_then(|()| {
                        let verified = pcp_protocol::verify(envelope).map_err(|e| Some(e.to_string()))?;
                        self.replay.check(&verified, run, now_ms()).map_err(|e| Some(e.to_string()))?;
                        Ok((run, verified))
                    })
                }
            },
        };
        let acceptance = match verdict {
            Ok((run, verified)) => {
                self.emit(Event::Gossip { run, from: source, message: Box::new(verified) });
                gossipsub::MessageAcceptance::Accept
            }
            Err(reason) => {
                self.stats.messages_rejected += 1;
                if let Some(reason) = reason {
                    tracing::debug!(peer = %source, "rejected gossip: {reason}");
                    self.emit(Event::MessageRejected { peer: source, reason });
                }
                gossipsub::MessageAcceptance::Reject
            }
        };
        self.swarm.behaviour_mut().gossipsub.report_message_validation_result(&id, &source, acceptance);
    }

    // ---- blob transfer (the state is in `Transfers`) ------------------------------

    /// Performs what [`Transfers`] asks for until it asks nothing more.
    fn poll_transfers(&mut self) {
        if !self.transfers.has_work() {
            return;
        }
        let now = Instant::now();
        let held = self.nat.held_peers(now);
        while let Some(action) = self.transfers.poll(now, &held) {
            self.perform(action);
        }
    }

    fn perform(&mut self, action: Action) {
        match action {
            Action::Request(request) => {
                let message = BlobRequest { blob: request.hash.0, want: request.want };
                let id = self.swarm.behaviour_mut().blob.send_request(&request.peer, message);
                self.transfers.sent(id, request);
            }
            Action::FindProviders(hash) => {
                let id = self.swarm.behaviour_mut().kad.get_providers(kad_key(&hash));
                self.provider_queries.insert(id, hash);
            }
            Action::Provide(hash) => self.provide(hash, None),
            Action::Unprovide(hash) => {
                if self.provided.remove(&hash) {
                    self.swarm.behaviour_mut().kad.stop_providing(&kad_key(&hash));
                }
            }
            Action::Ban { peer, reason } => self.ban(peer, reason),
            Action::Emit(event) => {
                self.emit(event);
            }
            Action::Reply { waiters, result } => {
                for w in waiters {
                    let _ = w.send(result.clone());
                }
            }
            Action::Run(job) => self.run_blocking(move || Work::Transfer(job.run())),
        }
    }

    /// Runs `job` on a blocking thread, or here when too many wait already.
    fn run_blocking(&mut self, job: impl FnOnce() -> Work + Send + 'static) {
        if let Err(job) = self.work.submit(job) {
            self.worked(job());
        }
    }

    /// Blob work finished on a blocking thread.
    fn worked(&mut self, work: Work) {
        match work {
            Work::Transfer(done) => self.transfers.done(done, Instant::now()),
            Work::Read(read, channel) => {
                let peer = read.peer;
                let reply = self.transfers.served(read);
                self.respond(peer, channel, reply);
            }
        }
    }

    fn ban(&mut self, peer: PeerId, reason: String) {
        if self.banned.contains_key(&peer) {
            // a response that was already in flight when the peer was banned
            return;
        }
        tracing::warn!(%peer, "banning: {reason}");
        self.stats.peers_banned += 1;
        self.banned.insert(peer, Instant::now() + self.config.ban_duration);
        self.swarm.behaviour_mut().blocked.block_peer(peer);
        self.swarm.behaviour_mut().kad.remove_peer(&peer);
        self.emit(Event::MessageRejected { peer, reason });
    }

    fn on_blob(&mut self, event: request_response::Event<BlobRequest, BlobReply>) {
        match event {
            request_response::Event::Message { peer, message, connection_id } => match message {
                request_response::Message::Request { request, channel, request_id } => {
                    match self.transfers.serve(peer, request_id, request, Instant::now()) {
                        Serve::Now(reply) => self.respond(peer, channel, reply),
                        Serve::Read(read) => self.run_blocking(move || Work::Read(read.run(), channel)),
                    }
                }
                request_response::Message::Response { request_id, response } => {
                    let relayed = self.nat.is_relayed_conn(connection_id);
                    self.transfers.answered(request_id, response, relayed, Instant::now());
                }
            },
            request_response::Event::ResponseSent { request_id, .. } => {
                self.transfers.responded(request_id, Instant::now());
            }
            request_response::Event::InboundFailure { request_id, peer, error, .. } => {
                tracing::debug!(%peer, "blob request not answered: {error}");
                self.transfers.responded(request_id, Instant::now());
            }
            request_response::Event::OutboundFailure { request_id, error, peer, connection_id } => {
                // a relayed connection closed for a direct one: ask again, no strike (its
                // streams end with "connection closed", or an IO error when cut mid-way)
                let replaced = match error {
                    request_response::OutboundFailure::ConnectionClosed => self.swarm.is_connected(&peer),
                    request_response::OutboundFailure::Io(_) => self.nat.replaced_by_direct(&peer, connection_id),
                    _ => false,
                };
                self.transfers.failed(request_id, replaced, &error);
            }
        }
        self.poll_transfers();
    }

    fn respond(&mut self, peer: PeerId, channel: ResponseChannel<BlobReply>, response: BlobReply) {
        if self.swarm.behaviour_mut().blob.send_response(channel, response).is_err() {
            tracing::debug!(%peer, "blob response dropped: connection closed");
        }
    }
}
