//! Coordinator candidates: a shepherd that may step down, and standbys that take
//! over when the leader's lease lapses.
//!
//! A candidate alternates between two phases. **Leading**, it is a shepherd
//! ([`super::shepherd`]) whose announcements carry its term and name the state blob
//! of the last completed round. **Standby**, it heartbeats the leader it awaits
//! (the run's [`Election`] says which), fetches each round's state blob as the
//! announcement naming it arrives, and checks that its parameters are the ones
//! announced. When the lease lapses and the next term is its own, it leads from
//! the last state it replicated: the open round is reopened (workers train it
//! again from the same parameters), so no completed round is lost or applied
//! twice. A standby does not train: its compute is free to take over at once.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use pcp_bootstrap::{Event, InboundId, Node, PeerId};
use pcp_protocol::election::{self, Election, Succession};
use pcp_protocol::failover::{self, Replica};
use pcp_protocol::{BlobHash, PublicKey, RunId, Verified};
use pcp_schema::{Ack, Heartbeat, Held, MessageKind, RoundAnnouncement, RunManifest};
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::RoleIo;
use super::retention::Retention;
use super::shepherd::{Host, LeaseKeeper, Outcome, Prepared, ShepherdHooks, ShepherdPlan};
use super::wire::{self, LeaderState, Signer, peer_name};
use crate::commands::train::{Corpus, step_config};
use crate::observe::events::{self as ev, Events};
use crate::training::config::Experiment;
use crate::training::engine::Engine;
use crate::training::model::Model;

/// How often a standby heartbeats the leader it awaits.
const HEARTBEAT: Duration = Duration::from_millis(500);
/// Blob fetches from the leader give up after this long.
const FETCH_TIMEOUT: Duration = Duration::from_secs(120);
/// How often a standby without a manifest asks the DHT for the run's leader.
const DISCOVERY_RETRY: Duration = Duration::from_secs(2);

/// How a candidate starts.
#[derive(Debug)]
pub(crate) enum Begin {
    /// As the leader: `pcp-node --shepherd` (a new run, or `--resume`).
    Lead(Box<ShepherdPlan>),
    /// As a standby of `run` (`pcp-node --candidate --run RUN_ID`), or of the first
    /// run the DHT knows (`sim`), keeping the blobs of its recent rounds.
    Standby(Option<RunId>, Retention),
}

/// Runs a candidate until the run is over or `cancel` fires.
pub(crate) async fn run(
    begin: Begin,
    io: RoleIo,
    mut requests: mpsc::Receiver<Event>,
    hooks: ShepherdHooks,
    cancel: CancellationToken,
) -> anyhow::Result<()> {
    let RoleIo { node, identity, data_dir, events } = io;
    let mut signer = Signer::new(identity.clone());
    // a leader's plan carries its blobs' retention; a standby holds it, and hands it on
    let (mut plan, mut follow, mut retention) = match begin {
        Begin::Lead(plan) => (Some(*plan), None, Retention::default()),
        Begin::Standby(run, retention) => (None, Some(Follow::Discover(run)), retention),
    };
    let mut keeper_until_led: Option<LeaseKeeper> = None;
    loop {
        if let Some(plan) = plan.take() {
            let mut host =
                Host::start(plan, node.clone(), identity.clone(), &data_dir, events.clone(), hooks.clone()).await?;
            drop(keeper_until_led.take()); // the host's own leases from here
            let outcome = host.main_loop(&mut requests, &cancel).await?;
            retention = host.take_retention();
            match outcome {
                Outcome::Done => return Ok(()),
                Outcome::SteppedDown { manifest, term, aside } => follow = Some(Follow::Known(manifest, term, aside)),
            }
        }
        let Some(how) = follow.take() else { return Ok(()) };
        let mut standby =
            match Standby::start(how, &node, &mut signer, &data_dir, &events, &mut requests, &cancel).await? {
                Some(s) => s,
                None => return Ok(()),
            };
        standby.hooks = hooks.clone();
        standby.keep(std::mem::take(&mut retention));
        if let Some(tx) = &standby.hooks.replicated {
            let _ = tx.try_send(None);
        }
        match standby.run(&mut signer, &mut requests, &cancel).await? {
            Standing::Elected(term) => {
                // leases go out at once, while the successor loads what it leads with:
                // the next candidate must not take the term after this one meanwhile
                let round = standby.machine.held().map_or(0, |r| r.round);
                let lease_ms = standby.manifest.lease_ms.max(500);
                let keeper = LeaseKeeper::spawn(
                    node.clone(),
                    Signer::new(identity.clone()),
                    standby.run,
                    standby.machine.election(),
                    lease_ms,
                );
                keeper.alive(term, round);
                plan = Some(standby.successor(term, &data_dir).await?);
                keeper_until_led = Some(keeper);
            }
            Standing::Over => return Ok(()),
        }
    }
}

