//! Links and transfers.
//!
//! Every node has an uplink, a downlink (bytes/s) and an access latency drawn
//! from a named [`Profile`]. Nodes live in regions; between regions a message
//! also pays half of an intercontinental round trip (80–250 ms, drawn per
//! region pair). A transfer between a worker and a hub (the shepherd or a
//! regional aggregator) is a fluid flow: all flows through the hub's link share
//! it max-min fairly, and each flow is also capped by the worker's own link
//! ([`fair_share`]). Windows, slow start and loss are not modelled.

use std::cmp::Ordering;
use std::collections::BTreeSet;

use rand::Rng;
use serde::Serialize;

/// Named link profiles.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Profile {
    /// 10–100 Gbps symmetric, 0.5–2 ms access latency.
    Datacenter,
    /// 1 Gbps symmetric, 2–10 ms.
    University,
    /// 20–500 Mbps down, 5–50 Mbps up (log-uniform), 5–30 ms.
    Residential,
    /// One machine: 1 GB/s each way, 50 µs, one region.
    Loopback,
}

/// A node's link.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Link {
    /// Bytes/s out.
    pub up: f64,
    /// Bytes/s in.
    pub down: f64,
    /// One-way access latency, seconds.
    pub latency: f64,
}

const GBPS: f64 = 1e9 / 8.0;
const MBPS: f64 = 1e6 / 8.0;

fn log_uniform(rng: &mut impl Rng, lo: f64, hi: f64) -> f64 {
    (lo.ln() + rng.r#gen::<f64>() * (hi.ln() - lo.ln())).exp()
}

impl Profile {
    /// Draws one node's link.
    pub fn draw(self, rng: &mut impl Rng) -> Link {
        match self {
            Self::Datacenter => {
                let bw = log_uniform(rng, 10.0 * GBPS, 100.0 * GBPS);
                Link { up: bw, down: bw, latency: rng.gen_range(0.0005..0.002) }
            }
            Self::University => Link { up: GBPS, down: GBPS, latency: rng.gen_range(0.002..0.010) },
            Self::Residential => Link {
                up: log_uniform(rng, 5.0 * MBPS, 50.0 * MBPS),
                down: log_uniform(rng, 20.0 * MBPS, 500.0 * MBPS),
                latency: rng.gen_range(0.005..0.030),
            },
            Self::Loopback => Link { up: 8.0 * GBPS, down: 8.0 * GBPS, latency: 0.000_05 },
        }
    }

    /// Whether nodes of this profile are spread over regions.
    pub fn spans_regions(self) -> bool {
        self != Self::Loopback
    }

    /// The preset's name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Self::Datacenter => "datacenter",
            Self::University => "university",
            Self::Residential => "residential",
            Self::Loopback => "loopback",
        }
    }
}

/// One transfer through a shared hub link.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Flow {
    /// When it starts, seconds.
    pub start: f64,
    /// Bytes to move.
    pub bytes: f64,
    /// The most this flow can get (the worker's own link), bytes/s.
    pub cap: f64,
}

#[derive(Clone, Copy, Debug, PartialEq)]
struct Key(f64);

impl Eq for Key {}

