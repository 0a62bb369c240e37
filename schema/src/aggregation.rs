//! Parameter-shard aggregators on the wire: who sums which shard (in the round
//! announcement), the workers' slices, the aggregators' reports, the shepherd's
//! accepted list, and the aggregators' votes on each shard's update.

use crate::codec::{self, DecodeError, MAX_CONTRIBUTION, MAX_CONTROL_MESSAGE, Message, fixed, list_len, malformed};
use crate::run::ParameterRef;
use crate::wire::pcp_capnp::{
    ShardFailure as WireFailure, accept_entry, accepts, shard_aggregators, shard_vote, slice, slice_report_entry,
    slice_reports,
};

/// Who sums one parameter shard of a round, and the bounds its slices are held to.
#[derive(Debug, Clone, PartialEq)]
pub struct ShardAggregators {
    /// Its replicas' keys, in order: workers upload to the first, which forwards.
    pub replicas: Vec<[u8; 32]>,
    /// The shard's auditor, if one was drawn.
    pub auditor: Option<[u8; 32]>,
    /// The round's per-tensor L2 bounds of the shard's tensors (infinite: none).
    pub tensor_bounds: Vec<f64>,
    /// The round's per-element bounds of the shard's tensors (infinite: none).
    pub element_bounds: Vec<f32>,
}

impl ShardAggregators {
    pub(crate) fn write_list(list: &[Self], mut b: capnp::struct_list::Builder<'_, shard_aggregators::Owned>) {
        for (i, s) in (0..).zip(list) {
            let mut e = b.reborrow().get(i);
            let mut replicas = e.reborrow().init_replicas(list_len(s.replicas.len()));
            for (j, r) in (0..).zip(&s.replicas) {
                replicas.set(j, &r[..]);
            }
            if let Some(a) = &s.auditor {
                e.set_auditor(&a[..]);
            }
            let mut tensor = e.reborrow().init_tensor_bounds(list_len(s.tensor_bounds.len()));
            for (j, b) in (0..).zip(&s.tensor_bounds) {
                tensor.set(j, *b);
            }
            let mut element = e.reborrow().init_element_bounds(list_len(s.element_bounds.len()));
            for (j, b) in (0..).zip(&s.element_bounds) {
                element.set(j, *b);
            }
        }
    }

    pub(crate) fn read_list(
        w: &'static str,
        list: capnp::Result<capnp::struct_list::Reader<'_, shard_aggregators::Owned>>,
    ) -> Result<Vec<Self>, DecodeError> {
        let list = list.map_err(|e| malformed(w, e))?;
        let mut out = Vec::with_capacity(list.len() as usize);
        for e in list.iter() {
            let keys = e.get_replicas().map_err(|e| malformed(w, e))?;
            let mut replicas = Vec::with_capacity(keys.len() as usize);
            for k in keys.iter() {
                replicas.push(fixed(w, "aggregators.replicas", k.map_err(|e| malformed(w, e))?)?);
            }
            let auditor = e.get_auditor().map_err(|e| malformed(w, e))?;
            let auditor = if auditor.is_empty() { None } else { Some(fixed(w, "aggregators.auditor", auditor)?) };
            let tensor_bounds = e.get_tensor_bounds().map_err(|e| malformed(w, e))?.iter().collect();
            let element_bounds = e.get_element_bounds().map_err(|e| malformed(w, e))?.iter().collect();
            out.push(Self { replicas, auditor, tensor_bounds, element_bounds });
        }
        Ok(out)
    }
}

/// A worker's slice of one shard of its contribution.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Slice {
    /// Run id.
    pub run: [u8; 32],
    /// Round number.
    pub round: u64,
    /// The shard.
    pub shard: u32,
    /// The contributing worker's key.
    pub worker: [u8; 32],
    /// The slice, encoded as the run's contributions are.
    pub bytes: Vec<u8>,
}

