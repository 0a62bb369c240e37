//! [`Transfers`] without a swarm: a node fetching from peers that are themselves
//! `Transfers` serving their stores (or peers that lack the blob, corrupt chunks, forge
//! outboards or never answer), every request answered in order, every job run in
//! place, time moved by hand. Blob contents are seeded.

use std::collections::VecDeque;
use std::path::Path;

use pcp_protocol::Identity;
use pcp_schema::{BlobRequest, CHUNK_SIZE};
use rand::{RngCore, SeedableRng, rngs::StdRng};
use tokio::sync::oneshot;
use tokio::sync::oneshot::error::TryRecvError;

use super::*;
use crate::command::Released;
use crate::fetch::LACKING_RETRY;

type T = Transfers<u64, u64>;

/// How long a served or fetched blob counts as in transfer here.
const LINGER: Duration = Duration::from_secs(3);
/// Chunk requests in flight per provider.
const WINDOW: usize = 2;
/// A blob of three chunks, the last one short.
const SIZE: usize = 2 * CHUNK_SIZE + 1000;

fn bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut data = vec![0u8; len];
    StdRng::seed_from_u64(seed).fill_bytes(&mut data);
    data
}

fn peer(n: u8) -> PeerId {
    crate::keypair(&Identity::from_secret([n; 32])).public().to_peer_id()
}

fn store(dir: &Path, name: &str) -> BlobStore {
    BlobStore::open(&dir.join(name)).expect("a store")
}

fn transfers(store: BlobStore) -> T {
    Transfers::new(store, LINGER, WINDOW)
}

/// A chunk as it arrives from the wire.
fn frame(data: &[u8]) -> ChunkFrame {
    ChunkFrame::build(data.len(), |m| {
        m.extend_from_slice(data);
        Ok(())
    })
    .expect("a chunk frame")
}

/// A peer answering blob requests.
enum Provider {
    /// Serves what its store holds (an empty store answers not-found).
    Honest(T),
    /// Serves its store, every chunk with one bit flipped.
    Corrupt(T),
    /// Answers with an outboard that does not hash to the blob.
    Forger,
    /// Never answers: every request fails.
    Silent,
}

/// What `t` answers to request `id` from `from`, as it arrives on the wire, after its
/// answer was sent.
fn serve(t: &mut T, from: PeerId, id: u64, request: BlobRequest, now: Instant, corrupt: bool) -> BlobReply {
    let reply = match t.serve(from, id, request, now) {
        Serve::Now(reply) => reply,
        Serve::Read(read) => t.served(read.run()),
    };
    t.responded(id, now);
    let data = match &reply {
        BlobReply::Mapped(chunk) => Some(chunk.data().to_vec()),
        BlobReply::Chunk(frame) => Some(frame.data().to_vec()),
        BlobReply::Other(_) => None,
    };
    let Some(mut data) = data else {
        return reply;
    };
    if corrupt {
        data[0] ^= 1;
    }
    BlobReply::Chunk(frame(&data))
}

/// A node (`node`, peer 1) and the peers it fetches from; the DHT names every peer
/// not banned.
struct Net {
    now: Instant,
    node: T,
    providers: Vec<(PeerId, Provider)>,
    next_id: u64,
    in_flight: VecDeque<(u64, Pending)>,
    // what the node asked for
    requests: Vec<(PeerId, BlobWant)>,
    queries: usize,
    bans: Vec<(PeerId, String)>,
    provided: Vec<BlobHash>,
    unprovided: Vec<BlobHash>,
    events: Vec<Event>,
}

impl Net {
    fn new(node: T, providers: Vec<(PeerId, Provider)>) -> Self {
        Self {
            now: Instant::now(),
            node,
            providers,
            next_id: 0,
            in_flight: VecDeque::new(),
            requests: Vec::new(),
            queries: 0,
            bans: Vec::new(),
            provided: Vec::new(),
            unprovided: Vec::new(),
            events: Vec::new(),
        }
    }

