//! The world of a seeded run: nodes, their clocks and disks, the network, the
//! nemesis's faults as they start and end, and the invariants' record, in one
//! queue of events in simulated milliseconds.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use pcp_protocol::diloco::Tensors;
use pcp_protocol::diloco::shepherd::{self, Snapshot};
use pcp_protocol::election::Succession;
use pcp_protocol::failover::Replica;
use pcp_protocol::{PublicKey, RunId};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::candidate::{self, Candidate};
use super::invariants::{self, Checker, Registry, State, id};
use super::msg::{Ctx, Event, Msg, Setup, Timer};
use super::nemesis::{self, Fault, Kind, STRIKE_WITHIN_MS};
use super::net::Net;
use super::worker::{self, WorkerNode};
use super::{
    CANDIDATES, Invariant, LEASE_MS, Outcome, PROGRESS_BOUND_MS, Rule, Rules, SETTLE_MS, Violation, WORKERS,
    params_hash,
};

/// A node's monotonic clock: ms since its process started, at its own rate, plus
/// the jumps it saw.
#[derive(Clone, Copy, Debug)]
struct Clock {
    start: u64,
    /// Per mille of real time.
    rate: u64,
    jump: u64,
}

impl Clock {
    fn local(&self, global: u64) -> u64 {
        1 + self.jump + global.saturating_sub(self.start) * self.rate / 1000
    }

    /// Global ms for `local` of this clock's ms.
    fn global(&self, local: u64) -> u64 {
        (local * 1000).div_ceil(self.rate)
    }
}

#[derive(Debug)]
enum Role {
    Candidate(Box<Candidate>),
    Worker(Box<WorkerNode>),
    Down,
}

#[derive(Debug)]
enum Disk {
    Candidate(candidate::Disk),
    Worker(worker::Disk),
}

