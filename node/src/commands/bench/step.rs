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
    /// Timed steps (after 3 warmup steps; 0: no step, only the forward passes).
    #[arg(long, default_value_t = 50)]
    steps: u64,
    /// Timed forward passes of a batch (after one warmup pass): the loss alone, as the
    /// shepherd's screen and validation run it.
    #[arg(long, default_value_t = 3)]
    forwards: u64,
    /// The preset's vocabulary, when larger than the corpus's (gpt2-124m's 50257 on a
    /// character corpus): the extra rows are never a target [default: the corpus's].
    #[arg(long)]
    vocab: Option<usize>,
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
    experiment.vocab_size = args.vocab;
    let counts = Counts { steps: args.steps, forwards: args.forwards };
    step(experiment, counts, args.data, net.data_dir.clone(), (args.device, args.memory)).await
}

const GIB: f64 = 1024.0 * 1024.0 * 1024.0;

/// Peak resident set size in bytes, from /proc.
fn peak_rss() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// What to time.
#[derive(Clone, Copy, Debug)]
struct Counts {
    steps: u64,
    forwards: u64,
}

async fn step(
    experiment: Experiment,
    Counts { steps, forwards }: Counts,
    data: Option<PathBuf>,
    data_dir: PathBuf,
    (device, memory): (DeviceArgs, MemoryArgs),
) -> Result<(), Failure> {
    let corpus = match data.or_else(default_corpus) {
        Some(path) => Some(Corpus::load(&path, "char", None, 0.1).map_err(Failure::input)?),
        None => None,
    };
    let source = experiment.model.clone().unwrap_or_default();
    let corpus_vocab = corpus.as_ref().map_or(65, |c| c.vocab.size());
    let vocab_size = match experiment.vocab_size {
        Some(v) if v < corpus_vocab => {
            return Err(Failure::input(anyhow::anyhow!(
                "--vocab {v} is smaller than the corpus's vocabulary of {corpus_vocab}"
            )));
        }
        Some(v) => v,
        None => corpus_vocab,
    };
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
    let warmup = if steps == 0 { 0 } else { 3 };
    for s in 1..=warmup {
        engine.step(s, 1e-3, &sampler.next_batch()).await?;
    }
    let timer = Instant::now();
    let mut loss = 0.0;
    for s in 4..4 + steps {
        loss = engine.step(s, 1e-3, &sampler.next_batch()).await?;
    }
    let seconds = timer.elapsed().as_secs_f64();
    let forward_s = time_forwards(&mut engine, &mut sampler, forwards).await?;
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
    if steps > 0 {
        writeln!(
            out,
            "steps        {steps} in {seconds:.2} s, {:.2} ms/step, last loss {loss:.4}",
            1e3 * seconds / steps as f64
        )?;
        writeln!(out, "tokens/s     {:.0}", tokens / seconds)?;
    }
    if let Some(pass_s) = forward_s {
        let flops = pcp_graph::models::preset(&source)
            .map(|c| forward_flops(params as f64, &c.with_vocab_size(vocab_size), batch * block));
        let rate = flops.map_or(String::new(), |f| {
            format!(
                ", {:.1} GFLOP/s (the simulator's count: 2 x matmul params x tokens + 2 x layers x context x width x tokens)",
                f / pass_s / 1e9
            )
        });
        writeln!(out, "forward      {forwards} passes, {:.1} ms/pass{rate}", 1e3 * pass_s)?;
    }
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

/// Seconds of one forward pass (the loss of a batch), the median of `n` after one
/// warmup pass; `None` when `n` is 0.
async fn time_forwards(
    engine: &mut crate::training::engine::Engine,
    sampler: &mut Sampler,
    n: u64,
) -> anyhow::Result<Option<f64>> {
    if n == 0 {
        return Ok(None);
    }
    let batch = sampler.next_batch();
    engine.eval(&batch).await?;
    let mut passes = Vec::new();
    for _ in 0..n {
        let timer = Instant::now();
        engine.eval(&batch).await?;
        passes.push(timer.elapsed().as_secs_f64());
    }
    passes.sort_by(f64::total_cmp);
    Ok(Some(passes[passes.len() / 2]))
}

/// A forward pass's FLOPs, as the simulator counts them (a third of Kaplan et al.'s
/// training FLOPs): `2 × params × tokens` for the matmuls, `2 × layers × context ×
/// width × tokens` for attention's score and value products. The presets' head is
/// untied: their token embedding, a lookup, is left out, and the head's matmul
/// stands for it, as in the simulator's tied gpt2-124m.
fn forward_flops(params: f64, config: &pcp_graph::models::NanoGptConfig, tokens: usize) -> f64 {
    let matmul = params - (config.vocab_size * config.n_embd) as f64;
    let attention = (config.n_layer * config.block_size * config.n_embd) as f64;
    2.0 * matmul * tokens as f64 + 2.0 * attention * tokens as f64
}
