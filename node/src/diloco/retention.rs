//! Which blobs a node keeps: those of its last K rounds (`--keep-rounds`), and what
//! it pins (the corpus, the artifacts, the loss module, the experiment and the
//! run's initial parameters). A role records the blobs each round uses as it
//! goes; [`Retention::round`] answers which blobs of older rounds are no longer
//! needed, and [`Retention::advance`] has the node release them
//! ([`pcp_bootstrap::Node::release`]: a blob a peer is fetching from this node, or
//! that it is fetching, goes when that transfer ends).
//!
//! Checkpoints are files of their own (`<state-dir>/step-*`), not blobs: deleting
//! blobs never makes a kept checkpoint unloadable. A shepherd keeps as many
//! checkpoints as rounds ([`Retention::rounds`]).

use std::collections::{BTreeMap, BTreeSet};

use pcp_bootstrap::Node;
use pcp_protocol::BlobHash;

use crate::observe::events::{BlobsReleased, Event, Events};

/// Rounds whose blobs a node keeps unless `--keep-rounds` says otherwise: the open
/// round's and the one before, which a worker a round behind (or a standby
/// candidate) may still fetch.
pub(crate) const DEFAULT_KEEP_ROUNDS: usize = 2;
/// A shepherd checkpoints after every this many rounds unless told (`--checkpoint-rounds`).
pub(crate) use pcp_protocol::diloco::checkpoint::DEFAULT_CHECKPOINT_ROUNDS;
/// Blobs recorded for one round; more are kept rather than tracked. A round uses its
/// parameters, an update, a state and the parameters' shards, of up to 4 MiB or one
/// larger tensor ([`pcp_protocol::diloco::fragments::SHARD_BYTES`]): 78 blobs for
/// gpt2-124m, thousands for a 7B model. (At 64, gpt2-124m's state, update and last
/// shards went untracked and stayed: 1.3 GB more on the shepherd's disk each round.)
const MAX_BLOBS_PER_ROUND: usize = 1 << 16;
/// Pinned blobs; more are kept but not tracked (a run pins a few, plus one artifact
/// per target it serves).
const MAX_PINS: usize = 1024;

/// `--keep-rounds`: the flag of every role and of `sim`.
#[derive(Debug, Clone, Copy, Default, clap::Args)]
pub(crate) struct RetentionArgs {
    /// Keep the blobs (parameters, updates, states) of this many recent rounds and
    /// delete older ones, and a shepherd keeps as many checkpoints; the corpus,
    /// artifacts and initial parameters stay, and a blob a peer is fetching goes when
    /// its transfer ends [default: 2]
    #[arg(long, value_name = "K", value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub(crate) keep_rounds: Option<u64>,
}

impl RetentionArgs {
    /// The flag given here, else the one given before the subcommand.
    pub(crate) fn or(self, outer: Self) -> Self {
        Self { keep_rounds: self.keep_rounds.or(outer.keep_rounds) }
    }

    /// Rounds to keep.
    pub(crate) fn keep(self) -> usize {
        self.keep_rounds.and_then(|k| usize::try_from(k).ok()).unwrap_or(DEFAULT_KEEP_ROUNDS)
    }
}

/// The blobs of a node's recent rounds, and the ones it pins.
#[derive(Debug, Clone)]
pub(crate) struct Retention {
    /// Rounds kept, at least 1.
    keep: u64,
    /// A shepherd checkpoints after every this many rounds (at least 1).
    checkpoints: u64,
    /// The blobs each round recorded, for the rounds still kept.
    rounds: BTreeMap<u64, BTreeSet<BlobHash>>,
    pinned: BTreeSet<BlobHash>,
    /// The newest round recorded.
    newest: Option<u64>,
}

impl Default for Retention {
    fn default() -> Self {
        Self::new(DEFAULT_KEEP_ROUNDS)
    }
}

