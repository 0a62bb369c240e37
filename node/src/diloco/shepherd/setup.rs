//! How a shepherd starts: where its run comes from (new, checkpoint, inherited),
//! the manifest, the state machine's settings and its own engine.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context as _;
use pcp_bootstrap::{BlobStore, Node};
use pcp_protocol::diloco::shepherd::{Shepherd, Snapshot};
use pcp_protocol::diloco::{Tensors, compress, fragments, shepherd};
use pcp_protocol::election::Succession;
use pcp_protocol::failover::{CHECK_QUORUM_LEASES, Quorum, Replica};
use pcp_protocol::{BlobHash, PublicKey, RunId};
use pcp_schema::{Admission, DataSpec, ParameterRef, RunManifest, Schedule, TensorSpec};
use tokio::task::JoinSet;

use crate::diloco::consensus::{Consensus, Seat};
use crate::diloco::wire;
use crate::diloco::wire::{Signer, peer_name};
use crate::observe::events as ev;
use crate::observe::events::Events;
use crate::training::checkpoint::Checkpoint;
use crate::training::config::{Experiment, step_config};
use crate::training::data::Corpus;
use crate::training::engine::Engine;

use super::leadership::LeaseKeeper;
use super::{CONTRIBUTION_OVERHEAD, Host, ShepherdHooks, Start, file_name, screen};
use super::{Screen, ShepherdPlan};

/// What a shepherd's checkpoint records besides its tensors (`meta.json`).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub(super) struct ShepherdMeta {
    /// Always `shepherd`.
    pub(super) role: String,
    /// The run id, hex.
    pub(super) run: String,
    pub(super) experiment: Experiment,
    /// The model's source (preset or path).
    pub(super) model: String,
    /// The corpus's vocabulary.
    #[serde(default)]
    pub(super) vocab: Option<crate::training::data::Vocab>,
    /// Recent round durations, milliseconds (adaptive deadlines).
    #[serde(default)]
    pub(super) durations: Vec<u64>,
    /// The last round's contribution norms (the next bound).
    #[serde(default)]
    pub(super) norms: Vec<f64>,
    /// The last round's contributors: how many to wait for on resume.
    #[serde(default = "one")]
    pub(super) contributors: usize,
    /// Their keys and those of the participants that missed its deadline, hex: the
    /// workers whose heartbeat joins the resumed shepherd without a hello (absent:
    /// every worker says hello again).
    #[serde(default)]
    pub(super) workers: Vec<String>,
    /// blake3 of the parameters blob, hex.
    #[serde(default)]
    pub(super) params_hash: String,
    /// The run's creator's key, hex (absent before elections existed: this node).
    #[serde(default)]
    pub(super) creator: Option<String>,
    /// The run id's salt, hex.
    #[serde(default)]
    pub(super) salt: Option<String>,
    /// The other coordinator candidates' keys, hex.
    #[serde(default)]
    pub(super) candidates: Vec<String>,
    /// The term it led in.
    #[serde(default = "one_u64")]
    pub(super) term: u64,
    /// The live workers' ratings and the references (absent: nothing learned).
    #[serde(default)]
    pub(super) learned: wire::LearnedRecord,
}

pub(super) fn one() -> usize {
    1
}

pub(super) fn one_u64() -> u64 {
    1
}

impl ShepherdMeta {
    pub(super) fn of(c: &Checkpoint) -> anyhow::Result<Self> {
        serde_json::from_value(c.meta.clone()).context("the shepherd checkpoint's metadata")
    }
}

