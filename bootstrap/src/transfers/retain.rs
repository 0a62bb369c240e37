//! Which blobs a transfer holds, and releasing blobs: one nobody reads is deleted at
//! once; one a transfer holds waits until it ends (or [`MAX_DEFER`]), and is kept if
//! it is stored or fetched again meanwhile.

use std::hash::Hash;
use std::time::Duration;

use pcp_protocol::BlobHash;
use tokio::time::Instant;

use super::{Action, Transfers};
use crate::command::Released;

/// A released blob that transfers keep alive is deleted after this long anyway, so
/// that a peer requesting it without end cannot hold it on disk.
pub(super) const MAX_DEFER: Duration = Duration::from_secs(300);
/// Released blobs waiting for their transfers to end; more delete the oldest at once.
pub(super) const MAX_DEFERRED: usize = 4096;
/// Blobs whose transfers are tracked (each one in the store at most once).
pub(super) const MAX_IN_USE: usize = 16_384;

/// Transfers of one blob: answers to peers not yet sent (outboards and chunks, from
/// the request until the response is on the wire), and when it was last requested,
/// sent or fetched.
#[derive(Debug, Clone, Copy)]
pub(super) struct Use {
    open: usize,
    last: Instant,
}

/// A released blob whose deletion waits for its transfers to end.
#[derive(Debug, Clone, Copy)]
pub(super) struct Deferred {
    since: Instant,
    /// The file it was released as: a new copy put in its place is kept. `None`:
    /// it was being fetched, and the fetched copy goes too.
    file: Option<(u64, u64)>,
}

impl<O: Copy + Eq + Hash, I: Copy + Eq + Hash> Transfers<O, I> {
    /// Deletes released blobs, or defers those in transfer (see [`crate::Node::release`]);
    /// stops announcing those that were here.
    pub(crate) fn release(&mut self, hashes: Vec<BlobHash>, now: Instant) -> Released {
        let mut released = Released::default();
        for hash in hashes {
            if self.deferred.contains_key(&hash) {
                continue;
            }
            let size = self.store.size(&hash);
            if size.is_none() && !self.fetches.contains_key(&hash) {
                // nothing complete here; a download abandoned earlier may be left on disk
                match self.store.remove(&hash) {
                    Ok(0) => released.absent += 1,
                    Ok(bytes) => {
                        released.removed += 1;
                        released.bytes += bytes;
                    }
                    Err(e) => {
                        tracing::warn!(%hash, "releasing blob: {e}");
                        released.failed += 1;
                    }
                }
                continue;
            }
            // new fetchers look elsewhere; those under way finish from here
            self.actions.push_back(Action::Unprovide(hash));
            if self.in_transfer(&hash, now) {
                self.defer(hash, size.and_then(|_| self.store.file_id(&hash)), now);
                released.deferred += 1;
                released.bytes += size.unwrap_or(0);
                tracing::debug!(%hash, "released while in transfer: deleted when it ends");
                continue;
            }
            match self.delete(hash) {
                Some(bytes) => {
                    released.removed += 1;
                    released.bytes += bytes;
                }
                None => released.failed += 1,
            }
        }
        released
    }

    /// Whether a released blob waits for its transfers to end.
    pub(crate) fn is_deferred(&self, hash: &BlobHash) -> bool {
        self.deferred.contains_key(hash)
    }

    /// Records a transfer of `hash` now; `open` counts an answer starting (+1) or
    /// sent (-1).
    pub(super) fn used(&mut self, hash: BlobHash, open: isize, now: Instant) {
        if !self.in_use.contains_key(&hash) && self.in_use.len() >= MAX_IN_USE {
            self.forget_unused(now);
            if self.in_use.len() >= MAX_IN_USE {
                return;
            }
        }
        let u = self.in_use.entry(hash).or_insert(Use { open: 0, last: now });
        u.open = u.open.saturating_add_signed(open);
        u.last = now;
    }

    /// Forgets the blobs with no answer open and no transfer within the linger.
    pub(super) fn forget_unused(&mut self, now: Instant) {
        let linger = self.linger;
        self.in_use.retain(|_, u| u.open > 0 || now.duration_since(u.last) < linger);
    }

    /// Deletes the released blobs whose transfers ended (or that waited
    /// [`MAX_DEFER`]); keeps those added to the store again meanwhile.
    pub(super) fn reap(&mut self, now: Instant) {
        if self.deferred.is_empty() {
            return;
        }
        let due: Vec<(BlobHash, Deferred)> = self
            .deferred
            .iter()
            .filter(|(hash, d)| !self.in_transfer(hash, now) || now.duration_since(d.since) >= MAX_DEFER)
            .map(|(h, d)| (*h, *d))
            .collect();
        for (hash, d) in due {
            self.deferred.remove(&hash);
            if d.file.is_some() && self.store.file_id(&hash) != d.file {
                tracing::debug!(%hash, "released blob added again: kept");
                continue;
            }
            if let Some(bytes) = self.delete(hash) {
                tracing::debug!(%hash, bytes, "released blob deleted after its transfers");
            }
        }
    }

    /// Whether a peer is fetching `hash` from this node or this node is fetching it.
    fn in_transfer(&self, hash: &BlobHash, now: Instant) -> bool {
        self.fetches.contains_key(hash)
            || self.in_use.get(hash).is_some_and(|u| u.open > 0 || now.duration_since(u.last) < self.linger)
    }

    /// Defers the deletion of `hash` (released as `file`); beyond [`MAX_DEFERRED`] the
    /// oldest deferred blob goes at once.
    fn defer(&mut self, hash: BlobHash, file: Option<(u64, u64)>, now: Instant) {
        if self.deferred.len() >= MAX_DEFERRED
            && let Some(oldest) = self.deferred.iter().min_by_key(|(_, d)| d.since).map(|(h, _)| *h)
        {
            self.deferred.remove(&oldest);
            self.delete(oldest);
        }
        self.deferred.insert(hash, Deferred { since: now, file });
    }

    /// Deletes a blob and forgets its caches; the bytes freed, `None` if it failed.
    fn delete(&mut self, hash: BlobHash) -> Option<u64> {
        self.maps.remove(&hash);
        self.outboards.remove(&hash);
        match self.store.remove(&hash) {
            Ok(bytes) => {
                self.counters.blobs_removed += 1;
                self.counters.bytes_removed += bytes;
                Some(bytes)
            }
            Err(e) => {
                tracing::warn!(%hash, "releasing blob: {e}");
                None
            }
        }
    }
}
