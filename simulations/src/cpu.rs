//! The shepherd's CPU in the star simulation: one event-loop thread that
//! everything waits for, and `threads` aggregate threads it hands parallel
//! work to and waits on.
//!
//! pcp-node's shepherd handles each contribution on its event loop: the
//! envelope's signature check, the transport's decryption and blake3 of the
//! bytes, the decode and check (`compress::decode_delta`, `Delta::validate`),
//! then the screen (two forward passes on the held-out batch, plus one a round
//! for the loss before), then the state machine's add (`RunningMean::push`:
//! dense contributions one at a time, sparse ones in batches of 32, each add
//! split over the aggregate threads). The loop awaits the forward passes and
//! the adds, so the simulator charges everything to one FIFO server: serial
//! work at a core's speed, parallel work (forward passes and adds) at
//! `threads` cores' speed. Receiving a contribution's bytes (the TCP stack,
//! TLS, yamux and the frame's copies, measured with the node) runs on libp2p's
//! connection tasks, on the same cores: it is charged as parallel work too, before
//! the contribution reaches the loop. A round's close holds the loop too: the last
//! batch's add, the validation batches' forward passes, and the parameters
//! hashed and stored with the checkpoint and the state blob.
//!
//! Heartbeats (each live worker's, every `poll_s`: a signature checked, one
//! made, ~450 bytes through the cipher) take a steady share of the loop, and
//! every other job on it runs that much slower (the share is capped at 95%,
//! and the report names it when it is past 100%). Each round's announcement,
//! fanned out to its participants, goes through the cipher on the loop when the
//! round opens. The blob bytes the shepherd itself serves go through the cipher
//! on libp2p's connection tasks (the swarm runs them on tokio's worker threads),
//! not on the loop: their core-seconds are counted apart ([`CpuTotals::serve_s`]).
//!
//! The screen's budget is the node's (`node/src/diloco/shepherd/screen.rs`): a
//! round screens its first [`MIN_SCREENS`] contributions whatever it costs;
//! past that, screening may take `share` of the last round's duration less its
//! screening; past the budget a rated peer's contribution is screened with
//! probability `sample` and one on probation is refused for the round
//! (`Rejection::Unscreened`), and its sender's next contribution is screened
//! whatever the budget (the node's `Waiting`: once per refusal, owed for
//! [`WAIT_ROUNDS`] rounds). Whether a peer is on probation is the real state
//! machine's ratings (`Shepherd::must_screen`).
//!
//! Not modelled: the shepherd's cores shared with other processes (with
//! `pcp-node loadtest` the synthetic workers run on the shepherd's machine), and
//! the leases and gossip a shepherd sends meanwhile.

use rand::Rng;
use rand_chacha::ChaCha8Rng;
use serde::Serialize;

mod committee;
pub use committee::ScreenerAttack;
use committee::{Committees, Draw};

/// Contributions a round screens whatever its budget (the node's `MIN_SCREENS`).
pub const MIN_SCREENS: u64 = 8;
/// Rounds a sender refused unscreened stays owed a screen (the node's `WAIT_ROUNDS`).
pub const WAIT_ROUNDS: u64 = 2;
/// The most of the loop heartbeats are taken to use: past it the report warns.
const MAX_LOAD: f64 = 0.95;

/// The screen's settings (pcp-node `--screen score`).
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct ScreenPolicy {
    /// Share of the last round's duration, less its screening, screening may take.
    pub share: f64,
    /// A rated peer's chance of being screened past the budget.
    pub sample: f64,
    /// Screens a key passes before it is rated.
    pub probation_rounds: u32,
    /// Screeners a committee (pcp-node `--screeners`; 0: the shepherd screens).
    pub screeners: u32,
    /// With committees: the share of contributions the shepherd spot-checks
    /// within its budget (pcp-node `--screen-spot-rate`).
    pub spot_rate: f64,
    /// With committees: what lying screeners report, and the share of workers
    /// that lie (`--hostile-screeners`).
    pub liars: Option<(ScreenerAttack, f64)>,
    /// Event-loop seconds the shepherd's screen spends on its host besides its
    /// forward passes ([`screen_host`]).
    pub host: ScreenHost,
}

