//! A deterministic fault simulator of shepherd failover: `pcp-node simulate
//! --faults --seed S` runs one seeded schedule, prints what happened, and fails
//! naming the first broken invariant.
//!
//! Coordinator candidates and four workers run pcp's real rules, composed as
//! pcp-node composes them: the protocol's candidate
//! ([`Candidate`](pcp_protocol::failover::Candidate): votes, the majority's lease
//! and commit), the [`failover`](pcp_protocol::failover) rules around it
//! (check-quorum, fencing, workers never moving back), the
//! [`election`](pcp_protocol::election) workers follow, and the
//! [`Shepherd`](pcp_protocol::diloco::shepherd::Shepherd)
//! and [`Worker`](pcp_protocol::diloco::worker::Worker) round machines. The
//! network, the clocks, the compute and the faults are simulated: no wall clock,
//! no threads, every draw from the seed (ChaCha8 streams for the run's shape, the
//! nemesis, the network and the nodes), so a seed replays byte for byte.
//!
//! **The run's shape**, drawn from the seed: three candidates mostly, five for
//! about one seed in seven and two for as many. With three or more, failover is
//! by majority (`Mode::Majority`: votes, commit and the lease each
//! take a majority of the candidates); with two it is best effort
//! (`Mode::BestEffort`: no majority survives the loss of one, the
//! report's first line says so, and the nemesis leaves out what two cannot
//! survive). Keys: the candidates' first, then the workers'. A state blob takes
//! 0.1 to 1.2 s to send, or for one seed in five (a large model: 500 MB on
//! 100 Mbit/s is 40 s) 4 to 40 s; a round's deadline (3 to 8 s, 6 s at first)
//! allows for the slowest of them too.
//!
//! **The world.** Events in simulated milliseconds, ties in the order they were
//! scheduled. Each node has its own monotonic clock: milliseconds since its
//! process started (a restart starts it again), running 10 % fast or slow at
//! most (2 % in a best-effort run), plus the jumps the nemesis makes, less the
//! pauses it slept through with its clock stopped. The lease is 1 s. Candidates
//! tick every 100 ms, workers every 250 ms; the leader sends its lease to the
//! other candidates every third of a lease; standbys heartbeat every candidate,
//! and workers the candidate they await, every half lease. Every message carries
//! the lease its sender follows (a signed lease is valid from whoever relays it),
//! so a stale leader learns of a newer term from anyone. Gossip: a leader's
//! announcements reach workers both in answer to their heartbeats and through
//! gossipsub, as in pcp-node: a worker that takes an announcement (its election
//! takes the lease, and it is newer than what the worker has) forwards the leader's
//! signed lease unchanged, once (it remembers the last eight it forwarded), to two
//! other workers drawn from its rng, each an ordinary message on the links (cuts,
//! queued cuts, loss, duplicates and delay apply); a worker takes a forwarded one
//! as a lease from the leader that signed it, and refuses a stale one (a deposed
//! leader's, however late it comes) without a word. So copies arrive late,
//! twice, out of order, and from a leader long deposed. Nothing arrives of a
//! state blob whose sender dies while sending it, and a worker asks again for one
//! after a lease or the slowest transfer, whichever is longer; τ inner steps take
//! 1.2 to 2 s. Parameters are one tensor of 4 f32, identified by the blake3 of
//! their bytes; each pseudo-gradient is fresh noise, so a round completed twice
//! gives two states and the invariants can tell their histories apart.
//!
//! How the nodes compose the rules (what pcp-node does):
//! * a candidate is the protocol's [`Candidate`](pcp_protocol::failover::Candidate),
//!   built from a [`Start`](pcp_protocol::failover::candidate::trace::Start) as
//!   pcp-node builds its own; its messages travel as simulated messages and the
//!   state blobs it asks for are fetched from the candidate its lease named.
//! * while it leads, it runs the
//!   [`Shepherd`](pcp_protocol::diloco::shepherd::Shepherd): the round's deadlines
//!   run only while a majority answers its lease (`may_act`), contributions are
//!   checked against its [`Fence`](pcp_protocol::failover::Fence) and always
//!   taken, a completed round's state goes to the candidates at once and its
//!   successor round to workers only once the candidate commits that state, and
//!   it steps aside when [`Quorum::check`](pcp_protocol::failover::Quorum::check)
//!   says it hears too few workers to close a round (a window of three leases, at
//!   least the heartbeat timeout).
//! * a worker trains a round only if
//!   [`Chain::admits`](pcp_protocol::failover::Chain::admits) it, takes an
//!   announcement that reopens its round (a new leader, or its leader restarted)
//!   as a new round to train, and sends its contribution again every lease until
//!   a newer announcement comes: a send lost in a partition would otherwise keep
//!   the round waiting for it, past its deadline when no quorum arrived.
//!
//! **The nemesis** draws up to six faults starting between 1.5 s and 15 s, then
//! heals everything but the nodes it crashed for good:
//! * crashes and restarts, with the disk or without, of any node, of whoever
//!   leads, or of the leader 0 to 800 ms after it next completes a round (the
//!   round is then not yet everywhere);
//! * pauses (a suspended VM: it reads its queue when it wakes) of up to eight
//!   leases, during which the node's clock either counts the pause (it jumps on
//!   waking, as `CLOCK_BOOTTIME` does) or stops (a VM whose clock froze: the node
//!   wakes believing little time passed);
//! * clock jumps of up to five leases;
//! * one-way and two-way cuts between a candidate and another node (another
//!   candidate, or the leader at one end), a node isolated from all, partitions;
//! * queued cuts: what crosses one is held, not lost (a TCP buffer, a retrying
//!   sender), and delivered in order when it heals, each after its link's delay
//!   from then (lost if its sender died meanwhile);
//! * links that lose up to 50 %, duplicate up to 30 %, and delay and reorder
//!   messages (up to 300 ms plus 600 ms of jitter);
//! * crashes for good (the node never restarts): at most a minority of the
//!   candidates, ⌊(n − 1)/2⌋, over the whole run (a candidate that loses its disk
//!   never restarts either: its identity key was on it, so it counts among them),
//!   and workers while two stay.
//!
//! A best-effort run's nemesis is the one of two candidates: pauses of up to
//! three leases that the clock counts, clock jumps of up to a lease, no crash for
//! good (a candidate that loses its disk restarts with an empty one), and what
//! follows left out.
//!
//! **What the world leaves out.** In every run, a node crashed for good takes no
//! more faults, and a crash does not hit a node that is down. The nemesis does not
//! crash for good
//! * a candidate before a majority of the candidates have held a state: the run's
//!   first state is on its creator alone until the others fetch it, and no design
//!   survives losing it;
//! * a worker before a worker has trained from a round past the first state: a
//!   shepherd that starts from the first state waits for every start worker.
//!
//! In a best-effort run no candidate can tell dead candidates from unreachable
//! ones (one live candidate may lead, and a leader that hears from no candidate
//! for two leases takes them for dead), so the nemesis never
//! * cuts candidates apart: no cut, queued cut or partition between two
//!   candidates, and the leader is never isolated. Each side would lead its own
//!   term, complete rounds (an isolated leader completes the open round with the
//!   contributions it has) and tell its workers, and when the sides meet one
//!   side's rounds are lost: the split brain of the failure model (docs/failover.md). A
//!   standby may be isolated: it takes a term alone, without workers, and when it
//!   is reachable again it steps aside for the candidate that holds what the
//!   others did meanwhile.
//! * crashes, pauses or isolates a candidate unless another candidate holds a
//!   state and has been up, awake and reachable for three leases and the slowest
//!   transfer (and so holds what the run committed). Otherwise the last candidate
//!   standing commits rounds alone and, gone before the others have them, they go
//!   on without: the run whose candidates are all dead, of docs/failover.md, when the
//!   one it waits for is not the one that returns.
//!
//! **Invariants**, checked after every event that can break them (a worker
//! applies a state, a leader completes or releases one, a candidate takes a term,
//! and every event for (d) and (f)); the first broken one ends the run:
//! * **(a)** no worker applies two different states for the same round (it applies
//!   a state when it starts training the next round from it; a worker that loses
//!   its disk comes back as a new worker);
//! * **(b)** the states workers apply lie on one history: each descends from those
//!   applied at earlier rounds, none moves back, and every round's update is made
//!   of pseudo-gradients trained from the state the round started from;
//! * **(c)** a state released to workers is never lost or changed: when a leader
//!   releases a round (announces it to workers) whose base is state S, every state
//!   a leader of that term or a later one completes at or after S's round descends
//!   from S, and the bases released by any leader lie on one history. (A state
//!   replicated to a minority of the candidates and never released may be lost; a
//!   deposed leader of an earlier term may complete rounds nobody takes.)
//! * **(d)** once every fault has healed, a worker trains from a round completed
//!   after the heal within [`progress_bound_ms`]: 20 s ([`PROGRESS_BOUND_MS`]:
//!   at most four leases to settle the term, three for check-quorum, one of
//!   resume grace, one round deadline of 8 s at most, and slack), plus three of
//!   the slowest transfers (the state a worker was fetching at the heal, the new
//!   round's state to the candidates that commit it, then to the worker; the
//!   round's deadline allows for one), plus two leases for each candidate past
//!   the third (each dead one in the succession costs a lease or two): 23.6 s
//!   with three candidates and the usual transfers, 144 s with five and a large
//!   model;
//! * **(e)** terms do not churn without end: after the heal, at most
//!   2 × candidates + 2 terms are taken;
//! * **(f)** no worker refuses rounds forever: every worker up (not crashed for
//!   good) trains from a round completed after the heal within twice (d)'s
//!   bound. The run goes on until they all have, then 3 s more for late messages
//!   to land.

