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
//!   longest silent forgotten first), and [`STRANGER_BUDGET`] for everyone else.
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
//! A worker admitted this way holds a slot of its address until it is forgotten
//! ([`Admission::forget`], or as the longest silent beyond [`MAX_KNOWN`]).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::IpAddr;
use std::sync::{Arc, Mutex, MutexGuard};

use libp2p::multiaddr::Protocol;
use libp2p::swarm::ConnectionId;
use libp2p::{Multiaddr, PeerId};
use pcp_protocol::{PublicKey, RunId};
use pcp_schema::{FrameHead, MAX_FRAME_HEAD, MessageKind};

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
    /// The run's contributions in flight already fill its budget (or what a retry may use of it).
    #[error("contribution from {signer}: {budget} bytes of contributions already in flight or kept")]
    Full {
        /// The signer.
        signer: PublicKey,
        /// The budget.
        budget: usize,
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
}

/// When a known signer was last heard from, and the address it was admitted from.
#[derive(Debug, Clone, Copy)]
struct Heard {
    at: u64,
    /// Set by [`Admission::admit_worker`]: the address whose slot it holds.
    address: Option<IpAddr>,
}

/// The signers a run knows, the longest silent first out beyond [`MAX_KNOWN`], and how
/// many of them hold a slot of each address.
#[derive(Debug, Default)]
struct Known {
    heard: HashMap<PublicKey, Heard>,
    order: BTreeMap<u64, PublicKey>,
    next: u64,
    /// Known signers per address they were admitted from (at most [`MAX_KNOWN`] entries).
    per_address: HashMap<IpAddr, usize>,
}

impl Known {
    /// Knows `signer`, keeping the address slot it holds.
    fn insert(&mut self, signer: PublicKey) {
        let address = self.heard.get(&signer).and_then(|h| h.address);
        self.insert_at(signer, address);
    }

    /// Knows `signer`, holding a slot of `address` (releasing any other it held).
    fn insert_at(&mut self, signer: PublicKey, address: Option<IpAddr>) {
        let heard = Heard { at: self.next, address };
        if let Some(old) = self.heard.insert(signer, heard) {
            self.order.remove(&old.at);
            release_slot(&mut self.per_address, old.address);
        }
        if let Some(address) = address {
            *self.per_address.entry(address).or_default() += 1;
        }
        self.order.insert(self.next, signer);
        self.next += 1;
        if self.heard.len() > MAX_KNOWN
            && let Some((_, oldest)) = self.order.pop_first()
            && let Some(old) = self.heard.remove(&oldest)
        {
            release_slot(&mut self.per_address, old.address);
        }
    }

    fn remove(&mut self, signer: &PublicKey) {
        if let Some(old) = self.heard.remove(signer) {
            self.order.remove(&old.at);
            release_slot(&mut self.per_address, old.address);
        }
    }

    /// The address whose slot `signer` holds.
    fn address(&self, signer: &PublicKey) -> Option<IpAddr> {
        self.heard.get(signer).and_then(|h| h.address)
    }

    /// Known signers holding a slot of `address`.
    fn at(&self, address: &IpAddr) -> usize {
        self.per_address.get(address).copied().unwrap_or(0)
    }

    fn contains(&self, signer: &PublicKey) -> bool {
        self.heard.contains_key(signer)
    }
}

fn release_slot(per_address: &mut HashMap<IpAddr, usize>, address: Option<IpAddr>) {
    if let Some(address) = address {
        release(per_address, address, 1);
    }
}

/// An open connection of a pcp peer, as [`Admission::connected`] saw it established.
#[derive(Debug, Clone, Copy)]
struct Connection {
    key: PublicKey,
    /// Its remote address's [`crate::ip_limits::address_key`] (a relayed connection's
    /// is its relay's); `None` without an IP.
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

