//! `pcp-node train`: single-node training with a fused, device-resident step.

use std::io::{IsTerminal as _, Write as _};
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::Context as _;
use pcp_runtime::Device;
use serde_json::json;

use crate::Failure;
use crate::commands::join::NetArgs;
use crate::observe::events::{self as ev, Events};
use crate::training::checkpoint::{Checkpoint, Tensor};
use crate::training::config::Experiment;
pub(crate) use crate::training::config::step_config;
pub(crate) use crate::training::data::{Corpus, default_corpus};
use crate::training::data::{Sampler, SamplerState};
use crate::training::engine::Engine;
use crate::training::model::Model;
pub(crate) use crate::training::schedule::{learning_rate, validation_loss};

/// Flags shared by `train`, `bench` and `generate` for where to run.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct DeviceArgs {
    /// cpu, cuda, rocm, vulkan or metal.
    #[arg(long, default_value = "cpu")]
    pub(crate) backend: String,
    /// The device target: an LLVM CPU name, sm_XX, gfx9XX…
    #[arg(long)]
    pub(crate) target: Option<String>,
}

impl DeviceArgs {
    pub(crate) fn resolve(&self) -> anyhow::Result<(Device, pcp_graph::Target)> {
        crate::commands::devices::resolve(&self.backend, self.target.as_deref())
    }
}

#[derive(Debug, clap::Args)]
pub(crate) struct TrainArgs {
    /// An experiment file (PCP's keys and pcp's own); flags override it.
    #[arg(long)]
    config: Option<PathBuf>,
    /// nanogpt-small, nanogpt-medium, or a StableHLO loss module (.mlir).
    #[arg(long)]
    model: Option<String>,
    /// The corpus: text, or u16 token .bin (nanoGPT or llm.c).
    #[arg(long)]
    data: Option<PathBuf>,
    /// Optimizer steps.
    #[arg(long)]
    steps: Option<u64>,
    /// Peak learning rate.
    #[arg(long)]
    lr: Option<f64>,
    /// Seed for initialisation and data order.
    #[arg(long)]
    seed: Option<u64>,
    /// Sequences per batch (presets only) [default: the preset's].
    #[arg(long)]
    batch: Option<usize>,
    /// char, byte or u16.
    #[arg(long)]
    tokenizer: Option<String>,
    /// Evaluate every N steps (0: only at the end).
    #[arg(long)]
    eval_every: Option<u64>,
    /// Checkpoint every N steps (0: only at the end).
    #[arg(long)]
    checkpoint_every: Option<u64>,
    /// Where checkpoints go [default: <data-dir>/checkpoints].
    #[arg(long)]
    checkpoint_dir: Option<PathBuf>,
    /// Continue from the newest checkpoint in the checkpoint directory.
    #[arg(long)]
    resume: bool,
    /// f32, or bf16: matmuls and attention in bf16, weights, AdamW state and loss in f32
    /// [default: f32, or the config's or resumed checkpoint's].
    #[arg(long)]
    precision: Option<String>,
    /// Activations the backward recomputes instead of keeping: none, attention (the
    /// T×T scores and softmax), elementwise (attention and all but the matmuls'
    /// outputs; the default) or blocks (all but the residual stream); the same losses, less memory [default: elementwise, or the config's or resumed checkpoint's].
    #[arg(long)]
    recompute: Option<String>,
    /// fused (one op per attention: causal blocks skipped, only the output and the rows'
    /// log-sum-exp kept, the probabilities recomputed in the backward) or naive (the
    /// model's own ops, the T×T probabilities kept) [default: fused, or the config's].
    #[arg(long)]
    attention: Option<String>,
    #[command(flatten)]
    memory: MemoryArgs,
    #[command(flatten)]
    device: DeviceArgs,
}

/// Flags for how much memory a step may use.
#[derive(Debug, Clone, Default, clap::Args)]
pub(crate) struct MemoryArgs {
    /// The device memory a step may use (e.g. 8GB) [default: on cpu, the host's
    /// available memory; on cuda and rocm, the GPU's free memory as nvidia-smi or
    /// rocm-smi reports it]. A batch whose step would not
    /// fit runs as micro-batches whose gradients are accumulated.
    #[arg(long, value_name = "SIZE", value_parser = crate::training::memory::parse_size)]
    pub(crate) free_memory: Option<u64>,
    /// Sequences per micro-batch, a divisor of the batch: the step runs the batch
    /// as micro-batches of this many sequences and accumulates their gradients
    /// [default: the whole batch, or what fits the memory and, on cpu, the cache].
    #[arg(long, value_name = "SEQUENCES", value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) micro_batch: Option<u64>,
}

