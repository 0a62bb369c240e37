//! Refusing replayed messages. Each envelope is bound to a run, a round, a nonce and a
//! signing time; a [`ReplayGuard`] accepts a message only inside a time window around
//! `now` and only once per (signer, nonce). Memory is bounded: a signer may have at most
//! `per_signer` messages in the window, and at most `max_signers` signers are tracked.

use std::collections::HashMap;

use crate::envelope::Verified;
use crate::identity::PublicKey;
use crate::ids::RunId;

/// Why a message was refused as a replay.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReplayError {
    /// Bound to another run.
    #[error("message from {signer} is for run {got}, not {expected}")]
    WrongRun {
        /// The signer.
        signer: PublicKey,
        /// The run expected.
        expected: RunId,
        /// The run signed.
        got: RunId,
    },
    /// Signed too long ago.
    #[error("message from {signer} is {age_ms} ms old, outside the {window_ms} ms window")]
    Stale {
        /// The signer.
        signer: PublicKey,
        /// How old.
        age_ms: u64,
        /// The window.
        window_ms: u64,
    },
    /// Signed in the future beyond the clock skew allowance.
    #[error("message from {signer} is {ahead_ms} ms in the future")]
    Future {
        /// The signer.
        signer: PublicKey,
        /// How far ahead.
        ahead_ms: u64,
    },
    /// Seen before.
    #[error("message from {signer} with nonce {nonce} was already seen")]
    Replayed {
        /// The signer.
        signer: PublicKey,
        /// The nonce.
        nonce: u64,
    },
    /// The signer, or the guard, is over its budget of remembered messages.
    #[error("too many messages from {signer} within the window")]
    Flooded {
        /// The signer.
        signer: PublicKey,
    },
}

/// Remembers recent (signer, nonce) pairs. Pure: the caller passes `now`.
#[derive(Debug, Clone)]
pub struct ReplayGuard {
    window_ms: u64,
    per_signer: usize,
    max_signers: usize,
    seen: HashMap<PublicKey, HashMap<u64, u64>>,
}

impl ReplayGuard {
    /// A guard that accepts messages signed within `window_ms` of `now` (either way).
    pub fn new(window_ms: u64, per_signer: usize, max_signers: usize) -> Self {
        Self { window_ms, per_signer, max_signers, seen: HashMap::new() }
    }

    /// Accepts `message` for `run` at `now_ms` once, or says why not.
    pub fn check(&mut self, message: &Verified, run: RunId, now_ms: u64) -> Result<(), ReplayError> {
        let signer = message.signer();
        let b = message.binding();
        if b.run != run {
            return Err(ReplayError::WrongRun { signer, expected: run, got: b.run });
        }
        if b.unix_ms + self.window_ms < now_ms {
            return Err(ReplayError::Stale { signer, age_ms: now_ms - b.unix_ms, window_ms: self.window_ms });
        }
        if b.unix_ms > now_ms.saturating_add(self.window_ms) {
            return Err(ReplayError::Future { signer, ahead_ms: b.unix_ms - now_ms });
        }
        if !self.seen.contains_key(&signer) && self.seen.len() >= self.max_signers {
            self.prune(now_ms);
            if self.seen.len() >= self.max_signers {
                return Err(ReplayError::Flooded { signer });
            }
        }
        let window = self.window_ms;
        let entries = self.seen.entry(signer).or_default();
        if entries.contains_key(&b.nonce) {
            return Err(ReplayError::Replayed { signer, nonce: b.nonce });
        }
        if entries.len() >= self.per_signer {
            entries.retain(|_, t| *t + window >= now_ms);
            if entries.len() >= self.per_signer {
                return Err(ReplayError::Flooded { signer });
            }
        }
        entries.insert(b.nonce, b.unix_ms);
        Ok(())
    }

    /// Forgets messages that fell out of the window.
    pub fn prune(&mut self, now_ms: u64) {
        let window = self.window_ms;
        self.seen.retain(|_, entries| {
            entries.retain(|_, t| *t + window >= now_ms);
            !entries.is_empty()
        });
    }

    /// Messages remembered.
    pub fn len(&self) -> usize {
        self.seen.values().map(HashMap::len).sum()
    }

    /// Whether nothing is remembered.
    pub fn is_empty(&self) -> bool {
        self.seen.is_empty()
    }
}
