//! A shard summed here from its committed slices: a spot check, summed while the
//! round gathers, and a recompute after a dispute or silence.
//!
//! A spot-checked shard is drawn from the shepherd's secret when the round is
//! assigned, so it is summed as its contributions are accepted: each accepted
//! entry goes to the shard's sum as it is added ([`Feed::Entry`]), its slice is
//! fetched from its worker then, a few at a time, and added at its place; the
//! round's count ([`Feed::Closed`]) ends it. At the close only the last slices
//! are left to read, and the check waits for the votes, never the votes for it.
//! A recompute is the same sum fed its whole list at once.

use futures::StreamExt as _;
use futures::stream::FuturesOrdered;
use pcp_protocol::diloco::aggregate::{Bounds, Delta};
use pcp_protocol::diloco::aggregation::{
    Accept, ShardSum, ShardUpdate, inspect, shard_bounds, spot_checked, spot_share,
};
use pcp_protocol::diloco::compress::{self, Encoding};
use pcp_protocol::{BlobHash, PublicKey};
use pcp_schema::AcceptEntry;
use tokio::sync::mpsc;

use super::{FETCH_TIMEOUT, Fetched};
use crate::diloco::shepherd::Host;
use crate::diloco::wire::{self, peer_name};

/// Slices of one shard's sum fetched at once: a thousand workers' slices, one
/// round trip each, would take minutes one after another.
const IN_FLIGHT: usize = 16;

/// What a shard's sum is fed, in order.
#[derive(Debug)]
pub(super) enum Feed {
    /// The next accepted contribution.
    Entry(AcceptEntry),
    /// The round closed at this many.
    Closed(u64),
}

/// A spot-checked shard of a round.
#[derive(Debug)]
pub(super) enum Spot {
    /// Being summed: the accepted entries go to it as they are added.
    Summing(mpsc::UnboundedSender<Feed>),
    /// Summed (or why it could not be), before its votes were all in.
    Summed(Result<ShardUpdate, String>),
    /// Its sum, kept, handed back to be taken now its votes are in.
    Handed,
}

impl Spot {
    /// Feeds a sum still going; a finished one needs nothing more.
    pub(super) fn feed(&self, feed: Feed) {
        if let Spot::Summing(tx) = self {
            // a sum that ended (a fetch failed) has dropped its receiver: its error is on its way
            let _ = tx.send(feed);
        }
    }
}

impl Host {
    /// Draws `round`'s spot-checked shards from the shepherd's secret, at the share
    /// its `participants` give ([`spot_share`]), and starts summing each.
    pub(super) fn start_spot_checks(&mut self, round: u64, participants: u64) {
        let share = spot_share(self.plan.aggregation.spot_rate, participants);
        let Some(record) = self.aggregation.rounds.get_mut(&round) else { return };
        for shard in 0..record.tensors.len() {
            if !spot_checked(&self.aggregation.spot_seed, round, shard, share) {
                continue;
            }
            let sizes = record.tensors[shard].clone().map(|i| self.layout.sizes[i]).collect();
            let bounds = shard_bounds(&record.bounds, &record.tensors[shard]);
            let (tx, rx) = mpsc::unbounded_channel();
            let (node, encoding) = (self.node.clone(), self.plan.encoding);
            self.aggregation.fetches.spawn(async move {
                let update = sum(node, (round, shard), rx, (sizes, bounds), encoding).await;
                Fetched::Spot { round, shard, update }
            });
            record.spots.insert(shard, Spot::Summing(tx));
        }
    }

    /// Spot-checked shard `shard` of `round` has its votes in, or they are late:
    /// its sum here decides, now if it is done, or when it is.
    pub(super) fn spot_checked(&mut self, round: u64, shard: usize) {
        let Some(record) = self.aggregation.rounds.get_mut(&round) else { return };
        record.busy.insert(shard);
        if matches!(record.spots.get(&shard), Some(Spot::Summed(_)))
            && let Some(Spot::Summed(update)) = record.spots.remove(&shard)
        {
            // back through the fetches, as a sum finished now would come
            record.spots.insert(shard, Spot::Handed);
            self.aggregation.fetches.spawn(async move { Fetched::Spot { round, shard, update } });
        }
    }

