//! A worker on a screening committee: the shepherd asks it to score a
//! contribution of the open round, and it answers between two of its own inner
//! steps, on its own engine, with the losses signed.
//!
//! The request carries the contribution as its sender encoded it (an aggregated
//! one's slice hashes instead, fetched from its shards' aggregators or else its
//! sender: [`scoring::fetch_sliced`]), the round's
//! bounds and scales (so the screener applies it exactly as the round would:
//! [`pcp_protocol::diloco::shepherd::Shepherd::applied`]) and a batch of the
//! withheld split. The screener scores it at the round's parameters, which it
//! holds from its own fetch (named by their hash: a screener that holds others,
//! as after a restart, says so and the shepherd scores the contribution itself).
//! Its training parameters are untouched ([`scoring::losses`]).

use pcp_bootstrap::{Event, InboundId};
use pcp_protocol::diloco::aggregate::{Bounds, Delta};
use pcp_protocol::diloco::aggregation::sliced_id;
use pcp_protocol::diloco::committee::Losses;
use pcp_protocol::diloco::{compress, fragments};
use pcp_protocol::{PublicKey, Verified};
use pcp_schema::{Ack, AckCode, ScreenReport, ScreenRequest};
use tokio::sync::mpsc;

use super::{Hostile, Trainer};
use crate::diloco::scoring;
use crate::diloco::wire::Signer;
use crate::observe::events as ev;
use crate::training::data::Batch;
use crate::training::engine::Resident;

/// Screen requests queued for the training loop at most (more are left
/// unanswered: the shepherd scores those itself).
pub(super) const QUEUED: usize = pcp_bootstrap::admission::SCREENS_IN_FLIGHT;

/// A screen request's bytes besides the contribution's: its fields, the bounds
/// and the batch's windows.
pub(crate) fn request_overhead(tensors: usize) -> usize {
    (1 << 20) + 16 * tensors
}

/// The screen requests the heartbeat task hands the training loop, and the signer
/// of the answers.
#[derive(Debug)]
pub(super) struct Screens {
    pub(super) requests: mpsc::Receiver<Event>,
    pub(super) signer: Signer,
    /// The loss at the last parameters and batch scored: every contribution of a
    /// round is scored at the same ones.
    pub(super) before: Option<([u8; 32], f32)>,
    /// The parameters last scored at (by their hash), on the engine's device:
    /// uploaded once a round, not once a request.
    pub(super) resident: Based,
}

/// Parameters on the engine's device, by their blob's hash.
type Based = Option<([u8; 32], Resident)>;

/// Why a screener could not score a contribution (the shepherd scores it itself).
#[derive(Debug, thiserror::Error)]
pub(super) enum ScreenError {
    #[error("undecodable screen request: {0}")]
    Undecodable(String),
    #[error("a screen request for run {0}, not this worker's")]
    WrongRun(String),
    #[error("a screen request signed by {0}, not the run's leader")]
    NotLeader(String),
    #[error("the parameters it is scored at ({0}) are not the ones this worker holds")]
    Stale(String),
    #[error("the contribution: {0}")]
    Contribution(String),
    #[error("the batch: {0}")]
    Batch(String),
    #[error("scoring failed: {0:#}")]
    Scoring(anyhow::Error),
}

fn short(hash: &[u8; 32]) -> String {
    pcp_protocol::BlobHash(*hash).to_hex()[..8].to_owned()
}

