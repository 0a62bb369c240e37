//! The slices an aggregator reads ([`super::Admission::aggregate`]).
//!
//! A slice is a shard's part of a worker's contribution: as large as the shard's
//! tensors make it (megabytes for a large model's embedding), past what a small
//! frame may carry. An aggregator reads one only for a round it sums, from a
//! sender its owner named for that round (the round's participants, and the first
//! replica of a shard it forwards), up to the round's slice length, each sender
//! within its count of permits; and all slices in flight together hold at most the
//! room of [`SLICES_IN_FLIGHT`] of the longest (a burst of workers waits for room,
//! as contributions do). Anyone else's slice is a small frame.

use std::collections::{BTreeMap, HashMap};

use pcp_protocol::{PublicKey, RunId};
use pcp_schema::FrameHead;

use super::Refusal;

/// The rounds an aggregator reads slices for at once, the newest kept.
const MAX_ROUNDS: usize = 4;
/// Slices of a round's longest that may be read and not yet handled at once.
pub const SLICES_IN_FLIGHT: usize = 64;

/// One round's senders and their slices' bound.
#[derive(Debug)]
struct Round {
    max_len: usize,
    /// Each sender's permits left.
    permits: HashMap<PublicKey, usize>,
}

/// The rounds this node aggregates, and the slices in flight.
#[derive(Debug, Default)]
pub(super) struct Slices {
    rounds: BTreeMap<(u64, RunId), Round>,
    bytes: usize,
}

impl Slices {
    /// Round `round` of `run`: each sender may send its count of slices of at most
    /// `max_len` bytes. Opening it again replaces its senders.
    pub(super) fn open(&mut self, (run, round): (RunId, u64), senders: &[(PublicKey, usize)], max_len: usize) {
        let permits = senders.iter().fold(HashMap::new(), |mut m: HashMap<PublicKey, usize>, (k, n)| {
            *m.entry(*k).or_default() += n;
            m
        });
        self.rounds.insert((round, run), Round { max_len, permits });
        while self.rounds.len() > MAX_ROUNDS {
            self.rounds.pop_first();
        }
    }

    /// `None`: no round of this node's names `signer`, and its slice is a small
    /// frame. Otherwise the slice's length, taken from the budget, or why not.
    pub(super) fn permit(&mut self, head: &FrameHead, signer: PublicKey) -> Option<Result<usize, Refusal>> {
        let key = (head.header.round, RunId(head.header.run));
        let round = self.rounds.get_mut(&key)?;
        let left = round.permits.get_mut(&signer)?;
        let len = head.payload_len;
        if len > round.max_len as u64 {
            return Some(Err(Refusal::TooLarge { kind: head.header.kind.tag(), len, max: round.max_len, signer }));
        }
        if *left == 0 {
            return Some(Err(Refusal::SlicesSpent { signer, round: key.0 }));
        }
        let budget = round.max_len.saturating_mul(SLICES_IN_FLIGHT);
        let len = len as usize;
        if self.bytes.saturating_add(len) > budget {
            return Some(Err(Refusal::Full { kind: "slice", signer, budget }));
        }
        *left -= 1;
        self.bytes += len;
        Some(Ok(len))
    }

    /// A slice of `len` bytes is handled.
    pub(super) fn release(&mut self, len: usize) {
        self.bytes = self.bytes.saturating_sub(len);
    }
}
