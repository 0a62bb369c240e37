//! A worker's round, from announcement to send, in one driver that owns the
//! worker's state ([`Trainer`]). It carries out the actions of the protocol's
//! worker state machine ([`pcp_protocol::diloco::worker::Worker`], whose docs
//! give the rules), the same one `pcp-node simulate` drives, and feeds it what
//! happens: the announcements (taken through the follower's
//! [`pcp_protocol::diloco::follower::Rounds`]), the fetches, the inner steps and
//! the sends. The trainer's part of a round (its steps, parameters and
//! contribution) is below the driver. Lockstep and
//! overlapped runs go through this one loop; the manifest's `overlap` only picks
//! the machine's mode ([`Worker::with_overlap`]).
//!
//! **Lockstep** (`--no-overlap`): fetch round r's parameters, train τ steps, send,
//! and wait for round r+1. A newer round, or a deadline passed during the fetch,
//! abandons the round (`round_abandoned`). In a run of P fragments only the
//! fragment round r − 1 synced is replaced by the fetched parameters, when this
//! worker trained round r − 1; the rest keep their local progress.
//!
//! **Overlapped** (the default): compute never waits for the network.
//! It sends round r's contribution and, without waiting, trains round r+1 from
//! its own parameters θ_end(r). The send, the shepherd's aggregation, round
//! r+1's announcement and the fetch of its parameters θ(r+1) (the sparse update,
//! in a sparse run) all happen meanwhile, off the training loop. When θ(r+1)
//! arrives, d inner steps later, the worker **rebases**:
//!
//! θ_local ← θ(r+1) + (θ_local − anchor(r))
//!
//! where the anchor is the parameters at the send of round r (θ_end(r)). It keeps
//! the d steps of progress made since the send and replaces their base with the
//! shepherd's parameters; a rebase moves the newer anchors by the same amount, so
//! round r+1's pseudo-gradient anchor(r) − θ_end(r+1) is the local progress of its
//! steps whether or not θ(r+1) was merged before they ended. Streaming DiLoCo's
//! overlapping variant mixes θ_local ← α·θ_local + (1 − α)·θ(r+1) instead; α = 0
//! would drop the d steps, larger α keeps stale parameters. The rebase is the
//! "delayed outer update" of one-step-delayed DiLoCo. AdamW's moments carry over.
//!
//! What the shepherd of an overlapping run adds (see
//! [`pcp_protocol::diloco::shepherd`]) reaches the worker in each announcement:
//! a compute budget (`budget_ms`: the worker runs τ steps or the budget,
//! whichever ends first, and its contribution is weighted by the steps it ran),
//! and when the median worker's steps of the round end (`steps_end_unix_ms`: a
//! worker training that round ahead stops there, so that one that fell behind
//! catches up). The worker sends with its contribution when it sent it
//! (`sent_unix_ms`), from which the shepherd sets the round's deadline.
//!
//! A contribution never waits for the update: a worker whose round-(r+1) steps
//! end before θ(r+1) arrived sends at once and trains round r+2 (two updates
//! behind). Compute waits only when round r+2's steps are done and θ(r+1) is
//! still not merged, or when the round it trained was not announced yet (an
//! `update_late` event says how long it waited). A contribution that arrives
//! after its round closed is carried into the next round by the shepherd, so a
//! send is abandoned only when two newer rounds opened. A newer round than the
//! one trained ahead, a round it is not in, the same round opened again by a
//! restarted or new leader, or a failed fetch abandons the steps trained ahead
//! (`round_abandoned`), and the worker starts afresh from the next announced
//! round's parameters, as a joiner does. A worker killed during an overlap loses
//! only the steps trained ahead: its error feedback and followed chain are saved
//! at each send, and it rejoins at the next round.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use pcp_protocol::BlobHash;
use pcp_protocol::diloco::Tensors;
use pcp_protocol::diloco::compress;
use pcp_protocol::diloco::follower::{self, Opening, Take};
use pcp_protocol::diloco::fragments;
use pcp_protocol::diloco::sparse;
use pcp_protocol::diloco::worker::{Action, Input, Worker};
use pcp_schema::{Contribution, ParameterRef, RoundAnnouncement};
use tokio::sync::{mpsc, watch};

use super::disk::{save_chain, save_feedback};
use super::heartbeats::{AbortOnDrop, Latest, announced, newer_arrives, opening};
use super::screener::Screens;
use super::send::{Courier, Delivery, Outgoing};
use super::{Fetched, Held, Hostile, Next, Outcome, ParamsSource, Progress, RoundParams, Trainer, round_params};
use crate::diloco::wire::{self, Signer};
use crate::observe::events::{self as ev, Event, RoundAbandoned, UpdateLate, UpdateMerged};
use crate::training::data::Sampler;
use crate::training::schedule::learning_rate;