/// Host seconds of one screen by pcp-node (`scoring::losses`), whatever device
/// runs its forward passes, which move the round's parameters on the device:
/// the contribution made ready and uploaded, once a screen (a top-k sparse one
/// as its kept indices and values, scattered on the device by `eval_sparse`;
/// any other dense, `eval_moved`), and the round's parameters uploaded, once a
/// round.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct ScreenHost {
    /// A contribution the shepherd read whole.
    pub whole: f64,
    /// An aggregated one, joined from its slices (as sparse as they are).
    pub aggregated: f64,
    /// The round's parameters uploaded, at the round's first screen.
    pub base: f64,
}

/// Seconds a kept entry of a top-k sparse contribution made ready to upload
/// (`scoring::sparse`: unpacked from its message, its indices as i32): 69 ms
/// for gpt2-124m's 10.19 M entries. Measured with `pcp-node bench screen --model
/// gpt2-124m --vocab 50257` (the default sparse encoding) on a 2-core Intel
/// Xeon (not the calibration table's AMD EPYC), 2026-12-08.
pub const SCREEN_ENTRY_S: f64 = 0.069 / BENCH_ENTRIES;
/// [`SCREEN_ENTRY_S`]'s upload of an entry (an i32 index and an f32 value):
/// 44 ms.
pub const SCREEN_ENTRY_UPLOAD_S: f64 = 0.044 / BENCH_ENTRIES;
/// Seconds a parameter of making a contribution in any other encoding dense
/// (`scoring::dense`: a fresh allocation whose pages fault in: 0.323 s for
/// 163 M parameters copied from a dense one), measured alike, in the same run.
pub const SCREEN_DENSE_S_PER_PARAM: f64 = 0.323 / BENCH_PARAMS;
/// [`SCREEN_DENSE_S_PER_PARAM`]'s upload of a parameter (on the CPU backend
/// IREE's buffer, allocated and copied into: 0.179 s; to a GPU, the host's side
/// of the transfer is taken as no cheaper).
pub const SCREEN_UPLOAD_S_PER_PARAM: f64 = 0.179 / BENCH_PARAMS;

/// The parameters of the bench's gpt2-124m (its head untied from the embedding).
const BENCH_PARAMS: f64 = 163_037_184.0;
/// Their kept entries in the default sparse layout (4 of every 64).
const BENCH_ENTRIES: f64 = BENCH_PARAMS / 16.0;

/// The host seconds of a screen of a model of `params` parameters, whose
/// contributions keep `entries` entries each in a top-k sparse layout (`None`:
/// another encoding, uploaded dense).
pub fn screen_host(params: f64, entries: Option<f64>) -> ScreenHost {
    let each = match entries {
        Some(e) => e * (SCREEN_ENTRY_S + SCREEN_ENTRY_UPLOAD_S),
        None => params * (SCREEN_DENSE_S_PER_PARAM + SCREEN_UPLOAD_S_PER_PARAM),
    };
    ScreenHost { whole: each, aggregated: each, base: SCREEN_UPLOAD_S_PER_PARAM * params }
}

