//! Screening by committees (`--screeners K`): rated workers score each
//! contribution on their own devices, so the score screen keeps pace with a
//! round of thousands. The decisions are the protocol's
//! ([`pcp_protocol::diloco::committee::screening::Screening`]); this part carries
//! them out.
//!
//! * **Committed, then drawn.** A contribution's hash is its commitment. Once
//!   the shepherd holds it, its committee is drawn from the round's secret screen
//!   seed (revealed with the next round, so anyone can audit the draw) among the
//!   screeners eligible then: rated workers, never the sender, whose own
//!   contribution to the round is already committed. A screener therefore sees
//!   the round's batch only after it can no longer shape its own contribution to
//!   it; the first contributions of a round, before any screener is committed,
//!   are the shepherd's to score.
//! * **What a screener receives.** The contribution as its sender encoded it,
//!   the round's bounds and scales (so it applies it as the round would), the
//!   hash of the parameters it is scored at, and the round's batch: on the
//!   withheld split, the round's own slice of it, which no other round screens
//!   on ([`ScreenRequest`]; `screen.rs`). Its sender is told nothing of any score.
//! * **The verdict.** Every member's losses agreeing: their median. A
//!   disagreement, a silence past [`WAIT`], a committee too small, or the spot
//!   check (`--screen-spot-rate` of contributions, drawn from the seed, while the
//!   round's screening is within its budget, `--screen-share`): the shepherd
//!   scores it itself, and every member its score contradicts is caught
//!   (`screener_caught`): it loses its rating and never screens again.
//! * **The sender waits for the verdict**: its contribution is answered, and
//!   fed to the state machine, once decided. A round's deadline waits for the
//!   contributions being screened, as for those being read. At most
//!   [`MAX_DEFERRED`](pcp_protocol::diloco::committee::screening::MAX_DEFERRED)
//!   wait at once, holding at most 1 GiB;
//!   past them the shepherd's own screen takes a contribution, within its budget.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;

use pcp_bootstrap::InboundId;
use pcp_protocol::diloco::Tensors;
use pcp_protocol::diloco::aggregate::{Bounds, Delta, Rejection};
use pcp_protocol::diloco::aggregation::sliced_id;
use pcp_protocol::diloco::committee::Losses;
use pcp_protocol::diloco::committee::screening::{
    Action, Config, ContributionId, Input, Screening, Source, Why, may_defer,
};
use pcp_protocol::diloco::shepherd::{self, Applied};
use pcp_protocol::{PublicKey, Verified};
use pcp_schema::{MessageKind, ScreenReport, ScreenRequest};
use tokio::task::JoinSet;

use super::Host;
use crate::diloco::scoring;
use crate::diloco::wire::peer_name;
use crate::observe::events as ev;
use crate::training::data::Batch;

/// How long a committee has to answer from its request, before the shepherd
/// scores the contribution itself.
pub(crate) const WAIT: Duration = Duration::from_secs(10);

/// The bytes a deferred contribution holds: its delta, its bounded copy, and
/// `requests` bytes of screen requests in flight (each member's holds the
/// contribution as it came and the round's batch).
fn held_bytes(input: &shepherd::Input<PublicKey>, applied: &Applied, requests: usize) -> usize {
    let delta = match input {
        shepherd::Input::Contribution { delta, .. } => delta.len_bytes(),
        _ => 0,
    };
    delta.saturating_add(applied.delta.len_bytes()).saturating_add(requests)
}

/// A contribution's id as events name it.
fn short(id: &ContributionId) -> String {
    pcp_protocol::BlobHash(*id).to_hex()[..8].to_owned()
}

/// What `contribution_received` reports of a contribution: samples, loss,
/// bytes and bytes down.
pub(crate) type Received = (u64, f32, usize, u64);

/// One member's answer to a screen request, or why there is none.
pub(crate) type Answer = (ContributionId, PublicKey, Result<Verified, String>);