    /// Admits `signer` as a worker of `run` (a run this node serves), and knows it (see
    /// [`Self::know`]), unless the address it is connected from (an IPv4 address or an
    /// IPv6 /64) already holds `max_per_address` of the run's admitted workers. The worker
    /// holds a slot of that address until it is forgotten ([`Self::forget`], or as the
    /// longest silent beyond [`MAX_KNOWN`]); admitting it again from the same address
    /// takes no other slot, and from another address moves its slot.
    ///
    /// The address is that of the signer's latest open direct connection, or of its
    /// latest relayed one if it has no direct one (a relayed connection counts under the
    /// relay's address: a node reached only through a relay shares its cap). Loopback
    /// addresses are not counted unless [`Self::count_loopback`] says so (`pcp-node sim`
    /// runs every node on 127.0.0.1), nor is a connection without an IP address.
    pub fn admit_worker(&self, run: RunId, signer: PublicKey, max_per_address: usize) -> Result<(), AdmitError> {
        let mut inner = self.lock();
        let count_loopback = inner.count_loopback;
        let connection =
            inner.connections.values().filter(|c| c.key == signer).max_by_key(|c| (!c.relayed, c.order)).copied();
        let served = inner.runs.get_mut(&run).ok_or(AdmitError::NotServed { signer, run })?;
        let connection = connection.ok_or(AdmitError::NotConnected { signer })?;
        let address = connection.address.filter(|_| count_loopback || !connection.loopback);
        if let Some(address) = address
            && served.known.address(&signer) != Some(address)
            && served.known.at(&address) >= max_per_address
        {
            return Err(AdmitError::Crowded { signer, run, address, max_per_address });
        }
        served.known.insert_at(signer, address);
        Ok(())
    }

    /// Whether [`Self::admit_worker`] counts workers on loopback addresses against the cap
    /// (by default it does not: `pcp-node sim` runs every node on 127.0.0.1).
    pub fn count_loopback(&self, count: bool) {
        self.lock().count_loopback = count;
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

    /// Whether `run` knows `signer`.
    pub fn is_known(&self, run: RunId, signer: PublicKey) -> bool {
        self.lock().runs.get(&run).is_some_and(|s| s.known.contains(&signer))
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
            return Err(Refusal::NotSender { kind: head.kind.tag(), signer });
        }
        let mut inner = self.lock();
        let share = if head.kind == MessageKind::Contribution {
            inner.contribution(head, signer)?
        } else {
            inner.small(head, signer, from.address)?
        };
        Ok(Permit { admission: self.clone(), share })
    }
}

impl Inner {
    fn contribution(&mut self, head: &FrameHead, signer: PublicKey) -> Result<Share, Refusal> {
        let (run, round, len) = (RunId(head.run), head.round, head.payload_len);
        let served = self.runs.get_mut(&run).ok_or(Refusal::NotServed { signer, run })?;
        let max = served.max_contribution;
        let open = [served.round.as_mut(), served.previous.as_mut()]
            .into_iter()
            .flatten()
            .find(|r| r.number == round)
            .ok_or(Refusal::NotOpen { signer, run, round })?;
        let taken = *open.taken.get(&signer).ok_or(Refusal::NotParticipant { signer, run, round })?;
        if len > max as u64 {
            return Err(Refusal::TooLarge { kind: head.kind.tag(), len, max, signer });
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
            return Err(Refusal::Full { signer, budget });
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
            return Err(Refusal::TooLarge { kind: head.kind.tag(), len: head.payload_len, max: SMALL_FRAME, signer });
        }
        if self.runs.values().any(|s| s.round.as_ref().is_some_and(|r| r.taken.contains_key(&signer))) {
            return Ok(Share::None);
        }
        let cost = head.payload_len as usize + FRAME_COST;
        let known = self.runs.values().any(|s| s.known.contains(&signer));
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
        matches!(self.share, Share::Contribution { .. }).then(|| Hold { _permit: Arc::new(self) })
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
        }
    }
}

#[cfg(test)]
mod tests {
    use std::net::{Ipv4Addr, Ipv6Addr};
    use std::time::Duration;

    use pcp_protocol::Identity;

    use super::*;

    fn head(kind: MessageKind, signer: &Identity, run: RunId, round: u64, payload_len: u64) -> FrameHead {
        FrameHead {
            kind,
            signer: signer.public().0,
            run: run.0,
            round,
            nonce: 1,
            unix_ms: 1,
            payload_len,
            payload_hash: [0; 32],
            signature: [0; 64],
        }
    }

    fn identity(i: u64) -> Identity {
        let mut secret = [7u8; 32];
        secret[..8].copy_from_slice(&i.to_le_bytes());
        Identity::from_secret(secret)
    }

