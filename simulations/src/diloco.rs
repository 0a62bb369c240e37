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
//!   once: fetches share the blob's serving capacity ([`Swarm`]), uploads the
//!   shepherd's downlink, each capped by the worker's link ([`fair_share`]).
//!   By default the capacity is a peer-to-peer swarm's, as in pcp-node (a
//!   round's blobs are content-addressed and every worker that holds them
//!   serves them): the shepherd's uplink plus every participant's uplink less
//!   what its own contribution takes of it in a round. A flow cancelled later (a worker that
//!   leaves or abandons) does not give its bandwidth back to the others, and
//!   uploads of consecutive rounds do not share the link.
//! * After a round closes, the shepherd spends `overhead_s` (validation,
//!   checkpoint) before the next announcement is visible.
//! * The shepherd decodes, validates and adds contributions on `shepherd_cores`
//!   cores, `decode_s` each ([`crate::decode`], measured on one core): each core
//!   takes the next contribution in the order they arrived, and a contribution
//!   reaches its state machine once its core is done with it, so a queue at the
//!   shepherd can make contributions late. This assumes the work spreads over the
//!   cores: checking a sparse contribution (`sparse::Packed::check`) is
//!   independent per contribution, and adding it splits into ranges of the sum
//!   (`shepherd::Config::add_threads`); memory bandwidth is taken to grow with
//!   the cores.
//! * Overlap (`overlap`, [`Worker::with_overlap`], and the shepherd's
//!   [`shepherd::Overlap`]): the workers' state machines decide everything, each
//!   action carried out as it comes. `Train` runs τ steps or the round's budget
//!   (the shepherd's [`Shepherd::budget_ms`], given to each worker with the
//!   round with [`Shepherd::steps_end_ms`]), whichever ends first, at the
//!   worker's own step time (its slowdown and ± jitter, drawn once a round), and
//!   the contribution's samples are the steps run; `EndSteps` ends them earlier
//!   (the step under way finishes); `Send` starts the upload at once (it does not
//!   wait for the update: staleness depth 2), `Rebase` costs nothing, and compute
//!   stops on `UpdateLate` until the next `Train`. The shepherd gets each
//!   contribution's [`Input::Timing`] (steps, their time, and the time from the
//!   send to the state machine, the decode queue included), learns the budget
//!   from it, closes a round at all-answered or at its deadline (ticked again
//!   when it moves: [`Shepherd::deadline_ms`]), and carries contributions one
//!   round late over. Fetches are still planned when a round opens (a worker's
//!   fetches one after another, as its state machine asks them), and so are the
//!   upload rates: every participant's upload is planned from the moment its
//!   steps should end, and when the state machine actually sends, the upload
//!   takes the planned duration (a worker that sends later than planned keeps
//!   the share it would have had). Heartbeats do not wait for an upload in
//!   flight. A worker whose chain breaks (two rounds behind) starts afresh with
//!   `FetchParams` of the newest round, and is charged the update only if it
//!   holds, or is fetching, the round before (what a host that keeps its fetch
//!   going and applies the update does).
//! * Utilization counts the inner-step time of the contributions the shepherd
//!   averaged, and nothing else (not steps of rounds abandoned, late or
//!   rejected), over participants × the wall time between two closes. With
//!   overlap a round's steps run partly before it opens (and a carried
//!   contribution's in the round before), so one round's ratio can pass 1; the
//!   summary's `overall_utilization` divides the compute of every round by the
//!   participants × wall time of every round instead.
//! * Sparse runs: a worker that holds the previous round's parameters (it
//!   fetched them, whether or not it finished the round) fetches only the
//!   shepherd's update (`update_bytes`); joiners and workers that missed a
//!   round fetch the whole fp32 parameters. Whether a worker holds them is
//!   decided when the round opens, so one still fetching the previous round's
//!   parameters then is charged the whole blob.
//! * Fragments (`fragments`, Streaming DiLoCo's P): the shepherd's state
//!   machine has one tensor a fragment and `Config::fragments`, round r syncs
//!   fragment (r − 1) mod P after τ/P inner steps (the workers' τ), each
//!   contribution carries that fragment's tensor (the others empty), and the
//!   round moves that fragment's bytes: its encoded contribution up, and down
//!   its sparse update or, for dense encodings, its changed fp32 shards (to a
//!   worker holding the round before; others fetch the whole parameters). The
//!   shepherd's cost per contribution is the fragment's share of the
//!   parameters. With fragments the state machine carries nothing over a round
//!   (a late contribution is refused).
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
use crate::report::{FragmentCost, RoundStats, StrategyReport, Summary};
use crate::world::{NodeSpec, Stream, World, rng};

