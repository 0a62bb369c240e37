//! A contribution's way into the shepherd: its bytes and the decode queue, or,
//! aggregated, its slices to the aggregators, their reports to the shepherd's
//! state machine ([`Input::Reported`]) and, at the close, their shard means
//! back ([`Input::Aggregated`]) when the pool has them ready. The machine's
//! sums are the aggregators' own ([`ShardSum`], the whole model one shard: the
//! simulated model is one small tensor a fragment).

use std::collections::BTreeMap;

use pcp_protocol::diloco::aggregate::{Bounds, Delta};
use pcp_protocol::diloco::aggregation::{Accept, ShardSum, inspect};
use pcp_protocol::diloco::shepherd::{self, Input, Report};
use rand::Rng;

use super::{Ev, Sim, us};
use crate::aggregators::Pool;
use crate::cpu::Screened;
use pcp_protocol::diloco::aggregate::Rejection;

/// The aggregators, and aggregated rounds' slices and sums.
#[derive(Debug)]
pub(super) struct Aggregation {
    /// The volunteers (`--aggregators`; none: the shepherd sums alone).
    pub(super) pool: Option<Pool>,
    /// Inspected (bounded) slices not added yet, by round and worker.
    held: BTreeMap<(u64, u32), Delta>,
    /// Each round's sum and the contributions it closed at, once known.
    sums: BTreeMap<u64, (ShardSum, u64)>,
    /// Bytes of shard means the shepherd read since the last close.
    pub(super) gathered_bytes: f64,
}

impl Aggregation {
    pub(super) fn new(pool: Option<Pool>) -> Self {
        Self { pool, held: BTreeMap::new(), sums: BTreeMap::new(), gathered_bytes: 0.0 }
    }
}

