//! An aggregated round's contribution (its announcement names aggregators):
//! cut into one slice a parameter shard ([`compress::slice`]), each kept as a
//! blob this worker serves (an aggregator that lacks it, or the shepherd summing
//! a disputed shard, fetches it by its hash), and sent to the shard's first
//! replica once the shepherd took the contribution's commitment: the slices'
//! hashes in place of its tensors.

use std::time::Duration;

use anyhow::Context as _;
use pcp_bootstrap::{BlobStore, Node, PeerId};
use pcp_protocol::diloco::aggregation::{shard_tensors, slice_hash};
use pcp_protocol::diloco::compress::{self, Encoding};
use pcp_protocol::{PublicKey, RunId};
use pcp_schema::{Contribution, RoundAnnouncement, Slice};
use tokio::sync::mpsc;

use crate::diloco::wire::Signer;

/// How long a slice's send waits for its aggregator's answer.
const SLICE_TIMEOUT: Duration = Duration::from_secs(60);
/// An aggregator that has not yet heard of the round (`WrongRound`: the worker
/// heard first) is sent the slice again this long after, this many times.
const NOT_YET: (Duration, usize) = (Duration::from_secs(1), 10);

/// Cuts `c` (encoded for tensors of `sizes` in `encoding`) into the slices of
/// `a`'s shards, stores them in `store`, and makes `c` their commitment. Returns
/// each slice with the first replica of its shard.
pub(crate) fn cut(
    c: &mut Contribution,
    a: &RoundAnnouncement,
    (sizes, encoding): (&[usize], Encoding),
    me: PublicKey,
    store: &BlobStore,
) -> anyhow::Result<Vec<(PeerId, Slice)>> {
    let shards = a.aggregators.len();
    let tensors = shard_tensors(sizes, shards)
        .with_context(|| format!("round {}: {shards} aggregated shards of {} tensors", a.round, sizes.len()))?;
    let mut out = Vec::with_capacity(shards);
    let mut hashes = Vec::with_capacity(shards);
    for (shard, (range, aggregators)) in tensors.into_iter().zip(&a.aggregators).enumerate() {
        let bytes = compress::slice(&c.delta, sizes, encoding, range)
            .with_context(|| format!("round {}: cutting shard {shard}'s slice", a.round))?;
        let hash = slice_hash(&bytes);
        store.put_bytes(&bytes).with_context(|| format!("round {}: storing shard {shard}'s slice", a.round))?;
        hashes.push(hash);
        let first =
            aggregators.replicas.first().with_context(|| format!("round {}: shard {shard} has no replica", a.round))?;
        let peer = pcp_bootstrap::peer_of(&PublicKey(*first))
            .with_context(|| format!("round {}: shard {shard}'s aggregator key is no peer id", a.round))?;
        let slice = Slice { run: c.run, round: c.round, shard: shard as u32, worker: me.0, bytes };
        out.push((peer, slice));
    }
    commit(c, hashes);
    Ok(out)
}

/// Makes `c` the commitment to its slices of `hashes`: their hashes in place of its
/// tensors.
pub(crate) fn commit(c: &mut Contribution, hashes: Vec<[u8; 32]>) {
    c.slice_hashes = hashes;
    c.delta = Vec::new();
    c.pseudo_gradient.blob = *blake3::hash(&[]).as_bytes();
    c.pseudo_gradient.size = 0;
}

/// Sends each slice to its aggregator (this node's own aggregator through `own`);
/// returns how many it took.
pub(crate) async fn send(
    (node, own): (&Node, Option<&mpsc::Sender<Slice>>),
    signer: &mut Signer,
    run: RunId,
    slices: &[(PeerId, Slice)],
) -> usize {
    let mut sends = tokio::task::JoinSet::new();
    let mut taken = 0;
    for (peer, slice) in slices {
        if *peer == node.peer_id() {
            match own {
                Some(own) if own.send(slice.clone()).await.is_ok() => taken += 1,
                _ => tracing::warn!(shard = slice.shard, "this node sums its shard, but its aggregator is not running"),
            }
            continue;
        }
        let (node, peer, shard) = (node.clone(), *peer, slice.shard);
        let (mut signer, slice) = (Signer::new(signer.identity().clone()), slice.clone());
        sends.spawn(async move {
            // an aggregator is a DHT server: the shepherd knows where it listens
            let found = node.find_peer(peer).await;
            tracing::debug!(%peer, ?found, "looked the aggregator up");
            let mut tries = 0;
            let taken = loop {
                let envelope = signer.seal(run, slice.round, &slice);
                let answer = tokio::time::timeout(SLICE_TIMEOUT, node.request(peer, envelope)).await;
                match answer {
                    Ok(Ok(v)) => match v.decode::<pcp_schema::Ack>() {
                        Ok(ack) if ack.accepted => break Ok(()),
                        Ok(ack) if ack.code == pcp_schema::AckCode::WrongRound && tries < NOT_YET.1 => {
                            tries += 1;
                            tokio::time::sleep(NOT_YET.0).await;
                        }
                        Ok(ack) => break Err(ack.reason),
                        Err(e) => break Err(e.to_string()),
                    },
                    Ok(Err(e)) => break Err(e.to_string()),
                    Err(_) => break Err("no answer".to_owned()),
                }
            };
            if let Err(reason) = &taken {
                tracing::warn!(%peer, shard, "the aggregator did not take the slice: {reason}");
            }
            taken.is_ok()
        });
    }
    taken + sends.join_all().await.into_iter().filter(|t| *t).count()
}
