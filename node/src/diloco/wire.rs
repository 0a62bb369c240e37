//! What shepherds and workers share: DHT keys, signing with fresh nonces, and the
//! parameter blob format.

use std::ops::Range;
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::Context as _;
use pcp_protocol::diloco::Tensors;
use pcp_protocol::diloco::compress::{self, Encoding};
use pcp_protocol::diloco::fragments;
use pcp_protocol::{Binding, BlobHash, Identity, PublicKey, RunId, Signable};
use pcp_schema::{ParameterRef, RunManifest, SignedEnvelope};

use crate::observe::events::{Event, Events, MessageRejected};

mod learned;

pub(crate) use learned::LearnedRecord;

/// The wire protocol version in `NodeHello`.
pub(crate) const PROTOCOL_VERSION: u32 = 1;

/// Every shepherd provides this DHT key, so that workers without `--run` find runs.
pub(crate) fn runs_key() -> BlobHash {
    BlobHash(*blake3::hash(b"pcp/runs/v1").as_bytes())
}

/// The DHT key a shepherd provides for its run.
pub(crate) fn run_key(run: RunId) -> BlobHash {
    BlobHash(*blake3::keyed_hash(blake3::hash(b"pcp/run-key/v1").as_bytes(), &run.0).as_bytes())
}

/// Wall-clock milliseconds since the Unix epoch.
pub(crate) fn unix_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// Milliseconds on a monotonic clock (since this process first asked): what leases
/// are measured on, so a step of the wall clock never makes one lapse.
pub(crate) fn mono_ms() -> u64 {
    static START: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    // start at one lease's worth so that `now - lease` never saturates oddly
    let start = *START.get_or_init(boot_ms);
    boot_ms().saturating_sub(start) + 1_000_000
}

/// Milliseconds of `CLOCK_BOOTTIME`: monotonic, and counting the time the system
/// was suspended (`Instant`'s clock stops then, so a laptop shepherd that slept
/// through its lease would wake believing it still held it).
#[cfg(target_os = "linux")]
fn boot_ms() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid, writable timespec for the call's duration.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut ts) };
    if rc != 0 {
        return instant_ms();
    }
    (ts.tv_sec as u64).saturating_mul(1_000) + (ts.tv_nsec as u64) / 1_000_000
}

#[cfg(not(target_os = "linux"))]
fn boot_ms() -> u64 {
    instant_ms()
}

/// `Instant`'s milliseconds since first asked (where there is no boot clock).
#[cfg_attr(target_os = "linux", allow(dead_code))]
fn instant_ms() -> u64 {
    static START: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    START.get_or_init(std::time::Instant::now).elapsed().as_millis() as u64
}

/// Signs messages with a nonce that never repeats for this key: a random start,
/// then a counter.
#[derive(Debug)]
pub(crate) struct Signer {
    identity: Identity,
    nonce: u64,
}

impl Signer {
    pub(crate) fn new(identity: Identity) -> Self {
        Self { identity, nonce: rand::random::<u64>() >> 1 }
    }

    pub(crate) fn identity(&self) -> &Identity {
        &self.identity
    }

    /// Seals `message` bound to `run` and `round`.
    pub(crate) fn seal<M: Signable>(&mut self, run: RunId, round: u64, message: &M) -> SignedEnvelope {
        self.nonce = self.nonce.wrapping_add(1);
        pcp_protocol::seal(&self.identity, Binding { run, round, nonce: self.nonce, unix_ms: unix_ms() }, message)
    }
}

/// A key as the peer id it signs for (how events and logs name peers).
pub(crate) fn peer_name(key: &PublicKey) -> String {
    pcp_bootstrap::peer_of(key).map_or_else(|| key.to_string(), |p| p.to_string())
}