#[derive(Debug)]
struct Node {
    role: Role,
    /// The incarnation: timers of an earlier one are void.
    epoch: u64,
    clock: Clock,
    paused_until: u64,
    /// When it last started.
    up_since: u64,
    /// When it was last cut off from every node, or suspended, until.
    reachable_since: u64,
    disk: Option<Disk>,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Ev {
    /// `msg` arrives; a blob only if its sender did not die while sending it.
    Deliver {
        from: usize,
        to: usize,
        msg: Msg,
        sender: Option<u64>,
    },
    Timer {
        node: usize,
        epoch: u64,
        timer: Timer,
    },
    FaultStart(usize),
    FaultEnd(usize),
    /// A [`Kind::CrashAfterRound`] strikes.
    Strike(usize),
}

#[derive(Debug)]
struct Scheduled {
    at: u64,
    seq: u64,
    ev: Ev,
}

impl PartialEq for Scheduled {
    fn eq(&self, other: &Self) -> bool {
        (self.at, self.seq) == (other.at, other.seq)
    }
}
impl Eq for Scheduled {}
impl PartialOrd for Scheduled {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Scheduled {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (self.at, self.seq).cmp(&(other.at, other.seq))
    }
}

#[derive(Debug)]
pub(super) struct World {
    seed: u64,
    setup: Setup,
    now: u64,
    seq: u64,
    queue: BinaryHeap<Reverse<Scheduled>>,
    nodes: Vec<Node>,
    net: Net,
    faults: Vec<Fault>,
    /// Faults on the leader that found none to hit.
    skipped: Vec<bool>,
    /// Crashes waiting for the leader's next round.
    armed: Vec<usize>,
    active: Vec<Fault>,
    reg: Registry,
    check: Checker,
    net_rng: ChaCha8Rng,
    node_rng: ChaCha8Rng,
    log: Vec<String>,
    violation: Option<Violation>,
    healed: u64,
    progress: Option<u64>,
    end: u64,
    rounds: u64,
    terms: u64,
    events: u64,
}

fn stream(seed: u64, stream: u64) -> ChaCha8Rng {
    let mut r = ChaCha8Rng::seed_from_u64(seed);
    r.set_stream(stream);
    r
}

impl World {
    pub(super) fn new(seed: u64, rules: Rules) -> Self {
        let n = CANDIDATES + WORKERS;
        let keys: Vec<PublicKey> =
            (0..n).map(|i| PublicKey([if i < CANDIDATES { 1 + i as u8 } else { 100 + i as u8 }; 32])).collect();
        let succession = Succession::new(RunId([7; 32]), keys[0], &keys[1..CANDIDATES]);
        let shepherd = shepherd::Config {
            rounds: 1_000,
            start_workers: WORKERS,
            resume_grace_ms: LEASE_MS,
            min_quorum: 1,
            initial_deadline_ms: 6_000,
            min_deadline_ms: 3_000,
            max_deadline_ms: 8_000,
            heartbeat_timeout_ms: 2_500,
            norm_factor: f64::INFINITY,
            ..shepherd::Config::default()
        };
        let setup = Setup { succession, keys, candidates: CANDIDATES, lease_ms: LEASE_MS, shepherd, rules };
        let mut nemesis = stream(seed, 1);
        let faults = nemesis::schedule(&mut nemesis, n, CANDIDATES, LEASE_MS);
        let healed = faults.iter().map(|f| f.end).max().unwrap_or(0);
        let mut node_rng = stream(seed, 3);
        let nodes = (0..n)
            .map(|_| Node {
                role: Role::Down,
                epoch: 0,
                clock: Clock { start: 0, rate: node_rng.gen_range(980..=1020), jump: 0 },
                paused_until: 0,
                up_since: 0,
                reachable_since: 0,
                disk: None,
            })
            .collect();
        let mut w = Self {
            seed,
            setup,
            now: 0,
            seq: 0,
            queue: BinaryHeap::new(),
            nodes,
            net: Net::new(n),
            skipped: vec![false; faults.len()],
            armed: Vec::new(),
            faults,
            active: Vec::new(),
            reg: Registry::default(),
            check: Checker::default(),
            net_rng: stream(seed, 2),
            node_rng,
            log: Vec::new(),
            violation: None,
            healed,
            progress: None,
            end: healed + PROGRESS_BOUND_MS + 1,
            rounds: 0,
            terms: 1,
            events: 0,
        };
        let order: Vec<String> = w.setup.succession.order().iter().map(|k| w.setup.name(w.setup.index(k))).collect();
        w.say(format!("succession {}; faults heal at {:.3}s", order.join(" "), healed as f64 / 1e3));
        for i in 0..w.faults.len() {
            let f = w.faults[i];
            w.push(f.start, Ev::FaultStart(i));
            w.push(f.end, Ev::FaultEnd(i));
        }
        w
    }

    fn say(&mut self, line: String) {
        self.log.push(format!("{:>8.3}s  {line}", self.now as f64 / 1e3));
    }

    fn push(&mut self, at: u64, ev: Ev) {
        self.seq += 1;
        self.queue.push(Reverse(Scheduled { at, seq: self.seq, ev }));
    }

    fn initial() -> (Replica, State) {
        let params: Tensors = vec![vec![0.1, -0.2, 0.3, 0.05]];
        let replica = Replica { term: 1, round: 0, params: params_hash(&params) };
        let snapshot =
            Snapshot { completed: 0, params, velocity: vec![vec![0.0; 4]], durations: Vec::new(), norms: Vec::new() };
        (replica, State { parent: None, snapshot, contributors: Vec::new(), at: 0 })
    }

    /// Runs the schedule to its end, or to the first broken invariant.
    pub(super) fn run(mut self, without: Option<Rule>) -> Outcome {
        self.events_loop();
        Outcome {
            seed: self.seed,
            without,
            log: self.log,
            violation: self.violation,
            healed_ms: self.healed,
            progress_ms: self.progress,
            rounds: self.rounds,
            terms: self.terms,
            events: self.events,
        }
    }

