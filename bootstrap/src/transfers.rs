//! Blob transfer, apart from the swarm: this node's downloads (each one a [`Fetch`]),
//! its answers to peers' chunk and outboard requests (see `serve`), and which blobs a
//! transfer holds, so that [`crate::Node::release`] deletes none under a reader (see
//! `retain`).
//!
//! [`Transfers`] is sans-IO. The event loop tells it what happened (the owner asked
//! for a blob, the DHT named providers, a request was answered or failed, blocking work
//! finished, a peer asked for a chunk, time passed) and then performs the [`Action`]s
//! that [`Transfers::poll`] hands out: requests to send, DHT queries and announcements,
//! bans, events, answers, and [`Job`]s for blocking threads (hashing and disk work).
//! Request ids are the caller's (`O` outbound, `I` inbound), so the tests drive it with
//! numbers, a store in a temporary directory and no swarm.

mod retain;
mod serve;
#[cfg(test)]
mod tests;

use std::collections::{HashMap, VecDeque};
use std::hash::Hash;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use libp2p::PeerId;
use memmap2::Mmap;
use pcp_protocol::BlobHash;
use pcp_schema::{BlobResponse, BlobWant};
use tokio::time::Instant;

use crate::codec::{BlobReply, ChunkFrame};
use crate::command::FetchReport;
use crate::error::{FetchError, Stopped};
use crate::events::{Event, Stats};
use crate::fetch::{Fetch, Reply};
use crate::outboard::Outboard;
use crate::store::{BlobStore, ChunkWriter, Partial, StoreError};
use retain::{Deferred, Use};
pub(crate) use serve::{Serve, Served};

/// Downloads in progress at once.
pub(crate) const MAX_FETCHES: usize = 32;
/// Failed requests after which a provider is dropped from a fetch.
const MAX_PROVIDER_FAILURES: u32 = 3;
/// How often a fetch with no usable provider asks the DHT again.
const REQUERY: Duration = Duration::from_secs(2);
/// How long a fetch waits for the provider query before requesting chunks.
const GATHER: Duration = Duration::from_millis(500);

/// A blob request in flight: to whom, for which blob, and what of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Pending {
    pub(crate) hash: BlobHash,
    pub(crate) peer: PeerId,
    pub(crate) want: BlobWant,
}

/// What the event loop does for [`Transfers`], in order.
#[derive(Debug)]
pub(crate) enum Action {
    /// Send this blob request, then report its id with [`Transfers::sent`].
    Request(Pending),
    /// Ask the DHT who provides a blob; report what it finds with
    /// [`Transfers::providers_found`].
    FindProviders(BlobHash),
    /// Announce a blob this node now holds (a download finished).
    Provide(BlobHash),
    /// Stop announcing a released blob, if it was announced.
    Unprovide(BlobHash),
    /// Ban a peer that sent a bad outboard or chunk, or the wrong answer. It is
    /// already dropped from every download.
    Ban { peer: PeerId, reason: String },
    /// Tell the owner.
    Emit(Event),
    /// Answer the waiters of a finished download (after its [`Event::BlobFetched`]).
    Reply { waiters: Vec<Reply>, result: Result<FetchReport, FetchError> },
    /// Run this on a blocking thread and hand what it returns to [`Transfers::done`].
    Run(Job),
}

/// Blob work for a blocking thread: hashing and disk reads and writes.
#[derive(Debug)]
pub(crate) enum Job {
    /// Verify chunk `index` of `hash` from `peer` and write it.
    Check { hash: BlobHash, peer: PeerId, index: u32, writer: ChunkWriter, frame: ChunkFrame },
    /// Open the download of `hash` on disk (a resumed one re-verifies what it holds).
    Open { hash: BlobHash, store: BlobStore, outboard: Outboard },
    /// Move the complete download of `hash` into the store (it syncs the data).
    Finish { hash: BlobHash, partial: Partial },
}

/// What a [`Job`] did.
#[derive(Debug)]
pub(crate) enum Done {
    /// Chunk `index` of `hash` from `peer` was verified (`Ok(true)`) and written, or
    /// failed verification (`Ok(false)`).
    Checked { hash: BlobHash, peer: PeerId, index: u32, result: Result<bool, StoreError> },
    /// A download was opened on disk.
    Opened { hash: BlobHash, result: Result<Partial, StoreError> },
    /// A complete blob was moved into the store.
    Stored { hash: BlobHash, result: Result<PathBuf, StoreError> },
}