/// Records a refused lease (an announcement or heartbeat of `term` from `from`) as
/// a `message_rejected` event of `kind`.
pub(crate) fn lease_rejected(
    events: &Events,
    kind: &str,
    from: &PublicKey,
    term: u64,
    reason: &pcp_protocol::election::Rejection,
) {
    events.emit(Event::MessageRejected(MessageRejected {
        peer: peer_name(from),
        kind: Some(kind.to_owned()),
        term: Some(term),
        reason: reason.to_string(),
    }));
}

/// Element counts of the manifest's tensors, in argument order.
pub(crate) fn sizes(manifest: &RunManifest) -> Vec<usize> {
    manifest.tensors.iter().map(|t| t.shape.iter().product::<u64>() as usize).collect()
}

/// The top-k layout a run's screens upload sparse contributions in
/// (`eval_sparse`): its workers' layout, unless strided (whose entries a round
/// keeps vary) or dense.
pub(crate) fn sparse_screen(encoding: Encoding) -> Option<pcp_graph::SparseScreen> {
    let up = encoding.sparse()?.up;
    (!up.strided).then_some(pcp_graph::SparseScreen { chunk: up.chunk, k: up.k })
}

/// [`sparse_screen`] of a manifest's encoding (none where it does not parse).
pub(crate) fn manifest_sparse_screen(manifest: &RunManifest) -> Option<pcp_graph::SparseScreen> {
    Encoding::parse_spec(&manifest.encoding).ok().and_then(sparse_screen)
}

/// Shapes of the manifest's tensors.
pub(crate) fn shapes(manifest: &RunManifest) -> Vec<Vec<usize>> {
    manifest.tensors.iter().map(|t| t.shape.iter().map(|d| *d as usize).collect()).collect()
}

/// Parameters as a blob: the exact fp32 pseudo-gradient format.
pub(crate) fn params_blob(params: &[Vec<f32>]) -> Vec<u8> {
    let sizes: Vec<usize> = params.iter().map(Vec::len).collect();
    let mut out = Vec::with_capacity(compress::encoded_len(&sizes, Encoding::F32));
    compress::encode_dense_into(params, Encoding::F32, &mut out);
    out
}

/// The references of a round's shard blobs (each shard's tensors as an fp32
/// parameters blob), hashed on `threads` threads (shard k on thread k mod
/// `threads`) and not stored: what the announcement lists (`shard` 1, 2, …; the
/// name says its tensors), in order, before [`put_shards`] writes them. None when
/// one shard holds every tensor (the whole blob is then the shard).
pub(crate) fn shard_refs(params: &[Vec<f32>], shards: &[Range<usize>], threads: usize) -> Vec<ParameterRef> {
    let hashed = on_shards(shards, threads, |k, r| {
        let mut hasher = blake3::Hasher::new();
        write_params(&mut hasher, &params[r.clone()])?;
        Ok(shard_ref(k, r, BlobHash(*hasher.finalize().as_bytes()), params_len(&params[r.clone()])))
    });
    // hashing into memory cannot fail
    hashed.unwrap_or_default()
}

/// The parameters blob's hash ([`params_hash`]) and its shards' references
/// ([`shard_refs`]), hashed at once: the whole blob on a thread of its own while the
/// shards take `threads`.
pub(crate) fn hash_params(params: &Tensors, shards: &[Range<usize>], threads: usize) -> (BlobHash, Vec<ParameterRef>) {
    std::thread::scope(|scope| {
        let whole = scope.spawn(|| params_hash(params));
        let refs = shard_refs(params, shards, threads);
        (whole.join().unwrap_or_else(|e| std::panic::resume_unwind(e)), refs)
    })
}