/// What the shepherd's CPU work costs in a run (from the calibration table).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ShepherdCosts {
    /// Aggregate threads: forward passes and adds run at this many cores' speed.
    pub threads: usize,
    /// Event-loop seconds per contribution of the whole model: signature check, decode and check.
    pub decode_s: f64,
    /// Event-loop seconds per byte of a contribution: decryption and blake3.
    pub per_byte_s: f64,
    /// Event-loop seconds to check one signature.
    pub verify_s: f64,
    /// Core-seconds to add a contribution of the whole model.
    pub add_core_s: f64,
    /// Core-seconds per byte of a contribution received beyond the cipher and blake3:
    /// the TCP stack, TLS, yamux and the frame's copies.
    pub transport_s_per_byte: f64,
    /// Core-seconds to hold a contribution of the whole model that the shepherd reads
    /// itself to the copy check (on the aggregate threads, the loop waiting); 0 without it.
    pub copy_check_core_s: f64,
    /// Contributions added together (32 for sparse, 1 for dense).
    pub add_batch: usize,
    /// Seconds of one forward pass on the screen's (and a validation) batch, where
    /// the shepherd runs it: its aggregate threads, or its device.
    pub forward_s: f64,
    /// Where it runs, for the report: the calibration CPU's cores, or a device
    /// (derived: a third of its modelled step).
    pub forward_on: String,
    /// The screen, with `--screen score`.
    pub screen: Option<ScreenPolicy>,
    /// Validation batches evaluated at each close.
    pub eval_batches: u64,
    /// Event-loop seconds a close spends before the next announcement: the outer step,
    /// the parameters' and their shards' hashes, and the state blob.
    pub close_s: f64,
    /// Event-loop seconds a close spends writing the parameters' shards, after the
    /// announcement.
    pub shards_s: f64,
    /// Event-loop seconds a close spends writing a checkpoint, when one is due.
    pub checkpoint_s: f64,
    /// A checkpoint after every this many rounds (pcp-node `--checkpoint-rounds`), the
    /// last and the first ([`pcp_protocol::diloco::checkpoint::due`]).
    pub checkpoint_rounds: u64,
    /// Event-loop seconds per heartbeat: its signature checked, the answer's made, its bytes ciphered.
    pub heartbeat_s: f64,
    /// Event-loop seconds per byte through the transport's cipher.
    pub cipher_s_per_byte: f64,
    /// Connections the shepherd admits; workers beyond them cannot join.
    pub max_connections: usize,
}

impl ShepherdCosts {
    /// Free work: an infinitely fast shepherd (the analytic strategies' and old tests' view).
    pub fn free(threads: usize) -> Self {
        Self {
            threads: threads.max(1),
            decode_s: 0.0,
            per_byte_s: 0.0,
            verify_s: 0.0,
            add_core_s: 0.0,
            transport_s_per_byte: 0.0,
            copy_check_core_s: 0.0,
            add_batch: 1,
            forward_s: 0.0,
            forward_on: String::new(),
            screen: None,
            eval_batches: 0,
            close_s: 0.0,
            shards_s: 0.0,
            checkpoint_s: 0.0,
            checkpoint_rounds: pcp_protocol::diloco::checkpoint::DEFAULT_CHECKPOINT_ROUNDS,
            heartbeat_s: 0.0,
            cipher_s_per_byte: 0.0,
            max_connections: usize::MAX,
        }
    }

    /// Seconds of one forward pass.
    fn forward_s(&self) -> f64 {
        self.forward_s
    }
}

/// The screen's verdict on a contribution, decided when the loop takes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Screened {
    /// Not screened (norm mode, not drawn, or not screenable).
    Skip,
    /// Screened (and passed: honest contributions lower the loss).
    Passed,
    /// On probation past the budget: refused for the round.
    OverBudget,
    /// Screened by its committee (and passed), not by the shepherd, unless it
    /// was spot-checked too.
    ByCommittee,
    /// Its committee's answers disagreed (some members lied): the shepherd
    /// scored it (and it passed) once they were in, and caught the liars.
    Disputed,
    /// A committee of liars agreed that it hurts the loss (`screen-high`), and
    /// no spot check caught them: refused as `NoImprovement`.
    Misjudged,
}

/// What the CPU did over a run, for the report.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct CpuTotals {
    /// Seconds the event loop was busy with contributions, screens and closes.
    pub busy_s: f64,
    /// Contributions screened.
    pub screened: u64,
    /// Contributions refused as on probation past the budget.
    pub over_budget: u64,
    /// Seconds spent screening.
    pub screen_s: f64,
    /// Seconds spent closing rounds.
    pub close_s: f64,
    /// Core-seconds of the connection tasks' cipher on the blob bytes the shepherd
    /// served (off the loop).
    pub serve_s: f64,
    /// The largest heartbeat share of the loop seen (may pass 1: the loop is overloaded).
    pub peak_heartbeat_load: f64,
    /// With committees: contributions their committees decided alone.
    pub by_committee: u64,
    /// With committees: contributions the shepherd spot-checked besides.
    pub spot_checks: u64,
    /// With lying screeners: contributions whose committee disagreed, which the shepherd scored.
    pub disputed: u64,
    /// With lying screeners: honest contributions a committee of liars refused.
    pub misjudged: u64,
    /// With lying screeners: screeners caught (barred and their ratings lost).
    pub screeners_caught: u64,
    /// With committees: contributions that found the contributions waiting for
    /// verdicts at the node's bounds, and went to the shepherd's own screen.
    pub undeferred: u64,
}

