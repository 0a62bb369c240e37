//! The worker's state machine: fetch the round's parameters, run τ inner
//! steps, send the pseudo-gradient. Optimizer state lives in the host's
//! training engine and persists across rounds; only parameters are reset to
//! the shepherd's at the start of each round.

use super::data_seed;

/// Where the worker is in a round.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Waiting for a round.
    Idle,
    /// Fetching the round's parameters.
    Fetching(u64),
    /// Running inner steps.
    Training(u64),
    /// Sending the pseudo-gradient.
    Sending(u64),
}

/// What happens to the worker.
#[derive(Clone, Debug, PartialEq)]
pub enum Input {
    /// The shepherd opened `round`; `participant` says whether we are in it.
    RoundOpened {
        /// The round.
        round: u64,
        /// Unix milliseconds.
        deadline_ms: u64,
        /// Whether this worker was included.
        participant: bool,
    },
    /// The round's parameters are loaded.
    ParamsReady(u64),
    /// τ inner steps finished.
    Trained(u64),
    /// The contribution was delivered.
    Sent(u64),
    /// Something failed for `round`; wait for the next one.
    Failed(u64),
    /// Time passed.
    Tick,
}

/// What the worker asks its host to do.
#[derive(Clone, Debug, PartialEq)]
pub enum Action {
    /// Fetch and load the parameters of `round`.
    FetchParams(u64),
    /// Run `steps` inner steps on data ordered by `seed`.
    Train {
        /// The round.
        round: u64,
        /// τ.
        steps: u64,
        /// This worker's data seed for the round.
        seed: u64,
    },
    /// Send θ_start − θ_end for `round`.
    Send(u64),
    /// Drop the work of `round` (its deadline passed or a newer round opened).
    Abandon(u64),
}

/// The worker.
#[derive(Clone, Debug)]
pub struct Worker {
    peer: Vec<u8>,
    run_seed: u64,
    tau: u64,
    phase: Phase,
    deadline_ms: u64,
}

impl Worker {
    /// A worker identified by `peer` bytes in a run with `run_seed` and τ.
    pub fn new(peer: Vec<u8>, run_seed: u64, tau: u64) -> Self {
        Self { peer, run_seed, tau, phase: Phase::Idle, deadline_ms: u64::MAX }
    }

    /// The current phase.
    pub fn phase(&self) -> Phase {
        self.phase
    }

    fn round(&self) -> Option<u64> {
        match self.phase {
            Phase::Idle => None,
            Phase::Fetching(r) | Phase::Training(r) | Phase::Sending(r) => Some(r),
        }
    }

    /// Advances the state machine.
    pub fn handle(&mut self, input: Input, now_ms: u64) -> Vec<Action> {
        let mut actions = Vec::new();
        match input {
            Input::RoundOpened { round, deadline_ms, participant } => {
                if self.round().is_some_and(|r| r >= round) {
                    return actions;
                }
                if let Some(old) = self.round() {
                    actions.push(Action::Abandon(old));
                    self.phase = Phase::Idle;
                }
                if participant {
                    self.phase = Phase::Fetching(round);
                    self.deadline_ms = deadline_ms;
                    actions.push(Action::FetchParams(round));
                }
            }
            Input::ParamsReady(r) if self.phase == Phase::Fetching(r) => {
                self.phase = Phase::Training(r);
                actions.push(Action::Train {
                    round: r,
                    steps: self.tau,
                    seed: data_seed(self.run_seed, &self.peer, r),
                });
            }
            Input::Trained(r) if self.phase == Phase::Training(r) => {
                self.phase = Phase::Sending(r);
                actions.push(Action::Send(r));
            }
            Input::Sent(r) | Input::Failed(r) if self.round() == Some(r) => self.phase = Phase::Idle,
            _ => {}
        }
        let expired = now_ms > self.deadline_ms && !matches!(self.phase, Phase::Sending(_));
        if let Some(r) = self.round().filter(|_| expired) {
            actions.push(Action::Abandon(r));
            self.phase = Phase::Idle;
        }
        actions
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_round_end_to_end() {
        let mut w = Worker::new(b"me".to_vec(), 1, 50);
        assert_eq!(
            w.handle(Input::RoundOpened { round: 1, deadline_ms: 100, participant: true }, 0),
            vec![Action::FetchParams(1)]
        );
        let train = w.handle(Input::ParamsReady(1), 1);
        assert_eq!(train, vec![Action::Train { round: 1, steps: 50, seed: data_seed(1, b"me", 1) }]);
        assert_eq!(w.handle(Input::Trained(1), 50), vec![Action::Send(1)]);
        assert!(w.handle(Input::Sent(1), 60).is_empty());
        assert_eq!(w.phase(), Phase::Idle);
    }

    #[test]
    fn non_participants_wait_and_newer_rounds_preempt() {
        let mut w = Worker::new(b"me".to_vec(), 1, 5);
        assert!(w.handle(Input::RoundOpened { round: 3, deadline_ms: 100, participant: false }, 0).is_empty());
        w.handle(Input::RoundOpened { round: 4, deadline_ms: 100, participant: true }, 0);
        w.handle(Input::ParamsReady(4), 1);
        let a = w.handle(Input::RoundOpened { round: 5, deadline_ms: 200, participant: true }, 2);
        assert_eq!(a, vec![Action::Abandon(4), Action::FetchParams(5)]);
        // A stale completion for round 4 changes nothing.
        assert!(w.handle(Input::Trained(4), 3).is_empty());
        assert_eq!(w.handle(Input::Tick, 201), vec![Action::Abandon(5)]);
    }
}
