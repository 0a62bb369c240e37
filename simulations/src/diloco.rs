//! DiLoCo in a star, driven by pcp's real [`Shepherd`] and [`Worker`] state
//! machines.
//!
//! Events run in simulated time (microseconds, ties broken by insertion
//! order). The shepherd's state machine sees what the node's shepherd sees:
//! joins, goodbyes, contributions and deadline ticks; each worker's state
//! machine sees its round announcement, parameters ready, training done and
//! send done, and what they answer decides what happens next (a worker told
//! to abandon a round sends nothing).
//!
//! Simplifications, all deliberate:
//! * Heartbeats are not sent one by one. Workers see a new round at their
//!   next heartbeat tick (every `poll_s`, each with its own phase) plus a
//!   round trip; the shepherd is told that a crashed worker left exactly one
//!   heartbeat timeout after it crashed (what its expiry would do), and a
//!   worker that says goodbye at once. The state machine's own expiry is
//!   switched off.
//! * When a round opens, every participant's fetch and upload is planned at
//!   once: fetches share the shepherd's uplink (times `swarm`, for workers
//!   that serve the blob to each other), uploads its downlink, each capped by
//!   the worker's link ([`fair_share`]). A flow cancelled later (a worker that
//!   leaves or abandons) does not give its bandwidth back to the others, and
//!   uploads of consecutive rounds do not share the link.
//! * After a round closes, the shepherd spends `overhead_s` (validation,
//!   checkpoint) before the next announcement is visible.
//! * The shepherd decodes, validates and adds contributions one at a time,
//!   `decode_s` each ([`crate::decode`]): a contribution reaches its state
//!   machine once those before it are done and its own `decode_s` has passed,
//!   so a queue at the shepherd can make contributions late.
//! * Sparse runs: a worker that holds the previous round's parameters (it
//!   fetched them, whether or not it finished the round) fetches only the
//!   shepherd's update (`update_bytes`); joiners and workers that missed a
//!   round fetch the whole fp32 parameters. Whether a worker holds them is
//!   decided when the round opens, so one still fetching the previous round's
//!   parameters then is charged the whole blob.
//! * Workers obey their state machine: `Abandon` means the round is neither
//!   trained further nor sent (pcp-node's worker ignores `Abandon` today and
//!   sends late contributions anyway).
//! * The shepherd holds one tensor of 4 values; wire sizes come from the
//!   modelled model. Hostile workers send NaN and the real validation
//!   rejects them.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};

use pcp_protocol::diloco::aggregate::Rejection;
use pcp_protocol::diloco::shepherd::{self, Action, Input, Shepherd};
use pcp_protocol::diloco::worker::{self, Worker};
use rand::Rng;
use rand_chacha::ChaCha8Rng;

use crate::network::{Flow, fair_share};
use crate::report::{RoundStats, StrategyReport, Summary};
use crate::world::{NodeSpec, Stream, World, rng};

/// What the star simulation needs besides the world.
#[derive(Clone, Debug, PartialEq)]
pub struct StarSetup {
    /// Rounds to run.
    pub rounds: u64,
    /// Workers at the start.
    pub workers: usize,
    /// Inner steps per round.
    pub tau: u64,
    /// Seconds per inner step on a typical worker.
    pub step_seconds: f64,
    /// Bytes of the parameters blob.
    pub params_bytes: f64,
    /// Bytes of one contribution.
    pub contribution_bytes: f64,
    /// Sparse runs: bytes of the shepherd's update, what a worker holding the previous
    /// round's parameters fetches instead of them.
    pub update_bytes: Option<f64>,
    /// Seconds the shepherd spends decoding, validating and adding one contribution.
    pub decode_s: f64,
    /// Shepherd work between a close and the next announcement, seconds.
    pub overhead_s: f64,
    /// The parameters blob is served at `swarm` × the shepherd's uplink.
    pub swarm: f64,
    /// Expected leaves per worker per hour (and as many joins).
    pub churn_per_hour: f64,
    /// Fraction of leaves that are crashes (noticed after the heartbeat timeout).
    pub crash_fraction: f64,
    /// The shepherd's state machine settings (its heartbeat timeout is the crash-notice delay).
    pub shepherd: shepherd::Config,
    /// The run seed.
    pub seed: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Ev {
    Discover { w: u32, r: u64 },
    ParamsReady { w: u32, r: u64, train_us: u64, arrive_us: u64, bytes: u64 },
    Trained { w: u32, r: u64, arrive_us: u64 },
    Arrive { w: u32, r: u64 },
    Decoded { w: u32, r: u64 },
    Deadline { r: u64 },
    Join,
    Leave { w: u32 },
    Notice { w: u32 },
}

#[derive(Debug)]
struct WorkerState {
    spec: NodeSpec,
    machine: Worker,
    alive: bool,
    training: Option<(u64, u64)>,
    /// Until when it is busy sending round `busy.0`'s contribution.
    busy: Option<(u64, u64)>,
    /// The round whose parameters it holds.
    held: Option<u64>,
}

fn us(s: f64) -> u64 {
    (s.max(0.0) * 1e6).round() as u64
}

fn secs(t: u64) -> f64 {
    t as f64 / 1e6
}

fn exp_us(rng: &mut ChaCha8Rng, rate_per_s: f64) -> u64 {
    if rate_per_s <= 0.0 {
        return u64::MAX;
    }
    let u: f64 = rng.r#gen();
    us(-(1.0 - u).ln() / rate_per_s).min(u64::MAX / 4)
}

struct Sim<'a> {
    setup: &'a StarSetup,
    world: World,
    shepherd: Shepherd<u32>,
    workers: Vec<WorkerState>,
    queue: BinaryHeap<Reverse<(u64, u64, Ev)>>,
    seq: u64,
    now: u64,
    churn: ChaCha8Rng,
    jitter: ChaCha8Rng,
    delta: ChaCha8Rng,
    /// Compute finished per round trained.
    compute: BTreeMap<u64, f64>,
    /// What happened since the last close: bytes, drops, abandons.
    window: RoundStats,
    deadlines: BTreeMap<u64, u64>,
    /// When the shepherd is done with the contributions it has received.
    decoding_until: u64,
    last_close: u64,
    done: Vec<RoundStats>,
    finished: bool,
}

