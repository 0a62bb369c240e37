//! `pcp-node bench step`: throughput and memory of the fused training step.

use std::io::Write as _;
use std::path::PathBuf;
use std::time::Instant;

use crate::Failure;
use crate::commands::join::NetArgs;
use crate::commands::train::{Corpus, DeviceArgs, MemoryArgs, default_corpus, load_engine, plan_micro_batches};
use crate::training::config::Experiment;
use crate::training::data::{Sampler, Tokens};
use crate::training::model::Model;

/// Tokens per second and peak RSS of the fused training step.
#[derive(Debug, clap::Args)]
pub(crate) struct StepArgs {
    /// nanogpt-small, nanogpt-medium or a .mlir loss module.
    #[arg(long, default_value = "nanogpt-small")]
    model: String,
    /// Timed steps (after 3 warmup steps).
    #[arg(long, default_value_t = 50)]
    steps: u64,
    /// The corpus [default: the demo corpus].
    #[arg(long)]
    data: Option<PathBuf>,
    /// Sequences per batch (presets only) [default: the preset's].
    #[arg(long)]
    batch: Option<usize>,
    /// f32, or bf16: matmuls and attention in bf16, weights, AdamW state and loss in f32.
    #[arg(long, default_value = "f32")]
    precision: String,
    /// Activations the backward recomputes: none, attention, elementwise (the default) or blocks.
    #[arg(long, default_value = "elementwise")]
    recompute: String,
    /// fused (one op per attention, a flash-style backward) or naive (the model's ops).
    #[arg(long, default_value = "fused")]
    attention: String,
    #[command(flatten)]
    memory: MemoryArgs,
    #[command(flatten)]
    device: DeviceArgs,
}

pub(crate) async fn run(args: StepArgs, net: &NetArgs) -> Result<(), Failure> {
    let mut experiment =
        Experiment { model: Some(args.model.clone()), batch_size: args.batch, ..Experiment::default() };
    experiment.set_precision(Some(&args.precision)).map_err(Failure::input)?;
    experiment.set_recompute(Some(&args.recompute)).map_err(Failure::input)?;
    experiment.set_attention(Some(&args.attention)).map_err(Failure::input)?;
    step(experiment, args.steps, args.data, net.data_dir.clone(), (args.device, args.memory)).await
}

const GIB: f64 = 1024.0 * 1024.0 * 1024.0;

/// Peak resident set size in bytes, from /proc.
fn peak_rss() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

async fn step(
    experiment: Experiment,
    steps: u64,
    data: Option<PathBuf>,
    data_dir: PathBuf,
    (device, memory): (DeviceArgs, MemoryArgs),
) -> Result<(), Failure> {
    let corpus = match data.or_else(default_corpus) {
        Some(path) => Some(Corpus::load(&path, "char", None, 0.1).map_err(Failure::input)?),
        None => None,
    };
    let source = experiment.model.clone().unwrap_or_default();
    let vocab_size = corpus.as_ref().map_or(65, |c| c.vocab.size());
    let mut model = Model::load_with_batch(&source, vocab_size, experiment.batch_size).map_err(Failure::input)?;
    let (batch, block) = model.batch_block()?;
    let plan = plan_micro_batches(&experiment, &model, vocab_size, &memory, &device)?;
    let k = plan.micro_batches as usize;
    if k > 1 {
        model = Model::load_with_batch(&source, vocab_size, Some(batch / k)).map_err(Failure::input)?;
    }
    let started = Instant::now();
    let mut engine = load_engine(&experiment, &model, &device, &data_dir, None, k).await.map_err(Failure::input)?;
    let load_seconds = started.elapsed().as_secs_f64();
    let split = match &corpus {
        Some(c) => c.train.clone(),
        None => Tokens::from_vec((0..100_000u32).map(|i| (i * 7919 % vocab_size as u32) as u16).collect(), "synthetic")
            .all(),
    };
    let mut sampler = Sampler::new(split, batch, block, 1)?;
    let mut out = std::io::stdout().lock();
    for s in 1..=3 {
        engine.step(s, 1e-3, &sampler.next_batch()).await?;
    }
    let timer = Instant::now();
    let mut loss = 0.0;
    for s in 4..4 + steps {
        loss = engine.step(s, 1e-3, &sampler.next_batch()).await?;
    }
    let seconds = timer.elapsed().as_secs_f64();
    let tokens = (batch * block) as f64 * steps as f64;
    let params: i64 = model.params.iter().map(|p| p.ty.elements()).sum();
    let state_bytes = params as f64 * 4.0 * 3.0;
    let forward = pcp_graph::autodiff::inline_calls(&model.module, "main")?;
    let activations: f64 = forward
        .ops
        .iter()
        .flat_map(|op| op.results.iter())
        .map(|r| forward.ty(*r))
        .filter_map(|t| t.element.float().map(|f| (t.elements() as usize * f.bytes()) as f64))
        .sum();
    let rss = peak_rss().map_or(f64::NAN, |b| b as f64);
    writeln!(
        out,
        "model        {source} ({params} parameters, batch {batch} x block {block}, {} matmuls, recompute {}, attention {})",
        experiment.precision, experiment.recompute, experiment.attention
    )?;
    let cache = match plan.cache_bytes {
        0 => String::new(),
        bytes => format!("; sized to the cpu's {} KiB of L2", bytes >> 10),
    };
    writeln!(
        out,
        "micro-batches {k} of {} sequences (free {:.2} GiB from {}; expected peak {:.2} GiB per micro-batch{cache})",
        batch / k,
        plan.free_bytes as f64 / GIB,
        plan.free_from,
        plan.estimate_bytes as f64 / GIB
    )?;
    writeln!(out, "setup        {load_seconds:.1} s (build, compile or cache hit, load)")?;
    writeln!(
        out,
        "steps        {steps} in {seconds:.2} s, {:.2} ms/step, last loss {loss:.4}",
        1e3 * seconds / steps.max(1) as f64
    )?;
    writeln!(out, "tokens/s     {:.0}", tokens / seconds)?;
    writeln!(out, "peak RSS     {:.1} MiB", rss / 1048576.0)?;
    writeln!(
        out,
        "state        params+AdamW {:.1} MiB, forward activations {:.1} MiB; RSS/(state+activations) = {:.2}",
        state_bytes / 1048576.0,
        activations / 1048576.0,
        rss / (state_bytes + activations)
    )?;
    Ok(())
}