/// How a standby learns the run.
#[derive(Debug)]
enum Follow {
    /// Ask the run's providers (any run's when `None`) for its manifest.
    Discover(Option<RunId>),
    /// A leader that stepped down knows it, and the term it saw; one that stepped
    /// aside (it lost its workers) holds its own state and awaits the next
    /// candidate at once.
    Known(Box<RunManifest>, u64, Option<Box<LeaderState>>),
}

/// Why a standby stopped.
#[derive(Debug)]
enum Standing {
    /// Its term came: lead.
    Elected(u64),
    /// The run finished, or the node is shutting down.
    Over,
}

/// What a successor inherits, fetched while standing by.
#[derive(Debug)]
struct Inheritance {
    experiment: Experiment,
    model: Model,
    corpus_path: PathBuf,
    corpus: Corpus,
    prepared: Prepared,
}

/// A state fetch in flight: the blob, and the announcement that named it.
type Fetched = ([u8; 32], Box<RoundAnnouncement>, anyhow::Result<LeaderState>);

/// A standby candidate of one run: the host of [`failover::Standby`], which
/// decides. Fetches run beside its loop, so it always hears the leases.
#[derive(Debug)]
struct Standby {
    node: Node,
    events: Events,
    run: RunId,
    manifest: RunManifest,
    sizes: Vec<usize>,
    machine: failover::Standby,
    /// Fetching and compiling what a successor needs, while standing by.
    inheritance: JoinSet<anyhow::Result<Inheritance>>,
    /// The latest replicated state, once there is one.
    state: Option<LeaderState>,
    /// The state blob held (or being fetched), so each is fetched once.
    blob: [u8; 32],
    fetching: JoinSet<Fetched>,
    hooks: ShepherdHooks,
    /// The state blobs of recent rounds (the run's initial parameters pinned).
    retention: Retention,
}