/// What the star simulation needs besides the world.
#[derive(Clone, Debug, PartialEq)]
pub struct StarSetup {
    /// Rounds to run.
    pub rounds: u64,
    /// Workers at the start.
    pub workers: usize,
    /// Inner steps per round (with fragments, τ/P: a round syncs one fragment).
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
    /// Cores the shepherd decodes, validates and adds contributions on, each taking
    /// whole contributions (1: one at a time, in the order they arrived).
    pub shepherd_cores: usize,
    /// Workers overlap rounds ([`Worker::with_overlap`]): they train round r+1 from
    /// their own parameters while round r's contribution, aggregation and update are
    /// on their way, and rebase onto the update when it arrives; the shepherd
    /// time-boxes rounds and carries late contributions over ([`shepherd::Overlap`]).
    pub overlap: bool,
    /// Shepherd work between a close and the next announcement, seconds.
    pub overhead_s: f64,
    /// What serves the round's blobs (parameters or update) to the workers.
    pub swarm: Swarm,
    /// Streaming DiLoCo's fragments, in sync order, when there are more than one:
    /// round r syncs fragment (r − 1) mod P through the real state machines
    /// (the shepherd's `Config::fragments`), and moves only that fragment's bytes.
    /// Empty: the whole model every round.
    pub fragments: Vec<FragmentCost>,
    /// Expected leaves per worker per hour (and as many joins).
    pub churn_per_hour: f64,
    /// Fraction of leaves that are crashes (noticed after the heartbeat timeout).
    pub crash_fraction: f64,
    /// The shepherd's state machine settings (its heartbeat timeout is the crash-notice delay).
    pub shepherd: shepherd::Config,
    /// The run seed.
    pub seed: u64,
}

/// What serves a round's blobs to its workers.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Swarm {
    /// The shepherd's uplink times this factor (at least 1; 1: the shepherd alone).
    Factor(f64),
    /// A peer-to-peer swarm, pcp-node's content-addressed blobs: every worker
    /// that holds (pieces of) a blob serves it, so the fetches of a round share
    /// the shepherd's uplink plus the participants' uplinks, each less the share
    /// of a round its own contribution's upload takes. This is the fluid model of
    /// a BitTorrent-like swarm (Qiu and Srikant, SIGCOMM 2004) with its
    /// efficiency at 1, which they show a swarm of many pieces approaches; each
    /// fetch is still capped by the worker's downlink.
    Peers,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Ev {
    Discover {
        w: u32,
        r: u64,
    },
    /// Worker `w` hears that round `r`'s deadline was extended.
    Extend {
        w: u32,
        r: u64,
    },
    ParamsReady {
        w: u32,
        r: u64,
        train_us: u64,
        arrive_us: u64,
        bytes: u64,
    },
    Trained {
        w: u32,
        r: u64,
        arrive_us: u64,
    },
    Arrive {
        w: u32,
        r: u64,
    },
    Decoded {
        w: u32,
        r: u64,
    },
    Deadline {
        r: u64,
    },
    Join,
    Leave {
        w: u32,
    },
    Notice {
        w: u32,
    },
}

