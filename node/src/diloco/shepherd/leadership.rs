//! The shepherd's leadership: the protocol's candidate (terms, commits), the
//! check-quorum over its workers, the keeper that sends leases while the loop is
//! busy, the replicated state, and a round held back until the candidates hold it;
//! and what the host does with them: publishing the state, carrying out the
//! consensus's decisions, stepping aside, releasing a committed round, the lease.

use std::sync::Arc;
use std::time::{Duration, Instant};

use pcp_bootstrap::{Node, PeerId};
use pcp_protocol::election::Succession;
use pcp_protocol::failover::candidate::{self as consensus_core, Stop};
use pcp_protocol::failover::{CHECK_QUORUM_LEASES, Quorum, Replica};
use pcp_protocol::{BlobHash, PublicKey, RunId};
use pcp_schema::{Heartbeat, Held, ParameterRef, RoundAnnouncement, SignedEnvelope};
use tokio::task::JoinSet;

use super::Host;
use crate::diloco::consensus::Consensus;
use crate::diloco::wire::{self, LeaderState, Signer, peer_name};
use crate::observe::events as ev;

/// A round's announcement held back from workers (see [`Host::release`]).
#[derive(Debug)]
pub(super) struct Opened {
    pub(super) round: u64,
    /// The (round, parameters) of the state it names: what a majority of the
    /// candidates must hold first.
    pub(super) state: Option<(u64, [u8; 32])>,
    pub(super) envelope: SignedEnvelope,
    /// The `round_started` event, emitted on release.
    pub(super) event: ev::RoundStarted,
    pub(super) at: Instant,
    /// The announcement itself: sealed again on release with a deadline moved by
    /// the time it waited.
    pub(super) held_back: RoundAnnouncement,
}

/// The longest stretch the keeper covers for a busy loop: a loop stuck longer is
/// as good as dead, and its lease lapses.
const KEEPER_LIMIT_MS: u64 = 600_000;

/// Sends the leader's lease to the other candidates whenever its loop has not
/// come round for a third of a lease (validating, writing a checkpoint, screening a
/// contribution, or an elected candidate loading what it leads with), so that a
/// busy leader does not look like a dead one. Its answers are read by the loop's
/// own probes once it is back.
#[derive(Debug)]
pub(in crate::diloco) struct LeaseKeeper {
    /// (the lease, when the loop last came round).
    busy: Arc<std::sync::Mutex<Option<(Heartbeat, u64)>>>,
    task: tokio::task::JoinHandle<()>,
}

impl LeaseKeeper {
    pub(in crate::diloco) fn spawn(
        node: Node,
        mut signer: Signer,
        run: RunId,
        succession: &Succession,
        lease_ms: u64,
    ) -> Self {
        let busy: Arc<std::sync::Mutex<Option<(Heartbeat, u64)>>> = Arc::default();
        let me = signer.identity().public();
        let others: Vec<PeerId> =
            succession.order().iter().filter(|k| **k != me).filter_map(pcp_bootstrap::peer_of).collect();
        let watched = busy.clone();
        let task = tokio::spawn(async move {
            let period = Duration::from_millis((lease_ms / 3).max(100));
            let mut tick = tokio::time::interval(period);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut sends = JoinSet::new();
            loop {
                tick.tick().await;
                while sends.try_join_next().is_some() {}
                let Some((hb, since)) = watched.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
                else {
                    continue;
                };
                let stuck = wire::mono_ms().saturating_sub(since);
                if stuck < period.as_millis() as u64 || stuck > KEEPER_LIMIT_MS || sends.len() >= 4 * others.len() {
                    continue; // the loop sends its own leases, or it is as good as dead
                }
                for peer in &others {
                    let hb = Heartbeat { unix_ms: wire::unix_ms(), ..hb.clone() };
                    let envelope = signer.seal(run, hb.round, &hb);
                    let (node, peer) = (node.clone(), *peer);
                    sends.spawn(async move {
                        let _ = tokio::time::timeout(period * 3, node.request(peer, envelope)).await;
                    });
                }
            }
        });
        Self { busy, task }
    }

