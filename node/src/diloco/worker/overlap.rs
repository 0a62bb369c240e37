//! Overlapped rounds: compute never waits for the network.
//!
//! A worker in a run whose manifest says `overlap` sends round r's contribution
//! and, without waiting, trains round r+1 from its own parameters θ_end(r). The
//! send, the shepherd's aggregation, round r+1's announcement and the fetch of its
//! parameters θ(r+1) (the sparse update, in a sparse run) all happen meanwhile,
//! off the training loop. When θ(r+1) arrives, d inner steps later, the worker
//! **rebases**:
//!
//! θ_local ← θ(r+1) + (θ_local − θ_end(r))
//!
//! It keeps the d steps of progress it made since the send and replaces their
//! base with the shepherd's parameters. Round r+1's pseudo-gradient stays
//! θ(r+1) − θ_end(r+1), so the shepherd is the same as without overlap. Streaming
//! DiLoCo's overlapping variant mixes θ_local ← α·θ_local + (1 − α)·θ(r+1) instead;
//! α = 0 would drop the d steps, larger α keeps stale parameters. The rebase is
//! the "delayed outer update" of one-step-delayed DiLoCo: the d steps' gradients
//! were taken at parameters one outer step stale, which costs little while d ≪ τ.
//! AdamW's moments carry over, as they do between rounds without overlap.
//!
//! Compute waits only when θ(r+1) has still not arrived once round r+1's τ steps
//! are done (the update is more than a round late): the worker then waits for it
//! (an `update_late` event says how long) before it can send round r+1. A newer
//! round than r+1, a round it does not take part in, or a failed fetch abandons
//! the steps trained ahead (`round_abandoned`), and the worker starts afresh from
//! the next announced round's parameters, as a joiner does. A worker killed during
//! an overlap loses only the steps trained ahead: its error feedback and followed
//! chain are saved at each send, and it rejoins at the next round.

use std::sync::Arc;
use std::time::Instant;

use anyhow::Context as _;
use pcp_protocol::diloco::Tensors;
use pcp_schema::RoundAnnouncement;
use tokio::sync::mpsc;

use super::{
    AbortOnDrop, Delivery, Fetched, Key, Latest, Next, Outcome, Outgoing, Progress, RoundParams, Trainer, key,
    newer_round,
};
use crate::diloco::wire::Signer;
use crate::observe::events::{Event, RoundAbandoned, UpdateLate, UpdateMerged};

/// What finished off the training loop.
enum Done {
    /// The parameters of the announcement with this key.
    Fetched(Key, anyhow::Result<RoundParams>),
    /// A contribution's send (`None`: cancelled), and the signer it borrowed.
    Delivered(Option<Delivery>, Signer),
}

/// The round trained ahead: its parameters may not be here yet.
enum Base {
    /// No announcement of the round yet.
    Awaited,
    /// Announced; its parameters are on the way (the task is aborted with it).
    Fetching(Box<RoundAnnouncement>, #[expect(dead_code, reason = "held for its drop")] AbortOnDrop),
    /// Announced and merged: the round's start parameters.
    Merged(Box<RoundAnnouncement>, Tensors, u64),
}

/// Why the steps trained ahead are dropped.
enum Drop {
    /// Start afresh from the next announcement.
    Abandon(String),
    /// Stop training on this run.
    Stop(Outcome),
}

/// The network side of an overlapped worker: at most one send and one fetch in
/// flight, each reporting on `done`.
struct Flights {
    done_tx: mpsc::Sender<Done>,
    done: mpsc::Receiver<Done>,
    /// The signer, unless a send has it.
    signer: Option<Signer>,
    /// The contribution on its way, and its task.
    sending: Option<(Outgoing, AbortOnDrop)>,
}

/// Runs overlapped rounds until the run ends, the worker must rejoin, or it is
/// cancelled.
pub(super) async fn run(t: &mut Trainer<'_>, signer: &mut Signer) -> anyhow::Result<Outcome> {
    let (done_tx, done) = mpsc::channel(4);
    let mut flights = Flights { done_tx, done, signer: Some(Signer::new(signer.identity().clone())), sending: None };
    // the last announcement handled
    let mut seen: Option<Key> = None;
    let outcome = 'fresh: loop {
        // a round to start from: the next announced one, parameters fetched
        let a = match t.next(&mut seen).await {
            Next::Train(a) => a,
            Next::Skip => continue,
            Next::Stop(outcome) => break outcome,
        };
        let fetched = match t.fetch_round(&a).await {
            Fetched::Got(fetched) => fetched,
            Fetched::Cancelled => break Outcome::Cancelled,
            Fetched::Failed(reason) => {
                tracing::warn!("round {}: {reason}", a.round);
                t.io.events.emit(Event::RoundAbandoned(RoundAbandoned {
                    round: a.round,
                    steps: 0,
                    reason: Some(reason.to_string()),
                }));
                continue;
            }
        };
        t.hold(&a, &fetched).await;
        t.engine.set_params(fetched.params.clone()).await?;
        let mut base = Base::Merged(a, fetched.params, fetched.bytes);
        let mut end_prev: Option<Tensors> = None;
        loop {
            let r = match &base {
                Base::Merged(a, ..) => a.round,
                _ => seen.map_or(0, |k| k.0) + 1,
            };
            match round(t, &mut flights, &mut seen, &mut base, end_prev.as_ref(), r).await? {
                Ok((a, start, bytes_down, progress)) => {
                    // the previous send's refusal gives its entries back to the feedback first
                    flights.land(t).await;
                    let end = t.engine.params().await?;
                    let mut out = t.outgoing(&a, &start, &end, &progress);
                    out.contribution.bytes_down = bytes_down;
                    flights.send(t, out, key(&a))?;
                    end_prev = Some(end);
                    base = Base::Awaited;
                }
                Err(Drop::Abandon(reason)) => {
                    t.io.events.emit(Event::RoundAbandoned(RoundAbandoned {
                        round: r,
                        steps: 0,
                        reason: Some(reason.to_string()),
                    }));
                    continue 'fresh;
                }
                Err(Drop::Stop(outcome)) => break 'fresh outcome,
            }
        }
    };
    flights.land(t).await;
    Ok(outcome)
}