mod candidate;
mod invariants;
mod msg;
mod nemesis;
mod net;
mod worker;
mod world;

use std::fmt;
use std::io::Write;

use pcp_protocol::diloco::Tensors;

use world::World;

/// Workers.
pub const WORKERS: usize = 4;
/// The lease, ms.
pub const LEASE_MS: u64 = 1_000;
/// Invariant (d)'s bound for three candidates whose state transfers are
/// instant: see [`progress_bound_ms`].
pub const PROGRESS_BOUND_MS: u64 = 20_000;
/// How long a run goes on once every worker up has caught up, ms (for late
/// messages to land).
const SETTLE_MS: u64 = 3_000;

/// Invariant (d)'s bound for a run of `candidates` candidates whose slowest state
/// transfer takes `slowest_transfer_ms`: once every fault has healed, a worker
/// trains from a round completed after the heal within [`PROGRESS_BOUND_MS`],
/// plus three of the slowest transfers (the state a worker was fetching at the
/// heal, the new round's state to the candidates that commit it, then to the
/// worker), plus two leases for each candidate past the third (each dead one in
/// the succession costs a lease or two). Invariant (f) allows twice that.
pub fn progress_bound_ms(candidates: usize, slowest_transfer_ms: u64) -> u64 {
    PROGRESS_BOUND_MS + 3 * slowest_transfer_ms + 2 * LEASE_MS * candidates.saturating_sub(3) as u64
}

