//! What a node agrees to read, and from whom, before it reads it.
//!
//! A DiLoCo request arrives as a signed [`FrameHead`] (at most
//! [`pcp_schema::MAX_FRAME_HEAD`] bytes) and then its payload. The codec reads it on the
//! connection's own task, where it knows the [`Remote`]: the peer the transport
//! authenticated and its IP address (see [`crate::rpc`] for how). It verifies the head's
//! signature and asks [`Admission`] for a [`Permit`] before reading a byte of the payload:
//!
//! - the head's signer must be the connection's peer. A head captured from one peer and
//!   sent by another is refused unread, and takes nothing of its signer's allowance;
//! - a contribution is read only for the **open round** of a run this node serves, from
//!   a **participant** of that round (the shepherd names them when it opens the round:
//!   [`Admission::open_round`]), and only up to the run's encoded contribution size
//!   ([`Admission::serve`]; a sparse run's is about 100 times smaller than a dense one's).
//!   Each participant gets [`CONTRIBUTIONS_PER_ROUND`] permits per round, one at a time:
//!   its contribution and one retry, for a stream that broke before its answer. All
//!   contributions in flight together hold at most [`contribution_budget`] bytes, and a
//!   retry is refused rather than taken out of the room kept for the participants that
//!   have not sent their first yet. A hello or a heartbeat gives no contribution permit;
//! - any other request carries at most [`SMALL_FRAME`] bytes. Participants of an open
//!   round read theirs without limit (the streams per connection bound them). Anyone
//!   else pays its payload plus [`FRAME_COST`] from three allowances at once:
//!   [`SIGNER_BUDGET`] per signer, and per pool [`ADDRESS_BUDGET`] per IP address (an
//!   IPv6 /64 counts as one address) and the pool's node-wide budget. The pools are
//!   [`KNOWN_BUDGET`] for the signers a run knows ([`Admission::know`]: the shepherd's
//!   workers, who said hello or sent a heartbeat; at most [`MAX_KNOWN`] per run, the
//!   longest silent forgotten first; and the run's coordinator candidates,
//!   [`Admission::candidates`]), and [`STRANGER_BUDGET`] for everyone else.
//!
//! So a stranger with unlimited keys costs a node at most `STRANGER_BUDGET +
//! KNOWN_BUDGET` of small frames plus one head per open stream, whatever it claims; one
//! address with many keys holds at most `ADDRESS_BUDGET` of each pool, and cannot keep
//! other addresses or known workers out; and contribution-sized memory goes only to the
//! workers the shepherd chose for the open round: one contribution at a time each, at
//! most [`CONTRIBUTIONS_PER_ROUND`] per round however fast the shepherd consumes them.
//! A permit is held while its payload is read and verified; the payload then goes on to
//! the node's owner through the bounded event queue.
//!
//! A shepherd also caps the **worker identities per address** of a run
//! ([`Admission::admit_worker`]): keys are free, addresses are not. Admission follows
//! every open connection of a pcp peer (the request-response behaviour reports them), so
//! it knows the address a signer is connected from: an IPv4 address, or an IPv6 /64.
//! A worker admitted this way holds a slot until the shepherd says it left
//! ([`Admission::worker_left`], [`Admission::forget`]; or as the longest silent beyond
//! [`MAX_KNOWN`]). The slot it holds is counted under:
//!
//! - the address of its latest **direct** connection, if it has one: at most
//!   `max_per_address` workers per IPv4 address or IPv6 /64, and at most
//!   [`MAX_64S_PER_48`] distinct /64s holding workers within one IPv6 /48 (a home or
//!   an office is commonly given a whole /48: 65,536 /64s, which a cap per /64 alone
//!   would let fill a run);
//! - otherwise, when it is reached only **through a relay**, the run's **relayed
//!   pool**: at most [`RELAYED_POOL_FACTOR`] × `max_per_address` workers, whatever
//!   the relay. A relayed connection's multiaddr names the relay's address, not the
//!   worker's, and what the worker says of its own (identify's listen or observed
//!   addresses) is unchecked; counting it under the relay's address would put every
//!   volunteer behind one public relay under one address's cap. A worker that hole
//!   punches (DCUtR) is counted under its own address from its next admission.

use std::collections::{HashMap, HashSet};
use std::net::IpAddr;
use std::sync::{Arc, Mutex, MutexGuard};