impl Job {
    /// Does the work, blocking.
    pub(crate) fn run(self) -> Done {
        match self {
            Self::Check { hash, peer, index, writer, frame } => {
                Done::Checked { hash, peer, index, result: writer.verify_and_write(index, frame.data()) }
            }
            Self::Open { hash, store, outboard } => Done::Opened { hash, result: store.partial(hash, outboard) },
            Self::Finish { hash, partial } => Done::Stored { hash, result: partial.finish() },
        }
    }
}

/// The counters of [`Stats`] that blob transfer keeps.
#[derive(Debug, Default, Clone, Copy)]
struct Counters {
    chunks_rejected: u64,
    chunks_served: u64,
    bytes_served: u64,
    chunks_relayed: u64,
    blobs_removed: u64,
    bytes_removed: u64,
}

/// Every blob transfer of one node: its downloads, its answers to peers, and the
/// released blobs that wait for transfers to end (see the module docs).
#[derive(Debug)]
pub(crate) struct Transfers<O, I> {
    store: BlobStore,
    /// How long a blob counts as in transfer after it was last served or fetched
    /// (`Config::transfer_linger`).
    linger: Duration,
    /// Chunk requests in flight to each provider (`Config::chunk_window`).
    window: usize,
    fetches: HashMap<BlobHash, Fetch>,
    /// Blob requests in flight, by the caller's id.
    pending: HashMap<O, Pending>,
    /// Downloads to advance at the next [`Transfers::poll`].
    to_drive: Vec<BlobHash>,
    actions: VecDeque<Action>,
    counters: Counters,
    /// Outboards cached for serving (at most `serve::OUTBOARD_CACHE`).
    outboards: HashMap<BlobHash, Outboard>,
    /// Memory maps of complete blobs being served (at most `serve::MAP_CACHE`).
    maps: HashMap<BlobHash, Arc<Mmap>>,
    /// Chunks being read to answer each peer.
    reading: HashMap<PeerId, usize>,
    /// Blob requests answered (or being answered) whose response is not sent yet.
    responding: HashMap<I, (BlobHash, Instant)>,
    /// Blobs being transferred (served or fetched), so that none is deleted under a
    /// reader (at most `retain::MAX_IN_USE`). A blob served or fetched within
    /// `linger` counts: a fetcher's next chunk request follows the answer to its last
    /// one at once, and its first follows the outboard within a provider query's wait.
    in_use: HashMap<BlobHash, Use>,
    /// Released blobs that wait for their transfers to end (at most
    /// `retain::MAX_DEFERRED`).
    deferred: HashMap<BlobHash, Deferred>,
}

impl<O: Copy + Eq + Hash, I: Copy + Eq + Hash> Transfers<O, I> {
    /// Transfers of the blobs in `store`.
    pub(crate) fn new(store: BlobStore, linger: Duration, window: usize) -> Self {
        Self {
            store,
            linger,
            window,
            fetches: HashMap::new(),
            pending: HashMap::new(),
            to_drive: Vec::new(),
            actions: VecDeque::new(),
            counters: Counters::default(),
            outboards: HashMap::new(),
            maps: HashMap::new(),
            reading: HashMap::new(),
            responding: HashMap::new(),
            in_use: HashMap::new(),
            deferred: HashMap::new(),
        }
    }

    /// The store the blobs are in.
    pub(crate) fn store(&self) -> &BlobStore {
        &self.store
    }

    /// The next thing to do, `None` when there is nothing. The downloads that changed
    /// are advanced once the actions before are done; `held` are providers that get no
    /// chunk requests for now (see [`Fetch::next_requests`]).
    pub(crate) fn poll(&mut self, now: Instant, held: &[PeerId]) -> Option<Action> {
        if self.actions.is_empty() {
            for hash in std::mem::take(&mut self.to_drive) {
                self.drive(hash, now, held);
            }
        }
        self.actions.pop_front()
    }

