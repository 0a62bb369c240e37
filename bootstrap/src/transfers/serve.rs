//! Answering peers' blob requests: outboards at once, chunks paged in from a memory map
//! of the blob (or read) on a blocking thread. A blob counts as in transfer from the
//! request until its answer is on the wire.

use std::hash::Hash;
use std::sync::Arc;
use std::time::Duration;

use libp2p::PeerId;
use memmap2::Mmap;
use pcp_protocol::BlobHash;
use pcp_schema::{BlobRequest, BlobResponse, BlobWant};
use tokio::time::Instant;

use super::Transfers;
use crate::codec::BlobReply;
use crate::outboard::Outboard;
use crate::store::{BlobStore, StoreError, map_chunk};

/// Outboards cached for serving.
const OUTBOARD_CACHE: usize = 64;
/// Complete blobs kept memory-mapped for serving.
const MAP_CACHE: usize = 16;
/// Blob answers tracked until they are sent (beyond it, a blob's transfer is known
/// only by when it was last requested).
pub(super) const MAX_RESPONDING: usize = 4096;
/// An answer neither sent nor failed after this long is no longer tracked (libp2p
/// reports every one; the blob protocol times requests out after 30 s).
const RESPONSE_LIMIT: Duration = Duration::from_secs(300);

/// How to answer a blob request.
#[derive(Debug)]
pub(crate) enum Serve {
    /// With this, now.
    Now(BlobReply),
    /// With the chunk this reads on a blocking thread (then [`Transfers::served`]).
    Read(Read),
}

/// A chunk of a complete blob to read for a peer.
#[derive(Debug)]
pub(crate) struct Read {
    pub(crate) peer: PeerId,
    hash: BlobHash,
    index: u32,
    size: u64,
    map: Option<Arc<Mmap>>,
    store: BlobStore,
}

/// A chunk read (or mapped) for a peer: the answer, `None` out of range.
#[derive(Debug)]
pub(crate) struct Served {
    pub(crate) peer: PeerId,
    hash: BlobHash,
    index: u32,
    result: Result<Option<BlobReply>, StoreError>,
}

impl Read {
    /// Pages the chunk in from the map, or reads it when there is none; blocking.
    pub(crate) fn run(self) -> Served {
        let Self { peer, hash, index, size, map, store } = self;
        let mapped = map.map(|map| map_chunk(map, size, index));
        let result = match mapped {
            Some(Ok(chunk)) => Ok(chunk.map(BlobReply::Mapped)),
            fallback => {
                if let Some(Err(e)) = fallback {
                    tracing::debug!(%hash, "paging in chunk {index}: {e}; reading it instead");
                }
                store.read_chunk_frame(&hash, size, index).map(|f| f.map(BlobReply::Chunk))
            }
        };
        Served { peer, hash, index, result }
    }
}

impl<O: Copy + Eq + Hash, I: Copy + Eq + Hash> Transfers<O, I> {
    /// `peer` asks for part of a blob in request `id`.
    pub(crate) fn serve(&mut self, peer: PeerId, id: I, request: BlobRequest, now: Instant) -> Serve {
        let hash = BlobHash(request.blob);
        let outboard = self.cached_outboard(&hash);
        if outboard.is_some() {
            // not deleted until the answer is on the wire (see `Transfers::release`)
            self.responding_to(id, hash, now);
        }
        let response = match (outboard, request.want) {
            (None, _) => BlobResponse::NotFound,
            (Some(ob), BlobWant::Outboard) => BlobResponse::Outboard { size: ob.size, chunk_cvs: ob.cvs },
            (Some(ob), BlobWant::Chunk(index)) => {
                *self.reading.entry(peer).or_default() += 1;
                let map = self.blob_map(&hash, ob.size);
                return Serve::Read(Read { peer, hash, index, size: ob.size, map, store: self.store.clone() });
            }
        };
        Serve::Now(response.into())
    }

    /// A chunk for a peer was read: the answer to send.
    pub(crate) fn served(&mut self, read: Served) -> BlobReply {
        let Served { peer, hash, index, result } = read;
        if let Some(n) = self.reading.get_mut(&peer) {
            *n -= 1;
            if *n == 0 {
                self.reading.remove(&peer);
            }
        }
        match result {
            Ok(Some(reply)) => {
                let bytes = match &reply {
                    BlobReply::Chunk(frame) => frame.data().len(),
                    BlobReply::Mapped(chunk) => chunk.data().len(),
                    BlobReply::Other(_) => 0,
                };
                self.counters.chunks_served += 1;
                self.counters.bytes_served += bytes as u64;
                reply
            }
            Ok(None) => BlobResponse::Refused(format!("chunk {index} out of range")).into(),
            Err(e) => {
                tracing::warn!(%hash, "reading chunk {index}: {e}");
                BlobResponse::NotFound.into()
            }
        }
    }

    /// The answer to request `id` was sent, or failed.
    pub(crate) fn responded(&mut self, id: I, now: Instant) {
        if let Some((hash, _)) = self.responding.remove(&id) {
            self.used(hash, -1, now);
        }
    }

    /// A peer asked for `hash` (request `id`): its transfer is open until the answer
    /// is sent.
    fn responding_to(&mut self, id: I, hash: BlobHash, now: Instant) {
        if self.responding.len() < MAX_RESPONDING {
            self.responding.insert(id, (hash, now));
            self.used(hash, 1, now);
        } else {
            self.used(hash, 0, now);
        }
    }

    /// Forgets answers neither sent nor failed within [`RESPONSE_LIMIT`].
    pub(super) fn expire_responses(&mut self, now: Instant) {
        let stale: Vec<I> = self
            .responding
            .iter()
            .filter(|(_, (_, since))| now.duration_since(*since) >= RESPONSE_LIMIT)
            .map(|(id, _)| *id)
            .collect();
        for id in stale {
            self.responded(id, now);
        }
    }

    fn cached_outboard(&mut self, hash: &BlobHash) -> Option<Outboard> {
        if let Some(ob) = self.outboards.get(hash) {
            return Some(ob.clone());
        }
        match self.store.outboard(hash) {
            Ok(Some(ob)) => {
                if self.outboards.len() >= OUTBOARD_CACHE {
                    self.outboards.clear();
                }
                self.outboards.insert(*hash, ob.clone());
                Some(ob)
            }
            Ok(None) => None,
            Err(e) => {
                tracing::warn!(%hash, "reading outboard: {e}");
                None
            }
        }
    }

    /// The memory map of a complete blob, made on its first request and kept for the next
    /// ones; `None` (the chunk is read instead) if it cannot be mapped.
    fn blob_map(&mut self, hash: &BlobHash, size: u64) -> Option<Arc<Mmap>> {
        if let Some(map) = self.maps.get(hash) {
            return Some(Arc::clone(map));
        }
        match self.store.map(hash, size) {
            Ok(Some(map)) => {
                if self.maps.len() >= MAP_CACHE {
                    self.maps.clear();
                }
                self.maps.insert(*hash, Arc::clone(&map));
                Some(map)
            }
            Ok(None) => None,
            Err(e) => {
                tracing::debug!(%hash, "mapping blob: {e}");
                None
            }
        }
    }
}
