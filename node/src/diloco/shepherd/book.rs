//! The open round's book: what each contributor sent and fetched, the bases its
//! update applies to, the bytes served, and the losses the run has reached; and
//! the round's close, which publishes its update and state, validates,
//! checkpoints, and records it (`round_completed` and the trust events).

use std::collections::BTreeMap;
use std::io::Write as _;
use std::time::{Duration, Instant};

use pcp_protocol::diloco::shepherd::RoundSummary;
use pcp_protocol::{BlobHash, PublicKey};
use pcp_schema::{ParameterRef, Update};

use super::{Host, Screen, screen, served};
use crate::diloco::wire::{self, peer_name};
use crate::observe::events as ev;

/// What a contributor of the open round sent and reported.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Traffic {
    /// Bytes of its contribution.
    pub(super) up: u64,
    /// Parameter bytes it says it fetched.
    pub(super) down: u64,
    /// Milliseconds in inner steps and wall milliseconds since its previous
    /// contribution, as it reports them (0, 0: not said).
    pub(super) busy: (u64, u64),
}

impl Traffic {
    /// The worker's utilization: time in inner steps over wall time, if it said.
    pub(super) fn utilization(&self) -> Option<f64> {
        let (train, wall) = self.busy;
        (wall > 0).then(|| (train as f64 / wall as f64).min(1.0))
    }

    /// The network's utilization: the contributors' inner-step time over their wall
    /// time, all together; `None` when none said.
    pub(super) fn network<'a>(traffic: impl Iterator<Item = &'a Traffic>) -> Option<f64> {
        let (train, wall) =
            traffic.filter(|t| t.busy.1 > 0).fold((0u64, 0u64), |(t, w), x| (t + x.busy.0.min(x.busy.1), w + x.busy.1));
        (wall > 0).then(|| train as f64 / wall as f64)
    }
}