/// Stores a round's shard blobs, as [`shard_refs`] names them, each encoded straight
/// into the store and hashed once, as it is written, and left to the page cache
/// ([`pcp_bootstrap::Durability::Volatile`]: a resumed shepherd writes its round's
/// shards anew); returns their references.
pub(crate) fn put_shards(
    store: &pcp_bootstrap::BlobStore,
    params: &[Vec<f32>],
    shards: &[Range<usize>],
    threads: usize,
) -> anyhow::Result<Vec<ParameterRef>> {
    on_shards(shards, threads, |k, r| {
        let tensors = &params[r.clone()];
        let size = params_len(tensors);
        let hash = store
            .put_stream_with(size, pcp_bootstrap::Durability::Volatile, &mut |w| write_params(w, tensors))
            .with_context(|| format!("storing parameter shard {}", k + 1))?;
        Ok(shard_ref(k, r, hash, size))
    })
}

/// Shard `k` (tensors `r`) of blob `hash` and `size` bytes, as the announcement names it.
fn shard_ref(k: usize, r: &Range<usize>, hash: BlobHash, size: u64) -> ParameterRef {
    ParameterRef { name: format!("shard:{}-{}", r.start, r.end), shard: k as u32 + 1, blob: hash.0, size }
}

/// `each` of a round's shards (none when one holds every tensor) on `threads`
/// threads, shard k on thread k mod `threads`; the results in shard order.
fn on_shards<F>(shards: &[Range<usize>], threads: usize, each: F) -> anyhow::Result<Vec<ParameterRef>>
where
    F: Fn(usize, &Range<usize>) -> anyhow::Result<ParameterRef> + Sync,
{
    let shards = if shards.len() <= 1 { &[][..] } else { shards };
    let threads = threads.clamp(1, shards.len().max(1));
    if threads == 1 {
        return shards.iter().enumerate().map(|(k, r)| each(k, r)).collect();
    }
    let mut refs: Vec<Option<ParameterRef>> = vec![None; shards.len()];
    std::thread::scope(|scope| -> anyhow::Result<()> {
        let each = &each;
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                scope.spawn(move || (t..shards.len()).step_by(threads).map(|k| Ok((k, each(k, &shards[k])?))).collect())
            })
            .collect();
        for h in handles {
            let done: anyhow::Result<Vec<(usize, ParameterRef)>> =
                h.join().unwrap_or_else(|e| std::panic::resume_unwind(e));
            for (k, r) in done? {
                refs[k] = Some(r);
            }
        }
        Ok(())
    })?;
    Ok(refs.into_iter().flatten().collect())
}

/// The shard ranges of a run: its fragments' tensors, cut at the shard size
/// ([`pcp_protocol::diloco::fragments`]).
pub(crate) fn shard_ranges(manifest: &RunManifest) -> anyhow::Result<Vec<Range<usize>>> {
    let sizes = sizes(manifest);
    let fragments = fragments::split(&sizes, manifest.fragments.max(1) as usize)?;
    Ok(fragments::shards(&sizes, &fragments))
}

/// Reads a parameters blob, checking every tensor's size.
pub(crate) fn read_params(bytes: &[u8], sizes: &[usize]) -> anyhow::Result<Tensors> {
    let (params, encoding) = compress::decode(bytes, sizes).map_err(|e| anyhow::anyhow!("parameters blob: {e}"))?;
    anyhow::ensure!(encoding == Encoding::F32, "parameters blob is {}, expected fp32", encoding.name());
    Ok(params)
}

/// The blake3 of a parameters blob: the `params_hash` in events.
pub(crate) fn params_hash(params: &Tensors) -> BlobHash {
    let mut hasher = blake3::Hasher::new();
    compress::encode_dense_with(params, Encoding::F32, &mut |bytes| {
        hasher.update(bytes);
    });
    BlobHash(*hasher.finalize().as_bytes())
}

/// What a successor resumes from: the leader's state after a completed round.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct LeaderState {
    /// The term of the leader that completed the round.
    pub(crate) term: u64,
    /// Rounds completed, parameters, outer momentum, recent durations (deadlines),
    /// norms (the norm bound), and the live workers' ratings and the references.
    pub(crate) snapshot: pcp_protocol::diloco::shepherd::Snapshot<PublicKey>,
    /// Who contributed to the last completed round.
    pub(crate) contributors: Vec<PublicKey>,
    /// Participants of the last completed round who missed its deadline.
    pub(crate) excluded: Vec<PublicKey>,
}

