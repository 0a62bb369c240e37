//! What the network hands a coordinator: its requests and gossip, and contributions
//! apart.
//!
//! A shepherd spends tens of milliseconds on a contribution (decode, screen, add) and
//! seconds closing a round, while every worker heartbeats twice a second. One queue
//! for both filled with heartbeats during that work, and a contribution that had been
//! read in full was then dropped with them. Here contributions have a queue of their
//! own, which a full control queue never touches; each holds its share of the run's
//! budget of contributions in flight ([`pcp_bootstrap::Hold`]) until it is handled,
//! so the contributions read and waiting stay within that budget and further senders
//! wait their turn in flow control.
//!
//! Control messages go first, for at most [`CONTROL_SLICE`] after each contribution:
//! a heartbeat waits for at most the contribution being handled and a slice, and a
//! thousand workers' heartbeats (two thousand a second, about as many as the role
//! answers) do not starve the contributions, which strict priority did.
//!
//! The run's coordinator candidates (its manifest names them; the node's
//! [`pcp_bootstrap::Admission::candidates`]) carry the consensus in their requests
//! and gossip: leases, terms, votes and the leader's state. Those go to a queue of
//! their own, served before everything else, so heartbeats and hellos from any
//! number of keys, which fill and overflow the control queue, never drop a lease
//! nor make one wait behind them. A run's candidates are few and each has at most
//! two requests in flight to another, so [`CANDIDATE_QUEUE`] is ample and their
//! priority cannot starve the workers.

use std::sync::Arc;

use pcp_bootstrap::{Admission, Event};
use pcp_schema::MessageKind;
use tokio::sync::mpsc;

/// Control messages (heartbeats, hellos, gossip) a coordinator queues; beyond this they
/// are dropped and their streams reset.
pub(crate) const CONTROL_QUEUE: usize = 256;
/// Messages of the run's candidates a coordinator queues.
pub(crate) const CANDIDATE_QUEUE: usize = 64;
/// Contributions a coordinator queues: more than its budget of contributions in flight
/// lets it read of a model's full-size contributions (64).
pub(crate) const CONTRIBUTION_QUEUE: usize = 128;

/// How long control messages keep a waiting contribution from the role, at most.
pub(crate) const CONTROL_SLICE: std::time::Duration = std::time::Duration::from_millis(15);

/// Signers of heartbeats dropped unanswered that a coordinator still counts as heard,
/// at most this many between two reads (one per participant of the largest run).
pub(crate) const MAX_HEARD: usize = 16_384;

/// Signers whose verified heartbeats were dropped for want of room: alive, though
/// unanswered (see [`Inbox::take_heard`]).
type Heard = std::sync::Arc<std::sync::Mutex<std::collections::HashSet<pcp_protocol::PublicKey>>>;

/// The sending side, in the node's event pump.
#[derive(Debug, Clone)]
pub(crate) struct Outbox {
    control: mpsc::Sender<Event>,
    /// `None` for a role that is no candidate (a worker): its candidates' messages
    /// go to `control`. The admission says who the candidates are.
    candidates: Option<(mpsc::Sender<Event>, Arc<Admission>)>,
    /// `None` for a role that takes no contributions (a worker): they go to `control`.
    contributions: Option<mpsc::Sender<Event>>,
    heard: Heard,
}

/// The receiving side, in the role.
#[derive(Debug)]
pub(crate) struct Inbox {
    candidates: mpsc::Receiver<Event>,
    control: mpsc::Receiver<Event>,
    contributions: mpsc::Receiver<Event>,
    /// When control messages began to be served since the last contribution.
    slice: Option<tokio::time::Instant>,
    heard: Heard,
}

