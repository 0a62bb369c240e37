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
//!   checkpoint) before the next announcement is visible. As in pcp-node, the
//!   next round's deadline moves by the time from the closing input to the
//!   announcement (the close on the loop plus the overhead).
//! * The shepherd's CPU is [`cpu`]: one event loop every contribution, screen,
//!   close and heartbeat waits for, with forward passes and adds spread over
//!   the aggregate threads, at the calibration table's costs. A contribution
//!   reaches the state machine once the loop is done with it (so a queue makes
//!   contributions late), and the next announcement goes out once the loop has
//!   closed the round. A participant fetches a participants blob past
//!   [`INLINE_PARTICIPANTS`]; workers past the connection cap never join.
//! * In a swarm ([`Swarm::Peers`]) a worker serves a round's blob only once its
//!   own fetch of it is done ([`fair_share_growing`]).
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
//!   contribution with its [`shepherd::Timing`] (steps, their time, and the time
//!   from the send to the state machine, the decode queue included), learns the budget
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
//!   rejected), in the wall-time window it actually ran in: with overlap a
//!   round's steps run partly before it opens, so they count in the window of
//!   the round they ran in. A round's figure is that compute over participants ×
//!   its window, capped at 1 (a window can hold steps of a worker that left
//!   since); the summary's overall and steady figures are ratios of sums of them,
//!   so neither can pass 1 (`windowed_utilization`).
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

use crate::aggregators::{AggregatorSetup, Pool};
use crate::cpu::{Cpu, ScreenHost, Screened};
use crate::report::{FragmentCost, RoundStats, StrategyReport, Summary};
use crate::world::{NodeSpec, Stream, World, rng};

mod contribute;
mod open;
pub use crate::cpu::{CpuTotals, ScreenPolicy, ShepherdCosts};