    /// The connection of `who` from `ip`.
    fn remote(who: &Identity, ip: IpAddr) -> Remote {
        let peer = crate::ids::peer_of(&who.public()).expect("a valid key");
        Remote { peer, key: Some(who.public()), address: Some(crate::ip_limits::address_key(ip)) }
    }

    const HOME: IpAddr = IpAddr::V4(Ipv4Addr::new(192, 0, 2, 1));

    #[test]
    fn a_run_that_carries_reads_the_round_before_the_open_one_and_no_older() {
        let admission = Arc::new(Admission::default());
        let (slow, fast, joiner) = (identity(1), identity(2), identity(3));
        let run = RunId([8; 32]);
        let ask = |who: &Identity, round| {
            admission.permit(&head(MessageKind::Contribution, who, run, round, 10), who.public(), &remote(who, HOME))
        };
        admission.serve(run, 1000);
        admission.open_round(run, 1, &[slow.public(), fast.public()]);
        drop(ask(&fast, 1).expect("in time"));
        // without carry, the round before is closed to contributions
        admission.open_round(run, 2, &[slow.public(), fast.public(), joiner.public()]);
        assert!(matches!(ask(&slow, 1), Err(Refusal::NotOpen { round: 1, .. })));

        admission.carry(run);
        admission.open_round(run, 3, &[slow.public(), fast.public(), joiner.public()]);
        // round 2, closed as 3 opens, is still read from its participants, its permits counted
        drop(ask(&slow, 2).expect("a late contribution for the round before"));
        drop(ask(&slow, 2).expect("and its retry"));
        assert!(matches!(ask(&slow, 2), Err(Refusal::Spent { round: 2, .. })));
        drop(ask(&joiner, 2).expect("the joiner was a participant of round 2"));
        drop(ask(&slow, 3).expect("and the open round"));
        // two rounds old: refused
        admission.open_round(run, 4, &[slow.public()]);
        assert!(matches!(ask(&fast, 2), Err(Refusal::NotOpen { round: 2, .. })));
        assert!(matches!(ask(&joiner, 4), Err(Refusal::NotParticipant { .. })));
        drop(ask(&joiner, 3).expect("round 3 is the round before"));
    }

    #[test]
    fn contributions_only_from_participants_of_the_open_round_and_up_to_its_size() {
        let admission = Arc::new(Admission::default());
        let (worker, joined_late) = (identity(1), identity(2));
        let run = RunId([9; 32]);
        let ask = |who: &Identity, round, len| {
            admission.permit(&head(MessageKind::Contribution, who, run, round, len), who.public(), &remote(who, HOME))
        };

        assert!(matches!(ask(&worker, 1, 10), Err(Refusal::NotServed { .. })));
        admission.serve(run, 1000);
        // a hello or heartbeat makes a signer known, not a participant
        admission.know(run, worker.public());
        assert!(matches!(ask(&worker, 1, 10), Err(Refusal::NotOpen { round: 1, .. })));
        admission.open_round(run, 1, &[worker.public()]);
        admission.know(run, joined_late.public());
        assert!(matches!(ask(&joined_late, 1, 10), Err(Refusal::NotParticipant { .. })));
        assert!(matches!(ask(&worker, 2, 10), Err(Refusal::NotOpen { round: 2, .. })));
        assert!(matches!(ask(&worker, 1, 1001), Err(Refusal::TooLarge { max: 1000, .. })));
        let first = ask(&worker, 1, 1000).expect("a participant's contribution");
        assert!(matches!(ask(&worker, 1, 1000), Err(Refusal::Busy { .. })), "one at a time");
        drop(first);
        let retry = ask(&worker, 1, 1000).expect("and its retry");
        drop(retry);
        assert!(matches!(ask(&worker, 1, 10), Err(Refusal::Spent { round: 1, .. })));

        // the next round: the round before is closed, the permits are new
        admission.open_round(run, 2, &[worker.public(), joined_late.public()]);
        assert!(matches!(ask(&worker, 1, 10), Err(Refusal::NotOpen { round: 1, .. })));
        assert!(ask(&joined_late, 2, 1000).is_ok());
        assert!(admission.is_participant(run, joined_late.public()));
        admission.forget(run, joined_late.public());
        assert!(matches!(ask(&joined_late, 2, 10), Err(Refusal::NotParticipant { .. })));
        assert!(!admission.is_known(run, joined_late.public()));
    }