    pub(super) fn set(&self, value: Option<(Heartbeat, u64)>) {
        *self.busy.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = value;
    }

    /// The loop came round, leading with `lease` (none: it does not lead): it may be
    /// busy from now.
    pub(in crate::diloco) fn alive(&self, lease: Option<Heartbeat>) {
        self.set(lease.map(|hb| (hb, wire::mono_ms())));
    }
}

impl Drop for LeaseKeeper {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Who leads the run and what a successor would need.
#[derive(Debug)]
pub(super) struct Leadership {
    /// Who leads the run, in which term, and what is committed: the protocol's
    /// candidate, which the fault simulator drives too.
    pub(super) consensus: Box<Consensus>,
    /// A round opened but not yet released to workers: it waits until every live
    /// candidate holds the state it names (the commit rule) and this leader's lease
    /// is current. Candidates see it at once, to replicate that state.
    pub(super) opened: Option<Opened>,
    /// Check-quorum over the last round's contributors.
    pub(super) quorum: Quorum,
    /// Sends leases while the loop is busy (validation, checkpoints).
    pub(super) keeper: LeaseKeeper,
    /// The highest term a worker reported following, once recorded.
    pub(super) reported_term: u64,
    /// The state blob after the last completed round, for successors.
    pub(super) state: Option<ParameterRef>,
    /// Where that state stands in the run's history.
    pub(super) state_replica: Option<Replica>,
    /// Set when this shepherd saw a higher term (or stepped aside: its own).
    pub(super) stepped_down: Option<u64>,
    /// Whether it stepped aside for lost workers, rather than for a higher term.
    pub(super) aside: bool,
    /// What the consensus decided while the state was being published, for the loop.
    pub(super) pending_consensus: Vec<consensus_core::Action>,
    /// The term it started in (a resumed shepherd's, from its checkpoint).
    pub(super) resumed_term: u64,
}

impl Leadership {
    /// Leading from `consensus` in `term`, nothing replicated or held back yet.
    pub(super) fn new(
        consensus: Box<Consensus>,
        pending_consensus: Vec<consensus_core::Action>,
        (quorum, keeper): (Quorum, LeaseKeeper),
        term: u64,
    ) -> Self {
        Self {
            consensus,
            opened: None,
            quorum,
            keeper,
            reported_term: 0,
            state: None,
            state_replica: None,
            stepped_down: None,
            aside: false,
            pending_consensus,
            resumed_term: term,
        }
    }
}

impl Host {
    /// Publishes the state after the last completed round as a blob, named by the
    /// next announcement, so candidates can take over from it. A run without standby
    /// candidates has nobody to fetch it: it writes none (a resume starts from the
    /// last checkpoint), and its consensus of one holds the state by its parameters.
    pub(super) fn publish_state(
        &mut self,
        contributors: &[PublicKey],
        excluded: &[PublicKey],
        params_hash: BlobHash,
    ) -> anyhow::Result<()> {
        let term = self.lead.consensus.state_term(self.machine.completed());
        let hash = match self.candidates_fetch_state() {
            true => {
                let state = wire::StateParts::of(&self.machine, term);
                let (hash, size) = wire::put_state(&self.store, &state, contributors, excluded)?;
                super::resume::record(&self.plan.state_dir, self.machine.completed(), hash, term)?;
                self.lead.state = Some(ParameterRef { name: "state".into(), shard: 0, blob: hash.0, size });
                hash
            }
            // (a zero blob is remembered by no one)
            false => BlobHash([0; 32]),
        };
        let replica = Replica { term, round: self.machine.completed(), params: params_hash.0 };
        self.lead.state_replica = Some(replica);
        if self.lead.consensus.core().is_leader() {
            // the candidates fetch it: workers learn the round after it once a majority holds it
            let actions = self.lead.consensus.holds(replica, hash.0)?;
            self.lead.pending_consensus.extend(actions);
        }
        Ok(())
    }