/// Brings checkpoint `c` (of tensors `names` of `sizes`) up to the newer state blob
/// its shepherd wrote, if any ([`super::resume`]); returns the round it resumes at.
pub(super) fn newest_state(
    c: &mut Checkpoint,
    state_dir: &Path,
    data_dir: &Path,
    names: &[String],
    sizes: &[usize],
) -> anyhow::Result<u64> {
    let Some(state) = super::resume::newer(state_dir, data_dir, c.step, sizes)? else { return Ok(c.step) };
    let s = &state.snapshot;
    for (name, (params, velocity)) in names.iter().zip(s.params.iter().zip(&s.velocity)) {
        let tensor = c.tensors.iter_mut().find(|t| &t.name == name);
        tensor.with_context(|| format!("the checkpoint has no tensor {name:?}"))?.data.clone_from(params);
        let v = format!("velocity.{name}");
        let tensor = c.tensors.iter_mut().find(|t| t.name == v);
        tensor.with_context(|| format!("the checkpoint has no tensor {v:?}"))?.data.clone_from(velocity);
    }
    let mut meta = ShepherdMeta::of(c)?;
    meta.durations.clone_from(&s.durations);
    meta.norms.clone_from(&s.norms);
    meta.contributors = state.contributors.len();
    meta.workers = state.contributors.iter().chain(&state.excluded).map(|k| hex::encode(k.0)).collect();
    meta.params_hash = wire::params_hash(&s.params).to_hex();
    meta.term = meta.term.max(state.term);
    meta.learned = wire::LearnedRecord::of(&s.learned);
    c.meta = serde_json::to_value(meta)?;
    c.step = s.completed;
    Ok(c.step)
}

/// Where a shepherd's run comes from: a new run, its checkpoint, or a leader's
/// replicated state it inherits.
pub(super) struct Origin {
    run: RunId,
    params: Tensors,
    snapshot: Option<Snapshot<PublicKey>>,
    /// Workers to wait for before the first round opens.
    contributors: usize,
    /// The workers of the state it starts from, whose heartbeat joins them.
    returning: Vec<PublicKey>,
    salt: [u8; 32],
    creator: PublicKey,
    candidates: Vec<PublicKey>,
    term: u64,
    /// A successor's manifest.
    inherited: Option<RunManifest>,
}

impl Origin {
    fn of(plan: &ShepherdPlan, me: PublicKey, model_hash: &[u8; 32]) -> anyhow::Result<Self> {
        Ok(match &plan.start {
            Start::Resume(c) => {
                let meta = ShepherdMeta::of(c)?;
                let run: RunId = meta.run.parse().context("the shepherd checkpoint's run id")?;
                let get = |prefix: &str| -> anyhow::Result<Tensors> {
                    plan.model
                        .params
                        .iter()
                        .map(|p| Ok(c.tensor(&format!("{prefix}{}", p.name))?.data.clone()))
                        .collect()
                };
                let key = |v: &Option<String>| v.as_deref().and_then(|s| s.parse::<BlobHash>().ok());
                let params = get("")?;
                let snapshot = Snapshot {
                    completed: c.step,
                    params: params.clone(),
                    velocity: get("velocity.")?,
                    durations: meta.durations.clone(),
                    norms: meta.norms.clone(),
                    learned: meta.learned.read(params.len()).context("the shepherd checkpoint's ratings")?,
                };
                Self {
                    run,
                    params,
                    snapshot: Some(snapshot),
                    contributors: meta.contributors,
                    returning: meta
                        .workers
                        .iter()
                        .filter_map(|k| k.parse::<BlobHash>().ok())
                        .map(|k| PublicKey(k.0))
                        .collect(),
                    salt: key(&meta.salt).context("shepherd checkpoint has no run salt")?.0,
                    creator: key(&meta.creator).map_or(me, |k| PublicKey(k.0)),
                    candidates: meta
                        .candidates
                        .iter()
                        .filter_map(|c| c.parse::<BlobHash>().ok())
                        .map(|k| PublicKey(k.0))
                        .collect(),
                    term: meta.term,
                    inherited: None,
                }
            }
            Start::Succeed { manifest, state, term } => {
                let snapshot = state.snapshot.clone();
                Self {
                    run: RunId(manifest.run),
                    params: snapshot.params.clone(),
                    snapshot: Some(snapshot),
                    contributors: state.contributors.len(),
                    returning: state.contributors.iter().chain(&state.excluded).copied().collect(),
                    salt: manifest.salt,
                    creator: PublicKey(manifest.shepherd),
                    candidates: manifest.candidates.iter().map(|k| PublicKey(*k)).collect(),
                    term: *term,
                    inherited: Some((**manifest).clone()),
                }
            }
            Start::New => {
                let salt = rand::random::<[u8; 32]>();
                let candidates = plan.candidates.clone();
                Self {
                    run: pcp_protocol::election::run_id(&me, model_hash, &salt, &candidates),
                    params: plan.model.init(plan.experiment.seed),
                    snapshot: None,
                    contributors: plan.min_workers,
                    returning: Vec::new(),
                    salt,
                    creator: me,
                    candidates,
                    term: 1,
                    inherited: None,
                }
            }
        })
    }
}