    #[test]
    fn a_head_sent_by_another_peer_takes_none_of_its_signers_permits() {
        let admission = Arc::new(Admission::default());
        let (worker, thief) = (identity(1), identity(2));
        let run = RunId([9; 32]);
        admission.serve(run, 1000);
        admission.open_round(run, 1, &[worker.public()]);
        let captured = head(MessageKind::Contribution, &worker, run, 1, 1000);
        for _ in 0..10 {
            let refused = admission.permit(&captured, worker.public(), &remote(&thief, HOME));
            assert!(matches!(refused, Err(Refusal::NotSender { .. })), "{refused:?}");
        }
        let refused = admission.permit(&captured, worker.public(), &Remote { key: None, ..remote(&thief, HOME) });
        assert!(matches!(refused, Err(Refusal::NotSender { .. })), "a peer id without a key");
        for _ in 0..CONTRIBUTIONS_PER_ROUND {
            assert!(admission.permit(&captured, worker.public(), &remote(&worker, HOME)).is_ok());
        }
        assert!(matches!(
            admission.permit(&captured, worker.public(), &remote(&worker, HOME)),
            Err(Refusal::Spent { .. })
        ));
    }

    /// A burst of participants larger than the budget: the one that finds it full
    /// waits and is read when a permit comes back, not refused; past its wait, it is.
    #[tokio::test(start_paused = true)]
    async fn a_contribution_waits_for_room_instead_of_being_refused() {
        let admission = Arc::new(Admission::default());
        let run = RunId([9; 32]);
        admission.serve(run, 1000);
        let workers: Vec<Identity> = (0..66).map(identity).collect();
        let keys: Vec<PublicKey> = workers.iter().map(Identity::public).collect();
        admission.open_round(run, 1, &keys);
        let head = |who: &Identity| head(MessageKind::Contribution, who, run, 1, 1000);
        let mut held: Vec<Permit> = workers[..64]
            .iter()
            .map(|w| admission.permit(&head(w), w.public(), &remote(w, HOME)).expect("the budget's first 64"))
            .collect();
        let last = &workers[64];
        let waiting = {
            let (admission, head, from) = (admission.clone(), head(last), remote(last, HOME));
            let key = last.public();
            tokio::spawn(async move { admission.wait_for_room(&head, key, &from, Duration::from_secs(60)).await })
        };
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert!(!waiting.is_finished(), "it waits while the budget is full");
        assert_eq!(admission.receiving(), 65, "64 being read, one waiting");
        held.pop();
        let permit = waiting.await.expect("joins").expect("read once a permit came back");
        held.push(permit);
        // nothing comes back: refused once its wait is over
        let other = &workers[65];
        let (other_head, from) = (head(other), remote(other, HOME));
        let refused = admission.wait_for_room(&other_head, other.public(), &from, Duration::from_secs(60)).await;
        assert!(matches!(refused, Err(Refusal::Full { .. })));
    }

    #[test]
    fn the_budget_keeps_room_for_first_contributions_over_retries() {
        let admission = Arc::new(Admission::default());
        let run = RunId([9; 32]);
        admission.serve(run, 1000);
        assert_eq!(contribution_budget(1000), 64_000);
        // more participants than the budget holds at once
        let workers: Vec<Identity> = (0..66).map(identity).collect();
        let keys: Vec<PublicKey> = workers.iter().map(Identity::public).collect();
        admission.open_round(run, 1, &keys);
        let ask = |who: &Identity| {
            admission.permit(&head(MessageKind::Contribution, who, run, 1, 1000), who.public(), &remote(who, HOME))
        };
        // the first sends, its stream breaks, and it retries while 65 have not sent: no room
        drop(ask(&workers[0]).expect("a first contribution"));
        assert!(matches!(ask(&workers[0]), Err(Refusal::Full { budget: 64_000, .. })));
        let held: Vec<Permit> = workers[1..65].iter().map(|w| ask(w).expect("the firsts fill the budget")).collect();
        assert!(matches!(ask(&workers[65]), Err(Refusal::Full { .. })), "full");
        drop(held);
        // one has not sent yet: its room is kept, the rest is the retry's
        let retry = ask(&workers[0]).expect("room for the retry");
        assert!(ask(&workers[65]).is_ok());
        drop(retry);
        assert_eq!(admission.lock().contribution_bytes, 0);
    }

