//! The worker's host: it carries out the actions of the protocol's worker state
//! machine ([`pcp_protocol::diloco::worker::Worker`], whose docs give the rules),
//! the same one `pcp-node simulate` drives, and feeds it what happens: the
//! announcements, the fetches, the inner steps and the sends. Lockstep and
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
use pcp_protocol::diloco::Tensors;
use pcp_protocol::diloco::worker::{Action, Input, Worker};
use pcp_schema::RoundAnnouncement;
use tokio::sync::mpsc;

use super::{AbortOnDrop, Delivery, Fetched, Latest, Next, Opening, Outcome, Outgoing, Progress, RoundParams, Trainer};
use crate::diloco::wire::{self, Signer};
use crate::observe::events::{Event, RoundAbandoned, UpdateLate, UpdateMerged};

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

/// The worker's host: the state machine, and what its actions need kept (module
/// docs).
struct Host {
    machine: Worker,
    /// The newest announcement handed to the machine.
    seen: Option<Opening>,
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
}

/// Runs the run's rounds, lockstep or overlapped as its manifest says, until the
/// run ends, the worker must rejoin, or it is cancelled.
pub(super) async fn run(t: &mut Trainer<'_>, signer: &mut Signer) -> anyhow::Result<Outcome> {
    let (done_tx, done) = mpsc::channel(4);
    let mut host = Host {
        machine: fresh_machine(t),
        seen: None,
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
    };
    let outcome = host.drive(t).await?;
    host.land(t).await;
    Ok(outcome)
}

fn fresh_machine(t: &Trainer<'_>) -> Worker {
    Worker::new(t.me.0.to_vec(), t.m.seed, t.tau()).with_overlap(t.m.overlap)
}

impl Host {
    /// The loop: the network's news, then one inner step, or a wait when there is
    /// nothing to compute.
    async fn drive(&mut self, t: &mut Trainer<'_>) -> anyhow::Result<Outcome> {
        loop {
            if t.io.cancel.is_cancelled() {
                return Ok(Outcome::Cancelled);
            }
            while let Ok(done) = self.done.try_recv() {
                if let Some(outcome) = self.on(t, done).await? {
                    return Ok(outcome);
                }
            }
            if let Some(outcome) = self.look(t).await? {
                return Ok(outcome);
            }
            if let Some(steps) = self.training.as_mut() {
                let started = Instant::now();
                steps.progress.loss_sum +=
                    f64::from(t.step(steps.round, steps.progress.taken, &mut steps.sampler).await?);
                steps.progress.taken += 1;
                steps.spent += started.elapsed();
                if steps.over() {
                    let steps = self.training.take().context("steps under way")?;
                    self.trained.insert(steps.round, steps.progress);
                    if let Some(outcome) = self.feed(t, Input::Trained(steps.round)).await? {
                        return Ok(outcome);
                    }
                }
                continue;
            }
            // nothing to compute: wait for the network
            tokio::select! {
                () = t.io.cancel.cancelled() => return Ok(Outcome::Cancelled),
                changed = t.latest.changed() => if changed.is_err() {
                    return Ok(Outcome::Rejoin("the heartbeat task stopped".into()));
                },
                Some(done) = self.done.recv() => if let Some(outcome) = self.on(t, done).await? {
                    return Ok(outcome);
                },
            }
        }
    }

    /// Hands the latest announcement to the machine if it is new.
    async fn look(&mut self, t: &mut Trainer<'_>) -> anyhow::Result<Option<Outcome>> {
        let a = match &*t.latest.borrow_and_update() {
            Latest::Nothing => return Ok(None),
            Latest::Refused(reason) => return Ok(Some(Outcome::Rejoin(reason.clone()))),
            Latest::Round(a) if a.finished || Some(Opening::of(a)) > self.seen => a.clone(),
            Latest::Round(_) => return Ok(None),
        };
        let heard = self.seen;
        let reopened = heard.is_some_and(|h| a.round <= h.round);
        let (budget_ms, end_ms, round, deadline_ms) = (a.budget_ms, a.steps_end_unix_ms, a.round, a.deadline_unix_ms);
        let participant = match t.consider(a, &mut self.seen) {
            Next::Stop(outcome) => return Ok(Some(outcome)),
            Next::Train(a) => {
                if reopened {
                    // the same round opened again (a restarted or new leader): what was
                    // trained ahead or sent for it went to the old one; start afresh
                    self.restart(t, format!("round {} opened again", a.round));
                }
                self.announced.insert(a.round, a);
                true
            }
            Next::Skip if self.seen != heard && !reopened => false,
            Next::Skip => return Ok(None),
        };
        let budget = Input::Budget { round, budget_ms, end_ms };
        if let Some(outcome) = self.feed(t, budget).await? {
            return Ok(Some(outcome));
        }
        self.feed(t, Input::RoundOpened { round, deadline_ms, participant }).await
    }