/// A round's screening: its machine and what its requests carry.
struct RoundCommittees {
    round: u64,
    machine: Screening<PublicKey>,
    /// The round's parameters (what every contribution of it is scored at).
    params: Arc<Tensors>,
    params_hash: [u8; 32],
    /// The round's batch and its loss at `params` once known.
    batch: Arc<Batch>,
    before: Option<f32>,
    /// `params` on the engine's device, once the shepherd scored one itself.
    resident: Option<crate::training::engine::Resident>,
}

/// What a deferred contribution is screened as: itself, bounded and scaled as
/// the round applies it, or an aggregated contribution's slice hashes with the
/// bounds and scale its screeners apply it with (fetched from its shards'
/// aggregators, `holders`, or else its sender, and made whole only if the
/// shepherd scores it).
pub(crate) enum Held {
    Whole(Applied),
    Sliced { hashes: Vec<[u8; 32]>, holders: Vec<Vec<[u8; 32]>>, bounds: Bounds, scale: f32, applied: Option<Delta> },
}

impl Held {
    fn bounds(&self) -> (&Bounds, f32) {
        match self {
            Held::Whole(a) => (&a.bounds, a.scale),
            Held::Sliced { bounds, scale, .. } => (bounds, *scale),
        }
    }

    /// The contribution as the round applies it, once the shepherd holds it.
    fn applied(&self) -> Option<&Delta> {
        match self {
            Held::Whole(a) => Some(&a.delta),
            Held::Sliced { applied, .. } => applied.as_ref(),
        }
    }
}

/// A contribution waiting for its verdict, and what answering it needs.
pub(crate) struct Deferred {
    /// Its request, answered at its verdict (none for an aggregated one: its
    /// commitment was answered when it came).
    pub(crate) id: Option<InboundId>,
    /// Its input, unscreened.
    pub(crate) input: shepherd::Input<PublicKey>,
    /// What `contribution_received` reports: samples, loss, bytes, bytes down,
    /// and the sender's busy time.
    pub(crate) received: (u64, f32, usize, u64),
    pub(crate) busy: (u64, u64),
    /// The round whose machine screens it.
    screened_in: u64,
    applied: Held,
    /// The bytes it holds ([`held_bytes`]).
    held: usize,
    at: Instant,
    /// Why the shepherd scored it, if it did.
    why: Option<Why>,
    silent: Vec<PublicKey>,
}

/// Screening by committees: the open round's and those of rounds before it
/// whose contributions are still being decided.
pub(crate) struct Committees {
    config: Config,
    rounds: Vec<RoundCommittees>,
    deferred: BTreeMap<ContributionId, Deferred>,
    /// The bytes the deferred contributions hold, together (each one's `held`).
    held: usize,
    /// The screen requests in flight.
    pub(crate) answers: JoinSet<Answer>,
    /// Aggregated contributions the shepherd scores, their slices being fetched.
    pub(crate) fetching: JoinSet<(ContributionId, Result<Delta, String>)>,
    /// Screeners caught lying, for the rest of the run.
    barred: Vec<PublicKey>,
}

impl Committees {
    /// `k` screeners a committee (0: none), and the spot check's rate.
    pub(crate) fn new(k: usize, spot_rate: f64) -> Self {
        let config = Config { k, spot_rate, wait_ms: WAIT.as_millis() as u64 };
        let (rounds, deferred, barred) = (Vec::new(), BTreeMap::new(), Vec::new());
        let (answers, fetching) = (JoinSet::new(), JoinSet::new());
        Self { config, rounds, deferred, held: 0, answers, fetching, barred }
    }

    /// Screeners a committee.
    pub(crate) fn k(&self) -> usize {
        self.config.k
    }

    /// Contributions of `round` being screened (a round's deadline waits for them).
    pub(crate) fn screening(&self, round: u64) -> usize {
        self.deferred.values().filter(|d| d.input_round() == round).count()
    }

