//! The nemesis: a seeded schedule of faults over the first part of a run, after
//! which everything heals (but the nodes it crashed for good).

use rand::Rng;
use rand_chacha::ChaCha8Rng;

use super::msg::Mode;
use super::net::{Link, Net};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kind {
    /// The node dies; it restarts when the fault ends, with its disk or without,
    /// unless `permanent`. (In a [`Mode::Majority`] run a candidate that loses its
    /// disk never restarts either: its identity key was on it.)
    Crash { node: usize, disk: bool, permanent: bool },
    /// Whoever leads dies `delay` ms after it next completes a round (or when
    /// [`STRIKE_WITHIN_MS`] have passed), and restarts when the fault ends: the
    /// moment when a round is completed but not yet everywhere.
    CrashAfterRound { disk: bool, delay: u64 },
    /// The node's process is suspended (a paused VM): it handles nothing until the
    /// fault ends. Its monotonic clock counts the pause (it jumps on waking, as
    /// `CLOCK_BOOTTIME` does), or with `frozen` it stopped (a VM whose clock froze:
    /// the node wakes believing little time passed).
    Pause { node: usize, frozen: bool },
    /// The node's monotonic clock steps forward by `ms` at once.
    Jump { node: usize, ms: u64 },
    /// Nothing gets through from `from` to `to`; the other way works.
    Cut { from: usize, to: usize },
    /// `a` and `b` cannot reach each other.
    Split { a: usize, b: usize },
    /// What `from` sends `to` (and `to` sends `from`, with `both`) is held, not
    /// lost (a TCP buffer, a retrying sender), and delivered in order when the
    /// fault heals, each after its link's delay from then.
    Queue { from: usize, to: usize, both: bool },
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
            Self::Crash { node, .. } | Self::Pause { node, .. } | Self::Jump { node, .. } => Some(node),
            _ => None,
        }
    }

    /// The fault on `leader` where it targets the leader, among `candidates`
    /// candidates (a link fault whose other end would be the leader itself takes the
    /// next candidate instead).
    pub(super) fn aimed_at(self, leader: usize, candidates: usize) -> Self {
        let pick = |n: usize| if n == LEADER { leader } else { n };
        // the other end of a link fault on the leader
        let other = |n: usize| if n == leader { (n + 1) % candidates.max(1) } else { n };
        let link = |x: usize, y: usize| match (x == LEADER, y == LEADER) {
            (true, _) => (leader, other(y)),
            (_, true) => (other(x), leader),
            _ => (x, y),
        };
        match self {
            Self::Crash { node, disk, permanent } => Self::Crash { node: pick(node), disk, permanent },
            Self::Pause { node, frozen } => Self::Pause { node: pick(node), frozen },
            Self::Isolate { node } => Self::Isolate { node: pick(node) },
            Self::Cut { from, to } => {
                let (from, to) = link(from, to);
                Self::Cut { from, to }
            }
            Self::Split { a, b } => {
                let (a, b) = link(a, b);
                Self::Split { a, b }
            }
            Self::Queue { from, to, both } => {
                let (from, to) = link(from, to);
                Self::Queue { from, to, both }
            }
            other => other,
        }
    }

    /// Whether it hits whichever candidate leads.
    pub(super) fn targets_leader(&self) -> bool {
        match *self {
            Self::Crash { node, .. } | Self::Pause { node, .. } | Self::Isolate { node } => node == LEADER,
            Self::Cut { from: a, to: b } | Self::Split { a, b } | Self::Queue { from: a, to: b, .. } => {
                a == LEADER || b == LEADER
            }
            _ => false,
        }
    }
}

/// A [`Kind::CrashAfterRound`] strikes at the latest this long after it starts.
pub(super) const STRIKE_WITHIN_MS: u64 = 4_000;

/// The first fault starts after this (the run has completed a round or so).
const FIRST_MS: u64 = 1_500;
/// The last fault starts before this.
const LAST_MS: u64 = 15_000;

/// What the nemesis may do in a run of one [`Mode`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Envelope {
    /// Candidates.
    pub(super) candidates: usize,
    /// Nodes: the candidates, then the workers.
    pub(super) nodes: usize,
    /// The longest pause, ms.
    max_pause_ms: u64,
    /// Whether a pause may stop the node's clock.
    frozen_pauses: bool,
    /// The longest clock jump, ms.
    max_jump_ms: u64,
    /// Whether faults may separate candidates from one another (the leader
    /// included) and crash nodes for good.
    majority: bool,
}

impl Envelope {
    /// The nemesis of a run of `mode` with `candidates` candidates among `nodes`.
    pub(super) fn of(mode: Mode, candidates: usize, nodes: usize, lease_ms: u64) -> Self {
        let majority = mode == Mode::Majority;
        Self {
            candidates,
            nodes,
            max_pause_ms: if majority { 8 * lease_ms } else { 3 * lease_ms },
            frozen_pauses: majority,
            max_jump_ms: if majority { 5 * lease_ms } else { lease_ms },
            majority,
        }
    }

