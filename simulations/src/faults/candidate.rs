//! A coordinator candidate, composed as pcp-node composes it: the protocol's
//! [`failover::Candidate`] decides who leads, what is committed and when the
//! leader may act; this host carries its messages, fetches the states it asks
//! for, and while it leads runs the [`Shepherd`] with [`Quorum`] (check-quorum on
//! workers) and [`Fence`], telling workers of a round only once the core commits
//! the state it starts from.

use std::collections::{BTreeMap, BTreeSet};

use pcp_protocol::diloco::aggregate::Delta;
use pcp_protocol::diloco::shepherd::{self, Shepherd};
use pcp_protocol::failover::candidate::trace::{Start, Step, Trace};
use pcp_protocol::failover::candidate::{Action, Input, LeftOut, Stop};
use pcp_protocol::failover::{self, CHECK_QUORUM_LEASES, Fence, HardState, Quorum, Replica};

use super::invariants::{StateId, describe, id};
use super::msg::{Announce, Ctx, Event, Follow, Msg, Timer};
use super::params_hash;

/// What a candidate keeps on disk.
#[derive(Clone, Debug)]
pub(super) struct Disk {
    hard: Option<HardState>,
    held: Option<Replica>,
    blobs: BTreeSet<StateId>,
}

#[derive(Debug)]
pub(super) struct Candidate {
    core: failover::Candidate,
    /// The shepherd, while the core leads.
    leader: Option<Box<Leader>>,
    /// The hard state as last persisted.
    hard: Option<HardState>,
    /// The states it can serve.
    blobs: BTreeSet<StateId>,
    /// Its run, recorded when the setup traces.
    trace: Option<Box<Trace>>,
}

#[derive(Debug)]
struct Leader {
    term: u64,
    shepherd: Shepherd<u32>,
    quorum: Quorum,
    /// The state the shepherd holds: the one it leads from, then each it completes.
    state: Replica,
    fence: Option<Fence>,
    /// The open round's announcement, not yet told to workers (its base is not
    /// committed yet).
    pending: Option<Announce>,
    /// The last announcement workers were told.
    published: Option<Announce>,
    /// What each contribution to the open round the shepherd took was trained from.
    trained: BTreeMap<u32, [u8; 32]>,
}

fn delta_of(d: [f32; 4]) -> Delta {
    Delta::Dense(vec![d.to_vec()])
}

impl Candidate {
    /// The run's creator at the start: term 1's leader, from the initial state.
    pub(super) fn creator(initial: Replica, ctx: &mut Ctx<'_>) -> Self {
        let start = Self::describe(None, None, Some(initial), ctx);
        let blobs = BTreeSet::from([id(&initial)]);
        let mut c = Self { core: start.candidate().0, leader: None, hard: None, blobs, trace: None };
        let actions = c.begin(start, ctx);
        c.apply(actions, ctx);
        c
    }

    /// A candidate starting (or restarting) with `disk`, if it kept one.
    pub(super) fn start(disk: Option<Disk>, ctx: &mut Ctx<'_>) -> Self {
        let Disk { hard, held, blobs } = disk.unwrap_or(Disk { hard: None, held: None, blobs: BTreeSet::new() });
        let start = Self::describe(hard, held, None, ctx);
        let mut c = Self { core: start.candidate().0, leader: None, hard, blobs, trace: None };
        let actions = c.begin(start, ctx);
        c.apply(actions, ctx);
        c
    }

    /// How this candidate starts, as pcp-node's would (the rules the run leaves out too).
    fn describe(hard: Option<HardState>, held: Option<Replica>, created: Option<Replica>, ctx: &Ctx<'_>) -> Start {
        let s = &ctx.setup;
        let rules = ctx.rules();
        let left_out = match (rules.up_to_date, rules.commit_term) {
            (false, _) => Some(LeftOut::UpToDate),
            (_, false) => Some(LeftOut::CommitTerm),
            _ => None,
        };
        Start {
            me: s.keys[ctx.me],
            order: s.succession.order().to_vec(),
            lease_ms: s.lease_ms,
            mode: s.mode,
            hard,
            held,
            now_ms: ctx.now,
            created,
            lost_state: false,
            left_out,
        }
    }

