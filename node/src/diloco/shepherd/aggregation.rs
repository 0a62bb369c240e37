//! Aggregated rounds, the shepherd's side (`--aggregators N`): who sums which
//! parameter shard (in the announcement), the workers' slice commitments, the
//! aggregators' reports fed to the state machine as [`Input::Reported`], the
//! accepted list sent to them ([`Accepts`]), their votes on each shard's mean,
//! and the means fetched, checked against the agreed hash and handed back
//! ([`Input::Aggregated`]). A shard whose aggregators disagree or fall silent
//! is summed here from the committed slices, fetched from the workers, and the
//! aggregators whose vote differs lose the role for the run
//! (`aggregate_disputed`).

use std::collections::{BTreeMap, BTreeSet};
use std::ops::Range;
use std::time::{Duration, Instant};

use pcp_bootstrap::InboundId;
use pcp_protocol::BlobHash;
use pcp_protocol::diloco::aggregate::{Bounds, Delta, Rejection};
use pcp_protocol::diloco::aggregation::{
    Collect, Outcome, Reported, ShardUpdate, SliceReport, assign, inspect, shard_bounds, shard_tensors,
};
use pcp_protocol::diloco::compress::{self, Encoding};
use pcp_protocol::diloco::shepherd::{self, Input, Report};
use pcp_protocol::{PublicKey, Verified};
use pcp_schema::{AcceptEntry, Accepts, Ack, Contribution, ShardAggregators, ShardVote, SliceReports};
use tokio::task::JoinSet;

use self::spot::{Feed, Spot};
use super::Host;
use super::committees::Deferral;
use crate::diloco::wire::{self, peer_name};
use crate::observe::events as ev;

mod spot;

/// How long after a round's close its shards' votes are waited for before the
/// shepherd sums the missing shards itself: this many times as long as the last
/// round's took to gather, within [`MIN_VOTE_WAIT`] and [`MAX_VOTE_WAIT`] (the
/// maximum before any round gathered).
const VOTE_WAIT_FACTOR: u32 = 4;
const MIN_VOTE_WAIT: Duration = Duration::from_secs(2);
const MAX_VOTE_WAIT: Duration = Duration::from_secs(30);
/// The least a round that averages a contribution carried from the round before
/// waits for its votes: that contribution's slices went to the last round's
/// aggregators, so this round's fetch them from its worker at the close, and an
/// aggregator gives such a fetch up 15 s after the close. Honest replicas still
/// fetching are not silent ones.
const FETCHING_VOTE_WAIT: Duration = Duration::from_secs(20);
/// Volunteers kept at most: the largest run's participants.
const MAX_VOLUNTEERS: usize = 16_384;
/// Blob fetches of shard means and slices give up after this long.
const FETCH_TIMEOUT: Duration = Duration::from_secs(60);

/// A committed contribution's claim: what the state machine takes once its
/// aggregators' reports agree.
#[derive(Debug, Clone, Copy)]
struct Claim {
    samples: u64,
    loss: f32,
    timing: shepherd::Timing,
    /// Fed to the state machine already.
    fed: bool,
}

/// One aggregated round.
#[derive(Debug)]
struct Record {
    collect: Collect<[u8; 32]>,
    /// Each shard's tensors.
    tensors: Vec<Range<usize>>,
    /// The round's per-tensor bounds.
    bounds: Bounds,
    /// Each shard's replicas.
    replicas: Vec<Vec<[u8; 32]>>,
    claims: BTreeMap<[u8; 32], Claim>,
    /// The accepted list, in order: each worker's slice hashes (its round's).
    accepted: Vec<AcceptEntry>,
    /// Accepts not yet sent.
    unsent: usize,
    /// The count was sent with them.
    close_sent: bool,
    /// The contributions added, once closed, and when.
    closed: Option<(u64, Instant)>,
    /// Shard means in, by shard.
    means: BTreeMap<usize, (ShardUpdate, bool)>,
    /// Shards being fetched or summed here.
    busy: BTreeSet<usize>,
    /// Disputed slices (worker, shard) being inspected here.
    inspecting: BTreeSet<([u8; 32], usize)>,
    /// When each slice (worker, shard) still missing a replica's report got its first.
    waiting: BTreeMap<([u8; 32], usize), Instant>,
    /// The spot-checked shards, summed here as the round gathers.
    spots: BTreeMap<usize, Spot>,
    /// A contribution made for the round before was added (its slices are fetched
    /// by this round's aggregators: see [`FETCHING_VOTE_WAIT`]).
    carried: bool,
}

/// A contribution whose reports are settled: its worker, its bounded norm and
/// each tensor's raw (norm, largest magnitude).
type Settled = ([u8; 32], f64, Vec<(f64, f32)>);