/// Everything a run needs: the compiled step on a device and its data.
pub(crate) struct Run {
    pub(crate) experiment: Experiment,
    pub(crate) model: Model,
    pub(crate) corpus: Corpus,
    pub(crate) engine: Engine,
    pub(crate) batch: usize,
    pub(crate) block: usize,
    /// How the batch is split to fit the device.
    pub(crate) micro_batches: ev::MicroBatches,
}

impl std::fmt::Debug for Run {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Run")
            .field("model", &self.model.source)
            .field("batch", &self.batch)
            .field("block", &self.block)
            .finish()
    }
}

/// How many micro-batches a step of `experiment`'s batch needs to fit the memory
/// `memory` allows on `device` (1 for a `.mlir` model, whose batch is fixed).
pub(crate) fn plan_micro_batches(
    experiment: &Experiment,
    model: &Model,
    vocab_size: usize,
    memory: &MemoryArgs,
    device: &DeviceArgs,
) -> anyhow::Result<ev::MicroBatches> {
    let (batch, _) = model.batch_block()?;
    let (free, free_from) = match (memory.free_memory, device.backend.parse::<pcp_runtime::Device>()) {
        (Some(bytes), _) => (Some(bytes), "flag"),
        (None, Ok(d)) => crate::training::memory::device_free(d),
        (None, Err(_)) => (None, "unknown"),
    };
    let preset = pcp_graph::models::preset(&model.source).is_some();
    let config = pcp_graph::StepConfig { accumulate: false, ..step_config(experiment) };
    let estimate = |mode, m| crate::training::memory::preset_step_bytes(&model.source, vocab_size, &config, mode, m);
    let (mut split, recompute) = match free {
        // the run's recomputation first; if not even single sequences fit, stronger ones
        Some(free) if preset => crate::training::memory::plan(batch, free, config.recompute, estimate),
        _ => {
            let bytes = pcp_graph::train_step(&model.module, "main", &config)
                .map_or(0, |s| crate::training::memory::step_bytes(&s));
            (crate::training::memory::Split::whole(batch, bytes), config.recompute)
        }
    };
    let mut cache_bytes = 0;
    let on_cpu = matches!(device.backend.parse::<pcp_runtime::Device>(), Ok(pcp_runtime::Device::Cpu));
    if let Some(m) = memory.micro_batch {
        let m = m as usize;
        anyhow::ensure!(
            m <= batch && batch.is_multiple_of(m),
            "--micro-batch {m} does not divide the batch of {batch} sequences"
        );
        let estimate_bytes = if preset { estimate(recompute, m) } else { split.estimate_bytes };
        let over = free.is_some_and(|f| estimate_bytes > f);
        split = crate::training::memory::Split { micro_batches: batch / m, estimate_bytes, over, ..split };
    }
    // on the cpu, a batch that spills the cache runs as micro-batches that stay in it
    else if let (true, Some(cache), Some(c)) =
        (on_cpu, crate::training::memory::CpuCache::host(), pcp_graph::models::preset(&model.source))
    {
        let (_, block) = model.batch_block()?;
        let widest = (4 * c.n_embd).max(vocab_size) as u64;
        let sequence_bytes = block as u64 * widest * 4;
        if let Some(m) = crate::training::memory::cache_micro_batch(batch, sequence_bytes, cache)
            && m < batch / split.micro_batches
        {
            let estimate_bytes = estimate(recompute, m);
            split = crate::training::memory::Split { micro_batches: batch / m, estimate_bytes, ..split };
            cache_bytes = cache.l2;
        }
    }
    if split.over {
        tracing::warn!(
            "a step of {} sequences may not fit in {:.1} GB even as {} micro-batches (about {:.1} GB each)",
            batch,
            free.unwrap_or(0) as f64 / 1e9,
            split.micro_batches,
            split.estimate_bytes as f64 / 1e9
        );
    }
    Ok(ev::MicroBatches {
        recompute: recompute.name().to_owned(),
        batch: batch as u64,
        micro_batches: split.micro_batches as u64,
        micro_batch: (batch / split.micro_batches) as u64,
        free_bytes: free.unwrap_or(0),
        free_from: free_from.to_owned(),
        estimate_bytes: split.estimate_bytes,
        cache_bytes,
    })
}