use libp2p::multiaddr::Protocol;
use libp2p::swarm::ConnectionId;
use libp2p::{Multiaddr, PeerId};
use pcp_protocol::{PublicKey, RunId};
use pcp_schema::{FrameHead, MAX_FRAME_HEAD, MessageKind};

use known::{Known, Slot};

mod known;
mod screens;
mod slices;

pub use screens::SCREENS_IN_FLIGHT;
pub use slices::SLICES_IN_FLIGHT;

/// The largest payload of a request that is not a contribution (hello, heartbeat).
pub const SMALL_FRAME: usize = 64 << 10;
/// What each small request costs beyond its payload: its open stream and head.
pub const FRAME_COST: usize = MAX_FRAME_HEAD;
/// Bytes of small requests in flight, node-wide, from signers no run knows.
pub const STRANGER_BUDGET: usize = 16 << 20;
/// Bytes of small requests in flight, node-wide, from known signers outside the open round.
pub const KNOWN_BUDGET: usize = 16 << 20;
/// Bytes of small requests in flight from one signer outside the open round: two of the largest.
pub const SIGNER_BUDGET: usize = 2 * (SMALL_FRAME + FRAME_COST);
/// Bytes of small requests in flight from one IP address (IPv6: one /64) in one pool
/// (strangers, known signers) outside the open round.
pub const ADDRESS_BUDGET: usize = 1 << 20;
/// Contribution permits per participant per round: its contribution, and one retry.
pub const CONTRIBUTIONS_PER_ROUND: usize = 2;
/// Signers a run knows; beyond, the one heard from longest ago is forgotten.
pub const MAX_KNOWN: usize = 16_384;
/// Open connections whose address admission remembers (the swarm holds fewer).
const MAX_CONNECTIONS: usize = 20_000;
/// The most distinct IPv6 /64s within one /48 that hold a run's admitted workers:
/// with the default 4 per /64, 64 workers from one /48, room for the subnets of a
/// household or a lab, while one free /48 cannot put 1,024 /64s' worth in a run.
pub const MAX_64S_PER_48: usize = 16;
/// The run's workers reached only through relays share one pool of this many times
/// the cap per address (64 at the default 4).
pub const RELAYED_POOL_FACTOR: usize = 16;

/// Bytes of contributions in flight, node-wide, for a run whose contributions are at
/// most `max_contribution` bytes: room for 64 at once, but no more than 8 GiB unless
/// that is fewer than 4.
pub fn contribution_budget(max_contribution: usize) -> usize {
    max_contribution.saturating_mul(64).min(8 << 30).max(max_contribution.saturating_mul(4))
}

/// The other end of a connection, as the transport authenticated it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Remote {
    /// Its peer id.
    pub(crate) peer: PeerId,
    /// The key its peer id embeds (every pcp peer's does).
    pub(crate) key: Option<PublicKey>,
    /// Its IP address, an IPv6 one cut to its /64.
    pub(crate) address: Option<IpAddr>,
}

impl Remote {
    /// The peer `peer` at `addr`.
    pub(crate) fn new(peer: PeerId, addr: &Multiaddr) -> Self {
        Self { peer, key: crate::ids::key_of(&peer), address: crate::ip_limits::address_of(addr) }
    }
}