    /// Whether the run names standby candidates besides this shepherd: they fetch
    /// each round's state blob.
    pub(super) fn candidates_fetch_state(&self) -> bool {
        self.lead.consensus.core().succession().order().len() > 1
    }

    /// This leader's state after its last completed round.
    pub(super) fn leader_state(&self, contributors: &[PublicKey], excluded: &[PublicKey]) -> LeaderState {
        LeaderState {
            term: self.lead.consensus.state_term(self.machine.completed()),
            snapshot: self.machine.snapshot(),
            contributors: contributors.to_vec(),
            excluded: excluded.to_vec(),
        }
    }

    /// Carries out what the consensus decided (and what it decided meanwhile, while
    /// the state was published): a commit releases the open round, a stop ends
    /// leading, another candidate's election (a resumed shepherd that did not win)
    /// makes this one a standby.
    pub(super) async fn on_consensus(&mut self, mut actions: Vec<consensus_core::Action>) -> anyhow::Result<()> {
        actions.splice(0..0, std::mem::take(&mut self.lead.pending_consensus));
        let me = self.lead.consensus.me();
        for action in actions {
            match action {
                consensus_core::Action::Commit(_) => self.release().await,
                consensus_core::Action::Stopped { term, why: Stop::Newer(newer) } => {
                    let leader = self.lead.consensus.core().succession().leader(newer);
                    tracing::warn!("run {}: term {newer} is led by {}; stepping down", self.run, peer_name(&leader));
                    self.events.emit(ev::Event::SteppedDown(ev::SteppedDown {
                        term,
                        peer: peer_name(&me),
                        newer,
                        leader: peer_name(&leader),
                        reason: None,
                    }));
                    self.table_line(&format!(
                        "term {term}: {} stepped down; term {newer} is led by {}",
                        peer_name(&me),
                        peer_name(&leader)
                    ))?;
                    self.lead.stepped_down = Some(newer);
                    self.lead.aside = false;
                }
                consensus_core::Action::Stopped { term, why: Stop::Aside } => {
                    self.lead.stepped_down = Some(term);
                    self.lead.aside = true;
                }
                consensus_core::Action::Stopped { term, why: Stop::Behind } => {
                    self.stood_aside(term, "another candidate holds a newer state (they led apart)")?;
                }
                consensus_core::Action::Elected { term, leader }
                    if leader != me && self.lead.stepped_down.is_none() =>
                {
                    // resumed while another candidate leads: this one stands by with its state
                    let resumed = self.lead.resumed_term;
                    tracing::warn!("run {}: term {term} is led by {}; standing by", self.run, peer_name(&leader));
                    self.events.emit(ev::Event::SteppedDown(ev::SteppedDown {
                        term: resumed,
                        peer: peer_name(&me),
                        newer: term,
                        leader: peer_name(&leader),
                        reason: Some(format!("resumed after term {resumed}; term {term} is led by another")),
                    }));
                    self.table_line(&format!(
                        "term {resumed}: {} stepped down; term {term} is led by {}",
                        peer_name(&me),
                        peer_name(&leader)
                    ))?;
                    self.lead.stepped_down = Some(term);
                    self.lead.aside = false;
                }
                consensus_core::Action::Lead { term, .. } => {
                    tracing::info!("run {}: leading term {term}", self.run);
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// Check-quorum: a leader that heard from no majority of its last round's
    /// contributors for [`CHECK_QUORUM_LEASES`] leases steps aside, so that a
    /// candidate the workers can reach takes over. Only with another candidate to
    /// take over.
    pub(super) fn check_quorum(&mut self) -> anyhow::Result<()> {
        let now = wire::mono_ms();
        if self.lead.stepped_down.is_some()
            || self.lead.consensus.core().succession().order().len() < 2
            || self.machine.is_finished()
            || !self.lead.quorum.check(now)
        {
            return Ok(());
        }
        let (heard, of) = self.lead.quorum.heard_of(now);
        let reason = format!(
            "lost quorum: heard from {heard} of the {of} workers of round {} within {CHECK_QUORUM_LEASES} leases",
            self.machine.completed()
        );
        self.step_aside(reason)
    }

    pub(super) fn step_aside(&mut self, reason: String) -> anyhow::Result<()> {
        let term = self.lead.consensus.term();
        let actions = self.lead.consensus.handle(consensus_core::Input::StepAside)?;
        self.lead.pending_consensus.extend(actions);
        self.stood_aside(term, &reason)
    }

    /// This leader gave up `term` for `reason` (no higher term): the event, the
    /// table's line, and the standby it becomes.
    pub(super) fn stood_aside(&mut self, term: u64, reason: &str) -> anyhow::Result<()> {
        let me = self.signer.identity().public();
        tracing::warn!("run {}: {reason}; stepping aside", self.run);
        self.events.emit(ev::Event::SteppedDown(ev::SteppedDown {
            term,
            peer: peer_name(&me),
            newer: term,
            leader: String::new(),
            reason: Some(reason.to_string()),
        }));
        self.table_line(&format!("term {term}: {} stepped aside: {reason}", peer_name(&me)))?;
        self.lead.stepped_down = Some(term);
        self.lead.aside = true;
        Ok(())
    }

    /// Releases the opened round's announcement to workers once a majority of the
    /// candidates holds the state it names (the consensus committed it) and this
    /// leader's lease is current.
    pub(super) async fn release(&mut self) {
        let Some(opened) = &self.lead.opened else { return };
        if !self.lead.consensus.may_act() {
            return;
        }
        let committed = self.lead.consensus.core().committed();
        let held = match opened.state {
            Some((round, params)) => committed.is_some_and(|c| c.round == round && c.params == params),
            None => committed.is_some(),
        };
        if !held {
            return;
        }
        let Some(opened) = self.lead.opened.take() else { return };
        let waited_ms = opened.at.elapsed().as_millis() as u64;
        let mut envelope = opened.envelope;
        let mut event = opened.event;
        if waited_ms > 0 {
            // the workers get the time the round waited: its deadline moves with it
            if let Some(deadline_ms) = self.machine.postpone(waited_ms) {
                let announcement = RoundAnnouncement { deadline_unix_ms: deadline_ms, ..opened.held_back };
                envelope = self.signer.seal(self.run, opened.round, &announcement);
                event.deadline_unix_ms = deadline_ms;
            }
        }
        self.set_published(Some(envelope.clone()));
        // the close, from the input that decided it to here, leads the next deadlines
        self.machine.announced(self.now_ms());
        use pcp_schema::Message as _;
        if let Err(e) = self.node.publish(self.run, envelope.encode()).await {
            tracing::debug!("gossiping round {}: {e}", opened.round);
        }
        event.waited_ms = waited_ms;
        self.events.emit(ev::Event::RoundStarted(event));
        if let Some(tx) = &self.hooks.opened {
            let _ = tx.try_send(opened.round);
        }
    }

    /// This leader's heartbeat to the run's topic (workers follow its term) and the
    /// round it names.
    pub(super) fn lease(&self) -> (u64, Heartbeat) {
        let round = self.machine.open_round().unwrap_or(self.machine.completed());
        let term = self.lead.consensus.term();
        (
            round,
            Heartbeat {
                term,
                follows: term,
                held: self.lead.state_replica.map(|r| Held { term: r.term, round: r.round, params: r.params }),
                // a round with no quorum at its deadline is extended: its workers hear it
                deadline_unix_ms: self.machine.deadline_ms().unwrap_or(0),
                ..Heartbeat::new(self.run.0, round, wire::unix_ms())
            },
        )
    }

    pub(super) async fn gossip_heartbeat(&mut self) {
        let (round, hb) = self.lease();
        let envelope = self.signer.seal(self.run, round, &hb);
        use pcp_schema::Message as _;
        if let Err(e) = self.node.publish(self.run, envelope.encode()).await {
            tracing::debug!("gossiping the heartbeat: {e}");
        }
    }
}