    fn fetch(&mut self, hash: BlobHash, timeout: Duration) -> oneshot::Receiver<Result<FetchReport, FetchError>> {
        let (tx, rx) = oneshot::channel();
        self.node.fetch(hash, [], timeout, tx, self.now);
        rx
    }

    /// Performs what the node asks and answers its requests until it asks nothing more.
    fn settle(&mut self) {
        loop {
            while let Some(action) = self.node.poll(self.now, &[]) {
                self.perform(action);
            }
            let Some((id, request)) = self.in_flight.pop_front() else {
                return;
            };
            self.answer(id, request);
        }
    }

    /// Moves time on by `by`, and lets the node notice.
    fn wait(&mut self, by: Duration) {
        self.now += by;
        self.node.housekeeping(self.now);
        self.settle();
    }

    fn perform(&mut self, action: Action) {
        match action {
            Action::Request(request) => {
                let id = self.next_id;
                self.next_id += 1;
                self.node.sent(id, request);
                self.requests.push((request.peer, request.want));
                self.in_flight.push_back((id, request));
            }
            Action::FindProviders(hash) => {
                self.queries += 1;
                let banned: Vec<PeerId> = self.bans.iter().map(|(p, _)| *p).collect();
                let found: Vec<PeerId> =
                    self.providers.iter().map(|(p, _)| *p).filter(|p| !banned.contains(p)).collect();
                self.node.providers_found(hash, found, true, self.now);
            }
            Action::Provide(hash) => self.provided.push(hash),
            Action::Unprovide(hash) => self.unprovided.push(hash),
            Action::Ban { peer, reason } => self.bans.push((peer, reason)),
            Action::Emit(event) => self.events.push(event),
            Action::Reply { waiters, result } => {
                for w in waiters {
                    let _ = w.send(result.clone());
                }
            }
            Action::Run(job) => self.node.done(job.run(), self.now),
        }
    }

    fn answer(&mut self, id: u64, request: Pending) {
        let (me, now) = (peer(1), self.now);
        let blob_request = BlobRequest { blob: request.hash.0, want: request.want };
        let (_, provider) = self.providers.iter_mut().find(|(p, _)| *p == request.peer).expect("a known peer");
        let reply = match provider {
            Provider::Honest(t) => serve(t, me, id, blob_request, now, false),
            Provider::Corrupt(t) => serve(t, me, id, blob_request, now, true),
            Provider::Forger => BlobResponse::Outboard { size: SIZE as u64, chunk_cvs: vec![[7; 32]; 3] }.into(),
            Provider::Silent => {
                self.node.failed(id, false, &"timed out");
                return;
            }
        };
        self.node.answered(id, reply, false, now);
    }

    fn asked(&self, who: PeerId) -> Vec<BlobWant> {
        self.requests.iter().filter(|(p, _)| *p == who).map(|(_, w)| *w).collect()
    }

    fn stats(&self) -> Stats {
        let mut stats = Stats::default();
        self.node.count(&mut stats);
        stats
    }
}

/// The answer to a fetch, which must have come.
fn outcome(rx: &mut oneshot::Receiver<Result<FetchReport, FetchError>>) -> Result<FetchReport, FetchError> {
    match rx.try_recv() {
        Ok(result) => result,
        Err(TryRecvError::Empty) => panic!("the fetch has not been answered"),
        Err(TryRecvError::Closed) => panic!("the fetch was dropped unanswered"),
    }
}

/// A store in `dir/name` holding the seeded blob; its hash and bytes.
fn holding(dir: &Path, name: &str, seed: u64) -> (BlobStore, BlobHash, Vec<u8>) {
    let store = store(dir, name);
    let data = bytes(SIZE, seed);
    let hash = store.put_bytes(&data).expect("put");
    (store, hash, data)
}

