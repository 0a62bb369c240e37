//! The states the run produced (a content-addressed store every node fetches
//! from) and the invariants checked against them.

use std::collections::BTreeMap;

use pcp_protocol::diloco::shepherd::Snapshot;
use pcp_protocol::failover::Replica;

use super::Invariant;

/// A state's place in the run: the round it follows and its parameters hash.
pub(super) type StateId = (u64, [u8; 32]);

/// The id of `replica`.
pub(super) fn id(replica: &Replica) -> StateId {
    (replica.round, replica.params)
}

/// A completed round's result.
#[derive(Clone, Debug)]
pub(super) struct State {
    /// The state it was completed from (none for the initial parameters).
    pub(super) parent: Option<StateId>,
    /// What a leader resumes from.
    pub(super) snapshot: Snapshot,
    /// Who contributed to it.
    pub(super) contributors: Vec<u32>,
    /// When it was completed, global ms.
    pub(super) at: u64,
}

/// Every state any leader completed.
#[derive(Clone, Debug, Default)]
pub(super) struct Registry {
    states: BTreeMap<StateId, State>,
}

impl Registry {
    pub(super) fn insert(&mut self, id: StateId, state: State) {
        self.states.entry(id).or_insert(state);
    }

    pub(super) fn get(&self, id: &StateId) -> Option<&State> {
        self.states.get(id)
    }

    /// The parameters hash of `id`'s ancestor after `round` (itself at its own round).
    pub(super) fn ancestor_at(&self, mut id: StateId, round: u64) -> Option<[u8; 32]> {
        while id.0 > round {
            id = self.states.get(&id)?.parent?;
        }
        (id.0 == round).then_some(id.1)
    }

    /// Whether `later` descends from (or is) `earlier`.
    pub(super) fn descends(&self, later: StateId, earlier: StateId) -> bool {
        self.ancestor_at(later, earlier.0) == Some(earlier.1)
    }
}

/// A broken invariant, before it is stamped with the time.
pub(super) type Broken = (Invariant, String);

/// What the invariants remember.
#[derive(Clone, Debug, Default)]
pub(super) struct Checker {
    /// What each worker applied: round → parameters hash.
    applied: BTreeMap<usize, BTreeMap<u64, [u8; 32]>>,
    /// The last round each worker applied.
    last: BTreeMap<usize, u64>,
    /// Every applied state, by round: one history.
    history: BTreeMap<u64, [u8; 32]>,
    /// Every state each candidate replicated, until it loses its disk.
    replicated: Vec<(usize, Replica)>,
}

/// A parameters hash, short.
pub(super) fn short(p: &[u8; 32]) -> String {
    p[..3].iter().map(|b| format!("{b:02x}")).collect()
}

/// `round r (term t, params p)`.
pub(super) fn describe(r: &Replica) -> String {
    format!("round {} of term {} ({})", r.round, r.term, short(&r.params))
}

impl Checker {
    /// (a) and (b): worker `w` (named `name`) applies `state` (it trains the next
    /// round from it).
    pub(super) fn applied(&mut self, reg: &Registry, w: usize, name: &str, state: &Replica) -> Result<(), Broken> {
        let (round, params) = id(state);
        let mine = self.applied.entry(w).or_default();
        if let Some(before) = mine.get(&round)
            && *before != params
        {
            return Err((
                Invariant::OneUpdatePerRound,
                format!(
                    "{name} applied round {round} twice: {} then {} (term {})",
                    short(before),
                    short(&params),
                    state.term
                ),
            ));
        }
        mine.insert(round, params);
        if let Some(last) = self.last.get(&w).copied()
            && round < last
        {
            return Err((
                Invariant::OneHistory,
                format!("{name} moved back: it applied round {last}, then round {round} ({})", short(&params)),
            ));
        }
        self.last.insert(w, round);
        if let Some(other) = self.history.get(&round) {
            if *other != params {
                return Err((
                    Invariant::OneHistory,
                    format!(
                        "{name} applied {}, but round {round} was applied as {} elsewhere",
                        describe(state),
                        short(other)
                    ),
                ));
            }
            return Ok(());
        }
        if let Some((r, p)) = self.history.range(..round).next_back()
            && !reg.descends((round, params), (*r, *p))
        {
            return Err((
                Invariant::OneHistory,
                format!(
                    "{name} applied {}, which does not descend from round {r} ({}) applied before",
                    describe(state),
                    short(p)
                ),
            ));
        }
        if let Some((r, p)) = self.history.range(round + 1..).next()
            && !reg.descends((*r, *p), (round, params))
        {
            return Err((
                Invariant::OneHistory,
                format!(
                    "{name} applied {}, from which round {r} ({}) applied before does not descend",
                    describe(state),
                    short(p)
                ),
            ));
        }
        self.history.insert(round, params);
        Ok(())
    }

    /// Candidate `c` replicated `state` (fetched and checked it).
    pub(super) fn replicated(&mut self, c: usize, state: &Replica) {
        if !self.replicated.contains(&(c, *state)) {
            self.replicated.push((c, *state));
        }
    }

    /// Node `n` lost its disk: what it replicated (a candidate) or applied (a
    /// worker) is gone with it, and it comes back as a new node.
    pub(super) fn forget(&mut self, n: usize) {
        self.replicated.retain(|(c, _)| *c != n);
        self.applied.remove(&n);
        self.last.remove(&n);
    }

    /// (c): the leader of the newest term (named `name`) completed `state`: every
    /// state replicated to a standby (that has not lost its disk since) up to its
    /// round must be in its history, or the run has moved on without it.
    pub(super) fn completed(
        &mut self,
        reg: &Registry,
        name: &str,
        state: &Replica,
        names: &dyn Fn(usize) -> String,
    ) -> Result<(), Broken> {
        for (c, r) in &self.replicated {
            if r.round <= state.round && !reg.descends(id(state), id(r)) {
                return Err((
                    Invariant::ReplicatedKept,
                    format!(
                        "{} replicated to {} is lost: {name} completed {} from another history",
                        describe(r),
                        names(*c),
                        describe(state)
                    ),
                ));
            }
        }
        Ok(())
    }
}