/// A coordinator's queues: its candidates' messages (those whose signer `admission`
/// names a candidate of their run), control and contributions.
pub(crate) fn coordinator(admission: Arc<Admission>) -> (Outbox, Inbox) {
    let (candidates, candidates_rx) = mpsc::channel(CANDIDATE_QUEUE);
    let (control, control_rx) = mpsc::channel(CONTROL_QUEUE);
    let (contributions, contributions_rx) = mpsc::channel(CONTRIBUTION_QUEUE);
    let heard = Heard::default();
    (
        Outbox {
            control,
            candidates: Some((candidates, admission)),
            contributions: Some(contributions),
            heard: heard.clone(),
        },
        Inbox { candidates: candidates_rx, control: control_rx, contributions: contributions_rx, slice: None, heard },
    )
}

/// One queue, for a role that takes no contributions.
pub(crate) fn single() -> (Outbox, mpsc::Receiver<Event>) {
    let (control, control_rx) = mpsc::channel(CONTROL_QUEUE);
    (Outbox { control, candidates: None, contributions: None, heard: Heard::default() }, control_rx)
}

impl Outbox {
    /// Queues `event` without waiting; gives it back when its queue is full (or the
    /// role is gone).
    pub(crate) fn try_send(&self, event: Event) -> Result<(), Box<Event>> {
        let from_candidate = |run, signer| {
            self.candidates.as_ref().filter(|(_, admission)| admission.is_candidate(run, signer)).map(|(q, _)| q)
        };
        let queue = match (&event, &self.contributions) {
            (Event::Request { message, .. }, Some(c)) if message.kind() == MessageKind::Contribution => c,
            (Event::Request { message, .. }, _) => {
                from_candidate(message.binding().run, message.signer()).unwrap_or(&self.control)
            }
            (Event::Gossip { run, message, .. }, _) => from_candidate(*run, message.signer()).unwrap_or(&self.control),
            _ => &self.control,
        };
        queue.try_send(event).map_err(|e| match e {
            mpsc::error::TrySendError::Full(e) | mpsc::error::TrySendError::Closed(e) => {
                // a coordinator too busy to answer a heartbeat still heard its signer
                if let (Event::Request { message, .. }, Some(_)) = (&e, &self.contributions)
                    && message.kind() == MessageKind::Heartbeat
                {
                    let mut heard = self.heard.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                    if heard.len() < MAX_HEARD {
                        heard.insert(message.signer());
                    }
                }
                Box::new(e)
            }
        })
    }
}

impl Inbox {
    /// The signers of heartbeats dropped unanswered since the last call: the role
    /// counts them as heard ([`pcp_protocol::diloco::Shepherd::heard`]), so that a
    /// worker whose heartbeats found the role busy for longer than its timeout is
    /// not taken for gone.
    pub(crate) fn take_heard(&self) -> Vec<pcp_protocol::PublicKey> {
        let mut heard = self.heard.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        heard.drain().collect()
    }

    /// The next event: the candidates' first, then control, unless control messages
    /// have been served for [`CONTROL_SLICE`] while a contribution waited. `None`
    /// once every queue is closed and empty. Cancel-safe, as [`mpsc::Receiver::recv`]
    /// is.
    pub(crate) async fn recv(&mut self) -> Option<Event> {
        if let Ok(event) = self.candidates.try_recv() {
            return Some(event);
        }
        let now = tokio::time::Instant::now();
        let turn = self.slice.is_some_and(|since| now.duration_since(since) >= CONTROL_SLICE);
        if turn && let Ok(event) = self.contributions.try_recv() {
            self.slice = None;
            return Some(event);
        }
        let event = tokio::select! {
            biased;
            Some(event) = self.candidates.recv() => return Some(event),
            Some(event) = self.control.recv() => event,
            Some(event) = self.contributions.recv() => {
                self.slice = None;
                return Some(event);
            }
            else => return None,
        };
        self.slice.get_or_insert(now);
        Some(event)
    }
}

#[cfg(test)]
mod tests {
    use pcp_bootstrap::{InboundId, PeerId};
    use pcp_protocol::{Identity, RunId};

