//! Parameter-shard aggregators in the DiLoCo star: the round's sum split into
//! `shards` shards, each summed by `replicas` volunteers, driven by the
//! protocol's own rules ([`pcp_protocol::diloco::aggregation`]: [`assign`],
//! [`Votes`], [`spot_checked`]).
//!
//! What is modelled, and how:
//! * **Volunteers.** `shards × replicas` volunteers (nodes that offered
//!   `--aggregate`) with links drawn from their own profile, in their own RNG
//!   stream; a share of them is hostile, of one kind ([`HostileAggregator`]). Their
//!   aggregation is modelled on a link and cores of their own (a volunteer that
//!   also trains is not slowed by it). Each round's assignment is the protocol's
//!   [`assign`] over the volunteers not caught yet, so once liars are dropped the
//!   others take more shards.
//! * **Uploads.** A worker sends each shard's slice once, to the shard's first
//!   replica, which forwards it to the others (a forward cannot be altered: the
//!   worker's commitment names the slice's hash; one withheld is a replica's
//!   silence). So a worker uploads its contribution's bytes once, through the
//!   volunteers' downlinks together less the forwards (balanced assignment spreads
//!   every contribution evenly), and its signed commitment (the slices' hashes) to
//!   the shepherd. A forwarded slice arrives at the lower of the first replica's
//!   uplink and the receiver's downlink.
//! * **The shepherd per contribution** checks the commitment's signature and the
//!   aggregators' reports of the slices' norms ([`commitment_s`]): no decode, no
//!   add. It learns a contribution once its slices are uploaded and reported
//!   (one report interval later).
//! * **A volunteer's shard** is ready once its downlink has taken every slice of the
//!   round (at its own rate, from the first arrival, and no sooner than the last
//!   one's own transfer) and its cores have checked, added and kept them (the
//!   calibration table's decode and add, and [`SERVE_S_PER_BYTE`], the shard's
//!   share of them).
//! * **Votes.** An honest replica signs the true hash when its shard is ready;
//!   `agg-alter` and `agg-drop` sign another hash then (liars agree with each
//!   other: the worst case); `agg-stall` never answers. A spot-checked shard
//!   (drawn at `--aggregator-spot-rate` from the shepherd's secret, as pcp-node
//!   draws it, at the share the round's contributions give where the node counts
//!   its participants) is summed by the shepherd whatever its votes, as the round
//!   gathers: every spot-checked slice read through the shepherd's downlink from
//!   one report interval after the first contribution reached the aggregators, and
//!   added on its aggregate threads, the last once the round closed; its sum is
//!   taken once the votes are in (or their wait is over). The shepherd applies a
//!   shard all its voters agree on; a disagreement recomputes it as soon as the
//!   votes are in, and silence at the vote deadline. A recompute reads the shard's
//!   slices from the workers (through the shepherd's downlink) and decodes and
//!   adds them on its aggregate threads, one shard after another; every replica
//!   [`Votes::liars`] names is dropped for good.
//! * **The close** gathers every shard's mean (the fp32 parameters' bytes through
//!   the shepherd's downlink, or the volunteers' uplinks together if slower),
//!   then runs the shepherd's own close.
//! * **Seeding.** Volunteers fetch each round's blobs (parameters, update) first
//!   and serve them: the swarm's capacity starts at the shepherd's uplink plus
//!   theirs.
//!
//! * **Committees** (`--screeners` with the score screen) fetch a contribution's
//!   slices from its shards' volunteers, as pcp-node's members do: the worker
//!   uploads once, and the volunteers' uplinks together serve the K copies
//!   (`Sim::committee_delay`).
//!
//! Not modelled: a volunteer's links shared with its own training, the
//! aggregators' request queues, retries of a failed slice upload, and a
//! committee's fetch falling back to the sender (the volunteers here hold
//! every slice they took).

use pcp_protocol::diloco::aggregation::{Assignment, Outcome, Votes, assign, spot_checked, spot_share};
use serde::Serialize;

use crate::network::{Link, Profile};
use crate::world::{Stream, rng};

