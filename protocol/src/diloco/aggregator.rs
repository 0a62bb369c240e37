//! An aggregator's side of a round (sans IO): the shards a signed announcement
//! assigned it, the slices workers send it, the shepherd's accepted list, and
//! the shard updates it publishes. The node's driver checks signatures, moves
//! bytes and stores blobs; this machine decides (see [`super::aggregation`] for
//! the rules it carries out).
//!
//! A round, for one of its shards:
//! 1. [`Input::Assigned`]: the shard's tensors, their sizes and the round's
//!    bounds cut to them, the replicas in order and this node's place among them
//!    (a replica, or the shard's auditor).
//! 2. [`Input::Slice`]: a worker's slice, sent to the first replica, which
//!    forwards it to the others ([`Action::Forward`]). The slice is decoded,
//!    validated and bounded at once, and reported to the shepherd with its hash
//!    ([`Action::Report`]): the shepherd compares the hash with the worker's
//!    signed commitment and decides acceptance from the reports. A slice that
//!    does not decode or validate is refused ([`Action::Refuse`]).
//! 3. [`Input::Accepted`]: the shepherd's place for a contribution, with the
//!    slice hash it committed. The slice of that hash is added at that place
//!    ([`ShardSum`]); a slice of another hash (a worker that sent replicas
//!    different slices) is dropped.
//! 4. [`Input::Closed`]: the round's count. Accepted slices that never came (all
//!    of an auditor's) are fetched ([`Action::Fetch`]). Once every place is
//!    added, the shard's update is published and its hash voted
//!    ([`Action::Publish`]); [`Input::GiveUp`] ends the wait ([`Action::Failed`]:
//!    the shepherd recomputes the shard, and this aggregator's silence counts
//!    against it).
//!
//! Memory is bounded: at most `max_slices` slices are held a shard (the
//! round's participants), and a round's shards are forgotten once published,
//! failed, or when a later round is assigned past `keep_rounds`. The bytes of
//! slices not yet accepted are bounded too ([`Aggregator::holding`]): a slice
//! past that budget is inspected and reported as usual, then handed to the
//! driver to keep on disk ([`Action::Spill`]), and read back once the shepherd
//! accepts it ([`Action::Load`], [`Input::Loaded`]). At gpt2-124m's size a
//! shard's slice is about 1.9 MB (sparse k 4, 4 shards), so 1,000 workers'
//! slices held in memory until their accepts came took 3.3–3.5 GiB an
//! aggregator.

use std::collections::BTreeMap;
use std::ops::Range;

use super::aggregate::{Bounds, Delta};
use super::aggregation::{Accept, ShardSum, ShardUpdate, SliceReport, SumError, inspect, slice_hash};
use super::compress::{self, Encoding};

/// Rounds whose shards an aggregator keeps, counting back from the newest assigned.
pub const KEEP_ROUNDS: u64 = 2;

/// This node's part in a shard's sum.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Place {
    /// Replica `j` (0: the one workers upload to, which forwards).
    Replica(usize),
    /// The shard's auditor: it sums the committed slices after the fact, fetched.
    Auditor,
}

/// One shard assigned to this node.
#[derive(Clone, Debug, PartialEq)]
pub struct ShardSpec<P> {
    /// The shard's index in the round's layout.
    pub shard: usize,
    /// The model's tensors it covers.
    pub tensors: Range<usize>,
    /// Their sizes.
    pub sizes: Vec<usize>,
    /// The round's bounds cut to them ([`super::aggregation::shard_bounds`]).
    pub bounds: Bounds,
    /// The shard's replicas, in order.
    pub replicas: Vec<P>,
    /// This node's part.
    pub place: Place,
}