#[test]
fn a_download_skips_a_provider_that_lacks_the_blob() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (source, hash, data) = holding(dir.path(), "a", 1);
    let (lacking, has) = (peer(2), peer(3));
    let providers = vec![
        (lacking, Provider::Honest(transfers(store(dir.path(), "b")))),
        (has, Provider::Honest(transfers(source))),
    ];
    let mut net = Net::new(transfers(store(dir.path(), "node")), providers);
    let mut rx = net.fetch(hash, Duration::from_secs(60));
    net.settle();

    let report = outcome(&mut rx).expect("fetched");
    assert_eq!((report.bytes, report.providers, report.chunks_fetched), (SIZE as u64, 1, 3));
    assert_eq!(std::fs::read(&report.path).expect("read"), data, "the stored blob is the served one");
    assert_eq!(net.asked(lacking), vec![BlobWant::Outboard], "asked once, then never again");
    assert_eq!(net.asked(has).len(), 4, "the outboard and three chunks");
    assert!(net.bans.is_empty(), "lacking a blob is no offence");
    assert_eq!(net.provided, vec![hash], "a fetched blob is announced");
    assert!(matches!(net.events[..], [Event::BlobFetched { chunks: 3, providers: 1, .. }]));
    assert!(!net.node.has_work() && net.node.fetches.is_empty() && net.node.pending.is_empty());
}

#[test]
fn a_provider_that_lacked_the_blob_is_asked_again_once_it_may_have_it() {
    // a shepherd announces a round's parameter shards and stores them just after
    let dir = tempfile::tempdir().expect("tempdir");
    let shepherd = peer(2);
    let providers = vec![(shepherd, Provider::Honest(transfers(store(dir.path(), "shepherd"))))];
    let mut net = Net::new(transfers(store(dir.path(), "node")), providers);
    let (_, hash, data) = holding(dir.path(), "elsewhere", 9);
    let mut rx = net.fetch(hash, Duration::from_secs(60));
    net.settle();
    assert_eq!(net.asked(shepherd), vec![BlobWant::Outboard], "it lacks the blob: asked once");
    net.wait(LACKING_RETRY / 2);
    assert_eq!(net.asked(shepherd).len(), 1, "not again before the retry");
    assert!(matches!(rx.try_recv(), Err(TryRecvError::Empty)), "the fetch waits");
    store(dir.path(), "shepherd").put_bytes(&data).expect("stored now");
    net.wait(LACKING_RETRY / 2);
    let report = outcome(&mut rx).expect("fetched once it was stored");
    assert_eq!(std::fs::read(&report.path).expect("read"), data);
    assert!(net.bans.is_empty(), "lacking a blob for a while is no offence");
}

#[test]
fn a_chunk_that_fails_verification_bans_its_sender_and_is_fetched_again() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (honest_store, hash, data) = holding(dir.path(), "a", 2);
    let (corrupt_store, ..) = holding(dir.path(), "c", 2);
    let (liar, honest) = (peer(2), peer(3));
    let providers =
        vec![(liar, Provider::Corrupt(transfers(corrupt_store))), (honest, Provider::Honest(transfers(honest_store)))];
    let mut net = Net::new(transfers(store(dir.path(), "node")), providers);
    let mut rx = net.fetch(hash, Duration::from_secs(60));
    net.settle();

    let report = outcome(&mut rx).expect("fetched from the honest peer");
    assert_eq!(std::fs::read(&report.path).expect("read"), data);
    assert_eq!(report.providers, 1, "only verified chunks count");
    assert!(!net.bans.is_empty() && net.bans.iter().all(|(p, _)| *p == liar), "{:?}", net.bans);
    assert!(net.bans[0].1.contains("failed verification"), "{}", net.bans[0].1);
    assert!(net.asked(liar).iter().any(|w| matches!(w, BlobWant::Chunk(_))), "the liar got chunk requests");
    assert_eq!(net.stats().chunks_rejected, net.bans.len() as u64);
}