/// Round `r`'s τ inner steps, from `base` (merged already, or arriving meanwhile
/// and rebased onto). Returns the round's announcement, start parameters, the
/// bytes fetched for them and the steps' progress.
async fn round(
    t: &mut Trainer<'_>,
    flights: &mut Flights,
    seen: &mut Option<Key>,
    base: &mut Base,
    end_prev: Option<&Tensors>,
    r: u64,
) -> anyhow::Result<Result<(Box<RoundAnnouncement>, Tensors, u64, Progress), Drop>> {
    let mut sampler = t.sampler(r)?;
    let mut progress = Progress::default();
    let tau = t.tau();
    let mut late: Option<Instant> = None;
    loop {
        if t.io.cancel.is_cancelled() {
            return Ok(Err(Drop::Stop(Outcome::Cancelled)));
        }
        // the network's news, without waiting
        while let Ok(done) = flights.done.try_recv() {
            if let Some(fetched) = flights.on(t, done)
                && let Err(drop) = merge(t, base, fetched, end_prev, progress.taken).await?
            {
                return Ok(Err(drop));
            }
        }
        if let Err(drop) = look(t, flights, seen, base, r) {
            return Ok(Err(drop));
        }
        if progress.taken < tau {
            progress.loss_sum += f64::from(t.step(r, progress.taken, &mut sampler).await?);
            progress.taken += 1;
            continue;
        }
        if let Base::Merged(..) = base {
            if let Some(since) = late {
                t.io.events
                    .emit(Event::UpdateLate(UpdateLate { round: r, waited_ms: since.elapsed().as_millis() as u64 }));
            }
            let Base::Merged(a, start, bytes) = std::mem::replace(base, Base::Awaited) else { unreachable!() };
            return Ok(Ok((a, start, bytes, progress)));
        }
        // τ steps done and the round's parameters are not here: the update is a
        // round late, and only now does compute wait
        late.get_or_insert_with(Instant::now);
        tokio::select! {
            () = t.io.cancel.cancelled() => return Ok(Err(Drop::Stop(Outcome::Cancelled))),
            changed = t.latest.changed() => if changed.is_err() {
                return Ok(Err(Drop::Stop(Outcome::Rejoin("the heartbeat task stopped".into()))));
            },
            Some(done) = flights.done.recv() => if let Some(fetched) = flights.on(t, done)
                && let Err(drop) = merge(t, base, fetched, end_prev, progress.taken).await?
            {
                return Ok(Err(drop));
            },
        }
    }
}