/// A failover rule the simulated composition can run without, to check that the
/// invariants catch its absence.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Rule {
    /// Voters ignore what the campaigner holds: a candidate behind a committed
    /// round may be elected.
    UpToDate,
    /// A new leader's state keeps the term that produced it instead of taking the
    /// new term when a majority holds it (Raft's figure 8).
    CommitTerm,
    /// Leaders never step aside for want of workers.
    CheckQuorum,
    /// Leaders run their rounds' deadlines whatever their lease says.
    LeaderLease,
    /// Leaders take contributions of any term and parameters (round numbers still checked).
    Fence,
    /// Leaders tell workers of a round before a majority of the candidates holds it.
    Commit,
    /// Workers follow any valid announcement, even one that moves them back.
    Chain,
}

impl fmt::Display for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::UpToDate => "up-to-date",
            Self::CommitTerm => "commit-term",
            Self::CheckQuorum => "check-quorum",
            Self::LeaderLease => "leader-lease",
            Self::Fence => "fence",
            Self::Commit => "commit",
            Self::Chain => "chain",
        })
    }
}

/// Which rules the simulated nodes follow.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Rules {
    pub(crate) up_to_date: bool,
    pub(crate) commit_term: bool,
    check_quorum: bool,
    leader_lease: bool,
    fence: bool,
    commit: bool,
    chain: bool,
}

impl Rules {
    fn without(rule: Option<Rule>) -> Self {
        let on = |r: Rule| rule != Some(r);
        Self {
            up_to_date: on(Rule::UpToDate),
            commit_term: on(Rule::CommitTerm),
            check_quorum: on(Rule::CheckQuorum),
            leader_lease: on(Rule::LeaderLease),
            fence: on(Rule::Fence),
            commit: on(Rule::Commit),
            chain: on(Rule::Chain),
        }
    }
}

/// The invariants checked after every step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum Invariant {
    /// (a) No worker applies two different updates for the same round.
    OneUpdatePerRound,
    /// (b) Every worker's chain of applied parameters is a prefix of one history.
    OneHistory,
    /// (c) A state released to workers is never lost or changed.
    ReleasedKept,
    /// (d) Once faults heal, a worker trains from a round completed since within
    /// [`progress_bound_ms`].
    Progress,
    /// (e) Once faults heal, at most 2 × candidates + 2 terms are taken.
    TermChurn,
    /// (f) Every worker up (not crashed for good) applies a state completed after
    /// the heal within twice [`progress_bound_ms`].
    WorkersCatchUp,
}