impl Trainer<'_> {
    /// Answers one screen request (`request` is an [`Event::Request`]): its
    /// losses, signed by `signer`, or a refusal naming why it could not score.
    pub(super) async fn answer_screen(&mut self, request: Event, screens: &mut Screens) {
        let Event::Request { id, message, .. } = request else { return };
        let round = message.binding().round;
        let started = std::time::Instant::now();
        let signer = &mut screens.signer;
        let (envelope, contribution, reason) =
            match self.screen(&message, (&mut screens.before, &mut screens.resident)).await {
                Ok((contribution, losses)) => {
                    let losses = Hostile::screened(self.plan.hostile, round, losses);
                    let Losses { before, after, reversed } = losses;
                    let report = ScreenReport { run: self.run.0, round, contribution, before, after, reversed };
                    (signer.seal(self.run, round, &report), short(&contribution), String::new())
                }
                Err(e) => {
                    tracing::debug!(round, "cannot screen: {e}");
                    let ack = Ack::refuse(self.run.0, round, AckCode::Other, e.to_string());
                    (signer.seal(self.run, round, &ack), String::new(), e.to_string())
                }
            };
        self.io.events.emit(ev::Event::ScreenAnswered(ev::ScreenAnswered {
            round,
            contribution,
            seconds: started.elapsed().as_secs_f64(),
            reason,
        }));
        self.respond(id, envelope).await;
    }

    async fn respond(&self, id: InboundId, envelope: pcp_schema::SignedEnvelope) {
        if let Err(e) = self.io.node.respond(id, envelope).await {
            tracing::debug!("answering a screen request: {e}");
        }
    }

    /// The losses of the contribution `message` asks about, and its id; `before`:
    /// the loss at the parameters and batch last scored, kept.
    async fn screen(
        &self,
        message: &Verified,
        (before, resident): (&mut Option<([u8; 32], f32)>, &mut Based),
    ) -> Result<([u8; 32], Losses), ScreenError> {
        let r: ScreenRequest = message.decode().map_err(|e| ScreenError::Undecodable(e.to_string()))?;
        if r.run != self.run.0 {
            return Err(ScreenError::WrongRun(short(&r.run)));
        }
        let leader = self.leader.borrow().1;
        if message.signer() != leader {
            return Err(ScreenError::NotLeader(crate::diloco::wire::peer_name(&message.signer())));
        }
        let held = self.held.clone().filter(|h| h.hash.0 == r.params_hash);
        let held = held.ok_or_else(|| ScreenError::Stale(short(&r.params_hash)))?;
        let fragment = &self.fragments[fragments::of_round(r.contribution_round, self.fragments.len())];
        let sizes = fragments::masked(&self.sizes, fragment);
        let delta = match &r.slices {
            // an aggregated contribution: its slices, fetched from its shards'
            // aggregators, or else its sender
            Some((sender, hashes)) => {
                if sliced_id(hashes) != r.contribution || !r.delta.is_empty() {
                    return Err(ScreenError::Contribution("its slices do not hash to its id".into()));
                }
                let layout = (sizes.as_slice(), self.encoding);
                let from = scoring::Holders { sender: PublicKey(*sender), aggregators: &r.holders };
                scoring::fetch_sliced(self.io.node, from, hashes, layout).await.map_err(ScreenError::Contribution)?
            }
            None => {
                if blake3::hash(&r.delta).as_bytes() != &r.contribution {
                    return Err(ScreenError::Contribution("it does not hash to its id".into()));
                }
                compress::decode_delta_seeded(&r.delta, &sizes, self.encoding, r.contribution_round)
                    .map_err(|e| ScreenError::Contribution(e.to_string()))?
            }
        };
        delta.validate(&sizes).map_err(|e| ScreenError::Contribution(e.to_string()))?;
        let applied = applied(delta, &r, &sizes)?;
        let shape = (self.m.data.batch as usize, self.m.data.block as usize);
        let batch = batch_of(r.rows as usize, &r.windows, shape, self.corpus.vocab.size())?;
        let mut at = blake3::Hasher::new();
        at.update(&r.params_hash);
        r.windows.iter().for_each(|t| {
            at.update(&t.to_le_bytes());
        });
        let at = *at.finalize().as_bytes();
        let known = before.filter(|(h, _)| *h == at).map(|(_, b)| b);
        if resident.as_ref().is_none_or(|(h, _)| *h != held.hash.0) {
            *resident = None;
            let uploaded = self.engine.resident(held.params.clone()).await.map_err(ScreenError::Scoring)?;
            *resident = Some((held.hash.0, uploaded));
        }
        let base = &resident.as_ref().expect("uploaded").1;
        let losses = scoring::losses(&self.engine, base, (&applied, r.outer_scale), &batch, known)
            .await
            .map_err(ScreenError::Scoring)?;
        *before = Some((at, losses.before));
        Ok((r.contribution, losses))
    }
}