/// What comes in.
#[derive(Clone, Debug)]
pub enum Input<P> {
    /// The round's announcement assigned these shards to this node.
    Assigned {
        /// The round.
        round: u64,
        /// The contributions' encoding.
        encoding: Encoding,
        /// The shards.
        shards: Vec<ShardSpec<P>>,
    },
    /// A worker's slice of shard `shard` (its signature checked by the driver);
    /// `forwarded`: it came from the first replica rather than the worker.
    Slice {
        /// The round.
        round: u64,
        /// The shard.
        shard: usize,
        /// The worker whose contribution it is.
        worker: P,
        /// Its encoded bytes.
        bytes: Vec<u8>,
        /// Whether a replica forwarded it.
        forwarded: bool,
    },
    /// The shepherd accepted `worker`'s contribution at `accept.seq`, having
    /// committed `hash` for this shard's slice.
    Accepted {
        /// The round.
        round: u64,
        /// The shard.
        shard: usize,
        /// The worker.
        worker: P,
        /// The slice hash the worker committed ([`slice_hash`]).
        hash: [u8; 32],
        /// Its place and weights.
        accept: Accept,
    },
    /// The shepherd closed `round` at `count` accepted contributions.
    Closed {
        /// The round.
        round: u64,
        /// Contributions accepted.
        count: u64,
    },
    /// A slice this aggregator spilled ([`Action::Load`]), read back (empty if it
    /// could not be: the committed slice is then fetched from its worker).
    Loaded {
        /// The round.
        round: u64,
        /// The shard.
        shard: usize,
        /// The worker.
        worker: P,
        /// Its bytes.
        bytes: Vec<u8>,
    },
    /// The wait for missing slices of `round` is over.
    GiveUp {
        /// The round.
        round: u64,
    },
}

/// Why a slice was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SliceRefusal {
    /// For a round or shard not assigned to this node (or already finished).
    #[error("shard {shard} of round {round} is not summed here")]
    NotAssigned {
        /// The round.
        round: u64,
        /// The shard.
        shard: usize,
    },
    /// A second, different slice from the same worker.
    #[error("a second slice of shard {shard} from the same worker")]
    Duplicate {
        /// The shard.
        shard: usize,
    },
    /// The shard holds as many slices as the round has participants.
    #[error("shard {shard} holds {max} slices already")]
    Full {
        /// The shard.
        shard: usize,
        /// The most held.
        max: usize,
    },
    /// It does not decode, or does not fit the shard's tensors.
    #[error("shard {shard}: {reason}")]
    Invalid {
        /// The shard.
        shard: usize,
        /// What was wrong.
        reason: String,
    },
}

/// What the driver does.
#[derive(Clone, Debug, PartialEq)]
pub enum Action<P> {
    /// Send the worker's slice to these replicas.
    Forward {
        /// The round.
        round: u64,
        /// The shard.
        shard: usize,
        /// The worker.
        worker: P,
        /// The replicas to send it to.
        to: Vec<P>,
        /// The slice.
        bytes: Vec<u8>,
    },
    /// Tell the shepherd what the slice holds.
    Report {
        /// The round.
        round: u64,
        /// The shard.
        shard: usize,
        /// The worker.
        worker: P,
        /// The slice's hash.
        hash: [u8; 32],
        /// Its statistics and bounded norm.
        report: SliceReport,
    },
    /// Tell the worker (and the shepherd) its slice was refused.
    Refuse {
        /// The round.
        round: u64,
        /// The worker.
        worker: P,
        /// Why.
        reason: SliceRefusal,
    },
    /// Fetch the accepted slice of `hash` (from the worker, or the first replica).
    Fetch {
        /// The round.
        round: u64,
        /// The shard.
        shard: usize,
        /// The worker.
        worker: P,
        /// The committed hash.
        hash: [u8; 32],
    },
    /// Keep this slice, inspected and reported, on disk: holding it would pass
    /// the budget of [`Aggregator::holding`]. The machine asks for it back with
    /// [`Action::Load`] if it is accepted; the driver may delete it once the round
    /// is no longer in [`Aggregator::rounds`].
    Spill {
        /// The round.
        round: u64,
        /// The shard.
        shard: usize,
        /// The worker.
        worker: P,
        /// The slice's hash.
        hash: [u8; 32],
        /// The slice.
        bytes: Vec<u8>,
    },
    /// Read back the slice spilled as `hash` and feed it as [`Input::Loaded`].
    Load {
        /// The round.
        round: u64,
        /// The shard.
        shard: usize,
        /// The worker.
        worker: P,
        /// The slice's hash.
        hash: [u8; 32],
    },
    /// Store the shard's update as a blob and sign its hash for the shepherd.
    Publish {
        /// The round.
        round: u64,
        /// The shard.
        shard: usize,
        /// The update.
        update: ShardUpdate,
    },
    /// The shard could not be summed: the shepherd recomputes it.
    Failed {
        /// The round.
        round: u64,
        /// The shard.
        shard: usize,
        /// Why.
        error: SumError,
    },
}