    /// The rates nodes' clocks run at, per mille of real time.
    pub(super) fn drift(mode: Mode) -> std::ops::RangeInclusive<u64> {
        match mode {
            Mode::Majority => 900..=1_100,
            Mode::BestEffort => 980..=1_020,
        }
    }

    /// Candidates that may be lost for good over a run: a minority,
    /// ⌊(candidates − 1) / 2⌋ (none of two).
    pub(super) fn lost_candidates(&self) -> usize {
        if self.majority { (self.candidates.saturating_sub(1)) / 2 } else { 0 }
    }
}

/// The workers that must outlive the run: crashes for good stop there.
pub(super) const KEPT_WORKERS: usize = 2;

/// A seeded schedule within `env`.
pub(super) fn schedule(rng: &mut ChaCha8Rng, env: &Envelope) -> Vec<Fault> {
    let count = rng.gen_range(1..=6);
    let mut faults: Vec<Fault> = Vec::new();
    let mut tries = 0;
    while faults.len() < count && tries < 50 {
        tries += 1;
        let start = rng.gen_range(FIRST_MS..LAST_MS);
        let (kind, duration) = draw(rng, env);
        if !survivable(&kind, env) {
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

/// One fault of `env` and how long it lasts, ms.
fn draw(rng: &mut ChaCha8Rng, env: &Envelope) -> (Kind, u64) {
    let (nodes, candidates) = (env.nodes, env.candidates);
    let node = rng.gen_range(0..nodes);
    // links between workers carry nothing: a link fault has a candidate at one end
    let other = if node < candidates { (node + rng.gen_range(1..nodes)) % nodes } else { rng.gen_range(0..candidates) };
    // crashes, pauses and isolation hit the leader two times in five
    let target = if rng.gen_bool(0.4) { LEADER } else { node };
    // in a majority run, so do one link fault in three: the leader at one end, a
    // candidate (the other's, or the next) at the other
    let (near, far) = if env.majority && rng.gen_bool(1.0 / 3.0) {
        let far = if other < candidates { other } else { node % candidates };
        if rng.gen_bool(0.5) { (LEADER, far) } else { (far, LEADER) }
    } else {
        (node, other)
    };
    match rng.gen_range(0..100) {
        0..10 => {
            // a node lost for good (majority runs): any worker or candidate
            let permanent = env.majority && rng.gen_bool(0.25);
            let disk = rng.gen_bool(0.6);
            let duration = if permanent { 0 } else { rng.gen_range(300..5_000) };
            (Kind::Crash { node: target, disk, permanent }, duration)
        }
        10..17 => {
            let delay = rng.gen_range(0..=800);
            // it ends (the node restarts) at least 300 ms after it strikes
            (
                Kind::CrashAfterRound { disk: rng.gen_bool(0.5), delay },
                STRIKE_WITHIN_MS + delay + rng.gen_range(300..5_000),
            )
        }
        17..28 => {
            let frozen = env.frozen_pauses && rng.gen_bool(0.5);
            (Kind::Pause { node: target, frozen }, rng.gen_range(200..env.max_pause_ms))
        }
        28..36 => (Kind::Jump { node, ms: rng.gen_range(50..=env.max_jump_ms) }, 0),
        36..48 => (Kind::Cut { from: near, to: far }, rng.gen_range(300..6_000)),
        48..56 => (Kind::Split { a: near, b: far }, rng.gen_range(300..6_000)),
        56..64 => (Kind::Queue { from: near, to: far, both: rng.gen_bool(0.5) }, rng.gen_range(300..6_000)),
        64..72 => (Kind::Isolate { node: target }, rng.gen_range(300..6_000)),
        72..82 => {
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
    }
}

/// Whether the design can survive `kind`. A majority run survives any of them
/// (the world checks, when it strikes, that a majority of candidates and two
/// workers outlive the run); a best-effort one never separates candidates from
/// one another, except by isolating one candidate from every node (see the module
/// docs of `faults` for why).
fn survivable(kind: &Kind, env: &Envelope) -> bool {
    if env.majority {
        return true;
    }
    let candidate = |n: usize| n < env.candidates;
    match *kind {
        Kind::Cut { from: a, to: b } | Kind::Split { a, b } | Kind::Queue { from: a, to: b, .. } => {
            !(candidate(a) && candidate(b))
        }
        Kind::Partition { side } => {
            let inside = (0..env.candidates).filter(|c| side & 1 << c != 0).count();
            let alone = |side: u64| side.count_ones() == 1 && side.trailing_zeros() < env.candidates as u32;
            let all = (1u64 << env.nodes) - 1;
            inside == 0 || inside == env.candidates || alone(side) || alone(all & !side)
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
            Kind::Queue { from, to, both: true } => both(net, from, to, &|l: &mut Link| l.queue = true),
            Kind::Queue { from, to, both: false } => net.link_mut(from, to).queue = true,
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

/// "keeps" or "loses" its disk.
fn disk(keeps: bool) -> &'static str {
    if keeps { "keeps" } else { "loses" }
}

/// The fault in words, nodes named by `name`.
pub(super) fn describe(f: &Fault, nodes: usize, name: &dyn Fn(usize) -> String) -> String {
    match f.kind {
        Kind::Crash { node, disk: keeps, permanent: true } => {
            format!("crash {} for good ({} its disk)", name(node), disk(keeps))
        }
        Kind::Crash { node, disk: keeps, permanent: false } => {
            format!("crash {} ({} its disk)", name(node), disk(keeps))
        }
        Kind::CrashAfterRound { disk: keeps, delay } => {
            format!("crash the leader {delay} ms after its next round ({} its disk)", disk(keeps))
        }
        Kind::Pause { node, frozen: false } => format!("pause {} (its clock counts the pause)", name(node)),
        Kind::Pause { node, frozen: true } => format!("pause {} (its clock stops)", name(node)),
        Kind::Jump { node, ms } => format!("{}'s clock jumps {ms} ms ahead", name(node)),
        Kind::Cut { from, to } => format!("cut {} → {}", name(from), name(to)),
        Kind::Split { a, b } => format!("cut {} ↔ {}", name(a), name(b)),
        Kind::Queue { from, to, both } => {
            format!("hold {} {} {} (delivered when it heals)", name(from), if both { "↔" } else { "→" }, name(to))
        }
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

#[cfg(test)]
mod tests {
    use rand::SeedableRng;

    use super::*;

    fn schedules(mode: Mode, candidates: usize) -> Vec<Fault> {
        let env = Envelope::of(mode, candidates, candidates + 4, 1_000);
        (0..2_000).flat_map(|seed| schedule(&mut ChaCha8Rng::seed_from_u64(seed), &env)).collect()
    }

    #[test]
    fn a_minority_of_the_candidates_may_be_lost() {
        let lost = |mode, c| Envelope::of(mode, c, c + 4, 1_000).lost_candidates();
        assert_eq!([lost(Mode::Majority, 3), lost(Mode::Majority, 4), lost(Mode::Majority, 5)], [1, 1, 2]);
        assert_eq!(lost(Mode::BestEffort, 2), 0);
    }

    #[test]
    fn a_fault_on_the_leader_lands_on_it_and_a_candidate_beside_it() {
        assert_eq!(Kind::Cut { from: LEADER, to: 1 }.aimed_at(1, 3), Kind::Cut { from: 1, to: 2 });
        assert_eq!(Kind::Cut { from: 0, to: LEADER }.aimed_at(2, 3), Kind::Cut { from: 0, to: 2 });
        assert_eq!(Kind::Split { a: 2, b: LEADER }.aimed_at(2, 3), Kind::Split { a: 0, b: 2 });
        let queue = Kind::Queue { from: LEADER, to: 4, both: true }.aimed_at(0, 3);
        assert_eq!(queue, Kind::Queue { from: 0, to: 4, both: true });
        assert_eq!(Kind::Pause { node: LEADER, frozen: true }.aimed_at(1, 3), Kind::Pause { node: 1, frozen: true });
        assert!(Kind::Queue { from: 3, to: LEADER, both: false }.targets_leader());
        assert!(!Kind::Cut { from: 3, to: 1 }.targets_leader());
    }

    #[test]
    fn a_majority_run_draws_every_fault() {
        let faults = schedules(Mode::Majority, 3);
        let any = |f: &dyn Fn(&Kind) -> bool| faults.iter().any(|x| f(&x.kind));
        assert!(any(&|k| matches!(k, Kind::Pause { frozen: true, .. })));
        assert!(any(&|k| matches!(k, Kind::Crash { permanent: true, .. })));
        assert!(any(&|k| matches!(k, Kind::Queue { .. })));
        assert!(any(&|k| matches!(k, Kind::Cut { from, to } if *from < 3 && *to < 3)));
        assert!(any(&|k| k.targets_leader() && matches!(k, Kind::Split { .. })));
        assert!(faults.iter().any(|f| matches!(f.kind, Kind::Pause { .. }) && f.end - f.start > 3_000));
        assert!(any(&|k| matches!(k, Kind::Jump { ms, .. } if *ms > 1_000)));
    }

    #[test]
    fn a_best_effort_run_never_cuts_candidates_apart() {
        for f in schedules(Mode::BestEffort, 2) {
            match f.kind {
                Kind::Cut { from: a, to: b } | Kind::Split { a, b } | Kind::Queue { from: a, to: b, .. } => {
                    assert!(a >= 2 || b >= 2, "{f:?}");
                }
                Kind::Pause { frozen, .. } => assert!(!frozen && f.end - f.start < 3_000, "{f:?}"),
                Kind::Jump { ms, .. } => assert!(ms <= 1_000, "{f:?}"),
                Kind::Crash { permanent, .. } => assert!(!permanent, "{f:?}"),
                _ => {}
            }
            assert!(
                !f.kind.targets_leader()
                    || matches!(f.kind, Kind::Crash { .. } | Kind::Pause { .. } | Kind::Isolate { .. })
            );
        }
    }
}