    /// Builds the core from `start`, recording when the run traces; what it did on
    /// starting.
    fn begin(&mut self, start: Start, ctx: &Ctx<'_>) -> Vec<Action> {
        let (core, actions, trace) = Trace::begin(start);
        self.core = core;
        self.trace = ctx.setup.trace.then(|| Box::new(trace));
        actions
    }

    /// Its recorded run, once (when the run traces).
    pub(super) fn take_trace(&mut self) -> Option<Trace> {
        self.trace.take().map(|t| *t)
    }

    /// What survives a crash with the disk.
    pub(super) fn disk(&self) -> Disk {
        Disk { hard: self.hard, held: self.core.held(), blobs: self.blobs.clone() }
    }

    /// The term it follows or leads, and whether it leads.
    pub(super) fn term(&self) -> (u64, bool) {
        (self.core.term(), self.core.is_leader())
    }

    fn follows(&self, ctx: &Ctx<'_>) -> Follow {
        let (term, leader) = self.core.following().unwrap_or((0, self.core.awaited()));
        Follow { term, leader: ctx.setup.index(&leader) }
    }

    /// Hands `input` to the core (recording it when the run traces) and carries
    /// out what it decides.
    fn core(&mut self, input: Input, ctx: &mut Ctx<'_>) {
        let actions = self.core.handle(input, ctx.now);
        if let Some(t) = &mut self.trace {
            t.steps.push(Step { now_ms: ctx.now, input, actions: actions.clone() });
        }
        self.apply(actions, ctx);
    }

    fn apply(&mut self, actions: Vec<Action>, ctx: &mut Ctx<'_>) {
        for a in actions {
            match a {
                Action::Persist(h) => self.hard = Some(h),
                Action::Send { to, msg } => ctx.send(ctx.setup.index(&to), Msg::Consensus(msg)),
                Action::Fetch { state, from } => ctx.send(ctx.setup.index(&from), Msg::Fetch { want: state }),
                Action::Held(state) => {
                    self.blobs.insert(id(&state));
                    if !self.core.is_leader() {
                        ctx.events.push(Event::Replicated(state));
                    }
                }
                Action::LeaseExpired { term, leader } => {
                    let name = ctx.setup.name(ctx.setup.index(&leader));
                    ctx.log(format!("{}: the lease of term {term} ({name}) lapsed", ctx.name()));
                }
                Action::Campaign { term, pre } => {
                    let what = if pre { "pre-votes" } else { "votes" };
                    ctx.log(format!("{} asks for {what} for term {term}", ctx.name()));
                }
                Action::Deferred { term } => {
                    ctx.log(format!("{} defers term {term}: it holds no leader's state yet", ctx.name()));
                }
                Action::Elected { .. } | Action::Rejected { .. } => {}
                Action::Lead { term, from } => self.lead(term, from, ctx),
                Action::Commit(state) => {
                    if let Some(l) = &mut self.leader {
                        l.publish(&self.core, ctx);
                    }
                    let _ = state;
                }
                Action::Stopped { term, why } => {
                    let why = match why {
                        Stop::Newer(t) => format!(
                            "term {t} is {}'s",
                            ctx.setup.name(ctx.setup.index(&self.core.succession().leader(t)))
                        ),
                        Stop::Aside => "it lost its workers".to_owned(),
                        Stop::Behind => "the other candidate holds a newer state".to_owned(),
                    };
                    ctx.log(format!("{} stops leading term {term}: {why}", ctx.name()));
                    self.leader = None;
                }
            }
        }
    }

    /// Starts the shepherd of `term` from `from`.
    fn lead(&mut self, term: u64, from: Replica, ctx: &mut Ctx<'_>) {
        let Some(state) = ctx.reg.get(&id(&from)) else {
            // a state nobody completed cannot be held
            ctx.log(format!("{} cannot lead from unknown {}", ctx.name(), describe(&from)));
            return;
        };
        let shepherd = Shepherd::resume(ctx.setup.shepherd.clone(), state.snapshot.clone());
        // as pcp-node: the window is three leases, and at least the heartbeat timeout
        let window = (CHECK_QUORUM_LEASES * ctx.setup.lease_ms).max(ctx.setup.shepherd.heartbeat_timeout_ms);
        let mut quorum = Quorum::new(window, ctx.now).needing(ctx.setup.shepherd.min_quorum);
        let contributors: Vec<_> =
            state.contributors.iter().map(|w| ctx.setup.keys[ctx.setup.candidates + *w as usize]).collect();
        quorum.round_completed(&contributors, ctx.now);
        ctx.log(format!("{} leads term {term} from {}", ctx.name(), describe(&from)));
        ctx.events.push(Event::Leads(term));
        self.blobs.insert(id(&from));
        let mut leader = Leader {
            term,
            shepherd,
            quorum,
            state: from,
            fence: None,
            pending: None,
            published: None,
            trained: BTreeMap::new(),
        };
        leader.handle_input(shepherd::Input::Tick, None, &mut self.core, ctx, &mut self.blobs);
        self.leader = Some(Box::new(leader));
    }