    use crate::diloco::wire::Signer;

    use super::*;

    fn connected(i: u8) -> Event {
        Event::PeerConnected { peer: PeerId::random(), addr: format!("/ip4/10.0.0.{i}/tcp/1").parse().expect("addr") }
    }

    /// A signed request of `kind`'s message, as the swarm hands it on.
    fn request<T: pcp_protocol::Signable>(n: u64, message: &T) -> Event {
        let mut signer = Signer::new(Identity::from_secret([n as u8; 32]));
        let envelope = signer.seal(RunId([1; 32]), 1, message);
        let verified = pcp_protocol::verify(envelope).expect("verifies");
        Event::Request {
            peer: PeerId::random(),
            id: InboundId::unanswerable(n),
            message: Box::new(verified),
            hold: None,
        }
    }

    fn contribution(n: u64) -> Event {
        let c = pcp_schema::Contribution {
            run: [1; 32],
            round: 1,
            inner_steps: 1,
            samples: 1,
            pseudo_gradient: pcp_schema::ParameterRef { name: String::new(), shard: 0, blob: [0; 32], size: 0 },
            loss: 0.0,
            delta: Vec::new(),
            bytes_down: 0,
            term: 1,
            params_hash: [0; 32],
            train_ms: 0,
            wall_ms: 0,
            sent_unix_ms: 0,
            slice_hashes: Vec::new(),
        };
        request(n, &c)
    }

    fn heartbeat() -> pcp_schema::Heartbeat {
        pcp_schema::Heartbeat { term: 1, follows: 1, ..pcp_schema::Heartbeat::new([1; 32], 1, 1) }
    }

    /// Who signed a request or a gossiped message.
    fn signer(event: &Event) -> Option<pcp_protocol::PublicKey> {
        match event {
            Event::Request { message, .. } | Event::Gossip { message, .. } => Some(message.signer()),
            _ => None,
        }
    }

    fn kind(event: &Event) -> Option<MessageKind> {
        match event {
            Event::Request { message, .. } => Some(message.kind()),
            _ => None,
        }
    }

    /// Heartbeats that fill the control queue take no contribution's room, and the role
    /// sees control first, then the contributions in their order.
    #[tokio::test]
    async fn a_full_control_queue_leaves_contributions_their_room() {
        let (outbox, mut inbox) = coordinator(Arc::default());
        for i in 0..CONTROL_QUEUE {
            outbox.try_send(connected(i as u8)).expect("room for control messages");
        }
        let ack = pcp_schema::Ack::accept([1; 32], 1);
        assert!(outbox.try_send(request(999, &ack)).is_err(), "the control queue is full");
        for n in 0..CONTRIBUTION_QUEUE as u64 {
            outbox.try_send(contribution(n)).expect("a contribution's room, whatever the control queue holds");
        }
        assert!(outbox.try_send(contribution(1000)).is_err(), "the contributions' queue is bounded too");
        let mut order = Vec::new();
        while let Ok(Some(event)) = tokio::time::timeout(std::time::Duration::from_millis(20), inbox.recv()).await {
            order.push(kind(&event));
        }
        assert_eq!(order.len(), CONTROL_QUEUE + CONTRIBUTION_QUEUE);
        assert!(order[..CONTROL_QUEUE].iter().all(Option::is_none), "control first");
        assert!(order[CONTROL_QUEUE..].iter().all(|k| *k == Some(MessageKind::Contribution)));
    }