/// Why a request's payload is not read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// The head is signed by someone else than the peer that sent it (relayed or replayed).
    #[error("{kind} signed by {signer}, not by the sending peer")]
    NotSender {
        /// The message kind.
        kind: &'static str,
        /// The signer the head names.
        signer: PublicKey,
    },
    /// A contribution for a run this node does not serve.
    #[error("contribution from {signer} for run {run}, which this node does not serve")]
    NotServed {
        /// The signer.
        signer: PublicKey,
        /// The run named.
        run: RunId,
    },
    /// A contribution for a round that is not the run's open round.
    #[error("contribution from {signer} for round {round} of run {run}, which is not its open round")]
    NotOpen {
        /// The signer.
        signer: PublicKey,
        /// The run.
        run: RunId,
        /// The round named.
        round: u64,
    },
    /// A contribution from a signer that is not a participant of the open round.
    #[error("contribution from {signer}, who is not a participant of round {round} of run {run}")]
    NotParticipant {
        /// The signer.
        signer: PublicKey,
        /// The run.
        run: RunId,
        /// The round.
        round: u64,
    },
    /// The announced payload is larger than this kind of request may be.
    #[error("{kind} of {len} bytes from {signer} exceeds its limit of {max} bytes")]
    TooLarge {
        /// The message kind.
        kind: &'static str,
        /// The announced length.
        len: u64,
        /// The limit.
        max: usize,
        /// The signer.
        signer: PublicKey,
    },
    /// The participant has had all its permits for the round.
    #[error("{signer} has had its {CONTRIBUTIONS_PER_ROUND} contribution permits for round {round}")]
    Spent {
        /// The signer.
        signer: PublicKey,
        /// The round.
        round: u64,
    },
    /// The participant already has a contribution in flight.
    #[error("{signer} already has a contribution in flight")]
    Busy {
        /// The signer.
        signer: PublicKey,
    },
    /// The run's contributions in flight already fill its budget (or what a retry may use
    /// of it); or, at an aggregator, the slices in flight fill theirs.
    #[error("{kind} from {signer}: {budget} bytes of {kind}s already in flight or kept")]
    Full {
        /// `contribution` or `slice`.
        kind: &'static str,
        /// The signer.
        signer: PublicKey,
        /// The budget.
        budget: usize,
    },
    /// A sender of slices has sent every one its round allows it.
    #[error("{signer} has sent every slice of round {round} that this aggregator reads from it")]
    SlicesSpent {
        /// The signer.
        signer: PublicKey,
        /// The round.
        round: u64,
    },
    /// An allowance for small requests is spent.
    #[error("request from {signer}: {budget} bytes already in flight from {scope}")]
    Budget {
        /// The signer.
        signer: PublicKey,
        /// Whose allowance: this signer, its address, strangers, known workers.
        scope: &'static str,
        /// The allowance.
        budget: usize,
    },
}

/// Why a worker was not admitted to a run ([`Admission::admit_worker`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AdmitError {
    /// The run is not served by this node.
    #[error("worker {signer} for run {run}, which this node does not serve")]
    NotServed {
        /// The worker.
        signer: PublicKey,
        /// The run.
        run: RunId,
    },
    /// No connection from the worker is open (it closed, or it never was).
    #[error("worker {signer} has no open connection to this node")]
    NotConnected {
        /// The worker.
        signer: PublicKey,
    },
    /// Its address already holds the run's cap of worker identities.
    #[error("worker {signer} refused: {} already has {max_per_address} worker identities in run {run}, the most one address may have", crate::ip_limits::show_address(.address))]
    Crowded {
        /// The worker.
        signer: PublicKey,
        /// The run.
        run: RunId,
        /// Its address (IPv6: its /64).
        address: IpAddr,
        /// The cap.
        max_per_address: usize,
    },
    /// Its IPv6 /48 already has [`MAX_64S_PER_48`] /64s holding workers of the run.
    #[error("worker {signer} refused: {} already has workers of run {run} on {MAX_64S_PER_48} /64s, the most one /48 may have", crate::ip_limits::show_network(.network))]
    CrowdedNetwork {
        /// The worker.
        signer: PublicKey,
        /// The run.
        run: RunId,
        /// Its /48.
        network: IpAddr,
    },
    /// It is reached only through a relay, and the run's relayed pool is full.
    #[error(
        "worker {signer} refused: run {run} already has {max} workers reached only through a relay, the most it takes (a direct connection counts by its own address)"
    )]
    CrowdedRelayed {
        /// The worker.
        signer: PublicKey,
        /// The run.
        run: RunId,
        /// The pool's size: [`RELAYED_POOL_FACTOR`] × the cap per address.
        max: usize,
    },
}

/// An open connection of a pcp peer, as [`Admission::connected`] saw it established.
#[derive(Debug, Clone, Copy)]
struct Connection {
    key: PublicKey,
    /// Its remote address's [`crate::ip_limits::address_key`] (a relayed connection's
    /// is its relay's, which [`Admission::admit_worker`] does not count it under);
    /// `None` without an IP.
    address: Option<IpAddr>,
    /// Whether the remote IP is a loopback address.
    loopback: bool,
    /// Through a relay.
    relayed: bool,
    /// Order of establishment.
    order: u64,
}

/// A run's open round: its participants and the permits each has had.
#[derive(Debug)]
struct Round {
    number: u64,
    taken: HashMap<PublicKey, usize>,
    /// Participants that have had no permit yet.
    unstarted: usize,
}

