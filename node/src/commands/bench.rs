//! `pcp-node bench …`: benchmarks.

mod aggregate;
mod blob;
mod gpu_plan;
mod screen;
mod step;

use crate::Failure;
use crate::commands::join::{DataDirArg, NetFlags, Uses};

#[derive(Debug, clap::Subcommand)]
pub(crate) enum BenchCommand {
    /// Tokens per second and peak RSS of the fused training step.
    Step {
        #[command(flatten)]
        args: step::StepArgs,
        #[command(flatten)]
        data_dir: DataDirArg,
    },
    /// Blob transfer throughput between two nodes vs raw TCP loopback.
    Blob(blob::BlobArgs),
    /// Decode, validate and add of contributions at the shepherd: seconds per contribution and peak RSS.
    Aggregate(aggregate::AggregateArgs),
    /// A GPU step's dispatches with their work, bytes, roofline time and matrix-instruction
    /// use, from IREE's compile for the target (no GPU needed).
    GpuPlan(gpu_plan::GpuPlanArgs),
    /// One contribution's screen in its parts: made dense, uploaded, three forward passes.
    Screen {
        #[command(flatten)]
        args: screen::ScreenArgs,
        #[command(flatten)]
        data_dir: DataDirArg,
    },
}

/// `root` holds the flags given before `bench`.
pub(crate) async fn run(command: BenchCommand, root: &NetFlags) -> Result<(), Failure> {
    match command {
        BenchCommand::Step { args, data_dir } => {
            step::run(args, &root.resolve(data_dir.into(), "bench step", Uses::DataDir)?).await
        }
        BenchCommand::Blob(args) => {
            root.resolve(NetFlags::default(), "bench blob", Uses::Nothing)?;
            Ok(blob::run(&args).await?)
        }
        BenchCommand::Aggregate(args) => {
            root.resolve(NetFlags::default(), "bench aggregate", Uses::Nothing)?;
            aggregate::run(&args)
        }
        BenchCommand::Screen { args, data_dir } => {
            screen::run(args, &root.resolve(data_dir.into(), "bench screen", Uses::DataDir)?).await
        }
        BenchCommand::GpuPlan(args) => {
            root.resolve(NetFlags::default(), "bench gpu-plan", Uses::Nothing)?;
            gpu_plan::run(&args)
        }
    }
}
