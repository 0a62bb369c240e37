//! Refusing replayed messages. Each envelope is bound to a run, a round, a nonce and a
//! signing time; a [`ReplayGuard`] accepts a message only inside a time window around
//! `now` and only once per (signer, nonce). Memory is bounded: a signer may have at most
//! `per_signer` messages in the window, and at most `max_signers` signers are tracked.
//!
//! A full guard does not lock new signers out (a flood of Sybil keys would lock out
//! everyone who joins after it): it forgets the signer heard from least recently
//! among those the caller does not vouch for ([`ReplayGuard::check_known`]), so a
//! run's admitted workers and candidates are never forgotten. A forgotten signer's
//! message replayed within the window is accepted once more; every handler of pcp
//! messages is idempotent for those (a duplicate contribution is refused by the
//! round, an old announcement by the round it names).
//!
//! Answers to requests come from the peer asked, over its authenticated
//! connection, signed by it; a leader answers many heartbeats with the one
//! announcement it signed, so answers repeat nonces. [`ReplayGuard::fresh`] checks
//! their run and age only.

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
    seen: HashMap<PublicKey, Signer>,
}

#[derive(Debug, Clone, Default)]
struct Signer {
    nonces: HashMap<u64, u64>,
    /// Vouched for by the caller: never forgotten to make room.
    known: bool,
    /// When it was last heard (the caller's clock).
    heard_ms: u64,
}

impl ReplayGuard {
    /// A guard that accepts messages signed within `window_ms` of `now` (either way).
    pub fn new(window_ms: u64, per_signer: usize, max_signers: usize) -> Self {
        Self { window_ms, per_signer, max_signers, seen: HashMap::new() }
    }

    /// Accepts `message` for `run` at `now_ms` once, or says why not.
    pub fn check(&mut self, message: &Verified, run: RunId, now_ms: u64) -> Result<(), ReplayError> {
        self.check_known(message, run, now_ms, false)
    }

    /// Checks an answer: bound to `run` (unless `run` is zero: a hello answered with
    /// the run) and signed within the window. Nonces are not remembered.
    pub fn fresh(&self, message: &Verified, run: RunId, now_ms: u64) -> Result<(), ReplayError> {
        let signer = message.signer();
        let b = message.binding();
        if run != RunId([0; 32]) && b.run != run && b.run != RunId([0; 32]) {
            return Err(ReplayError::WrongRun { signer, expected: run, got: b.run });
        }
        self.in_window(signer, b.unix_ms, now_ms)
    }

    fn in_window(&self, signer: PublicKey, unix_ms: u64, now_ms: u64) -> Result<(), ReplayError> {
        if unix_ms + self.window_ms < now_ms {
            return Err(ReplayError::Stale { signer, age_ms: now_ms - unix_ms, window_ms: self.window_ms });
        }
        if unix_ms > now_ms.saturating_add(self.window_ms) {
            return Err(ReplayError::Future { signer, ahead_ms: unix_ms - now_ms });
        }
        Ok(())
    }

    /// [`Self::check`], for a signer the caller vouches for when `known` (an
    /// admitted worker or a candidate): it is never forgotten to make room.
    pub fn check_known(&mut self, message: &Verified, run: RunId, now_ms: u64, known: bool) -> Result<(), ReplayError> {
        let signer = message.signer();
        let b = message.binding();
        if b.run != run {
            return Err(ReplayError::WrongRun { signer, expected: run, got: b.run });
        }
        self.in_window(signer, b.unix_ms, now_ms)?;
        if !self.seen.contains_key(&signer) && self.seen.len() >= self.max_signers {
            self.prune(now_ms);
            if self.seen.len() >= self.max_signers {
                // forget the least recently heard signer nobody vouches for
                let oldest =
                    self.seen.iter().filter(|(_, s)| !s.known).min_by_key(|(k, s)| (s.heard_ms, k.0)).map(|(k, _)| *k);
                match oldest {
                    Some(k) => {
                        self.seen.remove(&k);
                    }
                    None => return Err(ReplayError::Flooded { signer }),
                }
            }
        }
        let window = self.window_ms;
        let entry = self.seen.entry(signer).or_default();
        entry.known |= known;
        entry.heard_ms = entry.heard_ms.max(now_ms);
        let entries = &mut entry.nonces;
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
        self.seen.retain(|_, s| {
            s.nonces.retain(|_, t| *t + window >= now_ms);
            !s.nonces.is_empty()
        });
    }

    /// Messages remembered.
    pub fn len(&self) -> usize {
        self.seen.values().map(|s| s.nonces.len()).sum()
    }

    /// Whether nothing is remembered.
    pub fn is_empty(&self) -> bool {
        self.seen.is_empty()
    }
}