/// Builds and compiles `model`'s training step (cached under `cache`) and
/// loads it on the device with fresh parameters or `checkpoint`'s. With
/// `micro_batches` above 1, `model` takes one micro-batch and the engine
/// accumulates that many per step.
pub(crate) async fn load_engine(
    experiment: &Experiment,
    model: &Model,
    device: &DeviceArgs,
    cache: &Path,
    checkpoint: Option<&Checkpoint>,
    micro_batches: usize,
) -> anyhow::Result<Engine> {
    load_screening_engine(experiment, model, device, cache, checkpoint, (micro_batches, None)).await
}

/// [`load_engine`], its module also with `eval_sparse` for `sparse_screen`.
pub(crate) async fn load_screening_engine(
    experiment: &Experiment,
    model: &Model,
    device: &DeviceArgs,
    cache: &Path,
    checkpoint: Option<&Checkpoint>,
    (micro_batches, sparse_screen): (usize, Option<pcp_graph::SparseScreen>),
) -> anyhow::Result<Engine> {
    let int64 = model.data.first().is_some_and(|t| t.element.name() == "i64");
    let config = pcp_graph::StepConfig { accumulate: micro_batches > 1, sparse_screen, ..step_config(experiment) };
    let step =
        pcp_graph::train_step(&model.module, "main", &config).map_err(|e| anyhow::anyhow!("{}: {e}", model.source))?;
    let (device_kind, target) = device.resolve()?;
    let started = Instant::now();
    let spinner = crate::observe::progress::spinner(format!("compiling the training step for {target}"));
    let artifact = pcp_graph::compile(&step.module, &target, Some(&cache.join("artifacts")));
    spinner.finish_and_clear();
    let artifact = artifact?;
    tracing::info!(
        cached = artifact.cached,
        seconds = started.elapsed().as_secs_f64(),
        "compiled train_step for {target}"
    );
    let shapes: Vec<Vec<usize>> =
        model.params.iter().map(|p| p.ty.shape.iter().map(|d| *d as usize).collect()).collect();
    let (params, state) = match checkpoint {
        Some(c) => {
            let params =
                model.params.iter().map(|p| Ok(c.tensor(&p.name)?.data.clone())).collect::<anyhow::Result<Vec<_>>>()?;
            // a DiLoCo shepherd's checkpoint has parameters but no AdamW state
            let has_state = model.params.iter().all(|p| c.tensor(&format!("m.{}", p.name)).is_ok());
            let mut state = Vec::new();
            for prefix in ["m", "v"].into_iter().filter(|_| has_state) {
                for p in &model.params {
                    state.push(c.tensor(&format!("{prefix}.{}", p.name))?.data.clone());
                }
            }
            (params, has_state.then_some(state))
        }
        None => (model.init(experiment.seed), None),
    };
    let mut engine =
        Engine::new(device_kind, artifact.vmfb, shapes, params, state, step.state_per_param, int64).await?;
    engine.accumulate(micro_batches).await?;
    engine.screens_sparse(sparse_screen);
    Ok(engine)
}

impl Run {
    /// Builds and compiles the step for `model` and loads it on the device,
    /// with fresh parameters or those of `checkpoint`.
    pub(crate) async fn prepare(
        mut experiment: Experiment,
        corpus: Corpus,
        (device, memory): (&DeviceArgs, &MemoryArgs),
        cache: &Path,
        checkpoint: Option<&Checkpoint>,
    ) -> anyhow::Result<Self> {
        let source = experiment.model.clone().unwrap_or_else(|| "nanogpt-small".to_owned());
        let vocab = experiment.vocab(corpus.vocab.size());
        let mut model = Model::load_with_batch(&source, vocab, experiment.batch_size)?;
        let (batch, block) = model.batch_block()?;
        let micro_batches = plan_micro_batches(&experiment, &model, vocab, memory, device)?;
        // a device too small for the run's recomputation gets a stronger one
        experiment.recompute = micro_batches.recompute.clone();
        let k = micro_batches.micro_batches as usize;
        if k > 1 {
            model = Model::load_with_batch(&source, vocab, Some(batch / k))?;
        }
        let engine = load_engine(&experiment, &model, device, cache, checkpoint, k).await?;
        Ok(Self { experiment, model, corpus, engine, batch, block, micro_batches })
    }

