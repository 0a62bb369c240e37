//! One round's screening by committees, as the shepherd runs it: sans-IO, so the
//! node and the simulator drive the same decisions.
//!
//! * **Assigned on receipt.** A contribution's hash is its commitment: once the
//!   shepherd holds it, the machine draws its committee from the round's secret
//!   seed ([`committee`]) and asks the driver to send it the screen's request
//!   ([`Action::Request`]). With fewer eligible screeners than a majority of
//!   `k` ([`Tally::quorum`] of `k`), the shepherd scores it itself
//!   ([`Action::Score`]).
//! * **A verdict only from agreement.** Once every member has answered, or the
//!   contribution's wait has passed with a quorum of answers, the verdict is the
//!   members' median ([`Tally::verdict`]) if each answer agrees with it within
//!   the devices' noise ([`agrees`]), and the contribution was not drawn for a
//!   spot check ([`spot_checked`]). Otherwise (a disagreement, a spot check, or
//!   no quorum in time) the shepherd scores it itself, and its own losses are
//!   the verdict. A spot check alone the shepherd may waive when its screening
//!   budget is spent ([`Input::Waived`]): the agreeing median decides.
//! * **Liars are caught by the shepherd's own score.** Every member whose
//!   answer disagrees with it is caught ([`Action::Caught`]) and barred from
//!   screening for the rest of the run ([`Screening::barred`]): a lie costs the
//!   liar its role the first time the shepherd looks, and the shepherd looks
//!   whenever a committee disagrees. A member that never answered is named
//!   ([`Action::Silent`]) and not barred: silence makes the shepherd do the
//!   work, it cannot change a verdict.
//!
//! A lying majority of one committee that agrees with itself passes unless the
//! spot check draws it: the spot rate bounds how long such a majority lasts, and
//! committees drawn from rated screeners by a seed nobody knows in advance make
//! a majority of liars on one committee as rare as the liars are among the
//! screeners.

use std::collections::BTreeMap;

use super::{Losses, Refused, Tally, agrees, committee, spot_checked};

/// A contribution's id: the hash it was committed by.
pub type ContributionId = [u8; 32];

/// Contributions a shepherd holds for their verdicts at once, at most: past them
/// (or past [`MAX_DEFERRED_BYTES`]) a contribution goes to the shepherd's own
/// screen and its budget, so that what it holds stays bounded however many
/// arrive at once (pcp-node's `committees.rs`, and the simulator's model of it).
/// A round's contributions arrive together: at 64, 200 synthetic workers whose
/// screeners answer in 200 ms left 40–50 a round to the shepherd's budget, which
/// passed them unscreened (`pcp-node loadtest --screen-ms`); at 1,024, none. An
/// aggregated contribution holds only its requests (its slices stay with its
/// sender), so a round of 10,000 fits: at 1,024, 6,208 of a simulated
/// 10,000-volunteer run's went to the shepherd's own screen. The bytes, not the
/// count, bound the memory.
pub const MAX_DEFERRED: usize = 16_384;

/// The memory contributions held for their verdicts may take at most: each one's
/// decoded delta and its bounded copy (as sparse as it came, scaled or not), and
/// its screen requests in flight (a copy of its bytes and the round's batch for
/// each member), so contributions sent over the bound cannot fill the
/// shepherd's memory.
pub const MAX_DEFERRED_BYTES: usize = 1 << 30;

/// Whether a contribution holding `bytes` may wait for its verdict beside
/// `count` others holding `held` bytes.
pub fn may_defer(count: usize, held: usize, bytes: usize) -> bool {
    count < MAX_DEFERRED && held.saturating_add(bytes) <= MAX_DEFERRED_BYTES
}

/// How a round screens.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Config {
    /// Screeners a committee: `--screeners`.
    pub k: usize,
    /// The share of contributions the shepherd scores itself however its
    /// committee answered.
    pub spot_rate: f64,
    /// How long a committee has to answer, from the request.
    pub wait_ms: u64,
}

