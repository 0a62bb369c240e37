//! `pcp-node graph …`: model import, inspection and differentiation.

use std::io::Write as _;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context as _;
use clap::Subcommand;

use crate::Failure;

#[derive(Debug, Subcommand)]
pub(crate) enum GraphCommand {
    /// Print a model's signature, parameter count, data inputs, op histogram
    /// and any ops without a gradient rule.
    Inspect {
        /// A StableHLO module (`.mlir`).
        model: PathBuf,
        /// The loss function.
        #[arg(long, default_value = "main")]
        entry: String,
    },
    /// Write a module whose `@<entry>_grad` returns the loss and one gradient
    /// per floating-point argument.
    Grad {
        /// A StableHLO module (`.mlir`).
        model: PathBuf,
        /// The loss function.
        #[arg(long, default_value = "main")]
        entry: String,
        /// Where to write the differentiated module.
        #[arg(short, long)]
        output: PathBuf,
    },
}

pub(crate) fn run(command: GraphCommand) -> Result<(), Failure> {
    let mut stdout = std::io::stdout().lock();
    match command {
        GraphCommand::Inspect { model, entry } => {
            let module = pcp_graph::import_file(&model).map_err(Failure::input)?;
            let report = pcp_graph::inspect::inspect(&module, &entry)
                .map_err(|e| Failure::input(anyhow::anyhow!("{}: {e}", model.display())))?;
            writeln!(stdout, "model       {}", model.display())?;
            write!(stdout, "{report}")?;
        }
        GraphCommand::Grad { model, entry, output } => {
            let start = Instant::now();
            let module = pcp_graph::import_file(&model).map_err(Failure::input)?;
            let imported = start.elapsed();
            let gradient = pcp_graph::differentiate(&module, &entry)
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
    }
    Ok(())
}