    /// Opens `round`, screened with `seed` at `params` (blob `params_hash`) on
    /// `batch`. Earlier rounds are kept while they decide their contributions.
    /// Returns the contributions of a round opened again (a new term's) that
    /// its old machine was screening: they are refused unscreened.
    pub(crate) fn open(
        &mut self,
        round: u64,
        seed: [u8; 32],
        params: (Arc<Tensors>, [u8; 32]),
        batch: Batch,
    ) -> Vec<Deferred> {
        self.rounds.retain(|r| r.machine.pending() > 0 && r.round != round);
        let orphans: Vec<ContributionId> = self
            .deferred
            .iter()
            .filter(|(_, d)| !self.rounds.iter().any(|r| r.round == d.screened_in))
            .map(|(id, _)| *id)
            .collect();
        let orphans = orphans.into_iter().filter_map(|id| self.take(&id)).collect();
        let machine = Screening::new(seed, self.config, Vec::new(), self.barred.clone());
        let (params, params_hash) = params;
        self.rounds.push(RoundCommittees {
            round,
            machine,
            params,
            params_hash,
            batch: Arc::new(batch),
            before: None,
            resident: None,
        });
        orphans
    }

    /// `d` waits for its verdict as `contribution`.
    fn put(&mut self, contribution: ContributionId, d: Deferred) {
        self.held = self.held.saturating_add(d.held);
        self.deferred.insert(contribution, d);
    }

    /// `contribution` waits no more.
    fn take(&mut self, contribution: &ContributionId) -> Option<Deferred> {
        let d = self.deferred.remove(contribution)?;
        self.held = self.held.saturating_sub(d.held);
        Some(d)
    }

    fn round_mut(&mut self, round: u64) -> Option<&mut RoundCommittees> {
        self.rounds.iter_mut().find(|r| r.round == round)
    }
}

impl Deferred {
    fn input_round(&self) -> u64 {
        match &self.input {
            shepherd::Input::Contribution { round, .. } | shepherd::Input::Reported { round, .. } => *round,
            _ => 0,
        }
    }

    fn peer(&self) -> Option<PublicKey> {
        match &self.input {
            shepherd::Input::Contribution { peer, .. } | shepherd::Input::Reported { peer, .. } => Some(*peer),
            _ => None,
        }
    }
}

/// What [`Host::defer`] makes of a contribution.
pub(super) enum Deferral {
    /// Its committee screens it: it is answered at its verdict.
    Deferred,
    /// Not one for a committee: the shepherd's own screen takes it.
    Not(Box<shepherd::Input<PublicKey>>),
    /// One for a committee, with no room to wait for its verdict (or no round
    /// screening by committees): an aggregated contribution, which nothing else
    /// screens, is refused unscreened.
    Full(Box<shepherd::Input<PublicKey>>),
}

/// A contribution entering its committee: its id, its sender, what it is
/// screened as, and the bytes it holds.
struct Entering {
    contribution: ContributionId,
    peer: PublicKey,
    held: Held,
    bytes: usize,
}

impl Host {
    /// Hands `input` (a contribution of `bytes`, answered through `id`) to its
    /// round's committee, or back when it is not one a committee screens: not a
    /// contribution to the open round or carried into it, of the wrong shape or
    /// samples, from a key sitting out, or with no round screening by committees.
    pub(super) async fn defer(
        &mut self,
        (id, bytes): (InboundId, &[u8]),
        input: shepherd::Input<PublicKey>,
        (received, busy): ((u64, f32, usize, u64), (u64, u64)),
    ) -> anyhow::Result<Deferral> {
        let Some(peer) = self.screenable(&input) else { return Ok(Deferral::Not(Box::new(input))) };
        let shepherd::Input::Contribution { delta, .. } = &input else { return Ok(Deferral::Not(Box::new(input))) };
        let Some(applied) = self.machine.applied(delta) else { return Ok(Deferral::Not(Box::new(input))) };
        let requests =
            self.screener.committees.config.k.saturating_mul(bytes.len().saturating_add(self.windows_bytes()));
        let held = held_bytes(&input, &applied, requests);
        let entering =
            Entering { contribution: *blake3::hash(bytes).as_bytes(), peer, held: Held::Whole(applied), bytes: held };
        match self.enter((entering, Some(bytes)), input, (Some(id), received, busy)).await? {
            Deferral::Full(input) => Ok(Deferral::Not(input)),
            other => Ok(other),
        }
    }