impl Retention {
    /// Keeps the blobs of the last `keep` rounds (at least 1: the current round's).
    pub(crate) fn new(keep: usize) -> Self {
        Self {
            keep: (keep as u64).max(1),
            checkpoints: DEFAULT_CHECKPOINT_ROUNDS,
            rounds: BTreeMap::new(),
            pinned: BTreeSet::new(),
            newest: None,
        }
    }

    /// A shepherd that checkpoints after every `k` rounds (`--checkpoint-rounds`).
    pub(crate) fn checkpoint_every(self, k: u64) -> Self {
        Self { checkpoints: k.max(1), ..self }
    }

    /// Whether a shepherd checkpoints after `round`: every `--checkpoint-rounds`
    /// rounds, the `last`, and whenever it has no checkpoint yet (`first`).
    pub(crate) fn checkpoints(&self, round: u64, last: bool, first: bool) -> bool {
        pcp_protocol::diloco::checkpoint::due(round, self.checkpoints, last, first)
    }

    /// Rounds kept (at least 1).
    pub(crate) fn rounds(&self) -> usize {
        usize::try_from(self.keep).unwrap_or(usize::MAX)
    }

    /// Never releases `hash`, whatever rounds use it.
    pub(crate) fn pin(&mut self, hash: BlobHash) {
        if self.pinned.len() < MAX_PINS {
            self.pinned.insert(hash);
        } else {
            // untracked blobs are never released: kept, as pinned ones are
            tracing::debug!(%hash, "{MAX_PINS} blobs pinned already; kept untracked");
        }
    }

    /// Records that `round` uses `hashes`, and returns the blobs no longer needed:
    /// those of rounds before the last `keep` (counting back from the newest round
    /// recorded) that no kept round uses and that are not pinned. Each blob is
    /// returned once; a round may be recorded again (a reopened round, a second
    /// blob), and a round already past is released at once.
    pub(crate) fn round(&mut self, round: u64, hashes: impl IntoIterator<Item = BlobHash>) -> Vec<BlobHash> {
        let blobs = self.rounds.entry(round).or_default();
        for hash in hashes {
            if blobs.contains(&hash) {
                continue;
            }
            if blobs.len() >= MAX_BLOBS_PER_ROUND {
                tracing::debug!(%hash, round, "{MAX_BLOBS_PER_ROUND} blobs recorded for the round; kept untracked");
                continue;
            }
            blobs.insert(hash);
        }
        let newest = self.newest.map_or(round, |n| n.max(round));
        self.newest = Some(newest);
        // rounds before `first` go: newest − keep + 1 ..= newest stay
        let first = (newest + 1).saturating_sub(self.keep);
        let kept = self.rounds.split_off(&first);
        let old = std::mem::replace(&mut self.rounds, kept);
        let used: BTreeSet<&BlobHash> = self.rounds.values().flatten().collect();
        let drop: BTreeSet<BlobHash> =
            old.into_values().flatten().filter(|h| !used.contains(h) && !self.pinned.contains(h)).collect();
        drop.into_iter().collect()
    }