/// A held slice: its hash, its bounded tensors and its encoded length.
#[derive(Debug)]
struct Held {
    hash: [u8; 32],
    bounded: Delta,
    len: usize,
}

/// One assigned shard's work in one round.
#[derive(Debug)]
struct Work<P> {
    spec: ShardSpec<P>,
    sum: ShardSum,
    /// Slices received and not yet added, by worker.
    held: BTreeMap<P, Held>,
    /// Slices received, reported and spilled ([`Action::Spill`]), by worker: their hashes.
    spilled: BTreeMap<P, [u8; 32]>,
    /// Accepted slices being read back ([`Action::Load`]).
    loading: BTreeMap<P, [u8; 32]>,
    /// Accepted contributions whose slice has not come (or came with another hash).
    waiting: BTreeMap<P, ([u8; 32], Accept)>,
    /// Workers whose slice was added.
    added: Vec<P>,
}

/// One round's shards.
#[derive(Debug)]
struct RoundWork<P> {
    encoding: Encoding,
    shards: BTreeMap<usize, Work<P>>,
    /// The count the shepherd closed at.
    closed: Option<u64>,
}

/// An aggregator.
#[derive(Debug)]
pub struct Aggregator<P> {
    rounds: BTreeMap<u64, RoundWork<P>>,
    /// The most slices held a shard.
    max_slices: usize,
    /// Threads a shard's adds use.
    threads: usize,
    /// The most bytes of slices held in memory, not yet accepted.
    max_held: usize,
    /// The bytes of slices held, not yet accepted.
    held_bytes: usize,
}

impl<P: Clone + Ord> Aggregator<P> {
    /// An aggregator holding at most `max_slices` slices a shard, adding on
    /// `threads` threads, with no budget on their bytes.
    pub fn new(max_slices: usize, threads: usize) -> Self {
        Self {
            rounds: BTreeMap::new(),
            max_slices: max_slices.max(1),
            threads: threads.max(1),
            max_held: usize::MAX,
            held_bytes: 0,
        }
    }

    /// At most `bytes` of slices not yet accepted are held in memory; the rest are
    /// spilled ([`Action::Spill`]).
    pub fn holding(mut self, bytes: usize) -> Self {
        self.max_held = bytes;
        self
    }

    /// The bytes of slices held in memory, not yet accepted.
    pub fn held_bytes(&self) -> usize {
        self.held_bytes
    }

    /// Rounds with shards still being summed.
    pub fn rounds(&self) -> Vec<u64> {
        self.rounds.keys().copied().collect()
    }

    /// Feeds one input; returns what to do.
    pub fn handle(&mut self, input: Input<P>) -> Vec<Action<P>> {
        let mut out = Vec::new();
        match input {
            Input::Assigned { round, encoding, shards } => self.assigned(round, encoding, shards),
            Input::Slice { round, shard, worker, bytes, forwarded } => {
                self.slice(round, shard, worker, bytes, forwarded, &mut out)
            }
            Input::Accepted { round, shard, worker, hash, accept } => {
                self.accepted(round, shard, worker, hash, accept, &mut out)
            }
            Input::Closed { round, count } => {
                if let Some(r) = self.rounds.get_mut(&round) {
                    r.closed = Some(count);
                    // accepted slices that have not come (an auditor's: all of them)
                    for (shard, w) in &r.shards {
                        for (worker, (hash, _)) in w.waiting.iter().filter(|(k, _)| !w.loading.contains_key(*k)) {
                            let (shard, worker, hash) = (*shard, worker.clone(), *hash);
                            out.push(Action::Fetch { round, shard, worker, hash });
                        }
                    }
                    self.finish(round, false, &mut out);
                }
            }
            Input::Loaded { round, shard, worker, bytes } => self.loaded(round, shard, worker, &bytes, &mut out),
            Input::GiveUp { round } => self.finish(round, true, &mut out),
        }
        out
    }