#[derive(Debug, Default)]
struct Served {
    max_contribution: usize,
    known: Known,
    round: Option<Round>,
    /// [`Admission::carry`]: the round before the open one, still read.
    previous: Option<Round>,
    carry: bool,
}

/// Peers whose refusals are counted one by one between two reports.
const MAX_REFUSING_PEERS: usize = 256;

#[derive(Debug, Default)]
struct Inner {
    /// Contributions waiting in [`Admission::wait_for_room`].
    waiting: usize,
    runs: HashMap<RunId, Served>,
    /// Each run's coordinator candidates ([`Admission::candidates`]), served or not.
    candidates: HashMap<RunId, HashSet<PublicKey>>,
    /// Refusals not yet reported, per sending peer (`None`: unknown).
    refusals: HashMap<Option<PeerId>, (u64, String)>,
    /// Signers with a contribution in flight.
    contributing: HashSet<PublicKey>,
    contribution_bytes: usize,
    stranger_bytes: usize,
    known_bytes: usize,
    per_signer: HashMap<PublicKey, usize>,
    /// Per address and pool (known or not).
    per_address: HashMap<(Option<IpAddr>, bool), usize>,
    /// Open connections of pcp peers (at most [`MAX_CONNECTIONS`]).
    connections: HashMap<ConnectionId, Connection>,
    connections_opened: u64,
    /// [`Admission::count_loopback`].
    count_loopback: bool,
    /// [`Admission::aggregate`]: the rounds whose slices this node reads.
    slices: slices::Slices,
    /// [`Admission::screen_for`]: the leaders whose screen requests this node reads.
    screens: screens::Screens,
}

/// The runs this node serves and who may send it what. Shared by the node's handle
/// (the shepherd names each round's participants through [`crate::Node::admission`])
/// and the codec.
#[derive(Debug, Default)]
pub struct Admission {
    inner: Mutex<Inner>,
    /// Told when a contribution's permit is given back: contributions that found the
    /// budget full wait for it (see [`Admission::wait_for_room`]).
    freed: tokio::sync::Notify,
}

impl Admission {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        // the state is a few maps updated in single statements: a panic elsewhere
        // cannot leave it half-written
        self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// This node serves `run` and accepts contributions of up to `max_contribution`
    /// payload bytes from the participants of its open round.
    pub fn serve(&self, run: RunId, max_contribution: usize) {
        self.lock().runs.entry(run).or_default().max_contribution = max_contribution;
    }

    /// `run`'s shepherd carries a contribution that arrives after its round closed
    /// into the next round (an overlapping run): contributions for the round before
    /// the open one are read too, from that round's participants, with the permits
    /// they had left in it.
    pub fn carry(&self, run: RunId) {
        if let Some(served) = self.lock().runs.get_mut(&run) {
            served.carry = true;
        }
    }

    /// This node no longer serves `run`.
    pub fn stop_serving(&self, run: RunId) {
        self.lock().runs.remove(&run);
    }

    /// Round `round` of `run` (a run this node serves) is open to `participants`: each may
    /// now have [`CONTRIBUTIONS_PER_ROUND`] contribution permits for it, and contributions
    /// for any other round are refused. Opening the same round again adds participants
    /// and keeps the permits already had.
    pub fn open_round(&self, run: RunId, round: u64, participants: &[PublicKey]) {
        let mut inner = self.lock();
        let Some(served) = inner.runs.get_mut(&run) else { return };
        if served.round.as_ref().is_some_and(|open| open.number != round) {
            let closed = served.round.take().filter(|c| served.carry && c.number + 1 == round);
            served.previous = closed;
        }
        let open = served.round.get_or_insert_with(|| Round { number: round, taken: HashMap::new(), unstarted: 0 });
        for p in participants {
            if !open.taken.contains_key(p) {
                open.taken.insert(*p, 0);
                open.unstarted += 1;
            }
        }
    }

    /// `signer` is a worker of `run` (it said hello or sent a heartbeat): its small
    /// requests come from a pool strangers cannot fill. It gives no contribution permit.
    pub fn know(&self, run: RunId, signer: PublicKey) {
        if let Some(served) = self.lock().runs.get_mut(&run) {
            served.known.insert(signer);
        }
    }