/// Core-seconds a volunteer spends a byte of a slice it keeps as a blob to serve
/// committees (hashing and writing it, unsynced: pcp-node's aggregator on a
/// blocking thread): 2.3 ns for gpt2-124m's embedding slice (2.4 MB), 0.85 ns for
/// a 50 KB one, measured with `BlobStore::put_stream_with` on a 2-core Intel Xeon,
/// not the calibration table's AMD EPYC; the larger is taken.
pub const SERVE_S_PER_BYTE: f64 = 2.3e-9;

/// What hostile aggregators do (`--hostile-aggregators KIND:SHARE`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum HostileAggregator {
    /// Signs a wrong sum.
    AggAlter,
    /// Leaves inputs out (a wrong sum, too).
    AggDrop,
    /// Never answers.
    AggStall,
}

/// The aggregators of a run.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct AggregatorSetup {
    /// Shards the round's sum is split into (`--aggregators`).
    pub shards: usize,
    /// Volunteers summing each shard (`--aggregator-replicas`).
    pub replicas: usize,
    /// Volunteers' link profile.
    pub profile: Profile,
    /// Cores each volunteer adds on.
    pub cores: usize,
    /// Share of shards the shepherd recomputes whatever the votes.
    pub spot_rate: f64,
    /// Hostile volunteers: their kind and share.
    pub hostile: Option<(HostileAggregator, f64)>,
    /// Seconds after the close a shard's votes are waited for.
    pub vote_timeout_s: f64,
    /// Seconds from a slice's arrival to its report reaching the shepherd.
    pub report_s: f64,
    /// Event-loop seconds the shepherd spends on one contribution's commitment and
    /// reports ([`commitment_s`]).
    pub commit_s: f64,
    /// Bytes of one contribution's commitment and reports into the shepherd.
    pub commit_bytes: f64,
}

/// One volunteer.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Volunteer {
    link: Link,
    hostile: Option<HostileAggregator>,
    caught: bool,
}

/// What the aggregators did over a run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct AggregatorTotals {
    /// Rounds summed by aggregators (the rest the shepherd summed alone).
    pub rounds: u64,
    /// Shards applied on their replicas' agreement.
    pub agreed: u64,
    /// Shards the shepherd recomputed (disputes, silence, spot checks).
    pub recomputed: u64,
    /// Shards spot-checked (recomputed by the shepherd).
    pub spot_checks: u64,
    /// Volunteers caught lying or silent (each loses the role).
    pub caught: u64,
    /// Seconds the shepherd spent recomputing shards.
    pub recompute_s: f64,
    /// Seconds from a round's close to every shard's mean gathered, summed.
    pub wait_s: f64,
    /// Wrong sums applied: only a shard whose replicas all lie alike, and no spot
    /// check drawn, can be.
    pub applied_wrong: u64,
}

/// What a round's aggregation costs the shepherd at its close.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Closed {
    /// When every shard's mean is with the shepherd, µs.
    pub ready_us: u64,
    /// The shepherd's seconds of recomputing, on its aggregate threads.
    pub recompute_s: f64,
}

/// The volunteers and their record.
#[derive(Debug)]
pub struct Pool {
    setup: AggregatorSetup,
    volunteers: Vec<Volunteer>,
    seed: [u8; 32],
    /// The open round's assignment.
    assignment: Option<Assignment<[u8; 4]>>,
    /// Contributions that reached the volunteers since the last close: how many,
    /// the first's arrival and the last's, µs.
    inflow: Option<(u64, u64, u64)>,
    /// Totals.
    pub totals: AggregatorTotals,
}

fn us(s: f64) -> u64 {
    (s.max(0.0) * 1e6).round() as u64
}

fn key(i: usize) -> [u8; 4] {
    (i as u32).to_le_bytes()
}

/// Bytes of one contribution's commitment (a hash a shard) and its aggregators'
/// reports (12 bytes a tensor from each replica: raw norm, largest magnitude,
/// bounded norm).
pub fn commitment_bytes(shards: usize, replicas: usize, tensors: usize) -> f64 {
    (shards * 32 + replicas * tensors * 12) as f64
}

/// Event-loop seconds the shepherd spends on one contribution's commitment and its
/// aggregators' reports: the worker's signature checked, and the bytes hashed and
/// parsed at `per_byte_s` (reports come in signed batches, whose signatures are
/// left out).
pub fn commitment_s(verify_s: f64, per_byte_s: f64, bytes: f64) -> f64 {
    verify_s + bytes * per_byte_s
}

