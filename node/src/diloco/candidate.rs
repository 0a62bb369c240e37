//! Coordinator candidates: a shepherd that may step down, and standbys that take
//! over when the leader's lease lapses.
//!
//! A candidate alternates between two phases, and one [`Consensus`] (the
//! protocol's [`pcp_protocol::failover::Candidate`], which the fault simulator drives too) goes
//! through both. **Leading**, it is a shepherd ([`super::shepherd`]) that tells
//! workers of a round once a majority of the candidates holds the state it starts
//! from. **Standby**, it answers the leader's leases, fetches the state each lease
//! names and checks its parameters, and votes; when its turn comes it asks for
//! votes and, elected, leads from the state it holds: the open round is reopened
//! (workers train it again from the same parameters), so no committed round is lost
//! or applied twice. A standby does not train: its compute is free to take over at
//! once.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use pcp_bootstrap::{Event, InboundId, Node, PeerId};
use pcp_protocol::election::Succession;
use pcp_protocol::failover::Replica;
use pcp_protocol::failover::candidate::{Action, Input};
use pcp_protocol::{BlobHash, PublicKey, RunId, Verified};
use pcp_schema::{Ack, Heartbeat, MessageKind, RoundAnnouncement, RunManifest};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::RoleIo;
use super::consensus::{Consensus, Seat, mode_of};
use super::inbox::Inbox;
use super::retention::Retention;
use super::shepherd::{Host, LeaseKeeper, Outcome, OwnEngine, Prepared, ShepherdHooks, ShepherdPlan};
use super::wire::{self, LeaderState, Signer, peer_name};
use crate::observe::events::{self as ev, Events};
use crate::training::config::Experiment;
use crate::training::config::step_config;
use crate::training::data::Corpus;
use crate::training::device::Placement;
use crate::training::engine::Engine;
use crate::training::model::Model;

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
    /// run the DHT knows (`sim`), keeping the blobs of its recent rounds, with its
    /// own engine on the placement given (`--backend`, `--target`).
    Standby(Option<RunId>, Retention, Placement),
}