/// The shepherd's loop: when it is next free, and the screen's round state.
#[derive(Debug)]
pub struct Cpu {
    costs: ShepherdCosts,
    /// When the loop is free, µs.
    free: u64,
    /// Sparse contributions pushed and not added yet.
    pending: usize,
    /// Heartbeats' share of the loop.
    load: f64,
    /// The open round's screens and their seconds.
    screens: (u64, f64),
    /// With committees: the rated senders whose contributions to the open round
    /// arrived (the node's eligible screeners), and the liars.
    committees: Committees,
    /// The last closed round's duration less its screening, seconds.
    last_round_s: Option<f64>,
    /// Whether a checkpoint was written yet.
    checkpointed: bool,
    /// The open round, and the senders refused unscreened with their rounds.
    waiting: (u64, std::collections::BTreeMap<u32, u64>),
    rng: ChaCha8Rng,
    /// Totals.
    pub totals: CpuTotals,
}

fn us(s: f64) -> u64 {
    (s.max(0.0) * 1e6).round() as u64
}

impl Cpu {
    /// A loop free from time 0; `liars` draws the lying screeners and their committees.
    pub fn new(costs: ShepherdCosts, rng: ChaCha8Rng, liars: ChaCha8Rng) -> Self {
        let committees = Committees::new(costs.screen.and_then(|p| p.liars), liars);
        Self {
            costs,
            free: 0,
            pending: 0,
            load: 0.0,
            screens: (0, 0.0),
            committees,
            last_round_s: None,
            checkpointed: false,
            waiting: (1, std::collections::BTreeMap::new()),
            rng,
            totals: CpuTotals::default(),
        }
    }

    /// The costs.
    pub fn costs(&self) -> &ShepherdCosts {
        &self.costs
    }

    /// `alive` workers heartbeat every `poll_s`: the loop's share they take from now on.
    pub fn heartbeats(&mut self, alive: usize, poll_s: f64) {
        let load = if poll_s > 0.0 { alive as f64 * self.costs.heartbeat_s / poll_s } else { 0.0 };
        self.totals.peak_heartbeat_load = self.totals.peak_heartbeat_load.max(load);
        self.load = load.min(MAX_LOAD);
    }

    /// Runs `seconds` of work on the loop from `now` (µs) on; returns when it is done.
    fn run(&mut self, now: u64, seconds: f64) -> u64 {
        let start = self.free.max(now);
        let s = seconds / (1.0 - self.load);
        self.free = start + us(s);
        self.totals.busy_s += s;
        self.free
    }

    /// `bytes` of blobs served through the cipher on the connection tasks.
    pub fn serve(&mut self, bytes: f64) {
        self.totals.serve_s += bytes * self.costs.cipher_s_per_byte;
    }

    /// `bytes` through the cipher on the loop (announcements).
    pub fn cipher(&mut self, now: u64, bytes: f64) {
        let s = bytes * self.costs.cipher_s_per_byte;
        if s > 0.0 {
            self.run(now, s);
        }
    }

    /// Whether to screen a contribution (the node's `Screener::decide`); `must`: its
    /// sender `w` is on probation (`u32::MAX`: a sum of aggregators, no one's),
    /// `screenable`: it validated and is for the open round (or carried into it).
    fn decide(&mut self, (must, w): (bool, u32), screenable: bool) -> Screened {
        let Some(policy) = self.costs.screen.filter(|_| screenable) else { return Screened::Skip };
        let budget = self.last_round_s.map_or(f64::INFINITY, |s| s * policy.share);
        if self.screens.1 < budget || self.screens.0 < MIN_SCREENS {
            return Screened::Passed;
        }
        if must {
            if w != u32::MAX && self.waiting.1.remove(&w).is_some() {
                return Screened::Passed;
            }
            if w != u32::MAX {
                self.waiting.1.insert(w, self.waiting.0);
            }
            return Screened::OverBudget;
        }
        if self.rng.gen_bool(policy.sample.clamp(0.0, 1.0)) { Screened::Passed } else { Screened::Skip }
    }