impl Pool {
    /// Draws `shards × replicas` volunteers from the run's `seed`.
    pub fn new(setup: AggregatorSetup, seed: u64) -> Self {
        use rand::Rng;
        let mut r = rng(seed, Stream::Aggregators);
        let n = setup.shards * setup.replicas;
        let mut volunteers: Vec<Volunteer> =
            (0..n).map(|_| Volunteer { link: setup.profile.draw(&mut r), hostile: None, caught: false }).collect();
        if let Some((kind, share)) = setup.hostile {
            for v in volunteers.iter_mut() {
                if r.r#gen::<f64>() < share {
                    v.hostile = Some(kind);
                }
            }
        }
        let mut s = [0u8; 32];
        s[..8].copy_from_slice(&seed.to_le_bytes());
        Self { setup, volunteers, seed: s, assignment: None, inflow: None, totals: AggregatorTotals::default() }
    }

    /// The setup.
    pub fn setup(&self) -> &AggregatorSetup {
        &self.setup
    }

    /// Assigns round `round`'s shards; `false` when too few volunteers are left (the
    /// shepherd sums alone).
    pub fn open(&mut self, round: u64) -> bool {
        let live: Vec<[u8; 4]> =
            self.volunteers.iter().enumerate().filter(|(_, v)| !v.caught).map(|(i, _)| key(i)).collect();
        self.assignment = assign(&self.seed, round, self.setup.shards, self.setup.replicas, &live);
        self.assignment.is_some()
    }

    /// A contribution's slices reached the volunteers at `now`, µs.
    pub fn arrived(&mut self, now: u64) {
        let (n, first, last) = self.inflow.unwrap_or((0, now, now));
        self.inflow = Some((n + 1, first.min(now), last.max(now)));
    }

    /// The contributions that arrived since the last call ([`Pool::arrived`]): how
    /// many, the first's arrival and the last's (`now` when none).
    pub fn inflow(&mut self, now: u64) -> (u64, u64, u64) {
        self.inflow.take().unwrap_or((0, now, now))
    }

    /// Whether the open round is aggregated.
    pub fn active(&self) -> bool {
        self.assignment.is_some()
    }

    /// The volunteers' downlinks together: what every upload of the round shares.
    pub fn down(&self) -> f64 {
        self.live().map(|v| v.link.down).sum()
    }

    /// The volunteers' uplinks together: what they add to the swarm that serves a
    /// round's blobs.
    pub fn up(&self) -> f64 {
        self.live().map(|v| v.link.up).sum()
    }

    fn live(&self) -> impl Iterator<Item = &Volunteer> {
        self.volunteers.iter().filter(|v| !v.caught)
    }

    /// Round `round` closed at `close_us` with `n` contributions of `bytes` each,
    /// the first reaching the aggregators at `first_us` and the last at `last_us`;
    /// `slice_core_s` is the core-seconds to check and add one whole contribution,
    /// `shepherd_down` the shepherd's downlink and `threads` its aggregate threads.
    /// Returns when the shard means are gathered.
    #[expect(clippy::too_many_arguments, reason = "one round's figures, named at the call")]
    pub fn close(
        &mut self,
        round: u64,
        close_us: u64,
        (n, first_us, last_us): (u64, u64, u64),
        bytes: f64,
        slice_core_s: f64,
        params_bytes: f64,
        (shepherd_down, threads): (f64, usize),
    ) -> Closed {
        let Some(assignment) = self.assignment.take() else {
            return Closed { ready_us: close_us, recompute_s: 0.0 };
        };
        self.totals.rounds += 1;
        let shards = assignment.shards().max(1);
        let slice = bytes / shards as f64;
        let (first, last) = (first_us as f64 / 1e6, last_us as f64 / 1e6);
        let close = close_us as f64 / 1e6;
        let timeout = close + self.setup.vote_timeout_s;
        // each volunteer's shards, and when it has summed them all
        // (slices are checked and added as they arrive: the last one's add is left at the end)
        let ready = |v: &Volunteer, load: usize, from: Option<&Volunteer>| {
            let inbound = n as f64 * slice * load as f64;
            let down = from.map_or(v.link.down, |f| f.link.up.min(v.link.down)).max(1.0);
            let received = (first + inbound / down).max(last + slice * load as f64 / down);
            // besides checking and adding a slice, a volunteer keeps it as a blob it serves
            let core_s = slice_core_s + SERVE_S_PER_BYTE * bytes;
            let one = core_s * load as f64 / shards as f64 / self.setup.cores.max(1) as f64;
            received.max(first + n as f64 * one).max(close) + one
        };
        // a spot check is the shepherd's own, as pcp-node's: drawn when the round is
        // assigned, it sums the shard itself as the round gathers, fetching each slice
        // once it is accepted (one report after it reached its aggregators)
        let share = spot_share(self.setup.spot_rate, n);
        let spots: Vec<bool> = (0..shards).map(|s| spot_checked(&self.seed, round, s, share)).collect();
        let checked = spots.iter().filter(|s| **s).count() as f64;
        let (spot_ready, spot_s) = {
            let down = shepherd_down.max(1.0);
            let (from, to) = (first + self.setup.report_s, last + self.setup.report_s);
            let received = (from + n as f64 * slice * checked / down).max(to + slice * checked / down);
            let one = slice_core_s * checked / shards as f64 / threads.max(1) as f64;
            let ready = received.max(from + n as f64 * one).max(close) + one;
            (ready, n as f64 * (slice * checked / down + one))
        };
        let mut recompute_s = if checked > 0.0 { spot_s } else { 0.0 };
        let mut recompute_at = close;
        let mut gathered = close;
        for (s, spot) in spots.into_iter().enumerate() {
            let replicas = assignment.replicas(s).to_vec();
            let mut votes = Votes::new(replicas.clone());
            let mut voted_at = close;
            let mut silent = false;
            let first_replica = replicas.first().map(|k| self.volunteers[u32::from_le_bytes(*k) as usize]);
            for (j, k) in replicas.iter().enumerate() {
                let i = u32::from_le_bytes(*k) as usize;
                let v = self.volunteers[i];
                let load = assignment.shards_of(k).len() + usize::from(j >= self.setup.replicas);
                let at = ready(&v, load, first_replica.as_ref().filter(|_| j > 0));
                let hash = match v.hostile {
                    None => [1; 32],
                    Some(HostileAggregator::AggAlter) => [2; 32],
                    Some(HostileAggregator::AggDrop) => [3; 32],
                    Some(HostileAggregator::AggStall) => {
                        silent = true;
                        continue;
                    }
                };
                let _ = votes.vote(k, hash);
                voted_at = voted_at.max(at);
            }
            if spot {
                self.totals.spot_checks += 1;
            }
            let outcome = match votes.outcome(spot, false) {
                Outcome::Waiting if silent => votes.outcome(spot, true),
                o => o,
            };
            match outcome {
                Outcome::Agreed(hash) => {
                    self.totals.agreed += 1;
                    if hash != [1; 32] {
                        self.totals.applied_wrong += 1;
                    }
                    gathered = gathered.max(voted_at);
                }
                Outcome::Recompute | Outcome::Waiting => {
                    self.totals.recomputed += 1;
                    // disputes are known once the votes are in; silence at the deadline
                    let known = if silent { timeout.max(voted_at) } else { voted_at };
                    if spot {
                        // summed as the round gathered: its votes, or their wait, decide when
                        gathered = gathered.max(known.max(spot_ready));
                    } else {
                        let read = n as f64 * slice / shepherd_down.max(1.0);
                        let cpu = n as f64 * slice_core_s / shards as f64 / threads.max(1) as f64;
                        recompute_at = recompute_at.max(known) + read + cpu;
                        recompute_s += read + cpu;
                    }
                    for liar in votes.liars(&[1; 32]) {
                        let v = &mut self.volunteers[u32::from_le_bytes(liar) as usize];
                        if !v.caught {
                            v.caught = true;
                            self.totals.caught += 1;
                        }
                    }
                }
            }
        }
        let up: f64 = self.live().map(|v| v.link.up).sum();
        let gather = params_bytes / shepherd_down.min(up).max(1.0);
        let ready = gathered.max(recompute_at) + gather;
        self.totals.recompute_s += recompute_s;
        self.totals.wait_s += ready - close;
        Closed { ready_us: us(ready), recompute_s }
    }
}

#[cfg(test)]
mod tests;