    /// Mean loss over `batches` fixed validation batches.
    pub(crate) async fn validate(&self, batches: u64) -> anyhow::Result<f64> {
        validation_loss(&self.engine, &self.corpus.val, (self.batch, self.block), self.experiment.seed, batches).await
    }

    /// A checkpoint of the current state.
    pub(crate) async fn checkpoint(&self, step: u64, sampler: &SamplerState) -> anyhow::Result<Checkpoint> {
        let params = self.engine.params().await?;
        let state = self.engine.state().await?;
        let mut tensors = Vec::new();
        let n = self.model.params.len();
        for (i, p) in self.model.params.iter().enumerate() {
            let shape: Vec<usize> = p.ty.shape.iter().map(|d| *d as usize).collect();
            tensors.push(Tensor { name: p.name.clone(), shape: shape.clone(), data: params[i].clone() });
            tensors.push(Tensor { name: format!("m.{}", p.name), shape: shape.clone(), data: state[i].clone() });
            tensors.push(Tensor { name: format!("v.{}", p.name), shape, data: state[n + i].clone() });
        }
        Ok(Checkpoint {
            step,
            meta: json!({
                "model": self.model.source,
                "experiment": self.experiment,
                "vocab": self.corpus.vocab,
                "sampler": sampler,
            }),
            tensors,
        })
    }
}

/// Trains; `net` supplies the data directory and the events file.
/// The experiment `train` runs: the checkpoint's (resumed), the config file's or
/// the defaults, with the flags on top; and its corpus path.
fn resolve_experiment(args: &TrainArgs, resumed: Option<&Checkpoint>) -> Result<(Experiment, PathBuf), Failure> {
    let mut experiment = match (resumed, &args.config) {
        (Some(c), _) => serde_json::from_value(c.meta["experiment"].clone()).context("checkpoint has no experiment")?,
        (None, Some(path)) => Experiment::load_warned(path).map_err(Failure::input)?,
        (None, None) => Experiment::default(),
    };
    experiment.override_with(args.model.as_ref(), args.data.as_ref(), args.lr, args.seed);
    experiment.steps = args.steps.unwrap_or(experiment.steps);
    experiment.batch_size = args.batch.or(experiment.batch_size);
    experiment.eval_interval = args.eval_every.unwrap_or(experiment.eval_interval);
    experiment.checkpoint_interval = args.checkpoint_every.unwrap_or(experiment.checkpoint_interval);
    if let Some(t) = &args.tokenizer {
        experiment.tokenizer = t.clone();
    }
    experiment.set_precision(args.precision.as_deref()).map_err(Failure::input)?;
    experiment.set_recompute(args.recompute.as_deref()).map_err(Failure::input)?;
    experiment.set_attention(args.attention.as_deref()).map_err(Failure::input)?;
    if experiment.dtype != "f32" {
        return Err(Failure::input(anyhow::anyhow!(
            "dtype {:?} is not supported; pcp trains in f32",
            experiment.dtype
        )));
    }
    let data_path = match &experiment.data_path {
        Some(p) => PathBuf::from(p),
        None => default_corpus().ok_or_else(|| {
            Failure::input(anyhow::anyhow!("no --data given and no demo corpus found; run scripts/setup.sh"))
        })?,
    };
    experiment.data_path = Some(data_path.display().to_string());
    Ok((experiment, data_path))
}

/// The line saying how a step's batch is split, if it is.
fn write_split(out: &mut impl std::io::Write, m: &ev::MicroBatches) -> std::io::Result<()> {
    if m.cache_bytes > 0 {
        writeln!(
            out,
            "{} micro-batches of {} sequences per step, recompute {}, to keep each in the cpu's {} KiB of L2: about {:.1} GB each",
            m.micro_batches,
            m.micro_batch,
            m.recompute,
            m.cache_bytes >> 10,
            m.estimate_bytes as f64 / 1e9
        )?;
    } else if m.micro_batches > 1 {
        writeln!(
            out,
            "{} micro-batches of {} sequences per step, recompute {}, to fit {:.1} GB ({}): about {:.1} GB each",
            m.micro_batches,
            m.micro_batch,
            m.recompute,
            m.free_bytes as f64 / 1e9,
            m.free_from,
            m.estimate_bytes as f64 / 1e9
        )?;
    }
    Ok(())
}