    /// `signer` is no longer a worker of `run`, nor a participant of its open round.
    pub fn forget(&self, run: RunId, signer: PublicKey) {
        if let Some(served) = self.lock().runs.get_mut(&run) {
            served.known.remove(&signer);
            for round in [served.round.as_mut(), served.previous.as_mut()].into_iter().flatten() {
                if round.taken.remove(&signer) == Some(0) {
                    round.unstarted -= 1;
                }
            }
        }
    }

    /// `signer` left `run`'s workers (it said so, or its heartbeats stopped): the slot
    /// it held ([`Self::admit_worker`]) is free and the run no longer knows it, but it
    /// keeps what it had of the rounds it was named a participant of, whose
    /// contributions the shepherd still counts.
    pub fn worker_left(&self, run: RunId, signer: PublicKey) {
        if let Some(served) = self.lock().runs.get_mut(&run) {
            served.known.remove(&signer);
        }
    }

    /// Admits `signer` as a worker of `run` (a run this node serves), and knows it (see
    /// [`Self::know`]), unless the slot it is counted under is full (see the module's
    /// docs): the IPv4 address or IPv6 /64 of its latest open direct connection, which
    /// holds at most `max_per_address` of the run's admitted workers, in an IPv6 /48
    /// whose workers are on at most [`MAX_64S_PER_48`] /64s; or, with only relayed
    /// connections open, the run's relayed pool of [`RELAYED_POOL_FACTOR`] ×
    /// `max_per_address`. The worker holds its slot until it left
    /// ([`Self::worker_left`], [`Self::forget`], or as the longest silent beyond
    /// [`MAX_KNOWN`]); admitting it again with the same slot takes no other, and with
    /// another moves it.
    ///
    /// Loopback addresses (a relay's too) are not counted unless
    /// [`Self::count_loopback`] says so (`pcp-node sim` runs every node on 127.0.0.1),
    /// nor is a direct connection without an IP address.
    pub fn admit_worker(&self, run: RunId, signer: PublicKey, max_per_address: usize) -> Result<(), AdmitError> {
        let mut inner = self.lock();
        let count_loopback = inner.count_loopback;
        let connection =
            inner.connections.values().filter(|c| c.key == signer).max_by_key(|c| (!c.relayed, c.order)).copied();
        let served = inner.runs.get_mut(&run).ok_or(AdmitError::NotServed { signer, run })?;
        let connection = connection.ok_or(AdmitError::NotConnected { signer })?;
        let counted = count_loopback || !connection.loopback;
        let slot = match connection.address {
            _ if !counted => None,
            _ if connection.relayed => Some(Slot::Relayed),
            address => address.map(Slot::Address),
        };
        let known = &served.known;
        match slot {
            Some(slot) if known.slot(&signer) == Some(slot) => {}
            Some(Slot::Relayed) => {
                let max = max_per_address.saturating_mul(RELAYED_POOL_FACTOR);
                if known.at(Slot::Relayed) >= max {
                    return Err(AdmitError::CrowdedRelayed { signer, run, max });
                }
            }
            Some(slot @ Slot::Address(address)) => {
                if known.at(slot) >= max_per_address {
                    return Err(AdmitError::Crowded { signer, run, address, max_per_address });
                }
                if known.at(slot) == 0
                    && let Some(network) = crate::ip_limits::network_48(address)
                    && known.networks_but(network, &signer) >= MAX_64S_PER_48
                {
                    return Err(AdmitError::CrowdedNetwork { signer, run, network });
                }
            }
            None => {}
        }
        served.known.insert_at(signer, slot);
        Ok(())
    }

    /// Whether [`Self::admit_worker`] counts workers on loopback addresses against the cap
    /// (by default it does not: `pcp-node sim` runs every node on 127.0.0.1).
    pub fn count_loopback(&self, count: bool) {
        self.lock().count_loopback = count;
    }

    /// This node sums shards of `run`'s round `round` (an aggregator): each of
    /// `senders` may send it its count of slices (request kind `Slice`) of at most
    /// `max_len` bytes, read while the slices in flight hold less than
    /// [`SLICES_IN_FLIGHT`] × `max_len` and waited for past it, as contributions are;
    /// anyone else's slice is a small frame. The newest rounds are kept.
    pub fn aggregate(&self, (run, round): (RunId, u64), senders: &[(PublicKey, usize)], max_len: usize) {
        self.lock().slices.open((run, round), senders, max_len);
    }