    /// `peer` connected afresh: every download gives it another chance (see
    /// [`Fetch::reconnected`]).
    pub(crate) fn connected(&mut self, peer: &PeerId) {
        let revived: Vec<BlobHash> =
            self.fetches.iter_mut().filter_map(|(hash, fetch)| fetch.reconnected(peer).then_some(*hash)).collect();
        for hash in revived {
            tracing::debug!(%hash, %peer, "a provider that had failed is back");
            self.changed(hash);
        }
    }

    /// Whether [`Transfers::poll`] has anything to hand out.
    pub(crate) fn has_work(&self) -> bool {
        !self.actions.is_empty() || !self.to_drive.is_empty()
    }

    /// The owner wants `hash` within `timeout`, from `hint` (peers known to have it,
    /// neither banned nor this node) and whoever the DHT names.
    pub(crate) fn fetch(
        &mut self,
        hash: BlobHash,
        hint: impl IntoIterator<Item = PeerId>,
        timeout: Duration,
        reply: Reply,
        now: Instant,
    ) {
        self.start_fetch(hash, timeout, reply, now);
        if let Some(fetch) = self.fetches.get_mut(&hash) {
            for peer in hint {
                // the asker knows it has the blob now, whatever it did before
                fetch.reconnected(&peer);
                fetch.add_provider(peer);
            }
            self.changed(hash);
        }
    }

    fn start_fetch(&mut self, hash: BlobHash, timeout: Duration, reply: Reply, now: Instant) {
        if self.store.contains(&hash) {
            // the asker reads it next: a release does not delete it under the reader,
            // and one still waiting is called off (the owner wants the blob again)
            self.used(hash, 0, now);
            self.deferred.remove(&hash);
            let bytes = std::fs::metadata(self.store.path(&hash)).map_or(0, |m| m.len());
            let _ = reply.send(Ok(FetchReport {
                hash,
                path: self.store.path(&hash),
                bytes,
                providers: 0,
                chunks_fetched: 0,
                chunks_relayed: 0,
                seconds: 0.0,
            }));
            return;
        }
        if let Some(fetch) = self.fetches.get_mut(&hash) {
            fetch.add_waiter(reply, now + timeout);
            return;
        }
        if self.fetches.len() >= MAX_FETCHES {
            let _ = reply.send(Err(FetchError::Busy { hash, max: MAX_FETCHES }));
            return;
        }
        tracing::debug!(%hash, "fetch started");
        let mut fetch = Fetch::new(hash, now, now + timeout, reply, MAX_PROVIDER_FAILURES);
        fetch.query_started(now);
        self.fetches.insert(hash, fetch);
        self.actions.push_back(Action::FindProviders(hash));
        self.changed(hash);
    }

    /// The DHT named `providers` of `hash` (neither banned nor this node); `last`:
    /// the query is over.
    pub(crate) fn providers_found(
        &mut self,
        hash: BlobHash,
        providers: impl IntoIterator<Item = PeerId>,
        last: bool,
        now: Instant,
    ) {
        if let Some(fetch) = self.fetches.get_mut(&hash) {
            for peer in providers {
                fetch.add_provider(peer);
            }
            if last {
                fetch.query_done(now);
                tracing::debug!(%hash, "provider query done");
            }
        }
        self.changed(hash);
    }

    /// The request of an [`Action::Request`] went out as `id`.
    pub(crate) fn sent(&mut self, id: O, request: Pending) {
        self.pending.insert(id, request);
    }

    /// The answer to request `id`, at `now`; `relayed`: it came over a relayed connection.
    pub(crate) fn answered(&mut self, id: O, response: BlobReply, relayed: bool, now: Instant) {
        let Some(Pending { hash, peer, want }) = self.pending.remove(&id) else {
            return;
        };
        let Some(fetch) = self.fetches.get_mut(&hash) else {
            return;
        };
        if relayed && let (BlobReply::Chunk(_), BlobWant::Chunk(index)) = (&response, want) {
            fetch.arrived_via_relay(index);
            self.counters.chunks_relayed += 1;
        }
        let verdict = match (want, response) {
            (_, BlobReply::Other(BlobResponse::NotFound | BlobResponse::Refused(_))) => {
                fetch.provider_lacks(peer, want, now);
                Ok(())
            }
            (BlobWant::Outboard, BlobReply::Other(BlobResponse::Outboard { size, chunk_cvs })) => {
                self.on_outboard(hash, peer, Outboard { size, cvs: chunk_cvs })
            }
            (BlobWant::Chunk(index), BlobReply::Chunk(frame)) => {
                self.on_chunk(hash, peer, index, frame);
                Ok(())
            }
            (want, other) => {
                fetch.request_failed(peer, want);
                Err(format!("answered {want:?} for blob {hash} with {}", kind(&other)))
            }
        };
        if let Err(reason) = verdict {
            self.ban(peer, reason);
        }
        self.changed(hash);
    }