/// What a fetch brought back.
#[derive(Debug)]
pub(super) enum Fetched {
    /// A shard's mean from a voter, or why it could not be had.
    Mean { round: u64, shard: usize, hash: [u8; 32], bytes: Result<Vec<u8>, String> },
    /// A shard summed here from its committed slices.
    Summed { round: u64, shard: usize, update: Result<ShardUpdate, String> },
    /// A spot-checked shard summed here as its round gathered.
    Spot { round: u64, shard: usize, update: Result<ShardUpdate, String> },
    /// A disputed slice (`silent`: one a replica did not report in time), inspected
    /// here: the report its replicas should have sent.
    Inspected { round: u64, worker: [u8; 32], shard: usize, silent: bool, report: Result<SliceReport, String> },
}

/// The shepherd's aggregation: the volunteers and the aggregated rounds.
#[derive(Debug)]
pub(super) struct Aggregation {
    /// This shepherd's secret for drawing the spot-checked shards: no aggregator
    /// can tell which of its shards will be checked.
    spot_seed: [u8; 32],
    /// Live workers that offered to aggregate.
    volunteers: BTreeSet<[u8; 32]>,
    /// Aggregators caught lying or silent: they never sum again in this run.
    dropped: BTreeSet<[u8; 32]>,
    rounds: BTreeMap<u64, Record>,
    pub(super) fetches: JoinSet<Fetched>,
    /// How long the last round whose aggregators all agreed took from its close
    /// to its last shard's mean.
    gathered: Option<Duration>,
    /// When the last slice reports came.
    reported: Option<Instant>,
}

/// A round's deadline waits for committed contributions whose reports have not
/// all come only while reports keep coming, at most this long apart: a worker
/// that commits and never sends its slices holds no round.
const REPORTS_FLOWING: Duration = Duration::from_secs(2);

impl Default for Aggregation {
    fn default() -> Self {
        Self {
            spot_seed: rand::random(),
            volunteers: BTreeSet::new(),
            dropped: BTreeSet::new(),
            rounds: BTreeMap::new(),
            fetches: JoinSet::new(),
            gathered: None,
            reported: None,
        }
    }
}

impl Aggregation {
    /// `key` offered to aggregate in its hello.
    /// Volunteers are at most [`MAX_VOLUNTEERS`]: past it, those that are no
    /// longer `live` workers are forgotten, and a new one is not kept while it
    /// stays full (hellos that never become workers cannot grow the set).
    pub(super) fn volunteered(&mut self, key: PublicKey, live: impl Fn(&[u8; 32]) -> bool) {
        if self.volunteers.len() >= MAX_VOLUNTEERS {
            self.volunteers.retain(|k| live(k));
        }
        if self.volunteers.len() < MAX_VOLUNTEERS {
            self.volunteers.insert(key.0);
        }
    }

    /// `key` left the run.
    pub(super) fn left(&mut self, key: &PublicKey) {
        self.volunteers.remove(&key.0);
    }

    /// Contributions to `round` whose commitments were taken and whose slices'
    /// reports are still coming in (within [`REPORTS_FLOWING`] of the last):
    /// their slices are on their way, as a contribution being read is.
    pub(super) fn arriving(&self, round: u64) -> usize {
        if self.reported.is_none_or(|at| at.elapsed() > REPORTS_FLOWING) {
            return 0;
        }
        self.rounds.get(&round).map_or(0, |r| r.claims.values().filter(|c| !c.fed).count())
    }
}

impl Host {
    /// Round `round`'s aggregators, for its announcement (empty: the shepherd sums
    /// alone): `--aggregators` shards over the rated, live volunteers among its
    /// participants, drawn from the run's id ([`assign`]).
    pub(super) fn assign_aggregators(&mut self, round: u64, participants: &[PublicKey]) -> Vec<ShardAggregators> {
        let a = self.plan.aggregation;
        let strided = self.plan.encoding.sparse().is_some_and(|s| s.up.strided);
        // the score screen is its committees', which screen an aggregated contribution
        // from its slices; the shepherd's own screen needs it whole
        let unscreened = self.plan.screen == super::args::Screen::Score && !self.screener.committees_open_in(round);
        if a.shards == 0 || unscreened || self.layout.fragments.len() > 1 || strided {
            return Vec::new();
        }
        let agg = &self.aggregation;
        let volunteers: Vec<[u8; 32]> = participants
            .iter()
            .filter(|p| agg.volunteers.contains(&p.0) && !agg.dropped.contains(&p.0))
            .filter(|p| self.machine.config().rating.is_none() || !self.machine.ratings().on_probation(p))
            .map(|p| p.0)
            .collect();
        let Some(tensors) = shard_tensors(&self.layout.sizes, a.shards) else { return Vec::new() };
        let Some(assignment) = assign(&self.run.0, round, tensors.len(), a.replicas, &volunteers) else {
            return Vec::new();
        };
        let bounds = self.machine.round_bounds().cloned().unwrap_or_else(Bounds::none);
        let replicas: Vec<Vec<[u8; 32]>> = (0..tensors.len()).map(|s| assignment.replicas(s).to_vec()).collect();
        let entries = tensors
            .iter()
            .zip(&replicas)
            .map(|(t, r)| {
                let cut = shard_bounds(&bounds, t);
                ShardAggregators {
                    replicas: r.clone(),
                    auditor: None,
                    tensor_bounds: cut.tensor,
                    element_bounds: cut.element,
                }
            })
            .collect();
        let mut assigned: BTreeMap<[u8; 32], Vec<u64>> = BTreeMap::new();
        for (s, r) in replicas.iter().enumerate() {
            for key in r {
                assigned.entry(*key).or_default().push(s as u64);
            }
        }
        for (key, shards) in assigned {
            let peer = peer_name(&PublicKey(key));
            self.events.emit(ev::Event::AggregatorAssigned(ev::AggregatorAssigned { round, peer, shards }));
        }
        let collect = Collect::new(assignment, tensors.clone(), replicas.clone(), participants.len());
        let record = Record {
            collect,
            tensors,
            bounds,
            replicas,
            claims: BTreeMap::new(),
            accepted: Vec::new(),
            unsent: 0,
            close_sent: false,
            closed: None,
            means: BTreeMap::new(),
            busy: BTreeSet::new(),
            inspecting: BTreeSet::new(),
            waiting: BTreeMap::new(),
            spots: BTreeMap::new(),
            carried: false,
        };
        self.aggregation.rounds.insert(round, record);
        self.start_spot_checks(round, participants.len() as u64);
        // an aggregated round is kept until applied, and the one before for its late commitments
        let keep = round.saturating_sub(1);
        self.aggregation.rounds.retain(|r, _| *r >= keep);
        entries
    }