#[test]
fn a_forged_outboard_bans_its_sender() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (source, hash, data) = holding(dir.path(), "a", 3);
    let (forger, honest) = (peer(2), peer(3));
    let providers = vec![(forger, Provider::Forger), (honest, Provider::Honest(transfers(source)))];
    let mut net = Net::new(transfers(store(dir.path(), "node")), providers);
    let mut rx = net.fetch(hash, Duration::from_secs(60));
    net.settle();

    let report = outcome(&mut rx).expect("fetched");
    assert_eq!(std::fs::read(&report.path).expect("read"), data);
    assert_eq!(net.bans.len(), 1);
    assert_eq!(net.bans[0].0, forger);
    assert!(net.bans[0].1.contains("does not hash to it"), "{}", net.bans[0].1);
    assert_eq!(net.asked(forger), vec![BlobWant::Outboard]);
}

#[test]
fn a_blob_over_the_size_limit_is_refused_after_its_outboard() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (source, hash, _) = holding(dir.path(), "a", 4);
    let small = store(dir.path(), "node").with_max_size(CHUNK_SIZE as u64);
    let mut net = Net::new(transfers(small), vec![(peer(2), Provider::Honest(transfers(source)))]);
    let mut rx = net.fetch(hash, Duration::from_secs(60));
    net.settle();

    let err = outcome(&mut rx).expect_err("too large");
    assert!(matches!(err, FetchError::TooLarge { size, .. } if size == SIZE as u64), "{err}");
    assert_eq!(net.requests.len(), 1, "no chunk is asked for");
}

#[test]
fn a_silent_provider_is_dropped_after_three_failures_and_the_fetch_times_out() {
    let dir = tempfile::tempdir().expect("tempdir");
    let silent = peer(2);
    let mut net = Net::new(transfers(store(dir.path(), "node")), vec![(silent, Provider::Silent)]);
    let hash = BlobHash::of(b"nobody has this");
    let mut rx = net.fetch(hash, Duration::from_secs(10));
    net.settle();
    assert_eq!(net.asked(silent).len(), MAX_PROVIDER_FAILURES as usize, "asked until it counts as failed");
    assert_eq!(net.queries, 1);

    // with no usable provider left, the DHT is asked again every REQUERY
    net.wait(REQUERY);
    assert_eq!(net.queries, 2);
    assert_eq!(net.asked(silent).len(), MAX_PROVIDER_FAILURES as usize, "a failed provider stays dropped");
    assert!(matches!(rx.try_recv(), Err(TryRecvError::Empty)), "still waiting");

    net.wait(Duration::from_secs(8));
    let err = outcome(&mut rx).expect_err("timed out");
    assert!(matches!(err, FetchError::TimedOut { done: 0, total: 0, providers: 1, .. }), "{err}");
    assert!(net.node.fetches.is_empty());
}

#[test]
fn a_provider_that_failed_and_came_back_under_the_same_identity_serves_the_download() {
    // a shepherd killed mid-fetch and resumed from its checkpoint: same peer id, same blob
    let dir = tempfile::tempdir().expect("tempdir");
    let (source, hash, data) = holding(dir.path(), "a", 4);
    let shepherd = peer(2);
    let mut net = Net::new(transfers(store(dir.path(), "node")), vec![(shepherd, Provider::Silent)]);
    let mut rx = net.fetch(hash, Duration::from_secs(120));
    net.settle();
    assert_eq!(net.asked(shepherd).len(), MAX_PROVIDER_FAILURES as usize, "dropped after its failures");
    net.wait(REQUERY);
    assert_eq!(net.asked(shepherd).len(), MAX_PROVIDER_FAILURES as usize, "and not asked again while it is down");

    // it restarts and connects again: the download resumes from it, well before the timeout
    net.providers[0].1 = Provider::Honest(transfers(source));
    net.node.connected(&shepherd);
    net.settle();
    let report = outcome(&mut rx).expect("fetched from the restarted provider");
    assert_eq!(std::fs::read(&report.path).expect("read"), data);
    assert!(net.bans.is_empty(), "failing is no offence");
}