    /// Request `id` failed. `replaced`: its connection closed because a direct one
    /// replaced it; it is asked again, not held against the peer.
    pub(crate) fn failed(&mut self, id: O, replaced: bool, error: &dyn std::fmt::Display) {
        let Some(Pending { hash, peer, want }) = self.pending.remove(&id) else {
            return;
        };
        tracing::debug!(%peer, %hash, "blob request failed: {error}");
        if let Some(fetch) = self.fetches.get_mut(&hash) {
            if replaced {
                fetch.request_lost(peer, want);
            } else {
                fetch.request_failed(peer, want);
            }
        }
        self.changed(hash);
    }

    /// A [`Job`] is done.
    pub(crate) fn done(&mut self, done: Done, now: Instant) {
        match done {
            Done::Checked { hash, peer, index, result } => self.checked(hash, peer, index, result),
            Done::Opened { hash, result } => self.opened(hash, result),
            Done::Stored { hash, result } => self.finished(hash, result, now),
        }
    }

    /// Time passed: answers never sent are forgotten, released blobs whose transfers
    /// ended are deleted, and every download advances (or times out).
    pub(crate) fn housekeeping(&mut self, now: Instant) {
        self.expire_responses(now);
        self.reap(now);
        self.forget_unused(now);
        self.drive_all();
    }

    /// Advances every download at the next poll (after a change of which peers are held).
    pub(crate) fn drive_all(&mut self) {
        self.to_drive = self.fetches.keys().copied().collect();
    }

    /// Whether a blob request to `peer`, or a chunk read for it, is in flight.
    pub(crate) fn is_busy_with(&self, peer: &PeerId) -> bool {
        self.pending.values().any(|p| p.peer == *peer) || self.reading.contains_key(peer)
    }

    /// The node stops: every download fails, and what waited for a transfer goes now.
    pub(crate) fn stop(&mut self, now: Instant) {
        for (_, fetch) in self.fetches.drain() {
            fetch.fail(FetchError::Stopped(Stopped));
        }
        self.in_use.clear();
        self.responding.clear();
        self.maps.clear();
        self.reap(now);
    }

    /// Fills in the counters blob transfer keeps.
    pub(crate) fn count(&self, stats: &mut Stats) {
        let c = self.counters;
        stats.chunks_rejected = c.chunks_rejected;
        stats.chunks_served = c.chunks_served;
        stats.bytes_served = c.bytes_served;
        stats.chunks_relayed = c.chunks_relayed;
        stats.blobs_removed = c.blobs_removed;
        stats.bytes_removed = c.bytes_removed;
    }

    fn changed(&mut self, hash: BlobHash) {
        if !self.to_drive.contains(&hash) {
            self.to_drive.push(hash);
        }
    }

    /// Drops `peer` from every download and has it banned.
    fn ban(&mut self, peer: PeerId, reason: String) {
        for fetch in self.fetches.values_mut() {
            fetch.remove_provider(&peer);
        }
        self.actions.push_back(Action::Ban { peer, reason });
    }

    /// Advances a download: asks for providers, the outboard, or chunks, and finishes,
    /// fails or times it out.
    fn drive(&mut self, hash: BlobHash, now: Instant, held: &[PeerId]) {
        let Some(fetch) = self.fetches.get_mut(&hash) else {
            return;
        };
        if fetch.is_finishing() {
            return;
        }
        if fetch.is_complete() {
            if let Some(partial) = fetch.begin_finish() {
                tracing::debug!(%hash, "all chunks written, finishing");
                self.actions.push_back(Action::Run(Job::Finish { hash, partial }));
            }
            return;
        }
        if fetch.timed_out(now) {
            let err = fetch.timeout_error(now);
            if let Some(fetch) = self.fetches.remove(&hash) {
                fetch.fail(err);
            }
            return;
        }
        if fetch.needs_query(now, REQUERY) {
            fetch.query_started(now);
            self.actions.push_back(Action::FindProviders(hash));
        }
        for (peer, want) in fetch.next_requests(self.window, now, GATHER, held) {
            self.actions.push_back(Action::Request(Pending { hash, peer, want }));
        }
    }