    /// With committees (the node's `Screening` machine): a round's contributions
    /// before two rated senders' arrived have no committee, and the shepherd
    /// scores them ([`Screened::Passed`]); the rest their committees do
    /// ([`Screened::ByCommittee`]), and the shepherd scores the spot checks too
    /// while the round's screening is within its budget. Every contribution is
    /// screened: none is over budget. A committee with liars disagrees, and the
    /// shepherd scores it whatever its budget ([`Screened::Disputed`]); one of
    /// liars only decides unless spot-checked (`committee.rs`). Contributions
    /// waiting for their committees' verdicts are bounded as in the node
    /// (`MAX_DEFERRED`, `MAX_DEFERRED_BYTES`, each holding its `bytes` 2 + K
    /// times: its delta, its bounded copy and its K screen requests; an aggregated
    /// one, nothing: `bytes` is what it holds): past them the shepherd's own
    /// budgeted screen takes a contribution, and its sender screens none of the round's.
    fn by_committee(&mut self, policy: ScreenPolicy, (must, w): (bool, u32), (at, bytes): (u64, f64)) -> Screened {
        if !self.committees.room(at, bytes) {
            self.totals.undeferred += 1;
            return self.decide((must, w), true);
        }
        let quorum = (policy.screeners / 2 + 1) as usize;
        let committee = self.committees.eligible() >= quorum;
        if !must {
            self.committees.enlist(w);
        }
        if !committee {
            return Screened::Passed;
        }
        let draw = self.committees.draw(policy.screeners);
        // within the budget, without the floor of screens a run screening alone keeps
        let budget = self.last_round_s.map_or(f64::INFINITY, |s| s * policy.share);
        let spot = self.screens.1 < budget && self.rng.gen_bool(policy.spot_rate.clamp(0.0, 1.0));
        match draw {
            Draw::Disputed(liars) => {
                self.catch(&liars);
                self.totals.disputed += 1;
                Screened::Disputed
            }
            _ if spot => {
                if let Draw::Lying(liars, _) = draw {
                    self.catch(&liars);
                }
                self.totals.spot_checks += 1;
                Screened::Passed
            }
            Draw::Lying(_, ScreenerAttack::ScreenHigh) => {
                self.totals.misjudged += 1;
                Screened::Misjudged
            }
            Draw::Honest | Draw::Lying(_, ScreenerAttack::ScreenLow) => Screened::ByCommittee,
        }
    }

    fn catch(&mut self, liars: &[u32]) {
        self.committees.catch(liars);
    }

    /// A contribution of `bytes` waits for its committee's verdict until `until` (µs).
    pub fn deferred_until(&mut self, until: u64, bytes: f64) {
        self.committees.wait(until, 2.0 * bytes);
    }

    /// The screeners caught lying since the last call: the state machine takes
    /// their ratings (`Shepherd::screener_caught`).
    pub fn caught_screeners(&mut self) -> Vec<u32> {
        let caught = self.committees.take_caught();
        self.totals.screeners_caught += caught.len() as u64;
        caught
    }

    /// A contribution of `bytes` reached the shepherd at `now` (µs); `work` is its
    /// share of the model (fragments). Returns when the state machine gets it and
    /// the screen's verdict.
    /// `w`: its sender.
    pub fn contribution(
        &mut self,
        now: u64,
        w: u32,
        (bytes, work): (f64, f64),
        must: bool,
        screenable: bool,
    ) -> (u64, Screened) {
        self.received(now, (w, bytes), work, None, (must, screenable))
    }