    /// This node screens for `run` (a worker): `leader`'s screen requests (request
    /// kind `ScreenRequest`) of at most `max_len` bytes are read while those in
    /// flight hold less than [`SCREENS_IN_FLIGHT`] × `max_len`, and refused past
    /// it; anyone else's is a small frame. A new leader replaces the last.
    pub fn screen_for(&self, run: RunId, leader: PublicKey, max_len: usize) {
        self.lock().screens.open(run, leader, max_len);
    }

    /// A connection to `peer` at `remote` is established. Only pcp peers' (whose peer id
    /// embeds an ed25519 key) are remembered, at most [`MAX_CONNECTIONS`] at once.
    pub(crate) fn connected(&self, id: ConnectionId, peer: PeerId, remote: &Multiaddr) {
        let Some(key) = crate::ids::key_of(&peer) else { return };
        let ip = crate::ip_limits::ip(remote);
        let mut inner = self.lock();
        if inner.connections.len() >= MAX_CONNECTIONS {
            return;
        }
        let connection = Connection {
            key,
            address: ip.map(crate::ip_limits::address_key),
            loopback: ip.is_some_and(|ip| ip.is_loopback() || crate::ip_limits::address_key(ip).is_loopback()),
            relayed: remote.iter().any(|p| matches!(p, Protocol::P2pCircuit)),
            order: inner.connections_opened,
        };
        inner.connections_opened += 1;
        inner.connections.insert(id, connection);
    }

    /// A connection is closed.
    pub(crate) fn disconnected(&self, id: ConnectionId) {
        self.lock().connections.remove(&id);
    }

    /// `run`'s coordinator candidates are `keys` (its manifest names them): they
    /// are known to it ([`Self::is_known`]) whether or not this node serves it, and
    /// are told apart ([`Self::is_candidate`]). Replaces the ones said before.
    pub fn candidates(&self, run: RunId, keys: &[PublicKey]) {
        self.lock().candidates.insert(run, keys.iter().copied().collect());
    }

    /// Whether `signer` is one of `run`'s candidates ([`Self::candidates`]).
    pub fn is_candidate(&self, run: RunId, signer: PublicKey) -> bool {
        self.lock().candidates.get(&run).is_some_and(|c| c.contains(&signer))
    }

    /// Whether gossip on `run`'s topic signed by `signer` is taken (and forwarded):
    /// only the run's candidates publish there (announcements, leases), so once this
    /// node knows them ([`Self::candidates`]) anyone else's is dropped at the first
    /// hop, however many fresh keys send it. A run whose candidates this node does
    /// not know yet takes any.
    pub fn may_gossip(&self, run: RunId, signer: PublicKey) -> bool {
        self.lock().candidates.get(&run).is_none_or(|c| c.contains(&signer))
    }

    /// Whether `run` knows `signer`: one of its workers ([`Self::know`]) or
    /// candidates ([`Self::candidates`]).
    pub fn is_known(&self, run: RunId, signer: PublicKey) -> bool {
        let inner = self.lock();
        inner.runs.get(&run).is_some_and(|s| s.known.contains(&signer))
            || inner.candidates.get(&run).is_some_and(|c| c.contains(&signer))
    }

    /// Whether `signer` is a participant of `run`'s open round.
    pub fn is_participant(&self, run: RunId, signer: PublicKey) -> bool {
        self.lock().runs.get(&run).and_then(|s| s.round.as_ref()).is_some_and(|r| r.taken.contains_key(&signer))
    }

    /// Notes a refused request: from which peer, if known, and why.
    pub(crate) fn refused(&self, peer: Option<PeerId>, reason: String) {
        let mut inner = self.lock();
        let peer = if inner.refusals.len() < MAX_REFUSING_PEERS { peer } else { None };
        let entry = inner.refusals.entry(peer).or_default();
        entry.0 += 1;
        entry.1 = reason;
    }

    /// The refusals noted since the last call: peer, count, the last reason.
    pub(crate) fn take_refusals(&self) -> Vec<(Option<PeerId>, u64, String)> {
        self.lock().refusals.drain().map(|(peer, (count, reason))| (peer, count, reason)).collect()
    }

    /// Bytes of strangers' requests in flight now.
    pub fn stranger_bytes(&self) -> usize {
        self.lock().stranger_bytes
    }

