//! What a node agrees to read, and from whom, before it reads it.
//!
//! A DiLoCo request arrives as a signed [`FrameHead`] (at most
//! [`pcp_schema::MAX_FRAME_HEAD`] bytes) and then its payload. The codec verifies the
//! head's signature and asks [`Admission`] for a [`Permit`] before reading a byte of
//! the payload:
//!
//! - a contribution is read only from a signer admitted to a run this node serves
//!   (the shepherd admits a worker when it joins), and only up to that run's
//!   contribution size; each signer has at most [`CONTRIBUTIONS_PER_SIGNER`] in flight,
//!   and all of them together at most [`contribution_budget`] bytes;
//! - any other request carries at most [`SMALL_FRAME`] bytes; those from signers not
//!   admitted to any run share a node-wide budget of [`STRANGER_BUDGET`] bytes in flight.
//!
//! A stranger with unlimited keys therefore costs a node at most
//! `STRANGER_BUDGET` plus one head per open stream, whatever it claims.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard};

use pcp_protocol::{PublicKey, RunId};
use pcp_schema::{FrameHead, MessageKind};

/// The largest payload of a request that is not a contribution (hello, heartbeat).
pub const SMALL_FRAME: usize = 64 << 10;
/// Bytes in flight, node-wide, of requests from signers admitted to no run.
pub const STRANGER_BUDGET: usize = 16 << 20;
/// Contributions in flight per admitted signer (one, and its retry).
pub const CONTRIBUTIONS_PER_SIGNER: usize = 2;

/// Bytes of contributions in flight, node-wide, for a run whose contributions are at
/// most `max_contribution` bytes: room for 64 at once, but no more than 8 GiB unless
/// that is fewer than 4.
pub fn contribution_budget(max_contribution: usize) -> usize {
    max_contribution.saturating_mul(64).min(8 << 30).max(max_contribution.saturating_mul(4))
}

/// Why a request's payload is not read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// A contribution for a run this node does not serve.
    #[error("contribution from {signer} for run {run}, which this node does not serve")]
    NotServed {
        /// The signer.
        signer: PublicKey,
        /// The run named.
        run: RunId,
    },
    /// A contribution from a signer that has not joined the run.
    #[error("contribution from {signer}, who is not a participant of run {run}")]
    NotParticipant {
        /// The signer.
        signer: PublicKey,
        /// The run.
        run: RunId,
    },
    /// The announced payload is larger than this kind of request may be.
    #[error("{kind} of {len} bytes from {signer} exceeds its limit of {max} bytes")]
    TooLarge {
        /// The message kind.
        kind: &'static str,
        /// The announced length.
        len: u64,
        /// The limit.
        max: usize,
        /// The signer.
        signer: PublicKey,
    },
    /// The signer already has as many contributions in flight as allowed.
    #[error("{signer} already has {CONTRIBUTIONS_PER_SIGNER} contributions in flight")]
    Busy {
        /// The signer.
        signer: PublicKey,
    },
    /// The run's contributions in flight already fill its budget.
    #[error("contribution from {signer}: {budget} bytes of contributions already in flight")]
    Full {
        /// The signer.
        signer: PublicKey,
        /// The budget.
        budget: usize,
    },
    /// The budget for requests from strangers is spent.
    #[error("request from {signer}: {STRANGER_BUDGET} bytes from non-participants already in flight")]
    Budget {
        /// The signer.
        signer: PublicKey,
    },
}

#[derive(Debug, Default)]
struct Served {
    max_contribution: usize,
    participants: HashSet<PublicKey>,
}

/// Signers whose refusals are counted one by one between two reports.
const MAX_REFUSING_SIGNERS: usize = 256;

#[derive(Debug, Default)]
struct Inner {
    runs: HashMap<RunId, Served>,
    /// Refusals not yet reported, per signer (`None`: the head did not verify).
    refusals: HashMap<Option<PublicKey>, (u64, String)>,
    contributions: HashMap<PublicKey, usize>,
    contribution_bytes: usize,
    stranger_bytes: usize,
}

/// The runs this node serves and who may send it what. Shared by the node's handle
/// (the shepherd admits workers through [`crate::Node::admission`]) and the codec.
#[derive(Debug, Default)]
pub struct Admission {
    inner: Mutex<Inner>,
}