/// A new run's manifest from the plan: everything but the identities and blobs
/// of this run (run id, creator, parameters, candidates, salt, experiment), which
/// the caller sets.
pub(super) fn new_manifest(
    plan: &ShepherdPlan,
    step: &pcp_graph::TrainModule,
    (corpus, corpus_size): (BlobHash, u64),
    model_hash: [u8; 32],
) -> anyhow::Result<RunManifest> {
    let e = &plan.experiment;
    let (batch, block) = plan.model.batch_block()?;
    let int64 = plan.model.data.first().is_some_and(|t| t.element.name() == "i64");
    let total_steps = plan.rounds * plan.tau;
    let tensors = plan
        .model
        .params
        .iter()
        .map(|p| TensorSpec { name: p.name.clone(), shape: p.ty.shape.iter().map(|d| *d as u64).collect() })
        .collect();
    Ok(RunManifest {
        run: [0; 32],
        name: format!("{} on {}", plan.model.source, file_name(&plan.corpus_path)),
        shepherd: [0; 32],
        inner_steps: u32::try_from(plan.tau).context("--tau is too large")?,
        artifacts: Vec::new(),
        parameters: Vec::new(),
        model_hash,
        rounds: plan.rounds,
        seed: e.seed,
        schedule: Schedule {
            learning_rate: e.learning_rate,
            min_lr: e.min_lr.min(e.learning_rate),
            warmup_steps: e.warmup_steps.min(total_steps / 10),
            total_steps,
        },
        outer_lr: e.outer_lr as f32,
        outer_momentum: e.nesterov_momentum as f32,
        data: DataSpec {
            blob: corpus.0,
            size: corpus_size,
            tokenizer: e.tokenizer.clone(),
            val_fraction: e.val_fraction,
            batch: batch as u32,
            block: block as u32,
            int64,
        },
        tensors,
        state_per_param: step.state_per_param as u32,
        encoding: plan.encoding.spec(),
        screen: plan.screen.name().to_owned(),
        trim: plan.trim as f32,
        candidates: Vec::new(),
        lease_ms: plan.lease_ms,
        failover: plan.failover,
        salt: [0; 32],
        experiment: [0; 32],
        overlap: plan.overlap,
        fragments: plan.fragments,
        precision: e.precision.clone(),
        recompute: e.recompute.clone(),
        admission: Admission { aggregator_spot_rate: plan.aggregation.spot_rate as f32, ..plan.trust.manifest() },
    })
}