impl Slice {
    /// The most an encoded slice message carrying `bytes` bytes of slice takes: what
    /// an aggregator reads at most for a shard whose slices are that long. Bytes past
    /// the message's first segment go in a segment of their own, reached through a
    /// far pointer: its landing pad and segment table entry are the 64 bytes kept.
    pub fn encoded_len(bytes: usize) -> usize {
        let empty = Self { run: [1; 32], round: u64::MAX, shard: u32::MAX, worker: [1; 32], bytes: Vec::new() };
        empty.encode().len() + bytes.next_multiple_of(8) + 64
    }
}

impl Message for Slice {
    const NAME: &'static str = "Slice";
    const MAX_SIZE: usize = MAX_CONTRIBUTION;

    fn encode(&self) -> Vec<u8> {
        let mut message = capnp::message::Builder::new_default();
        let mut root = message.init_root::<slice::Builder<'_>>();
        root.set_run(&self.run[..]);
        root.set_round(self.round);
        root.set_shard(self.shard);
        root.set_worker(&self.worker[..]);
        root.set_bytes(&self.bytes);
        codec::words(&message)
    }

    fn decode(bytes: &[u8]) -> Result<Self, DecodeError> {
        const W: &str = Slice::NAME;
        codec::read(W, bytes, Self::MAX_SIZE, |m| {
            let r = m.get_root::<slice::Reader<'_>>().map_err(|e| malformed(W, e))?;
            Ok(Self {
                run: fixed(W, "run", r.get_run().map_err(|e| malformed(W, e))?)?,
                round: r.get_round(),
                shard: r.get_shard(),
                worker: fixed(W, "worker", r.get_worker().map_err(|e| malformed(W, e))?)?,
                bytes: r.get_bytes().map_err(|e| malformed(W, e))?.to_vec(),
            })
        })
    }
}

/// What an aggregator found in one slice.
#[derive(Debug, Clone, PartialEq)]
pub struct SliceReportEntry {
    /// The shard.
    pub shard: u32,
    /// The contributing worker.
    pub worker: [u8; 32],
    /// The slice's hash.
    pub hash: [u8; 32],
    /// Each tensor's raw L2 norm.
    pub norms: Vec<f64>,
    /// Each tensor's largest magnitude.
    pub maxes: Vec<f32>,
    /// The slice's L2 norm once bounded.
    pub bounded_norm: f64,
}

/// An aggregator's reports of slices it holds, in a batch.
#[derive(Debug, Clone, PartialEq)]
pub struct SliceReports {
    /// Run id.
    pub run: [u8; 32],
    /// Round number.
    pub round: u64,
    /// The reports.
    pub reports: Vec<SliceReportEntry>,
}

impl Message for SliceReports {
    const NAME: &'static str = "SliceReports";
    const MAX_SIZE: usize = MAX_CONTROL_MESSAGE;

    fn encode(&self) -> Vec<u8> {
        let mut message = capnp::message::Builder::new_default();
        let mut root = message.init_root::<slice_reports::Builder<'_>>();
        root.set_run(&self.run[..]);
        root.set_round(self.round);
        let mut list = root.init_reports(list_len(self.reports.len()));
        for (i, r) in (0..).zip(&self.reports) {
            write_report(r, list.reborrow().get(i));
        }
        codec::words(&message)
    }

    fn decode(bytes: &[u8]) -> Result<Self, DecodeError> {
        const W: &str = SliceReports::NAME;
        codec::read(W, bytes, Self::MAX_SIZE, |m| {
            let r = m.get_root::<slice_reports::Reader<'_>>().map_err(|e| malformed(W, e))?;
            let list = r.get_reports().map_err(|e| malformed(W, e))?;
            let mut reports = Vec::with_capacity(list.len() as usize);
            for e in list.iter() {
                reports.push(read_report(W, e)?);
            }
            Ok(Self { run: fixed(W, "run", r.get_run().map_err(|e| malformed(W, e))?)?, round: r.get_round(), reports })
        })
    }
}

