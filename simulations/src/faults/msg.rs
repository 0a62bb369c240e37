//! What nodes send each other, the timers they set, and what a node's handler
//! hands back to the world.

use pcp_protocol::PublicKey;
use pcp_protocol::diloco::shepherd;
use pcp_protocol::election::Succession;
use pcp_protocol::failover::Replica;
use pcp_protocol::failover::candidate::Message;
use rand_chacha::ChaCha8Rng;

use super::Rules;
use super::invariants::Registry;

/// A round's announcement: round `round` of `term` opens from `base` (the state
/// after round `round − 1`) for `participants`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Announce {
    pub(super) term: u64,
    pub(super) round: u64,
    pub(super) base: Replica,
    /// A bit per worker (worker index, not node index).
    pub(super) participants: u64,
    /// When the round opened, on the leader's clock: a leader restarted within its
    /// term reopens the round later, and that is a new round to train (pcp-node
    /// tells them apart by their deadlines).
    pub(super) opened_ms: u64,
}

/// A lease a node follows, relayed in what it sends (a signed lease is valid from
/// anyone who forwards it): `term` and its leader's node index.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Follow {
    pub(super) term: u64,
    pub(super) leader: usize,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum Msg {
    /// The leader's lease to workers (in answer to their heartbeats, and with each
    /// announcement it publishes).
    Lease { term: u64, epoch: u64, sent: u64, announce: Option<Announce> },
    /// A worker forwarding an announcement it took (gossip, as gossipsub does in
    /// pcp-node): the lease `origin` signed, carried unchanged (a signed lease is
    /// valid from whoever relays it), taken as a lease from `origin`.
    Gossip { origin: usize, term: u64, epoch: u64, sent: u64, announce: Announce },
    /// What candidates tell each other: leases, answers, votes.
    Consensus(Message),
    /// A worker's heartbeat to the candidate it awaits.
    WorkerBeat {
        follows: Follow,
        /// The round the worker last trained (its chain): a leader behind it does not
        /// count it in its quorum.
        round: u64,
    },
    /// A node refusing a stale lease, or a standby answering a worker: the lease
    /// it follows.
    Relay { follows: Follow },
    /// Asks for a state blob.
    Fetch { want: Replica },
    /// A state blob.
    Blob { state: Replica },
    /// A worker's pseudo-gradient for `round` of `term`, trained from `params`.
    Contribution { term: u64, round: u64, params: [u8; 32], delta: [f32; 4] },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Timer {
    /// The node's loop: elections, the shepherd's deadlines.
    Tick,
    /// A leader's lease to the other candidates.
    Lease,
    /// A standby's or a worker's heartbeat.
    Beat,
    /// A worker finished τ inner steps of work `id`.
    Trained(u64),
    /// A worker's fetch for work `id` is overdue: ask again.
    Refetch(u64),
    /// A worker sends work `id`'s contribution again (it cannot tell whether it
    /// arrived) until a newer announcement replaces the work.
    Resend(u64),
}

/// What a handler reports to the world.
#[derive(Clone, Debug)]
pub(super) enum Event {
    /// A line of the report.
    Log(String),
    /// A candidate leads a term.
    Leads(u64),
    /// A leader completed a round.
    Completed(Replica),
    /// The round a leader completed next took `worker`'s pseudo-gradient trained
    /// from `trained`, not from the state the round started from.
    Mixed { round: u64, worker: u32, trained: [u8; 32] },
    /// A standby replicated a state.
    Replicated(Replica),
    /// A worker applied a state: it trains the next round from it.
    Applied(Replica),
    /// A leader released a round to workers (announced it to them): the round
    /// opens from this state, its base. Invariant (c) holds every state a leader of
    /// the releasing term or a later one completes, at or after the base's round,
    /// to descend from it; and all released bases lie on one history.
    Released(Replica),
}

/// How the run's candidates fail over: the protocol's [`Mode`] for their number
/// (majority from three; best effort with one or two, where the nemesis leaves out
/// what no design survives, see the module docs of `faults`).
pub(crate) use pcp_protocol::failover::Mode;

/// The run's fixed settings.
#[derive(Clone, Debug)]
pub(super) struct Setup {
    pub(super) succession: Succession,
    /// Every node's key: candidates first, then workers.
    pub(super) keys: Vec<PublicKey>,
    pub(super) candidates: usize,
    pub(super) lease_ms: u64,
    pub(super) shepherd: shepherd::Config,
    pub(super) rules: Rules,
    /// How the candidates fail over: [`Mode::Majority`] with 3 candidates or more.
    pub(super) mode: Mode,
    /// The shortest and longest a state blob takes to transfer, ms (drawn per
    /// seed: 100 to 1,200 ms, or 4 to 40 s for a large model).
    pub(super) transfer_ms: (u64, u64),
    /// Candidates record their runs ([`pcp_protocol::failover::candidate::trace`]).
    pub(super) trace: bool,
}

impl Setup {
    /// The node holding `key`.
    pub(super) fn index(&self, key: &PublicKey) -> usize {
        self.keys.iter().position(|k| k == key).unwrap_or(usize::MAX)
    }

    pub(super) fn is_candidate(&self, node: usize) -> bool {
        node < self.candidates
    }

    /// `c0`…, `w0`….
    pub(super) fn name(&self, node: usize) -> String {
        if node < self.candidates { format!("c{node}") } else { format!("w{}", node - self.candidates) }
    }
}

/// A handler's view of the world.
#[derive(Debug)]
pub(super) struct Ctx<'a> {
    pub(super) me: usize,
    /// This node's monotonic clock, ms since it started.
    pub(super) now: u64,
    /// This node's incarnation.
    pub(super) epoch: u64,
    /// The world's clock, ms (for the record only: nodes act on `now`).
    pub(super) global: u64,
    pub(super) setup: &'a Setup,
    pub(super) reg: &'a mut Registry,
    pub(super) rng: &'a mut ChaCha8Rng,
    /// Messages, each with the ms it takes to produce before it goes on the link.
    pub(super) sends: Vec<(usize, Msg, u64)>,
    /// Timers in this node's ms from now.
    pub(super) timers: Vec<(u64, Timer)>,
    pub(super) events: Vec<Event>,
}

impl Ctx<'_> {
    pub(super) fn send(&mut self, to: usize, msg: Msg) {
        self.send_after(to, msg, 0);
    }

    /// Sends `msg` once `after` ms have passed (a blob's transfer time).
    pub(super) fn send_after(&mut self, to: usize, msg: Msg, after: u64) {
        if to != self.me && to < self.setup.keys.len() {
            self.sends.push((to, msg, after));
        }
    }

    /// A state blob for `to`: it takes [`Setup::transfer_ms`] to transfer.
    pub(super) fn send_blob(&mut self, to: usize, state: Replica) {
        use rand::Rng;
        let (shortest, longest) = self.setup.transfer_ms;
        let after = self.rng.gen_range(shortest..=longest.max(shortest));
        self.send_after(to, Msg::Blob { state }, after);
    }

    pub(super) fn log(&mut self, line: String) {
        self.events.push(Event::Log(line));
    }

    pub(super) fn rules(&self) -> Rules {
        self.setup.rules
    }

    pub(super) fn name(&self) -> String {
        self.setup.name(self.me)
    }
}