    /// A worker's commitment to its slices of an aggregated round: kept, and
    /// answered at once (its acceptance comes with its aggregators' reports).
    pub(super) async fn on_commitment(&mut self, id: InboundId, key: PublicKey, c: Contribution) -> anyhow::Result<()> {
        let round = c.round;
        let refused = match self.aggregation.rounds.get_mut(&round) {
            None => Some(format!("round {round} is not aggregated: send the contribution whole")),
            Some(_) if c.run != self.run.0 => Some("the commitment names another run".to_owned()),
            Some(record) => match record.collect.commit(key.0, c.slice_hashes.clone()) {
                Ok(()) => {
                    let transfer_ms = match c.sent_unix_ms {
                        0 => 0,
                        sent => wire::unix_ms().saturating_sub(sent),
                    };
                    let timing =
                        shepherd::Timing { steps: u64::from(c.inner_steps), train_ms: c.train_ms, transfer_ms };
                    record.claims.insert(key.0, Claim { samples: c.samples, loss: c.loss, timing, fed: false });
                    None
                }
                Err(e) => Some(format!("slice commitment refused: {e}")),
            },
        };
        let ack = match &refused {
            None => Ack::accept(self.run.0, round),
            Some(reason) => {
                self.events.emit(ev::Event::ContributionRejected(ev::ContributionRejected {
                    round,
                    peer: peer_name(&key),
                    reason: reason.clone(),
                }));
                Ack::refuse(self.run.0, round, pcp_schema::AckCode::Malformed, reason.clone())
            }
        };
        let envelope = self.signer.seal(self.run, round, &ack);
        self.respond(id, envelope).await
    }

    /// An aggregator's reports of the slices it holds: each contribution whose
    /// replicas all agree goes to the state machine.
    pub(super) async fn on_slice_reports(&mut self, id: InboundId, message: &Verified) -> anyhow::Result<()> {
        let from = message.signer();
        let reports: SliceReports = match message.decode() {
            Ok(r) => r,
            Err(e) => return self.refuse(id, message.binding().round, format!("bad slice reports: {e}")).await,
        };
        let round = reports.round;
        self.aggregation.reported = Some(Instant::now());
        let (mut ready, mut disputed) = (Vec::new(), Vec::new());
        if let Some(record) = self.aggregation.rounds.get_mut(&round) {
            for e in reports.reports {
                let raw = e.norms.iter().copied().zip(e.maxes.iter().copied()).collect();
                let report = SliceReport { raw, bounded_norm: e.bounded_norm };
                match record.collect.report(&from.0, &e.worker, e.shard as usize, e.hash, report) {
                    Ok(Reported::Ready { norm, raw }) => ready.push((e.worker, norm, raw)),
                    Ok(Reported::Disputed { shard }) => disputed.push((e.worker, shard)),
                    Ok(Reported::Waiting) => {
                        // a slice waits only while a replica of its shard has not reported it
                        let key = (e.worker, e.shard as usize);
                        let replicas = record.replicas.get(key.1).map_or(0, Vec::len);
                        if record.collect.reporters(&e.worker, key.1).len() < replicas {
                            record.waiting.entry(key).or_insert_with(Instant::now);
                        } else {
                            record.waiting.remove(&key);
                        }
                    }
                    Err(err) => tracing::debug!(round, "a report of {} refused: {err}", peer_name(&from)),
                }
            }
        }
        let ack = Ack::accept(self.run.0, round);
        let envelope = self.signer.seal(self.run, round, &ack);
        self.respond(id, envelope).await?;
        for (worker, shard) in disputed {
            self.inspect_slice(round, worker, shard, false);
        }
        self.feed(round, ready).await
    }