/// Runs a candidate until the run is over or `cancel` fires.
pub(crate) async fn run(
    begin: Begin,
    io: RoleIo,
    mut requests: Inbox,
    hooks: ShepherdHooks,
    cancel: CancellationToken,
) -> anyhow::Result<()> {
    let RoleIo { node, identity, data_dir, events } = io;
    let mut signer = Signer::new(identity.clone());
    // a leader's plan carries its blobs' retention; a standby holds it, and hands it on
    let (mut plan, mut follow, mut retention, on) = match begin {
        Begin::Lead(plan) => {
            let on = plan.engine.on.clone();
            (Some(*plan), None, Retention::default(), on)
        }
        Begin::Standby(run, retention, on) => (None, Some(Follow::Discover(run)), retention, on),
    };
    let mut keeper_until_led: Option<LeaseKeeper> = None;
    let mut consensus: Option<Box<Consensus>> = None;
    loop {
        if let Some(plan) = plan.take() {
            let mut host = Host::start(
                plan,
                node.clone(),
                identity.clone(),
                &data_dir,
                events.clone(),
                hooks.clone(),
                consensus.take(),
            )
            .await?;
            drop(keeper_until_led.take()); // the host's own leases from here
            let outcome = host.main_loop(&mut requests, &cancel).await?;
            let (c, kept) = host.into_parts();
            retention = kept;
            match outcome {
                Outcome::Done => return Ok(()),
                Outcome::SteppedDown { manifest, term, state } => {
                    consensus = Some(c);
                    follow = Some(Follow::Known(manifest, term, state));
                }
            }
        }
        let Some(how) = follow.take() else { return Ok(()) };
        let seat = (&node, data_dir.as_path(), &events, &on);
        let start = Standby::start(how, seat, &mut signer, &mut requests, &cancel, consensus.take());
        let mut standby = match start.await? {
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
                // the others must not elect another meanwhile
                let lease_ms = standby.manifest.lease_ms.max(500);
                let keeper = LeaseKeeper::spawn(
                    node.clone(),
                    Signer::new(identity.clone()),
                    standby.run,
                    standby.consensus.core().succession(),
                    lease_ms,
                );
                keeper.alive(standby.consensus.lease_heartbeat());
                let (next, c) = standby.successor(term, &data_dir).await?;
                plan = Some(next);
                consensus = Some(c);
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
    /// A leader that stopped knows it, the term it saw, and its own state.
    Known(Box<RunManifest>, u64, Box<LeaderState>),
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

/// A state fetch in flight: the state asked for, its blob, and what came.
type Fetched = (Replica, [u8; 32], anyhow::Result<LeaderState>);

/// A standby candidate of one run: the host of its [`Consensus`] while it does
/// not lead. Fetches run beside its loop, so it always hears the leases.
#[derive(Debug)]
struct Standby {
    node: Node,
    events: Events,
    run: RunId,
    manifest: RunManifest,
    sizes: Vec<usize>,
    consensus: Box<Consensus>,
    /// Fetching and compiling what a successor needs, while standing by.
    inheritance: JoinSet<anyhow::Result<Inheritance>>,
    /// The state the consensus holds, once there is one.
    state: Option<LeaderState>,
    /// The state being fetched, so each is fetched once at a time.
    fetching_state: Option<Replica>,
    fetching: JoinSet<Fetched>,
    hooks: ShepherdHooks,
    /// The state blobs of recent rounds (the run's initial parameters pinned).
    retention: Retention,
    /// Where its own engine runs: the one it prepares, and the one it leads with.
    on: Placement,
}

impl Standby {
    /// Learns the run's manifest (unless known), checks this node is a candidate,
    /// and starts fetching what it would need to lead. `None` when cancelled.
    async fn start(
        how: Follow,
        (node, data_dir, events, on): (&Node, &std::path::Path, &Events, &Placement),
        signer: &mut Signer,
        requests: &mut Inbox,
        cancel: &CancellationToken,
        consensus: Option<Box<Consensus>>,
    ) -> anyhow::Result<Option<Self>> {
        let me = signer.identity().public();
        let (manifest, term, source, state) = match how {
            Follow::Known(manifest, term, state) => {
                let leader = Succession::new(
                    RunId(manifest.run),
                    PublicKey(manifest.shepherd),
                    &manifest.candidates.iter().map(|k| PublicKey(*k)).collect::<Vec<_>>(),
                )
                .leader(term);
                let peer = pcp_bootstrap::peer_of(&leader).context("the leader's key is not a peer id")?;
                (*manifest, term, peer, Some(*state))
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
        let lease_ms = manifest.lease_ms.max(500);
        let mode = mode_of(manifest.failover, succession.order().len());
        let consensus = match consensus {
            Some(c) => c,
            None => {
                let identity = signer.identity();
                let seat = Seat { node, identity, events, data_dir, run, succession, lease_ms, mode };
                Box::new(Consensus::open(seat, None)?)
            }
        };
        let sizes = wire::sizes(&manifest);
        let mut inheritance = JoinSet::new();
        {
            let (node, manifest, data_dir, on) = (node.clone(), manifest.clone(), data_dir.to_path_buf(), on.clone());
            inheritance.spawn(async move { inherit(&node, &manifest, source, &data_dir, &on).await });
        }
        let mut fetching = JoinSet::new();
        let stood_aside = state.is_some();
        if state.is_none() && consensus.core().held().is_none() {
            // the run's start, fetched beside the loop: until a state arrives this
            // candidate holds nothing and never leads
            let initial = manifest.parameters.first().context("the manifest names no parameters")?.blob;
            let (node, sizes) = (node.clone(), sizes.clone());
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
                        learned: Default::default(),
                    };
                    Ok(LeaderState { term: 1, snapshot, contributors: Vec::new(), excluded: Vec::new() })
                }
                .await;
                // the manifest's initial state: term 1's, round 0
                let state = match &fetched {
                    Ok(s) => Replica { term: 1, round: 0, params: wire::params_hash(&s.snapshot.params).0 },
                    Err(_) => Replica { term: 1, round: 0, params: [0; 32] },
                };
                (state, [0; 32], fetched)
            });
        }
        tracing::info!("standing by as a candidate of run {run} (term {term})");
        events.emit(ev::Event::Standby(ev::Standby {
            run: run.to_hex(),
            term,
            peer: pcp_bootstrap::peer_of(&me).map(|p| p.to_string()),
            aside: stood_aside,
        }));
        Ok(Some(Self {
            node: node.clone(),
            events: events.clone(),
            run,
            manifest,
            sizes,
            consensus,
            inheritance,
            state,
            fetching_state: None,
            fetching,
            hooks: ShepherdHooks::default(),
            retention: Retention::default(),
            on: on.clone(),
        }))
    }

    async fn run(
        &mut self,
        signer: &mut Signer,
        requests: &mut Inbox,
        cancel: &CancellationToken,
    ) -> anyhow::Result<Standing> {
        let mut tick = tokio::time::interval(Duration::from_millis(100));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let actions = tokio::select! {
                () = cancel.cancelled() => return Ok(Standing::Over),
                event = requests.recv() => match event {
                    Some(Event::Request { id, message, .. }) => self.on_request(signer, id, *message).await?,
                    // the leader gossips its announcements: a finished run ends the standby
                    Some(Event::Gossip { run, message, .. }) if run == self.run => {
                        if self.finished(&message) {
                            return Ok(Standing::Over);
                        }
                        Vec::new()
                    }
                    Some(_) => Vec::new(),
                    None => return Ok(Standing::Over),
                },
                Some(done) = self.consensus.sends.join_next() => match done {
                    Ok(sent) => self.consensus.on_answer(sent)?,
                    Err(_) => Vec::new(),
                },
                Some(done) = self.fetching.join_next() => match done {
                    Ok((state, blob, fetched)) => {
                        let round = state.round;
                        let actions = self.on_fetched(state, fetched)?;
                        let kept = (blob != [0; 32]).then_some(BlobHash(blob));
                        self.retention.advance(&self.node, &self.events, round, kept).await;
                        actions
                    }
                    Err(_) => Vec::new(),
                },
                _ = tick.tick() => self.consensus.handle(Input::Tick)?,
            };
            if let Some(standing) = self.carry_out(actions) {
                return Ok(standing);
            }
        }
    }

    /// Carries out what the consensus decided: fetch a state, or lead.
    fn carry_out(&mut self, actions: Vec<Action>) -> Option<Standing> {
        for a in actions {
            match a {
                Action::Fetch { state, from } => self.fetch_state(state, from),
                Action::Held(state) => {
                    // a new leader's term on the parameters it holds already
                    if let Some(s) = self.state.as_mut().filter(|s| s.snapshot.completed == state.round) {
                        s.term = state.term;
                    }
                    if state.round >= self.manifest.rounds {
                        // the leader completed the last round: nothing is left to lead
                        tracing::info!("run {}: the last round's state is held; the run is over", self.run);
                        return Some(Standing::Over);
                    }
                }
                Action::Elected { term, leader } => {
                    tracing::info!("run {}: following {} in term {term}", self.run, peer_name(&leader));
                }
                Action::Lead { term, .. } => return Some(Standing::Elected(term)),
                _ => {}
            }
        }
        None
    }

    /// Fetches `state` from `from` (the leader whose lease named it).
    fn fetch_state(&mut self, state: Replica, from: PublicKey) {
        let Some(blob) = self.consensus.blob_of(&state) else {
            tracing::debug!("run {}: no blob named for round {}'s state", self.run, state.round);
            return;
        };
        if self.fetching_state == Some(state) {
            return;
        }
        let Some(peer) = pcp_bootstrap::peer_of(&from) else { return };
        self.fetching_state = Some(state);
        let (node, sizes) = (self.node.clone(), self.sizes.clone());
        self.fetching.spawn(async move {
            let fetched = async {
                let path = fetch(&node, blob, peer, "replicated state").await?;
                wire::read_state(&read(path)?, &sizes)
            }
            .await;
            (state, blob, fetched)
        });
    }

    /// Whether a gossiped message is the leader's announcement that the run is over.
    fn finished(&self, message: &Verified) -> bool {
        message.kind() == MessageKind::RoundAnnouncement
            && self.consensus.core().succession().contains(&message.signer())
            && message.decode::<RoundAnnouncement>().is_ok_and(|a| a.run == self.run.0 && a.finished)
    }

    /// Keeps the blobs `retention` tracks, and never releases the run's initial
    /// parameters (a successor's manifest names them).
    fn keep(&mut self, mut retention: Retention) {
        for p in &self.manifest.parameters {
            retention.pin(BlobHash(p.blob));
        }
        self.retention = retention;
    }

    /// A state fetched: checked against the state the consensus asked for (its
    /// round and parameters), then held.
    fn on_fetched(&mut self, state: Replica, fetched: anyhow::Result<LeaderState>) -> anyhow::Result<Vec<Action>> {
        if self.fetching_state == Some(state) {
            self.fetching_state = None;
        }
        let mut fetched = match fetched {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!("run {}: cannot replicate the state of round {}: {e:#}", self.run, state.round);
                return Ok(Vec::new()); // the next lease naming it asks again
            }
        };
        let params_hash = wire::params_hash(&fetched.snapshot.params);
        if params_hash.0 != state.params || fetched.snapshot.completed != state.round {
            tracing::warn!(
                "run {}: the state blob of round {} is not the state its lease named",
                self.run,
                state.round
            );
            return Ok(Vec::new());
        }
        fetched.term = state.term;
        let actions = self.consensus.handle(Input::Holds(state))?;
        if self.consensus.core().held() != Some(state) {
            return Ok(actions); // no longer wanted (a higher term's leader holds another)
        }
        self.events.emit(ev::Event::StateReplicated(ev::StateReplicated {
            round: fetched.snapshot.completed,
            term: state.term,
            params_hash: params_hash.to_hex(),
        }));
        if let Some(tx) = &self.hooks.replicated {
            let _ = tx.try_send(Some(fetched.snapshot.completed));
        }
        self.state = Some(fetched);
        Ok(actions)
    }

    /// Answers requests while standing by: another candidate's consensus message
    /// with the consensus's answer; anything else (a worker's heartbeat) with an
    /// ack naming the leader awaited.
    async fn on_request(
        &mut self,
        signer: &mut Signer,
        id: InboundId,
        message: Verified,
    ) -> anyhow::Result<Vec<Action>> {
        let key = message.signer();
        if message.kind() == MessageKind::Heartbeat
            && self.consensus.core().succession().contains(&key)
            && let Ok(hb) = message.decode::<Heartbeat>()
            && let Some((reply, actions)) = self.consensus.on_request(key, &hb)?
        {
            if let Some(reply) = reply {
                let envelope = signer.seal(self.run, reply.round, &reply);
                self.node.respond(id, envelope).await?;
                return Ok(actions);
            }
            self.ack(signer, id).await?;
            return Ok(actions);
        }
        self.ack(signer, id).await?;
        Ok(Vec::new())
    }

    async fn ack(&mut self, signer: &mut Signer, id: InboundId) -> anyhow::Result<()> {
        let core = self.consensus.core();
        let leader = pcp_bootstrap::peer_of(&core.awaited()).map_or_else(String::new, |p| p.to_string());
        let round = core.held().map_or(0, |r| r.round);
        let reason = format!("{STANDBY} of run {}; term {} is led by {leader}", self.run, core.term());
        let ack = Ack::refuse(self.run.0, round, pcp_schema::AckCode::Standby, reason);
        let envelope = signer.seal(self.run, round, &ack);
        self.node.respond(id, envelope).await?;
        Ok(())
    }

    /// The plan to lead `term` from the state held, and the consensus that leads it.
    async fn successor(
        mut self,
        term: u64,
        data_dir: &std::path::Path,
    ) -> anyhow::Result<(ShepherdPlan, Box<Consensus>)> {
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
            OwnEngine { on: self.on.clone(), prepared: Some(prepared) },
        )
        .map_err(|e| e.into_error())?;
        plan.retention = self.retention;
        Ok((plan, self.consensus))
    }
}