/// The header of a state blob, in JSON before the tensors.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct StateHeader {
    term: u64,
    completed: u64,
    durations: Vec<u64>,
    norms: Vec<f64>,
    contributors: Vec<String>,
    excluded: Vec<String>,
    /// The live workers' ratings and the references (absent: nothing learned).
    #[serde(default)]
    learned: LearnedRecord,
}

const STATE_MAGIC: &[u8; 8] = b"pcpstat1";
/// A state header's size limit: peers lists of a large run fit easily.
const MAX_STATE_HEADER: usize = 16 << 20;

/// [`state_blob_of`] of an owned state.
#[cfg(test)]
pub(crate) fn state_blob(state: &LeaderState) -> Vec<u8> {
    state_blob_of(&StateParts::of_state(state), &state.contributors, &state.excluded)
}

/// A leader's state by reference: what [`state_blob_of`] writes.
pub(crate) struct StateParts<'a> {
    pub(crate) term: u64,
    pub(crate) completed: u64,
    pub(crate) durations: Vec<u64>,
    pub(crate) norms: Vec<f64>,
    pub(crate) learned: pcp_protocol::diloco::shepherd::Learned<PublicKey>,
    pub(crate) params: &'a [Vec<f32>],
    pub(crate) velocity: &'a [Vec<f32>],
}

impl<'a> StateParts<'a> {
    /// An owned state's parts.
    #[cfg(test)]
    pub(crate) fn of_state(state: &'a LeaderState) -> Self {
        let s = &state.snapshot;
        Self {
            term: state.term,
            completed: s.completed,
            durations: s.durations.clone(),
            norms: s.norms.clone(),
            learned: s.learned.clone(),
            params: &s.params,
            velocity: &s.velocity,
        }
    }

    /// The state of `machine` at `term`, its tensors borrowed.
    pub(crate) fn of(machine: &'a pcp_protocol::diloco::shepherd::Shepherd<PublicKey>, term: u64) -> Self {
        let (durations, norms) = machine.history();
        Self {
            term,
            completed: machine.completed(),
            durations,
            norms,
            learned: machine.learned(),
            params: machine.params(),
            velocity: machine.velocity(),
        }
    }
}

/// Writes `tensors` as an fp32 parameters blob to `w`.
fn write_params(w: &mut dyn std::io::Write, tensors: &[Vec<f32>]) -> std::io::Result<()> {
    let mut failed = Ok(());
    compress::encode_dense_with(tensors, Encoding::F32, &mut |bytes| {
        if failed.is_ok() {
            failed = w.write_all(bytes);
        }
    });
    failed
}

/// The byte length of `tensors`' fp32 parameters blob.
pub(crate) fn params_len(tensors: &[Vec<f32>]) -> u64 {
    compress::encoded_len(&tensors.iter().map(Vec::len).collect::<Vec<_>>(), Encoding::F32) as u64
}

/// Stores `params` as a parameters blob, written as it is encoded (no copy of the
/// Fetches blob `hash` (from `from` first) within `timeout`, and reads it if it
/// is at most `max` bytes: a peer's blob of a known bound (a slice, a shard's
/// mean) is never read whole past it.
pub(crate) async fn fetch_bounded(
    node: &pcp_bootstrap::Node,
    hash: BlobHash,
    from: Vec<pcp_bootstrap::PeerId>,
    bound: (std::time::Duration, u64),
) -> Result<Vec<u8>, String> {
    fetch_bounded_report(node, hash, from, bound).await.0
}