/// Acts on the latest announcement for round `r`, trained ahead from `base`:
/// starts the fetch of its parameters, or drops the round if a newer one (or the
/// run's end) came instead.
fn look(
    t: &mut Trainer<'_>,
    flights: &mut Flights,
    seen: &mut Option<Key>,
    base: &mut Base,
    r: u64,
) -> Result<(), Drop> {
    match base {
        Base::Awaited => {}
        Base::Fetching(a, _) | Base::Merged(a, ..) => {
            return if newer_round(&t.latest, key(a)) {
                Err(Drop::Abandon("a newer announcement".into()))
            } else {
                Ok(())
            };
        }
    }
    let a = match &*t.latest.borrow() {
        Latest::Nothing => return Ok(()),
        Latest::Refused(reason) => return Err(Drop::Stop(Outcome::Rejoin(reason.clone()))),
        Latest::Round(a) if a.finished || (a.round, a.term, a.deadline_unix_ms) > seen.unwrap_or_default() => a.clone(),
        Latest::Round(_) => return Ok(()),
    };
    if a.round != r && !a.finished {
        // not the round trained ahead: leave it to the fresh start
        return Err(Drop::Abandon(format!("round {} opened while round {r} was trained ahead", a.round)));
    }
    match t.consider(a, seen) {
        Next::Train(a) => {
            let task = tokio::spawn({
                let (fetch, tx, k) = (t.fetch_task(&a), flights.done_tx.clone(), key(&a));
                async move {
                    let _ = tx.send(Done::Fetched(k, fetch.await)).await;
                }
            });
            *base = Base::Fetching(a, AbortOnDrop(task));
            Ok(())
        }
        Next::Skip => Err(Drop::Abandon(format!("this worker does not train round {r}"))),
        Next::Stop(outcome) => Err(Drop::Stop(outcome)),
    }
}

/// Rebases onto round `r`'s fetched parameters: θ_local ← θ(r) + (θ_local − θ_end(r−1)).
async fn merge(
    t: &mut Trainer<'_>,
    base: &mut Base,
    (k, fetched): (Key, anyhow::Result<RoundParams>),
    end_prev: Option<&Tensors>,
    after_steps: u64,
) -> anyhow::Result<Result<(), Drop>> {
    let Base::Fetching(a, _) = &*base else { return Ok(Ok(())) };
    if key(a) != k {
        return Ok(Ok(())); // a stale fetch
    }
    let fetched = match fetched {
        Ok(fetched) => fetched,
        Err(e) => return Ok(Err(Drop::Abandon(format!("{e:#}")))),
    };
    let Base::Fetching(a, _) = std::mem::replace(base, Base::Awaited) else { unreachable!() };
    t.hold(&a, &fetched).await;
    let end = end_prev.context("rebasing without the previous round's end")?;
    let mut local = t.engine.params().await?;
    // the fragment the previous round synced (every tensor without fragments)
    for i in t.fragment(a.round - 1) {
        for ((l, g), e) in local[i].iter_mut().zip(&fetched.params[i]).zip(&end[i]) {
            *l = g + (*l - e);
        }
    }
    t.engine.set_params(local).await?;
    t.io.events.emit(Event::UpdateMerged(UpdateMerged {
        round: a.round,
        after_steps,
        bytes: fetched.bytes,
        via: fetched.via.to_owned(),
    }));
    *base = Base::Merged(a, fetched.params, fetched.bytes);
    Ok(Ok(()))
}

impl Flights {
    /// Handles a finished flight: a send's outcome is settled here; a fetch's
    /// parameters are handed back.
    fn on(&mut self, t: &mut Trainer<'_>, done: Done) -> Option<(Key, anyhow::Result<RoundParams>)> {
        match done {
            Done::Fetched(k, result) => Some((k, result)),
            Done::Delivered(delivery, signer) => {
                self.signer = Some(signer);
                if let Some((out, _task)) = self.sending.take() {
                    let delivery = delivery.unwrap_or(Delivery {
                        accepted: false,
                        reason: "cancelled before the answer".into(),
                        wire_bytes: 0,
                    });
                    t.finish(out, &delivery);
                }
                None
            }
        }
    }

    /// Waits until no send is in flight (a fetch finishing meanwhile is dropped:
    /// only a round's own loop asks for one).
    async fn land(&mut self, t: &mut Trainer<'_>) {
        while self.sending.is_some() {
            match self.done.recv().await {
                Some(done) => {
                    self.on(t, done);
                }
                None => return,
            }
        }
    }

    /// Sends `out` off the training loop.
    fn send(&mut self, t: &Trainer<'_>, out: Outgoing, this: Key) -> anyhow::Result<()> {
        let mut signer = self.signer.take().context("a second send while one is in flight")?;
        let (courier, tx, contribution) = (t.courier(), self.done_tx.clone(), Arc::new(out.contribution.clone()));
        let task = tokio::spawn(async move {
            let delivery = courier.deliver(&mut signer, &contribution, this).await;
            let _ = tx.send(Done::Delivered(delivery, signer)).await;
        });
        self.sending = Some((out, AbortOnDrop(task)));
        Ok(())
    }
}