    fn assigned(&mut self, round: u64, encoding: Encoding, shards: Vec<ShardSpec<P>>) {
        let threads = self.threads;
        let work = shards
            .into_iter()
            .map(|spec| {
                let sum = ShardSum::new(round, spec.shard, spec.sizes.clone(), threads);
                let (held, spilled, loading, waiting) = Default::default();
                let w = Work { spec, sum, held, spilled, loading, waiting, added: Vec::new() };
                (w.spec.shard, w)
            })
            .collect();
        if let Some(old) = self.rounds.insert(round, RoundWork { encoding, shards: work, closed: None }) {
            self.held_bytes -= held_in(old.shards.values());
        }
        // rounds older than the last KEEP_ROUNDS go, finished or not
        let first = (round + 1).saturating_sub(KEEP_ROUNDS);
        let kept = self.rounds.split_off(&first);
        let gone = std::mem::replace(&mut self.rounds, kept);
        self.held_bytes -= held_in(gone.values().flat_map(|r| r.shards.values()));
    }

    fn slice(
        &mut self,
        round: u64,
        shard: usize,
        worker: P,
        mut bytes: Vec<u8>,
        forwarded: bool,
        out: &mut Vec<Action<P>>,
    ) {
        let max = self.max_slices;
        let refuse = |reason| Action::Refuse { round, worker: worker.clone(), reason };
        let Some(r) = self.rounds.get_mut(&round) else {
            out.push(refuse(SliceRefusal::NotAssigned { round, shard }));
            return;
        };
        let encoding = r.encoding;
        let Some(w) = r.shards.get_mut(&shard) else {
            out.push(refuse(SliceRefusal::NotAssigned { round, shard }));
            return;
        };
        let hash = slice_hash(&bytes);
        let has = |w: &Work<P>| {
            w.held.get(&worker).map(|h| h.hash).or_else(|| w.spilled.get(&worker).or(w.loading.get(&worker)).copied())
        };
        if w.added.contains(&worker) || has(w) == Some(hash) {
            // a copy of what this aggregator has (a forward and a retry cross): nothing to do
            return;
        }
        let expected = w.waiting.get(&worker).map(|(h, _)| *h);
        if has(w).is_some() && expected != Some(hash) {
            out.push(refuse(SliceRefusal::Duplicate { shard }));
            return;
        }
        if w.held.len() + w.spilled.len() >= max && expected.is_none() {
            out.push(refuse(SliceRefusal::Full { shard, max }));
            return;
        }
        let decoded = compress::decode_delta(&bytes, &w.spec.sizes, encoding)
            .map_err(|e| e.to_string())
            .and_then(|d| inspect(d, &w.spec.sizes, &w.spec.bounds).map_err(|e| e.to_string()));
        let (bounded, report) = match decoded {
            Ok(ok) => ok,
            Err(reason) => {
                out.push(refuse(SliceRefusal::Invalid { shard, reason }));
                return;
            }
        };
        let len = bytes.len();
        let spill = expected.is_none() && self.held_bytes.saturating_add(len) > self.max_held;
        let forward = !forwarded && w.spec.place == Place::Replica(0) && w.spec.replicas.len() > 1;
        if forward {
            let to = w.spec.replicas[1..].to_vec();
            let sent = if spill { bytes.clone() } else { std::mem::take(&mut bytes) };
            out.push(Action::Forward { round, shard, worker: worker.clone(), to, bytes: sent });
        }
        out.push(Action::Report { round, shard, worker: worker.clone(), hash, report });
        if spill {
            // past the budget: kept on disk until it is accepted
            w.spilled.insert(worker.clone(), hash);
            out.push(Action::Spill { round, shard, worker, hash, bytes });
            return;
        }
        w.held.insert(worker.clone(), Held { hash, bounded, len });
        self.held_bytes += len;
        if expected == Some(hash) {
            self.held_bytes -= Self::add(w, &worker, out, round);
        }
        self.finish(round, false, out);
    }