    /// Hands an aggregated contribution (`input`, an [`shepherd::Input::Reported`]
    /// whose slices are `hashes`, held by each shard's aggregators, `holders`) to
    /// its round's committee: its members fetch the slices from the aggregators,
    /// or else from its sender. Back as [`Deferral::Not`] when it is not one a
    /// committee screens (the state machine refuses it for what it is), and as
    /// [`Deferral::Full`] when it is but cannot wait.
    pub(super) async fn defer_reported(
        &mut self,
        input: shepherd::Input<PublicKey>,
        (hashes, holders): (Vec<[u8; 32]>, Vec<Vec<[u8; 32]>>),
        received: (u64, f32, usize, u64),
    ) -> anyhow::Result<Deferral> {
        let open = self.machine.completed() + 1;
        let shepherd::Input::Reported { peer, round, samples, report, .. } = &input else {
            return Ok(Deferral::Not(Box::new(input)));
        };
        let peer = *peer;
        let carried = self.plan.overlap && round + 1 == open;
        let late = *round != open && !carried;
        let bad = self.machine.check_samples(*samples).is_err() || report.validate(&self.round_sizes(open)).is_err();
        if late || bad || self.machine.sits_out(&peer, *round) {
            return Ok(Deferral::Not(Box::new(input)));
        }
        let Some((bounds, scale)) = self.machine.bounds_for(report.bounded_norm) else {
            return Ok(Deferral::Full(Box::new(input)));
        };
        let keys = hashes.len() + holders.iter().map(Vec::len).sum::<usize>();
        let requests = self.screener.committees.config.k.saturating_mul(self.windows_bytes() + 32 * keys);
        let contribution = sliced_id(&hashes);
        let held = Held::Sliced { hashes, holders, bounds, scale, applied: None };
        let entering = Entering { contribution, peer, held, bytes: requests };
        self.enter((entering, None), input, (None, received, (0, 0))).await
    }

    /// The open round's batch as a screen request carries it: rows × (block + 1)
    /// u16 tokens.
    fn windows_bytes(&mut self) -> usize {
        let open = self.machine.completed() + 1;
        self.screener.committees.round_mut(open).map_or(0, |rc| {
            let [rows, block] = rc.batch.shape();
            2 * rows * (block + 1)
        })
    }

    /// `input` enters its round's committee, if there is room and a round
    /// screening by committees.
    /// `bytes`: a whole contribution as it came, which its requests carry.
    async fn enter(
        &mut self,
        (entering, bytes): (Entering, Option<&[u8]>),
        input: shepherd::Input<PublicKey>,
        (id, received, busy): (Option<InboundId>, Received, (u64, u64)),
    ) -> anyhow::Result<Deferral> {
        let Entering { contribution, peer, held: applied, bytes: held_now } = entering;
        let open = self.machine.completed() + 1;
        let now_ms = self.now_ms();
        let committees = &mut self.screener.committees;
        let room = may_defer(committees.deferred.len(), committees.held, held_now);
        if committees.deferred.contains_key(&contribution) || !room {
            return Ok(Deferral::Full(Box::new(input)));
        }
        let Some(rc) = committees.round_mut(open) else { return Ok(Deferral::Full(Box::new(input))) };
        let Ok(actions) = rc.machine.on(Input::Received { contribution, sender: peer, now_ms }) else {
            return Ok(Deferral::Full(Box::new(input)));
        };
        // its own contribution to the round committed (not one carried into it), a rated
        // sender may screen the round's later ones
        let ratings = self.machine.ratings();
        let own = match &input {
            shepherd::Input::Contribution { round, .. } | shepherd::Input::Reported { round, .. } => *round == open,
            _ => false,
        };
        if own && ratings.get(&peer).is_some() && !ratings.on_probation(&peer) && !ratings.sits_out(&peer, open) {
            rc.machine.enlist(peer);
        }
        let deferred = Deferred {
            id,
            input,
            received,
            busy,
            screened_in: open,
            applied,
            held: held_now,
            at: Instant::now(),
            why: None,
            silent: Vec::new(),
        };
        committees.put(contribution, deferred);
        self.on_screening(actions, bytes).await?;
        Ok(Deferral::Deferred)
    }