    /// [`Retention::round`], then has `node` release what it returns and records a
    /// `blobs_released` event (the round recorded, how many blobs, their bytes, and
    /// how many wait for a transfer to end).
    pub(crate) async fn advance(
        &mut self,
        node: &Node,
        events: &Events,
        round: u64,
        hashes: impl IntoIterator<Item = BlobHash>,
    ) {
        let drop = self.round(round, hashes);
        if drop.is_empty() {
            return;
        }
        match node.release(drop).await {
            Ok(r) if r.removed + r.deferred + r.failed > 0 => {
                tracing::debug!(
                    round,
                    "released {} blobs ({} bytes, {} deferred)",
                    r.removed + r.deferred,
                    r.bytes,
                    r.deferred
                );
                events.emit(Event::BlobsReleased(BlobsReleased {
                    round,
                    count: (r.removed + r.deferred) as u64,
                    bytes: r.bytes,
                    deferred: r.deferred as u64,
                    failed: r.failed as u64,
                }));
            }
            Ok(_) => {}
            Err(e) => tracing::debug!(round, "releasing blobs: {e}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(n: u8) -> BlobHash {
        BlobHash([n; 32])
    }

    #[test]
    fn keeps_the_last_k_rounds() {
        let mut r = Retention::new(2);
        assert!(r.round(1, [h(1), h(11)]).is_empty());
        assert!(r.round(2, [h(2)]).is_empty());
        assert_eq!(r.round(3, [h(3)]), vec![h(1), h(11)], "round 1 goes when round 3 comes");
        // a second blob of a round, and the round recorded again: nothing new goes
        assert!(r.round(3, [h(33), h(3)]).is_empty());
        assert_eq!(r.round(4, []), vec![h(2)]);
        // skipping rounds drops every round before the last two
        assert_eq!(r.round(10, [h(10)]), vec![h(3), h(33)]);
        assert!(r.round(10, []).is_empty(), "each blob is returned once");
    }

    #[test]
    fn a_round_of_many_shards_releases_them_all() {
        // gpt2-124m's round: parameters, ~160 shards, then the update and the state
        let mut r = Retention::new(1);
        let blobs: Vec<BlobHash> = (0..=200u8).map(h).collect();
        assert!(r.round(1, blobs[..199].iter().copied()).is_empty());
        assert!(r.round(1, blobs[199..].iter().copied()).is_empty(), "the update and state, at the close");
        let released: BTreeSet<BlobHash> = r.round(2, [BlobHash([255; 32])]).into_iter().collect();
        assert_eq!(released, blobs.into_iter().collect(), "every blob of round 1 goes");
    }

    #[test]
    fn a_blob_used_by_a_kept_round_or_pinned_stays() {
        let mut r = Retention::new(1);
        r.pin(h(100));
        assert!(r.round(1, [h(1), h(100)]).is_empty());
        // the parameters did not change: round 2 uses round 1's blob
        assert!(r.round(2, [h(1), h(2)]).is_empty(), "h(1) is still used");
        assert_eq!(r.round(3, [h(3)]), vec![h(1), h(2)]);
        assert!(r.round(4, [h(100)]).iter().all(|x| *x != h(100)), "pinned");
        assert!(r.round(5, []).is_empty());
    }

    #[test]
    fn a_round_recorded_late_goes_at_once_and_rounds_may_start_at_zero() {
        let mut r = Retention::new(2);
        assert!(r.round(0, [h(0)]).is_empty());
        assert!(r.round(1, [h(1)]).is_empty());
        assert_eq!(r.round(2, []), vec![h(0)]);
        // a state of an older round fetched after a newer one (a deposed branch's)
        assert_eq!(r.round(0, [h(9)]), vec![h(9)]);
        assert!(r.round(1, [h(11)]).is_empty(), "round 1 is still kept");
    }

    #[test]
    fn zero_means_one_and_the_tracked_blobs_are_bounded() {
        let mut r = Retention::new(0);
        assert!(r.round(1, [h(1)]).is_empty(), "the current round's blobs are kept");
        assert_eq!(r.round(2, []), vec![h(1)]);
        let numbered = |n: u32| {
            let mut b = [7u8; 32];
            b[..4].copy_from_slice(&n.to_le_bytes());
            BlobHash(b)
        };
        r.round(3, (0..MAX_BLOBS_PER_ROUND as u32 + 10).map(numbered));
        assert_eq!(r.round(4, []).len(), MAX_BLOBS_PER_ROUND, "the rest were never tracked, so never released");
        for n in 0..2000u32 {
            r.pin(numbered(n));
        }
        assert_eq!(r.pinned.len(), MAX_PINS);
    }

    #[test]
    fn keep_rounds_defaults_and_inner_flags_win() {
        let none = RetentionArgs::default();
        assert_eq!(none.keep(), DEFAULT_KEEP_ROUNDS);
        let three = RetentionArgs { keep_rounds: Some(3) };
        assert_eq!(none.or(three).keep(), 3);
        assert_eq!(RetentionArgs { keep_rounds: Some(5) }.or(three).keep(), 5);
    }
}