/// Who decided a verdict.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// The committee's median, every answer agreeing with it.
    Committee,
    /// The shepherd's own score.
    Shepherd,
}

/// Why the shepherd scores a contribution itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Why {
    /// Too few eligible screeners for a quorum.
    NoCommittee,
    /// The seed drew it for a spot check.
    SpotCheck,
    /// Its committee's answers disagree.
    Disagreement,
    /// No quorum answered within the wait.
    Silence,
}

/// What the driver does next.
#[derive(Clone, Debug, PartialEq)]
pub enum Action<P> {
    /// Ask `screeners` to score the contribution.
    Request { contribution: ContributionId, screeners: Vec<P> },
    /// Score it on the shepherd's own engine and feed [`Input::Scored`].
    Score { contribution: ContributionId, why: Why },
    /// The contribution's losses: pass or refuse it on them.
    Verdict { contribution: ContributionId, losses: Losses, source: Source },
    /// `screener` answered `claimed`, and the shepherd's own score disagrees: it
    /// loses its rating and its screening role.
    Caught { screener: P, contribution: ContributionId, claimed: Losses, checked: Losses },
    /// Members that did not answer in time.
    Silent { contribution: ContributionId, screeners: Vec<P> },
}

/// What the machine is told.
#[derive(Clone, Debug, PartialEq)]
pub enum Input<P> {
    /// The shepherd holds a contribution, sent by `sender`, at `now_ms`.
    Received { contribution: ContributionId, sender: P, now_ms: u64 },
    /// A member's signed answer.
    Reported { contribution: ContributionId, screener: P, losses: Losses },
    /// A member will not answer: its request was refused (a screener takes a few
    /// at once), failed, or was answered with something else. Once every member
    /// answered or declined, or too many declined for a quorum, the committee
    /// settles without waiting out its wait.
    Declined { contribution: ContributionId, screener: P },
    /// The shepherd's own score of a contribution it was asked to score.
    Scored { contribution: ContributionId, losses: Losses },
    /// The shepherd waives a spot check it was asked for (its screening budget is
    /// spent): the committee's agreeing median decides.
    Waived { contribution: ContributionId },
    /// The contribution cannot be screened at all (an aggregated one whose
    /// sender did not serve the shepherd its slices): it is dropped without a
    /// verdict, and no member's answer is held against it.
    Withdrawn { contribution: ContributionId },
    /// The time, for the waits.
    Tick { now_ms: u64 },
}

/// Why an input was not taken.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Ignored {
    /// No such contribution is being screened (never received, or decided).
    #[error("no contribution {0} is being screened")]
    Unknown(String),
    /// It was received already.
    #[error("contribution {0} was received already")]
    Duplicate(String),
    /// The member's answer was not counted.
    #[error("an answer for contribution {id}: {why}")]
    Answer { id: String, why: Refused },
    /// A score the machine did not ask for, or a waiver of a score that is not a
    /// spot check.
    #[error("contribution {0} was not given to the shepherd to score, or not as a spot check")]
    NotAsked(String),
    /// The screener was caught lying: its answers no longer count.
    #[error("an answer for contribution {0} from a screener caught lying")]
    Barred(String),
}

#[derive(Clone, Debug)]
struct Pending<P> {
    tally: Tally<P>,
    due_ms: u64,
    /// Whether the shepherd scores it: the verdict then waits for its score.
    scoring: bool,
    /// Whether that score is a spot check (the committee agreed), which the
    /// shepherd may waive.
    spot: bool,
    /// Members that will not answer.
    declined: Vec<P>,
}

impl<P: AsRef<[u8]> + Clone + PartialEq> Pending<P> {
    /// Whether the committee is done: every member answered or declined, or so
    /// many declined that no quorum can answer.
    fn done(&self) -> bool {
        let members = self.tally.members().len();
        self.tally.answers().len() + self.declined.len() >= members
            || members.saturating_sub(self.declined.len()) < self.tally.quorum()
    }
}