    /// A spot check's sum came back: kept until its votes are in, taken when they
    /// are (the shard is `busy`). One that failed is summed again from the
    /// accepted list; one of a round applied already is dropped.
    pub(super) fn spot_summed(
        &mut self,
        round: u64,
        shard: usize,
        update: Result<ShardUpdate, String>,
    ) -> Option<ShardUpdate> {
        let record = self.aggregation.rounds.get_mut(&round)?;
        if !record.spots.contains_key(&shard) {
            return None;
        }
        if !record.busy.contains(&shard) {
            record.spots.insert(shard, Spot::Summed(update));
            return None;
        }
        record.spots.remove(&shard);
        match update {
            Ok(update) => Some(update),
            Err(e) => {
                record.busy.remove(&shard);
                self.recompute(round, shard, &format!("its spot check could not be summed as it gathered: {e}"));
                None
            }
        }
    }
}

/// Shard `shard` of `round` (its tensors' `sizes`, the round's `bounds` cut to
/// them), summed from the entries `feed` brings: each slice fetched from its
/// worker, inspected by the bounds and added at its place, until the count.
/// An error names the slice that could not be had or added.
pub(super) async fn sum(
    node: pcp_bootstrap::Node,
    (round, shard): (u64, usize),
    mut feed: mpsc::UnboundedReceiver<Feed>,
    (sizes, bounds): (Vec<usize>, Bounds),
    encoding: Encoding,
) -> Result<ShardUpdate, String> {
    let mut sum = ShardSum::new(round, shard, sizes.clone(), 1);
    let mut fetching = FuturesOrdered::new();
    let mut count = None;
    loop {
        let more = count.is_none() && fetching.len() < IN_FLIGHT;
        tokio::select! {
            next = feed.recv(), if more => match next {
                Some(Feed::Entry(e)) => fetching.push_back(slice(&node, e, shard, (&sizes, &bounds), encoding)),
                Some(Feed::Closed(c)) => count = Some(c),
                None => return Err(format!("round {round} ended before it closed")),
            },
            Some(fetched) = fetching.next() => {
                let (accept, bounded) = fetched?;
                sum.accept(accept, bounded).map_err(|e| e.to_string())?;
            }
            else => break,
        }
    }
    let count = count.ok_or_else(|| format!("round {round} ended before it closed"))?;
    sum.finish(count).map_err(|e| e.to_string())
}

/// Feeds a recompute its whole list: the first `count` entries, then the count.
pub(super) fn fed(entries: &[AcceptEntry], count: u64) -> mpsc::UnboundedReceiver<Feed> {
    let (tx, rx) = mpsc::unbounded_channel();
    for e in entries.iter().take(count as usize) {
        let _ = tx.send(Feed::Entry(e.clone()));
    }
    let _ = tx.send(Feed::Closed(count));
    rx
}

/// Entry `e`'s committed slice of `shard`, fetched from its worker and inspected
/// by the shard's bounds, with its place and weights.
async fn slice(
    node: &pcp_bootstrap::Node,
    e: AcceptEntry,
    shard: usize,
    (sizes, bounds): (&[usize], &Bounds),
    encoding: Encoding,
) -> Result<(Accept, Delta), String> {
    let Some((_, hash)) = e.hashes.iter().find(|(s, _)| *s as usize == shard) else {
        return Err(format!("{} committed no slice of shard {shard}", peer_name(&PublicKey(e.worker))));
    };
    let from = pcp_bootstrap::peer_of(&PublicKey(e.worker)).into_iter().collect();
    // a slice is exactly its shard's message in the run's encoding: no larger one is read
    let max = compress::encoded_len(sizes, encoding) as u64;
    let bytes = wire::fetch_bounded(node, BlobHash(*hash), from, (FETCH_TIMEOUT, max)).await?;
    let delta: Delta = compress::decode_delta(&bytes, sizes, encoding).map_err(|e| e.to_string())?;
    let (bounded, _) = inspect(delta, sizes, bounds).map_err(|e| e.to_string())?;
    Ok((Accept { seq: e.seq, weight: e.weight, norm: e.norm, bound: e.bound }, bounded))
}