/// What finished off the training loop.
enum Done {
    /// The parameters of this round's announcement (with this key).
    Fetched(u64, Opening, anyhow::Result<RoundParams>),
    /// A contribution's send (`None`: cancelled), and the signer it borrowed.
    Delivered(Option<Delivery>, Signer),
}

/// The inner steps under way.
struct Steps {
    round: u64,
    sampler: crate::training::data::Sampler,
    progress: Progress,
    /// Time spent in this round's steps.
    spent: Duration,
    /// τ.
    steps: u64,
    /// The round's compute budget: no step starts once it is spent.
    budget: Option<Duration>,
    /// When the median worker's steps of the round end (Unix milliseconds).
    end_ms: Option<u64>,
}

impl Steps {
    /// Whether the round's steps are over: τ done, the budget spent, or the
    /// announced end passed (at least one step runs).
    fn over(&self) -> bool {
        let taken = self.progress.taken;
        taken >= self.steps
            || taken > 0
                && (self.budget.is_some_and(|b| self.spent >= b) || self.end_ms.is_some_and(|e| wire::unix_ms() >= e))
    }
}

/// The round's driver: the worker's state, the state machine, and what its
/// actions need kept (module docs).
struct Driver<'a> {
    t: Trainer<'a>,
    machine: Worker,
    /// The announcements of the rounds the machine was told of.
    announced: BTreeMap<u64, Box<RoundAnnouncement>>,
    /// anchor(t): the parameters at the send of round t (at a fresh start of round
    /// r, anchor(r − 1) is the fetched θ(r)).
    anchors: BTreeMap<u64, Tensors>,
    /// θ(t) fetched, waiting for its rebase.
    fetched: BTreeMap<u64, RoundParams>,
    /// Parameter bytes fetched for round t (its contribution reports them).
    bytes_down: BTreeMap<u64, u64>,
    training: Option<Steps>,
    /// Rounds whose steps are done, waiting for their send.
    trained: BTreeMap<u64, Progress>,
    /// Compute has waited since then for this round to be sendable.
    late: Option<(u64, Instant)>,
    done_tx: mpsc::Sender<Done>,
    done: mpsc::Receiver<Done>,
    /// The signer, unless a send has it.
    signer: Option<Signer>,
    /// The contribution on its way, its task, and the epoch it was sent in.
    sending: Option<(Outgoing, AbortOnDrop, u64)>,
    /// Restarts so far: a send from before the last one answers a chain that is
    /// gone, so its answer is reported but not fed to the fresh machine (whose round
    /// of the same number is another one).
    epoch: u64,
    /// Contributions waiting for the one on its way (one send at a time).
    queued: VecDeque<(Outgoing, Opening)>,
    /// The update fetch in flight (its task is aborted with it).
    fetching: Option<AbortOnDrop>,
    /// Screen requests, answered between inner steps.
    screens: Screens,
    /// The leader's open round and its deadline now (see the heartbeat task).
    deadline: watch::Receiver<(u64, u64)>,
}

/// Runs the run's rounds, lockstep or overlapped as its manifest says, until the
/// run ends, the worker must rejoin, or it is cancelled.
pub(super) async fn run(
    t: Trainer<'_>,
    signer: &Signer,
    screens: Screens,
    deadline: watch::Receiver<(u64, u64)>,
) -> anyhow::Result<Outcome> {
    let (done_tx, done) = mpsc::channel(4);
    let mut driver = Driver {
        machine: fresh_machine(&t),
        t,
        announced: BTreeMap::new(),
        anchors: BTreeMap::new(),
        fetched: BTreeMap::new(),
        bytes_down: BTreeMap::new(),
        training: None,
        trained: BTreeMap::new(),
        late: None,
        done_tx,
        done,
        signer: Some(Signer::new(signer.identity().clone())),
        sending: None,
        epoch: 0,
        queued: VecDeque::new(),
        fetching: None,
        screens,
        deadline,
    };
    let outcome = driver.drive().await?;
    driver.finish_sends().await;
    Ok(outcome)
}

fn fresh_machine(t: &Trainer<'_>) -> Worker {
    Worker::new(t.me.0.to_vec(), t.m.seed, t.tau()).with_overlap(t.m.overlap)
}