impl fmt::Display for Invariant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::OneUpdatePerRound => "(a)",
            Self::OneHistory => "(b)",
            Self::ReleasedKept => "(c)",
            Self::Progress => "(d)",
            Self::TermChurn => "(e)",
            Self::WorkersCatchUp => "(f)",
        })
    }
}

/// A broken invariant: which, when (simulated ms) and how.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Violation {
    /// Which invariant.
    pub invariant: Invariant,
    /// When, simulated ms.
    pub at_ms: u64,
    /// What happened.
    pub detail: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invariant {} broken at t={:.3}s: {}", self.invariant, self.at_ms as f64 / 1e3, self.detail)
    }
}

/// What one seeded schedule did.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Outcome {
    /// The seed.
    pub seed: u64,
    /// The rule left out, if any.
    pub without: Option<Rule>,
    /// Coordinator candidates (drawn from the seed: 3 mostly, some 5, some 2).
    pub candidates: usize,
    /// Failover is best effort: two candidates (or one), no majority to survive
    /// the loss of one, and the nemesis leaves out what they cannot survive.
    pub best_effort: bool,
    /// The shortest and longest a state blob takes to transfer, ms.
    pub transfer_ms: (u64, u64),
    /// What happened: faults, terms, rounds, steps aside and down, deferrals.
    pub log: Vec<String>,
    /// The first broken invariant, if any.
    pub violation: Option<Violation>,
    /// When the last fault healed, simulated ms.
    pub healed_ms: u64,
    /// Invariant (d)'s bound, ms after the heal ([`progress_bound_ms`]).
    pub progress_bound_ms: u64,
    /// When a worker first trained from a round completed after the heal.
    pub progress_ms: Option<u64>,
    /// When every worker up had trained from a round completed after the heal.
    pub caught_up_ms: Option<u64>,
    /// The highest round completed.
    pub rounds: u64,
    /// The highest term taken.
    pub terms: u64,
    /// Events simulated.
    pub events: u64,
}

impl Outcome {
    /// The report `pcp-node simulate --faults` prints.
    pub fn write(&self, out: &mut impl Write) -> std::io::Result<()> {
        let without = self.without.map(|r| format!(", without the {r} rule")).unwrap_or_default();
        let mode = if self.best_effort { " (failover best-effort)" } else { "" };
        let (short, long) = self.transfer_ms;
        writeln!(
            out,
            "fault simulation, seed {}{without}: {} candidates{mode}, {WORKERS} workers, lease {LEASE_MS} ms, \
             state transfers {:.1}-{:.1} s",
            self.seed,
            self.candidates,
            short as f64 / 1e3,
            long as f64 / 1e3
        )?;
        for line in &self.log {
            writeln!(out, "{line}")?;
        }
        let secs = |ms: u64| ms as f64 / 1e3;
        match (&self.violation, self.progress_ms, self.caught_up_ms) {
            (Some(v), _, _) => writeln!(out, "{v}"),
            (None, Some(p), Some(all)) => writeln!(
                out,
                "ok: faults healed at {:.3}s and {:.3}s later a worker trained from a round completed since \
                 (bound {:.1}s), every worker up {:.3}s later; {} rounds, term {}, {} events; \
                 invariants (a) to (f) held",
                secs(self.healed_ms),
                secs(p.saturating_sub(self.healed_ms)),
                secs(self.progress_bound_ms),
                secs(all.saturating_sub(self.healed_ms)),
                self.rounds,
                self.terms,
                self.events
            ),
            (None, _, _) => writeln!(out, "stopped before the faults healed"),
        }
    }
}

/// Runs seed `seed`'s schedule, without `without` if given.
pub fn simulate(seed: u64, without: Option<Rule>) -> Outcome {
    World::new(seed, Rules::without(without)).run(without)
}

/// [`simulate`], with every candidate's run recorded (one recording per start of
/// a candidate): what [`pcp_protocol::failover::candidate::trace::replay`] replays.
pub fn simulate_traced(seed: u64) -> (Outcome, Vec<pcp_protocol::failover::candidate::trace::Trace>) {
    World::new(seed, Rules::without(None)).traced().run_traced(None)
}

/// The parameters hash: blake3 of the f32 bytes.
fn params_hash(params: &Tensors) -> [u8; 32] {
    let mut h = blake3::Hasher::new();
    for t in params {
        for v in t {
            h.update(&v.to_le_bytes());
        }
    }
    *h.finalize().as_bytes()
}
