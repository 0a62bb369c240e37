//! The state of one blob download: providers, the verified outboard, the chunks queued
//! and in flight per provider, and who delivered verified chunks.

use std::collections::{HashMap, HashSet, VecDeque};
use std::path::PathBuf;
use std::time::Duration;

use libp2p::PeerId;
use pcp_protocol::BlobHash;
use pcp_schema::BlobWant;
use tokio::sync::oneshot;
use tokio::time::Instant;

use crate::command::FetchReport;
use crate::error::FetchError;
use crate::store::{ChunkWriter, Partial, StoreError};

/// A provider that answered that it lacks the blob is asked again after this long:
/// it may be storing it (a shepherd writes a round's parameter shards just after
/// it announces them) or fetching it. A provider that still lacks it answers so
/// at once, one small request a second.
pub(crate) const LACKING_RETRY: Duration = Duration::from_secs(1);

/// Where a fetch's outcome goes.
pub(crate) type Reply = oneshot::Sender<Result<FetchReport, FetchError>>;

/// One download in progress.
#[derive(Debug)]
pub(crate) struct Fetch {
    hash: BlobHash,
    started: Instant,
    deadline: Instant,
    waiters: Vec<Reply>,
    providers: Vec<PeerId>,
    failures: HashMap<PeerId, u32>,
    max_failures: u32,
    /// Providers that answered that they lack the blob, and when.
    lacking: HashMap<PeerId, Instant>,
    outboard_request: Option<PeerId>,
    partial: Option<Partial>,
    queue: VecDeque<u32>,
    inflight: HashMap<PeerId, HashSet<u32>>,
    contributors: HashSet<PeerId>,
    fetched: u32,
    /// Chunks that arrived over relayed connections and wait for verification.
    via_relay: HashSet<u32>,
    /// Verified chunks that came over relayed connections.
    relayed: u32,
    query_running: bool,
    last_query: Option<Instant>,
    /// The blob's size while it is moved into the store.
    finishing: Option<u64>,
    /// The partial download is being opened (and its chunks on disk re-verified).
    opening: bool,
}

impl Fetch {
    pub(crate) fn new(hash: BlobHash, now: Instant, deadline: Instant, reply: Reply, max_failures: u32) -> Self {
        Self {
            hash,
            started: now,
            deadline,
            waiters: vec![reply],
            providers: Vec::new(),
            failures: HashMap::new(),
            max_failures,
            lacking: HashMap::new(),
            outboard_request: None,
            partial: None,
            queue: VecDeque::new(),
            inflight: HashMap::new(),
            contributors: HashSet::new(),
            fetched: 0,
            via_relay: HashSet::new(),
            relayed: 0,
            query_running: false,
            last_query: None,
            finishing: None,
            opening: false,
        }
    }

    pub(crate) fn add_waiter(&mut self, reply: Reply, deadline: Instant) {
        self.waiters.push(reply);
        self.deadline = self.deadline.max(deadline);
    }

    pub(crate) fn add_provider(&mut self, peer: PeerId) {
        if !self.providers.contains(&peer) {
            self.providers.push(peer);
        }
    }

    /// `peer` is reachable anew (a fresh connection, or an asker naming it): the
    /// failures and "lacks it" of its last connection are forgotten. A provider
    /// that restarted under the same identity (a shepherd resumed from its
    /// checkpoint) would otherwise stay dropped until the download times out.
    /// Banned peers are removed, not counted here, and stay out.
    pub(crate) fn reconnected(&mut self, peer: &PeerId) -> bool {
        let failed = self.failures.remove(peer).is_some_and(|n| n > 0);
        let lacked = self.lacking.remove(peer).is_some();
        failed || lacked
    }

    /// Drops a provider (banned) and requeues what it had in flight.
    pub(crate) fn remove_provider(&mut self, peer: &PeerId) {
        self.providers.retain(|p| p != peer);
        if self.outboard_request == Some(*peer) {
            self.outboard_request = None;
        }
        if let Some(chunks) = self.inflight.remove(peer) {
            for i in chunks {
                self.requeue(i);
            }
        }
    }

