//! A worker, composed as pcp-node composes it: it drives the protocol's
//! [`Follower`] (the leases it takes, the rounds its chain admits, what it saves)
//! and its [`Worker`] machine, and keeps its term and chain on disk. An
//! announcement it takes it forwards once to [`GOSSIP_FANOUT`] other workers
//! (gossip), who take it as a lease from the leader that signed it.

use pcp_protocol::diloco::follower::{self, Announced, Follower, Opening, Take};
use pcp_protocol::diloco::worker::{self, Worker};
use pcp_protocol::failover::{Chain, Replica};
use rand::Rng;

use super::msg::{Announce, Ctx, Event, Follow, Msg, Timer};

/// What a worker keeps on disk: what its follower's [`follower::Action::SaveTerm`]
/// and [`follower::Action::SaveChain`] wrote.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Disk {
    term: u64,
    chain: Chain,
}

/// The round a worker is on.
#[derive(Clone, Copy, Debug)]
struct Work {
    id: u64,
    term: u64,
    leader: usize,
    round: u64,
    base: Replica,
    /// What it trained (once it has).
    delta: [f32; 4],
}

#[derive(Debug)]
pub(super) struct WorkerNode {
    follower: Follower,
    disk: Disk,
    machine: Worker,
    work: Option<Work>,
    next_id: u64,
    /// The announcements it last forwarded, newest last (at most
    /// [`GOSSIP_MEMORY`]): it forwards each once.
    gossiped: Vec<Announce>,
}

/// How many other workers a worker forwards an announcement it took to.
pub(super) const GOSSIP_FANOUT: usize = 2;
/// How many forwarded announcements a worker remembers.
const GOSSIP_MEMORY: usize = 8;

/// Inner steps per round (the machine's τ; their time is the simulated compute).
const TAU: u64 = 20;

/// A worker's pseudo-gradient: small, and different every time it trains (GPUs
/// do not add in the same order twice), so that a round completed twice gives two
/// states and the invariants can tell their histories apart.
fn delta(rng: &mut impl Rng) -> [f32; 4] {
    std::array::from_fn(|_| rng.gen_range(-0.05..0.05))
}

impl WorkerNode {
    /// A worker starting (or restarting) with `disk`, if it kept one.
    pub(super) fn start(disk: Option<Disk>, ctx: &Ctx<'_>) -> Self {
        let s = &ctx.setup;
        let key = s.keys[ctx.me];
        let disk = disk.unwrap_or_default();
        let mut follower = Follower::new(key, s.succession.clone(), s.lease_ms, disk.term, disk.chain, ctx.now);
        if !ctx.rules().chain {
            follower.rounds = follower.rounds.leave_out_chain();
        }
        Self {
            follower,
            disk,
            machine: Worker::new(key.0.to_vec(), 1, TAU),
            work: None,
            next_id: 0,
            gossiped: Vec::new(),
        }
    }

    pub(super) fn disk(&self) -> Disk {
        self.disk
    }

    /// Carries out the follower's saves (its leader is read from it when needed).
    fn save(&mut self, actions: impl IntoIterator<Item = follower::Action>) {
        for action in actions {
            match action {
                follower::Action::SaveTerm(term) => self.disk.term = term,
                follower::Action::SaveChain(chain) => self.disk.chain = chain,
                follower::Action::Follow { .. } | follower::Action::Rejected { .. } => {}
            }
        }
    }

    fn follows(&self, ctx: &Ctx<'_>) -> Follow {
        let leases = &self.follower.leases;
        Follow { term: leases.term(), leader: ctx.setup.index(&leases.leader()) }
    }

    /// How long a fetch waits before it asks again: a lease, or the slowest
    /// transfer (asking again while a large state is on its way would only race
    /// two transfers of it).
    fn refetch_ms(ctx: &Ctx<'_>) -> u64 {
        ctx.setup.lease_ms.max(ctx.setup.transfer_ms.1)
    }

    fn index(ctx: &Ctx<'_>) -> usize {
        ctx.me - ctx.setup.candidates
    }

    pub(super) fn on_timer(&mut self, timer: Timer, ctx: &mut Ctx<'_>) {
        match timer {
            Timer::Tick => {
                ctx.timers.push((250, Timer::Tick));
                self.follower.leases.tick(ctx.now);
                self.machine.handle(worker::Input::Tick, ctx.now);
            }
            Timer::Beat => {
                ctx.timers.push((ctx.setup.lease_ms / 2, Timer::Beat));
                let to = ctx.setup.index(&self.follower.leases.awaited());
                let round = self.follower.rounds.chain().round;
                ctx.send(to, Msg::WorkerBeat { follows: self.follows(ctx), round });
            }
            Timer::Trained(id) => {
                let Some(w) = self.work.filter(|w| w.id == id) else { return };
                for a in self.machine.handle(worker::Input::Trained(w.round), ctx.now) {
                    if let worker::Action::Send(round) = a {
                        let w = Work { delta: delta(ctx.rng), ..w };
                        self.work = Some(w);
                        self.send(w, ctx);
                        self.machine.handle(worker::Input::Sent(round), ctx.now);
                    }
                }
            }
            Timer::Refetch(id) => {
                let Some(w) = self.work.filter(|w| w.id == id) else { return };
                if self.machine.phase() == worker::Phase::Fetching(w.round) {
                    ctx.send(w.leader, Msg::Fetch { want: w.base });
                    ctx.timers.push((Self::refetch_ms(ctx), Timer::Refetch(id)));
                }
            }
            Timer::Resend(id) => {
                if let Some(w) = self.work.filter(|w| w.id == id) {
                    self.send(w, ctx);
                }
            }
            Timer::Lease => {}
        }
    }