/// Stores what a run needs whatever its round (the corpus, the initial
/// parameters, the loss module and the experiment a successor leads with), pins
/// them, and returns the run's manifest: a successor's inherited one, or a new
/// run's. `(run, creator, candidates, salt)` must hash to the run id.
pub(super) fn run_manifest(
    store: &BlobStore,
    plan: &mut ShepherdPlan,
    step: &pcp_graph::TrainModule,
    params: &Tensors,
    (run, creator, candidates, salt): (RunId, PublicKey, &[PublicKey], [u8; 32]),
    (inherited, me): (Option<RunManifest>, PublicKey),
) -> anyhow::Result<RunManifest> {
    let model_hash = *blake3::hash(plan.model.module.to_mlir().as_bytes()).as_bytes();
    // a new run, or its creator's resume, withholds the tail of its corpus for the
    // screen; a successor, and a successor resuming its own checkpoint, has only the
    // public part, which it publishes as it is
    let public = if inherited.is_none() && creator == me {
        let (_, block) = plan.model.batch_block()?;
        let e = &plan.experiment;
        let withheld =
            screen::withhold(&plan.corpus_path, &plan.state_dir, &e.tokenizer, &plan.corpus.vocab, 4 * (block + 1))?;
        if withheld.split.is_some() {
            // the shepherd validates on what workers hold, as they would
            plan.corpus =
                Corpus::load(&withheld.public, &e.tokenizer, Some(plan.corpus.vocab.clone()), e.val_fraction)?;
        }
        plan.screen_split = withheld.split;
        withheld.public
    } else {
        plan.corpus_path.clone()
    };
    let (corpus_hash, corpus_size) = store.put_file(&public)?;
    let params_blob = wire::params_blob(params);
    let params_hash = store.put_bytes(&params_blob)?;
    let params_ref =
        ParameterRef { name: "params".into(), shard: 0, blob: params_hash.0, size: params_blob.len() as u64 };
    // what a successor needs besides the corpus: the loss module and the experiment
    let module_hash = store.put_bytes(plan.model.module.to_mlir().as_bytes())?;
    let mut shared = plan.experiment.clone();
    shared.data_path = None;
    let experiment_hash = store.put_bytes(&serde_json::to_vec(&shared)?)?;
    let manifest = match inherited {
        Some(mut m) => {
            m.artifacts = Vec::new();
            m
        }
        None => RunManifest {
            run: run.0,
            shepherd: creator.0,
            parameters: vec![params_ref],
            candidates: candidates.iter().map(|k| k.0).collect(),
            salt,
            experiment: experiment_hash.0,
            ..new_manifest(plan, step, (corpus_hash, corpus_size), model_hash)?
        },
    };
    anyhow::ensure!(
        pcp_protocol::election::run_id(&creator, &manifest.model_hash, &manifest.salt, candidates) == run,
        "run {run}: its id does not match its creator, model, salt and candidates"
    );
    // what the run needs whatever its round: never released
    for hash in [corpus_hash, module_hash, experiment_hash] {
        plan.retention.pin(hash);
    }
    for p in &manifest.parameters {
        plan.retention.pin(BlobHash(p.blob));
    }
    Ok(manifest)
}

/// The screen of a run: on the split its corpus withheld, else the public validation split.
fn screener(plan: &mut ShepherdPlan, manifest: &RunManifest) -> screen::Screener {
    let shape = (manifest.data.batch as usize, manifest.data.block as usize);
    let (split, hidden) = match plan.screen_split.take() {
        Some(split) => (split, true),
        None => (plan.corpus.val.clone(), false),
    };
    let t = &plan.trust;
    // the outer step applies a mean equal to the contribution at the outer learning rate
    // (dense); a sparse run's update is re-sparsified at the shepherd: its scale is 1
    let scale = if plan.encoding.sparse().is_some() { 1.0 } else { (plan.experiment.outer_lr as f32).min(1.0) };
    let sharing = (f64::from(t.screen_sample), t.screen_share);
    let committees = super::committees::Committees::new(t.screeners, t.spot_rate);
    screen::Screener::new(plan.screen, (split, hidden), sharing, shape, scale, committees)
}