    /// A spilled slice read back: added if it is the accepted one, else fetched
    /// from its worker at the close.
    fn loaded(&mut self, round: u64, shard: usize, worker: P, bytes: &[u8], out: &mut Vec<Action<P>>) {
        let Some(r) = self.rounds.get_mut(&round) else { return };
        let encoding = r.encoding;
        let closed = r.closed.is_some();
        let Some(w) = r.shards.get_mut(&shard) else { return };
        let Some(hash) = w.loading.remove(&worker) else { return };
        let decoded = (slice_hash(bytes) == hash)
            .then(|| compress::decode_delta(bytes, &w.spec.sizes, encoding).ok())
            .flatten()
            .and_then(|d| inspect(d, &w.spec.sizes, &w.spec.bounds).ok());
        match decoded {
            Some((bounded, _)) => {
                w.held.insert(worker.clone(), Held { hash, bounded, len: 0 });
                Self::add(w, &worker, out, round);
            }
            // lost or damaged on disk: the committed slice is fetched from its worker
            None if closed => out.push(Action::Fetch { round, shard, worker, hash }),
            None => {}
        }
        self.finish(round, false, out);
    }

    fn accepted(
        &mut self,
        round: u64,
        shard: usize,
        worker: P,
        hash: [u8; 32],
        accept: Accept,
        out: &mut Vec<Action<P>>,
    ) {
        let Some(w) = self.rounds.get_mut(&round).and_then(|r| r.shards.get_mut(&shard)) else { return };
        if w.added.contains(&worker) || w.waiting.contains_key(&worker) {
            return;
        }
        w.waiting.insert(worker.clone(), (hash, accept));
        match w.held.get(&worker) {
            Some(h) if h.hash == hash => self.held_bytes -= Self::add(w, &worker, out, round),
            // the worker sent this replica another slice than it committed: the
            // committed one is fetched if it has not come by the close
            Some(_) => self.held_bytes -= w.held.remove(&worker).map_or(0, |h| h.len),
            None => match w.spilled.remove(&worker) {
                Some(spilled) if spilled == hash => {
                    w.loading.insert(worker.clone(), hash);
                    out.push(Action::Load { round, shard, worker, hash });
                }
                _ => {}
            },
        }
        self.finish(round, false, out);
    }

    /// Adds `worker`'s held slice at its accepted place; returns the bytes it held.
    fn add(w: &mut Work<P>, worker: &P, out: &mut Vec<Action<P>>, round: u64) -> usize {
        let (Some(held), Some((_, accept))) = (w.held.remove(worker), w.waiting.remove(worker)) else { return 0 };
        match w.sum.accept(accept, held.bounded) {
            Ok(()) => w.added.push(worker.clone()),
            Err(error) => out.push(Action::Failed { round, shard: w.spec.shard, error }),
        }
        held.len
    }

    /// Publishes every shard of `round` whose places are all added once it closed;
    /// `give_up`: the rest fail.
    fn finish(&mut self, round: u64, give_up: bool, out: &mut Vec<Action<P>>) {
        let Some(r) = self.rounds.get_mut(&round) else { return };
        let Some(count) = r.closed else { return };
        let done: Vec<usize> =
            r.shards.iter().filter(|(_, w)| give_up || w.sum.added() >= count).map(|(s, _)| *s).collect();
        for shard in done {
            let Some(w) = r.shards.remove(&shard) else { continue };
            self.held_bytes -= held_in([&w]);
            match w.sum.finish(count) {
                Ok(update) => out.push(Action::Publish { round, shard, update }),
                Err(error) => out.push(Action::Failed { round, shard, error }),
            }
        }
        if r.shards.is_empty() {
            self.rounds.remove(&round);
        }
    }
}

/// The bytes the shards `works` hold in memory, not yet accepted.
fn held_in<'a, P: 'a>(works: impl IntoIterator<Item = &'a Work<P>>) -> usize {
    works.into_iter().flat_map(|w| w.held.values()).map(|h| h.len).sum()
}

#[cfg(test)]
#[path = "aggregator/tests.rs"]
mod tests;
