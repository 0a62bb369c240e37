//! The shepherd's side of an aggregated round (sans IO): the workers' slice
//! commitments, the replicas' reports of each slice, the accepted list it
//! numbers, and the votes on each shard's update.
//!
//! * A worker's signed contribution carries one slice hash a shard
//!   ([`Collect::commit`]); its tensors go to the aggregators.
//! * Each replica of a shard reports each slice it holds: the slice's hash,
//!   each tensor's raw statistics and its bounded norm ([`Collect::report`]).
//!   A report for a hash other than the committed one is refused. Once every
//!   replica of every shard has reported the same thing, the contribution is
//!   [`Reported::Ready`]: its bounded norm ([`super::contribution_norm`]) and the
//!   whole model's raw statistics, which the shepherd uses as it would its own
//!   decode (acceptance, the norm bound, the references). Replicas that
//!   disagree make it [`Reported::Disputed`]: the shepherd inspects that slice
//!   itself ([`super::inspect`]) and [`Collect::settle`]s it, and the replicas
//!   whose report differs are liars.
//! * [`Collect::accept`] numbers what the shepherd accepts, in order: the
//!   [`Accept`]s every aggregator adds in.
//! * [`Collect::vote`] counts each shard's signed update hashes ([`Votes`]).
//!
//! Memory is bounded by the round's participants: one commitment and one
//! report a replica and shard each.

use std::collections::BTreeMap;
use std::ops::Range;

use super::{Accept, Assignment, Outcome, Refused, SliceReport, Votes, contribution_norm};

/// Why the shepherd did not take a commitment, report or vote.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CollectError {
    /// A commitment with another number of hashes than the round has shards.
    #[error("{got} slice hashes for a round of {shards} shards")]
    Shards {
        /// Hashes given.
        got: usize,
        /// Shards in the round.
        shards: usize,
    },
    /// A second commitment from the same worker.
    #[error("the worker committed its slices already")]
    Committed,
    /// More workers than the round's participants.
    #[error("{max} workers committed already")]
    Full {
        /// The most taken.
        max: usize,
    },
    /// A report from a node that is not one of the shard's replicas.
    #[error("not an aggregator of shard {shard}")]
    NotReplica {
        /// The shard.
        shard: usize,
    },
    /// A report of a worker that committed nothing (yet).
    #[error("no commitment from that worker")]
    NoCommitment,
    /// A report of another slice than the worker committed.
    #[error("shard {shard}: a report of another slice than the worker committed")]
    WrongSlice {
        /// The shard.
        shard: usize,
    },
    /// A second report of the same slice from the same replica.
    #[error("shard {shard}: reported already")]
    Reported {
        /// The shard.
        shard: usize,
    },
    /// A report whose statistics do not fit the shard's tensors.
    #[error("shard {shard}: {got} tensors reported, the shard has {want}")]
    Tensors {
        /// The shard.
        shard: usize,
        /// Tensors reported.
        got: usize,
        /// Tensors in the shard.
        want: usize,
    },
    /// An accept of a contribution that is not ready, or accepted already.
    #[error("the contribution is not ready to accept")]
    NotReady,
    /// A vote that was not counted.
    #[error("shard {shard}: {refused}")]
    Vote {
        /// The shard.
        shard: usize,
        /// Why.
        refused: Refused,
    },
}

/// What a report made of its contribution.
#[derive(Clone, Debug, PartialEq)]
pub enum Reported {
    /// Reports are still missing.
    Waiting,
    /// Every replica of every shard reported the same: the contribution's bounded
    /// norm and each tensor's raw (norm, largest magnitude), for the whole model.
    Ready {
        /// The bounded norm.
        norm: f64,
        /// Each tensor's raw statistics, in model order.
        raw: Vec<(f64, f32)>,
    },
    /// The replicas of `shard` reported different things: the shepherd inspects
    /// that slice itself and [`Collect::settle`]s it.
    Disputed {
        /// The shard.
        shard: usize,
    },
}