    /// Feeds the state machine `round`'s contributions whose reports are settled:
    /// (worker, bounded norm, each tensor's raw statistics).
    async fn feed(&mut self, round: u64, ready: Vec<Settled>) -> anyhow::Result<()> {
        for (worker, norm, raw) in ready {
            let Some(claim) = self.aggregation.rounds.get_mut(&round).and_then(|r| r.claims.get_mut(&worker)) else {
                continue;
            };
            if std::mem::replace(&mut claim.fed, true) {
                continue;
            }
            let claim = *claim;
            let peer = PublicKey(worker);
            let mut input = match self.admit(peer) {
                Ok(()) => Input::Reported {
                    peer,
                    round,
                    samples: claim.samples,
                    loss: claim.loss,
                    report: Report { raw, bounded_norm: norm },
                    timing: Some(claim.timing),
                    screen: shepherd::Screen::Unscreened,
                },
                Err(refusal) => Input::Malformed { peer, round, reason: Rejection::NotAdmitted(refusal.reason) },
            };
            // under the score screen its committee screens it, its members fetching its slices
            let record = self.aggregation.rounds.get(&round);
            let hashes = record.and_then(|r| r.collect.hashes(&worker));
            if self.plan.screen == super::args::Screen::Score
                && matches!(input, Input::Reported { .. })
                && let Some(hashes) = hashes
            {
                // the shards' replicas hold the slices: members fetch them there first
                let holders = record.map_or_else(Vec::new, |r| {
                    r.replicas.iter().map(|k| k.iter().take(pcp_schema::MAX_HOLDERS).copied().collect()).collect()
                });
                let received = (claim.samples, claim.loss, 0, 0);
                input = match self.defer_reported(input, (hashes, holders), received).await? {
                    Deferral::Deferred => continue,
                    Deferral::Not(input) => *input,
                    Deferral::Full(_) => Input::Malformed { peer, round, reason: Rejection::Unscreened },
                };
            }
            self.conclude_reported(peer, round, input, (claim.samples, claim.loss)).await?;
        }
        Ok(())
    }

    /// Steps an aggregated contribution's input (`samples` and `loss` as it
    /// claimed), and records it.
    pub(super) async fn conclude_reported(
        &mut self,
        peer: PublicKey,
        round: u64,
        input: Input<PublicKey>,
        (samples, loss): (u64, f32),
    ) -> anyhow::Result<()> {
        let rejected = self.step(input).await?;
        let reason = rejected.into_iter().find(|(p, _)| *p == peer).map(|(_, r)| r);
        self.events.emit(ev::Event::ContributionReceived(ev::ContributionReceived {
            round,
            peer: peer_name(&peer),
            tokens: samples,
            loss: f64::from(loss),
            bytes: 0,
            bytes_down: 0,
            accepted: reason.is_none(),
            reason: reason.as_ref().map(ToString::to_string).unwrap_or_default(),
        }));
        Ok(())
    }

    /// The state machine added `peer`'s contribution made for round `of` to round
    /// `round`'s sum: the next place in its accepted list.
    pub(super) fn added(&mut self, (round, of): (u64, u64), peer: PublicKey, (weight, norm, bound): (f64, f64, f64)) {
        let hashes = self.aggregation.rounds.get(&of).and_then(|r| r.collect.hashes(&peer.0));
        let Some(record) = self.aggregation.rounds.get_mut(&round) else { return };
        let Some(hashes) = hashes else {
            tracing::warn!(round, "added {}'s contribution without its commitment", peer_name(&peer));
            return;
        };
        let seq = record.accepted.len() as u64;
        let hashes = hashes.into_iter().enumerate().map(|(s, h)| (s as u32, h)).collect();
        let entry = AcceptEntry { worker: peer.0, seq, weight, norm, bound, hashes };
        for spot in record.spots.values() {
            spot.feed(Feed::Entry(entry.clone()));
        }
        record.accepted.push(entry);
        record.unsent += 1;
        record.carried |= of != round;
    }

    /// The state machine closed aggregated round `round` at `count` contributions.
    pub(super) fn aggregate(&mut self, round: u64, count: u64) {
        if let Some(record) = self.aggregation.rounds.get_mut(&round) {
            record.closed = Some((count, Instant::now()));
            for spot in record.spots.values() {
                spot.feed(Feed::Closed(count));
            }
        }
    }

