//! `pcp-node graph …`: model import, inspection and differentiation.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::Context as _;
use clap::Subcommand;

use crate::Failure;

#[derive(Debug, Subcommand)]
pub(crate) enum GraphCommand {
    /// Print a model's signature, parameter count, data inputs, op histogram
    /// and any ops without a gradient rule.
    Inspect {
        /// A StableHLO module (`.mlir`), or a preset (`nanogpt-small`, `nanogpt-medium`, `gpt2-124m`,
        /// built for the demo corpus's 65 characters).
        model: PathBuf,
        /// The loss function.
        #[arg(long, default_value = "main")]
        entry: String,
    },
    /// Write a module whose `@<entry>_grad` returns the loss and one gradient
    /// per floating-point argument.
    Grad {
        /// A StableHLO module (`.mlir`), or a preset (`nanogpt-small`, `nanogpt-medium`, `gpt2-124m`,
        /// built for the demo corpus's 65 characters).
        model: PathBuf,
        /// The loss function.
        #[arg(long, default_value = "main")]
        entry: String,
        /// Where to write the differentiated module.
        #[arg(short, long)]
        output: PathBuf,
        /// fused (one op, a flash-style backward that recomputes the probabilities) or
        /// naive (the module's own ops, the `T × T` probabilities kept).
        #[arg(long, default_value = "fused")]
        attention: String,
    },
    /// Write the fused training module: `train_step`, `eval_loss` (and
    /// `logits` when the model has one).
    Step {
        /// A StableHLO module (`.mlir`), or a preset (`nanogpt-small`, `nanogpt-medium`, `gpt2-124m`,
        /// built for the demo corpus's 65 characters).
        model: PathBuf,
        /// The loss function.
        #[arg(long, default_value = "main")]
        entry: String,
        /// Where to write the module.
        #[arg(short, long)]
        output: PathBuf,
        #[command(flatten)]
        optimizer: OptimizerArgs,
        /// Write the micro-batch module a node runs when it accumulates gradients
        /// (`grad_step` and `apply_step` in place of `train_step`), for micro-batches of
        /// this many sequences (presets only).
        #[arg(long, value_name = "SEQUENCES")]
        micro_batch: Option<usize>,
        /// Sequences per batch of a preset (default: the preset's).
        #[arg(long)]
        batch: Option<usize>,
    },
    /// Compile a model to a VMFB for one backend and target, as a shepherd does for
    /// the workers that announce them: the training module (`train_step`,
    /// `eval_loss`, `logits`) by default, or the gradient module (`--module grad`).
    Compile {
        /// A StableHLO module (`.mlir`), or a preset (`nanogpt-small`, `nanogpt-medium`, `gpt2-124m`,
        /// `gpt2-124m`).
        model: PathBuf,
        /// The loss function.
        #[arg(long, default_value = "main")]
        entry: String,
        /// cpu, cuda, rocm, vulkan or metal.
        #[arg(long, default_value = "cpu")]
        backend: String,
        /// The device: `sm_80`, `h100`, `gfx942`, `mi300x`, `rdna3`, an LLVM CPU name, …
        /// (an unknown name lists the accepted ones).
        #[arg(long)]
        target: Option<String>,
        /// `step` (the fused training module) or `grad` (`@main` and `@main_grad`).
        #[arg(long, default_value = "step", value_parser = ["step", "grad"])]
        module: String,
        /// Where to write the VMFB.
        #[arg(short, long)]
        output: PathBuf,
        /// Cache compiled artifacts here (as a shepherd does); none by default.
        #[arg(long)]
        cache: Option<PathBuf>,
        #[command(flatten)]
        optimizer: OptimizerArgs,
        /// Compile the micro-batch module a node runs when it accumulates gradients
        /// (`grad_step` and `apply_step` in place of `train_step`), for micro-batches of
        /// this many sequences (presets only; the step module only).
        #[arg(long, value_name = "SEQUENCES")]
        micro_batch: Option<usize>,
        /// Sequences per batch of a preset (default: the preset's).
        #[arg(long)]
        batch: Option<usize>,
    },
}