    /// [`Cpu::contribution`] of a contribution whose shards aggregators sum: the loop
    /// checks its commitment and the reports of its slices (`commit_s`), and reads
    /// and decodes it only to screen it; it adds nothing.
    pub fn committed(
        &mut self,
        now: u64,
        bytes: f64,
        work: f64,
        commit_s: f64,
        must: bool,
        screenable: bool,
    ) -> (u64, Screened) {
        self.received(now, (u32::MAX, bytes), work, Some(commit_s), (must, screenable))
    }

    fn received(
        &mut self,
        now: u64,
        (w, bytes): (u32, f64),
        work: f64,
        committed: Option<f64>,
        (must, screenable): (bool, bool),
    ) -> (u64, Screened) {
        let c = &self.costs;
        let threads = c.threads.max(1) as f64;
        let mut read = c.decode_s * work + c.per_byte_s * bytes + c.transport_s_per_byte * bytes / threads;
        if committed.is_none() {
            // read here, not through aggregators: held to the copy check
            read += c.copy_check_core_s * work / threads;
        }
        let verdict = match self.costs.screen.filter(|p| p.screeners > 0 && screenable) {
            // a whole contribution waits as it came, bounded, and in its K requests; an
            // aggregated one holds nothing here (its members fetch its slices)
            Some(policy) => {
                let held = if committed.is_some() { 0.0 } else { (2.0 + f64::from(policy.screeners)) * bytes };
                self.by_committee(policy, (must, w), (self.free.max(now), held))
            }
            None => self.decide((must, w), screenable),
        };
        let mut s = match committed {
            Some(commit) if verdict == Screened::Passed => commit + read,
            Some(commit) => commit,
            None => read,
        };
        if matches!(verdict, Screened::Passed | Screened::Disputed) {
            // the loss before, once a round (and the round's parameters uploaded),
            // then with the contribution and reversed, moved on the device from
            // the contribution made dense and uploaded
            let first = self.screens.0 == 0;
            let passes = if first { 3.0 } else { 2.0 };
            let h = self.costs.screen.map_or(ScreenHost::default(), |p| p.host);
            let host = if committed.is_some() { h.aggregated } else { h.whole } + if first { h.base } else { 0.0 };
            let screen = passes * self.costs.forward_s() + host;
            self.screens.0 += 1;
            self.screens.1 += screen / (1.0 - self.load);
            self.totals.screened += 1;
            self.totals.screen_s += screen / (1.0 - self.load);
            s += screen;
        }
        if matches!(verdict, Screened::ByCommittee | Screened::Misjudged) {
            self.totals.by_committee += 1;
        }
        if verdict == Screened::OverBudget {
            self.totals.over_budget += 1;
        } else if screenable && committed.is_none() {
            let c = &self.costs;
            let threads = c.threads.max(1) as f64;
            self.pending += 1;
            if self.pending >= c.add_batch.max(1) {
                s += self.pending as f64 * c.add_core_s * work / threads;
                self.pending = 0;
            }
        }
        (self.run(now, s), verdict)
    }

