//! The nemesis: a seeded schedule of faults over the first part of a run, after
//! which everything heals.

use rand::Rng;
use rand_chacha::ChaCha8Rng;

use super::net::{Link, Net};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kind {
    /// The node dies; it restarts when the fault ends, with its disk or without.
    Crash { node: usize, disk: bool },
    /// Whoever leads dies `delay` ms after it next completes a round (or when
    /// [`STRIKE_WITHIN_MS`] have passed), and restarts when the fault ends: the
    /// moment when a round is completed but not yet everywhere.
    CrashAfterRound { disk: bool, delay: u64 },
    /// The node's process is suspended (a paused VM): it handles nothing until
    /// the fault ends, when its monotonic clock has jumped by the pause.
    Pause { node: usize },
    /// The node's monotonic clock steps forward by `ms` at once.
    Jump { node: usize, ms: u64 },
    /// Nothing gets through from `from` to `to`; the other way works.
    Cut { from: usize, to: usize },
    /// `a` and `b` cannot reach each other.
    Split { a: usize, b: usize },
    /// The node reaches nobody and nobody reaches it.
    Isolate { node: usize },
    /// The nodes of `side` (a bit each) and the others cannot reach each other.
    Partition { side: u64 },
    /// Both directions between `a` and `b` lose, duplicate, delay and reorder.
    Degrade { a: usize, b: usize, loss: u32, dup: u32, delay: u64, jitter: u64 },
}

/// The node of a fault that hits whichever candidate leads when it starts.
pub(super) const LEADER: usize = usize::MAX;

/// A fault from `start` to `end` (global ms).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Fault {
    pub(super) start: u64,
    pub(super) end: u64,
    pub(super) kind: Kind,
}

impl Kind {
    /// The node whose process the fault hits, if it hits one.
    pub(super) fn node(&self) -> Option<usize> {
        match *self {
            Self::Crash { node, .. } | Self::Pause { node } | Self::Jump { node, .. } => Some(node),
            _ => None,
        }
    }

    /// The fault on `node` where it targets the leader.
    pub(super) fn on(self, leader: usize) -> Self {
        let pick = |n: usize| if n == LEADER { leader } else { n };
        match self {
            Self::Crash { node, disk } => Self::Crash { node: pick(node), disk },
            Self::Pause { node } => Self::Pause { node: pick(node) },
            Self::Isolate { node } => Self::Isolate { node: pick(node) },
            other => other,
        }
    }

    /// Whether it hits whichever candidate leads.
    pub(super) fn targets_leader(&self) -> bool {
        matches!(self, Self::Crash { node: LEADER, .. } | Self::Pause { node: LEADER } | Self::Isolate { node: LEADER })
    }
}

/// A [`Kind::CrashAfterRound`] strikes at the latest this long after it starts.
pub(super) const STRIKE_WITHIN_MS: u64 = 4_000;

/// The first fault starts after this (the run has completed a round or so).
const FIRST_MS: u64 = 1_500;
/// The last fault starts before this.
const LAST_MS: u64 = 15_000;

/// A seeded schedule for `nodes` nodes, the first `candidates` of them candidates.
pub(super) fn schedule(rng: &mut ChaCha8Rng, nodes: usize, candidates: usize, lease_ms: u64) -> Vec<Fault> {
    let count = rng.gen_range(1..=6);
    let mut faults: Vec<Fault> = Vec::new();
    let mut tries = 0;
    while faults.len() < count && tries < 50 {
        tries += 1;
        let start = rng.gen_range(FIRST_MS..LAST_MS);
        let node = rng.gen_range(0..nodes);
        // links between workers carry nothing: a link fault has a candidate at one end
        let other =
            if node < candidates { (node + rng.gen_range(1..nodes)) % nodes } else { rng.gen_range(0..candidates) };
        // crashes, pauses and isolation hit the leader two times in five
        let target = if rng.gen_bool(0.4) { LEADER } else { node };
        let (kind, duration) = match rng.gen_range(0..100) {
            0..12 => (Kind::Crash { node: target, disk: rng.gen_bool(0.6) }, rng.gen_range(300..5_000)),
            12..20 => {
                let delay = rng.gen_range(0..=800);
                // it ends (the node restarts) at least 300 ms after it strikes
                (
                    Kind::CrashAfterRound { disk: rng.gen_bool(0.5), delay },
                    STRIKE_WITHIN_MS + delay + rng.gen_range(300..5_000),
                )
            }
            20..30 => (Kind::Pause { node: target }, rng.gen_range(200..3 * lease_ms)),
            30..40 => (Kind::Jump { node, ms: rng.gen_range(50..=lease_ms) }, 0),
            40..55 => (Kind::Cut { from: node, to: other }, rng.gen_range(300..6_000)),
            55..65 => (Kind::Split { a: node, b: other }, rng.gen_range(300..6_000)),
            65..75 => (Kind::Isolate { node: target }, rng.gen_range(300..6_000)),
            75..85 => {
                let side = rng.gen_range(1..(1u64 << nodes) - 1);
                (Kind::Partition { side }, rng.gen_range(300..6_000))
            }
            _ => {
                let kind = Kind::Degrade {
                    a: node,
                    b: other,
                    loss: rng.gen_range(0..=500),
                    dup: rng.gen_range(0..=300),
                    delay: rng.gen_range(0..=300),
                    jitter: rng.gen_range(0..=600),
                };
                (kind, rng.gen_range(1_000..8_000))
            }
        };
        if !survivable(&kind, nodes, candidates) {
            continue;
        }
        let fault = Fault { start, end: start + duration, kind };
        // one fault at a time on a node's process (one on the leader is checked when it starts)
        let clash = |f: &Fault| {
            f.kind.node().is_some_and(|n| n != LEADER)
                && f.kind.node() == kind.node()
                && f.start <= fault.end
                && fault.start <= f.end
        };
        if !faults.iter().any(clash) {
            faults.push(fault);
        }
    }
    faults.sort_by_key(|f| (f.start, f.end));
    faults
}