/// The state machine's settings. A resumed or elected shepherd waits a moment for
/// the last round's `contributors` to come back.
pub(super) fn machine_config(
    plan: &ShepherdPlan,
    params: &Tensors,
    contributors: usize,
) -> anyhow::Result<shepherd::Config> {
    let e = &plan.experiment;
    Ok(shepherd::Config {
        rounds: plan.rounds,
        start_workers: contributors.max(1),
        initial_deadline_ms: 600_000,
        min_deadline_ms: 10_000,
        heartbeat_timeout_ms: plan.heartbeat_timeout_ms,
        outer_lr: e.outer_lr as f32,
        outer_momentum: e.nesterov_momentum as f32,
        trim: plan.trim,
        sparse: plan.encoding.sparse(),
        fragments: fragments::split(&params.iter().map(Vec::len).collect::<Vec<_>>(), plan.fragments as usize)?,
        // claims are checked against the manifest: whole steps of batch × block, at most τ
        sample_unit: {
            let (batch, block) = plan.model.batch_block()?;
            (batch * block) as u64
        },
        max_steps: plan.tau,
        tensor_factor: plan.trust.tensor_bound,
        element_factor: plan.trust.element_clip,
        // ratings come from the screen
        rating: (plan.screen == Screen::Score).then_some(plan.trust.policy),
        aggregate_max: plan.trust.aggregate_max as usize,
        max_participants: plan.trust.max_participants as usize,
        add_threads: plan.aggregation.threads.max(1),
        untrusted: true,
        // copies (a replay from many keys, a scaled copy of the last update) are refused,
        // by sketches under a key of this process's own
        similarity: match plan.copy_check {
            true => pcp_protocol::diloco::sketch::DEFAULT_SIMILARITY,
            false => f64::INFINITY,
        },
        sketch_key: rand::random(),
        // overlapping workers: time-boxed rounds, a deadline after the budget, late
        // contributions carried over (see pcp_protocol::diloco::shepherd)
        // (announcements are gossiped when a round opens: half a second's notice)
        overlap: plan.overlap.then(|| shepherd::Overlap { notice_ms: 500, ..shepherd::Overlap::new(plan.tau) }),
        ..shepherd::Config::default()
    })
}

/// The shepherd's own engine (for validation and screening): a standby's
/// prepared one, else the step compiled for where the plan puts it
/// ([`super::OwnEngine::on`]).
/// None for a shepherd that neither validates nor screens by loss: it runs no model
/// itself (an engine would hold the parameters and optimizer state once more).
pub(super) async fn host_engine(
    plan: &ShepherdPlan,
    prepared: Option<Engine>,
    module: &Arc<pcp_graph::Module>,
    artifacts_dir: &Path,
    manifest: &RunManifest,
    params: Tensors,
    state_per_param: usize,
) -> anyhow::Result<Option<Engine>> {
    if plan.experiment.eval_batches == 0 && plan.screen != Screen::Score {
        return Ok(None);
    }
    if let Some(mut engine) = prepared {
        engine.set_params(params).await.context("loading the inherited parameters")?;
        return Ok(Some(engine));
    }
    let on = plan.engine.on.clone();
    let artifact = {
        let (module, dir, target) = (module.clone(), artifacts_dir.to_path_buf(), on.target.clone());
        tokio::task::spawn_blocking(move || pcp_graph::compile(&module, &target, Some(&dir)))
            .await?
            .with_context(|| format!("compiling the shepherd's own engine for {on}"))?
    };
    let mut engine = Engine::new(
        on.device,
        artifact.vmfb,
        wire::shapes(manifest),
        params,
        None,
        state_per_param,
        manifest.data.int64,
    )
    .await?;
    engine.screens_sparse(wire::manifest_sparse_screen(manifest));
    Ok(Some(engine))
}

