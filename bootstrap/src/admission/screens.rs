//! The screen requests a worker reads ([`super::Admission::screen_for`]).
//!
//! A screen request carries one contribution for a committee member to score: as
//! large as a contribution, past what a small frame may carry. A worker reads one
//! only from its run's leader, up to the run's contribution length, and all of
//! them in flight together hold at most the room of [`SCREENS_IN_FLIGHT`] of the
//! longest; past it a request is refused, and the shepherd scores that
//! contribution itself. Anyone else's screen request is a small frame.

use std::collections::HashMap;

use pcp_protocol::{PublicKey, RunId};
use pcp_schema::FrameHead;

use super::Refusal;

/// Screen requests of a run's longest that may be read and not yet handled at once.
pub const SCREENS_IN_FLIGHT: usize = 4;

/// Each run's leader and its requests' bound, and the requests in flight.
#[derive(Debug, Default)]
pub(super) struct Screens {
    runs: HashMap<RunId, (PublicKey, usize)>,
    bytes: usize,
}

impl Screens {
    /// `leader` leads `run`: its screen requests of at most `max_len` bytes are read.
    pub(super) fn open(&mut self, run: RunId, leader: PublicKey, max_len: usize) {
        self.runs.insert(run, (leader, max_len));
    }

    /// `None`: `signer` leads no run of this node's, and its request is a small
    /// frame. Otherwise the request's length, taken from the budget, or why not.
    pub(super) fn permit(&mut self, head: &FrameHead, signer: PublicKey) -> Option<Result<usize, Refusal>> {
        let (leader, max_len) = self.runs.get(&RunId(head.header.run))?;
        if *leader != signer {
            return None;
        }
        let len = head.payload_len;
        if len > *max_len as u64 {
            return Some(Err(Refusal::TooLarge { kind: head.header.kind.tag(), len, max: *max_len, signer }));
        }
        let budget = max_len.saturating_mul(SCREENS_IN_FLIGHT);
        let len = len as usize;
        if self.bytes.saturating_add(len) > budget {
            return Some(Err(Refusal::Full { kind: "screen request", signer, budget }));
        }
        self.bytes += len;
        Some(Ok(len))
    }

    /// A request of `len` bytes is handled.
    pub(super) fn release(&mut self, len: usize) {
        self.bytes = self.bytes.saturating_sub(len);
    }
}