    pub(super) fn on_timer(&mut self, timer: Timer, ctx: &mut Ctx<'_>) {
        match timer {
            Timer::Tick => {
                ctx.timers.push((100, Timer::Tick));
                self.core(Input::Tick, ctx);
                let Some(l) = &mut self.leader else { return };
                if ctx.rules().check_quorum && l.quorum.check(ctx.now) {
                    let (heard, of) = l.quorum.heard_of(ctx.now);
                    ctx.log(format!("{} steps aside: heard {heard} of its {of} contributors", ctx.name()));
                    self.core(Input::StepAside, ctx);
                    return;
                }
                let held = l.handle_input(shepherd::Input::Tick, None, &mut self.core, ctx, &mut self.blobs);
                self.held(held, ctx);
                if let Some(l) = &mut self.leader {
                    l.publish(&self.core, ctx);
                }
            }
            Timer::Lease => ctx.timers.push((ctx.setup.lease_ms / 3, Timer::Lease)),
            Timer::Beat => ctx.timers.push((ctx.setup.lease_ms / 2, Timer::Beat)),
            _ => {}
        }
    }

    /// The shepherd completed a round: the core replicates it.
    fn held(&mut self, done: Option<Replica>, ctx: &mut Ctx<'_>) {
        if let Some(done) = done {
            self.core(Input::Holds(done), ctx);
        }
    }

    pub(super) fn on_msg(&mut self, from: usize, msg: Msg, ctx: &mut Ctx<'_>) {
        match msg {
            Msg::Fetch { want } => {
                if self.blobs.contains(&id(&want)) {
                    ctx.send_blob(from, want);
                }
            }
            Msg::Blob { state } => {
                if ctx.reg.get(&id(&state)).is_some() {
                    self.core(Input::Holds(state), ctx);
                }
            }
            Msg::Consensus(msg) => self.core(Input::Message { from: ctx.setup.keys[from], msg }, ctx),
            Msg::WorkerBeat { round: trained, .. } => {
                let Some(l) = &mut self.leader else {
                    ctx.send(from, Msg::Relay { follows: self.follows(ctx) });
                    return;
                };
                let w = (from - ctx.setup.candidates) as u32;
                // as the node: a worker past this leader's rounds is not in its quorum
                if trained <= l.shepherd.completed() + 1 {
                    l.quorum.heard(&ctx.setup.keys[from], ctx.now);
                }
                let input = if l.shepherd.workers().any(|p| *p == w) {
                    shepherd::Input::Heartbeat(w)
                } else {
                    shepherd::Input::Joined(w)
                };
                let term = l.term;
                let announce = l.published;
                let held = l.handle_input(input, None, &mut self.core, ctx, &mut self.blobs);
                ctx.send(from, Msg::Lease { term, epoch: ctx.epoch, sent: ctx.now, announce });
                self.held(held, ctx);
            }
            Msg::Contribution { term: t, round, params, delta } => {
                let Some(l) = &mut self.leader else { return };
                l.quorum.heard(&ctx.setup.keys[from], ctx.now);
                if ctx.rules().fence && l.fence.is_none_or(|f| f.check(t, round, &params).is_err()) {
                    return;
                }
                let w = (from - ctx.setup.candidates) as u32;
                let (delta, timing, screen) = (delta_of(delta), None, shepherd::Screen::Unscreened);
                let input =
                    shepherd::Input::Contribution { peer: w, round, samples: 100, loss: 1.0, delta, timing, screen };
                let held = l.handle_input(input, Some(params), &mut self.core, ctx, &mut self.blobs);
                self.held(held, ctx);
                if let Some(l) = &mut self.leader {
                    l.publish(&self.core, ctx);
                }
            }
            Msg::Lease { .. } | Msg::Gossip { .. } | Msg::Relay { .. } => {}
        }
    }
}

