//! Aggregated rounds in `pcp-node loadtest`: synthetic workers commit to their
//! contributions' slices and send them to the shards' aggregators, as a worker
//! does, and `--aggregate` synthetic nodes sum shards (the volunteer's driver,
//! [`crate::diloco::Standalone`]) and train nothing.
//!
//! The workers send a few payloads in turn, so many hold the same slices: each
//! payload's slices of a round are cut and stored once, in a store of the
//! loadtest's own, and hard-linked into each worker's store, from which its node
//! serves them (to an aggregator that lacks one, or to the shepherd's spot checks).

use std::collections::{BTreeMap, VecDeque};
use std::path::Path;
use std::sync::{Arc, Mutex};

use anyhow::Context as _;
use pcp_bootstrap::{BlobStore, PeerId};
use pcp_protocol::diloco::compress::Encoding;
use pcp_protocol::{BlobHash, PublicKey};
use pcp_schema::{Contribution, RoundAnnouncement, Slice};

/// Synthetic workers sending their slices at once: each holds its slices and their
/// signed envelopes (twice its contribution) while it sends, and the rest wait, so
/// that a thousand workers finishing together do not hold a thousand contributions.
const SENDERS: usize = 64;

/// Rounds of slices a synthetic worker keeps serving (the round sent and the two
/// before it: a disputed shard is summed after its round closes).
const KEEP_ROUNDS: u64 = 3;

/// One payload's slices of one round: their hashes (the commitment) and each slice
/// with the first replica of its shard.
pub(super) struct Cut {
    hashes: Vec<[u8; 32]>,
    slices: Vec<(PeerId, Slice)>,
}

impl Cut {
    /// The slices as worker `me` sends them.
    pub(super) fn slices(&self, me: PublicKey) -> Vec<(PeerId, Slice)> {
        self.slices.iter().map(|(peer, s)| (*peer, Slice { worker: me.0, ..s.clone() })).collect()
    }
}

/// The slices cut so far, shared by the loadtest's synthetic workers.
pub(super) struct Slicer {
    store: BlobStore,
    cuts: Mutex<BTreeMap<(usize, u64), Arc<Cut>>>,
    senders: Arc<tokio::sync::Semaphore>,
}

impl Slicer {
    /// A slicer whose store is under `dir` (emptied first).
    pub(super) fn open(dir: &Path) -> anyhow::Result<Self> {
        if dir.exists() {
            std::fs::remove_dir_all(dir).with_context(|| format!("emptying {}", dir.display()))?;
        }
        let store = BlobStore::open(dir).with_context(|| format!("opening the slices' store in {}", dir.display()))?;
        Ok(Self { store, cuts: Mutex::new(BTreeMap::new()), senders: Arc::new(tokio::sync::Semaphore::new(SENDERS)) })
    }

    /// A turn to send slices ([`SENDERS`] at once).
    pub(super) async fn turn(&self) -> Option<tokio::sync::OwnedSemaphorePermit> {
        self.senders.clone().acquire_owned().await.ok()
    }

    /// Makes `c`, carrying payload `payload`'s bytes for `a`'s round, the commitment
    /// to its slices, and returns them ([`Cut::slices`] for worker `me`): cut once a
    /// payload and round, and linked into `own`, the worker's store.
    pub(super) fn cut(
        &self,
        c: &mut Contribution,
        (a, payload): (&RoundAnnouncement, usize),
        layout: (&[usize], Encoding),
        me: PublicKey,
        own: &BlobStore,
    ) -> anyhow::Result<Arc<Cut>> {
        let cut = {
            let mut cuts = self.cuts.lock().map_err(|_| anyhow::anyhow!("the slicer's lock is poisoned"))?;
            match cuts.get(&(payload, a.round)) {
                Some(cut) => cut.clone(),
                None => {
                    let mut first = c.clone();
                    let slices = crate::diloco::cut_slices(&mut first, a, layout, me, &self.store)?;
                    let cut = Arc::new(Cut { hashes: first.slice_hashes, slices });
                    cuts.insert((payload, a.round), cut.clone());
                    self.forget(&mut cuts, a.round);
                    cut
                }
            }
        };
        for hash in &cut.hashes {
            own.link_from(&self.store, &BlobHash(*hash))
                .with_context(|| format!("round {}: linking a slice into a worker's store", a.round))?;
        }
        crate::diloco::commit_slices(c, cut.hashes.clone());
        Ok(cut)
    }

    /// Drops the cuts of rounds no worker serves any more from the shared store
    /// (the workers' links keep their files until they let them go).
    fn forget(&self, cuts: &mut BTreeMap<(usize, u64), Arc<Cut>>, round: u64) {
        let old: Vec<(usize, u64)> = cuts.keys().filter(|(_, r)| r + KEEP_ROUNDS <= round).copied().collect();
        for key in old {
            if let Some(cut) = cuts.remove(&key) {
                for hash in &cut.hashes {
                    if let Err(e) = self.store.remove(&BlobHash(*hash)) {
                        tracing::debug!("forgetting a slice of round {}: {e}", key.1);
                    }
                }
            }
        }
    }
}

/// The slices a synthetic worker serves, by round.
#[derive(Default)]
pub(super) struct Served(VecDeque<(u64, Vec<[u8; 32]>)>);

impl Served {
    /// Round `round`'s slices `hashes` are served from `own`; those of rounds
    /// [`KEEP_ROUNDS`] before it are let go.
    pub(super) fn add(&mut self, own: &BlobStore, round: u64, hashes: Vec<[u8; 32]>) {
        self.0.push_back((round, hashes));
        while self.0.front().is_some_and(|(r, _)| r + KEEP_ROUNDS <= round) {
            let Some((_, old)) = self.0.pop_front() else { break };
            for hash in old {
                // another round's cut may hold the same slice: it is linked again then
                let _ = own.remove(&BlobHash(hash));
            }
        }
    }
}