    #[test]
    fn small_frames_are_shared_per_signer_per_address_and_per_pool() {
        let admission = Arc::new(Admission::default());
        let run = RunId([3; 32]);
        admission.serve(run, 1 << 20);
        let (participant, known) = (identity(1), identity(2));
        admission.open_round(run, 1, &[participant.public()]);
        admission.know(run, known.public());
        let small = SMALL_FRAME as u64;
        let frame = (SMALL_FRAME + FRAME_COST) as u64;
        let ask = |who: &Identity, ip: IpAddr, len| {
            admission.permit(&head(MessageKind::Heartbeat, who, run, 1, len), who.public(), &remote(who, ip))
        };
        let stranger = identity(3);
        assert!(matches!(ask(&stranger, HOME, small + 1), Err(Refusal::TooLarge { .. })));

        // one signer: two of the largest
        let mine: Vec<Permit> = (0..2).map(|_| ask(&stranger, HOME, small).expect("within its allowance")).collect();
        assert!(matches!(ask(&stranger, HOME, small), Err(Refusal::Budget { scope: "this signer", .. })));
        drop(mine);

        // one address with many keys: ADDRESS_BUDGET, whatever the keys
        let per_address = ADDRESS_BUDGET / frame as usize;
        let sybils: Vec<Identity> = (100..100 + per_address as u64 + 1).map(identity).collect();
        let held: Vec<Permit> = sybils[..per_address]
            .iter()
            .map(|s| ask(s, HOME, small).expect("within the address's allowance"))
            .collect();
        let last = sybils.last().expect("one more");
        assert!(matches!(ask(last, HOME, small), Err(Refusal::Budget { scope: "its address", .. })));
        // an IPv6 /64 is one address; the next /64 is another
        let v6 = |last: u16, net: u16| IpAddr::V6(Ipv6Addr::new(0x2001, 0xdb8, 0, net, 0, 0, 0, last));
        let v6_held: Vec<Permit> = sybils[..per_address]
            .iter()
            .enumerate()
            .map(|(i, s)| ask(s, v6(i as u16, 1), small).expect("another address"))
            .collect();
        assert!(matches!(ask(last, v6(999, 1), small), Err(Refusal::Budget { scope: "its address", .. })));
        assert!(ask(last, v6(999, 2), small).is_ok());
        // the known worker and the participant are not kept out by the strangers at their address
        let heartbeat = ask(&known, HOME, small).expect("a known worker's own allowance");
        assert_eq!(admission.known_bytes(), frame as usize);
        drop(heartbeat);
        let participant_frames: Vec<Permit> = (0..64).map(|_| ask(&participant, HOME, small).expect("free")).collect();
        drop((held, v6_held, participant_frames));
        assert_eq!((admission.stranger_bytes(), admission.known_bytes()), (0, 0));
        assert!(admission.lock().per_address.is_empty() && admission.lock().per_signer.is_empty());

        // strangers from many addresses share STRANGER_BUDGET; known workers have their own
        let fill = STRANGER_BUDGET / frame as usize;
        let many: Vec<Identity> = (1000..1000 + fill as u64).map(identity).collect();
        let ip = |i: usize| IpAddr::V4(Ipv4Addr::new(10, 0, (i >> 8) as u8, i as u8));
        let held: Vec<Permit> =
            many.iter().enumerate().map(|(i, s)| ask(s, ip(i), small).expect("within the pool")).collect();
        assert!(matches!(ask(last, ip(fill + 1), small), Err(Refusal::Budget { scope: "strangers", .. })));
        let heartbeat = ask(&known, HOME, small).expect("a known worker's own pool");
        assert_eq!(admission.known_bytes(), frame as usize);
        drop((held, heartbeat));
        assert_eq!((admission.stranger_bytes(), admission.known_bytes()), (0, 0));
    }

    /// `who` connects from `addr` on connection `id`.
    fn connect(admission: &Admission, id: usize, who: &Identity, addr: &str) {
        let peer = crate::ids::peer_of(&who.public()).expect("a valid key");
        admission.connected(ConnectionId::new_unchecked(id), peer, &addr.parse().expect("a multiaddr"));
    }