impl Standby {
    /// Learns the run's manifest (unless known), checks this node is a candidate,
    /// and starts fetching what it would need to lead. `None` when cancelled.
    async fn start(
        how: Follow,
        node: &Node,
        signer: &mut Signer,
        data_dir: &std::path::Path,
        events: &Events,
        requests: &mut mpsc::Receiver<Event>,
        cancel: &CancellationToken,
    ) -> anyhow::Result<Option<Self>> {
        let me = signer.identity().public();
        let (manifest, term, source, aside) = match how {
            Follow::Known(manifest, term, aside) => {
                let leader = Succession::new(
                    RunId(manifest.run),
                    PublicKey(manifest.shepherd),
                    &manifest.candidates.iter().map(|k| PublicKey(*k)).collect::<Vec<_>>(),
                )
                .leader(term);
                let peer = pcp_bootstrap::peer_of(&leader).context("the leader's key is not a peer id")?;
                (*manifest, term, peer, aside)
            }
            Follow::Discover(run) => {
                let Some((manifest, peer)) = discover(run, node, signer, requests, cancel).await? else {
                    return Ok(None);
                };
                (manifest, 1, peer, None)
            }
        };
        let run = RunId(manifest.run);
        let candidates: Vec<PublicKey> = manifest.candidates.iter().map(|k| PublicKey(*k)).collect();
        let creator = PublicKey(manifest.shepherd);
        anyhow::ensure!(
            pcp_protocol::election::run_id(&creator, &manifest.model_hash, &manifest.salt, &candidates) == run,
            "run {run}: the manifest's creator, model, salt and candidates do not hash to its id"
        );
        let succession = Succession::new(run, creator, &candidates);
        if !succession.contains(&me) {
            let peers: Vec<String> =
                succession.order().iter().filter_map(pcp_bootstrap::peer_of).map(|p| p.to_string()).collect();
            anyhow::bail!(
                "this node ({}) is not a candidate of run {run}; its candidates are {}",
                pcp_bootstrap::peer_of(&me).map_or_else(|| me.to_string(), |p| p.to_string()),
                peers.join(", ")
            );
        }
        let now = wire::mono_ms();
        let mut election = Election::resume(me, succession, manifest.lease_ms.max(500), term, now);
        if aside.is_some() {
            election.step_aside(now);
        }
        let sizes = wire::sizes(&manifest);
        let mut inheritance = JoinSet::new();
        {
            let (node, manifest, data_dir) = (node.clone(), manifest.clone(), data_dir.to_path_buf());
            inheritance.spawn(async move { inherit(&node, &manifest, source, &data_dir).await });
        }
        let mut fetching = JoinSet::new();
        let aside_at = aside.as_ref().map(|_| now);
        let state = aside.map(|s| *s);
        let held = state.as_ref().map(replica_of);
        if state.is_none() {
            // the run's start, fetched beside the loop: until it arrives this
            // candidate holds nothing and never leads
            let initial = manifest.parameters.first().context("the manifest names no parameters")?.blob;
            let (node, sizes) = (node.clone(), sizes.clone());
            let start = RoundAnnouncement {
                run: run.0,
                round: 1,
                parameters: manifest.parameters.clone(),
                deadline_unix_ms: 0,
                participants: Vec::new(),
                finished: false,
                term,
                state: None,
                update: None,
                budget_ms: 0,
                steps_end_unix_ms: 0,
                screen_commit: [0; 32],
                screen_reveal: [0; 32],
            };
            fetching.spawn(async move {
                let fetched = async {
                    let params =
                        wire::read_params(&read(fetch(&node, initial, source, "initial parameters").await?)?, &sizes)?;
                    let velocity = sizes.iter().map(|n| vec![0.0; *n]).collect();
                    let snapshot = pcp_protocol::diloco::shepherd::Snapshot {
                        completed: 0,
                        params,
                        velocity,
                        durations: Vec::new(),
                        norms: Vec::new(),
                    };
                    Ok(LeaderState { term: 0, snapshot, contributors: Vec::new(), excluded: Vec::new() })
                }
                .await;
                (initial, Box::new(start), fetched)
            });
        }
        tracing::info!("standing by as a candidate of run {run} (term {term})");
        events.emit(ev::Event::Standby(ev::Standby {
            run: run.to_hex(),
            term,
            peer: pcp_bootstrap::peer_of(&me).map(|p| p.to_string()),
            aside: held.is_some(),
        }));
        Ok(Some(Self {
            node: node.clone(),
            events: events.clone(),
            run,
            manifest,
            sizes,
            machine: if aside_at.is_some() {
                failover::Standby::new(election, held).set_aside(now)
            } else {
                failover::Standby::new(election, held)
            },
            inheritance,
            state,
            blob: [0; 32],
            fetching,
            hooks: ShepherdHooks::default(),
            retention: Retention::default(),
        }))
    }