/// Whether the design can survive `kind`: it never separates candidates from one
/// another, except by isolating one candidate from every node (see the module docs
/// of `faults` for why).
fn survivable(kind: &Kind, nodes: usize, candidates: usize) -> bool {
    let candidate = |n: usize| n < candidates;
    match *kind {
        Kind::Cut { from: a, to: b } | Kind::Split { a, b } => !(candidate(a) && candidate(b)),
        Kind::Partition { side } => {
            let inside = (0..candidates).filter(|c| side & 1 << c != 0).count();
            let alone = |side: u64| side.count_ones() == 1 && side.trailing_zeros() < candidates as u32;
            let all = (1u64 << nodes) - 1;
            inside == 0 || inside == candidates || alone(side) || alone(all & !side)
        }
        _ => true,
    }
}

/// The links as the `active` faults leave them.
pub(super) fn apply(net: &mut Net, nodes: usize, active: &[Fault]) {
    net.heal();
    let both = |net: &mut Net, a: usize, b: usize, f: &dyn Fn(&mut Link)| {
        f(net.link_mut(a, b));
        f(net.link_mut(b, a));
    };
    let cut = |l: &mut Link| l.cut = true;
    for f in active {
        match f.kind {
            Kind::Cut { from, to } => net.link_mut(from, to).cut = true,
            Kind::Split { a, b } => both(net, a, b, &cut),
            Kind::Isolate { node } => {
                for other in (0..nodes).filter(|o| *o != node) {
                    both(net, node, other, &cut);
                }
            }
            Kind::Partition { side } => {
                for a in (0..nodes).filter(|a| side & 1 << a != 0) {
                    for b in (0..nodes).filter(|b| side & 1 << b == 0) {
                        both(net, a, b, &cut);
                    }
                }
            }
            Kind::Degrade { a, b, loss, dup, delay, jitter } => both(net, a, b, &|l: &mut Link| {
                l.loss = l.loss.max(loss);
                l.dup = l.dup.max(dup);
                l.delay = l.delay.max(delay);
                l.jitter = l.jitter.max(jitter);
            }),
            Kind::Crash { .. } | Kind::CrashAfterRound { .. } | Kind::Pause { .. } | Kind::Jump { .. } => {}
        }
    }
}

/// The fault in words, nodes named by `name`.
pub(super) fn describe(f: &Fault, nodes: usize, name: &dyn Fn(usize) -> String) -> String {
    match f.kind {
        Kind::Crash { node, disk } => {
            format!("crash {} ({} its disk)", name(node), if disk { "keeps" } else { "loses" })
        }
        Kind::CrashAfterRound { disk, delay } => {
            format!(
                "crash the leader {delay} ms after its next round ({} its disk)",
                if disk { "keeps" } else { "loses" }
            )
        }
        Kind::Pause { node } => format!("pause {}", name(node)),
        Kind::Jump { node, ms } => format!("{}'s clock jumps {ms} ms ahead", name(node)),
        Kind::Cut { from, to } => format!("cut {} → {}", name(from), name(to)),
        Kind::Split { a, b } => format!("cut {} ↔ {}", name(a), name(b)),
        Kind::Isolate { node } => format!("isolate {}", name(node)),
        Kind::Partition { side } => {
            let group = |inside: bool| {
                (0..nodes).filter(|n| (side & 1 << n != 0) == inside).map(name).collect::<Vec<_>>().join(" ")
            };
            format!("partition {{{}}} | {{{}}}", group(true), group(false))
        }
        Kind::Degrade { a, b, loss, dup, delay, jitter } => format!(
            "degrade {} ↔ {}: {}% lost, {}% duplicated, {delay}+{jitter} ms",
            name(a),
            name(b),
            loss / 10,
            dup / 10
        ),
    }
}