impl Driver<'_> {
    /// The loop: the network's news, then one inner step, or a wait when there is
    /// nothing to compute.
    async fn drive(&mut self) -> anyhow::Result<Outcome> {
        loop {
            if self.t.io.cancel.is_cancelled() {
                return Ok(Outcome::Cancelled);
            }
            while let Ok(done) = self.done.try_recv() {
                if let Some(outcome) = self.landed(done).await? {
                    return Ok(outcome);
                }
            }
            if let Some(outcome) = self.take_latest().await? {
                return Ok(outcome);
            }
            if let Some(outcome) = self.take_deadline().await? {
                return Ok(outcome);
            }
            // a committee's screens go between two inner steps
            while let Ok(request) = self.screens.requests.try_recv() {
                self.t.answer_screen(request, &mut self.screens).await;
            }
            if let Some(steps) = self.training.as_mut() {
                let started = Instant::now();
                steps.progress.loss_sum +=
                    f64::from(self.t.step(steps.round, steps.progress.taken, &mut steps.sampler).await?);
                steps.progress.taken += 1;
                steps.spent += started.elapsed();
                if steps.over() {
                    let steps = self.training.take().context("steps under way")?;
                    self.trained.insert(steps.round, steps.progress);
                    if let Some(outcome) = self.handle(Input::Trained(steps.round)).await? {
                        return Ok(outcome);
                    }
                }
                continue;
            }
            // nothing to compute: wait for the network
            tokio::select! {
                () = self.t.io.cancel.cancelled() => return Ok(Outcome::Cancelled),
                changed = self.t.latest.changed() => if changed.is_err() {
                    return Ok(Outcome::Rejoin("the heartbeat task stopped".into()));
                },
                changed = self.deadline.changed() => if changed.is_err() {
                    return Ok(Outcome::Rejoin("the heartbeat task stopped".into()));
                },
                Some(done) = self.done.recv() => if let Some(outcome) = self.landed(done).await? {
                    return Ok(outcome);
                },
                Some(request) = self.screens.requests.recv() => {
                    self.t.answer_screen(request, &mut self.screens).await;
                }
            }
        }
    }

    /// Hands the latest announcement to the machine if it is new.
    async fn take_latest(&mut self) -> anyhow::Result<Option<Outcome>> {
        let a = match &*self.t.latest.borrow_and_update() {
            Latest::Nothing => return Ok(None),
            Latest::Refused(reason) => return Ok(Some(Outcome::Rejoin(reason.clone()))),
            Latest::Round(a) if self.t.rounds.is_new(&announced(a, &self.t.me)) => a.clone(),
            Latest::Round(_) => return Ok(None),
        };
        let heard = self.t.rounds.seen();
        let reopened = heard.is_some_and(|h| a.round <= h.round);
        let (budget_ms, end_ms, round, deadline_ms) = (a.budget_ms, a.steps_end_unix_ms, a.round, a.deadline_unix_ms);
        let participant = match self.t.consider(a) {
            Next::Stop(outcome) => return Ok(Some(outcome)),
            Next::Train(a) => {
                if reopened {
                    // the same round opened again (a restarted or new leader): what was
                    // trained ahead or sent for it went to the old one; start afresh
                    self.restart(format!("round {} opened again", a.round));
                }
                self.announced.insert(a.round, a);
                true
            }
            Next::Skip if self.t.rounds.seen() != heard && !reopened => false,
            Next::Skip => return Ok(None),
        };
        let budget = Input::Budget { round, budget_ms, end_ms };
        if let Some(outcome) = self.handle(budget).await? {
            return Ok(Some(outcome));
        }
        self.handle(Input::RoundOpened { round, deadline_ms, participant }).await
    }

    /// Hands the machine the open round's deadline when the leader moved it: the
    /// round goes on past the announced deadline, or is taken up again if it lapsed.
    async fn take_deadline(&mut self) -> anyhow::Result<Option<Outcome>> {
        if !self.deadline.has_changed().unwrap_or(false) {
            return Ok(None);
        }
        let (round, deadline_ms) = *self.deadline.borrow_and_update();
        self.handle(Input::DeadlineExtended { round, deadline_ms }).await
    }

    /// Drops everything of the chain trained so far: the machine starts afresh.
    fn restart(&mut self, reason: String) {
        if let Some(round) = self.machine.sending().last().copied().max(self.training.as_ref().map(|s| s.round)) {
            let steps = self.training.as_ref().map_or(0, |s| s.progress.taken);
            self.t.io.events.emit(Event::RoundAbandoned(RoundAbandoned { round, steps, reason: Some(reason) }));
        }
        self.machine = fresh_machine(&self.t);
        self.epoch += 1;
        // what waits to be sent went to the old chain
        self.queued.clear();
        self.clear();
    }

    fn clear(&mut self) {
        self.training = None;
        self.trained.clear();
        self.anchors.clear();
        self.fetched.clear();
        self.fetching = None;
        self.late = None;
    }

    /// Feeds `input` to the machine and carries out its actions (which may feed it
    /// more).
    async fn handle(&mut self, input: Input) -> anyhow::Result<Option<Outcome>> {
        let mut inputs = VecDeque::from([input]);
        while let Some(input) = inputs.pop_front() {
            for action in self.machine.handle(input, wire::unix_ms()) {
                match self.carry_out(action).await? {
                    Ok(Some(next)) => inputs.push_back(next),
                    Ok(None) => {}
                    Err(outcome) => return Ok(Some(outcome)),
                }
            }
            if self.machine.phase() == pcp_protocol::diloco::worker::Phase::Idle {
                // a failed fetch or an abandon: nothing of the chain is left
                self.clear();
            }
        }
        Ok(None)
    }

    /// Carries out one action; `Ok(Some(input))`: what to feed back at once.
    async fn carry_out(&mut self, action: Action) -> anyhow::Result<Result<Option<Input>, Outcome>> {
        match action {
            Action::FetchParams(r) => return self.fresh(r).await,
            Action::Train { round, steps, budget_ms, .. } => {
                self.training = Some(Steps {
                    round,
                    sampler: self.t.sampler(round)?,
                    progress: Progress::default(),
                    spent: Duration::ZERO,
                    steps: Hostile::steps(self.t.plan.hostile.and_then(|a| a.at(round)), steps),
                    budget: budget_ms.map(Duration::from_millis),
                    end_ms: None,
                });
            }
            Action::EndSteps { round, end_ms } => {
                if let Some(steps) = self.training.as_mut().filter(|s| s.round == round) {
                    steps.end_ms = Some(end_ms);
                }
            }
            Action::Send(r) => self.send(r).await?,
            Action::FetchUpdate(r) => self.fetch_update(r)?,
            Action::Rebase(r) => self.rebase(r).await?,
            Action::UpdateLate(r) => self.late = Some((r, Instant::now())),
            Action::Abandon(r) => {
                let training = self.training.as_ref().filter(|s| s.round == r);
                let on_its_way = self.sending.as_ref().is_some_and(|(o, ..)| o.contribution.round == r)
                    || self.queued.iter().any(|(o, _)| o.contribution.round == r);
                if training.is_none() && on_its_way {
                    // a lockstep machine moves on when the next round opens; the send of
                    // this one goes on, and its answer says what became of it
                    return Ok(Ok(None));
                }
                let steps = training.map_or(0, |s| s.progress.taken);
                self.t.io.events.emit(Event::RoundAbandoned(RoundAbandoned {
                    round: r,
                    steps,
                    reason: Some(format!("round {r} is moot: a newer round opened")),
                }));
            }
        }
        Ok(Ok(None))
    }

    /// A fresh start at round `r`: its parameters fetched (the training waits; no
    /// steps are under way), anchor(r − 1) = θ(r).
    async fn fresh(&mut self, r: u64) -> anyhow::Result<Result<Option<Input>, Outcome>> {
        self.clear();
        let Some(a) = self.announced.get(&r).cloned() else {
            return Ok(Ok(Some(Input::Failed(r))));
        };
        match self.t.fetch_round(&a).await {
            Fetched::Cancelled => Ok(Err(Outcome::Cancelled)),
            Fetched::Failed(reason) => {
                tracing::warn!("round {r}: {reason}");
                self.t.io.events.emit(Event::RoundAbandoned(RoundAbandoned {
                    round: r,
                    steps: 0,
                    reason: Some(reason),
                }));
                Ok(Ok(Some(Input::Failed(r))))
            }
            Fetched::Got(fetched) => {
                self.t.hold(&a, &fetched).await;
                if self.t.m.overlap {
                    self.t.engine.set_params(fetched.params.clone()).await?;
                } else {
                    // lockstep with fragments keeps the fragments this round did not sync
                    self.t.load(&a, &fetched.params).await?;
                }
                self.bytes_down.insert(r, fetched.bytes);
                self.anchors.insert(r - 1, fetched.params);
                Ok(Ok(Some(Input::ParamsReady(r))))
            }
        }
    }

    /// Round `r`'s contribution: anchor(r − 1) − θ; θ becomes anchor(r).
    async fn send(&mut self, r: u64) -> anyhow::Result<()> {
        if let Some((round, since)) = self.late.take() {
            let waited_ms = since.elapsed().as_millis() as u64;
            if waited_ms > 0 {
                self.t.io.events.emit(Event::UpdateLate(UpdateLate { round, waited_ms }));
            }
        }
        let a = self.announced.get(&r).cloned().with_context(|| format!("sending round {r}, not announced"))?;
        let progress = self.trained.remove(&r).with_context(|| format!("sending round {r}, not trained"))?;
        let end = self.t.engine.params().await?;
        // With fragments, round r syncs one fragment, whose local progress since its
        // own last sync (P rounds ago; rebases move only the fragment just synced) is
        // measured from its global value, which the latest parameters held carry.
        let held = self.t.held.clone().filter(|_| self.t.fragments.len() > 1);
        let start = match &held {
            Some(held) => &held.params,
            None => self.anchors.get(&(r - 1)).with_context(|| format!("sending round {r} without its anchor"))?,
        };
        let mut out = self.t.outgoing(&a, start, &end, &progress);
        out.contribution.bytes_down = self.bytes_down.remove(&r).unwrap_or(0);
        if !a.aggregators.is_empty() {
            let store = pcp_bootstrap::BlobStore::open(self.t.io.data_dir)?;
            let layout = (self.t.sizes.as_slice(), self.t.encoding);
            out.slices = super::slices::cut(&mut out.contribution, &a, layout, self.t.me, &store)?;
            let kept = out.contribution.slice_hashes.iter().map(|h| BlobHash(*h)).collect::<Vec<_>>();
            self.t.retention.advance(self.t.io.node, self.t.io.events, r, kept).await;
        }
        self.anchors.insert(r, end);
        // anchor(t − 1) goes once round t is sent and merged: at most depth 2 stays
        while self.anchors.len() > 3 {
            self.anchors.pop_first();
        }
        self.announced.retain(|k, _| *k + 2 >= r);
        self.queued.push_back((out, opening(&a)));
        self.next_send()
    }

    /// Starts the next queued send if none is on its way.
    fn next_send(&mut self) -> anyhow::Result<()> {
        if self.sending.is_some() {
            return Ok(());
        }
        let Some((mut out, this)) = self.queued.pop_front() else { return Ok(()) };
        let mut signer = self.signer.take().context("a second send while one is in flight")?;
        out.contribution.sent_unix_ms = wire::unix_ms();
        let (courier, tx, contribution) = (self.t.courier(), self.done_tx.clone(), Arc::new(out.contribution.clone()));
        let (late, slices) = (out.late, std::mem::take(&mut out.slices));
        // `withhold`: its store, whose slices it deletes as it sends them to its aggregators
        let withhold = self.t.plan.hostile.and_then(|a| a.at(out.contribution.round)) == Some(Hostile::Withhold);
        let withhold = withhold.then(|| pcp_bootstrap::BlobStore::open(self.t.io.data_dir)).transpose()?;
        let task = tokio::spawn(async move {
            if late {
                courier.after_close(this).await;
            }
            let delivery = courier.deliver(&mut signer, &contribution, this).await;
            // an aggregated round's slices go once the shepherd holds their commitment
            if delivery.as_ref().is_some_and(|d| d.accepted) && !slices.is_empty() {
                if let Some(store) = &withhold {
                    for hash in &contribution.slice_hashes {
                        let _ = store.remove(&BlobHash(*hash));
                    }
                }
                super::slices::send((&courier.node, courier.own_slices.as_ref()), &mut signer, courier.run, &slices)
                    .await;
            }
            let _ = tx.send(Done::Delivered(delivery, signer)).await;
        });
        self.sending = Some((out, AbortOnDrop(task), self.epoch));
        Ok(())
    }

    /// Fetches θ(r) beside the steps.
    fn fetch_update(&mut self, r: u64) -> anyhow::Result<()> {
        let a = self.announced.get(&r).with_context(|| format!("fetching round {r}, not announced"))?;
        let (fetch, tx, k) = (self.t.fetch_task(a), self.done_tx.clone(), opening(a));
        self.fetching = Some(AbortOnDrop(tokio::spawn(async move {
            let _ = tx.send(Done::Fetched(r, k, fetch.await)).await;
        })));
        Ok(())
    }

    /// θ ← θ + (θ(r) − anchor(r − 1)), and every newer anchor with it, over the
    /// fragment round r − 1 synced (every tensor without fragments).
    async fn rebase(&mut self, r: u64) -> anyhow::Result<()> {
        let fetched = self.fetched.remove(&r).with_context(|| format!("rebasing onto round {r}, not fetched"))?;
        let base = self.anchors.get(&(r - 1)).with_context(|| format!("rebasing onto round {r} without its anchor"))?;
        let fragment = self.t.fragment(r - 1);
        let shift: Vec<Vec<f32>> =
            fragment.clone().map(|i| fetched.params[i].iter().zip(&base[i]).map(|(g, b)| g - b).collect()).collect();
        let mut local = self.t.engine.params().await?;
        for tensors in std::iter::once(&mut local).chain(self.anchors.range_mut(r - 1..).map(|(_, a)| a)) {
            for (i, d) in fragment.clone().zip(&shift) {
                tensors[i].iter_mut().zip(d).for_each(|(v, d)| *v += d);
            }
        }
        self.t.engine.set_params(local).await?;
        let after_steps = self.training.as_ref().map_or(0, |s| s.progress.taken);
        self.t.io.events.emit(Event::UpdateMerged(UpdateMerged {
            round: r,
            after_steps,
            bytes: fetched.bytes,
            via: fetched.via.to_owned(),
        }));
        Ok(())
    }

    /// Handles a finished flight.
    async fn landed(&mut self, done: Done) -> anyhow::Result<Option<Outcome>> {
        match done {
            Done::Fetched(r, k, result) => {
                if self.announced.get(&r).is_none_or(|a| opening(a) != k) {
                    return Ok(None); // a stale fetch
                }
                self.fetching = None;
                match result {
                    Ok(fetched) => {
                        let a = self.announced.get(&r).cloned().context("announced")?;
                        self.t.hold(&a, &fetched).await;
                        self.bytes_down.insert(r, fetched.bytes);
                        self.fetched.insert(r, fetched);
                        self.handle(Input::ParamsReady(r)).await
                    }
                    Err(e) => {
                        let (round, steps) = self.training.as_ref().map_or((r, 0), |s| (s.round, s.progress.taken));
                        let reason = format!("fetching round {r}'s parameters: {e:#}");
                        tracing::warn!("round {round}: {reason}");
                        self.t.io.events.emit(Event::RoundAbandoned(RoundAbandoned {
                            round,
                            steps,
                            reason: Some(reason),
                        }));
                        self.handle(Input::Failed(r)).await
                    }
                }
            }
            Done::Delivered(delivery, signer) => match self.delivered(delivery, signer)? {
                Some(r) => self.handle(Input::Sent(r)).await,
                None => Ok(None),
            },
        }
    }

    /// A send finished: its outcome is reported, and the next queued one starts.
    /// Returns the round sent, unless the send is from before a restart.
    fn delivered(&mut self, delivery: Option<Delivery>, signer: Signer) -> anyhow::Result<Option<u64>> {
        self.signer = Some(signer);
        let Some((out, _task, epoch)) = self.sending.take() else { return Ok(None) };
        let delivery = delivery.unwrap_or(Delivery {
            accepted: false,
            reason: "cancelled before the answer".into(),
            wire_bytes: 0,
        });
        let r = out.contribution.round;
        self.t.finish(out, &delivery);
        self.next_send()?;
        Ok((epoch == self.epoch).then_some(r))
    }

    /// Waits until every contribution trained is sent (a fetch finishing meanwhile
    /// is dropped).
    async fn finish_sends(&mut self) {
        while self.sending.is_some() {
            match self.done.recv().await {
                Some(Done::Delivered(delivery, signer)) => {
                    if let Err(e) = self.delivered(delivery, signer) {
                        tracing::warn!("sending the last contributions: {e:#}");
                        return;
                    }
                }
                Some(Done::Fetched(..)) => {}
                None => return,
            }
        }
    }
}