#[derive(Debug)]
struct WorkerState {
    spec: NodeSpec,
    machine: Worker,
    alive: bool,
    training: Option<(u64, u64)>,
    /// Until when it is busy sending round `busy.0`'s contribution.
    busy: Option<(u64, u64)>,
    /// When the inner steps of round `trained_at.0` end (or ended).
    trained_at: Option<(u64, u64)>,
    /// The round whose parameters it holds.
    held: Option<u64>,
    /// Overlap: the last fetch planned, and when it is done.
    fetched: Option<(u64, u64)>,
    /// Overlap: planned upload durations of recent rounds.
    uploads: Vec<(u64, u64)>,
    /// Overlap: the steps of the round trained, and their time.
    steps: (u64, u64),
    /// Overlap: the contributions on their way: round, sent at, steps, their time.
    sends: Vec<(u64, u64, u64, u64)>,
    /// Overlap: compute has been waiting for the network since then.
    waiting: Option<u64>,
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
    /// Seconds of inner steps per round and worker, for the rounds not closed yet.
    compute: BTreeMap<u64, BTreeMap<u32, f64>>,
    /// The last round closed.
    closed: u64,
    /// What happened since the last close: bytes, drops, abandons.
    window: RoundStats,
    deadlines: BTreeMap<u64, u64>,
    /// The participants of the round open.
    participants: Vec<u32>,
    /// Overlap: each recent round's compute budget and the end of its median
    /// worker's steps, milliseconds (0: none).
    budgets: BTreeMap<u64, (u64, u64)>,
    /// Each open round's share of its fetched bytes served by the shepherd.
    served: BTreeMap<u64, f64>,
    /// Overlap: compute and participant-seconds of every round, for the overall utilization.
    totals: (f64, f64),
    /// When each of the shepherd's cores is done with the contributions it took.
    cores: Vec<u64>,
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
        // a round reaches a worker at its next heartbeat, plus a trip
        overlap: setup.overlap.then(|| shepherd::Overlap {
            notice_ms: us(world.config.poll_s) / 1000 + 500,
            ..shepherd::Overlap::new(setup.tau)
        }),
        fragments: if setup.fragments.len() > 1 {
            (0..setup.fragments.len()).map(|f| f..f + 1).collect()
        } else {
            Vec::new()
        },
        ..setup.shepherd.clone()
    };
    // one tensor of 4 values a fragment
    let params = vec![vec![0.0; 4]; setup.fragments.len().max(1)];
    let mut sim = Sim {
        setup,
        world,
        shepherd: Shepherd::new(config, params),
        workers: Vec::with_capacity(setup.workers),
        queue: BinaryHeap::new(),
        seq: 0,
        now: 0,
        churn: rng(setup.seed, Stream::Churn),
        jitter: rng(setup.seed, Stream::Jitter),
        delta: rng(setup.seed, Stream::Delta),
        compute: BTreeMap::new(),
        closed: 0,
        window: RoundStats::default(),
        deadlines: BTreeMap::new(),
        participants: Vec::new(),
        budgets: BTreeMap::new(),
        served: BTreeMap::new(),
        totals: (0.0, 0.0),
        cores: vec![0; setup.shepherd_cores.max(1)],
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
    let mut summary = Summary::of(&sim.done);
    if setup.overlap {
        summary.overall_utilization = Some(sim.totals.0 / sim.totals.1.max(1e-9));
    }
    let strategy = if setup.overlap { "diloco-star+overlap" } else { "diloco-star" };
    StrategyReport { strategy: strategy.into(), engine: "protocol".into(), rounds: sim.done, summary }
}