    /// Sends `w`'s contribution to its leader, and again a lease later: a send lost
    /// on the way (a partition) would otherwise leave the round waiting for it.
    fn send(&self, w: Work, ctx: &mut Ctx<'_>) {
        let msg = Msg::Contribution { term: w.term, round: w.round, params: w.base.params, delta: w.delta };
        ctx.send(w.leader, msg);
        ctx.timers.push((ctx.setup.lease_ms, Timer::Resend(w.id)));
    }

    pub(super) fn on_msg(&mut self, from: usize, msg: Msg, ctx: &mut Ctx<'_>) {
        match msg {
            Msg::Lease { term, epoch, sent, announce } => {
                if !self.lease(from, term, ctx) {
                    ctx.send(from, Msg::Relay { follows: self.follows(ctx) });
                    return;
                }
                if let Some(a) = announce.filter(|a| a.term == term)
                    && self.announced(from, a, ctx)
                {
                    self.gossip(Msg::Gossip { origin: from, term, epoch, sent, announce: a }, ctx);
                }
            }
            Msg::Gossip { origin, term, announce, .. } if ctx.setup.is_candidate(origin) => {
                self.forwarded(origin, term, announce, msg, ctx);
            }
            Msg::Relay { follows: f } if f.term > self.follower.leases.term() && ctx.setup.is_candidate(f.leader) => {
                self.lease(f.leader, f.term, ctx);
            }
            Msg::Blob { state } => self.fetched(state, ctx),
            _ => {}
        }
    }

    /// Candidate `leader`'s lease of `term` (from it, or forwarded): whether the
    /// election takes it.
    fn lease(&mut self, leader: usize, term: u64, ctx: &Ctx<'_>) -> bool {
        let (valid, actions) = self.follower.leases.lease(ctx.setup.keys[leader], term, ctx.now);
        self.save(actions);
        valid
    }

    /// `origin`'s lease of `term` with announcement `a`, forwarded by another worker
    /// as `msg`: taken as a lease from `origin`; a stale one is refused without a
    /// word (the relay is not the stale leader, and the leader is not listening).
    fn forwarded(&mut self, origin: usize, term: u64, a: Announce, msg: Msg, ctx: &mut Ctx<'_>) {
        if self.lease(origin, term, ctx) && a.term == term && self.announced(origin, a, ctx) {
            self.gossip(msg, ctx);
        }
    }

    /// Forwards `msg` (a [`Msg::Gossip`]) to [`GOSSIP_FANOUT`] other workers drawn
    /// from the node's rng, unless it forwarded its announcement already.
    fn gossip(&mut self, msg: Msg, ctx: &mut Ctx<'_>) {
        let Msg::Gossip { announce, .. } = msg else { return };
        if self.gossiped.contains(&announce) {
            return;
        }
        if self.gossiped.len() == GOSSIP_MEMORY {
            self.gossiped.remove(0);
        }
        self.gossiped.push(announce);
        let mut others: Vec<usize> = (ctx.setup.candidates..ctx.setup.keys.len()).filter(|n| *n != ctx.me).collect();
        for _ in 0..GOSSIP_FANOUT.min(others.len()) {
            let to = others.swap_remove(ctx.rng.gen_range(0..others.len()));
            ctx.send(to, msg);
        }
    }

    /// A valid announcement from `leader`: whether the worker takes it (the
    /// follower's [`Take`]; a refused round is not forwarded).
    fn announced(&mut self, leader: usize, a: Announce, ctx: &mut Ctx<'_>) -> bool {
        let participant = a.participants & (1 << Self::index(ctx)) != 0;
        let opening = Opening { term: a.term, round: a.round, opened_ms: a.opened_ms };
        let seen = Announced { opening, base: Some(a.base.params), participant, finished: false };
        let (take, save) = self.follower.rounds.announced(&seen);
        self.save(save);
        match take {
            Take::Finished | Take::Seen | Take::Refused(_) => return false,
            Take::Skip | Take::Train => {}
        }
        // a newer round, or the round reopened: what it was doing is moot
        self.work = None;
        self.machine = Worker::new(ctx.setup.keys[ctx.me].0.to_vec(), 1, TAU);
        if take == Take::Skip {
            return true;
        }
        self.next_id += 1;
        let w = Work { id: self.next_id, term: a.term, leader, round: a.round, base: a.base, delta: [0.0; 4] };
        self.work = Some(w);
        let opened = worker::Input::RoundOpened { round: a.round, deadline_ms: u64::MAX, participant: true };
        for act in self.machine.handle(opened, ctx.now) {
            if let worker::Action::FetchParams(_) = act {
                ctx.send(leader, Msg::Fetch { want: a.base });
                ctx.timers.push((Self::refetch_ms(ctx), Timer::Refetch(w.id)));
            }
        }
        true
    }

    /// The parameters of the work's round arrived.
    fn fetched(&mut self, state: Replica, ctx: &mut Ctx<'_>) {
        let Some(w) = self.work.filter(|w| w.base == state) else { return };
        if self.machine.phase() != worker::Phase::Fetching(w.round) {
            return;
        }
        for act in self.machine.handle(worker::Input::ParamsReady(w.round), ctx.now) {
            if let worker::Action::Train { .. } = act {
                ctx.events.push(Event::Applied(w.base));
                let compute = ctx.rng.gen_range(1200..=2000);
                ctx.timers.push((compute, Timer::Trained(w.id)));
            }
        }
    }
}