    /// A queue of control messages that never empties (a thousand workers' heartbeats)
    /// still lets a contribution through once a slice has passed.
    #[tokio::test(start_paused = true)]
    async fn control_messages_do_not_starve_contributions() {
        let (outbox, mut inbox) = coordinator(Arc::default());
        for i in 0..CONTROL_QUEUE {
            outbox.try_send(connected(i as u8)).expect("room");
        }
        outbox.try_send(contribution(1)).expect("room");
        outbox.try_send(contribution(2)).expect("room");
        assert!(kind(&inbox.recv().await.expect("queued")).is_none(), "control first");
        assert!(kind(&inbox.recv().await.expect("queued")).is_none(), "within the slice: control");
        tokio::time::advance(CONTROL_SLICE).await;
        assert_eq!(kind(&inbox.recv().await.expect("queued")), Some(MessageKind::Contribution), "the slice is over");
        assert!(kind(&inbox.recv().await.expect("queued")).is_none(), "a new slice of control");
        tokio::time::advance(CONTROL_SLICE).await;
        assert_eq!(kind(&inbox.recv().await.expect("queued")), Some(MessageKind::Contribution));
    }

    /// With the control queue full of heartbeats, a candidate's request (its lease)
    /// and its gossip still find room, and the role sees them first; a candidate of
    /// another run has no such room.
    #[tokio::test]
    async fn a_candidate_is_heard_first_through_a_full_control_queue() {
        let admission = Arc::new(Admission::default());
        let candidate = Identity::from_secret([9; 32]).public();
        admission.candidates(RunId([1; 32]), &[candidate]);
        admission.candidates(RunId([2; 32]), &[Identity::from_secret([10; 32]).public()]);
        let (outbox, mut inbox) = coordinator(admission);
        for n in 0..CONTROL_QUEUE as u64 {
            outbox.try_send(request(100 + n % 100, &heartbeat())).expect("room for heartbeats");
        }
        assert!(outbox.try_send(request(7, &heartbeat())).is_err(), "the control queue is full");
        assert!(outbox.try_send(request(10, &heartbeat())).is_err(), "another run's candidate is no candidate here");
        outbox.try_send(request(9, &heartbeat())).expect("a candidate's lease has room");
        let Event::Request { message, .. } = request(9, &heartbeat()) else { panic!("a request") };
        let gossip = Event::Gossip { run: RunId([1; 32]), from: PeerId::random(), message };
        outbox.try_send(gossip).expect("and its gossip");
        let first = inbox.recv().await.expect("queued");
        assert!(matches!(first, Event::Request { .. }) && signer(&first) == Some(candidate), "the lease first");
        let second = inbox.recv().await.expect("queued");
        assert!(matches!(second, Event::Gossip { .. }) && signer(&second) == Some(candidate), "then its gossip");
        let third = inbox.recv().await.expect("queued");
        assert_ne!(signer(&third), Some(candidate), "then the heartbeats");
        assert_eq!(kind(&third), Some(MessageKind::Heartbeat));
    }

    /// A heartbeat dropped for want of room leaves its signer heard, once.
    #[test]
    fn a_dropped_heartbeat_is_still_heard() {
        let (outbox, inbox) = coordinator(Arc::default());
        for i in 0..CONTROL_QUEUE {
            outbox.try_send(connected(i as u8)).expect("room");
        }
        let Err(dropped) = outbox.try_send(request(7, &heartbeat())) else { panic!("the queue is full") };
        let Event::Request { message, .. } = *dropped else { panic!("the request comes back") };
        let ack = pcp_schema::Ack::accept([1; 32], 1);
        assert!(outbox.try_send(request(8, &ack)).is_err(), "dropped too, but not a heartbeat");
        assert_eq!(inbox.take_heard(), vec![message.signer()]);
        assert!(inbox.take_heard().is_empty(), "taken");
    }

    /// A worker's single queue takes everything, contributions included.
    #[tokio::test]
    async fn a_single_queue_takes_contributions_with_the_rest() {
        let (outbox, mut rx) = single();
        outbox.try_send(contribution(1)).expect("room");
        outbox.try_send(connected(1)).expect("room");
        assert_eq!(kind(&rx.recv().await.expect("queued")), Some(MessageKind::Contribution));
        assert!(kind(&rx.recv().await.expect("queued")).is_none());
    }
}