/// Runs DiLoCo in a star; `progress` is called with each completed round.
pub fn run_star(world: World, setup: &StarSetup, progress: &mut dyn FnMut(u64)) -> StrategyReport {
    let config = shepherd::Config {
        rounds: setup.rounds,
        start_workers: setup.workers.max(1),
        // heartbeats are modelled by the simulator (see the module docs)
        heartbeat_timeout_ms: u64::MAX / 4,
        ..setup.shepherd.clone()
    };
    let mut sim = Sim {
        setup,
        world,
        shepherd: Shepherd::new(config, vec![vec![0.0; 4]]),
        workers: Vec::with_capacity(setup.workers),
        queue: BinaryHeap::new(),
        seq: 0,
        now: 0,
        churn: rng(setup.seed, Stream::Churn),
        jitter: rng(setup.seed, Stream::Jitter),
        delta: rng(setup.seed, Stream::Delta),
        compute: BTreeMap::new(),
        window: RoundStats::default(),
        deadlines: BTreeMap::new(),
        decoding_until: 0,
        last_close: 0,
        done: Vec::new(),
        finished: false,
    };
    for _ in 0..setup.workers {
        sim.join();
    }
    let join_rate = setup.churn_per_hour * setup.workers as f64 / 3600.0;
    if join_rate > 0.0 {
        let at = exp_us(&mut sim.churn, join_rate);
        sim.push(at, Ev::Join);
    }
    // a month of simulated time at most: a run whose workers all left stops there
    let horizon = us(30.0 * 86_400.0);
    let mut reported = 0;
    while let Some(Reverse((t, _, ev))) = sim.queue.pop() {
        if sim.finished || t > horizon {
            break;
        }
        sim.now = t;
        sim.event(ev, join_rate);
        if sim.done.len() > reported {
            reported = sim.done.len();
            progress(reported as u64);
        }
    }
    let summary = Summary::of(&sim.done);
    StrategyReport { strategy: "diloco-star".into(), engine: "protocol".into(), rounds: sim.done, summary }
}

