//! Outbound DiLoCo requests to one peer, a few at a time.
//!
//! A connection takes at most `MAX_RPC_STREAMS` request streams at once, inbound
//! and outbound together, and its receiver drops a stream past that unread. A
//! node sends at most [`PER_PEER`] requests to one peer at once (half, so two
//! peers asking each other stay within it); the rest wait their turn here, in the
//! order they were asked, rather than being dropped on the way in. A request
//! whose caller stopped waiting is never sent.

use std::collections::{HashMap, VecDeque};

use libp2p::PeerId;
use libp2p::request_response::OutboundRequestId;
use pcp_protocol::RunId;
use pcp_schema::SignedEnvelope;

use super::Reply;

/// Requests in flight to one peer.
pub(super) const PER_PEER: usize = 4;
/// Requests waiting their turn, to all peers.
pub(super) const MAX_QUEUED: usize = 4096;

/// The requests in flight (to whom, for which run, who waits for the answer), how
/// many to each peer, and those waiting.
#[derive(Default)]
pub(super) struct Outbox {
    pub(super) sent: HashMap<OutboundRequestId, (PeerId, RunId, Reply)>,
    in_flight: HashMap<PeerId, usize>,
    queued: HashMap<PeerId, VecDeque<(SignedEnvelope, Reply)>>,
    waiting: usize,
}

impl Outbox {
    /// Whether a request may go to `peer` now; if so it is counted in flight.
    pub(super) fn may_send(&mut self, peer: PeerId) -> bool {
        let n = self.in_flight.entry(peer).or_default();
        let may = *n < PER_PEER;
        *n += usize::from(may);
        may
    }

    /// A request to `peer` waits its turn ([`Self::may_send`] said no); `Err` gives
    /// its reply back when too many wait.
    pub(super) fn wait(&mut self, peer: PeerId, (envelope, reply): (SignedEnvelope, Reply)) -> Result<(), Reply> {
        if self.waiting >= MAX_QUEUED {
            return Err(reply);
        }
        self.waiting += 1;
        self.queued.entry(peer).or_default().push_back((envelope, reply));
        Ok(())
    }

    /// A request to `peer` ended: the next one waiting for it whose caller still
    /// waits, now in flight in its place.
    pub(super) fn done(&mut self, peer: PeerId) -> Option<(SignedEnvelope, Reply)> {
        if let Some(queue) = self.queued.get_mut(&peer) {
            while let Some((envelope, reply)) = queue.pop_front() {
                self.waiting -= 1;
                if !reply.is_closed() {
                    if queue.is_empty() {
                        self.queued.remove(&peer);
                    }
                    return Some((envelope, reply));
                }
            }
            self.queued.remove(&peer);
        }
        match self.in_flight.get_mut(&peer) {
            Some(n) if *n > 1 => *n -= 1,
            _ => {
                self.in_flight.remove(&peer);
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    type Answer = tokio::sync::oneshot::Receiver<Result<pcp_protocol::Verified, crate::error::RequestError>>;

    fn request(round: u64) -> (SignedEnvelope, Reply, Answer) {
        let identity = pcp_protocol::Identity::from_secret([3; 32]);
        let binding = pcp_protocol::Binding { run: pcp_protocol::RunId([1; 32]), round, nonce: round, unix_ms: 1 };
        let hb = pcp_schema::Heartbeat::new([1; 32], round, 1);
        let (tx, rx) = tokio::sync::oneshot::channel();
        (pcp_protocol::seal(&identity, binding, &hb), tx, rx)
    }

    #[test]
    fn a_peer_gets_a_few_requests_at_once_and_the_rest_in_order_skipping_the_abandoned() {
        let (a, b) = (PeerId::random(), PeerId::random());
        let mut outbox = Outbox::default();
        let mut waiting = Vec::new();
        for round in 0..PER_PEER as u64 {
            let (_, _, rx) = request(round);
            assert!(outbox.may_send(a), "request {round} goes at once");
            waiting.push(rx);
        }
        assert!(!outbox.may_send(a), "the fifth waits");
        let (e, r, _kept) = request(10);
        outbox.wait(a, (e, r)).expect("room to wait");
        let (e, r, abandoned) = request(11);
        outbox.wait(a, (e, r)).expect("room to wait");
        assert!(outbox.may_send(b), "another peer is not held up");
        drop(abandoned);
        let (next, _) = outbox.done(a).expect("the next in order");
        assert_eq!(next.header.round, 10);
        assert!(outbox.done(a).is_none(), "the abandoned one is skipped");
        for _ in 0..PER_PEER {
            assert!(outbox.done(a).is_none());
        }
        assert!(outbox.in_flight.is_empty() || outbox.in_flight.keys().all(|p| *p == b));
        assert_eq!(outbox.waiting, 0);
    }
}
