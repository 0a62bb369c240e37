//! The node's host of [`failover::Candidate`], the sans-IO candidate the fault
//! simulator drives too: it carries the candidate's messages as signed
//! heartbeats over request-response, persists its term, vote and held state
//! before anything it sends, and hands the rest of what the candidate decides
//! (fetch a state, lead, commit, stop) to the role that hosts it (a standby in
//! [`super::candidate`], the leader in [`super::shepherd`]).
//!
//! Time is [`wire::mono_ms`], a clock that counts system suspend.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context as _;
use pcp_bootstrap::Node;
use pcp_protocol::election::Succession;
use pcp_protocol::failover::candidate::trace::{Start, Step};
use pcp_protocol::failover::candidate::{Action, Input, Message};
use pcp_protocol::failover::{self, HardState, Mode, Replica};
use pcp_protocol::{PublicKey, RunId, Verified};
use pcp_schema::{ConsensusKind, Heartbeat, Held, MessageKind};
use tokio::task::JoinSet;

use super::wire::{self, Signer, peer_name};
use crate::observe::events::{self as ev, Events};

/// The blobs of states it remembers (leases name them; a fetch needs them).
const BLOBS_KEPT: usize = 16;
/// The most a recording (`PCP_CONSENSUS_TRACE=1`) grows to; it stops there.
const TRACE_LIMIT: u64 = 256 << 20;

/// Requests in flight to one candidate at most: a candidate cut off does not pile
/// up streams (a connection takes 8 at once) that all land when the cut heals; the
/// candidate sends its leases and vote requests again anyway.
const IN_FLIGHT_PER_PEER: usize = 2;

/// What a candidate keeps on disk for a run: `(term, vote)` and the state it holds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
struct Record {
    term: u64,
    #[serde(default, with = "opt_hex")]
    voted_for: Option<[u8; 32]>,
    #[serde(default)]
    held: Option<HeldRecord>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
struct HeldRecord {
    term: u64,
    round: u64,
    #[serde(with = "hex32")]
    params: [u8; 32],
    #[serde(with = "hex32")]
    blob: [u8; 32],
}

mod hex32 {
    pub(super) fn serialize<S: serde::Serializer>(v: &[u8; 32], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&hex::encode(v))
    }

    pub(super) fn deserialize<'de, D: serde::Deserializer<'de>>(d: D) -> Result<[u8; 32], D::Error> {
        let s: String = serde::Deserialize::deserialize(d)?;
        let mut out = [0; 32];
        hex::decode_to_slice(&s, &mut out).map_err(serde::de::Error::custom)?;
        Ok(out)
    }
}

mod opt_hex {
    pub(super) fn serialize<S: serde::Serializer>(v: &Option<[u8; 32]>, s: S) -> Result<S::Ok, S::Error> {
        match v {
            Some(v) => s.serialize_some(&hex::encode(v)),
            None => s.serialize_none(),
        }
    }

    pub(super) fn deserialize<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<[u8; 32]>, D::Error> {
        let s: Option<String> = serde::Deserialize::deserialize(d)?;
        s.map(|s| {
            let mut out = [0; 32];
            hex::decode_to_slice(&s, &mut out).map_err(serde::de::Error::custom)?;
            Ok(out)
        })
        .transpose()
    }
}

/// The failover mode a manifest asks for: `0` the default for its candidate count,
/// `1` majority, `2` best effort.
pub(crate) fn mode_of(failover: u8, candidates: usize) -> Mode {
    match failover {
        1 => Mode::Majority,
        2 => Mode::BestEffort,
        _ => Mode::for_candidates(candidates),
    }
}

/// How a candidate of `succession` starts now: new, holding nothing (the callers
/// fill in what they kept).
fn start_of(identity: &pcp_protocol::Identity, succession: &Succession, lease_ms: u64, mode: Mode) -> Start {
    Start {
        me: identity.public(),
        order: succession.order().to_vec(),
        lease_ms,
        mode,
        hard: None,
        held: None,
        now_ms: wire::mono_ms(),
        created: None,
        lost_state: false,
        left_out: None,
    }
}

/// Where a candidate sits: its node and identity, where it records, and the
/// run's candidates, lease and mode.
#[derive(Debug)]
pub(crate) struct Seat<'a> {
    pub(crate) node: &'a Node,
    pub(crate) identity: &'a pcp_protocol::Identity,
    pub(crate) events: &'a Events,
    pub(crate) data_dir: &'a Path,
    pub(crate) run: RunId,
    pub(crate) succession: Succession,
    pub(crate) lease_ms: u64,
    pub(crate) mode: Mode,
}