    async fn run(
        &mut self,
        signer: &mut Signer,
        requests: &mut mpsc::Receiver<Event>,
        cancel: &CancellationToken,
    ) -> anyhow::Result<Standing> {
        let mut tick = tokio::time::interval(Duration::from_millis(200));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut beat = tokio::time::interval(HEARTBEAT);
        beat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut asking: JoinSet<(PublicKey, PeerId, Option<Verified>)> = JoinSet::new();
        let mut asked: BTreeSet<PublicKey> = BTreeSet::new();
        loop {
            tokio::select! {
                () = cancel.cancelled() => return Ok(Standing::Over),
                event = requests.recv() => match event {
                    Some(Event::Request { id, message, .. }) => self.on_request(signer, id, *message).await?,
                    // the leader gossips each announcement as it opens a round: replicate at once
                    Some(Event::Gossip { run, from, message }) if run == self.run => {
                        if self.on_answer(from, &message) {
                            return Ok(Standing::Over);
                        }
                    }
                    Some(_) => {}
                    None => return Ok(Standing::Over),
                },
                _ = beat.tick() => {
                    // the leader awaited (its answer is a lease) and the other candidates
                    // (what each holds decides who may lead)
                    let me = self.machine.election().me();
                    let held = self.machine.held().map(|r| Held { term: r.term, round: r.round, params: r.params });
                    for key in self.machine.election().succession().order().to_vec() {
                        if key == me || asked.contains(&key) {
                            continue;
                        }
                        let Some(peer) = pcp_bootstrap::peer_of(&key) else { continue };
                        let hb = Heartbeat {
                            run: self.run.0,
                            round: self.machine.held().map_or(0, |r| r.round),
                            unix_ms: wire::unix_ms(),
                            free_memory_bytes: 0,
                            term: 0,
                            follows: self.machine.election().term(),
                            held,
                        };
                        let envelope = signer.seal(self.run, hb.round, &hb);
                        let node = self.node.clone();
                        asked.insert(key);
                        asking.spawn(async move {
                            let answer = tokio::time::timeout(HEARTBEAT * 4, node.request(peer, envelope)).await;
                            (key, peer, answer.ok().and_then(Result::ok))
                        });
                    }
                }
                Some(done) = asking.join_next() => {
                    if let Ok((key, peer, answer)) = done {
                        asked.remove(&key);
                        if let Some(answer) = answer
                            && answer.signer() == key
                            && self.on_answer(peer, &answer)
                        {
                            return Ok(Standing::Over);
                        }
                    } else {
                        asked.clear();
                    }
                }
                Some(done) = self.fetching.join_next() => {
                    if let Ok((blob, a, fetched)) = done {
                        // the round whose state it is: kept or not, it goes with that round
                        let round = fetched.as_ref().map_or(a.round.saturating_sub(1), |s| s.snapshot.completed);
                        if self.on_fetched(blob, &a, fetched) {
                            // tell the leader at once: it waits for this to release the round
                            beat.reset_immediately();
                        }
                        self.retention.advance(&self.node, &self.events, round, [BlobHash(blob)]).await;
                    }
                }
                _ = tick.tick() => {
                    for action in self.machine.handle(failover::Input::Tick, wire::mono_ms()) {
                        match action {
                            failover::Action::Election(election::Action::LeaseExpired { term, leader }) => {
                                let peer = peer_name(&leader);
                                tracing::warn!("run {}: the lease of term {term} lapsed", self.run);
                                self.events.emit(ev::Event::LeaseExpired(ev::LeaseExpired { term, peer }));
                            }
                            failover::Action::Deferred { term, to } => {
                                let (peer, round) = to.map_or((String::new(), 0), |(k, r)| (peer_name(&k), r.round));
                                let mine = self.machine.held().map(|r| r.round);
                                tracing::warn!("run {}: deferring term {term} (holding round {mine:?})", self.run);
                                self.events.emit(ev::Event::Deferred(ev::Deferred {
                                    term,
                                    to: peer,
                                    their_round: round,
                                    round: mine,
                                }));
                            }
                            failover::Action::Lead { term, .. } => return Ok(Standing::Elected(term)),
                            _ => {}
                        }
                    }
                }
            }
        }
    }

    /// Keeps the blobs `retention` tracks, and never releases the run's initial
    /// parameters (a successor's manifest names them).
    fn keep(&mut self, mut retention: Retention) {
        for p in &self.manifest.parameters {
            retention.pin(BlobHash(p.blob));
        }
        self.retention = retention;
    }