impl Admission {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        // the state is a few maps updated in single statements: a panic elsewhere
        // cannot leave it half-written
        self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// This node serves `run` and accepts contributions of up to `max_contribution`
    /// payload bytes from its participants.
    pub fn serve(&self, run: RunId, max_contribution: usize) {
        self.lock().runs.entry(run).or_default().max_contribution = max_contribution;
    }

    /// This node no longer serves `run`.
    pub fn stop_serving(&self, run: RunId) {
        self.lock().runs.remove(&run);
    }

    /// `signer` has joined `run` (a run this node serves) and may contribute to it.
    pub fn admit(&self, run: RunId, signer: PublicKey) {
        if let Some(served) = self.lock().runs.get_mut(&run) {
            served.participants.insert(signer);
        }
    }

    /// `signer` may no longer contribute to `run`.
    pub fn revoke(&self, run: RunId, signer: PublicKey) {
        if let Some(served) = self.lock().runs.get_mut(&run) {
            served.participants.remove(&signer);
        }
    }

    /// Whether `signer` is a participant of `run`.
    pub fn is_admitted(&self, run: RunId, signer: PublicKey) -> bool {
        self.lock().runs.get(&run).is_some_and(|s| s.participants.contains(&signer))
    }

    /// Notes a refused request: by whom, if its head verified, and why.
    pub(crate) fn refused(&self, signer: Option<PublicKey>, reason: String) {
        let mut inner = self.lock();
        let signer = if inner.refusals.len() < MAX_REFUSING_SIGNERS { signer } else { None };
        let entry = inner.refusals.entry(signer).or_default();
        entry.0 += 1;
        entry.1 = reason;
    }

    /// The refusals noted since the last call: signer, count, the last reason.
    pub(crate) fn take_refusals(&self) -> Vec<(Option<PublicKey>, u64, String)> {
        self.lock().refusals.drain().map(|(signer, (count, reason))| (signer, count, reason)).collect()
    }

    /// Bytes of strangers' requests in flight now.
    pub fn stranger_bytes(&self) -> usize {
        self.lock().stranger_bytes
    }

    /// Whether the payload `head` announces, from `signer` (whose signature on the head
    /// has been verified), may be read; the permit holds its share of the budgets until
    /// it is dropped.
    pub(crate) fn permit(self: &Arc<Self>, head: &FrameHead, signer: PublicKey) -> Result<Permit, Refusal> {
        let run = RunId(head.run);
        let len = head.payload_len;
        let too_large = |max: usize| Refusal::TooLarge { kind: head.kind.tag(), len, max, signer };
        let mut inner = self.lock();
        if head.kind == MessageKind::Contribution {
            let served = inner.runs.get(&run).ok_or(Refusal::NotServed { signer, run })?;
            if !served.participants.contains(&signer) {
                return Err(Refusal::NotParticipant { signer, run });
            }
            if len > served.max_contribution as u64 {
                return Err(too_large(served.max_contribution));
            }
            let budget = contribution_budget(served.max_contribution);
            let len = len as usize;
            if inner.contribution_bytes + len > budget {
                return Err(Refusal::Full { signer, budget });
            }
            let in_flight = inner.contributions.entry(signer).or_default();
            if *in_flight >= CONTRIBUTIONS_PER_SIGNER {
                return Err(Refusal::Busy { signer });
            }
            *in_flight += 1;
            inner.contribution_bytes += len;
            return Ok(Permit { admission: self.clone(), share: Share::Contribution(signer, len) });
        }
        if len > SMALL_FRAME as u64 {
            return Err(too_large(SMALL_FRAME));
        }
        let len = len as usize;
        if inner.runs.values().any(|s| s.participants.contains(&signer)) {
            return Ok(Permit { admission: self.clone(), share: Share::None });
        }
        if inner.stranger_bytes + len > STRANGER_BUDGET {
            return Err(Refusal::Budget { signer });
        }
        inner.stranger_bytes += len;
        Ok(Permit { admission: self.clone(), share: Share::Stranger(len) })
    }
}

#[derive(Debug)]
enum Share {
    None,
    Stranger(usize),
    Contribution(PublicKey, usize),
}