    /// Sends every aggregated round's accepts not yet sent (with its count once it
    /// closed) to its aggregators.
    pub(super) fn send_accepts(&mut self) {
        for (round, record) in &mut self.aggregation.rounds {
            let closed = record.closed.map(|(count, _)| count);
            if record.unsent == 0 && (closed.is_none() || record.close_sent) {
                continue;
            }
            record.close_sent = closed.is_some();
            let entries = &record.accepted[record.accepted.len() - record.unsent..];
            let mut to: BTreeMap<[u8; 32], BTreeSet<u32>> = BTreeMap::new();
            for (shard, replicas) in record.replicas.iter().enumerate() {
                for key in replicas {
                    to.entry(*key).or_default().insert(shard as u32);
                }
            }
            for (key, shards) in to {
                let Some(peer) = pcp_bootstrap::peer_of(&PublicKey(key)) else { continue };
                let node = self.node.clone();
                let envelopes: Vec<_> = accepts_for((self.run.0, *round), entries, &shards, closed)
                    .iter()
                    .map(|a| self.signer.seal(self.run, *round, a))
                    .collect();
                // in order: the count comes last
                self.background.spawn(async move {
                    for envelope in envelopes {
                        if let Err(e) = node.request(peer, envelope).await {
                            tracing::debug!(%peer, "sending accepts: {e}");
                        }
                    }
                });
            }
            record.unsent = 0;
        }
    }

    /// An aggregator's vote on a shard's mean: once every replica agrees, the mean
    /// is fetched from the voter.
    pub(super) async fn on_shard_vote(&mut self, id: InboundId, message: &Verified) -> anyhow::Result<()> {
        let from = message.signer();
        let vote: ShardVote = match message.decode() {
            Ok(v) => v,
            Err(e) => return self.refuse(id, message.binding().round, format!("bad shard vote: {e}")).await,
        };
        let (round, shard) = (vote.round, vote.shard as usize);
        let ack = Ack::accept(self.run.0, round);
        let envelope = self.signer.seal(self.run, round, &ack);
        self.respond(id, envelope).await?;
        let Some(record) = self.aggregation.rounds.get_mut(&round) else { return Ok(()) };
        let Ok((hash, blob)) = vote.outcome else {
            tracing::warn!(round, shard, "{} could not sum its shard", peer_name(&from));
            return Ok(());
        };
        if let Err(e) = record.collect.vote(&from.0, shard, hash) {
            tracing::debug!(round, shard, "a vote of {} refused: {e}", peer_name(&from));
            return Ok(());
        }
        if record.means.contains_key(&shard) || record.busy.contains(&shard) {
            return Ok(());
        }
        let spot = record.spots.contains_key(&shard);
        match record.collect.outcome(shard, spot, false) {
            Outcome::Waiting => {}
            Outcome::Recompute if spot => self.spot_checked(round, shard),
            Outcome::Agreed(hash) => {
                record.busy.insert(shard);
                let (node, peer) = (self.node.clone(), pcp_bootstrap::peer_of(&from));
                // a mean is exactly its shard's fp32 message and divisor: no larger blob is read
                let sizes: Vec<usize> = record.tensors[shard].clone().map(|i| self.layout.sizes[i]).collect();
                let max = ShardUpdate::blob_len(&sizes) as u64;
                self.aggregation.fetches.spawn(async move {
                    let from = peer.into_iter().collect();
                    let bytes = wire::fetch_bounded(&node, BlobHash(blob.blob), from, (FETCH_TIMEOUT, max)).await;
                    Fetched::Mean { round, shard, hash, bytes }
                });
            }
            Outcome::Recompute => self.recompute(round, shard, "its aggregators' votes differ"),
        }
        Ok(())
    }

    /// The replicas of `shard` disagree on `worker`'s slice (`silent`: one did not
    /// report it in time): the shepherd fetches the committed slice from its worker
    /// and inspects it itself.
    fn inspect_slice(&mut self, round: u64, worker: [u8; 32], shard: usize, silent: bool) {
        let Some(record) = self.aggregation.rounds.get_mut(&round) else { return };
        let Some(hash) = record.collect.hashes(&worker).and_then(|h| h.get(shard).copied()) else { return };
        if !record.inspecting.insert((worker, shard)) {
            return;
        }
        let why = if silent { "a replica did not report" } else { "replicas disagree on" };
        tracing::warn!(round, shard, "{why} {}'s slice: inspecting it here", peer_name(&PublicKey(worker)));
        let sizes: Vec<usize> = record.tensors[shard].clone().map(|i| self.layout.sizes[i]).collect();
        let bounds = shard_bounds(&record.bounds, &record.tensors[shard]);
        let (node, encoding) = (self.node.clone(), self.plan.encoding);
        self.aggregation.fetches.spawn(async move {
            let report = inspect_here(&node, (worker, hash), &sizes, &bounds, encoding).await;
            Fetched::Inspected { round, worker, shard, silent, report }
        });
    }