    fn requeue(&mut self, index: u32) {
        if !self.partial.as_ref().is_some_and(|p| p.has(index)) && !self.queue.contains(&index) {
            self.queue.push_front(index);
        }
    }

    fn usable(&self, peer: &PeerId, now: Instant) -> bool {
        self.lacking.get(peer).is_none_or(|at| now.duration_since(*at) >= LACKING_RETRY)
            && self.failures.get(peer).copied().unwrap_or(0) < self.max_failures
    }

    pub(crate) fn query_started(&mut self, now: Instant) {
        self.query_running = true;
        self.last_query = Some(now);
    }

    pub(crate) fn query_done(&mut self, now: Instant) {
        self.query_running = false;
        self.last_query = Some(now);
    }

    /// Whether to ask the DHT for providers again: no query running and no provider left.
    pub(crate) fn needs_query(&self, now: Instant, every: Duration) -> bool {
        !self.query_running
            && !self.providers.iter().any(|p| self.usable(p, now))
            && self.last_query.is_none_or(|t| now.duration_since(t) >= every)
    }

    /// Requests to send now: the outboard from one provider, or chunks spread over every
    /// usable provider, at most `window` in flight each.
    /// Chunk requests wait up to `gather` after the start while the provider query runs,
    /// so that the work is spread over every provider rather than the first found.
    /// Providers in `held` get no chunk requests for now (they are reachable only through
    /// a relay while a hole punch is tried).
    pub(crate) fn next_requests(
        &mut self,
        window: usize,
        now: Instant,
        gather: Duration,
        held: &[PeerId],
    ) -> Vec<(PeerId, BlobWant)> {
        let usable: Vec<PeerId> = self.providers.iter().copied().filter(|p| self.usable(p, now)).collect();
        let mut out = Vec::new();
        if self.partial.is_none() {
            if self.outboard_request.is_none()
                && !self.opening
                && let Some(p) = usable.first()
            {
                self.outboard_request = Some(*p);
                out.push((*p, BlobWant::Outboard));
            }
            return out;
        }
        if self.query_running && now.duration_since(self.started) < gather {
            return out;
        }
        loop {
            let mut progress = false;
            for p in usable.iter().filter(|p| !held.contains(p)) {
                let inflight = self.inflight.entry(*p).or_default();
                if inflight.len() >= window {
                    continue;
                }
                let Some(index) = self.queue.pop_front() else {
                    return out;
                };
                inflight.insert(index);
                out.push((*p, BlobWant::Chunk(index)));
                progress = true;
            }
            if !progress {
                return out;
            }
        }
    }

    pub(crate) fn set_partial(&mut self, partial: Partial) {
        self.queue = partial.missing().into();
        self.outboard_request = None;
        self.opening = false;
        self.partial = Some(partial);
    }

    /// Whether the download is open, or being opened, on disk.
    pub(crate) fn has_partial(&self) -> bool {
        self.partial.is_some() || self.opening
    }

    /// The verified outboard is in: the download is being opened off the event loop.
    pub(crate) fn opening(&mut self) {
        self.opening = true;
        self.outboard_request = None;
    }

    /// The outboard `peer` sent does not hash to the blob.
    pub(crate) fn outboard_failed(&mut self, peer: PeerId) {
        self.remove_provider(&peer);
    }

    fn release(&mut self, peer: PeerId, want: BlobWant) {
        match want {
            BlobWant::Outboard => {
                if self.outboard_request == Some(peer) {
                    self.outboard_request = None;
                }
            }
            BlobWant::Chunk(i) => {
                if self.inflight.get_mut(&peer).is_some_and(|s| s.remove(&i)) {
                    self.requeue(i);
                }
            }
        }
    }

    /// `peer` does not have the blob, at `now` (see [`LACKING_RETRY`]).
    pub(crate) fn provider_lacks(&mut self, peer: PeerId, want: BlobWant, now: Instant) {
        self.lacking.insert(peer, now);
        self.release(peer, want);
    }

    /// A request to `peer` failed (timeout, connection closed).
    pub(crate) fn request_failed(&mut self, peer: PeerId, want: BlobWant) {
        *self.failures.entry(peer).or_default() += 1;
        self.release(peer, want);
    }

