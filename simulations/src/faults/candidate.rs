//! A coordinator candidate, composed from the protocol's rules as pcp-node
//! composes them: a standby ([`Standby`]) that replicates the leader's state, or
//! the leader ([`Shepherd`] with [`Election`], [`Quorum`], [`LeaderLease`],
//! [`Commit`] and [`Fence`]).

use std::collections::{BTreeMap, BTreeSet};

use pcp_protocol::diloco::aggregate::Delta;
use pcp_protocol::diloco::shepherd::{self, Shepherd};
use pcp_protocol::election::{self, Election};
use pcp_protocol::failover::{self, CHECK_QUORUM_LEASES, Commit, Fence, LeaderLease, Quorum, Replica, Standby};

use super::invariants::{StateId, describe, id};
use super::msg::{Announce, Ctx, Event, Follow, LeaseSeen, Msg, Timer};
use super::params_hash;

/// What a candidate keeps on disk.
#[derive(Clone, Debug)]
pub(super) struct Disk {
    term: u64,
    /// A standby's state, or a leader's latest.
    held: Option<Replica>,
    blobs: BTreeSet<StateId>,
}

#[derive(Debug)]
pub(super) struct Candidate {
    role: Role,
    /// The state being fetched, and when it was asked for.
    fetching: Option<(Replica, u64)>,
    /// The states it can serve.
    blobs: BTreeSet<StateId>,
}

#[derive(Debug)]
enum Role {
    Standby(Box<Side>),
    Leader(Box<Leader>),
    /// Only between two roles.
    Switching,
}

#[derive(Debug)]
struct Side {
    standby: Standby,
    /// The latest lease of the followed term, for the leader to take as an answer.
    seen: Option<LeaseSeen>,
}

#[derive(Debug)]
struct Leader {
    election: Election,
    shepherd: Shepherd<u32>,
    quorum: Quorum,
    lease: LeaderLease,
    commit: Commit,
    /// The state it leads from, then each one it completes.
    state: Replica,
    fence: Option<Fence>,
    /// The open round's announcement, known to candidates but not yet to workers.
    pending: Option<Announce>,
    /// The last announcement workers were told.
    published: Option<Announce>,
    /// When the pending announcement's round opened.
    opened_at: u64,
    /// Inputs held while the leader may not act, each contribution with the
    /// parameters it was trained from.
    queue: Vec<(shepherd::Input<u32>, Option<[u8; 32]>)>,
    /// What each contribution to the open round the shepherd took was trained from.
    trained: BTreeMap<u32, [u8; 32]>,
}

/// What a leader does after a message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Next {
    Stay,
    /// It saw a higher term: it steps down and the message is the standby's.
    StepDown,
}

fn follows(e: &Election, ctx: &Ctx<'_>) -> Follow {
    Follow { term: e.term(), leader: ctx.setup.index(&e.leader()) }
}

fn delta_of(d: [f32; 4]) -> Delta {
    Delta::Dense(vec![d.to_vec()])
}

impl Candidate {
    /// The run's creator at the start: term 1's leader, from the initial state.
    pub(super) fn creator(initial: Replica, ctx: &mut Ctx<'_>) -> Self {
        let election = Election::new(ctx.setup.keys[ctx.me], ctx.setup.succession.clone(), ctx.setup.lease_ms, ctx.now);
        let mut c = Self { role: Role::Switching, fetching: None, blobs: BTreeSet::from([id(&initial)]) };
        c.lead(election, initial, ctx);
        c
    }

    /// A candidate starting (or restarting) with `disk`, if it kept one.
    pub(super) fn start(disk: Option<Disk>, ctx: &mut Ctx<'_>) -> Self {
        let s = &ctx.setup;
        let key = s.keys[ctx.me];
        let Some(disk) = disk else {
            let election = Election::new(key, s.succession.clone(), s.lease_ms, ctx.now);
            let side = Side { standby: Standby::new(election, None), seen: None };
            return Self { role: Role::Standby(Box::new(side)), fetching: None, blobs: BTreeSet::new() };
        };
        let election = Election::resume(key, s.succession.clone(), s.lease_ms, disk.term, ctx.now);
        let mut c = Self { role: Role::Switching, fetching: None, blobs: disk.blobs };
        match disk.held {
            // a leader restarted with its state resumes leading its term (`--resume`)
            Some(held) if election.is_leader() => c.lead(election, held, ctx),
            held => c.role = Role::Standby(Box::new(Side { standby: Standby::new(election, held), seen: None })),
        }
        c
    }