    /// A lease of `term` from `from`; refused ones are recorded. Whether it is valid.
    fn lease(&mut self, from: PublicKey, term: u64) -> bool {
        let mut valid = true;
        let input = failover::Input::Lease { from, term };
        for action in self.machine.handle(input, wire::mono_ms()) {
            if let failover::Action::Election(election::Action::Rejected { from, reason }) = action {
                valid = false;
                wire::lease_rejected(&self.events, "lease", &from, term, &reason);
            }
        }
        valid
    }

    /// What a leader's lease says it holds: a standby behind it defers to it.
    fn leader_holds(&mut self, leader: PublicKey, held: Option<Held>) {
        if let Some(h) = held {
            let held = Some(Replica { term: h.term, round: h.round, params: h.params });
            self.machine.handle(failover::Input::Peer { from: leader, held }, wire::mono_ms());
        }
    }

    /// The leader's answer to a heartbeat, or its gossiped announcement or lease
    /// (`peer` forwarded it); `true` when the run is over.
    fn on_answer(&mut self, peer: PeerId, answer: &Verified) -> bool {
        if answer.kind() == MessageKind::Heartbeat {
            if let Ok(hb) = answer.decode::<Heartbeat>()
                && hb.run == self.run.0
                && hb.term > 0
            {
                self.lease(answer.signer(), hb.term);
                self.leader_holds(answer.signer(), hb.held);
            }
            return false;
        }
        if answer.kind() != MessageKind::RoundAnnouncement {
            return false; // another standby's ack: the awaited leader is not up yet
        }
        let a: RoundAnnouncement = match answer.decode() {
            Ok(a) => a,
            Err(e) => {
                tracing::debug!("undecodable announcement from {peer}: {e}");
                return false;
            }
        };
        if a.run != self.run.0 || !self.lease(answer.signer(), a.term) {
            return false;
        }
        if let Some(state) = a.state.as_ref().filter(|s| s.blob != [0; 32] && s.blob != self.blob) {
            // fetched from the signer first: the forwarder of gossip may not hold it
            let from = pcp_bootstrap::peer_of(&answer.signer()).unwrap_or(peer);
            self.blob = state.blob;
            let (node, sizes, blob) = (self.node.clone(), self.sizes.clone(), state.blob);
            let a = Box::new(a.clone());
            self.fetching.spawn(async move {
                let fetched = async {
                    let path = fetch(&node, blob, from, "replicated state").await?;
                    wire::read_state(&read(path)?, &sizes)
                }
                .await;
                (blob, a, fetched)
            });
        }
        a.finished
    }