impl PartialOrd for Key {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Key {
    fn cmp(&self, other: &Self) -> Ordering {
        self.0.total_cmp(&other.0)
    }
}

/// When each flow finishes if all share a link of `capacity` bytes/s max-min
/// fairly, each also capped by its own `cap`.
///
/// Exact fluid model in O(n log n): flows limited by their cap run at it;
/// the others split what is left equally (rate λ) and are tracked in
/// "virtual bytes" (the integral of λ), so a rate change costs nothing for
/// them; a flow crosses between the two sets only when λ crosses its cap.
pub fn fair_share(capacity: f64, flows: &[Flow]) -> Vec<f64> {
    fair_share_growing(capacity, flows, &[])
}

/// [`fair_share`] through a link that grows by `gains[i]` bytes/s when flow `i`
/// finishes (a swarm: a worker serves a blob once it has fetched all of it).
pub fn fair_share_growing(capacity: f64, flows: &[Flow], gains: &[f64]) -> Vec<f64> {
    let mut capacity = capacity;
    let n = flows.len();
    let mut finish = vec![f64::INFINITY; n];
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|a, b| flows[*a].start.total_cmp(&flows[*b].start).then(a.cmp(b)));
    let mut next_arrival = 0;
    // uncapped: finish in virtual bytes; capped: finish in seconds
    let mut target = vec![0.0f64; n];
    let caps: Vec<f64> = flows.iter().map(|f| f.cap.max(1e-9)).collect();
    let mut unc_by_finish: BTreeSet<(Key, usize)> = BTreeSet::new();
    let mut unc_by_cap: BTreeSet<(Key, usize)> = BTreeSet::new();
    let mut cap_by_finish: BTreeSet<(Key, usize)> = BTreeSet::new();
    let mut cap_by_cap: BTreeSet<(Key, usize)> = BTreeSet::new();
    let mut capped_sum = 0.0f64;
    // changes to `capped_sum` since it was last summed afresh
    let mut changes = usize::MAX;
    let (mut t, mut v) = (0.0f64, 0.0f64);
    let lambda = |capacity: f64, capped_sum: f64, unc: usize| {
        if unc == 0 { f64::INFINITY } else { ((capacity - capped_sum) / unc as f64).max(0.0) }
    };
    loop {
        // rebalance: caps below λ run at their cap, caps above it share
        for _ in 0..=2 * n + 2 {
            let l = lambda(capacity, capped_sum, unc_by_cap.len());
            if let Some(&(Key(c), i)) = unc_by_cap.first().filter(|(Key(c), _)| *c < l) {
                unc_by_cap.remove(&(Key(c), i));
                unc_by_finish.remove(&(Key(target[i]), i));
                target[i] = t + (target[i] - v).max(0.0) / c;
                cap_by_finish.insert((Key(target[i]), i));
                cap_by_cap.insert((Key(c), i));
                capped_sum += c;
                changes = changes.saturating_add(1);
                continue;
            }
            let unc = unc_by_cap.len();
            let over =
                cap_by_cap.last().copied().filter(|(Key(c), _)| *c > (capacity - capped_sum + *c) / (unc + 1) as f64);
            match over {
                Some((Key(c), i)) => {
                    cap_by_cap.remove(&(Key(c), i));
                    cap_by_finish.remove(&(Key(target[i]), i));
                    capped_sum -= c;
                    changes = changes.saturating_add(1);
                    target[i] = v + (target[i] - t).max(0.0) * c;
                    unc_by_finish.insert((Key(target[i]), i));
                    unc_by_cap.insert((Key(c), i));
                }
                _ => break,
            }
        }
        // every flow capped: the running sum is summed afresh (against drift), once
        // per as many changes as there are capped flows, so a round stays O(n log n)
        if unc_by_cap.is_empty() && changes >= cap_by_cap.len() {
            capped_sum = cap_by_cap.iter().map(|(Key(c), _)| c).sum();
            changes = 0;
        }
        let l = lambda(capacity, capped_sum, unc_by_cap.len());
        let arrival = order.get(next_arrival).map_or(f64::INFINITY, |i| flows[*i].start);
        let capped_done = cap_by_finish.first().map_or(f64::INFINITY, |(Key(f), _)| *f);
        let unc_done = unc_by_finish
            .first()
            .map_or(f64::INFINITY, |(Key(f), _)| if l > 0.0 { t + (f - v).max(0.0) / l } else { f64::INFINITY });
        let next = arrival.min(capped_done).min(unc_done);
        if !next.is_finite() {
            break;
        }
        if l.is_finite() {
            v += l * (next - t).max(0.0);
        }
        t = t.max(next);
        while let Some(&(Key(f), i)) = cap_by_finish.first().filter(|(Key(f), _)| *f <= t) {
            cap_by_finish.remove(&(Key(f), i));
            cap_by_cap.remove(&(Key(caps[i]), i));
            capped_sum -= caps[i];
            changes = changes.saturating_add(1);
            finish[i] = t;
            capacity += gains.get(i).copied().unwrap_or(0.0);
        }
        // (and what λ moves in time's last bits: late in a run, a step below t's
        // precision would otherwise never finish the flow)
        let slack = 1e-9 * v.abs() + 1e-6 + if l.is_finite() { l * (t.abs() * 1e-12 + 1e-12) } else { 0.0 };
        while let Some(&(Key(f), i)) = unc_by_finish.first().filter(|(Key(f), _)| *f <= v + slack) {
            unc_by_finish.remove(&(Key(f), i));
            unc_by_cap.remove(&(Key(caps[i]), i));
            finish[i] = t;
            capacity += gains.get(i).copied().unwrap_or(0.0);
        }
        while let Some(&i) = order.get(next_arrival).filter(|i| flows[**i].start <= t) {
            next_arrival += 1;
            let f = flows[i];
            if f.bytes <= 0.0 {
                finish[i] = t.max(f.start);
                capacity += gains.get(i).copied().unwrap_or(0.0);
                continue;
            }
            target[i] = v + f.bytes;
            unc_by_finish.insert((Key(target[i]), i));
            unc_by_cap.insert((Key(caps[i]), i));
        }
        if cap_by_cap.is_empty() {
            capped_sum = 0.0;
        }
    }
    finish
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-6 * b.abs().max(1.0)
    }

    #[test]
    fn one_flow_runs_at_the_smaller_of_link_and_cap() {
        assert!(close(fair_share(100.0, &[Flow { start: 1.0, bytes: 200.0, cap: 50.0 }])[0], 5.0));
        assert!(close(fair_share(10.0, &[Flow { start: 0.0, bytes: 100.0, cap: 50.0 }])[0], 10.0));
    }

    #[test]
    fn equal_flows_share_the_link() {
        let flows = vec![Flow { start: 0.0, bytes: 100.0, cap: 1e9 }; 4];
        for f in fair_share(100.0, &flows) {
            assert!(close(f, 4.0), "{f}");
        }
    }

    #[test]
    fn a_slow_flow_leaves_the_rest_to_the_others() {
        // capacity 100: the capped flow gets 10, the two others 45 each
        let flows = [
            Flow { start: 0.0, bytes: 100.0, cap: 10.0 },
            Flow { start: 0.0, bytes: 90.0, cap: 1e9 },
            Flow { start: 0.0, bytes: 90.0, cap: 1e9 },
        ];
        let f = fair_share(100.0, &flows);
        assert!(close(f[1], 2.0) && close(f[2], 2.0), "{f:?}");
        assert!(close(f[0], 10.0), "{f:?}");
    }

    #[test]
    fn a_late_flow_slows_an_early_one() {
        // first alone for 1 s (100 bytes), then both at 50/s
        let flows = [Flow { start: 0.0, bytes: 200.0, cap: 1e9 }, Flow { start: 1.0, bytes: 50.0, cap: 1e9 }];
        let f = fair_share(100.0, &flows);
        assert!(close(f[1], 2.0), "{f:?}");
        assert!(close(f[0], 2.5), "{f:?}");
    }

    #[test]
    fn a_swarm_grows_as_fetches_finish() {
        // a 10 B/s seed; each of two fetchers serves 100 B/s once it holds the blob
        let flows = [Flow { start: 0.0, bytes: 10.0, cap: 1e9 }, Flow { start: 0.0, bytes: 110.0, cap: 1e9 }];
        let f = fair_share_growing(10.0, &flows, &[100.0, 100.0]);
        // both at 5/s for 2 s; then the second alone at 110/s for its last 100 bytes
        assert!(close(f[0], 2.0), "{f:?}");
        assert!(close(f[1], 2.0 + 100.0 / 110.0), "{f:?}");
        assert_eq!(fair_share_growing(10.0, &flows, &[]), fair_share(10.0, &flows));
    }

    #[test]
    fn the_link_is_never_overused() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
        use rand::SeedableRng;
        let flows: Vec<Flow> = (0..300)
            .map(|_| Flow {
                start: rng.gen_range(0.0..5.0),
                bytes: rng.gen_range(1.0..100.0),
                cap: rng.gen_range(1.0..40.0),
            })
            .collect();
        let f = fair_share(200.0, &flows);
        let bytes: f64 = flows.iter().map(|f| f.bytes).sum();
        let first = flows.iter().map(|f| f.start).fold(f64::INFINITY, f64::min);
        let last = f.iter().copied().fold(0.0, f64::max);
        assert!(last - first >= bytes / 200.0 - 1e-6, "{last} {bytes}");
        for (fl, end) in flows.iter().zip(&f) {
            assert!(end.is_finite() && *end >= fl.start + fl.bytes / fl.cap - 1e-6, "{fl:?} {end}");
        }
    }
}