/// How a standby's acks begin, so workers tell them from a leader's refusals.
pub(crate) const STANDBY: &str = "standby candidate";

/// Asks the run's providers for its signed manifest.
async fn discover(
    run: Option<RunId>,
    node: &Node,
    signer: &mut Signer,
    requests: &mut Inbox,
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
                    aggregate: false,
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
                let reason = format!("{STANDBY}: not yet following a run");
                let ack = Ack::refuse(run.0, 0, pcp_schema::AckCode::Standby, reason);
                let envelope = signer.seal(run, 0, &ack);
                node.respond(id, envelope).await?;
            }
        }
    }
}

/// Fetches the experiment, the loss module and the corpus a successor needs, and
/// compiles the training step ahead (into the artifact cache) for `on`, where its
/// engine runs.
async fn inherit(
    node: &Node,
    manifest: &RunManifest,
    leader: PeerId,
    data_dir: &std::path::Path,
    on: &Placement,
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
    let config =
        pcp_graph::StepConfig { sparse_screen: wire::manifest_sparse_screen(manifest), ..step_config(&experiment) };
    let dir = std::env::var_os("PCP_ARTIFACT_CACHE").map_or_else(|| data_dir.join("artifacts"), PathBuf::from);
    let target = on.target.clone();
    let (step, vmfb) = tokio::task::spawn_blocking(move || -> anyhow::Result<_> {
        let step = pcp_graph::train_step(&module, "main", &config).map_err(|e| anyhow::anyhow!("{e}"))?;
        let artifact = pcp_graph::compile(&step.module, &target, Some(&dir))?;
        Ok((step, artifact.vmfb))
    })
    .await?
    .with_context(|| format!("compiling a successor's engine for {on}"))?;
    let sizes = wire::sizes(manifest);
    let zeros = sizes.iter().map(|n| vec![0.0; *n]).collect();
    let mut engine =
        Engine::new(on.device, vmfb, wire::shapes(manifest), zeros, None, step.state_per_param, manifest.data.int64)
            .await?;
    engine.screens_sparse(wire::manifest_sparse_screen(manifest));
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