    /// Round `round` closed at `now` (µs) after `wall_s` seconds: its last batch's
    /// add, validation, the parameters hashed and, when due (`last`: the run's last
    /// round), a checkpoint. Returns when the loop is done with them (the next
    /// announcement goes out then); the shards' writes hold it after that.
    pub fn close(&mut self, now: u64, wall_s: f64, work: f64, (round, last): (u64, bool)) -> u64 {
        let c = &self.costs;
        let threads = c.threads.max(1) as f64;
        let checkpoint = pcp_protocol::diloco::checkpoint::due(round, c.checkpoint_rounds, last, !self.checkpointed);
        self.checkpointed = true;
        let s = self.pending as f64 * c.add_core_s * work / threads
            + c.eval_batches as f64 * self.costs.forward_s()
            + c.close_s
            + if checkpoint { c.checkpoint_s } else { 0.0 };
        self.pending = 0;
        let rest = wall_s - self.screens.1;
        if rest > 0.0 {
            self.last_round_s = Some(rest);
        }
        self.screens = (0, 0.0);
        self.waiting.0 = round + 1;
        self.waiting.1.retain(|_, refused| refused.saturating_add(WAIT_ROUNDS) > round);
        self.committees.next_round();
        self.totals.close_s += (s + c.shards_s) / (1.0 - self.load);
        let shards_s = c.shards_s;
        let announced = self.run(now, s);
        self.run(announced, shards_s);
        announced
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    fn costs() -> ShepherdCosts {
        ShepherdCosts {
            decode_s: 0.01,
            add_core_s: 0.04,
            add_batch: 4,
            // 2 core-seconds on 2 threads
            forward_s: 1.0,
            screen: Some(ScreenPolicy {
                share: 0.25,
                sample: 0.0,
                probation_rounds: 3,
                screeners: 0,
                spot_rate: 0.0,
                liars: None,
                host: ScreenHost::default(),
            }),
            eval_batches: 1,
            ..ShepherdCosts::free(2)
        }
    }

    #[test]
    fn the_loop_serves_in_order_and_adds_in_batches_on_all_threads() {
        let mut cpu = Cpu::new(
            ShepherdCosts { screen: None, ..costs() },
            ChaCha8Rng::seed_from_u64(1),
            ChaCha8Rng::seed_from_u64(2),
        );
        // three decodes of 10 ms, then the fourth adds the batch: 4 × 40 ms over 2 threads
        let done: Vec<u64> = (0..4).map(|_| cpu.contribution(0, 0, (0.0, 1.0), false, true).0).collect();
        assert_eq!(done, vec![10_000, 20_000, 30_000, 120_000]);
        // a close adds what is pending and validates: one 1 s forward pass on 2 threads
        cpu.contribution(1_000_000, 0, (0.0, 1.0), false, true);
        assert_eq!(cpu.close(1_010_000, 10.0, 1.0, (1, false)), 1_010_000 + 20_000 + 1_000_000);
    }

    #[test]
    fn a_contributions_bytes_cost_the_transport_on_every_core() {
        let transport = ShepherdCosts { screen: None, transport_s_per_byte: 1e-8, ..costs() };
        let mut cpu = Cpu::new(transport, ChaCha8Rng::seed_from_u64(1), ChaCha8Rng::seed_from_u64(2));
        // 10 ms of decode, and 1 MB at 10 ns a byte over 2 threads: 5 ms more
        assert_eq!(cpu.contribution(0, 0, (1e6, 1.0), false, true).0, 15_000);
        // a contribution summed by aggregators is not read: its commitment is all
        assert_eq!(cpu.committed(15_000, 1e6, 1.0, 0.001, false, true).0, 16_000);
    }

    #[test]
    fn the_shepherds_screen_costs_its_loop_an_upload_of_the_contribution() {
        let mut policy = costs().screen.expect("a screen");
        policy.host = ScreenHost { whole: 0.1, aggregated: 0.05, base: 0.2 };
        let screening = ShepherdCosts { screen: Some(policy), ..costs() };
        let mut cpu = Cpu::new(screening, ChaCha8Rng::seed_from_u64(1), ChaCha8Rng::seed_from_u64(2));
        // the round's first screen: 10 ms of decode, three 1 s passes, the round's
        // parameters uploaded (200 ms) and the contribution made dense and uploaded (100 ms)
        assert_eq!(cpu.contribution(0, 0, (0.0, 1.0), false, true), (3_310_000, Screened::Passed));
        // then two passes and the contribution's 100 ms
        assert_eq!(cpu.contribution(3_310_000, 1, (0.0, 1.0), false, true).0, 5_420_000);
        // an aggregated one, dense already: 1 ms of commitment, its decode, two
        // passes and its 50 ms copy and upload
        assert_eq!(cpu.committed(5_420_000, 0.0, 1.0, 0.001, false, true).0, 7_481_000);
    }

    #[test]
    fn a_contribution_the_shepherd_reads_is_held_to_the_copy_check() {
        let copies = ShepherdCosts { screen: None, copy_check_core_s: 0.04, ..costs() };
        let mut cpu = Cpu::new(copies, ChaCha8Rng::seed_from_u64(1), ChaCha8Rng::seed_from_u64(2));
        // 10 ms of decode, and 40 ms of a core's copy check over 2 threads: 20 ms more
        assert_eq!(cpu.contribution(0, 0, (0.0, 1.0), false, true).0, 30_000);
        // half the model (a fragment): half the check
        assert_eq!(cpu.contribution(30_000, 0, (0.0, 0.5), false, true).0, 45_000);
        // one summed by aggregators is not held to it: its commitment is all
        assert_eq!(cpu.committed(45_000, 0.0, 1.0, 0.001, false, true).0, 46_000);
    }

    #[test]
    fn the_shards_are_written_after_the_announcement_and_hold_the_loop() {
        let costs = ShepherdCosts { close_s: 1.0, shards_s: 0.5, ..ShepherdCosts::free(1) };
        let mut cpu = Cpu::new(costs, ChaCha8Rng::seed_from_u64(1), ChaCha8Rng::seed_from_u64(2));
        let announced = cpu.close(0, 10.0, 1.0, (2, false));
        assert_eq!(announced, 1_000_000, "the announcement waits for the close, not the shards");
        assert_eq!(cpu.run(announced, 0.1), 1_600_000, "the loop's next work waits for the shards");
    }

    #[test]
    fn a_close_writes_a_checkpoint_first_every_kth_round_and_last() {
        let costs = ShepherdCosts { close_s: 1.0, checkpoint_s: 2.0, checkpoint_rounds: 3, ..ShepherdCosts::free(1) };
        let mut cpu = Cpu::new(costs, ChaCha8Rng::seed_from_u64(1), ChaCha8Rng::seed_from_u64(2));
        let mut at = 0;
        let seconds: Vec<u64> = (1..=7)
            .map(|r| {
                let done = cpu.close(at, 10.0, 1.0, (r, r == 7));
                let s = (done - at) / 1_000_000;
                at = done;
                s
            })
            .collect();
        assert_eq!(seconds, [3, 1, 3, 1, 1, 3, 3]);
    }

    #[test]
    fn past_the_budget_probation_is_refused_and_rated_peers_skipped() {
        let mut cpu = Cpu::new(costs(), ChaCha8Rng::seed_from_u64(1), ChaCha8Rng::seed_from_u64(2));
        // round 1 has no budget yet: everything is screened
        for _ in 0..10 {
            assert_eq!(cpu.contribution(0, 0, (0.0, 1.0), true, true).1, Screened::Passed);
        }
        // 21 s of screening (3 passes, then 2 a contribution, of 1 s) in a 40 s round
        cpu.close(0, 40.0, 1.0, (1, false));
        // round 2: 8 screens whatever the budget (a quarter of 19 s)
        let verdicts: Vec<Screened> = (0..10).map(|i| cpu.contribution(0, 0, (0.0, 1.0), i % 2 == 0, true).1).collect();
        assert!(verdicts[..8].iter().all(|v| *v == Screened::Passed), "{verdicts:?}");
        assert_eq!(verdicts[8..], [Screened::OverBudget, Screened::Skip]);
        assert_eq!(cpu.totals.over_budget, 1);
        // its sender is owed a screen: its next contribution is screened, once
        assert_eq!(cpu.contribution(0, 0, (0.0, 1.0), true, true).1, Screened::Passed);
        assert_eq!(cpu.contribution(0, 0, (0.0, 1.0), true, true).1, Screened::OverBudget);
        // hostile (unscreenable) contributions are neither screened nor added
        assert_eq!(cpu.contribution(0, 0, (0.0, 1.0), true, false).1, Screened::Skip);
    }

    #[test]
    fn heartbeats_slow_the_loop() {
        let mut cpu = Cpu::new(
            ShepherdCosts { heartbeat_s: 1e-4, screen: None, ..costs() },
            ChaCha8Rng::seed_from_u64(1),
            ChaCha8Rng::seed_from_u64(2),
        );
        // 2,500 workers every 0.5 s at 100 µs: half the loop
        cpu.heartbeats(2_500, 0.5);
        assert_eq!(cpu.contribution(0, 0, (0.0, 1.0), false, true).0, 20_000);
        cpu.heartbeats(100_000, 0.5);
        assert!(cpu.totals.peak_heartbeat_load > 19.0);
    }
}
