//! The heartbeat task: it heartbeats to the leader it follows, reads each answer
//! (the current round announcement, or a small heartbeat when it holds that one
//! already), follows the run's election through announcements and gossiped
//! leases, and publishes what it learned on a watch channel.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use pcp_bootstrap::{Event, Node, PeerId};
use pcp_protocol::diloco::follower::{self, Announced, Leases, Opening};
use pcp_protocol::diloco::liveness;
use pcp_protocol::{PublicKey, RunId, Verified};
use pcp_schema::{Ack, Heartbeat, Message as _, MessageKind, RoundAnnouncement};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;

use super::Leader;
use super::disk::save_term;
use crate::diloco::wire::{self, Signer, peer_name};
use crate::observe::events::{self as ev, Events};

/// How often a worker heartbeats (and so polls for rounds) in a run of up to 2,000
/// workers; larger runs heartbeat slower ([`pcp_protocol::diloco::liveness`]).
pub(super) const HEARTBEAT: Duration = Duration::from_millis(liveness::HEARTBEAT_MS);

/// A heartbeat with no answer within this long counts as missed.
const HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(10);

/// What the heartbeat task learned last.
#[derive(Debug, Clone)]
pub(super) enum Latest {
    Nothing,
    Round(Box<RoundAnnouncement>),
    /// The shepherd refused us (another run now, say): discover again.
    Refused(String),
}

/// Which opening of a round `a` announces.
pub(super) fn opening(a: &RoundAnnouncement) -> Opening {
    Opening { term: a.term, round: a.round, opened_ms: a.deadline_unix_ms }
}

/// `a` as the follower sees it, for the worker `me`.
pub(super) fn announced(a: &RoundAnnouncement, me: &PublicKey) -> Announced {
    Announced { base: a.parameters.first().map(|p| p.blob), participant: a.participants.contains(&me.0), ..news(a) }
}

/// What `a` says of the run's progress, whoever reads it.
fn news(a: &RoundAnnouncement) -> Announced {
    Announced { opening: opening(a), base: None, participant: false, finished: a.finished }
}