    /// A disputed slice inspected here settles its report: the replicas that
    /// reported otherwise never sum again, and a contribution now settled goes to
    /// the state machine.
    async fn on_inspected(
        &mut self,
        (round, worker, shard, silent): (u64, [u8; 32], usize, bool),
        report: Result<SliceReport, String>,
    ) -> anyhow::Result<()> {
        let Some(record) = self.aggregation.rounds.get_mut(&round) else { return Ok(()) };
        record.inspecting.remove(&(worker, shard));
        record.waiting.remove(&(worker, shard));
        let who = peer_name(&PublicKey(worker));
        let report = match report {
            Ok(r) => r,
            Err(e) => {
                // its contribution is not summed: the slice it committed cannot be had
                tracing::warn!(round, shard, "inspecting {who}'s disputed slice: {e}");
                return Ok(());
            }
        };
        let reporters = record.collect.reporters(&worker, shard);
        let (liars, state) = match record.collect.settle(&worker, shard, report) {
            Ok(settled) => settled,
            Err(e) => {
                tracing::debug!(round, shard, "settling {who}'s slice: {e}");
                return Ok(());
            }
        };
        // after a dispute, a replica that has not reported yet is not named: its
        // report may still be on its way; after the wait, silence is named too
        let liars: Vec<[u8; 32]> = liars.into_iter().filter(|k| silent || reporters.contains(k)).collect();
        for key in &liars {
            self.aggregation.dropped.insert(*key);
        }
        if !liars.is_empty() {
            self.events.emit(ev::Event::AggregateDisputed(ev::AggregateDisputed {
                round,
                shard: shard as u64,
                liars: liars.iter().map(|k| peer_name(&PublicKey(*k))).collect(),
                reason: format!("their report of {who}'s slice differs from the shepherd's inspection, or never came"),
            }));
        }
        match state {
            Reported::Ready { norm, raw } => self.feed(round, vec![(worker, norm, raw)]).await,
            // another of its shards is disputed too
            Reported::Disputed { shard } => {
                self.inspect_slice(round, worker, shard, false);
                Ok(())
            }
            Reported::Waiting => Ok(()),
        }
    }

    /// Sums shard `shard` of `round` here from its committed slices, fetched from
    /// the workers that committed them.
    fn recompute(&mut self, round: u64, shard: usize, why: &str) {
        let Some(record) = self.aggregation.rounds.get_mut(&round) else { return };
        let Some((count, _)) = record.closed else { return };
        tracing::warn!(round, shard, "summing shard {shard} here: {why}");
        record.busy.insert(shard);
        let sizes: Vec<usize> = record.tensors[shard].clone().map(|i| self.layout.sizes[i]).collect();
        let bounds = shard_bounds(&record.bounds, &record.tensors[shard]);
        let feed = spot::fed(&record.accepted, count);
        let (node, encoding) = (self.node.clone(), self.plan.encoding);
        self.aggregation.fetches.spawn(async move {
            let update = spot::sum(node, (round, shard), feed, (sizes, bounds), encoding).await;
            Fetched::Summed { round, shard, update }
        });
    }

    /// A fetch came back: a shard's mean, checked against its agreed hash, or one
    /// summed here (whose hash names the liars). Once every shard's mean is in,
    /// the state machine gets their join.
    pub(super) async fn on_fetched(&mut self, fetched: Fetched) -> anyhow::Result<()> {
        let (round, shard, taken) = match fetched {
            Fetched::Inspected { round, worker, shard, silent, report } => {
                return self.on_inspected((round, worker, shard, silent), report).await;
            }
            Fetched::Mean { round, shard, hash, bytes } => {
                let Some(record) = self.aggregation.rounds.get(&round) else { return Ok(()) };
                let sizes: Vec<usize> = record.tensors[shard].clone().map(|i| self.layout.sizes[i]).collect();
                let read =
                    bytes.and_then(|b| ShardUpdate::from_blob(round, shard, &b, &sizes).map_err(|e| e.to_string()));
                match read {
                    Ok(update) if update.hash == hash => (round, shard, Some((update, false))),
                    Ok(_) => {
                        self.recompute(round, shard, "the agreed mean's blob hashes otherwise");
                        return Ok(());
                    }
                    Err(e) => {
                        self.recompute(round, shard, &format!("its mean could not be had: {e}"));
                        return Ok(());
                    }
                }
            }
            Fetched::Spot { round, shard, update } => match self.spot_summed(round, shard, update) {
                Some(taken) => (round, shard, Some((taken, true))),
                None => return Ok(()),
            },
            Fetched::Summed { round, shard, update } => match update {
                Ok(update) => (round, shard, Some((update, true))),
                Err(e) => {
                    tracing::warn!(round, shard, "summing shard {shard} here failed: {e}");
                    (round, shard, None)
                }
            },
        };
        let Some(record) = self.aggregation.rounds.get_mut(&round) else { return Ok(()) };
        record.busy.remove(&shard);
        let Some((update, recomputed)) = taken else {
            // the round is given up: its aggregated contributions are not applied
            return self.apply_means(round, false).await;
        };
        let count = record.closed.map_or(0, |(c, _)| c);
        if recomputed {
            let liars: Vec<String> =
                record.collect.liars(shard, &update.hash).into_iter().map(|k| peer_name(&PublicKey(k))).collect();
            for key in record.collect.liars(shard, &update.hash) {
                self.aggregation.dropped.insert(key);
            }
            if !liars.is_empty() {
                self.events.emit(ev::Event::AggregateDisputed(ev::AggregateDisputed {
                    round,
                    shard: shard as u64,
                    liars,
                    reason: "their vote differs from the shepherd's sum, or never came".into(),
                }));
            }
        }
        let seconds = record.closed.map_or(0.0, |(_, at)| at.elapsed().as_secs_f64());
        self.events.emit(ev::Event::ShardAggregated(ev::ShardAggregated {
            round,
            shard: shard as u64,
            hash: hex::encode(update.hash),
            contributions: count,
            recomputed,
            seconds,
        }));
        let Some(record) = self.aggregation.rounds.get_mut(&round) else { return Ok(()) };
        record.means.insert(shard, (update, recomputed));
        if record.means.len() == record.tensors.len() {
            return self.apply_means(round, true).await;
        }
        Ok(())
    }

