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
use super::msg::{Ctx, Event, Mode, Msg, Setup, Timer};
use super::nemesis::{self, Envelope, Fault, KEPT_WORKERS, Kind, STRIKE_WITHIN_MS};
use super::net::Net;
use super::worker::{self, WorkerNode};
use super::{Invariant, LEASE_MS, Outcome, Rule, Rules, SETTLE_MS, Violation, WORKERS, params_hash, progress_bound_ms};

/// A node's monotonic clock: ms since its process started, at its own rate, plus
/// the jumps it saw, less the pauses it slept through with its clock stopped.
#[derive(Clone, Copy, Debug)]
struct Clock {
    start: u64,
    /// Per mille of real time.
    rate: u64,
    jump: u64,
    /// Global ms it did not count (pauses with the clock stopped; nothing reads
    /// the clock of a paused node, so it never runs back for anyone).
    stopped: u64,
}

impl Clock {
    fn local(&self, global: u64) -> u64 {
        1 + self.jump + global.saturating_sub(self.start).saturating_sub(self.stopped) * self.rate / 1000
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
    /// Crashed for good: it never restarts, and later faults on it are void.
    gone: bool,
    /// The last term it said it leads.
    led: u64,
    /// It applied a state completed after the heal (a worker).
    fresh: bool,
    /// It holds a state (a candidate that replicated, led or completed one), until
    /// it loses its disk.
    holds: bool,
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

/// A message a [`Kind::Queue`] fault holds: sent by incarnation `epoch` of
/// `from` (lost if that incarnation dies before it goes), ready to go on the link
/// at `ready` (global ms).
#[derive(Clone, Copy, Debug)]
struct Held {
    from: usize,
    to: usize,
    msg: Msg,
    epoch: u64,
    ready: u64,
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
    /// The recorded runs of candidates that crashed (when the setup traces).
    traces: Vec<pcp_protocol::failover::candidate::trace::Trace>,
    seed: u64,
    setup: Setup,
    env: Envelope,
    now: u64,
    seq: u64,
    queue: BinaryHeap<Reverse<Scheduled>>,
    nodes: Vec<Node>,
    net: Net,
    /// What held links hold, in the order it was sent.
    held: Vec<Held>,
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
    /// Invariant (d)'s bound, ms after the heal.
    bound: u64,
    progress: Option<u64>,
    /// When every worker up had applied a state completed after the heal.
    caught_up: Option<u64>,
    /// Terms taken after the heal.
    terms_after_heal: u64,
    /// A majority of the candidates have held a state at once: the run's first
    /// state is committed, no longer on its creator alone.
    first_committed: bool,
    /// A worker applied a state past the first: the run has started (a shepherd
    /// that resumes from the first state waits for all its start workers).
    started: bool,
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

/// The seed's draws of the run's shape: how many candidates (3 mostly, 5 or 2
/// about one seed in seven each) and how long a state blob takes to transfer
/// (100 to 1,200 ms, or for one seed in five a large model's 4 to 40 s: 500 MB
/// on 100 Mbit/s is 40 s).
fn shape(seed: u64) -> (usize, (u64, u64)) {
    let mut rng = stream(seed, 4);
    let candidates = match rng.gen_range(0..100) {
        0..15 => 2,
        15..30 => 5,
        _ => 3,
    };
    let transfer = if rng.gen_bool(0.2) { (4_000, 40_000) } else { (100, 1_200) };
    (candidates, transfer)
}

/// The settings of a run of `candidates` candidates and `WORKERS` workers.
fn setup(candidates: usize, transfer_ms: (u64, u64), rules: Rules) -> Setup {
    let n = candidates + WORKERS;
    let keys: Vec<PublicKey> =
        (0..n).map(|i| PublicKey([if i < candidates { 1 + i as u8 } else { 100 + i as u8 }; 32])).collect();
    let succession = Succession::new(RunId([7; 32]), keys[0], &keys[1..candidates]);
    let shepherd = shepherd::Config {
        rounds: 1_000,
        start_workers: WORKERS,
        resume_grace_ms: LEASE_MS,
        min_quorum: 1,
        // a round's deadline allows for its state's slowest transfer to a worker
        initial_deadline_ms: 6_000 + transfer_ms.1,
        min_deadline_ms: 3_000 + transfer_ms.1,
        max_deadline_ms: 8_000 + transfer_ms.1,
        heartbeat_timeout_ms: 2_500,
        norm_factor: f64::INFINITY,
        ..shepherd::Config::default()
    };
    let mode = Mode::for_candidates(candidates);
    Setup { succession, keys, candidates, lease_ms: LEASE_MS, shepherd, rules, mode, transfer_ms, trace: false }
}

impl World {
    pub(super) fn new(seed: u64, rules: Rules) -> Self {
        let (candidates, transfer_ms) = shape(seed);
        let setup = setup(candidates, transfer_ms, rules);
        let n = setup.keys.len();
        let env = Envelope::of(setup.mode, candidates, n, LEASE_MS);
        let faults = nemesis::schedule(&mut stream(seed, 1), &env);
        let healed = faults.iter().map(|f| f.end).max().unwrap_or(0);
        let bound = progress_bound_ms(candidates, transfer_ms.1);
        let mut node_rng = stream(seed, 3);
        let drift = Envelope::drift(setup.mode);
        let nodes = (0..n)
            .map(|_| Node {
                role: Role::Down,
                epoch: 0,
                clock: Clock { start: 0, rate: node_rng.gen_range(drift.clone()), jump: 0, stopped: 0 },
                paused_until: 0,
                up_since: 0,
                reachable_since: 0,
                disk: None,
                gone: false,
                led: 0,
                fresh: false,
                holds: false,
            })
            .collect();
        let mut w = Self {
            traces: Vec::new(),
            seed,
            setup,
            env,
            now: 0,
            seq: 0,
            queue: BinaryHeap::new(),
            nodes,
            net: Net::new(n),
            held: Vec::new(),
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
            bound,
            progress: None,
            caught_up: None,
            terms_after_heal: 0,
            first_committed: false,
            started: false,
            // (f)'s deadline: the run ends sooner once every worker up caught up
            end: healed + 2 * bound,
            rounds: 0,
            terms: 1,
            events: 0,
        };
        let order: Vec<String> = w.setup.succession.order().iter().map(|k| w.setup.name(w.setup.index(k))).collect();
        w.say(format!(
            "succession {}; faults heal at {:.3}s; progress bound {:.1}s",
            order.join(" "),
            healed as f64 / 1e3,
            bound as f64 / 1e3
        ));
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
        let velocity = vec![vec![0.0; 4]];
        let learned = Default::default();
        let snapshot = Snapshot { completed: 0, params, velocity, durations: Vec::new(), norms: Vec::new(), learned };
        (replica, State { parent: None, snapshot, contributors: Vec::new(), at: 0 })
    }

    /// Candidates record their runs.
    pub(super) fn traced(mut self) -> Self {
        self.setup.trace = true;
        self
    }

    /// [`Self::run`], and every candidate's recorded run (one per start).
    pub(super) fn run_traced(
        mut self,
        without: Option<Rule>,
    ) -> (Outcome, Vec<pcp_protocol::failover::candidate::trace::Trace>) {
        self.events_loop();
        let mut traces = std::mem::take(&mut self.traces);
        for node in &mut self.nodes {
            if let Role::Candidate(c) = &mut node.role {
                traces.extend(c.take_trace());
            }
        }
        (self.outcome(without), traces)
    }

    /// Runs the schedule to its end, or to the first broken invariant.
    pub(super) fn run(mut self, without: Option<Rule>) -> Outcome {
        self.events_loop();
        self.outcome(without)
    }

    fn outcome(self, without: Option<Rule>) -> Outcome {
        Outcome {
            seed: self.seed,
            without,
            candidates: self.setup.candidates,
            best_effort: self.setup.mode == Mode::BestEffort,
            transfer_ms: self.setup.transfer_ms,
            log: self.log,
            violation: self.violation,
            healed_ms: self.healed,
            progress_bound_ms: self.bound,
            progress_ms: self.progress,
            caught_up_ms: self.caught_up,
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
            if self.violation.is_none() {
                self.violation = self.overdue(self.now);
            }
            if self.violation.is_some() {
                return;
            }
        }
        // the run's end: whatever is still owed is overdue
        self.violation = self.overdue(self.end.max(self.now));
    }

    /// Invariants (d) and (f) at `at`: no worker trained from a round completed
    /// after the heal within the bound, or a worker up has not yet at the run's
    /// last deadline.
    fn overdue(&self, at: u64) -> Option<Violation> {
        let heal = self.healed as f64 / 1e3;
        if self.progress.is_none() && at > self.healed + self.bound {
            let detail = format!(
                "no round completed after the heal at {heal:.3}s reached a worker within {:.1}s",
                self.bound as f64 / 1e3
            );
            return Some(Violation { invariant: Invariant::Progress, at_ms: at, detail });
        }
        if self.caught_up.is_none() && at >= self.healed + 2 * self.bound {
            let behind: Vec<String> = self.behind().map(|w| self.setup.name(w)).collect();
            let detail = format!(
                "{} up but applied no state completed after the heal at {heal:.3}s within {:.1}s",
                behind.join(" "),
                2.0 * self.bound as f64 / 1e3
            );
            return Some(Violation { invariant: Invariant::WorkersCatchUp, at_ms: at, detail });
        }
        None
    }

    /// The workers up (not crashed for good) that have applied no state completed
    /// after the heal.
    fn behind(&self) -> impl Iterator<Item = usize> + '_ {
        (self.setup.candidates..self.nodes.len()).filter(|w| !self.nodes[*w].gone && !self.nodes[*w].fresh)
    }

    /// Starts node `n` (at the run's start, or restarting from its disk).
    fn start(&mut self, n: usize, initial: Option<Replica>) {
        let node = &mut self.nodes[n];
        node.epoch += 1;
        node.up_since = self.now;
        node.clock = Clock { start: self.now, rate: node.clock.rate, jump: 0, stopped: 0 };
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
            let ready = self.now + clock.global(after);
            if self.net.holds(n, to) {
                self.held.push(Held { from: n, to, msg, epoch, ready });
                continue;
            }
            for delay in self.net.deliveries(n, to, &mut self.net_rng).into_iter().flatten() {
                let sender = (after > 0).then_some(epoch);
                self.push(ready + delay, Ev::Deliver { from: n, to, msg, sender });
            }
        }
        for (after, timer) in timers {
            self.push(self.now + clock.global(after), Ev::Timer { node: n, epoch, timer });
        }
        for e in events {
            self.record(n, e);
        }
    }

    /// Hands what links no longer hold back to them, in the order it was sent, each
    /// after its link's delay from now (and never before what was sent before it on
    /// that link). Its sender must still be the incarnation that sent it.
    fn release_held(&mut self) {
        let (go, keep): (Vec<Held>, Vec<Held>) =
            std::mem::take(&mut self.held).into_iter().partition(|h| !self.net.holds(h.from, h.to));
        self.held = keep;
        let mut last: Vec<((usize, usize), u64)> = Vec::new();
        for h in go {
            for delay in self.net.deliveries(h.from, h.to, &mut self.net_rng).into_iter().flatten() {
                let mut at = self.now.max(h.ready) + delay;
                match last.iter_mut().find(|(link, _)| *link == (h.from, h.to)) {
                    Some((_, prev)) => {
                        at = at.max(*prev);
                        *prev = at;
                    }
                    None => last.push(((h.from, h.to), at)),
                }
                let ev = Ev::Deliver { from: h.from, to: h.to, msg: h.msg, sender: Some(h.epoch) };
                self.push(at, ev);
            }
        }
    }

    fn record(&mut self, n: usize, e: Event) {
        let name = self.setup.name(n);
        let broken = match e {
            Event::Log(line) => {
                self.say(line);
                Ok(())
            }
            Event::Leads(term) => self.leads(n, term),
            Event::Completed(x) => {
                for i in std::mem::take(&mut self.armed) {
                    if let Kind::CrashAfterRound { delay, .. } = self.faults[i].kind {
                        self.push(self.now + delay, Ev::Strike(i));
                    }
                }
                self.rounds = self.rounds.max(x.round);
                self.holds(n);
                let setup = &self.setup;
                self.check.completed(&self.reg, &name, &x, &|c| setup.name(c))
            }
            Event::Mixed { round, worker, trained } => Err((
                Invariant::OneHistory,
                format!(
                    "{name} completed round {round} with w{worker}'s pseudo-gradient, trained from {} of another history",
                    invariants::short(&trained)
                ),
            )),
            Event::Replicated(r) => {
                self.holds(n);
                self.check.replicated(n, &r);
                Ok(())
            }
            Event::Released(base) => {
                let term = self.nodes[n].led;
                self.check.released(&self.reg, &name, &base, term)
            }
            Event::Applied(r) => self.applied(n, &name, &r),
        };
        if let Err((invariant, detail)) = broken
            && self.violation.is_none()
        {
            self.violation = Some(Violation { invariant, at_ms: self.now, detail });
        }
    }

    /// Candidate `n` holds a state.
    fn holds(&mut self, n: usize) {
        self.nodes[n].holds = true;
        let holders = self.nodes[..self.setup.candidates].iter().filter(|c| c.holds).count();
        self.first_committed |= holders > self.setup.candidates / 2;
    }

    /// (e): node `n` leads `term`; after the heal, at most 2 × candidates + 2 terms.
    fn leads(&mut self, n: usize, term: u64) -> Result<(), invariants::Broken> {
        self.terms = self.terms.max(term);
        self.nodes[n].led = term;
        self.holds(n);
        if self.now <= self.healed {
            return Ok(());
        }
        self.terms_after_heal += 1;
        let most = 2 * self.setup.candidates as u64 + 2;
        if self.terms_after_heal <= most {
            return Ok(());
        }
        Err((
            Invariant::TermChurn,
            format!(
                "{} takes term {term}: {} terms taken since the heal at {:.3}s, at most {most} allowed",
                self.setup.name(n),
                self.terms_after_heal,
                self.healed as f64 / 1e3
            ),
        ))
    }

    /// Worker `n` applied `r`: (a) and (b), and the progress (d) and (f) wait for.
    fn applied(&mut self, n: usize, name: &str, r: &Replica) -> Result<(), invariants::Broken> {
        self.started |= r.round > 0;
        let after_heal = self.reg.get(&id(r)).is_some_and(|s| s.at > self.healed);
        if after_heal {
            self.progress.get_or_insert(self.now);
            self.nodes[n].fresh = true;
            if self.caught_up.is_none() && self.behind().next().is_none() {
                self.caught_up = Some(self.now);
                self.end = self.end.min(self.now + SETTLE_MS);
            }
        }
        self.check.applied(&self.reg, n, name, r)
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

    /// Whether candidate `c` holds what the run committed: it holds a state, is
    /// up, awake and reachable, and has been for three leases and the slowest
    /// transfer (the leader waits for it before it tells workers of a round).
    fn settled(&self, c: usize) -> bool {
        let node = &self.nodes[c];
        let isolated = self.active.iter().any(|f| f.kind == Kind::Isolate { node: c }) || !self.connected(c);
        let since = node.up_since.max(node.reachable_since);
        node.holds
            && !matches!(node.role, Role::Down)
            && node.paused_until <= self.now
            && !isolated
            && self.now >= since + 3 * LEASE_MS + self.setup.transfer_ms.1
    }

    /// Whether candidate `c` reaches every other candidate both ways (no cut, split,
    /// partition or queue between them).
    fn connected(&self, c: usize) -> bool {
        (0..self.setup.candidates).filter(|o| *o != c).all(|o| !self.net.blocked(c, o) && !self.net.blocked(o, c))
    }

    /// Whether the crash `kind` loses its node for good: one so marked, or in a
    /// majority run a candidate without its disk (its identity key was on it).
    fn for_good(&self, kind: Kind) -> bool {
        match kind {
            Kind::Crash { node, disk, permanent } => {
                permanent || (self.setup.mode == Mode::Majority && self.setup.is_candidate(node) && !disk)
            }
            _ => false,
        }
    }

    /// Why the run could not survive `kind` now, if it could not. A node crashed for
    /// good takes no more faults; a majority of the candidates and two workers
    /// outlive the run. In a best-effort run the leader is never cut off from the
    /// other candidates, and a candidate is crashed, paused or cut off only while
    /// another holds what the run committed (see the module docs).
    fn unsurvivable(&self, kind: Kind) -> Option<&'static str> {
        if kind.node().is_some_and(|n| self.nodes[n].gone) {
            return Some("it is gone for good");
        }
        if let Kind::Crash { node, .. } = kind
            && matches!(self.nodes[node].role, Role::Down)
        {
            return Some("it is down already");
        }
        if let Kind::Crash { node, .. } = kind
            && self.for_good(kind)
            && self.setup.is_candidate(node)
            && !self.first_committed
        {
            return Some("the run's first state is on no majority of the candidates yet");
        }
        if self.for_good(kind) {
            let gone = |nodes: std::ops::Range<usize>| nodes.filter(|n| self.nodes[*n].gone).count();
            let (c, n) = (self.setup.candidates, self.nodes.len());
            match kind.node() {
                Some(x) if x < c && gone(0..c) >= self.env.lost_candidates() => {
                    return Some("a majority of the candidates outlives the run");
                }
                Some(x) if x >= c && n - c - gone(c..n) <= KEPT_WORKERS => {
                    return Some("two workers outlive the run");
                }
                Some(x) if x >= c && !self.started => {
                    return Some("the run has not started: its first round waits for every worker");
                }
                _ => {}
            }
        }
        if self.setup.mode == Mode::Majority {
            return None;
        }
        let hit = match kind {
            Kind::Isolate { node } if self.leader() == Some(node) => {
                return Some("the leader is never cut off from the other candidates");
            }
            Kind::Crash { node, .. } | Kind::Pause { node, .. } | Kind::Isolate { node } => node,
            _ => return None,
        };
        let other = (0..self.setup.candidates).any(|c| c != hit && self.settled(c));
        (self.setup.is_candidate(hit) && !other)
            .then_some("no other candidate has been up and reachable for three leases")
    }

    /// The candidate leading the highest term, if one is up.
    fn leader(&self) -> Option<usize> {
        (0..self.setup.candidates)
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
        if self.skipped[i] {
            return;
        }
        self.armed.retain(|a| *a != i);
        let Some(leader) = self.leader().filter(|l| self.nodes[*l].paused_until <= self.now) else {
            self.skipped[i] = true;
            return;
        };
        self.faults[i].kind = Kind::Crash { node: leader, disk, permanent: false };
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
                Some(l) => self.faults[i].kind = self.faults[i].kind.aimed_at(l, self.setup.candidates),
                None => {
                    self.skipped[i] = true;
                    return;
                }
            }
        }
        if starts && let Some(why) = self.unsurvivable(self.faults[i].kind) {
            self.skipped[i] = true;
            let line = self.describe(&self.faults[i]);
            self.say(format!("nemesis: spares the run \"{line}\": {why}"));
            return;
        }
        if self.skipped[i] {
            return;
        }
        let f = self.faults[i];
        if starts {
            self.announce(&f);
        }
        match f.kind {
            Kind::Crash { node, disk, .. } if starts => self.crash(node, disk, self.for_good(f.kind)),
            Kind::Crash { node, disk, .. } => {
                let name = self.setup.name(node);
                if self.nodes[node].gone {
                    self.say(format!("{name} stays down for good"));
                } else {
                    self.say(format!("{name} restarts {}", if disk { "from its disk" } else { "with an empty disk" }));
                    self.start(node, None);
                }
            }
            Kind::Pause { node, frozen } if starts => {
                self.nodes[node].paused_until = f.end;
                if frozen {
                    self.nodes[node].clock.stopped += f.end - f.start;
                }
            }
            Kind::Jump { node, ms } if starts => self.nodes[node].clock.jump += ms,
            // a process that was suspended has to catch up like one that restarted
            Kind::Pause { node, .. } => self.nodes[node].reachable_since = self.now,
            Kind::Jump { .. } => {}
            _ => self.link_fault(f, starts),
        }
    }

    /// Says that fault `f` starts.
    fn announce(&mut self, f: &Fault) {
        let line = self.describe(f);
        let until = if f.end > f.start { format!(" until {:.3}s", f.end as f64 / 1e3) } else { String::new() };
        let role = match f.kind {
            Kind::Crash { node, .. } | Kind::Pause { node, .. } => match &self.nodes[node].role {
                Role::Candidate(c) if c.term().1 => format!(" (the leader of term {})", c.term().0),
                _ => String::new(),
            },
            _ => String::new(),
        };
        self.say(format!("nemesis: {line}{role}{until}"));
    }

    fn describe(&self, f: &Fault) -> String {
        let setup = &self.setup;
        nemesis::describe(f, self.nodes.len(), &|x| setup.name(x))
    }

    /// Node `node` dies, keeping its disk or not, for good or to restart.
    fn crash(&mut self, node: usize, disk: bool, for_good: bool) {
        let mut dying = std::mem::replace(&mut self.nodes[node].role, Role::Down);
        if let Role::Candidate(c) = &mut dying {
            self.traces.extend(c.take_trace());
        }
        self.nodes[node].epoch += 1;
        self.nodes[node].gone = for_good;
        self.nodes[node].disk = match dying {
            Role::Candidate(c) if disk => Some(Disk::Candidate(c.disk())),
            Role::Worker(w) if disk => Some(Disk::Worker(w.disk())),
            _ => None,
        };
        if !disk {
            // what it replicated or applied is gone: a new node comes back
            self.nodes[node].holds = false;
            self.check.forget(node);
        }
    }

    /// A link fault `f` starts or ends: the links as the active faults leave them,
    /// and what held links no longer hold handed back to them.
    fn link_fault(&mut self, f: Fault, starts: bool) {
        let cut_off: Vec<usize> = (0..self.setup.candidates).filter(|c| !self.connected(*c)).collect();
        if starts {
            self.active.push(f);
        } else {
            self.active.retain(|a| *a != f);
            if let Kind::Isolate { node } = f.kind {
                self.nodes[node].reachable_since = self.now;
            }
            let line = self.describe(&f);
            self.say(format!("heals: {line}"));
        }
        nemesis::apply(&mut self.net, self.nodes.len(), &self.active);
        for c in cut_off {
            if self.connected(c) {
                // reachable again: it catches up like a candidate that restarted
                self.nodes[c].reachable_since = self.now;
            }
        }
        self.release_held();
    }
}

#[cfg(test)]
mod tests;