/// A request in flight to another candidate, and its answer.
type Sent = (PublicKey, Option<Verified>);

/// A candidate's consensus: the protocol's candidate, its disk record and its
/// messages in flight.
#[derive(Debug)]
pub(crate) struct Consensus {
    core: failover::Candidate,
    run: RunId,
    node: Node,
    signer: Signer,
    events: Events,
    path: PathBuf,
    record: Record,
    /// The blob of each state it heard of, by (round, params).
    blobs: BTreeMap<(u64, [u8; 32]), [u8; 32]>,
    /// Requests in flight (bounded: [`IN_FLIGHT_PER_PEER`] to each candidate).
    pub(crate) sends: JoinSet<Sent>,
    in_flight: BTreeMap<PublicKey, usize>,
    /// How long a request waits for its answer: half a lease (a lease goes out
    /// every third of one).
    timeout: Duration,
    /// With `PCP_CONSENSUS_TRACE=1`: its run recorded, as JSON lines next to its
    /// record (the start, then every input with its actions), for
    /// [`pcp_protocol::failover::candidate::trace::replay`].
    trace: Option<TraceFile>,
}

/// A recording being written, and its size so far.
#[derive(Debug)]
struct TraceFile {
    out: std::io::BufWriter<std::fs::File>,
    bytes: u64,
}

impl TraceFile {
    /// Starts `<record>.trace.jsonl` with the start and what it did, when
    /// `PCP_CONSENSUS_TRACE=1`; a recording that cannot be written is skipped.
    fn begin(record: &Path, start: &Start, started: &[Action]) -> Option<Self> {
        if std::env::var_os("PCP_CONSENSUS_TRACE").is_none_or(|v| v != "1") {
            return None;
        }
        let path = record.with_extension("trace.jsonl");
        let opened = path.parent().map_or(Ok(()), std::fs::create_dir_all).and_then(|()| std::fs::File::create(&path));
        match opened {
            Ok(f) => {
                let mut t = Self { out: std::io::BufWriter::new(f), bytes: 0 };
                t.line(&serde_json::json!({ "start": start, "started": started }));
                Some(t)
            }
            Err(e) => {
                tracing::warn!("not recording the consensus in {}: {e}", path.display());
                None
            }
        }
    }

    fn line(&mut self, value: &impl serde::Serialize) {
        use std::io::Write as _;
        if self.bytes > TRACE_LIMIT {
            return;
        }
        let Ok(mut line) = serde_json::to_vec(value) else { return };
        line.push(b'\n');
        self.bytes += line.len() as u64;
        // flushed at once: a process killed with -9 keeps what it did
        let _ = self.out.write_all(&line).and_then(|()| self.out.flush());
    }
}

impl Consensus {
    /// The record's path for `run` under `data_dir`.
    fn path(data_dir: &Path, run: RunId) -> PathBuf {
        data_dir.join("consensus").join(format!("{}.json", run.to_hex()))
    }

    fn read(path: &Path) -> anyhow::Result<Option<Record>> {
        match std::fs::read(path) {
            Ok(bytes) => {
                anyhow::ensure!(bytes.len() <= 4096, "{}: a consensus record of {} bytes", path.display(), bytes.len());
                Ok(Some(
                    serde_json::from_slice(&bytes)
                        .with_context(|| format!("{}: not a consensus record", path.display()))?,
                ))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e).with_context(|| format!("reading {}", path.display())),
        }
    }