#[test]
fn an_asker_naming_a_provider_that_had_failed_gives_it_another_chance() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (source, hash, _) = holding(dir.path(), "a", 5);
    let shepherd = peer(2);
    let mut net = Net::new(transfers(store(dir.path(), "node")), vec![(shepherd, Provider::Silent)]);
    let mut first = net.fetch(hash, Duration::from_secs(120));
    net.settle();
    net.providers[0].1 = Provider::Honest(transfers(source));
    // a second asker (the worker's next announcement) names it as the source
    let (tx, mut second) = oneshot::channel();
    net.node.fetch(hash, [shepherd], Duration::from_secs(120), tx, net.now);
    net.settle();
    assert!(outcome(&mut second).is_ok() && outcome(&mut first).is_ok(), "both askers are answered");
}

#[test]
fn downloads_beyond_the_limit_are_refused_and_a_second_asker_waits_for_the_first() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut net = Net::new(transfers(store(dir.path(), "node")), Vec::new());
    let mut waiting = Vec::new();
    for i in 0..MAX_FETCHES {
        waiting.push(net.fetch(BlobHash::of(&i.to_le_bytes()), Duration::from_secs(5)));
    }
    let mut twice = net.fetch(BlobHash::of(&0usize.to_le_bytes()), Duration::from_secs(5));
    let mut over = net.fetch(BlobHash::of(b"one too many"), Duration::from_secs(5));
    net.settle();
    let err = outcome(&mut over).expect_err("busy");
    assert!(matches!(err, FetchError::Busy { max: MAX_FETCHES, .. }), "{err}");
    assert_eq!(net.queries, MAX_FETCHES, "the same blob twice is one download");

    net.wait(Duration::from_secs(5));
    for rx in waiting.iter_mut().chain([&mut twice]) {
        assert!(matches!(outcome(rx), Err(FetchError::TimedOut { .. })));
    }
    // the slots are free again
    let mut next = net.fetch(BlobHash::of(b"one too many"), Duration::from_secs(5));
    net.settle();
    assert!(matches!(next.try_recv(), Err(TryRecvError::Empty)), "under way");
}

#[test]
fn a_release_waits_for_an_answer_in_flight_and_then_the_linger() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (source, hash, data) = holding(dir.path(), "a", 5);
    let mut server = transfers(source.clone());
    let t0 = Instant::now();
    let request = BlobRequest { blob: hash.0, want: BlobWant::Chunk(2) };
    let Serve::Read(read) = server.serve(peer(2), 7, request, t0) else {
        panic!("a chunk is read off the event loop");
    };

    let released = server.release(vec![hash], t0);
    assert_eq!(released, Released { deferred: 1, bytes: SIZE as u64, ..Released::default() });
    assert!(matches!(server.poll(t0, &[]), Some(Action::Unprovide(h)) if h == hash));
    assert!(server.is_deferred(&hash));
    assert_eq!(server.release(vec![hash], t0), Released::default(), "released once");

    // the answer is open for as long as it takes
    let t1 = t0 + Duration::from_secs(60);
    server.housekeeping(t1);
    assert!(source.contains(&hash), "not deleted under a reader");
    let reply = server.served(read.run());
    let BlobReply::Mapped(chunk) = &reply else { panic!("a mapped chunk, got {reply:?}") };
    assert_eq!(chunk.data(), &data[2 * CHUNK_SIZE..]);
    server.responded(7, t1);

    // then it lingers: the peer's next request follows at once
    server.housekeeping(t1 + LINGER - Duration::from_millis(1));
    assert!(source.contains(&hash));
    server.housekeeping(t1 + LINGER);
    assert!(!source.contains(&hash), "deleted once its transfers ended");
    assert!(!server.is_deferred(&hash));
    let mut stats = Stats::default();
    server.count(&mut stats);
    assert_eq!((stats.blobs_removed, stats.chunks_served), (1, 1));
    assert!(stats.bytes_removed > SIZE as u64, "the data and its outboard");

    // a blob nobody reads goes at once; one that is not here is counted absent
    let other = source.put_bytes(b"unread").expect("put");
    let released = server.release(vec![other, BlobHash::of(b"never here")], t1);
    assert_eq!((released.removed, released.absent, released.deferred), (1, 1, 0));
    assert!(released.bytes >= 6);
}