/// Leave to read one request's payload; returns its share of the budgets when dropped.
#[derive(Debug)]
pub(crate) struct Permit {
    admission: Arc<Admission>,
    share: Share,
}

impl Drop for Permit {
    fn drop(&mut self) {
        let mut inner = self.admission.lock();
        match self.share {
            Share::None => {}
            Share::Stranger(len) => inner.stranger_bytes -= len,
            Share::Contribution(signer, len) => {
                inner.contribution_bytes -= len;
                if let Some(n) = inner.contributions.get_mut(&signer) {
                    *n -= 1;
                    if *n == 0 {
                        inner.contributions.remove(&signer);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use pcp_protocol::Identity;

    use super::*;

    fn head(kind: MessageKind, signer: &Identity, run: RunId, payload_len: u64) -> FrameHead {
        FrameHead {
            kind,
            signer: signer.public().0,
            run: run.0,
            round: 1,
            nonce: 1,
            unix_ms: 1,
            payload_len,
            payload_hash: [0; 32],
            signature: [0; 64],
        }
    }

    #[test]
    fn contributions_only_from_participants_of_served_runs_and_up_to_their_size() {
        let admission = Arc::new(Admission::default());
        let (worker, stranger) = (Identity::from_secret([1; 32]), Identity::from_secret([2; 32]));
        let run = RunId([9; 32]);
        let ask = |who: &Identity, len| admission.permit(&head(MessageKind::Contribution, who, run, len), who.public());

        assert!(matches!(ask(&worker, 10), Err(Refusal::NotServed { .. })));
        admission.serve(run, 1000);
        admission.admit(run, worker.public());
        assert!(matches!(ask(&stranger, 10), Err(Refusal::NotParticipant { .. })));
        assert!(matches!(ask(&worker, 1001), Err(Refusal::TooLarge { max: 1000, .. })));
        let first = ask(&worker, 1000).expect("a participant's contribution");
        let second = ask(&worker, 1000).expect("and its retry");
        assert!(matches!(ask(&worker, 1000), Err(Refusal::Busy { .. })));
        drop(first);
        assert!(ask(&worker, 1000).is_ok());
        drop(second);
        assert_eq!(contribution_budget(1000), 64_000);
        let many: Vec<Identity> = (0..64u8).map(|i| Identity::from_secret([100 + i; 32])).collect();
        for w in &many {
            admission.admit(run, w.public());
        }
        let held: Vec<Permit> = many.iter().map(|w| ask(w, 1000).expect("within the budget")).collect();
        assert!(matches!(ask(&worker, 1), Err(Refusal::Full { budget: 64_000, .. })));
        drop(held);
        admission.revoke(run, worker.public());
        assert!(matches!(ask(&worker, 10), Err(Refusal::NotParticipant { .. })));
    }

    #[test]
    fn strangers_share_one_budget_of_small_frames() {
        let admission = Arc::new(Admission::default());
        let run = RunId([3; 32]);
        let worker = Identity::from_secret([4; 32]);
        admission.serve(run, 1 << 20);
        admission.admit(run, worker.public());
        let small = SMALL_FRAME as u64;
        let ask = |who: &Identity, len| admission.permit(&head(MessageKind::Heartbeat, who, run, len), who.public());

        let strangers: Vec<Identity> = (0..=STRANGER_BUDGET / SMALL_FRAME)
            .map(|i| {
                let mut secret = [1u8; 32];
                secret[..8].copy_from_slice(&(i as u64).to_le_bytes());
                Identity::from_secret(secret)
            })
            .collect();
        assert!(matches!(ask(&strangers[0], small + 1), Err(Refusal::TooLarge { .. })));
        let held: Vec<Permit> =
            strangers[..STRANGER_BUDGET / SMALL_FRAME].iter().map(|s| ask(s, small).expect("within budget")).collect();
        assert_eq!(admission.stranger_bytes(), STRANGER_BUDGET);
        let last = strangers.last().expect("one more");
        assert!(matches!(ask(last, small), Err(Refusal::Budget { .. })));
        // a participant's heartbeat does not wait on strangers
        assert!(ask(&worker, small).is_ok());
        drop(held);
        assert_eq!(admission.stranger_bytes(), 0);
        assert!(ask(last, small).is_ok());
    }
}
