//! The simulated network: a directed link from every node to every other, each
//! with its own delay, jitter, loss and duplication, which the nemesis cuts and
//! degrades. Reordering comes from jitter: every copy of a message draws its own
//! delay, so two messages on one link overtake each other when the jitter exceeds
//! the gap between them. A link may also hold what is sent on it (a queued cut):
//! the world keeps those messages and hands them back to the link when it heals.

use rand::Rng;
use rand_chacha::ChaCha8Rng;

/// One direction of one link.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Link {
    /// Nothing gets through.
    pub(super) cut: bool,
    /// What is sent is held until the link no longer holds it (the world keeps it
    /// and delivers it then); a cut wins.
    pub(super) queue: bool,
    /// Messages lost, per mille.
    pub(super) loss: u32,
    /// Messages delivered twice, per mille.
    pub(super) dup: u32,
    /// The shortest delay, ms.
    pub(super) delay: u64,
    /// Each copy waits up to this much longer, ms.
    pub(super) jitter: u64,
}

impl Link {
    /// A healthy link: a few milliseconds, a little jitter, nothing lost.
    pub(super) const HEALTHY: Self = Self { cut: false, queue: false, loss: 0, dup: 0, delay: 2, jitter: 18 };
}

/// Every link of `n` nodes.
#[derive(Clone, Debug)]
pub(super) struct Net {
    n: usize,
    links: Vec<Link>,
}

impl Net {
    /// `n` nodes, every link healthy.
    pub(super) fn new(n: usize) -> Self {
        Self { n, links: vec![Link::HEALTHY; n * n] }
    }

    /// The link `from → to`.
    pub(super) fn link_mut(&mut self, from: usize, to: usize) -> &mut Link {
        &mut self.links[from * self.n + to]
    }

    /// Every link healthy again.
    pub(super) fn heal(&mut self) {
        self.links.fill(Link::HEALTHY);
    }

    /// Whether nothing sent on `from → to` now arrives (it is cut or held).
    pub(super) fn blocked(&self, from: usize, to: usize) -> bool {
        let link = self.links[from * self.n + to];
        link.cut || link.queue
    }

    /// Whether what is sent on `from → to` now is held, not delivered or lost.
    pub(super) fn holds(&self, from: usize, to: usize) -> bool {
        let link = self.links[from * self.n + to];
        link.queue && !link.cut
    }

    /// The delays after which the copies of a message sent now on `from → to`
    /// arrive: none when it is lost or the link is cut, two when it is duplicated.
    pub(super) fn deliveries(&self, from: usize, to: usize, rng: &mut ChaCha8Rng) -> [Option<u64>; 2] {
        let link = self.links[from * self.n + to];
        if link.cut || (link.loss > 0 && rng.gen_range(0..1000) < link.loss) {
            return [None, None];
        }
        let delay =
            |rng: &mut ChaCha8Rng| link.delay + if link.jitter > 0 { rng.gen_range(0..=link.jitter) } else { 0 };
        let first = delay(rng);
        let second = (link.dup > 0 && rng.gen_range(0..1000) < link.dup).then(|| delay(rng));
        [Some(first), second]
    }
}