/// Participants an announcement lists inline; past them the list goes into a
/// participants blob every participant fetches, and the announcement carries its hash
/// (the node's rule under its 256 KiB control-message cap).
pub const INLINE_PARTICIPANTS: usize = 4_096;
/// Bytes of an announcement besides its participant list.
pub const ANNOUNCEMENT_BYTES: f64 = 1_000.0;
/// Bytes a participant takes in an announcement's list or the participants blob.
pub const PARTICIPANT_BYTES: f64 = 32.0;
/// Bytes of a heartbeat request.
pub const HEARTBEAT_REQUEST_BYTES: f64 = 250.0;
/// Bytes of a heartbeat's answer (the announcement once a round aside).
pub const HEARTBEAT_ANSWER_BYTES: f64 = 200.0;

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
    /// The shepherd's CPU costs ([`cpu`]): its event loop, aggregate threads, screen,
    /// close, heartbeats, cipher and connection cap.
    pub cpu: ShepherdCosts,
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
    /// Parameter-shard aggregators ([`crate::aggregators`]); `None`: the shepherd sums alone.
    pub aggregators: Option<AggregatorSetup>,
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
        screened: Screened,
    },
    /// Round `r`'s shard means are with the shepherd.
    Aggregated {
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
    /// With committees: its screening after the round's steps, µs (not training).
    screening: u64,
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

/// The star's random streams besides the world's.
struct Draws {
    churn: ChaCha8Rng,
    jitter: ChaCha8Rng,
    delta: ChaCha8Rng,
}

/// Inner steps a worker ran: from, to (µs), how many.
type Steps = (u64, u64, u64);

struct Sim<'a> {
    setup: &'a StarSetup,
    world: World,
    shepherd: Shepherd<u32>,
    workers: Vec<WorkerState>,
    queue: BinaryHeap<Reverse<(u64, u64, Ev)>>,
    seq: u64,
    now: u64,
    /// Churn, step-time jitter and pseudo-gradient draws, a stream each.
    draws: Draws,
    /// Inner steps per round and worker, for the rounds not closed yet.
    compute: BTreeMap<u64, BTreeMap<u32, Vec<Steps>>>,
    /// The inner steps of every contribution averaged.
    useful: Vec<Steps>,
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
    /// The shepherd's event loop and aggregate threads.
    cpu: Cpu,
    /// The aggregators, if any.
    /// The aggregators, and the aggregated rounds' sums (`contribute.rs`).
    agg: contribute::Aggregation,
    /// Live workers (connections held at the shepherd).
    alive: usize,
    /// Joins refused at the shepherd's connection cap.
    refused: u64,
    last_close: u64,
    /// When the shepherd's loop finished closing the last round (the next announcement goes out).
    closed_at: u64,
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
        rating: setup.cpu.screen.map(|s| pcp_protocol::diloco::rating::Policy {
            probation_rounds: s.probation_rounds,
            ..Default::default()
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
        draws: Draws {
            churn: rng(setup.seed, Stream::Churn),
            jitter: rng(setup.seed, Stream::Jitter),
            delta: rng(setup.seed, Stream::Delta),
        },
        compute: BTreeMap::new(),
        closed: 0,
        window: RoundStats::default(),
        deadlines: BTreeMap::new(),
        participants: Vec::new(),
        budgets: BTreeMap::new(),
        served: BTreeMap::new(),
        useful: Vec::new(),
        cpu: Cpu::new(setup.cpu.clone(), rng(setup.seed, Stream::Screen), rng(setup.seed, Stream::Screeners)),
        agg: contribute::Aggregation::new(setup.aggregators.clone().map(|a| Pool::new(a, setup.seed))),
        alive: 0,
        refused: 0,
        last_close: 0,
        closed_at: 0,
        done: Vec::new(),
        finished: false,
    };
    for _ in 0..setup.workers {
        sim.join();
    }
    let join_rate = setup.churn_per_hour * setup.workers as f64 / 3600.0;
    if join_rate > 0.0 {
        let at = exp_us(&mut sim.draws.churn, join_rate);
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
    windowed_utilization(&mut sim.done, &mut sim.useful);
    let mut summary = Summary::of(&sim.done);
    if setup.overlap {
        summary.overall_utilization = Some(summary.utilization);
    }
    summary.aggregators = sim.agg.pool.as_ref().map(|p| p.totals);
    summary.shepherd = Some(crate::report::ShepherdSummary {
        cpu: sim.cpu.totals,
        refused_joins: sim.refused,
        heartbeat_overload: sim.cpu.totals.peak_heartbeat_load > 1.0,
    });
    let strategy = if setup.overlap { "diloco-star+overlap" } else { "diloco-star" };
    StrategyReport { strategy: strategy.into(), engine: "protocol".into(), rounds: sim.done, summary }
}

/// Sets each round's utilization to the inner-step time of the contributions
/// averaged (in any round) that ran inside the round's wall-time window (from
/// the previous close to its own), over participants × that window, at most 1
/// (a window can hold steps of workers no longer among its participants: those
/// of a worker that left, carried over), and its trained steps to theirs in it.
fn windowed_utilization(rounds: &mut [RoundStats], useful: &mut [Steps]) {
    useful.sort_unstable();
    let ends: Vec<u64> = rounds.iter().map(|r| us(r.end_s)).collect();
    let mut compute = vec![0.0f64; rounds.len()];
    for &(from, to, steps) in useful.iter() {
        // the first window ending after `from`, then the ones after it that `to` reaches
        let mut k = ends.partition_point(|e| *e <= from);
        while k < ends.len() {
            let start = if k == 0 { 0 } else { ends[k - 1] };
            let overlap = to.min(ends[k]).saturating_sub(from.max(start));
            compute[k] += secs(overlap);
            rounds[k].trained_steps += steps as f64 * if to > from { overlap as f64 / (to - from) as f64 } else { 1.0 };
            if to <= ends[k] {
                break;
            }
            k += 1;
        }
    }
    for (r, c) in rounds.iter_mut().zip(compute) {
        let capacity = r.participants as f64 * r.wall_s;
        r.utilization = if capacity > 0.0 { (c / capacity).min(1.0) } else { 0.0 };
    }
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

    /// What the open round's uploads go through: the shepherd's downlink, or the
    /// aggregators' downlinks together (each slice reaches every replica of its
    /// shard: the worker's upload, then the first replica's forward).
    fn upload_link(&self) -> f64 {
        match &self.agg.pool {
            Some(p) if p.active() => p.down() / p.setup().replicas.max(1) as f64,
            _ => self.world.shepherd.down,
        }
    }

    /// Bytes a worker uploads for round `r`: its contribution, once (aggregated, each
    /// slice to its shard's first replica, which forwards it to the others; a
    /// committee's members fetch the slices from those aggregators, not from it).
    fn upload_bytes(&self, r: u64) -> f64 {
        self.contribution_bytes(r)
    }

    /// Bytes a worker holding round `r − 1`'s parameters fetches for round `r`, if
    /// less than the parameters: the update (sparse), or the fragment's.
    fn held_fetch_bytes(&self, r: u64) -> Option<f64> {
        self.fragment(r).map(|f| f.fetch_bytes).or(self.setup.update_bytes)
    }

    fn push(&mut self, t: u64, ev: Ev) {
        self.seq += 1;
        self.queue.push(Reverse((t, self.seq, ev)));
    }

    fn join(&mut self) {
        if self.alive >= self.setup.cpu.max_connections {
            self.refused += 1;
            return;
        }
        self.alive += 1;
        let spec = self.world.draw_node();
        let w = self.workers.len() as u32;
        let lifetime = exp_us(&mut self.draws.churn, self.setup.churn_per_hour / 3600.0);
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
            screening: 0,
        });
        if leave_us < u64::MAX / 4 {
            self.push(leave_us, Ev::Leave { w });
        }
        let now = self.now;
        self.shepherd_input(Input::Joined(w), now, false);
    }

    /// Screeners a committee (0: the shepherd screens).
    fn screeners(&self) -> u32 {
        self.cpu.costs().screen.map_or(0, |p| p.screeners)
    }

    /// Worker `w` ran round `r`'s inner steps from `since` to `now` (µs), its
    /// screening last.
    fn computed(&mut self, r: u64, w: u32, since: u64, now: u64) {
        let now = now.saturating_sub(self.workers[w as usize].screening).max(since);
        // overlap: a round closed may still be carried into the next
        let open = if self.setup.overlap { r >= self.closed } else { r > self.closed };
        if open {
            let steps = if self.setup.overlap { self.workers[w as usize].steps.0 } else { self.setup.tau };
            self.compute.entry(r).or_default().entry(w).or_default().push((since, now, steps));
        }
    }

    /// Lockstep: worker `w` trains round `r` again from the parameters it holds,
    /// from `now` (its deadline was extended after it lapsed), and uploads alone on
    /// its link.
    fn retake(&mut self, w: u32, r: u64, now: u64) {
        let train = self.train_seconds(w);
        let ws = &self.workers[w as usize];
        let lat = self.world.latency(&ws.spec, 0, &self.world.shepherd);
        let arrive = secs(now) + train + self.upload_bytes(r) / ws.spec.link.up + lat;
        self.push(now, Ev::ParamsReady { w, r, train_us: us(train), arrive_us: us(arrive), bytes: 0 });
    }

    /// Seconds of τ inner steps for worker `w` this round (its slowdown and jitter).
    fn train_seconds(&mut self, w: u32) -> f64 {
        self.setup.tau as f64 * self.step_seconds(w)
    }

    /// Seconds of one inner step for worker `w` this round (its slowdown and jitter).
    fn step_seconds(&mut self, w: u32) -> f64 {
        let jitter = self.setup.step_seconds * self.world.config.jitter;
        let noise = if jitter > 0.0 { self.draws.jitter.gen_range(-1.0..=1.0) } else { 0.0 };
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
                    // with committees, each worker screens about `screeners` contributions a
                    // round on its training loop: two forward passes and its host's work each,
                    // and the round's parameters uploaded once
                    let k = self.screeners() as f64;
                    let host = self.cpu.costs().screen.map_or(ScreenHost::default(), |p| p.host);
                    let base = if k > 0.0 { host.base } else { 0.0 };
                    let screening = us(k * (2.0 / 3.0 * step + host.aggregated) + base);
                    let train = us(n as f64 * step) + screening;
                    let ws = &mut self.workers[w as usize];
                    ws.screening = screening;
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
                    let bytes = self.upload_bytes(*r);
                    let ws = &mut self.workers[w as usize];
                    let up = planned.unwrap_or_else(|| us(bytes / ws.spec.link.up.max(1e-9)));
                    let (n, train) = ws.steps;
                    // its claimed time is its inner steps', as the node's
                    ws.sends.push((*r, now, n, train.saturating_sub(ws.screening)));
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
                    let step = train.saturating_sub(ws.screening) as f64 / n as f64;
                    let k = (((by.saturating_sub(start)) as f64 / step).ceil() as u64).clamp(1, n);
                    let train = (step * k as f64).round() as u64 + ws.screening;
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
                let at = now.saturating_add(exp_us(&mut self.draws.churn, join_rate));
                self.push(at, Ev::Join);
            }
            Ev::Leave { w } => {
                let crash = self.draws.churn.r#gen::<f64>() < self.setup.crash_fraction;
                let ws = &mut self.workers[w as usize];
                ws.alive = false;
                ws.training = None;
                self.alive -= 1;
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
                if !ws.alive {
                    return;
                }
                let actions = ws.machine.handle(worker::Input::DeadlineExtended { round: r, deadline_ms }, now / 1000);
                // a lockstep round that lapsed at its deadline is taken up again; one
                // whose parameters came is trained at once (the fetch still under way
                // ends with its own ParamsReady)
                if actions.contains(&worker::Action::FetchParams(r)) && ws.held == Some(r) {
                    self.retake(w, r, now);
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
                    self.computed(r, w, since, now);
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
            Ev::Decoded { w, r, screened } => self.contribute(w, r, now, screened),
            Ev::Aggregated { r } => self.aggregated(r, now),
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
                self.computed(r, w, since, now);
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
                    if let Some(pool) = self.agg.pool.as_mut() {
                        pool.open(round);
                    }
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
                    if let Some(trained) = self.compute.get(&r) {
                        for w in &summary.contributors {
                            self.useful.extend(trained.get(w).into_iter().flatten());
                        }
                    }
                    if let Some(before) = self.compute.get(&r.saturating_sub(1)) {
                        for w in &summary.carried {
                            self.useful.extend(before.get(w).into_iter().flatten());
                        }
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
                    self.control_bytes(&mut s, participants);
                    s.worker_bytes_in /= p;
                    s.worker_bytes_out /= p;
                    self.last_close = now;
                    // aggregated, the shards' means were gathered first (`Action::Aggregate`)
                    s.shepherd_bytes_in += std::mem::take(&mut self.agg.gathered_bytes);
                    let work = self.fragment(r + 1).map_or(1.0, |f| f.work);
                    self.closed_at = self.cpu.close(now, s.wall_s, work, (r, r == self.setup.rounds));
                    self.done.push(s);
                }
                Action::Finished => self.finished = true,
                Action::Added { round, peer, of, weight, norm, bound } => {
                    self.added((round, of), peer, (weight, norm, bound));
                }
                Action::Aggregate { round, count } => self.aggregate(round, count, now),
                Action::WorkerJoined(_) | Action::WorkerLeft { .. } => {}
            }
        }
    }
}