impl Sim<'_> {
    fn push(&mut self, t: u64, ev: Ev) {
        self.seq += 1;
        self.queue.push(Reverse((t, self.seq, ev)));
    }

    fn join(&mut self) {
        let spec = self.world.draw_node();
        let w = self.workers.len() as u32;
        let lifetime = exp_us(&mut self.churn, self.setup.churn_per_hour / 3600.0);
        let leave_us = self.now.saturating_add(lifetime);
        let peer = w.to_le_bytes().to_vec();
        let machine = Worker::new(peer, self.setup.seed, self.setup.tau);
        self.workers.push(WorkerState { spec, machine, alive: true, training: None, busy: None, held: None });
        if leave_us < u64::MAX / 4 {
            self.push(leave_us, Ev::Leave { w });
        }
        let now = self.now;
        self.shepherd_input(Input::Joined(w), now, false);
    }

    fn computed(&mut self, r: u64, s: f64) {
        if let Some(c) = self.compute.get_mut(&r) {
            *c += s;
        }
    }

    fn event(&mut self, ev: Ev, join_rate: f64) {
        let now = self.now;
        match ev {
            Ev::Join => {
                self.join();
                let at = now.saturating_add(exp_us(&mut self.churn, join_rate));
                self.push(at, Ev::Join);
            }
            Ev::Leave { w } => {
                let crash = self.churn.r#gen::<f64>() < self.setup.crash_fraction;
                let ws = &mut self.workers[w as usize];
                ws.alive = false;
                if let Some((r, since)) = ws.training.take() {
                    self.computed(r, secs(now.saturating_sub(since)));
                }
                let delay = if crash { self.setup.shepherd.heartbeat_timeout_ms.saturating_mul(1000) } else { 0 };
                self.push(now.saturating_add(delay), Ev::Notice { w });
            }
            Ev::Notice { w } => self.shepherd_input(Input::Left(w), now, false),
            Ev::Deadline { r } => {
                if self.deadlines.get(&r) == Some(&now) {
                    self.shepherd_input(Input::Tick, now, true);
                }
            }
            Ev::Discover { w, r } => {
                let Some(deadline_ms) = self.deadlines.get(&r).map(|d| d / 1000) else { return };
                let ws = &mut self.workers[w as usize];
                if !ws.alive {
                    return;
                }
                let input = worker::Input::RoundOpened { round: r, deadline_ms, participant: true };
                let actions = ws.machine.handle(input, now / 1000);
                let sending = ws.busy.is_some();
                let training = ws.training.take();
                for a in actions {
                    if let worker::Action::Abandon(old) = a {
                        if let Some((_, since)) = training {
                            self.computed(old, secs(now.saturating_sub(since)));
                        }
                        if !sending {
                            self.window.abandoned += 1;
                        }
                    }
                }
            }
            Ev::ParamsReady { w, r, train_us, arrive_us, bytes } => {
                let ws = &mut self.workers[w as usize];
                if !ws.alive {
                    return;
                }
                ws.held = Some(r);
                let actions = ws.machine.handle(worker::Input::ParamsReady(r), now / 1000);
                let train = actions.iter().any(|a| matches!(a, worker::Action::Train { .. }));
                let abandon = actions.iter().any(|a| matches!(a, worker::Action::Abandon(_)));
                let pb = bytes as f64;
                self.window.worker_bytes_in += pb;
                self.window.shepherd_bytes_out += pb / self.setup.swarm.max(1.0);
                if abandon {
                    self.window.abandoned += 1;
                } else if train {
                    ws.training = Some((r, now));
                    self.push(now + train_us, Ev::Trained { w, r, arrive_us });
                }
            }
            Ev::Trained { w, r, arrive_us } => {
                let ws = &mut self.workers[w as usize];
                if !ws.alive || ws.training.map(|t| t.0) != Some(r) {
                    return;
                }
                let since = ws.training.take().map_or(now, |t| t.1);
                let actions = ws.machine.handle(worker::Input::Trained(r), now / 1000);
                let send = actions.iter().any(|a| matches!(a, worker::Action::Send(_)));
                if send {
                    ws.busy = Some((r, arrive_us.max(now)));
                    self.push(arrive_us.max(now), Ev::Arrive { w, r });
                } else {
                    self.window.abandoned += 1;
                }
                self.computed(r, secs(now - since));
            }
            Ev::Arrive { w, r } => {
                let ws = &mut self.workers[w as usize];
                if !ws.alive {
                    return;
                }
                ws.busy = None;
                ws.machine.handle(worker::Input::Sent(r), now / 1000);
                let cb = self.setup.contribution_bytes;
                self.window.worker_bytes_out += cb;
                self.window.shepherd_bytes_in += cb;
                let decode = us(self.setup.decode_s);
                if decode == 0 {
                    self.contribute(w, r, now);
                } else {
                    // one at a time, in the order they arrived
                    self.decoding_until = self.decoding_until.max(now) + decode;
                    let at = self.decoding_until;
                    self.push(at, Ev::Decoded { w, r });
                }
            }
            Ev::Decoded { w, r } => self.contribute(w, r, now),
        }
    }

    /// Hands worker `w`'s decoded contribution for round `r` to the shepherd.
    fn contribute(&mut self, w: u32, r: u64, now: u64) {
        let hostile = self.workers[w as usize].spec.hostile;
        let delta = if hostile {
            vec![vec![f32::NAN, 0.0, 0.0, 0.0]]
        } else {
            vec![(0..4).map(|_| 0.01 * (1.0 + 0.1 * self.delta.r#gen::<f32>())).collect()]
        };
        let samples = self.setup.tau.max(1);
        let input = Input::Contribution { peer: w, round: r, samples, loss: 2.0, delta: delta.into() };
        self.shepherd_input(input, now, false);
    }

    fn shepherd_input(&mut self, input: Input<u32>, now: u64, at_deadline: bool) {
        let actions = self.shepherd.handle(input, now / 1000);
        for action in actions {
            match action {
                Action::OpenRound { round, deadline_ms, participants } => {
                    self.open(round, deadline_ms, &participants);
                }
                Action::DeadlineExtended { round, deadline_ms } => {
                    self.deadlines.insert(round, deadline_ms * 1000);
                    self.push(deadline_ms * 1000, Ev::Deadline { r: round });
                }
                Action::Rejected { reason, .. } => {
                    if matches!(reason, Rejection::Late { .. }) {
                        self.window.dropped_late += 1;
                    } else {
                        self.window.dropped_rejected += 1;
                    }
                }
                Action::RoundCompleted(summary) => {
                    let r = summary.round;
                    let compute = self.compute.get(&r).copied().unwrap_or(0.0);
                    let mut s = std::mem::take(&mut self.window);
                    let participants = (summary.contributors.len() + summary.excluded.len()) as u64;
                    s.round = r;
                    s.end_s = secs(now);
                    s.wall_s = secs(now - self.last_close);
                    s.participants = participants;
                    s.contributors = summary.contributors.len() as u64;
                    s.at_quorum = at_deadline && !summary.excluded.is_empty();
                    let p = participants.max(1) as f64;
                    s.utilization = compute / (p * s.wall_s.max(1e-9));
                    s.worker_bytes_in /= p;
                    s.worker_bytes_out /= p;
                    self.last_close = now;
                    self.done.push(s);
                }
                Action::Finished => self.finished = true,
                Action::WorkerJoined(_) | Action::WorkerLeft { .. } => {}
            }
        }
    }

    /// Plans round `r`: discovery, fetch, training and upload of every participant.
    fn open(&mut self, r: u64, deadline_ms: u64, participants: &[u32]) {
        let deadline_us = deadline_ms * 1000;
        self.deadlines.insert(r, deadline_us);
        self.deadlines.retain(|k, _| *k + 2 >= r);
        self.compute.retain(|k, _| *k >= r);
        self.compute.insert(r, 0.0);
        self.push(deadline_us, Ev::Deadline { r });
        let overhead = if r > 1 { self.setup.overhead_s } else { 0.0 };
        let visible = secs(self.now) + overhead;
        let shepherd = self.world.shepherd;
        let mut plan: Vec<(u32, f64, f64, f64)> = Vec::with_capacity(participants.len());
        let mut fetches = Vec::with_capacity(participants.len());
        for &w in participants {
            let ws = &self.workers[w as usize];
            if !ws.alive {
                continue;
            }
            let lat = self.world.latency(&ws.spec, 0, &shepherd);
            // a worker busy sending an older contribution sees the round after it
            let free = ws.busy.map_or(visible, |(_, until)| secs(until).max(visible));
            let discover = self.world.next_poll(&ws.spec, free) + 2.0 * lat;
            let bytes = match self.setup.update_bytes {
                Some(update) if r > 1 && ws.held == Some(r - 1) => update,
                _ => self.setup.params_bytes,
            };
            fetches.push(Flow { start: discover + lat, bytes, cap: ws.spec.link.down });
            plan.push((w, discover, lat, bytes));
        }
        let fetched = fair_share(shepherd.up * self.setup.swarm.max(1.0), &fetches);
        let mut uploads = Vec::with_capacity(plan.len());
        let mut trains = Vec::with_capacity(plan.len());
        let jitter = self.setup.step_seconds * self.world.config.jitter;
        for ((w, _, lat, _), done) in plan.iter().zip(&fetched) {
            let ws = &self.workers[*w as usize];
            let noise = if jitter > 0.0 { self.jitter.gen_range(-1.0..=1.0) } else { 0.0 };
            let step = self.setup.step_seconds * ws.spec.slowdown + jitter * noise;
            let train = self.setup.tau as f64 * step.max(0.0);
            let ready = done + lat;
            uploads.push(Flow { start: ready + train, bytes: self.setup.contribution_bytes, cap: ws.spec.link.up });
            trains.push((ready, train));
        }
        let uploaded = fair_share(shepherd.down, &uploads);
        for (((w, discover, lat, bytes), (ready, train)), up) in plan.iter().zip(trains).zip(uploaded) {
            let arrive = up + lat;
            self.push(us(*discover), Ev::Discover { w: *w, r });
            let bytes = bytes.round() as u64;
            self.push(us(ready), Ev::ParamsReady { w: *w, r, train_us: us(train), arrive_us: us(arrive), bytes });
        }
    }
}