    /// Carries out a round's screening actions (`bytes`: the contribution a
    /// request carries), and the actions they lead to.
    async fn on_screening(&mut self, actions: Vec<Action<PublicKey>>, bytes: Option<&[u8]>) -> anyhow::Result<()> {
        let mut queue: std::collections::VecDeque<Action<PublicKey>> = actions.into();
        while let Some(action) = queue.pop_front() {
            match action {
                Action::Request { contribution, screeners } => self.request_screens(contribution, screeners, bytes),
                // a spot check waits for the budget; the rest must be scored
                Action::Score { contribution, why: Why::SpotCheck } if !self.screener.within_budget() => {
                    queue.extend(self.waive(contribution));
                }
                Action::Score { contribution, why } => queue.extend(self.score_deferred(contribution, why).await?),
                Action::Verdict { contribution, losses, source } => self.decided(contribution, losses, source).await?,
                Action::Caught { screener, contribution, claimed, checked } => {
                    let round = self.screener.committees.deferred.get(&contribution).map_or(0, |d| d.screened_in);
                    tracing::warn!(screener = %peer_name(&screener), round, "a screener's losses contradict the shepherd's");
                    self.machine.screener_caught(&screener);
                    let committees = &mut self.screener.committees;
                    if !committees.barred.contains(&screener) {
                        committees.barred.push(screener);
                    }
                    let losses = |l: Losses| vec![f64::from(l.before), f64::from(l.after), f64::from(l.reversed)];
                    self.events.emit(ev::Event::ScreenerCaught(ev::ScreenerCaught {
                        round,
                        contribution: short(&contribution),
                        screener: peer_name(&screener),
                        claimed: losses(claimed),
                        checked: losses(checked),
                    }));
                }
                Action::Silent { contribution, screeners } => {
                    if let Some(d) = self.screener.committees.deferred.get_mut(&contribution) {
                        d.silent = screeners;
                    }
                }
            }
        }
        Ok(())
    }

    /// Sends `contribution`'s screen request to each of `screeners`.
    fn request_screens(&mut self, contribution: ContributionId, screeners: Vec<PublicKey>, bytes: Option<&[u8]>) {
        let outer_scale = self.screener.scale();
        let committees = &mut self.screener.committees;
        let Some(d) = committees.deferred.get(&contribution) else { return };
        // a whole contribution goes in its request; an aggregated one's members fetch its slices
        let (delta, slices, holders) = match (&d.applied, bytes, d.peer()) {
            (Held::Sliced { hashes, holders, .. }, _, Some(peer)) => {
                (Vec::new(), Some((peer.0, hashes.clone())), holders.clone())
            }
            (Held::Whole(_), Some(bytes), _) => (bytes.to_vec(), None, Vec::new()),
            _ => return,
        };
        let Some(rc) = committees.rounds.iter().find(|r| r.round == d.screened_in) else { return };
        let (bounds, bound_scale) = d.applied.bounds();
        let request = ScreenRequest {
            run: self.run.0,
            round: rc.round,
            contribution,
            contribution_round: d.input_round(),
            params_hash: rc.params_hash,
            delta,
            tensor_bounds: bounds.tensor.clone(),
            element_bounds: bounds.element.clone(),
            bound_scale,
            outer_scale,
            rows: rc.batch.shape()[0] as u32,
            windows: rc.batch.windows(),
            slices,
            holders,
        };
        let envelope = self.signer.seal(self.run, rc.round, &request);
        self.events.emit(ev::Event::ScreenAssigned(ev::ScreenAssigned {
            round: rc.round,
            contribution: short(&contribution),
            peer: d.peer().map(|p| peer_name(&p)).unwrap_or_default(),
            screeners: screeners.iter().map(peer_name).collect(),
        }));
        for screener in screeners {
            let Some(peer) = pcp_bootstrap::peer_of(&screener) else { continue };
            let (node, envelope) = (self.node.clone(), envelope.clone());
            committees.answers.spawn(async move {
                let answer = match tokio::time::timeout(WAIT, node.request(peer, envelope)).await {
                    Ok(Ok(v)) => Ok(v),
                    Ok(Err(e)) => Err(e.to_string()),
                    Err(_) => Err(format!("no answer in {} s", WAIT.as_secs())),
                };
                (contribution, screener, answer)
            });
        }
    }