    /// What survives a crash with the disk.
    pub(super) fn disk(&self) -> Disk {
        let (term, held) = match &self.role {
            Role::Standby(s) => (s.standby.election().term(), s.standby.held()),
            Role::Leader(l) => (l.election.term(), Some(l.state)),
            Role::Switching => (0, None),
        };
        Disk { term, held, blobs: self.blobs.clone() }
    }

    /// The term it follows or leads, and whether it leads.
    pub(super) fn term(&self) -> (u64, bool) {
        match &self.role {
            Role::Standby(s) => (s.standby.election().term(), false),
            Role::Leader(l) => (l.election.term(), true),
            Role::Switching => (0, false),
        }
    }

    /// Leads `election`'s term from `from`.
    fn lead(&mut self, election: Election, from: Replica, ctx: &mut Ctx<'_>) {
        let Some(state) = ctx.reg.get(&id(&from)) else {
            // a state nobody completed cannot be held; stay a standby
            self.role = Role::Standby(Box::new(Side { standby: Standby::new(election, None), seen: None }));
            return;
        };
        let lease_ms = ctx.setup.lease_ms;
        let shepherd = Shepherd::resume(ctx.setup.shepherd.clone(), state.snapshot.clone());
        // as pcp-node: the window is three leases, and at least the heartbeat timeout
        let window = (CHECK_QUORUM_LEASES * lease_ms).max(ctx.setup.shepherd.heartbeat_timeout_ms);
        let mut quorum = Quorum::new(window, ctx.now);
        let contributors: Vec<_> =
            state.contributors.iter().map(|w| ctx.setup.keys[ctx.setup.candidates + *w as usize]).collect();
        quorum.round_completed(&contributors, ctx.now);
        let term = election.term();
        ctx.log(format!("{} leads term {term} from {}", ctx.name(), describe(&from)));
        ctx.events.push(Event::Leads(term));
        self.blobs.insert(id(&from));
        let mut leader = Leader {
            election,
            shepherd,
            quorum,
            lease: LeaderLease::new(lease_ms),
            commit: Commit::new(lease_ms),
            state: from,
            fence: None,
            pending: None,
            published: None,
            opened_at: ctx.now,
            queue: Vec::new(),
            trained: BTreeMap::new(),
        };
        // a leader asserts its lease as soon as it starts
        leader.send_leases(ctx);
        leader.feed(shepherd::Input::Tick, None, ctx, &mut self.blobs);
        self.role = Role::Leader(Box::new(leader));
    }

    /// The leader becomes a standby holding its latest state.
    fn stand_by(&mut self) {
        self.stand_by_at(None);
    }

    /// As [`Self::stand_by`], for a leader that stepped aside at `aside` (it takes
    /// no term for a while, as pcp-node's does).
    fn stand_by_at(&mut self, aside: Option<u64>) {
        // a standby replicates only what the leader it follows announces
        self.fetching = None;
        if let Role::Leader(l) = std::mem::replace(&mut self.role, Role::Switching) {
            let l = *l;
            let mut standby = Standby::new(l.election, Some(l.state));
            if let Some(now) = aside {
                standby = standby.set_aside(now);
            }
            self.role = Role::Standby(Box::new(Side { standby, seen: None }));
        }
    }