/// Inner optimizer settings.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct OptimizerArgs {
    /// adamw or sgd.
    #[arg(long, default_value = "adamw")]
    pub(crate) optimizer: String,
    /// AdamW β1.
    #[arg(long, default_value_t = 0.9)]
    pub(crate) beta1: f64,
    /// AdamW β2.
    #[arg(long, default_value_t = 0.95)]
    pub(crate) beta2: f64,
    /// AdamW ε.
    #[arg(long, default_value_t = 1e-8)]
    pub(crate) eps: f64,
    /// Weight decay (decoupled for AdamW), on parameters of rank ≥ 2.
    #[arg(long, default_value_t = 0.1)]
    pub(crate) weight_decay: f64,
    /// SGD momentum.
    #[arg(long, default_value_t = 0.9)]
    pub(crate) momentum: f64,
    /// Clip gradients to this global L2 norm.
    #[arg(long)]
    pub(crate) clip_norm: Option<f64>,
    /// f32, or bf16: matmuls and attention in bf16, weights, optimizer state and loss in f32.
    #[arg(long, default_value = "f32")]
    pub(crate) precision: String,
    /// Activations the backward recomputes instead of keeping: none, attention, elementwise
    /// (the default) or blocks.
    #[arg(long, default_value = "elementwise")]
    pub(crate) recompute: String,
    /// fused (one op per attention, a flash-style backward) or naive (the model's ops).
    #[arg(long, default_value = "fused")]
    pub(crate) attention: String,
    /// Also build `eval_sparse`, which screens contributions in this top-k sparse encoding
    /// (`sparse`, `sparse:chunk=N,k=N,…`), as a run in it builds its step.
    #[arg(long, value_parser = pcp_protocol::diloco::compress::Encoding::parse_spec)]
    pub(crate) screen_encoding: Option<pcp_protocol::diloco::compress::Encoding>,
}

impl OptimizerArgs {
    pub(crate) fn config(&self) -> anyhow::Result<pcp_graph::StepConfig> {
        let optimizer = match self.optimizer.as_str() {
            "adamw" => pcp_graph::Optimizer::AdamW {
                beta1: self.beta1,
                beta2: self.beta2,
                eps: self.eps,
                weight_decay: self.weight_decay,
            },
            "sgd" => pcp_graph::Optimizer::Sgd { momentum: self.momentum, weight_decay: self.weight_decay },
            other => anyhow::bail!("unknown optimizer {other:?}; expected adamw or sgd"),
        };
        let precision = self.precision.parse()?;
        let recompute = self.recompute.parse()?;
        let attention = self.attention.parse()?;
        Ok(pcp_graph::StepConfig {
            optimizer,
            clip_norm: self.clip_norm,
            precision,
            recompute,
            accumulate: false,
            attention,
            sparse_screen: self.screen_encoding.and_then(crate::diloco::wire::sparse_screen),
        })
    }
}

/// The step's settings; a micro-batch module (`micro_batch`) accumulates gradients.
fn step_config(optimizer: &OptimizerArgs, micro_batch: Option<usize>) -> Result<pcp_graph::StepConfig, Failure> {
    if micro_batch == Some(0) {
        return Err(Failure::input(anyhow::anyhow!("--micro-batch must be at least 1 sequence")));
    }
    let config = optimizer.config().map_err(Failure::input)?;
    Ok(pcp_graph::StepConfig { accumulate: micro_batch.is_some(), ..config })
}

/// Imports `model`, or builds it when it names a preset (with the preset's vocabulary,
/// the demo corpus's 65 characters).
fn load(model: &Path) -> Result<pcp_graph::Module, Failure> {
    load_batch(model, None)
}

/// [`load`], with `batch` sequences per batch for a preset (an imported module's batch
/// is its own, so `batch` is refused for one).
pub(crate) fn load_batch(model: &Path, batch: Option<usize>) -> Result<pcp_graph::Module, Failure> {
    if let Some(config) = model.to_str().and_then(pcp_graph::models::preset) {
        // as `train` builds it for the demo corpus (65 characters)
        let config = config.with_vocab_size(65);
        let config = pcp_graph::NanoGptConfig { batch_size: batch.unwrap_or(config.batch_size), ..config };
        let built = pcp_graph::models::nanogpt(&config).map_err(Failure::input)?;
        return Ok(built.module);
    }
    if batch.is_some() {
        return Err(Failure::input(anyhow::anyhow!(
            "{}: --batch and --micro-batch apply to presets only (an imported module's batch is its own)",
            model.display()
        )));
    }
    pcp_graph::import_file(model).map_err(Failure::input)
}

/// The sequences a preset's module is built for: the micro-batch's, else `--batch`'s.
fn sequences(micro_batch: Option<usize>, batch: Option<usize>) -> Result<Option<usize>, Failure> {
    match (micro_batch, batch) {
        (Some(_), Some(_)) => Err(Failure::input(anyhow::anyhow!("--batch and --micro-batch exclude each other"))),
        (_, Some(0)) => Err(Failure::input(anyhow::anyhow!("--batch must be at least 1 sequence"))),
        (m, b) => Ok(m.or(b)),
    }
}

