//! The event loop's replay guard, for requests and gossip alike.
//!
//! A [`ReplayGuard`] holds a bounded number of signers, and a full one forgets the
//! least recently heard signer it is not told to keep. [`Replay`] tells it to keep
//! every signer a run vouches for ([`Admission::is_known`]: its admitted workers and
//! its coordinator candidates), whether the message came as a request or as gossip:
//! fresh keys, however many and however fast they sign, never push a candidate's or
//! a worker's nonces out of the guard (to be replayed within the window), nor get
//! one of them refused.

use std::sync::Arc;
use std::time::Duration;

use pcp_protocol::{PublicKey, ReplayError, ReplayGuard, RunId, Verified};
use tokio::time::Instant;

use crate::admission::Admission;

/// How long a signed message may be replayed at most: older ones are refused.
pub(super) const WINDOW_MS: u64 = 5 * 60 * 1000;
/// Nonces remembered per signer within the window.
const PER_SIGNER: usize = 1024;
/// Signers remembered.
const MAX_SIGNERS: usize = 4096;

/// How often gossip refused for its signer is reported (a flood of it is counted,
/// not reported message by message).
const REPORT_EVERY: Duration = Duration::from_secs(1);

/// The replay guard and who vouches for its signers.
#[derive(Debug)]
pub(super) struct Replay {
    guard: ReplayGuard,
    admission: Arc<Admission>,
    /// Gossip refused for its signer since the last report, and when that was.
    refused_gossip: (u64, Option<Instant>),
}

impl Replay {
    /// The node's guard, vouched for by its `admission`.
    pub(super) fn new(admission: Arc<Admission>) -> Self {
        Self::with(admission, ReplayGuard::new(WINDOW_MS, PER_SIGNER, MAX_SIGNERS))
    }

    fn with(admission: Arc<Admission>, guard: ReplayGuard) -> Self {
        Self { guard, admission, refused_gossip: (0, None) }
    }

    /// Whether gossip for `run` claiming `signer` is looked at (its signature
    /// checked, then the guard): only the run's candidates gossip
    /// ([`Admission::may_gossip`]), so anyone else's is refused unverified, at the
    /// cost of a lookup. `Err(Some(reason))` when the refusal is to be reported, at
    /// most once every [`REPORT_EVERY`] with the count since; `Err(None)` otherwise.
    pub(super) fn gate_gossip(&mut self, run: RunId, signer: PublicKey, now: Instant) -> Result<(), Option<String>> {
        if self.admission.may_gossip(run, signer) {
            return Ok(());
        }
        let (count, reported) = &mut self.refused_gossip;
        *count += 1;
        if reported.is_some_and(|at| now.duration_since(at) < REPORT_EVERY) {
            return Err(None);
        }
        let reason =
            format!("gossip signed by {signer}, not a candidate of run {run} ({count} refused since the last report)");
        (*count, *reported) = (0, Some(now));
        Err(Some(reason))
    }

    /// Accepts a request or a gossiped message for `run` once, or says why not.
    pub(super) fn check(&mut self, message: &Verified, run: RunId, now_ms: u64) -> Result<(), ReplayError> {
        let known = self.admission.is_known(run, message.signer());
        self.guard.check_known(message, run, now_ms, known)
    }

    /// Checks an answer's run and age ([`ReplayGuard::fresh`]).
    pub(super) fn fresh(&self, message: &Verified, run: RunId, now_ms: u64) -> Result<(), ReplayError> {
        self.guard.fresh(message, run, now_ms)
    }

    /// Forgets what fell out of the window.
    pub(super) fn prune(&mut self, now_ms: u64) {
        self.guard.prune(now_ms);
    }
}

#[cfg(test)]
mod tests {
    use pcp_protocol::{Binding, Identity, PublicKey, seal, verify};
    use pcp_schema::Heartbeat;

    use super::*;

    const RUN: RunId = RunId([1; 32]);

    fn identity(i: u64) -> Identity {
        let mut secret = [0; 32];
        secret[..8].copy_from_slice(&i.to_le_bytes());
        secret[8] = 1;
        Identity::from_secret(secret)
    }

    /// A heartbeat for [`RUN`] signed by `who` with `nonce`, at `unix_ms`.
    fn message(who: &Identity, nonce: u64, unix_ms: u64) -> Verified {
        let hb = Heartbeat::new(RUN.0, 1, unix_ms);
        verify(seal(who, Binding { run: RUN, round: 1, nonce, unix_ms }, &hb)).expect("verifies")
    }

    /// A candidate of the run (on a node that does not serve it: a standby) and an
    /// admitted worker keep their place in a guard of 8 signers while 100 fresh keys
    /// send a message each: their messages are still refused as replays, and their
    /// new ones accepted. Without the vouching (the gossip path's old plain check)
    /// the flood pushed them out and their replays were accepted again.
    #[test]
    fn a_flood_of_fresh_signers_keeps_the_candidates_and_workers() {
        let admission = Arc::new(Admission::default());
        let (candidate, worker) = (identity(1), identity(2));
        admission.candidates(RUN, &[candidate.public()]);
        admission.serve(RUN, 1 << 20);
        admission.know(RUN, worker.public());
        assert!(admission.is_known(RUN, candidate.public()), "a candidate is known without being served");
        assert!(!admission.is_known(RUN, identity(3).public()));
        let mut replay = Replay::with(admission, ReplayGuard::new(WINDOW_MS, 16, 8));
        let now = 1_000_000;
        let kept = [message(&candidate, 1, now), message(&worker, 1, now)];
        for m in &kept {
            replay.check(m, RUN, now).expect("first sight");
        }
        for i in 0..100 {
            let fresh = identity(100 + i);
            replay.check(&message(&fresh, 1, now), RUN, now + i).expect("a fresh signer finds room");
        }
        for m in &kept {
            let signer: PublicKey = m.signer();
            assert_eq!(
                replay.check(m, RUN, now + 200),
                Err(ReplayError::Replayed { signer, nonce: 1 }),
                "the vouched signer's nonce is remembered through the flood"
            );
        }
        replay.check(&message(&candidate, 2, now + 200), RUN, now + 200).expect("the candidate is not refused");
        replay.check(&message(&worker, 2, now + 200), RUN, now + 200).expect("nor the worker");
    }

    /// Gossip from keys that are not the run's candidates is refused before its
    /// signature is checked, and reported once a second with a count, not once a
    /// message: a flood of it costs a lookup each, not a verification and an event.
    #[tokio::test(start_paused = true)]
    async fn gossip_from_a_non_candidate_is_refused_unverified_and_reported_once_a_second() {
        let admission = Arc::new(Admission::default());
        let candidate = identity(1).public();
        let mut replay = Replay::new(admission.clone());
        let fresh = |i: u64| identity(100 + i).public();
        assert_eq!(replay.gate_gossip(RUN, fresh(0), Instant::now()), Ok(()), "candidates not known yet");
        admission.candidates(RUN, &[candidate]);
        assert_eq!(replay.gate_gossip(RUN, candidate, Instant::now()), Ok(()));
        let start = Instant::now();
        let reported: Vec<bool> =
            (0..50).map(|i| replay.gate_gossip(RUN, fresh(i), start).unwrap_err().is_some()).collect();
        assert_eq!(reported.iter().filter(|r| **r).count(), 1, "one report for 50 refusals in the same instant");
        tokio::time::advance(REPORT_EVERY).await;
        let reason = replay.gate_gossip(RUN, fresh(99), Instant::now()).unwrap_err().expect("a second later, a report");
        assert!(reason.contains("not a candidate") && reason.contains("(50 refused"), "{reason}");
    }
}