    pub(super) fn on_timer(&mut self, timer: Timer, ctx: &mut Ctx<'_>) {
        let lease_ms = ctx.setup.lease_ms;
        match (timer, &mut self.role) {
            (Timer::Tick, Role::Leader(l)) => {
                ctx.timers.push((100, Timer::Tick));
                l.election.tick(ctx.now);
                if ctx.rules().check_quorum && l.quorum.check(ctx.now) {
                    let (heard, of) = l.quorum.heard_of(ctx.now);
                    for a in l.election.step_aside(ctx.now) {
                        if let election::Action::SteppedAside { term } = a {
                            ctx.log(format!(
                                "{} steps aside from term {term}: heard {heard} of its {of} contributors",
                                ctx.name()
                            ));
                        }
                    }
                    self.stand_by_at(Some(ctx.now));
                    return;
                }
                // as the node: a leader behind a live candidate's newer state steps aside
                // for it (the up-to-date rule, kept after the election)
                if let Some((holder, newer)) = l.behind(ctx) {
                    l.election.step_aside(ctx.now);
                    ctx.log(format!(
                        "{} steps aside: {} holds {}",
                        ctx.name(),
                        ctx.setup.name(holder),
                        describe(&newer)
                    ));
                    self.stand_by_at(Some(ctx.now));
                    return;
                }
                l.feed(shepherd::Input::Tick, None, ctx, &mut self.blobs);
                l.publish(ctx);
            }
            (Timer::Tick, Role::Standby(s)) => {
                ctx.timers.push((100, Timer::Tick));
                let mut lead = None;
                for a in s.standby.handle(failover::Input::Tick, ctx.now) {
                    match a {
                        failover::Action::Lead { term, from } => lead = Some((term, from)),
                        failover::Action::Deferred { term, to } => {
                            let to = match to {
                                Some((k, r)) => {
                                    format!("{}, which holds {}", ctx.setup.name(ctx.setup.index(&k)), describe(&r))
                                }
                                None => "the others: it holds no state".into(),
                            };
                            ctx.log(format!("{} defers term {term} to {to}", ctx.name()));
                        }
                        _ => {}
                    }
                }
                if let Some((_, from)) = lead {
                    let election = s.standby.election().clone();
                    self.fetching = None;
                    self.lead(election, from, ctx);
                }
            }
            (Timer::Lease, Role::Leader(l)) => {
                ctx.timers.push((lease_ms / 3, Timer::Lease));
                l.send_leases(ctx);
            }
            (Timer::Beat, Role::Standby(s)) => {
                ctx.timers.push((lease_ms / 2, Timer::Beat));
                let msg = Msg::Heartbeat {
                    held: s.standby.held(),
                    follows: follows(s.standby.election(), ctx),
                    seen: s.seen,
                };
                for c in 0..ctx.setup.candidates {
                    ctx.send(c, msg);
                }
            }
            (Timer::Lease, _) => ctx.timers.push((lease_ms / 3, Timer::Lease)),
            (Timer::Beat, _) => ctx.timers.push((lease_ms / 2, Timer::Beat)),
            _ => {}
        }
    }

    pub(super) fn on_msg(&mut self, from: usize, msg: Msg, ctx: &mut Ctx<'_>) {
        if let Msg::Fetch { want } = msg {
            if self.blobs.contains(&id(&want)) {
                ctx.send_blob(from, want);
            }
            return;
        }
        if let Role::Leader(l) = &mut self.role {
            match l.on_msg(from, msg, ctx, &mut self.blobs) {
                Next::Stay => return,
                // it saw a higher term: it steps down and takes the message as a standby
                Next::StepDown => self.stand_by(),
            }
        }
        let Role::Standby(s) = &mut self.role else { return };
        let lease_ms = ctx.setup.lease_ms;
        match msg {
            Msg::Lease { term, epoch, sent, announce } => {
                let key = ctx.setup.keys[from];
                let actions = s.standby.handle(failover::Input::Lease { from: key, term }, ctx.now);
                let refused =
                    actions.iter().any(|a| matches!(a, failover::Action::Election(election::Action::Rejected { .. })));
                let mine = follows(s.standby.election(), ctx);
                if refused {
                    ctx.send(from, Msg::Relay { follows: mine });
                    return;
                }
                s.seen = Some(LeaseSeen { term, epoch, sent });
                ctx.send(from, Msg::Answer { epoch, sent, held: s.standby.held(), follows: mine });
                let Some(a) = announce.filter(|a| a.term == term) else { return };
                if s.standby.held().is_some_and(|h| !a.base.newer_than(&h)) {
                    return;
                }
                let asked = self.fetching.is_some_and(|(r, at)| r == a.base && ctx.now < at + lease_ms);
                if !asked {
                    self.fetching = Some((a.base, ctx.now));
                    ctx.send(from, Msg::Fetch { want: a.base });
                }
            }
            Msg::Heartbeat { held, follows: f, .. } => {
                if ctx.rules().up_to_date {
                    s.standby.handle(failover::Input::Peer { from: ctx.setup.keys[from], held }, ctx.now);
                }
                relay(s, f, ctx);
            }
            Msg::Relay { follows: f } | Msg::Answer { follows: f, .. } => relay(s, f, ctx),
            Msg::WorkerBeat { follows: f, .. } => {
                relay(s, f, ctx);
                ctx.send(from, Msg::Relay { follows: follows(s.standby.election(), ctx) });
            }
            Msg::Blob { state } => {
                if !self.fetching.is_some_and(|(r, _)| r == state) {
                    return;
                }
                self.fetching = None;
                let before = s.standby.held();
                s.standby.handle(failover::Input::Replicated(state), ctx.now);
                if s.standby.held() != before {
                    self.blobs.insert(id(&state));
                    ctx.events.push(Event::Replicated(state));
                    // it says so at once: the leader may be holding the round back for it
                    let msg =
                        Msg::Heartbeat { held: Some(state), follows: follows(s.standby.election(), ctx), seen: s.seen };
                    ctx.send(from, msg);
                }
            }
            Msg::Contribution { .. } | Msg::Fetch { .. } => {}
        }
    }
}