    /// The shepherd scores `contribution` itself (`why`); what its score leads to.
    async fn score_deferred(
        &mut self,
        contribution: ContributionId,
        why: Why,
    ) -> anyhow::Result<Vec<Action<PublicKey>>> {
        let started = Instant::now();
        let scale = self.screener.scale();
        let engine = self.engine.as_ref();
        let committees = &mut self.screener.committees;
        let Some(d) = committees.deferred.get_mut(&contribution) else { return Ok(Vec::new()) };
        d.why = Some(why);
        let Some(applied) = d.applied.applied() else {
            // an aggregated contribution: scored once its slices are here
            if let (Held::Sliced { hashes, holders, .. }, Some(peer)) = (&d.applied, d.peer()) {
                let (node, hashes, holders) = (self.node.clone(), hashes.clone(), holders.clone());
                let layout = (self.layout.sizes.clone(), self.plan.encoding);
                committees.fetching.spawn(async move {
                    let from = scoring::Holders { sender: peer, aggregators: &holders };
                    let whole = scoring::fetch_sliced(&node, from, &hashes, (&layout.0, layout.1)).await;
                    (contribution, whole)
                });
            }
            return Ok(Vec::new());
        };
        let Some(rc) = committees.rounds.iter_mut().find(|r| r.round == d.screened_in) else { return Ok(Vec::new()) };
        let engine = engine.context("the loss screen without the model on this host")?;
        if rc.resident.is_none() {
            rc.resident = Some(engine.resident(rc.params.as_ref().clone()).await?);
        }
        let base = rc.resident.as_ref().expect("uploaded");
        let losses = scoring::losses(engine, base, (applied, scale), &rc.batch, rc.before).await?;
        rc.before = Some(losses.before);
        let actions = rc.machine.on(Input::Scored { contribution, losses }).unwrap_or_default();
        self.screener.scored(started.elapsed().as_secs_f64());
        Ok(actions)
    }

    /// The spot check of `contribution` waived: its committee decides.
    fn waive(&mut self, contribution: ContributionId) -> Vec<Action<PublicKey>> {
        let committees = &mut self.screener.committees;
        let Some(d) = committees.deferred.get(&contribution) else { return Vec::new() };
        let round = d.screened_in;
        let Some(rc) = committees.round_mut(round) else { return Vec::new() };
        rc.machine.on(Input::Waived { contribution }).unwrap_or_default()
    }

    /// `contribution`'s screen decided on `losses`: it passes or is refused as the
    /// shepherd's own screen would, and is answered.
    async fn decided(&mut self, contribution: ContributionId, losses: Losses, source: Source) -> anyhow::Result<()> {
        let Some(d) = self.screener.committees.take(&contribution) else { return Ok(()) };
        let (Some(peer), round) = (d.peer(), d.input_round()) else { return Ok(()) };
        let Deferred { id, mut input, received, busy, screened_in, at, why, silent, .. } = d;
        let rated = !self.machine.ratings().on_probation(&peer);
        let judged = self.judge(losses, rated);
        let passed = judged.is_none();
        match judged {
            None => {
                if let shepherd::Input::Contribution { screen, timing, .. }
                | shepherd::Input::Reported { screen, timing, .. } = &mut input
                {
                    *screen = shepherd::Screen::Passed { improvement: losses.improvement() };
                    // the wait for its verdict is not its transfer
                    if let Some(t) = timing {
                        t.transfer_ms = t.transfer_ms.saturating_add(at.elapsed().as_millis() as u64);
                    }
                }
            }
            Some(reason) => input = shepherd::Input::Malformed { peer, round, reason },
        }
        let why = match why {
            None => String::new(),
            Some(Why::NoCommittee) => "no committee".into(),
            Some(Why::SpotCheck) => "spot check".into(),
            Some(Why::Disagreement) => "disagreement".into(),
            Some(Why::Silence) => "silence".into(),
        };
        self.events.emit(ev::Event::ScreenDecided(ev::ScreenDecided {
            round: screened_in,
            contribution: short(&contribution),
            peer: peer_name(&peer),
            source: match source {
                Source::Committee => "committee".into(),
                Source::Shepherd => "shepherd".into(),
            },
            why,
            passed,
            silent: silent.iter().map(peer_name).collect(),
        }));
        match id {
            Some(id) => self.conclude(id, peer, round, input, Some(received), busy).await,
            None => self.conclude_reported(peer, round, input, (received.0, received.1)).await,
        }
    }