/// One round's screening: its seed, its screeners and its contributions. The
/// verdicts of a round's contributions are independent of the order they
/// arrive in, and of the order of the eligible screeners.
#[derive(Clone, Debug)]
pub struct Screening<P> {
    seed: [u8; 32],
    config: Config,
    eligible: Vec<P>,
    pending: BTreeMap<ContributionId, Pending<P>>,
    barred: Vec<P>,
}

fn short(id: &ContributionId) -> String {
    id[..4].iter().map(|b| format!("{b:02x}")).collect()
}

impl<P: AsRef<[u8]> + Clone + PartialEq> Screening<P> {
    /// A round screened with `seed` (its secret, revealed with the next round) by
    /// `eligible` screeners ([`super::eligible`]), less any in `barred`.
    pub fn new(seed: [u8; 32], config: Config, eligible: Vec<P>, barred: Vec<P>) -> Self {
        let eligible = eligible.into_iter().filter(|p| !barred.contains(p)).collect();
        Self { seed, config, eligible, pending: BTreeMap::new(), barred }
    }

    /// The screeners caught so far, those this round started with included: the
    /// next round's machine takes them.
    pub fn barred(&self) -> &[P] {
        &self.barred
    }

    /// `screener` may screen this round's later contributions (its own is
    /// committed, so a batch it sees can no longer shape it); a barred or enlisted
    /// one is left as it is.
    pub fn enlist(&mut self, screener: P) {
        if !self.barred.contains(&screener) && !self.eligible.contains(&screener) {
            self.eligible.push(screener);
        }
    }

    /// The screeners a contribution may draw now.
    pub fn eligible(&self) -> &[P] {
        &self.eligible
    }

    /// Contributions awaiting a verdict.
    pub fn pending(&self) -> usize {
        self.pending.len()
    }

    /// The committee of a contribution being screened.
    pub fn members(&self, contribution: &ContributionId) -> Option<&[P]> {
        self.pending.get(contribution).map(|p| p.tally.members())
    }

    /// Feeds `input`; returns what to do, in order.
    pub fn on(&mut self, input: Input<P>) -> Result<Vec<Action<P>>, Ignored> {
        match input {
            Input::Received { contribution, sender, now_ms } => self.received(contribution, &sender, now_ms),
            Input::Reported { contribution, screener, losses } => {
                if self.barred.contains(&screener) {
                    return Err(Ignored::Barred(short(&contribution)));
                }
                let pending = self.pending.get_mut(&contribution).ok_or(Ignored::Unknown(short(&contribution)))?;
                pending
                    .tally
                    .answer(&screener, losses)
                    .map_err(|why| Ignored::Answer { id: short(&contribution), why })?;
                Ok(if pending.done() && !pending.scoring { self.settle(contribution) } else { Vec::new() })
            }
            Input::Declined { contribution, screener } => {
                let pending = self.pending.get_mut(&contribution).ok_or(Ignored::Unknown(short(&contribution)))?;
                let member = pending.tally.members().contains(&screener);
                let answered = pending.tally.answers().iter().any(|(a, _)| *a == screener);
                if !member || answered || pending.declined.contains(&screener) {
                    return Ok(Vec::new());
                }
                pending.declined.push(screener);
                Ok(if pending.done() && !pending.scoring { self.settle(contribution) } else { Vec::new() })
            }
            Input::Scored { contribution, losses } => self.scored(contribution, losses),
            Input::Waived { contribution } => self.waived(contribution),
            Input::Withdrawn { contribution } => {
                self.pending.remove(&contribution).ok_or(Ignored::Unknown(short(&contribution)))?;
                Ok(Vec::new())
            }
            Input::Tick { now_ms } => {
                let due: Vec<ContributionId> =
                    self.pending.iter().filter(|(_, p)| !p.scoring && p.due_ms <= now_ms).map(|(id, _)| *id).collect();
                Ok(due.into_iter().flat_map(|id| self.settle(id)).collect())
            }
        }
    }