/// One worker's commitment and the reports of its slices.
#[derive(Debug)]
struct Contribution<P> {
    hashes: Vec<[u8; 32]>,
    /// Each shard's reports, by replica.
    reports: Vec<Vec<(P, SliceReport)>>,
    /// Shards the shepherd settled itself.
    settled: BTreeMap<usize, SliceReport>,
    accepted: bool,
}

/// The shepherd's record of one aggregated round.
#[derive(Debug)]
pub struct Collect<P> {
    assignment: Assignment<P>,
    /// Each shard's tensors.
    tensors: Vec<Range<usize>>,
    contributions: BTreeMap<P, Contribution<P>>,
    /// The accepted, in order.
    accepted: Vec<(P, Accept)>,
    votes: Vec<Votes<P>>,
    max_workers: usize,
}

impl<P: Clone + Ord> Collect<P> {
    /// A round aggregated by `assignment`, shard `s` covering `tensors[s]`, with
    /// `voters[s]` voting on its update (its replicas, and any auditor), for at
    /// most `max_workers` workers.
    pub fn new(assignment: Assignment<P>, tensors: Vec<Range<usize>>, voters: Vec<Vec<P>>, max_workers: usize) -> Self {
        let votes = voters.into_iter().map(Votes::new).collect();
        Self { assignment, tensors, contributions: BTreeMap::new(), accepted: Vec::new(), votes, max_workers }
    }

    /// Shards in the round.
    pub fn shards(&self) -> usize {
        self.assignment.shards()
    }

    /// Takes `worker`'s slice hashes, one a shard.
    pub fn commit(&mut self, worker: P, hashes: Vec<[u8; 32]>) -> Result<(), CollectError> {
        let shards = self.shards();
        if hashes.len() != shards {
            return Err(CollectError::Shards { got: hashes.len(), shards });
        }
        if self.contributions.contains_key(&worker) {
            return Err(CollectError::Committed);
        }
        if self.contributions.len() >= self.max_workers {
            return Err(CollectError::Full { max: self.max_workers });
        }
        let reports = vec![Vec::new(); shards];
        self.contributions.insert(worker, Contribution { hashes, reports, settled: BTreeMap::new(), accepted: false });
        Ok(())
    }

    /// Takes replica `from`'s report of `worker`'s slice of `shard` (hash `hash`).
    pub fn report(
        &mut self,
        from: &P,
        worker: &P,
        shard: usize,
        hash: [u8; 32],
        report: SliceReport,
    ) -> Result<Reported, CollectError> {
        if !self.assignment.replicas(shard).contains(from) {
            return Err(CollectError::NotReplica { shard });
        }
        let want = self.tensors.get(shard).map_or(0, |t| t.len());
        if report.raw.len() != want {
            return Err(CollectError::Tensors { shard, got: report.raw.len(), want });
        }
        let c = self.contributions.get_mut(worker).ok_or(CollectError::NoCommitment)?;
        if c.hashes[shard] != hash {
            return Err(CollectError::WrongSlice { shard });
        }
        let reports = &mut c.reports[shard];
        if reports.iter().any(|(p, _)| p == from) {
            return Err(CollectError::Reported { shard });
        }
        reports.push((from.clone(), report));
        Ok(self.state(worker))
    }

    /// The shepherd's own report of `worker`'s slice of `shard` (inspected
    /// itself after a dispute or a replica's silence); returns the replicas whose
    /// report differs from it, or who did not report.
    pub fn settle(
        &mut self,
        worker: &P,
        shard: usize,
        report: SliceReport,
    ) -> Result<(Vec<P>, Reported), CollectError> {
        let replicas = self.assignment.replicas(shard).to_vec();
        let c = self.contributions.get_mut(worker).ok_or(CollectError::NoCommitment)?;
        let reports = c.reports.get(shard).ok_or(CollectError::NotReplica { shard })?;
        let liars = replicas
            .into_iter()
            .filter(|p| reports.iter().find(|(r, _)| r == p).is_none_or(|(_, got)| *got != report))
            .collect();
        c.settled.insert(shard, report);
        Ok((liars, self.state(worker)))
    }