    /// A request to `peer` was lost with a connection that this node closed on purpose
    /// (a direct connection replaced a relayed one): asked again, not held against it.
    pub(crate) fn request_lost(&mut self, peer: PeerId, want: BlobWant) {
        self.release(peer, want);
    }

    /// Chunk `index` came over a relayed connection.
    pub(crate) fn arrived_via_relay(&mut self, index: u32) {
        self.via_relay.insert(index);
    }

    /// Chunk `index` arrived from `peer`: the writer to verify and store it with, off the
    /// event loop, or `None` when it is not needed (already written). Until
    /// [`Fetch::chunk_checked`] the chunk keeps its place in the peer's window, so that
    /// chunks waiting for verification hold back further requests.
    pub(crate) fn chunk_arrived(&mut self, peer: PeerId, index: u32) -> Option<ChunkWriter> {
        match self.partial.as_ref() {
            Some(partial) if !partial.has(index) => Some(partial.writer()),
            _ => {
                if let Some(s) = self.inflight.get_mut(&peer) {
                    s.remove(&index);
                }
                None
            }
        }
    }

    /// The outcome of verifying and writing chunk `index` from `peer`: `ok` means it was
    /// verified and written; otherwise it is requested again (the caller bans the sender).
    pub(crate) fn chunk_checked(&mut self, peer: PeerId, index: u32, ok: bool) {
        if let Some(s) = self.inflight.get_mut(&peer) {
            s.remove(&index);
        }
        let relayed = self.via_relay.remove(&index);
        if !ok {
            self.requeue(index);
            return;
        }
        if let Some(partial) = self.partial.as_mut()
            && !partial.has(index)
        {
            partial.mark_done(index);
            self.contributors.insert(peer);
            self.fetched += 1;
            self.relayed += u32::from(relayed);
        }
    }

    pub(crate) fn is_complete(&self) -> bool {
        self.partial.as_ref().is_some_and(Partial::is_complete)
    }

    /// Whether the complete blob is being moved into the store.
    pub(crate) fn is_finishing(&self) -> bool {
        self.finishing.is_some()
    }

    /// Takes the complete download to move into the store (off the event loop); answer
    /// the waiters with [`Fetch::finished`].
    pub(crate) fn begin_finish(&mut self) -> Option<Partial> {
        let partial = self.partial.take()?;
        self.finishing = Some(partial.outboard().size);
        Some(partial)
    }

    pub(crate) fn timed_out(&self, now: Instant) -> bool {
        now >= self.deadline
    }

    /// The error for waiters when the deadline passes; verified chunks stay on disk.
    pub(crate) fn timeout_error(&self, now: Instant) -> FetchError {
        let (done, total) = self.partial.as_ref().map_or((0, 0), |p| {
            let total = p.outboard().chunks();
            (total - u32::try_from(p.missing().len()).unwrap_or(total), total)
        });
        FetchError::TimedOut {
            hash: self.hash,
            seconds: now.duration_since(self.started).as_secs_f64(),
            done,
            total,
            providers: self.providers.len(),
        }
    }

    /// Sends `err` to every waiter.
    pub(crate) fn fail(self, err: FetchError) {
        for w in self.waiters {
            let _ = w.send(Err(err.clone()));
        }
    }

    /// The outcome of moving the blob into the store; returns it and the waiters to
    /// answer (after the caller has recorded the outcome).
    pub(crate) fn finished(
        self,
        stored: Result<PathBuf, StoreError>,
        now: Instant,
    ) -> (Result<FetchReport, FetchError>, Vec<Reply>) {
        let seconds = now.duration_since(self.started).as_secs_f64();
        let result = match (self.finishing, stored) {
            (Some(bytes), Ok(path)) => Ok(FetchReport {
                hash: self.hash,
                path,
                bytes,
                providers: self.contributors.len(),
                chunks_fetched: self.fetched,
                chunks_relayed: self.relayed,
                seconds,
            }),
            (_, Err(e)) => Err(FetchError::Store { hash: self.hash, reason: e.to_string() }),
            (None, Ok(_)) => Err(FetchError::Store { hash: self.hash, reason: "finished without data".into() }),
        };
        (result, self.waiters)
    }
}