pub(crate) fn run(command: GraphCommand) -> Result<(), Failure> {
    let mut stdout = std::io::stdout().lock();
    match command {
        GraphCommand::Inspect { model, entry } => {
            let module = load(&model)?;
            let report = pcp_graph::inspect::inspect(&module, &entry)
                .map_err(|e| Failure::input(anyhow::anyhow!("{}: {e}", model.display())))?;
            writeln!(stdout, "model       {}", model.display())?;
            write!(stdout, "{report}")?;
        }
        GraphCommand::Grad { model, entry, output, attention } => {
            let attention: pcp_graph::Attention = attention.parse().map_err(Failure::input)?;
            let start = Instant::now();
            let module = load(&model)?;
            let imported = start.elapsed();
            let gradient = pcp_graph::autodiff::differentiate_with(&module, &entry, attention)
                .map_err(|e| Failure::input(anyhow::anyhow!("{}: {e}", model.display())))?;
            let text = gradient.module.to_mlir();
            pcp_graph::import::verify(&output.display().to_string(), &gradient.module)
                .context("internal error: the generated module does not verify")?;
            let total = start.elapsed();
            std::fs::write(&output, text).with_context(|| format!("cannot write {}", output.display()))?;
            writeln!(
                stdout,
                "wrote {}: @{entry}_grad returns the loss and {} gradients ({} parameters)",
                output.display(),
                gradient.signature.params.len(),
                gradient.signature.parameter_count()
            )?;
            writeln!(
                stdout,
                "ops: forward {}, gradient {} ({:.2}x); import {:.3} s, total {:.3} s",
                gradient.forward_ops,
                gradient.gradient_ops,
                gradient.gradient_ops as f64 / gradient.forward_ops.max(1) as f64,
                imported.as_secs_f64(),
                total.as_secs_f64()
            )?;
        }
        GraphCommand::Step { model, entry, output, optimizer, micro_batch, batch } => {
            let config = step_config(&optimizer, micro_batch)?;
            let module = load_batch(&model, sequences(micro_batch, batch)?)?;
            let step = pcp_graph::train_step(&module, &entry, &config)
                .map_err(|e| Failure::input(anyhow::anyhow!("{}: {e}", model.display())))?;
            pcp_graph::import::verify(&output.display().to_string(), &step.module)
                .context("internal error: the generated module does not verify")?;
            std::fs::write(&output, step.module.to_mlir())
                .with_context(|| format!("cannot write {}", output.display()))?;
            let functions: Vec<String> = step.module.functions.iter().map(|f| format!("@{}", f.name)).collect();
            writeln!(
                stdout,
                "wrote {}: {} ({} parameters, {} optimizer state tensors each; {:.1} MiB of activations kept for the backward, recompute {})",
                output.display(),
                functions.join(", "),
                step.signature.params.len(),
                step.state_per_param,
                step.saved_activation_bytes as f64 / 1048576.0,
                config.recompute
            )?;
        }
        GraphCommand::Compile {
            model,
            entry,
            backend,
            target,
            module,
            output,
            cache,
            optimizer,
            micro_batch,
            batch,
        } => {
            let backend: pcp_graph::Backend = backend.parse().map_err(Failure::input)?;
            let target = pcp_graph::Target::parse(backend, target.as_deref()).map_err(Failure::input)?;
            if module == "grad" && micro_batch.is_some() {
                return Err(Failure::input(anyhow::anyhow!(
                    "--micro-batch applies to the step module, not --module grad"
                )));
            }
            let loaded = load_batch(&model, sequences(micro_batch, batch)?)?;
            let built = if module == "grad" {
                pcp_graph::differentiate(&loaded, &entry).map(|g| g.module)
            } else {
                let config = step_config(&optimizer, micro_batch)?;
                pcp_graph::train_step(&loaded, &entry, &config).map(|s| s.module)
            }
            .map_err(|e| Failure::input(anyhow::anyhow!("{}: {e}", model.display())))?;
            if let Some(note) = target.note() {
                writeln!(stdout, "note: {note}")?;
            }
            let start = Instant::now();
            let artifact = pcp_graph::compile(&built, &target, cache.as_deref())?;
            let seconds = start.elapsed().as_secs_f64();
            std::fs::write(&output, &artifact.vmfb).with_context(|| format!("cannot write {}", output.display()))?;
            let functions: Vec<String> = built.functions.iter().map(|f| format!("@{}", f.name)).collect();
            writeln!(
                stdout,
                "wrote {}: {} for {target}, {:.2} MB, compiled in {seconds:.1} s{}",
                output.display(),
                functions.join(", "),
                artifact.vmfb.len() as f64 / 1e6,
                if artifact.cached { " (cached)" } else { "" }
            )?;
            writeln!(stdout, "flags: {}", artifact.flags.join(" "))?;
        }
    }
    Ok(())
}