/// Waits until an announcement makes a send for `current` moot (forever if the
/// heartbeat task stops): [`follower::moot`], or a refusal.
pub(super) async fn superseded(latest: &mut watch::Receiver<Latest>, current: Opening) {
    let moot = |l: &Latest| match l {
        Latest::Round(a) => follower::moot(current, &news(a)),
        Latest::Refused(_) => true,
        Latest::Nothing => false,
    };
    while !moot(&latest.borrow()) {
        if latest.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

/// Waits until an announcement newer than `current` arrives (forever if the
/// heartbeat task stops).
pub(super) async fn newer_arrives(latest: &mut watch::Receiver<Latest>, current: Opening) {
    while !newer_round(latest, current) {
        if latest.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

/// Whether an announcement newer than `current` ([`follower::newer`]), the run's
/// end or a refusal arrived.
pub(super) fn newer_round(latest: &watch::Receiver<Latest>, current: Opening) -> bool {
    match &*latest.borrow() {
        Latest::Round(a) => follower::newer(current, &news(a)),
        Latest::Refused(_) => true,
        Latest::Nothing => false,
    }
}

/// Aborts a task when dropped: the heartbeat task lives exactly as long as `train`.
#[derive(Debug)]
pub(super) struct AbortOnDrop(pub(super) tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Heartbeats to the leader; each answer is its current round announcement. It
/// follows the run's election: announcements and gossiped leases are checked
/// against the succession and the term, and when the leader's lease lapses the
/// heartbeats go to the candidate whose term comes next.
#[derive(Debug)]
pub(super) struct Heartbeats {
    pub(super) node: Node,
    pub(super) signer: Signer,
    pub(super) run: RunId,
    /// The run's election, as a follower.
    pub(super) leases: Leases,
    /// Where the highest term it followed is kept.
    pub(super) term_file: PathBuf,
    /// Whether a valid lease was heard yet: until then the heartbeats go to the
    /// candidate that answered the hello.
    pub(super) heard: bool,
    pub(super) leader: watch::Sender<Leader>,
    pub(super) latest: watch::Sender<Latest>,
    /// The leader's open round and its deadline now, from its leases: a round with
    /// no quorum at its deadline is extended ([`super::round`] takes it up again).
    pub(super) deadline: watch::Sender<(u64, u64)>,
    pub(super) round: watch::Receiver<u64>,
    pub(super) events: Events,
    pub(super) gossip: Arc<tokio::sync::Mutex<mpsc::Receiver<Event>>>,
    /// A volunteer's aggregator (`--aggregate`): the requests addressed to this node.
    pub(super) aggregator: Option<mpsc::Sender<Event>>,
    /// The training loop's screen requests, and their largest length (the
    /// leader's are read up to it: [`pcp_bootstrap::Admission::screen_for`]).
    pub(super) screens: (mpsc::Sender<Event>, usize),
    /// A hostile worker's forgeries (tests).
    pub(super) forge: bool,
    /// The hash of the announcement last put in `latest` (see `known` in the
    /// heartbeat's schema): the leader answers a heartbeat naming its current one
    /// with a small heartbeat of its own.
    pub(super) known: Option<[u8; 32]>,
    /// The last participants blob fetched (see [`super::participants`]).
    pub(super) participants: crate::diloco::participants::Cached,
    /// The run's lease (its manifest's): heartbeats are at most half of it apart.
    pub(super) lease_ms: u64,
}

type Asked = (PublicKey, PeerId, Result<Verified, String>);

impl Heartbeats {
    pub(super) async fn run(mut self) {
        let mut tick = tokio::time::interval(HEARTBEAT);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut missed = 0u32;
        let mut asking: JoinSet<Asked> = JoinSet::new();
        let gossip = self.gossip.clone();
        let mut gossip = gossip.lock().await;
        let mut beats = 0u64;
        // the run's size sets how often to heartbeat: every tick up to 2,000 workers
        let mut period = HEARTBEAT;
        let mut asked: Option<(std::time::Instant, PublicKey)> = None;
        loop {
            tokio::select! {
                _ = tick.tick() => {
                    beats += 1;
                    if self.expire() {
                        period = HEARTBEAT; // the next candidate, asked at once
                        asked = None;
                    }
                    let to = self.to_ask();
                    if asked.is_some_and(|(_, key)| key != to) {
                        // a new leader (or the next candidate) is asked at once, not
                        // after the request to the last one fails: a dial to a dead
                        // leader through a relay takes seconds, and until the new
                        // leader hears a heartbeat it lists this worker in no round
                        asking = JoinSet::new();
                        asked = None;
                    }
                    if asking.is_empty() && asked.is_none_or(|(at, _)| at.elapsed() + HEARTBEAT / 2 >= period) {
                        self.ask(&mut asking, to);
                        asked = Some((std::time::Instant::now(), to));
                    }
                    if self.forge && beats.is_multiple_of(4) {
                        self.forge().await;
                    }
                }
                Some(done) = asking.join_next() => {
                    let Ok((key, peer, answer)) = done else { continue };
                    match answer.and_then(|v| self.read(key, &v)) {
                        Ok(Some(latest)) => {
                            missed = 0;
                            let Some(latest) = self.with_participants(latest, peer).await else { continue };
                            period = self.pace(&latest).unwrap_or(period);
                            if self.latest.send(latest).is_err() {
                                return;
                            }
                        }
                        Ok(None) => missed = 0,
                        Err(reason) => {
                            missed += 1;
                            if missed == 1 || missed.is_multiple_of(20) {
                                tracing::warn!(shepherd = %peer, "heartbeat failed ({missed} in a row): {reason}");
                            }
                        }
                    }
                }
                event = gossip.recv() => match event {
                    Some(Event::Gossip { run, message, .. }) if run == self.run => {
                        let Some(latest) = self.on_gossip(&message) else { continue };
                        let leader = self.leader.borrow().0;
                        let Some(latest) = self.with_participants(latest, leader).await else { continue };
                        period = self.pace(&latest).unwrap_or(period);
                        if self.latest.send(latest).is_err() {
                            return;
                        }
                    }
                    Some(request @ Event::Request { .. }) => self.route(request),
                    Some(_) => {}
                    None => return,
                },
            }
        }
    }

    /// An announcement with its participants filled in from its blob, fetched from
    /// `from` (`None`: the blob could not be had; the next heartbeat asks again).
    async fn with_participants(&mut self, latest: Latest, from: PeerId) -> Option<Latest> {
        let Latest::Round(mut a) = latest else { return Some(latest) };
        match crate::diloco::participants::resolve(&self.node, &mut a, from, &mut self.participants).await {
            Ok(()) => Some(Latest::Round(a)),
            Err(e) => {
                tracing::warn!("run {}: {e:#}", self.run);
                self.known = None;
                None
            }
        }
    }

    /// Hands a request to the training loop (a screen request) or this node's
    /// aggregator; one they cannot take (none, or its queue is full) is left
    /// unanswered at once.
    fn route(&self, request: Event) {
        let Event::Request { id, message, .. } = &request else { return };
        let id = *id;
        let to = match message.kind() {
            MessageKind::ScreenRequest => Some(&self.screens.0),
            _ => self.aggregator.as_ref(),
        };
        let refused = match to {
            Some(tx) => tx.try_send(request).is_err(),
            None => true,
        };
        if refused {
            self.node.leave_unanswered(id);
        }
    }

    /// How often to heartbeat in the run `latest` announces (its participants).
    fn pace(&self, latest: &Latest) -> Option<Duration> {
        let Latest::Round(a) = latest else { return None };
        Some(Duration::from_millis(liveness::interval_ms(a.participants.len(), self.lease_ms)))
    }

    /// Reports a lapsed lease (returns whether one lapsed); the next heartbeat goes
    /// to the candidate awaited.
    fn expire(&mut self) -> bool {
        let lapsed = self.leases.tick(wire::mono_ms());
        let any = !lapsed.is_empty();
        for (term, leader) in lapsed {
            tracing::warn!("run {}: the lease of term {term} lapsed; asking the next candidate", self.run);
            self.events.emit(ev::Event::LeaseExpired(ev::LeaseExpired { term, peer: peer_name(&leader) }));
            self.heard = true; // from now on the election says whom to ask
        }
        any
    }

    /// Whom the next heartbeat goes to: the candidate the election awaits once a
    /// lease was heard, else the candidate that answered the hello.
    fn to_ask(&self) -> PublicKey {
        if self.heard { self.leases.awaited() } else { self.leader.borrow().1 }
    }

    fn ask(&mut self, asking: &mut JoinSet<Asked>, key: PublicKey) {
        let Some(peer) = pcp_bootstrap::peer_of(&key) else { return };
        let round = *self.round.borrow();
        let hb = Heartbeat {
            follows: self.leases.term(),
            known: self.known,
            ..Heartbeat::new(self.run.0, round, wire::unix_ms())
        };
        let envelope = self.signer.seal(self.run, round, &hb);
        let node = self.node.clone();
        asking.spawn(async move {
            let answer = match tokio::time::timeout(HEARTBEAT_TIMEOUT, node.request(peer, envelope)).await {
                Ok(Ok(v)) => Ok(v),
                Ok(Err(e)) => Err(e.to_string()),
                Err(_) => Err("no answer".to_owned()),
            };
            (key, peer, answer)
        });
    }

    /// Checks a lease of `term` signed by `from`; rejected ones are recorded.
    fn lease(&mut self, from: PublicKey, term: u64, what: &str) -> bool {
        let (valid, actions) = self.leases.lease(from, term, wire::mono_ms());
        for action in actions {
            match action {
                follower::Action::Rejected { from, term, reason } => {
                    tracing::warn!("run {}: refused a {what} from {}: {reason}", self.run, peer_name(&from));
                    wire::lease_rejected(&self.events, what, &from, term, &reason);
                }
                // kept before it acts on the term: a restart never follows a lower one
                follower::Action::SaveTerm(term) => {
                    if let Err(e) = save_term(&self.term_file, term) {
                        tracing::warn!("saving the followed term: {e:#}");
                    }
                }
                follower::Action::Follow { term, leader } => {
                    if let Some(peer) = pcp_bootstrap::peer_of(&leader) {
                        if *self.leader.borrow() != (peer, leader) {
                            self.events
                                .emit(ev::Event::LeaderFollowed(ev::LeaderFollowed { term, peer: peer.to_string() }));
                        }
                        let _ = self.leader.send((peer, leader));
                        self.node.admission().screen_for(self.run, leader, self.screens.1);
                    }
                }
                follower::Action::SaveChain(_) => {}
            }
        }
        if valid {
            self.heard = true;
        }
        valid
    }

    /// An answer to a heartbeat sent to `key`: the round to train (or none).
    fn read(&mut self, key: PublicKey, v: &Verified) -> Result<Option<Latest>, String> {
        if v.signer() != key {
            return Err("answer signed by someone else".to_owned());
        }
        match v.kind() {
            MessageKind::RoundAnnouncement => {
                let a: RoundAnnouncement = v.decode().map_err(|e| e.to_string())?;
                if a.run != self.run.0 {
                    return Ok(Some(Latest::Refused(format!("the shepherd now runs {}", RunId(a.run)))));
                }
                if !self.lease(key, a.term, "round announcement") {
                    return Ok(None);
                }
                self.known = Some(v.payload_hash());
                Ok(Some(Latest::Round(Box::new(a))))
            }
            // the announcement this worker holds is still current: a lease, no news
            MessageKind::Heartbeat => {
                let hb: Heartbeat = v.decode().map_err(|e| e.to_string())?;
                if hb.run != self.run.0 || hb.term == 0 {
                    return Err("answered a heartbeat with another run's or a term-less heartbeat".to_owned());
                }
                if hb.known.is_none() || hb.known != self.known {
                    self.known = None; // the next heartbeat asks for the announcement itself
                    return Ok(None);
                }
                if self.lease(key, hb.term, "heartbeat answer") {
                    self.deadline(&hb);
                }
                Ok(None)
            }
            MessageKind::Ack => {
                self.known = None;
                let ack: Ack = v.decode().map_err(|e| e.to_string())?;
                if ack.code == pcp_schema::AckCode::Standby {
                    return Ok(None); // the candidate awaited does not lead yet
                }
                Ok(Some(Latest::Refused(ack.reason)))
            }
            other => Err(format!("answered a heartbeat with {}", other.tag())),
        }
    }

    /// The open round's deadline a valid lease `hb` names, for the training loop.
    fn deadline(&self, hb: &Heartbeat) {
        if hb.deadline_unix_ms == 0 {
            return;
        }
        let now = (hb.round, hb.deadline_unix_ms);
        self.deadline.send_if_modified(|d| std::mem::replace(d, now) != now);
    }

    /// A gossiped announcement or leader heartbeat: a lease to check, and maybe a
    /// round to train sooner than the next heartbeat's answer brings it.
    fn on_gossip(&mut self, message: &Verified) -> Option<Latest> {
        match message.kind() {
            MessageKind::RoundAnnouncement => {
                let a: RoundAnnouncement = message.decode().ok()?;
                if a.run != self.run.0 || !self.lease(message.signer(), a.term, "round announcement") {
                    return None;
                }
                self.known = Some(message.payload_hash());
                Some(Latest::Round(Box::new(a)))
            }
            MessageKind::Heartbeat => {
                let hb: Heartbeat = message.decode().ok()?;
                if hb.run == self.run.0 && hb.term > 0 && self.lease(message.signer(), hb.term, "leader heartbeat") {
                    self.deadline(&hb);
                }
                None
            }
            _ => None,
        }
    }

    /// A hostile worker claims the next term on the run's topic.
    async fn forge(&mut self) {
        let forged = RoundAnnouncement {
            run: self.run.0,
            round: 1_000_000,
            parameters: Vec::new(),
            deadline_unix_ms: wire::unix_ms() + 60_000,
            participants: Vec::new(),
            participants_blob: None,
            finished: false,
            term: self.leases.term() + 1,
            state: None,
            update: None,
            budget_ms: 0,
            steps_end_unix_ms: 0,
            screen_commit: [0; 32],
            screen_reveal: [0; 32],
            aggregators: Vec::new(),
        };
        let envelope = self.signer.seal(self.run, forged.round, &forged);
        if let Err(e) = self.node.publish(self.run, envelope.encode()).await {
            tracing::debug!("gossiping a forgery: {e}");
        }
    }
}