/// The consensus a leader starts with: an elected candidate's (it leads already),
/// a new run's creator's (term 1's leader), or a resumed shepherd's (it leads again
/// once the candidates elect it; at once when alone); and what it decided.
fn open_consensus(
    elected: Option<Box<Consensus>>,
    (node, identity, events, data_dir): (&Node, &pcp_protocol::Identity, &Events, &Path),
    start: &Start,
    manifest: &RunManifest,
    store: &BlobStore,
    machine: &Shepherd<PublicKey>,
    (run, succession, term): (RunId, &Succession, u64),
) -> anyhow::Result<(Box<Consensus>, Vec<pcp_protocol::failover::candidate::Action>)> {
    if let Some(c) = elected {
        return Ok((c, Vec::new()));
    }
    let lease_ms = manifest.lease_ms.max(500);
    let mode = super::super::consensus::mode_of(manifest.failover, succession.order().len());
    let state = wire::StateParts::of(machine, term.max(1));
    let blob = wire::put_state(store, &state, &[], &[])?.0.0;
    let held = Replica { term: term.max(1), round: machine.completed(), params: wire::params_hash(machine.params()).0 };
    let seat = Seat { node, identity, events, data_dir, run, succession: succession.clone(), lease_ms, mode };
    if matches!(start, Start::New) {
        let (c, actions) = Consensus::create(seat, (held, blob))?;
        return Ok((Box::new(c), actions));
    }
    let c = Consensus::open(seat, Some((held, blob)))?;
    Ok((Box::new(c), Vec::new()))
}

impl Host {
    pub(in crate::diloco) async fn start(
        mut plan: ShepherdPlan,
        node: Node,
        identity: pcp_protocol::Identity,
        data_dir: &Path,
        events: Events,
        hooks: ShepherdHooks,
        consensus: Option<Box<Consensus>>,
    ) -> anyhow::Result<Self> {
        let store = BlobStore::open(data_dir)?;
        let (step, prepared_engine) = match plan.engine.prepared.take() {
            Some(p) => (p.step, Some(p.engine)),
            None => {
                let config = pcp_graph::StepConfig {
                    sparse_screen: wire::sparse_screen(plan.encoding),
                    ..step_config(&plan.experiment)
                };
                let step = pcp_graph::train_step(&plan.model.module, "main", &config)
                    .map_err(|err| anyhow::anyhow!("{}: {err}", plan.model.source))?;
                (step, None)
            }
        };
        let model_hash = *blake3::hash(plan.model.module.to_mlir().as_bytes()).as_bytes();
        let me = identity.public();
        let Origin { run, params, snapshot, contributors, returning, salt, creator, candidates, term, inherited } =
            Origin::of(&plan, me, &model_hash)?;
        let identity_of_run = (run, creator, &candidates[..], salt);
        let manifest = run_manifest(&store, &mut plan, &step, &params, identity_of_run, (inherited, me))?;
        let succession = Succession::new(run, creator, &candidates);
        let config = machine_config(&plan, &params, contributors)?;
        let machine = match snapshot {
            Some(s) => Shepherd::resume(config, s),
            None => Shepherd::new(config, params.clone()),
        };
        let lease_ms = manifest.lease_ms.max(500);
        let io = (&node, &identity, &events, data_dir);
        let (consensus, pending_consensus) =
            open_consensus(consensus, io, &plan.start, &manifest, &store, &machine, (run, &succession, term))?;
        let layout = super::layout::Layout::of(&manifest)?;
        // contributions are read only from workers that joined, and only up to this size
        node.admission().serve(run, compress::encoded_len(&layout.sizes, plan.encoding) + CONTRIBUTION_OVERHEAD);
        if plan.overlap {
            // a contribution that arrives after its round closed is carried into the next
            node.admission().carry(run);
        }

        // the host's own artifact, for validation
        // PCP_ARTIFACT_CACHE lets tests and sims share compiled artifacts
        let artifacts_dir = std::env::var_os("PCP_ARTIFACT_CACHE")
            .map(PathBuf::from)
            .or_else(|| plan.artifacts_dir.clone())
            .unwrap_or_else(|| data_dir.join("artifacts"));
        let whole_step_bytes = crate::training::memory::step_bytes(&step);
        let module = Arc::new(step.module);
        let engine =
            host_engine(&plan, prepared_engine, &module, &artifacts_dir, &manifest, params, step.state_per_param)
                .await?;
        let screener = screener(&mut plan, &manifest);

        // providing is a DHT query that can take seconds (a dead leader is still in
        // routing tables): it runs beside the main loop, so an elected candidate leads at once
        let mut background = JoinSet::new();
        for key in [wire::runs_key(), wire::run_key(run)] {
            let node = node.clone();
            background.spawn(async move {
                if let Err(e) = node.provide(key).await {
                    tracing::warn!("providing {key}: {e}");
                }
            });
        }
        node.subscribe(run).await?;
        let resumed_at = machine.completed();
        let min_quorum = machine.config().min_quorum;
        let keeper = LeaseKeeper::spawn(node.clone(), Signer::new(identity.clone()), run, &succession, lease_ms);
        // three leases, and never less than the time a silent worker is dropped after
        let quorum = Quorum::new((CHECK_QUORUM_LEASES * lease_ms).max(plan.heartbeat_timeout_ms), wire::mono_ms())
            .needing(min_quorum);
        let mut host = Self {
            node,
            store,
            signer: Signer::new(identity),
            run,
            manifest,
            machine,
            events,
            artifacts: super::compile::Artifacts::new(module, artifacts_dir, whole_step_bytes),
            hellos: super::hellos::Hellos::new(returning),
            published: None,
            lead: super::leadership::Leadership::new(consensus, pending_consensus, (quorum, keeper), term),
            book: super::book::RoundBook::new(),
            layout,
            engine,
            screener,
            hooks,
            out: std::io::stdout(),
            plan,
            background,
            aggregation: Default::default(),
        };
        host.started(resumed_at).await?;
        Ok(host)
    }

