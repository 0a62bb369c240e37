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
    pub(super) snapshot: Snapshot<u32>,
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
    /// Every base released to workers, with the lowest term that released it.
    released: Vec<(Replica, u64)>,
    /// Every state each candidate replicated, until it loses its disk (to say
    /// who held a state (c) finds lost).
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

    /// (c): a leader of `term` (named `name`) released a round opening from `base`
    /// to workers. Released bases lie on one history: each descends from those
    /// released at earlier rounds, and those released at later rounds from it.
    pub(super) fn released(&mut self, reg: &Registry, name: &str, base: &Replica, term: u64) -> Result<(), Broken> {
        for (r, _) in &self.released {
            let (earlier, later) = if r.round <= base.round { (r, base) } else { (base, r) };
            if !reg.descends(id(later), id(earlier)) {
                return Err((
                    Invariant::ReleasedKept,
                    format!(
                        "{} released to workers is changed: {name} (term {term}) released a round from {}",
                        describe(r),
                        describe(base)
                    ),
                ));
            }
        }
        match self.released.iter_mut().find(|(r, _)| id(r) == id(base)) {
            Some((_, t)) => *t = (*t).min(term),
            None => self.released.push((*base, term)),
        }
        Ok(())
    }

    /// (c): a leader (named `name`) completed `state`: every state released to
    /// workers under its term or an earlier one, at its round or before, is in its
    /// history (a leader of an earlier term may be stale, and what it completes is
    /// not released: it needs no such history).
    pub(super) fn completed(
        &mut self,
        reg: &Registry,
        name: &str,
        state: &Replica,
        names: &dyn Fn(usize) -> String,
    ) -> Result<(), Broken> {
        for (r, term) in &self.released {
            if *term <= state.term && r.round <= state.round && !reg.descends(id(state), id(r)) {
                let holders: Vec<String> =
                    self.replicated.iter().filter(|(_, x)| x == r).map(|(c, _)| names(*c)).collect();
                let held = if holders.is_empty() { "no standby".into() } else { holders.join(" ") };
                return Err((
                    Invariant::ReleasedKept,
                    format!(
                        "{} released to workers in term {term} (replicated to {held}) is lost: {name} completed {} \
                         from another history",
                        describe(r),
                        describe(state)
                    ),
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A registry of two histories from the initial state `a0`: `a1`, `a2` and
    /// `b1`, `b2`, each completed in `term`.
    fn forked() -> (Registry, [Replica; 5]) {
        let r = |term, round, p: u8| Replica { term, round, params: [p; 32] };
        let [a0, a1, a2, b1, b2] = [r(1, 0, 0), r(1, 1, 1), r(2, 2, 2), r(3, 1, 11), r(3, 2, 12)];
        let mut reg = Registry::default();
        let snapshot = Snapshot {
            completed: 0,
            params: Vec::new(),
            velocity: Vec::new(),
            durations: Vec::new(),
            norms: Vec::new(),
            learned: Default::default(),
        };
        for (x, parent) in [(a0, None), (a1, Some(a0)), (a2, Some(a1)), (b1, Some(a0)), (b2, Some(b1))] {
            let state =
                State { parent: parent.map(|p| id(&p)), snapshot: snapshot.clone(), contributors: Vec::new(), at: 0 };
            reg.insert(id(&x), state);
        }
        (reg, [a0, a1, a2, b1, b2])
    }

    #[test]
    fn a_released_state_is_in_every_later_leaders_history() {
        let (reg, [_, a1, a2, b1, b2]) = forked();
        let names = |c: usize| format!("c{c}");
        let mut check = Checker::default();
        check.released(&reg, "c0", &a1, 2).expect("the first release");
        assert!(check.completed(&reg, "c0", &a2, &names).is_ok(), "it descends");
        // a deposed leader of term 1 completes a round nobody takes
        let stale = Replica { term: 1, ..b2 };
        assert!(check.completed(&reg, "c1", &stale, &names).is_ok());
        // a leader of a later term loses it
        let (invariant, _) = check.completed(&reg, "c2", &b2, &names).expect_err("lost");
        assert_eq!(invariant, Invariant::ReleasedKept);
        // or releases another history
        let (invariant, _) = check.released(&reg, "c2", &b1, 3).expect_err("changed");
        assert_eq!(invariant, Invariant::ReleasedKept);
        assert!(check.released(&reg, "c2", &a2, 3).is_ok());
    }
}