impl Leader {
    /// Hands `input` (a contribution: trained from `trained`) to the shepherd. As
    /// pcp-node: the round's deadlines run (a tick) only while a majority answers
    /// this leader's lease; what workers send is always taken (a round completed
    /// meanwhile is told to workers only once a majority holds it). The state the
    /// shepherd completed, if it did.
    fn handle_input(
        &mut self,
        input: shepherd::Input<u32>,
        trained: Option<[u8; 32]>,
        core: &mut failover::Candidate,
        ctx: &mut Ctx<'_>,
        blobs: &mut BTreeSet<StateId>,
    ) -> Option<Replica> {
        let may_act = core.may_act(ctx.now) || !ctx.rules().leader_lease;
        if !may_act && matches!(input, shepherd::Input::Tick) {
            return None;
        }
        self.run(input, trained, ctx, blobs)
    }

    fn run(
        &mut self,
        input: shepherd::Input<u32>,
        trained: Option<[u8; 32]>,
        ctx: &mut Ctx<'_>,
        blobs: &mut BTreeSet<StateId>,
    ) -> Option<Replica> {
        let term = self.term;
        if let (shepherd::Input::Contribution { peer, round, .. }, Some(from)) = (&input, trained)
            && self.shepherd.open_round() == Some(*round)
        {
            // the shepherd takes a participant's first contribution to the round
            self.trained.entry(*peer).or_insert(from);
        }
        let mut completed = None;
        for a in self.shepherd.handle(input, ctx.now) {
            match a {
                shepherd::Action::RoundCompleted(summary) => {
                    for w in &summary.contributors {
                        if let Some(from) = self.trained.get(w).filter(|p| **p != self.state.params) {
                            ctx.events.push(Event::Mixed { round: summary.round, worker: *w, trained: *from });
                        }
                    }
                    self.trained.clear();
                    let params = params_hash(self.shepherd.params());
                    let done = Replica { term, round: summary.round, params };
                    ctx.reg.insert(
                        id(&done),
                        super::invariants::State {
                            parent: Some(id(&self.state)),
                            snapshot: self.shepherd.snapshot(),
                            contributors: summary.contributors.clone(),
                            at: ctx.global,
                        },
                    );
                    let keys: Vec<_> = summary
                        .contributors
                        .iter()
                        .map(|w| ctx.setup.keys[ctx.setup.candidates + *w as usize])
                        .collect();
                    self.quorum.round_completed(&keys, ctx.now);
                    let with: Vec<String> = summary.contributors.iter().map(|w| format!("w{w}")).collect();
                    ctx.log(format!("{} completed {} with {}", ctx.name(), describe(&done), with.join(" ")));
                    self.state = done;
                    blobs.insert(id(&done));
                    ctx.events.push(Event::Completed(done));
                    completed = Some(done);
                }
                shepherd::Action::OpenRound { round, participants, .. } => {
                    let bits = participants.iter().fold(0u64, |b, w| b | 1 << w);
                    let a = Announce { term, round, base: self.state, participants: bits, opened_ms: ctx.now };
                    self.fence = Some(Fence { term, round, params: self.state.params });
                    self.pending = Some(a);
                }
                _ => {}
            }
        }
        completed
    }

    /// Tells workers of the open round once the core committed the state it starts
    /// from (without the commit rule: at once).
    fn publish(&mut self, core: &failover::Candidate, ctx: &mut Ctx<'_>) {
        let Some(a) = self.pending else { return };
        let committed = core.committed().is_some_and(|c| c.round == a.base.round && c.params == a.base.params);
        if ctx.rules().commit && !committed {
            return;
        }
        self.pending = None;
        self.published = Some(a);
        let who: Vec<String> = (0..64).filter(|w| a.participants & (1 << w) != 0).map(|w| format!("w{w}")).collect();
        ctx.log(format!("{} releases round {} to {}", ctx.name(), a.round, who.join(" ")));
        ctx.events.push(Event::Released(a.base));
        let msg = Msg::Lease { term: self.term, epoch: ctx.epoch, sent: ctx.now, announce: Some(a) };
        for n in ctx.setup.candidates..ctx.setup.keys.len() {
            ctx.send(n, msg);
        }
    }
}