    /// The replicas that reported `worker`'s slice of `shard` so far.
    pub fn reporters(&self, worker: &P, shard: usize) -> Vec<P> {
        let reports = self.contributions.get(worker).and_then(|c| c.reports.get(shard));
        reports.map_or_else(Vec::new, |r| r.iter().map(|(p, _)| p.clone()).collect())
    }

    /// Where `worker`'s contribution stands.
    pub fn state(&self, worker: &P) -> Reported {
        let Some(c) = self.contributions.get(worker) else { return Reported::Waiting };
        let mut shards = Vec::with_capacity(c.reports.len());
        for (shard, reports) in c.reports.iter().enumerate() {
            if let Some(settled) = c.settled.get(&shard) {
                shards.push(settled);
                continue;
            }
            let Some((_, first)) = reports.first() else { return Reported::Waiting };
            if reports.iter().any(|(_, r)| r != first) {
                return Reported::Disputed { shard };
            }
            if reports.len() < self.assignment.replicas(shard).len() {
                return Reported::Waiting;
            }
            shards.push(first);
        }
        let norm = contribution_norm(shards.iter().copied());
        let raw = shards.iter().flat_map(|r| r.raw.iter().copied()).collect();
        Reported::Ready { norm, raw }
    }

    /// Accepts `worker`'s ready contribution at the next place, with its weight
    /// and the norm bound in force: the [`Accept`] every aggregator adds.
    pub fn accept(&mut self, worker: &P, weight: f64, bound: f64) -> Result<Accept, CollectError> {
        let Reported::Ready { norm, .. } = self.state(worker) else { return Err(CollectError::NotReady) };
        let c = self.contributions.get_mut(worker).ok_or(CollectError::NotReady)?;
        if c.accepted {
            return Err(CollectError::NotReady);
        }
        c.accepted = true;
        let accept = Accept { seq: self.accepted.len() as u64, weight, norm, bound };
        self.accepted.push((worker.clone(), accept));
        Ok(accept)
    }

    /// The accepted, in order, with the slice hash each committed for `shard`.
    pub fn accepted(&self, shard: usize) -> Vec<(P, [u8; 32], Accept)> {
        self.accepted
            .iter()
            .filter_map(|(p, a)| self.contributions.get(p).map(|c| (p.clone(), c.hashes[shard], *a)))
            .collect()
    }

    /// The slice hashes `worker` committed, one a shard.
    pub fn hashes(&self, worker: &P) -> Option<Vec<[u8; 32]>> {
        self.contributions.get(worker).map(|c| c.hashes.clone())
    }

    /// Counts `from`'s signed hash of `shard`'s update.
    pub fn vote(&mut self, from: &P, shard: usize, hash: [u8; 32]) -> Result<(), CollectError> {
        let votes = self.votes.get_mut(shard).ok_or(CollectError::NotReplica { shard })?;
        votes.vote(from, hash).map_err(|refused| CollectError::Vote { shard, refused })
    }

    /// What to do with `shard` ([`Votes::outcome`]).
    pub fn outcome(&self, shard: usize, spot: bool, expired: bool) -> Outcome {
        self.votes.get(shard).map_or(Outcome::Recompute, |v| v.outcome(spot, expired))
    }

    /// The voters of `shard` that lied, given the shepherd's own hash ([`Votes::liars`]).
    pub fn liars(&self, shard: usize, recomputed: &[u8; 32]) -> Vec<P> {
        self.votes.get(shard).map_or_else(Vec::new, |v| v.liars(recomputed))
    }
}

#[cfg(test)]
#[path = "collect/tests.rs"]
mod tests;
