//! The state of one blob download: providers, the verified outboard, the chunks queued
//! and in flight per provider, and who delivered verified chunks.

use std::collections::{HashMap, HashSet, VecDeque};
use std::time::Duration;

use libp2p::PeerId;
use pcp_protocol::BlobHash;
use pcp_schema::BlobWant;
use tokio::sync::oneshot;
use tokio::time::Instant;

use crate::node::{FetchError, FetchReport};
use crate::store::{Partial, StoreError};

type Reply = oneshot::Sender<Result<FetchReport, FetchError>>;

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
    lacking: HashSet<PeerId>,
    outboard_request: Option<PeerId>,
    partial: Option<Partial>,
    queue: VecDeque<u32>,
    inflight: HashMap<PeerId, HashSet<u32>>,
    contributors: HashSet<PeerId>,
    fetched: u32,
    query_running: bool,
    last_query: Option<Instant>,
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
            lacking: HashSet::new(),
            outboard_request: None,
            partial: None,
            queue: VecDeque::new(),
            inflight: HashMap::new(),
            contributors: HashSet::new(),
            fetched: 0,
            query_running: false,
            last_query: None,
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

    fn usable(&self, peer: &PeerId) -> bool {
        !self.lacking.contains(peer) && self.failures.get(peer).copied().unwrap_or(0) < self.max_failures
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
            && !self.providers.iter().any(|p| self.usable(p))
            && self.last_query.is_none_or(|t| now.duration_since(t) >= every)
    }

    /// Requests to send now: the outboard from one provider, or chunks spread over every
    /// usable provider, at most `window` in flight each.
    /// Chunk requests wait up to `gather` after the start while the provider query runs,
    /// so that the work is spread over every provider rather than the first found.
    pub(crate) fn next_requests(&mut self, window: usize, now: Instant, gather: Duration) -> Vec<(PeerId, BlobWant)> {
        let usable: Vec<PeerId> = self.providers.iter().copied().filter(|p| self.usable(p)).collect();
        let mut out = Vec::new();
        if self.partial.is_none() {
            if self.outboard_request.is_none()
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
            for p in &usable {
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
        self.partial = Some(partial);
    }

    pub(crate) fn has_partial(&self) -> bool {
        self.partial.is_some()
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

    /// `peer` does not have the blob after all.
    pub(crate) fn provider_lacks(&mut self, peer: PeerId, want: BlobWant) {
        self.lacking.insert(peer);
        self.release(peer, want);
    }

    /// A request to `peer` failed (timeout, connection closed).
    pub(crate) fn request_failed(&mut self, peer: PeerId, want: BlobWant) {
        *self.failures.entry(peer).or_default() += 1;
        self.release(peer, want);
    }

    /// Verifies and stores a chunk. `Ok(false)`: it failed verification (the caller bans
    /// the sender).
    pub(crate) fn accept_chunk(&mut self, peer: PeerId, index: u32, data: &[u8]) -> Result<bool, StoreError> {
        if let Some(s) = self.inflight.get_mut(&peer) {
            s.remove(&index);
        }
        let Some(partial) = self.partial.as_mut() else {
            return Ok(true);
        };
        if !partial.outboard().verify_chunk(index, data) {
            self.requeue(index);
            return Ok(false);
        }
        if !partial.has(index) {
            partial.write_chunk(index, data)?;
            self.contributors.insert(peer);
            self.fetched += 1;
        }
        Ok(true)
    }

    pub(crate) fn is_complete(&self) -> bool {
        self.partial.as_ref().is_some_and(Partial::is_complete)
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

    /// Moves the complete blob into the store; returns the outcome and the waiters to
    /// answer (after the caller has recorded the outcome).
    pub(crate) fn finish(mut self, now: Instant) -> (Result<FetchReport, FetchError>, Vec<Reply>) {
        let seconds = now.duration_since(self.started).as_secs_f64();
        let result = match self.partial.take() {
            Some(partial) => {
                let bytes = partial.outboard().size;
                partial
                    .finish()
                    .map(|path| FetchReport {
                        hash: self.hash,
                        path,
                        bytes,
                        providers: self.contributors.len(),
                        chunks_fetched: self.fetched,
                        seconds,
                    })
                    .map_err(|e| FetchError::Store { hash: self.hash, reason: e.to_string() })
            }
            None => Err(FetchError::Store { hash: self.hash, reason: "finished without data".into() }),
        };
        (result, self.waiters)
    }
}