    /// An aggregated contribution's slices fetched for the shepherd's own score
    /// (made whole, or why not): it is scored, or, if neither its aggregators nor
    /// its sender would serve them, withdrawn from its committee and refused
    /// unscreened.
    pub(super) async fn on_sliced(
        &mut self,
        (contribution, whole): (ContributionId, Result<Delta, String>),
    ) -> anyhow::Result<()> {
        let sizes = self.layout.sizes.clone();
        let committees = &mut self.screener.committees;
        let Some(d) = committees.deferred.get_mut(&contribution) else { return Ok(()) };
        let (Some(peer), round, screened_in) = (d.peer(), d.input_round(), d.screened_in) else { return Ok(()) };
        match (whole, &mut d.applied) {
            (Ok(delta), Held::Sliced { bounds, scale, applied, .. }) => {
                *applied = Some(delta.bounded(bounds).0.scaled(*scale, &sizes));
                let why = d.why.unwrap_or(Why::NoCommittee);
                let actions = self.score_deferred(contribution, why).await?;
                self.on_screening(actions, None).await
            }
            (whole, _) => {
                let e = whole.err().unwrap_or_else(|| "not an aggregated contribution".into());
                tracing::warn!(round, "{}'s slices, for its screen: {e}", peer_name(&peer));
                committees.take(&contribution);
                if let Some(rc) = committees.round_mut(screened_in) {
                    let _ = rc.machine.on(Input::Withdrawn { contribution });
                }
                let input = shepherd::Input::Malformed { peer, round, reason: Rejection::Unscreened };
                self.conclude_reported(peer, round, input, (0, 0.0)).await
            }
        }
    }

    /// A screen request's answer: its member's losses, counted by the round that
    /// screens the contribution.
    pub(super) async fn on_screen_answer(&mut self, (contribution, screener, answer): Answer) -> anyhow::Result<()> {
        let report = match answer {
            Ok(v) if v.kind() == MessageKind::ScreenReport && v.signer() == screener => {
                v.decode::<ScreenReport>().map_err(|e| e.to_string())
            }
            Ok(v) => Err(format!("a {} answer", v.kind().tag())),
            Err(e) => Err(e),
        };
        let report = match report {
            Ok(r) if r.run == self.run.0 && r.contribution == contribution => Ok(r),
            Ok(_) => Err("a report of another run or contribution".to_owned()),
            Err(e) => Err(e),
        };
        let report = match report {
            Ok(r) => r,
            Err(e) => {
                tracing::debug!(screener = %peer_name(&screener), "no screen from it: {e}");
                // its committee need not wait for it
                let Some(round) = self.screener.committees.deferred.get(&contribution).map(|d| d.screened_in) else {
                    return Ok(());
                };
                let Some(rc) = self.screener.committees.round_mut(round) else { return Ok(()) };
                let actions = rc.machine.on(Input::Declined { contribution, screener }).unwrap_or_default();
                return self.on_screening(actions, None).await;
            }
        };
        let Some(d) = self.screener.committees.deferred.get(&contribution) else { return Ok(()) };
        let round = d.screened_in;
        let losses = Losses { before: report.before, after: report.after, reversed: report.reversed };
        self.events.emit(ev::Event::ScreenReported(ev::ScreenReported {
            round,
            contribution: short(&contribution),
            screener: peer_name(&screener),
            before: f64::from(losses.before),
            after: f64::from(losses.after),
            reversed: f64::from(losses.reversed),
        }));
        let Some(rc) = self.screener.committees.round_mut(round) else { return Ok(()) };
        match rc.machine.on(Input::Reported { contribution, screener, losses }) {
            Ok(actions) => self.on_screening(actions, None).await,
            Err(e) => {
                tracing::debug!(screener = %peer_name(&screener), "screen answer not counted: {e}");
                Ok(())
            }
        }
    }