    /// Bytes of known signers' small requests in flight now.
    pub fn known_bytes(&self) -> usize {
        self.lock().known_bytes
    }

    /// [`Admission::permit`], waiting up to `wait` while the run's contributions in
    /// flight fill its budget ([`Refusal::Full`]) instead of refusing at once: the
    /// sender's stream holds only its head meanwhile (its payload waits in the
    /// transport's flow control), so a burst of participants is read as fast as the
    /// node consumes it rather than partly refused. Every other refusal is at once.
    pub(crate) async fn wait_for_room(
        self: &Arc<Self>,
        head: &FrameHead,
        signer: PublicKey,
        from: &Remote,
        wait: std::time::Duration,
    ) -> Result<Permit, Refusal> {
        let until = tokio::time::Instant::now() + wait;
        let _waiting = Waiting::new(self);
        loop {
            // registered before the check, so a permit given back in between is not missed
            let freed = self.freed.notified();
            tokio::pin!(freed);
            freed.as_mut().enable();
            match self.permit(head, signer, from) {
                Err(Refusal::Full { .. }) if tokio::time::Instant::now() < until => {
                    if tokio::time::timeout_at(until, freed).await.is_err() {
                        return self.permit(head, signer, from);
                    }
                }
                result => return result,
            }
        }
    }

    /// Contributions being read now or waiting for room to be read: a shepherd does
    /// not close a round at its deadline while one is on its way.
    pub fn receiving(&self) -> usize {
        let inner = self.lock();
        inner.contributing.len() + inner.waiting
    }

    /// Whether the payload `head` announces, signed by `signer` (whose signature on the
    /// head has been verified) and sent by `from`, may be read; the permit holds its
    /// share of the allowances until it is dropped.
    pub(crate) fn permit(
        self: &Arc<Self>,
        head: &FrameHead,
        signer: PublicKey,
        from: &Remote,
    ) -> Result<Permit, Refusal> {
        if from.key != Some(signer) {
            return Err(Refusal::NotSender { kind: head.header.kind.tag(), signer });
        }
        let mut inner = self.lock();
        let share = match head.header.kind {
            MessageKind::Contribution => inner.contribution(head, signer)?,
            MessageKind::Slice => match inner.slices.permit(head, signer) {
                Some(len) => Share::Slice { len: len? },
                None => inner.small(head, signer, from.address)?,
            },
            MessageKind::ScreenRequest => match inner.screens.permit(head, signer) {
                Some(len) => Share::Screen { len: len? },
                None => inner.small(head, signer, from.address)?,
            },
            _ => inner.small(head, signer, from.address)?,
        };
        Ok(Permit { admission: self.clone(), share })
    }
}

impl Inner {
    fn contribution(&mut self, head: &FrameHead, signer: PublicKey) -> Result<Share, Refusal> {
        let (run, round, len) = (RunId(head.header.run), head.header.round, head.payload_len);
        let served = self.runs.get_mut(&run).ok_or(Refusal::NotServed { signer, run })?;
        let max = served.max_contribution;
        let open = [served.round.as_mut(), served.previous.as_mut()]
            .into_iter()
            .flatten()
            .find(|r| r.number == round)
            .ok_or(Refusal::NotOpen { signer, run, round })?;
        let taken = *open.taken.get(&signer).ok_or(Refusal::NotParticipant { signer, run, round })?;
        if len > max as u64 {
            return Err(Refusal::TooLarge { kind: head.header.kind.tag(), len, max, signer });
        }
        if taken >= CONTRIBUTIONS_PER_ROUND {
            return Err(Refusal::Spent { signer, round });
        }
        if self.contributing.contains(&signer) {
            return Err(Refusal::Busy { signer });
        }
        let len = len as usize;
        let budget = contribution_budget(max);
        // a retry does not take the room of a participant's first contribution
        let kept = if taken == 0 { 0 } else { open.unstarted.saturating_mul(max) };
        if self.contribution_bytes.saturating_add(len).saturating_add(kept) > budget {
            return Err(Refusal::Full { kind: "contribution", signer, budget });
        }
        if taken == 0 {
            open.unstarted -= 1;
        }
        open.taken.insert(signer, taken + 1);
        self.contributing.insert(signer);
        self.contribution_bytes += len;
        Ok(Share::Contribution { signer, len })
    }