    fn received(&mut self, contribution: ContributionId, sender: &P, now_ms: u64) -> Result<Vec<Action<P>>, Ignored> {
        if self.pending.contains_key(&contribution) {
            return Err(Ignored::Duplicate(short(&contribution)));
        }
        let members = committee(&self.seed, &contribution, sender, &self.eligible, self.config.k);
        let enough = self.config.k > 0 && members.len() > self.config.k / 2;
        let due_ms = now_ms.saturating_add(self.config.wait_ms);
        if !enough {
            let pending =
                Pending { tally: Tally::new(Vec::new()), due_ms, scoring: true, spot: false, declined: Vec::new() };
            self.pending.insert(contribution, pending);
            return Ok(vec![Action::Score { contribution, why: Why::NoCommittee }]);
        }
        let pending =
            Pending { tally: Tally::new(members.clone()), due_ms, scoring: false, spot: false, declined: Vec::new() };
        self.pending.insert(contribution, pending);
        Ok(vec![Action::Request { contribution, screeners: members }])
    }

    /// A committee is done answering (all of it, or its wait passed): its verdict,
    /// or the shepherd's score.
    fn settle(&mut self, contribution: ContributionId) -> Vec<Action<P>> {
        let Some(pending) = self.pending.get_mut(&contribution) else { return Vec::new() };
        let mut actions = Vec::new();
        let silent: Vec<P> = pending
            .tally
            .members()
            .iter()
            .filter(|m| !pending.tally.answers().iter().any(|(a, _)| a == *m))
            .cloned()
            .collect();
        if !silent.is_empty() {
            actions.push(Action::Silent { contribution, screeners: silent });
        }
        let why = match pending.tally.verdict() {
            None => Why::Silence,
            Some(median) if !pending.tally.answers().iter().all(|(_, l)| agrees(l, &median)) => Why::Disagreement,
            Some(_) if spot_checked(&self.seed, &contribution, self.config.spot_rate) => Why::SpotCheck,
            Some(median) => {
                self.pending.remove(&contribution);
                actions.push(Action::Verdict { contribution, losses: median, source: Source::Committee });
                return actions;
            }
        };
        pending.scoring = true;
        pending.spot = why == Why::SpotCheck;
        actions.push(Action::Score { contribution, why });
        actions
    }

    fn waived(&mut self, contribution: ContributionId) -> Result<Vec<Action<P>>, Ignored> {
        match self.pending.get(&contribution) {
            None => return Err(Ignored::Unknown(short(&contribution))),
            Some(p) if !p.spot => return Err(Ignored::NotAsked(short(&contribution))),
            Some(_) => {}
        }
        let Some(median) = self.pending.remove(&contribution).and_then(|p| p.tally.verdict()) else {
            return Ok(Vec::new());
        };
        Ok(vec![Action::Verdict { contribution, losses: median, source: Source::Committee }])
    }

    fn scored(&mut self, contribution: ContributionId, checked: Losses) -> Result<Vec<Action<P>>, Ignored> {
        match self.pending.get(&contribution) {
            None => return Err(Ignored::Unknown(short(&contribution))),
            Some(p) if !p.scoring => return Err(Ignored::NotAsked(short(&contribution))),
            Some(_) => {}
        }
        let Some(pending) = self.pending.remove(&contribution) else { return Ok(Vec::new()) };
        let mut actions = Vec::new();
        for (screener, claimed) in pending.tally.answers() {
            if !agrees(claimed, &checked) {
                if !self.barred.contains(screener) {
                    self.barred.push(screener.clone());
                }
                self.eligible.retain(|p| p != screener);
                actions.push(Action::Caught { screener: screener.clone(), contribution, claimed: *claimed, checked });
            }
        }
        actions.push(Action::Verdict { contribution, losses: checked, source: Source::Shepherd });
        Ok(actions)
    }
}

#[cfg(test)]
mod tests;