/// The worker's part of a round: its steps, its parameters and its contribution.
impl Trainer<'_> {
    fn tau(&self) -> u64 {
        u64::from(self.m.inner_steps)
    }

    /// The tensors round `r` syncs (every tensor without fragments).
    fn fragment(&self, r: u64) -> std::ops::Range<usize> {
        self.fragments[fragments::of_round(r, self.fragments.len())].clone()
    }

    /// Loads round `a`'s parameters into the engine. After sending the previous
    /// round, only the fragment that round synced is taken from them (all of them
    /// without fragments): the other fragments' local progress is this worker's
    /// until their own round. Anyone else starts from all of them.
    async fn load(&mut self, a: &RoundAnnouncement, params: &Tensors) -> anyhow::Result<()> {
        if self.fragments.len() > 1 && self.trained == Some(a.round - 1) {
            let mut local = self.engine.params().await?;
            for i in self.fragment(a.round - 1) {
                local[i].clone_from(&params[i]);
            }
            self.engine.set_params(local).await
        } else {
            self.engine.set_params(params.clone()).await
        }
    }

    fn courier(&self) -> Courier {
        Courier {
            node: self.io.node.clone(),
            run: self.run,
            leader: self.leader.clone(),
            latest: self.latest.clone(),
            cancel: self.io.cancel.clone(),
            own_slices: self.io.own_slices.cloned(),
        }
    }

    /// A sampler for this worker's data in round `r`.
    fn sampler(&self, r: u64) -> anyhow::Result<Sampler> {
        let seed = pcp_protocol::diloco::data_seed(self.m.seed, &self.me.0, r);
        Ok(Sampler::new(self.corpus.train.clone(), self.m.data.batch as usize, self.m.data.block as usize, seed)?)
    }

    /// What `a` asks of the worker, if it is newer than the last announcement
    /// taken ([`Rounds::announced`]): the run's end, a round to train, or nothing.
    fn consider(&mut self, a: Box<RoundAnnouncement>) -> Next {
        let (take, save) = self.rounds.announced(&announced(&a, &self.me));
        if let Some(follower::Action::SaveChain(chain)) = save
            && let Err(e) = save_chain(&self.chain_file, &chain)
        {
            tracing::warn!("saving the followed chain: {e:#}");
        }
        let participant = a.participants.contains(&self.me.0);
        match take {
            Take::Finished => {
                self.io.events.emit(ev::Event::RunFinished(ev::RunFinished {
                    run: Some(self.run.to_hex()),
                    rounds: a.round,
                    ..ev::RunFinished::default()
                }));
                if self.plan.verbose {
                    println!("run {} finished after {} rounds", self.run, a.round);
                }
                return Next::Stop(Outcome::Finished);
            }
            Take::Seen => return Next::Skip,
            Take::Refused(behind) => {
                tracing::warn!("run {}: not training round {} of term {}: {behind}", self.run, a.round, a.term);
                self.io.events.emit(ev::Event::RoundRefused(ev::RoundRefused {
                    round: a.round,
                    term: a.term,
                    reason: behind.to_string(),
                }));
                return Next::Skip;
            }
            Take::Skip | Take::Train => {}
        }
        self.io.events.emit(ev::Event::RoundAnnounced(ev::RoundAnnounced {
            round: a.round,
            deadline_unix_ms: a.deadline_unix_ms,
            participant,
        }));
        if !participant {
            return Next::Skip;
        }
        let _ = self.round_tx.send(a.round);
        if take == Take::Train { Next::Train(a) } else { Next::Skip }
    }

    /// Fetches the parameters `a` announces (see [`round_params`]), off this task.
    fn fetch_task(&self, a: &RoundAnnouncement) -> impl Future<Output = anyhow::Result<RoundParams>> + Send + 'static {
        let src = ParamsSource {
            node: self.io.node.clone(),
            from: self.leader.borrow().0,
            sizes: self.sizes.clone(),
            shards: self.shards.clone(),
            down: self.encoding.sparse().map(|s| s.down()),
            fragments: self.fragments.clone(),
        };
        let (a, held) = (a.clone(), self.held.clone());
        async move { round_params(&src, &a, held.as_deref()).await }
    }

    /// Fetches round `a`'s parameters; a newer announcement (a leader that died
    /// mid-fetch was replaced) or cancellation ends the wait.
    async fn fetch_round(&mut self, a: &RoundAnnouncement) -> Fetched {
        self.clock.start();
        let mut watching = self.latest.clone();
        tokio::select! {
            () = self.io.cancel.cancelled() => Fetched::Cancelled,
            () = newer_arrives(&mut watching, opening(a)) => Fetched::Failed("a newer announcement".into()),
            fetched = self.fetch_task(a) => match fetched {
                Ok(p) => Fetched::Got(p),
                Err(e) => Fetched::Failed(format!("{e:#}")),
            },
        }
    }

    /// Remembers `params` as round `a`'s start (what a sparse update applies to).
    async fn hold(&mut self, a: &RoundAnnouncement, params: &RoundParams) {
        tracing::debug!("round {}: parameters {} ({} bytes)", a.round, params.via, params.bytes);
        self.io.events.emit(ev::Event::ParamsFetched(ev::ParamsFetched {
            round: a.round,
            via: params.via.to_owned(),
            bytes: params.bytes,
            shards: params.shards.0 as u64,
            of: params.shards.1 as u64,
        }));
        self.attacker.fetched(self.plan.hostile, &params.params);
        self.held = a.parameters.first().map(|p| {
            let shards = a.parameters[1..].iter().map(|s| s.blob).collect();
            Arc::new(Held { hash: BlobHash(p.blob), params: params.params.clone(), shards })
        });
        // the blobs of rounds older than this worker keeps go
        let used = a.parameters.iter().map(|p| p.blob).chain(a.update.as_ref().map(|u| u.blob.blob));
        self.retention.advance(self.io.node, self.io.events, a.round, used.map(BlobHash)).await;
    }

    /// Inner step `i` of round `r`: its loss.
    async fn step(&mut self, r: u64, i: u64, sampler: &mut Sampler) -> anyhow::Result<f32> {
        self.adam_step += 1;
        let global = (r - 1) * self.tau() + i + 1;
        let s = &self.m.schedule;
        let lr = learning_rate(global, s.total_steps, s.learning_rate, s.min_lr, s.warmup_steps);
        let started = Instant::now();
        let loss = self.engine.step(self.adam_step, lr as f32, &sampler.next_batch()).await?;
        if let Some(delay) = self.plan.step_delay {
            tokio::time::sleep(delay).await;
        }
        self.clock.train_s += started.elapsed().as_secs_f64();
        Ok(loss)
    }

    /// Round `a`'s contribution: θ_start − θ_end, encoded (through the error
    /// feedback in a sparse run).
    fn outgoing(&mut self, a: &RoundAnnouncement, start: &Tensors, end: &Tensors, progress: &Progress) -> Outgoing {
        let r = a.round;
        // θ_start − θ_end over the round's fragment; the other tensors are empty
        let fragment = self.fragment(r);
        let mut delta: Tensors = (0..start.len())
            .map(|i| match fragment.contains(&i) {
                true => start[i].iter().zip(&end[i]).map(|(s, e)| s - e).collect(),
                false => Vec::new(),
            })
            .collect();
        self.trained = Some(r);
        let hostile = self.plan.hostile.and_then(|a| a.at(r));
        if self.plan.hostile.is_some() {
            let slot = self.plan.replay.as_ref();
            self.attacker.corrupt(self.plan.hostile, r, &mut delta, slot, fragment.clone());
        }
        // a free rider's zeros, copy or replay go on the wire as they are, not
        // through its error feedback (which would send its honest residuals)
        let verbatim = matches!(hostile, Some(Hostile::Zero | Hostile::Copy | Hostile::Replay(_)));
        let (bytes, sent) = match (self.feedback.as_mut(), self.encoding.sparse()) {
            (Some(_), Some(s)) if verbatim => (sparse::encode_seeded(&delta, s.up, r).0, None),
            (Some(ef), _) => {
                let (bytes, sent) = ef.compress_seeded(&delta, 1.0, r);
                (bytes, Some(sent))
            }
            (None, _) => (compress::encode(&delta, self.encoding), None),
        };
        drop(delta);
        let trained_s = self.clock.train_s;
        let (train_ms, wall_ms) = self.clock.lap();
        let tokens = u64::from(self.m.data.batch) * u64::from(self.m.data.block);
        let contribution = Contribution {
            run: self.run.0,
            round: r,
            inner_steps: progress.taken as u32,
            samples: match hostile {
                Some(Hostile::Inflate) => 1_000_000_000_000,
                _ => progress.taken * tokens,
            },
            pseudo_gradient: ParameterRef {
                name: "delta".into(),
                shard: 0,
                blob: *blake3::hash(&bytes).as_bytes(),
                size: bytes.len() as u64,
            },
            loss: (progress.loss_sum / progress.taken.max(1) as f64) as f32,
            delta: bytes,
            bytes_down: 0,
            term: a.term,
            params_hash: a.parameters.first().map(|p| p.blob).unwrap_or_default(),
            // `timing`: a claim of 1 ms for the round's steps
            train_ms: if hostile == Some(Hostile::Timing) { 1 } else { train_ms },
            wall_ms,
            sent_unix_ms: wire::unix_ms(),
            slice_hashes: Vec::new(),
        };
        let late = hostile == Some(Hostile::Late);
        Outgoing { contribution, sent, trained_s, late, slices: Vec::new() }
    }

    /// After a send: a refused contribution's sparse entries go back into the error
    /// feedback (sent again later, not lost), and the event says how it fared.
    fn finish(&mut self, out: Outgoing, delivery: &Delivery) {
        let c = &out.contribution;
        if let (Some(ef), Some(sent)) = (self.feedback.as_mut(), &out.sent) {
            if !delivery.accepted {
                sparse::subtract(&mut ef.buffer, sent, -1.0);
            }
            if let Err(e) = save_feedback(&self.feedback_file, ef) {
                tracing::warn!("saving the error feedback: {e:#}");
            }
        }
        let param_bytes = 4 * self.sizes.iter().sum::<usize>() as u64;
        let wire_bytes = delivery.wire_bytes;
        let utilization = (c.wall_ms > 0).then(|| c.train_ms as f64 / c.wall_ms as f64);
        self.io.events.emit(ev::Event::ContributionSent(ev::ContributionSent {
            round: c.round,
            loss: f64::from(c.loss),
            bytes: wire_bytes,
            param_bytes,
            ratio: wire_bytes as f64 / param_bytes as f64,
            accepted: delivery.accepted,
            reason: delivery.reason.clone(),
            tokens: c.samples,
            seconds: out.trained_s,
            bytes_up: wire_bytes,
            bytes_down: c.bytes_down,
            utilization,
            train_s: c.train_ms as f64 / 1e3,
            wall_s: c.wall_ms as f64 / 1e3,
        }));
        if self.plan.verbose {
            let verdict =
                if delivery.accepted { "accepted".to_owned() } else { format!("rejected: {}", delivery.reason) };
            println!(
                "round {}: {} steps, mean loss {:.4}, sent {:.2} MB, {verdict}",
                c.round,
                c.inner_steps,
                c.loss,
                wire_bytes as f64 / 1e6
            );
        }
    }
}