impl Sim<'_> {
    /// Worker `w`'s contribution for round `r` reached the shepherd: its bytes, and
    /// the shepherd's decode queue.
    pub(super) fn arrived(&mut self, w: u32, r: u64, now: u64) {
        let cb = self.contribution_bytes(r);
        self.window.worker_bytes_out += self.upload_bytes(r);
        // the node validates, then screens what is for the open round (or carried into it)
        let open = self.shepherd.completed() + 1;
        let screenable = !self.workers[w as usize].spec.hostile && (r == open || (self.setup.overlap && r + 1 == open));
        let must = self.shepherd.must_screen(&w);
        let work = self.fragment(r).map_or(1.0, |f| f.work);
        let aggregated = self.aggregated_now();
        let (at, screened) = match self.agg.pool.as_ref().filter(|_| aggregated).map(|p| p.setup().clone()) {
            Some(a) => {
                // its slices went to the aggregators, its commitment and their reports to the shepherd
                self.window.shepherd_bytes_in += a.commit_bytes;
                if let Some(pool) = self.agg.pool.as_mut() {
                    pool.arrived(now);
                }
                let (at, screened) = self.cpu.committed(now, cb, work, a.commit_s, must, screenable);
                let at = at.max(now + us(a.report_s));
                for liar in self.cpu.caught_screeners() {
                    self.shepherd.screener_caught(&liar);
                }
                match screened {
                    // its committee fetches its slices from its aggregators and screens them
                    Screened::ByCommittee | Screened::Disputed | Screened::Misjudged => {
                        let until = at + self.committee_delay(w, cb, false);
                        self.cpu.deferred_until(until, 0.0);
                        (until, screened)
                    }
                    _ => (at, screened),
                }
            }
            None => {
                self.window.shepherd_bytes_in += cb;
                let (at, screened) = self.cpu.contribution(now, w, (cb, work), must, screenable);
                for liar in self.cpu.caught_screeners() {
                    self.shepherd.screener_caught(&liar);
                }
                match screened {
                    // a disputed contribution is scored once its committee answered
                    Screened::ByCommittee | Screened::Disputed | Screened::Misjudged => {
                        let until = at + self.committee_delay(w, cb, true);
                        self.cpu.deferred_until(until, cb);
                        (until, screened)
                    }
                    _ => (at, screened),
                }
            }
        };
        self.push(at, Ev::Decoded { w, r, screened });
    }

    /// Hands worker `w`'s decoded and screened contribution for round `r` to the shepherd.
    pub(super) fn contribute(&mut self, w: u32, r: u64, now: u64, screened: Screened) {
        let screen = match screened {
            Screened::OverBudget => {
                let reason = Rejection::Unscreened;
                return self.shepherd_input(Input::Malformed { peer: w, round: r, reason }, now, false);
            }
            Screened::Misjudged => {
                // the lying committee's losses: the loss with it half a nat above the loss without
                let reason = Rejection::NoImprovement { before: 2.0, after: 2.5, reversed: 1.5 };
                return self.shepherd_input(Input::Malformed { peer: w, round: r, reason }, now, false);
            }
            Screened::Passed | Screened::ByCommittee | Screened::Disputed => {
                shepherd::Screen::Passed { improvement: 0.01 }
            }
            Screened::Skip => shepherd::Screen::Unscreened,
        };
        let hostile = self.workers[w as usize].spec.hostile;
        let tensor: Vec<f32> = if hostile {
            vec![f32::NAN, 0.0, 0.0, 0.0]
        } else {
            (0..4).map(|_| 0.01 * (1.0 + 0.1 * self.draws.delta.r#gen::<f32>())).collect()
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
        let mut timing = None;
        if self.setup.overlap {
            let ws = &mut self.workers[w as usize];
            if let Some(i) = ws.sends.iter().position(|s| s.0 == r) {
                let (_, sent, steps, train) = ws.sends.remove(i);
                samples = steps;
                timing = Some(shepherd::Timing { steps, train_ms: train / 1000, transfer_ms: (now - sent) / 1000 });
            }
        }
        let delta = Delta::Dense(delta);
        if !self.aggregated_now() {
            let input = Input::Contribution { peer: w, round: r, samples, loss: 2.0, delta, timing, screen };
            return self.shepherd_input(input, now, false);
        }
        // its aggregators inspect its slice by the round's bounds, and report it
        let sizes = self.shepherd.round_sizes(r).into_owned();
        let bounds = self.shepherd.round_bounds().cloned().unwrap_or_else(Bounds::none);
        let input = match inspect(delta, &sizes, &bounds) {
            Ok((bounded, report)) => {
                self.agg.held.insert((r, w), bounded);
                let report = Report { raw: report.raw, bounded_norm: report.bounded_norm };
                Input::Reported { peer: w, round: r, samples, loss: 2.0, report, timing, screen }
            }
            Err(reason) => Input::Malformed { peer: w, round: r, reason },
        };
        self.shepherd_input(input, now, false);
    }

    /// Round `r` closed at `now`: when its aggregators' shard means are with the
    /// shepherd (`now` when it summed alone).
    fn gather(&mut self, r: u64, now: u64) -> u64 {
        let bytes = self.contribution_bytes(r);
        let Some(pool) = self.agg.pool.as_mut() else { return now };
        let inflow = pool.inflow(now);
        let (c, down) = (&self.setup.cpu, self.world.shepherd.down);
        let (slice_core_s, shepherd) = (c.decode_s + c.add_core_s + c.transport_s_per_byte * bytes, (down, c.threads));
        pool.close(r, now, inflow, bytes, slice_core_s, self.setup.params_bytes, shepherd).ready_us
    }

    /// Whether a contribution arriving now goes to aggregators: the open round is
    /// aggregated, or the shepherd is aggregating the round just closed (its
    /// late contributions are carried into the next round, whose aggregators
    /// the pool assigns when it opens).
    /// How long worker `w`'s contribution of `bytes` waits for its committee: its
    /// bytes reach each screener (over a screener's downlink, the sender's link
    /// standing for the screener's), which answers after the inner step under way
    /// and two forward passes (a forward pass a third of a step) with its host's
    /// work to upload the contribution, and the answer comes back. `relayed`: the shepherd's uplink carries `screeners` copies
    /// (counted in its bytes out, not queued behind its other sends); else (an
    /// aggregated contribution) the screeners fetch its slices from its shards'
    /// aggregators, whose uplinks together serve every committee of the round at
    /// once at most (each fetch at the lower of its downlink and its share of
    /// them).
    fn committee_delay(&mut self, w: u32, bytes: f64, relayed: bool) -> u64 {
        let k = self.cpu.costs().screen.map_or(0, |p| p.screeners);
        if relayed {
            self.window.shepherd_bytes_out += f64::from(k) * bytes;
        }
        self.window.worker_bytes_in += f64::from(k) * bytes;
        let spec = &self.workers[w as usize].spec;
        let lat = self.world.latency(spec, 0, &self.world.shepherd);
        let served = match &self.agg.pool {
            Some(p) if !relayed => p.up() / (f64::from(k) * self.alive.max(1) as f64).max(1.0),
            _ => f64::INFINITY,
        };
        let transfer = bytes / spec.link.down.min(served).max(1e-9);
        let host = self.cpu.costs().screen.map_or(0.0, |p| if relayed { p.host.whole } else { p.host.aggregated });
        us(self.setup.step_seconds * (1.0 + 2.0 / 3.0) + host + transfer + 2.0 * lat)
    }

    pub(super) fn aggregated_now(&self) -> bool {
        self.agg.pool.as_ref().is_some_and(|p| p.active() || self.shepherd.aggregating().is_some())
    }

    /// The shepherd added worker `peer`'s aggregated contribution for round `of` to
    /// round `round` (the round before, carried over): its aggregators add it at
    /// the next place.
    pub(super) fn added(&mut self, (round, of): (u64, u64), peer: u32, (weight, norm, bound): (f64, f64, f64)) {
        let Some(slice) = self.agg.held.remove(&(of, peer)) else { return };
        let sizes = self.shepherd.round_sizes(round).into_owned();
        let (sum, seq) = self.agg.sums.entry(round).or_insert_with(|| (ShardSum::new(round, 0, sizes, 1), 0));
        // places are given in order, once each: the sum cannot refuse one
        let _ = sum.accept(Accept { seq: *seq, weight, norm, bound }, slice);
        *seq += 1;
    }

    /// Round `round` closed with `count` aggregated contributions: its shard means
    /// reach the shepherd when the pool has them.
    pub(super) fn aggregate(&mut self, round: u64, count: u64, now: u64) {
        // this round's late slices may still be carried into the next
        self.agg.held.retain(|(r, _), _| *r >= round);
        let ready = self.gather(round, now);
        if ready > now {
            self.agg.gathered_bytes += self.setup.params_bytes;
        }
        if let Some((_, seq)) = self.agg.sums.get_mut(&round) {
            *seq = count;
        }
        self.push(ready, Ev::Aggregated { r: round });
    }

    /// Round `r`'s shard means are with the shepherd.
    pub(super) fn aggregated(&mut self, r: u64, now: u64) {
        let mean = self.agg.sums.remove(&r).and_then(|(sum, count)| sum.finish(count).ok());
        let mean = mean.map(|u| (u.mean, u.total));
        self.shepherd_input(Input::Aggregated { round: r, mean }, now, false);
    }
}