    /// A candidate of `run` (`succession` its candidates, `mode` its manifest's) with
    /// the record `data_dir` keeps of it, if any; `held` is the state it holds and
    /// its blob, when its host has it. A record whose held state the host no longer
    /// has makes it a new candidate: it may vote once it holds a leader's state.
    pub(crate) fn open(seat: Seat<'_>, held: Option<(Replica, [u8; 32])>) -> anyhow::Result<Self> {
        let Seat { node, identity, events, data_dir, run, succession, lease_ms, mode } = seat;
        let path = Self::path(data_dir, run);
        let record = Self::read(&path)?;
        let held = match (record.and_then(|r| r.held), held) {
            // what the record says it held, when the host still has that state
            (Some(r), Some((h, blob))) if r.round == h.round && r.params == h.params => {
                Some((Replica { term: r.term.max(h.term), ..h }, blob))
            }
            (Some(r), Some((h, blob))) if (r.term, r.round) < h.rank() => Some((h, blob)),
            (Some(_), _) => None,
            (None, held) => held,
        };
        let hard = record.map(|r| HardState { term: r.term, voted_for: r.voted_for.map(PublicKey) });
        // a record of a state this node no longer has: it may not vote until it holds
        // a leader's state again
        let lost = record.is_some_and(|r| r.held.is_some()) && held.is_none();
        let start = Start {
            hard,
            held: held.map(|(h, _)| h),
            lost_state: lost,
            ..start_of(identity, &succession, lease_ms, mode)
        };
        let (core, started) = start.candidate();
        if lost {
            tracing::warn!(
                "run {run}: the state this candidate held is gone; it votes again once it holds the leader's"
            );
        }
        let trace = TraceFile::begin(&path, &start, &started);
        let mut c = Self::with(core, node, identity, events, path, run, lease_ms);
        c.trace = trace;
        if let Some((h, blob)) = held {
            c.blobs.insert((h.round, h.params), blob);
        }
        c.record = Record { term: c.core.term(), voted_for: hard.and_then(|h| h.voted_for).map(|k| k.0), held: None };
        c.save(c.core.held())?;
        Ok(c)
    }

    /// The creator of a new run: term 1's leader, from the initial state in `blob`.
    pub(crate) fn create(seat: Seat<'_>, initial: (Replica, [u8; 32])) -> anyhow::Result<(Self, Vec<Action>)> {
        let Seat { node, identity, events, data_dir, run, succession, lease_ms, mode } = seat;
        let path = Self::path(data_dir, run);
        let start = Start { created: Some(initial.0), ..start_of(identity, &succession, lease_ms, mode) };
        let (core, actions) = start.candidate();
        let trace = TraceFile::begin(&path, &start, &actions);
        let mut c = Self::with(core, node, identity, events, path, run, lease_ms);
        c.trace = trace;
        c.blobs.insert((initial.0.round, initial.0.params), initial.1);
        let rest = c.process(actions)?;
        Ok((c, rest))
    }

    fn with(
        core: failover::Candidate,
        node: &Node,
        identity: &pcp_protocol::Identity,
        events: &Events,
        path: PathBuf,
        run: RunId,
        lease_ms: u64,
    ) -> Self {
        // the run's candidates' messages are kept apart and served first (see
        // `super::inbox`), and their nonces kept by the replay guard
        node.admission().candidates(run, core.succession().order());
        Self {
            core,
            run,
            node: node.clone(),
            signer: Signer::new(identity.clone()),
            events: events.clone(),
            path,
            record: Record::default(),
            blobs: BTreeMap::new(),
            sends: JoinSet::new(),
            in_flight: BTreeMap::new(),
            timeout: Duration::from_millis((lease_ms / 2).max(250)),
            trace: None,
        }
    }

    /// The protocol's candidate.
    pub(crate) fn core(&self) -> &failover::Candidate {
        &self.core
    }

    /// The term it follows or leads.
    pub(crate) fn term(&self) -> u64 {
        self.core.term()
    }

    /// This candidate's key.
    pub(crate) fn me(&self) -> PublicKey {
        self.core.me()
    }

    /// The term a leader's state after `round` carries: the held state's when it is
    /// that round (a majority run took it into this term on election; a best-effort
    /// one keeps the term that produced it), else this leader's.
    pub(crate) fn state_term(&self, round: u64) -> u64 {
        self.core.held().filter(|h| h.round == round).map_or(self.core.term(), |h| h.term)
    }

    /// Whether the leader may act now (a majority answered its lease).
    pub(crate) fn may_act(&self) -> bool {
        self.core.may_act(wire::mono_ms())
    }

    /// The blob of state `state`, if it heard of it.
    pub(crate) fn blob_of(&self, state: &Replica) -> Option<[u8; 32]> {
        self.blobs.get(&(state.round, state.params)).copied()
    }