    #[test]
    fn an_address_holds_at_most_the_cap_of_a_runs_workers_until_one_is_forgotten() {
        let admission = Admission::default();
        let run = RunId([6; 32]);
        let workers: Vec<Identity> = (0..5).map(identity).collect();
        assert!(matches!(admission.admit_worker(run, workers[0].public(), 2), Err(AdmitError::NotServed { .. })));
        admission.serve(run, 10);
        assert_eq!(
            admission.admit_worker(run, workers[0].public(), 2),
            Err(AdmitError::NotConnected { signer: workers[0].public() })
        );
        for (i, w) in workers[..3].iter().enumerate() {
            connect(&admission, i, w, "/ip4/203.0.113.5/udp/4001/quic-v1");
        }
        admission.admit_worker(run, workers[0].public(), 2).expect("the first of its address");
        admission.admit_worker(run, workers[1].public(), 2).expect("the second");
        admission.admit_worker(run, workers[0].public(), 2).expect("admitted again: no other slot");
        let crowded = admission.admit_worker(run, workers[2].public(), 2);
        assert_eq!(
            crowded.as_ref().err().map(ToString::to_string),
            Some(format!(
                "worker {} refused: 203.0.113.5 already has 2 worker identities in run {run}, \
                 the most one address may have",
                workers[2].public()
            ))
        );
        assert!(!admission.is_known(run, workers[2].public()));
        // another run has its own count
        let other = RunId([7; 32]);
        admission.serve(other, 10);
        admission.admit_worker(other, workers[2].public(), 2).expect("another run");
        // a heartbeat (know) keeps the slot; forgetting frees it
        admission.know(run, workers[1].public());
        assert!(admission.admit_worker(run, workers[2].public(), 2).is_err());
        admission.forget(run, workers[1].public());
        admission.admit_worker(run, workers[2].public(), 2).expect("a freed slot");

        // a worker that moves to another address takes its slot along
        connect(&admission, 10, &workers[0], "/ip4/198.51.100.1/tcp/4001");
        admission.admit_worker(run, workers[0].public(), 2).expect("its new address");
        admission.disconnected(ConnectionId::new_unchecked(10));
        connect(&admission, 3, &workers[3], "/ip4/203.0.113.5/tcp/4001");
        admission.admit_worker(run, workers[3].public(), 2).expect("the slot worker 0 left");
        // once its connections close, a worker cannot be admitted
        admission.disconnected(ConnectionId::new_unchecked(0));
        assert!(matches!(admission.admit_worker(run, workers[0].public(), 2), Err(AdmitError::NotConnected { .. })));
    }

    #[test]
    fn an_ipv6_64_is_one_address_and_a_direct_connection_is_preferred_to_a_relayed_one() {
        let admission = Admission::default();
        let run = RunId([6; 32]);
        admission.serve(run, 10);
        let workers: Vec<Identity> = (0..4).map(identity).collect();
        connect(&admission, 0, &workers[0], "/ip6/2001:db8:0:1::a/udp/4001/quic-v1");
        connect(&admission, 1, &workers[1], "/ip6/2001:db8:0:1:ffff::b/tcp/4001");
        connect(&admission, 2, &workers[2], "/ip6/2001:db8:0:2::a/tcp/4001");
        admission.admit_worker(run, workers[0].public(), 1).expect("the /64's one");
        let crowded = admission.admit_worker(run, workers[1].public(), 1);
        assert!(
            matches!(&crowded, Err(e @ AdmitError::Crowded { .. }) if e.to_string().contains("2001:db8:0:1::/64")),
            "{crowded:?}"
        );
        admission.admit_worker(run, workers[2].public(), 1).expect("another /64");

        // a worker reached through a relay counts under the relay's address, and under its
        // own once it is connected directly too (a hole punch)
        let relay_peer = crate::ids::peer_of(&identity(99).public()).expect("a valid key");
        let relayed = format!("/ip4/192.0.2.50/udp/4001/quic-v1/p2p/{relay_peer}/p2p-circuit");
        admission.disconnected(ConnectionId::new_unchecked(1));
        connect(&admission, 3, &workers[3], &relayed);
        connect(&admission, 4, &workers[1], &relayed);
        admission.admit_worker(run, workers[1].public(), 1).expect("relayed: the relay's address");
        assert!(matches!(admission.admit_worker(run, workers[3].public(), 1), Err(AdmitError::Crowded { .. })));
        connect(&admission, 5, &workers[3], "/ip4/203.0.113.77/udp/4001/quic-v1");
        admission.admit_worker(run, workers[3].public(), 1).expect("direct, though the relay's slot is taken");
    }