/// [`fetch_bounded`], and whether the blob came over the network (`false`: this
/// node held it already, or the fetch failed), so that a caller reading a blob
/// only once can release it.
pub(crate) async fn fetch_bounded_report(
    node: &pcp_bootstrap::Node,
    hash: BlobHash,
    from: Vec<pcp_bootstrap::PeerId>,
    (timeout, max): (std::time::Duration, u64),
) -> (Result<Vec<u8>, String>, bool) {
    let report = match node.fetch_from(hash, from, timeout).await {
        Ok(report) => report,
        Err(e) => return (Err(format!("fetching blob {hash}: {e}")), false),
    };
    let read = || {
        let len = std::fs::metadata(&report.path).map_err(|e| format!("reading {}: {e}", report.path.display()))?.len();
        if len > max {
            return Err(format!("blob {hash} is {len} bytes, more than the {max} it may be"));
        }
        std::fs::read(&report.path).map_err(|e| format!("reading {}: {e}", report.path.display()))
    };
    (read(), report.providers > 0)
}

/// model in memory); returns its content id and size.
pub(crate) fn put_params(store: &pcp_bootstrap::BlobStore, params: &[Vec<f32>]) -> anyhow::Result<(BlobHash, u64)> {
    let size = params_len(params);
    let hash = store.put_stream(size, &mut |w| write_params(w, params))?;
    Ok((hash, size))
}

/// Stores the state blob of [`state_blob_of`], written as it is encoded; returns its
/// content id and size.
pub(crate) fn put_state(
    store: &pcp_bootstrap::BlobStore,
    state: &StateParts<'_>,
    contributors: &[PublicKey],
    excluded: &[PublicKey],
) -> anyhow::Result<(BlobHash, u64)> {
    let header = state_header(state, contributors, excluded);
    let size = (STATE_MAGIC.len() + 4 + header.len()) as u64 + params_len(state.params) + params_len(state.velocity);
    let hash = store.put_stream(size, &mut |w| {
        w.write_all(STATE_MAGIC)?;
        w.write_all(&(header.len() as u32).to_le_bytes())?;
        w.write_all(&header)?;
        write_params(w, state.params)?;
        write_params(w, state.velocity)
    })?;
    Ok((hash, size))
}

fn state_header(state: &StateParts<'_>, contributors: &[PublicKey], excluded: &[PublicKey]) -> Vec<u8> {
    let header = StateHeader {
        term: state.term,
        completed: state.completed,
        durations: state.durations.clone(),
        norms: state.norms.clone(),
        contributors: contributors.iter().map(|k| hex::encode(k.0)).collect(),
        excluded: excluded.iter().map(|k| hex::encode(k.0)).collect(),
        learned: LearnedRecord::of(&state.learned),
    };
    serde_json::to_vec(&header).unwrap_or_default()
}

/// A state blob: magic, the JSON header's length (u32 LE) and header, then the
/// parameters and the outer momentum as parameter blobs of equal size; written
/// once into a buffer of its exact size (gpt2-124m's is a GB: no copy of the
/// tensors besides the blob itself).
#[cfg(test)]
pub(crate) fn state_blob_of(state: &StateParts<'_>, contributors: &[PublicKey], excluded: &[PublicKey]) -> Vec<u8> {
    let header = state_header(state, contributors, excluded);
    let sizes = |t: &[Vec<f32>]| t.iter().map(Vec::len).collect::<Vec<_>>();
    let tensors = compress::encoded_len(&sizes(state.params), Encoding::F32)
        + compress::encoded_len(&sizes(state.velocity), Encoding::F32);
    let mut out = Vec::with_capacity(STATE_MAGIC.len() + 4 + header.len() + tensors);
    out.extend_from_slice(STATE_MAGIC);
    out.extend_from_slice(&(header.len() as u32).to_le_bytes());
    out.extend_from_slice(&header);
    compress::encode_dense_into(state.params, Encoding::F32, &mut out);
    compress::encode_dense_into(state.velocity, Encoding::F32, &mut out);
    out
}