/// A standby hears (in a relayed lease) that a higher term exists.
fn relay(s: &mut Side, f: Follow, ctx: &mut Ctx<'_>) {
    if f.term > s.standby.election().term() && f.leader != ctx.me && ctx.setup.is_candidate(f.leader) {
        s.standby.handle(failover::Input::Lease { from: ctx.setup.keys[f.leader], term: f.term }, ctx.now);
    }
}

impl Leader {
    fn may_act(&mut self, ctx: &Ctx<'_>) -> bool {
        let lease = self.lease.check(ctx.now) || !ctx.rules().leader_lease;
        // a leader behind a live candidate's newer state completes nothing (it steps aside)
        lease && self.behind(ctx).is_none()
    }

    /// The newest state a live candidate holds that is newer than this leader's,
    /// and its holder (see [`failover::Commit::newer_than`]).
    fn behind(&self, ctx: &Ctx<'_>) -> Option<(usize, Replica)> {
        if !ctx.rules().step_aside_behind {
            return None;
        }
        let (key, newer) = self.commit.newer_than(&self.state, ctx.now)?;
        Some((ctx.setup.index(&key), newer))
    }

    fn send_leases(&mut self, ctx: &mut Ctx<'_>) {
        let msg = Msg::Lease {
            term: self.election.term(),
            epoch: ctx.epoch,
            sent: ctx.now,
            announce: self.pending.or(self.published),
        };
        for c in 0..ctx.setup.candidates {
            ctx.send(c, msg);
        }
    }

    /// Hands `input` (a contribution: trained from `trained`) to the shepherd, or
    /// holds it while the leader may not act.
    fn feed(
        &mut self,
        input: shepherd::Input<u32>,
        trained: Option<[u8; 32]>,
        ctx: &mut Ctx<'_>,
        blobs: &mut BTreeSet<StateId>,
    ) {
        if !self.may_act(ctx) {
            if !matches!(input, shepherd::Input::Tick) {
                self.queue.push((input, trained));
            }
            return;
        }
        for (held, from) in std::mem::take(&mut self.queue) {
            self.run(held, from, ctx, blobs);
        }
        self.run(input, trained, ctx, blobs);
    }