    /// Opens `round`'s committees: its secret seed, its parameters (blob `hash`)
    /// and its batch.
    pub(super) async fn open_committees(&mut self, round: u64, hash: pcp_protocol::BlobHash) -> anyhow::Result<()> {
        let params = Arc::new(self.machine.params().clone());
        let seed = self.screener.seed();
        let batch = self.screener.batch()?.0.clone();
        let orphans = self.screener.committees.open(round, seed, (params, hash.0), batch);
        // answered, not fed to the state machine: this runs inside its step
        for d in orphans {
            // an aggregated contribution's commitment was answered when it came
            let Some(id) = d.id else { continue };
            let (round, refused) = (d.input_round(), Rejection::Unscreened);
            let ack = pcp_schema::Ack::refuse(self.run.0, round, refused.code(), refused.told());
            let envelope = self.signer.seal(self.run, round, &ack);
            self.respond(id, envelope).await?;
        }
        Ok(())
    }

    /// Time passed: committees whose wait is over are settled.
    pub(super) async fn committee_tick(&mut self) -> anyhow::Result<()> {
        let now_ms = self.now_ms();
        let mut actions = Vec::new();
        for rc in &mut self.screener.committees.rounds {
            actions.extend(rc.machine.on(Input::Tick { now_ms }).unwrap_or_default());
        }
        self.on_screening(actions, None).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pcp_protocol::diloco::aggregate::{Bounds, Delta};
    use pcp_protocol::diloco::committee::screening::{MAX_DEFERRED, MAX_DEFERRED_BYTES};

    /// A contribution sent over the norm bound is held twice while its committee
    /// screens it: as it came, and scaled down, besides its screen requests. The
    /// count alone let 64 of gpt2-124m's wait dense, 32 GB; the byte budget lets
    /// two.
    #[test]
    fn contributions_over_the_bound_cannot_fill_the_shepherds_memory() {
        let dense = Delta::Dense(vec![vec![0.5; 1 << 12]]);
        let input = shepherd::Input::Contribution {
            peer: PublicKey([1; 32]),
            round: 1,
            samples: 1,
            loss: 2.0,
            delta: dense.clone(),
            timing: None,
            screen: shepherd::Screen::Unscreened,
        };
        let applied = Applied { delta: dense, bounds: Bounds::none(), scale: 0.5 };
        let filled = |each: usize| {
            let (mut count, mut held) = (0, 0);
            while may_defer(count, held, each) {
                count += 1;
                held += each;
            }
            (count, held)
        };
        let small = held_bytes(&input, &applied, 0);
        assert_eq!(small, 32 << 10, "16 KiB as it came and 16 KiB bounded");
        assert_eq!(held_bytes(&input, &applied, 3 << 10), small + (3 << 10), "and its 3 requests");
        assert_eq!(filled(small).0, MAX_DEFERRED, "small contributions: the count bounds them");
        // gpt2-124m: a sparse contribution of 3.9 MB, and its copy scaled down, dense
        let gpt2 = 3_900_000 + 4 * 124_439_808;
        assert!(MAX_DEFERRED * gpt2 > 32_000_000_000, "the count alone held {} bytes", MAX_DEFERRED * gpt2);
        let (count, held) = filled(gpt2);
        assert_eq!(count, 2);
        assert!(held <= MAX_DEFERRED_BYTES);
    }
}