/// Reads a state blob, checking its header and every tensor's size.
pub(crate) fn read_state(bytes: &[u8], sizes: &[usize]) -> anyhow::Result<LeaderState> {
    let rest = bytes.strip_prefix(STATE_MAGIC).ok_or_else(|| anyhow::anyhow!("state blob: bad magic"))?;
    anyhow::ensure!(rest.len() >= 4, "state blob: truncated header length");
    let (len, rest) = rest.split_at(4);
    let len = u32::from_le_bytes([len[0], len[1], len[2], len[3]]) as usize;
    anyhow::ensure!(len <= MAX_STATE_HEADER && len <= rest.len(), "state blob: header of {len} bytes");
    let (header, tensors) = rest.split_at(len);
    let header: StateHeader = serde_json::from_slice(header).map_err(|e| anyhow::anyhow!("state blob header: {e}"))?;
    anyhow::ensure!(tensors.len() % 2 == 0, "state blob: odd tensor bytes");
    let (params, velocity) = tensors.split_at(tensors.len() / 2);
    let keys = |list: &[String]| -> anyhow::Result<Vec<PublicKey>> {
        list.iter()
            .map(|k| {
                let bytes: [u8; 32] = hex::decode(k)
                    .ok()
                    .and_then(|b| b.try_into().ok())
                    .ok_or_else(|| anyhow::anyhow!("state blob: bad key {k:?}"))?;
                Ok(PublicKey(bytes))
            })
            .collect()
    };
    Ok(LeaderState {
        term: header.term,
        snapshot: pcp_protocol::diloco::shepherd::Snapshot {
            completed: header.completed,
            params: read_params(params, sizes)?,
            velocity: read_params(velocity, sizes)?,
            durations: header.durations,
            norms: header.norms,
            learned: header.learned.read(sizes.len()).map_err(|e| anyhow::anyhow!("state blob: {e}"))?,
        },
        contributors: keys(&header.contributors)?,
        excluded: keys(&header.excluded)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn params_blob_round_trips_and_checks_sizes() {
        let params = vec![vec![1.0, -2.5], vec![3.0]];
        let blob = params_blob(&params);
        assert_eq!(read_params(&blob, &[2, 1]).ok(), Some(params.clone()));
        assert!(read_params(&blob, &[2, 2]).is_err());
        assert!(read_params(&blob[..blob.len() - 1], &[2, 1]).is_err());
        assert_eq!(params_hash(&params), BlobHash(*blake3::hash(&blob).as_bytes()));
    }

    #[test]
    fn shards_are_stored_once_in_order_whatever_the_threads() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = pcp_bootstrap::BlobStore::open(dir.path()).expect("store");
        let params: Tensors = (0..7).map(|t| (0..(t * 13 + 1)).map(|i| (i * t) as f32 * 0.5).collect()).collect();
        let shards = [0..2, 2..3, 3..6, 6..7];
        let one = put_shards(&store, &params, &shards, 1).expect("stored");
        assert_eq!(one.len(), 4);
        for (k, (r, range)) in one.iter().zip(&shards).enumerate() {
            assert_eq!(
                (r.shard, r.name.as_str()),
                (k as u32 + 1, format!("shard:{}-{}", range.start, range.end).as_str())
            );
            let bytes = std::fs::read(store.path(&BlobHash(r.blob))).expect("the shard's blob");
            assert_eq!(BlobHash(r.blob), BlobHash(*blake3::hash(&bytes).as_bytes()));
            let sizes: Vec<usize> = params[range.clone()].iter().map(Vec::len).collect();
            assert_eq!(read_params(&bytes, &sizes).ok().as_deref(), Some(&params[range.clone()]));
        }
        for threads in [1, 2, 3, 8] {
            assert_eq!(put_shards(&store, &params, &shards, threads).expect("stored"), one, "{threads} threads");
            // what the announcement names before they are written
            assert_eq!(shard_refs(&params, &shards, threads), one, "{threads} threads");
            // and with the whole blob's hash, hashed beside them
            let whole = BlobHash(*blake3::hash(&params_blob(&params)).as_bytes());
            assert_eq!(hash_params(&params, &shards, threads), (whole, one.clone()), "{threads} threads");
        }
        // one shard: the whole blob is the shard, and none is stored apart
        assert!(put_shards(&store, &params, std::slice::from_ref(&(0..7)), 2).expect("nothing").is_empty());
        assert!(shard_refs(&params, std::slice::from_ref(&(0..7)), 2).is_empty());
    }

    #[test]
    fn state_blobs_round_trip_and_refuse_damage() {
        let state = LeaderState {
            term: 2,
            snapshot: pcp_protocol::diloco::shepherd::Snapshot {
                completed: 3,
                params: vec![vec![1.0, 2.0], vec![3.0]],
                velocity: vec![vec![-1.0, 0.5], vec![0.25]],
                durations: vec![1000, 2000],
                norms: vec![0.5],
                learned: pcp_protocol::diloco::shepherd::Learned {
                    ratings: vec![(
                        PublicKey([1; 32]),
                        pcp_protocol::diloco::rating::Rating {
                            passed: 2,
                            score: 0.25,
                            since: 1,
                            caught: 1,
                            sits_out_until: 5,
                        },
                    )],
                    earned: vec![(PublicKey([1; 32]), 20.0)],
                    tensors: vec![Some((0.5, 0.25)), None],
                    step_ms: Some(40.0),
                    rated_norms: true,
                },
            },
            contributors: vec![PublicKey([1; 32])],
            excluded: vec![PublicKey([2; 32])],
        };
        let blob = state_blob(&state);
        assert_eq!(read_state(&blob, &[2, 1]).ok(), Some(state.clone()));
        // streamed into a store, it is the same blob
        let dir = tempfile::tempdir().expect("tempdir");
        let store = pcp_bootstrap::BlobStore::open(dir.path()).expect("a store");
        let s = &state.snapshot;
        let parts = StateParts::of_state(&state);
        let (hash, size) = put_state(&store, &parts, &state.contributors, &state.excluded).expect("stored");
        assert_eq!((hash, size), (BlobHash::of(&blob), blob.len() as u64));
        let (hash, size) = put_params(&store, &s.params).expect("stored");
        assert_eq!((hash, size as usize), (params_hash(&s.params), params_blob(&s.params).len()));
        assert!(read_state(&blob, &[2, 2]).is_err(), "other shapes");
        assert!(read_state(&blob[..blob.len() - 4], &[2, 1]).is_err(), "truncated");
        assert!(read_state(&blob[1..], &[2, 1]).is_err(), "no magic");
        let mut huge = blob.clone();
        huge[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(read_state(&huge, &[2, 1]).is_err(), "a header longer than the blob");
        // a header whose ratings name a bad key is refused, naming it
        let len = u32::from_le_bytes([blob[8], blob[9], blob[10], blob[11]]) as usize;
        let mut header: serde_json::Value = serde_json::from_slice(&blob[12..12 + len]).expect("json");
        header["learned"]["ratings"][0][0] = "00ff".into();
        let header = serde_json::to_vec(&header).expect("json");
        let mut hostile = STATE_MAGIC.to_vec();
        hostile.extend_from_slice(&(header.len() as u32).to_le_bytes());
        hostile.extend_from_slice(&header);
        hostile.extend_from_slice(&blob[12 + len..]);
        let e = read_state(&hostile, &[2, 1]).expect_err("refused").to_string();
        assert!(e.contains("ratings: bad key \"00ff\""), "{e}");
    }

    #[test]
    fn nonces_never_repeat() {
        let mut signer = Signer::new(Identity::from_secret([3; 32]));
        let run = RunId([1; 32]);
        let hb = pcp_schema::Heartbeat::new(run.0, 0, 0);
        let a = signer.seal(run, 0, &hb);
        let b = signer.seal(run, 0, &hb);
        assert_ne!(a.header.nonce, b.header.nonce);
        assert_ne!(run_key(run), runs_key());
    }
}