    /// A state fetched: kept when its parameters are the ones announced and it is
    /// newer than the one held.
    /// Whether it was kept.
    fn on_fetched(&mut self, blob: [u8; 32], a: &RoundAnnouncement, fetched: anyhow::Result<LeaderState>) -> bool {
        let state = match fetched {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!("run {}: cannot replicate the state of round {}: {e:#}", self.run, a.round);
                if self.blob == blob {
                    self.blob = [0; 32]; // the next announcement naming it tries again
                }
                return false;
            }
        };
        let params_hash = wire::params_hash(&state.snapshot.params);
        // an open round's announcement names the parameters the state must hold
        if let Some(p) = a.parameters.first()
            && !a.finished
            && (p.blob != params_hash.0 || state.snapshot.completed + 1 != a.round)
        {
            tracing::warn!("run {}: the state blob of round {} does not match its announcement", self.run, a.round);
            return false;
        }
        let replica = replica_of(&state);
        self.machine.handle(failover::Input::Replicated(replica), wire::mono_ms());
        if self.machine.held() != Some(replica) {
            return false; // older than the state held (a deposed branch's, say)
        }
        self.events.emit(ev::Event::StateReplicated(ev::StateReplicated {
            round: state.snapshot.completed,
            term: state.term,
            params_hash: params_hash.to_hex(),
        }));
        if let Some(tx) = &self.hooks.replicated {
            let _ = tx.try_send(Some(state.snapshot.completed));
        }
        self.state = Some(state);
        true
    }

    /// Answers requests while standing by: heartbeats with an ack naming the leader
    /// awaited; a leader's lease is followed, another candidate's report of what it
    /// holds is noted.
    async fn on_request(&mut self, signer: &mut Signer, id: InboundId, message: Verified) -> anyhow::Result<()> {
        let key = message.signer();
        if message.kind() == MessageKind::RoundAnnouncement {
            // the leader pushes a round it holds back from workers until this candidate holds its state
            self.on_answer(pcp_bootstrap::peer_of(&key).unwrap_or(PeerId::random()), &message);
        }
        if message.kind() == MessageKind::Heartbeat
            && let Ok(hb) = message.decode::<Heartbeat>()
            && hb.run == self.run.0
        {
            if hb.term > 0 {
                self.lease(key, hb.term);
                self.leader_holds(key, hb.held);
            } else {
                let held = hb.held.map(|h| Replica { term: h.term, round: h.round, params: h.params });
                self.machine.handle(failover::Input::Peer { from: key, held }, wire::mono_ms());
            }
        }
        let election = self.machine.election();
        let leader = pcp_bootstrap::peer_of(&election.awaited()).map_or_else(String::new, |p| p.to_string());
        let round = self.machine.held().map_or(0, |r| r.round);
        let ack = Ack {
            run: self.run.0,
            round,
            accepted: false,
            reason: format!("{STANDBY} of run {}; term {} is led by {leader}", self.run, election.term()),
        };
        let envelope = signer.seal(self.run, round, &ack);
        self.node.respond(id, envelope).await?;
        Ok(())
    }

    /// The plan to lead `term` from the replicated state.
    async fn successor(mut self, term: u64, data_dir: &std::path::Path) -> anyhow::Result<ShepherdPlan> {
        let inheritance = self.inheritance.join_next().await.context("the inheritance task is gone")??;
        let Inheritance { experiment, model, corpus_path, corpus, prepared } = inheritance?;
        let state = self.state.context("elected without a replicated state")?;
        tracing::info!("run {}: elected for term {term} after round {}", self.run, state.snapshot.completed);
        let mut plan = ShepherdPlan::successor(
            self.manifest,
            experiment,
            model,
            corpus_path,
            corpus,
            state,
            term,
            data_dir,
            prepared,
        )
        .map_err(|e| e.into_error())?;
        plan.retention = self.retention;
        Ok(plan)
    }
}

/// Where a replicated state stands in the run's history.
fn replica_of(state: &LeaderState) -> Replica {
    Replica { term: state.term, round: state.snapshot.completed, params: wire::params_hash(&state.snapshot.params).0 }
}

/// How a standby's acks begin, so workers tell them from a leader's refusals.
pub(crate) const STANDBY: &str = "standby candidate";