    #[test]
    fn loopback_is_exempt_unless_counted() {
        let admission = Admission::default();
        let run = RunId([6; 32]);
        admission.serve(run, 10);
        let workers: Vec<Identity> = (0..3).map(identity).collect();
        for (i, w) in workers.iter().enumerate() {
            connect(&admission, i, w, "/ip4/127.0.0.1/tcp/4001");
        }
        connect(&admission, 9, &workers[2], "/ip6/::1/tcp/4001");
        for w in &workers {
            admission.admit_worker(run, w.public(), 1).expect("loopback is not counted");
        }
        let admission = Admission::default();
        admission.serve(run, 10);
        admission.count_loopback(true);
        for (i, w) in workers.iter().enumerate() {
            connect(&admission, i, w, "/ip4/127.0.0.1/tcp/4001");
        }
        admission.admit_worker(run, workers[0].public(), 2).expect("one");
        admission.admit_worker(run, workers[1].public(), 2).expect("two");
        let crowded = admission.admit_worker(run, workers[2].public(), 2);
        assert!(matches!(crowded, Err(AdmitError::Crowded { max_per_address: 2, .. })), "{crowded:?}");
        admission.forget(run, workers[0].public());
        admission.admit_worker(run, workers[2].public(), 2).expect("a forgotten worker's slot");
    }

    #[test]
    fn a_worker_forgotten_as_the_longest_silent_frees_its_slot() {
        let admission = Admission::default();
        let run = RunId([6; 32]);
        admission.serve(run, 10);
        admission.count_loopback(true);
        let (first, second) = (identity(1), identity(2));
        connect(&admission, 0, &first, "/ip4/203.0.113.5/tcp/1");
        connect(&admission, 1, &second, "/ip4/203.0.113.5/tcp/2");
        admission.admit_worker(run, first.public(), 1).expect("the address's one");
        assert!(admission.admit_worker(run, second.public(), 1).is_err());
        for i in 0..MAX_KNOWN as u64 {
            admission.know(run, identity(1000 + i).public());
        }
        assert!(!admission.is_known(run, first.public()));
        admission.admit_worker(run, second.public(), 1).expect("the slot of a worker no longer known");
        let inner = admission.lock();
        let known = &inner.runs[&run].known;
        assert_eq!(known.per_address.values().sum::<usize>(), 1);
    }

    #[test]
    fn connections_remembered_are_bounded() {
        let admission = Admission::default();
        for i in 0..MAX_CONNECTIONS + 10 {
            connect(&admission, i, &identity(i as u64), "/ip4/203.0.113.5/tcp/1");
        }
        assert_eq!(admission.lock().connections.len(), MAX_CONNECTIONS);
        for i in 0..MAX_CONNECTIONS + 10 {
            admission.disconnected(ConnectionId::new_unchecked(i));
        }
        assert!(admission.lock().connections.is_empty());
    }

    #[test]
    fn a_run_knows_at_most_max_known_signers_the_longest_silent_out_first() {
        let admission = Admission::default();
        let run = RunId([4; 32]);
        admission.serve(run, 10);
        let keys: Vec<PublicKey> = (0..MAX_KNOWN as u64 + 2).map(|i| identity(i).public()).collect();
        for k in &keys[..MAX_KNOWN] {
            admission.know(run, *k);
        }
        // the first speaks again: the second is now the longest silent
        admission.know(run, keys[0]);
        admission.know(run, keys[MAX_KNOWN]);
        assert!(admission.is_known(run, keys[0]) && admission.is_known(run, keys[MAX_KNOWN]));
        assert!(!admission.is_known(run, keys[1]));
        assert!(!admission.is_known(RunId([5; 32]), keys[0]), "only for runs served");
    }
}