    /// Drops everything of the chain trained so far: the machine starts afresh.
    fn restart(&mut self, t: &mut Trainer<'_>, reason: String) {
        if let Some(round) = self.machine.sending().last().copied().max(self.training.as_ref().map(|s| s.round)) {
            let steps = self.training.as_ref().map_or(0, |s| s.progress.taken);
            t.io.events.emit(Event::RoundAbandoned(RoundAbandoned { round, steps, reason: Some(reason) }));
        }
        self.machine = fresh_machine(t);
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
    async fn feed(&mut self, t: &mut Trainer<'_>, input: Input) -> anyhow::Result<Option<Outcome>> {
        let mut inputs = VecDeque::from([input]);
        while let Some(input) = inputs.pop_front() {
            for action in self.machine.handle(input, wire::unix_ms()) {
                match self.act(t, action).await? {
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
    async fn act(&mut self, t: &mut Trainer<'_>, action: Action) -> anyhow::Result<Result<Option<Input>, Outcome>> {
        match action {
            Action::FetchParams(r) => return self.fresh(t, r).await,
            Action::Train { round, steps, budget_ms, .. } => {
                self.training = Some(Steps {
                    round,
                    sampler: t.sampler(round)?,
                    progress: Progress::default(),
                    spent: Duration::ZERO,
                    steps: super::Hostile::steps(t.plan.hostile.and_then(|a| a.at(round)), steps),
                    budget: budget_ms.map(Duration::from_millis),
                    end_ms: None,
                });
            }
            Action::EndSteps { round, end_ms } => {
                if let Some(steps) = self.training.as_mut().filter(|s| s.round == round) {
                    steps.end_ms = Some(end_ms);
                }
            }
            Action::Send(r) => self.send(t, r).await?,
            Action::FetchUpdate(r) => self.fetch_update(t, r)?,
            Action::Rebase(r) => self.rebase(t, r).await?,
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
                t.io.events.emit(Event::RoundAbandoned(RoundAbandoned {
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
    async fn fresh(&mut self, t: &mut Trainer<'_>, r: u64) -> anyhow::Result<Result<Option<Input>, Outcome>> {
        self.clear();
        let Some(a) = self.announced.get(&r).cloned() else {
            return Ok(Ok(Some(Input::Failed(r))));
        };
        match t.fetch_round(&a).await {
            Fetched::Cancelled => Ok(Err(Outcome::Cancelled)),
            Fetched::Failed(reason) => {
                tracing::warn!("round {r}: {reason}");
                t.io.events.emit(Event::RoundAbandoned(RoundAbandoned { round: r, steps: 0, reason: Some(reason) }));
                Ok(Ok(Some(Input::Failed(r))))
            }
            Fetched::Got(fetched) => {
                t.hold(&a, &fetched).await;
                if t.m.overlap {
                    t.engine.set_params(fetched.params.clone()).await?;
                } else {
                    // lockstep with fragments keeps the fragments this round did not sync
                    t.load(&a, &fetched.params).await?;
                }
                self.bytes_down.insert(r, fetched.bytes);
                self.anchors.insert(r - 1, fetched.params);
                Ok(Ok(Some(Input::ParamsReady(r))))
            }
        }
    }

    /// Round `r`'s contribution: anchor(r − 1) − θ; θ becomes anchor(r).
    async fn send(&mut self, t: &mut Trainer<'_>, r: u64) -> anyhow::Result<()> {
        if let Some((round, since)) = self.late.take() {
            let waited_ms = since.elapsed().as_millis() as u64;
            if waited_ms > 0 {
                t.io.events.emit(Event::UpdateLate(UpdateLate { round, waited_ms }));
            }
        }
        let a = self.announced.get(&r).cloned().with_context(|| format!("sending round {r}, not announced"))?;
        let progress = self.trained.remove(&r).with_context(|| format!("sending round {r}, not trained"))?;
        let end = t.engine.params().await?;
        // With fragments, round r syncs one fragment, whose local progress since its
        // own last sync (P rounds ago; rebases move only the fragment just synced) is
        // measured from its global value, which the latest parameters held carry.
        let held = t.held.clone().filter(|_| t.fragments.len() > 1);
        let start = match &held {
            Some(held) => &held.params,
            None => self.anchors.get(&(r - 1)).with_context(|| format!("sending round {r} without its anchor"))?,
        };
        let mut out = t.outgoing(&a, start, &end, &progress);
        out.contribution.bytes_down = self.bytes_down.remove(&r).unwrap_or(0);
        self.anchors.insert(r, end);
        // anchor(t − 1) goes once round t is sent and merged: at most depth 2 stays
        while self.anchors.len() > 3 {
            self.anchors.pop_first();
        }
        self.announced.retain(|k, _| *k + 2 >= r);
        self.queued.push_back((out, Opening::of(&a)));
        self.next_send(t)
    }

    /// Starts the next queued send if none is on its way.
    fn next_send(&mut self, t: &Trainer<'_>) -> anyhow::Result<()> {
        if self.sending.is_some() {
            return Ok(());
        }
        let Some((mut out, this)) = self.queued.pop_front() else { return Ok(()) };
        let mut signer = self.signer.take().context("a second send while one is in flight")?;
        out.contribution.sent_unix_ms = wire::unix_ms();
        let (courier, tx, contribution) = (t.courier(), self.done_tx.clone(), Arc::new(out.contribution.clone()));
        let late = out.late;
        let task = tokio::spawn(async move {
            if late {
                courier.after_close(this).await;
            }
            let delivery = courier.deliver(&mut signer, &contribution, this).await;
            let _ = tx.send(Done::Delivered(delivery, signer)).await;
        });
        self.sending = Some((out, AbortOnDrop(task), self.epoch));
        Ok(())
    }

    /// Fetches θ(r) beside the steps.
    fn fetch_update(&mut self, t: &Trainer<'_>, r: u64) -> anyhow::Result<()> {
        let a = self.announced.get(&r).with_context(|| format!("fetching round {r}, not announced"))?;
        let (fetch, tx, k) = (t.fetch_task(a), self.done_tx.clone(), Opening::of(a));
        self.fetching = Some(AbortOnDrop(tokio::spawn(async move {
            let _ = tx.send(Done::Fetched(r, k, fetch.await)).await;
        })));
        Ok(())
    }

    /// θ ← θ + (θ(r) − anchor(r − 1)), and every newer anchor with it, over the
    /// fragment round r − 1 synced (every tensor without fragments).
    async fn rebase(&mut self, t: &mut Trainer<'_>, r: u64) -> anyhow::Result<()> {
        let fetched = self.fetched.remove(&r).with_context(|| format!("rebasing onto round {r}, not fetched"))?;
        let base = self.anchors.get(&(r - 1)).with_context(|| format!("rebasing onto round {r} without its anchor"))?;
        let fragment = t.fragment(r - 1);
        let shift: Vec<Vec<f32>> =
            fragment.clone().map(|i| fetched.params[i].iter().zip(&base[i]).map(|(g, b)| g - b).collect()).collect();
        let mut local = t.engine.params().await?;
        for tensors in std::iter::once(&mut local).chain(self.anchors.range_mut(r - 1..).map(|(_, a)| a)) {
            for (i, d) in fragment.clone().zip(&shift) {
                tensors[i].iter_mut().zip(d).for_each(|(v, d)| *v += d);
            }
        }
        t.engine.set_params(local).await?;
        let after_steps = self.training.as_ref().map_or(0, |s| s.progress.taken);
        t.io.events.emit(Event::UpdateMerged(UpdateMerged {
            round: r,
            after_steps,
            bytes: fetched.bytes,
            via: fetched.via.to_owned(),
        }));
        Ok(())
    }

    /// Handles a finished flight.
    async fn on(&mut self, t: &mut Trainer<'_>, done: Done) -> anyhow::Result<Option<Outcome>> {
        match done {
            Done::Fetched(r, k, result) => {
                if self.announced.get(&r).is_none_or(|a| Opening::of(a) != k) {
                    return Ok(None); // a stale fetch
                }
                self.fetching = None;
                match result {
                    Ok(fetched) => {
                        let a = self.announced.get(&r).cloned().context("announced")?;
                        t.hold(&a, &fetched).await;
                        self.bytes_down.insert(r, fetched.bytes);
                        self.fetched.insert(r, fetched);
                        self.feed(t, Input::ParamsReady(r)).await
                    }
                    Err(e) => {
                        let (round, steps) = self.training.as_ref().map_or((r, 0), |s| (s.round, s.progress.taken));
                        let reason = format!("fetching round {r}'s parameters: {e:#}");
                        tracing::warn!("round {round}: {reason}");
                        t.io.events.emit(Event::RoundAbandoned(RoundAbandoned { round, steps, reason: Some(reason) }));
                        self.feed(t, Input::Failed(r)).await
                    }
                }
            }
            Done::Delivered(delivery, signer) => match self.delivered(t, delivery, signer)? {
                Some(r) => self.feed(t, Input::Sent(r)).await,
                None => Ok(None),
            },
        }
    }

    /// A send finished: its outcome is reported, and the next queued one starts.
    /// Returns the round sent, unless the send is from before a restart.
    fn delivered(
        &mut self,
        t: &mut Trainer<'_>,
        delivery: Option<Delivery>,
        signer: Signer,
    ) -> anyhow::Result<Option<u64>> {
        self.signer = Some(signer);
        let Some((out, _task, epoch)) = self.sending.take() else { return Ok(None) };
        let delivery = delivery.unwrap_or(Delivery {
            accepted: false,
            reason: "cancelled before the answer".into(),
            wire_bytes: 0,
        });
        let r = out.contribution.round;
        t.finish(out, &delivery);
        self.next_send(t)?;
        Ok((epoch == self.epoch).then_some(r))
    }

    /// Waits until every contribution trained is sent (a fetch finishing meanwhile
    /// is dropped).
    async fn land(&mut self, t: &mut Trainer<'_>) {
        while self.sending.is_some() {
            match self.done.recv().await {
                Some(Done::Delivered(delivery, signer)) => {
                    if let Err(e) = self.delivered(t, delivery, signer) {
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