    /// Hands round `round`'s joined shard means to the state machine (`whole`:
    /// every shard's is in; otherwise none is applied).
    async fn apply_means(&mut self, round: u64, whole: bool) -> anyhow::Result<()> {
        let Some(mut record) = self.aggregation.rounds.remove(&round) else { return Ok(()) };
        if whole && record.means.values().all(|(_, recomputed)| !recomputed) {
            self.aggregation.gathered = record.closed.map(|(_, at)| at.elapsed());
        }
        let mean = whole.then(|| {
            let total = record.means.values().next().map_or(0.0, |(u, _)| u.total);
            let means = std::mem::take(&mut record.means);
            (means.into_values().flat_map(|(u, _)| u.mean).collect(), total)
        });
        // the commitments of this round still serve its late contributions, carried
        record.closed = None;
        record.claims.retain(|_, c| !c.fed);
        record.spots.clear();
        self.aggregation.rounds.insert(round, record);
        self.step(Input::Aggregated { round, mean }).await?;
        self.send_accepts();
        Ok(())
    }

    /// How long votes, and a slice's reports after its first, are waited for (see
    /// [`VOTE_WAIT_FACTOR`]).
    fn wait(&self) -> Duration {
        self.aggregation.gathered.map_or(MAX_VOTE_WAIT, |g| (g * VOTE_WAIT_FACTOR).clamp(MIN_VOTE_WAIT, MAX_VOTE_WAIT))
    }

    /// Slices one replica reported and another did not, within [`Self::wait`] of
    /// the first report, are inspected here: a silent replica holds no contribution
    /// back for longer.
    pub(super) fn expire_reports(&mut self) {
        let wait = self.wait();
        let late: Vec<(u64, [u8; 32], usize)> = self
            .aggregation
            .rounds
            .iter()
            .flat_map(|(round, r)| {
                r.waiting
                    .iter()
                    .filter(|(key, at)| at.elapsed() >= wait && !r.inspecting.contains(key))
                    .filter(|((worker, _), _)| r.claims.get(worker).is_some_and(|c| !c.fed))
                    .map(|((worker, shard), _)| (*round, *worker, *shard))
            })
            .collect();
        for (round, worker, shard) in late {
            self.inspect_slice(round, worker, shard, true);
        }
        // the slices whose contributions went on need no more waiting
        for r in self.aggregation.rounds.values_mut() {
            let claims = &r.claims;
            r.waiting.retain(|(worker, _), _| claims.get(worker).is_some_and(|c| !c.fed));
        }
    }

    /// Shards whose votes did not all come in time after the close (see
    /// [`VOTE_WAIT_FACTOR`]) are summed here.
    pub(super) fn expire_votes(&mut self) {
        let wait = self.wait();
        let late: Vec<(u64, usize)> = self
            .aggregation
            .rounds
            .iter()
            .filter(|(_, r)| {
                let wait = if r.carried { wait.max(FETCHING_VOTE_WAIT) } else { wait };
                r.closed.is_some_and(|(_, at)| at.elapsed() >= wait)
            })
            .flat_map(|(round, r)| {
                (0..r.tensors.len()).filter(|s| !r.means.contains_key(s) && !r.busy.contains(s)).map(|s| (*round, s))
            })
            .collect();
        for (round, shard) in late {
            match self.aggregation.rounds.get(&round).is_some_and(|r| r.spots.contains_key(&shard)) {
                true => self.spot_checked(round, shard),
                false => self.recompute(round, shard, "its aggregators did not all vote in time"),
            }
        }
    }
}