    fn events_loop(&mut self) {
        let (initial, state) = Self::initial();
        self.reg.insert(id(&initial), state);
        for n in 0..self.nodes.len() {
            self.start(n, Some(initial));
        }
        while let Some(Reverse(s)) = self.queue.pop() {
            if s.at > self.end {
                break;
            }
            self.now = s.at;
            self.events += 1;
            self.step(s.ev);
            if self.violation.is_some() {
                break;
            }
            if self.progress.is_none() && self.now > self.healed + PROGRESS_BOUND_MS {
                let detail = format!(
                    "no round completed after the heal at {:.3}s reached a worker within {:.0}s",
                    self.healed as f64 / 1e3,
                    PROGRESS_BOUND_MS as f64 / 1e3
                );
                self.violation = Some(Violation { invariant: Invariant::Progress, at_ms: self.now, detail });
                break;
            }
        }
    }

    /// Starts node `n` (at the run's start, or restarting from its disk).
    fn start(&mut self, n: usize, initial: Option<Replica>) {
        let node = &mut self.nodes[n];
        node.epoch += 1;
        node.up_since = self.now;
        node.clock = Clock { start: self.now, rate: node.clock.rate, jump: 0 };
        let disk = node.disk.take();
        let candidate = self.setup.is_candidate(n);
        self.handle(n, |role, ctx| {
            *role = match (disk, initial) {
                (_, Some(initial)) if ctx.me == 0 => Role::Candidate(Box::new(Candidate::creator(initial, ctx))),
                (Some(Disk::Candidate(d)), _) => Role::Candidate(Box::new(Candidate::start(Some(d), ctx))),
                (Some(Disk::Worker(d)), _) => Role::Worker(Box::new(WorkerNode::start(Some(d), ctx))),
                (None, _) if candidate => Role::Candidate(Box::new(Candidate::start(None, ctx))),
                (None, _) => Role::Worker(Box::new(WorkerNode::start(None, ctx))),
            };
            let phase = |ctx: &mut Ctx<'_>, every: u64| ctx.rng.gen_range(1..=every);
            if candidate {
                let (t, l, b) = (phase(ctx, 100), phase(ctx, LEASE_MS / 3), phase(ctx, LEASE_MS / 2));
                ctx.timers.extend([(t, Timer::Tick), (l, Timer::Lease), (b, Timer::Beat)]);
            } else {
                let (t, b) = (phase(ctx, 250), phase(ctx, LEASE_MS / 2));
                ctx.timers.extend([(t, Timer::Tick), (b, Timer::Beat)]);
            }
        });
    }