    fn on_outboard(&mut self, hash: BlobHash, peer: PeerId, outboard: Outboard) -> Result<(), String> {
        if outboard.root() != Some(hash) {
            self.counters.chunks_rejected += 1;
            if let Some(f) = self.fetches.get_mut(&hash) {
                f.outboard_failed(peer);
            }
            return Err(format!("outboard for blob {hash} does not hash to it"));
        }
        if self.fetches.get(&hash).is_some_and(Fetch::has_partial) {
            return Ok(());
        }
        let max = self.store.max_size();
        if outboard.size > max {
            if let Some(f) = self.fetches.remove(&hash) {
                f.fail(FetchError::TooLarge { hash, size: outboard.size, max });
            }
            return Ok(());
        }
        tracing::debug!(%hash, %peer, "outboard verified");
        if let Some(f) = self.fetches.get_mut(&hash) {
            f.opening();
        }
        // opening a resumed download re-verifies its chunks on disk: off the event loop
        self.actions.push_back(Action::Run(Job::Open { hash, store: self.store.clone(), outboard }));
        Ok(())
    }

    fn opened(&mut self, hash: BlobHash, result: Result<Partial, StoreError>) {
        match result {
            Ok(partial) => {
                if let Some(f) = self.fetches.get_mut(&hash) {
                    f.set_partial(partial);
                }
            }
            Err(e) => {
                if let Some(f) = self.fetches.remove(&hash) {
                    f.fail(FetchError::Store { hash, reason: e.to_string() });
                }
            }
        }
        self.changed(hash);
    }

    /// A chunk arrived: verified and written by a [`Job::Check`].
    fn on_chunk(&mut self, hash: BlobHash, peer: PeerId, index: u32, frame: ChunkFrame) {
        let Some(writer) = self.fetches.get_mut(&hash).and_then(|f| f.chunk_arrived(peer, index)) else {
            return;
        };
        self.actions.push_back(Action::Run(Job::Check { hash, peer, index, writer, frame }));
    }

    fn checked(&mut self, hash: BlobHash, peer: PeerId, index: u32, result: Result<bool, StoreError>) {
        let Some(fetch) = self.fetches.get_mut(&hash) else {
            return;
        };
        match result {
            Ok(ok) => {
                fetch.chunk_checked(peer, index, ok);
                if !ok {
                    self.counters.chunks_rejected += 1;
                    self.ban(peer, format!("chunk {index} of blob {hash} failed verification"));
                }
            }
            Err(e) => {
                if let Some(f) = self.fetches.remove(&hash) {
                    f.fail(FetchError::Store { hash, reason: e.to_string() });
                }
            }
        }
        self.changed(hash);
    }

    fn finished(&mut self, hash: BlobHash, stored: Result<PathBuf, StoreError>, now: Instant) {
        let Some(fetch) = self.fetches.remove(&hash) else {
            return;
        };
        let (result, waiters) = fetch.finished(stored, now);
        match &result {
            Ok(report) => {
                tracing::debug!(%hash, "fetch complete");
                self.used(hash, 0, now);
                if !self.deferred.contains_key(&hash) {
                    self.actions.push_back(Action::Provide(hash));
                }
                self.actions.push_back(Action::Emit(Event::BlobFetched {
                    hash,
                    bytes: report.bytes,
                    providers: report.providers,
                    seconds: report.seconds,
                    chunks: report.chunks_fetched,
                    chunks_relayed: report.chunks_relayed,
                }));
            }
            Err(e) => tracing::warn!("{e}"),
        }
        self.actions.push_back(Action::Reply { waiters, result });
    }
}

fn kind(r: &BlobReply) -> &'static str {
    match r {
        BlobReply::Other(BlobResponse::Outboard { .. }) => "an outboard",
        BlobReply::Chunk(_) | BlobReply::Mapped(_) | BlobReply::Other(BlobResponse::Chunk(_)) => "a chunk",
        BlobReply::Other(BlobResponse::NotFound) => "not-found",
        BlobReply::Other(BlobResponse::Refused(_)) => "refused",
    }
}