    /// Writes the record: the hard state and the held state with its blob.
    fn save(&mut self, held: Option<Replica>) -> anyhow::Result<()> {
        let hard = self.core.hard_state();
        self.record.term = hard.term;
        self.record.voted_for = hard.voted_for.map(|k| k.0);
        self.record.held = held.and_then(|h| {
            let blob = self.blob_of(&h)?;
            Some(HeldRecord { term: h.term, round: h.round, params: h.params, blob })
        });
        if let Some(dir) = self.path.parent() {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        let tmp = self.path.with_extension("json.tmp");
        let bytes = serde_json::to_vec(&self.record)?;
        {
            use std::io::Write as _;
            let mut f = std::fs::File::create(&tmp).with_context(|| format!("writing {}", tmp.display()))?;
            f.write_all(&bytes).with_context(|| format!("writing {}", tmp.display()))?;
            f.sync_all().with_context(|| format!("syncing {}", tmp.display()))?;
        }
        std::fs::rename(&tmp, &self.path).with_context(|| format!("renaming {} into place", tmp.display()))?;
        Ok(())
    }

    /// Feeds `input`; persists and sends what it decides; returns the rest for the
    /// role to carry out.
    pub(crate) fn handle(&mut self, input: Input) -> anyhow::Result<Vec<Action>> {
        let actions = self.step(input);
        self.process(actions)
    }

    /// One input to the candidate, recorded when tracing.
    fn step(&mut self, input: Input) -> Vec<Action> {
        let now_ms = wire::mono_ms();
        let actions = self.core.handle(input, now_ms);
        if let Some(t) = &mut self.trace {
            t.line(&Step { now_ms, input, actions: actions.clone() });
        }
        actions
    }

    /// The leader completed a round: its state, in `blob`, goes to the candidates.
    pub(crate) fn holds(&mut self, state: Replica, blob: [u8; 32]) -> anyhow::Result<Vec<Action>> {
        self.remember(state, blob);
        self.handle(Input::Holds(state))
    }

    fn remember(&mut self, state: Replica, blob: [u8; 32]) {
        if blob == [0; 32] {
            return;
        }
        self.blobs.insert((state.round, state.params), blob);
        while self.blobs.len() > BLOBS_KEPT {
            let Some(oldest) = self.blobs.keys().next().copied() else { break };
            self.blobs.remove(&oldest);
        }
    }

    fn process(&mut self, actions: Vec<Action>) -> anyhow::Result<Vec<Action>> {
        let mut rest = Vec::new();
        let mut save = false;
        let mut held = self.core.held();
        // persist first: nothing it sends may run ahead of its disk
        for a in &actions {
            match a {
                Action::Persist(_) => save = true,
                Action::Held(h) => {
                    save = true;
                    held = Some(*h);
                }
                _ => {}
            }
        }
        if save {
            self.save(held)?;
        }
        for a in actions {
            match a {
                Action::Send { to, msg } => self.send(to, msg),
                Action::Persist(_) => {}
                other => {
                    self.record_event(&other);
                    rest.push(other);
                }
            }
        }
        Ok(rest)
    }

    fn record_event(&self, a: &Action) {
        match a {
            Action::LeaseExpired { term, leader } => {
                tracing::warn!("run {}: the lease of term {term} lapsed", self.run);
                self.events.emit(ev::Event::LeaseExpired(ev::LeaseExpired { term: *term, peer: peer_name(leader) }));
            }
            Action::Campaign { term, pre } => {
                tracing::info!(
                    "run {}: asking for {} for term {term}",
                    self.run,
                    if *pre { "pre-votes" } else { "votes" }
                );
                self.events.emit(ev::Event::Campaign(ev::Campaign { term: *term, pre: *pre }));
            }
            Action::Deferred { term } => {
                let round = self.core.held().map(|r| r.round);
                tracing::warn!(
                    "run {}: deferring term {term} (holding round {round:?}: no leader's state yet, or it just stepped aside)",
                    self.run
                );
                self.events.emit(ev::Event::Deferred(ev::Deferred {
                    term: *term,
                    to: String::new(),
                    their_round: 0,
                    round,
                }));
            }
            Action::Rejected { from, reason } => {
                wire::lease_rejected(&self.events, "consensus", from, self.core.term(), reason);
            }
            _ => {}
        }
    }

    /// The heartbeat that carries `msg`.
    fn heartbeat(&self, msg: Message) -> Heartbeat {
        let kind = |kind, sent_ms, granted, pre, blob| pcp_schema::Consensus { kind, sent_ms, granted, pre, blob };
        let held_of = |r: Option<Replica>| r.map(|r| Held { term: r.term, round: r.round, params: r.params });
        let (term, held, consensus) = match msg {
            Message::Lease { term, sent_ms, state } => {
                let blob = self.blob_of(&state).unwrap_or([0; 32]);
                (term, held_of(Some(state)), kind(ConsensusKind::Lease, sent_ms, false, false, blob))
            }
            Message::Answer { term, sent_ms, held } => {
                (term, held_of(held), kind(ConsensusKind::Answer, sent_ms, false, false, [0; 32]))
            }
            Message::VoteRequest { term, held, pre } => {
                (term, held_of(held), kind(ConsensusKind::VoteRequest, 0, false, pre, [0; 32]))
            }
            Message::Vote { term, granted, pre } => (term, None, kind(ConsensusKind::Vote, 0, granted, pre, [0; 32])),
        };
        let round = held.as_ref().map_or(0, |h| h.round);
        Heartbeat {
            term,
            follows: self.core.term(),
            held,
            consensus: Some(consensus),
            ..Heartbeat::new(self.run.0, round, wire::unix_ms())
        }
    }

    /// The candidate message a heartbeat carries, if it carries one.
    fn message(&mut self, hb: &Heartbeat) -> Option<Message> {
        let c = hb.consensus?;
        let held = hb.held.map(|h| Replica { term: h.term, round: h.round, params: h.params });
        Some(match c.kind {
            ConsensusKind::Lease => {
                let state = held?;
                self.remember(state, c.blob);
                Message::Lease { term: hb.term, sent_ms: c.sent_ms, state }
            }
            ConsensusKind::Answer => Message::Answer { term: hb.term, sent_ms: c.sent_ms, held },
            ConsensusKind::VoteRequest => Message::VoteRequest { term: hb.term, held, pre: c.pre },
            ConsensusKind::Vote => Message::Vote { term: hb.term, granted: c.granted, pre: c.pre },
        })
    }

    fn send(&mut self, to: PublicKey, msg: Message) {
        let Some(peer) = pcp_bootstrap::peer_of(&to) else { return };
        let in_flight = self.in_flight.entry(to).or_default();
        if *in_flight >= IN_FLIGHT_PER_PEER {
            return; // a candidate that answers nothing: its requests time out first
        }
        *in_flight += 1;
        let hb = self.heartbeat(msg);
        let envelope = self.signer.seal(self.run, hb.round, &hb);
        let (node, timeout) = (self.node.clone(), self.timeout);
        self.sends.spawn(async move {
            let answer = tokio::time::timeout(timeout, node.request(peer, envelope)).await;
            (to, answer.ok().and_then(Result::ok))
        });
    }

    /// A request from candidate `from` carrying a consensus heartbeat: the answer
    /// to send back (the candidate's message to `from`, if it has one), and the
    /// rest of what it decided. `None` for a heartbeat that carries no message.
    pub(crate) fn on_request(
        &mut self,
        from: PublicKey,
        hb: &Heartbeat,
    ) -> anyhow::Result<Option<(Option<Heartbeat>, Vec<Action>)>> {
        if hb.run != self.run.0 {
            return Ok(None);
        }
        let Some(msg) = self.message(hb) else { return Ok(None) };
        let actions = self.step(Input::Message { from, msg });
        // the first message back to `from` is the answer; the rest go as requests
        let mut reply = None;
        let mut others = Vec::new();
        for a in actions {
            match a {
                Action::Send { to, msg } if to == from && reply.is_none() => reply = Some(self.heartbeat(msg)),
                a => others.push(a),
            }
        }
        let rest = self.process(others)?;
        Ok(Some((reply, rest)))
    }

    /// The answer to one of its requests (`None`: it timed out or was refused).
    pub(crate) fn on_answer(&mut self, (from, answer): Sent) -> anyhow::Result<Vec<Action>> {
        if let Some(n) = self.in_flight.get_mut(&from) {
            *n = n.saturating_sub(1);
        }
        let Some(answer) = answer else { return Ok(Vec::new()) };
        if answer.signer() != from || answer.kind() != MessageKind::Heartbeat {
            return Ok(Vec::new()); // an ack: it had nothing to say back
        }
        let Ok(hb) = answer.decode::<Heartbeat>() else { return Ok(Vec::new()) };
        if hb.run != self.run.0 {
            return Ok(Vec::new());
        }
        let Some(msg) = self.message(&hb) else { return Ok(Vec::new()) };
        self.handle(Input::Message { from, msg })
    }

    /// The leader's lease as a heartbeat, for the keeper to send while the loop is
    /// busy: followers hear the leader is alive (their answers are not read).
    pub(crate) fn lease_heartbeat(&self) -> Option<Heartbeat> {
        let state = self.core.held().filter(|_| self.core.is_leader())?;
        Some(self.heartbeat(Message::Lease { term: self.core.term(), sent_ms: wire::mono_ms(), state }))
    }
}