/// What the shepherd keeps of the open round and of the run's progress.
#[derive(Debug)]
pub(super) struct RoundBook {
    /// The open round and how long its deadline waited for contributions being read.
    pub(super) receiving_extension: (u64, u64),
    /// When the open round opened.
    pub(super) started: Instant,
    /// Contribution bytes received in the open round.
    pub(super) bytes_in: u64,
    /// Bytes each contributor of the open round sent, and says it fetched.
    pub(super) traffic: BTreeMap<PublicKey, Traffic>,
    /// The parameters blob of the open round: what its update applies to.
    pub(super) round_base: Option<BlobHash>,
    /// The parameters' hash and their shards' references the last close computed,
    /// with the rounds completed then: the next announcement names them without
    /// hashing the parameters again.
    pub(super) next_params: Option<(u64, BlobHash, Vec<ParameterRef>)>,
    /// The round before the open one and its parameters blob: the fence of a
    /// contribution an overlapping run carries over from it.
    pub(super) last_base: Option<(u64, BlobHash)>,
    /// A sparse run's last update and the parameters it applies to.
    pub(super) update: Option<Update>,
    /// Bytes the node had served when the open round opened.
    pub(super) served_at_open: u64,
    /// The validation loss after the last round, and after the first.
    pub(super) last_val: f64,
    pub(super) first_val: f64,
    /// The last close's phases as they went, logged when the next round opens.
    pub(super) close: Vec<(&'static str, Duration)>,
}

impl RoundBook {
    /// A book with no round yet.
    pub(super) fn new() -> Self {
        Self {
            receiving_extension: (0, 0),
            started: Instant::now(),
            bytes_in: 0,
            traffic: BTreeMap::new(),
            round_base: None,
            next_params: None,
            last_base: None,
            update: None,
            served_at_open: 0,
            last_val: f64::NAN,
            first_val: f64::NAN,
            close: Vec::new(),
        }
    }
}

impl Host {
    pub(super) async fn round_completed(&mut self, summary: RoundSummary<PublicKey>) -> anyhow::Result<()> {
        let mut lap = Instant::now();
        let mut phase = |book: &mut RoundBook, name| {
            let now = Instant::now();
            book.close.push((name, now - lap));
            lap = now;
        };
        let threads = self.plan.aggregation.threads;
        let (params_hash, shards) = wire::hash_params(self.machine.params(), &self.layout.shards, threads);
        self.book.next_params = Some((self.machine.completed(), params_hash, shards));
        // a sparse run publishes the update: workers holding this round's parameters fetch it instead
        let update_bytes = summary.update.as_ref().map_or(0, Vec::len) as u64;
        self.book.update = match (&summary.update, self.book.round_base) {
            (Some(bytes), Some(base)) => {
                let hash = self.store.put_bytes(bytes)?;
                let blob = ParameterRef { name: "update".into(), shard: 0, blob: hash.0, size: bytes.len() as u64 };
                Some(Update { blob, base: base.0 })
            }
            _ => None,
        };
        let workers: Vec<ev::WorkerTraffic> = summary
            .contributors
            .iter()
            .map(|p| {
                let t = self.book.traffic.get(p).copied().unwrap_or_default();
                ev::WorkerTraffic {
                    peer: peer_name(p),
                    bytes_up: t.up,
                    bytes_down: t.down,
                    utilization: t.utilization(),
                }
            })
            .collect();
        let utilization = Traffic::network(summary.contributors.iter().filter_map(|p| self.book.traffic.get(p)));
        self.lead.quorum.round_completed(&summary.contributors, wire::mono_ms());
        phase(&mut self.book, "hash and update");
        // validation and the checkpoint hold this loop: the keeper sends the leases meanwhile
        let val = self.validate().await?;
        phase(&mut self.book, "validation");
        // the state every round where candidates fetch it (--resume starts from it
        // too), a checkpoint every --checkpoint-rounds
        self.publish_state(&summary.contributors, &summary.excluded, params_hash)?;
        phase(&mut self.book, "state");
        let first = !self.plan.state_dir.join("latest").exists();
        let last = summary.round >= self.plan.rounds;
        let path = match self.plan.retention.checkpoints(summary.round, last, first) {
            true => Some(self.checkpoint(&summary.contributors, &summary.excluded, params_hash)?),
            false => None,
        };
        phase(&mut self.book, "checkpoint");
        self.book.last_val = val;
        if self.book.first_val.is_nan() {
            self.book.first_val = self.book.last_val;
        }
        let bytes_out =
            self.node.stats().await.map(|s| served(&s)).unwrap_or(0).saturating_sub(self.book.served_at_open);
        self.trust_events(&summary);
        for (peer, norm) in &summary.scaled {
            let bound = summary.norm_bound;
            self.events.emit(ev::Event::ContributionClipped(ev::ContributionClipped {
                peer: peer_name(peer),
                round: summary.round,
                norm: *norm,
                bound,
                reason: format!("norm {norm:.4} above the round's bound {bound:.4}: scaled by {:.4}", bound / norm),
            }));
        }
        self.events.emit(ev::Event::RoundCompleted(ev::RoundCompleted {
            round: summary.round,
            contributors: summary.contributors.len() as u64,
            mean_loss: summary.mean_loss,
            val_loss: self.book.last_val,
            bytes_in: self.book.bytes_in,
            bytes_out,
            seconds: summary.duration_ms as f64 / 1e3,
            params_hash: params_hash.to_hex(),
            peers: summary.contributors.iter().map(peer_name).collect(),
            excluded: summary.excluded.iter().map(peer_name).collect(),
            clipped: summary.clipped as u64,
            norm_bound: summary.norm_bound,
            encoding: self.plan.encoding.name().to_owned(),
            update_bytes,
            workers,
            utilization,
            carried: summary.carried.iter().map(peer_name).collect(),
            budget_ms: summary.budget_ms,
        }));
        self.admission_held(summary.round);
        if let Some(path) = path {
            self.events.emit(ev::Event::Checkpoint(ev::Checkpoint {
                step: None,
                round: Some(summary.round),
                path: path.display().to_string(),
            }));
        }
        if self.plan.table {
            writeln!(
                self.out.lock(),
                "{:>5} {:>12} {:>10.4} {:>10.4} {:>8.1} {:>10.1} {:>10.1}",
                summary.round,
                summary.contributors.len(),
                summary.mean_loss,
                self.book.last_val,
                summary.duration_ms as f64 / 1e3,
                self.book.bytes_in as f64 / 1e3,
                bytes_out as f64 / 1e3
            )?;
        }
        self.book.bytes_in = 0;
        self.set_published(None);
        // the round's update and state are the next round's: its announcement names them,
        // and a worker holding this round's parameters fetches the update (with
        // `--keep-rounds 1`, recorded as this round's, they went when the next opened)
        let made = [self.book.update.as_ref().map(|u| u.blob.blob), self.lead.state.as_ref().map(|s| s.blob)];
        let made = made.into_iter().flatten().map(BlobHash);
        self.plan.retention.advance(&self.node, &self.events, summary.round + 1, made).await;
        Ok(())
    }