fn write_report(r: &SliceReportEntry, mut b: slice_report_entry::Builder<'_>) {
    b.set_shard(r.shard);
    b.set_worker(&r.worker[..]);
    b.set_hash(&r.hash[..]);
    let mut norms = b.reborrow().init_norms(list_len(r.norms.len()));
    for (i, v) in (0..).zip(&r.norms) {
        norms.set(i, *v);
    }
    let mut maxes = b.reborrow().init_maxes(list_len(r.maxes.len()));
    for (i, v) in (0..).zip(&r.maxes) {
        maxes.set(i, *v);
    }
    b.set_bounded_norm(r.bounded_norm);
}

fn read_report(w: &'static str, e: slice_report_entry::Reader<'_>) -> Result<SliceReportEntry, DecodeError> {
    let norms = e.get_norms().map_err(|e| malformed(w, e))?.iter().collect::<Vec<_>>();
    let maxes = e.get_maxes().map_err(|e| malformed(w, e))?.iter().collect::<Vec<_>>();
    if norms.len() != maxes.len() {
        let reason = format!("{} norms and {} maxes", norms.len(), maxes.len());
        return Err(DecodeError::Invalid { what: w, field: "reports", reason });
    }
    Ok(SliceReportEntry {
        shard: e.get_shard(),
        worker: fixed(w, "reports.worker", e.get_worker().map_err(|e| malformed(w, e))?)?,
        hash: fixed(w, "reports.hash", e.get_hash().map_err(|e| malformed(w, e))?)?,
        norms,
        maxes,
        bounded_norm: e.get_bounded_norm(),
    })
}

/// One accepted contribution, as an aggregator adds it.
#[derive(Debug, Clone, PartialEq)]
pub struct AcceptEntry {
    /// The worker.
    pub worker: [u8; 32],
    /// Its place in the round's order.
    pub seq: u64,
    /// Its weight.
    pub weight: f64,
    /// Its bounded norm.
    pub norm: f64,
    /// The norm bound in force when it was accepted.
    pub bound: f64,
    /// The slice hashes it committed, for the recipient's shards: (shard, hash).
    pub hashes: Vec<(u32, [u8; 32])>,
}

/// The shepherd's accepted contributions of a round, for one aggregator.
#[derive(Debug, Clone, PartialEq)]
pub struct Accepts {
    /// Run id.
    pub run: [u8; 32],
    /// Round number.
    pub round: u64,
    /// Accepted contributions, in the shepherd's order (a batch of them).
    pub entries: Vec<AcceptEntry>,
    /// Once the round closed: how many it accepted.
    pub closed: Option<u64>,
}

impl Message for Accepts {
    const NAME: &'static str = "Accepts";
    const MAX_SIZE: usize = MAX_CONTROL_MESSAGE;

    fn encode(&self) -> Vec<u8> {
        let mut message = capnp::message::Builder::new_default();
        let mut root = message.init_root::<accepts::Builder<'_>>();
        root.set_run(&self.run[..]);
        root.set_round(self.round);
        if let Some(count) = self.closed {
            root.set_closed(true);
            root.set_count(count);
        }
        let mut list = root.init_entries(list_len(self.entries.len()));
        for (i, a) in (0..).zip(&self.entries) {
            let mut e = list.reborrow().get(i);
            e.set_worker(&a.worker[..]);
            e.set_seq(a.seq);
            e.set_weight(a.weight);
            e.set_norm(a.norm);
            e.set_bound(a.bound);
            let mut hashes = e.init_hashes(list_len(a.hashes.len()));
            for (j, (shard, hash)) in (0..).zip(&a.hashes) {
                let mut h = hashes.reborrow().get(j);
                h.set_shard(*shard);
                h.set_hash(&hash[..]);
            }
        }
        codec::words(&message)
    }