#[test]
fn a_release_is_bounded_in_time_and_called_off_by_a_new_copy() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (source, hash, data) = holding(dir.path(), "a", 6);
    let mut server = transfers(source.clone());
    let t0 = Instant::now();
    let outboard = BlobRequest { blob: hash.0, want: BlobWant::Outboard };
    assert!(matches!(server.serve(peer(2), 1, outboard, t0), Serve::Now(_)));
    server.release(vec![hash], t0);

    // an answer never reported sent holds the blob no longer than MAX_DEFER
    server.housekeeping(t0 + retain::MAX_DEFER - Duration::from_secs(1));
    assert!(source.contains(&hash));
    server.housekeeping(t0 + retain::MAX_DEFER);
    assert!(!source.contains(&hash), "deleted after MAX_DEFER");

    // put again while a release waits: the new copy stays
    source.put_bytes(&data).expect("put");
    let chunk = BlobRequest { blob: hash.0, want: BlobWant::Chunk(0) };
    let t1 = t0 + retain::MAX_DEFER;
    assert!(matches!(server.serve(peer(2), 2, chunk, t1), Serve::Read(_)));
    assert_eq!(server.release(vec![hash], t1).deferred, 1);
    source.put_bytes(&data).expect("put again");
    server.responded(2, t1);
    server.housekeeping(t1 + LINGER);
    assert!(source.contains(&hash), "a copy stored after the release is kept");
    assert!(!server.is_deferred(&hash));
}

#[test]
fn a_blob_released_while_this_node_fetches_it_goes_after_the_fetch() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (source, hash, _) = holding(dir.path(), "a", 7);
    let node_store = store(dir.path(), "node");
    let mut net = Net::new(transfers(node_store.clone()), vec![(peer(2), Provider::Honest(transfers(source)))]);
    let mut rx = net.fetch(hash, Duration::from_secs(60));
    let released = net.node.release(vec![hash], net.now);
    assert_eq!(released, Released { deferred: 1, ..Released::default() }, "the fetch holds it");
    net.settle();

    let report = outcome(&mut rx).expect("the fetch completes");
    assert!(node_store.contains(&hash), "the reader gets it");
    assert_eq!(net.unprovided, vec![hash]);
    assert!(net.provided.is_empty(), "a released blob is not announced");
    assert!(matches!(net.events[..], [Event::BlobFetched { .. }]));

    net.wait(LINGER);
    assert!(!node_store.contains(&hash), "deleted once the fetch and its linger are over");
    assert!(!report.path.exists());
}

#[test]
fn a_blob_already_here_is_answered_at_once_and_its_release_called_off() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (here, hash, _) = holding(dir.path(), "node", 8);
    let mut server = transfers(here.clone());
    let t0 = Instant::now();
    let chunk = BlobRequest { blob: hash.0, want: BlobWant::Chunk(1) };
    let Serve::Read(_read) = server.serve(peer(2), 1, chunk, t0) else { panic!("a read") };
    assert_eq!(server.release(vec![hash], t0).deferred, 1);

    let (tx, mut rx) = oneshot::channel();
    server.fetch(hash, [], Duration::from_secs(1), tx, t0);
    let report = outcome(&mut rx).expect("here");
    assert_eq!((report.bytes, report.providers, report.chunks_fetched), (SIZE as u64, 0, 0));
    assert!(!server.is_deferred(&hash), "the owner wants it again");
    server.housekeeping(t0 + retain::MAX_DEFER);
    assert!(here.contains(&hash));
}