impl Sim<'_> {
    /// The fragment round `r` syncs, with fragments.
    fn fragment(&self, r: u64) -> Option<&FragmentCost> {
        let p = self.setup.fragments.len();
        (p > 1).then(|| &self.setup.fragments[pcp_protocol::diloco::fragments::of_round(r, p)])
    }

    /// Bytes of a contribution to round `r`.
    fn contribution_bytes(&self, r: u64) -> f64 {
        self.fragment(r).map_or(self.setup.contribution_bytes, |f| f.contribution_bytes)
    }

    /// Bytes a worker holding round `r − 1`'s parameters fetches for round `r`, if
    /// less than the parameters: the update (sparse), or the fragment's.
    fn held_fetch_bytes(&self, r: u64) -> Option<f64> {
        self.fragment(r).map(|f| f.fetch_bytes).or(self.setup.update_bytes)
    }

    /// The shepherd's seconds per contribution to round `r`.
    fn decode_s(&self, r: u64) -> f64 {
        self.setup.decode_s * self.fragment(r).map_or(1.0, |f| f.work)
    }

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
        let machine = Worker::new(peer, self.setup.seed, self.setup.tau).with_overlap(self.setup.overlap);
        self.workers.push(WorkerState {
            spec,
            machine,
            alive: true,
            training: None,
            busy: None,
            trained_at: None,
            held: None,
            fetched: None,
            uploads: Vec::new(),
            steps: (0, 0),
            sends: Vec::new(),
            waiting: None,
        });
        if leave_us < u64::MAX / 4 {
            self.push(leave_us, Ev::Leave { w });
        }
        let now = self.now;
        self.shepherd_input(Input::Joined(w), now, false);
    }

    /// Worker `w` finished round `r`'s inner steps, `s` seconds of them.
    fn computed(&mut self, r: u64, w: u32, s: f64) {
        // overlap: a round closed may still be carried into the next
        let open = if self.setup.overlap { r >= self.closed } else { r > self.closed };
        if open {
            *self.compute.entry(r).or_default().entry(w).or_default() += s;
        }
    }

    /// Seconds of τ inner steps for worker `w` this round (its slowdown and jitter).
    fn train_seconds(&mut self, w: u32) -> f64 {
        self.setup.tau as f64 * self.step_seconds(w)
    }

    /// Seconds of one inner step for worker `w` this round (its slowdown and jitter).
    fn step_seconds(&mut self, w: u32) -> f64 {
        let jitter = self.setup.step_seconds * self.world.config.jitter;
        let noise = if jitter > 0.0 { self.jitter.gen_range(-1.0..=1.0) } else { 0.0 };
        let step = self.setup.step_seconds * self.workers[w as usize].spec.slowdown + jitter * noise;
        step.max(0.0)
    }

    /// Overlap: carries out worker `w`'s actions at `now`, in order.
    fn overlap_actions(&mut self, w: u32, actions: &[worker::Action], now: u64) {
        for a in actions {
            match a {
                worker::Action::Train { round, steps, budget_ms, behind, .. } => {
                    if *behind >= 2 {
                        self.window.sent_ahead += 1;
                    }
                    let step = self.step_seconds(w);
                    // τ steps, or no step starting once the budget is spent (at least one)
                    let n = match budget_ms {
                        Some(b) if step > 0.0 => (*steps).min(((*b as f64 / 1e3) / step).ceil().max(1.0) as u64),
                        _ => *steps,
                    };
                    let train = us(n as f64 * step);
                    let ws = &mut self.workers[w as usize];
                    if let Some(since) = ws.waiting.take() {
                        self.window.waited_s += secs(now - since);
                    }
                    ws.training = Some((*round, now));
                    ws.trained_at = Some((*round, now + train));
                    ws.steps = (n, train);
                    self.push(now + train, Ev::Trained { w, r: *round, arrive_us: 0 });
                }
                worker::Action::Send(r) => {
                    let ws = &mut self.workers[w as usize];
                    let lat = self.world.latency(&ws.spec, 0, &self.world.shepherd);
                    let planned = ws.uploads.iter().find(|(u, _)| u == r).map(|(_, d)| *d);
                    let bytes = self.contribution_bytes(*r);
                    let ws = &mut self.workers[w as usize];
                    let up = planned.unwrap_or_else(|| us(bytes / ws.spec.link.up.max(1e-9)));
                    let (n, train) = ws.steps;
                    ws.sends.push((*r, now, n, train));
                    self.push(now + up + us(lat), Ev::Arrive { w, r: *r });
                }
                worker::Action::Abandon(r) => {
                    let ws = &mut self.workers[w as usize];
                    ws.sends.retain(|s| s.0 != *r);
                    if ws.training.is_some_and(|t| t.0 == *r) {
                        ws.training = None;
                        self.window.abandoned += 1;
                    }
                }
                worker::Action::EndSteps { round, end_ms } => {
                    let ws = &mut self.workers[w as usize];
                    let (Some((t, start)), Some((_, end))) = (ws.training, ws.trained_at) else { continue };
                    let (n, train) = ws.steps;
                    let by = end_ms * 1000;
                    if t != *round || end <= by || n <= 1 {
                        continue;
                    }
                    // the step under way finishes
                    let step = train as f64 / n as f64;
                    let k = (((by.saturating_sub(start)) as f64 / step).ceil() as u64).clamp(1, n);
                    let train = (step * k as f64).round() as u64;
                    ws.steps = (k, train);
                    ws.trained_at = Some((t, start + train));
                    self.window.cut_short += 1;
                    self.push(start + train, Ev::Trained { w, r: t, arrive_us: 0 });
                }
                worker::Action::UpdateLate(_) => {
                    self.window.update_late += 1;
                    self.workers[w as usize].waiting = Some(now);
                }
                worker::Action::FetchParams(_) | worker::Action::FetchUpdate(_) | worker::Action::Rebase(_) => {}
            }
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
                ws.training = None;
                let delay = if crash { self.setup.shepherd.heartbeat_timeout_ms.saturating_mul(1000) } else { 0 };
                self.push(now.saturating_add(delay), Ev::Notice { w });
            }
            Ev::Notice { w } => self.shepherd_input(Input::Left(w), now, false),
            Ev::Deadline { r } => {
                if self.deadlines.get(&r) == Some(&now) {
                    self.shepherd_input(Input::Tick, now, true);
                }
            }
            Ev::Extend { w, r } => {
                let Some(deadline_ms) = self.deadlines.get(&r).map(|d| d / 1000) else { return };
                let ws = &mut self.workers[w as usize];
                if ws.alive {
                    ws.machine.handle(worker::Input::DeadlineExtended { round: r, deadline_ms }, now / 1000);
                }
            }
            Ev::Discover { .. } | Ev::ParamsReady { .. } | Ev::Trained { .. } | Ev::Arrive { .. }
                if self.setup.overlap =>
            {
                self.overlap_event(ev, now);
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
                ws.training = None;
                for a in actions {
                    if matches!(a, worker::Action::Abandon(_)) && !sending {
                        self.window.abandoned += 1;
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
                self.window.shepherd_bytes_out += pb * self.served.get(&r).copied().unwrap_or(1.0);
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
                    self.computed(r, w, secs(now - since));
                } else {
                    self.window.abandoned += 1;
                }
            }
            Ev::Arrive { w, r } => {
                let ws = &mut self.workers[w as usize];
                if !ws.alive {
                    return;
                }
                ws.busy = None;
                ws.machine.handle(worker::Input::Sent(r), now / 1000);
                self.arrived(w, r, now);
            }
            Ev::Decoded { w, r } => self.contribute(w, r, now),
        }
    }

    /// Overlap: a worker's event, handed to its state machine.
    fn overlap_event(&mut self, ev: Ev, now: u64) {
        let w = match ev {
            Ev::Discover { w, .. } | Ev::ParamsReady { w, .. } | Ev::Trained { w, .. } | Ev::Arrive { w, .. } => w,
            _ => return,
        };
        if !self.workers[w as usize].alive {
            return;
        }
        let actions = match ev {
            Ev::Discover { r, .. } => {
                let Some(deadline_ms) = self.deadlines.get(&r).map(|d| d / 1000) else { return };
                let (budget_ms, end_ms) = self.budgets.get(&r).copied().unwrap_or((0, 0));
                let machine = &mut self.workers[w as usize].machine;
                machine.handle(worker::Input::Budget { round: r, budget_ms, end_ms }, now / 1000);
                machine.handle(worker::Input::RoundOpened { round: r, deadline_ms, participant: true }, now / 1000)
            }
            Ev::ParamsReady { r, bytes, .. } => {
                let pb = bytes as f64;
                self.window.worker_bytes_in += pb;
                self.window.shepherd_bytes_out += pb * self.served.get(&r).copied().unwrap_or(1.0);
                let ws = &mut self.workers[w as usize];
                ws.held = Some(r);
                ws.machine.handle(worker::Input::ParamsReady(r), now / 1000)
            }
            Ev::Trained { r, .. } => {
                let ws = &mut self.workers[w as usize];
                // (not steps ended earlier by EndSteps)
                let Some((_, since)) = ws.training.filter(|t| t.0 == r && ws.trained_at == Some((r, now))) else {
                    return;
                };
                ws.training = None;
                let actions = ws.machine.handle(worker::Input::Trained(r), now / 1000);
                self.computed(r, w, secs(now - since));
                actions
            }
            Ev::Arrive { r, .. } => {
                let ws = &mut self.workers[w as usize];
                // a send abandoned on the way (two newer rounds opened) is not delivered
                if !ws.machine.sending().contains(&r) {
                    return;
                }
                let actions = ws.machine.handle(worker::Input::Sent(r), now / 1000);
                self.arrived(w, r, now);
                actions
            }
            _ => return,
        };
        self.overlap_actions(w, &actions, now);
    }

    /// Worker `w`'s contribution for round `r` reached the shepherd: its bytes, and
    /// the shepherd's decode queue.
    fn arrived(&mut self, w: u32, r: u64, now: u64) {
        let cb = self.contribution_bytes(r);
        self.window.worker_bytes_out += cb;
        self.window.shepherd_bytes_in += cb;
        let decode = us(self.decode_s(r));
        if decode == 0 {
            self.contribute(w, r, now);
        } else {
            // each core takes the next contribution in the order they arrived
            let (core, free) = self.cores.iter().copied().enumerate().min_by_key(|(_, f)| *f).unwrap_or((0, 0));
            let at = free.max(now) + decode;
            if let Some(c) = self.cores.get_mut(core) {
                *c = at;
            }
            self.push(at, Ev::Decoded { w, r });
        }
    }

    /// Hands worker `w`'s decoded contribution for round `r` to the shepherd.
    fn contribute(&mut self, w: u32, r: u64, now: u64) {
        let hostile = self.workers[w as usize].spec.hostile;
        let tensor: Vec<f32> = if hostile {
            vec![f32::NAN, 0.0, 0.0, 0.0]
        } else {
            (0..4).map(|_| 0.01 * (1.0 + 0.1 * self.delta.r#gen::<f32>())).collect()
        };
        // with fragments: the round's fragment's tensor, the others empty
        let p = self.setup.fragments.len();
        let delta = if p > 1 {
            let f = pcp_protocol::diloco::fragments::of_round(r, p);
            (0..p).map(|i| if i == f { tensor.clone() } else { Vec::new() }).collect()
        } else {
            vec![tensor]
        };
        let mut samples = self.setup.tau.max(1);
        if self.setup.overlap {
            let ws = &mut self.workers[w as usize];
            if let Some(i) = ws.sends.iter().position(|s| s.0 == r) {
                let (_, sent, steps, train) = ws.sends.remove(i);
                samples = steps;
                let timing = Input::Timing {
                    peer: w,
                    round: r,
                    steps,
                    train_ms: train / 1000,
                    transfer_ms: (now - sent) / 1000,
                };
                self.shepherd_input(timing, now, false);
            }
        }
        let input = Input::Contribution { peer: w, round: r, samples, loss: 2.0, delta: delta.into() };
        self.shepherd_input(input, now, false);
    }

    fn shepherd_input(&mut self, input: Input<u32>, now: u64, at_deadline: bool) {
        let actions = self.shepherd.handle(input, now / 1000);
        if self.setup.overlap
            && let (Some(r), Some(d)) = (self.shepherd.open_round(), self.shepherd.deadline_ms())
            && self.deadlines.get(&r).is_some_and(|k| *k != d * 1000)
            && !actions.iter().any(|a| matches!(a, Action::OpenRound { .. } | Action::DeadlineExtended { .. }))
        {
            // a time-boxed round's deadline moved earlier
            self.deadlines.insert(r, d * 1000);
            self.push(d * 1000, Ev::Deadline { r });
        }
        for action in actions {
            match action {
                Action::OpenRound { round, deadline_ms, participants } => {
                    if let Some(budget) = self.shepherd.budget_ms() {
                        self.budgets.insert(round, (budget, self.shepherd.steps_end_ms().unwrap_or(0)));
                        self.budgets.retain(|k, _| *k + 2 >= round);
                    }
                    if self.setup.overlap {
                        self.open_overlapped(round, deadline_ms, &participants);
                    } else {
                        self.open(round, deadline_ms, &participants);
                    }
                    self.participants = participants;
                }
                Action::DeadlineExtended { round, deadline_ms } => {
                    self.deadlines.insert(round, deadline_ms * 1000);
                    self.push(deadline_ms * 1000, Ev::Deadline { r: round });
                    self.tell_extension(round, now);
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
                    // the inner steps of the contributions averaged, and of nothing else
                    let trained = self.compute.get(&r);
                    let mut compute: f64 =
                        summary.contributors.iter().filter_map(|w| trained.and_then(|t| t.get(w))).sum();
                    if let Some(before) = self.compute.get(&r.saturating_sub(1)) {
                        compute += summary.carried.iter().filter_map(|w| before.get(w)).sum::<f64>();
                    }
                    self.closed = r;
                    if self.setup.overlap {
                        self.compute.retain(|k, _| *k >= r);
                    } else {
                        self.compute.retain(|k, _| *k > r);
                    }
                    let mut s = std::mem::take(&mut self.window);
                    let participants = (summary.contributors.len() + summary.excluded.len()) as u64;
                    s.round = r;
                    s.end_s = secs(now);
                    s.wall_s = secs(now - self.last_close);
                    s.participants = participants;
                    s.contributors = summary.contributors.len() as u64;
                    s.carried = summary.carried.len() as u64;
                    s.budget_s = summary.budget_ms.map(|b| b as f64 / 1e3);
                    // (a time-boxed round also closes at its deadline on a contribution)
                    let deadline = if self.setup.overlap { summary.at_deadline } else { at_deadline };
                    s.at_quorum = deadline && !summary.excluded.is_empty();
                    let p = participants.max(1) as f64;
                    s.utilization = compute / (p * s.wall_s.max(1e-9));
                    self.totals.0 += compute;
                    self.totals.1 += p * s.wall_s;
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

    /// Tells round `r`'s participants, at their next heartbeat, that its deadline moved.
    fn tell_extension(&mut self, r: u64, now: u64) {
        let shepherd = self.world.shepherd;
        let mut at = Vec::with_capacity(self.participants.len());
        for &w in &self.participants {
            let ws = &self.workers[w as usize];
            if ws.alive {
                let lat = self.world.latency(&ws.spec, 0, &shepherd);
                at.push((us(self.world.next_poll(&ws.spec, secs(now)) + 2.0 * lat), w));
            }
        }
        for (t, w) in at {
            self.push(t, Ev::Extend { w, r });
        }
    }

    /// Schedules round `r`'s deadline; returns when its announcement becomes
    /// visible (after the shepherd's overhead, from round 2), seconds.
    fn deadline_and_visibility(&mut self, r: u64, deadline_ms: u64) -> f64 {
        let deadline_us = deadline_ms * 1000;
        self.deadlines.insert(r, deadline_us);
        self.deadlines.retain(|k, _| *k + 2 >= r);
        self.push(deadline_us, Ev::Deadline { r });
        let overhead = if r > 1 { self.setup.overhead_s } else { 0.0 };
        secs(self.now) + overhead
    }

    /// The capacity serving round `r`'s blobs to `plan`'s workers (bytes/s), for
    /// rounds whose steps take about `round_s`; records the shepherd's share.
    fn serving(&mut self, r: u64, plan: &[(u32, f64, f64, f64)], round_s: f64) -> f64 {
        let up = self.world.shepherd.up;
        let capacity = match self.setup.swarm {
            Swarm::Factor(f) => up * f.max(1.0),
            Swarm::Peers => {
                let contribution = self.contribution_bytes(r);
                up + plan
                    .iter()
                    .map(|(w, ..)| {
                        let link = self.workers[*w as usize].spec.link.up;
                        (link - contribution / round_s.max(1e-3)).max(0.0)
                    })
                    .sum::<f64>()
            }
        };
        self.served.retain(|round, _| round + 4 > r);
        self.served.insert(r, up / capacity.max(up));
        capacity
    }

    /// Plans round `r`: discovery, fetch, training and upload of every participant.
    fn open(&mut self, r: u64, deadline_ms: u64, participants: &[u32]) {
        let visible = self.deadline_and_visibility(r, deadline_ms);
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
            let bytes = match self.held_fetch_bytes(r) {
                Some(update) if r > 1 && ws.held == Some(r - 1) => update,
                _ => self.setup.params_bytes,
            };
            fetches.push(Flow { start: discover + lat, bytes, cap: ws.spec.link.down });
            plan.push((w, discover, lat, bytes));
        }
        let round_s = self.setup.tau as f64 * self.setup.step_seconds;
        let capacity = self.serving(r, &plan, round_s);
        let fetched = fair_share(capacity, &fetches);
        let mut uploads = Vec::with_capacity(plan.len());
        let mut trains = Vec::with_capacity(plan.len());
        for ((w, _, lat, _), done) in plan.iter().zip(&fetched) {
            let ready = done + lat;
            let train = self.train_seconds(*w);
            let up = self.workers[*w as usize].spec.link.up;
            uploads.push(Flow { start: ready + train, bytes: self.contribution_bytes(r), cap: up });
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

    /// Overlap: plans round `r`'s discovery and fetches, and the upload rates of its
    /// contributions (the state machines decide when each is sent).
    fn open_overlapped(&mut self, r: u64, deadline_ms: u64, participants: &[u32]) {
        let visible = self.deadline_and_visibility(r, deadline_ms);
        let shepherd = self.world.shepherd;
        // a round's steps take about the budget (τ typical steps before there is one)
        let round_s =
            self.shepherd.budget_ms().map_or(self.setup.tau as f64 * self.setup.step_seconds, |b| b as f64 / 1e3);
        let mut plan: Vec<(u32, f64, f64, f64)> = Vec::with_capacity(participants.len());
        let mut fetches = Vec::with_capacity(participants.len());
        for &w in participants {
            let ws = &self.workers[w as usize];
            if !ws.alive {
                continue;
            }
            let lat = self.world.latency(&ws.spec, 0, &shepherd);
            let discover = self.world.next_poll(&ws.spec, visible) + 2.0 * lat;
            // the state machine fetches one round after another: a sparse update
            // needs the round before it
            let (bytes, after) = match (self.held_fetch_bytes(r), ws.fetched) {
                (Some(update), Some((f, done))) if r > 1 && f + 1 == r => (update, secs(done)),
                _ => (self.setup.params_bytes, 0.0),
            };
            fetches.push(Flow { start: (discover + lat).max(after), bytes, cap: ws.spec.link.down });
            plan.push((w, discover, lat, bytes));
        }
        let capacity = self.serving(r, &plan, round_s);
        let fetched = fair_share(capacity, &fetches);
        // uploads from when each worker's steps of round r should end
        let mut uploads = Vec::with_capacity(plan.len());
        for ((w, discover, lat, _), done) in plan.iter().zip(&fetched) {
            let ws = &self.workers[*w as usize];
            let end = match ws.trained_at {
                Some((t, end)) if t == r => secs(end),
                Some((t, end)) if t + 1 == r => secs(end) + round_s,
                _ => done + lat + round_s,
            };
            uploads.push(Flow { start: end.max(*discover), bytes: self.contribution_bytes(r), cap: ws.spec.link.up });
        }
        let uploaded = fair_share(shepherd.down, &uploads);
        for (((w, discover, lat, bytes), done), (flow, up)) in
            plan.iter().zip(fetched).zip(uploads.iter().zip(uploaded))
        {
            let ready = us(done + lat);
            let ws = &mut self.workers[*w as usize];
            ws.fetched = Some((r, ready));
            ws.uploads.retain(|(u, _)| u + 2 >= r);
            ws.uploads.push((r, us(up - flow.start)));
            self.push(us(*discover), Ev::Discover { w: *w, r });
            let bytes = bytes.round() as u64;
            self.push(ready, Ev::ParamsReady { w: *w, r, train_us: 0, arrive_us: 0, bytes });
        }
    }
}