    fn run(
        &mut self,
        input: shepherd::Input<u32>,
        trained: Option<[u8; 32]>,
        ctx: &mut Ctx<'_>,
        blobs: &mut BTreeSet<StateId>,
    ) {
        let term = self.election.term();
        if let (shepherd::Input::Contribution { peer, round, .. }, Some(from)) = (&input, trained)
            && self.shepherd.open_round() == Some(*round)
        {
            // the shepherd takes a participant's first contribution to the round
            self.trained.entry(*peer).or_insert(from);
        }
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
                }
                shepherd::Action::OpenRound { round, participants, .. } => {
                    let bits = participants.iter().fold(0u64, |b, w| b | 1 << w);
                    let a =
                        Announce { term, round, base: self.state, participants: bits, opened: (ctx.epoch, ctx.now) };
                    self.fence = Some(Fence { term, round, params: self.state.params });
                    self.pending = Some(a);
                    self.opened_at = ctx.now;
                    // candidates learn of it at once
                    self.send_leases(ctx);
                    self.publish(ctx);
                }
                _ => {}
            }
        }
    }

    /// Tells workers of the open round once every live candidate holds its base,
    /// or once it has waited [`pcp_protocol::failover::COMMIT_WAIT_LEASES`] for them
    /// (as pcp-node: a candidate that cannot keep up stalls nobody).
    fn publish(&mut self, ctx: &mut Ctx<'_>) {
        let Some(a) = self.pending else { return };
        if !self.may_act(ctx) {
            return;
        }
        let waiting = a.base.round > 0 && !self.commit.waiting_for(a.base.term, a.base.round, ctx.now).is_empty();
        if ctx.rules().commit && waiting && !self.commit.overdue(self.opened_at, ctx.now) {
            return;
        }
        self.pending = None;
        self.published = Some(a);
        let msg = Msg::Lease { term: self.election.term(), epoch: ctx.epoch, sent: ctx.now, announce: Some(a) };
        for n in 0..ctx.setup.keys.len() {
            ctx.send(n, msg);
        }
    }

    /// A relayed or direct lease of a higher term: steps down (returns true).
    fn higher(&mut self, f: Follow, ctx: &mut Ctx<'_>) -> bool {
        if f.term <= self.election.term() || f.leader == ctx.me || !ctx.setup.is_candidate(f.leader) {
            return false;
        }
        let led = self.election.term();
        let actions = self.election.on_lease(ctx.setup.keys[f.leader], f.term, ctx.now);
        let down = actions.iter().any(|a| matches!(a, election::Action::SteppedDown { .. }));
        if down {
            ctx.log(format!(
                "{} steps down from term {led}: term {} is {}'s",
                ctx.name(),
                f.term,
                ctx.setup.name(f.leader)
            ));
        }
        down
    }

    /// Handles `msg`.
    fn on_msg(&mut self, from: usize, msg: Msg, ctx: &mut Ctx<'_>, blobs: &mut BTreeSet<StateId>) -> Next {
        let term = self.election.term();
        let mine = Follow { term, leader: ctx.me };
        match msg {
            Msg::Lease { term: t, .. } => {
                if self.higher(Follow { term: t, leader: from }, ctx) {
                    return Next::StepDown;
                }
                if t < term {
                    ctx.send(from, Msg::Relay { follows: mine });
                }
            }
            Msg::Answer { epoch, sent, held, follows: f } => {
                if self.higher(f, ctx) {
                    return Next::StepDown;
                }
                if epoch == ctx.epoch && f.term == term {
                    self.lease.answered(sent, ctx.now);
                    self.commit.heard(ctx.setup.keys[from], held, ctx.now);
                    self.publish(ctx);
                }
            }
            Msg::Heartbeat { held, follows: f, seen } => {
                if self.higher(f, ctx) {
                    return Next::StepDown;
                }
                self.commit.heard(ctx.setup.keys[from], held, ctx.now);
                if let Some(seen) = seen.filter(|s| s.epoch == ctx.epoch && s.term == term) {
                    self.lease.answered(seen.sent, ctx.now);
                }
                let announce = self.pending.or(self.published);
                ctx.send(from, Msg::Lease { term, epoch: ctx.epoch, sent: ctx.now, announce });
                self.publish(ctx);
            }
            Msg::Relay { follows: f } => {
                if self.higher(f, ctx) {
                    return Next::StepDown;
                }
            }
            Msg::WorkerBeat { follows: f, round: trained } => {
                if self.higher(f, ctx) {
                    return Next::StepDown;
                }
                let w = (from - ctx.setup.candidates) as u32;
                // as the node: a worker past this leader's rounds is not in its quorum
                if trained <= self.shepherd.completed() + 1 {
                    self.quorum.heard(&ctx.setup.keys[from], ctx.now);
                }
                let input = if self.shepherd.workers().any(|p| *p == w) {
                    shepherd::Input::Heartbeat(w)
                } else {
                    shepherd::Input::Joined(w)
                };
                self.feed(input, None, ctx, blobs);
                ctx.send(from, Msg::Lease { term, epoch: ctx.epoch, sent: ctx.now, announce: self.published });
            }
            Msg::Contribution { term: t, round, params, delta } => {
                self.quorum.heard(&ctx.setup.keys[from], ctx.now);
                if ctx.rules().fence && self.fence.is_none_or(|f| f.check(t, round, &params).is_err()) {
                    return Next::Stay;
                }
                let w = (from - ctx.setup.candidates) as u32;
                let input =
                    shepherd::Input::Contribution { peer: w, round, samples: 100, loss: 1.0, delta: delta_of(delta) };
                self.feed(input, Some(params), ctx, blobs);
                self.publish(ctx);
            }
            Msg::Blob { .. } | Msg::Fetch { .. } => {}
        }
        Next::Stay
    }
}