    fn small(&mut self, head: &FrameHead, signer: PublicKey, address: Option<IpAddr>) -> Result<Share, Refusal> {
        if head.payload_len > SMALL_FRAME as u64 {
            return Err(Refusal::TooLarge {
                kind: head.header.kind.tag(),
                len: head.payload_len,
                max: SMALL_FRAME,
                signer,
            });
        }
        if self.runs.values().any(|s| s.round.as_ref().is_some_and(|r| r.taken.contains_key(&signer))) {
            return Ok(Share::None);
        }
        let cost = head.payload_len as usize + FRAME_COST;
        let known = self.runs.values().any(|s| s.known.contains(&signer))
            || self.candidates.values().any(|c| c.contains(&signer));
        let budget = |scope, budget| Refusal::Budget { signer, scope, budget };
        if self.per_signer.get(&signer).copied().unwrap_or(0) + cost > SIGNER_BUDGET {
            return Err(budget("this signer", SIGNER_BUDGET));
        }
        if self.per_address.get(&(address, known)).copied().unwrap_or(0) + cost > ADDRESS_BUDGET {
            return Err(budget("its address", ADDRESS_BUDGET));
        }
        let pool = if known { &mut self.known_bytes } else { &mut self.stranger_bytes };
        let (scope, max) = if known { ("known workers", KNOWN_BUDGET) } else { ("strangers", STRANGER_BUDGET) };
        if *pool + cost > max {
            return Err(budget(scope, max));
        }
        *pool += cost;
        *self.per_signer.entry(signer).or_default() += cost;
        *self.per_address.entry((address, known)).or_default() += cost;
        Ok(Share::Small { signer, address, known, cost })
    }
}

#[derive(Debug)]
enum Share {
    None,
    Small { signer: PublicKey, address: Option<IpAddr>, known: bool, cost: usize },
    Contribution { signer: PublicKey, len: usize },
    Slice { len: usize },
    Screen { len: usize },
}

fn release<K: std::hash::Hash + Eq>(map: &mut HashMap<K, usize>, key: K, n: usize) {
    if let Some(held) = map.get_mut(&key) {
        *held -= n;
        if *held == 0 {
            map.remove(&key);
        }
    }
}

/// Counts a contribution waiting for room while it lives.
struct Waiting<'a>(&'a Admission);

impl<'a> Waiting<'a> {
    fn new(admission: &'a Admission) -> Self {
        admission.lock().waiting += 1;
        Self(admission)
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        let mut inner = self.0.lock();
        inner.waiting = inner.waiting.saturating_sub(1);
    }
}

/// A contribution's share of its run's budget of contributions in flight, held from
/// when its payload is read until whoever handles it drops it, so that the budget
/// bounds the contributions read and not yet handled, not only those being read: a
/// node busy with one contribution does not pile up more in memory, their senders wait
/// (see [`Admission::wait_for_room`]). Its clones share it.
#[derive(Debug, Clone)]
pub struct Hold {
    _permit: Arc<Permit>,
}

impl Permit {
    /// Held on past the read if it is a contribution's ([`Hold`]); a small request's
    /// share ends with its read.
    pub(crate) fn hold(self) -> Option<Hold> {
        matches!(self.share, Share::Contribution { .. } | Share::Slice { .. }).then(|| Hold { _permit: Arc::new(self) })
    }
}

/// Leave to read one request's payload; returns its share of the allowances when
/// dropped (a contribution's permit for its round is spent for good).
#[derive(Debug)]
pub(crate) struct Permit {
    admission: Arc<Admission>,
    share: Share,
}

impl Drop for Permit {
    fn drop(&mut self) {
        let mut inner = self.admission.lock();
        match self.share {
            Share::None => {}
            Share::Small { signer, address, known, cost } => {
                if known {
                    inner.known_bytes -= cost;
                } else {
                    inner.stranger_bytes -= cost;
                }
                release(&mut inner.per_signer, signer, cost);
                release(&mut inner.per_address, (address, known), cost);
            }
            Share::Contribution { signer, len } => {
                inner.contribution_bytes -= len;
                inner.contributing.remove(&signer);
                drop(inner);
                self.admission.freed.notify_waiters();
            }
            Share::Slice { len } => {
                inner.slices.release(len);
                drop(inner);
                self.admission.freed.notify_waiters();
            }
            Share::Screen { len } => inner.screens.release(len),
        }
    }
}

#[cfg(test)]
mod tests;