    /// Says the run started (and, resumed or elected, from where), publishes the
    /// state and releases blobs of rounds before it.
    pub(super) async fn started(&mut self, resumed_at: u64) -> anyhow::Result<()> {
        let run = self.run;
        // the dashboard, when it is up, owns stdout and shows the rounds itself
        self.plan.table &= !crate::observe::tui::owns_stdout();
        self.publish_state(&[], &[], wire::params_hash(self.machine.params()))?;
        // the state is the next round's, which its announcement names
        let state = self.lead.state.as_ref().map(|s| BlobHash(s.blob));
        self.plan.retention.advance(&self.node, &self.events, resumed_at + 1, state).await;
        let params_hash = wire::params_hash(self.machine.params());
        self.events.emit(ev::Event::RunStarted(ev::RunStarted {
            run: run.to_hex(),
            model: self.plan.model.source.clone(),
            rounds: self.plan.rounds,
            tau: self.plan.tau,
            resumed_round: resumed_at,
            params_hash: params_hash.to_hex(),
            encoding: self.plan.encoding.name().to_owned(),
            encoding_spec: self.plan.encoding.spec(),
            overlap: self.plan.overlap,
            precision: self.manifest.precision.clone(),
            recompute: self.manifest.recompute.clone(),
            failover: self.lead.consensus.core().mode().name().to_owned(),
            candidates: self.lead.consensus.core().succession().order().len() as u64,
            engine: self.engine.as_ref().map_or_else(String::new, |_| self.plan.engine.on.to_string()),
        }));
        if matches!(self.plan.start, Start::Resume(_)) {
            self.events.emit(ev::Event::Resumed(ev::Resumed { round: resumed_at, params_hash: params_hash.to_hex() }));
        }
        self.print_header(resumed_at)?;
        if let Start::Succeed { term, state, .. } = &self.plan.start {
            let term = *term;
            // the quorum it must keep: the workers of the round it inherits
            self.lead.quorum.round_completed(&state.contributors, wire::mono_ms());
            self.events.emit(ev::Event::ShepherdElected(ev::ShepherdElected {
                term,
                peer: peer_name(&self.lead.consensus.me()),
                round: resumed_at,
                params_hash: params_hash.to_hex(),
            }));
            let lapsed = self.lead.consensus.core().succession().leader(term.saturating_sub(1));
            self.table_line(&format!("term {}: the lease of {} expired", term - 1, peer_name(&lapsed)))?;
            self.table_line(&format!(
                "term {term}: {} elected; resumes after round {resumed_at} from parameters {params_hash}",
                peer_name(&self.lead.consensus.me())
            ))?;
        }
        Ok(())
    }
}