/// The request's batch: `rows` windows of `tokens`, the run's `(batch, block)`
/// shape (the step is compiled for it), every token within `vocab`.
fn batch_of(rows: usize, tokens: &[u16], shape: (usize, usize), vocab: usize) -> Result<Batch, ScreenError> {
    let batch = Batch::from_windows(rows, tokens)
        .ok_or_else(|| ScreenError::Batch(format!("{} tokens in {rows} rows", tokens.len())))?;
    if batch.shape() != [shape.0, shape.1] {
        let [b, t] = batch.shape();
        return Err(ScreenError::Batch(format!("{b} x {t}, not the run's {} x {}", shape.0, shape.1)));
    }
    if usize::from(batch.max_token()) >= vocab {
        return Err(ScreenError::Batch(format!("token {} past the vocabulary of {vocab}", batch.max_token())));
    }
    Ok(batch)
}

/// `delta` as the round applies it: bounded as the request says, then scaled.
fn applied(delta: Delta, r: &ScreenRequest, sizes: &[usize]) -> Result<Delta, ScreenError> {
    let finite = |x: f32| x.is_finite() && x > 0.0;
    if !finite(r.bound_scale) || !r.outer_scale.is_finite() {
        return Err(ScreenError::Contribution(format!("scales {} and {}", r.bound_scale, r.outer_scale)));
    }
    let bounds = Bounds { tensor: r.tensor_bounds.clone(), element: r.element_bounds.clone() };
    Ok(delta.bounded(&bounds).0.scaled(r.bound_scale, sizes))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a hostile or broken leader's request may carry fails in one line, before
    /// the engine sees it: a batch not of the run's shape, a token past the
    /// vocabulary, rows that are not whole, a scale that is not a positive number.
    #[test]
    fn a_bad_request_is_refused_before_the_engine() {
        let windows: Vec<u16> = (0..2 * 9).map(|i| i as u16).collect();
        assert!(batch_of(2, &windows, (2, 8), 64).is_ok());
        let wrong = batch_of(2, &windows, (4, 8), 64).expect_err("another shape");
        assert_eq!(wrong.to_string(), "the batch: 2 x 8, not the run's 4 x 8");
        assert!(
            batch_of(2, &windows, (2, 8), 10).expect_err("vocab").to_string().contains("past the vocabulary of 10")
        );
        assert!(batch_of(5, &windows, (2, 8), 64).is_err(), "not whole rows");
        let request = |bound_scale: f32, outer_scale: f32| ScreenRequest {
            run: [0; 32],
            round: 1,
            contribution: [0; 32],
            contribution_round: 1,
            params_hash: [0; 32],
            delta: Vec::new(),
            tensor_bounds: Vec::new(),
            element_bounds: Vec::new(),
            bound_scale,
            outer_scale,
            rows: 2,
            windows: windows.clone(),
            slices: None,
            holders: Vec::new(),
        };
        let delta = || Delta::Dense(vec![vec![1.0, 2.0]]);
        assert!(applied(delta(), &request(0.5, 1.0), &[2]).is_ok());
        for (b, o) in [(f32::NAN, 1.0), (0.0, 1.0), (-1.0, 1.0), (1.0, f32::INFINITY)] {
            assert!(applied(delta(), &request(b, o), &[2]).is_err(), "{b} {o}");
        }
    }
}