/// The bytes of accepts a message carries at most, reckoned as [`accept_bytes`]:
/// half a small frame, the most an aggregator's admission reads of a request that
/// is not a slice ([`pcp_bootstrap::admission::SMALL_FRAME`]), for the encoding's
/// own overhead. (Half a control message, 128 KiB, made the accepts of 500
/// contributions 76 KB, and every aggregator refused them.)
const ACCEPTS_PER_MESSAGE: usize = pcp_bootstrap::admission::SMALL_FRAME / 2;

/// What an accepts entry takes in its message, at most: its worker, place, weight,
/// norm and bound, and each (shard, hash) with their pointers.
fn accept_bytes(e: &AcceptEntry) -> usize {
    128 + 48 * e.hashes.len()
}

/// The accepts of round `round` of `run` for the aggregator summing `shards`:
/// `entries` with only those shards' hashes, in as few messages as fit a control
/// message, the count `closed` (if the round closed) with the last.
fn accepts_for(
    (run, round): ([u8; 32], u64),
    entries: &[AcceptEntry],
    shards: &BTreeSet<u32>,
    closed: Option<u64>,
) -> Vec<Accepts> {
    let mut out = vec![Accepts { run, round, entries: Vec::new(), closed: None }];
    let mut bytes = 0;
    for e in entries {
        let hashes = e.hashes.iter().filter(|(s, _)| shards.contains(s)).copied().collect();
        let entry = AcceptEntry { hashes, ..e.clone() };
        let last = out.last_mut().expect("one message at least");
        if !last.entries.is_empty() && bytes + accept_bytes(&entry) > ACCEPTS_PER_MESSAGE {
            out.push(Accepts { run, round, entries: Vec::new(), closed: None });
            bytes = 0;
        }
        bytes += accept_bytes(&entry);
        out.last_mut().expect("one message at least").entries.push(entry);
    }
    out.last_mut().expect("one message at least").closed = closed;
    out
}

/// `worker`'s committed slice `hash`, fetched from it and inspected by its
/// shard's bounds: the report its replicas should have sent.
async fn inspect_here(
    node: &pcp_bootstrap::Node,
    (worker, hash): ([u8; 32], [u8; 32]),
    sizes: &[usize],
    bounds: &Bounds,
    encoding: Encoding,
) -> Result<SliceReport, String> {
    let from = pcp_bootstrap::peer_of(&PublicKey(worker)).into_iter().collect();
    // a slice is exactly its shard's message in the run's encoding: no larger one is read
    let max = compress::encoded_len(sizes, encoding) as u64;
    let bytes = wire::fetch_bounded(node, BlobHash(hash), from, (FETCH_TIMEOUT, max)).await?;
    let delta: Delta = compress::decode_delta(&bytes, sizes, encoding).map_err(|e| e.to_string())?;
    let (_, report) = inspect(delta, sizes, bounds).map_err(|e| e.to_string())?;
    Ok(report)
}

#[cfg(test)]
mod tests {
    use pcp_schema::Message as _;

    use super::*;

    #[test]
    fn a_thousand_accepts_go_in_messages_that_fit_each_with_the_aggregators_hashes_only() {
        let hashes: Vec<(u32, [u8; 32])> = (0..64).map(|s| (s, [s as u8; 32])).collect();
        let entries: Vec<AcceptEntry> = (0..1000)
            .map(|i| AcceptEntry {
                worker: [1; 32],
                seq: i,
                weight: 1.0,
                norm: 0.5,
                bound: 1.0,
                hashes: hashes.clone(),
            })
            .collect();
        for shards in [(0..64).collect::<BTreeSet<u32>>(), [3, 40].into()] {
            let messages = accepts_for(([2; 32], 7), &entries, &shards, Some(1000));
            for m in &messages {
                let len = m.encode().len();
                assert!(len <= pcp_bootstrap::admission::SMALL_FRAME, "{len} bytes: an aggregator reads a small frame");
                assert!(m.entries.iter().all(|e| e.hashes.iter().all(|(s, _)| shards.contains(s))));
            }
            let (last, rest) = messages.split_last().expect("a message");
            assert_eq!(last.closed, Some(1000));
            assert!(rest.iter().all(|m| m.closed.is_none()), "the count goes last");
            let seqs: Vec<u64> = messages.iter().flat_map(|m| m.entries.iter().map(|e| e.seq)).collect();
            assert_eq!(seqs, (0..1000).collect::<Vec<_>>(), "every entry, in order");
        }
        // the loadtest's: 500 contributions, each aggregator one shard of 4
        let one: Vec<AcceptEntry> =
            entries.iter().take(500).map(|e| AcceptEntry { hashes: hashes[..4].to_vec(), ..e.clone() }).collect();
        for m in accepts_for(([2; 32], 7), &one, &[2].into(), Some(500)) {
            assert!(m.encode().len() <= pcp_bootstrap::admission::SMALL_FRAME, "{} bytes", m.encode().len());
        }
        let none = accepts_for(([2; 32], 7), &[], &[0].into(), Some(0));
        assert_eq!(none.len(), 1, "a round closed empty still says so");
    }
}