pub(crate) async fn run(args: TrainArgs, net: &NetArgs) -> Result<(), Failure> {
    let _metrics = crate::observe::metrics::serve(net.metrics).await.map_err(Failure::input)?;
    let data_dir = net.data_dir.clone();
    let checkpoint_dir = args.checkpoint_dir.clone().unwrap_or_else(|| data_dir.join("checkpoints"));
    let resumed = if args.resume { Some(Checkpoint::load(&checkpoint_dir).map_err(Failure::input)?) } else { None };

    let (experiment, data_path) = resolve_experiment(&args, resumed.as_ref())?;
    let vocab = match &resumed {
        Some(c) => Some(serde_json::from_value(c.meta["vocab"].clone()).context("checkpoint has no vocabulary")?),
        None => None,
    };
    let corpus =
        Corpus::load(&data_path, &experiment.tokenizer, vocab, experiment.val_fraction).map_err(Failure::input)?;
    let events = Events::open(net.events.as_deref()).map_err(Failure::input)?;
    let _wandb = crate::observe::wandb::Bridge::start(Some(&experiment), "train");
    let run = Run::prepare(experiment.clone(), corpus, (&args.device, &args.memory), &data_dir, resumed.as_ref())
        .await
        .map_err(Failure::input)?;
    events.emit(ev::Event::MicroBatches(run.micro_batches.clone()));
    let mut sampler = match &resumed {
        Some(c) => {
            let state: SamplerState =
                serde_json::from_value(c.meta["sampler"].clone()).context("checkpoint has no sampler state")?;
            Sampler::resume_with_shape(run.corpus.train.clone(), run.batch, run.block, &state)?
        }
        None => Sampler::new(run.corpus.train.clone(), run.batch, run.block, experiment.seed)?,
    };
    let mut run = run;
    std::fs::create_dir_all(&checkpoint_dir).with_context(|| format!("cannot create {}", checkpoint_dir.display()))?;
    run.corpus.vocab.save(&checkpoint_dir.join("vocab.json"))?;
    let start_step = resumed.as_ref().map_or(0, |c| c.step);
    let total = experiment.steps;
    let tokens_per_step = (run.batch * run.block) as f64;
    // not locked: the progress bar draws on stdout too
    let mut out = std::io::stdout();
    let tty = out.is_terminal();
    writeln!(
        out,
        "training {} ({} parameters) on {} ({} train / {} val tokens, vocab {}), {} steps from step {}",
        run.model.source,
        run.model.params.iter().map(|p| p.ty.elements()).sum::<i64>(),
        data_path.display(),
        run.corpus.train.len(),
        run.corpus.val.len(),
        run.corpus.vocab.size(),
        total,
        start_step
    )?;
    write_split(&mut out, &run.micro_batches)?;
    let mut tokens_per_s = 0.0;
    let bar = crate::observe::progress::bar(total);
    bar.set_position(start_step);
    for step in start_step + 1..=total {
        let lr = learning_rate(step, total, experiment.learning_rate, experiment.min_lr, experiment.warmup_steps);
        let batch = sampler.next_batch();
        let started = Instant::now();
        let loss = run.engine.step(step, lr as f32, &batch).await?;
        // An exponential moving average of the step rate.
        let rate = tokens_per_step / started.elapsed().as_secs_f64().max(1e-9);
        tokens_per_s = if step == start_step + 1 { rate } else { 0.9 * tokens_per_s + 0.1 * rate };
        if !loss.is_finite() {
            return Err(anyhow::anyhow!("loss became {loss} at step {step}; lower the learning rate").into());
        }
        events.emit(ev::Event::Step(ev::Step { step, loss: f64::from(loss), lr, tokens_per_s }));
        if tty {
            bar.set_message(format!("loss {loss:.4} lr {lr:.2e} {:.1}k tok/s", tokens_per_s / 1e3));
            bar.set_position(step);
        } else if step % 50 == 0 || step == total || step == start_step + 1 {
            writeln!(out, "step {step}/{total} loss {loss:.4} lr {lr:.2e} {:.1}k tok/s", tokens_per_s / 1e3)?;
        }
        let eval_due = (experiment.eval_interval > 0 && step % experiment.eval_interval == 0) || step == total;
        if eval_due {
            let val = run.validate(experiment.eval_batches).await?;
            events.emit(ev::Event::Eval(ev::Eval { step, val_loss: val }));
            if tty {
                bar.println(format!("step {step}: val loss {val:.4}"));
            } else {
                writeln!(out, "step {step}: val loss {val:.4}")?;
            }
        }
        let checkpoint_due =
            (experiment.checkpoint_interval > 0 && step % experiment.checkpoint_interval == 0) || step == total;
        if checkpoint_due {
            let path = run.checkpoint(step, &sampler.state()).await?.save(&checkpoint_dir)?;
            events.emit(ev::Event::Checkpoint(ev::Checkpoint {
                step: Some(step),
                round: None,
                path: path.display().to_string(),
            }));
        }
    }
    if start_step >= total {
        // Nothing to train: save the state as it is (for `--steps 0`, the
        // initial parameters, which reference implementations can load).
        let path = run.checkpoint(start_step, &sampler.state()).await?.save(&checkpoint_dir)?;
        events.emit(ev::Event::Checkpoint(ev::Checkpoint {
            step: Some(start_step),
            round: None,
            path: path.display().to_string(),
        }));
    }
    bar.finish();
    run.experiment = experiment;
    writeln!(out, "done: checkpoints in {}", checkpoint_dir.display())?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedule_warms_up_then_decays() {
        assert!((learning_rate(1, 100, 1.0, 0.1, 10) - 0.1).abs() < 1e-12);
        assert!((learning_rate(10, 100, 1.0, 0.1, 10) - 1.0).abs() < 1e-12);
        assert!((learning_rate(100, 100, 1.0, 0.1, 10) - 0.1).abs() < 1e-12);
        let mid = learning_rate(55, 100, 1.0, 0.1, 10);
        assert!((mid - 0.55).abs() < 1e-9, "{mid}");
    }

    /// gpt2-124m's batch of 8 × 1024 on small devices. By default (fused attention,
    /// `elementwise` recomputation) the whole batch fits 8 GB; with 5 GB free it is
    /// split. A run that keeps every activation (`none`) needs micro-batches on 8 GB,
    /// and with plenty free, neither.
    #[test]
    fn gpt2_on_small_devices_gets_micro_batches_or_recomputation() -> anyhow::Result<()> {
        let model = Model::load_with_batch("gpt2-124m", 65, None)?;
        let device = DeviceArgs { backend: "vulkan".into(), target: None };
        let plan = |experiment: &Experiment, free: u64| {
            plan_micro_batches(
                experiment,
                &model,
                65,
                &MemoryArgs { free_memory: Some(free), micro_batch: None },
                &device,
            )
        };
        let default = Experiment { model: Some("gpt2-124m".into()), ..Experiment::default() };
        let eight = plan(&default, 8_000_000_000)?;
        assert_eq!((eight.batch, eight.free_from.as_str()), (8, "flag"));
        // 3.1 GB of state and 3.0 GB of kept activations (× 1.25 for IREE's transients)
        assert_eq!((eight.recompute.as_str(), eight.micro_batches), ("elementwise", 1), "{eight:?}");
        assert!(eight.estimate_bytes <= 7_200_000_000, "{eight:?}");
        let five = plan(&default, 5_000_000_000)?;
        assert!(five.micro_batches > 1, "{five:?}");
        assert_eq!(five.micro_batch * five.micro_batches, 8);
        assert!(five.estimate_bytes <= 4_500_000_000, "{five:?}");
        // keeping everything: 9.1 GB of activations at batch 8, so it is split on 8 GB
        let none = Experiment { recompute: "none".into(), ..default.clone() };
        let eight = plan(&none, 8_000_000_000)?;
        assert_eq!((eight.recompute.as_str(), eight.micro_batches, eight.micro_batch), ("none", 4, 2), "{eight:?}");
        let large = plan(&none, 200_000_000_000)?;
        assert_eq!((large.micro_batches, large.recompute.as_str()), (1, "none"), "{large:?}");
        // on a GPU whose free memory is unknown, the whole batch
        let unknown = plan_micro_batches(&default, &model, 65, &MemoryArgs::default(), &device)?;
        assert_eq!((unknown.micro_batches, unknown.free_from.as_str()), (1, "unknown"));
        Ok(())
    }
}