    fn decode(bytes: &[u8]) -> Result<Self, DecodeError> {
        const W: &str = Accepts::NAME;
        codec::read(W, bytes, Self::MAX_SIZE, |m| {
            let r = m.get_root::<accepts::Reader<'_>>().map_err(|e| malformed(W, e))?;
            let list = r.get_entries().map_err(|e| malformed(W, e))?;
            let mut entries = Vec::with_capacity(list.len() as usize);
            for e in list.iter() {
                entries.push(read_accept(W, e)?);
            }
            Ok(Self {
                run: fixed(W, "run", r.get_run().map_err(|e| malformed(W, e))?)?,
                round: r.get_round(),
                entries,
                closed: r.get_closed().then(|| r.get_count()),
            })
        })
    }
}

fn read_accept(w: &'static str, e: accept_entry::Reader<'_>) -> Result<AcceptEntry, DecodeError> {
    let list = e.get_hashes().map_err(|e| malformed(w, e))?;
    let mut hashes = Vec::with_capacity(list.len() as usize);
    for h in list.iter() {
        hashes.push((h.get_shard(), fixed(w, "entries.hashes", h.get_hash().map_err(|e| malformed(w, e))?)?));
    }
    Ok(AcceptEntry {
        worker: fixed(w, "entries.worker", e.get_worker().map_err(|e| malformed(w, e))?)?,
        seq: e.get_seq(),
        weight: e.get_weight(),
        norm: e.get_norm(),
        bound: e.get_bound(),
        hashes,
    })
}

/// Why an aggregator could not sum its shard.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShardFailure {
    /// An accepted slice never reached it.
    Missing,
    /// A place in the order was given twice.
    Duplicate,
    /// Places past the round's count were given.
    PastClose,
}

/// An aggregator's signed hash of a shard's update and the blob holding it, or
/// why it could not sum the shard.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardVote {
    /// Run id.
    pub run: [u8; 32],
    /// Round number.
    pub round: u64,
    /// The shard.
    pub shard: u32,
    /// The update's hash, or why there is none.
    pub outcome: Result<([u8; 32], ParameterRef), ShardFailure>,
}

impl Message for ShardVote {
    const NAME: &'static str = "ShardVote";
    const MAX_SIZE: usize = MAX_CONTROL_MESSAGE;

    fn encode(&self) -> Vec<u8> {
        let mut message = capnp::message::Builder::new_default();
        let mut root = message.init_root::<shard_vote::Builder<'_>>();
        root.set_run(&self.run[..]);
        root.set_round(self.round);
        root.set_shard(self.shard);
        match &self.outcome {
            Ok((hash, update)) => {
                root.set_hash(&hash[..]);
                update.write(root.reborrow().init_update());
                root.set_failure(WireFailure::None);
            }
            Err(f) => root.set_failure(match f {
                ShardFailure::Missing => WireFailure::Missing,
                ShardFailure::Duplicate => WireFailure::Duplicate,
                ShardFailure::PastClose => WireFailure::PastClose,
            }),
        }
        codec::words(&message)
    }

    fn decode(bytes: &[u8]) -> Result<Self, DecodeError> {
        const W: &str = ShardVote::NAME;
        codec::read(W, bytes, Self::MAX_SIZE, |m| {
            let r = m.get_root::<shard_vote::Reader<'_>>().map_err(|e| malformed(W, e))?;
            let failure = r.get_failure().map_err(|e| DecodeError::Invalid {
                what: W,
                field: "failure",
                reason: e.to_string(),
            })?;
            let outcome = match failure {
                WireFailure::None => Ok((
                    fixed(W, "hash", r.get_hash().map_err(|e| malformed(W, e))?)?,
                    ParameterRef::read(W, r.get_update().map_err(|e| malformed(W, e))?)?,
                )),
                WireFailure::Missing => Err(ShardFailure::Missing),
                WireFailure::Duplicate => Err(ShardFailure::Duplicate),
                WireFailure::PastClose => Err(ShardFailure::PastClose),
            };
            Ok(Self {
                run: fixed(W, "run", r.get_run().map_err(|e| malformed(W, e))?)?,
                round: r.get_round(),
                shard: r.get_shard(),
                outcome,
            })
        })
    }
}