    /// Runs `f` on node `n`'s role, then sends, sets timers and records what it asked.
    fn handle(&mut self, n: usize, f: impl FnOnce(&mut Role, &mut Ctx<'_>)) {
        let node = &mut self.nodes[n];
        let mut ctx = Ctx {
            me: n,
            now: node.clock.local(self.now),
            epoch: node.epoch,
            global: self.now,
            setup: &self.setup,
            reg: &mut self.reg,
            rng: &mut self.node_rng,
            sends: Vec::new(),
            timers: Vec::new(),
            events: Vec::new(),
        };
        f(&mut node.role, &mut ctx);
        let Ctx { sends, timers, events, .. } = ctx;
        let (clock, epoch) = (node.clock, node.epoch);
        for (to, msg, after) in sends {
            for delay in self.net.deliveries(n, to, &mut self.net_rng).into_iter().flatten() {
                let sender = (after > 0).then_some(epoch);
                self.push(self.now + clock.global(after) + delay, Ev::Deliver { from: n, to, msg, sender });
            }
        }
        for (after, timer) in timers {
            self.push(self.now + clock.global(after), Ev::Timer { node: n, epoch, timer });
        }
        for e in events {
            self.record(n, e);
        }
    }

    fn record(&mut self, n: usize, e: Event) {
        let name = self.setup.name(n);
        let broken = match e {
            Event::Log(line) => {
                self.say(line);
                Ok(())
            }
            Event::Leads(term) => {
                self.terms = self.terms.max(term);
                Ok(())
            }
            Event::Completed(x) => {
                for i in std::mem::take(&mut self.armed) {
                    if let Kind::CrashAfterRound { delay, .. } = self.faults[i].kind {
                        self.push(self.now + delay, Ev::Strike(i));
                    }
                }
                self.rounds = self.rounds.max(x.round);
                let setup = &self.setup;
                // only the newest term's rounds make the history: a deposed leader's are discarded
                if x.term >= self.terms {
                    self.check.completed(&self.reg, &name, &x, &|c| setup.name(c))
                } else {
                    Ok(())
                }
            }
            Event::Mixed { round, worker, trained } => Err((
                Invariant::OneHistory,
                format!(
                    "{name} completed round {round} with w{worker}'s pseudo-gradient, trained from {} of another history",
                    invariants::short(&trained)
                ),
            )),
            Event::Released(_) => Ok(()),
            Event::Replicated(r) => {
                self.check.replicated(n, &r);
                Ok(())
            }
            Event::Applied(r) => {
                let after_heal = self.reg.get(&id(&r)).is_some_and(|s| s.at > self.healed);
                if after_heal && self.progress.is_none() {
                    self.progress = Some(self.now);
                    self.end = self.now + SETTLE_MS;
                }
                self.check.applied(&self.reg, n, &name, &r)
            }
        };
        if let Err((invariant, detail)) = broken
            && self.violation.is_none()
        {
            self.violation = Some(Violation { invariant, at_ms: self.now, detail });
        }
    }

    fn step(&mut self, ev: Ev) {
        let node = match ev {
            Ev::Deliver { to, .. } => Some(to),
            Ev::Timer { node, .. } => Some(node),
            Ev::FaultStart(_) | Ev::FaultEnd(_) | Ev::Strike(_) => None,
        };
        if let Some(n) = node {
            let node = &self.nodes[n];
            if matches!(node.role, Role::Down) {
                return;
            }
            if node.paused_until > self.now {
                // a suspended process reads its queue when it wakes
                let at = node.paused_until;
                self.push(at, ev);
                return;
            }
        }
        match ev {
            Ev::Deliver { from, sender: Some(epoch), .. } if self.nodes[from].epoch != epoch => {}
            Ev::Deliver { from, to, msg, .. } => self.handle(to, |role, ctx| match role {
                Role::Candidate(c) => c.on_msg(from, msg, ctx),
                Role::Worker(w) => w.on_msg(from, msg, ctx),
                Role::Down => {}
            }),
            Ev::Timer { node, epoch, timer } => {
                if self.nodes[node].epoch != epoch {
                    return;
                }
                self.handle(node, |role, ctx| match role {
                    Role::Candidate(c) => c.on_timer(timer, ctx),
                    Role::Worker(w) => w.on_timer(timer, ctx),
                    Role::Down => {}
                });
            }
            Ev::FaultStart(i) => self.fault(i, true),
            Ev::FaultEnd(i) => self.fault(i, false),
            Ev::Strike(i) => self.strike(i),
        }
    }

    /// Whether candidate `c` holds what the run committed: it is up, awake and
    /// reachable, and has been for three leases (the leader waits for it before it
    /// tells workers of a round).
    fn settled(&self, c: usize) -> bool {
        let node = &self.nodes[c];
        let isolated = self.active.iter().any(|f| f.kind == Kind::Isolate { node: c });
        !matches!(node.role, Role::Down)
            && node.paused_until <= self.now
            && !isolated
            // the nodes that started the run hold its first state from the start
            && (node.up_since.max(node.reachable_since) == 0
                || self.now >= node.up_since.max(node.reachable_since) + 3 * LEASE_MS)
    }

    /// Why the run could not survive `kind` now, if it could not: the leader is
    /// never cut off from the other candidates, and a candidate is crashed, paused
    /// or cut off only while another holds what the run committed (see the module
    /// docs).
    fn unsurvivable(&self, kind: Kind) -> Option<&'static str> {
        let hit = match kind {
            Kind::Isolate { node } if self.leader() == Some(node) => {
                return Some("the leader is never cut off from the other candidates");
            }
            Kind::Crash { node, .. } | Kind::Pause { node } | Kind::Isolate { node } => node,
            _ => return None,
        };
        let other = (0..CANDIDATES).any(|c| c != hit && self.settled(c));
        (hit < CANDIDATES && !other).then_some("no other candidate has been up and reachable for three leases")
    }

    /// The candidate leading the highest term, if one is up.
    fn leader(&self) -> Option<usize> {
        (0..CANDIDATES)
            .filter_map(|c| match &self.nodes[c].role {
                Role::Candidate(k) if k.term().1 => Some((k.term().0, c)),
                _ => None,
            })
            .max()
            .map(|(_, c)| c)
    }

