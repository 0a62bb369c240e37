//! A candidate's run as recorded: how it started, then every input with the time
//! it came at and the actions it gave. Hosts build their candidate from a
//! [`Start`] (so what is recorded is what ran), and [`replay`] runs a recording
//! through a fresh candidate and checks that it does exactly the same: pcp-node
//! writes its candidates' runs with `PCP_CONSENSUS_TRACE=1`, the fault simulator
//! records its own, and tests replay both.

use super::{Action, Candidate, HardState, Input, LeftOut, Mode};
use crate::PublicKey;
use crate::election::Succession;
use crate::failover::Replica;

/// How a candidate started.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Start {
    /// Its key.
    pub me: PublicKey,
    /// The run's succession, in order.
    pub order: Vec<PublicKey>,
    /// The lease, ms.
    pub lease_ms: u64,
    /// The mode.
    pub mode: Mode,
    /// The hard state it kept (`None`: a new candidate).
    pub hard: Option<HardState>,
    /// The state it holds.
    pub held: Option<Replica>,
    /// When it started.
    pub now_ms: u64,
    /// The run's creator starting the run from this initial state (`hard` and
    /// `held` are then unused).
    pub created: Option<Replica>,
    /// It kept its hard state but lost the state it held ([`Candidate::lost_state`]).
    pub lost_state: bool,
    /// A rule left out (the fault simulator's checks only).
    pub left_out: Option<LeftOut>,
}

/// One input and what the candidate did.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Step {
    /// When.
    pub now_ms: u64,
    /// The input.
    pub input: Input,
    /// The actions it gave.
    pub actions: Vec<Action>,
}

/// Where a replay parted from its recording.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Diverged {
    /// The candidate started differently.
    #[error("on starting: recorded {recorded:?}, replayed {replayed:?}")]
    Start {
        /// What the recording says.
        recorded: Vec<Action>,
        /// What the replay did.
        replayed: Vec<Action>,
    },
    /// A step gave other actions.
    #[error("step {step} ({input:?} at {now_ms} ms): recorded {recorded:?}, replayed {replayed:?}")]
    Step {
        /// The step's index.
        step: usize,
        /// Its input.
        input: Box<Input>,
        /// Its time.
        now_ms: u64,
        /// What the recording says.
        recorded: Vec<Action>,
        /// What the replay did.
        replayed: Vec<Action>,
    },
}

impl Start {
    /// The candidate this start describes, and what it did on starting.
    pub fn candidate(&self) -> (Candidate, Vec<Action>) {
        let succession = Succession::from_order(self.order.clone());
        let (c, actions) = match self.created {
            Some(initial) => Candidate::create(self.me, succession, self.lease_ms, self.mode, initial, self.now_ms),
            None => {
                let c =
                    Candidate::new(self.me, succession, self.lease_ms, self.mode, self.hard, self.held, self.now_ms);
                (c, Vec::new())
            }
        };
        let c = if self.lost_state { c.lost_state() } else { c };
        let c = match self.left_out {
            Some(rule) => c.leave_out(rule),
            None => c,
        };
        (c, actions)
    }
}

/// Runs `steps` through the candidate `start` describes, checking each gives the
/// recorded actions (`started`: what it did on starting); the candidate at the end.
pub fn replay(start: &Start, started: &[Action], steps: &[Step]) -> Result<Candidate, Diverged> {
    let (mut c, actions) = start.candidate();
    if actions != started {
        return Err(Diverged::Start { recorded: started.to_vec(), replayed: actions });
    }
    for (i, step) in steps.iter().enumerate() {
        let replayed = c.handle(step.input, step.now_ms);
        if replayed != step.actions {
            return Err(Diverged::Step {
                step: i,
                input: Box::new(step.input),
                now_ms: step.now_ms,
                recorded: step.actions.clone(),
                replayed,
            });
        }
    }
    Ok(c)
}

/// A whole recording: the start, what it did on starting, and its steps.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Trace {
    /// How it started.
    pub start: Start,
    /// What it did on starting.
    pub started: Vec<Action>,
    /// Every input since.
    pub steps: Vec<Step>,
}

impl Trace {
    /// Starts recording: the candidate `start` describes, and the recording.
    pub fn begin(start: Start) -> (Candidate, Vec<Action>, Self) {
        let (c, started) = start.candidate();
        let trace = Self { start, started: started.clone(), steps: Vec::new() };
        (c, started, trace)
    }

    /// [`replay`] of this recording.
    pub fn replay(&self) -> Result<Candidate, Diverged> {
        replay(&self.start, &self.started, &self.steps)
    }
}
