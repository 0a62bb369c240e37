//! Artifacts per (backend, target, split): a worker's hello asks for one, the
//! shepherd compiles it beside its loop (a bounded number at once) and answers
//! with the manifest, that artifact first.
//!
//! A worker whose hello reports too little free memory for the run's batch gets a
//! step that accumulates gradients over micro-batches (and, if not even one
//! sequence fits, recomputes more activations): planned from the step's
//! [`Footprint`](crate::training::memory::Footprint), which the shepherd measures
//! once for a built-in model. An imported model's batch is fixed in its module:
//! its workers all get the whole-batch step.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::Arc;

use pcp_bootstrap::InboundId;
use pcp_protocol::{BlobHash, PublicKey};
use pcp_schema::{AckCode, ArtifactRef, NodeHello, SignedEnvelope};
use tokio::task::JoinSet;

use crate::diloco::Refusal;
use crate::diloco::wire::peer_name;
use crate::observe::events as ev;
use crate::training::config::step_config;
use crate::training::memory::Footprint;
use crate::training::model::Model;

use super::Host;

/// What distinguishes one artifact of a run from another: the backend, the
/// target, the micro-batches per batch and the recomputation.
pub(super) type ArtifactKey = (String, String, u32, &'static str);

/// Compiles in progress at once; more hellos for new targets are asked to retry.
const MAX_COMPILES: usize = 2;
/// Distinct (backend, target) artifacts a run serves.
const MAX_ARTIFACTS: usize = 32;

/// A compile in progress for one (backend, target), and who waits for it.
#[derive(Debug)]
pub(super) struct Compiling {
    waiters: Vec<(InboundId, PublicKey)>,
}

/// A finished compile: its artifact's key, and its blob, size and expected peak.
pub(super) type CompileResult = (ArtifactKey, Result<(BlobHash, u64, u64), String>);

/// The run's step and what the shepherd compiled of it: an artifact per worker
/// target, the compiles in progress, and the memory plan that splits a step.
pub(super) struct Artifacts {
    /// The training step every artifact is compiled from.
    pub(super) module: Arc<pcp_graph::Module>,
    /// Where compiled artifacts are kept.
    pub(super) dir: PathBuf,
    /// The artifacts compiled, each published as a blob.
    pub(super) built: BTreeMap<ArtifactKey, ArtifactRef>,
    pub(super) compiling: HashMap<ArtifactKey, Compiling>,
    /// The run's step's expected peak on the whole batch: a worker with this much
    /// free (and a tenth more) gets that step without further planning.
    pub(super) whole_step_bytes: u64,
    /// A built-in model's step memory at each split, which plans the step of a
    /// worker with less from its hello's free memory; measured for the first such
    /// worker.
    pub(super) footprint: Option<Footprint>,
    pub(super) compiles: JoinSet<CompileResult>,
}

impl Artifacts {
    /// Nothing compiled yet of `module`, whose whole-batch step peaks at
    /// `whole_step_bytes`; artifacts go to `dir`.
    pub(super) fn new(module: Arc<pcp_graph::Module>, dir: PathBuf, whole_step_bytes: u64) -> Self {
        Self {
            module,
            dir,
            built: BTreeMap::new(),
            compiling: HashMap::new(),
            whole_step_bytes,
            footprint: None,
            compiles: JoinSet::new(),
        }
    }
}

/// The step a worker with `free` bytes (0: unknown) runs: micro-batches per
/// batch, its recomputation, and the expected peak (0: not planned).
/// The device memory a worker reporting `free` bytes (0: unknown) has for its
/// step in a run of `params` parameters: under committees a screener keeps the
/// round's parameters on its device while it screens, and uploads a
/// contribution dense at worst, so two copies of them are not the step's.
fn step_room(free: u64, params: u64, committees: bool) -> u64 {
    if free == 0 || !committees {
        return free;
    }
    free.saturating_sub(2 * 4 * params).max(1)
}

fn split_for(footprint: Option<&Footprint>, free: u64, run: pcp_graph::Recompute) -> (u32, pcp_graph::Recompute, u64) {
    match footprint {
        Some(f) if free > 0 => {
            let (split, mode) = f.plan(free);
            (u32::try_from(split.micro_batches).unwrap_or(1), mode, split.estimate_bytes)
        }
        _ => (1, run, 0),
    }
}

impl Host {
    pub(super) async fn on_hello(&mut self, id: InboundId, key: PublicKey, hello: NodeHello) -> anyhow::Result<()> {
        if hello.peer != key.0 {
            return self.refuse(id, 0, "the hello names another peer than its signer").await;
        }
        let Some(backend) = hello.capabilities.backends.first() else {
            return self.refuse(id, 0, "the hello lists no backend").await;
        };
        let name = backend.name.clone();
        let target = backend.targets.first().cloned().unwrap_or_default();
        let shown = if target.is_empty() { name.clone() } else { format!("{name}:{target}") };
        // who may join (`--admit`, the cap per address): checked again at every contribution
        if let Err(reason) = self.admit_hello(key, (hello.certificate.clone(), hello.pow_nonce), shown) {
            tracing::info!(peer = %peer_name(&key), "hello refused: {reason}");
            return self.refuse(id, 0, reason).await;
        }
        if hello.capabilities.aggregate {
            let workers: std::collections::BTreeSet<[u8; 32]> = self.machine.workers().map(|w| w.0).collect();
            self.aggregation.volunteered(key, |k| workers.contains(k));
        }
        let run_mode = step_config(&self.plan.experiment).recompute;
        let params: u64 = self.layout.sizes.iter().map(|n| *n as u64).sum();
        let free = step_room(hello.capabilities.free_memory_bytes, params, self.screener.by_committees());
        // a device with room for the whole batch (or that did not say) needs no planning
        let short = free > 0 && free - free / 10 < self.artifacts.whole_step_bytes;
        let footprint = if short { self.footprint().await } else { None };
        let (micro_batches, recompute, estimate) = split_for(footprint, free, run_mode);
        self.node.admission().know(self.run, key);
        let entry: ArtifactKey = (name.clone(), target.clone(), micro_batches, recompute.name());
        if let Some(artifact) = self.artifacts.built.get(&entry).cloned() {
            let envelope = self.manifest_for(artifact);
            return self.respond(id, envelope).await;
        }
        let parsed: Result<pcp_graph::Backend, _> = name.parse();
        let backend = match parsed {
            Ok(b) => b,
            Err(e) => return self.refuse(id, 0, Refusal::new(AckCode::NoArtifact, e.to_string())).await,
        };
        // a target name the compiler does not know is refused with the accepted names
        let compile_target = match pcp_graph::Target::parse(backend, Some(&target)) {
            Ok(t) => t,
            Err(e) => {
                let reason = format!("the shepherd cannot compile for {name}: {e}");
                return self.refuse(id, 0, Refusal::new(AckCode::NoArtifact, reason)).await;
            }
        };
        if let Some(c) = self.artifacts.compiling.get_mut(&entry) {
            c.waiters.push((id, key));
            return Ok(());
        }
        if self.artifacts.compiling.len() >= MAX_COMPILES {
            return self.refuse(id, 0, "the shepherd is busy compiling for other targets; try again").await;
        }
        if self.artifacts.built.len() + self.artifacts.compiling.len() >= MAX_ARTIFACTS {
            return self.refuse(id, 0, format!("this run serves at most {MAX_ARTIFACTS} targets")).await;
        }
        self.artifacts.compiling.insert(entry.clone(), Compiling { waiters: vec![(id, key)] });
        // the run's own step, or one built for this worker's split
        let variant = (micro_batches > 1 || recompute != run_mode).then(|| {
            let batch = self.manifest.data.batch as usize;
            let config = pcp_graph::StepConfig {
                accumulate: micro_batches > 1,
                recompute,
                sparse_screen: crate::diloco::wire::sparse_screen(self.plan.encoding),
                ..step_config(&self.plan.experiment)
            };
            (
                self.plan.model.source.clone(),
                self.plan.experiment.vocab(self.plan.corpus.vocab.size()),
                batch / micro_batches.max(1) as usize,
                config,
            )
        });
        let module = self.artifacts.module.clone();
        let dir = self.artifacts.dir.clone();
        let store = self.store.clone();
        if micro_batches > 1 || recompute != run_mode {
            tracing::info!(
                "compiling the step for {compile_target} as {micro_batches} micro-batches, recompute {recompute} \
                 ({:.2} GB free, about {:.2} GB needed)",
                free as f64 / 1e9,
                estimate as f64 / 1e9
            );
        } else {
            tracing::info!("compiling train_step for {compile_target}");
        }
        self.events
            .emit(ev::Event::CompileStarted(ev::CompileStarted { backend: name.clone(), target: target.clone() }));
        self.artifacts.compiles.spawn_blocking(move || {
            let built = match variant {
                None => Ok(module),
                Some((source, vocab, micro, config)) => Model::load_with_batch(&source, vocab, Some(micro))
                    .and_then(|m| {
                        pcp_graph::train_step(&m.module, "main", &config).map_err(|e| anyhow::anyhow!("{source}: {e}"))
                    })
                    .map(|step| Arc::new(step.module))
                    .map_err(|e| anyhow::anyhow!("building the micro-batch step: {e}")),
            };
            let result = built.map_err(|e| e.to_string()).and_then(|module| {
                pcp_graph::compile(&module, &compile_target, Some(&dir)).map_err(|e| e.to_string()).and_then(|a| {
                    let hash = store.put_bytes(&a.vmfb).map_err(|e| e.to_string())?;
                    Ok((hash, a.vmfb.len() as u64, estimate))
                })
            });
            (entry, result)
        });
        Ok(())
    }

    /// The step's [`Footprint`], measured on first use (a few dozen step builds
    /// without compiling: 0.5 s for gpt2-124m); `None` for an imported model, whose
    /// batch is fixed in its module.
    async fn footprint(&mut self) -> Option<&Footprint> {
        if self.artifacts.footprint.is_none() && pcp_graph::models::preset(&self.plan.model.source).is_some() {
            let (batch, config) = (self.manifest.data.batch as usize, step_config(&self.plan.experiment));
            let (source, vocab) =
                (self.plan.model.source.clone(), self.plan.experiment.vocab(self.plan.corpus.vocab.size()));
            let measured = tokio::task::spawn_blocking(move || {
                Footprint::measure(batch, config.recompute, |mode, m| {
                    crate::training::memory::preset_step_bytes(&source, vocab, &config, mode, m)
                })
            })
            .await;
            match measured {
                Ok(f) => self.artifacts.footprint = Some(f),
                Err(e) => tracing::warn!("measuring the step's memory: {e}; workers get whole batches"),
            }
        }
        self.artifacts.footprint.as_ref()
    }

    pub(super) async fn on_compiled(&mut self, (entry, result): CompileResult) -> anyhow::Result<()> {
        let waiters = self.artifacts.compiling.remove(&entry).map(|c| c.waiters).unwrap_or_default();
        let (name, target, micro_batches, recompute) = entry.clone();
        match result {
            Ok((hash, size, estimate_bytes)) => {
                let artifact = ArtifactRef {
                    backend: name.clone(),
                    target: target.clone(),
                    blob: hash.0,
                    size,
                    micro_batches,
                    recompute: recompute.to_owned(),
                    estimate_bytes,
                };
                self.artifacts.built.insert(entry, artifact.clone());
                self.plan.retention.pin(hash);
                self.manifest.artifacts = self.artifacts.built.values().cloned().collect();
                self.events.emit(ev::Event::ArtifactPublished(ev::ArtifactPublished {
                    backend: name.clone(),
                    target: target.clone(),
                    hash: hash.to_hex(),
                    bytes: size,
                }));
                if let Err(e) = self.node.provide(hash).await {
                    tracing::warn!("providing artifact {hash}: {e}");
                }
                for (id, _) in waiters {
                    let envelope = self.manifest_for(artifact.clone());
                    self.respond(id, envelope).await?;
                }
            }
            Err(reason) => {
                let shown = if target.is_empty() { name.clone() } else { format!("{name}:{target}") };
                let reason = format!("the shepherd cannot compile for {shown}: {reason}");
                self.events.emit(ev::Event::CompileFailed(ev::CompileFailed {
                    backend: name.clone(),
                    target: target.clone(),
                    reason: reason.clone(),
                }));
                for (id, _) in waiters {
                    self.refuse(id, 0, Refusal::new(AckCode::NoArtifact, reason.clone())).await?;
                }
            }
        }
        Ok(())
    }

    /// The signed manifest with `artifact` first (the one the asker needs).
    pub(super) fn manifest_for(&mut self, artifact: ArtifactRef) -> SignedEnvelope {
        let mut manifest = self.manifest.clone();
        manifest.artifacts.retain(|a| a != &artifact);
        manifest.artifacts.insert(0, artifact);
        self.signer.seal(self.run, self.machine.completed(), &manifest)
    }
}

#[cfg(test)]
mod tests {
    use pcp_graph::Recompute;

    use super::*;
    use crate::training::config::Experiment;
    use crate::training::memory::preset_step_bytes;

    /// A screener's two copies of the parameters are not its step's room; a
    /// worker that did not say stays unplanned.
    #[test]
    fn a_screeners_copies_of_the_parameters_are_not_its_steps_room() {
        assert_eq!(step_room(8_000_000_000, 124_439_808, true), 8_000_000_000 - 995_518_464);
        assert_eq!(step_room(8_000_000_000, 124_439_808, false), 8_000_000_000);
        assert_eq!(step_room(0, 124_439_808, true), 0, "unknown stays unknown");
        assert_eq!(step_room(1_000, 124_439_808, true), 1, "short of everything, still known");
    }

    /// A worker with 8 GB free joins a gpt2-124m run at batch 8.
    #[test]
    fn a_gpt2_worker_with_8_gb_gets_micro_batches_and_an_unknown_one_the_whole_batch() {
        let config = step_config(&Experiment::default());
        let footprint =
            Footprint::measure(8, Recompute::None, |mode, m| preset_step_bytes("gpt2-124m", 65, &config, mode, m));
        // keeping every activation (9.1 GB at batch 8 with fused attention), 4 of 2
        let (k, mode, estimate) = split_for(Some(&footprint), 8_000_000_000, Recompute::None);
        assert_eq!((k, mode), (4, Recompute::None));
        assert!(estimate > 3_000_000_000 && estimate <= 7_200_000_000, "{estimate}");
        // a roomy device, one that did not say, and an imported model: the run's step
        assert_eq!(split_for(Some(&footprint), 80_000_000_000, Recompute::None).0, 1);
        assert_eq!(split_for(Some(&footprint), 0, Recompute::None), (1, Recompute::None, 0));
        assert_eq!(split_for(None, 8_000_000_000, Recompute::None), (1, Recompute::None, 0));
        // the default, elementwise: the whole batch fits (3.0 GB kept)
        let run = config.recompute;
        assert_eq!(run, Recompute::Elementwise);
        let footprint = Footprint::measure(8, run, |mode, m| preset_step_bytes("gpt2-124m", 65, &config, mode, m));
        let (k, mode, estimate) = split_for(Some(&footprint), 8_000_000_000, run);
        assert_eq!((k, mode), (1, Recompute::Elementwise));
        assert!(estimate <= 7_200_000_000, "{estimate}");
        // 4 GB: split, and still elementwise
        let (k, mode, _) = split_for(Some(&footprint), 4_000_000_000, run);
        assert!(k > 1 && mode == Recompute::Elementwise, "{k} {mode}");
    }
}