/// Asks the run's providers for its signed manifest.
async fn discover(
    run: Option<RunId>,
    node: &Node,
    signer: &mut Signer,
    requests: &mut mpsc::Receiver<Event>,
    cancel: &CancellationToken,
) -> anyhow::Result<Option<(RunManifest, PeerId)>> {
    let me = signer.identity().public();
    loop {
        let key = run.map_or_else(wire::runs_key, wire::run_key);
        for peer in node.providers(key, 8).await? {
            let hello = pcp_schema::NodeHello {
                peer: me.0,
                protocol_version: wire::PROTOCOL_VERSION,
                agent: format!("pcp-node/{} (candidate)", env!("CARGO_PKG_VERSION")),
                capabilities: pcp_schema::Capabilities {
                    backends: vec![pcp_schema::Backend {
                        name: "cpu".into(),
                        targets: vec![pcp_graph::Target::host().target.unwrap_or_default()],
                    }],
                    free_memory_bytes: 0,
                },
                certificate: Vec::new(),
                pow_nonce: 0,
            };
            let envelope = signer.seal(run.unwrap_or(RunId([0; 32])), 0, &hello);
            match node.request(peer, envelope).await {
                Ok(answer) if answer.kind() == MessageKind::RunManifest => match answer.decode::<RunManifest>() {
                    Ok(m) if run.is_none_or(|r| r.0 == m.run) => return Ok(Some((m, peer))),
                    Ok(_) => tracing::debug!(%peer, "serves another run"),
                    Err(e) => tracing::debug!(%peer, "bad manifest: {e}"),
                },
                Ok(_) => tracing::debug!(%peer, "did not answer with a manifest"),
                Err(e) => tracing::debug!(%peer, "hello failed: {e}"),
            }
        }
        tokio::select! {
            () = cancel.cancelled() => return Ok(None),
            () = tokio::time::sleep(DISCOVERY_RETRY) => {}
            // nobody leads yet: requests get a standby's refusal
            Some(Event::Request { id, .. }) = requests.recv() => {
                let run = run.unwrap_or(RunId([0; 32]));
                let ack = Ack { run: run.0, round: 0, accepted: false, reason: format!("{STANDBY}: not yet following a run") };
                let envelope = signer.seal(run, 0, &ack);
                node.respond(id, envelope).await?;
            }
        }
    }
}

/// Fetches the experiment, the loss module and the corpus a successor needs, and
/// compiles the training step ahead (into the artifact cache).
async fn inherit(
    node: &Node,
    manifest: &RunManifest,
    leader: PeerId,
    data_dir: &std::path::Path,
) -> anyhow::Result<Inheritance> {
    anyhow::ensure!(manifest.experiment != [0; 32], "the run's manifest names no experiment blob");
    let mut experiment: Experiment =
        serde_json::from_slice(&read(fetch(node, manifest.experiment, leader, "experiment").await?)?)
            .context("the run's experiment blob")?;
    let model_path = fetch(node, manifest.model_hash, leader, "loss module").await?;
    let corpus_path = fetch(node, manifest.data.blob, leader, "corpus").await?;
    let corpus = Corpus::load(&corpus_path, &manifest.data.tokenizer, None, manifest.data.val_fraction)?;
    experiment.data_path = Some(corpus_path.display().to_string());
    let source = model_path.display().to_string();
    let model = Model::load_with_batch(&source, corpus.vocab.size(), None)?;
    let module = model.module.clone();
    let config = step_config(&experiment);
    let dir = std::env::var_os("PCP_ARTIFACT_CACHE").map_or_else(|| data_dir.join("artifacts"), PathBuf::from);
    let (step, vmfb) = tokio::task::spawn_blocking(move || -> anyhow::Result<_> {
        let step = pcp_graph::train_step(&module, "main", &config).map_err(|e| anyhow::anyhow!("{e}"))?;
        let artifact = pcp_graph::compile(&step.module, &pcp_graph::Target::host(), Some(&dir))?;
        Ok((step, artifact.vmfb))
    })
    .await??;
    let sizes = wire::sizes(manifest);
    let zeros = sizes.iter().map(|n| vec![0.0; *n]).collect();
    let engine = Engine::new(
        pcp_runtime::Device::Cpu,
        vmfb,
        wire::shapes(manifest),
        zeros,
        None,
        step.state_per_param,
        manifest.data.int64,
    )
    .await?;
    Ok(Inheritance { experiment, model, corpus_path, corpus, prepared: Prepared { step, engine } })
}

async fn fetch(node: &Node, hash: [u8; 32], from: PeerId, what: &str) -> anyhow::Result<PathBuf> {
    let report = node
        .fetch_from(BlobHash(hash), vec![from], FETCH_TIMEOUT)
        .await
        .with_context(|| format!("fetching the {what} from {from}"))?;
    Ok(report.path)
}

fn read(path: PathBuf) -> anyhow::Result<Vec<u8>> {
    std::fs::read(&path).with_context(|| format!("reading {}", path.display()))
}