    /// The round's trust record: contributions the per-tensor bounds changed, those
    /// counted at less than full trust, and the screen's cost and secret.
    pub(super) fn trust_events(&mut self, summary: &RoundSummary<PublicKey>) {
        let round = summary.round;
        for (peer, elements, tensors) in &summary.bounded {
            self.events.emit(ev::Event::ContributionBounded(ev::ContributionBounded {
                round,
                peer: peer_name(peer),
                elements: *elements,
                tensors: *tensors as u64,
            }));
        }
        for (peer, factor, probation) in &summary.discounted {
            self.events.emit(ev::Event::ContributionDiscounted(ev::ContributionDiscounted {
                round,
                peer: peer_name(peer),
                factor: *factor,
                reason: if *probation { "probation" } else { "rating below the median" }.to_owned(),
            }));
        }
        if self.plan.screen == Screen::Score {
            let s = self.screener.close(summary.duration_ms as f64 / 1e3);
            let seed = self.screener.seed();
            self.events.emit(ev::Event::ScreenRound(ev::ScreenRound {
                round,
                screened: s.screened,
                skipped: s.skipped,
                over_budget: s.over_budget,
                seconds: s.seconds,
                share: if summary.duration_ms > 0 { s.seconds * 1e3 / summary.duration_ms as f64 } else { 0.0 },
                hidden: self.screener.hidden(),
                commit: hex::encode(screen::commit(&seed)),
                seed: hex::encode(seed),
            }));
        }
    }

    /// The current parameters for the announcement's `parameters`: the whole blob
    /// first (with more than one shard, its hash and size only: what the shards must
    /// make up), then the shards, hashed here and written once the round is
    /// announced ([`Self::store_shards`]). With one shard the whole blob is stored
    /// now.
    pub(super) fn publish_params(&mut self) -> anyhow::Result<Vec<ParameterRef>> {
        let params = self.machine.params();
        let threads = self.plan.aggregation.threads;
        let closed = self.book.next_params.take().filter(|(round, ..)| *round == self.machine.completed());
        let (hash, size, shards) = match self.layout.shards.len() > 1 {
            true => {
                let (hash, shards) =
                    closed.map_or_else(|| wire::hash_params(params, &self.layout.shards, threads), |(_, h, s)| (h, s));
                (hash, wire::params_len(params), shards)
            }
            false => {
                let (hash, size) = wire::put_params(&self.store, params)?;
                (hash, size, Vec::new())
            }
        };
        let mut refs = vec![ParameterRef { name: "params".into(), shard: 0, blob: hash.0, size }];
        refs.extend(shards);
        Ok(refs)
    }

    /// Writes round `round`'s parameter shards, `announced` (those
    /// [`Self::publish_params`] named), once it is announced: the workers that hold
    /// the last round's parameters fetch its update meanwhile, and a joiner that asks
    /// for a shard first is told the shepherd lacks it and asks again a second later
    /// (`pcp_bootstrap`'s fetch). So the writes are off the path from the round's
    /// last contribution to the next announcement (`docs/running-a-run.md`).
    pub(super) fn store_shards(&mut self, round: u64, announced: &[ParameterRef]) -> anyhow::Result<()> {
        if announced.is_empty() {
            return Ok(());
        }
        let started = Instant::now();
        let threads = self.plan.aggregation.threads;
        let stored = wire::put_shards(&self.store, self.machine.params(), &self.layout.shards, threads)?;
        anyhow::ensure!(stored == announced, "round {round}'s parameter shards were written otherwise than announced");
        tracing::info!(
            "round {round}'s parameter shards written in {:.2} s, after its announcement",
            started.elapsed().as_secs_f64()
        );
        Ok(())
    }
}