    /// A crash waiting for a round strikes whoever leads now.
    fn strike(&mut self, i: usize) {
        let Kind::CrashAfterRound { disk, .. } = self.faults[i].kind else { return };
        self.armed.retain(|a| *a != i);
        let Some(leader) = self.leader().filter(|l| self.nodes[*l].paused_until <= self.now) else {
            self.skipped[i] = true;
            return;
        };
        self.faults[i].kind = Kind::Crash { node: leader, disk };
        self.fault(i, true);
    }

    fn fault(&mut self, i: usize, starts: bool) {
        if let Kind::CrashAfterRound { .. } = self.faults[i].kind {
            if starts {
                // armed: it strikes after the leader's next round, or at the latest in STRIKE_WITHIN_MS
                self.armed.push(i);
                self.push(self.now + STRIKE_WITHIN_MS, Ev::Strike(i));
            } else {
                self.skipped[i] = true;
            }
            return;
        }
        if starts && self.faults[i].kind.targets_leader() {
            // it hits whoever leads now: no leader, or one already down or paused, and it is void
            let leader = self.leader().filter(|l| self.nodes[*l].paused_until <= self.now);
            match leader {
                Some(l) => self.faults[i].kind = self.faults[i].kind.on(l),
                None => {
                    self.skipped[i] = true;
                    return;
                }
            }
        }
        if starts && let Some(why) = self.unsurvivable(self.faults[i].kind) {
            self.skipped[i] = true;
            let setup = &self.setup;
            let line = nemesis::describe(&self.faults[i], self.nodes.len(), &|x| setup.name(x));
            self.say(format!("nemesis: spares the run \"{line}\": {why}"));
            return;
        }
        if self.skipped[i] {
            return;
        }
        let f = self.faults[i];
        let n = self.nodes.len();
        if starts && !self.skipped[i] {
            let setup = &self.setup;
            let line = nemesis::describe(&f, n, &|x| setup.name(x));
            let until = if f.end > f.start { format!(" until {:.3}s", f.end as f64 / 1e3) } else { String::new() };
            let role = match f.kind {
                Kind::Crash { node, .. } | Kind::Pause { node } => match &self.nodes[node].role {
                    Role::Candidate(c) if c.term().1 => format!(" (the leader of term {})", c.term().0),
                    _ => String::new(),
                },
                _ => String::new(),
            };
            self.say(format!("nemesis: {line}{role}{until}"));
        }
        match f.kind {
            Kind::Crash { node, disk } if starts => {
                let dying = std::mem::replace(&mut self.nodes[node].role, Role::Down);
                self.nodes[node].epoch += 1;
                self.nodes[node].disk = match dying {
                    Role::Candidate(c) if disk => Some(Disk::Candidate(c.disk())),
                    Role::Worker(w) if disk => Some(Disk::Worker(w.disk())),
                    _ => None,
                };
                if !disk {
                    // what it replicated or applied is gone: a new node comes back
                    self.check.forget(node);
                }
            }
            Kind::Crash { node, disk } => {
                let name = self.setup.name(node);
                self.say(format!("{name} restarts {}", if disk { "from its disk" } else { "with an empty disk" }));
                self.start(node, None);
            }
            Kind::Pause { node } if starts => self.nodes[node].paused_until = f.end,
            Kind::Jump { node, ms } if starts => self.nodes[node].clock.jump += ms,
            // a process that was suspended has to catch up like one that restarted
            Kind::Pause { node } => self.nodes[node].reachable_since = self.now,
            Kind::Jump { .. } => {}
            _ => {
                if starts {
                    self.active.push(f);
                } else {
                    self.active.retain(|a| *a != f);
                    if let Kind::Isolate { node } = f.kind {
                        self.nodes[node].reachable_since = self.now;
                    }
                    let setup = &self.setup;
                    let line = nemesis::describe(&f, n, &|x| setup.name(x));
                    self.say(format!("heals: {line}"));
                }
                nemesis::apply(&mut self.net, n, &self.active);
            }
        }
    }
}
